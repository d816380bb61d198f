"""Where each rank's step goes, read from the ``--profile-steps`` trace of a run.

    python -m sparsecomm_jax.launch --nproc 4 -- python -m experiments.train \\
        --strategy embrace --devices 4 --steps 12 --profile-steps 6:10 --log-dir runs/p4
    python -m experiments.step_profile runs/p4 --out runs/p4/profile.json

Reads ``<log dir>/trace/rank*/plugins/profile/*/*.trace.json.gz`` (one ``jax.profiler``
trace per rank). A step is a top-level program run (XLA:CPU's ``ThunkExecutor::Execute
(wait for completion)``) holding at least one collective. Per rank and step:

- ``program_ms``: the program's wall time;
- ``collective_ms``: time inside its collectives (the union of their intervals); split
  into ``transfer_ms``, the least time any rank spent in that collective of that step
  (what the exchange itself costs), and ``wait_ms``, the rest (waiting for slower ranks);
- ``compute_ms``: the rest of the program (its arithmetic and the executor's dispatch);
- ``host_ms``: the gap before the program since the previous step's program ended (the
  host's work between steps: the next batch, logging; the first step has none).

Per rank the medians over the traced steps, and per collective (by its HLO name) its
median time on each rank. On XLA:CPU a program's collectives and compute run one after
the other, so the parts add up to the program's time.

Example:
    >>> ev = [_x("ThunkExecutor::Execute (wait for completion)", 0, 10),
    ...       _x("all-to-all.1", 2, 3), _x("fusion", 6, 2)]
    >>> [s.collective_ms for s in steps_of(ev)]
    [0.003]
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

TOP = "ThunkExecutor::Execute (wait for completion)"
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


def _x(name: str, ts: float, dur: float, tid: int = 1) -> dict:
    """A complete trace event (``ph: X``), times in microseconds (for the examples)."""
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": tid}


def collective_kind(name: str) -> str | None:
    """The collective kind of an HLO op's name (``all_gather_invariant.10`` ->
    ``all-gather``), ``None`` for any other op."""
    for prefix, kind in KINDS.items():
        if re.match(re.escape(prefix) + r"(\b|_|\.|$)", name):
            return kind
    return None


class Step(NamedTuple):
    """One traced step on one rank (milliseconds)."""

    start_us: float  # the program's start on this rank's clock
    program_ms: float
    collective_ms: float
    host_ms: float | None  # None for the first traced step
    collectives: dict  # HLO name -> ms inside it (all its intervals)


def _union_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def steps_of(events: list[dict]) -> list[Step]:
    """The steps of one rank's trace events: top-level programs holding a collective,
    in time order, with the host gap before each."""
    ops = [e for e in events if e.get("ph") == "X" and not e["name"].startswith("$")]
    tops = sorted((e for e in ops if e["name"] == TOP), key=lambda e: e["ts"])
    colls = sorted((e for e in ops if collective_kind(e["name"])), key=lambda e: e["ts"])
    out, prev_end = [], None
    for top in tops:
        t0, t1 = top["ts"], top["ts"] + top["dur"]
        inside = [e for e in colls if t0 <= e["ts"] and e["ts"] + e["dur"] <= t1]
        if not inside:
            continue  # a program with no collective: not a step (a host check, say)
        per = collections.Counter()
        for e in inside:
            per[e["name"]] += e["dur"] / 1e3
        union = _union_us([(e["ts"], e["ts"] + e["dur"]) for e in inside])
        host = None if prev_end is None else (t0 - prev_end) / 1e3
        out.append(Step(t0, top["dur"] / 1e3, union / 1e3, host, dict(per)))
        prev_end = t1
    return out


def read_trace(path: Path) -> list[dict]:
    """The events of one ``*.trace.json.gz``."""
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return json.load(f)["traceEvents"]


def rank_traces(log_dir: Path) -> dict[int, Path]:
    """Rank -> its newest trace file under ``<log_dir>/trace/rank<N>``."""
    found = {}
    for path in sorted(log_dir.glob("trace/rank*/plugins/profile/*/*.trace.json.gz")):
        rank = int(path.relative_to(log_dir).parts[1].removeprefix("rank"))
        found[rank] = path  # sorted: the newest session of a rank wins
    return found


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return round(statistics.median(values), 3) if values else None


def summarize(per_rank: dict[int, list[Step]]) -> dict:
    """Per rank the medians of its steps, with each step's collective time split into
    transfer (the least any rank spent in that collective) and wait; per collective its
    median ms per rank. Ranks' steps are matched by their order in the trace."""
    n = min((len(s) for s in per_rank.values()), default=0)
    if not n:
        raise ValueError("no step with a collective in the traces (was --profile-steps set?)")
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
    """The per-rank table (milliseconds, medians over the traced steps)."""
    cols = ("program_ms", "compute_ms", "collective_ms", "transfer_ms", "wait_ms", "host_ms")
    head = ("rank", "step (program)", "compute", "collectives", "transfer", "wait", "host gap")
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for rank, r in summary["ranks"].items():
        lines.append(f"| {rank} | " + " | ".join(f"{r[c]}" for c in cols) + " |")
    lines += ["", "| collective | kind | ms per rank |", "|---|---|---|"]
    for name, c in summary["collectives"].items():
        per = ", ".join(f"{v}" for v in c["ms_per_rank"].values())
        lines.append(f"| {name} | {c['kind']} | {per} |")
    return "\n".join(lines)


def profile(log_dir: Path) -> dict:
    """``summarize`` of every rank's trace under ``log_dir``."""
    traces = rank_traces(log_dir)
    if not traces:
        raise FileNotFoundError(f"no trace under {log_dir}/trace (run with --profile-steps)")
    return summarize({rank: steps_of(read_trace(p)) for rank, p in traces.items()})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("log_dir", type=Path, help="the run's --log-dir (or --out's folder)")
    parser.add_argument("--out", default="", help="write the summary as JSON here")
    args = parser.parse_args(argv)
    try:
        summary = profile(args.log_dir)
    except (FileNotFoundError, ValueError) as err:
        print(f"step_profile: {err}", file=sys.stderr)
        return 2
    print(markdown(summary))
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
