"""Recompute-based attention backward pass in Triton (FA2 schedule, deterministic).

Two schedules of the same arithmetic. Two launches (backward schedules 0 and 2):
1. dQ: one program per (query block, batch * head), streaming key blocks read transposed from
   memory: dQ += dS K. It holds its rows' dO already, so it also computes their delta = rowsum(dO * O)
   - dlse (d lse / d s = P, so a cotangent on lse enters the softmax Jacobian's row term) and stores it
   for the next kernel: one read of O instead of a preprocess launch that reads O and dO again (H200,
   d = 64, 16 x 1k tokens, 32 heads: the dQ kernel 372 -> 392 us, the 36 us preprocess gone; docs/schedules.md).
2. dK/dV: one program per (key block, batch * K/V head). It loads its K and V block once, then for
   each query head that shares the K/V head (grouped-query attention: the sum over the group
   happens in registers, no atomics, nothing repeated) streams the query blocks that can see the
   key block, recomputing P = exp2(S - lse) from the saved log-sum-exp, and accumulates
   dV += P^T dO and dK += dS^T Q with dS = P * (dP - delta), dP = dO V^T. Its tiles are computed
   transposed (keys as rows: S^T = K Q^T), so P^T and dS^T feed the matmuls directly.
One launch (schedules 1 and 3, attention_bwd_kernel): both kinds of program share the GPU, so a dK/dV
program may run before the dQ program of its rows; delta comes from attention_bwd_preprocess_kernel,
launched first. The dQ programs use the dK/dV tile transposed (many query rows, few keys); the
two-launch dQ kernel may take a tile of its own.
dQ in its own programs (instead of atomics from the dK/dV programs) costs two extra matmuls per tile
but makes every gradient bitwise reproducible.

With USE_TMA (backward schedules 2 and 3) the tiles a program streams (Q and dO in dK/dV,
K and V in dQ) come from host-side tensor descriptors, (batch, heads, rows, dim) views whose box is one
head's tile, instead of pointer tiles: the copy engine zero-fills rows past the sequence's end and
columns past a padded head dim, and the loop keeps no per-element addresses or bounds in registers (on
an H200, d = 128: +2% to +10% over pointer loads, 0% at 16k causal; docs/schedules.md). The
arithmetic is the same. In a packed batch a descriptor over the packed tensor reads the next sequence's
rows where a sequence ends, so there only the interior blocks come by TMA and the edge blocks by masked
pointer loads: TMA everywhere with the neighbour's rows zeroed in the kernel made ptxas spill more and ran
4.5-11% slower than pointer loads, the interior by TMA runs 2-4% faster (docs/varlen.md).

Packed variable-length batches (VARLEN) work as in fwd.py: batch entry b is sequence b of the
packed tensors, and each program loops over its sequence's real blocks. The preprocess kernel needs
no sequence boundaries (rows are independent): it sees the packed batch as one long sequence.

Packed batches keep the band mask per element (scores(PER_ROW_BAND=not VARLEN)): folded per query row it tripled
the packed dK/dV kernel's spills (d = 128, 64 x 128: 536 -> 1,652 bytes per thread; triton 3.6, sm_90) and slowed
it 32% on an H200 (docs/compiler-workarounds.md); dense batches keep the fold.

Both loops skip blocks outside the causal / window band and use the element mask only on blocks
that straddle an edge (common.query_block_bounds / key_block_bounds). Softcap multiplies dS by the
derivative of softcap * tanh(x / softcap), 1 - tanh^2; ALiBi and masks are constants.

Dropout (HAS_DROPOUT) regenerates the forward's keep-mask Z by position (common.dropout_keep; nothing was stored).
With out = (P * Z / (1 - p)) V: dV = (P * Z)^T dO / (1 - p) (the factor applied once, when dV is stored), the
gradient of the probabilities is dP = dO V^T * Z / (1 - p), and dS = P * (dP - delta) with delta = rowsum(dO * O)
- dlse unchanged, since sum_j P_ij dP_ij = sum_j P_ij Z_ij / (1 - p) (dO V^T)_ij = rowsum(dO * O)_i.
"""

import triton
import triton.language as tl

from .common import (alibi_slope, descriptor_origin, exp2_of_scores, key_block_bounds, load_tile,
                     program_coordinates, program_heads, query_block_bounds, scores, sequence_bounds, dropout_keep,
                     dropout_state)


@triton.jit
def attention_bwd_preprocess_kernel(Out, dOut, dLse, Delta,
                                    stride_ob, stride_om, stride_oh, stride_dob, stride_dom, stride_doh,
                                    nheads, seqlen_q, row_programs,
                                    HEADDIM_V: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr,
                                    HAS_DLSE: tl.constexpr):
    pid_m, pid_bh = program_coordinates(row_programs)
    b, h, _ = program_heads(pid_bh, nheads, 1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = offs_m < seqlen_q
    ok = row_ok[:, None] & (offs_dv[None, :] < HEADDIM_V)
    rows = offs_m[:, None].to(tl.int64)
    o = tl.load(Out + b * stride_ob + h * stride_oh + rows * stride_om + offs_dv[None, :], mask=ok, other=0.0)
    do = tl.load(dOut + b * stride_dob + h * stride_doh + rows * stride_dom + offs_dv[None, :], mask=ok, other=0.0)
    _store_delta(o, do, dLse, Delta, pid_bh.to(tl.int64) * seqlen_q, offs_m, row_ok, HAS_DLSE)


@triton.jit
def _store_delta(o, do, dLse, Delta, row_base, offs_m, row_ok, HAS_DLSE: tl.constexpr):
    """delta = rowsum(dO * O) - dlse of rows offs_m, stored at Delta + row_base (dLse alike) and returned; the
    preprocess kernel and the two-launch dQ kernel both compute it here."""
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    if HAS_DLSE:
        delta -= tl.load(dLse + row_base + offs_m, mask=row_ok, other=0.0)
    tl.store(Delta + row_base + offs_m, delta, mask=row_ok)
    return delta


@triton.jit
def _lse_to_base2(lse):
    """Base-2 lse, +inf for rows that saw no key (lse -inf), so that exp2(s - lse) = 0 there."""
    return tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)


@triton.jit
def _load_row_stats(Lse, Delta, row_base, offs_m, seqlen_q, CHECK_ROWS: tl.constexpr):
    """Base-2 lse (_lse_to_base2) and delta of rows offs_m (CHECK_ROWS false: the caller knows every row lies
    inside the sequence)."""
    if CHECK_ROWS:
        row_ok = offs_m < seqlen_q
        lse = tl.load(Lse + row_base + offs_m, mask=row_ok, other=float("inf"))
        delta = tl.load(Delta + row_base + offs_m, mask=row_ok, other=0.0)
    else:
        lse = tl.load(Lse + row_base + offs_m)
        delta = tl.load(Delta + row_base + offs_m)
    return _lse_to_base2(lse), delta


@triton.jit
def _dkdv_blocks(dk, dv, k, v, q_src, do_src, q_desc, do_desc, b32, h32, row0, Lse, Delta, row_base, stride_qm,
                 stride_dom, mask_cols, stride_mask_m, offs_n, offs_d, offs_dv, start, end, seqlen_q, seqlen_k,
                 score_scale, softcap_scale, softcap_out, slope, diagonal_offset, window_left, window_right,
                 HEADDIM: tl.constexpr, HEADDIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                 BLOCK_M: tl.constexpr, MASKED: tl.constexpr,
                 HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                 HAS_ALIBI: tl.constexpr, MASK_KIND: tl.constexpr, DOT_PRECISION: tl.constexpr,
                 USE_TMA: tl.constexpr, SCALE_IN_EXP2: tl.constexpr, VARLEN: tl.constexpr,
                 key0, dropout_seed, dropout_stream, dropout_row, dropout_threshold, dropout_scale,
                 HAS_DROPOUT: tl.constexpr):
    # Tiles are transposed (keys as rows, queries as columns) so that P^T and dS^T come out of the
    # matmuls directly and only register tiles of Q and dO get transposed. q_src / do_src are pointers at the
    # sequence's row 0: MASKED ranges may run past the queries; the interior range never does, so its loads go
    # unmasked. With USE_TMA the tiles come through q_desc / do_desc instead, host-side (batch, heads, rows, dim)
    # descriptors (b32, h32 and row0 + m0 the coordinates): in a dense batch everywhere (rows past the sequence
    # read as zeros), in a packed one (VARLEN) only in the interior range, since past a sequence's end the
    # descriptor would read the next sequence's rows.
    for m0 in range(start, end, BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        if USE_TMA and not (MASKED and VARLEN):
            q_t = tl.trans(q_desc.load([b32, h32, row0 + m0, 0]).reshape(BLOCK_M, BLOCK_D))
            do = do_desc.load([b32, h32, row0 + m0, 0]).reshape(BLOCK_M, BLOCK_DV)
        else:
            row_ok = offs_m < seqlen_q
            q_t = load_tile(q_src + offs_m[None, :].to(tl.int64) * stride_qm + offs_d[:, None],
                            row_ok[None, :], offs_d[:, None] < HEADDIM, MASKED, BLOCK_D != HEADDIM)
            do = load_tile(do_src + offs_m[:, None].to(tl.int64) * stride_dom + offs_dv[None, :],
                           row_ok[:, None], offs_dv[None, :] < HEADDIM_V, MASKED, BLOCK_DV != HEADDIM_V)
        lse2, delta = _load_row_stats(Lse, Delta, row_base, offs_m, seqlen_q, MASKED)
        qk_t = tl.dot(k, q_t, input_precision=DOT_PRECISION)
        s_t, t_t = scores(qk_t, offs_m[None, :], offs_n[:, None], seqlen_q, seqlen_k, score_scale, softcap_scale,
                          softcap_out, slope, diagonal_offset, window_left, window_right,
                          mask_cols + offs_m[None, :].to(tl.int64) * stride_mask_m,
                          MASKED, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, MASK_KIND, SCALE_IN_EXP2, not VARLEN)
        # unscaled products (SCALE_IN_EXP2): one fused multiply-add per score also in masked tiles, where the
        # mask's select would sit between a separate multiply and the subtraction
        p_t = exp2_of_scores(s_t, lse2[None, :], score_scale, SCALE_IN_EXP2)
        if HAS_DROPOUT:
            # the keep-mask of keys [key0, key0 + BLOCK_N) against these queries, transposed like the tile; dV takes
            # the kept probabilities (its 1 / (1 - p) comes when it is stored), dP the kept entries scaled
            BLOCK_N: tl.constexpr = k.shape[0]
            keep_t = tl.trans(dropout_keep(dropout_seed, dropout_stream, dropout_row, offs_m, key0, dropout_threshold,
                                           BLOCK_N))
            dv += tl.dot(tl.where(keep_t, p_t, 0.0).to(do.dtype), do, input_precision=DOT_PRECISION)
            dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
            dp_t = tl.where(keep_t, dp_t * dropout_scale, 0.0)
        else:
            dv += tl.dot(p_t.to(do.dtype), do, input_precision=DOT_PRECISION)
            dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
        ds_t = p_t * (dp_t - delta[None, :])
        if HAS_SOFTCAP:  # d(softcap * tanh(x / softcap)) / dx = 1 - tanh^2
            ds_t = ds_t * (1.0 - t_t * t_t)
        dk += tl.dot(ds_t.to(q_t.dtype), tl.trans(q_t), input_precision=DOT_PRECISION)
    return dk, dv


@triton.jit
def _dkdv_key_block(n0, Q, K, V, dOut, q_desc, do_desc, Lse, Delta, dK, dV, Slopes, Mask, b, hk, q_start,
                    stride_qm, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_dom, stride_doh,
                    stride_dkn, stride_dkh, stride_dvn, stride_dvh, stride_lse_b, stride_lse_h,
                    stride_slopes_b, stride_mask_b, stride_mask_h, stride_mask_m, stride_mask_n,
                    group_size, seqlen_q, seqlen_k, sm_scale, score_scale, softcap_scale, softcap_out,
                    diagonal_offset, window_left, window_right,
                    HEADDIM: tl.constexpr, HEADDIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, MASK_KIND: tl.constexpr,
                    DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr, SCALE_IN_EXP2: tl.constexpr,
                    VARLEN: tl.constexpr, RngState, dropout_row0, dropout_threshold, dropout_scale,
                    HAS_DROPOUT: tl.constexpr):
    """dK and dV of keys [n0, n0 + BLOCK_N) of one (batch entry, K/V head); the pointers are at the entry's row 0.
    HAS_DROPOUT: query head h takes the keep-mask of dropout_row0 + h (dropout_row0 = b * nheads)."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    key_ok = offs_n < seqlen_k
    cols = offs_n[:, None].to(tl.int64)
    k = tl.load(K + hk * stride_kh + cols * stride_kn + offs_d[None, :],
                mask=key_ok[:, None] & (offs_d[None, :] < HEADDIM), other=0.0)
    v = tl.load(V + hk * stride_vh + cols * stride_vn + offs_dv[None, :],
                mask=key_ok[:, None] & (offs_dv[None, :] < HEADDIM_V), other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    lo, full_lo, full_hi, hi = query_block_bounds(n0, seqlen_q, seqlen_k, diagonal_offset, window_left,
                                                  window_right, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
    tma_b, tma_row0 = descriptor_origin(b, q_start, VARLEN)
    dropout_seed, dropout_stream = 0, 0
    if HAS_DROPOUT:
        dropout_seed, dropout_stream = dropout_state(RngState)
    for g in range(0, group_size):
        h = hk * group_size + g
        q_src = Q + h * stride_qh
        do_src = dOut + h * stride_doh
        row_base = b * stride_lse_b + h * stride_lse_h + q_start
        mask_cols = Mask + b * stride_mask_b + h * stride_mask_h + offs_n[:, None].to(tl.int64) * stride_mask_n
        slope = alibi_slope(Slopes, b, h, stride_slopes_b, HAS_ALIBI)
        dk, dv = _dkdv_blocks(dk, dv, k, v, q_src, do_src, q_desc, do_desc, tma_b, h.to(tl.int32), tma_row0, Lse,
                              Delta, row_base, stride_qm, stride_dom,
                              mask_cols, stride_mask_m, offs_n, offs_d, offs_dv, lo, tl.minimum(full_lo, hi),
                              seqlen_q, seqlen_k, score_scale, softcap_scale, softcap_out, slope, diagonal_offset,
                              window_left, window_right, HEADDIM, HEADDIM_V, BLOCK_D, BLOCK_DV, BLOCK_M, True,
                              HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, MASK_KIND, DOT_PRECISION,
                              USE_TMA, SCALE_IN_EXP2, VARLEN, n0, dropout_seed, dropout_stream, dropout_row0 + h,
                              dropout_threshold, dropout_scale, HAS_DROPOUT)
        dk, dv = _dkdv_blocks(dk, dv, k, v, q_src, do_src, q_desc, do_desc, tma_b, h.to(tl.int32), tma_row0, Lse,
                              Delta, row_base, stride_qm, stride_dom,
                              mask_cols, stride_mask_m, offs_n, offs_d, offs_dv, full_lo, full_hi,
                              seqlen_q, seqlen_k, score_scale, softcap_scale, softcap_out, slope, diagonal_offset,
                              window_left, window_right, HEADDIM, HEADDIM_V, BLOCK_D, BLOCK_DV, BLOCK_M, False,
                              HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, MASK_KIND, DOT_PRECISION,
                              USE_TMA, SCALE_IN_EXP2, VARLEN, n0, dropout_seed, dropout_stream, dropout_row0 + h,
                              dropout_threshold, dropout_scale, HAS_DROPOUT)
        dk, dv = _dkdv_blocks(dk, dv, k, v, q_src, do_src, q_desc, do_desc, tma_b, h.to(tl.int32), tma_row0, Lse,
                              Delta, row_base, stride_qm, stride_dom,
                              mask_cols, stride_mask_m, offs_n, offs_d, offs_dv, full_hi, hi,
                              seqlen_q, seqlen_k, score_scale, softcap_scale, softcap_out, slope, diagonal_offset,
                              window_left, window_right, HEADDIM, HEADDIM_V, BLOCK_D, BLOCK_DV, BLOCK_M, True,
                              HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, MASK_KIND, DOT_PRECISION,
                              USE_TMA, SCALE_IN_EXP2, VARLEN, n0, dropout_seed, dropout_stream, dropout_row0 + h,
                              dropout_threshold, dropout_scale, HAS_DROPOUT)
    if HAS_DROPOUT:
        dv = dv * dropout_scale  # the kept probabilities' 1 / (1 - p)
    tl.store(dK + hk * stride_dkh + cols * stride_dkn + offs_d[None, :],
             (dk * sm_scale).to(dK.dtype.element_ty), mask=key_ok[:, None] & (offs_d[None, :] < HEADDIM))
    tl.store(dV + hk * stride_dvh + cols * stride_dvn + offs_dv[None, :],
             dv.to(dV.dtype.element_ty), mask=key_ok[:, None] & (offs_dv[None, :] < HEADDIM_V))


@triton.jit
def _dkdv_program(pid_n, key_programs, b, hk, Q, K, V, dOut, q_desc, do_desc, Lse, Delta, dK, dV, Slopes, Mask,
                  CuSeqlensQ, CuSeqlensK,
                  stride_qb, stride_qm, stride_qh, stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh,
                  stride_dob, stride_dom, stride_doh, stride_dkb, stride_dkn, stride_dkh, stride_dvb, stride_dvn,
                  stride_dvh, stride_lse_b, stride_lse_h,
                  stride_slopes_b, stride_mask_b, stride_mask_h, stride_mask_m, stride_mask_n,
                  group_size, seqlen_q, seqlen_k,
                  sm_scale, score_scale, softcap_scale, softcap_out, diagonal_offset, window_left, window_right,
                  HEADDIM: tl.constexpr, HEADDIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
                  MASK_KIND: tl.constexpr, DOT_PRECISION: tl.constexpr, VARLEN: tl.constexpr,
                  USE_TMA: tl.constexpr, SCALE_IN_EXP2: tl.constexpr, RngState, nheads, dropout_threshold,
                  dropout_scale, HAS_DROPOUT: tl.constexpr):
    """The dK/dV work of program pid_n of key_programs for (batch entry b, K/V head hk)."""
    q_start, k_start, seqlen_q, seqlen_k, diagonal_offset = sequence_bounds(
        CuSeqlensQ, CuSeqlensK, b, seqlen_q, seqlen_k, diagonal_offset, VARLEN)
    q_ptr = Q + b * stride_qb + q_start * stride_qm
    k_ptr = K + b * stride_kb + k_start * stride_kn
    v_ptr = V + b * stride_vb + k_start * stride_vn
    do_ptr = dOut + b * stride_dob + q_start * stride_dom
    dk_ptr = dK + b * stride_dkb + k_start * stride_dkn
    dv_ptr = dV + b * stride_dvb + k_start * stride_dvn
    if VARLEN:
        # the grid covers max_seqlen_k (a hint), at most configs.VARLEN_GRID_ROWS keys: a longer sequence's
        # extra blocks are taken in turn
        for n0 in range(pid_n * BLOCK_N, seqlen_k, key_programs * BLOCK_N):
            _dkdv_key_block(n0, q_ptr, k_ptr, v_ptr, do_ptr, q_desc, do_desc, Lse, Delta, dk_ptr, dv_ptr, Slopes, Mask,
                            b, hk, q_start, stride_qm, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh,
                            stride_dom, stride_doh, stride_dkn, stride_dkh, stride_dvn, stride_dvh, stride_lse_b,
                            stride_lse_h, stride_slopes_b, stride_mask_b, stride_mask_h, stride_mask_m, stride_mask_n,
                            group_size, seqlen_q, seqlen_k, sm_scale, score_scale, softcap_scale, softcap_out,
                            diagonal_offset, window_left, window_right, HEADDIM, HEADDIM_V, BLOCK_D, BLOCK_DV, BLOCK_M,
                            BLOCK_N, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, MASK_KIND, DOT_PRECISION,
                            USE_TMA, SCALE_IN_EXP2, VARLEN, RngState, b * nheads, dropout_threshold, dropout_scale,
                            HAS_DROPOUT)
    else:
        _dkdv_key_block(pid_n * BLOCK_N, q_ptr, k_ptr, v_ptr, do_ptr, q_desc, do_desc, Lse, Delta, dk_ptr, dv_ptr,
                        Slopes, Mask, b, hk, q_start, stride_qm, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh,
                        stride_dom, stride_doh, stride_dkn, stride_dkh, stride_dvn, stride_dvh, stride_lse_b,
                        stride_lse_h, stride_slopes_b, stride_mask_b, stride_mask_h, stride_mask_m, stride_mask_n,
                        group_size, seqlen_q, seqlen_k, sm_scale, score_scale, softcap_scale, softcap_out,
                        diagonal_offset, window_left, window_right, HEADDIM, HEADDIM_V, BLOCK_D, BLOCK_DV, BLOCK_M,
                        BLOCK_N, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, MASK_KIND, DOT_PRECISION,
                        USE_TMA, SCALE_IN_EXP2, VARLEN, RngState, b * nheads, dropout_threshold, dropout_scale,
                        HAS_DROPOUT)


@triton.jit
def attention_bwd_dkdv_kernel(
    Q, K, V, dOut, q_desc, k_desc, v_desc, do_desc, Lse, Delta, dK, dV, Slopes, Mask, CuSeqlensQ, CuSeqlensK,
    RngState,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_dob, stride_dom, stride_doh,
    stride_dkb, stride_dkn, stride_dkh,
    stride_dvb, stride_dvn, stride_dvh,
    stride_lse_b, stride_lse_h,
    stride_slopes_b, stride_mask_b, stride_mask_h, stride_mask_m, stride_mask_n,
    nheads, nheads_k, group_size, seqlen_q, seqlen_k, key_programs,
    sm_scale, score_scale, softcap_scale, softcap_out, diagonal_offset, window_left, window_right,
    dropout_threshold, dropout_scale,
    HEADDIM: tl.constexpr, HEADDIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    MASK_KIND: tl.constexpr, DOT_PRECISION: tl.constexpr, VARLEN: tl.constexpr, USE_TMA: tl.constexpr,
    SCALE_IN_EXP2: tl.constexpr, HAS_DROPOUT: tl.constexpr = False,
):
    pid_n, pid_bhk = program_coordinates(key_programs)
    b, hk, _ = program_heads(pid_bhk, nheads_k, 1)
    _dkdv_program(pid_n, key_programs, b, hk, Q, K, V, dOut, q_desc, do_desc, Lse, Delta, dK, dV,
                  Slopes, Mask,
                  CuSeqlensQ, CuSeqlensK, stride_qb, stride_qm, stride_qh, stride_kb, stride_kn, stride_kh, stride_vb,
                  stride_vn, stride_vh, stride_dob, stride_dom, stride_doh, stride_dkb, stride_dkn, stride_dkh,
                  stride_dvb, stride_dvn, stride_dvh, stride_lse_b, stride_lse_h, stride_slopes_b, stride_mask_b,
                  stride_mask_h, stride_mask_m, stride_mask_n, group_size, seqlen_q, seqlen_k, sm_scale, score_scale,
                  softcap_scale, softcap_out, diagonal_offset, window_left, window_right, HEADDIM, HEADDIM_V, BLOCK_D,
                  BLOCK_DV, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, MASK_KIND, DOT_PRECISION,
                  VARLEN, USE_TMA, SCALE_IN_EXP2, RngState, nheads, dropout_threshold, dropout_scale, HAS_DROPOUT)


@triton.jit
def _dq_blocks(dq, q, do, lse2, delta, k_src, v_src, k_desc, v_desc, b32, hk32, row0, stride_kn, stride_vn,
               mask_rows, stride_mask_n,
               offs_m, offs_d, offs_dv, start, end, seqlen_q, seqlen_k, score_scale, softcap_scale, softcap_out, slope,
               diagonal_offset, window_left, window_right,
               HEADDIM: tl.constexpr, HEADDIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
               BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
               HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
               HAS_ALIBI: tl.constexpr, MASK_KIND: tl.constexpr, DOT_PRECISION: tl.constexpr,
               USE_TMA: tl.constexpr, SCALE_IN_EXP2: tl.constexpr, VARLEN: tl.constexpr,
               dropout_seed, dropout_stream, dropout_row, dropout_threshold, dropout_scale, HAS_DROPOUT: tl.constexpr):
    # k_src / v_src: pointers at the sequence's row 0, where MASKED ranges may run past the keys; the interior
    # range never does, so its loads go unmasked. With USE_TMA the tiles come through k_desc / v_desc (b32, hk32
    # and row0 + n0 the coordinates), in a packed batch (VARLEN) only in the interior range (as in _dkdv_blocks)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        if USE_TMA and not (MASKED and VARLEN):
            k_t = tl.trans(k_desc.load([b32, hk32, row0 + n0, 0]).reshape(BLOCK_N, BLOCK_D))
            v_t = tl.trans(v_desc.load([b32, hk32, row0 + n0, 0]).reshape(BLOCK_N, BLOCK_DV))
        else:
            key_ok = offs_n < seqlen_k
            cols = offs_n[None, :].to(tl.int64)
            # K and V are read transposed straight from memory (D, BLOCK_N): no in-register transpose
            k_t = load_tile(k_src + cols * stride_kn + offs_d[:, None],
                            key_ok[None, :], offs_d[:, None] < HEADDIM, MASKED, BLOCK_D != HEADDIM)
            v_t = load_tile(v_src + cols * stride_vn + offs_dv[:, None],
                            key_ok[None, :], offs_dv[:, None] < HEADDIM_V, MASKED, BLOCK_DV != HEADDIM_V)
        qk = tl.dot(q, k_t, input_precision=DOT_PRECISION)
        s, t = scores(qk, offs_m[:, None], offs_n[None, :], seqlen_q, seqlen_k, score_scale, softcap_scale,
                      softcap_out, slope, diagonal_offset, window_left, window_right,
                      mask_rows + offs_n[None, :] * stride_mask_n,
                      MASKED, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, MASK_KIND, SCALE_IN_EXP2, not VARLEN)
        p = exp2_of_scores(s, lse2[:, None], score_scale, SCALE_IN_EXP2)
        dp = tl.dot(do, v_t, input_precision=DOT_PRECISION)
        if HAS_DROPOUT:
            # the gradient of the probabilities reaches only the kept entries, scaled by 1 / (1 - p)
            keep = dropout_keep(dropout_seed, dropout_stream, dropout_row, offs_m, n0, dropout_threshold, BLOCK_N)
            dp = tl.where(keep, dp * dropout_scale, 0.0)
        ds = p * (dp - delta[:, None])
        if HAS_SOFTCAP:
            ds = ds * (1.0 - t * t)
        dq += tl.dot(ds.to(k_t.dtype), tl.trans(k_t), input_precision=DOT_PRECISION)
    return dq


@triton.jit
def _dq_query_block(m0, Q, K, V, dOut, Out, k_desc, v_desc, Lse, Delta, dLse, dQ, Slopes, Mask, b, h, hk, q_start,
                    k_start, stride_qm, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_dom, stride_doh,
                    stride_om, stride_oh, stride_dqm, stride_dqh, stride_lse_b, stride_lse_h,
                    stride_slopes_b, stride_mask_b, stride_mask_h, stride_mask_m, stride_mask_n,
                    seqlen_q, seqlen_k, sm_scale, score_scale, softcap_scale, softcap_out,
                    diagonal_offset, window_left, window_right,
                    HEADDIM: tl.constexpr, HEADDIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, MASK_KIND: tl.constexpr,
                    DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr, SCALE_IN_EXP2: tl.constexpr,
                    VARLEN: tl.constexpr, COMPUTE_DELTA: tl.constexpr, HAS_DLSE: tl.constexpr,
                    RngState, dropout_row, dropout_threshold, dropout_scale, HAS_DROPOUT: tl.constexpr):
    """dQ of query rows [m0, m0 + BLOCK_M) of one (batch entry, head); the pointers are at the entry's row 0.
    COMPUTE_DELTA: compute these rows' delta from Out and dO (and dLse) and store it, instead of reading it.
    HAS_DROPOUT: the keep-mask of (batch entry, head) dropout_row = b * nheads + h."""
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = offs_m < seqlen_q
    rows = offs_m[:, None].to(tl.int64)
    q = tl.load(Q + h * stride_qh + rows * stride_qm + offs_d[None, :],
                mask=row_ok[:, None] & (offs_d[None, :] < HEADDIM), other=0.0)
    do = tl.load(dOut + h * stride_doh + rows * stride_dom + offs_dv[None, :],
                 mask=row_ok[:, None] & (offs_dv[None, :] < HEADDIM_V), other=0.0)
    row_base = b * stride_lse_b + h * stride_lse_h + q_start
    if COMPUTE_DELTA:
        # the two-launch schedules run this kernel first: it holds dO already, so its delta costs one read of O
        # instead of a preprocess launch that reads both (the dK/dV kernel, launched next, reads what is stored)
        o = tl.load(Out + h * stride_oh + rows * stride_om + offs_dv[None, :],
                    mask=row_ok[:, None] & (offs_dv[None, :] < HEADDIM_V), other=0.0)
        delta = _store_delta(o, do, dLse, Delta, row_base, offs_m, row_ok, HAS_DLSE)
        lse2 = _lse_to_base2(tl.load(Lse + row_base + offs_m, mask=row_ok, other=float("inf")))
    else:
        lse2, delta = _load_row_stats(Lse, Delta, row_base, offs_m, seqlen_q, True)
    k_src = K + hk * stride_kh
    v_src = V + hk * stride_vh
    b32, row0 = descriptor_origin(b, k_start, VARLEN)
    hk32 = hk.to(tl.int32)
    mask_rows = Mask + b * stride_mask_b + h * stride_mask_h + rows * stride_mask_m
    slope = alibi_slope(Slopes, b, h, stride_slopes_b, HAS_ALIBI)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    lo, full_lo, full_hi, hi = key_block_bounds(m0, seqlen_k, diagonal_offset, window_left, window_right,
                                                BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
    dropout_seed, dropout_stream = 0, 0
    if HAS_DROPOUT:
        dropout_seed, dropout_stream = dropout_state(RngState)
    dq = _dq_blocks(dq, q, do, lse2, delta, k_src, v_src, k_desc, v_desc, b32, hk32, row0, stride_kn, stride_vn,
                    mask_rows, stride_mask_n,
                    offs_m, offs_d, offs_dv, lo, tl.minimum(full_lo, hi), seqlen_q, seqlen_k, score_scale,
                    softcap_scale, softcap_out, slope, diagonal_offset, window_left, window_right, HEADDIM,
                    HEADDIM_V, BLOCK_D, BLOCK_DV, BLOCK_N, True, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, MASK_KIND,
                    DOT_PRECISION, USE_TMA, SCALE_IN_EXP2, VARLEN, dropout_seed, dropout_stream, dropout_row,
                    dropout_threshold, dropout_scale, HAS_DROPOUT)
    dq = _dq_blocks(dq, q, do, lse2, delta, k_src, v_src, k_desc, v_desc, b32, hk32, row0, stride_kn, stride_vn,
                    mask_rows, stride_mask_n,
                    offs_m, offs_d, offs_dv, full_lo, full_hi, seqlen_q, seqlen_k, score_scale,
                    softcap_scale, softcap_out, slope, diagonal_offset, window_left, window_right, HEADDIM,
                    HEADDIM_V, BLOCK_D, BLOCK_DV, BLOCK_N, False, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI,
                    MASK_KIND, DOT_PRECISION, USE_TMA, SCALE_IN_EXP2, VARLEN, dropout_seed, dropout_stream,
                    dropout_row, dropout_threshold, dropout_scale, HAS_DROPOUT)
    dq = _dq_blocks(dq, q, do, lse2, delta, k_src, v_src, k_desc, v_desc, b32, hk32, row0, stride_kn, stride_vn,
                    mask_rows, stride_mask_n,
                    offs_m, offs_d, offs_dv, full_hi, hi, seqlen_q, seqlen_k, score_scale,
                    softcap_scale, softcap_out, slope, diagonal_offset, window_left, window_right, HEADDIM,
                    HEADDIM_V, BLOCK_D, BLOCK_DV, BLOCK_N, True, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, MASK_KIND,
                    DOT_PRECISION, USE_TMA, SCALE_IN_EXP2, VARLEN, dropout_seed, dropout_stream, dropout_row,
                    dropout_threshold, dropout_scale, HAS_DROPOUT)
    tl.store(dQ + h * stride_dqh + rows * stride_dqm + offs_d[None, :],
             (dq * sm_scale).to(dQ.dtype.element_ty), mask=row_ok[:, None] & (offs_d[None, :] < HEADDIM))


@triton.jit
def _dq_program(pid_m, query_programs, b, h, hk, Q, K, V, dOut, Out, k_desc, v_desc, Lse, Delta, dLse, dQ, Slopes,
                Mask, CuSeqlensQ, CuSeqlensK,
                stride_qb, stride_qm, stride_qh, stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh,
                stride_dob, stride_dom, stride_doh, stride_ob, stride_om, stride_oh, stride_dqb, stride_dqm, stride_dqh,
                stride_lse_b, stride_lse_h,
                stride_slopes_b, stride_mask_b, stride_mask_h, stride_mask_m, stride_mask_n,
                seqlen_q, seqlen_k,
                sm_scale, score_scale, softcap_scale, softcap_out, diagonal_offset, window_left, window_right,
                HEADDIM: tl.constexpr, HEADDIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
                MASK_KIND: tl.constexpr, DOT_PRECISION: tl.constexpr, VARLEN: tl.constexpr,
                USE_TMA: tl.constexpr, SCALE_IN_EXP2: tl.constexpr, COMPUTE_DELTA: tl.constexpr,
                HAS_DLSE: tl.constexpr, RngState, dropout_row, dropout_threshold, dropout_scale,
                HAS_DROPOUT: tl.constexpr):
    """The dQ work of program pid_m of query_programs for (batch entry b, query head h of K/V head hk)
    (COMPUTE_DELTA: see _dq_query_block)."""
    q_start, k_start, seqlen_q, seqlen_k, diagonal_offset = sequence_bounds(
        CuSeqlensQ, CuSeqlensK, b, seqlen_q, seqlen_k, diagonal_offset, VARLEN)
    q_ptr = Q + b * stride_qb + q_start * stride_qm
    k_ptr = K + b * stride_kb + k_start * stride_kn
    v_ptr = V + b * stride_vb + k_start * stride_vn
    do_ptr = dOut + b * stride_dob + q_start * stride_dom
    o_ptr = Out + b * stride_ob + q_start * stride_om
    dq_ptr = dQ + b * stride_dqb + q_start * stride_dqm
    if VARLEN:
        for m0 in range(pid_m * BLOCK_M, seqlen_q, query_programs * BLOCK_M):
            _dq_query_block(m0, q_ptr, k_ptr, v_ptr, do_ptr, o_ptr, k_desc, v_desc, Lse, Delta, dLse, dq_ptr, Slopes,
                            Mask, b, h, hk, q_start, k_start, stride_qm, stride_qh, stride_kn, stride_kh, stride_vn,
                            stride_vh, stride_dom, stride_doh, stride_om, stride_oh, stride_dqm, stride_dqh,
                            stride_lse_b, stride_lse_h, stride_slopes_b,
                            stride_mask_b, stride_mask_h, stride_mask_m, stride_mask_n, seqlen_q, seqlen_k, sm_scale,
                            score_scale, softcap_scale, softcap_out, diagonal_offset, window_left, window_right,
                            HEADDIM, HEADDIM_V, BLOCK_D, BLOCK_DV, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP,
                            HAS_ALIBI, MASK_KIND, DOT_PRECISION, USE_TMA, SCALE_IN_EXP2, VARLEN, COMPUTE_DELTA,
                            HAS_DLSE, RngState, dropout_row, dropout_threshold, dropout_scale, HAS_DROPOUT)
    else:
        _dq_query_block(pid_m * BLOCK_M, q_ptr, k_ptr, v_ptr, do_ptr, o_ptr, k_desc, v_desc, Lse, Delta, dLse, dq_ptr,
                        Slopes, Mask, b, h, hk, q_start, k_start, stride_qm, stride_qh, stride_kn, stride_kh,
                        stride_vn, stride_vh, stride_dom, stride_doh, stride_om, stride_oh, stride_dqm, stride_dqh,
                        stride_lse_b, stride_lse_h, stride_slopes_b,
                        stride_mask_b, stride_mask_h, stride_mask_m, stride_mask_n, seqlen_q, seqlen_k, sm_scale,
                        score_scale, softcap_scale, softcap_out, diagonal_offset, window_left, window_right, HEADDIM,
                        HEADDIM_V, BLOCK_D, BLOCK_DV, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP,
                        HAS_ALIBI, MASK_KIND, DOT_PRECISION, USE_TMA, SCALE_IN_EXP2, VARLEN, COMPUTE_DELTA, HAS_DLSE,
                        RngState, dropout_row, dropout_threshold, dropout_scale, HAS_DROPOUT)


@triton.jit
def attention_bwd_dq_kernel(
    Q, K, V, dOut, Out, q_desc, k_desc, v_desc, do_desc, Lse, Delta, dLse, dQ, Slopes, Mask, CuSeqlensQ, CuSeqlensK,
    RngState,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_dob, stride_dom, stride_doh,
    stride_ob, stride_om, stride_oh,
    stride_dqb, stride_dqm, stride_dqh,
    stride_lse_b, stride_lse_h,
    stride_slopes_b, stride_mask_b, stride_mask_h, stride_mask_m, stride_mask_n,
    nheads, group_size, seqlen_q, seqlen_k, query_programs,
    sm_scale, score_scale, softcap_scale, softcap_out, diagonal_offset, window_left, window_right,
    dropout_threshold, dropout_scale,
    HEADDIM: tl.constexpr, HEADDIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    MASK_KIND: tl.constexpr, DOT_PRECISION: tl.constexpr, VARLEN: tl.constexpr, USE_TMA: tl.constexpr,
    SCALE_IN_EXP2: tl.constexpr, HAS_DLSE: tl.constexpr, HAS_DROPOUT: tl.constexpr = False,
):
    """The two-launch schedules' first kernel: dQ, and each query row's delta = rowsum(dO * O) - dLse (HAS_DLSE),
    stored in Delta for the dK/dV kernel launched after it."""
    pid_m, pid_bh = program_coordinates(query_programs)
    b, h, hk = program_heads(pid_bh, nheads, group_size)
    _dq_program(pid_m, query_programs, b, h, hk, Q, K, V, dOut, Out, k_desc, v_desc, Lse, Delta, dLse,
                dQ, Slopes, Mask,
                CuSeqlensQ, CuSeqlensK, stride_qb, stride_qm, stride_qh, stride_kb, stride_kn, stride_kh, stride_vb,
                stride_vn, stride_vh, stride_dob, stride_dom, stride_doh, stride_ob, stride_om, stride_oh, stride_dqb,
                stride_dqm, stride_dqh,
                stride_lse_b, stride_lse_h, stride_slopes_b, stride_mask_b, stride_mask_h, stride_mask_m,
                stride_mask_n, seqlen_q, seqlen_k, sm_scale, score_scale, softcap_scale, softcap_out, diagonal_offset,
                window_left, window_right, HEADDIM, HEADDIM_V, BLOCK_D, BLOCK_DV, BLOCK_M, BLOCK_N, HAS_LEFT,
                HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, MASK_KIND, DOT_PRECISION, VARLEN, USE_TMA, SCALE_IN_EXP2, True,
                HAS_DLSE, RngState, pid_bh, dropout_threshold, dropout_scale, HAS_DROPOUT)


@triton.jit
def attention_bwd_kernel(
    Q, K, V, dOut, q_desc, k_desc, v_desc, do_desc, Lse, Delta, dQ, dK, dV, Slopes, Mask, CuSeqlensQ, CuSeqlensK,
    RngState,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_dob, stride_dom, stride_doh,
    stride_dqb, stride_dqm, stride_dqh,
    stride_dkb, stride_dkn, stride_dkh,
    stride_dvb, stride_dvn, stride_dvh,
    stride_lse_b, stride_lse_h,
    stride_slopes_b, stride_mask_b, stride_mask_h, stride_mask_m, stride_mask_n,
    nheads, nheads_k, group_size, seqlen_q, seqlen_k, key_programs, query_programs,
    sm_scale, score_scale, softcap_scale, softcap_out, diagonal_offset, window_left, window_right,
    dropout_threshold, dropout_scale,
    HEADDIM: tl.constexpr, HEADDIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    MASK_KIND: tl.constexpr, DOT_PRECISION: tl.constexpr, VARLEN: tl.constexpr, USE_TMA: tl.constexpr,
    SCALE_IN_EXP2: tl.constexpr, HAS_DROPOUT: tl.constexpr = False,
):
    """Backward schedule 1: the dK/dV and the dQ programs in one launch, (key_programs * nheads_k +
    query_programs * nheads) programs per batch entry (program_coordinates). Of a batch entry's programs the
    first key_programs * nheads_k do what attention_bwd_dkdv_kernel's do, the rest what attention_bwd_dq_kernel's
    do (same tiles, same arithmetic, each output written by one program: as deterministic as the two launches),
    so the two kinds of program can share the GPU instead of the dQ launch waiting for the dK/dV launch's last
    wave."""
    dkdv_programs = key_programs * nheads_k
    pid, b = program_coordinates(dkdv_programs + query_programs * nheads)
    b = b.to(tl.int64)
    if pid < dkdv_programs:
        hk = (pid // key_programs).to(tl.int64)
        _dkdv_program(pid % key_programs, key_programs, b, hk, Q, K, V, dOut, q_desc, do_desc, Lse, Delta, dK, dV,
                      Slopes, Mask,
                      CuSeqlensQ, CuSeqlensK, stride_qb, stride_qm, stride_qh, stride_kb, stride_kn, stride_kh,
                      stride_vb, stride_vn, stride_vh, stride_dob, stride_dom, stride_doh, stride_dkb, stride_dkn,
                      stride_dkh, stride_dvb, stride_dvn, stride_dvh, stride_lse_b, stride_lse_h, stride_slopes_b,
                      stride_mask_b, stride_mask_h, stride_mask_m, stride_mask_n, group_size, seqlen_q, seqlen_k,
                      sm_scale, score_scale, softcap_scale, softcap_out, diagonal_offset, window_left, window_right,
                      HEADDIM, HEADDIM_V, BLOCK_D, BLOCK_DV, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP,
                      HAS_ALIBI, MASK_KIND, DOT_PRECISION, VARLEN, USE_TMA, SCALE_IN_EXP2, RngState, nheads,
                      dropout_threshold, dropout_scale, HAS_DROPOUT)
    else:
        # the dQ programs use the transposed tile: BLOCK_N query rows against BLOCK_M keys
        r = pid - dkdv_programs
        h = (r // query_programs).to(tl.int64)
        # delta comes from the preprocess kernel here (a dK/dV program may run before the dQ program of its rows):
        # no Out or dLse to read (dOut stands in for them, never read)
        _dq_program(r % query_programs, query_programs, b, h, h // group_size, Q, K, V, dOut, dOut, k_desc, v_desc,
                    Lse, Delta, Lse, dQ,
                    Slopes, Mask, CuSeqlensQ, CuSeqlensK, stride_qb, stride_qm, stride_qh, stride_kb, stride_kn,
                    stride_kh, stride_vb, stride_vn, stride_vh, stride_dob, stride_dom, stride_doh, 0, 0, 0, stride_dqb,
                    stride_dqm, stride_dqh, stride_lse_b, stride_lse_h, stride_slopes_b, stride_mask_b, stride_mask_h,
                    stride_mask_m, stride_mask_n, seqlen_q, seqlen_k, sm_scale, score_scale, softcap_scale,
                    softcap_out, diagonal_offset, window_left, window_right, HEADDIM, HEADDIM_V, BLOCK_D, BLOCK_DV,
                    BLOCK_N, BLOCK_M, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, MASK_KIND, DOT_PRECISION, VARLEN,
                    USE_TMA, SCALE_IN_EXP2, False, False, RngState, b * nheads + h, dropout_threshold,
                    dropout_scale, HAS_DROPOUT)
