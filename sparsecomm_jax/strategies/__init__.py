"""The strategies and how a step is built.

- ``registry``: ``Strategy`` values in ``STRATEGIES``; ``parse_strategy`` and
  ``StrategyName``;
- ``bodies``: the data-parallel and table bodies and how a body becomes a step;
- ``build``: ``make_train_step`` and every rule about what may be combined;
- ``overlapped``: ``make_overlapped``, ``embrace_2d`` across steps.
"""
