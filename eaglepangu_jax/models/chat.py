"""Chat prompts rendered with the template stored in the teacher's GGUF.

SmolLM2's template is ChatML. When the first message is not a system message it inserts a
default one ("You are a helpful AI assistant named SmolLM, trained by Hugging Face"); an
explicit system message replaces it::

    <|im_start|>system
    You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>
    <|im_start|>user
    Hi<|im_end|>
    <|im_start|>assistant

The template is rendered the way ``transformers`` renders chat templates (a sandboxed Jinja
environment with ``trim_blocks`` and ``lstrip_blocks``), and the text is encoded without adding
a BOS, so :func:`encode_chat` gives the ids of ``apply_chat_template(..., tokenize=True)``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from eaglepangu_jax.models.tokenizer import Tokenizer, load_tokenizer

__all__ = ["Message", "render_chat", "encode_chat", "Renderer", "ChatRenderer"]

Message = Mapping[str, str]
"""One chat turn: ``{"role": "system" | "user" | "assistant", "content": str}``."""


def _raise_exception(message: str):
    raise ValueError(f"chat template error: {message}")


@functools.lru_cache(maxsize=8)
def _compile(template: str):
    try:
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as err:
        raise ImportError("rendering chat templates needs jinja2: pip install jinja2") from err
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.globals["raise_exception"] = _raise_exception
    return env.from_string(template)


def _check_messages(messages: Sequence[Message]) -> list[dict[str, str]]:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise TypeError("messages must be a sequence of {'role': ..., 'content': ...} dicts")
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise TypeError(f"message {i} is a {type(message).__name__}, expected a mapping")
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                raise ValueError(f"message {i} needs a string {key!r}, got {message.get(key)!r}")
        checked.append(dict(message))
    return checked


def render_chat(
    messages: Sequence[Message],
    add_generation_prompt: bool = True,
    *,
    tokenizer: Tokenizer | None = None,
) -> str:
    """The prompt text for ``messages`` under the teacher's chat template.

    Args:
      messages: the conversation, oldest first.
      add_generation_prompt: end with the header of an assistant turn, ready for generation.
      tokenizer: whose ``chat_template`` (and bos / eos text) to use; SmolLM2's by default.

    Raises:
      TypeError, ValueError: malformed messages.
      ValueError: the tokenizer has no chat template.
    """
    checked = _check_messages(messages)
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer()
    if not tokenizer.chat_template:
        raise ValueError("this tokenizer's model file has no chat template")
    return _compile(tokenizer.chat_template).render(
        messages=checked,
        add_generation_prompt=add_generation_prompt,
        bos_token=tokenizer.bos_token,
        eos_token=tokenizer.eos_token,
    )


def encode_chat(
    tokenizer: Tokenizer, messages: Sequence[Message], add_generation_prompt: bool = True
) -> list[int]:
    """Token ids of :func:`render_chat` (role markers are single special ids, no extra BOS)."""
    return tokenizer.encode(render_chat(messages, add_generation_prompt, tokenizer=tokenizer))


class Renderer(Protocol):
    """Turns a conversation into prompt ids and answer ids into text."""

    def encode(self, messages: Sequence[dict[str, str]]) -> list[int]:
        """Prompt ids ending with the assistant header."""

    def decode(self, ids: Sequence[int]) -> str:
        """Answer text (special tokens dropped), sent back as the assistant message."""

    def encode_text(self, text: str) -> list[int]:
        """Ids of plain text, no template (``generate --raw``)."""


@dataclasses.dataclass(frozen=True)
class ChatRenderer:
    """The teacher's chat template (the real benchmark's renderer)."""

    tokenizer: Any

    def encode(self, messages: Sequence[dict[str, str]]) -> list[int]:
        return encode_chat(self.tokenizer, messages)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def encode_text(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)
