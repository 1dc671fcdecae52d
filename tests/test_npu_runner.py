"""The torch-teacher runner against the JAX engine: same tokens, same rounds, same drafter
state (one state advance, the engine's); hostile drafter token ids become padding (reference
mode: an error naming the node); the strict Ascend simulator catches a wrong-polarity mask at
the runner level."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from eaglepangu_jax import mask as mask_lib  # noqa: E402
from eaglepangu_jax import tree as tree_lib  # noqa: E402
from eaglepangu_jax.drafters import eagle3  # noqa: E402
from eaglepangu_jax.drafters.ngram import NGramDrafter  # noqa: E402
from eaglepangu_jax.engine import decode as gen  # noqa: E402
from eaglepangu_jax.engine import step as engine_step  # noqa: E402
from eaglepangu_jax.engine.config import SpecConfig  # noqa: E402
from eaglepangu_jax.engine.drafter import Proposal  # noqa: E402
from eaglepangu_jax.engine.step import StepStatic, speculative_step  # noqa: E402
from eaglepangu_jax.models.config import LlamaConfig  # noqa: E402
from eaglepangu_jax.models.init import random_params  # noqa: E402
from npu_backend import attention, bridge, simulated  # noqa: E402
from npu_backend import runner as runner_lib  # noqa: E402
from npu_backend.llama_torch import TorchLlama  # noqa: E402
from npu_backend.method_runner import TorchMethodRunner  # noqa: E402
from npu_backend.runner import (  # noqa: E402
    TorchTeacherRunner,
    generate_torch,
)
from npu_backend.simulated import AscendConstraintError, simulated_npu  # noqa: E402

CFG = LlamaConfig.tiny(vocab_size=61, max_position=512)
NO_EOS = -7  # an id the vocabulary never produces, so runs last max_new_tokens
PROMPT = [5, 9, 3, 5, 9, 3, 5, 9, 3, 7, 5, 9]
SPEC = SpecConfig(budget=8, depth=4, max_new_tokens=24, eos_id=NO_EOS)


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
def teacher(params):
    return gen.Teacher(CFG, params)


@pytest.fixture(scope="module")
def greedy(teacher):
    """Plain greedy decoding by the JAX engine: the oracle continuation."""
    return gen.generate(teacher, None, PROMPT, SPEC).tokens


@dataclasses.dataclass(frozen=True)
class OracleDrafter:
    """Knows the greedy continuation; puts it behind decoy paths (so the accepted chain is
    never the first and commits must move K/V) and corrupts it at a random depth."""

    oracle: tuple[int, ...]
    prompt_len: int = len(PROMPT)
    budget: int = 8
    depth: int = 4
    name: str = "oracle"
    feature_layers: tuple[int, ...] = ()

    @property
    def max_depth(self):
        return self.depth

    def init_state(self, params, context):
        return None

    def update(self, params, state, context):
        return state

    def propose(self, params, state, context, key):
        cut_key, decoy_key = jax.random.split(key)
        oracle = jnp.asarray(self.oracle + (0,) * (self.depth + 1), jnp.int32)
        done = context.num_tokens - self.prompt_len
        truth = jax.lax.dynamic_slice(oracle, (done,), (self.depth,))
        cut = jax.random.randint(cut_key, (), 0, self.depth + 1)
        truth = jnp.where(jnp.arange(self.depth) < cut, truth, (truth + 1) % CFG.vocab_size)
        decoys = jax.random.randint(decoy_key, (2, self.depth), 0, CFG.vocab_size)
        paths = jnp.concatenate([decoys[:1], truth[None], decoys[1:]], axis=0)
        lengths = jnp.asarray([2, self.depth, 2], jnp.int32)  # 8 nodes: all fit the budget
        root = context.tokens[context.num_tokens - 1]
        return Proposal(tree=tree_lib.from_paths(root, paths, lengths, budget=self.budget))


def _assert_same_run(result, expected):
    assert result.tokens == expected.tokens
    assert result.stats.rounds == expected.stats.rounds
    assert result.stats.accepted_per_round == expected.stats.accepted_per_round
    assert result.stats.nodes_per_round == expected.stats.nodes_per_round


@pytest.mark.parametrize("which", ["plain", "ngram", "oracle"])
def test_tree_mode_equals_jax_generate(params, teacher, greedy, which):
    drafter = {
        "plain": None,
        "ngram": NGramDrafter(budget=8, depth=4, num_matches=4),
        "oracle": OracleDrafter(tuple(greedy)),
    }[which]
    model = TorchLlama(CFG, params, attention_impl="sdpa")
    result = generate_torch(model, drafter, PROMPT, SPEC)
    _assert_same_run(result, gen.generate(teacher, drafter, PROMPT, SPEC))
    assert result.tokens == greedy
    if which == "oracle":
        assert result.stats.accepted_length > 1.5


def test_accepted_paths_off_the_first_chain_are_moved(params, greedy):
    model = TorchLlama(CFG, params, attention_impl="eager")
    runner = TorchTeacherRunner(model, OracleDrafter(tuple(greedy)), SPEC)
    state, kv = runner.start(PROMPT)
    rounds = []
    while runner.running(state, kv):
        state, info = runner.step(state, kv)
        rounds.append(info)
        assert kv.length == int(state.num_tokens) - 1  # the root is never in the cache
    assert any(r.moved > 0 for r in rounds)
    assert all(r.moved <= r.accepted for r in rounds)  # the root never moves


def test_trailing_padding_is_not_verified(params):
    """A drafter with nothing to propose: the tree is the root and padding, one row is run."""
    model = TorchLlama(CFG, params, attention_impl="eager")
    runner = TorchTeacherRunner(model, NGramDrafter(budget=8, depth=4, num_matches=4), SPEC)
    state, kv = runner.start([1, 2, 3, 4])  # no repeated token: the n-gram finds nothing
    state, info = runner.step(state, kv)
    assert info.verified == 1 and info.accepted == 0
    assert int(state.nodes_log[0]) == 0


@pytest.fixture(scope="module")
def eagle():
    config = eagle3.Eagle3Config.for_teacher(CFG, draft_vocab_size=CFG.vocab_size)
    assert config.feature_layers == (0, 1, 2)
    return eagle3.Eagle3Drafter(config=config, budget=8, depth=4, top_k=3)


@pytest.fixture(scope="module")
def eagle_params(params, eagle):
    d2t = jnp.arange(CFG.vocab_size, dtype=jnp.int32)
    head = eagle3.init_head(eagle.config, jax.random.key(11), embed=params["embed"], d2t=d2t)
    return eagle3.make_params(head, params["embed"], d2t)


def _close(a, b):
    """Equal up to float32 rounding at the tensor's own scale (features reach 1e3 here)."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * (1.0 + float(np.abs(b).max())))


@pytest.mark.parametrize(
    "which, mode",
    [
        ("eagle3", "tree"),
        ("eagle3", "branches"),
        pytest.param("oracle", "branches", marks=pytest.mark.slow),
    ],
)
def test_teacher_features_reach_the_drafter_like_in_jax(
    params, teacher, greedy, eagle, eagle_params, which, mode
):
    """Round by round: same tokens, features, drafter state and committed cache. The
    feature-tapping oracle gets paths accepted, so features come from deep chain rows."""
    spec = dataclasses.replace(SPEC, depth=4, max_new_tokens=12)
    drafter, draft_params = eagle, eagle_params
    if which == "oracle":
        drafter, draft_params = OracleDrafter(tuple(greedy), feature_layers=(0, 2)), None
    capacity = gen.cache_slots(len(PROMPT), spec, CFG.max_position)
    key = jax.random.fold_in(jax.random.key(spec.seed), 0)
    expected = gen.init_state(
        teacher, drafter, draft_params, PROMPT, spec, capacity=capacity, key=key
    )
    static = StepStatic(teacher=CFG, drafter=drafter, spec=spec, window=capacity)
    step = jax.jit(speculative_step, static_argnums=0)
    # The "auto" controller's curve, given to both (the runner's default is the same one).
    latency = gen.nominal_verify_latency(CFG, spec, len(PROMPT) - 1)
    model = TorchLlama(CFG, params, attention_impl="eager")
    runner = TorchTeacherRunner(
        model, drafter, spec, draft_params=draft_params, mode=mode, verify_latency=latency
    )
    state, kv = runner.start(PROMPT)
    _close(state.features, expected.features)
    accepted = 0
    for _ in range(3):
        expected, info = step(static, params, draft_params, expected, latency)
        state, result = runner.step(state, kv)
        accepted += result.accepted
        assert int(state.num_tokens) == int(expected.num_tokens)
        np.testing.assert_array_equal(state.tokens, expected.tokens)
        assert int(state.num_features) == int(expected.num_features)
        _close(state.features, expected.features)
        for got, want in zip(
            jax.tree_util.tree_leaves(state.drafter_state),
            jax.tree_util.tree_leaves(expected.drafter_state),
        ):
            _close(got, want)
        n = kv.length
        assert n == int(expected.cache.length)
        _close(bridge.to_jax(kv.k[:, :n]), expected.cache.k[:, :n])
        _close(bridge.to_jax(kv.v[:, :n]), expected.cache.v[:, :n])
    assert which != "oracle" or accepted > 0


def test_eos_stops_exactly_like_jax(params, teacher, greedy):
    # The first token that is new to the output, a few tokens in: stop right after it.
    index = next(i for i in range(3, len(greedy)) if greedy[i] not in greedy[:i])
    spec = dataclasses.replace(SPEC, eos_id=greedy[index])
    drafter = OracleDrafter(tuple(greedy))
    model = TorchLlama(CFG, params, attention_impl="sdpa")
    result = generate_torch(model, drafter, PROMPT, spec)
    _assert_same_run(result, gen.generate(teacher, drafter, PROMPT, spec))
    assert result.tokens == greedy[: index + 1]


@pytest.mark.parametrize("mode", ["tree", "branches"])
def test_whole_loop_runs_clean_under_the_simulator(params, greedy, mode):
    drafter = OracleDrafter(tuple(greedy))
    model = TorchLlama(CFG, params, attention_impl="npu_fused")
    with simulated_npu() as npu:
        result = generate_torch(
            model, drafter, PROMPT, SPEC, mode=mode, index_select=simulated.index_select
        )
    assert result.tokens == greedy
    prefill_chunks = 1
    assert npu.calls == CFG.num_layers * (prefill_chunks + result.stats.rounds)


def _sdpa_polarity(mask, multiple=attention.KV_ALIGN):
    """The naive conversion: key padding added, but True = attend handed over unchanged."""
    padded = mask_lib.pad_keys(bridge.to_jax(mask), multiple)
    return bridge.to_torch(padded.astype(jnp.uint8), mask.device)


@pytest.mark.parametrize("mode", ["tree", "branches"])
def test_sdpa_polarity_mask_is_caught_at_runner_level(params, greedy, monkeypatch, mode):
    monkeypatch.setattr(attention, "ascend_mask", _sdpa_polarity)
    model = TorchLlama(CFG, params, attention_impl="npu_fused")
    with simulated_npu(), pytest.raises(AscendConstraintError, match="masked"):
        generate_torch(model, OracleDrafter(tuple(greedy)), PROMPT, SPEC, mode=mode)


def test_reference_mode_checks_and_agrees(params, greedy, reference_mode):
    # A spec of its own, so nothing traced in performance mode is reused.
    spec = dataclasses.replace(SPEC, max_new_tokens=20)
    model = TorchLlama(CFG, params, attention_impl="eager")
    runner = TorchTeacherRunner(model, OracleDrafter(tuple(greedy)), spec, mode="branches")
    assert runner.index_select is simulated.index_select  # range-checked gathers
    assert runner.generate(PROMPT).tokens == greedy[:20]


def test_bad_input_is_refused(params):
    model = TorchLlama(CFG, params, attention_impl="eager")
    with pytest.raises(ValueError, match="mode must be one of"):
        TorchTeacherRunner(model, None, SPEC, mode="chains")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        generate_torch(model, None, [3, CFG.vocab_size], SPEC)
    with pytest.raises(ValueError, match="empty"):
        generate_torch(model, None, [], SPEC)


def test_the_runner_advances_state_with_the_engines_function():
    # One state advance for both backends: the runner's finish step calls the engine's.
    assert runner_lib.advance_state is engine_step.advance_state
    assert runner_lib.plan_round is engine_step.plan_round


@dataclasses.dataclass(frozen=True)
class HostileDrafter:
    """A fixed tree whose token ids leave the vocabulary: root -> 1 -> 2 -> 3 and
    root -> 4 -> 5, with slot 2 (under the correct first token) and slot 4 out of range."""

    first: int  # the greedy continuation's first token
    bad: tuple[int, int] = (-1, CFG.vocab_size + 5)
    name: str = "hostile"
    feature_layers: tuple[int, ...] = ()

    @property
    def max_depth(self):
        return 4

    def init_state(self, params, context):
        return None

    def update(self, params, state, context):
        return state

    def propose(self, params, state, context, key):
        root = context.tokens[context.num_tokens - 1]
        tokens = jnp.asarray([0, self.first, self.bad[0], 7, self.bad[1], 8, 0, 0, 0], jnp.int32)
        tree = tree_lib.from_parents(  # budget + 1 = 9 slots, the last three padding
            jnp.asarray([0, 0, 1, 2, 0, 4, 0, 0, 0], jnp.int32),
            tokens=tokens.at[0].set(root),
            valid=jnp.arange(9) < 6,
            max_depth=4,
        )
        return Proposal(tree=tree)


HOSTILE_SPEC = dataclasses.replace(SPEC, policy="drafter", max_new_tokens=6)


def _first_plan(runner, state, kv):
    return runner_lib._plan(
        runner.static,
        None,
        state,
        jnp.int32(kv.length),
        None,
        jnp.float32(0.0),
        window=gen.window_for(kv.length + runner.static.tree_slots, runner._capacity(kv)),
        branches=False,
        table=runner.branch_table,
    )


@pytest.mark.parametrize("mode", ["tree", "branches"])
def test_hostile_token_ids_become_padding(params, teacher, greedy, mode, performance_mode):
    drafter = HostileDrafter(first=greedy[0])
    model = TorchLlama(CFG, params, attention_impl="eager")
    runner = TorchTeacherRunner(model, drafter, HOSTILE_SPEC, mode=mode)
    state, kv = runner.start(PROMPT)
    tree = _first_plan(runner, state, kv).tree
    valid = np.asarray(tree.valid)
    # The bad nodes and their descendants are padding; the good prefix stays.
    assert valid[:6].tolist() == [True, True, False, False, False, False]
    assert not valid[6:].any()
    tokens = np.asarray(tree.tokens)
    assert ((tokens >= 0) & (tokens < CFG.vocab_size)).all()  # nothing hostile reaches torch
    result = runner.generate(PROMPT)
    expected = gen.generate(teacher, drafter, PROMPT, HOSTILE_SPEC)
    _assert_same_run(result, expected)
    assert result.tokens == greedy[: HOSTILE_SPEC.max_new_tokens]
    assert set(result.stats.nodes_per_round) == {1}  # only the good first node is verified


def test_hostile_token_ids_raise_naming_the_node_in_reference_mode(params, greedy, reference_mode):
    spec = dataclasses.replace(HOSTILE_SPEC, max_new_tokens=5)  # a trace of its own
    model = TorchLlama(CFG, params, attention_impl="eager")
    # The engine's tree check, inherited through plan_round, raised by checkify.
    with pytest.raises(Exception, match=r"outside the vocabulary \[0, 61\) at node 2"):
        generate_torch(model, HostileDrafter(first=greedy[0]), PROMPT, spec)


def test_method_runner_is_a_peer_runner(params, teacher):
    drafter = NGramDrafter(budget=8, depth=4, num_matches=4)
    model = TorchLlama(CFG, params, attention_impl="sdpa")
    runner = TorchMethodRunner(model, drafter, costs=lambda n: (None, 0.0))
    spec = dataclasses.replace(SPEC, eos_id=None)
    result = runner(PROMPT, spec, eos_id=NO_EOS)
    _assert_same_run(result, gen.generate(teacher, drafter, PROMPT, SPEC))
    assert runner.describe() == {
        "backend": "torch",
        "device": "cpu",
        "dtype": "float32",
        "attention_impl": "sdpa",
        "mode": "tree",
    }
    with pytest.raises(ValueError, match="mode must be one of"):
        TorchMethodRunner(model, drafter, mode="chains")


@pytest.mark.slow
def test_smollm2_ngram_tree_and_branches_equal_jax():
    from eaglepangu_jax.models import chat, llama, smollm2, tokenizer

    config, weights = smollm2.load_smollm2()
    teacher = gen.Teacher(config, llama.prepare_params(weights))
    model = TorchLlama(config, weights, attention_impl="sdpa")
    tok = tokenizer.load_tokenizer()
    drafter = NGramDrafter(budget=12, depth=6)
    spec = SpecConfig(budget=12, depth=6, max_new_tokens=32)
    questions = [
        "Write a Python function that returns the squares of a list of numbers.",
        "List the first five prime numbers, one per line.",
    ]
    accepted = 0
    for question in questions:
        prompt = chat.encode_chat(tok, [{"role": "user", "content": question}])
        expected = gen.generate(teacher, drafter, prompt, spec)
        for mode in ("tree", "branches"):
            result = generate_torch(model, drafter, prompt, spec, mode=mode)
            assert result.tokens == expected.tokens, mode
            assert result.stats.accepted_per_round == expected.stats.accepted_per_round, mode
        accepted += sum(expected.stats.accepted_per_round)
    assert accepted > 0
