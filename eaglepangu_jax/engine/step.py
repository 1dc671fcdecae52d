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
from eaglepangu_jax import mode
from eaglepangu_jax import tree as tree_lib
from eaglepangu_jax import verify
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


def propose_tree(static: StepStatic, draft_params: Any, state: DecodeState, key: Array,
                 verify_latency: Float[Array, "N"] | None
                 ) -> tuple[tree_lib.Tree, Int[Array, ""], Proposal]:
    """Ask the drafter for candidates and shape them into this round's tree."""
    spec = static.spec
    root = state.tokens[jnp.clip(state.num_tokens - 1, 0, state.tokens.shape[0] - 1)]
    if static.drafter is None:
        tree = policies.root_only(root, static.tree_slots, 1)
        return tree, jnp.zeros((), jnp.int32), Proposal()
    proposal = static.drafter.propose(draft_params, state.drafter_state,
                                      state.context(spec.draft_window), key)
    tree, n = policies.build_tree(proposal, root, spec, verify_latency=verify_latency)
    # The root slot always carries the committed root token, whatever the drafter wrote.
    tree = dataclasses.replace(tree, tokens=tree.tokens.at[0].set(root))
    if mode.is_reference():
        tree_lib.assert_valid(tree)
    return tree, n, proposal


def accept(static: StepStatic, tree: tree_lib.Tree, logits: Float[Array, "N V"], key: Array,
           proposal: Proposal) -> verify.Acceptance:
    """Greedy or lossless-sampling acceptance, per the spec."""
    spec = static.spec
    if not spec.sampling:
        return verify.greedy(tree, logits)
    return verify.sample(tree, logits, key, temperature=spec.temperature, top_p=spec.top_p,
                         draft_probs=proposal.draft_probs)


def speculative_step(
    static: StepStatic,
    params: dict,
    draft_params: Any,
    state: DecodeState,
    verify_latency: Float[Array, "N"] | None = None,
) -> tuple[DecodeState, RoundInfo]:
    """One round. The caller skips finished sequences (the loops below do)."""
    spec = static.spec
    key, draft_key, accept_key = jax.random.split(state.key, 3)
    tree, n_nodes, proposal = propose_tree(static, draft_params, state, draft_key,
                                           verify_latency)
    committed = state.cache.length
    positions = tree_lib.positions(tree, committed)
    attend = mask_lib.verify_mask(tree, committed, static.window)
    logits, features, cache = llama.forward(
        params, tree.tokens, positions, state.cache, attend,
        config=static.teacher, feature_layers=static.feature_layers)
    acc = accept(static, tree, logits, accept_key, proposal)
    cache = cache_lib.commit(cache, acc.path, acc.length)

    emitted = acc.length + 1
    tokens = jax.lax.dynamic_update_slice(state.tokens, acc.tokens, (state.num_tokens,))
    index = jnp.arange(acc.tokens.shape[0], dtype=jnp.int32)
    budget_left = spec.max_new_tokens - state.new_tokens
    hit_eos = jnp.any((acc.tokens == static.eos_id) & (index < emitted))
    done = hit_eos | (emitted >= budget_left)
    new_state = dataclasses.replace(
        state,
        tokens=tokens,
        num_tokens=state.num_tokens + emitted,
        cache=cache,
        # Plain decoding has no drafter to feed (and a 1-deep path of another shape).
        features=features[acc.path] if static.drafter is not None else state.features,
        num_features=emitted,
        key=key,
        rounds=state.rounds + 1,
        done=done,
        accepted_log=state.accepted_log.at[state.rounds].set(acc.length, mode="drop"),
        nodes_log=state.nodes_log.at[state.rounds].set(n_nodes, mode="drop"),
    )
    if static.drafter is not None:
        new_state = dataclasses.replace(new_state, drafter_state=static.drafter.update(
            draft_params, state.drafter_state, new_state.context(spec.draft_window)))
    return new_state, RoundInfo(tree=tree, acceptance=acc, num_nodes=n_nodes)


def run_rounds(
    static: StepStatic,
    params: dict,
    draft_params: Any,
    state: DecodeState,
    limit: Int[Array, ""],
    verify_latency: Float[Array, "N"] | None = None,
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
