"""The ``"auto"`` policy's verify-latency curve, from the saved calibration.

The engine calls the controller with ``t_draft = t_other = 0`` and a ``verify_latency``
curve, so :func:`verify_latency_curve` folds the constant overheads into every entry: adding a
constant to every entry of the curve is exactly the same stopping rule. It also charges each
node count the slot bucket the engine really verifies (1, 2, 4, 8, ..., budget + 1).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from eaglepangu_jax import budget as budget_lib
from eaglepangu_jax.calibration.fit import predict
from eaglepangu_jax.calibration.store import (
    FIT_KEYS,
    MACHINE_KEYS,
    CalibrationFileError,
    MachineCalibration,
    default_path,
    describe_config,
    describe_machine,
    load_calibration,
    same_machine,
    teacher_fingerprint,
    timestamp,
)
from eaglepangu_jax.engine import decode as gen
from eaglepangu_jax.engine import step
from eaglepangu_jax.engine.config import SpecConfig
from eaglepangu_jax.methods import registry as methods_lib
from eaglepangu_jax.models.config import LlamaConfig

__all__ = [
    "verify_latency_curve",
    "uncalibrated",
    "usable_calibration",
    "curve_for",
    "auto_verify_latency",
    "draft_cost_key",
    "method_costs",
]

log = logging.getLogger(__name__)

_WARNED: set[str] = set()  # drafters already reported as lacking a drafting cost


# ----------------------------------------------------------------------------- the curve


def verify_latency_curve(
    calibration: MachineCalibration,
    config: LlamaConfig,
    context: int,
    budget: int,
    *,
    drafter: str | None = None,
    bucketed: bool = True,
    slot_buckets: tuple[int, ...] | None = None,
) -> Float[Array, " N+1"]:
    """The ``verify_latency`` argument of the ``"auto"`` policy, overheads folded in.

    Entry ``n`` is the predicted seconds of a round verifying the root plus ``n`` nodes:
    the forward at the engine's slot bucket (the smallest of ``slot_buckets``, by default
    1, 2, 4, 8, ..., and ``budget + 1`` holding ``n + 1`` slots) when ``bucketed``, over the
    engine's window at ``context`` committed tokens, plus ``t_other`` and the drafter's
    ``t_draft``. The controller compares differences of the curve with the cost ``C(n) =
    t_draft + t_other + T(n)``, and the engine passes ``t_draft = t_other = 0``, so folding
    the constants in gives exactly BASTION's rule.

    Args:
      calibration: a saved or fresh calibration for ``config``.
      config: the teacher.
      context: committed tokens when the curve is used (the prompt length).
      budget: the tree budget (nodes, root excluded), ``>= 1``.
      drafter: add this drafter's ``t_draft`` (it must have been calibrated).
      bucketed: charge the engine's slot bucket (``False``: exactly ``n + 1`` slots).
      slot_buckets: the run's :attr:`SpecConfig.slot_buckets` (``None``: the default sizes).

    Returns:
      float32 ``[budget + 1]``, non-decreasing.

    Raises:
      ValueError: bad budget or context, another teacher, or an uncalibrated drafter.
    """
    if budget < 1 or context < 0:
        raise ValueError(f"budget must be >= 1 and context >= 0, got {budget} and {context}")
    if calibration.teacher != teacher_fingerprint(config, calibration.dtype):
        raise ValueError(
            "the calibration was measured for another teacher: "
            f"{describe_config(calibration.teacher_config, calibration.dtype)}"
        )
    t_draft = 0.0
    if drafter is not None:
        if drafter not in calibration.t_draft:
            raise ValueError(
                f"drafter {drafter!r} was not calibrated; calibrated: "
                f"{sorted(calibration.t_draft) or 'none'}"
            )
        t_draft = calibration.t_draft[drafter]
    slots = np.arange(1, budget + 2)
    if bucketed:
        sizes = np.asarray(step.slot_buckets(budget + 1, slot_buckets))
        slots = sizes[np.searchsorted(sizes, slots)]
    # The engine picks one window per round, for the full tree, whatever bucket it verifies.
    window = gen.window_for(context + budget + 1, config.max_position)
    verify = predict(calibration, config, slots, context, window=window)
    return jnp.asarray(verify + (calibration.t_other + t_draft), jnp.float32)


def uncalibrated(config: LlamaConfig, dtype: str = "float32") -> MachineCalibration:
    """The roofline at this machine class's nominal peaks, no overheads: the fallback."""
    ideal = budget_lib.Calibration.ideal()
    return MachineCalibration(
        teacher=teacher_fingerprint(config, dtype),
        teacher_config=dataclasses.asdict(config),
        dtype=dtype,
        machine=describe_machine(),
        date=timestamp(),
        peak_flops=methods_lib.CPU_PEAK_FLOPS,
        bandwidth=methods_lib.CPU_BANDWIDTH,
        bytes_per_param=float(np.dtype(dtype).itemsize),
        **{k: float(getattr(ideal, k)) for k in FIT_KEYS},
    )


def usable_calibration(
    config: LlamaConfig, *, path: str | os.PathLike | None = None, dtype: str = "float32"
) -> MachineCalibration | None:
    """The calibration at ``path`` (default: :func:`default_path`) if it exists, is readable,
    belongs to this teacher and was measured on this kind of machine; else ``None``, with a
    log line saying why."""
    target = Path(path) if path is not None else default_path()
    try:
        calibration = load_calibration(target, config=config, dtype=dtype)
    except FileNotFoundError:
        log.info("no calibration at %s", target)
        return None
    except (OSError, CalibrationFileError) as err:
        log.warning("%s: not used", err)
        return None
    if not same_machine(calibration):
        log.warning(
            "calibration %s was measured on another machine or under other XLA flags (%s): "
            "not used",
            target,
            ", ".join(str(calibration.machine.get(k)) for k in MACHINE_KEYS),
        )
        return None
    return calibration


def curve_for(
    config: LlamaConfig,
    spec: SpecConfig,
    context: int,
    drafter_name: str | None = None,
    *,
    path: str | os.PathLike | None = None,
    dtype: str = "float32",
    bucketed: bool = True,
) -> Float[Array, " N+1"]:
    """The ``[spec.budget + 1]`` verify-latency curve for a run, from the saved calibration.

    Uses the calibration at ``path`` (default: :func:`default_path`) when it exists, is
    readable, belongs to this teacher and was measured on this kind of machine; otherwise the
    uncalibrated roofline (:func:`uncalibrated`), with a logged warning saying why. A drafter
    the calibration did not time adds no drafting cost (also logged).
    """
    calibration = usable_calibration(config, path=path, dtype=dtype) or uncalibrated(config, dtype)
    if drafter_name is not None and drafter_name not in calibration.t_draft:
        if calibration.samples and drafter_name not in _WARNED:
            _WARNED.add(drafter_name)  # once per process: this runs for every generation
            log.warning("drafter %r has no calibrated drafting cost: counting none", drafter_name)
        drafter_name = None
    return verify_latency_curve(
        calibration,
        config,
        context,
        spec.budget,
        drafter=drafter_name,
        bucketed=bucketed,
        slot_buckets=spec.slot_buckets,
    )


def auto_verify_latency(
    config: LlamaConfig, spec: SpecConfig, context: int, drafter_name: str | None = None
) -> Any:
    """The verify-latency curve the ``"auto"`` policy needs (``None`` for other policies):
    this machine's saved calibration (``eaglepangu calibrate``) at ``context`` cached tokens,
    with ``drafter_name``'s drafting cost folded in; the uncalibrated roofline of this machine
    class when there is no usable calibration (see :func:`curve_for`).
    """
    if spec.policy != "auto":
        return None
    return curve_for(config, spec, context, drafter_name)


def draft_cost_key(method: methods_lib.Method) -> str:
    """The calibration's name for ``method``'s drafting cost: the method and the tree shape it
    drafts. One drafter class drafts at very different costs: the EAGLE-3 head proposing 8
    nodes to depth 6 against the same head as MTP (one node), so a cost measured for one
    shape must not be read for another. A draft-target beam tree also names its width: it
    drafts ``top_k`` rows per level where chains of the same budget and depth may draft
    fewer. A drafter whose code drafts the same tree at another cost than before carries a
    ``cost_revision`` (class attribute, 0 when absent), named in the key from 1 up: a cost
    measured before the change is then not read, and the next controlled run measures it."""
    key = f"{method.name}:budget={method.spec.budget},depth={method.spec.depth}"
    if getattr(method.drafter, "tree_shape", "chains") == "beam":
        key += f",beam={method.drafter.top_k}"
    revision = getattr(method.drafter, "cost_revision", 0)
    if revision:
        key += f",rev={revision}"
    return key


def method_costs(
    config: LlamaConfig,
    method: methods_lib.Method,
    context: int,
    *,
    path: str | os.PathLike | None = None,
) -> tuple[Any, float]:
    """What the engine's ``"auto"`` controller weighs for ``method``: the ``[budget + 1]``
    verify-latency curve (drafting excluded, the round overhead included) and the drafter's
    seconds per round, from this machine's calibration (the uncalibrated roofline and no
    drafting cost when there is none). ``(None, 0.0)`` for other policies or no drafter."""
    if method.spec.policy != "auto" or method.drafter is None:
        return None, 0.0
    curve = curve_for(config, method.spec, context, path=path)
    calibration = usable_calibration(config, path=path)
    key = draft_cost_key(method)
    t_draft = calibration.t_draft.get(key, 0.0) if calibration is not None else 0.0
    return curve, float(t_draft)
