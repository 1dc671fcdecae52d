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
(``$CXX``, else ``c++``) with OpenMP for the widest instruction set the CPU has of
:data:`INSTRUCTION_SETS` (AVX-512F, else AVX2 with FMA; both builds give bitwise the same
results), cached in the project's cache folder under a name that hashes its source, flags,
the JAX version and the CPU's model and flags (written atomically), and registered with JAX.
:func:`available` says whether it can run here; it cannot without an x86-64 CPU with one of
those instruction sets, a C++ compiler, or JAX's CPU backend. ``EAGLEPANGU_FEW_ROW_KERNEL``
chooses: unset (or ``auto``) the widest set, ``avx512`` or ``avx2`` that one (``avx2`` on
an AVX-512 machine shows what a machine without AVX-512 gets), ``0`` / ``off`` none. Where
the kernel does not run, :func:`applies` is False and callers use XLA's product: the results
agree to float rounding either way (the kernel sums every output over ``k`` in order; it is
not bitwise XLA's).

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
    "INSTRUCTION_SETS",
    "instruction_set",
    "usable_instruction_sets",
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
# The instruction sets the kernel is built for, widest first: each with the CPU flags it needs
# (as /proc/cpuinfo names them) and the compiler flags that select its code path in the source.
INSTRUCTION_SETS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "avx512": (("avx512f", "fma"), ("-mavx512f", "-mfma")),
    "avx2": (("avx2", "fma"), ("-mavx2", "-mfma")),
}
_OFF = ("0", "off", "false", "no")
_AUTO = ("", "1", "on", "true", "yes", "auto")
_LANES = 16  # columns are split between the kernel's threads in pieces of 16
_SOURCE = Path(__file__).with_name("few_row_product.cc")
_SYMBOL = "EaglepanguFewRowProduct"
_TARGET = "eaglepangu_few_row_product_v2_{}"
_FLAGS = ("-std=c++17", "-O3", "-fopenmp", "-shared", "-fPIC", "-w")


def _switch() -> str:
    """The switch's value, normalised: "off", "auto" or an instruction set's name."""
    value = os.environ.get(ENV_SWITCH, "").strip().lower()
    if value in _OFF:
        return "off"
    if value in _AUTO:
        return "auto"
    if value in INSTRUCTION_SETS:
        return value
    raise ValueError(
        f"{ENV_SWITCH}={os.environ[ENV_SWITCH]!r} is not understood: expected unset or "
        f"'auto', one of {sorted(INSTRUCTION_SETS)}, or '0' / 'off'"
    )


@functools.cache
def _cpu() -> tuple[str, frozenset[str]]:
    """The CPU's model name and flags (empty off x86-64 or without /proc/cpuinfo)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return platform.machine(), frozenset()
    model, flags = "", frozenset()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and not model:
                    model = value.strip()
                elif key.strip() == "flags" and not flags:
                    flags = frozenset(value.split())
    except OSError:
        pass
    return model, flags


def _cache_folder() -> Path:
    return resolve_cache_dir() / "kernels"


def usable_instruction_sets() -> list[str]:
    """The keys of :data:`INSTRUCTION_SETS` this CPU has, widest first (whatever the switch)."""
    _, flags = _cpu()
    return [name for name, (needs, _) in INSTRUCTION_SETS.items() if flags.issuperset(needs)]


def _chosen() -> tuple[str | None, str | None]:
    """``(instruction set, None)`` the switch and the CPU choose, else ``(None, reason)``."""
    switch = _switch()
    if switch == "off":
        return None, f"turned off by {ENV_SWITCH}"
    usable = usable_instruction_sets()
    if switch == "auto":
        if not usable:
            wanted = " or ".join("+".join(needs) for needs, _ in INSTRUCTION_SETS.values())
            return None, f"the CPU has none of the instruction sets the kernel needs ({wanted})"
        return usable[0], None
    if switch not in usable:
        needs = "+".join(INSTRUCTION_SETS[switch][0])
        return None, f"{ENV_SWITCH} asks for {switch}, but the CPU lacks {needs}"
    return switch, None


def _compile_flags(isa: str) -> tuple[str, ...]:
    return (*_FLAGS, *INSTRUCTION_SETS[isa][1])


def _digest(isa: str, compiler: str) -> str:
    """A hash of all that shapes the machine code of the kernel built for ``isa`` by
    ``compiler``, the CPU included: a cache folder shared between machines never hands one a
    library built for instructions it lacks."""
    model, cpu_flags = _cpu()
    parts = [
        _SOURCE.read_bytes(),
        " ".join(_compile_flags(isa)).encode(),
        jax.__version__.encode(),
        compiler.encode(),
        model.encode(),
        " ".join(sorted(cpu_flags)).encode(),
    ]
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]


@functools.cache
def _build(isa: str) -> tuple[str | None, str | None]:
    """``(identity, None)`` once the kernel for ``isa`` is compiled, loaded and registered,
    else ``(None, reason)``. Runs once per process and instruction set."""
    if jax.default_backend() != "cpu":
        return None, f"JAX's backend is {jax.default_backend()!r}, not the CPU"
    compiler = shutil.which(os.environ.get("CXX", "c++"))
    if compiler is None:
        return None, "no C++ compiler found ($CXX, else c++)"
    flags = _compile_flags(isa)
    digest = _digest(isa, compiler)
    library = _cache_folder() / f"few_row_{isa}_{digest}.so"
    if not library.exists():
        library.parent.mkdir(parents=True, exist_ok=True)
        fd, partial = tempfile.mkstemp(dir=library.parent, suffix=".so.partial")
        os.close(fd)
        command = [compiler, *flags, f"-I{jax.ffi.include_dir()}", str(_SOURCE), "-o", partial]
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
        jax.ffi.register_ffi_target(_TARGET.format(isa), jax.ffi.pycapsule(handler), platform="cpu")
    except (OSError, AttributeError) as err:
        return None, f"loading the kernel failed: {err}"
    return f"v2-{isa}-{digest}", None


def unavailable_reason() -> str | None:
    """Why the kernel does not run here (``None`` when it does). Raises ``ValueError`` when
    the switch's value is not understood."""
    isa, reason = _chosen()
    return reason if isa is None else _build(isa)[1]


def available() -> bool:
    """Whether products may run on the kernel in this process (builds it at the first call)."""
    return unavailable_reason() is None


def instruction_set() -> str | None:
    """The instruction set products run on here (a key of :data:`INSTRUCTION_SETS`), or
    ``None`` where the kernel does not run."""
    return _chosen()[0] if available() else None


def identity() -> str:
    """``"off"``, or the kernel's version, instruction set and build hash: recorded with a
    machine's timings (calibration, layout probe), which the kernel changes."""
    isa = instruction_set()
    return "off" if isa is None else _build(isa)[0]


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
    isa = instruction_set()
    if isa is None:
        raise RuntimeError(f"the few-row kernel cannot run here: {unavailable_reason()}")
    call = jax.ffi.ffi_call(
        _TARGET.format(isa),
        jax.ShapeDtypeStruct((x.shape[0], w.shape[1]), jnp.float32),
        vmap_method="sequential",
    )
    return call(x, w)


@product.defjvp
def _product_jvp(primals, tangents):
    x, w = primals
    dx, dw = tangents
    return product(x, w), dx @ w + x @ dw
