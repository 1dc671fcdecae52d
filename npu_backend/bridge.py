"""Moving arrays between JAX and torch, zero-copy where the frameworks allow it.

* CPU and CUDA: DLPack. ``torch.from_dlpack(jax_array)`` and ``jax.numpy.from_dlpack(tensor)``
  share the buffer for contiguous, suitably aligned tensors (torch's own allocations are; a
  view at an odd offset is copied by JAX).
* NPU: torch_npu exports its tensors as an extension device that JAX cannot import, so NPU
  tensors go through host memory (one device-to-host copy). So do CUDA tensors when JAX has
  no GPU backend (a CPU-only JAX beside a CUDA torch).
* Booleans travel as ``uint8``: a one-byte integer is the most portable DLPack element type,
  and torch reinterprets it as ``bool`` without a copy (``Tensor.view``).

Only the dtypes of :data:`DTYPES` cross; anything else is refused with a ``TypeError``.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import torch

# name -> (JAX dtype, torch dtype). Explicit so that a silent width change (float64 -> float32,
# int64 -> int32 without x64) can never happen on the way across.
DTYPES: dict[str, tuple[np.dtype, torch.dtype]] = {
    "float32": (jnp.dtype(jnp.float32), torch.float32),
    "bfloat16": (jnp.dtype(jnp.bfloat16), torch.bfloat16),
    "float16": (jnp.dtype(jnp.float16), torch.float16),
    "int32": (jnp.dtype(jnp.int32), torch.int32),
    "int64": (jnp.dtype(jnp.int64), torch.int64),
    "uint8": (jnp.dtype(jnp.uint8), torch.uint8),
    "bool": (jnp.dtype(jnp.bool_), torch.bool),
}
_BY_JAX = {j: name for name, (j, _) in DTYPES.items()}
_BY_TORCH = {t: name for name, (_, t) in DTYPES.items()}

# Device types whose tensors DLPack can hand to JAX directly.
_DLPACK_DEVICES = ("cpu", "cuda")


def torch_dtype(jax_dtype) -> torch.dtype:
    """The torch dtype matching a JAX dtype; ``TypeError`` when it is not in the table."""
    name = _BY_JAX.get(jnp.dtype(jax_dtype))
    if name is None:
        raise TypeError(
            f"dtype {jnp.dtype(jax_dtype)} cannot cross to torch; supported: {sorted(DTYPES)}"
        )
    return DTYPES[name][1]


def jax_dtype(dtype: torch.dtype) -> np.dtype:
    """The JAX dtype matching a torch dtype; ``TypeError`` when it is not in the table."""
    name = _BY_TORCH.get(dtype)
    if name is None:
        raise TypeError(f"dtype {dtype} cannot cross to JAX; supported: {sorted(DTYPES)}")
    if name == "int64" and not jax.config.jax_enable_x64:
        # Without x64 JAX would quietly narrow the ids to int32.
        raise TypeError(
            "int64 tensors need jax_enable_x64 to cross to JAX unchanged; cast to int32 first"
        )
    return DTYPES[name][0]


def to_torch(x: jax.Array, device: str | torch.device = "cpu") -> torch.Tensor:
    """A torch view of ``x`` (zero-copy on the same CPU/CUDA device), moved to ``device``.

    Args:
        x: a JAX array of a dtype in :data:`DTYPES`.
        device: target torch device (``"cpu"``, ``"cuda:0"``, ``"npu:0"``, ...). When it
            differs from the array's device the tensor is copied there (for an NPU always:
            through host memory).

    Returns:
        A tensor of the matching dtype and shape. On CPU/CUDA it shares ``x``'s buffer, so
        it must be treated as read-only (JAX arrays are immutable).
    """
    if not isinstance(x, jax.Array):
        raise TypeError(f"to_torch expects a jax.Array, got {type(x).__name__}")
    target = torch.device(device)
    dtype = torch_dtype(x.dtype)
    if dtype == torch.bool:
        tensor = torch.from_dlpack(x.astype(jnp.uint8)).view(torch.bool)
    else:
        tensor = torch.from_dlpack(x)
    if tensor.device != target:
        tensor = tensor.to(target)
    return tensor


def to_jax(t: torch.Tensor) -> jax.Array:
    """A JAX array with ``t``'s values: zero-copy for contiguous CPU/CUDA tensors.

    Args:
        t: a tensor of a dtype in :data:`DTYPES`. Non-contiguous tensors are made contiguous
            first (a copy); NPU tensors are copied to host memory first.

    Returns:
        A JAX array of the matching dtype and shape. When zero-copy, later in-place writes to
        ``t`` are visible through it: do not mutate ``t`` while the array is in use.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"to_jax expects a torch.Tensor, got {type(t).__name__}")
    dtype = jax_dtype(t.dtype)
    t = t.detach()
    if t.device.type not in _DLPACK_DEVICES or not _jax_imports(t.device.type):
        t = t.cpu()
    t = t.contiguous()
    if t.dtype == torch.bool:
        return jnp.from_dlpack(t.view(torch.uint8)) != jnp.uint8(0)
    array = jnp.from_dlpack(t)
    if array.dtype != dtype:
        raise TypeError(f"DLPack produced {array.dtype} for a {t.dtype} tensor")
    return array


@functools.cache
def _jax_imports(device_type: str) -> bool:
    """Whether JAX has a backend that can take a DLPack tensor of this torch device type."""
    if device_type == "cpu":
        return True
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:  # no GPU backend in this JAX build
        return False


def measure_roundtrip_overhead(
    shape: tuple[int, ...], repeats: int = 100, dtype=jnp.float32, device: str = "cpu"
) -> float:
    """Mean wall-clock seconds of one JAX -> torch -> JAX round trip of an array of ``shape``.

    One warm-up trip is excluded. The JAX side is synchronised (``block_until_ready``) so the
    figure includes any copy the transfer forces.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    x = jnp.zeros(shape, dtype)
    to_jax(to_torch(x, device)).block_until_ready()
    start = time.perf_counter()
    for _ in range(repeats):
        x = to_jax(to_torch(x, device))
    x.block_until_ready()
    return (time.perf_counter() - start) / repeats
