"""Byte-level BPE tokenizer from GGUF metadata, and the streaming decoder."""

from __future__ import annotations

import gguf
import pytest
from hypothesis import given
from hypothesis import strategies as st

from eaglepangu_jax.models import tokenizer as tokenizer_mod
from eaglepangu_jax.models.gguf_loader import ModelFileError
from eaglepangu_jax.models.tokenizer import IncrementalDecoder, Tokenizer, byte_alphabet

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a"]
MERGED = ["Ġt", "he", "Ġthe", "in", "Ġa"]
BYTE0 = len(SPECIALS)  # id of byte b is BYTE0 + b


def tiny_metadata(**override):
    alphabet = byte_alphabet()
    tokens = SPECIALS + [alphabet[b] for b in range(256)] + MERGED + ["<think>"]
    types = [3] * len(SPECIALS) + [1] * (256 + len(MERGED)) + [4]
    meta = dict(
        tokens=tokens, merges=MERGES, token_types=types, bos_id=1, eos_id=2, chat_template=None
    )
    return {**meta, **override}


TINY = Tokenizer(**tiny_metadata())
GID = {t: i for i, t in enumerate(tiny_metadata()["tokens"])}


def byte_ids(text: str) -> list[int]:
    return [BYTE0 + b for b in text.encode("utf-8")]


def write_tokenizer_gguf(path, meta, model="gpt2"):
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model(model)
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(meta["tokens"])
    writer.add_token_types(meta["token_types"])
    writer.add_token_merges(meta["merges"])
    writer.add_bos_token_id(meta["bos_id"])
    writer.add_eos_token_id(meta["eos_id"])
    writer.add_add_bos_token(False)
    writer.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    for key in (
        "block_count",
        "embedding_length",
        "context_length",
        "feed_forward_length",
        "attention.head_count",
    ):
        writer.add_uint32(f"llama.{key}", 8)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# ----------------------------------------------------------------------------- alphabet


def test_byte_alphabet():
    alphabet = byte_alphabet()
    assert len(set(alphabet.values())) == 256
    assert all(alphabet[b] == chr(b) for b in range(ord("!"), ord("~") + 1))
    assert alphabet[ord(" ")] == "Ġ" and alphabet[ord("\n")] == "Ċ" and alphabet[0] == "Ā"
    assert all(ch.isprintable() and not ch.isspace() for ch in alphabet.values())


# ----------------------------------------------------------------------------- encode


def test_encode_applies_merges_in_rank_order():
    ids = TINY.encode("the the in")
    assert ids == [GID["t"], GID["he"], GID["Ġthe"], GID["Ġ"], GID["in"]]


def test_special_tokens_are_single_ids():
    ids = TINY.encode("<|im_start|>user\nhi<|im_end|><|endoftext|>")
    assert ids[0] == 1 and ids[-2:] == [2, 0]
    assert ids[1:-2] == byte_ids("user\nhi")
    assert TINY.special_ids == frozenset({0, 1, 2})
    assert (TINY.bos_token, TINY.eos_token) == ("<|im_start|>", "<|im_end|>")


def test_user_defined_token_is_whole_but_not_special():
    think = GID["<think>"]
    assert TINY.encode("a<think>b") == [BYTE0 + ord("a"), think, BYTE0 + ord("b")]
    assert TINY.decode([think], skip_special_tokens=True) == "<think>"


def test_no_bos_is_added():
    assert TINY.encode("") == []
    assert TINY.encode("x") == [BYTE0 + ord("x")]


@given(st.text(max_size=60))
def test_round_trip(text):
    assert TINY.decode(TINY.encode(text)) == text


def test_raw_vocabulary_entries_are_respelled():
    meta = tiny_metadata()
    meta["tokens"] = meta["tokens"] + ["中"]
    meta["token_types"] = meta["token_types"] + [1]
    tok = Tokenizer(**meta)
    assert tok.decode([len(meta["tokens"]) - 1]) == "中"
    assert tok.token_bytes(len(meta["tokens"]) - 1) == "中".encode()


def test_bad_input_is_rejected():
    with pytest.raises(TypeError, match="str"):
        TINY.encode(b"bytes")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        TINY.decode([len(TINY)])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        TINY.decode([-1])
    with pytest.raises(ValueError, match="two space-separated"):
        Tokenizer(**tiny_metadata(merges=["a b c"]))
    with pytest.raises(ValueError, match="bos_id"):
        Tokenizer(**tiny_metadata(bos_id=10**6))
    with pytest.raises(ValueError, match="token types"):
        Tokenizer(**tiny_metadata(token_types=[1, 1]))
    with pytest.raises(KeyError, match="nope"):
        TINY.id_of("nope")
    assert TINY.id_of("<|im_end|>") == 2


# ----------------------------------------------------------------------------- decode


def test_decode_invalid_utf8_like_python():
    broken = byte_ids("😀")[:2] + byte_ids("a")
    assert TINY.decode(broken) == b"\xf0\x9fa".decode("utf-8", errors="replace")
    assert TINY.decode([0, 5], skip_special_tokens=True) == TINY.decode([5])


def test_incremental_decoder_holds_back_partial_characters():
    decoder = IncrementalDecoder(TINY)
    assert [decoder.push(i) for i in byte_ids("😀")] == ["", "", "", "😀"]
    assert [decoder.push(i) for i in byte_ids("中a")] == ["", "", "中", "a"]
    assert decoder.push(byte_ids("é")[0]) == ""
    assert decoder.flush() == "\ufffd"  # the stream ended inside a character
    assert decoder.push(BYTE0 + ord("z")) == "z"  # flush reset the state


@given(st.text(max_size=40), st.booleans())
def test_incremental_decoder_matches_decode(text, byte_per_token):
    ids = byte_ids(text) if byte_per_token else TINY.encode(text)
    decoder = IncrementalDecoder(TINY)
    pieces = [decoder.push(i) for i in ids]
    assert "".join(pieces) + decoder.flush() == text
    if "\ufffd" not in text:
        assert all("\ufffd" not in piece for piece in pieces)


def test_incremental_decoder_extend_and_skip_specials():
    decoder = IncrementalDecoder(TINY, skip_special_tokens=True)
    assert decoder.extend([1] + byte_ids("日本")[:4]) == "日"
    assert decoder.extend(byte_ids("日本")[4:] + [2]) == "本"


# ----------------------------------------------------------------------------- from GGUF


def test_from_gguf_and_disk_cache(tmp_path, monkeypatch):
    path = tmp_path / "tok.gguf"
    write_tokenizer_gguf(path, tiny_metadata())
    direct = Tokenizer.from_gguf(path)
    assert direct.encode("the <|im_end|> 中") == TINY.encode("the <|im_end|> 中")
    assert direct.chat_template.startswith("{% for m in messages %}")

    cache = tmp_path / "cache"
    loaded = tokenizer_mod.load_tokenizer(path, cache_dir=cache)
    assert tokenizer_mod.load_tokenizer(path, cache_dir=cache) is loaded  # memoised
    tokenizer_mod._load_cached.cache_clear()

    def fail(_):
        raise AssertionError("metadata parsed again")

    monkeypatch.setattr(tokenizer_mod, "read_tokenizer_metadata", fail)
    again = tokenizer_mod.load_tokenizer(path, cache_dir=cache)  # from the disk cache
    assert again is not loaded and again.encode("in the") == TINY.encode("in the")
    tokenizer_mod._load_cached.cache_clear()


def test_unsupported_tokenizer_model(tmp_path):
    path = tmp_path / "spm.gguf"
    write_tokenizer_gguf(path, tiny_metadata(), model="llama")
    with pytest.raises(ModelFileError, match="tokenizer model 'llama' is not supported"):
        Tokenizer.from_gguf(path)


@pytest.mark.reference
def test_tiny_gguf_matches_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    path = tmp_path / "tok.gguf"
    write_tokenizer_gguf(path, tiny_metadata())
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    ours = Tokenizer.from_gguf(path)
    for text in [
        "the cat in a hat",
        " the  the\n\nthe",
        "<|im_start|>in<|im_end|>",
        "a<think>b",
        "é😀中文 'll it's 123",
    ]:
        want = theirs(text, add_special_tokens=False)["input_ids"]
        assert ours.encode(text) == want, text
        assert ours.decode(want) == theirs.decode(want), text


# ----------------------------------------------------------------------------- SmolLM2

REAL_TEXTS = [
    "Hello, world! How are you today?",
    "def fib(n: int) -> int:\n    if n < 2:\n        return n\n"
    "    return fib(n - 1) + fib(n - 2)\n",
    'for (int i = 0; i < 10; ++i) { printf("%d\\n", i); }\t// done',
    "  leading and trailing spaces   \n\n\n",
    "Numbers: 2024, 3.14159, 1e-5, 123456789 and -42.",
    "Ünïcödé — “quotes” «guillemets» 日本語のテキスト 中文 한국어 العربية",
    "Emoji: 😀👍🏽🇫🇷👩‍👩‍👧 and symbols ∑∫√≠ ≤ ≥ → ⇒",
    "<|im_start|>user\nWhat's 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><repo_name>eaglepangu<file_sep>README.md",
    "I'm sure they'll say we've done it; don't you think it's fine?",
    "a\r\nb\u00a0c\u200bd\u3000e",
]


@pytest.fixture(scope="module")
def real_pair(tmp_path_factory):
    from eaglepangu_jax.models import smollm2

    try:
        path = smollm2.find_smollm2_gguf()
    except smollm2.ModelNotInstalledError as err:
        pytest.skip(str(err))
    ours = tokenizer_mod.load_tokenizer(path, cache_dir=tmp_path_factory.mktemp("tok-cache"))
    transformers = pytest.importorskip("transformers")
    theirs = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return ours, theirs


@pytest.mark.real_model  # kept in `make test`
@pytest.mark.reference
def test_smollm2_matches_transformers(real_pair):
    ours, theirs = real_pair
    assert len(ours) == 49152 and (ours.bos_id, ours.eos_id) == (1, 2)
    for text in REAL_TEXTS:
        want = theirs(text, add_special_tokens=False)["input_ids"]
        assert ours.encode(text) == want, text
        assert ours.decode(want) == theirs.decode(want) == text, text


@pytest.mark.real_model  # kept in `make test`
@pytest.mark.reference
def test_smollm2_specials_and_streaming(real_pair):
    ours, _ = real_pair
    assert ours.encode("<|endoftext|><|im_start|><|im_end|>") == [0, 1, 2]
    text = "Tokyo 東京 🗼 — naïve café 😀👍🏽"
    decoder = IncrementalDecoder(ours)
    pieces = [decoder.push(i) for i in ours.encode(text)]
    assert "".join(pieces) + decoder.flush() == text
    assert all("\ufffd" not in piece for piece in pieces)
    assert any(piece == "" for piece in pieces)  # some emoji span several tokens
