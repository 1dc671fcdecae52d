"""The transformers peers: round counting (exact), a tiny random model, the real teacher."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from eaglepangu_jax import runtime
from eaglepangu_jax.engine.config import SpecConfig
from eaglepangu_jax.evaluation import run as bench_run
from eaglepangu_jax.methods import peers
from eaglepangu_jax.methods import registry as methods_lib


def _calls(prompt_len, emitted, candidates, *, first_end=1.0, step=0.5):
    """Forward calls of a run emitting ``emitted[r]`` tokens after ``candidates[r]`` drafts."""
    calls, done = [], 0
    for r, (e, c) in enumerate(zip(emitted, candidates)):
        if r == 0:
            position, inputs = 0, prompt_len + c
        else:
            position, inputs = prompt_len + done - 1, 1 + c
        calls.append(
            peers.ForwardCall(end=first_end + r * step, first_position=position, num_inputs=inputs)
        )
        done += e
    return calls


def test_greedy_counts_one_token_per_round():
    tokens = [7, 8, 9, 10]
    stats = peers.count_rounds(
        _calls(5, [1, 1, 1, 1], [0, 0, 0, 0]), tokens, prompt_len=5, start=0.25, end=2.75
    )
    assert (stats.new_tokens, stats.rounds, stats.accepted_length) == (4, 4, 1.0)
    assert stats.accepted_per_round == (0, 0, 0, 0) and stats.nodes_per_round == (0, 0, 0, 0)
    # The first call (prompt + first token) is the prefill; the 3 later tokens over 1.75 s.
    assert stats.prefill_seconds == pytest.approx(0.75)
    assert stats.seconds == pytest.approx(1.75)
    assert stats.tokens_per_s == pytest.approx(3 / 1.75)


def test_prompt_lookup_rounds():
    # Round 1 verifies 3 candidates after the 5-token prompt and keeps 2 (+ bonus); round 2
    # verifies 3 more at the last committed token and keeps all of them (+ bonus).
    calls = [
        peers.ForwardCall(end=1.0, first_position=0, num_inputs=8),
        peers.ForwardCall(end=2.0, first_position=7, num_inputs=4),
    ]
    stats = peers.count_rounds(calls, list(range(7)), prompt_len=5, start=0.0, end=2.5)
    assert stats.rounds == 2 and stats.accepted_length == 3.5
    assert stats.accepted_per_round == (2, 3) and stats.nodes_per_round == (3, 3)
    assert stats.tokens_per_s == pytest.approx(4 / 1.5)


def test_one_round_has_no_decoding_rate():
    calls = [peers.ForwardCall(end=1.0, first_position=0, num_inputs=4)]
    stats = peers.count_rounds(calls, [5], prompt_len=4, start=0.0, end=1.0)
    assert stats.rounds == 1 and stats.accepted_length == 1.0
    assert math.isnan(stats.tokens_per_s)  # the bench records None and skips it


@pytest.mark.parametrize("positions", [[0, 5, 5], [3, 6], [0, 9]])
def test_inconsistent_calls_are_refused(positions):
    calls = [peers.ForwardCall(end=1.0, first_position=p, num_inputs=1) for p in positions]
    with pytest.raises(ValueError, match="do not fit a 5-token prompt"):
        peers.count_rounds(calls, [1, 2, 3], prompt_len=5, start=0.0, end=2.0)


def test_no_call_is_refused():
    with pytest.raises(ValueError, match="without a single forward call"):
        peers.count_rounds([], [1], prompt_len=5, start=0.0, end=2.0)


@given(
    prompt_len=st.integers(1, 50),
    rounds=st.lists(st.tuples(st.integers(1, 11), st.integers(0, 10)), min_size=1, max_size=30),
)
def test_count_rounds_recovers_every_round(prompt_len, rounds):
    emitted = [e for e, _ in rounds]
    candidates = [max(c, e - 1) for e, c in rounds]  # a round keeps at most its drafts + 1
    tokens = list(range(sum(emitted)))
    stats = peers.count_rounds(
        _calls(prompt_len, emitted, candidates), tokens, prompt_len=prompt_len, start=0.0, end=100.0
    )
    assert stats.rounds == len(rounds) and stats.new_tokens == len(tokens)
    assert stats.accepted_length == pytest.approx(len(tokens) / len(rounds))
    assert stats.accepted_per_round == tuple(e - 1 for e in emitted)
    assert stats.nodes_per_round == tuple(candidates)
    assert sum(stats.accepted_per_round) + stats.rounds == stats.new_tokens


def test_reference_stack_missing(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(
        peers.ReferenceStackMissingError,
        match=r"torch\. Install them with: pip install 'eaglepangu\[reference\]'",
    ):
        peers.import_reference_stack()
    with pytest.raises(peers.ReferenceStackMissingError, match="reference"):
        peers.set_torch_threads(1)


def test_peer_settings_are_checked():
    with pytest.raises(ValueError, match="prompt_lookup must be >= 1"):
        peers.TransformersPeer(prompt_lookup=0)
    with pytest.raises(ValueError, match="torch_threads must be >= 1"):
        peers.TransformersPeer(torch_threads=0)
    sampled = SpecConfig(acceptance="sample", temperature=0.7)
    with pytest.raises(ValueError, match="decode greedily"):
        peers.TransformersPeer()([1, 2], sampled, eos_id=2)


# ----------------------------------------------------------------------------- real generate


@pytest.fixture(scope="module")
def tiny_model():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=61,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    # float64: the multi-token verify forward and the one-token steps then agree far past
    # any logit gap of this random model, so prompt lookup must reproduce greedy exactly.
    return transformers.LlamaForCausalLM(config).to(torch.float64).eval()


@pytest.mark.reference
def test_hooked_generate_counts_a_tiny_model(tiny_model):
    prompt = [3, 4, 5, 6, 3, 4, 5, 6, 3, 4, 5, 6, 3, 4]
    greedy = peers.transformers_generate(tiny_model, prompt, max_new_tokens=24, eos_id=999)
    assert len(greedy.tokens) == 24
    assert greedy.stats.rounds == 24 and greedy.stats.accepted_length == 1.0
    assert greedy.stats.nodes_per_round == (0,) * 24
    pld = peers.transformers_generate(
        tiny_model, prompt, max_new_tokens=24, eos_id=999, prompt_lookup=4
    )
    assert pld.tokens == greedy.tokens
    s = pld.stats
    assert s.new_tokens == 24 and len(s.accepted_per_round) == s.rounds < 24  # drafts kept
    assert sum(s.accepted_per_round) + s.rounds == 24
    assert all(0 <= a <= n <= 4 for a, n in zip(s.accepted_per_round, s.nodes_per_round))
    # Stops at eos, which is counted: the first generated token made the stop token.
    stop = peers.transformers_generate(
        tiny_model, prompt, max_new_tokens=24, eos_id=greedy.tokens[0]
    )
    assert stop.tokens == greedy.tokens[:1] and stop.stats.rounds == 1


@pytest.mark.reference
def test_peer_reports_the_settings_in_effect():
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    settings = peers.TransformersPeer(prompt_lookup=4).describe()
    assert settings["prompt_lookup"] == 4 and settings["gguf_path"] is None
    assert settings["torch_threads"] == torch.get_num_threads()
    assert settings["implementation"].startswith("transformers ")


@pytest.mark.slow
@pytest.mark.reference
def test_peers_match_our_greedy_on_the_real_teacher():
    from eaglepangu_jax.models import smollm2

    try:
        smollm2.find_smollm2_gguf()
        peers.check_reference_stack()
    except (smollm2.ModelNotInstalledError, peers.ReferenceStackMissingError) as err:
        pytest.skip(str(err))
    teacher, renderer = runtime.load_teacher(), runtime.load_renderer()
    text = 'def running_max(xs):\n    """Running maximum of xs, as a list."""\n'
    ids = renderer.encode([{"role": "user", "content": text}])
    spec = SpecConfig(budget=8, depth=6, max_new_tokens=16)
    results = {
        name: bench_run.generate_with(teacher, methods_lib.make_method(name, spec), ids)
        for name in ("greedy", "transformers-greedy", "transformers-pld")
    }
    ours = results["greedy"].tokens
    assert len(ours) == 16 or ours[-1] == teacher.config.eos_id
    assert results["transformers-greedy"].tokens == ours
    assert results["transformers-pld"].tokens == results["transformers-greedy"].tokens
    assert results["transformers-greedy"].stats.accepted_length == 1.0
    assert results["transformers-pld"].stats.rounds <= 16
