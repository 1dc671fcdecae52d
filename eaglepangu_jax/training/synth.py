"""User turns written by the teacher itself: the prompt source of the self-distilled corpus.

An instruct model has learned what users ask. Given its chat template up to the start of a
user turn (the system turn, then ``<|im_start|>user\\n``: the *pre-query* template), it samples
a plausible request and stops at ``<|im_end|>``. That gives prompts far closer to real use than
templates, at the cost of some junk, which the filters below remove:

* :func:`reject_reason`: the sample stopped by itself (not cut at the length limit), has sane
  length, is one turn (no template token, no ``assistant:`` hand-over), is mostly letters and
  not a repetition loop;
* :func:`deduplicate`: exact duplicates (after normalisation) and near duplicates (MinHash over
  character 5-grams, banded LSH, then the exact Jaccard similarity of each candidate pair);
* :class:`EvalGuard`: any prompt sharing a run of ``n`` normalised words with an evaluation
  text (MT-Bench, HumanEval) is dropped, so the evaluation suites stay unseen.

Sampling is batched (``generate_batch`` over copies of the pre-query prompt, one PRNG key per
copy), and deterministic: batch ``b`` of seed ``s`` always draws the same turns.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from typing import Iterable, Sequence

import numpy as np

__all__ = [
    "SynthSettings",
    "pre_query_ids",
    "sample_user_turns",
    "normalize",
    "reject_reason",
    "deduplicate",
    "EvalGuard",
]


@dataclasses.dataclass(frozen=True, kw_only=True)
class SynthSettings:
    """How user turns are sampled and filtered (hashed into the synthesis batches' keys).

    Attributes:
      batch_size: turns sampled per batch (one ``generate_batch`` call).
      max_tokens: longest user turn; a sample cut here is dropped as truncated.
      temperature, top_p: sampling of the user turn.
      min_chars, max_chars: length bounds of a kept turn.
    """

    batch_size: int = 64
    max_tokens: int = 96
    temperature: float = 1.0
    top_p: float = 0.95
    min_chars: int = 16
    max_chars: int = 400

    def __post_init__(self):
        if self.batch_size < 1 or self.max_tokens < 1:
            raise ValueError(
                f"batch_size and max_tokens must be >= 1, got {self.batch_size}, {self.max_tokens}"
            )
        if not 0.0 < self.temperature or not 0.0 < self.top_p <= 1.0:
            raise ValueError(
                f"temperature must be > 0 and top_p in (0, 1], got {self.temperature}, {self.top_p}"
            )
        if not 0 <= self.min_chars < self.max_chars:
            raise ValueError(
                f"need 0 <= min_chars < max_chars, got {self.min_chars}, {self.max_chars}"
            )


_MARK = "\x00eaglepangu-user-turn\x00"


def pre_query_ids(tokenizer) -> list[int]:
    """The chat template up to where a user's words begin (system turn and user header).

    Rendered from a one-message conversation and cut at the message, so it is exactly what
    the template puts before any user turn (its default system turn included).
    """
    from eaglepangu_jax.models.chat import render_chat

    text = render_chat(
        [{"role": "user", "content": _MARK}], add_generation_prompt=False, tokenizer=tokenizer
    )
    return tokenizer.encode(text[: text.index(_MARK)])


def sample_user_turns(
    teacher, tokenizer, settings: SynthSettings, *, seed: int, batch: int
) -> list[list[int]]:
    """Batch ``batch`` of ``seed``: ``settings.batch_size`` sampled user turns (raw ids, the
    stop token included when the sample stopped by itself)."""
    from eaglepangu_jax.engine.config import SpecConfig
    from eaglepangu_jax.engine.decode import generate_batch

    prefix = pre_query_ids(tokenizer)
    # One seed per (seed, batch): batches are independent and reproducible in any order.
    batch_seed = int.from_bytes(hashlib.sha256(f"{seed}/{batch}".encode()).digest()[:4], "little")
    spec = SpecConfig(
        policy="drafter",
        budget=1,
        depth=1,
        max_new_tokens=settings.max_tokens,
        acceptance="sample",  # without it the engine decodes greedily, whatever the temperature
        temperature=settings.temperature,
        top_p=settings.top_p,
        seed=batch_seed,
    )
    results = generate_batch(teacher, None, [prefix] * settings.batch_size, spec)
    return [list(map(int, r.tokens)) for r in results]


def normalize(text: str) -> str:
    """Lower case, every run of non-alphanumerics one space (for duplicate and overlap
    checks)."""
    return " ".join(re.sub(r"[^0-9a-z]+", " ", text.lower()).split())


_ROLE_HANDOVER = re.compile(r"(^|\n)\s*(assistant|user|system)\s*[:\n]", re.IGNORECASE)


def reject_reason(
    ids: Sequence[int],
    text: str,
    *,
    eos_id: int,
    special_ids: Iterable[int],
    settings: SynthSettings,
) -> str | None:
    """Why a sampled user turn is not kept (``None``: keep it).

    Reasons: ``truncated`` (no stop token), ``template`` (a special token other than the final
    stop, or role text handing over the turn), ``length``, ``junk`` (mostly non-letters),
    ``repetitive`` (a loop: few distinct word 3-grams, or a character run).
    """
    ids = list(ids)
    if not ids or ids[-1] != eos_id:
        return "truncated"
    specials = set(special_ids) | {eos_id}
    if any(t in specials for t in ids[:-1]) or "<|" in text or _ROLE_HANDOVER.search(text):
        return "template"
    stripped = text.strip()
    if not settings.min_chars <= len(stripped) <= settings.max_chars:
        return "length"
    letters = sum(ch.isalpha() for ch in stripped)
    if letters < 0.5 * len(stripped):
        return "junk"
    words = stripped.lower().split()
    if len(words) >= 9:
        grams = list(zip(words, words[1:], words[2:]))
        if len(set(grams)) < 0.7 * len(grams):
            return "repetitive"
    if re.search(r"(.)\1{7,}", stripped):
        return "repetitive"
    return None


# MinHash: 32 hash functions in 8 bands of 4 rows; a pair colliding in a band is a candidate.
_PERMUTATIONS, _BANDS = 32, 8
_PRIME = (1 << 61) - 1


def _shingles(text: str, width: int = 5) -> np.ndarray:
    """Hashes of the character ``width``-grams of a normalised text (the text itself when
    shorter)."""
    grams = {text[i : i + width] for i in range(max(len(text) - width + 1, 1))}
    return np.array(
        [
            int.from_bytes(hashlib.blake2b(g.encode(), digest_size=7).digest(), "little")
            for g in grams
        ],
        dtype=np.uint64,
    )


def _minhash(shingles: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    # (a * x + b) mod p in object-free uint64 arithmetic would overflow; Python ints are exact
    # and the sets are small (tens of shingles).
    x = [int(v) for v in shingles]
    return np.array([min((ai * v + bi) % _PRIME for v in x) for ai, bi in zip(a, b)], np.uint64)


def deduplicate(texts: Sequence[str], *, threshold: float = 0.7, seed: int = 0) -> list[int]:
    """Indices of the texts to keep: the first of every group of exact duplicates (after
    :func:`normalize`) or near duplicates (character 5-gram Jaccard similarity >= threshold)."""
    rng = np.random.default_rng(seed)
    a = [int(v) for v in rng.integers(1, _PRIME, _PERMUTATIONS, dtype=np.int64)]
    b = [int(v) for v in rng.integers(0, _PRIME, _PERMUTATIONS, dtype=np.int64)]
    rows = _PERMUTATIONS // _BANDS
    seen_exact: set[str] = set()
    buckets: dict[tuple, list[int]] = {}
    kept: list[int] = []
    shingle_sets: dict[int, set[int]] = {}
    for i, text in enumerate(texts):
        norm = normalize(text)
        if norm in seen_exact:
            continue
        shingles = _shingles(norm)
        mine = set(int(v) for v in shingles)
        signature = _minhash(shingles, a, b)
        keys = [(band, tuple(signature[band * rows : (band + 1) * rows])) for band in range(_BANDS)]
        candidates = {j for key in keys for j in buckets.get(key, ())}
        if any(
            len(mine & shingle_sets[j]) / len(mine | shingle_sets[j]) >= threshold
            for j in candidates
        ):
            continue
        seen_exact.add(norm)
        shingle_sets[i] = mine
        for key in keys:
            buckets.setdefault(key, []).append(i)
        kept.append(i)
    return kept


@dataclasses.dataclass(frozen=True)
class EvalGuard:
    """Refuses texts that share a run of ``n`` normalised words with an evaluation text.

    Build with :meth:`from_texts` from every evaluation prompt (all MT-Bench turns, every
    HumanEval problem). ``n = 8`` flags quoting far shorter than a paragraph, while ordinary
    phrases ("can you write a python function that") are shorter than that.
    """

    grams: frozenset
    n: int = 8

    @classmethod
    def from_texts(cls, texts: Iterable[str], n: int = 8) -> "EvalGuard":
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        return cls(frozenset(g for t in texts for g in _word_grams(t, n)), n)

    def overlaps(self, text: str) -> bool:
        """Whether ``text`` shares a run of ``n`` normalised words with an evaluation text."""
        return any(g in self.grams for g in _word_grams(text, self.n))


def _word_grams(text: str, n: int) -> set[tuple[str, ...]]:
    words = normalize(text).split()
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}
