"""Many tables of different sizes in one model: each batch key checked against the
tables it feeds, a layout per table (column, row, table-wise, replicated) mixed in one
step and exact against single-device training, features sharing a table, pooled
multi-hot bags."""

import flax.linen as linen
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_trees_close

import sparsecomm_jax as sc
from sparsecomm_jax import nn, runtime
from sparsecomm_jax.embedding import layout_registry
from sparsecomm_jax.embedding.access import PLAIN

# embrace_2d as its pipelined program (conftest), not as embrace on this CPU mesh
pytestmark = pytest.mark.usefixtures("pipelined_2d")

N, B, D = 8, 32, 8
SIZES = {"user": 48, "item": 40, "tag": 16}  # rows of each table


def init(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    params = {k: rng.normal(size=(v, D)).astype(np.float32) for k, v in SIZES.items()}
    params["w"] = rng.normal(size=(D,)).astype(np.float32)
    return params


def loss(params, batch, ops):
    """Two towers and a bag of tags: ``item`` and ``seen`` share the item table, the
    ``label`` key is an integer class that feeds no table."""
    user = ops.lookup(params["user"], batch["user"])  # [B/P, D]
    item = ops.lookup(params["item"], batch["item"])
    seen = ops.lookup(params["item"], batch["seen"])
    tags = ops.lookup(params["tag"], batch["tags"]).sum(axis=1)  # [B/P, 3, D] -> [B/P, D]
    score = jnp.sum((user + tags) * (item - 0.5 * seen) * params["w"], axis=-1)
    target = batch["label"].astype(jnp.float32) / 500.0
    return jnp.mean((score - target) ** 2)


def batch_at(step: int) -> dict:
    rng = np.random.default_rng(100 + step)
    return {
        "user": rng.integers(0, SIZES["user"], B).astype(np.int32),
        "item": rng.integers(0, SIZES["item"], B).astype(np.int32),
        "seen": rng.integers(0, SIZES["item"], B).astype(np.int32),
        "tags": rng.integers(0, SIZES["tag"], (B, 3)).astype(np.int32),
        "label": rng.integers(0, 500, B).astype(np.int32),  # beyond every table: not ids
    }


PATHS = [(k,) for k in SIZES]


def make(strategy="embrace", optimizer=None, **kw):
    return sc.make_train_step(
        loss,
        optimizer or optax.sgd(0.05),
        runtime.data_mesh(N),
        init(),
        strategy,
        embedding_paths=PATHS,
        **kw,
    )


def reference(optimizer, steps):
    params, state = jax.tree.map(jnp.asarray, init()), optimizer.init(init())

    @jax.jit
    def step(params, state, batch):
        value, grads = jax.value_and_grad(loss)(params, batch, PLAIN)
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state, value

    losses = []
    for s in range(steps):
        params, state, value = step(params, state, batch_at(s))
        losses.append(float(value))
    return losses, params


MIXES = {
    "column everywhere": {},
    "one of each": {"user": "row", "item": "column", "tag": "replicated"},
    "rows and a copy": {"user": "replicated", "item": "row", "tag": "row"},
    "one data parallel": {"user": "column", "item": "row", "tag": "dense"},
    "all data parallel": dict.fromkeys(SIZES, "dense"),  # what a plan of small tables gives
    "table-wise everywhere": dict.fromkeys(SIZES, "table"),  # three owners, one pack
    "two table-wise, one by rows": {"user": "table", "item": "row", "tag": "table"},
}


@pytest.mark.matrix
@pytest.mark.parametrize("opt", ["sgd", "adagrad"])
@pytest.mark.parametrize("mix", sorted(MIXES))
def test_a_layout_per_table_equals_single_device(mix, opt):
    optimizer = {"sgd": lambda: optax.sgd(0.05), "adagrad": lambda: optax.adagrad(0.1)}[opt]
    ref_losses, ref_params = reference(optimizer(), 3)
    ts = make("embrace", optimizer(), table_layouts=MIXES[mix])
    assert ts.table_update == "rows"  # auto: exact for both
    state, losses = ts.state, []
    for s in range(3):
        state, value = ts.step(state, ts.place_batch(batch_at(s)))
        losses.append(sc.loss_value(value))
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert_trees_close(ts.host_params(state), ref_params, rtol=1e-5, atol=1e-6)
    for name in SIZES:  # each table lies as its layout says (data parallel: replicated)
        chosen = MIXES[mix].get(name, "column")
        expected = layout_registry.get("replicated" if chosen == "dense" else chosen).spec("data")
        got = state.params[name].sharding.spec
        assert (*got, None, None)[:2] == (*expected, None, None)[:2], name


@pytest.mark.parametrize("strategy", ["dense", "embrace"])
def test_each_key_is_checked_against_the_tables_it_feeds(strategy):
    """The user key against the 48-row table, item and seen against the 40-row one; the
    integer label feeds no table and is left alone."""
    ts = make(strategy)
    good = batch_at(0)
    good["user"][0] = SIZES["user"] - 1  # valid for users, beyond the item table
    ts.place_batch(good)
    bad = batch_at(0)
    bad["seen"][3] = SIZES["item"]
    with pytest.raises(
        ValueError, match=r"batch\['seen'\] has ids in \[\d+, 40\], outside \[0, 40\) of table item"
    ):
        ts.place_batch(bad)


def test_named_id_keys_map_features_to_tables():
    ts = make(
        "embrace", id_keys={"user": ("user",), "item": "item", "seen": "item", "tags": ["tag"]}
    )
    batch = batch_at(1)
    batch["label"][0] = -7  # not named: not checked
    ts.place_batch(batch)
    batch["tags"][0, 0] = 16
    with pytest.raises(ValueError, match=r"batch\['tags'\] .* outside \[0, 16\) of table tag"):
        ts.place_batch(batch)
    with pytest.raises(ValueError, match=r"id_keys maps a key to 'items', which is not an embed"):
        make("embrace", id_keys={"item": "items"})
    with pytest.raises(ValueError, match=r"id_keys names \['users'\], which the batch does not"):
        make("embrace", id_keys=("users",)).place_batch(batch_at(0))


def test_table_layouts_are_checked():
    with pytest.raises(ValueError, match=r"table_layouts names \['users'\], which are not"):
        make("embrace", table_layouts={"users": "row"})
    with pytest.raises(ValueError, match=r"table_layouts names unknown layouts \['diagonal'\]"):
        make("embrace", table_layouts={"user": "diagonal"})
    with pytest.raises(ValueError, match=r"table_layouts needs a strategy among"):
        make("dense", table_layouts={"user": "row"})
    with pytest.raises(ValueError, match=r"table_layouts names \['user'\] more than once"):
        make("embrace", table_layouts={("user",): "row", "user": "table"})


class Bags(linen.Module):
    """Two multi-hot features: tags pooled by their mean (bags padded with id 0), clicks
    by their sum (bags cut by lengths)."""

    @linen.compact
    def __call__(self, batch):
        tags = nn.EmbedBag(16, D, mode="mean", padding_id=0, name="tags")(batch["tags"])
        clicks = nn.EmbedBag(40, D, mode="sum", name="clicks")(batch["clicks"], batch["lengths"])
        return linen.Dense(1)(jnp.concatenate([tags, clicks], -1))[:, 0]


def bag_batch(step: int, clicks: int = 5) -> dict:
    """``clicks``: the width of the clicks bags (0: the feature reads no id)."""
    rng = np.random.default_rng(200 + step)
    tags = rng.integers(1, 16, (B, 4))
    tags[rng.random((B, 4)) < 0.4] = 0  # padded places
    return {
        "tags": tags.astype(np.int32),
        "clicks": rng.integers(0, 40, (B, clicks)).astype(np.int32),
        "lengths": rng.integers(0, clicks + 1, B).astype(np.int32),  # empty bags too
        "y": rng.normal(size=B).astype(np.float32),
    }


def bag_loss(params, batch):
    return jnp.mean((Bags().apply(params, batch) - batch["y"]) ** 2)


@pytest.mark.matrix
@pytest.mark.parametrize("layout", ["column", "row", "table", "replicated"])
def test_pooled_bags_under_every_layout_equal_single_device(layout):
    params = Bags().init(jax.random.key(1), bag_batch(0))
    ts, state, ref = _bags_against_single_device(params, layout, bag_batch)
    untouched = ~np.isin(np.arange(40), [bag_batch(s)["clicks"] for s in range(3)])
    table = np.asarray(params["params"]["clicks"]["embedding"])
    got = ts.host_params(state)["params"]["clicks"]["embedding"]
    np.testing.assert_array_equal(got[untouched], table[untouched])


@pytest.mark.matrix
@pytest.mark.parametrize("layout", ["column", "row", "table", "replicated"])
def test_a_bag_of_width_zero_reads_nothing_under_every_layout(layout):
    """A feature whose bags have no places (shape [B, 0]) is an empty read: its table
    stays as it was, the rest trains as on one device."""
    params = Bags().init(jax.random.key(1), bag_batch(0))
    ts, state, _ = _bags_against_single_device(params, layout, lambda s: bag_batch(s, 0))
    clicks = ts.host_params(state)["params"]["clicks"]["embedding"]
    np.testing.assert_array_equal(clicks, params["params"]["clicks"]["embedding"])


def test_a_pipelined_row_wise_table_takes_a_bag_of_width_zero():
    """``embrace_2d`` carries row-wise tables too; a bag of width 0 of one sends nothing
    (it plans such a table's buckets from its ids, not its positions): the table stays
    as it was, the rest trains as on one device."""
    params = Bags().init(jax.random.key(1), bag_batch(0))
    ts, state, _ = _bags_against_single_device(
        params, "row", lambda s: bag_batch(s, 0), "embrace_2d"
    )
    assert ts.runs_as == "embrace_2d"
    clicks = ts.host_params(state)["params"]["clicks"]["embedding"]
    np.testing.assert_array_equal(clicks, params["params"]["clicks"]["embedding"])


def test_the_pipelined_step_refuses_a_bag_of_width_zero_by_name():
    """A column-wise table, whose chunks are planned from positions: refused."""
    params = Bags().init(jax.random.key(1), bag_batch(0))
    ts = sc.make_train_step(
        nn.loss_with_embeddings(bag_loss),
        optax.sgd(0.5),
        runtime.data_mesh(N),
        params,
        "embrace_2d",
        embedding_paths=nn.embedding_paths(params),
    )
    with pytest.raises(ValueError, match=r"\['params/clicks/embedding'\] are read with no ids"):
        ts.step(ts.state, ts.place_batch(bag_batch(0, 0), bag_batch(1, 0)))


def _bags_against_single_device(params, layout, batch_of, strategy: str = "embrace"):
    """Three SGD steps of ``Bags`` on ``batch_of(step)`` under ``strategy`` with every
    table laid out as ``layout``, checked against single-device training; returns
    ``(ts, state, reference params)``."""
    opt = optax.sgd(0.5)
    ref, state = params, opt.init(params)
    for s in range(3):
        grads = jax.grad(bag_loss)(ref, batch_of(s))
        updates, state = opt.update(grads, state, ref)
        ref = optax.apply_updates(ref, updates)
    paths = nn.embedding_paths(params)
    ts = sc.make_train_step(
        nn.loss_with_embeddings(bag_loss),
        opt,
        runtime.data_mesh(N),
        params,
        strategy,
        embedding_paths=paths,
        table_layouts={p: layout for p in paths},
    )
    assert ts.table_update == "rows"
    state = ts.state
    for s in range(3):  # each batch with those it looks ahead to (a pipelined step's)
        state, _ = ts.step(state, sc.place_for_step(ts, batch_of, s, 3))
    assert_trees_close(ts.host_params(state), ref, rtol=1e-5, atol=1e-6)
    return ts, state, ref


# Tables whose split dimension does not divide by the 8 workers: stored padded.
ODD = {"a": (13, 6), "b": (21, 8), "c": (11, 6)}  # (V, D): c is read by a full softmax
ODD_MIXES = {
    "a, c by columns, b by rows": {"a": "column", "b": "row", "c": "column"},
    "a, c by rows, b by columns": {"a": "row", "b": "column", "c": "row"},
    "a, b table-wise (two packs), c by columns": {"a": "table", "b": "table", "c": "column"},
}
ODD_OPTIMIZERS = {
    "sgd": lambda: optax.sgd(0.1),  # the row update
    "adam": lambda: optax.adam(0.05),  # the dense update, every stored row moved
    "clip+adamw": lambda: optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(0.05)),
}


def odd_init(seed: int = 3) -> dict:
    rng = np.random.default_rng(seed)
    params = {k: rng.normal(size=s).astype(np.float32) for k, s in ODD.items()}
    params["m"] = rng.normal(size=(6, 8)).astype(np.float32)
    return params


def odd_loss(params, batch, ops):
    a = ops.lookup(params["a"], batch["a"])  # [B/P, 6]
    b = ops.lookup(params["b"], batch["b"])  # [B/P, 8]
    logits = ops.attend(params["c"], a)  # [B/P, 11]
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), batch["y"][:, None], 1)
    return jnp.mean(nll) + jnp.mean(jnp.sum((a @ params["m"]) * b, -1) ** 2)


def odd_batch(step: int) -> dict:
    rng = np.random.default_rng(300 + step)
    return {
        "a": rng.integers(0, 13, B).astype(np.int32),
        "b": rng.integers(0, 21, B).astype(np.int32),
        "y": rng.integers(0, 11, B).astype(np.int32),
    }


@pytest.mark.matrix
@pytest.mark.parametrize("opt", sorted(ODD_OPTIMIZERS))
@pytest.mark.parametrize("mix", sorted(ODD_MIXES))
def test_tables_not_divisible_by_the_workers_are_padded_and_exact(mix, opt):
    optimizer = ODD_OPTIMIZERS[opt]
    params, state = jax.tree.map(jnp.asarray, odd_init()), optimizer().init(odd_init())
    ref_losses = []
    for s in range(3):
        value, grads = jax.value_and_grad(odd_loss)(params, odd_batch(s), PLAIN)
        updates, state = optimizer().update(grads, state, params)
        params = optax.apply_updates(params, updates)
        ref_losses.append(float(value))
    ts = sc.make_train_step(
        odd_loss,
        optimizer(),
        runtime.data_mesh(N),
        odd_init(),
        "embrace",
        embedding_paths=[(k,) for k in ODD],
        table_layouts=ODD_MIXES[mix],
    )
    state, losses = ts.state, []
    for s in range(3):
        state, value = ts.step(state, ts.place_batch(odd_batch(s)))
        losses.append(sc.loss_value(value))
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    got = ts.host_params(state)  # cut back to V x D
    assert {k: got[k].shape for k in ODD} == ODD
    assert_trees_close(got, params, rtol=1e-4, atol=1e-5)
    for k, (v, d) in ODD.items():  # stored padded (or packed); the padding still zero
        stored = np.asarray(state.params[k])
        split = {"row": 0, "column": 1, "table": 0}[ODD_MIXES[mix][k]]
        assert stored.shape[split] % N == 0
        assert not np.any(stored[v:]) and not np.any(stored[:, d:]), k  # table-wise: on w0
    bad = odd_batch(0)
    bad["a"][0] = 13  # a padded row is not a valid id
    with pytest.raises(ValueError, match=r"outside \[0, 13\) of table a"):
        ts.place_batch(bad)


def test_the_pipelined_step_refuses_a_table_it_would_pad():
    with pytest.raises(ValueError, match=r"table a has D \(columns\) = 6, not divisible by the 8"):
        sc.make_train_step(
            odd_loss,
            optax.sgd(0.1),
            runtime.data_mesh(N),
            odd_init(),
            "embrace_2d",
            embedding_paths=[(k,) for k in ODD],
        )
