"""The oracle itself, checked against scalar loops that spell out the documented semantics."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from flashtile.reference import attention_reference, flash_attn_reference, sdpa_reference


def _scalar_attention(q, k, v, scale, left, right, offset, softcap, slopes, mask):
    """One (query, key) pair at a time, in Python floats: the rules as written in the docs."""
    batch, nheads, seqlen_q, _ = q.shape
    nheads_k, seqlen_k, headdim_v = k.shape[1], k.shape[2], v.shape[3]
    group = nheads // nheads_k
    out = torch.zeros(batch, nheads, seqlen_q, headdim_v, dtype=torch.float64)
    lse = torch.full((batch, nheads, seqlen_q), -math.inf, dtype=torch.float64)
    for b in range(batch):
        for h in range(nheads):
            for i in range(seqlen_q):
                scores = {}
                for j in range(seqlen_k):
                    if left >= 0 and j < i + offset - left:
                        continue
                    if right >= 0 and j > i + offset + right:
                        continue
                    if mask is not None and not mask[b, h, i, j]:
                        continue
                    s = scale * float(q[b, h, i] @ k[b, h // group, j])
                    if softcap > 0:
                        s = softcap * math.tanh(s / softcap)
                    if slopes is not None:
                        s -= float(slopes[b, h]) * abs(i + offset - j)
                    scores[j] = s
                if scores:
                    top = max(scores.values())
                    total = sum(math.exp(s - top) for s in scores.values())
                    lse[b, h, i] = top + math.log(total)
                    for j, s in scores.items():
                        out[b, h, i] += math.exp(s - top) / total * v[b, h // group, j]
    return out, lse


@pytest.mark.parametrize("seqlen_q, seqlen_k", [(3, 6), (6, 3), (5, 5)])
@pytest.mark.parametrize("left, right", [(-1, -1), (-1, 0), (1, 2), (0, 0), (2, -1)])
def test_oracle_matches_scalar_rules(seqlen_q, seqlen_k, left, right):
    torch.manual_seed(seqlen_q * 10 + seqlen_k)
    q = torch.randn(2, 4, seqlen_q, 3, dtype=torch.float64)
    k = torch.randn(2, 2, seqlen_k, 3, dtype=torch.float64)
    v = torch.randn(2, 2, seqlen_k, 2, dtype=torch.float64)
    slopes = torch.rand(2, 4, dtype=torch.float64)
    mask = torch.rand(2, 4, seqlen_q, seqlen_k) > 0.2
    offset = seqlen_k - seqlen_q
    out, lse = attention_reference(q, k, v, softmax_scale=0.7, window_size=(left, right), diagonal_offset=offset,
                                   softcap=1.5, alibi_slopes=slopes, attn_mask=mask)
    want_out, want_lse = _scalar_attention(q, k, v, 0.7, left, right, offset, 1.5, slopes, mask)
    torch.testing.assert_close(out, want_out, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(lse, want_lse, atol=1e-12, rtol=1e-12)


def test_flash_layout_wrapper_uses_bottom_right_alignment():
    q, k, v = torch.randn(1, 2, 1, 4), torch.randn(1, 5, 1, 4), torch.randn(1, 5, 1, 3)
    out, lse = flash_attn_reference(q, k, v, causal=True)
    want_out, want_lse = _scalar_attention(*(t.transpose(1, 2).double() for t in (q, k, v)), 0.5, -1, 0, 3, 0.0,
                                           None, None)
    torch.testing.assert_close(out.transpose(1, 2), want_out)
    torch.testing.assert_close(lse, want_lse)


def test_sdpa_wrapper_agrees_with_torch_math():
    q, k, v = torch.randn(2, 3, 7, 8), torch.randn(2, 3, 9, 8), torch.randn(2, 3, 9, 5)
    mask = torch.randn(7, 9)
    out, _ = sdpa_reference(q, k, v, attn_mask=mask)
    torch.testing.assert_close(out.float(), F.scaled_dot_product_attention(q, k, v, attn_mask=mask), atol=1e-6, rtol=1e-5)
    out, _ = sdpa_reference(q, k, v, is_causal=True)
    torch.testing.assert_close(out.float(), F.scaled_dot_product_attention(q, k, v, is_causal=True), atol=1e-6, rtol=1e-5)


def test_fully_masked_rows_have_zero_gradient_in_the_oracle():
    q, k, v = (torch.randn(1, 1, n, 4, dtype=torch.float64, requires_grad=True) for n in (4, 2, 2))
    out, lse = attention_reference(q, k, v, window_size=(-1, 0), diagonal_offset=-2)  # rows 0, 1 see nothing
    assert torch.isneginf(lse[0, 0, :2]).all() and torch.equal(out[0, 0, :2], torch.zeros(2, 4, dtype=torch.float64))
    out.sum().backward()
    assert q.grad.isfinite().all() and torch.equal(q.grad[0, 0, :2], torch.zeros(2, 4, dtype=torch.float64))
