"""Training loop of the draft heads (EAGLE-3, block): AdamW, atomic resumable checkpoints.

One loop, optimiser and checkpoint format serve every drafter kind; a :class:`Kind` names what
differs (config class, initialisation, loss, per-step arrays). The block drafter's objective
lives in :mod:`eaglepangu_jax.training.train_block`.

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

import argparse
import dataclasses
import json
import math
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from eaglepangu_jax.drafters import block, eagle3
from eaglepangu_jax.drafters.vocab import DraftVocab, build_vocab, token_counts
from eaglepangu_jax.training import train_block
from eaglepangu_jax.training.data import Shard, atomic_write

STEP_DECAY = 0.8


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Optimisation settings (saved with every checkpoint)."""

    steps: int = 200
    batch_size: int = 8
    seq_len: int = 256
    learning_rate: float = 1e-3
    warmup_steps: int = 20
    weight_decay: float = 0.01
    ttt_steps: int = 3  # EAGLE-3: unrolled training-time-test steps
    anchors: int = 16  # block drafter: blocks (root positions) per sequence and step
    context_window: int = 0  # block drafter: half the blocks see only the last 1..N positions
    seed: int = 0
    checkpoint_every: int = 25

    def __post_init__(self):
        for field in ("steps", "batch_size", "seq_len", "ttt_steps", "anchors",
                      "checkpoint_every"):
            if getattr(self, field) < 1:
                raise ValueError(f"{field} must be >= 1, got {getattr(self, field)}")
        if self.context_window < 0:
            raise ValueError(f"context_window must be >= 0, got {self.context_window}")


@dataclasses.dataclass(frozen=True)
class Batches:
    """Padded training arrays (host side)."""

    tokens: np.ndarray  # [N, T] int32
    targets: np.ndarray  # [N, T] int32 draft id of each token, -1 when not trainable
    features: np.ndarray  # [N, T, F, H] float16
    prompt_lens: np.ndarray  # [N] int32 prompt tokens (cut to the row)
    lengths: np.ndarray  # [N] int32 real tokens of each row (the rest is padding)


def make_batches(shards: Sequence[Shard], vocab: DraftVocab, seq_len: int) -> Batches:
    """Cut every sequence to ``seq_len``; only answer tokens inside the draft vocab are targets."""
    t2d = vocab.t2d()
    toks, tgts, feats, prompt_lens, lengths = [], [], [], [], []
    for shard in shards:
        for seq, feat, prompt_len in shard.sequences():
            n = min(len(seq), seq_len)
            tok = np.zeros((seq_len,), np.int32)
            tok[:n] = seq[:n]
            tgt = np.full((seq_len,), -1, np.int32)
            tgt[:n] = t2d[seq[:n]]
            tgt[:prompt_len] = -1  # prompt tokens are not the teacher's predictions
            f = np.zeros((seq_len,) + feat.shape[1:], np.float16)
            f[:n] = feat[:n]
            toks.append(tok)
            tgts.append(tgt)
            feats.append(f)
            prompt_lens.append(min(prompt_len, n))
            lengths.append(n)
    if not toks:
        raise ValueError("no training sequences")
    return Batches(np.stack(toks), np.stack(tgts), np.stack(feats),
                   np.asarray(prompt_lens, np.int32), np.asarray(lengths, np.int32))


def sequence_loss(head: dict, config: eagle3.Eagle3Config, embed, features, tokens, targets,
                  steps: int):
    """Weighted training-time-test loss of one sequence and per-step (loss sum, hits, count)."""
    logits = eagle3.ttt_logits(head, config, embed, features, tokens, steps)  # [K, T, Vd]
    t = tokens.shape[0]
    total, stats = jnp.float32(0.0), []
    for i in range(steps):
        tgt = jnp.concatenate([targets[i + 2:], jnp.full((i + 2,), -1, jnp.int32)])[:t]
        ok = tgt >= 0
        logp = jax.nn.log_softmax(logits[i], axis=-1)
        picked = jnp.take_along_axis(logp, jnp.maximum(tgt, 0)[:, None], axis=-1)[:, 0]
        nll = jnp.where(ok, -picked, 0.0)
        hit = ok & (jnp.argmax(logits[i], axis=-1) == tgt)
        stats.append((jnp.sum(nll), jnp.sum(hit.astype(jnp.float32)),
                      jnp.sum(ok.astype(jnp.float32))))
    return stats


def batch_loss(head, config, embed, features, tokens, targets, steps):
    """Mean over each step's targets, steps weighted ``0.8 ** i``; also step accuracies."""
    per = jax.vmap(lambda f, tk, tg: sequence_loss(head, config, embed, f.astype(jnp.float32),
                                                   tk, tg, steps))(features, tokens, targets)
    loss, accs = jnp.float32(0.0), []
    for i, (nll, hit, count) in enumerate(per):
        n = jnp.maximum(jnp.sum(count), 1.0)
        loss = loss + jnp.float32(STEP_DECAY ** i) * jnp.sum(nll) / n
        accs.append(jnp.sum(hit) / n)
    return loss, jnp.stack(accs)


def lr_schedule(cfg: TrainConfig):
    """Linear warmup to ``learning_rate``, then cosine decay to 5% of it at ``steps``.

    Written out (not optax's helper) so every operation is dtype-explicit: the step count is
    int32 and the tests run under strict dtype promotion.
    """
    peak, warm = cfg.learning_rate, max(min(cfg.warmup_steps, cfg.steps - 1), 1)

    def schedule(count):
        t = jnp.asarray(count).astype(jnp.float32)
        warmup = jnp.float32(peak) * t / jnp.float32(warm)
        frac = jnp.clip((t - jnp.float32(warm)) / jnp.float32(max(cfg.steps - warm, 1)), 0.0, 1.0)
        cosine = jnp.float32(peak) * (jnp.float32(0.05) + jnp.float32(0.95 * 0.5)
                                      * (1.0 + jnp.cos(jnp.float32(math.pi) * frac)))
        return jnp.where(t < jnp.float32(warm), warmup, cosine)

    return schedule


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    return optax.chain(optax.clip_by_global_norm(1.0),
                       optax.adamw(lr_schedule(cfg), weight_decay=cfg.weight_decay))


def batch_indices(step: int, num: int, cfg: TrainConfig) -> np.ndarray:
    """Rows of batch ``step``: a per-epoch permutation seeded by ``(seed, epoch)``."""
    per_epoch = max(num // cfg.batch_size, 1)
    epoch, k = divmod(step, per_epoch)
    order = np.random.default_rng([cfg.seed, epoch]).permutation(num)
    if num < cfg.batch_size:
        order = np.resize(order, cfg.batch_size)
    return order[k * cfg.batch_size: (k + 1) * cfg.batch_size]


# ------------------------------------------------------------------------------------ kinds


@dataclasses.dataclass(frozen=True)
class Kind:
    """What differs between drafter kinds; the loop, optimiser and checkpoints are shared.

    Attributes:
      name: the kind's name (``--kind``); checkpoints store ``format = "eaglepangu-<name>"``.
      config_cls: its config class (``to_json`` / ``from_json`` / ``head_shapes``).
      init_head: ``(config, key, *, embed, d2t, final_norm) -> head``.
      arrays: ``(batches, rows, step, train_cfg, config) -> tuple`` of host arrays of a step.
      loss: ``(head, config, embed, arrays, train_cfg) -> (loss, per-depth accuracy)``.
    """

    name: str
    config_cls: type
    init_head: Callable[..., dict]
    arrays: Callable[..., tuple]
    loss: Callable[..., tuple]

    @property
    def format(self) -> str:
        return f"eaglepangu-{self.name}"


def _eagle3_arrays(batches: Batches, rows, step, cfg, config) -> tuple:
    return batches.features[rows], batches.tokens[rows], batches.targets[rows]


def _eagle3_loss(head, config, embed, arrays, cfg):
    return batch_loss(head, config, embed, *arrays, cfg.ttt_steps)


KINDS: dict[str, Kind] = {
    "eagle3": Kind("eagle3", eagle3.Eagle3Config, eagle3.init_head, _eagle3_arrays,
                   _eagle3_loss),
    "block": Kind("block", block.BlockConfig, block.init_head, train_block.train_arrays,
                  train_block.loss),
}


def kind_of(config: Any) -> Kind:
    """The kind whose config class ``config`` is."""
    for kind in KINDS.values():
        if isinstance(config, kind.config_cls):
            return kind
    raise ValueError(f"no drafter kind has config type {type(config).__name__}; known kinds: "
                     f"{sorted(KINDS)}")


# ------------------------------------------------------------------------------ checkpoints


def save_checkpoint(path: str | Path, head: dict, config: Any, d2t: np.ndarray, *,
                    fingerprint: str, extra: dict | None = None, opt_state: Any = None,
                    dtype: Any = np.float32) -> None:
    """Write ``path.safetensors`` + ``path.json`` atomically (optimiser state optional);
    ``config`` (an EAGLE-3 or block config) decides the stored ``format``."""
    from safetensors.numpy import save_file

    path = Path(path)
    kind = kind_of(config)
    arrays = {f"head.{k}": np.asarray(v, np.float32).astype(dtype) for k, v in head.items()}
    arrays["d2t"] = np.asarray(d2t, np.int32)
    if opt_state is not None:
        for i, leaf in enumerate(jax.tree_util.tree_leaves(opt_state)):
            arrays[f"opt.{i}"] = np.asarray(leaf)
    meta = {"format": kind.format, "version": 1, "teacher_fingerprint": fingerprint,
            "config": config.to_json(), **(extra or {})}
    atomic_write(path.with_suffix(".safetensors"), lambda tmp: save_file(arrays, str(tmp)))
    atomic_write(path.with_suffix(".json"),
                 lambda tmp: tmp.write_text(json.dumps(meta, indent=1, sort_keys=True)))


def load_checkpoint(path: str | Path, *, fingerprint: str | None, config: Any = None,
                    kind: str | None = None) -> tuple[Any, dict, np.ndarray, dict, dict]:
    """``(config, head float32, d2t, metadata, optimiser leaves by index)``.

    Args:
      path: checkpoint path without suffix (or with either suffix).
      fingerprint: the teacher it must belong to (``None`` skips the check).
      config: the head shape it must have (``None``: the stored one); also fixes the kind.
      kind: the drafter kind it must hold (``"eagle3"``, ``"block"``; ``None``: any).

    Raises:
      ValueError: another teacher's checkpoint, another kind, an unknown format, or a weight
        of the wrong shape / missing.
    """
    from safetensors.numpy import load_file

    path = Path(path)
    path = path.with_suffix("") if path.suffix in (".json", ".safetensors") else path
    meta = json.loads(path.with_suffix(".json").read_text())
    stored_fp = meta.get("teacher_fingerprint")
    if fingerprint is not None and stored_fp != fingerprint:
        raise ValueError(f"checkpoint {path} was trained for teacher {str(stored_fp)[:16]}..., "
                         f"not this teacher {fingerprint[:16]}...: refusing to load it")
    by_format = {k.format: k for k in KINDS.values()}
    stored_kind = by_format.get(meta.get("format"))
    if stored_kind is None:
        raise ValueError(f"checkpoint {path} has format {meta.get('format')!r}; known formats: "
                         f"{sorted(by_format)}")
    wanted = kind if config is None else kind_of(config).name
    if wanted is not None and wanted != stored_kind.name:
        raise ValueError(f"checkpoint {path} holds a drafter of kind {stored_kind.name!r}, "
                         f"not the {wanted!r} asked for")
    cfg = config if config is not None else stored_kind.config_cls.from_json(meta["config"])
    arrays = load_file(str(path.with_suffix(".safetensors")))
    head = {}
    for name, shape in cfg.head_shapes().items():
        arr = arrays.get(f"head.{name}")
        if arr is None or tuple(arr.shape) != shape:
            got = None if arr is None else tuple(arr.shape)
            raise ValueError(f"checkpoint {path}: weight {name!r} has shape {got}, the head "
                             f"needs {shape}")
        head[name] = jnp.asarray(arr.astype(np.float32))
    d2t = arrays.get("d2t")
    if d2t is None or d2t.shape != (cfg.draft_vocab_size,):
        raise ValueError(f"checkpoint {path}: d2t has shape "
                         f"{None if d2t is None else d2t.shape}, expected "
                         f"({cfg.draft_vocab_size},)")
    if d2t.min() < 0 or d2t.max() >= cfg.teacher_vocab_size:
        raise ValueError(f"checkpoint {path}: d2t holds ids outside the teacher vocabulary")
    opt = {int(k.split(".")[1]): v for k, v in arrays.items() if k.startswith("opt.")}
    return cfg, head, d2t, meta, opt


# ------------------------------------------------------------------------------------ loop


def train(batches: Batches, config: Any, vocab: DraftVocab, embed, cfg: TrainConfig, *,
          fingerprint: str, checkpoint: str | Path | None = None, resume: bool = True,
          final_norm=None, progress: bool = True, until: int | None = None,
          monitor: Callable[[int, dict], None] | None = None, monitor_every: int = 100
          ) -> tuple[dict, list[float]]:
    """Train a head of ``config``'s kind; returns ``(head, losses)``.

    Args:
      checkpoint: checkpoint path (written every ``cfg.checkpoint_every`` steps and at the
        end; resumed from when present and ``resume``).
      until: stop after this step (default ``cfg.steps``); the schedule still spans
        ``cfg.steps``, so a later call resumes the same run from the checkpoint.
      monitor: called as ``monitor(step, head)`` every ``monitor_every`` steps and after the
        last one (held-out evaluation, keeping the best head).
    """
    kind = kind_of(config)
    embed = jnp.asarray(embed, jnp.float32)
    d2t = jnp.asarray(vocab.d2t)
    head = kind.init_head(config, jax.random.key(cfg.seed), embed=embed, d2t=d2t,
                          final_norm=final_norm)
    opt = make_optimizer(cfg)
    opt_state = opt.init(head)
    start, losses = 0, []
    if checkpoint is not None and resume and Path(checkpoint).with_suffix(".json").exists():
        _, head, _, meta, leaves = load_checkpoint(checkpoint, fingerprint=fingerprint,
                                                   config=config)
        # Resuming under other settings (another schedule, batch or seed) would silently
        # splice two different runs into one curve.
        stored = meta.get("train", {})
        changed = sorted(k for k, v in dataclasses.asdict(cfg).items()
                         if k in stored and stored[k] != v)
        if changed:
            raise ValueError(f"checkpoint {checkpoint} belongs to a run with other settings "
                             f"({', '.join(f'{k}={stored[k]}' for k in changed)}); use the "
                             f"same settings, another path, or resume=False")
        treedef = jax.tree_util.tree_structure(opt_state)
        old = jax.tree_util.tree_leaves(opt_state)
        opt_state = jax.tree_util.tree_unflatten(
            treedef, [jnp.asarray(leaves[i]).astype(o.dtype) for i, o in enumerate(old)])
        start, losses = int(meta["step"]), list(meta["losses"])

    @jax.jit
    def step_fn(head, opt_state, arrays):
        (loss, accs), grads = jax.value_and_grad(
            lambda h: kind.loss(h, config, embed, arrays, cfg), has_aux=True)(head)
        # optax's bias correction mixes a Python float with the int32 count, which strict
        # dtype promotion (as set by the test suite) rejects; our own code stays explicit.
        with jax.numpy_dtype_promotion("standard"):
            updates, opt_state = opt.update(grads, opt_state, head)
        return optax.apply_updates(head, updates), opt_state, loss, accs

    stop = cfg.steps if until is None else min(until, cfg.steps)
    steps = range(start, stop)
    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(steps, desc=kind.name, initial=start, total=cfg.steps)
        steps = bar
    num = batches.tokens.shape[0]
    for step in steps:
        rows = batch_indices(step, num, cfg)
        arrays = tuple(jnp.asarray(a) for a in kind.arrays(batches, rows, step, cfg, config))
        head, opt_state, loss, accs = step_fn(head, opt_state, arrays)
        losses.append(float(loss))
        if bar is not None:
            bar.set_postfix(loss=f"{losses[-1]:.3f}", acc0=f"{float(accs[0]):.3f}")
        done = step + 1
        if monitor is not None and (done % monitor_every == 0 or done == stop):
            monitor(done, head)
        if checkpoint is not None and (done % cfg.checkpoint_every == 0 or done == stop):
            save_checkpoint(checkpoint, head, config, vocab.d2t, fingerprint=fingerprint,
                            opt_state=opt_state, extra={
                                "step": done, "losses": losses,
                                "train": dataclasses.asdict(cfg),
                                "vocab_coverage": vocab.coverage})
    return head, losses


# ------------------------------------------------------------------------------------- CLI


def train_draft_main(argv: Sequence[str] | None = None) -> int:
    """``train-draft --kind {eagle3,block}``: self-distil data, build the vocab, train, export.

    Both kinds read the same cached shards (same prompts, teacher and tapped layers). With the
    defaults (288 prompts, 128 new tokens) answering the prompts takes ~10-30 min on two shared
    CPU cores (18 shards of 35-100 s; cached, so only once). EAGLE-3 training: 200 steps of
    ~7-9 s. Block training, as shipped (``--kind block --steps 600 --anchors 16 --lr 3e-3
    --warmup-steps 50 --weight-decay 0.1 --context-window 32 --holdout-shards 1
    --eval-every 200``): ~0.7 s per step, 7.7 min in all. The training checkpoint resumes
    (the held-out tracking of ``--eval-every`` does not: it covers the last uninterrupted part).
    """
    parser = argparse.ArgumentParser(prog="eaglepangu train-draft")
    parser.add_argument("--kind", default="eagle3", choices=sorted(KINDS))
    parser.add_argument("--prompts", type=int, default=288)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--shard-size", type=int, default=16)
    parser.add_argument("--data-dir", default=None, help="shard directory (default: cache)")
    parser.add_argument("--holdout-shards", type=int, default=0,
                        help="leave the last N shards out of training (and the vocabulary) "
                             "and report held-out accuracy on them")
    parser.add_argument("--out", required=True, help="checkpoint path (no suffix)")
    parser.add_argument("--export", default=None, help="also write float16 weights here")
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=224)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--warmup-steps", type=int, default=20)
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--eval-every", type=int, default=100,
                        help="block with --holdout-shards: evaluate every N steps and export "
                             "the head with the longest held-out chain accepted length")
    parser.add_argument("--ttt-steps", type=int, default=3, help="eagle3: unrolled steps")
    parser.add_argument("--block-size", type=int, default=8, help="block: slots per block (D)")
    parser.add_argument("--block-layers", type=int, default=2, help="block: drafter layers")
    parser.add_argument("--anchors", type=int, default=16,
                        help="block: blocks per sequence and step")
    parser.add_argument("--context-window", type=int, default=0,
                        help="block: half the blocks see only the last 1..N context positions")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ray-address", default=None)
    args = parser.parse_args(argv)

    from eaglepangu_jax.engine.generate import Teacher
    from eaglepangu_jax.models import chat, llama, smollm2, tokenizer as tok_lib
    from eaglepangu_jax.models.weights_cache import resolve_cache_dir
    from eaglepangu_jax.training import data as data_lib
    from eaglepangu_jax.training.prompts import training_prompts

    t0 = time.time()
    teacher_cfg, params = smollm2.load_smollm2()
    teacher = Teacher(teacher_cfg, llama.prepare_params(params))
    fingerprint = smollm2.teacher_fingerprint()
    tok = tok_lib.load_tokenizer()
    if args.kind == "block":
        head_cfg = block.BlockConfig.for_teacher(teacher_cfg, args.vocab_size,
                                                 block_size=args.block_size,
                                                 num_layers=args.block_layers)
    else:
        head_cfg = eagle3.Eagle3Config.for_teacher(teacher_cfg, args.vocab_size)
    settings = data_lib.DataSettings(feature_layers=head_cfg.feature_layers,
                                     max_new_tokens=args.max_new_tokens,
                                     shard_size=args.shard_size)
    prompt_ids = [chat.encode_chat(tok, [{"role": "user", "content": p}])
                  for p in training_prompts(args.prompts, seed=args.seed)]
    data_dir = Path(args.data_dir) if args.data_dir else resolve_cache_dir() / "eagle3-data"
    keys = data_lib.build_dataset(teacher, prompt_ids, settings, data_dir,
                                  fingerprint=fingerprint, ray_address=args.ray_address)
    shards = data_lib.load_dataset(data_dir, keys)
    if not 0 <= args.holdout_shards < len(shards):
        raise ValueError(f"--holdout-shards {args.holdout_shards} must lie in [0, "
                         f"{len(shards) - 1}] ({len(shards)} shards)")
    held = shards[len(shards) - args.holdout_shards:] if args.holdout_shards else []
    shards = shards[: len(shards) - args.holdout_shards]
    counts = token_counts((s.tokens for s in shards), teacher_cfg.vocab_size)
    vocab = build_vocab(counts, args.vocab_size, special_ids=(0, 1, 2))
    print(f"draft vocabulary: {vocab.size} tokens, coverage {vocab.coverage:.4f}")
    batches = make_batches(shards, vocab, args.seq_len)
    cfg = TrainConfig(steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len,
                      learning_rate=args.lr, warmup_steps=args.warmup_steps,
                      weight_decay=args.weight_decay, ttt_steps=args.ttt_steps,
                      anchors=args.anchors, context_window=args.context_window,
                      seed=args.seed)
    best: dict[str, Any] = {}
    history: list[dict[str, Any]] = []

    def monitor(step: int, head: dict) -> None:
        report = train_block.evaluate(head, head_cfg, params["embed"], held_batches)
        history.append({"step": step, "loss": report["loss"], "accuracy": report["accuracy"],
                        "chain_accepted_length": report["chain_accepted_length"]})
        print(f"\nstep {step}: held-out loss {report['loss']:.3f}, accuracy "
              f"{[round(a, 3) for a in report['accuracy'][:4]]}, chain accepted length "
              f"{report['chain_accepted_length']:.3f}", flush=True)
        # Acceptance, not likelihood: past the first epochs the held-out loss rises (the
        # marginals grow overconfident) while the held-out accuracy still improves.
        if not best or report["chain_accepted_length"] > best["report"]["chain_accepted_length"]:
            best.update(step=step, head=head, report=report)

    evaluating = bool(held) and args.kind == "block"
    held_batches = make_batches(held, vocab, args.seq_len) if evaluating else None
    t_train = time.time()
    head, losses = train(batches, head_cfg, vocab, params["embed"], cfg,
                         fingerprint=fingerprint, checkpoint=args.out,
                         final_norm=params["final_norm"],
                         monitor=monitor if evaluating else None, monitor_every=args.eval_every)
    extra = {"step": cfg.steps, "final_loss": losses[-1], "train": dataclasses.asdict(cfg),
             "loss_every_10_steps": losses[::10], "train_seconds": time.time() - t_train,
             "train_sequences": int(batches.tokens.shape[0]), "vocab_coverage": vocab.coverage}
    if best:
        head = best["head"]
        extra.update(step=best["step"], held_out={"shards": len(held), **best["report"]},
                     held_out_history=history)
        print(f"exporting step {best['step']}; held-out:", json.dumps(best["report"]))
    if args.export:
        save_checkpoint(args.export, head, head_cfg, vocab.d2t, fingerprint=fingerprint,
                        dtype=np.float16, extra=extra)
    print(f"done in {time.time() - t0:.0f} s; final loss {losses[-1]:.4f}")
    return 0
