"""The draft controller: calibration bins, the draft-or-not decision, backoff and budget."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from eaglepangu_jax import draft_control as dc
from eaglepangu_jax import tree as tree_lib
from eaglepangu_jax import verify

CONFIG = dc.ControlConfig()
SLOTS, DEPTH = 6, 3

update_jit = jax.jit(dc.update, static_argnums=1)
should_draft_jit = jax.jit(dc.should_draft, static_argnums=1)
calibrated_jit = jax.jit(dc.calibrated_logscores, static_argnums=3)
choose_nodes_jit = jax.jit(dc.choose_nodes, static_argnums=1)
pays_jit = jax.jit(dc.speculation_pays)
keep_best_jit = jax.jit(tree_lib.keep_best)
from_parents_jit = jax.jit(tree_lib.from_parents, static_argnames="max_depth")


# ------------------------------------------------------------------ strategies


def f32(lo, hi):
    # No subnormals: XLA on CPU flushes them to zero.
    return st.floats(float(np.float32(lo)), float(np.float32(hi)), width=32, allow_subnormal=False)


nasty = st.sampled_from([math.nan, math.inf, -math.inf])
counts = st.one_of(f32(0, 50), f32(-5, 0), nasty)
logscore = st.one_of(f32(-3, 0.5), f32(-30, 0), nasty)


@st.composite
def stats_strategy(draw, finite=False):
    b = CONFIG.num_bins
    count = f32(0, 50) if finite else counts
    scalar = f32(0, 12) if finite else st.one_of(f32(0, 12), nasty)
    return dc.AcceptanceStats(
        trials=jnp.asarray(draw(st.lists(count, min_size=b, max_size=b)), jnp.float32),
        hits=jnp.asarray(draw(st.lists(count, min_size=b, max_size=b)), jnp.float32),
        accepted_ema=jnp.float32(draw(scalar)),
        nodes_ema=jnp.float32(draw(scalar)),
        top_ema=jnp.float32(draw(f32(0, 1) if finite else st.one_of(f32(0, 1), nasty))),
        rounds_since_draft=jnp.int32(draw(st.integers(0, 100))),
        backoff=jnp.int32(draw(st.integers(0, 100))),
        observed=jnp.int32(draw(st.integers(-3, 100))),
    )


@st.composite
def tree_strategy(draw):
    parents = [0] + [draw(st.integers(0, i - 1)) for i in range(1, SLOTS)]
    mostly_true = st.sampled_from([True, True, True, False])
    valid = [True] + draw(st.lists(mostly_true, min_size=SLOTS - 1, max_size=SLOTS - 1))
    scores = draw(st.lists(logscore, min_size=SLOTS, max_size=SLOTS))
    return from_parents_jit(
        np.asarray(parents, np.int32),
        tokens=100 + np.arange(SLOTS),
        valid=np.asarray(valid),
        logscore=np.asarray(scores, np.float32),
        max_depth=DEPTH,
    )


@st.composite
def acceptance_strategy(draw, tree):
    """``(length, path)`` as verify.Acceptance has them, stopping at a random valid slot."""
    valid, depth, ancestors = (np.asarray(x) for x in (tree.valid, tree.depth, tree.ancestors))
    stop = draw(st.integers(0, SLOTS - 1))
    stop = stop if valid[stop] else 0
    return int(depth[stop]), ancestors[stop]


def no_bin_edge(logscores):
    """Reject examples where float32 round-off could move a probability across a bin edge."""
    for value in np.asarray(logscores, np.float64):
        if np.isfinite(value):
            x = min(math.exp(value), 1.0) * CONFIG.num_bins
            assume(x >= CONFIG.num_bins or abs(x - round(x)) > 1e-3 or round(x) == 0)


# ------------------------------------------------------------------ numpy references


def ref_count(x):
    return x if np.isfinite(x) and x > 0 else 0.0


def ref_prob(value):
    return 0.0 if np.isnan(value) else min(max(math.exp(min(value, 50.0)), 0.0), 1.0)


def ref_bin(p):
    return min(math.floor(p * CONFIG.num_bins), CONFIG.num_bins - 1)


def ref_calibrated(stats, logscores, valid, config=CONFIG):
    trials_b, hits_b = np.asarray(stats.trials, np.float64), np.asarray(stats.hits, np.float64)
    out = []
    for value, ok in zip(np.asarray(logscores, np.float64), np.asarray(valid)):
        p = ref_prob(value)
        b = ref_bin(p)
        trials = ref_count(trials_b[b])
        hits = min(ref_count(hits_b[b]), trials)
        p_hat = (hits + config.prior_strength * p) / (trials + config.prior_strength)
        out.append(math.log(p_hat) if ok and p_hat > 0 else -math.inf)
    return np.asarray(out)


def ref_pays(accepted, nodes, latency, t_draft):
    """Rate of every node count in the table, then the one ``nodes`` rounds to."""
    latency = np.asarray(latency, np.float64)
    big_n = len(latency) - 1
    if not all(np.isfinite([accepted, nodes, t_draft, latency[0]])) or latency[0] <= 0:
        return False, math.inf
    n = int(min(max(np.round(nodes), 1), big_n))
    rates = {}
    for k in range(1, big_n + 1):
        spec = t_draft + latency[k]
        rates[k] = (1 + accepted) / spec if np.isfinite(spec) and spec > 0 else None
    if rates[n] is None:
        return False, math.inf
    plain = 1 / latency[0]
    return rates[n] > plain, abs(rates[n] - plain) / plain


def ref_free(latency, t_draft, share=0.05):
    """Drafting is free: ``0 <= t_draft <= share * T[0]``, both finite, ``T[0] > 0``; also the
    distance of ``t_draft`` from the threshold, relative to ``T[0]``."""
    plain = float(np.asarray(latency, np.float64)[0])
    if not (np.isfinite(plain) and np.isfinite(t_draft)) or plain <= 0 or t_draft < 0:
        return False, math.inf
    return t_draft <= share * plain, abs(t_draft - share * plain) / plain


def ref_update(stats, config, tree, length, path, speculated, paid=None):
    rounds, backoff = int(stats.rounds_since_draft), int(stats.backoff)
    if not speculated:
        return {
            "trials": np.asarray(stats.trials),
            "hits": np.asarray(stats.hits),
            "accepted_ema": float(stats.accepted_ema),
            "nodes_ema": float(stats.nodes_ema),
            "top_ema": float(stats.top_ema),
            "rounds_since_draft": rounds + 1,
            "backoff": backoff,
            "observed": int(stats.observed),
        }
    trials = [config.decay * ref_count(float(t)) for t in np.asarray(stats.trials)]
    hits = [config.decay * ref_count(float(h)) for h in np.asarray(stats.hits)]
    accepted_slots = {int(s) for s in path[1 : length + 1]}
    nodes, valid, scores = 0, np.asarray(tree.valid), np.asarray(tree.logscore, np.float64)
    for i in range(1, tree.num_slots):
        if valid[i]:
            nodes += 1
            b = ref_bin(ref_prob(scores[i]))
            trials[b] += 1
            hits[b] += i in accepted_slots
    # The best-scored root child (NaN: -inf; ties: the lower slot), if the tree has one.
    depth = np.asarray(tree.depth)
    children = [i for i in range(1, tree.num_slots) if valid[i] and depth[i] == 1]
    child_scores = [-math.inf if np.isnan(scores[i]) else scores[i] for i in children]
    top_child = children[int(np.argmax(child_scores))] if children else None

    seen = max(int(stats.observed), 0)

    def ema(old, new):
        w = max(config.ema_weight, 1.0 / (seen + 1 + config.prior_rounds))
        return (1 - w) * old + w * new if np.isfinite(old) else new

    backoff = min(max(backoff, config.min_backoff), config.max_backoff)
    success = length >= 1 if paid is None else paid
    if success:
        new_backoff = config.min_backoff
    elif rounds >= backoff:
        new_backoff = min(2 * backoff, config.max_backoff)
    else:
        new_backoff = backoff
    return {
        "trials": np.asarray(trials),
        "hits": np.asarray(hits),
        "accepted_ema": ema(float(stats.accepted_ema), length),
        "nodes_ema": ema(float(stats.nodes_ema), nodes),
        "top_ema": (
            float(stats.top_ema)
            if top_child is None
            else ema(float(stats.top_ema), float(top_child in accepted_slots))
        ),
        "rounds_since_draft": 0,
        "backoff": new_backoff,
        "observed": seen + 1,
    }


def assert_stats_equal(got, want):
    for name, value in want.items():
        np.testing.assert_allclose(
            np.asarray(getattr(got, name), np.float64), value, rtol=1e-5, atol=1e-5, err_msg=name
        )


# ------------------------------------------------------------------ config and state


def test_config_validation_names_the_field():
    for field, bad in [
        ("num_bins", 0),
        ("decay", 0.0),
        ("decay", 1.5),
        ("prior_strength", 0.0),
        ("initial_accept", -1.0),
        ("ema_weight", 0.0),
        ("min_backoff", 0),
        ("max_backoff", 2),
        ("num_bins", 2.5),
        ("initial_nodes", math.nan),
        ("free_draft_share", 1.0),
        ("free_draft_share", -0.1),
        ("prior_rounds", 0.0),
        ("prior_rounds", math.inf),
    ]:
        with pytest.raises(ValueError, match=field):
            dataclasses.replace(CONFIG, **{field: bad})
    with pytest.raises(TypeError):
        dc.ControlConfig(10)  # keyword-only
    assert hash(CONFIG) == hash(dc.ControlConfig())


def test_create_is_optimistic_and_bin_count_is_checked():
    stats = dc.AcceptanceStats.create(CONFIG)
    assert stats.trials.shape == (10,) and float(stats.accepted_ema) == CONFIG.initial_accept
    assert int(stats.backoff) == CONFIG.min_backoff
    latency = 0.02 + 0.0005 * np.arange(9, dtype=np.float32)
    assert bool(should_draft_jit(stats, CONFIG, latency, 0.002))  # a new drafter is tried
    with pytest.raises(ValueError, match="num_bins"):
        dc.calibrated_logscores(
            stats, jnp.zeros(3), jnp.ones(3, bool), dc.ControlConfig(num_bins=4)
        )


# ------------------------------------------------------------------ against numpy


@given(
    stats_strategy(),
    st.lists(logscore, min_size=7, max_size=7),
    st.lists(st.booleans(), min_size=7, max_size=7),
)
def test_calibrated_logscores_matches_numpy(stats, scores, valid):
    no_bin_edge(scores)
    got = np.asarray(
        calibrated_jit(stats, np.asarray(scores, np.float32), np.asarray(valid), CONFIG)
    )
    want = ref_calibrated(stats, scores, valid)
    assert not np.any(np.isnan(got))
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
    finite = np.isfinite(want)
    np.testing.assert_allclose(got[finite], want[finite], rtol=1e-5, atol=1e-5)


@given(
    st.one_of(f32(-2, 20), nasty),
    st.one_of(f32(-1, 12), nasty),
    st.lists(st.one_of(f32(1e-4, 1), st.sampled_from([0.0, -0.01]), nasty), min_size=2, max_size=9),
    st.one_of(f32(0, 0.5), nasty),
    st.integers(0, 20),
    st.integers(0, 20),
    st.one_of(f32(0, 1), nasty),
    st.booleans(),
)
def test_should_draft_matches_brute_force(
    accepted, nodes, latency, t_draft, rounds, backoff, top, single_node_gate
):
    pays, margin = ref_pays(accepted, nodes, latency, t_draft)
    assume(margin > 1e-4)
    one_pays, one_margin = ref_pays(top, 1, latency, t_draft)
    assume(one_margin > 1e-4)
    latency = np.asarray(latency, np.float32)
    assert bool(pays_jit(accepted, nodes, latency, t_draft)) == pays
    config = dataclasses.replace(CONFIG, single_node_gate=single_node_gate)
    stats = dataclasses.replace(
        dc.AcceptanceStats.create(config),
        accepted_ema=jnp.float32(accepted),
        nodes_ema=jnp.float32(nodes),
        top_ema=jnp.float32(top),
        rounds_since_draft=jnp.int32(rounds),
        backoff=jnp.int32(backoff),
    )
    free, free_margin = ref_free(latency, t_draft)
    assume(free_margin > 1e-4)
    assert bool(dc.drafts_freely(config, latency, t_draft)) == free
    due = rounds >= min(max(backoff, config.min_backoff), config.max_backoff)
    want = pays or (single_node_gate and one_pays) or due or free
    assert bool(should_draft_jit(stats, config, latency, t_draft)) == want


@given(
    st.lists(st.one_of(f32(1e-4, 1), nasty), min_size=2, max_size=9),
    st.one_of(f32(0, 0.5), nasty),
    st.integers(1, 12),
)
def test_oracle_pays_matches_brute_force(latency, t_draft, depth):
    best = min(depth, len(latency) - 1)
    pays, margin = ref_pays(best, best, latency, t_draft)
    assume(margin > 1e-4)
    assert bool(dc.oracle_pays(depth, np.asarray(latency, np.float32), t_draft)) == pays


@given(stats_strategy(), tree_strategy(), st.data(), st.booleans())
def test_update_matches_numpy(stats, tree, data, speculated):
    no_bin_edge(tree.logscore)
    length, path = data.draw(acceptance_strategy(tree))
    got = update_jit(stats, CONFIG, tree, length, path, speculated)
    assert_stats_equal(got, ref_update(stats, CONFIG, tree, length, path, speculated))
    if speculated:  # the new statistics are always usable
        assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(got))


@given(stats_strategy(), tree_strategy(), st.data(), st.booleans(), st.booleans())
def test_update_with_paid_matches_numpy(stats, tree, data, speculated, paid):
    # With the engine's verdict on the round, only a round that paid resets the back-off.
    no_bin_edge(tree.logscore)
    length, path = data.draw(acceptance_strategy(tree))
    got = update_jit(stats, CONFIG, tree, length, path, speculated, paid)
    assert_stats_equal(got, ref_update(stats, CONFIG, tree, length, path, speculated, paid))


def test_a_probe_that_accepts_but_does_not_pay_backs_off():
    stats = dc.AcceptanceStats.create(CONFIG)
    stats = dataclasses.replace(stats, rounds_since_draft=jnp.int32(CONFIG.min_backoff))
    tree = tree_lib.chain(SLOTS)
    path = jnp.arange(tree.max_depth + 1, dtype=jnp.int32)
    unpaid = dc.update(stats, CONFIG, tree, 1, path, True, False)
    legacy = dc.update(stats, CONFIG, tree, 1, path, True)
    assert int(unpaid.backoff) == 2 * CONFIG.min_backoff
    assert int(legacy.backoff) == CONFIG.min_backoff


@settings(max_examples=8)  # eager dispatch is slow; the numpy test covers the values
@given(stats_strategy(), tree_strategy(), st.data(), st.booleans())
def test_update_jit_matches_eager(stats, tree, data, speculated):
    length, path = data.draw(acceptance_strategy(tree))
    jitted = update_jit(stats, CONFIG, tree, length, path, speculated)
    eager = dc.update(stats, CONFIG, tree, length, path, speculated)
    for a, b in zip(jax.tree.leaves(jitted), jax.tree.leaves(eager)):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_allclose(a, b, rtol=1e-6, equal_nan=True)


@given(
    stats_strategy(finite=True),
    tree_strategy(),
    f32(0.005, 0.05),
    st.lists(f32(0, 0.01), min_size=SLOTS - 1, max_size=SLOTS - 1),
    f32(0, 0.01),
)
def test_choose_nodes_matches_numpy(stats, tree, base, steps, t_draft):
    no_bin_edge(tree.logscore)
    latency = np.cumsum([base, *steps]).astype(np.float32)
    n, pruned = choose_nodes_jit(stats, CONFIG, tree, latency, t_draft, 0.001)
    n = int(n)
    calibrated = ref_calibrated(stats, tree.logscore, tree.valid)
    calibrated[0] = 0.0
    valid, parents = np.asarray(tree.valid), np.asarray(tree.parents)
    capped = np.full(SLOTS, -np.inf)
    for i in range(SLOTS):  # minimum along the root path, by walking parents
        if valid[i]:
            j, capped[i] = i, calibrated[i]
            while j:
                j = int(parents[j])
                capped[i] = min(capped[i], calibrated[j])
    rho = np.exp(np.sort(capped[1:])[::-1])
    cost = t_draft + 0.001 + latency.astype(np.float64)
    speed = np.concatenate([[1.0], 1.0 + np.cumsum(rho)]) / cost  # every node count scanned
    want = int(np.argmax(speed))  # the first of equal maxima
    others = np.delete(speed, want)
    assume(np.all(speed[want] - others > 1e-4 * speed[want]) or np.all(rho == 0))
    assert n == min(want, int(np.sum(valid[1:])))
    # The n best calibrated nodes (ties to the lower slot), packed in slot order, raw scores.
    ranked = sorted((i for i in range(1, SLOTS) if valid[i]), key=lambda i: (-capped[i], i))
    best = sorted(ranked[:n])
    assert all(parents[i] == 0 or parents[i] in best for i in best)  # a subtree
    np.testing.assert_array_equal(pruned.valid, np.arange(SLOTS) <= n)
    np.testing.assert_array_equal(pruned.tokens[1 : n + 1], np.asarray(tree.tokens)[best])
    np.testing.assert_array_equal(pruned.logscore[1 : n + 1], np.asarray(tree.logscore)[best])
    slot_of = {old: new for new, old in enumerate([0, *best])}
    np.testing.assert_array_equal(pruned.parents[1 : n + 1], [slot_of[parents[i]] for i in best])
    again = keep_best_jit(pruned, n)  # what an engine applying keep_best itself would get
    for x, y in zip(jax.tree.leaves(again), jax.tree.leaves(pruned)):
        np.testing.assert_array_equal(x, y)


def test_update_with_greedy_acceptance():
    tree = from_parents_jit(
        np.array([0, 0, 1, 2, 0]),
        tokens=np.array([9, 1, 2, 3, 4]),
        logscore=np.log(np.array([1, 0.95, 0.55, 0.35, 0.05])),
        max_depth=3,
    )
    logits = jax.nn.one_hot(np.array([1, 2, 7, 0, 0]), 10)  # accepts slots 1, 2 then stops
    acc = jax.jit(verify.greedy)(tree, logits)
    assert int(acc.length) == 2
    stats = update_jit(dc.AcceptanceStats.create(CONFIG), CONFIG, tree, acc.length, acc.path, True)
    np.testing.assert_allclose(stats.trials, np.eye(10)[[9, 5, 3, 0]].sum(0))
    np.testing.assert_allclose(stats.hits, np.eye(10)[[9, 5]].sum(0))
    # The first round is averaged with the optimistic start as one round (prior_rounds 1).
    np.testing.assert_allclose(stats.accepted_ema, 0.5 * 1.0 + 0.5 * 2, rtol=1e-6)
    assert int(stats.observed) == 1
    # From the tenth round on the EMA weight (0.1) exceeds the running-mean weight.
    later = dataclasses.replace(stats, observed=jnp.int32(9))
    later = update_jit(later, CONFIG, tree, acc.length, acc.path, True)
    np.testing.assert_allclose(later.accepted_ema, 0.9 * 1.5 + 0.1 * 2, rtol=1e-6)


# ------------------------------------------------------------------ closed-loop behaviour

LATENCY = (0.02 + 0.0005 * np.arange(9)).astype(np.float32)  # root + up to 8 nodes
CHAIN = from_parents_jit(np.maximum(np.arange(9) - 1, 0), max_depth=8)
CHAIN = dataclasses.replace(CHAIN, logscore=jnp.log(0.9) * jnp.arange(9, dtype=jnp.float32))


@jax.jit
def round_step(stats, accepted, t_draft):
    draft = dc.should_draft(stats, CONFIG, LATENCY, t_draft)
    path = jnp.where(jnp.arange(9) <= accepted, jnp.arange(9), accepted)
    return dc.update(stats, CONFIG, CHAIN, accepted, path, draft), draft


def run(stats, accepted_per_round, t_draft):
    drafted = []
    for accepted in accepted_per_round:
        stats, draft = round_step(stats, jnp.int32(accepted), jnp.float32(t_draft))
        drafted.append(bool(draft))
    return stats, np.asarray(drafted)


def test_never_matching_drafter_rarely_speculates():
    _, drafted = run(dc.AcceptanceStats.create(CONFIG), [0] * 300, 0.002)
    assert drafted[0] and drafted[50:].mean() < 0.1
    assert drafted[50:].any()  # probes still happen


def test_the_optimistic_start_is_corrected_within_a_few_rounds():
    """A drafter that accepts nothing from the first round. Averaged with the optimistic start
    as one round, the average round's estimate stops paying after 3 drafting rounds (then only
    the doubling probes draft); a plain EMA (the start counting as 10^9 rounds, the negative
    control) keeps drafting for 13 rounds, each paying for a draft and a multi-token verify.
    With the single-node gate (the default) the estimate for one node, which here costs 1/8 of
    a plain step more with drafting, needs 7 rounds to fall below 1/8 (1 / (7 + 1))."""

    def drafted(config):
        stats, out = dc.AcceptanceStats.create(config), []
        for _ in range(40):
            draft = dc.should_draft(stats, config, LATENCY, jnp.float32(0.002))
            path = jnp.zeros((9,), jnp.int32)
            stats = update_jit(stats, config, CHAIN, jnp.int32(0), path, draft)
            out.append(str(int(draft)))
        return "".join(out)

    average_only = dataclasses.replace(CONFIG, single_node_gate=False)
    assert drafted(average_only) == "1110000100000000100000000000000001000000"
    assert drafted(CONFIG) == "1111111000010000000010000000000000000100"
    plain_ema = dataclasses.replace(average_only, prior_rounds=1e9)
    assert drafted(plain_ema) == "1111111111111000010000000010000000000000"


def test_oracle_drafter_always_speculates():
    stats, drafted = run(dc.AcceptanceStats.create(CONFIG), [8] * 300, 0.0005)
    assert drafted.all()
    assert float(stats.accepted_ema) > 7.9 and round(float(stats.nodes_ema)) == 8


def test_speculation_resumes_when_text_turns_repetitive():
    stats, _ = run(dc.AcceptanceStats.create(CONFIG), [0] * 200, 0.002)
    assert int(stats.backoff) == CONFIG.max_backoff
    _, drafted = run(stats, [8] * 100, 0.002)
    first = int(np.argmax(drafted))
    assert first <= CONFIG.max_backoff and drafted[first:].all()


# ------------------------------------------------------------------ non-finite input


@pytest.mark.parametrize("field", ["accepted_ema", "nodes_ema", "top_ema", "latency", "t_draft"])
def test_nan_means_plain_decoding_except_due_probes(field):
    # Only the field under test could open the gate: the other route starts closed.
    closed = "accepted_ema" if field == "top_ema" else "top_ema"
    good = dataclasses.replace(dc.AcceptanceStats.create(CONFIG), **{closed: jnp.float32(0.0)})
    stats = (
        dataclasses.replace(good, **{field: jnp.float32(math.nan)})
        if field in ("accepted_ema", "nodes_ema", "top_ema")
        else good
    )
    latency = np.full_like(LATENCY, math.nan) if field == "latency" else LATENCY
    t_draft = math.nan if field == "t_draft" else 0.002  # not free: the gate decides
    assert not bool(should_draft_jit(stats, CONFIG, latency, t_draft))
    due = dataclasses.replace(stats, rounds_since_draft=good.backoff)
    assert bool(should_draft_jit(due, CONFIG, latency, t_draft))
    healed = update_jit(due, CONFIG, CHAIN, 2, np.array([0, 1, 2, 2, 2, 2, 2, 2, 2]), True)
    assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(healed))


def test_nan_counts_never_reach_outputs():
    stats = dataclasses.replace(
        dc.AcceptanceStats.create(CONFIG),
        trials=jnp.full((10,), math.nan),
        hits=jnp.full((10,), math.inf),
    )
    scores = np.array([0.0, math.nan, -math.inf, math.inf, -1.0], np.float32)
    out = np.asarray(calibrated_jit(stats, scores, np.ones(5, bool), CONFIG))
    assert not np.any(np.isnan(out)) and np.isneginf(out[[1, 2]]).all()
    np.testing.assert_allclose(out[[0, 3, 4]], [0.0, 0.0, -1.0], rtol=1e-6)  # prior only
    n, pruned = choose_nodes_jit(stats, CONFIG, CHAIN, LATENCY, 0.001, 0.0)
    assert 0 <= int(n) <= 8 and int(np.sum(pruned.valid)) == int(n) + 1


def test_top_ema_follows_the_best_root_child():
    """Two root children; the round's accepted path runs through the weaker one, then the
    stronger one; a round whose tree has no root child leaves the estimate alone."""
    tree = from_parents_jit(
        np.array([0, 0, 0, 2], np.int32),
        tokens=np.array([5, 6, 7, 8], np.int32),
        logscore=np.log(np.array([1.0, 0.6, 0.3, 0.2], np.float32)),
        max_depth=2,
    )
    start = dataclasses.replace(dc.AcceptanceStats.create(CONFIG), observed=jnp.int32(1000))
    weaker = update_jit(start, CONFIG, tree, 2, np.array([0, 2, 3]), True)
    stronger = update_jit(start, CONFIG, tree, 1, np.array([0, 1, 1]), True)
    w = CONFIG.ema_weight
    np.testing.assert_allclose(float(weaker.top_ema), 1.0 - w, rtol=1e-6)
    np.testing.assert_allclose(float(stronger.top_ema), 1.0, rtol=1e-6)
    root_only = dataclasses.replace(tree, valid=jnp.array([True, False, False, False]))
    empty = update_jit(weaker, CONFIG, root_only, 0, np.array([0, 0, 0]), True)
    assert float(empty.top_ema) == float(weaker.top_ema)
    assert float(empty.accepted_ema) < float(weaker.accepted_ema)  # the round still counted


def test_single_node_gate_keeps_drafting_where_one_node_pays():
    """A three-node chain whose first node is accepted in 2 rounds of 5 and nothing deeper, on
    a curve where 4 slots cost 1.5x a plain step and 2 slots 1.05x: the average round (1.4
    tokens for 1.65 steps' time) does not pay, one node (1.4 for 1.2) does. The gate on the
    average alone drafts only its probes (about one round in five); with the single-node gate
    it drafts every round."""
    latency = np.array([0.040, 0.042, 0.048, 0.060], np.float32)
    chain = from_parents_jit(np.array([0, 0, 1, 2], np.int32), max_depth=3)
    chain = dataclasses.replace(chain, logscore=jnp.log(jnp.array([1.0, 0.8, 0.6, 0.5])))

    def drafted(config):
        stats, out = dc.AcceptanceStats.create(config), []
        for i in range(200):
            draft = dc.should_draft(stats, config, latency, jnp.float32(0.006))
            length = 1 if i % 5 in (0, 2) else 0
            path = np.array([0, 1, 1, 1]) if length else np.zeros(4, np.int32)
            paid = dc.speculation_pays(length, 3, latency, 0.006)
            stats = update_jit(stats, config, chain, length, path, draft, paid)
            out.append(bool(draft))
        return np.asarray(out)

    assert drafted(dataclasses.replace(CONFIG, single_node_gate=False))[50:].mean() < 0.3
    assert drafted(CONFIG)[50:].all()


def test_single_node_gate_must_be_a_bool():
    with pytest.raises(ValueError, match="single_node_gate"):
        dc.ControlConfig(single_node_gate=1)
