"""agentrl_jax.train."""
