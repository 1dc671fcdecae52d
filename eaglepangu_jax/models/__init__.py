"""The teacher: a Llama-architecture model in JAX, loaded from GGUF (SmolLM2-135M-Instruct).

* :mod:`.config`: :class:`LlamaConfig`; :mod:`.llama`: the forward with explicit cache and mask;
* :mod:`.smollm2`: finding and loading the shipped GGUF file; :mod:`.gguf_loader` reads it;
* :mod:`.tokenizer` and :mod:`.chat`: the byte-level BPE tokenizer and the chat template.
"""

from eaglepangu_jax.models import llama
from eaglepangu_jax.models.chat import ChatRenderer, encode_chat, render_chat
from eaglepangu_jax.models.config import LlamaConfig
from eaglepangu_jax.models.smollm2 import (
    ModelNotInstalledError,
    find_smollm2_gguf,
    load_smollm2,
    teacher_fingerprint,
)
from eaglepangu_jax.models.tokenizer import Tokenizer, load_tokenizer

__all__ = [
    "ChatRenderer",
    "LlamaConfig",
    "ModelNotInstalledError",
    "Tokenizer",
    "encode_chat",
    "find_smollm2_gguf",
    "llama",
    "load_smollm2",
    "load_tokenizer",
    "render_chat",
    "teacher_fingerprint",
]
