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

The decode schedule's host side follows the kernels: its tiles per cache layout (DecodeTile, default_decode_tile),
how a call covers the GPU (decode_geometry, choose_num_splits), the launch plan fixed per validated layout, decode()
itself, and forward_by_decode, which runs a flash_attn_func call of a few query rows by these kernels.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .._validate import AttentionProblem
from ..errors import BackendUnavailableError
from . import configs
from .common import finish_rows, initial_row_stats, online_softmax_step, program_coordinates, scores
from .host import (cdiv, dot_precision, forward_widths, next_power_of_2, program_grid, row_strides, score_constants,
                   sink_arg, slopes_arg, sm_count)
from .relaunch import FixedLaunch, launch_fixed


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


def choose_num_splits(programs: int, key_blocks: int, sm_count: int, waves: int = 4, min_blocks: int = 4,
                      max_splits: int = 64) -> int:
    """Flash-Decoding's split count: as many programs as fit in `waves` programs per SM, never a few more
    (at batch 8 x 8 K/V heads on an H200, 8 splits, 512 programs, read the cache up to 8% faster than 9,
    576, contiguous and 16-key pages alike, with one tie), each split keeping at least `min_blocks` key blocks
    (so the merge stays cheap next to the reads), at most `max_splits` splits (a tile's own limits, DecodeTile)."""
    if programs >= sm_count:
        return 1
    wanted = waves * sm_count // max(1, programs)
    return max(1, min(wanted, key_blocks // min_blocks, max_splits))


@dataclass(frozen=True)
class DecodeTile:
    """The decode kernel's tile for one cache layout: keys per block, warps, pipeline stages, the waves of
    programs the split count aims for, and the split count's limits (key blocks a split keeps at least, splits at
    most; choose_num_splits). In a paged cache a key block looks its page up once where block_n divides the page
    size, else once per run of gcd(block_n, page_size) keys (both are multiples of 16)."""

    block_n: int
    num_warps: int
    num_stages: int
    waves: int
    min_blocks_per_split: int = 4
    max_splits: int = 64


# Decode tiles. Why each, with its measurements: docs/decode.md (paged reads) and docs/tuning.md (the tiles); numbers
# from benchmarks/tune_decode.py on an H200 (bf16, d = 128, 32 query heads on 8 K/V heads, kernels from CUDA graphs),
# raw results in benchmarks/results/raw/ under the names given.
# Unsplit launches, contiguous or paged: 64-key blocks, 2 stages (3 lost 5-25% at batch 8 and 64), about four waves;
# a block over smaller pages looks up each page it spans (pages of 16, 64 x 32k: 1,963 us against 2,033 for 16-key
# blocks). Raw: 2026-11-29-h200-tune-decode.txt, 2026-11-30-h200-s16-call4-page16-tiles.txt
DECODE_TILE = DecodeTile(block_n=64, num_warps=4, num_stages=2, waves=4)
# Split launches over pages of a multiple of 64 keys: the same tile, one page lookup per block, down to 2 key blocks a
# split so that short caches get more programs (1 x 4k: 9.3 us at 32 splits against 10.2 at 16).
# Raw: 2026-11-30-h200-s15-call2-varlen-fix-decode-tiles.txt, 2026-12-01-h200-s19-call3-variants.txt
DECODE_TILE_LARGE_PAGES_SPLIT = DecodeTile(block_n=64, num_warps=4, num_stages=2, waves=4, min_blocks_per_split=2)
# Split launches over a contiguous cache: 3 stages at about two waves, two programs per SM with more bytes in flight
# each (up to 7% faster at batch 1 and 8); not for paged caches, whose page lookups need more programs in flight.
# Raw: 2026-11-30-h200-s16-call2-decode-stages-packed-d64.txt
DECODE_TILE_CONTIGUOUS_SPLIT = DecodeTile(block_n=64, num_warps=4, num_stages=3, waves=2)
# Split launches over other pages (every page size is a multiple of 16): 16-key blocks, one lookup each, 2 warps and
# 8 stages so that enough copies stay in flight (pages of 16, 8 x 128k: 1,008 us against 1,196 with a lookup per key).
# Raw: 2026-11-30-h200-s12-call2-page16-tiles.txt
DECODE_TILE_SMALL_PAGES = DecodeTile(block_n=16, num_warps=2, num_stages=8, waves=4)
# Short caches in such pages, where DECODE_TILE_SMALL_PAGES would leave a split no more key blocks than stages (the
# pipeline never fills): 4 stages, eight waves, down to 2 key blocks a split, up to 128 splits (pages of 16, 1 x 4k:
# 10.0 us against 10.9). Raw: 2026-11-30-h200-s18-call8-smallpages.txt, 2026-11-30-h200-s18-call9-variants.txt
DECODE_TILE_SHORT_SMALL_PAGES = DecodeTile(block_n=16, num_warps=2, num_stages=4, waves=8, min_blocks_per_split=2,
                                           max_splits=128)


def page_chunk(block_n: int, page_size: int | None) -> int:
    """Keys per page lookup in a key block (the decode kernel's PAGE_CHUNK): block_n where it divides the page size
    (and for a contiguous cache), else the runs of gcd(block_n, page_size) keys that lie in one page."""
    return math.gcd(block_n, page_size or block_n)


def default_decode_tile(page_size: int | None, split: bool = False) -> DecodeTile:
    """The decode tile for a contiguous cache (page_size None) or a paged one; split: whether the launch splits
    each sequence's keys (a contiguous cache, and pages that are not a multiple of 64 keys, then take their own)."""
    if page_size is None:
        return DECODE_TILE_CONTIGUOUS_SPLIT if split else DECODE_TILE
    if not split:
        return DECODE_TILE
    if page_size % DECODE_TILE.block_n == 0:
        return DECODE_TILE_LARGE_PAGES_SPLIT
    return DECODE_TILE_SMALL_PAGES


@dataclass(frozen=True)
class DecodeGeometry:
    """How attention_decode_kernel covers a KV-cache call: rows per program (a GQA group's query heads x
    query tokens), keys per block, the split of each sequence's key blocks, warps and pipeline stages."""

    block_m: int
    row_blocks: int
    block_n: int
    splits: int
    blocks_per_split: int
    num_warps: int
    num_stages: int

    def describe(self) -> str:
        merge = " + attention_decode_combine_kernel" if self.splits > 1 else ""
        return (f"attention_decode_kernel{merge}: {self.row_blocks} x {self.block_m} rows per (batch, K/V head) "
                f"(query heads of a group x query tokens), {self.block_n}-key blocks, {self.splits} split(s) of "
                f"up to {self.blocks_per_split} blocks, {self.num_warps} warps, {self.num_stages} stages")


@functools.lru_cache(maxsize=256)
def decode_geometry(problem: AttentionProblem, page_size: int | None, num_splits: int,
                    tile: DecodeTile | None = None) -> DecodeGeometry:
    """The launch shape for a KV-cache problem (problem.seqlen_k is the cache capacity); tile overrides
    the layout's default. Cached: a decode loop asks for the same geometry at every step."""
    rows = problem.group_size * problem.seqlen_q
    block_m = min(64, max(16, next_power_of_2(rows)))
    row_blocks = cdiv(rows, block_m)

    def key_blocks_and_splits(tile: DecodeTile) -> tuple[int, int]:
        key_blocks = max(1, cdiv(problem.seqlen_k, tile.block_n))
        return key_blocks, num_splits or choose_num_splits(problem.batch * problem.nheads_k * row_blocks, key_blocks,
                                                           sm_count(problem.device), tile.waves,
                                                           tile.min_blocks_per_split, tile.max_splits)

    if tile is None:
        # the layout's tile for split launches where the keys do end up split, else its unsplit tile
        tile = default_decode_tile(page_size, split=True)
        key_blocks, splits = key_blocks_and_splits(tile)
        if splits == 1:
            tile = default_decode_tile(page_size)
        elif tile is DECODE_TILE_SMALL_PAGES and cdiv(key_blocks, splits) <= tile.num_stages:
            tile = DECODE_TILE_SHORT_SMALL_PAGES
    key_blocks, splits = key_blocks_and_splits(tile)
    blocks_per_split = cdiv(key_blocks, max(1, min(splits, key_blocks)))
    return DecodeGeometry(block_m, row_blocks, tile.block_n, cdiv(key_blocks, blocks_per_split),
                          blocks_per_split, tile.num_warps, tile.num_stages)


@dataclass(frozen=True)
class _DecodePlan:
    """Everything a KV-cache call's launches take but the tensors, for one validated layout (see decode())."""

    grid: tuple  # three ints
    kernel: FixedLaunch  # attention_decode_kernel with its strides, sizes, score scalars and constexprs
    combine_grid: tuple
    combine: FixedLaunch | None  # attention_decode_combine_kernel, when the keys are split
    out_shape: tuple
    lse_shape: tuple | None  # None: the caller did not ask for lse, and the kernels do not store it
    part_floats: int  # floats of the split partial outputs followed by their lse (0 when not split)
    dtype: torch.dtype  # q's, and out's
    device: torch.device


def _decode_plan(call, num_splits: int, geometry: DecodeGeometry | None, precision: str, slopes_stride: int,
                 table: torch.Tensor) -> _DecodePlan:
    """decode()'s launch plan, built from the first call of a layout (a layout's signature fixes every stride
    and size read here: q's, the caches', the block table's, the slopes')."""
    p, q, k_cache, v_cache = call.problem, call.q, call.k_cache, call.v_cache
    batch, seqlen_q = q.shape[:2]
    shape = geometry or decode_geometry(p, call.page_size, num_splits)
    scalars, flags = score_constants(p, 0, precision)
    flags = forward_widths(flags)
    # a KV cache takes no attn_mask; and the decode kernel keeps its scores scaled and masked per element (see
    # decode.py: memory-bound, it gains nothing from the fused exponent, and the per-row band cost it 18% at batch 64)
    del flags["MASK_KIND"], flags["SCALE_IN_EXP2"]
    _, score_scale, softcap_scale, softcap_out, _, window_left, window_right = scalars
    out_shape = (batch, seqlen_q, p.nheads, p.headdim_v)
    out_strides = row_strides(torch.empty(out_shape, device="meta"), 1)  # decode() allocates out contiguous
    tile_rows = p.group_size * seqlen_q  # the rows of a (batch, K/V head) tile that exist (not its padding)
    # the split partials: outputs (batch * nheads_k, splits, tile_rows, BLOCK_DV), then their lse from part_lse_start
    partial_rows = batch * p.nheads_k * shape.splits * tile_rows if shape.splits > 1 else 0
    part_lse_start = partial_rows * flags["BLOCK_DV"]
    seqlen_new = 0 if call.k_new is None else call.k_new.shape[1]
    store_lse = call.layout.return_lse
    kernel = FixedLaunch(
        attention_decode_kernel,
        (*row_strides(q, 1), *row_strides(k_cache, 1), *row_strides(v_cache, 1), table.stride(0), slopes_stride,
         *out_strides, p.nheads, p.nheads_k, p.group_size, seqlen_q, seqlen_new, call.capacity,
         call.page_size or 1, k_cache.shape[0], shape.blocks_per_split, shape.splits, shape.row_blocks, tile_rows,
         part_lse_start, score_scale,
         softcap_scale, softcap_out, window_left, window_right),
        dict(BLOCK_M=shape.block_m, BLOCK_N=shape.block_n, PAGED=call.page_size is not None,
             PAGE_CHUNK=page_chunk(shape.block_n, call.page_size),
             SPLIT=shape.splits > 1, STORE_LSE=store_lse, HAS_BATCH_IDX=call.cache_batch_idx is not None,
             HAS_LEFTPAD=call.cache_leftpad is not None,
             # the sink enters once: here when the keys are not split, else in the combine kernel's merge
             HAS_SINK=p.has_sink and shape.splits == 1,
             num_warps=shape.num_warps, num_stages=shape.num_stages, **flags))
    combine = None
    if shape.splits > 1:
        combine = FixedLaunch(
            attention_decode_combine_kernel,
            (*out_strides, p.nheads, p.nheads_k, p.group_size, seqlen_q, shape.splits, tile_rows, part_lse_start),
            dict(HEADDIM_V=p.headdim_v, BLOCK_DV=flags["BLOCK_DV"], BLOCK_S=next_power_of_2(shape.splits),
                 STORE_LSE=store_lse, HAS_SINK=p.has_sink))
    # one-axis grids (common.program_coordinates), kept as three ints for the relaunch
    return _DecodePlan((*program_grid(shape.splits * shape.row_blocks * batch * p.nheads_k), 1, 1), kernel,
                       (*program_grid(tile_rows * batch * p.nheads_k), 1, 1), combine, out_shape,
                       (batch, p.nheads, seqlen_q) if store_lse else None, part_lse_start + partial_rows, q.dtype,
                       q.device)


# Plans by (validated layout, split request, geometry override, dot precision). A layout is compared by
# identity and held by its key here, so a plan is never found for another layout's tensors.
_DECODE_PLANS: dict = {}
MAX_DECODE_PLANS = 1024


def decode(call, num_splits: int, geometry: DecodeGeometry | None = None):
    """Attention over a KV cache (kvcache.KVCacheCall, new tokens already appended): returns out
    (batch, seqlen_q, nheads, headdim_v) in q's dtype and lse (batch, nheads, seqlen_q) float32, or None
    for lse when the call did not ask for it (call.layout.return_lse).

    num_splits 0 lets choose_num_splits decide; the count is capped by the number of key blocks.
    geometry overrides decode_geometry's choice (for tuning scripts). Nothing is read back from the GPU.
    The launch constants (strides, sizes, score scalars, constexprs) are computed once per validated
    layout (call.layout) and reused: a decode loop's steps differ only in their tensors.
    """
    q = call.q
    precision = dot_precision(q.dtype)
    key = (call.layout, num_splits, geometry, precision)
    slopes, slopes_stride = slopes_arg(q, call.alibi_slopes)
    sink = sink_arg(q, call.learnable_sink)
    table = call.block_table if call.block_table is not None else call.cache_seqlens  # never read if contiguous
    plan = _DECODE_PLANS.get(key)
    if plan is None:
        if len(_DECODE_PLANS) >= MAX_DECODE_PLANS:
            _DECODE_PLANS.clear()
        plan = _DECODE_PLANS[key] = _decode_plan(call, num_splits, geometry, precision, slopes_stride, table)
    out = torch.empty(plan.out_shape, dtype=plan.dtype, device=plan.device)
    lse = None if plan.lse_shape is None else torch.empty(plan.lse_shape, dtype=torch.float32, device=plan.device)
    if plan.out_shape[0] == 0:
        return out, lse
    lse_arg = out if lse is None else lse  # never written without STORE_LSE
    # one allocation for the partial outputs and their lse (a host-bound decode step feels each torch.empty)
    part = lse_arg if plan.combine is None else torch.empty(plan.part_floats, dtype=torch.float32, device=plan.device)
    # absent index tensors are passed as cache_seqlens (int32, never read)
    batch_idx = call.cache_seqlens if call.cache_batch_idx is None else call.cache_batch_idx
    leftpad = call.cache_seqlens if call.cache_leftpad is None else call.cache_leftpad
    launch_fixed(plan.kernel, plan.grid, (q, call.k_cache, call.v_cache, call.cache_seqlens, table, batch_idx, leftpad,
                                          slopes, sink, out, lse_arg, part))
    if plan.combine is not None:
        launch_fixed(plan.combine, plan.combine_grid, (part, out, lse_arg, sink))
    return out, lse


def forward_by_decode(q, k, v, alibi_slopes, problem: AttentionProblem, learnable_sink=None):
    """A dense call's forward by the decode kernels (forward schedule 5, configs.decode_forward): k and v (batch,
    seqlen_k, nheads_k, dim) as full KV caches of seqlen_k keys, as flash_attn_with_kvcache(q, k, v,
    cache_seqlens=seqlen_k) runs them, whose band rule (aligned to each sequence's last key) is the call's. Returns
    out, lse as forward(). Raises BackendUnavailableError for a call the decode kernels do not serve (a tile setting
    that forces the schedule onto one)."""
    from .._validate import prepare_kvcache  # the KV cache's validation: its layouts key the decode plans

    p = problem
    reason = configs.decode_forward_unserved_reason(p)
    if reason:
        raise BackendUnavailableError(f"forward_schedule=5 of backend 'triton' cannot serve this call: {reason}")
    # alibi_slopes comes as (batch or 1, nheads); the KV cache takes (nheads,) or (batch, nheads)
    slopes = alibi_slopes[0] if alibi_slopes is not None and alibi_slopes.shape[0] == 1 else alibi_slopes
    call = prepare_kvcache(q, k, v, None, None, p.seqlen_k, None, softmax_scale=p.softmax_scale, causal=False,
                           window_size=(p.window_left, p.window_right), softcap=p.softcap, alibi_slopes=slopes,
                           num_splits=0, return_softmax_lse=True, check_values=False, learnable_sink=learnable_sink)
    return decode(call, 0)
