"""The Llama-architecture teacher forward: one pure function for prefill, decode and tree
verification.

``forward(params, tokens, positions, cache, mask)`` runs ``T`` new tokens against the KV
cache. Their K/V are written at slots ``[cache.length, cache.length + T)``; ``cache.length``
is *not* advanced (the caller commits, so a rejected tree branch is rolled back by doing
nothing). Token ``t`` attends to cache slot ``s`` iff ``mask[t, s]``, which covers the
committed prefix, the new tokens themselves (causal chain, or ancestors in a tree) and
nothing else.

The mask's width ``W`` is the attention window: only slots ``[0, W)`` are read, so a caller
that knows ``length + T <= W`` passes a narrower mask (a power-of-two bucket) and pays for
``W`` slots instead of the whole cache. ``W`` is a static shape: one compilation per bucket.

Precision: matrix products run in the parameter dtype (float32, or bfloat16 for half the
memory traffic); RMSNorm, rotary embedding, attention scores and softmax run in float32;
logits are returned as float32.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from eaglepangu_jax.cache import KVCache
from eaglepangu_jax.models.config import LlamaConfig
from eaglepangu_jax.models.rope import apply_rope, rope_angles

LAYER_KEYS = ("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down")


def forward(
    params: dict,
    tokens: Int[Array, "T"],
    positions: Int[Array, "T"],
    cache: KVCache,
    mask: Bool[Array, "T W"],
    *,
    config: LlamaConfig,
    feature_layers: tuple[int, ...] = (),
) -> tuple[Float[Array, "T V"], Float[Array, "T F H"], KVCache]:
    """Run ``T`` new tokens through the decoder against ``cache``.

    Args:
        params: parameter pytree in the layout of :class:`LlamaConfig`.
        tokens: token ids of the new tokens.
        positions: their rotary positions (a tree node's position is its depth past the
            committed prefix, not its slot).
        cache: KV cache; the new K/V land at slots ``[cache.length, cache.length + T)``
            (``cache.length + T <= W`` is the caller's contract; the write is clamped into
            the buffer, never out of range).
        mask: ``mask[t, s]`` is True when token ``t`` may attend to slot ``s``;
            ``W <= S`` columns, slots ``>= W`` are ignored. A fully masked row yields a
            zero attention output (finite logits), never NaN.
        config: static model shape.
        feature_layers: static layer indices in ``[0, L)``; ``features[:, f]`` is the
            residual stream *leaving* layer ``feature_layers[f]`` (0-based, before the final
            norm), i.e. the transformers ``hidden_states[feature_layers[f] + 1]``.

    Returns:
        ``(logits [T, V] float32, features [T, F, H] in the parameter dtype, cache)`` with the
        new K/V written and ``length`` unchanged.
    """
    _check_shapes(params, tokens, positions, cache, mask, config, feature_layers)
    dtype = params["embed"].dtype
    cos, sin = rope_angles(positions, config.head_dim, config.rope_theta)
    x = params["embed"][tokens]
    k_all, v_all = cache.k, cache.v
    features = []
    # A Python loop (unrolled at trace time) rather than lax.scan: each layer's weights are a
    # static slice of the stacked arrays, which XLA reads in place; a scan's dynamic slices
    # copied every weight per step (measured ~2x slower per decode token on CPU).
    for i in range(config.num_layers):
        layer = layer_params(params, i)
        x, k_all, v_all = _decoder_layer(
            x, layer, i, k_all, v_all, cache.length, cos, sin, mask, config
        )
        if i in feature_layers:
            features.append(x)
    by_layer = dict(zip(sorted(set(feature_layers)), features))
    if feature_layers:
        feats = jnp.stack([by_layer[i] for i in feature_layers], axis=1)
    else:
        feats = jnp.zeros((tokens.shape[0], 0, config.hidden_size), dtype)
    h = rms_norm(x, params["final_norm"], config.rms_norm_eps)
    logits = _lm_head(h, params)
    return logits, feats, dataclasses.replace(cache, k=k_all, v=v_all)


def layer_params(params: dict, i: int) -> dict:
    """Layer ``i``'s weights from stacked (``[L, ...]`` leaves) or unstacked (a sequence of
    per-layer dicts) ``params["layers"]``."""
    layers = params["layers"]
    if isinstance(layers, (list, tuple)):
        return layers[i]
    return {name: layers[name][i] for name in LAYER_KEYS}


def rms_norm(x: Float[Array, "T H"], weight: Float[Array, "H"], eps: float) -> Float[Array, "T H"]:
    """RMSNorm computed in float32, scaled by ``weight`` after casting back."""
    xf = x.astype(jnp.float32)
    normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + jnp.float32(eps))
    return weight * normed.astype(x.dtype)


def _decoder_layer(x, layer, i, k_all, v_all, start, cos, sin, mask, config):
    """One pre-norm block: attention then SwiGLU MLP, both residual."""
    h = rms_norm(x, layer["attn_norm"], config.rms_norm_eps)
    attn, k_all, v_all = _attention(h, layer, i, k_all, v_all, start, cos, sin, mask, config)
    x = x + attn
    h = rms_norm(x, layer["mlp_norm"], config.rms_norm_eps)
    if "w_gate_up" in layer:
        gate, up = jnp.split(h @ layer["w_gate_up"], 2, axis=-1)
    else:
        gate, up = h @ layer["w_gate"], h @ layer["w_up"]
    x = x + (jax.nn.silu(gate) * up) @ layer["w_down"]
    return x, k_all, v_all


def _attention(h, layer, i, k_all, v_all, start, cos, sin, mask, config):
    """GQA attention of the new tokens over cache slots ``[0, W)`` after writing their K/V."""
    t = h.shape[0]
    n_kv, dh = config.num_kv_heads, config.head_dim
    group = config.num_heads // n_kv
    window = mask.shape[1]
    if "wqkv" in layer:
        qkv = h @ layer["wqkv"]
        q, k, v = jnp.split(qkv, [config.q_width, config.q_width + config.kv_width], axis=-1)
    else:
        q, k, v = h @ layer["wq"], h @ layer["wk"], h @ layer["wv"]
    q = apply_rope(q.reshape(t, config.num_heads, dh), cos, sin)
    k = apply_rope(k.reshape(t, n_kv, dh), cos, sin)
    v = v.reshape(t, n_kv, dh)
    zero = jnp.zeros((), jnp.int32)
    layer_idx = jnp.int32(i)
    k_all = jax.lax.dynamic_update_slice(k_all, k[None].astype(k_all.dtype),
                                         (layer_idx, start, zero, zero))
    v_all = jax.lax.dynamic_update_slice(v_all, v[None].astype(v_all.dtype),
                                         (layer_idx, start, zero, zero))
    keys = k_all[i, :window]  # [W, K, Dh]
    values = v_all[i, :window]
    # Query head j uses kv head j // group (kv heads repeated consecutively).
    qg = q.reshape(t, n_kv, group, dh)
    scores = jnp.einsum("tkgd,wkd->kgtw", qg, keys.astype(q.dtype),
                        preferred_element_type=jnp.float32) * jnp.float32(dh ** -0.5)
    probs = _masked_softmax(scores, mask)
    out = jnp.einsum("kgtw,wkd->tkgd", probs.astype(q.dtype), values.astype(q.dtype))
    return out.reshape(t, config.q_width) @ layer["wo"], k_all, v_all


def _masked_softmax(scores: Float[Array, "K G T W"], mask: Bool[Array, "T W"]):
    """Softmax over allowed slots; rows with no allowed slot give all-zero weights."""
    # A finite fill (not -inf) keeps max-subtraction finite on a fully masked row; the final
    # multiply by the mask then zeroes that row instead of spreading uniform weight.
    filled = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    filled = filled - jnp.max(filled, axis=-1, keepdims=True)
    weights = jnp.exp(filled) * mask.astype(jnp.float32)
    total = jnp.sum(weights, axis=-1, keepdims=True)
    return weights / jnp.maximum(total, jnp.float32(1e-30))


def _lm_head(h: Float[Array, "T H"], params: dict) -> Float[Array, "T V"]:
    if "lm_head" in params:
        logits = h @ params["lm_head"]
    else:
        # Contract against the embedding's hidden axis directly: no transposed copy of the
        # [V, H] matrix is materialised.
        logits = jax.lax.dot_general(h, params["embed"], (((1,), (1,)), ((), ())))
    return logits.astype(jnp.float32)


def _check_shapes(params, tokens, positions, cache, mask, config, feature_layers):
    """Trace-time shape checks with messages naming the offending argument."""
    t = tokens.shape[0]
    if tokens.ndim != 1 or positions.shape != (t,):
        raise ValueError(f"tokens and positions must be [T]; got {tokens.shape} and "
                         f"{positions.shape}")
    expected_cache = (config.num_layers, cache.k.shape[1], config.num_kv_heads, config.head_dim)
    if cache.k.shape != expected_cache or cache.v.shape != expected_cache:
        raise ValueError(f"cache k/v must be [L, S, K, Dh] = {expected_cache}; got "
                         f"{cache.k.shape} and {cache.v.shape}")
    if mask.ndim != 2 or mask.shape[0] != t or not 1 <= mask.shape[1] <= cache.num_slots:
        raise ValueError(f"mask must be [T={t}, W] with 1 <= W <= S={cache.num_slots}; got "
                         f"{mask.shape}")
    if mask.dtype != jnp.bool_:
        raise ValueError(f"mask must be boolean, got {mask.dtype}")
    if params["embed"].shape != (config.vocab_size, config.hidden_size):
        raise ValueError(f"embed must be [V, H] = {(config.vocab_size, config.hidden_size)}; "
                         f"got {params['embed'].shape}")
    bad = [i for i in feature_layers if not 0 <= i < config.num_layers]
    if bad:
        raise ValueError(f"feature_layers {bad} out of range [0, {config.num_layers})")
