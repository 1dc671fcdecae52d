"""Prefill, greedy generation and the verification forward on a tiny random model."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eaglepangu_jax import cache as kv_cache
from eaglepangu_jax.models import decode, llama
from eaglepangu_jax.models.config import LlamaConfig
from eaglepangu_jax.models.init import random_params

CONFIG = LlamaConfig.tiny()


@pytest.fixture(scope="module")
def params():
    return llama.prepare_params(random_params(CONFIG, jax.random.PRNGKey(1)))


def _cache(slots=128):
    return kv_cache.init(CONFIG.num_layers, slots, CONFIG.num_kv_heads, CONFIG.head_dim)


@pytest.fixture(scope="module")
def uncached_logits(params):
    """Logits of a whole sequence in one causal forward (the ground truth)."""
    fwd = jax.jit(llama.forward, static_argnames=("config", "feature_layers"))

    def run(tokens, feature_layers=()):
        t = len(tokens)
        # Right-padded to a multiple of 32 (few compiled shapes): causal rows never see the
        # padding after them.
        width = -(-t // 32) * 32
        padded = np.zeros(width, np.int32)
        padded[:t] = tokens
        mask = jnp.arange(width)[None, :] <= jnp.arange(width)[:, None]
        cache = kv_cache.init(CONFIG.num_layers, width, CONFIG.num_kv_heads, CONFIG.head_dim)
        logits, feats, _ = fwd(params, jnp.asarray(padded), jnp.arange(width), cache, mask,
                               config=CONFIG, feature_layers=feature_layers)
        return np.asarray(logits)[:t], np.asarray(feats)[:t]

    return run


def _naive_greedy(uncached_logits, prompt, n):
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(np.argmax(uncached_logits(seq)[0][-1])))
    return seq[len(prompt):]


@pytest.mark.parametrize("chunk", [4, 128])
def test_prefill_chunked_equals_one_forward(params, uncached_logits, chunk):
    prompt = np.arange(11) * 7 % CONFIG.vocab_size
    ref_logits, ref_feats = uncached_logits(prompt, (0, 2))
    last, feats, cache = decode.prefill(params, CONFIG, prompt, _cache(), chunk=chunk,
                                        feature_layers=(0, 2))
    assert int(cache.length) == 11
    np.testing.assert_allclose(last, ref_logits[-1], atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(feats, ref_feats, atol=1e-5, rtol=1e-5)
    # Appending to a non-empty cache continues positions from its length.
    last2, _, cache = decode.prefill(params, CONFIG, [5, 6, 7], cache, chunk=chunk)
    full, _ = uncached_logits(np.concatenate([prompt, [5, 6, 7]]))
    np.testing.assert_allclose(last2, full[-1], atol=1e-5, rtol=1e-5)
    assert int(cache.length) == 14


def test_prefill_without_room_for_padding(params, uncached_logits):
    # 5 tokens would pad to 8, which does not fit 6 slots: the piece runs unpadded.
    last, _, cache = decode.prefill(params, CONFIG, [1, 2, 3, 4, 5], _cache(6), chunk=16)
    np.testing.assert_allclose(last, uncached_logits([1, 2, 3, 4, 5])[0][-1], atol=1e-5)
    assert int(cache.length) == 5


def test_greedy_matches_naive_decoding_across_window_buckets(params, uncached_logits):
    prompt = list(range(3, 63))  # 60 tokens: generation crosses the 64-slot window
    new = decode.greedy_generate(params, CONFIG, prompt, 12)
    assert new.dtype == np.int32
    assert new.tolist() == _naive_greedy(uncached_logits, prompt, 12)


def test_greedy_stacked_params_and_explicit_cache(params, uncached_logits):
    stacked = random_params(CONFIG, jax.random.PRNGKey(1))
    new = decode.greedy_generate(stacked, CONFIG, [4, 5], 5, cache_slots=7)
    assert new.tolist() == _naive_greedy(uncached_logits, [4, 5], 5)


def test_greedy_stops_after_eos(params):
    free = decode.greedy_generate(params, CONFIG, [9, 8, 7], 10)
    eos = int(free[3])
    first = free.tolist().index(eos)
    stopped = decode.greedy_generate(params, CONFIG, [9, 8, 7], 10, eos_id=eos)
    assert stopped.tolist() == free[:first + 1].tolist()
    assert decode.greedy_generate(params, CONFIG, [9, 8, 7], 0).shape == (0,)


def test_greedy_does_not_recompile_for_new_values(params):
    decode.greedy_generate(params, CONFIG, [1, 2, 3, 4], 6)
    sizes = (decode._greedy_segment._cache_size(), decode._prefill_chunk._cache_size())
    decode.greedy_generate(params, CONFIG, [9, 9, 5, 1], 5, eos_id=3)
    halved = jax.tree.map(lambda a: a * 0.5, params)
    decode.greedy_generate(halved, CONFIG, [7, 7, 7, 7], 6)
    assert (decode._greedy_segment._cache_size(), decode._prefill_chunk._cache_size()) == sizes


@pytest.mark.parametrize("kwargs, match", [
    (dict(prompt=[]), "empty"),
    (dict(prompt=[1, 2, CONFIG.vocab_size]), "out of range"),
    (dict(prompt=[[1, 2]]), "1-D"),
    (dict(prompt=[1] * (CONFIG.max_position + 1), max_new=0, cache_slots=1024),
     "max_position"),
    (dict(prompt=[1] * 10, max_new=30, cache_slots=32), r"10\) \+ max_new_tokens \(30"),
])
def test_greedy_rejects_bad_requests_before_work(params, kwargs, match):
    with pytest.raises(ValueError, match=match):
        decode.greedy_generate(params, CONFIG, kwargs["prompt"], kwargs.get("max_new", 4),
                               cache_slots=kwargs.get("cache_slots"))


def test_check_budget_counts_the_tree():
    decode.check_budget(CONFIG, 10, 20, 40, tree_budget=10)
    with pytest.raises(ValueError, match=r"tree_budget \(11\) = 41 .* 40 slots"):
        decode.check_budget(CONFIG, 10, 20, 40, tree_budget=11)


def test_verify_chain_equals_greedy(params, uncached_logits):
    prompt = [3, 1, 4, 1, 5]
    chain = _naive_greedy(uncached_logits, prompt, 6)
    _, _, cache = decode.prefill(params, CONFIG, prompt, _cache(64))
    # Root = first generated token, then a chain of the next ones; all must be confirmed.
    tokens = jnp.asarray(chain, jnp.int32)
    n = tokens.shape[0]
    mask = jnp.arange(64)[None, :] <= (5 + jnp.arange(n))[:, None]
    logits, feats, cache = decode.verify_forward(params, CONFIG, tokens, 5 + jnp.arange(n),
                                                 cache, mask, feature_layers=(1,), window=16)
    assert feats.shape == (n, 1, CONFIG.hidden_size)
    assert int(cache.length) == 5
    predicted = np.argmax(np.asarray(logits), axis=-1)
    assert predicted[:-1].tolist() == chain[1:]


def test_verify_window_must_cover_the_tree(params, reference_mode):
    _, _, cache = decode.prefill(params, CONFIG, list(range(1, 15)), _cache(64))
    tokens = jnp.arange(4, dtype=jnp.int32)
    mask = jnp.ones((4, 64), bool)
    with pytest.raises(ValueError, match="window of 16"):
        decode.verify_forward(params, CONFIG, tokens, tokens + 14, cache, mask, window=16)
    with pytest.raises(ValueError, match="window=65"):
        decode.verify_forward(params, CONFIG, tokens, tokens + 14, cache, mask, window=65)


def test_verify_does_not_recompile_for_new_values(params):
    def run(tokens, length):
        cache = kv_cache.KVCache(k=_cache(64).k, v=_cache(64).v, length=jnp.int32(length))
        positions = length + jnp.arange(4)
        mask = jnp.arange(64)[None, :] <= positions[:, None]
        return decode.verify_forward(params, CONFIG, jnp.asarray(tokens, jnp.int32),
                                     positions, cache, mask, window=32)

    run([1, 2, 3, 4], 3)
    size = decode._verify_jit._cache_size()
    logits, _, cache = run([5, 6, 7, 8], 20)
    assert decode._verify_jit._cache_size() == size
    assert int(cache.length) == 20 and np.isfinite(np.asarray(logits)).all()
