"""The loss mask aligned with the trainer's teacher-forced logprobs.

``agentrl_jax.model.chunked.sequence_logprobs`` returns ``logp[:, j] = log p(tokens[:, j + 1] |
tokens[:, :j + 1])`` (shape [B, T-1]); per-token trajectory arrays are shifted with ``x[:, 1:]``
to line up with it, and :func:`target_mask` is the mask of the entries a loss trains on.
"""

from __future__ import annotations

import jax


def target_mask(action_mask: jax.Array, valid: jax.Array | None = None) -> jax.Array:
    """Loss mask aligned with ``model.chunked.sequence_logprobs``: bool [B, T] -> bool [B, T-1].

    Entry j is True when token j+1 is a (valid) action token, i.e. logp[:, j] is trained on.
    """
    m = action_mask.astype(bool)
    if valid is not None:
        m = m & valid.astype(bool)
    return m[:, 1:]
