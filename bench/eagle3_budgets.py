"""The EAGLE-3 head (or another drafter, ``--drafter``) at small budgets, every round drafted
and under the controller, side by side with greedy (all interleaved per turn on the same
prompts), with each turn's rounds recorded: how many nodes each round verified and how many
of them were accepted. ::

    PYTHONPATH=. python3 bench/eagle3_budgets.py --budgets 1,3 --json eagle3_budgets.json
    PYTHONPATH=. python3 bench/eagle3_budgets.py --drafter block --budgets 1,2,4 --json b.json

Methods are named ``D b=N best_first`` (N nodes every round) and ``D b=N auto`` (the
controller, N its ceiling), ``D`` the drafter; with ``--average-gate`` each controlled budget
also runs as ``D b=N auto average-gate``, the controller without its single-node gate
(``ControlConfig.single_node_gate=False``: it drafts only when the average round pays), to
measure the gate side by side; with ``--absent-fade`` each controlled method also runs as ``...
absent-fade``, its cost correction fading a kind of round's old evidence only while that kind
is absent (``CostCorrection(rare_share=0.0)``, the rule before session 52); with
``--old-correction`` as ``... old-correction``, the cost correction as it was before session 52
(absent-only fading, every segment at full weight: ``rare_share=0.0, surprise=None``); with
``--old-controller`` as ``D b=N auto old-controller``, both at once (no single-node gate, the
old correction): the controller of before session 52 as one twin, for a long suite where a twin
of each change would cost too much. ``--disturbed-start S`` starts every controlled method's
cost correction (``engine.costs``) as if one segment of speculative rounds had just run ``S``
times slower than the calibration predicts at the 256- and 512-slot windows, the state a
disturbed turn can leave behind on a shared machine, to measure how the controller recovers
from it. Each controlled method learns its own cost correction and the calibration times each
budget's drafting apart. The JSON is the bench report (turns with ``accepted_per_round`` and
``nodes_per_round``) with an ``eagle3_budgets`` entry: the drafter and, per method, the rounds,
the share that verified nodes, accepted tokens per verifying round and how many rounds verified
0, 1, 2, ... nodes.
"""

from __future__ import annotations

import argparse
import dataclasses

from eaglepangu_jax.cli import side_by_side

POLICIES = ("best_first", "auto")
# The cost correction's rules before session 52 (engine.costs.CostCorrection's settings).
OLD_CORRECTION = dict(rare_share=0.0, surprise=None)


def budget_list(text: str) -> list[int]:
    """``"1,3"`` -> ``[1, 3]``: distinct node budgets >= 1."""
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"budgets must be integers, got {text!r}") from None
    if any(v < 1 for v in values) or len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"budgets must be distinct and >= 1, got {text!r}")
    return values


def round_summary(turns: list[dict], name: str) -> dict:
    """Pooled over ``turns``: rounds, the share that verified nodes, accepted draft tokens
    per verifying round, and the count of rounds by nodes verified."""
    accepted, nodes = [], []
    for turn in turns:
        record = turn["methods"][name]
        accepted += record["accepted_per_round"]
        nodes += record["nodes_per_round"]
    verifying = [a for a, n in zip(accepted, nodes) if n > 0]
    histogram = [0] * (max(nodes, default=0) + 1)
    for n in nodes:
        histogram[n] += 1
    return {
        "rounds": len(nodes),
        "verifying_share": len(verifying) / len(nodes) if nodes else 0.0,
        "accepted_per_verifying_round": sum(verifying) / len(verifying) if verifying else 0.0,
        "rounds_by_nodes": histogram,
    }


def correction_twins(methods: list, *, absent_fade: bool, old_correction: bool) -> list:
    """A twin of every method with a cost correction, named ``"<name> absent-fade"`` (the
    correction fading only absent kinds of round) and/or ``"<name> old-correction"`` (also
    every segment at full weight), each with a fresh correction of its own."""
    from eaglepangu_jax.engine.costs import CostCorrection

    twins = {}
    if absent_fade:
        twins["absent-fade"] = dict(rare_share=0.0)
    if old_correction:
        twins["old-correction"] = OLD_CORRECTION
    return [
        dataclasses.replace(m, name=f"{m.name} {twin}", correction=CostCorrection(**settings))
        for twin, settings in twins.items()
        for m in methods
        if m.correction is not None
    ]


def old_controller_twin(average_gate, name: str):
    """The controller of before session 52, named ``"<name> old-controller"``: the method
    ``average_gate`` (its gate opens only when the average round pays) with a fresh cost
    correction of the old rules (every segment at full weight, only absent kinds fading)."""
    from eaglepangu_jax.engine.costs import CostCorrection

    return dataclasses.replace(
        average_gate, name=f"{name} old-controller", correction=CostCorrection(**OLD_CORRECTION)
    )


def main(argv=None, *, teacher=None, renderer=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    side_by_side.add_suite_arguments(p, per_category=0)
    p.add_argument("--drafter", default="eagle3", help="an engine drafter (see eaglepangu bench)")
    p.add_argument("--budgets", type=budget_list, default=[1, 2, 3])
    p.add_argument(
        "--policies",
        default=",".join(POLICIES),
        help=f"comma-separated, from {', '.join(POLICIES)}",
    )
    p.add_argument(
        "--average-gate",
        action="store_true",
        help="also run each controlled budget without the single-node gate",
    )
    p.add_argument(
        "--absent-fade",
        action="store_true",
        help="also run each controlled method with the cost correction's absent-only fading",
    )
    p.add_argument(
        "--old-correction",
        action="store_true",
        help="also run each controlled method with the cost correction of before session 52",
    )
    p.add_argument(
        "--old-controller",
        action="store_true",
        help="also run each controlled budget with the controller of before session 52 (no "
        "single-node gate, the old cost correction) as one twin",
    )
    p.add_argument(
        "--disturbed-start",
        type=float,
        default=None,
        metavar="S",
        help="start the cost corrections as after speculative rounds S times slower (> 0)",
    )
    args = p.parse_args(argv)
    if args.disturbed_start is not None and not args.disturbed_start > 0:
        p.error(f"--disturbed-start must be > 0, got {args.disturbed_start}")
    policies = args.policies.split(",")
    if any(x not in POLICIES for x in policies) or len(set(policies)) < len(policies):
        p.error(f"--policies: distinct names from {', '.join(POLICIES)}, got {args.policies!r}")
    side_by_side.check_suite_arguments(p, args)

    from eaglepangu_jax.draft_control import ControlConfig
    from eaglepangu_jax.engine.config import SpecConfig
    from eaglepangu_jax.methods.registry import (
        DEFAULT_DEPTH,
        REFERENCE,
        engine_drafters,
        make_method,
    )

    try:
        drafters = engine_drafters(args.drafter)
    except ValueError as err:
        p.error(f"--drafter: {err}")
    if len(drafters) != 1:
        p.error(f"--drafter: one engine drafter, got {args.drafter!r}")
    (drafter,) = drafters

    teacher = side_by_side.real_teacher(teacher)
    methods = [
        make_method(
            REFERENCE,
            SpecConfig(budget=1, depth=DEFAULT_DEPTH, max_new_tokens=args.max_new_tokens),
        )
    ]
    for budget in args.budgets:
        for policy in policies:
            spec = SpecConfig(
                budget=budget,
                depth=DEFAULT_DEPTH,
                max_new_tokens=args.max_new_tokens,
                policy=policy,
            )
            method = make_method(drafter, spec, default_depth=True)
            methods.append(dataclasses.replace(method, name=f"{drafter} b={budget} {policy}"))
            if policy == "auto" and (args.average_gate or args.old_controller):
                average = ControlConfig(single_node_gate=False)
                method = make_method(
                    drafter, dataclasses.replace(spec, control=average), default_depth=True
                )
                name = f"{drafter} b={budget} auto"
                if args.average_gate:
                    methods.append(dataclasses.replace(method, name=f"{name} average-gate"))
                if args.old_controller:
                    methods.append(old_controller_twin(method, name))
    methods += correction_twins(
        methods, absent_fade=args.absent_fade, old_correction=args.old_correction
    )
    if args.disturbed_start is not None:
        for method in methods:
            for window in (256, 512):
                if method.correction is not None:
                    method.correction.observe(0.0, 1.0, args.disturbed_start, window)
    report = side_by_side.run_and_report(
        teacher,
        methods,
        args,
        "eagle3_budgets",
        lambda report: {
            "drafter": drafter,
            "rounds": {m.name: round_summary(report["turns"], m.name) for m in methods[1:]},
        },
        renderer=renderer,
        per_round=True,
    )
    for name, rounds in report["eagle3_budgets"]["rounds"].items():
        print(
            f"{name}: {rounds['verifying_share']:.0%} of {rounds['rounds']} rounds verifying, "
            f"{rounds['accepted_per_verifying_round']:.2f} accepted per verifying round"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
