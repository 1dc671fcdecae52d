"""Prefill, plain greedy decoding and the tree-verification forward of the teacher.

All three run :func:`eaglepangu_jax.models.llama.forward` under ``jax.jit`` with the cache
*donated* (updated in place): the cache passed in is consumed, use the one returned.
Shapes that vary per call are bucketed so a session compiles a handful of programs:

* prefill runs fixed ``chunk``-token pieces; the last piece is padded to a power of two;
* attention reads a power-of-two window of the cache (:func:`llama.window_bucket`);
* greedy decoding runs on device in a ``lax.while_loop`` per window bucket, so the host only
  syncs when the window grows or generation ends.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Bool, Float, Int

from eaglepangu_jax import cache as kv_cache
from eaglepangu_jax import mode
from eaglepangu_jax.cache import KVCache
from eaglepangu_jax.models import llama
from eaglepangu_jax.models.config import LlamaConfig

DEFAULT_CHUNK = 128


def check_budget(
    config: LlamaConfig,
    prompt_len: int,
    max_new_tokens: int,
    num_slots: int,
    *,
    tree_budget: int = 0,
) -> None:
    """Raise ``ValueError`` (with the numbers) unless a generation fits model and cache.

    Args:
        config: the model (``max_position`` bounds the prompt).
        prompt_len: prompt tokens.
        max_new_tokens: tokens to generate.
        num_slots: KV-cache slots ``S``.
        tree_budget: extra speculative slots a verify forward may write past the committed
            length (tree nodes, root included); 0 for plain decoding.
    """
    if prompt_len < 1:
        raise ValueError("the prompt is empty: at least one token is needed to condition on")
    if max_new_tokens < 0 or tree_budget < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens} and tree_budget={tree_budget} "
                         "must be >= 0")
    if prompt_len > config.max_position:
        raise ValueError(f"prompt of {prompt_len} tokens exceeds the model's max_position="
                         f"{config.max_position}")
    needed = prompt_len + max_new_tokens + tree_budget
    if needed > num_slots:
        raise ValueError(
            f"prompt ({prompt_len}) + max_new_tokens ({max_new_tokens}) + tree_budget "
            f"({tree_budget}) = {needed} tokens exceed the KV cache's {num_slots} slots")


def prefill(
    params: dict,
    config: LlamaConfig,
    prompt_ids: Int[ArrayLike, "P"],
    cache: KVCache,
    *,
    chunk: int = DEFAULT_CHUNK,
    feature_layers: tuple[int, ...] = (),
) -> tuple[Float[Array, "V"], Float[Array, "P F H"], KVCache]:
    """Append ``prompt_ids`` to the committed prefix, ``chunk`` tokens per forward.

    Args:
        params: stacked or prepared parameters (prepared is much faster).
        config: the model.
        prompt_ids: token ids to append after ``cache.length`` (causal attention; positions
            continue from the slot index).
        cache: donated; ``cache.length + P`` must fit in its slots.
        chunk: tokens per forward (bounds activation memory for long prompts).
        feature_layers: layers whose outputs to return for every prompt token (see
            :func:`llama.forward`).

    Returns:
        ``(logits of the last prompt token [V], features [P, F, H], cache)`` with
        ``cache.length`` advanced by ``P``.
    """
    ids = _check_ids(prompt_ids, config)
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    start = int(cache.length)
    if start + ids.size > cache.num_slots:
        raise ValueError(f"cache holds {start} tokens; {ids.size} more exceed its "
                         f"{cache.num_slots} slots")
    last_logits, pieces = None, []
    for lo in range(0, ids.size, chunk):
        piece = ids[lo:lo + chunk]
        width = _padded_width(piece.size, chunk, start + lo, cache.num_slots)
        padded = np.zeros(width, np.int32)
        padded[:piece.size] = piece
        window = llama.window_bucket(start + lo + width, cache.num_slots)
        last_logits, feats, cache = _prefill_chunk(
            params, jnp.asarray(padded), jnp.int32(piece.size), cache,
            config=config, window=window, feature_layers=feature_layers)
        pieces.append(feats[:piece.size])
    features = jnp.concatenate(pieces, axis=0) if len(pieces) > 1 else pieces[0]
    return last_logits, features, cache


def greedy_generate(
    params: dict,
    config: LlamaConfig,
    prompt_ids: Int[ArrayLike, "P"],
    max_new_tokens: int,
    *,
    cache_slots: int | None = None,
    eos_id: int | None = None,
    chunk: int = DEFAULT_CHUNK,
) -> np.ndarray:
    """Greedy (argmax) continuation of ``prompt_ids``.

    Args:
        params: stacked or prepared parameters; stacked ones are prepared (copied) per call,
            so pass :func:`llama.prepare_params` output when calling repeatedly.
        config: the model.
        prompt_ids: non-empty prompt.
        max_new_tokens: tokens to generate (fewer if ``eos_id`` is produced).
        cache_slots: KV-cache size; default: the next power of two holding prompt and new
            tokens (so prompts of similar length share compiled programs).
        eos_id: stop after emitting this token (it is included in the output); None
            generates exactly ``max_new_tokens``.
        chunk: prefill chunk size.

    Returns:
        The new token ids, int32 ``[<= max_new_tokens]``.

    Raises:
        ValueError: empty prompt, token ids out of range, or a prompt / generation that does
            not fit ``config.max_position`` or the cache (checked before any computation).
    """
    ids = _check_ids(prompt_ids, config)
    needed = ids.size + max_new_tokens
    slots = cache_slots if cache_slots is not None else 1 << max(needed - 1, 0).bit_length()
    check_budget(config, ids.size, max_new_tokens, slots)
    if max_new_tokens == 0:
        return np.zeros((0,), np.int32)
    params = llama.prepare_params(params)
    dtype = params["embed"].dtype
    cache = kv_cache.init(config.num_layers, slots, config.num_kv_heads, config.head_dim, dtype)
    last_logits, _, cache = prefill(params, config, ids, cache, chunk=chunk)
    # eos = -1 never matches a token id: "no eos" without a separate compiled program.
    eos = jnp.int32(-1 if eos_id is None else eos_id)
    first = jnp.argmax(last_logits).astype(jnp.int32)
    state = _GreedyState(cache=cache, out=jnp.zeros((slots,), jnp.int32).at[0].set(first),
                         count=jnp.int32(1), done=first == eos)
    stop = jnp.int32(max_new_tokens)
    while int(state.count) < max_new_tokens and not bool(state.done):
        window = llama.window_bucket(int(state.cache.length) + 1, slots)
        state = _greedy_segment(params, state, stop, eos, config=config, window=window)
    return np.asarray(state.out[:int(state.count)])


def verify_forward(
    params: dict,
    config: LlamaConfig,
    tree_tokens: Int[Array, "N"],
    tree_positions: Int[Array, "N"],
    cache: KVCache,
    mask: Bool[Array, "N S"],
    *,
    feature_layers: tuple[int, ...] = (),
    window: int | None = None,
) -> tuple[Float[Array, "N V"], Float[Array, "N F H"], KVCache]:
    """One teacher forward over the root and the tree nodes (slot ``j`` = node ``j``).

    The K/V of node ``j`` is written at cache slot ``cache.length + j`` (the speculative
    region); ``cache.length`` is not advanced: commit the accepted path with the cache module.

    Args:
        params: prepared parameters (stacked ones work, slower).
        config: the model.
        tree_tokens: node tokens, root first (the newest emitted token, whose K/V is not in
            the cache yet).
        tree_positions: node positions (committed length + depth).
        cache: donated.
        mask: True = may attend; columns are cache slots (prefix + tree, e.g. from the mask
            module's verify mask).
        feature_layers: teacher layers to tap for the drafter.
        window: optional static attention window; the mask is cut to its first ``window``
            columns (must cover ``cache.length + N``; see :func:`llama.window_bucket`).

    Returns:
        ``(logits [N, V], features [N, F, H], cache)``.
    """
    n = tree_tokens.shape[0]
    if tree_tokens.ndim != 1 or n < 1 or tree_positions.shape != (n,):
        raise ValueError(f"tree_tokens and tree_positions must be [N] with N >= 1; got "
                         f"{tree_tokens.shape} and {tree_positions.shape}")
    if window is not None:
        if not 1 <= window <= mask.shape[-1]:
            raise ValueError(f"window={window} must lie in [1, {mask.shape[-1]}]")
        mask = mask[:, :window]
    if mode.is_reference():
        # A host sync: only in reference mode (the performance path never waits on length).
        length = int(cache.length)
        if length + n > mask.shape[1]:
            raise ValueError(f"{n} tree nodes after {length} committed tokens do not fit the "
                             f"attention window of {mask.shape[1]} slots")
    return _verify_jit(params, tree_tokens.astype(jnp.int32), tree_positions.astype(jnp.int32),
                       cache, mask, config=config, feature_layers=feature_layers)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _GreedyState:
    cache: KVCache
    out: Int[Array, "S"]  # generated tokens; out[count - 1] is the next input
    count: Int[Array, ""]  # tokens generated so far
    done: Bool[Array, ""]  # eos produced


@functools.partial(jax.jit, static_argnames=("config", "feature_layers"),
                   donate_argnames=("cache",))
def _verify_jit(params, tokens, positions, cache, mask, *, config, feature_layers):
    return llama.forward(params, tokens, positions, cache, mask, config=config,
                         feature_layers=feature_layers)


@functools.partial(jax.jit, static_argnames=("config", "window", "feature_layers"),
                   donate_argnames=("cache",))
def _prefill_chunk(params, tokens, n_valid, cache, *, config, window, feature_layers):
    """Forward one (padded) chunk causally and commit its ``n_valid`` real tokens."""
    t = tokens.shape[0]
    slots = cache.length + jnp.arange(t, dtype=jnp.int32)
    mask = jnp.arange(window, dtype=jnp.int32)[None, :] <= slots[:, None]
    logits, feats, cache = llama.forward(params, tokens, slots, cache, mask, config=config,
                                         feature_layers=feature_layers)
    cache = dataclasses.replace(cache, length=cache.length + n_valid)
    return logits[n_valid - 1], feats, cache


@functools.partial(jax.jit, static_argnames=("config", "window"), donate_argnames=("state",))
def _greedy_segment(params, state, stop, eos, *, config, window):
    """Greedy steps on device while the next write slot stays inside ``window``."""
    cols = jnp.arange(window, dtype=jnp.int32)

    def cond(s: _GreedyState):
        return (s.count < stop) & ~s.done & (s.cache.length < window)

    def body(s: _GreedyState):
        length = s.cache.length
        token = s.out[s.count - 1]
        logits, _, cache = llama.forward(
            params, token[None], length[None], s.cache, (cols <= length)[None, :],
            config=config)
        nxt = jnp.argmax(logits[0]).astype(jnp.int32)
        return _GreedyState(
            cache=dataclasses.replace(cache, length=length + 1),
            out=s.out.at[s.count].set(nxt),
            count=s.count + 1,
            done=nxt == eos,
        )

    return jax.lax.while_loop(cond, body, state)


def _padded_width(size: int, chunk: int, start: int, num_slots: int) -> int:
    """Width of a prefill piece: ``chunk`` or, for the last one, a power of two when it fits.

    Padding bounds the number of compiled shapes; padded rows write garbage K/V past the
    committed length (harmless: not committed), so they need free slots, else no padding.
    """
    if size == chunk:
        return chunk
    width = min(chunk, 1 << (size - 1).bit_length())
    return width if start + width <= num_slots else size


def _check_ids(prompt_ids: Int[ArrayLike, "P"] | Sequence[int], config: LlamaConfig) -> np.ndarray:
    ids = np.asarray(prompt_ids)
    if ids.ndim != 1:
        raise ValueError(f"prompt_ids must be 1-D, got shape {ids.shape}")
    if ids.size == 0:
        raise ValueError("the prompt is empty: at least one token is needed to condition on")
    if not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"prompt_ids must be integers, got {ids.dtype}")
    bad = ids[(ids < 0) | (ids >= config.vocab_size)]
    if bad.size:
        raise ValueError(f"token ids {bad[:5].tolist()} out of range [0, {config.vocab_size})")
    return ids.astype(np.int32)
