"""Reporting a calibration: the fit's error per measured point, a table, a figure."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np

from eaglepangu_jax.calibration.fit import predict, roofline_prediction
from eaglepangu_jax.calibration.store import MachineCalibration
from eaglepangu_jax.models.config import LlamaConfig

__all__ = ["error_table", "format_report", "plot_calibration"]

log = logging.getLogger(__name__)

# ----------------------------------------------------------------------------- reporting


def error_table(calibration: MachineCalibration, config: LlamaConfig) -> list[dict[str, float]]:
    """Per sample: slots, context, window, measured ms, the fitted roofline's ms and its
    relative error % (the model's error; :func:`predict` reproduces measured points)."""
    samples = calibration.samples
    if not samples:
        return []
    predicted = roofline_prediction(
        calibration,
        config,
        [x.slots for x in samples],
        [x.context for x in samples],
        window=[x.window for x in samples],
    )
    return [
        {
            "slots": x.slots,
            "context": x.context,
            "window": x.window,
            "measured_ms": 1e3 * x.seconds,
            "predicted_ms": 1e3 * float(p),
            "error_pct": 100.0 * (float(p) - x.seconds) / x.seconds if x.seconds else 0.0,
        }
        for x, p in zip(samples, predicted)
    ]


def format_report(calibration: MachineCalibration, config: LlamaConfig) -> str:
    """The measured-vs-predicted table, the coefficients and the overheads, as text."""
    rows = error_table(calibration, config)
    header = (
        f"{'s':>4} {'c':>6} {'window':>6} {'measured ms':>11} {'roofline ms':>12} {'error %':>8}"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(
            f"{r['slots']:>4} {r['context']:>6} {r['window']:>6} "
            f"{r['measured_ms']:>11.2f} {r['predicted_ms']:>12.2f} "
            f"{r['error_pct']:>+8.1f}"
        )
    c = calibration
    worst = max((abs(r["error_pct"]) for r in rows), default=0.0)
    lines += [
        "",
        f"fit (peak {c.peak_flops / 1e9:.0f} GFLOP/s, {c.bandwidth / 1e9:.0f} GB/s): "
        f"a_c={c.a_c:.4g} b_c={1e3 * c.b_c:.3f} ms  a_m={c.a_m:.4g} b_m={1e3 * c.b_m:.3f} ms",
        f"roofline max |error| {worst:.1f}% (the controller's curve interpolates the measured "
        f"grid and uses the roofline only beyond it)",
        f"t_other {1e3 * c.t_other:.3f} ms/round"
        + "".join(f", t_draft[{k}] {1e3 * v:.3f} ms" for k, v in c.t_draft.items()),
    ]
    return "\n".join(lines)


def plot_calibration(
    calibration: MachineCalibration, config: LlamaConfig, path: str | os.PathLike
) -> Path:
    """Measured (markers) and predicted (lines) verify latency against ``s``, one colour per
    context, log-2 x axis; written as a PNG atomically.

    Raises:
      PlotsUnavailableError: matplotlib is missing (the message names the ``plots`` extra).
      ValueError: the calibration has no samples.
    """
    from eaglepangu_jax.evaluation import plots

    if not calibration.samples:
        raise ValueError("the calibration has no samples to plot")
    plots.require_matplotlib()
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.0, 4.6), layout="constrained")
    ax = fig.add_subplot()
    contexts = sorted({x.context for x in calibration.samples})
    top = max(x.slots for x in calibration.samples)
    grid = np.unique(np.round(np.geomspace(1, top, 80)).astype(np.int64))
    for i, c in enumerate(contexts):
        colour = plots.PALETTE[i % len(plots.PALETTE)]
        points = sorted((x for x in calibration.samples if x.context == c), key=lambda x: x.slots)
        ax.plot(
            grid,
            1e3 * roofline_prediction(calibration, config, grid, c),
            color=colour,
            lw=1.6,
            label=f"c = {c}: roofline fit",
        )
        ax.plot(
            grid,
            1e3 * predict(calibration, config, grid, c),
            color=colour,
            lw=0.9,
            ls="--",
            label=f"c = {c}: controller's curve",
        )
        ax.plot(
            [x.slots for x in points],
            [1e3 * x.seconds for x in points],
            "o",
            color=colour,
            ms=6,
            mfc="none",
            mew=1.6,
            label=f"c = {c}: measured",
        )
    worst = max(abs(r["error_pct"]) for r in error_table(calibration, config))
    ax.set_xscale("log", base=2)
    ticks = sorted({x.slots for x in calibration.samples})
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.minorticks_off()
    ax.set_xlabel("new tokens per verify forward s (root + draft nodes)")
    ax.set_ylabel("verify forward latency (ms)")
    ax.set_title(
        f"Verify latency, measured vs calibrated roofline "
        f"({config.num_layers} layers, hidden {config.hidden_size}, "
        f"{calibration.dtype})\n{calibration.machine.get('processor', '')}, "
        f"{calibration.machine.get('backend', '')}; c = cached tokens; "
        f"roofline max error {worst:.0f}%",
        fontsize=9,
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncols=2)
    return plots.save_figure(fig, path)
