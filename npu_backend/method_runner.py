"""The torch runner as a benchmark method: what ``eaglepangu bench --backend torch`` runs."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

from eaglepangu_jax.engine import decode as engine
from eaglepangu_jax.engine.config import SpecConfig
from npu_backend.llama_torch import TorchLlama
from npu_backend.runner import MODES, Mode, generate_torch

__all__ = ["TorchMethodRunner"]


class TorchMethodRunner:
    """A decoding method (a drafter, or ``None`` for greedy) with the teacher in torch, as a
    runner of :class:`eaglepangu_jax.methods.registry.PeerRunner`: the benchmark and the
    command line run it in place of the JAX engine (``eaglepangu bench --backend torch``).

    Args:
        model: the torch teacher.
        drafter, draft_params: the method's drafter and its weights.
        mode: ``"tree"`` or ``"branches"`` (see :func:`generate_torch`).
        costs: for the ``"auto"`` controller, a function of the prompt length (the context)
            returning ``(verify_latency, draft_seconds)`` (as
            :func:`eaglepangu_jax.calibration.curve.method_costs`); ``None``: the engine's
            nominal roofline and no drafting cost.
    """

    def __init__(
        self,
        model: TorchLlama,
        drafter: Any,
        *,
        draft_params: Any = None,
        mode: Mode = "tree",
        costs: Callable[[int], tuple[Any, float]] | None = None,
    ):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.model = model
        self.drafter = drafter
        self.draft_params = draft_params
        self.mode = mode
        self.costs = costs

    def __call__(
        self, prompt_ids: Sequence[int], spec: SpecConfig, *, eos_id: int
    ) -> engine.GenerationResult:
        """Generate for ``prompt_ids``, stopping at ``eos_id``; counted like ``generate``."""
        latency, draft_seconds = (None, 0.0) if self.costs is None else self.costs(len(prompt_ids))
        return generate_torch(
            self.model,
            self.drafter,
            prompt_ids,
            dataclasses.replace(spec, eos_id=eos_id),
            draft_params=self.draft_params,
            mode=self.mode,
            verify_latency=latency,
            draft_seconds=draft_seconds,
        )

    def describe(self) -> dict[str, Any]:
        """The settings in effect (JSON-ready), for the benchmark report."""
        return {
            "backend": "torch",
            "device": str(self.model.device),
            "dtype": str(self.model.dtype).removeprefix("torch."),
            "attention_impl": self.model.attention_impl,
            "mode": self.mode,
        }
