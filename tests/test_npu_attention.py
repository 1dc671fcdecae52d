"""tree_attention: the three implementations agree, and each respects True = may attend."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from npu_backend import attention  # noqa: E402
from npu_backend.attention import KV_ALIGN, tree_attention  # noqa: E402
from npu_backend.device import DeviceUnavailableError  # noqa: E402
from npu_backend.simulated import simulated_npu  # noqa: E402


@pytest.fixture
def npu():
    with simulated_npu() as fake:
        yield fake


def _inputs(seed, b=2, nq=4, n_kv=2, t=5, s=9, dh=8, batched_mask=True, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, nq, t, dh, generator=gen).to(dtype)
    k = torch.randn(b, n_kv, s, dh, generator=gen).to(dtype)
    v = torch.randn(b, n_kv, s, dh, generator=gen).to(dtype)
    shape = (b, t, s) if batched_mask else (t, s)
    mask = torch.rand(shape, generator=gen) < 0.6
    mask[..., 0] = True  # every row sees something (empty rows have their own test)
    return q, k, v, mask


def _numpy_reference(q, k, v, mask, scale):
    """Per-head loop in float64: query head j reads kv head j // group."""
    q, k, v = (x.double().numpy() for x in (q, k, v))
    mask = mask.numpy()
    b, nq, t, _ = q.shape
    group = nq // k.shape[1]
    out = np.zeros_like(q)
    for bi in range(b):
        m = mask[bi] if mask.ndim == 3 else mask
        for j in range(nq):
            scores = q[bi, j] @ k[bi, j // group].T * scale
            scores = np.where(m, scores, -np.inf)
            p = np.exp(scores - scores.max(-1, keepdims=True))
            out[bi, j] = (p / p.sum(-1, keepdims=True)) @ v[bi, j // group]
    return out


@pytest.mark.parametrize("batched_mask", [True, False])
def test_eager_matches_a_per_head_float64_loop(batched_mask):
    q, k, v, mask = _inputs(0, batched_mask=batched_mask)
    out = tree_attention(q, k, v, mask, impl="eager", scale=0.3)
    np.testing.assert_allclose(out.numpy(), _numpy_reference(q, k, v, mask, 0.3), atol=1e-5)


def test_gqa_query_heads_read_consecutive_kv_heads():
    # Two kv heads with constant values 1 and 2: query heads 0,1 must read 1; heads 2,3 read 2.
    q = torch.randn(1, 4, 3, 8)
    k = torch.randn(1, 2, 6, 8)
    v = torch.stack([torch.full((6, 8), 1.0), torch.full((6, 8), 2.0)])[None]
    mask = torch.ones(3, 6, dtype=torch.bool)
    for impl in ("eager", "sdpa"):
        out = tree_attention(q, k, v, mask, impl=impl)
        expected = torch.tensor([1.0, 1.0, 2.0, 2.0])[None, :, None, None].expand_as(out)
        torch.testing.assert_close(out, expected)


@given(
    seed=st.integers(0, 2**16),
    group=st.sampled_from([1, 2, 3]),
    n_kv=st.integers(1, 2),
    t=st.integers(1, 6),
    s=st.integers(1, 40),
    batched_mask=st.booleans(),
)
def test_sdpa_agrees_with_eager(seed, group, n_kv, t, s, batched_mask):
    q, k, v, mask = _inputs(seed, nq=group * n_kv, n_kv=n_kv, t=t, s=s, batched_mask=batched_mask)
    eager = tree_attention(q, k, v, mask, impl="eager")
    sdpa = tree_attention(q, k, v, mask, impl="sdpa")
    torch.testing.assert_close(sdpa, eager, atol=1e-5, rtol=1e-5)


@given(
    seed=st.integers(0, 2**16),
    group=st.sampled_from([1, 3]),
    t=st.integers(1, 6),
    s=st.sampled_from([1, 7, KV_ALIGN - 1, KV_ALIGN, KV_ALIGN + 3]),
    batched_mask=st.booleans(),
)
def test_npu_fused_agrees_with_eager_under_the_simulator(seed, group, t, s, batched_mask):
    q, k, v, mask = _inputs(seed, nq=2 * group, n_kv=2, t=t, s=s, batched_mask=batched_mask)
    eager = tree_attention(q, k, v, mask, impl="eager")
    with simulated_npu() as fake:
        fused = tree_attention(q, k, v, mask, impl="npu_fused")
    assert fake.calls == 1
    torch.testing.assert_close(fused, eager, atol=1e-5, rtol=1e-5)


def test_npu_fused_in_half_precision(npu):
    q, k, v, mask = _inputs(3, dtype=torch.bfloat16, s=20)
    fused = tree_attention(q, k, v, mask, impl="npu_fused")
    eager = tree_attention(q, k, v, mask, impl="eager")
    assert fused.dtype == torch.bfloat16
    torch.testing.assert_close(fused.float(), eager.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("impl", ["eager", "sdpa", "npu_fused"])
def test_fully_masked_rows_give_zeros_like_the_jax_forward(impl, npu):
    q, k, v, mask = _inputs(1, s=12)
    mask[1, 2] = False
    mask[0, 4] = False
    out = tree_attention(q, k, v, mask, impl=impl)
    assert torch.isfinite(out).all()
    assert (out[1, :, 2] == 0).all() and (out[0, :, 4] == 0).all()
    reference = tree_attention(q, k, v, mask, impl="eager")
    torch.testing.assert_close(out, reference, atol=1e-5, rtol=1e-5)


def test_scale_is_honoured():
    q, k, v, mask = _inputs(2)
    for scale in (0.05, 1.0):
        expected = _numpy_reference(q, k, v, mask, scale)
        for impl in ("eager", "sdpa"):
            out = tree_attention(q, k, v, mask, impl=impl, scale=scale)
            np.testing.assert_allclose(out.numpy(), expected, atol=1e-5)


def test_ascend_mask_inverts_and_pads_with_masked_columns():
    mask = torch.tensor([[True, False, True], [False, True, True]])
    ascend = attention.ascend_mask(mask, multiple=4)
    assert ascend.dtype == torch.uint8
    assert ascend.tolist() == [[0, 1, 0, 1], [1, 0, 0, 1]]


def test_npu_fused_without_torch_npu_names_what_is_missing(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "torch_npu", None)  # makes the import fail
    q, k, v, mask = _inputs(0)
    with pytest.raises(DeviceUnavailableError, match="npu_fused' needs torch_npu.*not installed"):
        tree_attention(q, k, v, mask, impl="npu_fused")


def test_choose_impl_follows_mode_and_device(monkeypatch):
    monkeypatch.setenv("EAGLEPANGU_MODE", "performance")
    assert attention.choose_impl("npu:0") == "npu_fused"
    assert attention.choose_impl("cpu") == "sdpa"
    monkeypatch.setenv("EAGLEPANGU_MODE", "reference")
    assert attention.choose_impl("npu") == "eager"


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda q, k, v, m: (q, k, v, m.to(torch.uint8)), "must be bool"),
        (lambda q, k, v, m: (q, k, v, m[..., :-1]), "mask must be"),
        (lambda q, k, v, m: (q[:, :3], k, v, m), "not a multiple"),
        (lambda q, k, v, m: (q, k, v[..., :4], m), "k and v"),
        (lambda q, k, v, m: (q[0], k, v, m), "4-D"),
        (lambda q, k, v, m: (q.double(), k, v, m), "dtypes differ"),
    ],
)
def test_bad_inputs_are_refused(change, message):
    args = change(*_inputs(0))
    with pytest.raises(ValueError, match=message):
        tree_attention(*args, impl="eager")


def test_unknown_impl_is_refused():
    with pytest.raises(ValueError, match="impl must be one of"):
        tree_attention(*_inputs(0), impl="flash")
