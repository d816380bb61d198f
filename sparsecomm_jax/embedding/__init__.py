"""Embedding tables: how a model reads them, how they are placed, how they change.

- ``access``: ``EmbeddingOps`` (what a loss calls), ``Read`` and the recording of a
  loss's reads (device and host);
- ``tables``: which parameters are tables (``Table``);
- ``layout``: the layout protocol (plan the ids, fetch rows, send row gradients back);
  one file per layout: ``column`` (EmbRace), ``row``, ``tablewise``, ``replicated``,
  ``dense``, ``hot`` (hot rows on every worker, the rest by rows);
- ``gradients``: the loss and the tables' gradients through their layouts;
- ``replicas``: the row gradients summed across replica groups (2-D sparse
  parallelism);
- ``update``: ``TableUpdate`` values, ``DENSE`` and ``ROWS``;
- ``row_optimizers``: the row view of any optax optimizer, ``lazy_adam``.

Adding a layout is one file defining a ``layout.Layout`` value.
"""
