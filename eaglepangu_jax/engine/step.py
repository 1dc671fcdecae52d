"""One speculative round as a pure function, and the on-device loop over rounds.

(draft or not) -> build tree -> mask -> verify forward -> accept -> commit -> new root.

Everything here is traced into one XLA computation per (teacher config, drafter, spec shape,
window); ``run_rounds`` wraps the step in ``lax.while_loop`` so a whole segment of generation
runs on device with no host round trip per round. Values that do not change the computation
(seed, temperature, top-p, eos id, max_new_tokens) travel in the state, not in the static key.

Under the ``"auto"`` policy the controller (:mod:`eaglepangu_jax.draft_control`) decides each
round, before drafting, whether speculation is expected to pay: expected emitted tokens per
second ``(1 + E[accepted]) / (t_draft + T_verify(n))`` against ``1 / T_verify(0)``, with
``E[accepted]`` learned online from the rounds so far. If not, the round is a plain one-token
step (``lax.cond``: the drafter does not run). When it drafts, the drafter's node scores are
corrected by the online per-bin acceptance statistics and the tree is pruned to the nodes
that pay for their verification. Exploration probes retry speculation after a back-off.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from eaglepangu_jax import cache as cache_lib
from eaglepangu_jax import draft_control, mode, scoring, verify
from eaglepangu_jax import tree as tree_lib
from eaglepangu_jax.cache import KVCache
from eaglepangu_jax.engine import policies
from eaglepangu_jax.engine.config import SpecConfig
from eaglepangu_jax.engine.drafter import Proposal, fit_budget, fit_curve, proposes_every_round
from eaglepangu_jax.engine.state import DecodeState
from eaglepangu_jax.engine.verification import (
    accept,
    slot_buckets,
    truncate_tree,
    verify_and_accept,
)
from eaglepangu_jax.models.config import LlamaConfig

# An exploration probe verifies the drafter's best nodes up to the first slot bucket of at
# least this many slots (3 nodes): a 2-slot probe would only ever teach the controller
# about depth 1.
PROBE_SLOTS = 4

__all__ = [
    "StepStatic",
    "static_spec",
    "RoundInfo",
    "draft",
    "shape_tree",
    "controlled_tree",
    "propose_tree",
    "plan_round",
    "decide",
    "speculated",
    "draft_if",
    "catch_up",
    "feature_rows",
    "tree_if",
    "accept",
    "slot_buckets",
    "truncate_tree",
    "verify_and_accept",
    "commit_round",
    "advance_state",
    "round_paid",
    "speculative_step",
    "run_rounds",
    "run_rounds_batched",
]


@dataclasses.dataclass(frozen=True)
class StepStatic:
    """The hashable, static half of a step: shapes and strategies."""

    teacher: LlamaConfig
    drafter: Any  # a Drafter (frozen dataclass) or None for plain decoding
    spec: SpecConfig
    window: int  # attention window W: verify reads cache slots [0, W)
    # The mode is read at trace time; keeping it in the static key stops a step traced in one
    # mode from being reused from the jit cache in the other.
    reference: bool = dataclasses.field(default_factory=mode.is_reference)
    # Verify only the smallest slot bucket holding the valid nodes (a lax.switch). Off for
    # batched runs: under vmap a switch evaluates every branch.
    bucketed: bool = True

    def __post_init__(self):
        # Only what shapes the computation stays in the static key: the run's values are in
        # the state (see DecodeState), so new values reuse the compiled loop. The budget is
        # the drafter's node limit at most (``fit_budget``), whoever built the static.
        object.__setattr__(self, "spec", static_spec(fit_budget(self.spec, self.drafter)))

    @property
    def control(self) -> draft_control.ControlConfig:
        """The draft-or-not controller's settings (the spec's); used under the "auto" policy
        with a drafter."""
        return self.spec.control

    @property
    def controlled(self) -> bool:
        """The draft-or-not controller runs (policy "auto" with a drafter)."""
        return self.drafter is not None and self.spec.policy == "auto"

    @property
    def tree_slots(self) -> int:
        """Slots per verify forward: the root alone for plain decoding, else budget + 1."""
        return 1 if self.drafter is None else self.spec.budget + 1

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return tuple(self.drafter.feature_layers) if self.drafter is not None else ()


def static_spec(spec: SpecConfig) -> SpecConfig:
    """``spec`` with its traced values (seed, temperature, top-p, eos id, max_new_tokens) set
    to fixed stand-ins: two runs that differ only there share one compiled loop. Whether
    tokens are sampled stays static (it selects the acceptance rule)."""
    return dataclasses.replace(
        spec,
        seed=0,
        temperature=1.0 if spec.sampling else 0.0,
        top_p=1.0,
        eos_id=None,
        max_new_tokens=1,
    )


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
    return _finish_tree(static, tree, root, n)


def _finish_tree(
    static: StepStatic, tree: tree_lib.Tree, root: Int[Array, ""], n: Int[Array, ""]
) -> tuple[tree_lib.Tree, Int[Array, ""]]:
    """The root slot carries the committed root token, whatever the drafter wrote; a node
    whose token lies outside the vocabulary becomes padding (reference mode: raises)."""
    tree = dataclasses.replace(tree, tokens=tree.tokens.at[0].set(root))
    tree = tree_lib.restrict_tokens(tree, static.teacher.vocab_size)
    if static.reference:
        tree_lib.assert_valid(tree)
    return tree, jnp.minimum(n, jnp.sum(tree.valid[1:]).astype(jnp.int32))


def _root_token(state: DecodeState) -> Int[Array, ""]:
    return state.tokens[jnp.clip(state.num_tokens - 1, 0, state.tokens.shape[0] - 1)]


def controlled_tree(
    static: StepStatic,
    proposal: Proposal,
    state: DecodeState,
    verify_latency: Float[Array, " N"],
    draft_seconds: Float[Array, ""],
    explore: Bool[Array, ""],
) -> tuple[tree_lib.Tree, Int[Array, ""]]:
    """The controller's tree from a proposal: the drafter's own tree, or best-first over its
    marginals, pruned to the nodes that pay for their verification. The node scores are the
    drafter's corrected by the online statistics, except on exploration rounds, which keep
    the drafter's own scores (a pessimistic correction must be able to learn it was wrong)."""
    spec, stats = static.spec, state.control
    root = _root_token(state)
    if proposal.marginals is not None:
        full = scoring.best_first(
            proposal.marginals[: spec.depth], root, budget=spec.budget, top_k=spec.top_k
        )
    else:
        full = policies.fit(proposal.tree, spec)
    full = tree_lib.restrict_tokens(
        dataclasses.replace(full, tokens=full.tokens.at[0].set(root)), static.teacher.vocab_size
    )
    if proposal.draft_probs is not None:
        # Sampled children: dropping an earlier draw while keeping its later siblings would
        # make the verifier read them as first draws (not lossless), so the tree is verified
        # as drawn; the controller only decides whether to draft.
        return _finish_tree(static, full, root, jnp.sum(full.valid[1:]).astype(jnp.int32))
    n_cal, calibrated = draft_control.choose_nodes(
        stats, static.control, full, verify_latency, draft_seconds, 0.0
    )
    # A probe must verify something to learn anything: the drafter's best nodes up to the
    # first slot bucket of at least PROBE_SLOTS (so it also learns past depth 1), more if
    # the uncorrected scores say they pay.
    buckets = slot_buckets(static.tree_slots, static.spec.slot_buckets)
    probe_nodes = next(b for b in buckets if b >= min(PROBE_SLOTS, static.tree_slots)) - 1
    raw = policies.prune_by_controller(full, verify_latency, draft_seconds)
    n_raw = jnp.maximum(jnp.sum(raw.valid[1:]).astype(jnp.int32), probe_nodes)
    raw = tree_lib.keep_best(full, n_raw)
    tree = jax.tree.map(lambda a, b: jnp.where(explore, a, b), raw, calibrated)
    return _finish_tree(static, tree, root, jnp.where(explore, n_raw, n_cal))


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


def plan_round(
    static: StepStatic,
    draft_params: Any,
    state: DecodeState,
    key: Array,
    verify_latency: Float[Array, " N"] | None,
    draft_seconds: Float[Array, ""] | float = 0.0,
) -> tuple[tree_lib.Tree, Int[Array, ""], Proposal, Bool[Array, ""], DecodeState]:
    """This round's tree, its node count, the proposal, whether the round counts as
    speculative (:func:`speculated`), and the state the round continues from.

    Without the controller: :func:`propose_tree` (the state is unchanged). With it (policy
    ``"auto"`` and a drafter): draft only if
    :func:`eaglepangu_jax.draft_control.speculation_pays` on the online statistics, an
    exploration probe is due, or drafting is free (then the node budget decides); otherwise
    the tree is the root alone (a plain one-token step: the verify forward runs at its
    one-slot bucket) and the drafter does not run at all. A drafting round first lets a
    stateful drafter catch up on the teacher features of the rounds it skipped
    (:func:`catch_up`); the returned state holds the caught-up drafter.
    """
    if not static.controlled:
        tree, n, proposal = propose_tree(static, draft_params, state, key, verify_latency)
        return tree, n, proposal, jnp.asarray(static.drafter is not None), state
    drafting, explore = decide(static, state, verify_latency, draft_seconds)
    proposal, state = draft_if(static, draft_params, state, key, drafting)
    tree, n = tree_if(static, proposal, state, verify_latency, draft_seconds, drafting, explore)
    counted = speculated(static, drafting, n, verify_latency, draft_seconds)
    return tree, n, proposal, counted, state


def decide(
    static: StepStatic,
    state: DecodeState,
    verify_latency: Float[Array, " N"] | None,
    draft_seconds: Float[Array, ""] | float,
) -> tuple[Bool[Array, ""], Bool[Array, ""]]:
    """The controller's choice before drafting: ``(draft this round, as an exploration
    probe)``. It drafts when the online estimate says speculation pays, when a probe is due
    (the back-off since the last speculative round has run out), or when drafting is free
    (:func:`eaglepangu_jax.draft_control.drafts_freely`: the node budget then decides)."""
    if verify_latency is None:
        raise ValueError("policy 'auto' needs the verify latency curve (a calibration)")
    return draft_control.decide(
        state.control,
        static.control,
        verify_latency,
        draft_seconds,
        every_round=proposes_every_round(static.drafter),
    )


def speculated(
    static: StepStatic,
    drafting: Bool[Array, ""],
    n_nodes: Int[Array, ""],
    verify_latency: Float[Array, " N"],
    draft_seconds: Float[Array, ""] | float,
) -> Bool[Array, ""]:
    """Whether the controller's statistics count this round as speculative: the drafter ran
    and, if its drafting is free (:func:`eaglepangu_jax.draft_control.drafts_freely`), the
    round verified at least one node. A free drafter proposes every round, and an empty
    proposal (no n-gram match) cost nothing: counting it would reset the probe back-off in
    every round and fill the acceptance averages with rounds that were never speculated. A
    costly drafter's empty round is counted: its drafting time was spent for nothing."""
    free = draft_control.drafts_freely(
        static.control,
        jnp.asarray(verify_latency, jnp.float32),
        jnp.asarray(draft_seconds, jnp.float32),
        every_round=proposes_every_round(static.drafter),
    )
    return drafting & ((n_nodes > 0) | ~free)


def draft_if(
    static: StepStatic, draft_params: Any, state: DecodeState, key: Array, drafting: Bool[Array, ""]
) -> tuple[Proposal, DecodeState]:
    """When ``drafting``: :func:`catch_up`, then :func:`draft` from the caught-up state. Else
    an all-zero proposal of the same shapes and the state unchanged (the drafter does not
    run: ``lax.cond``)."""

    # The branches return the drafter's part of the state only: a branch returning the whole
    # state (the teacher's KV cache included) may make XLA copy the cache every round.
    def run(_):
        caught_up = catch_up(static, draft_params, state)
        proposal = draft(static, draft_params, caught_up, key)
        return proposal, caught_up.drafter_state, caught_up.num_features

    def skip(_):
        zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes)
        return zeros, state.drafter_state, state.num_features

    shapes = jax.eval_shape(run, None)[0]
    proposal, drafter_state, pending = jax.lax.cond(drafting, run, skip, None)
    return proposal, dataclasses.replace(state, drafter_state=drafter_state, num_features=pending)


def feature_rows(spec: SpecConfig, controlled: bool, control: draft_control.ControlConfig) -> int:
    """Rows of the state's feature buffer: the last round's path (``D + 1``), or under the
    controller the backlog a stateful drafter catches up on (at least ``D + 1``)."""
    rows = spec.depth + 1
    return max(rows, control.backlog_rows) if controlled else rows


def catch_up(static: StepStatic, draft_params: Any, state: DecodeState) -> DecodeState:
    """Feed the drafter the teacher features it has not consumed (``state.features[:
    state.num_features]``, the backlog) and empty the backlog.

    Under the controller a stateful drafter (EAGLE-3, block, draft-target) is not updated in
    rounds that do not draft, so a plain round costs what a greedy step costs; it catches up
    here, in one batched update, when it next drafts (or in :func:`advance_state` when the
    backlog is full). The update is the drafter's own ``update``: a backlog of up to
    ``D + 1`` rows runs at the usual ``D + 1``-row shape, a longer one at the buffer's.
    """
    rows, buffer = static.spec.depth + 1, state.features.shape[0]
    window = static.spec.draft_window

    def update(features, count):
        context = dataclasses.replace(state.context(window), features=features, num_features=count)
        return static.drafter.update(draft_params, state.drafter_state, context)

    def short(_):
        start = jnp.clip(state.num_features - rows, 0, buffer - rows)
        features = jax.lax.dynamic_slice_in_dim(state.features, start, rows)
        return update(features, state.num_features - start)

    if buffer == rows:
        drafter_state = short(None)
    else:
        drafter_state = jax.lax.cond(
            state.num_features <= rows,
            short,
            lambda _: update(state.features, state.num_features),
            None,
        )
    return dataclasses.replace(
        state, drafter_state=drafter_state, num_features=jnp.zeros((), jnp.int32)
    )


def tree_if(
    static: StepStatic,
    proposal: Proposal,
    state: DecodeState,
    verify_latency: Float[Array, " N"],
    draft_seconds: Float[Array, ""] | float,
    drafting: Bool[Array, ""],
    explore: Bool[Array, ""],
) -> tuple[tree_lib.Tree, Int[Array, ""]]:
    """:func:`controlled_tree` when ``drafting``, else the root alone (a plain step)."""
    latency = jnp.asarray(verify_latency, jnp.float32)
    t_draft = jnp.asarray(draft_seconds, jnp.float32)

    def skip(_):
        tree = policies.root_only(_root_token(state), static.tree_slots, static.spec.depth)
        return tree, jnp.zeros((), jnp.int32)

    return jax.lax.cond(
        drafting,
        lambda _: controlled_tree(static, proposal, state, latency, t_draft, explore),
        skip,
        None,
    )


def commit_round(
    static: StepStatic,
    draft_params: Any,
    state: DecodeState,
    acc: verify.Acceptance,
    path_features: Float[Array, "D+1 F H"],
    cache: KVCache,
    n_nodes: Int[Array, ""],
    key: Array,
    tree: tree_lib.Tree | None = None,
    drafted: Bool[Array, ""] | bool = False,
    paid: Bool[Array, ""] | None = None,
) -> DecodeState:
    """Commit the accepted path in the teacher's cache, then :func:`advance_state`.

    ``cache`` already holds the path's K/V in place (:func:`verify_and_accept` wrote them at
    ``[length, length + D + 1)``): committing only advances ``length``."""
    state = dataclasses.replace(state, cache=cache_lib.commit_length(cache, acc.length))
    return advance_state(
        static, draft_params, state, acc, path_features, n_nodes, key, tree, drafted, paid
    )


def advance_state(
    static: StepStatic,
    draft_params: Any,
    state: DecodeState,
    acc: verify.Acceptance,
    path_features: Float[Array, "D+1 F H"] | None,
    n_nodes: Int[Array, ""],
    key: Array,
    tree: tree_lib.Tree | None = None,
    drafted: Bool[Array, ""] | bool = False,
    paid: Bool[Array, ""] | None = None,
) -> DecodeState:
    """Everything a round changes besides the teacher's cache, for every backend: append the
    emitted tokens, count the round, set the stop flag (eos or max_new_tokens), log it, feed
    the drafter the accepted positions' features, and fold the round into the controller's
    acceptance statistics (``tree`` is the verified tree, ``drafted`` whether the drafter
    ran, ``paid`` whether it beat a plain step: :func:`round_paid`). ``path_features=None``
    keeps the state's features (plain decoding)."""
    emitted = acc.length + 1
    tokens = jax.lax.dynamic_update_slice(state.tokens, acc.tokens, (state.num_tokens,))
    index = jnp.arange(acc.tokens.shape[0], dtype=jnp.int32)
    budget_left = state.max_new_tokens - state.new_tokens
    hit_eos = jnp.any((acc.tokens == state.eos_id) & (index < emitted))
    new_state = dataclasses.replace(
        state,
        tokens=tokens,
        num_tokens=state.num_tokens + emitted,
        key=key,
        rounds=state.rounds + 1,
        done=hit_eos | (emitted >= budget_left),
        accepted_log=state.accepted_log.at[state.rounds].set(acc.length, mode="drop"),
        nodes_log=state.nodes_log.at[state.rounds].set(n_nodes, mode="drop"),
    )
    # Plain decoding has no drafter to feed (and a 1-deep path of another shape).
    if static.drafter is not None and path_features is not None:
        new_state = _feed_drafter(static, draft_params, new_state, path_features, emitted)
    if static.controlled and tree is not None:
        new_state = dataclasses.replace(
            new_state,
            control=draft_control.update(
                state.control, static.control, tree, acc.length, acc.path, drafted, paid
            ),
        )
    return new_state


def round_paid(
    static: StepStatic,
    acc: verify.Acceptance,
    n_nodes: Int[Array, ""],
    verify_latency: Float[Array, " N"] | None,
    draft_seconds: Float[Array, ""] | float,
) -> Bool[Array, ""] | None:
    """Whether this round's speculation beat a plain step (its own accepted length over its
    node count, :func:`eaglepangu_jax.draft_control.speculation_pays`); None without the
    controller or a latency curve."""
    if not static.controlled or verify_latency is None:
        return None
    return draft_control.speculation_pays(
        acc.length, n_nodes, jnp.asarray(verify_latency, jnp.float32), draft_seconds
    )


def _feed_drafter(
    static: StepStatic,
    draft_params: Any,
    state: DecodeState,
    path_features: Float[Array, "D+1 F H"],
    emitted: Int[Array, ""],
) -> DecodeState:
    """Hand the accepted positions' teacher features to the drafter: at once (its ``update``)
    without the controller; under it, appended to the backlog, which :func:`catch_up` feeds
    when the drafter next drafts, or here when one more round might not fit the buffer."""
    if not static.controlled:
        state = dataclasses.replace(state, features=path_features, num_features=emitted)
        return catch_up(static, draft_params, state)
    rows, buffer = path_features.shape[0], state.features.shape[0]
    pending = jnp.clip(state.num_features, 0, buffer - rows)
    features = jax.lax.dynamic_update_slice_in_dim(state.features, path_features, pending, axis=0)
    state = dataclasses.replace(state, features=features, num_features=pending + emitted)

    def flush(_):
        caught_up = catch_up(static, draft_params, state)
        return caught_up.drafter_state, caught_up.num_features

    drafter_state, pending = jax.lax.cond(
        state.num_features + rows > buffer,
        flush,
        lambda _: (state.drafter_state, state.num_features),
        None,
    )
    return dataclasses.replace(state, drafter_state=drafter_state, num_features=pending)


def speculative_step(
    static: StepStatic,
    params: dict,
    draft_params: Any,
    state: DecodeState,
    verify_latency: Float[Array, " N"] | None = None,
    draft_seconds: Float[Array, ""] | float = 0.0,
) -> tuple[DecodeState, RoundInfo]:
    """One round. The caller skips finished sequences (the loops below do). A latency curve
    made for a budget above the static's fitted one is cut to it (:func:`fit_curve`)."""
    verify_latency = fit_curve(verify_latency, static.spec)
    key, draft_key, accept_key = jax.random.split(state.key, 3)
    tree, n_nodes, proposal, drafted, state = plan_round(
        static, draft_params, state, draft_key, verify_latency, draft_seconds
    )
    acc, path_features, cache = verify_and_accept(static, params, state, tree, proposal, accept_key)
    paid = round_paid(static, acc, n_nodes, verify_latency, draft_seconds)
    new_state = commit_round(
        static, draft_params, state, acc, path_features, cache, n_nodes, key, tree, drafted, paid
    )
    return new_state, RoundInfo(tree=tree, acceptance=acc, num_nodes=n_nodes)


def run_rounds(
    static: StepStatic,
    params: dict,
    draft_params: Any,
    state: DecodeState,
    limit: Int[Array, ""],
    verify_latency: Float[Array, " N"] | None = None,
    draft_seconds: Float[Array, ""] | float = 0.0,
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
        return speculative_step(static, params, draft_params, s, verify_latency, draft_seconds)[0]

    return jax.lax.while_loop(running, body, state)


def run_rounds_batched(
    static, params, draft_params, state, limit, verify_latency=None, draft_seconds=0.0
):
    """:func:`run_rounds` over a batch of states (leading axis ``B``), until all stop."""
    need = static.tree_slots

    def running(s: DecodeState):
        return jnp.any(~s.done & (s.cache.length + need <= limit))

    def body(s: DecodeState):
        def one(x):
            active = ~x.done & (x.cache.length + need <= limit)
            stepped = speculative_step(
                static, params, draft_params, x, verify_latency, draft_seconds
            )[0]
            return jax.tree_util.tree_map(lambda a, b: jnp.where(active, a, b), stepped, x)

        return jax.vmap(one)(s)

    return jax.lax.while_loop(running, body, state)
