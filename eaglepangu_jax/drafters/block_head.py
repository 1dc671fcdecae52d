"""The block drafter's config and weights: :class:`BlockConfig`, the weight names and their
initialisation (the drafter that runs them is :mod:`eaglepangu_jax.drafters.block`)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from eaglepangu_jax.drafters.eagle3_head import check_head_config, default_feature_layers
from eaglepangu_jax.models.config import LlamaConfig
from eaglepangu_jax.models.init import fresh_weights

__all__ = ["LAYER_KEYS", "BlockConfig", "init_head"]


LAYER_KEYS = (
    "attn_norm",
    "wq",
    "wk",
    "wv",
    "ctx_wk",
    "ctx_wv",
    "wo",
    "mlp_norm",
    "w_gate",
    "w_up",
    "w_down",
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class BlockConfig:
    """Static shape of a block drafter (hashable); per-layer weights are stacked on axis 0."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    draft_vocab_size: int
    teacher_vocab_size: int
    feature_layers: tuple[int, ...]
    block_size: int = 8
    rope_theta: float = 100000.0
    rms_norm_eps: float = 1e-5

    def __post_init__(self):
        for field in (
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "intermediate_size",
            "block_size",
        ):
            if getattr(self, field) < 1:
                raise ValueError(f"{field} must be >= 1, got {getattr(self, field)}")
        check_head_config(self)

    @classmethod
    def for_teacher(
        cls,
        teacher: LlamaConfig,
        draft_vocab_size: int,
        *,
        block_size: int = 8,
        num_layers: int = 2,
        feature_layers: tuple[int, ...] | None = None,
    ) -> "BlockConfig":
        """Layers shaped like the teacher's, tapping the same layers as an EAGLE-3 head (so
        both train on the same cached data)."""
        if feature_layers is None:
            feature_layers = default_feature_layers(teacher.num_layers)
        return cls(
            hidden_size=teacher.hidden_size,
            num_layers=num_layers,
            num_heads=teacher.num_heads,
            num_kv_heads=teacher.num_kv_heads,
            head_dim=teacher.head_dim,
            intermediate_size=teacher.intermediate_size,
            draft_vocab_size=draft_vocab_size,
            teacher_vocab_size=teacher.vocab_size,
            feature_layers=tuple(feature_layers),
            block_size=block_size,
            rope_theta=teacher.rope_theta,
            rms_norm_eps=teacher.rms_norm_eps,
        )

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "feature_layers": list(self.feature_layers)}

    @classmethod
    def from_json(cls, data: dict) -> "BlockConfig":
        return cls(**{**data, "feature_layers": tuple(data["feature_layers"])})

    def head_shapes(self) -> dict[str, tuple[int, ...]]:
        """Expected shape of every weight (per-layer ones lead with ``num_layers``)."""
        h, f, i, n = (
            self.hidden_size,
            len(self.feature_layers),
            self.intermediate_size,
            self.num_layers,
        )
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        layer = {
            "attn_norm": (h,),
            "wq": (h, q),
            "wk": (h, kv),
            "wv": (h, kv),
            "ctx_wk": (h, kv),
            "ctx_wv": (h, kv),
            "wo": (q, h),
            "mlp_norm": (h,),
            "w_gate": (h, i),
            "w_up": (h, i),
            "w_down": (i, h),
        }
        return {
            "feature_norm": (f, h),
            "fc": (f * h, h),
            "ctx_norm": (h,),
            "mask_embed": (h,),
            "w_last": (h, h),
            **{k: (n,) + shape for k, shape in layer.items()},
            "final_norm": (h,),
            "lm_head": (h, self.draft_vocab_size),
        }


def init_head(
    config: BlockConfig,
    key: Array,
    *,
    embed: Float[Array, "V H"] | None = None,
    d2t: Int[Array, " Vd"] | None = None,
    final_norm: Float[Array, " H"] | None = None,
) -> dict:
    """Random weights (float32): norms 1, matrices ``N(0, 1 / fan_in)``.

    Warm start when the teacher's pieces are given: ``lm_head`` = the teacher's (tied)
    embedding rows of the draft vocabulary, ``final_norm`` = the teacher's; ``fc`` passes the
    highest tapped layer through, and ``w_last`` is the identity and the MASK vector random,
    both at the scale of the embedding rows. So every slot starts as its own input plus the
    teacher's newest late-layer state, on equal terms.
    """
    head = fresh_weights(config.head_shapes(), key)
    if embed is not None:
        rows = jnp.asarray(embed, jnp.float32)
        scale = jnp.sqrt(jnp.mean(rows * rows))
        h = config.hidden_size
        head["fc"] = head["fc"].at[-h:].add(jnp.eye(h, dtype=jnp.float32))
        head["w_last"] = scale * jnp.eye(h, dtype=jnp.float32)
        head["mask_embed"] = scale * head["mask_embed"]
        if d2t is not None:
            head["lm_head"] = rows[jnp.asarray(d2t, jnp.int32)].T
    if final_norm is not None:
        head["final_norm"] = jnp.asarray(final_norm, jnp.float32)
    return head


# ----------------------------------------------------------------------------- the network
