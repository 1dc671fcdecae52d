"""Count the corpus n-gram table the ``ngram-corpus`` drafter ships with.

Reads the teacher's answers of the training split of one or more corpus folders (the
held-out shards stay out, as for the trained heads), counts them with
:func:`eaglepangu_jax.drafters.ngram_table.count_table` and writes the table with its
provenance (corpora, shard hashes, token counts, the teacher) beside the other packaged
weights.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

from eaglepangu_jax.drafters import ngram_table
from eaglepangu_jax.drafters.ngram_corpus import save_counted

__all__ = ["DEFAULT_MAX_ORDER", "training_answers", "build_table_file"]

# The packaged table counts contexts of up to three tokens: four and five (the drafter reads
# up to ngram_table.MAX_ORDER) did not draft faster on the dev suite (docs/RESULTS.md).
DEFAULT_MAX_ORDER = 3


def training_answers(
    directory: str | os.PathLike, fingerprint: str
) -> tuple[list[list[int]], dict]:
    """The answers of ``directory``'s training shards and a provenance record.

    Raises:
      ValueError: no corpus manifest, a corpus answered by another teacher, or a training
        shard missing or corrupt.
    """
    from eaglepangu_jax.training import corpus as corpus_lib
    from eaglepangu_jax.training import distill

    manifest = distill.read_manifest(directory)
    if manifest.get("teacher") != fingerprint:
        raise ValueError(
            f"the corpus in {directory} was answered by another teacher "
            f"({str(manifest.get('teacher'))[:12]}, installed {fingerprint[:12]})"
        )
    answers, hashes = [], []
    for entry in manifest["shards"]:
        if entry["split"] != "train":
            continue
        shard = corpus_lib.load_corpus_shard(Path(directory) / "answers", entry["key"])
        if shard is None:
            raise ValueError(f"corpus shard {entry['key']} in {directory} is missing or corrupt")
        answers += shard.answers()
        hashes.append(entry["sha256"])
    record = {
        "corpus": Path(directory).name,
        "train_shards": len(hashes),
        "answer_tokens": sum(map(len, answers)),
        "shard_sha256": hashes,
    }
    return answers, record


def build_table_file(
    directories: Sequence[str | os.PathLike],
    out: str,
    *,
    fingerprint: str,
    min_count: int = 2,
    max_order: int = DEFAULT_MAX_ORDER,
    prune: bool = False,
) -> dict:
    """Count the training answers of ``directories`` and write the table to ``out``
    (``out.safetensors`` + ``out.json``, atomically); returns the JSON's provenance part.
    ``prune``: leave out the rows the lookup does not need
    (:func:`~eaglepangu_jax.drafters.ngram_table.prune_redundant`)."""
    answers, sources = [], []
    for directory in directories:
        got, record = training_answers(directory, fingerprint)
        answers += got
        sources.append(record)
    counted = ngram_table.count_table(answers, min_count=min_count, max_order=max_order)
    counted_rows = len(counted)
    if prune:
        counted = ngram_table.prune_redundant(counted)
    rows_per_order = {str(k): int((counted.order == k).sum()) for k in range(1, max_order + 1)}
    meta = {
        "teacher": fingerprint,
        "max_order": max_order,
        "min_count": min_count,
        "counted_rows": counted_rows,
        "pruned_rows": counted_rows - len(counted),
        "rows_per_order": rows_per_order,
        "answer_tokens": sum(r["answer_tokens"] for r in sources),
        "corpora": sources,
    }
    save_counted(out, counted, meta)
    return {"rows": len(counted), **meta}
