"""Side-by-side decoding benchmark: every method on the same turns, on the same teacher.

For each user turn the methods run one after another (greedy first: it is the reference), so a
change of machine load hits them all alike. Later turns of a conversation follow the *greedy*
answers, so every method sees the same prompt. Per turn and method we record the throughput,
the accepted length (emitted tokens / verify rounds, bonus included) and whether the output is
identical to greedy; for a divergence, its index and the teacher's top-2 logit gap there
(computed along the greedy sequence): in float32, lossless methods should only diverge at
near-ties.

Compilation is kept out of the timings: a warm-up generation per method runs first, and a turn
whose decoding compiled anything (new shapes) is run again and the second run is recorded; the
discarded time is reported as ``compile_seconds``, and the warm-up's own compile work as
``warmup_compile_seconds``. (``prefill_seconds`` may still include compilation: it is
reported, not used.)
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from eaglepangu_jax.calibration.curve import method_costs
from eaglepangu_jax.engine.compile_watch import CompileWatch
from eaglepangu_jax.engine.decode import GenerationResult, Teacher, generate
from eaglepangu_jax.evaluation.report import summarize_turns
from eaglepangu_jax.evaluation.suites import Conversation, count_turns
from eaglepangu_jax.methods.registry import REFERENCE, Method
from eaglepangu_jax.models import llama
from eaglepangu_jax.models.chat import Renderer
from eaglepangu_jax.models.config import LlamaConfig

__all__ = [
    "CompileWatch",
    "generate_with",
    "run_method",
    "first_divergence",
    "near_tie_gaps",
    "check_prompts",
    "mapping_pressure",
    "run_bench",
]

MAX_RUNS = 3  # generations per turn and method at most (see run_method)
# XLA's CPU JIT maps each compiled module's sections separately; a bench holding many methods'
# programs (plus recompiles for a larger cache) can reach the kernel's per-process mapping
# limit and abort ("Unable to allocate section memory"). Past this share of the limit the
# bench drops its compiled programs between turns (they come back from the compile cache).
MAPPING_SHARE = 0.75


def generate_with(teacher: Teacher, method: Method, prompt_ids: Sequence[int]) -> GenerationResult:
    """One generation with ``method``: its peer runner, or the JAX engine on ``teacher``."""
    if method.runner is not None:
        eos_id = teacher.config.eos_id if method.spec.eos_id is None else method.spec.eos_id
        return method.runner(prompt_ids, method.spec, eos_id=eos_id)
    verify_latency, draft_seconds = method_costs(teacher.config, method, len(prompt_ids))
    return generate(
        teacher,
        method.drafter,
        prompt_ids,
        method.spec,
        draft_params=method.draft_params,
        verify_latency=verify_latency,
        draft_seconds=draft_seconds,
        correction=method.correction,
    )


def run_method(
    teacher: Teacher, method: Method, prompt_ids: Sequence[int]
) -> tuple[GenerationResult, float]:
    """Generate with ``method``; a run that compiled is discarded and run again.

    Returns:
      The recorded result and the wall seconds of discarded (compiling) runs. After
      ``MAX_RUNS`` runs the last one is kept even if it compiled (something recompiles every
      time: a bug to look for, not a reason to loop forever). A peer compiles no JAX: its
      first run is kept.
    """
    discarded = 0.0
    for attempt in range(MAX_RUNS):
        watch = CompileWatch()
        start = time.perf_counter()
        with watch.active():
            result = generate_with(teacher, method, prompt_ids)
        # Only compilation inside the decode time (after the prefill) spoils the figures.
        if not watch.seconds_after(start + result.stats.prefill_seconds) or attempt == MAX_RUNS - 1:
            return result, discarded
        discarded += time.perf_counter() - start
    raise AssertionError("unreachable")


def mapping_pressure() -> float | None:
    """This process's memory mappings as a share of the kernel's per-process limit
    (``vm.max_map_count``); ``None`` where ``/proc`` does not tell (not Linux)."""
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            limit = int(f.read())
        with open("/proc/self/maps") as f:
            used = sum(1 for _ in f)
    except (OSError, ValueError):
        return None
    return used / limit if limit > 0 else None


# ----------------------------------------------------------------------------- divergence


def first_divergence(reference: Sequence[int], tokens: Sequence[int]) -> int | None:
    """First index where ``tokens`` differs from ``reference`` (``None`` if identical)."""
    for i, (a, b) in enumerate(zip(reference, tokens)):
        if a != b:
            return i
    if len(reference) != len(tokens):
        return min(len(reference), len(tokens))
    return None


@functools.partial(jax.jit, static_argnames="config")
def _sequence_logits(params: dict, tokens: jax.Array, *, config: LlamaConfig) -> jax.Array:
    return llama.forward_sequence(params, tokens, config=config)[0]


def near_tie_gaps(
    teacher: Teacher, prompt_ids: Sequence[int], greedy: Sequence[int], indices: Sequence[int]
) -> dict[int, float | None]:
    """Teacher top-1 minus top-2 logit before greedy token ``i``, for each ``i`` in
    ``indices``, from one causal forward over ``prompt + greedy`` (``None`` past its end)."""
    wanted = sorted({i for i in indices if 0 <= i < len(greedy)})
    gaps: dict[int, float | None] = {i: None for i in indices}
    if not wanted:
        return gaps
    sequence = list(prompt_ids) + list(greedy)
    # Padded to a multiple of 128 so sequences of similar length share one compilation; the
    # padding comes after every row we read, so causality keeps it out of them.
    padded = np.zeros((-(-len(sequence) // 128) * 128,), np.int32)
    padded[: len(sequence)] = sequence
    logits = _sequence_logits(teacher.params, jnp.asarray(padded), config=teacher.config)
    rows = np.asarray(logits[np.asarray([len(prompt_ids) - 1 + i for i in wanted])])
    top2 = np.sort(rows, axis=-1)[:, -2:]
    for i, (second, first) in zip(wanted, top2):
        gaps[i] = float(first - second)
    return gaps


# ----------------------------------------------------------------------------- the run


def _turn_record(
    result: GenerationResult, compile_seconds: float, per_round: bool = False
) -> dict[str, Any]:
    stats = result.stats
    rounds = {}
    if per_round:  # what the controller chose and what it got, round by round
        rounds = {
            "accepted_per_round": list(stats.accepted_per_round),
            "nodes_per_round": list(stats.nodes_per_round),
        }
    return {
        "new_tokens": stats.new_tokens,
        "seconds": stats.seconds,
        "tokens_per_s": _finite(stats.tokens_per_s),
        "rounds": stats.rounds,
        # Rounds that verified a tree (the rest were plain one-token steps).
        "speculated_rounds": sum(1 for n in stats.nodes_per_round if n > 0),
        "accepted_length": stats.accepted_length,
        "prefill_seconds": stats.prefill_seconds,
        "compile_seconds": compile_seconds,
        **rounds,
    }


def _finite(x: float) -> float | None:
    return float(x) if math.isfinite(x) else None


def check_prompts(
    conversations: Sequence[Conversation],
    renderer: Renderer,
    config: LlamaConfig,
    max_new_tokens: int,
) -> None:
    """Fail before any work if an opening turn cannot fit the teacher's context."""
    for c in conversations:
        n = len(renderer.encode([{"role": "user", "content": c.turns[0]}]))
        if n + max_new_tokens > config.max_position:
            raise ValueError(
                f"conversation {c.id!r}: the first prompt has {n} tokens; with "
                f"{max_new_tokens} new tokens it exceeds the teacher's context "
                f"of {config.max_position}"
            )


def run_bench(
    teacher: Teacher,
    conversations: Sequence[Conversation],
    methods: Sequence[Method],
    renderer: Renderer,
    *,
    progress: bool = True,
    per_round: bool = False,
) -> dict[str, Any]:
    """Run every method on every turn, interleaved per turn, greedy first.

    Args:
      teacher: the verifying model (injected, so tests can use a tiny random one).
      conversations: the prompts; later turns follow the greedy answers.
      methods: greedy first (see :func:`parse_methods`, :func:`make_method`).
      renderer: prompt encoding and answer decoding.
      progress: show a progress bar (stderr) with the running accepted lengths.
      per_round: also record each turn's accepted draft tokens and verified nodes per round
        (``accepted_per_round``, ``nodes_per_round``; a plain round verified 0 nodes).

    Returns:
      The report: ``methods`` (settings), ``warmup_seconds`` (wall, one generation
      included), ``warmup_compile_seconds`` (the compile work within it, from
      :class:`CompileWatch`), ``cache_clears`` (indices of the turns before which the
      compiled programs were dropped, see :data:`MAPPING_SHARE`), ``turns`` and ``summary``
      (see :func:`summarize_turns`); JSON-ready.
    """
    if not methods or methods[0].name != REFERENCE:
        raise ValueError(f"the first method must be {REFERENCE!r} (the reference)")
    if not conversations:
        raise ValueError("no conversations to benchmark")
    check_prompts(
        conversations, renderer, teacher.config, max(m.spec.max_new_tokens for m in methods)
    )
    first = renderer.encode([{"role": "user", "content": conversations[0].turns[0]}])
    warmup, warmup_compile = {}, {}
    for method in methods:
        watch = CompileWatch()
        start = time.perf_counter()
        with watch.active():
            generate_with(teacher, method, first)
        warmup[method.name] = time.perf_counter() - start
        # The warm-up is where most compiling happens; its wall time also holds one
        # generation, so the compile work itself is recorded apart.
        warmup_compile[method.name] = watch.seconds
    turns, cache_clears = [], []
    with _progress_bar(count_turns(conversations), progress) as bar:
        for conversation in conversations:
            history: list[dict[str, str]] = []
            for index, text in enumerate(conversation.turns):
                pressure = mapping_pressure()
                if pressure is not None and pressure > MAPPING_SHARE:
                    # A run that then reloads a program counts as compiling and is re-run
                    # (run_method), so the timings stay clean.
                    jax.clear_caches()
                    cache_clears.append(len(turns))
                history.append({"role": "user", "content": text})
                record, greedy_tokens = _run_turn(
                    teacher, methods, renderer.encode(history), per_round
                )
                record = {
                    "conversation_id": conversation.id,
                    "category": conversation.category,
                    "turn_index": index,
                    **record,
                }
                turns.append(record)
                history.append({"role": "assistant", "content": renderer.decode(greedy_tokens)})
                _advance(bar, turns, methods)
    return {
        "methods": {m.name: _describe(m) for m in methods},
        "warmup_seconds": warmup,
        "warmup_compile_seconds": warmup_compile,
        "cache_clears": cache_clears,
        "turns": turns,
        "summary": summarize_turns(turns, [m.name for m in methods]),
    }


def _run_turn(
    teacher: Teacher, methods: Sequence[Method], prompt_ids: list[int], per_round: bool = False
) -> tuple[dict[str, Any], list[int]]:
    results, records = {}, {}
    for method in methods:
        result, compile_seconds = run_method(teacher, method, prompt_ids)
        results[method.name] = result
        records[method.name] = _turn_record(result, compile_seconds, per_round)
        if method.correction is not None:
            # The controller's cost scales after this turn: how they move turn by turn is
            # what explains a method that starts drafting in every round (docs/RESULTS.md).
            records[method.name]["cost_correction"] = method.correction.describe()
    greedy = results[REFERENCE].tokens
    divergence = {name: first_divergence(greedy, r.tokens) for name, r in results.items()}
    gaps = near_tie_gaps(
        teacher, prompt_ids, greedy, [i for i in divergence.values() if i is not None]
    )
    greedy_tps = records[REFERENCE]["tokens_per_s"]
    for name, record in records.items():
        index = divergence[name]
        record["identical_to_greedy"] = index is None
        record["divergence_index"] = index
        record["near_tie_gap"] = gaps[index] if index is not None else None
        tps = record["tokens_per_s"]
        record["speedup"] = tps / greedy_tps if tps is not None and greedy_tps else None
    return {"prompt_tokens": len(prompt_ids), "methods": records}, greedy


def _describe(method: Method) -> dict[str, Any]:
    return {
        "drafter": repr(method.drafter) if method.drafter is not None else None,
        "runner": method.runner.describe() if method.runner is not None else None,
        "spec": dataclasses.asdict(method.spec),
        "cost_correction": method.correction.describe() if method.correction else None,
    }


@contextlib.contextmanager
def _progress_bar(total: int, enabled: bool):
    from tqdm import tqdm

    bar = tqdm(total=total, unit="turn", desc="bench", disable=not enabled, dynamic_ncols=True)
    try:
        yield bar
    finally:
        bar.close()


def _advance(bar, turns: list[dict[str, Any]], methods: Sequence[Method]) -> None:
    running = {}
    for method in methods[1:]:
        tokens = sum(t["methods"][method.name]["new_tokens"] for t in turns)
        rounds = sum(t["methods"][method.name]["rounds"] for t in turns)
        running[method.name] = f"{tokens / rounds:.2f}" if rounds else "-"
    bar.set_postfix({f"acc[{k}]": v for k, v in running.items()}, refresh=False)
    bar.update(1)
