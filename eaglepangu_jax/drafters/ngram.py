"""Training-free n-gram ("prompt lookup") drafter: continuations copied from the context.

Generated text repeats its context (identifiers in code, quoted passages, a rewritten answer).
When the last ``n`` committed tokens also occur earlier in the buffer, the tokens that followed
that earlier occurrence are a cheap, often right, guess for what comes next. This drafter finds
such occurrences, takes the committed tokens after each as a candidate path, and merges up to
``M`` candidates into one tree with :func:`eaglepangu_jax.tree.from_paths`.

Everything has fixed shapes: one ``[C]`` boolean pass per suffix length (``O(C * max_ngram)``),
a top-``M`` over the buffer and an ``[M, D]`` gather, so only values (``num_tokens``, tokens)
change between rounds and nothing recompiles. Example, ``num_tokens = 11``, root ``c``::

    buffer    a b c d x b c e y b c
    suffix                      b c      (n = 2)
    matches       ^       ^              (end positions 2 and 6, most recent first)
    paths     [e y b], [d x b]           (depth 3; never past the root)

Dimensions: ``C`` buffer capacity, ``M`` candidate matches, ``D`` continuation depth.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float, Int

from eaglepangu_jax import tree as tree_lib
from eaglepangu_jax.engine.drafter import DraftContext, Proposal

__all__ = ["match_lengths", "find_candidates", "NGramDrafter"]


def match_lengths(
    tokens: Int[ArrayLike, " C"],
    num_tokens: Int[ArrayLike, ""],
    max_ngram: int,
    start: Int[ArrayLike, ""] = 0,
) -> Int[Array, " C"]:
    """Length of the committed suffix that also ends at each earlier position.

    ``out[j]`` is the largest ``n <= max_ngram`` with
    ``tokens[j - n + 1 : j + 1] == tokens[L - n : L]`` (``L = num_tokens``) and
    ``j - n + 1 >= start``, for the earlier end positions ``j <= L - 2``; 0 elsewhere, so
    uncommitted and hidden entries never match.

    Args:
      tokens: ``[C]`` token buffer; only entries ``start .. num_tokens - 1`` are read.
      num_tokens: committed entries (the last one is the root); clipped to ``[0, C]``.
      max_ngram: longest suffix compared (static).
      start: first visible entry (see :class:`DraftContext`); earlier ones are ignored.

    Returns:
      ``[C]`` int32 match lengths in ``[0, max_ngram]``.
    """
    tokens = jnp.asarray(tokens, jnp.int32)
    c = tokens.shape[0]
    last = jnp.clip(jnp.asarray(num_tokens, jnp.int32), 0, c) - 1  # the root; -1 if empty
    index = jnp.arange(c, dtype=jnp.int32)
    first = jnp.clip(jnp.asarray(start, jnp.int32), 0, c)
    # A run of agreements grows one token further back per step: run_k[j] says the k + 1
    # tokens ending at j equal the k + 1 tokens ending at the root. j <= last - 1 also keeps
    # the suffix index last - k >= 1 wherever the run is alive, so no read wraps.
    run = index < last
    length = jnp.zeros((c,), jnp.int32)
    for k in range(min(max_ngram, c)):
        suffix_token = tokens[jnp.clip(last - k, 0, c - 1)]
        shifted = jnp.concatenate([jnp.zeros((k,), jnp.int32), tokens[: c - k]])  # tokens[j-k]
        run = run & (index >= first + k) & (shifted == suffix_token)
        length = length + run.astype(jnp.int32)
    return length


def find_candidates(
    tokens: Int[ArrayLike, " C"],
    num_tokens: Int[ArrayLike, ""],
    start: Int[ArrayLike, ""] = 0,
    *,
    min_ngram: int,
    max_ngram: int,
    num_matches: int,
    depth: int,
) -> tuple[Int[Array, "M D"], Int[Array, " M"], Int[Array, " M"]]:
    """The ``M`` best earlier occurrences of the suffix and the committed tokens after each.

    Occurrences lie in the visible committed window ``[start, num_tokens - 2]`` and are ranked
    by match length (longest first), then by recency (latest first).
    A continuation stops at ``depth`` tokens or at the root, whichever comes first: it only
    ever holds committed tokens.

    Returns:
      ``(paths, path_len, match_len)``: ``[M, D]`` continuation tokens (0 past ``path_len``),
      ``[M]`` their lengths (0 for an unused candidate) and ``[M]`` the matched suffix length.
    """
    tokens = jnp.asarray(tokens, jnp.int32)
    c = tokens.shape[0]
    if (max_ngram + 1) * c >= 2**31:
        raise ValueError(f"buffer of {c} tokens too large for an int32 ranking key")
    last = jnp.clip(jnp.asarray(num_tokens, jnp.int32), 0, c) - 1
    length = match_lengths(tokens, num_tokens, max_ngram, start)
    index = jnp.arange(c, dtype=jnp.int32)
    # One int32 key orders (length, position) lexicographically; -1 marks "no match".
    key = jnp.where(length >= min_ngram, length * c + index, -1)
    key = jnp.pad(key, (0, max(0, num_matches - c)), constant_values=-1)
    top, end = jax.lax.top_k(key, num_matches)
    found = top >= 0
    end = jnp.clip(end, 0, c - 1).astype(jnp.int32)
    path_len = jnp.where(found, jnp.clip(last - end, 0, depth), 0).astype(jnp.int32)
    step = jnp.arange(depth, dtype=jnp.int32)
    gathered = tokens[jnp.clip(end[:, None] + 1 + step[None, :], 0, c - 1)]
    paths = jnp.where(step[None, :] < path_len[:, None], gathered, 0)
    match_len = jnp.where(found, length[end], 0).astype(jnp.int32)
    return paths, path_len, match_len


@dataclasses.dataclass(frozen=True, kw_only=True)
class NGramDrafter:
    """Prompt-lookup drafter: a tree of continuations of earlier suffix occurrences.

    Attributes:
      max_ngram: longest suffix searched for.
      min_ngram: shortest suffix accepted as a match.
      depth: continuation length, the tree's maximum depth ``D``.
      num_matches: candidate continuations merged into the tree, ``M``.
      budget: tree nodes, root excluded (the tree has ``budget + 1`` slots).
      length_weight: a path matched on ``n`` tokens weighs ``length_weight ** (n - 1)``;
        a node's logscore is the log of the weight share of the paths through it, so a
        longer or more frequent match counts as more likely...
      continue_prob: ...times ``continue_prob ** (depth - 1)``: a copied continuation is
        less likely to hold the further it goes. The weight share alone gives every node of
        a lone match probability 1 at every depth, so the ``"auto"`` controller's bins of
        predicted probability (:mod:`eaglepangu_jax.draft_control`) mixed first tokens with
        deep ones and learnt one acceptance rate for all; with the depth factor each depth
        falls into its own bins and the bins learn how far matches really run (``1.0``
        restores the plain weight share).
    """

    name: ClassVar[str] = "ngram"

    max_ngram: int = 3
    min_ngram: int = 1
    depth: int = 8
    num_matches: int = 8
    budget: int = 16
    length_weight: float = 2.0
    continue_prob: float = 0.8

    def __post_init__(self):
        if self.min_ngram < 1 or self.max_ngram < self.min_ngram:
            raise ValueError(
                f"need 1 <= min_ngram <= max_ngram, got min_ngram="
                f"{self.min_ngram}, max_ngram={self.max_ngram}"
            )
        for field in ("depth", "num_matches", "budget"):
            if getattr(self, field) < 1:
                raise ValueError(f"{field} must be >= 1, got {getattr(self, field)}")
        if not self.length_weight > 0:
            raise ValueError(f"length_weight must be > 0, got {self.length_weight}")
        if not 0 < self.continue_prob <= 1:
            raise ValueError(f"continue_prob must be in (0, 1], got {self.continue_prob}")

    @property
    def max_depth(self) -> int:
        """Deepest tree it proposes (the continuation length)."""
        return self.depth

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """None: it reads tokens only."""
        return ()

    def init_state(self, params: Any, context: DraftContext) -> None:
        """Stateless: everything it needs is in the token buffer."""
        return None

    def update(self, params: Any, state: Any, context: DraftContext) -> Any:
        """Stateless: returns ``state`` unchanged."""
        return state

    def propose(self, params: Any, state: Any, context: DraftContext, key: Array) -> Proposal:
        """A tree of up to ``num_matches`` continuations (root only when nothing matches)."""
        return Proposal(tree=self.tree(context.tokens, context.num_tokens, context.start))

    def tree(
        self,
        tokens: Int[ArrayLike, " C"],
        num_tokens: Int[ArrayLike, ""],
        start: Int[ArrayLike, ""] = 0,
    ) -> tree_lib.Tree:
        """The proposed tree for a raw buffer (``budget + 1`` slots, depth ``depth``)."""
        tokens = jnp.asarray(tokens, jnp.int32)
        paths, path_len, weight = self.candidates(tokens, num_tokens, start)
        return self.merge(tokens, num_tokens, paths, path_len, weight)

    def candidates(
        self, tokens: Int[Array, " C"], num_tokens: Int[ArrayLike, ""], start: Int[ArrayLike, ""]
    ) -> tuple[Int[Array, "M D"], Int[Array, " M"], Float[Array, " M"]]:
        """The context continuations (:func:`find_candidates`) and their path weights."""
        paths, path_len, match_len = find_candidates(
            tokens,
            num_tokens,
            start,
            min_ngram=self.min_ngram,
            max_ngram=self.max_ngram,
            num_matches=self.num_matches,
            depth=self.depth,
        )
        return paths, path_len, self._weights(match_len)

    def merge(
        self,
        tokens: Int[Array, " C"],
        num_tokens: Int[ArrayLike, ""],
        paths: Int[Array, "P D"],
        path_len: Int[Array, " P"],
        weight: Float[Array, " P"],
        shift: Float[ArrayLike, ""] = 0.0,
    ) -> tree_lib.Tree:
        """Candidate paths (best first) merged into a tree rooted at the last committed token;
        a node scores its paths' weight share times the depth decay, times ``exp(shift)``."""
        last = jnp.clip(jnp.asarray(num_tokens, jnp.int32) - 1, 0, tokens.shape[0] - 1)
        tree = tree_lib.from_paths(
            tokens[last], paths, path_len, budget=self.budget, path_weight=weight
        )
        further = jnp.maximum(tree.depth - 1, 0).astype(jnp.float32)
        decay = further * jnp.log(jnp.float32(self.continue_prob))
        # padding stays -inf
        return dataclasses.replace(tree, logscore=tree.logscore + shift + decay)

    def _weights(self, match_len: Int[Array, " M"]) -> Float[Array, " M"]:
        exponent = jnp.maximum(match_len - 1, 0).astype(jnp.float32)
        weight = jnp.power(jnp.float32(self.length_weight), exponent)
        return jnp.where(match_len > 0, weight, 0.0)
