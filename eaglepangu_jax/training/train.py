"""Training loop of the EAGLE-3 head: training-time test, AdamW, atomic resumable checkpoints.

Loss: for each of ``ttt_steps`` unrolled steps ``i`` (the head's own hidden state fed back,
:func:`eaglepangu_jax.drafters.eagle3.ttt_logits`), hard cross-entropy of the draft-vocabulary
logits against the teacher's greedy next token (the data *is* the teacher's greedy answer),
averaged over answer positions whose target is in the draft vocabulary, weighted ``0.8 ** i``.
Optimiser: AdamW with linear warmup and cosine decay, gradient clipping at norm 1.

Determinism: batch order is a function of ``(seed, epoch)`` and initialisation of ``seed``, so
the same seed and data give the same loss curve, also across a resume.

Checkpoints are ``<name>.safetensors`` (head weights, ``d2t``, optimiser state) plus
``<name>.json`` (head config, train config, step, teacher fingerprint, losses), both written
atomically. :func:`load_checkpoint` refuses another teacher's checkpoint or wrong shapes.

Timing (2 shared CPU cores, SmolLM2-135M teacher, CLI defaults): ~90-100 s per 16-prompt data
shard, ~7-9 s per training step of 8 sequences x 224 tokens x 3 unrolled steps.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from pathlib import Path
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from eaglepangu_jax.drafters import eagle3
from eaglepangu_jax.drafters.vocab import DraftVocab, build_vocab, token_counts
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
    ttt_steps: int = 3
    seed: int = 0
    checkpoint_every: int = 25

    def __post_init__(self):
        for field in ("steps", "batch_size", "seq_len", "ttt_steps", "checkpoint_every"):
            if getattr(self, field) < 1:
                raise ValueError(f"{field} must be >= 1, got {getattr(self, field)}")


@dataclasses.dataclass(frozen=True)
class Batches:
    """Padded training arrays (host side)."""

    tokens: np.ndarray  # [N, T] int32
    targets: np.ndarray  # [N, T] int32 draft id of each token, -1 when not trainable
    features: np.ndarray  # [N, T, F, H] float16


def make_batches(shards: Sequence[Shard], vocab: DraftVocab, seq_len: int) -> Batches:
    """Cut every sequence to ``seq_len``; only answer tokens inside the draft vocab are targets."""
    t2d = vocab.t2d()
    toks, tgts, feats = [], [], []
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
    if not toks:
        raise ValueError("no training sequences")
    return Batches(np.stack(toks), np.stack(tgts), np.stack(feats))


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


# ------------------------------------------------------------------------------ checkpoints


def save_checkpoint(path: str | Path, head: dict, config: eagle3.Eagle3Config,
                    d2t: np.ndarray, *, fingerprint: str, extra: dict | None = None,
                    opt_state: Any = None, dtype: Any = np.float32) -> None:
    """Write ``path.safetensors`` + ``path.json`` atomically (optimiser state optional)."""
    from safetensors.numpy import save_file

    path = Path(path)
    arrays = {f"head.{k}": np.asarray(v, np.float32).astype(dtype) for k, v in head.items()}
    arrays["d2t"] = np.asarray(d2t, np.int32)
    if opt_state is not None:
        for i, leaf in enumerate(jax.tree_util.tree_leaves(opt_state)):
            arrays[f"opt.{i}"] = np.asarray(leaf)
    meta = {"format": "eaglepangu-eagle3", "version": 1, "teacher_fingerprint": fingerprint,
            "config": config.to_json(), **(extra or {})}
    atomic_write(path.with_suffix(".safetensors"), lambda tmp: save_file(arrays, str(tmp)))
    atomic_write(path.with_suffix(".json"),
                 lambda tmp: tmp.write_text(json.dumps(meta, indent=1, sort_keys=True)))


def load_checkpoint(path: str | Path, *, fingerprint: str | None,
                    config: eagle3.Eagle3Config | None = None
                    ) -> tuple[eagle3.Eagle3Config, dict, np.ndarray, dict, dict]:
    """``(config, head float32, d2t, metadata, optimiser leaves by index)``.

    Args:
      path: checkpoint path without suffix (or with either suffix).
      fingerprint: the teacher it must belong to (``None`` skips the check).
      config: the head shape it must have (``None``: the stored one).

    Raises:
      ValueError: another teacher's checkpoint, or a weight of the wrong shape / missing.
    """
    from safetensors.numpy import load_file

    path = Path(path)
    path = path.with_suffix("") if path.suffix in (".json", ".safetensors") else path
    meta = json.loads(path.with_suffix(".json").read_text())
    stored_fp = meta.get("teacher_fingerprint")
    if fingerprint is not None and stored_fp != fingerprint:
        raise ValueError(f"checkpoint {path} was trained for teacher {str(stored_fp)[:16]}..., "
                         f"not this teacher {fingerprint[:16]}...: refusing to load it")
    stored = eagle3.Eagle3Config.from_json(meta["config"])
    cfg = config if config is not None else stored
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


def train(batches: Batches, config: eagle3.Eagle3Config, vocab: DraftVocab, embed, cfg: TrainConfig,
          *, fingerprint: str, checkpoint: str | Path | None = None, resume: bool = True,
          final_norm=None, progress: bool = True) -> tuple[dict, list[float]]:
    """Train a head; returns ``(head, losses)``; checkpoints to ``checkpoint`` if given."""
    embed = jnp.asarray(embed, jnp.float32)
    d2t = jnp.asarray(vocab.d2t)
    head = eagle3.init_head(config, jax.random.key(cfg.seed), embed=embed, d2t=d2t,
                            final_norm=final_norm)
    opt = make_optimizer(cfg)
    opt_state = opt.init(head)
    start, losses = 0, []
    if checkpoint is not None and resume and Path(checkpoint).with_suffix(".json").exists():
        _, head, _, meta, leaves = load_checkpoint(checkpoint, fingerprint=fingerprint,
                                                   config=config)
        treedef = jax.tree_util.tree_structure(opt_state)
        old = jax.tree_util.tree_leaves(opt_state)
        opt_state = jax.tree_util.tree_unflatten(
            treedef, [jnp.asarray(leaves[i]).astype(o.dtype) for i, o in enumerate(old)])
        start, losses = int(meta["step"]), list(meta["losses"])

    @jax.jit
    def step_fn(head, opt_state, features, tokens, targets):
        (loss, accs), grads = jax.value_and_grad(
            lambda h: batch_loss(h, config, embed, features, tokens, targets, cfg.ttt_steps),
            has_aux=True)(head)
        # optax's bias correction mixes a Python float with the int32 count, which strict
        # dtype promotion (as set by the test suite) rejects; our own code stays explicit.
        with jax.numpy_dtype_promotion("standard"):
            updates, opt_state = opt.update(grads, opt_state, head)
        return optax.apply_updates(head, updates), opt_state, loss, accs

    steps = range(start, cfg.steps)
    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(steps, desc="eagle3", initial=start, total=cfg.steps)
        steps = bar
    num = batches.tokens.shape[0]
    for step in steps:
        rows = batch_indices(step, num, cfg)
        head, opt_state, loss, accs = step_fn(
            head, opt_state, jnp.asarray(batches.features[rows]),
            jnp.asarray(batches.tokens[rows]), jnp.asarray(batches.targets[rows]))
        losses.append(float(loss))
        if bar is not None:
            bar.set_postfix(loss=f"{losses[-1]:.3f}", acc0=f"{float(accs[0]):.3f}")
        done = step + 1
        if checkpoint is not None and (done % cfg.checkpoint_every == 0 or done == cfg.steps):
            save_checkpoint(checkpoint, head, config, vocab.d2t, fingerprint=fingerprint,
                            opt_state=opt_state, extra={
                                "step": done, "losses": losses,
                                "train": dataclasses.asdict(cfg),
                                "vocab_coverage": vocab.coverage})
    return head, losses


# ------------------------------------------------------------------------------------- CLI


def train_draft_main(argv: Sequence[str] | None = None) -> int:
    """``train-draft --kind eagle3``: self-distil data, build the vocab, train, export.

    With the defaults (288 prompts, 128 new tokens, 200 steps of 8 sequences) it takes about
    an hour on two shared CPU cores: ~30 min answering the prompts (18 shards of ~90-100 s),
    ~25 min training (~7-9 s/step). Shards are cached and the training checkpoint resumes.
    """
    parser = argparse.ArgumentParser(prog="eaglepangu train-draft --kind eagle3")
    parser.add_argument("--kind", default="eagle3", choices=["eagle3"])
    parser.add_argument("--prompts", type=int, default=288)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--shard-size", type=int, default=16)
    parser.add_argument("--data-dir", default=None, help="shard directory (default: cache)")
    parser.add_argument("--out", required=True, help="checkpoint path (no suffix)")
    parser.add_argument("--export", default=None, help="also write float16 weights here")
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=224)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--ttt-steps", type=int, default=3)
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
    counts = token_counts((s.tokens for s in shards), teacher_cfg.vocab_size)
    vocab = build_vocab(counts, args.vocab_size, special_ids=(0, 1, 2))
    print(f"draft vocabulary: {vocab.size} tokens, coverage {vocab.coverage:.4f}")
    batches = make_batches(shards, vocab, args.seq_len)
    cfg = TrainConfig(steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len,
                      learning_rate=args.lr, ttt_steps=args.ttt_steps, seed=args.seed)
    head, losses = train(batches, head_cfg, vocab, params["embed"], cfg,
                         fingerprint=fingerprint, checkpoint=args.out,
                         final_norm=params["final_norm"])
    if args.export:
        save_checkpoint(args.export, head, head_cfg, vocab.d2t, fingerprint=fingerprint,
                        dtype=np.float16, extra={"step": cfg.steps, "final_loss": losses[-1],
                                                 "train": dataclasses.asdict(cfg)})
    print(f"done in {time.time() - t0:.0f} s; final loss {losses[-1]:.4f}")
    return 0
