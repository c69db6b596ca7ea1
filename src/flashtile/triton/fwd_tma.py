"""Attention forward, Hopper schedule: the same algorithm as fwd.py, with tiles moved by TMA.

Q, K, V and the output are read and written through in-kernel tensor descriptors
(`tl.make_tensor_descriptor`, one 2-D [seqlen, headdim] view per (batch, head)), so the copy engine
moves whole tiles, zero-fills rows past the end of the sequence and columns past the head dim, and
clips the store; no per-element pointer or bounds arithmetic is left in the loop.

Without warp specialization the key loop is split into masked edges and an unmasked interior, as in
fwd.py. With WARP_SPECIALIZE the compiler splits one key loop into a producer warp issuing the TMA
copies and consumer warpgroups doing the matmuls and the softmax (`tl.range(..., warp_specialize=True)`);
its pass rejects a kernel with several loops (triton 3.9, compiled for sm_90: "'scf.for' op operation
destroyed but still has uses"), so that variant runs a single loop over every visible block and applies
the element mask on every tile when the problem has a band or a ragged key end (MASK_ALL). Splitting a
tile of more than 64 rows between two consumer warpgroups, the pass adds the second warpgroup's row
offset (+64) to the scalar that the descriptors' row coordinate comes from, and to everything derived
from it: were the query positions built from that same scalar, they would come out offset twice
(triton 3.6 and 3.9, read in the TTGIR; on an H200, wrong masks and lse rows, errors ~0.15). So the
descriptors take their row from a separate value (m0_desc), which the pass offsets alone.

Requirements checked by the launcher: a CUDA GPU of compute capability 9.0 or newer (or the
interpreter), 16-byte aligned base addresses and row strides (headdim and nheads * headdim
multiples of 8 for 2-byte dtypes), no user mask (masks keep to fwd.py). Everything else (band,
softcap, ALiBi, GQA, dv != d, both alignments) is as in fwd.py; the kernel writes the same out and
lse.
"""

import triton
import triton.language as tl

from .common import alibi_slope, finish_rows, key_block_bounds, online_softmax_step, program_heads, scores


@triton.jit
def _forward_blocks_tma(acc, l_i, m_i, q, k_desc, v_desc, offs_m, start, end, seqlen_q, seqlen_k, score_scale,
                        softcap_scale, softcap_out, slope, diagonal_offset, window_left, window_right,
                        BLOCK_N: tl.constexpr, MASKED: tl.constexpr, HAS_LEFT: tl.constexpr,
                        HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
                        DOT_PRECISION: tl.constexpr, WARP_SPECIALIZE: tl.constexpr):
    for n0 in tl.range(start, end, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        k = k_desc.load([n0, 0])
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        s, _ = scores(qk, offs_m[:, None], offs_n[None, :], seqlen_q, seqlen_k, score_scale, softcap_scale,
                      softcap_out, slope, diagonal_offset, window_left, window_right, None,
                      MASKED, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, 0)
        v = v_desc.load([n0, 0])
        acc, l_i, m_i = online_softmax_step(acc, l_i, m_i, s, v, MASKED, 0, DOT_PRECISION)
    return acc, l_i, m_i


@triton.jit
def attention_fwd_tma_kernel(
    Q, K, V, Out, Lse, Slopes,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_ob, stride_om, stride_oh,
    stride_slopes_b,
    nheads, group_size, seqlen_q, seqlen_k,
    sm_scale, score_scale, softcap_scale, softcap_out, diagonal_offset, window_left, window_right,
    HEADDIM: tl.constexpr, HEADDIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    DOT_PRECISION: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, MASK_ALL: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b, h, hk = program_heads(pid_bh, nheads, group_size)
    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)

    # one 2-D [seqlen, headdim] view per (batch, head); rows and columns past the ends read as zeros
    q_desc = tl.make_tensor_descriptor(Q + b * stride_qb + h * stride_qh, shape=[seqlen_q, HEADDIM],
                                       strides=[stride_qm, 1], block_shape=[BLOCK_M, BLOCK_D])
    k_desc = tl.make_tensor_descriptor(K + b * stride_kb + hk * stride_kh, shape=[seqlen_k, HEADDIM],
                                       strides=[stride_kn, 1], block_shape=[BLOCK_N, BLOCK_D])
    v_desc = tl.make_tensor_descriptor(V + b * stride_vb + hk * stride_vh, shape=[seqlen_k, HEADDIM_V],
                                       strides=[stride_vn, 1], block_shape=[BLOCK_N, BLOCK_DV])
    o_desc = tl.make_tensor_descriptor(Out + b * stride_ob + h * stride_oh, shape=[seqlen_q, HEADDIM_V],
                                       strides=[stride_om, 1], block_shape=[BLOCK_M, BLOCK_DV])
    # Workaround (triton 3.6 and 3.9, 2026-11-29): equal to m0, but a value of its own, so that warp
    # specialization offsets the descriptors' rows and not offs_m (see the module docstring)
    m0_desc = tl.minimum(m0, seqlen_q)
    q = q_desc.load([m0_desc, 0])
    slope = alibi_slope(Slopes, b, h, stride_slopes_b, HAS_ALIBI)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    lo, full_lo, full_hi, hi = key_block_bounds(m0, seqlen_k, diagonal_offset, window_left, window_right,
                                                BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
    if WARP_SPECIALIZE:
        acc, l_i, m_i = _forward_blocks_tma(acc, l_i, m_i, q, k_desc, v_desc, offs_m, lo, hi,
                                            seqlen_q, seqlen_k, score_scale, softcap_scale, softcap_out, slope,
                                            diagonal_offset, window_left, window_right, BLOCK_N, MASK_ALL, HAS_LEFT,
                                            HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, DOT_PRECISION, True)
    else:
        acc, l_i, m_i = _forward_blocks_tma(acc, l_i, m_i, q, k_desc, v_desc, offs_m, lo, tl.minimum(full_lo, hi),
                                            seqlen_q, seqlen_k, score_scale, softcap_scale, softcap_out, slope,
                                            diagonal_offset, window_left, window_right, BLOCK_N, True, HAS_LEFT,
                                            HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, DOT_PRECISION, False)
        acc, l_i, m_i = _forward_blocks_tma(acc, l_i, m_i, q, k_desc, v_desc, offs_m, full_lo, full_hi,
                                            seqlen_q, seqlen_k, score_scale, softcap_scale, softcap_out, slope,
                                            diagonal_offset, window_left, window_right, BLOCK_N, False, HAS_LEFT,
                                            HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, DOT_PRECISION, False)
        acc, l_i, m_i = _forward_blocks_tma(acc, l_i, m_i, q, k_desc, v_desc, offs_m, full_hi, hi,
                                            seqlen_q, seqlen_k, score_scale, softcap_scale, softcap_out, slope,
                                            diagonal_offset, window_left, window_right, BLOCK_N, True, HAS_LEFT,
                                            HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, DOT_PRECISION, False)

    out, lse = finish_rows(acc, l_i, m_i)
    o_desc.store([m0_desc, 0], out.to(Out.dtype.element_ty))
    tl.store(Lse + pid_bh.to(tl.int64) * seqlen_q + offs_m, lse, mask=offs_m < seqlen_q)
