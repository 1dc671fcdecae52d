"""What a program needs at run time: the real teacher, its chat renderer, the compile cache.

This sits above the library's layers and below the command line, so that the commands, the
notebooks and user scripts load the model the same way.
"""

from __future__ import annotations

from pathlib import Path

from eaglepangu_jax.engine.decode import Teacher
from eaglepangu_jax.models import llama, weights_cache
from eaglepangu_jax.models.chat import ChatRenderer
from eaglepangu_jax.models.smollm2 import load_smollm2
from eaglepangu_jax.models.tokenizer import load_tokenizer

__all__ = ["load_teacher", "load_renderer", "enable_compile_cache"]


def load_teacher() -> Teacher:
    """The real teacher (SmolLM2-135M-Instruct, float32, weights laid out per layer, with
    the ``[out, in]`` copies that verify trees read)."""
    config, params = load_smollm2()
    # Prepared from the stacked layout, the tied head's [out, in] copy is the embedding.
    return Teacher(config, llama.prepare_params(params, transposed_copy=True))


def load_renderer() -> ChatRenderer:
    """The teacher's chat template and tokenizer."""
    return ChatRenderer(load_tokenizer())


def enable_compile_cache(path: str | None) -> None:
    """Turn on JAX's persistent compilation cache in ``path`` (default folder if ``None``;
    off if empty). Compiling the decode loop takes tens of seconds per shape on a small CPU;
    with the cache a second run of the same command reads the programs back."""
    if path == "":
        return
    import jax

    folder = Path(path) if path is not None else weights_cache.resolve_cache_dir() / "xla"
    folder.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(folder))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
