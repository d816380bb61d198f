"""Flax NNX models under the strategies, unchanged (``sparsecomm_jax.nnx_tables``): a model
written twice, in Linen and in NNX with the same initial parameters, takes the same steps
under every strategy; lossless strategies equal one device's plain training of the NNX
model with ``nnx.Optimizer``; the user's module is never modified."""

import functools
import json

import flax.linen as linen
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import assert_trees_close, strategy_run

import sparsecomm_jax as sc
from models import get_workload
from sparsecomm_jax import checkpoint, nn, nnx_tables, runtime
from sparsecomm_jax.strategies.registry import strategy_names

V, BAGS, D, C, T, L, B = 96, 40, 16, 4, 5, 3, 32  # vocab, bag vocab, width, classes, ...


class NnxModel(nnx.Module):
    """Tokens through a plain ``nnx.Embed``, multi-hot bags through ``EmbedBag`` in an
    ``nnx.List`` (its parameters under an integer key), two dense layers."""

    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Embed(V, D, rngs=rngs)
        self.bags = nnx.List([nnx_tables.EmbedBag(BAGS, D, mode="mean", padding_id=0, rngs=rngs)])
        self.hidden = nnx.Linear(D, D, rngs=rngs)
        self.out = nnx.Linear(D, C, rngs=rngs)

    def __call__(self, tokens, bags):
        h = self.embed(tokens).mean(axis=1) + self.bags[0](bags)  # float[B, D]
        return self.out(nnx.relu(self.hidden(h)))


class LinenTwin(linen.Module):
    """``NnxModel`` in Linen: the same arithmetic, parameters from ``linen_params``."""

    @linen.compact
    def __call__(self, tokens, bags):
        h = linen.Embed(V, D, name="embed")(tokens).mean(axis=1)
        h = h + nn.EmbedBag(BAGS, D, mode="mean", padding_id=0, name="bag")(bags)
        return linen.Dense(C, name="out")(linen.relu(linen.Dense(D, name="hidden")(h)))


def nnx_loss(model, batch):
    logits = model(batch["tokens"], batch["bags"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()


def linen_loss(params, batch):
    logits = LinenTwin().apply(params, batch["tokens"], batch["bags"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()


def linen_params(model: NnxModel) -> dict:
    """The NNX model's initial parameters in the Linen twin's tree."""

    def dense(layer):
        return {"kernel": layer.kernel[...], "bias": layer.bias[...]}

    return {
        "params": {
            "embed": {"embedding": model.embed.embedding[...]},
            "bag": {"embedding": model.bags[0].embedding[...]},
            "hidden": dense(model.hidden),
            "out": dense(model.out),
        }
    }


def batch_at(step: int) -> dict:
    """Fresh random ids (Zipf-like skew, so rows repeat) and labels."""
    rng = np.random.default_rng(100 + step)
    tokens = np.minimum(rng.zipf(1.3, (B, T)) - 1, V - 1)
    bags = rng.integers(0, BAGS, (B, L)) * (rng.random((B, L)) < 0.7)  # 0 pads
    return {
        "tokens": tokens.astype(np.int32),
        "bags": bags.astype(np.int32),
        "labels": rng.integers(0, C, B).astype(np.int32),
    }


def run(ts, steps: int = 3):
    state, losses = ts.state, []
    for batch in sc.placed_batches(ts, batch_at, 0, steps):
        state, loss = ts.step(state, batch)
        losses.append(sc.loss_value(loss))
    return state, losses


def reference(model: NnxModel, optimizer, steps: int = 3):
    """One device, the whole batch, flax's own ``nnx.Optimizer``: the ground truth."""
    opt = nnx.Optimizer(model, optimizer, wrt=nnx.Param)

    @nnx.jit
    def step(model, opt, batch):
        loss, grads = nnx.value_and_grad(nnx_loss)(model, batch)
        opt.update(model, grads)
        return loss

    losses = [float(step(model, opt, batch_at(k))) for k in range(steps)]
    return losses, nnx.to_pure_dict(nnx.state(model, nnx.Param))


def params_of(module) -> dict:
    return jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(module, nnx.Param)))


@pytest.mark.matrix
@pytest.mark.parametrize("strategy", ["embrace", *(s for s in strategy_names() if s != "embrace")])
def test_linen_and_nnx_twins_take_the_same_steps(strategy):
    """Every strategy: the NNX model and its Linen twin, same initial parameters, the
    same losses (to 1e-6) and the same trained parameters."""
    model = NnxModel(nnx.Rngs(0))
    mesh, opt = runtime.data_mesh(8), optax.adam(0.05)
    twin = linen_params(model)
    ts_nnx = sc.make_train_step(nnx_loss, opt, mesh, model, strategy)
    ts_linen = sc.make_train_step(
        nn.loss_with_embeddings(linen_loss),
        opt,
        mesh,
        twin,
        strategy,
        embedding_paths=nn.embedding_paths(twin),
    )
    assert ts_nnx.runs_as == ts_linen.runs_as
    state_nnx, losses_nnx = run(ts_nnx)
    state_linen, losses_linen = run(ts_linen)
    np.testing.assert_allclose(losses_nnx, losses_linen, rtol=1e-6, atol=1e-6)
    trained, want = params_of(ts_nnx.module(state_nnx)), ts_linen.host_params(state_linen)
    got = {
        "embed": trained["embed"],
        "bag": trained["bags"][0],
        "hidden": trained["hidden"],
        "out": trained["out"],
    }
    assert_trees_close(got, want["params"], rtol=1e-5, atol=1e-6)


@pytest.mark.matrix
@pytest.mark.parametrize(
    "strategy", ["embrace_rowwise", "dense_pmap", "dense", "sparse_allgather", "embrace"]
)
def test_lossless_strategies_equal_one_device_nnx_training(strategy):
    """A lossless strategy on 8 devices equals one device's training of the same NNX model
    with ``nnx.Optimizer`` and plain optax (Adagrad: row updates exact)."""
    opt = optax.adagrad(0.1)
    want_losses, want = reference(NnxModel(nnx.Rngs(1)), opt)
    model = NnxModel(nnx.Rngs(1))
    ts = sc.make_train_step(nnx_loss, opt, runtime.data_mesh(8), model, strategy)
    state, losses = run(ts)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5, atol=1e-6)
    assert_trees_close(params_of(ts.module(state)), jax.tree.map(np.asarray, want))


def test_the_tables_are_found_and_the_module_is_left_alone():
    """The plain ``nnx.Embed`` and the ``EmbedBag`` (under ``nnx.List``'s integer key) are
    the tables; the dense layers are not; the user's module keeps its class and values;
    ``ts.module`` gives a fresh module of the user's classes, callable."""
    model = NnxModel(nnx.Rngs(2))
    before = params_of(model)
    ts = sc.make_train_step(nnx_loss, optax.sgd(0.5), runtime.data_mesh(8), model, "embrace")
    assert nnx_tables.table_paths(model) == (("bags", "0", "embedding"), ("embed", "embedding"))
    state, losses = run(ts)
    assert type(model.embed) is nnx.Embed
    assert_trees_close(params_of(model), before, rtol=0, atol=0)
    trained = ts.module(state)
    assert type(trained) is NnxModel and type(trained.embed) is nnx.Embed
    assert trained is not model
    assert not np.allclose(params_of(trained)["embed"]["embedding"], before["embed"]["embedding"])
    after = float(nnx_loss(trained, batch_at(0)))
    assert np.isfinite(after) and after < losses[0]  # trained on batches 0-2


class TiedLm(nnx.Module):
    """A tied softmax: the output logits are ``embed.attend`` (``query @ table.T``)."""

    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Embed(V, D, rngs=rngs)
        self.mix = nnx.Linear(D, D, rngs=rngs)

    def __call__(self, tokens):
        return self.embed.attend(nnx.tanh(self.mix(self.embed(tokens).mean(axis=1))))


def tied_loss(model, batch):
    logits = model(batch["tokens"])  # float[B, V]
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["tokens"][:, 0]).mean()


@pytest.mark.parametrize("strategy", ["embrace", "embrace_rowwise"])
def test_a_tied_table_attends_through_the_strategy(strategy):
    """``nnx.Embed.attend`` on a sharded table equals one device's training."""
    opt = optax.sgd(0.3)
    want_model = TiedLm(nnx.Rngs(3))
    want_opt = nnx.Optimizer(want_model, opt, wrt=nnx.Param)
    want = []
    for k in range(2):
        loss, grads = nnx.value_and_grad(tied_loss)(want_model, batch_at(k))
        want_opt.update(want_model, grads)
        want.append(float(loss))
    ts = sc.make_train_step(tied_loss, opt, runtime.data_mesh(8), TiedLm(nnx.Rngs(3)), strategy)
    state, losses = run(ts, steps=2)
    np.testing.assert_allclose(losses, want, rtol=1e-5)
    assert_trees_close(params_of(ts.module(state)), params_of(want_model))


def test_nnx_embed_bag_pools_as_numpy():
    """Sum and mean pools of padded bags against numpy."""
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 9, (6, 4)).astype(np.int32)
    for mode in nn.POOLINGS:
        bag = nnx_tables.EmbedBag(9, 3, mode=mode, padding_id=0, rngs=nnx.Rngs(0))
        table = np.asarray(bag.embedding[...])
        mask = (ids != 0)[..., None]
        total = (table[ids] * mask).sum(axis=1)
        want = total if mode == "sum" else total / np.maximum(mask.sum(axis=1), 1)
        np.testing.assert_allclose(np.asarray(bag(jnp.asarray(ids))), want, rtol=1e-6)


class Normed(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Embed(V, D, rngs=rngs)
        self.norm = nnx.BatchNorm(D, rngs=rngs)

    def __call__(self, tokens):
        return self.norm(self.embed(tokens).mean(axis=1))


class NoTable(nnx.Module):
    def __init__(self, rngs):
        self.out = nnx.Linear(T, C, rngs=rngs)

    def __call__(self, tokens):
        return self.out(tokens.astype(jnp.float32))


def test_bad_input_says_what_to_pass():
    """One line each, naming the argument: a Linen-form loss with an NNX model, an
    ``nnx.Optimizer``, state the step cannot carry, a model with no table, a plan naming
    a table the model lacks; and the reverse, an NNX-form loss given a Linen tree."""
    mesh, model = runtime.data_mesh(8), NnxModel(nnx.Rngs(0))

    def linen_form(params, batch, emb):
        return 0.0

    with pytest.raises(TypeError, match=r"^loss_fn\(params, batch, emb\) has the Linen form"):
        sc.make_train_step(linen_form, optax.sgd(0.1), mesh, model, "embrace")
    with pytest.raises(TypeError, match=r"^optimizer is an nnx.Optimizer; pass its optax"):
        opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
        sc.make_train_step(nnx_loss, opt, mesh, model, "embrace")
    with pytest.raises(ValueError, match=r"state other than nnx.Param .*norm/mean \(BatchStat\)"):
        sc.make_train_step(nnx_loss, optax.sgd(0.1), mesh, Normed(nnx.Rngs(0)), "embrace")
    with pytest.raises(ValueError, match=r"'embrace' needs embedding tables: the model has no"):
        sc.make_train_step(nnx_loss, optax.sgd(0.1), mesh, NoTable(nnx.Rngs(0)), "embrace")
    with pytest.raises(
        TypeError, match=r"^loss_fn\(model, batch\) cannot take \(params, batch, emb"
    ):
        sc.make_train_step(nnx_loss, optax.sgd(0.1), mesh, linen_params(model), "embrace")
    plan = {"nope/embedding": "row"}  # a table the module lacks: the tables it has, named
    with pytest.raises(
        ValueError,
        match=r"^table_layouts names \['nope/embedding'\], .*"
        r"the tables: \['bags/0/embedding', 'embed/embedding'\]$",
    ):
        sc.make_train_step(nnx_loss, optax.sgd(0.1), mesh, model, "embrace", table_layouts=plan)


OPTIONS = {  # name -> (the NNX step's options, the Linen twin's)
    "table_layouts": (
        {"table_layouts": {"embed/embedding": "row", "bags/0/embedding": "table"}},
        {"table_layouts": {"params/embed/embedding": "row", "params/bag/embedding": "table"}},
    ),
    "replicas": ({"replicas": 2}, {"replicas": 2}),
    "comm_dtype": ({"comm_dtype": "bfloat16"}, {"comm_dtype": "bfloat16"}),
    "rows": ({"table_update": "rows"}, {"table_update": "rows"}),
}
CLIPPED = optax.chain(  # clipping by global norm and a schedule: the row update is exact
    optax.clip_by_global_norm(0.5),
    optax.adagrad(optax.warmup_cosine_decay_schedule(0.0, 0.2, 2, 6)),
)


@pytest.mark.matrix
@pytest.mark.parametrize("option", list(OPTIONS))
def test_the_step_options_work_as_for_linen(option):
    """A plan of layouts by table path, replica groups, a narrow wire, the row update of
    a clipped and scheduled optimizer: the NNX model's steps equal its Linen twin's under
    the same options (``embrace``; Adagrad)."""
    mine, twins = OPTIONS[option]
    model, mesh = NnxModel(nnx.Rngs(4)), runtime.data_mesh(8)
    opt = CLIPPED if option == "rows" else optax.adagrad(0.1)
    twin = linen_params(model)
    ts_nnx = sc.make_train_step(nnx_loss, opt, mesh, model, "embrace", **mine)
    ts_linen = sc.make_train_step(
        nn.loss_with_embeddings(linen_loss),
        opt,
        mesh,
        twin,
        "embrace",
        embedding_paths=nn.embedding_paths(twin),
        **twins,
    )
    assert ts_nnx.table_update == ts_linen.table_update
    _, losses_nnx = run(ts_nnx)
    _, losses_linen = run(ts_linen)
    np.testing.assert_allclose(losses_nnx, losses_linen, rtol=1e-6, atol=1e-6)


def test_several_steps_a_call_equal_one_a_call():
    """``ts.steps`` on an NNX model: the same losses as ``ts.step`` one at a time."""
    ts = sc.make_train_step(
        nnx_loss, optax.sgd(0.3), runtime.data_mesh(8), NnxModel(nnx.Rngs(5)), "embrace"
    )
    _, one_a_call = run(ts, steps=3)
    ts = sc.make_train_step(
        nnx_loss, optax.sgd(0.3), runtime.data_mesh(8), NnxModel(nnx.Rngs(5)), "embrace"
    )
    _, losses = ts.steps(ts.state, ts.place_steps([batch_at(k) for k in range(3)]))
    np.testing.assert_allclose(np.asarray(losses), one_a_call, rtol=1e-5)


class Named(nnx.Module):
    """Tables with MaxText-style logical axis names: ``vocab`` on the rows of one, ``embed``
    on the features of the other."""

    def __init__(self, rngs: nnx.Rngs):
        def named(axes):
            return {"out_sharding": axes, "eager_sharding": False}

        self.embed = nnx.Embed(V, D, embedding_metadata=named(("vocab", None)), rngs=rngs)
        self.bags = nnx.List(
            [nnx_tables.EmbedBag(BAGS, D, embedding_metadata=named((None, "embed")), rngs=rngs)]
        )
        self.hidden = nnx.Linear(D, D, rngs=rngs)
        self.out = nnx.Linear(D, C, rngs=rngs)

    __call__ = NnxModel.__call__


def test_sharding_metadata_chooses_the_layout_unless_the_plan_says():
    """``("vocab", None)`` makes a table row-wise, ``(None, "embed")`` column-wise, under
    ``embrace_rowwise``; ``table_layouts`` overrides; the steps equal one device's."""
    assert nnx_tables.metadata_layouts(Named(nnx.Rngs(0))) == {
        "embed/embedding": "row",
        "bags/0/embedding": "column",
    }
    mesh, opt = runtime.data_mesh(8), optax.adagrad(0.1)
    ts = sc.make_train_step(nnx_loss, opt, mesh, Named(nnx.Rngs(6)), "embrace_rowwise")
    spec = {k: ts.state.params[k] for k in ("embed", "bags")}
    assert tuple(spec["embed"]["embedding"].sharding.spec) == ("data", None)
    assert tuple(spec["bags"]["0"]["embedding"].sharding.spec) == (None, "data")
    want_losses, want = reference(Named(nnx.Rngs(6)), opt)
    state, losses = run(ts)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5, atol=1e-6)
    assert_trees_close(params_of(ts.module(state)), jax.tree.map(np.asarray, want))
    planned = sc.make_train_step(
        nnx_loss,
        opt,
        mesh,
        Named(nnx.Rngs(6)),
        "embrace",
        table_layouts={"embed/embedding": "column"},
    )
    assert tuple(planned.state.params["embed"]["embedding"].sharding.spec) == (None, "data")


@pytest.mark.matrix
@pytest.mark.parametrize("strategy", ["embrace", "embrace_rowwise", "dense_pmap"])
def test_the_nnx_dlrm_takes_the_linen_dlrms_steps(strategy):
    """``--model dlrm_nnx`` (``models.dlrm_nnx``) given ``--model dlrm``'s parameter values
    takes its steps: the same losses to 1e-6 (Adam)."""
    sizes = dict(tables="300,200,100,50", dim=8, batch=64, multi_hot=2)
    linen_w, nnx_w = get_workload("dlrm", **sizes), get_workload("dlrm_nnx", **sizes)
    params = nnx_w.init(jax.random.key(0))

    def dense(mlp):
        return {f"Dense_{i}": layer for i, layer in mlp["layers"].items()}

    twin = {
        "params": {
            "MLP_0": dense(params["bottom"]),
            "MLP_1": dense(params["top"]),
            **{k: v for k, v in params.items() if k.startswith("sparse_")},
        }
    }
    shapes = jax.tree.map(jnp.shape, linen_w.init(jax.random.key(0)))
    assert jax.tree.map(jnp.shape, twin) == shapes
    opt = optax.adam(0.01)
    nnx_losses, _, _ = strategy_run(nnx_w, opt, params, 3, strategy)
    linen_losses, _, _ = strategy_run(linen_w, opt, twin, 3, strategy)
    np.testing.assert_allclose(nnx_losses, linen_losses, rtol=1e-6, atol=1e-6)


@pytest.mark.cli
def test_the_command_line_trains_and_resumes_the_nnx_dlrm(tmp_path):
    """``--model dlrm_nnx`` through ``experiments.train``: a run checkpointed on 4 devices
    resumes on 8 with the losses of the uninterrupted run."""
    from experiments.train import main

    flags = ["--model", "dlrm_nnx", "--tables", "64,48,24", "--dim", "8", "--batch", "32"]
    flags += ["--strategy", "embrace_rowwise", "--optimizer", "adagrad", "--devices", "4"]
    assert main([*flags, "--steps", "4", f"--out={tmp_path / 'full.json'}"]) == 0
    full = json.loads((tmp_path / "full.json").read_text())
    saved = tmp_path / "saved"
    assert main([*flags, "--steps", "2", f"--checkpoint-dir={saved}"]) == 0
    out = tmp_path / "resumed.json"
    again = [*flags, "--steps", "4", "--devices", "8", "--resume", f"--checkpoint-dir={saved}"]
    assert main([*again, f"--out={out}"]) == 0
    assert json.loads(out.read_text())["losses"] == pytest.approx(full["losses"][2:], rel=1e-5)


@pytest.mark.cli
def test_the_parity_study_on_a_small_model(tmp_path):
    """``experiments.studies.nnx_parity`` at a small size: the NNX and Linen programs send
    the same bytes with the same collectives, and their losses are equal."""
    from experiments.studies import nnx_parity

    args = ["--out-dir", str(tmp_path), "--strategies", "embrace", "--vocab", "500"]
    assert nnx_parity.main([*args, "--batch", "64", "--steps", "3", "--rounds", "1"]) == 0
    (row,) = json.loads((tmp_path / "nnx_parity.json").read_text())
    assert row["nnx_mb"] == row["linen_mb"] > 0
    assert row["nnx_collectives"] == row["linen_collectives"]
    assert row["loss_gap"] < 1e-6 and len(row["nnx_losses"]) == 3
    assert "`embrace`" in (tmp_path / "nnx_parity.md").read_text()


def linen_lstm_params(params: dict) -> dict:
    """``--model lstm_lm_nnx``'s parameters in ``--model lstm_lm``'s tree (one layer):
    the NNX cell's packed gate kernels (i, f, g, o) split into Linen's per-gate ones."""
    cell = params["lstm"]["0"]["cell"]
    gates = "ifgo"
    inputs = np.split(np.asarray(cell["dense_i"]["kernel"]), 4, axis=-1)
    hidden = np.split(np.asarray(cell["dense_h"]["kernel"]), 4, axis=-1)
    bias = np.split(np.asarray(cell["dense_h"]["bias"]), 4, axis=-1)
    lstm = {f"i{g}": {"kernel": k} for g, k in zip(gates, inputs, strict=True)}
    lstm |= {f"h{g}": {"kernel": k, "bias": b} for g, k, b in zip(gates, hidden, bias, strict=True)}
    rest = {k: v for k, v in params.items() if k != "lstm"}
    return {**rest, "lstm": {"OptimizedLSTMCell_0": lstm}}


@pytest.mark.matrix
@pytest.mark.parametrize("strategy", ["embrace", "embrace_rowwise", "dense_pmap", "embrace_2d"])
def test_the_nnx_lstm_lm_takes_the_linen_lms_steps(strategy):
    """``--model lstm_lm_nnx`` (``models.lstm_lm_nnx``: plain ``nnx.Embed`` tables, a sampled
    softmax over shared negatives) given ``--model lstm_lm``'s parameter values takes its
    steps: the same losses to 1e-6 (SGD)."""
    sizes = dict(vocab=300, dim=8, hidden=16, seq_len=6, batch=32, sampled_softmax=24)
    linen_w, nnx_w = get_workload("lstm_lm", **sizes), get_workload("lstm_lm_nnx", **sizes)
    params = nnx_w.init(jax.random.key(0))
    twin = linen_lstm_params(params)
    assert jax.tree.map(jnp.shape, twin) == jax.tree.map(jnp.shape, linen_w.init(jax.random.key(0)))
    opt = optax.sgd(0.5)
    nnx_losses, _, _ = strategy_run(nnx_w, opt, params, 3, strategy)
    linen_losses, _, _ = strategy_run(linen_w, opt, twin, 3, strategy)
    np.testing.assert_allclose(nnx_losses, linen_losses, rtol=1e-6, atol=1e-6)


def test_a_checkpoint_of_an_nnx_model_resumes_on_another_count_and_layout(tmp_path):
    """Two steps on 8 devices (``embrace``, Adam), saved with ``checkpoint.Checkpointer``,
    restored into the same module's step on 4 devices with its tables row-wise: the next
    steps' losses and the trained module equal the uninterrupted run's."""
    opt = optax.adam(0.02)
    first = sc.make_train_step(
        nnx_loss, opt, runtime.data_mesh(8), NnxModel(nnx.Rngs(7)), "embrace"
    )
    state, batches = first.state, [sc.place_for_step(first, batch_at, k, 4) for k in range(4)]
    for batch in batches[:2]:
        state, _ = first.step(state, batch)
    with checkpoint.Checkpointer(tmp_path) as ckpt:
        ckpt.save_state(2, first, state, force=True)
    after = []
    for batch in batches[2:]:
        state, loss = first.step(state, batch)
        after.append(sc.loss_value(loss))
    rows = {"embed/embedding": "row", "bags/0/embedding": "row"}
    then = sc.make_train_step(
        nnx_loss, opt, runtime.data_mesh(4), NnxModel(nnx.Rngs(8)), "embrace", table_layouts=rows
    )
    with checkpoint.Checkpointer(tmp_path) as ckpt:
        restored, step = ckpt.restore_state(then)
    assert step == 2
    again = []
    for k in (2, 3):
        restored, loss = then.step(restored, sc.place_for_step(then, batch_at, k, 4))
        again.append(sc.loss_value(loss))
    np.testing.assert_allclose(again, after, rtol=1e-5, atol=1e-6)
    assert_trees_close(params_of(then.module(restored)), params_of(first.module(state)))


class PlainSubclass(nnx.Embed):
    """A subclass that reads its table through ``nnx.Embed``'s methods: a table."""


class OwnReads(nnx.Embed):
    """A subclass that reads its table its own way: not a table."""

    def __call__(self, inputs):
        return jnp.take(self.embedding[...], inputs, axis=0) * 2.0


class Kinds(nnx.Module):
    """A subclass table, a pooled table read by ``attend`` too, and an own-reads one."""

    def __init__(self, rngs: nnx.Rngs):
        self.words = PlainSubclass(V, D, rngs=rngs)
        self.bag = nnx_tables.EmbedBag(C, D, padding_id=0, rngs=rngs)
        self.own = OwnReads(BAGS, D, rngs=rngs)

    def __call__(self, tokens, bags):
        h = self.words(tokens).mean(axis=1) + self.own(bags).mean(axis=1)  # float[B, D]
        return self.bag.attend(jnp.tanh(h))  # float[B, C]: the bag's table, tied


def test_subclasses_and_a_pooled_tables_attend_go_through_the_strategy():
    """A subclass of ``nnx.Embed`` that keeps its methods is a table and is served, so is
    ``EmbedBag.attend``; a subclass with its own reads stays dense, and naming it is
    refused. Lossless on 8 devices against one device's ``nnx.Optimizer`` training."""
    model = Kinds(nnx.Rngs(9))
    assert nnx_tables.table_paths(model) == (("bag", "embedding"), ("words", "embedding"))
    opt = optax.sgd(0.3)
    for strategy in ("embrace", "embrace_rowwise"):
        want_losses, want = reference(Kinds(nnx.Rngs(9)), opt)
        ts = sc.make_train_step(nnx_loss, opt, runtime.data_mesh(8), Kinds(nnx.Rngs(9)), strategy)
        state, losses = run(ts)
        np.testing.assert_allclose(losses, want_losses, rtol=1e-5, atol=1e-6)
        assert_trees_close(params_of(ts.module(state)), jax.tree.map(np.asarray, want))
    with pytest.raises(ValueError, match=r"^embedding_paths names \['own/embedding'\], tables"):
        sc.make_train_step(
            nnx_loss, opt, runtime.data_mesh(8), model, "embrace", embedding_paths=["own/embedding"]
        )


def test_metadata_names_only_the_tables_the_step_shards():
    """Sharding metadata on a table that ``embedding_paths`` leaves out is ignored (no
    ``table_layouts`` error the user did not write); a ``PartitionSpec`` names axes too."""
    spec = {"out_sharding": jax.sharding.PartitionSpec("vocab", None), "eager_sharding": False}
    model = Named(nnx.Rngs(0))
    assert nnx_tables.metadata_layouts(
        nnx.Embed(V, D, embedding_metadata=spec, rngs=nnx.Rngs(0))
    ) == {"embedding": "row"}
    ts = sc.make_train_step(
        nnx_loss,
        optax.sgd(0.1),
        runtime.data_mesh(8),
        model,
        "embrace",
        embedding_paths=["bags/0/embedding"],
    )
    assert tuple(ts.state.params["bags"]["0"]["embedding"].sharding.spec) == (None, "data")
    assert tuple(ts.state.params["embed"]["embedding"].sharding.spec) in ((), (None, None))


def test_a_wrapped_three_argument_loss_is_not_refused():
    """``functools.wraps`` of a two-argument loss into ``(params, batch, emb=None)``: the
    wrapper's own signature is what the step calls."""

    def two(params, batch):
        return linen_loss(params, batch)

    @functools.wraps(two)
    def three(params, batch, emb=None):
        with nn.use_ops(emb):
            return two(params, batch)

    twin = linen_params(NnxModel(nnx.Rngs(0)))
    ts = sc.make_train_step(
        three,
        optax.sgd(0.1),
        runtime.data_mesh(8),
        twin,
        "embrace",
        embedding_paths=nn.embedding_paths(twin),
    )
    _, losses = run(ts, steps=1)
    assert np.isfinite(losses[0])
