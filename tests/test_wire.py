"""The precision on the wire (``comm.wire``): each codec against a numpy reference, each
collective against a list-of-blocks reference, the compiled bytes against the cost
formulas to the byte, the spec's parser and its refusals."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from experiments.train import train_and_evaluate
from experiments.train.config import RunConfig
from sparsecomm_jax import runtime
from sparsecomm_jax.comm import costmodel, hlo, wire
from sparsecomm_jax.errors import ArgumentError

N = 4
FP8 = [wire.E4M3, wire.E5M2]
NUMPY = {"float8_e4m3fn": ml_dtypes.float8_e4m3fn, "float8_e5m2": ml_dtypes.float8_e5m2}


def _quantized(x, c):
    """numpy: what a row of ``x`` arrives as in codec ``c`` (per-row scale for FP8; the
    values times the scale's reciprocal, as ``wire.encode`` writes it)."""
    x = np.asarray(x, np.float32)
    if c.name == "float32":
        return x
    if c.name == "bfloat16":
        return x.astype(ml_dtypes.bfloat16).astype(np.float32)
    fmax = np.float32(ml_dtypes.finfo(NUMPY[c.name]).max)
    amax = np.max(np.abs(x), axis=-1, keepdims=True)
    scale = np.maximum(amax * np.float32(1 / fmax), np.finfo(np.float32).tiny)
    q = np.clip(x * (np.float32(1) / scale), -fmax, fmax).astype(NUMPY[c.name])
    return q.astype(np.float32) * scale


@pytest.mark.parametrize("c", FP8, ids=lambda c: c.name)
def test_fp8_bits_round_as_the_conversion_does(c):
    """Every FP8 value, the midpoints between neighbours (ties to even) and a float32
    step either side of them, signed zeros, the subnormal range and values far below
    it, and random values over the whole range: the bits ``astype`` gives."""
    fp8 = NUMPY[c.name]
    codes = np.arange(256, dtype=np.uint8).view(fp8).astype(np.float32)
    finite = np.unique(np.abs(codes[np.isfinite(codes)]))  # ascending, 0 first
    mid = (finite[:-1] + finite[1:]) / 2  # exact in float32
    near = np.concatenate([mid, np.nextafter(mid, 0), np.nextafter(mid, np.inf)])
    rng = np.random.default_rng(0)
    fmax = float(ml_dtypes.finfo(fp8).max)
    spread = np.exp(rng.uniform(np.log(1e-12), np.log(fmax), 20_000))
    v = np.concatenate([finite, near, finite[1] * np.array([0.25, 0.5, 0.75]), spread])
    v = np.concatenate([v, -v, [-0.0]]).astype(np.float32)
    v = v[np.abs(v) <= fmax]
    got = np.asarray(jax.jit(lambda a: wire.fp8_bits(a, c))(v))
    np.testing.assert_array_equal(got, v.astype(fp8).view(np.uint8))
    nan = np.asarray(wire.fp8_bits(jnp.array([np.nan], jnp.float32), c)).view(fp8)
    assert np.isnan(nan.astype(np.float32)).all()


def _rows(rng, shape):
    """Rows of very different magnitudes (1e-3 to 1e4), one of zeros, one of values in
    (1e-37, 4e-36), normal floats whose amax / 448 would be subnormal (the scale is
    float32's smallest normal there; subnormal inputs the CPU flushes to zero)."""
    x = rng.normal(size=shape) * 10.0 ** rng.uniform(-3, 4, size=(*shape[:-1], 1))
    x[(0,) * (len(shape) - 1)] = 0
    tiny = rng.uniform(1e-37, 4e-36, size=shape[-1]) * rng.choice([-1, 1], size=shape[-1])
    x[(-1,) * (len(shape) - 1)] = tiny
    return x.astype(np.float32)


@pytest.mark.parametrize("c", list(wire.CODECS.values()), ids=list(wire.CODECS))
def test_a_row_arrives_as_numpy_rounds_it(c):
    rng = np.random.default_rng()
    x = _rows(rng, (6, 37))
    bits = jax.jit(lambda v: wire.encode(v, c))(x)
    assert bits.dtype == c.bits and bits.shape[-1] * bits.dtype.itemsize == wire.row_bytes(37, c)
    got = np.asarray(jax.jit(lambda b: wire.decode(b, c))(bits))
    np.testing.assert_array_equal(got, _quantized(x, c))
    if c.scaled:  # every row keeps its own precision, whatever its magnitude
        rel = 2.0 ** -(4 if c is wire.E4M3 else 3)  # half an ulp of 3 or 2 mantissa bits
        big = np.abs(x) >= np.max(np.abs(x), axis=-1, keepdims=True) / 64  # not subnormal
        big[-1] = False  # the row of 1e-37: its scale is float32's smallest normal
        assert np.all(np.abs(got - x)[big] <= rel * np.abs(x)[big])
        np.testing.assert_array_equal(got[0], 0)
        assert np.isfinite(got).all() and np.abs(got[-1]).max() > 0  # no 0 x inf


@pytest.mark.parametrize("c", FP8, ids=lambda c: c.name)
def test_a_row_with_a_non_finite_value_arrives_nan_throughout(c):
    x = np.ones((3, 8), np.float32)
    x[0, 2], x[2, 5] = np.nan, np.inf
    got = np.asarray(jax.jit(lambda v: wire.decode(wire.encode(v, c), c))(x))
    assert np.isnan(got[0]).all() and np.isnan(got[2]).all()
    np.testing.assert_array_equal(got[1], 1)


def _shard_map(fn, in_specs, out_specs):
    mesh = runtime.data_mesh(N)
    return mesh, jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs))


@pytest.mark.parametrize("c", list(wire.CODECS.values()), ids=list(wire.CODECS))
def test_a2a_rows_moves_each_block_as_a_list_of_blocks_says(c):
    """Worker w's block slice j arrives at worker j as slice w, quantized row by row;
    one all-to-all of exactly (P-1) x rows x row_bytes."""
    rng = np.random.default_rng()
    a, b = _rows(rng, (N, N, 3, 5)), _rows(rng, (N, N, 2, 8))  # [worker, dest, rows, w]

    def body(x, y):
        got = wire.a2a_rows([x[0], y[0]], "data", c)  # per block [P, r, w]
        return got[0][None], got[1][None]

    mesh, fn = _shard_map(body, (P("data"),) * 2, (P("data"),) * 2)
    args = [runtime.put_global(v, mesh, P("data")) for v in (a, b)]
    got_a, got_b = (np.asarray(v) for v in fn(*args))
    for w in range(N):
        for j in range(N):
            np.testing.assert_array_equal(got_a[j, w], _quantized(a[w, j], c))
            np.testing.assert_array_equal(got_b[j, w], _quantized(b[w, j], c))
    colls = hlo.collectives(fn, *args)
    assert [x.kind for x in colls] == ["all-to-all"]
    assert colls[0].bytes_sent == (N - 1) * (3 * wire.row_bytes(5, c) + 2 * wire.row_bytes(8, c))


@pytest.mark.parametrize("c", FP8, ids=lambda c: c.name)
def test_gather_rows_gives_every_worker_every_block(c):
    rng = np.random.default_rng()
    a = _rows(rng, (N, 3, 6))

    def body(x):
        return wire.gather_rows([x[0]], "data", c, to="invarying")[0]

    mesh, fn = _shard_map(body, (P("data"),), P())
    got = np.asarray(fn(runtime.put_global(a, mesh, P("data"))))
    np.testing.assert_array_equal(got, _quantized(a, c))


@pytest.mark.parametrize("size", [5, 80, 1000, 4099])
@pytest.mark.parametrize("c", list(wire.CODECS.values()), ids=list(wire.CODECS))
def test_the_flat_mean_sums_in_float32_and_costs_what_the_formula_says(c, size):
    """``psum_carrying``: the sum of every worker's quantized slice blocks, re-quantized
    by its owner (numpy, block by block); the scalars exact; compiled bytes equal to
    ``costmodel.flat_mean_cost`` to the byte; check_vma on."""
    rng = np.random.default_rng()
    g = rng.normal(size=(N, size)).astype(np.float32)
    extra = rng.normal(size=(N, 3)).astype(np.float32)

    def body(x, e):
        total, every = wire.psum_carrying(x[0], e[0], "data", c)
        return total[None], every[None]

    mesh, fn = _shard_map(body, (P("data"),) * 2, (P("data"),) * 2)
    args = [runtime.put_global(v, mesh, P("data")) for v in (g, extra)]
    total, every = (np.asarray(v) for v in fn(*args))
    padded = wire.padded(size, N, c)
    share = padded // N
    blk = wire.block(share, c)
    flat = np.pad(g, ((0, 0), (0, padded - size))).reshape(N, N, share // blk, blk)
    summed = _quantized(flat, c).sum(axis=0, dtype=np.float32)  # [owner, blocks, blk]
    want = _quantized(summed, c).reshape(-1)[:size]
    for w in range(N):
        np.testing.assert_allclose(total[w], want, rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(every[w], extra)
    loose = {"float32": 1e-5, "bfloat16": 0.03}.get(c.name, 0.3)
    np.testing.assert_allclose(total[0], g.sum(0), rtol=loose, atol=loose * 2)
    colls = hlo.collectives(fn, *args)
    assert hlo.total_bytes(colls) == costmodel.flat_mean_cost(size, N, c, extra=3)[1]
    assert len(colls) == costmodel.flat_mean_cost(size, N, c)[0] // (N - 1)


def test_fp8_sends_about_a_quarter_of_float32():
    for c in FP8:
        dense = costmodel.flat_mean_cost(1 << 20, 8, c)[1] / costmodel.flat_mean_cost(1 << 20, 8)[1]
        assert 0.25 < dense < 0.26  # a scale per 128 values
        assert wire.row_bytes(128, c) / wire.row_bytes(128, wire.FLOAT32) < 0.26


def test_parse_names_and_directions():
    assert wire.parse("float32") == wire.DEFAULT and not wire.DEFAULT.narrow
    assert wire.parse("bfloat16") == wire.Wire(*[wire.BFLOAT16] * 3)
    w = wire.parse("backward=float8_e5m2,forward=float8_e4m3fn,dense=bfloat16")
    assert w == wire.Wire(wire.E4M3, wire.E5M2, wire.BFLOAT16) and w.narrow
    assert wire.parse(w.name) == w and wire.parse(w) is w
    assert wire.parse("dense=bfloat16") == wire.Wire(dense=wire.BFLOAT16)


@pytest.mark.parametrize(
    "spec, message",
    [
        ("fp8", "comm_dtype='fp8' is unknown; choose one of"),
        ("forward=fp8", "gives forward 'fp8'; choose one of"),
        ("sideways=bfloat16", "names 'sideways'; directions are"),
        ("forward=bfloat16,forward=float32", "gives 'forward' twice"),
        ("forward=bfloat16,", "names ''; directions are"),
        ("", "must name a codec"),
    ],
)
def test_parse_refuses_with_one_line_naming_comm_dtype(spec, message):
    with pytest.raises(ArgumentError, match=message) as e:
        wire.parse(spec)
    assert e.value.argument == "comm_dtype" and "\n" not in str(e.value)


def test_scalars_ride_any_codec_bit_for_bit():
    x = np.array([np.pi, -1e-30, 3.4e38, np.nan], np.float32)
    for c in wire.CODECS.values():
        back = jax.jit(lambda v, c=c: wire.from_wire_bits(wire.as_wire_bits(v, c), c))(x)
        np.testing.assert_array_equal(np.asarray(back).view(np.uint32), x.view(np.uint32))
        assert jnp.asarray(wire.as_wire_bits(x, c)).dtype == c.bits


@pytest.mark.cli
def test_a_tied_full_softmax_names_the_exchanges_that_stay_float32():
    """A tied full-softmax LM in FP8: the compiled program gathers the whole table in
    float32 (f32[V, D]) and reduce-scatters its gradient in float32, the largest
    collectives of the step; the run's record names exactly that table and why, and a
    float32 run records none."""
    cfg = dict(model="lstm_lm", vocab=2000, dim=32, hidden=16, seq_len=8, batch=16)
    cfg.update(tie_embeddings=True, sampled_softmax=0, devices=4, steps=1, warmup=0)
    cfg.update(strategy="embrace", optimizer="sgd")
    fp8 = train_and_evaluate(RunConfig(**cfg, comm_dtype="float8_e4m3fn"), progress=False)
    (named,) = fp8["float32_exchanges"]
    assert named.startswith("embed/embedding: its whole-table all-gather")
    whole = [c for c in fp8["collectives"] if "f32[2000,32]" in c["shapes"]]
    assert {c["kind"] for c in whole} >= {"all-gather"}
    largest = max(fp8["collectives"], key=lambda c: c["bytes_sent"])
    assert "f32[2000,32]" in largest["shapes"] or "f32[500,32]" in largest["shapes"]
    plain = train_and_evaluate(RunConfig(**cfg), progress=False)
    assert plain["float32_exchanges"] == []
