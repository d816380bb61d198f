"""The balanced sparse all-reduces (``topk_balanced``, ``oktopk``): the owner hash and
the routing against list-of-blocks references, then the aggregators inside a
``check_vma`` ``shard_map`` against numpy on fresh random, skewed and adversarial
inputs: the exact sum of the selections, the exact global top-k, conservation, and the
entries deferred when an owner's slots run out."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from sparsecomm_jax import aggregators, runtime
from sparsecomm_jax.errors import ArgumentError
from sparsecomm_jax.topk import balanced, costs


def lowbias32(x):
    """The block hash of ``topk.balanced``, in numpy uint64 arithmetic mod 2**32."""
    x = x.astype(np.uint64)
    x = ((x ^ (x >> 16)) * 0x7FEB352D) % 2**32
    x = ((x ^ (x >> 15)) * 0x846CA68B) % 2**32
    return x ^ (x >> 16)


def np_owners(size, workers, indices=None):
    """The owner and position of every index (of ``indices``), by the rule of
    ``topk.balanced``'s doc."""
    i = np.arange(size, dtype=np.int64) if indices is None else indices
    block = i // workers
    rotation = (lowbias32(block) % workers).astype(np.int64)
    return (i % workers + rotation) % workers, block


@pytest.mark.parametrize("size, workers", [(1, 1), (3, 4), (10, 3), (64, 8), (1001, 8)])
def test_owner_hash_is_a_bijection_onto_the_shards(size, workers):
    h = balanced.OwnerHash(size, workers)
    owner, position = (np.asarray(a) for a in h.owners(jnp.arange(size)))
    ref_owner, ref_position = np_owners(size, workers)
    np.testing.assert_array_equal(owner, ref_owner)
    np.testing.assert_array_equal(position, ref_position)
    assert len(set(zip(owner.tolist(), position.tolist(), strict=True))) == size
    assert position.max() < h.width
    np.testing.assert_array_equal(h.indices(owner, position), np.arange(size))
    shards = np.zeros((workers, h.width), np.float32)  # the list-of-blocks reference
    x = np.random.default_rng(size).normal(size=size).astype(np.float32)
    shards[owner, position] = x
    np.testing.assert_array_equal(h.unshard(jnp.asarray(shards)), x)


@pytest.mark.parametrize("workers", [3, 8, 32])
def test_a_hot_region_spreads_over_every_owner(workers):
    """A contiguous region, or one index in every ``stride`` (a matrix's column: any
    stride, P^2 and P + 1 included): the most loaded owner gets at most 1.3x the mean
    (contiguous shards would give one owner all of a region)."""
    for stride in (1, workers, workers + 1, workers**2, 64, 1024, 4096):
        region = 40_000 + stride * np.arange(3_000 * workers, dtype=np.int64)
        counts = np.bincount(np_owners(0, workers, region)[0], minlength=workers)
        assert counts.max() <= 1.3 * len(region) / workers, (stride, counts)


def test_route_lays_pairs_out_by_owner_and_leaves_what_does_not_fit():
    rng = np.random.default_rng(0)
    size, workers, slots = 200, 4, 6
    indices = rng.choice(size, 40, replace=False)
    values = rng.normal(size=40).astype(np.float32)
    h = balanced.OwnerHash(size, workers)
    routed = balanced.route(h, jnp.asarray(values), jnp.asarray(indices, jnp.int32), slots)
    owner, position = np_owners(size, workers)
    fits = np.ones(40, bool)
    for o in range(workers):  # reference: each owner's pairs in selection order
        mine = [j for j in range(40) if owner[indices[j]] == o]
        sent = np.asarray(routed.sends[o])
        np.testing.assert_array_equal(sent[: len(mine[:slots])], position[indices[mine[:slots]]])
        assert (sent[len(mine[:slots]) : slots] == h.width).all()  # empty slots: nowhere
        got = sent[slots:].view(np.float32)[: len(mine[:slots])]
        np.testing.assert_array_equal(got, values[mine[:slots]])
        fits[mine[slots:]] = False
    np.testing.assert_array_equal(routed.fits, fits)
    assert int(routed.deferred) == (~fits).sum() > 0


# ------------------------------------------------------------------ the aggregators


def run(agg, grads, residual=None):
    """One update of ``agg`` on float[P, d] (split 3:1 into two leaves) in a
    ``check_vma`` shard_map whose mean is ``P()``; returns (mean, residual, deferred)
    as numpy."""
    workers, d = grads.shape
    mesh = runtime.data_mesh(workers)
    cut = max(1, d * 3 // 4)
    split = lambda x: {"a": x[..., :cut], "b": x[..., cut:]}  # noqa: E731
    agg = aggregators.per_worker(agg, workers)
    state = agg.init(split(jnp.zeros(d)))
    if residual is not None:
        state = state._replace(residual=split(jnp.asarray(residual)))

    def body(g, state):
        mean, state = agg.update(split(g[0]), state)  # g[0]: this worker's, varying
        return jnp.concatenate([mean["a"], mean["b"]]), state

    spec = aggregators.state_spec()
    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("data"), spec), out_specs=(P(), spec)))
    mean, state = fn(runtime.put_global(grads, mesh, P("data")), state)
    residual = np.concatenate([np.asarray(state.residual["a"]), np.asarray(state.residual["b"])], 1)
    return np.asarray(mean), residual, np.asarray(state.deferred)


def selections(acc, k):
    """Each worker's k entries of largest magnitude (ties to the lower index)."""
    out = np.zeros_like(acc)
    for w, row in enumerate(acc):
        top = np.argsort(-np.abs(row), kind="stable")[:k]
        out[w, top] = row[top]
    return out


def global_top(total, k, workers):
    """The k entries of largest magnitude of ``total``, nonzero, ties to the lower
    owner then the lower position (``topk.balanced.global_top``)."""
    owner, position = np_owners(total.size, workers)
    order = np.lexsort((position, owner, -np.abs(total)))
    chosen = [i for i in order[:k] if total[i] != 0]
    out = np.zeros_like(total)
    out[chosen] = total[chosen]
    return out


def inputs(kind, workers, d, seed):
    rng = np.random.default_rng(seed)
    g = rng.normal(size=(workers, d)).astype(np.float32)
    r = (0.1 * rng.normal(size=(workers, d))).astype(np.float32)
    if kind == "skewed":  # every large entry inside one contiguous tenth
        lo = int(rng.integers(0, d - d // 10))
        g *= 1e-3
        g[:, lo : lo + max(1, d // 10)] *= 1e4
    elif kind == "ties":  # magnitudes of 1 and 2 only: ties at every threshold
        g, r = np.sign(g) * rng.integers(1, 3, size=g.shape), np.zeros_like(r)
    elif kind == "zeros":
        g[:], r[:] = 0, 0
    elif kind == "few":  # fewer nonzeros than k
        g[:, 3:], r[:] = 0, 0
    return g.astype(np.float32), r


CASES = [  # (workers, d, density, input): P = 3, 4, 8; k = 1, k = d, a bucket smaller than P
    (3, 1001, 0.05, "random"),
    (4, 600, 0.1, "skewed"),
    (8, 2000, 0.02, "ties"),
    (8, 512, 0.05, "zeros"),
    (4, 97, 0.01, "random"),  # k = 1
    (3, 40, 1.0, "random"),  # k = d
    (8, 5, 0.6, "random"),  # d < P: some owners hold nothing
    (4, 300, 0.2, "few"),
]


@pytest.mark.matrix
@pytest.mark.parametrize("workers, d, density, kind", CASES)
@pytest.mark.parametrize("name", ["topk_balanced", "oktopk"])
def test_the_exact_result_and_conservation_against_numpy(name, workers, d, density, kind):
    g, r = inputs(kind, workers, d, seed=d + workers)
    agg = aggregators.AGGREGATORS[name](density, "data", bucket_bytes=None, selector="exact")
    mean, new_r, deferred = run(agg, g, r)
    acc = g + r
    scale = max(1.0, float(np.abs(acc).max()))
    # conservation: what every worker sent and kept is what came in
    np.testing.assert_allclose(workers * mean + new_r.sum(0), acc.sum(0), atol=1e-5 * scale)
    assert (deferred == 0).all()  # the default slots hold every pair here
    k = max(1, min(d, round(density * d)))
    selected = selections(acc, k)
    total = selected.sum(0)
    want = total if name == "topk_balanced" else global_top(total, k, workers)
    np.testing.assert_allclose(workers * mean, want, rtol=1e-6, atol=1e-6 * scale)
    # each worker keeps what it did not select, and what it selected that did not come back
    np.testing.assert_array_equal(new_r, acc - np.where(want != 0, selected, 0))
    if kind != "zeros":
        assert np.abs(mean).sum() > 0


def test_buckets_each_reduced_on_their_own():
    """Two fused buckets: each its own k and owners; the sum of the selections of each."""
    g, r = inputs("random", 4, 800, seed=7)
    agg = aggregators.topk_balanced(0.05, "data", selector="exact", bucket_bytes=600 * 4)
    mean, new_r, _ = run(agg, g, r)
    acc = g + r
    want = np.concatenate([selections(acc[:, :600], 30), selections(acc[:, 600:], 10)], 1)
    np.testing.assert_allclose(4 * mean, want.sum(0), rtol=1e-6, atol=1e-5)
    np.testing.assert_allclose(4 * mean + new_r.sum(0), acc.sum(0), atol=1e-4)


@pytest.mark.parametrize("name", ["topk_balanced", "oktopk"])
def test_pairs_past_an_owners_slots_wait_in_the_residual_and_are_counted(name):
    """``capacity_factor=1``: C = ceil(k/P) slots an owner, fewer than a random
    selection gives some owner. Nothing is lost, and the count is each worker's pairs
    past C, summed over owners (oktopk may also defer on the way back)."""
    workers, d, density = 4, 400, 0.1
    g, _ = inputs("random", workers, d, seed=11)
    agg = aggregators.AGGREGATORS[name](
        density, "data", bucket_bytes=None, selector="exact", capacity_factor=1.0
    )
    mean, new_r, deferred = run(agg, g)
    np.testing.assert_allclose(workers * mean + new_r.sum(0), g.sum(0), atol=1e-5)
    k, slots = 40, costs.owner_slots(40, workers, 1.0)
    owner, _ = np_owners(d, workers)
    chosen = selections(g, k) != 0
    late = [np.maximum(np.bincount(owner[c], minlength=workers) - slots, 0).sum() for c in chosen]
    if name == "topk_balanced":  # the union of the rest fits its slots here
        np.testing.assert_array_equal(deferred, late)
    assert deferred.sum() >= sum(late) > 0


def test_check_vma_refuses_replicated_gradients():
    mesh = runtime.data_mesh(4)
    agg = aggregators.oktopk(0.1, "data")
    state = agg.init({"w": jnp.zeros(16)})

    def body(w):
        grads = jax.grad(lambda w: jnp.sum(w**2))(w)  # of a P() input: already summed
        return agg.update({"w": grads}, state)[0]["w"]

    fn = jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P())
    with pytest.raises(ValueError, match="replicated"):
        jax.jit(fn)(jnp.ones(16))


@pytest.mark.parametrize("factor", [0.5, 0, -1, float("nan"), float("inf"), "2", True])
def test_an_unusable_capacity_factor_is_a_one_line_error(factor):
    with pytest.raises(ArgumentError, match=r"^capacity_factor=.* must be a number >= 1") as e:
        aggregators.topk_balanced(0.01, capacity_factor=factor)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("density", [0, -0.1, 1.5])
def test_a_density_outside_0_1_is_refused(density):
    with pytest.raises(ValueError, match="density"):
        aggregators.oktopk(density)


@pytest.mark.matrix
@pytest.mark.parametrize("size", [1, 31, 32, 33, 1000])
@pytest.mark.parametrize("fraction", [0.0, 0.1, 0.9, 1.0])
def test_the_bit_counts_against_numpy(size, fraction):
    mask = np.random.default_rng(size).random(size) < fraction
    words = balanced.pack_bits(jnp.asarray(mask))
    np.testing.assert_array_equal(
        np.asarray(balanced.bit_ranks(jnp.asarray(mask))), np.cumsum(mask) - mask
    )
    for count in (1, 7, size):
        want = np.full(count, size)
        set_ = np.nonzero(mask)[0][:count]
        want[: len(set_)] = set_
        np.testing.assert_array_equal(balanced.select_bits(words, count, size), want)
