"""Tests for eaglepangu_jax.mask: literal masks, brute-force oracles, round trips, jit/vmap."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from eaglepangu_jax import mask, mode
from eaglepangu_jax import tree as tree_lib

# A few fixed table shapes (N slots, D max depth) keep compilations few; random parents,
# padding and depth limits inside them cover the trees.
SHAPES = [(1, 1), (5, 2), (12, 3), (12, 11)]


@st.composite
def raw_trees(draw):
    """Valid construction inputs: parents ``0 <= p < i``, a valid closure, a depth limit."""
    n, max_depth = draw(st.sampled_from(SHAPES))
    parents = [0] + [draw(st.integers(0, i - 1)) for i in range(1, n)]
    keep = [True] + [draw(st.integers(0, 4)) > 0 for _ in range(1, n)]
    limit = draw(st.integers(1, max_depth))
    depth, valid = [0] * n, [True] * n
    for i in range(1, n):
        depth[i] = depth[parents[i]] + 1
        valid[i] = keep[i] and valid[parents[i]] and depth[i] <= limit
    return parents, valid, max_depth


def _from_parents(parents, valid, max_depth):
    return tree_lib.from_parents(parents, valid=valid, max_depth=max_depth)


# checked outside jit: in reference mode from_parents emits checkify checks.
_build = mode.checked(jax.jit(_from_parents, static_argnums=2))


def build(parents, valid, max_depth):
    return _build(np.asarray(parents, np.int32), np.asarray(valid), max_depth)


tree_mask_jit = jax.jit(mask.tree_mask)
verify_mask_jit = jax.jit(mask.verify_mask, static_argnums=2)
causal_mask_jit = jax.jit(mask.causal_mask, static_argnums=(0, 2))


def oracle_tree_mask(parents, valid):
    """Follow parent pointers one node at a time."""
    n = len(parents)
    out = np.zeros((n, n), bool)
    for i in range(n):
        out[i, i] = out[i, 0] = True
        node = i
        while valid[i] and node != 0:
            node = parents[node]
            out[i, node] = True
    return out


def oracle_verify_mask(parents, valid, committed_len, cache_len):
    within = oracle_tree_mask(parents, valid)
    n = len(parents)
    out = np.zeros((n, cache_len), bool)
    for i in range(n):
        for s in range(cache_len):
            j = s - committed_len
            out[i, s] = s < committed_len or (0 <= j < n and within[i, j])
    return out


# Example tree of the tree module: root -> 1 -> 3, root -> 2, 1 -> 4.
EXAMPLE = build([0, 0, 0, 1, 1], [True] * 5, 2)


def test_tree_mask_literal():
    expected = np.array(
        [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 1, 0, 0, 1]], bool
    )
    np.testing.assert_array_equal(mask.tree_mask(EXAMPLE), expected)


def test_tree_mask_padding_rows_see_root_and_self_only():
    # Slots 2 and 3 are padding (3's parent pointer to 2 is ignored).
    tree = build([0, 0, 0, 2, 1], [True, True, False, False, True], 3)
    expected = np.array(
        [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 0, 0, 1, 0], [1, 1, 0, 0, 1]], bool
    )
    np.testing.assert_array_equal(mask.tree_mask(tree), expected)


def test_verify_mask_literal():
    expected = np.array(
        [
            [1, 1, 1, 0, 0, 0, 0, 0],
            [1, 1, 1, 1, 0, 0, 0, 0],
            [1, 1, 1, 0, 1, 0, 0, 0],
            [1, 1, 1, 1, 0, 1, 0, 0],
            [1, 1, 1, 1, 0, 0, 1, 0],
        ],
        bool,
    )
    got = mask.verify_mask(EXAMPLE, jnp.int32(2), 8)
    assert got.shape == (5, 8) and got.dtype == jnp.bool_
    np.testing.assert_array_equal(got, expected)


def test_causal_mask_literal():
    expected = np.array([[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 0]], bool)
    np.testing.assert_array_equal(mask.causal_mask(3, jnp.int32(2), 6), expected)
    np.testing.assert_array_equal(mask.causal_mask(4, 0, 4), np.tril(np.ones((4, 4), bool)))


@given(raw_trees())
def test_tree_mask_matches_oracle(raw):
    parents, valid, max_depth = raw
    tree = build(parents, valid, max_depth)
    np.testing.assert_array_equal(np.asarray(tree.valid), valid)
    got = np.asarray(tree_mask_jit(tree))
    np.testing.assert_array_equal(got, oracle_tree_mask(parents, valid))
    assert got.any(axis=1).all()


@given(raw_trees(), st.data())
def test_verify_mask_matches_oracle(raw, data):
    parents, valid, max_depth = raw
    n = len(parents)
    cache_len = data.draw(st.sampled_from([1, 7, 16, 24]))
    # Mostly trees that fit; sometimes past the end (columns dropped, rows still non-empty).
    committed = data.draw(st.integers(0, cache_len + 2))
    got = np.asarray(
        verify_mask_jit(build(parents, valid, max_depth), jnp.int32(committed), cache_len)
    )
    assert got.shape == (n, cache_len)
    expected = oracle_verify_mask(parents, valid, min(committed, cache_len), cache_len)
    np.testing.assert_array_equal(got, expected)
    assert got.any(axis=1).all()


@given(st.sampled_from([1, 3, 8]), st.sampled_from([1, 8, 20]), st.integers(0, 22))
def test_causal_mask_matches_oracle(t, cache_len, committed):
    got = np.asarray(causal_mask_jit(t, jnp.int32(committed), cache_len))
    c = min(committed, cache_len)
    expected = np.array([[s <= c + r for s in range(cache_len)] for r in range(t)])
    np.testing.assert_array_equal(got, expected)
    assert got.any(axis=1).all()


def test_left_padded_causal_mask_literal():
    # The docstring's example: slot 2 is padding (sees only itself), real tokens start at 3.
    expected = np.array([[0, 0, 1, 0, 0, 0], [0, 0, 0, 1, 0, 0], [0, 0, 0, 1, 1, 0]], bool)
    np.testing.assert_array_equal(mask.left_padded_causal_mask(3, 2, 6, 3), expected)
    # No padding: the plain causal mask.
    np.testing.assert_array_equal(
        mask.left_padded_causal_mask(3, 2, 6, 0), mask.causal_mask(3, 2, 6)
    )


@given(st.sampled_from([1, 3, 8]), st.sampled_from([4, 8, 20]), st.data())
def test_left_padded_causal_mask_matches_oracle(t, cache_len, data):
    committed = data.draw(st.integers(0, cache_len - 1))
    first = data.draw(st.integers(0, cache_len))
    got = np.asarray(mask.left_padded_causal_mask(t, jnp.int32(committed), cache_len, first))
    expected = np.array(
        [
            [first <= s <= committed + r or s == committed + r for s in range(cache_len)]
            for r in range(t)
        ]
    )
    np.testing.assert_array_equal(got, expected)
    # A row whose own slot is inside the window is never empty.
    assert got[: cache_len - committed].any(axis=1).all()


def test_bad_static_arguments():
    with pytest.raises(ValueError, match="cache_len"):
        mask.verify_mask(EXAMPLE, 0, 0)
    with pytest.raises(ValueError, match="t must be"):
        mask.causal_mask(0, 0, 4)
    with pytest.raises(ValueError, match="cache_len"):
        jax.jit(lambda s: mask.verify_mask(EXAMPLE, 0, s))(8)
    with pytest.raises(ValueError, match="multiple"):
        mask.pad_keys(jnp.ones((2, 3), bool), 0)
    with pytest.raises(ValueError, match="boolean"):
        mask.pad_keys(jnp.ones((2, 3), jnp.uint8), 4)


# --- conversions -------------------------------------------------------------------------

# Word-boundary widths (31, 32, 33, 64, 70) and a few batch shapes; random contents.
MASK_SHAPES = [(1,), (31,), (32,), (33,), (4, 1), (3, 64), (2, 3, 70)]
bool_masks = st.sampled_from(MASK_SHAPES).flatmap(lambda shape: hnp.arrays(np.bool_, shape))

pack_jit = jax.jit(mask.pack)
unpack_jit = jax.jit(mask.unpack, static_argnums=1)
to_ascend_jit = jax.jit(mask.to_ascend, static_argnums=1)
from_ascend_jit = jax.jit(mask.from_ascend)
pad_keys_jit = jax.jit(mask.pad_keys, static_argnums=1)


def test_pack_bit_layout():
    m = np.zeros((2, 40), bool)
    m[0, [0, 31]] = True
    m[1, 33] = True
    packed = mask.pack(jnp.asarray(m))
    assert packed.dtype == jnp.uint32 and packed.shape == (2, 2)
    np.testing.assert_array_equal(packed, np.array([[1 + 2**31, 0], [0, 2]], np.uint32))


@given(bool_masks)
def test_pack_unpack_round_trip(m):
    packed = pack_jit(jnp.asarray(m))
    assert packed.shape == m.shape[:-1] + (-(-m.shape[-1] // 32),)
    np.testing.assert_array_equal(unpack_jit(packed, m.shape[-1]), m)


def test_unpack_rejects_wrong_width():
    packed = mask.pack(jnp.ones((3, 40), bool))
    with pytest.raises(ValueError, match="words"):
        mask.unpack(packed, 70)
    with pytest.raises(ValueError, match="uint32"):
        mask.unpack(packed.astype(jnp.int32), 40)


@given(bool_masks, st.sampled_from([jnp.uint8, jnp.bool_]))
def test_ascend_round_trip(m, dtype):
    ascend = to_ascend_jit(jnp.asarray(m), dtype)
    assert ascend.dtype == dtype
    np.testing.assert_array_equal(np.asarray(ascend).astype(bool), ~m)  # 1 = masked out
    np.testing.assert_array_equal(from_ascend_jit(ascend), m)


def test_to_ascend_literal_and_bad_dtype():
    np.testing.assert_array_equal(
        mask.to_ascend(jnp.array([True, False])), np.array([0, 1], np.uint8)
    )
    with pytest.raises(ValueError, match="uint8 or bool"):
        mask.to_ascend(jnp.array([True]), jnp.float32)


@given(bool_masks, st.sampled_from([1, 7, 16, 32]))
def test_pad_keys_round_trip(m, multiple):
    padded = np.asarray(pad_keys_jit(jnp.asarray(m), multiple))
    s = m.shape[-1]
    assert padded.shape[:-1] == m.shape[:-1]
    assert padded.shape[-1] % multiple == 0 and s <= padded.shape[-1] < s + multiple
    np.testing.assert_array_equal(padded[..., :s], m)
    assert not padded[..., s:].any()
    # Padded columns come out masked in the Ascend polarity too.
    assert np.asarray(to_ascend_jit(jnp.asarray(padded), jnp.uint8))[..., s:].all()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_to_bias(dtype):
    m = mask.verify_mask(EXAMPLE, 2, 8)
    bias = mask.to_bias(m, dtype)
    assert bias.dtype == dtype
    low = jnp.finfo(dtype).min
    np.testing.assert_array_equal(np.asarray(bias == 0), np.asarray(m))
    np.testing.assert_array_equal(np.asarray(bias == low), ~np.asarray(m))
    # Softmax with the bias equals softmax restricted to allowed slots; no NaN.
    scores = jax.random.normal(jax.random.key(0), m.shape, jnp.float32)
    probs = jax.nn.softmax(scores + bias.astype(jnp.float32), axis=-1)
    masked = jnp.where(m, jnp.exp(scores), jnp.float32(0))
    expected = masked / jnp.sum(masked, axis=-1, keepdims=True)
    np.testing.assert_allclose(probs, expected, rtol=1e-6, atol=1e-7)


def test_to_bias_rejects_integer_dtype():
    with pytest.raises(ValueError, match="floating"):
        mask.to_bias(jnp.array([True]), jnp.int32)


# --- jit, vmap, no recompilation ---------------------------------------------------------


def _stack(trees):
    return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


def test_vmap_over_trees_and_lengths():
    raws = [
        ([0, 0, 1, 2, 0, 4], [True] * 6, 3),
        ([0, 0, 0, 0, 0, 0], [True, True, False, True, True, False], 3),
        ([0, 0, 1, 1, 3, 2], [True] * 6, 3),
    ]
    trees = [build(*raw) for raw in raws]
    batch = _stack(trees)
    committed = jnp.array([0, 3, 7], jnp.int32)
    tm = jax.jit(jax.vmap(mask.tree_mask))(batch)
    vm = jax.jit(jax.vmap(mask.verify_mask, in_axes=(0, 0, None)), static_argnums=2)(
        batch, committed, 16
    )
    cm = jax.vmap(mask.causal_mask, in_axes=(None, 0, None))(3, committed, 16)
    for b, (parents, valid, _) in enumerate(raws):
        np.testing.assert_array_equal(tm[b], oracle_tree_mask(parents, valid))
        np.testing.assert_array_equal(
            vm[b], oracle_verify_mask(parents, valid, int(committed[b]), 16)
        )
        np.testing.assert_array_equal(cm[b], mask.causal_mask(3, committed[b], 16))


@pytest.mark.parametrize("shape", [(3, 33), (2, 64)])
def test_conversions_vmap_and_jit(shape):
    m = jax.random.bernoulli(jax.random.key(1), 0.5, shape)
    cols = m.shape[-1]
    packed = jax.jit(jax.vmap(mask.pack))(m)
    np.testing.assert_array_equal(packed, mask.pack(m))
    np.testing.assert_array_equal(
        jax.jit(jax.vmap(mask.unpack, in_axes=(0, None)), static_argnums=1)(packed, cols), m
    )
    np.testing.assert_array_equal(jax.jit(jax.vmap(mask.to_ascend))(m), mask.to_ascend(m))
    np.testing.assert_array_equal(jax.vmap(mask.from_ascend)(mask.to_ascend(m)), m)
    np.testing.assert_array_equal(jax.jit(jax.vmap(mask.to_bias))(m), mask.to_bias(m))
    np.testing.assert_array_equal(
        jax.jit(jax.vmap(mask.pad_keys, in_axes=(0, None)), static_argnums=1)(m, 8),
        mask.pad_keys(m, 8),
    )


def test_no_recompile_when_dynamic_values_change():
    traces = {"verify": 0, "causal": 0, "tree": 0}

    def verify(tree, committed):
        traces["verify"] += 1
        return mask.verify_mask(tree, committed, 16)

    def causal(committed):
        traces["causal"] += 1
        return mask.causal_mask(4, committed, 16)

    def within(tree):
        traces["tree"] += 1
        return mask.tree_mask(tree)

    verify_jit, causal_jit, tree_jit = jax.jit(verify), jax.jit(causal), jax.jit(within)
    tree_a = build([0, 0, 1, 2, 0, 4], [True] * 6, 3)
    tree_b = build([0, 0, 0, 1, 1, 3], [True, True, True, False, True, False], 3)
    for committed, tree in [(0, tree_a), (5, tree_b), (9, tree_a)]:
        c = jnp.int32(committed)
        np.testing.assert_array_equal(verify_jit(tree, c), mask.verify_mask(tree, c, 16))
        np.testing.assert_array_equal(causal_jit(c), mask.causal_mask(4, c, 16))
        np.testing.assert_array_equal(tree_jit(tree), mask.tree_mask(tree))
    assert traces == {"verify": 1, "causal": 1, "tree": 1}


def test_no_python_loop_over_nodes():
    # The traced program's size must not grow with the number of slots.
    def size(n):
        tree = build([0] * n, [True] * n, 4)
        return len(jax.make_jaxpr(lambda t: mask.verify_mask(t, 3, 64))(tree).eqns)

    assert size(4) == size(40)
