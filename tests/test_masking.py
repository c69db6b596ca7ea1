"""Which keys each query sees: both causal alignments, windows, fully masked rows, empty inputs."""

from __future__ import annotations

import pytest
import torch

import flashtile

from conftest import DEVICE, forced_tiles, random_qkv, skip_unsupported


def _attention_pattern(backend, seqlen_q, seqlen_k, **kwargs):
    """Run flash_attn_func with V = identity so that out[i] is row i of the probability matrix."""
    q = torch.randn(1, seqlen_q, 1, 8, device=DEVICE)
    k = torch.randn(1, seqlen_k, 1, 8, device=DEVICE)
    v = torch.eye(seqlen_k, device=DEVICE).view(1, seqlen_k, 1, seqlen_k)
    with forced_tiles(backend, 2, 3):
        out, lse = flashtile.flash_attn_func(q, k, v, return_lse=True, **kwargs)
    return (out[0, :, 0] > 0).int().tolist(), lse[0, 0]


def test_causal_is_bottom_right_when_queries_are_fewer(backend):
    pattern, _ = _attention_pattern(backend, 2, 5, causal=True)
    assert pattern == [[1, 1, 1, 1, 0],
                       [1, 1, 1, 1, 1]]


def test_causal_is_bottom_right_when_queries_are_more(backend):
    pattern, lse = _attention_pattern(backend, 5, 2, causal=True)
    assert pattern == [[0, 0], [0, 0], [0, 0], [1, 0], [1, 1]]
    assert torch.isneginf(lse[:3]).all() and lse[3:].isfinite().all()


def test_window_is_aligned_to_the_same_diagonal(backend):
    pattern, _ = _attention_pattern(backend, 3, 6, window_size=(1, 1))
    # diagonal offset 3: row i centres on key i + 3
    assert pattern == [[0, 0, 1, 1, 1, 0],
                       [0, 0, 0, 1, 1, 1],
                       [0, 0, 0, 0, 1, 1]]


def test_causal_window_combines_both_limits(backend):
    pattern, _ = _attention_pattern(backend, 4, 4, causal=True, window_size=(1, 5))  # causal forces right = 0
    assert pattern == [[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]]


def test_sdpa_causal_is_top_left(backend):
    q = torch.randn(1, 1, 5, 8, device=DEVICE)
    k = torch.randn(1, 1, 2, 8, device=DEVICE)
    v = torch.eye(2, device=DEVICE).view(1, 1, 2, 2)
    with forced_tiles(backend, 2, 1):
        out = flashtile.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert (out[0, 0] > 0).int().tolist() == [[1, 0], [1, 1], [1, 1], [1, 1], [1, 1]]


@pytest.mark.parametrize("dtype", (torch.float32, torch.float16, torch.float64), ids=("fp32", "fp16", "fp64"))
def test_fully_masked_rows_give_zero_output_neg_inf_lse_and_zero_gradients(backend, dtype):
    skip_unsupported(backend, dtype)
    # seqlen_q > seqlen_k with causal: the first rows see no key; the window leaves others empty too
    q, k, v = random_qkv(2, 30, 11, 4, 2, 16, 8, dtype, requires_grad=True)
    with forced_tiles(backend, 4, 3):
        out, lse = flashtile.flash_attn_func(q, k, v, causal=True, return_lse=True)
    empty = 30 - 11
    assert torch.equal(out[:, :empty], torch.zeros_like(out[:, :empty]))
    assert torch.isneginf(lse[:, :, :empty]).all() and lse[:, :, empty:].isfinite().all()
    grad_out = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad((out * grad_out).sum() + lse.masked_fill(lse.isinf(), 0).sum(), (q, k, v))
    assert all(g.isfinite().all() for g in (dq, dk, dv)), "NaN/inf in gradients of fully masked rows"
    assert torch.equal(dq[:, :empty], torch.zeros_like(dq[:, :empty]))


def test_window_gap_rows_are_zero_not_nan(backend):
    # left window 0 and right window 0 with seqlen_k < seqlen_q: only rows on the diagonal see a key
    q, k, v = random_qkv(1, 9, 4, 1, 1, 8, 8, torch.float32, requires_grad=True)
    with flashtile.use_backend(backend):
        out, lse = flashtile.flash_attn_func(q, k, v, window_size=(0, 0), return_lse=True)
    sees = [i + 4 - 9 in range(4) for i in range(9)]
    for i, visible in enumerate(sees):
        assert lse[0, 0, i].isfinite().item() == visible
        if not visible:
            assert out[0, i].abs().max() == 0
    out.sum().backward()
    assert q.grad.isfinite().all() and k.grad.isfinite().all() and v.grad.isfinite().all()


def test_empty_keys(backend):
    q, k, v = random_qkv(2, 5, 0, 4, 2, 16, 8, torch.float32, requires_grad=True)
    with flashtile.use_backend(backend):
        out, lse = flashtile.flash_attn_func(q, k, v, return_lse=True)
    assert out.shape == (2, 5, 4, 8) and torch.equal(out, torch.zeros_like(out))
    assert torch.isneginf(lse).all()
    out.sum().backward()
    assert torch.equal(q.grad, torch.zeros_like(q)) and k.grad.shape == k.shape and v.grad.shape == v.shape


def test_empty_queries_and_empty_batch(backend):
    for shape in ((2, 0, 7, 4, 4, 16, 16), (0, 5, 7, 4, 4, 16, 16)):
        q, k, v = random_qkv(*shape, torch.float32, requires_grad=True)
        with flashtile.use_backend(backend):
            out, lse = flashtile.flash_attn_func(q, k, v, causal=True, return_lse=True)
        assert out.shape == (shape[0], shape[1], 4, 16) and lse.shape == (shape[0], 4, shape[1])
        out.sum().backward()
        assert k.grad.shape == k.shape and torch.equal(k.grad, torch.zeros_like(k))


def test_sdpa_mask_that_hides_a_whole_row(backend):
    q, k, v = (torch.randn(2, 3, 6, 16, device=DEVICE) for _ in range(3))
    mask = torch.ones(6, 6, dtype=torch.bool, device=DEVICE)
    mask[2] = False
    additive = torch.zeros(6, 6, device=DEVICE).masked_fill(~mask, float("-inf"))
    for m in (mask, additive):
        with flashtile.use_backend(backend):
            out = flashtile.scaled_dot_product_attention(q, k, v, attn_mask=m)
        assert torch.equal(out[:, :, 2], torch.zeros_like(out[:, :, 2]))
        assert out.isfinite().all()
