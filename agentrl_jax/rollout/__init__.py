"""agentrl_jax.rollout."""
