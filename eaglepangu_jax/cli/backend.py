"""``--backend jax|torch``: where the teacher's forward runs.

``jax`` (default) is the engine's on-device loop. ``torch`` runs the same speculative loop
with the teacher forward in torch (:mod:`npu_backend.runner`): drafting, tree shaping and
acceptance stay in JAX, so both return the same tokens. The torch device comes from
``EAGLEPANGU_DEVICE`` (``auto``: npu, then cuda, then cpu; see :mod:`npu_backend.device`), so
the same flag runs on an Ascend host with ``eaglepangu[npu]`` installed.

The torch adapter is imported here only, inside the functions, and only for ``--backend
torch``: everything else (``eaglepangu --help`` included) works without torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.util
from typing import Any, Sequence

from eaglepangu_jax.calibration.curve import method_costs
from eaglepangu_jax.engine.decode import Teacher
from eaglepangu_jax.methods.registry import Method

__all__ = ["BACKENDS", "TORCH_INSTALL", "add_option", "torch_device", "torch_methods"]

BACKENDS = ("jax", "torch")
TORCH_INSTALL = "pip install 'eaglepangu[torch]'"


def add_option(p: argparse.ArgumentParser) -> None:
    """Add ``--backend`` to a command's parser."""
    p.add_argument(
        "--backend",
        choices=BACKENDS,
        default="jax",
        help="where the teacher forward runs: 'jax' = the engine's on-device loop; "
        "'torch' = the same speculative loop with the teacher in torch, on "
        "$EAGLEPANGU_DEVICE (auto, npu, cuda, cpu); needs the 'torch' extra",
    )


def torch_device(parser: argparse.ArgumentParser, args: argparse.Namespace) -> str | None:
    """For ``--backend torch``, the torch device to run on (``None`` for ``jax``).

    Checked before any model loads: torch installed and importable, the device usable; a
    problem ends in ``parser.error`` naming it (and the extra to install).
    """
    if args.backend != "torch":
        return None
    if importlib.util.find_spec("torch") is None:
        parser.error(
            "--backend torch needs PyTorch, which is not installed; install the 'torch' "
            f"extra: {TORCH_INSTALL}"
        )
    try:
        from npu_backend import device as device_lib
        from npu_backend import runner  # noqa: F401  (imports torch: fail now, not after loading)
    except ImportError as err:
        parser.error(
            f"--backend torch: PyTorch is installed but does not import ({err}); "
            f"reinstall the 'torch' extra: {TORCH_INSTALL}"
        )
    try:
        return device_lib.select_device()
    except (ValueError, device_lib.DeviceUnavailableError) as err:
        parser.error(f"--backend torch: {err}")
    raise AssertionError("unreachable")


def torch_methods(methods: Sequence[Method], teacher: Teacher, device: str) -> list[Method]:
    """``methods`` with the teacher in torch on ``device``: every engine method (greedy and
    the drafters) gets a :class:`~npu_backend.method_runner.TorchMethodRunner` (the peer-runner
    protocol of :class:`~eaglepangu_jax.methods.registry.Method`); peers stay as they are.
    One torch copy of the teacher serves them all."""
    from npu_backend import bridge
    from npu_backend.llama_torch import TorchLlama
    from npu_backend.method_runner import TorchMethodRunner

    model = TorchLlama(
        teacher.config,
        teacher.params,
        device=device,
        dtype=bridge.torch_dtype(teacher.params["embed"].dtype),
    )
    out = []
    for method in methods:
        if method.runner is None:
            runner: Any = TorchMethodRunner(
                model,
                method.drafter,
                draft_params=method.draft_params,
                # The "auto" controller's costs at the prompt's length, as the JAX engine's.
                costs=functools.partial(method_costs, teacher.config, method),
            )
            method = dataclasses.replace(method, runner=runner)
        out.append(method)
    return out
