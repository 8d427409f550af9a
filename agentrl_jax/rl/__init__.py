"""agentrl_jax.rl."""
