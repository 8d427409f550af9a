"""RL of a pretrained Qwen3 chat model on the code-repair task, through its own chat template.

``init.hf_path`` is a Hugging Face Qwen3 directory (weights, ``config.json``, ``tokenizer.json``
and the chat template): the model, the starting parameters and the tokenizer come from it, and
the environment is played through ``ChatEnv`` (the task and tool schemas in the system and user
turns, ``<tool_call>`` JSON calls, tool outputs as tool turns). A short SFT on the scripted
expert's calls teaches the tool format, then GRPO. Sized for one 8-GPU node (bf16, parameters
and optimiser state sharded over ``fsdp``):

    agentrl train experiments/qwen3_rl.py:hf_path=/data/Qwen3-1.7B
    agentrl train experiments/qwen3_rl.py:smoke=True     # a random tiny Qwen3, on a CPU
"""

from agentrl_jax.hf.experiment import chat_rl_config


def get_config(arg=None):
    return chat_rl_config("qwen3", arg)
