"""The self-distilled corpus: token ids only, in shards, content-addressed and resumable.

A **shard** holds ``S`` conversations: the chat-formatted prompt ids and the teacher's greedy
answer ids, each concatenated with ``int64`` offsets, ids stored as ``uint16`` (the teacher's
vocabulary has 49,152 ids). It is two files, ``<key>.safetensors`` and ``<key>.json`` (the
inputs of the key plus the sha256 of the tensor file), both written atomically; on read the
hash is checked, and a missing or corrupt shard is regenerated while an intact one is skipped.
The key is the sha256 of everything that determines the shard (teacher fingerprint, prompt ids,
settings, :data:`CORPUS_VERSION`), so a changed input makes a new shard, never a stale read.

The same format stores the *synthesis batches* of :mod:`eaglepangu_jax.training.synth`: the
"prompt" is the pre-query template, the "answers" are the sampled user turns.

Answer shards are generated batched (one
:func:`~eaglepangu_jax.engine.plain_batch.greedy_batch` call of ``shard_size`` prompts), locally
or as Ray tasks (:func:`build_shards` with ``ray_address``); the bytes do not depend
on where a shard was made. Teacher features are never stored here: :func:`shard_features`
recomputes them from the ids by batched prefill and caches them by content
(:mod:`eaglepangu_jax.training.data`'s :class:`~eaglepangu_jax.training.data.Shard`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from eaglepangu_jax.files import atomic_write, sha256_file

__all__ = [
    "CORPUS_VERSION",
    "CorpusSettings",
    "CorpusShard",
    "corpus_key",
    "pack",
    "save_corpus_shard",
    "load_corpus_shard",
    "answer_prompts",
    "build_shards",
]

CORPUS_VERSION = 1
_ID_LIMIT = 1 << 16  # ids are stored as uint16


@dataclasses.dataclass(frozen=True, kw_only=True)
class CorpusSettings:
    """How answers are generated (hashed into the answer shards' keys).

    Attributes:
      max_new_tokens: longest teacher answer.
      shard_size: prompts per shard, answered in one batch.
    """

    max_new_tokens: int = 256
    shard_size: int = 64

    def __post_init__(self):
        if self.max_new_tokens < 1 or self.shard_size < 1:
            raise ValueError(
                f"max_new_tokens and shard_size must be >= 1, got {self.max_new_tokens}, "
                f"{self.shard_size}"
            )


@dataclasses.dataclass(frozen=True)
class CorpusShard:
    """Prompt and answer ids of ``S`` conversations (numpy; see the module docstring)."""

    prompt_ids: np.ndarray  # [P] uint16
    prompt_offsets: np.ndarray  # [S + 1] int64
    answer_ids: np.ndarray  # [A] uint16
    answer_offsets: np.ndarray  # [S + 1] int64

    def __len__(self) -> int:
        return len(self.prompt_offsets) - 1

    def prompts(self) -> list[list[int]]:
        return _split(self.prompt_ids, self.prompt_offsets)

    def answers(self) -> list[list[int]]:
        return _split(self.answer_ids, self.answer_offsets)

    @property
    def answer_tokens(self) -> int:
        return int(self.answer_offsets[-1])

    @property
    def prompt_tokens(self) -> int:
        return int(self.prompt_offsets[-1])


def _split(ids: np.ndarray, offsets: np.ndarray) -> list[list[int]]:
    return [ids[a:b].astype(np.int64).tolist() for a, b in zip(offsets[:-1], offsets[1:])]


def pack(prompts: Sequence[Sequence[int]], answers: Sequence[Sequence[int]]) -> CorpusShard:
    """A shard from id lists.

    Raises:
      ValueError: different numbers of prompts and answers, or an id outside ``[0, 65536)``.
    """
    if len(prompts) != len(answers):
        raise ValueError(f"{len(prompts)} prompts but {len(answers)} answers")

    def flat(seqs):
        offsets = np.zeros(len(seqs) + 1, np.int64)
        offsets[1:] = np.cumsum([len(s) for s in seqs])
        ids = np.fromiter((t for s in seqs for t in s), np.int64, count=int(offsets[-1]))
        if ids.size and (ids.min() < 0 or ids.max() >= _ID_LIMIT):
            raise ValueError(f"token ids must lie in [0, {_ID_LIMIT}) to be stored as uint16")
        return ids.astype(np.uint16), offsets

    p, po = flat(prompts)
    a, ao = flat(answers)
    return CorpusShard(prompt_ids=p, prompt_offsets=po, answer_ids=a, answer_offsets=ao)


def corpus_key(kind: str, fingerprint: str, prompts: Sequence[Sequence[int]], settings: Any) -> str:
    """The content address (hex sha256) of a shard of ``kind`` (``"answers"``,
    ``"user-turns"``) made by the teacher ``fingerprint`` from ``prompts`` under ``settings``
    (a dataclass or a JSON-able dict)."""
    if dataclasses.is_dataclass(settings):
        settings = dataclasses.asdict(settings)
    blob = json.dumps(
        {
            "kind": kind,
            "teacher": fingerprint,
            "prompts": [list(map(int, p)) for p in prompts],
            "settings": settings,
            "version": CORPUS_VERSION,
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()


def save_corpus_shard(
    directory: str | os.PathLike, key: str, shard: CorpusShard, info: dict[str, Any]
) -> dict[str, Any]:
    """Write the tensors, then the JSON that vouches for them (both atomically); returns the
    JSON's contents. ``info`` must be JSON-able and deterministic (no times, no host names):
    the same shard is the same bytes wherever it was made."""
    from safetensors.numpy import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    arrays = {
        "prompt_ids": shard.prompt_ids,
        "prompt_offsets": shard.prompt_offsets,
        "answer_ids": shard.answer_ids,
        "answer_offsets": shard.answer_offsets,
    }
    data_path = directory / f"{key}.safetensors"
    atomic_write(data_path, lambda tmp: save_file(arrays, str(tmp)))
    meta = {
        "key": key,
        "sha256": sha256_file(data_path),
        "sequences": len(shard),
        "prompt_tokens": shard.prompt_tokens,
        "answer_tokens": shard.answer_tokens,
        **info,
    }
    text = json.dumps(meta, indent=1, sort_keys=True) + "\n"
    atomic_write(directory / f"{key}.json", lambda tmp: tmp.write_text(text))
    return meta


def load_corpus_shard(directory: str | os.PathLike, key: str) -> CorpusShard | None:
    """The shard ``key`` if present and intact (hash and shapes checked), else ``None``."""
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    directory = Path(directory)
    data_path, meta_path = directory / f"{key}.safetensors", directory / f"{key}.json"
    try:
        meta = json.loads(meta_path.read_text())
        if meta.get("key") != key or sha256_file(data_path) != meta.get("sha256"):
            return None
        arrays = load_file(str(data_path))
        shard = CorpusShard(
            prompt_ids=arrays["prompt_ids"],
            prompt_offsets=arrays["prompt_offsets"],
            answer_ids=arrays["answer_ids"],
            answer_offsets=arrays["answer_offsets"],
        )
    except (OSError, ValueError, KeyError, SafetensorError):
        return None
    consistent = (
        shard.prompt_ids.dtype == np.uint16
        and shard.answer_ids.dtype == np.uint16
        and len(shard.prompt_offsets) == len(shard.answer_offsets) >= 1
        and shard.prompt_offsets[-1] == len(shard.prompt_ids)
        and shard.answer_offsets[-1] == len(shard.answer_ids)
        and bool(np.all(np.diff(shard.prompt_offsets) >= 0))
        and bool(np.all(np.diff(shard.answer_offsets) >= 0))
    )
    return shard if consistent else None


def answer_prompts(
    teacher, prompts: Sequence[Sequence[int]], settings: CorpusSettings
) -> CorpusShard:
    """The teacher's greedy answers to ``prompts``, decoded as one batch (eos kept)."""
    from eaglepangu_jax.engine.plain_batch import greedy_batch

    return pack(prompts, greedy_batch(teacher, [list(p) for p in prompts], settings.max_new_tokens))


def build_shards(
    teacher,
    chunks: Sequence[Sequence[Sequence[int]]],
    settings: CorpusSettings,
    directory: str | os.PathLike,
    *,
    fingerprint: str,
    ray_address: str | None = None,
    on_shard: Callable[[int, dict[str, Any]], None] | None = None,
) -> list[str]:
    """Make sure the answer shard of every prompt chunk exists; returns their keys in order.

    Missing shards are generated in order (so a killed run resumes after its last complete
    shard), or, with ``ray_address`` (``"local"`` for a local instance, ``"auto"``, or a
    cluster address), as Ray tasks. ``on_shard(index, meta)`` is called after each new shard.

    Raises:
      ImportError: ``ray_address`` given but Ray is not installed (the ``ray`` extra).
    """
    directory = Path(directory)
    keys = [corpus_key("answers", fingerprint, chunk, settings) for chunk in chunks]
    missing = [i for i, key in enumerate(keys) if load_corpus_shard(directory, key) is None]
    info = {"kind": "answers", "teacher": fingerprint, "settings": dataclasses.asdict(settings)}
    if ray_address is not None and missing:
        _build_with_ray(
            teacher, chunks, keys, missing, settings, directory, info, ray_address, on_shard
        )
        return keys
    for i in missing:
        meta = save_corpus_shard(
            directory, keys[i], answer_prompts(teacher, chunks[i], settings), info
        )
        if on_shard is not None:
            on_shard(i, meta)
    return keys


def _answer_task(teacher, chunk, settings, directory, key, info):
    return save_corpus_shard(directory, key, answer_prompts(teacher, chunk, settings), info)


def _build_with_ray(teacher, chunks, keys, missing, settings, directory, info, address, on_shard):
    try:
        import ray
    except ImportError as err:
        raise ImportError(
            "ray_address was given but Ray is not installed; install the 'ray' extra "
            "(pip install 'eaglepangu[ray]')"
        ) from err
    started_here = not ray.is_initialized()
    if started_here:
        ray.init(address=None if address == "local" else address, include_dashboard=False)
    try:
        task = ray.remote(_answer_task)
        teacher_ref = ray.put(teacher)
        pending = {
            task.remote(teacher_ref, chunks[i], settings, str(directory), keys[i], info): i
            for i in missing
        }
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1)
            i = pending.pop(done[0])
            meta = ray.get(done[0])
            if on_shard is not None:
                on_shard(i, meta)
    finally:
        if started_here:
            ray.shutdown()
