"""The speculative engine on a tiny random teacher: losslessness, batching, compile counts,
bad input, hostile drafters."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_engine_hostile import random_mostly_valid_tree

from eaglepangu_jax import mask as mask_lib
from eaglepangu_jax import tree as tree_lib
from eaglepangu_jax.cache import KVCache
from eaglepangu_jax.engine import decode as gen
from eaglepangu_jax.engine import sampling
from eaglepangu_jax.engine.config import SpecConfig
from eaglepangu_jax.engine.drafter import Proposal, StatelessDrafter
from eaglepangu_jax.engine.verification import slot_buckets
from eaglepangu_jax.models import llama
from eaglepangu_jax.models.config import LlamaConfig
from eaglepangu_jax.models.init import random_params

CFG = LlamaConfig.tiny(vocab_size=61, max_position=512)
NO_EOS = -7  # an id the vocabulary never produces, so runs last max_new_tokens


@pytest.fixture(scope="module")
def teacher():
    # Larger-than-default weights so the random teacher's greedy output is not a constant.
    params = random_params(CFG, jax.random.key(3))
    params = jax.tree_util.tree_map(lambda x: x * 3.0 if x.ndim >= 2 else x, params)
    return gen.Teacher(CFG, params)


@jax.jit
def _uncached_logits(params, tokens):
    """Logits of a full causal forward from an empty cache (no incremental state at all)."""
    t = tokens.shape[0]
    kv = KVCache(
        k=jnp.zeros((CFG.num_layers, t, CFG.num_kv_heads, CFG.head_dim)),
        v=jnp.zeros((CFG.num_layers, t, CFG.num_kv_heads, CFG.head_dim)),
        length=jnp.int32(0),
    )
    positions = jnp.arange(t, dtype=jnp.int32)
    mask = mask_lib.causal_mask(t, 0, t)
    return llama.forward(params, tokens, positions, kv, mask, config=CFG)[0]


def naive_greedy(teacher, prompt, n):
    """Oracle: full uncached forward over the whole sequence for every new token. The
    sequence is zero-padded to a multiple of 64 (one compilation for every call here); causal
    attention keeps the padding after position ``t`` out of the logits at ``t``."""
    seq = list(prompt)
    length = -(-(len(prompt) + n) // 64) * 64
    for _ in range(n):
        padded = np.zeros(length, np.int32)
        padded[: len(seq)] = seq
        logits = _uncached_logits(teacher.params, jnp.asarray(padded))
        seq.append(int(jnp.argmax(logits[len(seq) - 1])))
    return seq[len(prompt) :]


@dataclasses.dataclass(frozen=True)
class OracleTreeDrafter(StatelessDrafter):
    """Knows the true greedy continuation; hides it on a random branch among decoys and
    corrupts it at a random depth, so commits must reorder slots and acceptance varies."""

    oracle: tuple[int, ...]
    prompt_len: int
    budget: int
    depth: int
    name: str = "oracle"

    def propose(self, params, state, context, key):
        k1, k2, k3 = jax.random.split(key, 3)
        oracle = jnp.asarray(self.oracle + (0,) * (self.depth + 1), jnp.int32)
        done = context.num_tokens - self.prompt_len
        truth = jax.lax.dynamic_slice(oracle, (done,), (self.depth,))
        cut = jax.random.randint(k1, (), 0, self.depth + 1)
        wrong = jax.random.randint(k2, (self.depth,), 0, CFG.vocab_size)
        truth = jnp.where(jnp.arange(self.depth) < cut, truth, (truth + 1) % CFG.vocab_size)
        decoys = jax.random.randint(k3, (3, self.depth), 0, CFG.vocab_size)
        paths = jnp.concatenate([decoys[:1], truth[None], decoys[1:], wrong[None]], axis=0)
        lens = jnp.full((paths.shape[0],), self.depth, jnp.int32)
        tree = tree_lib.from_paths(
            context.tokens[context.num_tokens - 1], paths, lens, budget=self.budget
        )
        return Proposal(tree=tree)


@dataclasses.dataclass(frozen=True)
class GarbageDrafter(StatelessDrafter):
    """Hostile drafter: a new mostly-valid random tree each round, with bad parents, depth
    overflow, nodes under invalid ones and NaN / infinite scores sprinkled in (at least one
    malformed parent per tree). Token ids stay in range here: tests/test_engine_hostile.py
    covers those, and its hypothesis trees."""

    budget: int
    depth: int
    name: str = "garbage"

    def propose(self, params, state, context, key):
        parents, tokens, valid, logscore = random_mostly_valid_tree(
            key, self.budget + 1, max_depth=self.depth, vocab_size=CFG.vocab_size, bad_tokens=False
        )
        tree = tree_lib.from_parents(
            parents, tokens=tokens, valid=valid, logscore=logscore, max_depth=self.depth
        )
        return Proposal(tree=tree)


PROMPT = [5, 9, 14, 3, 22, 7]


def test_plain_decoding_equals_uncached_greedy(teacher):
    spec = SpecConfig(budget=4, depth=3, max_new_tokens=12, eos_id=NO_EOS)
    result = gen.generate(teacher, None, PROMPT, spec)
    expected = naive_greedy(teacher, PROMPT, 12)
    assert len(set(expected)) > 2, "the test teacher should not be degenerate"
    assert result.tokens == expected
    assert result.stats.rounds == 12 and result.stats.accepted_length == 1.0


@pytest.mark.parametrize("budget,depth", [(6, 3), (12, 4)])
def test_tree_speculation_is_lossless_and_accepts(teacher, budget, depth):
    expected = naive_greedy(teacher, PROMPT, 24)
    drafter = OracleTreeDrafter(tuple(expected), len(PROMPT), budget, depth)
    spec = SpecConfig(budget=budget, depth=depth, max_new_tokens=24, eos_id=NO_EOS)
    result = gen.generate(teacher, drafter, PROMPT, spec)
    assert result.tokens == expected
    assert result.stats.accepted_length > 1.3
    assert sum(a + 1 for a in result.stats.accepted_per_round) >= 24
    assert max(result.stats.accepted_per_round) <= depth


def test_hostile_drafter_never_corrupts(teacher):
    spec = SpecConfig(budget=5, depth=3, max_new_tokens=10, eos_id=NO_EOS)
    result = gen.generate(teacher, GarbageDrafter(5, 3), PROMPT, spec)
    assert result.tokens == naive_greedy(teacher, PROMPT, 10)


def test_eos_stops_and_is_kept(teacher):
    expected = naive_greedy(teacher, PROMPT, 10)
    eos = expected[4]
    spec = SpecConfig(budget=4, depth=3, max_new_tokens=10, eos_id=eos)
    result = gen.generate(teacher, None, PROMPT, spec)
    assert result.tokens == expected[: expected.index(eos) + 1]


def test_batched_equals_per_sequence(teacher):
    prompts = [PROMPT, [1, 2], [40, 41, 42, 43, 44, 45, 46, 47, 48]]
    spec = SpecConfig(budget=6, depth=3, max_new_tokens=9, eos_id=NO_EOS)
    oracle = naive_greedy(teacher, prompts[0], 9)
    drafter = OracleTreeDrafter(tuple(oracle), len(PROMPT), 6, 3)
    batch = gen.generate_batch(teacher, drafter, prompts, spec)
    for i, (p, r) in enumerate(zip(prompts, batch)):
        single = gen.generate(teacher, drafter, p, spec, stream=i)
        assert r.tokens == single.tokens
        assert r.stats.accepted_per_round == single.stats.accepted_per_round
    assert batch[0].tokens == oracle


def test_step_compiles_once_per_configuration(teacher):
    spec = SpecConfig(budget=3, depth=2, max_new_tokens=5, eos_id=NO_EOS)
    gen.generate(teacher, None, [1, 2, 3], spec)
    before = gen._run._cache_size()
    gen.generate(teacher, None, [4, 5, 6], spec)
    gen.generate(teacher, None, [7, 8, 9, 10], spec)
    assert gen._run._cache_size() == before


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(policy="nope"), "unknown tree policy"),
        (dict(budget=0), "budget must be >= 1"),
        (dict(temperature=-1.0), "temperature must be >= 0"),
        (dict(acceptance="maybe"), "unknown acceptance"),
        (dict(top_p=0.0), "top_p"),
    ],
)
def test_bad_spec(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SpecConfig(**kwargs)


def test_bad_input_before_work(teacher):
    spec = SpecConfig(budget=4, depth=3, max_new_tokens=8)
    with pytest.raises(ValueError, match="empty"):
        gen.generate(teacher, None, [], spec)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        gen.generate(teacher, None, [1, CFG.vocab_size], spec)
    with pytest.raises(ValueError, match=r"prompt \(500\) \+ max_new_tokens \(8\)"):
        gen.generate(teacher, None, [1] * 500, spec)
    with pytest.raises(ValueError, match="longer than the teacher's context of 512"):
        gen.generate(teacher, None, [1] * 600, spec)
    deep = OracleTreeDrafter((1,), 1, 4, 3)
    with pytest.raises(ValueError, match="above the drafter's maximum"):
        gen.generate(teacher, deep, [1, 2], SpecConfig(budget=4, depth=5))


@dataclasses.dataclass(frozen=True)
class OracleMarginalDrafter(StatelessDrafter):
    """A block-style drafter: per-depth log-marginals that favour the true continuation at
    odd depths and a wrong token at even ones (so acceptance stops at varying depths)."""

    oracle: tuple[int, ...]
    prompt_len: int
    depth: int
    name: str = "oracle-marginals"

    def propose(self, params, state, context, key):
        oracle = jnp.asarray(self.oracle + (0,) * (self.depth + 1), jnp.int32)
        done = context.num_tokens - self.prompt_len
        truth = jax.lax.dynamic_slice(oracle, (done,), (self.depth,))
        noise = jax.random.normal(key, (self.depth, CFG.vocab_size))
        boost = jnp.where(jax.random.bernoulli(key, 0.7, (self.depth,)), 4.0, 0.5)
        logits = noise + boost[:, None] * jax.nn.one_hot(truth, CFG.vocab_size)
        return Proposal(marginals=jax.nn.log_softmax(logits, axis=-1))


@pytest.mark.parametrize(
    "policy,extra",
    [
        ("best_first", {}),
        ("static", {"choices": ((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0))}),
    ],
)
def test_marginal_policies_are_lossless(teacher, policy, extra):
    expected = naive_greedy(teacher, PROMPT, 16)
    drafter = OracleMarginalDrafter(tuple(expected), len(PROMPT), 3)
    spec = SpecConfig(policy=policy, budget=8, depth=3, max_new_tokens=16, eos_id=NO_EOS, **extra)
    result = gen.generate(teacher, drafter, PROMPT, spec)
    assert result.tokens == expected
    assert result.stats.accepted_length > 1.2


def test_auto_policy_uses_the_controller(teacher):
    expected = naive_greedy(teacher, PROMPT, 12)
    drafter = OracleMarginalDrafter(tuple(expected), len(PROMPT), 3)
    spec = SpecConfig(policy="auto", budget=8, depth=3, max_new_tokens=12, eos_id=NO_EOS)
    # Steeply rising verify cost: the controller must keep small trees.
    steep = jnp.asarray([1.0 + 5.0 * n for n in range(9)], jnp.float32)
    result = gen.generate(teacher, drafter, PROMPT, spec, verify_latency=steep)
    assert result.tokens == expected
    flat = jnp.ones((9,), jnp.float32)
    wide = gen.generate(teacher, drafter, PROMPT, spec, verify_latency=flat)
    assert wide.tokens == expected
    assert max(result.stats.nodes_per_round) < max(wide.stats.nodes_per_round)
    # Without a curve the controller reads the nominal roofline: still lossless.
    assert gen.generate(teacher, drafter, PROMPT, spec).tokens == expected


def test_auto_policy_prunes_a_drafter_built_tree(teacher):
    """Under "auto" a tree-proposing drafter's tree is cut to the controller's node count."""
    expected = naive_greedy(teacher, PROMPT, 12)
    drafter = OracleTreeDrafter(tuple(expected), len(PROMPT), 8, 3)
    spec = SpecConfig(policy="auto", budget=8, depth=3, max_new_tokens=12, eos_id=NO_EOS)
    # Every node scores 0 (rho = 1): with cost rising 5 per node, a node never pays for itself;
    # with a flat cost every node does.
    steep = jnp.asarray([1.0 + 5.0 * n for n in range(9)], jnp.float32)
    pruned = gen.generate(teacher, drafter, PROMPT, spec, verify_latency=steep)
    flat = jnp.ones((9,), jnp.float32)
    full = gen.generate(teacher, drafter, PROMPT, spec, verify_latency=flat)
    assert pruned.tokens == expected and full.tokens == expected
    # Plain steps, except the controller's exploration probes, which verify the cheapest
    # multi-token bucket (3 nodes) and no more.
    assert set(pruned.stats.nodes_per_round) <= {0, 3}
    assert sum(n == 0 for n in pruned.stats.nodes_per_round) > len(pruned.stats.nodes_per_round) / 2
    assert min(full.stats.nodes_per_round) > 0 and full.stats.accepted_length > 1.2


@pytest.mark.parametrize(
    "slots, buckets",
    [
        (1, (1,)),
        (2, (1, 2)),
        (3, (1, 2, 3)),
        (5, (1, 2, 4, 5)),
        (9, (1, 2, 4, 9)),  # 8 left out: 9 exceeds it by less than a quarter of it
        (10, (1, 2, 4, 8, 10)),
        (17, (1, 2, 4, 8, 17)),
        (21, (1, 2, 4, 8, 16, 21)),
        (33, (1, 2, 4, 8, 16, 33)),
    ],
)
def test_slot_buckets_literal_ladder(slots, buckets):
    assert slot_buckets(slots) == buckets


@pytest.mark.parametrize(
    "slots, sizes, buckets",
    [
        (9, (1, 4), (1, 4, 9)),
        (9, (1, 4, 8, 16), (1, 4, 8, 9)),  # explicit sizes are kept as given
        (4, (1, 2, 4, 8), (1, 2, 4)),
        (1, (1, 2), (1,)),
    ],
)
def test_slot_buckets_from_the_specs_sizes(slots, sizes, buckets):
    assert slot_buckets(slots, sizes) == buckets


@pytest.mark.parametrize("sizes", [(), (2, 4), (1, 4, 4), (1, 4, 2), [1, 2], (1, 2.0)])
def test_bad_slot_buckets_are_refused(sizes):
    with pytest.raises(ValueError, match="slot_buckets"):
        SpecConfig(slot_buckets=sizes)


def test_reference_and_performance_modes_agree(teacher, monkeypatch):
    expected = naive_greedy(teacher, PROMPT, 10)
    drafter = OracleTreeDrafter(tuple(expected), len(PROMPT), 6, 3)
    spec = SpecConfig(budget=6, depth=3, max_new_tokens=10, eos_id=NO_EOS)
    monkeypatch.setenv("EAGLEPANGU_MODE", "performance")
    fast = gen.generate(teacher, drafter, PROMPT, spec)
    monkeypatch.setenv("EAGLEPANGU_MODE", "reference")
    checked = gen.generate(teacher, drafter, PROMPT, spec)
    assert fast.tokens == checked.tokens == expected
    assert fast.stats.accepted_per_round == checked.stats.accepted_per_round


def test_reference_mode_raises_on_a_broken_drafter_tree(teacher, monkeypatch):
    spec = SpecConfig(budget=5, depth=3, max_new_tokens=4, eos_id=NO_EOS)
    monkeypatch.setenv("EAGLEPANGU_MODE", "performance")
    gen.generate(teacher, GarbageDrafter(5, 3), PROMPT, spec)  # repaired, runs
    monkeypatch.setenv("EAGLEPANGU_MODE", "reference")
    with pytest.raises(Exception, match="invalid tree: invariant"):
        gen.generate(teacher, GarbageDrafter(5, 3), PROMPT, spec)


def test_sample_many_does_not_depend_on_the_chunk(teacher):
    """Streams decoded in chunks (the last one padded) equal streams decoded all at once."""
    spec = SpecConfig(
        budget=4,
        depth=3,
        max_new_tokens=6,
        eos_id=NO_EOS,
        acceptance="sample",
        temperature=1.0,
        seed=5,
    )
    whole = sampling.sample_many(teacher, None, PROMPT, spec, 7, chunk=7)
    chunked = sampling.sample_many(teacher, None, PROMPT, spec, 7, chunk=3)
    assert chunked == whole
    assert len({tuple(s) for s in whole}) > 1, "streams should differ"
    with pytest.raises(ValueError, match="chunk must be >= 1"):
        sampling.sample_many(teacher, None, PROMPT, spec, 2, chunk=0)
