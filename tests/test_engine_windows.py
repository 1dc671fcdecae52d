"""The engine across an attention-window boundary.

:func:`~eaglepangu_jax.engine.decode.generate` runs its rounds in power-of-two attention
windows starting at ``MIN_WINDOW = 256`` and moves to a wider one when the sequence outgrows
it (prefill chunks likewise). Here a ~240-token prompt generates 40 tokens, so decoding
crosses slot 256 mid-generation, and a 290-token prompt crosses it during the prefill. Plain
greedy through the engine must equal a naive reference (a full uncached forward over the whole
sequence per new token), and speculative greedy with the n-gram drafter must equal plain
greedy.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eaglepangu_jax.drafters import NGramDrafter
from eaglepangu_jax.engine import decode as gen
from eaglepangu_jax.engine.config import SpecConfig
from eaglepangu_jax.models import llama
from eaglepangu_jax.models.config import LlamaConfig
from eaglepangu_jax.models.init import random_params

CFG = LlamaConfig.tiny(vocab_size=61, max_position=512)
NO_EOS = -7  # an id the vocabulary never produces, so runs last max_new_tokens
NEW_TOKENS = 40
REFERENCE_LEN = CFG.max_position  # the naive reference's fixed (padded) sequence length
MIN_MARGIN = 1e-3  # top-1 minus top-2 logit: below this, float noise could flip the argmax


def repetitive_prompt(length: int) -> list[int]:
    """A 7-token motif, repeated with a changed token every third repeat: the n-gram drafter
    finds earlier occurrences of any suffix, and the text is not one constant cycle."""
    motif = [5, 9, 14, 3, 22, 7, 31]
    out = []
    while len(out) < length:
        rep = len(out) // len(motif)
        block = list(motif)
        if rep % 3 == 2:
            block[rep % len(motif)] = (block[rep % len(motif)] + rep) % CFG.vocab_size
        out += block
    return out[:length]


PROMPTS = {
    "crosses-256-while-decoding": repetitive_prompt(240),
    # Random ids: a repetitive prompt this long hides a wrong prefill window (the chunk past
    # slot 256 not seeing itself), since every token it lost has a twin that is still seen.
    "prompt-longer-than-256": np.random.default_rng(0).integers(0, CFG.vocab_size, 290).tolist(),
}


@pytest.fixture(scope="module")
def raw_params():
    # Larger-than-default weights: peaked logits, so greedy is not a near-tie mess.
    params = random_params(CFG, jax.random.key(3))
    return jax.tree_util.tree_map(lambda x: x * 3.0 if x.ndim >= 2 else x, params)


@pytest.fixture(scope="module")
def teacher(raw_params):
    return gen.Teacher(CFG, raw_params)


@jax.jit
def _full_forward(params, tokens):
    """Logits of every position of ``tokens``, from an empty cache: no chunks, no windows, no
    tree. Row ``t`` sees tokens ``[0, t]`` only, so trailing padding is harmless."""
    return llama.forward_sequence(params, tokens, config=CFG)[0]


def naive_greedy(params, prompt, n):
    """Oracle: one full uncached forward over the whole sequence per new token, argmax of
    the last real position. Returns the tokens and the smallest top-1 / top-2 logit gap."""
    seq = list(prompt)
    margin = np.inf
    for _ in range(n):
        padded = np.zeros((REFERENCE_LEN,), np.int32)
        padded[: len(seq)] = seq
        row = np.asarray(_full_forward(params, jnp.asarray(padded)))
        row = row[len(seq) - 1]
        top2 = np.sort(row)[-2:]
        margin = min(margin, float(top2[1] - top2[0]))
        seq.append(int(np.argmax(row)))
    return seq[len(prompt) :], margin


@pytest.fixture(scope="module")
def oracle(raw_params):
    """The naive greedy continuation of each prompt (the stacked, unprepared parameters: a
    different forward path from the engine's)."""
    out = {}
    for name, prompt in PROMPTS.items():
        tokens, margin = naive_greedy(raw_params, prompt, NEW_TOKENS)
        assert margin > MIN_MARGIN, f"{name}: a near-tie ({margin}) makes greedy ill-defined"
        assert len(set(tokens)) > 2, "the test teacher should not be degenerate"
        out[name] = tokens
    return out


@pytest.fixture
def windows(monkeypatch):
    """Every attention window the engine picks (prefill chunks and decode rounds). Both
    prompts use two: the 240-token one is prefilled in window 256 and decoded past it, the
    290-token one is prefilled across it."""
    seen = []
    real = gen.window_for

    def spy(needed, capacity):
        # A window too narrow for the next round would make the host loop spin forever.
        assert len(seen) < 100, "the engine keeps asking for windows: no progress"
        seen.append(real(needed, capacity))
        return seen[-1]

    monkeypatch.setattr(gen, "window_for", spy)
    return seen


# policy "drafter": the n-gram trees are verified whole, not pruned by the controller.
SPEC = SpecConfig(policy="drafter", budget=8, depth=4, max_new_tokens=NEW_TOKENS, eos_id=NO_EOS)
NGRAM = NGramDrafter(budget=8, depth=4, num_matches=4)


@pytest.mark.parametrize("name", list(PROMPTS))
def test_plain_greedy_across_the_window_equals_naive_forward(teacher, oracle, windows, name):
    prompt = PROMPTS[name]
    result = gen.generate(teacher, None, prompt, SPEC)
    assert result.tokens == oracle[name]
    assert result.stats.rounds == NEW_TOKENS
    assert len(set(windows)) > 1, "no window crossing"


@pytest.mark.parametrize("name", list(PROMPTS))
def test_ngram_speculation_across_the_window_equals_plain_greedy(teacher, oracle, windows, name):
    prompt = PROMPTS[name]
    plain = gen.generate(teacher, None, prompt, SPEC)
    windows.clear()
    result = gen.generate(teacher, NGRAM, prompt, SPEC)
    assert result.tokens == plain.tokens == oracle[name]
    assert sum(result.stats.accepted_per_round) > 0, "the n-gram drafter was never accepted"
    assert result.stats.rounds < NEW_TOKENS
    assert len(set(windows)) > 1, "no window crossing"
