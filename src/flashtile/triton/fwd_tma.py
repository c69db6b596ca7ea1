"""Attention forward, Hopper schedule: the same algorithm as fwd.py, with tiles moved by TMA.

The launcher builds host-side tensor descriptors (`triton.tools.tensor_descriptor.TensorDescriptor`)
for Q, K and V, each a 4-D (batch, heads, rows, dim) view of the (batch, rows, heads, dim) tensor
whose [1, 1, block_rows, block_width] box is one head's tile: the copy engine moves whole tiles and
zero-fills rows past the end of the sequence and columns past the head dim, no per-element pointer or
bounds arithmetic is left in the loop, and no program builds a descriptor of its own. Descriptors
built in the kernel (`tl.make_tensor_descriptor`) cost every program their set-up; on an H200 the
host-side ones made the 1k-key forward 18-28% faster at d = 128 and 11-62% at d = 64 (causal the most),
so the table takes this kernel at every length on sm_90 (docs/schedules.md).
The output is stored by pointers (a 128-row tile is written once; the warp-specialized variant below
cannot store through a host descriptor).

Without warp specialization the key loop is split into masked edges and an unmasked interior, as in
fwd.py, except that in a dense batch the interior and the right edge (a band closing on the right, or the
keys' ragged end) share one loop and the edge blocks take the element mask through a runtime branch: as a
loop of its own the edge started with a copy that waited behind the interior loop's drain, once per program
(H200, d = 128: causal forward +5% at 1k keys, +0.5% at 4k, docs/schedules.md; without a band +3% at 1k).
Long problems without a band (SEPARATE_RAGGED_END, the tile table's choice from 4k keys) keep the ragged end
in a loop of its own: there the branch in the loop cost 1-3% (d = 64 4k 3.3%, d = 128 16k 1-2%; docs/tuning.md).
The left-edge loop is compiled only where there is a left edge (HAS_LEFT).

With WARP_SPECIALIZE the compiler splits one key loop into a producer warp issuing the TMA
copies and consumer warpgroups doing the matmuls and the softmax (`tl.range(..., warp_specialize=True)`);
its pass rejects a kernel with several loops (triton 3.9, compiled for sm_90: "'scf.for' op operation
destroyed but still has uses"), so that variant runs a single loop over every visible block and applies
the element mask on every tile when the problem has a band or a ragged key end (MASK_ALL). Splitting a
tile of more than 64 rows between two consumer warpgroups, the pass adds the second warpgroup's row
offset (+64) to the scalar that the descriptors' row coordinate comes from, and to everything derived
from it: were the query positions built from that same scalar, they would come out offset twice
(triton 3.6 and 3.9, read in the TTGIR; on an H200, wrong masks and lse rows, errors ~0.15). So the
descriptors take their row from a separate value (m0_desc), which the pass offsets alone. The same
split needs the query tile's descriptor built in the kernel (the pass gives each consumer its own,
with a half-height box): with a host descriptor triton 3.9 refuses the kernel, and pointer loads of Q
trip an assertion of the pass in both 3.6 and 3.9 (compiled for sm_90; docs/compiler-workarounds.md).

Packed variable-length batches (VARLEN, schedule 1 only) use the same descriptors over the packed
(1, total, heads, dim) tensors: a program's tiles start at its sequence's cu_seqlens row, and it loops
over its sequence's query blocks beyond the grid as fwd.py does. Where a tile runs past the sequence's
last key the copy engine reads the next sequence's rows instead of zeros: their scores are masked like
any key past the end, and their value rows are zeroed in the masked blocks, so that a non-finite value
there cannot reach the output through 0 * inf. Query rows past the end are computed and never stored.

With a band that closes on the right (causal) the query blocks are taken from the last one down: the
blocks that see the most keys start first and short ones fill the last wave (+6% at 16k keys, d = 128,
on an H200; within -2.5% .. +1% at 1k and 4k; docs/schedules.md).

Requirements checked by the launcher: a CUDA GPU of compute capability 9.0 or newer (or the
interpreter), 16-byte aligned base addresses and row strides (headdim and nheads * headdim
multiples of 8 for 2-byte dtypes), a non-empty key tensor, no user mask (masks keep to fwd.py).
Everything else (band, softcap, ALiBi, GQA, dv != d, both alignments, a learnable sink (HAS_SINK), FlashAttention-4's
RESCALE_THRESHOLD and EXP2_POLY_EVERY of the fa4 schedule, dropout with HAS_DROPOUT) is as in fwd.py; the kernel
writes the same out and lse.
"""

import triton
import triton.language as tl

from .common import (alibi_slope, band_mask, descriptor_origin, finish_rows, initial_row_stats, key_block_bounds,
                     online_softmax_step, program_coordinates, program_heads, scores, sequence_bounds, dropout_keep,
                     dropout_state)


@triton.jit
def _forward_blocks_tma(acc, l_i, m_i, q, k_desc, v_desc, b, hk, key_row0, offs_m, start, end, masked_from,
                        seqlen_q, seqlen_k, score_scale, softcap_scale, softcap_out, slope, diagonal_offset,
                        window_left, window_right,
                        BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, MASKED: tl.constexpr,
                        HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                        HAS_ALIBI: tl.constexpr, DOT_PRECISION: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
                        VARLEN: tl.constexpr, SCALE_IN_EXP2: tl.constexpr, RESCALE_THRESHOLD: tl.constexpr,
                        EXP2_POLY_EVERY: tl.constexpr, dropout_seed, dropout_stream, dropout_row, dropout_threshold,
                        HAS_DROPOUT: tl.constexpr):
    """Key blocks [start, end): MASKED 0 none masked, 1 all masked, 2 those from masked_from on (a runtime
    branch, so that interior blocks and the right edge share one pipelined loop)."""
    for n0 in tl.range(start, end, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        k = k_desc.load([b, hk, key_row0 + n0, 0]).reshape(BLOCK_N, BLOCK_D)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        s, _ = scores(qk, offs_m[:, None], offs_n[None, :], seqlen_q, seqlen_k, score_scale, softcap_scale,
                      softcap_out, slope, diagonal_offset, window_left, window_right, None,
                      MASKED == 1, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, 0, SCALE_IN_EXP2)
        if MASKED == 2:
            if n0 >= masked_from:
                s = band_mask(s, offs_m[:, None], offs_n[None, :], seqlen_q, seqlen_k, diagonal_offset, window_left,
                              window_right, HAS_LEFT, HAS_RIGHT)
        v = v_desc.load([b, hk, key_row0 + n0, 0]).reshape(BLOCK_N, BLOCK_DV)
        if VARLEN and MASKED:
            # past a packed sequence's last key the copy engine reads the next sequence's rows: their scores
            # are masked, but 0 * inf would still reach the output, so those value rows become zeros
            v = tl.where((offs_n < seqlen_k)[:, None], v, 0.0)
        keep = None
        if HAS_DROPOUT:
            keep = dropout_keep(dropout_seed, dropout_stream, dropout_row, offs_m, n0, dropout_threshold, BLOCK_N)
        acc, l_i, m_i = online_softmax_step(acc, l_i, m_i, s, v, score_scale, MASKED != 0, 0, DOT_PRECISION,
                                            SCALE_IN_EXP2, RESCALE_THRESHOLD, EXP2_POLY_EVERY, HAS_DROPOUT, keep)
    return acc, l_i, m_i


@triton.jit
def _forward_query_block_tma(m0, Q, q_desc, k_desc, v_desc, Out, Lse, Sink, b, h, hk, q_start, k_start, slope,
                             stride_qb, stride_qm, stride_qh, stride_om, stride_oh, stride_lse_b, stride_lse_h,
                             seqlen_q, seqlen_k, score_scale, softcap_scale, softcap_out, diagonal_offset,
                             window_left, window_right,
                             HEADDIM: tl.constexpr, HEADDIM_V: tl.constexpr, BLOCK_D: tl.constexpr,
                             BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                             HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                             HAS_ALIBI: tl.constexpr, DOT_PRECISION: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
                             MASK_ALL: tl.constexpr, VARLEN: tl.constexpr, SEPARATE_RAGGED_END: tl.constexpr,
                             SCALE_IN_EXP2: tl.constexpr, RESCALE_THRESHOLD: tl.constexpr,
                             EXP2_POLY_EVERY: tl.constexpr, RngState, dropout_row, dropout_threshold, dropout_scale,
                             HAS_SINK: tl.constexpr, HAS_DROPOUT: tl.constexpr):
    """Query rows [m0, m0 + BLOCK_M) of one (batch entry, head); Out points at the entry's row 0, the descriptors'
    rows of this entry start at q_start / k_start (common.descriptor_origin). HAS_DROPOUT: the keep-mask of (batch
    entry, head) dropout_row = b * nheads + h (common.dropout_keep)."""
    b32, q_row0 = descriptor_origin(b, q_start, VARLEN)
    _, key_row0 = descriptor_origin(b, k_start, VARLEN)
    h32, hk32 = h.to(tl.int32), hk.to(tl.int32)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = offs_m < seqlen_q
    # Workaround (triton 3.6 and 3.9, 2026-11-29): equal to m0, but a value of its own, so that warp
    # specialization offsets the descriptor's row and not offs_m (see the module docstring)
    m0_desc = tl.minimum(m0, seqlen_q)
    if WARP_SPECIALIZE:
        # the pass splits the query tile between two consumer warpgroups, and rebuilds an in-kernel
        # descriptor with their half-height boxes; a host descriptor's box is fixed (triton 3.9 refuses it)
        # and pointer loads break the pass (triton 3.6 and 3.9: an assertion in WSLowerToken)
        q_view = tl.make_tensor_descriptor(Q + b * stride_qb + h * stride_qh, shape=[seqlen_q, HEADDIM],
                                           strides=[stride_qm, 1], block_shape=[BLOCK_M, BLOCK_D])
        q = q_view.load([m0_desc, 0])
    else:
        q = q_desc.load([b32, h32, q_row0 + m0_desc, 0]).reshape(BLOCK_M, BLOCK_D)

    m_i, l_i = initial_row_stats(Sink, h, BLOCK_M, HAS_SINK)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    lo, full_lo, full_hi, hi = key_block_bounds(m0, seqlen_k, diagonal_offset, window_left, window_right,
                                                BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
    dropout_seed, dropout_stream = 0, 0
    if HAS_DROPOUT:
        dropout_seed, dropout_stream = dropout_state(RngState)
    if WARP_SPECIALIZE:
        acc, l_i, m_i = _forward_blocks_tma(acc, l_i, m_i, q, k_desc, v_desc, b32, hk32, key_row0, offs_m, lo, hi, lo,
                                            seqlen_q, seqlen_k, score_scale, softcap_scale, softcap_out, slope,
                                            diagonal_offset, window_left, window_right, BLOCK_N, BLOCK_D, BLOCK_DV,
                                            MASK_ALL, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, DOT_PRECISION, True,
                                            VARLEN, SCALE_IN_EXP2, RESCALE_THRESHOLD, EXP2_POLY_EVERY, dropout_seed,
                                            dropout_stream, dropout_row, dropout_threshold, HAS_DROPOUT)
    else:
        if HAS_LEFT:
            acc, l_i, m_i = _forward_blocks_tma(acc, l_i, m_i, q, k_desc, v_desc, b32, hk32, key_row0, offs_m, lo,
                                                tl.minimum(full_lo, hi), lo, seqlen_q, seqlen_k, score_scale,
                                                softcap_scale, softcap_out, slope, diagonal_offset, window_left,
                                                window_right, BLOCK_N, BLOCK_D, BLOCK_DV, 1, HAS_LEFT, HAS_RIGHT,
                                                HAS_SOFTCAP, HAS_ALIBI, DOT_PRECISION, False, VARLEN, SCALE_IN_EXP2,
                                                RESCALE_THRESHOLD, EXP2_POLY_EVERY, dropout_seed, dropout_stream,
                                                dropout_row, dropout_threshold, HAS_DROPOUT)
        if VARLEN or (SEPARATE_RAGGED_END and not HAS_RIGHT):
            acc, l_i, m_i = _forward_blocks_tma(acc, l_i, m_i, q, k_desc, v_desc, b32, hk32, key_row0, offs_m,
                                                full_lo, full_hi, full_hi, seqlen_q, seqlen_k, score_scale,
                                                softcap_scale, softcap_out, slope, diagonal_offset, window_left,
                                                window_right, BLOCK_N, BLOCK_D, BLOCK_DV, 0, HAS_LEFT, HAS_RIGHT,
                                                HAS_SOFTCAP, HAS_ALIBI, DOT_PRECISION, False, VARLEN, SCALE_IN_EXP2,
                                                RESCALE_THRESHOLD, EXP2_POLY_EVERY, dropout_seed, dropout_stream,
                                                dropout_row, dropout_threshold, HAS_DROPOUT)
            acc, l_i, m_i = _forward_blocks_tma(acc, l_i, m_i, q, k_desc, v_desc, b32, hk32, key_row0, offs_m,
                                                full_hi, hi, full_hi, seqlen_q, seqlen_k, score_scale, softcap_scale,
                                                softcap_out, slope, diagonal_offset, window_left, window_right,
                                                BLOCK_N, BLOCK_D, BLOCK_DV, 1, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP,
                                                HAS_ALIBI, DOT_PRECISION, False, VARLEN, SCALE_IN_EXP2,
                                                RESCALE_THRESHOLD, EXP2_POLY_EVERY, dropout_seed, dropout_stream,
                                                dropout_row, dropout_threshold, HAS_DROPOUT)
        else:
            # the interior and the right edge (the band's or the keys' ragged end) in one loop, the edge masked
            # by a runtime branch: as two loops the edge's first copies would wait behind the interior loop's
            # drain, once per program (but the branch in the loop costs long problems without a band 1-3%:
            # SEPARATE_RAGGED_END keeps their ragged end in a loop of its own)
            acc, l_i, m_i = _forward_blocks_tma(acc, l_i, m_i, q, k_desc, v_desc, b32, hk32, key_row0, offs_m,
                                                full_lo, hi, full_hi, seqlen_q, seqlen_k, score_scale, softcap_scale,
                                                softcap_out, slope, diagonal_offset, window_left, window_right,
                                                BLOCK_N, BLOCK_D, BLOCK_DV, 2, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP,
                                                HAS_ALIBI, DOT_PRECISION, False, VARLEN, SCALE_IN_EXP2,
                                                RESCALE_THRESHOLD, EXP2_POLY_EVERY, dropout_seed, dropout_stream,
                                                dropout_row, dropout_threshold, HAS_DROPOUT)

    out, lse = finish_rows(acc, l_i, m_i)
    if HAS_DROPOUT:
        out = out * dropout_scale  # the kept probabilities' 1 / (1 - p)
    tl.store(Out + h * stride_oh + offs_m[:, None].to(tl.int64) * stride_om + offs_dv[None, :],
             out.to(Out.dtype.element_ty), mask=row_ok[:, None] & (offs_dv[None, :] < HEADDIM_V))
    tl.store(Lse + b * stride_lse_b + h * stride_lse_h + q_start + offs_m, lse, mask=row_ok)


@triton.jit
def attention_fwd_tma_kernel(
    Q, q_desc, k_desc, v_desc, Out, Lse, Slopes, Sink, CuSeqlensQ, CuSeqlensK, RngState,
    stride_qb, stride_qm, stride_qh,
    stride_ob, stride_om, stride_oh,
    stride_lse_b, stride_lse_h,
    stride_slopes_b,
    nheads, group_size, seqlen_q, seqlen_k, query_programs,
    sm_scale, score_scale, softcap_scale, softcap_out, diagonal_offset, window_left, window_right,
    dropout_threshold, dropout_scale,
    HEADDIM: tl.constexpr, HEADDIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    DOT_PRECISION: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, MASK_ALL: tl.constexpr, VARLEN: tl.constexpr,
    SEPARATE_RAGGED_END: tl.constexpr, SCALE_IN_EXP2: tl.constexpr,
    RESCALE_THRESHOLD: tl.constexpr = 0, EXP2_POLY_EVERY: tl.constexpr = 0, HAS_SINK: tl.constexpr = False,
    HAS_DROPOUT: tl.constexpr = False,
):
    tl.static_assert(not (VARLEN and WARP_SPECIALIZE), "packed sequences take the forward without warp specialization")
    pid_m, pid_bh = program_coordinates(query_programs)
    if HAS_RIGHT:
        # the band closes on the right, so later query blocks see more keys: start them first (programs are
        # dispatched in launch order, query blocks of a head next to each other, which keeps its K and V in
        # L2), so the short ones fill the last wave
        pid_m = query_programs - 1 - pid_m
    b, h, hk = program_heads(pid_bh, nheads, group_size)
    # packed sequences (VARLEN): stride_ob is 0 and each sequence starts at its own first row
    q_start, k_start, seqlen_q, seqlen_k, diagonal_offset = sequence_bounds(
        CuSeqlensQ, CuSeqlensK, b, seqlen_q, seqlen_k, diagonal_offset, VARLEN)
    o_ptr = Out + b * stride_ob + q_start * stride_om
    slope = alibi_slope(Slopes, b, h, stride_slopes_b, HAS_ALIBI)
    if VARLEN:
        # the grid covers max_seqlen_q (a hint), at most configs.VARLEN_GRID_ROWS rows: a longer sequence's
        # extra blocks are taken in turn
        for m0 in range(pid_m * BLOCK_M, seqlen_q, query_programs * BLOCK_M):
            _forward_query_block_tma(m0, Q, q_desc, k_desc, v_desc, o_ptr, Lse, Sink, b, h, hk, q_start, k_start,
                                     slope, stride_qb, stride_qm, stride_qh, stride_om, stride_oh, stride_lse_b,
                                     stride_lse_h, seqlen_q, seqlen_k, score_scale, softcap_scale, softcap_out,
                                     diagonal_offset, window_left, window_right, HEADDIM, HEADDIM_V, BLOCK_D,
                                     BLOCK_DV, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI,
                                     DOT_PRECISION, False, MASK_ALL, True, SEPARATE_RAGGED_END,
                                     SCALE_IN_EXP2, RESCALE_THRESHOLD, EXP2_POLY_EVERY, RngState, pid_bh,
                                     dropout_threshold, dropout_scale, HAS_SINK, HAS_DROPOUT)
    else:
        _forward_query_block_tma(pid_m * BLOCK_M, Q, q_desc, k_desc, v_desc, o_ptr, Lse, Sink, b, h, hk, q_start,
                                 k_start, slope, stride_qb, stride_qm, stride_qh, stride_om, stride_oh, stride_lse_b,
                                 stride_lse_h, seqlen_q, seqlen_k, score_scale, softcap_scale, softcap_out,
                                 diagonal_offset, window_left, window_right, HEADDIM, HEADDIM_V, BLOCK_D, BLOCK_DV,
                                 BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, DOT_PRECISION,
                                 WARP_SPECIALIZE, MASK_ALL, False, SEPARATE_RAGGED_END,
                                 SCALE_IN_EXP2, RESCALE_THRESHOLD, EXP2_POLY_EVERY, RngState, pid_bh,
                                 dropout_threshold, dropout_scale, HAS_SINK, HAS_DROPOUT)
