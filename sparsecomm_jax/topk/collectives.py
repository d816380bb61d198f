"""Sparse all-reduce collectives: pure functions for ``shard_map`` bodies.

Each takes this worker's selection and returns the *sum* over workers as a dense
vector, identical on every worker (divide by P for the mean) and typed so: under
``jax.shard_map``'s ``check_vma`` it is replicated, usable with ``out_specs=P()``.
The collectives are ``topk_allgather`` (all-gather of the (value, index) pairs,
scatter-add), ``topk_a2a`` (all-to-all per shard, local add, all-gather of the shards)
and ``gtopk`` (log2 P rounds of ppermute and re-selection). Their messages and bytes
per worker are ``topk.exchanges.messages_and_bytes``.

References:
    Peng et al., "TopKA2A", ICPP 2024.
    Shi et al., "A Distributed Synchronous SGD Algorithm with Global Top-k
    Sparsification for Low Bandwidth Networks" (gTop-k), ICDCS 2019.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sparsecomm_jax.comm.vma import all_gather_replicated, vma_checked
from sparsecomm_jax.topk import hostkernel
from sparsecomm_jax.topk.selectors import densify


def topk_allgather(values, indices, size: int, axis_name: str):
    """Sum of every worker's sparse vector by all-gather and scatter-add.

    Per worker (P=2, size 4)::

        before: w0 ([5.], [1])        w1 ([2.], [1])
        all_gather: both ([5., 2.], [1, 1])
        after:  both [0, 7, 0, 0]

    Args:
      values: float[k]; indices: int[k] into [0, size).
      size: d, length of the dense result.
      axis_name: the mesh axis.

    Returns:
      float[size], the sum over workers.
    """
    all_values = all_gather_replicated(values, axis_name)  # float[P*k]
    all_indices = all_gather_replicated(indices, axis_name)  # int[P*k]
    return densify(all_values, all_indices, size)


def topk_allgather_carrying(values, indices, size: int, axis_name: str, extra):
    """``topk_allgather``, and every worker's float32 ``extra`` (a few scalars: a loss,
    flags) as raw int32 bits at the end of its indices: no collective of their own,
    exact whatever the values' dtype.

    Per worker (P=2, size 4): before w0 ``([5.], [1], extra [a])``, w1 ``([2.], [1],
    extra [b])``; after both ``([0, 7, 0, 0], [[a], [b]])``.

    Returns:
      ``(float[size] the sum over workers, float32[P, m] every worker's extra)``.
    """
    k = indices.shape[0]
    bits = jax.lax.bitcast_convert_type(extra.astype(jnp.float32), jnp.int32)  # int32[m]
    share = jnp.concatenate([indices.astype(jnp.int32), bits])  # int32[k + m]
    every = jax.lax.all_gather(share, axis_name, to="invarying")  # int32[P, k + m]
    all_values = all_gather_replicated(values, axis_name)  # float[P*k]
    total = densify(all_values, every[:, :k].reshape(-1), size)
    return total, jax.lax.bitcast_convert_type(every[:, k:], jnp.float32)


def topk_a2a(values, indices, size: int, axis_name: str):
    """TopKA2A: the sparse pieces of shard i go to worker i by one all-to-all; worker i
    sums them into its dense shard; a tiled all-gather returns the whole vector.

    Per worker (P=2, size 4, shards [0:2] and [2:4], shard-local indices)::

        before:     w0 vals [[5.], [1.]] idx [[1], [0]]   w1 vals [[2.], [3.]] idx [[1], [1]]
        all_to_all: w0 vals [[5.], [2.]] idx [[1], [1]]   w1 vals [[1.], [3.]] idx [[0], [1]]
        local add:  w0 [0, 7]                             w1 [1, 3]
        all_gather: both [0, 7, 1, 3]

    Args:
      values: float[P, k/P], this worker's selection per destination shard.
      indices: int[P, k/P], shard-local indices.
      size: d (divisible by P).
      axis_name: the mesh axis.

    Returns:
      float[size], the sum over workers.
    """
    num = values.shape[0]
    if values.shape != indices.shape or size % num:
        raise ValueError(
            f"topk_a2a needs values and indices of one shape [P, k/P] and a size divisible "
            f"by P={num}; got {values.shape}, {indices.shape}, {size}"
        )
    got_values = jax.lax.all_to_all(values, axis_name, 0, 0)  # float[P, k/P] for my shard
    got_indices = jax.lax.all_to_all(indices, axis_name, 0, 0)  # int[P, k/P]
    mine = densify(got_values, got_indices, size // num)  # float[d/P]
    return all_gather_replicated(mine, axis_name)  # float[d]


def merge_topk(values_a, indices_a, values_b, indices_b, k: int):
    """Top-k of the sum of two sparse vectors, and what the re-selection leaves out.

    On CPU (float32) the host kernel merges in one pass over the 2k entries
    (``hostkernel.merge``, lists in index order); elsewhere a sort and ``lax.top_k``.

    Returns:
      ``(values, indices, dropped_values, dropped_indices)``: the k largest-magnitude
      entries of a + b (duplicates summed; ties to the lower index), and the rest of
      a + b as 2k entries (so ``densify(dropped)`` + ``densify(kept)`` = a + b).
    """
    args = (values_a, indices_a.astype(jnp.int32), values_b, indices_b.astype(jnp.int32))
    return hostkernel.dispatch(
        args,
        lambda *a: hostkernel.merge(*a, k),
        lambda *a: _lax_merge_topk(*a, k),
        usable=values_a.dtype == jnp.float32,
    )


def _lax_merge_topk(values_a, indices_a, values_b, indices_b, k: int):
    """``merge_topk`` by a sort of the 2k indices and ``lax.top_k`` of the sums."""
    idx = jnp.concatenate([indices_a, indices_b])  # int[2k]
    val = jnp.concatenate([values_a, values_b])  # float[2k]
    order = jnp.argsort(idx)
    idx, val = idx[order], val[order]
    first = jnp.concatenate([jnp.array([True]), idx[1:] != idx[:-1]])
    run = jnp.cumsum(first) - 1  # run id of each entry
    totals = jnp.zeros_like(val).at[run].add(val)[run]  # run total at every entry
    merged = jnp.where(first, totals, 0.0)  # one entry per distinct index
    _, pick = jax.lax.top_k(jnp.abs(merged), k)
    kept = jnp.zeros(idx.shape, bool).at[pick].set(True)
    return merged[pick], idx[pick], jnp.where(kept, 0.0, merged), idx


def gtopk_lists(values, indices, k: int, axis_name: str):
    """gTop-k on (value, index) lists: log2(P) rounds of pairwise exchange (``ppermute``
    with rank XOR 2^r), each merging two k-lists and re-selecting k.

    Args:
      values: float[k]; indices: int[k].
      k: entries kept after every merge.
      axis_name: the mesh axis (size a power of two).

    Returns:
      ``(values, indices, dropped_values, dropped_indices)``: the final global k-list,
      the same on every worker (typed replicated under ``check_vma``), and the entries
      this worker must keep in its residual, 2k per round (each merge's leftovers are
      assigned to one rank of the group that made it: nothing vanishes and nothing is
      counted twice).
    """
    num = jax.lax.axis_size(axis_name)
    if num & (num - 1):
        raise ValueError(f"gtopk needs a power-of-two number of workers, got {num}")
    rank = jax.lax.axis_index(axis_name)
    left_values, left_indices = [jnp.zeros((0,), values.dtype)], [jnp.zeros((0,), jnp.int32)]
    for r in range(num.bit_length() - 1):
        perm = [(i, i ^ (1 << r)) for i in range(num)]
        other_v = jax.lax.ppermute(values, axis_name, perm)
        other_i = jax.lax.ppermute(indices, axis_name, perm)
        values, indices, left_v, left_i = merge_topk(values, indices, other_v, other_i, k)
        # After round r the 2^(r+1) workers of a group hold the same list and made the
        # same merge: only the group's first rank keeps what it dropped.
        keeper = (rank & ((2 << r) - 1)) == 0
        left_values.append(jnp.where(keeper, left_v, 0.0))
        left_indices.append(left_i)
    if vma_checked(axis_name):  # every worker holds this list; type it so
        values, indices = _replicated_list(values, indices, axis_name)
    return values, indices, jnp.concatenate(left_values), jnp.concatenate(left_indices)


def gtopk(values, indices, size: int, k: int, axis_name: str):
    """gTop-k (``gtopk_lists``) as dense vectors.

    Per worker (P=2, k=1)::

        before: w0 ([5.], [1])  w1 ([2.], [3])
        round 0: both merge {1: 5, 3: 2} and keep ([5.], [1]); w0 keeps {3: 2} aside
        after:  both [0, 5, 0, 0]; dropped mass: w0 [0, 0, 0, 2], w1 zeros

    Args:
      values: float[k]; indices: int[k].
      size: d.
      k: entries kept after every merge.
      axis_name: the mesh axis (size a power of two).

    Returns:
      ``(total, dropped)``: float[size] sum of the final global list (same on every
      worker), and float[size] mass this worker must keep in its residual. Under
      ``check_vma`` the final list is typed replicated by one tiled all-gather of 1/P
      of it per worker (bytes above + 2k/P).
    """
    values, indices, left_v, left_i = gtopk_lists(values, indices, k, axis_name)
    return densify(values, indices, size), densify(left_v, left_i, size)


def _replicated_list(values, indices, axis_name: str):
    """A list every worker holds identically, typed replicated: each worker sends 1/P
    of it by a tiled all-gather ((P-1)/P * 2k * 4 more bytes per worker)."""
    num = jax.lax.axis_size(axis_name)
    pad = -values.shape[0] % num  # padding entries add 0 at index 0
    values, indices = jnp.pad(values, (0, pad)), jnp.pad(indices, (0, pad))
    n = values.shape[0] // num
    start = jax.lax.axis_index(axis_name) * n

    def gather(x):
        return all_gather_replicated(jax.lax.dynamic_slice_in_dim(x, start, n), axis_name)

    return gather(values), gather(indices)
