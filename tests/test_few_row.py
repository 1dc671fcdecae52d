"""The few-row product kernel (models/few_row.py): values, routing, switch, llama's use."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from eaglepangu_jax import cache as kv_cache
from eaglepangu_jax.calibration import store
from eaglepangu_jax.models import few_row, llama
from eaglepangu_jax.models.config import LlamaConfig
from eaglepangu_jax.models.init import random_params

needs_kernel = pytest.mark.skipif(
    not few_row.available(), reason=f"kernel unavailable: {few_row.unavailable_reason()}"
)


def _operands(rows, inner, cols, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, inner), dtype=np.float32)
    w = rng.standard_normal((inner, cols), dtype=np.float32)
    return jnp.asarray(x), jnp.asarray(w)


@needs_kernel
@settings(max_examples=25, deadline=None)
@given(
    rows=st.integers(1, 16),
    inner=st.integers(1, 70),
    pieces=st.integers(1, 7),
    seed=st.integers(0, 2**16),
)
def test_product_equals_the_matrix_product(rows, inner, pieces, seed):
    x, w = _operands(rows, inner, 16 * pieces, seed)
    got = np.asarray(jax.jit(few_row.product)(x, w))
    want = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    # float32 rounding of an inner sum of `inner` terms of size ~1
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * inner)


@needs_kernel
def test_an_empty_inner_dimension_gives_zeros():
    x, w = jnp.ones((3, 0), jnp.float32), jnp.ones((0, 32), jnp.float32)
    np.testing.assert_array_equal(few_row.product(x, w), np.zeros((3, 32), np.float32))


@needs_kernel
def test_a_rows_result_does_not_depend_on_the_rows_beside_it():
    x, w = _operands(7, 576, 192)
    together = np.asarray(few_row.product(x, w))
    for r in range(7):
        alone = np.asarray(few_row.product(x[r : r + 1], w))
        np.testing.assert_array_equal(together[r], alone[0])  # bitwise


@pytest.mark.parametrize(
    "rows, cols, dtype, applies",
    [
        (1, 32, jnp.float32, False),  # one row stays with XLA's matrix-vector product
        (2, 32, jnp.float32, True),
        (few_row.MAX_ROWS, 32, jnp.float32, True),
        (few_row.MAX_ROWS + 1, 32, jnp.float32, False),
        (4, 40, jnp.float32, False),  # columns not a multiple of 16
        (4, 32, jnp.bfloat16, False),
    ],
)
def test_which_products_go_to_the_kernel(rows, cols, dtype, applies):
    x = jnp.zeros((rows, 8), dtype)
    w = jnp.zeros((8, cols), dtype)
    assert few_row.applies(x, w) is (applies and few_row.available())


def test_three_dimensional_operands_stay_with_xla():
    assert not few_row.applies(jnp.zeros((2, 4, 8)), jnp.zeros((8, 16)))


def test_the_switch_turns_the_kernel_off(monkeypatch):
    monkeypatch.setenv(few_row.ENV_SWITCH, "0")
    assert not few_row.available()
    assert few_row.identity() == "off"
    assert few_row.ENV_SWITCH in few_row.unavailable_reason()
    assert not few_row.applies(jnp.zeros((4, 8)), jnp.zeros((8, 32)))


def test_a_switch_value_not_understood_is_an_error_naming_it(monkeypatch):
    monkeypatch.setenv(few_row.ENV_SWITCH, "sse4")
    with pytest.raises(ValueError, match=f"{few_row.ENV_SWITCH}='sse4' is not understood"):
        few_row.available()


def _cpu_with(*flags):
    return lambda: ("a CPU", frozenset(flags))


@pytest.mark.parametrize(
    "flags, switch, chosen, reason",
    [
        (("avx512f", "avx2", "fma"), "", "avx512", None),
        (("avx512f", "avx2", "fma"), "avx2", "avx2", None),
        (("avx2", "fma"), "auto", "avx2", None),
        (("avx2", "fma"), "avx512", None, "asks for avx512, but the CPU lacks avx512f+fma"),
        (("avx2",), "", None, "none of the instruction sets"),  # AVX2 without FMA
        ((), "", None, "none of the instruction sets"),  # not x86-64
        (("avx512f", "fma"), "off", None, "turned off by"),
    ],
)
def test_the_instruction_set_follows_the_cpu_and_the_switch(
    flags, switch, chosen, reason, monkeypatch
):
    monkeypatch.setattr(few_row, "_cpu", _cpu_with(*flags))
    monkeypatch.setenv(few_row.ENV_SWITCH, switch)
    got, why = few_row._chosen()
    assert got == chosen
    assert (why is None) if reason is None else (reason in why)


def test_a_library_built_on_another_cpu_is_not_reused(monkeypatch):
    monkeypatch.setattr(few_row, "_cpu", _cpu_with("avx2", "fma"))
    here = few_row._digest("avx2", "c++")
    assert few_row._digest("avx2", "c++") == here
    monkeypatch.setattr(few_row, "_cpu", _cpu_with("avx2", "fma", "avx512f"))
    assert few_row._digest("avx2", "c++") != here
    assert few_row._digest("avx512", "c++") != few_row._digest("avx2", "c++")


def _builds_here(isa):
    try:
        return few_row._chosen()[0] is not None and few_row._build(isa)[0] is not None
    except ValueError:
        return False


@pytest.mark.skipif(
    not (_builds_here("avx512") and _builds_here("avx2") and few_row._cpu()[1] >= {"avx512f"}),
    reason="needs a CPU with AVX-512F and AVX2 and a kernel build for each",
)
@pytest.mark.parametrize("rows", [2, 5, 8])
def test_the_avx2_and_avx512_builds_give_bitwise_the_same_products(rows, monkeypatch):
    # Every output is the same chain of fused multiply-adds whatever the register width or
    # the columns a step covers (97 pieces of 16: a thread's range ends in an odd piece).
    x, w = _operands(rows, 576, 16 * 97, seed=3)
    results = {}
    for isa in ("avx512", "avx2"):
        monkeypatch.setenv(few_row.ENV_SWITCH, isa)
        assert few_row.identity().startswith(f"v2-{isa}-")
        results[isa] = np.asarray(few_row.product(x, w))
    np.testing.assert_array_equal(results["avx512"], results["avx2"])


def test_the_machine_description_names_the_kernel(monkeypatch):
    assert store.describe_machine()["few_row_kernel"] == few_row.identity()
    monkeypatch.setenv(few_row.ENV_SWITCH, "off")
    assert store.describe_machine()["few_row_kernel"] == "off"


def test_timings_taken_with_another_kernel_setting_are_not_this_machines():
    here = store.describe_machine()
    other = "off" if here["few_row_kernel"] != "off" else "v1-something-else"

    class Record:
        machine = {**here, "few_row_kernel": other}

    assert not store.same_machine(Record())
    Record.machine = here
    assert store.same_machine(Record())


@needs_kernel
def test_shapes_the_kernel_cannot_take_are_refused_by_it():
    x, w = _operands(3, 8, 20)
    with pytest.raises(Exception, match="multiple of 16"):
        jax.block_until_ready(few_row.product(x, w))


@needs_kernel
def test_gradients_and_vmap_follow_the_matrix_product():
    x, w = _operands(3, 24, 32)
    gx, gw = jax.grad(lambda a, b: jnp.sum(jnp.sin(few_row.product(a, b))), argnums=(0, 1))(x, w)
    hx, hw = jax.grad(lambda a, b: jnp.sum(jnp.sin(a @ b)), argnums=(0, 1))(x, w)
    np.testing.assert_allclose(gx, hx, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(gw, hw, rtol=1e-4, atol=1e-4)
    batch = jnp.stack([x, 2 * x])
    np.testing.assert_allclose(
        jax.vmap(few_row.product, in_axes=(0, None))(batch, w), batch @ w, rtol=1e-5, atol=1e-4
    )


CONFIG = LlamaConfig.tiny()  # hidden 32, MLP 64, K/V 16: every layer product is eligible


def _forward_fn():
    # A fresh jit each time: the kernel is chosen at trace time.
    return jax.jit(functools.partial(llama.forward, config=CONFIG))


def _inputs(t):
    cache = kv_cache.init(CONFIG.num_layers, 16, CONFIG.num_kv_heads, CONFIG.head_dim)
    tokens = jnp.arange(3, 3 + t, dtype=jnp.int32)
    positions = jnp.arange(t, dtype=jnp.int32)
    mask = jnp.asarray(np.arange(16)[None, :] <= np.arange(t)[:, None])
    return tokens, positions, cache, mask


@needs_kernel
@pytest.mark.parametrize("layout", ["stacked", "prepared"])
def test_the_teacher_forward_runs_its_few_row_products_on_the_kernel(layout, monkeypatch):
    params = random_params(CONFIG, jax.random.PRNGKey(0))
    if layout == "prepared":
        params = llama.prepare_params(params)
    args = _inputs(4)
    with_kernel = _forward_fn()
    assert "ffi_call" in str(with_kernel.trace(params, *args).jaxpr)
    logits, features, cache = with_kernel(params, *args)
    monkeypatch.setenv(few_row.ENV_SWITCH, "0")
    without = _forward_fn()
    assert "ffi_call" not in str(without.trace(params, *args).jaxpr)
    ref_logits, ref_features, ref_cache = without(params, *args)
    np.testing.assert_allclose(logits, ref_logits, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(features, ref_features, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(cache.k, ref_cache.k, rtol=1e-5, atol=1e-5)


@needs_kernel
def test_a_one_token_step_stays_with_xla():
    params = llama.prepare_params(random_params(CONFIG, jax.random.PRNGKey(0)))
    assert "ffi_call" not in str(_forward_fn().trace(params, *_inputs(1)).jaxpr)
