"""RL of a pretrained gpt-oss model on the code-repair task, through its own chat template.

``init.hf_path`` is a Hugging Face gpt-oss directory (weights, ``config.json``, ``tokenizer.json``
and the chat template): the model, the starting parameters and the tokenizer come from it, and
the environment is played through ``ChatEnv`` (the task and tool schemas in the system and user
turns, harmony tool calls on the commentary channel, tool outputs as tool turns). gpt-oss is the
released family closest to the guide's architecture: alternating sliding-window and full
attention (with learned sinks) and MoE. A short SFT on the scripted expert's calls teaches the
tool format, then GRPO. Sized for one 8-GPU node (bf16, parameters and optimiser state sharded
over ``fsdp``; released MXFP4 expert weights are dequantised on load):

    agentrl train experiments/gpt_oss_rl.py:hf_path=/data/gpt-oss-20b
    agentrl train experiments/gpt_oss_rl.py:smoke=True   # a random tiny gpt-oss, on a CPU
"""

from agentrl_jax.hf.experiment import chat_rl_config


def get_config(arg=None):
    return chat_rl_config("gpt_oss", arg)
