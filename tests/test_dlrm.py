"""DLRM: the model under table strategies and mixed layouts against single-device
training, its AUC against a pairwise numpy count, the Criteo TSV reader on generated
files (good and malformed), and a command-line run on such a file."""

import json

import jax
import numpy as np
import optax
import pytest
from helpers import assert_trees_close, reference_run, strategy_run

from experiments.train import main
from models import dlrm, get_workload

SMALL = dict(tables="64,48,24,16", dim=8, bottom="16", top="16", batch=32)


@pytest.mark.matrix
@pytest.mark.parametrize(
    "strategy, options",
    [
        ("embrace", {}),
        ("embrace_rowwise", {"multi_hot": 3}),
        ("embrace", {"table_layouts": "mixed"}),
        ("embrace", {"table_layouts": "table", "multi_hot": 3}),
    ],
)
def test_dlrm_equals_single_device(strategy, options):
    options = dict(options)
    w = get_workload("dlrm", **SMALL, multi_hot=options.pop("multi_hot", 1))
    params = w.init(jax.random.key(0))
    if options.get("table_layouts") == "mixed":  # one of each, the big table by rows
        kinds = ["row", "column", "replicated", "replicated"]
        options["table_layouts"] = dict(zip(w.embedding_paths, kinds, strict=True))
    if options.get("table_layouts") == "table":  # each table whole on one worker
        options["table_layouts"] = dict.fromkeys(w.embedding_paths, "table")
    opt = optax.adagrad(0.1)
    ref_losses, ref_params = reference_run(w, opt, params, 3)
    losses, got, ts = strategy_run(w, opt, params, 3, strategy, **options)
    assert ts.table_update == "rows"
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert_trees_close(got, ref_params, rtol=1e-5, atol=1e-6)


def test_auc_counts_pairs():
    rng = np.random.default_rng(0)
    scores = np.round(rng.normal(size=200), 1).astype(np.float32)  # ties too
    labels = (rng.random(200) < 0.3).astype(np.float32)
    pos, neg = scores[labels == 1], scores[labels == 0]
    pairs = (pos[:, None] > neg[None, :]).mean() + 0.5 * (pos[:, None] == neg[None, :]).mean()
    assert float(dlrm.auc(scores, labels)) == pytest.approx(pairs, rel=1e-5)
    assert float(dlrm.auc(scores, np.ones(200, np.float32))) == 0.5


def write_criteo(path, lines: int, seed: int = 0) -> None:
    """A file in the Criteo format: label, 13 integers, 26 hexadecimal values, some
    fields empty."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(lines):
        dense = [str(x) if rng.random() > 0.1 else "" for x in rng.integers(-2, 500, 13)]
        cats = [f"{x:08x}" if rng.random() > 0.1 else "" for x in rng.integers(0, 2**32, 26)]
        rows.append("\t".join([str(int(rng.random() < 0.25)), *dense, *cats]))
    path.write_text("\n".join(rows) + "\n")


def test_criteo_file_is_read_and_hashed(tmp_path):
    write_criteo(tmp_path / "train.txt", 50)
    rows = dlrm.read_criteo(tmp_path / "train.txt", [64, 48, 24, 16])
    assert rows["dense"].shape == (50, 13) and rows["label"].shape == (50,)
    assert np.all(rows["dense"] >= 0)  # log(1 + max(x, 0))
    for f, v in enumerate([64, 48, 24, 16]):
        assert rows[f"sparse_{f}"].shape == (50, 1)
        assert 0 <= rows[f"sparse_{f}"].min() and rows[f"sparse_{f}"].max() < v
    first = (tmp_path / "train.txt").read_text().splitlines()[0].split("\t")
    assert rows["sparse_0"][0, 0] == (int(first[14], 16) if first[14] else 0) % 64


@pytest.mark.parametrize(
    "line, message",
    [
        ("1\t2\t3", r"train.txt, line 2: 3 fields, a Criteo line has 40"),
        ("x" + "\t0" * 39, "line 2"),
    ],
)
def test_a_malformed_criteo_line_is_named(tmp_path, line, message):
    write_criteo(tmp_path / "train.txt", 1)
    with open(tmp_path / "train.txt", "a") as f:
        f.write(line + "\n")
    with pytest.raises(ValueError, match=message):
        dlrm.read_criteo(tmp_path / "train.txt", [64])


@pytest.mark.cli
def test_dlrm_trains_on_a_criteo_file_from_the_command_line(tmp_path):
    write_criteo(tmp_path / "train.txt", 400)
    out = tmp_path / "r.json"
    args = ["--model", "dlrm", "--strategy", "embrace", "--devices", "4", "--steps", "3"]
    args += ["--tables", "64,48,24,16", "--dim", "8", "--batch", "32", "--optimizer", "adagrad"]
    assert main([*args, "--data-dir", str(tmp_path), "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result["heldout"]["valid"]) >= {"loss", "accuracy", "auc"}
    assert result["config"]["tables"] == "64,48,24,16" and result["samples_per_s"] > 0


@pytest.mark.cli
def test_dlrm_evaluates_its_synthetic_heldout_data_every_few_steps(tmp_path):
    # DLRM's synthetic data has held-out splits, so --eval-every needs no --data-dir.
    out = tmp_path / "r.json"
    args = ["--model", "dlrm", "--strategy", "embrace", "--devices", "2", "--steps", "4"]
    args += ["--tables", "64,48", "--dim", "8", "--batch", "16", "--eval-every", "2"]
    assert main([*args, "--eval-batches", "2", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [e["step"] for e in result["eval"]] == [1, 3]
    assert all(e["split"] == "valid" and e["loss"] > 0 for e in result["eval"])
    assert result["eval"][-1]["loss"] == pytest.approx(result["heldout"]["valid"]["loss"])


def test_criteo_raw_ids_keep_every_bit(tmp_path):
    """``raw=True``: each category's 64 bits as an int64 id, no modulo; the widest
    values (above 2**63) read as negative ids, an empty field as 0."""
    write_criteo(tmp_path / "train.txt", 30)
    lines = (tmp_path / "train.txt").read_text().splitlines()
    first = lines[0].split("\t")
    first[14], first[15] = "ffffffffffffffff", "8000000000000001"
    (tmp_path / "train.txt").write_text("\n".join(["\t".join(first), *lines[1:]]) + "\n")
    rows = dlrm.read_criteo(tmp_path / "train.txt", [64, 48, 24], raw=True)
    assert rows["sparse_0"].dtype == np.int64 and rows["sparse_0"][0, 0] == -1
    assert rows["sparse_1"][0, 0] == np.uint64(0x8000000000000001).view(np.int64)
    for f in range(3):
        want = [int(x.split("\t")[14 + f] or "0", 16) for x in lines[1:]]
        assert rows[f"sparse_{f}"][1:, 0].tolist() == want  # below 2**32 here: unchanged


def test_multi_hot_with_a_criteo_file_is_refused(tmp_path):
    """A Criteo line has one id per feature: a bag size for it would be ignored."""
    write_criteo(tmp_path / "train.txt", 40)
    cfg = dlrm.DLRMConfig(tables="64,48", dim=4, batch=8, multi_hot=3, data_dir=str(tmp_path))
    with pytest.raises(ValueError, match="--multi-hot 3 is for the synthetic data"):
        dlrm.workload(cfg)
