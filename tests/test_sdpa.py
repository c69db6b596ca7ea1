"""flashtile.scaled_dot_product_attention against torch's on the same inputs, and against float64."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import flashtile
from flashtile.reference import sdpa_reference

from conftest import DEVICE, assert_close_to_oracle, forced_tiles


def _inputs(lead, hq, hk, seqlen_q, seqlen_k, e, ev, dtype=torch.float32):
    def make(*shape):
        return torch.randn(*shape, dtype=dtype, device=DEVICE, requires_grad=True)

    return make(*lead, hq, seqlen_q, e), make(*lead, hk, seqlen_k, e), make(*lead, hk, seqlen_k, ev)


CASES = {
    "plain": dict(lead=(2,), hq=4, hk=4, seqlen_q=37, seqlen_k=53, mask=None, is_causal=False),
    "causal-more-keys": dict(lead=(2,), hq=4, hk=4, seqlen_q=37, seqlen_k=53, mask=None, is_causal=True),
    "causal-more-queries": dict(lead=(1,), hq=2, hk=2, seqlen_q=53, seqlen_k=37, mask=None, is_causal=True),
    "gqa": dict(lead=(2,), hq=6, hk=2, seqlen_q=29, seqlen_k=29, mask=None, is_causal=True),
    "bool-mask-per-head": dict(lead=(2,), hq=4, hk=4, seqlen_q=31, seqlen_k=45, mask="bool-4d", is_causal=False),
    "float-mask-broadcast": dict(lead=(2,), hq=4, hk=4, seqlen_q=31, seqlen_k=45, mask="float-2d", is_causal=False),
    "rank-5": dict(lead=(2, 3), hq=2, hk=2, seqlen_q=17, seqlen_k=19, mask="bool-row", is_causal=False),
}


def _mask(kind, lead, hq, seqlen_q, seqlen_k):
    if kind is None:
        return None
    if kind == "bool-4d":
        mask = torch.rand(*lead, hq, seqlen_q, seqlen_k, device=DEVICE) > 0.3
        mask[..., 0] = True  # keep every row non-empty: torch returns NaN for empty rows
        return mask
    if kind == "float-2d":
        return torch.randn(seqlen_q, seqlen_k, device=DEVICE)
    if kind == "bool-row":
        mask = torch.rand(seqlen_k, device=DEVICE) > 0.5
        mask[0] = True
        return mask
    raise AssertionError(kind)


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_matches_torch_sdpa(backend, case, seed):
    lead, hq, hk, seqlen_q, seqlen_k = (case[x] for x in ("lead", "hq", "hk", "seqlen_q", "seqlen_k"))
    q, k, v = _inputs(lead, hq, hk, seqlen_q, seqlen_k, 16, 24)
    mask = _mask(case["mask"], lead, hq, seqlen_q, seqlen_k)
    kwargs = dict(attn_mask=mask, is_causal=case["is_causal"], enable_gqa=hq != hk)
    with forced_tiles(backend, 8, 16):
        ours = flashtile.scaled_dot_product_attention(q, k, v, **kwargs)
    theirs = F.scaled_dot_product_attention(q, k, v, **kwargs)
    ref, _ = sdpa_reference(q, k, v, **kwargs)
    assert ours.shape == theirs.shape and ours.dtype == theirs.dtype
    assert_close_to_oracle("out", ours, ref, theirs, torch.float32, seed)

    grad = torch.randn_like(ours)
    got = torch.autograd.grad((ours * grad).sum(), (q, k, v))
    want = torch.autograd.grad((ref * grad).sum(), (q, k, v))
    torch_grads = torch.autograd.grad((theirs * grad).sum(), (q, k, v))
    for name, g, w, t in zip(("dq", "dk", "dv"), got, want, torch_grads):
        assert_close_to_oracle(name, g, w, t, torch.float32, seed)


def test_rank_2_and_rank_3_inputs(backend, seed):
    for shape_q, shape_k in (((13, 8), (17, 8)), ((3, 13, 8), (3, 17, 8))):
        q, k, v = (torch.randn(shape, device=DEVICE) for shape in (shape_q, shape_k, shape_k))
        with flashtile.use_backend(backend):
            ours = flashtile.scaled_dot_product_attention(q, k, v, is_causal=True)
        theirs = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        torch.testing.assert_close(ours, theirs, atol=2e-6, rtol=1e-5)


def test_custom_scale_and_half_precision(backend, seed):
    q, k, v = _inputs((2,), 4, 4, 40, 40, 32, 32, dtype=torch.float16)
    with flashtile.use_backend(backend):
        ours = flashtile.scaled_dot_product_attention(q, k, v, scale=0.05, is_causal=True)
    ref, _ = sdpa_reference(q, k, v, scale=0.05, is_causal=True)
    eager, _ = sdpa_reference(q, k, v, scale=0.05, is_causal=True, dtype=torch.float16)
    assert_close_to_oracle("out", ours, ref, eager, torch.float16, seed)


def test_sdpa_output_is_usable_like_torchs():
    q, k, v = (torch.randn(2, 4, 8, 16, device=DEVICE) for _ in range(3))
    out = flashtile.scaled_dot_product_attention(q, k, v)
    # callers commonly do out.transpose(1, 2).reshape(batch, seq, width)
    merged = out.transpose(1, 2).reshape(2, 8, 64)
    torch.testing.assert_close(merged, F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(2, 8, 64),
                               atol=2e-6, rtol=1e-5)
