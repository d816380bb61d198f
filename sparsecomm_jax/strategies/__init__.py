"""The strategies and how a step is built.

- ``registry``: ``Strategy`` values in ``STRATEGIES``; ``parse_strategy`` and
  ``StrategyName``;
- ``bodies``: the data-parallel and table bodies and how a body becomes a step;
- ``rules``: every rule about what may be combined, checked before anything is traced;
- ``engines``: ``jax.jit`` of a ``shard_map`` step, or ``jax.pmap``, as a ``TrainStep``;
- ``feeding``: batches placed on a host thread, and a run's program calls;
- ``build``: ``make_train_step``, the entry point over all of them;
- ``overlapped``: ``make_overlapped``, ``embrace_2d`` across steps.
"""
