"""Selectors (values of ``topk.selectors``) and TopKA2A's shard selection against numpy and
lax.top_k, and their argument checks."""

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import a2a_sent
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

from sparsecomm_jax import runtime
from sparsecomm_jax.topk import hostkernel, selectors, shards


def test_exact_topk_matches_numpy():
    x = np.random.default_rng(0).normal(size=500).astype(np.float32)
    values, idx = selectors.exact_topk(jnp.asarray(x), 20)
    ref = np.argsort(-np.abs(x))[:20]
    assert set(np.asarray(idx).tolist()) == set(ref.tolist())
    np.testing.assert_array_equal(np.asarray(values), x[np.asarray(idx)])


def test_threshold_topk_takes_large_entries_only():
    x = np.random.default_rng(1).normal(size=10_000).astype(np.float32)
    values, idx = selectors.threshold_topk(jnp.asarray(x), 100, sample=1000)
    values, idx = np.asarray(values), np.asarray(idx)
    taken = values != 0
    assert 50 <= taken.sum() <= 100  # a sampled threshold is near, not at, the true one
    assert len(set(idx[taken].tolist())) == taken.sum()  # each index at most once
    np.testing.assert_array_equal(values[taken], x[idx[taken]])
    kth = np.sort(np.abs(x))[-100]
    assert np.abs(values[taken]).min() >= 0.5 * kth


def _numpy_topk(x, k):
    """Indices of the k largest |x|, ties to the lower index (a stable sort)."""
    return sorted(np.argsort(-np.abs(x), kind="stable")[:k].tolist())


@pytest.mark.matrix
@pytest.mark.parametrize("seed", range(6))
def test_radix_topk_selects_the_exact_entries(seed):
    rng = np.random.default_rng(seed)
    d = int(rng.integers(1, 2000))
    k = int(rng.integers(1, d + 1))
    ties = seed % 2  # half the cases: small integers, so the k-th magnitude is tied
    x = rng.integers(-4, 5, d) if ties else rng.normal(size=d) * 10.0 ** rng.integers(-30, 30)
    x = x.astype(np.float32)
    values, idx = selectors.radix_topk(jnp.asarray(x), k)
    assert np.asarray(idx).tolist() == _numpy_topk(x, k)  # in index order, exactly k
    np.testing.assert_array_equal(np.asarray(values), x[np.asarray(idx)])
    _, exact = selectors.exact_topk(jnp.asarray(x), k)
    assert sorted(np.asarray(exact).tolist()) == np.asarray(idx).tolist()


def test_radix_topk_with_zeros_and_signed_zeros():
    x = np.array([0.0, -0.0, 0.0, -2.0, 0.0], np.float32)
    values, idx = selectors.radix_topk(jnp.asarray(x), 3)
    assert np.asarray(idx).tolist() == [0, 1, 3]
    assert np.asarray(values).tolist() == [0.0, 0.0, -2.0]


@pytest.mark.parametrize("selector", ["auto", "exact", "radix"])
def test_per_shard_topk_matches_numpy(selector):
    x = np.random.default_rng(2).normal(size=64).astype(np.float32)
    values, local = selectors.select_rows(
        selectors.get(selector), jnp.asarray(x).reshape(4, -1), 3
    )[:2]
    for s, shard in enumerate(x.reshape(4, 16)):
        ref = np.argsort(-np.abs(shard))[:3]
        assert set(np.asarray(local[s]).tolist()) == set(ref.tolist())
        np.testing.assert_array_equal(np.asarray(values[s]), shard[np.asarray(local[s])])


def test_shards_are_array_split_and_slots_follow_real_entries():
    to_shards = jax.jit(shards.to_shards, static_argnums=1)
    from_shards = jax.jit(shards.from_shards, static_argnums=1)
    for d, p in [(13, 4), (37, 8), (5, 8), (64, 8)]:
        x = np.arange(1, d + 1, dtype=np.float32)
        cut, parts = np.asarray(to_shards(x, p)), np.array_split(x, p)
        assert cut.shape == (p, -(-d // p))
        for row, part in zip(cut, parts, strict=True):
            np.testing.assert_array_equal(row[: part.size], part)
            assert not row[part.size :].any()  # padding is zero
        np.testing.assert_array_equal(from_shards(cut, d), x)
        for k in range(1, d + 1):  # k in all; no shard above its real entries or its share
            slots = shards.shard_slots(k, d, p)
            assert sum(slots) == k
            for n, part in zip(slots, parts, strict=True):
                assert 0 <= n <= part.size and abs(n - k * part.size / d) < 1


@pytest.mark.parametrize("selector", ["auto", "exact", "radix"])
def test_shard_topk_with_residual_matches_numpy_at_any_length(selector):
    rng = np.random.default_rng(12)
    for d, p, k in [(13, 4, 1), (37, 8, 11), (50, 4, 50)]:
        x = np.round(rng.normal(size=d)).astype(np.float32)  # ties and zeros
        fn = jax.jit(lambda v, k=k, p=p: shards.shard_select(selectors.get(selector), v, k, p))
        values, local, kept = (np.asarray(a) for a in fn(x))
        sent = a2a_sent(x, k, p)
        np.testing.assert_array_equal(kept, x - sent)
        assert values.shape == local.shape == (p, -(-k // p))
        starts = np.cumsum([0] + [a.size for a in np.array_split(x, p)])[:-1, None]
        got, nonzero = np.zeros_like(x), values != 0  # zeros: padding or dropped slots
        np.add.at(got, (local + starts)[nonzero], values[nonzero])
        np.testing.assert_array_equal(got, sent)


@pytest.mark.parametrize("density", [0.0, -0.1, 1.5, float("nan"), "0.1"])
def test_density_outside_range(density):
    with pytest.raises(ValueError, match=r"density must be in \(0, 1\]"):
        selectors.num_selected(density, 100)


def test_k_rounding_to_zero():
    with pytest.raises(ValueError, match="keeps k = round"):
        selectors.num_selected(0.001, 100)
    assert selectors.num_selected(1.0, 7) == 7


def test_unknown_selector():
    with pytest.raises(ValueError, match="selector must be one of"):
        selectors.get("magic")


def _lax_reference(x, k):
    """lax.top_k's entries, in index order (the reference of every exact selector)."""
    return sorted(np.asarray(jax.lax.top_k(jnp.abs(jnp.asarray(x)), k)[1]).tolist())


@st.composite
def vectors(draw):
    """Random, tied, all-zero, sparse, heavy-tailed and sign-mixed float32 vectors, and a k."""
    d = draw(st.integers(1, 40_000))
    rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
    kind = draw(st.sampled_from(["normal", "ties", "zeros", "sparse", "heavy", "signed_zeros"]))
    x = {
        "normal": lambda: rng.normal(size=d),
        "ties": lambda: rng.integers(-3, 4, d),
        "zeros": lambda: np.zeros(d),
        "sparse": lambda: rng.normal(size=d) * (rng.random(d) < 10.0 ** rng.uniform(-3, -1)),
        "heavy": lambda: rng.standard_cauchy(d) ** 3,
        "signed_zeros": lambda: np.where(rng.random(d) < 0.5, -0.0, 0.0) * rng.integers(0, 2, d),
    }[kind]()
    k = draw(st.integers(1, d) | st.sampled_from([max(1, d // 100), max(1, d // 5)]))
    return x.astype(np.float32), min(k, d)


@settings(max_examples=25, deadline=None)
@given(case=vectors())
def test_auto_topk_is_lax_top_k(case):
    x, k = case
    values, idx = jax.jit(lambda v: selectors.select(selectors.AUTO, v, k))(jnp.asarray(x))
    assert sorted(np.asarray(idx).tolist()) == _lax_reference(x, k)
    np.testing.assert_array_equal(np.asarray(values), x[np.asarray(idx)])


def test_tie_rule_lower_index_wins():
    x = jnp.array([1.0, -2.0, 2.0, 0.5, -2.0, 2.0], jnp.float32)
    for selector in ("auto", "exact", "radix"):
        _, idx = selectors.select(selectors.get(selector), x, 2)
        assert sorted(np.asarray(idx).tolist()) == [1, 2], selector


@pytest.mark.parametrize("where", ["tail", "head"])
def test_host_kernel_exact_when_the_sample_misses(where):
    # n > the kernel's 16384 samples with stride 1: the sample sees only the head.
    rng = np.random.default_rng(3)
    x = rng.normal(size=50_000).astype(np.float32) * 1e-3
    if where == "tail":  # the sample's band lies below the top-k: too many above it
        x[30_000:] *= 1e6
    else:  # the sample's band lies above the top-k: too few candidates
        x[:16_384] *= 1e6
    k = 20_000
    values, idx, residual = hostkernel.topk(jnp.asarray(x), k, residual=True)
    assert np.asarray(idx).tolist() == _numpy_topk(x, k)
    np.testing.assert_array_equal(np.asarray(values), x[np.asarray(idx)])
    kept = x.copy()
    kept[np.asarray(idx)] = 0
    np.testing.assert_array_equal(np.asarray(residual), kept)


_TOPK_1000 = jax.jit(lambda v: hostkernel.topk(v, 1_000, residual=True))


@pytest.mark.parametrize("nonzeros", [300, 1_000, 5_000])
def test_host_kernel_exact_on_sparse_rows(nonzeros):
    # Mostly zeros, as an embedding gradient: the sample sees few nonzeros (k = 1,000);
    # with fewer than k nonzeros the first zeros in index order complete the k.
    rng = np.random.default_rng(nonzeros)
    x = np.zeros(100_000, np.float32)
    x[rng.choice(x.size, nonzeros, replace=False)] = rng.normal(size=nonzeros)
    k = 1_000
    values, idx, residual = _TOPK_1000(x)
    assert np.asarray(idx).tolist() == _numpy_topk(x, k)
    np.testing.assert_array_equal(np.asarray(values), x[np.asarray(idx)])
    kept = x.copy()
    kept[np.asarray(idx)] = 0
    np.testing.assert_array_equal(np.asarray(residual), kept)


def test_host_kernel_orders_nan_first_like_lax():
    x = np.array([1.0, np.nan, np.inf, -3.0, 2.0], np.float32)
    _, idx = selectors.select(selectors.AUTO, jnp.asarray(x), 3)
    assert sorted(np.asarray(idx).tolist()) == _lax_reference(x, 3) == [1, 2, 3]


@pytest.mark.parametrize("selector", tuple(selectors.SELECTORS))
def test_select_with_residual_is_x_minus_densify(selector):
    x = np.random.default_rng(4).normal(size=3000).astype(np.float32)
    values, idx, kept = jax.jit(
        lambda v: selectors.select_with_residual(selectors.get(selector), v, 60)
    )(x)
    dense = np.asarray(selectors.densify(values, idx, 3000))
    np.testing.assert_array_equal(np.asarray(kept), x - dense)


def test_auto_topk_per_worker_in_shard_map_and_under_vmap():
    x = np.random.default_rng(5).normal(size=(4, 300)).astype(np.float32)
    mesh = runtime.data_mesh(4)
    body = jax.shard_map(
        lambda v: selectors.select(selectors.AUTO, v[0], 7)[1][None],
        mesh=mesh,
        in_specs=P("data"),
        out_specs=P("data"),
    )
    got = jax.jit(body)(runtime.put_global(x, mesh, P("data")))
    batched = jax.jit(jax.vmap(lambda v: selectors.select(selectors.AUTO, v, 7)[1]))(x)
    for w in range(4):
        assert sorted(np.asarray(got[w]).tolist()) == _lax_reference(x[w], 7)
        assert sorted(np.asarray(batched[w]).tolist()) == _lax_reference(x[w], 7)


def test_auto_topk_without_host_kernel_uses_lax(monkeypatch):
    monkeypatch.setattr(hostkernel, "available", lambda: False)
    x = np.random.default_rng(6).normal(size=1000).astype(np.float32)
    for k in (5, 300):  # lax.top_k below the crossover, radix above
        _, idx = selectors.select(selectors.AUTO, jnp.asarray(x), k)
        assert sorted(np.asarray(idx).tolist()) == _lax_reference(x, k)


def test_host_kernel_builds_when_a_compiler_exists():
    if shutil.which("c++") or shutil.which("g++"):
        assert hostkernel.available()
        text = (
            jax.jit(lambda v: selectors.select(selectors.AUTO, v, 3)).lower(jnp.ones(64)).as_text()
        )
        assert "callback" in text  # the CPU program runs the kernel, not lax.top_k
    with pytest.raises(RuntimeError, match="building the host kernel topk_kernel.cc failed"):
        hostkernel.build(compiler="false")


@pytest.mark.parametrize("selector", tuple(selectors.SELECTORS))
def test_per_shard_topk_with_residual_is_x_minus_densify(selector):
    x = np.random.default_rng(7).normal(size=400).astype(np.float32)
    fn = jax.jit(lambda v: _rows(selectors.get(selector), v, 5, 4))
    values, local, kept = fn(x)
    ref_values, ref_local = selectors.select_rows(
        selectors.get(selector), jnp.asarray(x).reshape(4, -1), 5
    )[:2]
    pairs = lambda i, v: sorted(zip(np.asarray(i).tolist(), np.asarray(v).tolist(), strict=True))  # noqa: E731
    for s in range(4):  # the same entries per shard (order may differ)
        assert pairs(local[s], values[s]) == pairs(ref_local[s], ref_values[s])
    offsets = (np.arange(4) * 100)[:, None]
    dense = np.asarray(selectors.densify(values, np.asarray(local) + offsets, 400))
    np.testing.assert_array_equal(np.asarray(kept), x - dense)


def _rows(selector, v, k, p):
    """Per-shard selection of a flat vector cut into p rows, the residual flat."""
    values, local, rest = selectors.select_rows(selector, v.reshape(p, -1), k)
    return values, local, rest.reshape(-1)


_PARTS_1000 = jax.jit(lambda *p: selectors.select_parts(selectors.AUTO, list(p), 1_000))


@pytest.mark.parametrize("kind", ["normal", "ties", "sparse"])
def test_select_with_residual_parts_is_the_concatenated_selection(kind):
    # Parts as the leaves of a bucket (one empty), long enough for a strided sample that
    # crosses them: the same entries and residual as lax.top_k on the concatenation.
    rng = np.random.default_rng(len(kind))
    sizes = [30_000, 0, 17, 20_000]
    x = {
        "normal": lambda: rng.normal(size=sum(sizes)),
        "ties": lambda: rng.integers(-2, 3, sum(sizes)),
        "sparse": lambda: rng.normal(size=sum(sizes)) * (rng.random(sum(sizes)) < 0.01),
    }[kind]().astype(np.float32)
    parts = np.split(x, np.cumsum(sizes)[:-1])
    k = 1_000
    values, idx, kept = _PARTS_1000(*parts)
    assert np.asarray(idx).tolist() == _lax_reference(x, k)
    np.testing.assert_array_equal(np.asarray(values), x[np.asarray(idx)])
    want = x.copy()
    want[np.asarray(idx)] = 0
    np.testing.assert_array_equal(np.concatenate([np.asarray(p) for p in kept]), want)


def test_add_to_parts_is_a_scatter_add_on_the_concatenation():
    rng = np.random.default_rng(8)
    sizes = [50, 0, 3, 40]
    x = rng.normal(size=sum(sizes)).astype(np.float32)
    idx = np.concatenate([rng.integers(0, x.size, 60), [50, 52, 53, 0, 92, 92]]).astype(np.int32)
    val = rng.normal(size=idx.size).astype(np.float32)
    parts = np.split(x, np.cumsum(sizes)[:-1])
    got = jax.jit(lambda v, i, *p: selectors.add_to_parts(list(p), v, i))(val, idx, *parts)
    want = x.copy()
    np.add.at(want, idx, val)
    np.testing.assert_allclose(np.concatenate([np.asarray(p) for p in got]), want, rtol=1e-6)


def test_per_shard_topk_with_residual_parts_is_the_concatenated_selection():
    # 4 shards of 12,505 that start and end inside parts: shard-local entries as lax.top_k.
    rng = np.random.default_rng(9)
    sizes = [30_000, 0, 17, 20_003]
    x = (rng.normal(size=sum(sizes)) * (rng.random(sum(sizes)) < 0.05)).astype(np.float32)
    x[:5_000] = rng.integers(-2, 3, 5_000)  # ties in the first shard
    parts = np.split(x, np.cumsum(sizes)[:-1])
    fn = jax.jit(lambda *p: selectors.select_parts_rows(selectors.AUTO, list(p), 300, 4))
    values, local, kept = fn(*parts)
    want = x.copy()
    for s, shard in enumerate(x.reshape(4, -1)):
        assert np.asarray(local[s]).tolist() == _lax_reference(shard, 300)
        np.testing.assert_array_equal(np.asarray(values[s]), shard[np.asarray(local[s])])
        want[s * shard.size + np.asarray(local[s])] = 0
    np.testing.assert_array_equal(np.concatenate([np.asarray(p) for p in kept]), want)


@pytest.mark.parametrize("sizes", [[30_000, 0, 17, 20_003], [30_000, 17, 20_002]])
def test_shard_topk_with_residual_parts_is_the_concatenated_selection(sizes):
    # k = 1,201 over 4 shards (slots 301, 300, 300, 300), equal shards or not.
    rng = np.random.default_rng(10)
    x = (rng.normal(size=sum(sizes)) * (rng.random(sum(sizes)) < 0.05)).astype(np.float32)
    parts = np.split(x, np.cumsum(sizes)[:-1])
    fn = jax.jit(lambda *p: shards.shard_select_parts(selectors.AUTO, list(p), 1_201, 4))
    values, local, kept = fn(*parts)
    ref = jax.jit(lambda v: shards.shard_select(selectors.EXACT, v, 1_201, 4))(x)
    pairs = lambda v, i: sorted(zip(np.asarray(i).tolist(), np.asarray(v).tolist(), strict=True))  # noqa: E731
    for s in range(4):
        assert pairs(values[s], local[s]) == pairs(ref[0][s], ref[1][s])
    np.testing.assert_array_equal(np.concatenate([np.asarray(p) for p in kept]), ref[2])
