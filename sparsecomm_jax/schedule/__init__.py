"""EmbRace's 2D communication scheduling.

- ``priority``: which positions go first (next-use levels, chunk sizes) and the plan of
  the first chunk;
- ``chunks``: one chunk of a column-wise table's gradient exchange (an all-to-all);
- ``rowwise``: a row-wise table's gradient in two chunks and its next rows, carried;
- ``pipeline``: ``embrace_2d``, one pipelined step per program;
- ``overlap``: step t's late exchange beside step t+1's compute (two host threads on
  CPU, one program per step on an accelerator).
"""
