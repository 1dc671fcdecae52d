"""``eaglepangu corpus``: grow the self-distilled corpus (prompts the teacher writes, answers
it gives), resumable, optionally on Ray."""

from __future__ import annotations

import argparse
import json
from importlib import resources
from pathlib import Path

from eaglepangu_jax.cli import args as args_lib

__all__ = ["DEFAULT_DIR", "add_arguments", "run", "summary"]


def _default_dir() -> Path:
    return Path(str(resources.files("eaglepangu_jax") / "data" / "corpus"))


DEFAULT_DIR = _default_dir()


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--out",
        default=str(DEFAULT_DIR),
        help="corpus folder (default: the corpus shipped in the package, which this extends)",
    )
    p.add_argument(
        "--target-tokens",
        type=args_lib.positive,
        default=1_000_000,
        help="stop once the answers hold this many tokens",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--shard-size",
        type=args_lib.positive,
        default=64,
        help="prompts per shard, answered as one batch",
    )
    p.add_argument(
        "--max-new-tokens", type=args_lib.positive, default=256, help="longest teacher answer"
    )
    p.add_argument(
        "--synth-batch", type=args_lib.positive, default=64, help="user turns sampled per batch"
    )
    p.add_argument(
        "--ray-address",
        default=None,
        help="make the answer shards as Ray tasks: 'local' starts a local "
        "instance, 'auto' or HOST:PORT joins a cluster (needs the 'ray' extra)",
    )
    p.add_argument(
        "--summary",
        action="store_true",
        help="print the manifest's counts and exit (no model is loaded)",
    )


def summary(manifest: dict) -> str:
    """A few lines: totals per split, the prompt mix and the drop counts."""
    lines = [f"teacher {manifest['teacher'][:12]}, {len(manifest['shards'])} shards"]
    for split, t in manifest["totals"].items():
        lines.append(
            f"  {split:8s} {t['shards']:4d} shards {t['sequences']:7,d} conversations "
            f"{t['prompt_tokens']:10,d} prompt tokens {t['answer_tokens']:10,d} answer tokens"
        )
    p = manifest["prompts"]
    lines.append(
        f"  prompts: {p['user_turns_sampled']:,} user turns sampled in "
        f"{p['synthesis_batches']} batches; kept {p['kept']}; dropped {p['dropped']}"
    )
    return "\n".join(lines)


def run(
    parser: argparse.ArgumentParser, args: argparse.Namespace, *, teacher=None, tokenizer=None
) -> int:
    from eaglepangu_jax.training import distill, synth

    out = Path(args.out)
    if args.summary:
        try:
            manifest = distill.read_manifest(out)
        except ValueError as err:
            parser.error(f"--out: {err}")
        print(summary(manifest))
        return 0
    if args.ray_address is not None:
        try:
            import ray  # noqa: F401
        except ImportError:
            parser.error(
                "--ray-address needs Ray: install the 'ray' extra (pip install -e '.[ray]')"
            )
    from eaglepangu_jax import runtime
    from eaglepangu_jax.evaluation.suites import evaluation_texts
    from eaglepangu_jax.models.smollm2 import teacher_fingerprint

    teacher = teacher if teacher is not None else runtime.load_teacher()
    tokenizer = tokenizer if tokenizer is not None else runtime.load_renderer().tokenizer
    plan = distill.CorpusPlan(
        seed=args.seed,
        target_answer_tokens=args.target_tokens,
        synth=synth.SynthSettings(batch_size=args.synth_batch),
        answers=distill.corpus_lib.CorpusSettings(
            max_new_tokens=args.max_new_tokens, shard_size=args.shard_size
        ),
    )
    manifest = distill.build_corpus(
        teacher,
        tokenizer,
        plan,
        out,
        fingerprint=teacher_fingerprint(),
        guard=synth.EvalGuard.from_texts(evaluation_texts()),
        ray_address=args.ray_address,
    )
    print(summary(manifest))
    print(json.dumps(manifest["totals"]))
    return 0
