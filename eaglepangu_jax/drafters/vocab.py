"""Draft vocabulary: the teacher tokens a draft head can propose.

A head's ``lm_head`` over the teacher's full vocabulary would cost more than the rest of the
head; the most frequent teacher tokens of the training data cover nearly all of it. Draft id
``i`` stands for teacher id ``d2t[i]``. Special tokens are always included (the head must be able
to propose end of turn), then the most frequent tokens, then (when the data has fewer distinct
tokens than ``N``) the lowest unused teacher ids, so ``d2t`` is always ``N`` distinct valid ids.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Sequence

import numpy as np

__all__ = ["DraftVocab", "token_counts", "build_vocab", "vocab_over"]


@dataclasses.dataclass(frozen=True)
class DraftVocab:
    """``d2t[i]`` = teacher id of draft id ``i`` (``N`` distinct ids in ``[0, V)``)."""

    d2t: np.ndarray  # [N] int32
    teacher_vocab_size: int
    coverage: float  # share of the counted tokens that ``d2t`` contains

    @property
    def size(self) -> int:
        return int(self.d2t.shape[0])

    def t2d(self) -> np.ndarray:
        """``[V]`` draft id of each teacher id, ``-1`` where it has none (host-side only)."""
        out = np.full((self.teacher_vocab_size,), -1, np.int64)
        out[self.d2t] = np.arange(self.size)
        return out


def token_counts(sequences: Iterable[Sequence[int]], vocab_size: int) -> np.ndarray:
    """``[V]`` occurrence counts of each teacher id."""
    counts = np.zeros((vocab_size,), np.int64)
    for seq in sequences:
        ids = np.asarray(seq, np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
            raise ValueError(f"token ids outside [0, {vocab_size}) in the data")
        counts += np.bincount(ids, minlength=vocab_size)
    return counts


def build_vocab(
    counts: np.ndarray, size: int, special_ids: Sequence[int] = (0, 1, 2)
) -> DraftVocab:
    """The ``size`` draft tokens: specials, then by frequency (ties: lower id), then filler.

    Raises:
      ValueError: ``size`` is not in ``[len(special_ids), V]`` or a special id is out of range.
    """
    counts = np.asarray(counts, np.int64)
    vocab_size = counts.shape[0]
    specials = list(dict.fromkeys(int(s) for s in special_ids))
    if not len(specials) <= size <= vocab_size:
        raise ValueError(
            f"draft vocabulary size {size} must lie in [{len(specials)}, "
            f"{vocab_size}] (special tokens .. teacher vocabulary)"
        )
    if any(not 0 <= s < vocab_size for s in specials):
        raise ValueError(f"special ids {specials} outside [0, {vocab_size})")
    # A stable sort on -count orders by frequency, ties by id; unseen ids come last by id,
    # which is the filler when the data has fewer than ``size`` distinct tokens.
    order = np.argsort(-counts, kind="stable")
    taken = np.zeros((vocab_size,), bool)
    taken[specials] = True
    rest = order[~taken[order]][: size - len(specials)]
    return vocab_over(np.concatenate([np.asarray(specials, np.int64), rest]), counts)


def vocab_over(d2t: np.ndarray, counts: np.ndarray) -> DraftVocab:
    """The draft vocabulary ``d2t`` (e.g. a stored head's), its coverage of ``counts``."""
    counts = np.asarray(counts, np.int64)
    d2t = np.asarray(d2t).astype(np.int32)
    total = counts.sum()
    coverage = float(counts[d2t].sum() / total) if total > 0 else 0.0
    return DraftVocab(d2t=d2t, teacher_vocab_size=counts.shape[0], coverage=coverage)
