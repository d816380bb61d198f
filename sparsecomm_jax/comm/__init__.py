"""Communication helpers every strategy uses.

- ``vma``: which workers a value varies over inside ``shard_map``, and typing it;
- ``wire``: collectives in a narrower wire dtype (bfloat16), summed in float32;
- ``fusion``: leaves packed into buckets, one collective each; the threshold search;
- ``hlo``: the compiled program's collectives and the bytes each worker sends;
- ``costmodel``: the alpha-beta model, calibration, the per-bucket choice.
"""
