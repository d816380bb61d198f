"""What a step compiles to on GPUs that are not there: ``python -m experiments.gpu_schedule``.

    python -m experiments.gpu_schedule --gpus 8 --strategy embrace_2d --model lstm_lm \\
        --out runs/gpu_schedule/lstm_embrace_2d.json
    python -m experiments.gpu_schedule --hosts 2 --gpus 8 --strategy embrace --model dlrm

builds the training command's step (every flag of ``python -m experiments.train``
applies) for compile-only GPUs (``--gpu h100`` or ``h200``; ``--hosts`` x ``--gpus``),
compiles it (``sparsecomm_jax.compile_only``), and prints what the program says: its
collectives and the bytes each GPU sends, its memory per GPU, and each asynchronous
collective with the number of operations XLA scheduled between its start and its done.
A pipelined step (``embrace_2d``) is compiled twice: its first call fetches every row,
and the second, the steady state, reads the rows the first carried to it; that second
program is the one reported. With ``--steps-per-call K`` one call runs K steps (each in
the name scope ``step{k}``), and a window's operations of other steps are counted apart:
step k's late exchange with step k+1's forward pass between its start and done is
EmbRace's overlap across steps.

Writes the report as JSON (``--out``) and the scheduled HLO beside it (``.hlo.txt``):
read it from its ``ENTRY`` computation down, in issue order; an asynchronous collective
is its ``-start`` (``"is_sync":false`` in its ``backend_config``: it runs on a stream of
its own) and its ``-done``, and the lines between them are what may run while it is in
flight. ``op_name`` metadata holds the JAX scopes (``embrace2d_high``, ``embrace2d_low``,
``step1``, ...).

Needs the ``gpu-compile`` extra; runs on a CPU host (``JAX_PLATFORMS=cpu``, set here
before JAX starts). These are XLA's schedules for the described card, not timings.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # before JAX starts: compile-only GPUs

import argparse  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import sparsecomm_jax as sc  # noqa: E402
from experiments.train.config import OneLineErrors, add_arguments, from_namespace  # noqa: E402
from experiments.train.run import build  # noqa: E402
from sparsecomm_jax import compile_only  # noqa: E402
from sparsecomm_jax.errors import ArgumentError  # noqa: E402

STEP_SCOPE = re.compile(r"(?:^|/)step(\d+)(?:/|$)")


def make_parser() -> argparse.ArgumentParser:
    parser = OneLineErrors(
        prog="python -m experiments.gpu_schedule",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--gpu", default="h100", choices=sorted(compile_only.GPUS))
    parser.add_argument("--gpus", type=int, default=8, help="GPUs a host")
    parser.add_argument("--hosts", type=int, default=1, help="hosts of the job")
    add_arguments(parser, skip=("devices",))
    return parser


def step_of(op_name: str) -> int | None:
    """The unrolled step an operation belongs to (its ``step{k}`` scope), or ``None``."""
    m = STEP_SCOPE.search(op_name)
    return int(m.group(1)) if m else None


def is_forward_backward(op_name: str) -> bool:
    """Whether an operation is a step's forward or backward pass (``jax.value_and_grad``
    names them ``jvp(...)`` and ``transpose(jvp(...))``)."""
    return "jvp(" in op_name


def window_summary(window) -> dict[str, Any]:
    """One asynchronous collective: its kind, scope, whether XLA left it asynchronous,
    how many operations run in its window, how many of those are another step's, and
    how many of those are that step's forward or backward pass."""
    own = step_of(window.op_name)
    others = [i for i in window.between if step_of(i.op_name) not in (None, own)]
    return {
        "kind": window.kind,
        "start": window.start,
        "step": own,
        "op_name": window.op_name,
        "async": not window.sync,
        "ops_between": len(window.between),
        "other_steps_between": len(others),
        "other_steps_forward_backward": sum(is_forward_backward(i.op_name) for i in others),
        "other_steps": sorted({step_of(i.op_name) for i in others}),
    }


def programs(ts, workload, steps_per_call: int, steps: int) -> list:
    """The programs a run compiles, as ``(name, compiled)``: the first call, and for a
    pipelined step (it carries rows) the second, its steady state."""
    size = steps_per_call
    step = ts.steps if size > 1 else ts.step
    first = sc.place_for_call(ts, workload.batch_at, (0, size), steps)
    compiled, state = compile_only.compile_step(step, ts.state, first)
    out = [("first call", compiled)]
    if ts.lookahead:  # the steady state reads the rows the call before carried
        second = sc.place_for_call(ts, workload.batch_at, (size, size), steps)
        compiled, _ = compile_only.compile_step(step, state, second)
        out.append(("steady state", compiled))
    return out


def run(argv: list[str] | None = None) -> dict[str, Any]:
    """Parses ``argv``, compiles, prints the report; returns it (as JSON)."""
    args = make_parser().parse_args(argv)
    config = from_namespace(args)
    gpus = compile_only.gpu_devices(args.gpu, args.hosts, args.gpus)
    mesh = compile_only.gpu_mesh(args.gpu, args.hosts, args.gpus)
    workload, ts = build(config, mesh=mesh)
    steps = max(config.steps, 3 * config.steps_per_call + ts.lookahead)
    result: dict[str, Any] = {
        "gpu": gpus[0].device_kind,
        "hosts": args.hosts,
        "gpus_per_host": args.gpus,
        "strategy": config.strategy,
        "runs_as": ts.runs_as,
        "model": config.model,
        "steps_per_call": config.steps_per_call,
        "programs": {},
    }
    for name, compiled in programs(ts, workload, config.steps_per_call, steps):
        report = compile_only.report(compiled)
        result["programs"][name] = {
            "bytes_per_gpu": report.bytes_per_device,
            "collectives": len(report.collectives),
            "memory": report.memory,
            "windows": [window_summary(w) for w in report.windows],
        }
        result["hlo"] = report.text  # the last program's: the steady state
    print_report(result)
    if config.out:
        hlo_path = Path(config.out).with_suffix(".hlo.txt")
        hlo_path.parent.mkdir(parents=True, exist_ok=True)
        hlo_path.write_text(result["hlo"])
        Path(config.out).write_text(json.dumps({**result, "hlo": str(hlo_path)}, indent=1))
    return result


def print_report(result: dict[str, Any]) -> None:
    print(
        f"{result['strategy']} (runs as {result['runs_as']}) on {result['hosts']} x "
        f"{result['gpus_per_host']} {result['gpu']}, {result['steps_per_call']} step(s) a call"
    )
    for name, p in result["programs"].items():
        windows = p["windows"]
        overlapped = sum(w["async"] and w["ops_between"] > 0 for w in windows)
        print(
            f"  {name}: {p['collectives']} collectives, {p['bytes_per_gpu'] / 1e6:.3f} MB "
            f"a GPU, peak {p['memory']['peak_memory_in_bytes'] / 2**30:.3f} GiB a GPU; "
            f"{len(windows)} asynchronous, {overlapped} with work between start and done"
        )
        for w in windows:
            if w["ops_between"]:
                across = (
                    f", {w['other_steps_between']} of steps {w['other_steps']} "
                    f"({w['other_steps_forward_backward']} their forward or backward pass)"
                    if w["other_steps_between"]
                    else ""
                )
                between = f"{w['ops_between']:>4} ops between{across}"
                print(f"    {w['kind']:<15} {between}  {w['op_name']}")


def main(argv: list[str] | None = None) -> int:
    """The command line; the exit status (2: a bad flag, one line on stderr)."""
    try:
        run(argv)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 2
    except (ArgumentError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
