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

from eaglepangu_jax.cli import side_by_side


def main(argv=None, *, teacher=None, renderer=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    side_by_side.add_suite_arguments(p, per_category=2)
    p.add_argument("--methods", default="ngram,ngram-corpus", help="drafters, comma-separated")
    p.add_argument(
        "--sizes", default="1,4", help="the compared variant's slot buckets (below the tree)"
    )
    args = p.parse_args(argv)
    side_by_side.check_suite_arguments(p, args)
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

    teacher = side_by_side.real_teacher(teacher)
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
    side_by_side.run_and_report(
        teacher,
        methods,
        args,
        "slot_buckets",
        {
            "default": names,
            "compared_sizes": list(sizes),
            "compared": [n + suffix for n in names],
        },
        renderer=renderer,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
