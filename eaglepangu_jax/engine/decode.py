"""``generate``: speculative (or plain) decoding of one or several prompts.

The host validates everything before any work, prefills, then hands the loop to the device:
rounds run inside ``lax.while_loop`` (:func:`~eaglepangu_jax.engine.step.run_rounds`) within an
attention window ``W`` (a power of two, static), and the host only steps in to move to a wider
window when the sequence outgrows it: ``log2`` of the length host round trips in all, one
compilation per window size. ``drafter=None`` is plain decoding through the same step (a tree
of padding under the root), so both are counted the same way.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from eaglepangu_jax import budget as budget_lib
from eaglepangu_jax import cache as cache_lib
from eaglepangu_jax import draft_control, mode
from eaglepangu_jax import mask as mask_lib
from eaglepangu_jax.engine.compile_watch import CompileWatch
from eaglepangu_jax.engine.config import SpecConfig
from eaglepangu_jax.engine.costs import CostCorrection, segment_costs
from eaglepangu_jax.engine.drafter import fit_budget
from eaglepangu_jax.engine.result import (
    GenerationResult,
    GenerationStats,
    finish_tokens,
    result_from_state,
)
from eaglepangu_jax.engine.state import DecodeState
from eaglepangu_jax.engine.step import StepStatic, feature_rows, run_rounds, run_rounds_batched
from eaglepangu_jax.models import llama
from eaglepangu_jax.models.config import LlamaConfig

__all__ = [
    "MIN_WINDOW",
    "Teacher",
    "GenerationStats",
    "GenerationResult",
    "window_for",
    "CAPACITY_BUCKET",
    "needed_slots",
    "cache_slots",
    "validate",
    "PREFILL_CHUNK",
    "prefill",
    "init_state",
    "eos_id_of",
    "nominal_verify_latency",
    "state_after_prefill",
    "speculation_hopeless",
    "drafter_to_run",
    "finish_tokens",
    "result_from_state",
    "generate",
    "generate_batch",
]

MIN_WINDOW = 256


@dataclasses.dataclass(frozen=True)
class Teacher:
    """A teacher model: static config plus its parameter pytree.

    The parameters are converted once to the forward's prepared layout (per-layer arrays,
    an ``[H, V]`` output head): with stacked layers XLA copies every layer's weights each
    step, which made decoding about 2x slower. Unless ``transposed_copy`` is False they also
    get the ``[out, in]`` weight copies that full verify trees multiply (see
    :func:`llama.prepare_params`). Without them the teacher holds one copy of its weights
    (half the memory). Which layout verifies faster depends on the CPU:
    ``runtime.load_teacher()`` times both once per machine and keeps the faster
    (``calibration.layout``); the calibration records the layout it measured.
    """

    config: LlamaConfig
    params: dict
    transposed_copy: bool = True

    def __post_init__(self):
        if "layers" in self.params:  # an empty dict stands for "config only" (validation)
            prepared = llama.prepare_params(self.params, transposed_copy=self.transposed_copy)
            if not self.transposed_copy:
                prepared = llama.without_transposed_copy(prepared)
            object.__setattr__(self, "params", prepared)


def window_for(needed: int, capacity: int) -> int:
    """Smallest power-of-two window >= ``needed`` (at least ``MIN_WINDOW``), capped."""
    w = MIN_WINDOW
    while w < needed:
        w *= 2
    return min(w, capacity)


# Two windows' worth: a short prompt and a longer one (a HumanEval turn of ~180 tokens plus
# 96 new ones) then share one cache shape, so the longer one reuses every program compiled at
# the 256-slot window and compiles only the 512-slot one. With 256 the two shapes differed and
# each recompiled everything. The unused slots cost memory only: the loop reads the window.
CAPACITY_BUCKET = 512


def needed_slots(prompt_len: int, spec: SpecConfig) -> int:
    """Positions a generation may touch: prompt, new tokens, one tree, the emitted overshoot."""
    return prompt_len + spec.max_new_tokens + spec.budget + spec.depth + 2


def cache_slots(prompt_len: int, spec: SpecConfig, max_position: int | None = None) -> int:
    """Cache slots to allocate: :func:`needed_slots` rounded up to a multiple of
    ``CAPACITY_BUCKET`` (so prompts of similar length share one compiled loop), never below
    whole prefill chunks, and not rounded past ``max_position``."""
    need = needed_slots(prompt_len, spec)
    bucketed = -(-need // CAPACITY_BUCKET) * CAPACITY_BUCKET
    if max_position is not None:
        bucketed = min(bucketed, max(need, max_position))
    return max(bucketed, -(-prompt_len // PREFILL_CHUNK) * PREFILL_CHUNK)


def validate(teacher: Teacher, drafter: Any, prompt_ids: Sequence[int], spec: SpecConfig) -> None:
    """All the checks that must pass before any work starts, with the numbers in the message."""
    cfg = teacher.config
    if len(prompt_ids) == 0:
        raise ValueError("the prompt is empty: at least one token is needed")
    bad = [t for t in prompt_ids if not 0 <= int(t) < cfg.vocab_size]
    if bad:
        raise ValueError(
            f"prompt token ids {bad[:5]} are outside the vocabulary [0, {cfg.vocab_size})"
        )
    if len(prompt_ids) > cfg.max_position:
        raise ValueError(
            f"the prompt has {len(prompt_ids)} tokens, longer than the teacher's "
            f"context of {cfg.max_position}"
        )
    total = needed_slots(len(prompt_ids), spec)
    if total > cfg.max_position:
        raise ValueError(
            f"prompt ({len(prompt_ids)}) + max_new_tokens ({spec.max_new_tokens}) + tree "
            f"budget ({spec.budget}) + depth ({spec.depth}) needs {total} positions, more than "
            f"the teacher's context of {cfg.max_position}"
        )
    if drafter is not None:
        if spec.depth > drafter.max_depth:
            raise ValueError(
                f"depth {spec.depth} is above the drafter's maximum {drafter.max_depth}"
            )
        for layer in drafter.feature_layers:
            if not 0 <= layer < cfg.num_layers:
                raise ValueError(
                    f"drafter wants teacher layer {layer}, the teacher has {cfg.num_layers}"
                )


PREFILL_CHUNK = 64


@jax.jit(static_argnames=("config", "feature_layers", "window"), donate_argnames=("kv",))
def _prefill_chunk(params, tokens, kv, *, config, feature_layers, window):
    start = kv.length
    positions = start + jnp.arange(tokens.shape[0], dtype=jnp.int32)
    attend = mask_lib.causal_mask(tokens.shape[0], start, window)
    _, feats, kv = llama.forward(
        params, tokens, positions, kv, attend, config=config, feature_layers=feature_layers
    )
    return cache_lib.advance(kv, tokens.shape[0]), feats


def prefill(
    params: dict,
    config: LlamaConfig,
    prompt: np.ndarray,
    kv: cache_lib.KVCache,
    *,
    feature_layers: tuple[int, ...] = (),
) -> tuple[cache_lib.KVCache, jax.Array]:
    """Feed ``prompt`` in fixed-size chunks (one compilation per window) and commit it.

    Returns the cache and the tapped features of every prompt token ``[P, F, H]``. The last
    chunk is padded to the chunk size; its padding is written past the committed length and
    never attended (it is overwritten by the next forward).
    """
    feats = []
    for begin in range(0, len(prompt), PREFILL_CHUNK):
        chunk = prompt[begin : begin + PREFILL_CHUNK]
        real = len(chunk)
        padded = np.zeros((PREFILL_CHUNK,), np.int32)
        padded[:real] = chunk
        window = window_for(begin + PREFILL_CHUNK, kv.num_slots)
        if begin + PREFILL_CHUNK > kv.num_slots:
            raise ValueError(
                f"prefill chunk ends at {begin + PREFILL_CHUNK}, past the cache's "
                f"{kv.num_slots} slots"
            )
        kv, f = _prefill_chunk(
            params,
            jnp.asarray(padded),
            kv,
            config=config,
            feature_layers=tuple(feature_layers),
            window=window,
        )
        kv = cache_lib.truncate(kv, begin + real)
        # Cut on the host: a device slice or concatenation of a prompt-length shape compiles
        # once per prompt length (dozens of small compilations per new prompt).
        feats.append(np.asarray(f)[:real])
    return kv, jnp.asarray(np.concatenate(feats, axis=0))


def init_state(
    teacher: Teacher,
    drafter: Any,
    draft_params: Any,
    prompt_ids: Sequence[int],
    spec: SpecConfig,
    *,
    capacity: int,
    key: jax.Array,
) -> DecodeState:
    """Prefill ``prompt[:-1]`` and build the state whose root is the prompt's last token."""
    cfg = teacher.config
    prompt = np.asarray(prompt_ids, np.int32)
    n_feat = len(drafter.feature_layers) if drafter is not None else 0
    kv = cache_lib.init(
        cfg.num_layers, capacity, cfg.num_kv_heads, cfg.head_dim, teacher.params["embed"].dtype
    )
    features = jnp.zeros((spec.depth + 1, n_feat, cfg.hidden_size), teacher.params["embed"].dtype)
    prefill_features = features[:0]
    if len(prompt) > 1:
        kv, prefill_features = prefill(
            teacher.params,
            cfg,
            prompt[:-1],
            kv,
            feature_layers=drafter.feature_layers if drafter is not None else (),
        )
    return state_after_prefill(
        prompt,
        kv,
        features,
        prefill_features,
        drafter,
        draft_params,
        spec,
        capacity=capacity,
        key=key,
        eos_id=eos_id_of(teacher, spec),
    )


def eos_id_of(teacher: Teacher, spec: SpecConfig) -> int:
    """The stop token: ``spec.eos_id``, else the teacher's."""
    return teacher.config.eos_id if spec.eos_id is None else spec.eos_id


def nominal_verify_latency(config: LlamaConfig, spec: SpecConfig, context: int) -> jax.Array:
    """The uncalibrated roofline's ``[budget + 1]`` verify-latency curve (no overheads), what
    the ``"auto"`` policy uses when no curve is given. A calibrated curve
    (:mod:`eaglepangu_jax.calibration`) is better: this one only knows the nominal machine."""
    roofline = budget_lib.Roofline.for_llama(
        config, peak_flops=budget_lib.NOMINAL_PEAK_FLOPS, bandwidth=budget_lib.NOMINAL_BANDWIDTH
    )
    return budget_lib.verify_latencies(
        roofline, budget_lib.Calibration.ideal(), context, max_nodes=spec.budget
    )


def state_after_prefill(
    prompt: np.ndarray,
    cache: Any,
    features: jax.Array,
    prefill_features: jax.Array,
    drafter: Any,
    draft_params: Any,
    spec: SpecConfig,
    *,
    capacity: int,
    key: jax.Array,
    eos_id: int,
) -> DecodeState:
    """The state whose root is the prompt's last token, ``prompt[:-1]`` already prefilled.

    Args:
      prompt: the prompt ids.
      cache: the teacher's cache after the prefill (any backend's; kept as given).
      features: ``[D + 1, F, H]`` zeros: the feature buffer's row shape and dtype (it is
        sized by :func:`eaglepangu_jax.engine.step.feature_rows`).
      prefill_features: ``[P - 1, F, H]`` teacher features of the prefilled tokens.
    """
    controlled = drafter is not None and spec.policy == "auto"
    control = spec.control
    # The drafter consumes every prompt feature in init_state below: nothing is pending.
    rows = feature_rows(spec, controlled, control)
    features = jnp.zeros((rows, *features.shape[1:]), features.dtype)
    buffer = np.zeros((capacity + spec.depth + 2,), np.int32)
    buffer[: len(prompt)] = prompt
    # One log entry per round; sized by the (bucketed) capacity, not max_new_tokens, so that
    # a new max_new_tokens keeps the compiled loop's shapes.
    rounds_cap = capacity + 1
    state = DecodeState(
        tokens=jnp.asarray(buffer),
        num_tokens=jnp.int32(len(prompt)),
        prompt_len=jnp.int32(len(prompt)),
        cache=cache,
        features=features,
        num_features=jnp.int32(0),
        drafter_state=None,
        key=key,
        rounds=jnp.int32(0),
        done=jnp.bool_(False),
        accepted_log=jnp.full((rounds_cap,), -1, jnp.int32),
        nodes_log=jnp.full((rounds_cap,), -1, jnp.int32),
        temperature=jnp.float32(spec.temperature),
        top_p=jnp.float32(spec.top_p),
        eos_id=jnp.int32(eos_id),
        max_new_tokens=jnp.int32(spec.max_new_tokens),
        control=(draft_control.AcceptanceStats.create(control) if controlled else None),
    )
    if drafter is not None:
        # The drafter's own cache is built from the features of the *whole* prompt (EAGLE
        # heads need long-range context), not only the last depth + 1 rows the loop carries.
        context = state.context(spec.draft_window)
        rows = prefill_features.shape[0]
        if rows > 0:  # a one-token prompt has none
            # Padded to a power of two (>= 64 rows; the drafters read only ``num_features``)
            # so that the jitted init compiles once per bucket, not once per prompt length.
            padded = np.zeros((_feature_bucket(rows), *prefill_features.shape[1:]))
            padded = padded.astype(prefill_features.dtype)
            padded[:rows] = np.asarray(prefill_features)
            context = dataclasses.replace(
                context, features=jnp.asarray(padded), num_features=jnp.int32(rows)
            )
        state = dataclasses.replace(
            state, drafter_state=_init_drafter(drafter, draft_params, context)
        )
    return state


def _feature_bucket(rows: int) -> int:
    bucket = PREFILL_CHUNK
    while bucket < rows:
        bucket *= 2
    return bucket


@jax.jit(static_argnums=0)
def _init_drafter(drafter: Any, draft_params: Any, context: Any) -> Any:
    return drafter.init_state(draft_params, context)


_run = jax.jit(run_rounds, static_argnums=(0,), donate_argnums=(3,))
_run_batched = jax.jit(run_rounds_batched, static_argnums=(0,), donate_argnums=(3,))


def _shapes(tree: Any) -> tuple:
    """Shapes and dtypes of a pytree's leaves (what, besides the static key, selects a
    compiled program)."""
    return tuple((tuple(x.shape), str(x.dtype)) for x in jax.tree_util.tree_leaves(tree))


def speculation_hopeless(spec: SpecConfig, verify_latency: Any, draft_seconds: float) -> bool:
    """True when the ``"auto"`` controller would decode plainly from the start: the costs are
    known (finite) and even an oracle drafter, every node accepted, would emit fewer tokens
    per second than plain decoding (:func:`eaglepangu_jax.draft_control.oracle_pays`).
    :func:`generate` then never runs the drafter: not its proposals, which could not pay,
    and not its prefill and per-round updates either, which for a draft model (the truncated
    teacher) cost about a teacher forward per token and alone made it lose 17%."""
    if spec.policy != "auto" or verify_latency is None:
        return False
    latency = np.asarray(verify_latency, np.float32)
    if not (np.all(np.isfinite(latency)) and np.isfinite(draft_seconds)):
        return False  # unknown costs: the controller's probes decide
    return not bool(draft_control.oracle_pays(spec.depth, latency, draft_seconds))


def drafter_to_run(
    drafter: Any, draft_params: Any, spec: SpecConfig, verify_latency: Any, draft_seconds: float
) -> tuple[Any, Any]:
    """``(drafter, draft_params)``, or ``(None, None)`` (plain decoding) when
    :func:`speculation_hopeless`: what every entry point runs, before it prefills."""
    if drafter is not None and speculation_hopeless(spec, verify_latency, draft_seconds):
        return None, None
    return drafter, draft_params


def decode_loop(
    teacher,
    drafter,
    draft_params,
    state,
    spec,
    capacity,
    batched,
    verify_latency=None,
    draft_seconds=0.0,
    correction: CostCorrection | None = None,
    observe_plain: bool = False,
):
    """Drive the device loop through growing attention windows until every sequence stops.

    With a ``correction`` (policy ``"auto"``, one sequence), each segment runs on the curve
    as corrected for its attention window, and its measured time is added to that window's
    fit (:mod:`.costs`). ``observe_plain``: the caller dropped the drafter because the
    corrected costs said it could not pay (:func:`generate`); the plain segments are then
    still added, so that the speculative evidence behind that verdict ages as while any
    other run of plain rounds (otherwise one bad estimate would stop drafting for good)."""
    need = 1 if drafter is None else spec.budget + 1
    controlled = drafter is not None and spec.policy == "auto"
    if controlled and verify_latency is None:
        context = int(np.max(np.asarray(state.cache.length)))
        verify_latency = nominal_verify_latency(teacher.config, spec, context)
    observing = observe_plain and drafter is None and verify_latency is not None
    if not (controlled or observing) or batched:
        correction = None
    base_latency = None if verify_latency is None else np.asarray(verify_latency, np.float32)
    while True:
        length = int(np.max(np.asarray(state.cache.length)))
        done = np.asarray(state.done)
        if bool(np.all(done)) or length + need > capacity:
            return state
        window = window_for(length + need, capacity)
        static = StepStatic(
            teacher=teacher.config,
            drafter=drafter,
            spec=spec,
            window=window,
            bucketed=not batched,
        )
        latency, t_draft = base_latency, float(draft_seconds)
        if correction is not None:
            latency, t_draft = correction.apply(base_latency, t_draft, window)
            # The loop compiles per static key *and* per input shape: a longer prompt's larger
            # cache recompiles a window seen before, and timing that segment would charge
            # the compilation to its rounds.
            compiling = correction.first_run((static, _shapes(state)))
            first_round, start = int(state.rounds), time.perf_counter()
        # Reference mode: the invariant checks traced into the step raise on the host.
        runner = mode.checked(_run_batched if batched else _run)
        # Anything compiled (or read back from the compile cache) while the segment runs is in
        # its time too, also when the loop's key was seen before (programs dropped and
        # reloaded, a helper traced for a new shape): such a segment is not observed either.
        watch = CompileWatch()
        with watch.active() if correction is not None else contextlib.nullcontext():
            state = runner(
                static,
                teacher.params,
                draft_params,
                state,
                jnp.int32(window),
                None if latency is None else jnp.asarray(latency, jnp.float32),
                jnp.float32(t_draft),
            )
            if correction is not None:
                last_round = int(state.rounds)  # waits for the segment to finish
        if correction is not None:
            elapsed = time.perf_counter() - start
            if not compiling and not watch.events:
                plain, spec_s = segment_costs(
                    np.asarray(state.nodes_log),
                    first_round,
                    last_round,
                    base_latency,
                    float(draft_seconds),
                )
                correction.observe(plain, spec_s, elapsed, window)


def generate(
    teacher: Teacher,
    drafter: Any,
    prompt_ids: Sequence[int],
    spec: SpecConfig,
    *,
    draft_params: Any = None,
    verify_latency: Any = None,
    draft_seconds: float = 0.0,
    stream: int = 0,
    correction: CostCorrection | None = None,
) -> GenerationResult:
    """Generate a continuation of ``prompt_ids`` (a list of token ids).

    Args:
      teacher: the verifying model.
      drafter: a :class:`~eaglepangu_jax.engine.drafter.Drafter`, or ``None`` for plain
        decoding counted the same way (one round per token).
      prompt_ids: the prompt, at least one token.
      spec: the run's settings.
      draft_params: the drafter's weights (``None`` for training-free drafters).
      verify_latency: ``[budget + 1]`` predicted seconds of a round verifying the root plus
        ``n`` nodes, drafting excluded, for the ``"auto"`` policy (default: the nominal
        roofline, :func:`nominal_verify_latency`; calibrated curves come from
        :mod:`eaglepangu_jax.calibration`).
      draft_seconds: predicted seconds the drafter takes per round (``"auto"``). When these
        costs say that even an oracle drafter could not pay, the call decodes plainly and
        the drafter never runs (:func:`speculation_hopeless`).
      stream: random stream index: the PRNG key is ``fold_in(key(spec.seed), stream)``;
        sequence ``i`` of :func:`generate_batch` uses stream ``i``.
      correction: under ``"auto"``, the :class:`~eaglepangu_jax.engine.costs.CostCorrection`
        that scales ``verify_latency`` and ``draft_seconds`` and learns from this call's
        segment times (keep one per method across calls). Tokens do not depend on it under
        greedy acceptance; speed does.

    Returns:
      The new tokens (cut after eos and at ``max_new_tokens``) and statistics. The
      accepted length counts verify rounds, the bonus token included.
    """
    spec = fit_budget(spec, drafter)
    validate(teacher, drafter, prompt_ids, spec)
    eos_id = eos_id_of(teacher, spec)
    capacity = cache_slots(len(prompt_ids), spec, teacher.config.max_position)
    observe_plain = False
    if drafter is not None and verify_latency is not None:
        latency, t_draft = np.asarray(verify_latency, np.float32), float(draft_seconds)
        if correction is not None:  # the costs the first segment would run on
            window = window_for(len(prompt_ids) + spec.budget + 1, capacity)
            latency, t_draft = correction.apply(latency, t_draft, window)
        drafter, draft_params = drafter_to_run(drafter, draft_params, spec, latency, t_draft)
        # Dropped on the corrected costs alone: the correction keeps learning from the plain
        # rounds, or it would never see the evidence that could lift the verdict.
        observe_plain = (
            drafter is None
            and correction is not None
            and not speculation_hopeless(spec, verify_latency, draft_seconds)
        )
    t0 = time.perf_counter()
    state = init_state(
        teacher,
        drafter,
        draft_params,
        prompt_ids,
        spec,
        capacity=capacity,
        key=jax.random.fold_in(jax.random.key(spec.seed), stream),
    )
    jax.block_until_ready(state)
    t1 = time.perf_counter()
    state = decode_loop(
        teacher,
        drafter,
        draft_params,
        state,
        spec,
        capacity,
        batched=False,
        verify_latency=verify_latency,
        draft_seconds=draft_seconds,
        correction=correction,
        observe_plain=observe_plain,
    )
    jax.block_until_ready(state)
    t2 = time.perf_counter()
    return result_from_state(
        state, len(prompt_ids), spec, eos_id, seconds=t2 - t1, prefill_seconds=t1 - t0
    )


def generate_batch(
    teacher: Teacher,
    drafter: Any,
    prompts: Sequence[Sequence[int]],
    spec: SpecConfig,
    *,
    draft_params: Any = None,
    verify_latency: Any = None,
    draft_seconds: float = 0.0,
) -> list[GenerationResult]:
    """Generate for several prompts at once (``vmap``): each sequence keeps its own tree,
    committed length and stopping point; results equal per-prompt :func:`generate` calls.
    Timings are for the whole batch."""
    if not prompts:
        raise ValueError("no prompts given")
    spec = fit_budget(spec, drafter)
    for p in prompts:
        validate(teacher, drafter, p, spec)
    drafter, draft_params = drafter_to_run(
        drafter, draft_params, spec, verify_latency, draft_seconds
    )
    eos_id = eos_id_of(teacher, spec)
    capacity = max(cache_slots(len(p), spec, teacher.config.max_position) for p in prompts)
    t0 = time.perf_counter()
    states = [
        init_state(
            teacher,
            drafter,
            draft_params,
            p,
            spec,
            capacity=capacity,
            key=jax.random.fold_in(jax.random.key(spec.seed), i),
        )
        for i, p in enumerate(prompts)
    ]
    state = jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *states)
    jax.block_until_ready(state)
    t1 = time.perf_counter()
    state = decode_loop(
        teacher,
        drafter,
        draft_params,
        state,
        spec,
        capacity,
        batched=True,
        verify_latency=verify_latency,
        draft_seconds=draft_seconds,
    )
    jax.block_until_ready(state)
    t2 = time.perf_counter()
    return [
        result_from_state(
            state, len(p), spec, eos_id, seconds=t2 - t1, prefill_seconds=t1 - t0, index=i
        )
        for i, p in enumerate(prompts)
    ]
