"""Lossless sampling: the emitted tokens follow the adjusted teacher exactly (chi-square tests).

Every statistical test uses fixed seeds, so it is deterministic: a pass cannot turn into a
flake. Thresholds: a correct rule must give p > 1e-3; the negative controls (rules known to be
biased) must give p < 1e-9 on the same sample size, which shows the test has power.
"""

import dataclasses
import functools
import os
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st
from scipy.stats import chisquare

from eaglepangu_jax import mode
from eaglepangu_jax import tree as T
from eaglepangu_jax import verify as V

# ------------------------------------------------------------------------------------------
# adjusted_probs
# ------------------------------------------------------------------------------------------


def np_adjusted(logits, temperature, top_p):
    """Plain numpy float64 reference for temperature + top-p (ties at the cutoff kept)."""
    logits = np.asarray(logits, np.float64)
    if temperature == 0:
        return np.eye(logits.shape[-1])[np.argmax(logits)]
    p = np.exp((logits - logits.max()) / temperature)
    p /= p.sum()
    kept, mass = np.zeros_like(p), 0.0
    for i in np.argsort(-p, kind="stable"):
        if mass >= top_p and p[i] < kept[kept > 0].min():
            break
        kept[i] = p[i]
        mass += p[i]
    return kept / kept.sum()


adjusted_jit = jax.jit(V.adjusted_probs)


def test_adjusted_probs_literal():
    logits = np.log(np.asarray([0.5, 0.3, 0.15, 0.05], np.float32))
    np.testing.assert_allclose(adjusted_jit(logits), [0.5, 0.3, 0.15, 0.05], rtol=1e-6)
    np.testing.assert_allclose(adjusted_jit(logits, 1.0, 0.7), [0.625, 0.375, 0, 0], rtol=1e-6)
    np.testing.assert_allclose(
        adjusted_jit(logits, 1.0, 0.85), np.asarray([0.5, 0.3, 0.15, 0]) / 0.95, rtol=1e-6
    )
    np.testing.assert_allclose(adjusted_jit(logits, 1.0, 1e-9), [1, 0, 0, 0])
    # Temperature 0 is the argmax, first index on ties.
    np.testing.assert_array_equal(
        adjusted_jit(np.asarray([1.0, 3.0, 3.0], np.float32), 0.0), [0, 1, 0]
    )
    # Ties at the top-p cutoff are all kept.
    tied = np.log(np.asarray([0.4, 0.3, 0.3], np.float32))
    np.testing.assert_allclose(adjusted_jit(tied, 1.0, 0.5), [0.4, 0.3, 0.3], rtol=1e-6)
    # Degenerate rows become a safe one-hot.
    broken = np.asarray([[0.0, np.nan, 1.0], [-np.inf] * 3, [0.0, np.inf, 1.0]], np.float32)
    np.testing.assert_array_equal(adjusted_jit(broken), [[0, 0, 1], [1, 0, 0], [0, 1, 0]])


def cutoff_is_ambiguous(logits, temperature, top_p, tol=1e-4):
    """True when float32 may legitimately keep a different top-p set than the float64
    reference: the mass of some most-likely set ``{p >= v}`` lies within ``tol`` of ``top_p``,
    or the last kept probability nearly (not exactly) ties the next one down. Exact ties are
    fine: equal logits give bit-equal probabilities in both. No filter, no ambiguity."""
    if temperature == 0 or top_p >= 1.0:
        return False
    p = np_adjusted(logits, temperature, 1.0)
    values = np.unique(p[p > 0])[::-1]  # distinct probabilities, descending
    masses = np.cumsum([p[p == v].sum() for v in values])  # mass of {p >= v}
    cut = int(np.argmax(masses >= top_p))  # values[cut] is the last kept probability
    near_tie = cut + 1 < len(values) and values[cut] - values[cut + 1] < tol * values[cut]
    return bool(np.any(np.abs(masses - top_p) < tol) or near_tie)


@pytest.mark.parametrize("temperature", [0.0, 0.3, 1.0, 2.5])
@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9, 1.0])
# No subnormals: XLA flushes them to zero (so -1e-45 ties 0.0 for the argmax), numpy does not.
@given(logits=st.lists(st.floats(-4, 4, width=32, allow_subnormal=False), min_size=1, max_size=8))
def test_adjusted_probs_matches_numpy(logits, temperature, top_p):
    """Every (temperature, top_p) pair, filter off (top_p = 1) included, on random logits."""
    # Pad to one static shape with -inf (probability 0) so a single compilation serves all.
    padded = np.full((8,), -np.inf, np.float32)
    padded[: len(logits)] = logits
    # Only a cutoff that float32 rounding may move is left out (rare: see the docstring).
    assume(not cutoff_is_ambiguous(padded, temperature, top_p))
    got = np.asarray(adjusted_jit(padded, np.float32(temperature), np.float32(top_p)))
    want = np_adjusted(padded, temperature, top_p)
    np.testing.assert_array_equal(got > 0, want > 0)  # the same tokens kept
    np.testing.assert_allclose(got, want, atol=1e-5)
    np.testing.assert_allclose(got.sum(), 1.0, rtol=1e-5)


@pytest.mark.parametrize("top_p", [0.3, 0.9, 0.995])
def test_top_p_on_a_large_vocabulary(top_p):
    """The bisection cutoff equals the sorted cutoff where probabilities are tiny and many."""
    rng = np.random.default_rng(7)
    logits = (rng.normal(size=(4, 2000)) * 3).astype(np.float32)
    got = np.asarray(adjusted_jit(logits, np.float32(1.0), np.float32(top_p)))
    for r in range(4):
        want = np_adjusted(logits[r], 1.0, top_p)
        np.testing.assert_array_equal(got[r] > 0, want > 0)
        np.testing.assert_allclose(got[r], want, atol=1e-6)


def test_adjusted_probs_rejects_bad_parameters():
    with pytest.raises(ValueError, match="temperature"):
        V.adjusted_probs(np.zeros(3, np.float32), -0.5)
    with pytest.raises(ValueError, match="top_p"):
        V.adjusted_probs(np.zeros(3, np.float32), 1.0, 0.0)
    with pytest.raises(ValueError, match="top_p"):
        V.adjusted_probs(np.zeros(3, np.float32), 1.0, 1.5)
    with pytest.raises(ValueError, match="scalar"):
        V.adjusted_probs(np.zeros(3, np.float32), np.ones(2, np.float32))


# ------------------------------------------------------------------------------------------
# The statistical setting: a Markov teacher, a 2-level tree, two rounds when needed
# ------------------------------------------------------------------------------------------

VOCAB = 6
ROOT_TOKEN = 2
# Slots: root; 3 children (1-3); 2 grandchildren under each child (4-9); 2 padding (10-11).
PARENTS = np.asarray([0, 0, 0, 0, 1, 1, 2, 2, 3, 3, 0, 0], np.int32)
VALID = np.asarray([True] * 10 + [False] * 2)
CHILD_SLOTS = (1, 2, 3)
GRANDCHILD_SLOTS = ((4, 5), (6, 7), (8, 9))
_rng = np.random.default_rng(20240611)
TEACHER = jnp.asarray(_rng.normal(size=(VOCAB, VOCAB)) * 1.3, jnp.float32)  # logits | last
# The draft is a perturbed teacher, so it agrees often but not always.
DRAFT = jax.nn.softmax(
    TEACHER * 0.7 + jnp.asarray(_rng.normal(size=(VOCAB, VOCAB)), jnp.float32), axis=-1
)
SAMPLES = 40_000
PASS_P, CONTROL_P = 1e-3, 1e-9


def skeleton():
    return T.from_parents(PARENTS, valid=VALID, max_depth=2)


HOW = {"topk": 0, "wor": 1, "iid": 2}  # a traced code, so tree kinds share one compilation


def children_tokens(key, q, k, how, duplicate=False):
    """``k`` child tokens for draft row ``q``: top-k (optionally with a duplicate sibling),
    drawn without replacement (Gumbel-top-k, in draw order), or drawn i.i.d."""
    top = jnp.argsort(-q, stable=True)[:k].astype(jnp.int32)
    if duplicate:
        top = top.at[1].set(top[0])  # duplicate siblings: the second can never be accepted
    gumbel = jax.random.gumbel(key, q.shape, jnp.float32)
    without = jnp.argsort(-(jnp.log(q) + gumbel))[:k].astype(jnp.int32)
    iid = jax.random.categorical(key, jnp.log(q), shape=(k,)).astype(jnp.int32)
    return jnp.stack([top, without, iid])[how]


def build_tree(root_token, key, how):
    """Fill the skeleton's tokens from the draft; returns (tree, draft rows per slot)."""
    keys = jax.random.split(key, 4)
    tokens = jnp.zeros((PARENTS.shape[0],), jnp.int32).at[0].set(root_token)
    kids = children_tokens(keys[0], DRAFT[root_token], 3, how)
    tokens = tokens.at[jnp.asarray(CHILD_SLOTS)].set(kids)
    for i, (slot, grand) in enumerate(zip(CHILD_SLOTS, GRANDCHILD_SLOTS)):
        g = children_tokens(keys[i + 1], DRAFT[tokens[slot]], 2, how, duplicate=i == 0)
        tokens = tokens.at[jnp.asarray(grand)].set(g)
    tree = dataclasses.replace(skeleton(), tokens=tokens)
    return tree, DRAFT[tokens]


@functools.partial(jax.jit, static_argnames=("verify_with_q", "without_replacement"))
def one_round(root_tokens, keys, how, temperature, top_p, *, verify_with_q, without_replacement):
    """One verification round per (root token, key), vmapped; returns the Acceptance."""

    def single(root_token, key):
        kb, kv = jax.random.split(key)
        tree, rows = build_tree(root_token, kb, how)
        logits = TEACHER[tree.tokens]  # Markov teacher: row u depends on slot u's token
        return V.sample(
            tree,
            logits,
            kv,
            temperature=temperature,
            top_p=top_p,
            draft_probs=rows if verify_with_q else None,
            without_replacement=without_replacement,
        )

    return jax.vmap(single)(root_tokens, keys)


def simulate(seed, temperature, top_p, how, verify_with_q, without_replacement=True):
    """First two emitted tokens per sample: from round 1, or round 1's bonus + round 2."""
    keys = jax.random.split(jax.random.key(seed), (2, SAMPLES))
    kwargs = dict(
        how=jnp.int32(HOW[how]),
        temperature=jnp.float32(temperature),
        top_p=jnp.float32(top_p),
        verify_with_q=verify_with_q,
        without_replacement=without_replacement,
    )
    roots = jnp.full((SAMPLES,), ROOT_TOKEN, jnp.int32)
    first = one_round(roots, keys[0], **kwargs)
    second = one_round(first.tokens[:, 0], keys[1], **kwargs)  # same shapes: no recompile
    t2 = jnp.where(first.length >= 1, first.tokens[:, 1], second.tokens[:, 0])
    return np.asarray(first.tokens[:, 0]), np.asarray(t2), np.asarray(first.length)


def expected_joint(temperature, top_p):
    p = np.stack([np_adjusted(np.asarray(TEACHER[t]), temperature, top_p) for t in range(VOCAB)])
    return p[ROOT_TOKEN][:, None] * p  # P(t1 = a, t2 = b) = p(a | root) p(b | a)


def joint_p_value(t1, t2, expected):
    observed = np.zeros((VOCAB, VOCAB))
    np.add.at(observed, (np.asarray(t1), np.asarray(t2)), 1)
    n = observed.sum()
    exp = expected.ravel() * n
    obs = observed.ravel()
    # Cells the teacher forbids must stay empty; tiny cells are pooled so chi-square applies.
    assert obs[expected.ravel() == 0].sum() == 0
    small = exp < 5
    obs = np.append(obs[~small], obs[small].sum())
    exp = np.append(exp[~small], exp[small].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return chisquare(obs, exp).pvalue


def run(seed, temperature, top_p, how, verify_with_q, without_replacement=True):
    t1, t2, length = simulate(seed, temperature, top_p, how, verify_with_q, without_replacement)
    return joint_p_value(t1, t2, expected_joint(temperature, top_p)), length


CASES = [(1.0, 1.0), (0.7, 0.9), (1.6, 0.75)]


@pytest.mark.parametrize("temperature,top_p", CASES)
def test_deterministic_children_are_lossless(temperature, top_p):
    pvalue, length = run(1, temperature, top_p, "topk", verify_with_q=False)
    assert pvalue > PASS_P
    # The tree is really exercised: whole paths get accepted.
    assert np.mean(length == 2) > 0.05 and np.mean(length == 0) > 0.05


@pytest.mark.parametrize("temperature,top_p", CASES)
def test_sampled_children_without_replacement_are_lossless(temperature, top_p):
    pvalue, length = run(2, temperature, top_p, "wor", verify_with_q=True)
    assert pvalue > PASS_P
    assert np.mean(length == 2) > 0.05 and np.mean(length == 0) > 0.05


@pytest.mark.parametrize("temperature,top_p", CASES[:2])
@pytest.mark.parametrize("without_replacement", [False, True])
def test_sampled_children_iid_are_lossless(temperature, top_p, without_replacement):
    """I.i.d. children: the textbook rule is exact, and so is the without-replacement rule."""
    pvalue, _ = run(
        3, temperature, top_p, "iid", verify_with_q=True, without_replacement=without_replacement
    )
    assert pvalue > PASS_P


def test_match_rule_is_lossless_on_sampled_trees_too():
    pvalue, _ = run(4, 1.0, 1.0, "wor", verify_with_q=False)
    assert pvalue > PASS_P


def test_speculative_sampling_accepts_more_than_matching_on_sampled_trees():
    _, with_q = run(5, 1.0, 1.0, "wor", verify_with_q=True)
    _, matching = run(5, 1.0, 1.0, "wor", verify_with_q=False)
    assert with_q.mean() > matching.mean()


def test_negative_control_q_ratio_on_deterministic_children_is_detected():
    """min(1, p/q) on top-k children (the classic mistake) is biased: the test must see it."""
    pvalue, _ = run(1, 1.0, 1.0, "topk", verify_with_q=True)
    assert pvalue < CONTROL_P


def test_negative_control_iid_rule_on_children_drawn_without_replacement_is_detected():
    """Keeping q fixed when siblings are distinct by construction is biased."""
    pvalue, _ = run(2, 1.0, 1.0, "wor", verify_with_q=True, without_replacement=False)
    assert pvalue < CONTROL_P


def test_negative_control_argmax_matching_at_positive_temperature_is_detected():
    """Matching the teacher's argmax at T > 0 (not lossless) is detected too."""
    # Verify greedily, but compare with the T = 1 teacher.
    t1, t2, _ = simulate(6, 0.0, 1.0, "topk", verify_with_q=False)
    assert len(set(zip(np.asarray(t1).tolist(), np.asarray(t2).tolist()))) == 1
    assert joint_p_value(t1, t2, expected_joint(1.0, 1.0)) < CONTROL_P


# ------------------------------------------------------------------------------------------
# Exact properties
# ------------------------------------------------------------------------------------------


@jax.jit
def build(parents, tokens, valid):
    return T.from_parents(parents, tokens=tokens, valid=valid, max_depth=4)


def random_case(seed, n=12, vocab=5):
    rng = np.random.default_rng(seed)
    parents = [0] + [int(rng.integers(0, i)) for i in range(1, n)]
    valid = [True]
    for i in range(1, n):
        valid.append(valid[parents[i]] and rng.random() < 0.8)
    with mock.patch.dict(os.environ, {"EAGLEPANGU_MODE": "performance"}):  # trace once, here
        tree = build(
            np.asarray(parents, np.int32),
            rng.integers(0, vocab, n).astype(np.int32),
            np.asarray(valid),
        )
    logits = (rng.normal(size=(n, vocab)) * 2).astype(np.float32)
    q = rng.dirichlet(np.ones(vocab), size=n).astype(np.float32)
    return tree, logits, q


greedy_jit = jax.jit(V.greedy)


@pytest.mark.parametrize("use_q", [False, True])
def test_temperature_zero_equals_greedy(use_q):
    fn = jax.jit(
        lambda t, l, k, q: V.sample(t, l, k, temperature=0.0, draft_probs=q if use_q else None)
    )
    for seed in range(8):
        tree, logits, q = random_case(seed)
        want = greedy_jit(tree, logits)
        got = fn(tree, logits, jax.random.key(seed), q)
        np.testing.assert_array_equal(got.tokens, want.tokens)
        np.testing.assert_array_equal(got.path, want.path)


@pytest.mark.parametrize("use_q", [False, True])
def test_paths_are_consistent_and_padding_never_accepted(use_q):
    fn = jax.jit(
        jax.vmap(
            lambda t, l, k, q: V.sample(
                t, l, k, temperature=1.3, top_p=0.9, draft_probs=q if use_q else None
            )
        )
    )
    cases = [random_case(s) for s in range(6)]
    trees = jax.tree.map(lambda *xs: jnp.stack(xs), *[c[0] for c in cases])
    logits = np.stack([c[1] for c in cases])
    q = np.stack([c[2] for c in cases])
    for rep in range(20):
        keys = jax.random.split(jax.random.key(rep), len(cases))
        acc = fn(trees, logits, keys, q)
        for b, (tree, _, _) in enumerate(cases):
            length, path = int(acc.length[b]), np.asarray(acc.path[b])
            assert path[0] == 0 and np.all(path[length:] == path[length])
            assert all(bool(tree.valid[s]) for s in path)
            for d in range(1, length + 1):
                assert int(tree.parents[path[d]]) == path[d - 1]
                assert int(acc.tokens[b, d - 1]) == int(tree.tokens[path[d]])
            assert np.all(np.asarray(acc.tokens[b, length:]) == int(acc.next_token[b]))


@pytest.mark.parametrize("use_q", [False, True])
def test_vmap_equals_loop_and_no_recompilation(use_q):
    traces = []

    def counted(t, l, k, temperature, top_p, q):
        traces.append(1)
        return V.sample(
            t, l, k, temperature=temperature, top_p=top_p, draft_probs=q if use_q else None
        )

    fn = jax.jit(counted)
    batched = jax.jit(jax.vmap(counted))
    cases = [random_case(s) for s in range(4)]
    keys = jax.random.split(jax.random.key(0), len(cases))
    temps = np.asarray([0.0, 0.5, 1.0, 2.0], np.float32)
    tops = np.asarray([1.0, 0.9, 0.5, 1.0], np.float32)
    loop = [fn(c[0], c[1], k, t, p, c[2]) for c, k, t, p in zip(cases, keys, temps, tops)]
    stack = jax.tree.map(lambda *xs: jnp.stack(xs), *[c[0] for c in cases])
    out = batched(
        stack, np.stack([c[1] for c in cases]), keys, temps, tops, np.stack([c[2] for c in cases])
    )
    for b, one in enumerate(loop):
        np.testing.assert_array_equal(out.tokens[b], one.tokens)
        np.testing.assert_array_equal(out.path[b], one.path)
    assert len(traces) == 2  # one trace for the loop, one for the batch


@pytest.mark.parametrize("use_q", [False, True])
def test_nan_root_row_stops_safely(use_q, performance_mode):
    tree, logits, q = random_case(0)
    logits[0, 1] = np.nan
    fn = jax.jit(lambda t, l, k, q_: V.sample(t, l, k, draft_probs=q_ if use_q else None))
    for seed in range(5):
        acc = fn(tree, logits, jax.random.key(seed), q)
        assert int(acc.length) == 0 and not bool(acc.ok)
        assert int(acc.next_token) == int(np.nanargmax(logits[0]))


@pytest.mark.parametrize("use_q,expected", [(False, 0.3), (True, 0.5)])
def test_single_child_acceptance_rate(use_q, expected):
    """One child x with p(x) = 0.3: matching accepts with p(x), the ratio rule with
    min(1, p(x) / q(x)) = 0.3 / 0.6 when x was drawn from q."""
    tree = T.from_parents([0, 0], tokens=[0, 1], max_depth=1)
    logits = np.log(np.asarray([[0.5, 0.3, 0.2], [0.2, 0.3, 0.5]], np.float32))
    q = np.asarray([[0.2, 0.6, 0.2], [1 / 3, 1 / 3, 1 / 3]], np.float32)
    keys = jax.random.split(jax.random.key(11), 20_000)
    acc = jax.jit(jax.vmap(lambda k: V.sample(tree, logits, k, draft_probs=q if use_q else None)))(
        keys
    )
    rate = float(np.mean(np.asarray(acc.length)))
    assert abs(rate - expected) < 0.02  # binomial sd 0.0035
    first = np.bincount(np.asarray(acc.tokens[:, 0]), minlength=3)
    if use_q:
        # A fixed child is not a draw from q, so only the residual max(p - q, 0) = (0.3, 0, 0)
        # can follow a rejection: token 2 is never emitted (lossless only when x ~ q).
        assert first[2] == 0
    else:
        # Matching is lossless for any fixed tree: the first token follows p exactly.
        assert chisquare(first, np.asarray([0.5, 0.3, 0.2]) * len(keys)).pvalue > PASS_P


def test_reference_mode_raises_on_nan(reference_mode):
    tree, logits, q = random_case(0)
    slot = int(np.flatnonzero(np.asarray(tree.valid))[-1])  # a valid leaf-ish slot
    logits[slot, 0] = np.nan
    for draft in (None, q):
        with pytest.raises(V.DegenerateLogitsError, match=f"slot {slot}"):
            V.sample(tree, logits, jax.random.key(0), draft_probs=draft)
    checked = mode.checked(jax.jit(lambda t, l, k: V.sample(t, l, k, temperature=0.5)))
    with pytest.raises(Exception, match=f"slot {slot}"):
        checked(tree, logits, jax.random.key(0))


def test_sample_bad_input_raises():
    tree, logits, q = random_case(0)
    with pytest.raises(ValueError, match="draft_probs"):
        V.sample(tree, logits, jax.random.key(0), draft_probs=q[:3])
    with pytest.raises(ValueError, match="temperature"):
        V.sample(tree, logits, jax.random.key(0), temperature=-1.0)
