"""FallbackDrafter: the first drafter's tree when it holds a node, else the second's; lossless
in the engine; built as the ``ngram-eagle3`` method."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import random_eagle3_head

from eaglepangu_jax import tree as tree_lib
from eaglepangu_jax.drafters import DRAFTERS, block, eagle3
from eaglepangu_jax.drafters.fallback import FallbackDrafter
from eaglepangu_jax.drafters.ngram import NGramDrafter
from eaglepangu_jax.drafters.registry import configure_drafter
from eaglepangu_jax.engine.config import SpecConfig
from eaglepangu_jax.engine.decode import Teacher, generate
from eaglepangu_jax.engine.drafter import DraftContext, Proposal
from eaglepangu_jax.methods.registry import DRAFTER_BUDGETS, Method, make_method
from eaglepangu_jax.models.config import LlamaConfig
from eaglepangu_jax.models.init import random_params

CFG = LlamaConfig.tiny()


@pytest.fixture(scope="module")
def tiny():
    params = random_params(CFG, jax.random.key(0))
    return params, *random_eagle3_head(CFG, params["embed"])


def _pair(head_cfg, budget=6, depth=4):
    return FallbackDrafter(
        primary=NGramDrafter(budget=budget, depth=depth),
        fallback=eagle3.Eagle3Drafter(config=head_cfg, budget=1, depth=1),
    )


def _context(head_cfg, tokens, capacity=32):
    buffer = np.zeros(capacity, np.int32)
    buffer[: len(tokens)] = tokens
    feats = jax.random.normal(
        jax.random.key(5), (5, len(head_cfg.feature_layers), CFG.hidden_size), jnp.float32
    )
    return DraftContext(
        tokens=jnp.asarray(buffer),
        num_tokens=jnp.int32(len(tokens)),
        features=feats,
        num_features=jnp.int32(3),
    )


def _assert_same_tree(got, want):
    for field in ("tokens", "parents", "valid", "depth", "ancestors", "logscore"):
        np.testing.assert_array_equal(np.asarray(getattr(got, field)), getattr(want, field))


@pytest.mark.parametrize("graft", [True, False])
@pytest.mark.parametrize(
    "tokens, matched",
    [
        ([5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6], True),  # the suffix "5 6" occurred before
        ([5, 9, 13, 17, 21, 25, 29, 33], False),  # no token repeats: no n-gram match
    ],
)
def test_the_primary_tree_when_it_has_a_node_else_the_fallback_tree(tiny, tokens, matched, graft):
    """With a match: n-gram's tree, plus (``graft``) the head's node in its first free slot;
    without: the head's tree, widened to n-gram's shape."""
    _, head_cfg, head_params = tiny
    drafter = dataclasses.replace(_pair(head_cfg), graft=graft)
    params = {"primary": None, "fallback": head_params}
    ctx = _context(head_cfg, tokens)
    state = jax.jit(drafter.init_state)(params, ctx)
    got = jax.jit(drafter.propose)(params, state, ctx, jax.random.key(0)).tree
    ngram = drafter.primary.propose(None, None, ctx, jax.random.key(0)).tree
    assert bool(jnp.any(ngram.valid[1:])) == matched
    head_tree = drafter.fallback.propose(head_params, state[1], ctx, jax.random.key(0)).tree
    head_wide = tree_lib.widen(head_tree, ngram.num_slots, ngram.max_depth)
    assert (got.num_slots, got.max_depth) == (7, 4)
    if not matched:
        _assert_same_tree(got, head_wide)
        return
    m = int(jnp.sum(ngram.valid[1:]))
    assert m + 1 < ngram.num_slots and bool(jnp.all(ngram.valid[: m + 1]))  # room left
    # The n-gram nodes are kept as they were.
    for field in ("tokens", "parents", "valid", "depth", "logscore"):
        np.testing.assert_array_equal(getattr(got, field)[: m + 1], getattr(ngram, field)[: m + 1])
    head_token = int(head_tree.tokens[1])
    held = head_token in {
        int(t) for t, d, v in zip(ngram.tokens, ngram.depth, ngram.valid) if v and d == 1
    }
    added = graft and not held
    assert int(jnp.sum(got.valid[1:])) == m + added
    if added:
        assert (int(got.tokens[m + 1]), int(got.parents[m + 1])) == (head_token, 0)
        assert float(got.logscore[m + 1]) == float(head_tree.logscore[1])


@pytest.mark.parametrize("policy", ["drafter", "best_first"])
def test_generation_equals_greedy(tiny, policy):
    params, head_cfg, head_params = tiny
    teacher = Teacher(CFG, params)
    drafter = _pair(head_cfg)
    spec = SpecConfig(policy=policy, budget=6, depth=4, max_new_tokens=24)
    dparams = {"primary": None, "fallback": head_params}
    for prompt in ([5, 9, 13, 17, 21, 25, 29], [7, 8, 9, 7, 8, 9, 7, 8], [7]):
        plain = generate(teacher, None, prompt, spec)
        out = generate(teacher, drafter, prompt, spec, draft_params=dparams)
        assert out.tokens == plain.tokens
        assert out.stats.rounds <= plain.stats.rounds


def test_configuring_the_pair_sets_the_primary_and_caps_the_fallback(tiny):
    _, head_cfg, _ = tiny
    wide = FallbackDrafter(
        primary=NGramDrafter(budget=8, depth=6),
        fallback=eagle3.Eagle3Drafter(config=head_cfg, budget=4, depth=3),
    )
    small = configure_drafter(wide, budget=2, depth=5)
    assert (small.primary.budget, small.primary.depth) == (2, 5)
    assert (small.fallback.budget, small.fallback.depth) == (2, 3)
    assert (small.budget, small.max_depth) == (2, 5)
    assert small.feature_layers == tuple(head_cfg.feature_layers)
    assert small.name == "ngram-eagle3"


def test_the_pairs_cost_key_changes_when_a_parts_drafting_cost_does(tiny):
    """A calibration keeps each method's drafting cost under a key naming the drafter's cost
    revision; a pair's names its parts', so the pair is timed again when its head's update
    gets cheaper, as the head alone is."""
    from eaglepangu_jax.calibration.curve import draft_cost_key

    _, head_cfg, _ = tiny

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Revised(eagle3.Eagle3Drafter):
        cost_revision = eagle3.Eagle3Drafter.cost_revision + 1

    pair = _pair(head_cfg)
    revised = dataclasses.replace(pair, fallback=Revised(config=head_cfg, budget=1, depth=1))
    assert pair.cost_revision == eagle3.Eagle3Drafter.cost_revision  # n-gram has none
    spec = SpecConfig(budget=6, depth=4)
    keys = [
        draft_cost_key(Method(name="ngram-eagle3", spec=spec, drafter=d)) for d in (pair, revised)
    ]
    assert keys[0] == f"ngram-eagle3:budget=6,depth=4,rev={eagle3.Eagle3Drafter.cost_revision}"
    assert keys[1] != keys[0]


def test_trees_that_cannot_be_combined_are_refused_by_name(tiny):
    _, head_cfg, head_params = tiny
    ngram = NGramDrafter(budget=4, depth=3)
    with pytest.raises(ValueError, match="budget 6 is above the primary's 4"):
        FallbackDrafter(ngram, eagle3.Eagle3Drafter(config=head_cfg, budget=6, depth=2))
    with pytest.raises(ValueError, match="depth 5 is above the primary's 3"):
        FallbackDrafter(ngram, eagle3.Eagle3Drafter(config=head_cfg, budget=2, depth=5))
    other = dataclasses.replace(head_cfg, feature_layers=(0,))
    with pytest.raises(ValueError, match="different teacher layers"):
        FallbackDrafter(
            eagle3.Eagle3Drafter(config=head_cfg, budget=4, depth=3),
            eagle3.Eagle3Drafter(config=other, budget=1, depth=1),
        )
    # A block drafter proposes marginals, not a tree of a node budget.
    block_cfg = block.BlockConfig.for_teacher(CFG, 24, block_size=3, num_layers=1)
    with pytest.raises(ValueError, match="fallback drafter \\(BlockDrafter\\) has no node budget"):
        FallbackDrafter(ngram, block.BlockDrafter(config=block_cfg))


@dataclasses.dataclass(frozen=True)
class _SampledChildren(NGramDrafter):
    """An n-gram drafter whose proposal claims sampled children (a ``draft_probs``)."""

    def propose(self, params, state, context, key):
        tree = super().propose(params, state, context, key).tree
        return Proposal(tree=tree, draft_probs=jnp.zeros((tree.num_slots, CFG.vocab_size)))


def test_a_proposal_with_sampled_children_is_refused_by_name(tiny):
    _, head_cfg, head_params = tiny
    pair = FallbackDrafter(
        _SampledChildren(budget=4, depth=3),
        eagle3.Eagle3Drafter(config=head_cfg, budget=1, depth=1),
    )
    params = {"primary": None, "fallback": head_params}
    ctx = _context(head_cfg, [5, 9, 13, 5, 9])
    state = pair.init_state(params, ctx)
    with pytest.raises(ValueError, match="primary drafter \\(_SampledChildren\\) must propose"):
        pair.propose(params, state, ctx, jax.random.key(0))


def test_ngram_eagle3_method_pairs_ngram_with_the_head_at_its_own_default_tree(tiny):
    _, head_cfg, head_params = tiny
    assert DRAFTERS["ngram-eagle3"] is FallbackDrafter

    def loader():
        return eagle3.Eagle3Drafter(config=head_cfg), head_params

    spec = SpecConfig(budget=8, depth=6)
    method = make_method("ngram-eagle3", spec, eagle3_loader=loader)
    pair, own = method.drafter, DRAFTER_BUDGETS["eagle3"]
    assert isinstance(pair.primary, NGramDrafter)
    assert (pair.primary.budget, pair.primary.depth) == (8, 6)
    assert (pair.fallback.budget, pair.fallback.depth) == (own, own)
    assert (method.spec.budget, method.spec.depth) == (8, 6)
    assert method.draft_params == {"primary": None, "fallback": head_params}
    deep = make_method("ngram-eagle3:3", spec, eagle3_loader=loader)
    assert (deep.spec.depth, deep.drafter.primary.depth, deep.drafter.fallback.depth) == (3, 3, 1)


def test_the_retrieval_drafter_of_a_pair_is_built_as_it_runs_alone(tiny):
    """Each ``HEAD_PAIRS`` method's primary is the drafter its retrieval method builds alone
    at the same settings (same tree, same params)."""
    from eaglepangu_jax.methods.registry import HEAD_PAIRS

    _, head_cfg, head_params = tiny

    def loader():
        return eagle3.Eagle3Drafter(config=head_cfg), head_params

    assert HEAD_PAIRS == {"ngram-eagle3": "ngram"}
    for pair_name, retrieval in HEAD_PAIRS.items():
        spec = SpecConfig(budget=8, depth=5)
        pair = make_method(pair_name, spec, eagle3_loader=loader)
        alone = make_method(retrieval, spec)
        assert pair.drafter.primary == alone.drafter
        assert pair.draft_params["primary"] is alone.draft_params
