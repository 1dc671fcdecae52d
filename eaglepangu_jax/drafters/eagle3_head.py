"""The EAGLE-3 draft head's mathematics: its config, weights and forward pieces.

Teacher features from a low, a middle and a high layer, concatenated and fused to the hidden
size; one decoder layer whose q/k/v see ``[norm(embedding), norm(feature)]``; its own final
norm; a head over a reduced draft vocabulary (``d2t`` maps draft ids to teacher ids). The
training-time test unrolls the head on its own outputs (:func:`ttt_logits`). The drafter
that runs it inside the engine is :class:`eaglepangu_jax.drafters.eagle3.Eagle3Drafter`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from eaglepangu_jax.models.config import LlamaConfig
from eaglepangu_jax.models.init import fresh_weights
from eaglepangu_jax.models.llama import grouped_attention, rms_norm
from eaglepangu_jax.models.rope import apply_rope, rope_angles

__all__ = [
    "HEAD_KEYS",
    "Eagle3Config",
    "attend",
    "check_head_config",
    "default_feature_layers",
    "draft_logits",
    "finish",
    "fuse",
    "init_head",
    "make_params",
    "project",
    "checked_temperature",
    "safe_log_softmax",
    "ttt_logits",
]

HEAD_KEYS = (
    "fc",
    "embed_norm",
    "feature_norm",
    "wq",
    "wk",
    "wv",
    "wo",
    "mlp_norm",
    "w_gate",
    "w_up",
    "w_down",
    "final_norm",
    "lm_head",
)


def default_feature_layers(num_layers: int) -> tuple[int, ...]:
    """The tapped teacher layers: low, middle and high, ``(2, L // 2, L - 3)``."""
    n = num_layers
    return tuple(sorted({min(2, n - 1), n // 2, max(n - 3, 0)}))


def check_head_config(config: Any) -> None:
    """Checks every trained head's config shares: attention grouping, draft vocabulary size
    and at least one tapped teacher layer (raises ``ValueError`` naming the problem)."""
    if config.num_heads % config.num_kv_heads:
        raise ValueError(
            f"num_heads {config.num_heads} is not a multiple of num_kv_heads {config.num_kv_heads}"
        )
    if not 1 <= config.draft_vocab_size <= config.teacher_vocab_size:
        raise ValueError(
            f"draft vocabulary {config.draft_vocab_size} must lie in [1, "
            f"{config.teacher_vocab_size}]"
        )
    if not config.feature_layers:
        raise ValueError("feature_layers must name at least one teacher layer")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Eagle3Config:
    """Static shape of an EAGLE-3 head (hashable)."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    draft_vocab_size: int
    teacher_vocab_size: int
    feature_layers: tuple[int, ...]
    rope_theta: float = 100000.0
    rms_norm_eps: float = 1e-5

    def __post_init__(self):
        check_head_config(self)

    @classmethod
    def for_teacher(
        cls,
        teacher: LlamaConfig,
        draft_vocab_size: int,
        feature_layers: tuple[int, ...] | None = None,
    ) -> "Eagle3Config":
        """A head shaped like one teacher layer; layers ``(2, L // 2, L - 3)`` by default."""
        if feature_layers is None:
            feature_layers = default_feature_layers(teacher.num_layers)
        return cls(
            hidden_size=teacher.hidden_size,
            num_heads=teacher.num_heads,
            num_kv_heads=teacher.num_kv_heads,
            head_dim=teacher.head_dim,
            intermediate_size=teacher.intermediate_size,
            draft_vocab_size=draft_vocab_size,
            teacher_vocab_size=teacher.vocab_size,
            feature_layers=tuple(feature_layers),
            rope_theta=teacher.rope_theta,
            rms_norm_eps=teacher.rms_norm_eps,
        )

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "feature_layers": list(self.feature_layers)}

    @classmethod
    def from_json(cls, data: dict) -> "Eagle3Config":
        return cls(**{**data, "feature_layers": tuple(data["feature_layers"])})

    def head_shapes(self) -> dict[str, tuple[int, ...]]:
        """Expected shape of every head weight."""
        h, f, i = self.hidden_size, len(self.feature_layers), self.intermediate_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return {
            "fc": (f * h, h),
            "embed_norm": (h,),
            "feature_norm": (h,),
            "wq": (2 * h, q),
            "wk": (2 * h, kv),
            "wv": (2 * h, kv),
            "wo": (q, h),
            "mlp_norm": (h,),
            "w_gate": (h, i),
            "w_up": (h, i),
            "w_down": (i, h),
            "final_norm": (h,),
            "lm_head": (h, self.draft_vocab_size),
        }


def init_head(
    config: Eagle3Config,
    key: Array,
    *,
    embed: Float[Array, "V H"] | None = None,
    d2t: Int[Array, " Vd"] | None = None,
    final_norm: Float[Array, " H"] | None = None,
) -> dict:
    """Random head weights (float32); ``lm_head`` / ``final_norm`` start from the teacher's
    tied embedding rows of the draft vocabulary and final norm when given (a warm start: the
    head then only has to learn to predict the next residual stream)."""
    head = fresh_weights(config.head_shapes(), key)
    if embed is not None and d2t is not None:
        head["lm_head"] = jnp.asarray(embed, jnp.float32)[jnp.asarray(d2t, jnp.int32)].T
        # Start as the teacher's "logit lens" of the highest tapped layer: fc passes that layer
        # through and the residual branches start small, so the first predictions come from
        # a meaningful residual stream at the right scale instead of a random projection.
        h = config.hidden_size
        head["fc"] = head["fc"].at[-h:].add(jnp.eye(h, dtype=jnp.float32))
        head["wo"] = jnp.float32(0.1) * head["wo"]
        head["w_down"] = jnp.float32(0.1) * head["w_down"]
    if final_norm is not None:
        head["final_norm"] = jnp.asarray(final_norm, jnp.float32)
    return head


def make_params(head: dict, embed: Float[Array, "V H"], d2t: Int[Array, " Vd"]) -> dict:
    """The drafter's parameter pytree: trained head, frozen teacher embedding, draft map."""
    return {"head": head, "embed": embed, "d2t": jnp.asarray(d2t, jnp.int32)}


# ----------------------------------------------------------------------------- layer pieces


def fuse(head: dict, features: Float[Array, "T F H"]) -> Float[Array, "T H"]:
    """``fc`` over the concatenated tapped features."""
    t = features.shape[0]
    return features.reshape(t, -1).astype(jnp.float32) @ head["fc"]


def project(
    head: dict,
    config: Eagle3Config,
    emb: Float[Array, "T H"],
    feat: Float[Array, "T H"],
    positions: Int[Array, " T"],
) -> tuple[Float[Array, "T Nq Dh"], Float[Array, "T Nk Dh"], Float[Array, "T Nk Dh"]]:
    """Rotated queries/keys and values of slots from ``[norm(emb), norm(feat)]``."""
    eps = config.rms_norm_eps
    x = jnp.concatenate(
        [rms_norm(emb, head["embed_norm"], eps), rms_norm(feat, head["feature_norm"], eps)], axis=-1
    )
    t, dh = x.shape[0], config.head_dim
    q = (x @ head["wq"]).reshape(t, config.num_heads, dh)
    k = (x @ head["wk"]).reshape(t, config.num_kv_heads, dh)
    v = (x @ head["wv"]).reshape(t, config.num_kv_heads, dh)
    cos, sin = rope_angles(positions, dh, config.rope_theta)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def finish(
    head: dict, config: Eagle3Config, feat: Float[Array, "T H"], attn: Float[Array, "T Nq Dh"]
) -> Float[Array, "T H"]:
    """Output projection on the feature residual, then the MLP block: the hidden ``h``."""
    h = feat.astype(jnp.float32) + attn.reshape(attn.shape[0], -1) @ head["wo"]
    x = rms_norm(h, head["mlp_norm"], config.rms_norm_eps)
    return h + (jax.nn.silu(x @ head["w_gate"]) * (x @ head["w_up"])) @ head["w_down"]


def draft_logits(head: dict, config: Eagle3Config, h: Float[Array, "T H"]) -> Float[Array, "T Vd"]:
    """Draft-vocabulary logits of hidden states (float32)."""
    return rms_norm(h, head["final_norm"], config.rms_norm_eps) @ head["lm_head"]


def _scores(
    config: Eagle3Config, q: Float[Array, "T Nq Dh"], k: Float[Array, "S Nk Dh"]
) -> Float[Array, "T Nq S"]:
    group = config.num_heads // config.num_kv_heads
    k = jnp.repeat(k, group, axis=1)
    return jnp.einsum("tnd,snd->tns", q, k) / jnp.float32(math.sqrt(config.head_dim))


def attend(
    config: Eagle3Config,
    q: Float[Array, "T Nq Dh"],
    k: Float[Array, "S Nk Dh"] | tuple[Float[Array, "_ Nk Dh"], ...],
    v: Float[Array, "S Nk Dh"] | tuple[Float[Array, "_ Nk Dh"], ...],
    mask: Bool[Array, "T S"],
) -> Float[Array, "T Nq Dh"]:
    """Masked attention; a fully masked row gives zeros, never NaN.

    The keys may come in blocks, ``k`` and ``v`` tuples (a draft tree level attends to the
    committed cache and to the tree's own rows; ``mask`` covers the blocks' columns in order),
    attended with one softmax as if joined, but never joined: copying the whole cache into
    one buffer at every level cost more than the attention itself (the teacher's
    :func:`~eaglepangu_jax.models.llama.grouped_attention`, which this is).
    """
    if q.shape[1] != config.num_heads:  # the grouping itself is checked with the config
        raise ValueError(f"queries {q.shape} do not fit the head's {config.num_heads} heads")
    if not isinstance(k, tuple):
        k, v = (k,), (v,)
    return grouped_attention(q, k, v, mask)


# ----------------------------------------------------------------------- training-time test


def ttt_logits(
    head: dict,
    config: Eagle3Config,
    embed: Float[Array, "V H"],
    features: Float[Array, "T F H"],
    tokens: Int[Array, " T"],
    steps: int,
) -> Float[Array, "K T Vd"]:
    """Draft logits of ``steps`` unrolled steps for every chain start ``s`` (one sequence).

    ``out[i, s]`` predicts ``tokens[s + i + 2]`` from the teacher features of slots ``<= s``
    and the head's own hidden states for the ``i`` later steps, fed the true tokens
    ``tokens[s + 1 .. s + i + 1]`` (training-time test). Entries past the sequence read
    padding and must be masked by the caller.
    """
    t = tokens.shape[0]
    index = jnp.arange(t, dtype=jnp.int32)
    causal = index[None, :] <= index[:, None]
    feat = fuse(head, features)
    base_k = base_v = None
    own_k, own_v, out = [], [], []
    for i in range(steps):
        nxt = jnp.concatenate([tokens[i + 1 :], jnp.zeros((i + 1,), tokens.dtype)])[:t]
        emb = embed[nxt].astype(jnp.float32)
        q, k, v = project(head, config, emb, feat, index + i)
        if i == 0:
            base_k, base_v = k, v
        else:
            own_k.append(k)
            own_v.append(v)
        group = config.num_heads // config.num_kv_heads
        s0 = _scores(config, q, base_k)  # [T, Nq, T]
        s0 = jnp.where(causal[:, None, :], s0, -jnp.inf)
        diag = [
            jnp.sum(q * jnp.repeat(kk, group, axis=1), axis=-1)
            / jnp.float32(math.sqrt(config.head_dim))
            for kk in own_k
        ]  # [T, Nq] each
        scores = jnp.concatenate([s0] + [d[:, :, None] for d in diag], axis=-1)
        p = jax.nn.softmax(scores, axis=-1)
        attn = jnp.einsum("tns,snd->tnd", p[:, :, :t], jnp.repeat(base_v, group, axis=1))
        for j, vv in enumerate(own_v):
            attn = attn + p[:, :, t + j, None] * jnp.repeat(vv, group, axis=1)
        feat = finish(head, config, feat, attn)
        out.append(draft_logits(head, config, feat))
    return jnp.stack(out)


# --------------------------------------------------------------------------------- drafter


def checked_temperature(temperature) -> Float[Array, " D"]:
    """Per-depth draft temperatures as a float32 vector, refused unless every entry is finite
    and positive (the EAGLE-3 and block drafters divide their logits by them)."""
    temperature = jnp.asarray(temperature, jnp.float32).reshape(-1)
    if temperature.shape[0] < 1:
        raise ValueError("depth_temperature needs at least one entry")
    if not bool(jnp.all(jnp.isfinite(temperature) & (temperature > 0))):
        raise ValueError(f"depth_temperature must be finite and > 0, got {temperature}")
    return temperature


def safe_log_softmax(logits: Float[Array, "... Vd"]) -> Float[Array, "... Vd"]:
    """log-softmax with NaN mapped to ``-inf`` (a NaN never outranks a real candidate)."""
    out = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return jnp.where(jnp.isnan(out), -jnp.inf, out)
