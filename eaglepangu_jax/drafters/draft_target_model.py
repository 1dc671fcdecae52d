"""The draft model of draft-target speculation: its fit to the teacher, its cache prefill, and
the training-free draft (the teacher truncated to its first layers).

The drafter that runs it is :class:`eaglepangu_jax.drafters.draft_target.DraftTargetDrafter`.
Dimensions: ``C`` token-buffer capacity, ``S`` draft cache slots, ``T`` new tokens, ``V``
vocabulary.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from eaglepangu_jax import cache as cache_lib
from eaglepangu_jax import mask as mask_lib
from eaglepangu_jax.cache import KVCache
from eaglepangu_jax.models import llama
from eaglepangu_jax.models.config import LlamaConfig

__all__ = ["PREFILL_CHUNK", "check_compatible", "block_mask", "prefill", "truncated_teacher"]

PREFILL_CHUNK = 64  # prompt tokens per draft forward at prefill (a fixed shape)


def check_compatible(draft: LlamaConfig, teacher: LlamaConfig) -> None:
    """Refuse a draft that does not speak the teacher's tokenizer.

    Raises:
      ValueError: the vocabulary sizes differ, or the bos / eos ids do (another tokenizer).
    """
    if draft.vocab_size != teacher.vocab_size:
        raise ValueError(
            f"the draft model's vocabulary has {draft.vocab_size} tokens, the teacher's "
            f"{teacher.vocab_size}: a draft-target drafter needs the teacher's tokenizer"
        )
    if (draft.bos_id, draft.eos_id) != (teacher.bos_id, teacher.eos_id):
        raise ValueError(
            f"the draft model's bos/eos ids ({draft.bos_id}, {draft.eos_id}) differ from the "
            f"teacher's ({teacher.bos_id}, {teacher.eos_id}): another tokenizer"
        )


def block_mask(
    rows: int, at: Int[Array, ""], start: Int[Array, ""], num_slots: int
) -> Bool[Array, "T S"]:
    """``rows`` consecutive tokens written at ``[at, at + rows)``: causal, old context hidden."""
    s = jnp.arange(num_slots, dtype=jnp.int32)
    return mask_lib.causal_mask(rows, at, num_slots) & (s >= start)[None, :]


def prefill(
    params: dict,
    tokens: Int[Array, " C"],
    num_tokens: Int[Array, ""],
    start: Int[Array, ""],
    *,
    config: LlamaConfig,
    num_slots: int,
) -> tuple[KVCache, Float[Array, " V"]]:
    """A fresh draft cache holding ``tokens[:num_tokens]``, and the logits at the last one.

    Fixed ``PREFILL_CHUNK``-token forwards in a loop whose trip count is traced, so it jits
    once per buffer size. ``num_slots`` must cover the buffer rounded up to whole chunks.
    """
    c = tokens.shape[0]
    if num_slots < -(-c // PREFILL_CHUNK) * PREFILL_CHUNK:
        raise ValueError(f"{num_slots} draft cache slots cannot hold {c} tokens in chunks")
    padded = jnp.pad(tokens.astype(jnp.int32), (0, -c % PREFILL_CHUNK))
    num = jnp.clip(num_tokens, 1, c).astype(jnp.int32)
    cache = cache_lib.init(
        config.num_layers, num_slots, config.num_kv_heads, config.head_dim, params["embed"].dtype
    )
    offsets = jnp.arange(PREFILL_CHUNK, dtype=jnp.int32)

    def chunk(i, carry):
        kv, root_logits = carry
        begin = i * PREFILL_CHUNK
        ids = jax.lax.dynamic_slice(padded, (begin,), (PREFILL_CHUNK,))
        mask = block_mask(PREFILL_CHUNK, begin, start, num_slots)
        kv = cache_lib.truncate(kv, begin)  # the chunk's K/V land at slot `begin`
        logits, _, kv = llama.forward(params, ids, begin + offsets, kv, mask, config=config)
        row = num - 1 - begin
        here = (row >= 0) & (row < PREFILL_CHUNK)
        return kv, jnp.where(here, logits[jnp.clip(row, 0, PREFILL_CHUNK - 1)], root_logits)

    init = (cache, jnp.zeros((config.vocab_size,), jnp.float32))
    trips = (num + PREFILL_CHUNK - 1) // PREFILL_CHUNK
    cache, logits = jax.lax.fori_loop(0, trips, chunk, init)
    return cache_lib.truncate(cache, num), logits


def truncated_teacher(
    teacher_params: dict, teacher_config: LlamaConfig, num_layers: int
) -> tuple[LlamaConfig, dict]:
    """The teacher's first ``num_layers`` layers with its final norm and head, as a draft
    model ``(config, params)`` (same layout as given; arrays shared, not copied, when the
    layout is prepared).

    Raises:
      ValueError: ``num_layers`` outside ``[1, teacher layers]``.
    """
    if not 1 <= num_layers <= teacher_config.num_layers:
        raise ValueError(
            f"a truncated teacher needs 1 to {teacher_config.num_layers} layers, got {num_layers}"
        )
    layers = teacher_params["layers"]
    if isinstance(layers, (list, tuple)):
        kept: Any = tuple(layers[:num_layers])
    else:
        kept = {name: w[:num_layers] for name, w in layers.items()}
    config = dataclasses.replace(teacher_config, num_layers=num_layers)
    return config, dict(teacher_params, layers=kept)
