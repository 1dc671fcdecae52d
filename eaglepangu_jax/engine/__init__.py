"""The speculative decoding engine: one round as a pure function, the on-device loop, and
``generate`` on top.

* :class:`SpecConfig`: the frozen settings of a run (tree policy, budget, acceptance).
* :class:`Teacher`: a model config plus its prepared parameters.
* :func:`generate`, :func:`generate_batch`, :func:`sample_many`: decoding entry points;
  :func:`greedy_batch`: plain greedy decoding of many prompts at once (the corpus path).
* :class:`Drafter`, :class:`DraftContext`, :class:`Proposal`: the drafter protocol;
  :func:`fit_budget`: a run's budget lowered to the nodes its drafter's trees can hold.
* :class:`CostCorrection`: the controller's latency curve corrected from measured times.
"""

from eaglepangu_jax.engine.config import POLICIES, SpecConfig
from eaglepangu_jax.engine.costs import CostCorrection
from eaglepangu_jax.engine.decode import (
    GenerationResult,
    GenerationStats,
    Teacher,
    generate,
    generate_batch,
    result_from_state,
)
from eaglepangu_jax.engine.drafter import DraftContext, Drafter, Proposal, fit_budget
from eaglepangu_jax.engine.plain_batch import greedy_batch
from eaglepangu_jax.engine.sampling import sample_many
from eaglepangu_jax.engine.state import DecodeState

__all__ = [
    "POLICIES",
    "CostCorrection",
    "DecodeState",
    "DraftContext",
    "Drafter",
    "GenerationResult",
    "GenerationStats",
    "Proposal",
    "SpecConfig",
    "Teacher",
    "fit_budget",
    "generate",
    "generate_batch",
    "greedy_batch",
    "result_from_state",
    "sample_many",
]
