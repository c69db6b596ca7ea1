"""Attention over a KV cache in Triton: split-KV (Flash-Decoding) programs and the merge of their results.

attention_decode_kernel: one program per (split, block of rows, batch * K/V head), all along grid axis 0
(common.program_coordinates), the splits of a tile next to each other. Its tile's rows
are the (query head of the group, query token) pairs that share the K/V head — group_size * seqlen_q
rows, BLOCK_M per program — so for decoding (seqlen_q * group_size <= BLOCK_M) each byte of K and V is
read from memory once for the whole group. It streams
the key blocks of its split of the sequence's keys (positions 0 .. cache_seqlens[b] + seqlen_new - 1,
read through the block table when the cache is paged: one lookup per key block where BLOCK_N divides
the page size, one per run of PAGE_CHUNK keys otherwise) with the same online softmax as fwd.py.
With one split it normalises and writes out and lse itself; otherwise it writes its normalised
partial output and log-sum-exp to a float32 workspace, and attention_decode_combine_kernel merges
the splits with the log-sum-exp identity (weights exp(lse_s - lse), lse = log sum exp lse_s).
The final lse is stored only when the caller asked for it (STORE_LSE): a decode step that does not
return it then allocates nothing for it. A learnable sink (one natural-log logit per query head) enters once:
an unsplit program starts its rows' online softmax from it (HAS_SINK, common.initial_row_stats); split programs
attend their keys without it and the combine kernel adds it to the merge as one more term (lse_s = the sink,
o_s = 0).

A contiguous cache's row for sequence b is CacheBatchIdx[b] with HAS_BATCH_IDX (clamped into the cache), and with
HAS_LEFTPAD its keys start at position CacheLeftpad[b] of that row: the program then works on the keys
leftpad .. cache_seqlens[b] + seqlen_new - 1 as if they started at 0 (the row's base moves by leftpad rows), so
splits, bands and masks are those of a sequence of that many keys. Neither applies to paged caches.

Key positions are bottom-right aligned per sequence (query token i sits at position
length - seqlen_q + i), so causal and windows mean what they mean in flash_attn_with_kvcache. Key
blocks outside the band are skipped; every visited block applies the element mask (decoding is
bound by memory traffic, not by the mask).
"""

import triton
import triton.language as tl

from .common import finish_rows, initial_row_stats, online_softmax_step, program_coordinates, scores


@triton.jit
def attention_decode_kernel(
    Q, KCache, VCache, CacheSeqlens, BlockTable, CacheBatchIdx, CacheLeftpad, Slopes, Sink, Out, Lse, Part,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_table_b, stride_slopes_b,
    stride_ob, stride_om, stride_oh,
    nheads, nheads_k, group_size, seqlen_q, seqlen_new, capacity, page_size, num_blocks, blocks_per_split,
    num_splits, row_blocks, tile_rows, part_lse_start, score_scale, softcap_scale, softcap_out, window_left,
    window_right,
    HEADDIM: tl.constexpr, HEADDIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGED: tl.constexpr, PAGE_CHUNK: tl.constexpr,
    SPLIT: tl.constexpr, STORE_LSE: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    DOT_PRECISION: tl.constexpr, HAS_BATCH_IDX: tl.constexpr, HAS_LEFTPAD: tl.constexpr,
    HAS_SINK: tl.constexpr = False,
):
    tl.static_assert(not (HAS_SINK and SPLIT), "split programs leave the sink to the combine kernel")
    split, tile = program_coordinates(num_splits)
    row_block = tile % row_blocks
    pid_bhk = tile // row_blocks
    b = (pid_bhk // nheads_k).to(tl.int64)
    hk = (pid_bhk % nheads_k).to(tl.int64)
    # this sequence's keys, new tokens included; clamped to the capacity so that lengths the host did not
    # check (device tensors, see prepare_kvcache) can never make the program read outside the cache
    length = tl.minimum(tl.load(CacheSeqlens + b) + seqlen_new, capacity)
    # the cache row of this sequence (num_blocks is the number of rows of a contiguous cache) and the position its
    # keys start at, both clamped into the cache like the lengths; keys are then counted from that start
    cache_row = b
    if HAS_BATCH_IDX:
        cache_row = tl.minimum(tl.maximum(tl.load(CacheBatchIdx + b), 0), num_blocks - 1).to(tl.int64)
    key_start = b * 0
    if HAS_LEFTPAD:
        key_start = tl.maximum(tl.load(CacheLeftpad + b), 0).to(tl.int64)
        length = length - key_start
    diagonal_offset = length - seqlen_q

    # rows: (query head g of the group, query token i) -> row g * seqlen_q + i; BLOCK_M rows per program
    rows = row_block * BLOCK_M + tl.arange(0, BLOCK_M)
    g = rows // seqlen_q
    i = rows % seqlen_q
    row_ok = g < group_size
    h = hk * group_size + g
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q = tl.load(Q + b * stride_qb + h[:, None] * stride_qh + i[:, None].to(tl.int64) * stride_qm + offs_d[None, :],
                mask=row_ok[:, None] & (offs_d[None, :] < HEADDIM), other=0.0)
    slope = 0.0
    if HAS_ALIBI:
        slope = tl.load(Slopes + b * stride_slopes_b + h, mask=row_ok, other=0.0)[:, None]

    # this split's key blocks, trimmed to the band of the first and last query token
    lo = split * blocks_per_split * BLOCK_N
    hi = tl.minimum((split + 1) * blocks_per_split * BLOCK_N, length)
    if HAS_LEFT:
        lo = tl.maximum(lo, ((diagonal_offset - window_left) // BLOCK_N) * BLOCK_N)
    if HAS_RIGHT:
        hi = tl.minimum(hi, seqlen_q + diagonal_offset + window_right)
    # the tile's padding rows (g >= group_size) read head 0's sink and are never stored
    m_i, l_i = initial_row_stats(Sink, tl.where(row_ok, h, 0), BLOCK_M, HAS_SINK)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        key_ok = offs_n < length
        if PAGED and PAGE_CHUNK == BLOCK_N:
            # BLOCK_N divides the page size and blocks start on multiples of BLOCK_N, so the block lies in one
            # page, looked up once: its rows are then consecutive, as in a contiguous cache (a lookup per key
            # cost 15% at 8 x 128k with 16-key pages on an H200). Entries the host did not check are clamped
            # into the cache, never followed outside it
            block = tl.load(BlockTable + b * stride_table_b + n0 // page_size)
            block = tl.minimum(tl.maximum(block, 0), num_blocks - 1).to(tl.int64)
            within = (n0 % page_size + tl.arange(0, BLOCK_N)).to(tl.int64)
            k_rows = block * stride_kb + within * stride_kn
            v_rows = block * stride_vb + within * stride_vn
        elif PAGED:
            # pages smaller than the block: PAGE_CHUNK (which divides both) consecutive keys lie in one page, so
            # the block is BLOCK_N // PAGE_CHUNK runs of consecutive rows, one page lookup each (a vector load of
            # table entries; chunks past the sequence's end look nothing up and their keys are masked)
            chunk_start = n0 + tl.arange(0, BLOCK_N // PAGE_CHUNK) * PAGE_CHUNK
            block = tl.load(BlockTable + b * stride_table_b + chunk_start // page_size, mask=chunk_start < length,
                            other=0)
            block = tl.minimum(tl.maximum(block, 0), num_blocks - 1)
            # each key's block; the strides multiply it after the reshape, so the row offsets keep the strides'
            # known divisibility and the loads stay vectorised and pipelined (reshaping the offsets loses it)
            key_block = tl.reshape(tl.broadcast_to(block[:, None], (BLOCK_N // PAGE_CHUNK, PAGE_CHUNK)), (BLOCK_N,))
            key_block = key_block.to(tl.int64)
            within = (offs_n % page_size).to(tl.int64)
            k_rows = key_block * stride_kb + within * stride_kn
            v_rows = key_block * stride_vb + within * stride_vn
        else:
            k_rows = cache_row * stride_kb + (key_start + offs_n.to(tl.int64)) * stride_kn
            v_rows = cache_row * stride_vb + (key_start + offs_n.to(tl.int64)) * stride_vn
        k_t = tl.load(KCache + k_rows[None, :] + hk * stride_kh + offs_d[:, None],
                      mask=key_ok[None, :] & (offs_d[:, None] < HEADDIM), other=0.0)
        qk = tl.dot(q, k_t, input_precision=DOT_PRECISION)
        # scaled scores and the per-element band (UNSCALED and PER_ROW_BAND off): the forms this kernel was tuned
        # with; the per-row band cost it 18% at batch 64 with 256-key pages (common.band_mask)
        s, _ = scores(qk, i[:, None], offs_n[None, :], seqlen_q, length, score_scale, softcap_scale, softcap_out,
                      slope, diagonal_offset, window_left, window_right, None,
                      True, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, 0, False, False)
        v = tl.load(VCache + v_rows[:, None] + hk * stride_vh + offs_dv[None, :],
                    mask=key_ok[:, None] & (offs_dv[None, :] < HEADDIM_V), other=0.0)
        acc, l_i, m_i = online_softmax_step(acc, l_i, m_i, s, v, 1.0, True, 0, DOT_PRECISION, False)

    out, lse = finish_rows(acc, l_i, m_i)
    if SPLIT:
        # workspace Part: the partial outputs (batch * nheads_k, num_splits, tile_rows, BLOCK_DV), tile_rows =
        # group_size * seqlen_q, then from part_lse_start their lse (one allocation, no view made per call); the
        # combine kernel reads it back. The tile's padding rows are not stored: at 1 x 4k with 16-key pages (128
        # splits of 4 real rows in 16) they were three quarters of the workspace's writes
        part = (pid_bhk * num_splits + split).to(tl.int64) * tile_rows + rows
        tl.store(Part + part[:, None] * BLOCK_DV + offs_dv[None, :], out, mask=row_ok[:, None])
        tl.store(Part + part_lse_start + part, lse, mask=row_ok)
    else:
        tl.store(Out + b * stride_ob + h[:, None] * stride_oh + i[:, None].to(tl.int64) * stride_om
                 + offs_dv[None, :], out.to(Out.dtype.element_ty),
                 mask=row_ok[:, None] & (offs_dv[None, :] < HEADDIM_V))
        if STORE_LSE:
            tl.store(Lse + (b * nheads + h) * seqlen_q + i, lse, mask=row_ok)


@triton.jit
def attention_decode_combine_kernel(
    Part, Out, Lse, Sink,
    stride_ob, stride_om, stride_oh,
    nheads, nheads_k, group_size, seqlen_q, num_splits, tile_rows, part_lse_start,
    HEADDIM_V: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_S: tl.constexpr, STORE_LSE: tl.constexpr,
    HAS_SINK: tl.constexpr = False,
):
    """One program per (row of the tile, batch * K/V head), along grid axis 0: out = sum_s exp(lse_s - lse) o_s,
    lse = log(sum_s exp(lse_s)), with HAS_SINK the row's head's sink as one more term of the sum (its o_s is 0)."""
    row, pid_bhk = program_coordinates(tile_rows)
    g = row // seqlen_q
    if g < group_size:
        i = row % seqlen_q
        b = (pid_bhk // nheads_k).to(tl.int64)
        h = (pid_bhk % nheads_k).to(tl.int64) * group_size + g
        splits = tl.arange(0, BLOCK_S)
        split_ok = splits < num_splits
        part = (pid_bhk * num_splits + splits).to(tl.int64) * tile_rows + row
        lses = tl.load(Part + part_lse_start + part, mask=split_ok, other=float("-inf"))
        top = tl.max(lses, 0)
        if HAS_SINK:
            sink = tl.load(Sink + h).to(tl.float32)  # natural log, as the lses
            top = tl.maximum(top, sink)
        top = tl.where(top == float("-inf"), 0.0, top)  # no split saw a key (and no sink): weights 0, out 0
        weights = tl.exp(lses - top)
        total = tl.sum(weights, 0)
        if HAS_SINK:
            total += tl.exp(sink - top)  # the sink's term of the denominator: it adds nothing to out
        offs_dv = tl.arange(0, BLOCK_DV)
        parts = tl.load(Part + part[:, None] * BLOCK_DV + offs_dv[None, :], mask=split_ok[:, None], other=0.0)
        out = tl.sum(parts * weights[:, None], 0) / tl.where(total > 0, total, 1.0)
        lse = tl.where(total > 0, top + tl.log(tl.where(total > 0, total, 1.0)), float("-inf"))
        tl.store(Out + b * stride_ob + h * stride_oh + i.to(tl.int64) * stride_om + offs_dv,
                 out.to(Out.dtype.element_ty), mask=offs_dv < HEADDIM_V)
        if STORE_LSE:
            tl.store(Lse + (b * nheads + h) * seqlen_q + i, lse)
