"""The ``Trajectory`` batch the rollout produces and the trainer consumes, and its JSONL log.

Layout (B episodes padded to T tokens; numpy arrays from the rollout, any array type works):
  tokens            int32 [B, T]  prompt, model turns, observations (0 on padding)
  valid             bool  [B, T]  non-padding
  action_mask       bool  [B, T]  tokens the model sampled (losses and logprobs apply there)
  turn_ids          int32 [B, T]  0 prompt, k on model turn k and its observation, -1 padding
  rollout_logprobs  f32   [B, T]  log p(tokens[b,t] | tokens[b,:t]) under the sampled policy
                                  (0 off actions); compare with token_logprobs(logits[:, :-1],
                                  tokens[:, 1:]) at positions 1..T-1
  routes            int32 [B, T, L_moe, k] or None: experts each token's own forward used; -1
                                  where the rollout never ran the token (replay: the router's)
  outcome_reward    f32   [B]     final-step reward (0 if the episode did not finish)
  process_rewards   f32   [B, T]  sum of the turn's process signals on its last action token
  success, goal_adhered, truncated  bool [B]  (truncated: stopped by max turns / max tokens /
                                  cache capacity before the environment said done)
  group_ids         int32 [B]     episodes of the same task share a group id
  kv_evict_at       int32 [B, T] or None: for KV eviction, the first position whose chunk no
                                  longer sees token t in full/sparse layers (int32 max = kept).
                                  Eviction takes effect at chunk-aligned positions; replay it with
                                  ``trainer_logprobs(..., replay_kv=True)``
  kv_keep_mask      bool  [B, T] or None: ``kv_evict_at == int32 max`` (token never evicted)
  kv_int8_mask      bool  [B, T] or None: token's K/V pages were moved to int8 (per-page scales)
  kv_int8_at        int32 [B, T] or None: the chunk-aligned position from which it was int8
  sparse_blocks     int32 [B, T, L_F, K, n] or None: the key blocks each F layer's query at
                                  each position attended to, per kv head (-1 unused; positions
                                  never computed keep only their own block). Replayed in training
                                  (``rl.use_block_replay``)
  policy_versions   int32 [B, T] or None: the policy version (updates applied to the
                                  parameters) that sampled each action token, -1 elsewhere; set
                                  by rollouts that switch weights mid-episode

``logs`` (host only, dropped by jax tree operations so a jitted trainer never retraces on it):
one dict per model turn with ``episode``, ``turn``, ``tool``, ``args``, ``output``, ``error``,
``tokens_so_far``, ``new_tokens``, ``prefill_tokens`` and the episode's KV memory measured on
the live pools at that moment: ``pages_in_use`` / ``int8_pages_in_use`` (its pages in the float
/ int8 pool), ``kv_bytes`` (those pages x page bytes + its rings), ``kv_bytes_float``,
``kv_bytes_int8``, and ``pool_pages_in_use`` / ``int8_pool_pages_in_use`` over all slots.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

import jax
import numpy as np

ARRAY_FIELDS = (
    "tokens",
    "valid",
    "action_mask",
    "turn_ids",
    "rollout_logprobs",
    "routes",
    "outcome_reward",
    "process_rewards",
    "success",
    "goal_adhered",
    "truncated",
    "group_ids",
    "kv_evict_at",
    "kv_keep_mask",
    "kv_int8_mask",
    "kv_int8_at",
    "sparse_blocks",
)
# Set only by rollouts that switch weights mid-batch (asynchronous RL). Kept out of ARRAY_FIELDS,
# which the pinned digests of rollouts hash field by field (tests/rollout), but a pytree leaf.
VERSION_FIELDS = ("policy_versions",)


@dataclasses.dataclass(frozen=True)
class Trajectory:
    """A padded batch of episodes (see module docstring). A jax pytree of its arrays."""

    tokens: Any
    valid: Any
    action_mask: Any
    turn_ids: Any
    rollout_logprobs: Any
    routes: Any
    outcome_reward: Any
    process_rewards: Any
    success: Any
    goal_adhered: Any
    truncated: Any
    group_ids: Any
    kv_evict_at: Any = None
    kv_keep_mask: Any = None
    kv_int8_mask: Any = None
    kv_int8_at: Any = None
    sparse_blocks: Any = None
    policy_versions: Any = None
    logs: tuple = ()

    @property
    def batch(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def length(self) -> int:
        return int(self.tokens.shape[1])

    def replace(self, **changes) -> Trajectory:
        return dataclasses.replace(self, **changes)


def _flatten(traj: Trajectory):
    return tuple(getattr(traj, f) for f in ARRAY_FIELDS + VERSION_FIELDS), None


def _unflatten(_, children) -> Trajectory:
    return Trajectory(**dict(zip(ARRAY_FIELDS + VERSION_FIELDS, children, strict=True)))


jax.tree_util.register_pytree_node(Trajectory, _flatten, _unflatten)


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, np.generic):
        return x.item()
    return x


def log_lines(traj: Trajectory) -> list[str]:
    """The per-turn log records of ``traj`` as JSON strings (one line each)."""
    return [json.dumps(_jsonable(r), sort_keys=True) for r in traj.logs]


def write_jsonl(traj: Trajectory, path: str, *, append: bool = True) -> int:
    """Writes the per-turn log to ``path`` as JSONL; returns the number of records."""
    lines = log_lines(traj)
    with open(path, "a" if append else "w") as f:
        for line in lines:
            f.write(line + "\n")
    return len(lines)


def history_state_ids(tokens, action_mask, turn_ids) -> np.ndarray:
    """Step-level state ids: equal for model turns taken after the same token history.

    The state an action turn k of row b is taken from is the token prefix
    ``tokens[b, :s]`` before the turn's first action token ``s`` (prompt, earlier actions and
    observations). Two turns get the same id iff their prefixes are equal, so the rollouts of
    one task share an id at the first turn, and again after identical actions and observations.
    Ids are 1, 2, ... in order of first appearance over the batch (row-major), written on the
    turn's action tokens; 0 elsewhere. For ``CreditInputs.state_ids`` (``gigpo``).

    Args:
      tokens: int [B, T]; action_mask: bool [B, T]; turn_ids: int [B, T] (as ``Trajectory``).

    Returns:
      int32 [B, T].
    """
    tokens = np.asarray(tokens)
    action_mask = np.asarray(action_mask, bool)
    turn_ids = np.asarray(turn_ids)
    if not tokens.shape == action_mask.shape == turn_ids.shape or tokens.ndim != 2:
        raise ValueError(
            f"tokens {tokens.shape}, action_mask {action_mask.shape} and turn_ids "
            f"{turn_ids.shape} must be equal [B, T] shapes"
        )
    out = np.zeros(tokens.shape, np.int32)
    ids: dict[bytes, int] = {}
    for b in range(tokens.shape[0]):
        row = tokens[b].astype(np.int64)
        for k in np.unique(turn_ids[b][action_mask[b]]):
            on = action_mask[b] & (turn_ids[b] == k)
            start = int(np.flatnonzero(on)[0])
            key = hashlib.blake2b(row[:start].tobytes(), digest_size=16).digest()
            out[b, on] = ids.setdefault(key, len(ids) + 1)
    return out


@dataclasses.dataclass
class EpisodeRecord:
    """Host-side token stream of one episode while it is being played."""

    uid: int
    task_index: int
    group_id: int
    tokens: list[int] = dataclasses.field(default_factory=list)
    action: list[bool] = dataclasses.field(default_factory=list)
    turn_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    routes: np.ndarray | None = None  # [capacity, L_moe, k], written by position
    routes_upto: int = 0  # routes of tokens before this index are final
    blocks: np.ndarray | None = None  # [capacity, L_F, K, n] sparse block records by position
    blocks_upto: int = 0  # block records of tokens before this index are final
    process: dict[int, float] = dataclasses.field(default_factory=dict)
    evict_at: dict[int, int] = dataclasses.field(default_factory=dict)
    int8_at: dict[int, int] = dataclasses.field(default_factory=dict)
    outcome: float = 0.0
    success: bool = False
    goal_adhered: bool = True
    done: bool = False
    truncated: bool = False

    def extend(self, toks, *, action: bool, turn: int, logprobs=None) -> None:
        toks = [int(t) for t in toks]
        self.tokens += toks
        self.action += [action] * len(toks)
        self.turn_ids += [turn] * len(toks)
        self.logprobs += [0.0] * len(toks) if logprobs is None else [float(x) for x in logprobs]

    def set_blocks(self, upto: int, blocks: np.ndarray) -> None:
        """Block records of positions ``blocks_upto .. upto - 1`` from a slot's device record
        ``blocks`` [S, L_F, K, n] (earlier positions keep what was recorded first)."""
        if self.blocks is not None and upto > self.blocks_upto:
            self.blocks[self.blocks_upto : upto] = blocks[self.blocks_upto : upto]
            self.blocks_upto = upto

    def set_routes(self, start: int, routes: np.ndarray) -> None:
        """Routes of tokens ``start .. start + len(routes) - 1`` (MoE)."""
        if self.routes is not None and len(routes):
            self.routes[start : start + len(routes)] = routes


def own_blocks(capacity: int, shape: tuple[int, int, int], block_size: int) -> np.ndarray:
    """int32 [capacity, L_F, K, n] block records that select only each position's own block."""
    out = np.full((capacity, *shape), -1, np.int32)
    out[..., 0] = (np.arange(capacity) // block_size)[:, None, None]
    return out


def weighted_process(signals: dict[str, float], weights: dict[str, float]) -> float:
    """A turn's process reward: its signals weighted by ``weights`` (a missing key weighs 1.0)."""
    return float(sum(weights.get(k, 1.0) * v for k, v in signals.items()))


def episode_record(
    episode, *, uid: int, group_id: int, process_weights: dict[str, float] | None = None
) -> EpisodeRecord:
    """An ``EpisodeRecord`` of an episode played outside the sampler (``envs.episode.Episode``,
    e.g. a scripted expert's): process signals weighted as ``run_episodes`` weighs them (1.0 per
    missing key) on each turn's last action token; rollout logprobs 0 (the caller fills them)."""
    weights = process_weights or {}
    rec = EpisodeRecord(uid=uid, task_index=uid, group_id=group_id)
    rec.tokens = [int(t) for t in episode.tokens]
    rec.action = [bool(a) for a in episode.action_mask]
    rec.turn_ids = [int(t) for t in episode.turn_ids]
    rec.logprobs = [0.0] * len(rec.tokens)
    for end, signals in zip(episode.turn_ends, episode.process, strict=True):
        rec.process[int(end)] = weighted_process(signals, weights)
    rec.outcome = float(episode.outcome_reward)
    rec.success = bool(episode.success)
    rec.goal_adhered = bool(episode.goal_adhered)
    rec.done = bool(episode.done)
    rec.truncated = not episode.done
    return rec


def stack_episodes(
    records: list[EpisodeRecord],
    *,
    pad_to: int | None = None,
    route_shape: tuple[int, int] | None = None,
    kv_masks: bool = False,
    logs: tuple = (),
    blocks: tuple[tuple[int, int, int], int] | None = None,
) -> Trajectory:
    """Pads finished episode records into a :class:`Trajectory` (rows in record order).

    ``blocks``: ((L_F, K, n), block size) to stack the records' sparse block records (padding
    positions select their own block), or None.

    Raises:
      ValueError: if ``pad_to`` is shorter than the longest episode.
    """
    longest = max(len(r.tokens) for r in records)
    t = longest if pad_to is None else pad_to
    if t < longest:
        raise ValueError(f"pad_to={pad_to} must be >= the longest episode ({longest})")
    b = len(records)
    tokens = np.zeros((b, t), np.int32)
    valid = np.zeros((b, t), bool)
    action = np.zeros((b, t), bool)
    turns = np.full((b, t), -1, np.int32)
    logp = np.zeros((b, t), np.float32)
    proc = np.zeros((b, t), np.float32)
    routes = None if route_shape is None else np.full((b, t, *route_shape), -1, np.int32)
    never = np.iinfo(np.int32).max
    evict = np.full((b, t), never, np.int32) if kv_masks else None
    int8 = np.full((b, t), never, np.int32) if kv_masks else None
    blk = None
    if blocks is not None:
        blk = np.broadcast_to(own_blocks(t, *blocks), (b, t, *blocks[0])).copy()
    for i, r in enumerate(records):
        n = len(r.tokens)
        tokens[i, :n] = r.tokens
        valid[i, :n] = True
        action[i, :n] = r.action
        turns[i, :n] = r.turn_ids
        logp[i, :n] = r.logprobs
        for pos, v in r.process.items():
            proc[i, pos] += v
        if routes is not None and r.routes is not None:
            routes[i, :n] = r.routes[:n]
            # tokens never run through the model (the last sampled token, a final observation)
            # have no routes: -1, which a replay leaves to the router (``model.experts.route``)
            routes[i, r.routes_upto : n] = -1
        if blk is not None and r.blocks is not None:
            blk[i, :n] = r.blocks[:n]
        if kv_masks:
            for pos, e in r.evict_at.items():
                evict[i, pos] = e
            for pos, e in r.int8_at.items():
                int8[i, pos] = e
    return Trajectory(
        tokens=tokens,
        valid=valid,
        action_mask=action,
        turn_ids=turns,
        rollout_logprobs=logp,
        routes=routes,
        outcome_reward=np.asarray([r.outcome for r in records], np.float32),
        process_rewards=proc,
        success=np.asarray([r.success for r in records], bool),
        goal_adhered=np.asarray([r.goal_adhered for r in records], bool),
        truncated=np.asarray([r.truncated for r in records], bool),
        group_ids=np.asarray([r.group_id for r in records], np.int32),
        kv_evict_at=evict,
        kv_keep_mask=None if evict is None else evict == never,
        kv_int8_mask=None if int8 is None else int8 != never,
        kv_int8_at=int8,
        sparse_blocks=blk,
        logs=tuple(logs),
    )


# -- rows of a trajectory as plain arrays (the RL loop's batch assembly) ---------------------------

Rows = dict[str, np.ndarray]
NEVER = np.iinfo(np.int32).max  # the "not evicted / not int8" mark of kv_evict_at, kv_int8_at


def select_rows(traj: Trajectory, idx) -> Rows:
    """The arrays of ``traj``'s rows ``idx`` (per-turn logs and absent fields left out)."""
    out = {}
    for f in dataclasses.fields(traj):
        v = getattr(traj, f.name)
        if f.name != "logs" and v is not None:
            out[f.name] = np.asarray(v)[idx]
    return out


def _pad_value(key: str, a: np.ndarray):
    if key in ("turn_ids", "policy_versions", "routes"):  # routes: -1 = the router's own
        return -1
    if key.startswith("kv_") and a.dtype == np.int32:
        return NEVER
    if key == "sparse_blocks":
        return -1
    return 0


def concat_rows(parts: list[Rows], length: int) -> Rows:
    """Concatenates row dicts along the batch, padding time to ``length`` (``turn_ids``,
    ``routes`` (the router's own under replay), ``sparse_blocks`` and ``policy_versions`` with
    -1, the int32 KV marks with ``NEVER``, everything else with 0).

    Raises:
      ValueError: a part longer than ``length``.
    """
    out = {}
    for key in parts[0]:
        arrs = []
        for p in parts:
            a = p[key]
            if a.ndim >= 2:
                if a.shape[1] > length:
                    raise ValueError(f"rows of {key!r} have {a.shape[1]} > length={length} steps")
                pad = [(0, 0), (0, length - a.shape[1])] + [(0, 0)] * (a.ndim - 2)
                a = np.pad(a, pad, constant_values=_pad_value(key, a))
            arrs.append(a)
        out[key] = np.concatenate(arrs, axis=0)
    return out


def with_first_row(rows: Rows, one: Rows, length: int) -> Rows:
    """A copy of ``rows`` padded to ``length`` whose first row is the one-row ``one`` (e.g. a
    guide's episode replacing a group's first member), flagged in ``guided``."""
    out = concat_rows([rows], length)
    for key, value in concat_rows([one], length).items():
        out[key][0] = value[0]
    out["guided"] = np.arange(len(out["guided"])) == 0
    return out
