"""The step's finite flag (``apply.finite``): right against numpy on fresh random trees,
and combined once in the compiled step, not copied into every ``where`` of the skipped
update (whose size would then grow with leaves x state leaves)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import sparsecomm_jax as sc
from sparsecomm_jax import runtime
from sparsecomm_jax.step import apply


@pytest.mark.parametrize("seed", range(6))
def test_finite_matches_numpy(seed):
    """Random trees of mixed dtypes and shapes (an empty leaf among them), some with a
    NaN or Inf planted in a floating leaf (half of the seeds plant none)."""
    rng = np.random.default_rng(seed)
    dtypes = [np.float32, jnp.bfloat16, np.float16, np.int32]
    tree = {
        f"w{i}": rng.normal(size=rng.integers(1, 6, size=2)).astype(dtypes[i % len(dtypes)])
        for i in range(7)
    }
    tree["empty"] = np.zeros((0, 3), np.float32)
    floating = [k for k in sorted(tree) if tree[k].size and tree[k].dtype != np.int32]
    for name in rng.choice(floating, size=rng.integers(1, 3), replace=False) if seed % 2 else []:
        flat = tree[name].reshape(-1)
        flat[rng.integers(flat.size)] = rng.choice([np.nan, np.inf, -np.inf])
    expected = all(np.isfinite(np.asarray(x, np.float32)).all() for x in tree.values())
    assert expected == (seed % 2 == 0)
    assert bool(jax.jit(apply.finite)(tree)) == expected
    assert bool(apply.finite({})) is True


def _compiled_step_ops(num_leaves: int) -> dict[str, int]:
    """Instruction counts of the compiled ``embrace`` step of a model with a table and
    ``num_leaves`` dense leaves, Adam (three state leaves per parameter), skip on a
    non-finite gradient (the default)."""
    params = {"embed": jnp.zeros((16, 4))}
    params |= {f"w{i}": jnp.full((4,), 0.1 * i) for i in range(num_leaves)}

    def loss(p, batch, emb):
        h = emb.lookup(p["embed"], batch["ids"]).sum(axis=1)  # [B, 4]
        for i in range(num_leaves):
            h = jnp.tanh(h * p[f"w{i}"])
        return jnp.mean(h**2)

    ts = sc.make_train_step(
        loss, optax.adam(1e-2), runtime.data_mesh(), params, "embrace", embedding_paths=[("embed",)]
    )
    n = len(jax.devices())
    batch = ts.place_batch({"ids": np.arange(2 * n * 3).reshape(2 * n, 3) % 16})
    text = ts.step.lower(ts.state, batch).compile().as_text()
    return {op: len(re.findall(rf" {op}\(", text)) for op in ("and", "parameter")}


def test_the_finite_flag_is_not_copied_into_each_update():
    small, large = _compiled_step_ops(4), _compiled_step_ops(24)
    # linear in the leaves: 6x the leaves, at most about 6x the instructions. Copied into
    # every where, 4 -> 24 leaves gave 91 -> 1,891 `and`s and 344 -> 3,211 parameters
    # (40 -> 120 and 292 -> 1,443 combined once)
    assert large["and"] <= 8 * max(small["and"], 1) + 40, (small, large)
    assert large["parameter"] <= 8 * small["parameter"], (small, large)
