"""A model the library does not ship (a flax bag-of-words classifier on
``sparsecomm_jax.nn.Embed``), trained as a user would: every table strategy through
``make_train_step`` against a hand-written ``jax.pmap`` + ``lax.pmean`` step, and a
hand-written default ``jax.shard_map`` step (``check_vma`` on) with ``topk_a2a``."""

import functools
import os
import re
import subprocess
import sys

import flax.linen as linen
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import sparsecomm_jax as sc
from sparsecomm_jax import aggregators, checkpoint, nn, runtime
from sparsecomm_jax.embedding.access import PLAIN
from tests.conftest import REPO
from tests.helpers import assert_trees_close

# embrace_2d as its pipelined program (conftest), not as embrace on this CPU mesh
pytestmark = pytest.mark.usefixtures("pipelined_2d")

N, V, D, CLASSES, T, B = 8, 64, 16, 4, 6, 32
LR = 0.5


class BagOfWords(linen.Module):
    """Mean of the token embeddings, then an MLP; ``tied`` scores classes against
    the first ``CLASSES`` rows of the table instead (``Embed.attend``)."""

    embed_cls: type = nn.Embed
    tied: bool = False

    @linen.compact
    def __call__(self, tokens):
        embed = self.embed_cls(V, D, name="embed")
        h = embed(tokens).mean(axis=1)  # float[B, D]
        h = linen.relu(linen.Dense(32)(h))
        if self.tied:
            return embed.attend(linen.Dense(D)(h))[:, :CLASSES]
        return linen.Dense(CLASSES)(h)


def batch_at(step: int) -> dict:
    """Learnable data: class c draws most tokens from its own quarter of the vocabulary."""
    rng = np.random.default_rng(step)
    labels = rng.integers(0, CLASSES, B)
    own = labels[:, None] * (V // CLASSES) + rng.integers(0, V // CLASSES, (B, T))
    tokens = np.where(rng.random((B, T)) < 0.7, own, rng.integers(0, V, (B, T)))
    return {"tokens": tokens.astype(np.int32), "labels": labels.astype(np.int32)}


def make_loss(model):
    def loss(params, batch):
        logits = model.apply(params, batch["tokens"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()

    return loss


def init(model):
    return model.init(jax.random.key(0), jnp.zeros((1, T), jnp.int32))


@functools.cache
def pmap_reference(tied, steps):
    """Hand-written data parallelism: ``jax.pmap``, ``lax.pmean`` of the gradients, SGD."""
    model = BagOfWords(linen.Embed, tied)  # plain flax: no strategy involved
    loss_fn = make_loss(model)

    def step(params, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        grads = jax.lax.pmean(grads, "data")
        params = jax.tree.map(lambda p, g: p - LR * g, params, grads)
        return params, jax.lax.pmean(loss, "data")

    step = jax.pmap(step, axis_name="data")
    params = jax.tree.map(lambda x: np.broadcast_to(x, (N, *x.shape)), init(model))
    losses = []
    for s in range(steps):
        batch = {k: v.reshape(N, -1, *v.shape[1:]) for k, v in batch_at(s).items()}
        params, loss = step(params, batch)
        losses.append(float(loss[0]))
    return losses, jax.tree.map(lambda x: np.asarray(x[0]), params)


def library_run(model, strategy, steps):
    params = init(model)
    ts = sc.make_train_step(
        nn.loss_with_embeddings(make_loss(model)),
        optax.sgd(LR),
        runtime.data_mesh(N),
        params,
        strategy,
        embedding_paths=nn.embedding_paths(params),
        id_keys=("tokens",),
    )
    state, losses = ts.state, []
    for s in range(steps):
        state, loss = ts.step(state, sc.place_for_step(ts, batch_at, s, steps))
        losses.append(sc.loss_value(loss))
    return losses, ts.host_params(state)


def test_id_keys_the_batch_lacks_and_empty_batches_are_errors():
    """A misspelt id key (``token`` for ``tokens``) would turn the id check off."""
    params = init(BagOfWords())
    ts = sc.make_train_step(
        nn.loss_with_embeddings(make_loss(BagOfWords())),
        optax.sgd(LR),
        runtime.data_mesh(N),
        params,
        "embrace",
        embedding_paths=nn.embedding_paths(params),
        id_keys=("token",),
    )
    with pytest.raises(ValueError, match=r"id_keys names \['token'\], which the batch does not"):
        ts.place_batch(batch_at(0))
    empty = {k: v[:0] for k, v in batch_at(0).items()}
    with pytest.raises(ValueError, match=r"batch\['tokens'\] has no examples"):
        ts.place_batch(empty)


def test_embedding_paths_of_a_flax_model():
    assert nn.embedding_paths(init(BagOfWords())) == (("params", "embed", "embedding"),)
    assert nn.embedding_paths(init(BagOfWords())["params"]) == (("embed", "embedding"),)


def test_embrace_equals_hand_written_pmap():
    ref_losses, ref_params = pmap_reference(False, steps=5)
    losses, params = library_run(BagOfWords(), "embrace", steps=5)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6, atol=1e-6)
    assert_trees_close(params, ref_params, rtol=1e-6, atol=1e-6)
    assert ref_losses[-1] < ref_losses[0]


@pytest.mark.parametrize(
    "strategy, embed_cls, tied",
    [
        ("embrace_rowwise", nn.Embed, True),  # attend: a tied output layer
        ("sparse_allgather", nn.Embed, False),
        ("embrace_2d", nn.Embed, False),
        ("embrace", linen.Embed, True),  # an unmodified flax Embed, served by use_ops
    ],
)
def test_every_table_strategy_equals_pmap(strategy, embed_cls, tied):
    model = BagOfWords(embed_cls, tied)
    ref_losses, ref_params = pmap_reference(tied, steps=3)
    losses, params = library_run(model, strategy, steps=3)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6, atol=1e-6)
    assert_trees_close(params, ref_params, rtol=1e-6, atol=1e-6)


def test_topk_a2a_in_a_hand_written_shard_map_step(tmp_path):
    model, steps = BagOfWords(), 40
    loss_fn, params, opt = make_loss(model), init(model), optax.adam(0.02)
    agg = aggregators.per_worker(aggregators.topk_a2a(0.1), N)
    spec = aggregators.state_spec()

    def body(params, opt_state, agg_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(aggregators.vary(params), batch)
        mean, agg_state = agg.update(grads, agg_state)
        updates, opt_state = opt.update(mean, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, agg_state, jax.lax.pmean(loss, "data")

    step = jax.jit(
        jax.shard_map(  # check_vma on (the default): P() outputs are checked replicated
            body,
            mesh=runtime.data_mesh(N),
            in_specs=(P(), P(), spec, P("data")),
            out_specs=(P(), P(), spec, P()),
        )
    )
    opt_state, agg_state, losses = opt.init(params), agg.init(params), []
    ckpt = checkpoint.Checkpointer(tmp_path / "ck", every=steps // 2)
    for s in range(steps):
        params, opt_state, agg_state, loss = step(params, opt_state, agg_state, batch_at(s))
        losses.append(float(loss))
        ckpt.save(s + 1, (params, opt_state, agg_state))  # any pytree, saved when due
    assert np.mean(losses[-5:]) < 0.5 * np.mean(losses[:5]), losses
    residual = np.asarray(agg_state.residual["params"]["embed"]["embedding"])
    assert residual.shape == (N, V, D)  # every worker's residual, as one global array
    assert len({w.tobytes() for w in residual}) == N  # and they differ
    assert np.all(np.abs(residual).sum(axis=(1, 2)) > 0)

    # exact resume: the midway checkpoint, restored into the shapes and shardings of the
    # loop's state (the final one: its values are overwritten), continues to the same
    # losses and the same final state, bit for bit
    like = checkpoint.abstract((params, opt_state, agg_state))
    (params2, opt_state2, agg_state2), start = ckpt.restore(like, step=steps // 2)
    assert start == steps // 2
    assert agg_state2.residual["params"]["embed"]["embedding"].sharding.spec == P("data")
    resumed = []
    for s in range(start, steps):
        params2, opt_state2, agg_state2, loss = step(params2, opt_state2, agg_state2, batch_at(s))
        resumed.append(float(loss))
    ckpt.close()
    assert resumed == losses[start:]
    for a, b in zip(
        jax.tree.leaves((params, opt_state, agg_state)),
        jax.tree.leaves((params2, opt_state2, agg_state2)),
        strict=True,
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_shard_read_outside_a_step_names_the_fix():
    model = BagOfWords()
    params = init(model)
    shard = jax.tree.map(lambda x: x, params)
    shard["params"]["embed"]["embedding"] = params["params"]["embed"]["embedding"][:, : D // N]
    with pytest.raises(ValueError, match=r"embed has shape \(64, 2\).*use_ops"):
        model.apply(shard, batch_at(0)["tokens"])
    with pytest.raises(ValueError, match="Input type must be an integer"):
        model.apply(params, batch_at(0)["tokens"].astype(np.float32))


GUIDE = os.path.join(REPO, "docs", "guides", "your-own-model.md")


def _blocks(path: str) -> list[str]:
    """A page's python code blocks, in order."""
    with open(path) as f:
        return re.findall(r"```python\n(.*?)```", f.read(), re.S)


def _guide_block(marker: str) -> str:
    """The own-model guide's python code block that contains ``marker``."""
    (block,) = [b for b in _blocks(GUIDE) if marker in b]
    return block


def test_guide_snippets_run():
    """The own model of the guide through ``make_train_step`` and through its
    hand-written ``shard_map`` step: the same first loss, and one residual per worker."""
    scope = {}
    exec(_guide_block("nn.loss_with_embeddings(loss)"), scope)  # defines losses, model
    exec(_guide_block("sc.per_worker"), scope)
    params = scope["model"].init(jax.random.key(0), jnp.zeros((1, scope["T"]), jnp.int32))
    state = (params, scope["opt"].init(params))
    agg_state = scope["agg"].init(params)
    _, _, agg_state, first = scope["step"](*state, agg_state, scope["batch_at"](0))
    np.testing.assert_allclose(float(first), scope["losses"][0], rtol=1e-6)
    assert agg_state.residual["params"]["embed"]["embedding"].shape == (
        scope["N"],
        scope["V"],
        scope["D"],
    )


def test_readme_runs_as_one_script():
    """Every python block of the README, in order, in a fresh process."""
    script = "\n".join(_blocks(os.path.join(REPO, "README.md")))
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "losses" in done.stdout


@pytest.mark.parametrize("dtype", [None, jnp.bfloat16])
def test_embed_is_a_drop_in_for_flax_embed(dtype):
    ids = jnp.asarray(batch_at(0)["tokens"])
    query = jax.random.normal(jax.random.key(1), (3, D))
    ours, theirs = nn.Embed(V, D, dtype=dtype), linen.Embed(V, D, dtype=dtype)
    params = theirs.init(jax.random.key(0), ids)
    assert_trees_close(ours.init(jax.random.key(0), ids), params, rtol=0, atol=0)
    for ops in (None, PLAIN):
        with nn.use_ops(ops):
            got, want = ours.apply(params, ids), theirs.apply(params, ids)
            assert got.dtype == want.dtype
            np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
            got = ours.apply(params, query, method="attend")
            want = theirs.apply(params, query, method="attend")
            assert got.dtype == want.dtype
            tol = 1e-6 if dtype is None else 2e-2  # bf16: the product rounds differently
            np.testing.assert_allclose(
                np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=tol, atol=tol
            )
