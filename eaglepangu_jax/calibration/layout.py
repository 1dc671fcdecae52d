"""The teacher's weight layout for this machine: with or without the ``[out, in]`` copies.

``llama.prepare_params(..., transposed_copy=True)`` stores every product weight a second
time, ``[out, in]``, and forwards of at least ``llama.TRANSPOSED_MIN_ROWS`` tokens (full
verify trees, prefill) multiply those copies. Whether that pays depends on the CPU and on
the kernels XLA picks for it. Both cases were measured on 2 cores (docs/RESULTS.md). On an
Intel Xeon the 9-slot verify ran 13% faster with the copies. On an AMD EPYC it ran 20-28%
slower, at every row count from 5 up. So no layout can be fixed in the code. The first run
on a machine times the engine's verify forward at :data:`PROBE_SLOTS` slots in both layouts,
interleaved. It keeps the copies only if they are at least :data:`MIN_GAIN` faster, since
they double the weights' memory. The result is saved, atomically, beside the calibration
(:data:`FILE_NAME`) with the machine, the teacher's shape and the XLA flags it was measured
under (all in :func:`~.store.describe_machine`). A file for another machine, teacher or
flags is measured again. So is a corrupt one,
with a warning.

:func:`machine_layout` is the entry point; ``runtime.load_teacher()`` calls it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import statistics
import sys
from pathlib import Path
from typing import Any, Mapping

from eaglepangu_jax.calibration.measure import measure_grids
from eaglepangu_jax.calibration.store import (
    CalibrationFileError,
    describe_machine,
    dtype_name,
    non_negative,
    same_machine,
    teacher_fingerprint,
    timestamp,
)
from eaglepangu_jax.engine import step
from eaglepangu_jax.engine.decode import Teacher
from eaglepangu_jax.files import write_text_atomic
from eaglepangu_jax.methods.registry import DEFAULT_BUDGET
from eaglepangu_jax.models import few_row, llama
from eaglepangu_jax.models.config import LlamaConfig

__all__ = [
    "FORMAT",
    "VERSION",
    "FILE_NAME",
    "PROBE_SLOTS",
    "PROBE_CONTEXT",
    "PROBE_REPEATS",
    "MIN_GAIN",
    "LayoutProbe",
    "copies_pay",
    "with_layout",
    "probe_layout",
    "default_layout_path",
    "save_probe",
    "load_probe",
    "saved_probe",
    "machine_layout",
]

log = logging.getLogger(__name__)

FORMAT = "eaglepangu-teacher-layout"
VERSION = 1
FILE_NAME = "teacher_layout.json"

# The engine's verify bucket for its default 8-node trees (9 slots): the smallest bucket
# that reads the copies (llama.TRANSPOSED_MIN_ROWS = 5), the one the n-gram drafters fill.
PROBE_SLOTS = step.slot_buckets(DEFAULT_BUDGET + 1)[-1]
PROBE_CONTEXT = 128  # the quick calibration's context (calibration.auto.QUICK_CONTEXTS)
PROBE_REPEATS = 9
# The copies cost a second copy of the weights (425 MB for SmolLM2-135M in float32): a
# layout within 3% of the other is not worth that memory.
MIN_GAIN = 0.03


@dataclasses.dataclass(frozen=True, kw_only=True)
class LayoutProbe:
    """One machine's timing of the verify forward in both weight layouts.

    Attributes:
      teacher: :func:`~.store.teacher_fingerprint` of the teacher's shape and dtype.
      machine: :func:`~.store.describe_machine` of the machine that measured (with the
        ``XLA_FLAGS`` it ran under: they change the kernels XLA picks).
      date: ISO 8601 UTC time of the measurement.
      slots, context: the verify forward timed (tokens, committed tokens before them).
      with_copies, in_out_only: every timed run of each layout, seconds.
    """

    teacher: str
    machine: Mapping[str, Any]
    date: str
    slots: int
    context: int
    with_copies: tuple[float, ...]
    in_out_only: tuple[float, ...]

    @property
    def with_copies_seconds(self) -> float:
        return statistics.median(self.with_copies)

    @property
    def in_out_seconds(self) -> float:
        return statistics.median(self.in_out_only)

    @property
    def transposed_copy(self) -> bool:
        """Whether the teacher should carry the ``[out, in]`` copies on this machine."""
        return copies_pay(self.with_copies_seconds, self.in_out_seconds)

    def describe(self) -> str:
        choice = "with" if self.transposed_copy else "without"
        return (
            f"{choice} the [out, in] weight copies (a {self.slots}-slot verify: "
            f"{1e3 * self.with_copies_seconds:.1f} ms with them, "
            f"{1e3 * self.in_out_seconds:.1f} ms without)"
        )


def copies_pay(
    with_copies_seconds: float, in_out_seconds: float, min_gain: float = MIN_GAIN
) -> bool:
    """True when the copies make the forward at least ``min_gain`` faster (a fraction)."""
    return with_copies_seconds <= (1.0 - min_gain) * in_out_seconds


def with_layout(teacher: Teacher, *, transposed_copy: bool) -> Teacher:
    """``teacher`` with the ``[out, in]`` copies made or dropped; the ``[in, out]`` weights
    are shared, not copied."""
    if llama.has_transposed_copy(teacher.params) == transposed_copy:
        return teacher
    return Teacher(teacher.config, teacher.params, transposed_copy=transposed_copy)


def probe_layout(
    teacher: Teacher,
    *,
    slots: int = PROBE_SLOTS,
    context: int = PROBE_CONTEXT,
    repeats: int = PROBE_REPEATS,
    bar: Any = None,
) -> LayoutProbe:
    """Time the engine's verify forward of ``slots`` tokens after ``context`` in both
    layouts, interleaved (see :func:`~.measure.measure_grids`)."""
    if slots < llama.TRANSPOSED_MIN_ROWS:
        raise ValueError(
            f"a forward of {slots} slots never reads the copies (they serve "
            f"{llama.TRANSPOSED_MIN_ROWS} or more): probe at least that many"
        )
    samples = measure_grids(
        {
            "with_copies": with_layout(teacher, transposed_copy=True),
            "in_out_only": with_layout(teacher, transposed_copy=False),
        },
        [slots],
        [context],
        repeats,
        bar=bar,
    )
    return LayoutProbe(
        teacher=teacher_fingerprint(teacher.config, dtype_name(teacher)),
        machine=describe_machine(),
        date=timestamp(),
        slots=slots,
        context=context,
        with_copies=samples["with_copies"][0].times,
        in_out_only=samples["in_out_only"][0].times,
    )


def default_layout_path() -> Path:
    """``teacher_layout.json`` in the cache folder, beside ``calibration.json``."""
    from eaglepangu_jax.models.weights_cache import resolve_cache_dir

    return resolve_cache_dir() / FILE_NAME


def save_probe(probe: LayoutProbe, path: str | os.PathLike | None = None) -> Path:
    """Write ``probe`` as JSON, atomically. Returns the path."""
    target = Path(path) if path is not None else default_layout_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    document = {
        "format": FORMAT,
        "version": VERSION,
        **dataclasses.asdict(probe),
        "transposed_copy": probe.transposed_copy,
    }
    write_text_atomic(target, json.dumps(document, indent=1, sort_keys=True) + "\n")
    return target


def load_probe(path: str | os.PathLike | None = None) -> LayoutProbe:
    """Read a file written by :func:`save_probe`.

    Raises:
      FileNotFoundError: no file there.
      CalibrationFileError: the file is corrupt, not a layout probe, or of another version.
    """
    target = Path(path) if path is not None else default_layout_path()
    try:
        data = json.loads(target.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
        raise CalibrationFileError(f"teacher layout file {target} is corrupt ({err})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise CalibrationFileError(f"{target} is not a teacher layout file")
    if data.get("version") != VERSION:
        raise CalibrationFileError(
            f"teacher layout file {target} is version {data.get('version')!r}; "
            f"this library reads version {VERSION}"
        )
    try:
        probe = LayoutProbe(
            teacher=str(data["teacher"]),
            machine=dict(data["machine"]),
            date=str(data["date"]),
            slots=int(data["slots"]),
            context=int(data["context"]),
            with_copies=tuple(non_negative(t, "with_copies") for t in data["with_copies"]),
            in_out_only=tuple(non_negative(t, "in_out_only") for t in data["in_out_only"]),
        )
    except (KeyError, TypeError, ValueError) as err:
        raise CalibrationFileError(
            f"teacher layout file {target} has a missing or bad field ({err!r})"
        ) from None
    if not probe.with_copies or not probe.in_out_only:
        raise CalibrationFileError(f"teacher layout file {target} holds no timings")
    return probe


def machine_layout(
    teacher: Teacher,
    *,
    path: str | os.PathLike | None = None,
    progress: bool = True,
) -> tuple[Teacher, LayoutProbe]:
    """``teacher`` in the layout that verifies faster on this machine, and the timing that
    chose it: read from ``path`` (default: :func:`default_layout_path`) when that file was
    measured for this teacher's shape on this machine under these XLA flags; otherwise
    measured now (a few seconds of compiling and timing, reported on stderr) and saved."""
    target = Path(path) if path is not None else default_layout_path()
    probe = saved_probe(teacher.config, dtype_name(teacher), target)
    if probe is None:
        _say(f"timing the teacher's two weight layouts on this machine (once; saved to {target})")
        bar = _bar(progress)
        try:
            probe = probe_layout(teacher, bar=bar)
        finally:
            if bar is not None:
                bar.close()
        save_probe(probe, target)
        _say(f"the teacher runs {probe.describe()}")
        reason = few_row.unavailable_reason()
        _say(
            "small verify trees multiply on the few-row product kernel"
            if reason is None
            else f"small verify trees multiply with XLA's products ({reason})"
        )
    return with_layout(teacher, transposed_copy=probe.transposed_copy), probe


def saved_probe(
    config: LlamaConfig, dtype: str = "float32", path: str | os.PathLike | None = None
) -> LayoutProbe | None:
    """The saved probe at ``path`` (default: :func:`default_layout_path`) if it was measured
    for a teacher of this shape and dtype, on this machine, under these XLA flags; else
    ``None`` (a corrupt file is logged as a warning)."""
    target = Path(path) if path is not None else default_layout_path()
    try:
        probe = load_probe(target)
    except FileNotFoundError:
        return None
    except (OSError, CalibrationFileError) as err:
        log.warning("%s: measuring the layouts again", err)
        return None
    if probe.teacher != teacher_fingerprint(config, dtype):
        log.info("teacher layout file %s is for another teacher: measuring again", target)
        return None
    if not same_machine(probe):
        log.info(
            "teacher layout file %s is from another machine or other XLA flags: measuring again",
            target,
        )
        return None
    return probe


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _bar(enabled: bool):
    if not enabled:
        return None
    from tqdm.auto import tqdm

    # measure_grids ticks once per compile and once per timed call, for each layout.
    return tqdm(total=2 * (1 + PROBE_REPEATS), desc="layout", unit="run", file=sys.stderr)
