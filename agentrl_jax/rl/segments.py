"""Segment statistics for credit assignment: groups of episodes, turns of an episode.

Every function is pure and jittable; segment counts are static (derived from array shapes), so
arbitrary integer keys (task hashes, state hashes) are first mapped to dense ids by sorting.

Shape legend:
  B  episodes (batch rows)
  T  tokens per episode
  K  turn slots per episode (K = T: a turn has at least one token, so ids are < T)
  N  flattened entries (B for episodes, B*K for (episode, turn) pairs)
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import Array


def dense_segment_ids(keys: Sequence[Array], valid: Array) -> Array:
    """Maps each entry's key tuple to a dense id; entries with equal keys share an id.

    Args:
      keys: one or more int arrays of shape [N]; entries are grouped by the tuple of their keys.
      valid: bool [N]; invalid entries get id N (outside [0, N), i.e. dropped by segment ops).

    Returns:
      int32 [N], ids in [0, number of distinct valid key tuples) for valid entries, N otherwise.
    """
    n = valid.shape[0]
    # jnp.lexsort sorts by the last key first: valid entries first, then keys[0], keys[1], ...
    order = jnp.lexsort(tuple(reversed([k for k in keys])) + (~valid,))
    changed = jnp.zeros((n,), bool).at[0].set(True)
    for k in keys:
        ks = k[order]
        changed = changed | jnp.concatenate([jnp.ones((1,), bool), ks[1:] != ks[:-1]])
    seg_sorted = jnp.cumsum(changed.astype(jnp.int32)) - 1
    seg_sorted = jnp.where(valid[order], seg_sorted, n)
    return jnp.zeros((n,), jnp.int32).at[order].set(seg_sorted)


def segment_stats(x: Array, seg: Array, valid: Array) -> tuple[Array, Array, Array]:
    """Per-entry sum, count and population std of the entry's segment (two-pass, fp32).

    Args:
      x: float [N] values.
      seg: int [N] dense segment ids in [0, N]; id N is a discard bucket.
      valid: bool [N]; invalid entries contribute nothing and receive zeros.

    Returns:
      (segment_sum, segment_count, segment_std), each f32 [N], gathered back per entry:
      std = sqrt(mean over the segment of (x - segment_mean)^2).
    """
    n = x.shape[0]
    x = jnp.where(valid, x.astype(jnp.float32), 0.0)
    seg = jnp.where(valid, seg, n)
    s = jax.ops.segment_sum(x, seg, num_segments=n + 1)
    c = jax.ops.segment_sum(valid.astype(jnp.float32), seg, num_segments=n + 1)
    mean = s / jnp.maximum(c, 1.0)
    dev = jnp.where(valid, x - mean[seg], 0.0)
    var = jax.ops.segment_sum(dev * dev, seg, num_segments=n + 1) / jnp.maximum(c, 1.0)
    valid_f = valid.astype(jnp.float32)
    return s[seg] * valid_f, c[seg] * valid_f, jnp.sqrt(var[seg]) * valid_f


def segment_all_equal(x: Array, seg: Array, valid: Array) -> Array:
    """Whether every valid entry of the entry's segment holds the same value (exactly).

    A segment's float32 mean of equal values that do not sum exactly (0.9 three times) differs
    from the value in the last bit, so ``x - mean`` is not zero there; estimators use this mask
    to give such a segment exactly zero advantage.

    Args:
      x: float [N] values.
      seg: int [N] dense segment ids in [0, N]; id N is a discard bucket.
      valid: bool [N]; invalid entries are ignored and receive False.

    Returns:
      bool [N].
    """
    n = x.shape[0]
    x = x.astype(jnp.float32)
    seg = jnp.where(valid, seg, n)
    hi = jax.ops.segment_max(jnp.where(valid, x, -jnp.inf), seg, num_segments=n + 1)
    lo = jax.ops.segment_min(jnp.where(valid, x, jnp.inf), seg, num_segments=n + 1)
    return valid & (hi[seg] == lo[seg])


def per_turn_sum(x: Array, turn_ids: Array, mask: Array) -> Array:
    """Sums x over the masked tokens of each turn: out[b, k] = sum_{t: turn_ids[b,t]=k, mask} x.

    Args:
      x: float [B, T].
      turn_ids: int [B, T] turn index per token (negative for padding).
      mask: bool [B, T] tokens to include (typically the action mask).

    Returns:
      f32 [B, K] with K = T (turn slots; turns with no masked token hold 0).
    """
    b, t = x.shape
    valid = mask & (turn_ids >= 0) & (turn_ids < t)
    flat = jnp.where(valid, jnp.arange(b)[:, None] * t + turn_ids, b * t).reshape(-1)
    vals = jnp.where(valid, x.astype(jnp.float32), 0.0).reshape(-1)
    return jax.ops.segment_sum(vals, flat, num_segments=b * t + 1)[: b * t].reshape(b, t)


def per_turn_max(x: Array, turn_ids: Array, mask: Array) -> Array:
    """Max of an int array over the masked tokens of each turn (min int where a turn is empty)."""
    b, t = x.shape
    valid = mask & (turn_ids >= 0) & (turn_ids < t)
    flat = jnp.where(valid, jnp.arange(b)[:, None] * t + turn_ids, b * t).reshape(-1)
    out = jax.ops.segment_max(x.reshape(-1), flat, num_segments=b * t + 1)
    return out[: b * t].reshape(b, t)


def turn_to_tokens(per_turn: Array, turn_ids: Array, mask: Array) -> Array:
    """Broadcasts a per-turn value to the masked tokens of that turn; zero elsewhere."""
    k = per_turn.shape[1]
    valid = mask & (turn_ids >= 0) & (turn_ids < k)
    vals = jnp.take_along_axis(per_turn, jnp.clip(turn_ids, 0, k - 1), axis=1)
    return jnp.where(valid, vals, 0.0)


def last_true(mask: Array) -> Array:
    """One-hot of the last True position of each row (all False for a row with none)."""
    t = mask.shape[1]
    idx = jnp.where(mask, jnp.arange(t)[None, :], -1).max(axis=1)
    return (jnp.arange(t)[None, :] == idx[:, None]) & mask


def reverse_discounted_sum(rewards: Array, active: Array, gamma: float) -> Array:
    """Discounted suffix sums over active positions only (inactive ones are skipped, not steps).

    out[b, i] = sum_{j >= i, active} gamma^(#active positions in (i, j]) * rewards[b, j]
    for active i; inactive positions hold 0. One reverse ``lax.scan`` over N.
    """

    def step(carry, xs):
        r, a = xs
        g = jnp.where(a, r + gamma * carry, carry)
        return g, jnp.where(a, g, 0.0)

    init = jnp.zeros(rewards.shape[:1], jnp.float32)
    xs = (jnp.where(active, rewards.astype(jnp.float32), 0.0).T, active.T)
    _, out = jax.lax.scan(step, init, xs, reverse=True)
    return out.T
