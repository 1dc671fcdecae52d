"""Which exceptions are the user's to fix: one ``error:`` line and exit status 2, no traceback.

Flags are checked by argparse, and the commands check what they can before any work (see
:mod:`eaglepangu_jax.cli.args`). What only shows up later (a missing model package, a file
that cannot be read or written, a later conversation turn longer than the teacher's context)
is an exception raised further down; :func:`user_message` tells those apart from bugs:

* an exception of a known user-error type (:func:`user_error_types`): the model package is
  not installed, a calibration file is corrupt, a drafter or a device is unavailable;
* an ``OSError`` about a named file (a path the user gave: missing, a folder, unreadable);
* a ``ValueError`` raised by one of the library's input checks (:data:`VALIDATORS`): the
  frame that raised it is one of them.

Anything else is a bug, and :func:`guard` lets it through with its traceback.
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable

from eaglepangu_jax.calibration.store import CalibrationFileError
from eaglepangu_jax.drafters.registry import DrafterUnavailableError
from eaglepangu_jax.models.smollm2 import ModelNotInstalledError

__all__ = ["VALIDATORS", "user_error_types", "user_message", "guard"]

# (module, function) of the checks whose ValueError describes bad input, not a bug. A
# ValueError counts only when one of these raised it itself (the innermost frame).
VALIDATORS = frozenset(
    {
        ("eaglepangu_jax.engine.decode", "validate"),  # prompt empty / too long / bad ids
        ("eaglepangu_jax.engine.config", "__post_init__"),  # SpecConfig's checks
        ("eaglepangu_jax.evaluation.run", "check_prompts"),  # bench: a turn too long
        ("eaglepangu_jax.drafters.checkpoint", "load_checkpoint"),  # a checkpoint path
        ("eaglepangu_jax.drafters.checkpoint", "load_starting_head"),  # --init-from
        ("eaglepangu_jax.training.train", "train"),  # resuming a checkpoint of another run
    }
)


def user_error_types() -> tuple[type[BaseException], ...]:
    """The exception types that are always the user's to fix.

    The torch adapter's ``DeviceUnavailableError`` counts once :mod:`npu_backend.device` is
    imported (only ``--backend torch`` imports it; before that nothing can raise it).
    """
    types: tuple[type[BaseException], ...] = (
        ModelNotInstalledError,
        CalibrationFileError,
        DrafterUnavailableError,
    )
    device = sys.modules.get("npu_backend.device")
    if device is not None:
        types += (device.DeviceUnavailableError,)
    return types


def _raised_by_validator(err: BaseException) -> bool:
    tb = err.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    frame = tb.tb_frame
    return (frame.f_globals.get("__name__"), frame.f_code.co_name) in VALIDATORS


def _one_line(text: str) -> str:
    return " ".join(text.split())


def user_message(err: BaseException) -> str | None:
    """The one-line message for a user error, ``None`` for anything else (a bug)."""
    if isinstance(err, user_error_types()):
        return _one_line(str(err))
    if isinstance(err, OSError) and err.filename is not None:
        why = err.strerror or type(err).__name__
        return _one_line(f"{err.filename}: {why}")
    if isinstance(err, ValueError) and _raised_by_validator(err):
        return _one_line(str(err))
    return None


def guard(parser: argparse.ArgumentParser, run: Callable[[], int]) -> int:
    """``run()``; a user error ends in ``parser.error`` (one ``error:`` line, status 2)."""
    try:
        return run()
    except Exception as err:
        message = user_message(err)
        if message is None:
            raise
        parser.error(message)
    raise AssertionError("unreachable")
