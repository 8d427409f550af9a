"""The experiment: the one base config, and its sections built and checked together.

Every section's defaults live with the code that owns it (a frozen dataclass); this module sits
above them all and assembles them. ``base_config()`` is what every experiment module starts
from; :func:`build` turns a config into :class:`Sections` (the frozen dataclasses the trainer,
the sampler and the evaluator take) and checks what spans sections, so a bad value anywhere
fails before a run directory, SFT or an evaluation exists.

=========  ===================================  ==========================================
section    dataclass                            owner
=========  ===================================  ==========================================
env        ``envs.registry.EnvSpec`` (by name)  the environment registry
init       ``InitConfig``                       ``hf/training.py``
model      ``ModelConfig``                      ``model/config.py``
policy     ``DTypePolicy`` (by preset name)     ``precision.py``
mesh       ``MeshConfig``                       ``sharding.py``
sft        ``SFTConfig``                        ``train/sft.py``
eval       ``EvalConfig``                       ``train/evaluate.py``
data       ``DataConfig``                       ``data/pipeline.py``
rollout    ``RolloutConfig``                   ``rollout/sampler.py``
rl         ``RLConfig`` (+ nested ``loss``)     ``rl/state.py``, ``rl/losses.py``
train      ``TrainConfig``                      ``train/loop_config.py``
=========  ===================================  ==========================================
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from agentrl_jax.config import (
    ConfigDict,
    apply_overrides,
    check_moved,
    move_keys,
    register_moved_key,
    to_dataclass,
)
from agentrl_jax.data.pipeline import DataConfig
from agentrl_jax.envs.registry import EnvSpec, get_env
from agentrl_jax.hf import training as hf_training
from agentrl_jax.hf.training import InitConfig
from agentrl_jax.kernels import OPS
from agentrl_jax.model.config import ModelConfig
from agentrl_jax.precision import DTypePolicy, get_policy
from agentrl_jax.rl.losses import LossConfig
from agentrl_jax.rl.state import RLConfig
from agentrl_jax.rollout.sampler import RolloutConfig
from agentrl_jax.sharding import MeshConfig
from agentrl_jax.train.evaluate import EvalConfig, eval_data_config
from agentrl_jax.train.loop_config import TrainConfig
from agentrl_jax.train.sft import SFTConfig

# keys that moved between sections (old -> new): setting the old one is an error naming the new
MOVED_KEYS = {
    "train.advantage": "rl.advantage",
    "train.advantage_kwargs": "rl.advantage_kwargs",
}
for _old, _new in MOVED_KEYS.items():
    register_moved_key(_old, _new)


def _section(cls) -> ConfigDict:
    return ConfigDict(dataclasses.asdict(cls()))


def base_config() -> ConfigDict:
    """The one base config holding every default of a run. Experiments modify a copy."""
    cfg = ConfigDict()
    cfg.name = "experiment"
    cfg.seed = 0
    cfg.smoke = False
    cfg.workdir = "runs"  # run directories are created under here
    cfg.env = "coderepair"  # environment registry name (agentrl_jax.envs.registry)
    # agentrl_jax.precision preset name: dtypes, and parity when it ends in '-parity'
    cfg.policy = "fp32"
    # attention kernels: 'auto' (kernels.select.TABLE: only what lowers on the backend),
    # 'xla' or 'pallas'; the policy's kernel_impl (a preset sets none)
    cfg.kernel_impl = "auto"
    # one op's implementation (kernels.select.TABLE's rows), overriding kernel_impl for it:
    # 'auto' leaves it to the table's rule; decode_matmul='xla' keeps the one-row decode's
    # weights unpacked (model.decode_params)
    cfg.kernels = ConfigDict({op: "auto" for op in OPS})
    cfg.sweep_vectorized = False  # agentrl sweep: one vmapped learner for all points
    cfg.init = _section(InitConfig)  # a pretrained Hugging Face model to start from
    cfg.model = _section(ModelConfig)
    cfg.mesh = _section(MeshConfig)
    cfg.sft = _section(SFTConfig)  # supervised warm start
    cfg.eval = _section(EvalConfig)  # held-out evaluation
    cfg.data = _section(DataConfig)  # task pipeline: difficulty band, diversity
    cfg.rollout = _section(RolloutConfig)  # sampler and KV-cache shape
    cfg.rl = _section(RLConfig)  # optimiser, PPO, losses, corrections, fallback
    cfg.train = _section(TrainConfig)  # the RL loop
    return cfg


@dataclasses.dataclass(frozen=True)
class Sections:
    """A config's sections as the frozen dataclasses the code takes (see the module table).

    With ``init.hf_path`` the model is the pretrained one's and the environment is played
    through its chat template (``hf.training``).
    """

    env: EnvSpec
    init: InitConfig
    model: ModelConfig
    policy: DTypePolicy
    mesh: MeshConfig
    sft: SFTConfig
    eval: EvalConfig
    data: DataConfig
    rollout: RolloutConfig
    rl: RLConfig
    train: TrainConfig


def rl_config(section: ConfigDict | dict[str, Any]) -> RLConfig:
    """RLConfig from its config section (the nested ``loss`` becomes a ``LossConfig``)."""
    data = section.to_dict() if isinstance(section, ConfigDict) else dict(section)
    data["loss"] = to_dataclass(data.get("loss", {}), LossConfig)
    return to_dataclass(data, RLConfig)


def build(cfg: ConfigDict) -> Sections:
    """Builds every section of ``cfg`` and checks what spans sections.

    Raises:
      ValueError (or TypeError): a key that moved (``MOVED_KEYS``, naming the new key); the
        first bad section, named by its own message; a data section whose train split has no
        tasks or whose bug types the environment does not have; process weights the
        environment does not emit; an evaluation level the environment does not have; option
        combinations that cannot run together.
    """
    check_moved(cfg)
    init = hf_training.resolve(to_dataclass(cfg.init, InitConfig))  # a .gguf: its HF directory
    env = get_env(cfg.env)
    model = to_dataclass(cfg.model, ModelConfig)
    if init.hf_path:
        model = hf_training.model_config(init.hf_path, model)
        env = hf_training.chat_env(env, init.hf_path)
    model = model.check_trainable()
    s = Sections(
        env=env,
        init=init,
        model=model,
        policy=_policy(cfg),
        mesh=to_dataclass(cfg.mesh, MeshConfig),
        sft=to_dataclass(cfg.sft, SFTConfig),
        eval=to_dataclass(cfg.eval, EvalConfig),
        data=to_dataclass(cfg.data, DataConfig),
        rollout=to_dataclass(cfg.rollout, RolloutConfig),
        rl=rl_config(cfg.rl),
        train=to_dataclass(cfg.train, TrainConfig),
    )
    _check_env(s)
    _check_train(s)
    return s


def _policy(cfg: ConfigDict) -> DTypePolicy:
    """The ``policy`` preset with the config's kernel choices (``kernel_impl``, ``kernels``);
    ``DTypePolicy`` checks them."""
    return get_policy(cfg.policy, kernel_impl=cfg.kernel_impl, kernels=dict(cfg.kernels))


def _check_env(s: Sections) -> None:
    unknown = sorted(set(s.data.bug_types) - set(s.env.bug_types))
    if unknown:
        raise ValueError(
            f"data.bug_types has {unknown}, which env={s.env.name!r} does not have; "
            f"its bug types: {s.env.bug_types}"
        )
    if not s.data.cells("train"):
        raise ValueError(
            f"data: no training tasks at difficulties={s.data.difficulties} with "
            f"bug_types={s.data.bug_types}: heldout_combo={s.data.heldout_combo} holds out every "
            "combination (set data.heldout_combo=() to hold out none)"
        )
    for level in (*s.data.difficulties, *s.sft.difficulties, *s.sft.curriculum_difficulties):
        s.env.check_difficulty(level)
    s.env.check_difficulty(s.eval.difficulty)
    ev = s.eval
    eval_data_config(ev.split, ev.difficulty, ev.n_episodes, seed=ev.seed, data=s.data)
    weights = s.train.process_weights
    unknown = sorted(set(weights) - set(s.env.process_keys))
    if unknown:
        raise ValueError(
            f"train.process_weights has unknown keys {unknown}; env={s.env.name!r} emits "
            f"{s.env.process_keys}"
        )
    for k, w in weights.items():
        if not isinstance(w, (int, float)) or not math.isfinite(w):
            raise ValueError(f"train.process_weights[{k!r}]={w!r} must be a finite number")


def _check_train(s: Sections) -> None:
    loop, rl, model = s.train, s.rl, s.model
    if loop.greedy_member and s.data.group_size < 2:
        raise ValueError(
            f"train.greedy_member needs data.group_size >= 2, not {s.data.group_size} "
            "(a group needs a sampled member)"
        )
    if model.value_head and (rl.advantage != "gae" or rl.loss.vf_coef <= 0):
        raise ValueError(
            f"model.value_head={model.value_head!r} is a critic for rl.advantage='gae' "
            f"trained with rl.loss.vf_coef > 0 (got advantage={rl.advantage!r}, "
            f"vf_coef={rl.loss.vf_coef})"
        )
    if rl.loss.vf_coef > 0 and not model.value_head:
        raise ValueError(
            f"rl.loss.vf_coef={rl.loss.vf_coef} needs a value head: set model.value_head to "
            "'shared' or 'detached'"
        )
    if loop.guide_groups and loop.guide_source == "expert" and model.is_moe:
        raise ValueError(
            f"train.guide_groups={loop.guide_groups} needs a dense model: a scripted expert "
            "episode has no MoE routes to replay or compare"
        )


def _dotted(node: ConfigDict, values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``values`` (nested, as ``config.json`` stores them) as dotted keys over ``node``'s sections;
    free-form dict fields (empty sections such as ``rl.advantage_kwargs``) stay whole."""
    out = {}
    for key, value in values.items():
        sub = node.get(key) if isinstance(node, ConfigDict) else None
        if isinstance(value, dict) and isinstance(sub, ConfigDict) and sub.keys():
            out.update(_dotted(sub, value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def from_saved(saved: dict[str, Any], overrides=()) -> ConfigDict:
    """A run's saved config (``config.json``) on top of ``base_config()``, then ``overrides``.

    Keys the base config gained since the run was made keep their defaults; keys that moved
    since (``MOVED_KEYS``) are read under their new names.

    Raises:
      ValueError: a saved key the base config does not have, or a bad override.
    """
    cfg = apply_overrides(base_config(), move_keys(_dotted(base_config(), saved)))
    return apply_overrides(cfg, list(overrides))


def check_config(cfg: ConfigDict) -> None:
    """``build(cfg)`` for its errors only."""
    build(cfg)
