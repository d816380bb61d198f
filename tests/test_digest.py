"""The checkpoint digest (``checkpoint.digest``): any change of one word of an array, or
a move of words within it, changes its digest; how the array is sharded does not."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from sparsecomm_jax import runtime
from sparsecomm_jax.checkpoint import digest

DTYPES = ["float32", "bfloat16", "float16", "int32", "uint8", "float8_e4m3fn", "bool"]


def _random(rng: np.random.Generator, dtype: str, shape=(6, 10)) -> np.ndarray:
    if dtype == "bool":
        return rng.random(shape) < 0.5
    if dtype in ("int32", "uint8"):
        return rng.integers(0, 100, shape).astype(dtype)
    return rng.normal(size=shape).astype(jnp.dtype(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_one_changed_element_changes_the_digest(dtype):
    rng = np.random.default_rng(0)
    x = _random(rng, dtype)
    record = digest.of({"x": x})
    assert record["x"][0] == str(np.dtype(x.dtype))
    for _ in range(20):
        i, j = rng.integers(0, 6), rng.integers(0, 10)
        y = x.copy()
        raw = y.view(np.uint8).reshape(-1)  # flip one random bit of element (i, j)
        raw[(i * 10 + j) * y.itemsize + rng.integers(0, y.itemsize)] ^= 1 << rng.integers(0, 8)
        assert digest.differing(record, {"x": y}) == ["x"]
    assert digest.differing(record, {"x": x.copy()}) == []


@pytest.mark.parametrize("dtype", DTYPES[:4])
def test_swapped_rows_change_the_digest(dtype):
    x = _random(np.random.default_rng(1), dtype)
    swapped = x[[1, 0, *range(2, 6)]]
    assert digest.of({"x": x})["x"] != digest.of({"x": swapped})["x"]


def test_the_digest_does_not_depend_on_the_sharding():
    """Rows over 8 devices, columns over 4, or one device: one digest (the sums wrap
    modulo 2^32 in any order)."""
    x = np.random.default_rng(2).normal(size=(16, 8)).astype(np.float32)
    mesh8, mesh4 = runtime.data_mesh(8), runtime.data_mesh(4)
    placed = [
        x,
        jax.device_put(x, NamedSharding(mesh8, PartitionSpec(mesh8.axis_names[0]))),
        jax.device_put(x, NamedSharding(mesh4, PartitionSpec(None, mesh4.axis_names[0]))),
    ]
    assert len({digest.of({"t": p})["t"][1] for p in placed}) == 1


def test_a_converted_array_and_a_missing_one():
    """An array read as another dtype than saved is not compared; one missing is named."""
    record = digest.of({"a": np.ones(3, np.float32), "b": np.ones(2, np.float32)})
    assert digest.differing(record, {"a": np.ones(3, np.float16)}) == ["b"]
