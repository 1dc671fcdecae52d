"""The teacher forward on a tiny random model: against an independent numpy transcription of
the architecture, and the equivalences decoding relies on (cached == uncached, a tree
verified at once == its paths decoded one by one, jit == eager, no recompilation)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from eaglepangu_jax import cache as kv_cache
from eaglepangu_jax.models import llama
from eaglepangu_jax.models.config import LlamaConfig
from eaglepangu_jax.models.init import random_params
from eaglepangu_jax.models.rope import apply_rope, rope_angles

CONFIG = LlamaConfig.tiny()
SLOTS = 32


@pytest.fixture(scope="module")
def stacked():
    return random_params(CONFIG, jax.random.PRNGKey(0))


@pytest.fixture(scope="module", params=["stacked", "prepared", "transposed"])
def params(request, stacked):
    if request.param == "stacked":
        return stacked
    return llama.prepare_params(stacked, transposed_copy=request.param == "transposed")


_jit_forward = jax.jit(llama.forward, static_argnames=("config", "feature_layers"))


def _forward(params, tokens, positions, cache, mask, feature_layers=()):
    return _jit_forward(
        params,
        jnp.asarray(tokens, jnp.int32),
        jnp.asarray(positions, jnp.int32),
        cache,
        jnp.asarray(mask),
        config=CONFIG,
        feature_layers=feature_layers,
    )


def _causal(t, start=0, width=SLOTS):
    return np.arange(width)[None, :] <= (start + np.arange(t))[:, None]


def _empty_cache(slots=SLOTS, dtype=jnp.float32):
    return kv_cache.init(CONFIG.num_layers, slots, CONFIG.num_kv_heads, CONFIG.head_dim, dtype)


def _with_length(cache, length):
    return kv_cache.KVCache(k=cache.k, v=cache.v, length=jnp.int32(length))


def _numpy_forward(params, tokens):
    """Causal forward written from the architecture's definition, in float64, no cache."""
    c = CONFIG
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    t, dh, g = len(tokens), c.head_dim, c.num_heads // c.num_kv_heads

    def norm(x, w):
        return w * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + c.rms_norm_eps)

    inv = 1.0 / c.rope_theta ** (np.arange(0, dh, 2) / dh)
    ang = np.arange(t)[:, None, None] * inv[None, None, :]

    def rope(x):
        a, b = x[..., : dh // 2], x[..., dh // 2 :]
        return np.concatenate(
            [a * np.cos(ang) - b * np.sin(ang), b * np.cos(ang) + a * np.sin(ang)], axis=-1
        )

    x = p["embed"][np.asarray(tokens)]
    for i in range(c.num_layers):
        w = {k: v[i] for k, v in p["layers"].items()}
        h = norm(x, w["attn_norm"])
        q = rope((h @ w["wq"]).reshape(t, c.num_heads, dh))
        k = np.repeat(rope((h @ w["wk"]).reshape(t, c.num_kv_heads, dh)), g, axis=1)
        v = np.repeat((h @ w["wv"]).reshape(t, c.num_kv_heads, dh), g, axis=1)
        s = np.einsum("tnd,snd->nts", q, k) / np.sqrt(dh)
        s = np.where(np.tril(np.ones((t, t), bool)), s, -np.inf)
        a = np.exp(s - s.max(-1, keepdims=True))
        a /= a.sum(-1, keepdims=True)
        x = x + np.einsum("nts,snd->tnd", a, v).reshape(t, -1) @ w["wo"]
        h = norm(x, w["mlp_norm"])
        gate = h @ w["w_gate"]
        x = x + (gate / (1 + np.exp(-gate)) * (h @ w["w_up"])) @ w["w_down"]
    return norm(x, p["final_norm"]) @ p["embed"].T


def test_matches_numpy_transcription(stacked, params):
    tokens = [1, 5, 17, 33, 2, 96, 40, 8, 8]
    logits, _, _ = _forward(params, tokens, range(9), _empty_cache(), _causal(9))
    np.testing.assert_allclose(logits, _numpy_forward(stacked, tokens), atol=2e-4, rtol=1e-4)


def test_forward_sequence_is_the_causal_forward_and_ignores_what_follows(stacked, params):
    """The whole-sequence helper (teacher forcing, training, oracles) against the numpy
    transcription, and padding after a prefix leaves the prefix's rows as they were."""
    tokens = [1, 5, 17, 33, 2, 96, 40, 8, 8]
    logits, feats = llama.forward_sequence(
        params, jnp.asarray(tokens, jnp.int32), config=CONFIG, feature_layers=(0, 2)
    )
    assert logits.shape == (9, CONFIG.vocab_size)
    assert feats.shape == (9, 2, CONFIG.hidden_size)
    np.testing.assert_allclose(logits, _numpy_forward(stacked, tokens), atol=2e-4, rtol=1e-4)
    _, want, _ = _forward(params, tokens, range(9), _empty_cache(), _causal(9), (0, 2))
    np.testing.assert_allclose(feats, want, atol=1e-5, rtol=1e-5)
    padded, _ = llama.forward_sequence(
        params, jnp.asarray(tokens[:5] + [0] * 4, jnp.int32), config=CONFIG
    )
    np.testing.assert_allclose(padded[:5], logits[:5], atol=1e-5, rtol=1e-5)


def test_cached_incremental_equals_uncached(params):
    tokens = np.array([3, 14, 15, 92, 65, 35, 89, 79, 32, 38])
    full, full_feats, _ = _forward(
        params, tokens, range(10), _empty_cache(), _causal(10), feature_layers=(0, 2)
    )
    cache = _empty_cache()
    # Prefix of 4 in one forward, then single tokens, committing each time.
    steps = [(0, 4)] + [(i, i + 1) for i in range(4, 10)]
    for lo, hi in steps:
        logits, feats, cache = _forward(
            params, tokens[lo:hi], range(lo, hi), cache, _causal(hi - lo, lo), feature_layers=(0, 2)
        )
        np.testing.assert_allclose(logits, full[lo:hi], atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(feats, full_feats[lo:hi], atol=1e-5, rtol=1e-5)
        assert int(cache.length) == lo  # forward writes, never commits
        cache = _with_length(cache, hi)


@pytest.mark.parametrize("rows", [[0], [9], [4, 4, 1]])
def test_logits_of_chosen_rows_are_those_rows_of_the_full_logits(params, rows):
    """``logits_rows`` computes only the rows a caller keeps (a drafter's root): the same
    values as the full forward's rows, the features and cache untouched."""
    tokens = jnp.asarray([3, 14, 15, 92, 65, 35, 89, 79, 32, 38], jnp.int32)
    args = (tokens, jnp.arange(10), _empty_cache(), jnp.asarray(_causal(10)))
    full, feats, cache = _forward(params, *args, feature_layers=(1,))
    some, some_feats, some_cache = jax.jit(
        llama.forward, static_argnames=("config", "feature_layers")
    )(params, *args, config=CONFIG, feature_layers=(1,), logits_rows=jnp.asarray(rows))
    assert some.shape == (len(rows), CONFIG.vocab_size)
    np.testing.assert_allclose(some, np.asarray(full)[rows], atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(some_feats, feats)
    np.testing.assert_array_equal(some_cache.k, cache.k)


def test_tree_verified_at_once_equals_paths_decoded(params):
    # Committed prefix of 3, then a tree (node: parent) 0:-, 1:0, 2:0, 3:1, 4:3, 5:2.
    prefix = [7, 8, 9]
    parents = [-1, 0, 0, 1, 3, 2]
    nodes = [11, 12, 13, 14, 15, 16]
    depth = [0, 1, 1, 2, 3, 2]
    cache = _empty_cache()
    _, _, cache = _forward(params, prefix, range(3), cache, _causal(3))
    cache = _with_length(cache, 3)
    mask = np.zeros((6, SLOTS), bool)
    mask[:, :3] = True
    for j in range(6):
        a = j
        while a >= 0:
            mask[j, 3 + a] = True
            a = parents[a]
    logits, _, _ = _forward(params, nodes, [3 + d for d in depth], cache, mask)
    for j in range(6):
        path, a = [], j
        while a >= 0:
            path.insert(0, nodes[a])
            a = parents[a]
        seq = prefix + path
        # Right-padded to one shape: causal rows never see the padding after them.
        padded = seq + [0] * (8 - len(seq))
        ref, _, _ = _forward(params, padded, range(8), _empty_cache(), _causal(8))
        np.testing.assert_allclose(logits[j], ref[len(seq) - 1], atol=1e-5, rtol=1e-5)


_jit_detached = jax.jit(llama.forward_detached, static_argnames=("config", "feature_layers"))


@pytest.mark.parametrize("window", [SLOTS, 16])
def test_detached_forward_equals_writing_forward(params, window):
    # A tree over a committed prefix of 3: the detached forward (cache read only, new K/V
    # returned) must give the writing forward's logits and features, and its rows must be
    # exactly what the writing forward put at slots [3, 9).
    prefix, parents = [7, 8, 9], [-1, 0, 0, 1, 3, 2]
    nodes, depth = [11, 12, 13, 14, 15, 16], [0, 1, 1, 2, 3, 2]
    _, _, cache = _forward(params, prefix, range(3), _empty_cache(), _causal(3))
    cache = _with_length(cache, 3)
    mask = np.zeros((6, SLOTS), bool)
    mask[:, :3] = True
    self_mask = np.zeros((6, 6), bool)
    for j in range(6):
        a = j
        while a >= 0:
            mask[j, 3 + a] = self_mask[j, a] = True
            a = parents[a]
    positions = [3 + d for d in depth]
    logits, features, written = _forward(params, nodes, positions, cache, mask, (0, 1))
    d_logits, d_features, new_k, new_v = _jit_detached(
        params,
        jnp.asarray(nodes, jnp.int32),
        jnp.asarray(positions, jnp.int32),
        cache,
        jnp.asarray(mask[:, :window] & (np.arange(window) < 3)[None, :]),
        jnp.asarray(self_mask),
        config=CONFIG,
        feature_layers=(0, 1),
    )
    np.testing.assert_allclose(d_logits, logits, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(d_features, features, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(new_k, written.k[:, 3:9], atol=1e-6)
    np.testing.assert_allclose(new_v, written.v[:, 3:9], atol=1e-6)
    # The cache it was given is untouched: nothing past the prefix was written.
    np.testing.assert_array_equal(cache.k[:, 3:], 0.0)


def test_detached_forward_rejects_a_bad_self_mask(stacked):
    with pytest.raises(ValueError, match="self_mask"):
        llama.forward_detached(
            stacked,
            jnp.zeros((2,), jnp.int32),
            jnp.arange(2, dtype=jnp.int32),
            _empty_cache(),
            jnp.ones((2, SLOTS), bool),
            jnp.ones((3, 3), bool),
            config=CONFIG,
        )


def test_narrow_window_equals_full_cache(params):
    tokens = [5, 6, 7, 8, 9]
    cache = _empty_cache()
    full, _, full_cache = _forward(params, tokens, range(5), cache, _causal(5))
    narrow, _, narrow_cache = _forward(
        params, tokens, range(5), _empty_cache(), _causal(5, width=8)
    )
    np.testing.assert_allclose(narrow, full, atol=1e-6)
    np.testing.assert_array_equal(narrow_cache.k, full_cache.k)


def test_fully_masked_row_is_finite(params):
    mask = _causal(3)
    mask[1] = False
    logits, _, _ = _forward(params, [4, 5, 6], range(3), _empty_cache(), mask)
    assert np.isfinite(np.asarray(logits)).all()
    # Rows before the empty one do not see it.
    ref, _, _ = _forward(params, [4, 5, 6], range(3), _empty_cache(), _causal(3))
    np.testing.assert_allclose(logits[0], ref[0], atol=1e-6)


def test_features_follow_the_documented_convention(params, stacked):
    tokens = [1, 2, 3, 4]
    logits, feats, _ = _forward(
        params, tokens, range(4), _empty_cache(), _causal(4), feature_layers=(2, 0, 2)
    )
    assert feats.shape == (4, 3, CONFIG.hidden_size)
    np.testing.assert_array_equal(feats[:, 0], feats[:, 2])
    # The last layer's output, final-normed and projected, gives the logits.
    h = llama.rms_norm(feats[:, 0], stacked["final_norm"], CONFIG.rms_norm_eps)
    np.testing.assert_allclose(h @ stacked["embed"].T, logits, atol=1e-5, rtol=1e-5)
    # A one-layer model's output equals the first tap of the full model.
    one = LlamaConfig.tiny(num_layers=1)
    first = dict(stacked, layers=jax.tree.map(lambda a: a[:1], stacked["layers"]))
    cache1 = kv_cache.init(1, SLOTS, one.num_kv_heads, one.head_dim)
    _, feats1, _ = llama.forward(
        first,
        jnp.asarray(tokens),
        jnp.arange(4),
        cache1,
        jnp.asarray(_causal(4)),
        config=one,
        feature_layers=(0,),
    )
    np.testing.assert_allclose(feats1[:, 0], feats[:, 1], atol=1e-6)


def test_jit_equals_eager_and_does_not_recompile(params):
    calls = []

    def traced(params, tokens, positions, cache, mask):
        calls.append(1)
        return llama.forward(
            params, tokens, positions, cache, mask, config=CONFIG, feature_layers=(1,)
        )

    jitted = jax.jit(traced)
    args = (jnp.asarray([3, 4, 5]), jnp.arange(3), _empty_cache(), jnp.asarray(_causal(3)))
    eager = llama.forward(params, *args, config=CONFIG, feature_layers=(1,))
    compiled = jitted(params, *args)
    for a, b in zip(jax.tree.leaves(eager), jax.tree.leaves(compiled)):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)
    other = (
        jnp.asarray([9, 1, 2]),
        jnp.arange(3) + 4,
        _with_length(_empty_cache(), 4),
        jnp.asarray(_causal(3, 4)),
    )
    jitted(jax.tree.map(lambda a: a * 0.5, params), *other)
    assert len(calls) == 1
    assert jitted._cache_size() == 1


def test_bfloat16_params_close_to_float32(stacked):
    tokens = [1, 5, 9, 13]
    ref, _, _ = _forward(stacked, tokens, range(4), _empty_cache(), _causal(4))
    half = jax.tree.map(lambda a: a.astype(jnp.bfloat16), llama.prepare_params(stacked))
    logits, feats, cache = _forward(
        half, tokens, range(4), _empty_cache(dtype=jnp.bfloat16), _causal(4), feature_layers=(1,)
    )
    assert logits.dtype == jnp.float32 and feats.dtype == jnp.bfloat16
    assert cache.k.dtype == jnp.bfloat16
    assert np.abs(np.asarray(logits) - np.asarray(ref)).max() < 0.1 * np.abs(ref).max()


def test_prepare_params_is_idempotent_and_unties_the_head(stacked):
    prepared = llama.prepare_params(stacked)
    assert llama.prepare_params(prepared) is prepared
    assert len(prepared["layers"]) == CONFIG.num_layers
    np.testing.assert_array_equal(prepared["lm_head"], stacked["embed"].T)
    np.testing.assert_array_equal(prepared["layers"][1]["wq"], stacked["layers"]["wq"][1])


def test_transposed_copy_holds_every_product_weight_out_in(stacked):
    plain = llama.prepare_params(stacked)
    both = llama.prepare_params(stacked, transposed_copy=True)
    assert llama.has_transposed_copy(both) and not llama.has_transposed_copy(plain)
    assert llama.prepare_params(both, transposed_copy=True) is both
    for layer, copy in zip(plain["layers"], (lay[llama.TRANSPOSED] for lay in both["layers"])):
        assert sorted(copy) == sorted(llama.PRODUCTS)
        for name in llama.PRODUCTS:
            np.testing.assert_array_equal(copy[name], np.asarray(layer[name]).T)
    # Tied: the head's [out, in] copy is the embedding table itself, not a second copy.
    assert both[llama.TRANSPOSED]["lm_head"] is stacked["embed"]
    # Added to prepared parameters, the head is copied from lm_head.
    added = llama.prepare_params(plain, transposed_copy=True)
    np.testing.assert_array_equal(added[llama.TRANSPOSED]["lm_head"], stacked["embed"])
    stripped = llama.without_transposed_copy(both)
    assert jax.tree.structure(stripped) == jax.tree.structure(plain)
    assert llama.without_transposed_copy(plain) is plain


@pytest.mark.parametrize("t", [1, llama.TRANSPOSED_MIN_ROWS - 1, llama.TRANSPOSED_MIN_ROWS, 9])
def test_forwards_of_many_rows_read_the_transposed_copy(stacked, t):
    """Zeroing the copies changes exactly the forwards of at least TRANSPOSED_MIN_ROWS tokens:
    the dispatch is real, and shorter forwards (a decode step) never read the copy."""
    both = llama.prepare_params(stacked, transposed_copy=True)
    zeroed = {
        **both,
        "layers": tuple(
            {**lay, llama.TRANSPOSED: jax.tree.map(jnp.zeros_like, lay[llama.TRANSPOSED])}
            for lay in both["layers"]
        ),
        llama.TRANSPOSED: {"lm_head": jnp.zeros_like(both[llama.TRANSPOSED]["lm_head"])},
    }
    tokens, mask = list(range(1, t + 1)), _causal(t)
    a, _, _ = _forward(both, tokens, range(t), _empty_cache(), mask)
    b, _, _ = _forward(zeroed, tokens, range(t), _empty_cache(), mask)
    if t >= llama.TRANSPOSED_MIN_ROWS:
        assert np.all(np.asarray(b) == 0.0) and not np.all(np.asarray(a) == 0.0)
    else:
        np.testing.assert_array_equal(a, b)


def test_untied_lm_head_is_used():
    config = LlamaConfig.tiny(tie_embeddings=False)
    p = random_params(config, jax.random.PRNGKey(3))
    assert "lm_head" in p
    cache = kv_cache.init(config.num_layers, 8, config.num_kv_heads, config.head_dim)
    a, _, _ = llama.forward(
        p, jnp.asarray([1]), jnp.asarray([0]), cache, jnp.ones((1, 8), bool), config=config
    )
    b, _, _ = llama.forward(
        dict(p, lm_head=p["lm_head"] * 2),
        jnp.asarray([1]),
        jnp.asarray([0]),
        cache,
        jnp.ones((1, 8), bool),
        config=config,
    )
    np.testing.assert_allclose(b, 2 * a, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(mask=np.ones((3, SLOTS + 1), bool)), "mask must be"),
        (dict(mask=np.ones((2, SLOTS), bool)), "mask must be"),
        (dict(mask=np.ones((3, SLOTS), np.int32)), "boolean"),
        (dict(positions=np.arange(2)), "positions"),
        (dict(feature_layers=(CONFIG.num_layers,)), "feature_layers"),
    ],
)
def test_bad_inputs_raise(stacked, bad, match):
    args = dict(
        tokens=np.array([1, 2, 3]),
        positions=np.arange(3),
        cache=_empty_cache(),
        mask=_causal(3),
        feature_layers=(),
    )
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        _forward(stacked, **args)


def test_window_bucket():
    assert llama.window_bucket(1, 1024) == 64
    assert llama.window_bucket(65, 1024) == 128
    assert llama.window_bucket(128, 1024) == 128
    assert llama.window_bucket(600, 1000) == 1000
    with pytest.raises(ValueError, match="1001"):
        llama.window_bucket(1001, 1000)


@given(st.integers(0, 500), st.integers(0, 500), st.integers(0, 2**31 - 1))
def test_rope_scores_depend_on_relative_position(m, n, seed):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(1, 1, 8)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(1, 1, 8)), jnp.float32)

    def score(pq, pk):
        cq, sq = rope_angles(jnp.asarray([pq]), 8, 10000.0)
        ck, sk = rope_angles(jnp.asarray([pk]), 8, 10000.0)
        return float(jnp.sum(apply_rope(q, cq, sq) * apply_rope(k, ck, sk)))

    shift = 7
    assert score(m, n) == pytest.approx(score(m + shift, n + shift), abs=1e-3)
    np.testing.assert_allclose(
        jnp.linalg.norm(apply_rope(q, *rope_angles(jnp.asarray([m]), 8, 10000.0))),
        jnp.linalg.norm(q),
        rtol=1e-5,
    )
