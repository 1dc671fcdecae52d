"""Fitting the roofline to measured verify times, and predicting from the fit.

The engine attends over a power-of-two *window* of the cache (masked), not over the ``c``
cached tokens alone, so the fit uses the window's context ``W - s`` as the roofline's ``c``
(``c + s = W``: the keys actually read); :func:`predict` maps a real ``c`` to it.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import jax.numpy as jnp
import numpy as np

from eaglepangu_jax import budget as budget_lib
from eaglepangu_jax.calibration.store import MachineCalibration, Sample
from eaglepangu_jax.engine import decode as gen
from eaglepangu_jax.models.config import LlamaConfig

__all__ = ["engine_window", "attended_context", "fit_samples", "roofline_prediction", "predict"]

log = logging.getLogger(__name__)

# ----------------------------------------------------------------------------- fitting


def engine_window(context: int, slots: int, config: LlamaConfig) -> int:
    """The attention window of a round verifying ``slots`` tokens after ``context``."""
    return gen.window_for(context + slots, config.max_position)


def attended_context(slots: Any, window: Any) -> Any:
    """The roofline's ``c`` for a forward of ``slots`` tokens over a ``window``: ``W - s``,
    so that ``c + s`` is the number of keys the engine's masked attention reads."""
    return np.maximum(np.asarray(window) - np.asarray(slots), 0)


def fit_samples(samples: Sequence[Sample], roofline: budget_lib.Roofline) -> budget_lib.Calibration:
    """Fit the roofline's ``a_c, b_c, a_m, b_m`` to measured samples (window context)."""
    rows = [(x.slots, float(attended_context(x.slots, x.window)), x.seconds) for x in samples]
    return budget_lib.calibrate(roofline, rows)


def _points(
    config: LlamaConfig, slots: Any, context: Any, window: Any
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``slots``, ``context`` and ``window`` broadcast together as int64 arrays; a missing
    window is the engine's for ``context + slots``."""
    s, c = np.broadcast_arrays(np.asarray(slots, np.int64), np.asarray(context, np.int64))
    if window is None:
        window = np.vectorize(lambda ci, si: engine_window(int(ci), int(si), config))(c, s)
    return s, c, np.broadcast_to(np.asarray(window, np.int64), s.shape)


def roofline_prediction(
    calibration: MachineCalibration,
    config: LlamaConfig,
    slots: Any,
    context: Any,
    window: Any = None,
) -> np.ndarray:
    """The fitted roofline's seconds for the verify forward (no overheads, no correction).

    Args:
      slots: tokens per forward (array-like).
      context: committed tokens (array-like, broadcast with ``slots``).
      window: the attention window; default: the engine's for ``context + slots``.
    """
    s, _, window = _points(config, slots, context, window)
    c_eff = attended_context(s, window)
    out = budget_lib.latency(
        calibration.roofline(config),
        calibration.coefficients,
        jnp.asarray(s, jnp.float32),
        jnp.asarray(c_eff, jnp.float32),
    )
    return np.asarray(out, np.float64)


def _measured_table(calibration: MachineCalibration) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """``window -> (slot counts, seconds)`` of the calibration's samples, sorted by slots, the
    seconds made non-decreasing in slots.

    A forward over more slots does all the work of one over fewer, so a smaller forward timed
    slower than a larger one was slowed by something else (a shared machine only ever adds
    time). Each point therefore takes the minimum of its own and every larger forward's time:
    measured on a busy machine, a one-slot median of 98 ms beside 69 ms for four slots would
    otherwise make a plain step look dearer than speculation.
    """
    table: dict[int, dict[int, float]] = {}
    for x in calibration.samples:
        if x.seconds > 0:
            table.setdefault(int(x.window), {})[int(x.slots)] = float(x.seconds)
    out = {}
    for w, row in sorted(table.items()):
        slots = sorted(row)
        seconds = np.asarray([row[k] for k in slots], np.float64)
        monotone = np.minimum.accumulate(seconds[::-1])[::-1]
        out[w] = (np.asarray(slots, np.float64), monotone)
    return out


def _at_window(
    calibration: MachineCalibration,
    config: LlamaConfig,
    s: float,
    w: int,
    row: tuple[np.ndarray, np.ndarray],
) -> float:
    """Seconds at ``s`` slots in a measured window: linear between measured slot counts, the
    roofline's relative change beyond them."""
    known, seconds = row
    if known[0] <= s <= known[-1]:
        return float(np.interp(s, known, seconds))
    ref = known[0] if s < known[0] else known[-1]
    at_ref = seconds[0] if s < known[0] else seconds[-1]
    scale = roofline_prediction(calibration, config, s, 0, window=w) / roofline_prediction(
        calibration, config, ref, 0, window=w
    )
    return float(at_ref * scale)


def predict(
    calibration: MachineCalibration,
    config: LlamaConfig,
    slots: Any,
    context: Any,
    window: Any = None,
) -> np.ndarray:
    """Predicted seconds of the verify forward alone (no overheads), as float64 numpy.

    The two-line roofline alone cannot follow a small model on a CPU (measured: one token
    ~50 ms, four ~1.5x that, where the fitted lines are flat), so the prediction is the
    *measured* grid, interpolated linearly in slots and in ``log(window)`` between measured
    points; the fitted roofline only extrapolates beyond the grid (its relative change from
    the nearest measured point). Without samples it is the fitted roofline itself.

    Args:
      slots: tokens per forward (array-like).
      context: committed tokens (array-like, broadcast with ``slots``).
      window: the attention window; default: the engine's for ``context + slots``.
    """
    s, c, w = _points(config, slots, context, window)
    table = _measured_table(calibration)
    if not table:
        return roofline_prediction(calibration, config, s, c, w)
    windows = np.asarray(list(table), np.float64)
    out = np.empty(s.shape, np.float64)
    for index in np.ndindex(s.shape):
        si, wi = float(s[index]), int(w[index])
        lo = windows[windows <= wi].max() if np.any(windows <= wi) else windows[0]
        hi = windows[windows >= wi].min() if np.any(windows >= wi) else windows[-1]
        at = {int(x): _at_window(calibration, config, si, int(x), table[int(x)]) for x in {lo, hi}}
        if lo == hi:
            value = at[int(lo)]
            if wi != int(lo):  # outside the measured windows: the roofline's relative change
                value *= float(
                    roofline_prediction(calibration, config, si, 0, window=wi)
                    / roofline_prediction(calibration, config, si, 0, window=int(lo))
                )
        else:
            frac = (np.log(wi) - np.log(lo)) / (np.log(hi) - np.log(lo))
            value = (1 - frac) * at[int(lo)] + frac * at[int(hi)]
        out[index] = value
    return out
