"""Everything a run's configuration must satisfy, checked before JAX starts.

Each field on its own (``config.check_fields``), the combinations of flags, the rules of
the library itself (``sparsecomm_jax.strategies.build``: what may be combined, asked of
the library and told in flags), the model's own fields, the data file, the resources of
this machine and every location the run writes. A failure is a ``ValueError`` whose
message names the flag: ``experiments.train`` prints it as one line (exit status 2).

Example:
    >>> from experiments.train.config import RunConfig
    >>> from experiments.train.validate import validate
    >>> validate(RunConfig(strategy="embrace", optimizer="sgd"))
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from pathlib import Path
from typing import Any

from experiments.train import histogram
from experiments.train.config import RunConfig, check_fields
from models import MODELS, config_fields
from sparsecomm_jax import STRATEGIES, distributed, optimizers, parse_strategy
from sparsecomm_jax.embedding import update
from sparsecomm_jax.errors import NO_VALUE, ArgumentError, Call, clipped, python_words
from sparsecomm_jax.strategies.rules import check_replicas, check_table_update

# XLA's CPU backend runs a collective on a pool of at most 256 threads, one per
# participating device: more simulated devices in one process deadlock, then abort.
MAX_PROCESS_DEVICES = 256


def validate(config: RunConfig) -> None:
    """Checks a config before JAX starts; raises ``ValueError`` naming the bad flag."""
    check_fields(config)
    check_library_rules(config)
    _check_combinations(config)
    _check_model_fields(config)
    _check_text_file(config)
    histogram.check_flags(config)
    _check_resources(config)


# --------------------------------------------------------- the library's rules


# Library arguments that a flag of another name sets (the others: --name-with-dashes).
ARGUMENT_FLAGS = {"num_devices": "devices", "table_layouts": "plan"}


def flag_words(argument: str, value: Any) -> str:
    """A library argument as the command line says it (``errors.ArgumentError.render``):
    ``table_update='rows'`` -> ``--table-update rows``, ``num_devices=4`` -> ``--devices
    4``; a call the command line makes for the user (``runtime.simulate_cpu_devices(8)``)
    -> ``pass --devices 8``; an argument no flag sets, in Python's words."""
    if isinstance(value, Call):
        return f"pass {flag_words(value.argument, value.value)}"
    name = ARGUMENT_FLAGS.get(argument, argument)
    if name not in {f.name for f in dataclasses.fields(RunConfig)}:
        return python_words(argument, value)
    flag = "--" + name.replace("_", "-")
    return flag if value is NO_VALUE else f"{flag} {clipped(str(value))}"


def in_flags(error: Exception) -> Exception:
    """A library error as the command line tells it: an ``ArgumentError`` in flags
    (``flag_words``), any other as it is."""
    return ValueError(error.render(flag_words)) if isinstance(error, ArgumentError) else error


def table_update_of(config: RunConfig) -> str:
    """The table update of ``--table-update``: ``auto`` is ``rows`` when the strategy
    and ``--optimizer`` allow it (``Optimizer.rows``: an optimizer the row-sparse
    update is exact for, or one defined on rows); ``ValueError`` for what the command
    line does not offer."""
    strategy = parse_strategy(config.strategy).strategy
    optimizer = optimizers.get(config.optimizer)
    rows = config.table_update == "rows" or (
        config.table_update == "auto" and strategy.row_updates and optimizer.rows is not None
    )
    if rows and optimizer.rows is None:
        exact = [o.name for o in optimizers.OPTIMIZERS.values() if o.rows]
        raise ValueError(
            f"--optimizer {config.optimizer} has no row-sparse table update here; use "
            f"--table-update dense or one of {exact}"
        )
    if optimizer.rows == "lazy" and not rows:
        rows_strategies = [n for n, s in STRATEGIES.items() if s.row_updates]
        raise ValueError(
            f"--optimizer {config.optimizer} is a row-sparse table update: use it with "
            f"--table-update auto or rows and a strategy among {rows_strategies}"
        )
    return "rows" if rows else "dense"


def check_library_rules(config: RunConfig) -> None:
    """The library's own checks of the strategy, table update and wire dtype, their
    message told in flags."""
    try:
        name = parse_strategy(config.strategy)
        check_table_update(name, update.get(table_update_of(config)), config.comm_dtype)
        if config.devices:  # 0: every device of the job, known once JAX starts
            check_replicas(name, config.replicas, config.devices, "auto")
    except ArgumentError as e:
        raise in_flags(e) from None


# ------------------------------------------------------------- the command line


def _check_combinations(config: RunConfig) -> None:
    if config.devices and config.batch % config.devices:
        raise ValueError(f"--batch {config.batch} is not divisible by --devices {config.devices}")
    if (config.resume or config.checkpoint_every) and not config.checkpoint_dir:
        raise ValueError("--resume and --checkpoint-every need --checkpoint-dir")
    if config.resume_step and not config.resume:
        raise ValueError("--resume-step needs --resume")
    if config.resume and config.overwrite:
        raise ValueError(
            "--resume continues the folder's run, --overwrite replaces it: pass one of them"
        )
    if config.replicas > 1 and config.overlap:
        raise ValueError(
            f"--replicas {config.replicas}: --overlap is built for one group of every "
            "device; leave out --overlap (embrace_2d pipelines its steps without it) or "
            "--replicas"
        )
    if config.replicas > 1 and config.plan in ("auto", "model"):
        raise ValueError(
            f"--replicas {config.replicas}: --plan {config.plan} is built for one group of "
            "every device; with replica groups give a plan by hand (--plan '{...}') or "
            "leave it out"
        )
    if config.overlap:
        _check_overlap(config)
    if config.steps_per_call > 1:
        _check_steps_per_call(config)
    if config.plan and not parse_strategy(config.strategy).strategy.any_layout:
        mixed = [n for n, s in STRATEGIES.items() if s.any_layout]
        raise ValueError(
            f"--plan places each table by its own layout: use a strategy among {mixed}, "
            f"not --strategy {config.strategy}"
        )


def one_step_a_call(config: RunConfig, platform: str | None = None) -> str:
    """Why ``config.strategy`` runs one step a call, or ``""`` when one call can run
    several of its steps (``Strategy.several_a_call``: scanned, or a pipelined step
    unrolled): only ``jax.pmap``'s cannot. ``platform``: the devices' platform, once JAX
    has started (``--collectives-overlap auto`` pipelines a strategy with a ``serial``
    form, ``embrace_2d``, off CPUs); before, only ``yes`` is known."""
    strategy = parse_strategy(config.strategy).strategy
    overlap = config.collectives_overlap == "yes" or (
        config.collectives_overlap == "auto" and platform not in (None, "cpu")
    )
    runs = strategy.serial if strategy.serial is not None and not overlap else strategy
    if not runs.several_a_call:
        return f"runs one step a call ({runs.why_one_step_a_call()})"
    return ""


def _check_steps_per_call(config: RunConfig) -> None:
    """Several steps a call need a step one call can repeat (``one_step_a_call``)."""
    if why := one_step_a_call(config):
        raise ValueError(
            f"--steps-per-call {config.steps_per_call}: --strategy {config.strategy} {why}"
        )


def _check_overlap(config: RunConfig) -> None:
    """``--overlap`` runs its own loop: ``embrace_2d`` alone, nothing it does not record."""
    if not parse_strategy(config.strategy).strategy.across_steps:
        across = " or ".join(n for n, s in STRATEGIES.items() if s.across_steps)
        raise ValueError(f"--overlap runs {across} across steps: give --strategy {across}")
    for name in ("checkpoint_dir", "log_dir", "profile_steps", "eval_every", "capacity"):
        if getattr(config, name):
            flag = "--" + name.replace("_", "-")
            raise ValueError(f"--overlap keeps no {flag}: run without it, or without --overlap")
    if config.steps_per_call > 1:
        raise ValueError("--overlap runs one step a call: leave out --steps-per-call")
    if config.plan:
        raise ValueError(
            "--overlap carries column-wise tables only: leave out --plan (--strategy "
            "embrace_2d without --overlap takes one)"
        )


def _check_model_fields(config: RunConfig) -> None:
    """Constraints between the fields of the chosen model."""
    fields = config_fields(config.model)
    if "heads" in fields and config.dim % config.heads:
        raise ValueError(
            f"--heads {config.heads} does not divide --dim {config.dim} "
            f"(the width of --model {config.model})"
        )
    if "masked" in fields and config.masked > config.seq_len:
        raise ValueError(f"--masked {config.masked} is more than --seq-len {config.seq_len}")


def _check_text_file(config: RunConfig) -> None:
    if not config.text_file:
        return
    readers = sorted(m for m in MODELS if "text_file" in config_fields(m))
    if config.model not in readers:
        raise ValueError(
            f"--text-file is read by {', '.join(readers)} only; --model "
            f"{config.model} would ignore it (drop the flag)"
        )
    path = Path(config.text_file)
    if not path.is_file():
        if path.is_dir():
            problem = "is a directory"
        elif path.exists():  # a device (/dev/null, /dev/zero), a FIFO, a socket
            problem = "is not a regular file (a device, FIFO or socket)"
        else:
            problem = "does not exist"
        raise ValueError(f"--text-file {config.text_file} {problem}; give a text file")
    try:
        path.open("rb").close()
    except OSError as e:
        raise ValueError(f"--text-file {config.text_file}: {e.strerror}") from None


def _physical_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _batch_bytes(config: RunConfig) -> int:
    """A lower bound on the host memory that building one global batch takes."""
    if "image_size" in config_fields(config.model):
        per_example = 3 * config.image_size**2 * 8 * 3  # float64 noise, templates, sum
    else:
        per_example = 2 * (config.seq_len + 1) * 8  # uniform draws and token ids
    return config.batch * per_example


def _check_resources(config: RunConfig) -> None:
    """A request no machine of this kind can serve, refused before XLA is asked."""
    if distributed.distributed_args() is None and config.devices > MAX_PROCESS_DEVICES:
        raise ValueError(
            f"--devices {config.devices}: one process runs at most "
            f"{MAX_PROCESS_DEVICES} devices (XLA's CPU collectives cannot "
            "join more simulated devices); use fewer, or the launcher"
        )
    need, have = _batch_bytes(config), _physical_memory()
    if need > have // 2:
        raise ValueError(
            f"--batch {config.batch}: one global batch alone needs "
            f"{need / 2**30:.1f} GiB, this machine has {have / 2**30:.1f} GiB; "
            "use a smaller --batch"
        )


# ------------------------------------------------------------ output locations


def writable_folder(folder: Path, what: str) -> None:
    """Creates ``folder`` if needed and writes a probe file into it; ``ValueError``
    (starting with ``what``) when that is impossible."""
    for parent in (folder, *folder.parents):
        if parent.exists():
            if not parent.is_dir():
                raise ValueError(f"{what}: {parent} is a file, not a directory")
            break
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=folder).close()
    except OSError as e:
        raise ValueError(f"{what}: cannot write into {folder} ({e.strerror or e})") from None


def check_output_file(path: str, flag: str) -> None:
    """``ValueError`` unless a file can be written at ``path`` (its folder is created)."""
    if Path(path).is_dir():
        raise ValueError(f"{flag} {path} is a directory; give a file path")
    writable_folder(Path(path).absolute().parent, f"{flag} {path}")
    if Path(path).exists() and not os.access(path, os.W_OK):
        raise ValueError(f"{flag} {path} exists and is not writable")


def is_primary() -> bool:
    """Process 0 of a multi-process job, or a single process (known before JAX starts)."""
    args = distributed.distributed_args()
    return args is None or args["process_id"] == 0


def check_outputs(config: RunConfig) -> None:
    """Every location the run writes, checked before it starts."""
    if config.out and is_primary():
        check_output_file(config.out, "--out")
    if config.checkpoint_dir:
        writable_folder(Path(config.checkpoint_dir), f"--checkpoint-dir {config.checkpoint_dir}")
