"""Fusion planning on hand-worked examples; the threshold search against brute force."""

import itertools

import jax.numpy as jnp
import numpy as np
import pytest

from sparsecomm_jax.comm import fusion


def test_plan_buckets_hand_examples():
    assert fusion.plan_buckets([10, 10, 30, 5], bucket_bytes=80) == [[0, 1], [2], [3]]
    assert fusion.plan_buckets([10, 10, 30, 5], bucket_bytes=None) == [[0, 1, 2, 3]]
    assert fusion.plan_buckets([10, 10], bucket_bytes=4) == [[0], [1]]
    with pytest.raises(ValueError, match="bucket_bytes"):
        fusion.plan_buckets([1], -1)
    assert fusion.plan_buckets([0, 10], 40) == [[0, 1]]  # an empty leaf first
    assert fusion.plan_buckets([0, 0, 20], 40) == [[0, 1], [2]]
    assert fusion.plan_buckets([], 40) == []


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
    costs = [cost(c) for c in candidates]
    assert cost(best) <= min(costs) * 1.05  # unimodal only approximately: near the optimum
    plateau = max(len(list(run)) for _, run in itertools.groupby(costs))  # walked once
    assert evals <= 2 * int(np.ceil(np.log2(len(candidates)))) + 2 + plateau


def test_search_threshold_exact_on_unimodal():
    candidates = list(range(100))
    best, _ = fusion.search_threshold(lambda c: (c - 37) ** 2, candidates)
    assert best == 37


def _random_sizes(rng, n):
    """Leaf sizes with repeats, empty leaves and a few leaves far above the rest."""
    sizes = rng.integers(0, 50, size=n)
    sizes[rng.random(n) < 0.2] *= 40  # large leaves
    sizes[rng.random(n) < 0.1] = 0
    return sizes.tolist()


@pytest.mark.parametrize("seed", range(20))
def test_candidate_thresholds_hold_every_plan(seed):
    rng = np.random.default_rng(seed)
    sizes = _random_sizes(rng, int(rng.integers(1, 12)))
    total = 4 * sum(sizes)
    every = {str(fusion.plan_buckets(sizes, t)) for t in range(1, total + 2)}
    candidates = fusion.candidate_thresholds(sizes)
    plans = [str(fusion.plan_buckets(sizes, t)) for t in candidates]
    assert sorted(plans) == sorted(every)  # each plan exactly once
    assert candidates == sorted(candidates)


def test_search_threshold_walks_plateaus():
    costs = {1: 5, 2: 5, 3: 5, 4: 1}
    assert fusion.search_threshold(costs.__getitem__, [1, 2, 3, 4])[0] == 4
    costs = {1: 3, 2: 1, 3: 1, 4: 1, 5: 2}
    assert costs[fusion.search_threshold(costs.__getitem__, [1, 2, 3, 4, 5])[0]] == 1


@pytest.mark.parametrize("seed", range(30))
def test_search_threshold_is_brute_force_on_unimodal_with_plateaus(seed):
    rng = np.random.default_rng(seed)
    down = np.sort(rng.integers(0, 6, size=int(rng.integers(0, 30))))[::-1]
    up = np.sort(rng.integers(0, 6, size=int(rng.integers(1, 30))))
    costs = np.concatenate([down, up])  # non-increasing, then non-decreasing: unimodal
    candidates = list(range(len(costs)))
    best, _ = fusion.search_threshold(lambda c: costs[c], candidates)
    assert costs[best] == costs.min()


@pytest.mark.parametrize("seed", range(10))
def test_search_over_plans_finds_a_brute_force_minimum(seed):
    # A modelled step time of every plan that is unimodal in the threshold: latency per
    # bucket against a cost that grows with the largest bucket.
    rng = np.random.default_rng(seed)
    sizes = _random_sizes(rng, 25)

    def cost(threshold):
        plan = fusion.plan_buckets(sizes, threshold)
        return len(plan) * 0.2 + max(sum(sizes[i] for i in b) for b in plan) * 1e-3

    brute = min(cost(t) for t in range(1, 4 * sum(sizes) + 2))
    candidates = fusion.candidate_thresholds(sizes)
    assert min(cost(c) for c in candidates) == brute
