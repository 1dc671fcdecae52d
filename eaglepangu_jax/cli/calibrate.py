"""``eaglepangu calibrate``: measure this machine's verification cost and fit the roofline;
saved where the ``"auto"`` policy finds it."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Sequence

from eaglepangu_jax import runtime
from eaglepangu_jax.calibration import measure, store
from eaglepangu_jax.calibration.curve import draft_cost_key
from eaglepangu_jax.cli import args as args_lib
from eaglepangu_jax.drafters.registry import NAMES as DRAFTER_NAMES
from eaglepangu_jax.drafters.registry import DrafterUnavailableError
from eaglepangu_jax.engine.config import SpecConfig
from eaglepangu_jax.engine.decode import Teacher
from eaglepangu_jax.evaluation import calibration_report as report
from eaglepangu_jax.methods import registry as methods_lib
from eaglepangu_jax.models.config import LlamaConfig

__all__ = ["add_arguments", "run", "main"]


def _drafter_list(text: str) -> tuple[str, ...]:
    names = tuple(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    if names in ((), ("none",)):
        return ()
    unknown = [n for n in names if n not in DRAFTER_NAMES]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown drafter(s) {unknown}; known: {', '.join(DRAFTER_NAMES)} (or 'none')"
        )
    return names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the options of ``eaglepangu calibrate`` to ``parser``."""
    parser.add_argument(
        "--slots",
        type=args_lib.counts("tokens"),
        default=",".join(map(str, measure.DEFAULT_SLOTS)),
        metavar="LIST",
        help="tokens per verify forward (root + nodes) to time, e.g. 1,2,4,9,16,32,64",
    )
    parser.add_argument(
        "--contexts",
        type=args_lib.counts("tokens"),
        default=",".join(map(str, measure.DEFAULT_CONTEXTS)),
        metavar="LIST",
        help="cached tokens to time at, e.g. 64,256,1024",
    )
    parser.add_argument(
        "--repeats",
        type=args_lib.positive,
        default=measure.DEFAULT_REPEATS,
        metavar="N",
        help="timed runs per point (the median is kept)",
    )
    parser.add_argument(
        "--drafters",
        type=_drafter_list,
        default=None,
        metavar="LIST",
        help=f"drafters whose drafting cost to time, from "
        f"{', '.join(DRAFTER_NAMES)}, or 'none' (default: those that "
        f"load)",
    )
    parser.add_argument(
        "--out",
        "--json",
        dest="out",
        metavar="FILE.json",
        default=None,
        help="where to save the calibration (default: calibration.json in "
        "the cache folder, where 'auto' looks for it)",
    )
    parser.add_argument(
        "--plot", metavar="FILE.png", default=None, help="also draw measured vs predicted latency"
    )
    parser.add_argument(
        "--no-progress", dest="progress", action="store_false", help="no progress bar"
    )
    parser.set_defaults(calibrate_parser=parser)


def _methods(
    parser: argparse.ArgumentParser, teacher: Teacher, names: Sequence[str] | None
) -> dict[str, methods_lib.Method]:
    """The drafters to time; explicit names must load, defaults that do not are skipped."""
    explicit = names is not None
    spec = SpecConfig(budget=methods_lib.DEFAULT_BUDGET, depth=methods_lib.DEFAULT_DEPTH)
    methods = {}
    for name in names if explicit else DRAFTER_NAMES:
        try:
            method = _method(name, spec, teacher)
            methods[draft_cost_key(method)] = method
        except (ValueError, DrafterUnavailableError) as err:
            if explicit:
                parser.error(f"--drafters: {name}: {err}")
            print(f"drafter {name} skipped: {err}", file=sys.stderr)
    return methods


def _method(name: str, spec: SpecConfig, teacher: Teacher) -> methods_lib.Method:
    if name == "eagle3":

        def loader():
            from eaglepangu_jax.drafters.eagle3 import load_shipped_eagle3

            return load_shipped_eagle3(teacher.params)

        return methods_lib.make_method(
            name, spec, default_depth=True, default_budget=True, eagle3_loader=loader
        )
    if name != "block":
        return methods_lib.make_method(name, spec, default_depth=True, default_budget=True)
    try:
        from eaglepangu_jax.drafters.block import load_shipped_block
    except ImportError as err:
        raise DrafterUnavailableError(f"the block drafter is not available: {err}") from None
    try:
        drafter, params = load_shipped_block(teacher.params, budget=spec.budget)
    except (TypeError, ImportError, OSError, ValueError, KeyError) as err:
        raise DrafterUnavailableError(f"the block drafter could not be loaded: {err}") from err
    spec = dataclasses.replace(spec, policy="best_first", depth=min(spec.depth, drafter.max_depth))
    drafter = methods_lib.configure_drafter(drafter, budget=spec.budget, depth=spec.depth)
    return methods_lib.Method(name=name, spec=spec, drafter=drafter, draft_params=params)


def _check_args(
    parser: argparse.ArgumentParser, args: argparse.Namespace, config: LlamaConfig
) -> None:
    if max(args.slots) > config.max_position:
        parser.error(
            f"--slots: {max(args.slots)} is above the model's context of {config.max_position}"
        )
    if max(args.slots) + max(args.contexts) > config.max_position:
        parser.error(
            f"--contexts: {max(args.contexts)} cached tokens plus {max(args.slots)} "
            f"slots exceed the model's context of {config.max_position}"
        )
    for option, path in (("--out", args.out), ("--plot", args.plot)):
        if path is not None and not Path(path).resolve().parent.is_dir():
            parser.error(f"{option}: cannot write {path}: its folder does not exist")
    if args.plot is not None:
        from eaglepangu_jax.evaluation import plots

        try:
            plots.require_matplotlib()
        except plots.PlotsUnavailableError as err:
            parser.error(f"--plot: {err}")


def run(args: argparse.Namespace, *, teacher: Teacher | None = None) -> int:
    """Run ``eaglepangu calibrate`` with parsed ``args``; ``teacher`` replaces SmolLM2.

    Returns:
      The exit status (bad options exit with status 2 before the model loads).
    """
    parser = args.calibrate_parser
    config = teacher.config if teacher is not None else LlamaConfig.smollm2_135m()
    _check_args(parser, args, config)
    if teacher is None:
        teacher = runtime.load_teacher()
    methods = _methods(parser, teacher, args.drafters)
    from tqdm import tqdm

    total = measure.progress_total(len(args.slots) * len(args.contexts), args.repeats, len(methods))
    with tqdm(
        total=total, desc="calibrate", unit="run", disable=not args.progress, dynamic_ncols=True
    ) as bar:
        calibration = measure.calibrate_teacher(
            teacher,
            slots=args.slots,
            contexts=args.contexts,
            repeats=args.repeats,
            drafters=methods,
            bar=bar,
        )
    path = store.save_calibration(calibration, args.out)
    print(report.format_report(calibration, teacher.config))
    print(f"calibration written to {path}", file=sys.stderr)
    if args.plot is not None:
        report.plot_calibration(calibration, teacher.config, args.plot)
        print(f"plot written to {args.plot}", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    """A stand-alone parser for ``calibrate`` (tests, ``python -m``)."""
    parser = argparse.ArgumentParser(
        prog="eaglepangu calibrate",
        description="Time the teacher's verify forward on this machine over a grid of tree "
        "sizes and contexts, the engine's per-round overhead and each drafter's "
        "cost; fit the roofline and save it for the 'auto' policy.",
    )
    add_arguments(parser)
    return parser


def main(argv: Sequence[str] | None = None, *, teacher: Teacher | None = None) -> int:
    """Entry point with its own parser; ``teacher`` replaces SmolLM2 (tests)."""
    args = build_parser().parse_args(None if argv is None else list(argv))
    return run(args, teacher=teacher)


if __name__ == "__main__":
    runtime.enable_compile_cache(None)
    sys.exit(main())
