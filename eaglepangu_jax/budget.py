"""BASTION's hardware-aware budget controller: roofline verify latency and the stopping rule.

A verify forward over ``s`` new tokens with ``c`` cached ones costs, on a roofline,
``T(s, c) = max(a_c FLOPs/F + b_c, a_m Bytes/BW + b_m)``: compute-bound or memory-bound,
whichever is slower, with per-regime efficiency ``a`` and fixed overhead ``b`` fitted on
measured timings (:func:`calibrate`). One speculation round costs
``C(n) = t_draft + t_other + T_verify(n)`` for a tree of ``n`` draft nodes; the controller picks
the ``n`` that maximises accepted tokens per second ``A(n) / C(n)`` along best-first order
(:func:`choose_budget`). Timings drift (thermal state, other tenants, context growth), so
:class:`OnlineCalibration` keeps a per-regime multiplicative correction, updated after every
round by an exponential moving average of observed / predicted time.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Float, Int

__all__ = [
    "Scalar",
    "NOMINAL_PEAK_FLOPS",
    "NOMINAL_BANDWIDTH",
    "Roofline",
    "Calibration",
    "latency",
    "verify_latencies",
    "calibrate",
    "choose_budget",
    "OnlineCalibration",
    "corrected_latency",
    "observe",
]

Scalar = Float[ArrayLike, "..."]

# Nominal figures of this project's reference host (2 CPU cores: f32 matmul throughput and
# memory read bandwidth), for the uncalibrated roofline used until a calibration exists.
NOMINAL_PEAK_FLOPS = 165e9
NOMINAL_BANDWIDTH = 24e9


@dataclasses.dataclass(frozen=True, kw_only=True)
class Roofline:
    """Static model and hardware figures for the roofline cost of one forward.

    Attributes:
      num_layers: ``L``.
      hidden: ``h``, residual width.
      q_width: ``h_q``, query projection width (heads x head dim).
      kv_width: ``h_kv``, key (= value) projection width.
      ffn: ``f``, MLP inner width.
      vocab: ``V``.
      bytes_per_param: ``b``, bytes per weight, KV entry and activation element.
      peak_flops: ``F``, FLOP/s.
      bandwidth: ``BW``, bytes/s.
    """

    num_layers: int
    hidden: int
    q_width: int
    kv_width: int
    ffn: int
    vocab: int
    bytes_per_param: float
    peak_flops: float
    bandwidth: float

    def __post_init__(self):
        for f in dataclasses.fields(self):
            if not getattr(self, f.name) > 0:
                raise ValueError(f"Roofline.{f.name} must be > 0, got {getattr(self, f.name)}")

    @classmethod
    def for_llama(
        cls, config: Any, *, peak_flops: float, bandwidth: float, bytes_per_param: float = 4
    ) -> "Roofline":
        """The roofline of a Llama-style config on hardware with the given peaks.

        ``config`` is any object with ``num_layers``, ``hidden_size``, ``q_width``,
        ``kv_width``, ``intermediate_size`` and ``vocab_size`` (a
        :class:`~eaglepangu_jax.models.config.LlamaConfig`); the core does not import the
        models layer.
        """
        return cls(
            num_layers=config.num_layers,
            hidden=config.hidden_size,
            q_width=config.q_width,
            kv_width=config.kv_width,
            ffn=config.intermediate_size,
            vocab=config.vocab_size,
            bytes_per_param=bytes_per_param,
            peak_flops=peak_flops,
            bandwidth=bandwidth,
        )

    def flops(self, s: Scalar, c: Scalar) -> Float[Array, "..."]:
        """FLOPs of one forward over ``s`` new tokens attending to ``c`` cached ones.

        ``L[2sh h_q + 4sh h_kv + 4s(c+s)h_q + 2s h_q h + 6shf] + 2shV``: projections, attention
        scores and values, output projection, gated MLP, lm head.
        """
        s, c = _f32(s), _f32(c)
        h, hq, hkv, f = self.hidden, self.q_width, self.kv_width, self.ffn
        per_layer = (
            2 * s * h * hq + 4 * s * h * hkv + 4 * s * (c + s) * hq + 2 * s * hq * h + 6 * s * h * f
        )
        return self.num_layers * per_layer + 2 * s * h * self.vocab

    def bytes(self, s: Scalar, c: Scalar) -> Float[Array, "..."]:
        """Bytes moved by one forward over ``s`` new tokens with ``c`` cached.

        ``b[2Vh + L(2h h_q + 2h h_kv + 3hf)]`` (weights, embedding and head counted apart)
        ``+ b L(2c h_kv + 2s h_kv)`` (KV cache read, new KV written) ``+ activations``.

        Activations (our choice): each intermediate tensor written once per token, i.e.
        ``b s [L(2h + 2h_q + 2h_kv + 2f) + V]`` for residual in/out, q, attention output, k, v,
        the MLP gate and up products, and the logits; fused reads are free. At small ``s`` this
        is negligible next to the weights, and it makes large trees (logits ``s x V``) cost
        what they cost.
        """
        s, c = _f32(s), _f32(c)
        h, hq, hkv, f, v, L = (
            self.hidden,
            self.q_width,
            self.kv_width,
            self.ffn,
            self.vocab,
            self.num_layers,
        )
        b = self.bytes_per_param
        weights = b * (2 * v * h + L * (2 * h * hq + 2 * h * hkv + 3 * h * f))
        kv = b * L * (2 * c * hkv + 2 * s * hkv)
        activations = b * s * (L * (2 * h + 2 * hq + 2 * hkv + 2 * f) + v)
        return weights + kv + activations

    def regime_times(self, s: Scalar, c: Scalar) -> tuple[Float[Array, "..."], Float[Array, "..."]]:
        """Ideal ``(FLOPs / F, Bytes / BW)`` in seconds, the regressors of the calibration."""
        return self.flops(s, c) / self.peak_flops, self.bytes(s, c) / self.bandwidth


def _f32(x: Scalar) -> Float[Array, "..."]:
    return jnp.asarray(x, jnp.float32)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Calibration:
    """Fitted roofline coefficients, all ``>= 0`` (``a``: slowdown vs peak, ``b``: seconds)."""

    a_c: Float[Array, ""]  # compute-branch slope
    b_c: Float[Array, ""]  # compute-branch overhead, seconds
    a_m: Float[Array, ""]  # memory-branch slope
    b_m: Float[Array, ""]  # memory-branch overhead, seconds

    @classmethod
    def ideal(cls) -> "Calibration":
        """The uncalibrated roofline: peaks reached, no overhead."""
        one, zero = jnp.float32(1.0), jnp.float32(0.0)
        return cls(a_c=one, b_c=zero, a_m=one, b_m=zero)


def latency(roofline: Roofline, calib: Calibration, s: Scalar, c: Scalar) -> Float[Array, "..."]:
    """Predicted seconds of one forward over ``s`` new tokens with ``c`` cached (jittable)."""
    compute, memory = _branches(roofline, calib, s, c)
    return jnp.maximum(compute, memory)


def _branches(roofline, calib, s, c):
    x_c, x_m = roofline.regime_times(s, c)
    return calib.a_c * x_c + calib.b_c, calib.a_m * x_m + calib.b_m


def verify_latencies(
    roofline: Roofline, calib: Calibration, context: Scalar, *, max_nodes: int
) -> Float[Array, " N+1"]:
    """``[max_nodes + 1]`` table: entry ``n`` = verifying the root plus ``n`` nodes.

    This is the ``verify_latency`` argument of :func:`choose_budget`.
    """
    s = jnp.arange(1, max_nodes + 2, dtype=jnp.float32)
    return latency(roofline, calib, s, context)


# ------------------------------------------------------------------ calibration (host side)


def _nnls_line(x: np.ndarray, t: np.ndarray) -> tuple[float, float, float]:
    """``min ||a x + b - t||^2`` with ``a, b >= 0``; returns ``(a, b, sse)``.

    A convex problem in two variables: the optimum is the unconstrained one when feasible,
    else the best optimum of a boundary face (``a = 0`` or ``b = 0``), each in closed form.
    """
    candidates = [(0.0, 0.0)]
    if len(x):
        candidates.append((0.0, max(float(t.mean()), 0.0)))
        xx = float(x @ x)
        if xx > 0:
            candidates.append((max(float(x @ t) / xx, 0.0), 0.0))
    if len(x) >= 2 and np.ptp(x) > 0:
        a, b = np.polyfit(x, t, 1)
        if a >= 0 and b >= 0:
            candidates.append((float(a), float(b)))
    scored = [(a, b, float(np.sum((a * x + b - t) ** 2))) for a, b in candidates]
    return min(scored, key=lambda abs_: abs_[2])


def _fit_split(x_c, x_m, t, is_compute):
    a_c, b_c, _ = _nnls_line(x_c[is_compute], t[is_compute])
    a_m, b_m, _ = _nnls_line(x_m[~is_compute], t[~is_compute])
    pred_c, pred_m = a_c * x_c + b_c, a_m * x_m + b_m
    sse = float(np.sum((np.maximum(pred_c, pred_m) - t) ** 2))
    return (a_c, b_c, a_m, b_m), sse, pred_c > pred_m


def calibrate(
    roofline: Roofline,
    samples: Iterable[tuple[float, float, float]] | ArrayLike,
    *,
    max_iters: int = 50,
) -> Calibration:
    """Fit ``a_c, b_c, a_m, b_m >= 0`` to measured ``(s, c, seconds)`` points (host, numpy).

    ``max(line_c, line_m)`` is fitted by assigning each point to the branch that binds there
    and fitting each branch by non-negative least squares on its own points. The assignment
    starts from every split of the points sorted by arithmetic intensity (FLOPs / Bytes: the
    compute branch binds at high intensity), keeps the split of least squared error, then
    alternates (reassign each point to the branch the fit says binds, refit) until the
    assignment stops changing. A branch with no points gets ``a = b = 0`` (it never binds).

    Args:
      roofline: the model and hardware figures.
      samples: ``[M, 3]`` rows of (new tokens ``s``, cached tokens ``c``, seconds).
      max_iters: bound on the alternation rounds.

    Returns:
      A :class:`Calibration` of float32 scalars.
    """
    data = np.asarray(samples, np.float64)
    if data.ndim != 2 or data.shape[1] != 3 or data.shape[0] < 1:
        raise ValueError(f"samples must be rows of (s, c, seconds), got shape {data.shape}")
    if not np.all(np.isfinite(data)) or np.any(data < 0):
        raise ValueError("samples must be finite and non-negative")
    s, c, t = data.T
    x_c, x_m = (np.asarray(v, np.float64) for v in roofline.regime_times(s, c))
    order = np.argsort(x_c / x_m, kind="stable")
    best = None
    for split in range(len(t) + 1):
        is_compute = np.zeros(len(t), bool)
        is_compute[order[split:]] = True
        fit = _fit_split(x_c, x_m, t, is_compute)
        if best is None or fit[1] < best[1]:
            best = fit
    coeffs, sse, assign = best
    for _ in range(max_iters):
        new_coeffs, new_sse, new_assign = _fit_split(x_c, x_m, t, assign)
        if new_sse >= sse:
            break
        coeffs, sse = new_coeffs, new_sse
        if np.array_equal(new_assign, assign):
            break
        assign = new_assign
    return Calibration(*(jnp.float32(v) for v in coeffs))


# ------------------------------------------------------------------ the stopping rule


def choose_budget(
    sorted_logscores: Float[ArrayLike, " N"],
    verify_latency: Float[ArrayLike, " N+1"],
    t_draft: Scalar,
    t_other: Scalar,
) -> Int[Array, ""]:
    """Node count ``n`` at the global maximum of ``S(n) = A(n) / C(n)`` (jittable).

    ``A(n) = 1 + sum_{i<n} exp(sorted_logscores[i])`` (expected tokens a round emits) and
    ``C(n) = t_draft + t_other + verify_latency[n]`` (its seconds). Ties go to the smaller
    ``n``. A smooth convex cost would make the first local maximum the global one (``A`` is
    concave along best-first order), but the engine's verify cost is a staircase of slot
    buckets: adding the 4th node moves the round from the 4-slot to the 8-slot forward, which
    one node alone rarely pays for while four more do. Stopping at the first local maximum
    kept the n-gram drafter at 3 nodes on text that accepts 4 to 6 per round.

    Args:
      sorted_logscores: ``[N]`` path log-scores of the best-first nodes, non-increasing (the
        tree's ``logscore[1:]``). NaN counts as ``-inf`` (a node worth nothing).
      verify_latency: ``[N + 1]`` seconds to verify the root plus ``n`` nodes. A non-finite
        entry stops the growth there: ``n`` stays below it.
      t_draft: seconds spent drafting per round.
      t_other: other per-round seconds (sampling, cache commit, host sync).

    Returns:
      int32 ``n`` in ``[0, N]``.
    """
    logs = jnp.asarray(sorted_logscores, jnp.float32)
    verify = jnp.asarray(verify_latency, jnp.float32)
    if logs.ndim != 1 or verify.shape != (logs.shape[0] + 1,):
        raise ValueError(
            f"verify_latency must have shape [N + 1] = ({logs.shape[-1] + 1},) "
            f"for N = {logs.shape[-1]} scores, got {verify.shape}"
        )
    rho = jnp.exp(jnp.where(jnp.isnan(logs), -jnp.inf, logs))
    accept = jnp.concatenate([jnp.ones((1,), jnp.float32), 1.0 + jnp.cumsum(rho)])
    cost = _f32(t_draft) + _f32(t_other) + verify
    usable = jnp.cumprod((jnp.isfinite(cost) & (cost > 0)).astype(jnp.int32)).astype(bool)
    # n = 0 stays a candidate whatever its cost: a plain step is always possible.
    usable = usable.at[0].set(True)
    speed = jnp.where(usable, accept / jnp.where(usable, cost, 1.0), -jnp.inf)
    speed = jnp.where(jnp.isnan(speed), -jnp.inf, speed)
    return jnp.argmax(speed).astype(jnp.int32)


# ------------------------------------------------------------------ online correction


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class OnlineCalibration:
    """A calibration plus one multiplicative correction per regime, tracked online.

    ``corrected = max(scale_c * compute_branch, scale_m * memory_branch)``. After each round,
    :func:`observe` finds the branch that binds under the corrected model and moves its scale
    toward ``observed / branch`` by an exponential moving average; the other scale is untouched.
    If the truth is the calibration scaled by ``k_c`` and ``k_m``, the scales converge to them.
    """

    roofline: Roofline = dataclasses.field(metadata=dict(static=True))
    calib: Calibration
    scale_c: Float[Array, ""]  # compute-branch correction
    scale_m: Float[Array, ""]  # memory-branch correction
    count_c: Int[Array, ""]  # observations attributed to each branch so far
    count_m: Int[Array, ""]

    @classmethod
    def create(cls, roofline: Roofline, calib: Calibration) -> "OnlineCalibration":
        """Start with no correction (both scales 1)."""
        one, zero = jnp.float32(1.0), jnp.int32(0)
        return cls(
            roofline=roofline, calib=calib, scale_c=one, scale_m=one, count_c=zero, count_m=zero
        )


def corrected_latency(state: OnlineCalibration, s: Scalar, c: Scalar) -> Float[Array, "..."]:
    """Predicted seconds with the online corrections applied (jittable)."""
    compute, memory = _branches(state.roofline, state.calib, s, c)
    return jnp.maximum(state.scale_c * compute, state.scale_m * memory)


def observe(
    state: OnlineCalibration, s: Scalar, c: Scalar, seconds: Scalar, decay: Scalar = 0.9
) -> OnlineCalibration:
    """Fold one measured forward (``s`` new, ``c`` cached tokens, ``seconds``) into the state.

    ``decay`` in ``[0, 1)`` is the weight kept by the old scale. A non-finite or non-positive
    measurement, or a branch that predicts 0 seconds, leaves the state unchanged.
    """
    compute, memory = _branches(state.roofline, state.calib, s, c)
    on_compute = state.scale_c * compute >= state.scale_m * memory
    branch = jnp.where(on_compute, compute, memory)
    seconds = _f32(seconds)
    ok = jnp.isfinite(seconds) & (seconds > 0) & (branch > 0)
    ratio = seconds / jnp.where(ok, branch, 1.0)
    decay = _f32(decay)

    def ema(scale, mine):
        return jnp.where(ok & mine, decay * scale + (1.0 - decay) * ratio, scale)

    return dataclasses.replace(
        state,
        scale_c=ema(state.scale_c, on_compute),
        scale_m=ema(state.scale_m, ~on_compute),
        count_c=state.count_c + (ok & on_compute).astype(jnp.int32),
        count_m=state.count_m + (ok & ~on_compute).astype(jnp.int32),
    )
