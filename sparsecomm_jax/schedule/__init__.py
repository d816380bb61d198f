"""EmbRace's 2D communication scheduling, for any layout that says how it is carried
(``embedding.layout.Pipelined``; no layout is named here).

- ``pipeline``: ``embrace_2d``, one pipelined step per program, over the layouts'
  carriers;
- ``overlap``: step t's late exchange beside step t+1's compute (two host threads on
  CPU, one program per step on an accelerator);
- ``scopes``: the name scopes of the pipelined step's phases, read in the compiled
  program.

Which positions go first is ``embedding.priority``; each carrier is its layout's
(``column.CARRIER``, ``row.CARRIER``).
"""
