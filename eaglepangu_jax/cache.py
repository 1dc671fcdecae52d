"""The branchable KV cache: a committed prefix plus a speculative region, updated functionally.

Layout: ``k`` and ``v`` are ``[L, S, K, Dh]``. Slots ``[0, length)`` hold the *committed*
prefix. The speculative region is ``[length, length + N)``: a teacher forward over ``T`` new
tokens writes their K/V at slots ``[length, length + T)`` without advancing ``length``, so
rollback is simply not advancing it (there is no ``rollback`` function). Tree node ``j`` lives
at slot ``length + j`` (the root, node 0, at ``length``).

**What a round commits.** The tree's root is the *previous round's bonus token*: it is not in
the cache yet when the round starts, and the verify forward writes it at slot ``length`` along
with the draft nodes. Greedy verification accepts ``n`` draft nodes along ``path`` and
produces a new bonus token. :func:`commit` keeps the root and the ``n`` accepted nodes
(``length += n + 1``); the new bonus token's K/V are **not** in the cache: it becomes the next
round's root, written by the next forward at the new ``length``. Example, ``length = 10``,
a 6-slot tree, accepted ``path = [0, 2, 5]`` (``n = 2``), bonus token ``b``::

    before commit  slot 10 11 12 13 14 15      length = 10
                   node  0  1  2  3  4  5      (root = last round's bonus token)
    after commit   slot 10 11 12 | 13 ...      length = 13
                   node  0  2  5 | stale       (b goes to slot 13 in the next forward)

Moved K/V stay correct because a tree node's rotary position is ``length + depth`` and the
accepted node at depth ``k`` lands at slot ``length + k``.

**The engine's way** skips the move: its verify forward reads the cache without writing it
(:func:`eaglepangu_jax.models.llama.forward_detached`) and returns the tree's K/V; after
acceptance :func:`write_rows` writes the accepted path's rows (root first) straight into
their final slots and :func:`commit_length` advances ``length``. Same cache, one write, and
the forward can sit in a ``lax.switch`` without XLA copying the cache through the branches.
:func:`commit` serves forwards that wrote the tree in place (the torch adapter's).

Dimensions: ``L`` layers, ``S`` slots, ``K`` KV heads, ``Dh`` head dim, ``D`` max tree depth
(paths have ``D + 1`` entries, the root first). Every function is pure and jittable; jit the
step with ``donate_argnums`` for the cache so XLA updates it in place.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Float, Int

__all__ = [
    "KVCache",
    "init",
    "write",
    "write_rows",
    "commit",
    "commit_acceptance",
    "commit_length",
    "advance",
    "truncate",
    "capacity_check",
]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Immutable KV cache state; update with the functions of this module."""

    k: Float[Array, "L S K Dh"]  # [L, S, K, Dh]
    v: Float[Array, "L S K Dh"]  # [L, S, K, Dh]
    length: Int[Array, ""]  # committed prefix length, int32 scalar

    @property
    def num_slots(self) -> int:
        """``S``, the static number of slots (also for a batched ``[B, L, S, K, Dh]`` cache)."""
        return self.k.shape[-3]


def init(
    num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int, dtype=jnp.float32
) -> KVCache:
    """An empty cache with ``num_slots`` slots per layer."""
    shape = (num_layers, num_slots, num_kv_heads, head_dim)
    return KVCache(
        k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype), length=jnp.zeros((), jnp.int32)
    )


def write(
    cache_kv: Float[Array, "S K Dh"],
    new_kv: Float[Array, "T K Dh"],
    start: Int[Array, ""],
) -> Float[Array, "S K Dh"]:
    """Write ``T`` new rows of one layer's K or V at slots ``[start, start + T)``.

    ``dynamic_update_slice`` clamps ``start`` so the write stays inside the buffer (never an
    out-of-range scatter); callers check capacity before generating.
    """
    return jax.lax.dynamic_update_slice(
        cache_kv, new_kv.astype(cache_kv.dtype), (start, jnp.int32(0), jnp.int32(0))
    )


def write_rows(
    cache: KVCache, k_rows: Float[Array, "L R K Dh"], v_rows: Float[Array, "L R K Dh"]
) -> KVCache:
    """Write ``R`` rows per layer at slots ``[length, length + R)``, ``length`` unchanged.

    The engine's commit for a forward that did not write the cache
    (:func:`eaglepangu_jax.models.llama.forward_detached`): it writes the accepted path's
    rows, root first, already in their final slots, and :func:`commit_length` then advances
    ``length``. Nothing moves, unlike :func:`commit`. The write is one in-place
    ``dynamic_update_slice``; callers keep ``length + R <= S`` (the engine's loop stops
    before a tree no longer fits), since a clamped start would land on committed slots.
    """
    zero = jnp.zeros((), jnp.int32)
    at = (zero, cache.length.astype(jnp.int32), zero, zero)
    return dataclasses.replace(
        cache,
        k=jax.lax.dynamic_update_slice(cache.k, k_rows.astype(cache.k.dtype), at),
        v=jax.lax.dynamic_update_slice(cache.v, v_rows.astype(cache.v.dtype), at),
    )


def commit(cache: KVCache, path: Int[ArrayLike, " D+1"], length: Int[ArrayLike, ""]) -> KVCache:
    """Commit the root and ``length`` accepted nodes along ``path``; advance by ``length + 1``.

    The node accepted at depth ``k`` (tree slot ``path[k]``, cache slot ``cache.length +
    path[k]``) moves to cache slot ``cache.length + k`` for ``k = 0..length``. All sources are
    read before any write, so overlapping moves are safe.

    Prefix-sharing fast path: entries already in place (``path[k] == k``: the root, any chain,
    the leading chain segment of a path) are not moved. Only the newly accepted segment is
    gathered; when nothing needs to move (``lax.cond`` on that dynamic condition) the buffers
    are returned untouched. Under ``jax.vmap`` the cond becomes a select (both sides run).

    The move is one gather of a ``D + 1``-slot window followed by one contiguous
    ``dynamic_update_slice`` (window slots outside the segment are rewritten with their own
    value), so every index is in ``[0, S)`` and no scatter with duplicate targets exists.

    Args:
      cache: the cache after the verify forward wrote the tree at ``[length, length + N)``.
      path: ``[D + 1]`` int32 tree slots from the root (``path[0] == 0``); entries past
        ``length`` are ignored.
      length: int32 scalar, accepted draft nodes (root excluded), clipped to ``[0, D]``.

    Returns:
      The cache with ``length`` advanced by ``length + 1`` (clipped to ``S``). Sources outside
      the cache are left where they are (callers check capacity, see :func:`capacity_check`).
    """
    path = jnp.asarray(path, jnp.int32)
    if path.ndim != 1 or path.shape[0] < 1:
        raise ValueError(f"path must be a non-empty 1-D array of slots, got shape {path.shape}")
    width, slots = path.shape[0], cache.num_slots
    if width > slots:
        raise ValueError(f"a path of {width} entries cannot fit a cache of {slots} slots")
    accepted = jnp.clip(jnp.asarray(length, jnp.int32), 0, width - 1)
    base = cache.length
    # A window of `width` slots holding every destination base + k that lies inside the cache.
    start = jnp.clip(base, 0, slots - width)
    window = start + jnp.arange(width, dtype=jnp.int32)  # cache slots, all in [0, S)
    depth = window - base  # which path entry lands at each window slot (may be out of range)
    on_path = (depth >= 0) & (depth <= accepted)
    entry = path[jnp.clip(depth, 0, width - 1)]
    source = base + entry
    move = on_path & (entry != depth) & (source >= 0) & (source < slots)
    gather_from = jnp.where(move, source, window)

    def reorder(kv: Float[Array, "L S K Dh"]) -> Float[Array, "L S K Dh"]:
        rows = kv[:, gather_from]  # read every source before writing anything
        return jax.lax.dynamic_update_slice_in_dim(kv, rows, start, axis=1)

    k, v = jax.lax.cond(
        jnp.any(move),
        lambda kv: (reorder(kv[0]), reorder(kv[1])),
        lambda kv: kv,
        (cache.k, cache.v),
    )
    return dataclasses.replace(cache, k=k, v=v, length=jnp.minimum(base + accepted + 1, slots))


def commit_acceptance(cache: KVCache, acceptance: Any) -> KVCache:
    """:func:`commit` with ``acceptance.path`` and ``acceptance.length`` (a verify result)."""
    return commit(cache, acceptance.path, acceptance.length)


def commit_length(cache: KVCache, length: Int[ArrayLike, ""]) -> KVCache:
    """Commit by length, for chains: root + ``length`` accepted nodes are already in place.

    Equivalent to :func:`commit` with ``path = arange(D + 1)``, without any data movement:
    ``cache.length`` advances by ``length + 1``.
    """
    return advance(cache, jnp.maximum(jnp.asarray(length, jnp.int32), 0) + 1)


def advance(cache: KVCache, n: Int[ArrayLike, ""]) -> KVCache:
    """Commit ``n`` slots written in place (e.g. after a prefill of ``n`` tokens).

    The new length is clipped to ``[0, S]`` so it always stays a valid slot bound.
    """
    n = jnp.asarray(n, jnp.int32)
    return dataclasses.replace(cache, length=jnp.clip(cache.length + n, 0, cache.num_slots))


def truncate(cache: KVCache, n: Int[ArrayLike, ""]) -> KVCache:
    """Set the committed length to ``n`` (clipped to ``[0, S]``), e.g. to restart a turn.

    Slots past ``n`` keep stale K/V; they are never attended to and get overwritten.
    """
    n = jnp.asarray(n, jnp.int32)
    return dataclasses.replace(cache, length=jnp.clip(n, 0, cache.num_slots))


def capacity_check(cache: KVCache, needed: int) -> None:
    """Host-side: raise ``ValueError`` unless ``needed`` more slots fit after ``length``.

    Call it before a forward that writes ``needed`` slots (a prefill of ``T`` tokens, a verify
    over ``N`` tree slots). Works on batched caches (checks the longest). Not jittable: it
    reads the concrete length.
    """
    needed = int(needed)
    if needed < 0:
        raise ValueError(f"needed must be >= 0, got {needed}")
    if isinstance(cache.length, jax.core.Tracer):
        raise ValueError("capacity_check runs on the host; call it outside jit")
    used = int(np.max(np.asarray(cache.length)))
    if used + needed > cache.num_slots:
        raise ValueError(
            f"KV cache overflow: {used} committed slots + {needed} new ones exceed its "
            f"{cache.num_slots} slots; allocate a larger cache or truncate the context"
        )
