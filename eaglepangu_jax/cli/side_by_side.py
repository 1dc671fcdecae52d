"""What the side-by-side scripts under ``bench/`` share: the suite options, the real teacher
with its compile cache, and one run of greedy and the compared methods interleaved per turn,
calibrated, written as a bench report with the script's own entry.

A script builds the methods it compares (its variants of a drafter, a teacher or a setting)
between :func:`real_teacher` and :func:`run_and_report`::

    parser = argparse.ArgumentParser()
    side_by_side.add_suite_arguments(parser, per_category=2)
    args = parser.parse_args(argv)
    side_by_side.check_suite_arguments(parser, args)
    teacher = side_by_side.real_teacher(teacher)  # a test may pass its own
    methods = [make_method("greedy", spec), ...]
    side_by_side.run_and_report(teacher, methods, args, "my_comparison", {...})
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from eaglepangu_jax import runtime
from eaglepangu_jax.calibration.auto import calibrated_methods
from eaglepangu_jax.engine.decode import Teacher
from eaglepangu_jax.evaluation.report import format_summary, write_report
from eaglepangu_jax.evaluation.run import run_bench
from eaglepangu_jax.evaluation.suites import load_suite, per_category
from eaglepangu_jax.methods.registry import Method

__all__ = ["add_suite_arguments", "check_suite_arguments", "real_teacher", "run_and_report"]


def add_suite_arguments(
    parser: argparse.ArgumentParser,
    *,
    per_category: int,
    suite: str = "dev",
    max_new_tokens: int = 64,
) -> None:
    """``--suite`` (by default ``dev``: the human-written turns kept apart from the evaluation
    suites, where settings are chosen), ``--per-category``, ``--max-new-tokens`` and
    ``--json`` (required), with the given defaults."""
    parser.add_argument("--suite", default=suite)
    parser.add_argument(
        "--per-category",
        type=int,
        default=per_category,
        help="conversations per category (0: all)",
    )
    parser.add_argument("--max-new-tokens", type=int, default=max_new_tokens)
    parser.add_argument("--json", required=True, help="the report to write")


def check_suite_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Exit through ``parser.error`` on a negative ``--per-category`` or a ``--max-new-tokens``
    below 1."""
    if args.per_category < 0:
        parser.error("--per-category must be >= 0 (0: every conversation)")
    if args.max_new_tokens < 1:
        parser.error("--max-new-tokens must be >= 1")


def real_teacher(teacher: Teacher | None = None) -> Teacher:
    """``teacher``, or the real SmolLM2 teacher with the persistent compile cache on (a suite's
    long prompts need decode loops of new shapes per method: a rerun reads them back)."""
    if teacher is not None:
        return teacher
    runtime.enable_compile_cache(None)
    return runtime.load_teacher()


def run_and_report(
    teacher: Teacher,
    methods: list[Method],
    args: argparse.Namespace,
    entry: str,
    details: dict[str, Any] | Callable[[dict[str, Any]], dict[str, Any]],
    *,
    renderer=None,
    per_round: bool = False,
    progress: bool = True,
) -> dict[str, Any]:
    """Calibrate the controlled methods on this machine, run ``methods`` (greedy first) on the
    turns of ``args.suite`` (``args.per_category`` per category, 0: all), interleaved per
    turn, and write the report to ``args.json`` with ``report[entry]`` = the suite, the
    per-category count and ``details`` (or what ``details(report)`` returns, for figures
    drawn from the turns); print the summary and return the report.
    ``per_round``: each turn also records its rounds (see ``run_bench``); ``progress``:
    progress bars on stderr."""
    renderer = renderer if renderer is not None else runtime.load_renderer()
    methods, _ = calibrated_methods(teacher, methods, progress=progress)
    conversations = load_suite(args.suite)
    if args.per_category:
        conversations = per_category(conversations, args.per_category)
    report = run_bench(
        teacher, conversations, methods, renderer, per_round=per_round, progress=progress
    )
    if callable(details):
        details = details(report)
    report[entry] = {"suite": args.suite, "per_category": args.per_category, **details}
    write_report(args.json, report)
    print(format_summary(report))
    return report
