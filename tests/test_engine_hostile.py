"""Hostile drafters whose trees are MOSTLY VALID, with bad values sprinkled in.

A drafter that returns pure garbage gets its whole tree thrown away, which tests little: the
interesting case is a real tree (parents in ``[0, i)``, closed under validity) with a few bad
nodes, so the repair must drop exactly those and keep verifying, accepting and committing
the rest. Corruptions: a parent that is negative, not before the node or far out of range;
a chain deeper than the tree's depth; a valid node under an invalid one (or under drafter
padding); a token id outside ``[0, V)``; a NaN / infinite score.

The contract (README "Core concepts"): in performance mode (the default) bad nodes, and
their descendants, become padding and the output is plain greedy decoding whatever the
drafter proposes; in reference mode (``EAGLEPANGU_MODE=reference``) the first bad node
raises an error naming it. Token ids outside the vocabulary follow the same rule.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from eaglepangu_jax import tree as tree_lib
from eaglepangu_jax.engine import decode as gen
from eaglepangu_jax.engine.config import SpecConfig
from eaglepangu_jax.engine.drafter import Proposal, StatelessDrafter
from eaglepangu_jax.models.config import LlamaConfig
from eaglepangu_jax.models.init import random_params

CFG = LlamaConfig.tiny(vocab_size=61, max_position=512)
V = CFG.vocab_size
NO_EOS = -7  # an id the vocabulary never produces, so runs last max_new_tokens
PROMPT = [5, 9, 14, 3, 22, 7]
BUDGET = 11  # tree slots: BUDGET + 1
DEPTH = 3
NEW = 10
# The drafter's tree verbatim (the default "auto" policy prunes it; one test runs that too).
SPEC = SpecConfig(policy="drafter", budget=BUDGET, depth=DEPTH, max_new_tokens=NEW, eos_id=NO_EOS)
I32_MIN, I32_MAX = -(2**31), 2**31 - 1
BAD_TOKENS = (-1, I32_MIN, V, V + 1, I32_MAX)


# ------------------------------------------------------------------------------------------
# Mostly-valid trees: a hypothesis strategy (host side) and a jittable generator
# ------------------------------------------------------------------------------------------

CORRUPTIONS = (
    "parent_negative",
    "parent_not_before",  # parent >= i (itself, a later slot, or just past the tree)
    "parent_out_of_range",
    "depth_overflow",  # a child of a node already at the maximum depth
    "under_invalid_parent",  # a well-formed node whose parent is a bad node or padding
    "drafter_padding",  # the drafter itself marks the slot invalid
    "bad_token",
    "bad_score",
)


def contract_keep(parents, tokens, use_oracle, valid, max_depth=DEPTH, vocab_size=V):
    """Which slots the contract keeps: the root; a node flagged valid whose parent is an
    earlier kept node above ``max_depth``, whose token is in ``[0, vocab_size)`` (oracle
    tokens always are)."""
    keep, depth = [True], [0]
    for i in range(1, len(parents)):
        p = parents[i]
        ok = valid[i] and 0 <= p < i and keep[p] and depth[p] < max_depth
        ok = ok and (use_oracle[i] or 0 <= tokens[i] < vocab_size)
        keep.append(ok)
        depth.append(depth[p] + 1 if ok else -1)
    return tuple(keep)


@dataclasses.dataclass(frozen=True)
class HostileTree:
    """A drafter's raw tree, slot by slot. Node ``i`` carries the true greedy token at depth
    ``offset[i]`` when ``use_oracle[i]`` (see :class:`HostileDrafter`), else ``tokens[i]``."""

    parents: tuple[int, ...]
    tokens: tuple[int, ...]
    use_oracle: tuple[bool, ...]
    offset: tuple[int, ...]  # the depth the node was built at (its oracle token index)
    valid: tuple[bool, ...]
    logscore: tuple[float, ...]
    corruptions: tuple[str, ...] = ()  # per slot, "" for none (for failure messages)

    @classmethod
    def from_rows(cls, rows):
        """From ``(parent, token, use_oracle, offset, valid, logscore)`` rows."""
        return cls(*(tuple(column) for column in zip(*rows)))

    def rows(self) -> list[list]:
        fields = (self.parents, self.tokens, self.use_oracle, self.offset, self.valid)
        return [list(row) for row in zip(*fields, self.logscore)]

    @property
    def keep(self) -> tuple[bool, ...]:
        return contract_keep(self.parents, self.tokens, self.use_oracle, self.valid)

    def params(self, oracle) -> dict:
        return dict(
            parents=jnp.asarray(self.parents, jnp.int32),
            tokens=jnp.asarray(self.tokens, jnp.int32),
            use_oracle=jnp.asarray(self.use_oracle, bool),
            offset=jnp.asarray(self.offset, jnp.int32),
            valid=jnp.asarray(self.valid, bool),
            logscore=jnp.asarray(self.logscore, jnp.float32),
            oracle=jnp.asarray(oracle, jnp.int32),
        )


@st.composite
def mostly_valid_trees(draw, num_slots=BUDGET + 1, max_depth=DEPTH, vocab_size=V, bad_rate=0.2):
    """A valid random tree (each parent an earlier kept node above the maximum depth) whose
    nodes are each corrupted with probability about ``bad_rate``."""
    parents, tokens, use_oracle, offset = [0], [0], [True], [0]
    valid, logscore, keep, corruptions = [True], [0.0], [True], [""]
    depth = [0]  # depth of kept nodes (the contract's), -1 for dropped ones
    for i in range(1, num_slots):
        eligible = [j for j in range(i) if keep[j] and depth[j] < max_depth]
        parent = draw(st.sampled_from(eligible))
        token = draw(st.integers(0, vocab_size - 1))
        oracle = draw(st.booleans()) or draw(st.booleans())  # 3/4 of the nodes
        score = logscore[parent] + draw(st.floats(-3.0, 0.0))
        is_valid, kind = True, ""
        if draw(st.floats(0.0, 1.0)) < bad_rate:
            kind = draw(st.sampled_from(CORRUPTIONS))
        if kind == "parent_negative":
            parent = draw(st.sampled_from([-1, -2, -i, I32_MIN]))
        elif kind == "parent_not_before":
            parent = draw(st.integers(i, num_slots))
        elif kind == "parent_out_of_range":
            parent = draw(st.sampled_from([num_slots + 1, 2 * num_slots, I32_MAX]))
        elif kind == "depth_overflow":
            deepest = [j for j in range(i) if keep[j] and depth[j] == max_depth]
            parent = draw(st.sampled_from(deepest)) if deepest else parent
            kind = kind if deepest else ""
        elif kind == "under_invalid_parent":
            dropped = [j for j in range(1, i) if not keep[j]]
            parent = draw(st.sampled_from(dropped)) if dropped else parent
            kind = kind if dropped else ""
        elif kind == "drafter_padding":
            is_valid = False
        elif kind == "bad_token":
            token, oracle = draw(st.sampled_from(BAD_TOKENS)), False
        elif kind == "bad_score":
            score = draw(st.sampled_from([np.nan, np.inf, -np.inf]))
        well_formed = 0 <= parent < i and keep[parent] and depth[parent] < max_depth
        kept = is_valid and well_formed and (oracle or 0 <= token < vocab_size)
        parents.append(parent)
        tokens.append(token)
        use_oracle.append(oracle)
        offset.append(depth[parent] + 1 if well_formed else 1)
        valid.append(is_valid)
        logscore.append(score)
        keep.append(kept)
        depth.append(depth[parent] + 1 if kept else -1)
        corruptions.append(kind)
    tree = HostileTree(*map(tuple, (parents, tokens, use_oracle, offset, valid, logscore)))
    tree = dataclasses.replace(tree, corruptions=tuple(corruptions))
    assert tree.keep == tuple(keep)
    return tree


def random_mostly_valid_tree(key, num_slots, *, max_depth, vocab_size, bad_tokens=True):
    """Jittable counterpart of :func:`mostly_valid_trees` for drafters that draw a new tree
    every round: ``(parents, tokens, valid, logscore)`` of a random tree (parent uniform in
    ``[0, i)``, so deep chains overflow ``max_depth`` now and then) with about one node in
    four corrupted, and always at least one malformed parent. With ``bad_tokens=False`` token
    ids stay in ``[0, vocab_size)``."""
    keys = jax.random.split(key, 8)
    n = num_slots
    index = jnp.arange(n, dtype=jnp.int32)
    parents = jnp.floor(jax.random.uniform(keys[0], (n,)) * index.astype(jnp.float32))
    parents = parents.astype(jnp.int32)
    tokens = jax.random.randint(keys[1], (n,), 0, vocab_size)
    logscore = -jax.random.exponential(keys[2], (n,))
    kinds = 8 if bad_tokens else 7
    kind = jnp.where(jax.random.bernoulli(keys[3], 0.25, (n,)), 1, 0) * jax.random.randint(
        keys[4], (n,), 1, kinds + 1
    )
    kind = kind.at[0].set(0)
    pick = jax.random.randint(keys[5], (n,), 0, 4)
    negative = jnp.asarray([-1, -2, -n, I32_MIN], jnp.int32)[pick]
    huge = jnp.asarray([n, n + 1, 2 * n, I32_MAX], jnp.int32)[pick]
    not_before = index + jax.random.randint(keys[6], (n,), 0, 2)  # itself or the next slot
    malformed = (kind >= 1) & (kind <= 3)
    # The last earlier slot with a malformed parent (0, the root, if none).
    last_bad = jax.lax.cummax(jnp.where(malformed, index, 0))
    under_bad = jnp.concatenate([jnp.zeros((1,), jnp.int32), last_bad[:-1]])
    parents = jnp.select(
        [kind == 1, kind == 2, kind == 3, kind == 4, kind == 5],
        [negative, not_before, huge, jnp.maximum(index - 1, 0), under_bad],
        parents,
    )
    valid = kind != 6
    logscore = jnp.where(kind == 7, jnp.asarray([jnp.nan, jnp.inf, -jnp.inf, 0.0])[pick], logscore)
    bad_token = jnp.asarray([-1, vocab_size, I32_MIN, I32_MAX], jnp.int32)[pick]
    tokens = jnp.where(kind == 8, bad_token, tokens)
    # At least one malformed parent: the last slot points at itself if nothing else is bad.
    parents = parents.at[n - 1].set(jnp.where(jnp.any(malformed), parents[n - 1], n - 1))
    return parents, tokens, valid, logscore


# ------------------------------------------------------------------------------------------
# The drafter and the teacher
# ------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class HostileDrafter(StatelessDrafter):
    """Proposes the tree in ``draft_params`` (a :meth:`HostileTree.params` dict) every round.

    A node flagged ``use_oracle`` carries the true greedy token at its build depth, read from
    ``params["oracle"]`` at the current position, so valid oracle paths are accepted and the
    surviving part of the tree is really used. The tree lives in the parameters, not in the
    drafter, so every example runs the same compiled loop.
    """

    prompt_len: int = len(PROMPT)
    budget: int = BUDGET
    depth: int = DEPTH
    name: str = "hostile"

    def propose(self, params, state, context, key):
        oracle = params["oracle"]
        done = context.num_tokens - self.prompt_len  # tokens emitted so far
        at = jnp.clip(done + params["offset"] - 1, 0, oracle.shape[0] - 1)
        tokens = jnp.where(params["use_oracle"], oracle[at], params["tokens"])
        tree = tree_lib.from_parents(
            params["parents"],
            tokens=tokens,
            valid=params["valid"],
            logscore=params["logscore"],
            max_depth=self.depth,
        )
        return Proposal(tree=tree)


DRAFTER = HostileDrafter()


class Setup:
    """The tiny teacher, its raw parameters and its plain greedy continuation (``oracle``,
    long enough for the deepest oracle node). A short repr: hypothesis prints the test's
    arguments on failure."""

    def __init__(self):
        # Larger-than-default weights so the random teacher's greedy output is not constant.
        params = random_params(CFG, jax.random.key(3))
        self.raw_params = jax.tree_util.tree_map(lambda x: x * 3.0 if x.ndim >= 2 else x, params)
        self.teacher = gen.Teacher(CFG, self.raw_params)
        spec = dataclasses.replace(SPEC, max_new_tokens=NEW + DEPTH + 1)
        self.oracle = gen.generate(self.teacher, None, PROMPT, spec).tokens
        assert len(set(self.oracle)) > 2, "the test teacher should not be degenerate"

    def __repr__(self):
        return "Setup(tiny teacher)"

    def generate(self, tree: "HostileTree", spec=SPEC, **kwargs):
        return gen.generate(
            self.teacher, DRAFTER, PROMPT, spec, draft_params=tree.params(self.oracle), **kwargs
        )


@pytest.fixture(scope="module")
def setup():
    return Setup()


def check_output(result, oracle):
    assert result.tokens == oracle[:NEW]  # lossless, whatever the drafter proposed
    assert all(0 <= t < V for t in result.tokens)
    assert all(0 <= a <= DEPTH for a in result.stats.accepted_per_round)
    assert all(0 <= n <= BUDGET for n in result.stats.nodes_per_round)


# ------------------------------------------------------------------------------------------
# Performance mode: never crash, lossless, exact repair
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["drafter", "auto"])
@given(tree=mostly_valid_trees())
def test_hostile_tree_is_lossless(setup, performance_mode, policy, tree):
    spec = dataclasses.replace(SPEC, policy=policy)
    latency = jnp.ones((BUDGET + 1,), jnp.float32) if policy == "auto" else None
    check_output(setup.generate(tree, spec, verify_latency=latency), setup.oracle)


@given(tree=mostly_valid_trees())
def test_repair_keeps_exactly_the_valid_nodes(setup, performance_mode, tree):
    """Every round verifies exactly the nodes the contract keeps: the bad ones and their
    descendants become padding, nothing else is lost (token ids outside the vocabulary
    included)."""
    result = setup.generate(tree)
    kept = sum(tree.keep[1:])
    assert set(result.stats.nodes_per_round) == {kept}, tree.corruptions


# A hand-made mostly-valid tree: an oracle chain 1 -> 2 -> 3, a decoy 4 -> 5 beside it, and
# each structural corruption once. Rows: parent, token, use_oracle, offset, valid, logscore.
FIXED_ROWS = [
    (0, 0, True, 0, True, 0.0),
    (0, 0, True, 1, True, -0.1),  # 1: oracle, depth 1
    (1, 0, True, 2, True, np.nan),  # 2: oracle, depth 2; NaN score
    (2, 0, True, 3, True, -0.3),  # 3: oracle, depth 3
    (0, 17, False, 1, True, -1.0),  # 4: decoy
    (4, 0, True, 2, True, np.inf),  # 5: oracle token under the decoy; infinite score
    (-1, 0, True, 1, True, -0.5),  # 6: negative parent
    (6, 0, True, 2, True, -0.5),  # 7: under the bad node 6
    (3, 0, True, 4, True, -0.5),  # 8: deeper than DEPTH
    (9, 0, True, 1, True, -0.5),  # 9: its own parent
    (0, 0, True, 1, False, -0.5),  # 10: drafter padding
    (10, 0, True, 2, True, -0.5),  # 11: under the padding
]
WELL_FORMED = 6  # slots 0-5


def well_formed_tree(bad_slot=None, bad_token=None):
    """The well-formed part of ``FIXED_ROWS`` (finite scores), then proper padding;
    optionally one token id outside the vocabulary at ``bad_slot``."""
    rows = [list(row[:5]) + [-0.1 * i] for i, row in enumerate(FIXED_ROWS[:WELL_FORMED])]
    if bad_slot is not None:
        rows[bad_slot][1:3] = [bad_token, False]
    rows += [[0, 0, False, 1, False, -1.0]] * (BUDGET + 1 - WELL_FORMED)
    return HostileTree.from_rows(rows)


def test_a_fixed_hostile_tree_is_used_and_lossless(setup, performance_mode):
    tree = HostileTree.from_rows(FIXED_ROWS)
    assert tree.keep == (True,) * WELL_FORMED + (False,) * (BUDGET + 1 - WELL_FORMED)
    result = setup.generate(tree)
    check_output(result, setup.oracle)
    assert set(result.stats.nodes_per_round) == {WELL_FORMED - 1}
    assert sum(result.stats.accepted_per_round) > NEW // 2  # the oracle chain is accepted


# ------------------------------------------------------------------------------------------
# Reference mode: a token id outside [0, V) raises, naming the node
# ------------------------------------------------------------------------------------------


def test_reference_mode_runs_the_well_formed_part(setup, reference_mode):
    """Control: the well-formed part of the tree, all token ids in range, runs in reference
    mode (so the error below is the token's)."""
    result = setup.generate(well_formed_tree())
    check_output(result, setup.oracle)
    assert sum(result.stats.accepted_per_round) > 0


@pytest.mark.parametrize("bad_slot,bad_token", [(3, -1), (4, V)])
def test_reference_mode_rejects_token_ids_outside_the_vocabulary(
    setup, reference_mode, bad_slot, bad_token
):
    with pytest.raises(Exception, match=rf"\b(node|slot) {bad_slot}\b"):
        setup.generate(well_formed_tree(bad_slot, bad_token))


# ------------------------------------------------------------------------------------------
# The torch teacher runner agrees
# ------------------------------------------------------------------------------------------


@settings(max_examples=8)
@given(tree=mostly_valid_trees())
def test_torch_runner_equals_the_jax_engine(setup, performance_mode, tree):
    torch = pytest.importorskip("torch")
    from npu_backend.llama_torch import TorchLlama
    from npu_backend.runner import generate_torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny forwards: threads only contend with XLA's
    try:
        model = TorchLlama(CFG, setup.raw_params, attention_impl="sdpa")
        params = tree.params(setup.oracle)
        result = generate_torch(model, DRAFTER, PROMPT, SPEC, draft_params=params)
    finally:
        torch.set_num_threads(threads)
    expected = setup.generate(tree)
    assert result.tokens == expected.tokens
    assert result.stats.accepted_per_round == expected.stats.accepted_per_round
    assert result.stats.nodes_per_round == expected.stats.nodes_per_round
    check_output(result, setup.oracle)
