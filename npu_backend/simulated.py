"""A strict stand-in for ``torch_npu`` so the Ascend code path runs, and fails loudly, on CPU.

``simulated_npu()`` puts a fake ``torch_npu`` module in ``sys.modules`` for the duration of a
``with`` block (or a pytest fixture built on it). Its ``npu_fusion_attention`` computes the
documented semantics (``atten_mask`` 1/True = masked out) and raises
:class:`AscendConstraintError` on what a device would reject or silently get wrong:

* mask dtype other than bool/uint8, uint8 values other than 0/1;
* mask shape other than BNSS, B1SS, 11SS or SS for the given layout;
* a query row with every key masked;
* a query row that attends *trailing zero keys* (an all-zero K and V tail is what key padding
  looks like: attending it means the padding was not masked, typically a mask in the wrong
  polarity);
* head dim outside 1..768, query heads not a multiple of KV heads, ``head_num`` not matching;
* key length not a multiple of the alignment;
* non-contiguous inputs, mixed dtypes, sparse modes other than 0.

``gather`` and ``index_select`` are strict index helpers: a device kernel does not wrap a
negative index the way torch on CPU does, so any negative or out-of-range index raises.
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import sys
import types
from typing import Iterator

import torch

from npu_backend.attention import KV_ALIGN

MAX_HEAD_DIM = 768
LAYOUTS = ("BNSD", "BSND", "BSH", "SBH")
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class AscendConstraintError(ValueError):
    """An input the Ascend kernel would reject, or silently mis-compute."""


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise AscendConstraintError(message)


def _to_bnsd(x: torch.Tensor, layout: str, heads: int | None) -> torch.Tensor:
    """View ``x`` in BNSD; ``heads`` splits the H axis of BSH/SBH."""
    if layout == "BNSD":
        return x
    if layout == "BSND":
        return x.transpose(1, 2)
    if layout == "SBH":
        x = x.transpose(0, 1)
    b, s, h = x.shape
    _require(heads is not None and h % heads == 0, f"hidden {h} does not split into {heads} heads")
    return x.reshape(b, s, heads, h // heads).transpose(1, 2)


def _from_bnsd(x: torch.Tensor, layout: str) -> torch.Tensor:
    if layout == "BNSD":
        return x.contiguous()
    if layout == "BSND":
        return x.transpose(1, 2).contiguous()
    b, n, s, d = x.shape
    out = x.transpose(1, 2).reshape(b, s, n * d)
    return (out.transpose(0, 1) if layout == "SBH" else out).contiguous()


class SimulatedTorchNpu(types.ModuleType):
    """The fake module; ``calls`` counts fused-attention invocations that passed the checks."""

    def __init__(self, alignment: int = KV_ALIGN):
        super().__init__("torch_npu")
        self.__spec__ = importlib.machinery.ModuleSpec("torch_npu", None)
        self.alignment = alignment
        self.calls = 0

    def npu_fusion_attention(
        self,
        query,
        key,
        value,
        head_num,
        input_layout,
        pse=None,
        padding_mask=None,
        atten_mask=None,
        scale=1.0,
        keep_prob=1.0,
        pre_tockens=2147483647,
        next_tockens=2147483647,
        inner_precise=0,
        prefix=None,
        actual_seq_qlen=None,
        actual_seq_kvlen=None,
        sparse_mode=0,
        **unused,
    ):
        """Fused attention with Ascend semantics; returns ``(out,)`` in the input layout."""
        _require(input_layout in LAYOUTS, f"layout {input_layout!r} not simulated; use {LAYOUTS}")
        _require(
            sparse_mode == 0,
            f"sparse_mode={sparse_mode}: only 0 (full mask) can hold a "
            "tree mask and is the only mode simulated",
        )
        _require(
            pse is None
            and padding_mask is None
            and prefix is None
            and actual_seq_qlen is None
            and actual_seq_kvlen is None
            and keep_prob == 1.0,
            "pse, padding_mask, prefix, actual_seq_* and dropout are not simulated",
        )
        for name, x in (("query", query), ("key", key), ("value", value)):
            _require(x.is_contiguous(), f"{name} is not contiguous")
            _require(x.dtype in _FLOAT_DTYPES, f"{name} dtype {x.dtype} not in {_FLOAT_DTYPES}")
        _require(
            query.dtype == key.dtype == value.dtype,
            f"mixed dtypes {query.dtype}, {key.dtype}, {value.dtype}",
        )
        _require(key.shape == value.shape, f"key {tuple(key.shape)} != value {tuple(value.shape)}")
        q = _to_bnsd(query, input_layout, head_num)
        kv_heads = None
        if input_layout in ("BSH", "SBH"):
            # K/V heads of a packed layout follow from the query head width.
            kv_heads = key.shape[-1] // (query.shape[-1] // head_num)
        k, v = (_to_bnsd(x, input_layout, kv_heads) for x in (key, value))
        b, nq, t, dh = q.shape
        n_kv, s = k.shape[1], k.shape[2]
        _require(nq == head_num, f"head_num={head_num} but the query has {nq} heads")
        _require(1 <= dh <= MAX_HEAD_DIM, f"head dim {dh} outside 1..{MAX_HEAD_DIM}")
        _require(k.shape[3] == dh and k.shape[0] == b, "query and key shapes disagree")
        _require(nq % n_kv == 0, f"query heads {nq} not a multiple of kv heads {n_kv}")
        _require(
            s % self.alignment == 0,
            f"key length {s} is not padded to a multiple of {self.alignment}",
        )
        masked = self._check_mask(atten_mask, b, nq, t, s)
        self._check_padding_masked(k, v, masked)
        out = _reference(q, k, v, masked, float(scale))
        self.calls += 1
        return (_from_bnsd(out, input_layout),)

    def _check_mask(self, atten_mask, b, n, t, s) -> torch.Tensor:
        """Validate ``atten_mask``; returns it as a bool ``[B|1, N|1, T, S]`` (True = masked)."""
        _require(atten_mask is not None, "atten_mask is required with sparse_mode=0 here")
        _require(
            atten_mask.dtype in (torch.bool, torch.uint8),
            f"atten_mask dtype {atten_mask.dtype}; the kernel takes bool or uint8 only",
        )
        _require(atten_mask.is_contiguous(), "atten_mask is not contiguous")
        shape = tuple(atten_mask.shape)
        allowed = {(b, n, t, s): "BNSS", (b, 1, t, s): "B1SS", (1, 1, t, s): "11SS", (t, s): "SS"}
        _require(
            shape in allowed,
            f"atten_mask shape {shape} is none of BNSS/B1SS/11SS/SS for "
            f"B={b}, N={n}, S_q={t}, S_kv={s}",
        )
        if atten_mask.dtype == torch.uint8:
            _require(
                bool(((atten_mask == 0) | (atten_mask == 1)).all()),
                "uint8 atten_mask holds values other than 0 and 1",
            )
        masked = atten_mask.bool()
        masked = masked[None, None] if masked.dim() == 2 else masked
        empty = masked.all(dim=-1)
        if bool(empty.any()):
            row = tuple(int(i) for i in empty.nonzero()[0])
            raise AscendConstraintError(
                f"query row {row[-1]} (batch/head {row[:2]}) has every key masked; the fused "
                "kernel does not support empty rows. atten_mask uses 1 = masked out: was a "
                "True = attend (SDPA) mask passed unchanged?"
            )
        return masked

    def _check_padding_masked(self, k, v, masked) -> None:
        """Raise when a query attends the all-zero key tail (unmasked key padding)."""
        nonzero = (k != 0).any(dim=3).any(dim=1) | (v != 0).any(dim=3).any(dim=1)  # [B, S]
        positions = torch.arange(k.shape[2], device=k.device)
        last = torch.where(nonzero, positions, -1).amax(dim=-1)  # last real key per batch
        tail = positions[None, :] > last[:, None]  # [B, S]
        if bool((~masked & tail[:, None, None, :]).any()):
            raise AscendConstraintError(
                "a query attends key positions in the all-zero padded tail: padding must be "
                "masked (1), and atten_mask uses 1 = masked out (the opposite of SDPA)"
            )


def _reference(q, k, v, masked, scale):
    """Ascend semantics in float32 (rows are known to be non-empty)."""
    group = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    scores = torch.matmul(q.float(), k.transpose(-1, -2)) * scale
    probs = torch.softmax(scores.masked_fill(masked, float("-inf")), dim=-1)
    return torch.matmul(probs, v).to(q.dtype)


@contextlib.contextmanager
def simulated_npu(alignment: int = KV_ALIGN) -> Iterator[SimulatedTorchNpu]:
    """Install a :class:`SimulatedTorchNpu` as ``torch_npu`` for the block, then restore."""
    previous = sys.modules.get("torch_npu")
    fake = SimulatedTorchNpu(alignment)
    sys.modules["torch_npu"] = fake
    try:
        yield fake
    finally:
        if previous is None:
            sys.modules.pop("torch_npu", None)
        else:
            sys.modules["torch_npu"] = previous


def _check_index(x: torch.Tensor, index: torch.Tensor, dim: int) -> None:
    if index.dtype not in (torch.int32, torch.int64):
        raise AscendConstraintError(f"index dtype {index.dtype}; integer indices only")
    size = x.shape[dim]
    if index.numel() and bool(((index < 0) | (index >= size)).any()):
        bad = index[(index < 0) | (index >= size)].flatten()[:5].tolist()
        raise AscendConstraintError(
            f"indices {bad} outside [0, {size}) on dim {dim}: device kernels do not wrap "
            "negative indices; sanitise sentinels before gathering"
        )


def gather(x: torch.Tensor, index: torch.Tensor, dim: int) -> torch.Tensor:
    """``torch.gather`` that raises on any negative or out-of-range index."""
    _check_index(x, index, dim)
    return torch.gather(x, dim, index.long())


def index_select(x: torch.Tensor, index: torch.Tensor, dim: int) -> torch.Tensor:
    """``torch.index_select`` (1-D ``index``) that raises on any negative or out-of-range index."""
    _check_index(x, index, dim)
    return torch.index_select(x, dim, index.long())
