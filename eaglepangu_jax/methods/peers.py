"""Peer decoders for the side-by-side benchmark: ``transformers`` on the same GGUF file.

``transformers`` loads the teacher's GGUF (dequantised to float32, like ours) and decodes it
greedily, plainly or with its prompt-lookup assisted generation. A peer run returns a
:class:`~eaglepangu_jax.engine.decode.GenerationResult`, counted the way the JAX engine counts:

* tokens: the generated ids themselves (never text re-tokenised), prompt excluded, up to and
  including eos, at most ``max_new_tokens``;
* rounds: the model's forward calls during ``generate`` (a forward hook counts them). One call
  emits the tokens of one round: plain greedy decoding scores 1.00 tokens per round;
* timing: ``transformers`` fuses the prompt's prefill with the first round (one forward over
  the whole prompt emits the first token), where the JAX engine prefills ``prompt[:-1]`` apart
  and counts the first round as decoding. So the first call is reported as
  ``prefill_seconds``, ``seconds`` is the time after it, and ``tokens_per_s`` is the tokens of
  the later rounds over ``seconds``: the same steady decoding rate, neither side credited
  with tokens it did not time.

torch and transformers are imported inside functions only: the JAX package imports without
them. They come with the ``reference`` extra (:data:`INSTALL_HINT`).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import os
import time
from typing import Any, Sequence

from eaglepangu_jax.engine.config import SpecConfig
from eaglepangu_jax.engine.decode import GenerationResult, GenerationStats
from eaglepangu_jax.models import smollm2

__all__ = [
    "INSTALL_HINT",
    "PROMPT_LOOKUP_TOKENS",
    "REFERENCE_STACK",
    "ForwardCall",
    "ReferenceStackMissingError",
    "TransformersPeer",
    "check_reference_stack",
    "count_rounds",
    "import_reference_stack",
    "load_transformers_teacher",
    "set_torch_threads",
    "transformers_generate",
]

REFERENCE_STACK = ("torch", "transformers", "accelerate")  # accelerate: GGUF loading needs it
INSTALL_HINT = "pip install 'eaglepangu[reference]'"
PROMPT_LOOKUP_TOKENS = 10  # candidate tokens per round, as measured in REFERENCE.md


class ReferenceStackMissingError(ImportError):
    """torch, transformers or accelerate is missing; the message names the extra to install."""


def check_reference_stack() -> None:
    """Fail early, importing nothing, if a package of :data:`REFERENCE_STACK` is missing.

    Raises:
      ReferenceStackMissingError: the message names the missing packages and gives
        :data:`INSTALL_HINT`.
    """
    missing = [name for name in REFERENCE_STACK if importlib.util.find_spec(name) is None]
    if missing:
        raise ReferenceStackMissingError(
            f"the transformers peers need {', '.join(REFERENCE_STACK)}; not installed: "
            f"{', '.join(missing)}. Install them with: {INSTALL_HINT}"
        )


def import_reference_stack() -> tuple[Any, Any]:
    """``(torch, transformers)``, imported.

    Raises:
      ReferenceStackMissingError: a package of :data:`REFERENCE_STACK` is missing or cannot be
        imported; the message says which and gives :data:`INSTALL_HINT`.
    """
    check_reference_stack()
    try:
        modules = [importlib.import_module(name) for name in REFERENCE_STACK]
    except ImportError as err:
        raise ReferenceStackMissingError(
            f"the transformers peers cannot import {err.name or 'a dependency'} ({err}). "
            f"Reinstall them with: {INSTALL_HINT}"
        ) from err
    return modules[0], modules[1]


def load_transformers_teacher(path: str | os.PathLike | None = None) -> Any:
    """The teacher as a ``transformers`` causal LM, float32, in eval mode.

    Args:
      path: a Llama GGUF file (default: the SmolLM2 file, see
        :func:`~eaglepangu_jax.models.smollm2.find_smollm2_gguf`).

    Raises:
      ReferenceStackMissingError: the reference stack is not installed.
      ModelNotInstalledError: ``path`` is ``None`` and the SmolLM2 file is missing.
    """
    torch, transformers = import_reference_stack()
    path = smollm2.find_smollm2_gguf() if path is None else os.fspath(path)
    directory, name = os.path.split(os.path.abspath(path))
    model = transformers.AutoModelForCausalLM.from_pretrained(
        directory, gguf_file=name, dtype=torch.float32
    )
    model.eval()
    return model


def set_torch_threads(threads: int | None) -> None:
    """Set torch's intra-op threads, process-wide (``None``: leave torch's setting)."""
    if threads is not None:
        if threads < 1:
            raise ValueError(f"torch threads must be >= 1, got {threads}")
        import_reference_stack()[0].set_num_threads(threads)


@functools.lru_cache(maxsize=1)
def _shared_teacher(path: str | None) -> Any:
    # Both peer methods of a bench run decode the same file: one copy of the weights.
    return load_transformers_teacher(path)


# ----------------------------------------------------------------------------- counting


@dataclasses.dataclass(frozen=True, kw_only=True)
class ForwardCall:
    """One forward call of the peer model during ``generate``."""

    end: float  # time.perf_counter() when the call returned
    first_position: int  # position of the call's first input token
    num_inputs: int  # input tokens of the call


def count_rounds(
    calls: Sequence[ForwardCall],
    tokens: Sequence[int],
    *,
    prompt_len: int,
    start: float,
    end: float,
) -> GenerationStats:
    """The statistics of one peer generation, one round per forward call.

    The first call runs over the whole prompt (and the first candidates); every later call
    starts at the last committed token, which is not in the cache yet, so a call at position
    ``p`` means ``p - prompt_len + 1`` tokens were emitted before it. A call feeds its
    candidates after its first token (after the prompt, for the first call).

    Args:
      calls: the forward calls, in order.
      tokens: the generated ids (prompt excluded).
      prompt_len: prompt tokens.
      start, end: ``time.perf_counter()`` around ``generate``.

    Raises:
      ValueError: no calls, or calls inconsistent with ``tokens`` (a counting bug to fix, not
        a result to report).
    """
    if not calls:
        raise ValueError("the peer generated without a single forward call")
    before = [0] + [c.first_position - prompt_len + 1 for c in calls[1:]] + [len(tokens)]
    emitted = [b - a for a, b in zip(before, before[1:])]
    if calls[0].first_position != 0 or min(emitted) < 1:
        raise ValueError(
            f"forward calls at positions {[c.first_position for c in calls]} do "
            f"not fit a {prompt_len}-token prompt and {len(tokens)} new tokens"
        )
    nodes = [calls[0].num_inputs - prompt_len] + [c.num_inputs - 1 for c in calls[1:]]
    seconds = end - calls[0].end
    later = len(tokens) - emitted[0]  # tokens of the rounds after the fused first one
    return GenerationStats(
        new_tokens=len(tokens),
        rounds=len(calls),
        accepted_length=len(tokens) / len(calls),
        seconds=seconds,
        prefill_seconds=calls[0].end - start,
        # No later round: no decoding rate to report (NaN, dropped by the bench's summary).
        tokens_per_s=later / seconds if later and seconds > 0 else float("nan"),
        accepted_per_round=tuple(e - 1 for e in emitted),
        nodes_per_round=tuple(nodes),
    )


class _CallRecorder:
    """A forward hook that records every call as a :class:`ForwardCall`."""

    def __init__(self):
        self.calls: list[ForwardCall] = []

    def __call__(self, module: Any, args: tuple, kwargs: dict, output: Any) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        positions = kwargs.get("position_ids")
        if ids is None or positions is None:
            raise RuntimeError(
                "the peer model was called without input_ids/position_ids; "
                "this transformers version cannot be counted"
            )
        self.calls.append(
            ForwardCall(
                end=time.perf_counter(),
                first_position=int(positions[0, 0]),
                num_inputs=int(ids.shape[-1]),
            )
        )


def transformers_generate(
    model: Any,
    prompt_ids: Sequence[int],
    *,
    max_new_tokens: int,
    eos_id: int,
    prompt_lookup: int | None = None,
    force_length: bool = False,
) -> GenerationResult:
    """Greedy ``model.generate`` (prompt-lookup assisted if ``prompt_lookup``), counted.

    Args:
      model: a ``transformers`` causal LM.
      prompt_ids: the prompt, at least one token.
      max_new_tokens: generation limit.
      eos_id: stop token (emitted, then generation stops).
      prompt_lookup: candidate tokens per round taken from earlier text
        (``prompt_lookup_num_tokens``); ``None``: plain greedy decoding.
      force_length: generate exactly ``max_new_tokens``, eos suppressed (speed comparisons
        at equal lengths; the ids after the first eos are then not greedy's).

    Returns:
      The generated ids and their statistics (see :func:`count_rounds`).
    """
    torch, _ = import_reference_stack()
    if len(prompt_ids) == 0:
        raise ValueError("the prompt is empty: at least one token is needed")
    inputs = torch.tensor([list(prompt_ids)], dtype=torch.long)
    options = dict(
        attention_mask=torch.ones_like(inputs),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        num_beams=1,
        temperature=None,
        top_p=None,
        top_k=None,
        repetition_penalty=None,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
    )
    if prompt_lookup is not None:
        options["prompt_lookup_num_tokens"] = prompt_lookup
    if force_length:
        options["min_new_tokens"] = max_new_tokens
    recorder = _CallRecorder()
    handle = model.register_forward_hook(recorder, with_kwargs=True)
    try:
        with torch.no_grad():
            start = time.perf_counter()
            out = model.generate(inputs, **options)
            end = time.perf_counter()
    finally:
        handle.remove()
    tokens = out[0, len(prompt_ids) :].tolist()
    return GenerationResult(
        tokens=tokens,
        stats=count_rounds(
            recorder.calls, tokens, prompt_len=len(prompt_ids), start=start, end=end
        ),
    )


# ----------------------------------------------------------------------------- the runner


@dataclasses.dataclass(frozen=True, kw_only=True)
class TransformersPeer:
    """A bench method run by ``transformers`` on the teacher's GGUF file.

    Attributes:
      prompt_lookup: candidate tokens per round for prompt-lookup decoding; ``None``: plain
        greedy decoding.
      gguf_path: the weights (default: the SmolLM2 file the JAX teacher reads).
      torch_threads: torch's intra-op threads (``None``: torch's default, one per core, or
        ``OMP_NUM_THREADS`` when set). On a machine other processes keep busy, 1 can be much
        faster and steadier: torch's threads wait for one another at every operation, so one
        descheduled thread stalls them all (on a shared 2-core host, 2 threads gave 1.4 to 23
        tokens/s from run to run, 1 thread a steady 23). The setting is process-wide in torch.
    """

    prompt_lookup: int | None = None
    gguf_path: str | None = None
    torch_threads: int | None = None

    def __post_init__(self):
        if self.prompt_lookup is not None and self.prompt_lookup < 1:
            raise ValueError(f"prompt_lookup must be >= 1 token, got {self.prompt_lookup}")
        if self.torch_threads is not None and self.torch_threads < 1:
            raise ValueError(f"torch_threads must be >= 1, got {self.torch_threads}")

    def __call__(
        self, prompt_ids: Sequence[int], spec: SpecConfig, *, eos_id: int
    ) -> GenerationResult:
        """Generate greedily for ``prompt_ids`` with ``spec.max_new_tokens``.

        Raises:
          ValueError: ``spec`` samples (the peers decode greedily only).
          ReferenceStackMissingError: the reference stack is not installed.
        """
        if spec.sampling:
            raise ValueError(
                "the transformers peers decode greedily; got a sampling spec "
                f"(temperature {spec.temperature})"
            )
        model = _shared_teacher(self.gguf_path)
        set_torch_threads(self.torch_threads)
        return transformers_generate(
            model,
            prompt_ids,
            max_new_tokens=spec.max_new_tokens,
            eos_id=eos_id,
            prompt_lookup=self.prompt_lookup,
        )

    def describe(self) -> dict[str, Any]:
        """The settings in effect, for the report: torch's thread count decides its speed."""
        torch, transformers = import_reference_stack()
        return {
            "implementation": f"transformers {transformers.__version__}, torch {torch.__version__}",
            "prompt_lookup": self.prompt_lookup,
            "gguf_path": self.gguf_path,
            "torch_threads": torch.get_num_threads(),
        }
