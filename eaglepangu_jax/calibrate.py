"""``eaglepangu calibrate``: measure this machine's verification cost and fit the roofline.

BASTION's controller (the ``"auto"`` policy) grows a tree while tokens per second rise, so it
needs the cost of a round, ``C(n) = t_draft + t_other + T_verify(n)``, on the machine it runs
on. This module measures it with the engine's own functions:

* **T_verify**: :func:`eaglepangu_jax.engine.step.verify_and_accept` (the teacher's
  tree-masked forward plus acceptance, the function the engine runs each round), jitted,
  compilation excluded, the median of ``repeats`` timings interleaved over a grid of (slots
  ``s``, cached context ``c``). The budget module's roofline is fitted to those points.
* **t_other**: a plain decoding round of the engine minus its one-slot verify forward
  (sampling, cache commit, the loop's own cost).
* **t_draft**: a named drafter's proposal, tree shaping and state update (the engine's
  ``propose_tree`` and ``update``).

The engine attends over a power-of-two *window* of the cache (masked), not over the ``c``
cached tokens alone, so the fit uses the window's context ``W - s`` as the roofline's ``c``
(``c + s = W``: the keys actually read); :func:`predict` maps a real ``c`` to it.

The engine calls the controller with ``t_draft = t_other = 0`` and a ``verify_latency``
curve, so :func:`verify_latency_curve` folds the constant overheads into every entry: adding a
constant to every entry of the curve is exactly the same stopping rule. It also charges each
node count the slot bucket the engine really verifies (1, 4, 16, ..., budget + 1).

The result is saved as versioned JSON (:func:`save_calibration`, by default
:func:`default_path`) and read back by :func:`curve_for`, the ``"auto"`` policy's entry point,
which falls back to the uncalibrated roofline when no usable calibration exists.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import hashlib
import json
import logging
import math
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from eaglepangu_jax import bench
from eaglepangu_jax import budget as budget_lib
from eaglepangu_jax import cache as cache_lib
from eaglepangu_jax import tree as tree_lib
from eaglepangu_jax.engine import generate as gen
from eaglepangu_jax.engine import step
from eaglepangu_jax.engine.config import SpecConfig
from eaglepangu_jax.engine.drafter import Proposal
from eaglepangu_jax.engine.trace import write_text_atomic
from eaglepangu_jax.models.config import LlamaConfig

log = logging.getLogger(__name__)

FORMAT = "eaglepangu-calibration"
VERSION = 1
FILE_NAME = "calibration.json"
DEFAULT_SLOTS = (1, 4, 16, 32, 64)
DEFAULT_CONTEXTS = (64, 256, 1024)
DEFAULT_REPEATS = 5
DRAFTER_NAMES = ("ngram", "eagle3", "block")  # by default: those that load
OVERHEAD_ROUNDS = 32  # plain decoding rounds timed per repeat for t_other
OVERHEAD_FORWARDS = 8  # one-slot verify forwards timed per repeat beside them
_PROBE_SPEC = SpecConfig(depth=bench.DEFAULT_DEPTH)  # verify probes: greedy acceptance
_FIT_KEYS = ("a_c", "b_c", "a_m", "b_m")
_WARNED: set[str] = set()  # drafters already reported as lacking a drafting cost


class CalibrationFileError(ValueError):
    """A calibration file is corrupt, of another version, or for another teacher."""


# ----------------------------------------------------------------------------- the record


@dataclasses.dataclass(frozen=True, kw_only=True)
class Sample:
    """One grid point: the median seconds of the engine's verify forward.

    Attributes:
      slots: ``s``, tokens in the forward (root + draft nodes).
      context: ``c``, committed tokens in the cache.
      window: ``W``, the attention window the engine uses there (cache slots read).
      seconds: median of ``times``.
      times: every timed run, seconds.
    """

    slots: int
    context: int
    window: int
    seconds: float
    times: tuple[float, ...]


@dataclasses.dataclass(frozen=True, kw_only=True)
class MachineCalibration:
    """A saved calibration: fitted roofline, raw samples and per-round overheads.

    Attributes:
      teacher: fingerprint of the teacher's shape and dtype (:func:`teacher_fingerprint`).
      teacher_config: the teacher's :class:`LlamaConfig` fields, for humans.
      dtype: parameter dtype name.
      machine: :func:`describe_machine` of the machine that measured.
      date: ISO 8601 UTC time of the measurement.
      peak_flops, bandwidth, bytes_per_param: the roofline figures the fit is relative to.
      a_c, b_c, a_m, b_m: fitted coefficients (see :class:`budget.Calibration`).
      samples: the measured grid.
      t_other: seconds per round outside drafting and verification.
      t_draft: seconds per round of drafting, by drafter name.
      details: how the overheads were measured (contexts, rounds, settings).
    """

    teacher: str
    teacher_config: Mapping[str, Any]
    dtype: str
    machine: Mapping[str, Any]
    date: str
    peak_flops: float
    bandwidth: float
    bytes_per_param: float
    a_c: float
    b_c: float
    a_m: float
    b_m: float
    samples: tuple[Sample, ...] = ()
    t_other: float = 0.0
    t_draft: Mapping[str, float] = dataclasses.field(default_factory=dict)
    details: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def coefficients(self) -> budget_lib.Calibration:
        """The fit as the budget module's :class:`~budget.Calibration`."""
        return budget_lib.Calibration(*(jnp.float32(getattr(self, k)) for k in _FIT_KEYS))

    def roofline(self, config: LlamaConfig) -> budget_lib.Roofline:
        """The roofline the coefficients were fitted on, for ``config``."""
        return budget_lib.Roofline.for_llama(config, peak_flops=self.peak_flops,
                                             bandwidth=self.bandwidth,
                                             bytes_per_param=self.bytes_per_param)


def teacher_fingerprint(config: LlamaConfig, dtype: str = "float32") -> str:
    """sha256 of everything that sets a forward's cost: the config's fields and the dtype.

    The weights' values do not change the cost, so a calibration serves any teacher of the
    same shape.
    """
    text = json.dumps({"config": dataclasses.asdict(config), "dtype": str(dtype)},
                      sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def describe_machine() -> dict[str, Any]:
    """The host and accelerator a calibration belongs to."""
    device = jax.devices()[0]
    return {"system": platform.system(), "machine": platform.machine(),
            "processor": _cpu_model(), "cpu_count": os.cpu_count(),
            "backend": jax.default_backend(), "device_kind": device.device_kind,
            "device_count": jax.device_count(), "jax_version": jax.__version__,
            "python": platform.python_version()}


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


_MACHINE_KEYS = ("machine", "processor", "backend", "device_kind")


def same_machine(calibration: MachineCalibration) -> bool:
    """True when ``calibration`` was measured on this kind of host and accelerator."""
    here = describe_machine()
    return all(calibration.machine.get(k) == here[k] for k in _MACHINE_KEYS)


def _dtype_name(teacher: gen.Teacher) -> str:
    return str(np.dtype(teacher.params["embed"].dtype))


# ----------------------------------------------------------------------------- measuring


def _median(times: Sequence[float]) -> float:
    return float(np.median(np.asarray(times, np.float64)))


def _tick(bar: Any) -> None:
    if bar is not None:
        bar.update(1)


def _phase(bar: Any, text: str) -> None:
    """Say on the progress bar what the next (possibly long) steps are doing."""
    if bar is not None and hasattr(bar, "set_postfix_str"):
        bar.set_postfix_str(text)


def probe_tree(num_slots: int, depth: int) -> tree_lib.Tree:
    """A verify-shaped tree of ``num_slots`` slots: chains of ``depth`` nodes under the root,
    as deep as the engine's trees (the cost does not depend on the tokens)."""
    i = np.arange(num_slots)
    parents = np.where((i - 1) % depth == 0, 0, i - 1)
    parents[0] = 0
    return tree_lib.from_parents(jnp.asarray(parents, jnp.int32),
                                 tokens=jnp.asarray(3 + i % 17, jnp.int32),
                                 max_depth=depth)


def _probe_prompt(length: int, vocab: int) -> list[int]:
    """A repetitive prompt (so an n-gram drafter finds matches), free of bos/eos."""
    return [int(3 + i % 17) % vocab for i in range(length)]


@functools.partial(jax.jit, static_argnums=0, donate_argnums=3)
def _engine_verify(static: step.StepStatic, params: dict, state: Any,
                   cache: cache_lib.KVCache, tree: tree_lib.Tree, key: Array):
    # The cache is donated and threaded back, as in the engine's loop: without donation the
    # K/V write would copy the whole cache every call.
    state = dataclasses.replace(state, cache=cache)
    acc, _, cache = step.verify_and_accept(static, params, state, tree, Proposal(), key)
    return acc, cache


class _VerifyTimer:
    """Compiles and times the engine's verify forward at (slots, context, window) points;
    points with the same window share one cache buffer."""

    def __init__(self, teacher: gen.Teacher):
        self.teacher = teacher
        cfg = teacher.config
        self.dtype = teacher.params["embed"].dtype
        placeholder = cache_lib.init(cfg.num_layers, 1, cfg.num_kv_heads, cfg.head_dim,
                                     self.dtype)
        # verify_and_accept reads only the cache from the state; the rest is a valid shell.
        self.state = gen.state_after_prefill(
            np.asarray(_probe_prompt(2, cfg.vocab_size), np.int32), placeholder,
            jnp.zeros((_PROBE_SPEC.depth + 1, 0, cfg.hidden_size), self.dtype),
            jnp.zeros((0, 0, cfg.hidden_size), self.dtype), None, None, _PROBE_SPEC,
            capacity=1, key=jax.random.key(0))
        self.buffers: dict[int, cache_lib.KVCache] = {}
        self.points: dict[tuple[int, int, int], tuple[step.StepStatic, tree_lib.Tree]] = {}

    def add(self, slots: int, context: int, window: int) -> tuple[int, int, int]:
        """Register a point and run it once (compiles); returns its key."""
        cfg = self.teacher.config
        if window not in self.buffers:
            self.buffers[window] = cache_lib.init(cfg.num_layers, window, cfg.num_kv_heads,
                                                  cfg.head_dim, self.dtype)
        static = step.StepStatic(teacher=cfg, drafter=None, spec=_PROBE_SPEC, window=window,
                                 eos_id=cfg.eos_id, bucketed=False)
        key = (slots, context, window)
        self.points[key] = (static, probe_tree(slots, _PROBE_SPEC.depth))
        self.time(key)
        return key

    def time(self, key: tuple[int, int, int]) -> float:
        """Seconds of one call at a registered point."""
        _, context, window = key
        static, tree = self.points[key]
        buf = self.buffers[window]
        cache = cache_lib.KVCache(k=buf.k, v=buf.v, length=jnp.int32(context))
        start = time.perf_counter()
        out = jax.block_until_ready(_engine_verify(static, self.teacher.params, self.state,
                                                   cache, tree, jax.random.key(0)))
        seconds = time.perf_counter() - start
        self.buffers[window] = out[1]
        return seconds


def engine_window(context: int, slots: int, config: LlamaConfig) -> int:
    """The attention window of a round verifying ``slots`` tokens after ``context``."""
    return gen.window_for(context + slots, config.max_position)


def measure_grid(teacher: gen.Teacher, slots: Sequence[int], contexts: Sequence[int],
                 repeats: int, *, bar: Any = None) -> list[Sample]:
    """Time the engine's verify forward at every (``s`` in ``slots``, ``c`` in ``contexts``).

    Every point compiles first (untimed); then ``repeats`` passes time each point once, in
    interleaved order so that a busy moment on a shared machine hits every point alike, and
    the median is kept. The window at ``(s, c)`` is the engine's for a tree of ``s`` slots.

    Args:
      teacher: the model (a tiny random one is fine for tests).
      slots: tokens per forward, each ``>= 1``.
      contexts: committed tokens, each ``>= 0``; ``c + s`` must fit ``max_position``.
      repeats: timed runs per point, ``>= 1``.
      bar: a progress bar (``update(1)`` per compile and per timed call), or ``None``.

    Returns:
      One :class:`Sample` per point, contexts outer, slots inner.
    """
    _check_grid(teacher.config, slots, contexts, repeats)
    timer = _VerifyTimer(teacher)
    keys = []
    for c in contexts:
        for s in slots:
            _phase(bar, f"compiling verify s={s} c={c}")
            keys.append(timer.add(s, c, engine_window(c, s, teacher.config)))
            _tick(bar)
    times: dict[tuple[int, int, int], list[float]] = {k: [] for k in keys}
    for r in range(repeats):
        _phase(bar, f"timing verify, pass {r + 1}/{repeats}")
        for k in keys:
            times[k].append(timer.time(k))
            _tick(bar)
    return [Sample(slots=s, context=c, window=w, seconds=_median(times[s, c, w]),
                   times=tuple(times[s, c, w])) for s, c, w in keys]


def _check_grid(config: LlamaConfig, slots: Sequence[int], contexts: Sequence[int],
                repeats: int) -> None:
    if not slots or not contexts:
        raise ValueError("the grid needs at least one slot count and one context")
    if any(s < 1 for s in slots) or any(c < 0 for c in contexts) or repeats < 1:
        raise ValueError(f"slots must be >= 1, contexts >= 0 and repeats >= 1; got slots "
                         f"{list(slots)}, contexts {list(contexts)}, repeats {repeats}")
    if max(slots) + max(contexts) > config.max_position:
        raise ValueError(f"{max(slots)} slots after {max(contexts)} cached tokens exceed the "
                         f"teacher's context of {config.max_position}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Overhead:
    """A plain engine round, its one-slot verify forward and their difference (seconds)."""

    round_seconds: float
    verify_seconds: float
    context: int
    rounds: int

    @property
    def t_other(self) -> float:
        return max(self.round_seconds - self.verify_seconds, 0.0)


def measure_overhead(teacher: gen.Teacher, *, context: int, repeats: int,
                     rounds: int = OVERHEAD_ROUNDS, bar: Any = None) -> Overhead:
    """``t_other``: a plain decoding round of the engine minus its one-slot verify forward.

    Plain decoding goes through the same step as speculation (a root-only tree), so the
    difference is what a round costs besides drafting and verification: the loop, acceptance,
    cache commit, token bookkeeping. Compiling runs go first; then each of ``repeats`` passes
    decodes ``rounds`` tokens after ``context`` committed ones and times a few one-slot
    forwards at the middle of that span (medians kept).
    """
    cfg = teacher.config
    prompt = _probe_prompt(context + 1, cfg.vocab_size)  # the last token is the first root
    spec = SpecConfig(budget=1, depth=1, max_new_tokens=rounds, eos_id=-1)
    gen.validate(teacher, None, prompt, spec)
    capacity = gen.cache_slots(len(prompt), spec, cfg.max_position)
    _phase(bar, "compiling plain decoding")
    gen.generate(teacher, None, prompt, spec)
    _tick(bar)
    timer = _VerifyTimer(teacher)
    key = timer.add(1, context + rounds // 2, gen.window_for(context + 1, capacity))
    _tick(bar)
    _phase(bar, "timing plain decoding rounds")
    per_round, verify = [], []
    # Interleaved, so that the round and the forward it is compared with see the same load.
    for _ in range(repeats):
        stats = gen.generate(teacher, None, prompt, spec).stats
        per_round.append(stats.seconds / max(stats.rounds, 1))
        _tick(bar)
        verify += [timer.time(key) for _ in range(min(rounds, OVERHEAD_FORWARDS))]
        _tick(bar)
    return Overhead(round_seconds=_median(per_round), verify_seconds=_median(verify),
                    context=context, rounds=rounds)


@functools.partial(jax.jit, static_argnums=0)
def _engine_draft(static: step.StepStatic, draft_params: Any, state: Any, key: Array,
                  verify_latency: Any):
    tree, n, _ = step.propose_tree(static, draft_params, state, key, verify_latency)
    context = state.context(static.spec.draft_window)
    return tree, n, static.drafter.update(draft_params, state.drafter_state, context)


def measure_draft(teacher: gen.Teacher, method: bench.Method, *, context: int, repeats: int,
                  bar: Any = None) -> float:
    """``t_draft`` of one drafter: the engine's proposal, tree shaping and drafter update
    after ``context`` committed tokens; median of ``repeats`` runs, compilation excluded."""
    spec = method.spec
    prompt = _probe_prompt(context + 1, teacher.config.vocab_size)
    gen.validate(teacher, method.drafter, prompt, spec)
    capacity = gen.cache_slots(len(prompt), spec, teacher.config.max_position)
    state = gen.init_state(teacher, method.drafter, method.draft_params, prompt, spec,
                           capacity=capacity, key=jax.random.key(0))
    static = step.StepStatic(teacher=teacher.config, drafter=method.drafter, spec=spec,
                             window=gen.window_for(context + spec.budget + 1, capacity),
                             eos_id=-1)
    latency = jnp.zeros((spec.budget + 1,), jnp.float32) if spec.policy == "auto" else None
    _phase(bar, f"timing drafter {method.name}")
    times = []
    for i in range(repeats + 1):
        start = time.perf_counter()
        jax.block_until_ready(_engine_draft(static, method.draft_params, state,
                                            jax.random.key(i), latency))
        if i:  # the first call compiles
            times.append(time.perf_counter() - start)
        _tick(bar)
    return _median(times)


# ----------------------------------------------------------------------------- fitting


def attended_context(slots: Any, window: Any) -> Any:
    """The roofline's ``c`` for a forward of ``slots`` tokens over a ``window``: ``W - s``,
    so that ``c + s`` is the number of keys the engine's masked attention reads."""
    return np.maximum(np.asarray(window) - np.asarray(slots), 0)


def fit_samples(samples: Sequence[Sample], roofline: budget_lib.Roofline
                ) -> budget_lib.Calibration:
    """Fit the roofline's ``a_c, b_c, a_m, b_m`` to measured samples (window context)."""
    rows = [(x.slots, float(attended_context(x.slots, x.window)), x.seconds) for x in samples]
    return budget_lib.calibrate(roofline, rows)


def _points(config: LlamaConfig, slots: Any, context: Any, window: Any
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``slots``, ``context`` and ``window`` broadcast together as int64 arrays; a missing
    window is the engine's for ``context + slots``."""
    s, c = np.broadcast_arrays(np.asarray(slots, np.int64), np.asarray(context, np.int64))
    if window is None:
        window = np.vectorize(lambda ci, si: engine_window(int(ci), int(si), config))(c, s)
    return s, c, np.broadcast_to(np.asarray(window, np.int64), s.shape)


def roofline_prediction(calibration: MachineCalibration, config: LlamaConfig, slots: Any,
                        context: Any, window: Any = None) -> np.ndarray:
    """The fitted roofline's seconds for the verify forward (no overheads, no correction).

    Args:
      slots: tokens per forward (array-like).
      context: committed tokens (array-like, broadcast with ``slots``).
      window: the attention window; default: the engine's for ``context + slots``.
    """
    s, _, window = _points(config, slots, context, window)
    c_eff = attended_context(s, window)
    out = budget_lib.latency(calibration.roofline(config), calibration.coefficients,
                             jnp.asarray(s, jnp.float32), jnp.asarray(c_eff, jnp.float32))
    return np.asarray(out, np.float64)


def _measured_table(calibration: MachineCalibration) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """``window -> (slot counts, median seconds)`` of the calibration's samples, sorted."""
    table: dict[int, dict[int, float]] = {}
    for x in calibration.samples:
        if x.seconds > 0:
            table.setdefault(int(x.window), {})[int(x.slots)] = float(x.seconds)
    return {w: (np.asarray(sorted(row), np.float64),
                np.asarray([row[k] for k in sorted(row)], np.float64))
            for w, row in sorted(table.items())}


def _at_window(calibration: MachineCalibration, config: LlamaConfig, s: float, w: int,
               row: tuple[np.ndarray, np.ndarray]) -> float:
    """Seconds at ``s`` slots in a measured window: linear between measured slot counts, the
    roofline's relative change beyond them."""
    known, seconds = row
    if known[0] <= s <= known[-1]:
        return float(np.interp(s, known, seconds))
    ref = known[0] if s < known[0] else known[-1]
    at_ref = seconds[0] if s < known[0] else seconds[-1]
    scale = (roofline_prediction(calibration, config, s, 0, window=w)
             / roofline_prediction(calibration, config, ref, 0, window=w))
    return float(at_ref * scale)


def predict(calibration: MachineCalibration, config: LlamaConfig, slots: Any, context: Any,
            window: Any = None) -> np.ndarray:
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
        at = {int(x): _at_window(calibration, config, si, int(x), table[int(x)])
              for x in {lo, hi}}
        if lo == hi:
            value = at[int(lo)]
            if wi != int(lo):  # outside the measured windows: the roofline's relative change
                value *= float(roofline_prediction(calibration, config, si, 0, window=wi)
                               / roofline_prediction(calibration, config, si, 0,
                                                     window=int(lo)))
        else:
            frac = (np.log(wi) - np.log(lo)) / (np.log(hi) - np.log(lo))
            value = (1 - frac) * at[int(lo)] + frac * at[int(hi)]
        out[index] = value
    return out


def calibrate_teacher(teacher: gen.Teacher, *, slots: Sequence[int] = DEFAULT_SLOTS,
                      contexts: Sequence[int] = DEFAULT_CONTEXTS,
                      repeats: int = DEFAULT_REPEATS,
                      drafters: Mapping[str, bench.Method] | None = None,
                      peak_flops: float = bench.CPU_PEAK_FLOPS,
                      bandwidth: float = bench.CPU_BANDWIDTH,
                      bar: Any = None) -> MachineCalibration:
    """Measure the grid, the round overhead and each drafter's cost; fit the roofline.

    Args:
      teacher: the model to calibrate.
      slots, contexts, repeats: the verify grid (see :func:`measure_grid`).
      drafters: name -> the method whose drafting cost to measure (none by default).
      peak_flops, bandwidth: nominal machine figures; the fitted slopes are relative to them.
      bar: a progress bar, see :func:`progress_total` for its length.

    Returns:
      The calibration (not yet saved).
    """
    drafters = dict(drafters or {})
    cfg = teacher.config
    dtype = _dtype_name(teacher)
    samples = measure_grid(teacher, slots, contexts, repeats, bar=bar)
    overhead_context = min(contexts)
    overhead = measure_overhead(teacher, context=overhead_context, repeats=repeats,
                                rounds=_overhead_rounds(cfg, overhead_context), bar=bar)
    t_draft = {name: measure_draft(teacher, m, context=overhead_context, repeats=repeats,
                                   bar=bar) for name, m in drafters.items()}
    roofline = budget_lib.Roofline.for_llama(cfg, peak_flops=peak_flops, bandwidth=bandwidth,
                                             bytes_per_param=np.dtype(dtype).itemsize)
    fit = fit_samples(samples, roofline)
    return MachineCalibration(
        teacher=teacher_fingerprint(cfg, dtype), teacher_config=dataclasses.asdict(cfg),
        dtype=dtype, machine=describe_machine(), date=_now(), peak_flops=float(peak_flops),
        bandwidth=float(bandwidth), bytes_per_param=float(roofline.bytes_per_param),
        **{k: float(getattr(fit, k)) for k in _FIT_KEYS},
        samples=tuple(samples), t_other=overhead.t_other, t_draft=t_draft,
        details={"repeats": repeats,
                 "overhead": dataclasses.asdict(overhead),
                 "drafters": {name: {"context": overhead_context, "policy": m.spec.policy,
                                     "budget": m.spec.budget, "depth": m.spec.depth}
                              for name, m in drafters.items()}})


def _overhead_rounds(config: LlamaConfig, context: int) -> int:
    """As many as :data:`OVERHEAD_ROUNDS` plain rounds as fit the teacher's context."""
    spare = config.max_position - gen.needed_slots(context + 1, SpecConfig(
        budget=1, depth=1, max_new_tokens=1)) + 1
    return max(1, min(OVERHEAD_ROUNDS, spare))


def progress_total(num_points: int, repeats: int, num_drafters: int) -> int:
    """Progress steps of :func:`calibrate_teacher`: every compile and every timed call."""
    return (num_points * (1 + repeats) + (1 + repeats) + (1 + repeats)
            + num_drafters * (1 + repeats))


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


# ----------------------------------------------------------------------------- saving


def default_path() -> Path:
    """Where calibrations live unless told otherwise: ``calibration.json`` in the cache
    folder (``$EAGLEPANGU_CACHE``, else ``~/.cache/eaglepangu``)."""
    from eaglepangu_jax.models.weights_cache import resolve_cache_dir

    return resolve_cache_dir() / FILE_NAME


def to_json(calibration: MachineCalibration) -> dict[str, Any]:
    """The JSON document of a calibration."""
    c = calibration
    return {
        "format": FORMAT, "version": VERSION, "date": c.date, "machine": dict(c.machine),
        "teacher": {"fingerprint": c.teacher, "dtype": c.dtype,
                    "config": dict(c.teacher_config)},
        "roofline": {"peak_flops": c.peak_flops, "bandwidth": c.bandwidth,
                     "bytes_per_param": c.bytes_per_param, "context": "attention window"},
        "fit": {k: getattr(c, k) for k in _FIT_KEYS},
        "t_other": c.t_other, "t_draft": dict(c.t_draft),
        "samples": [dataclasses.asdict(x) for x in c.samples],
        "details": dict(c.details),
    }


def save_calibration(calibration: MachineCalibration, path: str | os.PathLike | None = None
                     ) -> Path:
    """Write ``calibration`` as indented JSON, atomically (default: :func:`default_path`)."""
    path = Path(path) if path is not None else default_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(to_json(calibration), indent=2, allow_nan=False) + "\n")
    return path


def load_calibration(path: str | os.PathLike | None = None, *,
                     config: LlamaConfig | None = None,
                     dtype: str = "float32") -> MachineCalibration:
    """Read a calibration written by :func:`save_calibration`.

    Args:
      path: the file (default: :func:`default_path`).
      config, dtype: when ``config`` is given, the calibration must be for a teacher of this
        shape and dtype.

    Raises:
      FileNotFoundError: no file there (the message says how to make one).
      CalibrationFileError: the file is not valid JSON, not a calibration, of another format
        version, has missing or bad fields, or belongs to another teacher.
    """
    path = Path(path) if path is not None else default_path()
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FileNotFoundError(f"no calibration at {path}; measure one with "
                                f"'eaglepangu calibrate'") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise CalibrationFileError(f"calibration {path} is corrupt (not JSON: {err}); "
                                   f"measure it again with 'eaglepangu calibrate'") from None
    calibration = _from_json(data, path)
    if config is not None and calibration.teacher != teacher_fingerprint(config, dtype):
        raise CalibrationFileError(
            f"calibration {path} was measured for another teacher "
            f"({_describe_config(calibration.teacher_config, calibration.dtype)}), not this "
            f"one ({_describe_config(dataclasses.asdict(config), dtype)})")
    return calibration


def _describe_config(fields: Mapping[str, Any], dtype: str) -> str:
    keys = ("num_layers", "hidden_size", "intermediate_size", "vocab_size")
    return ", ".join(f"{k}={fields.get(k)}" for k in keys) + f", {dtype}"


def _from_json(data: Any, path: Path) -> MachineCalibration:
    def bad(why: str) -> CalibrationFileError:
        return CalibrationFileError(f"calibration {path} is corrupt: {why}; measure it again "
                                    f"with 'eaglepangu calibrate'")

    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise bad(f"it is not a {FORMAT} file")
    if data.get("version") != VERSION:
        raise CalibrationFileError(f"calibration {path} has format version "
                                   f"{data.get('version')!r}, this code reads version "
                                   f"{VERSION}; measure it again with 'eaglepangu calibrate'")
    try:
        teacher, roof, fit = data["teacher"], data["roofline"], data["fit"]
        numbers = {k: _non_negative(fit[k], k) for k in _FIT_KEYS}
        for k in ("peak_flops", "bandwidth", "bytes_per_param"):
            numbers[k] = _non_negative(roof[k], k)
            if numbers[k] == 0:
                raise ValueError(f"{k} must be > 0")
        samples = tuple(Sample(slots=int(x["slots"]), context=int(x["context"]),
                               window=int(x["window"]),
                               seconds=_non_negative(x["seconds"], "seconds"),
                               times=tuple(_non_negative(t, "times") for t in x["times"]))
                        for x in data["samples"])
        t_draft = {str(k): _non_negative(v, f"t_draft[{k}]")
                   for k, v in dict(data["t_draft"]).items()}
        return MachineCalibration(
            teacher=str(teacher["fingerprint"]), teacher_config=dict(teacher["config"]),
            dtype=str(teacher["dtype"]), machine=dict(data["machine"]), date=str(data["date"]),
            samples=samples, t_other=_non_negative(data["t_other"], "t_other"),
            t_draft=t_draft, details=dict(data.get("details", {})), **numbers)
    except KeyError as err:
        raise bad(f"field {err} is missing") from None
    except (TypeError, ValueError, AttributeError) as err:
        raise bad(str(err)) from None


def _non_negative(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be finite and >= 0, got {value!r}")
    return float(value)


# ----------------------------------------------------------------------------- the curve


def verify_latency_curve(calibration: MachineCalibration, config: LlamaConfig, context: int,
                         budget: int, *, drafter: str | None = None,
                         bucketed: bool = True) -> Float[Array, "N+1"]:
    """The ``verify_latency`` argument of the ``"auto"`` policy, overheads folded in.

    Entry ``n`` is the predicted seconds of a round verifying the root plus ``n`` nodes:
    the forward at the engine's slot bucket (the smallest of 1, 4, 16, ..., ``budget + 1``
    holding ``n + 1`` slots) when ``bucketed``, over the engine's window at ``context``
    committed tokens, plus ``t_other`` and the drafter's ``t_draft``. The controller compares
    differences of the curve with the cost ``C(n) = t_draft + t_other + T(n)``, and the engine
    passes ``t_draft = t_other = 0``, so folding the constants in gives exactly BASTION's rule.

    Args:
      calibration: a saved or fresh calibration for ``config``.
      config: the teacher.
      context: committed tokens when the curve is used (the prompt length).
      budget: the tree budget (nodes, root excluded), ``>= 1``.
      drafter: add this drafter's ``t_draft`` (it must have been calibrated).
      bucketed: charge the engine's slot bucket (``False``: exactly ``n + 1`` slots).

    Returns:
      float32 ``[budget + 1]``, non-decreasing.

    Raises:
      ValueError: bad budget or context, another teacher, or an uncalibrated drafter.
    """
    if budget < 1 or context < 0:
        raise ValueError(f"budget must be >= 1 and context >= 0, got {budget} and {context}")
    if calibration.teacher != teacher_fingerprint(config, calibration.dtype):
        raise ValueError("the calibration was measured for another teacher: "
                         f"{_describe_config(calibration.teacher_config, calibration.dtype)}")
    t_draft = 0.0
    if drafter is not None:
        if drafter not in calibration.t_draft:
            raise ValueError(f"drafter {drafter!r} was not calibrated; calibrated: "
                             f"{sorted(calibration.t_draft) or 'none'}")
        t_draft = calibration.t_draft[drafter]
    slots = np.arange(1, budget + 2)
    if bucketed:
        sizes = np.asarray(step.slot_buckets(budget + 1))
        slots = sizes[np.searchsorted(sizes, slots)]
    # The engine picks one window per round, for the full tree, whatever bucket it verifies.
    window = gen.window_for(context + budget + 1, config.max_position)
    verify = predict(calibration, config, slots, context, window=window)
    return jnp.asarray(verify + (calibration.t_other + t_draft), jnp.float32)


def uncalibrated(config: LlamaConfig, dtype: str = "float32") -> MachineCalibration:
    """The roofline at this machine class's nominal peaks, no overheads: the fallback."""
    ideal = budget_lib.Calibration.ideal()
    return MachineCalibration(
        teacher=teacher_fingerprint(config, dtype), teacher_config=dataclasses.asdict(config),
        dtype=dtype, machine=describe_machine(), date=_now(),
        peak_flops=bench.CPU_PEAK_FLOPS, bandwidth=bench.CPU_BANDWIDTH,
        bytes_per_param=float(np.dtype(dtype).itemsize),
        **{k: float(getattr(ideal, k)) for k in _FIT_KEYS})


def curve_for(config: LlamaConfig, spec: SpecConfig, context: int,
              drafter_name: str | None = None, *, path: str | os.PathLike | None = None,
              dtype: str = "float32", bucketed: bool = True) -> Float[Array, "N+1"]:
    """The ``[spec.budget + 1]`` verify-latency curve for a run, from the saved calibration.

    Uses the calibration at ``path`` (default: :func:`default_path`) when it exists, is
    readable, belongs to this teacher and was measured on this kind of machine; otherwise the
    uncalibrated roofline (:func:`uncalibrated`), with a logged warning saying why. A drafter
    the calibration did not time adds no drafting cost (also logged).
    """
    target = Path(path) if path is not None else default_path()
    calibration = None
    try:
        calibration = load_calibration(target, config=config, dtype=dtype)
    except FileNotFoundError:
        log.info("no calibration at %s: using the uncalibrated roofline", target)
    except (OSError, CalibrationFileError) as err:
        log.warning("%s: using the uncalibrated roofline", err)
    if calibration is not None and not same_machine(calibration):
        log.warning("calibration %s was measured on another machine (%s): using the "
                    "uncalibrated roofline", target,
                    ", ".join(str(calibration.machine.get(k)) for k in _MACHINE_KEYS))
        calibration = None
    if calibration is None:
        calibration = uncalibrated(config, dtype)
    if drafter_name is not None and drafter_name not in calibration.t_draft:
        if calibration.samples and drafter_name not in _WARNED:
            _WARNED.add(drafter_name)  # once per process: this runs for every generation
            log.warning("drafter %r has no calibrated drafting cost: counting none",
                        drafter_name)
        drafter_name = None
    return verify_latency_curve(calibration, config, context, spec.budget,
                                drafter=drafter_name, bucketed=bucketed)


# ----------------------------------------------------------------------------- reporting


def error_table(calibration: MachineCalibration, config: LlamaConfig) -> list[dict[str, float]]:
    """Per sample: slots, context, window, measured ms, the fitted roofline's ms and its
    relative error % (the model's error; :func:`predict` reproduces measured points)."""
    samples = calibration.samples
    if not samples:
        return []
    predicted = roofline_prediction(calibration, config, [x.slots for x in samples],
                                    [x.context for x in samples],
                                    window=[x.window for x in samples])
    return [{"slots": x.slots, "context": x.context, "window": x.window,
             "measured_ms": 1e3 * x.seconds, "predicted_ms": 1e3 * float(p),
             "error_pct": 100.0 * (float(p) - x.seconds) / x.seconds if x.seconds else 0.0}
            for x, p in zip(samples, predicted)]


def format_report(calibration: MachineCalibration, config: LlamaConfig) -> str:
    """The measured-vs-predicted table, the coefficients and the overheads, as text."""
    rows = error_table(calibration, config)
    header = (f"{'s':>4} {'c':>6} {'window':>6} {'measured ms':>11} {'roofline ms':>12} "
              f"{'error %':>8}")
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(f"{r['slots']:>4} {r['context']:>6} {r['window']:>6} "
                     f"{r['measured_ms']:>11.2f} {r['predicted_ms']:>12.2f} "
                     f"{r['error_pct']:>+8.1f}")
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


def plot_calibration(calibration: MachineCalibration, config: LlamaConfig,
                     path: str | os.PathLike) -> Path:
    """Measured (markers) and predicted (lines) verify latency against ``s``, one colour per
    context, log-2 x axis; written as a PNG atomically.

    Raises:
      PlotsUnavailableError: matplotlib is missing (the message names the ``plots`` extra).
      ValueError: the calibration has no samples.
    """
    from eaglepangu_jax import plots

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
        points = sorted((x for x in calibration.samples if x.context == c),
                        key=lambda x: x.slots)
        ax.plot(grid, 1e3 * roofline_prediction(calibration, config, grid, c), color=colour,
                lw=1.6, label=f"c = {c}: roofline fit")
        ax.plot(grid, 1e3 * predict(calibration, config, grid, c), color=colour, lw=0.9,
                ls="--", label=f"c = {c}: controller's curve")
        ax.plot([x.slots for x in points], [1e3 * x.seconds for x in points], "o",
                color=colour, ms=6, mfc="none", mew=1.6, label=f"c = {c}: measured")
    worst = max(abs(r["error_pct"]) for r in error_table(calibration, config))
    ax.set_xscale("log", base=2)
    ticks = sorted({x.slots for x in calibration.samples})
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.minorticks_off()
    ax.set_xlabel("new tokens per verify forward s (root + draft nodes)")
    ax.set_ylabel("verify forward latency (ms)")
    ax.set_title(f"Verify latency, measured vs calibrated roofline "
                 f"({config.num_layers} layers, hidden {config.hidden_size}, "
                 f"{calibration.dtype})\n{calibration.machine.get('processor', '')}, "
                 f"{calibration.machine.get('backend', '')}; c = cached tokens; "
                 f"roofline max error {worst:.0f}%", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncols=2)
    return plots.save_figure(fig, path)


# ----------------------------------------------------------------------------- command line


def _whole(text: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
    return value


def _int_list(minimum: int) -> Callable[[str], tuple[int, ...]]:
    """A parser of ``"1,4,16"``: sorted distinct whole numbers, each ``>= minimum``."""
    def parse(text: str) -> tuple[int, ...]:
        values = tuple(_whole(x.strip(), minimum) for x in text.split(",") if x.strip())
        if not values:
            raise argparse.ArgumentTypeError("expected at least one number")
        return tuple(sorted(set(values)))
    return parse


def _drafter_list(text: str) -> tuple[str, ...]:
    names = tuple(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    if names in ((), ("none",)):
        return ()
    unknown = [n for n in names if n not in DRAFTER_NAMES]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown drafter(s) {unknown}; known: "
                                         f"{', '.join(DRAFTER_NAMES)} (or 'none')")
    return names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the options of ``eaglepangu calibrate`` to ``parser``."""
    parser.add_argument("--slots", type=_int_list(1), default=",".join(map(str, DEFAULT_SLOTS)),
                        metavar="LIST",
                        help="tokens per verify forward (root + nodes) to time, e.g. "
                             "1,4,16,32,64")
    parser.add_argument("--contexts", type=_int_list(1),
                        default=",".join(map(str, DEFAULT_CONTEXTS)),
                        metavar="LIST", help="cached tokens to time at, e.g. 64,256,1024")
    parser.add_argument("--repeats", type=lambda t: _whole(t, 1), default=DEFAULT_REPEATS,
                        metavar="N", help="timed runs per point (the median is kept)")
    parser.add_argument("--drafters", type=_drafter_list, default=None, metavar="LIST",
                        help=f"drafters whose drafting cost to time, from "
                             f"{', '.join(DRAFTER_NAMES)}, or 'none' (default: those that "
                             f"load)")
    parser.add_argument("--out", "--json", dest="out", metavar="FILE.json", default=None,
                        help="where to save the calibration (default: calibration.json in "
                             "the cache folder, where 'auto' looks for it)")
    parser.add_argument("--plot", metavar="FILE.png", default=None,
                        help="also draw measured vs predicted latency")
    parser.add_argument("--no-progress", dest="progress", action="store_false",
                        help="no progress bar")
    parser.set_defaults(calibrate_parser=parser)


def _methods(parser: argparse.ArgumentParser, teacher: gen.Teacher,
             names: Sequence[str] | None) -> dict[str, bench.Method]:
    """The drafters to time; explicit names must load, defaults that do not are skipped."""
    explicit = names is not None
    spec = SpecConfig(budget=bench.DEFAULT_BUDGET, depth=bench.DEFAULT_DEPTH)
    methods = {}
    for name in (names if explicit else DRAFTER_NAMES):
        try:
            methods[name] = _method(name, spec, teacher)
        except (ValueError, bench.DrafterUnavailableError) as err:
            if explicit:
                parser.error(f"--drafters: {name}: {err}")
            print(f"drafter {name} skipped: {err}", file=sys.stderr)
    return methods


def _method(name: str, spec: SpecConfig, teacher: gen.Teacher) -> bench.Method:
    if name == "eagle3":
        def loader():
            from eaglepangu_jax.drafters.eagle3 import load_shipped_eagle3

            return load_shipped_eagle3(teacher.params)
        return bench.make_method(name, spec, default_depth=True, eagle3_loader=loader)
    if name != "block":
        return bench.make_method(name, spec, default_depth=True)
    try:
        from eaglepangu_jax.drafters.block import load_shipped_block
    except ImportError as err:
        raise bench.DrafterUnavailableError(f"the block drafter is not available: {err}") \
            from None
    try:
        drafter, params = load_shipped_block(teacher.params, budget=spec.budget)
    except (TypeError, ImportError, OSError, ValueError, KeyError) as err:
        raise bench.DrafterUnavailableError(f"the block drafter could not be loaded: "
                                            f"{err}") from err
    spec = dataclasses.replace(spec, policy="best_first",
                               depth=min(spec.depth, drafter.max_depth))
    drafter = bench.configure_drafter(drafter, budget=spec.budget, depth=spec.depth)
    return bench.Method(name=name, spec=spec, drafter=drafter, draft_params=params)


def _check_args(parser: argparse.ArgumentParser, args: argparse.Namespace,
                config: LlamaConfig) -> None:
    if max(args.slots) > config.max_position:
        parser.error(f"--slots: {max(args.slots)} is above the model's context of "
                     f"{config.max_position}")
    if max(args.slots) + max(args.contexts) > config.max_position:
        parser.error(f"--contexts: {max(args.contexts)} cached tokens plus {max(args.slots)} "
                     f"slots exceed the model's context of {config.max_position}")
    for option, path in (("--out", args.out), ("--plot", args.plot)):
        if path is not None and not Path(path).resolve().parent.is_dir():
            parser.error(f"{option}: cannot write {path}: its folder does not exist")
    if args.plot is not None:
        from eaglepangu_jax import plots

        try:
            plots.require_matplotlib()
        except plots.PlotsUnavailableError as err:
            parser.error(f"--plot: {err}")


def run(args: argparse.Namespace, *, teacher: gen.Teacher | None = None) -> int:
    """Run ``eaglepangu calibrate`` with parsed ``args``; ``teacher`` replaces SmolLM2.

    Returns:
      The exit status (bad options exit with status 2 before the model loads).
    """
    parser = args.calibrate_parser
    config = teacher.config if teacher is not None else LlamaConfig.smollm2_135m()
    _check_args(parser, args, config)
    if teacher is None:
        from eaglepangu_jax.cli import load_teacher

        teacher = load_teacher()
    methods = _methods(parser, teacher, args.drafters)
    from tqdm import tqdm

    total = progress_total(len(args.slots) * len(args.contexts), args.repeats, len(methods))
    with tqdm(total=total, desc="calibrate", unit="run", disable=not args.progress,
              dynamic_ncols=True) as bar:
        calibration = calibrate_teacher(teacher, slots=args.slots, contexts=args.contexts,
                                        repeats=args.repeats, drafters=methods, bar=bar)
    path = save_calibration(calibration, args.out)
    print(format_report(calibration, teacher.config))
    print(f"calibration written to {path}", file=sys.stderr)
    if args.plot is not None:
        plot_calibration(calibration, teacher.config, args.plot)
        print(f"plot written to {args.plot}", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    """A stand-alone parser for ``calibrate`` (tests, ``python -m``)."""
    parser = argparse.ArgumentParser(
        prog="eaglepangu calibrate",
        description="Time the teacher's verify forward on this machine over a grid of tree "
                    "sizes and contexts, the engine's per-round overhead and each drafter's "
                    "cost; fit the roofline and save it for the 'auto' policy.")
    add_arguments(parser)
    return parser


def main(argv: Sequence[str] | None = None, *, teacher: gen.Teacher | None = None) -> int:
    """Entry point with its own parser; ``teacher`` replaces SmolLM2 (tests)."""
    args = build_parser().parse_args(None if argv is None else list(argv))
    return run(args, teacher=teacher)


if __name__ == "__main__":
    from eaglepangu_jax.cli import enable_compile_cache

    enable_compile_cache(None)
    sys.exit(main())
