"""A quick check of one accelerator: selectors and scatter-add at d = 25M, one training
step of every model on one device, a profiler trace, and the first model's program set
beside the compile-only one for the same card; sized for under eight minutes on one GPU.

    python -m experiments.gpu_check --out gpu_check.json
    python -m experiments.gpu_check --small --out /tmp/gpu_check.json   # CPU, seconds

Writes a JSON (device, jax version, every timing in seconds) and prints a short table
(GB/s = the 4 d bytes of the float32 vector over the time). The trace
(``<--out without .json>.trace/``) holds two more steps of the first model; open it with
TensorBoard's profile plugin or at ui.perfetto.dev (``*.trace.json.gz``).

On an H100 or H200 the first model's step is also compiled for the compile-only
description of that card (``sparsecomm_jax.compile_only``, in a child process with
``JAX_PLATFORMS=cpu``: ``python -m experiments.gpu_schedule --gpus 1``), and the two
programs are compared: the entry computation's operations by opcode and the peak memory.
Equal counts say the description this library compiles GPU programs from on a CPU host
leads XLA to the program the real card gets; a difference is listed. Elsewhere (a CPU, or
a card with no description) the comparison is skipped, saying why.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from experiments.studies.selection_cost import selector_times
from experiments.train import build, start_devices
from experiments.train.config import RunConfig
from models import MODELS
from sparsecomm_jax import compile_only, loss_value
from sparsecomm_jax.comm import hlo
from sparsecomm_jax.comm.costmodel import median_seconds
from sparsecomm_jax.topk import selectors

# One-device model sizes: mid-size on an accelerator, tiny with --small.
FULL_SIZES: dict[str, dict[str, Any]] = {
    "lstm_lm": dict(vocab=100_000, dim=512, hidden=1024, seq_len=32, batch=64),
    "transformer": dict(vocab=32_000, dim=512, heads=8, layers=6, seq_len=64, batch=32),
    "bert": dict(vocab=30_522, dim=768, heads=12, layers=12, seq_len=128, batch=32, masked=20),
    "gpt2": dict(vocab=50_257, dim=768, heads=12, layers=12, seq_len=512, batch=8),
    "resnet": dict(width=64, blocks=2, batch=128),
    "vgg": dict(width=64, blocks=2, batch=128),
    "dlrm": dict(
        tables="1000000,500000,100000,50000,10000,5000,1000,100",
        dim=64,
        bottom="512,256",
        top="512,256",
        batch=2048,
    ),
}
FULL_SIZES["dlrm_nnx"] = FULL_SIZES["dlrm"]  # the same models in flax NNX
FULL_SIZES["lstm_lm_nnx"] = FULL_SIZES["lstm_lm"]
SMALL_SIZES = dict(vocab=200, dim=16, hidden=16, heads=2, seq_len=8, batch=4, width=4)


def scatter_add_times(size: int, density: float, workers: int = 8) -> dict[str, float]:
    """Seconds of ``topk.selectors.densify`` (scatter-add) of k and of ``workers * k`` pairs."""
    k = selectors.num_selected(density, size)
    rng = np.random.default_rng(0)
    out = {}
    for name, n in (("k", k), (f"{workers}k", workers * k)):
        values = jnp.asarray(rng.normal(size=n).astype(np.float32))
        indices = jnp.asarray(rng.integers(0, size, n).astype(np.int32))
        out[name] = median_seconds(
            jax.jit(lambda v, i: selectors.densify(v, i, size)), values, indices
        )
    return out


def model_step(
    model: str, overrides: dict[str, Any], trace_dir: Path | None = None, steps: int = 4
) -> dict[str, Any]:
    """Compile time, first step and median later step of the library's dense train
    step of ``model`` on one device; with ``trace_dir``, two more steps profiled there."""
    config = RunConfig(model=model, devices=1, strategy="dense", steps=steps + 2, **overrides)
    workload, ts = build(config)
    batches = [ts.place_batch(workload.batch_at(step)) for step in range(steps + 2)]
    t = time.perf_counter()
    program = ts.step.lower(ts.state, batches[0]).compile()
    compile_s = time.perf_counter() - t
    state, times = ts.state, []
    for batch in batches[:steps]:
        t = time.perf_counter()
        state, loss = program(state, batch)
        loss = loss_value(loss)
        times.append(time.perf_counter() - t)
    params = sum(int(np.size(x)) for x in jax.tree.leaves(ts.host_params(state)))
    out = {
        "model": model,
        "params": params,
        "compile_s": compile_s,
        "first_step_s": times[0],
        "step_s": statistics.median(times[1:]),
        "loss": loss,
        "program": program_summary(
            program.as_text(), getattr(program.memory_analysis(), "peak_memory_in_bytes", 0)
        ),
    }
    if trace_dir:
        out["trace"] = trace_steps(program, state, batches[steps:], trace_dir)
    return out


def program_summary(text: str, peak: int) -> dict[str, Any]:
    """A compiled program in brief: its entry computation's operations by opcode, and
    ``peak``, its peak memory per device (``memory_analysis``)."""
    opcodes = collections.Counter(i.opcode for i in hlo.entry_instructions(text))
    return {"opcodes": dict(sorted(opcodes.items())), "peak_memory_in_bytes": int(peak)}


def card_of(device_kind: str) -> str | None:
    """The key of ``compile_only.GPUS`` describing ``device_kind`` ("NVIDIA H100 80GB
    HBM3" -> ``"h100"``), or ``None``."""
    return next((g for g in compile_only.GPUS if g in device_kind.lower()), None)


def compile_only_summary(gpu: str, model: str, overrides: dict[str, Any]) -> dict[str, Any]:
    """``model``'s dense step on one compile-only ``gpu``, compiled by
    ``experiments.gpu_schedule`` in a child process (it needs ``JAX_PLATFORMS=cpu``
    before JAX starts), as ``program_summary`` gives it."""
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in overrides.items()]
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "one_gpu.json"
        command = [sys.executable, "-m", "experiments.gpu_schedule", "--gpu", gpu, "--gpus", "1"]
        command += ["--model", model, "--strategy", "dense", *flags, "--out", str(out)]
        env = {**os.environ, "JAX_PLATFORMS": "cpu"}
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
        if done.returncode:
            raise RuntimeError(f"gpu_schedule failed: {done.stderr.strip()[-300:]}")
        report = json.loads(out.read_text())
        text = Path(report["hlo"]).read_text()
    return program_summary(text, report["programs"]["first call"]["memory"]["peak_memory_in_bytes"])


def compare_programs(real: dict[str, Any], described: dict[str, Any]) -> dict[str, Any]:
    """Where the real card's program and the compile-only one differ: opcodes whose
    counts differ (``{opcode: [real, compile-only]}``) and the two peaks."""
    codes = sorted(set(real["opcodes"]) | set(described["opcodes"]))
    differ = {
        c: [real["opcodes"].get(c, 0), described["opcodes"].get(c, 0)]
        for c in codes
        if real["opcodes"].get(c, 0) != described["opcodes"].get(c, 0)
    }
    return {
        "same_opcodes": not differ,
        "opcodes_that_differ": differ,
        "peak_memory_in_bytes": [real["peak_memory_in_bytes"], described["peak_memory_in_bytes"]],
    }


def schedule_comparison(first: dict[str, Any], size: dict[str, Any], kind: str) -> dict[str, Any]:
    """The first model's real program against the compile-only one for this card, or
    ``{"skipped": why}``."""
    gpu = card_of(kind)
    if "program" not in first:
        return {"skipped": f"the first model failed: {first.get('error')}"}
    if jax.default_backend() != "gpu" or gpu is None:
        return {
            "skipped": f"{kind!r} has no compile-only description ({sorted(compile_only.GPUS)})"
        }
    try:
        described = compile_only_summary(gpu, first["model"], size)
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
        return {"skipped": f"{type(e).__name__}: {e}"}
    return {"gpu": gpu, "model": first["model"], **compare_programs(first["program"], described)}


def trace_steps(program, state, batches: list, folder: Path) -> dict[str, Any]:
    """``program`` over ``batches`` under ``jax.profiler``; the files written."""
    jax.profiler.start_trace(str(folder))
    for batch in batches:
        state, loss = program(state, batch)
        loss_value(loss)
    jax.profiler.stop_trace()
    files = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
    return {"dir": str(folder), "files": files}


def guarded(fn, model: str, *args) -> dict[str, Any]:
    """``fn(model, *args)``, or ``{"model", "error"}`` when it raises (an out-of-memory
    model must not hide the others' figures)."""
    try:
        return fn(model, *args)
    except Exception as e:  # recorded in the JSON and the table
        first_line = (str(e).splitlines() or [""])[0][:200]
        return {"model": model, "error": f"{type(e).__name__}: {first_line}"}


def run_check(small: bool, models: list[str], trace_dir: Path) -> dict[str, Any]:
    """Every timing of the check, as a JSON-ready dict."""
    size = 1 << 16 if small else 25_000_000
    started = time.perf_counter()
    sizes = {m: SMALL_SIZES if small else FULL_SIZES[m] for m in models}
    result: dict[str, Any] = {
        "device": str(jax.devices()[0].device_kind),
        "backend": jax.default_backend(),
        "jax": jax.__version__,
        "size": size,
        "density": 0.01,
        "selectors_s": selector_times(size, 0.01, num_shards=8),
        "scatter_add_s": scatter_add_times(size, 0.01),
        "models": [
            guarded(model_step, m, sizes[m], trace_dir if i == 0 else None)
            for i, m in enumerate(models)
        ],
    }
    first = result["models"][0]
    result["compile_only"] = schedule_comparison(first, sizes[models[0]], result["device"])
    result["trace"] = {"model": first["model"], **first.pop("trace", {"error": first.get("error")})}
    result["total_s"] = time.perf_counter() - started
    return result


def table(result: dict[str, Any]) -> str:
    """The short text table printed at the end."""
    d = result["size"]
    rows = [f"{result['backend']} {result['device']}, jax {result['jax']}, d = {d:,}"]
    scatter = {f"scatter_add {k}": v for k, v in result["scatter_add_s"].items()}
    for name, s in {**result["selectors_s"], **scatter}.items():
        rows.append(f"  {name:<22} {s * 1e3:10.3f} ms  {4 * d / s / 1e9:8.1f} GB/s")
    rows.append(f"  {'model':<12} {'params':>12} {'compile s':>10} {'step ms':>10}")
    for m in result["models"]:
        if "error" in m:
            rows.append(f"  {m['model']:<12} failed: {m['error']}")
            continue
        rows.append(
            f"  {m['model']:<12} {m['params']:>12,} {m['compile_s']:>10.1f} "
            f"{m['step_s'] * 1e3:>10.2f}"
        )
    same = result["compile_only"]
    if "skipped" in same:
        rows.append(f"  compile-only comparison skipped: {same['skipped']}")
    else:
        verdict = (
            "same operations" if same["same_opcodes"] else f"differ: {same['opcodes_that_differ']}"
        )
        real, described = (b / 2**20 for b in same["peak_memory_in_bytes"])
        rows.append(
            f"  {same['model']} on this card vs compile-only {same['gpu']}: {verdict}; "
            f"peak {real:.1f} vs {described:.1f} MiB"
        )
    trace = result["trace"]
    rows.append(f"  trace: {trace.get('dir')} {trace.get('files', trace.get('error'))}")
    rows.append(f"  total {result['total_s']:.0f} s")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.gpu_check", description=__doc__)
    parser.add_argument(
        "--small", action="store_true", help="tiny sizes (d = 65536, tiny models) that run on a CPU"
    )
    parser.add_argument(
        "--models", default=",".join(MODELS), help="comma-separated models (default: all)"
    )
    parser.add_argument("--out", default="gpu_check.json", help="the JSON result path")
    args = parser.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    unknown = sorted(set(models) - set(MODELS))
    if unknown or not models:
        print(f"error: unknown --models {unknown}; choose from {sorted(MODELS)}", file=sys.stderr)
        return 2
    start_devices(1)
    out = Path(args.out)
    result = run_check(args.small, models, out.with_name(out.stem + ".trace"))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
