"""Fused attention forward pass in Triton (FA2 schedule).

One program per (query block, batch * head). The program loads its query block once, streams the
key/value blocks of its K/V head (grouped-query attention by index arithmetic: head h reads K/V
head h // group_size, nothing is repeated), and keeps the online softmax in registers: running max
m (base 2), running sum l and the unnormalised output acc, rescaled by exp2(m_old - m_new) when a
block raises the max. Normalisation happens once in the epilogue, which writes out and the natural
log-sum-exp (lse = (m + log2 l) * ln 2; -inf with out = 0 for rows that see no key). Where the scale is
the scores' only transformation and positive (SCALE_IN_EXP2, chosen by the launcher), the scores stay raw
products: the row max is taken on them and scaled once per row, and the scale goes inside the exponent, one
fused multiply-add per score (common.online_softmax_step).

The key loop is split into three ranges (see common.key_block_bounds): blocks before the band's
left edge region and after its right edge pay for the element mask; blocks wholly inside run
without it; blocks wholly outside are never loaded.

Supports: any head dims up to 256 (padded to a power of two inside the kernel, masked), dv != d,
fp16 / bf16 / fp32 (fp32 dots in IEEE fp32 unless TF32 is allowed), causal and windows in either
alignment (diagonal_offset), softcap, ALiBi, boolean / additive masks with any strides (stride 0
for broadcast), int64 offsets, and packed variable-length batches (VARLEN: batch entry b is the
sequence cu_seqlens[b] .. cu_seqlens[b + 1] of the packed tensors; its programs exit or loop by
the sequence's real length, so work follows the real tokens and max_seqlen is only a grid hint).
FlashAttention-4's moves (the fa4 schedule; 0 for every other, which compiles to the plain loop):
RESCALE_THRESHOLD = t keeps a row's running max while a block raises it by at most t (base 2), so acc and l are
not rescaled for that block; EXP2_POLY_EVERY = n computes one probability column in n by a cubic on the FMA units
(common.online_softmax_step, docs/schedules.md).
Paged K/V (PAGED, with VARLEN: flash_attn_varlen_func with block_table): K and V are caches of (num_blocks,
page_size, nheads_k, dim) and sequence b's key j is row j % page_size of block BlockTable[b, j // page_size]; its key
count is SeqlensK[b]. A key block looks its page up once where BLOCK_N divides the page size (the launcher then
passes PAGE_CHUNK = BLOCK_N), once per key otherwise (PAGE_CHUNK = 0); everything else (bands, masks, the online
softmax) is unchanged. Forward only. Without PAGED the key addresses are the packed kernel's expressions (the sm_90
instruction stream is the same as without the flag).
A learnable sink (HAS_SINK: Sink holds one natural-log logit per query head) is where each row's online softmax
starts, running max = the sink in base 2 and running sum = 1 (common.initial_row_stats): the lse includes it and a
row that sees no key gets out = 0 and lse = the sink.
Dropout (HAS_DROPOUT, flashtile._dropout): each tile's keep-mask is regenerated from Philox by position
(common.dropout_keep); the running sum l takes every probability and acc only the kept ones, and the finished rows
are scaled by 1 / (1 - p), so out = dropout(softmax(S)) V with the lse of S (with a sink, the sink's term is in l
and in the lse but never dropped: it has no value).
Limitations: fp64 is left to the torch backend.
"""

import triton
import triton.language as tl

from .common import (alibi_slope, finish_rows, initial_row_stats, key_block_bounds, load_tile, online_softmax_step,
                     program_coordinates, program_heads, scores, sequence_bounds, dropout_keep, dropout_state)


@triton.jit
def _key_rows(n0, offs_n, key_ok, table, page_size, num_blocks, stride_kb, stride_kn, stride_vb, stride_vn,
              BLOCK_N: tl.constexpr, PAGE_CHUNK: tl.constexpr):
    """Offsets of paged keys offs_n (a block starting at n0, a multiple of BLOCK_N) from the K / V head's base: row
    offs_n % page_size of block table[offs_n // page_size]. Table entries are clamped into 0 .. num_blocks - 1:
    unchecked ones are never followed outside the cache."""
    if PAGE_CHUNK == BLOCK_N:
        # BLOCK_N divides the page size: the block lies in one page, looked up once, and its rows are consecutive
        block = tl.load(table + n0 // page_size)
        block = tl.minimum(tl.maximum(block, 0), num_blocks - 1).to(tl.int64)
        within = (n0 % page_size + tl.arange(0, BLOCK_N)).to(tl.int64)
        k_rows = block * stride_kb + within * stride_kn
        v_rows = block * stride_vb + within * stride_vn
    else:
        # pages smaller than the block: one table entry per key (keys past the sequence's end look nothing up)
        block = tl.load(table + offs_n // page_size, mask=key_ok, other=0)
        block = tl.minimum(tl.maximum(block, 0), num_blocks - 1).to(tl.int64)
        within = (offs_n % page_size).to(tl.int64)
        k_rows = block * stride_kb + within * stride_kn
        v_rows = block * stride_vb + within * stride_vn
    return k_rows, v_rows


@triton.jit
def _forward_blocks(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn, mask_rows, stride_mask_n,
                    offs_m, offs_d, offs_dv, start, end, seqlen_q, seqlen_k, score_scale, softcap_scale, softcap_out, slope,
                    diagonal_offset, window_left, window_right, table, page_size, num_blocks, stride_kb, stride_vb,
                    HEADDIM: tl.constexpr, HEADDIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                    BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
                    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                    HAS_ALIBI: tl.constexpr, MASK_KIND: tl.constexpr, DOT_PRECISION: tl.constexpr,
                    SCALE_IN_EXP2: tl.constexpr, RESCALE_THRESHOLD: tl.constexpr, EXP2_POLY_EVERY: tl.constexpr,
                    dropout_seed, dropout_stream, dropout_row, dropout_threshold, HAS_DROPOUT: tl.constexpr,
                    PAGED: tl.constexpr, PAGE_CHUNK: tl.constexpr):
    # MASKED ranges may run past the keys; the interior range never does, so its loads go unmasked
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        key_ok = offs_n < seqlen_k
        if PAGED:
            k_rows, v_rows = _key_rows(n0, offs_n, key_ok, table, page_size, num_blocks, stride_kb, stride_kn,
                                       stride_vb, stride_vn, BLOCK_N, PAGE_CHUNK)
            k_ptrs = k_base + k_rows[None, :] + offs_d[:, None]
        else:
            k_ptrs = k_base + offs_n[None, :].to(tl.int64) * stride_kn + offs_d[:, None]
        k_t = load_tile(k_ptrs, key_ok[None, :], offs_d[:, None] < HEADDIM, MASKED, BLOCK_D != HEADDIM)
        qk = tl.dot(q, k_t, input_precision=DOT_PRECISION)
        s, _ = scores(qk, offs_m[:, None], offs_n[None, :], seqlen_q, seqlen_k, score_scale, softcap_scale,
                      softcap_out, slope, diagonal_offset, window_left, window_right,
                      mask_rows + offs_n[None, :] * stride_mask_n,
                      MASKED, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, MASK_KIND, SCALE_IN_EXP2)
        if PAGED:
            v_ptrs = v_base + v_rows[:, None] + offs_dv[None, :]
        else:
            v_ptrs = v_base + offs_n[:, None].to(tl.int64) * stride_vn + offs_dv[None, :]
        v = load_tile(v_ptrs,
                      key_ok[:, None], offs_dv[None, :] < HEADDIM_V, MASKED, BLOCK_DV != HEADDIM_V)
        keep = None
        if HAS_DROPOUT:
            keep = dropout_keep(dropout_seed, dropout_stream, dropout_row, offs_m, n0, dropout_threshold, BLOCK_N)
        acc, l_i, m_i = online_softmax_step(acc, l_i, m_i, s, v, score_scale, MASKED, MASK_KIND, DOT_PRECISION,
                                            SCALE_IN_EXP2, RESCALE_THRESHOLD, EXP2_POLY_EVERY, HAS_DROPOUT, keep)
    return acc, l_i, m_i


@triton.jit
def _forward_query_block(m0, Q, K, V, Out, Lse, Mask, Sink, q_start, k_start, b, h, hk, slope,
                         stride_qm, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_om, stride_oh,
                         stride_lse_b, stride_lse_h, stride_mask_b, stride_mask_h, stride_mask_m, stride_mask_n,
                         seqlen_q, seqlen_k, score_scale, softcap_scale, softcap_out, diagonal_offset,
                         window_left, window_right, table, page_size, num_blocks, stride_kb, stride_vb,
                         HEADDIM: tl.constexpr, HEADDIM_V: tl.constexpr, BLOCK_D: tl.constexpr,
                         BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                         HAS_ALIBI: tl.constexpr, MASK_KIND: tl.constexpr, DOT_PRECISION: tl.constexpr,
                         SCALE_IN_EXP2: tl.constexpr, RESCALE_THRESHOLD: tl.constexpr, EXP2_POLY_EVERY: tl.constexpr,
                         RngState, dropout_row, dropout_threshold, dropout_scale, HAS_SINK: tl.constexpr,
                         HAS_DROPOUT: tl.constexpr, PAGED: tl.constexpr, PAGE_CHUNK: tl.constexpr):
    """Query rows [m0, m0 + BLOCK_M) of one (batch entry, head): Q, Out point at the entry's row 0, K and V at its
    key row 0 (PAGED: at the cache's block 0, the keys found through `table`, the sequence's block-table row).
    HAS_DROPOUT: the keep-mask of (batch entry, head) dropout_row = b * nheads + h (common.dropout_keep)."""
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = offs_m < seqlen_q
    q = tl.load(Q + h * stride_qh + offs_m[:, None].to(tl.int64) * stride_qm + offs_d[None, :],
                mask=row_ok[:, None] & (offs_d[None, :] < HEADDIM), other=0.0)
    k_base = K + hk * stride_kh
    v_base = V + hk * stride_vh
    mask_rows = Mask + b * stride_mask_b + h * stride_mask_h + offs_m[:, None].to(tl.int64) * stride_mask_m

    m_i, l_i = initial_row_stats(Sink, h, BLOCK_M, HAS_SINK)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    lo, full_lo, full_hi, hi = key_block_bounds(m0, seqlen_k, diagonal_offset, window_left, window_right,
                                                BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
    dropout_seed, dropout_stream = 0, 0
    if HAS_DROPOUT:
        dropout_seed, dropout_stream = dropout_state(RngState)
    # the three key ranges: left band edge (masked), interior (unmasked), right edge and ragged end (masked)
    acc, l_i, m_i = _forward_blocks(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn, mask_rows, stride_mask_n,
                                    offs_m, offs_d, offs_dv, lo, tl.minimum(full_lo, hi), seqlen_q, seqlen_k,
                                    score_scale, softcap_scale, softcap_out, slope, diagonal_offset, window_left,
                                    window_right, table, page_size, num_blocks, stride_kb, stride_vb, HEADDIM,
                                    HEADDIM_V, BLOCK_D, BLOCK_DV, BLOCK_N, True, HAS_LEFT,
                                    HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, MASK_KIND, DOT_PRECISION, SCALE_IN_EXP2,
                                    RESCALE_THRESHOLD, EXP2_POLY_EVERY, dropout_seed, dropout_stream, dropout_row,
                                    dropout_threshold, HAS_DROPOUT, PAGED, PAGE_CHUNK)
    acc, l_i, m_i = _forward_blocks(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn, mask_rows, stride_mask_n,
                                    offs_m, offs_d, offs_dv, full_lo, full_hi, seqlen_q, seqlen_k,
                                    score_scale, softcap_scale, softcap_out, slope, diagonal_offset, window_left,
                                    window_right, table, page_size, num_blocks, stride_kb, stride_vb, HEADDIM,
                                    HEADDIM_V, BLOCK_D, BLOCK_DV, BLOCK_N, False, HAS_LEFT,
                                    HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, MASK_KIND, DOT_PRECISION, SCALE_IN_EXP2,
                                    RESCALE_THRESHOLD, EXP2_POLY_EVERY, dropout_seed, dropout_stream, dropout_row,
                                    dropout_threshold, HAS_DROPOUT, PAGED, PAGE_CHUNK)
    acc, l_i, m_i = _forward_blocks(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn, mask_rows, stride_mask_n,
                                    offs_m, offs_d, offs_dv, full_hi, hi, seqlen_q, seqlen_k,
                                    score_scale, softcap_scale, softcap_out, slope, diagonal_offset, window_left,
                                    window_right, table, page_size, num_blocks, stride_kb, stride_vb, HEADDIM,
                                    HEADDIM_V, BLOCK_D, BLOCK_DV, BLOCK_N, True, HAS_LEFT,
                                    HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, MASK_KIND, DOT_PRECISION, SCALE_IN_EXP2,
                                    RESCALE_THRESHOLD, EXP2_POLY_EVERY, dropout_seed, dropout_stream, dropout_row,
                                    dropout_threshold, HAS_DROPOUT, PAGED, PAGE_CHUNK)

    out, lse = finish_rows(acc, l_i, m_i)
    if HAS_DROPOUT:
        out = out * dropout_scale  # the kept probabilities' 1 / (1 - p)
    tl.store(Out + h * stride_oh + offs_m[:, None].to(tl.int64) * stride_om + offs_dv[None, :],
             out.to(Out.dtype.element_ty), mask=row_ok[:, None] & (offs_dv[None, :] < HEADDIM_V))
    tl.store(Lse + b * stride_lse_b + h * stride_lse_h + q_start + offs_m, lse, mask=row_ok)


@triton.jit
def attention_fwd_kernel(
    Q, K, V, Out, Lse, Slopes, Sink, Mask, CuSeqlensQ, CuSeqlensK, RngState, BlockTable, SeqlensK,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_ob, stride_om, stride_oh,
    stride_lse_b, stride_lse_h,
    stride_slopes_b, stride_mask_b, stride_mask_h, stride_mask_m, stride_mask_n,
    nheads, group_size, seqlen_q, seqlen_k, query_programs,
    sm_scale, score_scale, softcap_scale, softcap_out, diagonal_offset, window_left, window_right,
    dropout_threshold, dropout_scale,
    stride_table_b, stride_kblock, stride_vblock, page_size, num_blocks, capacity,
    HEADDIM: tl.constexpr, HEADDIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    MASK_KIND: tl.constexpr, DOT_PRECISION: tl.constexpr, VARLEN: tl.constexpr, SCALE_IN_EXP2: tl.constexpr,
    RESCALE_THRESHOLD: tl.constexpr = 0, EXP2_POLY_EVERY: tl.constexpr = 0, HAS_SINK: tl.constexpr = False,
    HAS_DROPOUT: tl.constexpr = False,
    PAGED: tl.constexpr = False, PAGE_CHUNK: tl.constexpr = 0,
):
    tl.static_assert(BLOCK_D >= HEADDIM and BLOCK_DV >= HEADDIM_V)
    pid_m, pid_bh = program_coordinates(query_programs)
    b, h, hk = program_heads(pid_bh, nheads, group_size)
    # packed sequences: stride_*b are 0 and each sequence starts at its own first row
    q_start, k_start, seqlen_q, seqlen_k, diagonal_offset = sequence_bounds(
        CuSeqlensQ, CuSeqlensK, b, seqlen_q, seqlen_k, diagonal_offset, VARLEN)
    table = BlockTable
    if PAGED:
        # paged K/V (packed queries only): sequence b's keys are the first SeqlensK[b] of its block-table row, clamped
        # to the row's capacity so that lengths the host did not check never send the program past its row
        tl.static_assert(VARLEN, "paged K/V comes with packed queries")
        seqlen_k = tl.minimum(tl.load(SeqlensK + b), capacity)
        diagonal_offset = seqlen_k - seqlen_q
        k_start = b * 0
        table = BlockTable + b * stride_table_b
    q_ptr = Q + b * stride_qb + q_start * stride_qm
    k_ptr = K + b * stride_kb + k_start * stride_kn
    v_ptr = V + b * stride_vb + k_start * stride_vn
    o_ptr = Out + b * stride_ob + q_start * stride_om
    slope = alibi_slope(Slopes, b, h, stride_slopes_b, HAS_ALIBI)
    if VARLEN:
        # the grid covers max_seqlen_q (a hint), at most configs.VARLEN_GRID_ROWS rows: a longer sequence's
        # extra blocks are taken in turn
        for m0 in range(pid_m * BLOCK_M, seqlen_q, query_programs * BLOCK_M):
            _forward_query_block(m0, q_ptr, k_ptr, v_ptr, o_ptr, Lse, Mask, Sink, q_start, k_start, b, h, hk, slope,
                                 stride_qm, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_om,
                                 stride_oh, stride_lse_b, stride_lse_h, stride_mask_b, stride_mask_h, stride_mask_m,
                                 stride_mask_n, seqlen_q, seqlen_k, score_scale, softcap_scale, softcap_out,
                                 diagonal_offset, window_left, window_right, table, page_size, num_blocks,
                                 stride_kblock, stride_vblock, HEADDIM, HEADDIM_V, BLOCK_D, BLOCK_DV,
                                 BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, MASK_KIND,
                                 DOT_PRECISION, SCALE_IN_EXP2, RESCALE_THRESHOLD, EXP2_POLY_EVERY, RngState,
                                 pid_bh, dropout_threshold, dropout_scale, HAS_SINK, HAS_DROPOUT,
                                 PAGED, PAGE_CHUNK)
    else:
        _forward_query_block(pid_m * BLOCK_M, q_ptr, k_ptr, v_ptr, o_ptr, Lse, Mask, Sink, q_start, k_start, b, h, hk,
                             slope, stride_qm, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_om,
                             stride_oh, stride_lse_b, stride_lse_h, stride_mask_b, stride_mask_h, stride_mask_m,
                             stride_mask_n, seqlen_q, seqlen_k, score_scale, softcap_scale, softcap_out,
                             diagonal_offset, window_left, window_right, table, page_size, num_blocks, stride_kblock,
                             stride_vblock, HEADDIM, HEADDIM_V, BLOCK_D, BLOCK_DV,
                             BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, MASK_KIND, DOT_PRECISION,
                             SCALE_IN_EXP2, RESCALE_THRESHOLD, EXP2_POLY_EVERY, RngState, pid_bh,
                             dropout_threshold, dropout_scale, HAS_SINK, HAS_DROPOUT,
                             PAGED, PAGE_CHUNK)
