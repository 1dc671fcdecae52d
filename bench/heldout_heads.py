"""Held-out figures of draft-head checkpoints, offline: on a corpus's held-out split, or on the
teacher's own greedy answers to an evaluation suite.

For each checkpoint (EAGLE-3, block or distilled draft model, e.g. the shipped ones and a new
training run) the teacher features of the sequences are computed from the ids (a corpus's are
read from the feature cache; a draft model reads none), the targets are mapped through *that
checkpoint's own* draft vocabulary, and the training code's evaluation runs: per-depth top-1
accuracy and the accepted length of a single top-1 chain (bonus token included). Every row
also gives the draft vocabulary's coverage: the share of answer tokens it holds (a token
outside it can never be drafted). Block checkpoints also report the per-depth calibration
error of their marginals, raw and with the stored temperatures::

    python3 bench/heldout_heads.py --corpus eaglepangu_jax/data/corpus \\
        --checkpoint eaglepangu_jax/weights/eagle3_smollm2 \\
        --checkpoint eaglepangu_jax/weights/block_smollm2 --json heldout.json

With ``--suite`` instead of ``--corpus`` the sequences are the evaluation suite's turns as the
bench builds them (a later turn follows the greedy answer to the earlier one) with the
teacher's greedy answer, so a head's offline figures on its training distribution and on the
benchmark's prompts can be set side by side; those rows are also split by category::

    python3 bench/heldout_heads.py --suite mtbench-humaneval --per-category 1 \\
        --checkpoint eaglepangu_jax/weights/draft_distilled_smollm2 --json suite.json
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path


def corpus_split(corpus: str, split: str):
    """Yield ``(manifest entry, corpus shard)`` of every shard of ``split`` in the manifest."""
    from eaglepangu_jax.training import corpus as corpus_lib
    from eaglepangu_jax.training import distill

    for entry in distill.read_manifest(corpus)["shards"]:
        if entry["split"] != split:
            continue
        shard = corpus_lib.load_corpus_shard(Path(corpus) / "answers", entry["key"])
        if shard is None:
            raise SystemExit(f"corpus shard {entry['key']} is missing or corrupt")
        yield entry, shard


def corpus_shards(teacher, corpus: str, feature_layers, fingerprint: str) -> list:
    """The corpus's held-out shards with the teacher features ``feature_layers``."""
    from eaglepangu_jax.models.weights_cache import resolve_cache_dir
    from eaglepangu_jax.training.features import shard_features

    held = []
    for entry, shard in corpus_split(corpus, "heldout"):
        held.append(
            shard_features(
                teacher,
                shard,
                entry["sha256"],
                feature_layers,
                resolve_cache_dir() / "features",
                fingerprint=fingerprint,
            )
        )
    return held


def suite_sequences(teacher, suite: str, per_category: int, max_new_tokens: int) -> list:
    """``(category, ids, prompt_len)`` of every turn: the bench's prompt and greedy answer."""
    from eaglepangu_jax import runtime
    from eaglepangu_jax.engine.config import SpecConfig
    from eaglepangu_jax.evaluation import suites
    from eaglepangu_jax.evaluation.run import check_prompts, generate_with
    from eaglepangu_jax.methods.registry import REFERENCE, make_method

    renderer = runtime.load_renderer()
    conversations = suites.load_suite(suite)
    if per_category:
        conversations = suites.per_category(conversations, per_category)
    check_prompts(conversations, renderer, teacher.config, max_new_tokens)
    greedy = make_method(REFERENCE, SpecConfig(max_new_tokens=max_new_tokens))
    out = []
    for conversation in conversations:
        history: list[dict[str, str]] = []
        for text in conversation.turns:
            history.append({"role": "user", "content": text})
            prompt = renderer.encode(history)
            answer = generate_with(teacher, greedy, prompt).tokens
            out.append((conversation.category, list(prompt) + list(answer), len(prompt)))
            history.append({"role": "assistant", "content": renderer.decode(answer)})
            print(f"{conversation.category}: {len(prompt)} + {len(answer)} tokens", flush=True)
    return out


def suite_shards(teacher, sequences: list, feature_layers) -> tuple[list, dict[str, list]]:
    """The ``(category, ids, prompt_len)`` rows as in-memory shards with their features (each
    sequence's computed once): ``([all rows], {category: [its rows]})``."""
    import numpy as np

    from eaglepangu_jax.training.data import Shard
    from eaglepangu_jax.training.features import sequence_features

    ids = [np.asarray(s, np.int32) for _, s, _ in sequences]
    if feature_layers:
        feats = sequence_features(teacher, ids, feature_layers)
    else:  # a draft model reads tokens only
        feats = [np.zeros((len(s), 0, 1), np.float16) for s in ids]

    def shard(rows: list[int]) -> Shard:
        return Shard(
            tokens=np.concatenate([ids[i] for i in rows]),
            offsets=np.concatenate([[0], np.cumsum([len(ids[i]) for i in rows])]).astype(np.int64),
            prompt_lens=np.asarray([sequences[i][2] for i in rows], np.int32),
            features=np.concatenate([feats[i] for i in rows]).astype(np.float16),
        )

    categories = sorted({c for c, _, _ in sequences})
    groups = {c: [shard([i for i, s in enumerate(sequences) if s[0] == c])] for c in categories}
    return [shard(list(range(len(sequences))))], groups


def coverage(shards, vocab) -> float:
    """Share of answer tokens inside the draft vocabulary."""
    t2d = vocab.t2d()
    inside = total = 0
    for shard in shards:
        for seq, _, prompt_len in shard.sequences():
            answer = seq[prompt_len:]
            inside += int((t2d[answer] >= 0).sum())
            total += len(answer)
    return inside / max(total, 1)


def training_vocabularies(corpus: str, sizes: list[int], vocab_size: int) -> dict[str, object]:
    """A draft vocabulary of each size, built as training builds it: the most frequent ids of
    the corpus's training split (prompts and answers)."""
    import numpy as np

    from eaglepangu_jax.drafters.vocab import build_vocab

    counts = np.zeros((vocab_size,), np.int64)
    for _, shard in corpus_split(corpus, "train"):
        for ids in (shard.prompt_ids, shard.answer_ids):
            counts += np.bincount(np.asarray(ids, np.int64), minlength=vocab_size)
    return {str(n): build_vocab(counts, n) for n in sizes}


def evaluate(kind: str, head, config, embed, batches, depth: int, meta: dict) -> dict:
    """The training code's held-out evaluation of one head kind."""
    from eaglepangu_jax.training import train, train_block, train_draft_model

    if kind.endswith("eagle3"):
        return train.evaluate(head, config, embed, batches, depth=depth)
    if kind.endswith("draft-model"):
        return train_draft_model.evaluate(head, config, embed, batches, depth=depth)
    report = train_block.evaluate(head, config, embed, batches)
    calibration = train_block.fit_depth_temperatures(head, config, embed, batches)
    report["ece_raw"] = calibration["ece_before"]
    report["fitted_depth_temperature"] = calibration["depth_temperature"]
    given_chain = train_block.fit_depth_temperatures(head, config, embed, batches, given_chain=True)
    report["given_chain_calibration"] = given_chain
    report["stored_depth_temperature"] = meta.get("calibration", {}).get("depth_temperature")
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--corpus", help="corpus folder (its manifest's held-out split)")
    source.add_argument("--suite", help="evaluation suite (e.g. mtbench-humaneval)")
    parser.add_argument("--per-category", type=int, default=0, help="--suite: N per category")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="--suite: answer length")
    parser.add_argument(
        "--checkpoint", action="append", required=True, help="checkpoint path (no suffix)"
    )
    parser.add_argument("--seq-len", type=int, default=512, help="tokens kept per sequence")
    parser.add_argument("--depth", type=int, default=6, help="EAGLE-3 / draft-model chain depth")
    parser.add_argument(
        "--coverage-sizes",
        default="",
        help="comma-separated draft vocabulary sizes: also report the answers' coverage by a "
        "vocabulary of each size built from --vocab-corpus's training split",
    )
    parser.add_argument(
        "--vocab-corpus",
        default="eaglepangu_jax/data/corpus",
        help="corpus whose training split the --coverage-sizes vocabularies come from",
    )
    parser.add_argument("--json", required=True)
    args = parser.parse_args()
    try:
        sizes = [int(n) for n in args.coverage_sizes.split(",") if n.strip()]
    except ValueError:
        parser.error(f"--coverage-sizes: expected integers, got {args.coverage_sizes!r}")
    if args.per_category < 0 or args.max_new_tokens < 1:
        parser.error("--per-category must be >= 0 and --max-new-tokens >= 1")

    import numpy as np

    from eaglepangu_jax.drafters.checkpoint import load_checkpoint
    from eaglepangu_jax.drafters.vocab import DraftVocab
    from eaglepangu_jax.engine.decode import Teacher
    from eaglepangu_jax.files import write_json_atomic
    from eaglepangu_jax.models import llama, smollm2
    from eaglepangu_jax.training import train

    cfg, params = smollm2.load_smollm2()
    teacher = Teacher(cfg, llama.prepare_params(params))
    fingerprint = smollm2.teacher_fingerprint()
    sequences = None
    if args.suite:
        sequences = suite_sequences(teacher, args.suite, args.per_category, args.max_new_tokens)
    sized = training_vocabularies(args.vocab_corpus, sizes, cfg.vocab_size) if sizes else {}
    rows = []
    for path in args.checkpoint:
        config, head, d2t, meta, _ = load_checkpoint(path, fingerprint=fingerprint)
        vocab = DraftVocab(np.asarray(d2t, np.int32), cfg.vocab_size, float("nan"))
        layers = config.feature_layers
        if sequences is None:
            held = corpus_shards(teacher, args.corpus, layers, fingerprint)
            groups = {}
        else:
            held, groups = suite_shards(teacher, sequences, layers)
        start = time.perf_counter()
        batches = train.make_batches(held, vocab, args.seq_len)
        report = evaluate(meta["format"], head, config, params["embed"], batches, args.depth, meta)
        report.update(
            checkpoint=str(path),
            format=meta["format"],
            trained_step=meta.get("step"),
            sequences=int(batches.tokens.shape[0]),
            vocab_coverage=coverage(held, vocab),
        )
        if sized:
            report["vocab_coverage_by_size"] = {n: coverage(held, v) for n, v in sized.items()}
            print("coverage by draft vocabulary size:", report["vocab_coverage_by_size"])
        by_category = {}
        for name, shards in groups.items():
            part = train.make_batches(shards, vocab, args.seq_len)
            one = evaluate(meta["format"], head, config, params["embed"], part, args.depth, meta)
            by_category[name] = {
                "accuracy": one["accuracy"],
                "chain_accepted_length": one["chain_accepted_length"],
                "anchors": one["anchors"],
                "vocab_coverage": coverage(shards, vocab),
            }
        if by_category:
            report["by_category"] = by_category
        report["eval_seconds"] = time.perf_counter() - start
        rows.append(report)
        acc = ", ".join(f"{a:.3f}" for a in report["accuracy"][:6])
        print(
            f"{path}: accuracy by depth [{acc}], chain accepted length "
            f"{report['chain_accepted_length']:.3f} over {report['anchors']} chains, "
            f"vocabulary coverage {report['vocab_coverage']:.4f}",
            flush=True,
        )
        for name, one in by_category.items():
            print(
                f"  {name:<12} chain {one['chain_accepted_length']:.3f}  top-1 "
                f"{one['accuracy'][0]:.3f}  coverage {one['vocab_coverage']:.4f}",
                flush=True,
            )
    source = {"corpus": args.corpus} if args.corpus else {"suite": args.suite}
    if args.suite:
        source.update(per_category=args.per_category, max_new_tokens=args.max_new_tokens)
    write_json_atomic(Path(args.json), {**source, "heads": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
