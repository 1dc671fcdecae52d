"""Tests for eaglepangu_jax.cache: commit against a sequential-copy oracle, fast path, jit/vmap."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from eaglepangu_jax import cache as cache_lib
from eaglepangu_jax import mode
from eaglepangu_jax import tree as tree_lib

LAYERS, HEADS, HEAD_DIM = 2, 1, 2


def sentinel_cache(num_slots: int, length: int) -> cache_lib.KVCache:
    """Every (layer, slot, head, dim) entry holds a distinct value; v = -k - 1."""
    k = np.arange(LAYERS * num_slots * HEADS * HEAD_DIM, dtype=np.float32)
    k = k.reshape(LAYERS, num_slots, HEADS, HEAD_DIM)
    return cache_lib.KVCache(k=jnp.asarray(k), v=jnp.asarray(-k - 1), length=jnp.int32(length))


def oracle_commit(kv: np.ndarray, base: int, path, length: int) -> np.ndarray:
    """Copy one entry at a time from a snapshot taken before any write."""
    snapshot = np.array(kv)
    out = np.array(kv)
    for k in range(length + 1):
        out[:, base + k] = snapshot[:, base + int(path[k])]
    return out


def check_against_oracle(cache, path, length, got):
    base = int(cache.length)
    np.testing.assert_array_equal(got.k, oracle_commit(cache.k, base, path, length))
    np.testing.assert_array_equal(got.v, oracle_commit(cache.v, base, path, length))
    assert int(got.length) == base + length + 1


commit_jit = jax.jit(cache_lib.commit)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FakeAcceptance:
    """What the verifier returns: only ``path`` and ``length`` are read."""

    length: jax.Array
    path: jax.Array
    next_token: jax.Array


# --- exact cases -------------------------------------------------------------------------


def test_commit_literal_example():
    # The module docstring's example: length 10, accepted path [0, 2, 5], bonus not stored.
    cache = sentinel_cache(20, 10)
    path = jnp.array([0, 2, 5, 5], jnp.int32)  # entries past length repeat the last node
    got = commit_jit(cache, path, jnp.int32(2))
    assert int(got.length) == 13
    k = np.asarray(cache.k)
    np.testing.assert_array_equal(got.k[:, 10], k[:, 10])
    np.testing.assert_array_equal(got.k[:, 11], k[:, 12])
    np.testing.assert_array_equal(got.k[:, 12], k[:, 15])
    untouched = [s for s in range(20) if s not in (11, 12)]
    np.testing.assert_array_equal(got.k[:, untouched], k[:, untouched])
    np.testing.assert_array_equal(got.v[:, 12], -k[:, 15] - 1)


def test_chain_fast_path_moves_nothing():
    cache = sentinel_cache(16, 4)
    for length in range(5):
        got = commit_jit(cache, jnp.arange(5, dtype=jnp.int32), jnp.int32(length))
        np.testing.assert_array_equal(got.k, cache.k)
        np.testing.assert_array_equal(got.v, cache.v)
        assert int(got.length) == 4 + length + 1


def test_fast_path_is_a_cond():
    cache = sentinel_cache(16, 4)
    jaxpr = jax.make_jaxpr(cache_lib.commit)(cache, jnp.arange(5, dtype=jnp.int32), 2)
    assert any(eqn.primitive.name == "cond" for eqn in jaxpr.jaxpr.eqns)


def test_only_the_new_segment_moves():
    # Leading chain 0, 1, 2 is in place; only depths 3 and 4 are gathered.
    cache = sentinel_cache(24, 6)
    path = jnp.array([0, 1, 2, 5, 9, 9], jnp.int32)
    got = commit_jit(cache, path, jnp.int32(4))
    k = np.asarray(cache.k)
    changed = np.flatnonzero(np.any(np.asarray(got.k) != k, axis=(0, 2, 3)))
    np.testing.assert_array_equal(changed, [9, 10])
    np.testing.assert_array_equal(got.k[:, 9], k[:, 11])
    np.testing.assert_array_equal(got.k[:, 10], k[:, 15])
    assert int(got.length) == 11


def test_rejected_everything_commits_the_root_only():
    cache = sentinel_cache(12, 3)
    got = commit_jit(cache, jnp.array([0, 4, 7], jnp.int32), jnp.int32(0))
    np.testing.assert_array_equal(got.k, cache.k)
    assert int(got.length) == 4


@pytest.mark.parametrize(
    "path,length",
    [
        ([0, 2, 3, 4], 3),  # each source is the previous entry's destination
        ([0, 3, 1, 2], 3),  # not a tree path: sources behind destinations, read before written
        ([0, 2, 1, 1], 2),  # swap of two neighbours
    ],
)
def test_overlapping_moves_read_before_write(path, length):
    cache = sentinel_cache(10, 2)
    got = commit_jit(cache, jnp.array(path, jnp.int32), jnp.int32(length))
    check_against_oracle(cache, path, length, got)


def test_commit_near_the_end_of_the_cache():
    # The path (D + 1 = 6 entries) is wider than the room left; the window shifts left and
    # must not disturb the committed prefix.
    cache = sentinel_cache(12, 8)
    path = [0, 1, 3, 3, 3, 3]
    got = commit_jit(cache, jnp.array(path, jnp.int32), jnp.int32(2))
    check_against_oracle(cache, path, 2, got)


def test_commit_rejects_bad_paths():
    cache = sentinel_cache(4, 0)
    with pytest.raises(ValueError, match="cannot fit"):
        cache_lib.commit(cache, jnp.arange(5, dtype=jnp.int32), 1)
    with pytest.raises(ValueError, match="1-D"):
        cache_lib.commit(cache, jnp.zeros((2, 2), jnp.int32), 1)


def test_commit_acceptance_reads_attributes():
    cache = sentinel_cache(16, 1)
    acceptance = FakeAcceptance(
        length=jnp.int32(2), path=jnp.array([0, 1, 4, 4], jnp.int32), next_token=jnp.int32(7)
    )
    got = jax.jit(cache_lib.commit_acceptance)(cache, acceptance)
    check_against_oracle(cache, [0, 1, 4, 4], 2, got)


def test_commit_length_advance_truncate():
    cache = sentinel_cache(10, 3)
    by_length = cache_lib.commit_length(cache, jnp.int32(2))
    by_path = cache_lib.commit(cache, jnp.arange(4, dtype=jnp.int32), jnp.int32(2))
    assert int(by_length.length) == int(by_path.length) == 6
    assert by_length.k is cache.k  # advance only: no data touched
    assert int(cache_lib.advance(cache, 5).length) == 8
    assert int(cache_lib.advance(cache, 50).length) == 10  # clipped to S
    assert int(cache_lib.truncate(cache, 1).length) == 1
    assert int(cache_lib.truncate(cache, -4).length) == 0
    assert int(cache_lib.truncate(cache, 99).length) == 10


def test_capacity_check():
    cache = sentinel_cache(10, 6)
    cache_lib.capacity_check(cache, 4)
    with pytest.raises(ValueError, match="6 committed slots \\+ 5 new ones exceed its 10"):
        cache_lib.capacity_check(cache, 5)
    with pytest.raises(ValueError, match=">= 0"):
        cache_lib.capacity_check(cache, -1)
    batched = jax.tree.map(lambda *xs: jnp.stack(xs), cache, cache_lib.truncate(cache, 9))
    with pytest.raises(ValueError, match="9 committed"):
        cache_lib.capacity_check(batched, 2)
    with pytest.raises(ValueError, match="outside jit"):
        jax.jit(lambda c: cache_lib.capacity_check(c, 1))(cache)


# --- properties --------------------------------------------------------------------------

NUM_SLOTS = 24
WIDTH = 6  # D + 1


@st.composite
def arbitrary_paths(draw):
    """Any in-range path (not necessarily a tree path), a length, a base that fits it."""
    span = draw(st.integers(1, 10))  # tree slots written by the forward
    path = [0] + [draw(st.integers(0, span - 1)) for _ in range(WIDTH - 1)]
    length = draw(st.integers(0, WIDTH - 1))
    base = draw(st.integers(0, NUM_SLOTS - max(span, length + 1)))
    return path, length, base


@given(arbitrary_paths())
def test_commit_matches_sequential_oracle(case):
    path, length, base = case
    cache = sentinel_cache(NUM_SLOTS, base)
    got = commit_jit(cache, jnp.array(path, jnp.int32), jnp.int32(length))
    check_against_oracle(cache, path, length, got)


def _from_parents(parents, valid):
    return tree_lib.from_parents(parents, valid=valid, max_depth=WIDTH - 1)


build = mode.checked(jax.jit(_from_parents))  # checked outside jit (reference mode)


@given(st.data())
def test_commit_tree_paths_match_oracle(data):
    n = 10
    parents = [0] + [data.draw(st.integers(0, i - 1)) for i in range(1, n)]
    depth = [0] * n
    for i in range(1, n):
        depth[i] = depth[parents[i]] + 1
    valid = np.array([d <= WIDTH - 1 for d in depth]) & np.array(
        [True] + [data.draw(st.booleans()) for _ in range(1, n)]
    )
    for i in range(1, n):
        valid[i] &= valid[parents[i]]
    tree = build(np.asarray(parents, np.int32), valid)
    node = data.draw(st.sampled_from(np.flatnonzero(valid).tolist()))
    path, length = tree_lib.path_to(tree, node), int(tree.depth[node])
    base = data.draw(st.integers(0, NUM_SLOTS - n))
    cache = sentinel_cache(NUM_SLOTS, base)
    got = commit_jit(cache, path, jnp.int32(length))
    check_against_oracle(cache, np.asarray(path), length, got)
    # A tree path is increasing, so the in-place prefix is exactly where path[k] == k.
    in_place = int(
        np.argmin(np.append(np.asarray(path)[: length + 1] == np.arange(length + 1), False))
    )
    np.testing.assert_array_equal(got.k[:, : base + in_place], cache.k[:, : base + in_place])


# --- jit, vmap, no recompilation ---------------------------------------------------------


def test_vmap_over_caches():
    cases = [([0, 1, 2, 3], 3, 0), ([0, 2, 5, 6], 2, 4), ([0, 3, 1, 2], 3, 9)]
    caches = [sentinel_cache(NUM_SLOTS, base) for _, _, base in cases]
    batch = jax.tree.map(lambda *xs: jnp.stack(xs), *caches)
    paths = jnp.array([p for p, _, _ in cases], jnp.int32)
    lengths = jnp.array([n for _, n, _ in cases], jnp.int32)
    got = jax.jit(jax.vmap(cache_lib.commit))(batch, paths, lengths)
    for b, (path, length, _) in enumerate(cases):
        one = jax.tree.map(lambda x, b=b: x[b], got)
        check_against_oracle(caches[b], path, length, one)
    advanced = jax.vmap(cache_lib.commit_length)(batch, lengths)
    np.testing.assert_array_equal(advanced.length, np.array([4, 7, 13]))
    np.testing.assert_array_equal(jax.vmap(cache_lib.truncate)(batch, lengths).length, lengths)


def test_no_recompile_when_dynamic_values_change():
    traces = {"commit": 0, "length": 0}

    def commit(cache, path, length):
        traces["commit"] += 1
        return cache_lib.commit(cache, path, length)

    def commit_length(cache, length):
        traces["length"] += 1
        return cache_lib.commit_length(cache, length)

    commit_once, length_once = jax.jit(commit), jax.jit(commit_length)
    cases = [([0, 1, 2, 3], 3, 0), ([0, 2, 5, 6], 2, 4), ([0, 3, 3, 3], 1, 9)]
    for path, length, base in cases:
        cache = sentinel_cache(NUM_SLOTS, base)
        got = commit_once(cache, jnp.array(path, jnp.int32), jnp.int32(length))
        check_against_oracle(cache, path, length, got)
        assert int(length_once(cache, jnp.int32(length)).length) == base + length + 1
    assert traces == {"commit": 1, "length": 1}


def test_donated_commit_in_jit():
    cache = sentinel_cache(NUM_SLOTS, 2)
    expected = oracle_commit(cache.k, 2, [0, 3, 4], 2)
    step = jax.jit(cache_lib.commit, donate_argnums=0)
    got = step(cache, jnp.array([0, 3, 4], jnp.int32), jnp.int32(2))
    np.testing.assert_array_equal(got.k, expected)
