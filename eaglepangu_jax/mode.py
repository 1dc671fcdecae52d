"""The reference / performance switch, read from ``EAGLEPANGU_MODE`` here and nowhere else.

* ``performance`` (default): no value checks inside compiled code; every gather is made safe by
  construction (indices clipped or sanitised), so hostile input degrades to padding, never to an
  out-of-range access.
* ``reference``: invariant checks run inside jitted code (``jax.experimental.checkify``) and
  raise a clear error naming the first bad node; the eager attention path is used.

The mode is read at *trace* time: a function jitted in one mode keeps that mode's behaviour,
and two ``jax.jit`` wrappers of the same function share one trace cache, so put the mode in the
static arguments of anything jitted (the engine's ``StepStatic`` does). Use :func:`checked`
around a jitted function that may emit checks so that they raise in reference mode.
"""

from __future__ import annotations

import functools
import os
from typing import Callable, Literal, TypeVar

from jax.experimental import checkify

__all__ = ["ENV_VAR", "MODES", "Mode", "F", "current", "is_reference", "checked"]

ENV_VAR = "EAGLEPANGU_MODE"
MODES = ("reference", "performance")
Mode = Literal["reference", "performance"]

F = TypeVar("F", bound=Callable)


def current() -> Mode:
    """The active mode; raises ``ValueError`` for an unknown value of ``EAGLEPANGU_MODE``."""
    value = os.environ.get(ENV_VAR, "performance").strip().lower() or "performance"
    if value not in MODES:
        raise ValueError(f"{ENV_VAR}={value!r} is not a mode; expected one of {MODES}")
    return value  # type: ignore[return-value]


def is_reference() -> bool:
    """True when invariant checks should run (``EAGLEPANGU_MODE=reference``)."""
    return current() == "reference"


def checked(fn: F) -> F:
    """Wrap ``fn`` so that checkify checks it emits raise, in reference mode.

    In performance mode the checks are never emitted, so ``fn`` is returned as is. Wrap a
    jitted function (``checked(jax.jit(f))``), not the other way round: the error is
    functionalised through the compiled computation and thrown on the host afterwards.
    """

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if not is_reference():
            return fn(*args, **kwargs)
        err, out = checkify.checkify(fn, errors=checkify.user_checks)(*args, **kwargs)
        err.throw()
        return out

    return wrapper  # type: ignore[return-value]
