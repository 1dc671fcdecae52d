"""Tree tensor semantics: literal cases, property tests, hostile input, jit/vmap behaviour."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from test_tree_validator import Fields, first_violation, validate

from eaglepangu_jax import tree as T

INT32 = st.integers(min_value=-(2**31), max_value=2**31 - 1)


@st.composite
def valid_parents(draw, max_n=12):
    """Random topologically ordered parent arrays (0 <= p < i), with a valid-closed mask.

    Always ``max_n`` slots (a fixed shape compiles once); the tail may be padding.
    """
    n = max_n
    parents = [0] + [draw(st.integers(0, i - 1)) for i in range(1, n)]
    valid = [True]
    for i in range(1, n):
        valid.append(valid[parents[i]] and draw(st.booleans()))
    return np.asarray(parents, np.int32), np.asarray(valid)


def naive_depths(parents):
    depth = [0]
    for i in range(1, len(parents)):
        depth.append(depth[parents[i]] + 1)
    return depth


def test_literal_five_slot_tree():
    t = T.from_parents([0, 0, 0, 1, 1], tokens=[5, 6, 7, 8, 9], max_depth=2)
    np.testing.assert_array_equal(t.depth, [0, 1, 1, 2, 2])
    np.testing.assert_array_equal(
        t.ancestors, [[0, 0, 0], [0, 1, 1], [0, 2, 2], [0, 1, 3], [0, 1, 4]]
    )
    np.testing.assert_array_equal(T.positions(t, 10), [10, 11, 11, 12, 12])
    np.testing.assert_array_equal(T.path_to(t, 4), [0, 1, 4])
    assert bool(T.is_valid(t))
    assert t.num_slots == 5 and t.max_depth == 2


def test_chain_and_choices():
    c = T.chain(4, tokens=[1, 2, 3, 4])
    np.testing.assert_array_equal(c.parents, [0, 0, 1, 2])
    np.testing.assert_array_equal(c.ancestors[3], [0, 1, 2, 3])
    tr, rank = T.from_choices([[0, 0], [1], [0], [0, 1]])
    np.testing.assert_array_equal(tr.parents, [0, 0, 0, 1, 1])
    np.testing.assert_array_equal(rank, [0, 0, 1, 0, 1])
    # Missing prefixes are added.
    tr, _ = T.from_choices([[2, 0]])
    np.testing.assert_array_equal(tr.parents, [0, 0, 1])
    with pytest.raises(ValueError, match="negative rank"):
        T.from_choices([[0, -1]])


_from_parents_jit = jax.jit(T.from_parents, static_argnames="max_depth")
_check_jit = jax.jit(T.check)
_is_valid_jit = jax.jit(T.is_valid)


@given(valid_parents(), st.sampled_from([1, 3, 12]))
def test_property_invariants_hold(data, max_depth):
    parents, valid = data
    t = _from_parents_jit(parents, valid=valid, max_depth=max_depth)
    results = _check_jit(t)
    for name, ok in results.items():
        assert bool(jnp.all(ok)), name
    depth = naive_depths(parents)
    for i in range(len(parents)):
        if t.valid[i]:
            assert int(t.depth[i]) == depth[i] <= max_depth
            # Ancestor column d is the d-th node on the root path.
            node, path = i, [i]
            while node:
                node = parents[node]
                path.append(node)
            np.testing.assert_array_equal(t.ancestors[i, : depth[i] + 1], path[::-1])
        # A node is kept exactly when it and all its ancestors were valid and shallow enough.
        expected = bool(valid[i]) and depth[i] <= max_depth
        node = i
        while node:
            node = parents[node]
            expected = expected and bool(valid[node])
        assert bool(t.valid[i]) == expected


@given(
    st.lists(INT32, min_size=10, max_size=10),
    st.lists(st.booleans(), min_size=10, max_size=10),
    st.sampled_from([1, 6]),
)
def test_performance_mode_repairs_any_int32_input(performance_mode, raw, valid, max_depth):
    parents = np.asarray(raw, np.int64).astype(np.int32)
    t = _from_parents_jit(parents, valid=np.asarray(valid), max_depth=max_depth)
    n = len(raw)
    for field in (t.parents, t.depth, t.ancestors):
        assert int(jnp.min(field)) >= 0 and int(jnp.max(field)) < max(n, max_depth + 1)
    assert int(jnp.max(t.parents)) < n and int(jnp.max(t.ancestors)) < n
    assert bool(_is_valid_jit(t))
    # The independent validator agrees the repaired tree is sound.
    repaired = Fields(
        *(np.asarray(getattr(t, name)) for name in ("parents", "valid", "depth", "ancestors"))
    )
    assert first_violation(repaired) is None


# Any int32, with the small values that make some fields (not all) index in range.
GARBAGE = st.one_of(st.integers(-1, 8), INT32)


@given(st.lists(GARBAGE, min_size=8, max_size=8), st.lists(GARBAGE, min_size=8, max_size=8))
def test_check_never_fails_on_garbage(parents, depth):
    """check runs under jit on any int32 fields, and its verdict is the validator's."""
    n = len(parents)
    garbage = Fields(
        parents=np.asarray(parents, np.int32),
        valid=np.ones((n,), bool),
        depth=np.asarray(depth, np.int32),
        ancestors=np.resize(np.asarray(depth, np.int32), (n, 3)),
    )
    t = T.Tree(
        tokens=jnp.zeros((n,), jnp.int32),
        parents=jnp.asarray(garbage.parents),
        valid=jnp.asarray(garbage.valid),
        depth=jnp.asarray(garbage.depth),
        ancestors=jnp.asarray(garbage.ancestors),
        logscore=jnp.zeros((n,), jnp.float32),
    )
    results = {k: np.asarray(v) for k, v in _check_jit(t).items()}  # must not crash
    assert set(results) == set(T.INVARIANTS)
    assert all(v.shape == (n,) and v.dtype == bool for v in results.values())
    # Per slot, the invariants that need no convention for broken input match exactly; and
    # check names the same first broken (invariant, node) as the independent validator.
    expected = validate(garbage)
    for name in ("root_ok", "in_range"):
        np.testing.assert_array_equal(results[name], expected[name], name)
    broken = [(k, int(np.argmin(results[k]))) for k in T.INVARIANTS if not results[k].all()]
    assert (broken[0] if broken else None) == first_violation(garbage)


@pytest.mark.parametrize(
    "parents,valid,max_depth,invariant",
    [
        ([0, 0, 2], None, 3, "topological"),  # parent == own index
        ([0, 0, 5], None, 3, "in_range"),  # out of range
        ([0, -1, 0], None, 3, "in_range"),  # negative sentinel
        ([0, 2, 1], None, 3, "topological"),  # a cycle 1 <-> 2
        ([0, 0, 1], [True, False, True], 3, "valid_closure"),
        ([0, 0, 1, 2, 3], None, 3, "depth_consistent"),  # depth 4 > max_depth 3
        ([1, 0, 0], None, 3, "root_ok"),
    ],
)
def test_reference_mode_names_the_broken_invariant(
    reference_mode, parents, valid, max_depth, invariant
):
    with pytest.raises(T.InvalidTreeError, match=f"'{invariant}' broken at node"):
        T.from_parents(parents, valid=valid, max_depth=max_depth)
    # The same check inside jit raises through checkify.
    jitted = T.mode.checked(jax.jit(lambda p: T.from_parents(p, valid=valid, max_depth=max_depth)))
    with pytest.raises(Exception, match=f"'{invariant}' broken at node"):
        jitted(jnp.asarray(parents, jnp.int32))


def test_assert_valid_on_hand_built_cycle():
    t = T.from_parents([0, 0, 1], max_depth=2)
    cyclic = T.Tree(
        tokens=t.tokens,
        parents=jnp.asarray([0, 2, 1], jnp.int32),
        valid=t.valid,
        depth=t.depth,
        ancestors=t.ancestors,
        logscore=t.logscore,
    )
    assert not bool(jnp.all(T.check(cyclic)["acyclic"]))
    with pytest.raises(T.InvalidTreeError, match="broken at node 1"):
        T.assert_valid(cyclic)


def test_performance_mode_turns_bad_nodes_into_padding(performance_mode):
    t = T.from_parents([0, 3, 0, -5, 1, 2], max_depth=2)
    np.testing.assert_array_equal(t.valid, [True, False, True, False, False, True])
    np.testing.assert_array_equal(t.parents, [0, 0, 0, 0, 0, 2])
    assert float(t.logscore[1]) == -np.inf


def test_jit_vmap_and_no_recompile():
    traces = []

    def build(parents, valid):
        traces.append(1)
        return T.from_parents(parents, valid=valid, max_depth=4)

    fn = jax.jit(build)
    a = fn(jnp.asarray([0, 0, 1, 2], jnp.int32), jnp.ones((4,), bool))
    b = fn(jnp.asarray([0, 0, 0, 1], jnp.int32), jnp.asarray([True, True, False, True]))
    assert len(traces) == 1
    eager = T.from_parents([0, 0, 0, 1], valid=[True, True, False, True], max_depth=4)
    for x, y in zip(jax.tree_util.tree_leaves(b), jax.tree_util.tree_leaves(eager)):
        np.testing.assert_array_equal(x, y)
    batch = jax.vmap(build)(
        jnp.asarray([[0, 0, 1, 2], [0, 0, 0, 1]], jnp.int32), jnp.ones((2, 4), bool)
    )
    np.testing.assert_array_equal(batch.depth, [[0, 1, 2, 3], [0, 1, 1, 2]])
    np.testing.assert_array_equal(batch.depth[0], a.depth)
    assert bool(jnp.all(jax.vmap(T.is_valid)(batch)))


def test_bad_shapes_are_named():
    with pytest.raises(ValueError, match="tokens has shape"):
        T.from_parents([0, 0], tokens=[1, 2, 3], max_depth=1)
    with pytest.raises(ValueError, match="max_depth"):
        T.from_parents([0, 0], max_depth=0)
    with pytest.raises(ValueError, match="at least the root"):
        T.chain(0)


_from_paths_jit = jax.jit(T.from_paths, static_argnames="budget")


@st.composite
def candidate_paths(draw):
    m, d = 5, 4  # fixed shapes (one compilation); lengths vary the content
    paths = [[draw(st.integers(0, 2)) for _ in range(d)] for _ in range(m)]
    lens = [draw(st.integers(0, d)) for _ in range(m)]
    return np.asarray(paths, np.int32), np.asarray(lens, np.int32)


@given(candidate_paths(), st.sampled_from([1, 4, 25]))
def test_from_paths_matches_trie_oracle(data, budget):
    paths, lens = data
    t = _from_paths_jit(9, paths, lens, budget=budget)
    assert bool(_is_valid_jit(t)) and t.num_slots == budget + 1
    # Oracle: insert prefixes in (path, depth) order, keep the first `budget` distinct ones.
    order, counts = [], {}
    for p, n in zip(paths.tolist(), lens.tolist()):
        for k in range(1, n + 1):
            prefix = tuple(p[:k])
            counts[prefix] = counts.get(prefix, 0) + 1
            if prefix not in order:
                order.append(prefix)
    kept = order[:budget]
    got = []
    for i in range(1, t.num_slots):
        if t.valid[i]:
            got.append(tuple(int(t.tokens[a]) for a in t.ancestors[i, 1 : int(t.depth[i]) + 1]))
    assert got == kept
    total = max(sum(1 for n in lens if n > 0), 1)
    for i, prefix in enumerate(got, start=1):
        np.testing.assert_allclose(np.exp(float(t.logscore[i])), counts[prefix] / total, rtol=1e-5)
    assert int(t.tokens[0]) == 9


# ----------------------------------------------------------------------------- keep_best


def test_keep_best_literal():
    # root -> 1 (-0.1) -> 3 (-0.5), root -> 2 (-2.0), 1 -> 4 (-0.3); keep the best 2 nodes.
    t = T.from_parents(
        [0, 0, 0, 1, 1],
        tokens=[9, 11, 12, 13, 14],
        logscore=[0.0, -0.1, -2.0, -0.5, -0.3],
        max_depth=2,
    )
    k = T.keep_best(t, 2)
    np.testing.assert_array_equal(k.valid, [True, True, True, False, False])
    np.testing.assert_array_equal(k.tokens[:3], [9, 11, 14])  # packed, original order
    np.testing.assert_array_equal(k.parents[:3], [0, 0, 1])
    np.testing.assert_allclose(k.logscore[:3], [0.0, -0.1, -0.3])
    assert bool(T.is_valid(k))
    none = T.keep_best(t, 0)
    np.testing.assert_array_equal(none.valid, [True, False, False, False, False])
    everything = T.keep_best(t, 10)
    np.testing.assert_array_equal(everything.tokens, t.tokens)
    np.testing.assert_array_equal(everything.parents, t.parents)


_keep_best_jit = jax.jit(T.keep_best)


@given(
    valid_parents(), st.lists(st.floats(-8.0, 0.0), min_size=12, max_size=12), st.integers(0, 12)
)
def test_keep_best_matches_oracle(data, own, n):
    """Oracle: with path scores non-increasing along paths, the kept set is the top-n valid
    nodes by (score desc, slot asc), and the packed tree has the same root paths of tokens."""
    parents, valid = data
    from eaglepangu_jax.scoring import path_logscores

    scores = np.asarray(path_logscores(parents, np.asarray([0.0] + own[1:], np.float32)))
    tokens = np.arange(100, 112, dtype=np.int32)
    t = _from_parents_jit(parents, tokens=tokens, valid=valid, logscore=scores, max_depth=12)
    k = _keep_best_jit(t, jnp.int32(n))
    assert bool(_is_valid_jit(k))
    ranked = sorted((i for i in range(1, 12) if valid[i]), key=lambda i: (-scores[i], i))
    expected = sorted(ranked[:n])
    m = len(expected)
    np.testing.assert_array_equal(np.asarray(k.valid), np.arange(12) <= m)
    np.testing.assert_array_equal(np.asarray(k.tokens[1 : m + 1]), tokens[expected])

    def token_path(tree, i):
        out = []
        while i:
            out.append(int(tree.tokens[i]))
            i = int(tree.parents[i])
        return out[::-1]

    for new, old in enumerate(expected, start=1):
        assert token_path(k, new) == token_path(t, old)


# ----------------------------------------------------------------------------- widen


def test_widen_literal():
    # root -> 1 -> 2 at depth 2, widened to 5 slots and depth 4: two padding slots appended.
    t = T.from_parents([0, 0, 1], tokens=[9, 11, 12], logscore=[0.0, -0.5, -1.0], max_depth=2)
    w = T.widen(t, 5, 4)
    assert (w.num_slots, w.max_depth) == (5, 4)
    np.testing.assert_array_equal(w.valid, [True, True, True, False, False])
    np.testing.assert_array_equal(w.tokens, [9, 11, 12, 0, 0])
    np.testing.assert_array_equal(w.parents, [0, 0, 1, 0, 0])
    np.testing.assert_array_equal(w.depth, [0, 1, 2, 1, 1])
    np.testing.assert_array_equal(w.ancestors[2], [0, 1, 2, 2, 2])
    np.testing.assert_allclose(w.logscore[:3], [0.0, -0.5, -1.0])
    assert np.all(np.isneginf(np.asarray(w.logscore[3:])))
    assert bool(T.is_valid(w))


def test_widen_never_cuts():
    t = T.chain(4)
    with pytest.raises(ValueError, match="never cut"):
        T.widen(t, 3, t.max_depth)
    with pytest.raises(ValueError, match="never cut"):
        T.widen(t, 8, t.max_depth - 1)


_widen_jit = jax.jit(T.widen, static_argnums=(1, 2))


@given(valid_parents(max_n=8), st.integers(0, 6), st.integers(0, 3))
def test_widen_keeps_every_node_and_its_path(data, extra_slots, extra_depth):
    """Widening appends padding only: the first slots keep their tokens, parents, depths,
    scores and ancestors (cut at the old depth), the tree stays valid."""
    parents, valid = data
    tokens = np.arange(100, 108, dtype=np.int32)
    scores = -np.arange(8, dtype=np.float32) / 4
    t = _from_parents_jit(parents, tokens=tokens, valid=valid, logscore=scores, max_depth=8)
    w = _widen_jit(t, 8 + extra_slots, 8 + extra_depth)
    assert bool(_is_valid_jit(w))
    for field in ("tokens", "parents", "valid", "depth", "logscore"):
        np.testing.assert_array_equal(getattr(w, field)[:8], getattr(t, field))
    np.testing.assert_array_equal(w.ancestors[:8, :9], t.ancestors)
    assert not np.any(np.asarray(w.valid[8:]))


# ----------------------------------------------------------------------------- add_root_children


def test_add_root_children_literal():
    # Root children 7 (slot 1) and 9 (slot 2), 7 -> 8 (slot 3); slots 4-5 are padding.
    # Candidates [9, 4, 6, 2] (the last not kept): 9 is held, 4 -> slot 4, 6 -> slot 5.
    t = T.from_parents(
        [0, 0, 0, 1, 0, 0],
        tokens=[1, 7, 9, 8, 0, 0],
        valid=[True, True, True, True, False, False],
        logscore=[0.0, -0.1, -0.2, -0.3, 0.0, 0.0],
        max_depth=3,
    )
    got = T.add_root_children(t, [9, 4, 6, 2], [-0.5, -0.6, -0.7, -0.8], [True, True, True, False])
    np.testing.assert_array_equal(got.valid, [True] * 6)
    np.testing.assert_array_equal(got.tokens, [1, 7, 9, 8, 4, 6])
    np.testing.assert_array_equal(got.parents, [0, 0, 0, 1, 0, 0])
    np.testing.assert_array_equal(got.depth, [0, 1, 1, 2, 1, 1])
    np.testing.assert_allclose(got.logscore, [0.0, -0.1, -0.2, -0.3, -0.6, -0.7])
    assert bool(T.is_valid(got))
    # No free slot: nothing changes; no candidate: nothing changes.
    full = T.add_root_children(got, [3], [-0.1], [True])
    np.testing.assert_array_equal(full.tokens, got.tokens)
    none = T.add_root_children(
        t, jnp.zeros((0,), jnp.int32), jnp.zeros((0,)), jnp.zeros((0,), bool)
    )
    np.testing.assert_array_equal(none.valid, t.valid)


_add_root_children_jit = jax.jit(T.add_root_children)


@given(
    valid_parents(max_n=8),
    st.lists(st.integers(0, 5), min_size=4, max_size=4),
    st.lists(st.booleans(), min_size=4, max_size=4),
)
def test_add_root_children_matches_oracle(data, candidates, keep):
    """Oracle: the kept candidates whose token no root child has (nor an earlier added
    candidate), in order, fill the padding slots in slot order until none is left; every
    original node is unchanged and the tree stays valid."""
    parents, valid = data
    tokens = np.asarray([9, 1, 2, 3, 4, 5, 1, 2], np.int32)
    t = _from_parents_jit(parents, tokens=tokens, valid=valid, max_depth=8)
    scores = -np.arange(1, 5, dtype=np.float32)
    got = _add_root_children_jit(t, np.asarray(candidates, np.int32), scores, np.asarray(keep))
    assert bool(_is_valid_jit(got))
    held = {int(tokens[i]) for i in range(1, 8) if valid[i] and parents[i] == 0}
    todo = []
    for c, s, k in zip(candidates, scores, keep):
        if k and c not in held:
            todo.append((c, s))
            held.add(c)
    free = [i for i in range(1, 8) if not valid[i]]
    expected_tokens, expected_valid = tokens.copy(), valid.copy()
    for slot, (c, _) in zip(free, todo):
        expected_tokens[slot], expected_valid[slot] = c, True
    np.testing.assert_array_equal(np.asarray(got.valid), expected_valid)
    np.testing.assert_array_equal(
        np.asarray(got.tokens)[expected_valid], expected_tokens[expected_valid]
    )
    for slot, (_, s) in zip(free, todo):
        assert int(got.parents[slot]) == 0 and float(got.logscore[slot]) == s
    for i in range(8):
        if valid[i]:
            assert int(got.parents[i]) == int(t.parents[i])
