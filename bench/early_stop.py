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

from eaglepangu_jax.cli import side_by_side

POLICIES = ("auto", "best_first")


def main(argv=None, *, teacher=None, renderer=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    side_by_side.add_suite_arguments(p, per_category=2)
    p.add_argument("--policy", default="auto", choices=POLICIES)
    args = p.parse_args(argv)
    side_by_side.check_suite_arguments(p, args)

    from eaglepangu_jax.engine.config import SpecConfig
    from eaglepangu_jax.engine.drafter import costliest
    from eaglepangu_jax.methods.registry import (
        DEFAULT_BUDGET,
        DEFAULT_DEPTH,
        REFERENCE,
        make_method,
    )

    teacher = side_by_side.real_teacher(teacher)
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
    side_by_side.run_and_report(
        teacher,
        methods,
        args,
        "early_stop",
        {"policy": args.policy, "compared": [shipped.name, every_level.name]},
        renderer=renderer,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
