"""Model configuration for Llama-architecture teachers (SmolLM2 is one)."""

from __future__ import annotations

import dataclasses

__all__ = ["LlamaConfig"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class LlamaConfig:
    """Static hyper-parameters of a Llama-style decoder (hashable: usable as a jit static arg).

    Parameter pytree layout produced by the loaders and consumed by every forward
    (layers stacked on a leading ``L`` axis; matrices stored input-major so ``x @ w``):

    ``{"embed": [V, H],
       "layers": {"attn_norm": [L, H], "wq": [L, H, Nq*Dh], "wk": [L, H, K*Dh],
                  "wv": [L, H, K*Dh], "wo": [L, Nq*Dh, H], "mlp_norm": [L, H],
                  "w_gate": [L, H, F], "w_up": [L, H, F], "w_down": [L, F, H]},
       "final_norm": [H],
       "lm_head": [H, V]}``  (``lm_head`` absent when embeddings are tied)

    Q/K projections are in the rotate-half rope layout (the GGUF loader undoes llama.cpp's
    interleaved row order).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position: int = 2048
    tie_embeddings: bool = True
    bos_id: int = 1
    eos_id: int = 2

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def q_width(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.num_kv_heads * self.head_dim

    def layer_shapes(self) -> dict[str, tuple[int, ...]]:
        """Shape of each stacked per-layer parameter (leading axis ``L``)."""
        n, h, f = self.num_layers, self.hidden_size, self.intermediate_size
        return {
            "attn_norm": (n, h),
            "wq": (n, h, self.q_width),
            "wk": (n, h, self.kv_width),
            "wv": (n, h, self.kv_width),
            "wo": (n, self.q_width, h),
            "mlp_norm": (n, h),
            "w_gate": (n, h, f),
            "w_up": (n, h, f),
            "w_down": (n, f, h),
        }

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        """Shape of every parameter of the stacked layout, keyed ``"layers/wq"``-style."""
        shapes = {"embed": (self.vocab_size, self.hidden_size)}
        shapes.update({f"layers/{k}": v for k, v in self.layer_shapes().items()})
        shapes["final_norm"] = (self.hidden_size,)
        if not self.tie_embeddings:
            shapes["lm_head"] = (self.hidden_size, self.vocab_size)
        return shapes

    @classmethod
    def smollm2_135m(cls, **override) -> "LlamaConfig":
        """SmolLM2-135M-Instruct (REFERENCE facts; the GGUF loader reads the same from metadata)."""
        base = dict(
            vocab_size=49152,
            hidden_size=576,
            intermediate_size=1536,
            num_layers=30,
            num_heads=9,
            num_kv_heads=3,
            head_dim=64,
            rope_theta=100000.0,
            rms_norm_eps=1e-5,
            max_position=8192,
            tie_embeddings=True,
            bos_id=1,
            eos_id=2,
        )
        return cls(**{**base, **override})

    @classmethod
    def tiny(cls, **override) -> "LlamaConfig":
        """A small random-weight config of the same architecture, for fast tests."""
        base = dict(
            vocab_size=97,
            hidden_size=32,
            intermediate_size=64,
            num_layers=3,
            num_heads=4,
            num_kv_heads=2,
            head_dim=8,
            rope_theta=10000.0,
            rms_norm_eps=1e-5,
            max_position=256,
            tie_embeddings=True,
            bos_id=1,
            eos_id=2,
        )
        return cls(**{**base, **override})
