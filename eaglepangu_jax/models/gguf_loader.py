"""Read a Llama-architecture GGUF file into a :class:`LlamaConfig` and the parameter pytree.

The GGUF stores one tensor per layer and per projection, output-major (a ``[out, in]`` numpy
array, which GGUF lists as ``[in, out]``), with Q and K rows in llama.cpp's interleaved rope
order. The loader maps every tensor name through an explicit table, dequantizes it to float32,
undoes the rope row order, transposes matrices to input-major and stacks layers on a leading
``L`` axis, giving the layout documented in :class:`LlamaConfig`.

Everything that can go wrong with the file itself (truncated, corrupt, unknown / missing /
duplicated tensors, shapes that contradict the metadata) raises :class:`ModelFileError`, whose
message names the file and the problem.
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path
from typing import Any, Mapping

import gguf
import jax.numpy as jnp
import numpy as np

from eaglepangu_jax.models.config import LlamaConfig

__all__ = [
    "ModelFileError",
    "FlatParams",
    "Params",
    "open_gguf",
    "read_field",
    "config_from_reader",
    "expected_shapes",
    "check_flat_params",
    "read_gguf_f32",
    "unflatten_params",
    "load_gguf",
    "interleaved_to_rotate_half",
    "rotate_half_to_interleaved",
    "config_to_json",
    "config_from_json",
]

FlatParams = dict[str, np.ndarray]
"""Parameters keyed by dotted path (``"layers.wq"``), float32 numpy: the cache's format."""
Params = dict[str, Any]
"""The nested parameter pytree of :class:`LlamaConfig` (``params["layers"]["wq"]``)."""

SUPPORTED_ARCHITECTURES = ("llama",)
SUPPORTED_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)

# GGUF name -> flat parameter name. Per-layer names are "blk.{i}.<key>.weight".
_GLOBAL_TENSORS = {
    "token_embd.weight": "embed",
    "output_norm.weight": "final_norm",
    "output.weight": "lm_head",
}
_LAYER_TENSORS = {
    "attn_norm": "layers.attn_norm",
    "attn_q": "layers.wq",
    "attn_k": "layers.wk",
    "attn_v": "layers.wv",
    "attn_output": "layers.wo",
    "ffn_norm": "layers.mlp_norm",
    "ffn_gate": "layers.w_gate",
    "ffn_up": "layers.w_up",
    "ffn_down": "layers.w_down",
}
_LAYER_NAME = re.compile(r"blk\.(\d+)\.([a-z_]+)\.weight")
# Linear layers are stored output-major ([out, in] as numpy); our layout is input-major.
# The embedding is a lookup table, [V, H] in both.
_TRANSPOSED = frozenset(
    {
        "layers.wq",
        "layers.wk",
        "layers.wv",
        "layers.wo",
        "layers.w_gate",
        "layers.w_up",
        "layers.w_down",
        "lm_head",
    }
)


class ModelFileError(ValueError):
    """A model file (GGUF or cached weights) is unreadable, corrupt or inconsistent."""


# ----------------------------------------------------------------------------- rope layout


def interleaved_to_rotate_half(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Reorder Q/K output rows from llama.cpp's interleaved rope order to rotate-half order.

    Within each head of ``Dh`` rows, llama.cpp's converter puts the two members of rotary pair
    ``i`` next to each other: GGUF row ``2*i + j`` holds rotate-half row ``j*Dh/2 + i``
    (``j`` in {0, 1}, ``i`` < Dh/2). Viewing the rows as ``[n_heads, Dh/2, 2]`` and swapping the
    last two axes to ``[n_heads, 2, Dh/2]`` gives back the rotate-half order that HF uses.

    Args:
      w: ``[n_heads * Dh, ...]`` rows in interleaved order (output-major weight).
      n_heads: heads sharing these rows (query heads for Q, KV heads for K).

    Returns:
      The same rows in rotate-half order (a new array).
    """
    rows = w.shape[0]
    if rows % (2 * n_heads):
        raise ValueError(f"{rows} rows cannot be split into {n_heads} heads of even size")
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def rotate_half_to_interleaved(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of :func:`interleaved_to_rotate_half` (what llama.cpp's converter applies)."""
    rows = w.shape[0]
    if rows % (2 * n_heads):
        raise ValueError(f"{rows} rows cannot be split into {n_heads} heads of even size")
    half = rows // n_heads // 2
    return w.reshape(n_heads, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# ----------------------------------------------------------------------------- metadata


def open_gguf(path: str | os.PathLike) -> gguf.GGUFReader:
    """Parse a GGUF header, turning any parse failure into :class:`ModelFileError`.

    Raises:
      FileNotFoundError: ``path`` does not exist.
      ModelFileError: the file is not a readable GGUF (bad magic, truncated, corrupt).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    if path.stat().st_size == 0:
        raise ModelFileError(f"{path}: the file is empty")
    try:
        return gguf.GGUFReader(path)
    except OSError:
        raise
    except Exception as err:  # the reader is a parser of untrusted bytes: any failure = bad file
        raise ModelFileError(
            f"{path}: not a readable GGUF file (truncated or corrupt?): {type(err).__name__}: {err}"
        ) from err


_MISSING = object()


def read_field(reader: gguf.GGUFReader, key: str, default: Any = _MISSING) -> Any:
    """The decoded value of metadata ``key``; ``default`` when absent, else ModelFileError."""
    field = reader.fields.get(key)
    if field is None:
        if default is _MISSING:
            raise ModelFileError(f"{reader.data.filename}: metadata key {key!r} is missing")
        return default
    try:
        return field.contents()
    except Exception as err:
        raise ModelFileError(
            f"{reader.data.filename}: metadata key {key!r} cannot be decoded: {err}"
        ) from err


def _as_int(reader: gguf.GGUFReader, key: str, default: Any = _MISSING) -> int:
    value = read_field(reader, key, default)
    if isinstance(value, (bool, str, list)) or value is None:
        raise ModelFileError(
            f"{reader.data.filename}: metadata {key!r}={value!r} is not an integer"
        )
    return int(value)


def _as_float(reader: gguf.GGUFReader, key: str, default: Any = _MISSING) -> float:
    value = read_field(reader, key, default)
    if isinstance(value, (bool, str, list)) or value is None:
        raise ModelFileError(f"{reader.data.filename}: metadata {key!r}={value!r} is not a number")
    # Stored as float32: the shortest decimal that round-trips the float32 is the intended
    # value (1e-5, not 9.99999974e-06), so configs compare equal to hand-written presets.
    return float(str(np.float32(value)))


def config_from_reader(reader: gguf.GGUFReader) -> LlamaConfig:
    """Build the :class:`LlamaConfig` from a GGUF's ``llama.*`` and ``tokenizer.ggml.*`` keys."""
    path = reader.data.filename
    arch = read_field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelFileError(
            f"{path}: architecture {arch!r} is not supported "
            f"(expected one of {SUPPORTED_ARCHITECTURES})"
        )
    hidden = _as_int(reader, f"{arch}.embedding_length")
    heads = _as_int(reader, f"{arch}.attention.head_count")
    if heads < 1 or hidden % heads:
        raise ModelFileError(
            f"{path}: embedding_length={hidden} is not a multiple of head_count={heads}"
        )
    head_dim = _as_int(reader, f"{arch}.attention.key_length", hidden // heads)
    rope_dims = _as_int(reader, f"{arch}.rope.dimension_count", head_dim)
    if rope_dims != head_dim:
        raise ModelFileError(
            f"{path}: partial rotary embedding (rope.dimension_count="
            f"{rope_dims}, head_dim={head_dim}) is not supported"
        )
    if head_dim % 2:
        raise ModelFileError(f"{path}: head_dim={head_dim} must be even for rotary embedding")
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    # The token list length is the vocabulary; ``data`` indexes its items, so no decoding needed.
    vocab = len(tokens.data) if tokens is not None else _as_int(reader, f"{arch}.vocab_size")
    declared_vocab = _as_int(reader, f"{arch}.vocab_size", vocab)
    if declared_vocab != vocab:
        raise ModelFileError(
            f"{path}: {arch}.vocab_size={declared_vocab} but the token list has {vocab} entries"
        )
    try:
        return LlamaConfig(
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=_as_int(reader, f"{arch}.feed_forward_length"),
            num_layers=_as_int(reader, f"{arch}.block_count"),
            num_heads=heads,
            num_kv_heads=_as_int(reader, f"{arch}.attention.head_count_kv", heads),
            head_dim=head_dim,
            rope_theta=_as_float(reader, f"{arch}.rope.freq_base", 10000.0),
            rms_norm_eps=_as_float(reader, f"{arch}.attention.layer_norm_rms_epsilon"),
            max_position=_as_int(reader, f"{arch}.context_length"),
            tie_embeddings="output.weight" not in {t.name for t in reader.tensors},
            bos_id=_as_int(reader, "tokenizer.ggml.bos_token_id"),
            eos_id=_as_int(reader, "tokenizer.ggml.eos_token_id"),
        )
    except ValueError as err:
        if isinstance(err, ModelFileError):
            raise
        raise ModelFileError(f"{path}: inconsistent hyper-parameters: {err}") from err


# ----------------------------------------------------------------------------- tensors


def expected_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Flat parameter name (``"layers.wq"``) -> shape in our layout (see :class:`LlamaConfig`)."""
    return {name.replace("/", "."): shape for name, shape in config.param_shapes().items()}


def check_flat_params(config: LlamaConfig, flat: Mapping[str, np.ndarray], source: Any) -> None:
    """Raise :class:`ModelFileError` unless ``flat`` has exactly the names and shapes expected."""
    want = expected_shapes(config)
    missing = sorted(set(want) - set(flat))
    extra = sorted(set(flat) - set(want))
    if missing or extra:
        raise ModelFileError(
            f"{source}: parameters do not match the config (missing {missing}, unexpected {extra})"
        )
    for name, shape in want.items():
        if tuple(flat[name].shape) != shape:
            raise ModelFileError(
                f"{source}: parameter {name!r} has shape "
                f"{tuple(flat[name].shape)}, expected {shape}"
            )


def _target_of(name: str, num_layers: int, path: Any) -> tuple[str, int | None]:
    """Map a GGUF tensor name to (flat parameter name, layer index or None)."""
    if name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[name], None
    match = _LAYER_NAME.fullmatch(name)
    if match is None or match.group(2) not in _LAYER_TENSORS:
        raise ModelFileError(f"{path}: unknown tensor {name!r} (not a Llama tensor)")
    layer = int(match.group(1))
    if layer >= num_layers:
        raise ModelFileError(
            f"{path}: tensor {name!r} names layer {layer}, but block_count is {num_layers}"
        )
    return _LAYER_TENSORS[match.group(2)], layer


def _dequantize(tensor: Any, path: Any) -> np.ndarray:
    """One tensor as float32 numpy, in numpy (reversed GGUF) shape order."""
    try:
        data = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as err:
        raise ModelFileError(
            f"{path}: tensor {tensor.name!r} has unsupported type {tensor.tensor_type.name}"
        ) from err
    except Exception as err:
        raise ModelFileError(
            f"{path}: tensor {tensor.name!r} cannot be decoded (truncated or corrupt?): {err}"
        ) from err
    data = np.asarray(data, dtype=np.float32)
    if not np.isfinite(data).all():
        raise ModelFileError(
            f"{path}: tensor {tensor.name!r} holds NaN or infinite values (corrupt file?)"
        )
    return data


def read_gguf_f32(path: str | os.PathLike) -> tuple[LlamaConfig, FlatParams]:
    """Read and dequantize a Llama GGUF into ``(config, flat float32 params)``.

    Raises:
      FileNotFoundError: ``path`` does not exist.
      ModelFileError: anything wrong with the file's content (see module docstring).
    """
    path = Path(path)
    reader = open_gguf(path)
    config = config_from_reader(reader)
    want = expected_shapes(config)
    flat: FlatParams = {name: np.empty(shape, np.float32) for name, shape in want.items()}
    seen: set[tuple[str, int | None]] = set()
    file_size = path.stat().st_size
    for tensor in reader.tensors:
        target, layer = _target_of(tensor.name, config.num_layers, path)
        if target not in want:  # only "lm_head" can be absent from the table
            raise ModelFileError(f"{path}: tensor {tensor.name!r} contradicts the config")
        if (target, layer) in seen:
            raise ModelFileError(f"{path}: duplicate tensor {tensor.name!r}")
        seen.add((target, layer))
        if tensor.data_offset + tensor.n_bytes > file_size:
            raise ModelFileError(
                f"{path}: tensor {tensor.name!r} runs past the end of the file (truncated?)"
            )
        one = want[target][1:] if layer is not None else want[target]
        stored = one[::-1] if target in _TRANSPOSED else one
        data = _dequantize(tensor, path)
        if data.shape != stored:
            raise ModelFileError(
                f"{path}: tensor {tensor.name!r} has shape {data.shape} "
                f"(numpy order), expected {stored} from the metadata"
            )
        if target == "layers.wq":
            data = interleaved_to_rotate_half(data, config.num_heads)
        elif target == "layers.wk":
            data = interleaved_to_rotate_half(data, config.num_kv_heads)
        if target in _TRANSPOSED:
            data = data.T
        if layer is None:
            flat[target][...] = data
        else:
            flat[target][layer] = data
    _check_complete(config, seen, path)
    return config, flat


def _check_complete(config: LlamaConfig, seen: set[tuple[str, int | None]], path: Any) -> None:
    missing = [
        gguf_name
        for gguf_name, target in _GLOBAL_TENSORS.items()
        if target in expected_shapes(config) and (target, None) not in seen
    ]
    for i in range(config.num_layers):
        missing += [
            f"blk.{i}.{key}.weight"
            for key, target in _LAYER_TENSORS.items()
            if (target, i) not in seen
        ]
    if missing:
        shown = ", ".join(missing[:5]) + (
            f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        )
        raise ModelFileError(f"{path}: missing tensors: {shown}")


# ----------------------------------------------------------------------------- pytree


def unflatten_params(flat: Mapping[str, np.ndarray], dtype: Any = jnp.float32) -> Params:
    """Flat float32 numpy params -> the nested ``jnp`` pytree of :class:`LlamaConfig`."""
    if not any(jnp.dtype(dtype) == jnp.dtype(ok) for ok in SUPPORTED_DTYPES):
        raise ValueError(f"dtype {dtype!r} is not supported; expected float32, bfloat16 or float16")
    params: Params = {"layers": {}}
    for name, value in flat.items():
        node = params
        *parents, leaf = name.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = jnp.asarray(value, dtype=dtype)
    return params


def load_gguf(path: str | os.PathLike, dtype: Any = jnp.float32) -> tuple[LlamaConfig, Params]:
    """Read a Llama GGUF into ``(config, params)`` without any caching.

    Args:
      path: the ``.gguf`` file.
      dtype: dtype of the returned arrays (float32, bfloat16 or float16).

    Returns:
      The config read from the metadata and the parameter pytree as ``jnp`` arrays.
    """
    config, flat = read_gguf_f32(path)
    return config, unflatten_params(flat, dtype)


def config_to_json(config: LlamaConfig) -> dict[str, Any]:
    """A JSON-able dict of the config (round trips through :func:`config_from_json`)."""
    return dataclasses.asdict(config)


def config_from_json(data: Mapping[str, Any]) -> LlamaConfig:
    """Inverse of :func:`config_to_json`."""
    return LlamaConfig(**data)
