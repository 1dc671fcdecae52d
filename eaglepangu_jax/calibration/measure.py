"""Measuring this machine's costs with the engine's own functions.

* **T_verify**: :func:`eaglepangu_jax.engine.step.verify_and_accept` (the teacher's
  tree-masked forward plus acceptance, the function the engine runs each round), jitted,
  compilation excluded, the median of ``repeats`` timings interleaved over a grid of (slots
  ``s``, cached context ``c``).
* **t_other**: a plain decoding round of the engine minus its one-slot verify forward
  (sampling, cache commit, the loop's own cost).
* **t_draft**: a named drafter's proposal, tree shaping and state update (the engine's
  ``propose_tree`` and ``update``).

:func:`calibrate_teacher` runs all three and fits the roofline (:mod:`.fit`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array

from eaglepangu_jax import budget as budget_lib
from eaglepangu_jax import cache as cache_lib
from eaglepangu_jax import tree as tree_lib
from eaglepangu_jax.calibration.fit import engine_window, fit_samples
from eaglepangu_jax.calibration.store import (
    FIT_KEYS,
    MachineCalibration,
    Sample,
    describe_machine,
    dtype_name,
    teacher_fingerprint,
    timestamp,
)
from eaglepangu_jax.engine import decode as gen
from eaglepangu_jax.engine import step
from eaglepangu_jax.engine.config import SpecConfig
from eaglepangu_jax.engine.drafter import Proposal, costliest
from eaglepangu_jax.methods import registry as methods_lib
from eaglepangu_jax.models import llama
from eaglepangu_jax.models.config import LlamaConfig

__all__ = [
    "DEFAULT_SLOTS",
    "DEFAULT_CONTEXTS",
    "DEFAULT_REPEATS",
    "OVERHEAD_ROUNDS",
    "OVERHEAD_FORWARDS",
    "probe_tree",
    "measure_grid",
    "measure_grids",
    "Overhead",
    "measure_overhead",
    "measure_draft",
    "calibrate_teacher",
    "progress_total",
]

log = logging.getLogger(__name__)

# The engine's verify buckets for the default 8-node trees (1, 2, 4, 9: what the controller
# reads, and what calibration.sizing compares), then larger trees for the fit.
DEFAULT_SLOTS = (1, 2, 4, 9, 16, 32, 64)
DEFAULT_CONTEXTS = (64, 256, 1024)
DEFAULT_REPEATS = 5


OVERHEAD_ROUNDS = 32  # plain decoding rounds timed per repeat for t_other
OVERHEAD_FORWARDS = 8  # one-slot verify forwards timed per repeat beside them
_PROBE_SPEC = SpecConfig(depth=methods_lib.DEFAULT_DEPTH)  # verify probes: greedy acceptance


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
    return tree_lib.from_parents(
        jnp.asarray(parents, jnp.int32), tokens=jnp.asarray(3 + i % 17, jnp.int32), max_depth=depth
    )


def _probe_prompt(length: int, vocab: int) -> list[int]:
    """A repetitive prompt (so an n-gram drafter finds matches), free of bos/eos."""
    return [int(3 + i % 17) % vocab for i in range(length)]


@functools.partial(jax.jit, static_argnums=0, donate_argnums=3)
def _engine_verify(
    static: step.StepStatic,
    params: dict,
    state: Any,
    cache: cache_lib.KVCache,
    tree: tree_lib.Tree,
    key: Array,
):
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
        placeholder = cache_lib.init(cfg.num_layers, 1, cfg.num_kv_heads, cfg.head_dim, self.dtype)
        # verify_and_accept reads only the cache from the state; the rest is a valid shell.
        self.state = gen.state_after_prefill(
            np.asarray(_probe_prompt(2, cfg.vocab_size), np.int32),
            placeholder,
            jnp.zeros((_PROBE_SPEC.depth + 1, 0, cfg.hidden_size), self.dtype),
            jnp.zeros((0, 0, cfg.hidden_size), self.dtype),
            None,
            None,
            _PROBE_SPEC,
            capacity=1,
            key=jax.random.key(0),
            eos_id=cfg.eos_id,
        )
        self.buffers: dict[int, cache_lib.KVCache] = {}
        self.points: dict[tuple[int, int, int], tuple[step.StepStatic, tree_lib.Tree]] = {}

    def add(self, slots: int, context: int, window: int) -> tuple[int, int, int]:
        """Register a point and run it once (compiles); returns its key."""
        cfg = self.teacher.config
        if window not in self.buffers:
            self.buffers[window] = cache_lib.init(
                cfg.num_layers, window, cfg.num_kv_heads, cfg.head_dim, self.dtype
            )
        static = step.StepStatic(
            teacher=cfg,
            drafter=None,
            spec=_PROBE_SPEC,
            window=window,
            bucketed=False,
        )
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
        out = jax.block_until_ready(
            _engine_verify(static, self.teacher.params, self.state, cache, tree, jax.random.key(0))
        )
        seconds = time.perf_counter() - start
        self.buffers[window] = out[1]
        return seconds


def measure_grid(
    teacher: gen.Teacher,
    slots: Sequence[int],
    contexts: Sequence[int],
    repeats: int,
    *,
    bar: Any = None,
) -> list[Sample]:
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
    return measure_grids({"teacher": teacher}, slots, contexts, repeats, bar=bar)["teacher"]


def measure_grids(
    teachers: Mapping[str, gen.Teacher],
    slots: Sequence[int],
    contexts: Sequence[int],
    repeats: int,
    *,
    bar: Any = None,
) -> dict[str, list[Sample]]:
    """:func:`measure_grid` for several teachers side by side (e.g. one model in two weight
    layouts): each pass times every point of every teacher once, so that a busy moment hits
    them alike. Returns name -> that teacher's samples."""
    if not teachers:
        raise ValueError("no teacher to time")
    for teacher in teachers.values():
        _check_grid(teacher.config, slots, contexts, repeats)
    timers = {name: _VerifyTimer(teacher) for name, teacher in teachers.items()}
    keys = []
    for c in contexts:
        for s in slots:
            for name, timer in timers.items():
                _phase(bar, f"compiling verify s={s} c={c}")
                keys.append((name, timer.add(s, c, engine_window(c, s, timer.teacher.config))))
                _tick(bar)
    times: dict[tuple[str, tuple[int, int, int]], list[float]] = {k: [] for k in keys}
    for r in range(repeats):
        _phase(bar, f"timing verify, pass {r + 1}/{repeats}")
        for name, point in keys:
            times[name, point].append(timers[name].time(point))
            _tick(bar)
    return {
        name: [
            Sample(
                slots=s,
                context=c,
                window=w,
                seconds=_median(times[name, (s, c, w)]),
                times=tuple(times[name, (s, c, w)]),
            )
            for owner, (s, c, w) in keys
            if owner == name
        ]
        for name in teachers
    }


def _check_grid(
    config: LlamaConfig, slots: Sequence[int], contexts: Sequence[int], repeats: int
) -> None:
    if not slots or not contexts:
        raise ValueError("the grid needs at least one slot count and one context")
    if any(s < 1 for s in slots) or any(c < 0 for c in contexts) or repeats < 1:
        raise ValueError(
            f"slots must be >= 1, contexts >= 0 and repeats >= 1; got slots "
            f"{list(slots)}, contexts {list(contexts)}, repeats {repeats}"
        )
    if max(slots) + max(contexts) > config.max_position:
        raise ValueError(
            f"{max(slots)} slots after {max(contexts)} cached tokens exceed the "
            f"teacher's context of {config.max_position}"
        )


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


def measure_overhead(
    teacher: gen.Teacher,
    *,
    context: int,
    repeats: int,
    rounds: int = OVERHEAD_ROUNDS,
    bar: Any = None,
) -> Overhead:
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
    return Overhead(
        round_seconds=_median(per_round),
        verify_seconds=_median(verify),
        context=context,
        rounds=rounds,
    )


@functools.partial(jax.jit, static_argnums=0)
def _engine_draft(
    static: step.StepStatic, draft_params: Any, state: Any, key: Array, verify_latency: Any
):
    tree, n, _ = step.propose_tree(static, draft_params, state, key, verify_latency)
    context = state.context(static.spec.draft_window)
    return tree, n, static.drafter.update(draft_params, state.drafter_state, context)


def _drafting_state(
    teacher: gen.Teacher, method: methods_lib.Method, prompt: list[int], capacity: int
) -> Any:
    """A decode state after ``prompt``, without running the teacher: a zero cache and zero
    features of the right shapes. A drafter's cost does not depend on these values (the
    n-gram drafter reads the tokens, which are real), and the teacher's prefill programs
    were a sixth of the quick calibration's compilation."""
    cfg, drafter = teacher.config, method.drafter
    dtype = teacher.params["embed"].dtype
    kv = cache_lib.init(cfg.num_layers, capacity, cfg.num_kv_heads, cfg.head_dim, dtype)
    kv = cache_lib.truncate(kv, len(prompt) - 1)
    rows = (method.spec.depth + 1, len(drafter.feature_layers), cfg.hidden_size)
    return gen.state_after_prefill(
        np.asarray(prompt, np.int32),
        kv,
        jnp.zeros(rows, dtype),
        jnp.zeros((len(prompt) - 1, *rows[1:]), dtype),
        drafter,
        method.draft_params,
        method.spec,
        capacity=capacity,
        key=jax.random.key(0),
        eos_id=cfg.eos_id,
    )


def measure_draft(
    teacher: gen.Teacher, method: methods_lib.Method, *, context: int, repeats: int, bar: Any = None
) -> float:
    """``t_draft`` of one drafter: the engine's proposal, tree shaping and drafter update
    after ``context`` committed tokens; median of ``repeats`` runs, compilation excluded.
    A drafter whose cost varies by round is timed at its highest (:func:`~eaglepangu_jax.
    engine.drafter.costliest`)."""
    method = dataclasses.replace(method, drafter=costliest(method.drafter))
    spec = method.spec
    prompt = _probe_prompt(context + 1, teacher.config.vocab_size)
    gen.validate(teacher, method.drafter, prompt, spec)
    capacity = gen.cache_slots(len(prompt), spec, teacher.config.max_position)
    state = _drafting_state(teacher, method, prompt, capacity)
    static = step.StepStatic(
        teacher=teacher.config,
        drafter=method.drafter,
        spec=spec,
        window=gen.window_for(context + spec.budget + 1, capacity),
    )
    latency = jnp.zeros((spec.budget + 1,), jnp.float32) if spec.policy == "auto" else None
    _phase(bar, f"timing drafter {method.name}")
    times = []
    for i in range(repeats + 1):
        start = time.perf_counter()
        jax.block_until_ready(
            _engine_draft(static, method.draft_params, state, jax.random.key(i), latency)
        )
        if i:  # the first call compiles
            times.append(time.perf_counter() - start)
        _tick(bar)
    return _median(times)


def calibrate_teacher(
    teacher: gen.Teacher,
    *,
    slots: Sequence[int] = DEFAULT_SLOTS,
    contexts: Sequence[int] = DEFAULT_CONTEXTS,
    repeats: int = DEFAULT_REPEATS,
    drafters: Mapping[str, methods_lib.Method] | None = None,
    peak_flops: float = methods_lib.CPU_PEAK_FLOPS,
    bandwidth: float = methods_lib.CPU_BANDWIDTH,
    bar: Any = None,
    overhead: bool = True,
) -> MachineCalibration:
    """Measure the grid, the round overhead and each drafter's cost; fit the roofline.

    Args:
      teacher: the model to calibrate.
      slots, contexts, repeats: the verify grid (see :func:`measure_grid`).
      drafters: name -> the method whose drafting cost to measure (none by default).
      peak_flops, bandwidth: nominal machine figures; the fitted slopes are relative to them.
      bar: a progress bar, see :func:`progress_total` for its length.
      overhead: measure the round overhead ``t_other`` (a compiled plain-decoding loop);
        without it ``t_other`` is 0 and the details say so. The quick calibration leaves it
        out: the engine's online cost correction learns the per-round overhead anyway (it
        scales the plain step), and the loop's compilation was a third of the quick run.

    Returns:
      The calibration (not yet saved).
    """
    drafters = dict(drafters or {})
    cfg = teacher.config
    dtype = dtype_name(teacher)
    samples = measure_grid(teacher, slots, contexts, repeats, bar=bar)
    overhead_context = min(contexts)
    measured_overhead = None
    if overhead:
        measured_overhead = measure_overhead(
            teacher,
            context=overhead_context,
            repeats=repeats,
            rounds=_overhead_rounds(cfg, overhead_context),
            bar=bar,
        )
    t_draft = {
        name: measure_draft(teacher, m, context=overhead_context, repeats=repeats, bar=bar)
        for name, m in drafters.items()
    }
    roofline = budget_lib.Roofline.for_llama(
        cfg, peak_flops=peak_flops, bandwidth=bandwidth, bytes_per_param=np.dtype(dtype).itemsize
    )
    fit = fit_samples(samples, roofline)
    return MachineCalibration(
        teacher=teacher_fingerprint(cfg, dtype),
        teacher_config=dataclasses.asdict(cfg),
        dtype=dtype,
        machine=describe_machine(),
        date=timestamp(),
        peak_flops=float(peak_flops),
        bandwidth=float(bandwidth),
        bytes_per_param=float(roofline.bytes_per_param),
        **{k: float(getattr(fit, k)) for k in FIT_KEYS},
        samples=tuple(samples),
        t_other=measured_overhead.t_other if measured_overhead else 0.0,
        t_draft=t_draft,
        details={
            "repeats": repeats,
            # The verify cost of >= llama.TRANSPOSED_MIN_ROWS slots depends on it (.layout).
            "transposed_copy": llama.has_transposed_copy(teacher.params),
            "overhead": (
                dataclasses.asdict(measured_overhead)
                if measured_overhead
                else "not measured (quick calibration: corrected online)"
            ),
            "drafters": {
                name: {
                    "context": overhead_context,
                    "policy": m.spec.policy,
                    "budget": m.spec.budget,
                    "depth": m.spec.depth,
                }
                for name, m in drafters.items()
            },
        },
    )


def _overhead_rounds(config: LlamaConfig, context: int) -> int:
    """As many as :data:`OVERHEAD_ROUNDS` plain rounds as fit the teacher's context."""
    spare = (
        config.max_position
        - gen.needed_slots(context + 1, SpecConfig(budget=1, depth=1, max_new_tokens=1))
        + 1
    )
    return max(1, min(OVERHEAD_ROUNDS, spare))


def progress_total(num_points: int, repeats: int, num_drafters: int, overhead: bool = True) -> int:
    """Progress steps of :func:`calibrate_teacher`: every compile and every timed call."""
    loop = 2 * (1 + repeats) if overhead else 0
    return num_points * (1 + repeats) + loop + num_drafters * (1 + repeats)
