"""Host kernel for CPU: exact top-k in a few passes over the vector.

XLA:CPU has no fast selection (``lax.top_k`` sorts; ``jnp.nonzero(size=)`` alone costs
tens of passes), so on CPU the selectors call ``topk_kernel.cc``, compiled once with the
system C++ compiler into a cache directory (``$SPARSECOMM_KERNEL_DIR``, default
``~/.cache/sparsecomm_jax``) and run through ``buffer_callback``, which hands the kernel
the XLA buffers without a copy. ``topk`` selects per row, ``topk_parts`` on a bucket's
leaves read as one vector (each residual written over its leaf), ``merge`` is gTop-k's
merge of two k-lists and ``add_parts`` adds (value, index) pairs into leaves in place.
``available()`` is False when no compiler is found; the selectors then use their
``lax`` formulation.

Example:
    >>> import jax.numpy as jnp
    >>> from sparsecomm_jax.topk import hostkernel
    >>> vals, idx, _ = hostkernel.topk(jnp.array([0.1, -3.0, 2.0, 0.5]), 2)
    >>> idx.tolist(), vals.tolist()
    ([1, 2], [-3.0, 2.0])

References:
    Lin et al., "Deep Gradient Compression", ICLR 2018 (sampled threshold).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import math
import os
import shutil
import stat
import subprocess
import tempfile
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.buffer_callback import buffer_callback

from sparsecomm_jax.comm.vma import varying_like

SOURCE = Path(__file__).with_name("topk_kernel.cc")
FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC")  # portable: the cache may be shared


class KernelCacheError(RuntimeError):
    """The kernel's cache folder cannot be trusted (another owner, writable by others)."""


def cache_dir() -> Path:
    """``$SPARSECOMM_KERNEL_DIR``, else ``~/.cache/sparsecomm_jax``."""
    default = Path.home() / ".cache" / "sparsecomm_jax"
    return Path(os.environ.get("SPARSECOMM_KERNEL_DIR", default))


def private_dir(path: Path) -> Path:
    """``path``, created 0700 if missing; ``KernelCacheError`` unless it is a folder
    (not a link) owned by this user that no one else can write."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise KernelCacheError(f"{path} is not a folder (a link?): give a private folder")
    if st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise KernelCacheError(
            f"{path} is not private (owner uid {st.st_uid}, mode {stat.filemode(st.st_mode)}): "
            "a library there could be replaced by another user; set SPARSECOMM_KERNEL_DIR to "
            "a folder of your own (chmod 700)"
        )
    return path


def _compiler(compiler: str | None) -> str:
    cxx = compiler or os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not cxx:
        raise RuntimeError("no C++ compiler found for the host kernels; set CXX")
    return cxx


def library_path(compiler: str | None = None, source: Path = SOURCE) -> Path:
    """Where the kernel built from ``source`` (default the top-k kernel's) with
    ``compiler`` lives in the cache (a name from the source's and the flags' digest)."""
    cxx = _compiler(compiler)
    digest = hashlib.sha256(source.read_bytes() + " ".join((cxx, *FLAGS)).encode())
    return cache_dir() / f"{source.stem}-{digest.hexdigest()[:16]}.so"


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def intact(lib: Path) -> bool:
    """Whether ``lib`` is the library this user built: a regular file (not a link) owned
    by this user, writable by no one else, whose content has the digest recorded beside
    it when it was built (a truncated, damaged or planted file has not)."""
    record = lib.with_suffix(".sha256")
    try:
        st, rst = os.lstat(lib), os.lstat(record)
    except FileNotFoundError:
        return False
    for s in (st, rst):
        if not stat.S_ISREG(s.st_mode) or s.st_uid != os.getuid() or s.st_mode & 0o022:
            return False
    return record.read_text().strip() == _digest(lib)


def build(compiler: str | None = None, source: Path = SOURCE) -> Path:
    """The library of the kernel ``source`` (default the top-k kernel's) in the private
    cache: the one built before when it is intact (``intact``), else compiled now (a
    damaged or foreign file is replaced).

    Raises:
      RuntimeError: no C++ compiler on PATH (set ``CXX``) or the compilation failed.
      KernelCacheError: the cache folder is not private.
    """
    cxx = _compiler(compiler)
    lib = library_path(cxx, source)
    private_dir(lib.parent)
    if intact(lib):
        return lib
    with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:  # atomic: build, then rename
        out = Path(tmp) / lib.name
        done = subprocess.run([cxx, *FLAGS, str(source), "-o", str(out)], capture_output=True)
        if done.returncode:
            raise RuntimeError(
                f"building the host kernel {source.name} failed: {done.stderr[-500:]!r}"
            )
        out.chmod(0o700)
        record = Path(tmp) / "digest"
        record.write_text(_digest(out))
        os.replace(out, lib)
        os.replace(record, lib.with_suffix(".sha256"))
    return lib


def load(path: Path) -> ctypes.CDLL:
    """The kernel library at ``path`` with its functions' argument types."""
    lib = ctypes.CDLL(str(path))
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.sparsecomm_topk.argtypes = [ptr, i64, i64, i64, ptr, ptr, ptr]
    lib.sparsecomm_topk_parts.argtypes = [ptr, ptr, i64, i64, i64, ptr, ptr, ptr]
    lib.sparsecomm_add_parts.argtypes = [ptr, ptr, i64, ptr, ptr, i64]
    lib.sparsecomm_merge.argtypes = [ptr, ptr, ptr, ptr, i64, i64, i64, ptr, ptr, ptr, ptr]
    return lib


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The loaded kernel, or ``None`` (announced once) when it cannot be had."""
    try:
        return load(build())
    except (RuntimeError, OSError) as e:
        warnings.warn(
            f"the CPU top-k kernel is not used ({' '.join(str(e).split())}); top-k selection "
            "runs lax.top_k or the radix select instead, the same entries, slower on CPU",
            stacklevel=3,
        )
        return None


def available() -> bool:
    """Whether the host kernel could be built and loaded on this machine."""
    return _library() is not None


def dispatch(args, kernel, other, elsewhere=None, usable: bool = True):
    """The one switch between the kernel and its ``lax`` formulation.

    ``kernel(*args)`` on CPU when ``usable`` (the caller's dtype rule) and the kernel is
    built; ``other(*args)`` where it is not. Under ``jax.jit`` the platform is chosen
    per device (``lax.platform_dependent``): on other platforms ``elsewhere(*args)``
    (default ``other``) runs.
    """
    if not (usable and available()):
        return other(*args)
    return jax.lax.platform_dependent(*args, cpu=kernel, default=elsewhere or other)


def check_k(k: int, n: int) -> None:
    """``ValueError`` unless 1 <= k <= n: checked before the kernel sees a k."""
    if not isinstance(k, int) or not 1 <= k <= n:
        raise ValueError(f"k must be an integer in [1, {n}] for {n} entries, got {k!r}")


def _ptr(buf) -> int:
    return np.asarray(buf).ctypes.data


def _topk_callback(k: int, residual: bool):
    def run(ctx, out, x):
        n = x.shape[-1]
        rows = math.prod(x.shape[:-1])
        vals, idx = out[0], out[1]
        res = _ptr(out[2]) if residual else None
        _library().sparsecomm_topk(_ptr(x), rows, n, k, _ptr(vals), _ptr(idx), res)

    return run


def topk(x, k: int, residual: bool = False):
    """Top-k by magnitude of each row of ``x`` (float32[..., n]) on the host.

    Args:
      x: float32[..., n].
      k: entries per row, 1 <= k <= n.
      residual: also return ``x`` with the taken entries zeroed.

    Returns:
      ``(values float32[..., k], indices int32[..., k], residual or None)``; indices in
      increasing order; ties in magnitude go to the lower index, as in ``lax.top_k``.
    """
    x = jnp.asarray(x, jnp.float32)
    check_k(k, x.shape[-1])
    shape = x.shape[:-1]
    outs = [jax.ShapeDtypeStruct((*shape, k), jnp.float32)]
    outs.append(jax.ShapeDtypeStruct((*shape, k), jnp.int32))
    if residual:
        outs.append(jax.ShapeDtypeStruct(x.shape, jnp.float32))
    aliases = {0: 2} if residual else None  # the residual is written over x's buffer
    call = buffer_callback(
        _topk_callback(k, residual),
        tuple(outs),
        vmap_method="broadcast_all",
        input_output_aliases=aliases,
    )
    got = [varying_like(y, x) for y in call(x)]
    return got[0], got[1], got[2] if residual else None


def _pointers(buffers) -> ctypes.Array:
    return (ctypes.c_void_p * len(buffers))(*[_ptr(b) for b in buffers])


def _lengths(sizes: tuple[int, ...]) -> ctypes.Array:
    return (ctypes.c_int64 * len(sizes))(*sizes)


def _parts_callback(k: int, sizes: tuple[int, ...], rows: int):
    def run(ctx, out, *parts):
        xs, resid, lens = _pointers(parts), _pointers(out[2:]), _lengths(sizes)  # kept alive
        _library().sparsecomm_topk_parts(
            ctypes.addressof(xs),
            ctypes.addressof(lens),
            len(sizes),
            rows,
            k,
            _ptr(out[0]),
            _ptr(out[1]),
            ctypes.addressof(resid),
        )

    return run


def topk_parts(parts, k: int, rows: int | None = None):
    """Top-k by magnitude of the concatenation of ``parts`` without concatenating them
    (or of each of ``rows`` equal rows it is cut into); each part's residual is written
    over its buffer.

    Args:
      parts: float32 vectors (the flattened leaves of a fusion bucket).
      k: entries kept (per row), 1 <= k <= the row's length.
      rows: ``None`` for one row, else the number of rows (dividing the total length).

    Returns:
      ``(values float32[k], indices int32[k], residuals)`` (``[rows, k]`` with rows):
      indices into the concatenation (into the row), in increasing order, ties to the
      lower index as in ``lax.top_k``; ``residuals`` one per part, the part with the
      taken entries zeroed.
    """
    parts = [jnp.asarray(p, jnp.float32).reshape(-1) for p in parts]
    total = sum(p.shape[0] for p in parts)
    if rows is not None and (rows < 1 or total % rows):
        raise ValueError(f"rows={rows} must cut the {total} entries into equal rows")
    check_k(k, total // (rows or 1))
    shape = (k,) if rows is None else (rows, k)
    outs = [jax.ShapeDtypeStruct(shape, jnp.float32), jax.ShapeDtypeStruct(shape, jnp.int32)]
    outs += [jax.ShapeDtypeStruct(p.shape, jnp.float32) for p in parts]
    sizes = tuple(p.shape[0] for p in parts)
    aliases = {i: 2 + i for i in range(len(parts))}
    run = _parts_callback(k, sizes, rows or 1)
    call = buffer_callback(run, tuple(outs), input_output_aliases=aliases)
    got = [varying_like(y, parts[0]) for y in call(*parts)]
    return got[0], got[1], got[2:]


def _add_callback(sizes: tuple[int, ...]):
    def run(ctx, out, values, indices, *parts):
        dest, lens = _pointers(out), _lengths(sizes)  # kept alive during the call
        _library().sparsecomm_add_parts(
            ctypes.addressof(dest),
            ctypes.addressof(lens),
            len(sizes),
            _ptr(values),
            _ptr(indices),
            values.shape[0],
        )

    return run


def add_parts(parts, values, indices):
    """``parts`` (float32 vectors read as one) with ``values`` added at ``indices`` (into
    the concatenation; repeated ones add up), written over the parts' buffers. As
    ``jnp``'s scatter-add: a negative index counts from the end, one outside the
    concatenation is dropped.

    Returns:
      The updated parts, one array per part.
    """
    sizes = tuple(p.shape[0] for p in parts)
    outs = tuple(jax.ShapeDtypeStruct(p.shape, jnp.float32) for p in parts)
    aliases = {2 + i: i for i in range(len(parts))}
    call = buffer_callback(_add_callback(sizes), outs, input_output_aliases=aliases)
    return [varying_like(y, parts[0]) for y in call(values, indices.astype(jnp.int32), *parts)]


def _merge_callback(k: int):
    def run(ctx, out, values_a, indices_a, values_b, indices_b):
        n = values_a.shape[-1]
        rows = math.prod(values_a.shape[:-1])
        ins = [_ptr(b) for b in (values_a, indices_a, values_b, indices_b)]
        _library().sparsecomm_merge(*ins, rows, n, k, *[_ptr(b) for b in out])

    return run


def merge(
    values_a: jax.Array, indices_a: jax.Array, values_b: jax.Array, indices_b: jax.Array, k: int
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Top-k of the sum of two sparse vectors (n entries each, any order, repeated
    indices summed) on the host, and the rest of the sum.

    Args:
      values_a: float32[..., n]; indices_a: int32[..., n]; the same for b.
      k: entries kept, 1 <= k.

    Returns:
      ``(values [..., k], indices [..., k], dropped_values [..., 2n], dropped_indices
      [..., 2n])``, each list in index order: the k entries of a + b of largest
      magnitude (ties to the lower index, as in ``lax.top_k``) and the other entries;
      unused slots are padding (value 0 at index 0).
    """
    shape, n = values_a.shape[:-1], values_a.shape[-1]
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be an integer >= 1, got {k!r}")
    outs = [
        jax.ShapeDtypeStruct((*shape, m), t) for m in (k, 2 * n) for t in (jnp.float32, jnp.int32)
    ]
    call = buffer_callback(_merge_callback(k), tuple(outs), vmap_method="broadcast_all")
    args = (values_a, indices_a, values_b, indices_b)
    return tuple(varying_like(y, values_a) for y in call(*args))
