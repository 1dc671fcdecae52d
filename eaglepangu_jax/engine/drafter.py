"""The drafter protocol: what the engine asks of a drafter, and what it gives it.

A drafter is a small frozen (hashable) dataclass: its hyper-parameters are static, its weights
and per-sequence state are pytrees passed explicitly, so the whole speculative step jits into one
function. Each round the engine calls :meth:`Drafter.propose` with a :class:`DraftContext` and
receives a :class:`Proposal`: a ready tree (auto-regressive or retrieval drafters) or per-depth
marginals ``[D, V]`` (block drafters) that a tree policy turns into a tree. After verification
the engine calls :meth:`Drafter.update` with what was accepted, including the teacher's features
at the accepted positions (EAGLE-style heads condition on them).

Dimensions: ``C`` token-buffer capacity, ``D`` drafter depth, ``N`` tree slots, ``V`` vocab,
``F`` tapped teacher layers, ``H`` hidden size.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from eaglepangu_jax.engine.config import SpecConfig
from eaglepangu_jax.tree import Tree

__all__ = [
    "DraftContext",
    "Proposal",
    "Drafter",
    "StatelessDrafter",
    "FeatureHeadDrafter",
    "max_nodes_of",
    "proposes_every_round",
    "costliest",
    "fit_budget",
    "fit_curve",
]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DraftContext:
    """What a drafter may look at when proposing (all committed, nothing speculative)."""

    tokens: Int[Array, " C"]  # [C] prompt + emitted tokens; tokens[num_tokens - 1] is the root
    num_tokens: Int[Array, ""]  # valid entries of ``tokens`` (root included)
    # Teacher features of the tokens accepted in the last round, oldest first: row r belongs to
    # position num_tokens - 1 - num_features + r. The root has none yet (it was never fed).
    features: Float[Array, "A F H"]
    num_features: Int[Array, ""]  # valid rows of ``features``
    # First visible token: drafters must ignore tokens[:start] (the draft-window ablation
    # hides old context this way; hiding by overwriting ids would need a sentinel id, and a
    # negative sentinel is exactly what wraps on accelerators).
    start: Int[Array, ""] = dataclasses.field(default_factory=lambda: jnp.zeros((), jnp.int32))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Proposal:
    """A drafter's output for one round: exactly one of ``tree`` / ``marginals`` is used.

    ``draft_probs`` is set only when children were *sampled* from the drafter (row u = the
    distribution u's children were drawn from); acceptance then uses the multi-step
    speculative-sampling rule, otherwise the deterministic-children rule.
    """

    tree: Tree | None = None
    marginals: Float[Array, "D V"] | None = None  # log-probabilities per depth
    draft_probs: Float[Array, "N V"] | None = None


class Drafter(Protocol):
    """Interface every drafter implements (frozen dataclass; hashable)."""

    name: str

    @property
    def max_depth(self) -> int:
        """Deepest tree it can propose."""

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """Teacher layers whose hidden states it consumes (empty if none)."""

    # Optional: ``max_nodes``, the most nodes (root excluded) any of its trees can hold, for
    # drafters whose proposals cannot fill an arbitrary budget (``top_k`` chains of ``depth``
    # hold ``depth * top_k``). Such a drafter's tree has ``max_nodes + 1`` slots and the engine
    # verifies no more (:func:`fit_budget`). Drafters without it fill the run's budget.
    #
    # Optional: ``proposes_every_round``, True when the controller must let it propose in
    # every round and decide on the proposal, as for a drafter that drafts for free
    # (:func:`proposes_every_round`).
    #
    # Optional: ``early_stop``, a bool field: True when the drafter's cost varies from round
    # to round because it stops growing a tree whose deeper levels could not change it
    # (EAGLE-3). Calibration times it with the field False (:func:`costliest`).

    def init_state(self, params: Any, context: DraftContext) -> Any:
        """Per-sequence state after the prompt was prefilled."""

    def propose(self, params: Any, state: Any, context: DraftContext, key: Array) -> Proposal:
        """Draft continuations of ``context``; the tree's root is its last token (the root)."""

    def update(self, params: Any, state: Any, context: DraftContext) -> Any:
        """New state after a round; ``context`` already holds the newly accepted tokens."""


class StatelessDrafter:
    """Defaults for drafters that keep no per-sequence state and read no teacher features.

    Subclass it from a frozen dataclass with a ``depth`` field and write only ``propose``.
    """

    feature_layers: tuple[int, ...] = ()

    @property
    def max_depth(self) -> int:
        return self.depth  # type: ignore[attr-defined]

    def init_state(self, params: Any, context: DraftContext) -> None:
        return None

    def update(self, params: Any, state: Any, context: DraftContext) -> Any:
        return state


class FeatureHeadDrafter:
    """Defaults for trained heads conditioned on teacher features: a ``config`` with
    ``feature_layers`` and a ``depth`` field (EAGLE-3, block drafters)."""

    @property
    def max_depth(self) -> int:
        return self.depth  # type: ignore[attr-defined]

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return self.config.feature_layers  # type: ignore[attr-defined]


def max_nodes_of(drafter: Any) -> int | None:
    """The drafter's ``max_nodes`` (see :class:`Drafter`), ``None`` when it fills any budget."""
    return None if drafter is None else getattr(drafter, "max_nodes", None)


def proposes_every_round(drafter: Any) -> bool:
    """Whether the controller treats ``drafter`` as a free one whatever its drafting costs:
    it proposes in every round, and the node budget decides on the proposal what is verified
    (an empty or unpaying proposal verifies nothing). For a drafter whose rounds differ in
    kind, such as :class:`~eaglepangu_jax.drafters.fallback.FallbackDrafter` (the n-gram
    drafter's long trees in some rounds, a head's single node in the others): the gate before
    drafting decides from averages over all rounds, which describe neither kind. False for
    ``None`` and for drafters without the attribute."""
    return bool(getattr(drafter, "proposes_every_round", False))


def costliest(drafter: Any) -> Any:
    """``drafter`` as it drafts at its highest cost: one that stops growing its trees early
    (an ``early_stop`` field, see :class:`Drafter`) with every level grown, others as they
    are. Calibration times this one: how many levels a round grows depends on the text, and
    the calibrating prompt is not text. The controller's drafting cost is then an upper
    bound, which the online cost correction (:mod:`eaglepangu_jax.engine.costs`) brings down
    from the rounds it observes."""
    if getattr(drafter, "early_stop", False):
        return dataclasses.replace(drafter, early_stop=False)
    return drafter


def fit_budget(spec: SpecConfig, drafter: Any) -> SpecConfig:
    """``spec`` with its budget lowered to the nodes ``drafter``'s trees can hold.

    A larger budget only pads the tree, and the verify forward runs on the smallest slot
    bucket of ``budget + 1`` that holds the nodes: one chain of 4 under a budget of 8 was
    verified at 9 slots instead of 5 (on this project's 2-core CPU a 9-slot forward costs
    about 1.2x a 5-slot one). Tokens do not change: the padding was never valid. Every
    engine entry point applies it, so a drafter built by hand gets it too."""
    limit = max_nodes_of(drafter)
    if limit is None or spec.budget <= limit:
        return spec
    return dataclasses.replace(spec, budget=limit)


def fit_curve(verify_latency: Any, spec: SpecConfig) -> Any:
    """A ``[M]`` verify-latency curve cut to its ``[spec.budget + 1]`` first entries (entry
    ``n`` verifies the root plus ``n`` nodes): a curve made for the budget that
    :func:`fit_budget` lowered serves the fitted one. ``None`` stays ``None``; a shorter
    curve is left for the controller to refuse."""
    if verify_latency is None:
        return None
    return verify_latency[: spec.budget + 1]
