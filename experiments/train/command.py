"""The training command line: ``python -m experiments.train``.

    python -m experiments.train --model lstm_lm --strategy dense --devices 8 \\
        --steps 20 --seed 0 --out run.json

On a CPU-only host ``--devices N`` simulates N devices; on GPU hosts it takes the first N
GPUs. Under ``python -m sparsecomm_jax.launch`` every process joins one job and rank 0
writes the result.

Every flag, output location and checkpoint folder is checked before JAX starts; a bad
one is a one-line error (exit status 2). A checkpoint folder holds one run: a fresh run
refuses another run's checkpoints (unless --overwrite), --resume refuses a configuration
that changes the trajectory, and a lock keeps two processes out of one folder.

``main`` is kept short: the flags become a ``RunConfig`` (``config``), the run is
``run.train_and_evaluate``, its record goes to ``--out`` (``record``).
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback

from experiments.train.config import OneLineErrors, add_arguments, from_namespace
from experiments.train.record import write_json
from experiments.train.run import train_and_evaluate
from sparsecomm_jax import distributed
from sparsecomm_jax.errors import clipped


def make_parser() -> argparse.ArgumentParser:
    """The command line: one flag per ``RunConfig`` field, one-line errors."""
    parser = OneLineErrors(
        prog="python -m experiments.train",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    parser.set_defaults(devices=0)  # every device of the job
    return parser


def main(argv: list[str] | None = None) -> int:
    """The command line: trains, writes ``--out`` and prints one line; returns the exit
    status (2 for a bad flag, said in one line on stderr, as for any error a user can
    act on)."""
    try:
        config = from_namespace(make_parser().parse_args(argv))
    except SystemExit as e:  # --help (0), or a flag argparse refused (2, said already)
        return e.code if isinstance(e.code, int) else 2
    try:
        record = train_and_evaluate(config)
        if record["rank"] == 0:
            write_json(record, config.out)
    except (ValueError, FloatingPointError, OSError, distributed.JobError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if record["rank"] == 0:
        items = next(k for k in record if k.endswith("_per_s"))
        print(
            f"{ran_as(config.strategy, record)}: final loss {record['losses'][-1]:.4f}, "
            f"step {record['step_time_s'] * 1e3:.1f} ms "
            f"({(record['wall_time_s'] or record['step_time_s']) * 1e3:.1f} ms wall), "
            f"{items} {record[items]:.0f}, "
            f"comm {record['comm_bytes_per_step'] / 1e6:.3f} MB/step/worker"
        )
    return 0


def ran_as(strategy: str, record: dict) -> str:
    """``strategy``, and the strategy that ran where the record says another did
    (``embrace_2d`` runs as ``embrace`` where nothing overlaps)."""
    runs_as = record.get("runs_as", strategy)
    return strategy if runs_as == strategy else f"{strategy} (ran as {runs_as})"


# What a collective or the coordination service says when another process of the job
# has gone (killed, or ended by its own error): the cause is in that process's output.
PEER_GONE = ("Connection closed by peer", "Connection reset by peer")


def peer_gone(error: BaseException) -> str:
    """One line for a failure that only says another process of a multi-process job is
    gone (a gloo collective or the coordination service losing its peer), ``""`` for
    any other: that traceback would bury the line saying which process failed and why."""
    text = " ".join(str(error).split())
    if not isinstance(error, RuntimeError) or not any(mark in text for mark in PEER_GONE):
        return ""
    if not distributed.joined():  # one process: no peer to lose
        return ""
    return (
        f"another process of the job is gone ({clipped(text, 120)}); its own output, "
        "and the launcher's line, say which and why"
    )


def cli() -> None:
    """``main`` as a process: a failed run ends at once with a non-zero status instead
    of waiting at shutdown for threads a failure left behind (orbax, coordination)."""
    try:
        code = main()
    except SystemExit as e:  # argparse: --help (0) or a bad flag (2)
        code = e.code if isinstance(e.code, int) else 2
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        code = 130
    except BaseException as e:
        if line := peer_gone(e):
            print(f"error: {line}", file=sys.stderr)
        else:
            traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    if code:
        os._exit(code)
    sys.exit(0)


if __name__ == "__main__":
    cli()
