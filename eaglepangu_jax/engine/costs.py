"""Online correction of the controller's latency curve from measured segment times.

The ``"auto"`` controller weighs a speculative round, ``t_draft + T[n]``, against a plain
step, ``T[0]``, on a latency curve measured once per machine (or the nominal roofline). Both
drift: the machine is shared, its memory system differs from the calibrating run, a drafter
costs more inside the loop than alone. The host already waits for the device at the end of
every segment (one attention window of the on-device loop), and the state's logs say how many
rounds ran and how many nodes each verified. From them this module fits, across segments and
generations, two scale factors of the curve:

    measured segment seconds  ~  a * X_plain + b * X_spec
    X_plain = sum over the segment's plain rounds of T[0]
    X_spec  = sum over its speculative rounds of (t_draft + T[n_r])

``a`` scales a plain step, ``b`` a speculative round; the corrected curve is ``a T[0]``,
``b T[n]`` and ``b t_draft``. The fit is least squares with each segment divided by its
predicted time (so a long segment does not outweigh short ones, and a machine far slower
than predicted still gives full-weight evidence), with older segments decayed, a weak pull
of ``a`` toward 1 and a weak pull of ``b`` toward ``a``: when only one kind of round has run,
the other scale follows the machine's overall speed instead of staying where it was. Both
stay within ``[1/4, 4]``.

The object is host-side and mutable (not a pytree, never traced): a caller that keeps one per
method passes it to every :func:`~eaglepangu_jax.engine.decode.generate` call. The corrected
curve is a traced value, so correcting it never recompiles the loop; a segment whose loop was
compiled during the call is not used (its time is mostly compilation).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

__all__ = ["CostCorrection", "segment_costs"]

SCALE_RANGE = (0.25, 4.0)


@dataclasses.dataclass(eq=False)
class CostCorrection:
    """Scale factors of the latency curve learned from segment times (module docstring).

    Attributes:
      decay: weight kept by older segments when a new one is added, in ``(0, 1]``.
      prior_plain: pull of ``a`` toward 1, in segments' worth of evidence.
      prior_tie: pull of ``b`` toward ``a``, in segments' worth of evidence.
      min_seconds: segments shorter than this are ignored (host overhead dominates them).
    """

    decay: float = 0.9
    prior_plain: float = 0.01
    prior_tie: float = 0.05
    min_seconds: float = 0.05
    segments: int = 0
    # Decayed normal equations of the relative-error fit.
    _s11: float = 0.0
    _s12: float = 0.0
    _s22: float = 0.0
    _r1: float = 0.0
    _r2: float = 0.0
    _compiled: set = dataclasses.field(default_factory=set, repr=False)

    def __post_init__(self):
        if not 0.0 < self.decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {self.decay}")
        if not (self.prior_plain > 0.0 and self.prior_tie > 0.0):
            raise ValueError("prior_plain and prior_tie must be > 0")

    @property
    def scales(self) -> tuple[float, float]:
        """``(a, b)``: the plain-step and speculative-round scale factors."""
        l1, l2 = self.prior_plain, self.prior_tie
        lhs = np.array([[self._s11 + l1 + l2, self._s12 - l2], [self._s12 - l2, self._s22 + l2]])
        rhs = np.array([self._r1 + l1, self._r2])
        try:
            a, b = np.linalg.solve(lhs, rhs)
        except np.linalg.LinAlgError:
            return 1.0, 1.0
        if not (np.isfinite(a) and np.isfinite(b)):
            return 1.0, 1.0
        lo, hi = SCALE_RANGE
        return float(np.clip(a, lo, hi)), float(np.clip(b, lo, hi))

    def observe(self, plain_predicted: float, spec_predicted: float, measured: float) -> None:
        """Add one segment: its predicted plain-round and speculative-round seconds (on the
        uncorrected curve) and its measured seconds. Non-finite or too-short segments, and
        segments with nothing predicted, are ignored."""
        values = (plain_predicted, spec_predicted, measured)
        if not all(np.isfinite(v) for v in values) or measured < self.min_seconds:
            return
        if plain_predicted < 0 or spec_predicted < 0 or plain_predicted + spec_predicted <= 0:
            return
        total = plain_predicted + spec_predicted
        x1, x2, y = plain_predicted / total, spec_predicted / total, measured / total
        d = self.decay
        self._s11 = d * self._s11 + x1 * x1
        self._s12 = d * self._s12 + x1 * x2
        self._s22 = d * self._s22 + x2 * x2
        self._r1 = d * self._r1 + x1 * y
        self._r2 = d * self._r2 + x2 * y
        self.segments += 1

    def apply(self, verify_latency: Any, draft_seconds: float) -> tuple[np.ndarray, float]:
        """The corrected ``(verify_latency, draft_seconds)``: ``a T[0]``, ``b T[n >= 1]``,
        ``b t_draft``."""
        a, b = self.scales
        curve = np.asarray(verify_latency, np.float32).copy()
        curve[0] *= a
        curve[1:] *= b
        return curve, float(draft_seconds) * b

    def first_run(self, key: Any) -> bool:
        """True the first time ``key`` (a compiled loop's static key) is seen: that segment's
        time includes compilation."""
        if key in self._compiled:
            return False
        self._compiled.add(key)
        return True

    def describe(self) -> dict[str, float | int]:
        """JSON-ready summary for reports."""
        a, b = self.scales
        return {"plain_scale": a, "spec_scale": b, "segments": self.segments}


def segment_costs(
    nodes_log: np.ndarray,
    first_round: int,
    last_round: int,
    verify_latency: np.ndarray,
    draft_seconds: float,
) -> tuple[float, float]:
    """Predicted ``(X_plain, X_spec)`` of rounds ``[first_round, last_round)`` from the
    state's ``nodes_log`` (nodes verified per round, root excluded; 0 = a plain step) on the
    uncorrected curve."""
    nodes = np.asarray(nodes_log)[first_round:last_round].astype(np.int64)
    curve = np.asarray(verify_latency, np.float64)
    nodes = np.clip(nodes, 0, curve.shape[0] - 1)
    plain = float(np.sum(nodes == 0) * curve[0])
    spec = float(np.sum(curve[nodes[nodes > 0]] + draft_seconds))
    return plain, spec
