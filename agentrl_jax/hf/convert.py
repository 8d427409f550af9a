"""``agentrl convert HF_DIR RUN_DIR``, ``agentrl convert FILE.gguf HF_DIR`` and
``agentrl export CKPT HF_DIR``.

``convert`` of a ``.gguf`` file writes an HF directory, not a run directory (``hf.gguf``:
``config.json``, float32 ``model.safetensors``, ``tokenizer.json``, ``tokenizer_config.json``
with the chat template, ``generation_config.json``); OUT_DIR must not exist or be empty. That
directory is an ``init.hf_path`` or the HF_DIR of a second ``convert`` into a run directory.

``convert`` of an HF directory loads it (``load_pretrained``) and writes a run directory the
trainer starts from:

    RUN_DIR/checkpoints/sft/0/     orbax checkpoint, item ``state`` = {params, rng, step} and a
                                   JSON item ``meta`` (the layout of ``train.checkpoint``), so
                                   ``train.init_from=RUN_DIR`` restores it
    RUN_DIR/config.json            ``model`` (the ModelConfig fields), ``policy``, ``hf_family``
    RUN_DIR/hf_source/             the source's config, tokenizer and chat-template files
    RUN_DIR/experiment.py          an experiment whose model is this one, starting from it

``export`` writes an HF directory from a checkpoint: a step directory, a stage directory (its
latest step) or a run directory (its SFT stage); the model config comes from the enclosing run
directory's ``config.json`` and the source ``config.json`` fields (token ids, ...) are kept when
the run was made by ``convert``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from agentrl_jax.hf.checkpoint import (
    _param_specs,
    infer_family,
    load_pretrained,
    read_hf_config,
    save_pretrained,
)
from agentrl_jax.hf.families import family_of
from agentrl_jax.model.config import ModelConfig
from agentrl_jax.precision import get_policy

SOURCE_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)
_EXPERIMENT = '''"""Starts from the Hugging Face model converted into this run directory
(``agentrl convert {source} {run_dir}``)."""

from agentrl_jax.config import parse_arg
from agentrl_jax.experiment import base_config

MODEL = {model}


def get_config(arg=None):
    arg = parse_arg(arg)
    cfg = base_config()
    cfg.name = "{name}"
    cfg.policy = "{policy}"
    for key, value in MODEL.items():
        cfg.model[key] = value
    cfg.train.sft = False
    cfg.train.init_from = "{run_dir}"
    return cfg
'''


def convert(hf_dir: str, run_dir: str, *, policy: str = "fp32") -> str:
    """Converts an HF directory into a run directory (module docstring); returns its checkpoint
    step directory.

    Raises:
      ValueError: ``run_dir`` already holds checkpoints, or the HF directory does not load
        (``load_pretrained``'s errors).
    """
    run_dir = os.path.abspath(run_dir)
    ckpt_dir = os.path.join(run_dir, "checkpoints", "sft")
    if os.path.isdir(ckpt_dir) and os.listdir(ckpt_dir):
        raise ValueError(f"run directory {run_dir!r} already holds checkpoints")
    hf = read_hf_config(hf_dir)
    family = family_of(hf).name
    cfg, params = load_pretrained(hf_dir, policy)
    mngr = ocp.CheckpointManager(ckpt_dir, options=ocp.CheckpointManagerOptions(create=True))
    state = {
        "params": params,
        "rng": np.asarray(jax.random.key_data(jax.random.key(0))),
        "step": np.asarray(0, np.int64),
    }
    meta = {"hf_source": os.path.abspath(hf_dir), "hf_family": family}
    mngr.save(
        0, args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta))
    )
    mngr.wait_until_finished()
    mngr.close()
    os.makedirs(os.path.join(run_dir, "hf_source"), exist_ok=True)
    for name in SOURCE_FILES:
        if os.path.isfile(os.path.join(hf_dir, name)):
            shutil.copy(os.path.join(hf_dir, name), os.path.join(run_dir, "hf_source", name))
    model = dataclasses.asdict(cfg)
    config = {"name": f"hf-{family}", "policy": policy, "model": model, "hf_family": family}
    with open(os.path.join(run_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    with open(os.path.join(run_dir, "experiment.py"), "w") as f:
        f.write(
            _EXPERIMENT.format(
                source=hf_dir,
                run_dir=run_dir,
                model=repr(model),
                name=config["name"],
                policy=policy,
            )
        )
    return os.path.join(ckpt_dir, "0")


def _step_dir(path: str) -> tuple[str, str]:
    """(step directory, run directory) of a step, stage or run directory."""
    path = os.path.abspath(path)
    if os.path.isdir(os.path.join(path, "checkpoints")):
        path = os.path.join(path, "checkpoints", "sft")
    if not os.path.basename(path).isdigit():
        steps = (
            sorted(int(n) for n in os.listdir(path) if n.isdigit()) if os.path.isdir(path) else []
        )
        if not steps:
            raise ValueError(f"no checkpoint found at {path!r}")
        path = os.path.join(path, str(steps[-1]))
    run = path
    while not os.path.isfile(os.path.join(run, "config.json")):
        if os.path.dirname(run) == run:
            raise ValueError(f"{path!r} is not inside a run directory (no config.json above it)")
        run = os.path.dirname(run)
    return path, run


def export(ckpt: str, hf_dir: str, *, dtype: str | None = None, max_shard_bytes=None) -> list[str]:
    """Writes the checkpoint ``ckpt`` as an HF directory (module docstring); returns the
    safetensors files written.

    Raises:
      ValueError: no checkpoint, no enclosing run directory, or a model no HF family expresses.
    """
    step_dir, run_dir = _step_dir(ckpt)
    with open(os.path.join(run_dir, "config.json")) as f:
        run_cfg: dict[str, Any] = json.load(f)
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    model = {k: tuple(v) if isinstance(v, list) else v for k, v in run_cfg["model"].items()}
    cfg = ModelConfig(**{k: v for k, v in model.items() if k in fields})
    shapes, _ = _param_specs(cfg, get_policy(run_cfg.get("policy", "fp32")))
    mngr = ocp.CheckpointManager(os.path.dirname(step_dir))
    out = mngr.restore(
        int(os.path.basename(step_dir)),
        args=ocp.args.Composite(state=ocp.args.StandardRestore(), meta=ocp.args.JsonRestore()),
    )
    mngr.close()
    params = jax.tree.unflatten(jax.tree.structure(shapes), jax.tree.leaves(out["state"]["params"]))
    src = os.path.join(run_dir, "hf_source")
    extra = None
    if os.path.isfile(os.path.join(src, "config.json")):  # what ModelConfig does not hold
        keep = ("max_position_embeddings", "bos_token_id", "eos_token_id", "pad_token_id")
        extra = {k: v for k, v in read_hf_config(src).items() if k in keep}
    family = run_cfg.get("hf_family") or infer_family(cfg)
    files = save_pretrained(
        hf_dir, cfg, params, family=family, dtype=dtype, max_shard_bytes=max_shard_bytes,
        extra_config=extra,
    )  # fmt: skip
    for name in SOURCE_FILES[1:]:
        if os.path.isfile(os.path.join(src, name)):
            shutil.copy(os.path.join(src, name), os.path.join(hf_dir, name))
    return files


def run_from_cli(args) -> int:
    """``agentrl convert`` / ``agentrl export`` (see ``agentrl_jax.cli``)."""
    if args.command == "convert" and args.hf_dir.endswith(".gguf"):
        from agentrl_jax.hf.gguf import gguf_to_hf

        out = gguf_to_hf(args.hf_dir, args.run_dir)
        print(json.dumps({"hf_dir": out, "source": os.path.abspath(args.hf_dir)}))
    elif args.command == "convert":
        step = convert(args.hf_dir, args.run_dir, policy=args.policy)
        print(json.dumps({"checkpoint": step, "experiment": f"{args.run_dir}/experiment.py"}))
    else:
        files = export(args.checkpoint, args.hf_dir, dtype=args.dtype)
        print(json.dumps({"hf_dir": args.hf_dir, "files": files}))
    return 0
