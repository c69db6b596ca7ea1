"""The input contract: every rule raises the right error naming the argument; odd strides work."""

from __future__ import annotations

import math

import pytest
import torch

import flashtile
from flashtile.reference import flash_attn_reference

from conftest import DEVICE, assert_close_to_oracle, assert_exact_to_oracle, forced_tiles, random_qkv


def qkv(batch=2, seqlen_q=5, seqlen_k=7, nheads=4, nheads_k=2, headdim=8, headdim_v=8, dtype=torch.float32):
    return (torch.randn(batch, seqlen_q, nheads, headdim, dtype=dtype),
            torch.randn(batch, seqlen_k, nheads_k, headdim, dtype=dtype),
            torch.randn(batch, seqlen_k, nheads_k, headdim_v, dtype=dtype))


def _replace(index, value):
    tensors = list(qkv())
    tensors[index] = value
    return tensors


FLASH_BAD_INPUTS = {
    "q not a tensor": (lambda: ([[1.0]], *qkv()[1:]), {}, TypeError, r"q must be a torch\.Tensor"),
    "q rank 3": (lambda: _replace(0, torch.randn(5, 4, 8)), {}, ValueError, r"q must have rank 4.*\(5, 4, 8\)"),
    "integer dtype": (lambda: [t.to(torch.int32) for t in qkv()], {}, TypeError, r"q has dtype torch\.int32"),
    "mixed dtypes": (lambda: _replace(1, qkv()[1].double()), {}, TypeError, r"share one dtype.*k=torch\.float64"),
    "mixed devices": (lambda: _replace(2, qkv()[2].to("meta")), {}, ValueError, r"one device.*v on meta"),
    "batch mismatch": (lambda: _replace(1, torch.randn(3, 7, 2, 8)), {}, ValueError, r"batch sizes differ: q has 2, k has 3"),
    "q/k head dims": (lambda: _replace(1, torch.randn(2, 7, 2, 9)), {}, ValueError, r"q has head dim 8 but k has 9"),
    "k/v lengths": (lambda: _replace(2, torch.randn(2, 6, 2, 8)), {}, ValueError, r"k has seqlen 7 but v has 6"),
    "k/v heads": (lambda: _replace(2, torch.randn(2, 7, 1, 8)), {}, ValueError, r"k has 2 heads but v has 1"),
    "head dim 0": (lambda: qkv(headdim=0), {}, ValueError, r"q has head dim 0; it must be between 1 and 256"),
    "head dim 257": (lambda: qkv(headdim=257), {}, ValueError, r"q has head dim 257"),
    "v head dim 300": (lambda: qkv(headdim_v=300), {}, ValueError, r"v has head dim 300"),
    "heads not divisible": (lambda: qkv(nheads=4, nheads_k=3), {}, ValueError, r"k has 3 heads but q has 4; nheads must be a multiple"),
    "window not a pair": (qkv, {"window_size": (1, 2, 3)}, TypeError, r"window_size must be a \(left, right\) pair"),
    "window float": (qkv, {"window_size": (1.5, 2)}, TypeError, r"window_size left must be an int, got 1\.5"),
    "window below -1": (qkv, {"window_size": (3, -2)}, ValueError, r"window_size right is -2"),
    "negative softcap": (qkv, {"softcap": -1.0}, ValueError, r"softcap must be >= 0.*-1\.0"),
    "nan softcap": (qkv, {"softcap": math.nan}, ValueError, r"softcap must be finite"),
    "string softcap": (qkv, {"softcap": "1"}, TypeError, r"softcap must be a real number"),
    "infinite scale": (qkv, {"softmax_scale": math.inf}, ValueError, r"softmax_scale must be finite"),
    "causal not bool": (qkv, {"causal": 1}, TypeError, r"causal must be a bool"),
    "alibi shape": (qkv, {"alibi_slopes": torch.rand(3)}, ValueError, r"alibi_slopes has shape \(3,\); it must be \(nheads,\) = \(4,\)"),
    "alibi dtype": (qkv, {"alibi_slopes": torch.ones(4, dtype=torch.int64)}, TypeError, r"alibi_slopes must be a floating tensor"),
    "alibi device": (qkv, {"alibi_slopes": torch.rand(4, device="meta")}, ValueError, r"alibi_slopes is on meta"),
    "alibi requires grad": (qkv, {"alibi_slopes": torch.rand(4, requires_grad=True)}, ValueError, r"alibi_slopes requires grad"),
    "dropout out of range": (qkv, {"dropout_p": 1.5}, ValueError, r"dropout_p must be in \[0, 1\).*got 1\.5"),
    "dropout 1": (qkv, {"dropout_p": 1.0}, ValueError, r"dropout_p must be in \[0, 1\).*got 1\.0"),
    "negative dropout": (qkv, {"dropout_p": -0.1}, ValueError, r"dropout_p must be in \[0, 1\).*got -0\.1"),
    "nan dropout": (qkv, {"dropout_p": math.nan}, ValueError, r"dropout_p must be finite"),
    "string dropout": (qkv, {"dropout_p": "0.1"}, TypeError, r"dropout_p must be a real number"),
    "attn probs not bool": (qkv, {"return_attn_probs": 1}, TypeError, r"return_attn_probs must be a bool"),
}


@pytest.mark.parametrize("make, kwargs, error, message", FLASH_BAD_INPUTS.values(), ids=FLASH_BAD_INPUTS.keys())
def test_flash_attn_func_rejects(make, kwargs, error, message):
    with pytest.raises(error, match=message):
        flashtile.flash_attn_func(*make(), **kwargs)


def _sdpa_qkv(hq=4, hk=4, seqlen_q=5, seqlen_k=7, e=8, ev=8):
    return torch.randn(2, hq, seqlen_q, e), torch.randn(2, hk, seqlen_k, e), torch.randn(2, hk, seqlen_k, ev)


SDPA_BAD_INPUTS = {
    "rank 1": (lambda: (torch.randn(8), torch.randn(8), torch.randn(8)), {}, ValueError, r"query must have rank >= 2"),
    "rank mismatch": (lambda: (torch.randn(2, 4, 5, 8), torch.randn(4, 7, 8), torch.randn(4, 7, 8)), {}, ValueError, r"key has rank 3 but query has rank 4"),
    "leading dims": (lambda: (torch.randn(2, 4, 5, 8), torch.randn(3, 4, 7, 8), torch.randn(3, 4, 7, 8)), {}, ValueError, r"key has leading dims \(3,\) but query has \(2,\)"),
    "E mismatch": (lambda: (torch.randn(2, 4, 5, 8), torch.randn(2, 4, 7, 6), torch.randn(2, 4, 7, 8)), {}, ValueError, r"query has head dim E=8 but key has 6"),
    "S mismatch": (lambda: (torch.randn(2, 4, 5, 8), torch.randn(2, 4, 7, 8), torch.randn(2, 4, 6, 8)), {}, ValueError, r"key has length S=7 but value has 6"),
    "gqa not enabled": (lambda: _sdpa_qkv(hq=4, hk=2), {}, ValueError, r"pass enable_gqa=True"),
    "gqa not divisible": (lambda: _sdpa_qkv(hq=4, hk=3), {"enable_gqa": True}, ValueError, r"nheads must be a multiple"),
    "mask dtype": (_sdpa_qkv, {"attn_mask": torch.ones(5, 7, dtype=torch.int64)}, TypeError, r"attn_mask must be bool"),
    "mask shape": (_sdpa_qkv, {"attn_mask": torch.ones(5, 6, dtype=torch.bool)}, ValueError, r"attn_mask has shape \(5, 6\), which does not broadcast"),
    "mask and causal": (_sdpa_qkv, {"attn_mask": torch.ones(5, 7, dtype=torch.bool), "is_causal": True}, ValueError, r"mutually exclusive"),
    "mask requires grad": (_sdpa_qkv, {"attn_mask": torch.zeros(5, 7, requires_grad=True)}, ValueError, r"attn_mask requires grad"),
    "dropout out of range": (_sdpa_qkv, {"dropout_p": 1.0}, ValueError, r"dropout_p must be in \[0, 1\)"),
    "scale type": (_sdpa_qkv, {"scale": "0.1"}, TypeError, r"scale must be a real number"),
    "is_causal type": (_sdpa_qkv, {"is_causal": None}, TypeError, r"is_causal must be a bool"),
}


@pytest.mark.parametrize("make, kwargs, error, message", SDPA_BAD_INPUTS.values(), ids=SDPA_BAD_INPUTS.keys())
def test_sdpa_rejects(make, kwargs, error, message):
    with pytest.raises(error, match=message):
        flashtile.scaled_dot_product_attention(*make(), **kwargs)


def test_arbitrary_strides_match_the_oracle(backend, seed):
    dtype = torch.float64 if backend == "torch" else torch.float32
    batch, seqlen, nheads, headdim = 2, 19, 4, 16
    base_q = torch.randn(batch, seqlen, nheads, 2 * headdim, dtype=dtype, device=DEVICE)
    q = base_q[..., ::2]  # last dim not unit-stride: copied
    k = torch.randn(batch, nheads // 2, seqlen, headdim, dtype=dtype, device=DEVICE).transpose(1, 2)  # BHSD storage
    v = torch.randn(batch, seqlen + 5, nheads // 2, headdim + 3, dtype=dtype, device=DEVICE)[:, 5:, :, 3:]  # offsets
    for t in (q, k, v):
        assert not t.is_contiguous()
        t.requires_grad_(True)
    with forced_tiles(backend, 8, 8):
        out = flashtile.flash_attn_func(q, k, v, causal=True)
        grads = torch.autograd.grad(out.sum(), (q, k, v))  # .sum(): the incoming gradient has stride 0
    ref, _ = flash_attn_reference(q, k, v, causal=True)
    ref_grads = torch.autograd.grad(ref.sum(), (q, k, v))
    if dtype == torch.float64:
        for name, got, want in zip(("out", "dq", "dk", "dv"), (out,) + grads, (ref,) + ref_grads):
            assert_exact_to_oracle(name, got, want, seed)
        return
    eager, _ = flash_attn_reference(q, k, v, causal=True, dtype=dtype)
    eager_grads = torch.autograd.grad(eager.sum(), (q, k, v))
    for name, got, want, e in zip(("out", "dq", "dk", "dv"), (out,) + grads, (ref,) + ref_grads, (eager,) + eager_grads):
        assert_close_to_oracle(name, got, want, e, dtype, seed)


def test_stride_zero_gradient_from_sum(backend, seed):
    dtype = torch.float64 if backend == "torch" else torch.float32
    q, k, v = random_qkv(2, 5, 7, 4, 2, 8, 8, dtype, requires_grad=True)
    with flashtile.use_backend(backend):
        out = flashtile.flash_attn_func(q, k, v)
    out.sum().backward()  # the incoming gradient is an expanded scalar: stride 0 in every dim
    expected = torch.autograd.grad(flash_attn_reference(q, k, v)[0].sum(), (q, k, v))
    for name, got, want in zip(("dq", "dk", "dv"), (q.grad, k.grad, v.grad), expected):
        assert_exact_to_oracle(name, got, want, seed, tol=1e-10 if dtype == torch.float64 else 1e-5)


def test_calls_without_gradients_skip_autograd_and_give_the_same_results(monkeypatch, backend, seed):
    """No input needs a gradient (plain tensors, or torch.no_grad / inference_mode): the backend runs
    directly, without the autograd.Function (its host cost matters to short GPU calls); out and lse are
    those of the differentiable path, bitwise."""
    from flashtile import autograd

    dtype = torch.float64 if backend == "torch" else torch.float32
    q, k, v = random_qkv(2, 9, 13, 4, 2, 16, 8, dtype, requires_grad=True)
    with flashtile.use_backend(backend):
        out, lse = flashtile.flash_attn_func(q, k, v, causal=True, return_lse=True)
        assert out.grad_fn is not None and lse.grad_fn is not None

        def must_not_run(*args):
            raise AssertionError("the autograd.Function ran for a call that needs no gradient")

        monkeypatch.setattr(autograd._EagerAttention, "apply", must_not_run)
        plain = flashtile.flash_attn_func(q.detach(), k.detach(), v.detach(), causal=True, return_lse=True)
        with torch.no_grad():
            no_grad = flashtile.flash_attn_func(q, k, v, causal=True, return_lse=True)
        with torch.inference_mode():
            inference = flashtile.flash_attn_func(q, k, v, causal=True, return_lse=True)
    for got in (plain, no_grad, inference):
        assert got[0].grad_fn is None and got[1].grad_fn is None and not got[0].requires_grad
        assert torch.equal(got[0], out.detach()) and torch.equal(got[1], lse.detach())


def test_autocast_leaves_the_attention_in_its_inputs_dtype(backend):
    """Under torch.autocast the inputs' dtype sets the precision (the torch backend's tiles would otherwise mix
    autocast's dtype with float32 statistics): float32 inputs give float32 results equal to those outside autocast,
    forward and backward."""
    q, k, v = (torch.randn(1, 37, 2, 16, device=DEVICE, requires_grad=True) for _ in range(3))
    with flashtile.use_backend(backend):
        expected = flashtile.flash_attn_func(q, k, v, causal=True)
        expected_grads = torch.autograd.grad(expected.sum(), (q, k, v))
        with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
            out = flashtile.flash_attn_func(q, k, v, causal=True)
            grads = torch.autograd.grad(out.sum(), (q, k, v))
    assert out.dtype == torch.float32 and torch.equal(out, expected), "out under autocast"
    for name, got, want in zip(("dq", "dk", "dv"), grads, expected_grads):
        assert torch.equal(got, want), f"{name} under autocast"
