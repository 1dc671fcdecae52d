"""Speculative decoding with the teacher in torch: a host-driven loop around the JAX engine.

The JAX engine runs its rounds inside one ``lax.while_loop``; a torch teacher cannot be
traced, so here the host drives each round and every framework does what it owns:

1. **plan** (JAX, jitted): :func:`eaglepangu_jax.engine.step.plan_round` drafts (or, under
   the ``"auto"`` controller, decides not to) and shapes the tree with the engine's policies,
   its vocabulary check included (a drafter token id outside ``[0, V)`` turns the node and
   its descendants into padding; in reference mode it raises naming the node); the verify mask
   (:func:`eaglepangu_jax.mask.verify_mask`) and positions are built, or in branches mode
   the chain table and its causal batch mask (:mod:`npu_backend.branches`).
2. **verify** (torch): tokens, positions and mask cross the bridge
   (:mod:`npu_backend.bridge`); :meth:`TorchLlama.forward` writes the K/V to the cache's
   speculative region, or :func:`~npu_backend.branches.verify_branches` to per-chain
   scratch regions. Unlike the on-device loop, the host knows how much of the tree is
   real: trailing padding slots (or unused chains) are not run, the rows in use being
   rounded up to a power of two so that only a few forward shapes exist.
3. **finish** (JAX, jitted): logits (and teacher features, for drafters that read them)
   cross back; :func:`eaglepangu_jax.engine.step.accept` decides; the engine's own
   :func:`eaglepangu_jax.engine.step.advance_state` updates the token buffer, counters, stop
   flag, logs, drafter state and controller statistics (everything ``speculative_step``
   changes but the cache), so both backends share one state advance.
4. **commit** (torch): the host reads the accepted path (one synchronisation, needed to
   emit tokens anyway) and the cache moves it into place with integer index copies.

The prompt is prefilled in torch in the engine's fixed chunks. The JAX-side state is the
engine's :class:`~eaglepangu_jax.engine.state.DecodeState` with ``cache=None``: the KV cache
lives in torch (:class:`~npu_backend.kv_cache.TorchKVCache`, committed length
``num_tokens - 1``). Stopping (eos, ``max_new_tokens``, capacity), the PRNG stream and the
statistics are those of :func:`eaglepangu_jax.engine.decode.generate`, so both return the
same tokens for the same teacher weights (up to float near-ties).

Every table lookup on the torch side goes through one integer ``index_select``; in reference
mode (``EAGLEPANGU_MODE=reference``) it is the range-checked one of
:mod:`npu_backend.simulated`, so a negative sentinel raises instead of wrapping.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Literal, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import torch

from eaglepangu_jax import mask as mask_lib
from eaglepangu_jax import mode as engine_mode
from eaglepangu_jax import tree as tree_lib
from eaglepangu_jax.engine import decode as engine
from eaglepangu_jax.engine.config import SpecConfig
from eaglepangu_jax.engine.drafter import Proposal
from eaglepangu_jax.engine.state import DecodeState
from eaglepangu_jax.engine.step import (
    StepStatic,
    accept,
    advance_state,
    plan_round,
    round_paid,
)
from npu_backend import branches as branches_lib
from npu_backend import bridge, simulated
from npu_backend.kv_cache import TorchKVCache
from npu_backend.llama_torch import TorchLlama

MODES = ("tree", "branches")
Mode = Literal["tree", "branches"]
# tree -> (branch_slots [B, D + 1], branch_len [B]); jittable. Swappable for tests.
BranchTable = Callable[[tree_lib.Tree], tuple[jax.Array, jax.Array]]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RoundPlan:
    """Everything JAX prepares for one verify forward (branch fields are None in tree mode).

    Dimensions: ``N`` tree slots, ``W`` key columns, ``B`` chains of ``T = D + 1`` entries.
    """

    state: DecodeState  # the state the round continues from (a drafter caught up)
    tree: tree_lib.Tree
    num_nodes: jax.Array  # [] draft nodes in the tree
    proposal: Proposal
    drafted: jax.Array  # [] whether the drafter ran (the controller may skip it)
    key: jax.Array  # the state's next PRNG key
    accept_key: jax.Array
    positions: jax.Array  # [N] tree mode, [B, T] branches mode
    mask: jax.Array  # [N, W] tree mode, [B, T, W] branches mode
    used: jax.Array  # [] rows in use: tree slots up to the last valid one, or chains
    branch_slots: jax.Array | None = None  # [B, T]
    rows: jax.Array | None = None  # [N] flat chain row of each tree slot


@dataclasses.dataclass(frozen=True)
class RoundResult:
    """Host-side outcome of one round."""

    accepted: int  # draft nodes accepted
    path: tuple[int, ...]  # tree slots of the root and the accepted nodes
    moved: int  # cache slots copied by the commit
    verified: int  # rows run: tree slots (tree mode) or chains (branches mode)


@jax.jit(static_argnames=("static", "window", "branches", "table"))
def _plan(
    static: StepStatic,
    draft_params: Any,
    state: DecodeState,
    committed: jax.Array,
    verify_latency: jax.Array | None,
    draft_seconds: jax.Array,
    *,
    window: int,
    branches: bool,
    table: BranchTable,
) -> RoundPlan:
    """Draft, tree and the verify inputs: the tree mask, or the chains and their mask."""
    key, draft_key, accept_key = jax.random.split(state.key, 3)  # as speculative_step
    tree, n_nodes, proposal, drafted, state = plan_round(
        static, draft_params, state, draft_key, verify_latency, draft_seconds
    )
    if branches:
        slots, length = table(tree)
        t = slots.shape[1]
        inputs = dict(
            positions=committed + jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), slots.shape),
            mask=branches_lib.branch_mask(length, committed, t, window),
            branch_slots=slots,
            rows=branches_lib.node_rows(tree, slots, length),
            used=jnp.sum(length > 0).astype(jnp.int32),
        )
    else:
        slot = jnp.arange(tree.num_slots, dtype=jnp.int32)
        inputs = dict(
            positions=tree_lib.positions(tree, committed),
            mask=mask_lib.verify_mask(tree, committed, window),
            used=jnp.max(jnp.where(tree.valid, slot, 0)) + 1,
        )
    return RoundPlan(
        state=state,
        tree=tree,
        num_nodes=n_nodes,
        proposal=proposal,
        drafted=drafted,
        key=key,
        accept_key=accept_key,
        **inputs,
    )


@jax.jit(static_argnames=("static",))
def _finish(
    static: StepStatic,
    draft_params: Any,
    state: DecodeState,
    plan: RoundPlan,
    logits: jax.Array,
    features: jax.Array | None,
    costs: tuple[jax.Array | None, jax.Array],
) -> tuple[DecodeState, jax.Array, jax.Array, jax.Array]:
    """Acceptance and the state update of ``speculative_step`` (the cache aside).

    ``logits`` / ``features`` hold the rows that were verified: the leading tree slots (the
    trailing padding is not run; its rows become the root's, never read by acceptance) or,
    in branches mode, the chains' ``[B T, ...]`` rows, gathered back to tree slots through
    ``plan.rows``. The state advance is the engine's :func:`advance_state`. Returns the new
    state, the accepted length, the path and the winning chain (0 in tree mode).
    """
    winner = jnp.zeros((), jnp.int32)
    rows = plan.rows
    if rows is None and logits.shape[0] < plan.tree.num_slots:
        slot = jnp.arange(plan.tree.num_slots, dtype=jnp.int32)
        rows = jnp.where(slot < logits.shape[0], slot, 0)
    if rows is not None:
        logits = logits[rows]
        features = features[rows] if features is not None else None
    acc = accept(static, plan.tree, logits, plan.accept_key, plan.proposal, state)
    if plan.rows is not None:
        winner = plan.rows[acc.stop] // plan.branch_slots.shape[1]
    path_features = features[acc.path] if features is not None else None
    new_state = advance_state(
        static,
        draft_params,
        state,
        acc,
        path_features,
        plan.num_nodes,
        plan.key,
        plan.tree,
        plan.drafted,
        round_paid(static, acc, plan.num_nodes, *costs),
    )
    return new_state, acc.length, acc.path, winner


@jax.jit(static_argnames=("t", "width"))
def _causal(committed: jax.Array, *, t: int, width: int) -> jax.Array:
    return mask_lib.causal_mask(t, committed, width)


class TorchTeacherRunner:
    """Speculative (or plain) decoding of one sequence with a :class:`TorchLlama` teacher.

    Args:
        model: the torch teacher.
        drafter: a drafter (frozen dataclass) or None for plain decoding.
        spec: the run's settings (as for the JAX engine).
        draft_params: the drafter's weights.
        mode: ``"tree"`` (one tree-masked forward) or ``"branches"`` (a batch of causal
            chains, :mod:`npu_backend.branches`).
        verify_latency: ``[budget + 1]`` predicted verify seconds for the ``"auto"`` policy
            (default: the engine's nominal roofline at the prompt's length, as ``generate``).
        draft_seconds: predicted drafting seconds per round, for the ``"auto"`` controller.
        index_select: the torch integer gather for table lookups; None picks the
            range-checked one in reference mode, plain ``torch.index_select`` otherwise.
        branch_table: the chain decomposition (default :func:`~npu_backend.branches.
            tree_to_branches`); must be a jittable, hashable function.
    """

    def __init__(
        self,
        model: TorchLlama,
        drafter: Any,
        spec: SpecConfig,
        *,
        draft_params: Any = None,
        mode: Mode = "tree",
        verify_latency: Any = None,
        draft_seconds: float = 0.0,
        index_select: branches_lib.IndexSelect | None = None,
        branch_table: BranchTable = branches_lib.tree_to_branches,
    ):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        drafter, draft_params = engine.drafter_to_run(  # as the JAX engine
            drafter, draft_params, spec, verify_latency, draft_seconds
        )
        self.model = model
        self.drafter = drafter
        self.spec = spec
        self.draft_params = draft_params
        self.mode = mode
        self.verify_latency = verify_latency
        self.draft_seconds = draft_seconds
        # The curve the plans use; set per sequence by start() when it defaults.
        self._latency = None if verify_latency is None else jnp.asarray(verify_latency, jnp.float32)
        self.branch_table = branch_table
        if index_select is None:
            index_select = (
                simulated.index_select
                if engine_mode.is_reference()
                else branches_lib.plain_index_select
            )
        self.index_select = index_select
        config = model.config
        self.eos_id = config.eos_id if spec.eos_id is None else spec.eos_id
        self.static = StepStatic(teacher=config, drafter=drafter, spec=spec, window=0)

    # ------------------------------------------------------------------ public

    def generate(self, prompt_ids: Sequence[int], *, stream: int = 0) -> engine.GenerationResult:
        """Generate a continuation; same result and statistics as the JAX ``generate``."""
        t0 = time.perf_counter()
        state, kv = self.start(prompt_ids, stream=stream)
        t1 = time.perf_counter()
        while self.running(state, kv):
            state, _ = self.step(state, kv)
        jax.block_until_ready(state)
        t2 = time.perf_counter()
        return engine.result_from_state(
            state, len(prompt_ids), self.spec, self.eos_id, seconds=t2 - t1, prefill_seconds=t1 - t0
        )

    def start(
        self, prompt_ids: Sequence[int], *, stream: int = 0
    ) -> tuple[DecodeState, TorchKVCache]:
        """Validate, prefill ``prompt[:-1]`` in torch and build the state whose root is the
        prompt's last token (``init_state`` of the JAX engine)."""
        spec, drafter, cfg = self.spec, self.drafter, self.model.config
        engine.validate(engine.Teacher(cfg, {}), drafter, prompt_ids, spec)
        prompt = np.asarray(prompt_ids, np.int32)
        capacity = engine.cache_slots(len(prompt), spec, cfg.max_position)
        kv = self.model.new_cache(capacity + self._scratch())
        dtype = bridge.jax_dtype(self.model.dtype)
        layers = self.static.feature_layers
        features = jnp.zeros((spec.depth + 1, len(layers), cfg.hidden_size), dtype)
        prefill_features = features[:0]
        if len(prompt) > 1:
            tapped = self._prefill(prompt[:-1], kv, capacity)
            if layers:
                prefill_features = bridge.to_jax(tapped)
            else:  # nothing tapped: an empty [P - 1, 0, H], not worth a bridge crossing
                prefill_features = jnp.zeros((len(prompt) - 1, 0, cfg.hidden_size), dtype)
        # The torch cache lives beside the state (``cache=None`` in it).
        state = engine.state_after_prefill(
            prompt,
            None,
            features,
            prefill_features,
            drafter,
            self.draft_params,
            spec,
            capacity=capacity,
            key=jax.random.fold_in(jax.random.key(spec.seed), stream),
            eos_id=self.eos_id,
        )
        if self.verify_latency is None and self.static.controlled:
            # As the JAX engine's decode loop: the nominal roofline at the committed length.
            self._latency = engine.nominal_verify_latency(cfg, spec, kv.length)
        return state, kv

    def running(self, state: DecodeState, kv: TorchKVCache) -> bool:
        """The JAX engine's loop condition: not done and the next tree fits the capacity."""
        return not bool(state.done) and kv.length + self.static.tree_slots <= self._capacity(kv)

    def step(self, state: DecodeState, kv: TorchKVCache) -> tuple[DecodeState, RoundResult]:
        """One round: plan in JAX, verify in torch, accept in JAX, commit in torch."""
        committed = kv.length
        branches = self.mode == "branches"
        # A chain holds D + 1 tokens, which may exceed the tree's slots.
        need = max(self.static.tree_slots, self.spec.depth + 1 if branches else 0)
        window = engine.window_for(committed + need, self._capacity(kv))
        plan = engine_mode.checked(_plan)(
            self.static,
            self.draft_params,
            state,
            jnp.int32(committed),
            self._latency,
            jnp.float32(self.draft_seconds),
            window=window,
            branches=branches,
            table=self.branch_table,
        )
        if branches:
            plan, logits, features, verified = self._verify_branches(plan, kv)
        else:
            logits, features = self._verify_tree(plan, kv)
            verified = logits.shape[0]
        state, length, path, winner = engine_mode.checked(_finish)(
            self.static,
            self.draft_params,
            plan.state,
            plan,
            bridge.to_jax(logits),
            bridge.to_jax(features) if self.static.feature_layers else None,
            (self._latency, jnp.float32(self.draft_seconds)),
        )
        length, path, winner = (int(length), np.asarray(path), int(winner))
        accepted_path = tuple(int(s) for s in path[: length + 1])
        if branches:
            t = int(plan.branch_slots.shape[1])
            if engine_mode.is_reference():
                chain = np.asarray(plan.branch_slots[winner, : length + 1])
                if tuple(int(s) for s in chain) != accepted_path:
                    raise RuntimeError(
                        f"winning chain {winner} holds {chain.tolist()}, "
                        f"not the accepted path {list(accepted_path)}"
                    )
            slots = branches_lib.commit_slots(winner, length, t)
        else:
            slots = accepted_path
        moved = kv.commit_path(slots)
        return state, RoundResult(
            accepted=length, path=accepted_path, moved=moved, verified=verified
        )

    # ------------------------------------------------------------------ internals

    def _scratch(self) -> int:
        """Cache slots past the engine's capacity: the chains' scratch regions."""
        if self.mode != "branches":
            return 0
        return branches_lib.scratch_slots(self.static.tree_slots, self.spec.depth)

    def _capacity(self, kv: TorchKVCache) -> int:
        """The JAX engine's capacity for this sequence (its stopping bound)."""
        return kv.num_slots - self._scratch()

    def _prefill(self, prompt: np.ndarray, kv: TorchKVCache, capacity: int) -> torch.Tensor:
        """Feed ``prompt`` in the engine's fixed-size chunks; returns its features
        ``[P, F, H]``. Chunk padding is written past the committed length, never attended."""
        chunk_size, device = engine.PREFILL_CHUNK, self.model.device
        feats = []
        for begin in range(0, len(prompt), chunk_size):
            chunk = prompt[begin : begin + chunk_size]
            padded = np.zeros((chunk_size,), np.int32)
            padded[: len(chunk)] = chunk
            window = engine.window_for(begin + chunk_size, capacity)
            mask = _causal(jnp.int32(begin), t=chunk_size, width=window)
            positions = jnp.arange(begin, begin + chunk_size, dtype=jnp.int32)
            _, f = self.model.forward(
                bridge.to_torch(jnp.asarray(padded), device),
                bridge.to_torch(positions, device),
                kv,
                bridge.to_torch(mask, device),
                self.static.feature_layers,
            )
            kv.advance(len(chunk))
            feats.append(f[: len(chunk)])
        return torch.cat(feats, dim=0)

    def _verify_tree(self, plan: RoundPlan, kv: TorchKVCache):
        """One tree-masked forward over the slots up to the last valid one (rounded up to a
        power of two): trailing padding is never accepted, so it is not run."""
        rows = _bucket(int(plan.used), plan.tree.num_slots)
        device = self.model.device
        return self.model.forward(
            bridge.to_torch(plan.tree.tokens[:rows], device),
            bridge.to_torch(plan.positions[:rows], device),
            kv,
            bridge.to_torch(plan.mask[:rows], device),
            self.static.feature_layers,
        )

    def _verify_branches(self, plan: RoundPlan, kv: TorchKVCache):
        """Run the chains in use (rounded up to a power of two) as one batch."""
        chains = _bucket(int(plan.used), plan.branch_slots.shape[0])
        plan = dataclasses.replace(
            plan,
            branch_slots=plan.branch_slots[:chains],
            positions=plan.positions[:chains],
            mask=plan.mask[:chains],
        )
        device = self.model.device
        logits, features = branches_lib.verify_branches(
            self.model,
            kv,
            bridge.to_torch(plan.tree.tokens, device),
            bridge.to_torch(plan.branch_slots, device),
            bridge.to_torch(plan.positions, device),
            bridge.to_torch(plan.mask, device),
            self.static.feature_layers,
            index_select=self.index_select,
        )
        t = logits.shape[1]
        return (
            plan,
            logits.reshape(chains * t, -1),
            features.reshape(chains * t, *features.shape[2:]),
            chains,
        )


def _bucket(used: int, total: int) -> int:
    """``used`` rounded up to a power of two, at most ``total``: few distinct forward shapes
    (each new shape recompiles on an NPU)."""
    return min(1 << max(used - 1, 0).bit_length(), total)


def generate_torch(
    torch_model: TorchLlama,
    drafter: Any,
    prompt_ids: Sequence[int],
    spec: SpecConfig,
    *,
    draft_params: Any = None,
    mode: Mode = "tree",
    verify_latency: Any = None,
    draft_seconds: float = 0.0,
    stream: int = 0,
    index_select: branches_lib.IndexSelect | None = None,
) -> engine.GenerationResult:
    """Generate with the teacher in torch (see the module docstring).

    Args:
        torch_model: the teacher, e.g. ``TorchLlama(config, params, device=..., dtype=...)``.
        drafter: a drafter or None (plain decoding, counted the same way).
        prompt_ids: the prompt, at least one token.
        spec: the run's settings.
        draft_params: the drafter's weights.
        mode: ``"tree"`` or ``"branches"`` (chain-only kernels).
        verify_latency: for the ``"auto"`` policy (default: the nominal roofline).
        draft_seconds: predicted drafting seconds per round, for the ``"auto"`` controller.
        stream: random stream index, as in the JAX ``generate``.
        index_select: torch integer gather for table lookups (see
            :class:`TorchTeacherRunner`).

    Returns:
        The same :class:`~eaglepangu_jax.engine.decode.GenerationResult` as the JAX
        ``generate``; ``seconds`` is the decode wall time, prefill excluded.
    """
    runner = TorchTeacherRunner(
        torch_model,
        drafter,
        spec,
        draft_params=draft_params,
        mode=mode,
        verify_latency=verify_latency,
        draft_seconds=draft_seconds,
        index_select=index_select,
    )
    return runner.generate(prompt_ids, stream=stream)
