"""HLO accounting against small hand-written shard_map programs with known bytes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from sparsecomm_jax import runtime
from sparsecomm_jax.comm import hlo

N = 8


def _compile(body, out_specs, x):
    mesh = runtime.data_mesh(N)
    fn = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=out_specs, check_vma=False)
    )
    return hlo.collectives(fn, runtime.put_global(x, mesh, P("data")))


def test_psum_bytes():
    x = np.random.default_rng(0).normal(size=(N * 6,)).astype(np.float32)
    (c,) = _compile(lambda v: jax.lax.psum(v, "data"), P(), x)
    assert c.kind == "all-reduce" and c.group_size == N
    assert c.shapes == (("f32", (6,)),)
    assert c.bytes_sent == pytest.approx(2 * (N - 1) / N * 6 * 4)


def test_all_gather_bytes():
    x = np.arange(N * 5, dtype=np.int32)
    (c,) = _compile(lambda v: jax.lax.all_gather(v, "data", tiled=True), P(), x)
    assert c.kind == "all-gather" and c.shapes == (("s32", (N * 5,)),)
    assert c.bytes_sent == pytest.approx((N - 1) / N * N * 5 * 4)


def test_all_to_all_bytes():
    x = np.zeros((N * N, 3), np.float32)
    (c,) = _compile(lambda v: jax.lax.all_to_all(v, "data", 0, 0, tiled=True), P("data"), x)
    assert c.kind == "all-to-all" and c.result_bytes == N * 3 * 4
    assert c.bytes_sent == pytest.approx((N - 1) / N * N * 3 * 4)


def test_ppermute_bytes():
    x = np.zeros((N * 7,), np.float32)
    perm = [(i, (i + 1) % N) for i in range(N)]
    (c,) = _compile(lambda v: jax.lax.ppermute(v, "data", perm), P("data"), x)
    assert c.kind == "collective-permute" and c.bytes_sent == 7 * 4


def test_psum_scatter_bytes():
    x = np.zeros((N * N * 2,), np.float32)
    (c,) = _compile(lambda v: jax.lax.psum_scatter(v, "data", tiled=True), P("data"), x)
    assert c.kind == "reduce-scatter" and c.result_bytes == 2 * 4
    assert c.bytes_sent == pytest.approx((N - 1) * 2 * 4)


def test_one_collective_per_call_and_order():
    def body(v):
        a = jax.lax.psum(v, "data")
        return jax.lax.all_gather(a * 2, "data", tiled=True)

    colls = _compile(body, P(), np.ones(N * 4, np.float32))
    assert [c.kind for c in colls] == ["all-reduce", "all-gather"]


def test_collectives_of_a_branch_are_marked_and_left_out_of_the_bytes():
    """A ``lax.cond`` branch's collectives, a loop's inside it too, are ``conditional``:
    they run only when the branch is taken, so the bytes per call leave them out."""

    def body(v):
        s = jax.lax.psum(v, "data")  # every call

        def taken(u):
            looped = jax.lax.fori_loop(0, 3, lambda i, a: a + jax.lax.psum(a, "data"), u)
            return jax.lax.all_gather(u, "data", tiled=True)[: u.shape[0]] + looped

        return jax.lax.cond(s[0] > 0, taken, lambda u: u, s)

    x = np.random.default_rng(1).normal(size=(N * 4,)).astype(np.float32)
    colls = _compile(body, P("data"), x)
    always = [c for c in colls if not c.conditional]
    branch = sorted(c.kind for c in colls if c.conditional)
    assert [c.kind for c in always] == ["all-reduce"] and branch == ["all-gather", "all-reduce"]
    psum = 2 * (N - 1) / N * 4 * 4
    gather = (N - 1) / N * N * 4 * 4
    assert hlo.total_bytes(colls) == pytest.approx(psum)
    assert hlo.total_bytes(colls, conditional=True) == pytest.approx(2 * psum + gather)


def test_true_false_computations_count_as_branches():
    text = """HloModule m, num_partitions=2

%t (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %ar = f32[4]{0} all-reduce(%p), replica_groups={{0,1}}, to_apply=%add
}

ENTRY %main (p: pred[], x: f32[4]) -> f32[4] {
  %x = f32[4]{0} parameter(1)
  %ag = f32[8]{0} all-gather(%x), replica_groups={{0,1}}, dimensions={0}
  ROOT %c = f32[4]{0} conditional(%p, %x, %x), true_computation=%t, false_computation=%f
}
"""
    ar, ag = hlo.parse_collectives(text)
    assert (ar.kind, ar.conditional) == ("all-reduce", True)
    assert (ag.kind, ag.conditional) == ("all-gather", False)
    assert hlo.total_bytes([ar, ag]) == pytest.approx(16)


GPU_TEXT = """HloModule jit_step, is_scheduled=true, num_partitions=4

ENTRY %main (p: f32[1024]) -> f32[4096] {
  %p = f32[1024]{0} parameter(0)
  %ars = f32[1024]{0} all-reduce-start(%p), channel_id=1, replica_groups=[1,4]<=[4], to_apply=%add
  %ard = f32[1024]{0} all-reduce-done(%ars)
  %ags = (f32[1024]{0}, f32[4096]{0}) all-gather-start(%ard), channel_id=2, replica_groups={{0,1,2,3}}, dimensions={0}
  %agd = f32[4096]{0} all-gather-done(%ags)
  %a2a = (f32[2,8]{1,0}, f32[2,8]{1,0}, bf16[2,8]{1,0}, f32[2,8]{1,0}) all-to-all(%x, %y, %z, %w), replica_groups={}
  ROOT %cp = s32[10]{0} collective-permute(%q), source_target_pairs={{0,1},{1,0}}
}
"""


def test_async_pairs_tuples_and_group_formats():
    colls = hlo.parse_collectives(GPU_TEXT)
    assert [c.kind for c in colls] == [
        "all-reduce",
        "all-gather",
        "all-to-all",
        "collective-permute",
    ]
    ar, ag, a2a, cp = colls
    assert ar.group_size == 4 and ar.bytes_sent == pytest.approx(2 * 3 / 4 * 4096)
    assert ag.shapes == (("f32", (4096,)),) and ag.bytes_sent == pytest.approx(3 / 4 * 16384)
    assert a2a.group_size == 4 and a2a.result_bytes == 3 * 64 + 32
    assert cp.bytes_sent == 40


def test_single_device_axis_sends_nothing():
    assert hlo.bytes_per_worker("all-reduce", 1000, 1) == 0.0


def test_rejects_non_jitted():
    with pytest.raises(ValueError, match="jax.jit"):
        hlo.collectives(lambda x: x, jnp.ones(3))
