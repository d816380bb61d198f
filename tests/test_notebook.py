"""notebooks/your_own_model.ipynb runs from top to bottom on simulated devices, and
what it prints is consistent: five runs (one of an NNX model), each with bytes and a
falling loss."""

import os
import re

import nbformat
import pytest
from nbclient import NotebookClient

from tests.conftest import REPO

pytestmark = pytest.mark.processes

NOTEBOOK = os.path.join(REPO, "notebooks", "your_own_model.ipynb")


def _stdout(nb) -> str:
    return "".join(
        out.get("text", "")
        for cell in nb.cells
        if cell.cell_type == "code"
        for out in cell.get("outputs", [])
        if out.get("name") == "stdout"
    )


def test_notebook_runs(monkeypatch):
    # the kernel imports this checkout, whatever is installed
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    nb = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(
        nb, timeout=180, kernel_name="python3", resources={"metadata": {"path": REPO}}
    ).execute()
    text = _stdout(nb)
    assert "residual per worker: (8, 512, 32)" in text
    rows = re.findall(r"^(.+?)\s+([\d.]+) kB/worker/step\s+final loss ([\d.]+)$", text, re.M)
    names = ["dense_pmap", "embrace", "embrace, clip + schedule", "embrace, NNX"]
    assert [r[0].strip() for r in rows] == [*names, "topk_a2a (own step)"]
    kbytes = [float(r[1]) for r in rows]
    assert all(b > 0 for b in kbytes) and len({kbytes[0], kbytes[1], kbytes[4]}) == 3
    assert kbytes[3] == kbytes[1]  # the NNX model's program sends what the Linen one's does
    assert "NnxTopicClassifier (512, 32)" in text
    assert all(float(r[2]) < 1.0 for r in rows)  # from ln(4) = 1.39 at the start
    assert any(
        out.get("output_type") == "display_data" for c in nb.cells for out in c.get("outputs", [])
    )
