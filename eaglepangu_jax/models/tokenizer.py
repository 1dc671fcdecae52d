"""Byte-level BPE tokenizer rebuilt from a GGUF's ``tokenizer.ggml.*`` metadata.

The GGUF carries the vocabulary, the merges, a type per token and the special ids, but no
``tokenizer.json``. We rebuild the same tokenizer ``transformers`` builds from the file for a
``gpt2``-model vocabulary: a BPE over the GPT-2 byte alphabet, the GPT-2 split regex with no
prefix space, and the tokens marked CONTROL matched whole in the text as special tokens.

Decoding goes through bytes (each token id maps to the bytes it stands for), so that
:class:`IncrementalDecoder` can stream text without ever cutting a UTF-8 character.
"""

from __future__ import annotations

import codecs
import functools
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, decoders, models, pre_tokenizers

from eaglepangu_jax.models import gguf_loader, weights_cache
from eaglepangu_jax.models.smollm2 import find_smollm2_gguf

__all__ = [
    "Tokenizer",
    "IncrementalDecoder",
    "load_tokenizer",
    "read_tokenizer_metadata",
    "byte_alphabet",
    "TOKEN_TYPE_CONTROL",
    "TOKEN_TYPE_USER_DEFINED",
]

# llama.cpp token types (tokenizer.ggml.token_type).
TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4


@functools.cache
def byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map.

    Bytes that are printable and not whitespace (``!``..``~``, ``¡``..``¬``, ``®``..``ÿ``) stand
    for themselves; the other 68 are shifted to code points 256, 257, ... in byte order, so every
    token is a printable string (a space is ``Ġ``, a newline ``Ċ``).
    """
    keep = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table = {b: chr(b) for b in keep}
    shifted = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + shifted)
            shifted += 1
    return table


def _spell(token: str) -> str:
    """A vocabulary entry in the byte alphabet (entries stored as raw text are re-spelled)."""
    if set(token) <= _alphabet_chars():
        return token
    alphabet = byte_alphabet()
    return "".join(alphabet[b] for b in token.encode("utf-8"))


@functools.cache
def _alphabet_chars() -> frozenset[str]:
    return frozenset(byte_alphabet().values())


@functools.cache
def _unspell_table() -> dict[str, int]:
    return {ch: b for b, ch in byte_alphabet().items()}


class Tokenizer:
    """Encode text to ids and ids to text for a GGUF byte-level BPE vocabulary.

    Build with :meth:`from_gguf` or :func:`load_tokenizer`; the constructor takes the raw
    metadata (useful for tests).

    Attributes:
      vocab_size: number of ids.
      bos_id, eos_id: special ids from the file; bos_token, eos_token: their text.
      special_ids: ids of CONTROL tokens (``<|im_start|>``, ``<|endoftext|>``...).
      chat_template: the file's Jinja chat template, or None.
    """

    def __init__(
        self,
        *,
        tokens: Sequence[str],
        merges: Sequence[str],
        token_types: Sequence[int] | None = None,
        bos_id: int,
        eos_id: int,
        chat_template: str | None = None,
    ):
        n = len(tokens)
        if token_types is not None and len(token_types) != n:
            raise ValueError(f"{len(token_types)} token types for {n} tokens")
        for name, value in (("bos_id", bos_id), ("eos_id", eos_id)):
            if not 0 <= value < n:
                raise ValueError(f"{name}={value} is outside the vocabulary of {n} tokens")
        types = list(token_types) if token_types is not None else [TOKEN_TYPE_NORMAL] * n
        spelled = [_spell(t) for t in tokens]
        vocab = {t: i for i, t in enumerate(spelled)}
        if len(vocab) != n:
            raise ValueError("the token list holds duplicate entries")
        pairs = []
        for merge in merges:
            parts = merge.split(" ")
            if len(parts) != 2:
                raise ValueError(f"merge {merge!r} is not two space-separated tokens")
            pairs.append((parts[0], parts[1]))

        bpe = models.BPE(
            vocab=vocab,
            merges=pairs,
            dropout=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
        )
        backend = tokenizers.Tokenizer(bpe)
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        backend.decoder = decoders.ByteLevel()
        alphabet = _alphabet_chars()
        # A CONTROL token written outside the byte alphabet is a converter mislabel (it could
        # never be produced by BPE either); like transformers, leave it out of the specials.
        control = [
            i for i, t in enumerate(types) if t == TOKEN_TYPE_CONTROL and set(tokens[i]) <= alphabet
        ]
        user = [
            i
            for i, t in enumerate(types)
            if t == TOKEN_TYPE_USER_DEFINED and spelled[i] == tokens[i]
        ]
        backend.add_special_tokens(
            [AddedToken(tokens[i], normalized=False, special=True) for i in control]
        )
        backend.add_tokens([AddedToken(tokens[i], normalized=False, special=False) for i in user])

        self._backend = backend
        self._ids = {t: i for i, t in enumerate(tokens)}
        unspell = _unspell_table()
        specials = set(control) | set(user)
        # Added tokens decode to their text; BPE tokens to the bytes their spelling encodes.
        self._bytes = tuple(
            tokens[i].encode("utf-8") if i in specials else bytes(unspell[ch] for ch in s)
            for i, s in enumerate(spelled)
        )
        self.vocab_size = n
        self.bos_id = int(bos_id)
        self.eos_id = int(eos_id)
        self.special_ids = frozenset(control)
        self.bos_token = tokens[bos_id]
        self.eos_token = tokens[eos_id]
        self.chat_template = chat_template

    @classmethod
    def from_gguf(cls, path: str | os.PathLike) -> "Tokenizer":
        """Build from a GGUF's metadata (raises ModelFileError for a bad or non-BPE file)."""
        return cls._from_metadata(read_tokenizer_metadata(path), path)

    @classmethod
    def _from_metadata(cls, metadata: dict[str, Any], source: Any) -> "Tokenizer":
        try:
            return cls(**metadata)
        except (ValueError, TypeError) as err:
            raise gguf_loader.ModelFileError(
                f"{source}: invalid tokenizer metadata: {err}"
            ) from err

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; special-token strings in it become their single id.

        No BOS is added (the file says ``add_bos_token = false``; chat templates write their
        own markers).
        """
        if not isinstance(text, str):
            raise TypeError(f"encode expects a str, got {type(text).__name__}")
        return self._backend.encode(text, add_special_tokens=False).ids

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one id stands for (a special token: its UTF-8 text)."""
        if not 0 <= token_id < self.vocab_size:
            raise ValueError(f"token id {token_id} is outside the vocabulary of {self.vocab_size}")
        return self._bytes[token_id]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text of ``ids``; byte sequences that are not valid UTF-8 become U+FFFD."""
        return self.decode_bytes(ids, skip_special_tokens).decode("utf-8", errors="replace")

    def decode_bytes(self, ids: Iterable[int], skip_special_tokens: bool = False) -> bytes:
        """The raw bytes of ``ids`` (what :meth:`decode` turns into text)."""
        return b"".join(
            self.token_bytes(int(i))
            for i in ids
            if not (skip_special_tokens and int(i) in self.special_ids)
        )

    def id_of(self, token: str) -> int:
        """The id of a vocabulary entry as the file spells it (``"<|im_end|>"``, ``"Ġthe"``)."""
        try:
            return self._ids[token]
        except KeyError:
            raise KeyError(f"{token!r} is not in the vocabulary") from None

    def __len__(self) -> int:
        return self.vocab_size


class IncrementalDecoder:
    """Turn a stream of ids into text pieces, holding back incomplete UTF-8 characters.

    ``"".join(push(i) for i in ids) + flush()`` equals ``tokenizer.decode(ids)``; no piece ever
    ends inside a character, so an emoji spread over three tokens comes out whole.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False):
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        """Feed one id; return the text it completes (possibly empty)."""
        return self._utf8.decode(
            self._tokenizer.decode_bytes([token_id], self._skip_special), final=False
        )

    def extend(self, ids: Iterable[int]) -> str:
        """Feed several ids; return the text they complete."""
        return self._utf8.decode(self._tokenizer.decode_bytes(ids, self._skip_special), final=False)

    def flush(self) -> str:
        """End of stream: return held-back bytes (an unfinished character becomes U+FFFD)."""
        text = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return text


def read_tokenizer_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """The :class:`Tokenizer` constructor arguments stored in a GGUF (JSON-able)."""
    reader = gguf_loader.open_gguf(path)
    model = gguf_loader.read_field(reader, "tokenizer.ggml.model")
    if model != "gpt2":
        raise gguf_loader.ModelFileError(
            f"{path}: tokenizer model {model!r} is not supported (expected byte-level BPE, 'gpt2')"
        )
    types = gguf_loader.read_field(reader, "tokenizer.ggml.token_type", None)
    return {
        "tokens": list(gguf_loader.read_field(reader, "tokenizer.ggml.tokens")),
        "merges": list(gguf_loader.read_field(reader, "tokenizer.ggml.merges")),
        "token_types": [int(t) for t in types] if types is not None else None,
        "bos_id": int(gguf_loader.read_field(reader, "tokenizer.ggml.bos_token_id")),
        "eos_id": int(gguf_loader.read_field(reader, "tokenizer.ggml.eos_token_id")),
        "chat_template": gguf_loader.read_field(reader, "tokenizer.chat_template", None),
    }


@functools.lru_cache(maxsize=4)
def _load_cached(path: Path, size: int, mtime_ns: int, cache_dir: Path) -> Tokenizer:
    del size, mtime_ns  # part of the memo key only: a rewritten file is read again
    metadata = weights_cache.load_or_build_json(
        path, "tokenizer", lambda: read_tokenizer_metadata(path), cache_dir=cache_dir
    )
    return Tokenizer._from_metadata(metadata, path)


def load_tokenizer(
    path: str | os.PathLike | None = None, cache_dir: str | os.PathLike | None = None
) -> Tokenizer:
    """The tokenizer of a GGUF file, the SmolLM2 teacher's by default.

    Parsing a GGUF's metadata takes seconds, so the tokenizer metadata is cached on disk (see
    :func:`weights_cache.load_or_build_json`) and the built tokenizer memoised per
    (path, size, mtime) in this process; it is immutable, so sharing it is safe.
    """
    if path is None:
        path = find_smollm2_gguf()
    path = Path(path).resolve()
    stat = path.stat()
    return _load_cached(
        path, stat.st_size, stat.st_mtime_ns, weights_cache.resolve_cache_dir(cache_dir)
    )
