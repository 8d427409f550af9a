"""agentrl_jax.envs.coderepair."""
