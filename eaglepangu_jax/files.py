"""Atomic file writes: the one writer every cache, checkpoint, report and trace goes through.

A reader never sees a half-written file: the content goes to a uniquely named temporary file
beside the target and is moved into place with ``os.replace`` (atomic on POSIX and Windows
within one folder). A failed write leaves the old file, if any, untouched.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from pathlib import Path
from typing import Any, Callable

__all__ = ["atomic_write", "write_text_atomic", "write_json_atomic", "sha256_file"]

_CHUNK = 1 << 20


def atomic_write(path: str | os.PathLike, write: Callable[[Path], None]) -> Path:
    """Call ``write(tmp)`` on a temporary file beside ``path``, then move it into place.

    The file is made world-readable (``0644``): some writers create private files, and these
    are shared data (caches, reports). Returns ``path`` as a :class:`~pathlib.Path`.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # A unique name per writer (not mkstemp, whose 0600 mode would ignore the umask).
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp")
    try:
        write(tmp)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically."""
    return atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def write_json_atomic(path: str | os.PathLike, data: Any) -> Path:
    """Write ``data`` as indented, key-sorted JSON to ``path`` atomically."""
    return write_text_atomic(path, json.dumps(data, indent=1, sort_keys=True))


def sha256_file(path: str | os.PathLike) -> str:
    """Hex sha256 of a file's bytes, read in chunks (constant memory)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()
