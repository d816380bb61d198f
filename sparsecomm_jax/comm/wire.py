"""The dtype on the wire: collectives that send float32 or bfloat16 and sum in float32.

An exchange of rows (embedding lookups, their gradients) or of the dense layers'
gradients can travel in a narrower dtype: ``bfloat16`` halves the bytes. Values are cast
to the wire dtype just before the collective and back to float32 on arrival, and every
sum is taken in float32 at the receiver. A bfloat16 payload travels as its uint16 bits,
so no backend widens the collective back to float32.

Example:
    >>> import jax.numpy as jnp
    >>> from sparsecomm_jax.comm import wire
    >>> wire.wire_dtype("bfloat16") == jnp.bfloat16
    True

References:
    Mudigere et al., "High-performance, Distributed Training of Large-scale DLRMs", 2021
    (quantized embedding communication).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sparsecomm_jax.comm import fusion

F32 = jnp.float32
WIRE_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def wire_dtype(name: str):
    """The dtype called ``name`` in ``WIRE_DTYPES``; one-line ``ValueError`` otherwise."""
    if name not in WIRE_DTYPES:
        raise ValueError(f"unknown comm_dtype {name!r}; choose one of {sorted(WIRE_DTYPES)}")
    return WIRE_DTYPES[name]


def send(x, wire):
    """``x`` as it travels: float32, or the ``wire`` bits as uint16 (data movement only)."""
    if wire == F32:
        return x.astype(F32)
    return jax.lax.bitcast_convert_type(x.astype(wire), jnp.uint16)


def receive(x, wire):
    """What ``send`` sent, back in float32."""
    return x if wire == F32 else jax.lax.bitcast_convert_type(x, wire).astype(F32)


def a2a(x, axis: str, wire=F32):
    """``all_to_all`` over the leading axis in ``wire``, back in float32.

    Per worker (P=2): before w0 ``[a0, a1]``, w1 ``[b0, b1]``; after w0 ``[a0, b0]``,
    w1 ``[a1, b1]`` (block j of every worker goes to worker j).
    """
    return receive(jax.lax.all_to_all(send(x, wire), axis, 0, 0), wire)


def gather(x, axis: str, wire=F32, dim: int = 0, to: str = "varying"):
    """Tiled ``all_gather`` along ``dim`` in ``wire``, back in float32 (``to``:
    ``"invarying"`` types the result replicated, for ``check_vma``).

    Per worker (P=2, dim 0): before w0 ``[a]``, w1 ``[b]``; after both ``[a, b]``.
    """
    gathered = jax.lax.all_gather(send(x, wire), axis, axis=dim, tiled=True, to=to)
    return receive(gathered, wire)


def psum(x, axis: str, wire=F32, scatter: bool = False):
    """``psum`` of ``x``. In a narrow ``wire`` (or with ``scatter``) it is an all-to-all
    (each worker gets every worker's copy of one 1/P slice), a float32 sum, and an
    all-gather of the sums: the bytes of a ring all-reduce in ``wire``, summed in
    float32, in two collectives of one operand each.

    Per worker (P=2): before w0 ``[1, 2]``, w1 ``[3, 4]``; after both ``[4, 6]``.
    """
    if wire == F32 and not scatter:
        return jax.lax.psum(x, axis)
    mine = _my_slice_summed(x, axis, wire)  # float[d/P]
    return gather(mine, axis, wire, to="invarying")[: x.size].reshape(x.shape)


def _my_slice_summed(x, axis: str, wire):
    """``x`` flattened and padded to a multiple of P; this worker's 1/P slice summed
    over the workers (an all-to-all in ``wire``, the sum in float32): float[d/P]."""
    num, flat = jax.lax.axis_size(axis), x.reshape(-1)  # x: float[d]
    flat = jnp.pad(flat, (0, fusion.padded_size(flat.shape[0], num) - flat.shape[0]))
    return a2a(flat.reshape(num, -1), axis, wire).sum(axis=0)


def as_wire_bits(x, wire):
    """float32 ``x`` as bits in the type ``send`` puts on the wire (float32 itself, or
    two uint16 per value): moved by a collective, not summed, they arrive exactly."""
    x = x.astype(F32)
    if wire == F32:
        return x
    return jax.lax.bitcast_convert_type(x, jnp.uint16).reshape(-1)  # uint16[2k]


def from_wire_bits(bits, wire):
    """``as_wire_bits`` undone along the last axis: float32[..., k]."""
    if wire == F32:
        return bits
    pairs = bits.reshape(*bits.shape[:-1], -1, 2)
    return jax.lax.bitcast_convert_type(pairs, F32)


def psum_carrying(x, extra, axis: str, wire=F32):
    """``psum(x, axis, wire, scatter=True)``, and every worker's float32 ``extra``
    (a few scalars: a loss, flags) carried as raw bits at the end of each worker's
    share of the all-gather: no collective of their own, exact in any ``wire``.

    Per worker (P=2): before w0 ``x=[1, 2], extra=[a]``, w1 ``x=[3, 4], extra=[b]``;
    after both ``([4, 6], [[a], [b]])``.

    Returns:
      ``(sum shaped like x, float32[P, k] every worker's extra in worker order)``.
    """
    mine = _my_slice_summed(x, axis, wire)  # float[d/P]
    sums, every = gather_carrying(mine, extra, axis, wire)  # float[P*d/P], float[P, k]
    return sums[: x.size].reshape(x.shape), every


def gather_carrying(x, extra, axis: str, wire=F32):
    """Tiled all-gather of float[n] ``x`` in ``wire`` (back in float32, typed
    replicated), with every worker's float32 ``extra`` as raw bits at the end of its
    share: the scalars of a step travel in a collective it makes anyway.

    Per worker (P=2): before w0 ``x=[1], extra=[a]``, w1 ``x=[2], extra=[b]``; after
    both ``([1, 2], [[a], [b]])``.

    Returns:
      ``(float32[P*n], float32[P, k])``.
    """
    bits = as_wire_bits(extra, wire)  # [k] or uint16[2k]
    share = jnp.concatenate([send(x, wire), bits])  # [n + bits]
    every = jax.lax.all_gather(share, axis, to="invarying")  # [P, n + bits]
    n = x.shape[0]
    return receive(every[:, :n], wire).reshape(-1), from_wire_bits(every[:, n:], wire)
