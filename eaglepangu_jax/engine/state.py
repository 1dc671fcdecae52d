"""``DecodeState``: the immutable per-sequence state the speculative loop carries.

Token buffer convention (shared with :class:`~eaglepangu_jax.engine.drafter.DraftContext`):
``tokens[:num_tokens]`` are the prompt and every emitted token; the last of them,
``tokens[num_tokens - 1]``, is the **root** of the next tree: emitted (or the prompt's last
token) but never fed to the teacher, so the cache's committed length is always
``num_tokens - 1``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from eaglepangu_jax.cache import KVCache
from eaglepangu_jax.engine.drafter import DraftContext

__all__ = ["DecodeState"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
    tokens: Int[Array, " C"]  # [C] prompt + emitted tokens, zero past num_tokens
    num_tokens: Int[Array, ""]  # valid entries of tokens
    prompt_len: Int[Array, ""]  # tokens[:prompt_len] is the prompt
    cache: KVCache  # teacher KV cache, committed length == num_tokens - 1
    features: Float[Array, "A F H"]  # teacher features of the last round's accepted positions
    num_features: Int[Array, ""]
    drafter_state: Any
    key: Array  # PRNG key for sampling and stochastic drafters
    rounds: Int[Array, ""]  # verify rounds so far
    done: Bool[Array, ""]  # eos emitted or max_new_tokens reached
    accepted_log: Int[Array, " R"]  # [R] accepted draft nodes per round (-1 = no round)
    nodes_log: Int[Array, " R"]  # [R] tree nodes verified per round (root excluded)
    # The run's values, traced so that new values reuse the compiled loop (the static key,
    # ``StepStatic``, holds only what shapes the computation).
    temperature: Float[Array, ""]
    top_p: Float[Array, ""]
    eos_id: Int[Array, ""]
    max_new_tokens: Int[Array, ""]
    # The controller's online acceptance statistics (``draft_control.AcceptanceStats``) under
    # the "auto" policy with a drafter; None otherwise.
    control: Any = None

    @property
    def new_tokens(self) -> Int[Array, ""]:
        return self.num_tokens - self.prompt_len

    def context(self, draft_window: int | None = None) -> DraftContext:
        """The drafter's view; with ``draft_window`` only the last tokens stay visible."""
        start = jnp.zeros((), jnp.int32)
        if draft_window is not None:
            start = jnp.maximum(self.num_tokens - draft_window, 0)
        return DraftContext(
            tokens=self.tokens,
            num_tokens=self.num_tokens,
            features=self.features,
            num_features=self.num_features,
            start=start,
        )
