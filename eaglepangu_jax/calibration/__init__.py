"""``eaglepangu calibrate``'s library: measure this machine's verification cost, fit the
roofline, store it, and turn it into the ``"auto"`` policy's latency curve.

BASTION's controller (the ``"auto"`` policy) grows a tree while tokens per second rise, so it
needs the cost of a round, ``C(n) = t_draft + t_other + T_verify(n)``, on the machine it runs
on:

* :mod:`.measure`: times the engine's own verify forward, per-round overhead and drafting;
* :mod:`.fit`: fits the roofline to the measured grid and predicts from it;
* :mod:`.store`: the versioned, fingerprinted JSON record, written atomically;
* :mod:`.curve`: the ``[budget + 1]`` verify-latency curve the engine's controller reads;
* :mod:`.sizing`: the heads' default tree budgets on this machine, from its verify timings;
* :mod:`.layout`: whether the teacher keeps its ``[out, in]`` weight copies on this machine;
* :mod:`.auto`: calibration without a manual step, and the methods sized by it;
Tables and figures of a calibration are in :mod:`eaglepangu_jax.evaluation.calibration_report`.
"""

from eaglepangu_jax.calibration.curve import curve_for, uncalibrated, verify_latency_curve
from eaglepangu_jax.calibration.measure import calibrate_teacher, measure_grid, measure_grids
from eaglepangu_jax.calibration.store import (
    CalibrationFileError,
    MachineCalibration,
    load_calibration,
    save_calibration,
)

__all__ = [
    "CalibrationFileError",
    "MachineCalibration",
    "calibrate_teacher",
    "curve_for",
    "load_calibration",
    "measure_grid",
    "measure_grids",
    "save_calibration",
    "uncalibrated",
    "verify_latency_curve",
]
