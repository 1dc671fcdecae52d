"""On-disk cache of dequantized weights, keyed by the sha256 of the source model file.

Layout of the cache directory (``$EAGLEPANGU_CACHE``, else ``~/.cache/eaglepangu``)::

    file-hashes.json                   # {resolved path: {size, mtime_ns, sha256}}
    weights/<sha256>-v<N>.safetensors  # float32 tensors, flat names ("layers.wq")
    weights/<sha256>-v<N>.json         # sidecar: payload sha256 + byte size + metadata
    <kind>/<sha256>-v<N>.json          # small JSON-able data (tokenizer metadata), checksummed

The sidecar is written after the payload, so its presence marks a complete entry. On every
load the payload is hashed (about 0.4 s for SmolLM2) and compared with the sidecar: a corrupt,
truncated or mismatching entry is deleted and rebuilt, never trusted. All files are written to
a temporary name in the same directory and moved into place with ``os.replace``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np
import safetensors.numpy

from eaglepangu_jax.files import atomic_write, sha256_file, write_json_atomic

__all__ = [
    "CACHE_ENV_VAR",
    "FORMAT_VERSION",
    "resolve_cache_dir",
    "sha256_file",
    "file_sha256",
    "load_or_build",
    "load_or_build_json",
    "entry_paths",
]

log = logging.getLogger(__name__)

CACHE_ENV_VAR = "EAGLEPANGU_CACHE"
# Bump when the conversion (names, layout, rope order) changes: old entries are then ignored.
FORMAT_VERSION = 1
_HASH_INDEX = "file-hashes.json"
_CHUNK = 1 << 22

Arrays = dict[str, np.ndarray]
Builder = Callable[[], tuple[Mapping[str, Any], Mapping[str, np.ndarray]]]


def resolve_cache_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """``cache_dir`` if given, else ``$EAGLEPANGU_CACHE``, else ``~/.cache/eaglepangu``."""
    if cache_dir is None:
        cache_dir = os.environ.get(CACHE_ENV_VAR) or Path.home() / ".cache" / "eaglepangu"
    return Path(cache_dir).expanduser()


def _read_json(path: Path) -> Any:
    """Parsed JSON, or None when the file is missing or unreadable."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def file_sha256(path: str | os.PathLike, *, cache_dir: str | os.PathLike | None = None) -> str:
    """sha256 of ``path``, memoised in the cache directory by (resolved path, size, mtime).

    A file rewritten in place changes its mtime or size, so the memo is re-keyed; hashing
    is only repeated for files that changed.
    """
    path = Path(path).resolve()
    stat = path.stat()
    key = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    index_path = resolve_cache_dir(cache_dir) / _HASH_INDEX
    index = _read_json(index_path)
    if not isinstance(index, dict):
        index = {}
    entry = index.get(str(path))
    if (
        isinstance(entry, dict)
        and {k: entry.get(k) for k in key} == key
        and isinstance(entry.get("sha256"), str)
    ):
        return entry["sha256"]
    digest = sha256_file(path)
    # Re-read just before writing to lose as little as possible of a concurrent writer's work.
    latest = _read_json(index_path)
    index = latest if isinstance(latest, dict) else {}
    index[str(path)] = {**key, "sha256": digest}
    try:
        write_json_atomic(index_path, index)
    except OSError as err:  # a read-only cache only costs a rehash next time
        log.warning("could not record the hash of %s in %s: %s", path, index_path, err)
    return digest


def entry_paths(
    source_sha256: str, cache_dir: str | os.PathLike | None = None
) -> tuple[Path, Path]:
    """(payload, sidecar) paths of the cache entry for a source file hash."""
    stem = resolve_cache_dir(cache_dir) / "weights" / f"{source_sha256}-v{FORMAT_VERSION}"
    return stem.with_suffix(".safetensors"), stem.with_suffix(".json")


def _load_entry(
    payload: Path, sidecar: Path, source_sha256: str
) -> tuple[dict[str, Any], Arrays] | None:
    """The cached (metadata, arrays), or None after deleting an entry that fails a check."""
    meta = _read_json(sidecar)
    if meta is None:
        if payload.exists():  # payload without sidecar: an interrupted write
            _discard(payload, sidecar, "no readable sidecar")
        return None
    problem = None
    if (
        not isinstance(meta, dict)
        or meta.get("format_version") != FORMAT_VERSION
        or meta.get("source_sha256") != source_sha256
        or not isinstance(meta.get("metadata"), dict)
    ):
        problem = "sidecar does not describe this source file"
    else:
        try:
            data = payload.read_bytes()
        except OSError as err:
            data, problem = b"", f"payload unreadable: {err}"
        if problem is None and len(data) != meta.get("payload_bytes"):
            problem = f"payload has {len(data)} bytes, sidecar says {meta.get('payload_bytes')}"
        elif problem is None and hashlib.sha256(data).hexdigest() != meta.get("payload_sha256"):
            problem = "payload sha256 does not match the sidecar"
        if problem is None:
            try:
                arrays = safetensors.numpy.load(data)
            except Exception as err:  # hash matched but the content does not parse
                problem = f"payload does not parse: {err}"
            else:
                return meta["metadata"], arrays
    _discard(payload, sidecar, problem)
    return None


def _discard(payload: Path, sidecar: Path, problem: str) -> None:
    log.warning("discarding weights cache entry %s: %s", payload, problem)
    sidecar.unlink(missing_ok=True)
    payload.unlink(missing_ok=True)


def _store_entry(
    payload: Path,
    sidecar: Path,
    source_sha256: str,
    metadata: Mapping[str, Any],
    arrays: Mapping[str, np.ndarray],
) -> None:
    contiguous = {name: np.ascontiguousarray(a, dtype=np.float32) for name, a in arrays.items()}
    atomic_write(payload, lambda tmp: safetensors.numpy.save_file(contiguous, str(tmp)))
    write_json_atomic(
        sidecar,
        {
            "format_version": FORMAT_VERSION,
            "source_sha256": source_sha256,
            "payload_sha256": sha256_file(payload),
            "payload_bytes": payload.stat().st_size,
            "metadata": dict(metadata),
        },
    )


def load_or_build(
    source: str | os.PathLike, build: Builder, *, cache_dir: str | os.PathLike | None = None
) -> tuple[dict[str, Any], Arrays]:
    """Cached ``build()`` result for the model file ``source``.

    Args:
      source: the model file the arrays are derived from; its sha256 keys the entry.
      build: returns ``(metadata, arrays)``: JSON-able metadata and float32 arrays by name.
        Called only on a miss (or after a bad entry was discarded).
      cache_dir: see :func:`resolve_cache_dir`.

    Returns:
      ``(metadata, arrays)``, from the cache when a valid entry exists. A failure to write
      the cache is logged, not raised: the freshly built result is returned regardless.
    """
    source_sha256 = file_sha256(source, cache_dir=cache_dir)
    payload, sidecar = entry_paths(source_sha256, cache_dir)
    cached = _load_entry(payload, sidecar, source_sha256)
    if cached is not None:
        return cached
    metadata, arrays = build()
    try:
        _store_entry(payload, sidecar, source_sha256, metadata, arrays)
    except OSError as err:
        log.warning("could not write weights cache entry %s: %s", payload, err)
    return dict(metadata), dict(arrays)


def _canonical_sha256(payload: Any) -> str:
    text = json.dumps(payload, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def load_or_build_json(
    source: str | os.PathLike,
    kind: str,
    build: Callable[[], Any],
    *,
    cache_dir: str | os.PathLike | None = None,
) -> Any:
    """Cached ``build()`` (a JSON-able value derived from ``source``), checksummed like weights.

    Args:
      source: the model file; its sha256 keys the entry.
      kind: a short name for what is cached (a subdirectory: ``"tokenizer"``).
      build: computes the value on a miss.
      cache_dir: see :func:`resolve_cache_dir`.
    """
    if not kind.isidentifier():
        raise ValueError(f"cache kind {kind!r} must be a plain identifier")
    source_sha256 = file_sha256(source, cache_dir=cache_dir)
    path = resolve_cache_dir(cache_dir) / kind / f"{source_sha256}-v{FORMAT_VERSION}.json"
    entry = _read_json(path)
    if entry is not None:
        if (
            isinstance(entry, dict)
            and entry.get("format_version") == FORMAT_VERSION
            and entry.get("source_sha256") == source_sha256
            and "payload" in entry
            and entry.get("payload_sha256") == _canonical_sha256(entry["payload"])
        ):
            return entry["payload"]
        log.warning("discarding cache entry %s: checksum or header mismatch", path)
        path.unlink(missing_ok=True)
    elif path.exists():
        log.warning("discarding unreadable cache entry %s", path)
        path.unlink(missing_ok=True)
    payload = build()
    try:
        write_json_atomic(
            path,
            {
                "format_version": FORMAT_VERSION,
                "source_sha256": source_sha256,
                "payload_sha256": _canonical_sha256(payload),
                "payload": payload,
            },
        )
    except OSError as err:
        log.warning("could not write cache entry %s: %s", path, err)
    return payload
