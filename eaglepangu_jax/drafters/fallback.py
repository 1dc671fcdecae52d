"""One drafter's tree when it has one, another's otherwise: retrieval first, a model after.

The n-gram drafter costs almost nothing and, when the context repeats, proposes long paths
that the teacher accepts; on new text it finds no match in about half of the rounds, and those
rounds are plain steps. A trained head (EAGLE-3 at one node a round) guesses in every round but
one token at a time. Per turn of the 240 evaluation turns (session 41's run) the better of the
two averaged 1.83x where either alone gave 1.64x (n-gram) and 1.43x (EAGLE-3), and the head
was the better one on 59% of the turns: they pay on different text.

:class:`FallbackDrafter` takes the first drafter's tree in every round where it holds a node,
and the second's in the others. Where the first tree has padding slots left, the second
drafter's root children also go there (``graft``; :func:`~eaglepangu_jax.tree.
add_root_children`, which skips a token the tree already has at depth 1), so a round whose
retrieved paths are wrong from their first token can still accept the head's guess.

Both proposals are made every round and combined by ``where``: the second drafter's proposal
at one node is the top-1 of the hidden state its update already computed, so skipping it
would save nothing, and its state must follow every accepted token anyway (:meth:`update`
feeds both drafters). The second tree is widened to the first's slots and depth
(:func:`~eaglepangu_jax.tree.widen`), so the engine sees one tree shape. Node scores are each
drafter's own; under the controller the online calibration of
:mod:`eaglepangu_jax.draft_control` corrects them in the same probability bins.

**Under the controller the pair proposes every round** (``proposes_every_round``), as a free
drafter does, and the node budget decides on each proposal what is verified. The gate
before drafting would decide from averages over all speculative rounds, which mix the n-gram
drafter's long trees with the head's single nodes and describe neither: gated, the pair
drafted in 32% of the dev suite's rounds and ran 1.53x against n-gram's 1.57x alone (one
run, session 42). The price is the head's update in every round (about 11% of a plain step
on 2 CPU cores), which EAGLE-3 alone pays in all but a few rounds here anyway.

Both drafters must propose ready trees (no marginals) with deterministic children (no
``draft_probs``): a sampled tree's acceptance rule needs the distribution its children were
drawn from, which one drafter's draws do not share with the other's.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array

from eaglepangu_jax import tree as tree_lib
from eaglepangu_jax.engine.drafter import DraftContext, Proposal

__all__ = ["FallbackDrafter"]


@dataclasses.dataclass(frozen=True)
class FallbackDrafter:
    """``primary``'s tree when it has a node, else ``fallback``'s (see the module docstring).

    Attributes:
      primary: the drafter tried first (its ``budget`` and depth set the tree's shape).
      fallback: the drafter whose tree is used in rounds where ``primary``'s is empty; its
        trees hold no more nodes and are no deeper than ``primary``'s.
      graft: also add ``fallback``'s root children to ``primary``'s tree, in its free slots.
      proposes_every_round: the controller lets the pair propose in every round (see the
        module docstring and :func:`~eaglepangu_jax.engine.drafter.proposes_every_round`);
        False gates it like any costly drafter.

    Params are ``{"primary": ..., "fallback": ...}``, the state the pair of their states.
    """

    primary: Any
    fallback: Any
    graft: bool = True
    proposes_every_round: bool = True

    def __post_init__(self):
        for role in ("primary", "fallback"):
            drafter = getattr(self, role)
            if getattr(drafter, "budget", None) is None:
                raise ValueError(
                    f"the {role} drafter ({type(drafter).__name__}) has no node budget: a pair "
                    "combines drafters that propose ready trees of at most budget nodes"
                )
        if self.fallback.budget > self.primary.budget:
            raise ValueError(
                f"the fallback drafter's budget {self.fallback.budget} is above the primary's "
                f"{self.primary.budget}: its trees would not fit the primary's slots"
            )
        if self.fallback.max_depth > self.primary.max_depth:
            raise ValueError(
                f"the fallback drafter's depth {self.fallback.max_depth} is above the "
                f"primary's {self.primary.max_depth}"
            )
        first, second = self.primary.feature_layers, self.fallback.feature_layers
        if first and second and tuple(first) != tuple(second):
            raise ValueError(
                f"the two drafters read different teacher layers ({tuple(first)} and "
                f"{tuple(second)}); the engine hands one set of features to a drafter"
            )

    @property
    def name(self) -> str:
        return f"{self.primary.name}-{self.fallback.name}"

    @property
    def budget(self) -> int:
        """Tree nodes, root excluded: the primary's."""
        return self.primary.budget

    @property
    def max_depth(self) -> int:
        return self.primary.max_depth

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return tuple(self.primary.feature_layers or self.fallback.feature_layers)

    @property
    def cost_revision(self) -> int:
        """The parts' cost revisions added up: when either part drafts the same tree at a new
        cost, the pair's calibrated cost is measured again
        (:func:`eaglepangu_jax.calibration.curve.draft_cost_key`)."""
        return sum(getattr(d, "cost_revision", 0) for d in (self.primary, self.fallback))

    def configured(self, *, budget: int, depth: int, configure) -> "FallbackDrafter":
        """The pair at a run's ``budget`` and ``depth``: the primary takes both, the fallback
        keeps its own tree where that is smaller (``configure`` sets one drafter's)."""
        return dataclasses.replace(
            self,
            primary=configure(self.primary, budget=budget, depth=depth),
            fallback=configure(
                self.fallback,
                budget=min(self.fallback.budget, budget),
                depth=min(self.fallback.max_depth, depth),
            ),
        )

    def init_state(self, params: Any, context: DraftContext) -> tuple[Any, Any]:
        return (
            self.primary.init_state(params["primary"], context),
            self.fallback.init_state(params["fallback"], context),
        )

    def update(self, params: Any, state: tuple[Any, Any], context: DraftContext) -> tuple:
        """Both drafters follow every accepted token, whichever tree was verified."""
        return (
            self.primary.update(params["primary"], state[0], context),
            self.fallback.update(params["fallback"], state[1], context),
        )

    def propose(
        self, params: Any, state: tuple[Any, Any], context: DraftContext, key: Array
    ) -> Proposal:
        first_key, second_key = jax.random.split(key)
        first = self.primary.propose(params["primary"], state[0], context, first_key)
        second = self.fallback.propose(params["fallback"], state[1], context, second_key)
        for role, proposal in (("primary", first), ("fallback", second)):
            if proposal.tree is None or proposal.draft_probs is not None:
                raise ValueError(
                    f"the {role} drafter ({type(getattr(self, role)).__name__}) must propose a "
                    "ready tree with deterministic children to be combined"
                )
        own = first.tree
        other = tree_lib.widen(second.tree, own.num_slots, own.max_depth)
        if self.graft:
            children = other.valid & (other.depth == 1)
            own = tree_lib.add_root_children(own, other.tokens, other.logscore, children)
        has_node = jnp.any(first.tree.valid[1:])
        return Proposal(tree=jax.tree.map(lambda a, b: jnp.where(has_node, a, b), own, other))
