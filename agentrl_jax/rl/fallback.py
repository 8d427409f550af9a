"""Host-side precision fallback: after N non-finite steps in a row, train under another dtype
policy for a while, then switch back.

This tells a precision problem (fp8/bf16 overflow: the fallback steps are finite) apart from an
algorithmic one (they are not). The update functions are built lazily per policy and cached, so
switching back does not recompile.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from agentrl_jax.precision import DTypePolicy, get_policy
from agentrl_jax.rl.state import RLConfig

log = logging.getLogger(__name__)


class FallbackController:
    """Wraps update functions and switches dtype policy on runs of non-finite steps.

    Args:
      build: ``policy -> update_fn`` (e.g. ``lambda p: make_update_fn(model, cfg, p, meta)``).
      rl_cfg: supplies ``max_consecutive_nonfinite`` (0 disables), ``fallback_policy`` and
        ``fallback_steps``.
      policy: the primary dtype policy.

    Call it like an update function: ``state, metrics = controller(state, batch, rng)``; metrics
    gain ``fallback_active`` (1.0 while the fallback policy is used). ``events`` lists
    ``(call index, 'fallback' | 'primary', policy name)`` for every switch.
    """

    def __init__(
        self,
        build: Callable[[DTypePolicy], Callable],
        rl_cfg: RLConfig,
        policy: DTypePolicy,
    ):
        self._build = build
        self._fns: dict[str, Callable] = {}
        self.cfg = rl_cfg
        self.primary = policy
        self.fallback = get_policy(rl_cfg.fallback_policy, kernel_impl=policy.kernel_impl)
        self.active = policy
        self.consecutive = 0
        self.remaining = 0
        self.calls = 0
        self.events: list[tuple[int, str, str]] = []

    @property
    def in_fallback(self) -> bool:
        return self.active is not self.primary

    def update_fn(self) -> Callable:
        """The update function of the currently active policy (built on first use)."""
        name = self.active.name
        if name not in self._fns:
            self._fns[name] = self._build(self.active)
        return self._fns[name]

    def observe(self, skipped: bool) -> str | None:
        """Records one step's outcome; returns 'fallback' / 'primary' when it switches."""
        self.calls += 1
        event = None
        if self.in_fallback:
            self.remaining -= 1
            if self.remaining <= 0:
                self.active, self.consecutive = self.primary, 0
                event = "primary"
        else:
            self.consecutive = self.consecutive + 1 if skipped else 0
            limit = self.cfg.max_consecutive_nonfinite
            if limit > 0 and self.consecutive >= limit and self.fallback != self.primary:
                self.active, self.remaining = self.fallback, self.cfg.fallback_steps
                event = "fallback"
        if event is not None:
            self.events.append((self.calls, event, self.active.name))
            if event == "fallback":
                log.warning(
                    "%d non-finite steps in a row under %r: switching to %r for %d steps",
                    self.consecutive,
                    self.primary.name,
                    self.active.name,
                    self.cfg.fallback_steps,
                )
            else:
                log.warning("fallback over: back to %r", self.active.name)
        return event

    def __call__(self, state, batch, rng=None):
        fallback_active = float(self.in_fallback)
        state, metrics = self.update_fn()(state, batch, rng)
        self.observe(bool(metrics["skipped"] > 0))
        metrics = dict(metrics)
        metrics["fallback_active"] = fallback_active
        return state, metrics
