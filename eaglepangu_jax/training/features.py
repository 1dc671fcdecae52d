"""Teacher features of corpus sequences, recomputed from the ids and cached by content.

The corpus stores ids only (a few megabytes); the features a draft head trains on (the residual
stream leaving the tapped layers, ``[T, F, H]``) are about 3.5 kB per token in float16, so a
million tokens are gigabytes: made on demand, never committed. They are computed by batched
prefill: sequences are sorted by length, grouped ``batch_size`` at a time, padded to a multiple
of :data:`LENGTH_BUCKET` (one compilation per bucket, not per length) and run through one
vmapped causal forward. Padding sits after every real token, so it changes no real feature.

The cache entry of a corpus shard is a :class:`~eaglepangu_jax.training.data.Shard` keyed by
the sha256 of (the corpus shard's own sha256, the teacher fingerprint, the tapped layers,
:data:`FEATURES_VERSION`), written and verified by :mod:`eaglepangu_jax.training.data`.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
from pathlib import Path
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from eaglepangu_jax.models import llama
from eaglepangu_jax.models.config import LlamaConfig
from eaglepangu_jax.training import data as data_lib
from eaglepangu_jax.training.corpus import CorpusShard

__all__ = [
    "FEATURES_VERSION",
    "LENGTH_BUCKET",
    "sequence_features",
    "features_key",
    "shard_features",
]

FEATURES_VERSION = 1
LENGTH_BUCKET = 64


@functools.partial(jax.jit, static_argnames=("config", "feature_layers"))
def _batch_features(
    params: dict, tokens: Int[Array, "B L"], *, config: LlamaConfig, feature_layers: tuple[int, ...]
) -> Float[Array, "B L F H"]:
    def one(seq):
        return llama.forward_sequence(params, seq, config=config, feature_layers=feature_layers)[1]

    return jax.vmap(one)(tokens)


def sequence_features(
    teacher,
    sequences: Sequence[Sequence[int]],
    feature_layers: Sequence[int],
    *,
    batch_size: int = 8,
) -> list[np.ndarray]:
    """``[len(seq), F, H]`` float16 features of every sequence, in the given order."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    layers = tuple(int(x) for x in feature_layers)
    cfg = teacher.config
    for seq in sequences:
        if len(seq) > cfg.max_position:
            raise ValueError(
                f"a sequence of {len(seq)} tokens is longer than the teacher's context "
                f"{cfg.max_position}"
            )
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
    out: list[np.ndarray | None] = [None] * len(sequences)
    for begin in range(0, len(order), batch_size):
        group = order[begin : begin + batch_size]
        longest = max(len(sequences[i]) for i in group)
        length = max(-(-longest // LENGTH_BUCKET) * LENGTH_BUCKET, LENGTH_BUCKET)
        tokens = np.zeros((batch_size, length), np.int32)  # a fixed batch: one compile per L
        for row, i in enumerate(group):
            tokens[row, : len(sequences[i])] = sequences[i]
        feats = _batch_features(
            teacher.params, jnp.asarray(tokens), config=cfg, feature_layers=layers
        )
        feats = np.asarray(feats, np.float32).astype(np.float16)
        for row, i in enumerate(group):
            out[i] = feats[row, : len(sequences[i])]
    return out  # type: ignore[return-value]


def features_key(shard_sha256: str, fingerprint: str, feature_layers: Sequence[int]) -> str:
    """The cache key of a corpus shard's features."""
    blob = json.dumps(
        {
            "corpus_shard": shard_sha256,
            "teacher": fingerprint,
            "feature_layers": [int(x) for x in feature_layers],
            "version": FEATURES_VERSION,
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()


def shard_features(
    teacher,
    shard: CorpusShard,
    shard_sha256: str,
    feature_layers: Sequence[int],
    cache_dir: str | os.PathLike,
    *,
    fingerprint: str,
    batch_size: int = 8,
) -> data_lib.Shard:
    """The training shard (ids + features) of a corpus shard, from the cache or computed and
    cached (atomically; a corrupt entry is recomputed). With no ``feature_layers`` (a drafter
    that reads tokens only) the features are empty and nothing runs or is cached."""
    if not feature_layers:
        return _ids_only(shard, teacher.config.hidden_size)
    cache_dir = Path(cache_dir)
    key = features_key(shard_sha256, fingerprint, feature_layers)
    cached = data_lib.load_shard(cache_dir, key)
    if cached is not None:
        return cached
    sequences = [p + a for p, a in zip(shard.prompts(), shard.answers())]
    feats = sequence_features(teacher, sequences, feature_layers, batch_size=batch_size)
    out = dataclasses.replace(
        _ids_only(shard, teacher.config.hidden_size), features=np.concatenate(feats, axis=0)
    )
    cache_dir.mkdir(parents=True, exist_ok=True)
    data_lib.save_shard(
        cache_dir,
        key,
        out,
        {"corpus_shard": shard_sha256, "teacher": fingerprint, "version": FEATURES_VERSION},
    )
    return out


def _ids_only(shard: CorpusShard, hidden_size: int) -> data_lib.Shard:
    """The shard's prompt + answer ids as a training shard with empty ``[N, 0, H]`` features."""
    prompts, answers = shard.prompts(), shard.answers()
    sequences = [p + a for p, a in zip(prompts, answers)]
    offsets = np.zeros(len(sequences) + 1, np.int64)
    offsets[1:] = np.cumsum([len(s) for s in sequences])
    return data_lib.Shard(
        tokens=np.concatenate([np.asarray(s, np.int32) for s in sequences]),
        offsets=offsets,
        prompt_lens=np.asarray([len(p) for p in prompts], np.int32),
        features=np.zeros((int(offsets[-1]), 0, hidden_size), np.float16),
    )
