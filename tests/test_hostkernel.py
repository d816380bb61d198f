"""The CPU top-k kernel at its edges: built only into a private cache and loaded only when
its digest is the one recorded at the build (a planted, truncated or damaged library is
rebuilt, never loaded); k and indices outside a row never reach memory they should not
(the kernel under AddressSanitizer and UBSan, and against numpy on random inputs); 16-bit
gradients select like float32 ones."""

import ctypes
import os
import shutil
import subprocess
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sparsecomm_jax.topk import hostkernel, selectors

COMPILER = shutil.which("c++") or shutil.which("g++")
needs_compiler = pytest.mark.skipif(COMPILER is None, reason="no C++ compiler on this machine")
HERE = Path(__file__).resolve().parent


@pytest.mark.processes
@needs_compiler
def test_kernel_under_address_and_undefined_behaviour_sanitizers(tmp_path):
    """Edge cases (k of 1 and of the whole row, rows of 1 entry, zeros, ties, parts of no
    entries, indices outside the row, a k no row can give) under the sanitizers: no
    report, and every selection as a sort gives it."""
    driver = tmp_path / "driver"
    flags = ["-O1", "-g", "-std=c++17", "-fsanitize=address,undefined"]
    flags += ["-fno-sanitize-recover=all", "-fno-omit-frame-pointer"]
    sources = [str(HERE / "kernel_driver.cc"), str(hostkernel.SOURCE)]
    subprocess.run([COMPILER, *flags, *sources, "-o", str(driver)], check=True)
    done = subprocess.run([str(driver)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def _planted(path: Path, marker: Path) -> None:
    """A library whose constructor would leave ``marker``: what an attacker plants."""
    source = path.with_suffix(".c")
    source.write_text(
        "#include <stdio.h>\n__attribute__((constructor)) static void f(void) {"
        f' FILE* m = fopen("{marker}", "w"); if (m) fclose(m); }}\n'
    )
    subprocess.run([COMPILER, "-shared", "-fPIC", str(source), "-o", str(path)], check=True)


def _selects(lib: ctypes.CDLL) -> list[int]:
    x = np.array([0.5, -3.0, 2.0, 0.1], np.float32)
    vals, idx = np.zeros(2, np.float32), np.zeros(2, np.int32)
    lib.sparsecomm_topk(x.ctypes.data, 1, 4, 2, vals.ctypes.data, idx.ctypes.data, None)
    return idx.tolist()


@needs_compiler
def test_planted_or_damaged_library_is_rebuilt_never_loaded(tmp_path, monkeypatch):
    """The library's name in the cache is predictable: a file planted there (or the
    real one truncated, or changed) does not carry the digest recorded at the build, so
    it is compiled anew; its constructor never runs."""
    monkeypatch.setenv("SPARSECOMM_KERNEL_DIR", str(tmp_path / "cache"))
    hostkernel.private_dir(tmp_path / "cache")
    lib, marker = hostkernel.library_path(), tmp_path / "ran"
    _planted(lib, marker)
    assert not hostkernel.intact(lib)
    assert hostkernel.build() == lib and hostkernel.intact(lib)
    assert _selects(hostkernel.load(lib)) == [1, 2] and not marker.exists()
    with open(lib, "r+b") as f:  # truncated: a load would end in SIGBUS
        f.truncate(os.path.getsize(lib) // 2)
    assert not hostkernel.intact(lib)
    assert hostkernel.build() == lib and hostkernel.intact(lib)
    lib.with_suffix(".sha256").write_text("0" * 64)  # a record that does not match
    assert not hostkernel.intact(lib)
    os.chmod(lib, 0o777)  # a library others may write is not trusted either
    hostkernel.build()
    assert hostkernel.intact(lib) and os.stat(lib).st_mode & 0o777 == 0o700


def test_a_cache_folder_others_can_write_is_refused_and_the_fallback_announced(
    tmp_path, monkeypatch
):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    monkeypatch.setenv("SPARSECOMM_KERNEL_DIR", str(shared))
    with pytest.raises(hostkernel.KernelCacheError, match="is not private"):
        hostkernel.private_dir(shared)
    with pytest.warns(UserWarning, match="the CPU top-k kernel is not used.*not private"):
        assert hostkernel._library.__wrapped__() is None
    assert not list(shared.iterdir())  # nothing built or loaded there


@pytest.mark.parametrize("k", [0, -1, 11, 2**40])
def test_k_outside_the_row_is_an_error_before_the_kernel(k):
    x = jnp.arange(10, dtype=jnp.float32)
    with pytest.raises(ValueError, match=r"k must be an integer in \[1, 10\]"):
        hostkernel.topk(x, k)
    with pytest.raises(ValueError, match=r"k must be an integer in \[1, 10\]"):
        selectors.select(selectors.AUTO, x, k)
    with pytest.raises(ValueError, match=r"k must be an integer in \[1, 5\]"):
        hostkernel.topk_parts([x[:3], x[3:]], k, rows=2)
    with pytest.raises(ValueError, match="rows=3 must cut the 10 entries"):
        hostkernel.topk_parts([x], 1, rows=3)


_TOPK = {}


def _topk(n, k):
    if (n, k) not in _TOPK:
        _TOPK[n, k] = jax.jit(lambda v: hostkernel.topk(v, k, True))
    return _TOPK[n, k]


@settings(max_examples=25, deadline=None)
@given(
    n=st.sampled_from([1, 5, 64, 300]),
    frac=st.floats(0.0, 1.0),
    zeros=st.floats(0.0, 0.9),
    seed=st.integers(0, 2**31 - 1),
)
def test_kernel_topk_against_numpy(n, frac, zeros, seed):
    """The k largest magnitudes, ties to the lower index, in index order; the residual
    is the input with them zeroed."""
    rng = np.random.default_rng(seed)
    x = np.round(rng.normal(size=n) * 2).astype(np.float32)  # ties
    x[rng.random(n) < zeros] = 0.0
    k = max(1, min(n, int(round(frac * n))))
    values, idx, rest = (np.asarray(a) for a in _topk(n, k)(jnp.asarray(x)))
    want = np.sort(np.argsort(-np.abs(x), kind="stable")[:k])
    np.testing.assert_array_equal(idx, want)
    np.testing.assert_array_equal(values, x[want])
    kept = x.copy()
    kept[want] = 0.0
    np.testing.assert_array_equal(rest, kept)


_ADD = jax.jit(lambda v, i, a, b: hostkernel.add_parts([a, b], v, i))


@settings(max_examples=25, deadline=None)
@given(
    idx=st.lists(
        st.integers(-30, 30) | st.sampled_from([2**31 - 1, -(2**31)]), min_size=6, max_size=6
    ),
    seed=st.integers(0, 2**31 - 1),
)
def test_kernel_add_parts_drops_or_wraps_like_jax(idx, seed):
    """Indices outside the row (past its end, far past it, negative) as ``jnp``'s
    scatter-add treats them: counted from the end when negative, else dropped."""
    rng = np.random.default_rng(seed)
    a, b = rng.normal(size=9).astype(np.float32), rng.normal(size=4).astype(np.float32)
    values = rng.normal(size=6).astype(np.float32)
    indices = np.asarray(idx, np.int32)
    got = np.concatenate([np.asarray(p) for p in _ADD(values, indices, a, b)])
    want = np.asarray(jnp.concatenate([a, b]).at[indices].add(values))
    np.testing.assert_allclose(got, want, rtol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("name", ["auto", "exact", "radix", "threshold"])
def test_sixteen_bit_gradients_select_like_float32(dtype, name):
    """Every selector takes bfloat16 and float16 vectors: the entries of the same vector
    in float32 (the magnitude order survives the widening)."""
    x = jnp.asarray(np.random.default_rng(3).normal(size=512), dtype)
    selector = selectors.get(name)
    values, idx = selectors.select(selector, x, 20)
    ref_values, ref_idx = selectors.select(selector, x.astype(jnp.float32), 20)
    assert values.dtype == dtype
    assert sorted(np.asarray(idx).tolist()) == sorted(np.asarray(ref_idx).tolist())
    _, _, rest = selectors.select_with_residual(selector, x, 20)
    assert rest.dtype == dtype and int(jnp.sum(rest == 0)) >= 20
