"""Experiment grids: one benchmark method per cell, and the summaries of a grid run.

An experiment (see :mod:`eaglepangu_jax.cli.experiments`) is a list of
:class:`eaglepangu_jax.methods.Method`, one drafter with one :class:`SpecConfig` per cell, each
named after its cell (``"ngram n=8 d=4"``), run by one :func:`evaluation.run.run_bench` call beside
greedy. Everything here after the builders reads only bench's per-turn records and the cells'
coordinates (:func:`cells_of`), so a stored report can be summarised again.

* :func:`sweep_methods`: tree nodes x max depth (the seeds' budget sweep).
* :func:`window_methods`: the drafter sees only the last W tokens (``draft_window``).
* :func:`budget_methods`: best-first at fixed budgets and the ``auto`` controller, compared
  per prompt category by :func:`compare_budgets`.

The ``format_*`` functions print an experiment summary as a fixed-width table.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Sequence

from eaglepangu_jax.drafters.registry import MARGINAL, NAMES
from eaglepangu_jax.engine.config import SpecConfig
from eaglepangu_jax.evaluation.report import summarize_turns
from eaglepangu_jax.methods import registry as methods_lib

__all__ = [
    "DRAFTERS",
    "MARGINAL_DRAFTERS",
    "MAX_NODES",
    "MAX_DEPTH",
    "FULL",
    "TARGET_GAP_PERCENT",
    "ALL_TURNS",
    "default_policy",
    "window_label",
    "Maker",
    "method_maker",
    "sweep_methods",
    "window_methods",
    "budget_methods",
    "cells_of",
    "summarize_cells",
    "sweet_spot",
    "grid",
    "compare_budgets",
    "format_number",
    "format_sweep",
    "format_windows",
    "format_budgets",
]

DRAFTERS = NAMES
MARGINAL_DRAFTERS = MARGINAL  # their marginals are shaped best-first into a tree
MAX_NODES = 256
# A sanity ceiling above any drafter here; each drafter's own maximum is checked when its
# cells are built (methods_lib.make_method).
MAX_DEPTH = 64
FULL = "full"  # the window of the whole context
TARGET_GAP_PERCENT = 5.0
ALL_TURNS = "all turns"


def default_policy(drafter: str) -> str:
    """A tree-proposing drafter builds its own tree; a block drafter's marginals are shaped
    best-first into exactly the cell's node count."""
    return "best_first" if drafter in MARGINAL_DRAFTERS else "drafter"


# ----------------------------------------------------------------------------- values


def window_label(window: int | None) -> str:
    """``"128"`` or ``"full"``."""
    return FULL if window is None else str(window)


# ----------------------------------------------------------------------------- grids


Maker = Callable[[SpecConfig, bool], methods_lib.Method]


def method_maker(drafter: str) -> Maker:
    """``(spec, default_depth) -> Method`` for one drafter (see :func:`methods_lib.make_method`);
    EAGLE-3's shipped weights are read once for the whole grid."""
    extra = (
        {"eagle3_loader": functools.cache(methods_lib.load_eagle3)} if drafter == "eagle3" else {}
    )

    def make(spec: SpecConfig, default_depth: bool) -> methods_lib.Method:
        return methods_lib.make_method(drafter, spec, default_depth=default_depth, **extra)

    return make


def _cell(
    make: Maker, name: str, spec: SpecConfig, default_depth: bool = False
) -> methods_lib.Method:
    return dataclasses.replace(make(spec, default_depth), name=name)


def sweep_methods(
    drafter: str,
    nodes: Sequence[int],
    depths: Sequence[int],
    *,
    max_new_tokens: int,
    policy: str | None = None,
    make: Maker | None = None,
) -> list[methods_lib.Method]:
    """One method per (nodes, depth), nodes varying fastest, named ``"ngram n=8 d=4"``.

    Raises:
      ValueError: a depth above the drafter's maximum (or another bad setting).
      methods_lib.DrafterUnavailableError: the drafter cannot be loaded.
    """
    make = make or method_maker(drafter)
    policy = policy or default_policy(drafter)
    return [
        _cell(
            make,
            f"{drafter} n={n} d={d}",
            SpecConfig(policy=policy, budget=n, depth=d, max_new_tokens=max_new_tokens),
        )
        for d in depths
        for n in nodes
    ]


def window_methods(
    drafter: str,
    windows: Sequence[int | None],
    *,
    nodes: int,
    depth: int | None,
    max_new_tokens: int,
    policy: str | None = None,
    make: Maker | None = None,
) -> list[methods_lib.Method]:
    """One method per draft window, named ``"ngram w=128"`` / ``"ngram w=full"``; ``depth``
    ``None`` = the bench default (a shipped drafter keeps its own)."""
    make = make or method_maker(drafter)
    spec = SpecConfig(
        policy=policy or default_policy(drafter),
        budget=nodes,
        depth=depth or methods_lib.DEFAULT_DEPTH,
        max_new_tokens=max_new_tokens,
    )
    return [
        _cell(
            make,
            f"{drafter} w={window_label(w)}",
            dataclasses.replace(spec, draft_window=w),
            depth is None,
        )
        for w in windows
    ]


def budget_methods(
    drafter: str,
    budgets: Sequence[int],
    *,
    depth: int | None,
    max_new_tokens: int,
    make: Maker | None = None,
) -> list[methods_lib.Method]:
    """Every fixed budget (``"block b=8"``), then the ``auto`` controller with the largest
    budget as its ceiling (``"block auto<=32"``). A block drafter's fixed cells are best-first
    trees; a tree-proposing drafter (n-gram, EAGLE-3) builds its own tree of each budget, and
    under ``auto`` the controller keeps the best-scored nodes of its largest tree."""
    make = make or method_maker(drafter)
    spec = SpecConfig(
        policy=default_policy(drafter),
        depth=depth or methods_lib.DEFAULT_DEPTH,
        max_new_tokens=max_new_tokens,
    )
    fixed = [
        _cell(make, f"{drafter} b={b}", dataclasses.replace(spec, budget=b), depth is None)
        for b in budgets
    ]
    ceiling = max(budgets)
    auto = _cell(
        make,
        f"{drafter} auto<={ceiling}",
        dataclasses.replace(spec, policy="auto", budget=ceiling),
        depth is None,
    )
    return fixed + [auto]


def cells_of(methods: Sequence[methods_lib.Method]) -> list[dict[str, Any]]:
    """The grid coordinates of each method, from the spec it actually runs with."""
    return [
        {
            "method": m.name,
            "nodes": m.spec.budget,
            "depth": m.spec.depth,
            "window": m.spec.draft_window,
            "policy": m.spec.policy,
        }
        for m in methods
    ]


# ----------------------------------------------------------------------------- summaries


def summarize_cells(
    turns: Sequence[dict[str, Any]], cells: Sequence[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Each cell with its :func:`summarize_turns` figures over ``turns``."""
    stats = summarize_turns(turns, [c["method"] for c in cells])
    return [{**c, **stats[c["method"]]} for c in cells]


def sweet_spot(cells: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """The cell of best mean speed-up; a tie goes to fewer nodes, then less depth (the
    cheaper tree). ``None`` when no cell has a speed-up."""
    measured = [c for c in cells if c.get("mean_speedup") is not None]
    if not measured:
        return None
    return max(measured, key=lambda c: (c["mean_speedup"], -c["nodes"], -c["depth"]))


def grid(
    cells: Sequence[dict[str, Any]], key: str, rows: Sequence[int], cols: Sequence[int]
) -> list[list[float | None]]:
    """``cells[key]`` laid out by depth (rows) and nodes (columns); missing = ``None``."""
    at = {(c["depth"], c["nodes"]): c.get(key) for c in cells}
    return [[at.get((d, n)) for n in cols] for d in rows]


def compare_budgets(
    turns: Sequence[dict[str, Any]],
    cells: Sequence[dict[str, Any]],
    *,
    target_percent: float = TARGET_GAP_PERCENT,
) -> dict[str, Any]:
    """Per category (and over all turns): the controller's mean speed-up, each fixed
    budget's, the best fixed budget, and the gap ``100 * (best - auto) / best`` (positive:
    the controller is slower; negative: it beats every fixed budget).

    Raises:
      ValueError: not exactly one ``auto`` cell, or no fixed one.
    """
    auto = [c for c in cells if c["policy"] == "auto"]
    fixed = [c for c in cells if c["policy"] != "auto"]
    if len(auto) != 1 or not fixed:
        raise ValueError(
            f"need one 'auto' cell and at least one fixed budget, got {len(auto)} and {len(fixed)}"
        )
    names = [c["method"] for c in cells]
    categories = list(dict.fromkeys(t["category"] for t in turns))
    rows = []
    for category in categories + [ALL_TURNS]:
        subset = [t for t in turns if category in (ALL_TURNS, t["category"])]
        stats = summarize_turns(subset, names)
        by_budget = [
            {"budget": c["nodes"], "mean_speedup": stats[c["method"]]["mean_speedup"]}
            for c in fixed
        ]
        best = max(
            (b for b in by_budget if b["mean_speedup"] is not None),
            key=lambda b: (b["mean_speedup"], -b["budget"]),
            default=None,
        )
        auto_speedup = stats[auto[0]["method"]]["mean_speedup"]
        gap = None
        if best is not None and auto_speedup is not None and best["mean_speedup"] > 0:
            gap = 100.0 * (best["mean_speedup"] - auto_speedup) / best["mean_speedup"]
        best = best or {"budget": None, "mean_speedup": None}
        rows.append(
            {
                "category": category,
                "turns": len(subset),
                "auto_speedup": auto_speedup,
                "auto_accepted_length": stats[auto[0]["method"]]["mean_accepted_length"],
                "fixed": by_budget,
                "best_budget": best["budget"],
                "best_fixed_speedup": best["mean_speedup"],
                "gap_percent": gap,
                "within_target": gap is not None and gap <= target_percent,
            }
        )
    return {
        "target_gap_percent": target_percent,
        "categories": rows,
        "all_within_target": all(r["within_target"] for r in rows),
    }


# ----------------------------------------------------------------------------- tables


def format_number(value: float | None, digits: int = 2, suffix: str = "") -> str:
    """``value`` with ``digits`` decimals and ``suffix``; ``"-"`` for a missing value."""
    return "-" if value is None else f"{value:.{digits}f}{suffix}"


def _percent(fraction: float | None) -> str:
    return format_number(None if fraction is None else 100.0 * fraction, 0, "%")


def _matrix(
    title: str,
    values: list[list[float | None]],
    rows: Sequence[int],
    cols: Sequence[int],
    suffix: str,
) -> list[str]:
    lines = [title, "depth \\ nodes" + "".join(f"{n:>9}" for n in cols)]
    for d, row in zip(rows, values):
        lines.append(f"{d:<13}" + "".join(f"{format_number(v, 2, suffix):>9}" for v in row))
    return lines


def format_sweep(experiment: dict[str, Any]) -> str:
    """Speed-up and accepted-length matrices, and the sweet spot."""
    cells, rows, cols = experiment["cells"], experiment["depths"], experiment["nodes"]
    lines = [experiment["context"], ""]
    lines += _matrix(
        "mean speed-up over greedy", grid(cells, "mean_speedup", rows, cols), rows, cols, "x"
    )
    lines += [""] + _matrix(
        "mean accepted length (tokens / verify round)",
        grid(cells, "mean_accepted_length", rows, cols),
        rows,
        cols,
        "",
    )
    best = experiment["sweet_spot"]
    if best is not None:
        speedup = format_number(best["mean_speedup"], 2, "x")
        accepted = format_number(best["mean_accepted_length"])
        lines += [
            "",
            f"sweet spot: {best['nodes']} nodes, depth {best['depth']}: {speedup} "
            f"mean speed-up, accepted length {accepted}",
        ]
    worst = min(
        (c["identical_fraction"] for c in cells if c["identical_fraction"] is not None),
        default=None,
    )
    lines.append(f"outputs identical to greedy: at least {_percent(worst)} of turns in every cell")
    return "\n".join(lines)


def format_windows(experiment: dict[str, Any]) -> str:
    """One row per draft window."""
    header = f"{'window':>8} {'speed-up':>9} {'p50':>7} {'acc.len':>8} {'identical':>10}"
    lines = [experiment["context"], "", header, "-" * len(header)]
    for c in experiment["cells"]:
        lines.append(
            f"{window_label(c['window']):>8} "
            f"{format_number(c['mean_speedup'], 2, 'x'):>9} "
            f"{format_number(c['p50_speedup'], 2, 'x'):>7} "
            f"{format_number(c['mean_accepted_length']):>8} "
            f"{_percent(c['identical_fraction']):>10}"
        )
    return "\n".join(lines)


def format_budgets(experiment: dict[str, Any]) -> str:
    """Per category: every fixed budget, the controller, the best fixed budget and the gap."""
    comparison = experiment["comparison"]
    target = comparison["target_gap_percent"]
    budgets = [b["budget"] for b in comparison["categories"][0]["fixed"]]
    header = (
        f"{'category':<14} {'turns':>5}"
        + "".join(f"{'b=' + str(b):>8}" for b in budgets)
        + f"{'auto':>8} {'best fixed':>13} {'gap':>7}  within {target:g}%"
    )
    lines = [experiment["context"], "", "mean speed-up over greedy", header, "-" * len(header)]
    for r in comparison["categories"]:
        fixed = "".join(f"{format_number(b['mean_speedup'], 2, 'x'):>8}" for b in r["fixed"])
        best = f"{format_number(r['best_fixed_speedup'], 2, 'x')} (b={r['best_budget']})"
        lines.append(
            f"{r['category'][:14]:<14} {r['turns']:>5}{fixed}"
            f"{format_number(r['auto_speedup'], 2, 'x'):>8} {best:>13} "
            f"{format_number(r['gap_percent'], 1, '%'):>7}  "
            f"{'yes' if r['within_target'] else 'NO'}"
        )
    verdict = "met" if comparison["all_within_target"] else "NOT met"
    lines += [
        "",
        f"target (auto within {target:g}% of the best fixed budget in every category): {verdict}",
    ]
    return "\n".join(lines)
