"""MTP-style single-token speculation: one drafted token per round from a head on the
teacher's hidden states.

Multi-token-prediction (MTP) drafting as the Sonar seed describes it proposes exactly one token
per round from a head that reads the teacher's hidden state at position ``t`` and the token
at ``t + 1`` (hidden states and tokens shifted one step against each other), so a round emits
one or two tokens. This library's EAGLE-3 head has exactly that input layout (slot ``j`` reads
the teacher features of ``x_j`` and the embedding of ``x_{j+1}``, :mod:`.eagle3`); run at depth
1 with one candidate it *is* a single-token MTP head, so MTP is the shipped EAGLE-3 head at
depth 1, budget 1, top-k 1, reported as its own method. Its one draft step is the head's first,
trained on teacher features alone (no training-time-test steps involved).
"""

from __future__ import annotations

from eaglepangu_jax.drafters.eagle3 import Eagle3Drafter, load_shipped_eagle3

__all__ = ["load_shipped_mtp"]


def load_shipped_mtp(teacher_params: dict | None = None, **_: object) -> tuple[Eagle3Drafter, dict]:
    """The shipped EAGLE-3 head as a one-token drafter: ``(drafter, params)``.

    Budget, depth and top-k are fixed at 1 (other keywords, e.g. a grid's ``budget``, are
    ignored: a single-token scheme has no tree to size).
    """
    return load_shipped_eagle3(teacher_params, budget=1, depth=1, top_k=1)
