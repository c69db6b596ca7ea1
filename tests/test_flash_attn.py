"""flash_attn_func on every backend against the float64 oracle: every option, forward and backward.

Shapes are ragged (lengths and tile sizes that divide nothing), cover seqlen_q <, =, > seqlen_k,
MHA / GQA / MQA and dv != d. Tile sizes are forced so that every case crosses several tiles. The
Triton backend runs through Triton's CPU interpreter here (and on the GPU with
FLASHTILE_TEST_DEVICE=cuda).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import flashtile
from flashtile._dispatch import resolve
from flashtile._validate import prepare_flash_attn
from flashtile.autograd import attention
from flashtile.reference import attention_reference, flash_attn_reference

from conftest import (DEVICE, LOW_PRECISION, assert_attention_follows_the_eager_rule, assert_close_to_oracle,
                      assert_exact_to_oracle, forced_tiles, random_qkv, rounding_floor, skip_unsupported)

# (batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, headdim_v)
# small enough for Triton's CPU interpreter, still several 16-wide tiles in every direction
SHAPES = {
    "mha-square": (2, 53, 53, 2, 2, 16, 16),
    "gqa-short-q-dv": (1, 37, 70, 4, 2, 24, 40),
    "mqa-long-q": (1, 70, 37, 3, 1, 40, 8),
    "decode-d72": (1, 1, 70, 2, 1, 72, 72),
    "d1": (1, 7, 9, 1, 1, 1, 3),
}


def _slopes(shape, per_batch):
    batch, _, _, nheads = shape[:4]
    return torch.rand(batch, nheads, device=DEVICE) if per_batch else torch.rand(nheads, device=DEVICE)


SCENARIOS = {
    "plain": lambda shape: {},
    "causal": lambda shape: {"causal": True},
    "window": lambda shape: {"window_size": (5, 3)},
    "window-left-only": lambda shape: {"window_size": (9, -1)},
    "window-right-only": lambda shape: {"window_size": (-1, 4)},
    "causal-window": lambda shape: {"causal": True, "window_size": (6, -1)},
    "softcap": lambda shape: {"softcap": 2.5, "softmax_scale": 1.0},
    "alibi": lambda shape: {"alibi_slopes": _slopes(shape, per_batch=False)},
    "alibi-per-batch": lambda shape: {"alibi_slopes": _slopes(shape, per_batch=True), "causal": True},
    "everything": lambda shape: {"causal": True, "window_size": (12, -1), "softcap": 5.0, "softmax_scale": 0.3,
                                 "alibi_slopes": _slopes(shape, per_batch=True)},
}

LOW_PRECISION_IDS = ("fp32", "fp16", "bf16")


@pytest.mark.parametrize("tiles", [(7, 13), (16, 32), None], ids=["7x13", "16x32", "default"])
@pytest.mark.parametrize("scenario", SCENARIOS.keys())
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_float64_is_exact(shape, scenario, tiles, seed):
    """In float64 the tiled algorithm (torch backend) reproduces dense attention to rounding, gradients included."""
    kwargs = SCENARIOS[scenario](shape)
    if "alibi_slopes" in kwargs:
        kwargs["alibi_slopes"] = kwargs["alibi_slopes"].double()
    q, k, v = random_qkv(*shape, torch.float64, requires_grad=True)
    with forced_tiles("torch", *tiles) if tiles else flashtile.use_backend("torch"):
        out, lse = flashtile.flash_attn_func(q, k, v, return_lse=True, **kwargs)
    ref_out, ref_lse = flash_attn_reference(q, k, v, **kwargs)
    assert out.dtype == torch.float64 and lse.dtype == torch.float32
    assert_exact_to_oracle("out", out, ref_out, seed)
    assert_exact_to_oracle("lse", lse, ref_lse, seed, tol=1e-5)  # lse is returned in float32
    grad_out = torch.randn_like(ref_out)
    got = torch.autograd.grad((out * grad_out).sum(), (q, k, v))
    want = torch.autograd.grad((ref_out * grad_out).sum(), (q, k, v))
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        assert_exact_to_oracle(name, g, w, seed)


@pytest.mark.parametrize("dtype", (torch.float32,) + LOW_PRECISION, ids=LOW_PRECISION_IDS)
@pytest.mark.parametrize("scenario", SCENARIOS.keys())
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_low_precision_follows_the_eager_rule(backend, shape, scenario, dtype, seed):
    """fp32/fp16/bf16: forward, lse and gradients (through out and lse) within 2x eager error + floor."""
    skip_unsupported(backend, dtype)
    kwargs = SCENARIOS[scenario](shape)
    q, k, v = random_qkv(*shape, dtype, requires_grad=True)
    with forced_tiles(backend, 7, 13):
        got = flashtile.flash_attn_func(q, k, v, return_lse=True, **kwargs)
    assert_attention_follows_the_eager_rule(got, flash_attn_reference(q, k, v, **kwargs),
                                            flash_attn_reference(q, k, v, dtype=dtype, **kwargs), (q, k, v), dtype,
                                            seed)


def test_gradient_through_lse_float64(seed):
    """d lse / d s = P: a loss on lse alone must give the oracle's gradients (to float32 rounding of lse)."""
    q, k, v = random_qkv(2, 29, 41, 4, 2, 16, 8, torch.float64, requires_grad=True)
    with forced_tiles("torch", 8, 16):
        _, lse = flashtile.flash_attn_func(q, k, v, causal=True, return_lse=True)
    _, ref_lse = flash_attn_reference(q, k, v, causal=True)
    grad_lse = torch.randn_like(ref_lse)
    got = torch.autograd.grad((lse.double() * grad_lse).sum(), (q, k, v), allow_unused=True)
    want = torch.autograd.grad((ref_lse * grad_lse).sum(), (q, k, v), allow_unused=True)
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        w = torch.zeros_like(g) if w is None else w  # lse does not depend on v
        assert_exact_to_oracle(name, g, w, seed, tol=1e-5)


@pytest.mark.parametrize("dtype", (torch.float32, torch.float16), ids=("fp32", "fp16"))
def test_late_maximum_in_last_tile(backend, dtype, seed):
    """The largest score arrives in the last key tile: the rescale of earlier tiles must happen."""
    seqlen_k = 50
    q = torch.ones(1, 3, 1, 4, dtype=dtype, device=DEVICE)
    k = (0.1 * torch.randn(1, seqlen_k, 1, 4)).to(device=DEVICE, dtype=dtype)
    k[0, -1, 0] = 5.0  # only the final tile holds the maximum
    v = torch.randn(1, seqlen_k, 1, 6).to(device=DEVICE, dtype=dtype)
    with forced_tiles(backend, 2, 8):
        out, lse = flashtile.flash_attn_func(q, k, v, return_lse=True)
    ref_out, ref_lse = flash_attn_reference(q, k, v)
    eager_out, eager_lse = flash_attn_reference(q, k, v, dtype=dtype)
    # most of the weight sits on the last key: a missing rescale would be off by a lot, not by rounding
    assert (ref_out - v[0, -1].double()).abs().max() < 0.2
    assert_close_to_oracle("out", out, ref_out, eager_out, dtype, seed)
    assert_close_to_oracle("lse", lse, ref_lse, eager_lse, dtype, seed)


@pytest.mark.parametrize("dtype", (torch.float32, torch.float64), ids=("fp32", "fp64"))
def test_huge_scores_do_not_overflow(backend, dtype, seed):
    """|s| ~ 1e3 is far beyond exp's range; the running max keeps everything finite and exact."""
    skip_unsupported(backend, dtype)
    q, k, v = random_qkv(1, 40, 70, 2, 2, 16, 16, dtype, requires_grad=True, scale=16.0)
    with forced_tiles(backend, 16, 16):
        out, lse = flashtile.flash_attn_func(q, k, v, return_lse=True, softmax_scale=1.0)
    ref_out, ref_lse = flash_attn_reference(q, k, v, softmax_scale=1.0)
    assert ref_lse.abs().max() > 500, "the test needs huge scores"
    assert out.isfinite().all() and lse.isfinite().all()
    eager_out, eager_lse = flash_attn_reference(q, k, v, softmax_scale=1.0, dtype=dtype)
    # Beyond the usual floor: the Triton kernels round s * log2(e) once more than the eager natural exp, which
    # at |s| ~ 1e3 moves a weight by up to ~|s| eps (computed in fp32 for every input dtype but fp64); where two
    # keys nearly tie, the output moves by |v| times that (seen: 4x the eager error in 2.5% of seeds).
    compute_eps = torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).eps
    tol_floor = ((1e-9 if dtype == torch.float64 else rounding_floor(dtype, ref_out))
                 + ref_lse.abs().max().item() * compute_eps * v.abs().max().item())
    assert_close_to_oracle("out", out, ref_out, eager_out, dtype, seed, floor=tol_floor)
    assert_close_to_oracle("lse", lse, ref_lse, eager_lse.float(), torch.float32, seed)
    with forced_tiles(backend, 16, 16):
        dq, dk, dv = torch.autograd.grad(out.sum(), (q, k, v))
    assert all(g.isfinite().all() for g in (dq, dk, dv))


def test_keys_are_permutation_invariant(backend, seed):
    """Without causal/window/ALiBi, permuting key-value pairs jointly must not move the result."""
    q, k, v = random_qkv(2, 33, 96, 4, 2, 16, 24, torch.float32)
    perm = torch.randperm(96, device=DEVICE)
    with forced_tiles(backend, 7, 13):
        out1, lse1 = flashtile.flash_attn_func(q, k, v, return_lse=True, softcap=4.0)
        out2, lse2 = flashtile.flash_attn_func(q, k[:, perm], v[:, perm], return_lse=True, softcap=4.0)
    torch.testing.assert_close(out1, out2, atol=2e-6, rtol=1e-5, msg=lambda m: f"out moved (seed {seed}): {m}")
    torch.testing.assert_close(lse1, lse2, atol=2e-6, rtol=1e-6, msg=lambda m: f"lse moved (seed {seed}): {m}")


def test_deterministic_bitwise(backend, seed):
    q, k, v = random_qkv(2, 37, 41, 4, 2, 16, 16, torch.float32, requires_grad=True)
    runs = []
    with flashtile.use_backend(backend):
        for _ in range(3):
            out = flashtile.flash_attn_func(q, k, v, causal=True, deterministic=True)
            runs.append((out,) + torch.autograd.grad(out.square().sum(), (q, k, v)))
    for run in runs[1:]:
        for name, a, b in zip(("out", "dq", "dk", "dv"), runs[0], run):
            assert torch.equal(a, b), f"{name} differs between identical calls (seed {seed})"


def test_default_tiles_agree_with_forced_tiles(backend, seed):
    q, k, v = random_qkv(1, 100, 170, 2, 1, 32, 32, torch.float32)
    with flashtile.use_backend(backend):
        default = flashtile.flash_attn_func(q, k, v, causal=True)
    with forced_tiles(backend, 5, 11):
        forced = flashtile.flash_attn_func(q, k, v, causal=True)
    torch.testing.assert_close(default, forced, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("seqlen_q, seqlen_k", [(37, 61), (61, 37)])
@pytest.mark.parametrize("window", [(-1, 0), (4, 2), (0, -1)])
def test_windows_in_top_left_alignment(backend, seqlen_q, seqlen_k, window, seed):
    """The machinery behind the SDPA entry point: any window around the top-left diagonal (offset 0)."""
    dtype = torch.float64 if backend == "torch" else torch.float32
    q, k, v = random_qkv(2, seqlen_q, seqlen_k, 4, 2, 16, 8, dtype, requires_grad=True)
    call = prepare_flash_attn(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=window,
                              softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False,
                              return_lse=True)
    call = dataclasses.replace(call, problem=dataclasses.replace(call.problem, diagonal_offset=0, alignment="top-left"))
    with forced_tiles(backend, 7, 13):
        out, lse = attention(call, *resolve(call.problem))
        grad = torch.randn_like(out, dtype=torch.float64)
        got = torch.autograd.grad((out * grad).sum(), (q, k, v))
    ref_out, ref_lse = attention_reference(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           window_size=window, diagonal_offset=0)
    ref_out = ref_out.transpose(1, 2)
    want = torch.autograd.grad((ref_out * grad).sum(), (q, k, v))
    if dtype == torch.float64:
        checks = [("out", out, ref_out), ("lse", lse, ref_lse)] + list(zip(("dq", "dk", "dv"), got, want))
        for name, actual, expected in checks:
            assert_exact_to_oracle(name, actual, expected, seed, tol=1e-5 if name == "lse" else 1e-10)
        return
    eager_out, _ = attention_reference(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), window_size=window,
                                       diagonal_offset=0, dtype=dtype)
    eager_out = eager_out.transpose(1, 2)
    eager = torch.autograd.grad((eager_out * grad).sum(), (q, k, v))
    assert_close_to_oracle("out", out, ref_out, eager_out, dtype, seed)
    for name, g, w, e in zip(("dq", "dk", "dv"), got, want, eager):
        assert_close_to_oracle(name, g, w, e, dtype, seed)
