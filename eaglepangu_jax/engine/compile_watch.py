"""Watching for compilation: JAX's tracing, lowering, XLA compiles and persistent-cache reads,
as reported by ``jax.monitoring``.

Timings that include compilation say nothing about the program's speed: the benchmark
discards and re-runs a generation that compiled, and the decode loop does not feed such a
segment to the controller's cost correction (:mod:`eaglepangu_jax.engine.costs`).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Iterator

import jax

__all__ = ["CompileWatch"]

_COMPILE_EVENTS = (
    "/jax/core/compile/backend_compile_duration",
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/compilation_cache/cache_retrieval_time_sec",
)


class CompileWatch:
    """Records compilation work (tracing, lowering, XLA compiles, persistent-cache reads)
    while active, through ``jax.monitoring``."""

    def __init__(self):
        self.events: list[tuple[float, float]] = []  # (perf_counter at the end, seconds)

    @property
    def seconds(self) -> float:
        """Seconds of all recorded compilation work."""
        return sum(d for _, d in self.events)

    def seconds_after(self, t: float) -> float:
        """Seconds of the work that ended after ``time.perf_counter() == t``."""
        return sum(d for end, d in self.events if end > t)

    def _listen(self, event: str, duration: float, **kwargs: Any) -> None:
        if event in _COMPILE_EVENTS:
            self.events.append((time.perf_counter(), duration))

    @contextlib.contextmanager
    def active(self) -> Iterator["CompileWatch"]:
        jax.monitoring.register_event_duration_secs_listener(self._listen)
        try:
            yield self
        finally:
            jax.monitoring.unregister_event_duration_listener(self._listen)
