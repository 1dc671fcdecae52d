"""The ngram-corpus drafter's settings side by side in the engine: greedy, the n-gram drafter
and one ``ngram-corpus`` method per ``--weights`` value (and, with ``--min-counts``, per table
counted with another ``min_count``; with ``--max-orders``, per table of contexts up to
another length; with ``--extra-corpus``, the table counted over more corpora), interleaved per
turn on the same prompts, under the default controller.

Settings are chosen on the dev suite (human-written, kept apart from the evaluation suites)::

    PYTHONPATH=. python3 bench/ngram_corpus_variants.py --suite dev --per-category 2 \\
        --weights 0.25,1,4 --min-counts 1 --json variants.json

Methods are named ``ngram-corpus:w=W`` (the packaged table), ``ngram-corpus:mc=M`` (a
table counted with ``min_count = M`` over the same corpora, weight 1) and
``ngram-corpus:k=K`` (contexts of up to ``K`` tokens, ``min_count = 2``, weight 1) and
``ngram-corpus:+NAME`` (the packaged table's settings counted over its corpora and the
``--extra-corpus`` folders, NAME their folder names joined by ``+``); the JSON is the bench
report with an ``ngram_corpus_variants`` entry naming them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from eaglepangu_jax.cli import side_by_side


def parse_floats(text: str) -> list[float]:
    values = [float(v) for v in text.split(",") if v.strip()]
    if any(not v >= 0 for v in values):
        raise argparse.ArgumentTypeError(f"weights must be >= 0, got {text!r}")
    return values


def parse_counts(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"min counts must be >= 1, got {text!r}")
    return values


def main(argv=None, *, teacher=None, renderer=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    side_by_side.add_suite_arguments(p, per_category=2)
    p.add_argument("--budget", type=int, default=8, help="tree nodes per round (ceiling)")
    p.add_argument("--depth", type=int, default=6)
    p.add_argument("--weights", type=parse_floats, default=[1.0], help="corpus_weight values")
    p.add_argument(
        "--min-counts", type=parse_counts, default=[], help="extra tables' min_count values"
    )
    p.add_argument(
        "--max-orders",
        type=parse_counts,
        default=[],
        help="extra tables' longest contexts (tokens, at most the table's MAX_ORDER)",
    )
    p.add_argument(
        "--prune",
        action="store_true",
        help="also run each extra table without its redundant rows (named ...,pruned)",
    )
    p.add_argument(
        "--extra-corpus",
        action="append",
        default=[],
        metavar="DIR",
        help="also a table counted over the packaged corpora and this corpus folder "
        "(repeat for several; one table for all)",
    )
    args = p.parse_args(argv)
    side_by_side.check_suite_arguments(p, args)
    for folder in args.extra_corpus:
        if not (Path(folder) / "manifest.json").is_file():
            p.error(f"--extra-corpus: {folder!r} is not a corpus folder (no manifest.json)")

    from importlib import resources

    from eaglepangu_jax.cli.ngram_table import DEFAULT_CORPORA
    from eaglepangu_jax.drafters import ngram_table
    from eaglepangu_jax.engine.config import SpecConfig
    from eaglepangu_jax.methods.registry import make_method
    from eaglepangu_jax.models.smollm2 import teacher_fingerprint
    from eaglepangu_jax.training.ngram_counts import training_answers

    spec = SpecConfig(
        budget=args.budget, depth=args.depth, max_new_tokens=args.max_new_tokens, policy="auto"
    )
    base = make_method("ngram-corpus", spec)
    methods = [make_method("greedy", spec), make_method("ngram", spec)]
    for w in args.weights:
        drafter = dataclasses.replace(base.drafter, corpus_weight=w)
        methods.append(dataclasses.replace(base, name=f"ngram-corpus:w={w:g}", drafter=drafter))
    if any(k > ngram_table.MAX_ORDER for k in args.max_orders):
        p.error(f"--max-orders must be <= {ngram_table.MAX_ORDER}, got {args.max_orders}")
    # (label, counting settings, whether the --extra-corpus answers are counted too)
    tables = [(f"mc={m}", dict(min_count=m), False) for m in args.min_counts]
    tables += [(f"k={k}", dict(max_order=k), False) for k in args.max_orders]
    if args.extra_corpus:
        tables.append(("+" + "+".join(Path(f).name for f in args.extra_corpus), {}, True))
    if tables:
        package = resources.files("eaglepangu_jax") / "data"
        answers = []
        for name in DEFAULT_CORPORA:
            answers += training_answers(str(package / name), teacher_fingerprint())[0]
        extra = []
        for folder in args.extra_corpus:
            extra += training_answers(folder, teacher_fingerprint())[0]
        for label, counting, with_extra in tables:
            counted = ngram_table.count_table(
                answers + extra if with_extra else answers, **counting
            )
            variants = [(label, counted)]
            if args.prune:
                variants.append((f"{label},pruned", ngram_table.prune_redundant(counted)))
            for name, rows in variants:
                table = ngram_table.hash_table(rows)
                methods.append(
                    dataclasses.replace(base, name=f"ngram-corpus:{name}", draft_params=table)
                )
    side_by_side.run_and_report(
        side_by_side.real_teacher(teacher),
        methods,
        args,
        "ngram_corpus_variants",
        {
            "weights": args.weights,
            "min_counts": args.min_counts,
            "max_orders": args.max_orders,
            "prune": args.prune,
            "extra_corpora": args.extra_corpus,
        },
        renderer=renderer,
        progress=False,
    )
    print(json.dumps({"report": args.json}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
