"""The FA1-schedule forward (flashtile.triton.fwd_fa1) against the float64 oracle and the FA2-schedule forward.

Shapes are ragged against the 16 x 16 blocks of the interpreter (and 64-wide GPU blocks), cover seqlen_q <, =, >
seqlen_k, MHA / GQA / MQA and dv != d; bands are bottom-right aligned. Low-precision results follow conftest's
eager rule; the FA1 and FA2 schedules are compared within that rule's bound, never bit for bit.
"""

from __future__ import annotations

import pytest
import torch

import flashtile
from flashtile.reference import flash_attn_reference
from flashtile.triton.fwd_fa1 import forward_fa1

from conftest import (DEVICE, assert_close_to_oracle, assert_within_bounds, eager_rule_bound, random_qkv,
                      skip_unsupported)

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}

# (batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, headdim_v), keyword arguments
CASES = {
    "one-query": ((2, 1, 7, 2, 2, 16, 16), {}),
    "q7-k37-mqa": ((1, 7, 37, 3, 1, 16, 32), {}),
    "q37-k100-gqa4-dv": ((1, 37, 100, 8, 2, 32, 48), {}),
    "q100-k37-causal": ((2, 100, 37, 2, 1, 16, 16), {"causal": True}),
    "q37-k100-causal": ((1, 37, 100, 4, 2, 24, 16), {"causal": True}),
    "square-causal-scale": ((2, 53, 53, 2, 2, 64, 64), {"causal": True, "softmax_scale": 0.3}),
    "window": ((1, 70, 53, 4, 2, 16, 40), {"window_size": (5, 3)}),
    "window-left-only": ((1, 45, 70, 2, 1, 16, 16), {"window_size": (9, -1)}),
    "causal-window": ((1, 61, 61, 2, 2, 32, 16), {"causal": True, "window_size": (6, -1)}),
    "negative-scale": ((1, 33, 47, 2, 1, 16, 24), {"softmax_scale": -0.4}),
    "d128": ((1, 40, 50, 1, 1, 128, 96), {"causal": True}),
}


def _forward_bounds(got, q, k, v, kwargs, dtype, seed) -> dict:
    """out and lse of (out, lse) = got within the eager rule against the float64 oracle, rows that see no key
    exactly out = 0 and lse = -inf; returns the rule's bound of each (for comparing another schedule)."""
    out, lse = got
    ref_out, ref_lse = flash_attn_reference(q, k, v, **kwargs)
    eager_out, eager_lse = flash_attn_reference(q, k, v, dtype=dtype, **kwargs)
    assert out.dtype == dtype and lse.dtype == torch.float32, f"out {out.dtype}, lse {lse.dtype}"
    assert out.device == q.device and lse.device == q.device
    # lse is float32 but the eager baseline computes it in the input dtype
    lse_dtype = torch.float32 if dtype == torch.float32 else dtype
    assert_close_to_oracle("out", out, ref_out, eager_out, dtype, seed)
    assert_close_to_oracle("lse", lse, ref_lse, eager_lse, lse_dtype, seed)
    empty = ref_lse.isneginf()
    assert torch.equal(lse.isneginf(), empty), f"rows with lse -inf differ from the oracle's (seed {seed})"
    assert (out.transpose(1, 2)[empty] == 0).all(), f"a row that sees no key has a nonzero output (seed {seed})"
    return {"out": eager_rule_bound(ref_out, eager_out, dtype), "lse": eager_rule_bound(ref_lse, eager_lse, lse_dtype)}


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("case", CASES.keys())
def test_fa1_follows_the_eager_rule(case, dtype, seed):
    skip_unsupported("triton", dtype)
    shape, kwargs = CASES[case]
    q, k, v = random_qkv(*shape, dtype)
    _forward_bounds(forward_fa1(q, k, v, **kwargs), q, k, v, kwargs, dtype, seed)


@pytest.mark.parametrize("blocks", [(16, 32), (32, 16), (64, 16)], ids=["16x32", "32x16", "64x16"])
@pytest.mark.parametrize("kwargs", [{"causal": True}, {"window_size": (7, 2)}], ids=["causal", "window"])
def test_fa1_blocks_of_unequal_sides(blocks, kwargs, seed):
    """Query and key blocks of different sizes: the band's block bounds differ per side (16-key blocks inside one
    64-row block, and the converse), seqlen_q > seqlen_k and the converse in one batch each."""
    dtype = torch.float16
    block_m, block_n = blocks
    for shape in ((1, 83, 45, 2, 1, 16, 16), (1, 29, 90, 2, 2, 16, 32)):
        q, k, v = random_qkv(*shape, dtype)
        got = forward_fa1(q, k, v, block_m=block_m, block_n=block_n, **kwargs)
        _forward_bounds(got, q, k, v, kwargs, dtype, seed)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_rows_that_see_no_key_are_zero_with_lse_minus_inf(dtype, seed):
    """Causal with seqlen_q > seqlen_k, bottom-right aligned: the first seqlen_q - seqlen_k rows see no key (whole
    query blocks of them, and one block with both kinds of row), and the rest as the oracle says."""
    skip_unsupported("triton", dtype)
    q, k, v = random_qkv(2, 75, 30, 2, 2, 16, 24, dtype)
    out, lse = forward_fa1(q, k, v, causal=True)
    empty = 75 - 30
    assert torch.equal(out[:, :empty], torch.zeros_like(out[:, :empty]))
    assert torch.isneginf(lse[:, :, :empty]).all() and lse[:, :, empty:].isfinite().all()
    _forward_bounds((out, lse), q, k, v, {"causal": True}, dtype, seed)


def test_largest_score_in_the_last_key_block(seed):
    """Every row's largest score lies in the last, ragged key block, far above the others: the state of every
    query block is rescaled by a tiny factor at the outer loop's last step (FA1's l_i e^(m_i - m_new) O_i)."""
    dtype = torch.float16
    q, k, v = random_qkv(1, 40, 45, 2, 1, 32, 32, dtype)
    q = (q.float().abs() + 0.25).to(dtype)  # positive: a key of large positive entries scores high for every row
    k[:, -1] = 2.0
    out, lse = forward_fa1(q, k, v, softmax_scale=0.3)
    scores = torch.einsum("bqhd,bkd->bhqk", q.double(), k[:, :, 0].double()) * 0.3
    assert (scores.argmax(-1) == 44).all() and (scores[..., 44] - scores[..., :44].amax(-1) > 8).all()
    _forward_bounds((out, lse), q, k, v, {"softmax_scale": 0.3}, dtype, seed)


def test_no_keys_and_no_queries(seed):
    """seqlen_k = 0: every row sees no key (out 0, lse -inf); seqlen_q = 0: empty results."""
    q, k, v = random_qkv(2, 5, 0, 2, 1, 16, 8, torch.float32)
    out, lse = forward_fa1(q, k, v)
    assert out.shape == (2, 5, 2, 8) and torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()
    q, k, v = random_qkv(2, 0, 9, 2, 1, 16, 8, torch.float32)
    out, lse = forward_fa1(q, k, v, causal=True)
    assert out.shape == (2, 0, 2, 8) and lse.shape == (2, 2, 0)


def test_strided_inputs(seed):
    """K stored (batch, heads, seqlen, dim), V a view with row and column offsets, q's head dim not unit-stride
    (copied by the launcher): the kernel follows the strides it is given."""
    dtype = torch.float32
    q = torch.randn(2, 37, 2, 32, dtype=dtype, device=DEVICE)[..., ::2]
    k = torch.randn(2, 2, 41, 16, dtype=dtype, device=DEVICE).transpose(1, 2)
    v = torch.randn(2, 46, 2, 27, dtype=dtype, device=DEVICE)[:, 5:, :, 3:]
    assert not any(t.is_contiguous() for t in (q, k, v))
    _forward_bounds(forward_fa1(q, k, v, causal=True), q, k, v, {"causal": True}, dtype, seed)


FA2_CASES = {
    "q100-k37-causal-mqa": ((2, 100, 37, 2, 1, 16, 16), {"causal": True}),
    "q37-k100-gqa-dv": ((1, 37, 100, 4, 2, 32, 48), {}),
    "window": ((1, 70, 53, 2, 2, 16, 16), {"window_size": (5, 3), "softmax_scale": 0.5}),
}


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("case", FA2_CASES.keys())
def test_fa1_agrees_with_the_fa2_schedule(case, dtype, seed):
    """The FA1 and FA2 (flash_attn_func on the Triton backend) schedules compute the same out and lse: each
    within the eager rule against the oracle, and within the rule's bound of each other."""
    skip_unsupported("triton", dtype)
    shape, kwargs = FA2_CASES[case]
    q, k, v = random_qkv(*shape, dtype)
    fa1 = forward_fa1(q, k, v, **kwargs)
    with flashtile.use_backend("triton", block_m=16, block_n=16):
        fa2 = flashtile.flash_attn_func(q, k, v, return_lse=True, **kwargs)
    bounds = _forward_bounds(fa1, q, k, v, kwargs, dtype, seed)
    _forward_bounds(fa2, q, k, v, kwargs, dtype, seed)
    assert_within_bounds(("out", "lse"), fa1, fa2, bounds, "the FA1 and FA2 schedules", seed)


def _qkv(batch=2, seqlen_q=5, seqlen_k=7, nheads=4, nheads_k=2, headdim=16, headdim_v=16, dtype=torch.float32):
    return random_qkv(batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, headdim_v, dtype)


def _replace(index, value):
    tensors = list(_qkv())
    tensors[index] = value
    return tensors


BAD_INPUTS = {
    "q not a tensor": (lambda: ([[1.0]], *_qkv()[1:]), {}, TypeError, r"q must be a torch\.Tensor"),
    "k rank 3": (lambda: _replace(1, torch.randn(2, 7, 16, device=DEVICE)), {}, ValueError,
                 r"k must have rank 4.*\(2, 7, 16\)"),
    "float64": (lambda: _qkv(dtype=torch.float64), {}, TypeError, r"q has dtype torch\.float64; the FA1 kernel"),
    "integer v": (lambda: _replace(2, torch.zeros(2, 7, 2, 16, dtype=torch.int32, device=DEVICE)), {}, TypeError,
                  r"v has dtype torch\.int32"),
    "mixed dtypes": (lambda: _replace(1, _qkv()[1].half()), {}, TypeError, r"share one dtype.*k=torch\.float16"),
    "mixed devices": (lambda: _replace(2, _qkv()[2].to("meta")), {}, ValueError, r"one device.*v on meta"),
    "meta device": (lambda: [t.to("meta") for t in _qkv()], {}, ValueError, r"q, k and v are on meta"),
    "batch mismatch": (lambda: _replace(1, torch.randn(3, 7, 2, 16, device=DEVICE)), {}, ValueError,
                       r"batch sizes differ: q has 2, k has 3"),
    "q/k head dims": (lambda: _replace(1, torch.randn(2, 7, 2, 8, device=DEVICE)), {}, ValueError,
                      r"q has head dim 16 but k has 8"),
    "k/v lengths": (lambda: _replace(2, torch.randn(2, 6, 2, 16, device=DEVICE)), {}, ValueError,
                    r"k has seqlen 7 but v has 6"),
    "heads not divisible": (lambda: _qkv(nheads=4, nheads_k=3), {}, ValueError,
                            r"k has 3 heads but q has 4; nheads must be a multiple"),
    "head dim 257": (lambda: _qkv(headdim=257), {}, ValueError, r"q has head dim 257"),
    "v head dim 300": (lambda: _qkv(headdim_v=300), {}, ValueError, r"v has head dim 300"),
    "causal not bool": (_qkv, {"causal": 1}, TypeError, r"causal must be a bool"),
    "window float": (_qkv, {"window_size": (1.5, 2)}, TypeError, r"window_size left must be an int"),
    "window below -1": (_qkv, {"window_size": (3, -2)}, ValueError, r"window_size right is -2"),
    "infinite scale": (_qkv, {"softmax_scale": float("inf")}, ValueError, r"softmax_scale must be finite"),
    "block_m not a power of two": (_qkv, {"block_m": 24}, ValueError, r"block_m must be a power of two >= 16"),
    "block_n below 16": (_qkv, {"block_n": 8}, ValueError, r"block_n must be a power of two >= 16 .*got 8"),
    "num_warps": (_qkv, {"num_warps": 3}, ValueError, r"num_warps must be a power of two"),
}


@pytest.mark.parametrize("make, kwargs, error, message", BAD_INPUTS.values(), ids=BAD_INPUTS.keys())
def test_forward_fa1_rejects(make, kwargs, error, message):
    with pytest.raises(error, match=message):
        forward_fa1(*make(), **kwargs)
