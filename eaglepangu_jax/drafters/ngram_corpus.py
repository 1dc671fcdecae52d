"""Prompt lookup plus the corpus's n-gram table: the n-gram drafter with a fallback path.

The n-gram drafter (:mod:`eaglepangu_jax.drafters.ngram`) copies continuations from the
context and has nothing to offer when the last tokens never occurred before (about a quarter
of the positions of the dev suite's answers). This drafter adds one more candidate path every
round: the continuation the teacher's own corpus suggests (:mod:`ngram_table`, a backoff
table of the most frequent next token after each context of up to three tokens). The
candidates are merged into one tree as the n-gram drafter merges its matches
(:func:`eaglepangu_jax.tree.from_paths`), the corpus path weighing ``corpus_weight`` times
its first token's corpus frequency, so a context match of any length outweighs it and it
mostly decides the rounds without one. Node scores are weight shares normalised by at least
1 (the weight of a one-token context match): alone, the corpus path scores its first token's
frequency instead of certainty, so the controller's calibration bins keep it apart from
context matches.

Like the n-gram drafter it needs no forward pass (a few hashed lookups per drafted token),
so under the default controller it proposes every round and the node budget decides.

The shipped table is counted over the training split of the committed corpora's answers
(``eaglepangu_jax/weights/ngram_corpus_smollm2.*``, made by ``eaglepangu ngram-table``); the
evaluation suites never enter it (the corpora's prompts are kept clear of them).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, ClassVar

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Int

from eaglepangu_jax import tree as tree_lib
from eaglepangu_jax.drafters import ngram_table
from eaglepangu_jax.drafters.ngram import NGramDrafter
from eaglepangu_jax.engine.drafter import DraftContext, Proposal

__all__ = [
    "SHIPPED",
    "CorpusNGramDrafter",
    "save_counted",
    "load_counted",
    "load_shipped_ngram_corpus",
]

SHIPPED = "ngram_corpus_smollm2"  # the packaged table under eaglepangu_jax/weights
_FORMAT = "eaglepangu n-gram table"
_FIELDS = ("order", "context", "next_token", "count", "total")
_STORED = {
    "order": np.uint8,
    "context": np.uint16,
    "next_token": np.uint16,
    "count": np.uint32,
    "total": np.uint32,
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class CorpusNGramDrafter(NGramDrafter):
    """:class:`NGramDrafter` plus the corpus table's continuation as one more candidate path
    (its weights, ``params``, are a :class:`ngram_table.HashedTable`).

    Attributes:
      corpus_weight: the corpus path weighs ``corpus_weight * p``, ``p`` the corpus
        frequency of its first token after the context (a one-token context match weighs 1).
    """

    name: ClassVar[str] = "ngram-corpus"

    corpus_weight: float = 1.0

    def __post_init__(self):
        super().__post_init__()
        if not self.corpus_weight >= 0:
            raise ValueError(f"corpus_weight must be >= 0, got {self.corpus_weight}")

    def propose(
        self, params: ngram_table.HashedTable, state: Any, context: DraftContext, key: Array
    ) -> Proposal:
        """A tree of up to ``num_matches`` context continuations and the corpus path."""
        return Proposal(tree=self.tree(params, context.tokens, context.num_tokens, context.start))

    def tree(
        self,
        table: ngram_table.HashedTable,
        tokens: Int[ArrayLike, " C"],
        num_tokens: Int[ArrayLike, ""],
        start: Int[ArrayLike, ""] = 0,
    ) -> tree_lib.Tree:
        """The proposed tree for a raw buffer (``budget + 1`` slots, depth ``depth``)."""
        tokens = jnp.asarray(tokens, jnp.int32)
        c = tokens.shape[0]
        num_tokens = jnp.clip(jnp.asarray(num_tokens, jnp.int32), 0, c)
        paths, path_len, match_w = self.candidates(tokens, num_tokens, start)
        # The last MAX_ORDER visible committed tokens (the root last) seed the corpus path.
        k = ngram_table.MAX_ORDER
        index = num_tokens - k + jnp.arange(k, dtype=jnp.int32)
        recent = tokens[jnp.clip(index, 0, c - 1)]
        visible = jnp.clip(num_tokens - jnp.clip(jnp.asarray(start, jnp.int32), 0, c), 0, k)
        corpus, corpus_lp, corpus_len = ngram_table.continuation(table, recent, visible, self.depth)
        corpus_w = self.corpus_weight * jnp.exp(corpus_lp[0])
        corpus_len = jnp.where(corpus_w > 0, corpus_len, 0)  # weight 0: no corpus path at all
        weight = jnp.concatenate([match_w, corpus_w[None]])
        weight = jnp.where(jnp.concatenate([path_len, corpus_len[None]]) > 0, weight, 0.0)
        # Heaviest path first: from_paths keeps the first paths when the budget runs out.
        order = jnp.argsort(-weight, stable=True)
        all_paths = jnp.concatenate([paths, corpus[None]])[order]
        all_len = jnp.concatenate([path_len, corpus_len[None]])[order]
        weight = weight[order]
        # from_paths normalises by the total weight; a total below 1 (the corpus path alone)
        # is normalised by 1 instead, so that path keeps its own frequency as its score.
        total = jnp.sum(weight)
        shrink = jnp.log(jnp.where(total > 0, total / jnp.maximum(total, 1.0), 1.0))
        return self.merge(tokens, num_tokens, all_paths, all_len, weight, shrink)


def save_counted(path: str, counted: ngram_table.CountedTable, meta: dict[str, Any]) -> None:
    """Write a counted table as ``path.safetensors`` and its JSON (sha256, ``meta``), both
    atomically."""
    from safetensors.numpy import save_file

    from eaglepangu_jax.files import atomic_write, sha256_file, write_json_atomic

    # Stored compactly (ids fit 16 bits, counts 32; only as many context columns as the
    # longest context needs, the loader pads them back); read back as int64.
    width = max(int(np.max(counted.order)), 1) if len(counted) else 1
    arrays = {f: np.ascontiguousarray(getattr(counted, f), dtype=_STORED[f]) for f in _FIELDS}
    columns = arrays["context"][:, counted.context.shape[1] - width :]
    arrays["context"] = np.ascontiguousarray(columns)
    data = atomic_write(f"{path}.safetensors", lambda tmp: save_file(arrays, str(tmp)))
    write_json_atomic(
        f"{path}.json",
        {"format": _FORMAT, "rows": len(counted), "sha256": sha256_file(data), **meta},
    )


def load_counted(path: str, *, fingerprint: str | None = None) -> tuple[Any, dict]:
    """A counted table written by :func:`save_counted`, and its JSON.

    Raises:
      ValueError: missing or corrupt files (hash, fields, shapes or id range), another
        format, or a table counted over another teacher's corpus than ``fingerprint``.
    """
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    from eaglepangu_jax.files import sha256_file

    try:
        meta = json.loads(open(f"{path}.json", encoding="utf-8").read())
        digest = sha256_file(f"{path}.safetensors")
    except (OSError, ValueError) as err:
        raise ValueError(f"n-gram table {path}: unreadable ({err})") from None
    if meta.get("format") != _FORMAT:
        raise ValueError(f"n-gram table {path}: not an n-gram table ({meta.get('format')!r})")
    if digest != meta.get("sha256"):
        raise ValueError(f"n-gram table {path}: the tensors do not match their sha256 (corrupt)")
    if fingerprint is not None and meta.get("teacher") != fingerprint:
        raise ValueError(
            f"n-gram table {path}: counted over another teacher's corpus "
            f"({meta.get('teacher')!r}, installed {fingerprint!r})"
        )
    try:
        arrays = load_file(f"{path}.safetensors")
        if any(arrays[f].dtype != _STORED[f] for f in _FIELDS):
            raise KeyError("unexpected dtypes")
        counted = ngram_table.CountedTable(**{f: arrays[f].astype(np.int64) for f in _FIELDS})
    except (SafetensorError, KeyError, OSError) as err:
        raise ValueError(f"n-gram table {path}: malformed ({err})") from None
    n = len(counted)
    width = counted.context.shape[1] if counted.context.ndim == 2 else -1
    if 1 <= width < ngram_table.MAX_ORDER and counted.context.shape[0] == n:
        # A table counted with shorter contexts (three tokens before session 35): contexts
        # are right-aligned, so leading zero columns make it today's layout.
        pad = np.zeros((n, ngram_table.MAX_ORDER - width), np.int64)
        counted = dataclasses.replace(counted, context=np.concatenate([pad, counted.context], 1))
        width = ngram_table.MAX_ORDER if np.all(counted.order <= width) else -1
    shapes_ok = (
        width == ngram_table.MAX_ORDER
        and counted.context.shape[0] == n
        and all(getattr(counted, f).shape == (n,) for f in _FIELDS if f != "context")
    )
    values_ok = shapes_ok and bool(
        np.all((counted.order >= 1) & (counted.order <= ngram_table.MAX_ORDER))
        and np.all((counted.context >= 0) & (counted.context < 1 << 16))
        and np.all((counted.next_token >= 0) & (counted.next_token < 1 << 16))
        and np.all((counted.count >= 1) & (counted.count <= counted.total))
    )
    if not values_ok or n != meta.get("rows"):
        raise ValueError(f"n-gram table {path}: malformed (shapes or values out of range)")
    return counted, meta


def load_shipped_ngram_corpus(**kwargs: Any) -> tuple[CorpusNGramDrafter, ngram_table.HashedTable]:
    """The drafter (hyper-parameters ``kwargs``) and the packaged table, hashed.

    Raises:
      ValueError: the packaged table is missing, corrupt or for another teacher.
    """
    from importlib import resources

    from eaglepangu_jax.models import smollm2

    path = resources.files("eaglepangu_jax") / "weights" / SHIPPED
    counted, _ = load_counted(str(path), fingerprint=smollm2.teacher_fingerprint())
    return CorpusNGramDrafter(**kwargs), ngram_table.hash_table(counted)
