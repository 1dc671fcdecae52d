"""What a generation returns: the generated ids and the statistics, counted the same way for
every backend (the JAX engine, the traced loop, the torch runner)."""

from __future__ import annotations

import dataclasses

import numpy as np

from eaglepangu_jax.engine.config import SpecConfig
from eaglepangu_jax.engine.state import DecodeState

__all__ = ["GenerationStats", "GenerationResult", "finish_tokens", "result_from_state"]


@dataclasses.dataclass(frozen=True)
class GenerationStats:
    new_tokens: int  # tokens emitted (eos included, nothing past it)
    rounds: int  # teacher verify forwards (prefill excluded)
    accepted_length: float  # new_tokens / rounds, bonus included; plain decoding = 1.0
    seconds: float  # decode wall time, prefill excluded
    prefill_seconds: float
    tokens_per_s: float  # new_tokens / seconds
    accepted_per_round: tuple[int, ...]  # accepted draft nodes per round
    nodes_per_round: tuple[int, ...]  # tree nodes verified per round (root excluded)


@dataclasses.dataclass(frozen=True)
class GenerationResult:
    tokens: list[int]  # generated ids (prompt excluded), cut after eos / max_new_tokens
    stats: GenerationStats


def finish_tokens(
    tokens: np.ndarray, prompt_len: int, num_tokens: int, spec: SpecConfig, eos_id: int
) -> list[int]:
    """The generated ids of a token buffer: past the prompt, cut at ``max_new_tokens`` and
    after the first ``eos_id``."""
    new = tokens[prompt_len:num_tokens].tolist()[: spec.max_new_tokens]
    if eos_id in new:
        new = new[: new.index(eos_id) + 1]
    return new


def result_from_state(
    state: DecodeState,
    prompt_len: int,
    spec: SpecConfig,
    eos_id: int,
    *,
    seconds: float,
    prefill_seconds: float,
    index: int | None = None,
) -> GenerationResult:
    """The :class:`GenerationResult` of a finished decode state (sequence ``index`` of a
    batched state), counted the same way for every backend: tokens cut after eos and at
    ``max_new_tokens``, accepted length = emitted tokens / verify rounds."""
    pick = (lambda x: np.asarray(x)) if index is None else (lambda x: np.asarray(x)[index])
    new = finish_tokens(pick(state.tokens), prompt_len, int(pick(state.num_tokens)), spec, eos_id)
    rounds = int(pick(state.rounds))
    accepted = tuple(int(a) for a in pick(state.accepted_log)[:rounds])
    nodes = tuple(int(n) for n in pick(state.nodes_log)[:rounds])
    stats = GenerationStats(
        new_tokens=len(new),
        rounds=rounds,
        accepted_length=len(new) / rounds if rounds else 0.0,
        seconds=seconds,
        prefill_seconds=prefill_seconds,
        tokens_per_s=len(new) / seconds if seconds > 0 else float("inf"),
        accepted_per_round=accepted,
        nodes_per_round=nodes,
    )
    return GenerationResult(tokens=new, stats=stats)
