"""Shared pieces of the command line: argument types, checks and messages.

Every value is checked by argparse before any model loads, so a typo costs a second, not a
model load; a bad value exits with status 2 and one ``error:`` line naming the problem.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

from eaglepangu_jax.drafters import draft_distilled, draft_target
from eaglepangu_jax.drafters.registry import DrafterUnavailableError
from eaglepangu_jax.engine.config import POLICIES, SpecConfig
from eaglepangu_jax.engine.decode import Teacher, validate
from eaglepangu_jax.evaluation.grids import FULL
from eaglepangu_jax.methods.registry import (
    DEFAULT_BUDGET,
    DEFAULT_DEPTH,
    DRAFTER_BUDGETS,
    MACHINE_SIZED,
    Method,
    make_method,
)

__all__ = [
    "Formatter",
    "parse_counts",
    "parse_windows",
    "typed",
    "counts",
    "count",
    "positive",
    "budget",
    "writable",
    "check_prompt",
    "note",
    "depth_of",
    "spec_of",
    "method_of",
    "add_tree_options",
]


class Formatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the hand-written layout of descriptions; shows the defaults worth showing."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        hidden = (
            action.default is None
            or isinstance(action.default, bool)
            or action.default == argparse.SUPPRESS
        )
        if action.option_strings and not hidden and "%(default)" not in text:
            text += " (default: %(default)s)"
        return text


# ----------------------------------------------------------------------------- values


def parse_counts(text: str, *, what: str, high: int | None = None) -> tuple[int, ...]:
    """``"4,8,16"`` -> ``(4, 8, 16)``, sorted.

    Raises:
      ValueError: an empty list or item, a non-integer, a value below 1 or above ``high``,
        or a repeated value.
    """
    items = [t.strip() for t in text.split(",")]
    if not text.strip() or not all(items):
        raise ValueError(f"expected a comma-separated list of {what}, got {text!r}")
    values = []
    for item in items:
        try:
            value = int(item)
        except ValueError:
            raise ValueError(f"{item!r} is not a whole number of {what}") from None
        if value < 1 or (high is not None and value > high):
            bound = "at least 1" if high is None else f"between 1 and {high}"
            raise ValueError(f"{what} must be {bound}, got {value}")
        values.append(value)
    no_repeats(values)
    return tuple(sorted(values))


def parse_windows(text: str) -> tuple[int | None, ...]:
    """``"128,256,full"`` -> ``(128, 256, None)`` (``None`` = the whole context, last).

    Raises:
      ValueError: an empty list or item, a value that is neither ``full`` nor an integer
        >= 1, or a repeated value.
    """
    items = [t.strip().lower() for t in text.split(",")]
    if not text.strip() or not all(items):
        raise ValueError(f"expected a comma-separated list of windows, got {text!r}")
    no_repeats(items)
    numbers = [i for i in items if i != FULL]
    bad = [i for i in numbers if not i.lstrip("+-").isdigit()]
    if bad:
        raise ValueError(f"window {bad[0]!r} is neither {FULL!r} nor a whole number of tokens")
    windows = parse_counts(",".join(numbers), what="window tokens") if numbers else ()
    return windows + ((None,) if FULL in items else ())


def no_repeats(values: Sequence[Any]) -> None:
    repeated = sorted({str(v) for v in values if values.count(v) > 1})
    if repeated:
        raise ValueError(f"value(s) {', '.join(repeated)} given more than once")


def typed(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """An argparse ``type`` that keeps ``parse``'s ``ValueError`` message."""

    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None

    return convert


def counts(what: str, high: int | None = None) -> Callable[[str], tuple[int, ...]]:
    """An argparse ``type`` for a comma-separated list (see :func:`parse_counts`)."""
    return typed(lambda text: parse_counts(text, what=what, high=high))


def count(what: str, high: int | None = None) -> Callable[[str], int]:
    """An argparse ``type`` for one whole number in ``[1, high]``."""

    def parse(text: str) -> int:
        values = parse_counts(text, what=what, high=high)
        if len(values) != 1:
            raise ValueError(f"expected one number of {what}, got {text!r}")
        return values[0]

    return typed(parse)


def positive(text: str) -> int:
    """An argparse ``type``: a whole number >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def budget(text: str) -> int | str:
    """An argparse ``type``: ``auto`` or a whole number of tree nodes >= 1."""
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected 'auto' or a whole number of tree nodes, got {text!r}"
        ) from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"budget must be >= 1 tree node, got {value}")
    return value


# ----------------------------------------------------------------------------- checks


def writable(parser: argparse.ArgumentParser, path: str | None, what: str) -> None:
    """Fail now (status 2) if ``path`` cannot be written: its folder does not exist or is not
    writable, or it is itself a folder."""
    if path is None:
        return
    folder = Path(path).resolve().parent
    if not folder.is_dir():
        parser.error(f"cannot write the {what} {path}: its folder does not exist")
    if Path(path).is_dir():
        parser.error(f"cannot write the {what} {path}: it is a folder")
    if not os.access(folder, os.W_OK):
        parser.error(f"cannot write the {what} {path}: its folder is not writable")


def check_prompt(
    parser: argparse.ArgumentParser,
    config: Any,
    method: Method,
    prompt_ids: Sequence[int],
    where: str = "",
) -> None:
    """The engine's checks of a run (:func:`~eaglepangu_jax.engine.decode.validate`: an
    empty prompt, one longer than the teacher's context, ...) on the teacher's ``config``
    alone, before its weights load; a failure is a parser error, prefixed with ``where``."""
    try:
        validate(Teacher(config, {}), method.drafter, prompt_ids, method.spec)
    except ValueError as err:
        parser.error(f"{where}{err}")


def note(message: str) -> None:
    """A progress or status line on stderr (stdout carries the results)."""
    print(message, file=sys.stderr, flush=True)


def depth_of(args: argparse.Namespace) -> tuple[int, bool]:
    """The depth to use, and whether it is a default (see ``make_method``)."""
    if args.depth is None:
        return DEFAULT_DEPTH, True
    return args.depth, False


def budget_is_default(args: argparse.Namespace) -> bool:
    """Whether ``--budget`` was left at ``auto``: a drafter with a budget of its own
    (:data:`~eaglepangu_jax.methods.registry.DRAFTER_BUDGETS`) then runs at it, or at the
    larger one this machine verifies for the same time
    (:mod:`eaglepangu_jax.calibration.sizing`)."""
    return args.budget == "auto"


def spec_of(parser: argparse.ArgumentParser, args: argparse.Namespace, **extra: Any) -> SpecConfig:
    """The run's :class:`SpecConfig` from the tree options, or a parser error."""
    depth, _ = depth_of(args)
    nodes = DEFAULT_BUDGET if args.budget == "auto" else args.budget
    try:
        return SpecConfig(
            policy=args.policy,
            budget=nodes,
            depth=depth,
            max_new_tokens=args.max_new_tokens,
            **extra,
        )
    except ValueError as err:
        parser.error(str(err))
    raise AssertionError("unreachable")


def method_of(
    parser: argparse.ArgumentParser,
    name: str,
    spec: SpecConfig,
    default: bool,
    torch_threads: int | None = None,
    draft_top_k: int | None = None,
    draft_tree: str | None = None,
    default_budget: bool = False,
) -> Method:
    """``make_method`` with its errors turned into a parser error."""
    try:
        return make_method(
            name,
            spec,
            default_depth=default,
            default_budget=default_budget,
            torch_threads=torch_threads,
            draft_top_k=draft_top_k,
            draft_tree=draft_tree,
        )
    except (ValueError, DrafterUnavailableError) as err:
        parser.error(str(err))
    raise AssertionError("unreachable")


def add_tree_options(p: argparse.ArgumentParser, *, max_new_tokens: int) -> None:
    """The options that shape a run's tree (``--max-new-tokens --budget --depth --draft-top-k
    --draft-tree --policy``)."""
    p.add_argument(
        "--max-new-tokens",
        type=positive,
        default=max_new_tokens,
        metavar="N",
        help="tokens to generate per answer (fewer if the model stops)",
    )
    p.add_argument(
        "--budget",
        type=budget,
        default="auto",
        metavar="{auto,N}",
        help=f"tree nodes verified per round, root excluded; 'auto' = "
        f"{DEFAULT_BUDGET}, or the drafter's own "
        f"({', '.join(f'{k} {v}' for k, v in DRAFTER_BUDGETS.items())}; "
        f"{' and '.join(MACHINE_SIZED)} take more where this machine's calibration verifies "
        f"more slots for the same time) "
        f"(with --policy auto: the ceiling under which the controller chooses each round)",
    )
    p.add_argument(
        "--depth",
        type=positive,
        default=None,
        metavar="D",
        help=f"deepest tree node (default: {DEFAULT_DEPTH} for ngram, the "
        f"shipped head's own depth for eagle3; with --budget auto, no deeper than the "
        f"budget of a drafter that has its own: a tree of N nodes is at most N deep)",
    )
    p.add_argument(
        "--draft-top-k",
        type=positive,
        default=None,
        metavar="K",
        help="root children of the draft-target drafters (draft-target, draft-distilled): "
        "K chains of up to --depth tokens share the --budget nodes (default: the draft's "
        f"own, {draft_target.DEFAULT_TOP_K} for draft-target, "
        f"{draft_distilled.DEFAULT_TOP_K} for draft-distilled); other drafters ignore it",
    )
    p.add_argument(
        "--draft-tree",
        choices=draft_target.TREE_SHAPES,
        default=None,
        help="tree shape of the draft-target drafters: 'chains' = --draft-top-k fixed chains "
        "(default); 'beam' = a dynamic tree keeping the --draft-top-k best nodes per level "
        "by cumulative draft log-probability, then the --budget best of them; other drafters "
        "ignore it",
    )
    p.add_argument(
        "--policy",
        choices=POLICIES,
        default="auto",
        help="'auto' = the controller: each round it drafts only when speculation is "
        "expected to pay (acceptance learned online, costs from this machine's "
        "calibration, measured on first use), then keeps the tree nodes that pay for "
        "their verification; 'drafter' = the drafter's own tree every round; "
        "'best_first' = the top-budget prefixes of per-depth marginals; 'static' = a "
        "fixed topology",
    )
