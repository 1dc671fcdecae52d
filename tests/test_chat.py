"""Chat template rendering and encoding, checked against transformers on the real file."""

from __future__ import annotations

import pytest

from eaglepangu_jax.models.chat import encode_chat, render_chat
from eaglepangu_jax.models.tokenizer import Tokenizer, byte_alphabet

# SmolLM2-135M-Instruct's template, as stored in its GGUF (tokenizer.chat_template).
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)
DEFAULT_SYSTEM = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
    "Hugging Face<|im_end|>\n"
)


@pytest.fixture(scope="module")
def tiny():
    alphabet = byte_alphabet()
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + [alphabet[b] for b in range(256)]
    return Tokenizer(
        tokens=tokens,
        merges=[],
        token_types=[3, 3, 3] + [1] * 256,
        bos_id=1,
        eos_id=2,
        chat_template=SMOLLM2_TEMPLATE,
    )


def test_default_system_prompt_is_inserted(tiny):
    text = render_chat([{"role": "user", "content": "Hi"}], tokenizer=tiny)
    assert text == (DEFAULT_SYSTEM + "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_explicit_system_prompt_replaces_the_default(tiny):
    messages = [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Bye"},
    ]
    text = render_chat(messages, add_generation_prompt=False, tokenizer=tiny)
    assert text == (
        "<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n"
    )


def test_encode_chat_uses_single_marker_ids(tiny):
    ids = encode_chat(tiny, [{"role": "user", "content": "é"}])
    assert ids.count(1) == 3 and ids.count(2) == 2  # system, user, assistant headers
    assert ids[-1] == 3 + ord("\n") and tiny.decode(ids).endswith(
        "é<|im_end|>\n<|im_start|>assistant\n"
    )


@pytest.mark.parametrize(
    "messages, error",
    [
        ("hello", TypeError),
        ([("user", "hi")], TypeError),
        ([{"role": "user"}], ValueError),
        ([{"role": "user", "content": None}], ValueError),
        ([{"role": 3, "content": "x"}], ValueError),
    ],
)
def test_malformed_messages(tiny, messages, error):
    with pytest.raises(error):
        render_chat(messages, tokenizer=tiny)


def test_tokenizer_without_template(tiny):
    bare = Tokenizer(tokens=[byte_alphabet()[b] for b in range(256)], merges=[], bos_id=0, eos_id=0)
    with pytest.raises(ValueError, match="no chat template"):
        render_chat([{"role": "user", "content": "x"}], tokenizer=bare)


CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are a pirate."},
        {"role": "user", "content": "Tell me about ships."},
    ],
    [
        {"role": "user", "content": "Write a Python function that reverses a list."},
        {"role": "assistant", "content": "```python\ndef rev(xs):\n    return xs[::-1]\n```"},
        {"role": "user", "content": "Now do it in place, without slicing."},
    ],
    [
        {"role": "system", "content": "Réponds en français. 日本語も可。"},
        {"role": "user", "content": "Bonjour ! 😀 Ça va ?"},
        {"role": "assistant", "content": "Très bien, merci — et vous ? 👍🏽"},
        {"role": "user", "content": "中文呢？"},
        {"role": "assistant", "content": "当然可以。"},
        {"role": "user", "content": "  spaces\tand\ttabs  \n\n"},
    ],
    [
        {"role": "user", "content": "for i in range(3):\n\tprint(f'{i:>3}')  # ok?"},
        {"role": "assistant", "content": "Yes.<|endoftext|>"},
    ],
]


@pytest.fixture(scope="module")
def real_pair(tmp_path_factory):
    from eaglepangu_jax.models import smollm2, tokenizer

    try:
        path = smollm2.find_smollm2_gguf()
    except smollm2.ModelNotInstalledError as err:
        pytest.skip(str(err))
    ours = tokenizer.load_tokenizer(path, cache_dir=tmp_path_factory.mktemp("chat-cache"))
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("jinja2")
    theirs = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return ours, theirs


def _ids(encoding):
    # transformers 5 returns a BatchEncoding for tokenize=True; older versions a list.
    return list(encoding["input_ids"] if hasattr(encoding, "keys") else encoding)


@pytest.mark.real_model  # kept in `make test`
@pytest.mark.reference
@pytest.mark.parametrize("index", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_matches_transformers(real_pair, index, add_generation_prompt):
    ours, theirs = real_pair
    messages = CONVERSATIONS[index]
    assert ours.chat_template == SMOLLM2_TEMPLATE
    want_text = theirs.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=False
    )
    want_ids = _ids(
        theirs.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=True
        )
    )
    assert render_chat(messages, add_generation_prompt, tokenizer=ours) == want_text
    assert encode_chat(ours, messages, add_generation_prompt) == want_ids


@pytest.mark.real_model  # kept in `make test`
def test_default_tokenizer_is_smollm2(real_pair, tmp_path, monkeypatch):
    from eaglepangu_jax.models import weights_cache

    monkeypatch.setenv(weights_cache.CACHE_ENV_VAR, str(tmp_path))
    ours, _ = real_pair
    messages = CONVERSATIONS[2]
    assert render_chat(messages) == render_chat(messages, tokenizer=ours)
