"""The Llama-architecture teacher forward: one pure function for prefill, decode and tree
verification.

``forward(params, tokens, positions, cache, mask)`` runs ``T`` new tokens against the KV
cache. Their K/V are written at slots ``[cache.length, cache.length + T)``; ``cache.length``
is *not* advanced (the caller commits, so a rejected tree branch is rolled back by doing
nothing). Token ``t`` attends to cache slot ``s`` iff ``mask[t, s]``: the committed prefix,
the new tokens themselves (a causal chain, or a node's ancestors in a tree) and nothing else.

**Attention window.** The mask's width ``W <= S`` is the window: only slots ``[0, W)`` are
read, so a caller that knows ``length + T <= W`` passes a narrower mask (a power-of-two
bucket, see :func:`window_bucket`) and pays for ``W`` slots instead of the whole cache. ``W``
is a static shape: one compilation per bucket.

**Two parameter layouts**, same results:

* the loaders' *stacked* layout (:class:`LlamaConfig` docstring, ``[L, ...]`` leaves), run
  with ``lax.scan`` over layers: compiles fast, but XLA on CPU copies each layer's weight
  slice before its matrix product (about 2x the decode-step time of the prepared layout; an
  unrolled loop over static slices copies too and was 4x);
* the *prepared* layout of :func:`prepare_params` (a tuple of per-layer dicts, ``lm_head``
  stored ``[H, V]`` even when tied), run as a Python loop unrolled at trace time: weights
  are read in place, a decode step streams them once (near the memory-bandwidth floor);
  compiling takes ~L times longer. Use it for anything repeated.

The prepared layout may also carry each weight matrix a second time, stored ``[out, in]``
(``prepare_params(..., transposed_copy=True)``): on a CPU, XLA's product of several rows
with that layout is faster than with ``[in, out]``, while one row costs the same. A forward
of ``T >= TRANSPOSED_MIN_ROWS`` tokens (a full verify tree, a prefill) reads the copy, a
decode step the original; the logits agree to float rounding.

**A head over part of the vocabulary.** Prepared params may carry ``vocab_ids`` ``[K]`` with
``lm_head`` ``[H, K]``: the model then scores only those ``K`` tokens and every other logit is
``-inf`` (a distilled draft model's head: its cost per token is a ``K``-column product, not
the teacher's ``V``-column one).

Precision: matrix products run in the parameter dtype (float32, or bfloat16 for half the
memory traffic); RMSNorm, rotary embedding, attention scores and softmax run in float32;
logits are returned as float32.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from eaglepangu_jax import cache as cache_lib
from eaglepangu_jax import mask as mask_lib
from eaglepangu_jax.cache import KVCache
from eaglepangu_jax.models import few_row
from eaglepangu_jax.models.config import LlamaConfig
from eaglepangu_jax.models.rope import apply_rope, rope_angles

__all__ = [
    "LAYER_KEYS",
    "forward",
    "forward_detached",
    "forward_residual",
    "forward_sequence",
    "grouped_attention",
    "prepare_params",
    "is_prepared",
    "has_transposed_copy",
    "without_transposed_copy",
    "TRANSPOSED_MIN_ROWS",
    "layer_params",
    "window_bucket",
    "rms_norm",
]

LAYER_KEYS = ("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down")

# The layer weights that multiply the residual stream (the norms' scales do not).
PRODUCTS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")

# Key of the optional ``[out, in]`` weight copies (``prepare_params(transposed_copy=True)``).
TRANSPOSED = "transposed"

# From this many rows a product reads the [out, in] copy (when there is one). Measured on 2
# cores of an Intel Xeon with XLA (bench/matmul_rows.py --transposed, the teacher's shapes):
# one row costs the same in both layouts, 2-3 rows are 7-22% slower from [out, in], 5 / 9 /
# 17 rows 10-16% faster; the whole verify forward at 9 slots 13% faster
# (bench/teacher_layout.py). The engine verifies 1, 2, 4 or 9 slots for its default 8-node
# trees, so only full trees (and prefill) take the copy. On 2 cores of an AMD EPYC every row
# count from 2 up was slower from [out, in] (9 slots: 20-28%), so whether a teacher carries
# the copies at all is chosen per machine (calibration.layout).
TRANSPOSED_MIN_ROWS = 5


def forward(
    params: dict,
    tokens: Int[Array, " T"],
    positions: Int[Array, " T"],
    cache: KVCache,
    mask: Bool[Array, "T W"],
    *,
    config: LlamaConfig,
    feature_layers: tuple[int, ...] = (),
    logits_rows: Int[Array, " R"] | None = None,
) -> tuple[Float[Array, "T V"], Float[Array, "T F H"], KVCache]:
    """Run ``T`` new tokens through the decoder against ``cache``.

    Jit it with ``config`` and ``feature_layers`` static; changing only values (tokens,
    positions, mask, ``cache.length``, weights) never recompiles.

    Args:
        params: parameter pytree, stacked or prepared (module docstring).
        tokens: token ids of the new tokens.
        positions: their rotary positions (a tree node's position is the committed length
            plus its depth, not its slot).
        cache: KV cache; the new K/V land at slots ``[cache.length, cache.length + T)``.
            ``cache.length + T <= W`` is the caller's contract (the write is clamped into the
            buffer, never out of range, but a clamped write lands on the wrong slots).
        mask: ``mask[t, s]`` is True when token ``t`` may attend to slot ``s``; its
            ``W <= S`` columns set the attention window. A fully masked row gives a zero
            attention output (finite logits), never NaN.
        config: static model shape.
        feature_layers: static layer indices in ``[0, L)``; ``features[:, f]`` is the
            residual stream *leaving* layer ``feature_layers[f]`` (0-based, before the final
            norm), i.e. the transformers ``hidden_states[feature_layers[f] + 1]``.
        logits_rows: when given, only these rows' logits are computed and returned (``[R,
            V]``): a caller that keeps one row of a many-row forward skips the vocabulary
            product of the others (the largest single product of a small model).

    Returns:
        ``(logits [T, V] float32, features [T, F, H] in the parameter dtype, cache)`` with the
        new K/V written and ``length`` unchanged.
    """
    _check_tokens(params, tokens, config)
    return forward_residual(
        params,
        params["embed"][tokens],
        positions,
        cache,
        mask,
        config=config,
        feature_layers=feature_layers,
        logits_rows=logits_rows,
    )


def forward_sequence(
    params: dict,
    tokens: Int[Array, " T"],
    *,
    config: LlamaConfig,
    feature_layers: tuple[int, ...] = (),
) -> tuple[Float[Array, "T V"], Float[Array, "T F H"]]:
    """:func:`forward` over one whole sequence from an empty cache of ``T`` slots, causally
    (position ``t`` sees tokens ``0..t``): teacher forcing, training targets and features,
    and the uncached oracle tests compare the engine with. Trailing padding changes no
    earlier row. Returns ``(logits, features)`` as :func:`forward` does; jit it with
    ``config`` and ``feature_layers`` static (or inside a caller's jit)."""
    t = tokens.shape[0]
    cache = cache_lib.init(
        config.num_layers, t, config.num_kv_heads, config.head_dim, params["embed"].dtype
    )
    positions = jnp.arange(t, dtype=jnp.int32)
    mask = mask_lib.causal_mask(t, 0, t)
    logits, features, _ = forward(
        params, tokens, positions, cache, mask, config=config, feature_layers=feature_layers
    )
    return logits, features


def forward_residual(
    params: dict,
    x: Float[Array, "T H"],
    positions: Int[Array, " T"],
    cache: KVCache,
    mask: Bool[Array, "T W"],
    *,
    config: LlamaConfig,
    feature_layers: tuple[int, ...] = (),
    logits_rows: Int[Array, " R"] | None = None,
) -> tuple[Float[Array, "T V"], Float[Array, "T F H"], KVCache]:
    """:func:`forward` from a residual stream instead of token ids: ``x`` enters the first of
    ``params``'s layers (:func:`forward` is the embedding lookup followed by this). With the
    top layers of a teacher (``config.num_layers`` of them) and ``x`` the features leaving the
    layer below them, the logits are the teacher's own (what soft distillation targets are
    computed with, from cached features). ``params`` needs no ``embed`` when it has an
    ``lm_head``. Arguments and results as for :func:`forward`."""
    _check_shapes(x, positions, cache, mask, config, feature_layers)
    cos, sin = rope_angles(positions, config.head_dim, config.rope_theta)
    run = _layers_unrolled if is_prepared(params) else _layers_scanned
    x, k_all, v_all, taps = run(params, x, cache, cos, sin, mask, config, feature_layers)
    logits, features = _outputs(params, x, taps, feature_layers, config, logits_rows)
    return logits, features, dataclasses.replace(cache, k=k_all, v=v_all)


def _layers_unrolled(params, x, cache, cos, sin, mask, config, feature_layers):
    """Prepared layout: a Python loop over per-layer weights, each read in place."""
    k_all, v_all = cache.k, cache.v
    taps = {}
    for i in range(config.num_layers):
        layer = params["layers"][i]
        x, (k_all, v_all) = _decoder_layer(
            x,
            layer,
            lambda h, layer=layer, i=i, k=k_all, v=v_all: _attention(
                h, layer, jnp.int32(i), k, v, cache.length, cos, sin, mask, config
            ),
            config,
        )
        if i in feature_layers:
            taps[i] = x
    return x, k_all, v_all, taps


def _layers_scanned(params, x, cache, cos, sin, mask, config, feature_layers):
    """Stacked layout: ``lax.scan`` over the layer axis. Its per-layer weight slices are
    copies, but so are an unrolled loop's static slices of stacked arrays, and the scan
    compiles one layer instead of ``L``."""
    stacked = {name: params["layers"][name] for name in LAYER_KEYS}

    def body(carry, xs):
        x, k_all, v_all = carry
        layer, i = xs
        x, (k_all, v_all) = _decoder_layer(
            x,
            layer,
            lambda h: _attention(h, layer, i, k_all, v_all, cache.length, cos, sin, mask, config),
            config,
        )
        return (x, k_all, v_all), (x if feature_layers else None)

    layer_ids = jnp.arange(config.num_layers, dtype=jnp.int32)
    (x, k_all, v_all), outs = jax.lax.scan(body, (x, cache.k, cache.v), (stacked, layer_ids))
    taps = {i: outs[i] for i in feature_layers}
    return x, k_all, v_all, taps


def forward_detached(
    params: dict,
    tokens: Int[Array, " T"],
    positions: Int[Array, " T"],
    cache: KVCache,
    prefix_mask: Bool[Array, "T W"],
    self_mask: Bool[Array, "T T"],
    *,
    config: LlamaConfig,
    feature_layers: tuple[int, ...] = (),
) -> tuple[
    Float[Array, "T V"], Float[Array, "T F H"], Float[Array, "L T K Dh"], Float[Array, "L T K Dh"]
]:
    """:func:`forward` that reads the cache but does not write it: the new tokens' K/V are
    returned instead (``[L, T, K, Dh]`` each), for the caller to write what it keeps.

    Token ``t`` attends to cache slot ``s < W`` iff ``prefix_mask[t, s]`` and to new token
    ``u`` iff ``self_mask[t, u]`` (a causal chain, or a tree node's ancestors and itself).
    With ``prefix_mask`` = the committed slots and the new tokens at slots ``[length,
    length + T)``, the logits and features equal :func:`forward`'s.

    Why it exists: the speculative step verifies at one of several slot buckets (a
    ``lax.switch``), and a branch that writes the loop-carried cache makes XLA copy the whole
    cache in and out of the branch on every round. A branch that only reads the cache and
    returns the accepted rows leaves one small in-place write after the switch.
    """
    t = tokens.shape[0]
    if self_mask.shape != (t, t) or self_mask.dtype != jnp.bool_:
        raise ValueError(f"self_mask must be boolean [T, T] = [{t}, {t}]; got {self_mask.shape}")
    _check_tokens(params, tokens, config)
    x = params["embed"][tokens]
    _check_shapes(x, positions, cache, prefix_mask, config, feature_layers)
    cos, sin = rope_angles(positions, config.head_dim, config.rope_theta)
    window = prefix_mask.shape[1]
    mask = jnp.concatenate([prefix_mask, self_mask], axis=1)

    def attention(h, layer, cache_k, cache_v):
        q, k, v = _project_qkv(h, layer, cos, sin, config)
        # Two key blocks, the cache window and the new tokens: concatenating their K/V
        # would copy the window every layer.
        out = _attend(
            q,
            (cache_k[:window].astype(q.dtype), k),
            (cache_v[:window].astype(q.dtype), v),
            mask,
            layer,
            config,
        )
        return out, (k, v)

    if is_prepared(params):
        taps, rows_k, rows_v = {}, [], []
        for i in range(config.num_layers):
            layer = params["layers"][i]
            x, (k, v) = _decoder_layer(
                x,
                layer,
                lambda h, layer=layer, i=i: attention(h, layer, cache.k[i], cache.v[i]),
                config,
            )
            rows_k.append(k)
            rows_v.append(v)
            if i in feature_layers:
                taps[i] = x
        new_k, new_v = jnp.stack(rows_k), jnp.stack(rows_v)
    else:
        stacked = {name: params["layers"][name] for name in LAYER_KEYS}

        def body(x, xs):
            layer, cache_k, cache_v = xs
            x, (k, v) = _decoder_layer(
                x, layer, lambda h: attention(h, layer, cache_k, cache_v), config
            )
            return x, (x if feature_layers else None, k, v)

        x, (outs, new_k, new_v) = jax.lax.scan(body, x, (stacked, cache.k, cache.v))
        taps = {i: outs[i] for i in feature_layers}
    logits, features = _outputs(params, x, taps, feature_layers, config)
    return logits, features, new_k.astype(cache.k.dtype), new_v.astype(cache.v.dtype)


def prepare_params(params: dict, *, transposed_copy: bool = False) -> dict:
    """Convert stacked parameters to the prepared layout (idempotent).

    Layout: ``{"embed": [V, H], "layers": (L dicts with the stacked layout's layer keys,
    without the leading axis), "final_norm": [H], "lm_head": [H, V]}``. Copies the weights
    once; tied embeddings also get a transposed ``lm_head`` copy, because contracting the
    ``[V, H]`` table on its minor axis ran at half the bandwidth of a plain ``[H, V]``
    product.

    With ``transposed_copy`` every layer and the top level also carry ``"transposed"``: the
    same matrices stored ``[out, in]``, which forwards of at least
    :data:`TRANSPOSED_MIN_ROWS` tokens (tree verification, prefill) multiply instead (see
    :data:`TRANSPOSED_MIN_ROWS`). It costs a second copy of the layer weights; a tied
    output head's copy is the embedding table itself. Adding it to prepared parameters that
    lack it is allowed; a one-token step never reads it. The copies are made once: replace a
    weight in such a dict only after :func:`without_transposed_copy` (a copy of another shape
    is refused at trace time; one of the same shape would silently stay the old weight).
    """
    if not is_prepared(params):
        stacked = params["layers"]
        n_layers = stacked["wq"].shape[0]
        layers = tuple({name: stacked[name][i] for name in LAYER_KEYS} for i in range(n_layers))
        tied = "lm_head" not in params
        prepared = {
            "embed": params["embed"],
            "layers": layers,
            "final_norm": params["final_norm"],
            "lm_head": jnp.transpose(params["embed"]) if tied else params["lm_head"],
        }
        # The [V, H] table is the tied head's transposed copy: nothing more to store.
        head_out_in = params["embed"] if tied else None
    else:
        prepared, head_out_in = params, None
    if not transposed_copy or has_transposed_copy(prepared):
        return prepared
    if head_out_in is None:
        head_out_in = _out_in(prepared["lm_head"])
    return {
        **prepared,
        "layers": tuple(
            {
                **layer,
                TRANSPOSED: {name: _out_in(layer[name]) for name in PRODUCTS},
            }
            for layer in prepared["layers"]
        ),
        TRANSPOSED: {"lm_head": head_out_in},
    }


def has_transposed_copy(params: dict) -> bool:
    """True for prepared parameters made with ``prepare_params(..., transposed_copy=True)``."""
    return TRANSPOSED in params


def without_transposed_copy(params: dict) -> dict:
    """``params`` with the ``[out, in]`` copies of :func:`prepare_params` dropped (for code
    that reads the plain layout only, e.g. the torch adapter or sharding)."""
    if not has_transposed_copy(params):
        return params
    return {
        **{k: v for k, v in params.items() if k != TRANSPOSED},
        "layers": tuple(
            {k: v for k, v in layer.items() if k != TRANSPOSED} for layer in params["layers"]
        ),
    }


def _out_in(weight: Float[Array, "I O"]) -> Float[Array, "O I"]:
    return jnp.transpose(weight)  # a copy in XLA's row-major layout, not a view


def is_prepared(params: dict) -> bool:
    """True for the layout of :func:`prepare_params`."""
    return isinstance(params["layers"], (list, tuple))


def layer_params(params: dict, i: int) -> dict:
    """Layer ``i``'s weights (no leading ``L`` axis) from either layout, without the
    ``[out, in]`` copies."""
    layers = params["layers"]
    if isinstance(layers, (list, tuple)):
        return {k: v for k, v in layers[i].items() if k != TRANSPOSED}
    return {name: layers[name][i] for name in LAYER_KEYS}


def window_bucket(needed: int, num_slots: int, minimum: int = 64) -> int:
    """Smallest power of two ``>= needed`` (and ``>= minimum``), capped at ``num_slots``.

    The attention window for a forward whose last written slot is ``needed - 1``; buckets
    bound the number of compiled shapes to ``log2(S)``.
    """
    if needed > num_slots:
        raise ValueError(f"{needed} cache slots needed but the cache has {num_slots}")
    width = max(minimum, 1 << max(needed - 1, 0).bit_length())
    return min(width, num_slots)


def rms_norm(
    x: Float[Array, "... H"], weight: Float[Array, " H"], eps: float
) -> Float[Array, "... H"]:
    """RMSNorm over the last axis, computed in float32, scaled by ``weight`` after casting
    back (any leading shape: the teacher's ``[T, H]`` rows, a draft head's ``[..., H]``)."""
    xf = x.astype(jnp.float32)
    normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + jnp.float32(eps))
    return weight.reshape((1,) * (x.ndim - 1) + (-1,)) * normed.astype(x.dtype)


def _product(x: Float[Array, "T I"], weights: dict, name: str) -> Float[Array, "T O"]:
    """``x @ weights[name]``, from the ``[out, in]`` copy when there is one and ``T`` is at
    least :data:`TRANSPOSED_MIN_ROWS`, else on the few-row kernel where it applies
    (:mod:`~eaglepangu_jax.models.few_row`: a verify of 2-8 slots on a CPU), else XLA's
    product (``T`` is static: the choice is made at trace time)."""
    copies = weights.get(TRANSPOSED)
    if copies is not None and x.shape[0] >= TRANSPOSED_MIN_ROWS:
        copy, weight = copies[name], weights[name]
        if copy.shape != weight.shape[::-1]:
            # A weight was replaced after the copies were made (e.g. a narrower lm_head).
            raise ValueError(
                f"the [out, in] copy of {name!r} is {copy.shape}, the weight {weight.shape}: "
                "drop stale copies with llama.without_transposed_copy before replacing weights"
            )
        return jax.lax.dot_general(x, copy, (((1,), (1,)), ((), ())))
    if few_row.applies(x, weights[name]):
        return few_row.product(x, weights[name])
    return x @ weights[name]


def _decoder_layer(x, layer, attention, config):
    """One pre-norm block: attention then SwiGLU MLP, both residual. ``attention(h)`` returns
    the attention output and whatever K/V it passes back (an updated cache, or new rows)."""
    h = rms_norm(x, layer["attn_norm"], config.rms_norm_eps)
    attn, kv = attention(h)
    x = x + attn
    h = rms_norm(x, layer["mlp_norm"], config.rms_norm_eps)
    gated = jax.nn.silu(_product(h, layer, "w_gate")) * _product(h, layer, "w_up")
    return x + _product(gated, layer, "w_down"), kv


def _attention(h, layer, i, k_all, v_all, start, cos, sin, mask, config):
    """GQA attention of the new tokens over slots ``[0, W)`` after writing their K/V."""
    q, k, v = _project_qkv(h, layer, cos, sin, config)
    zero = jnp.zeros((), jnp.int32)
    at = (i, start.astype(jnp.int32), zero, zero)
    k_all = jax.lax.dynamic_update_slice(k_all, k[None].astype(k_all.dtype), at)
    v_all = jax.lax.dynamic_update_slice(v_all, v[None].astype(v_all.dtype), at)
    size = (1, mask.shape[1], config.num_kv_heads, config.head_dim)
    keys = jax.lax.dynamic_slice(k_all, (i, zero, zero, zero), size)[0].astype(q.dtype)
    values = jax.lax.dynamic_slice(v_all, (i, zero, zero, zero), size)[0].astype(q.dtype)
    return _attend(q, (keys,), (values,), mask, layer, config), (k_all, v_all)


def _project_qkv(h, layer, cos, sin, config):
    """Rotary queries ``[T, Nq, Dh]`` and keys, and values ``[T, K, Dh]``, of new tokens."""
    t, dh = h.shape[0], config.head_dim
    q = apply_rope(_product(h, layer, "wq").reshape(t, config.num_heads, dh), cos, sin)
    k = apply_rope(_product(h, layer, "wk").reshape(t, config.num_kv_heads, dh), cos, sin)
    v = _product(h, layer, "wv").reshape(t, config.num_kv_heads, dh)
    return q, k, v


def _attend(q, keys, values, mask, layer, config):
    """:func:`grouped_attention` of ``q`` over the key blocks, projected by ``wo``."""
    out = grouped_attention(q, keys, values, mask)
    return _product(out.reshape(q.shape[0], config.q_width), layer, "wo")


def grouped_attention(
    q: Float[Array, "T Nq Dh"],
    keys: Sequence[Float[Array, "_ Nk Dh"]],
    values: Sequence[Float[Array, "_ Nk Dh"]],
    mask: Bool[Array, "T S"],
) -> Float[Array, "T Nq Dh"]:
    """Masked grouped-query attention of ``q`` over one or more blocks of keys/values
    (``[W_b, Nk, Dh]`` each, e.g. a cache window then the new tokens; ``S`` their widths'
    sum), scaled by ``Dh ** -0.5``. ``mask`` covers the blocks' columns in order; a row with
    no allowed column gives zeros, never NaN. The blocks' scores are joined only for the
    softmax, so no block of K/V is ever copied into a concatenation, and query head ``n``
    reads key head ``n // (Nq / Nk)`` without the keys being repeated."""
    t, nq, dh = q.shape
    n_kv = keys[0].shape[1]
    # Query head j reads kv head j // group (each kv head serves a consecutive group).
    qg = q.reshape(t, n_kv, nq // n_kv, dh)
    scores = [jnp.einsum("tkgd,wkd->kgtw", qg, k, preferred_element_type=jnp.float32) for k in keys]
    scores = scores[0] if len(scores) == 1 else jnp.concatenate(scores, axis=-1)
    probs = _masked_softmax(scores * jnp.float32(dh**-0.5), mask).astype(q.dtype)
    out, start = 0.0, 0
    for value in values:
        width = value.shape[0]
        out = out + jnp.einsum("kgtw,wkd->tkgd", probs[..., start : start + width], value)
        start += width
    return out.reshape(t, nq, dh)


def _masked_softmax(
    scores: Float[Array, "K G T W"], mask: Bool[Array, "T W"]
) -> Float[Array, "K G T W"]:
    """Softmax over allowed slots; a row with no allowed slot gets all-zero weights."""
    # A finite fill (not -inf) keeps the max-subtraction finite on a fully masked row; the
    # multiply by the mask then zeroes that row instead of spreading uniform weight on it.
    mask = mask[None, None]
    filled = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    filled = filled - jnp.max(filled, axis=-1, keepdims=True)
    weights = jnp.exp(filled) * mask.astype(jnp.float32)
    total = jnp.sum(weights, axis=-1, keepdims=True)
    return weights / jnp.maximum(total, jnp.float32(1e-30))


def _outputs(params, x, taps, feature_layers, config, logits_rows=None):
    """Logits of the last residual stream (of ``logits_rows`` only, when given) and the
    tapped features ``[T, F, H]``."""
    if feature_layers:
        features = jnp.stack([taps[i] for i in feature_layers], axis=1)
    else:
        features = jnp.zeros((x.shape[0], 0, config.hidden_size), x.dtype)
    if logits_rows is not None:
        x = x[jnp.clip(jnp.asarray(logits_rows, jnp.int32), 0, x.shape[0] - 1)]
    logits = _lm_head(rms_norm(x, params["final_norm"], config.rms_norm_eps), params)
    if "vocab_ids" in params:
        # The head scores only these tokens: the rest can never be proposed.
        full = jnp.full((x.shape[0], config.vocab_size), -jnp.inf, jnp.float32)
        logits = full.at[:, params["vocab_ids"]].set(logits)
    return logits, features


def _lm_head(h: Float[Array, "T H"], params: dict) -> Float[Array, "T K"]:
    if "lm_head" in params:
        logits = _product(h, params, "lm_head")
    else:
        # Tied embeddings in the stacked layout: contract on the embedding's hidden axis.
        logits = jax.lax.dot_general(h, params["embed"], (((1,), (1,)), ((), ())))
    return logits.astype(jnp.float32)


def _check_tokens(params, tokens, config):
    """Trace-time checks of what only :func:`forward` takes: ids and the embedding."""
    if tokens.ndim != 1 or tokens.shape[0] < 1:
        raise ValueError(f"tokens must be [T] with T >= 1; got {tokens.shape}")
    if params["embed"].shape != (config.vocab_size, config.hidden_size):
        raise ValueError(
            f"embed must be [V, H] = {(config.vocab_size, config.hidden_size)}; "
            f"got {params['embed'].shape}"
        )


def _check_shapes(x, positions, cache, mask, config, feature_layers):
    """Trace-time shape checks whose messages name the offending argument."""
    t = x.shape[0] if x.ndim == 2 else -1
    if x.ndim != 2 or t < 1 or x.shape[1] != config.hidden_size or positions.shape != (t,):
        raise ValueError(
            f"the residual stream must be [T, H={config.hidden_size}] with T >= 1 and "
            f"positions [T]; got {x.shape} and {positions.shape}"
        )
    expected = (config.num_layers, cache.k.shape[1], config.num_kv_heads, config.head_dim)
    if cache.k.shape != expected or cache.v.shape != expected:
        raise ValueError(
            f"cache k/v must be [L, S, K, Dh] = {expected}; got {cache.k.shape} and {cache.v.shape}"
        )
    if mask.ndim != 2 or mask.shape[0] != t or not 1 <= mask.shape[1] <= cache.num_slots:
        raise ValueError(
            f"mask must be [T={t}, W] with 1 <= W <= S={cache.num_slots}; got {mask.shape}"
        )
    if mask.dtype != jnp.bool_:
        raise ValueError(f"mask must be boolean (True = may attend), got {mask.dtype}")
    bad = [i for i in feature_layers if not 0 <= i < config.num_layers]
    if bad:
        raise ValueError(f"feature_layers {bad} out of range [0, {config.num_layers})")
