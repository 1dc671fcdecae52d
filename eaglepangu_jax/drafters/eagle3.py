"""EAGLE-3 draft head: one decoder layer over fused low/mid/high teacher features.

**Head.** Slot ``j`` sees the teacher features of token ``x_j`` from ``F`` tapped layers,
fused by ``fc: F*H -> H`` into ``g_j``, and the (frozen, shared) teacher embedding of the next
token ``x_{j+1}``. One decoder layer whose q/k/v read ``[norm(embed(x_{j+1})), norm(g_j)]``
(``2H`` wide) with ``g_j`` as the residual, then an MLP, gives the head's hidden state ``h_j``;
``lm_head(final_norm(h_j))`` over the draft vocabulary predicts ``x_{j+2}``. For the next draft
step the head's own ``h_j`` stands in for the teacher feature (the teacher has not seen the
drafted token yet)::

    slot j     [g_j   | x_{j+1}]  -> h_j      -> predicts x_{j+2}
    slot j+1   [h_j   | x_{j+2}]  -> h_{j+1}  -> predicts x_{j+3}   (draft / training-time test)

**Draft time.** The drafter state keeps the head's K/V of every committed slot (teacher
features known) and the hidden state of the newest one (the update computes K/V for every new
slot but runs the attention and MLP for the newest only: the others' hidden states are never
read), so a round costs at most ``min(depth, budget) - 1`` forwards of ``top_k``
tokens (a tree of ``budget`` nodes holds no node deeper than ``budget``: see
:attr:`Eagle3Drafter.tree_levels`; one node a round costs no forward at all, its candidates
are the root's children, read from the head state the last update left). The tree is grown
EAGLE-2 style: the ``top_k`` best children of each of the ``top_k`` frontier nodes (by
cumulative log-probability) are candidates, the ``top_k`` best candidates form the next
frontier; finally the global best ``budget`` candidates are kept. Every candidate records its
parent's candidate index, so parents are never searched for; a NaN log-probability becomes
``-inf`` and such nodes are padding. A level is grown only while one of its nodes could still
enter those ``budget`` (:func:`children_can_enter`; a ``lax.cond``, so the head does not
run): with 8 nodes a confident head's tree is deep and an unsure one's wide and shallow, and
the levels below the deepest node that can be chosen were computed for nothing.

**Training-time test** (:func:`ttt_logits`): ``k`` unrolled steps; step ``i`` of the chain
started at slot ``s`` attends to the teacher-feature slots ``<= s`` and to steps ``1..i`` of its
own chain, exactly what a depth-``i`` draft node sees.

Dimensions: ``T`` slots, ``C`` buffer capacity, ``K`` top_k, ``D`` depth, ``F`` tapped layers,
``H`` hidden, ``Vd`` draft vocabulary, ``V`` teacher vocabulary.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from eaglepangu_jax import tree as tree_lib
from eaglepangu_jax.drafters.eagle3_head import (  # noqa: F401  (re-exported: the head's API)
    HEAD_KEYS,
    Eagle3Config,
    attend,
    check_head_config,
    checked_temperature,
    default_feature_layers,
    draft_logits,
    finish,
    fuse,
    init_head,
    make_params,
    project,
    safe_log_softmax,
    ttt_logits,
)
from eaglepangu_jax.engine.drafter import DraftContext, FeatureHeadDrafter, Proposal

__all__ = [
    "Eagle3Config",
    "Eagle3State",
    "Eagle3Drafter",
    "children_can_enter",
    "SHIPPED_NAME",
    "load_shipped_eagle3",
    "depth_temperature_for",
    "with_calibration",
    "with_depth_temperature",
]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Eagle3State:
    """The head's committed K/V: slot ``p`` = (features of position ``p``, token ``p + 1``)."""

    k: Float[Array, "C Nk Dh"]  # [C, Nk, Dh]
    v: Float[Array, "C Nk Dh"]  # [C, Nk, Dh]
    first: Int[Array, ""]  # first filled slot (earlier prompt positions had no features)
    length: Int[Array, ""]  # slots [first, length) are filled
    last_hidden: Float[Array, " H"]  # h of slot length - 1: it predicts the root's child


class _Frontier(NamedTuple):
    """The nodes a tree level grows from, and the draft buffers their children read."""

    index: Int[Array, " K"]  # pool index of each frontier node
    token: Int[Array, " K"]
    score: Float[Array, " K"]  # cumulative log-probability
    hidden: Float[Array, "K H"]  # the hidden its slot reads as a feature
    draft_k: Float[Array, "DK Nk Dh"]  # K/V of the drafted nodes, by draft-buffer row
    draft_v: Float[Array, "DK Nk Dh"]
    anc: Int[Array, "K D"]  # anc[j, d]: draft-buffer row of node j's ancestor at depth d + 1
    anc_live: Bool[Array, "K D"]


def children_can_enter(
    frontier_score: Float[Array, " K"], pool_score: Float[Array, " P"], budget: int
) -> Bool[Array, ""]:
    """Whether growing the frontier's children can change a tree of the ``budget`` best
    candidates of the pool: false once ``budget`` candidates already score at least as high
    as every frontier node.

    A child's score is its parent's plus a log-probability, so it is never above its parent's,
    and nothing deeper is above the frontier's best. The tree takes the ``budget`` best with
    ``lax.top_k``, which puts the lower index first among equal scores, and children join the
    pool after every candidate already in it: a child that only ties the ``budget``-th best
    is not chosen either. So when ``budget`` candidates score at least the frontier's best, no
    later candidate enters the top ``budget`` (the check never changes which candidates are
    chosen). A pool with fewer than ``budget`` scores always grows. NaN scores count as
    ``-inf``, as in the tree selection.
    """
    pool = jnp.where(jnp.isnan(pool_score), -jnp.inf, pool_score)
    if pool.shape[0] < budget:
        return jnp.asarray(True)
    threshold = jax.lax.top_k(pool, budget)[0][budget - 1]
    best = jnp.max(jnp.where(jnp.isnan(frontier_score), -jnp.inf, frontier_score))
    return best > threshold


@dataclasses.dataclass(frozen=True, kw_only=True)
class Eagle3Drafter(FeatureHeadDrafter):
    """EAGLE-3 drafter (see the module docstring); params from :func:`make_params`.

    Attributes:
      config: the head's shape.
      budget: tree nodes per round, root excluded (the tree has ``budget + 1`` slots).
      depth: deepest draft node ``D``.
      top_k: children per expanded node and frontier width ``K``.
      early_stop: grow a level only while one of its nodes could enter the final tree
        (:func:`children_can_enter`); the tree is the same either way, and ``False`` (every
        level up to :attr:`tree_levels` grown, the cost of the deepest tree every round) is
        kept for comparison.
    """

    name: ClassVar[str] = "eagle3"
    # Raised when the same tree's drafting cost changes (1: no level below tree_levels is
    # grown; 2: the update runs the head's attention and MLP for the newest row only; 3: the
    # attention reads the cache in place, grouped, instead of a joined, repeated copy), so a
    # calibration's cost measured before is not read but measured again
    # (:func:`eaglepangu_jax.calibration.curve.draft_cost_key`).
    cost_revision: ClassVar[int] = 3

    config: Eagle3Config
    budget: int = 16
    depth: int = 6
    top_k: int = 4
    early_stop: bool = True

    def __post_init__(self):
        for field in ("budget", "depth", "top_k"):
            if getattr(self, field) < 1:
                raise ValueError(f"{field} must be >= 1, got {getattr(self, field)}")
        if self.top_k > self.config.draft_vocab_size:
            raise ValueError(
                f"top_k {self.top_k} exceeds the draft vocabulary {self.config.draft_vocab_size}"
            )

    @property
    def tree_levels(self) -> int:
        """The deepest tree level a round can use: ``min(depth, budget)``.

        The tree keeps the ``budget`` best candidates, and a node is chosen only with its
        parent (the parent scores at least as high and comes first in the pool, and
        ``lax.top_k`` puts the lower index first among equal scores), so a chosen node at
        depth ``d`` brings ``d - 1`` chosen ancestors: no node below depth ``budget`` is ever
        chosen, and the levels below it are not grown (static: one node a round drafts with
        no head forward).
        """
        return min(self.depth, self.budget)

    def init_state(self, params: Any, context: DraftContext) -> Eagle3State:
        """Empty cache, then the prompt positions whose features the engine handed over."""
        cfg = self.config
        c = context.tokens.shape[0]
        shape = (c, cfg.num_kv_heads, cfg.head_dim)
        first = jnp.maximum(context.num_tokens - 1 - context.num_features, 0)
        empty = Eagle3State(
            k=jnp.zeros(shape, jnp.float32),
            v=jnp.zeros(shape, jnp.float32),
            first=first.astype(jnp.int32),
            length=first.astype(jnp.int32),
            last_hidden=jnp.zeros((cfg.hidden_size,), jnp.float32),
        )
        return self.update(params, empty, context)

    def update(self, params: Any, state: Eagle3State, context: DraftContext) -> Eagle3State:
        """Add the slots of the newly accepted positions (their features just arrived)."""
        cfg, head = self.config, params["head"]
        c, a = context.tokens.shape[0], context.features.shape[0]
        nf = context.num_features
        row = jnp.arange(a, dtype=jnp.int32)
        pos = context.num_tokens - 1 - nf + row
        live = row < nf
        nxt = context.tokens[jnp.clip(pos + 1, 0, c - 1)]
        feat = fuse(head, context.features)
        emb = params["embed"][nxt].astype(jnp.float32)
        q, k, v = project(head, cfg, emb, feat, jnp.maximum(pos, 0))
        slot = jnp.where(live, pos, c)  # c is past the end: dropped, never wrapped
        keys = state.k.at[slot].set(k, mode="drop")
        values = state.v.at[slot].set(v, mode="drop")
        # Every new slot needs its K/V (above), but only the newest one's hidden state is kept
        # (the root's children are read from it), so the attention, output projection and
        # MLP run for that one row: on a CPU a one-row product is a matrix-vector product,
        # and a catch-up over a long backlog no longer runs the MLP over every row of it.
        s = jnp.arange(c, dtype=jnp.int32)
        first = jnp.maximum(state.first, context.start)
        last = jnp.clip(nf - 1, 0, a - 1)
        mask = ((s >= first) & (s <= pos[last]))[None, :]
        h = finish(head, cfg, feat[last][None], attend(cfg, q[last][None], keys, values, mask))[0]
        last_hidden = jnp.where(nf > 0, h, state.last_hidden)
        return Eagle3State(
            k=keys,
            v=values,
            first=state.first,
            length=(context.num_tokens - 1).astype(jnp.int32),
            last_hidden=last_hidden,
        )

    def propose(
        self, params: Any, state: Eagle3State, context: DraftContext, key: Array
    ) -> Proposal:
        """An EAGLE-2-style dynamic tree of ``budget`` nodes (``budget + 1`` slots)."""
        cfg, head, d2t = self.config, params["head"], params["d2t"]
        kk, depth = self.top_k, self.depth
        c = context.tokens.shape[0]
        root = context.tokens[jnp.clip(context.num_tokens - 1, 0, c - 1)]
        s = jnp.arange(c, dtype=jnp.int32)
        first = jnp.maximum(state.first, context.start)
        committed = (s >= first) & (s < state.length)  # [C]

        temperature = depth_temperature_for(params, self.budget)

        def log_probs(hidden, d):  # the marginals of tree depth d + 1 (d = 0: root children)
            logits = draft_logits(head, cfg, hidden)
            if temperature is not None:  # calibrated (absent: the raw marginals)
                logits = logits / temperature[min(d, temperature.shape[0] - 1)]
            return safe_log_softmax(logits)

        logp = log_probs(state.last_hidden[None, :], 0)[0]
        score, ids = jax.lax.top_k(logp, kk)
        pool_score, pool_token, pool_parent = [score], [d2t[ids]], [jnp.zeros((kk,), jnp.int32)]
        buffer_row = jnp.arange(depth * kk, dtype=jnp.int32)
        frontier = _Frontier(
            index=jnp.arange(kk, dtype=jnp.int32),
            token=d2t[ids],
            score=score,
            hidden=jnp.broadcast_to(state.last_hidden[None, :], (kk, cfg.hidden_size)),
            draft_k=jnp.zeros((depth * kk, cfg.num_kv_heads, cfg.head_dim), jnp.float32),
            draft_v=jnp.zeros((depth * kk, cfg.num_kv_heads, cfg.head_dim), jnp.float32),
            anc=jnp.zeros((kk, depth), jnp.int32),
            anc_live=jnp.zeros((kk, depth), bool),
        )

        def grow(d, offset, carry):  # the children of the depth-d frontier (static d)
            f_index, f_token, f_score, f_hidden, draft_k, draft_v, anc, anc_live = carry
            rows = (d - 1) * kk + jnp.arange(kk, dtype=jnp.int32)
            anc = anc.at[:, d - 1].set(rows)
            anc_live = anc_live.at[:, d - 1].set(True)
            emb = params["embed"][f_token].astype(jnp.float32)
            position = jnp.full((kk,), state.length + d - 1, jnp.int32)
            q, k, v = project(head, cfg, emb, f_hidden, position)
            draft_k = draft_k.at[rows].set(k)
            draft_v = draft_v.at[rows].set(v)
            own = jnp.any(
                (anc[:, :, None] == buffer_row[None, None, :]) & anc_live[:, :, None], axis=1
            )  # [K, D * K]: the node's ancestors and itself
            # The committed cache and the tree's rows as two blocks of one softmax (no copy
            # of the cache per level).
            attn = attend(
                cfg,
                q,
                (state.k, draft_k),
                (state.v, draft_v),
                jnp.concatenate([jnp.broadcast_to(committed[None, :], (kk, c)), own], axis=1),
            )
            h = finish(head, cfg, f_hidden, attn)
            logp = log_probs(h, d)  # [K, Vd]
            child_score, child_ids = jax.lax.top_k(logp, kk)  # [K, K]
            cand = (f_score[:, None] + child_score).reshape(-1)
            cand = jnp.where(jnp.isnan(cand), -jnp.inf, cand)
            best_score, best = jax.lax.top_k(cand, kk)
            parent_row = best // kk
            carry = _Frontier(
                offset + best.astype(jnp.int32),
                d2t[child_ids.reshape(-1)[best]],
                best_score,
                h[parent_row],
                draft_k,
                draft_v,
                anc[parent_row],
                anc_live[parent_row],
            )
            return carry, cand, d2t[child_ids].reshape(-1)

        def stop(carry):  # no child could enter the tree: none is computed
            empty = jnp.full((kk * kk,), -jnp.inf, jnp.float32)
            return carry, empty, jnp.zeros((kk * kk,), jnp.int32)

        offset = kk
        for d in range(1, self.tree_levels):
            parent = jnp.repeat(frontier.index + 1, kk)  # pool index + 1; 0 = root
            if self.early_stop:
                pool = jnp.concatenate(pool_score)
                worth = children_can_enter(frontier.score, pool, self.budget)
                frontier, cand, token = jax.lax.cond(
                    worth, functools.partial(grow, d, offset), stop, frontier
                )
            else:
                frontier, cand, token = grow(d, offset, frontier)
            pool_score.append(cand)
            pool_token.append(token)
            pool_parent.append(parent)
            offset += kk * kk
        return Proposal(
            tree=self._select(
                root,
                jnp.concatenate(pool_score),
                jnp.concatenate(pool_token),
                jnp.concatenate(pool_parent),
            )
        )

    def _select(
        self,
        root: Int[Array, ""],
        score: Float[Array, " P"],
        token: Int[Array, " P"],
        parent: Int[Array, " P"],
    ) -> tree_lib.Tree:
        """The global top-``budget`` candidates as a tree; pool order is topological."""
        p, n = score.shape[0], self.budget
        score = jnp.where(jnp.isnan(score), -jnp.inf, score)
        take = min(n, p)
        _, chosen = jax.lax.top_k(score, take)
        chosen = jnp.sort(chosen).astype(jnp.int32)  # parents precede children in the pool
        slot_of = (
            jnp.zeros((p,), jnp.int32).at[chosen].set(jnp.arange(1, take + 1, dtype=jnp.int32))
        )
        par_pool = jnp.clip(parent[chosen] - 1, 0, p - 1)
        par_slot = jnp.where(parent[chosen] == 0, 0, slot_of[par_pool])
        ok = jnp.isfinite(score[chosen]) & ((parent[chosen] == 0) | (par_slot > 0))
        pad = n - take
        parents = jnp.concatenate(
            [jnp.zeros((1,), jnp.int32), par_slot, jnp.zeros((pad,), jnp.int32)]
        )
        valid = jnp.concatenate([jnp.ones((1,), bool), ok, jnp.zeros((pad,), bool)])
        tokens = jnp.concatenate(
            [
                root[None].astype(jnp.int32),
                token[chosen].astype(jnp.int32),
                jnp.zeros((pad,), jnp.int32),
            ]
        )
        logscore = jnp.concatenate(
            [jnp.zeros((1,), jnp.float32), score[chosen], jnp.full((pad,), -jnp.inf, jnp.float32)]
        )

        # Validity closure (an invalid parent invalidates its subtree), so the tree is
        # well-formed even in reference mode, where from_parents checks instead of repairing.
        def close(keep, i):
            return keep.at[i].set(keep[i] & keep[parents[i]]), None

        valid, _ = jax.lax.scan(close, valid, jnp.arange(1, n + 1, dtype=jnp.int32))
        parents = jnp.where(valid, parents, 0)
        return tree_lib.from_parents(
            parents, tokens=tokens, valid=valid, logscore=logscore, max_depth=self.depth
        )


def with_depth_temperature(params: dict, temperature, *, budget: int | None = None) -> dict:
    """``params`` whose draft marginals at tree depth ``d + 1`` are
    ``softmax(logits / temperature[min(d, len - 1)])`` (one entry: one temperature for all).

    The best-first tree ranks nodes by the product of these marginals along their paths, so a
    head trained with hard targets until it is overconfident (a long run on a small corpus)
    spends the budget on its top-1 chain even where the alternatives are often right. A
    temperature keeps every argmax: the top-1 chain is unchanged, the rest of the tree moves.

    Args:
      params: the head's drafting params (:func:`make_params`).
      temperature: per-depth temperatures (a scalar or one entry: the same at every depth).
      budget: ``None``: the temperature of every tree size (any per-size entry is dropped).
        ``B``: the temperature of trees of at most ``B`` nodes only; the best temperature
        depends on the tree (a 3-node tree spends its nodes otherwise than an 8-node one),
        and :func:`depth_temperature_for` picks the entry of the smallest ``B`` that holds
        the drafter's tree.

    Raises:
      ValueError: a temperature that is not finite and positive, or ``budget < 1``.
    """
    temperature = checked_temperature(temperature)
    if budget is None:
        return {
            **{k: v for k, v in params.items() if k != "budget_temperature"},
            "depth_temperature": temperature,
        }
    if budget < 1:
        raise ValueError(f"budget must be >= 1, got {budget}")
    # Python int keys: a pytree's dict keys are static, so the drafter picks its entry when
    # it is traced (its budget is static too) and no lookup runs inside the compiled round.
    table = {**params.get("budget_temperature", {}), int(budget): temperature}
    return {**params, "budget_temperature": table}


def depth_temperature_for(params: dict, budget: int) -> Float[Array, " D"] | None:
    """The per-depth temperatures a tree of ``budget`` nodes drafts at: the entry of the
    smallest listed budget ``>= budget`` (:func:`with_depth_temperature`), else the temperature
    of every tree size, else ``None`` (the raw marginals)."""
    sizes = [b for b in params.get("budget_temperature", {}) if b >= budget]
    if sizes:
        return params["budget_temperature"][min(sizes)]
    return params.get("depth_temperature")


SHIPPED_NAME = "eagle3_smollm2"


def load_shipped_eagle3(
    teacher_params: dict | None = None, *, budget: int = 16, depth: int = 6, top_k: int = 4
) -> tuple[Eagle3Drafter, dict]:
    """The packaged head trained for SmolLM2-135M-Instruct: ``(drafter, params)``.

    Args:
      teacher_params: the teacher's parameters (for the frozen embedding); loaded when
        ``None``. The teacher weight file must be the one the head was trained on.
      budget, depth, top_k: tree shape of the returned drafter.

    Raises:
      ValueError: the installed teacher is not the one the head was trained for.
    """
    from eaglepangu_jax.drafters.shipped import load_packaged

    config, head, d2t, embed, meta = load_packaged(SHIPPED_NAME, "eagle3", teacher_params)
    drafter = Eagle3Drafter(config=config, budget=budget, depth=depth, top_k=top_k)
    params = make_params(head, embed, d2t)
    return drafter, with_calibration(params, meta.get("calibration", {}))


def with_calibration(params: dict, calibration: dict) -> dict:
    """``params`` with the draft temperatures an export's ``calibration`` stores:
    ``depth_temperature`` for every tree size, and under ``by_budget`` (``{"3":
    {"depth_temperature": [2.0], ...}}``) those of trees of at most that many nodes
    (``bench/draft_temperature.py --calibrate-from``)."""
    temperature = calibration.get("depth_temperature")
    if temperature is not None:
        params = with_depth_temperature(params, temperature)
    for budget, entry in calibration.get("by_budget", {}).items():
        try:
            size = int(budget)
            temperature = entry["depth_temperature"]
        except (ValueError, TypeError, KeyError) as err:
            raise ValueError(
                f"calibration.by_budget[{budget!r}]: needs an integer tree size and a "
                f"depth_temperature ({err!r})"
            ) from None
        params = with_depth_temperature(params, temperature, budget=size)
    return params
