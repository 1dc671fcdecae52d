"""The verify half of a round: the teacher's forward over the tree at the smallest slot bucket
holding its valid nodes, and greedy or lossless-sampling acceptance."""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from eaglepangu_jax import mask as mask_lib
from eaglepangu_jax import tree as tree_lib
from eaglepangu_jax import verify
from eaglepangu_jax.cache import KVCache
from eaglepangu_jax.engine.drafter import Proposal
from eaglepangu_jax.engine.state import DecodeState
from eaglepangu_jax.models import llama

if TYPE_CHECKING:  # the step's statics; step imports this module
    from eaglepangu_jax.engine.step import StepStatic

__all__ = ["accept", "slot_buckets", "truncate_tree", "verify_and_accept"]


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


def slot_buckets(num_slots: int) -> tuple[int, ...]:
    """Verify-forward sizes compiled for a tree of ``num_slots`` slots: 1, 4, 16, ... and
    ``num_slots`` itself. A round whose valid nodes fit a smaller bucket verifies only that
    many slots (an n-gram drafter without a match costs one plain decode step)."""
    sizes, b = [], 1
    while b < num_slots:
        sizes.append(b)
        b *= 4
    return tuple(sizes) + (num_slots,)


def truncate_tree(tree: tree_lib.Tree, num_slots: int) -> tree_lib.Tree:
    """The first ``num_slots`` slots of ``tree`` (valid when no valid node lies beyond them:
    parents precede children, so every index stays inside)."""
    return jax.tree_util.tree_map(lambda x: x[:num_slots], tree)


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
    cache with the tree's K/V written (not yet committed)."""
    committed = state.cache.length
    index = jnp.arange(tree.num_slots, dtype=jnp.int32)
    last_valid = jnp.max(jnp.where(tree.valid, index, 0))

    def branch(size):
        def run(_):
            small = truncate_tree(tree, size)
            attend = mask_lib.verify_mask(small, committed, static.window)
            logits, features, cache = llama.forward(
                params,
                small.tokens,
                tree_lib.positions(small, committed),
                state.cache,
                attend,
                config=static.teacher,
                feature_layers=static.feature_layers,
            )
            acc = accept(static, small, logits, key, proposal, state)
            return acc, features[acc.path], cache

        return run

    sizes = slot_buckets(tree.num_slots) if static.bucketed else (tree.num_slots,)
    if len(sizes) == 1:
        return branch(sizes[0])(None)
    which = jnp.sum(jnp.asarray(sizes[:-1], jnp.int32) <= last_valid)
    return jax.lax.switch(which, [branch(size) for size in sizes], None)
