"""Greedy acceptance: literal cases, a naive-walk oracle, plain decoding, jit/vmap, bad input."""

import dataclasses
import functools
import os
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from eaglepangu_jax import mode
from eaglepangu_jax import tree as T
from eaglepangu_jax import verify as V

PERFORMANCE = {"EAGLEPANGU_MODE": "performance"}
greedy_jit = jax.jit(V.greedy)  # literal cases share a few shapes: compile once per shape


def row(vocab, **peaks):
    """A logits row of -1 with the given ``index=value`` peaks (``t3=2.0`` sets index 3)."""
    out = np.full((vocab,), -1.0, np.float32)
    for name, value in peaks.items():
        out[int(name[1:])] = value
    return out


@functools.cache
def five_slot_tree():
    """root -> 1 (tok 1) -> 3 (tok 3), 1 -> 4 (tok 3, duplicate), root -> 2 (tok 2), padding 5."""
    return T.from_parents(
        [0, 0, 0, 1, 1, 0],
        tokens=[5, 1, 2, 3, 3, 0],
        valid=[True, True, True, True, True, False],
        max_depth=3,
    )


def test_literal_acceptance():
    t = five_slot_tree()
    logits = np.stack([row(6, t1=3.0), row(6, t3=2.0), row(6), row(6, t4=5.0), row(6), row(6)])
    acc = greedy_jit(t, logits)
    assert int(acc.length) == 2
    np.testing.assert_array_equal(acc.path, [0, 1, 3, 3])  # slot 3, not its duplicate 4
    assert int(acc.next_token) == 4 and int(acc.stop) == 3
    np.testing.assert_array_equal(acc.tokens, [1, 3, 4, 4])
    np.testing.assert_array_equal(V.emitted_tokens(acc), [1, 3, 4])
    assert bool(acc.ok)
    for field in dataclasses.fields(acc):
        assert getattr(acc, field.name).dtype in (jnp.int32, jnp.bool_), field.name


def test_nothing_accepted_emits_the_root_argmax():
    t = five_slot_tree()
    logits = np.stack([row(6, t4=1.0)] + [row(6)] * 5)
    acc = greedy_jit(t, logits)
    assert int(acc.length) == 0 and int(acc.next_token) == 4
    np.testing.assert_array_equal(acc.path, [0, 0, 0, 0])
    np.testing.assert_array_equal(acc.tokens, [4, 4, 4, 4])


def test_padding_token_zero_is_never_matched():
    # The root's argmax is token 0 and padding slot 5 carries token 0: no match.
    t = five_slot_tree()
    logits = np.stack([row(6, t0=4.0)] + [row(6)] * 5)
    acc = greedy_jit(t, logits)
    assert int(acc.length) == 0 and int(acc.next_token) == 0
    # A *valid* node carrying token 0 is matched.
    t0 = T.from_parents([0, 0], tokens=[9, 0], max_depth=1)
    acc = greedy_jit(t0, np.stack([row(6, t0=4.0), row(6, t2=1.0)]))
    assert int(acc.length) == 1 and V.emitted_tokens(acc).tolist() == [0, 2]


def test_duplicate_siblings_take_the_lowest_slot():
    # Slots 1 and 2 both carry token 2; only slot 2 has a child that would match further.
    t = T.from_parents([0, 0, 0, 2], tokens=[7, 2, 2, 4], max_depth=2)
    logits = np.stack([row(6, t2=1.0), row(6, t5=1.0), row(6, t4=1.0), row(6)])
    acc = greedy_jit(t, logits)
    np.testing.assert_array_equal(acc.path, [0, 1, 1])
    assert V.emitted_tokens(acc).tolist() == [2, 5]


# ------------------------------------------------------------------------------------------
# Oracle
# ------------------------------------------------------------------------------------------


def naive_greedy(parents, valid, tokens, logits):
    """Walk the tree in plain Python; returns (path, bonus, ok)."""
    node, path = 0, [0]
    while True:
        r = logits[node]
        degenerate = np.isnan(r).any() or (r == np.inf).any() or (r == -np.inf).all()
        target = int(np.argmax(np.where(np.isnan(r), -np.inf, r)))
        if degenerate:
            return path, target, False
        nxt = next(
            (
                c
                for c in range(1, len(parents))
                if valid[c] and parents[c] == node and tokens[c] == target
            ),
            None,
        )
        if nxt is None:
            return path, target, True
        node = nxt
        path.append(node)


N_MAX, V_MAX = 10, 5


@jax.jit
def build_and_verify(parents, valid, tokens, logits):
    """One compiled shape for every hypothesis case (fixed N_MAX slots, V_MAX vocabulary)."""
    t = T.from_parents(parents, tokens=tokens, valid=valid, max_depth=N_MAX - 1)
    return V.greedy(t, logits)


@st.composite
def trees_and_logits(draw):
    """Valid random trees over a tiny vocabulary (many duplicate and 0 tokens), tied logits.

    The drawn tree fills the first ``n`` slots; the rest are padding carrying token 0, and
    logits columns past the drawn vocabulary are -inf, so every case has one static shape.
    """
    n = draw(st.integers(1, N_MAX))
    vocab = draw(st.integers(1, V_MAX))
    parents = [0] + [draw(st.integers(0, i - 1)) for i in range(1, n)] + [0] * (N_MAX - n)
    valid = [True]
    for i in range(1, N_MAX):
        valid.append(i < n and valid[parents[i]] and draw(st.booleans()))
    # Tokens may exceed the vocabulary: such nodes can never be matched.
    tokens = [draw(st.integers(0, vocab)) for _ in range(n)] + [0] * (N_MAX - n)
    values = st.sampled_from([-np.inf, -1.0, 0.0, 1.0, 2.0])
    logits = np.full((N_MAX, V_MAX), -np.inf, np.float32)
    for i in range(N_MAX):
        logits[i, :vocab] = [draw(values) for _ in range(vocab)]
        if draw(st.integers(0, 9)) == 0:  # occasionally a broken row
            logits[i, draw(st.integers(0, vocab - 1))] = draw(st.sampled_from([np.nan, np.inf]))
    return (np.asarray(parents, np.int32), np.asarray(valid), np.asarray(tokens, np.int32), logits)


@given(trees_and_logits())
def test_matches_naive_walk(case):
    parents, valid, tokens, logits = case
    max_depth = N_MAX - 1
    with mock.patch.dict(os.environ, PERFORMANCE):
        acc = build_and_verify(parents, valid, tokens, logits)
    path, bonus, ok = naive_greedy(parents, valid, tokens, logits)
    length = len(path) - 1
    assert int(acc.length) == length
    np.testing.assert_array_equal(acc.path, path + [path[-1]] * (max_depth + 1 - len(path)))
    assert int(acc.next_token) == bonus and bool(acc.ok) == ok
    expected = [int(tokens[s]) for s in path[1:]] + [bonus] * (max_depth + 1 - length)
    np.testing.assert_array_equal(acc.tokens, expected)
    assert all(valid[s] for s in path)


@jax.jit
def verify_chain(draft, logits):
    return V.greedy(T.chain(draft.shape[0], draft), logits)


def test_chain_equals_plain_argmax_decoding():
    """A Markov teacher: the emitted tokens are exactly plain greedy decoding's next tokens."""
    rng = np.random.default_rng(0)
    vocab, n = 7, 6
    table = rng.normal(size=(vocab, vocab)).astype(np.float32)
    for _ in range(30):
        start = int(rng.integers(vocab))
        truth = [start]
        for _ in range(n):
            truth.append(int(np.argmax(table[truth[-1]])))
        draft = [start] + [
            t if rng.random() < 0.75 else int(rng.integers(vocab)) for t in truth[1:n]
        ]
        acc = verify_chain(np.asarray(draft, np.int32), table[np.asarray(draft)])
        correct = 0
        while correct < n - 1 and draft[correct + 1] == truth[correct + 1]:
            correct += 1
        assert int(acc.length) == correct
        assert V.emitted_tokens(acc).tolist() == truth[1 : correct + 2]


# ------------------------------------------------------------------------------------------
# jit / vmap / recompilation
# ------------------------------------------------------------------------------------------


build_tree = jax.jit(
    lambda p, tok, val, max_depth: T.from_parents(p, tokens=tok, valid=val, max_depth=max_depth),
    static_argnames="max_depth",
)


def random_batch(seed, batch=6, n=9, vocab=4, max_depth=4):
    """Random trees of fixed shape whose logits often agree with the drafted tokens."""
    rng = np.random.default_rng(seed)
    trees, logits = [], []
    for _ in range(batch):
        parents = [0] + [int(rng.integers(0, i)) for i in range(1, n)]
        valid = [True]
        for i in range(1, n):
            valid.append(valid[parents[i]] and rng.random() < 0.85)
        tokens = rng.integers(0, vocab, size=n)
        with mock.patch.dict(os.environ, PERFORMANCE):
            trees.append(
                build_tree(
                    np.asarray(parents, np.int32),
                    tokens.astype(np.int32),
                    np.asarray(valid),
                    max_depth=max_depth,
                )
            )
        logits.append(rng.normal(size=(n, vocab)).astype(np.float32))
    return trees, np.stack(logits)


def test_jit_and_vmap_equal_eager():
    trees, logits = random_batch(1)
    eager = [V.greedy(t, l) for t, l in zip(trees, logits)]
    assert max(int(a.length) for a in eager) >= 1  # the batch exercises acceptance
    jitted = jax.jit(V.greedy)
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *trees)
    batched = jax.jit(jax.vmap(V.greedy))(stacked, logits)
    for b, (t, l, e) in enumerate(zip(trees, logits, eager)):
        j = jitted(t, l)
        for field in ("length", "path", "next_token", "tokens", "ok"):
            np.testing.assert_array_equal(getattr(j, field), getattr(e, field))
            np.testing.assert_array_equal(getattr(batched, field)[b], getattr(e, field))


def test_no_recompilation_when_values_change():
    traces = []

    def counted(tree, logits):
        traces.append(1)
        return V.greedy(tree, logits)

    fn = jax.jit(counted)
    for seed in range(3):
        trees, logits = random_batch(seed, batch=2)
        for t, l in zip(trees, logits):
            fn(t, l).length.block_until_ready()
    assert len(traces) == 1


# ------------------------------------------------------------------------------------------
# Degenerate rows, hostile trees, bad input
# ------------------------------------------------------------------------------------------


def test_nan_rows_stop_acceptance_in_performance_mode(performance_mode):
    t = five_slot_tree()
    good = np.stack([row(6, t1=3.0), row(6, t3=2.0), row(6), row(6, t4=5.0), row(6), row(6)])
    # NaN at the root: nothing accepted, a safe bonus, ok False.
    bad = good.copy()
    bad[0, 2] = np.nan
    acc = greedy_jit(t, bad)
    assert int(acc.length) == 0 and not bool(acc.ok)
    assert 0 <= int(acc.next_token) < 6
    # NaN at the stop node: the path is kept, the round is flagged.
    bad = good.copy()
    bad[3] = np.nan
    acc = greedy_jit(t, bad)
    assert int(acc.length) == 2 and not bool(acc.ok) and int(acc.next_token) == 0
    # NaN at a row the walk never reads changes nothing.
    bad = good.copy()
    bad[2] = np.nan
    acc = greedy_jit(t, bad)
    assert int(acc.length) == 2 and bool(acc.ok) and int(acc.next_token) == 4
    # All -inf is degenerate too.
    bad = good.copy()
    bad[1] = -np.inf
    acc = greedy_jit(t, bad)
    assert int(acc.length) == 1 and not bool(acc.ok)


def test_nan_rows_raise_in_reference_mode(reference_mode):
    t = five_slot_tree()
    logits = np.stack([row(6, t1=3.0), row(6), row(6), row(6), row(6), row(6)])
    logits[2, 1] = np.nan  # valid slot 2, even though the walk never reads it
    with pytest.raises(V.DegenerateLogitsError, match="slot 2"):
        V.greedy(t, logits)
    with pytest.raises(Exception, match="slot 2"):
        mode.checked(jax.jit(lambda tree, x: V.greedy(tree, x)))(t, logits)
    # A degenerate padding row is not an error.
    logits[2, 1] = 0.0
    logits[5] = np.nan
    assert int(mode.checked(jax.jit(lambda tree, x: V.greedy(tree, x)))(t, logits).length) == 1


def test_invalid_tree_raises_in_reference_mode(reference_mode):
    t = five_slot_tree()
    broken = dataclasses.replace(t, parents=t.parents.at[3].set(4))
    with pytest.raises(T.InvalidTreeError):
        V.greedy(broken, np.zeros((6, 6), np.float32))


def test_hostile_tree_stays_in_range(performance_mode):
    t = five_slot_tree()
    hostile = dataclasses.replace(
        t,
        parents=jnp.asarray([7, -3, 99, 1, 2**30, -1], jnp.int32),
        ancestors=jnp.full((6, 4), -5, jnp.int32).at[1].set(1000),
        depth=jnp.asarray([0, 9, -2, 1, 1, 3], jnp.int32),
    )
    rng = np.random.default_rng(3)
    fn = jax.jit(lambda tree, logits: V.greedy(tree, logits))  # fresh trace in this mode
    for _ in range(5):
        acc = fn(hostile, rng.normal(size=(6, 6)).astype(np.float32))
        assert 0 <= int(acc.length) <= 3
        assert np.all((np.asarray(acc.path) >= 0) & (np.asarray(acc.path) < 6))


def test_bad_shapes_raise():
    t = five_slot_tree()
    with pytest.raises(ValueError, match="shape"):
        V.greedy(t, np.zeros((5, 6), np.float32))
    with pytest.raises(ValueError, match="shape"):
        V.greedy(t, np.zeros((6,), np.float32))
    with pytest.raises(ValueError, match="floating"):
        V.greedy(t, np.zeros((6, 6), np.int32))
    acc = jax.vmap(V.greedy)(
        jax.tree.map(lambda x: jnp.stack([x, x]), t), np.zeros((2, 6, 6), np.float32)
    )
    with pytest.raises(ValueError, match="unbatched"):
        V.emitted_tokens(acc)
