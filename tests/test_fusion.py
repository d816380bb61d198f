"""Fusion planning on hand-worked examples; the threshold search against brute force."""

import jax.numpy as jnp
import numpy as np
import pytest

from sparsecomm_jax import fusion


def test_plan_buckets_hand_examples():
    assert fusion.plan_buckets([10, 10, 30, 5], bucket_bytes=80) == [[0, 1], [2], [3]]
    assert fusion.plan_buckets([10, 10, 30, 5], bucket_bytes=None) == [[0, 1, 2, 3]]
    assert fusion.plan_buckets([10, 10], bucket_bytes=4) == [[0], [1]]
    with pytest.raises(ValueError, match="bucket_bytes"):
        fusion.plan_buckets([1], -1)


def test_pack_unpack_roundtrip_with_padding():
    leaves = [jnp.arange(6.0).reshape(2, 3), jnp.ones(5), jnp.full((1,), 7.0)]
    flat = fusion.pack(leaves, [0, 2], multiple=4)
    assert flat.shape == (8,) and float(flat[-1]) == 0.0
    out = fusion.unpack(flat, leaves, [0, 2])
    np.testing.assert_array_equal(out[0], leaves[0])
    np.testing.assert_array_equal(out[2], leaves[2])


def test_pipelined_time_hand_example():
    # leaves ready at 1, 2, 3 s; a bucket costs 1 s + 0.1 s per element
    buckets = [[0, 1], [2]]
    t = fusion.pipelined_time(buckets, [1.0, 2.0, 3.0], lambda n: 1 + 0.1 * n, [10, 10, 10])
    assert t == pytest.approx(max(2 + 3, 3) + 2)  # first ends at 5, second at 7


@pytest.mark.parametrize("seed", range(5))
def test_search_threshold_finds_brute_force_minimum(seed):
    rng = np.random.default_rng(seed)
    sizes = rng.integers(100, 5000, size=30).tolist()
    ready = np.cumsum(rng.uniform(0.001, 0.01, size=30)).tolist()
    candidates = fusion.candidate_thresholds(sizes)

    def cost(threshold):
        plan = fusion.plan_buckets(sizes, threshold)
        return fusion.pipelined_time(plan, ready, lambda n: 0.005 + n * 4e-8, sizes)

    best, evals = fusion.search_threshold(cost, candidates)
    brute = min(cost(c) for c in candidates)
    assert cost(best) <= brute * 1.05  # unimodal only approximately: near the optimum
    assert evals <= 2 * int(np.ceil(np.log2(len(candidates)))) + 2


def test_search_threshold_exact_on_unimodal():
    candidates = list(range(100))
    best, _ = fusion.search_threshold(lambda c: (c - 37) ** 2, candidates)
    assert best == 37
