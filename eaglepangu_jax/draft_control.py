"""Whether to draft at all, and how many nodes to verify, from acceptance learned online.

Drafters' path scores (``tree.logscore``, log of the predicted probability that a node is
accepted) are often badly calibrated, and some drafters never pay on some text. This module
keeps, in the decode state, an immutable :class:`AcceptanceStats` pytree updated after every
round (:func:`update`, pure and jittable):

* **Calibration bins.** Predicted probabilities ``p = exp(logscore)`` fall into ``B`` uniform
  bins of ``[0, 1]``; each bin keeps decayed counts of verified nodes (``trials``) and of
  accepted ones (``hits``). Every speculative round first multiplies all counts by ``decay``
  and then adds its own, so old text is forgotten geometrically (half-life
  ``log 0.5 / log decay`` rounds). :func:`calibrated_logscores` blends a bin's hit rate with
  the prediction: ``p_hat = (hits[b] + s p) / (trials[b] + s)``, ``s = prior_strength``.
* **Pre-draft decision.** EMAs of accepted tokens and of verified nodes per speculative round
  feed :func:`speculation_pays`. They start at optimistic values that count as
  ``prior_rounds`` observed rounds: until the EMA weight takes over, each round is averaged
  in with weight ``1 / (observed + 1 + prior_rounds)``, so one round that accepts nothing
  already halves the optimism (with a plain EMA of weight 0.1, every generation began with
  up to 13 such rounds, each paying for a draft and a multi-token verify).
  :func:`should_draft` adds an exploration probe after ``backoff`` rounds without drafting.
  A probe that does not pay (fewer accepted tokens than a plain step would have emitted in
  its time) doubles ``backoff`` (up to ``max_backoff``); any speculative round that pays
  resets it to ``min_backoff``. So a drafter that never pays
  speculates in about ``1 / max_backoff`` of the rounds, while one that starts paying
  (repetitive text) is retried within ``max_backoff + 1`` rounds.
* **The cheapest speculative round.** The averages above describe the rounds as the node
  budget shaped them; a drafter of several nodes a round whose average round does not pay
  may still pay with one node (verifying two slots costs little more than a plain step, four
  may cost much more). So a third EMA, ``top_ema``, tracks how often the drafter's best root
  child was accepted, and the gate also opens when one such node alone would pay
  (``ControlConfig.single_node_gate``); the node budget then decides, on the round's own
  scores, how many nodes it verifies. Three-node EAGLE-3 trees on an Intel Xeon drafted in
  72% of rounds with it, 56% without, at the same speed, and kept drafting a little more
  after a disturbed turn (docs/RESULTS.md, "The controller after a disturbed turn").
* **Near-free drafters propose every round.** When drafting costs at most
  ``free_draft_share`` of a plain step (:func:`drafts_freely`: the n-gram drafter's lookup
  costs about 1% of one), the gate has nothing to save: the drafter proposes every round and
  the node budget decides, on the proposal itself, whether anything is verified. The gate
  would decide *before* the drafter has looked for a match, from a running average; for a
  retrieval drafter whose proposals are empty in about half the rounds that average mixes the
  two kinds of round, and the gate misses the rounds that have a match. Only rounds that
  verify at least one node count as speculative for such a drafter (an empty proposal cost
  nothing), so probes still come due while its proposals are pruned to nothing, and a due
  probe verifies on the drafter's own scores (the engine's ``decide``).
* **Drafters that cannot pay.** When even an oracle could not pay (:func:`oracle_pays`:
  drafting costs more than ``depth`` accepted tokens save), the engine decodes plainly and
  never runs the drafter (:func:`eaglepangu_jax.engine.decode.generate`): probing it would
  only lose, and a draft model would still have to read every emitted token.
* **Budget.** :func:`choose_nodes` runs BASTION's stop rule (:func:`budget.choose_budget`) on
  the calibrated scores and prunes the tree to the best calibrated nodes.

Non-finite statistics never propagate: a NaN or negative count reads as 0, a NaN EMA makes
speculation "not pay" (plain decoding, probes only) and is restarted by the next update.

Dimensions: ``N`` slots (root included), ``D`` maximum depth, ``B`` bins.
"""

# jaxtyping shape strings such as "N" are not forward references and must stay quoted.

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Float, Int

from eaglepangu_jax import budget
from eaglepangu_jax import tree as tree_lib
from eaglepangu_jax.tree import Tree

__all__ = [
    "Scalar",
    "ControlConfig",
    "AcceptanceStats",
    "calibrated_logscores",
    "speculation_pays",
    "drafts_freely",
    "oracle_pays",
    "should_draft",
    "decide",
    "update",
    "choose_nodes",
]

Scalar = Float[ArrayLike, ""]
_MAX_ROUNDS = 2**30  # rounds_since_draft saturates here instead of overflowing int32


@dataclasses.dataclass(frozen=True, kw_only=True)
class ControlConfig:
    """Static (hashable) settings of the draft controller.

    Attributes:
      num_bins: ``B``, uniform bins of the predicted probability.
      decay: in ``(0, 1]``, factor applied to all bin counts once per speculative round.
      prior_strength: ``> 0``, pseudo-trials given to the drafter's own prediction.
      initial_accept: ``accepted_ema`` at start; optimistic so a new drafter gets tried.
      initial_nodes: ``nodes_ema`` at start.
      ema_weight: in ``(0, 1]``, weight of the newest round in both EMAs (once it exceeds
        the running-mean weight ``1 / (observed + 1 + prior_rounds)``).
      prior_rounds: ``> 0``, how many observed rounds ``initial_accept`` and
        ``initial_nodes`` count as.
      min_backoff: ``>= 1``, rounds without drafting before a probe, after a success.
      max_backoff: ``>= min_backoff``, cap of the doubling backoff.
      free_draft_share: in ``[0, 1)``, drafting that costs at most this share of a plain step
        is treated as free: the drafter proposes every round (:func:`drafts_freely`).
      single_node_gate: also draft when verifying only the drafter's best root child is
        expected to pay (``top_ema``; module docstring); ``False``: the gate reads only the
        average round's outcome (the behaviour before this option, for ablations).
      backlog_rows: ``>= 1``, teacher-feature rows kept for a stateful drafter between the
        rounds it drafts in; it catches up on them when it next drafts, or when one more
        round might not fit (so at most every ``backlog_rows - D`` plain tokens).
    """

    num_bins: int = 10
    decay: float = 0.98
    prior_strength: float = 2.0
    initial_accept: float = 1.0
    initial_nodes: float = 4.0
    ema_weight: float = 0.1
    prior_rounds: float = 1.0
    min_backoff: int = 4
    max_backoff: int = 64
    free_draft_share: float = 0.05
    single_node_gate: bool = True
    backlog_rows: int = 32

    def __post_init__(self):
        rules = {
            "num_bins": (lambda v: isinstance(v, int) and v >= 1, "an int >= 1"),
            "decay": (lambda v: 0 < v <= 1, "in (0, 1]"),
            "prior_strength": (lambda v: 0 < v < float("inf"), "finite and > 0"),
            "initial_accept": (lambda v: 0 <= v < float("inf"), "finite and >= 0"),
            "initial_nodes": (lambda v: 0 <= v < float("inf"), "finite and >= 0"),
            "ema_weight": (lambda v: 0 < v <= 1, "in (0, 1]"),
            "prior_rounds": (lambda v: 0 < v < float("inf"), "finite and > 0"),
            "min_backoff": (lambda v: isinstance(v, int) and v >= 1, "an int >= 1"),
            "backlog_rows": (lambda v: isinstance(v, int) and v >= 1, "an int >= 1"),
            "free_draft_share": (lambda v: 0 <= v < 1, "in [0, 1)"),
            "max_backoff": (
                lambda v: isinstance(v, int) and v >= self.min_backoff,
                "an int >= min_backoff",
            ),
        }
        for name, (ok, what) in rules.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not ok(value):
                raise ValueError(f"ControlConfig.{name} must be {what}, got {value!r}")
        if not isinstance(self.single_node_gate, bool):
            raise ValueError(
                f"ControlConfig.single_node_gate must be a bool, got {self.single_node_gate!r}"
            )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AcceptanceStats:
    """Online acceptance statistics of one drafter on the current text (see module docstring)."""

    trials: Float[Array, " B"]  # decayed count of verified nodes per predicted-probability bin
    hits: Float[Array, " B"]  # decayed count of those that were accepted
    accepted_ema: Float[Array, ""]  # accepted draft tokens per speculative round
    nodes_ema: Float[Array, ""]  # valid non-root nodes verified per speculative round
    # share of speculative rounds with a root child whose best-scored root child was accepted
    top_ema: Float[Array, ""]
    rounds_since_draft: Int[Array, ""]  # consecutive rounds without speculation
    backoff: Int[Array, ""]  # rounds without speculation after which a probe is made
    observed: Int[Array, ""]  # speculative rounds folded into the EMAs (saturating)

    @classmethod
    def create(cls, config: ControlConfig) -> "AcceptanceStats":
        """Empty bins, optimistic EMAs, minimum backoff."""
        # Two buffers, not one shared: the decode loop donates its state.
        return cls(
            trials=jnp.zeros((config.num_bins,), jnp.float32),
            hits=jnp.zeros((config.num_bins,), jnp.float32),
            accepted_ema=jnp.float32(config.initial_accept),
            nodes_ema=jnp.float32(config.initial_nodes),
            top_ema=jnp.float32(min(config.initial_accept, 1.0)),
            rounds_since_draft=jnp.int32(0),
            backoff=jnp.int32(config.min_backoff),
            observed=jnp.int32(0),
        )


def _count(x: Float[Array, "..."]) -> Float[Array, "..."]:
    """A count as stored, with NaN, infinite or negative entries read as 0."""
    return jnp.where(jnp.isfinite(x) & (x > 0), x, 0.0)


def _probability(logscores: Float[ArrayLike, " N"]) -> Float[Array, " N"]:
    """``exp(logscore)`` clipped to ``[0, 1]``; NaN counts as ``-inf`` (probability 0)."""
    logs = jnp.asarray(logscores, jnp.float32)
    return jnp.clip(jnp.exp(jnp.where(jnp.isnan(logs), -jnp.inf, logs)), 0.0, 1.0)


def _bin(p: Float[Array, " N"], num_bins: int) -> Int[Array, " N"]:
    """Uniform bin of each probability; ``p = 1`` goes to the last bin."""
    return jnp.clip(jnp.floor(p * num_bins), 0, num_bins - 1).astype(jnp.int32)


def _check_bins(stats: AcceptanceStats, config: ControlConfig) -> None:
    if stats.trials.shape[-1] != config.num_bins:
        raise ValueError(
            f"stats have {stats.trials.shape[-1]} bins but ControlConfig.num_bins "
            f"is {config.num_bins}"
        )


def calibrated_logscores(
    stats: AcceptanceStats,
    logscores: Float[ArrayLike, " N"],
    valid: Bool[ArrayLike, " N"],
    config: ControlConfig | None = None,
) -> Float[Array, " N"]:
    """Per-node ``log p_hat``, ``p_hat = (hits[b] + s p) / (trials[b] + s)`` (jittable).

    ``p = exp(logscores)`` clipped to ``[0, 1]`` (NaN: 0), ``b`` its bin, ``s`` the config's
    ``prior_strength`` (``config=None``: the defaults). Invalid nodes get ``-inf``; the result
    never holds NaN. Apply it to draft nodes only: the root is accepted with certainty.
    """
    config = ControlConfig(num_bins=stats.trials.shape[-1]) if config is None else config
    _check_bins(stats, config)
    p = _probability(logscores)
    b = _bin(p, config.num_bins)
    trials = _count(stats.trials)
    hits = jnp.minimum(_count(stats.hits), trials)  # keeps p_hat <= 1 whatever the state
    s = config.prior_strength
    p_hat = (hits[b] + s * p) / (trials[b] + s)
    return jnp.where(jnp.asarray(valid, bool), jnp.log(p_hat), -jnp.inf)


def speculation_pays(
    accepted: Scalar, nodes: Scalar, verify_latency: Float[ArrayLike, " N+1"], t_draft: Scalar
) -> Bool[Array, ""]:
    """True when ``(1 + accepted) / (t_draft + T[n]) > 1 / T[0]`` (jittable).

    ``T = verify_latency`` (``[N + 1]``, entry ``n`` verifies the root plus ``n`` nodes),
    ``n = round(nodes)`` clipped to ``[1, N]``: expected emitted tokens per second of a
    speculative round against a plain one-token step. False when ``accepted``, ``nodes``,
    ``t_draft``, ``T[0]`` or ``T[n]`` is not finite, or either round time is not positive.
    """
    verify = jnp.asarray(verify_latency, jnp.float32)
    if verify.ndim != 1 or verify.shape[0] < 2:
        raise ValueError(f"verify_latency must have shape [N + 1] with N >= 1, got {verify.shape}")
    accepted, nodes, t_draft = (jnp.asarray(x, jnp.float32) for x in (accepted, nodes, t_draft))
    n = jnp.clip(jnp.round(jnp.where(jnp.isfinite(nodes), nodes, 1.0)), 1, verify.shape[0] - 1)
    plain, spec = verify[0], t_draft + verify[n.astype(jnp.int32)]
    finite = jnp.isfinite(accepted) & jnp.isfinite(nodes) & jnp.isfinite(plain) & jnp.isfinite(spec)
    # Both round times are positive here, so comparing cross-products compares the rates.
    return finite & (plain > 0) & (spec > 0) & ((1.0 + accepted) * plain > spec)


def oracle_pays(
    depth: int, verify_latency: Float[ArrayLike, " N+1"], t_draft: Scalar
) -> Bool[Array, ""]:
    """Could speculation pay at all? :func:`speculation_pays` for an oracle drafter whose
    chain of ``d = min(depth, N)`` nodes is always accepted, the best a round can do (it emits
    at most ``d + 1`` tokens and verifies at least ``d`` nodes to do so). False also when a
    cost is not finite (jittable)."""
    verify = jnp.asarray(verify_latency, jnp.float32)
    if verify.ndim != 1 or verify.shape[0] < 2:
        raise ValueError(f"verify_latency must have shape [N + 1] with N >= 1, got {verify.shape}")
    if depth < 1:
        raise ValueError(f"depth must be >= 1, got {depth}")
    best = float(min(depth, verify.shape[0] - 1))
    return speculation_pays(best, best, verify, t_draft)


def drafts_freely(
    config: ControlConfig,
    verify_latency: Float[ArrayLike, " N+1"],
    t_draft: Scalar,
    *,
    every_round: bool = False,
) -> Bool[Array, ""]:
    """True when drafting costs at most ``config.free_draft_share`` of a plain step ``T[0]``
    (jittable): such a drafter proposes every round and the node budget decides. False when
    ``t_draft`` or ``T[0]`` is not finite or not positive (``t_draft = 0``, an unmeasured
    cost, counts: the controller's cost model then charges nothing for drafting either).
    ``every_round`` (static): the drafter proposes every round as a free one does, whatever
    it costs (see :func:`eaglepangu_jax.engine.drafter.proposes_every_round`): always True."""
    plain = jnp.asarray(verify_latency, jnp.float32)[0]
    t_draft = jnp.asarray(t_draft, jnp.float32)
    finite = jnp.isfinite(plain) & jnp.isfinite(t_draft) & (plain > 0) & (t_draft >= 0)
    return (finite & (t_draft <= config.free_draft_share * plain)) | every_round


def _probe_due(stats: AcceptanceStats, config: ControlConfig) -> Bool[Array, ""]:
    backoff = jnp.clip(stats.backoff, config.min_backoff, config.max_backoff)
    return stats.rounds_since_draft >= backoff


def should_draft(
    stats: AcceptanceStats,
    config: ControlConfig,
    verify_latency: Float[ArrayLike, " N+1"],
    t_draft: Scalar,
) -> Bool[Array, ""]:
    """Draft this round? True if speculation is expected to pay, an exploration probe is due,
    or drafting is free (:func:`drafts_freely`; the node budget then decides).

    Uses :func:`speculation_pays` on ``accepted_ema`` and ``nodes_ema``, and (with
    ``config.single_node_gate``) on ``top_ema`` and one node; non-finite statistics or
    latencies mean plain decoding except for due probes (jittable).
    """
    return decide(stats, config, verify_latency, t_draft)[0]


def decide(
    stats: AcceptanceStats,
    config: ControlConfig,
    verify_latency: Float[ArrayLike, " N+1"],
    t_draft: Scalar,
    *,
    every_round: bool = False,
) -> tuple[Bool[Array, ""], Bool[Array, ""]]:
    """``(draft this round, as an exploration probe)`` (jittable): :func:`should_draft`, and
    whether the round is a probe that verifies on the drafter's own scores. A due probe
    explores unless the statistics say speculation pays anyway; for a free drafter those
    averages decide nothing and go stale while its proposals are pruned to nothing, so its
    due probes always explore. ``every_round``: see :func:`drafts_freely`."""
    verify_latency = jnp.asarray(verify_latency, jnp.float32)
    t_draft = jnp.asarray(t_draft, jnp.float32)
    pays = speculation_pays(stats.accepted_ema, stats.nodes_ema, verify_latency, t_draft)
    if config.single_node_gate:
        pays = pays | speculation_pays(stats.top_ema, 1.0, verify_latency, t_draft)
    free = drafts_freely(config, verify_latency, t_draft, every_round=every_round)
    probe = _probe_due(stats, config)
    return pays | probe | free, probe & (~pays | free)


def update(
    stats: AcceptanceStats,
    config: ControlConfig,
    tree: Tree,
    acceptance_length: Int[ArrayLike, ""],
    accepted_path: Int[ArrayLike, " D+1"],
    speculated: Bool[ArrayLike, ""],
    paid: Bool[ArrayLike, ""] | None = None,
) -> AcceptanceStats:
    """Fold one round into the statistics (jittable; ``speculated`` may be traced).

    Not speculated: only ``rounds_since_draft`` grows. Speculated, with ``tree`` the verified
    tree and ``accepted_path`` / ``acceptance_length`` its :class:`verify.Acceptance` ``path``
    and ``length`` (accepted nodes: ``path[1 : length + 1]``): counts decay, then every valid
    non-root node adds a trial to its bin and each accepted one a hit; the EMAs move toward
    this round's accepted length and node count, and ``top_ema`` toward whether its
    best-scored root child was accepted (a tree without a root child leaves it), with weight
    ``max(ema_weight, 1 / (observed + 1 + prior_rounds))`` (a non-finite EMA restarts at the
    observation), and ``observed`` grows by one; ``rounds_since_draft`` becomes 0. A
    speculative round that *paid* resets ``backoff`` to ``min_backoff``; a probe (speculation
    while ``rounds_since_draft >= backoff``) that did not doubles it. ``paid`` is whether the
    round beat a plain step (:func:`speculation_pays` on its own accepted length and node
    count, which the engine passes); without it, accepting >= 1 token counts as paid. The
    difference matters for a drafter that often gets one token right but never enough to
    pay: with the weaker rule each such probe reset the back-off, and it probed every
    ``min_backoff`` rounds.
    """
    _check_bins(stats, config)
    slots = tree.num_slots
    index = jnp.arange(slots, dtype=jnp.int32)
    node = tree.valid & (index > 0)
    path = jnp.clip(jnp.asarray(accepted_path, jnp.int32), 0, slots - 1)
    length = jnp.clip(jnp.asarray(acceptance_length, jnp.int32), 0, path.shape[-1] - 1)
    j = jnp.arange(path.shape[-1], dtype=jnp.int32)
    on_path = (j >= 1) & (j <= length)  # past `length` the path repeats the stop slot
    accepted = jnp.any((index[:, None] == path[None, :]) & on_path[None, :], axis=1) & node
    # What a one-node round would have done: was the best-scored root child accepted?
    child = node & (tree.depth == 1)
    child_score = jnp.where(child, jnp.nan_to_num(tree.logscore, nan=-jnp.inf), -jnp.inf)
    top_child = jnp.argmax(child_score)  # ties: the lower slot
    has_child = jnp.any(child)
    top_hit = (accepted[top_child] & has_child).astype(jnp.float32)
    b = _bin(_probability(tree.logscore), config.num_bins)
    zeros = jnp.zeros((config.num_bins,), jnp.float32)
    trials = config.decay * _count(stats.trials) + zeros.at[b].add(node.astype(jnp.float32))
    hits = config.decay * _count(stats.hits) + zeros.at[b].add(accepted.astype(jnp.float32))

    # A running mean with the initial values as `prior_rounds` rounds, until the EMA weight
    # is the larger: early rounds correct the optimistic start at once.
    seen = jnp.clip(stats.observed, 0, _MAX_ROUNDS)
    weight = jnp.maximum(
        config.ema_weight, 1.0 / (seen.astype(jnp.float32) + 1.0 + config.prior_rounds)
    )

    def ema(old, observed):
        new = (1.0 - weight) * old + weight * observed
        return jnp.where(jnp.isfinite(old), new, observed)

    backoff = jnp.clip(stats.backoff, config.min_backoff, config.max_backoff)
    success = length >= 1 if paid is None else jnp.asarray(paid, bool)
    failed_probe = _probe_due(stats, config) & ~success
    backoff = jnp.where(
        success,
        config.min_backoff,
        jnp.where(failed_probe, jnp.minimum(2 * backoff, config.max_backoff), backoff),
    )
    drafted = AcceptanceStats(
        trials=trials,
        hits=hits,
        accepted_ema=ema(stats.accepted_ema, length.astype(jnp.float32)),
        nodes_ema=ema(stats.nodes_ema, jnp.sum(node.astype(jnp.float32))),
        # A round that verified no root child says nothing about one.
        top_ema=jnp.where(has_child, ema(stats.top_ema, top_hit), stats.top_ema),
        rounds_since_draft=jnp.int32(0),
        backoff=backoff.astype(jnp.int32),
        observed=jnp.minimum(seen + 1, _MAX_ROUNDS),
    )
    waited = dataclasses.replace(
        stats, rounds_since_draft=jnp.minimum(stats.rounds_since_draft + 1, _MAX_ROUNDS)
    )
    speculated = jnp.asarray(speculated, bool)
    return jax.tree.map(lambda a, b: jnp.where(speculated, a, b), drafted, waited)


def choose_nodes(
    stats: AcceptanceStats,
    config: ControlConfig,
    tree: Tree,
    verify_latency: Float[ArrayLike, " N"],
    t_draft: Scalar,
    t_other: Scalar,
) -> tuple[Int[Array, ""], Tree]:
    """Node budget on calibrated scores, and the tree pruned to it (jittable).

    ``verify_latency`` is ``[N]`` (entry ``n`` verifies the root plus ``n`` of the ``N - 1``
    draft slots). ``n`` is :func:`budget.choose_budget` on the calibrated node scores sorted
    best first, at most the number of valid nodes. ``pruned`` is ``tree.keep_best`` ranking
    by the calibrated scores: the root plus the ``n`` best calibrated nodes, packed.

    Choices. (1) ``pruned`` keeps the drafter's *raw* ``logscore``: that is what verify it
    and pass to :func:`update`, whose bins index raw predictions (binning calibrated scores
    would calibrate the calibration). ``keep_best(pruned, n)`` is the identity, so an engine
    that applies ``keep_best`` anyway gets the same tree. (2) Binning is monotone in ``p`` only
    within a bin, so a child may calibrate above its parent; ``keep_best`` would then drop it
    (validity closure) and keep fewer than ``n`` nodes. A node's calibrated score is therefore
    capped by its ancestors' (minimum along the path): accepting a node implies accepting its
    parent, so the cap is also the better estimate, and with ties going to the lower slot the
    ``n`` best always form a subtree.
    """
    slots = tree.num_slots
    calibrated = calibrated_logscores(stats, tree.logscore, tree.valid, config).at[0].set(0.0)
    ancestors = jnp.clip(tree.ancestors, 0, slots - 1)
    calibrated = jnp.where(tree.valid, jnp.min(calibrated[ancestors], axis=-1), -jnp.inf)
    n = budget.choose_budget(-jnp.sort(-calibrated[1:]), verify_latency, t_draft, t_other)
    n = jnp.minimum(n, jnp.sum(tree.valid[1:].astype(jnp.int32)))
    # keep_best ranks by logscore and moves tokens along: carry each node's slot id as its
    # token, then gather the real tokens and raw scores back through it.
    index = jnp.arange(slots, dtype=jnp.int32)
    kept = tree_lib.keep_best(dataclasses.replace(tree, tokens=index, logscore=calibrated), n)
    old = jnp.clip(kept.tokens, 0, slots - 1)
    return n, dataclasses.replace(
        kept,
        tokens=jnp.where(kept.valid, tree.tokens[old], 0),
        logscore=jnp.where(kept.valid, tree.logscore[old], -jnp.inf),
    )
