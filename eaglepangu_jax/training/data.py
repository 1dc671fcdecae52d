"""Self-distillation data for draft heads: the teacher answers synthetic prompts greedily.

Each shard holds a fixed slice of the prompt list: for every prompt, the chat-formatted prompt
ids followed by the teacher's greedy answer (plain decoding through the engine, batched), and
the teacher's tapped features (residual stream leaving ``feature_layers``) for every token of
that sequence, recomputed with one chunked teacher forward per sequence and stored as float16.

**Content addressing.** A shard's name is the sha256 of everything that determines it: the
teacher fingerprint, the shard's prompt ids, the generation settings and :data:`CODE_VERSION`.
Changing any of them makes a new name, so stale data is never read. A shard is two files,
``<key>.safetensors`` and ``<key>.json`` (the key's inputs plus the sha256 of the tensor file),
each written to a temporary file and moved into place with ``os.replace``. On read the tensor
file's hash is checked against the JSON; a missing, truncated or corrupt shard is regenerated,
a present and intact one is skipped.

Layout of one shard (``S`` sequences, ``T`` tokens in all, ``F`` layers, ``H`` hidden):
``tokens [T] int32`` (sequences concatenated), ``offsets [S + 1] int64``, ``prompt_lens [S]
int32``, ``features [T, F, H] float16``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import warnings
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from eaglepangu_jax import cache as cache_lib
from eaglepangu_jax.engine.decode import Teacher, prefill
from eaglepangu_jax.engine.plain_batch import greedy_batch
from eaglepangu_jax.files import atomic_write, sha256_file

__all__ = [
    "CODE_VERSION",
    "DataSettings",
    "Shard",
    "shard_key",
    "load_shard",
    "generate_shard",
    "save_shard",
    "build_dataset",
    "load_dataset",
    "prompts_of",
    "without_prompts",
]

# Bump when the shard contents or their computation change.
CODE_VERSION = 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataSettings:
    """Generation settings that shape the data (all hashed into the shard keys).

    Attributes:
      feature_layers: tapped teacher layers (low, mid, high).
      max_new_tokens: longest teacher answer.
      shard_size: prompts per shard (and per generation batch).
    """

    feature_layers: tuple[int, ...] = (2, 15, 27)
    max_new_tokens: int = 128
    shard_size: int = 16

    def __post_init__(self):
        if self.max_new_tokens < 1 or self.shard_size < 1:
            raise ValueError(
                f"max_new_tokens and shard_size must be >= 1, got "
                f"{self.max_new_tokens}, {self.shard_size}"
            )
        if not self.feature_layers:
            raise ValueError("feature_layers must name at least one teacher layer")


@dataclasses.dataclass(frozen=True)
class Shard:
    """One loaded shard (numpy arrays; see the module docstring for the layout)."""

    tokens: np.ndarray
    offsets: np.ndarray
    prompt_lens: np.ndarray
    features: np.ndarray

    def sequences(self):
        """Yield ``(tokens [n], features [n, F, H], prompt_len)`` per sequence."""
        for i in range(len(self.prompt_lens)):
            a, b = int(self.offsets[i]), int(self.offsets[i + 1])
            yield self.tokens[a:b], self.features[a:b], int(self.prompt_lens[i])


def shard_key(fingerprint: str, prompts: Sequence[Sequence[int]], settings: DataSettings) -> str:
    """The content address of a shard (hex sha256)."""
    blob = json.dumps(
        {
            "teacher": fingerprint,
            "prompts": [list(map(int, p)) for p in prompts],
            "settings": dataclasses.asdict(settings),
            "code_version": CODE_VERSION,
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()


def load_shard(directory: Path, key: str) -> Shard | None:
    """The shard ``key`` if present and intact (hash verified), else ``None``."""
    from safetensors.numpy import load_file

    data_path, meta_path = directory / f"{key}.safetensors", directory / f"{key}.json"
    try:
        meta = json.loads(meta_path.read_text())
        if meta.get("key") != key or sha256_file(data_path) != meta.get("sha256"):
            return None
        arrays = load_file(str(data_path))
        return Shard(
            tokens=arrays["tokens"],
            offsets=arrays["offsets"],
            prompt_lens=arrays["prompt_lens"],
            features=arrays["features"],
        )
    except (OSError, ValueError, KeyError):
        return None


def generate_shard(
    teacher: Teacher, prompts: Sequence[Sequence[int]], settings: DataSettings
) -> Shard:
    """Greedy answers for ``prompts`` (one batch) and the features of each full sequence."""
    answers = greedy_batch(teacher, [list(p) for p in prompts], settings.max_new_tokens)
    tokens, feats, prompt_lens = [], [], []
    cfg = teacher.config
    for prompt, answer in zip(prompts, answers):
        seq = np.asarray(list(prompt) + answer, np.int32)
        slots = -(-len(seq) // 64) * 64
        kv = cache_lib.init(
            cfg.num_layers, slots, cfg.num_kv_heads, cfg.head_dim, teacher.params["embed"].dtype
        )
        _, f = prefill(teacher.params, cfg, seq, kv, feature_layers=tuple(settings.feature_layers))
        tokens.append(seq)
        feats.append(np.asarray(f, np.float32).astype(np.float16))
        prompt_lens.append(len(prompt))
    offsets = np.concatenate([[0], np.cumsum([len(t) for t in tokens])]).astype(np.int64)
    return Shard(
        tokens=np.concatenate(tokens),
        offsets=offsets,
        prompt_lens=np.asarray(prompt_lens, np.int32),
        features=np.concatenate(feats, axis=0),
    )


def save_shard(directory: Path, key: str, shard: Shard, info: dict[str, Any]) -> None:
    """Write the tensors, then the JSON that vouches for them (both atomically)."""
    from safetensors.numpy import save_file

    data_path = directory / f"{key}.safetensors"
    arrays = {
        "tokens": shard.tokens,
        "offsets": shard.offsets,
        "prompt_lens": shard.prompt_lens,
        "features": shard.features,
    }
    atomic_write(data_path, lambda tmp: save_file(arrays, str(tmp)))
    meta = {"key": key, "sha256": sha256_file(data_path), **info}
    atomic_write(
        directory / f"{key}.json",
        lambda tmp: tmp.write_text(json.dumps(meta, indent=1, sort_keys=True)),
    )


def build_dataset(
    teacher: Teacher,
    prompts: Sequence[Sequence[int]],
    settings: DataSettings,
    directory: str | os.PathLike,
    *,
    fingerprint: str,
    ray_address: str | None = None,
    progress: bool = True,
) -> list[str]:
    """Make sure every shard of ``prompts`` exists; returns their keys in order.

    Args:
      teacher: the teacher that answers (its ``fingerprint`` names it in the keys).
      prompts: prompt token ids (chat-formatted).
      settings: generation settings.
      directory: shard directory.
      fingerprint: the teacher's fingerprint (sha256 of its weight file).
      ray_address: run missing shards as Ray tasks on that cluster (``"auto"``, an address);
        ignored with a warning when Ray is not installed.
      progress: show a progress bar.
    """
    directory = Path(directory)
    chunks = [
        prompts[i : i + settings.shard_size] for i in range(0, len(prompts), settings.shard_size)
    ]
    keys = [shard_key(fingerprint, chunk, settings) for chunk in chunks]
    missing = [i for i, key in enumerate(keys) if load_shard(directory, key) is None]
    if (
        missing
        and ray_address is not None
        and _run_with_ray(
            teacher, chunks, keys, missing, settings, directory, fingerprint, ray_address
        )
    ):
        missing = []
    iterator = missing
    if progress and missing:
        from tqdm.auto import tqdm

        iterator = tqdm(missing, desc="teacher shards")
    for i in iterator:
        shard = generate_shard(teacher, chunks[i], settings)
        save_shard(directory, keys[i], shard, _info(fingerprint, settings, len(chunks[i])))
    return keys


def load_dataset(directory: str | os.PathLike, keys: Sequence[str]) -> list[Shard]:
    """Load and verify shards; raises if one is missing or corrupt."""
    shards = []
    for key in keys:
        shard = load_shard(Path(directory), key)
        if shard is None:
            raise ValueError(
                f"shard {key} in {directory} is missing or corrupt; rebuild it with build_dataset"
            )
        shards.append(shard)
    return shards


def _prompts(shard: Shard) -> list[tuple[int, ...]]:
    """The prompt ids of each sequence of ``shard``, in order."""
    return [tuple(tokens[:p].tolist()) for tokens, _, p in shard.sequences()]


def prompts_of(shards: Sequence[Shard]) -> set[tuple[int, ...]]:
    """The prompt ids of every sequence of ``shards``."""
    return {prompt for shard in shards for prompt in _prompts(shard)}


def without_prompts(
    shards: Sequence[Shard], prompts: set[tuple[int, ...]]
) -> tuple[list[Shard], int]:
    """``shards`` less the sequences whose prompt ids are in ``prompts``, and how many went.

    Corpora made apart can share prompts (the synthesised ones draw on the same template and
    code pools), so a prompt held out in one corpus may sit in another's training split; held
    out must mean unseen, or model selection reads a flattered score. A shard that loses
    nothing is returned as it is (no copy of its features).
    """
    kept_shards, dropped = [], 0
    for shard in shards:
        keep = [i for i, prompt in enumerate(_prompts(shard)) if prompt not in prompts]
        dropped += len(shard.prompt_lens) - len(keep)
        if len(keep) == len(shard.prompt_lens):
            kept_shards.append(shard)
        elif keep:
            spans = [(int(shard.offsets[i]), int(shard.offsets[i + 1])) for i in keep]
            lengths = np.array([b - a for a, b in spans], dtype=np.int64)
            kept_shards.append(
                Shard(
                    tokens=np.concatenate([shard.tokens[a:b] for a, b in spans]),
                    offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(shard.offsets.dtype),
                    prompt_lens=shard.prompt_lens[keep],
                    features=np.concatenate([shard.features[a:b] for a, b in spans]),
                )
            )
    return kept_shards, dropped


def _info(fingerprint: str, settings: DataSettings, n: int) -> dict[str, Any]:
    return {
        "teacher": fingerprint,
        "settings": dataclasses.asdict(settings),
        "code_version": CODE_VERSION,
        "num_sequences": n,
    }


def _run_with_ray(
    teacher, chunks, keys, missing, settings, directory, fingerprint, address
) -> bool:
    """Generate the missing shards as Ray tasks; False when Ray is unavailable."""
    try:
        import ray
    except ImportError:
        warnings.warn(
            "ray_address given but Ray is not installed; generating locally", stacklevel=2
        )
        return False
    ray.init(address=address, ignore_reinit_error=True)
    params_ref = ray.put(teacher)

    @ray.remote
    def task(t, chunk, key):
        save_shard(
            directory,
            key,
            generate_shard(t, chunk, settings),
            _info(fingerprint, settings, len(chunk)),
        )
        return key

    ray.get([task.remote(params_ref, chunks[i], keys[i]) for i in missing])
    return True
