"""The strict Ascend simulator: documented semantics, and loud failures on naive inputs."""

import importlib
import importlib.util
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from npu_backend import simulated  # noqa: E402
from npu_backend.simulated import AscendConstraintError, simulated_npu  # noqa: E402

ALIGN = simulated.KV_ALIGN


@pytest.fixture
def npu():
    with simulated_npu() as fake:
        yield fake


def _qkv(b=1, nq=2, n_kv=1, t=4, s=ALIGN, dh=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (
        torch.randn(b, nq, t, dh, generator=gen),
        torch.randn(b, n_kv, s, dh, generator=gen),
        torch.randn(b, n_kv, s, dh, generator=gen),
    )


def _allowed_to_ascend(allowed):
    return (~allowed).to(torch.uint8)


def test_install_and_restore():
    assert "torch_npu" not in sys.modules
    with simulated_npu() as fake:
        assert importlib.import_module("torch_npu") is fake
        assert importlib.util.find_spec("torch_npu") is not None
    assert "torch_npu" not in sys.modules


def test_restores_a_previous_module_even_after_an_error(monkeypatch):
    previous = object()
    monkeypatch.setitem(sys.modules, "torch_npu", previous)
    with pytest.raises(RuntimeError):
        with simulated_npu():
            raise RuntimeError("boom")
    assert sys.modules["torch_npu"] is previous


def test_semantics_one_means_masked_out(npu):
    q, k, v = _qkv(t=2)
    allowed = torch.zeros(2, ALIGN, dtype=torch.bool)
    allowed[0, 3] = True  # row 0 sees only key 3: its output is exactly v[3]
    allowed[1, :5] = True
    out = npu.npu_fusion_attention(
        q, k, v, 2, "BNSD", atten_mask=_allowed_to_ascend(allowed), scale=0.5
    )[0]
    torch.testing.assert_close(out[0, :, 0], v[0, 0, 3].expand(2, -1))
    scores = (q[0, :, 1] @ k[0, 0, :5].T) * 0.5
    expected = torch.softmax(scores, dim=-1) @ v[0, 0, :5]
    torch.testing.assert_close(out[0, :, 1], expected)


@pytest.mark.parametrize("shape", ["BNSS", "B1SS", "11SS", "SS"])
def test_every_documented_mask_shape_is_accepted_and_agrees(npu, shape):
    b, n, t, s = 2, 2, 4, ALIGN
    q, k, v = _qkv(b=b, nq=n, t=t, s=s)
    allowed = torch.arange(s)[None, :] <= torch.arange(t)[:, None] + 3  # [T, S]
    full = _allowed_to_ascend(allowed)
    mask = {
        "BNSS": full.expand(b, n, t, s),
        "B1SS": full.expand(b, 1, t, s),
        "11SS": full[None, None],
        "SS": full,
    }[shape].contiguous()
    out = npu.npu_fusion_attention(q, k, v, n, "BNSD", atten_mask=mask)[0]
    expected = npu.npu_fusion_attention(q, k, v, n, "BNSD", atten_mask=full)[0]
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("layout", ["BSND", "BSH", "SBH"])
def test_other_layouts_agree_with_bnsd(npu, layout):
    q, k, v = _qkv(b=2, nq=4, n_kv=2)
    mask = torch.zeros(4, ALIGN, dtype=torch.uint8)
    expected = npu.npu_fusion_attention(q, k, v, 4, "BNSD", atten_mask=mask)[0]

    def pack(x):
        bsnd = x.transpose(1, 2)
        if layout == "BSND":
            return bsnd.contiguous()
        bsh = bsnd.reshape(x.shape[0], x.shape[2], -1)
        return (bsh.transpose(0, 1) if layout == "SBH" else bsh).contiguous()

    out = npu.npu_fusion_attention(pack(q), pack(k), pack(v), 4, layout, atten_mask=mask)[0]
    torch.testing.assert_close(out, pack(expected))


def test_sdpa_polarity_causal_mask_is_caught(npu):
    """A True = attend causal mask passed unchanged: the last row masks every key."""
    t = s = ALIGN
    q, k, v = _qkv(t=t, s=s)
    sdpa_causal = torch.ones(t, s, dtype=torch.bool).tril()
    with pytest.raises(AscendConstraintError, match="every key masked.*SDPA"):
        npu.npu_fusion_attention(q, k, v, 2, "BNSD", atten_mask=sdpa_causal)
    # The same mask inverted is fine.
    npu.npu_fusion_attention(q, k, v, 2, "BNSD", atten_mask=~sdpa_causal)
    assert npu.calls == 1


def test_sdpa_polarity_with_zero_padded_keys_is_caught(npu):
    """Naive padding (False columns) plus wrong polarity: no row is empty, but padding is read."""
    t, real = 6, 6
    q, k, v = _qkv(t=t, s=real)
    k = torch.nn.functional.pad(k, (0, 0, 0, ALIGN - real))
    v = torch.nn.functional.pad(v, (0, 0, 0, ALIGN - real))
    sdpa_causal = torch.ones(t, real, dtype=torch.bool).tril()
    naive = torch.nn.functional.pad(sdpa_causal, (0, ALIGN - real), value=False)
    with pytest.raises(AscendConstraintError, match="padded tail"):
        npu.npu_fusion_attention(q, k, v, 2, "BNSD", atten_mask=naive)
    correct = torch.nn.functional.pad(~sdpa_causal, (0, ALIGN - real), value=True)
    npu.npu_fusion_attention(q, k, v, 2, "BNSD", atten_mask=correct)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda q, k, v, m: dict(query=q, key=k, value=v, atten_mask=m.float()), "dtype"),
        (
            lambda q, k, v, m: dict(query=q, key=k, value=v, atten_mask=m[None]),
            "none of BNSS/B1SS/11SS/SS",
        ),
        (lambda q, k, v, m: dict(query=q, key=k, value=v, atten_mask=m + 2), "other than 0 and 1"),
        (
            lambda q, k, v, m: dict(
                query=q, key=k[:, :, :-1], value=v[:, :, :-1], atten_mask=m[:, :-1].contiguous()
            ),
            "not padded",
        ),
        (
            lambda q, k, v, m: dict(
                query=q.transpose(2, 3).contiguous().transpose(2, 3), key=k, value=v, atten_mask=m
            ),
            "not contiguous",
        ),
        (lambda q, k, v, m: dict(query=q, key=k.half(), value=v, atten_mask=m), "mixed dtypes"),
        (
            lambda q, k, v, m: dict(query=q, key=k, value=v, atten_mask=m, sparse_mode=3),
            "sparse_mode",
        ),
        (lambda q, k, v, m: dict(query=q, key=k, value=v, atten_mask=None), "required"),
    ],
)
def test_constraint_violations_raise(npu, make, message):
    q, k, v = _qkv(nq=2, n_kv=1)
    mask = torch.zeros(4, ALIGN, dtype=torch.uint8)
    kwargs = make(q, k, v, mask)
    with pytest.raises(AscendConstraintError, match=message):
        npu.npu_fusion_attention(head_num=2, input_layout="BNSD", **kwargs)
    assert npu.calls == 0


def test_head_constraints(npu):
    mask = torch.zeros(4, ALIGN, dtype=torch.uint8)
    q, k, v = _qkv(nq=3, n_kv=2)
    with pytest.raises(AscendConstraintError, match="not a multiple of kv heads"):
        npu.npu_fusion_attention(q, k, v, 3, "BNSD", atten_mask=mask)
    q, k, v = _qkv(nq=2, n_kv=1)
    with pytest.raises(AscendConstraintError, match="head_num=4"):
        npu.npu_fusion_attention(q, k, v, 4, "BNSD", atten_mask=mask)
    q, k, v = _qkv(nq=1, n_kv=1, dh=770)
    with pytest.raises(AscendConstraintError, match="head dim 770"):
        npu.npu_fusion_attention(q, k, v, 1, "BNSD", atten_mask=mask)


def test_retrieve_table_padded_with_minus_one_is_caught():
    """EAGLE pads retrieve indices with -1; on CPU ``logits[idx]`` wraps to the last node."""
    logits = torch.arange(5.0)[:, None].expand(5, 3)  # node i has logits all equal to i
    retrieve = torch.tensor([[0, 1, 3], [0, 2, -1]])
    assert logits[retrieve][1, 2, 0] == 4.0  # the silent wrap a device would not do
    with pytest.raises(AscendConstraintError, match=r"indices \[-1\].*negative"):
        simulated.index_select(logits, retrieve.flatten(), dim=0)
    with pytest.raises(AscendConstraintError, match=r"\[-1, -1, -1\]"):
        simulated.gather(logits, retrieve[:, :, None].expand(2, 3, 3).reshape(6, 3), dim=0)


def test_strict_index_helpers_match_torch_on_valid_indices():
    x = torch.arange(24.0).reshape(4, 6)
    index = torch.tensor([[3, 0, 1, 5, 5, 2]] * 2)
    torch.testing.assert_close(simulated.gather(x, index, dim=1), torch.gather(x, 1, index))
    rows = torch.tensor([3, 1], dtype=torch.int32)
    torch.testing.assert_close(simulated.index_select(x, rows, dim=0), x[[3, 1]])
    with pytest.raises(AscendConstraintError, match=r"\[6\] outside \[0, 6\)"):
        simulated.gather(x, torch.tensor([[6]]), dim=1)
    with pytest.raises(AscendConstraintError, match="integer"):
        simulated.index_select(x, torch.tensor([0.0]), dim=0)


def test_reference_matches_float64_softmax(npu):
    q, k, v = _qkv(b=1, nq=2, n_kv=1, t=3, seed=5)
    gen = np.random.default_rng(0)
    masked = gen.random((3, ALIGN)) < 0.5
    masked[:, 0] = False
    out = npu.npu_fusion_attention(
        q, k, v, 2, "BNSD", atten_mask=torch.from_numpy(masked.astype(np.uint8)), scale=0.25
    )[0]
    qd, kd, vd = (x.double().numpy()[0] for x in (q, k, v))
    for h in range(2):
        scores = np.where(masked, -np.inf, qd[h] @ kd[0].T * 0.25)
        p = np.exp(scores - scores.max(-1, keepdims=True))
        np.testing.assert_allclose(
            out[0, h].numpy(), (p / p.sum(-1, keepdims=True)) @ vd[0], atol=1e-5
        )
