"""The name scopes of EmbRace's pipelined step (``schedule.pipeline``, ``schedule.overlap``).

Each phase of the step runs inside ``jax.named_scope(SCOPE_...)``, so the compiled
program's op metadata says which phase an operation (a collective above all) belongs
to: the tests and ``experiments.gpu_schedule`` read the schedule by them.

Example:
    >>> SCOPE_HIGH, SCOPE_LOW
    ('embrace2d_high', 'embrace2d_low')
"""

SCOPE_HIGH = "embrace2d_high"  # every carried table's first chunk
SCOPE_LOW = "embrace2d_low"  # the late chunks, after every first chunk
SCOPE_NEXT = "embrace2d_next_lookup"  # batch t+1's rows, read with the early update
SCOPE_REFETCH = "embrace2d_refetch"  # rows fetched again where the carried were stale (rare)
SCOPE_DENSE = "embrace2d_dense"  # the dense layers' mean (no data edge to the tables')
SCOPE_ROWS = "embrace2d_step_rows"  # rows fetched in the step, before its forward pass
