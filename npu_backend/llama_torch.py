"""The Llama teacher forward in torch, on the JAX model's parameter pytree.

Same contract as :func:`eaglepangu_jax.models.llama.forward`: ``T`` new tokens run against an
explicit :class:`~npu_backend.kv_cache.TorchKVCache`; their K/V land at
``[length, length + T)`` and ``length`` is not advanced; token ``t`` attends slot ``s`` iff
``mask[t, s]`` (True = may attend, ``W <= S`` columns, only slots ``[0, W)`` are read);
``features[:, f]`` is the residual stream leaving layer ``feature_layers[f]``.

Same precision too: matrix products in the parameter dtype, RMSNorm and rotary embedding in
float32, logits returned as float32. Attention goes through
:func:`npu_backend.attention.tree_attention` with the chosen implementation.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch

from eaglepangu_jax.models import llama
from eaglepangu_jax.models.config import LlamaConfig
from npu_backend import bridge
from npu_backend.attention import IMPLS, Impl, choose_impl, tree_attention
from npu_backend.device import torch_device
from npu_backend.kv_cache import TorchKVCache

# attend(layer, q [..., T, Nq, Dh], k [..., T, K, Dh], v [..., T, K, Dh]) -> [..., T, Nq, Dh]
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def param_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Expected shape of every parameter, keyed ``"layers/wq"``-style (the pytree layout)."""
    return config.param_shapes()


@dataclasses.dataclass(frozen=True)
class _PerLayer:
    """One weight of the prepared layout (a leaf per layer), stacked when converted."""

    leaves: tuple

    @property
    def shape(self) -> tuple:
        if any(leaf is None for leaf in self.leaves):
            return ("missing in some layers",)
        shapes = {tuple(leaf.shape) for leaf in self.leaves}
        return (len(self.leaves), *shapes.pop()) if len(shapes) == 1 else ("ragged",)


def _flatten(params: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"layers/wq": leaf, ...}``; a tuple of per-layer dicts (the JAX model's prepared
    layout) becomes one :class:`_PerLayer` per weight name."""
    flat = {}
    for name, value in params.items():
        if isinstance(value, Mapping):
            flat.update(_flatten(value, f"{prefix}{name}/"))
        elif isinstance(value, (list, tuple)):
            keys = sorted(set().union(*(layer.keys() for layer in value)))
            for key in keys:
                flat[f"{prefix}{name}/{key}"] = _PerLayer(tuple(layer.get(key) for layer in value))
        else:
            flat[f"{prefix}{name}"] = value
    return flat


def _as_tensor(value: Any, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """numpy / JAX / torch leaf (or a :class:`_PerLayer`) -> tensor on ``device`` in ``dtype``."""
    if isinstance(value, _PerLayer):
        return torch.stack([_as_tensor(leaf, device, dtype) for leaf in value.leaves])
    if isinstance(value, torch.Tensor):
        tensor = value.detach()
    elif isinstance(value, np.ndarray):
        tensor = torch.from_numpy(np.array(value))  # a writable copy: torch wants one
    else:
        tensor = bridge.to_torch(value)  # a jax.Array; anything else is refused there
    return tensor.to(device=device, dtype=dtype)


def convert_params(
    params: Mapping[str, Any],
    config: LlamaConfig,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> dict[str, torch.Tensor]:
    """Check the pytree against :func:`param_shapes` and convert every leaf to torch.

    Accepts the loaders' stacked layout and the JAX model's prepared layout (a tuple of
    per-layer dicts, re-stacked here; its ``lm_head`` is used even for tied embeddings, and
    its optional ``[out, in]`` copies are left out).

    Raises:
        ValueError: naming missing, unexpected or mis-shaped parameters.
    """
    # The JAX model's optional [out, in] weight copies are a CPU layout choice, not weights.
    flat = _flatten(llama.without_transposed_copy(dict(params)))
    expected = param_shapes(config)
    if config.tie_embeddings and "lm_head" in flat:
        expected["lm_head"] = (config.hidden_size, config.vocab_size)
    missing = sorted(set(expected) - set(flat))
    unexpected = sorted(set(flat) - set(expected))
    if missing or unexpected:
        raise ValueError(
            f"parameter names do not match the config: missing {missing}, unexpected {unexpected}"
        )
    wrong = {
        name: tuple(flat[name].shape)
        for name, shape in expected.items()
        if tuple(flat[name].shape) != shape
    }
    if wrong:
        raise ValueError(
            f"parameter shapes {wrong} differ from the config's "
            f"{ {name: expected[name] for name in wrong} }"
        )
    device = torch_device(device)
    return {name: _as_tensor(value, device, dtype) for name, value in flat.items()}


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in float32, scaled by ``weight`` after casting back (as the JAX model)."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.square().mean(dim=-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def rope_angles(positions: torch.Tensor, head_dim: int, theta: float):
    """Float32 cosine and sine tables ``[..., T, Dh/2]`` for positions ``[..., T]`` (the JAX
    model's formula)."""
    exponents = (
        torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device) / head_dim
    )
    inv_freq = 1.0 / torch.tensor(theta, dtype=torch.float32, device=positions.device) ** exponents
    angles = positions.float()[..., None] * inv_freq
    return torch.cos(angles), torch.sin(angles)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary embedding of ``x [..., T, N, Dh]`` in float32."""
    half = x.shape[-1] // 2
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    c, s = cos[..., None, :], sin[..., None, :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)


class TorchLlama:
    """A Llama decoder in torch with the JAX model's architecture, layout and precision rules.

    Args:
        config: model shape.
        params: the JAX parameter pytree (numpy, JAX or torch leaves). CPU JAX leaves already
            in ``dtype`` are shared with the model (DLPack), not copied; the model never
            writes to its parameters.
        device: torch device string (see :func:`npu_backend.device.select_device`).
        dtype: parameter and cache dtype.
        attention_impl: ``"eager"``, ``"sdpa"`` or ``"npu_fused"``; None picks
            :func:`~npu_backend.attention.choose_impl` for ``device`` and the current mode.
    """

    def __init__(
        self,
        config: LlamaConfig,
        params: Mapping[str, Any],
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        attention_impl: Impl | None = None,
    ):
        if attention_impl is None:
            attention_impl = choose_impl(device)
        if attention_impl not in IMPLS:
            raise ValueError(f"attention_impl must be one of {IMPLS}, got {attention_impl!r}")
        self.config = config
        self.device = torch_device(device)
        self.dtype = dtype
        self.attention_impl = attention_impl
        self.params = convert_params(params, config, device=self.device, dtype=dtype)

    def new_cache(self, num_slots: int) -> TorchKVCache:
        """An empty cache matching this model."""
        c = self.config
        return TorchKVCache.empty(
            c.num_layers,
            num_slots,
            c.num_kv_heads,
            c.head_dim,
            device=self.device,
            dtype=self.dtype,
        )

    @torch.no_grad()
    def forward(
        self,
        tokens: torch.Tensor | Sequence[int],
        positions: torch.Tensor | Sequence[int],
        kv_cache: TorchKVCache,
        mask: torch.Tensor,
        feature_layers: Sequence[int] = (),
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run ``T`` new tokens; writes their K/V into ``kv_cache`` (``length`` unchanged).

        Args:
            tokens: ``[T]`` token ids.
            positions: ``[T]`` rotary positions.
            kv_cache: the cache; needs ``length + T <= W``.
            mask: bool ``[T, W]``, ``W <= S``; True = may attend.
            feature_layers: layer indices in ``[0, L)`` to tap.

        Returns:
            ``(logits [T, V] float32, features [T, F, H] in the parameter dtype)``.
        """
        tokens = torch.as_tensor(tokens, dtype=torch.long, device=self.device)
        positions = torch.as_tensor(positions, dtype=torch.long, device=self.device)
        mask = mask.to(self.device)
        self._check(tokens, positions, kv_cache, mask, feature_layers)
        width = mask.shape[1]

        def attend(i, q, k, v):
            kv_cache.write(i, k, v)
            keys = kv_cache.k[i, :width].to(q.dtype).permute(1, 0, 2)[None]  # [1, K, W, Dh]
            values = kv_cache.v[i, :width].to(q.dtype).permute(1, 0, 2)[None]
            out = tree_attention(
                q.permute(1, 0, 2)[None],
                keys,
                values,
                mask,
                impl=self.attention_impl,
                scale=self.config.head_dim**-0.5,
            )
            return out[0].permute(1, 0, 2)

        return self.run(tokens, positions, attend, feature_layers)

    @torch.no_grad()
    def run(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        attend: Attend,
        feature_layers: Sequence[int] = (),
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The decoder with the attention step supplied by the caller.

        :meth:`forward` is this with a cache-backed ``attend``; other verification layouts
        (a batch of chains, :mod:`npu_backend.branches`) supply their own. Leading axes of
        ``tokens`` are carried through every layer.

        Args:
            tokens: ``[..., T]`` token ids (long, on the model's device).
            positions: ``[..., T]`` rotary positions.
            attend: ``attend(layer, q, k, v)`` with rotated ``q [..., T, Nq, Dh]`` and the new
                tokens' ``k``, ``v [..., T, K, Dh]``; returns ``[..., T, Nq, Dh]``.
            feature_layers: layer indices to tap (checked by the caller).

        Returns:
            ``(logits [..., T, V] float32, features [..., T, F, H])``.
        """
        p, c = self.params, self.config
        cos, sin = rope_angles(positions, c.head_dim, c.rope_theta)
        x = p["embed"][tokens]
        lead = x.shape[:-1]
        tapped = {}
        for i in range(c.num_layers):
            h = rms_norm(x, p["layers/attn_norm"][i], c.rms_norm_eps)
            q = apply_rope((h @ p["layers/wq"][i]).view(*lead, c.num_heads, c.head_dim), cos, sin)
            k = apply_rope(
                (h @ p["layers/wk"][i]).view(*lead, c.num_kv_heads, c.head_dim), cos, sin
            )
            v = (h @ p["layers/wv"][i]).view(*lead, c.num_kv_heads, c.head_dim)
            x = x + attend(i, q, k, v).reshape(*lead, c.q_width) @ p["layers/wo"][i]
            h = rms_norm(x, p["layers/mlp_norm"][i], c.rms_norm_eps)
            gate = torch.nn.functional.silu(h @ p["layers/w_gate"][i])
            x = x + (gate * (h @ p["layers/w_up"][i])) @ p["layers/w_down"][i]
            if i in feature_layers:
                tapped[i] = x
        features = (
            torch.stack([tapped[i] for i in feature_layers], dim=-2)
            if feature_layers
            else x.new_zeros((*lead, 0, c.hidden_size))
        )
        h = rms_norm(x, p["final_norm"], c.rms_norm_eps)
        head = p["lm_head"] if "lm_head" in p else p["embed"].T
        return (h @ head).float(), features

    def _check(self, tokens, positions, cache, mask, feature_layers):
        c, t = self.config, tokens.shape[0]
        if tokens.dim() != 1 or tuple(positions.shape) != (t,):
            raise ValueError(
                f"tokens and positions must be [T]; got {tuple(tokens.shape)} and "
                f"{tuple(positions.shape)}"
            )
        expected = (c.num_layers, cache.num_slots, c.num_kv_heads, c.head_dim)
        if tuple(cache.k.shape) != expected:
            raise ValueError(
                f"cache k/v must be [L, S, K, Dh] = {expected}; got {tuple(cache.k.shape)}"
            )
        if (
            mask.dtype != torch.bool
            or mask.dim() != 2
            or mask.shape[0] != t
            or not 1 <= mask.shape[1] <= cache.num_slots
        ):
            raise ValueError(
                f"mask must be bool [T={t}, W] with 1 <= W <= S="
                f"{cache.num_slots}; got {mask.dtype} {tuple(mask.shape)}"
            )
        if cache.length + t > mask.shape[1]:
            raise ValueError(
                f"{t} new tokens at slot {cache.length} do not fit the mask's "
                f"window of {mask.shape[1]} slots"
            )
        bad = [i for i in feature_layers if not 0 <= i < c.num_layers]
        if bad:
            raise ValueError(f"feature_layers {bad} out of range [0, {c.num_layers})")
