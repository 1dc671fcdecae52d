"""Soft distillation targets: the teacher's next-token distribution over the draft vocabulary.

The corpus holds the teacher's greedy answers, so a hard target is the teacher's top-1 only.
A draft trained on ``--soft-targets`` also matches the rest of the teacher's distribution (its
top ``K`` draft-vocabulary tokens, renormalised), the signal of knowledge distillation
(Hinton et al. 2015; for speculative drafts, DistillSpec, Zhou et al. 2023).

They cost no extra teacher pass: the cached features hold the residual stream leaving the
highest tapped layer ``f``, so running the teacher's layers ``f + 1 .. L - 1``, its final norm
and its head restricted to the draft vocabulary on them gives the teacher's own logits
(:func:`~eaglepangu_jax.models.llama.forward_residual`; two layers for SmolLM2's taps). The
features are stored in float16, so the logits are the teacher's up to that rounding. A row
that continues a longer sequence (``--row-overlap``) starts without its earlier context in
those top layers: its targets are approximate there.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from eaglepangu_jax import cache as cache_lib
from eaglepangu_jax import mask as mask_lib
from eaglepangu_jax.models import llama
from eaglepangu_jax.models.config import LlamaConfig

__all__ = ["teacher_top", "top_logits", "row_soft_targets", "soft_targets"]


def teacher_top(
    params: dict, config: LlamaConfig, below: int, d2t: Int[Array, " Vd"]
) -> tuple[dict, LlamaConfig]:
    """The teacher's layers above layer ``below``, its final norm and its head over the draft
    vocabulary ``d2t``, as prepared params, and the config to run them with
    (:func:`top_logits`; when ``below`` is the last layer there are none to run)."""
    if not 0 <= below < config.num_layers:
        raise ValueError(f"layer {below} is not one of the teacher's {config.num_layers}")
    params = params if llama.is_prepared(params) else llama.prepare_params(params)
    head = params["lm_head"][:, jnp.asarray(d2t, jnp.int32)]
    top = {
        "layers": tuple(params["layers"][below + 1 :]),
        "final_norm": params["final_norm"],
        "lm_head": jnp.asarray(head, jnp.float32),
    }
    top = jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.float32), top)
    above = config.num_layers - 1 - below
    return top, dataclasses.replace(config, num_layers=above) if above else config


def top_logits(
    top: dict, config: LlamaConfig, residual: Float[Array, "T H"]
) -> Float[Array, "T Vd"]:
    """The teacher's draft-vocabulary logits of one causal sequence from the residual stream
    leaving the layer below ``top`` (:func:`teacher_top`)."""
    x = residual.astype(jnp.float32)
    if not top["layers"]:
        return llama.rms_norm(x, top["final_norm"], config.rms_norm_eps) @ top["lm_head"]
    t = x.shape[0]
    kv = cache_lib.init(config.num_layers, t, config.num_kv_heads, config.head_dim, jnp.float32)
    positions = jnp.arange(t, dtype=jnp.int32)
    logits, _, _ = llama.forward_residual(
        top, x, positions, kv, mask_lib.causal_mask(t, jnp.int32(0), t), config=config
    )
    return logits


@functools.partial(jax.jit, static_argnames=("config", "top_k"))
def row_soft_targets(
    top: dict, residual: Float[Array, "B T H"], *, config: LlamaConfig, top_k: int
) -> tuple[Int[Array, "B T K"], Float[Array, "B T K"]]:
    """Per position ``p`` of each causal row: the ``top_k`` draft ids of the teacher's law of
    token ``p + 1`` and their probabilities, renormalised to sum to one."""

    def one(x):
        logits = top_logits(top, config, x)
        score, ids = jax.lax.top_k(jax.nn.log_softmax(logits, axis=-1), top_k)
        return ids.astype(jnp.int32), jax.nn.softmax(score, axis=-1)

    return jax.vmap(one)(residual)


def soft_targets(
    features: np.ndarray,
    teacher_params: dict,
    teacher_config: LlamaConfig,
    feature_layers: Sequence[int],
    d2t: Any,
    *,
    top_k: int = 8,
    chunk: int = 8,
    progress: Callable[[int, int], None] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Soft targets of every row of ``features`` (``[N, T, F, H]``, tapped at
    ``feature_layers``): ``(ids [N, T, K] int32 draft ids, probs [N, T, K] float32)``.

    Raises:
      ValueError: ``top_k`` outside ``[1, draft vocabulary]``, or features that do not match
        ``feature_layers`` or the teacher's width.
    """
    d2t = np.asarray(d2t)
    if not 1 <= top_k <= d2t.shape[0]:
        raise ValueError(f"top_k must be in [1, {d2t.shape[0]}], got {top_k}")
    if features.ndim != 4 or features.shape[2:] != (
        len(feature_layers),
        teacher_config.hidden_size,
    ):
        raise ValueError(
            f"features must be [N, T, F={len(feature_layers)}, H={teacher_config.hidden_size}]; "
            f"got {features.shape}"
        )
    highest = int(np.argmax(feature_layers))
    top, config = teacher_top(teacher_params, teacher_config, feature_layers[highest], d2t)
    n = features.shape[0]
    ids = np.zeros(features.shape[:2] + (top_k,), np.int32)
    probs = np.zeros(features.shape[:2] + (top_k,), np.float32)
    for begin in range(0, n, chunk):
        rows = slice(begin, min(begin + chunk, n))
        block = jnp.asarray(features[rows, :, highest])
        if block.shape[0] < chunk:  # one compiled shape: pad the last chunk
            pad = jnp.zeros((chunk - block.shape[0],) + block.shape[1:], block.dtype)
            block = jnp.concatenate([block, pad])
        got_ids, got_probs = row_soft_targets(top, block, config=config, top_k=top_k)
        ids[rows] = np.asarray(got_ids)[: rows.stop - begin]
        probs[rows] = np.asarray(got_probs)[: rows.stop - begin]
        if progress is not None:
            progress(rows.stop, n)
    return ids, probs
