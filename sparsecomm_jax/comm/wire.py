"""The precision on the wire: collectives that send float32, bfloat16 or FP8 and sum
in float32.

An exchange of rows (embedding lookups, their gradients) or of the dense layers'
gradients can travel narrower than float32: ``bfloat16`` halves the bytes, FP8
(``float8_e4m3fn``, ``float8_e5m2``) quarters them. Values are encoded just before the
collective and decoded to float32 on arrival, and every sum is taken in float32 at the
receiver. A narrow payload travels as its bits (uint16, uint8), so no backend widens the
collective (XLA on CPU widens an f8 all-to-all to f16, a bf16 one to f32).

FP8 holds 3 (e4m3) or 2 (e5m2) bits of mantissa and a short range, so each row travels
with one float32 scale, ``amax / FP8 max`` (at least float32's smallest normal), as 4
more bytes of the row (a ``Codec`` with ``scaled``): every value of the row is divided
by it before rounding and multiplied back on arrival. Values far below the row's
largest (under about 2^-15 of it in e4m3) fall into FP8's subnormals or to zero. The
rounding to FP8 is done on the float32 bits (``fp8_bits``: round to nearest, ties to
even: the bits of XLA's conversion, in fewer operations on XLA:CPU). A flat
buffer (the dense layers' mean) has one scale per ``BLOCK`` entries. A row with a
non-finite value arrives as NaN throughout, so the step's finite check sees it.

Each of a step's three exchanges takes its own codec (``Wire``): the rows of the
forward lookups, the row gradients on the way back, and the dense layers' mean.

Example:
    >>> from sparsecomm_jax.comm import wire
    >>> w = wire.parse("forward=float8_e4m3fn,backward=bfloat16")
    >>> w.forward.name, w.backward.name, w.dense.name
    ('float8_e4m3fn', 'bfloat16', 'float32')
    >>> wire.row_bytes(64, w.forward)  # 64 one-byte values and their float32 scale
    68

References:
    Mudigere et al., "High-performance, Distributed Training of Large-scale DLRMs", 2021
    (quantized embedding communication); Micikevicius et al., "FP8 Formats for Deep
    Learning", 2022 (the e4m3 and e5m2 formats).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from sparsecomm_jax.comm import fusion
from sparsecomm_jax.errors import ArgumentError, clipped

F32 = jnp.float32
SCALE_BYTES = 4  # one float32 scale per row (or per block) of a scaled codec
BLOCK = 128  # entries of a flat buffer that share one scale


class Codec(NamedTuple):
    """One precision on the wire.

    Attributes:
      name: how ``--comm-dtype`` says it (``"float8_e4m3fn"``).
      dtype: what each value is rounded to.
      bits: the dtype the collective moves (float32 itself, or unsigned bits).
      scaled: each row travels with a float32 scale (FP8's short range).
    """

    name: str
    dtype: Any
    bits: Any
    scaled: bool = False

    @property
    def narrow(self) -> bool:
        """Whether it sends fewer bytes than float32 (and rounds)."""
        return self.name != "float32"


FLOAT32 = Codec("float32", jnp.float32, jnp.float32)
BFLOAT16 = Codec("bfloat16", jnp.bfloat16, jnp.uint16)
E4M3 = Codec("float8_e4m3fn", jnp.float8_e4m3fn, jnp.uint8, scaled=True)
E5M2 = Codec("float8_e5m2", jnp.float8_e5m2, jnp.uint8, scaled=True)
#: Every codec by name.
CODECS: dict[str, Codec] = {c.name: c for c in (FLOAT32, BFLOAT16, E4M3, E5M2)}
#: The exchanges of a step whose precision is chosen apart, in ``Wire``'s order.
DIRECTIONS = ("forward", "backward", "dense")


class Wire(NamedTuple):
    """The codec of each exchange of a step.

    Attributes:
      forward: the rows of the forward lookups.
      backward: the row gradients on the way back to their owners.
      dense: the dense layers' mean (and a dense table's gradient).
    """

    forward: Codec = FLOAT32
    backward: Codec = FLOAT32
    dense: Codec = FLOAT32

    @property
    def name(self) -> str:
        """One codec's name when all three agree, else ``forward=...,backward=...,dense=...``."""
        if len(set(self)) == 1:
            return self.forward.name
        return ",".join(f"{d}={c.name}" for d, c in zip(DIRECTIONS, self, strict=True))

    @property
    def narrow(self) -> bool:
        """Whether any exchange travels narrower than float32."""
        return any(c.narrow for c in self)


#: float32 on every exchange: the default, lossless.
DEFAULT = Wire()


def codec(name: str) -> Codec:
    """The codec called ``name``; an ``ArgumentError`` naming ``comm_dtype`` otherwise."""
    if name not in CODECS:
        raise ArgumentError("comm_dtype", name, f"is unknown; choose one of {sorted(CODECS)}")
    return CODECS[name]


def _field_codec(spec: Wire, direction: str, value: Codec | str) -> Codec:
    """A ``Wire`` field given as one of ``CODECS`` or as its name
    (``Wire(forward="bfloat16")``); a codec made by hand is refused (the exchanges know
    only these)."""
    if isinstance(value, Codec) and value in CODECS.values():
        return value
    if isinstance(value, str) and value in CODECS:
        return CODECS[value]
    raise ArgumentError(
        "comm_dtype",
        spec,
        f"gives {direction} {clipped(repr(value))}; choose one of {sorted(CODECS)}",
    )


def parse(spec: str | Wire) -> Wire:
    """A ``Wire`` from ``"bfloat16"`` (all three exchanges), from
    ``"forward=float8_e4m3fn,backward=bfloat16"`` (the directions not named stay
    float32), or a ``Wire`` whose fields are codecs or their names.

    Example:
        >>> parse("bfloat16").name
        'bfloat16'
        >>> parse("dense=float8_e5m2").name
        'forward=float32,backward=float32,dense=float8_e5m2'
        >>> parse(Wire(forward="bfloat16")).name
        'forward=bfloat16,backward=float32,dense=float32'

    Raises:
      ArgumentError: an unknown codec or direction, a direction given twice.
    """
    if isinstance(spec, Wire) and all(c in CODECS.values() for c in spec):
        return spec
    if isinstance(spec, Wire):  # its fields may be codecs or their names
        return Wire(*[_field_codec(spec, d, c) for d, c in zip(DIRECTIONS, spec, strict=True)])
    if not isinstance(spec, str) or not spec:
        raise ArgumentError("comm_dtype", spec, f"must name a codec among {sorted(CODECS)}")
    if "=" not in spec:
        return Wire(*[codec(spec)] * 3)
    chosen: dict[str, Codec] = {}
    for part in spec.split(","):
        direction, _, name = part.partition("=")
        if direction not in DIRECTIONS:
            raise ArgumentError(
                "comm_dtype",
                spec,
                f"names {clipped(repr(direction))}; directions are {list(DIRECTIONS)}",
            )
        if direction in chosen:
            raise ArgumentError("comm_dtype", spec, f"gives {direction!r} twice")
        if name not in CODECS:
            raise ArgumentError(
                "comm_dtype",
                spec,
                f"gives {direction} {clipped(repr(name))}; choose one of {sorted(CODECS)}",
            )
        chosen[direction] = CODECS[name]
    return Wire(**chosen)


# ------------------------------------------------------------------ encoding


def row_bytes(width: int, c: Codec) -> int:
    """Bytes on the wire of one row of ``width`` values (its scale included)."""
    return width * np.dtype(c.bits).itemsize + (SCALE_BYTES if c.scaled else 0)


def block(size: int, c: Codec) -> int:
    """The entries that share a scale in a flat slice of ``size`` entries: ``BLOCK``,
    or the whole slice when it is shorter (a small buffer pays one scale, not a
    block of padding)."""
    return min(size, BLOCK) if c.scaled else max(size, 1)


def flat_bytes(size: int, c: Codec) -> int:
    """Bytes on the wire of a flat slice of ``size`` entries (a multiple of
    ``block(size, c)``): one scale per block for a scaled codec."""
    if not c.scaled:
        return row_bytes(size, c)
    b = block(size, c)
    return size // b * row_bytes(b, c)


def _fp8_max(c: Codec) -> float:
    return float(jnp.finfo(c.dtype).max)


def encode(x, c: Codec):
    """float ``x[..., w]`` as the bits the collective moves: ``[..., w]`` for an
    unscaled codec; uint8 ``[..., w + 4]`` for a scaled one, the row's values times the
    reciprocal of its scale ``max(amax / max, float32 tiny)`` and the scale's 4 bytes
    after them. (A multiply by the reciprocal, written so: XLA:CPU turns the division by
    a row's scale into one, and a value a float32 rounding away from an FP8 midpoint
    would otherwise round by which the compiler chose.)"""
    x = x.astype(F32)
    if c.bits == F32:
        return x
    if not c.scaled:
        return jax.lax.bitcast_convert_type(x.astype(c.dtype), c.bits)
    fmax = _fp8_max(c)
    amax = jnp.max(jnp.abs(x), axis=-1, keepdims=True)  # NaN or inf: the row is lost
    # float[..., 1]: never below float32's smallest normal (a zero row, a row of values
    # under 448 x 1e-38 would flush it to zero and decode 0 x inf); NaN stays NaN
    scale = jnp.maximum(amax * F32(1 / fmax), jnp.finfo(F32).tiny)
    values = fp8_bits(jnp.clip(x * (1 / scale), -fmax, fmax), c)
    scale_bits = jax.lax.bitcast_convert_type(scale, c.bits).reshape(*x.shape[:-1], SCALE_BYTES)
    return jnp.concatenate([values, scale_bits], -1)


def decode(bits, c: Codec):
    """``encode`` undone: float32 ``[..., w]``."""
    if c.bits == F32:
        return bits
    if not c.scaled:
        return jax.lax.bitcast_convert_type(bits, c.dtype).astype(F32)
    values = jax.lax.bitcast_convert_type(bits[..., :-SCALE_BYTES], c.dtype).astype(F32)
    scale = jax.lax.bitcast_convert_type(bits[..., -SCALE_BYTES:], F32)  # float[...]
    return values * scale[..., None]


def fp8_bits(v, c: Codec):
    """The bits of float32 ``v`` rounded to the FP8 format of ``c`` (round to nearest,
    ties to even), for ``v`` within FP8's range or NaN: ``v.astype(c.dtype)``'s bits,
    computed on the float32 bits in a few integer operations.

    A normal FP8 value keeps the float32 exponent rebiased and the mantissa's top bits
    rounded (a carry moves into the exponent); one below FP8's smallest normal is its
    count of the smallest subnormal, rounded.

    Example:
        >>> fp8_bits(jnp.array([1.0, -0.1, 3e-3, 448.0]), E4M3).tolist()
        [56, 157, 2, 126]
    """
    info = jnp.finfo(c.dtype)
    mant, least = int(info.nmant), int(info.minexp)  # FP8's smallest normal: 2^least
    drop = 23 - mant  # the float32 mantissa bits FP8 has no room for
    word = jax.lax.bitcast_convert_type(v.astype(F32), jnp.uint32)
    sign = (word >> 24) & 0x80
    magnitude = word & 0x7FFFFFFF
    half = (1 << (drop - 1)) - 1 + ((magnitude >> drop) & 1)  # ties to even
    normal = ((magnitude + half) >> drop) - ((127 - (1 - least)) << mant)  # rebiased
    small = jax.lax.bitcast_convert_type(magnitude, F32)
    tiny = jax.lax.round(small * F32(2.0 ** (mant - least)), TO_EVEN)  # subnormal steps
    code = jnp.where(small < F32(2.0**least), tiny.astype(jnp.uint32), normal)
    nan = int(np.array(np.nan, np.float32).astype(c.dtype).view(np.uint8)) & 0x7F
    code = jnp.where(jnp.isnan(v), nan, code)
    return (code | sign).astype(jnp.uint8)


TO_EVEN = jax.lax.RoundingMethod.TO_NEAREST_EVEN


def encode_flat(x, c: Codec):
    """float ``x[..., n]`` (n a multiple of ``block(n, c)``) encoded in blocks:
    bits[..., m]."""
    blocks = x.reshape(*x.shape[:-1], -1, block(x.shape[-1], c))
    return encode(blocks, c).reshape(*x.shape[:-1], -1)


def decode_flat(bits, c: Codec, size: int):
    """``encode_flat`` of ``size`` entries undone: float32 ``[..., size]``."""
    width = row_bytes(block(size, c), c) // np.dtype(c.bits).itemsize
    blocks = bits.reshape(*bits.shape[:-1], -1, width)
    return decode(blocks, c).reshape(*bits.shape[:-1], size)


# --------------------------------------------------------------- collectives


def a2a_rows(blocks: list, axis: str, c: Codec = FLOAT32) -> list:
    """``all_to_all`` of several blocks of rows in one collective, each row encoded by
    ``c`` (its own scale for FP8), back in float32.

    Per worker (P=2, one block of one row): before w0 ``[[a0], [a1]]``, w1
    ``[[b0], [b1]]``; after w0 ``[[a0], [b0]]``, w1 ``[[a1], [b1]]`` (slice j of every
    worker goes to worker j).

    Args:
      blocks: per block float[P, r, w] (slice j of its leading axis goes to worker j;
        the widths may differ).
      axis: the mesh axis.
      c: the codec.

    Returns:
      per block float32[P, r, w]: slice j from worker j.
    """
    num = jax.lax.axis_size(axis)
    sent = [encode(b, c).reshape(num, -1) for b in blocks]  # bits[P, r * w']
    got = jax.lax.all_to_all(jnp.concatenate(sent, 1), axis, 0, 0)  # bits[P, sum]
    return _decoded_blocks(got, blocks, sent, c)


def gather_rows(blocks: list, axis: str, c: Codec = FLOAT32, to: str = "varying") -> list:
    """Every worker's blocks of rows in one ``all_gather``, encoded by ``c``, back in
    float32 (``to="invarying"`` types the result replicated, for ``check_vma``).

    Per worker (P=2): before w0 ``[a]``, w1 ``[b]``; after both ``[[a], [b]]``.

    Args:
      blocks: per block float[r, w].
      axis: the mesh axis.
      c: the codec.
      to: ``all_gather``'s ``to``.

    Returns:
      per block float32[P, r, w]: worker j's block at j.
    """
    sent = [encode(b, c).reshape(-1) for b in blocks]  # bits[r * w']
    every = jax.lax.all_gather(jnp.concatenate(sent), axis, to=to)  # bits[P, sum]
    return _decoded_blocks(every, blocks, sent, c)


def _decoded_blocks(got, blocks: list, sent: list, c: Codec) -> list:
    """``got``, bits[P, sum] of the encoded blocks ``sent`` side by side (as one
    collective delivered them), split back into its blocks of rows and decoded: per
    block float32[P, r, w], r the rows of ``blocks``' block."""
    ends = np.cumsum([0, *(s.shape[-1] for s in sent)])
    return [
        decode(got[:, a:e].reshape(got.shape[0], b.shape[-2], -1), c)
        for b, a, e in zip(blocks, ends[:-1], ends[1:], strict=True)
    ]


def psum(x, axis: str, c: Codec = FLOAT32, scatter: bool = False):
    """``psum`` of ``x``. In a narrow codec (or with ``scatter``) it is an all-to-all
    (each worker gets every worker's copy of one 1/P slice), a float32 sum, and an
    all-gather of the sums: the bytes of a ring all-reduce in the codec, summed in
    float32, in two collectives of one operand each.

    Per worker (P=2): before w0 ``[1, 2]``, w1 ``[3, 4]``; after both ``[4, 6]``.
    """
    if not c.narrow and not scatter:
        return jax.lax.psum(x, axis)
    mine = _my_slice_summed(x, axis, c)  # float[d'/P]
    return gather_carrying(mine, jnp.zeros(0, F32), axis, c)[0][: x.size].reshape(x.shape)


def padded(size: int, workers: int, c: Codec) -> int:
    """The length a flat buffer of ``size`` entries is padded to before ``psum``'s
    all-to-all: P slices, each of whole blocks (``block``).

    Example:
        >>> padded(80, 8, E4M3), padded(1000, 4, E4M3), padded(1000, 4, FLOAT32)
        (80, 1024, 1000)
    """
    share = fusion.padded_size(size, workers) // workers
    if c.scaled and share > BLOCK:
        share = fusion.padded_size(share, BLOCK)
    return workers * share


def _my_slice_summed(x, axis: str, c: Codec):
    """``x`` flattened and padded (``padded``); this worker's 1/P slice summed over the
    workers (an all-to-all in the codec, the sum in float32): float[d'/P]."""
    num, flat = jax.lax.axis_size(axis), x.reshape(-1)  # x: float[d]
    size = padded(flat.shape[0], num, c)
    flat = jnp.pad(flat.astype(F32), (0, size - flat.shape[0]))
    sent = encode_flat(flat.reshape(num, -1), c)  # bits[P, m]
    got = jax.lax.all_to_all(sent, axis, 0, 0)  # bits[P, m]: every worker's copy of my slice
    return decode_flat(got, c, size // num).sum(axis=0)


def as_wire_bits(x, c: Codec):
    """float32 ``x`` as bits of the type the codec moves (float32 itself, or two uint16
    or four uint8 per value): moved by a collective, not summed, they arrive exactly."""
    x = x.astype(F32)
    if c.bits == F32:
        return x
    return jax.lax.bitcast_convert_type(x, c.bits).reshape(-1)  # bits[k * 4 / size]


def from_wire_bits(bits, c: Codec):
    """``as_wire_bits`` undone along the last axis: float32[..., k]."""
    if c.bits == F32:
        return bits
    per = np.dtype(F32).itemsize // np.dtype(c.bits).itemsize  # bits of one float32
    return jax.lax.bitcast_convert_type(bits.reshape(*bits.shape[:-1], -1, per), F32)


def psum_carrying(x, extra, axis: str, c: Codec = FLOAT32):
    """``psum(x, axis, c, scatter=True)``, and every worker's float32 ``extra``
    (a few scalars: a loss, flags) carried as raw bits at the end of each worker's
    share of the all-gather: no collective of their own, exact in any codec.

    Per worker (P=2): before w0 ``x=[1, 2], extra=[a]``, w1 ``x=[3, 4], extra=[b]``;
    after both ``([4, 6], [[a], [b]])``.

    Returns:
      ``(sum shaped like x, float32[P, k] every worker's extra in worker order)``.
    """
    mine = _my_slice_summed(x, axis, c)  # float[d'/P]
    sums, every = gather_carrying(mine, extra, axis, c)  # float[d'], float[P, k]
    return sums[: x.size].reshape(x.shape), every


def gather_carrying(x, extra, axis: str, c: Codec = FLOAT32):
    """Tiled all-gather of float[n] ``x`` in the codec (n a multiple of ``block(n, c)``;
    back in float32, typed replicated), with every worker's float32 ``extra`` as raw
    bits at the end of its share: the scalars of a step travel in a collective it makes
    anyway.

    Per worker (P=2): before w0 ``x=[1], extra=[a]``, w1 ``x=[2], extra=[b]``; after
    both ``([1, 2], [[a], [b]])``.

    Returns:
      ``(float32[P*n], float32[P, k])``.
    """
    sent = encode_flat(x, c)  # bits[m]
    share = jnp.concatenate([sent, as_wire_bits(extra, c)])  # bits[m + extra's bits]
    every = jax.lax.all_gather(share, axis, to="invarying")  # bits[P, m + ...]
    m = sent.shape[0]
    values = decode_flat(every[:, :m], c, x.shape[0]).reshape(-1)
    return values, from_wire_bits(every[:, m:], c)
