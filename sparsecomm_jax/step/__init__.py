"""What every train step shares.

- ``state``: ``TrainState``, ``StepContext``, ``TrainStep``;
- ``batch_checks``: a host batch checked (keys, shapes, every id in its table);
- ``capacities``: the slots of a step's static buffers, sized from each batch;
- ``batches``: ``PlacedBatch``, its specs, the placers of one step's and several
  steps' batches;
- ``placed_state``: each parameter's and state's partition spec, the state placed;
- ``host``: a step's results read back on the host (``loss_value``, ...);
- ``apply``: ``Gradients`` (what a body hands on) and the optimizer on global arrays;
- ``stored_form``: how the state is stored, and the conversions that reshard a checkpoint.
"""
