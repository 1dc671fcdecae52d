"""Which torch device to run on: npu > cuda > cpu, or what ``EAGLEPANGU_DEVICE`` asks for.

An Ascend NPU is usable only when three things hold, checked in this order:

1. the ``torch_npu`` package is installed (``pip install eaglepangu[npu]``);
2. it imports, which needs the CANN toolkit's libraries (its environment script sourced);
3. ``torch.npu.is_available()``: the driver sees at least one device.

:func:`probe_npu` reports which of them failed, and :func:`select_device` names it in the
error when the user asked for ``npu`` explicitly.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os

ENV_VAR = "EAGLEPANGU_DEVICE"
DEVICE_TYPES = ("npu", "cuda", "cpu")

# Indirections so tests can stand in for an installed / broken / device-less torch_npu.
_find_spec = importlib.util.find_spec
_import_module = importlib.import_module


class DeviceUnavailableError(RuntimeError):
    """The requested device cannot be used; the message says which prerequisite is missing."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class NpuStatus:
    """Outcome of :func:`probe_npu`; ``available`` only when every step succeeded."""

    installed: bool
    import_error: str | None = None
    device_count: int = 0

    @property
    def available(self) -> bool:
        return self.installed and self.import_error is None and self.device_count > 0

    def reason(self) -> str:
        """A sentence naming the first missing prerequisite ("" when available)."""
        if not self.installed:
            return (
                "the torch_npu package is not installed "
                "(install the 'npu' extra: pip install eaglepangu[npu])"
            )
        if self.import_error is not None:
            return (
                "torch_npu is installed but failed to import; the CANN toolkit is missing "
                f"or its environment is not set up ({self.import_error})"
            )
        if self.device_count == 0:
            return "torch_npu imported but torch.npu.is_available() is False: no NPU device found"
        return ""


def probe_npu() -> NpuStatus:
    """Check for a usable Ascend NPU without raising."""
    try:
        spec = _find_spec("torch_npu")
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        return NpuStatus(installed=False)
    try:
        import torch

        _import_module("torch_npu")
        npu = getattr(torch, "npu", None)
        if npu is None or not npu.is_available():
            return NpuStatus(installed=True)
        return NpuStatus(installed=True, device_count=int(npu.device_count()))
    # torch_npu surfaces a missing CANN toolkit as ImportError, OSError (shared libraries) or
    # RuntimeError (initialisation) depending on the version.
    except (ImportError, OSError, RuntimeError) as error:
        return NpuStatus(installed=True, import_error=f"{type(error).__name__}: {error}")


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def select_device(requested: str | None = None) -> str:
    """The torch device string to use.

    Args:
        requested: ``"npu"``, ``"cuda"``, ``"cpu"`` (optionally with an index, ``"npu:1"``)
            or ``"auto"``. ``None`` reads ``EAGLEPANGU_DEVICE`` (default ``"auto"``).

    Returns:
        The device string; ``"auto"`` picks npu, then cuda, then cpu.

    Raises:
        ValueError: for an unknown device name.
        DeviceUnavailableError: when an explicitly requested accelerator is not usable.
    """
    value = requested if requested is not None else os.environ.get(ENV_VAR, "auto")
    value = value.strip().lower() or "auto"
    kind, sep, index = value.partition(":")
    if value != "auto" and (kind not in DEVICE_TYPES or (sep and not index.isdigit())):
        raise ValueError(
            f"unknown device {value!r} (from {'argument' if requested is not None else ENV_VAR});"
            f" expected 'auto' or one of {DEVICE_TYPES}, optionally with ':<index>'"
        )
    if value == "auto":
        if probe_npu().available:
            return "npu"
        return "cuda" if _cuda_available() else "cpu"
    if kind == "npu":
        status = probe_npu()
        if not status.available:
            raise DeviceUnavailableError(f"device {value!r} requested but {status.reason()}")
        if index and int(index) >= status.device_count:
            raise DeviceUnavailableError(
                f"device {value!r} requested but only {status.device_count} NPU(s) are visible"
            )
    if kind == "cuda" and not _cuda_available():
        raise DeviceUnavailableError(
            f"device {value!r} requested but torch.cuda.is_available() is False"
        )
    return value


def torch_device(name: str):
    """``torch.device(name)``, importing torch_npu first for an NPU (torch only knows the
    ``npu`` type once it is registered); ``DeviceUnavailableError`` when that fails."""
    import torch

    if str(name).partition(":")[0] == "npu":
        try:
            _import_module("torch_npu")
        except ImportError as error:
            raise DeviceUnavailableError(
                f"device {name!r} requested but {probe_npu().reason()}"
            ) from error
    return torch.device(name)
