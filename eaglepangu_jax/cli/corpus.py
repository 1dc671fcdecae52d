"""``eaglepangu corpus``: grow the self-distilled corpus (prompts the teacher writes, answers
it gives), resumable, optionally on Ray; or, with ``--written`` / ``--conversations``, answer
given conversations turn by turn into a corpus of their own."""

from __future__ import annotations

import argparse
import json
from importlib import resources
from pathlib import Path

from eaglepangu_jax.cli import args as args_lib

__all__ = ["DEFAULT_DIR", "WRITTEN_DIR", "add_arguments", "run", "summary"]


def _data_dir(name: str) -> Path:
    return Path(str(resources.files("eaglepangu_jax") / "data" / name))


DEFAULT_DIR = _data_dir("corpus")
WRITTEN_DIR = _data_dir("corpus-written")  # the answers to the written training prompts


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--out",
        default=None,
        help="corpus folder (default: the corpus shipped in the package, which this extends; "
        "with --written, the package's corpus-written)",
    )
    given = p.add_mutually_exclusive_group()
    given.add_argument(
        "--written",
        action="store_true",
        help="answer the training conversations written for the project (every turn, each "
        "after the teacher's answers to the earlier ones) instead of synthesising prompts",
    )
    given.add_argument(
        "--conversations",
        metavar="FILE",
        default=None,
        help="answer the conversations of this JSON Lines file (the bench's prompt format) "
        "instead of synthesising prompts; needs --out",
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
    if "source" in p:  # given conversations, answered turn by turn
        plan = manifest["plan"]
        lines.append(
            f"  prompts: {plan['turns']:,} user turns of {plan['conversations']:,} "
            f"conversations from {p['source']}"
        )
    else:
        lines.append(
            f"  prompts: {p['user_turns_sampled']:,} user turns sampled in "
            f"{p['synthesis_batches']} batches; kept {p['kept']}; dropped {p['dropped']}"
        )
    return "\n".join(lines)


def run(
    parser: argparse.ArgumentParser, args: argparse.Namespace, *, teacher=None, tokenizer=None
) -> int:
    from eaglepangu_jax.training import distill, synth

    given = args.written or args.conversations is not None
    if args.out is None and args.conversations is not None:
        parser.error("--conversations needs --out (a folder of its own)")
    out = Path(args.out if args.out is not None else WRITTEN_DIR if given else DEFAULT_DIR)
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
    from eaglepangu_jax.evaluation import suites
    from eaglepangu_jax.models.smollm2 import teacher_fingerprint

    guard = synth.EvalGuard.from_texts(suites.evaluation_texts())
    settings = distill.corpus_lib.CorpusSettings(
        max_new_tokens=args.max_new_tokens, shard_size=args.shard_size
    )
    if given:
        source = "written" if args.written else str(args.conversations)
        conversations = _given_conversations(parser, args, suites, guard)
        _check_same_kind(parser, out, source)
    teacher = teacher if teacher is not None else runtime.load_teacher()
    tokenizer = tokenizer if tokenizer is not None else runtime.load_renderer().tokenizer
    if given:
        manifest = distill.build_conversation_corpus(
            teacher,
            tokenizer,
            conversations,
            settings,
            out,
            fingerprint=teacher_fingerprint(),
            source=source,
            ray_address=args.ray_address,
        )
    else:
        plan = distill.CorpusPlan(
            seed=args.seed,
            target_answer_tokens=args.target_tokens,
            synth=synth.SynthSettings(batch_size=args.synth_batch),
            answers=settings,
        )
        manifest = distill.build_corpus(
            teacher,
            tokenizer,
            plan,
            out,
            fingerprint=teacher_fingerprint(),
            guard=guard,
            ray_address=args.ray_address,
        )
    print(summary(manifest))
    print(json.dumps(manifest["totals"]))
    return 0


def _given_conversations(parser, args, suites, guard) -> list[list[str]]:
    """The turns to answer; none may quote an evaluation suite (they are training data)."""
    try:
        conversations = (
            suites.written_prompts() if args.written else suites.load_prompts(args.conversations)
        )
    except (OSError, ValueError) as err:
        parser.error(f"--conversations: {err}")
    quoting = [c.id for c in conversations if any(guard.overlaps(t) for t in c.turns)]
    if quoting:
        parser.error(
            f"{len(quoting)} conversation(s) share a run of {guard.n} words with MT-Bench or "
            f"HumanEval (first: {quoting[0]!r}); evaluation text must not become training data"
        )
    return [list(c.turns) for c in conversations]


def _check_same_kind(parser, out: Path, source: str) -> None:
    """Refuse to write given conversations over another kind of corpus (the synthesised one
    above all: its manifest would be replaced)."""
    from eaglepangu_jax.training import distill

    if not (out / distill.MANIFEST).exists():
        return
    try:
        there = distill.read_manifest(out).get("plan", {}).get("source")
    except ValueError as err:
        parser.error(f"--out: {err}")
    if there != source:
        kind = "synthesised prompts" if there is None else f"conversations from {there}"
        parser.error(f"--out {out} holds a corpus of {kind}; give another folder")
