"""Rotary position embedding in the rotate-half layout.

Each head vector of width ``Dh`` is split into halves ``(x1, x2)``; dimension ``i`` of the
first half is rotated together with dimension ``i`` of the second half by the angle
``position * theta ** (-2 i / Dh)``. (llama.cpp stores Q/K rows so that *adjacent* dimensions
pair up instead; the GGUF loader permutes them into this layout.)
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

__all__ = ["rope_angles", "apply_rope"]


def rope_angles(
    positions: Int[Array, " T"], head_dim: int, theta: float
) -> tuple[Float[Array, "T Dh2"], Float[Array, "T Dh2"]]:
    """Cosine and sine tables (float32) for ``positions``; ``Dh2 = head_dim // 2``."""
    if head_dim % 2:
        raise ValueError(f"rotary embedding needs an even head_dim, got {head_dim}")
    # Same formula and precision as the common reference implementations, so that logits
    # agree to ~1e-5 at long positions (float64 frequencies would drift from them).
    exponents = jnp.arange(0, head_dim, 2, dtype=jnp.float32) / jnp.float32(head_dim)
    inv_freq = 1.0 / (jnp.float32(theta) ** exponents)
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(
    x: Float[Array, "T N Dh"], cos: Float[Array, "T Dh2"], sin: Float[Array, "T Dh2"]
) -> Float[Array, "T N Dh"]:
    """Rotate every head of ``x`` by the angles of its token's position (computed in f32)."""
    half = x.shape[-1] // 2
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., :half], xf[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    out = jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)
    return out.astype(x.dtype)
