"""Device detection and choice, with the NPU prerequisites stood in for."""

import importlib.machinery
import subprocess
import sys
import types
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from npu_backend import device  # noqa: E402


def _installed(name):
    return importlib.machinery.ModuleSpec(name, None)


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(device, "_cuda_available", lambda: False)


@pytest.fixture
def no_torch_npu(monkeypatch):
    monkeypatch.setattr(device, "_find_spec", lambda name: None)


@pytest.fixture
def broken_torch_npu(monkeypatch):
    def fail(name):
        raise ImportError("libhccl.so: cannot open shared object file")

    monkeypatch.setattr(device, "_find_spec", _installed)
    monkeypatch.setattr(device, "_import_module", fail)


@pytest.fixture
def npu_devices(monkeypatch):
    """torch_npu imports and registers ``torch.npu``; returns a setter for the device count."""
    fake_npu = types.SimpleNamespace(count=0)
    fake_npu.is_available = lambda: fake_npu.count > 0
    fake_npu.device_count = lambda: fake_npu.count
    monkeypatch.setattr(device, "_find_spec", _installed)
    monkeypatch.setattr(device, "_import_module", lambda name: types.ModuleType(name))
    monkeypatch.setattr(torch, "npu", fake_npu, raising=False)

    def set_count(n):
        fake_npu.count = n

    return set_count


def test_missing_package_is_named(no_torch_npu):
    status = device.probe_npu()
    assert not status.installed and not status.available
    with pytest.raises(
        device.DeviceUnavailableError,
        match=r"torch_npu package is not installed"
        r".*pip install eaglepangu\[npu\]",
    ):
        device.select_device("npu")


def test_missing_toolkit_is_named(broken_torch_npu):
    status = device.probe_npu()
    assert status.installed and not status.available
    with pytest.raises(device.DeviceUnavailableError, match=r"CANN toolkit.*libhccl"):
        device.select_device("npu")


def test_missing_device_is_named(npu_devices):
    npu_devices(0)
    with pytest.raises(device.DeviceUnavailableError, match=r"is_available\(\) is False"):
        device.select_device("npu")


def test_auto_prefers_npu_then_cuda_then_cpu(npu_devices, monkeypatch):
    npu_devices(2)
    monkeypatch.setattr(device, "_cuda_available", lambda: True)
    assert device.select_device("auto") == "npu"
    npu_devices(0)
    assert device.select_device("auto") == "cuda"
    monkeypatch.setattr(device, "_cuda_available", lambda: False)
    assert device.select_device("auto") == "cpu"


def test_npu_index_is_checked_against_the_device_count(npu_devices):
    npu_devices(2)
    assert device.select_device("npu:1") == "npu:1"
    with pytest.raises(device.DeviceUnavailableError, match="only 2 NPU"):
        device.select_device("npu:2")


def test_environment_variable_overrides_auto(monkeypatch, npu_devices):
    npu_devices(1)
    monkeypatch.setenv(device.ENV_VAR, "cpu")
    assert device.select_device() == "cpu"
    monkeypatch.setenv(device.ENV_VAR, " NPU ")
    assert device.select_device() == "npu"
    monkeypatch.delenv(device.ENV_VAR)
    assert device.select_device() == "npu"


def test_explicit_argument_beats_the_environment(monkeypatch, no_torch_npu, no_cuda):
    monkeypatch.setenv(device.ENV_VAR, "npu")
    assert device.select_device("cpu") == "cpu"
    with pytest.raises(device.DeviceUnavailableError):
        device.select_device()


@pytest.mark.parametrize("bad", ["tpu", "npu:x", "gpu", "cpu:"])
def test_unknown_device_names_are_refused(bad, monkeypatch):
    monkeypatch.setenv(device.ENV_VAR, bad)
    with pytest.raises(ValueError, match=device.ENV_VAR):
        device.select_device()


def test_cuda_requested_without_cuda(no_cuda):
    with pytest.raises(device.DeviceUnavailableError, match="cuda"):
        device.select_device("cuda")


def test_cpu_is_always_available():
    assert device.select_device("cpu") == "cpu"


def test_packages_import_without_torch():
    """The JAX library and the adapter package itself must not pull torch in."""
    code = (
        "import sys, eaglepangu_jax, eaglepangu_jax.models.llama, npu_backend; "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=Path(__file__).parents[1]
    )
    assert result.returncode == 0, result.stderr


def test_torch_device_names_the_missing_npu_package(no_torch_npu, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_npu", None)
    assert device.torch_device("cpu") == torch.device("cpu")
    with pytest.raises(device.DeviceUnavailableError, match="npu:0.*not installed"):
        device.torch_device("npu:0")
