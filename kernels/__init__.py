"""Attention kernels (installed as ``agentrl_jax.kernels``).

Each op has a pure-jnp ``*_reference``, a blocked XLA implementation and a Pallas kernel,
selected with ``impl='auto'|'xla'|'pallas'``.
"""
