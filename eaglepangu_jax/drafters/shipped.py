"""Loading a drafter packaged with the library (``eaglepangu_jax/weights``)."""

from __future__ import annotations

from typing import Any

__all__ = ["load_packaged"]


def load_packaged(
    name: str, kind: str, teacher_params: dict | None
) -> tuple[Any, dict, Any, Any, dict]:
    """``(config, trained weights, d2t, teacher embedding, metadata)`` of the packaged
    checkpoint ``name``, refused unless it was trained for the installed teacher file. The
    metadata is the checkpoint's JSON (training settings, held-out figures, calibration).

    Args:
      name: checkpoint name under ``eaglepangu_jax/weights`` (no suffix).
      kind: the drafter kind it must hold (``"eagle3"``, ``"block"``).
      teacher_params: the teacher's parameters (for the frozen embedding); loaded when
        ``None``.

    Raises:
      ValueError: another teacher's checkpoint, another kind, or malformed weights.
    """
    from importlib import resources

    from eaglepangu_jax.drafters.checkpoint import load_checkpoint
    from eaglepangu_jax.models import smollm2

    path = resources.files("eaglepangu_jax") / "weights" / name
    config, head, d2t, meta, _ = load_checkpoint(
        str(path), kind=kind, fingerprint=smollm2.teacher_fingerprint()
    )
    if teacher_params is None:
        _, teacher_params = smollm2.load_smollm2()
    return config, head, d2t, teacher_params["embed"], meta
