"""The run configuration shared by every experiment script, and its CLI flags."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any


@dataclasses.dataclass
class RunConfig:
    model: str = "lstm_lm"  # workload name (models.MODELS)
    strategy: str = "dense"  # communication strategy (sparsecomm_jax.train.STRATEGIES)
    devices: int = 8  # workers; on a CPU-only host this many devices are simulated
    steps: int = 20  # training steps
    warmup: int = 2  # first steps left out of the step-time median (compilation)
    seed: int = 0  # init and data seed
    optimizer: str = "adam"  # sgd | momentum | adam | adagrad | lazy_adam
    table_update: str = "auto"  # auto (row-sparse when it can) | sparse | dense
    comm_dtype: str = "float32"  # float32 | bfloat16 (row exchanges and dense all-reduce)
    lr: float = 1e-3  # learning rate
    batch: int = 32  # global batch (examples per step, all workers together)
    seq_len: int = 16  # tokens per example (language models)
    vocab: int = 2000  # vocabulary size V (language models)
    dim: int = 32  # embedding / model width D
    hidden: int = 64  # LSTM units per layer
    layers: int = 1  # recurrent or transformer layers
    heads: int = 2  # attention heads (transformer, bert, gpt2)
    masked: int = 3  # masked positions per example (bert)
    image_size: int = 32  # image height = width (resnet, vgg)
    width: int = 8  # channels of the first stage (resnet, vgg)
    blocks: int = 1  # blocks per stage (resnet, vgg)
    noise: float = 1.0  # noise std of the synthetic images (resnet, vgg)
    sampled_softmax: int = 0  # shared negative samples per step; 0 = full softmax
    tie_embeddings: bool = False  # tie the output table to the input table
    zipf_exponent: float = 1.1  # Zipf exponent of synthetic tokens
    text_file: str = ""  # word-level corpus instead of synthetic tokens
    capacity: int = 0  # embrace_rowwise slots per bucket; 0 = sized per batch
    density: float = 0.01  # fraction sent by top-k strategies, in (0, 1]
    selector: str = "exact"  # top-k selection: exact | radix (same, no sort) | threshold
    bucket_mb: float = 64.0  # tensor-fusion threshold in MiB for top-k strategies
    link_gbit: float = 10.0  # adaptive: link Gbit/s of the cost model; 0 = calibrate here
    link_alpha_us: float = 50.0  # adaptive: latency per message of the cost model (us)
    nonfinite: str = "skip"  # NaN/Inf gradient: skip the step (counted) | error | off
    checkpoint_dir: str = ""  # where checkpoints go ("" = none)
    checkpoint_every: int = 0  # save every N steps (0 = only at the end)
    resume: bool = False  # continue from the newest checkpoint in --checkpoint-dir
    calibrate: bool = False  # after training, fit the link's alpha and beta (costmodel)
    out: str = ""  # JSON result path ("" = do not write)
    # real data, logs and traces (help text: IO_HELP)
    data_dir: str = ""  # WikiText / PTB token files or CIFAR-10 batches
    eval_every: int = 0  # held-out evaluation every N steps (0 = only at the end)
    eval_batches: int = 0  # held-out batches per evaluation (0 = the whole split)
    log_dir: str = ""  # per-step logs and traces ("" = next to --out)
    profile_steps: str = ""  # A:B = trace steps A .. B-1 with jax.profiler

    def model_overrides(self) -> dict[str, Any]:
        """The fields a model config may take (models ignore the ones they lack)."""
        skip = {"model", "strategy", "devices", "steps", "warmup", "optimizer", "lr", "out",
                "capacity", "density", "selector", "bucket_mb", "nonfinite", "link_gbit",
                "link_alpha_us", "table_update", "comm_dtype",
                "checkpoint_dir", "checkpoint_every", "resume", "calibrate",
                *RUN_IO_FIELDS}  # fmt: skip
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in skip}


RUN_IO_FIELDS = ("eval_every", "eval_batches", "log_dir", "profile_steps")
IO_HELP = {
    "data_dir": "folder of local data, nothing is downloaded: WikiText (wiki.{train,valid,"
    "test}.tokens) or PTB (ptb.{train,valid,test}.txt) for the language models, "
    "cifar-10-batches-py/ for resnet and vgg",
    "text_file": "one word-level text file as training data (language models only; no "
    "held-out split)",
    "eval_every": "held-out loss and perplexity/accuracy every N steps and at the end "
    "(0 = only at the end); needs --data-dir",
    "eval_batches": "held-out batches per evaluation (0 = the whole split)",
    "log_dir": "per-step logs (steps.jsonl, TensorBoard scalars) and traces go here; "
    "default: <--out without .json>.logs/ when --out is given, else none",
    "profile_steps": "A:B = a jax.profiler trace of steps A to B-1 into <log dir>/trace "
    "(open with TensorBoard's profile plugin or ui.perfetto.dev)",
}


def add_arguments(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    """One ``--flag`` per ``RunConfig`` field (``seq_len`` -> ``--seq-len``)."""
    for f in dataclasses.fields(RunConfig):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        if f.type in (bool, "bool"):
            parser.add_argument(flag, action="store_true", default=f.default)
        else:
            kind = {"int": int, "float": float, "str": str}[str(f.type)]
            parser.add_argument(flag, type=kind, default=f.default, help=IO_HELP.get(f.name))


def from_namespace(ns: argparse.Namespace) -> RunConfig:
    names = {f.name for f in dataclasses.fields(RunConfig)}
    return RunConfig(**{k: v for k, v in vars(ns).items() if k in names})
