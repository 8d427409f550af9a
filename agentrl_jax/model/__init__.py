"""agentrl_jax.model."""
