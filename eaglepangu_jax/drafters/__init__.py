"""Drafters by name: each is a frozen dataclass implementing
:class:`eaglepangu_jax.engine.drafter.Drafter`. Register a new one with one line in
:data:`DRAFTERS`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from eaglepangu_jax.drafters.ngram import NGramDrafter

DRAFTERS: dict[str, type] = {
    "ngram": NGramDrafter,
    "eagle3": __import__("eaglepangu_jax.drafters.eagle3", fromlist=["Eagle3Drafter"]).Eagle3Drafter,
    "block": __import__("eaglepangu_jax.drafters.block", fromlist=["BlockDrafter"]).BlockDrafter,
}


def make_drafter(name: str, **kwargs: Any) -> Any:
    """Build the drafter registered as ``name`` with hyper-parameters ``kwargs``.

    Raises:
      ValueError: unknown name, or a keyword the drafter does not have.
    """
    if name not in DRAFTERS:
        raise ValueError(f"unknown drafter {name!r}; known drafters: {sorted(DRAFTERS)}")
    cls = DRAFTERS[name]
    if dataclasses.is_dataclass(cls):
        known = {f.name for f in dataclasses.fields(cls) if f.init}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"drafter {name!r} has no hyper-parameter(s) {unknown}; "
                             f"known: {sorted(known)}")
    return cls(**kwargs)


__all__ = ["DRAFTERS", "NGramDrafter", "make_drafter"]
