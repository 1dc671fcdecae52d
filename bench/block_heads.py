"""Block drafter (or, ``--kind eagle3``, EAGLE-3) exports side by side in the engine:
greedy, the shipped head and each ``--checkpoint``, interleaved per turn on the same prompts.

Offline figures (``bench/heldout_heads.py``) score a head's top-1 chain; the engine's
best-first tree also spends its budget on the head's other candidates, ranked by its
(calibrated) marginals, so a new head is checked here before it ships. Each head runs with
the per-depth temperatures its own export stores (``calibration.depth_temperature``), as
``load_shipped_block`` would run it once shipped. The default ``--policy best_first`` drafts
every round, so acceptance is compared, not the controller's choices::

    PYTHONPATH=. python3 bench/block_heads.py --suite mtbench-humaneval --per-category 1 \\
        --checkpoint runs/blk5_export --json block_heads.json

``--policy auto`` runs them under the engine's default controller instead, the way
``eaglepangu bench`` runs the shipped head (``--per-category 0``: the whole suite, e.g. the
240 turns at ``--max-new-tokens 64``); with ``--budget auto`` too, every head drafts the tree
the shipped one drafts by default (its ``DRAFTER_BUDGETS`` entry, no deeper than that). The
controller weighs each round's drafting cost, measured once per head shape on this machine and
kept in its calibration, so a deeper head pays its own cost there, not the shipped head's.

Methods are named ``block`` (shipped) and ``block#I`` (the ``I``-th checkpoint; under
``--policy auto`` ``block#I-<8 hex>``, the hex naming its shape), or ``eagle3`` and
``eagle3#I...`` with ``--kind eagle3``; the JSON is the bench report with a ``block_heads``
entry naming the kind and the checkpoints.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json

from eaglepangu_jax.cli import side_by_side
from eaglepangu_jax.cli.args import budget


def method_name(index: int, config, policy: str, kind: str = "block") -> str:
    """``block#I``; under the controller also the head's shape, ``block#I-<8 hex>``
    (``eagle3#I...`` for ``kind="eagle3"``).

    The calibration keeps drafting costs by method name (``draft_cost_key``). A cost measured
    for one head must not be read for another of a different depth or width run later as the
    same ``block#I``; heads of one shape draft at one cost, so the shape names it."""
    if policy != "auto":
        return f"{kind}#{index}"
    shape = json.dumps(dataclasses.asdict(config), sort_keys=True, default=str)
    return f"{kind}#{index}-{hashlib.sha256(shape.encode()).hexdigest()[:8]}"


def _mismatch(kind: str, config, ours) -> str | None:
    """Why a head of ``config`` cannot run beside the shipped one (``ours``), or None.

    Another depth or width is compared as it stands; the tapped teacher layers must match so
    that both heads see the same features, and a block head's block size, so that both draft
    the same tree depth."""
    if kind == "block":
        if (config.feature_layers, config.block_size) != (ours.feature_layers, ours.block_size):
            return (
                f"taps teacher layers {config.feature_layers} with blocks of "
                f"{config.block_size}; the shipped head {ours.feature_layers} with "
                f"{ours.block_size}"
            )
    elif config.feature_layers != ours.feature_layers:
        return (
            f"taps teacher layers {config.feature_layers}; the shipped head {ours.feature_layers}"
        )
    return None


def _params(kind: str, config, head, d2t, embed, calibration: dict):
    """Drafting params of a head, with the temperatures its export stores (if any)."""
    from eaglepangu_jax.drafters import block, eagle3

    if kind == "eagle3":
        return eagle3.with_calibration(eagle3.make_params(head, embed, d2t), calibration)
    params = block.make_params(head, embed, d2t)
    temperature = calibration.get("depth_temperature")
    if temperature is not None:
        params = block.with_depth_temperature(params, config, temperature)
    return params


def head_methods(p: argparse.ArgumentParser, args: argparse.Namespace) -> list:
    """Greedy, the shipped head and one method per ``--checkpoint``, all drafting the tree
    ``--budget`` names (``auto``: the shipped drafter's default one, at its depth)."""
    from eaglepangu_jax.drafters.checkpoint import load_checkpoint
    from eaglepangu_jax.engine.config import SpecConfig
    from eaglepangu_jax.methods.registry import make_method
    from eaglepangu_jax.models.smollm2 import teacher_fingerprint

    auto = args.budget == "auto"
    spec = SpecConfig(policy=args.policy, max_new_tokens=args.max_new_tokens)
    if not auto:
        spec = dataclasses.replace(spec, budget=args.budget)
    kind = getattr(args, "kind", "block")
    shipped = make_method(kind, spec, default_depth=auto, default_budget=auto)
    methods = [make_method("greedy", spec), shipped]
    for i, path in enumerate(args.checkpoint):
        try:
            config, head, d2t, meta, _ = load_checkpoint(
                path, fingerprint=teacher_fingerprint(), kind=kind
            )
        except ValueError as err:
            p.error(f"--checkpoint {path}: {err}")
        why = _mismatch(kind, config, shipped.drafter.config)
        if why is not None:
            p.error(f"--checkpoint {path}: {why}")
        calibration = meta.get("calibration", {})
        params = _params(kind, config, head, d2t, shipped.draft_params["embed"], calibration)
        drafter = dataclasses.replace(shipped.drafter, config=config)
        methods.append(
            dataclasses.replace(
                shipped,
                name=method_name(i, config, args.policy, kind),
                drafter=drafter,
                draft_params=params,
            )
        )
    return methods


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    side_by_side.add_suite_arguments(
        p, per_category=1, suite="mtbench-humaneval", max_new_tokens=128
    )
    p.add_argument(
        "--budget",
        type=budget,
        default=8,
        help="tree nodes per round, or 'auto': the shipped drafter's default tree",
    )
    p.add_argument("--policy", default="best_first", help="tree policy (see eaglepangu bench)")
    p.add_argument(
        "--kind",
        choices=("block", "eagle3"),
        default="block",
        help="which drafter's exports to compare (default: block)",
    )
    p.add_argument(
        "--checkpoint",
        action="append",
        required=True,
        help="an export or checkpoint of a --kind head (repeatable)",
    )
    args = p.parse_args(argv)
    side_by_side.check_suite_arguments(p, args)
    methods = head_methods(p, args)  # a checkpoint it cannot run is refused before any load
    teacher = side_by_side.real_teacher()
    # Under "auto" the calibration times each head's drafting (the controller reads it).
    side_by_side.run_and_report(
        teacher, methods, args, "block_heads", {"kind": args.kind, "checkpoints": args.checkpoint}
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
