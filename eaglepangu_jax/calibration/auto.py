"""Calibration without a manual step: the first ``"auto"`` run on a machine measures it.

:func:`ensure_calibration` returns this machine's calibration for the teacher and the
drafters about to run. It reads the saved one (:func:`~.store.default_path`) when that file is
readable, fingerprinted for this teacher, measured on this machine and in the teacher's
weight layout (:mod:`.layout`); otherwise (missing, corrupt, another teacher, another
machine, the other layout) it measures a quick one, with a progress bar,
and saves it atomically in its place. A drafter the saved calibration lacks is timed and
added. ``eaglepangu calibrate`` still measures the full grid.

:func:`calibrated_methods` does that for a list of methods and also sizes the drafters whose
budget the machine may raise (:mod:`.sizing`): it measures the grid up to the default
budget's buckets, raises their budgets, and then times their drafting at the new sizes. The
command-line runs call it.

The quick grid is what the controller reads: the verify forward at the engine's own slot
buckets for the run's tree budget, at one attention window, plus the per-round overhead and
each drafter's cost.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import time
from pathlib import Path
from typing import Mapping, Sequence

import jax

from eaglepangu_jax.calibration.curve import draft_cost_key, usable_calibration
from eaglepangu_jax.calibration.measure import (
    calibrate_teacher,
    measure_draft,
    progress_total,
)
from eaglepangu_jax.calibration.sizing import sized_methods
from eaglepangu_jax.calibration.store import (
    MachineCalibration,
    default_path,
    dtype_name,
    save_calibration,
)
from eaglepangu_jax.engine import step
from eaglepangu_jax.engine.decode import Teacher
from eaglepangu_jax.methods.registry import DEFAULT_BUDGET, Method
from eaglepangu_jax.models import llama

__all__ = [
    "QUICK_CONTEXTS",
    "QUICK_REPEATS",
    "calibrated_methods",
    "controlled_methods",
    "ensure_calibration",
    "quick_slots",
]

log = logging.getLogger(__name__)

QUICK_CONTEXTS = (128,)  # one attention window (256): the one short prompts decode in
# Timings per point (interleaved passes, median kept); a pass costs well under a second once
# compiled. With 3, two quick calibrations of one machine hours apart gave a plain step of 42
# and 34 ms and a 4-slot / 1-slot ratio of 1.14 and 1.55 (one point's three timings: 41 to
# 56 ms), and that ratio sizes every tree.
QUICK_REPEATS = 9


def quick_slots(budget: int) -> tuple[int, ...]:
    """The verify sizes the engine compiles for a tree of ``budget`` nodes (its buckets)."""
    return step.slot_buckets(budget + 1)


def ensure_calibration(
    teacher: Teacher,
    methods: Mapping[str, Method],
    *,
    path: str | os.PathLike | None = None,
    progress: bool = True,
    grid_budget: int | None = None,
) -> MachineCalibration | None:
    """This machine's calibration, measured now if there is no usable saved one and some
    method runs under the ``"auto"`` controller (or ``grid_budget`` is given).

    Args:
      teacher: the model the runs use (its fingerprint must match the saved file's).
      methods: drafter name -> a method using it (see :func:`controlled_methods`); their
        drafting costs must be in the calibration (measured now if missing). None: no run
        reads a calibration, so nothing is measured.
      path: the calibration file (default: :func:`~.store.default_path`).
      progress: show a progress bar on stderr while measuring.
      grid_budget: measure (when measuring) the verify buckets of at least this tree budget,
        and measure even with no ``methods`` (:func:`calibrated_methods` sizes drafters from
        the buckets above their defaults).

    Returns:
      The calibration, saved at ``path``; with no ``methods``, the usable saved one or None.
    """
    target = Path(path) if path is not None else default_path()
    calibration = usable_calibration(teacher.config, path=target, dtype=dtype_name(teacher))
    copies = llama.has_transposed_copy(teacher.params)
    # Files from before the layout was chosen per machine were all measured with the copies.
    if calibration is not None and calibration.details.get("transposed_copy", True) != copies:
        _say(
            f"the saved calibration was measured {'without' if copies else 'with'} the "
            "teacher's [out, in] weight copies (see calibration.layout): measuring again"
        )
        calibration = None
    if not methods and grid_budget is None:
        # Only the controller weighs costs (see curve.method_costs): greedy, a fixed policy
        # such as --policy drafter, or a peer's runner would wait minutes for nothing (on a
        # fresh GPU machine the whole benchmark's time went to it).
        return calibration
    budget = max([*(m.spec.budget for m in methods.values()), grid_budget or 0])
    if calibration is None:
        _say(f"calibrating this machine for the 'auto' controller (once; saved to {target})")
        start = time.perf_counter()
        with _bar(len(quick_slots(budget)) * len(QUICK_CONTEXTS), len(methods), progress) as bar:
            calibration = calibrate_teacher(
                teacher,
                slots=quick_slots(budget),
                contexts=QUICK_CONTEXTS,
                repeats=QUICK_REPEATS,
                drafters=methods,
                bar=bar,
                overhead=False,
            )
        calibration = dataclasses.replace(
            calibration, details={**calibration.details, "quick": True}
        )
        save_calibration(calibration, target)
        # The measuring programs are not used again; dropping them frees about 4 k of the
        # process's memory mappings (see evaluation.run.MAPPING_SHARE).
        jax.clear_caches()
        _say(f"calibrated in {time.perf_counter() - start:.0f} s")
        return calibration
    missing = {name: m for name, m in methods.items() if name not in calibration.t_draft}
    if missing:
        _say(f"timing drafter(s) {', '.join(missing)} for the 'auto' controller")
        context = min(s.context for s in calibration.samples) if calibration.samples else 128
        t_draft = dict(calibration.t_draft)
        for name, method in missing.items():
            t_draft[name] = measure_draft(teacher, method, context=context, repeats=QUICK_REPEATS)
        calibration = dataclasses.replace(calibration, t_draft=t_draft)
        save_calibration(calibration, target)
    return calibration


def calibrated_methods(
    teacher: Teacher,
    methods: Sequence[Method],
    *,
    path: str | os.PathLike | None = None,
    progress: bool = True,
) -> tuple[list[Method], MachineCalibration | None]:
    """``methods`` as they run on this machine, and its calibration (see
    :func:`ensure_calibration`; measured now where needed).

    A method the machine may size (``Method.machine_sized``) gets the budget
    :func:`~.sizing.machine_budget` reads from the calibration; a new calibration then
    measures the verify buckets up to :data:`DEFAULT_BUDGET` nodes, so that there is
    something to read. Every controlled method's drafting cost is timed at the size it runs
    at. Each sizing is reported on stderr.
    """
    methods = list(methods)
    controlled = controlled_methods(methods)
    if not any(m.machine_sized for m in controlled.values()):
        return methods, ensure_calibration(teacher, controlled, path=path, progress=progress)
    fixed = {k: m for k, m in controlled.items() if not m.machine_sized}
    calibration = ensure_calibration(
        teacher, fixed, path=path, progress=progress, grid_budget=DEFAULT_BUDGET
    )
    methods, sizings = sized_methods(calibration, teacher.config, methods)
    largest = quick_slots(DEFAULT_BUDGET)[-1]
    for name, sizing in sizings.items():
        _say(f"{name}: {sizing.describe()}")
        if max(sizing.verify_seconds, default=0) < largest:
            # A calibration saved by runs with smaller trees: sizing saw fewer buckets.
            _say(
                f"  (the saved calibration timed no verify of {largest} slots; "
                "`eaglepangu calibrate` measures the full grid)"
            )
    calibration = ensure_calibration(
        teacher, controlled_methods(methods), path=path, progress=progress
    )
    return methods, calibration


def controlled_methods(methods) -> dict[str, Method]:
    """Drafting-cost key (:func:`~.curve.draft_cost_key`) -> method, for the methods the
    ``"auto"`` controller will run."""
    return {
        draft_cost_key(m): m
        for m in methods
        if m.runner is None and m.drafter is not None and m.spec.policy == "auto"
    }


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class _bar:
    """A tqdm bar sized like :func:`calibrate_teacher`'s work (no bar when disabled)."""

    def __init__(self, points: int, drafters: int, enabled: bool):
        self.total = progress_total(points, QUICK_REPEATS, drafters, overhead=False)
        self.enabled = enabled
        self.bar = None

    def __enter__(self):
        if self.enabled:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=self.total, desc="calibrate", unit="run", file=sys.stderr)
        return self.bar

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.close()
        return False
