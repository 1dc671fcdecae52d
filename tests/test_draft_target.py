"""The draft-target drafter: its cache rolls back and refills exactly, a perfect draft is always
accepted, greedy output is plain greedy's, sampling with ``draft_probs`` follows the teacher's
law exactly (chi-square, with a negative control), and a foreign vocabulary is refused.

The tiny teacher has untied embeddings: with tied ones a random model mostly repeats its input
token, which any draft guesses, so rejections (and rollbacks) would never happen.
"""

import collections
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.stats import chisquare

from eaglepangu_jax.calibration import curve
from eaglepangu_jax.drafters import draft_target, registry
from eaglepangu_jax.drafters.draft_target import (
    DraftTargetDrafter,
    chain_lengths,
    tree_layout,
    truncated_teacher,
)
from eaglepangu_jax.engine import decode as gen
from eaglepangu_jax.engine import sampling
from eaglepangu_jax.engine.config import SpecConfig
from eaglepangu_jax.engine.drafter import fit_budget, max_nodes_of
from eaglepangu_jax.engine.step import StepStatic, catch_up, speculative_step
from eaglepangu_jax.methods import registry as methods
from eaglepangu_jax.models import llama
from eaglepangu_jax.models.config import LlamaConfig
from eaglepangu_jax.models.init import random_params

CFG = LlamaConfig.tiny(tie_embeddings=False)
PROMPT = [5, 17, 33, 8, 5, 17, 40, 2, 9, 11]
NO_EOS = -7  # never produced: every run has exactly max_new_tokens tokens


@pytest.fixture(scope="module")
def teacher():
    return gen.Teacher(CFG, random_params(CFG, jax.random.key(0)))


@pytest.fixture(scope="module")
def plain(teacher):
    """Plain greedy decoding of ``PROMPT`` (30 tokens; the tree settings do not matter)."""
    return gen.generate(teacher, None, PROMPT, SpecConfig(max_new_tokens=30, eos_id=NO_EOS))


def drafter_for(teacher, layers, **settings):
    """The teacher's first ``layers`` layers as the draft, and its params."""
    config, params = truncated_teacher(teacher.params, CFG, layers)
    return DraftTargetDrafter(config=config, teacher_config=CFG, **settings), params


def spec_of(drafter, **extra):
    return SpecConfig(
        budget=drafter.budget, depth=drafter.depth, eos_id=NO_EOS, max_new_tokens=30, **extra
    )


# ------------------------------------------------------------------------------ the tree


def test_chain_lengths_fill_chains_in_rank_order():
    assert chain_lengths(5, 3, 2) == (3, 2)
    assert chain_lengths(8, 6, 4) == (6, 2)
    assert chain_lengths(4, 4, 1) == (4,)
    assert chain_lengths(12, 2, 3) == (2, 2, 2)


def test_tree_layout_is_the_docstring_example():
    chain, level, parents = tree_layout((3, 2))
    assert chain.tolist() == [0, 0, 0, 1, 1]
    assert level.tolist() == [1, 2, 3, 1, 2]
    assert parents.tolist() == [0, 0, 1, 2, 0, 4]


# ----------------------------------------------------------- 1. rollback and refill exact


ROUND_CASES = {
    "chain": (dict(top_k=1, budget=3, depth=3), dict(policy="drafter")),
    "top2-tree": (dict(top_k=2, budget=6, depth=3), dict(policy="drafter")),
    "top2-sampled": (
        dict(top_k=2, budget=6, depth=3, temperature=1.0),
        dict(policy="drafter", acceptance="sample", temperature=1.0),
    ),
    "auto": (dict(top_k=2, budget=6, depth=3), dict(policy="auto")),
}


# Each case compiles its own loop; `make test` runs three, `make test-all` all of them.
@pytest.mark.parametrize(
    "case",
    [
        c if c in ("top2-sampled", "auto") else pytest.param(c, marks=pytest.mark.slow)
        for c in ROUND_CASES
    ],
)
def test_cache_after_each_round_equals_a_rebuilt_one(teacher, case):
    settings, extra = ROUND_CASES[case]
    drafter, params = drafter_for(teacher, 2, **settings)
    spec = spec_of(drafter, **extra)
    capacity = gen.cache_slots(len(PROMPT), spec, CFG.max_position)
    state = gen.init_state(
        teacher, drafter, params, PROMPT, spec, capacity=capacity, key=jax.random.key(3)
    )
    static = StepStatic(teacher=CFG, drafter=drafter, spec=spec, window=capacity)
    latency = gen.nominal_verify_latency(CFG, spec, len(PROMPT)) if spec.policy == "auto" else None
    step = jax.jit(speculative_step, static_argnums=0)
    accepted = []
    while not bool(state.done):
        state, info = step(static, teacher.params, params, state, latency)
        accepted.append(int(info.acceptance.length))
        # Under "auto" the drafter may skip rounds and catch up when it next drafts: the
        # caught-up cache is the one that must equal a rebuilt one.
        ours = catch_up(static, params, state).drafter_state
        fresh = drafter.init_state(params, state.context(spec.draft_window))
        n = int(state.num_tokens)
        assert int(ours.cache.length) == int(fresh.cache.length) == n  # the root included
        np.testing.assert_allclose(ours.cache.k[:, :n], fresh.cache.k[:, :n], atol=1e-5)
        np.testing.assert_allclose(ours.cache.v[:, :n], fresh.cache.v[:, :n], atol=1e-5)
        np.testing.assert_allclose(ours.logits, fresh.logits, rtol=1e-5, atol=1e-4)
    # Both kinds of round happened: some drafted nodes accepted, some rolled back.
    assert max(accepted) > 0 and min(accepted) < drafter.depth, accepted


# ------------------------------------------------------------ 2. a perfect draft


@pytest.mark.parametrize(
    "settings",
    [
        pytest.param(dict(top_k=1, budget=4, depth=4), marks=pytest.mark.slow),
        pytest.param(dict(top_k=2, budget=8, depth=4), marks=pytest.mark.slow),
        dict(top_k=1, budget=4, depth=4, temperature=1.0),
    ],
    ids=["chain", "top2-tree", "sampled-chain"],
)
def test_the_teacher_as_its_own_draft_accepts_every_drafted_token(teacher, settings):
    drafter, params = drafter_for(teacher, CFG.num_layers, **settings)
    sampled = dict(acceptance="sample", temperature=1.0) if drafter.sampling else {}
    spec = spec_of(drafter, policy="drafter", **sampled)
    result = gen.generate(teacher, drafter, PROMPT, spec, draft_params=params)
    assert set(result.stats.accepted_per_round) == {drafter.depth}
    assert result.stats.accepted_length > drafter.depth


# ------------------------------------------------------------ 3. greedy is plain greedy


@pytest.mark.parametrize(
    "settings,policy",
    [
        (dict(top_k=1, budget=4, depth=4), "drafter"),
        pytest.param(dict(top_k=3, budget=7, depth=3), "drafter", marks=pytest.mark.slow),
        pytest.param(dict(top_k=2, budget=6, depth=3), "auto", marks=pytest.mark.slow),
        (dict(top_k=2, budget=6, depth=3), "window"),
    ],
    ids=["chain", "top3-tree", "top2-auto", "top2-draft-window"],
)
def test_greedy_output_is_plain_greedy(teacher, plain, settings, policy):
    drafter, params = drafter_for(teacher, 1, **settings)
    window = dict(policy="drafter", draft_window=6) if policy == "window" else dict(policy=policy)
    spec = spec_of(drafter, **window)
    ours = gen.generate(teacher, drafter, PROMPT, spec, draft_params=params)
    assert ours.tokens == plain.tokens
    assert ours.stats.rounds < plain.stats.rounds or policy == "auto"


@pytest.mark.slow
def test_real_teacher_truncated_greedy_is_plain_greedy():
    from eaglepangu_jax import runtime
    from eaglepangu_jax.models.smollm2 import ModelNotInstalledError

    try:
        real = runtime.load_teacher()
    except ModelNotInstalledError as err:
        pytest.skip(str(err))
    drafter, params = draft_target.load_draft_target(
        real.params, teacher_config=real.config, budget=4, depth=2, top_k=2
    )
    prompt = runtime.load_renderer().encode([{"role": "user", "content": "Count to twenty."}])
    spec = SpecConfig(policy="drafter", budget=4, depth=2, max_new_tokens=24)
    plain = gen.generate(real, None, prompt, spec)
    ours = gen.generate(real, drafter, prompt, spec, draft_params=params)
    assert ours.tokens == plain.tokens
    assert ours.stats.rounds < plain.stats.rounds  # the truncated teacher is accepted at times


# ------------------------------------------------- 4. sampling with draft_probs is exact

V = 8
SMALL = LlamaConfig.tiny(vocab_size=V, num_layers=2)
SMALL_PROMPT = [t % V for t in PROMPT]
SAMPLES = 4000
CHUNK = 1000
PASS_P, CONTROL_P = 1e-3, 1e-6


@pytest.fixture(scope="module")
def small_teacher():
    params = random_params(SMALL, jax.random.key(7))
    # Shrunk logits spread the mass over many (x1, x2) cells (see test_engine_sampling).
    return gen.Teacher(SMALL, dict(params, final_norm=params["final_norm"] * 0.15))


@pytest.fixture(scope="module")
def small_draft():
    """An independent one-layer model with the teacher's vocabulary, sampled under a nucleus:
    its law is unlike the teacher's, so drafts are often rejected and the residual draws
    matter."""
    config = dataclasses.replace(SMALL, num_layers=1)
    params = random_params(config, jax.random.key(11))
    params = dict(params, final_norm=params["final_norm"] * 0.3)
    drafter = DraftTargetDrafter(
        config=config, teacher_config=SMALL, budget=3, depth=2, top_k=2, temperature=1.0, top_p=0.9
    )
    return drafter, llama.prepare_params(params)


@dataclasses.dataclass(frozen=True, kw_only=True)
class WrongProbsDrafter(DraftTargetDrafter):
    """The negative control: draws children like its parent but reports a uniform ``q``."""

    def propose(self, params, state, context, key):
        proposal = super().propose(params, state, context, key)
        uniform = jnp.full_like(proposal.draft_probs, 1.0 / V)
        return dataclasses.replace(proposal, draft_probs=uniform)


@jax.jit
def _forward_all(params, tokens):
    """Logits ``[B, T, V]`` of whole sequences, each from an empty cache."""
    return jax.vmap(lambda seq: llama.forward_sequence(params, seq, config=SMALL)[0])(tokens)


def exact_law(teacher):
    """``[V, V]``: the teacher's law of the first two new tokens at temperature 1."""
    seqs = jnp.asarray([SMALL_PROMPT + [a] for a in range(V)], jnp.int32)
    logits = np.asarray(_forward_all(teacher.params, seqs), np.float64)

    def softmax(x):
        e = np.exp(x - x.max(axis=-1, keepdims=True))
        return e / e.sum(axis=-1, keepdims=True)

    return softmax(logits[0, -2])[:, None] * softmax(logits[:, -1])


def p_value(samples, law):
    """Chi-square p-value of ``(x1, x2)`` samples against ``law``; cells expecting fewer
    than 5 draws are pooled by first token, then into one cell."""
    seqs = np.asarray(samples)
    assert (law[tuple(seqs.T)] > 0).all()
    cell_of, probs = np.full(law.shape, -1), []
    for k in (2, 1, 0):
        groups = collections.defaultdict(list)
        for seq in zip(*np.nonzero((cell_of < 0) & (law > 0))):
            groups[seq[:k]].append(seq)
        for members in groups.values():
            mass = sum(law[s] for s in members)
            if mass * len(seqs) >= 5 or k == 0:
                for s in members:
                    cell_of[s] = len(probs)
                probs.append(mass)
    observed = np.bincount(cell_of[tuple(seqs.T)], minlength=len(probs))
    assert len(probs) > 20, "too few cells for a meaningful test"
    return chisquare(observed, np.asarray(probs) / sum(probs) * len(seqs)).pvalue


def engine_samples(teacher, drafter, params):
    """``SAMPLES`` two-token continuations, and the accepted draft nodes of every round."""
    spec = SpecConfig(
        policy="drafter",
        budget=drafter.budget,
        depth=drafter.depth,
        acceptance="sample",
        temperature=1.0,
        max_new_tokens=2,
        eos_id=NO_EOS,
        seed=5,
    )
    logs, real = [], sampling.decode_loop

    def spy(*args, **kwargs):
        state = real(*args, **kwargs)
        logs.append(np.asarray(state.accepted_log))
        return state

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sampling, "decode_loop", spy)
        samples = sampling.sample_many(
            teacher, drafter, SMALL_PROMPT, spec, SAMPLES, draft_params=params, chunk=CHUNK
        )
    accepted = np.concatenate(logs)
    return samples, accepted[accepted >= 0]


def test_sampled_drafts_leave_the_teacher_law_exact(small_teacher, small_draft):
    drafter, params = small_draft
    samples, accepted = engine_samples(small_teacher, drafter, params)
    # The draft really speculates: some rounds accept drafted tokens, some reject them all.
    assert 0.05 < np.mean(accepted > 0) < 0.95, np.mean(accepted > 0)
    assert p_value(samples, exact_law(small_teacher)) > PASS_P


def test_negative_control_wrong_draft_probs_are_rejected(small_teacher, small_draft):
    drafter, params = small_draft
    wrong = WrongProbsDrafter(
        **{f.name: getattr(drafter, f.name) for f in dataclasses.fields(drafter)}
    )
    samples, _ = engine_samples(small_teacher, wrong, params)
    assert p_value(samples, exact_law(small_teacher)) < CONTROL_P


# ------------------------------------------------------ 5. a foreign vocabulary is refused


def test_a_foreign_vocabulary_is_refused():
    with pytest.raises(ValueError, match=r"50 tokens.*97"):
        DraftTargetDrafter(config=LlamaConfig.tiny(vocab_size=50), teacher_config=CFG)
    with pytest.raises(ValueError, match="another tokenizer"):
        DraftTargetDrafter(config=LlamaConfig.tiny(eos_id=3), teacher_config=CFG)
    with pytest.raises(ValueError, match=r"50 tokens.*97"):
        registry.make_drafter(
            "draft-target", config=LlamaConfig.tiny(vocab_size=50), teacher_config=CFG
        )


# --------------------------------------------------------------------- the wiring


def test_it_is_registered_untrained_and_offered_on_the_command_line():
    from eaglepangu_jax.cli.generate import DRAFTER_CHOICES

    assert "draft-target" in registry.NAMES and "draft-target" not in registry.TRAINED
    assert "draft-target" in DRAFTER_CHOICES
    assert methods.parse_methods("greedy,draft-target") == ("greedy", "draft-target")


def test_make_method_builds_it_for_the_spec(teacher, monkeypatch):
    drafter, params = drafter_for(teacher, 2)
    monkeypatch.setattr(draft_target, "load_draft_target", lambda: (drafter, params))
    methods._truncated_teacher_draft.cache_clear()
    try:
        default = methods.make_method("draft-target", SpecConfig(budget=6), default_depth=True)
        sampled = methods.make_method(
            "draft-target",
            SpecConfig(budget=5, depth=3, acceptance="sample", temperature=0.7, top_p=0.9),
        )
        three_chains = methods.make_method(
            "draft-target", SpecConfig(budget=6, depth=2), draft_top_k=3
        )
        with pytest.raises(ValueError, match="draft_top_k must be >= 1, got 0"):
            methods.make_method("draft-target", SpecConfig(budget=6), draft_top_k=0)
    finally:
        methods._truncated_teacher_draft.cache_clear()
    assert default.spec.depth == default.drafter.depth == draft_target.DEFAULT_DEPTH
    assert default.drafter.top_k == sampled.drafter.top_k == draft_target.DEFAULT_TOP_K
    assert three_chains.drafter.top_k == 3 and three_chains.drafter.lengths == (2, 2, 2)
    # Two chains of 2 fill 4 of the 6 nodes: the method's budget (the verified tree) is 4.
    assert default.drafter.max_nodes == default.spec.budget == 4 and not default.drafter.sampling
    assert three_chains.spec.budget == three_chains.drafter.max_nodes == 6
    assert (sampled.drafter.depth, sampled.drafter.budget) == (3, 5)
    assert (sampled.drafter.temperature, sampled.drafter.top_p) == (0.7, 0.9)
    assert sampled.draft_params is params


def test_the_engine_verifies_only_the_nodes_the_chains_hold(teacher, plain):
    """One chain of 4 under a budget of 8, built by hand: the tree has 5 slots, the engine
    lowers the run's budget to 4 (``fit_budget``) and verifies 5 slots, not 9, with the same
    tokens and acceptance as a run built at budget 4."""
    drafter, params = drafter_for(teacher, 2, top_k=1, budget=8, depth=4)
    assert drafter.max_nodes == 4
    spec = dataclasses.replace(spec_of(drafter), policy="drafter")  # budget 8
    assert fit_budget(spec, drafter).budget == 4
    assert StepStatic(teacher=CFG, drafter=drafter, spec=spec, window=64).tree_slots == 5
    state = gen.init_state(
        teacher, drafter, params, PROMPT, spec, capacity=64, key=jax.random.key(0)
    )
    proposal = drafter.propose(
        params, state.drafter_state, state.context(spec.draft_window), jax.random.key(0)
    )
    assert proposal.tree.num_slots == 5 and bool(jnp.all(proposal.tree.valid))
    runs = {}
    for budget in (8, 4):
        d = dataclasses.replace(drafter, budget=budget)
        run_spec = dataclasses.replace(spec, budget=budget)
        runs[budget] = gen.generate(teacher, d, PROMPT, run_spec, draft_params=params)
    assert runs[8].tokens == runs[4].tokens == plain.tokens
    assert runs[8].stats.accepted_per_round == runs[4].stats.accepted_per_round
    assert max(runs[8].stats.nodes_per_round) == 4


def test_a_curve_for_the_run_budget_serves_the_fitted_tree(teacher, plain):
    """Under ``"auto"`` a latency curve made for the run's budget (9 entries) is cut to the
    fitted tree's 5 slots; the controller picks from it and the output stays plain greedy's."""
    drafter, params = drafter_for(teacher, 2, top_k=1, budget=8, depth=4)
    spec = spec_of(drafter, policy="auto")
    curve = gen.nominal_verify_latency(CFG, spec, len(PROMPT))
    assert curve.shape == (9,)
    result = gen.generate(teacher, drafter, PROMPT, spec, draft_params=params, verify_latency=curve)
    assert result.tokens == plain.tokens
    assert max(result.stats.nodes_per_round) <= 4


def test_fit_budget_lowers_only_to_a_declared_limit(teacher):
    drafter, _ = drafter_for(teacher, 2, top_k=2, budget=8, depth=3)  # chains (3, 3)
    assert fit_budget(SpecConfig(budget=8), drafter).budget == 6
    assert fit_budget(SpecConfig(budget=5), drafter).budget == 5  # the run's is lower
    assert fit_budget(SpecConfig(budget=8), None).budget == 8  # plain decoding
    ngram = registry.make_drafter("ngram", budget=8, depth=4)
    assert max_nodes_of(ngram) is None
    assert fit_budget(SpecConfig(budget=8), ngram).budget == 8


# ------------------------------------------------------------------------ the beam tree


@functools.partial(jax.jit, static_argnames=("config",))
def _last_log_probs(params, tokens, *, config):
    """Log-probabilities of the token after ``tokens`` (one sequence, from an empty cache)."""
    logits, _ = llama.forward_sequence(params, tokens, config=config)
    return jax.nn.log_softmax(logits[-1])


def brute_force_beam(config, params, prefix, width, depth):
    """``{path: cumulative log-probability}`` of every node a beam of ``width`` keeps per
    level, each path scored by a whole-sequence forward (no cache, no scratch slots)."""

    def children(path, score):
        logp = np.asarray(_last_log_probs(params, jnp.asarray(prefix + list(path)), config=config))
        best = np.argsort(-logp)[:width]
        return [(path + (int(t),), score + float(logp[t])) for t in best]

    frontier, kept = children((), 0.0), {}
    for level in range(depth):
        frontier = sorted(frontier, key=lambda node: -node[1])[:width]
        kept.update(frontier)
        if level + 1 < depth:
            frontier = [c for path, score in frontier for c in children(path, score)]
    return kept


def proposed_paths(tree):
    """``{path: logscore}`` of the valid nodes of a proposed tree."""
    tokens, anc, depth = (np.asarray(x) for x in (tree.tokens, tree.ancestors, tree.depth))
    return {
        tuple(int(tokens[anc[i, d]]) for d in range(1, depth[i] + 1)): float(tree.logscore[i])
        for i in np.nonzero(np.asarray(tree.valid))[0]
        if i > 0
    }


@pytest.mark.parametrize("budget", [9, 5], ids=["every-node", "best-5"])
def test_the_beam_tree_is_a_beam_search_of_the_draft(teacher, budget):
    """The beam's scratch slots and ancestry masks give each row the logits of its own path:
    the proposed tree is the beam search done with whole-sequence forwards, and a smaller
    budget keeps its best-scored nodes, packed into ``budget + 1`` slots."""
    drafter, params = drafter_for(teacher, 2, top_k=3, budget=budget, depth=3, tree_shape="beam")
    spec = spec_of(drafter, policy="drafter")
    state = gen.init_state(
        teacher, drafter, params, PROMPT, spec, capacity=64, key=jax.random.key(0)
    )
    context = state.context(spec.draft_window)
    tree = drafter.propose(params, state.drafter_state, context, jax.random.key(1)).tree
    prefix = [int(t) for t in np.asarray(context.tokens)[: int(context.num_tokens)]]
    reference = brute_force_beam(drafter.config, params, prefix, width=3, depth=3)
    best = dict(sorted(reference.items(), key=lambda node: -node[1])[:budget])
    ours = proposed_paths(tree)
    assert tree.num_slots == budget + 1 == drafter.max_nodes + 1
    assert sorted(ours) == sorted(best)
    np.testing.assert_allclose([ours[p] for p in best], list(best.values()), atol=1e-4)
    # The case tests what fixed chains cannot do: some node above the last level keeps two
    # children, or none.
    children_of = collections.Counter(p[:-1] for p in reference if len(p) > 1)
    inner = [p for p in reference if len(p) < 3]
    assert any(children_of[p] != 1 for p in inner), children_of


@pytest.mark.parametrize(
    "settings",
    [
        dict(top_k=3, budget=7, depth=3),
        pytest.param(dict(top_k=2, budget=8, depth=4), marks=pytest.mark.slow),
    ],
    ids=["top3-best7", "top2-every-node"],
)
def test_beam_greedy_output_is_plain_greedy(teacher, plain, settings):
    drafter, params = drafter_for(teacher, 1, tree_shape="beam", **settings)
    ours = gen.generate(
        teacher, drafter, PROMPT, spec_of(drafter, policy="drafter"), draft_params=params
    )
    assert ours.tokens == plain.tokens
    assert ours.stats.rounds < plain.stats.rounds


def test_beam_cache_after_each_round_equals_a_rebuilt_one(teacher):
    drafter, params = drafter_for(teacher, 2, top_k=2, budget=5, depth=3, tree_shape="beam")
    spec = spec_of(drafter, policy="drafter")
    capacity = gen.cache_slots(len(PROMPT), spec, CFG.max_position)
    state = gen.init_state(
        teacher, drafter, params, PROMPT, spec, capacity=capacity, key=jax.random.key(3)
    )
    static = StepStatic(teacher=CFG, drafter=drafter, spec=spec, window=capacity)
    step = jax.jit(speculative_step, static_argnums=0)
    accepted = []
    while not bool(state.done):
        state, info = step(static, teacher.params, params, state, None)
        accepted.append(int(info.acceptance.length))
        ours = state.drafter_state
        fresh = drafter.init_state(params, state.context(spec.draft_window))
        n = int(state.num_tokens)
        assert int(ours.cache.length) == int(fresh.cache.length) == n
        np.testing.assert_allclose(ours.cache.k[:, :n], fresh.cache.k[:, :n], atol=1e-5)
        np.testing.assert_allclose(ours.logits, fresh.logits, rtol=1e-5, atol=1e-4)
    assert max(accepted) > 0 and min(accepted) < drafter.depth, accepted


def test_a_sampled_run_verifies_the_beam_as_a_deterministic_tree(small_teacher, small_draft):
    """Under sampling the beam is still grown by top-k, reported without ``draft_probs``, and
    the emitted tokens follow the teacher's law (chi-square)."""
    drafter, params = small_draft
    beam = dataclasses.replace(drafter, tree_shape="beam", budget=4)
    assert not beam.sampling and beam.max_nodes == 4
    samples, accepted = engine_samples(small_teacher, beam, params)
    assert 0.05 < np.mean(accepted > 0) < 0.95, np.mean(accepted > 0)
    assert p_value(samples, exact_law(small_teacher)) > PASS_P


def test_the_tree_shape_is_checked_and_wired(teacher, monkeypatch):
    with pytest.raises(ValueError, match=r"tree_shape must be one of \('chains', 'beam'\)"):
        drafter_for(teacher, 1, tree_shape="dynamic")
    drafter, params = drafter_for(teacher, 2)
    monkeypatch.setattr(draft_target, "load_draft_target", lambda: (drafter, params))
    methods._truncated_teacher_draft.cache_clear()
    try:
        beam = methods.make_method(
            "draft-target", SpecConfig(budget=16, depth=4), draft_top_k=3, draft_tree="beam"
        )
        with pytest.raises(ValueError, match="draft_tree must be one of"):
            methods.make_method("draft-target", SpecConfig(budget=6), draft_tree="dynamic")
    finally:
        methods._truncated_teacher_draft.cache_clear()
    assert beam.drafter.tree_shape == "beam"
    assert beam.drafter.max_nodes == beam.spec.budget == 12  # three per level, four levels
    # Its drafting cost is calibrated apart from chains of the same budget and depth.
    assert curve.draft_cost_key(beam) == "draft-target:budget=12,depth=4,beam=3,rev=1"
    chains = dataclasses.replace(beam, drafter=dataclasses.replace(beam.drafter, top_k=3))
    chains = dataclasses.replace(
        chains, drafter=dataclasses.replace(chains.drafter, tree_shape="chains")
    )
    assert curve.draft_cost_key(chains) == "draft-target:budget=12,depth=4,rev=1"
    ngram = methods.make_method("ngram", SpecConfig(budget=8, depth=4), draft_tree="beam")
    assert ngram.spec.budget == 8  # other drafters ignore it


def test_the_command_line_offers_the_tree_shape(capsys):
    from eaglepangu_jax.cli.app import build_parser

    parser = build_parser()
    bench = ["bench", "--suite", "dev", "--json", "out.json", "--draft-tree", "beam"]
    assert parser.parse_args(bench).draft_tree == "beam"
    assert parser.parse_args(["generate", "Hi."]).draft_tree is None  # chains
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "Hi.", "--draft-tree", "dynamic"])
    assert "invalid choice: 'dynamic'" in capsys.readouterr().err
