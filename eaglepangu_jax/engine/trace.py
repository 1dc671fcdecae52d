"""Per-round traces: a host-driven, phase-by-phase copy of the speculative loop, and its log.

The on-device loop (:func:`~eaglepangu_jax.engine.decode.generate`) runs whole segments of
rounds inside one ``lax.while_loop``, so nothing inside a round can be timed. For debugging and
ablations :func:`generate_traced` runs the same round from the host, one jitted function per
phase, each blocked with ``block_until_ready`` so its wall time is its own::

    draft -> tree -> mask -> verify -> accept -> commit

and writes one JSON object per round to a JSON Lines file (the schema is in
``docs/TRACE_SCHEMA.md``; :data:`TRACE_FIELDS` and :data:`PHASES` are its field and phase
names). It emits exactly the tokens ``generate`` emits: the same prefill, the same keys, the
same tree, acceptance and commit. Host round trips make it slower than ``generate``: use it to
see *where* a round's time goes, and ``generate`` to measure throughput. The first round at a
new attention window includes compilation (the phases are jitted per window).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import math
import os
import time
from pathlib import Path
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from eaglepangu_jax import budget as budget_lib
from eaglepangu_jax import cache as cache_lib
from eaglepangu_jax import tree as tree_lib
from eaglepangu_jax.engine import decode as gen
from eaglepangu_jax.engine.config import SpecConfig
from eaglepangu_jax.engine.drafter import fit_budget, fit_curve
from eaglepangu_jax.engine.state import DecodeState
from eaglepangu_jax.engine.step import (
    StepStatic,
    accept,
    commit_round,
    decide,
    draft,
    draft_if,
    round_paid,
    shape_tree,
    speculated,
    tree_if,
    truncate_tree,
)
from eaglepangu_jax.engine.verification import (
    committed_rows,
    path_rows,
    verify_forward,
    verify_inputs,
    verify_sizes,
)
from eaglepangu_jax.files import write_text_atomic

__all__ = [
    "PHASES",
    "TRACE_FIELDS",
    "generate_traced",
    "write_jsonl_atomic",
    "read_trace",
    "TraceSummary",
    "summarize",
]

PHASES = ("draft", "tree", "mask", "verify", "accept", "commit")
TRACE_FIELDS = (
    "round",
    "committed_len",
    "tree_nodes",
    "tree_depth",
    "verified_slots",
    "budget",
    "accepted",
    "emitted",
    "seconds",
    "predicted_verify_s",
)


# ------------------------------------------------------------------------------ the phases


@functools.partial(jax.jit, static_argnums=0)
def _draft(static: StepStatic, draft_params: Any, state: DecodeState, verify_latency, t_draft):
    # The same three-way split as the fused step, so sampling sees the same keys.
    key, draft_key, accept_key = jax.random.split(state.key, 3)
    if not static.controlled:
        drafting = jnp.asarray(static.drafter is not None)
        explore = jnp.asarray(False)
        proposal = draft(static, draft_params, state, draft_key)
    else:
        drafting, explore = decide(static, state, verify_latency, t_draft)
        proposal, state = draft_if(static, draft_params, state, draft_key, drafting)
    return proposal, drafting, explore, key, accept_key, state


@functools.partial(jax.jit, static_argnums=0)
def _tree(static: StepStatic, proposal, state, verify_latency, t_draft, drafting, explore):
    if not static.controlled:
        tree, n = shape_tree(static, proposal, state, verify_latency)
        return tree, n, drafting
    tree, n = tree_if(static, proposal, state, verify_latency, t_draft, drafting, explore)
    return tree, n, speculated(static, drafting, n, verify_latency, t_draft)


@functools.partial(jax.jit, static_argnums=0)
def _mask(static: StepStatic, cache, tree: tree_lib.Tree):
    return verify_inputs(static, cache, tree)


@functools.partial(jax.jit, static_argnums=0)
def _verify(static: StepStatic, params: dict, cache, tree: tree_lib.Tree, inputs):
    return verify_forward(static, params, cache, tree, inputs)


@functools.partial(jax.jit, static_argnums=0)
def _accept(static: StepStatic, tree: tree_lib.Tree, logits, accept_key, proposal, state):
    return accept(static, tree, logits, accept_key, proposal, state)


@functools.partial(jax.jit, static_argnums=0, donate_argnums=2)
def _commit(static, draft_params, state, verified, acc, n_nodes, key, tree, drafted, costs):
    features, new_k, new_v = verified
    rows = path_rows(acc, new_k, new_v, committed_rows(tree))
    cache = cache_lib.write_rows(state.cache, *rows)
    paid = round_paid(static, acc, n_nodes, *costs)
    return commit_round(
        static,
        draft_params,
        state,
        acc,
        features[acc.path],
        cache,
        n_nodes,
        key,
        tree,
        drafted,
        paid,
    )


class _Clock:
    """Wall time per phase of one round; every phase's outputs are blocked on."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    def run(self, phase: str, fn, *args):
        start = time.perf_counter()
        out = jax.block_until_ready(fn(*args))
        self.seconds[phase] = time.perf_counter() - start
        return out


# ------------------------------------------------------------------------------ the loop


def generate_traced(
    teacher: gen.Teacher,
    drafter: Any,
    prompt_ids: Sequence[int],
    spec: SpecConfig,
    *,
    draft_params: Any = None,
    trace_path: str | os.PathLike,
    verify_latency: Any = None,
    draft_seconds: float = 0.0,
    roofline: budget_lib.Roofline | None = None,
    calibration: budget_lib.Calibration | None = None,
    stream: int = 0,
) -> gen.GenerationResult:
    """:func:`~eaglepangu_jax.engine.decode.generate`, phase by phase, with a trace.

    Args:
      teacher, drafter, prompt_ids, spec, draft_params, verify_latency, stream: as for
        ``generate`` (same tokens, same statistics; ``seconds`` includes the host round trips).
      trace_path: the JSON Lines file written (atomically, when generation ends or fails).
      roofline, calibration: give both to record each round's ``predicted_verify_s``, the
        calibrated roofline time of a forward over the tokens actually fed (the tree's
        slots) with ``committed_len`` cached; otherwise it is ``null``.

    Returns:
      The :class:`~eaglepangu_jax.engine.decode.GenerationResult`.
    """
    if (roofline is None) != (calibration is None):
        raise ValueError("give both roofline and calibration to predict verify times, or neither")
    spec = fit_budget(spec, drafter)
    gen.validate(teacher, drafter, prompt_ids, spec)
    if not Path(trace_path).parent.is_dir():
        raise ValueError(f"cannot write the trace {trace_path}: its folder does not exist")
    eos_id = gen.eos_id_of(teacher, spec)
    capacity = gen.cache_slots(len(prompt_ids), spec, teacher.config.max_position)
    if drafter is not None and spec.policy == "auto" and verify_latency is None:
        verify_latency = gen.nominal_verify_latency(teacher.config, spec, len(prompt_ids) - 1)
    if verify_latency is not None:
        verify_latency = jnp.asarray(fit_curve(verify_latency, spec), jnp.float32)
    records: list[dict[str, Any]] = []
    kept = math.inf  # output length, known once generation ends
    try:
        t0 = time.perf_counter()
        state = gen.init_state(
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
        while not bool(state.done):
            static = _static(teacher, drafter, spec, state, capacity)
            if static is None:
                break
            state, record = _traced_round(
                static,
                teacher.params,
                draft_params,
                state,
                verify_latency,
                draft_seconds,
                roofline,
                calibration,
            )
            record["round"] = len(records)
            records.append(record)
        t2 = time.perf_counter()
        result = gen.result_from_state(
            state, len(prompt_ids), spec, eos_id, seconds=t2 - t1, prefill_seconds=t1 - t0
        )
        kept = len(result.tokens)
        return result
    finally:
        # Written on failure too (every round so far, uncut): that is when a trace helps most.
        _keep_emitted(records, kept)
        write_jsonl_atomic(trace_path, [{k: r[k] for k in TRACE_FIELDS} for r in records])


def _static(teacher, drafter, spec, state, capacity) -> StepStatic | None:
    """The step statics for the next round, or None when its tree no longer fits."""
    probe = StepStatic(teacher=teacher.config, drafter=drafter, spec=spec, window=capacity)
    need = probe.tree_slots
    length = int(state.cache.length)
    if length + need > capacity:
        return None
    return dataclasses.replace(probe, window=gen.window_for(length + need, capacity))


def _traced_round(
    static, params, draft_params, state, verify_latency, draft_seconds, roofline, calibration
):
    clock = _Clock()
    committed = state.cache.length
    committed_len = int(committed)
    t_draft = jnp.float32(draft_seconds)
    proposal, drafted, explore, key, accept_key, state = clock.run(
        "draft", _draft, static, draft_params, state, verify_latency, t_draft
    )
    full_tree, n_nodes, drafted = clock.run(
        "tree", _tree, static, proposal, state, verify_latency, t_draft, drafted, explore
    )
    tree = full_tree
    # Verify at the same slot bucket the fused step's switch would pick.
    valid = np.asarray(tree.valid)
    last_valid = int(np.max(np.nonzero(valid)[0]))
    sizes = verify_sizes(static, tree.num_slots)
    tree = truncate_tree(tree, next(size for size in sizes if size > last_valid))
    inputs = clock.run("mask", _mask, static, state.cache, tree)
    logits, features, new_k, new_v = clock.run(
        "verify", _verify, static, params, state.cache, tree, inputs
    )
    acc = clock.run("accept", _accept, static, tree, logits, accept_key, proposal, state)
    state = clock.run(
        "commit",
        _commit,
        static,
        draft_params,
        state,
        (features, new_k, new_v),
        acc,
        n_nodes,
        key,
        full_tree,
        drafted,
        (verify_latency, t_draft),
    )
    predicted = None
    if roofline is not None:
        predicted = float(budget_lib.latency(roofline, calibration, tree.num_slots, committed_len))
    record = {
        "committed_len": committed_len,
        "tree_nodes": int(n_nodes),
        "tree_depth": int(np.max(np.where(np.asarray(tree.valid), np.asarray(tree.depth), 0))),
        "verified_slots": tree.num_slots,
        "budget": static.spec.budget,
        "accepted": int(acc.length),
        "raw_emitted": int(acc.length) + 1,
        "seconds": {phase: clock.seconds[phase] for phase in PHASES},
        "predicted_verify_s": predicted,
    }
    return state, record


def _keep_emitted(records: list[dict[str, Any]], kept: float) -> None:
    """Per round, the tokens that made it into the output (cut at eos / max_new_tokens), so
    that the ``emitted`` fields sum to the generated length."""
    total = 0
    for record in records:
        before = min(total, kept)
        total += record.pop("raw_emitted")
        record["emitted"] = int(min(total, kept) - before)


# ------------------------------------------------------------------------------ files


def write_jsonl_atomic(path: str | os.PathLike, records: Sequence[dict[str, Any]]) -> None:
    """One JSON object per line, written to a temporary file and moved into place."""
    write_text_atomic(path, "".join(json.dumps(r) + "\n" for r in records))


def read_trace(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of a trace file, checked against the schema.

    Raises:
      ValueError: naming the file and line of the first record that is not a JSON object
        with exactly :data:`TRACE_FIELDS` and per-phase ``seconds``.
    """
    records = []
    text = Path(path).read_text(encoding="utf-8")
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}, line {number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{where}: invalid JSON ({err.msg})") from None
        if not isinstance(record, dict) or set(record) != set(TRACE_FIELDS):
            got = sorted(record) if isinstance(record, dict) else type(record).__name__
            raise ValueError(f"{where}: expected the fields {list(TRACE_FIELDS)}, got {got}")
        if not isinstance(record["seconds"], dict) or set(record["seconds"]) != set(PHASES):
            raise ValueError(f"{where}: 'seconds' must hold the phases {list(PHASES)}")
        records.append(record)
    return records


@dataclasses.dataclass(frozen=True, kw_only=True)
class TraceSummary:
    """Totals over a trace."""

    rounds: int
    new_tokens: int  # sum of ``emitted``
    phase_seconds: dict[str, float]  # total per phase, in :data:`PHASES` order
    accepted_histogram: dict[int, int]  # accepted draft nodes -> rounds, ascending

    @property
    def total_seconds(self) -> float:
        return sum(self.phase_seconds.values())

    @property
    def accepted_length(self) -> float:
        """Emitted tokens per round, bonus included."""
        return self.new_tokens / self.rounds if self.rounds else 0.0

    def to_json(self) -> dict:
        """The summary as a JSON-ready dict (histogram keys become strings)."""
        return {
            "rounds": self.rounds,
            "new_tokens": self.new_tokens,
            "accepted_length": self.accepted_length,
            "total_seconds": self.total_seconds,
            "phase_seconds": dict(self.phase_seconds),
            "accepted_histogram": {str(k): v for k, v in self.accepted_histogram.items()},
        }

    def to_text(self) -> str:
        """A human-readable report: phase totals and the acceptance histogram."""
        total = self.total_seconds
        lines = [
            f"{self.rounds} rounds, {self.new_tokens} tokens, accepted length "
            f"{self.accepted_length:.2f}, {total:.3f} s in phases",
            "",
            f"{'phase':<8} {'seconds':>9} {'share':>6} {'ms/round':>9}",
        ]
        for phase, seconds in self.phase_seconds.items():
            share = seconds / total if total > 0 else 0.0
            per_round = 1e3 * seconds / self.rounds if self.rounds else 0.0
            lines.append(f"{phase:<8} {seconds:>9.3f} {share:>6.1%} {per_round:>9.2f}")
        lines += ["", f"{'accepted':<8} {'rounds':>7}"]
        widest = max(self.accepted_histogram.values(), default=0)
        for accepted, count in self.accepted_histogram.items():
            bar = "#" * max(1, math.ceil(30 * count / widest)) if widest else ""
            lines.append(f"{accepted:<8} {count:>7}  {bar}")
        return "\n".join(lines)


def summarize(path: str | os.PathLike) -> TraceSummary:
    """Per-phase time totals and the histogram of accepted lengths of a trace file."""
    records = read_trace(path)
    phase_seconds = {phase: float(sum(r["seconds"][phase] for r in records)) for phase in PHASES}
    histogram = collections.Counter(int(r["accepted"]) for r in records)
    return TraceSummary(
        rounds=len(records),
        new_tokens=int(sum(r["emitted"] for r in records)),
        phase_seconds=phase_seconds,
        accepted_histogram=dict(sorted(histogram.items())),
    )
