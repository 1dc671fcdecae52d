"""Batched plain greedy decoding (the corpus path) equals per-prompt plain decoding: prompts of
different lengths, one crossing the first attention window, eos stops, and bad input."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from eaglepangu_jax.engine import decode as gen
from eaglepangu_jax.engine.config import SpecConfig
from eaglepangu_jax.engine.plain_batch import greedy_batch
from eaglepangu_jax.models.config import LlamaConfig
from eaglepangu_jax.models.init import random_params

CFG = LlamaConfig.tiny(vocab_size=61, max_position=512)


@pytest.fixture(scope="module")
def teacher():
    # Larger-than-default weights: peaked logits, so greedy is not a near-tie mess.
    params = random_params(CFG, jax.random.key(3))
    return gen.Teacher(CFG, jax.tree_util.tree_map(lambda x: x * 3.0 if x.ndim >= 2 else x, params))


def plain(teacher, prompt, max_new_tokens, eos_id):
    spec = SpecConfig(
        policy="drafter", budget=1, depth=1, max_new_tokens=max_new_tokens, eos_id=eos_id
    )
    return list(map(int, gen.generate(teacher, None, prompt, spec).tokens))


def test_equals_per_prompt_plain_decoding_across_a_window(teacher):
    rng = np.random.default_rng(0)
    # Lengths 1 (nothing to prefill), short, and 240 (decoding crosses the 256-slot window).
    prompts = [
        [7],
        rng.integers(0, CFG.vocab_size, 13).tolist(),
        rng.integers(0, CFG.vocab_size, 240).tolist(),
    ]
    got = greedy_batch(teacher, prompts, 30, eos_id=-7)  # an id never produced: no early stop
    want = [plain(teacher, p, 30, -7) for p in prompts]
    assert got == want
    assert [len(g) for g in got] == [30, 30, 30]


def test_each_sequence_stops_at_its_own_eos(teacher):
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, CFG.vocab_size, n).tolist() for n in (5, 9, 17, 33)]
    free = [plain(teacher, p, 24, -7) for p in prompts]
    eos = free[0][3]  # the first prompt's 4th token: it stops there, the others maybe later
    got = greedy_batch(teacher, prompts, 24, eos_id=eos)
    want = [plain(teacher, p, 24, eos) for p in prompts]
    assert got == want
    assert got[0] == free[0][:4]


def test_bad_input_names_the_prompt(teacher):
    with pytest.raises(ValueError, match="no prompts"):
        greedy_batch(teacher, [], 8)
    with pytest.raises(ValueError, match="prompt 1: the prompt is empty"):
        greedy_batch(teacher, [[3], []], 8)
    with pytest.raises(ValueError, match="prompt 0: .*outside the vocabulary"):
        greedy_batch(teacher, [[CFG.vocab_size]], 8)
    with pytest.raises(ValueError, match="prompt 0: .*needs .* positions"):
        greedy_batch(teacher, [[3] * 500], 64)
