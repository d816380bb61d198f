"""Selectors against numpy, and their argument checks."""

import jax.numpy as jnp
import numpy as np
import pytest

from sparsecomm_jax import sparsify


def test_exact_topk_matches_numpy():
    x = np.random.default_rng(0).normal(size=500).astype(np.float32)
    values, idx = sparsify.exact_topk(jnp.asarray(x), 20)
    ref = np.argsort(-np.abs(x))[:20]
    assert set(np.asarray(idx).tolist()) == set(ref.tolist())
    np.testing.assert_array_equal(np.asarray(values), x[np.asarray(idx)])


def test_threshold_topk_takes_large_entries_only():
    x = np.random.default_rng(1).normal(size=10_000).astype(np.float32)
    values, idx = sparsify.threshold_topk(jnp.asarray(x), 100, sample=1000)
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


@pytest.mark.parametrize("seed", range(6))
def test_radix_topk_selects_the_exact_entries(seed):
    rng = np.random.default_rng(seed)
    d = int(rng.integers(1, 2000))
    k = int(rng.integers(1, d + 1))
    ties = seed % 2  # half the cases: small integers, so the k-th magnitude is tied
    x = rng.integers(-4, 5, d) if ties else rng.normal(size=d) * 10.0 ** rng.integers(-30, 30)
    x = x.astype(np.float32)
    values, idx = sparsify.radix_topk(jnp.asarray(x), k)
    assert np.asarray(idx).tolist() == _numpy_topk(x, k)  # in index order, exactly k
    np.testing.assert_array_equal(np.asarray(values), x[np.asarray(idx)])
    _, exact = sparsify.exact_topk(jnp.asarray(x), k)
    assert sorted(np.asarray(exact).tolist()) == np.asarray(idx).tolist()


def test_radix_topk_with_zeros_and_signed_zeros():
    x = np.array([0.0, -0.0, 0.0, -2.0, 0.0], np.float32)
    values, idx = sparsify.radix_topk(jnp.asarray(x), 3)
    assert np.asarray(idx).tolist() == [0, 1, 3]
    assert np.asarray(values).tolist() == [0.0, 0.0, -2.0]


@pytest.mark.parametrize("selector", ["exact", "radix"])
def test_per_shard_topk_matches_numpy(selector):
    x = np.random.default_rng(2).normal(size=64).astype(np.float32)
    values, local = sparsify.per_shard_topk(jnp.asarray(x), 3, 4, selector)
    for s, shard in enumerate(x.reshape(4, 16)):
        ref = np.argsort(-np.abs(shard))[:3]
        assert set(np.asarray(local[s]).tolist()) == set(ref.tolist())
        np.testing.assert_array_equal(np.asarray(values[s]), shard[np.asarray(local[s])])


@pytest.mark.parametrize("density", [0.0, -0.1, 1.5, float("nan"), "0.1"])
def test_density_outside_range(density):
    with pytest.raises(ValueError, match=r"density must be in \(0, 1\]"):
        sparsify.num_selected(density, 100)


def test_k_rounding_to_zero():
    with pytest.raises(ValueError, match="keeps k = round"):
        sparsify.num_selected(0.001, 100)
    assert sparsify.num_selected(1.0, 7) == 7


def test_unknown_selector():
    with pytest.raises(ValueError, match="selector must be one of"):
        sparsify.select(jnp.ones(4), 1, "magic")
