"""agentrl_jax.envs."""
