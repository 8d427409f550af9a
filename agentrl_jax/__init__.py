"""agentrl_jax: agentic RL of LLMs on long, multi-turn, tool-calling trajectories."""

__version__ = "0.1.0"
