"""The verify sizes the engine compiles, side by side: greedy, each drafter with the default
slot buckets (1, 2, 4, 8, ...: a round that verifies one drafted node runs a 2-slot forward)
and the same drafter with other sizes (``--sizes``, by default ``1,4``: the ladder before the
2-slot size, so such a round paid for 4 slots), interleaved per turn on the same prompts,
under the default controller. ::

    PYTHONPATH=. python3 bench/slot_buckets.py --suite dev --per-category 2 \\
        --methods ngram,ngram-corpus --json buckets.json

Methods are named ``D`` (default sizes) and ``D/1-4`` (``--sizes``); each learns its own cost
correction, and both read this machine's calibration (measured at the default sizes, so
the 2-slot forward is timed, not interpolated). The JSON is the bench report with a
``slot_buckets`` entry.
"""

from __future__ import annotations

import argparse
import dataclasses


def main(argv=None, *, teacher=None, renderer=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--suite", default="dev")
    p.add_argument(
        "--per-category", type=int, default=2, help="conversations per category (0: all)"
    )
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--methods", default="ngram,ngram-corpus", help="drafters, comma-separated")
    p.add_argument(
        "--sizes", default="1,4", help="the compared variant's slot buckets (below the tree)"
    )
    p.add_argument("--json", required=True, help="the report to write")
    args = p.parse_args(argv)
    if args.per_category < 0:
        p.error("--per-category must be >= 0 (0: every conversation)")
    if args.max_new_tokens < 1:
        p.error("--max-new-tokens must be >= 1")
    try:
        sizes = tuple(int(s) for s in args.sizes.split(","))
    except ValueError:
        p.error(f"--sizes must be comma-separated integers, got {args.sizes!r}")

    from eaglepangu_jax.engine.config import SpecConfig
    from eaglepangu_jax.methods.registry import (
        DEFAULT_BUDGET,
        DEFAULT_DEPTH,
        REFERENCE,
        engine_drafters,
        make_method,
    )

    # The tree settings of `eaglepangu bench` with none given.
    spec = SpecConfig(
        budget=DEFAULT_BUDGET, depth=DEFAULT_DEPTH, max_new_tokens=args.max_new_tokens
    )
    try:
        dataclasses.replace(spec, slot_buckets=sizes)
        names = engine_drafters(args.methods)
    except ValueError as err:
        p.error(str(err))

    from eaglepangu_jax import runtime
    from eaglepangu_jax.calibration.auto import controlled_methods, ensure_calibration
    from eaglepangu_jax.evaluation.report import format_summary, write_report
    from eaglepangu_jax.evaluation.run import run_bench
    from eaglepangu_jax.evaluation.suites import load_suite, per_category

    if teacher is None:
        runtime.enable_compile_cache(None)
        teacher = runtime.load_teacher()
    renderer = renderer if renderer is not None else runtime.load_renderer()
    suffix = "/" + "-".join(str(s) for s in sizes)
    methods = [make_method(REFERENCE, spec)]
    for name in names:
        method = make_method(name, spec, default_depth=True)
        methods += [
            method,
            dataclasses.replace(
                method,
                name=name + suffix,
                spec=dataclasses.replace(method.spec, slot_buckets=sizes),
                correction=None,  # its own, made fresh
            ),
        ]
    ensure_calibration(teacher, controlled_methods(methods))
    conversations = load_suite(args.suite)
    if args.per_category:
        conversations = per_category(conversations, args.per_category)
    report = run_bench(teacher, conversations, methods, renderer)
    report["slot_buckets"] = {
        "suite": args.suite,
        "per_category": args.per_category,
        "default": names,
        "compared_sizes": list(sizes),
        "compared": [n + suffix for n in names],
    }
    write_report(args.json, report)
    print(format_summary(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
