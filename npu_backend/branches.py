"""Branches mode: verify a speculation tree as a batch of causal chains.

Serving stacks on NPUs verify chains, not trees: their attention kernels take a causal mask
(with a key offset), never an arbitrary tree mask. Branches mode keeps those kernels usable:

1. **Decompose** (pure JAX, :func:`tree_to_branches`): one chain per leaf, root first, read
   off the tree's ancestor table. Chains are padded to ``D + 1`` entries by repeating the
   leaf (the ancestor table already does), so every entry is a real slot in ``[0, N)``;
   never ``-1``. The tree of :mod:`eaglepangu_jax.tree` (``root -> 1 -> 3``, ``root -> 2``,
   ``1 -> 4``, ``D = 2``) gives, leaves in slot order::

       branch_slots = [[0, 2, 2],    branch_len = [2,
                       [0, 1, 3],                  3,
                       [0, 1, 4],                  3,
                       [0, 0, 0]]                  0]   (unused row: the root, length 0)

2. **Verify** (torch, :func:`verify_branches`): the ``B`` chains run as one batch of
   ``B x (D + 1)`` tokens. Each chain sees the committed prefix plus its own causal chain:
   :func:`branch_mask`, row ``d`` of chain ``b`` attends key columns ``[0, c + d]``, a plain
   causal mask with offset ``c`` (clipped at the chain's length for the padded rows).

   *KV layout (per-branch scratch regions).* The chains' K/V are written into the cache's
   speculative region, chain ``b`` at slots ``[c + b (D + 1), c + (b + 1)(D + 1))``: one
   contiguous write of all ``B (D + 1)`` rows per layer, nothing committed. For attention,
   chain ``b``'s keys are gathered into a contiguous ``[prefix | own chain]`` sequence with
   one integer ``index_select`` (:func:`key_slots`), so the kernel sees a dense causal
   problem per batch row, the layout chain kernels expect. The cache therefore needs
   ``B (D + 1)`` speculative slots instead of ``N`` (:func:`scratch_slots`).

3. **Accept**: a node's teacher row is the same in every chain that contains it (same
   ancestors, same positions), so the tree's ``[N, V]`` logits are reassembled from each
   node's first occurrence (:func:`node_rows`) and the *tree* acceptance rule runs on them
   (greedy or lossless sampling, same PRNG key). The result is therefore the tree-mode
   result; the winning chain is the one holding the stop node, and its first
   ``length + 1`` entries are the accepted path.

4. **Commit**: the accepted nodes of the winning chain move from its scratch region to
   ``[c, c + length]`` (:func:`commit_slots` with :meth:`TorchKVCache.commit_path`); the
   root is common to every chain and chain 0's copy is already in place.

Cost: ``B (D + 1)`` verified tokens instead of ``N`` and a prefix copy per chain per layer;
the price of chain-only kernels. Only the chains in use are run: the host trims the batch to
the next power of two above the leaf count (few distinct shapes, few recompilations).

Dimensions: ``N`` tree slots, ``D`` depth, ``T = D + 1`` chain length, ``B`` chains,
``W`` key columns, ``K`` KV heads, ``Dh`` head dim.
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax.numpy as jnp
import torch
from jaxtyping import Array, ArrayLike, Bool, Int

from eaglepangu_jax.tree import Tree
from npu_backend.attention import tree_attention
from npu_backend.kv_cache import TorchKVCache
from npu_backend.llama_torch import TorchLlama

# index_select(x, index, dim): the integer gather used for every table lookup on the torch
# side. :func:`npu_backend.simulated.index_select` is the strict (range-checked) variant.
IndexSelect = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]


def plain_index_select(x: torch.Tensor, index: torch.Tensor, dim: int) -> torch.Tensor:
    """``torch.index_select`` with the argument order of the strict simulator helper."""
    return torch.index_select(x, dim, index.long())


def num_branches(tree: Tree) -> int:
    """``B``, the static number of chain rows: one per possible leaf, ``max(N - 1, 1)``."""
    return max(tree.num_slots - 1, 1)


def leaves(tree: Tree) -> Bool[Array, " N"]:
    """Valid slots without a valid child (the root only when the tree has no node)."""
    n = tree.num_slots
    index = jnp.arange(n, dtype=jnp.int32)
    is_child = tree.valid & (index > 0)
    has_child = jnp.zeros((n,), jnp.int32).at[tree.parents].add(is_child.astype(jnp.int32))
    return tree.valid & (has_child == 0)


def tree_to_branches(tree: Tree) -> tuple[Int[Array, "B D+1"], Int[Array, " B"]]:
    """Root-to-leaf chains of ``tree`` (see the module docstring for an example).

    Returns:
        ``(branch_slots, branch_len)``: ``branch_slots[b, k]`` is the slot at depth ``k`` of
        chain ``b`` (entries past the leaf repeat it), ``branch_len[b]`` its entries, leaf
        included (0 for an unused row, whose slots are all the root). Chains are ordered by
        leaf slot, used rows first; ``B = max(N - 1, 1)`` (static). Every entry is in
        ``[0, N)``.
    """
    b = num_branches(tree)
    is_leaf = leaves(tree)
    order = jnp.argsort(~is_leaf, stable=True)[:b]  # leaves first, in slot order
    used = is_leaf[order]
    slots = jnp.where(used[:, None], tree.ancestors[order], 0).astype(jnp.int32)
    length = jnp.where(used, tree.depth[order] + 1, 0).astype(jnp.int32)
    return slots, length


def node_rows(
    tree: Tree, branch_slots: Int[ArrayLike, "B T"], branch_len: Int[ArrayLike, " B"]
) -> Int[Array, " N"]:
    """Flat row ``b * T + k`` of each slot's first occurrence in a used chain entry.

    Slots in no chain (padding) get row 0, the root of chain 0: an in-range row whose values
    acceptance never reads for them.
    """
    branch_slots = jnp.asarray(branch_slots, jnp.int32)
    t = branch_slots.shape[1]
    live = jnp.arange(t, dtype=jnp.int32)[None, :] < jnp.asarray(branch_len, jnp.int32)[:, None]
    slots = jnp.arange(tree.num_slots, dtype=jnp.int32)[:, None]
    hits = (branch_slots.reshape(-1)[None, :] == slots) & live.reshape(-1)[None, :]
    return jnp.argmax(hits, axis=1).astype(jnp.int32)


def branch_mask(
    branch_len: Int[ArrayLike, " B"], committed_len: Int[ArrayLike, ""], t: int, width: int
) -> Bool[Array, "B T W"]:
    """The batch mask over each chain's gathered keys ``[prefix | own chain]``.

    Row ``d`` of chain ``b`` attends columns ``[0, c + min(d, len_b - 1)]``: the committed
    prefix and its chain causally. Rows past the chain's end (padding, outputs discarded)
    see the whole chain; an unused row (length 0) sees the prefix and its root, so no row is
    ever empty. With ``c = 2``, ``T = 3``, ``W = 6`` and ``len = 2``::

        [1 1 1 0 0 0]
        [1 1 1 1 0 0]
        [1 1 1 1 0 0]   (padding row)
    """
    c = jnp.clip(jnp.asarray(committed_len, jnp.int32), 0, width)
    length = jnp.maximum(jnp.asarray(branch_len, jnp.int32), 1)
    d = jnp.arange(t, dtype=jnp.int32)[None, :]
    last = c + jnp.minimum(d, length[:, None] - 1)  # [B, T] last visible column
    cols = jnp.arange(width, dtype=jnp.int32)
    return cols[None, None, :] <= last[:, :, None]


def scratch_slots(tree_slots: int, depth: int) -> int:
    """Speculative cache slots branches mode needs beyond the committed prefix."""
    return max(tree_slots - 1, 1) * (depth + 1)


def key_slots(committed: int, branches: int, t: int, width: int, device) -> torch.Tensor:
    """``[B, W]`` cache slot behind each gathered key column (see the module docstring).

    Column ``j < c`` is prefix slot ``j``; ``c <= j < c + T`` is chain ``b``'s slot
    ``c + b T + (j - c)``; later columns (masked) read slot ``j`` itself, so every entry is a
    real slot in ``[0, max(W, c + B T))``.
    """
    cols = torch.arange(width, dtype=torch.long, device=device)[None, :]
    chain = torch.arange(branches, dtype=torch.long, device=device)[:, None] * t
    own = (cols >= committed) & (cols < committed + t)
    return torch.where(own, cols + chain, cols.expand(branches, width))


def commit_slots(winner: int, accepted: int, t: int) -> list[int]:
    """Scratch slots (relative to the committed length) of the winning chain's accepted
    entries, root first: the root from chain 0 (identical in every chain, already in place),
    then depths ``1..accepted`` of chain ``winner``."""
    if winner < 0 or accepted < 0 or accepted >= t:
        raise ValueError(
            f"winner {winner} / accepted {accepted} out of range for chains of {t} entries"
        )
    return [0] + [winner * t + k for k in range(1, accepted + 1)]


@torch.no_grad()
def verify_branches(
    model: TorchLlama,
    kv_cache: TorchKVCache,
    tree_tokens: torch.Tensor,
    branch_slots: torch.Tensor,
    positions: torch.Tensor,
    mask: torch.Tensor,
    feature_layers: Sequence[int] = (),
    *,
    index_select: IndexSelect = plain_index_select,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One teacher forward over ``B`` chains; K/V go to the per-chain scratch regions.

    Args:
        model: the teacher.
        kv_cache: committed prefix at ``[0, c)``; needs ``c + B T`` slots. Not advanced.
        tree_tokens: ``[N]`` token id per tree slot.
        branch_slots: ``[B, T]`` chain table (:func:`tree_to_branches`, maybe trimmed to its
            used rows); gathered with ``index_select``, so a negative entry raises under the
            strict helper.
        positions: ``[B, T]`` rotary positions (``c + k`` at chain depth ``k``).
        mask: bool ``[B, T, W]`` from :func:`branch_mask`.
        feature_layers: teacher layers to tap.
        index_select: the integer gather (plain, or the strict checked one).

    Returns:
        ``(logits [B, T, V] float32, features [B, T, F, H])``.
    """
    device = model.device
    b, t = branch_slots.shape
    mask = mask.to(device)
    if tuple(mask.shape[:2]) != (b, t) or mask.dtype != torch.bool:
        raise ValueError(
            f"mask must be bool [B={b}, T={t}, W]; got {mask.dtype} {tuple(mask.shape)}"
        )
    if tuple(positions.shape) != (b, t):
        raise ValueError(f"positions must be [B={b}, T={t}]; got {tuple(positions.shape)}")
    committed, width = kv_cache.length, mask.shape[2]
    if committed + t > width or max(width, committed + b * t) > kv_cache.num_slots:
        raise ValueError(
            f"{b} chains of {t} after {committed} committed slots need "
            f"{committed + b * t} cache slots and a key window of at least "
            f"{committed + t}; have {kv_cache.num_slots} slots, window {width}"
        )
    tokens = index_select(tree_tokens.to(device), branch_slots.to(device).reshape(-1), 0)
    tokens = tokens.long().view(b, t)
    keys_at = key_slots(committed, b, t, width, device).reshape(-1)
    cfg = model.config

    def attend(i, q, k, v):
        kv_cache.write(
            i,
            k.reshape(b * t, cfg.num_kv_heads, cfg.head_dim),
            v.reshape(b * t, cfg.num_kv_heads, cfg.head_dim),
        )
        keys, values = (
            index_select(x[i], keys_at, 0)
            .view(b, width, cfg.num_kv_heads, cfg.head_dim)
            .to(q.dtype)
            .permute(0, 2, 1, 3)
            for x in (kv_cache.k, kv_cache.v)
        )
        out = tree_attention(
            q.permute(0, 2, 1, 3),
            keys,
            values,
            mask,
            impl=model.attention_impl,
            scale=cfg.head_dim**-0.5,
        )
        return out.permute(0, 2, 1, 3)

    return model.run(tokens, positions.to(device=device, dtype=torch.long), attend, feature_layers)
