"""What the sweep experiments share: running one configuration as a subprocess (on the
emulated cluster or on simulated CPU devices), a progress-reporting grid that survives a
failed configuration, speed-ups against a baseline, and saving rows as JSON and CSV.

Example:
    >>> from experiments.studies import harness
    >>> result = harness.run_config(["--steps", "3", "--strategy", "dense"], "runs/x.json",
    ...                           nproc=2)                    # 2 simulated devices
    >>> result["step_time_s"] > 0
    True
"""

from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from sparsecomm_jax.comm import costmodel, hlo

BASELINE = "dense_pmap"


def parser(module: str, doc: str | None) -> argparse.ArgumentParser:
    """A study's command line: ``python -m <module>`` with its docstring as help, and
    ``--out-dir`` (default ``runs/<study>``), the folder its results go to.

    Example:
        >>> parser("experiments.studies.scaling", "Throughput.").parse_args([]).out_dir
        'runs/scaling'
    """
    name = module.rsplit(".", 1)[-1]
    p = argparse.ArgumentParser(
        prog=f"python -m {module}",
        description=doc,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--out-dir", default=f"runs/{name}", help="where the results go")
    return p


def write_result(out_dir: str | Path, name: str, result: Any) -> Path:
    """``result`` as ``<out_dir>/<name>.json`` (the folder made); returns the path."""
    path = Path(out_dir) / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    return path


def write_report(out_dir: str | Path, name: str, result: Any, table: str) -> Path:
    """``result`` as ``<out_dir>/<name>.json`` (``write_result``) and its results
    ``table`` (markdown) as ``<name>.md`` beside it, the table printed; returns the
    JSON's path."""
    path = write_result(out_dir, name, result)
    path.with_suffix(".md").write_text(table)
    print(table)
    return path


_UNITS = {"gbit": 1.0, "mbit": 1e-3, "kbit": 1e-6, "bit": 1e-9}


def gbit(rate: str) -> float:
    """A ``tc`` rate in Gbit/s: ``"100mbit"`` -> 0.1."""
    for unit, scale in _UNITS.items():
        if rate.endswith(unit):
            return float(rate[: -len(unit)]) * scale
    raise ValueError(f"bandwidth must end in bit/kbit/mbit/gbit, got {rate!r}")


def split_argv(argv: Sequence[str] | None) -> tuple[list[str], list[str]]:
    """``(own arguments, experiments.train arguments)``, split at ``--``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    return argv[:split], argv[split + 1 :]


def command(train_args: Sequence[str], out: str | Path, nproc: int, bandwidth: str) -> list[str]:
    """The command line of one run: ``nproc`` processes on the emulated cluster, each with
    a ``bandwidth`` link of its own (``cluster --per-worker``), or (``bandwidth=""``) one
    process with ``nproc`` simulated devices and no network."""
    train = ["--devices", str(nproc), *train_args, "--out", str(out)]
    if not bandwidth:
        return [sys.executable, "-m", "experiments.train", *train]
    return [
        sys.executable,
        "-m",
        "experiments.cluster",
        "--nproc",
        str(nproc),
        "--bandwidth",
        bandwidth,
        "--per-worker",
        "--",
        *train,
    ]


def run_config(
    train_args: Sequence[str], out: str | Path, nproc: int = 1, bandwidth: str = ""
) -> dict[str, Any]:
    """Runs one ``experiments.train`` configuration; returns its JSON result.

    Raises:
      RuntimeError: with the command and the end of its output, if it failed (the
        launcher streams each rank's error to its standard output, so both count).
    """
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    cmd = command(train_args, out, nproc, bandwidth)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{failure_tail(proc.stdout, proc.stderr)}")
    return json.loads(Path(out).read_text())


def failure_tail(stdout: str, stderr: str, lines: int = 12, limit: int = 4000) -> str:
    """What explains a failed run: the first lines of its standard output that name an
    error (a launched job's ranks write there, and the rank that failed first is often
    followed by the others' lost-connection tracebacks), then the last ``lines`` lines
    of its standard output and of its standard error, at most ``limit`` characters."""
    out = stdout.split("\n")
    tail = out[-lines:]
    first = [line for line in out[:-lines] if "error" in line.lower()][:3]
    text = "\n".join([*first, *(["..."] if first else []), *tail, *stderr.split("\n")[-lines:]])
    return text if len(text) <= limit else text[:limit] + " ..."


def grid(jobs: Iterable[tuple], measure: Callable[..., dict], desc: str) -> list[dict]:
    """``measure(*job)`` for every job, with a progress bar. A job that fails is reported
    and recorded as ``{"error": ...}`` so that one bad configuration does not lose the
    others."""
    from tqdm import tqdm

    rows = []
    jobs = list(jobs)
    for job in tqdm(jobs, desc=desc):
        try:
            rows.append(measure(*job))
        except RuntimeError as e:
            print(f"\n{desc}: {job} failed: {str(e)[-600:]}", file=sys.stderr)
            rows.append({"job": list(job), "error": str(e)[-2000:]})
    return rows


def throughput(result: dict[str, Any]) -> tuple[str, float]:
    """``("tokens_per_s", value)`` or ``("samples_per_s", value)`` of one result."""
    key = next(k for k in result if k.endswith("_per_s"))
    return key, result[key]


def predicted_comm_s(result: dict[str, Any], link: costmodel.Link) -> float:
    """The cost model's communication seconds of a result's compiled collectives."""
    colls = [
        hlo.Collective(
            c["kind"],
            c["name"],
            (),
            c["group_size"],
            c["result_bytes"],
            c["bytes_sent"],
            c.get("conditional", False),  # results written before the field: none
        )
        for c in result["collectives"]
    ]
    return costmodel.program_time(colls, link)


def measure(
    train_args: Sequence[str],
    out: str | Path,
    nproc: int,
    bandwidth: str,
    /,
    link: costmodel.Link | None = None,
    **labels: Any,
) -> dict[str, Any]:
    """One row: ``labels`` plus step time, throughput, bytes and final loss of a run, and
    with a ``link`` the cost model's ``predicted_comm_s``."""
    result = run_config(train_args, out, nproc, bandwidth)
    key, value = throughput(result)
    row = {
        **labels,
        "strategy": result["strategy"],
        "step_s": result["step_time_s"],
        "throughput": value,
        "unit": key,
        "bytes": result["comm_bytes_per_step"],
        "final_loss": result["losses"][-1],
    }
    if link is not None:
        row["predicted_comm_s"] = predicted_comm_s(result, link)
    return row


def add_measured_comm(rows: list[dict], free: dict[str, Any]) -> None:
    """Sets ``comm_s`` = step time - the step time of the row for the same strategy whose
    fields match ``free`` (e.g. ``{"bandwidth": "100gbit"}``: practically no network)."""
    ok = [r for r in rows if "error" not in r]
    base = {r["strategy"]: r["step_s"] for r in ok if all(r[k] == v for k, v in free.items())}
    for r in ok:
        if r["strategy"] in base:
            r["comm_s"] = r["step_s"] - base[r["strategy"]]


def add_speedups(rows: list[dict], group: Sequence[str], baseline: str = BASELINE) -> None:
    """Sets ``speedup`` = baseline step time / step time, within rows that agree on the
    ``group`` fields (e.g. the same bandwidth); None where the baseline is missing."""
    ok = [r for r in rows if "error" not in r]
    base = {tuple(r[g] for g in group): r["step_s"] for r in ok if r["strategy"] == baseline}
    for r in ok:
        b = base.get(tuple(r[g] for g in group))
        r["speedup"] = b / r["step_s"] if b else None


def report(rows: list[dict], labels: Sequence[str]) -> str:
    """One line per error-free row: its ``labels``, strategy, step time, throughput and
    speed-up over the baseline."""
    lines = []
    for r in (r for r in rows if "error" not in r):
        speedup = f"{r['speedup']:.2f}x" if r.get("speedup") else "-"
        head = " ".join(f"{r[k]!s:>8}" for k in labels)
        lines.append(
            f"{head} {r['strategy']:>15}  step {r['step_s'] * 1e3:9.1f} ms "
            f"{r['throughput']:10.1f} {r['unit']}  vs {BASELINE} {speedup}"
        )
    return "\n".join(lines)


def save_rows(rows: list[dict], out_dir: str | Path, name: str, extra: dict | None = None) -> Path:
    """Writes ``name.json`` (rows and ``extra``) and ``name.csv`` (the error-free rows'
    scalar fields) into ``out_dir``; returns the directory."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps({"rows": rows, **(extra or {})}, indent=1))
    ok = [r for r in rows if "error" not in r]
    fields = [k for k in (ok[0] if ok else {}) if not isinstance(ok[0][k], (list, dict))]
    with open(out / f"{name}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(ok)
    return out


def plot_by_strategy(ax, rows: list[dict], x: str, y: str) -> None:
    """One line per strategy on ``ax``: ``y`` against ``x`` over the error-free rows
    whose ``y`` is set, sorted by ``x``."""
    ok = [r for r in rows if "error" not in r and r.get(y) is not None]
    for strategy in dict.fromkeys(r["strategy"] for r in ok):
        pts = sorted((r[x], r[y]) for r in ok if r["strategy"] == strategy)
        ax.plot(*zip(*pts, strict=True), marker="o", label=strategy)


def pyplot():
    """matplotlib's pyplot on the file-only backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
