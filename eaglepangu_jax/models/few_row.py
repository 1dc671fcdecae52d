"""A float32 product of a few rows by a weight matrix that streams the weights once (CPU).

A decoding step multiplies one row by every weight matrix of the teacher; verifying a tree of
``s`` slots multiplies ``s`` rows by the same matrices. On a CPU the one-row product runs at
the memory-bandwidth floor, but XLA's matrix-matrix kernels for 2-8 rows stream the same
weights markedly slower: on 2 cores of an AMD EPYC the teacher's products cost ~1.35x one
row from two rows up, so every speculative round paid a third of a step before it accepted
anything. ``few_row_product.cc`` (beside this file) reads the weights once, in memory order,
for all rows: there the teacher's products at 2 / 4 / 8 rows cost 1.11 / 1.17 / 1.51x one
row (XLA: 1.48 / 1.33 / 1.60x), and the whole verify forward of 2 / 4 slots 1.02-1.05 /
1.12-1.15x a one-token step (XLA: 1.31 / 1.31x; docs/RESULTS.md, "A few-row product
kernel").

The kernel is an XLA FFI custom call, compiled at first use with the machine's C++ compiler
(``$CXX``, else ``c++``) for AVX-512F with OpenMP, cached in the project's cache folder under
a name that hashes its source, flags and the JAX version (written atomically), and registered
with JAX. :func:`available` says whether it can run here; it cannot without an x86-64 CPU
with AVX-512F, a C++ compiler, or JAX's CPU backend, and ``EAGLEPANGU_FEW_ROW_KERNEL=0``
turns it off. Where it cannot, :func:`applies` is False and callers use XLA's product: the
results agree to float rounding either way (the kernel sums every output over ``k`` in
order; it is not bitwise XLA's).

:func:`eaglepangu_jax.models.llama` routes a product through it when :func:`applies`: float32
operands, ``MIN_ROWS <= rows <= MAX_ROWS``, a column count divisible by 16. One row stays with
XLA (its matrix-vector product is already at the floor, and a plain decoding step, the
benchmarks' baseline, is left as it was).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from eaglepangu_jax.models.weights_cache import resolve_cache_dir

__all__ = [
    "MIN_ROWS",
    "MAX_ROWS",
    "ENV_SWITCH",
    "available",
    "unavailable_reason",
    "identity",
    "applies",
    "product",
]

log = logging.getLogger(__name__)

# Rows routed to the kernel. Two rows is where XLA's kernels leave the bandwidth floor; from
# about nine rows XLA's matrix-matrix kernels caught up with this one (same machine).
MIN_ROWS = 2
MAX_ROWS = 8
ENV_SWITCH = "EAGLEPANGU_FEW_ROW_KERNEL"
_LANES = 16  # the kernel works on 16-float column pieces
_SOURCE = Path(__file__).with_name("few_row_product.cc")
_SYMBOL = "EaglepanguFewRowProduct"
_TARGET = "eaglepangu_few_row_product_v1"
_FLAGS = ("-std=c++17", "-O3", "-mavx512f", "-mfma", "-fopenmp", "-shared", "-fPIC", "-w")


def _switched_off() -> bool:
    return os.environ.get(ENV_SWITCH, "").strip().lower() in ("0", "off", "false", "no")


def _cpu_has_avx512f() -> bool:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return any(line.startswith("flags") and " avx512f" in line for line in f)
    except OSError:
        return False


def _cache_folder() -> Path:
    return resolve_cache_dir() / "kernels"


@functools.cache
def _build() -> tuple[str | None, str | None]:
    """``(identity, None)`` once the kernel is compiled, loaded and registered, else
    ``(None, reason)``. Runs once per process."""
    if jax.default_backend() != "cpu":
        return None, f"JAX's backend is {jax.default_backend()!r}, not the CPU"
    if not _cpu_has_avx512f():
        return None, "the CPU has no AVX-512F"
    compiler = shutil.which(os.environ.get("CXX", "c++"))
    if compiler is None:
        return None, "no C++ compiler found ($CXX, else c++)"
    source = _SOURCE.read_bytes()
    digest = hashlib.sha256(
        source + " ".join(_FLAGS).encode() + jax.__version__.encode() + compiler.encode()
    ).hexdigest()[:16]
    library = _cache_folder() / f"few_row_{digest}.so"
    if not library.exists():
        library.parent.mkdir(parents=True, exist_ok=True)
        fd, partial = tempfile.mkstemp(dir=library.parent, suffix=".so.partial")
        os.close(fd)
        command = [compiler, *_FLAGS, f"-I{jax.ffi.include_dir()}", str(_SOURCE), "-o", partial]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=300)
            if done.returncode != 0:
                return None, f"compiling the kernel failed: {done.stderr.strip()[-400:]}"
            os.replace(partial, library)  # atomic: a reader never sees a half-written library
        except (OSError, subprocess.SubprocessError) as err:
            return None, f"compiling the kernel failed: {err}"
        finally:
            if os.path.exists(partial):
                os.unlink(partial)
    try:
        handler = getattr(ctypes.cdll.LoadLibrary(str(library)), _SYMBOL)
        jax.ffi.register_ffi_target(_TARGET, jax.ffi.pycapsule(handler), platform="cpu")
    except (OSError, AttributeError) as err:
        return None, f"loading the kernel failed: {err}"
    return f"v1-{digest}", None


def unavailable_reason() -> str | None:
    """Why the kernel does not run here (``None`` when it does)."""
    if _switched_off():
        return f"turned off by {ENV_SWITCH}"
    return _build()[1]


def available() -> bool:
    """Whether products may run on the kernel in this process (builds it at the first call)."""
    return unavailable_reason() is None


def identity() -> str:
    """``"off"``, or the kernel's version and build hash: recorded with a machine's timings
    (calibration, layout probe), which the kernel changes."""
    return _build()[0] if available() else "off"


def applies(x: jax.Array, w: jax.Array) -> bool:
    """Whether ``x @ w`` goes to the kernel (decided at trace time, from shapes and dtypes)."""
    return (
        x.ndim == 2
        and w.ndim == 2
        and x.dtype == jnp.float32
        and w.dtype == jnp.float32
        and MIN_ROWS <= x.shape[0] <= MAX_ROWS
        and w.shape[1] % _LANES == 0
        and x.shape[1] == w.shape[0]
        and available()
    )


@jax.custom_jvp
def product(x: Float[Array, "M K"], w: Float[Array, "K N"]) -> Float[Array, "M N"]:
    """``x @ w`` on the kernel (call only where :func:`applies`); differentiable (the
    tangents are XLA products) and vmappable (one call per batch entry)."""
    call = jax.ffi.ffi_call(
        _TARGET,
        jax.ShapeDtypeStruct((x.shape[0], w.shape[1]), jnp.float32),
        vmap_method="sequential",
    )
    return call(x, w)


@product.defjvp
def _product_jvp(primals, tangents):
    x, w = primals
    dx, dw = tangents
    return product(x, w), dx @ w + x @ dw
