"""Attention forward, persistent schedule: fwd_tma.py's tiles, with each program walking many query blocks
in one pipelined loop.

With one 128 x 128 program per SM (the H200 table's forward tile fills an SM's registers), every query
block pays for its own pipeline fill (the first K/V tiles' copies, nothing to overlap them with) and drain
(normalising and storing the output while no copy is in flight). At 4k keys that is a few per cent of a
program; at 1k keys, eight key blocks per query block, it was ~1.7 blocks' worth of time per program
(BENCHMARKS.md, session 11: 21.7 us a query block at 1k against 8 x 2.24 us at 4k's steady rate).

Here `num_programs` programs (about one per SM) share the (batch * head, query block) tiles round-robin,
and each runs one flat loop over all of its (tile, key block) steps. The step's tile and key block are
arithmetic on the loop counter, never loop-carried state, so the compiler's software pipeline prefetches
the next tile's first K/V blocks while the current tile finishes: the first step of a tile loads its
query block and resets the running statistics, the last one normalises and stores. Only problems
without a band are served (every tile then has the same number of key blocks, which keeps the step ->
(tile, block) map a division); a ragged key end masks keys on every step (MASK_KEYS). Everything else is
as in fwd_tma.py: GQA, dv != d, padded head dims (the copy engine zero-fills), softcap, ALiBi, both
alignments (without a band they agree), fully masked rows never arise (every row sees keys).
"""

import triton
import triton.language as tl

from .common import alibi_slope, finish_rows, online_softmax_step, program_heads, scores


@triton.jit
def attention_fwd_persistent_kernel(
    q_desc, k_desc, v_desc, Out, Lse, Slopes,
    stride_ob, stride_om, stride_oh,
    stride_lse_b, stride_lse_h,
    stride_slopes_b,
    nheads, group_size, seqlen_q, seqlen_k, query_blocks, tiles, key_blocks,
    sm_scale, score_scale, softcap_scale, softcap_out, diagonal_offset, window_left, window_right,
    HEADDIM: tl.constexpr, HEADDIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    DOT_PRECISION: tl.constexpr, MASK_KEYS: tl.constexpr,
):
    tl.static_assert(not (HAS_LEFT or HAS_RIGHT), "the persistent forward serves problems without a band")
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    # tiles pid, pid + programs, ...: this program's share, key_blocks steps each
    steps = tl.cdiv(tiles - pid, programs) * key_blocks
    offs_dv = tl.arange(0, BLOCK_DV)
    q = tl.zeros([BLOCK_M, BLOCK_D], dtype=Out.dtype.element_ty)  # q's dtype; loaded at each tile's first step
    slope = 0.0
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    for step in tl.range(0, steps):
        # which tile and key block: arithmetic on the counter, so the pipeline can compute it ahead
        nth = step // key_blocks
        block = step - nth * key_blocks
        tile = pid + nth * programs
        pid_bh = tile // query_blocks  # query blocks of one head are neighbours: their K/V stay in L2
        m0 = (tile - pid_bh * query_blocks) * BLOCK_M
        b, h, hk = program_heads(pid_bh, nheads, group_size)
        b32, h32, hk32 = b.to(tl.int32), h.to(tl.int32), hk.to(tl.int32)
        if block == 0:
            q = q_desc.load([b32, h32, m0, 0]).reshape(BLOCK_M, BLOCK_D)
            slope = alibi_slope(Slopes, b, h, stride_slopes_b, HAS_ALIBI)
            m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
            l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
            acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
        n0 = block * BLOCK_N
        offs_m = m0 + tl.arange(0, BLOCK_M)
        offs_n = n0 + tl.arange(0, BLOCK_N)
        k = k_desc.load([b32, hk32, n0, 0]).reshape(BLOCK_N, BLOCK_D)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        s, _ = scores(qk, offs_m[:, None], offs_n[None, :], seqlen_q, seqlen_k, score_scale, softcap_scale,
                      softcap_out, slope, diagonal_offset, window_left, window_right, None,
                      MASK_KEYS, False, False, HAS_SOFTCAP, HAS_ALIBI, 0)
        v = v_desc.load([b32, hk32, n0, 0]).reshape(BLOCK_N, BLOCK_DV)
        acc, l_i, m_i = online_softmax_step(acc, l_i, m_i, s, v, MASK_KEYS, 0, DOT_PRECISION)
        if block == key_blocks - 1:
            out, lse = finish_rows(acc, l_i, m_i)
            row_ok = offs_m < seqlen_q
            tl.store(Out + b * stride_ob + h * stride_oh + offs_m[:, None].to(tl.int64) * stride_om
                     + offs_dv[None, :], out.to(Out.dtype.element_ty),
                     mask=row_ok[:, None] & (offs_dv[None, :] < HEADDIM_V))
            tl.store(Lse + b * stride_lse_b + h * stride_lse_h + offs_m, lse, mask=row_ok)
