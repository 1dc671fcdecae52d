"""JAX <-> torch bridge: values, dtypes, and that CPU transfers share memory."""

import math

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from npu_backend import bridge  # noqa: E402

CROSSING = ["float32", "bfloat16", "float16", "int32", "uint8", "bool"]


def _sample(name: str, shape=(3, 5)) -> np.ndarray:
    values = np.arange(math.prod(shape)).reshape(shape) % 7
    return values.astype(bool) if name == "bool" else values.astype(bridge.DTYPES[name][0])


@pytest.mark.parametrize("name", CROSSING)
def test_round_trip_keeps_values_dtype_and_shape(name):
    x = jnp.asarray(_sample(name))
    t = bridge.to_torch(x)
    assert t.dtype == bridge.DTYPES[name][1]
    assert tuple(t.shape) == x.shape
    back = bridge.to_jax(t)
    assert back.dtype == x.dtype
    np.testing.assert_array_equal(np.asarray(back), np.asarray(x))


def test_to_torch_shares_the_jax_buffer():
    x = jnp.arange(16, dtype=jnp.float32).reshape(4, 4)
    t = bridge.to_torch(x)
    assert t.data_ptr() == x.unsafe_buffer_pointer()
    # Writing through torch is visible from JAX: the buffer really is shared.
    t[1, 2] = -5.0
    assert float(x[1, 2]) == -5.0


def test_to_jax_shares_the_torch_buffer():
    t = torch.arange(16, dtype=torch.float32).reshape(4, 4)
    x = bridge.to_jax(t)
    assert x.unsafe_buffer_pointer() == t.data_ptr()
    t[3, 0] = 42.0
    assert float(x[3, 0]) == 42.0


def test_bool_masks_travel_as_uint8_and_come_back_bool():
    mask = jnp.asarray([[True, False, True], [False, False, True]])
    t = bridge.to_torch(mask)
    assert t.dtype == torch.bool
    assert t.tolist() == [[True, False, True], [False, False, True]]
    back = bridge.to_jax(torch.tensor([[False, True]]))
    assert back.dtype == jnp.bool_
    assert back.tolist() == [[False, True]]


def test_non_contiguous_tensor_crosses_with_the_right_values():
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4).T
    assert not t.is_contiguous()
    np.testing.assert_array_equal(np.asarray(bridge.to_jax(t)), t.numpy())


def test_grad_tracking_tensor_crosses():
    t = torch.ones(3, requires_grad=True)
    np.testing.assert_array_equal(np.asarray(bridge.to_jax(t)), np.ones(3, np.float32))


@pytest.mark.parametrize("dtype", [torch.float64, torch.int16, torch.complex64, torch.int8])
def test_unsupported_torch_dtypes_are_refused(dtype):
    with pytest.raises(TypeError, match="cannot cross to JAX"):
        bridge.to_jax(torch.zeros(2, dtype=dtype))


@pytest.mark.parametrize("dtype", [jnp.int16, jnp.int8, jnp.uint32])
def test_unsupported_jax_dtypes_are_refused(dtype):
    with pytest.raises(TypeError, match="cannot cross to torch"):
        bridge.to_torch(jnp.zeros(2, dtype))


def test_int64_without_x64_is_refused_not_narrowed():
    with pytest.raises(TypeError, match="jax_enable_x64"):
        bridge.to_jax(torch.tensor([2**40], dtype=torch.int64))


def test_wrong_argument_types_are_refused():
    with pytest.raises(TypeError, match="jax.Array"):
        bridge.to_torch(np.zeros(2, np.float32))
    with pytest.raises(TypeError, match="torch.Tensor"):
        bridge.to_jax(np.zeros(2, np.float32))


@given(
    shape=st.lists(st.integers(1, 5), min_size=1, max_size=3),
    name=st.sampled_from(CROSSING),
)
def test_round_trip_is_identity(shape, name):
    x = jnp.asarray(_sample(name, tuple(shape)))
    np.testing.assert_array_equal(np.asarray(bridge.to_jax(bridge.to_torch(x))), np.asarray(x))


def test_measure_roundtrip_overhead_returns_seconds():
    seconds = bridge.measure_roundtrip_overhead((8, 8), repeats=3)
    assert isinstance(seconds, float) and 0.0 < seconds < 10.0
    with pytest.raises(ValueError, match="repeats"):
        bridge.measure_roundtrip_overhead((2,), repeats=0)
