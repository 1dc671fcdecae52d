"""Held-out figures of draft-head checkpoints on a corpus's held-out split, offline.

For each checkpoint (EAGLE-3, block or distilled draft model, e.g. the shipped ones and a new
training run) the teacher features of the corpus's held-out shards are recomputed from the ids
(or read from the feature cache; a draft model reads none), the targets are mapped through
*that checkpoint's own* draft vocabulary, and the training code's evaluation runs: per-depth
top-1 accuracy and the accepted length of a single top-1 chain (bonus token included). Block
checkpoints also report the per-depth calibration error of their marginals, raw and with the
stored temperatures::

    python3 bench/heldout_heads.py --corpus eaglepangu_jax/data/corpus \\
        --checkpoint eaglepangu_jax/weights/eagle3_smollm2 \\
        --checkpoint eaglepangu_jax/weights/block_smollm2 --json heldout.json
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", required=True, help="corpus folder (its manifest's split)")
    parser.add_argument(
        "--checkpoint", action="append", required=True, help="checkpoint path (no suffix)"
    )
    parser.add_argument("--seq-len", type=int, default=512, help="tokens kept per sequence")
    parser.add_argument("--depth", type=int, default=6, help="EAGLE-3 / draft-model chain depth")
    parser.add_argument("--json", required=True)
    args = parser.parse_args()

    import numpy as np

    from eaglepangu_jax.drafters.checkpoint import load_checkpoint
    from eaglepangu_jax.drafters.vocab import DraftVocab
    from eaglepangu_jax.engine.decode import Teacher
    from eaglepangu_jax.files import write_json_atomic
    from eaglepangu_jax.models import llama, smollm2
    from eaglepangu_jax.models.weights_cache import resolve_cache_dir
    from eaglepangu_jax.training import corpus as corpus_lib
    from eaglepangu_jax.training import distill, train, train_block, train_draft_model
    from eaglepangu_jax.training.features import shard_features

    cfg, params = smollm2.load_smollm2()
    teacher = Teacher(cfg, llama.prepare_params(params))
    fingerprint = smollm2.teacher_fingerprint()
    manifest = distill.read_manifest(args.corpus)
    rows = []
    for path in args.checkpoint:
        config, head, d2t, meta, _ = load_checkpoint(path, fingerprint=fingerprint)
        held = []
        for entry in manifest["shards"]:
            if entry["split"] != "heldout":
                continue
            shard = corpus_lib.load_corpus_shard(Path(args.corpus) / "answers", entry["key"])
            if shard is None:
                raise SystemExit(f"corpus shard {entry['key']} is missing or corrupt")
            held.append(
                shard_features(
                    teacher,
                    shard,
                    entry["sha256"],
                    config.feature_layers,
                    resolve_cache_dir() / "features",
                    fingerprint=fingerprint,
                )
            )
        vocab = DraftVocab(np.asarray(d2t, np.int32), cfg.vocab_size, float("nan"))
        batches = train.make_batches(held, vocab, args.seq_len)
        start = time.perf_counter()
        if meta["format"].endswith("eagle3"):
            report = train.evaluate(head, config, params["embed"], batches, depth=args.depth)
        elif meta["format"].endswith("draft-model"):
            report = train_draft_model.evaluate(
                head, config, params["embed"], batches, depth=args.depth
            )
        else:
            report = train_block.evaluate(head, config, params["embed"], batches)
            calibration = train_block.fit_depth_temperatures(head, config, params["embed"], batches)
            stored = meta.get("calibration", {}).get("depth_temperature")
            report["ece_raw"] = calibration["ece_before"]
            report["stored_depth_temperature"] = stored
        report.update(
            checkpoint=str(path),
            format=meta["format"],
            trained_step=meta.get("step"),
            sequences=int(batches.tokens.shape[0]),
            eval_seconds=time.perf_counter() - start,
        )
        rows.append(report)
        acc = ", ".join(f"{a:.3f}" for a in report["accuracy"][:6])
        print(
            f"{path}: accuracy by depth [{acc}], chain accepted length "
            f"{report['chain_accepted_length']:.3f} over {report['anchors']} chains",
            flush=True,
        )
    write_json_atomic(Path(args.json), {"corpus": args.corpus, "heads": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
