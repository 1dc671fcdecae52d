"""The JAX teacher against transformers on the real SmolLM2 weights (same GGUF file)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eaglepangu_jax import cache as kv_cache
from eaglepangu_jax.engine.config import SpecConfig
from eaglepangu_jax.engine.decode import Teacher, generate
from eaglepangu_jax.methods import peers
from eaglepangu_jax.models import chat, llama, smollm2, tokenizer

pytestmark = [pytest.mark.slow, pytest.mark.reference]

TEXTS = [
    "Hello!",
    "The quick brown fox jumps over the lazy dog. Speculative decoding drafts several tokens "
    "and lets the large model check them all in one forward pass.",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n    a, b = 0, 1\n'
    "    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n\n"
    "def is_prime(n):\n    if n < 2:\n        return False\n    for d in range(2, int(n ** 0.5)"
    " + 1):\n        if n % d == 0:\n            return False\n    return True\n\n\n"
    "# Print the first primes among the Fibonacci numbers, one per line, with their index.\n",
]
PADDED = 192
TAPPED = (2, 15)


@pytest.fixture(scope="module")
def teacher():
    try:
        path = smollm2.find_smollm2_gguf()
    except smollm2.ModelNotInstalledError as err:
        pytest.skip(str(err))
    try:
        model = peers.load_transformers_teacher(path)
    except peers.ReferenceStackMissingError as err:
        pytest.skip(str(err))
    config, params = smollm2.load_smollm2()
    return config, llama.prepare_params(params), model, tokenizer.load_tokenizer(path)


def _hf_forward(model, ids):
    import torch

    with torch.no_grad():
        out = model(torch.tensor([ids]), output_hidden_states=True)
    return out.logits[0].numpy(), [h[0].numpy() for h in out.hidden_states]


def test_logits_and_features_match_transformers(teacher):
    config, params, model, tok = teacher
    prompts = [tok.encode(text) for text in TEXTS]
    assert sorted(len(p) for p in prompts) == [len(p) for p in prompts]  # three lengths
    assert len(prompts[-1]) <= PADDED
    # One compiled shape: each prompt is right-padded; causal attention keeps the real rows
    # independent of the padding after them.
    fwd = jax.jit(llama.forward, static_argnames=("config", "feature_layers"))
    mask = jnp.arange(PADDED)[None, :] <= jnp.arange(PADDED)[:, None]
    for ids in prompts:
        padded = np.zeros(PADDED, np.int32)
        padded[: len(ids)] = ids
        cache = kv_cache.init(config.num_layers, PADDED, config.num_kv_heads, config.head_dim)
        logits, feats, _ = fwd(
            params,
            jnp.asarray(padded),
            jnp.arange(PADDED),
            cache,
            mask,
            config=config,
            feature_layers=TAPPED,
        )
        ref_logits, ref_hidden = _hf_forward(model, ids)
        n = len(ids)
        assert np.abs(np.asarray(logits[:n]) - ref_logits).max() < 1e-3
        for f, layer in enumerate(TAPPED):
            ref = ref_hidden[layer + 1]
            err = np.abs(np.asarray(feats[:n, f]) - ref).max()
            assert err < 1e-4 * max(1.0, np.abs(ref).max()), (layer, err)


def test_64_greedy_tokens_identical(teacher):
    config, params, model, tok = teacher
    ids = chat.encode_chat(tok, [{"role": "user", "content": "Write a short poem about the sea."}])
    ours = generate(Teacher(config, params), None, ids, SpecConfig(max_new_tokens=64)).tokens
    theirs = peers.transformers_generate(model, ids, max_new_tokens=64, eos_id=config.eos_id).tokens
    assert len(ours) == 64 or ours[-1] == config.eos_id
    assert ours == theirs
