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
        if dtype == "bool":  # a bool is its value, whatever other bits its byte holds
            y[i, j] = not y[i, j]
        else:  # flip one random bit of element (i, j)
            raw = y.view(np.uint8).reshape(-1)
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


def test_blocks_on_a_two_axis_mesh_sum_to_the_whole_arrays_digest():
    """Each device sums its own block, placed by its mesh coordinates: a 3-D array split
    along its middle axis over both axes of a 2 x 4 mesh, or along one axis and
    replicated over the other, or replicated whole, digests as the numpy array does."""
    x = np.random.default_rng(4).normal(size=(4, 16, 6)).astype(np.float32)
    mesh = jax.make_mesh((2, 4), ("r", "d"), devices=jax.devices()[:8])
    want = digest.of({"t": x})["t"]
    specs = [
        PartitionSpec(None, ("r", "d")),
        PartitionSpec(None, "d"),
        PartitionSpec("r", "d"),
        PartitionSpec(None, None, "r"),
        PartitionSpec(),
    ]
    for spec in specs:
        placed = jax.device_put(x, NamedSharding(mesh, spec))
        assert digest.of({"t": placed})["t"] == want, spec


def test_a_tree_of_arrays_placed_every_way_digests_as_numpy():
    """One tree: numpy, an array JAX placed itself, one committed to device 3, one
    replicated over 8 devices, one split over them: each as its numpy copy."""
    rng = np.random.default_rng(5)
    host = {k: rng.normal(size=(8, 4)).astype(np.float32) for k in "abcde"}
    mesh = runtime.data_mesh(8)
    tree = {
        "a": host["a"],
        "b": jnp.asarray(host["b"]),
        "c": jax.device_put(host["c"], jax.devices()[3]),
        "d": jax.device_put(host["d"], NamedSharding(mesh, PartitionSpec())),
        "e": jax.device_put(host["e"], NamedSharding(mesh, PartitionSpec(mesh.axis_names[0]))),
    }
    assert digest.of(tree) == digest.of(host)


def test_changes_that_cancel_in_a_linear_sum_are_caught():
    """Two sign bits flipped add 2^32 to any sum of odd weights: the mixed sum sees them
    (``[1, 2]`` against ``[-1, -2]``, and the two swapped)."""
    for a, b in (([1.0, 2.0], [-1.0, -2.0]), ([1.0, -1.0], [-1.0, 1.0])):
        x, y = np.float32(a), np.float32(b)
        assert digest.of({"w": x}) != digest.of({"w": y})
        assert digest.of({"w": jnp.asarray(x)}) != digest.of({"w": jnp.asarray(y)})


def test_host_leaves_keys_and_numbers_are_summed_whole():
    """A float64 numpy leaf is summed on the host to its last bit (not narrowed to
    float32 on a device); Python numbers and PRNG keys are digested (they made a save
    fail)."""
    assert digest.of({"x": np.array([1.0])}) != digest.of({"x": np.array([1 + 2**-40])})
    record = digest.of({"step": 3, "lr": 0.5, "rng": jax.random.key(0)})
    assert record["step"][0] == "int64" and record["rng"][0].startswith("key")
    assert digest.of({"rng": jax.random.key(1)}) != {"rng": record["rng"]}
