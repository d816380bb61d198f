"""The wire's precision against float32: the loss each ``--comm-dtype`` reaches and the
bytes each exchange compiles to, on the LSTM language model and on DLRM.

Every spec trains the same steps from the same seed on simulated CPU devices (no
network: quality and bytes do not depend on it). The LM reads real text, word by word:
the Python standard library's modules, one file (``stdlib_corpus``), because its
synthetic Zipf tokens are independent and leave a model nothing to learn beyond their
frequencies (its loss falls 1% in 300 steps). The LM's figure is its mean training
loss over the last ``--tail`` steps (a text file has no held-out split here); DLRM's
is its held-out (test split) log loss after the last step (``--eval-every``). A spec
"holds" when its figure is within ``--within`` (1%) of float32's under the first of
``--strategies`` (``embrace``, lossless: the reference every spec and strategy is held
to).

Usage:
    python -m experiments.studies.wire [--steps 300] [--models lstm_lm,dlrm]
        [--strategies embrace,embrace+topk_balanced] [--specs "float32;bfloat16;..."]
        [--out-dir runs/wire] [-- more experiments.train flags, after the model's own]

Writes ``wire.json`` / ``wire.csv`` (a row per model, strategy and spec; a spec the
strategy refuses is a row with its error) and prints the table.
"""

from __future__ import annotations

import statistics
import sys
import sysconfig
from pathlib import Path

from experiments.studies import harness

SPECS = (
    "float32",
    "bfloat16",
    "float8_e4m3fn",
    "float8_e5m2",
    "forward=float8_e4m3fn,backward=float8_e4m3fn,dense=bfloat16",
    "forward=float8_e4m3fn,backward=float8_e5m2,dense=bfloat16",
    "forward=float8_e4m3fn,backward=float8_e4m3fn,dense=float32",
)

# each model's flags: DLRM as the cluster benchmarks run it; the LM with V = 10k and a
# learning rate at which 300 steps on text learn (SGD and the row update for both)
MODELS = {
    "lstm_lm": (
        "--model lstm_lm --vocab 10000 --dim 128 --hidden 128 --batch 64 --seq-len 32 "
        "--sampled-softmax 1024 --lr 1.0"
    ).split(),
    "dlrm": (
        "--model dlrm --tables 100000,50000,20000,10000,5000,1000,500,100 --dim 64 "
        "--bottom 512,256 --top 512,256 --zipf-exponent 1.0 --batch 512 --lr 0.1 "
        "--eval-batches 20"
    ).split(),
}


def stdlib_corpus(out_dir: Path) -> Path:
    """The Python standard library's top-level modules, in name order, as one text file
    in ``out_dir`` (about 0.5M words): real text on any machine, the same on every one
    that runs this Python."""
    path = out_dir / "stdlib_corpus.txt"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
        path.write_text("".join(f.read_text(encoding="utf-8", errors="replace") for f in files))
    return path


def figure(model: str, result: dict, tail: int) -> float:
    """The loss a spec is judged by: DLRM's held-out log loss at the end, the LM's mean
    training loss over its last ``tail`` steps."""
    if model == "dlrm":
        return float(result["heldout"]["test"]["loss"])
    return statistics.fmean(result["losses"][-tail:])


def exchange_bytes(result: dict) -> dict[str, float]:
    """Compiled bytes a step a worker by the dtype that travels (ids are s32)."""
    out: dict[str, float] = {}
    for c in result["collectives"]:
        kind = c["shapes"][0][0]
        out[kind] = out.get(kind, 0.0) + c["bytes_sent"]
    return out


def run(
    model: str, strategy: str, spec: str, steps: int, devices: int, out_dir: Path, extra=()
) -> dict:
    args = [*MODELS[model], "--strategy", strategy, "--optimizer", "sgd"]
    args += ["--steps", str(steps), "--comm-dtype", spec, "--seed", "0"]
    if model == "dlrm":
        args += ["--eval-every", str(steps)]
    else:
        args += ["--text-file", str(stdlib_corpus(out_dir))]
    args += list(extra)
    name = f"{model}_{strategy}_{spec.replace('=', '-').replace(',', '_')}"
    return harness.run_config(args, out_dir / f"{name}.json", nproc=devices)


def table(rows: list[dict], within: float, reference: str) -> str:
    """A line per row: its loss and bytes against ``reference``'s float32 run."""
    head = (
        "model | strategy | comm-dtype | loss | vs float32 | holds | bytes/step/worker | vs float32"
    )
    lines = [head]
    base = {
        r["model"]: r
        for r in rows
        if r["spec"] == "float32" and r["strategy"] == reference and "loss" in r
    }
    for r in rows:
        if "loss" not in r:
            lines.append(f"{r['model']} | {r['strategy']} | {r['spec']} | failed")
            continue
        b = base.get(r["model"])
        rel = r["loss"] / b["loss"] - 1 if b else float("nan")
        ratio = r["bytes"] / b["bytes"] if b else float("nan")
        holds = "yes" if abs(rel) <= within else "NO"
        lines.append(
            f"{r['model']} | {r['strategy']} | {r['spec']} | {r['loss']:.4f} | {rel:+.2%} | "
            f"{holds} | {r['bytes'] / 1e6:.3f} MB | {ratio:.3f}x"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = harness.parser(__name__, __doc__)
    p.add_argument("--steps", type=int, default=300, help="steps of every run")
    p.add_argument("--tail", type=int, default=30, help="LM: steps its final loss averages")
    p.add_argument("--devices", type=int, default=4, help="simulated devices")
    p.add_argument("--models", default=",".join(MODELS), help="comma-separated")
    p.add_argument(
        "--strategies", default="embrace", help="comma-separated; the first is the reference"
    )
    p.add_argument("--specs", default=";".join(SPECS), help="semicolon-separated")
    p.add_argument("--within", type=float, default=0.01, help="the loss tolerance")
    own, extra = harness.split_argv(argv)
    args = p.parse_args(own)
    out_dir = Path(args.out_dir)
    strategies = args.strategies.split(",")
    jobs = [
        (m, t, s) for m in args.models.split(",") for t in strategies for s in args.specs.split(";")
    ]

    def measure(model: str, strategy: str, spec: str) -> dict:
        result = run(model, strategy, spec, args.steps, args.devices, out_dir, extra)
        sent = exchange_bytes(result)
        ids = sent.get("s32", 0.0)
        return {
            "model": model,
            "strategy": strategy,
            "spec": spec,
            "loss": figure(model, result, args.tail),
            "bytes": result["comm_bytes_per_step"] - ids,
            "bytes_by_dtype": sent,
            "final_train_loss": result["losses"][-1],
        }

    rows = harness.grid(jobs, measure, "wire")
    for r in rows:
        if "job" in r:
            r["model"], r["strategy"], r["spec"] = r["job"]
    harness.save_rows(rows, out_dir, "wire", {"steps": args.steps, "within": args.within})
    print(table(rows, args.within, strategies[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
