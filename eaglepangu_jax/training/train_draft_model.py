"""The distilled draft model's objective and held-out figures (kind ``"draft-model"``).

The model (:class:`~eaglepangu_jax.drafters.draft_target_model.DraftModelConfig`) is a small
Llama that reads tokens only. Loss: hard cross-entropy of its draft-vocabulary logits at
position ``p`` against the token at ``p + 1`` wherever that token is an answer token inside the
draft vocabulary (the corpus *is* the teacher's greedy answers, so this is the teacher's
top-1). With ``soft_weight = w > 0`` it is ``(1 - w) * hard + w * soft``, ``soft`` the
cross-entropy against the teacher's renormalised top-K law at the same positions
(:mod:`eaglepangu_jax.training.soft_targets`). The loop, optimiser and checkpoints are
:mod:`eaglepangu_jax.training.train`'s.

Held-out chains are exact offline: the draft reads nothing but tokens, so while its drafts are
accepted it has read exactly the teacher-forced ones; a chain from root ``r`` is accepted up to
the first position ``p >= r`` whose top-1 misses the token at ``p + 1``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from eaglepangu_jax.drafters.draft_target_model import DraftModelConfig, draft_model_params
from eaglepangu_jax.models import llama
from eaglepangu_jax.models.init import fresh_weights

__all__ = ["init_head", "sequence_logits", "train_arrays", "loss", "evaluate"]


def init_head(
    config: DraftModelConfig,
    key: Array,
    *,
    embed: Float[Array, "V H"] | None = None,
    d2t: Int[Array, " Vd"] | None = None,
    final_norm: Float[Array, " H"] | None = None,
) -> dict:
    """Random layers (norms at one, matrices ``N(0, 1/fan_in)``); the head starts from the
    embedding's draft-vocabulary rows and the final norm from the teacher's when given. The
    command line starts from the teacher's own first layers instead
    (:func:`~eaglepangu_jax.drafters.draft_target_model.init_from_teacher`)."""
    head = fresh_weights(config.head_shapes(), key)
    if embed is not None and d2t is not None:
        head["lm_head"] = jnp.asarray(embed, jnp.float32)[jnp.asarray(d2t, jnp.int32)].T
    if final_norm is not None:
        head["final_norm"] = jnp.asarray(final_norm, jnp.float32)
    return head


def sequence_logits(
    head: dict, config: DraftModelConfig, embed: Float[Array, "V H"], tokens: Int[Array, " T"]
) -> Float[Array, "T Vd"]:
    """Draft-vocabulary logits at every position of one causal sequence."""
    params = draft_model_params(head, config, embed)
    return llama.forward_sequence(params, tokens.astype(jnp.int32), config=config.llama_config())[0]


def _next_targets(targets: Int[Array, "... T"]) -> Int[Array, "... T"]:
    """``out[..., p]``: the draft id of token ``p + 1`` (-1: none, or not trainable)."""
    pad = jnp.full(targets.shape[:-1] + (1,), -1, targets.dtype)
    return jnp.concatenate([targets[..., 1:], pad], axis=-1)


def train_arrays(batches, rows, step, cfg, config) -> tuple:
    """A step's arrays: the rows' tokens and draft-id targets, and their soft targets when
    the run weighs them."""
    if cfg.soft_weight <= 0.0:
        return batches.tokens[rows], batches.targets[rows]
    if batches.soft_ids is None or batches.soft_probs is None:
        raise ValueError(f"soft_weight {cfg.soft_weight} needs batches with soft targets")
    return (
        batches.tokens[rows],
        batches.targets[rows],
        batches.soft_ids[rows],
        batches.soft_probs[rows],
    )


def loss(head, config, embed, arrays, cfg) -> tuple[Array, Array]:
    """Mean next-token cross-entropy over trainable positions (mixed with the soft-target
    one, see the module docstring), and ``(top-1 accuracy,)``."""
    tokens, targets, *soft = arrays
    logits = jax.vmap(lambda tk: sequence_logits(head, config, embed, tk))(tokens)
    nxt = _next_targets(targets)
    valid = nxt >= 0
    logp = jax.nn.log_softmax(logits, axis=-1)
    picked = jnp.take_along_axis(logp, jnp.maximum(nxt, 0)[..., None], axis=-1)[..., 0]
    count = jnp.maximum(jnp.sum(valid), 1).astype(jnp.float32)
    nll = -jnp.sum(jnp.where(valid, picked, 0.0)) / count
    if soft:
        soft_ids, soft_probs = soft
        cross = jnp.sum(soft_probs * jnp.take_along_axis(logp, soft_ids, axis=-1), axis=-1)
        soft_nll = -jnp.sum(jnp.where(valid, cross, 0.0)) / count
        nll = (1.0 - cfg.soft_weight) * nll + cfg.soft_weight * soft_nll
    hit = valid & (jnp.argmax(logits, axis=-1) == nxt)
    return nll, jnp.sum(hit)[None].astype(jnp.float32) / count


def evaluate(
    head: dict,
    config: DraftModelConfig,
    embed,
    batches,
    *,
    depth: int = 6,
    chunk: int = 4,
) -> dict[str, Any]:
    """Held-out figures, offline (see the module docstring).

    A chain's root is every position ``r`` whose next token ``r + 1`` is an answer token of
    the row (the teacher has just emitted ``r``). A target outside the draft vocabulary or past
    the row's end is a miss.

    Returns:
      ``accuracy``: ``[top-1 accuracy]`` over trainable positions (the same at every depth for
      a model that reads tokens only); ``chain[i]``: share of chains right at every draft
      ``<= i``; ``chain_accepted_length``: ``1 + sum(chain)`` for a top-1 chain of ``depth``
      drafts (bonus included); ``nll`` and ``loss``: mean cross-entropy; ``anchors``.
    """
    embed = jnp.asarray(embed, jnp.float32)

    @jax.jit
    def scores(tokens, targets):
        logits = jax.vmap(lambda tk: sequence_logits(head, config, embed, tk))(tokens)
        nxt = _next_targets(targets)
        valid = nxt >= 0
        logp = jax.nn.log_softmax(logits, axis=-1)
        picked = jnp.take_along_axis(logp, jnp.maximum(nxt, 0)[..., None], axis=-1)[..., 0]
        return jnp.where(valid, picked, 0.0), valid & (jnp.argmax(logits, -1) == nxt), valid

    t = batches.tokens.shape[1]
    starts = np.arange(t)
    nll = hits = count = 0.0
    chain, num_chains = np.zeros(depth), 0
    for begin in range(0, batches.tokens.shape[0], chunk):
        sl = slice(begin, begin + chunk)
        picked, hit, valid = (
            np.asarray(x)
            for x in scores(jnp.asarray(batches.tokens[sl]), jnp.asarray(batches.targets[sl]))
        )
        nll -= float(picked.sum())
        hits += float(hit.sum())
        count += float(valid.sum())
        padded = np.concatenate([hit, np.zeros(hit.shape[:1] + (depth,), bool)], axis=1)
        ahead = np.stack([padded[:, i : i + t] for i in range(depth)], axis=-1)  # [B, T, D]
        run = np.cumprod(ahead, axis=-1)
        live = (starts[None, :] + 1 >= batches.prompt_lens[sl, None]) & (
            starts[None, :] + 1 < batches.lengths[sl, None]
        )
        chain += run[live].sum(axis=0)
        num_chains += int(live.sum())
    count = max(count, 1.0)
    chain = chain / max(num_chains, 1)
    return {
        "accuracy": [hits / count],
        "nll": [nll / count],
        "loss": nll / count,
        "chain": chain.tolist(),
        "chain_accepted_length": float(1.0 + chain.sum()),
        "anchors": num_chains,
    }
