"""N-gram (prompt-lookup) drafter: literal trees, committed-only reads, properties, jit/vmap."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from eaglepangu_jax import tree as T
from eaglepangu_jax.drafters import DRAFTERS, NGramDrafter, make_drafter
from eaglepangu_jax.drafters.ngram import find_candidates, match_lengths
from eaglepangu_jax.engine.drafter import DraftContext

SENTINEL = 999
KEY = jax.random.key(0)


def context(tokens, num_tokens, capacity=None, start=0):
    tokens = list(tokens) + [SENTINEL] * ((capacity or len(tokens)) - len(tokens))
    return DraftContext(
        tokens=jnp.asarray(tokens, jnp.int32),
        num_tokens=jnp.asarray(num_tokens, jnp.int32),
        features=jnp.zeros((1, 1, 4), jnp.float32),
        num_features=jnp.asarray(0, jnp.int32),
        start=jnp.asarray(start, jnp.int32),
    )


def node_paths(tree):
    """{slot: token path from the root's child down to the slot} for valid non-root slots."""
    out = {}
    for i in range(1, tree.num_slots):
        if bool(tree.valid[i]):
            d = int(tree.depth[i])
            out[i] = [int(tree.tokens[a]) for a in np.asarray(tree.ancestors[i, 1 : d + 1])]
    return out


def test_two_repeats_of_a_bigram():
    # a b c d x b c e y b c: the suffix "b c" occurred at end positions 6 and 2.
    a, b, c, d, x, e, y = 10, 2, 3, 4, 11, 5, 12
    buf = [a, b, c, d, x, b, c, e, y, b, c]
    drafter = NGramDrafter(depth=3, budget=6, continue_prob=1.0)
    tree = drafter.propose(None, None, context(buf, 11, capacity=16), KEY).tree
    np.testing.assert_array_equal(tree.tokens, [c, e, y, b, d, x, b])
    np.testing.assert_array_equal(tree.parents, [0, 0, 1, 2, 0, 4, 5])
    assert bool(jnp.all(tree.valid))
    # Two equally long matches: each path carries half the weight.
    np.testing.assert_allclose(tree.logscore, [0.0] + [np.log(0.5)] * 6, rtol=1e-6)
    # By default each depth past the first multiplies by continue_prob (0.8).
    decayed = dataclasses.replace(drafter, continue_prob=0.8)
    tree = decayed.propose(None, None, context(buf, 11, capacity=16), KEY).tree
    half, q = np.log(0.5), np.log(0.8)
    np.testing.assert_allclose(
        tree.logscore, [0.0, half, half + q, half + 2 * q, half, half + q, half + 2 * q], rtol=1e-6
    )


def test_longer_match_first_and_continuation_stops_at_root():
    # 1 2 3 1 2 3 1 2: "3 1 2" ends at 4 (length 3), "1 2" ends at 1 (length 2). The first
    # continuation reaches the root after 3 tokens; the second is cut at depth 4.
    drafter = NGramDrafter(depth=4, budget=6, length_weight=2.0, continue_prob=1.0)
    tree = drafter.tree(jnp.asarray([1, 2, 3, 1, 2, 3, 1, 2, SENTINEL, SENTINEL]), 8)
    paths, path_len, match_len = find_candidates(
        jnp.asarray([1, 2, 3, 1, 2, 3, 1, 2]), 8, min_ngram=1, max_ngram=3, num_matches=3, depth=4
    )
    np.testing.assert_array_equal(paths, [[3, 1, 2, 0], [3, 1, 2, 3], [0, 0, 0, 0]])
    np.testing.assert_array_equal(path_len, [3, 4, 0])
    np.testing.assert_array_equal(match_len, [3, 2, 0])
    np.testing.assert_array_equal(tree.tokens[:5], [2, 3, 1, 2, 3])
    np.testing.assert_array_equal(tree.parents[:5], [0, 0, 1, 2, 3])
    np.testing.assert_array_equal(tree.valid, [True] * 5 + [False] * 2)
    # Weights 2**2 (length 3) and 2**1 (length 2): the last node only has the second path.
    np.testing.assert_allclose(tree.logscore[:5], [0, 0, 0, 0, np.log(2 / 6)], atol=1e-6)


def test_min_ngram_filters_short_matches():
    tree = NGramDrafter(min_ngram=3, depth=4, budget=6).tree(
        jnp.asarray([1, 2, 3, 1, 2, 3, 1, 2]), 8
    )
    assert node_paths(tree) == {1: [3], 2: [3, 1], 3: [3, 1, 2]}


def test_match_lengths_literal():
    # Committed suffix "8 7 8" (positions 7..9); the root itself and the tail never count.
    got = match_lengths(jnp.asarray([8, 7, 8, 6, 8, 0, 7, 8, 7, 8, 5]), 10, 3)
    np.testing.assert_array_equal(got, [1, 0, 3, 0, 1, 0, 0, 2, 0, 0, 0])


def test_no_match_gives_root_only_tree():
    tree = NGramDrafter(budget=5).tree(jnp.asarray([1, 2, 3, 4, 5, 6, 1, 2]), 6)
    assert int(tree.tokens[0]) == 6
    assert not bool(jnp.any(tree.valid[1:]))
    assert bool(T.is_valid(tree))


@pytest.mark.parametrize("num_tokens", [0, 1])
def test_tiny_buffers_give_root_only_tree(num_tokens):
    tree = NGramDrafter().tree(jnp.asarray([4, 4, 4, 4]), num_tokens)
    assert not bool(jnp.any(tree.valid[1:]))
    assert bool(T.is_valid(tree))


def test_never_reads_uncommitted_entries():
    # The committed suffix "1 2" matches at end position 2, whose continuation would run past
    # the root into sentinels; the uncommitted tail also holds "1 2" followed by sentinels.
    committed = [7, 1, 2, 3, 4, 1, 2]
    buf = committed + [SENTINEL, 1, 2, SENTINEL, SENTINEL, 1, 2, SENTINEL, SENTINEL]
    tree = NGramDrafter(depth=8, num_matches=8, budget=20).tree(jnp.asarray(buf), 7)
    tokens = np.asarray(tree.tokens)[np.asarray(tree.valid)]
    assert SENTINEL not in tokens
    assert node_paths(tree) == {1: [3], 2: [3, 4], 3: [3, 4, 1], 4: [3, 4, 1, 2]}


def test_start_hides_earlier_tokens():
    # a b c d x b c e y b c with start = 1: the occurrence ending at 2 is still visible
    # ("b c" starts at 1), with start = 2 only its "c" is, and with start = 3 it is gone.
    buf = [10, 2, 3, 4, 11, 2, 3, 5, 12, 2, 3]
    drafter = NGramDrafter(depth=3, budget=6)
    paths = lambda start: sorted(
        map(
            tuple,
            node_paths(
                drafter.propose(None, None, context(buf, 11, start=start), KEY).tree
            ).values(),
        )
    )
    both = [(4,), (4, 11), (4, 11, 2), (5,), (5, 12), (5, 12, 2)]
    assert paths(1) == both
    _, _, match_len = find_candidates(
        jnp.asarray(buf), 11, 2, min_ngram=1, max_ngram=3, num_matches=2, depth=3
    )
    np.testing.assert_array_equal(match_len, [2, 1])
    assert paths(3) == [(5,), (5, 12), (5, 12, 2)]
    assert paths(7) == []


def test_repeated_token_run():
    # 5 5 5 5: suffix matches at every earlier position; continuations end at the root.
    tree = NGramDrafter(depth=4, budget=8).tree(jnp.asarray([5, 5, 5, 5, 0, 0]), 4)
    assert set(map(tuple, node_paths(tree).values())) == {(5,), (5, 5), (5, 5, 5)}


def test_registry():
    assert DRAFTERS["ngram"] is NGramDrafter
    d = make_drafter("ngram", depth=5)
    assert d == NGramDrafter(depth=5) and hash(d) == hash(NGramDrafter(depth=5))
    assert d.max_depth == 5 and d.feature_layers == () and d.name == "ngram"
    with pytest.raises(ValueError, match="known drafters.*ngram"):
        make_drafter("medusa")
    with pytest.raises(ValueError, match="no hyper-parameter"):
        make_drafter("ngram", depht=5)
    with pytest.raises(ValueError, match="min_ngram"):
        NGramDrafter(min_ngram=4, max_ngram=3)
    with pytest.raises(ValueError, match="budget"):
        NGramDrafter(budget=0)
    for bad in (0.0, 1.5, float("nan")):
        with pytest.raises(ValueError, match="continue_prob"):
            NGramDrafter(continue_prob=bad)


def test_state_is_passed_through():
    d = NGramDrafter()
    ctx = context([1, 2, 1], 3)
    state = d.init_state(None, ctx)
    assert jax.tree_util.tree_leaves(state) == []
    assert d.update(None, state, ctx) is state


# --- properties --------------------------------------------------------------------------

CAPACITY = 24
PROP = NGramDrafter(max_ngram=3, min_ngram=1, depth=5, num_matches=6, budget=12)
_propose = jax.jit(lambda ctx: PROP.propose(None, None, ctx, KEY).tree)
_candidates = jax.jit(
    lambda tok, n, start: find_candidates(
        tok,
        n,
        start,
        min_ngram=PROP.min_ngram,
        max_ngram=PROP.max_ngram,
        num_matches=PROP.num_matches,
        depth=PROP.depth,
    )
)


def naive_candidates(buf, n_tok, drafter, start=0):
    """Plain-Python reference: (match_len, end) best first, with their continuations."""
    found = []
    for j in range(start, n_tok - 1):
        n = 0
        while n < drafter.max_ngram and j - n >= start and buf[j - n] == buf[n_tok - 1 - n]:
            n += 1
        if n >= drafter.min_ngram:
            found.append((n, j))
    found.sort(reverse=True)
    return [
        (n, buf[j + 1 : min(j + 1 + drafter.depth, n_tok)]) for n, j in found[: drafter.num_matches]
    ]


def occurs_after_suffix(path, buf, n_tok, drafter, start):
    """True if ``path`` follows an earlier visible occurrence of the committed suffix."""
    for j in range(n_tok - 1):
        if j + len(path) > n_tok - 1 or buf[j + 1 : j + 1 + len(path)] != path:
            continue
        n = drafter.min_ngram
        if j - n + 1 >= start and buf[j - n + 1 : j + 1] == buf[n_tok - n : n_tok]:
            return True
    return False


buffers = st.tuples(
    st.lists(st.integers(0, 3), min_size=CAPACITY, max_size=CAPACITY),
    st.integers(0, CAPACITY),
    st.sampled_from([0, 0, 0, 3, 10]),
)


@given(buffers)
def test_property_tree_valid_and_paths_come_from_the_buffer(case):
    buf, n_tok, start = case
    tree = _propose(context(buf, n_tok, start=start))
    assert bool(T.is_valid(tree))
    committed = buf[:n_tok]
    for path in node_paths(tree).values():
        assert occurs_after_suffix(path, committed, n_tok, PROP, start), (path, committed)
    # Logscores never rise along a path (a child's paths are a subset of its parent's).
    valid = np.asarray(tree.valid)
    score, parent_score = np.asarray(tree.logscore), np.asarray(tree.logscore)[tree.parents]
    assert np.all(score[valid] <= parent_score[valid] + 1e-6)
    # Something matched <=> the tree is non-empty (budget >= 1).
    expected = naive_candidates(committed, n_tok, PROP, start)
    assert bool(np.any(valid[1:])) == bool(expected)


@given(buffers)
def test_property_candidates_equal_naive_search(case):
    buf, n_tok, start = case
    paths, path_len, match_len = _candidates(jnp.asarray(buf, jnp.int32), n_tok, start)
    expected = naive_candidates(buf[:n_tok], n_tok, PROP, start)
    got = [
        (int(m), [int(t) for t in p[:k]])
        for m, p, k in zip(match_len, np.asarray(paths), path_len)
        if int(k) > 0
    ]
    assert got == expected


def test_jit_vmap_and_no_recompile():
    traces = []

    def propose(ctx):
        traces.append(1)
        return PROP.propose(None, None, ctx, KEY).tree

    jitted = jax.jit(propose)
    rng = np.random.default_rng(0)
    bufs = rng.integers(0, 3, size=(4, CAPACITY))
    lens = np.asarray([0, 5, 17, CAPACITY])
    batch = DraftContext(
        tokens=jnp.asarray(bufs, jnp.int32),
        num_tokens=jnp.asarray(lens, jnp.int32),
        features=jnp.zeros((4, 1, 1, 4), jnp.float32),
        num_features=jnp.zeros((4,), jnp.int32),
        start=jnp.asarray([0, 0, 4, 2], jnp.int32),
    )
    batched = jax.jit(jax.vmap(propose))(batch)
    for b in range(4):
        single = jitted(context(bufs[b], lens[b], start=int(batch.start[b])))
        for got, want in zip(jax.tree_util.tree_leaves(single), jax.tree_util.tree_leaves(batched)):
            np.testing.assert_array_equal(got, want[b])
    # One trace for the vmapped function, one for the single one: new num_tokens, start and
    # token values reuse the compiled function.
    assert len(traces) == 2
