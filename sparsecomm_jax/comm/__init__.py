"""Communication helpers every strategy uses.

- ``vma``: which workers a value varies over inside ``shard_map``, and typing it;
- ``order``: a value made to wait for others by a data edge (``waits_for``);
- ``wire``: collectives in bfloat16 or FP8 (a float32 scale a row), each exchange's
  codec chosen apart, summed in float32;
- ``fusion``: leaves packed into buckets, one collective each; the threshold search;
- ``hlo``: the compiled program's collectives and the bytes each worker sends;
- ``costmodel``: the alpha-beta link model, calibration, the dense costs.
"""
