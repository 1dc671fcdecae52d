"""Drafters by name: the one list of drafter names, and how to build or load each.

Every drafter is a frozen dataclass implementing :class:`eaglepangu_jax.engine.drafter.Drafter`.
Register a new one with one line in :data:`DRAFTERS` (and, if it ships trained weights, a
``load_shipped_<name>`` function in its module). The command line, the benchmark methods, the
calibration and the experiments all read their drafter names from here.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

from eaglepangu_jax.drafters.block import BlockDrafter
from eaglepangu_jax.drafters.draft_target import DraftTargetDrafter
from eaglepangu_jax.drafters.eagle3 import Eagle3Drafter
from eaglepangu_jax.drafters.fallback import FallbackDrafter
from eaglepangu_jax.drafters.ngram import NGramDrafter
from eaglepangu_jax.drafters.ngram_corpus import CorpusNGramDrafter

__all__ = [
    "DRAFTERS",
    "NAMES",
    "TRAINED",
    "MARGINAL",
    "DrafterUnavailableError",
    "make_drafter",
    "load_shipped",
    "configure_drafter",
]

DRAFTERS: dict[str, type] = {
    "ngram": NGramDrafter,
    "ngram-corpus": CorpusNGramDrafter,  # n-gram plus the corpus table (packaged counts)
    "eagle3": Eagle3Drafter,
    "block": BlockDrafter,
    "draft-target": DraftTargetDrafter,  # an independent draft LM (truncated teacher: methods)
    "draft-distilled": DraftTargetDrafter,  # the same with the shipped distilled draft model
    "mtp": Eagle3Drafter,  # single-token speculation: the EAGLE-3 head at depth 1 (drafters/mtp)
    # n-gram's tree with the shipped EAGLE-3 head's node beside it, or alone without a match
    "ngram-eagle3": FallbackDrafter,
}
NAMES: tuple[str, ...] = tuple(DRAFTERS)
# Drafters whose weights ship with the library (loaded by :func:`load_shipped`).
TRAINED: tuple[str, ...] = ("eagle3", "block", "mtp", "draft-distilled", "ngram-corpus")
# Drafters that propose per-depth marginals, which a tree policy shapes (best-first, auto),
# rather than a ready tree.
MARGINAL: tuple[str, ...] = ("block",)


class DrafterUnavailableError(RuntimeError):
    """A drafter (or peer) was asked for that this installation cannot provide (the message
    says why)."""


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
            raise ValueError(
                f"drafter {name!r} has no hyper-parameter(s) {unknown}; known: {sorted(known)}"
            )
    return cls(**kwargs)


def load_shipped(name: str, **kwargs: Any) -> tuple[Any, Any]:
    """A shipped drafter and its weights: ``drafters.<name>.load_shipped_<name>(**kwargs)``
    (``-`` in ``name`` read as ``_``).

    Raises:
      DrafterUnavailableError: the drafter module or its shipped weights are missing or
        unreadable (the message says which).
    """
    ident = name.replace("-", "_")
    module_name = f"eaglepangu_jax.drafters.{ident}"
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        if isinstance(err, ModuleNotFoundError) and err.name == module_name:
            raise DrafterUnavailableError(
                f"the {name} drafter is not part of this installation"
            ) from None
        raise DrafterUnavailableError(f"the {name} drafter cannot be imported: {err}") from err
    loader = getattr(module, f"load_shipped_{ident}", None)
    if loader is None:
        raise DrafterUnavailableError(f"the {name} module has no load_shipped_{ident}()")
    try:
        return loader(**kwargs)
    except (ImportError, OSError, ValueError, KeyError) as err:
        raise DrafterUnavailableError(
            f"the {name} shipped weights could not be loaded: {err}"
        ) from err


def configure_drafter(drafter: Any, *, budget: int, depth: int) -> Any:
    """``drafter`` with its ``budget`` / ``depth`` hyper-parameters set, where it has them
    (a drafter made of others, such as :class:`~.fallback.FallbackDrafter`, sets its parts')."""
    configured = getattr(drafter, "configured", None)
    if configured is not None:
        return configured(budget=budget, depth=depth, configure=configure_drafter)
    if not dataclasses.is_dataclass(drafter):
        return drafter
    fields = {f.name for f in dataclasses.fields(drafter) if f.init}
    changes = {k: v for k, v in (("budget", budget), ("depth", depth)) if k in fields}
    return dataclasses.replace(drafter, **changes) if changes else drafter
