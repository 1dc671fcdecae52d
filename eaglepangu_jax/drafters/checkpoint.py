"""Drafter checkpoints: ``<name>.safetensors`` + ``<name>.json``, and the format table.

The weights file holds the head's tensors (``head.<name>``), the draft-to-teacher vocabulary map
``d2t`` and, for a training checkpoint, the optimiser state (``opt.<i>``). The JSON holds
``format`` (``"eaglepangu-<kind>"``), the head config, the teacher fingerprint and whatever the
writer adds (training step, losses). Both are written atomically. :func:`load_checkpoint`
refuses another teacher's checkpoint, another kind, a corrupt file, or wrong shapes, with a
message naming the file and the problem. Weights are read with safetensors, never pickle.

This lives with the drafters (not with training) so that loading a shipped drafter never
imports the training code.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from eaglepangu_jax.drafters.block_head import LAYER_KEYS as BLOCK_LAYER_KEYS
from eaglepangu_jax.drafters.block_head import BlockConfig
from eaglepangu_jax.drafters.draft_target_model import DraftModelConfig
from eaglepangu_jax.drafters.eagle3_head import Eagle3Config
from eaglepangu_jax.files import atomic_write

__all__ = [
    "FORMATS",
    "format_name",
    "kind_of",
    "save_checkpoint",
    "load_checkpoint",
    "load_starting_head",
    "grow_block_layers",
]

# Kind name -> head config class (``to_json`` / ``from_json`` / ``head_shapes``).
FORMATS: dict[str, type] = {
    "eagle3": Eagle3Config,
    "block": BlockConfig,
    "draft-model": DraftModelConfig,  # the distilled draft of draft-target speculation
}


def format_name(kind: str) -> str:
    """The ``format`` string stored in a checkpoint of ``kind``."""
    return f"eaglepangu-{kind}"


def kind_of(config: Any) -> str:
    """The kind whose config class ``config`` is."""
    for kind, cls in FORMATS.items():
        if isinstance(config, cls):
            return kind
    raise ValueError(
        f"no drafter kind has config type {type(config).__name__}; known kinds: {sorted(FORMATS)}"
    )


def format_of(config: Any) -> str:
    return format_name(kind_of(config))


def save_checkpoint(
    path: str | Path,
    head: dict,
    config: Any,
    d2t: np.ndarray,
    *,
    fingerprint: str,
    extra: dict | None = None,
    opt_state: Any = None,
    dtype: Any = np.float32,
) -> None:
    """Write ``path.safetensors`` + ``path.json`` atomically (optimiser state optional);
    ``config`` (a config class of :data:`FORMATS`) decides the stored ``format``."""
    from safetensors.numpy import save_file

    path = Path(path)
    kind = format_of(config)
    arrays = {f"head.{k}": np.asarray(v, np.float32).astype(dtype) for k, v in head.items()}
    arrays["d2t"] = np.asarray(d2t, np.int32)
    if opt_state is not None:
        for i, leaf in enumerate(jax.tree_util.tree_leaves(opt_state)):
            arrays[f"opt.{i}"] = np.asarray(leaf)
    meta = {
        "format": kind,
        "version": 1,
        "teacher_fingerprint": fingerprint,
        "config": config.to_json(),
        **(extra or {}),
    }
    atomic_write(path.with_suffix(".safetensors"), lambda tmp: save_file(arrays, str(tmp)))
    atomic_write(
        path.with_suffix(".json"),
        lambda tmp: tmp.write_text(json.dumps(meta, indent=1, sort_keys=True)),
    )


def load_checkpoint(
    path: str | Path, *, fingerprint: str | None, config: Any = None, kind: str | None = None
) -> tuple[Any, dict, np.ndarray, dict, dict]:
    """``(config, head float32, d2t, metadata, optimiser leaves by index)``.

    Args:
      path: checkpoint path without suffix (or with either suffix).
      fingerprint: the teacher it must belong to (``None`` skips the check).
      config: the head shape it must have (``None``: the stored one); also fixes the kind.
      kind: the drafter kind it must hold (a key of :data:`FORMATS`; ``None``: any).

    Raises:
      ValueError: another teacher's checkpoint, another kind, an unknown format, or a weight
        of the wrong shape / missing.
    """
    from safetensors.numpy import load_file

    path = Path(path)
    path = path.with_suffix("") if path.suffix in (".json", ".safetensors") else path
    try:
        meta = json.loads(path.with_suffix(".json").read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(
            f"checkpoint {path}: unreadable metadata {path.with_suffix('.json')}: {err}"
        ) from err
    if not isinstance(meta, dict):
        raise ValueError(f"checkpoint {path}: metadata is not a JSON object")
    stored_fp = meta.get("teacher_fingerprint")
    if fingerprint is not None and stored_fp != fingerprint:
        raise ValueError(
            f"checkpoint {path} was trained for teacher {str(stored_fp)[:16]}..., "
            f"not this teacher {fingerprint[:16]}...: refusing to load it"
        )
    by_format = {format_name(k): k for k in FORMATS}
    stored_kind = by_format.get(meta.get("format"))
    if stored_kind is None:
        raise ValueError(
            f"checkpoint {path} has format {meta.get('format')!r}; known formats: "
            f"{sorted(by_format)}"
        )
    wanted = kind if config is None else kind_of(config)
    if wanted is not None and wanted != stored_kind:
        raise ValueError(
            f"checkpoint {path} holds a drafter of kind {stored_kind!r}, "
            f"not the {wanted!r} asked for"
        )
    cfg = config if config is not None else FORMATS[stored_kind].from_json(meta["config"])
    try:
        arrays = load_file(str(path.with_suffix(".safetensors")))
    except Exception as err:  # safetensors raises its own error types for corrupt files
        raise ValueError(
            f"checkpoint {path}: unreadable weights {path.with_suffix('.safetensors')}: {err}"
        ) from err
    head = {}
    for name, shape in cfg.head_shapes().items():
        arr = arrays.get(f"head.{name}")
        if arr is None or tuple(arr.shape) != shape:
            got = None if arr is None else tuple(arr.shape)
            raise ValueError(
                f"checkpoint {path}: weight {name!r} has shape {got}, the head needs {shape}"
            )
        head[name] = jnp.asarray(arr.astype(np.float32))
    d2t = arrays.get("d2t")
    if d2t is None or d2t.shape != (cfg.draft_vocab_size,):
        raise ValueError(
            f"checkpoint {path}: d2t has shape "
            f"{None if d2t is None else d2t.shape}, expected "
            f"({cfg.draft_vocab_size},)"
        )
    if d2t.min() < 0 or d2t.max() >= cfg.teacher_vocab_size:
        raise ValueError(f"checkpoint {path}: d2t holds ids outside the teacher vocabulary")
    opt = {int(k.split(".")[1]): v for k, v in arrays.items() if k.startswith("opt.")}
    return cfg, head, d2t, meta, opt


def load_starting_head(
    path: str | Path,
    *,
    config: Any,
    d2t: np.ndarray,
    fingerprint: str,
    fresh_head: dict | None = None,
) -> tuple[dict, dict]:
    """The head stored at ``path`` as the starting weights of a new training run:
    ``(head float32, provenance)``.

    A new run (fresh optimiser and schedule) may start from an earlier run's checkpoint or
    export, e.g. to continue a schedule that ended while the held-out loss still fell. Its
    weights only mean something over the same head shape and the same draft vocabulary (row
    ``i`` of the head scores draft token ``i``), so both must match, with one exception: a
    draft model (kind ``draft-model``, whose only vocabulary-indexed tensor is ``lm_head``)
    may move to another draft vocabulary, e.g. a wider one. Its layers and norm are kept, the
    ``lm_head`` column of every teacher id in both vocabularies is carried to that id's new
    place, and the columns of ids new to the vocabulary come from ``fresh_head`` (the run's
    own initial head, the teacher's embedding rows for a draft model).
    A block drafter may also change its block size (none of its weights has a slot axis) and
    grow deeper: its layers are kept and the new ones, appended above them, start as the
    identity (see :func:`grow_block_layers`; their other weights come from ``fresh_head``).

    Raises:
      ValueError: anything :func:`load_checkpoint` refuses, another head config, or another
        draft vocabulary (the row order of the head would be wrong) where it cannot move.
    """
    kind = kind_of(config)
    stored, head, stored_d2t, meta, _ = load_checkpoint(path, fingerprint=fingerprint, kind=kind)
    provenance = {"path": str(path), "step": meta.get("step"), "held_out": meta.get("held_out")}
    same_vocab = np.array_equal(np.asarray(stored_d2t), np.asarray(d2t))
    movable = kind == "draft-model" and fresh_head is not None
    if not same_vocab and not movable:
        raise ValueError(
            f"checkpoint {path} was trained over another draft vocabulary (another corpus, "
            f"--vocab-size or held-out split): its rows would score the wrong tokens"
        )
    if not same_vocab:
        stored = dataclasses.replace(stored, draft_vocab_size=config.draft_vocab_size)
    if kind == "block" and stored.block_size != config.block_size:
        # No block weight has a slot axis (one MASK vector, positions by rotation), so a head
        # trained on blocks of one size goes on with blocks of another.
        provenance["block_size"] = {"stored": stored.block_size, "now": config.block_size}
        stored = dataclasses.replace(stored, block_size=config.block_size)
    if kind == "block" and stored.num_layers < config.num_layers:
        if fresh_head is None:
            raise ValueError(
                f"checkpoint {path} holds {stored.num_layers} block layers and "
                f"{config.num_layers} are wanted: the new layers need a fresh head to start from"
            )
        head = grow_block_layers(head, fresh_head, stored.num_layers)
        provenance["num_layers"] = {"stored": stored.num_layers, "now": config.num_layers}
        stored = dataclasses.replace(stored, num_layers=config.num_layers)
    if stored != config:
        have, want = stored.to_json(), config.to_json()
        changed = ", ".join(
            f"{k}={have.get(k)} there, {v} here" for k, v in want.items() if have.get(k) != v
        )
        raise ValueError(f"checkpoint {path} holds a head of another config ({changed})")
    if same_vocab:
        return head, provenance
    old_place = {int(t): i for i, t in enumerate(np.asarray(stored_d2t))}
    new_ids = np.asarray(d2t)
    kept = np.array([int(t) in old_place for t in new_ids])
    columns = np.asarray(fresh_head["lm_head"], np.float32).copy()
    old = np.asarray(head["lm_head"], np.float32)
    columns[:, kept] = old[:, [old_place[int(t)] for t in new_ids[kept]]]
    head = {**head, "lm_head": jnp.asarray(columns)}
    provenance["vocabulary"] = {"kept": int(kept.sum()), "new": int((~kept).sum())}
    return head, provenance


def grow_block_layers(head: dict, fresh_head: dict, num_layers: int) -> dict:
    """``head`` (``num_layers`` block layers) deepened to ``fresh_head``'s depth, computing
    the same function: the new layers are appended above the old ones, each with its attention
    output ``wo`` and its MLP output ``w_down`` zero, so it adds nothing to the residual stream
    until training moves those (their gradients are not zero: their inputs are not). Every
    other weight of a new layer is ``fresh_head``'s; the weights outside the layers are
    ``head``'s."""
    grown = dict(head)
    for name in BLOCK_LAYER_KEYS:
        new = jnp.asarray(fresh_head[name][num_layers:], jnp.float32)
        if name in ("wo", "w_down"):
            new = jnp.zeros_like(new)
        grown[name] = jnp.concatenate([jnp.asarray(head[name], jnp.float32), new], axis=0)
    return grown
