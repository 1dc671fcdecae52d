"""A table of the most frequent next token after each short context, counted over a corpus.

The teacher's own answers repeat its phrasing across prompts ("Here are some ...", list
markers, code idioms). Counting, over a corpus of those answers, which token most often
follows each context of the last ``k = 1 .. K`` tokens gives a backoff n-gram model that
predicts a continuation with no forward pass: a few hashed lookups per drafted token.

Two halves:

* **Counting** (host, numpy): :func:`count_table` turns token sequences into
  :class:`CountedTable` rows, one per context ``(order, c_1 .. c_K)`` with its most frequent
  next token (ties: the smallest id) and the counts. Deterministic: the same sequences give
  the same rows in the same order.
* **Lookup** (jittable): :func:`hash_table` places the rows in an open-addressing table of
  ``2**bits`` slots (:class:`HashedTable`, a pytree of fixed shapes); :func:`predict` reads
  the longest known context's next token and :func:`continuation` chains ``D`` predictions.
  A lookup reads :data:`PROBES` consecutive slots from the context's hash (masked into range,
  never a negative or wrapping index); rows that would sit further from their hash are left
  out when the table is built (most frequent rows placed first; :attr:`HashedTable.dropped`
  counts them).

Keys: ``hi = order << 16 | c_1`` and ``lo = c_2 << 16 | c_3`` (``K = 3``; a shorter context is
right-aligned, its leading entries 0), so token ids must be below ``2**16``; an empty slot
has ``hi = 0`` (order 0 is never stored).

Dimensions: ``T`` table slots, ``R`` rows, ``D`` continuation depth.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Bool, Float, Int, UInt32

__all__ = [
    "MAX_ORDER",
    "PROBES",
    "CountedTable",
    "HashedTable",
    "count_table",
    "context_keys",
    "slot_of",
    "hash_table",
    "predict",
    "continuation",
]

MAX_ORDER = 3  # contexts of up to three tokens: (order, three ids) fits two uint32 words
PROBES = 8  # slots read per lookup (linear probing)
_ID_LIMIT = 1 << 16


@dataclasses.dataclass(frozen=True)
class CountedTable:
    """Counted rows (host arrays), one per context seen at least ``min_count`` times with its
    best next token.

    Attributes:
      order: ``[R]`` context length ``1 .. MAX_ORDER``.
      context: ``[R, MAX_ORDER]`` context ids, right-aligned (leading entries 0).
      next_token: ``[R]`` the most frequent next token.
      count: ``[R]`` how often it followed the context.
      total: ``[R]`` how often the context was followed by anything.
    """

    order: np.ndarray
    context: np.ndarray
    next_token: np.ndarray
    count: np.ndarray
    total: np.ndarray

    def __len__(self) -> int:
        return int(self.order.shape[0])


def count_table(
    sequences: Iterable[Sequence[int]], *, max_order: int = MAX_ORDER, min_count: int = 2
) -> CountedTable:
    """Count, for every context of ``1 .. max_order`` tokens inside a sequence, its most
    frequent next token; keep contexts whose best next token was seen ``min_count`` times.

    Raises:
      ValueError: ``max_order`` outside ``1 .. MAX_ORDER``, ``min_count < 1``, or an id
        outside ``[0, 2**16)``.
    """
    if not 1 <= max_order <= MAX_ORDER:
        raise ValueError(f"max_order must be in 1..{MAX_ORDER}, got {max_order}")
    if min_count < 1:
        raise ValueError(f"min_count must be >= 1, got {min_count}")
    arrays = [np.asarray(s, np.int64).reshape(-1) for s in sequences]
    flat = np.concatenate(arrays) if arrays else np.zeros((0,), np.int64)
    if flat.size and (flat.min() < 0 or flat.max() >= _ID_LIMIT):
        raise ValueError(f"token ids must lie in [0, {_ID_LIMIT}) for the n-gram table")
    # Position of each token inside its sequence: a context may not cross a boundary.
    lengths = np.asarray([a.size for a in arrays], np.int64)
    inside = np.arange(flat.size) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    last_in_seq = np.repeat(np.cumsum(lengths) - 1, lengths)
    rows = []
    for k in range(1, max_order + 1):
        # A context ends at i (its tokens i-k+1 .. i) and its next token is i+1.
        ends = np.nonzero((inside >= k - 1) & (np.arange(flat.size) < last_in_seq))[0]
        if ends.size == 0:  # no sequence holds a context of k tokens and a next token
            continue
        key = np.zeros(ends.size, np.uint64)
        for j in range(k):  # the context's tokens, oldest first, 16 bits each
            key = (key << np.uint64(16)) | flat[ends - k + 1 + j].astype(np.uint64)
        pair = (key << np.uint64(16)) | flat[ends + 1].astype(np.uint64)
        pairs, counts = np.unique(pair, return_counts=True)  # sorted: by context, then next
        contexts = pairs >> np.uint64(16)
        starts = np.flatnonzero(np.r_[True, contexts[1:] != contexts[:-1]])
        totals = np.add.reduceat(counts, starts)
        # The best next token per context: highest count, then smallest id (first in order).
        group = np.repeat(np.arange(starts.size), np.diff(np.r_[starts, pairs.size]))
        order_in = np.lexsort((np.arange(pairs.size), -counts, group))
        first = order_in[np.r_[True, group[order_in][1:] != group[order_in][:-1]]]
        keep = counts[first] >= min_count
        first = first[keep]
        ctx = np.zeros((first.size, MAX_ORDER), np.int64)
        for j in range(k):
            shift = np.uint64(16 * (k - 1 - j))
            ctx[:, MAX_ORDER - k + j] = ((contexts[first] >> shift) & np.uint64(0xFFFF)).astype(
                np.int64
            )
        rows.append(
            (
                np.full(first.size, k, np.int32),
                ctx.astype(np.int32),
                (pairs[first] & np.uint64(0xFFFF)).astype(np.int32),
                counts[first].astype(np.int64),
                totals[keep].astype(np.int64),
            )
        )
    if not rows:
        empty = np.zeros((0,), np.int64)
        return CountedTable(empty, np.zeros((0, MAX_ORDER), np.int64), empty, empty, empty)
    order, context, next_token, count, total = (np.concatenate(x) for x in zip(*rows))
    return CountedTable(order, context, next_token, count, total)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class HashedTable:
    """The rows of a :class:`CountedTable` in ``T = 2**bits`` hashed slots (a pytree; every
    field an array so it can be drafter weights)."""

    hi: UInt32[Array, " T"]  # order << 16 | c_1; 0 marks an empty slot
    lo: UInt32[Array, " T"]  # c_2 << 16 | c_3
    next_token: Int[Array, " T"]
    logprob: Float[Array, " T"]  # log(count / total): how often the next token followed
    dropped: Int[Array, ""]  # rows left out (further than PROBES slots from their hash)

    @property
    def num_slots(self) -> int:
        return int(self.hi.shape[0])


def context_keys(
    order: Int[ArrayLike, "..."], context: Int[ArrayLike, "... K"]
) -> tuple[UInt32[Array, "..."], UInt32[Array, "..."]]:
    """The ``(hi, lo)`` key words of right-aligned contexts (``K = MAX_ORDER``)."""
    order = jnp.asarray(order, jnp.uint32)
    context = jnp.asarray(context, jnp.uint32)
    hi = (order << 16) | context[..., 0]
    lo = (context[..., 1] << 16) | context[..., 2]
    return hi, lo


def slot_of(hi: UInt32[ArrayLike, "..."], lo: UInt32[ArrayLike, "..."], bits: int):
    """Home slot in ``[0, 2**bits)`` of a key (a multiplicative hash; uint32 arithmetic wraps
    identically on every backend)."""
    h = jnp.asarray(hi, jnp.uint32) * jnp.uint32(0x9E3779B1) ^ jnp.asarray(
        lo, jnp.uint32
    ) * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 15)
    h = h * jnp.uint32(0x2C1B3C6D)
    h = h ^ (h >> 13)
    return (h >> (32 - bits)).astype(jnp.int32) if bits else jnp.zeros_like(h, jnp.int32)


def hash_table(counted: CountedTable, *, bits: int | None = None) -> HashedTable:
    """Place ``counted``'s rows in ``2**bits`` slots by linear probing, most frequent rows
    first (``bits=None``: the smallest table at most half full)."""
    n = len(counted)
    if bits is None:
        bits = max(4, int(np.ceil(np.log2(max(2 * n, 1)))))
    if not 1 <= bits <= 30:
        raise ValueError(f"bits must be in 1..30, got {bits}")
    size = 1 << bits
    hi, lo = (np.asarray(x) for x in context_keys(counted.order, counted.context))
    home = np.asarray(slot_of(hi, lo, bits))
    table_hi = np.zeros(size, np.uint32)
    table_lo = np.zeros(size, np.uint32)
    table_next = np.zeros(size, np.int32)
    table_lp = np.full(size, -np.inf, np.float32)
    logprob = np.log(counted.count / np.maximum(counted.total, 1)).astype(np.float32)
    dropped = 0
    # Most frequent first (ties: row order), so the rows most often asked for sit at home.
    for r in np.lexsort((np.arange(n), -counted.count)).tolist():
        for probe in range(PROBES):
            s = (home[r] + probe) & (size - 1)
            if table_hi[s] == 0:
                table_hi[s], table_lo[s] = hi[r], lo[r]
                table_next[s], table_lp[s] = counted.next_token[r], logprob[r]
                break
        else:
            dropped += 1
    return HashedTable(
        hi=jnp.asarray(table_hi),
        lo=jnp.asarray(table_lo),
        next_token=jnp.asarray(table_next),
        logprob=jnp.asarray(table_lp),
        dropped=jnp.asarray(dropped, jnp.int32),
    )


def predict(
    table: HashedTable, recent: Int[ArrayLike, " K"], available: Int[ArrayLike, ""]
) -> tuple[Int[Array, ""], Float[Array, ""], Bool[Array, ""]]:
    """The next token after the longest known context among the last ``1 .. available``
    tokens of ``recent`` (``[MAX_ORDER]``, newest last).

    Returns:
      ``(token, logprob, found)``; ``token`` 0 and ``logprob`` ``-inf`` when no context of
      any order is in the table.
    """
    recent = jnp.asarray(recent, jnp.int32)
    bits = int(np.log2(table.num_slots))
    orders = jnp.arange(MAX_ORDER, 0, -1, dtype=jnp.int32)  # longest first
    # Right-aligned context of each order: entries before its first token read as 0.
    column = jnp.arange(MAX_ORDER, dtype=jnp.int32)
    contexts = jnp.where(column[None, :] >= MAX_ORDER - orders[:, None], recent[None, :], 0)
    hi, lo = context_keys(orders, contexts)
    slots = (slot_of(hi, lo, bits)[:, None] + jnp.arange(PROBES)[None, :]) & (table.num_slots - 1)
    match = (table.hi[slots] == hi[:, None]) & (table.lo[slots] == lo[:, None])  # [K, P]
    usable = jnp.any(match, axis=1) & (orders <= jnp.asarray(available, jnp.int32))
    slot = slots[jnp.arange(MAX_ORDER), jnp.argmax(match, axis=1)]
    best = jnp.argmax(usable)  # the first usable order is the longest
    found = jnp.any(usable)
    token = jnp.where(found, table.next_token[slot[best]], 0)
    logprob = jnp.where(found, table.logprob[slot[best]], -jnp.inf)
    return token, logprob, found


def continuation(
    table: HashedTable, recent: Int[ArrayLike, " K"], available: Int[ArrayLike, ""], depth: int
) -> tuple[Int[Array, " D"], Float[Array, " D"], Int[Array, ""]]:
    """``depth`` chained predictions, each read after the previous ones (greedy backoff).

    Returns:
      ``(tokens, logprobs, length)``: the chain stops at the first context the table does not
      know; entries past ``length`` are 0 / ``-inf``.
    """
    recent = jnp.asarray(recent, jnp.int32)
    available = jnp.asarray(available, jnp.int32)
    tokens, logprobs = [], []
    alive = jnp.asarray(True)
    length = jnp.zeros((), jnp.int32)
    for _ in range(depth):
        token, logprob, found = predict(table, recent, available)
        alive = alive & found
        tokens.append(jnp.where(alive, token, 0))
        logprobs.append(jnp.where(alive, logprob, -jnp.inf))
        length = length + alive.astype(jnp.int32)
        recent = jnp.concatenate([recent[1:], token[None]])
        available = jnp.minimum(available + 1, MAX_ORDER)
    return jnp.stack(tokens), jnp.stack(logprobs), length
