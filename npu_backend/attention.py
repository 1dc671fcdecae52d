"""Tree attention in torch with three interchangeable implementations.

``tree_attention(q, k, v, mask, impl=...)`` takes the library-wide mask convention
(**True = may attend**) and hides each backend's own:

* ``"npu_fused"``: ``torch_npu.npu_fusion_attention`` in ``BNSD`` layout, ``sparse_mode=0``
  (a full mask: the only mode that can express a tree). Its mask polarity is the opposite
  (1 = masked out), so the mask is converted by :func:`ascend_mask`; the key length is
  padded to :data:`KV_ALIGN` with zero keys whose mask columns are 1. GQA is native
  (``head_num`` = query heads).
* ``"sdpa"``: ``torch.nn.functional.scaled_dot_product_attention`` (True = attend), GQA via
  ``enable_gqa``.
* ``"eager"``: softmax(Q K^T * scale, masked) V in float32, the reference.

Query head ``j`` reads KV head ``j // (Nq // K)`` in all three (KV heads repeated
consecutively, as in Llama). A query row with no allowed key returns zeros, as the JAX
forward does; the fused kernel never sees such a row (it would reject it): the row is given
one dummy key and its output is zeroed afterwards, with no host synchronisation.
"""

from __future__ import annotations

import importlib
from typing import Literal

import torch
import torch.nn.functional as F

from eaglepangu_jax import mask as mask_lib
from eaglepangu_jax import mode
from npu_backend import bridge
from npu_backend.device import DeviceUnavailableError, probe_npu

IMPLS = ("npu_fused", "sdpa", "eager")
Impl = Literal["npu_fused", "sdpa", "eager"]

# Key length multiple for the fused kernel: a uint8 mask row of KV_ALIGN positions is 32 bytes,
# the alignment recommended for Ascend fused-attention masks (padded positions are masked).
KV_ALIGN = 32


def choose_impl(device: str | torch.device) -> Impl:
    """The implementation for ``device`` under the current ``EAGLEPANGU_MODE``.

    Reference mode always takes ``"eager"`` (the debugging baseline); performance mode takes
    the fused kernel on an NPU and SDPA elsewhere.
    """
    if mode.is_reference():
        return "eager"
    # Parsed as text: torch only knows the "npu" device type once torch_npu is imported.
    return "npu_fused" if str(device).partition(":")[0] == "npu" else "sdpa"


def tree_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    *,
    impl: Impl,
    scale: float | None = None,
) -> torch.Tensor:
    """Masked multi-head attention of ``T`` queries over ``S`` keys.

    Args:
        q: queries ``[B, Nq, T, Dh]``.
        k: keys ``[B, K, S, Dh]`` with ``Nq % K == 0``.
        v: values ``[B, K, S, Dh]``.
        mask: bool ``[T, S]`` (shared by the batch) or ``[B, T, S]``; True = may attend.
        impl: one of :data:`IMPLS`.
        scale: score scale; ``Dh ** -0.5`` when None.

    Returns:
        ``[B, Nq, T, Dh]`` in ``q``'s dtype.
    """
    _check_inputs(q, k, v, mask)
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    mask4 = mask[None, None] if mask.dim() == 2 else mask[:, None]  # [B|1, 1, T, S]
    if impl == "eager":
        return _eager(q, k, v, mask4, scale)
    # Fully masked rows: attend to key 0 instead (kernels reject or NaN on an empty row) and
    # zero the result, so every backend returns what the eager reference returns.
    has_key = mask4.any(dim=-1, keepdim=True)  # [B|1, 1, T, 1]
    first_col = torch.zeros_like(mask4[..., :1, :])
    first_col[..., 0] = True
    safe = mask4 | (~has_key & first_col)
    if impl == "sdpa":
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=safe, scale=scale, enable_gqa=True)
    else:
        out = _npu_fused(q, k, v, safe, scale)
    return out * has_key.to(out.dtype)


def ascend_mask(mask: torch.Tensor, multiple: int = KV_ALIGN) -> torch.Tensor:
    """A True = attend mask in the fused kernel's form: uint8, 1 = masked out, key axis padded.

    The conversion is :func:`eaglepangu_jax.mask.pad_keys` then
    :func:`eaglepangu_jax.mask.to_ascend`, so the polarity rule lives in one place. The mask
    crosses to JAX and back (zero-copy on CPU; a small host round trip from an NPU).
    """
    converted = mask_lib.to_ascend(mask_lib.pad_keys(bridge.to_jax(mask), multiple))
    return bridge.to_torch(converted, mask.device)


def _npu_fused(q, k, v, mask4, scale):
    """``npu_fusion_attention`` with the key axis padded to :data:`KV_ALIGN`."""
    try:
        torch_npu = importlib.import_module("torch_npu")
    except ImportError as error:
        raise DeviceUnavailableError(
            f"impl='npu_fused' needs torch_npu, but {probe_npu().reason()}"
        ) from error
    pad = -k.shape[2] % KV_ALIGN
    ascend = ascend_mask(mask4, KV_ALIGN)
    if pad:
        # Zero keys and values: their columns are masked, so only the shape changes.
        k = F.pad(k, (0, 0, 0, pad))
        v = F.pad(v, (0, 0, 0, pad))
    outputs = torch_npu.npu_fusion_attention(
        q.contiguous(),
        k.contiguous(),
        v.contiguous(),
        q.shape[1],
        "BNSD",
        atten_mask=ascend.contiguous(),
        scale=scale,
        sparse_mode=0,
    )
    return outputs[0]


def _eager(q, k, v, mask4, scale):
    """The float32 reference; fully masked rows give zero weights, never NaN."""
    b, nq, t, dh = q.shape
    n_kv = k.shape[1]
    qg = q.float().reshape(b, n_kv, nq // n_kv, t, dh)
    scores = torch.einsum("bkgtd,bksd->bkgts", qg, k.float()) * scale
    allowed = mask4[:, :, None]  # [B|1, 1, 1, T, S] against [B, K, G, T, S]
    # A finite fill keeps the max subtraction finite on an empty row; multiplying by the
    # mask afterwards turns that row into zeros instead of a uniform average.
    filled = scores.masked_fill(~allowed, torch.finfo(torch.float32).min)
    weights = torch.exp(filled - filled.amax(dim=-1, keepdim=True)) * allowed
    probs = weights / weights.sum(dim=-1, keepdim=True).clamp_min(1e-30)
    out = torch.einsum("bkgts,bksd->bkgtd", probs, v.float())
    return out.reshape(b, nq, t, dh).to(q.dtype)


def _check_inputs(q, k, v, mask):
    """Shape and dtype checks with messages naming the offending argument."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"q, k, v must be 4-D BNSD; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    b, nq, t, dh = q.shape
    if k.shape != v.shape or k.shape[0] != b or k.shape[3] != dh:
        raise ValueError(
            f"k and v must be [B={b}, K, S, Dh={dh}] and equal; got "
            f"{tuple(k.shape)} and {tuple(v.shape)}"
        )
    if nq % k.shape[1]:
        raise ValueError(f"query heads {nq} are not a multiple of kv heads {k.shape[1]}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if mask.dtype != torch.bool:
        raise ValueError(f"mask must be bool (True = may attend), got {mask.dtype}")
    s = k.shape[2]
    if mask.shape not in ((t, s), (b, t, s)):
        raise ValueError(
            f"mask must be [T, S] = {(t, s)} or [B, T, S] = {(b, t, s)}; got {tuple(mask.shape)}"
        )
