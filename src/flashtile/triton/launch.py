"""Launchers: allocate outputs, compute grids, pass strides, pick constexprs for the Triton kernels.

Layout contract (shared with the torch backend): q (batch, seqlen_q, nheads, headdim), k and v
(batch, seqlen_k, nheads_k, headdim[_v]) with unit-stride last dims and any other strides;
out (batch, seqlen_q, nheads, headdim_v) and gradients are returned contiguous in the inputs'
dtype; lse (batch, nheads, seqlen_q) is contiguous float32, natural log.
"""

from __future__ import annotations

import torch
import triton

from .._validate import AttentionProblem
from .common import LOG2E
from .bwd import attention_bwd_dkdv_kernel, attention_bwd_dq_kernel, attention_bwd_preprocess_kernel
from .configs import TritonTiles
from .configs import interpreting
from .fwd import attention_fwd_kernel
from .fwd_tma import attention_fwd_tma_kernel


def _block_width(dim: int) -> int:
    return max(16, triton.next_power_of_2(dim))


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs are multiplied in full fp32 unless the user allowed TF32, as torch's matmul does
    if dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return "ieee"


def _score_args(q: torch.Tensor, alibi_slopes, attn_mask, problem: AttentionProblem):
    """The kernel arguments that describe scores: slopes, mask, their strides, the flags."""
    if alibi_slopes is not None:
        slopes = (alibi_slopes.float() * LOG2E).contiguous()  # the kernels work in base 2
        slopes_stride = 0 if slopes.shape[0] == 1 else slopes.stride(0)
    else:
        slopes, slopes_stride = q, 0  # never read
    if attn_mask is not None:
        mask = attn_mask.view(torch.uint8) if attn_mask.dtype == torch.bool else attn_mask
        mask_strides = mask.stride()
        mask_kind = 1 if attn_mask.dtype == torch.bool else 2
    else:
        mask, mask_strides, mask_kind = q, (0, 0, 0, 0), 0  # never read
    softcap = problem.softcap if problem.softcap > 0 else 1.0
    # scale of the final scores in base 2; with softcap, tanh(q.k * softcap_scale) * softcap_out
    scalars = (problem.softmax_scale, problem.softmax_scale * LOG2E, problem.softmax_scale / softcap,
               softcap * LOG2E, problem.diagonal_offset, max(problem.window_left, 0), max(problem.window_right, 0))
    flags = dict(HEADDIM=problem.headdim, HEADDIM_V=problem.headdim_v, BLOCK_D=_block_width(problem.headdim),
                 BLOCK_DV=_block_width(problem.headdim_v), HAS_LEFT=problem.window_left >= 0,
                 HAS_RIGHT=problem.window_right >= 0, HAS_SOFTCAP=problem.softcap > 0,
                 HAS_ALIBI=alibi_slopes is not None, MASK_KIND=mask_kind, DOT_PRECISION=_dot_precision(problem.dtype))
    return slopes, slopes_stride, mask, mask_strides, scalars, flags


def _tma_ready(tensors, attn_mask) -> bool:
    """TMA needs 16-byte aligned base addresses and strides, a GPU of sm_90+ (or the interpreter), no mask."""
    if attn_mask is not None:
        return False
    if not interpreting():
        if tensors[0].device.type != "cuda" or torch.cuda.get_device_capability(tensors[0].device) < (9, 0):
            return False
    for t in tensors:
        size = t.element_size()
        if t.data_ptr() % 16 or any((stride * size) % 16 for stride in t.stride()[:-1]):
            return False
    return True


def _tma_scratch(size: int, alignment: int, stream):
    # in-kernel tensor descriptors need a little global scratch memory from the caller
    return torch.empty(size, dtype=torch.int8, device="cuda")


def forward(q, k, v, alibi_slopes, attn_mask, problem: AttentionProblem, tiles: TritonTiles):
    """Fused forward: returns out (batch, seqlen_q, nheads, headdim_v) and lse (batch, nheads, seqlen_q) float32."""
    p = problem
    out = torch.empty(p.batch, p.seqlen_q, p.nheads, p.headdim_v, dtype=q.dtype, device=q.device)
    lse = torch.empty(p.batch, p.nheads, p.seqlen_q, dtype=torch.float32, device=q.device)
    if out.numel() == 0 and lse.numel() == 0:
        return out, lse
    slopes, slopes_stride, mask, mask_strides, scalars, flags = _score_args(q, alibi_slopes, attn_mask, p)
    grid = (triton.cdiv(p.seqlen_q, tiles.block_m), p.batch * p.nheads)
    if tiles.forward_schedule > 0 and _tma_ready((q, k, v, out), attn_mask):
        if not interpreting():
            triton.set_allocator(_tma_scratch)
        del flags["MASK_KIND"]
        attention_fwd_tma_kernel[grid](
            q, k, v, out, lse, slopes,
            q.stride(0), q.stride(1), q.stride(2),
            k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2),
            out.stride(0), out.stride(1), out.stride(2),
            slopes_stride, p.nheads, p.group_size, p.seqlen_q, p.seqlen_k, *scalars,
            BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, num_warps=tiles.num_warps, num_stages=tiles.num_stages,
            WARP_SPECIALIZE=tiles.forward_schedule == 2,
            MASK_ALL=problem.is_banded or p.seqlen_k % tiles.block_n != 0, **flags)
        return out, lse
    attention_fwd_kernel[grid](
        q, k, v, out, lse, slopes, mask,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        slopes_stride, *mask_strides,
        p.nheads, p.group_size, p.seqlen_q, p.seqlen_k, *scalars,
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, num_warps=tiles.num_warps, num_stages=tiles.num_stages,
        **flags)
    return out, lse


def backward(grad_out, grad_lse, q, k, v, out, lse, alibi_slopes, attn_mask, problem: AttentionProblem,
             tiles: TritonTiles):
    """Recompute backward: returns dq, dk, dv contiguous in the flash layout and the inputs' dtype."""
    p = problem
    dq = torch.empty(p.batch, p.seqlen_q, p.nheads, p.headdim, dtype=q.dtype, device=q.device)
    dk = torch.empty(p.batch, p.seqlen_k, p.nheads_k, p.headdim, dtype=k.dtype, device=k.device)
    dv = torch.empty(p.batch, p.seqlen_k, p.nheads_k, p.headdim_v, dtype=v.dtype, device=v.device)
    if p.batch * p.nheads == 0:
        return dq, dk, dv
    if p.seqlen_q == 0:  # no query sees any key: no gradient flows to k and v
        return dq, dk.zero_(), dv.zero_()
    slopes, slopes_stride, mask, mask_strides, scalars, flags = _score_args(q, alibi_slopes, attn_mask, p)
    has_dlse = grad_lse is not None
    grad_lse = grad_lse.float().contiguous() if has_dlse else lse  # never read without HAS_DLSE
    delta = torch.empty_like(lse)
    attention_bwd_preprocess_kernel[(triton.cdiv(p.seqlen_q, 64), p.batch * p.nheads)](
        out, grad_out, grad_lse, delta,
        out.stride(0), out.stride(1), out.stride(2), grad_out.stride(0), grad_out.stride(1), grad_out.stride(2),
        p.nheads, p.seqlen_q, HEADDIM_V=p.headdim_v, BLOCK_M=64, BLOCK_DV=flags["BLOCK_DV"], HAS_DLSE=has_dlse)
    common = (slopes_stride, *mask_strides, p.nheads, p.nheads_k, p.group_size, p.seqlen_q, p.seqlen_k, *scalars)
    if p.seqlen_k > 0:
        attention_bwd_dkdv_kernel[(triton.cdiv(p.seqlen_k, tiles.bwd_block_n), p.batch * p.nheads_k)](
            q, k, v, grad_out, lse, delta, dk, dv, slopes, mask,
            q.stride(0), q.stride(1), q.stride(2),
            k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2),
            grad_out.stride(0), grad_out.stride(1), grad_out.stride(2),
            dk.stride(0), dk.stride(1), dk.stride(2),
            dv.stride(0), dv.stride(1), dv.stride(2),
            *common,
            BLOCK_M=tiles.bwd_block_m, BLOCK_N=tiles.bwd_block_n, num_warps=tiles.bwd_num_warps,
            num_stages=tiles.bwd_num_stages, **flags)
    # the dQ kernel uses the transposed tile: bwd_block_n query rows against bwd_block_m keys
    attention_bwd_dq_kernel[(triton.cdiv(p.seqlen_q, tiles.bwd_block_n), p.batch * p.nheads)](
        q, k, v, grad_out, lse, delta, dq, slopes, mask,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        grad_out.stride(0), grad_out.stride(1), grad_out.stride(2),
        dq.stride(0), dq.stride(1), dq.stride(2),
        slopes_stride, *mask_strides, p.nheads, p.group_size, p.seqlen_q, p.seqlen_k, *scalars,
        BLOCK_M=tiles.bwd_block_n, BLOCK_N=tiles.bwd_block_m, num_warps=tiles.bwd_num_warps,
        num_stages=tiles.bwd_num_stages, **flags)
    return dq, dk, dv
