"""experiments.gpu_check with --small: every section runs and its JSON is complete."""

import json

import jax
import numpy as np
import pytest

from experiments import gpu_check
from experiments.train.config import RunConfig
from models import MODELS, get_workload

jax.devices()  # start JAX on conftest's 8 devices: runs with --devices < 8 must not shrink it


@pytest.mark.cli
def test_small_check_writes_json_table_and_trace(tmp_path, capsys):
    out = tmp_path / "check.json"
    assert gpu_check.main(["--small", "--models", "gpt2", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result["selectors_s"]) >= {"exact", "radix", "threshold"}
    assert all(t > 0 for t in [*result["selectors_s"].values(), *result["scatter_add_s"].values()])
    assert [m["model"] for m in result["models"]] == ["gpt2"]
    for m in result["models"]:
        assert m["step_s"] > 0 and np.isfinite(m["loss"]), m
        config = RunConfig(model=m["model"], **gpu_check.SMALL_SIZES)
        w = get_workload(m["model"], **config.model_overrides())
        leaves = jax.tree.leaves(w.init(jax.random.key(0)))
        assert m["params"] == sum(x.size for x in leaves)
    assert any(f.endswith((".xplane.pb", ".trace.json.gz")) for f in result["trace"]["files"])
    table = capsys.readouterr().out
    assert "radix" in table and "gpt2" in table and "trace:" in table


def test_every_model_has_a_full_size_and_bad_models_are_refused(capsys):
    assert set(gpu_check.FULL_SIZES) == set(MODELS)
    assert gpu_check.main(["--small", "--models", "nope"]) == 2
    assert "unknown --models ['nope']" in capsys.readouterr().err


@pytest.mark.cli
def test_a_failing_model_is_recorded_not_fatal():
    def boom(model, sizes):
        raise MemoryError("out of memory\nsecond line")

    assert gpu_check.guarded(boom, "bert", {}) == {
        "model": "bert",
        "error": "MemoryError: out of memory",
    }

    def silent(model):
        raise MemoryError()

    assert gpu_check.guarded(silent, "vgg") == {"model": "vgg", "error": "MemoryError: "}
