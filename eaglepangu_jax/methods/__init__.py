"""Decoding methods by name (greedy, the drafters, transformers peers): see
:mod:`eaglepangu_jax.methods.registry`."""

from eaglepangu_jax.methods.registry import (
    DEFAULT_BUDGET,
    DEFAULT_DEPTH,
    DRAFTER_BUDGETS,
    METHODS,
    REFERENCE,
    DrafterUnavailableError,
    Method,
    make_method,
    parse_methods,
    split_method,
)

__all__ = [
    "DEFAULT_BUDGET",
    "DEFAULT_DEPTH",
    "DRAFTER_BUDGETS",
    "METHODS",
    "REFERENCE",
    "DrafterUnavailableError",
    "Method",
    "make_method",
    "parse_methods",
    "split_method",
]
