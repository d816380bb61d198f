"""Aggregators inside shard_map: conservation on adversarial inputs, numpy references,
equality with dense at density 1, and the compiled programs' collectives and bytes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import a2a_sent
from jax.sharding import PartitionSpec as P

from sparsecomm_jax import aggregators, runtime, strategy_names
from sparsecomm_jax.comm import costmodel, hlo, wire
from sparsecomm_jax.errors import ArgumentError
from sparsecomm_jax.topk import collectives, exchanges, selectors

N = 8
LOSSY = ("topk_allgather", "topk_a2a", "gtopk")


def _program(agg, devices=N):
    """jit(shard_map) of agg.update on a two-leaf gradient tree, one row per worker."""
    mesh = runtime.data_mesh(devices)

    def body(a, b, ra, rb):
        grads = {"a": a[0], "b": b[0]}
        state = aggregators.ErrorFeedbackState({"a": ra[0], "b": rb[0]})
        mean, new = agg.update(grads, state)
        return mean["a"][None], mean["b"][None], new.residual["a"][None], new.residual["b"][None]

    spec = P("data")
    fn = jax.shard_map(
        body, mesh=mesh, in_specs=(spec,) * 4, out_specs=(spec,) * 4, check_vma=False
    )
    return jax.jit(fn), mesh


def run(agg, grads, residual, devices=N):
    """grads/residual: float[P, d] (split 3:1 into two leaves). Returns (mean, residual)."""
    fn, mesh = _program(agg, devices)
    cut = grads.shape[1] * 3 // 4
    args = [grads[:, :cut], grads[:, cut:], residual[:, :cut], residual[:, cut:]]
    ma, mb, ra, rb = fn(*[runtime.put_global(x, mesh, P("data")) for x in args])
    return np.concatenate([ma, mb], 1), np.concatenate([ra, rb], 1)


def inputs(kind, d=512, seed=0):
    rng = np.random.default_rng(seed)
    g = rng.normal(size=(N, d)).astype(np.float32)
    r = (0.1 * rng.normal(size=(N, d))).astype(np.float32)
    if kind == "one_shard":  # all mass in the first 1/P of the vector
        g[:, d // N :] = 0
        r[:] = 0
    elif kind == "ties":
        g = np.sign(g).astype(np.float32)
        r[:] = 0
    elif kind == "zeros":
        g[:], r[:] = 0, 0
    elif kind == "negative":
        g, r = -np.abs(g), -np.abs(r)
    elif kind == "skewed":  # one worker much larger than the others
        g[3] *= 1e4
    return g, r


@pytest.mark.matrix
@pytest.mark.parametrize("kind", ["random", "one_shard", "ties", "zeros", "negative", "skewed"])
@pytest.mark.parametrize("name", LOSSY)
@pytest.mark.parametrize("bucket_bytes", [None, 1024])
def test_conservation(name, kind, bucket_bytes):
    g, r = inputs(kind)
    agg = aggregators.AGGREGATORS[name](0.05, "data", bucket_bytes=bucket_bytes)
    mean, new_r = run(agg, g, r)
    np.testing.assert_array_equal(mean, np.broadcast_to(mean[0], mean.shape))  # same on all
    total = (g + r).sum(0)
    scale = max(1.0, float(np.abs(g + r).max()))
    np.testing.assert_allclose(N * mean[0] + new_r.sum(0), total, atol=1e-5 * scale * N)
    if kind != "zeros":
        assert np.abs(mean[0]).sum() > 0  # something was actually sent


def _topk_dense(x, k):
    out = np.zeros_like(x)
    idx = np.argsort(-np.abs(x), kind="stable")[:k]
    out[idx] = x[idx]
    return out


@pytest.mark.parametrize("selector", ["auto", "exact", "radix"])
def test_topk_allgather_is_mean_of_exact_topk(selector):
    g, _ = inputs("random", d=400, seed=3)
    zero = np.zeros_like(g)
    agg = aggregators.topk_allgather(0.05, "data", bucket_bytes=None, selector=selector)
    mean, _ = run(agg, g, zero)
    ref = np.mean([_topk_dense(x, 20) for x in g], axis=0)
    np.testing.assert_allclose(mean[0], ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("selector", ["auto", "exact", "radix"])
def test_topk_a2a_is_mean_of_per_shard_topk(selector):
    g, _ = inputs("random", d=800, seed=4)
    zero = np.zeros_like(g)
    agg = aggregators.topk_a2a(0.04, "data", bucket_bytes=None, selector=selector)
    mean, _ = run(agg, g, zero)
    # k = 32 of 800, ceil(32 / 8) = 4 per shard of 100
    ref = np.mean(
        [np.concatenate([_topk_dense(s, 4) for s in x.reshape(N, -1)]) for x in g], axis=0
    )
    np.testing.assert_allclose(mean[0], ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "d, workers, density, kind", [(13, 4, 0.1, "ties"), (101, 8, 0.3, "random")]
)
def test_topk_a2a_any_length_sends_k_entries_by_real_shard_sizes(d, workers, density, kind):
    # d=13, P=4, density 0.1: k = 1 entry in all, not one per shard (4, a density of 31%)
    g, r = (x[:workers] for x in inputs(kind, d=d, seed=11))
    agg = aggregators.topk_a2a(density, "data", bucket_bytes=None)
    mean, new_r = run(agg, g, r, devices=workers)
    k = round(density * d)
    sent = np.stack([a2a_sent(x, k, workers) for x in g + r])
    np.testing.assert_allclose(mean[0], sent.mean(0), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(new_r, g + r - sent)
    assert (np.count_nonzero(new_r != g + r, axis=1) == k).all()  # every worker sent k


def test_gtopk_keeps_at_most_k_and_matches_reference():
    g, _ = inputs("random", d=256, seed=5)
    zero = np.zeros_like(g)
    mean, _ = run(aggregators.gtopk(1 / 16, "data", bucket_bytes=None), g, zero)
    k = 16
    # numpy recursive doubling: merge pairs, keep the k largest of the sum
    lists = [_topk_dense(x, k) for x in g]
    step = 1
    while step < N:
        lists = [_topk_dense(lists[i] + lists[i ^ step], k) for i in range(N)]
        step *= 2
    np.testing.assert_allclose(mean[0], lists[0] / N, rtol=1e-5, atol=1e-6)
    assert np.count_nonzero(mean[0]) <= k


@pytest.mark.parametrize("name", LOSSY)
def test_density_one_equals_dense(name):
    g, r = inputs("random", d=256, seed=6)
    mean, new_r = run(aggregators.AGGREGATORS[name](1.0, "data"), g, r)
    np.testing.assert_allclose(mean[0], (g + r).mean(0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(new_r, 0, atol=1e-6)


def _bytes(agg, d):
    fn, mesh = _program(agg)
    cut = d * 3 // 4
    args = [np.zeros((N, c), np.float32) for c in (cut, d - cut, cut, d - cut)]
    return hlo.collectives(fn, *[runtime.put_global(x, mesh, P("data")) for x in args])


def test_topk_a2a_program_and_bytes():
    d, k = 16_000, 160
    colls = _bytes(aggregators.topk_a2a(k / d, "data", bucket_bytes=None), d)
    kinds = [c.kind for c in colls]
    assert "all-to-all" in kinds and "all-gather" in kinds
    assert not [c for c in colls if c.kind == "all-reduce" and c.result_bytes >= d]
    expected = (2 * k + d) * (N - 1) / N * 4
    assert hlo.total_bytes(colls) == pytest.approx(expected, rel=0.05)


def test_topk_allgather_and_gtopk_bytes():
    d, k = 16_000, 160
    colls = _bytes(aggregators.topk_allgather(k / d, "data", bucket_bytes=None), d)
    assert hlo.total_bytes(colls) == pytest.approx(2 * (N - 1) * k * 4, rel=0.05)
    colls = _bytes(aggregators.gtopk(k / d, "data", bucket_bytes=None), d)
    assert {c.kind for c in colls} == {"collective-permute"}
    assert hlo.total_bytes(colls) == pytest.approx(2 * k * 4 * 3, rel=0.05)  # log2(8) = 3


@pytest.mark.parametrize("density", [0.0, 1.01, -1])
@pytest.mark.parametrize("name", LOSSY)
def test_bad_density(name, density):
    with pytest.raises(ValueError, match="density must be in"):
        aggregators.AGGREGATORS[name](density, "data")


def test_k_rounds_to_zero_is_an_error():
    g, r = inputs("random", d=64)
    with pytest.raises(ValueError, match="keeps k = round"):
        run(aggregators.topk_a2a(0.001, "data", bucket_bytes=None), g, r)


def test_adaptive_sends_buckets_too_small_for_one_entry_dense():
    """density 0.01 and buckets of 16 entries: k rounds to 0, so adaptive sends them dense
    (the exact mean, nothing left behind) where topk_a2a refuses; a large bucket in the
    same gradient still goes sparse."""
    g, r = inputs("random", d=64)
    agg = aggregators.adaptive(0.01, "data", bucket_bytes=64)
    mean, new_r = run(agg, g, r)
    np.testing.assert_allclose(mean[0], (g + r).mean(0), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(new_r, 0)
    big, big_r = inputs("random", d=4096)
    mean, new_r = run(aggregators.adaptive(0.01, "data", bucket_bytes=None), big, big_r)
    assert np.abs(new_r).sum() > 0  # sparse: most of it stays behind as residual


def test_per_worker_state_of_the_wrong_worker_count_is_an_error():
    agg = aggregators.per_worker(aggregators.topk_a2a(0.1), 8)
    mesh = runtime.data_mesh(4)
    params = {"w": jnp.zeros(64)}
    spec = aggregators.state_spec()
    step = jax.shard_map(
        lambda g, s: agg.update(g, s), mesh=mesh, in_specs=(P(), spec), out_specs=(P(), spec)
    )
    with pytest.raises(ValueError, match=r"num_workers=8\) runs on a mesh axis of 4 workers"):
        jax.eval_shape(step, params, agg.init(params))


def test_non_float_gradients_are_an_error():
    agg = aggregators.topk_allgather(0.5, "data")
    grads = {"w": jnp.zeros(4, jnp.int32)}
    with pytest.raises(ValueError, match=r"\['w'\] has dtype int32"):
        jax.eval_shape(
            jax.shard_map(
                lambda g: agg.update(g, agg.init(g))[0],
                mesh=runtime.data_mesh(N),
                in_specs=P(),
                out_specs=P(),
                check_vma=False,
            ),
            grads,
        )


def test_gtopk_needs_power_of_two():
    g, r = inputs("random", d=60)
    with pytest.raises(ValueError, match="power-of-two"):
        run(aggregators.gtopk(0.5, "data"), g[:6], r[:6], devices=6)


# ------------------------------------------- a user's own step: check_vma, per-worker state


def _checked_program(agg, devices=N):
    """A default ``jax.shard_map`` (check_vma on): mean out as ``P()``, state per worker."""
    mesh = runtime.data_mesh(devices)
    spec = aggregators.state_spec()

    def body(grads, state):
        grads = jax.tree.map(lambda x: x[0], grads)  # {"a": float[cut], "b": float[d - cut]}
        return agg.update(grads, state)

    fn = jax.shard_map(body, mesh=mesh, in_specs=(P("data"), spec), out_specs=(P(), spec))
    return jax.jit(fn), mesh


@pytest.mark.parametrize("name", [*LOSSY, "adaptive"])
def test_check_vma_mean_is_replicated_and_equal_to_unchecked(name):
    g, r = inputs("random", d=512, seed=7)
    options = {"link": costmodel.Link(alpha=0.0, beta=1.0)} if name == "adaptive" else {}
    agg = aggregators.AGGREGATORS[name](0.05, bucket_bytes=1024, **options)  # axis "data"
    wrapped = aggregators.per_worker(agg, N)
    state = wrapped.init({"a": np.zeros(384, np.float32), "b": np.zeros(128, np.float32)})
    assert state.residual["a"].shape == (N, 384)
    state = aggregators.ErrorFeedbackState({"a": r[:, :384], "b": r[:, 384:]})
    fn, mesh = _checked_program(wrapped)
    mean, new = fn({"a": g[:, :384], "b": g[:, 384:]}, state)
    ref_mean, ref_r = run(agg, g, r)  # check_vma=False, per-worker outputs
    np.testing.assert_array_equal(np.concatenate([mean["a"], mean["b"]]), ref_mean[0])
    residual = np.concatenate([np.asarray(new.residual["a"]), np.asarray(new.residual["b"])], 1)
    np.testing.assert_array_equal(residual, ref_r)  # every worker's residual, shape [P, d]
    assert len({row.tobytes() for row in residual}) == N


def test_check_vma_dense_allreduce_is_the_mean():
    g, _ = inputs("random", d=64, seed=8)
    fn, _ = _checked_program(aggregators.per_worker(aggregators.dense_allreduce(), N))
    mean, state = fn({"a": g[:, :48], "b": g[:, 48:]}, aggregators.EmptyState())
    np.testing.assert_allclose(np.concatenate([mean["a"], mean["b"]]), g.mean(0), rtol=1e-6)


def _grad_step(agg, use_vary):
    """One hand-written step: local gradient of sum(x * w), aggregated; check_vma on."""

    def body(w, x):
        w_in = aggregators.vary(w) if use_vary else w
        grads = jax.grad(lambda w: jnp.sum(x * w))(w_in)  # float[d]
        return agg.update(grads, agg.init(grads))[0]

    mesh = runtime.data_mesh(N)
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P("data")), out_specs=P()))


@pytest.mark.parametrize("name", ["dense", "topk_a2a"])
def test_vary_gives_each_worker_its_own_gradient(name):
    x = np.random.default_rng(9).normal(size=(N, 64)).astype(np.float32)
    agg = aggregators.AGGREGATORS[name](1.0)
    mean = _grad_step(agg, use_vary=True)(np.ones(64, np.float32), x)
    np.testing.assert_allclose(mean, x.mean(0), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match=r"already summed.*aggregators.vary\(params"):
        _grad_step(agg, use_vary=False)(np.ones(64, np.float32), x)


@pytest.mark.parametrize("selector", ["radix", "threshold"])
def test_gtopk_takes_a_selector(selector):
    g, r = inputs("random", d=256, seed=10)
    mean, new_r = run(aggregators.gtopk(1 / 16, selector=selector, bucket_bytes=None), g, r)
    np.testing.assert_allclose(N * mean[0] + new_r.sum(0), (g + r).sum(0), atol=1e-4)
    if selector == "radix":  # the same entries as exact selection
        exact, _ = run(aggregators.gtopk(1 / 16, bucket_bytes=None), g, r)
        np.testing.assert_allclose(mean, exact, rtol=1e-6, atol=1e-7)


def test_check_vma_costs_bytes_only_for_gtopk():
    d, k = 16_000, 160
    cut = d * 3 // 4
    grads = {"a": np.zeros((N, cut), np.float32), "b": np.zeros((N, d - cut), np.float32)}
    for name in LOSSY:
        agg = aggregators.AGGREGATORS[name](k / d, bucket_bytes=None)
        checked_fn, _ = _checked_program(aggregators.per_worker(agg, N))
        state = aggregators.ErrorFeedbackState(jax.tree.map(np.zeros_like, grads))
        checked = hlo.total_bytes(hlo.collectives(checked_fn, grads, state))
        unchecked = hlo.total_bytes(_bytes(agg, d))
        # gtopk: every worker sends 1/P of the final k-list (values and indices) once more
        extra = 2 * (N - 1) / N * k * 4 if name == "gtopk" else 0
        assert checked == pytest.approx(unchecked + extra, rel=1e-6), name


_HOST_MERGE = jax.jit(lambda *a: collectives.merge_topk(*a, 40))
_LAX_MERGE = jax.jit(lambda *a: collectives._lax_merge_topk(*a, 40))


@pytest.mark.parametrize("kind", ["random", "ties", "overlap"])
def test_host_merge_topk_is_the_lax_merge(kind):
    # Two k-lists in any order, sharing indices, with padding (0 at index 0) and sums
    # that cancel: the host kernel keeps and drops the same mass as sort + lax.top_k.
    rng = np.random.default_rng(len(kind))
    k, d = 40, 120 if kind == "overlap" else 1000
    lists = []
    for _ in range(2):
        idx = rng.choice(d, k, replace=False).astype(np.int32)
        val = rng.integers(-2, 3, k) if kind == "ties" else rng.normal(size=k)
        val = val.astype(np.float32)
        val[:3], idx[:3] = 0.0, 0  # padding entries, repeated index 0
        lists += [jnp.asarray(val), jnp.asarray(idx)]
    lists[2] = lists[2].at[5].set(-lists[0][5]).at[5 + 1].set(lists[0][6])  # cancel / add
    lists[3] = lists[3].at[5].set(lists[1][5]).at[6].set(lists[1][6])
    host, ref = _HOST_MERGE(*lists), _LAX_MERGE(*lists)  # compiled once for every kind
    dense = lambda v, i: np.asarray(selectors.densify(v, i, d))  # noqa: E731
    for got, want in ((host[:2], ref[:2]), (host[2:], ref[2:])):
        np.testing.assert_array_equal(dense(*got), dense(*want))
    assert np.all(np.diff(np.asarray(host[1])[np.asarray(host[0]) != 0]) > 0)  # index order


@pytest.mark.parametrize("comm_dtype", ["float32", "bfloat16", "float8_e4m3fn"])
def test_flat_allreduce_carries_every_workers_scalars_exactly(comm_dtype):
    """``update_carrying``: the mean as ``wire.psum`` gives it, and every worker's float32
    scalars (values no bfloat16 holds) at every worker bit for bit, in worker order,
    within the same two collectives (an all-to-all and an all-gather)."""
    rng = np.random.default_rng()
    g = rng.normal(size=(N, 37)).astype(np.float32)  # 37: not a multiple of P
    extra = (rng.normal(size=(N, 3)) * np.pi).astype(np.float32)
    agg = aggregators.flat_allreduce("data", comm_dtype)
    mesh = runtime.data_mesh(N)

    def carrying(x, e):
        mean, _, every, ok = agg.update_carrying({"g": x[0]}, aggregators.EmptyState(), e[0])
        assert ok.shape == () and ok.dtype == jnp.bool_
        return mean["g"][None], every[None]

    def plain(x, e):  # the mean by wire.psum: the all-to-all and all-gather, no extra
        return wire.psum(x[0], "data", wire.codec(comm_dtype), scatter=True)[None] / N

    specs = dict(mesh=mesh, in_specs=(P("data"),) * 2)  # check_vma on, as by default
    fn = jax.jit(jax.shard_map(carrying, out_specs=(P("data"),) * 2, **specs))
    args = [runtime.put_global(x, mesh, P("data")) for x in (g, extra)]
    mean, every = (np.asarray(x) for x in fn(*args))
    np.testing.assert_array_equal(
        mean, jax.jit(jax.shard_map(plain, out_specs=P("data"), **specs))(*args)
    )
    # the mean's rounding: none; bfloat16's 8 bits; FP8's 4 bits of each block's amax
    # (about 3 here), on the way out and again on the sums' way back
    tol = {"float32": 1e-6, "bfloat16": 1e-2, "float8_e4m3fn": 0.15}[comm_dtype]
    np.testing.assert_allclose(mean[0], g.mean(0), rtol=tol, atol=tol)
    for w in range(N):  # what each worker received: every worker's scalars, exactly
        np.testing.assert_array_equal(every[w], extra)
    kinds = sorted(c.kind for c in hlo.parse_collectives(fn.lower(*args).compile().as_text()))
    assert kinds == ["all-gather", "all-to-all"]


@pytest.mark.parametrize("name", ["topk_allgather"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_topk_carries_every_workers_scalars_in_its_own_collectives(name, dtype):
    """``update_carrying`` of ``topk_allgather``: bit for bit the mean and residual
    of ``update``, every worker's float32 scalars at every worker exactly, in the same
    collectives (no all-reduce of their own), two buckets (the scalars ride the last);
    ``state_ok`` is false on every worker when one worker's ``grad + residual`` holds a
    NaN (what it sends or keeps), true otherwise. check_vma on."""
    rng = np.random.default_rng()
    g = rng.normal(size=(N, 300)).astype(np.float32)
    r = (0.1 * rng.normal(size=(N, 300))).astype(np.float32)
    extra = (rng.normal(size=(N, 3)) * np.pi).astype(np.float32)
    agg = aggregators.AGGREGATORS[name](0.1, "data", bucket_bytes=600)  # two buckets
    mesh = runtime.data_mesh(N)

    def state_of(x):
        return aggregators.ErrorFeedbackState({"a": x[0, :200], "b": x[0, 200:]})

    def grads_of(x):
        return {"a": x[0, :200].astype(dtype), "b": x[0, 200:].astype(dtype)}

    def carrying(x, res, e):
        mean, new, every, ok = agg.update_carrying(grads_of(x), state_of(res), e[0])
        flat = jnp.concatenate([mean["a"], mean["b"]]).astype(jnp.float32)
        kept = jnp.concatenate([new.residual["a"], new.residual["b"]])
        return flat[None], kept[None], every[None], ok[None]

    def plain(x, res, e):
        mean, new = agg.update(grads_of(x), state_of(res))
        flat = jnp.concatenate([mean["a"], mean["b"]]).astype(jnp.float32)
        return flat[None], jnp.concatenate([new.residual["a"], new.residual["b"]])[None]

    spec = P("data")
    fn = jax.jit(jax.shard_map(carrying, mesh=mesh, in_specs=(spec,) * 3, out_specs=(spec,) * 4))
    ref = jax.jit(jax.shard_map(plain, mesh=mesh, in_specs=(spec,) * 3, out_specs=(spec,) * 2))
    for poisoned in (False, True):
        if poisoned:
            g[5, 17] = np.nan
        args = [runtime.put_global(x, mesh, spec) for x in (g, r, extra)]
        mean, kept, every, ok = (np.asarray(x) for x in fn(*args))
        want_mean, want_kept = (np.asarray(x) for x in ref(*args))
        np.testing.assert_array_equal(mean, want_mean)
        np.testing.assert_array_equal(kept, want_kept)
        for w in range(N):
            np.testing.assert_array_equal(every[w], extra)
        assert ok.tolist() == [not poisoned] * N

    def kinds(f):
        return sorted(c.kind for c in hlo.parse_collectives(f.lower(*args).compile().as_text()))

    assert kinds(fn) == kinds(ref)


def test_one_registration_makes_an_exchange_an_aggregator_and_a_strategy(monkeypatch):
    """Registering an ``Exchange`` is the one step: ``AGGREGATORS`` builds its aggregator
    (error feedback around it, conserving every entry), and the strategy names take it
    alone and after a table strategy; an option it does not take is refused."""
    monkeypatch.setattr(exchanges, "EXCHANGES", dict(exchanges.EXCHANGES))
    twice = exchanges.ALLGATHER._replace(name="topk_allgather_again", carries=False)
    exchanges.register(twice)
    assert "topk_allgather_again" in aggregators.AGGREGATORS
    assert {"topk_allgather_again", "embrace+topk_allgather_again"} <= set(strategy_names())
    g, r = inputs("skewed", seed=3)
    agg = aggregators.AGGREGATORS["topk_allgather_again"](0.05, "data", bucket_bytes=1024)
    mean, new_r = run(agg, g, r)
    want, want_r = run(aggregators.topk_allgather(0.05, "data", bucket_bytes=1024), g, r)
    np.testing.assert_array_equal(mean, want)  # the same exchange, the same numbers
    np.testing.assert_array_equal(new_r, want_r)
    with pytest.raises(ArgumentError, match="capacity_factor"):
        aggregators.AGGREGATORS["topk_allgather_again"](0.05, capacity_factor=2.0)
    with pytest.raises(ArgumentError, match="capacity_factor"):
        aggregators.AGGREGATORS["topk_balanced"](0.05, capacity_factor=0.5)
