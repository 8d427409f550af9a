"""A pretrained Hugging Face model as the trainer's starting point (config section ``init``).

With ``init.hf_path`` set, the directory decides the model (its ``config.json``: ``model_config``),
the starting parameters (``load_pretrained``: SFT, or RL directly, starts from them) and the
tokenizer with its chat template and tool-call format: the run's environment is played through
:class:`~agentrl_jax.hf.chat_env.ChatEnv` (``chat_env``), so the model sees the task, the tool
schemas and the observations as its own chat turns, and its tool calls are parsed in its family's
format. Token ids still never round-trip through text between turns.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from agentrl_jax.envs.registry import EnvSpec
from agentrl_jax.hf.chat_env import ChatEnv, ChatExpertPolicy
from agentrl_jax.hf.checkpoint import read_hf_config
from agentrl_jax.hf.families import family_of
from agentrl_jax.hf.tokenizer import HFTokenizer, load_tokenizer
from agentrl_jax.model.config import ModelConfig

# ModelConfig fields a run may set on top of a pretrained architecture (training choices, not
# the architecture the checkpoint was trained with)
TRAINING_FIELDS = (
    "remat",
    "frozen_groups",
    "value_head",
    "capacity_factor",
    "router_aux_weight",
    "router_z_weight",
    "init_std",
)


@dataclasses.dataclass(frozen=True)
class InitConfig:
    """Where a run's model comes from (config section ``init``).

    Attributes:
      hf_path: a Hugging Face directory (``config.json``, ``*.safetensors``, ``tokenizer.json``
        and a chat template) or a ``.gguf`` file (converted once into a cache folder:
        ``hf.gguf.converted_dir``); '' = the model section, trained from scratch or
        ``train.init_from``.
    """

    hf_path: str = ""


def resolve(init: InitConfig) -> InitConfig:
    """``init`` with a ``.gguf`` ``hf_path`` replaced by its converted HF directory (converted
    on first use, reused after).

    Raises:
      FileNotFoundError: no such file; ValueError: a GGUF file the converter does not support.
    """
    if not init.hf_path.endswith(".gguf"):
        return init
    from agentrl_jax.hf.gguf import converted_dir

    return dataclasses.replace(init, hf_path=converted_dir(init.hf_path))


def model_config(hf_path: str, section: ModelConfig) -> ModelConfig:
    """The pretrained model's config, with the run's ``TRAINING_FIELDS`` from ``section``.

    Raises:
      ValueError: ``section`` changes an architecture field from its default (the checkpoint
        decides those), an unknown architecture, or an unsupported config field.
    """
    base = ModelConfig()
    changed = [
        f.name
        for f in dataclasses.fields(ModelConfig)
        if getattr(section, f.name) != getattr(base, f.name)
    ]
    fixed = sorted(set(changed) - set(TRAINING_FIELDS))
    if fixed:
        raise ValueError(
            f"model.{fixed[0]} is decided by init.hf_path={hf_path!r} (its config.json); with a "
            f"pretrained model only {TRAINING_FIELDS} may be set in the model section"
        )
    hf = read_hf_config(hf_path)
    cfg = family_of(hf).model_config(hf)
    return cfg.replace(**{k: getattr(section, k) for k in changed})


@functools.lru_cache(maxsize=8)
def tokenizer(hf_path: str) -> HFTokenizer:
    """The directory's tokenizer (loaded once per process)."""
    return load_tokenizer(hf_path)


class _ChatExpert(ChatExpertPolicy):
    """``ChatExpertPolicy`` that keeps the scripted expert's deliberate detours."""

    def __init__(self, expert, tok: HFTokenizer, code_tool: str | None):
        super().__init__(expert, tok, code_tool)
        self.detour_turns = getattr(expert, "detour_turns", frozenset())
        self.guess_turns = getattr(expert, "guess_turns", frozenset())


def chat_env(base: EnvSpec, hf_path: str) -> EnvSpec:
    """``base`` played by the chat model of ``hf_path``: its tokenizer, ``ChatEnv`` over the
    environment's text interface, the scripted expert's calls in the family's format.

    Raises:
      ValueError: an environment without a text interface (``TextEnv``).
    """
    inner_tok = base.tokenizer()
    probe = base.env(inner_tok)
    if not hasattr(probe, "reset_text"):
        raise ValueError(f"env={base.name!r} has no text interface (TextEnv) for a chat model")

    def make_env(tok: HFTokenizer):
        return ChatEnv(base.env(inner_tok), tok)

    def expert(task: Any, tok: HFTokenizer, **options):
        scripted = base.expert(task, inner_tok, **options)
        if not hasattr(scripted, "plan"):
            raise ValueError(
                f"env={base.name!r}: its scripted expert has no plan of calls to render as a "
                "chat model's turns (SFT demonstrations need one; set train.sft=False)"
            )
        inner = base.env(inner_tok)
        inner.reset_text(task)  # the task's level decides whether calls are code blocks
        return _ChatExpert(scripted, tok, getattr(inner, "code_action", None))

    return dataclasses.replace(
        base, tokenizer=lambda: tokenizer(hf_path), env=make_env, expert=expert
    )
