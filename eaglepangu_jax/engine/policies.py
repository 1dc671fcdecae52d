"""Tree policies: turn a drafter's :class:`Proposal` into the tree the teacher verifies.

Every policy returns a tree with exactly ``budget + 1`` slots and ``max_depth = depth`` so the
verify forward has one static shape per configuration (padding slots fill the rest).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from eaglepangu_jax import budget as budget_lib
from eaglepangu_jax import scoring
from eaglepangu_jax import tree as tree_lib
from eaglepangu_jax.engine.config import SpecConfig
from eaglepangu_jax.engine.drafter import Proposal

__all__ = [
    "root_only",
    "fit",
    "controller_budget",
    "prune_by_controller",
    "build_tree",
    "static_tree",
]


def root_only(root_token: Int[Array, ""], num_slots: int, max_depth: int) -> tree_lib.Tree:
    """The root and ``num_slots - 1`` padding slots: one plain decoding step.

    Plain decoding uses ``num_slots = 1`` (a one-token forward, the cheapest step).
    """
    return tree_lib.from_parents(
        jnp.zeros((num_slots,), jnp.int32),
        tokens=jnp.zeros((num_slots,), jnp.int32).at[0].set(root_token),
        valid=jnp.zeros((num_slots,), bool).at[0].set(True),
        max_depth=max_depth,
    )


def fit(tree: tree_lib.Tree, spec: SpecConfig) -> tree_lib.Tree:
    """Pad or check a drafter's tree to ``budget + 1`` slots and ``depth``.

    Drafters are built for a configuration, so a mismatch is a programming error and raises.
    """
    if tree.num_slots != spec.budget + 1 or tree.max_depth != spec.depth:
        raise ValueError(
            f"drafter tree has {tree.num_slots} slots / depth {tree.max_depth}, the engine "
            f"expects budget + 1 = {spec.budget + 1} slots / depth {spec.depth}"
        )
    return tree


def controller_budget(
    candidate: tree_lib.Tree,
    verify_latency: Float[Array, " N"],
    t_draft: Float[Array, ""],
    t_other: Float[Array, ""],
) -> Int[Array, ""]:
    """BASTION's stop rule on a best-first tree whose slots are sorted by score."""
    return budget_lib.choose_budget(candidate.logscore[1:], verify_latency, t_draft, t_other)


def prune_by_controller(
    tree: tree_lib.Tree,
    verify_latency: Float[Array, " N"],
    t_draft: Float[Array, ""] | float = 0.0,
    t_other: Float[Array, ""] | float = 0.0,
) -> tree_lib.Tree:
    """BASTION's stop rule applied to a tree the drafter built itself (EAGLE-2-style heads).

    The drafter's nodes, sorted by path score, play the role of the best-first order: the
    controller picks how many of them pay for their verification, and
    :func:`eaglepangu_jax.tree.keep_best` keeps those (packed to the front, so the engine
    verifies a smaller slot bucket when the drafter is unsure).
    """
    scores = jnp.where(tree.valid[1:], tree.logscore[1:], -jnp.inf)
    scores = -jnp.sort(-jnp.where(jnp.isnan(scores), -jnp.inf, scores))
    n = budget_lib.choose_budget(scores, verify_latency, jnp.float32(t_draft), jnp.float32(t_other))
    return tree_lib.keep_best(tree, n)


def _need_latency(verify_latency: Float[Array, " N"] | None) -> Float[Array, " N"]:
    if verify_latency is None:
        raise ValueError("policy 'auto' needs the verify latency curve (a calibration)")
    return verify_latency


def build_tree(
    proposal: Proposal,
    root_token: Int[Array, ""],
    spec: SpecConfig,
    *,
    verify_latency: Float[Array, " N"] | None = None,
    t_draft: Float[Array, ""] | float = 0.0,
    t_other: Float[Array, ""] | float = 0.0,
) -> tuple[tree_lib.Tree, Int[Array, ""]]:
    """The round's tree and its node count (for traces).

    Args:
      proposal: the drafter's output (a tree or per-depth log-marginals).
      root_token: the last committed token (tree slot 0).
      spec: the run's configuration (policy, budget, depth, top_k).
      verify_latency: ``[budget + 1]`` predicted seconds to verify root + n nodes; required by
        the ``"auto"`` policy.
      t_draft, t_other: per-round seconds outside verification, for ``"auto"``.
    """
    if spec.policy == "drafter" or proposal.marginals is None:
        if proposal.tree is None:
            raise ValueError("the drafter proposed neither a tree nor marginals")
        tree = fit(proposal.tree, spec)
        if spec.policy == "auto":
            tree = prune_by_controller(tree, _need_latency(verify_latency), t_draft, t_other)
        return tree, jnp.sum(tree.valid[1:]).astype(jnp.int32)
    marginals = proposal.marginals[: spec.depth]
    if marginals.shape[0] < spec.depth:
        raise ValueError(
            f"drafter gives {marginals.shape[0]} depths, the engine asks for depth {spec.depth}"
        )
    if spec.policy == "best_first":
        tree = scoring.best_first(marginals, root_token, budget=spec.budget, top_k=spec.top_k)
        return tree, jnp.sum(tree.valid[1:]).astype(jnp.int32)
    if spec.policy == "auto":
        full = scoring.best_first(marginals, root_token, budget=spec.budget, top_k=spec.top_k)
        n = controller_budget(
            full, _need_latency(verify_latency), jnp.float32(t_draft), jnp.float32(t_other)
        )
        keep = jnp.arange(spec.budget + 1) <= n
        tree = tree_lib.from_parents(
            full.parents,
            tokens=full.tokens,
            valid=full.valid & keep,
            logscore=full.logscore,
            max_depth=spec.depth,
        )
        return tree, n
    if spec.policy == "static":
        tree = static_tree(marginals, root_token, spec)
        return tree, jnp.sum(tree.valid[1:]).astype(jnp.int32)
    raise ValueError(f"policy {spec.policy!r} needs a tree-proposing drafter")


def static_tree(
    marginals: Float[Array, "D V"], root_token: Int[Array, ""], spec: SpecConfig
) -> tree_lib.Tree:
    """The fixed ``spec.choices`` topology, each node taking the token of its rank at its
    depth under the factorised marginals (topology is host-side and static)."""
    topology, rank = tree_lib.from_choices(spec.choices, max_depth=spec.depth)
    n = topology.num_slots
    pad = spec.budget + 1 - n
    depth = jnp.pad(topology.depth, (0, pad), constant_values=1)
    rank = jnp.pad(rank, (0, pad))
    parents = jnp.pad(topology.parents, (0, pad))
    valid = jnp.pad(jnp.ones((n,), bool), (0, pad))
    k = int(max(max(c) for c in spec.choices)) + 1
    top_lp, top_tok = jax.lax.top_k(jnp.nan_to_num(marginals, nan=-jnp.inf), k)  # [D, k]
    row = jnp.clip(depth - 1, 0, spec.depth - 1)
    tokens = top_tok[row, rank].at[0].set(root_token)
    token_lp = top_lp[row, rank].at[0].set(0.0)
    return tree_lib.from_parents(
        parents,
        tokens=tokens,
        valid=valid,
        logscore=scoring.path_logscores(parents, token_lp),
        max_depth=spec.depth,
    )
