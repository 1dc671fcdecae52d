"""Lossless speculative sampling through the whole engine, checked exactly.

A tiny teacher (vocabulary of 8) continues a fixed prompt by 3 tokens with
:func:`~eaglepangu_jax.engine.sampling.sample_many` (``acceptance="sample"``), each run over
several verify rounds with a drafter whose proposals are sometimes accepted. The empirical
law of the whole 3-token continuation is compared with the EXACT teacher law, computed by
enumerating every sequence with naive uncached forwards: ``P(x1 x2 x3) = p(x1) p(x2 | x1)
p(x3 | x1 x2)``, each factor the temperature / top-p adjusted softmax. Chi-square test over
the 512 cells, rare cells pooled into their prefix. Seeds are fixed, so every test is
deterministic. A correct engine must give p > 1e-3; the negative controls (samples from a
deliberately wrong law, same sample size, same test) must give p < 1e-6.
"""

import collections
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.stats import chisquare

from eaglepangu_jax import tree as tree_lib
from eaglepangu_jax.engine import decode as gen
from eaglepangu_jax.engine import sampling
from eaglepangu_jax.engine.config import SpecConfig
from eaglepangu_jax.engine.drafter import Proposal, StatelessDrafter
from eaglepangu_jax.models import llama
from eaglepangu_jax.models.config import LlamaConfig
from eaglepangu_jax.models.init import random_params

V = 8
CFG = LlamaConfig.tiny(vocab_size=V, num_layers=2, max_position=256)
NO_EOS = -7  # never produced: every sample has exactly NEW tokens
NEW = 3
PROMPT = [1, 3, 5, 1, 3, 6, 1, 3, 5, 1, 3]
SAMPLES = 4000
CHUNK = 1000  # streams decoded together (results do not depend on it)
PASS_P = 1e-3
CONTROL_P = 1e-6
MIN_EXPECTED = 5.0  # chi-square cells with a smaller expected count are pooled


@pytest.fixture(scope="module")
def raw_params():
    params = random_params(CFG, jax.random.key(7))
    # Tied embeddings make the random teacher's logits very peaked; shrinking the final norm
    # scales every logit by 0.15, which leaves a few nats over the 3 tokens: many cells with
    # real mass, so the test sees the conditionals, not one dominant sequence.
    return dict(params, final_norm=params["final_norm"] * 0.15)


@pytest.fixture(scope="module")
def teacher(raw_params):
    return gen.Teacher(CFG, raw_params)


# ------------------------------------------------------------------------------------------
# The exact law
# ------------------------------------------------------------------------------------------


@jax.jit
def _forward_all(params, tokens):
    """Logits ``[B, T, V]`` of a batch of whole sequences, each from an empty cache."""
    return jax.vmap(lambda seq: llama.forward_sequence(params, seq, config=CFG)[0])(tokens)


@pytest.fixture(scope="module")
def teacher_logits(raw_params):
    """``(l1 [V], l2 [V, V], l3 [V, V, V])``: the teacher's logits for the first token, the
    second given the first, the third given the first two (float64 on the host)."""
    seqs = np.asarray([PROMPT + [a, b] for a in range(V) for b in range(V)], np.int32)
    logits = np.asarray(_forward_all(raw_params, jnp.asarray(seqs)), np.float64)
    p = len(PROMPT)
    return logits[0, p - 1], logits[::V, p], logits[:, p + 1].reshape(V, V, V)


def adjusted(logits, temperature, top_p):
    """Temperature then nucleus filtering along the last axis (float64): keep the most likely
    tokens until their mass reaches ``top_p`` (the crossing one included, and every token
    tied with it), renormalise; the rule of :func:`eaglepangu_jax.verify.adjusted_probs`."""
    z = logits / temperature
    p = np.exp(z - z.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    if top_p >= 1.0:
        return p
    desc = -np.sort(-p, axis=-1)
    mass = np.cumsum(desc, axis=-1)
    # float32 in the engine vs float64 here: no cumulative mass may sit near the cutoff.
    assert np.min(np.abs(mass - top_p)) > 1e-5, "top_p too close to a cumulative mass"
    cross = np.argmax(mass >= top_p, axis=-1)[..., None]
    cutoff = np.take_along_axis(desc, cross, axis=-1)
    kept = np.where(p >= cutoff, p, 0.0)
    return kept / kept.sum(axis=-1, keepdims=True)


def exact_law(teacher_logits, temperature=1.0, top_p=1.0):
    """``[V, V, V]`` probability of each 3-token continuation."""
    l1, l2, l3 = teacher_logits
    p1 = adjusted(l1, temperature, top_p)
    p2 = adjusted(l2, temperature, top_p)
    p3 = adjusted(l3, temperature, top_p)
    return p1[:, None, None] * p2[:, :, None] * p3


# ------------------------------------------------------------------------------------------
# The test statistic
# ------------------------------------------------------------------------------------------


def pooled_cells(law):
    """Cells for the chi-square test: each continuation whose expected count reaches
    ``MIN_EXPECTED``; the rare rest pooled by 2-token prefix, what is still rare by first
    token, and the remainder into one cell. Returns ``(cell_of [V, V, V], probs)``."""
    cell_of = np.full(law.shape, -1)
    probs = []
    pending = np.ones(law.shape, bool) & (law > 0)
    for k in (3, 2, 1, 0):
        groups = collections.defaultdict(list)
        for seq in zip(*np.nonzero(pending)):
            groups[seq[:k]].append(seq)
        for members in groups.values():
            mass = sum(law[s] for s in members)
            if mass * SAMPLES >= MIN_EXPECTED or (k == 0 and mass > 0):
                for s in members:
                    cell_of[s] = len(probs)
                    pending[s] = False
                probs.append(mass)
    return cell_of, np.asarray(probs)


def p_value(samples, law):
    """Chi-square p-value of ``samples`` (lists of ``NEW`` ids) against ``law``."""
    assert all(len(s) == NEW for s in samples)
    seqs = np.asarray(samples)
    assert ((seqs >= 0) & (seqs < V)).all(), "a token outside the vocabulary"
    zero = law[tuple(seqs.T)] == 0
    assert not zero.any(), f"a continuation of probability 0: {seqs[np.argmax(zero)]}"
    cell_of, probs = pooled_cells(law)
    observed = np.bincount(cell_of[tuple(seqs.T)], minlength=len(probs))
    assert len(probs) > 40, "too few cells for a meaningful test"
    return chisquare(observed, probs / probs.sum() * len(samples)).pvalue


def draw(law, n, seed):
    """``n`` i.i.d. continuations from ``law`` by numpy (for the negative controls)."""
    flat = np.random.default_rng(seed).choice(law.size, size=n, p=law.ravel() / law.sum())
    return np.stack(np.unravel_index(flat, law.shape), axis=1).tolist()


# ------------------------------------------------------------------------------------------
# Drafters
# ------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SampledChildrenDrafter(StatelessDrafter):
    """Children *sampled* from draft distributions ``q`` (``draft_params``, ``[2, V]``) without
    replacement (Gumbel-top-k) and reported in ``draft_probs``: the multi-step speculative
    sampling rule. Topology: root -> slots 1, 2, 3 drawn from ``q[0]``; slot 1 -> slots 4, 5
    drawn from ``q[1]``."""

    budget: int = 5
    depth: int = 2
    name: str = "sampled-children"

    def propose(self, params, state, context, key):
        root_key, child_key = jax.random.split(key)
        logq = jnp.log(params)
        root_children = jax.lax.top_k(logq[0] + jax.random.gumbel(root_key, (V,)), 3)[1]
        grandchildren = jax.lax.top_k(logq[1] + jax.random.gumbel(child_key, (V,)), 2)[1]
        root = context.tokens[context.num_tokens - 1]
        tokens = jnp.concatenate([root[None], root_children, grandchildren]).astype(jnp.int32)
        tree = tree_lib.from_parents(
            jnp.asarray([0, 0, 0, 0, 1, 1], jnp.int32), tokens=tokens, max_depth=self.depth
        )
        uniform = jnp.full((self.budget + 1, V), 1.0 / V, jnp.float32)
        return Proposal(tree=tree, draft_probs=uniform.at[:2].set(params))


@dataclasses.dataclass(frozen=True)
class DuplicateSiblingsDrafter(StatelessDrafter):
    """A fixed tree with duplicate sibling tokens and a chain (deterministic children): root
    -> 3, 3, 0, 4; the first 3 -> 1 -> 3 and -> 6; the second 3 -> 5."""

    budget: int = 8
    depth: int = 3
    name: str = "duplicate-siblings"

    def propose(self, params, state, context, key):
        root = context.tokens[context.num_tokens - 1]
        tokens = jnp.asarray([0, 3, 3, 0, 4, 1, 6, 5, 3], jnp.int32).at[0].set(root)
        parents = jnp.asarray([0, 0, 0, 0, 0, 1, 1, 2, 5], jnp.int32)
        return Proposal(tree=tree_lib.from_parents(parents, tokens=tokens, max_depth=self.depth))


# Peaked draft laws unlike the teacher's: rejections (and residual draws) happen often, and
# a wrong rule shows (verifying these without-replacement children with the with-replacement
# rule gave p ~ 1e-20 here).
DRAFT_Q = np.asarray(
    [
        [0.6, 0.05, 0.05, 0.15, 0.05, 0.05, 0.025, 0.025],
        [0.5, 0.3, 0.1, 0.02, 0.02, 0.02, 0.02, 0.02],
    ],
    np.float32,
)


def _fallback_pair():
    """The ngram-eagle3 pair on this teacher: n-gram's tree (PROMPT repeats, so it matches in
    some rounds and not in others) with a random EAGLE-3 head's node beside it or alone."""
    from eaglepangu_jax.drafters import eagle3
    from eaglepangu_jax.drafters.fallback import FallbackDrafter
    from eaglepangu_jax.drafters.ngram import NGramDrafter

    embed = random_params(CFG, jax.random.key(7))["embed"]
    head_cfg = eagle3.Eagle3Config.for_teacher(CFG, V)
    d2t = jnp.arange(V, dtype=jnp.int32)
    head = eagle3.init_head(head_cfg, jax.random.key(3), embed=embed, d2t=d2t)
    pair = FallbackDrafter(
        NGramDrafter(budget=6, depth=3), eagle3.Eagle3Drafter(config=head_cfg, budget=1, depth=1)
    )
    return pair, {"primary": None, "fallback": eagle3.make_params(head, embed, d2t)}


# One compilation each (the spec is static): the deterministic-children rule at top_p = 1, the
# sampled-children rule under a nucleus, and a pair of drafters (deterministic children).
CASES = {
    "fixed-tree": (DuplicateSiblingsDrafter(), None, dict(budget=8, depth=3)),
    "fallback-pair": (*_fallback_pair(), dict(budget=6, depth=3)),
    "sampled-children-top-p": (
        SampledChildrenDrafter(),
        jnp.asarray(DRAFT_Q),
        dict(budget=5, depth=2, top_p=0.95),
    ),
}


def spec_for(case):
    _, _, extra = CASES[case]
    return SpecConfig(
        policy="drafter",
        acceptance="sample",
        temperature=1.0,
        max_new_tokens=NEW,
        eos_id=NO_EOS,
        seed=11,
        **extra,
    )


@pytest.fixture(scope="module")
def engine_samples(teacher):
    """``case -> (samples, rounds, accepted)``: engine samples of each case, drawn once, with
    each stream's verify rounds and the accepted draft nodes of every round (read from the
    decode loop's final states)."""
    cache = {}

    def get(case):
        if case in cache:
            return cache[case]
        drafter, draft_params, _ = CASES[case]
        states = []
        real = sampling.decode_loop

        def spy(*args, **kwargs):
            state = real(*args, **kwargs)
            states.append((np.asarray(state.rounds), np.asarray(state.accepted_log)))
            return state

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(sampling, "decode_loop", spy)
            samples = sampling.sample_many(
                teacher,
                drafter,
                PROMPT,
                spec_for(case),
                SAMPLES,
                draft_params=draft_params,
                chunk=CHUNK,
            )
        rounds = np.concatenate([r for r, _ in states])
        log = np.concatenate([a for _, a in states])  # [S, R], -1 past the stream's rounds
        accepted = log[log >= 0]  # accepted draft nodes of every round of every stream
        cache[case] = samples, rounds, accepted
        return cache[case]

    return get


# ------------------------------------------------------------------------------------------
# Tests
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", list(CASES))
def test_engine_samples_follow_the_exact_teacher_law(engine_samples, teacher_logits, case):
    samples, rounds, accepted = engine_samples(case)
    # The drafter really speculates, over several rounds: some rounds accept draft nodes,
    # some reject them all, and most streams need more than one round.
    assert 0.01 < np.mean(accepted > 0) < 0.99, np.mean(accepted > 0)
    assert np.mean(rounds > 1) > 0.5, np.mean(rounds > 1)
    top_p = spec_for(case).top_p
    law = exact_law(teacher_logits, 1.0, top_p)
    assert abs(law.sum() - 1.0) < 1e-9
    assert p_value(samples, law) > PASS_P


def test_negative_control_wrong_temperature(teacher_logits):
    """Samples of the teacher at temperature 0.5: the same test must reject them."""
    wrong = draw(exact_law(teacher_logits, 0.5), SAMPLES, seed=0)
    assert p_value(wrong, exact_law(teacher_logits, 1.0)) < CONTROL_P
    # ... and accept samples of the right law, drawn the same way (the test is calibrated).
    right = draw(exact_law(teacher_logits, 1.0), SAMPLES, seed=0)
    assert p_value(right, exact_law(teacher_logits, 1.0)) > PASS_P


def test_negative_control_wrong_conditional(teacher_logits):
    """A subtler wrong law: the third token ignores the second (its law given the first token
    only), as a stale cache row would. The marginals of x1, x2 and x3 | x1 are all right."""
    law = exact_law(teacher_logits)
    p12 = law.sum(axis=2)
    p3_given_1 = law.sum(axis=1) / law.sum(axis=(1, 2))[:, None]
    wrong = p12[:, :, None] * p3_given_1[:, None, :]
    assert p_value(draw(wrong, SAMPLES, seed=1), law) < CONTROL_P


def test_negative_control_engine_samples_of_another_law(engine_samples, teacher_logits):
    """The engine's own top-p samples against the unfiltered law: the test sees the missing
    tail (and the nucleus law rejects the unfiltered n-gram samples outright)."""
    nucleus = engine_samples("sampled-children-top-p")[0]
    assert p_value(nucleus, exact_law(teacher_logits, 1.0)) < CONTROL_P
    full = engine_samples("fixed-tree")[0]
    with pytest.raises(AssertionError, match="probability 0"):
        p_value(full, exact_law(teacher_logits, 1.0, 0.95))
