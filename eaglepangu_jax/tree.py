"""Tree tensor semantics: the one place that defines what a speculation tree is.

A tree has ``N`` slots. Slot 0 is the **virtual root**: it holds the last committed token (the
previous round's bonus token) and is always valid, with ``parents[0] == 0`` and depth 0. Every
other slot ``i`` is a draft node or padding:

* a valid node has a valid parent with ``0 <= parents[i] < i`` (topological order, so the tree
  is acyclic by construction and a single forward sweep computes depths);
* ``depth[i] = depth[parents[i]] + 1 <= D``;
* ``ancestors[i, d]`` is ``i``'s ancestor at depth ``d`` for ``d <= depth[i]``, so
  ``ancestors[i, 0] == 0`` and ``ancestors[i, depth[i]] == i``; columns past the depth repeat
  ``i`` itself;
* padding slots (``valid[i] == False``) hang off the root (parent 0, depth 1) and are never
  accepted.

**No negative index exists anywhere**: every integer field lies in ``[0, N)`` for any input,
so device gathers through these tables can never wrap (peers pad with ``-1``, which silently
reads the last node on accelerators). Example, the 5-slot tree ``root -> 1 -> 3, root -> 2,
1 -> 4``::

    parents   = [0, 0, 0, 1, 1]
    depth     = [0, 1, 1, 2, 2]
    ancestors = [[0, 0, 0],      # root
                 [0, 1, 1],
                 [0, 2, 2],
                 [0, 1, 3],
                 [0, 1, 4]]

Dimensions: ``N`` slots (root included), ``D`` maximum depth.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify
from jaxtyping import Array, ArrayLike, Bool, Float, Int

from eaglepangu_jax import mode

__all__ = [
    "INVARIANTS",
    "Tree",
    "from_parents",
    "chain",
    "from_choices",
    "from_paths",
    "keep_best",
    "widen",
    "add_root_children",
    "check",
    "is_valid",
    "InvalidTreeError",
    "assert_valid",
    "positions",
    "path_to",
    "children_mask",
    "restrict_tokens",
]

INVARIANTS = ("root_ok", "in_range", "topological", "acyclic", "valid_closure", "depth_consistent")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Tree:
    """A speculation tree with a virtual root at slot 0 (see the module docstring)."""

    tokens: Int[Array, " N"]  # [N] token id per slot; tokens[0] = last committed token
    parents: Int[Array, " N"]  # [N] parent slot, parents[0] == 0
    valid: Bool[Array, " N"]  # [N] False marks padding; valid[0] is True
    depth: Int[Array, " N"]  # [N] 0 for the root
    ancestors: Int[Array, "N D+1"]  # [N, D + 1] ancestor at each depth, then self
    logscore: Float[Array, " N"]  # [N] cumulative draft log-probability, 0 at the root

    @property
    def num_slots(self) -> int:
        """``N``, the static number of slots (root included)."""
        return self.parents.shape[-1]

    @property
    def max_depth(self) -> int:
        """``D``, the static maximum depth."""
        return self.ancestors.shape[-1] - 1


def _climb_table(parents: Int[Array, " N"], max_depth: int) -> Int[Array, "D+1 N"]:
    """``up[k, i]`` = the k-th ancestor of ``i`` (``up[0] = i``), saturating at the root."""

    def step(current, _):
        nxt = parents[current]
        return nxt, nxt

    identity = jnp.arange(parents.shape[0], dtype=jnp.int32)
    _, ups = jax.lax.scan(step, identity, None, length=max_depth + 1)
    return jnp.concatenate([identity[None], ups], axis=0)


def _sanitize_parents(parents: Int[Array, " N"]) -> tuple[Int[Array, " N"], Bool[Array, " N"]]:
    """Force ``0 <= parent < i`` (root: 0); report which slots needed it."""
    n = parents.shape[0]
    index = jnp.arange(n, dtype=jnp.int32)
    ok = (parents >= 0) & (parents < jnp.maximum(index, 1))
    ok = ok.at[0].set(parents[0] == 0)
    safe = jnp.where(ok, parents, 0).astype(jnp.int32)
    return safe.at[0].set(0), ok


def _raw_invariants(
    parents: Int[Array, " N"], valid: Bool[Array, " N"], max_depth: int
) -> dict[str, Bool[Array, " N"]]:
    """Per-slot invariants of raw (unsanitised) construction inputs; True = holds."""
    n = parents.shape[0]
    index = jnp.arange(n, dtype=jnp.int32)
    in_range = (parents >= 0) & (parents < n)
    topological = jnp.where(index == 0, parents == 0, parents < index)
    safe, _ = _sanitize_parents(parents)
    # Depth along sanitised parents; a chain longer than max_depth never reaches the root
    # within max_depth steps.
    up = _climb_table(safe, max_depth)
    reached = jnp.any(up[: max_depth + 1] == 0, axis=0)
    parent_valid = valid[safe]
    closure = ~valid | (index == 0) | parent_valid
    return {
        "in_range": in_range | ~valid,
        "topological": topological | ~valid,
        "acyclic": jnp.ones((n,), bool),  # topological order rules cycles out
        "valid_closure": closure,
        "depth_consistent": reached | ~valid,
        "root_ok": (index != 0) | (parents == 0),
    }


def from_parents(
    parents: Int[ArrayLike, " N"],
    *,
    tokens: Int[ArrayLike, " N"] | None = None,
    valid: Bool[ArrayLike, " N"] | None = None,
    logscore: Float[ArrayLike, " N"] | None = None,
    max_depth: int,
) -> Tree:
    """Build a tree from parent pointers (jittable; ``max_depth`` static).

    In reference mode (see :mod:`eaglepangu_jax.mode`) broken input raises an error naming the
    first bad slot. In performance mode it is repaired instead, so no index can leave
    ``[0, N)``: a slot with an out-of-range or non-topological parent, an invalid ancestor, or a
    depth past ``max_depth`` becomes padding.

    Args:
      parents: ``[N]`` parent slot of each slot; ``parents[0]`` must be 0.
      tokens: ``[N]`` token ids (default zeros).
      valid: ``[N]`` which slots are real nodes (default all). The root is always valid.
      logscore: ``[N]`` cumulative draft log-probabilities (default zeros).
      max_depth: ``D``, the deepest allowed node.

    Returns:
      A :class:`Tree` whose every invariant holds.
    """
    parents = jnp.asarray(parents, jnp.int32)
    n = parents.shape[0]
    if parents.ndim != 1 or n < 1:
        raise ValueError(f"parents must be a non-empty 1-D array, got shape {parents.shape}")
    if max_depth < 1:
        raise ValueError(f"max_depth must be >= 1, got {max_depth}")
    valid = jnp.ones((n,), bool) if valid is None else jnp.asarray(valid, bool)
    tokens = jnp.zeros((n,), jnp.int32) if tokens is None else jnp.asarray(tokens, jnp.int32)
    logscore = (
        jnp.zeros((n,), jnp.float32) if logscore is None else jnp.asarray(logscore, jnp.float32)
    )
    for name, arr in (("valid", valid), ("tokens", tokens), ("logscore", logscore)):
        if arr.shape != (n,):
            raise ValueError(f"{name} has shape {arr.shape}, expected ({n},) like parents")

    if mode.is_reference():
        _assert_invariants(_raw_invariants(parents, valid, max_depth))

    safe, parent_ok = _sanitize_parents(parents)
    valid = valid.at[0].set(True) & (parent_ok | (jnp.arange(n) == 0))
    up = _climb_table(safe, max_depth)  # [D + 2, N]
    at_root = up == 0
    # depth = the first k whose k-th ancestor is the root; > max_depth if never reached.
    depth = jnp.where(jnp.any(at_root, axis=0), jnp.argmax(at_root, axis=0), max_depth + 1)
    valid = valid & (depth <= max_depth)

    # Validity closure: a node is kept only if every ancestor is kept. Slots are topological,
    # so one forward sweep propagates invalidity down the tree.
    def close(keep, i):
        keep = keep.at[i].set(keep[i] & keep[safe[i]])
        return keep, None

    valid, _ = jax.lax.scan(close, valid, jnp.arange(1, n, dtype=jnp.int32))
    # Padding hangs off the root so every table stays a plain in-range index.
    safe = jnp.where(valid, safe, 0)
    return _assemble(tokens, safe, valid, logscore, max_depth)


def _assemble(tokens, parents, valid, logscore, max_depth) -> Tree:
    """Depth and ancestor tables for already-sanitised parents (invalid slots under root)."""
    n = parents.shape[0]
    up = _climb_table(parents, max_depth)  # [D + 2, N]
    at_root = up == 0
    depth = jnp.where(valid, jnp.argmax(at_root, axis=0), 1).astype(jnp.int32)
    depth = depth.at[0].set(0)
    # ancestors[i, d] = up[depth[i] - d, i] for d <= depth[i], else i itself.
    d = jnp.arange(max_depth + 1, dtype=jnp.int32)
    steps = jnp.clip(depth[:, None] - d[None, :], 0, max_depth + 1)  # [N, D + 1]
    index = jnp.arange(n, dtype=jnp.int32)
    ancestors = up[steps, index[:, None]]
    ancestors = jnp.where(d[None, :] <= depth[:, None], ancestors, index[:, None])
    return Tree(
        tokens=tokens,
        parents=parents,
        valid=valid,
        depth=depth,
        ancestors=ancestors.astype(jnp.int32),
        logscore=jnp.where(valid, logscore, -jnp.inf).at[0].set(0.0),
    )


def chain(
    n: int, tokens: Int[ArrayLike, " N"] | None = None, *, max_depth: int | None = None
) -> Tree:
    """A chain ``root -> 1 -> 2 -> ... -> n-1`` (``n`` slots; plain speculative decoding)."""
    if n < 1:
        raise ValueError(f"a chain needs at least the root slot, got n={n}")
    parents = jnp.maximum(jnp.arange(n, dtype=jnp.int32) - 1, 0)
    return from_parents(parents, tokens=tokens, max_depth=max_depth or max(n - 1, 1))


def from_choices(
    choices: Sequence[Sequence[int]], *, max_depth: int | None = None
) -> tuple[Tree, Int[Array, " N"]]:
    """Static tree from EAGLE/Medusa-style choice lists (host-side, not jitted).

    Each choice is a path of top-k ranks from the root, e.g. ``[0]`` is the top-1 child of the
    root, ``[0, 2]`` the third-ranked child of that. Every prefix of a choice must itself be a
    choice (or is added). Slots are ordered by depth, then lexicographically, so parents
    precede children.

    Returns:
      ``(tree, rank)``: the tree topology (tokens to be filled in by a drafter) and ``rank[i]``,
      the top-k rank of slot ``i`` among its siblings (0 for the root).
    """
    paths = {tuple(int(r) for r in c) for c in choices}
    for path in list(paths):
        if not path:
            raise ValueError("an empty choice denotes the root, which is implicit")
        if any(r < 0 for r in path):
            raise ValueError(f"choice {list(path)} has a negative rank")
        paths.update(path[:k] for k in range(1, len(path)))
    ordered = sorted(paths, key=lambda p: (len(p), p))
    slot = {(): 0}
    parents, rank = [0], [0]
    for path in ordered:
        slot[path] = len(parents)
        parents.append(slot[path[:-1]])
        rank.append(path[-1])
    depth = max((len(p) for p in ordered), default=1)
    tree = from_parents(np.asarray(parents, np.int32), max_depth=max_depth or depth)
    return tree, jnp.asarray(rank, jnp.int32)


def from_paths(
    root_token: Int[ArrayLike, ""],
    paths: Int[ArrayLike, "M D"],
    path_len: Int[ArrayLike, " M"],
    *,
    budget: int,
    path_weight: Float[ArrayLike, " M"] | None = None,
) -> Tree:
    """Merge candidate continuations into a trie (jittable; ``budget`` static).

    Path ``m`` contributes nodes for ``paths[m, :path_len[m]]``; paths sharing a prefix share
    its nodes. Slots are numbered in (path, depth) order, which puts every parent before its
    children, and the first ``budget`` distinct nodes are kept (earlier paths win, so pass
    paths best first). A node's ``logscore`` is the log of the summed ``path_weight`` of the
    paths through it, normalised by the total weight (a count-based acceptance estimate).

    Returns:
      A tree with ``budget + 1`` slots and ``max_depth = D``.
    """
    paths = jnp.asarray(paths, jnp.int32)
    m, d = paths.shape
    path_len = jnp.clip(jnp.asarray(path_len, jnp.int32), 0, d)
    weight = (
        jnp.ones((m,), jnp.float32)
        if path_weight is None
        else jnp.nan_to_num(jnp.asarray(path_weight, jnp.float32), nan=0.0, neginf=0.0)
    )
    weight = jnp.where(path_len > 0, jnp.maximum(weight, 0.0), 0.0)
    depth_index = jnp.arange(d, dtype=jnp.int32)
    present = depth_index[None, :] < path_len[:, None]  # [M, D]
    # same[a, b, k]: paths a and b agree on tokens 0..k (and both reach depth k).
    agree = (paths[:, None, :] == paths[None, :, :]) & present[:, None, :] & present[None, :, :]
    same = jnp.cumprod(agree.astype(jnp.int32), axis=-1).astype(bool)  # [M, M, D]
    earlier = jnp.arange(m)[None, :] < jnp.arange(m)[:, None]  # [a, b]: b < a
    owner_is_self = ~jnp.any(same & earlier[:, :, None], axis=1)  # [M, D]
    is_new = owner_is_self & present
    # Owner of (a, k): the first path agreeing with a up to depth k.
    owner = jnp.argmax(same, axis=1).astype(jnp.int32)  # [M, D]
    flat_new = is_new.reshape(-1)
    slot_of_new = jnp.cumsum(flat_new.astype(jnp.int32)).reshape(m, d)  # 1-based slot ids
    kept_new = is_new & (slot_of_new <= budget)
    node_slot = slot_of_new[owner, depth_index[None, :]]  # [M, D] slot of (a, k)'s owner node
    parent_slot = jnp.concatenate([jnp.zeros((m, 1), jnp.int32), node_slot[:, :-1]], axis=1)
    mass = jnp.sum(jnp.where(same, weight[None, :, None], 0.0), axis=1)  # [M, D]
    total = jnp.maximum(jnp.sum(weight), 1e-30)
    logscore = jnp.log(mass / total)
    n = budget + 1
    # Scatter kept nodes to their slots; everything else is dropped (mode="drop" keeps
    # indices in range: the out-of-budget ones are routed to slot n, which does not exist).
    target = jnp.where(kept_new, slot_of_new, n).reshape(-1)
    parents = jnp.zeros((n,), jnp.int32).at[target].set(parent_slot.reshape(-1), mode="drop")
    tokens = (
        jnp.zeros((n,), jnp.int32)
        .at[target]
        .set(paths.reshape(-1), mode="drop")
        .at[0]
        .set(jnp.asarray(root_token, jnp.int32))
    )
    valid = jnp.zeros((n,), bool).at[target].set(True, mode="drop").at[0].set(True)
    scores = jnp.zeros((n,), jnp.float32).at[target].set(logscore.reshape(-1), mode="drop")
    return _assemble(tokens, jnp.where(valid, parents, 0), valid, scores, d)


def keep_best(tree: Tree, n: Int[ArrayLike, ""]) -> Tree:
    """The root plus the ``n`` best-scored valid nodes of ``tree``, packed into the front slots.

    This is how a node budget (e.g. the roofline controller's) applies to a tree a drafter
    built itself: nodes are ranked by ``logscore`` (NaN counts as ``-inf``; ties go to the
    lower slot, so a parent outranks a child of equal score), a node whose parent is not kept
    is dropped too (validity closure), and the kept nodes move to slots ``1..m`` in their
    original order (still topological). Packing matters: the engine verifies the smallest
    slot bucket holding the last valid slot, so a pruned tree must not leave nodes behind.

    Args:
      tree: any valid tree.
      n: node budget, root excluded (clipped to ``[0, N - 1]``; dynamic).

    Returns:
      A tree of the same static shape with at most ``n`` valid nodes besides the root.
    """
    slots = tree.num_slots
    index = jnp.arange(slots, dtype=jnp.int32)
    score = jnp.where(jnp.isnan(tree.logscore), -jnp.inf, tree.logscore)
    score = jnp.where(tree.valid & (index > 0), score, -jnp.inf).at[0].set(jnp.inf)
    order = jnp.argsort(-score, stable=True)  # the root first, then by score, ties by slot
    rank = jnp.zeros((slots,), jnp.int32).at[order].set(index)
    keep = tree.valid & (rank <= jnp.asarray(n, jnp.int32))

    def close(kept, i):
        return kept.at[i].set(kept[i] & kept[tree.parents[i]]), None

    keep, _ = jax.lax.scan(close, keep.at[0].set(True), jnp.arange(1, slots, dtype=jnp.int32))
    new_slot = jnp.cumsum(keep.astype(jnp.int32)) - 1  # where each kept slot moves
    old_slot = jnp.argsort(~keep, stable=True).astype(jnp.int32)  # kept slots first, in order
    live = index < jnp.sum(keep.astype(jnp.int32))
    parents = jnp.where(live, new_slot[tree.parents[old_slot]], 0)
    return _assemble(
        jnp.where(live, tree.tokens[old_slot], 0),
        parents,
        live,
        jnp.where(live, tree.logscore[old_slot], -jnp.inf),
        tree.max_depth,
    )


def widen(tree: Tree, num_slots: int, max_depth: int) -> Tree:
    """``tree`` with padding slots appended up to ``num_slots`` and its ancestor table cut for
    ``max_depth``: the same nodes in the same slots, in the static shape another tree has (so
    that one of two trees can be picked by ``where``).

    Raises:
      ValueError: ``num_slots`` or ``max_depth`` below the tree's own (nothing is dropped).
    """
    n = tree.num_slots
    if num_slots < n or max_depth < tree.max_depth:
        raise ValueError(
            f"cannot widen a tree of {n} slots / depth {tree.max_depth} to {num_slots} slots / "
            f"depth {max_depth}: a tree is widened, never cut"
        )
    extra = num_slots - n
    return _assemble(
        jnp.concatenate([tree.tokens, jnp.zeros((extra,), jnp.int32)]),
        jnp.concatenate([tree.parents, jnp.zeros((extra,), jnp.int32)]),
        jnp.concatenate([tree.valid, jnp.zeros((extra,), bool)]),
        jnp.concatenate([tree.logscore, jnp.full((extra,), -jnp.inf, jnp.float32)]),
        max_depth,
    )


def add_root_children(
    tree: Tree,
    tokens: Int[ArrayLike, " K"],
    logscore: Float[ArrayLike, " K"],
    keep: Bool[ArrayLike, " K"],
) -> Tree:
    """``tree`` with the candidates ``keep`` marks added as children of the root, in its padding
    slots (jittable).

    Candidates go, in their order, to the padding slots in slot order; a candidate whose token
    is already a root child's is skipped (the tree holds that path), a token given twice enters
    once, and candidates beyond the free slots are dropped. A tree whose nodes fill its front
    slots (every drafter's here) stays packed. Example: root children ``[7, 9]`` in slots 1-2
    of a 5-slot tree, candidates ``[9, 4, 6]``: 9 is skipped, 4 goes to slot 3, 6 to slot 4.

    Args:
      tree: any valid tree.
      tokens, logscore: ``[K]`` the candidates' tokens and (cumulative = own, at depth 1) scores.
      keep: ``[K]`` which candidates are real.

    Returns:
      A tree of the same static shape.
    """
    tokens = jnp.asarray(tokens, jnp.int32)
    logscore = jnp.asarray(logscore, jnp.float32)
    keep = jnp.asarray(keep, bool)
    k = tokens.shape[0]
    if k == 0:
        return tree
    children = tree.valid & (tree.depth == 1)
    held = jnp.any(children[None, :] & (tree.tokens[None, :] == tokens[:, None]), axis=1)
    keep = keep & ~held
    # A token given twice enters once (the first time).
    earlier = jnp.arange(k)[None, :] < jnp.arange(k)[:, None]  # [j, i]: i comes before j
    again = jnp.any(earlier & keep[None, :] & (tokens[None, :] == tokens[:, None]), axis=1)
    keep = keep & ~again
    # The r-th free slot takes the r-th kept candidate.
    order = jnp.argsort(~keep, stable=True).astype(jnp.int32)  # kept candidates first
    free = ~tree.valid
    free_rank = jnp.cumsum(free.astype(jnp.int32)) - 1
    fill = free & (free_rank < jnp.sum(keep.astype(jnp.int32)))
    source = order[jnp.clip(free_rank, 0, k - 1)]
    return _assemble(
        jnp.where(fill, tokens[source], tree.tokens),
        jnp.where(fill, 0, tree.parents),
        tree.valid | fill,
        jnp.where(fill, logscore[source], tree.logscore),
        tree.max_depth,
    )


def check(tree: Tree) -> dict[str, Bool[Array, " N"]]:
    """Evaluate every invariant per slot on an arbitrary (maybe hand-built) tree.

    Returns a dict ``name -> [N] bool`` (True = holds) with keys :data:`INVARIANTS`. Never
    gathers out of range, whatever the field values.
    """
    n, max_depth = tree.num_slots, tree.max_depth
    index = jnp.arange(n, dtype=jnp.int32)
    parents = tree.parents
    in_range = (parents >= 0) & (parents < n)
    for field in (tree.ancestors,):
        in_range = in_range & jnp.all((field >= 0) & (field < n), axis=-1)
    topological = jnp.where(index == 0, parents == 0, parents < index)
    safe = jnp.clip(parents, 0, n - 1)
    # Acyclic: climbing N times from any slot must reach the root.
    up = jax.lax.fori_loop(0, n, lambda _, cur: safe[cur], index)
    acyclic = up == 0
    safe_anc = jnp.clip(tree.ancestors, 0, n - 1)
    parent_valid = tree.valid[safe]
    valid_closure = ~tree.valid | (index == 0) | parent_valid
    depth_ok = jnp.where(
        index == 0, tree.depth == 0, (tree.depth == tree.depth[safe] + 1) | ~tree.valid
    )
    depth_ok = depth_ok & (tree.depth >= 0) & (tree.depth <= max_depth)
    clipped_depth = jnp.clip(tree.depth, 0, max_depth)
    d = jnp.arange(max_depth + 1, dtype=jnp.int32)
    # Columns from the depth on hold the node itself (the root's whole row is 0), the ones
    # before it the parent's row, so by induction from the root column d is the ancestor at d.
    self_from_depth = jnp.all(
        (safe_anc == index[:, None]) | (d[None, :] < clipped_depth[:, None]), axis=1
    )
    parent_row = safe_anc[safe]
    same_prefix = jnp.all((parent_row == safe_anc) | (d[None, :] >= clipped_depth[:, None]), axis=1)
    depth_ok = depth_ok & ((self_from_depth & same_prefix) | ~tree.valid)
    root_ok = (index != 0) | (tree.valid & (parents == 0) & (tree.depth == 0))
    return {
        "in_range": in_range,
        "topological": topological | ~tree.valid,
        "acyclic": acyclic,
        "valid_closure": valid_closure,
        "depth_consistent": depth_ok,
        "root_ok": root_ok,
    }


def is_valid(tree: Tree) -> Bool[Array, ""]:
    """True when every invariant holds at every slot."""
    return jnp.all(jnp.stack([jnp.all(v) for v in check(tree).values()]))


class InvalidTreeError(ValueError):
    """A tree breaks one of the invariants in the module docstring."""


def _assert_invariants(results: dict[str, Bool[Array, " N"]]) -> None:
    concrete = all(not isinstance(v, jax.core.Tracer) for v in results.values())
    if concrete:
        for name in INVARIANTS:
            ok = np.asarray(results[name])
            if not ok.all():
                bad = int(np.argmin(ok))
                raise InvalidTreeError(f"invalid tree: invariant '{name}' broken at node {bad}")
        return
    for name in INVARIANTS:
        ok = results[name]
        checkify.check(
            jnp.all(ok),
            f"invalid tree: invariant '{name}' broken at node {{bad}}",
            bad=jnp.argmin(ok),
        )


def assert_valid(tree: Tree) -> None:
    """Raise :class:`InvalidTreeError` naming the first bad node and the broken invariant.

    Eagerly it raises at once. Inside ``jax.jit`` it emits ``checkify`` checks: wrap the jitted
    function with :func:`eaglepangu_jax.mode.checked` (reference mode) to have them raise.
    """
    _assert_invariants(check(tree))


def positions(tree: Tree, start: Int[ArrayLike, ""]) -> Int[Array, " N"]:
    """Sequence position of each slot: ``start + depth`` (the root sits at ``start``)."""
    return jnp.asarray(start, jnp.int32) + tree.depth


def path_to(tree: Tree, node: Int[ArrayLike, ""]) -> Int[Array, " D+1"]:
    """Slots from the root to ``node``; entries past its depth repeat ``node``."""
    node = jnp.clip(jnp.asarray(node, jnp.int32), 0, tree.num_slots - 1)
    return tree.ancestors[node]


def children_mask(tree: Tree) -> Bool[Array, "N N"]:
    """``[u, c]`` True when valid slot ``c > 0`` is a child of ``u``."""
    index = jnp.arange(tree.num_slots, dtype=jnp.int32)
    return (tree.parents[None, :] == index[:, None]) & tree.valid[None, :] & (index[None, :] > 0)


def restrict_tokens(tree: Tree, vocab_size: int) -> Tree:
    """``tree`` with every node whose token id lies outside ``[0, vocab_size)`` made padding.

    A drafter's token ids reach the teacher's embedding gather; a ``-1`` would be a wrapped
    index on an accelerator. In performance mode such a node, and every node under it, becomes
    padding (the validity closure of :func:`from_parents`). In reference mode the first such
    node raises :class:`InvalidTreeError` naming it (inside ``jax.jit``: a ``checkify``
    check, raised by :func:`eaglepangu_jax.mode.checked`). The root's token is the engine's
    own and is not checked.
    """
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    in_vocab = (tree.tokens >= 0) & (tree.tokens < vocab_size)
    ok = ~tree.valid | in_vocab | (jnp.arange(tree.num_slots) == 0)
    if mode.is_reference():
        message = f"invalid tree: token id outside the vocabulary [0, {vocab_size}) at node"
        if isinstance(ok, jax.core.Tracer):
            checkify.check(jnp.all(ok), message + " {bad}", bad=jnp.argmin(ok))
        elif not bool(np.all(np.asarray(ok))):
            raise InvalidTreeError(f"{message} {int(np.argmin(np.asarray(ok)))}")
    safe_tokens = jnp.where(in_vocab, tree.tokens, 0)
    return from_parents(
        tree.parents,
        tokens=safe_tokens,
        valid=tree.valid & ok,
        logscore=tree.logscore,
        max_depth=tree.max_depth,
    )
