"""Tensor-parallel placement of the teacher over a ``jax.sharding.Mesh``.

The forward itself is unchanged: :func:`eaglepangu_jax.models.llama.forward` under ``jax.jit``
follows the shardings of its inputs (XLA inserts the collectives). Megatron-style split over
the mesh axis ``axis`` (size ``M``):

* attention: query heads (``wq`` columns, ``wo`` rows) when ``M`` divides ``num_heads``;
  kv heads (``wk``/``wv`` columns and the cache's ``K`` axis) when ``M`` divides
  ``num_kv_heads``;
* MLP: ``w_gate``/``w_up`` columns and ``w_down`` rows when ``M`` divides the FFN width;
* ``lm_head`` columns (the vocabulary) when ``M`` divides ``vocab_size``.

A dimension that ``M`` does not divide is **replicated** (every device holds it whole and
computes it redundantly): still correct, just not split. SmolLM2-135M (9 query / 3 kv heads)
on 2 or 4 devices thus splits its MLP and vocabulary but replicates attention.
Embeddings and norm weights are always replicated.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from eaglepangu_jax.cache import KVCache
from eaglepangu_jax.models import llama
from eaglepangu_jax.models.config import LlamaConfig

__all__ = ["AXIS", "make_mesh", "layer_specs", "shard_params", "shard_cache"]

AXIS = "model"


def make_mesh(num_devices: int | None = None, axis: str = AXIS) -> Mesh:
    """A 1-D mesh over the first ``num_devices`` devices (default: all)."""
    devices = jax.devices()
    n = len(devices) if num_devices is None else num_devices
    if not 1 <= n <= len(devices):
        raise ValueError(f"num_devices={n}: only {len(devices)} devices are available")
    return Mesh(np.asarray(devices[:n]), (axis,))


def layer_specs(config: LlamaConfig, size: int, axis: str = AXIS) -> dict[str, PartitionSpec]:
    """Partition specs of one layer's weights for a mesh axis of ``size`` devices."""
    heads = axis if config.num_heads % size == 0 else None
    kv_heads = axis if config.num_kv_heads % size == 0 else None
    ffn = axis if config.intermediate_size % size == 0 else None
    return {
        "attn_norm": PartitionSpec(),
        "wq": PartitionSpec(None, heads),
        "wk": PartitionSpec(None, kv_heads),
        "wv": PartitionSpec(None, kv_heads),
        "wo": PartitionSpec(heads, None),
        "mlp_norm": PartitionSpec(),
        "w_gate": PartitionSpec(None, ffn),
        "w_up": PartitionSpec(None, ffn),
        "w_down": PartitionSpec(ffn, None),
    }


def shard_params(params: dict, mesh: Mesh, *, config: LlamaConfig, axis: str = AXIS) -> dict:
    """Place ``params`` (either layout) on ``mesh`` in the prepared layout.

    Returns:
        Prepared parameters (see :func:`llama.prepare_params`) whose leaves are sharded
        according to the module docstring.
    """
    size = mesh.shape[axis]
    # The [out, in] copies are not sharded: the sharded forward reads the plain layout.
    prepared = llama.without_transposed_copy(llama.prepare_params(params))
    specs = layer_specs(config, size, axis)

    def put(x, spec):
        return jax.device_put(x, NamedSharding(mesh, spec))

    vocab = axis if config.vocab_size % size == 0 else None
    return {
        "embed": put(prepared["embed"], PartitionSpec()),
        "layers": tuple(
            {name: put(w, specs[name]) for name, w in layer.items()} for layer in prepared["layers"]
        ),
        "final_norm": put(prepared["final_norm"], PartitionSpec()),
        "lm_head": put(prepared["lm_head"], PartitionSpec(None, vocab)),
    }


def shard_cache(cache: KVCache, mesh: Mesh, *, config: LlamaConfig, axis: str = AXIS) -> KVCache:
    """Place ``cache`` on ``mesh``: K/V split over kv heads when they divide, else replicated."""
    kv_heads = axis if config.num_kv_heads % mesh.shape[axis] == 0 else None
    kv = NamedSharding(mesh, PartitionSpec(None, None, kv_heads, None))
    return dataclasses.replace(
        cache,
        k=jax.device_put(cache.k, kv),
        v=jax.device_put(cache.v, kv),
        length=jax.device_put(cache.length, NamedSharding(mesh, PartitionSpec())),
    )
