"""The torch teacher against the JAX forward: same parameters, same logits, same cache."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from eaglepangu_jax import cache as jax_cache  # noqa: E402
from eaglepangu_jax import mask as jax_mask  # noqa: E402
from eaglepangu_jax import tree as jax_tree  # noqa: E402
from eaglepangu_jax.models import llama  # noqa: E402
from eaglepangu_jax.models.config import LlamaConfig  # noqa: E402
from eaglepangu_jax.models.init import random_params  # noqa: E402
from npu_backend.kv_cache import TorchKVCache  # noqa: E402
from npu_backend.llama_torch import TorchLlama, convert_params  # noqa: E402
from npu_backend.simulated import simulated_npu  # noqa: E402

TOL = dict(atol=1e-4, rtol=1e-4)
SLOTS = 40
FEATURES = (0, 2, 1)
jax_forward = jax.jit(llama.forward, static_argnames=("config", "feature_layers"))


@pytest.fixture(scope="module")
def tiny():
    config = LlamaConfig.tiny()
    return config, random_params(config, jax.random.key(7))


def _tensor(x):
    return torch.from_numpy(np.array(x))


def _prefill(config, params, model, tokens, window):
    """Prefill both models; returns (jax logits, jax features, jax cache, torch outputs, cache)."""
    t = len(tokens)
    toks = jnp.asarray(tokens, jnp.int32)
    pos = jnp.arange(t, dtype=jnp.int32)
    mask = jax_mask.causal_mask(t, 0, window)
    cache = jax_cache.init(config.num_layers, SLOTS, config.num_kv_heads, config.head_dim)
    logits, feats, cache = jax_forward(
        params, toks, pos, cache, mask, config=config, feature_layers=FEATURES
    )
    torch_cache = model.new_cache(SLOTS)
    out = model.forward(_tensor(toks), _tensor(pos), torch_cache, _tensor(mask), FEATURES)
    return (logits, feats, cache), out, torch_cache


def _assert_close(jax_array, tensor):
    np.testing.assert_allclose(tensor.float().numpy(), np.asarray(jax_array, np.float32), **TOL)


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_prefill_matches_jax(tiny, impl):
    config, params = tiny
    model = TorchLlama(config, params, attention_impl=impl)
    (logits, feats, cache), (t_logits, t_feats), t_cache = _prefill(
        config, params, model, [5, 17, 3, 90, 1, 44, 8], window=16
    )
    assert t_logits.dtype == torch.float32 and t_logits.shape == (7, config.vocab_size)
    assert t_feats.shape == (7, len(FEATURES), config.hidden_size)
    _assert_close(logits, t_logits)
    _assert_close(feats, t_feats)
    _assert_close(cache.k, t_cache.k)
    _assert_close(cache.v, t_cache.v)
    assert t_cache.length == 0  # the forward never commits


def test_tree_verification_and_commit_match_jax(tiny):
    config, params = tiny
    model = TorchLlama(config, params, attention_impl="eager")
    prompt = [3, 9, 27, 81, 50]
    (_, _, cache), _, t_cache = _prefill(config, params, model, prompt, window=SLOTS)
    cache = jax_cache.advance(cache, len(prompt))
    t_cache.advance(len(prompt))

    tree, _ = jax_tree.from_choices([[0], [1], [0, 0], [0, 1], [1, 0], [0, 1, 0]])
    n = tree.num_slots
    tokens = jnp.asarray([12, 4, 60, 33, 2, 71, 18][:n], jnp.int32)
    positions = jax_tree.positions(tree, cache.length)
    mask = jax_mask.verify_mask(tree, cache.length, SLOTS)
    logits, feats, cache = jax_forward(
        params, tokens, positions, cache, mask, config=config, feature_layers=FEATURES
    )
    t_logits, t_feats = model.forward(
        _tensor(tokens), _tensor(positions), t_cache, _tensor(mask), FEATURES
    )
    _assert_close(logits, t_logits)
    _assert_close(feats, t_feats)

    # Accept the deepest path (root -> [0] -> [0, 1] -> [0, 1, 0]): a path that must move.
    leaf = n - 1
    depth = int(tree.depth[leaf])
    path = jax_tree.path_to(tree, leaf)
    cache = jax_cache.commit(cache, path, depth)
    moved = t_cache.commit_path(np.asarray(path)[: depth + 1])
    assert moved > 0
    assert t_cache.length == int(cache.length) == len(prompt) + depth + 1
    _assert_close(cache.k[:, : t_cache.length], t_cache.k[:, : t_cache.length])
    _assert_close(cache.v[:, : t_cache.length], t_cache.v[:, : t_cache.length])


def test_untied_lm_head_matches_jax():
    config = LlamaConfig.tiny(tie_embeddings=False)
    params = random_params(config, jax.random.key(1))
    model = TorchLlama(config, params, attention_impl="sdpa")
    (logits, _, _), (t_logits, _), _ = _prefill(config, params, model, [1, 2, 3], window=8)
    _assert_close(logits, t_logits)


def test_npu_fused_under_the_simulator_matches_eager(tiny):
    config, params = tiny
    tokens, positions = torch.tensor([4, 8, 15, 16, 23]), torch.arange(5)
    mask = _tensor(jax_mask.causal_mask(5, 0, 24))  # 24 slots: the fused path pads the keys
    eager = TorchLlama(config, params, attention_impl="eager")
    expected, expected_feats = eager.forward(
        tokens, positions, eager.new_cache(SLOTS), mask, FEATURES
    )
    fused = TorchLlama(config, params, attention_impl="npu_fused")
    with simulated_npu() as npu:
        logits, feats = fused.forward(tokens, positions, fused.new_cache(SLOTS), mask, FEATURES)
    assert npu.calls == config.num_layers
    torch.testing.assert_close(logits, expected, **TOL)
    torch.testing.assert_close(feats, expected_feats, **TOL)


def test_cached_decoding_equals_one_prefill(tiny):
    config, params = tiny
    model = TorchLlama(config, params, attention_impl="sdpa")
    tokens = [7, 1, 30, 2, 66, 5]
    full, _ = model.forward(
        tokens, range(6), model.new_cache(16), _tensor(jax_mask.causal_mask(6, 0, 16))
    )
    cache = model.new_cache(16)
    model.forward(tokens[:4], range(4), cache, _tensor(jax_mask.causal_mask(4, 0, 16)))
    cache.advance(4)
    step, _ = model.forward(tokens[4:], [4, 5], cache, _tensor(jax_mask.causal_mask(2, 4, 16)))
    torch.testing.assert_close(step, full[4:], **TOL)


def test_bfloat16_runs_and_stays_near_float32(tiny):
    config, params = tiny
    mask = _tensor(jax_mask.causal_mask(4, 0, 8))
    f32 = TorchLlama(config, params, attention_impl="eager")
    bf16 = TorchLlama(config, params, dtype=torch.bfloat16, attention_impl="eager")
    ref, _ = f32.forward([1, 2, 3, 4], range(4), f32.new_cache(8), mask)
    low, _ = bf16.forward([1, 2, 3, 4], range(4), bf16.new_cache(8), mask)
    assert bf16.new_cache(8).k.dtype == torch.bfloat16 and low.dtype == torch.float32
    assert (low - ref).abs().max() < 0.25 * ref.abs().max()


def test_bad_forward_inputs_are_refused(tiny):
    config, params = tiny
    model = TorchLlama(config, params, attention_impl="eager")
    cache = model.new_cache(8)
    causal = _tensor(jax_mask.causal_mask(3, 0, 8))
    with pytest.raises(ValueError, match="mask must be bool"):
        model.forward([1, 2, 3], range(3), cache, causal.to(torch.uint8))
    with pytest.raises(ValueError, match="mask must be bool"):
        model.forward([1, 2, 3], range(3), cache, torch.ones(3, 9, dtype=torch.bool))
    with pytest.raises(ValueError, match="window"):
        model.forward([1, 2, 3], range(3), cache, causal[:, :2])
    with pytest.raises(ValueError, match="feature_layers"):
        model.forward([1, 2, 3], range(3), cache, causal, feature_layers=(3,))
    with pytest.raises(ValueError, match="positions"):
        model.forward([1, 2, 3], range(2), cache, causal)
    with pytest.raises(ValueError, match="attention_impl"):
        TorchLlama(config, params, attention_impl="flash")


def test_parameter_table_is_checked(tiny):
    config, params = tiny
    with pytest.raises(ValueError, match=r"missing \['final_norm'\]"):
        convert_params({k: v for k, v in params.items() if k != "final_norm"}, config)
    with pytest.raises(ValueError, match=r"unexpected \['final_norm/x'\]"):
        convert_params({**params, "final_norm": {"x": params["final_norm"]}}, config)
    wrong = {**params, "layers": {**params["layers"], "wq": params["layers"]["wk"]}}
    with pytest.raises(ValueError, match="layers/wq"):
        convert_params(wrong, config)
    numpy_params = jax.tree_util.tree_map(np.asarray, params)
    converted = convert_params(numpy_params, config, dtype=torch.bfloat16)
    assert converted["layers/wq"].dtype == torch.bfloat16


def test_prepared_layout_gives_the_same_logits(tiny):
    config, params = tiny
    prepared = llama.prepare_params(params)
    mask = _tensor(jax_mask.causal_mask(3, 0, 8))
    stacked = TorchLlama(config, params, attention_impl="eager")
    per_layer = TorchLlama(config, prepared, attention_impl="eager")
    assert per_layer.params.keys() == stacked.params.keys() | {"lm_head"}
    expected, _ = stacked.forward([5, 6, 7], range(3), stacked.new_cache(8), mask)
    logits, _ = per_layer.forward([5, 6, 7], range(3), per_layer.new_cache(8), mask)
    torch.testing.assert_close(logits, expected, **TOL)
    broken = {**prepared, "layers": prepared["layers"][:2]}
    with pytest.raises(ValueError, match="layers/wq"):
        convert_params(broken, config)


def _filled_cache(slots=10, length=2):
    """A 1-layer cache whose slot s holds the value s (easy to read moves back)."""
    values = torch.arange(slots, dtype=torch.float32)[None, :, None, None].expand(1, slots, 1, 2)
    return TorchKVCache(k=values.clone(), v=-values.clone(), length=length)


def test_commit_path_moves_only_the_new_segment():
    cache = _filled_cache()
    # Tree slots 0 and 1 are in place; 4 and 7 (cache slots 6 and 9) move to 4 and 5.
    assert cache.commit_path([0, 1, 4, 7]) == 2
    assert cache.length == 6
    assert cache.k[0, :, 0, 0].tolist() == [0, 1, 2, 3, 6, 9, 6, 7, 8, 9]
    assert cache.v[0, :, 0, 0].tolist() == [-0.0, -1, -2, -3, -6, -9, -6, -7, -8, -9]
    untouched = _filled_cache()
    assert untouched.commit_path([0, 1, 2]) == 0 and untouched.length == 5
    assert torch.equal(untouched.k, _filled_cache().k)


def test_commit_length_and_advance_follow_the_jax_cache():
    cache = _filled_cache(length=2)
    cache.commit_length(3)  # root + 3 accepted
    assert cache.length == 6
    cache.advance(4)
    assert cache.length == 10
    with pytest.raises(ValueError, match="cannot advance"):
        cache.advance(1)
    with pytest.raises(ValueError, match="accepted"):
        _filled_cache().commit_length(-1)


@pytest.mark.parametrize(
    "path, message",
    [
        ([0, -1], "does not fit"),
        ([0, 8], "does not fit"),
        ([1, 2], "root"),
        ([], "root"),
        ([0, 3, 3], "repeats"),
    ],
)
def test_commit_path_refuses_bad_paths(path, message):
    cache = _filled_cache()
    with pytest.raises(ValueError, match=message):
        cache.commit_path(path)
    assert cache.length == 2 and torch.equal(cache.k, _filled_cache().k)


def test_write_refuses_overflow():
    cache = TorchKVCache.empty(1, 4, 1, 2)
    cache.advance(3)
    with pytest.raises(ValueError, match="overflow"):
        cache.write(0, torch.ones(2, 1, 2), torch.ones(2, 1, 2))


@pytest.mark.slow
def test_real_smollm2_matches_jax():
    from eaglepangu_jax.models.smollm2 import load_smollm2

    config, params = load_smollm2()
    model = TorchLlama(config, params, attention_impl="sdpa")
    tokens = [1, 504, 3458, 314, 4649, 30, 2]
    features = (2, config.num_layers // 2, config.num_layers - 3)
    mask = jax_mask.causal_mask(len(tokens), 0, 16)
    cache = jax_cache.init(config.num_layers, 16, config.num_kv_heads, config.head_dim)
    toks, pos = jnp.asarray(tokens, jnp.int32), jnp.arange(len(tokens), dtype=jnp.int32)
    logits, feats, _ = jax_forward(
        params, toks, pos, cache, mask, config=config, feature_layers=features
    )
    t_logits, t_feats = model.forward(
        tokens, range(len(tokens)), model.new_cache(16), _tensor(mask), features
    )
    _assert_close(logits, t_logits)
    _assert_close(feats, t_feats)
