"""The docs as a user reads them: every page's Python blocks run in order as one script;
the extending guide's from a file of its own, in a fresh process, as a user's own file
would; the command line's reference page is the one its fields generate; every public
name of the front door has its API page."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

import sparsecomm_jax as sc
from experiments.train import reference
from experiments.train.config import RunConfig

DOCS = Path(REPO) / "docs"
PAGES = sorted(p for p in DOCS.rglob("*.md") if "lab" not in p.relative_to(DOCS).parts)
# Pages that register values: run in a fresh process, so nothing leaks into the others.
OWN_PROCESS = {"guides/extending.md"}


def blocks(page: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", page.read_text(), re.S)


def name(page: Path) -> str:
    return str(page.relative_to(DOCS))


@pytest.mark.parametrize("page", [p for p in PAGES if blocks(p)], ids=name)
def test_every_page_runs(page, tmp_path, capsys):
    script = "\n".join(blocks(page))
    if name(page) in OWN_PROCESS:
        own = tmp_path / "mine.py"  # as a user's own file, nothing of the repository touched
        own.write_text(script)
        done = subprocess.run(
            [sys.executable, str(own)], cwd=REPO, capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, done.stderr[-3000:]
        return
    exec(compile(script, str(page), "exec"), {"__name__": "__page__"})
    assert capsys.readouterr().out  # every page shows what it did


def test_the_pages_say_what_they_show(capsys):
    """A few printed results of the pages, checked (the rest are checked by the tests of
    what they show)."""
    exec(compile("\n".join(blocks(DOCS / "guides" / "optax.md")), "optax", "exec"), {})
    out = capsys.readouterr().out
    assert "rows changed: [1, 3]" in out and "adamw with clipping: dense" in out


def test_the_command_line_reference_is_current():
    """``docs/cli.md`` is what ``experiments.train.reference`` generates now (run
    ``python -m experiments.train.reference docs/cli.md`` after changing a flag), and
    every flag stands in exactly one of its sections."""
    assert (DOCS / "cli.md").read_text() == reference.markdown()
    placed = [f for names in reference.SECTIONS.values() for f in names]
    fields = [f.name for f in RunConfig.__dataclass_fields__.values()]
    assert sorted(placed) == sorted(fields), set(placed) ^ set(fields)


def test_every_public_name_has_an_api_page():
    """Each name of ``sparsecomm_jax.__all__`` is on the front door's page, linked to the
    page whose ``automodule`` documents the module that defines it."""
    front = (DOCS / "api" / "front-door.md").read_text()
    documented = {}
    for page in (DOCS / "api").glob("*.md"):
        for module in re.findall(r"^\.\. automodule:: (\S+)", page.read_text(), re.M):
            documented[module] = page.name
    missing = []
    for public in sc.__all__:
        row = re.search(rf"^\| `sc\.{public}` \|.*\]\((\S+\.md)\) \|$", front, re.M)
        module = sc._EXPORTS[public]
        if public == "vary":  # defined in comm.vma, exported by aggregators
            module = "sparsecomm_jax.comm.vma"
        if not row or documented.get(module) != row.group(1):
            missing.append(f"{public} ({module})")
    assert not missing, missing
