"""What a program needs at run time: the real teacher, its chat renderer, the compile cache.

This sits above the library's layers and below the command line, so that the commands, the
notebooks and user scripts load the model the same way.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from eaglepangu_jax.calibration.layout import machine_layout, saved_probe
from eaglepangu_jax.engine.decode import Teacher
from eaglepangu_jax.models import llama, weights_cache
from eaglepangu_jax.models.chat import ChatRenderer
from eaglepangu_jax.models.smollm2 import load_smollm2
from eaglepangu_jax.models.tokenizer import load_tokenizer

__all__ = ["LAYOUTS", "load_teacher", "load_renderer", "enable_compile_cache"]


# How load_teacher lays out the weights: measured per machine, or fixed by the caller.
LAYOUTS = ("auto", "transposed", "in-out")


def load_teacher(*, layout: str = "auto", progress: bool = True) -> Teacher:
    """The real teacher (SmolLM2-135M-Instruct, float32, weights laid out per layer).

    Args:
      layout: ``"auto"`` keeps the ``[out, in]`` weight copies that full verify trees read
        only where they make verification faster on this machine (timed once and saved, see
        :func:`calibration.layout.machine_layout`); ``"transposed"`` always keeps them,
        ``"in-out"`` never does.
      progress: show a progress bar while the layouts are timed (first run on a machine).
    """
    if layout not in LAYOUTS:
        raise ValueError(f"unknown weight layout {layout!r}; choose one of {', '.join(LAYOUTS)}")
    config, params = load_smollm2()
    if layout == "auto":
        # Built in the saved choice; unknown, with the copies, which the probe then drops by
        # reference if they do not pay. (Made here from the stacked layout, the tied head's
        # copy is the embedding itself; added later, it would be a second [V, H] array.)
        saved = saved_probe(config, str(np.dtype(params["embed"].dtype)))
        copies = saved is None or saved.transposed_copy
    else:
        copies = layout == "transposed"
    # Prepared from the stacked layout, the tied head's [out, in] copy is the embedding.
    teacher = Teacher(
        config, llama.prepare_params(params, transposed_copy=copies), transposed_copy=copies
    )
    if layout == "auto":
        teacher, _ = machine_layout(teacher, progress=progress)
    return teacher


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
