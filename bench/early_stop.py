"""EAGLE-3's early stop, side by side: greedy, the head as shipped (a level is grown only while
one of its nodes could still enter the tree) and the same head growing every level, the
three interleaved per turn on the same prompts. The trees are the same, so the tokens are
too; what differs is the drafting time. ::

    PYTHONPATH=. python3 bench/early_stop.py --suite dev --per-category 2 --json early_stop.json
    PYTHONPATH=. python3 bench/early_stop.py --policy best_first --json every_round.json

Methods are named ``eagle3`` and ``eagle3/every-level``; under ``--policy auto`` (the
default controller) each learns its own cost correction, and the calibration times both at
their highest cost (every level grown), so the controller starts from the same drafting
cost and learns the difference from the rounds. ``--policy best_first`` drafts every round.
The JSON is the bench report with an ``early_stop`` entry.
"""

from __future__ import annotations

import argparse
import dataclasses

POLICIES = ("auto", "best_first")


def main(argv=None, *, teacher=None, renderer=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--suite", default="dev")
    p.add_argument(
        "--per-category", type=int, default=2, help="conversations per category (0: all)"
    )
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--policy", default="auto", choices=POLICIES)
    p.add_argument("--json", required=True, help="the report to write")
    args = p.parse_args(argv)
    if args.per_category < 0:
        p.error("--per-category must be >= 0 (0: every conversation)")
    if args.max_new_tokens < 1:
        p.error("--max-new-tokens must be >= 1")

    from eaglepangu_jax import runtime
    from eaglepangu_jax.calibration.auto import controlled_methods, ensure_calibration
    from eaglepangu_jax.engine.config import SpecConfig
    from eaglepangu_jax.engine.drafter import costliest
    from eaglepangu_jax.evaluation.report import format_summary, write_report
    from eaglepangu_jax.evaluation.run import run_bench
    from eaglepangu_jax.evaluation.suites import load_suite, per_category
    from eaglepangu_jax.methods.registry import (
        DEFAULT_BUDGET,
        DEFAULT_DEPTH,
        REFERENCE,
        make_method,
    )

    if teacher is None:
        runtime.enable_compile_cache(None)
        teacher = runtime.load_teacher()
    renderer = renderer if renderer is not None else runtime.load_renderer()
    # The tree settings of `eaglepangu bench` with none given.
    spec = SpecConfig(
        budget=DEFAULT_BUDGET,
        depth=DEFAULT_DEPTH,
        max_new_tokens=args.max_new_tokens,
        policy=args.policy,
    )
    shipped = make_method("eagle3", spec, default_depth=True)
    every_level = dataclasses.replace(
        shipped,
        name="eagle3/every-level",
        drafter=costliest(shipped.drafter),
        correction=None,  # its own, made fresh
    )
    methods = [make_method(REFERENCE, spec), shipped, every_level]
    ensure_calibration(teacher, controlled_methods(methods))
    conversations = load_suite(args.suite)
    if args.per_category:
        conversations = per_category(conversations, args.per_category)
    report = run_bench(teacher, conversations, methods, renderer)
    report["early_stop"] = {
        "suite": args.suite,
        "per_category": args.per_category,
        "policy": args.policy,
        "compared": [shipped.name, every_level.name],
    }
    write_report(args.json, report)
    print(format_summary(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
