"""Evaluation experiments as commands: budget sweep, draft-window ablation, controller vs fixed
budgets. Each runs a grid of methods (:mod:`eaglepangu_jax.evaluation.grids`) beside greedy in ONE
side-by-side benchmark, then writes bench's report plus an ``experiment`` summary (JSON),
prints a table and, with ``--plot-dir``, draws PNGs (:mod:`eaglepangu_jax.evaluation.plots`).

* ``sweep``: tree nodes x max depth. The seeds report a non-monotonic budget curve with a
  sweet spot at 16 nodes, depth 10 (1.48x).
* ``ablate-window``: the drafter sees only the last W tokens; the seeds report that fixed
  windows of 128/256/512 collapse acceptance.
* ``budgets``: fixed tree budgets vs the ``auto`` controller, per category
  (BASTION: a calibrated controller needs no per-configuration tuning; the target is to stay
  within 5% of the best fixed budget of every category).

Every option is checked, and every cell built, before the model loads.

For the ``eaglepangu`` command: ``add_<name>_arguments(parser)`` and
``run_<name>(args, *, teacher=None, renderer=None)`` per command (names in
:data:`COMMANDS`). Standalone: ``python -m eaglepangu_jax.cli.experiments sweep --help``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from eaglepangu_jax import runtime
from eaglepangu_jax.calibration.auto import calibrated_methods
from eaglepangu_jax.cli import args as args_lib
from eaglepangu_jax.drafters.registry import DrafterUnavailableError
from eaglepangu_jax.engine.config import SpecConfig
from eaglepangu_jax.evaluation import grids, plots
from eaglepangu_jax.evaluation.experiments import (
    budgets_plot,
    run_in_groups,
    sweep_plots,
    window_plot,
)
from eaglepangu_jax.evaluation.report import write_report
from eaglepangu_jax.evaluation.suites import (
    SUITES,
    Conversation,
    count_turns,
    load_prompts,
    load_suite,
    per_category,
)
from eaglepangu_jax.methods import registry as methods_lib

__all__ = [
    "DEFAULT_MAX_NEW_TOKENS",
    "DESCRIPTIONS",
    "add_sweep_arguments",
    "add_ablate_window_arguments",
    "add_budgets_arguments",
    "run_sweep",
    "run_ablate_window",
    "run_budgets",
    "COMMANDS",
    "build_parser",
    "main",
]

DEFAULT_MAX_NEW_TOKENS = 64  # an experiment runs many cells: shorter answers than bench's
DESCRIPTIONS = {
    "sweep": "Mean speed-up and accepted length per (tree nodes, max depth) cell, side by "
    "side with greedy on the same turns; the sweet spot; two heatmaps.",
    "ablate-window": "The drafter sees only the last W committed tokens (W per cell, 'full' "
    "= all); accepted length and speed-up against W.",
    "budgets": "Trees at fixed budgets vs the 'auto' roofline controller (its "
    "ceiling the largest budget), per prompt category: the controller's gap to "
    "the best fixed budget of each category.",
}


# ----------------------------------------------------------------------------- arguments


def _add_common(p: argparse.ArgumentParser, drafters: Sequence[str], default: str) -> None:
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--suite", choices=SUITES, help="a shipped prompt suite")
    source.add_argument(
        "--prompts", metavar="FILE.jsonl", help="conversations to run (JSON Lines, as for 'bench')"
    )
    p.add_argument(
        "--limit",
        type=args_lib.count("conversations"),
        default=None,
        metavar="N",
        help="run only the first N conversations",
    )
    p.add_argument(
        "--per-category",
        type=args_lib.count("conversations"),
        default=None,
        metavar="N",
        help="run only the first N conversations of every category (applied before --limit)",
    )
    p.add_argument(
        "--max-new-tokens",
        type=args_lib.count("tokens"),
        default=DEFAULT_MAX_NEW_TOKENS,
        metavar="N",
        help="tokens to generate per answer (fewer if the model stops; default: %(default)s)",
    )
    p.add_argument(
        "--drafter", choices=drafters, default=default, help="the drafter (default: %(default)s)"
    )
    p.add_argument(
        "--json",
        metavar="OUT",
        required=True,
        help="where to write the report (bench's per-turn records + the summary)",
    )
    p.add_argument(
        "--plot-dir",
        metavar="DIR",
        default=None,
        help="also draw the figures (PNG) into DIR; needs the 'plots' extra",
    )
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    p.set_defaults(experiment_parser=p)


def add_sweep_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``sweep``."""
    _add_common(parser, grids.DRAFTERS, "ngram")
    parser.add_argument(
        "--nodes",
        type=args_lib.counts("tree nodes", grids.MAX_NODES),
        default="4,8,16,32,64",
        metavar="LIST",
        help=f"tree node budgets (root excluded), each 1..{grids.MAX_NODES} (default: %(default)s)",
    )
    parser.add_argument(
        "--depth",
        type=args_lib.counts("depth levels", grids.MAX_DEPTH),
        default="2,4,6,8,10",
        metavar="LIST",
        help="max tree depths, each at least 1 and at most the drafter's "
        "maximum (default: %(default)s)",
    )


def add_ablate_window_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``ablate-window``."""
    _add_common(parser, grids.DRAFTERS, "ngram")
    parser.add_argument(
        "--windows",
        type=args_lib.typed(args_lib.parse_windows),
        default="128,256,512,full",
        metavar="LIST",
        help="draft windows in tokens (each >= 1) or 'full' (default: %(default)s)",
    )
    parser.add_argument(
        "--nodes",
        type=args_lib.count("tree nodes", grids.MAX_NODES),
        default=methods_lib.DEFAULT_BUDGET,
        metavar="N",
        help="tree node budget (default: %(default)s)",
    )
    parser.add_argument(
        "--depth",
        type=args_lib.count("depth levels", grids.MAX_DEPTH),
        default=None,
        metavar="D",
        help=f"max tree depth (default: {methods_lib.DEFAULT_DEPTH}, or a shipped drafter's own)",
    )


def add_budgets_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``budgets``."""
    _add_common(parser, grids.DRAFTERS, "block")
    parser.add_argument(
        "--budgets",
        type=args_lib.counts("tree nodes", grids.MAX_NODES),
        default="2,4,8,16,32",
        metavar="LIST",
        help="fixed tree budgets (best-first for the block drafter); the "
        "largest is the controller's ceiling (default: %(default)s)",
    )
    parser.add_argument(
        "--depth",
        type=args_lib.count("depth levels", grids.MAX_DEPTH),
        default=None,
        metavar="D",
        help=f"max tree depth (default: {methods_lib.DEFAULT_DEPTH}, or "
        f"the drafter's maximum if lower)",
    )


# ----------------------------------------------------------------------------- checks


def _conversations(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[Conversation]:
    option, source = ("--prompts", args.prompts) if args.prompts else ("--suite", args.suite)
    load = load_prompts if args.prompts else load_suite
    try:
        conversations = load(source)
        if args.per_category:
            conversations = per_category(conversations, args.per_category)
        return conversations[: args.limit]  # a limit of None keeps them all
    except (OSError, ValueError) as err:
        parser.error(f"argument {option}: {err}")
    raise AssertionError("unreachable")


def _check_outputs(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if not Path(args.json).resolve().parent.is_dir():
        parser.error(f"argument --json: cannot write {args.json}: its folder does not exist")
    if args.plot_dir is not None:
        try:
            plots.require_matplotlib()
            Path(args.plot_dir).mkdir(parents=True, exist_ok=True)  # fail now, not after the run
        except (plots.PlotsUnavailableError, OSError) as err:
            parser.error(f"argument --plot-dir: {err}")


def _build(
    parser: argparse.ArgumentParser,
    args: argparse.Namespace,
    build: Callable[[], list[methods_lib.Method]],
    settings: str,
) -> list[methods_lib.Method]:
    try:
        return build()
    except (ValueError, DrafterUnavailableError) as err:
        parser.error(f"argument --drafter {args.drafter} with {settings}: {err}")
    raise AssertionError("unreachable")


# ----------------------------------------------------------------------------- running


def _run(
    args: argparse.Namespace,
    conversations: list[Conversation],
    methods: list[methods_lib.Method],
    teacher: Any,
    renderer: Any,
    name: str,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Greedy + ``methods`` on every turn; the bench report and the experiment header."""
    greedy = methods_lib.make_method(
        methods_lib.REFERENCE, SpecConfig(max_new_tokens=args.max_new_tokens)
    )
    if teacher is None:  # the real model: its 'auto' runs read this machine's calibration
        teacher = runtime.load_teacher()
        # Without it an uncalibrated drafting cost reads as 0: a costly drafter would count
        # as free and propose every round.
        methods, _ = calibrated_methods(teacher, methods, progress=args.progress)
    renderer = renderer if renderer is not None else runtime.load_renderer()
    start = time.perf_counter()
    report = run_in_groups(
        teacher, conversations, greedy, methods, renderer, progress=args.progress
    )
    source = args.suite or Path(args.prompts).name
    if args.per_category:
        source += f" (first {args.per_category} per category)"
    if args.limit:
        source += f" (first {len(conversations)} conversations)"
    turns = count_turns(conversations)
    header = {
        "name": name,
        "drafter": args.drafter,
        "source": source,
        "conversations": len(conversations),
        "turns": turns,
        "max_new_tokens": args.max_new_tokens,
        "seconds": time.perf_counter() - start,  # the whole benchmark, warm-ups included
        "context": f"{args.drafter} drafter on {source}: {turns} turns, up to "
        f"{args.max_new_tokens} new tokens each",
    }
    return report, header


def _finish(
    args: argparse.Namespace,
    report: dict[str, Any],
    experiment: dict[str, Any],
    table: str,
    draw: Callable[[Path], list[Path]],
) -> int:
    write_report(args.json, {**report, "experiment": experiment})
    print(table)
    print(
        f"\n{len(report['turns'])} turns x {len(report['methods'])} methods in "
        f"{experiment['seconds']:.0f} s; report written to {args.json}",
        file=sys.stderr,
    )
    if args.plot_dir is not None:
        for path in draw(Path(args.plot_dir)):
            print(f"figure written to {path}", file=sys.stderr)
    return 0


def run_sweep(args: argparse.Namespace, *, teacher: Any = None, renderer: Any = None) -> int:
    """``sweep``: see :data:`DESCRIPTIONS`."""
    parser = args.experiment_parser  # set by add_<name>_arguments
    conversations = _conversations(parser, args)
    _check_outputs(parser, args)
    methods = _build(
        parser,
        args,
        lambda: grids.sweep_methods(
            args.drafter, args.nodes, args.depth, max_new_tokens=args.max_new_tokens
        ),
        f"--nodes {','.join(map(str, args.nodes))} --depth {','.join(map(str, args.depth))}",
    )
    report, header = _run(args, conversations, methods, teacher, renderer, "sweep")
    cells = grids.summarize_cells(report["turns"], grids.cells_of(methods))
    experiment = {
        **header,
        "nodes": sorted({c["nodes"] for c in cells}),
        "depths": sorted({c["depth"] for c in cells}),
        "cells": cells,
        "sweet_spot": grids.sweet_spot(cells),
    }
    return _finish(
        args,
        report,
        experiment,
        grids.format_sweep(experiment),
        lambda folder: sweep_plots(experiment, folder),
    )


def run_ablate_window(
    args: argparse.Namespace, *, teacher: Any = None, renderer: Any = None
) -> int:
    """``ablate-window``: see :data:`DESCRIPTIONS`."""
    parser = args.experiment_parser  # set by add_<name>_arguments
    conversations = _conversations(parser, args)
    _check_outputs(parser, args)
    methods = _build(
        parser,
        args,
        lambda: grids.window_methods(
            args.drafter,
            args.windows,
            nodes=args.nodes,
            depth=args.depth,
            max_new_tokens=args.max_new_tokens,
        ),
        f"--nodes {args.nodes} --depth {args.depth or 'default'}",
    )
    report, header = _run(args, conversations, methods, teacher, renderer, "ablate-window")
    spec = methods[0].spec
    experiment = {
        **header,
        "nodes": spec.budget,
        "depth": spec.depth,
        "cells": grids.summarize_cells(report["turns"], grids.cells_of(methods)),
    }
    return _finish(
        args,
        report,
        experiment,
        grids.format_windows(experiment),
        lambda folder: [window_plot(experiment, folder)],
    )


def run_budgets(args: argparse.Namespace, *, teacher: Any = None, renderer: Any = None) -> int:
    """``budgets``: see :data:`DESCRIPTIONS`."""
    parser = args.experiment_parser  # set by add_<name>_arguments
    conversations = _conversations(parser, args)
    _check_outputs(parser, args)
    methods = _build(
        parser,
        args,
        lambda: grids.budget_methods(
            args.drafter, args.budgets, depth=args.depth, max_new_tokens=args.max_new_tokens
        ),
        f"--budgets {','.join(map(str, args.budgets))} --depth {args.depth or 'default'}",
    )
    report, header = _run(args, conversations, methods, teacher, renderer, "budgets")
    cells = grids.summarize_cells(report["turns"], grids.cells_of(methods))
    experiment = {
        **header,
        "depth": methods[0].spec.depth,
        "cells": cells,
        "comparison": grids.compare_budgets(report["turns"], cells),
    }
    return _finish(
        args,
        report,
        experiment,
        grids.format_budgets(experiment),
        lambda folder: [budgets_plot(experiment, folder)],
    )


COMMANDS: dict[str, tuple[Callable[[argparse.ArgumentParser], None], Callable[..., int]]] = {
    "sweep": (add_sweep_arguments, run_sweep),
    "ablate-window": (add_ablate_window_arguments, run_ablate_window),
    "budgets": (add_budgets_arguments, run_budgets),
}


# ----------------------------------------------------------------------------- figures


# ----------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    """The standalone parser (sub-commands of :data:`COMMANDS`)."""
    parser = argparse.ArgumentParser(
        prog="python -m eaglepangu_jax.cli.experiments",
        description="Evaluation experiments, each a grid of speculative settings run side by "
        "side with greedy on the same turns.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (add, _) in COMMANDS.items():
        add(
            sub.add_parser(
                name, help=DESCRIPTIONS[name].split(";")[0], description=DESCRIPTIONS[name]
            )
        )
    return parser


def main(argv: Sequence[str] | None = None, *, teacher: Any = None, renderer: Any = None) -> int:
    """Run one experiment command; ``teacher`` / ``renderer`` replace the real model (tests).

    Returns:
      The exit status (bad options exit with status 2 before any model is loaded).
    """
    args = build_parser().parse_args(argv)
    if teacher is None:
        runtime.enable_compile_cache(None)
    return COMMANDS[args.command][1](args, teacher=teacher, renderer=renderer)


if __name__ == "__main__":
    sys.exit(main())
