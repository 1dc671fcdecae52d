"""Running experiment grids beside greedy, and their figures.

An experiment (``eaglepangu sweep``, ``ablate-window``, ``budgets``; the commands live in
:mod:`eaglepangu_jax.cli.experiments`) is a list of methods, one per cell of a grid
(:mod:`eaglepangu_jax.evaluation.grids`), run beside greedy on the same turns.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import jax

from eaglepangu_jax.evaluation import grids, plots
from eaglepangu_jax.evaluation.report import summarize_turns
from eaglepangu_jax.evaluation.run import run_bench
from eaglepangu_jax.evaluation.suites import Conversation
from eaglepangu_jax.methods.registry import REFERENCE, Method

__all__ = ["CELLS_PER_RUN", "run_in_groups", "sweep_plots", "window_plot", "budgets_plot"]

CELLS_PER_RUN = 6  # cells interleaved in one benchmark (see run_in_groups)


def run_in_groups(
    teacher: Any,
    conversations: list[Conversation],
    greedy: Method,
    methods: Sequence[Method],
    renderer: Any,
    *,
    progress: bool,
    group_size: int | None = None,
) -> dict[str, Any]:
    """``run_bench`` over ``greedy`` + ``methods``, ``group_size`` cells at a time.

    Every compiled program of a benchmark stays alive while it runs (the methods are
    interleaved per turn), and a 16-cell sweep exhausted the process's memory maps in XLA's
    CPU compiler. So the cells run in groups, each beside its own greedy run on the same
    turns (each cell's speed-up is against the greedy run it was interleaved with), and the
    compilation caches are cleared between groups. The merged report keeps the first
    group's greedy records and every cell's records, and is summarised afresh.
    ``group_size`` defaults to :data:`CELLS_PER_RUN`.
    """
    group_size = group_size or CELLS_PER_RUN
    groups = [list(methods[i : i + group_size]) for i in range(0, len(methods), group_size)]
    merged: dict[str, Any] | None = None
    for index, group in enumerate(groups):
        if index:
            jax.clear_caches()
        report = run_bench(teacher, conversations, [greedy, *group], renderer, progress=progress)
        if merged is None:
            merged = report
            continue
        merged["methods"].update({k: v for k, v in report["methods"].items() if k != REFERENCE})
        for key in ("warmup_seconds", "warmup_compile_seconds"):
            merged[key].update({k: v for k, v in report[key].items() if k != REFERENCE})
        for mine, theirs in zip(merged["turns"], report["turns"]):
            mine["methods"].update({k: v for k, v in theirs["methods"].items() if k != REFERENCE})
    assert merged is not None, "no methods to run"
    names = [REFERENCE] + [m.name for m in methods]
    merged["summary"] = summarize_turns(merged["turns"], names)
    merged["groups"] = [[m.name for m in group] for group in groups]
    return merged


def sweep_plots(experiment: dict[str, Any], folder: Path) -> list[Path]:
    """Speed-up and accepted-length heatmaps of a sweep (sweet spot outlined)."""
    cells, rows, cols = experiment["cells"], experiment["depths"], experiment["nodes"]
    best = experiment["sweet_spot"]
    common = dict(
        rows=rows,
        cols=cols,
        xlabel="tree nodes (budget)",
        ylabel="max depth",
        highlight=(rows.index(best["depth"]), cols.index(best["nodes"])) if best else None,
    )
    stem = folder / f"sweep_{experiment['drafter']}"
    note = "outlined: the sweet spot, best mean speed-up"
    return [
        plots.heatmap(
            grids.grid(cells, "mean_speedup", rows, cols),
            path=f"{stem}_speedup.png",
            fmt="{:.2f}×",
            center=1.0,
            title=f"Mean speed-up over greedy ({note})\n{experiment['context']}",
            colorbar_label="speed-up over greedy (×)",
            **common,
        ),
        plots.heatmap(
            grids.grid(cells, "mean_accepted_length", rows, cols),
            path=f"{stem}_accepted_length.png",
            title=f"Mean accepted length ({note})\n{experiment['context']}",
            colorbar_label="accepted length (tokens / verify round)",
            **common,
        ),
    ]


def window_plot(experiment: dict[str, Any], folder: Path) -> Path:
    """Accepted length and speed-up against the draft window."""
    cells = experiment["cells"]
    return plots.setting_bars(
        [grids.window_label(c["window"]) for c in cells],
        [
            (
                "mean accepted length (tokens / verify round)",
                [c["mean_accepted_length"] for c in cells],
                1.0,
            ),
            ("mean speed-up over greedy (×)", [c["mean_speedup"] for c in cells], 1.0),
        ],
        path=folder / f"window_{experiment['drafter']}.png",
        xlabel="draft window (latest tokens the drafter sees)",
        title=f"Draft-window ablation ({experiment['nodes']} tree nodes, max depth "
        f"{experiment['depth']})\n{experiment['context']}",
    )


def budgets_plot(experiment: dict[str, Any], folder: Path) -> Path:
    """Mean speed-up per category: every fixed budget and the controller, with its gap."""
    rows = experiment["comparison"]["categories"]
    series = {
        f"fixed, {b['budget']} nodes": [r["fixed"][i]["mean_speedup"] for r in rows]
        for i, b in enumerate(rows[0]["fixed"])
    }
    auto = next(c for c in experiment["cells"] if c["policy"] == "auto")
    series[f"auto controller (ceiling {auto['nodes']} nodes)"] = [r["auto_speedup"] for r in rows]
    return plots.grouped_bars(
        [f"{r['category']}\n({plots.plural(r['turns'], 'turn')})" for r in rows],
        series,
        path=folder / f"budgets_{experiment['drafter']}.png",
        xlabel="prompt category",
        ylabel="mean speed-up over greedy (×)",
        group_notes=[f"auto gap {grids.format_number(r['gap_percent'], 1, '%')}" for r in rows],
        title=f"Controller vs fixed budgets (max depth {experiment['depth']}; gap = best fixed "
        f"minus auto, % of best)\n{experiment['context']}",
    )
