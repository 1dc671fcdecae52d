"""The verify half of a round: the teacher's forward over the tree at the smallest slot bucket
holding its valid nodes, and greedy or lossless-sampling acceptance."""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from eaglepangu_jax import cache as cache_lib
from eaglepangu_jax import mask as mask_lib
from eaglepangu_jax import tree as tree_lib
from eaglepangu_jax import verify
from eaglepangu_jax.cache import KVCache
from eaglepangu_jax.engine.drafter import Proposal
from eaglepangu_jax.engine.state import DecodeState
from eaglepangu_jax.models import llama

if TYPE_CHECKING:  # the step's statics; step imports this module
    from eaglepangu_jax.engine.step import StepStatic

__all__ = [
    "accept",
    "committed_rows",
    "path_rows",
    "slot_buckets",
    "verify_sizes",
    "truncate_tree",
    "verify_and_accept",
    "verify_forward",
    "verify_inputs",
]


def accept(
    static: StepStatic,
    tree: tree_lib.Tree,
    logits: Float[Array, "N V"],
    key: Array,
    proposal: Proposal,
    state: DecodeState,
) -> verify.Acceptance:
    """Greedy or lossless-sampling acceptance, per the spec (temperature and top-p are the
    state's traced values)."""
    if not static.spec.sampling:
        return verify.greedy(tree, logits)
    draft_probs = proposal.draft_probs
    if draft_probs is not None:
        draft_probs = draft_probs[: tree.num_slots]
    return verify.sample(
        tree,
        logits,
        key,
        temperature=state.temperature,
        top_p=state.top_p,
        draft_probs=draft_probs,
    )


def slot_buckets(num_slots: int, sizes: tuple[int, ...] | None = None) -> tuple[int, ...]:
    """Verify-forward sizes compiled for a tree of ``num_slots`` slots: those of ``sizes``
    below ``num_slots``, then ``num_slots`` itself. A round whose valid nodes fit a smaller
    bucket verifies only that many slots (an n-gram drafter without a match costs one plain
    decode step).

    ``sizes=None`` (:attr:`SpecConfig.slot_buckets` unset): 1, 2, 4, 8, 16, ... On a 2-core
    x86 CPU two rows cost about what one does (the teacher's verify forward 1.03x one slot)
    while four cost 1.3-1.5x, so a round that verifies a single drafted token pays almost
    nothing more than a plain step. Sizes double from there (they quadrupled once: with 17
    slots a round of 4 to 15 nodes then paid for 16, and the ``"auto"`` controller, which
    sizes trees from this curve, stopped at 3 nodes on text that accepts 4 to 6). A power of
    two that ``num_slots`` exceeds by less than a quarter is left out: the full tree costs
    about the same and one program fewer compiles (9 slots: 1, 2, 4, 9)."""
    if sizes is None:
        powers, b = [1], 2
        while b < num_slots:
            powers.append(b)
            b *= 2
        if len(powers) > 3 and num_slots - powers[-1] < powers[-1] / 4:
            powers.pop()
        sizes = tuple(powers)
    return tuple(s for s in sizes if s < num_slots) + (num_slots,)


def verify_sizes(static: StepStatic, num_slots: int) -> tuple[int, ...]:
    """The verify sizes a step compiles for a tree of ``num_slots`` slots: the run's slot
    buckets (:func:`slot_buckets` of ``static.spec.slot_buckets``), or the whole tree alone
    when the step is not bucketed (batched runs)."""
    if not static.bucketed:
        return (num_slots,)
    return slot_buckets(num_slots, static.spec.slot_buckets)


def truncate_tree(tree: tree_lib.Tree, num_slots: int) -> tree_lib.Tree:
    """The first ``num_slots`` slots of ``tree`` (valid when no valid node lies beyond them:
    parents precede children, so every index stays inside)."""
    return jax.tree_util.tree_map(lambda x: x[:num_slots], tree)


def verify_inputs(
    static: StepStatic, cache: KVCache, tree: tree_lib.Tree
) -> tuple[Int[Array, " N"], Bool[Array, "N W"], Bool[Array, "N N"]]:
    """Rotary positions, cache mask (the committed prefix) and in-tree mask of the verify
    forward over ``tree``."""
    committed = cache.length
    return (
        tree_lib.positions(tree, committed),
        mask_lib.prefix_mask(tree.num_slots, committed, static.window),
        mask_lib.tree_mask(tree),
    )


def verify_forward(
    static: StepStatic,
    params: dict,
    cache: KVCache,
    tree: tree_lib.Tree,
    inputs: tuple[Array, Array, Array] | None = None,
) -> tuple[
    Float[Array, "N V"], Float[Array, "N F H"], Float[Array, "L N K Dh"], Float[Array, "L N K Dh"]
]:
    """The teacher's forward over every slot of ``tree`` against the committed cache, which
    it reads but does not write: ``(logits, features, new K, new V)``, the new rows in tree
    slot order (see :func:`eaglepangu_jax.models.llama.forward_detached`). ``inputs``: the
    :func:`verify_inputs` of ``tree``, when the caller built them already."""
    positions, prefix, within = inputs if inputs is not None else verify_inputs(static, cache, tree)
    return llama.forward_detached(
        params,
        tree.tokens,
        positions,
        cache,
        prefix,
        within,
        config=static.teacher,
        feature_layers=static.feature_layers,
    )


def path_rows(
    acc: verify.Acceptance,
    new_k: Float[Array, "L N K Dh"],
    new_v: Float[Array, "L N K Dh"],
    num_rows: int,
) -> tuple[Float[Array, "L R K Dh"], Float[Array, "L R K Dh"]]:
    """The new K/V rows along the accepted path, root first, ``R = num_rows`` of them, ready
    for :func:`eaglepangu_jax.cache.write_rows`. ``num_rows = min(D + 1, N)`` for an
    ``N``-slot tree: a path never accepts more nodes than the tree has, and every bucket of
    the tree writes the same number of rows."""
    path = acc.path[:num_rows]
    return new_k[:, path], new_v[:, path]


def committed_rows(tree: tree_lib.Tree) -> int:
    """How many K/V rows a round over ``tree`` writes: ``min(D + 1, N)``."""
    return min(tree.max_depth + 1, tree.num_slots)


def verify_and_accept(
    static: StepStatic,
    params: dict,
    state: DecodeState,
    tree: tree_lib.Tree,
    proposal: Proposal,
    key: Array,
) -> tuple[verify.Acceptance, Float[Array, "D+1 F H"], KVCache]:
    """Teacher forward over the tree (at the smallest bucket holding its valid nodes) and
    acceptance. Returns the acceptance, the teacher features along the accepted path, and the
    cache with the accepted path's K/V written at ``[length, length + R)`` (``length`` not
    yet advanced: :func:`eaglepangu_jax.cache.commit_length` commits them).

    Each bucket's branch only reads the cache and returns the accepted rows; the one write
    happens after the switch. A branch that wrote the loop-carried cache made XLA copy the
    whole cache in and out of the switch every round (two copies per branch in the HLO),
    which cost a plain one-token round about 8% over a greedy step.
    """
    index = jnp.arange(tree.num_slots, dtype=jnp.int32)
    rows = committed_rows(tree)
    last_valid = jnp.max(jnp.where(tree.valid, index, 0))

    def branch(size):
        def run(_):
            small = truncate_tree(tree, size)
            logits, features, new_k, new_v = verify_forward(static, params, state.cache, small)
            acc = accept(static, small, logits, key, proposal, state)
            return acc, features[acc.path], path_rows(acc, new_k, new_v, rows)

        return run

    sizes = verify_sizes(static, tree.num_slots)
    if len(sizes) == 1:
        acc, path_features, kv = branch(sizes[0])(None)
    else:
        which = jnp.sum(jnp.asarray(sizes[:-1], jnp.int32) <= last_valid)
        acc, path_features, kv = jax.lax.switch(which, [branch(size) for size in sizes], None)
    return acc, path_features, cache_lib.write_rows(state.cache, *kv)
