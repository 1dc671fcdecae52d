"""EAGLE-3 with its draft marginals at several temperatures, side by side in the engine.

A head trained long on a small corpus grows overconfident: its top-1 chain improves while the
best-first tree (which ranks nodes by the product of the marginals along their paths) spends
its budget on that chain. A temperature keeps every argmax and moves the rest of the tree. This
runs greedy and the head at each temperature interleaved per turn, every round drafted
(``--policy drafter``: acceptance, not the controller, is what is compared), and writes the
bench report (JSON) and its table. Select on ``--suite dev`` (human-written, not an evaluation
suite), then check the chosen temperature on the evaluation suite::

    PYTHONPATH=. python3 bench/draft_temperature.py --suite dev --per-category 1 \\
        --temperatures 1,1.5,2,3 --json dev_temperatures.json

``--calibrate-from REPORT`` runs nothing: it writes the temperature under which the report's
one head accepted the most tokens per round (pooled over its turns) into that head's export
JSON (``calibration.depth_temperature``; ``--checkpoint``, or the shipped head for a report of
the shipped head), where ``load_shipped_eagle3`` reads it::

    PYTHONPATH=. python3 bench/draft_temperature.py --calibrate-from dev_temperatures.json

The best temperature depends on the tree (a 3-node tree spends its nodes otherwise than an
8-node one): with ``--for-budget`` the temperature is stored for trees of at most the
report's ``--budget`` nodes (``calibration.by_budget``), and a drafter uses the entry of the
smallest such budget that holds its tree, else the temperature of every size.

``--checkpoint`` (repeatable) runs other EAGLE-3 exports instead of the shipped head, each at
every temperature, all interleaved in the one run (methods named ``eagle3#I@TT``, ``I`` the
checkpoint's position).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

# The drafting params an export's calibration sets (eagle3.with_calibration): dropped before
# a sweep so that each swept temperature is the one every tree size drafts at.
CALIBRATED_KEYS = ("depth_temperature", "budget_temperature")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--suite", default="dev")
    p.add_argument(
        "--per-category", type=int, default=1, help="conversations per category (0: all)"
    )
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperatures", default="1,1.5,2,3", help="comma-separated, each > 0")
    p.add_argument("--budget", type=int, default=8)
    p.add_argument("--depth", type=int, default=6)
    p.add_argument(
        "--checkpoint",
        action="append",
        default=None,
        help="an EAGLE-3 export (repeatable; default: the shipped head)",
    )
    p.add_argument("--json", default=None, help="the report to write (needed to run)")
    p.add_argument(
        "--for-budget",
        action="store_true",
        help="with --calibrate-from: store the temperature for trees of at most the report's "
        "budget (calibration.by_budget) instead of for every tree size",
    )
    p.add_argument(
        "--calibrate-from",
        metavar="REPORT",
        default=None,
        help="run nothing: write the best temperature of REPORT's head into its export",
    )
    args = p.parse_args(argv)
    if args.calibrate_from is not None:
        return calibrate_from(p, args)
    if args.json is None:
        p.error("--json is required to run")
    if args.per_category < 0:
        p.error("--per-category must be >= 0 (0: every conversation)")
    try:
        temperatures = [float(t) for t in args.temperatures.split(",")]
    except ValueError:
        p.error(f"--temperatures: not a comma-separated list of numbers: {args.temperatures!r}")
    if not temperatures or any(not t > 0 for t in temperatures):
        p.error(f"--temperatures must all be > 0, got {args.temperatures!r}")

    from eaglepangu_jax import runtime
    from eaglepangu_jax.drafters import eagle3
    from eaglepangu_jax.drafters.checkpoint import load_checkpoint
    from eaglepangu_jax.drafters.eagle3_head import make_params
    from eaglepangu_jax.engine.config import SpecConfig
    from eaglepangu_jax.evaluation.report import format_summary, write_report
    from eaglepangu_jax.evaluation.run import run_bench
    from eaglepangu_jax.evaluation.suites import load_suite, per_category
    from eaglepangu_jax.methods.registry import make_method
    from eaglepangu_jax.models.smollm2 import teacher_fingerprint

    teacher = runtime.load_teacher()
    renderer = runtime.load_renderer()
    spec = SpecConfig(
        policy="drafter", budget=args.budget, depth=args.depth, max_new_tokens=args.max_new_tokens
    )
    base = make_method("eagle3", spec)
    shipped = dict(base.draft_params)
    heads = []  # (label, params without a calibration)
    for i, path in enumerate(args.checkpoint or [None]):
        params = shipped
        if path is not None:
            config, head, d2t, _, _ = load_checkpoint(
                path, fingerprint=teacher_fingerprint(), kind="eagle3"
            )
            if config != base.drafter.config:
                p.error(f"--checkpoint {path}: another head shape than the shipped one")
            params = make_params(head, shipped["embed"], d2t)
        params = {k: v for k, v in params.items() if k not in CALIBRATED_KEYS}
        heads.append(("eagle3" if args.checkpoint is None else f"eagle3#{i}", params))
    methods = [make_method("greedy", spec)]
    for label, params in heads:
        for t in temperatures:
            tuned = eagle3.with_depth_temperature(params, [t])
            methods.append(dataclasses.replace(base, name=f"{label}@T{t:g}", draft_params=tuned))
    conversations = load_suite(args.suite)
    if args.per_category:
        conversations = per_category(conversations, args.per_category)
    report = run_bench(teacher, conversations, methods, renderer)
    report["draft_temperature"] = {
        "suite": args.suite,
        "per_category": args.per_category,
        "temperatures": temperatures,
        "checkpoints": args.checkpoint or ["shipped"],
        "budget": args.budget,
        "depth": args.depth,
    }
    write_report(args.json, report)
    print(format_summary(report))
    return 0


def calibrate_from(p: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """Write the report's best temperature into the export of the head it ran."""
    import json
    from importlib import resources
    from pathlib import Path

    from eaglepangu_jax.drafters.eagle3 import SHIPPED_NAME
    from eaglepangu_jax.files import atomic_write

    try:
        report = json.loads(Path(args.calibrate_from).read_text())
        info = report["draft_temperature"]
        summary = report["summary"]
    except (OSError, ValueError, KeyError) as err:
        p.error(f"--calibrate-from {args.calibrate_from}: not a draft_temperature report ({err})")
    heads = info.get("checkpoints", [info.get("checkpoint", "shipped")])  # first reports: one
    if len(heads) != 1:
        p.error("--calibrate-from: the report ran several heads; give a report of one")
    ran = heads[0]
    if args.checkpoint is not None and len(args.checkpoint) != 1:
        p.error("--calibrate-from takes at most one --checkpoint")
    target = args.checkpoint[0] if args.checkpoint else None
    if target is None:
        if ran != "shipped":
            p.error(f"--calibrate-from: the report ran {ran}; name it with --checkpoint")
        target = str(resources.files("eaglepangu_jax") / "weights" / SHIPPED_NAME)
    pooled = {
        t: summary[name]["overall_accepted_length"]
        for t in info["temperatures"]
        for name in summary
        if name.endswith(f"@T{t:g}")
    }
    best = max(pooled, key=lambda t: (pooled[t], -t))  # ties: the smaller change
    path = Path(target).with_suffix(".json")
    meta = json.loads(path.read_text())
    entry = {
        "depth_temperature": [best],
        "selected_by": "bench/draft_temperature.py: the most tokens per round, pooled",
        "suite": info["suite"],
        "per_category": info["per_category"],
        "pooled_accepted_length": {f"{t:g}": round(v, 4) for t, v in pooled.items()},
    }
    budget, depth = _report_tree(report)
    calibration = meta.get("calibration", {})
    if args.for_budget:
        if budget is None:
            p.error("--for-budget: the report does not record the tree it ran")
        entry.update(budget=budget, depth=depth)
        calibration = {
            **calibration,
            "by_budget": {**calibration.get("by_budget", {}), str(budget): entry},
        }
        where = f"trees of at most {budget} nodes"
    else:
        # The temperature of every tree size; the per-size entries (selected on their own
        # trees) are kept.
        entry["budget"] = budget
        if "by_budget" in calibration:
            entry["by_budget"] = calibration["by_budget"]
        calibration = entry
        where = "every tree size"
    meta["calibration"] = calibration
    atomic_write(path, lambda tmp: tmp.write_text(json.dumps(meta, indent=1, sort_keys=True)))
    print(
        f"temperature {best:g} (pooled accepted length {pooled[best]:.3f}) for {where} "
        f"written to {path}"
    )
    return 0


def _report_tree(report: dict) -> tuple[int | None, int | None]:
    """The tree (nodes a round, depth) the report's heads drafted; ``None`` where not
    recorded."""
    info = report["draft_temperature"]
    budget, depth = info.get("budget"), info.get("depth")
    if budget is None:  # reports written before the sweep recorded it: the methods' spec
        specs = [m.get("spec", {}) for m in report.get("methods", {}).values()]
        spec = next((s for s in specs if s.get("budget")), {})
        budget, depth = spec.get("budget"), spec.get("depth")
    return (None if budget is None else int(budget)), (None if depth is None else int(depth))


if __name__ == "__main__":
    sys.exit(main())
