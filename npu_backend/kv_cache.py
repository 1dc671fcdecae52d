"""The torch KV cache: the same slot layout as :mod:`eaglepangu_jax.cache`, updated in place.

``k`` and ``v`` are ``[L, S, K, Dh]``; slots ``[0, length)`` hold the committed prefix. A
forward over ``T`` new tokens writes their K/V at ``[length, length + T)`` and leaves
``length`` alone, so a rejected branch is rolled back by doing nothing. Acceptance then
commits either a chain already in place (:meth:`TorchKVCache.commit_length`) or an accepted
tree path (:meth:`TorchKVCache.commit_path`, moved into place), with the semantics of
:mod:`eaglepangu_jax.cache`: the root (last round's bonus token) and the accepted nodes are
kept, the new bonus token is written by the next forward.

Every move uses integer ``index_copy_``: a boolean ``index_put_`` crashed an Ascend device,
and device kernels do not wrap negative indices, so slots are range-checked on the host first.
``length`` is a host integer: the host decides what to commit, and keeping it off the device
avoids a synchronisation per step.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch


@dataclasses.dataclass(eq=False)
class TorchKVCache:
    """Mutable KV cache; build with :meth:`empty`."""

    k: torch.Tensor  # [L, S, K, Dh]
    v: torch.Tensor  # [L, S, K, Dh]
    length: int = 0  # committed prefix length

    def __post_init__(self):
        if self.k.dim() != 4 or self.k.shape != self.v.shape:
            raise ValueError(
                f"k and v must be equal [L, S, K, Dh]; got {tuple(self.k.shape)} "
                f"and {tuple(self.v.shape)}"
            )
        if not 0 <= self.length <= self.num_slots:
            raise ValueError(f"length {self.length} outside [0, {self.num_slots}]")

    @classmethod
    def empty(
        cls,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> "TorchKVCache":
        """A zeroed cache with ``num_slots`` slots per layer and nothing committed."""
        shape = (num_layers, num_slots, num_kv_heads, head_dim)
        return cls(
            k=torch.zeros(shape, dtype=dtype, device=device),
            v=torch.zeros(shape, dtype=dtype, device=device),
        )

    @property
    def num_slots(self) -> int:
        return self.k.shape[1]

    def _slots(self, start: int, count: int) -> torch.Tensor:
        return torch.arange(start, start + count, dtype=torch.long, device=self.k.device)

    def write(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor) -> None:
        """Write ``T`` rows ``[T, K, Dh]`` of one layer at slots ``[length, length + T)``."""
        t = k_new.shape[0]
        if self.length + t > self.num_slots:
            raise ValueError(
                f"cache overflow: {t} new tokens after {self.length} committed "
                f"exceed {self.num_slots} slots"
            )
        slots = self._slots(self.length, t)
        self.k[layer].index_copy_(0, slots, k_new.to(self.k.dtype))
        self.v[layer].index_copy_(0, slots, v_new.to(self.v.dtype))

    def advance(self, n: int) -> None:
        """Commit ``n`` slots written in place (e.g. after a prefill of ``n`` tokens)."""
        if n < 0 or self.length + n > self.num_slots:
            raise ValueError(f"cannot advance by {n} after {self.length} of {self.num_slots} slots")
        self.length += n

    def commit_length(self, accepted: int) -> None:
        """Commit a chain: the root and ``accepted`` draft tokens are already in place."""
        if accepted < 0:
            raise ValueError(f"accepted must be >= 0, got {accepted}")
        self.advance(accepted + 1)

    def commit_path(self, path_slots: Sequence[int] | torch.Tensor) -> int:
        """Move an accepted tree path into place and commit it (root included).

        Tree node ``j`` lives at cache slot ``length + j``; the path's entry ``k`` (the node
        accepted at depth ``k``) moves to ``length + k`` and ``length`` grows by
        ``len(path_slots)``, as :func:`eaglepangu_jax.cache.commit` does.

        Args:
            path_slots: tree slots of the accepted path, root (0) first, accepted nodes only.
                Each in ``[0, S - length)``, no repeats. A device tensor is read on the host
                (one synchronisation; the host needs the path to emit its tokens anyway).

        Returns:
            The number of slots copied: the leading run already in place (the root, a chain
            of first children) is skipped, only the newly accepted segment moves.
        """
        path = [
            int(s)
            for s in (path_slots.tolist() if isinstance(path_slots, torch.Tensor) else path_slots)
        ]
        room = self.num_slots - self.length
        if not path or path[0] != 0:
            raise ValueError(f"a path starts at the root, tree slot 0; got {path}")
        bad = [s for s in path if not 0 <= s < room]
        if bad or len(path) > room:
            raise ValueError(
                f"path {path} does not fit the {room} slots after the committed "
                f"prefix (bad entries {bad})"
            )
        if len(set(path)) != len(path):
            raise ValueError(f"path {path} repeats a slot")
        in_place = 0
        while in_place < len(path) and path[in_place] == in_place:
            in_place += 1
        moved = len(path) - in_place
        if moved:
            src = torch.tensor(path[in_place:], dtype=torch.long, device=self.k.device)
            src += self.length
            dst = self._slots(self.length + in_place, moved)
            # index_select copies first, so overlapping source and destination are safe.
            self.k.index_copy_(1, dst, self.k.index_select(1, src))
            self.v.index_copy_(1, dst, self.v.index_select(1, src))
        self.length += len(path)
        return moved
