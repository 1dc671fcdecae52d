"""Path scores and best-first speculation trees under factorised draft marginals.

A node's **path score** is the draft probability of its whole prefix, ``rho(i) = prod q_k(x_ik)``
over the depths ``k`` on its root path; trees keep it as a log-probability (``Tree.logscore``,
0 at the root). BASTION's surrogate for the expected accepted length is
``A(T) = sum_{i in T} rho(i)`` with the root counting 1 (it stands for the bonus token).

With one marginal per depth (a block drafter), a child never scores above its parent, so the
``B`` best prefixes form a tree and maximise ``A`` over all ``B``-node trees (DDTree).
:func:`best_first` finds them with a fixed-shape heap.

**Tie rule** (makes every result reproducible): candidates are ordered by score (higher first),
then by the slot of their parent (earlier first), then by token rank at their depth (lower
first); token ranks order equal log-probabilities by token id. NaN log-probabilities count as
``-inf``; a ``-inf`` prefix is never kept.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float, Int

from eaglepangu_jax import tree as tree_lib

__all__ = ["path_logscores", "expected_accept", "best_first"]


def _nan_to_neg_inf(x: Float[Array, "..."]) -> Float[Array, "..."]:
    return jnp.where(jnp.isnan(x), -jnp.inf, x)


def path_logscores(
    parents: Int[ArrayLike, " N"], token_logprobs: Float[ArrayLike, " N"]
) -> Float[Array, " N"]:
    """Cumulative log-probability of each slot's root path (the root scores 0).

    Uses pointer doubling (``ceil(log2 N)`` gather rounds), so it is jittable with no loop over
    nodes and needs no maximum depth.

    Args:
      parents: ``[N]`` topologically ordered parent slots (``0 <= parents[i] < i``). A slot
        whose parent breaks that rule is cut off: it and its descendants score ``-inf``.
      token_logprobs: ``[N]`` log-probability of each slot's own token; entry 0 is ignored.
        NaN counts as ``-inf``.

    Returns:
      ``[N]`` float32 path log-scores.
    """
    parents = jnp.asarray(parents, jnp.int32)
    own = _nan_to_neg_inf(jnp.asarray(token_logprobs, jnp.float32))
    if parents.ndim != 1 or own.shape != parents.shape:
        raise ValueError(
            f"parents {parents.shape} and token_logprobs {own.shape} must be "
            "1-D arrays of the same length"
        )
    n = parents.shape[0]
    index = jnp.arange(n, dtype=jnp.int32)
    ok = (parents >= 0) & (parents < index)
    up = jnp.where(ok, parents, 0).at[0].set(0)
    score = jnp.where(ok, own, -jnp.inf).at[0].set(0.0)
    # Invariant after k rounds: score[i] sums the 2^k nearest path entries from i up and
    # up[i] is the 2^k-th ancestor. The root is a fixed point with score 0, so overshooting
    # past it adds nothing.
    for _ in range(max(n - 1, 1).bit_length()):
        score = score + score[up]
        up = up[up]
    return score


def expected_accept(tree: tree_lib.Tree) -> Float[Array, ""]:
    """BASTION's surrogate ``A(T)``: sum of ``exp(logscore)`` over valid slots, root = 1."""
    p = jnp.where(tree.valid, jnp.exp(_nan_to_neg_inf(tree.logscore)), 0.0)
    return jnp.sum(p.at[0].set(1.0))


def best_first(
    marginal_logprobs: Float[ArrayLike, "D V"],
    root_token: Int[ArrayLike, ""],
    *,
    budget: int,
    top_k: int | None = None,
    n_nodes: Int[ArrayLike, ""] | None = None,
) -> tree_lib.Tree:
    """The ``budget`` highest-scoring prefixes under per-depth marginals, as a tree.

    Slot ``t`` (1-based) holds the ``t``-th best prefix under the module's tie rule, so scores
    never increase with the slot and every parent precedes its children. Runs a best-first
    search: popping a prefix pushes its first child (append the top token of the next depth)
    and its next sibling (swap the last token for the next-ranked one); each prefix has exactly
    one such generator, so pops come out in order. The frontier lives in a fixed pool of
    ``2 * budget + 1`` candidates searched by argmax (``O(budget^2)``; budgets are small).
    A popped node's parent is carried by index from the pop that pushed it, never searched for.

    Jittable with ``budget`` and ``top_k`` static; ``vmap`` over a batch of marginals.

    Args:
      marginal_logprobs: ``[D, V]`` draft log-probabilities per depth (row ``k`` scores the
        token at depth ``k + 1``). NaN counts as ``-inf``; values above 0 are clipped to 0
        (a probability cannot exceed 1, and the search relies on children never outscoring
        their parent).
      root_token: token id stored in the root slot (the last committed token).
      budget: number of draft nodes ``B``; the tree has ``B + 1`` slots.
      top_k: consider only the ``top_k`` best tokens per depth (default and cap:
        ``min(B, V)``, which loses nothing: a token ranked ``>= B`` has ``B`` better siblings).
      n_nodes: optional dynamic node count in ``[0, B]`` (clipped); slots past it become
        padding without recompiling. Default ``B``.

    Returns:
      A :class:`~eaglepangu_jax.tree.Tree` with ``B + 1`` slots and ``max_depth = D``. Slots
      whose prefix scores ``-inf`` (no finite prefix left) are padding.
    """
    lp = jnp.asarray(marginal_logprobs, jnp.float32)
    if lp.ndim != 2 or lp.shape[0] < 1 or lp.shape[1] < 1:
        raise ValueError(f"marginal_logprobs must have shape [D, V] with D, V >= 1, got {lp.shape}")
    if not isinstance(budget, int) or budget < 1:
        raise ValueError(f"budget must be a positive static int, got {budget!r}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    depth_max, vocab = lp.shape
    k = min(budget, vocab, top_k or budget)
    # ``>= 0`` also maps -0.0 to +0.0: top_k orders -0.0 below +0.0, which would break the
    # token-id tie rule between equal probabilities.
    lp = jnp.where(lp >= 0, 0.0, _nan_to_neg_inf(lp))
    top_lp, top_tok = jax.lax.top_k(lp, k)  # [D, K]; equal values keep the lower token id first
    # Without the barrier XLA on CPU fuses what follows into the top-k and sorts the whole
    # vocabulary per depth instead (measured 63 ms -> 0.5 ms per round, identical trees).
    top_lp, top_tok = jax.lax.optimization_barrier((top_lp, top_tok))

    slots, pool = budget + 1, 2 * budget + 1
    # Candidate pool: a candidate is (score, parent slot, depth row, rank at that row).
    init = dict(
        score=jnp.full((pool,), -jnp.inf, jnp.float32).at[0].set(top_lp[0, 0]),
        parent=jnp.zeros((pool,), jnp.int32),
        row=jnp.zeros((pool,), jnp.int32),
        rank=jnp.zeros((pool,), jnp.int32),
        live=jnp.zeros((pool,), bool).at[0].set(True),
        count=jnp.int32(1),
        out_parent=jnp.zeros((slots,), jnp.int32),
        out_token=jnp.zeros((slots,), jnp.int32).at[0].set(jnp.asarray(root_token, jnp.int32)),
        out_score=jnp.full((slots,), -jnp.inf, jnp.float32).at[0].set(0.0),
    )

    def push(c, keep, score, parent, row, rank):
        # Writes at the first free entry; a discarded push is overwritten by the next one.
        at = c["count"]
        c = dict(
            c,
            score=c["score"].at[at].set(score),
            parent=c["parent"].at[at].set(parent),
            row=c["row"].at[at].set(row),
            rank=c["rank"].at[at].set(rank),
            live=c["live"].at[at].set(keep),
        )
        return dict(c, count=at + keep.astype(jnp.int32))

    def pop(slot, c):
        score = jnp.where(c["live"], c["score"], -jnp.inf)
        best = jnp.max(score)
        tie = c["live"] & (score == best)
        code = jnp.where(tie, c["parent"] * k + c["rank"], jnp.iinfo(jnp.int32).max)
        pick = jnp.argmin(code)
        found = best > -jnp.inf  # else only -inf prefixes remain: this and later slots pad
        parent, row, rank = c["parent"][pick], c["row"][pick], c["rank"][pick]
        c = dict(
            c,
            live=c["live"].at[pick].set(False),
            out_parent=c["out_parent"].at[slot].set(jnp.where(found, parent, 0)),
            out_token=c["out_token"].at[slot].set(jnp.where(found, top_tok[row, rank], 0)),
            out_score=c["out_score"].at[slot].set(jnp.where(found, best, -jnp.inf)),
        )
        child_row = jnp.minimum(row + 1, depth_max - 1)
        c = push(
            c,
            found & (row + 1 < depth_max),
            best + top_lp[child_row, 0],
            slot,
            child_row,
            jnp.int32(0),
        )
        sibling = jnp.minimum(rank + 1, k - 1)
        return push(
            c,
            found & (rank + 1 < k),
            c["out_score"][parent] + top_lp[row, sibling],
            parent,
            row,
            sibling,
        )

    c = jax.lax.fori_loop(1, slots, pop, init)
    limit = budget if n_nodes is None else jnp.clip(jnp.asarray(n_nodes, jnp.int32), 0, budget)
    index = jnp.arange(slots, dtype=jnp.int32)
    valid = (index <= limit) & (c["out_score"] > -jnp.inf)
    return tree_lib.from_parents(
        c["out_parent"],
        tokens=c["out_token"],
        valid=valid,
        logscore=c["out_score"],
        max_depth=depth_max,
    )
