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

Keys: three uint32 words, ``order << 16 | c_1``, ``c_2 << 16 | c_3`` and ``c_4 << 16 | c_5``
(``K = 5``; a shorter context is right-aligned, its leading entries 0), so token ids must be
below ``2**16``; an empty slot's first word is 0 (order 0 is never stored). Contexts of four
and five tokens predict the teacher's held-out answers better than three offline (chained six
deep, 0.77 tokens right per position against 0.71), but in the engine, beside prompt lookup,
they drafted no faster, so the packaged table counts three (docs/RESULTS.md, session 35).

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
    "KEY_WORDS",
    "PROBES",
    "CountedTable",
    "HashedTable",
    "count_table",
    "prune_redundant",
    "context_keys",
    "slot_of",
    "hash_table",
    "predict",
    "continuation",
]

MAX_ORDER = 5  # contexts of up to five tokens: (order, five ids) fits three uint32 words
KEY_WORDS = 3
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
        # Columns: the context's tokens, oldest first, then the next token; sorted by them
        # (lexsort's last key is its primary one), equal rows are one (context, next) pair.
        columns = [flat[ends - k + 1 + j] for j in range(k)] + [flat[ends + 1]]
        order_of = np.lexsort(columns[::-1])
        table = np.stack([c[order_of] for c in columns], axis=1)  # [N, k + 1]
        new_pair = np.r_[True, np.any(table[1:] != table[:-1], axis=1)]
        pair_starts = np.flatnonzero(new_pair)
        pairs = table[pair_starts]  # sorted: by context, then next
        counts = np.diff(np.r_[pair_starts, table.shape[0]])
        contexts = pairs[:, :k]
        starts = np.flatnonzero(np.r_[True, np.any(contexts[1:] != contexts[:-1], axis=1)])
        totals = np.add.reduceat(counts, starts)
        # The best next token per context: highest count, then smallest id (first in order).
        group = np.repeat(np.arange(starts.size), np.diff(np.r_[starts, pairs.shape[0]]))
        order_in = np.lexsort((np.arange(pairs.shape[0]), -counts, group))
        first = order_in[np.r_[True, group[order_in][1:] != group[order_in][:-1]]]
        keep = counts[first] >= min_count
        first = first[keep]
        ctx = np.zeros((first.size, MAX_ORDER), np.int64)
        ctx[:, MAX_ORDER - k :] = contexts[first]
        rows.append(
            (
                np.full(first.size, k, np.int32),
                ctx.astype(np.int32),
                pairs[first, k].astype(np.int32),
                counts[first].astype(np.int64),
                totals[keep].astype(np.int64),
            )
        )
    if not rows:
        empty = np.zeros((0,), np.int64)
        return CountedTable(empty, np.zeros((0, MAX_ORDER), np.int64), empty, empty, empty)
    order, context, next_token, count, total = (np.concatenate(x) for x in zip(*rows))
    return CountedTable(order, context, next_token, count, total)


def prune_redundant(counted: CountedTable) -> CountedTable:
    """``counted`` without the rows that :func:`predict` does not need: a context of ``k >= 2``
    tokens whose best next token is the one its last ``k - 1`` tokens already predict (by
    backoff, the lookup then finds the shorter context's row and the same token).

    Every context's predicted token is unchanged, so :func:`continuation` chains the same
    tokens; the frequency reported for a pruned context is its shorter context's. Rows keep
    their order. Most long contexts are redundant (over the packaged corpora, 92% of the
    five-token ones), which makes a table of five-token contexts smaller than one of three.
    """
    n = len(counted)
    if n == 0:
        return counted
    order = counted.order.astype(np.int64)
    context = counted.context.astype(np.int64)
    # Pruning a row keeps its context's prediction, so whether a row is redundant depends only
    # on the unpruned table: compare with the row of the context one token shorter.
    best = {
        (int(o), *context[r, MAX_ORDER - int(o) :].tolist()): int(counted.next_token[r])
        for r, o in enumerate(order.tolist())
    }
    keep = np.ones(n, bool)
    for r, o in enumerate(order.tolist()):
        if o >= 2:
            shorter = (o - 1, *context[r, MAX_ORDER - o + 1 :].tolist())
            keep[r] = best.get(shorter) != int(counted.next_token[r])
    return CountedTable(
        counted.order[keep],
        counted.context[keep],
        counted.next_token[keep],
        counted.count[keep],
        counted.total[keep],
    )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class HashedTable:
    """The rows of a :class:`CountedTable` in ``T = 2**bits`` hashed slots (a pytree; every
    field an array so it can be drafter weights)."""

    keys: UInt32[Array, "T W"]  # context_keys of the slot's row; keys[:, 0] == 0: empty
    next_token: Int[Array, " T"]
    logprob: Float[Array, " T"]  # log(count / total): how often the next token followed
    dropped: Int[Array, ""]  # rows left out (further than PROBES slots from their hash)

    @property
    def num_slots(self) -> int:
        return int(self.keys.shape[0])


def context_keys(
    order: Int[ArrayLike, "..."], context: Int[ArrayLike, "... K"]
) -> UInt32[Array, "... W"]:
    """The ``KEY_WORDS`` key words of right-aligned contexts (``K = MAX_ORDER``):
    ``order << 16 | c_1``, ``c_2 << 16 | c_3``, ``c_4 << 16 | c_5``."""
    order = jnp.asarray(order, jnp.uint32)
    context = jnp.asarray(context, jnp.uint32)
    words = [(order << 16) | context[..., 0]]
    words += [(context[..., j] << 16) | context[..., j + 1] for j in range(1, MAX_ORDER, 2)]
    return jnp.stack(words, axis=-1)


# One odd multiplier per key word (a multiplicative hash of each, summed by xor).
_WORD_MULTIPLIERS = (0x9E3779B1, 0x85EBCA6B, 0xC2B2AE35)


def slot_of(keys: UInt32[ArrayLike, "... W"], bits: int) -> Int[Array, "..."]:
    """Home slot in ``[0, 2**bits)`` of keys (a multiplicative hash; uint32 arithmetic wraps
    identically on every backend)."""
    keys = jnp.asarray(keys, jnp.uint32)
    h = keys[..., 0] * jnp.uint32(_WORD_MULTIPLIERS[0])
    for w in range(1, KEY_WORDS):
        # Mixed before the next word joins, so words equal up to a swap hash apart.
        h = (h ^ (h >> 16)) * jnp.uint32(0x7FEB352D)
        h = h ^ keys[..., w] * jnp.uint32(_WORD_MULTIPLIERS[w])
    # A 32-bit finaliser (xor-shift, multiply) so every key bit reaches the top bits used.
    h = (h ^ (h >> 16)) * jnp.uint32(0x85EBCA6B)
    h = (h ^ (h >> 13)) * jnp.uint32(0xC2B2AE35)
    h = h ^ (h >> 16)
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
    keys = np.asarray(context_keys(counted.order, counted.context)).reshape(n, KEY_WORDS)
    home = np.asarray(slot_of(keys, bits))
    table_keys = np.zeros((size, KEY_WORDS), np.uint32)
    table_next = np.zeros(size, np.int32)
    table_lp = np.full(size, -np.inf, np.float32)
    logprob = np.log(counted.count / np.maximum(counted.total, 1)).astype(np.float32)
    dropped = 0
    # Most frequent first (ties: row order), so the rows most often asked for sit at home.
    for r in np.lexsort((np.arange(n), -counted.count)).tolist():
        for probe in range(PROBES):
            s = (home[r] + probe) & (size - 1)
            if table_keys[s, 0] == 0:
                table_keys[s] = keys[r]
                table_next[s], table_lp[s] = counted.next_token[r], logprob[r]
                break
        else:
            dropped += 1
    return HashedTable(
        keys=jnp.asarray(table_keys),
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
    keys = context_keys(orders, contexts)  # [K, W]
    slots = (slot_of(keys, bits)[:, None] + jnp.arange(PROBES)[None, :]) & (table.num_slots - 1)
    match = jnp.all(table.keys[slots] == keys[:, None, :], axis=-1)  # [K, P]
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
