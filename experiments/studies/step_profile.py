"""Where each rank's step goes, read from the ``--profile-steps`` trace of a run.

    python -m sparsecomm_jax.launch --nproc 4 -- python -m experiments.train \\
        --strategy embrace --devices 4 --steps 14 --profile-steps 8:13 --log-dir runs/p4
    python -m experiments.studies.step_profile runs/p4 --out runs/p4/profile.json

Reads ``<log dir>/trace/rank*/plugins/profile/*/*.trace.json.gz`` (one ``jax.profiler``
trace per rank; XLA:CPU records every thunk it runs, tagged with its program
(``hlo_module``), its device and the run's id). A run of a program on a device is the
span of its thunks; a step is a run of the step's program (the program that holds the
collectives and runs most often). Per device and step:

- ``program_ms``: from the run's first thunk to its last;
- ``collective_ms``: time inside its collectives (the union of their intervals); split
  into ``transfer_ms``, the least time any device spent in the collectives of that step
  (what the exchange itself costs), and ``wait_ms``, the rest (waiting for slower ones);
- ``compute_ms``: the rest of the run (its arithmetic and the executor's dispatch);
- ``host_ms``: the gap since the previous step's run ended on that device (the host's
  work between steps that the step in flight did not hide: with ``--in-flight no``
  the loss read and logging; the first traced step has none).

With ``--hlo`` (the step's optimized HLO, as ``XLA_FLAGS="--xla_dump_to=DIR
--xla_dump_hlo_as_text --xla_dump_hlo_module_re=jit_step"`` writes it:
``DIR/*jit_step.cpu_after_optimizations.txt``) each thunk is also put in a part of the
step (``PARTS``) by the ``op_name`` its HLO instruction carries (the JAX and Flax scopes
it was traced under): collectives, the model's MLPs and interaction (forward and
backward), the rest of its forward and backward pass, the exchange's own work on the
ids and rows inside ``shard_map``, the scatters that sum gradient rows and update the
tables, and the optimizer and checks outside ``shard_map``. Per device the median over
the traced steps of each part's summed thunk time; XLA:CPU may run independent thunks
at once, so the parts can add up to more than the program's time.

The tracing slows the thunks themselves: one process on one core ran the side-by-side LM's
step in 19.6 ms traced and 10.3-11.0 ms untraced (``BENCHMARKS.md``). Read the parts as
shares of a traced step, and take totals from untraced runs.

Per device (``rank`` or ``rank/device`` when a process drives several) the medians over
the traced steps, and per collective (by its HLO name) its median time on each. On
XLA:CPU a program's collectives and compute run one after the other, so the parts add
up to the program's time. Steps are matched across devices by their order; a device
whose steps ran other collectives is an error, not a silent mismatch.

Example:
    >>> ev = [_x("fusion", 0, 10, run=1), _x("all-to-all.1", 10, 3, run=1),
    ...       _x("fusion", 20, 5, run=2), _x("all-to-all.1", 25, 2, run=2)]
    >>> [(s.program_ms, s.collective_ms, s.host_ms) for s in steps_of(ev)["0"]]
    [(0.013, 0.003, None), (0.007, 0.002, 0.007)]
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import re
import statistics
import sys
from pathlib import Path
from typing import NamedTuple

from sparsecomm_jax.comm.hlo import op_names

KINDS = {  # an HLO name's prefix -> its collective kind
    "all-to-all": "all-to-all",
    "all_to_all": "all-to-all",
    "all-gather": "all-gather",
    "all_gather": "all-gather",
    "all-reduce": "all-reduce",
    "psum_scatter": "reduce-scatter",
    "psum": "all-reduce",
    "reduce-scatter": "reduce-scatter",
    "reduce_scatter": "reduce-scatter",
    "collective-permute": "collective-permute",
    "ppermute": "collective-permute",
}


def _x(name: str, ts: float, dur: float, run: int = 1, device: int = 0, module="jit_step"):
    """A thunk's trace event as XLA:CPU writes it (times in microseconds; examples)."""
    args = {"hlo_module": module, "run_id": str(run), "device_ordinal": str(device)}
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": 1, "args": args}


def collective_kind(name: str) -> str | None:
    """The collective kind of an HLO op's name (``all_gather_invariant.10`` ->
    ``all-gather``), ``None`` for any other op."""
    for prefix, kind in KINDS.items():
        if re.match(re.escape(prefix) + r"(\b|_|\.|$)", name):
            return kind
    return None


class Step(NamedTuple):
    """One traced step on one device (milliseconds)."""

    start_us: float  # the run's first thunk on this rank's clock
    program_ms: float
    collective_ms: float
    host_ms: float | None  # None for the first traced step
    collectives: dict  # HLO name -> ms inside it (all its intervals)
    parts: dict | None = None  # part of the step (PARTS) -> ms of its thunks (with --hlo)


def _has(*needles: str):
    return lambda op: any(n in op for n in needles)


#: The parts of a step, by the op_name of a thunk's HLO instruction (first match wins;
#: a collective by its HLO name). The model's parts are named as ``models.dlrm`` and
#: ``models.lstm_lm`` trace them (Flax module names, the interaction's einsum).
PARTS = (
    ("interaction (forward, backward)", _has("bfd,bgd->bfg")),
    ("MLPs (forward, backward)", lambda op: re.search(r"/MLP_\d|/Dense_\d|/LSTM", op)),
    ("model backward, other (pooling, concatenation)", _has("transpose(jvp(")),
    ("model forward, other (pooling, concatenation)", _has("jvp(")),
    ("gradient rows summed, tables updated (scatter)", _has("scatter")),
    (
        "exchange's local work (ids sorted, deduplicated, bucketed; rows gathered)",
        lambda op: "shard_map" in op,
    ),
    ("optimizer, step checks (outside shard_map)", _has("jit(step)")),
)
COLLECTIVES = "collectives"
OTHER = "other (copies, ops without a scope)"


def part_of(name: str, op_name: str) -> str:
    """The part of the step (``PARTS``) a thunk of HLO instruction ``name`` belongs to.

    Example:
        >>> mlp = "jit(step)/shard_map/jvp(DLRM)/MLP_0/Dense_1/add"
        >>> part_of("all-to-all.2", ""), part_of("fusion.1", mlp)
        ('collectives', 'MLPs (forward, backward)')
    """
    if collective_kind(name):
        return COLLECTIVES
    return next((part for part, match in PARTS if op_name and match(op_name)), OTHER)


def _union_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def _runs(events: list[dict]) -> dict[tuple, list[dict]]:
    """(device, module, run id) -> the thunk events of that run."""
    runs: dict[tuple, list[dict]] = collections.defaultdict(list)
    for e in events:
        args = e.get("args") or {}
        if e.get("ph") == "X" and "hlo_module" in args and "run_id" in args:
            runs[(args.get("device_ordinal", "0"), args["hlo_module"], args["run_id"])].append(e)
    return runs


def _step_module(runs: dict[tuple, list[dict]]) -> str | None:
    """The program whose runs hold collectives most often (the step's)."""
    count = collections.Counter(
        module for (_, module, _), es in runs.items() if any(collective_kind(e["name"]) for e in es)
    )
    return count.most_common(1)[0][0] if count else None


def _step(events: list[dict], prev_end: float | None, names: dict | None = None) -> Step:
    t0 = min(e["ts"] for e in events)
    t1 = max(e["ts"] + e["dur"] for e in events)
    colls = [e for e in events if collective_kind(e["name"])]
    per: collections.Counter = collections.Counter()
    for e in colls:
        per[e["name"]] += e["dur"] / 1e3
    union = _union_us([(e["ts"], e["ts"] + e["dur"]) for e in colls])
    host = None if prev_end is None else (t0 - prev_end) / 1e3
    parts: collections.Counter = collections.Counter()
    for e in events if names is not None else ():
        parts[part_of(e["name"], names.get(e["name"], ""))] += e["dur"] / 1e3
    return Step(
        t0,
        (t1 - t0) / 1e3,
        union / 1e3,
        host,
        dict(per),
        dict(parts) if names is not None else None,
    )


def steps_of(events: list[dict], names: dict | None = None) -> dict[str, list[Step]]:
    """Device -> its steps in time order (the runs of the step's program), each with the
    host gap since the previous one (and, given ``comm.hlo.op_names`` of the step's HLO, its
    thunks' time by part)."""
    runs = _runs(events)
    module = _step_module(runs)
    out: dict[str, list[Step]] = {}
    for device in sorted({d for d, _, _ in runs}):
        mine = sorted(
            (es for (d, m, _), es in runs.items() if d == device and m == module),
            key=lambda es: min(e["ts"] for e in es),
        )
        steps, prev_end = [], None
        for es in mine:
            steps.append(_step(es, prev_end, names))
            prev_end = max(e["ts"] + e["dur"] for e in es)
        if steps:
            out[device] = steps
    return out


def read_trace(path: Path) -> list[dict]:
    """The events of one ``*.trace.json.gz``."""
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return json.load(f)["traceEvents"]


def rank_traces(log_dir: Path) -> dict[int, Path]:
    """Rank -> its newest trace file under ``<log_dir>/trace/rank<N>`` (a one-process
    run's ``<log_dir>/trace``: rank 0)."""
    found = {}
    for path in sorted(log_dir.glob("trace/plugins/profile/*/*.trace.json.gz")):
        found[0] = path
    for path in sorted(log_dir.glob("trace/rank*/plugins/profile/*/*.trace.json.gz")):
        rank = int(path.relative_to(log_dir).parts[1].removeprefix("rank"))
        found[rank] = path  # sorted: the newest session of a rank wins
    return found


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return round(statistics.median(values), 3) if values else None


def summarize(per_rank: dict[str, list[Step]]) -> dict:
    """Per device the medians of its steps, with each step's collective time split into
    transfer (the least any device spent in each collective) and wait; per collective
    its median ms per device. Steps are matched by their order in the traces.

    Raises:
      ValueError: no step in the traces, or matched steps that ran other collectives.
    """
    n = min((len(s) for s in per_rank.values()), default=0)
    if not n:
        raise ValueError("no step with a collective in the traces (was --profile-steps set?)")
    for i in range(n):
        seen = {r: sorted(steps[i].collectives) for r, steps in per_rank.items()}
        if len({tuple(v) for v in seen.values()}) > 1:
            raise ValueError(f"traced step {i} ran other collectives on other devices: {seen}")
    names = sorted({k for steps in per_rank.values() for s in steps[:n] for k in s.collectives})
    least = [  # step -> the least time any rank spent in each collective
        {k: min(steps[i].collectives.get(k, 0.0) for steps in per_rank.values()) for k in names}
        for i in range(n)
    ]
    ranks = {}
    for rank, steps in sorted(per_rank.items()):
        steps = steps[:n]
        transfer = [min(sum(least[i].values()), s.collective_ms) for i, s in enumerate(steps)]
        ranks[rank] = {
            "steps": n,
            "program_ms": _median([s.program_ms for s in steps]),
            "compute_ms": _median([s.program_ms - s.collective_ms for s in steps]),
            "collective_ms": _median([s.collective_ms for s in steps]),
            "transfer_ms": _median(transfer),
            "wait_ms": _median([s.collective_ms - t for s, t in zip(steps, transfer, strict=True)]),
            "host_ms": _median([s.host_ms for s in steps]),
        }
        parts = sorted({p for s in steps for p in s.parts or {}})
        if parts:
            ranks[rank]["parts_ms"] = {
                p: _median([(s.parts or {}).get(p, 0.0) for s in steps]) for p in parts
            }
    per_collective = {
        k: {
            "kind": collective_kind(k),
            "ms_per_rank": {
                r: _median([s.collectives.get(k, 0.0) for s in st[:n]])
                for r, st in per_rank.items()
            },
        }
        for k in names
    }
    return {"ranks": ranks, "collectives": per_collective}


def markdown(summary: dict) -> str:
    """The per-device table (milliseconds, medians over the traced steps)."""
    cols = ("program_ms", "compute_ms", "collective_ms", "transfer_ms", "wait_ms", "host_ms")
    head = ("device", "step (program)", "compute", "collectives", "transfer", "wait", "host gap")
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for rank, r in summary["ranks"].items():
        lines.append(f"| {rank} | " + " | ".join(f"{r[c]}" for c in cols) + " |")
    parts = [p for p, _ in PARTS] + [COLLECTIVES, OTHER]
    if any("parts_ms" in r for r in summary["ranks"].values()):
        lines += ["", "| part of the step (thunk ms) | " + " | ".join(summary["ranks"]) + " |"]
        lines.append("|---" * (len(summary["ranks"]) + 1) + "|")
        for p in parts:
            per = [r.get("parts_ms", {}).get(p, 0.0) for r in summary["ranks"].values()]
            lines.append(f"| {p} | " + " | ".join(f"{v}" for v in per) + " |")
    lines += ["", "| collective | kind | ms per device |", "|---|---|---|"]
    for name, c in summary["collectives"].items():
        per = ", ".join(f"{v}" for v in c["ms_per_rank"].values())
        lines.append(f"| {name} | {c['kind']} | {per} |")
    return "\n".join(lines)


def profile(log_dir: Path, hlo: Path | None = None) -> dict:
    """``summarize`` of every rank's trace under ``log_dir`` (a device is named by its
    rank, or ``rank/device`` where one process drives several); with ``hlo`` (the step's
    optimized HLO text) each step's parts too."""
    traces = rank_traces(log_dir)
    if not traces:
        raise FileNotFoundError(f"no trace under {log_dir}/trace (run with --profile-steps)")
    names = op_names(hlo.read_text()) if hlo is not None else None
    per_device = {}
    for rank, path in sorted(traces.items()):
        devices = steps_of(read_trace(path), names)
        for device, steps in devices.items():
            per_device[str(rank) if len(devices) == 1 else f"{rank}/{device}"] = steps
    return summarize(per_device)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("log_dir", type=Path, help="the run's --log-dir (or --out's folder)")
    parser.add_argument("--out", default="", help="write the summary as JSON here")
    parser.add_argument(
        "--hlo",
        type=Path,
        help="the step's optimized HLO text (an XLA dump's *jit_step.cpu_after_optimizations"
        ".txt): each step's thunks by part too",
    )
    args = parser.parse_args(argv)
    try:
        summary = profile(args.log_dir, args.hlo)
    except (FileNotFoundError, ValueError) as err:
        print(f"step_profile: {err}", file=sys.stderr)
        return 2
    print(markdown(summary))
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
