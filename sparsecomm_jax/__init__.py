"""sparsecomm_jax: sparse communication for data-parallel training in JAX.

Modules: ``runtime`` (meshes, simulated devices, multi-process), ``launch`` (the
multi-process launcher), ``hlo`` (collectives and bytes of a compiled program),
``train`` (``make_train_step`` for every strategy).
"""

__version__ = "0.1.0"
