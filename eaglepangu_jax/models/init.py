"""Random weights: Llama parameters in the documented layout (tests and benchmarks), and the
starting point every trainable draft head shares."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from eaglepangu_jax.models.config import LlamaConfig

__all__ = ["random_params", "fresh_weights"]


def random_params(config: LlamaConfig, key: jax.Array, dtype=jnp.float32) -> dict:
    """Random parameters in the layout of :class:`LlamaConfig`'s docstring.

    Matrices are drawn with standard deviation ``1/sqrt(fan_in)`` so activations keep unit
    scale through the layers (logits are neither flat nor saturated); norm weights are drawn
    around 1 so that a wrong norm is not hidden by all-ones weights.

    Args:
        config: model shape. ``lm_head`` is present only when ``tie_embeddings`` is False.
        key: PRNG key.
        dtype: dtype of every leaf.

    Returns:
        The parameter pytree.
    """
    c = config
    h = c.hidden_size
    shapes = c.layer_shapes()
    keys = jax.random.split(key, len(shapes) + 3)
    layers = {}
    for k, (name, shape) in zip(keys, shapes.items()):
        if name.endswith("norm"):
            layers[name] = _norm_weight(k, shape, dtype)
        else:
            layers[name] = _matrix(k, shape, dtype)
    params = {
        "embed": jax.random.normal(keys[-3], (c.vocab_size, h), jnp.float32).astype(dtype),
        "layers": layers,
        "final_norm": _norm_weight(keys[-2], (h,), dtype),
    }
    if not c.tie_embeddings:
        params["lm_head"] = _matrix(keys[-1], (h, c.vocab_size), dtype)
    return params


def fresh_weights(shapes: dict[str, tuple[int, ...]], key: jax.Array) -> dict:
    """Float32 starting weights for a head described by ``{name: shape}``.

    Norm weights (names ending in ``norm``) start at one, other vectors ``N(0, 1)``, matrices
    ``N(0, 1/fan_in)`` with ``fan_in = shape[-2]`` (stacked per-layer matrices included) so
    activations keep unit scale. Each name gets its own key, split in the order of ``shapes``:
    the same seed gives the same head.
    """
    keys = dict(zip(shapes, jax.random.split(key, len(shapes))))
    weights = {}
    for name, shape in shapes.items():
        if name.endswith("norm"):
            weights[name] = jnp.ones(shape, jnp.float32)
        elif len(shape) == 1:
            weights[name] = jax.random.normal(keys[name], shape, jnp.float32)
        else:
            weights[name] = _matrix(keys[name], shape, jnp.float32)
    return weights


def _matrix(key: jax.Array, shape: tuple[int, ...], dtype) -> jax.Array:
    fan_in = shape[-2]
    w = jax.random.normal(key, shape, jnp.float32) * (fan_in**-0.5)
    return w.astype(dtype)


def _norm_weight(key: jax.Array, shape: tuple[int, ...], dtype) -> jax.Array:
    w = 1.0 + 0.1 * jax.random.normal(key, shape, jnp.float32)
    return w.astype(dtype)
