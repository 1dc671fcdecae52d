"""Branches mode: the chain decomposition, its batch mask, the chain forward against the tree
forward, and generation equal to tree mode (also under the strict Ascend simulator)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

# The oracle drafter of the runner tests: accepted paths off the first chain.
from test_npu_runner import OracleDrafter  # noqa: E402

from eaglepangu_jax import mask as mask_lib  # noqa: E402
from eaglepangu_jax import tree as tree_lib  # noqa: E402
from eaglepangu_jax.drafters.ngram import NGramDrafter  # noqa: E402
from eaglepangu_jax.engine import decode as gen  # noqa: E402
from eaglepangu_jax.engine.config import SpecConfig  # noqa: E402
from eaglepangu_jax.models.config import LlamaConfig  # noqa: E402
from eaglepangu_jax.models.init import random_params  # noqa: E402
from npu_backend import branches, simulated  # noqa: E402
from npu_backend.llama_torch import TorchLlama  # noqa: E402
from npu_backend.runner import TorchTeacherRunner, generate_torch  # noqa: E402
from npu_backend.simulated import AscendConstraintError, simulated_npu  # noqa: E402

CFG = LlamaConfig.tiny(vocab_size=61, max_position=512)
NO_EOS = -7
PROMPT = [5, 9, 3, 5, 9, 3, 5, 9, 3, 7, 5, 9, 3, 5]
SPEC = SpecConfig(budget=8, depth=4, max_new_tokens=24, eos_id=NO_EOS)
NGRAM = NGramDrafter(budget=8, depth=4, num_matches=4)


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    # Tiny forwards: torch's thread pool only adds contention with XLA's on a shared CPU.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def params():
    p = random_params(CFG, jax.random.key(3))
    # Larger weights so the random teacher's greedy output is not constant.
    return jax.tree_util.tree_map(lambda x: x * 3.0 if x.ndim >= 2 else x, p)


@pytest.fixture(scope="module")
def oracle(params):
    greedy = gen.generate(gen.Teacher(CFG, params), None, PROMPT, SPEC).tokens
    return OracleDrafter(tuple(greedy), prompt_len=len(PROMPT))


def _tensor(x):
    return torch.from_numpy(np.array(x))


def _example_tree():
    """``root -> 1 -> 3``, ``root -> 2``, ``1 -> 4`` (the tree module's example)."""
    return tree_lib.from_parents(
        jnp.asarray([0, 0, 0, 1, 1], jnp.int32),
        tokens=jnp.asarray([11, 12, 13, 14, 15], jnp.int32),
        max_depth=2,
    )


def test_tree_to_branches_example():
    slots, length = branches.tree_to_branches(_example_tree())
    np.testing.assert_array_equal(slots, [[0, 2, 2], [0, 1, 3], [0, 1, 4], [0, 0, 0]])
    np.testing.assert_array_equal(length, [2, 3, 3, 0])
    rows = branches.node_rows(_example_tree(), slots, length)
    np.testing.assert_array_equal(rows, [0, 4, 1, 5, 8])  # flat b * 3 + k


def test_root_only_tree_is_one_chain_of_the_root():
    tree = tree_lib.from_parents(
        jnp.zeros((4,), jnp.int32), valid=jnp.asarray([True, False, False, False]), max_depth=3
    )
    slots, length = branches.tree_to_branches(tree)
    np.testing.assert_array_equal(slots, np.zeros((3, 4), np.int32))
    np.testing.assert_array_equal(length, [1, 0, 0])


def test_branch_mask_example():
    mask = branches.branch_mask(jnp.asarray([2, 0], jnp.int32), jnp.int32(2), 3, 6)
    np.testing.assert_array_equal(
        mask[0], [[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 0, 0]]
    )
    # An unused chain still sees its root: no row is ever empty.
    np.testing.assert_array_equal(mask[1], [[1, 1, 1, 0, 0, 0]] * 3)
    empty_prefix = branches.branch_mask(jnp.asarray([0], jnp.int32), jnp.int32(0), 2, 4)
    assert bool(jnp.all(jnp.any(empty_prefix, axis=-1)))


_table = jax.jit(branches.tree_to_branches)
_rows = jax.jit(branches.node_rows)


@st.composite
def trees(draw):
    n = draw(st.integers(1, 10))
    max_depth = draw(st.integers(1, 4))
    parents = [0] + [draw(st.integers(0, i - 1)) for i in range(1, n)]
    valid = [True] + draw(st.lists(st.booleans(), min_size=n - 1, max_size=n - 1))
    # Out-of-range depths and invalid ancestors are repaired into padding by from_parents.
    return tree_lib.from_parents(
        jnp.asarray(parents, jnp.int32), valid=jnp.asarray(valid), max_depth=max_depth
    )


@given(trees())
def test_tree_to_branches_invariants(tree):
    slots, length = (np.asarray(x) for x in _table(tree))
    n, d = tree.num_slots, tree.max_depth
    valid, parents, depth = (np.asarray(x) for x in (tree.valid, tree.parents, tree.depth))
    assert slots.shape == (max(n - 1, 1), d + 1)
    assert ((slots >= 0) & (slots < n)).all()  # every index in range, never -1
    used = length > 0
    assert not (used[1:] & ~used[:-1]).any()  # used chains first
    has_child = np.zeros(n, bool)
    for i in range(1, n):
        has_child[parents[i]] |= valid[i]
    leaves = sorted(np.flatnonzero(valid & ~has_child).tolist())
    ends = [int(slots[b, length[b] - 1]) for b in np.flatnonzero(used)]
    assert ends == leaves  # every valid leaf exactly once, in slot order
    for b in np.flatnonzero(used):
        chain = slots[b, : length[b]]
        assert chain[0] == 0 and (depth[chain] == np.arange(length[b])).all()
        assert (parents[chain[1:]] == chain[:-1]).all()
        assert (slots[b, length[b] :] == chain[-1]).all()  # padding repeats the leaf
    covered = {int(s) for b in np.flatnonzero(used) for s in slots[b, : length[b]]}
    assert covered == set(np.flatnonzero(valid).tolist())
    rows = np.asarray(_rows(tree, slots, length))
    flat = slots.reshape(-1)
    for j in np.flatnonzero(valid):
        b, k = divmod(int(rows[j]), d + 1)
        assert flat[rows[j]] == j and k < length[b]


def test_chain_forward_matches_tree_forward_and_commit(params):
    model = TorchLlama(CFG, params, attention_impl="eager")
    tree = _example_tree()
    prompt = [3, 9, 27, 50, 8, 1]
    slots, length = branches.tree_to_branches(tree)
    b, t = slots.shape
    c = len(prompt)
    width = 32

    def prefilled(extra):
        kv = model.new_cache(width + extra)
        model.forward(
            torch.tensor(prompt), torch.arange(c), kv, _tensor(mask_lib.causal_mask(c, 0, width))
        )
        kv.advance(c)
        return kv

    tree_kv = prefilled(0)
    mask = _tensor(mask_lib.verify_mask(tree, c, width))
    positions = _tensor(tree_lib.positions(tree, c))
    tokens = _tensor(tree.tokens)
    expected, expected_feats = model.forward(tokens, positions, tree_kv, mask, (0, 2))

    chain_kv = prefilled(branches.scratch_slots(tree.num_slots, tree.max_depth))
    chain_mask = _tensor(branches.branch_mask(length, c, t, width))
    chain_pos = c + torch.arange(t).expand(b, t)
    logits, feats = branches.verify_branches(
        model,
        chain_kv,
        tokens,
        _tensor(slots),
        chain_pos,
        chain_mask,
        (0, 2),
        index_select=simulated.index_select,
    )
    rows = _tensor(branches.node_rows(tree, slots, length)).long()
    torch.testing.assert_close(logits.reshape(b * t, -1)[rows], expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(
        feats.reshape(b * t, 2, -1)[rows], expected_feats, atol=1e-4, rtol=1e-4
    )

    # Accept root -> 1 -> 4: chain 2 wins; its commit must leave what the tree commit leaves.
    tree_kv.commit_path([0, 1, 4])
    chain_kv.commit_path(branches.commit_slots(2, 2, t))
    assert chain_kv.length == tree_kv.length == c + 3
    for a, e in ((chain_kv.k, tree_kv.k), (chain_kv.v, tree_kv.v)):
        torch.testing.assert_close(a[:, : c + 3], e[:, : c + 3], atol=1e-5, rtol=1e-5)


def test_commit_slots_rejects_out_of_range():
    assert branches.commit_slots(0, 0, 5) == [0]
    assert branches.commit_slots(3, 2, 5) == [0, 16, 17]
    with pytest.raises(ValueError, match="out of range"):
        branches.commit_slots(1, 5, 5)


SAMPLE = SpecConfig(
    budget=8,
    depth=4,
    max_new_tokens=24,
    eos_id=NO_EOS,
    acceptance="sample",
    temperature=1.0,
    seed=5,
)


@pytest.mark.parametrize(
    "which, spec",
    [("oracle", SPEC), pytest.param("ngram", SPEC, marks=pytest.mark.slow), ("oracle", SAMPLE)],
    ids=["oracle", "ngram", "sample"],
)
def test_branches_mode_equals_tree_mode_and_jax(params, oracle, which, spec):
    drafter = oracle if which == "oracle" else NGRAM
    model = TorchLlama(CFG, params, attention_impl="sdpa")
    tree = generate_torch(model, drafter, PROMPT, spec, mode="tree")
    chains = generate_torch(model, drafter, PROMPT, spec, mode="branches")
    reference = gen.generate(gen.Teacher(CFG, params), drafter, PROMPT, spec)
    assert chains.tokens == tree.tokens == reference.tokens
    assert chains.stats.accepted_per_round == tree.stats.accepted_per_round
    assert chains.stats.nodes_per_round == tree.stats.nodes_per_round
    if which == "oracle":
        assert sum(chains.stats.accepted_per_round) > 0


def test_branches_mode_runs_clean_under_the_simulator(params, oracle):
    model = TorchLlama(CFG, params, attention_impl="npu_fused")
    runner = TorchTeacherRunner(
        model, oracle, SPEC, mode="branches", index_select=simulated.index_select
    )
    winners = []
    with simulated_npu() as npu:
        state, kv = runner.start(PROMPT)
        while runner.running(state, kv):
            state, info = runner.step(state, kv)
            winners.append(info)
    assert npu.calls > 0
    assert any(r.moved > 0 for r in winners)  # some accepted chain was not chain 0
    # Three paths make three leaves (two if a decoy merges), rounded up to a power of two.
    assert {r.verified for r in winners} <= {2, 4} and any(r.verified == 4 for r in winners)
    expected = gen.generate(gen.Teacher(CFG, params), oracle, PROMPT, SPEC)
    new = np.asarray(state.tokens)[len(PROMPT) : len(PROMPT) + SPEC.max_new_tokens]
    assert new.tolist() == expected.tokens
    assert int(state.rounds) == expected.stats.rounds


def _minus_one_table(tree):
    """The naive decomposition: chains padded with -1 (EAGLE's retrieve_indices habit)."""
    slots, length = branches.tree_to_branches(tree)
    depth = jnp.arange(slots.shape[1], dtype=jnp.int32)
    return jnp.where(depth[None, :] < length[:, None], slots, -1), length


def test_minus_one_padded_branch_table_raises_in_the_strict_gather(params):
    model = TorchLlama(CFG, params, attention_impl="npu_fused")
    runner = TorchTeacherRunner(
        model,
        NGRAM,
        SPEC,
        mode="branches",
        index_select=simulated.index_select,
        branch_table=_minus_one_table,
    )
    with simulated_npu(), pytest.raises(AscendConstraintError, match="negative"):
        runner.generate(PROMPT)
