"""Training objective of the block drafter: random anchors, one block per anchor.

For one sequence the context K/V of every position are computed once; then ``A`` anchors
``p`` (root positions) are drawn in the answer region, and anchor ``p``'s block
``[embed(x_p), MASK, ...]`` reads the context of positions ``< p`` and its own block, exactly
what :meth:`~eaglepangu_jax.drafters.block.BlockDrafter.propose` sees with ``x_p`` as the root.
Slot ``i`` is scored against ``x_{p+i+1}`` (the data *is* the teacher's greedy answer, so its
next token is the teacher's argmax): hard cross-entropy over the draft vocabulary, masked where
the target is a prompt token, past the sequence or outside the draft vocabulary. Each depth's
loss is a mean over its targets; depths are weighted ``decay ** i`` (``TrainConfig.depth_decay``,
0.8 by default: the acceptance of depth ``i`` needs the ``i`` earlier ones, so the first
depths matter most). Evaluation reports its loss at the default decay, so runs with other
decays stay comparable.

**Context windows** (``TrainConfig.context_window = W > 0``): half of the blocks see only the
last ``1 .. W`` context positions (drawn uniformly), like the engine's draft window. On small
data a block that always sees its whole sequence learns to recognise it (from the prompt) and
recite the memorised answer; a block that must also work from the recent context alone has to
learn what carries over to new text.

**Every root** (``TrainConfig.all_roots_weight = w > 0``): the blocks above score depth 1 at
only ``A`` roots per row, while depth 1 is learnt from every position of the row almost for
free: a one-slot block ``[embed(x_p)] + w_last c_{p-1}`` at *every* root ``p`` costs one slot
per position where the ``A`` full blocks cost ``D`` per anchor. Its mean depth-1 loss is added,
weighted ``w``. A one-slot block's slot 0 differs from a full block's only by not reading the
block's MASK slots; the trained heads barely read them (the fourth-stage block head's held-out
depth-1 top-1 is 0.3678 with one slot, 0.3676 with eight), and the full blocks keep training
slot 0 as the engine runs it.

Anchors and windows are a function of ``(seed, step)``, so a run and its resume see the same
blocks. The
loop, optimiser and checkpoints are shared with EAGLE-3 (:mod:`eaglepangu_jax.training.train`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from eaglepangu_jax.drafters import block

__all__ = [
    "DEPTH_DECAY",
    "anchor_range",
    "sample_anchors",
    "sample_windows",
    "all_anchors",
    "block_targets",
    "sequence_logits",
    "sequence_scores",
    "batch_loss",
    "all_roots_nll",
    "train_arrays",
    "loss",
    "evaluate",
    "INVERSE_TEMPERATURES",
    "temperature_statistics",
    "calibration_error",
    "after_right_chain",
    "fit_depth_temperatures",
]

DEPTH_DECAY = 0.8


def anchor_range(prompt_len: int, length: int) -> tuple[int, int]:
    """``[lo, hi)`` of valid root positions: the root's next token must be an answer token
    (``p + 1 >= prompt_len``) inside the sequence (``p + 1 < length``)."""
    return max(prompt_len - 1, 0), max(length - 1, 0)


def sample_anchors(
    prompt_lens: np.ndarray, lengths: np.ndarray, num_anchors: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """``A`` distinct anchors per sequence, uniform over its valid range; ``ok`` is False for
    the padding of sequences with fewer than ``A`` valid anchors."""
    b = len(prompt_lens)
    anchors = np.zeros((b, num_anchors), np.int32)
    ok = np.zeros((b, num_anchors), bool)
    for i in range(b):
        lo, hi = anchor_range(int(prompt_lens[i]), int(lengths[i]))
        picks = lo + rng.permutation(max(hi - lo, 0))[:num_anchors]
        anchors[i, : len(picks)] = picks
        ok[i, : len(picks)] = True
    return anchors, ok


def sample_windows(anchors: np.ndarray, window: int, rng: np.random.Generator) -> np.ndarray:
    """First visible context position of each block: ``0`` for half of them, the anchor
    minus ``1 .. window`` (uniform) for the others; ``window = 0`` shows all context."""
    since = np.zeros(anchors.shape, np.int32)
    if window > 0:
        local = rng.random(anchors.shape) < 0.5
        width = rng.integers(1, window + 1, size=anchors.shape)
        since = np.where(local, np.maximum(anchors - width, 0), 0).astype(np.int32)
    return since


def all_anchors(prompt_lens: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Every valid anchor of each sequence, left-aligned and padded to the longest answer;
    ``ok`` marks the real ones (for evaluation)."""
    ranges = [anchor_range(int(p), int(n)) for p, n in zip(prompt_lens, lengths)]
    width = max(max(hi - lo for lo, hi in ranges), 1)
    anchors = np.zeros((len(ranges), width), np.int32)
    ok = np.zeros((len(ranges), width), bool)
    for i, (lo, hi) in enumerate(ranges):
        anchors[i, : hi - lo] = np.arange(lo, hi)
        ok[i, : hi - lo] = True
    return anchors, ok


def block_targets(
    targets: Int[Array, " T"], anchors: Int[Array, " A"], block_size: int
) -> Int[Array, "A D"]:
    """Draft id of the token at ``anchor + i + 1`` for each slot ``i``; ``-1``: not a target."""
    t = targets.shape[0]
    index = anchors[:, None] + 1 + jnp.arange(block_size, dtype=jnp.int32)[None, :]
    return jnp.where(index < t, targets[jnp.minimum(index, t - 1)], -1)


def sequence_logits(
    head: dict,
    config: block.BlockConfig,
    embed: Float[Array, "V H"],
    features: Float[Array, "T F H"],
    tokens: Int[Array, " T"],
    anchors: Int[Array, " A"],
    since: Int[Array, " A"],
) -> Float[Array, "A D Vd"]:
    """Draft-vocabulary logits of one block per anchor of one sequence; block ``a`` sees the
    context positions ``since[a] <= s < anchors[a]``."""
    t = tokens.shape[0]
    positions = jnp.arange(t, dtype=jnp.int32)
    stream = block.context_stream(head, config, features.astype(jnp.float32))
    ctx_k, ctx_v = block.context_kv(head, config, stream, positions)
    visible = (positions[None, :] < anchors[:, None]) & (positions[None, :] >= since[:, None])
    last = jnp.where((anchors > since)[:, None], stream[jnp.maximum(anchors - 1, 0)], 0.0)
    return block.block_logits(
        head, config, embed, ctx_k, ctx_v, visible, tokens[anchors], anchors, last
    )


def sequence_scores(
    head: dict,
    config: block.BlockConfig,
    embed: Float[Array, "V H"],
    features: Float[Array, "T F H"],
    tokens: Int[Array, " T"],
    targets: Int[Array, " T"],
    anchors: Int[Array, " A"],
    ok: Bool[Array, " A"],
    since: Int[Array, " A"],
) -> tuple[Float[Array, "A D"], Bool[Array, "A D"], Bool[Array, "A D"]]:
    """Per anchor and slot of one sequence: target log-probability, top-1 hit, target valid.
    Block ``a`` sees the context positions ``since[a] <= s < anchors[a]``."""
    logits = sequence_logits(head, config, embed, features, tokens, anchors, since)
    tgt = block_targets(targets, anchors, config.block_size)
    valid = (tgt >= 0) & ok[:, None]
    logp = jax.nn.log_softmax(logits, axis=-1)
    picked = jnp.take_along_axis(logp, jnp.maximum(tgt, 0)[..., None], axis=-1)[..., 0]
    hit = valid & (jnp.argmax(logits, axis=-1) == tgt)
    return jnp.where(valid, picked, 0.0), hit, valid


def batch_loss(
    head: dict,
    config: block.BlockConfig,
    embed: Float[Array, "V H"],
    features: Float[Array, "B T F H"],
    tokens: Int[Array, "B T"],
    targets: Int[Array, "B T"],
    anchors: Int[Array, "B A"],
    ok: Bool[Array, "B A"],
    since: Int[Array, "B A"],
    depth_decay: float = DEPTH_DECAY,
    all_roots_weight: float = 0.0,
) -> tuple[Float[Array, ""], Float[Array, " D"]]:
    """Depth-weighted mean cross-entropy and each depth's top-1 accuracy on the batch, plus
    ``all_roots_weight`` times :func:`all_roots_nll` (skipped at 0)."""
    picked, hit, valid = jax.vmap(
        lambda f, tk, tg, an, k, w: sequence_scores(head, config, embed, f, tk, tg, an, k, w)
    )(features, tokens, targets, anchors, ok, since)
    count = jnp.maximum(jnp.sum(valid, axis=(0, 1)).astype(jnp.float32), 1.0)  # [D]
    nll = -jnp.sum(picked, axis=(0, 1)) / count
    weights = jnp.float32(depth_decay) ** jnp.arange(config.block_size, dtype=jnp.float32)
    total = jnp.sum(weights * nll)
    if all_roots_weight > 0:
        total = total + jnp.float32(all_roots_weight) * all_roots_nll(
            head, config, embed, features, tokens, targets
        )
    return total, jnp.sum(hit, axis=(0, 1)).astype(jnp.float32) / count


def all_roots_nll(
    head: dict,
    config: block.BlockConfig,
    embed: Float[Array, "V H"],
    features: Float[Array, "B T F H"],
    tokens: Int[Array, "B T"],
    targets: Int[Array, "B T"],
) -> Float[Array, ""]:
    """Mean depth-1 cross-entropy of a one-slot block at every position of every row, seeing
    all the context before it. Positions whose next token is no target (prompt, padding,
    outside the draft vocabulary) are masked by :func:`block_targets`, so every position can
    be a root and the shapes stay fixed."""
    one_slot = dataclasses.replace(config, block_size=1)
    roots = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    picked, _, valid = jax.vmap(
        lambda f, tk, tg, an: sequence_scores(
            head, one_slot, embed, f, tk, tg, an, jnp.ones_like(an, bool), jnp.zeros_like(an)
        )
    )(features, tokens, targets, roots)
    return -jnp.sum(picked) / jnp.maximum(jnp.sum(valid).astype(jnp.float32), 1.0)


def train_arrays(
    batches: Any, rows: np.ndarray, step: int, cfg: Any, config: Any
) -> tuple[np.ndarray, ...]:
    """Host arrays of training step ``step``: the rows' data and their anchors."""
    rng = np.random.default_rng([cfg.seed, 1, step])  # a stream apart from batch_indices'
    anchors, ok = sample_anchors(batches.prompt_lens[rows], batches.lengths[rows], cfg.anchors, rng)
    since = sample_windows(anchors, cfg.context_window, rng)
    return (batches.features[rows], batches.tokens[rows], batches.targets[rows], anchors, ok, since)


def loss(
    head: dict,
    config: block.BlockConfig,
    embed: Float[Array, "V H"],
    arrays: tuple[Array, ...],
    cfg: Any,
) -> tuple[Float[Array, ""], Float[Array, " D"]]:
    """:func:`batch_loss` on :func:`train_arrays`' output (the shared loop's interface)."""
    return batch_loss(
        head,
        config,
        embed,
        *arrays,
        depth_decay=cfg.depth_decay,
        all_roots_weight=cfg.all_roots_weight,
    )


def evaluate(
    head: dict,
    config: block.BlockConfig,
    embed: Float[Array, "V H"],
    batches: Any,
    *,
    chunk: int = 4,
) -> dict[str, Any]:
    """Held-out figures over every valid anchor of ``batches``.

    Returns:
      ``accuracy[i]``: top-1 accuracy at depth ``i + 1`` (targets in the draft vocabulary);
      ``chain[i]``: share of anchors whose top-1 tokens are right at all depths ``<= i + 1``;
      ``chain_accepted_length``: ``1 + sum(chain)``, the accepted length a single top-1 chain
      of depth ``D`` would reach (bonus token included); ``nll``: mean per depth; ``loss``:
      the training loss's depth-weighted sum of ``nll``; ``anchors``: anchors evaluated.
    """
    anchors, ok = all_anchors(batches.prompt_lens, batches.lengths)
    embed = jnp.asarray(embed, jnp.float32)

    @jax.jit
    def scores(features, tokens, targets, anchors, ok):
        return jax.vmap(
            lambda f, tk, tg, an, k: sequence_scores(
                head, config, embed, f, tk, tg, an, k, jnp.zeros_like(an)
            )
        )(features, tokens, targets, anchors, ok)

    d = config.block_size
    nll, hits, counts = np.zeros(d), np.zeros(d), np.zeros(d)
    chain, num_anchors = np.zeros(d), 0
    for begin in range(0, batches.tokens.shape[0], chunk):
        sl = slice(begin, begin + chunk)
        picked, hit, valid = (
            np.asarray(x)
            for x in scores(
                jnp.asarray(batches.features[sl]),
                jnp.asarray(batches.tokens[sl]),
                jnp.asarray(batches.targets[sl]),
                jnp.asarray(anchors[sl]),
                jnp.asarray(ok[sl]),
            )
        )
        nll -= picked.sum(axis=(0, 1))
        hits += hit.sum(axis=(0, 1))
        counts += valid.sum(axis=(0, 1))
        live = ok[sl]
        chain += (np.cumprod(hit, axis=-1)[live]).sum(axis=0)
        num_anchors += int(live.sum())
    counts = np.maximum(counts, 1)
    chain = chain / max(num_anchors, 1)
    weights = DEPTH_DECAY ** np.arange(d)
    return {
        "accuracy": (hits / counts).tolist(),
        "nll": (nll / counts).tolist(),
        "loss": float(np.sum(weights * nll / counts)),
        "chain": chain.tolist(),
        "chain_accepted_length": float(1.0 + chain.sum()),
        "anchors": num_anchors,
    }


# ------------------------------------------------------------------ per-depth calibration

# Grid of inverse temperatures searched: 2**(-3 .. 2) in steps of 2**(1/16) (~4.4% apart),
# with beta = 1 (no scaling) exactly on it. The held-out negative log-likelihood of
# ``softmax(beta * z)`` is convex in ``beta`` (``-beta z_t + lse(beta z)``), so the best grid
# point is within one step of the optimum.
INVERSE_TEMPERATURES = 2.0 ** np.linspace(-3.0, 2.0, 81)
CALIBRATION_BINS = 10


def temperature_statistics(
    logits: Float[Array, "N D Vd"],
    targets: Int[Array, "N D"],
    valid: Bool[Array, "N D"],
    betas: Float[Array, " G"],
) -> tuple[Float[Array, "G D"], Float[Array, "G N D"], Bool[Array, "N D"]]:
    """For each inverse temperature ``beta``: the summed NLL per depth of ``softmax(beta z)``
    over the valid targets, and each prediction's top-1 confidence; plus the top-1 hits."""
    z_t = jnp.take_along_axis(logits, jnp.maximum(targets, 0)[..., None], axis=-1)[..., 0]
    hit = valid & (jnp.argmax(logits, axis=-1) == targets)
    top = jnp.max(logits, axis=-1)

    def one(beta):
        lse = jax.nn.logsumexp(beta * logits, axis=-1)  # [N, D]
        nll = jnp.where(valid, lse - beta * z_t, 0.0)
        return jnp.sum(nll, axis=0), jnp.exp(beta * top - lse)

    nll, confidence = jax.lax.map(one, betas)
    return nll, confidence, hit


def after_right_chain(hit: Bool[Array, "... D"]) -> Bool[Array, "... D"]:
    """``True`` at depth ``i`` where the top-1 hits at every depth ``< i`` are ``True`` (always
    at depth 0): the predictions a tree's path reaches with every ancestor accepted."""
    shallower = jnp.cumprod(hit, axis=-1, dtype=jnp.int32)[..., :-1] > 0
    return jnp.concatenate([jnp.ones_like(hit[..., :1]), shallower], axis=-1)


def calibration_error(confidence: np.ndarray, hit: np.ndarray, bins: int = CALIBRATION_BINS):
    """Expected calibration error of top-1 confidences: the mean over equal-width confidence
    bins of ``|accuracy - mean confidence|``, weighted by the bin's share of predictions."""
    confidence, hit = np.asarray(confidence, np.float64), np.asarray(hit, np.float64)
    if confidence.size == 0:
        return 0.0
    which = np.minimum((confidence * bins).astype(int), bins - 1)
    error = 0.0
    for b in range(bins):
        sel = which == b
        if sel.any():
            error += sel.mean() * abs(hit[sel].mean() - confidence[sel].mean())
    return float(error)


def fit_depth_temperatures(
    head: dict,
    config: block.BlockConfig,
    embed: Float[Array, "V H"],
    batches: Any,
    *,
    chunk: int = 2,
    given_chain: bool = False,
) -> dict[str, Any]:
    """Per-depth temperatures that minimise the held-out NLL of the drafter's marginals.

    Every valid anchor of ``batches`` (full context, as the engine drafts) contributes one
    prediction per slot whose target is in the draft vocabulary. Returns ``depth_temperature``
    (``[D]``, for :func:`eaglepangu_jax.drafters.block.with_depth_temperature`), the held-out
    NLL per depth before and after, the expected calibration error of the top-1 confidence per
    depth before and after, and the predictions counted.

    ``given_chain``: depth ``i``'s predictions count only at anchors whose top-1 tokens at
    every depth ``< i`` were right. A tree scores a node by the product of its path's
    marginals, as if each were the chance of that token *given its ancestors were accepted*;
    the block's slots do not see each other, and their errors come together (a hard spot is
    hard at every depth), so given a right top-1 chain the next slot is right more often than
    its plain marginal says (the shipped head, held out: 0.41 against 0.34 at depth 2, 0.36
    against 0.22 at depth 3). This fit makes each factor that conditional chance along the
    top-1 chain. For the shipped head it moves little (depth 2 / 3: 1.04 / 1.00 against 1.09 /
    1.04): its confidence already rises where its chain is right (docs/RESULTS.md).
    """
    anchors, ok = all_anchors(batches.prompt_lens, batches.lengths)
    embed = jnp.asarray(embed, jnp.float32)
    betas = jnp.asarray(INVERSE_TEMPERATURES, jnp.float32)
    d = config.block_size

    @jax.jit
    def stats(features, tokens, targets, anchors, ok):
        logits = jax.vmap(
            lambda f, tk, an: sequence_logits(head, config, embed, f, tk, an, jnp.zeros_like(an))
        )(features, tokens, anchors)  # [B, A, D, Vd]
        tgt = jax.vmap(lambda tg, an: block_targets(tg, an, d))(targets, anchors)
        valid = (tgt >= 0) & ok[..., None]
        if given_chain:
            valid = valid & after_right_chain(valid & (jnp.argmax(logits, axis=-1) == tgt))
        flat = lambda x: x.reshape((-1,) + x.shape[2:])  # noqa: E731
        return temperature_statistics(flat(logits), flat(tgt), flat(valid), betas) + (flat(valid),)

    nll = np.zeros((len(INVERSE_TEMPERATURES), d))
    confidences, hits = [], []
    for begin in range(0, batches.tokens.shape[0], chunk):
        sl = slice(begin, begin + chunk)
        part_nll, confidence, hit, valid = (
            np.asarray(x)
            for x in stats(
                jnp.asarray(batches.features[sl]),
                jnp.asarray(batches.tokens[sl]),
                jnp.asarray(batches.targets[sl]),
                jnp.asarray(anchors[sl]),
                jnp.asarray(ok[sl]),
            )
        )
        nll += part_nll
        keep = valid.any(axis=-1)  # rows of real anchors
        confidences.append(np.where(valid, confidence, np.nan)[:, keep])
        hits.append(np.where(valid, hit, False)[keep])
    confidence = np.concatenate(confidences, axis=1)  # [G, N, D], NaN where not a target
    hit = np.concatenate(hits)  # [N, D]
    seen = (~np.isnan(confidence[0])).sum(axis=0)
    counts = np.maximum(seen, 1)
    unit = int(np.flatnonzero(INVERSE_TEMPERATURES == 1.0)[0])  # no scaling
    # A depth without predictions (none reached by a right chain) has no evidence: unscaled.
    best = np.where(seen > 0, np.argmin(nll, axis=0), unit)  # [D]

    def ece(g: int, i: int) -> float:
        col = confidence[g, :, i]
        live = ~np.isnan(col)
        return calibration_error(col[live], hit[live, i])

    return {
        "depth_temperature": [float(1.0 / INVERSE_TEMPERATURES[g]) for g in best],
        "nll_before": (nll[unit] / counts).tolist(),
        "nll_after": [float(nll[g, i] / counts[i]) for i, g in enumerate(best)],
        "ece_before": [ece(unit, i) for i in range(d)],
        "ece_after": [ece(int(g), i) for i, g in enumerate(best)],
        "predictions": int(seen.sum()),
        "predictions_by_depth": seen.tolist(),
    }
