"""Attention masks for tree verification, and their compact / kernel-specific forms.

Every mask here is boolean with **True = may attend**, unless its name says otherwise
(:func:`to_ascend` flips the polarity for Ascend fused kernels). Dimensions:

* ``N``: tree slots, the virtual root (slot 0) included; ``D``: maximum tree depth.
* ``T``: new tokens of a plain (causal) forward.
* ``S``: key columns = KV-cache slots seen by the forward (its attention window).
* ``P``: packed words, ``ceil(S / 32)``.

Tree node ``j`` attends to its ancestors and itself. For the tree of :mod:`eaglepangu_jax.tree`
(``root -> 1 -> 3``, ``root -> 2``, ``1 -> 4``) :func:`tree_mask` is (rows = queries)::

    slot  0 1 2 3 4
       0 [1 0 0 0 0]   root
       1 [1 1 0 0 0]
       2 [1 0 1 0 0]
       3 [1 1 0 1 0]
       4 [1 1 0 0 1]

During verification the committed prefix occupies cache slots ``[0, c)`` and tree slot ``j``
has its K/V at cache slot ``c + j`` (the root at ``c``, where the forward writes it). With
``c = 2`` and ``S = 8`` :func:`verify_mask` of the same tree is::

    cache slot 0 1 | 2 3 4 5 6 | 7
       0      [1 1 | 1 0 0 0 0 | 0]
       1      [1 1 | 1 1 0 0 0 | 0]
       2      [1 1 | 1 0 1 0 0 | 0]
       3      [1 1 | 1 1 0 1 0 | 0]
       4      [1 1 | 1 1 0 0 1 | 0]

**No row is ever empty.** Fused attention kernels return NaN on a fully masked row, so every
row sees at least itself and the root: padding slots see exactly the root and themselves, and
the root and self columns are forced even for a hand-built tree with broken tables.

All functions are pure, jittable and vmappable; shape-defining arguments (``cache_len``, ``t``,
``multiple``, ``num_cols``) are static Python ints, ``committed_len`` is a dynamic int32 scalar
so changing it never recompiles.
"""

from __future__ import annotations

import operator

import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Float, Int, UInt, UInt32

from eaglepangu_jax.tree import Tree

__all__ = [
    "WORD_BITS",
    "tree_mask",
    "verify_mask",
    "prefix_mask",
    "causal_mask",
    "left_padded_causal_mask",
    "to_bias",
    "to_ascend",
    "from_ascend",
    "pad_keys",
    "pack",
    "unpack",
]

WORD_BITS = 32


def _attended_slots(tree: Tree) -> Int[Array, "N D+3"]:
    """Row ``i`` lists the tree slots ``i`` attends to (repeats allowed): root, ancestors, self.

    Padding rows list only the root and themselves. The explicit root and self columns keep
    every row non-empty whatever the tables hold; for a valid tree they add nothing.
    """
    n = tree.num_slots
    index = jnp.arange(n, dtype=jnp.int32)[:, None]  # [N, 1]
    depth_col = jnp.arange(tree.max_depth + 1, dtype=jnp.int32)[None, :]  # [1, D + 1]
    padding_row = jnp.where(depth_col == 0, jnp.int32(0), index)  # root, then self
    rows = jnp.where(tree.valid[:, None], tree.ancestors.astype(jnp.int32), padding_row)
    return jnp.concatenate([jnp.zeros((n, 1), jnp.int32), rows, index], axis=1)


def tree_mask(tree: Tree) -> Bool[Array, "N N"]:
    """``[i, j]`` True when tree slot ``j`` is ``i`` itself or one of its ancestors.

    Built from the ancestor table with one broadcast comparison (no loop over nodes).
    """
    slots = jnp.arange(tree.num_slots, dtype=jnp.int32)[None, None, :]
    return jnp.any(_attended_slots(tree)[:, :, None] == slots, axis=1)


def verify_mask(
    tree: Tree, committed_len: Int[ArrayLike, ""], cache_len: int
) -> Bool[Array, "N S"]:
    """Mask of one verification forward over all tree slots against the KV cache.

    Args:
      tree: the speculation tree; slot ``j``'s K/V live at cache slot ``committed_len + j``.
      committed_len: dynamic int32 scalar ``c``, the committed prefix length; slots ``[0, c)``
        are visible to every row. Clipped to ``[0, cache_len]``.
      cache_len: static ``S``, the number of key columns (the attention window).

    Returns:
      ``[N, S]``: the prefix, plus each row's tree ancestors and itself shifted by ``c``.
      Slots past the tree are hidden. A tree that does not fit (``c + N > S``) loses its
      trailing columns; check capacity before verifying (:func:`eaglepangu_jax.cache.
      capacity_check`). Rows stay non-empty even then: column ``min(c, S - 1)`` is always
      visible.
    """
    _check_positive("cache_len", cache_len)
    c = jnp.clip(jnp.asarray(committed_len, jnp.int32), 0, cache_len)
    slots = jnp.arange(cache_len, dtype=jnp.int32)
    prefix = (slots < c)[None, :]  # [1, S]
    shifted = _attended_slots(tree) + c  # [N, D + 3] cache slots
    hits = jnp.any(shifted[:, :, None] == slots[None, None, :], axis=1)
    return prefix | hits


def prefix_mask(
    num_rows: int, committed_len: Int[ArrayLike, ""], cache_len: int
) -> Bool[Array, "T S"]:
    """``[T, S]``: every row sees the committed slots ``[0, c)`` and nothing else.

    The cache half of a forward whose new tokens attend to each other through a separate
    ``[T, T]`` mask (:func:`tree_mask`, or a causal chain) and are not in the cache yet.
    ``c`` is clipped to ``[0, cache_len]``; with ``c = 0`` the rows see no cache slot (their
    own slot, in the other half, keeps them non-empty).
    """
    _check_positive("num_rows", num_rows)
    _check_positive("cache_len", cache_len)
    c = jnp.clip(jnp.asarray(committed_len, jnp.int32), 0, cache_len)
    slots = jnp.arange(cache_len, dtype=jnp.int32)
    return jnp.broadcast_to((slots < c)[None, :], (num_rows, cache_len))


def causal_mask(t: int, committed_len: Int[ArrayLike, ""], cache_len: int) -> Bool[Array, "T S"]:
    """Mask of a prefill / plain-decode forward of ``t`` tokens written at ``[c, c + t)``.

    Row ``r`` (cache slot ``c + r``) sees slots ``[0, c + r]``; ``c`` is clipped to
    ``[0, cache_len]``, so slot 0 is always visible and no row is empty.
    """
    _check_positive("t", t)
    _check_positive("cache_len", cache_len)
    c = jnp.clip(jnp.asarray(committed_len, jnp.int32), 0, cache_len)
    rows = jnp.arange(t, dtype=jnp.int32)[:, None]
    slots = jnp.arange(cache_len, dtype=jnp.int32)[None, :]
    return slots <= c + rows


def left_padded_causal_mask(
    t: int, committed_len: Int[ArrayLike, ""], cache_len: int, first_slot: Int[ArrayLike, ""]
) -> Bool[Array, "T S"]:
    """:func:`causal_mask` of a sequence whose slots ``[0, first_slot)`` are left padding.

    Batched plain decoding right-aligns prompts of different lengths so that every sequence
    writes at the same slot (one in-place cache update for the batch). Row ``r`` (slot
    ``c + r``) sees ``[first_slot, c + r]``; a padding row (``c + r < first_slot``) sees only
    itself, so no row is empty. With ``c = 2``, ``t = 3``, ``first_slot = 3``, ``S = 6``::

        cache slot 0 1 2 3 4 5
           0      [0 0 1 0 0 0]   padding (slot 2)
           1      [0 0 0 1 0 0]   the first real token (slot 3)
           2      [0 0 0 1 1 0]
    """
    rows = causal_mask(t, committed_len, cache_len)
    slots = jnp.arange(cache_len, dtype=jnp.int32)[None, :]
    own = (
        jnp.clip(jnp.asarray(committed_len, jnp.int32), 0, cache_len)
        + jnp.arange(t, dtype=jnp.int32)[:, None]
    )
    return (rows & (slots >= jnp.asarray(first_slot, jnp.int32))) | (slots == own)


def to_bias(mask: Bool[Array, "... S"], dtype=jnp.float32) -> Float[Array, "... S"]:
    """Additive attention bias: 0 where allowed, the dtype's most negative finite value elsewhere.

    A finite value rather than ``-inf``: ``-inf`` turns into NaN as soon as a kernel subtracts
    the row maximum of a fully masked row (``-inf - -inf``), while a finite minimum only
    underflows to a zero weight after ``exp``. Fully masked rows cannot come out of this
    module anyway (every row sees itself and the root), but a bias may be combined with other
    masks by the caller.
    """
    dtype = jnp.dtype(dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"to_bias needs a floating dtype, got {dtype}")
    return jnp.where(mask, jnp.zeros((), dtype), jnp.asarray(jnp.finfo(dtype).min, dtype))


def to_ascend(mask: Bool[Array, "... S"], dtype=jnp.uint8) -> UInt[Array, "... S"]:
    """Inverted polarity for Ascend fused attention: **1 / True = masked out**.

    Args:
      mask: True = may attend.
      dtype: ``uint8`` (what the fused kernels take most reliably) or ``bool``.
    """
    dtype = jnp.dtype(dtype)
    if dtype not in (jnp.dtype(jnp.uint8), jnp.dtype(jnp.bool_)):
        raise ValueError(f"Ascend masks are uint8 or bool, got {dtype}")
    return jnp.logical_not(mask).astype(dtype)


def from_ascend(mask: UInt[Array, "... S"]) -> Bool[Array, "... S"]:
    """Back from Ascend polarity (nonzero = masked out) to True = may attend."""
    return jnp.logical_not(jnp.asarray(mask).astype(jnp.bool_))


def pad_keys(mask: Bool[Array, "... S"], multiple: int) -> Bool[Array, "... S2"]:
    """Pad the key axis up to a multiple of ``multiple``; padded columns are hidden (False).

    Pad before :func:`to_ascend` so the padding comes out masked in either polarity.
    """
    _check_positive("multiple", multiple)
    mask = jnp.asarray(mask)
    if mask.dtype != jnp.bool_ or mask.ndim < 1:
        raise ValueError(
            f"pad_keys needs a boolean mask with a key axis, got {mask.dtype} of shape {mask.shape}"
        )
    extra = -mask.shape[-1] % multiple
    return jnp.pad(mask, [(0, 0)] * (mask.ndim - 1) + [(0, extra)], constant_values=False)


def pack(mask: Bool[Array, "... S"]) -> UInt32[Array, "... P"]:
    """Bit-pack the key axis: column ``c`` is bit ``c % 32`` of word ``c // 32``.

    ``P = ceil(S / 32)``; unused high bits of the last word are 0 (hidden). 32x smaller than a
    bool mask, for masks kept around or shipped between devices.
    """
    padded = pad_keys(mask, WORD_BITS)
    words = padded.shape[-1] // WORD_BITS
    bits = padded.reshape(padded.shape[:-1] + (words, WORD_BITS)).astype(jnp.uint32)
    shifts = _bit_shifts(bits.ndim)
    # Distinct powers of two: their sum is their bitwise OR and cannot overflow 32 bits.
    return jnp.sum(bits << shifts, axis=-1, dtype=jnp.uint32)


def unpack(packed: UInt32[Array, "... P"], num_cols: int) -> Bool[Array, "... S"]:
    """Inverse of :func:`pack`; ``num_cols`` (static ``S``) must need exactly ``P`` words."""
    packed = jnp.asarray(packed)
    if packed.dtype != jnp.uint32 or packed.ndim < 1:
        raise ValueError(
            f"unpack needs uint32 words with a word axis, got {packed.dtype} "
            f"of shape {packed.shape}"
        )
    _check_positive("num_cols", num_cols)
    words = packed.shape[-1]
    if -(-num_cols // WORD_BITS) != words:
        raise ValueError(
            f"{num_cols} columns pack into {-(-num_cols // WORD_BITS)} words, "
            f"but the packed mask has {words}"
        )
    shifts = _bit_shifts(packed.ndim + 1)
    bits = (packed[..., None] >> shifts) & jnp.uint32(1)
    flat = bits.astype(jnp.bool_).reshape(packed.shape[:-1] + (words * WORD_BITS,))
    return flat[..., :num_cols]


def _bit_shifts(ndim: int) -> UInt32[Array, "..."]:
    """``[0, 1, ..., 31]`` as uint32 on the last of ``ndim`` axes (rank-explicit broadcast)."""
    return jnp.arange(WORD_BITS, dtype=jnp.uint32).reshape((1,) * (ndim - 1) + (WORD_BITS,))


def _check_positive(name: str, value: int) -> None:
    """Shape-defining arguments must be concrete positive integers (not traced values)."""
    try:
        ok = not isinstance(value, bool) and operator.index(value) >= 1
    except TypeError:
        ok = False
    if not ok:
        raise ValueError(f"{name} must be a static positive int, got {value!r}")
