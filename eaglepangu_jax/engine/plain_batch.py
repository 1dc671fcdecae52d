"""Plain greedy decoding of many prompts at once: the corpus path.

:func:`~eaglepangu_jax.engine.decode.generate_batch` vmaps the speculative round, so each
sequence still verifies a root plus a padding node per step and carries the tree bookkeeping;
under ``vmap`` every ``lax.cond`` of the round also runs both branches. For plain decoding none
of that is needed. :func:`greedy_batch` runs one token per sequence per step, ``[B, H]``
products against shared weights, which is what makes batching pay on a CPU (one sequence is
bandwidth-bound: every step reads all the weights for one token).

Prompts of different lengths are **right-aligned**: sequence ``i``'s prompt ends at the same
slot as every other's, after ``first_slot[i]`` slots of left padding that its mask hides
(:func:`~eaglepangu_jax.mask.left_padded_causal_mask`) and its rotary positions skip. So every
sequence writes its K/V at the same slot, one in-place update of the batched cache; with a
slot per sequence the write is a scatter, and XLA copied the whole batched cache for it in
every layer (a batch of 8 stepped at 4x the time of one sequence). The prompts are prefilled
together in chunks, the same way. A finished sequence keeps stepping with the batch (its
tokens are dropped), and the loop ends when every sequence has stopped. As in
:func:`~eaglepangu_jax.engine.decode.generate`, the host only steps in to widen the attention
window.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from eaglepangu_jax import cache as cache_lib
from eaglepangu_jax import mask as mask_lib
from eaglepangu_jax.engine.config import SpecConfig
from eaglepangu_jax.engine.decode import (
    PREFILL_CHUNK,
    Teacher,
    cache_slots,
    validate,
    window_for,
)
from eaglepangu_jax.engine.result import finish_tokens
from eaglepangu_jax.models import llama
from eaglepangu_jax.models.config import LlamaConfig

__all__ = ["greedy_batch"]


@dataclasses.dataclass(frozen=True)
class _Loop:
    """What a compiled batch loop depends on (its static key)."""

    config: LlamaConfig
    window: int
    max_new_tokens: int


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _Carry:
    out: Int[Array, "B M"]  # generated ids, -1 where not generated
    step: Int[Array, ""]  # tokens generated so far (the same for every sequence)
    last: Int[Array, " B"]  # each sequence's newest token, fed next
    cache: cache_lib.KVCache  # k, v [B, L, S, K, Dh]; one length for the batch
    first_slot: Int[Array, " B"]  # left padding of each sequence
    done: Bool[Array, " B"]  # emitted eos


def _forward(
    params: dict,
    tokens: Int[Array, "B T"],
    cache: cache_lib.KVCache,
    first_slot: Int[Array, " B"],
    *,
    config: LlamaConfig,
    window: int,
) -> tuple[Float[Array, "B T V"], cache_lib.KVCache]:
    """``T`` tokens of every sequence written at the batch's slots ``[length, length + T)``;
    ``length`` is not advanced. ``length`` is shared, so it is not vmapped: the write stays an
    in-place ``dynamic_update_slice``."""
    t = tokens.shape[1]

    def one(tok, k, v, pad):
        kv = cache_lib.KVCache(k=k, v=v, length=cache.length)
        positions = jnp.maximum(cache.length + jnp.arange(t, dtype=jnp.int32) - pad, 0)
        attend = mask_lib.left_padded_causal_mask(t, cache.length, window, pad)
        logits, _, kv = llama.forward(params, tok, positions, kv, attend, config=config)
        return logits, kv.k, kv.v

    logits, k, v = jax.vmap(one)(tokens, cache.k, cache.v, first_slot)
    return logits, dataclasses.replace(cache, k=k, v=v)


@partial(jax.jit, static_argnames=("config", "window"), donate_argnames=("cache",))
def _prefill_chunk(params, tokens, cache, first_slot, *, config, window):
    _, cache = _forward(params, tokens, cache, first_slot, config=config, window=window)
    return cache


@partial(jax.jit, static_argnums=(0,), donate_argnums=(2,))
def _run(static: _Loop, params: dict, carry: _Carry, eos_id: Int[Array, ""]) -> _Carry:
    """Steps until every sequence is done, the token limit, or the window is full."""

    def keep_going(c: _Carry):
        fits = c.cache.length + 1 <= static.window
        return (c.step < static.max_new_tokens) & ~jnp.all(c.done) & fits

    def body(c: _Carry) -> _Carry:
        logits, cache = _forward(
            params,
            c.last[:, None],
            c.cache,
            c.first_slot,
            config=static.config,
            window=static.window,
        )
        token = jnp.where(c.done, -1, jnp.argmax(logits[:, 0], axis=-1).astype(jnp.int32))
        out = jax.lax.dynamic_update_slice(c.out, token[:, None], (jnp.int32(0), c.step))
        return dataclasses.replace(
            c,
            out=out,
            step=c.step + 1,
            last=jnp.maximum(token, 0),
            cache=cache_lib.advance(cache, 1),
            done=c.done | (token == eos_id),
        )

    return jax.lax.while_loop(keep_going, body, carry)


def greedy_batch(
    teacher: Teacher,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    eos_id: int | None = None,
) -> list[list[int]]:
    """The teacher's greedy continuation of every prompt, decoded together.

    Equal to :func:`~eaglepangu_jax.engine.decode.generate` with ``drafter=None`` per prompt
    (up to float near-ties: the batched products round differently): each list is cut at
    ``max_new_tokens`` and after the first ``eos_id`` (kept).

    Args:
      teacher: the model.
      prompts: token ids, each at least one token; lengths may differ.
      max_new_tokens: the longest continuation.
      eos_id: the stop token (default: the teacher's).

    Raises:
      ValueError: no prompts, or a prompt that is empty, out of the vocabulary or too long
        for the teacher's context with ``max_new_tokens`` (the message names it).
    """
    if not prompts:
        raise ValueError("no prompts given")
    spec = SpecConfig(policy="drafter", budget=1, depth=1, max_new_tokens=max_new_tokens)
    for i, p in enumerate(prompts):
        try:
            validate(teacher, None, p, spec)
        except ValueError as err:
            raise ValueError(f"prompt {i}: {err}") from None
    cfg = teacher.config
    eos = cfg.eos_id if eos_id is None else int(eos_id)
    longest = max(len(p) for p in prompts)
    # The padding is inside the cache, so the longest prompt sets every sequence's slots.
    if longest + max_new_tokens > cfg.max_position:
        raise ValueError(
            f"the longest prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) is "
            f"more than the teacher's context of {cfg.max_position}"
        )
    capacity = cache_slots(longest, spec, cfg.max_position)
    # Prompt i ends at slot longest - 1 (its last token is fed by the first step).
    first_slot = np.asarray([longest - len(p) for p in prompts], np.int32)
    body = np.zeros((len(prompts), longest - 1), np.int32)
    for i, p in enumerate(prompts):
        body[i, first_slot[i] :] = p[:-1]
    kv = cache_lib.init(
        cfg.num_layers, capacity, cfg.num_kv_heads, cfg.head_dim, teacher.params["embed"].dtype
    )
    batched = jax.tree_util.tree_map(lambda x: jnp.broadcast_to(x, (len(prompts),) + x.shape), kv)
    cache = dataclasses.replace(batched, length=kv.length)
    pads = jnp.asarray(first_slot)
    for begin in range(0, longest - 1, PREFILL_CHUNK):
        chunk = np.zeros((len(prompts), PREFILL_CHUNK), np.int32)
        real = min(PREFILL_CHUNK, longest - 1 - begin)
        chunk[:, :real] = body[:, begin : begin + real]
        window = window_for(begin + PREFILL_CHUNK, capacity)
        cache = _prefill_chunk(
            teacher.params, jnp.asarray(chunk), cache, pads, config=cfg, window=window
        )
        # The chunk's padding past the prompt lies beyond the length: never attended.
        cache = cache_lib.truncate(cache, begin + real)
    carry = _Carry(
        out=jnp.full((len(prompts), max_new_tokens), -1, jnp.int32),
        step=jnp.int32(0),
        last=jnp.asarray([int(p[-1]) for p in prompts], jnp.int32),
        cache=cache,
        first_slot=pads,
        done=jnp.zeros((len(prompts),), bool),
    )
    while True:
        step, done, length = int(carry.step), np.asarray(carry.done), int(carry.cache.length)
        if step >= max_new_tokens or bool(np.all(done)) or length + 1 > capacity:
            break
        static = _Loop(cfg, window_for(length + 1, capacity), max_new_tokens)
        carry = _run(static, teacher.params, carry, jnp.int32(eos))
    out = np.asarray(carry.out)
    results = []
    for row in out:
        tokens = row[row >= 0]
        results.append(finish_tokens(tokens, 0, len(tokens), spec, eos))
    return results
