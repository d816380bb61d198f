"""The command line's reference page, generated from ``RunConfig``'s field metadata:
one table per section, one row per flag (its default, its choices and its help).

    python -m experiments.train.reference docs/cli.md

A test compares ``docs/cli.md`` with ``markdown()``: the page is never stale.

Example:
    >>> print(markdown().splitlines()[0])
    # The command line: `python -m experiments.train`
"""

from __future__ import annotations

import dataclasses
import sys

from experiments.train.command import make_parser
from experiments.train.config import RunConfig, _choices

# The sections of the page, each field of RunConfig in exactly one (a test checks).
SECTIONS: dict[str, tuple[str, ...]] = {
    "The run": ("model", "strategy", "devices", "replicas", "steps", "warmup", "seed"),
    "Optimizer and tables": (
        "optimizer",
        "lr",
        "table_update",
        "comm_dtype",
        "capacity",
        "plan",
        "plan_memory_mb",
        "hot_rows",
        "histogram",
    ),
    "Top-k strategies": (
        "density",
        "selector",
        "bucket_mb",
        "capacity_factor",
        "link_gbit",
        "link_alpha_us",
    ),
    "Models and synthetic data": (
        "batch",
        "seq_len",
        "vocab",
        "dim",
        "hidden",
        "layers",
        "heads",
        "masked",
        "image_size",
        "width",
        "blocks",
        "noise",
        "sampled_softmax",
        "tie_embeddings",
        "tables",
        "bottom",
        "top",
        "multi_hot",
        "raw_ids",
        "zipf_exponent",
    ),
    "Steps and failures": (
        "nonfinite",
        "max_skipped",
        "in_flight",
        "steps_per_call",
        "overlap",
        "collectives_overlap",
    ),
    "Checkpoints": ("checkpoint_dir", "checkpoint_every", "resume", "resume_step", "overwrite"),
    "Data, outputs and logs": (
        "data_dir",
        "text_file",
        "out",
        "eval_every",
        "eval_batches",
        "log_dir",
        "profile_steps",
        "calibrate",
    ),
}

INTRO = """\
Every flag of `python -m experiments.train` (`--help` prints the same), one line each,
generated from the fields of `experiments.train.config.RunConfig`
(`python -m experiments.train.reference docs/cli.md`). Every flag is checked before JAX
starts; a bad value is a one-line error naming the flag, exit status 2.
"""


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _row(field: dataclasses.Field, default) -> str:
    flag = "--" + field.name.replace("_", "-")
    shown = "off" if default is False else "on" if default is True else f"`{default!r}`"
    help_text = field.metadata["help"].replace("%(choices)s", "the strategies below")
    choices = _choices(field)
    if choices is not None and len(choices) <= 12:
        help_text += f"; one of {', '.join(f'`{c}`' for c in choices)}"
    return f"| `{flag}` | {shown} | {_cell(help_text)} |"


def markdown() -> str:
    """The page: each section a table of its flags."""
    fields = {f.name: f for f in dataclasses.fields(RunConfig)}
    parser = make_parser()  # the command line's defaults (--devices: 0, every device)
    parts = ["# The command line: `python -m experiments.train`", "", INTRO]
    for title, names in SECTIONS.items():
        parts += [f"## {title}", "", "| flag | default | what |", "|---|---|---|"]
        parts += [_row(fields[name], parser.get_default(name)) for name in names]
        parts.append("")
    strategies = _choices(fields["strategy"])
    parts += ["## Strategies", "", "`--strategy` takes one of:", ""]
    parts += [", ".join(f"`{s}`" for s in strategies), ""]
    return "\n".join(parts + _comparison())


def _comparison() -> list[str]:
    """The section of ``python -m experiments.compare``: its own flags and defaults."""
    from experiments import compare

    parser = compare.make_parser()
    own = [a for a in parser._actions if a.dest in ("strategies", "out_dir")]
    defaults = ", ".join(f"`--{k.replace('_', '-')} {v}`" for k, v in compare.HEADLINE.items())
    lines = [
        "## The comparison: `python -m experiments.compare`",
        "",
        "Runs each strategy with the flags above (all but `--strategy` and `--out`), "
        f"defaulting to the headline comparison ({defaults}); prints the table, a short "
        "recommendation drawn from it (the lossless strategy of least mean step here and "
        "on each modelled link, why, the slowest and why, what the run can say of the "
        "lossy strategies), and writes `compare.json` and `compare.csv`. Its own flags:",
        "",
        "| flag | default | what |",
        "|---|---|---|",
    ]
    lines += [f"| `{a.option_strings[0]}` | `{a.default!r}` | {_cell(a.help)} |" for a in own]
    return [*lines, ""]


def main(argv: list[str] | None = None) -> int:
    """Writes the page to the path given (standard output without one)."""
    argv = sys.argv[1:] if argv is None else argv
    text = markdown()
    if argv:
        with open(argv[0], "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
