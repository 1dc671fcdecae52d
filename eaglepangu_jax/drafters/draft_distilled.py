"""The shipped distilled draft model as a draft-target drafter (``"draft-distilled"``).

A four-layer Llama of the teacher's width, started from the teacher's first layers and trained
on the self-distilled corpus to predict the teacher's greedy token
(:class:`~eaglepangu_jax.drafters.draft_target_model.DraftModelConfig`; training:
``eaglepangu train-draft --kind draft-model``). It owns its layers, final norm and a head over
the draft vocabulary; it borrows the teacher's embedding. The drafter and its cache handling are
:class:`~eaglepangu_jax.drafters.draft_target.DraftTargetDrafter`'s, as for the truncated
teacher. Model card: ``eaglepangu_jax/weights/DRAFT_DISTILLED_MODEL_CARD.md``.
"""

from __future__ import annotations

from eaglepangu_jax.drafters.draft_target import DraftTargetDrafter
from eaglepangu_jax.drafters.draft_target_model import draft_model_params
from eaglepangu_jax.models.config import LlamaConfig

__all__ = ["SHIPPED_NAME", "DEFAULT_DEPTH", "DEFAULT_TOP_K", "load_shipped_draft_distilled"]

SHIPPED_NAME = "draft_distilled_smollm2"
DEFAULT_DEPTH = 4  # the chain length its held-out figures are reported at (model card)
DEFAULT_TOP_K = 1


def load_shipped_draft_distilled(
    teacher_params: dict | None = None,
    *,
    budget: int = 8,
    depth: int = DEFAULT_DEPTH,
    top_k: int = DEFAULT_TOP_K,
    temperature: float = 0.0,
    top_p: float = 1.0,
) -> tuple[DraftTargetDrafter, dict]:
    """The packaged distilled draft for SmolLM2-135M-Instruct: ``(drafter, params)``.

    Args:
      teacher_params: the teacher's parameters (for the frozen embedding); loaded when
        ``None``. The teacher weight file must be the one the draft was trained for.
      budget, depth, top_k, temperature, top_p: the drafter's settings
        (:class:`DraftTargetDrafter`).

    Raises:
      ValueError: the installed teacher is not the one the draft was trained for, or the
        packaged files are malformed.
    """
    from eaglepangu_jax.drafters.shipped import load_packaged

    config, head, d2t, embed, _ = load_packaged(SHIPPED_NAME, "draft-model", teacher_params)
    drafter = DraftTargetDrafter(
        config=config.llama_config(),
        teacher_config=LlamaConfig.smollm2_135m(),
        budget=budget,
        depth=depth,
        top_k=top_k,
        temperature=temperature,
        top_p=top_p,
    )
    return drafter, draft_model_params(head, config, embed, d2t)
