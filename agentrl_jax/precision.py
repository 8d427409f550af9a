"""Dtype policies: one frozen object fixes every dtype the model, sampler and trainer use.

The sampler and the trainer receive the *same* policy object, so the numbers a rollout samples
from are the numbers training differentiates. A policy that lets them differ says so in its name
and is measured by the mismatch metrics (``agentrl_jax.rl.mismatch``).

Presets (``get_policy(name)``) name dtypes only; the other choices a policy carries are not
part of a preset: ``parity`` follows from the name (the ``-parity`` presets, :func:`parity_of`),
the kernel choices are the experiment's ``kernel_impl`` key (every attention op) and its
``kernels`` section (one op each: ``get_policy(name, kernel_impl=..., kernels=...)``, resolved
by ``kernels.select.TABLE`` through :meth:`DTypePolicy.kernel_choice`);
:meth:`DTypePolicy.describe` says them all and where each came from (the run's log prints it).
  fp32          everything fp32.
  bf16          fp32 params, bf16 matmul inputs, fp32 accumulation, fp32 softmax/router/logits.
  fp8           like bf16, but matmul inputs are quantised to float8_e4m3fn with per-tensor
                scales (emulated: the fp8 values are upcast for the dot, so every backend gives
                the same numbers; hardware fp8 units are a later optimisation).
  fp32-parity   fp32, and training recomputes logprobs with the rollout's chunk function so the
  bf16-parity   bf16,  sampler's and trainer's logprobs are bitwise equal (see rollout/).
  bf16-int8kv   bf16 with an int8 KV cache (per-page, per-head scales): every completed F/D page
                is int8 round-tripped in the rollout cache (simulated in bf16 buffers, see
                ``model.kv_quant``); training's teacher-forced pass does not quantise (measured
                mismatch, not a parity policy).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from agentrl_jax.kernels import ATTENTION_OPS, check_impl

_DTYPES = {
    "float32": jnp.float32,
    "bfloat16": jnp.bfloat16,
    "float16": jnp.float16,
    "float8_e4m3fn": jnp.float8_e4m3fn,
    "int8": jnp.int8,
}
FP8_MAX = 448.0  # largest finite float8_e4m3fn
DTYPE_FIELDS = (
    "param_dtype",
    "compute_dtype",
    "accum_dtype",
    "attn_dtype",
    "router_dtype",
    "logits_dtype",
    "kv_cache_dtype",
)


def _dtype_name(x) -> str:
    return jnp.dtype(x).name


@dataclasses.dataclass(frozen=True)
class DTypePolicy:
    """Every dtype choice of a run. Dtypes are stored as names so the policy is hashable/static.

    Attributes:
      name: preset name (appears in logs and benchmark lines).
      param_dtype: dtype parameters are stored (and optimised) in.
      compute_dtype: dtype of activations and matmul inputs.
      accum_dtype: ``preferred_element_type`` of matmuls (accumulation).
      attn_dtype: dtype of attention logits and softmax.
      router_dtype: dtype of MoE router logits and routing probabilities.
      logits_dtype: dtype of vocabulary logits and logprobs; always float32.
      kv_cache_dtype: dtype of cached keys/values ('int8' means per-page-per-head scales).
      fp8_matmul: quantise matmul inputs to float8_e4m3fn with per-tensor scales.
      kernel_impl: 'auto' | 'xla' | 'pallas' for the attention ops (``kernels.ATTENTION_OPS``;
        no preset sets it: the experiment's ``kernel_impl`` key does).
      kernels: per-op choices ``((op, impl), ...)`` that override ``kernel_impl`` (any op of
        ``kernels.OPS``, any of its impls); given as a mapping, kept sorted without the 'auto'
        entries (the experiment's ``kernels`` section).
      parity: training recomputes logprobs through the rollout's chunk function
        (bitwise rollout/train agreement at some cost in speed); a preset's follows from its
        name (:func:`parity_of`).
    """

    name: str = "fp32"
    param_dtype: str = "float32"
    compute_dtype: str = "float32"
    accum_dtype: str = "float32"
    attn_dtype: str = "float32"
    router_dtype: str = "float32"
    logits_dtype: str = "float32"
    kv_cache_dtype: str = "float32"
    fp8_matmul: bool = False
    kernel_impl: str = "auto"
    kernels: tuple[tuple[str, str], ...] = ()
    parity: bool = False

    def __post_init__(self):
        for field in DTYPE_FIELDS:
            value = getattr(self, field)
            if value not in _DTYPES:
                raise ValueError(f"DTypePolicy.{field}={value!r}; allowed: {sorted(_DTYPES)}")
        if self.logits_dtype != "float32":
            raise ValueError(
                f"DTypePolicy.logits_dtype must be 'float32', got {self.logits_dtype!r}"
            )
        if self.kernel_impl not in ("auto", "xla", "pallas"):
            raise ValueError(
                f"DTypePolicy.kernel_impl={self.kernel_impl!r}; allowed: 'auto', 'xla', 'pallas'"
            )
        pairs = dict(self.kernels)
        for op, impl in pairs.items():
            try:
                check_impl(op, impl)
            except ValueError as e:
                raise ValueError(f"DTypePolicy.kernels: {e}") from None
        chosen = tuple(sorted((op, impl) for op, impl in pairs.items() if impl != "auto"))
        object.__setattr__(self, "kernels", chosen)

    def kernel_choice(self, op: str) -> str:
        """The impl asked for ``op`` ('auto' or a name of ``kernels.OP_IMPLS[op]``): its entry
        in ``kernels``, else ``kernel_impl`` for an attention op, else 'auto'."""
        chosen = dict(self.kernels).get(op, "auto")
        if chosen == "auto" and op in ATTENTION_OPS:
            return self.kernel_impl
        return chosen

    # Dtype objects -------------------------------------------------------------------------
    @property
    def param(self):
        return _DTYPES[self.param_dtype]

    @property
    def compute(self):
        return _DTYPES[self.compute_dtype]

    @property
    def accum(self):
        return _DTYPES[self.accum_dtype]

    @property
    def attn(self):
        return _DTYPES[self.attn_dtype]

    @property
    def router(self):
        return _DTYPES[self.router_dtype]

    @property
    def logits(self):
        return _DTYPES[self.logits_dtype]

    @property
    def kv_cache(self):
        return _DTYPES[self.kv_cache_dtype]

    def replace(self, **changes) -> DTypePolicy:
        return dataclasses.replace(self, **changes)

    def describe(self) -> str:
        """One line for the run's log: the dtypes, then parity and the kernel choices with where
        each comes from (``parity`` follows from the preset's name, ``kernel_impl`` is the
        experiment's ``kernel_impl`` key, per-op choices its ``kernels`` section; ``'auto'``
        leaves each op to ``kernels.select.TABLE``; ``model.dispatch.describe`` says what
        they resolve to)."""
        dtypes = ", ".join(f"{f.removesuffix('_dtype')}={getattr(self, f)}" for f in DTYPE_FIELDS)
        fp8 = ", fp8 matmul inputs" if self.fp8_matmul else ""
        ops = ", ".join(f"{op}={impl!r}" for op, impl in self.kernels)
        per_op = f"; kernels {ops} (the kernels section)" if ops else ""
        return (
            f"dtype policy {self.name!r}: {dtypes}{fp8}; parity={self.parity} (from the policy "
            f"name); kernel_impl={self.kernel_impl!r} (the kernel_impl key){per_op}"
        )

    # Matmul ---------------------------------------------------------------------------------
    def einsum(self, subscripts: str, x: jax.Array, w: jax.Array) -> jax.Array:
        """``jnp.einsum`` of activation ``x`` and weight ``w`` under this policy.

        Inputs are cast to the compute dtype (or quantised to fp8 with per-tensor scales),
        accumulated in ``accum`` and returned in the compute dtype.
        """
        if self.fp8_matmul:
            xq, sx = quantize_fp8(x)
            wq, sw = quantize_fp8(w)
            y = weight_einsum(
                subscripts,
                xq.astype(self.compute),
                wq.astype(self.compute),
                preferred_element_type=self.accum,
            )
            return (y * (sx * sw).astype(self.accum)).astype(self.compute)
        return weight_einsum(
            subscripts,
            x.astype(self.compute),
            w.astype(self.compute),
            preferred_element_type=self.accum,
            out_dtype=self.compute,
        )


def matmul_form(xs: str, ws: str, out: str) -> tuple[int, bool] | None:
    """``(batch axes, w transposed)`` when ``xs,ws->out`` reads ``<batch><c>,<c><out>`` or
    ``<batch><c>,<out><c>`` -> ``<batch><out>`` with distinct letters; else None."""
    for n_c in range(1, min(len(xs), len(ws)) + 1):
        batch, c = xs[:-n_c], xs[-n_c:]
        for transposed, rest in ((False, ws[n_c:]), (True, ws[:-n_c])):
            letters = xs + rest
            if (
                batch
                and ws == (rest + c if transposed else c + rest)
                and out == batch + rest
                and len(set(letters)) == len(letters)
            ):
                return len(batch), transposed
    return None


def weight_einsum(
    subscripts: str, x: jax.Array, w: jax.Array, *, out_dtype=None, **kwargs
) -> jax.Array:
    """``jnp.einsum`` that runs an activation-times-weight contraction as one 2-D matmul.

    When ``subscripts`` reads ``<batch><contract>,<contract><out>-><batch><out>`` (e.g.
    ``BTD,DNH->BTNH``, ``BTNH,NHD->BTD``) or ``<batch><contract>,<out><contract>`` (a tied
    unembedding ``BTD,VD->BTV``), ``x`` is reshaped to [prod(batch), prod(contract)] and ``w``
    to [prod(contract), prod(out)] (or its transpose): the same products and sums, but XLA CPU's
    gradient of the 3-D form transposes and copies its operands, which makes it several times
    slower (docs/results.md has the measurement). Any other form goes to ``jnp.einsum``
    unchanged. The parsing runs at trace time only.
    ``out_dtype`` casts the result (inside the matmul's hand-written gradient, whose backward
    matmuls then read the cotangent in that dtype: bf16 in, f32 accumulated, as the forward).
    """
    ins, out = subscripts.replace(" ", "").split("->")
    xs, ws = ins.split(",")
    form = matmul_form(xs, ws, out)
    if form is None:
        y = jnp.einsum(subscripts, x, w, **kwargs)
        return y if out_dtype is None else y.astype(out_dtype)
    n_b, transposed = form
    n_c = x.ndim - n_b
    x2 = x.reshape(-1, math.prod(x.shape[n_b:]))
    if transposed:
        w2 = w.reshape(-1, x2.shape[1])
        tail = w.shape[: w.ndim - n_c]
    else:
        w2 = w.reshape(x2.shape[1], -1)
        tail = w.shape[n_c:]
    pet = kwargs.get("preferred_element_type")
    narrow = pet is not None and jnp.dtype(pet).itemsize > max(x.dtype.itemsize, w.dtype.itemsize)
    if narrow and set(kwargs) == {"preferred_element_type"}:
        # bf16 (or narrower) operands accumulated wider: the hand-written gradient below
        out = None if out_dtype is None else jnp.dtype(out_dtype)
        y = _matmul(x2, w2, transposed, jnp.dtype(pet), out)
    else:
        y = jnp.einsum("mk,nk->mn" if transposed else "mk,kn->mn", x2, w2, **kwargs)
        y = y if out_dtype is None else y.astype(out_dtype)
    return y.reshape(*x.shape[:n_b], *tail)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _matmul(x, w, transposed: bool, accum, out):
    """[m, k] x [k, n] (or x [n, k]^T when ``transposed``) -> [m, n], accumulated in ``accum``.

    Differentiated by hand so that the weight gradient x^T g is a matmul XLA CPU runs fast: as
    autodiff writes it (contracting dimension 0 of both operands) XLA CPU upcasts bf16 operands
    to f32 and leaves its fast matmul library for a slower generic dot; with a leading unit
    batch axis it transposes x once and runs the library matmul in the operands' dtype, about
    2.5x faster for bf16. The same products and f32 sums; only the summation order differs.
    Used for operands narrower than the accumulation only: with fp32 operands the hand-written
    form makes the whole update step slower, so autodiff is kept (docs/results.md has both
    measurements).
    """
    return _matmul_fwd(x, w, transposed, accum, out)[0]


def _matmul_fwd(x, w, transposed, accum, out):
    y = jnp.einsum("mk,nk->mn" if transposed else "mk,kn->mn", x, w, preferred_element_type=accum)
    return (y if out is None else y.astype(out)), (x, w)


def _matmul_bwd(transposed, accum, out, res, g):
    x, w = res
    dx = jnp.einsum("mn,nk->mk" if transposed else "mn,kn->mk", g, w, preferred_element_type=accum)
    # The weight gradient contracts the m rows with a leading unit axis and the weight's own
    # layout as output. (Transposing the einsum's result instead lets XLA fold the transpose
    # into a bf16 dot that its fallback DotThunk cannot run: "Unsupported element type".)
    if transposed:
        dw = jnp.einsum("umn,umk->nk", g[None], x[None], preferred_element_type=accum)
    else:
        dw = jnp.einsum("umk,umn->kn", x[None], g[None], preferred_element_type=accum)
    return dx.astype(x.dtype), dw.astype(w.dtype)


_matmul.defvjp(_matmul_fwd, _matmul_bwd)


def quantize_fp8(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per-tensor symmetric float8_e4m3fn quantisation: returns (x_q, scale), x ~ x_q * scale."""
    amax = jnp.max(jnp.abs(x.astype(jnp.float32)))
    scale = jnp.maximum(amax, 1e-12) / FP8_MAX
    xq = (x.astype(jnp.float32) / scale).astype(jnp.float8_e4m3fn)
    return xq, jax.lax.stop_gradient(scale)


# The presets: ``DTYPE_FIELDS`` and ``fp8_matmul`` only (parity and kernels are not theirs).
_BF16 = {"compute_dtype": "bfloat16", "kv_cache_dtype": "bfloat16"}
_PRESETS: dict[str, dict] = {
    "fp32": {},
    "bf16": _BF16,
    "fp8": {**_BF16, "fp8_matmul": True},
    "fp32-parity": {},
    "bf16-parity": _BF16,
    "bf16-int8kv": {"compute_dtype": "bfloat16", "kv_cache_dtype": "int8"},
}
PARITY_SUFFIX = "-parity"


def policy_names() -> list[str]:
    """Names accepted by :func:`get_policy`."""
    return sorted(_PRESETS)


def parity_of(name: str) -> bool:
    """Whether the preset ``name`` trains through the rollout's chunk function: the
    ``-parity`` presets do (bitwise sampler/trainer logprobs), the others do not."""
    return name.endswith(PARITY_SUFFIX)


def get_policy(name: str | DTypePolicy, **overrides) -> DTypePolicy:
    """Returns the preset policy ``name`` (optionally with fields replaced): the preset's dtypes,
    ``parity`` from its name (:func:`parity_of`) and the default kernel choices; an override
    replaces any of them (``kernel_impl=`` and ``kernels=`` are how an experiment's
    ``kernel_impl`` key and ``kernels`` section reach the policy).

    Raises:
      ValueError: unknown name or invalid override.
    """
    if isinstance(name, DTypePolicy):
        policy = name
    else:
        if name not in _PRESETS:
            raise ValueError(f"unknown dtype policy {name!r}; known: {policy_names()}")
        policy = DTypePolicy(name=name, parity=parity_of(name), **_PRESETS[name])
    if overrides:
        unknown = set(overrides) - {f.name for f in dataclasses.fields(DTypePolicy)}
        if unknown:
            raise ValueError(f"unknown DTypePolicy fields {sorted(unknown)}")
        policy = dataclasses.replace(policy, **overrides)
    return policy
