"""Embedding tables: how a model reads them, how they are placed, how they change.

- ``access``: ``EmbeddingOps`` (what a loss calls), ``Read`` and the recording of a
  loss's reads (device and host);
- ``tables``: which parameters are tables (``Table``);
- ``layout``: the layout protocol (plan the ids, fetch rows, send row gradients back;
  and ``Pipelined``, how ``embrace_2d`` carries a layout's tables across steps); one
  file per layout, each with its trio, its price and its pipelining: ``column``
  (EmbRace), ``row``, ``tablewise``, ``replicated``, ``dense``, ``hot`` (hot rows on
  every worker, the rest by rows);
- ``priority``: EmbRace's priorities, which positions of a gradient go first and in
  which chunks the rest follow;
- ``gradients``: the loss and the tables' gradients through their layouts;
- ``replicas``: the row gradients summed across replica groups (2-D sparse
  parallelism);
- ``update``: ``TableUpdate`` values, ``DENSE`` and ``ROWS``;
- ``row_optimizers``: the row view of any optax optimizer, ``lazy_adam``.

Adding a layout is one file defining a ``layout.Layout`` value.
"""
