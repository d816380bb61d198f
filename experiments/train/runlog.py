"""What a training run writes while it goes: per-step JSON lines, TensorBoard scalars,
held-out evaluations and a ``jax.profiler`` trace of chosen steps.

``RunHooks`` is called by ``experiments.train.run_steps`` around every step:

    <log dir>/steps.jsonl       one JSON object per step, flushed as it is written
    <log dir>/events.out.tfevents.*   the same scalars for TensorBoard
    <log dir>/trace/            the --profile-steps trace (TensorBoard profile plugin
                                or ui.perfetto.dev: plugins/profile/*/*.trace.json.gz)

A log folder holds one run, like a checkpoint folder: ``claim_log_dir`` locks it (two
runs at once are refused) and refuses one inside the checkpoint folder (rotation would
delete it). A fresh run replaces the folder's logs; a resumed one keeps the lines of the
steps before its start, drops the rest, and writes the kept scalars anew into one
TensorBoard event file, so no step is logged twice.

Example:
    >>> parse_profile_steps("3:5")
    (3, 5)
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import jax

from experiments.train.config import RunConfig
from experiments.train.validate import is_primary, writable_folder
from models import has_synthetic_heldout
from models.heldout import evaluate, heldout_splits
from models.workload import Workload
from sparsecomm_jax import checkpoint
from sparsecomm_jax.comm import hlo
from sparsecomm_jax.step import managed_ids


def parse_profile_steps(text: str) -> tuple[int, int] | None:
    """``"A:B"`` -> ``(A, B)`` with ``0 <= A < B``; ``""`` -> ``None``."""
    if not text:
        return None
    try:
        a, b = (int(x) for x in text.split(":"))
    except ValueError:
        a, b = -1, -1
    if not 0 <= a < b:
        raise ValueError(
            f"--profile-steps must be A:B with 0 <= A < B (steps A..B-1), got {text!r}"
        )
    return a, b


def log_dir_of(config: RunConfig) -> Path | None:
    """``--log-dir``, else ``<--out without .json>.logs`` next to the result, else None."""
    if config.log_dir:
        return Path(config.log_dir)
    if config.out:
        out = Path(config.out)
        return out.with_name(out.stem + ".logs")
    return None


def trace_folder(log_dir: Path, rank: int) -> Path:
    """``<log dir>/trace``, or ``<log dir>/trace/rank<r>`` in a multi-process job (each
    process writes its own trace; same-host processes would overwrite each other's)."""
    folder = log_dir / "trace"
    return folder / f"rank{rank}" if jax.process_count() > 1 else folder


def _log_flag(config: RunConfig, folder: Path) -> str:
    return f"--log-dir {folder}" if config.log_dir else f"the log folder {folder} (next to --out)"


def claim_log_dir(config: RunConfig) -> checkpoint.DirectoryLock | None:
    """On rank 0, before JAX starts: creates and locks the run's log folder. Returns the
    lock (``None``: no logs, or not rank 0).

    Raises:
      ValueError: the folder is inside ``--checkpoint-dir``, cannot be written, or
        another run holds it.
    """
    folder = log_dir_of(config)
    if folder is None or not is_primary():
        return None
    flag = _log_flag(config, folder)
    if config.checkpoint_dir:
        ckpt, logs = Path(config.checkpoint_dir).resolve(), folder.resolve()
        if logs == ckpt or ckpt in logs.parents:
            raise ValueError(
                f"{flag} is inside --checkpoint-dir {config.checkpoint_dir}, whose "
                "rotation would delete it: give the logs a folder outside it"
            )
    writable_folder(folder, flag)
    return checkpoint.DirectoryLock(folder, what=flag)


def check_run_io(config: RunConfig) -> None:
    """``ValueError`` naming the flag when the data, log or trace flags are unusable."""
    for name in ("eval_every", "eval_batches"):
        if getattr(config, name) < 0:
            flag = "--" + name.replace("_", "-")
            raise ValueError(f"{flag} must be >= 0, got {getattr(config, name)}")
    if config.eval_every and not (config.data_dir or has_synthetic_heldout(config.model)):
        raise ValueError(
            f"--eval-every needs held-out data: --model {config.model}'s synthetic data has "
            "none; give --data-dir (WikiText, PTB, CIFAR-10 or Criteo)"
        )
    if config.data_dir and config.text_file:
        raise ValueError("give --data-dir or --text-file, not both")
    window = parse_profile_steps(config.profile_steps)
    if window and log_dir_of(config) is None:
        raise ValueError("--profile-steps needs --log-dir or --out (the trace goes next to it)")
    if window and window[0] >= config.steps:
        raise ValueError(f"--profile-steps {config.profile_steps} starts after the last step")


def _finite_or_none(value: Any) -> Any:
    """NaN / Inf become ``null``, so every line is strict JSON (``jq`` reads it)."""
    return None if isinstance(value, float) and not math.isfinite(value) else value


def scalar_tag(key: str) -> str:
    """TensorBoard tag of a log field: ``valid_loss`` -> ``valid/loss``, ``loss`` ->
    ``train/loss``."""
    split, _, rest = key.partition("_")
    return f"{split}/{rest}" if split in ("valid", "test") else f"train/{key}"


def kept_lines(path: Path, start: int) -> list[dict[str, Any]]:
    """The records of ``path`` (JSON lines) of steps before ``start``; a line cut short
    by a killed run, or one that is no record, is dropped."""
    kept = []
    if not path.is_file():
        return kept
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):
            continue
        if (
            isinstance(record, dict)
            and isinstance(record.get("step"), int)
            and record["step"] < start
        ):
            kept.append(record)
    return kept


class StepLog:
    """JSON lines (flushed per line) and TensorBoard scalars (written every 5 s and at
    close) of one run in one folder.

    A fresh run (``start`` 0) replaces what the folder holds; a resumed one keeps the
    records of the steps before ``start`` and writes them again as its first scalars,
    into the one event file the folder then holds.
    """

    def __init__(self, folder: Path, start: int = 0):
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / "steps.jsonl"
        kept = kept_lines(self.path, start) if start else []
        for old in folder.glob("events.out.tfevents.*"):
            old.unlink()
        self._file = open(self.path, "w", buffering=1, encoding="utf-8")
        # imported here: tensorboardX imports torch when it is installed (seconds per
        # process), and only runs with --log-dir write scalars
        from tensorboardX import SummaryWriter

        self._tb = SummaryWriter(str(folder), flush_secs=5)  # no fsync on the step path
        for record in kept:
            self.write(record)

    def write(self, record: dict[str, Any]) -> None:
        """Appends ``record`` (must hold ``step``) and its numbers as scalars."""
        strict = {k: _finite_or_none(v) for k, v in record.items()}
        self._file.write(json.dumps(strict, allow_nan=False) + "\n")
        self._file.flush()
        for key, value in record.items():
            if key != "step" and isinstance(value, int | float) and math.isfinite(value):
                self._tb.add_scalar(scalar_tag(key), value, record["step"])

    def close(self) -> None:
        self._file.close()
        self._tb.close()


class Trace:
    """A ``jax.profiler`` trace of steps ``[start, stop)`` into ``folder``."""

    def __init__(self, folder: Path, window: tuple[int, int]):
        self.folder, (self.start, self.stop) = folder, window
        self.active = self.written = False

    def before(self, step: int) -> None:
        if step == self.start or (self.start < step < self.stop and not self.active):
            jax.profiler.start_trace(str(self.folder))
            self.active = self.written = True

    def after(self, step: int) -> None:
        if self.active and step + 1 >= self.stop:
            self.close()

    def edge(self, step: int) -> bool:
        """Whether the window opens or closes right after ``step``."""
        return step + 1 == self.start or (self.start <= step < self.stop <= step + 1)

    def close(self) -> None:
        if self.active:
            jax.profiler.stop_trace()
            self.active = False


class RunHooks:
    """Per-step logging, periodic held-out evaluation and the profiler window of a run.

    Args:
      config: the run (``eval_every``, ``eval_batches``, ``log_dir``/``out``,
        ``profile_steps``).
      workload: the model and its data.
      ts: the ``TrainStep`` (its ``host_params`` feed the evaluation).
      rank: this process's rank; only rank 0 writes logs.
      start: the run's first step (a resumed run's checkpoint step).
    """

    def __init__(self, config: RunConfig, workload: Workload, ts, rank: int, start: int = 0):
        self.config, self.workload, self.ts = config, workload, ts
        self.splits = heldout_splits(workload)
        self.batches = {s: workload.heldout(s, config.eval_batches) for s in self.splits}
        self.folder = log_dir_of(config)
        on = self.folder and rank == 0
        self.log = StepLog(self.folder, start) if on else None
        self.trace = self._trace(rank, start)
        self.evals: list[dict[str, Any]] = []
        self._bytes: dict[int, float] = {}

    def _trace(self, rank: int, start: int) -> Trace | None:
        window = parse_profile_steps(self.config.profile_steps)
        if window and window[1] <= start:
            if rank == 0:
                print(
                    f"--profile-steps {self.config.profile_steps} ends before step {start}, "
                    "where this resumed run starts: no trace is written",
                    file=sys.stderr,
                )
            return None
        return Trace(trace_folder(self.folder, rank), window) if window else None

    def evaluate(self, state, splits: tuple[str, ...]) -> dict[str, dict[str, float]]:
        """Held-out metrics of ``state`` on ``splits``."""
        params, vocab = self.ts.host_params(state), self.ts.vocabulary
        if vocab is None:
            return {s: evaluate(self.workload, params, self.batches[s]) for s in splits}
        out = {}
        for s in splits:  # raw ids looked up as the mappings stand, nothing admitted
            ready, batches = managed_ids.for_evaluation(vocab, params, self.batches[s])
            out[s] = evaluate(self.workload, ready, batches)
        return out

    def before_step(self, step: int) -> None:
        if self.trace:
            self.trace.before(step)

    def settles(self, step: int) -> bool:
        """Whether the step loop must wait for ``step`` to end before starting the next:
        an evaluation of its state is due, or the profiler's window opens or closes
        after it (a trace holds whole steps)."""
        every = self.config.eval_every
        due = bool(every) and (step + 1) % every == 0
        return due or bool(self.trace and self.trace.edge(step))

    def after_step(self, step: int, state, loss: float, seconds: float, program) -> None:
        """Closes the trace window, evaluates when due, writes the step's line."""
        if self.trace:
            self.trace.after(step)
        record = {"step": step, "loss": loss, "step_time_s": seconds}
        record["comm_bytes_per_worker"] = self._comm_bytes(program)
        every = self.config.eval_every
        if every and (step + 1) % every == 0:
            metrics = self.evaluate(state, self.splits[:1])
            self.evals += [{"step": step, "split": s, **m} for s, m in metrics.items()]
            record.update({f"{s}_{k}": v for s, m in metrics.items() for k, v in m.items()})
        if self.log:
            self.log.write(record)

    def _comm_bytes(self, program) -> float:
        if id(program) not in self._bytes:
            colls = hlo.parse_collectives(program.as_text())
            self._bytes[id(program)] = hlo.total_bytes(colls)
        return self._bytes[id(program)]

    def finish(self, state) -> dict[str, Any]:
        """The result fields: final held-out metrics, periodic ones, log and trace paths."""
        self.close()
        out: dict[str, Any] = {"eval": self.evals}
        if self.splits:
            out["heldout"] = self.evaluate(state, self.splits)
        if self.folder:
            out["log_dir"] = str(self.folder)
        if self.trace and self.trace.written:
            out["trace_dir"] = str(self.trace.folder)
        return out

    def close(self) -> None:
        """Stops an open trace and closes the log files (safe to call twice)."""
        if self.trace:
            self.trace.close()
        if self.log:
            self.log.close()
            self.log = None

    def guard(self, fn, *args):
        """``fn(*args)``, closing the trace and logs if it raises."""
        try:
            return fn(*args)
        except BaseException:
            self.close()
            raise
