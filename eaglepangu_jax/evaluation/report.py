"""Benchmark reports: per-method summaries (mean / p99 speed-up, accepted length, identical
share), fixed-width tables, and the JSON file."""

from __future__ import annotations

import json
import os
from typing import Any, Sequence

import numpy as np

from eaglepangu_jax.files import write_text_atomic

__all__ = ["summarize_turns", "format_summary", "format_turns", "write_report"]


def summarize_turns(
    turns: Sequence[dict[str, Any]], names: Sequence[str]
) -> dict[str, dict[str, Any]]:
    """Per method, over the turns: ``mean_tokens_per_s``; ``mean_speedup``, ``p50_speedup``,
    ``p99_speedup`` of per-turn tokens/s over greedy's (percentiles interpolate linearly);
    ``mean_accepted_length`` (mean of per-turn values) and ``overall_accepted_length`` (all
    tokens / all rounds); ``speculated_fraction`` (rounds that verified a tree / all rounds);
    ``identical_fraction``; ``turns``."""
    summary = {}
    for name in names:
        rows = [t["methods"][name] for t in turns]
        speedups = [r["speedup"] for r in rows if r["speedup"] is not None]
        tps = [r["tokens_per_s"] for r in rows if r["tokens_per_s"] is not None]
        rounds = sum(r["rounds"] for r in rows)
        summary[name] = {
            "turns": len(rows),
            "mean_tokens_per_s": _mean(tps),
            "mean_speedup": _mean(speedups),
            "p50_speedup": _percentile(speedups, 50),
            "p99_speedup": _percentile(speedups, 99),
            "mean_accepted_length": _mean([r["accepted_length"] for r in rows]),
            "overall_accepted_length": (
                sum(r["new_tokens"] for r in rows) / rounds if rounds else None
            ),
            "speculated_fraction": (
                sum(r.get("speculated_rounds", 0) for r in rows) / rounds if rounds else None
            ),
            "identical_fraction": _mean([float(r["identical_to_greedy"]) for r in rows]),
            "compile_seconds": float(sum(r["compile_seconds"] for r in rows)),
        }
    return summary


def _mean(values: Sequence[float]) -> float | None:
    return float(np.mean(values)) if len(values) else None


def _percentile(values: Sequence[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if len(values) else None


def format_summary(report: dict[str, Any]) -> str:
    """The summary as a fixed-width table.

    ``spec.``: the share of rounds that verified a tree (the rest were plain one-token steps
    chosen by the controller). ``warm-up s``: wall seconds of the warm-up generation.
    ``compile s``: the compile work measured during the warm-up plus the wall seconds of the
    turn runs discarded because they compiled (reports written before the warm-up's compile
    work was recorded show the discarded runs only).
    """
    warmup_compile = report.get("warmup_compile_seconds", {})
    w = _name_width(report["summary"])
    header = (
        f"{'method':<{w}} {'turns':>5} {'tok/s':>7} {'speed-up':>8} {'p50':>6} {'p99':>6} "
        f"{'acc.len':>7} {'spec.':>5} {'identical':>9} {'warm-up s':>9} {'compile s':>9}"
    )
    lines = [header, "-" * len(header)]
    for name, s in report["summary"].items():
        spec = _fmt(s.get("speculated_fraction"), 0, "%", 100)
        lines.append(
            f"{name:<{w}} {s['turns']:>5} {_fmt(s['mean_tokens_per_s'], 1):>7} "
            f"{_fmt(s['mean_speedup'], 2, 'x'):>8} {_fmt(s['p50_speedup'], 2, 'x'):>6} "
            f"{_fmt(s['p99_speedup'], 2, 'x'):>6} {_fmt(s['mean_accepted_length'], 2):>7} "
            f"{spec:>5} {_fmt(s['identical_fraction'], 0, '%', 100):>9} "
            f"{report['warmup_seconds'][name]:>9.1f} "
            f"{warmup_compile.get(name, 0.0) + s['compile_seconds']:>9.1f}"
        )
    return "\n".join(lines)


def format_turns(report: dict[str, Any]) -> str:
    """One row per turn and method: the side-by-side view."""
    w = _name_width(report["summary"])
    header = (
        f"{'turn':<16} {'method':<{w}} {'tokens':>6} {'tok/s':>7} {'speed-up':>8} "
        f"{'acc.len':>7} {'same as greedy':>14}"
    )
    lines = [header, "-" * len(header)]
    for t in report["turns"]:
        label = f"{t['conversation_id']}#{t['turn_index'] + 1}"
        for name, r in t["methods"].items():
            same = (
                "yes"
                if r["identical_to_greedy"]
                else (
                    f"no @{r['divergence_index']}"
                    + (f" gap {r['near_tie_gap']:.2f}" if r["near_tie_gap"] is not None else "")
                )
            )
            lines.append(
                f"{label:<16} {name:<{w}} {r['new_tokens']:>6} "
                f"{_fmt(r['tokens_per_s'], 1):>7} {_fmt(r['speedup'], 2, 'x'):>8} "
                f"{r['accepted_length']:>7.2f} {same:>14}"
            )
            label = ""
    return "\n".join(lines)


def _name_width(names: Sequence[str]) -> int:
    return max([8, *(len(n) for n in names)])


def _fmt(value: float | None, digits: int, suffix: str = "", scale: float = 1.0) -> str:
    return "-" if value is None else f"{value * scale:.{digits}f}{suffix}"


def write_report(path: str | os.PathLike, report: dict[str, Any]) -> None:
    """The report as indented JSON, written atomically."""
    write_text_atomic(path, json.dumps(report, indent=2, allow_nan=False) + "\n")
