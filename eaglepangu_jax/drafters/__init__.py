"""Drafters: what proposes the tree each round.

* :class:`NGramDrafter`: training-free retrieval from the context (prompt lookup).
* :class:`CorpusNGramDrafter`: the same plus one continuation from an n-gram table counted
  over the teacher's corpus (:mod:`~eaglepangu_jax.drafters.ngram_table`; shipped table).
* :class:`Eagle3Drafter`: the EAGLE-3 head on the teacher's features (trained, shipped).
* :class:`BlockDrafter`: a DFlash-style block drafter, per-depth marginals in one pass
  (trained, shipped).
* :class:`DraftTargetDrafter`: an independent draft LM with its own KV cache (draft-target
  speculation); :func:`truncated_teacher` makes a training-free draft, :func:`load_draft_target`
  the real teacher's, :func:`load_shipped_draft_distilled` the shipped distilled draft model
  (:class:`DraftModelConfig`).
* :class:`FallbackDrafter`: one drafter's tree when it has one, another's otherwise (the
  ``ngram-eagle3`` method: n-gram's tree, and the EAGLE-3 head's node where n-gram has no
  match or room left).

:mod:`~eaglepangu_jax.drafters.registry` lists them by name;
:mod:`~eaglepangu_jax.drafters.checkpoint` reads and writes trained heads.
"""

from eaglepangu_jax.drafters.block import BlockDrafter, load_shipped_block
from eaglepangu_jax.drafters.checkpoint import load_checkpoint, load_starting_head, save_checkpoint
from eaglepangu_jax.drafters.draft_distilled import load_shipped_draft_distilled
from eaglepangu_jax.drafters.draft_target import (
    DraftTargetDrafter,
    load_draft_target,
    truncated_teacher,
)
from eaglepangu_jax.drafters.draft_target_model import DraftModelConfig
from eaglepangu_jax.drafters.eagle3 import Eagle3Drafter, load_shipped_eagle3
from eaglepangu_jax.drafters.fallback import FallbackDrafter
from eaglepangu_jax.drafters.ngram import NGramDrafter
from eaglepangu_jax.drafters.ngram_corpus import CorpusNGramDrafter, load_shipped_ngram_corpus
from eaglepangu_jax.drafters.registry import (
    DRAFTERS,
    NAMES,
    DrafterUnavailableError,
    configure_drafter,
    load_shipped,
    make_drafter,
)

__all__ = [
    "DRAFTERS",
    "NAMES",
    "BlockDrafter",
    "CorpusNGramDrafter",
    "DrafterUnavailableError",
    "DraftModelConfig",
    "DraftTargetDrafter",
    "Eagle3Drafter",
    "FallbackDrafter",
    "NGramDrafter",
    "configure_drafter",
    "load_checkpoint",
    "load_draft_target",
    "load_shipped",
    "load_shipped_block",
    "load_shipped_draft_distilled",
    "load_shipped_eagle3",
    "load_shipped_ngram_corpus",
    "load_starting_head",
    "make_drafter",
    "save_checkpoint",
    "truncated_teacher",
]
