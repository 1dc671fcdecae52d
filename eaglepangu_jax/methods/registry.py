"""Decoding methods by name: greedy, the drafters, and peer implementations.

A :class:`Method` is what the benchmark, the calibration and the experiments run: a drafter
for the JAX engine with its :class:`~eaglepangu_jax.engine.config.SpecConfig`, or a peer
runner that decodes outside the engine (transformers, for side-by-side figures). The names
come from the drafter registry (:mod:`eaglepangu_jax.drafters.registry`) plus ``greedy``
and the peers, listed once here.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Protocol, Sequence

from eaglepangu_jax.budget import NOMINAL_BANDWIDTH, NOMINAL_PEAK_FLOPS
from eaglepangu_jax.drafters import draft_target
from eaglepangu_jax.drafters.fallback import FallbackDrafter
from eaglepangu_jax.drafters.registry import (
    MARGINAL,
    DrafterUnavailableError,
    configure_drafter,
    load_shipped,
    make_drafter,
)
from eaglepangu_jax.drafters.registry import (
    NAMES as DRAFTER_NAMES,
)
from eaglepangu_jax.engine.config import SpecConfig
from eaglepangu_jax.engine.costs import CostCorrection
from eaglepangu_jax.engine.decode import GenerationResult
from eaglepangu_jax.engine.drafter import fit_budget
from eaglepangu_jax.methods import peers

__all__ = [
    "REFERENCE",
    "PEER_METHODS",
    "METHODS",
    "DEFAULT_BUDGET",
    "DRAFTER_BUDGETS",
    "MACHINE_SIZED",
    "DEFAULT_DEPTH",
    "CPU_PEAK_FLOPS",
    "CPU_BANDWIDTH",
    "DrafterUnavailableError",
    "PeerRunner",
    "Method",
    "parse_methods",
    "engine_drafters",
    "split_method",
    "load_eagle3",
    "load_block",
    "DRAFT_TARGET",
    "DRAFT_DISTILLED",
    "HEAD_PAIRS",
    "load_truncated_draft",
    "make_method",
    "with_machine_budget",
]

REFERENCE = "greedy"
DRAFT_TARGET = "draft-target"  # built on the real teacher, truncated (load_truncated_draft)
DRAFT_DISTILLED = "draft-distilled"  # the shipped distilled draft model, same drafter
# Retrieval first, the EAGLE-3 head's node beside or instead (drafters.fallback): method ->
# the retrieval drafter. ngram-corpus with the head was slower than ngram-corpus alone (dev
# suite 1.60x vs 1.70x, session 42: its table proposes in almost every round, so the head's
# update is paid for little), so only n-gram has a pair.
HEAD_PAIRS = {"ngram-eagle3": "ngram"}
# Peers: other implementations decoding the same GGUF file, run beside ours; the value is the
# prompt-lookup candidate count (None: plain greedy).
PEER_METHODS = {"transformers-greedy": None, "transformers-pld": peers.PROMPT_LOOKUP_TOKENS}
METHODS = (REFERENCE, *DRAFTER_NAMES, *PEER_METHODS)
DEFAULT_BUDGET = 8  # tree nodes; the seeds' M = 16 verifies too slowly on 2 CPU cores
DEFAULT_DEPTH = 6  # deepest draft node
# Tree nodes a drafter runs at when the run's budget is a default the user did not choose
# (``make_method(..., default_budget=True)``); drafters not named take DEFAULT_BUDGET. The
# shipped EAGLE-3 head pays most with one node a round on 2 CPU cores: it then runs no head
# forward beyond the update (the root's children come from the state the update leaves,
# `Eagle3Drafter.tree_levels`), and a lone drafted token is verified at the 2-slot bucket,
# about the price of a plain step (docs/RESULTS.md, "EAGLE-3 drafts one node"). The block
# head drafts every depth in one forward whatever the budget, but on these cores its deeper
# guesses do not pay for the wider verify either: one node 1.21x against 8 nodes 1.13x on
# the dev suite under the controller (docs/RESULTS.md, "The block drafter drafts one node").
# The distilled draft model drafts a chain token by token, so one node is one draft forward
# instead of four: 1.09x against 1.00x at its four-node chain on the dev suite
# (docs/RESULTS.md, "The distilled draft drafts one node"). Draft-target (the teacher cut
# to 28 layers, an ablation) and MTP (one token by construction) keep theirs.
DRAFTER_BUDGETS = {"eagle3": 1, "block": 1, "draft-distilled": 1}
# Drafters whose DRAFTER_BUDGETS entry is a floor that the machine may raise
# (:mod:`eaglepangu_jax.calibration.sizing`): where a verify of a few more slots costs what
# the floor's does, the extra nodes are verified for nothing, and these drafters draft them
# for little (the block head: one forward whatever the budget; the EAGLE-3 head: one more
# head step per level). On 2 cores of an AMD EPYC, two and four slots cost the same (37 ms
# against 28 ms for one) and three nodes paid more than one (240 turns side by side: EAGLE-3
# 1.23x vs 1.12x, block 1.18x vs 1.08x; docs/RESULTS.md); on the Intel Xeon four slots cost
# 1.4x two with XLA's products (one node stayed) and 1.13x with the few-row kernel: three
# nodes are chosen there and ran like one (dev suite 1.31x and 1.30x, session 52; session
# 51's 1.11x at three nodes was the controller locked out by a disturbed turn). The
# distilled draft is not here: each node is one more forward of the draft model, about half
# a plain step.
MACHINE_SIZED = ("eagle3", "block")
CPU_PEAK_FLOPS = NOMINAL_PEAK_FLOPS  # the uncalibrated roofline's machine (see budget)
CPU_BANDWIDTH = NOMINAL_BANDWIDTH


class PeerRunner(Protocol):
    """Runs a method outside the JAX engine (see :mod:`eaglepangu_jax.methods.peers`)."""

    def __call__(
        self, prompt_ids: Sequence[int], spec: SpecConfig, *, eos_id: int
    ) -> GenerationResult:
        """Generate for ``prompt_ids``, counted like :func:`generate`: the generated ids, one
        round per teacher forward, decode seconds apart from the prefill."""

    def describe(self) -> dict[str, Any]:
        """The runner's settings in effect (JSON-ready), for the report."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Method:
    """One decoding method and its run settings: a drafter for the JAX engine (``None`` for
    greedy), or a ``runner`` that decodes instead of the engine (a peer implementation)."""

    name: str
    spec: SpecConfig
    drafter: Any = None
    draft_params: Any = None
    runner: PeerRunner | None = None
    # Under "auto", the latency-curve correction learned from this method's own runs (host
    # state shared by every turn it generates; see engine.costs).
    correction: CostCorrection | None = dataclasses.field(default=None, compare=False)
    # Set while the budget (and the depth, no deeper) are this drafter's defaults, which the
    # machine may raise (MACHINE_SIZED, with_machine_budget): the depth it runs at when the
    # budget allows. None once a user chose either, and once the machine has (so sizing
    # twice changes nothing).
    sizable_depth: int | None = None

    @property
    def machine_sized(self) -> bool:
        """Whether the machine may still raise this method's budget (:data:`MACHINE_SIZED`)."""
        return self.sizable_depth is not None

    def __post_init__(self):
        if self.correction is None and self.drafter is not None and self.spec.policy == "auto":
            object.__setattr__(self, "correction", CostCorrection())


def split_method(entry: str) -> tuple[str, int | None]:
    """``"eagle3:4"`` -> ``("eagle3", 4)``: a method entry is a name, or a drafter's name and
    the tree depth to run it at (``None``: the depth the run's settings give it). This is how
    one run compares depths of one drafter side by side.

    Raises:
      ValueError: an unknown name, a depth that is not a positive integer, or a depth given to
        a method without one (greedy, the peers, MTP: it drafts one token).
    """
    name, colon, depth_text = entry.partition(":")
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; known methods: {', '.join(METHODS)}")
    if not colon:
        return name, None
    if name in (REFERENCE, "mtp", *PEER_METHODS):
        raise ValueError(f"{entry!r}: {name} has no tree depth to set")
    if not depth_text.isdigit() or int(depth_text) < 1:
        raise ValueError(f"{entry!r}: the depth after ':' must be a positive integer")
    return name, int(depth_text)


def parse_methods(text: str | Sequence[str]) -> tuple[str, ...]:
    """Method entries from ``"greedy,ngram,eagle3:4"``, greedy first (added if missing); an
    entry ``NAME:D`` runs NAME at tree depth D (see :func:`split_method`).

    Raises:
      ValueError: an unknown or repeated entry, a bad depth, or an empty list.
    """
    names = [n.strip() for n in text.split(",")] if isinstance(text, str) else list(text)
    names = [n for n in names if n]
    if not names:
        raise ValueError(f"no methods given; known methods: {', '.join(METHODS)}")
    for n in names:
        split_method(n)
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"method(s) {repeated} given more than once")
    return (REFERENCE,) + tuple(n for n in names if n != REFERENCE)


def engine_drafters(text: str | Sequence[str]) -> tuple[str, ...]:
    """The drafting entries of a method list, greedy left out, for scripts that run each
    drafter in the engine beside greedy (e.g. in two variants).

    Raises:
      ValueError: what :func:`parse_methods` refuses, a list with no drafter, or a peer
        method (it decodes outside the engine).
    """
    names = tuple(n for n in parse_methods(text) if n != REFERENCE)
    if not names:
        raise ValueError(f"the methods name no drafter: {text!r}")
    peers = [n for n in names if split_method(n)[0] in PEER_METHODS]
    if peers:
        raise ValueError(f"{', '.join(peers)} does not run in the engine")
    return names


def load_eagle3() -> tuple[Any, Any]:
    """The shipped EAGLE-3 drafter and its weights (see :func:`load_shipped`)."""
    return load_shipped("eagle3")


def load_block(*, budget: int = DEFAULT_BUDGET) -> tuple[Any, Any]:
    """The shipped block drafter at its trained depth, and its weights (see
    :func:`load_shipped`)."""
    return load_shipped("block", budget=budget)


@functools.cache
def _truncated_teacher_draft() -> tuple[Any, Any]:
    """Read once per process: every grid cell shares the truncated weights."""
    try:
        return draft_target.load_draft_target()
    except (ImportError, OSError, ValueError, KeyError) as err:
        raise DrafterUnavailableError(
            f"the draft-target drafter's teacher could not be loaded: {err}"
        ) from err


def load_truncated_draft(
    spec: SpecConfig, *, top_k: int | None = None, tree_shape: str | None = None
) -> tuple[Any, Any]:
    """The draft-target drafter on the real teacher truncated to
    :data:`~eaglepangu_jax.drafters.draft_target.DEFAULT_LAYERS` layers, and its weights,
    set up for ``spec``: its budget and depth, and when ``spec`` samples its temperature and
    top-p (the drafter cannot read the engine's traced values; any is lossless, the run's
    accepts most); ``top_k`` root children and ``tree_shape`` when given (else its
    defaults)."""
    drafter, params = _truncated_teacher_draft()
    return _draft_target_for(drafter, spec, top_k, tree_shape), params


def _draft_target_for(
    drafter: Any, spec: SpecConfig, top_k: int | None, tree_shape: str | None = None
) -> Any:
    """A draft-target drafter set up for ``spec`` (see :func:`load_truncated_draft`)."""
    changes: dict[str, Any] = dict(budget=spec.budget, depth=spec.depth)
    if spec.sampling:
        changes.update(temperature=spec.temperature, top_p=spec.top_p)
    if top_k is not None:
        changes.update(top_k=top_k)
    if tree_shape is not None:
        changes.update(tree_shape=tree_shape)
    return dataclasses.replace(drafter, **changes)


def make_method(
    name: str,
    spec: SpecConfig,
    *,
    default_depth: bool = False,
    default_budget: bool = False,
    eagle3_loader: Callable[[], tuple[Any, Any]] | None = None,
    torch_threads: int | None = None,
    draft_top_k: int | None = None,
    draft_tree: str | None = None,
) -> Method:
    """Build a benchmark method; ``spec``'s budget and depth configure the drafter.

    Args:
      name: one of :data:`METHODS`, or ``NAME:D`` (:func:`split_method`): NAME at tree depth
        D, whatever ``spec.depth`` and ``default_depth`` say; the method keeps the whole entry
        as its name, so two depths of one drafter are told apart in a report.
      spec: the run settings. The block drafter proposes marginals, not a tree: under the
        default ``"drafter"`` policy it runs ``"auto"`` (best-first, roofline-sized trees).
      default_depth: ``spec.depth`` is a default the user did not choose: a shipped drafter
        keeps the depth it comes with (EAGLE-3's head was trained for its own; the
        draft-target drafter its measured default), and a drafter
        whose maximum is lower lowers it, instead of failing.
      default_budget: ``spec.budget`` is a default the user did not choose: a drafter named
        in :data:`DRAFTER_BUDGETS` runs at its own budget instead (the tree size it pays most
        at on the machines measured), the others at ``spec.budget``. With ``default_depth``
        too, such a drafter also runs no deeper than that budget: a tree of ``N`` nodes holds
        no node deeper than ``N`` (a node enters only with its parent), so the trees are the
        same and the rounds cheaper (fewer feature rows in the drafter's update, fewer
        marginals to shape).
      eagle3_loader: returns the EAGLE-3 ``(drafter, params)`` (default: :func:`load_eagle3`).
      torch_threads: torch's threads for the transformers peers (``None``: torch's default;
        see :class:`~eaglepangu_jax.methods.peers.TransformersPeer`).
      draft_top_k: the draft-target drafters' root children (``top_k`` chains sharing the
        budget; ``None``: each draft's default). Other methods have no such setting and
        ignore it, so one value can serve a whole method list.
      draft_tree: the draft-target drafters' tree shape, ``"chains"`` or ``"beam"``
        (:class:`~eaglepangu_jax.drafters.draft_target.DraftTargetDrafter`; ``None``: chains);
        ignored by the other methods, like ``draft_top_k``.

    Raises:
      ValueError: unknown name, a depth above the drafter's maximum, ``draft_top_k < 1`` or
        an unknown ``draft_tree``.
      DrafterUnavailableError: a shipped drafter was asked for and cannot be loaded, or a peer
        whose packages are not installed.
    """
    if draft_top_k is not None and draft_top_k < 1:
        raise ValueError(f"draft_top_k must be >= 1, got {draft_top_k}")
    if draft_tree is not None and draft_tree not in draft_target.TREE_SHAPES:
        raise ValueError(
            f"draft_tree must be one of {draft_target.TREE_SHAPES}, got {draft_tree!r}"
        )
    entry = name
    name, depth = split_method(entry)
    if default_budget and name in DRAFTER_BUDGETS:
        spec = dataclasses.replace(spec, budget=DRAFTER_BUDGETS[name])
    if depth is not None:
        spec, default_depth = dataclasses.replace(spec, depth=depth), False
    method = _make_method(
        name, spec, default_depth, eagle3_loader, torch_threads, draft_top_k, draft_tree
    )
    if default_depth and default_budget and name in DRAFTER_BUDGETS:
        full_depth = method.spec.depth
        method = _no_deeper_than_budget(method)
        if name in MACHINE_SIZED:
            method = dataclasses.replace(method, sizable_depth=full_depth)
    return method if entry == name else dataclasses.replace(method, name=entry)


def with_machine_budget(method: Method, budget: int) -> Method:
    """``method`` at ``budget`` nodes a round and no deeper (nor deeper than the drafter's own
    default depth), as :func:`make_method` would have built it had ``budget`` been the
    drafter's default.
    The machine's choice (:func:`eaglepangu_jax.calibration.sizing.machine_budget`).

    Raises:
      ValueError: ``method`` is not ``machine_sized`` (its budget or depth was chosen by a
        user, or the drafter is not in :data:`MACHINE_SIZED`), or ``budget < 1``.
    """
    if not method.machine_sized:
        raise ValueError(f"method {method.name!r} is not sized by the machine")
    if budget < 1:
        raise ValueError(f"budget must be >= 1, got {budget}")
    if budget == method.spec.budget:
        return dataclasses.replace(method, sizable_depth=None)
    depth = min(budget, method.sizable_depth)
    drafter = configure_drafter(method.drafter, budget=budget, depth=depth)
    spec = fit_budget(dataclasses.replace(method.spec, budget=budget, depth=depth), drafter)
    # correction=None: the resized method learns its own cost correction (__post_init__).
    return dataclasses.replace(
        method, spec=spec, drafter=drafter, correction=None, sizable_depth=None
    )


def _no_deeper_than_budget(method: Method) -> Method:
    """``method`` with its tree depth lowered to its budget (see :func:`make_method`,
    ``default_budget``). Measured on the shipped drafters at one node (calibration timer,
    2 CPU cores): a drafting round 3.7 -> 3.4 ms for EAGLE-3 (7 feature rows -> 2), 4.8 ->
    3.9 ms for the block drafter (8 marginals -> 1)."""
    spec = method.spec
    if spec.depth <= spec.budget:
        return method
    spec = dataclasses.replace(spec, depth=spec.budget)
    drafter = configure_drafter(method.drafter, budget=spec.budget, depth=spec.depth)
    return dataclasses.replace(method, spec=spec, drafter=drafter)


def _make_method(
    name: str,
    spec: SpecConfig,
    default_depth: bool,
    eagle3_loader: Callable[[], tuple[Any, Any]] | None,
    torch_threads: int | None,
    draft_top_k: int | None,
    draft_tree: str | None,
) -> Method:
    if name == REFERENCE:
        return Method(name=name, spec=spec)
    if name in PEER_METHODS:
        return _peer_method(name, spec, torch_threads)
    if name == "ngram":
        drafter, params = make_drafter("ngram", depth=spec.depth, budget=spec.budget), None
    elif name == "ngram-corpus":
        drafter, params = load_shipped(name, depth=spec.depth, budget=spec.budget)
    elif name in HEAD_PAIRS:
        # The retrieval tree at the run's budget and depth; the head adds the tree it pays
        # most at when alone (one node).
        retrieval = _make_method(
            HEAD_PAIRS[name], spec, default_depth, None, torch_threads, None, None
        )
        head, head_params = (eagle3_loader or load_eagle3)()
        own = DRAFTER_BUDGETS["eagle3"]
        drafter = FallbackDrafter(
            primary=retrieval.drafter, fallback=configure_drafter(head, budget=own, depth=own)
        )
        params = {"primary": retrieval.draft_params, "fallback": head_params}
    elif name == "mtp":  # one drafted token per round, whatever the spec's tree settings
        drafter, params = load_shipped("mtp")
        spec = dataclasses.replace(spec, budget=1, depth=1)
    elif name in ("eagle3", "block"):
        if name == "eagle3":
            drafter, params = (eagle3_loader or load_eagle3)()
        else:
            drafter, params = load_block(budget=spec.budget)
        if name in MARGINAL and spec.policy == "drafter":
            spec = dataclasses.replace(spec, policy="auto")
        if default_depth:
            spec = dataclasses.replace(spec, depth=drafter.max_depth)
        drafter = configure_drafter(drafter, budget=spec.budget, depth=spec.depth)
    elif name == DRAFT_TARGET:
        if default_depth:
            spec = dataclasses.replace(spec, depth=draft_target.DEFAULT_DEPTH)
        drafter, params = load_truncated_draft(spec, top_k=draft_top_k, tree_shape=draft_tree)
    elif name == DRAFT_DISTILLED:
        drafter, params = load_shipped(name)
        if default_depth:
            spec = dataclasses.replace(spec, depth=drafter.depth)
        drafter = _draft_target_for(drafter, spec, draft_top_k, draft_tree)
    else:  # split_method refused every other name
        raise AssertionError(name)
    if spec.depth > drafter.max_depth:
        if not default_depth:
            raise ValueError(
                f"depth {spec.depth} is above the {name} drafter's maximum {drafter.max_depth}"
            )
        spec = dataclasses.replace(spec, depth=drafter.max_depth)
        drafter = configure_drafter(drafter, budget=spec.budget, depth=spec.depth)
    # The engine verifies no more nodes than the drafter's trees hold; the method's spec
    # records the budget that really runs.
    return Method(name=name, spec=fit_budget(spec, drafter), drafter=drafter, draft_params=params)


def _peer_method(name: str, spec: SpecConfig, torch_threads: int | None) -> Method:
    try:
        peers.check_reference_stack()
    except peers.ReferenceStackMissingError as err:
        raise DrafterUnavailableError(f"{name}: {err}") from None
    if spec.sampling:
        raise ValueError(f"{name} decodes greedily; it cannot run a sampling spec")
    runner = peers.TransformersPeer(prompt_lookup=PEER_METHODS[name], torch_threads=torch_threads)
    return Method(name=name, spec=spec, runner=runner)
