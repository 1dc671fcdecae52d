"""Many independent generations of one prompt, prefilled once (best-of-n, and the
statistical checks that sampling is lossless)."""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from eaglepangu_jax.engine.config import SpecConfig
from eaglepangu_jax.engine.decode import (
    Teacher,
    cache_slots,
    decode_loop,
    drafter_to_run,
    eos_id_of,
    init_state,
    validate,
)
from eaglepangu_jax.engine.drafter import fit_budget
from eaglepangu_jax.engine.result import finish_tokens

__all__ = ["SAMPLE_CHUNK", "sample_many"]


SAMPLE_CHUNK = 64  # streams decoded together by sample_many (see there)


def sample_many(
    teacher: Teacher,
    drafter: Any,
    prompt_ids: Sequence[int],
    spec: SpecConfig,
    num_samples: int,
    *,
    draft_params: Any = None,
    verify_latency: Any = None,
    draft_seconds: float = 0.0,
    chunk: int = SAMPLE_CHUNK,
) -> list[list[int]]:
    """``num_samples`` independent generations of one prompt, prefilled once.

    Sample ``i`` uses random stream ``i`` (as :func:`generate` with ``stream=i``), so with
    ``acceptance="sample"`` the results are draws from the teacher's (adjusted) distribution;
    useful for best-of-n and for checking losslessness statistically. Streams are decoded
    ``chunk`` at a time (the results do not depend on it): every stream carries its own KV
    cache and ``[slots, vocab]`` probabilities, and 384 streams at once took over 17 GB.
    ``verify_latency`` and ``draft_seconds`` are the ``"auto"`` controller's costs, as in
    :func:`eaglepangu_jax.engine.decode.generate`.
    """
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    spec = fit_budget(spec, drafter)
    validate(teacher, drafter, prompt_ids, spec)
    drafter, draft_params = drafter_to_run(
        drafter, draft_params, spec, verify_latency, draft_seconds
    )
    eos_id = eos_id_of(teacher, spec)
    capacity = cache_slots(len(prompt_ids), spec, teacher.config.max_position)
    state = init_state(
        teacher,
        drafter,
        draft_params,
        prompt_ids,
        spec,
        capacity=capacity,
        key=jax.random.key(spec.seed),
    )
    size = min(chunk, num_samples)
    results: list[list[int]] = []
    for begin in range(0, num_samples, size):
        # The last chunk is padded to the same size (one compilation) and its extra streams
        # are dropped. A fresh batch each time: the decode loop donates its input buffers.
        batch = jax.tree_util.tree_map(lambda x: jnp.broadcast_to(x, (size,) + x.shape), state)
        streams = jnp.arange(begin, begin + size, dtype=jnp.int32)
        keys = jax.vmap(lambda i: jax.random.fold_in(jax.random.key(spec.seed), i))(streams)
        done = decode_loop(
            teacher,
            drafter,
            draft_params,
            dataclasses.replace(batch, key=keys),
            spec,
            capacity,
            batched=True,
            verify_latency=verify_latency,
            draft_seconds=draft_seconds,
        )
        tokens, num = np.asarray(done.tokens), np.asarray(done.num_tokens)
        results += [
            finish_tokens(tokens[i], len(prompt_ids), int(num[i]), spec, eos_id)
            for i in range(min(size, num_samples - begin))
        ]
    return results
