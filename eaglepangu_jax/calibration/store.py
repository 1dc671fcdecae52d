"""Calibration files: the measured record of one machine and teacher, saved as versioned JSON.

A :class:`MachineCalibration` holds the measured verify-cost grid, the fitted roofline
coefficients, the per-round overhead and the drafting costs, with the fingerprints of the
teacher and of the machine it was measured on. It is written atomically; a file that is
corrupt, of another version, for another teacher or from another machine is refused with a
message naming the problem (:class:`CalibrationFileError`).
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import logging
import math
import os
import platform
from pathlib import Path
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from eaglepangu_jax import budget as budget_lib
from eaglepangu_jax.engine import decode as gen
from eaglepangu_jax.files import write_text_atomic
from eaglepangu_jax.models import few_row
from eaglepangu_jax.models.config import LlamaConfig

__all__ = [
    "FORMAT",
    "VERSION",
    "FILE_NAME",
    "FIT_KEYS",
    "CalibrationFileError",
    "Sample",
    "MachineCalibration",
    "teacher_fingerprint",
    "describe_machine",
    "MACHINE_KEYS",
    "same_machine",
    "dtype_name",
    "timestamp",
    "default_path",
    "to_json",
    "save_calibration",
    "load_calibration",
    "describe_config",
    "non_negative",
]

log = logging.getLogger(__name__)

FORMAT = "eaglepangu-calibration"
# 2: the engine's teacher multiplies full verify trees with [out, in] weight copies
# (models.llama.prepare_params(transposed_copy=True)), so version-1 timings overstate them.
# 3: the engine verifies at a 2-slot bucket too (engine.verification.slot_buckets); a
# version-2 file has no 2-slot timing, and interpolating one between 1 and 4 slots
# overstates it (measured 1.03x one slot, against 1.3x for four).
VERSION = 3
FILE_NAME = "calibration.json"


FIT_KEYS = ("a_c", "b_c", "a_m", "b_m")


class CalibrationFileError(ValueError):
    """A calibration file is corrupt, of another version, or for another teacher."""


# ----------------------------------------------------------------------------- the record


@dataclasses.dataclass(frozen=True, kw_only=True)
class Sample:
    """One grid point: the median seconds of the engine's verify forward.

    Attributes:
      slots: ``s``, tokens in the forward (root + draft nodes).
      context: ``c``, committed tokens in the cache.
      window: ``W``, the attention window the engine uses there (cache slots read).
      seconds: median of ``times``.
      times: every timed run, seconds.
    """

    slots: int
    context: int
    window: int
    seconds: float
    times: tuple[float, ...]


@dataclasses.dataclass(frozen=True, kw_only=True)
class MachineCalibration:
    """A saved calibration: fitted roofline, raw samples and per-round overheads.

    Attributes:
      teacher: fingerprint of the teacher's shape and dtype (:func:`teacher_fingerprint`).
      teacher_config: the teacher's :class:`LlamaConfig` fields, for humans.
      dtype: parameter dtype name.
      machine: :func:`describe_machine` of the machine that measured.
      date: ISO 8601 UTC time of the measurement.
      peak_flops, bandwidth, bytes_per_param: the roofline figures the fit is relative to.
      a_c, b_c, a_m, b_m: fitted coefficients (see :class:`budget.Calibration`).
      samples: the measured grid.
      t_other: seconds per round outside drafting and verification.
      t_draft: seconds per round of drafting, by drafter name.
      details: how the overheads were measured (contexts, rounds, settings).
    """

    teacher: str
    teacher_config: Mapping[str, Any]
    dtype: str
    machine: Mapping[str, Any]
    date: str
    peak_flops: float
    bandwidth: float
    bytes_per_param: float
    a_c: float
    b_c: float
    a_m: float
    b_m: float
    samples: tuple[Sample, ...] = ()
    t_other: float = 0.0
    t_draft: Mapping[str, float] = dataclasses.field(default_factory=dict)
    details: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def coefficients(self) -> budget_lib.Calibration:
        """The fit as the budget module's :class:`~budget.Calibration`."""
        return budget_lib.Calibration(*(jnp.float32(getattr(self, k)) for k in FIT_KEYS))

    def roofline(self, config: LlamaConfig) -> budget_lib.Roofline:
        """The roofline the coefficients were fitted on, for ``config``."""
        return budget_lib.Roofline.for_llama(
            config,
            peak_flops=self.peak_flops,
            bandwidth=self.bandwidth,
            bytes_per_param=self.bytes_per_param,
        )


def teacher_fingerprint(config: LlamaConfig, dtype: str = "float32") -> str:
    """sha256 of everything that sets a forward's cost: the config's fields and the dtype.

    The weights' values do not change the cost, so a calibration serves any teacher of the
    same shape.
    """
    text = json.dumps({"config": dataclasses.asdict(config), "dtype": str(dtype)}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def describe_machine() -> dict[str, Any]:
    """The host and accelerator a calibration belongs to, the XLA flags it ran under (they
    change the kernels XLA picks: the test suite compiles at -O0, for one) and whether the
    few-row product kernel ran (:func:`eaglepangu_jax.models.few_row.identity`: it changes
    what a small verify costs)."""
    device = jax.devices()[0]
    return {
        "xla_flags": os.environ.get("XLA_FLAGS", "").strip(),
        "few_row_kernel": few_row.identity(),
        "system": platform.system(),
        "machine": platform.machine(),
        "processor": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "backend": jax.default_backend(),
        "device_kind": device.device_kind,
        "device_count": jax.device_count(),
        "jax_version": jax.__version__,
        "python": platform.python_version(),
    }


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


# A calibration (or layout probe) from before the flags (or the kernel) were recorded is
# measured again.
MACHINE_KEYS = ("machine", "processor", "backend", "device_kind", "xla_flags", "few_row_kernel")


def same_machine(calibration: MachineCalibration) -> bool:
    """True when ``calibration`` (or another record with a ``machine`` description, such as
    a :class:`~.layout.LayoutProbe`) was measured on this kind of host and accelerator."""
    here = describe_machine()
    return all(calibration.machine.get(k) == here[k] for k in MACHINE_KEYS)


def dtype_name(teacher: gen.Teacher) -> str:
    return str(np.dtype(teacher.params["embed"].dtype))


def timestamp() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def default_path() -> Path:
    """Where calibrations live unless told otherwise: ``calibration.json`` in the cache
    folder (``$EAGLEPANGU_CACHE``, else ``~/.cache/eaglepangu``)."""
    from eaglepangu_jax.models.weights_cache import resolve_cache_dir

    return resolve_cache_dir() / FILE_NAME


def to_json(calibration: MachineCalibration) -> dict[str, Any]:
    """The JSON document of a calibration."""
    c = calibration
    return {
        "format": FORMAT,
        "version": VERSION,
        "date": c.date,
        "machine": dict(c.machine),
        "teacher": {"fingerprint": c.teacher, "dtype": c.dtype, "config": dict(c.teacher_config)},
        "roofline": {
            "peak_flops": c.peak_flops,
            "bandwidth": c.bandwidth,
            "bytes_per_param": c.bytes_per_param,
            "context": "attention window",
        },
        "fit": {k: getattr(c, k) for k in FIT_KEYS},
        "t_other": c.t_other,
        "t_draft": dict(c.t_draft),
        "samples": [dataclasses.asdict(x) for x in c.samples],
        "details": dict(c.details),
    }


def save_calibration(
    calibration: MachineCalibration, path: str | os.PathLike | None = None
) -> Path:
    """Write ``calibration`` as indented JSON, atomically (default: :func:`default_path`)."""
    path = Path(path) if path is not None else default_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(to_json(calibration), indent=2, allow_nan=False) + "\n")
    return path


def load_calibration(
    path: str | os.PathLike | None = None,
    *,
    config: LlamaConfig | None = None,
    dtype: str = "float32",
) -> MachineCalibration:
    """Read a calibration written by :func:`save_calibration`.

    Args:
      path: the file (default: :func:`default_path`).
      config, dtype: when ``config`` is given, the calibration must be for a teacher of this
        shape and dtype.

    Raises:
      FileNotFoundError: no file there (the message says how to make one).
      CalibrationFileError: the file is not valid JSON, not a calibration, of another format
        version, has missing or bad fields, or belongs to another teacher.
    """
    path = Path(path) if path is not None else default_path()
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FileNotFoundError(
            f"no calibration at {path}; measure one with 'eaglepangu calibrate'"
        ) from None
    except UnicodeDecodeError as err:
        raise CalibrationFileError(
            f"calibration {path} is corrupt (not UTF-8 text: {err}); "
            f"measure it again with 'eaglepangu calibrate'"
        ) from None
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as err:
        raise CalibrationFileError(
            f"calibration {path} is corrupt (not JSON: {err}); "
            f"measure it again with 'eaglepangu calibrate'"
        ) from None
    calibration = _from_json(data, path)
    if config is not None and calibration.teacher != teacher_fingerprint(config, dtype):
        raise CalibrationFileError(
            f"calibration {path} was measured for another teacher "
            f"({describe_config(calibration.teacher_config, calibration.dtype)}), not this "
            f"one ({describe_config(dataclasses.asdict(config), dtype)})"
        )
    return calibration


def describe_config(fields: Mapping[str, Any], dtype: str) -> str:
    keys = ("num_layers", "hidden_size", "intermediate_size", "vocab_size")
    return ", ".join(f"{k}={fields.get(k)}" for k in keys) + f", {dtype}"


def _from_json(data: Any, path: Path) -> MachineCalibration:
    def bad(why: str) -> CalibrationFileError:
        return CalibrationFileError(
            f"calibration {path} is corrupt: {why}; measure it again with 'eaglepangu calibrate'"
        )

    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise bad(f"it is not a {FORMAT} file")
    if data.get("version") != VERSION:
        raise CalibrationFileError(
            f"calibration {path} has format version "
            f"{data.get('version')!r}, this code reads version "
            f"{VERSION}; measure it again with 'eaglepangu calibrate'"
        )
    try:
        teacher, roof, fit = data["teacher"], data["roofline"], data["fit"]
        numbers = {k: non_negative(fit[k], k) for k in FIT_KEYS}
        for k in ("peak_flops", "bandwidth", "bytes_per_param"):
            numbers[k] = non_negative(roof[k], k)
            if numbers[k] == 0:
                raise ValueError(f"{k} must be > 0")
        samples = tuple(
            Sample(
                slots=int(x["slots"]),
                context=int(x["context"]),
                window=int(x["window"]),
                seconds=non_negative(x["seconds"], "seconds"),
                times=tuple(non_negative(t, "times") for t in x["times"]),
            )
            for x in data["samples"]
        )
        t_draft = {
            str(k): non_negative(v, f"t_draft[{k}]") for k, v in dict(data["t_draft"]).items()
        }
        return MachineCalibration(
            teacher=str(teacher["fingerprint"]),
            teacher_config=dict(teacher["config"]),
            dtype=str(teacher["dtype"]),
            machine=dict(data["machine"]),
            date=str(data["date"]),
            samples=samples,
            t_other=non_negative(data["t_other"], "t_other"),
            t_draft=t_draft,
            details=dict(data.get("details", {})),
            **numbers,
        )
    except KeyError as err:
        raise bad(f"field {err} is missing") from None
    except (TypeError, ValueError, AttributeError) as err:
        raise bad(str(err)) from None


def non_negative(value: Any, name: str) -> float:
    """``value`` as a float, if it is a finite number >= 0 (not a bool); else ValueError
    naming ``name`` (what a file read back must hold for a time or a coefficient)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be finite and >= 0, got {value!r}")
    return float(value)
