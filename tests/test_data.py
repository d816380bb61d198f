"""Local data files: WikiText / PTB token files for every language model, CIFAR-10
pickle batches for the CNNs, held-out batches and metrics, and clear errors."""

import collections
import dataclasses
import json
import os
import pickle

import jax
import numpy as np
import optax
import pytest

import sparsecomm_jax as sc
from experiments.train import main, train_and_evaluate
from experiments.train.config import RunConfig
from experiments.train.record import write_json
from models import datasets, get_workload, heldout, vision
from models.bert import MASK_ID
from models.data import read_words
from sparsecomm_jax import runtime

jax.devices()  # start JAX on conftest's 8 devices: runs with --devices < 8 must not shrink it

LMS = ("lstm_lm", "transformer", "gpt2", "bert")
TINY = dict(vocab=40, dim=8, hidden=8, seq_len=6, batch=4, masked=2)


def write_corpus(folder, layout="WikiText", seed=0, lines=(120, 30, 30)):
    """Random word-level splits in ``layout``'s file names; returns split -> lines."""
    rng = np.random.default_rng(seed)
    words = [f"w{i}" for i in range(60)] + ["<unk>", "the", "the", "the"]
    out = {}
    for split, n in zip(datasets.SPLITS, lines, strict=True):
        out[split] = [" ".join(rng.choice(words, rng.integers(0, 9))) for _ in range(n)]
        path = folder / datasets.TEXT_LAYOUTS[layout][split]
        path.write_text("\n".join(out[split]) + "\n", encoding="utf-8")
    return out


def reference_ids(lines, train_lines, vocab_size, specials=("<unk>",)):
    """Tokenise by hand: top words of train (ties by spelling), ``<eos>`` per line."""
    tokens = lambda ls: [w for line in ls for w in [*line.split(), "<eos>"]]  # noqa: E731
    counts = collections.Counter(w for w in tokens(train_lines) if w not in specials)
    top = sorted(counts, key=lambda w: (-counts[w], w))[: vocab_size - len(specials)]
    vocab = {w: i for i, w in enumerate([*specials, *top])}
    return np.array([vocab.get(w, vocab["<unk>"]) for w in tokens(lines)]), vocab


@pytest.mark.parametrize("layout", ["WikiText", "PTB"])
def test_corpus_matches_hand_tokenisation(tmp_path, layout):
    lines = write_corpus(tmp_path, layout, seed=len(layout))
    corpus = datasets.load_corpus(tmp_path, vocab_size=30)
    for split in datasets.SPLITS:
        want, vocab = reference_ids(lines[split], lines["train"], 30)
        np.testing.assert_array_equal(corpus.splits[split], want)
    assert corpus.vocab == vocab and corpus.vocab["<unk>"] == 0


def test_missing_files_name_the_files_expected(tmp_path):
    write_corpus(tmp_path)
    (tmp_path / "wiki.test.tokens").unlink()
    with pytest.raises(ValueError, match="wiki.test.tokens.*ptb.train.txt"):
        datasets.load_corpus(tmp_path, 30)
    with pytest.raises(ValueError, match="cifar-10-batches-py/.*data_batch_1.*batches.meta"):
        datasets.cifar_folder(tmp_path)


def test_too_short_heldout_file_names_the_split(tmp_path):
    write_corpus(tmp_path, "PTB")
    (tmp_path / "ptb.valid.txt").write_text("w1\n")  # 2 tokens with <eos>
    w = get_workload("gpt2", **TINY, data_dir=str(tmp_path))
    with pytest.raises(ValueError, match="the valid file of --data-dir has 2 tokens"):
        w.heldout("valid")
    assert len(w.heldout("test")) > 0


def test_heldout_windows_predict_every_token_once():
    ids = np.random.default_rng(1).integers(0, 50, 103).astype(np.int32)
    chunks = datasets.heldout_windows(ids, length=7, batch=4, overlap=1)
    windows = np.concatenate(chunks)  # 17 windows of 6 targets; 16 fit 4 chunks of 4
    assert len(chunks) == 4 and all(c.shape == (4, 7) for c in chunks)
    np.testing.assert_array_equal(windows[:, 1:].reshape(-1), ids[1 : 1 + 16 * 6])
    np.testing.assert_array_equal(windows[:, 0], ids[0 : 16 * 6 : 6])
    assert len(datasets.heldout_windows(ids, 7, 4, max_batches=2, overlap=1)) == 2
    with pytest.raises(ValueError, match="fewer than length"):
        datasets.heldout_windows(ids[:5], 7, 4)


def _is_window_of(row, ids):
    n = len(row)
    return any(np.array_equal(ids[s : s + n], row) for s in range(len(ids) - n + 1))


def _example_tokens(name, batch):
    """Each example's text tokens as the model's batch carries them."""
    if name == "transformer":
        return batch["src"]
    if name == "bert":
        tokens = batch["tokens"].copy()
        np.put_along_axis(tokens, batch["positions"], batch["labels"], axis=1)
        return tokens
    return batch["tokens"]


@pytest.mark.parametrize("name", LMS)
@pytest.mark.parametrize("source", ["data_dir", "text_file"])
def test_every_language_model_reads_the_text(tmp_path, name, source):
    write_corpus(tmp_path)
    where = tmp_path if source == "data_dir" else tmp_path / "wiki.train.tokens"
    w = get_workload(name, **TINY, **{source: str(where)})
    synthetic = get_workload(name, **TINY)
    specials = ("[MASK]", "<unk>") if name == "bert" else ("<unk>",)
    train = datasets.load_corpus(tmp_path, 40, specials).splits["train"]
    batch = w.batch_at(3)
    assert jax.tree.map(np.shape, batch) == jax.tree.map(np.shape, synthetic.batch_at(3))
    assert all(_is_window_of(row, train) for row in _example_tokens(name, batch))
    if name == "bert":  # [MASK] is id 0 and no text word has it
        assert (np.take_along_axis(batch["tokens"], batch["positions"], 1) == MASK_ID).all()
        assert (batch["labels"] != MASK_ID).all()
    valid = w.heldout("valid")
    assert (len(valid) > 0) == (source == "data_dir")


def test_text_sources_refused_where_they_cannot_apply(tmp_path, capsys):
    write_corpus(tmp_path)
    with pytest.raises(ValueError, match="--text-file does not apply to --model resnet"):
        get_workload("resnet", text_file=str(tmp_path / "wiki.train.tokens"))
    assert main(["--model", "vgg", "--text-file", "x.txt", "--devices", "1"]) == 2
    assert "--model vgg would ignore it" in capsys.readouterr().err
    args = ["--devices", "1", "--batch", "4", "--steps", "1", "--data-dir", str(tmp_path)]
    assert main([*args, "--text-file", str(tmp_path / "wiki.train.tokens")]) == 2
    assert "not both" in capsys.readouterr().err
    assert main(["--model", "gpt2", "--text-file", str(tmp_path / "nope.txt"), *args[:6]]) == 2
    assert "nope.txt does not exist" in capsys.readouterr().err


def test_missing_data_dir_is_one_line_cli_error(tmp_path, capsys):
    args = ["--devices", "1", "--batch", "4", "--steps", "1", "--data-dir", str(tmp_path)]
    for model, expected in (("bert", "wiki.train.tokens"), ("resnet", "data_batch_5")):
        assert main(["--model", model, *args]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and expected in err[0] and str(tmp_path) in err[0]


@pytest.mark.cli
def test_sampled_softmax_models_are_evaluated_with_the_full_softmax(tmp_path):
    write_corpus(tmp_path)
    cfg = dict(TINY, data_dir=str(tmp_path))
    sampled = get_workload("lstm_lm", **cfg, sampled_softmax=8)
    full = get_workload("lstm_lm", **cfg)
    params = sampled.init(jax.random.key(0))
    batches = sampled.heldout("valid")
    got = heldout.evaluate(sampled, params, batches)
    want = np.mean([float(jax.jit(full.loss)(params, b)) for b in batches])
    assert got["loss"] == pytest.approx(want, rel=1e-5)
    assert got["perplexity"] == pytest.approx(np.exp(want), rel=1e-5)
    assert got["batches"] == len(batches) and heldout.heldout_splits(full) == ("valid", "test")


# ------------------------------------------------------------------ CIFAR-10


def write_cifar(folder, per_batch=6, seed=0):
    """CIFAR-10 python batches with ``per_batch`` random images each."""
    rng = np.random.default_rng(seed)
    d = folder / datasets.CIFAR_FOLDER
    d.mkdir()
    batches = {}
    for name in (*datasets.CIFAR_TRAIN, "test_batch"):
        data = rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8)
        labels = rng.integers(0, 10, per_batch).tolist()
        with open(d / name, "wb") as f:
            pickle.dump({b"data": data, b"labels": labels, b"batch_label": b"x"}, f)
        batches[name] = (data, labels)
    with open(d / "batches.meta", "wb") as f:
        pickle.dump({b"label_names": [f"c{i}".encode() for i in range(10)]}, f)
    return batches


def test_cifar_batches_decode_to_nhwc(tmp_path):
    raw = write_cifar(tmp_path)
    train, test, names = datasets.load_cifar10(tmp_path)
    data, labels = raw["data_batch_2"]
    n, c, i, j = 3, 2, 5, 30  # pixel (i, j) of channel c is byte c * 1024 + i * 32 + j
    assert train.images[6 + n, i, j, c] == data[n, c * 1024 + i * 32 + j]
    assert train.images.shape == (30, 32, 32, 3) and test.images.shape == (6, 32, 32, 3)
    assert train.labels[6:12].tolist() == labels and names[3] == "c3"


@pytest.mark.cli
def test_cnn_trains_on_every_image_once_per_epoch_and_reports_accuracy(tmp_path):
    write_cifar(tmp_path)
    w = get_workload("resnet", data_dir=str(tmp_path), width=4, batch=4)
    train, test, _ = datasets.load_cifar10(tmp_path)
    epoch = np.concatenate([w.batch_at(s)["labels"] for s in range(30 // 2)])  # 2 epochs
    want = 2 * np.bincount(train.labels, minlength=10)
    assert np.bincount(epoch, minlength=10).tolist() == want.tolist()
    batches = w.heldout("test")
    assert len(batches) == 1 and w.heldout("valid") == []  # 6 test images: one batch of 4
    params = w.init(jax.random.key(1))
    logits = np.asarray(_logits(params, batches[0]))
    got = heldout.evaluate(w, params, batches)
    assert got["accuracy"] == pytest.approx(np.mean(logits.argmax(-1) == test.labels[:4]))
    with pytest.raises(ValueError, match="--image-size 32"):
        get_workload("vgg", data_dir=str(tmp_path), image_size=16)


def _logits(params, batch):
    model = vision.ResNet(vision.VisionConfig(width=4))
    return jax.jit(model.apply)({"params": params}, batch["images"])


@pytest.mark.cli
def test_cnn_run_reports_heldout_accuracy_in_its_result(tmp_path):
    write_cifar(tmp_path, per_batch=8)
    config = RunConfig(
        model="vgg", devices=2, steps=2, warmup=0, batch=4, width=4, data_dir=str(tmp_path)
    )
    config = dataclasses.replace(config, eval_every=1, eval_batches=1)
    result = train_and_evaluate(config, progress=False)
    test = result["heldout"]["test"]
    assert test["batches"] == 1 and (test["accuracy"] * 4) % 1 == 0  # 1 of 2 batches of 4
    assert [(e["step"], e["split"]) for e in result["eval"]] == [(0, "test"), (1, "test")]
    assert result["eval"][-1]["accuracy"] == test["accuracy"] and "valid" not in result["heldout"]


class _RunsCode:
    """A pickled object whose loading would run a shell command (``__reduce__``)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _hostile_batches(tmp_path):
    """Each case: (file to replace, its new bytes, what the error says)."""
    marker = tmp_path / "ran"
    good = np.zeros((2, 3072), np.uint8)
    return marker, [
        ("data_batch_1", pickle.dumps({b"data": _RunsCode(marker), b"labels": [0]}), "refuses"),
        ("batches.meta", pickle.dumps(_RunsCode(marker)), "refuses"),
        (
            "data_batch_2",
            pickle.dumps({b"data": good.astype(np.float32), b"labels": [0, 1]}),
            "uint8",
        ),
        (
            "data_batch_2",
            pickle.dumps({b"data": good.astype(np.int64) + 300, b"labels": [0, 1]}),
            "uint8",
        ),
        (
            "data_batch_3",
            pickle.dumps({b"data": good, b"labels": [0, 10]}),
            r"labels must lie in \[0, 10\)",
        ),
        ("data_batch_3", pickle.dumps({b"data": good, b"labels": [-1, 99]}), r"got \[-1, 99\]"),
        (
            "data_batch_4",
            pickle.dumps({b"data": good, b"labels": [0, 1, 2]}),
            "2 images but 3 labels",
        ),
        ("data_batch_4", pickle.dumps({b"data": good[:, :100], b"labels": [0, 1]}), "rows of 3072"),
        ("data_batch_5", pickle.dumps({b"labels": [0, 1]}), "no 'data' entry"),
        ("data_batch_5", pickle.dumps([good]), "holds a list"),
        ("test_batch", pickle.dumps({b"data": good, b"labels": [0, 1]})[:40], "no CIFAR-10"),
        ("test_batch", b"", "no CIFAR-10"),
        ("test_batch", b"not a pickle at all", "no CIFAR-10"),
        ("test_batch", pickle.dumps({b"data": good, b"labels": ["a", "b"]}), "list of integers"),
        ("batches.meta", pickle.dumps({b"label_names": [b"x"]}), "10 names"),
    ]


@pytest.mark.parametrize("case", range(15))
def test_cifar_files_are_data_never_code(tmp_path, case):
    """A hostile or malformed CIFAR file is a one-line ValueError naming it: no code it
    names runs, nothing wraps into uint8, no label outside the ten classes is trained."""
    write_cifar(tmp_path)
    marker, cases = _hostile_batches(tmp_path)
    name, content, message = cases[case]
    path = tmp_path / datasets.CIFAR_FOLDER / name
    path.write_bytes(content)
    with pytest.raises(ValueError, match=message) as error:
        datasets.load_cifar10(tmp_path)
    assert str(path) in str(error.value) and "\n" not in str(error.value)
    assert not marker.exists()  # the command was never run


@pytest.mark.cli
def test_hostile_cifar_folder_through_the_command_line(tmp_path, capsys):
    """The attack as a user would meet it: one line, exit status 2, nothing run."""
    write_cifar(tmp_path)
    marker, cases = _hostile_batches(tmp_path)
    (tmp_path / datasets.CIFAR_FOLDER / "data_batch_1").write_bytes(cases[0][1])
    code = main(
        ["--model", "resnet", "--data-dir", str(tmp_path), "--devices", "2", "--steps", "1"]
    )
    err = capsys.readouterr().err.strip()
    assert code == 2 and "data_batch_1" in err and "refuses" in err and "\n" not in err
    assert not marker.exists()


def test_a_text_file_that_is_not_utf8_is_named(tmp_path):
    path = tmp_path / "latin1.txt"
    path.write_bytes("one line\nsecond line caf\xe9\n".encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin1.txt' is not UTF-8 \(byte \d+, line 2"):
        read_words(path)


def test_results_are_strict_json(tmp_path):
    """A diverged run's NaN loss is ``null`` in ``--out``: every JSON reader parses it."""
    out = tmp_path / "r.json"
    write_json({"losses": [1.5, float("nan")], "eval": {"loss": float("inf")}}, str(out))

    def refuse(name):
        raise ValueError(f"not strict JSON: {name}")

    assert json.loads(out.read_text(), parse_constant=refuse) == {
        "losses": [1.5, None],
        "eval": {"loss": None},
    }


@pytest.mark.matrix
@pytest.mark.parametrize("name", LMS)
@pytest.mark.parametrize("sampled_softmax", [0, 8])
def test_every_language_model_names_id_keys_its_batch_has(name, sampled_softmax):
    """A workload's ``id_keys`` are keys of its batch in both softmax modes (BERT named
    its negatives with the full softmax, its default, and every table strategy refused
    its first batch); the ids in them are still checked."""
    w = get_workload(name, **{**TINY, "batch": 8}, sampled_softmax=sampled_softmax)
    batch = w.batch_at(0)
    assert w.id_keys is None or set(w.id_keys) <= set(batch), (w.id_keys, sorted(batch))
    ts = sc.make_train_step(
        w.loss,
        optax.sgd(0.1),
        runtime.data_mesh(),
        w.init(jax.random.key(0)),
        "embrace",
        replicated_keys=w.replicated_keys,
        embedding_paths=w.embedding_paths,
        id_keys=w.id_keys,
    )
    ts.place_batch(batch)
    # every integer key but BERT's masked positions holds ids; each is checked: one id
    # past the vocabulary is refused
    keys = [k for k in batch if np.issubdtype(batch[k].dtype, np.integer) and k != "positions"]
    assert ("negatives" in keys) == bool(sampled_softmax)
    for key in keys:
        ids = np.array(batch[key])
        ids.flat[0] = 40
        with pytest.raises(ValueError, match=rf"batch\['{key}'\] has ids in \[\d+, 40\]"):
            ts.place_batch({**batch, key: ids})
