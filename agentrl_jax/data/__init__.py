"""agentrl_jax.data."""
