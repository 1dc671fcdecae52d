"""Training loop of the draft heads (EAGLE-3, block) and the distilled draft model: AdamW,
atomic resumable checkpoints.

One loop, optimiser and checkpoint format serve every drafter kind; a :class:`Kind` names what
differs (config class, initialisation, loss, per-step arrays). The block drafter's objective
lives in :mod:`eaglepangu_jax.training.train_block`, the draft model's in
:mod:`eaglepangu_jax.training.train_draft_model`.

EAGLE-3 loss: for each of ``ttt_steps`` unrolled steps ``i`` (the head's own hidden state fed back,
:func:`eaglepangu_jax.drafters.eagle3.ttt_logits`), hard cross-entropy of the draft-vocabulary
logits against the teacher's greedy next token (the data *is* the teacher's greedy answer),
averaged over answer positions whose target is in the draft vocabulary, weighted ``0.8 ** i``.
Optimiser: AdamW with linear warmup and cosine decay, gradient clipping at norm 1.

Determinism: batch order is a function of ``(seed, epoch)`` and initialisation of ``seed``, so
the same seed and data give the same loss curve, also across a resume.

Checkpoints are ``<name>.safetensors`` (head weights, ``d2t``, optimiser state) plus
``<name>.json`` (``format`` naming the kind, head config, train config, step, teacher
fingerprint, losses), both written atomically. :func:`load_checkpoint` refuses another
teacher's checkpoint, another kind, or wrong shapes.

Timing (2 shared CPU cores, SmolLM2-135M teacher, CLI defaults): ~90-100 s per 16-prompt data
shard, ~7-9 s per EAGLE-3 training step of 8 sequences x 224 tokens x 3 unrolled steps.
"""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from eaglepangu_jax.drafters import block, eagle3
from eaglepangu_jax.drafters import checkpoint as checkpoint_lib
from eaglepangu_jax.drafters.checkpoint import load_checkpoint, save_checkpoint
from eaglepangu_jax.drafters.vocab import DraftVocab
from eaglepangu_jax.training import train_block, train_draft_model
from eaglepangu_jax.training.data import Shard

__all__ = [
    "STEP_DECAY",
    "TrainConfig",
    "Batches",
    "row_starts",
    "make_batches",
    "sequence_loss",
    "batch_loss",
    "evaluate",
    "lr_schedule",
    "make_optimizer",
    "FIT_SKIP",
    "FIT_PROBE",
    "fitted_schedule_steps",
    "batch_indices",
    "Kind",
    "KINDS",
    "kind_of",
    "train",
]

STEP_DECAY = 0.8


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Optimisation settings (saved with every checkpoint)."""

    steps: int = 200
    batch_size: int = 8
    seq_len: int = 256
    row_overlap: int | None = None  # None: one row per sequence; see row_starts
    learning_rate: float = 1e-3
    warmup_steps: int = 20
    weight_decay: float = 0.01
    ttt_steps: int = 3  # EAGLE-3: unrolled training-time-test steps
    anchors: int = 16  # block drafter: blocks (root positions) per sequence and step
    context_window: int = 0  # block drafter: half the blocks see only the last 1..N positions
    depth_decay: float = train_block.DEPTH_DECAY  # block drafter: depth i weighs depth_decay**i
    all_roots_weight: float = 0.0  # block drafter: weight of a depth-1 loss at every position
    soft_weight: float = 0.0  # EAGLE-3, draft model: weight of the soft-target loss (0: hard)
    seed: int = 0
    checkpoint_every: int = 25

    def __post_init__(self):
        for field in ("steps", "batch_size", "seq_len", "ttt_steps", "anchors", "checkpoint_every"):
            if getattr(self, field) < 1:
                raise ValueError(f"{field} must be >= 1, got {getattr(self, field)}")
        if self.row_overlap is not None and not 0 <= self.row_overlap < self.seq_len:
            raise ValueError(
                f"row_overlap must be in [0, seq_len={self.seq_len}), got {self.row_overlap}"
            )
        if self.context_window < 0:
            raise ValueError(f"context_window must be >= 0, got {self.context_window}")
        if not 0.0 < self.depth_decay <= 1.0:
            raise ValueError(f"depth_decay must be in (0, 1], got {self.depth_decay}")
        if not self.all_roots_weight >= 0.0:  # NaN fails too
            raise ValueError(f"all_roots_weight must be >= 0, got {self.all_roots_weight}")
        if not 0.0 <= self.soft_weight <= 1.0:
            raise ValueError(f"soft_weight must be in [0, 1], got {self.soft_weight}")


@dataclasses.dataclass(frozen=True, eq=False)
class RowFeatures:
    """The teacher features of padded training rows, ``[N, T, F, H]`` float16, read from the
    shards' own arrays when indexed.

    Copying every row out up front would hold the features twice (the shards and the rows) and
    once more per repeat of a corpus given several times: the synthesised corpus plus the
    written one three times at 384 tokens is about 14 GB of rows beside 7 GB of shards, past a
    24 GB machine. A row here is a place in a shard; indexing (an int, a slice, an index array,
    optionally followed by indices of the other axes) copies out only the rows asked for, zero
    past each row's length, as the padded array would hold them.
    """

    sources: tuple[np.ndarray, ...]  # per shard [positions, F, H]
    source: np.ndarray  # [N] int32 the shard of each row
    begin: np.ndarray  # [N] int64 the row's first position in its shard
    length: np.ndarray  # [N] int32 positions of the row (the rest is padding)
    seq_len: int

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (len(self.source), self.seq_len) + self.sources[0].shape[1:]

    @property
    def ndim(self) -> int:
        return 4

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(np.float16)

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, index) -> np.ndarray:
        rest = ()
        if isinstance(index, tuple):
            index, rest = index[0], index[1:]
        rows = np.arange(len(self.source))[index]
        single = np.ndim(rows) == 0
        rows = np.atleast_1d(rows)
        out = np.zeros((len(rows),) + self.shape[1:], np.float16)
        for k, r in enumerate(rows):
            a, n = int(self.begin[r]), int(self.length[r])
            out[k, :n] = self.sources[self.source[r]][a : a + n]
        out = out[0] if single else out
        return out[rest] if single else out[(slice(None),) + rest]

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        out = self[:]
        return out if dtype is None else out.astype(dtype)


@dataclasses.dataclass(frozen=True)
class Batches:
    """Padded training arrays (host side)."""

    tokens: np.ndarray  # [N, T] int32
    targets: np.ndarray  # [N, T] int32 draft id of each token, -1 when not trainable
    features: np.ndarray | RowFeatures  # [N, T, F, H] float16
    prompt_lens: np.ndarray  # [N] int32 leading non-target positions (prompt, or context)
    lengths: np.ndarray  # [N] int32 real tokens of each row (the rest is padding)
    # Soft targets (training.soft_targets; EAGLE-3, draft model): the teacher's top-K draft ids
    # of the next token at each position, and their renormalised probabilities.
    soft_ids: np.ndarray | None = None  # [N, T, K] int32
    soft_probs: np.ndarray | None = None  # [N, T, K] float32


def row_starts(length: int, seq_len: int, row_overlap: int | None) -> list[int]:
    """Where the rows of a ``length``-token sequence start.

    ``row_overlap=None``: one row, the sequence cut to its first ``seq_len`` tokens. An integer
    ``N``: rows every ``seq_len - N`` tokens until one reaches the end, so a long answer is
    trained on to its last token and every continuation row opens with ``N`` tokens of context.
    """
    if row_overlap is not None and not 0 <= row_overlap < seq_len:
        raise ValueError(f"row_overlap must be in [0, seq_len={seq_len}), got {row_overlap}")
    if row_overlap is None or length <= seq_len:
        return [0]
    stride = seq_len - row_overlap
    return [k * stride for k in range(1 + math.ceil((length - seq_len) / stride))]


def make_batches(
    shards: Sequence[Shard], vocab: DraftVocab, seq_len: int, row_overlap: int | None = None
) -> Batches:
    """Rows of ``seq_len`` tokens (:func:`row_starts`); only answer tokens inside the draft vocab
    are targets, and each of them in one row only: the first ``row_overlap`` positions of a
    continuation row are context, marked as its ``prompt_lens`` and never targets."""
    t2d = vocab.t2d()
    toks, tgts, sources, source, begin, prompt_lens, lengths = [], [], [], [], [], [], []
    places: dict[int, int] = {}  # a shard given twice (a corpus weighted up) is held once
    for shard in shards:
        where = places.setdefault(id(shard.features), len(sources))
        if where == len(sources):
            sources.append(shard.features)
        for i, (seq, _, prompt_len) in enumerate(shard.sequences()):
            for start in row_starts(len(seq), seq_len, row_overlap):
                n = min(len(seq) - start, seq_len)
                context = prompt_len - start if start == 0 else max(prompt_len - start, row_overlap)
                context = min(max(context, 0), n)
                tok = np.zeros((seq_len,), np.int32)
                tok[:n] = seq[start : start + n]
                tgt = np.full((seq_len,), -1, np.int32)
                tgt[:n] = t2d[tok[:n]]
                tgt[:context] = -1  # prompt (or already-trained context) is not a target
                toks.append(tok)
                tgts.append(tgt)
                source.append(where)
                begin.append(int(shard.offsets[i]) + start)
                prompt_lens.append(context)
                lengths.append(n)
    if not toks:
        raise ValueError("no training sequences")
    features = RowFeatures(
        tuple(sources),
        np.asarray(source, np.int32),
        np.asarray(begin, np.int64),
        np.asarray(lengths, np.int32),
        seq_len,
    )
    return Batches(
        np.stack(toks),
        np.stack(tgts),
        features,
        np.asarray(prompt_lens, np.int32),
        np.asarray(lengths, np.int32),
    )


def sequence_loss(
    head: dict,
    config: eagle3.Eagle3Config,
    embed,
    features,
    tokens,
    targets,
    steps: int,
    soft_ids=None,
    soft_probs=None,
    soft_weight: float = 0.0,
):
    """Weighted training-time-test loss of one sequence and per-step (loss sum, hits, count).

    With soft targets (``soft_ids`` / ``soft_probs`` ``[T, K]``: the teacher's top-K law of
    token ``p + 1`` at position ``p``, :mod:`~eaglepangu_jax.training.soft_targets`) each
    step's negative log-likelihood is ``(1 - soft_weight) * hard + soft_weight * soft``, the
    soft one the cross-entropy against the teacher's law of the same token.
    """
    logits = eagle3.ttt_logits(head, config, embed, features, tokens, steps)  # [K, T, Vd]
    t = tokens.shape[0]
    stats = []
    for i in range(steps):
        # Step i at position p drafts token p + i + 2.
        tgt = jnp.concatenate([targets[i + 2 :], jnp.full((i + 2,), -1, jnp.int32)])[:t]
        ok = tgt >= 0
        logp = jax.nn.log_softmax(logits[i], axis=-1)
        picked = jnp.take_along_axis(logp, jnp.maximum(tgt, 0)[:, None], axis=-1)[:, 0]
        nll = -picked
        if soft_ids is not None:
            # The teacher's law of token p + i + 2 is stored at position p + i + 1.
            law_ids = jnp.concatenate([soft_ids[i + 1 :], jnp.zeros_like(soft_ids[: i + 1])])
            law = jnp.concatenate([soft_probs[i + 1 :], jnp.zeros_like(soft_probs[: i + 1])])
            cross = jnp.sum(law * jnp.take_along_axis(logp, law_ids, axis=-1), axis=-1)
            nll = (1.0 - soft_weight) * nll - soft_weight * cross
        nll = jnp.where(ok, nll, 0.0)
        hit = ok & (jnp.argmax(logits[i], axis=-1) == tgt)
        stats.append(
            (jnp.sum(nll), jnp.sum(hit.astype(jnp.float32)), jnp.sum(ok.astype(jnp.float32)))
        )
    return stats


def batch_loss(
    head,
    config,
    embed,
    features,
    tokens,
    targets,
    steps,
    soft_ids=None,
    soft_probs=None,
    soft_weight: float = 0.0,
):
    """Mean over each step's targets, steps weighted ``0.8 ** i``; also step accuracies
    (soft targets as in :func:`sequence_loss`, ``[B, T, K]``)."""

    def one(f, tk, tg, *soft):
        f = f.astype(jnp.float32)
        return sequence_loss(head, config, embed, f, tk, tg, steps, *soft, soft_weight=soft_weight)

    soft = () if soft_ids is None else (soft_ids, soft_probs)
    per = jax.vmap(one)(features, tokens, targets, *soft)
    loss, accs = jnp.float32(0.0), []
    for i, (nll, hit, count) in enumerate(per):
        n = jnp.maximum(jnp.sum(count), 1.0)
        loss = loss + jnp.float32(STEP_DECAY**i) * jnp.sum(nll) / n
        accs.append(jnp.sum(hit) / n)
    return loss, jnp.stack(accs)


def evaluate(
    head: dict,
    config: eagle3.Eagle3Config,
    embed,
    batches: Batches,
    *,
    depth: int = 6,
    chunk: int = 4,
) -> dict[str, Any]:
    """Held-out figures of an EAGLE-3 head, offline, from teacher-forced greedy continuations.

    A chain starts at every slot ``s`` whose first drafted token ``s + 2`` is an answer token
    (the teacher has verified up to ``s`` and emitted ``s + 1``, the bonus token). Step ``i``
    drafts ``s + i + 2`` from the head's own earlier hidden states and the true tokens, which is
    what the engine feeds while every earlier draft was accepted. A target outside the draft
    vocabulary, or past the sequence's end, is a miss.

    Returns:
      ``accuracy[i]``: top-1 accuracy of step ``i`` over its in-vocabulary targets;
      ``chain[i]``: share of chains whose top-1 drafts are right at every step ``<= i``;
      ``chain_accepted_length``: ``1 + sum(chain)``, the accepted length a single top-1 chain
      of ``depth`` drafts reaches (bonus token included); ``nll``: mean per step; ``loss``:
      the training loss's step-weighted sum of the first ``min(depth, 3)`` ``nll``;
      ``anchors``: chains evaluated.
    """
    embed = jnp.asarray(embed, jnp.float32)
    t = batches.tokens.shape[1]

    @jax.jit
    def scores(features, tokens, targets):
        def one(f, tk, tg):
            logits = eagle3.ttt_logits(head, config, embed, f.astype(jnp.float32), tk, depth)
            logp = jax.nn.log_softmax(logits, axis=-1)  # [K, T, Vd]
            padded = jnp.concatenate([tg, jnp.full((depth + 2,), -1, jnp.int32)])
            shifted = jnp.stack([padded[i + 2 : i + 2 + t] for i in range(depth)])  # [K, T]
            valid = shifted >= 0
            picked = jnp.take_along_axis(logp, jnp.maximum(shifted, 0)[..., None], axis=-1)
            hit = valid & (jnp.argmax(logits, axis=-1) == shifted)
            return jnp.where(valid, picked[..., 0], 0.0), hit, valid

        return jax.vmap(one)(features, tokens, targets)

    nll, hits, counts = np.zeros(depth), np.zeros(depth), np.zeros(depth)
    chain, num_chains = np.zeros(depth), 0
    starts = np.arange(t)
    for begin in range(0, batches.tokens.shape[0], chunk):
        sl = slice(begin, begin + chunk)
        picked, hit, valid = (
            np.asarray(x)
            for x in scores(
                jnp.asarray(batches.features[sl]),
                jnp.asarray(batches.tokens[sl]),
                jnp.asarray(batches.targets[sl]),
            )
        )
        # a chain starts where its first draft is an answer slot of the row
        live = (starts[None, :] + 2 >= batches.prompt_lens[sl, None]) & (
            starts[None, :] + 2 < batches.lengths[sl, None]
        )  # [B, T]
        nll -= picked.sum(axis=(0, 2))
        hits += hit.sum(axis=(0, 2))
        counts += valid.sum(axis=(0, 2))
        run = np.cumprod(np.moveaxis(hit, 1, -1), axis=-1)  # [B, T, K]
        chain += run[live].sum(axis=0)
        num_chains += int(live.sum())
    counts = np.maximum(counts, 1)
    chain = chain / max(num_chains, 1)
    trained = min(depth, 3)
    weights = STEP_DECAY ** np.arange(trained)
    return {
        "accuracy": (hits / counts).tolist(),
        "nll": (nll / counts).tolist(),
        "loss": float(np.sum(weights * (nll / counts)[:trained])),
        "chain": chain.tolist(),
        "chain_accepted_length": float(1.0 + chain.sum()),
        "anchors": num_chains,
    }


def lr_schedule(cfg: TrainConfig, total_steps=None):
    """Linear warmup to ``learning_rate``, then cosine decay to 5% of it at ``total_steps``
    (default ``cfg.steps``; it may be a traced integer, so a schedule fitted to a time limit
    while training, :func:`fitted_schedule_steps`, needs no new compilation).

    Written out (not optax's helper) so every operation is dtype-explicit: the step count is
    int32 and the tests run under strict dtype promotion.
    """
    peak = jnp.float32(cfg.learning_rate)
    total = jnp.asarray(cfg.steps if total_steps is None else total_steps).astype(jnp.float32)
    # max(min(warmup, total - 1), 1); small integers are exact in float32, so a schedule of
    # cfg.steps gives the same rates as when these were Python constants.
    warm = jnp.maximum(jnp.minimum(jnp.float32(cfg.warmup_steps), total - 1.0), 1.0)

    def schedule(count):
        t = jnp.asarray(count).astype(jnp.float32)
        warmup = peak * t / warm
        frac = jnp.clip((t - warm) / jnp.maximum(total - warm, 1.0), 0.0, 1.0)
        cosine = peak * (
            jnp.float32(0.05)
            + jnp.float32(0.95 * 0.5) * (1.0 + jnp.cos(jnp.float32(math.pi) * frac))
        )
        return jnp.where(t < warm, warmup, cosine)

    return schedule


def make_optimizer(cfg: TrainConfig, total_steps=None) -> optax.GradientTransformation:
    """AdamW on :func:`lr_schedule` with gradient clipping at norm 1. The optimiser state does
    not depend on ``total_steps``: one state serves every schedule length."""
    return optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(lr_schedule(cfg, total_steps), weight_decay=cfg.weight_decay),
    )


# Fitting the schedule to a time limit: the first FIT_SKIP steps of a run (compilation, warm
# caches) are not timed, the next FIT_PROBE are.
FIT_SKIP, FIT_PROBE = 3, 20
FIT_MARGIN = 0.92  # of the time left: held-out evaluations and checkpoints also take some


def fitted_schedule_steps(
    done: int, steps_per_second: float, seconds_left: float, ceiling: int
) -> int:
    """Steps the schedule should span so that it ends when ``seconds_left`` run out.

    ``done`` steps have run, at ``steps_per_second`` lately; :data:`FIT_MARGIN` of the time left
    is planned for steps. Never more than ``ceiling`` (the configured ``steps``) and never
    fewer than ``done + 1``: the run always takes one more step, its last, at the floor rate.
    """
    if not steps_per_second > 0:
        raise ValueError(f"steps_per_second must be > 0, got {steps_per_second}")
    planned = done + int(steps_per_second * max(seconds_left, 0.0) * FIT_MARGIN)
    return int(min(max(planned, done + 1), ceiling))


def batch_indices(step: int, num: int, cfg: TrainConfig) -> np.ndarray:
    """Rows of batch ``step``: a per-epoch permutation seeded by ``(seed, epoch)``."""
    per_epoch = max(num // cfg.batch_size, 1)
    epoch, k = divmod(step, per_epoch)
    order = np.random.default_rng([cfg.seed, epoch]).permutation(num)
    if num < cfg.batch_size:
        order = np.resize(order, cfg.batch_size)
    return order[k * cfg.batch_size : (k + 1) * cfg.batch_size]


# ------------------------------------------------------------------------------------ kinds


@dataclasses.dataclass(frozen=True)
class Kind:
    """What differs between drafter kinds; the loop, optimiser and checkpoints are shared.

    Attributes:
      name: the kind's name (``--kind``), a key of the checkpoint format table
        (:data:`eaglepangu_jax.drafters.checkpoint.FORMATS`, which gives its config class).
      init_head: ``(config, key, *, embed, d2t, final_norm) -> head``.
      arrays: ``(batches, rows, step, train_cfg, config) -> tuple`` of host arrays of a step.
      loss: ``(head, config, embed, arrays, train_cfg) -> (loss, per-depth accuracy)``.
      evaluate: ``(head, config, embed, held_out_batches) -> report`` with at least ``loss``,
        ``accuracy`` (per depth) and ``chain_accepted_length`` (model selection).
    """

    name: str
    init_head: Callable[..., dict]
    arrays: Callable[..., tuple]
    loss: Callable[..., tuple]
    evaluate: Callable[..., dict]

    @property
    def config_cls(self) -> type:
        return checkpoint_lib.FORMATS[self.name]


def _eagle3_arrays(batches: Batches, rows, step, cfg, config) -> tuple:
    arrays = (batches.features[rows], batches.tokens[rows], batches.targets[rows])
    if cfg.soft_weight <= 0.0:
        return arrays
    if batches.soft_ids is None or batches.soft_probs is None:
        raise ValueError(f"soft_weight {cfg.soft_weight} needs batches with soft targets")
    return arrays + (batches.soft_ids[rows], batches.soft_probs[rows])


def _eagle3_loss(head, config, embed, arrays, cfg):
    features, tokens, targets, *soft = arrays
    return batch_loss(
        head,
        config,
        embed,
        features,
        tokens,
        targets,
        cfg.ttt_steps,
        *soft,
        soft_weight=cfg.soft_weight,
    )


KINDS: dict[str, Kind] = {
    "eagle3": Kind("eagle3", eagle3.init_head, _eagle3_arrays, _eagle3_loss, evaluate),
    "block": Kind(
        "block", block.init_head, train_block.train_arrays, train_block.loss, train_block.evaluate
    ),
    "draft-model": Kind(
        "draft-model",
        train_draft_model.init_head,
        train_draft_model.train_arrays,
        train_draft_model.loss,
        train_draft_model.evaluate,
    ),
}


def kind_of(config: Any) -> Kind:
    """The training kind whose config class ``config`` is."""
    return KINDS[checkpoint_lib.kind_of(config)]


# ------------------------------------------------------------------------------------ loop


def train(
    batches: Batches,
    config: Any,
    vocab: DraftVocab,
    embed,
    cfg: TrainConfig,
    *,
    fingerprint: str,
    checkpoint: str | Path | None = None,
    resume: bool = True,
    final_norm=None,
    initial_head: dict | None = None,
    progress: bool = True,
    until: int | None = None,
    monitor: Callable[[int, dict], None] | None = None,
    monitor_every: int = 100,
    time_limit: float | None = None,
    fit_schedule: bool = False,
    on_fit: Callable[[int, float], None] | None = None,
) -> tuple[dict, list[float]]:
    """Train a head of ``config``'s kind; returns ``(head, losses)``.

    Args:
      checkpoint: checkpoint path (written every ``cfg.checkpoint_every`` steps and at the
        end; resumed from when present and ``resume``).
      initial_head: the starting weights (default: the kind's ``init_head``), e.g. the
        teacher's own layers for a draft model.
      until: stop after this step (default ``cfg.steps``); the schedule still spans
        ``cfg.steps``, so a later call resumes the same run from the checkpoint.
      monitor: called as ``monitor(step, head)`` every ``monitor_every`` steps and after the
        last one (held-out evaluation, keeping the best head).
      time_limit: seconds of training (counted from the first step); the step that passes it
        is the last one, evaluated and checkpointed like the end of the run. For leases of
        fixed length: the schedule still spans ``cfg.steps`` (so the learning rate has not
        decayed to its floor when the limit cuts it), and the returned losses say how many
        steps ran.
      fit_schedule: with ``time_limit``: time steps ``FIT_SKIP`` to ``FIT_SKIP + FIT_PROBE``
        of the run and shorten the schedule so that it ends when the time limit does
        (:func:`fitted_schedule_steps`; ``cfg.steps`` is the ceiling, the warmup unchanged),
        so a lease of fixed length ends on a decayed learning rate whatever the machine's
        speed. The fitted length is saved in the checkpoint (``schedule_steps``) and a resume
        keeps it. Which length is fitted depends on the machine's speed; the run is otherwise
        as deterministic as any.
      on_fit: called as ``on_fit(schedule_steps, steps_per_second)`` once the schedule is fitted.
    """
    if time_limit is not None and not time_limit > 0:
        raise ValueError(f"time_limit must be > 0 seconds, got {time_limit}")
    if fit_schedule and time_limit is None:
        raise ValueError("fit_schedule needs a time_limit to fit the schedule to")
    kind = kind_of(config)
    embed = jnp.asarray(embed, jnp.float32)
    d2t = jnp.asarray(vocab.d2t)
    if initial_head is None:
        head = kind.init_head(
            config, jax.random.key(cfg.seed), embed=embed, d2t=d2t, final_norm=final_norm
        )
    else:
        head = {k: jnp.asarray(v, jnp.float32) for k, v in initial_head.items()}
    opt = make_optimizer(cfg)
    opt_state = opt.init(head)
    start, losses, schedule_steps = 0, [], cfg.steps
    if checkpoint is not None and resume and Path(checkpoint).with_suffix(".json").exists():
        _, head, _, meta, leaves = load_checkpoint(
            checkpoint, fingerprint=fingerprint, config=config
        )
        # Resuming under other settings (another schedule, batch or seed) would silently
        # splice two different runs into one curve.
        stored = meta.get("train", {})
        changed = sorted(
            k for k, v in dataclasses.asdict(cfg).items() if k in stored and stored[k] != v
        )
        if changed:
            raise ValueError(
                f"checkpoint {checkpoint} belongs to a run with other settings "
                f"({', '.join(f'{k}={stored[k]}' for k in changed)}); use the "
                f"same settings, another path, or resume=False"
            )
        treedef = jax.tree_util.tree_structure(opt_state)
        old = jax.tree_util.tree_leaves(opt_state)
        opt_state = jax.tree_util.tree_unflatten(
            treedef, [jnp.asarray(leaves[i]).astype(o.dtype) for i, o in enumerate(old)]
        )
        start, losses = int(meta["step"]), list(meta["losses"])
        schedule_steps = int(meta.get("schedule_steps", cfg.steps))
        fit_schedule = fit_schedule and "schedule_steps" not in meta

    # The schedule's length is an argument, not a constant of the compiled step, so fitting it
    # to a time limit mid-run costs no second compilation.
    @jax.jit
    def step_fn(head, opt_state, arrays, total_steps):
        (loss, accs), grads = jax.value_and_grad(
            lambda h: kind.loss(h, config, embed, arrays, cfg), has_aux=True
        )(head)
        # optax's bias correction mixes a Python float with the int32 count, which strict
        # dtype promotion (as set by the test suite) rejects; our own code stays explicit.
        with jax.numpy_dtype_promotion("standard"):
            updates, opt_state = make_optimizer(cfg, total_steps).update(grads, opt_state, head)
        return optax.apply_updates(head, updates), opt_state, loss, accs

    stop = schedule_steps if until is None else min(until, schedule_steps)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(desc=kind.name, initial=start, total=schedule_steps)
    num = batches.tokens.shape[0]
    began = time.monotonic()
    probe_from = probe_to = None
    if fit_schedule:
        probe_from, probe_to = start + FIT_SKIP, start + FIT_SKIP + FIT_PROBE
    probe_began = began
    step = start
    while step < stop:
        rows = batch_indices(step, num, cfg)
        arrays = tuple(jnp.asarray(a) for a in kind.arrays(batches, rows, step, cfg, config))
        head, opt_state, loss, accs = step_fn(head, opt_state, arrays, jnp.int32(schedule_steps))
        losses.append(float(loss))  # waits for the step: the timings below are the steps'
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{losses[-1]:.3f}", acc0=f"{float(accs[0]):.3f}")
        done = step + 1
        step = done
        now = time.monotonic()
        if done == probe_from:
            probe_began = now
        elif done == probe_to and done < stop:
            rate = FIT_PROBE / max(now - probe_began, 1e-9)
            schedule_steps = fitted_schedule_steps(
                done, rate, time_limit - (now - began), schedule_steps
            )
            stop = schedule_steps if until is None else min(until, schedule_steps)
            if bar is not None:
                bar.total = schedule_steps
                bar.refresh()
            if on_fit is not None:
                on_fit(schedule_steps, rate)
        out_of_time = time_limit is not None and now - began >= time_limit
        last = done == stop or out_of_time
        if monitor is not None and (done % monitor_every == 0 or last):
            monitor(done, head)
        if checkpoint is not None and (done % cfg.checkpoint_every == 0 or last):
            save_checkpoint(
                checkpoint,
                head,
                config,
                vocab.d2t,
                fingerprint=fingerprint,
                opt_state=opt_state,
                extra={
                    "step": done,
                    "schedule_steps": schedule_steps,
                    "losses": losses,
                    "train": dataclasses.asdict(cfg),
                    "vocab_coverage": vocab.coverage,
                },
            )
        if out_of_time:
            break
    if bar is not None:
        bar.close()
    return head, losses


# ------------------------------------------------------------------------------------- CLI
