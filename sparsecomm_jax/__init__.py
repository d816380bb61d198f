"""sparsecomm_jax: sparse communication for data-parallel training in JAX.

The front door: ``make_train_step`` builds any strategy's step (``strategy_names()``
lists them; ``"embrace"``, ``"topk_a2a"``, ``"embrace+topk_a2a"``, ...), and the pieces a
hand-written ``shard_map`` step uses: the aggregators (``topk_a2a(0.01)``,
``per_worker``, ``vary``), the row-sparse table update (``ROWS``, ``lazy_adam``), flax
layers whose tables a strategy can shard (``nn.Embed``), a plan of table layouts
(``TablePlan``, ``planner``), checkpoints (``checkpoint``), the devices
(``runtime``) and a job of several processes (``distributed``). The concepts live in
subpackages: ``comm``, ``topk``, ``embedding``, ``step``, ``schedule``, ``strategies``,
``planner``; the tools beside them: ``runtime``, ``distributed``, ``launch``,
``checkpoint``.

Example:
    >>> import jax, jax.numpy as jnp, optax
    >>> import sparsecomm_jax as sc
    >>> loss = lambda p, b, emb: jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2)
    >>> ts = sc.make_train_step(loss, optax.sgd(0.1), sc.runtime.data_mesh(),
    ...                         {"w": jnp.zeros((3, 1))}, "dense")
"""

import importlib

__version__ = "0.3.0"

# The public API, name -> the module that defines it. Loaded on first use (PEP 562), so
# that ``python -m sparsecomm_jax.launch`` starts without importing JAX.
_EXPORTS = {
    "aggregators": "sparsecomm_jax.aggregators",
    "checkpoint": "sparsecomm_jax.checkpoint",
    "distributed": "sparsecomm_jax.distributed",
    "layouts": "sparsecomm_jax.embedding.layout_registry",
    "nn": "sparsecomm_jax.nn",
    "optimizers": "sparsecomm_jax.optimizers",
    "planner": "sparsecomm_jax.planner",
    "runtime": "sparsecomm_jax.runtime",
    "row_optimizers": "sparsecomm_jax.embedding.row_optimizers",
    "ArgumentError": "sparsecomm_jax.errors",
    "TablePlan": "sparsecomm_jax.embedding.layout_registry",
    **dict.fromkeys(
        (
            "AGGREGATORS",
            "Aggregator",
            "adaptive",
            "dense_allreduce",
            "error_feedback",
            "flat_allreduce",
            "gtopk",
            "oktopk",
            "per_worker",
            "state_spec",
            "topk_a2a",
            "topk_allgather",
            "topk_balanced",
            "vary",
        ),
        "sparsecomm_jax.aggregators",
    ),
    **dict.fromkeys(
        ("RowGrad", "lazy_adam", "segment_rows"), "sparsecomm_jax.embedding.row_optimizers"
    ),
    **dict.fromkeys(("DENSE", "ROWS", "TableUpdate"), "sparsecomm_jax.embedding.update"),
    **dict.fromkeys(("CapacityWarning", "overflow_message"), "sparsecomm_jax.step.capacities"),
    **dict.fromkeys(("first_replica", "loss_value", "loss_values"), "sparsecomm_jax.step.host"),
    **dict.fromkeys(("TrainState", "TrainStep"), "sparsecomm_jax.step.state"),
    "make_train_step": "sparsecomm_jax.strategies.build",
    **dict.fromkeys(
        ("call_plan", "place_for_call", "place_for_step", "placed_batches", "placed_calls"),
        "sparsecomm_jax.strategies.feeding",
    ),
    "make_overlapped": "sparsecomm_jax.strategies.overlapped",
    **dict.fromkeys(
        ("STRATEGIES", "Strategy", "StrategyName", "parse_strategy", "strategy_names"),
        "sparsecomm_jax.strategies.registry",
    ),
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    """The public name ``name``, imported from its module on first use."""
    if name not in _EXPORTS:
        raise AttributeError(f"module 'sparsecomm_jax' has no attribute {name!r}")
    module = importlib.import_module(_EXPORTS[name])
    value = module if module.__name__.endswith("." + name) else getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
