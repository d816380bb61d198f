"""What every train step shares.

- ``state``: ``TrainState``, ``StepContext``, ``TrainStep``;
- ``placement``: partition specs, batch checks, ``PlacedBatch``, capacities per batch;
- ``finish``: ``Gradients`` (what a body hands on) and the optimizer on global arrays;
- ``form``: how the state is stored, and the conversions that reshard a checkpoint.
"""
