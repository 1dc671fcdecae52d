"""How many nodes a round a drafter drafts on this machine, from its verify timings.

A drafter's default budget (``methods.DRAFTER_BUDGETS``) was chosen where it paid most on
the machine measured, and machines differ where it matters: on 2 cores of an Intel Xeon a
verify of four slots costs about 1.4x one of two, so the shipped heads draft one node a round;
on 2 cores of an AMD EPYC two and four slots both cost about 37 ms with XLA's products (one:
28 ms), and about 28 and 31 ms with the few-row product kernel (``models.few_row``); there
the heads at three nodes paid more than at one either way (docs/RESULTS.md).
:func:`machine_budget` reads the calibration's measured verify times and raises a drafter's
budget to the largest slot bucket whose verify costs no more than ``1 + tolerance`` times the
default's; :func:`sized_methods` applies it to the methods that allow it
(``Method.machine_sized``: drafters in ``methods.MACHINE_SIZED`` at their default budget and
depth). The ``"auto"`` controller still decides every round how many of the drafted nodes to
verify; this only sets how many it may choose from.

Only measured slot counts are candidates (the calibration times the engine's buckets): an
interpolated point between a flat and a steep measurement would say more about the line
drawn than about the machine.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Iterable

import numpy as np

from eaglepangu_jax.calibration.fit import predict
from eaglepangu_jax.calibration.store import MachineCalibration
from eaglepangu_jax.methods import registry as methods_lib
from eaglepangu_jax.models.config import LlamaConfig

__all__ = ["FLAT_TOLERANCE", "Sizing", "machine_budget", "sized_methods"]

log = logging.getLogger(__name__)

# A bucket is "about as cheap" when it costs at most this much more than the default's.
# Five quiet timings of the AMD machine's 4-slot / 2-slot ratio spread 0.97-1.04 with XLA's
# products, 1.10-1.14 with the few-row kernel (models/few_row.py), and at 1.10-1.14 three
# nodes still paid more than one (dev suite: EAGLE-3 1.34x against 1.28x, side by side);
# the Intel machine's ratio is about 1.4, where one node paid more.
FLAT_TOLERANCE = 0.20


@dataclasses.dataclass(frozen=True, kw_only=True)
class Sizing:
    """A machine's budget for one drafter and why.

    Attributes:
      budget: the nodes a round it drafts (``>= floor``).
      floor: its default budget.
      context: the cached tokens the verify timings were measured at (``None``: no timings).
      verify_seconds: measured slot count -> verify seconds at ``context``, the candidates
        read (monotone in slots, see :func:`~eaglepangu_jax.calibration.fit.predict`).
    """

    budget: int
    floor: int
    context: int | None = None
    verify_seconds: dict[int, float] = dataclasses.field(default_factory=dict)

    def describe(self) -> str:
        """One line for a user: the budget and the timings that chose it."""
        if self.context is None:
            return f"{self.budget} node(s) a round (no verify timings to size it)"
        times = ", ".join(f"{s} slots {t * 1e3:.1f} ms" for s, t in self.verify_seconds.items())
        return f"{self.budget} node(s) a round (verify at {self.context} cached tokens: {times})"


def machine_budget(
    calibration: MachineCalibration,
    config: LlamaConfig,
    floor: int,
    *,
    ceiling: int = methods_lib.DEFAULT_BUDGET,
    tolerance: float = FLAT_TOLERANCE,
) -> Sizing:
    """The largest budget ``n`` in ``[floor, ceiling]`` whose ``n + 1`` verified slots were
    measured and cost at most ``(1 + tolerance)`` times the ``floor + 1`` slots of the
    default, at the calibration's shortest measured context; ``floor`` when nothing larger
    qualifies or the calibration has no timings.

    Raises:
      ValueError: ``floor < 1``, ``ceiling < floor`` or ``tolerance < 0``.
    """
    if floor < 1 or ceiling < floor or not tolerance >= 0:
        raise ValueError(
            f"need 1 <= floor <= ceiling and tolerance >= 0; got floor {floor}, "
            f"ceiling {ceiling}, tolerance {tolerance}"
        )
    if not calibration.samples:
        return Sizing(budget=floor, floor=floor)
    context = min(int(s.context) for s in calibration.samples)
    slots = sorted({int(s.slots) for s in calibration.samples if s.context == context})
    seconds = predict(calibration, config, np.asarray([floor + 1, *slots]), context)
    reference, measured = float(seconds[0]), dict(zip(slots, map(float, seconds[1:])))
    budget = max(
        (
            s - 1
            for s, t in measured.items()
            if floor < s - 1 <= ceiling and t <= (1 + tolerance) * reference
        ),
        default=floor,
    )
    return Sizing(budget=budget, floor=floor, context=context, verify_seconds=measured)


def sized_methods(
    calibration: MachineCalibration | None,
    config: LlamaConfig,
    methods: Iterable[methods_lib.Method],
) -> tuple[list[methods_lib.Method], dict[str, Sizing]]:
    """``methods`` with every ``machine_sized`` one at :func:`machine_budget` (the others as
    they are), and the sizing of each by name. Without a calibration nothing changes."""
    out, sizings = [], {}
    for method in methods:
        if method.machine_sized and calibration is not None:
            sizing = machine_budget(calibration, config, method.spec.budget)
            method = methods_lib.with_machine_budget(method, sizing.budget)
            sizings[method.name] = sizing
        out.append(method)
    return out, sizings
