"""Every docstring example of the package, the models and the experiments runs as
written, on the suite's 8 simulated CPU devices (the devices the examples assume)."""

import doctest
import importlib
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("sparsecomm_jax", "models", "experiments")
FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
# an example line that runs: not a comment, not marked to be skipped
RUNS = re.compile(r"^\s*>>> (?!#)(?!.*doctest: \+SKIP)", re.MULTILINE)


def modules_with_examples() -> list[str]:
    """The importable names of the modules with an example that runs (modules whose
    examples are only comments, or skipped, are left out)."""
    names = []
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            if RUNS.search(path.read_text()):
                parts = path.relative_to(REPO).with_suffix("").parts
                names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


@pytest.mark.parametrize("name", modules_with_examples())
def test_docstring_examples_run_as_written(name):
    runner = doctest.DocTestRunner(optionflags=FLAGS)
    report: list[str] = []
    for test in doctest.DocTestFinder().find(importlib.import_module(name)):
        runner.run(test, out=report.append)
    assert runner.tries > 0, f"{name} has an example line but doctest found none"
    assert runner.failures == 0, "".join(report)
