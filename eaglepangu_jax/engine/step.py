"""One speculative round as a pure function, and the on-device loop over rounds.

draft -> build tree -> mask -> verify forward -> accept -> commit -> new root.

Everything here is traced into one XLA computation per (teacher config, drafter, spec, window);
``run_rounds`` wraps the step in ``lax.while_loop`` so a whole segment of generation runs on
device with no host round trip per round.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from eaglepangu_jax import cache as cache_lib
from eaglepangu_jax import mask as mask_lib
from eaglepangu_jax import mode, verify
from eaglepangu_jax import tree as tree_lib
from eaglepangu_jax.cache import KVCache
from eaglepangu_jax.engine import policies
from eaglepangu_jax.engine.config import SpecConfig
from eaglepangu_jax.engine.drafter import Proposal
from eaglepangu_jax.engine.state import DecodeState
from eaglepangu_jax.models import llama
from eaglepangu_jax.models.config import LlamaConfig


@dataclasses.dataclass(frozen=True)
class StepStatic:
    """The hashable, static half of a step: shapes and strategies."""

    teacher: LlamaConfig
    drafter: Any  # a Drafter (frozen dataclass) or None for plain decoding
    spec: SpecConfig
    window: int  # attention window W: verify reads cache slots [0, W)
    eos_id: int
    # The mode is read at trace time; keeping it in the static key stops a step traced in one
    # mode from being reused from the jit cache in the other.
    reference: bool = dataclasses.field(default_factory=mode.is_reference)
    # Verify only the smallest slot bucket holding the valid nodes (a lax.switch). Off for
    # batched runs: under vmap a switch evaluates every branch.
    bucketed: bool = True

    @property
    def tree_slots(self) -> int:
        """Slots per verify forward: the root alone for plain decoding, else budget + 1."""
        return 1 if self.drafter is None else self.spec.budget + 1

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return tuple(self.drafter.feature_layers) if self.drafter is not None else ()


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RoundInfo:
    """Per-round outputs, for traces and tests."""

    tree: tree_lib.Tree
    acceptance: verify.Acceptance
    num_nodes: Int[Array, ""]


def draft(static: StepStatic, draft_params: Any, state: DecodeState, key: Array) -> Proposal:
    """The drafter's proposal for this round (empty for plain decoding)."""
    if static.drafter is None:
        return Proposal()
    return static.drafter.propose(
        draft_params, state.drafter_state, state.context(static.spec.draft_window), key
    )


def shape_tree(
    static: StepStatic,
    proposal: Proposal,
    state: DecodeState,
    verify_latency: Float[Array, " N"] | None,
) -> tuple[tree_lib.Tree, Int[Array, ""]]:
    """This round's tree (root = the committed root token) and its node count."""
    spec = static.spec
    root = state.tokens[jnp.clip(state.num_tokens - 1, 0, state.tokens.shape[0] - 1)]
    if static.drafter is None:
        return policies.root_only(root, static.tree_slots, 1), jnp.zeros((), jnp.int32)
    tree, n = policies.build_tree(proposal, root, spec, verify_latency=verify_latency)
    # The root slot always carries the committed root token, whatever the drafter wrote.
    tree = dataclasses.replace(tree, tokens=tree.tokens.at[0].set(root))
    if static.reference:
        tree_lib.assert_valid(tree)
    return tree, n


def propose_tree(
    static: StepStatic,
    draft_params: Any,
    state: DecodeState,
    key: Array,
    verify_latency: Float[Array, " N"] | None,
) -> tuple[tree_lib.Tree, Int[Array, ""], Proposal]:
    """:func:`draft` then :func:`shape_tree`."""
    proposal = draft(static, draft_params, state, key)
    tree, n = shape_tree(static, proposal, state, verify_latency)
    return tree, n, proposal


def accept(
    static: StepStatic,
    tree: tree_lib.Tree,
    logits: Float[Array, "N V"],
    key: Array,
    proposal: Proposal,
) -> verify.Acceptance:
    """Greedy or lossless-sampling acceptance, per the spec."""
    spec = static.spec
    if not spec.sampling:
        return verify.greedy(tree, logits)
    draft_probs = proposal.draft_probs
    if draft_probs is not None:
        draft_probs = draft_probs[: tree.num_slots]
    return verify.sample(
        tree, logits, key, temperature=spec.temperature, top_p=spec.top_p, draft_probs=draft_probs
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
            acc = accept(static, small, logits, key, proposal)
            return acc, features[acc.path], cache

        return run

    sizes = slot_buckets(tree.num_slots) if static.bucketed else (tree.num_slots,)
    if len(sizes) == 1:
        return branch(sizes[0])(None)
    which = jnp.sum(jnp.asarray(sizes[:-1], jnp.int32) <= last_valid)
    return jax.lax.switch(which, [branch(size) for size in sizes], None)


def commit_round(
    static: StepStatic,
    draft_params: Any,
    state: DecodeState,
    acc: verify.Acceptance,
    path_features: Float[Array, "D+1 F H"],
    cache: KVCache,
    n_nodes: Int[Array, ""],
    key: Array,
) -> DecodeState:
    """Commit the accepted path, append the emitted tokens, update the drafter, stop flags."""
    spec = static.spec
    if static.drafter is None:
        cache = cache_lib.commit_length(cache, acc.length)  # the root alone: nothing moves
    else:
        cache = cache_lib.commit(cache, acc.path, acc.length)
    emitted = acc.length + 1
    tokens = jax.lax.dynamic_update_slice(state.tokens, acc.tokens, (state.num_tokens,))
    index = jnp.arange(acc.tokens.shape[0], dtype=jnp.int32)
    budget_left = spec.max_new_tokens - state.new_tokens
    hit_eos = jnp.any((acc.tokens == static.eos_id) & (index < emitted))
    new_state = dataclasses.replace(
        state,
        tokens=tokens,
        num_tokens=state.num_tokens + emitted,
        cache=cache,
        # Plain decoding has no drafter to feed (and a 1-deep path of another shape).
        features=path_features if static.drafter is not None else state.features,
        num_features=emitted,
        key=key,
        rounds=state.rounds + 1,
        done=hit_eos | (emitted >= budget_left),
        accepted_log=state.accepted_log.at[state.rounds].set(acc.length, mode="drop"),
        nodes_log=state.nodes_log.at[state.rounds].set(n_nodes, mode="drop"),
    )
    if static.drafter is not None:
        new_state = dataclasses.replace(
            new_state,
            drafter_state=static.drafter.update(
                draft_params, state.drafter_state, new_state.context(spec.draft_window)
            ),
        )
    return new_state


def speculative_step(
    static: StepStatic,
    params: dict,
    draft_params: Any,
    state: DecodeState,
    verify_latency: Float[Array, " N"] | None = None,
) -> tuple[DecodeState, RoundInfo]:
    """One round. The caller skips finished sequences (the loops below do)."""
    key, draft_key, accept_key = jax.random.split(state.key, 3)
    tree, n_nodes, proposal = propose_tree(static, draft_params, state, draft_key, verify_latency)
    acc, path_features, cache = verify_and_accept(static, params, state, tree, proposal, accept_key)
    new_state = commit_round(static, draft_params, state, acc, path_features, cache, n_nodes, key)
    return new_state, RoundInfo(tree=tree, acceptance=acc, num_nodes=n_nodes)


def run_rounds(
    static: StepStatic,
    params: dict,
    draft_params: Any,
    state: DecodeState,
    limit: Int[Array, ""],
    verify_latency: Float[Array, " N"] | None = None,
) -> DecodeState:
    """Run rounds on device until done or until the next tree might not fit ``limit`` slots.

    ``limit`` (dynamic) is the window the static ``static.window`` allows: a round needs
    ``cache.length + budget + 1`` slots, so the loop stops early enough for the host to move
    to a wider window.
    """
    need = static.tree_slots

    def running(s: DecodeState):
        return ~s.done & (s.cache.length + need <= limit)

    def body(s: DecodeState):
        return speculative_step(static, params, draft_params, s, verify_latency)[0]

    return jax.lax.while_loop(running, body, state)


def run_rounds_batched(static, params, draft_params, state, limit, verify_latency=None):
    """:func:`run_rounds` over a batch of states (leading axis ``B``), until all stop."""
    need = static.tree_slots

    def running(s: DecodeState):
        return jnp.any(~s.done & (s.cache.length + need <= limit))

    def body(s: DecodeState):
        def one(x):
            active = ~x.done & (x.cache.length + need <= limit)
            stepped = speculative_step(static, params, draft_params, x, verify_latency)[0]
            return jax.tree_util.tree_map(lambda a, b: jnp.where(active, a, b), stepped, x)

        return jax.vmap(one)(s)

    return jax.lax.while_loop(running, body, state)
