"""The stages around the RL loop, shared by the main job (``train/main.py``) and sweeps.

* :func:`start_params`: the parameters RL starts from: the SFT stage, ``train.init_from`` (a run
  or checkpoint directory, :func:`initial_params`) or a fresh initialisation.
* :func:`evaluate_run` / :func:`before_rl`: the held-out evaluation of a checkpoint; before RL
  it is run, or reused from the ``init_from`` run's summary when that evaluated the same SFT
  checkpoint the same way (:func:`stored_sft_eval`).
* :func:`summary`: the job's JSON summary line from the evaluations before and after RL.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import jax
import numpy as np

from agentrl_jax import multihost
from agentrl_jax.config import ConfigDict
from agentrl_jax.hf import load_pretrained
from agentrl_jax.metrics import MetricsWriter, load_config_json, plain
from agentrl_jax.model.transformer import Transformer, init_params, param_count
from agentrl_jax.train.checkpoint import restore_params, stage_dir
from agentrl_jax.train.eval_stats import paired_gain
from agentrl_jax.train.evaluate import evaluate_split
from agentrl_jax.train.placement import Placement
from agentrl_jax.train.sft import run_sft

log = logging.getLogger(__name__)


def start_params(
    sections,
    seed: int,
    run_dir: str,
    *,
    resume: bool,
    writer: MetricsWriter | None = None,
    progress: bool | None = None,
    placement: Placement | None = None,
):
    """The parameters RL starts from: SFT (``train.sft``; continued from its checkpoint when
    ``resume`` and one exists), else ``train.init_from``, else ``init_params`` with ``seed``.
    With ``init.hf_path`` the pretrained parameters are where SFT starts, or RL without SFT.
    With ``placement`` they come back placed on its mesh (sharded by the rules)."""
    s = sections
    place = placement or Placement.default_device(s.model, s.policy)
    model = Transformer(s.model, s.policy)
    pretrained = None
    if s.init.hf_path:
        mesh = place.mesh if place.sharded else None
        _, pretrained = load_pretrained(s.init.hf_path, s.policy, mesh, mesh_cfg=s.mesh)
    if s.train.sft:
        sft_dir = stage_dir(run_dir, "sft")
        # process 0's view: the others must not race its clean-up of a killed save
        done = multihost.broadcast_object(
            bool(resume and os.path.isdir(sft_dir) and os.listdir(sft_dir))
        )
        params, _ = run_sft(
            s.model,
            s.policy,
            s.sft,
            run_dir,
            env=s.env,
            data=s.data,
            params=pretrained,
            resume=bool(done),
            writer=writer,
            progress=progress,
            placement=place,
        )
        return params
    if pretrained is not None:
        return place.place_params(pretrained)
    template = init_params(model, jax.random.key(seed))
    if s.train.init_from:
        return place.place_params(initial_params(s.train.init_from, template))
    return place.place_params(template)


def initial_params(source: str, template):
    """Params RL starts from (``train.init_from``): a run dir (its SFT stage), a stage dir (its
    latest step) or a step dir, restored onto ``template``. A value head the template has and
    the checkpoint lacks (a critic added after SFT) keeps the template's fresh one.

    Raises:
      ValueError: no checkpoint at ``source``.
    """
    if os.path.isdir(os.path.join(source, "checkpoints")):  # a run dir: its SFT stage
        source = stage_dir(source, "sft")
    head = template["params"].get("value_head")
    try:
        return restore_params(source, template)[0]
    except ValueError:  # with a head: the checkpoint's tree may lack it (fewer leaves)
        if head is None:
            raise
        trunk = {
            **template,
            "params": {k: v for k, v in template["params"].items() if k != "value_head"},
        }
        params, _ = restore_params(source, trunk)
        log.info("%s has no value head: the critic starts from its initialisation", source)
        return {**params, "params": {**params["params"], "value_head": head}}


def evaluate_run(sections, params, placement: Placement | None = None) -> dict[str, Any]:
    """``evaluate_split`` of ``params`` under the run's ``eval`` section (its ``data`` section
    picks the ``"train"`` split's tasks). With ``placement`` the episodes run under its host
    context (the run's mesh; with several processes each evaluates on its local copy)."""
    s = sections
    model = Transformer(s.model, s.policy)
    if placement is None:
        return evaluate_split(model, params, s.eval, env=s.env, data=s.data)
    with placement.host_context():
        local = placement.host_params(params)
        return evaluate_split(model, local, s.eval, env=s.env, data=s.data)


def main_mode(result: dict) -> str:
    """The mode a summary reports: ``greedy`` if evaluated, else the first one."""
    modes = [k for k in result if isinstance(result[k], dict)]
    return "greedy" if "greedy" in modes else modes[0]


def mode_value(result: dict, key: str) -> float:
    """``key`` of the result's main mode (``main_mode``)."""
    return float(result[main_mode(result)][key])


def eval_metrics(result: dict) -> dict[str, float]:
    """Metrics of an evaluation for the JSONL/TensorBoard writer (prefix ``eval``): the greedy
    (else first) mode's success, goal adherence, truncated fraction and per-bug-type and
    per-subtype success (``heldout_bug_subtype/logic/variable``)."""
    r = result[main_mode(result)]
    out = {f"heldout_{k}": float(r[k]) for k in ("success", "goal_adherence", "truncated")}
    for key in ("bug_type", "bug_subtype"):
        out.update({f"heldout_{key}/{b}": float(v) for b, v in r.get(f"per_{key}", {}).items()})
    return out


def before_rl(
    cfg: ConfigDict,
    sections,
    params,
    prior: dict,
    writer: MetricsWriter,
    summary_path: str,
    placement: Placement | None = None,
) -> None:
    """Fills ``prior`` (the summary so far) with the before-RL evaluation: run it
    (``train.eval_before``; written to the metrics at step 0), or reuse the ``init_from`` run's
    stored one (``eval_before_from``); nothing when ``prior`` already has it (a resume)."""
    loop = sections.train
    if loop.eval_before and "heldout_success_before_rl" not in prior:
        before = evaluate_run(sections, params, placement)
        writer.write(0, eval_metrics(before), prefix="eval")
        log.info("held-out before RL: %s", json.dumps(before))
    elif not loop.eval_before and loop.init_from and "eval_before" not in prior:
        stored = stored_sft_eval(loop.init_from, cfg)
        if stored is None:
            return
        before, prior["eval_before_from"] = stored
        log.info("held-out before RL: reused from %s", prior["eval_before_from"])
    else:
        return
    prior["heldout_success_before_rl"] = mode_value(before, "success")
    prior["goal_adherence_before_rl"] = mode_value(before, "goal_adherence")
    prior["eval_before"] = before
    dump_json(summary_path, prior)


def stored_sft_eval(source: str, cfg: ConfigDict) -> tuple[dict, str] | None:
    """``(evaluation, summary path)`` of the SFT checkpoint a run dir ``source`` holds, when its
    summary has the before-RL evaluation and its config the same ``eval`` section, environment
    and dtype policy as ``cfg`` (same tasks, same decoding), and for ``eval.split="train"`` the
    same ``data`` section (which picks those tasks); else None."""
    summary_file = os.path.join(source, "summary.json")
    if not (os.path.isfile(summary_file) and os.path.isfile(os.path.join(source, "config.json"))):
        return None
    src = load_config_json(source)
    with open(summary_file) as f:
        before = json.load(f).get("eval_before")
    same = plain(cfg.eval) == src.get("eval") and src.get("env", "coderepair") == cfg.env
    if cfg.eval.split == "train":  # the run's own training tasks: its data section picks them
        same = same and plain(cfg.data) == src.get("data")
    if not before or not same or src.get("policy") != cfg.policy:
        return None
    return before, os.path.abspath(summary_file)


def gains(before: dict | None, after: dict) -> dict[str, Any] | None:
    """``{mode: paired_gain}`` for each mode evaluated before and after (None without a before
    evaluation; a mode whose before result predates ``episode_success`` is left out)."""
    if not before:
        return None
    return {
        mode: {
            k: round(v, 4) if isinstance(v, float) else v
            for k, v in paired_gain(before[mode], after[mode]).items()
        }
        for mode in after
        if isinstance(after[mode], dict) and "episode_success" in before.get(mode, {})
    }


SUMMARY_KEYS = (
    "model",
    "heldout_success_before_rl",
    "heldout_success_after_rl",
    "goal_adherence_before_rl",
    "goal_adherence_after_rl",
    "heldout_sampled_success_before_rl",
    "heldout_sampled_success_after_rl",
    "heldout_gain",
    "eval_before_from",
    "eval_split",
    "entropy_start",
    "entropy_end",
    "nonfinite_steps",
    "rl_steps",
    "wall_s",
    "run_dir",
)  # what summary() returns, in order (a finished run's summary is read back by these keys)


def model_name(cfg: ConfigDict, params) -> str:
    """What a run trains, for its summary: the pretrained source (``init.hf_path`` as given, a
    GGUF file or Hugging Face directory) or the experiment's own randomly initialised model,
    with the parameter count."""
    n = f"{param_count(params) / 1e6:.1f}M parameters"
    if cfg.init.hf_path:
        return f"{os.path.basename(os.path.normpath(cfg.init.hf_path))} ({n})"
    return f"{cfg.name} model, trained from scratch ({n})"


def summary(
    prior: dict,
    after: dict,
    *,
    model: str,
    eval_split: str,
    entropies: list[float],
    nonfinite_steps: int,
    rl_steps: int,
    wall_s: float,
    run_dir: str,
) -> dict[str, Any]:
    """The job's summary (BENCHMARKS.md "The main job's last line") from the before-RL fields
    in ``prior`` and the after-RL evaluation ``after``."""
    finite = [e for e in entropies if np.isfinite(e)]
    before = prior.get("eval_before")
    out = {
        "model": model,
        "heldout_success_before_rl": prior.get("heldout_success_before_rl"),
        "heldout_success_after_rl": mode_value(after, "success"),
        "goal_adherence_before_rl": prior.get("goal_adherence_before_rl"),
        "goal_adherence_after_rl": mode_value(after, "goal_adherence"),
        "heldout_sampled_success_before_rl": (before or {}).get("sampled", {}).get("success"),
        "heldout_sampled_success_after_rl": after.get("sampled", {}).get("success"),
        "heldout_gain": gains(before, after),
        "eval_before_from": prior.get("eval_before_from"),
        "eval_split": eval_split,
        "entropy_start": finite[0] if finite else None,
        "entropy_end": finite[-1] if finite else None,
        "nonfinite_steps": nonfinite_steps,
        "rl_steps": rl_steps,
        "wall_s": round(wall_s, 1),
        "run_dir": run_dir,
    }
    return out


def dump_json(path: str, obj: dict) -> None:
    """Writes ``obj`` as JSON atomically (temp file + rename); on a multi-process run only
    process 0 writes (the others hold the same ``obj``)."""
    if not multihost.is_primary():
        return
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, default=float)
    os.replace(tmp, path)
