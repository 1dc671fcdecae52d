"""Lossless sampling on the real teacher: the first two generated tokens follow the teacher.

The exact reference law of (token 1, token 2) comes from teacher forwards: p1 at the prompt,
then p2 given each likely token 1. Speculative sampling through the engine, with both
acceptance rules (deterministic children; sampled children with draft probabilities), and plain
sampling are each compared with it by a chi-square goodness-of-fit test. Seeds are fixed, so
the test is deterministic; the threshold (p > 1e-3) is the rejection level.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eaglepangu_jax import tree as tree_lib
from eaglepangu_jax import verify
from eaglepangu_jax.engine import decode as gen
from eaglepangu_jax.engine import sampling
from eaglepangu_jax.engine.config import SpecConfig
from eaglepangu_jax.engine.drafter import Proposal, StatelessDrafter

scipy_stats = pytest.importorskip("scipy.stats")

pytestmark = pytest.mark.slow

TEMPERATURE, TOP_P = 0.7, 0.8
SAMPLES = 384
TOP1, TOP2 = 4, 4  # categories: top-4 first tokens x top-4 second tokens, plus "other"


@pytest.fixture(scope="module")
def setup():
    from eaglepangu_jax.models.chat import encode_chat
    from eaglepangu_jax.models.smollm2 import load_smollm2
    from eaglepangu_jax.models.tokenizer import load_tokenizer

    config, params = load_smollm2()
    teacher = gen.Teacher(config, params)
    prompt = encode_chat(load_tokenizer(), [{"role": "user", "content": "Name a fruit."}])
    p1 = _next_probs(teacher, prompt)
    first = [int(t) for t in np.argsort(-p1)[:TOP1]]
    second = {t: _next_probs(teacher, prompt + [t]) for t in first}
    return teacher, prompt, p1, first, second


def _next_probs(teacher, ids):
    """Exact adjusted next-token law after ``ids`` (one uncached forward)."""
    from eaglepangu_jax import mask as mask_lib
    from eaglepangu_jax.cache import init
    from eaglepangu_jax.models import llama

    cfg = teacher.config
    t = len(ids)
    kv = init(cfg.num_layers, t, cfg.num_kv_heads, cfg.head_dim)
    logits, _, _ = llama.forward(
        teacher.params,
        jnp.asarray(ids, jnp.int32),
        jnp.arange(t, dtype=jnp.int32),
        kv,
        mask_lib.causal_mask(t, 0, t),
        config=cfg,
    )
    return np.asarray(verify.adjusted_probs(logits[-1], TEMPERATURE, TOP_P), np.float64)


@dataclasses.dataclass(frozen=True)
class FixedTree(StatelessDrafter):
    """Deterministic children: a fixed tree over the likely tokens."""

    parents: tuple[int, ...]
    tokens: tuple[int, ...]
    depth: int = 2
    name: str = "fixed"

    def propose(self, params, state, context, key):
        return Proposal(
            tree=tree_lib.from_parents(
                jnp.asarray(self.parents, jnp.int32),
                tokens=jnp.asarray(self.tokens, jnp.int32),
                max_depth=self.depth,
            )
        )


@dataclasses.dataclass(frozen=True)
class SampledTree(StatelessDrafter):
    """Sampled children: 3 root children drawn without replacement (Gumbel top-k) from q, and
    2 children of each drawn from a second q; ``draft_probs`` reports both laws."""

    q_root: tuple[float, ...]
    q_child: tuple[float, ...]
    depth: int = 2
    name: str = "sampled"

    def propose(self, params, state, context, key):
        q_root = jnp.asarray(self.q_root, jnp.float32)
        q_child = jnp.asarray(self.q_child, jnp.float32)
        k_root, k_child = jax.random.split(key)
        g = jax.random.gumbel(k_root, q_root.shape)
        _, kids = jax.lax.top_k(jnp.log(q_root) + g, 3)
        gc = jax.random.gumbel(k_child, (3,) + q_child.shape)
        _, grand = jax.lax.top_k(jnp.log(q_child)[None] + gc, 2)  # [3, 2]
        parents = jnp.asarray([0, 0, 0, 0, 1, 1, 2, 2, 3, 3], jnp.int32)
        tokens = jnp.concatenate([jnp.zeros((1,), jnp.int32), kids, grand.reshape(-1)])
        tree = tree_lib.from_parents(parents, tokens=tokens.astype(jnp.int32), max_depth=2)
        rows = jnp.concatenate([q_root[None], jnp.broadcast_to(q_child, (9,) + q_child.shape)])
        return Proposal(tree=tree, draft_probs=rows)


def _categories(samples, first, second):
    """Map (t1, t2) to a category index; the last index is 'other'."""
    index = {}
    for t1 in first:
        for t2 in second[t1]:
            index[(t1, t2)] = len(index)
    counts = np.zeros(len(index) + 1)
    for s in samples:
        counts[index.get((s[0], s[1]), len(index))] += 1
    return counts


def _expected(p1, first, second_probs, second):
    probs = [p1[t1] * second_probs[t1][t2] for t1 in first for t2 in second[t1]]
    return np.asarray(probs + [1.0 - sum(probs)])


def _chi_square_p(counts, probs):
    expected = probs * counts.sum()
    # Lump sparse categories into 'other' so every expected count is >= 5.
    keep = expected[:-1] >= 5
    obs = np.append(counts[:-1][keep], counts[:-1][~keep].sum() + counts[-1])
    exp = np.append(expected[:-1][keep], expected[:-1][~keep].sum() + expected[-1])
    return scipy_stats.chisquare(obs, exp).pvalue


def test_first_two_tokens_follow_the_teacher(setup):
    teacher, prompt, p1, first, second_probs = setup
    second = {t: [int(x) for x in np.argsort(-second_probs[t])[:TOP2]] for t in first}
    probs = _expected(p1, first, second_probs, second)
    assert probs[:-1].sum() > 0.3, "the categories should cover much of the mass"
    spec = SpecConfig(
        budget=9,
        depth=2,
        max_new_tokens=2,
        acceptance="sample",
        temperature=TEMPERATURE,
        top_p=TOP_P,
        seed=11,
        eos_id=-1,
    )
    # Deterministic children: the 3 likeliest first tokens, each with its 2 likeliest next.
    parents = (0, 0, 0, 0, 1, 1, 2, 2, 3, 3)
    tokens = (0, *first[:3], *[t for t1 in first[:3] for t in second[t1][:2]])
    q_root = np.full(teacher.config.vocab_size, 1e-6)
    q_root[first] = np.linspace(1.0, 0.4, len(first))
    q_child = np.full(teacher.config.vocab_size, 1e-6)
    for t1 in first:
        q_child[second[t1]] += 0.5
    drafters = {
        "plain": None,
        "deterministic": FixedTree(parents, tokens),
        "sampled": SampledTree(
            tuple((q_root / q_root.sum()).tolist()), tuple((q_child / q_child.sum()).tolist())
        ),
    }
    for name, drafter in drafters.items():
        samples = sampling.sample_many(teacher, drafter, prompt, spec, SAMPLES)
        assert all(len(s) == 2 for s in samples), name
        counts = _categories(samples, first, second)
        p_value = _chi_square_p(counts, probs)
        tv = 0.5 * np.abs(counts / counts.sum() - probs).sum()
        assert p_value > 1e-3, (name, p_value, counts, probs * SAMPLES)
        assert tv < 0.12, (name, tv)
