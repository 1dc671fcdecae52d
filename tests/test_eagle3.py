"""EAGLE-3 drafter: draft vocabulary, tree proposals (jit, NaN), losslessness, shipped head."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import random_eagle3_head
from hypothesis import given, settings
from hypothesis import strategies as st

from eaglepangu_jax import tree as tree_lib
from eaglepangu_jax.drafters import DRAFTERS, eagle3
from eaglepangu_jax.drafters.vocab import build_vocab, token_counts
from eaglepangu_jax.engine.config import SpecConfig
from eaglepangu_jax.engine.decode import Teacher, generate
from eaglepangu_jax.engine.drafter import DraftContext
from eaglepangu_jax.models.config import LlamaConfig
from eaglepangu_jax.models.init import random_params


@given(st.lists(st.integers(0, 39), max_size=30), st.integers(3, 40))
@settings(max_examples=40, deadline=None)
def test_draft_vocab_is_always_distinct_and_valid(tokens, size):
    counts = token_counts([tokens], 40)
    vocab = build_vocab(counts, size, special_ids=(0, 1, 2))
    d2t = vocab.d2t
    assert d2t.shape == (size,) and len(set(d2t.tolist())) == size
    assert d2t.min() >= 0 and d2t.max() < 40
    assert set([0, 1, 2]) <= set(d2t.tolist())
    distinct = set(tokens) - {0, 1, 2}
    if len(distinct) + 3 <= size:
        assert distinct <= set(d2t.tolist()) and (vocab.coverage == 1.0 or not tokens)
    t2d = vocab.t2d()
    assert np.array_equal(t2d[d2t], np.arange(size))


def test_draft_vocab_orders_by_frequency_and_rejects_bad_sizes():
    counts = np.zeros(10, np.int64)
    counts[[7, 4, 5]] = [5, 9, 1]
    vocab = build_vocab(counts, 5, special_ids=(0, 2))
    assert vocab.d2t.tolist() == [0, 2, 4, 7, 5]
    assert vocab.coverage == 1.0
    with pytest.raises(ValueError, match="size"):
        build_vocab(counts, 11)
    with pytest.raises(ValueError, match="size"):
        build_vocab(counts, 1, special_ids=(0, 1))


@pytest.fixture(scope="module")
def tiny():
    cfg = LlamaConfig.tiny()
    params = random_params(cfg, jax.random.key(0))
    return cfg, params, *random_eagle3_head(cfg, params["embed"])


def _context(cfg, head_cfg, num_tokens=9, capacity=32, depth=4):
    tokens = jnp.asarray(np.arange(capacity) % 50 + 3, jnp.int32)
    feats = jax.random.normal(
        jax.random.key(5), (depth + 1, len(head_cfg.feature_layers), cfg.hidden_size), jnp.float32
    )
    return DraftContext(
        tokens=tokens, num_tokens=jnp.int32(num_tokens), features=feats, num_features=jnp.int32(3)
    )


@pytest.mark.parametrize("poison", ["none", "lm_head_row", "everything"])
def test_propose_gives_a_valid_tree_under_jit_even_with_nan(tiny, poison):
    cfg, _, head_cfg, params = tiny
    drafter = eagle3.Eagle3Drafter(config=head_cfg, budget=10, depth=4, top_k=3)
    head = dict(params["head"])
    if poison == "lm_head_row":
        head["lm_head"] = head["lm_head"].at[:, 5].set(jnp.nan)
    elif poison == "everything":
        head["fc"] = jnp.full_like(head["fc"], jnp.nan)
    params = {**params, "head": head}
    ctx = _context(cfg, head_cfg)

    @jax.jit
    def run(params, ctx):
        state = drafter.init_state(params, ctx)
        return drafter.propose(params, state, ctx, jax.random.key(0)).tree

    tree = run(params, ctx)
    assert tree.num_slots == 11 and tree.max_depth == 4
    assert bool(tree_lib.is_valid(tree))
    assert int(tree.tokens[0]) == int(ctx.tokens[8])
    valid = np.asarray(tree.valid)
    nodes = np.asarray(tree.tokens)[1:][valid[1:]]
    assert set(nodes.tolist()) <= set(np.asarray(params["d2t"]).tolist())
    if poison == "none":
        assert valid.all()
        # Scores never rise along a path and the depth reaches past one level.
        parents = np.asarray(tree.parents)
        score = np.asarray(tree.logscore)
        assert all(score[i] <= score[parents[i]] for i in range(1, 11))
        assert int(np.asarray(tree.depth).max()) >= 2
    if poison == "everything":
        assert valid.tolist() == [True] + [False] * 10


@pytest.mark.parametrize("split", [1, 4, 11])
def test_the_updated_head_state_predicts_what_the_training_time_test_does(tiny, split):
    """After the prompt's features (``split`` of them at first, the rest in a second update
    padded to a longer backlog), the head's kept hidden state gives the root's children the
    logits the training code's first step gives the same slot: the update's one-row attention
    and MLP compute what the all-rows formula of ``ttt_logits`` does."""
    cfg, _, head_cfg, params = tiny
    drafter = eagle3.Eagle3Drafter(config=head_cfg, budget=4, depth=3, top_k=2)
    n, capacity = 13, 32  # tokens[12] is the root; features of positions 0..11
    tokens = jnp.asarray((np.arange(capacity) * 7) % 50 + 3, jnp.int32)
    feats = jax.random.normal(
        jax.random.key(9), (n - 1, len(head_cfg.feature_layers), cfg.hidden_size), jnp.float32
    )
    first = DraftContext(
        tokens=tokens,
        num_tokens=jnp.int32(split + 1),
        features=feats[:split],
        num_features=jnp.int32(split),
    )
    rest = n - 1 - split
    backlog = jnp.zeros((rest + 5, *feats.shape[1:]), jnp.float32).at[:rest].set(feats[split:])
    second = DraftContext(
        tokens=tokens, num_tokens=jnp.int32(n), features=backlog, num_features=jnp.int32(rest)
    )
    state = jax.jit(drafter.update)(params, jax.jit(drafter.init_state)(params, first), second)
    assert int(state.length) == n - 1

    embed = params["embed"].astype(jnp.float32)
    # ttt_logits reads tokens[s + 1] for slot s: the last slot (n - 2) needs the root, so it
    # gets one more token and a padding feature row (causal: slot n - 2 never reads it).
    reference = eagle3.ttt_logits(
        params["head"], head_cfg, embed, jnp.concatenate([feats, feats[:1]]), tokens[:n], 1
    )[0, n - 2]
    ours = eagle3.draft_logits(params["head"], head_cfg, state.last_hidden[None])[0]
    np.testing.assert_allclose(ours, reference, rtol=1e-4, atol=1e-4)
    assert int(jnp.argmax(ours)) == int(jnp.argmax(reference))


def _propose(drafter, params, ctx):
    state = drafter.init_state(params, ctx)
    return jax.jit(drafter.propose)(params, state, ctx, jax.random.key(0)).tree


def _by_depth(tree):
    """The node tokens of each depth, as sets (slot order is the drafter's business)."""
    tokens, depth, valid = (np.asarray(x) for x in (tree.tokens, tree.depth, tree.valid))
    return [set(tokens[(depth == d) & valid].tolist()) for d in range(1, int(depth.max()) + 1)]


def test_a_depth_temperature_of_one_changes_nothing_and_others_keep_the_root_children(tiny):
    cfg, _, head_cfg, params = tiny
    drafter = eagle3.Eagle3Drafter(config=head_cfg, budget=10, depth=4, top_k=3)
    ctx = _context(cfg, head_cfg)
    raw = _propose(drafter, params, ctx)
    same = _propose(drafter, eagle3.with_depth_temperature(params, [1.0]), ctx)
    for a, b in zip(jax.tree_util.tree_leaves(raw), jax.tree_util.tree_leaves(same)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # A temperature keeps each level's ranking, so the root's top-k candidates stay the same
    # tokens (a tree wide enough to keep every candidate shows them all); which candidates the
    # budget keeps may change. Scores along paths still never rise, and a per-depth vector is
    # read depth by depth.
    wide = eagle3.Eagle3Drafter(config=head_cfg, budget=30, depth=4, top_k=3)
    candidates = _by_depth(_propose(wide, params, ctx))[0]
    assert len(candidates) == 3
    for temperature in ([3.0], [0.5, 2.0, 4.0]):
        tuned = eagle3.with_depth_temperature(params, temperature)
        assert _by_depth(_propose(wide, tuned, ctx))[0] == candidates
        hot = _propose(drafter, tuned, ctx)
        assert bool(tree_lib.is_valid(hot))
        assert _by_depth(hot)[0] <= candidates
        parents, score = np.asarray(hot.parents), np.asarray(hot.logscore)
        assert all(score[i] <= score[parents[i]] for i in range(1, 11))
        assert not np.allclose(np.asarray(hot.logscore), np.asarray(raw.logscore))


def test_attention_over_key_blocks_is_the_attention_over_them_joined(tiny):
    """The draft levels attend to (cache, tree rows) as two blocks; the result is that of the
    joined keys, against a literal per-head softmax, and a row that may attend to nothing
    gives zeros."""
    _, _, head_cfg, _ = tiny
    nq, nk, dh = head_cfg.num_heads, head_cfg.num_kv_heads, head_cfg.head_dim
    keys = jax.random.split(jax.random.key(3), 4)
    q = jax.random.normal(keys[0], (3, nq, dh), jnp.float32)
    k = jax.random.normal(keys[1], (7, nk, dh), jnp.float32)
    v = jax.random.normal(keys[2], (7, nk, dh), jnp.float32)
    mask = jax.random.bernoulli(keys[3], 0.6, (3, 7)).at[0, :].set(False).at[1, 2].set(True)
    joined = eagle3.attend(head_cfg, q, k, v, mask)
    blocks = eagle3.attend(head_cfg, q, (k[:5], k[5:]), (v[:5], v[5:]), mask)
    np.testing.assert_allclose(np.asarray(blocks), np.asarray(joined), rtol=1e-5, atol=1e-6)
    qn, kn, vn, mn = (np.asarray(x, np.float64) for x in (q, k, v, mask))
    group = nq // nk
    want = np.zeros((3, nq, dh))
    for t in range(3):
        for n in range(nq):
            allowed = mn[t] > 0
            if not allowed.any():
                continue  # stays zero
            s = kn[allowed, n // group] @ qn[t, n] / np.sqrt(dh)
            p = np.exp(s - s.max())
            want[t, n] = (p / p.sum()) @ vn[allowed, n // group]
    np.testing.assert_allclose(np.asarray(joined), want, rtol=1e-4, atol=1e-5)
    assert not np.asarray(joined[0]).any()


def test_children_can_enter_literal_cases():
    can = eagle3.children_can_enter
    pool = jnp.asarray([-0.5, -0.7, -0.9, -3.0])
    # Three candidates beat the frontier's best (-1.0) strictly: no child can enter a top 3.
    assert not bool(can(jnp.asarray([-1.0, -2.0]), pool, 3))
    # A top 4 still has room (its fourth is -3.0). A child tying the third loses the tie to
    # it (top_k puts the lower index, the earlier candidate, first), so a tie stops.
    assert bool(can(jnp.asarray([-1.0, -2.0]), pool, 4))
    assert not bool(can(jnp.asarray([-0.9, -2.0]), pool, 3))
    assert bool(can(jnp.asarray([-0.8, -2.0]), pool, 3))
    # One node: the root's best child is the frontier's best, and no child beats it.
    assert not bool(can(pool, pool, 1))
    # Fewer candidates than the budget: always grow. NaN scores count as -inf.
    assert bool(can(jnp.asarray([-9.0]), pool[:2], 3))
    assert bool(can(jnp.asarray([-9.0]), jnp.asarray([-0.5, jnp.nan, -0.9]), 3))
    assert not bool(can(jnp.asarray([jnp.nan, -jnp.inf]), pool, 2))


def _jit_propose(drafter):
    """The drafter's tree for ``(params, context)``, from a fresh state, jitted."""

    def propose(params, ctx):
        state = drafter.init_state(params, ctx)
        return drafter.propose(params, state, ctx, jax.random.key(0)).tree

    return jax.jit(propose)


def _sharpened(params, seed, sharpness):
    """``params`` whose head output is perturbed by ``seed`` and scaled by ``sharpness``
    (0.1: a flat head, 40: a confident one)."""
    head = dict(params["head"])
    noise = jax.random.normal(jax.random.key(seed), head["lm_head"].shape, jnp.float32)
    head["lm_head"] = (head["lm_head"] + 0.05 * noise) * sharpness
    return {**params, "head": head}


def _assert_same_tree(got, want, what=""):
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=what)


# (budget, depth, top_k): the shipped shape, a narrow frontier, a budget the pool barely holds.
@pytest.mark.parametrize("shape", [(8, 6, 4), (3, 5, 2), (10, 4, 3)])
def test_early_stop_drafts_the_tree_of_every_level_grown(tiny, shape):
    """The same tree, leaf for leaf, over heads from flat to confident. A tree no deeper than
    ``depth - 2`` means a level was skipped (its best node was beaten by ``budget`` shallower
    ones, which is what stops the growth), so both kinds of round are checked."""
    cfg, _, head_cfg, params = tiny
    budget, depth, top_k = shape
    trees = {
        early_stop: _jit_propose(
            eagle3.Eagle3Drafter(
                config=head_cfg, budget=budget, depth=depth, top_k=top_k, early_stop=early_stop
            )
        )
        for early_stop in (True, False)
    }
    depths = []
    for sharpness in (0.1, 1.0, 8.0, 40.0):
        for seed in range(3):
            tuned = _sharpened(params, seed, sharpness)
            ctx = _context(cfg, head_cfg, depth=depth)
            ctx = dataclasses.replace(
                ctx, features=ctx.features * (1.0 + seed), num_tokens=jnp.int32(9 + seed)
            )
            full = trees[False](tuned, ctx)
            _assert_same_tree(trees[True](tuned, ctx), full)
            assert bool(tree_lib.is_valid(full))
            valid = np.asarray(full.valid)
            depths.append(int(np.asarray(full.depth)[valid].max()))
    assert min(depths) <= depth - 2, depths  # some rounds stopped early
    assert max(depths) >= 3, depths  # and some grew deep


class EveryLevelDrafter(eagle3.Eagle3Drafter):
    """The reference: grows every level down to ``depth``, whatever the budget."""

    @property
    def tree_levels(self) -> int:
        return self.depth


@pytest.mark.parametrize("budget", [1, 2, 3])
def test_small_trees_grow_only_the_levels_they_can_use(tiny, budget):
    """A tree of ``budget`` nodes holds no node deeper than ``budget``: growing only those
    levels (with and without the early stop) drafts the tree of every level grown, leaf for
    leaf, and one node a round runs no head forward."""
    cfg, _, head_cfg, params = tiny
    depth, top_k = 6, 4
    shape = dict(config=head_cfg, budget=budget, depth=depth, top_k=top_k)
    variants = {
        "early stop": eagle3.Eagle3Drafter(**shape),
        "bounded": eagle3.Eagle3Drafter(**shape, early_stop=False),
        "every level": EveryLevelDrafter(**shape, early_stop=False),
    }
    assert variants["bounded"].tree_levels == budget

    trees = {name: _jit_propose(d) for name, d in variants.items()}
    depths = []
    for sharpness in (0.1, 8.0, 40.0, 400.0):
        for seed in range(2):
            tuned = _sharpened(params, seed, sharpness)
            ctx = _context(cfg, head_cfg, depth=depth)
            ctx = dataclasses.replace(ctx, num_tokens=jnp.int32(9 + seed))
            reference = trees["every level"](tuned, ctx)
            for name in ("early stop", "bounded"):
                _assert_same_tree(trees[name](tuned, ctx), reference, name)
            valid = np.asarray(reference.valid)
            assert valid.sum() == budget + 1
            depths.append(int(np.asarray(reference.depth)[valid].max()))
    assert max(depths) <= budget
    if budget > 1:
        assert max(depths) == budget, depths  # a confident head uses the deepest level

    # One node a round: the candidates are the root's children, no head forward runs.
    if budget == 1:
        ctx = _context(cfg, head_cfg, depth=depth)
        drafter = variants["bounded"]
        state = drafter.init_state(params, ctx)
        jaxpr = jax.make_jaxpr(lambda p, s: drafter.propose(p, s, ctx, jax.random.key(0)))(
            params, state
        )
        assert "dot_general" in str(jaxpr)  # the root's marginals: the lm_head product
        every = variants["every level"]
        deep = jax.make_jaxpr(lambda p, s: every.propose(p, s, ctx, jax.random.key(0)))(
            params, state
        )
        assert str(jaxpr).count("dot_general") < str(deep).count("dot_general")


@pytest.mark.parametrize("budget", [1, 2])
def test_a_head_run_no_deeper_than_its_budget_drafts_the_same_trees(tiny, budget):
    """The default tree of a drafter with a budget of its own is cut to that depth
    (methods.make_method): the same nodes and scores as at the full depth, from a state
    whose update read fewer feature rows."""
    cfg, _, head_cfg, params = tiny
    shape = dict(config=head_cfg, budget=budget, top_k=4)
    full, cut = (eagle3.Eagle3Drafter(**shape, depth=d) for d in (6, budget))
    for sharpness in (0.1, 8.0, 400.0):
        for seed in range(2):
            tuned = _sharpened(params, seed, sharpness)
            ctx = _context(cfg, head_cfg, depth=6)
            ctx = dataclasses.replace(ctx, num_tokens=jnp.int32(9 + seed))
            # The engine hands a drafter of depth D a [D + 1, F, H] buffer; a round accepts at
            # most `budget` nodes, so `budget + 1` rows are filled and the rest ignored.
            ctx = dataclasses.replace(ctx, num_features=jnp.int32(budget + 1))
            few = dataclasses.replace(ctx, features=ctx.features[: budget + 1])
            want, got = _jit_propose(full)(tuned, ctx), _jit_propose(cut)(tuned, few)
            for field in ("tokens", "parents", "valid", "depth", "logscore"):
                np.testing.assert_array_equal(
                    np.asarray(getattr(got, field)), np.asarray(getattr(want, field)), field
                )


def test_calibration_times_the_drafter_with_every_level_grown(tiny, monkeypatch):
    from eaglepangu_jax.calibration import measure
    from eaglepangu_jax.engine.drafter import costliest
    from eaglepangu_jax.methods.registry import Method

    cfg, params, head_cfg, dparams = tiny
    drafter = eagle3.Eagle3Drafter(config=head_cfg, budget=4, depth=3, top_k=2)
    assert drafter.early_stop and not costliest(drafter).early_stop
    assert costliest(costliest(drafter)) == costliest(drafter)
    assert costliest(None) is None
    timed = []
    real = measure._engine_draft

    def record(static, *args):
        timed.append(static.drafter)
        return real(static, *args)

    monkeypatch.setattr(measure, "_engine_draft", record)
    spec = SpecConfig(policy="best_first", budget=4, depth=3, max_new_tokens=8)
    method = Method(name="eagle3", spec=spec, drafter=drafter, draft_params=dparams)
    seconds = measure.measure_draft(Teacher(cfg, params), method, context=12, repeats=1)
    assert seconds > 0 and timed and all(d == costliest(drafter) for d in timed)


def test_depth_temperature_is_validated_and_read_from_the_shipped_calibration(tiny, monkeypatch):
    _, params, head_cfg, dparams = tiny
    for bad in ([], [0.0], [1.0, -2.0], [float("nan")]):
        with pytest.raises(ValueError, match="depth_temperature"):
            eagle3.with_depth_temperature(dparams, bad)
    from eaglepangu_jax.drafters import shipped

    def packaged(meta):
        head, d2t = dparams["head"], dparams["d2t"]
        return lambda *args: (head_cfg, head, d2t, params["embed"], meta)

    monkeypatch.setattr(shipped, "load_packaged", packaged({}))
    _, plain = eagle3.load_shipped_eagle3(params)
    assert "depth_temperature" not in plain
    monkeypatch.setattr(
        shipped, "load_packaged", packaged({"calibration": {"depth_temperature": [1.5, 2.0]}})
    )
    _, tuned = eagle3.load_shipped_eagle3(params)
    assert np.asarray(tuned["depth_temperature"]).tolist() == [1.5, 2.0]


def test_a_temperature_per_tree_size_is_picked_by_the_drafters_budget(tiny, monkeypatch):
    cfg, params, head_cfg, dparams = tiny
    every = eagle3.with_depth_temperature(dparams, [3.0])
    sized = eagle3.with_depth_temperature(every, [2.0], budget=3)
    sized = eagle3.with_depth_temperature(sized, [1.5, 4.0], budget=6)
    picked = {b: eagle3.depth_temperature_for(sized, b) for b in (1, 3, 4, 6, 7, 16)}
    assert {b: np.asarray(t).tolist() for b, t in picked.items()} == {
        1: [2.0],  # the smallest listed size that holds the tree
        3: [2.0],
        4: [1.5, 4.0],
        6: [1.5, 4.0],
        7: [3.0],  # larger than every listed size: the temperature of every size
        16: [3.0],
    }
    assert eagle3.depth_temperature_for(dparams, 3) is None  # no calibration: raw marginals
    # A temperature for every size replaces the per-size entries (a sweep sets one for all).
    assert "budget_temperature" not in eagle3.with_depth_temperature(sized, [1.0])
    with pytest.raises(ValueError, match="budget must be >= 1"):
        eagle3.with_depth_temperature(dparams, [2.0], budget=0)
    # The drafter drafts at its own size's entry: a 3-node tree under the table is the tree
    # the 3-node temperature alone gives, and differs from the one of every size.
    ctx = _context(cfg, head_cfg)
    drafter = eagle3.Eagle3Drafter(config=head_cfg, budget=3, depth=3, top_k=3)
    at_two = _propose(drafter, eagle3.with_depth_temperature(dparams, [2.0]), ctx)
    _assert_same_tree(_propose(drafter, sized, ctx), at_two)
    at_three = _propose(drafter, every, ctx)
    assert not np.allclose(np.asarray(at_two.logscore), np.asarray(at_three.logscore))
    # The shipped export's calibration stores the entries under by_budget.
    from eaglepangu_jax.drafters import shipped

    calibration = {"depth_temperature": [3.0], "by_budget": {"3": {"depth_temperature": [2.0]}}}
    meta = {"calibration": calibration}
    monkeypatch.setattr(
        shipped,
        "load_packaged",
        lambda *args: (head_cfg, dparams["head"], dparams["d2t"], params["embed"], meta),
    )
    _, loaded = eagle3.load_shipped_eagle3(params)
    assert np.asarray(eagle3.depth_temperature_for(loaded, 3)).tolist() == [2.0]
    assert np.asarray(eagle3.depth_temperature_for(loaded, 8)).tolist() == [3.0]
    no_size, no_temperature = {"x": {"depth_temperature": [2]}}, {"3": {}}
    for broken in (no_size, no_temperature, {"3": {"depth_temperature": []}}):
        with pytest.raises(ValueError, match="by_budget|depth_temperature"):
            eagle3.with_calibration(dparams, {"by_budget": broken})


def test_registered_and_validates():
    assert DRAFTERS["eagle3"] is eagle3.Eagle3Drafter
    head_cfg = eagle3.Eagle3Config.for_teacher(LlamaConfig.tiny(), 8)
    with pytest.raises(ValueError, match="top_k"):
        eagle3.Eagle3Drafter(config=head_cfg, top_k=9)
    with pytest.raises(ValueError, match="budget"):
        eagle3.Eagle3Drafter(config=head_cfg, budget=0)


def test_generation_with_eagle3_equals_greedy(tiny):
    cfg, params, head_cfg, dparams = tiny
    teacher = Teacher(cfg, params)
    drafter = eagle3.Eagle3Drafter(config=head_cfg, budget=6, depth=3, top_k=2)
    spec = SpecConfig(policy="drafter", budget=6, depth=3, max_new_tokens=24)
    for prompt in ([5, 9, 13, 17, 21, 25, 29], [7]):
        plain = generate(teacher, None, prompt, spec)
        spec_out = generate(teacher, drafter, prompt, spec, draft_params=dparams)
        assert spec_out.tokens == plain.tokens
        assert spec_out.stats.rounds <= plain.stats.rounds


# Real model, kept in `make test` (not marked slow): the shipped head end to end.
def test_shipped_head_on_real_teacher_is_lossless_and_accepts():
    from eaglepangu_jax.models import chat, llama, smollm2, tokenizer

    cfg, params = smollm2.load_smollm2()
    teacher = Teacher(cfg, llama.prepare_params(params))
    drafter, dparams = eagle3.load_shipped_eagle3(params, budget=16, depth=6, top_k=4)
    tok = tokenizer.load_tokenizer()
    prompt = chat.encode_chat(tok, [{"role": "user", "content": "What is the capital of France?"}])
    spec = SpecConfig(policy="drafter", budget=16, depth=6, max_new_tokens=32)
    plain = generate(teacher, None, prompt, spec)
    out = generate(teacher, drafter, prompt, spec, draft_params=dparams)
    assert out.tokens == plain.tokens
    assert out.stats.accepted_length > 1.0


def test_mtp_is_registered_as_a_trained_one_token_method():
    from eaglepangu_jax.drafters import registry
    from eaglepangu_jax.methods import METHODS

    assert "mtp" in registry.NAMES and "mtp" in registry.TRAINED and "mtp" in METHODS


@pytest.mark.slow
def test_mtp_drafts_one_token_per_round_and_is_lossless_on_the_real_teacher():
    from eaglepangu_jax.methods import make_method
    from eaglepangu_jax.models import chat, llama, smollm2, tokenizer

    cfg, params = smollm2.load_smollm2()
    teacher = Teacher(cfg, llama.prepare_params(params))
    method = make_method("mtp", SpecConfig(policy="drafter", budget=8, depth=6, max_new_tokens=32))
    assert (method.spec.budget, method.spec.depth, method.drafter.top_k) == (1, 1, 1)
    tok = tokenizer.load_tokenizer()
    prompt = chat.encode_chat(tok, [{"role": "user", "content": "Name three primary colours."}])
    plain = generate(teacher, None, prompt, method.spec)
    out = generate(teacher, method.drafter, prompt, method.spec, draft_params=method.draft_params)
    assert out.tokens == plain.tokens
    assert set(out.stats.nodes_per_round) <= {0, 1} and max(out.stats.accepted_per_round) == 1
