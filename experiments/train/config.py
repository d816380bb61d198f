"""The run configuration shared by every experiment script, its CLI flags and its checks.

Every ``RunConfig`` field is one ``--flag`` (``seq_len`` -> ``--seq-len``) whose help text,
fixed choices and value check live in the field's metadata, so the parser, ``--help``
and ``check_fields`` (used by ``experiments.train.validate``) cannot disagree.

Example:
    >>> from experiments.train.config import RunConfig, check_fields
    >>> check_fields(RunConfig(lr=1e-2))
    >>> RunConfig(model="gpt2").trajectory()["model"]
    'gpt2'
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import math
from collections.abc import Callable, Mapping
from typing import Any

from models import MODELS, config_fields
from sparsecomm_jax import optimizers, parse_strategy, strategy_names
from sparsecomm_jax.aggregators import AGGREGATORS
from sparsecomm_jax.comm import wire
from sparsecomm_jax.embedding.layout_registry import TablePlan
from sparsecomm_jax.errors import ArgumentError, clipped, few
from sparsecomm_jax.strategies.rules import NONFINITE
from sparsecomm_jax.topk.selectors import DEFAULT_DENSITY, SELECTORS, check_density

TABLE_UPDATES = ("auto", "rows", "dense")
IN_FLIGHT = ("auto", "yes", "no")
MAX_SEED = 2**32 - 1

# ----------------------------------------------------------------- value checks
# Each returns what is wrong with a value ("must be >= 1, got 0") or None.

Check = Callable[[Any], "str | None"]


def at_least(low: int) -> Check:
    """Integers >= ``low``."""
    return lambda v: None if v >= low else f"must be >= {low}, got {v}"


def finite_at_least(low: float, strict: bool = False) -> Check:
    """Finite numbers >= ``low`` (> ``low`` when ``strict``)."""

    def check(v: float) -> str | None:
        ok = math.isfinite(v) and (v > low if strict else v >= low)
        return None if ok else f"must be {'>' if strict else '>='} {low} (finite), got {v}"

    return check


def seed_range(v: int) -> str | None:
    return None if 0 <= v <= MAX_SEED else f"must be in [0, 2**32 - 1], got {v}"


def bucket_size(v: str) -> str | None:
    """A size in MiB (finite, > 0) or ``auto``."""
    if v == "auto":
        return None
    try:
        return finite_at_least(0, strict=True)(float(v))
    except ValueError:
        return f"must be a size in MiB or auto, got {v!r}"


def capacity_factor_range(v: float) -> str | None:
    """0 (sized by the spread) or a finite factor >= 1."""
    return None if v == 0 or (math.isfinite(v) and v >= 1) else f"must be 0 or >= 1, got {v}"


def wire_spec(v: str) -> str | None:
    """A codec's name, or ``direction=codec`` pairs (``comm.wire.parse``)."""
    try:
        wire.parse(v)
    except ArgumentError as e:
        return f"{clipped(repr(v))} {e.problem}"
    return None


def density_range(v: float) -> str | None:
    try:
        check_density(v)
    except ValueError as e:
        return str(e).removeprefix("density ")
    return None


def _field(default: Any, help: str, check: Check | None = None, choices=None, parse=None) -> Any:
    """A ``RunConfig`` field: its ``--help`` text, value check, fixed choices (a
    sequence, or a function giving one, evaluated when the parser is built) and, for a
    value that is more than its text, ``parse(text) -> value``."""
    meta = {"help": help, "check": check, "choices": choices, "parse": parse}
    return dataclasses.field(default=default, metadata=meta)


@dataclasses.dataclass
class RunConfig:
    model: str = _field("lstm_lm", "workload to train", choices=lambda: sorted(MODELS))
    strategy: str = _field("dense", "communication strategy: %(choices)s", choices=strategy_names)
    devices: int = _field(
        8,
        "workers; 0 = every device of the job (the command line's "
        "default; a single process on a CPU-only host simulates this many "
        "devices, 8 for 0)",
        at_least(0),
    )
    replicas: int = _field(
        1,
        "replica groups R (2-D sparse parallelism): the devices split into R groups of "
        "devices/R; each table sharded within a group and replicated across the groups, "
        "its lookups exchanged in the group, its row gradients summed across the groups "
        "each step (exact); 1 = every table over every device",
        at_least(1),
    )
    steps: int = _field(20, "training steps (the run's total, resumed or not)", at_least(1))
    warmup: int = _field(
        2,
        "first program calls left out of the step-time medians (compilation, first runs): "
        "steps, or calls of --steps-per-call steps",
        at_least(0),
    )
    seed: int = _field(0, "seed of initialisation and data, in [0, 2**32 - 1]", seed_range)
    optimizer: str = _field(
        "adam",
        "optax optimizer (lazy_adam: Adam whose table rows change only on steps that read them)",
        choices=lambda: list(optimizers.OPTIMIZERS),
    )
    table_update: str = _field(
        "auto",
        "embedding tables: auto (row-sparse where the "
        "strategy and optimizer allow), rows (only the rows a batch "
        "reads) or dense (a V x D gradient)",
        choices=TABLE_UPDATES,
    )
    comm_dtype: str = _field(
        "float32",
        "precision on the wire, summed in float32: one codec for every exchange "
        f"({', '.join(sorted(wire.CODECS))}; bfloat16 halves the bytes, FP8 quarters them "
        "with a float32 scale a row), or each exchange's own, e.g. "
        "forward=float8_e4m3fn,backward=bfloat16,dense=bfloat16 (the rows of the lookups, "
        "their gradients, the dense layers' mean; unnamed ones float32)",
        wire_spec,
    )
    lr: float = _field(1e-3, "learning rate (finite, > 0)", finite_at_least(0, strict=True))
    batch: int = _field(
        32,
        "global batch: examples per step, all workers together; divisible by --devices",
        at_least(1),
    )
    seq_len: int = _field(16, "tokens per example (language models)", at_least(1))
    vocab: int = _field(2000, "vocabulary size V (language models)", at_least(2))
    dim: int = _field(
        32,
        "embedding / model width D (language models); divisible by --heads for attention models",
        at_least(1),
    )
    hidden: int = _field(64, "LSTM units per layer (lstm_lm)", at_least(1))
    layers: int = _field(1, "recurrent or transformer layers", at_least(1))
    heads: int = _field(2, "attention heads (transformer, bert, gpt2)", at_least(1))
    masked: int = _field(3, "masked positions per example (bert), <= --seq-len", at_least(1))
    image_size: int = _field(32, "image height = width (resnet, vgg)", at_least(1))
    width: int = _field(8, "channels of the first stage (resnet, vgg)", at_least(1))
    blocks: int = _field(1, "blocks per stage (resnet, vgg)", at_least(1))
    noise: float = _field(
        1.0, "noise std of the synthetic images (resnet, vgg)", finite_at_least(0)
    )
    sampled_softmax: int = _field(
        0, "shared negative samples per step; 0 = full softmax", at_least(0)
    )
    tie_embeddings: bool = _field(False, "tie the output table to the input table")
    tables: str = _field(
        "1000,1000,500,500,200,200,100,100",
        "rows of each sparse feature's table, comma-separated (dlrm)",
    )
    bottom: str = _field("64", "hidden widths of the bottom MLP, comma-separated (dlrm)")
    top: str = _field("64,32", "hidden widths of the top MLP, comma-separated (dlrm)")
    multi_hot: int = _field(1, "ids per sparse feature, pooled by sum (dlrm)", at_least(1))
    raw_ids: bool = _field(
        False,
        "the sparse features' ids as raw 64-bit values, no modulo (dlrm: Criteo's hex "
        "values, the synthetic ids hashed): for tables --plan gives the managed layout",
    )
    zipf_exponent: float = _field(
        1.1, "Zipf exponent of the synthetic tokens (> 0)", finite_at_least(0, strict=True)
    )
    text_file: str = _field(
        "",
        "one word-level text file as training data instead of "
        "synthetic tokens (language models only; no held-out split)",
    )
    capacity: int = _field(
        0,
        "fixed slots of the tables' exchange buffers (embrace: distinct ids per worker; "
        "embrace_rowwise: rows per bucket; embrace_2d: its first chunk, and each other "
        "layout's own), an error when a "
        "batch needs more; 0 = sized from the first batch with a margin, grown (a new "
        "program, warned about after the warm-up) only if a batch needs more",
        at_least(0),
    )
    density: float = _field(
        DEFAULT_DENSITY, "fraction sent by top-k strategies, in (0, 1]", density_range
    )
    selector: str = _field(
        "auto",
        "top-k selection: auto (exact, the fastest for the "
        "platform and size), exact (lax.top_k), radix (same result, no "
        "sort) or threshold (sampled, approximate)",
        choices=tuple(SELECTORS),
    )
    capacity_factor: float = _field(
        0.0,
        "topk_balanced, oktopk: an owner's slots for a worker's pairs over its mean "
        "share k/P, >= 1; 0 = the mean plus six standard deviations plus 8",
        capacity_factor_range,
    )
    bucket_mb: str = _field(
        "64",
        "tensor-fusion threshold in MiB for top-k strategies, or "
        "auto (binary search on measured step times at start-up)",
        bucket_size,
    )
    link_gbit: float = _field(
        10.0,
        "adaptive: link Gbit/s of the cost model; 0 = calibrate on this cluster first",
        finite_at_least(0),
    )
    link_alpha_us: float = _field(
        50.0, "adaptive: latency per message of the cost model (microseconds)", finite_at_least(0)
    )
    plan: str | TablePlan = _field(
        "",
        "a layout per embedding table (embrace, embrace_rowwise, sparse_allgather, "
        "embrace_2d: its column, row and hot tables pipelined, the others read within each "
        "step): auto "
        "(the planner's candidates, on --link-gbit/--link-alpha-us and --plan-memory-mb, "
        "each timed a few steps here, the fastest kept; hot rows priced from --histogram "
        "or the first 16 batches), "
        'model (its modelled best) or a JSON object {"table path": "layout"} of the '
        "registered layouts (column, row, table, replicated, dense, hot, managed, ...; a "
        'table\'s hot ids as {"layout": "hot", "config": [ids]}, a managed table\'s policy as '
        '{"layout": "managed", "config": {"eviction": "lfu", "threshold": 2}}); "" = the '
        "strategy's layout",
        parse=lambda v: parse_plan(v),
    )
    plan_memory_mb: float = _field(
        0.0, "tables' memory per worker the planner may use (0 = no limit)", finite_at_least(0)
    )
    hot_rows: int = _field(
        0,
        'H: rows that each table --plan gives "hot" holds on every worker, its most read '
        "ids (the rest sharded by rows)",
        at_least(0),
    )
    histogram: str = _field(
        "",
        "a .npz of each hot table's id counts (table path -> int[V], numpy.savez), or of "
        'the tables the planner may give hot rows (--plan auto/model); "" = counted over '
        "the first 16 batches",
    )
    nonfinite: str = _field(
        "skip",
        "NaN/Inf gradient or loss: skip the step (listed in "
        "skipped_steps), error (stop naming it) or off (apply it)",
        choices=NONFINITE,
    )
    max_skipped: int = _field(
        10, "stop (non-zero exit) when more than this many steps in a row are skipped", at_least(0)
    )
    in_flight: str = _field(
        "auto",
        "yes hands step t+1 to the devices before reading step t's loss (the host's work "
        "between steps beside the devices'), no waits for every step, auto is no where "
        "the devices are CPUs and a host of the job runs more processes than it has cores",
        choices=IN_FLIGHT,
    )
    steps_per_call: int = _field(
        1,
        "steps one program call runs (a scan over their batches; embrace_2d's pipelined "
        "steps unrolled): one dispatch, one program run and one loss read for them all; "
        "checkpoints, evaluations, the profiler's window and the last step end a call "
        "(steps near them run one a call)",
        at_least(1),
    )
    checkpoint_dir: str = _field("", 'checkpoint folder, one run per folder ("" = none)')
    checkpoint_every: int = _field(
        0,
        "save every N steps, and after the first step into a folder with no checkpoint "
        "(0 = after the first step and at the end)",
        at_least(0),
    )
    resume: bool = _field(
        False, "continue the run in --checkpoint-dir from its newest checkpoint that restores"
    )
    resume_step: int = _field(
        0,
        "with --resume: the checkpoint step to continue from (0 = the newest that restores)",
        at_least(0),
    )
    overwrite: bool = _field(False, "replace another run's checkpoints in --checkpoint-dir")
    overlap: bool = _field(
        False,
        "embrace_2d across steps: step t's late exchange and table update beside step "
        "t+1's compute (two programs on two host threads; no checkpoints or logs)",
    )
    collectives_overlap: str = _field(
        "auto",
        "whether the step's collectives can run beside its compute (read by embrace_2d "
        "only): auto asks the platform (not on CPU, where the pipeline can only lose and "
        "embrace_2d runs as embrace), yes builds its pipelined program anyway, no never",
        choices=("auto", "yes", "no"),
    )
    calibrate: bool = _field(
        False,
        "after training, fit the link's alpha and beta (costmodel) and add them to the result",
    )
    out: str = _field("", 'JSON result path ("" = do not write)')
    data_dir: str = _field(
        "",
        "folder of local data, nothing is downloaded: WikiText "
        "(wiki.{train,valid,test}.tokens) or PTB (ptb.{train,valid,test}.txt) "
        "for the language models, cifar-10-batches-py/ for resnet and vgg, "
        "a Criteo TSV train.txt for dlrm",
    )
    eval_every: int = _field(
        0,
        "held-out loss and perplexity/accuracy every N steps and at "
        "the end (0 = only at the end); needs --data-dir, or dlrm's synthetic splits",
        at_least(0),
    )
    eval_batches: int = _field(
        0, "held-out batches per evaluation (0 = the whole split)", at_least(0)
    )
    log_dir: str = _field(
        "",
        "per-step logs (steps.jsonl, TensorBoard scalars) and traces "
        "go here; default: <--out without .json>.logs/ when --out is given",
    )
    profile_steps: str = _field(
        "",
        "A:B = a jax.profiler trace of steps A to B-1 into "
        "<log dir>/trace (TensorBoard's profile plugin or "
        "ui.perfetto.dev)",
    )

    def __post_init__(self) -> None:
        if isinstance(self.plan, str) and self.plan not in PLAN_MODES:
            try:
                self.plan = parse_plan(self.plan)  # a JSON plan: a value from here on
            except ValueError as e:
                raise ValueError(f"--plan {e}") from None
        elif isinstance(self.plan, Mapping) and not isinstance(self.plan, TablePlan):
            self.plan = TablePlan.from_json(self.plan)

    def to_json(self) -> dict[str, Any]:
        """The fields as JSON-ready values (a ``TablePlan`` as its JSON object)."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        if isinstance(self.plan, TablePlan):
            values["plan"] = self.plan.to_json()
        return values

    def model_overrides(self) -> dict[str, Any]:
        """The fields some model's config takes (each model ignores the ones it lacks)."""
        known = set().union(*(config_fields(m) for m in MODELS))
        return {k: v for k, v in dataclasses.asdict(self).items() if k in known}

    def trajectory(self) -> dict[str, Any]:
        """The fields that decide this run's losses: a resumed run must match them.

        Everything but the run's length, placement, outputs and policies; model fields
        only where this model reads them, aggregator fields only where this strategy
        uses them.
        """
        values = dataclasses.asdict(self)
        unused = (set(self.model_overrides()) - config_fields(self.model)) | (
            set(AGGREGATOR_FIELDS) - set(aggregator_fields(self.strategy))
        )
        return {k: v for k, v in values.items() if k not in NOT_TRAJECTORY | unused}


# Fields that may change between a run and its resumption (the device count too:
# the global batch, and so the losses, do not depend on it; collectives_overlap:
# embrace_2d pipelined or as embrace, the same losses to float rounding).
NOT_TRAJECTORY = frozenset(
    {
        "devices",
        "replicas",
        "steps",
        "warmup",
        "capacity",
        "nonfinite",
        "max_skipped",
        "in_flight",
        "steps_per_call",
        "checkpoint_dir",
        "checkpoint_every",
        "resume",
        "resume_step",
        "overwrite",
        "calibrate",
        "overlap",
        "collectives_overlap",
        "plan",
        "plan_memory_mb",
        "hot_rows",
        "histogram",
        "out",
        "eval_every",
        "eval_batches",
        "log_dir",
        "profile_steps",
    }
)
AGGREGATOR_FIELDS = (
    "density",
    "selector",
    "bucket_mb",
    "link_gbit",
    "link_alpha_us",
    "capacity_factor",
)


def aggregator_fields(strategy: str) -> tuple[str, ...]:
    """The ``AGGREGATOR_FIELDS`` that ``strategy``'s gradient aggregator reads."""
    kind = AGGREGATORS[parse_strategy(strategy).aggregator]
    if not kind.sparse:
        return ()
    fields = ("density", "bucket_mb", "selector", *kind.options)
    return fields + (("link_gbit", "link_alpha_us") if kind.link else ())


def _choices(f: dataclasses.Field) -> Any:
    choices = f.metadata.get("choices")
    return choices() if callable(choices) else choices


def check_fields(config: RunConfig) -> None:
    """Each field on its own: ``ValueError`` naming the first bad flag."""
    for f in dataclasses.fields(RunConfig):
        value, flag = getattr(config, f.name), "--" + f.name.replace("_", "-")
        choices = _choices(f)
        if choices is not None and value not in choices:
            raise ValueError(f"unknown {flag} {value!r}; choose one of {list(choices)}")
        problem = f.metadata.get("check") and f.metadata["check"](value)
        if problem:
            raise ValueError(f"{flag} {problem}")


PLAN_MODES = ("", "auto", "model")  # --plan values that are no plan: the strategy's, searched


class _Pairs(list):
    """A JSON object as its (key, value) pairs, in order, repeated keys kept."""

    def __repr__(self) -> str:
        return repr(dict(self))


def _plain(value: Any) -> Any:
    """A JSON value with every object in it a ``dict`` again (a managed table's
    ``config`` is an object inside the table's)."""
    if isinstance(value, _Pairs):
        return {k: _plain(v) for k, v in value}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def parse_plan(value: str) -> str | TablePlan:
    """``--plan`` as the config holds it: a mode of ``PLAN_MODES`` as it is, a JSON
    object as a ``TablePlan`` (by the registered layouts' names; a table's entry may be
    ``{"layout": name, "config": ...}``, e.g. the hot layout's ids).

    Raises:
      ValueError: anything else, one line saying why (after the flag's name).

    Example:
        >>> parse_plan('{"params/a": "row"}')
        TablePlan({'params/a': 'row'})
    """
    if value in PLAN_MODES:
        return value
    shown = value if len(value) <= 80 else value[:77] + "..."
    try:
        pairs = json.loads(value, object_pairs_hook=_Pairs)  # an object's keys, repeats kept
    except (ValueError, RecursionError):  # RecursionError: nested deeper than Python goes
        raise ValueError(
            f"must be auto, model or a JSON object of table path -> layout, got {shown!r}"
        ) from None
    if not isinstance(pairs, _Pairs):
        raise ValueError(f"must be a JSON object of table path -> layout, got {shown!r}")
    keys = collections.Counter(k for k, _ in pairs)
    if twice := sorted(k for k, n in keys.items() if n > 1):
        raise ValueError(f"names {few(twice)} more than once: give each table one layout")
    entries = {k: _plain(v) for k, v in pairs}  # a configured table's entry an object
    try:
        return TablePlan.from_json(entries)
    except ValueError as e:
        raise ValueError(str(e).removeprefix("the plan ")) from None


class OneLineErrors(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line on stderr (exit status 2)."""

    def error(self, message: str):
        self.exit(2, f"error: {message} (see --help)\n")


def add_arguments(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    """One ``--flag`` per ``RunConfig`` field (``seq_len`` -> ``--seq-len``), with its
    help, default and fixed choices; values are checked by ``check_fields``."""
    for f in dataclasses.fields(RunConfig):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        help_text = f"{f.metadata['help']} (default: %(default)r)"
        if f.type in (bool, "bool"):
            parser.add_argument(flag, action="store_true", default=f.default, help=help_text)
            continue
        kind = f.metadata.get("parse") and _argument_type(f.metadata["parse"])
        kind = kind or {"int": int, "float": float, "str": str}[str(f.type)]
        choices = _choices(f)
        metavar = "NAME" if choices is not None and len(choices) > 8 else None
        parser.add_argument(
            flag, type=kind, default=f.default, choices=choices, metavar=metavar, help=help_text
        )


def _argument_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """``parse`` as an argparse type: its ``ValueError`` is the one-line error."""

    def kind(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return kind


def from_namespace(ns: argparse.Namespace) -> RunConfig:
    names = {f.name for f in dataclasses.fields(RunConfig)}
    return RunConfig(**{k: v for k, v in vars(ns).items() if k in names})
