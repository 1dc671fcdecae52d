"""Path scores, the acceptance surrogate and best-first trees: oracles, properties, jit/vmap."""

import functools
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from eaglepangu_jax import mode
from eaglepangu_jax import scoring as S
from eaglepangu_jax import tree as T

NAN, NEG_INF = float("nan"), float("-inf")
# One compiled program per (shape, budget, top_k), shared by all examples.
best_first = jax.jit(S.best_first, static_argnames=("budget", "top_k"))


# ------------------------------------------------------------------ oracles


def naive_path_logscores(parents, logprobs):
    out = [0.0]
    for i in range(1, len(parents)):
        p = parents[i]
        lp = NEG_INF if math.isnan(logprobs[i]) else float(logprobs[i])
        out.append(out[p] + lp if 0 <= p < i else NEG_INF)
    return np.asarray(out)


def oracle_best_first(lp, budget, top_k=None):
    """Every prefix over the top-K tokens, sorted by the tie rule, the first ``budget`` kept.

    The tie rule as a static key: ``key(P) = (-score, key(parent), rank)``; tuple comparison of
    the nested parent key orders equal scores by their parents' order, i.e. the parent's slot.
    Returns ``(tokens, parents, scores)`` per kept slot, root excluded.
    """
    lp = np.where(np.isnan(lp), -np.inf, np.minimum(lp, 0)).astype(np.float32)
    depth, vocab = lp.shape
    k = min(budget, vocab, top_k or budget)
    ranked = [sorted(range(vocab), key=lambda v, d=d: (-lp[d, v], v))[:k] for d in range(depth)]
    nodes = []  # (key, path of tokens, score)

    def grow(path, key, score):
        d = len(path)
        if d == depth:
            return
        for r, tok in enumerate(ranked[d]):
            s = np.float32(score + lp[d, tok])
            if s == -np.inf:
                continue
            child_key = (-s, key, r)
            nodes.append((child_key, path + (tok,), s))
            grow(path + (tok,), child_key, s)

    grow((), (), np.float32(0.0))
    nodes.sort(key=lambda n: n[0])
    kept = nodes[:budget]
    slot = {(): 0}
    tokens, parents, scores = [], [], []
    for i, (_, path, s) in enumerate(kept, start=1):
        assert path[:-1] in slot, "the oracle kept a node without its parent"
        slot[path] = i
        tokens.append(path[-1])
        parents.append(slot[path[:-1]])
        scores.append(s)
    return tokens, parents, scores


# ------------------------------------------------------------------ strategies

TIE_VALUES = st.sampled_from([0.0, -0.5, -1.0, -2.0, NEG_INF, NAN])
# XLA on CPU flushes subnormals to zero, numpy does not: keep them out of exact comparisons.
SMOOTH_VALUES = st.floats(-6.0, 0.0, allow_nan=False, allow_subnormal=False, width=32)


@st.composite
def marginals(draw, shapes=((1, 4), (3, 4), (2, 3))):
    d, v = draw(st.sampled_from(shapes))
    values = draw(
        st.sampled_from([TIE_VALUES, SMOOTH_VALUES, st.one_of(TIE_VALUES, SMOOTH_VALUES)])
    )
    return np.asarray(draw(st.lists(values, min_size=d * v, max_size=d * v)), np.float32).reshape(
        d, v
    )


# Few static budgets (each compiles once); smaller ones are reached through n_nodes.
BUDGETS = st.sampled_from([2, 90])


@st.composite
def parents_and_logprobs(draw, max_n=12):
    n = draw(st.integers(1, max_n))
    parents = [0] + [
        draw(st.one_of(st.integers(0, i - 1), st.integers(-3, n + 2))) for i in range(1, n)
    ]
    logprobs = draw(
        st.lists(
            st.one_of(st.floats(-5.0, 0.0, width=32), st.sampled_from([NAN, NEG_INF])),
            min_size=n,
            max_size=n,
        )
    )
    return np.asarray(parents, np.int32), np.asarray(logprobs, np.float32)


# ------------------------------------------------------------------ path scores, surrogate


def test_path_logscores_literal():
    # root -> 1 -> 3, root -> 2, 1 -> 4
    got = S.path_logscores([0, 0, 0, 1, 1], [5.0, -1.0, -2.0, -0.5, -0.25])
    np.testing.assert_allclose(got, [0.0, -1.0, -2.0, -1.5, -1.25])


@given(parents_and_logprobs())
def test_path_logscores_matches_naive_loop(data):
    parents, logprobs = data
    got = jax.jit(S.path_logscores)(parents, logprobs)
    want = naive_path_logscores(parents, logprobs)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def test_path_logscores_deep_chain():
    n = 130
    got = S.path_logscores(jnp.maximum(jnp.arange(n) - 1, 0), jnp.full((n,), -0.5))
    np.testing.assert_allclose(got, -0.5 * np.arange(n), rtol=1e-6)


def test_path_logscores_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="same length"):
        S.path_logscores([0, 0, 1], [0.0, -1.0])


def test_expected_accept_literal_tree():
    tree = T.from_parents(
        [0, 0, 0, 1, 1],
        valid=[True, True, True, True, False],
        logscore=np.log([7.0, 0.5, 0.25, 0.2, 0.1]).astype(np.float32),
        max_depth=2,
    )
    # Root counts 1 whatever its stored score; padding counts 0.
    np.testing.assert_allclose(S.expected_accept(tree), 1.0 + 0.5 + 0.25 + 0.2, rtol=1e-6)
    nan_tree = T.from_parents([0, 0], logscore=[0.0, NAN], max_depth=1)
    np.testing.assert_allclose(S.expected_accept(nan_tree), 1.0)


# ------------------------------------------------------------------ best-first trees


def test_best_first_literal():
    lp = np.log([[0.6, 0.3, 0.1], [0.5, 0.25, 0.25]]).astype(np.float32)
    t = S.best_first(lp, 7, budget=4)
    # 0.6 | 0.6*0.5=0.3 vs 0.3: the depth-1 node's parent (root, slot 0) comes first.
    np.testing.assert_array_equal(t.tokens, [7, 0, 1, 0, 1])
    np.testing.assert_array_equal(t.parents, [0, 0, 0, 1, 1])
    np.testing.assert_array_equal(t.depth, [0, 1, 1, 2, 2])
    np.testing.assert_allclose(np.exp(t.logscore), [1, 0.6, 0.3, 0.3, 0.15], rtol=1e-6)
    assert t.max_depth == 2 and t.num_slots == 5


def test_best_first_top1_is_greedy_chain():
    lp = np.log([[0.1, 0.9], [0.8, 0.2], [0.3, 0.7]]).astype(np.float32)
    t = best_first(lp, 0, budget=6, top_k=1)
    np.testing.assert_array_equal(t.tokens[:4], [0, 1, 0, 1])
    np.testing.assert_array_equal(t.parents[:4], [0, 0, 1, 2])
    np.testing.assert_array_equal(t.valid, [True] * 4 + [False] * 3)


def test_all_neg_inf_is_all_padding():
    t = S.best_first(np.full((2, 3), NEG_INF, np.float32), 5, budget=4)
    np.testing.assert_array_equal(t.valid, [True, False, False, False, False])
    np.testing.assert_array_equal(t.parents, 0)
    assert float(S.expected_accept(t)) == 1.0


@pytest.mark.parametrize("bad", [dict(budget=0), dict(budget=3, top_k=0)])
def test_best_first_rejects_bad_static_args(bad):
    with pytest.raises(ValueError):
        S.best_first(np.zeros((2, 3), np.float32), 0, **bad)


def test_best_first_rejects_bad_shape():
    with pytest.raises(ValueError, match=r"\[D, V\]"):
        S.best_first(np.zeros((3,), np.float32), 0, budget=2)


@given(marginals(), BUDGETS, st.sampled_from([None, 2]), st.integers(0, 90))
def test_best_first_matches_brute_force_oracle(lp, budget, top_k, n_nodes):
    n_nodes = min(n_nodes, budget)
    t = best_first(lp, 9, budget=budget, top_k=top_k, n_nodes=jnp.int32(n_nodes))
    tokens, parents, scores = oracle_best_first(lp, n_nodes, top_k)
    m = len(tokens)
    valid = np.asarray(t.valid)
    np.testing.assert_array_equal(valid[1:], [True] * m + [False] * (budget - m))
    np.testing.assert_array_equal(np.asarray(t.tokens)[1 : m + 1], tokens)
    np.testing.assert_array_equal(np.asarray(t.parents)[1 : m + 1], parents)
    np.testing.assert_array_equal(np.asarray(t.logscore)[1 : m + 1], np.asarray(scores, np.float32))


@given(marginals(shapes=((3, 4), (4, 3))), st.sampled_from([1, 2]))
def test_a_tree_of_budget_nodes_reads_no_marginal_deeper_than_its_budget(lp, budget):
    """A node enters only with its parent, so ``budget`` nodes reach depth ``budget`` at most:
    the marginals below it change nothing (why a drafter's default depth is cut to its
    default budget, methods.make_method)."""
    deep = best_first(lp, 9, budget=budget)
    cut = best_first(lp[:budget], 9, budget=budget)
    for field in ("tokens", "parents", "valid", "depth", "logscore"):
        np.testing.assert_array_equal(
            np.asarray(getattr(cut, field)), np.asarray(getattr(deep, field))
        )
    assert int(np.max(np.asarray(deep.depth))) <= budget


@given(st.integers(0, 2**32 - 1), st.integers(1, 30))
def test_distinct_scores_give_exactly_the_top_budget_prefixes(seed, n):
    # Continuous marginals: no ties, so "top n prefixes" needs no tie rule at all.
    rng = np.random.default_rng(seed)
    lp = np.asarray(jax.nn.log_softmax(rng.normal(size=(3, 4)) * 2, axis=-1), np.float32)
    t = best_first(lp, 0, budget=30, n_nodes=jnp.int32(n))
    every = {}
    for d in range(1, 4):
        for path in itertools.product(range(4), repeat=d):
            every[path] = sum(np.float64(lp[k, x]) for k, x in enumerate(path))
    want = sorted(every, key=every.get, reverse=True)[:n]
    got = [
        tuple(int(t.tokens[a]) for a in t.ancestors[i, 1 : int(t.depth[i]) + 1])
        for i in range(1, n + 1)
    ]
    assert set(got) == set(want)
    assert int(t.valid.sum()) == n + 1
    np.testing.assert_allclose(
        np.asarray(t.logscore)[1 : n + 1], [every[p] for p in got], rtol=1e-5
    )


@given(marginals(), BUDGETS)
def test_best_first_properties(lp, budget):
    t = best_first(lp, 3, budget=budget)
    for name, ok in jax.jit(T.check)(t).items():
        assert bool(jnp.all(ok)), name
    valid = np.asarray(t.valid)
    m = int(valid.sum()) - 1
    assert valid[: m + 1].all() and not valid[m + 1 :].any()  # padding only at the tail
    score = np.asarray(t.logscore)[: m + 1]
    assert np.all(np.diff(score) <= 0), "scores must not increase with the slot"
    clean = np.where(np.isnan(lp), -np.inf, np.minimum(lp, 0)).astype(np.float32)
    for i in range(1, m + 1):
        p, d, tok = int(t.parents[i]), int(t.depth[i]), int(t.tokens[i])
        assert np.isfinite(score[i])
        assert score[i] == np.float32(score[p] + clean[d - 1, tok])
    # Path tokens are distinct across nodes: no prefix appears twice.
    paths = {
        tuple(int(t.tokens[a]) for a in t.ancestors[i, 1 : int(t.depth[i]) + 1])
        for i in range(1, m + 1)
    }
    assert len(paths) == m


@jax.jit
def accept_by_budget(lp, n_nodes):
    """A(n) for every n at once: one best-first tree per dynamic node count."""
    return jax.vmap(lambda n: S.expected_accept(S.best_first(lp, 0, budget=40, n_nodes=n)))(n_nodes)


@given(marginals(shapes=((3, 4), (2, 3))))
def test_expected_accept_is_concave_in_budget(lp):
    budget = 40
    values = np.asarray(accept_by_budget(lp, jnp.arange(budget + 1, dtype=jnp.int32)))
    steps = np.diff(values)
    assert np.all(steps >= 0)
    assert np.all(np.diff(steps) <= 1e-6), "increments of A must not increase"
    # n_nodes truncates the full tree: same slots, tail padded.
    full = best_first(lp, 0, budget=budget)
    part = best_first(lp, 0, budget=budget, n_nodes=jnp.int32(7))
    np.testing.assert_array_equal(part.valid, np.asarray(full.valid) & (np.arange(budget + 1) <= 7))


def test_n_nodes_is_clipped():
    lp = np.log(np.full((2, 2), 0.5, np.float32))
    assert int(best_first(lp, 0, budget=3, n_nodes=jnp.int32(-5)).valid.sum()) == 1
    assert int(best_first(lp, 0, budget=3, n_nodes=jnp.int32(99)).valid.sum()) == 4


def test_vmap_over_a_batch_matches_single_calls():
    rng = np.random.default_rng(0)
    lp = np.array(jax.nn.log_softmax(rng.normal(size=(5, 3, 6)), axis=-1), np.float32)
    lp[1, 1] = NAN
    roots = jnp.arange(5, dtype=jnp.int32)
    n_nodes = jnp.asarray([8, 3, 0, 8, 5], jnp.int32)
    batched = jax.jit(jax.vmap(functools.partial(S.best_first, budget=8)))(
        lp, roots, n_nodes=n_nodes
    )
    for b in range(5):
        single = best_first(lp[b], roots[b], budget=8, n_nodes=n_nodes[b])
        for got, want in zip(jax.tree.leaves(batched), jax.tree.leaves(single)):
            np.testing.assert_array_equal(got[b], want)


def test_no_recompile_when_only_values_change():
    traces = []

    def build(lp, root, n):
        traces.append(1)
        return S.best_first(lp, root, budget=6, n_nodes=n)

    fn = jax.jit(build)
    rng = np.random.default_rng(1)
    for n in range(4):
        lp = np.asarray(rng.normal(size=(3, 5)), np.float32)
        fn(lp, jnp.int32(n), jnp.int32(n)).valid.block_until_ready()
    assert len(traces) == 1


def test_reference_mode_builds_checked_trees(reference_mode):
    lp = np.log([[0.5, 0.5], [0.9, 0.1]]).astype(np.float32)
    eager = S.best_first(lp, 1, budget=5)
    jitted = mode.checked(jax.jit(functools.partial(S.best_first, budget=5)))(lp, 1)
    for got, want in zip(jax.tree.leaves(jitted), jax.tree.leaves(eager)):
        np.testing.assert_array_equal(got, want)
    T.assert_valid(eager)
