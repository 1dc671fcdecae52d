"""Figures for benchmark and experiment reports (PNG, written atomically).

matplotlib is an optional dependency (the ``plots`` extra): it is imported only when a figure
is drawn, and :func:`require_matplotlib` says how to install it when it is missing. Figures
are built on ``matplotlib.figure.Figure`` directly (no pyplot), so nothing here touches a
global figure registry or needs a display.

* :func:`heatmap`: a value per (row, column) cell, annotated (the budget x depth sweep).
* :func:`setting_bars`: one or more metrics against a categorical setting (window ablation).
* :func:`grouped_bars`: series of bars per group (fixed budgets vs the controller, per
  category).
* :func:`speedup_distribution` / :func:`write_bench_plots`: per-turn speed-up and accepted
  length of every method, per category, from any ``eaglepangu bench`` report.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from eaglepangu_jax.files import atomic_write

__all__ = [
    "REFERENCE",
    "DPI",
    "BENCH_PLOT",
    "PALETTE",
    "PlotsUnavailableError",
    "require_matplotlib",
    "save_figure",
    "heatmap",
    "setting_bars",
    "grouped_bars",
    "plural",
    "speedup_distribution",
    "write_bench_plots",
]

REFERENCE = "greedy"
DPI = 120
BENCH_PLOT = "speedup_by_category.png"
# Distinct, colour-blind-safe colours (Okabe-Ito), cycled over methods and series.
PALETTE = ("#0072B2", "#E69F00", "#009E73", "#D55E00", "#CC79A7", "#56B4E9", "#F0E442", "#000000")


class PlotsUnavailableError(RuntimeError):
    """matplotlib is not installed (the message says how to get it)."""


def require_matplotlib() -> Any:
    """The ``matplotlib`` module.

    Raises:
      PlotsUnavailableError: it is not installed; the message names the ``plots`` extra.
    """
    try:
        import matplotlib
    except ImportError:
        raise PlotsUnavailableError(
            "plots need matplotlib, which is not installed; install the 'plots' extra "
            "(pip install 'eaglepangu[plots]') or drop the plot option"
        ) from None
    return matplotlib


def _figure(width: float, height: float, title: str = "") -> Any:
    """A figure at least as wide as ``title``'s longest line needs at font size 10."""
    require_matplotlib()
    from matplotlib.figure import Figure

    longest = max((len(line) for line in title.splitlines()), default=0)
    return Figure(figsize=(max(width, 0.5 + 0.085 * longest), height), layout="constrained")


def save_figure(fig: Any, path: str | os.PathLike) -> Path:
    """Write ``fig`` as a PNG at ``path`` atomically (temporary file + ``os.replace``)."""
    path = Path(path)
    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=DPI))
    return path


def _array(values: Any) -> np.ndarray:
    """Floats with ``None`` as NaN (missing measurements stay visible as gaps)."""
    return np.array(values, dtype=float)


# ----------------------------------------------------------------------------- heatmap


def heatmap(
    values: Sequence[Sequence[float | None]],
    *,
    rows: Sequence[Any],
    cols: Sequence[Any],
    path: str | os.PathLike,
    title: str,
    xlabel: str,
    ylabel: str,
    colorbar_label: str,
    fmt: str = "{:.2f}",
    center: float | None = None,
    highlight: tuple[int, int] | None = None,
) -> Path:
    """An annotated heatmap, ``values[r][c]`` at row ``rows[r]`` (bottom first), column
    ``cols[c]``.

    Args:
      center: a diverging red-to-green scale centred here (1.0 for speed-ups: red is slower
        than greedy); otherwise a sequential scale.
      highlight: ``(row, col)`` of a cell to outline (the sweet spot).
      fmt: the cell annotation; missing cells read "-".
    """
    from matplotlib import colormaps
    from matplotlib.colors import TwoSlopeNorm
    from matplotlib.patches import Rectangle

    data = _array(values)
    fig = _figure(max(6.4, 1.6 + 1.0 * len(cols)), 1.8 + 0.55 * len(rows), title)
    ax = fig.add_subplot()
    finite = data[np.isfinite(data)]
    if center is not None:
        # Red below the centre, green above; the scale spans only the measured values.
        low = min(float(finite.min()) if finite.size else center, center - 0.05)
        high = max(float(finite.max()) if finite.size else center, center + 0.05)
        norm, cmap = TwoSlopeNorm(center, low, high), "RdYlGn"
    else:
        norm, cmap = None, "viridis"
    image = ax.imshow(
        data,
        origin="lower",
        aspect="auto",
        norm=norm,
        cmap=colormaps[cmap].with_extremes(bad="0.85"),
    )  # grey: not measured
    for (r, c), v in np.ndenumerate(data):
        text = "-" if not np.isfinite(v) else fmt.format(v)
        red, green, blue, _ = image.cmap(image.norm(v)) if np.isfinite(v) else (1, 1, 1, 1)
        dark = 0.299 * red + 0.587 * green + 0.114 * blue < 0.5
        ax.text(
            c, r, text, ha="center", va="center", fontsize=9, color="white" if dark else "black"
        )
    if highlight is not None:
        r, c = highlight
        ax.add_patch(Rectangle((c - 0.5, r - 0.5), 1, 1, fill=False, lw=2.5, ec="black"))
    ax.set_xticks(range(len(cols)), [str(c) for c in cols])
    ax.set_yticks(range(len(rows)), [str(r) for r in rows])
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    fig.colorbar(image, ax=ax, label=colorbar_label)
    return save_figure(fig, path)


# ----------------------------------------------------------------------------- bars


def setting_bars(
    labels: Sequence[str],
    panels: Sequence[tuple[str, Sequence[float | None], float | None]],
    *,
    path: str | os.PathLike,
    title: str,
    xlabel: str,
    fmt: str = "{:.2f}",
) -> Path:
    """One panel per metric, one bar per setting (e.g. the draft window).

    Args:
      labels: the settings, in order (x axis).
      panels: ``(y label, values, reference)`` per panel; ``reference`` draws a dashed
        horizontal line (greedy's 1.0) when not ``None``.
    """
    fig = _figure(1.8 + 3.6 * len(panels), 3.6, title)
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    x = np.arange(len(labels))
    for ax, (ylabel, values, reference), colour in zip(axes, panels, PALETTE):
        data = _array(values)
        bars = ax.bar(x, np.nan_to_num(data), color=colour, width=0.6)
        ax.bar_label(
            bars,
            ["-" if not np.isfinite(v) else fmt.format(v) for v in data],
            padding=2,
            fontsize=9,
        )
        if reference is not None:
            ax.axhline(reference, color="0.3", ls="--", lw=1, label=f"greedy ({reference:g})")
            ax.legend(loc="lower right", fontsize=8)
        ax.set_xticks(x, list(labels))
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.margins(y=0.15)
    fig.suptitle(title, fontsize=10)
    return save_figure(fig, path)


def grouped_bars(
    groups: Sequence[str],
    series: Mapping[str, Sequence[float | None]],
    *,
    path: str | os.PathLike,
    title: str,
    xlabel: str,
    ylabel: str,
    reference: float | None = 1.0,
    group_notes: Sequence[str] | None = None,
) -> Path:
    """Bars of every series side by side within each group.

    Args:
      groups: the x-axis groups (e.g. prompt categories).
      series: name -> one value per group (``None``: no bar), drawn in this order.
      reference: a dashed horizontal line (greedy's 1.0) unless ``None``.
      group_notes: a short note printed above each group (e.g. the controller's gap).
    """
    fig = _figure(min(14.0, 2.2 + (0.35 * len(series) + 0.5) * len(groups)), 4.6, title)
    ax = fig.add_subplot()
    width = 0.8 / max(len(series), 1)
    x = np.arange(len(groups))
    for i, ((name, values), colour) in enumerate(zip(series.items(), _cycle(len(series)))):
        ax.bar(
            x + (i - (len(series) - 1) / 2) * width,
            np.nan_to_num(_array(values)),
            width=width,
            color=colour,
            label=name,
        )
    if reference is not None:
        ax.axhline(reference, color="0.3", ls="--", lw=1, label=f"greedy ({reference:g}×)")
    if group_notes is not None:
        top = np.nanmax(np.array([_array(v) for v in series.values()]), axis=0)
        for gx, note, height in zip(x, group_notes, top):
            ax.text(
                gx,
                (height if np.isfinite(height) else 0) * 1.02,
                note,
                ha="center",
                va="bottom",
                fontsize=8,
            )
    ax.set_xticks(x, list(groups))
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.margins(y=0.18)
    ax.legend(fontsize=8, ncols=min(len(series), 4), loc="upper left")
    ax.set_title(title, fontsize=10)
    return save_figure(fig, path)


def plural(count: int, word: str) -> str:
    """``"1 turn"``, ``"3 turns"``."""
    return f"{count} {word}{'' if count == 1 else 's'}"


def _cycle(n: int) -> list[str]:
    return [PALETTE[i % len(PALETTE)] for i in range(n)]


# ----------------------------------------------------------------------------- bench reports


def _per_category(report: Mapping[str, Any], method: str, key: str) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for turn in report["turns"]:
        value = turn["methods"][method][key]
        out.setdefault(turn["category"], [])
        if value is not None:
            out[turn["category"]].append(float(value))
    return out


def speedup_distribution(
    report: Mapping[str, Any], path: str | os.PathLike, *, title: str | None = None
) -> Path:
    """Per-turn speed-up over greedy (top) and accepted length (bottom) of every
    non-reference method: one box per method and category, each turn a dot on it.

    Args:
      report: a benchmark report (``bench.run_bench``'s output or its JSON).
      title: the figure title (default: the turn count and new-token limit).

    Raises:
      ValueError: the report has no turns or no method besides greedy.
    """
    from matplotlib.patches import Patch

    methods = [m for m in report["methods"] if m != REFERENCE]
    if not report.get("turns") or not methods:
        raise ValueError("the report has no turns or no method besides greedy to plot")
    categories = list(dict.fromkeys(t["category"] for t in report["turns"]))
    colours = _cycle(len(methods))
    fig = _figure(min(16.0, max(7.5, 3.6 + (0.55 * len(methods) + 0.5) * len(categories))), 7.0)
    axes = fig.subplots(2, 1, sharex=True)
    width = 0.8 / len(methods)
    rng = np.random.default_rng(0)  # fixed jitter: the same report draws the same figure
    panels = (
        ("speedup", "speed-up over greedy (×)", 1.0),
        ("accepted_length", "accepted length (tokens / verify round)", 1.0),
    )
    for ax, (key, ylabel, reference) in zip(axes, panels):
        for i, (method, colour) in enumerate(zip(methods, colours)):
            values = _per_category(report, method, key)
            positions = np.arange(len(categories)) + (i - (len(methods) - 1) / 2) * width
            data = [values.get(c, []) for c in categories]
            drawn = [(p, d) for p, d in zip(positions, data) if d]
            if drawn:
                ax.boxplot(
                    [d for _, d in drawn],
                    positions=[p for p, _ in drawn],
                    widths=width * 0.8,
                    showfliers=False,
                    patch_artist=True,
                    boxprops=dict(facecolor=colour, alpha=0.35, edgecolor=colour),
                    medianprops=dict(color=colour, lw=2),
                    whiskerprops=dict(color=colour),
                    capprops=dict(color=colour),
                )
            for p, d in drawn:
                jitter = rng.uniform(-0.25, 0.25, len(d)) * width
                ax.scatter(p + jitter, d, s=10, color=colour, alpha=0.8, zorder=3)
        ax.axhline(reference, color="0.3", ls="--", lw=1)
        ax.set_ylabel(ylabel)
    counts = [sum(t["category"] == c for t in report["turns"]) for c in categories]
    axes[1].set_xticks(
        range(len(categories)), [f"{c}\n({plural(n, 'turn')})" for c, n in zip(categories, counts)]
    )
    axes[1].set_xlabel("prompt category")
    # Beside the panels, so that no turn's dot hides under it.
    fig.legend(
        handles=[Patch(color=c, alpha=0.6, label=m) for m, c in zip(methods, colours)],
        fontsize=8,
        loc="outside right upper",
        title="method",
        title_fontsize=8,
    )
    fig.suptitle(title or _bench_title(report), fontsize=10)
    return save_figure(fig, path)


def _bench_title(report: Mapping[str, Any]) -> str:
    specs = [m.get("spec", {}) for m in report["methods"].values()]
    tokens = max((s.get("max_new_tokens", 0) for s in specs), default=0)
    return (
        f"Per-turn speed-up over greedy and accepted length, by prompt category\n"
        f"{len(report['turns'])} turns, up to {tokens} new tokens each; one dot per turn; "
        f"dashed line = greedy"
    )


def write_bench_plots(
    report: Mapping[str, Any] | str | os.PathLike, plot_dir: str | os.PathLike
) -> list[Path]:
    """The figures of a benchmark report (a dict or the path of its JSON) in ``plot_dir``
    (created if missing): :data:`BENCH_PLOT`. Returns the written paths."""
    if not isinstance(report, Mapping):
        report = json.loads(Path(report).read_text(encoding="utf-8"))
    folder = Path(plot_dir)
    folder.mkdir(parents=True, exist_ok=True)
    return [speedup_distribution(report, folder / BENCH_PLOT)]
