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

Three rules keep one odd stretch of text, or one disturbed turn, from steering the
controller for good:

* **One fit per attention window.** A segment runs at one window, and the curve is predicted
  at the prompt's window; a long turn's later segments attend twice as many positions. Fitted
  together, such a segment moved the scales of every later short turn (measured:
  docs/RESULTS.md, "Per-category 2 after the cost fit went per window"). Each window keeps its
  own fit; a window never seen starts from the uncorrected curve.
* **Evidence about a kind of round fades while that kind barely runs.** The controller's
  choice depends only on ``a / b``; once it speculates in (nearly) every round, or in
  (nearly) none, the segments say little new about the other kind, and a ratio learned from
  a few noisy segments would hold for as long as the old evidence lasts. So from the second
  segment in a row in which plain rounds are at most ``rare_share`` of the predicted time,
  each such segment multiplies the weight of the earlier segments in which they were a larger
  share than in it by ``stale_decay`` (and the same for speculative rounds; one such segment
  is ordinary alternation and fades nothing). The rarely seen scale then returns to the
  machine's overall speed (the pull toward each other), the controller weighs the rounds on
  the calibrated ratio again, and fresh evidence of both kinds follows. Why "rare" and not
  only "absent" (``rare_share = 0``, the rule before session 52): after one disturbed turn
  the EAGLE-3 head's speculative scale stayed at 1.2-1.6 for twenty turns, the controller
  drafting in a fifth of the rounds, each segment too thin in speculative rounds to outweigh
  the disturbed one (docs/RESULTS.md, "The controller after a disturbed turn").
* **A surprising segment enters with less weight, once the fit is settled.** A shared
  machine slows now and then for a turn: such a segment, weighted like any other, can move
  a scale by half or more and hold it there for about twenty segments (decay 0.9); in one
  run on the dev suite the n-gram drafter's speculative scale went to 1.72 after one
  disturbed turn and took twenty turns to come back to 1.07, while its twin, spared, stayed
  at 0.8-1.0 (docs/RESULTS.md, "The controller after a disturbed turn"). So once a
  window's fit rests on at least ``settled`` segments' worth of weight, a segment whose time
  is off the fit's prediction by a fraction ``r > surprise`` enters with weight ``surprise /
  r`` (Huber's rule, one pass): a lasting change of the machine still moves the fit,
  segment after segment, as its residuals shrink; a window's first segments always count
  fully (a machine far slower than calibrated is learned at once).

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
_MAX_SEGMENTS = 64  # per window; older ones weigh < decay ** 64 (0.1% at the default)


@dataclasses.dataclass(eq=False)
class CostCorrection:
    """Scale factors of the latency curve learned from segment times (module docstring).

    Attributes:
      decay: weight kept by older segments when a new one is added, in ``(0, 1]``.
      stale_decay: extra weight kept by the earlier segments with plain (speculative) rounds,
        per segment after the first in a row where they are rare, in ``(0, 1]``; 1: no fading.
      rare_share: a kind of round is rare in a segment when its share of the segment's
        predicted seconds is at most this, in ``[0, 1)``; 0: only when it is absent.
      prior_plain: pull of ``a`` toward 1, in segments' worth of evidence.
      prior_tie: pull of ``b`` toward ``a``, in segments' worth of evidence.
      min_seconds: segments shorter than this are ignored (host overhead dominates them).
      surprise: ``> 0``, the relative deviation from the settled fit's prediction above which
        a segment's weight falls as ``surprise / deviation``; ``None``: every segment weighs 1.
      settled: ``>= 0``, the total weight (in segments) a window's fit needs before
        ``surprise`` applies.
    """

    decay: float = 0.9
    stale_decay: float = 0.3
    rare_share: float = 0.25
    prior_plain: float = 0.01
    prior_tie: float = 0.05
    min_seconds: float = 0.05
    surprise: float | None = 0.15
    settled: float = 3.0
    segments: int = 0
    # Per window (None: not given), the used segments as relative (x_plain, x_spec, y) rows,
    # oldest first, each with its weight.
    _rows: dict = dataclasses.field(default_factory=dict, repr=False)
    _last_window: Any = dataclasses.field(default=None, repr=False)
    _compiled: set = dataclasses.field(default_factory=set, repr=False)

    def __post_init__(self):
        for name in ("decay", "stale_decay"):
            if not 0.0 < getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in (0, 1], got {getattr(self, name)}")
        if not 0.0 <= self.rare_share < 1.0:
            raise ValueError(f"rare_share must be in [0, 1), got {self.rare_share}")
        if not (self.prior_plain > 0.0 and self.prior_tie > 0.0):
            raise ValueError("prior_plain and prior_tie must be > 0")
        if self.surprise is not None and not 0.0 < self.surprise < float("inf"):
            raise ValueError(f"surprise must be finite and > 0, or None; got {self.surprise}")
        if not 0.0 <= self.settled < float("inf"):
            raise ValueError(f"settled must be finite and >= 0, got {self.settled}")

    def scales_for(self, window: int | None = None) -> tuple[float, float]:
        """``(a, b)`` for segments at ``window``: the plain-step and speculative-round scale
        factors; ``(1, 1)`` for a window with no segments yet."""
        rows = self._rows.get(window, [])
        if not rows:
            return 1.0, 1.0
        x1, x2, y, w = (np.asarray(c, np.float64) for c in zip(*rows))
        l1, l2 = self.prior_plain, self.prior_tie
        s11, s12, s22 = np.sum(w * x1 * x1), np.sum(w * x1 * x2), np.sum(w * x2 * x2)
        lhs = np.array([[s11 + l1 + l2, s12 - l2], [s12 - l2, s22 + l2]])
        rhs = np.array([np.sum(w * x1 * y) + l1, np.sum(w * x2 * y)])
        try:
            a, b = np.linalg.solve(lhs, rhs)
        except np.linalg.LinAlgError:
            return 1.0, 1.0
        if not (np.isfinite(a) and np.isfinite(b)):
            return 1.0, 1.0
        lo, hi = SCALE_RANGE
        return float(np.clip(a, lo, hi)), float(np.clip(b, lo, hi))

    @property
    def scales(self) -> tuple[float, float]:
        """``(a, b)`` of the window observed last (:meth:`scales_for`)."""
        return self.scales_for(self._last_window)

    def observe(
        self,
        plain_predicted: float,
        spec_predicted: float,
        measured: float,
        window: int | None = None,
    ) -> None:
        """Add one segment at ``window``: its predicted plain-round and speculative-round
        seconds (on the uncorrected curve) and its measured seconds. Non-finite or too-short
        segments, and segments with nothing predicted, are ignored."""
        values = (plain_predicted, spec_predicted, measured)
        if not all(np.isfinite(v) for v in values) or measured < self.min_seconds:
            return
        if plain_predicted < 0 or spec_predicted < 0 or plain_predicted + spec_predicted <= 0:
            return
        total = plain_predicted + spec_predicted
        x1, x2, y = plain_predicted / total, spec_predicted / total, measured / total
        previous = self._rows.get(window, [])
        weight = self._surprise_weight(x1, x2, y, window)
        # A kind of round rare in this segment *and* the one before: the evidence of the
        # segments that saw more of it than this one ages. (One such segment is normal
        # alternation, e.g. a plain turn after a speculative one.)
        rare = self.rare_share
        plain_gone = x1 <= rare and bool(previous) and previous[-1][0] <= rare
        spec_gone = x2 <= rare and bool(previous) and previous[-1][1] <= rare
        rows = []
        for old1, old2, old_y, old_weight in previous:
            old_weight *= self.decay
            if (plain_gone and old1 > x1) or (spec_gone and old2 > x2):
                old_weight *= self.stale_decay
            rows.append((old1, old2, old_y, old_weight))
        rows.append((x1, x2, y, weight))
        self._rows[window] = rows[-_MAX_SEGMENTS:]
        self._last_window = window
        self.segments += 1

    def _surprise_weight(self, x1: float, x2: float, y: float, window: Any) -> float:
        """The weight a new relative segment ``(x1, x2, y)`` enters with (module docstring):
        1 until the window's fit is settled, then ``surprise / r`` where its time deviates
        from the fit's prediction by a fraction ``r > surprise``."""
        rows = self._rows.get(window, [])
        if self.surprise is None or sum(row[3] for row in rows) < self.settled:
            return 1.0
        a, b = self.scales_for(window)
        predicted = a * x1 + b * x2
        deviation = abs(y / predicted - 1.0) if predicted > 0 else float("inf")
        return 1.0 if deviation <= self.surprise else self.surprise / deviation

    def apply(
        self, verify_latency: Any, draft_seconds: float, window: int | None = None
    ) -> tuple[np.ndarray, float]:
        """The corrected ``(verify_latency, draft_seconds)`` for a segment at ``window``:
        ``a T[0]``, ``b T[n >= 1]``, ``b t_draft``."""
        a, b = self.scales_for(window)
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

    def describe(self) -> dict[str, Any]:
        """JSON-ready summary for reports: the last window's scales, the segment count, and
        each window's scales and segments."""
        a, b = self.scales
        windows = {}
        for window, rows in sorted(self._rows.items(), key=lambda item: str(item[0])):
            wa, wb = self.scales_for(window)
            windows[str(window)] = {"plain_scale": wa, "spec_scale": wb, "segments": len(rows)}
        return {"plain_scale": a, "spec_scale": b, "segments": self.segments, "windows": windows}


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
