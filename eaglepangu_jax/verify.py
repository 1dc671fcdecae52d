"""Lossless acceptance: which drafted nodes the teacher keeps, and the bonus token it adds.

The teacher scores every tree slot in one forward, giving ``logits`` ``[N, V]``: row ``u`` is the
teacher's distribution for the token *after* slot ``u`` (given ``u``'s ancestors). Acceptance
walks down from the virtual root (slot 0): at node ``u`` it picks one child to descend into, or
stops and emits a *bonus* token drawn from (what is left of) row ``u``. Three rules:

* :func:`greedy`: descend while ``argmax logits[u]`` is the token of a valid child of ``u``;
  the bonus is the argmax at the stop node.
* :func:`sample` without ``draft_probs`` (deterministic children, e.g. top-k / best-first
  trees): lossless sampling. The sequential rule "accept child ``x_i`` with probability
  ``p_i(x_i)``, on rejection zero ``x_i`` in ``p`` and renormalise; if all are rejected draw the
  bonus from the residual" accepts the first child carrying token ``y`` with probability
  ``p(y)`` (a later duplicate of ``y`` has probability 0 left) and otherwise emits a token from
  ``p`` restricted to the tokens no child carries. That is exactly the law of "draw ``y ~ p``
  once per row; descend into the first (lowest-slot) valid child whose token is ``y``, else emit
  ``y``", which is what is computed here: one draw per row, no loop over children. Every emitted
  token is a fresh draw from the teacher given the emitted prefix, so the output distribution is
  the teacher's for *any* tree fixed before the draws.
* :func:`sample` with ``draft_probs`` (sampled children): SpecInfer multi-step speculative
  sampling, which accepts more often when the children really were drawn from ``q``; see
  :func:`sample` for the variants and why they are lossless.

The teacher's distribution is first adjusted by temperature and top-p
(:func:`adjusted_probs`); temperature 0 means argmax, and then :func:`sample` returns exactly
what :func:`greedy` returns.

**Degenerate rows.** A logits row with a NaN or ``+inf`` entry, or with no finite entry, has no
usable distribution. Acceptance never descends *from* such a row: it stops there, sets
``Acceptance.ok`` to False, and the bonus is the row's first largest non-NaN entry (index 0 for
an all-NaN / all ``-inf`` row), so every index stays in range. In reference mode
(:mod:`eaglepangu_jax.mode`) a degenerate row at any valid slot raises
:class:`DegenerateLogitsError` instead (eagerly at once; under ``jax.jit`` wrap the jitted
function with :func:`eaglepangu_jax.mode.checked`), and the tree's invariants are checked too.

Everything here is jittable and vmappable over a batch of ``(tree, logits, key)``; temperature
and top-p may be traced values, so changing them never recompiles.

Dimensions: ``N`` slots (root included), ``D`` maximum depth, ``V`` vocabulary.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify
from jaxtyping import Array, ArrayLike, Bool, Float, Int

from eaglepangu_jax import mode
from eaglepangu_jax import tree as tree_lib
from eaglepangu_jax.tree import Tree

__all__ = [
    "DegenerateLogitsError",
    "Acceptance",
    "emitted_tokens",
    "degenerate_rows",
    "adjusted_probs",
    "greedy",
    "sample",
]

# Smallest top-p actually used: keeps at least the most likely token when a traced top_p <= 0.
_MIN_TOP_P = 1e-6


class DegenerateLogitsError(ValueError):
    """A teacher logits row at a valid slot holds NaN or +inf, or no finite entry."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Acceptance:
    """Outcome of one verification round (unbatched; under ``vmap`` every field gains ``B``).

    Example: tree ``root -> 1 -> 3``, ``root -> 2`` with ``D = 3``; the teacher accepts slot 1
    then slot 3 and adds bonus token ``b``. Then ``length = 2``, ``path = [0, 1, 3, 3]``,
    ``next_token = b`` and ``tokens = [tok[1], tok[3], b, b]``.
    """

    length: Int[Array, ""]  # [] accepted draft nodes, root excluded; 0 <= length <= D
    path: Int[Array, " D+1"]  # [D + 1] slots from the root (path[0] == 0); after `length` the
    #                          last accepted slot repeats, so every entry is a valid slot index
    next_token: Int[Array, ""]  # [] bonus token drawn at the stop node path[length]
    tokens: Int[Array, " D+1"]  # [D + 1] emitted tokens: tokens[:length] are the accepted
    #                            nodes' tokens, tokens[length:] all equal next_token. The round
    #                            emits tokens[:length + 1].
    ok: Bool[Array, ""]  # [] False when the stop node's logits row was degenerate

    @property
    def stop(self) -> Int[Array, ""]:
        """The slot acceptance stopped at (``path[length]``; the root when nothing matched)."""
        return self.path[..., -1]


def emitted_tokens(acceptance: Acceptance) -> np.ndarray:
    """The tokens one (unbatched) round emits, ``tokens[:length + 1]``, as a host array.

    Host-side helper (its length is data-dependent, so it is not jittable); inside jitted code
    use ``acceptance.tokens`` with ``acceptance.length``.
    """
    length = np.asarray(acceptance.length)
    if length.ndim != 0:
        raise ValueError(
            f"emitted_tokens takes one unbatched Acceptance, got length of shape "
            f"{length.shape}; index the batch first"
        )
    return np.asarray(acceptance.tokens)[: int(length) + 1]


# --------------------------------------------------------------------------------------------
# Teacher distribution
# --------------------------------------------------------------------------------------------


def degenerate_rows(logits: Float[ArrayLike, "... V"]) -> Bool[Array, "..."]:
    """True for rows with a NaN or ``+inf`` entry, or with no finite entry."""
    logits = jnp.asarray(logits)
    broken = jnp.any(jnp.isnan(logits) | (logits == jnp.inf), axis=-1)
    return broken | jnp.all(logits == -jnp.inf, axis=-1)


def _fallback_token(logits: Float[Array, "... V"]) -> Int[Array, "..."]:
    """First largest non-NaN entry of each row (0 when there is none): always in range."""
    return jnp.argmax(jnp.where(jnp.isnan(logits), -jnp.inf, logits), axis=-1).astype(jnp.int32)


def _top_p_filter(probs: Float[Array, "... V"], top_p: Float[Array, ""]) -> Float[Array, "... V"]:
    """Keep the smallest most-likely set reaching mass ``top_p``, renormalised.

    The kept set is ``{p >= c}`` for the largest cutoff ``c`` with ``mass(p >= c) >= top_p``:
    in descending order, tokens are kept until the mass reaches ``top_p`` (the crossing token
    included), and every token tied with the last kept one is kept too, so the result never
    depends on token order. ``c`` is found by bisection on the bit patterns of non-negative
    float32 values, which are ordered like the values: 31 exact halvings, each one pass over
    the vocabulary, where sorting ``N x V`` values would be far slower on CPU.
    """
    bits = jax.lax.bitcast_convert_type(probs, jnp.int32)

    def mass_reaches(threshold_bits):
        kept = jnp.where(bits >= threshold_bits, probs, 0.0)
        return jnp.sum(kept, axis=-1, keepdims=True) >= top_p

    def halve(_, bounds):
        lo, hi = bounds  # invariant: mass_reaches(lo) and not mass_reaches(hi)
        mid = lo + (hi - lo) // 2
        ok = mass_reaches(mid)
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

    shape = probs.shape[:-1] + (1,)
    lo = jnp.zeros(shape, jnp.int32)  # all mass
    hi = jnp.max(bits, axis=-1, keepdims=True) + 1  # nothing kept
    lo, _ = jax.lax.fori_loop(0, 31, halve, (lo, hi))
    kept = jnp.where(bits >= lo, probs, 0.0)
    return kept / jnp.sum(kept, axis=-1, keepdims=True)


def adjusted_probs(
    logits: Float[ArrayLike, "... V"],
    temperature: Float[ArrayLike, ""] = 1.0,
    top_p: Float[ArrayLike, ""] = 1.0,
) -> Float[Array, "... V"]:
    """The teacher's sampling distribution after temperature and top-p, in float32.

    ``softmax(logits / temperature)``, then top-p (nucleus) filtering: keep the most likely
    tokens until their mass reaches ``top_p`` (the token that crosses it included, and every
    token tied with the last one kept), renormalise. Temperature 0 gives the one-hot of the
    argmax (first index on ties), which makes sampling greedy. A degenerate row (see
    :func:`degenerate_rows`) becomes the one-hot of its fallback token, so the result never
    holds NaN.

    Args:
      logits: ``[..., V]`` teacher logits.
      temperature: scalar >= 0 (may be traced).
      top_p: scalar in ``(0, 1]`` (may be traced; 1 disables the filter).

    Returns:
      ``[..., V]`` probabilities, each row summing to 1.
    """
    _check_sampling_params(temperature, top_p)
    logits = jnp.asarray(logits).astype(jnp.float32)
    temperature = jnp.asarray(temperature, jnp.float32)
    top_p = jnp.maximum(jnp.asarray(top_p, jnp.float32), jnp.float32(_MIN_TOP_P))
    vocab = logits.shape[-1]
    fallback = jax.nn.one_hot(_fallback_token(logits), vocab, dtype=jnp.float32)
    hot = temperature > 0
    scaled = logits / jnp.where(hot, temperature, jnp.float32(1.0))
    probs = jax.nn.softmax(scaled, axis=-1)
    # The filter costs a few dozen passes over the vocabulary: skip it when it is off.
    probs = jax.lax.cond(top_p < 1.0, _top_p_filter, lambda p, _: p, probs, top_p)
    probs = jnp.where(hot, probs, fallback)
    bad = degenerate_rows(logits)[..., None]
    return jnp.where(bad, fallback, probs)


def _check_sampling_params(temperature, top_p) -> None:
    for name, value in (("temperature", temperature), ("top_p", top_p)):
        if jnp.ndim(value) != 0:
            raise ValueError(f"{name} must be a scalar, got shape {jnp.shape(value)}")
    if not isinstance(temperature, jax.core.Tracer):
        t = float(temperature)
        if not t >= 0.0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {t}")
    if not isinstance(top_p, jax.core.Tracer):
        p = float(top_p)
        if not 0.0 < p <= 1.0:
            raise ValueError(f"top_p must lie in (0, 1], got {p}")


def _uniforms(key: Array, n: int) -> Float[Array, " N"]:
    """``n`` uniforms where entry ``i`` depends on ``(key, i)`` only, not on ``n``: the engine
    verifies a tree at several slot counts, and the same slot must see the same draw."""
    index = jnp.arange(n, dtype=jnp.int32)
    return jax.vmap(lambda i: jax.random.uniform(jax.random.fold_in(key, i), (), jnp.float32))(
        index
    )


def _sample_rows(key: Array, probs: Float[Array, "N V"]) -> Int[Array, " N"]:
    """One independent draw per row by inverse CDF (one uniform per row, not one per token).

    A zero-probability token is never returned: its CDF interval is empty, and rounding past
    the last step falls back to the last token with positive probability.
    """
    n, vocab = probs.shape
    cdf = jnp.cumsum(probs, axis=-1)
    u = _uniforms(key, n)[:, None] * cdf[:, -1:]
    index = jnp.sum(cdf <= u, axis=-1).astype(jnp.int32)
    positive = probs > 0
    last_positive = (vocab - 1 - jnp.argmax(positive[:, ::-1], axis=-1)).astype(jnp.int32)
    return jnp.minimum(index, last_positive)


# --------------------------------------------------------------------------------------------
# Walks
# --------------------------------------------------------------------------------------------


def _first_match_stop(
    tree: Tree, targets: Int[Array, " N"], blocked: Bool[Array, " N"]
) -> Int[Array, ""]:
    """Deepest slot reached by "descend into the first valid child whose token is targets[u]".

    Vectorised instead of a loop over depth: an edge ``parent(c) -> c`` is *taken* when ``c``
    is valid, carries ``targets[parent(c)]``, its parent is not blocked, and no lower-slot
    sibling qualifies too. Each node then has at most one taken edge, so the slots whose whole
    root path is taken form one chain from the root; its deepest slot is where the walk stops.
    Every field is clipped first so a hand-built tree cannot index out of range.
    """
    n, max_depth = tree.num_slots, tree.max_depth
    index = jnp.arange(n, dtype=jnp.int32)
    parents = jnp.clip(tree.parents, 0, n - 1)
    ancestors = jnp.clip(tree.ancestors, 0, n - 1)
    depth = jnp.clip(tree.depth, 0, max_depth)
    edge = tree.valid & (index > 0) & (tree.tokens == targets[parents]) & ~blocked[parents]
    # Duplicate sibling tokens: only the lowest slot may be taken.
    earlier_sibling = (
        (parents[None, :] == parents[:, None]) & (index[None, :] < index[:, None]) & edge[None, :]
    )
    taken = edge & ~jnp.any(earlier_sibling, axis=1)
    d = jnp.arange(max_depth + 1, dtype=jnp.int32)
    off_path = (d[None, :] == 0) | (d[None, :] > depth[:, None])
    reached = jnp.all(taken[ancestors] | off_path, axis=1) & (taken | (index == 0))
    return jnp.argmax(jnp.where(reached, depth, -1)).astype(jnp.int32)


def _speculative_walk(
    tree: Tree,
    probs: Float[Array, "N V"],
    draft: Float[Array, "N V"],
    blocked: Bool[Array, " N"],
    key: Array,
    without_replacement: bool,
) -> tuple[Int[Array, ""], Int[Array, ""]]:
    """SpecInfer multi-step speculative sampling over the tree; returns (stop slot, bonus).

    One loop step tries one child, so ``N - 1`` steps always suffice (each slot is tried at
    most once); the step count is static, hence vmappable with no recompilation.
    """
    n, vocab = probs.shape
    index = jnp.arange(n, dtype=jnp.int32)
    children = tree_lib.children_mask(tree)
    tokens = tree.tokens
    in_vocab = (tokens >= 0) & (tokens < vocab)
    safe_tokens = jnp.clip(tokens, 0, vocab - 1)
    draft = _normalise(
        jnp.where(jnp.isfinite(draft) & (draft > 0), draft, 0.0), jnp.zeros_like(draft)
    )
    vocab_ids = jnp.arange(vocab, dtype=jnp.int32)
    accept_key, bonus_key = jax.random.split(key)
    draws = _uniforms(accept_key, max(n - 1, 1))

    def step(i, carry):
        node, p, q, last = carry
        candidates = children[node] & (index > last) & ~blocked[node]
        has = jnp.any(candidates)
        child = jnp.argmax(candidates).astype(jnp.int32)  # lowest untried child slot
        x = safe_tokens[child]
        px, qx = p[x], q[x]
        # q(x) = 0 cannot happen when x was really drawn from q (e.g. a duplicate in the
        # without-replacement variant): such a candidate is skipped, leaving p and q as they
        # were, which keeps the remaining steps exact.
        usable = has & in_vocab[child] & (qx > 0)
        accept = usable & (draws[i] * qx < px)  # probability min(1, p(x) / q(x))
        reject = usable & ~accept
        is_x = vocab_ids == x
        without_x = jnp.where(is_x, 0.0, p)
        # Residual max(p - q, 0) has positive mass in exact arithmetic after a rejection
        # (p(x) < q(x) and both sum to 1); the fallbacks only guard float round-off.
        p_rejected = _normalise(jnp.maximum(p - q, 0.0), _normalise(without_x, p))
        if without_replacement:
            q_rejected = _normalise(jnp.where(is_x, 0.0, q), jnp.zeros_like(q))
        else:
            q_rejected = q
        node = jnp.where(accept, child, node)
        p = jnp.where(accept, probs[child], jnp.where(reject, p_rejected, p))
        q = jnp.where(accept, draft[child], jnp.where(reject, q_rejected, q))
        # Children come after their parent in slot order, so `child` also bounds the next
        # candidates after a descent.
        last = jnp.where(has, child, last)
        return node, p, q, last

    init = (jnp.int32(0), probs[0], draft[0], jnp.int32(0))
    node, p, _, _ = jax.lax.fori_loop(0, n - 1, step, init)
    bonus = _sample_rows(bonus_key, p[None, :])[0]
    return node, bonus


def _normalise(x: Float[Array, "... V"], fallback: Float[Array, "... V"]) -> Float[Array, "... V"]:
    """``x / sum(x)`` per row, or ``fallback`` where that sum is not positive."""
    total = jnp.sum(x, axis=-1, keepdims=True)
    return jnp.where(total > 0, x / jnp.where(total > 0, total, 1.0), fallback)


# --------------------------------------------------------------------------------------------
# Public rules
# --------------------------------------------------------------------------------------------


def greedy(tree: Tree, logits: Float[ArrayLike, "N V"]) -> Acceptance:
    """Greedy tree verification: follow the teacher's argmax through the tree.

    From the root ``u``: if ``argmax logits[u]`` (first index on ties) is the token of a valid
    child of ``u``, move to that child (the lowest slot if several carry it) and repeat; else
    stop. Padding slots are never matched. The bonus is the argmax at the stop node.

    Args:
      tree: the speculation tree.
      logits: ``[N, V]`` teacher logits; row ``u`` predicts the token after slot ``u``.

    Returns:
      The :class:`Acceptance`.
    """
    logits = _check_logits(tree, logits, "logits")
    blocked = degenerate_rows(logits)
    targets = _fallback_token(logits)  # the argmax on every usable row
    stop = _first_match_stop(tree, targets, blocked)
    _reference_checks(tree, blocked)
    return _acceptance(tree, stop, targets[stop], ~blocked[stop])


def sample(
    tree: Tree,
    logits: Float[ArrayLike, "N V"],
    key: Array,
    *,
    temperature: Float[ArrayLike, ""] = 1.0,
    top_p: Float[ArrayLike, ""] = 1.0,
    draft_probs: Float[ArrayLike, "N V"] | None = None,
    without_replacement: bool = True,
) -> Acceptance:
    """Lossless sampling verification: emitted tokens follow the adjusted teacher exactly.

    The target at slot ``u`` is ``p_u = adjusted_probs(logits[u], temperature, top_p)``. The
    tree must have been fixed before ``key`` is used (it is only consumed here).

    * ``draft_probs is None`` (deterministic children: top-k, best-first, static trees): draw
      ``y_u ~ p_u`` for each row; descend into the first valid child whose token is ``y_u``,
      else emit ``y_u`` as the bonus. This has the same law as the sequential rule (accept
      ``x_i`` with ``p_i(x_i)``, on rejection zero it and renormalise) and is lossless for any
      tree; see the module docstring.
    * ``draft_probs`` given (sampled children): row ``u`` is the draft distribution ``q_u`` the
      children of ``u`` were drawn from. SpecInfer multi-step speculative sampling: try the
      valid children ``x_1, x_2, ...`` in slot order; accept ``x_i`` with probability
      ``min(1, p(x_i) / q(x_i))`` and descend (restarting with ``p_c, q_c`` at the child);
      on rejection ``p <- norm(max(p - q, 0))``; when every child is rejected, draw the bonus
      from the final ``p``.

      - ``without_replacement=True`` (default): on rejection also ``q <- q`` with ``x_i``
        zeroed, renormalised. This is exactly the law of the next child when siblings are
        drawn sequentially without replacement (e.g. Gumbel-top-k). It is exact for i.i.d.
        children too: a duplicate of an earlier sibling then has ``q(x) = 0`` and is
        skipped, and a non-duplicate, conditioned on not being one, follows that same
        renormalised ``q``. Hence the default.
      - ``without_replacement=False``: the textbook SpecInfer rule, ``q`` stays fixed; exact
        only for children drawn i.i.d. from ``q``. Applied to distinct (without-replacement)
        siblings it is biased.

      Why lossless: for one candidate ``x ~ q``, "accept with ``min(1, p/q)``, otherwise draw
      from ``norm(max(p - q, 0))``" yields exactly ``p`` (standard speculative sampling).
      Replacing that final draw by the same procedure on the next candidate, whose conditional
      law given everything so far is the ``q`` in use, with target ``norm(max(p - q, 0))``,
      preserves this by induction over the candidates; after all of them the residual is
      sampled directly. A rejected ``x`` has ``p(x) < q(x)``, so it has zero mass in the new
      ``p`` as well. Descending into an accepted child restarts the argument one level down
      with that child's fresh rows, so each emitted token follows the teacher given the
      emitted prefix. Candidates with ``q(x) = 0`` (impossible if really drawn from ``q``)
      are skipped without touching ``p`` or ``q``. Using the draft's ``q`` for children that
      were *chosen* (not drawn) breaks the premise ``x ~ q`` and is not lossless.

    Args:
      tree: the speculation tree.
      logits: ``[N, V]`` teacher logits; row ``u`` predicts the token after slot ``u``.
      key: PRNG key.
      temperature: scalar >= 0, may be traced; 0 gives exactly :func:`greedy`.
      top_p: scalar in ``(0, 1]``, may be traced.
      draft_probs: ``[N, V]`` draft distributions for sampled children, or None. Rows are
        renormalised; non-finite or negative entries count as 0.
      without_replacement: static; how the sampled children were drawn (see above).

    Returns:
      The :class:`Acceptance`.
    """
    logits = _check_logits(tree, logits, "logits")
    blocked = degenerate_rows(logits)
    probs = adjusted_probs(logits, temperature, top_p)
    if draft_probs is None:
        targets = _sample_rows(key, probs)
        stop = _first_match_stop(tree, targets, blocked)
        bonus = targets[stop]
    else:
        draft = _check_logits(tree, draft_probs, "draft_probs")
        if draft.shape != logits.shape:
            raise ValueError(
                f"draft_probs has shape {draft.shape}, expected {logits.shape} like logits"
            )
        stop, bonus = _speculative_walk(
            tree, probs, draft.astype(jnp.float32), blocked, key, bool(without_replacement)
        )
    _reference_checks(tree, blocked)
    return _acceptance(tree, stop, bonus, ~blocked[stop])


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------


def _check_logits(tree: Tree, logits, name: str) -> Float[Array, "N V"]:
    logits = jnp.asarray(logits)
    if logits.ndim != 2 or logits.shape[0] != tree.num_slots or logits.shape[1] < 1:
        raise ValueError(
            f"{name} must have shape [N, V] with N = {tree.num_slots} tree slots, "
            f"got {logits.shape} (batch with jax.vmap)"
        )
    if not jnp.issubdtype(logits.dtype, jnp.floating):
        raise ValueError(f"{name} must be floating point, got {logits.dtype}")
    return logits


def _acceptance(
    tree: Tree, stop: Int[Array, ""], bonus: Int[Array, ""], ok: Bool[Array, ""]
) -> Acceptance:
    n, max_depth = tree.num_slots, tree.max_depth
    path = jnp.clip(tree.ancestors[stop], 0, n - 1).astype(jnp.int32)
    length = jnp.clip(tree.depth[stop], 0, max_depth).astype(jnp.int32)
    j = jnp.arange(max_depth + 1, dtype=jnp.int32)
    accepted = tree.tokens[path[jnp.minimum(j + 1, max_depth)]]
    bonus = bonus.astype(jnp.int32)
    tokens = jnp.where(j < length, accepted, bonus).astype(jnp.int32)
    return Acceptance(length=length, path=path, next_token=bonus, tokens=tokens, ok=ok)


def _reference_checks(tree: Tree, blocked: Bool[Array, " N"]) -> None:
    """In reference mode: tree invariants, and no degenerate logits row at a valid slot."""
    if not mode.is_reference():
        return
    tree_lib.assert_valid(tree)
    bad = blocked & tree.valid
    message = "teacher logits row of slot {slot} holds NaN/+inf or no finite entry"
    if isinstance(bad, jax.core.Tracer):
        checkify.check(~jnp.any(bad), message, slot=jnp.argmax(bad))
    elif bool(jnp.any(bad)):
        raise DegenerateLogitsError(message.format(slot=int(jnp.argmax(bad))))
