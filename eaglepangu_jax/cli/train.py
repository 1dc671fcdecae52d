"""``eaglepangu train-draft``: reproduce a shipped drafter (self-distillation + training)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import jax
import numpy as np

from eaglepangu_jax import runtime
from eaglepangu_jax.cli import errors
from eaglepangu_jax.drafters import block, eagle3
from eaglepangu_jax.drafters.checkpoint import (
    load_checkpoint,
    load_starting_head,
    save_checkpoint,
)
from eaglepangu_jax.drafters.draft_target_model import DraftModelConfig, init_from_teacher
from eaglepangu_jax.drafters.eagle3_head import default_feature_layers
from eaglepangu_jax.drafters.vocab import build_vocab, token_counts, vocab_over
from eaglepangu_jax.training import data as data_lib
from eaglepangu_jax.training.train import KINDS, TrainConfig, make_batches, train

__all__ = ["train_draft_main", "steps_time_limit"]


def train_draft_main(argv: Sequence[str] | None = None, *, compile_cache: Any = False) -> int:
    """``train-draft --kind {eagle3,block,draft-model}``: self-distil data (or read a corpus),
    build the vocab, train, export. ``draft-model`` is the distilled draft of draft-target
    speculation: ``--draft-layers`` Llama layers started from the teacher's first ones.
    ``compile_cache`` is the global ``--compile-cache`` value when one was given before the
    command (``False``: none given, no persistent compilation cache).

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
    parser.add_argument(
        "--corpus",
        action="append",
        default=None,
        help="train on this corpus folder (see 'eaglepangu corpus'; its manifest's held-out "
        "shards are held out) instead of answering --prompts template prompts. Repeat to "
        "train on several (e.g. the synthesised corpus and corpus-written); a folder given "
        "twice has its training shards counted twice (held-out shards once); a conversation "
        "whose prompt one corpus holds out is left out of the others' training shards",
    )
    parser.add_argument(
        "--unique-prompts",
        action="store_true",
        help="with several --corpus: train on each prompt once, leaving out of a later "
        "corpus the conversations whose prompt an earlier one trains on (corpora made apart "
        "share prompts, and greedy answers them alike); a folder given twice still counts "
        "twice",
    )
    parser.add_argument(
        "--holdout-shards",
        type=int,
        default=0,
        help="leave the last N shards out of training (and the vocabulary) "
        "and report held-out accuracy on them",
    )
    parser.add_argument(
        "--train-shards",
        type=int,
        default=None,
        help="with --corpus: train on its first N training shards only (default: all); the "
        "teacher features of the others are never computed. Its held-out shards are all kept",
    )
    parser.add_argument("--out", required=True, help="checkpoint path (no suffix)")
    parser.add_argument("--export", default=None, help="also write float16 weights here")
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=224)
    parser.add_argument(
        "--row-overlap",
        type=int,
        default=None,
        metavar="N",
        help="train on long sequences to their end: further rows of --seq-len tokens every "
        "seq-len - N tokens, each opening with N context positions that are not targets "
        "(default: each sequence is cut to its first --seq-len tokens). Held-out rows stay cut",
    )
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--warmup-steps", type=int, default=20)
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument(
        "--eval-every",
        type=int,
        default=100,
        help="with held-out shards (--holdout-shards, or a corpus's held-out split): evaluate "
        "every N steps and export the head with the longest held-out chain accepted length",
    )
    parser.add_argument("--ttt-steps", type=int, default=3, help="eagle3: unrolled steps")
    parser.add_argument("--block-size", type=int, default=8, help="block: slots per block (D)")
    parser.add_argument("--block-layers", type=int, default=2, help="block: drafter layers")
    parser.add_argument(
        "--anchors", type=int, default=16, help="block: blocks per sequence and step"
    )
    parser.add_argument(
        "--draft-layers",
        type=int,
        default=2,
        help="draft-model: layers (started from the teacher's first ones)",
    )
    parser.add_argument(
        "--soft-targets",
        type=float,
        default=0.0,
        metavar="W",
        help="eagle3, draft-model: weight in (0, 1] of a soft-target loss, the teacher's top-K "
        "law of each drafted token over the draft vocabulary (computed from the cached "
        "features), mixed with the hard one as (1 - W) * hard + W * soft (default 0: hard "
        "targets only)",
    )
    parser.add_argument(
        "--soft-top-k",
        type=int,
        default=8,
        metavar="K",
        help="with --soft-targets: teacher tokens kept per position (default 8)",
    )
    parser.add_argument(
        "--context-window",
        type=int,
        default=0,
        help="block: half the blocks see only the last 1..N context positions",
    )
    parser.add_argument(
        "--depth-decay",
        type=float,
        default=TrainConfig.depth_decay,
        help="block: depth i's loss weighs DECAY ** i (smaller: the first depths count more)",
    )
    parser.add_argument(
        "--all-roots-weight",
        type=float,
        default=0.0,
        metavar="W",
        help="block: also learn depth 1 from every position of each row (a one-slot block per "
        "root, about one slot of compute per position), its mean loss weighted W (0: off)",
    )
    parser.add_argument(
        "--init-from",
        default=None,
        metavar="CKPT",
        help="start from the head of this checkpoint or export (same --kind, head shape and "
        "draft vocabulary; a draft-model may change its --vocab-size: shared tokens keep their "
        "head columns; a block drafter its --block-size, or grow deeper with --block-layers: "
        "the new layers start as the identity) with a fresh optimiser and "
        "schedule, e.g. to go on training a head whose held-out loss still fell when its "
        "schedule ended. A checkpoint at --out is "
        "resumed instead",
    )
    parser.add_argument(
        "--time-limit",
        type=float,
        default=None,
        metavar="SECONDS",
        help="stop training after the step that passes this many seconds, counted from the "
        "first step (the teacher features are made before), then evaluate, checkpoint and export "
        "as at the end; the schedule still spans --steps. For machines lent for a fixed time",
    )
    parser.add_argument(
        "--wall-limit",
        type=float,
        default=None,
        metavar="SECONDS",
        help="stop training after the step that passes this many seconds, counted from the "
        "start of the command's work (loading the teacher, its features and the rest of the "
        "set-up included), then evaluate, checkpoint and export as with --time-limit; if the "
        "set-up alone uses them up, one step runs. For jobs that must end by a deadline "
        "whatever the features cost (with both, the earlier limit applies)",
    )
    parser.add_argument(
        "--fit-schedule",
        action="store_true",
        help="with --time-limit or --wall-limit: time the first steps and shorten the schedule "
        "(--steps is its ceiling, the warmup unchanged) so that the learning rate has decayed "
        "when the limit ends the run; the fitted length is printed and saved with the weights",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ray-address", default=None)
    args = parser.parse_args(argv)
    if compile_cache is not False:
        runtime.enable_compile_cache(compile_cache)
    _check_args(parser, args)
    return errors.guard(parser, lambda: _train_draft(parser, args))


def _check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """What can be checked before the model loads: the output folders, and a checkpoint
    already at ``--out`` (resumed from, so it must be readable and of this kind)."""
    if args.draft_layers < 1:
        parser.error(f"--draft-layers must be >= 1, got {args.draft_layers}")
    if args.row_overlap is not None and not 0 <= args.row_overlap < args.seq_len:
        parser.error(
            f"--row-overlap must be in [0, --seq-len={args.seq_len}), got {args.row_overlap}"
        )
    if args.soft_targets:
        if args.kind not in ("eagle3", "draft-model"):
            parser.error("--soft-targets needs --kind eagle3 or --kind draft-model")
        if not 0.0 < args.soft_targets <= 1.0:
            parser.error(f"--soft-targets must be in (0, 1], got {args.soft_targets}")
    if args.all_roots_weight != 0.0:
        if args.kind != "block":
            parser.error("--all-roots-weight trains a block drafter: it needs --kind block")
        if not args.all_roots_weight > 0.0:  # NaN and negatives
            parser.error(f"--all-roots-weight must be >= 0, got {args.all_roots_weight}")
    if args.soft_top_k < 1:
        parser.error(f"--soft-top-k must be >= 1, got {args.soft_top_k}")
    for option, limit in (("--time-limit", args.time_limit), ("--wall-limit", args.wall_limit)):
        if limit is not None and not limit > 0:
            parser.error(f"{option} must be > 0 seconds, got {limit}")
    if args.fit_schedule and args.time_limit is None and args.wall_limit is None:
        parser.error(
            "--fit-schedule fits the schedule to a limit: give --time-limit or --wall-limit"
        )
    if args.holdout_shards < 0:
        parser.error(f"--holdout-shards must be >= 0, got {args.holdout_shards}")
    if args.train_shards is not None:
        if args.corpus is None:
            parser.error("--train-shards needs --corpus")
        if len(args.corpus) > 1:
            parser.error("--train-shards takes a single --corpus")
        if args.train_shards < 1:
            parser.error(f"--train-shards must be >= 1, got {args.train_shards}")
    if args.unique_prompts and args.corpus is None:
        parser.error("--unique-prompts needs --corpus")
    for option, path in (("--out", args.out), ("--export", args.export)):
        if path is not None and not Path(path).resolve().parent.is_dir():
            parser.error(f"{option}: cannot write {path}: its folder does not exist")
    if args.init_from is not None:
        try:  # shape, vocabulary and teacher are checked once those are known
            load_checkpoint(args.init_from, fingerprint=None, kind=args.kind)
        except ValueError as err:
            parser.error(f"--init-from: {err}")
    if Path(args.out).with_suffix(".json").exists():
        try:  # the teacher's fingerprint is checked once the teacher is loaded
            load_checkpoint(args.out, fingerprint=None, kind=args.kind)
        except ValueError as err:
            parser.error(f"--out: cannot resume: {err}")


def steps_time_limit(
    time_limit: float | None, wall_limit: float | None, elapsed: float
) -> float | None:
    """Seconds of training steps allowed: ``time_limit`` (counted from the first step) or what
    ``wall_limit`` (counted from the command's start) leaves after ``elapsed`` seconds of
    set-up, whichever is smaller; ``None`` without either. Never below a millisecond: a
    deadline already passed still runs one step, so the run ends evaluated and exported."""
    limits = [] if time_limit is None else [time_limit]
    if wall_limit is not None:
        limits.append(wall_limit - elapsed)
    return max(min(limits), 1e-3) if limits else None


def _train_draft(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from eaglepangu_jax.engine.decode import Teacher
    from eaglepangu_jax.models import llama, smollm2
    from eaglepangu_jax.models import tokenizer as tok_lib
    from eaglepangu_jax.models.weights_cache import resolve_cache_dir

    t0 = time.time()
    teacher_cfg, params = smollm2.load_smollm2()
    teacher = Teacher(teacher_cfg, llama.prepare_params(params))
    fingerprint = smollm2.teacher_fingerprint()
    tok = tok_lib.load_tokenizer()
    if args.kind == "block":
        head_cfg = block.BlockConfig.for_teacher(
            teacher_cfg, args.vocab_size, block_size=args.block_size, num_layers=args.block_layers
        )
    elif args.kind == "draft-model":
        head_cfg = DraftModelConfig.for_teacher(teacher_cfg, args.vocab_size, args.draft_layers)
    else:
        head_cfg = eagle3.Eagle3Config.for_teacher(teacher_cfg, args.vocab_size)
    taps = head_cfg.feature_layers
    if args.soft_targets and args.kind == "draft-model":
        # computed from EAGLE-3's taps: the feature cache it already made
        taps = default_feature_layers(teacher_cfg.num_layers)
    if args.corpus is not None:
        shards, held, duplicates = corpora(
            args.corpus,
            lambda directory: _corpus_shards(
                parser,
                teacher,
                directory,
                taps,
                fingerprint,
                resolve_cache_dir() / "features",
                train_shards=args.train_shards,
            ),
            unique_prompts=args.unique_prompts,
        )
        if duplicates:
            print(
                f"left out {duplicates} training conversation(s) whose prompt an earlier "
                "given corpus already trains on (--unique-prompts)"
            )
        shards, leaked = data_lib.without_prompts(shards, data_lib.prompts_of(held))
        if leaked:
            print(
                f"left out {leaked} training conversation(s) whose prompt another given corpus "
                "holds out (held-out prompts stay unseen)"
            )
    else:
        shards, held = _prompt_shards(parser, args, teacher, tok, taps, fingerprint)
    counts = token_counts((s.tokens for s in shards), teacher_cfg.vocab_size)
    vocab = build_vocab(counts, args.vocab_size, special_ids=(0, 1, 2))
    if args.init_from is not None:
        # A continued head keeps the draft vocabulary its rows score, even where new data
        # (another corpus) would rank the tokens differently; only a draft model given
        # another --vocab-size moves to a new one (see load_starting_head).
        stored_d2t = load_checkpoint(args.init_from, fingerprint=None, kind=args.kind)[2]
        if len(stored_d2t) == args.vocab_size:
            vocab = vocab_over(stored_d2t, counts)
    print(f"draft vocabulary: {vocab.size} tokens, coverage {vocab.coverage:.4f}")
    batches = make_batches(shards, vocab, args.seq_len, args.row_overlap)
    if args.soft_targets:
        batches = _with_soft_targets(
            batches, teacher, taps, vocab, args.soft_top_k, keep_features=args.kind == "eagle3"
        )
    cfg = TrainConfig(
        steps=args.steps,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        row_overlap=args.row_overlap,
        learning_rate=args.lr,
        warmup_steps=args.warmup_steps,
        weight_decay=args.weight_decay,
        ttt_steps=args.ttt_steps,
        anchors=args.anchors,
        context_window=args.context_window,
        depth_decay=args.depth_decay,
        all_roots_weight=args.all_roots_weight,
        soft_weight=args.soft_targets,
        seed=args.seed,
    )
    best: dict[str, Any] = {}
    history: list[dict[str, Any]] = []

    def monitor(step: int, head: dict) -> None:
        report = KINDS[args.kind].evaluate(head, head_cfg, params["embed"], held_batches)
        history.append(
            {
                "step": step,
                "loss": report["loss"],
                "accuracy": report["accuracy"],
                "chain_accepted_length": report["chain_accepted_length"],
            }
        )
        print(
            f"\nstep {step}: held-out loss {report['loss']:.3f}, accuracy "
            f"{[round(a, 3) for a in report['accuracy'][:4]]}, chain accepted length "
            f"{report['chain_accepted_length']:.3f}",
            flush=True,
        )
        # Acceptance, not likelihood: past the first epochs the held-out loss rises (the
        # marginals grow overconfident) while the held-out accuracy still improves.
        if not best or report["chain_accepted_length"] > best["report"]["chain_accepted_length"]:
            best.update(step=step, head=head, report=report)

    evaluating = bool(held)
    held_batches = make_batches(held, vocab, args.seq_len) if evaluating else None
    initial_head, started_from = None, None
    if args.kind == "draft-model":
        initial_head = init_from_teacher(head_cfg, params, vocab.d2t)
    elif args.kind == "block" and args.init_from is not None:
        # Where --block-layers deepens the stored head, its new layers start from these.
        initial_head = block.init_head(
            head_cfg,
            jax.random.key(args.seed),
            embed=params["embed"],
            d2t=vocab.d2t,
            final_norm=params["final_norm"],
        )
    if args.init_from is not None:
        initial_head, started_from = load_starting_head(
            args.init_from,
            config=head_cfg,
            d2t=vocab.d2t,
            fingerprint=fingerprint,
            fresh_head=initial_head,
        )
        print(f"starting from {args.init_from} (its step {started_from['step']})")
        if "num_layers" in started_from:
            print(
                "block layers {stored} -> {now}: the new ones start as the identity".format(
                    **started_from["num_layers"]
                )
            )
        if "vocabulary" in started_from:
            print(
                "draft vocabulary moved: {kept} columns kept, {new} new".format(
                    **started_from["vocabulary"]
                )
            )
        if Path(args.out).with_suffix(".json").exists():
            print(f"--out {args.out} holds a checkpoint: resuming it (--init-from starts runs)")
    fitted = {}

    def on_fit(schedule_steps: int, steps_per_second: float) -> None:
        fitted.update(schedule_steps=schedule_steps, steps_per_second=steps_per_second)
        print(
            f"schedule fitted to the time limit: {schedule_steps} steps "
            f"(--steps {cfg.steps}), {steps_per_second:.2f} steps/s"
        )

    t_train = time.time()
    head, losses = train(
        batches,
        head_cfg,
        vocab,
        params["embed"],
        cfg,
        fingerprint=fingerprint,
        checkpoint=args.out,
        final_norm=params["final_norm"],
        initial_head=initial_head,
        monitor=monitor if evaluating else None,
        monitor_every=args.eval_every,
        time_limit=steps_time_limit(args.time_limit, args.wall_limit, time.time() - t0),
        fit_schedule=args.fit_schedule,
        on_fit=on_fit,
    )
    if len(losses) < fitted.get("schedule_steps", cfg.steps):
        print(f"time limit reached after step {len(losses)}")
    extra = {
        "step": len(losses),
        "final_loss": losses[-1],
        "train": dataclasses.asdict(cfg),
        "loss_every_10_steps": losses[::10],
        "train_seconds": time.time() - t_train,
        "train_sequences": int(batches.tokens.shape[0]),
        "vocab_coverage": vocab.coverage,
    }
    if fitted:
        extra["fitted_schedule"] = fitted
    if started_from is not None:
        extra["init_from"] = started_from
    if args.soft_targets:
        extra["soft_top_k"] = args.soft_top_k
    if best:
        head = best["head"]
        extra.update(
            step=best["step"],
            held_out={"shards": len(held), **best["report"]},
            held_out_history=history,
        )
        print(f"exporting step {best['step']}; held-out:", json.dumps(best["report"]))
    if best and args.kind == "block":
        # Its marginals feed the tree policies and the controller as acceptance estimates.
        from eaglepangu_jax.training.train_block import fit_depth_temperatures

        calibration = fit_depth_temperatures(head, head_cfg, params["embed"], held_batches)
        extra["calibration"] = calibration
        print("per-depth calibration on the held-out split:", json.dumps(calibration))
    if args.export:
        save_checkpoint(
            args.export,
            head,
            head_cfg,
            vocab.d2t,
            fingerprint=fingerprint,
            dtype=np.float16,
            extra=extra,
        )
    print(f"done in {time.time() - t0:.0f} s; final loss {losses[-1]:.4f}")
    return 0


def _with_soft_targets(batches, teacher, feature_layers, vocab, top_k: int, *, keep_features):
    """``batches`` with the teacher's top-``top_k`` law at every position, computed from the
    features, which are then dropped unless ``keep_features`` (EAGLE-3 reads them; the draft
    model reads tokens only)."""
    from eaglepangu_jax.training.soft_targets import soft_targets

    def report(done: int, total: int) -> None:
        if done == total or done % 512 < 8:  # every 512 rows in chunks of 8
            print(f"soft targets: {done}/{total} rows", flush=True)

    t0 = time.time()
    ids, probs = soft_targets(
        batches.features,
        teacher.params,
        teacher.config,
        feature_layers,
        vocab.d2t,
        top_k=top_k,
        progress=report,
    )
    print(f"soft targets: top-{top_k} in {time.time() - t0:.0f} s")
    if keep_features:
        return dataclasses.replace(batches, soft_ids=ids, soft_probs=probs)
    n, t, _, h = batches.features.shape
    none = np.zeros((n, t, 0, h), np.float16)
    return dataclasses.replace(batches, features=none, soft_ids=ids, soft_probs=probs)


def _prompt_shards(parser, args, teacher, tok, feature_layers, fingerprint):
    """Training and held-out shards answered from the template prompts (the legacy path)."""
    from eaglepangu_jax.models import chat
    from eaglepangu_jax.models.weights_cache import resolve_cache_dir
    from eaglepangu_jax.training.prompts import training_prompts

    settings = data_lib.DataSettings(
        feature_layers=tuple(feature_layers),
        max_new_tokens=args.max_new_tokens,
        shard_size=args.shard_size,
    )
    prompt_ids = [
        chat.encode_chat(tok, [{"role": "user", "content": p}])
        for p in training_prompts(args.prompts, seed=args.seed)
    ]
    data_dir = Path(args.data_dir) if args.data_dir else resolve_cache_dir() / "eagle3-data"
    keys = data_lib.build_dataset(
        teacher,
        prompt_ids,
        settings,
        data_dir,
        fingerprint=fingerprint,
        ray_address=args.ray_address,
    )
    shards = data_lib.load_dataset(data_dir, keys)
    if not 0 <= args.holdout_shards < len(shards):
        parser.error(
            f"--holdout-shards {args.holdout_shards} must lie in [0, "
            f"{len(shards) - 1}] ({len(shards)} shards)"
        )
    held = shards[len(shards) - args.holdout_shards :] if args.holdout_shards else []
    shards = shards[: len(shards) - args.holdout_shards]
    return shards, held


def corpora(
    directories: Sequence[str],
    read: Callable[[str], tuple[list, list]],
    *,
    unique_prompts: bool = False,
):
    """``(training shards, held-out shards, dropped)`` of several corpus folders,
    ``read(folder)`` giving one folder's. A folder given twice is read once: its training
    shards count twice (a way to weight a small corpus), its held-out shards once.

    With ``unique_prompts`` a conversation whose prompt an earlier folder's training shards
    already hold is left out of a later folder's (``dropped`` counts them): corpora made
    apart share prompts (the synthesised ones draw on the same template and code pools), and
    their greedy answers are the same sequence, which would otherwise be trained on twice.
    """
    train_shards, held, seen, trained_on, dropped = [], [], {}, set(), 0
    for directory in directories:
        where = Path(directory).resolve()
        if where not in seen:
            own_train, own_held = read(directory)
            if unique_prompts:
                own_train, left_out = data_lib.without_prompts(own_train, trained_on)
                dropped += left_out
                trained_on |= data_lib.prompts_of(own_train)
            seen[where] = own_train, own_held
            held += own_held
        train_shards += seen[where][0]
    return train_shards, held, dropped


def _corpus_shards(
    parser, teacher, directory, feature_layers, fingerprint, features_dir, *, train_shards=None
):
    """Training and held-out shards of a corpus folder (its manifest's split; only the first
    ``train_shards`` training shards when given), with the teacher features recomputed from
    the ids (cached in ``features_dir``)."""
    from eaglepangu_jax.training import corpus as corpus_lib
    from eaglepangu_jax.training import distill
    from eaglepangu_jax.training.features import shard_features

    try:
        manifest = distill.read_manifest(directory)
    except ValueError as err:
        parser.error(f"--corpus: {err}")
    if manifest["teacher"] != fingerprint:
        parser.error(
            f"--corpus: the corpus in {directory} was answered by teacher "
            f"{manifest['teacher'][:12]}, not the installed {fingerprint[:12]}"
        )
    available = sum(entry["split"] == "train" for entry in manifest["shards"])
    wanted = available if train_shards is None else train_shards
    if wanted > available:
        parser.error(
            f"--train-shards {wanted}: the corpus in {directory} has {available} training shards"
        )
    out: dict[str, list] = {"train": [], "heldout": []}
    for i, entry in enumerate(manifest["shards"]):
        if entry["split"] == "train" and len(out["train"]) == wanted:
            continue  # past the requested training shards: no features computed
        shard = corpus_lib.load_corpus_shard(Path(directory) / "answers", entry["key"])
        if shard is None:
            parser.error(f"--corpus: shard {entry['key']} in {directory} is missing or corrupt")
        print(f"features: shard {i + 1}/{len(manifest['shards'])}", flush=True)
        out[entry["split"]].append(
            shard_features(
                teacher,
                shard,
                entry["sha256"],
                feature_layers,
                features_dir,
                fingerprint=fingerprint,
            )
        )
    return out["train"], out["heldout"]
