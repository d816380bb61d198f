"""Top-k sparsification: what to send of a gradient, and how it travels.

- ``selectors``: ``Selector`` values (``AUTO``, ``EXACT``, ``RADIX``, ``THRESHOLD``) in
  a registry, and the selection functions with their error-feedback residual;
- ``shards``: TopKA2A's selection split over P shards (one all-to-all destination each);
- ``collectives``: ``topk_allgather``, ``topk_a2a``, ``gtopk`` inside ``shard_map``;
- ``balanced``: hashed owners, their sums and the way back (Zen, Ok-Topk);
- ``hostkernel``: the CPU kernel behind ``AUTO`` (``topk_kernel.cc``), one dispatch;
- ``exchanges``: how a selection travels, one ``Exchange`` value each, in a registry
  (each one an aggregator of ``sparsecomm_jax.aggregators`` too);
- ``costs``: each exchange's messages and bytes, as compiled;
- ``local_cost``: the measured local work of the sparse exchanges, for the cost model.

The aggregators built from the exchanges live in ``sparsecomm_jax.aggregators``.
"""
