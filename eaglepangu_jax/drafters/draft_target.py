"""Draft-target speculation: a small Llama-architecture LM drafts with its own KV cache.

The classic scheme (HF's assisted generation): an independent draft model with the teacher's
tokenizer proposes tokens auto-regressively; the teacher verifies them in one forward. Any
:class:`~eaglepangu_jax.models.config.LlamaConfig` model with the teacher's vocabulary can be
the draft; :func:`truncated_teacher` makes a training-free one (the teacher's first ``k``
layers, its final norm and head: self-speculation, as in LayerSkip or Draft & Verify).

**The draft cache** is a :class:`~eaglepangu_jax.cache.KVCache` holding the committed tokens
*including the root* ``tokens[num_tokens - 1]`` (the teacher's holds one fewer: its verify
forward feeds the root), and the state keeps the draft's logits at the root, its guess for the
root's child. A round:

* :meth:`DraftTargetDrafter.propose`: the root's children are the ``top_k`` best tokens of
  those logits (greedy), or ``top_k`` draws without replacement (Gumbel-top-k) from the draft
  distribution ``q`` at the drafter's temperature; each child then grows a chain, one token
  per draft forward, all chains in the same forward. Drafted tokens go to scratch slots past
  the committed length; ``propose`` returns no state, so they vanish with the round.
* :meth:`DraftTargetDrafter.update`: roll the cache back *by length* to the tokens committed
  before the round (``truncate``, exactly as the teacher's cache), feed the tokens emitted
  (accepted ones and the teacher's bonus, the new root) in one forward of ``depth + 1``
  slots (padding rows land past the new length, never attended) and ``advance`` by their
  count. The logits at the new root seed the next round.

A draft window (``DraftContext.start``) hides the old slots from every draft forward; K/V
cached before a token left the window keep what they saw then (as EAGLE-3's head does):
recomputing the window each round would cost a prefill per round.

**The tree**, ``tree_shape="chains"`` (SpecInfer-style, the default): ``top_k`` chains hang
off the root, filled in rank order up to ``budget`` nodes (chain ``i`` gets
``min(depth, nodes left)``), each chain's nodes in consecutive slots, and no padding slot: the
tree has :attr:`~DraftTargetDrafter.max_nodes` ``+ 1`` slots. Example, ``depth = 3``,
``top_k = 2``, ``budget = 5``::

    slot    0  1  2  3  4  5
    parent  0  0  1  2  0  4        chain 0: slots 1-3, chain 1 (the second child): 4-5
    depth   0  1  2  3  1  2

Siblings sit in draw order, so a budget that cuts chains drops only later draws: what the
multi-step speculative sampling rule needs to stay lossless. With ``temperature > 0`` the
proposal carries ``draft_probs`` (row ``u``: the ``q`` that ``u``'s children were drawn
from) and :func:`eaglepangu_jax.verify.sample` applies the draft-target rejection rule.
The drafter cannot see the engine's traced temperature: set :attr:`temperature` to the
run's (``make_method`` does). Any value is lossless (``draft_probs`` is the law the
children were really drawn from); a different one only accepts less.

``tree_shape="beam"`` grows a dynamic tree instead (the EAGLE-2 idea applied to a draft
model): the root's ``top_k`` best children form the first level; each further level feeds
the ``top_k`` frontier nodes in one draft forward (each row reading only its own ancestors'
scratch slots), and of their ``top_k x top_k`` children the ``top_k`` with the best
cumulative log-probability become the next frontier, whichever parents they hang from. Of the
``depth x top_k`` nodes grown, the ``budget`` best-scored are kept
(:func:`eaglepangu_jax.tree.keep_best`: a child never outranks its parent, so the kept set is a
tree). Where one branch is sure and another is not, the budget goes to the sure one's
subtree, which fixed chains cannot do. The tree is deterministic (top-k at every node) under
sampling too, and verified without ``draft_probs``: the rule for deterministic trees in
:func:`eaglepangu_jax.verify.sample`, lossless for any tree.

**Measured choice of k** (SmolLM2-135M-Instruct, 30 layers). Greedy acceptance on held-out
text, teacher-forced and exact for greedy chains (288 positions: the teacher's greedy answers,
96 tokens each, to MT-Bench writing #1, math #1 and HumanEval #3), with the estimated speed-up
``(1 + E[accepted]) / (1 + D * c_k)`` (one verify, ``D - 1`` draft steps and the update per
round) where a draft forward costs ``c_k = (k * 3.54M + 28.3M) / 134.5M`` teacher forwards
(weights read per token)::

    k                        4    8   12   16   20   24   26   28   (30: the teacher)
    top-1 agreement        .03  .05  .07  .12  .20  .41  .49  .59   1.00
    E[accepted] chain D=2  .03  .05  .08  .13  .23  .60  .74 1.02   2.00
    E[accepted] chain D=4  .03  .05  .08  .14  .25  .70  .93 1.33   4.00
    E[accepted] top-2 D=2  .08  .10  .15  .16  .34  .73  .90 1.15   2.00
    cost c_k               .32  .42  .53  .63  .74  .84  .89  .95   1.00
    est. speed-up chain 2  .63  .57  .52  .50  .50  .60  .62  .70
    est. speed-up top-2 2  .66  .60  .56  .51  .54  .64  .68  .74

The early layers of this small model do not decode through its head (5% agreement at
``k = 8``), and its tied head alone is a fifth of the teacher, so no ``k`` pays: truncation is
a baseline here, not a speed-up. ``k = 28`` has the best estimate at every depth >= 2, best
at depth 2 with two chains: the defaults :data:`DEFAULT_LAYERS`, ``depth = 2``,
``top_k = 2``. The draft reads every emitted token, so a round the ``"auto"`` controller does
not draft would still pay ``c_k`` for the update; on a machine where drafting costs more than
an oracle could save (this CPU: 166 ms per round against a 39 ms step), the engine therefore
does not run the drafter at all (:func:`eaglepangu_jax.engine.decode.speculation_hopeless`).

Dimensions: ``C`` token-buffer capacity, ``S`` draft cache slots, ``K`` chains (root
children), ``D`` depth, ``N`` tree slots, ``V`` vocabulary.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from eaglepangu_jax import cache as cache_lib
from eaglepangu_jax import tree as tree_lib
from eaglepangu_jax import verify
from eaglepangu_jax.cache import KVCache
from eaglepangu_jax.drafters.draft_target_model import (  # noqa: F401  (re-exported)
    PREFILL_CHUNK,
    block_mask,
    check_compatible,
    prefill,
    truncated_teacher,
)
from eaglepangu_jax.engine.drafter import DraftContext, Proposal
from eaglepangu_jax.models import llama
from eaglepangu_jax.models.config import LlamaConfig

__all__ = [
    "DEFAULT_LAYERS",
    "DEFAULT_DEPTH",
    "DEFAULT_TOP_K",
    "TREE_SHAPES",
    "PREFILL_CHUNK",
    "DraftTargetState",
    "DraftTargetDrafter",
    "check_compatible",
    "chain_lengths",
    "tree_layout",
    "prefill",
    "truncated_teacher",
    "load_draft_target",
]

DEFAULT_LAYERS = 28  # the truncated teacher's layers (see the measurement above)
DEFAULT_DEPTH = 2
DEFAULT_TOP_K = 2
TREE_SHAPES = ("chains", "beam")  # see the module docstring


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DraftTargetState:
    """The draft model's cache (committed length = ``num_tokens``, the root included) and its
    logits at the root."""

    cache: KVCache
    logits: Float[Array, " V"]  # [V] draft logits at the root: the law of the root's child


def chain_lengths(budget: int, depth: int, top_k: int) -> tuple[int, ...]:
    """Nodes of each chain, in rank order: ``min(depth, nodes left)`` each, empty ones
    dropped. ``chain_lengths(5, 3, 2) == (3, 2)``; ``chain_lengths(8, 6, 4) == (6, 2)``."""
    lengths, left = [], budget
    for _ in range(top_k):
        if left <= 0:
            break
        lengths.append(min(depth, left))
        left -= lengths[-1]
    return tuple(lengths)


def tree_layout(lengths: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Static ``(chain, level, parents)`` of the chains' nodes in slot order (root excluded
    from ``chain`` and ``level``; ``parents`` has the root's 0 first). Levels count from 1."""
    chain, level, parents = [], [], [0]
    for i, n in enumerate(lengths):
        for d in range(1, n + 1):
            parents.append(0 if d == 1 else len(parents) - 1)
            chain.append(i)
            level.append(d)
    return np.asarray(chain, np.int32), np.asarray(level, np.int32), np.asarray(parents, np.int32)


def _chain_ancestry(width: int, level: Int[Array, ""], size: int) -> Bool[Array, "K M"]:
    """Draft step ``level`` of ``width`` chains: chain ``i``'s nodes so far, among the
    ``size`` scratch slots (its level-``e`` node sits at ``(e - 1) * width + i``), for
    :func:`_ancestry_mask`."""
    j = jnp.arange(size, dtype=jnp.int32)[None, :]
    chain = jnp.arange(width, dtype=jnp.int32)[:, None]
    return (j < level * width) & (j % width == chain)


def _ancestry_mask(
    ancestry: Bool[Array, "K M"],
    committed: Int[Array, ""],
    start: Int[Array, ""],
    num_slots: int,
) -> Bool[Array, "K S"]:
    """A draft step's mask (chains and beam rows alike): row ``i`` reads the visible committed
    slots ``[start, committed)`` and the scratch slots ``committed + j`` with
    ``ancestry[i, j]`` (its ancestors and itself)."""
    s = jnp.arange(num_slots, dtype=jnp.int32)
    rel = s - committed
    scratch = (rel >= 0) & (rel < ancestry.shape[1])
    own = ancestry[:, jnp.clip(rel, 0, ancestry.shape[1] - 1)] & scratch[None, :]
    return ((s >= start) & (rel < 0))[None, :] | own


_prefill = jax.jit(prefill, static_argnames=("config", "num_slots"))


def _slots(root: Array, nodes: Array) -> Array:
    """``[max_nodes + 1]`` slot values: the root's, then the chains' nodes'."""
    return jnp.concatenate([root[None].astype(nodes.dtype), nodes])


@dataclasses.dataclass(frozen=True, kw_only=True)
class DraftTargetDrafter:
    """Draft-target drafter (see the module docstring); params: the draft model's, any layout.

    Attributes:
      config: the draft model's shape.
      teacher_config: the teacher's; its vocabulary (and bos / eos ids) must be the draft's.
      budget: most tree nodes per round, root excluded. The chains fill at most
        ``depth * top_k`` of them: the tree has :attr:`max_nodes` ``+ 1`` slots, and the
        engine lowers a larger run budget to it
        (:func:`~eaglepangu_jax.engine.drafter.fit_budget`).
      depth: chain length ``D``, the tree's maximum depth.
      top_k: children of the root, each grown into a chain (1: a plain chain); with
        ``tree_shape="beam"``, the frontier nodes kept per level.
      tree_shape: ``"chains"`` (``top_k`` fixed chains) or ``"beam"`` (a dynamic tree, the
        best ``top_k`` nodes per level by cumulative log-probability; deterministic, so
        sampled runs verify it without ``draft_probs``). See the module docstring.
      temperature: 0 drafts greedily (argmax, no ``draft_probs``); > 0 samples the children
        from the draft's ``softmax(logits / temperature)`` (top-p filtered) and reports it.
      top_p: nucleus mass of the draft distribution when sampling.
    """

    name: ClassVar[str] = "draft-target"
    feature_layers: ClassVar[tuple[int, ...]] = ()  # reads tokens only, never teacher features
    # Raised when the same tree's drafting cost changes (1: the update computes the root's
    # logits only, not every fed row's), so a calibration's cost measured before is measured
    # again (:func:`eaglepangu_jax.calibration.curve.draft_cost_key`).
    cost_revision: ClassVar[int] = 1

    config: LlamaConfig
    teacher_config: LlamaConfig
    budget: int = 8
    depth: int = DEFAULT_DEPTH
    top_k: int = DEFAULT_TOP_K
    temperature: float = 0.0
    top_p: float = 1.0
    tree_shape: str = "chains"

    def __post_init__(self):
        check_compatible(self.config, self.teacher_config)
        if self.tree_shape not in TREE_SHAPES:
            raise ValueError(f"tree_shape must be one of {TREE_SHAPES}, got {self.tree_shape!r}")
        for field in ("budget", "depth", "top_k"):
            if getattr(self, field) < 1:
                raise ValueError(f"{field} must be >= 1, got {getattr(self, field)}")
        if self.top_k > self.config.vocab_size:
            raise ValueError(f"top_k {self.top_k} exceeds the vocabulary {self.config.vocab_size}")
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def max_depth(self) -> int:
        """Deepest tree it proposes (the chain length)."""
        return self.depth

    @property
    def sampling(self) -> bool:
        """Children are drawn from ``q`` (and reported as ``draft_probs``); a beam tree is
        always grown deterministically."""
        return self.temperature > 0.0 and self.tree_shape == "chains"

    def num_slots(self, capacity: int) -> int:
        """Draft cache slots for a ``capacity``-token buffer: the committed tokens plus the
        scratch chains, in whole prefill chunks."""
        need = capacity + self.top_k * self.depth + 1
        return -(-need // PREFILL_CHUNK) * PREFILL_CHUNK

    def init_state(self, params: Any, context: DraftContext) -> DraftTargetState:
        """Prefill the committed tokens, root included."""
        cache, logits = _prefill(
            params,
            context.tokens,
            context.num_tokens,
            context.start,
            config=self.config,
            num_slots=self.num_slots(context.tokens.shape[0]),
        )
        return DraftTargetState(cache=cache, logits=logits)

    def update(self, params: Any, state: DraftTargetState, context: DraftContext) -> Any:
        """Roll back to the tokens the draft saw last, feed the ``num_features`` emitted
        since (the last is the new root) in one forward as wide as ``context.features``
        (``D + 1`` rows after one round; a longer backlog when the controller skipped
        drafting rounds and the drafter catches up)."""
        width, slots = max(context.features.shape[0], 1), state.cache.num_slots
        emitted = jnp.clip(context.num_features, 0, width).astype(jnp.int32)
        committed = jnp.clip(context.num_tokens - emitted, 0, slots - width).astype(jnp.int32)
        cache = cache_lib.truncate(state.cache, committed)  # rollback: drafted slots drop out
        fed = jax.lax.dynamic_slice(
            jnp.pad(context.tokens.astype(jnp.int32), (0, width)), (committed,), (width,)
        )
        positions = committed + jnp.arange(width, dtype=jnp.int32)
        mask = block_mask(width, committed, context.start, slots)
        # Only the root's logits are kept: the vocabulary product runs for that row alone.
        newest = jnp.clip(emitted - 1, 0, width - 1)[None]
        logits, _, cache = llama.forward(
            params, fed, positions, cache, mask, config=self.config, logits_rows=newest
        )
        return DraftTargetState(
            cache=cache_lib.advance(cache, emitted),
            logits=jnp.where(emitted > 0, logits[0], state.logits),
        )

    def propose(
        self, params: Any, state: DraftTargetState, context: DraftContext, key: Array
    ) -> Proposal:
        """``top_k`` chains of up to ``depth`` tokens from the root, or a beam tree (see the
        module docstring)."""
        c = context.tokens.shape[0]
        root = context.tokens[jnp.clip(context.num_tokens - 1, 0, c - 1)]
        if self.tree_shape == "beam":
            return Proposal(tree=self._beam_tree(params, state, context, root))
        first_key, step_key = jax.random.split(key)
        tokens, scores, q0 = self._children(state.logits, first_key)
        probs = None
        if self.lengths[0] > 1:
            more, more_scores, probs = self._grow(params, state, context, tokens, step_key)
            tokens = jnp.concatenate([tokens[None], more])
            scores = jnp.concatenate([scores[None], more_scores])
        else:
            tokens, scores = tokens[None], scores[None]
        tree = self._tree(root, tokens, scores)
        if not self.sampling:
            return Proposal(tree=tree)
        return Proposal(tree=tree, draft_probs=self._draft_probs(q0, probs))

    @property
    def lengths(self) -> tuple[int, ...]:
        """The chains' node counts (:func:`chain_lengths`)."""
        return chain_lengths(self.budget, self.depth, self.top_k)

    @property
    def max_nodes(self) -> int:
        """Nodes of every tree it proposes, root excluded: ``min(budget, depth * top_k)``."""
        if self.tree_shape == "beam":
            return min(self.budget, self.depth * self.top_k)
        return sum(self.lengths)

    def _law(self, logits: Float[Array, "... V"]) -> Float[Array, "... V"]:
        """The draft distribution ``q`` children are sampled from."""
        return verify.adjusted_probs(logits, self.temperature, self.top_p)

    def _children(
        self, logits: Float[Array, " V"], key: Array
    ) -> tuple[Int[Array, " K"], Float[Array, " K"], Float[Array, " V"] | None]:
        """The root's children: top-k tokens (greedy) or Gumbel-top-k draws from ``q``, i.e.
        sequential draws without replacement, in draw order; their log-probabilities."""
        k = len(self.lengths)
        if not self.sampling:
            logp = _log_probs(logits)
            score, ids = jax.lax.top_k(logp, k)
            return ids.astype(jnp.int32), score, None
        q = self._law(logits)
        logq = jnp.log(q)
        _, ids = jax.lax.top_k(logq + jax.random.gumbel(key, logq.shape), k)
        return ids.astype(jnp.int32), logq[ids], q

    def _next(
        self, logits: Float[Array, "K V"], key: Array
    ) -> tuple[Int[Array, " K"], Float[Array, " K"], Float[Array, "K V"] | None]:
        """Each chain's next token (argmax, or one draw from ``q``) and its log-probability."""
        rows = jnp.arange(logits.shape[0])
        if not self.sampling:
            logp = jax.nn.log_softmax(logits)
            ids = jnp.argmax(logits, axis=-1).astype(jnp.int32)
            return ids, logp[rows, ids], None
        q = self._law(logits)
        logq = jnp.log(q)
        ids = jax.random.categorical(key, logq, axis=-1).astype(jnp.int32)
        return ids, logq[rows, ids], q

    def _grow(
        self,
        params: Any,
        state: DraftTargetState,
        context: DraftContext,
        first: Int[Array, " K"],
        key: Array,
    ) -> tuple[Int[Array, "D-1 K"], Float[Array, "D-1 K"], Float[Array, "D-1 K V"] | None]:
        """Levels ``2..D`` of every chain: step ``d`` feeds the level-``d`` tokens at scratch
        slots past the committed length and picks level ``d + 1``. Also returns the ``q``
        each level-``d`` node's child was drawn from (sampling only)."""
        width, steps, slots = first.shape[0], self.lengths[0] - 1, state.cache.num_slots
        committed = jnp.clip(context.num_tokens, 1, slots).astype(jnp.int32)
        levels = jnp.arange(1, steps + 1, dtype=jnp.int32)

        def step(carry, xs):
            cache, frontier = carry
            level, step_key = xs
            at = committed + (level - 1) * width  # this level's scratch slots
            ancestry = _chain_ancestry(width, level, steps * width)
            mask = _ancestry_mask(ancestry, committed, context.start, slots)
            positions = jnp.full((width,), committed - 1 + level, jnp.int32)
            cache = cache_lib.truncate(cache, at)
            logits, _, cache = llama.forward(
                params, frontier, positions, cache, mask, config=self.config
            )
            ids, score, q = self._next(logits, step_key)
            return (cache, ids), (ids, score, q)

        keys = jax.random.split(key, steps)
        _, (ids, scores, probs) = jax.lax.scan(step, (state.cache, first), (levels, keys))
        return ids, scores, probs

    def _beam_tree(
        self, params: Any, state: DraftTargetState, context: DraftContext, root: Int[Array, ""]
    ) -> tree_lib.Tree:
        """The beam tree of ``max_nodes + 1`` slots (see the module docstring).

        Level ``l``'s frontier sits at scratch slots ``committed + (l - 1) * K + i`` (the
        chains' layout); ``ancestry[i]`` marks row ``i``'s ancestors-and-self among them, so a
        row reads its own path only, whichever rows its ancestors were."""
        width, slots = self.top_k, state.cache.num_slots
        logp = _log_probs(state.logits[None])[0]
        score, ids = jax.lax.top_k(logp, width)
        levels = [(ids.astype(jnp.int32), score, jnp.zeros((width,), jnp.int32))]
        if self.depth > 1:
            committed = jnp.clip(context.num_tokens, 1, slots).astype(jnp.int32)
            rows = jnp.arange(width, dtype=jnp.int32)
            ancestry = jnp.zeros((width, self.depth * width), bool).at[rows, rows].set(True)

            def step(carry, level):
                cache, frontier, score, ancestry = carry
                mask = _ancestry_mask(ancestry, committed, context.start, slots)
                positions = jnp.full((width,), committed - 1 + level, jnp.int32)
                cache = cache_lib.truncate(cache, committed + (level - 1) * width)
                logits, _, cache = llama.forward(
                    params, frontier, positions, cache, mask, config=self.config
                )
                child_score, child_ids = jax.lax.top_k(_log_probs(logits), width)  # [K, K]
                total = (score[:, None] + child_score).reshape(-1)
                best, pick = jax.lax.top_k(total, width)
                parent = (pick // width).astype(jnp.int32)
                ids = child_ids.reshape(-1)[pick].astype(jnp.int32)
                ancestry = ancestry[parent].at[rows, level * width + rows].set(True)
                return (cache, ids, best, ancestry), (ids, best, parent)

            carry = (state.cache, levels[0][0], score, ancestry)
            _, grown = jax.lax.scan(step, carry, jnp.arange(1, self.depth, dtype=jnp.int32))
            levels += [tuple(x[d] for x in grown) for d in range(self.depth - 1)]
        tokens = jnp.concatenate([root[None].astype(jnp.int32)] + [t for t, _, _ in levels])
        scores = jnp.concatenate([jnp.zeros((1,), jnp.float32)] + [s for _, s, _ in levels])
        # Level l's parent row p sits at slot 1 + (l - 2) * K + p; level 1 hangs off the root.
        parents = jnp.concatenate(
            [jnp.zeros((1 + width,), jnp.int32)]
            + [1 + d * width + p for d, (_, _, p) in enumerate(levels[1:])]
        )
        valid = jnp.isfinite(scores)  # a -inf or NaN path is padding, and so is all below it
        full = tree_lib.from_parents(
            parents,
            tokens=tokens,
            valid=valid,
            logscore=jnp.where(valid, scores, -jnp.inf),
            max_depth=self.depth,
        )
        kept = tree_lib.keep_best(full, self.max_nodes)
        return jax.tree_util.tree_map(lambda x: x[: self.max_nodes + 1], kept)

    def _tree(
        self, root: Int[Array, ""], tokens: Int[Array, "D K"], scores: Float[Array, "D K"]
    ) -> tree_lib.Tree:
        """The chains as a tree of ``max_nodes + 1`` slots; a node whose log-probability is
        not finite (a NaN row, a ``q = 0`` draw) is padding, and so is its chain below it."""
        chain, level, parents = tree_layout(self.lengths)
        ok = jnp.cumsum(~jnp.isfinite(scores), axis=0) == 0  # every ancestor finite
        logscore = jnp.cumsum(jnp.where(ok, scores, 0.0), axis=0)
        valid = _slots(jnp.bool_(True), ok[level - 1, chain])
        return tree_lib.from_parents(
            jnp.where(valid, jnp.asarray(parents), 0),
            tokens=_slots(root.astype(jnp.int32), tokens[level - 1, chain]),
            valid=valid,
            logscore=jnp.where(
                valid, _slots(jnp.float32(0.0), logscore[level - 1, chain]), -jnp.inf
            ),
            max_depth=self.depth,
        )

    def _draft_probs(
        self, q0: Float[Array, " V"], probs: Float[Array, "D-1 K V"] | None
    ) -> Float[Array, "N V"]:
        """Row ``u``: the ``q`` that ``u``'s children were drawn from (zeros for leaves,
        which have none)."""
        chain, level, _ = tree_layout(self.lengths)
        width, vocab = len(self.lengths), q0.shape[0]
        last = jnp.zeros((1, width, vocab), jnp.float32)  # the deepest level has no children
        per_level = last if probs is None else jnp.concatenate([probs, last])
        return jnp.concatenate([q0[None], per_level[level - 1, chain]])


def _log_probs(logits: Float[Array, "K V"]) -> Float[Array, "K V"]:
    """Row-wise log-softmax with NaN read as ``-inf`` (a NaN row ranks nothing)."""
    logp = jax.nn.log_softmax(jnp.nan_to_num(logits, nan=-jnp.inf), axis=-1)
    return jnp.where(jnp.isnan(logp), -jnp.inf, logp)


def load_draft_target(
    teacher_params: dict | None = None,
    *,
    teacher_config: LlamaConfig | None = None,
    layers: int = DEFAULT_LAYERS,
    budget: int = 8,
    depth: int = DEFAULT_DEPTH,
    top_k: int = DEFAULT_TOP_K,
    temperature: float = 0.0,
    top_p: float = 1.0,
    tree_shape: str = "chains",
) -> tuple[DraftTargetDrafter, dict]:
    """The training-free draft: the real teacher truncated to ``layers`` layers.

    Args:
      teacher_params: the teacher's parameters; SmolLM2-135M-Instruct is loaded when
        ``None``.
      teacher_config: their config (default: the loaded teacher's, else SmolLM2-135M's).
      layers: the draft's depth in teacher layers.
      budget, depth, top_k, temperature, top_p, tree_shape: the drafter's settings.

    Returns:
      ``(drafter, params)``, the params in the prepared layout.
    """
    if teacher_params is None:
        from eaglepangu_jax.models import smollm2

        loaded_config, teacher_params = smollm2.load_smollm2()
        teacher_config = teacher_config or loaded_config
    teacher_config = teacher_config or LlamaConfig.smollm2_135m()
    config, params = truncated_teacher(teacher_params, teacher_config, layers)
    drafter = DraftTargetDrafter(
        config=config,
        teacher_config=teacher_config,
        budget=budget,
        depth=depth,
        top_k=top_k,
        temperature=temperature,
        top_p=top_p,
        tree_shape=tree_shape,
    )
    return drafter, llama.prepare_params(params)
