"""The KV-cache append of flash_attn_with_kvcache, with its rotary embeddings, in one Triton launch.

kvcache_append_kernel writes the new keys and values into the cache; with ROTARY it first rotates q and the new keys
by their positions (the rotated keys are what it writes), so that a decode step costs one small launch before the
attention kernel, with rotary tables or without.

Grid: axis 0 holds, with ROTARY, one program per query row (batch * seqlen_q, row b * seqlen_q + i), then one per new
token (batch * seqlen_new, row b * seqlen_new + t); axis 1 the blocks of BLOCK_H heads. With ROTARY a program reads
its position's row of the cos and sin tables once and rotates every head of its block:

    query row i of sequence b:   cache_seqlens[b] + i with Q_SHIFTED (causal or a window), else cache_seqlens[b]
    new token t of sequence b:   cache_seqlens[b] + t

each clamped into the tables (rows 0 .. rotary_len - 1), so unchecked positions past the tables read their last row
and never outside them. Pair j of a head, (2j, 2j + 1) with INTERLEAVED (GPT-J) or (j, j + ROTARY_HALF) (GPT-NeoX),
turns by the angle of column j: (a, b) -> (a cos - b sin, a sin + b cos), in float32 with every product and sum
rounded as torch's eager ops round them (the launcher compiles without FMA contraction), then rounded once to the
output's dtype; the dims from 2 * ROTARY_HALF to HEADDIM are copied. The result is bit-identical to
flashtile.kvcache.rotate for fp16, bf16 and fp32 inputs with float32 or same-dtype tables.

A query program writes the rotated row to QOut (a new tensor). A new-token program writes its keys (rotated with
ROTARY, else as given) to KCache and its values, unrotated, to VCache at the token's position: row CacheBatchIdx[b]
(HAS_BATCH_IDX; else b) of a contiguous cache, or slot position % page_size of block BlockTable[b, position //
page_size] of a paged one (PAGED). A position outside 0 .. capacity - 1, a row or block outside the cache drops the
token's writes: unchecked values can never make the kernel write outside the caches.

Without ROTARY the kernel copies bits (any dtype the cache holds) and never reads Q, Cos, Sin or QOut. Limitations:
float32 rotation only (no float64: the Triton backend does not take it); nothing is returned for the rotated new keys
other than the cache entries.

The launcher, append_to_cache, follows the kernel: one launch per call, fixed per validated cache layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .host import cdiv, next_power_of_2, program_grid, row_strides
from .relaunch import FixedLaunch, launch_fixed


@triton.jit
def _round_to(x, DTYPE: tl.constexpr):
    """float32 x rounded to nearest even in DTYPE."""
    if DTYPE == tl.bfloat16:
        # torch's rounding (c10's round_to_nearest_even) in integers: the GPU's own conversion gives the same bits for
        # every number, but Triton's CPU interpreter truncates float32 -> bfloat16 casts (triton 3.9.0, 2026-12)
        bits = x.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        rounded = tl.where(x != x, 0x7FC0, rounded)  # NaN stays a NaN
        return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(DTYPE)


@triton.jit
def _rotate_heads(Src, stride_src_h, stride_src_d, Dst, stride_dst_h, heads, head_block, cos, sin,
                  HEADDIM: tl.constexpr, ROTARY_HALF: tl.constexpr, INTERLEAVED: tl.constexpr,
                  BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr):
    """Rotate the first 2 * ROTARY_HALF dims of heads head_block * BLOCK_H .. heads - 1 of one (token, heads, dim)
    row at Src by cos, sin (BLOCK_R float32) and copy the rest, into Dst (unit-stride dims)."""
    h = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    j = tl.arange(0, BLOCK_R)
    head_ok = (h < heads)[:, None]
    pair_ok = head_ok & (j < ROTARY_HALF)[None, :]
    if INTERLEAVED:
        first, second = 2 * j, 2 * j + 1
    else:
        first, second = j, j + ROTARY_HALF
    src = Src + h[:, None].to(tl.int64) * stride_src_h
    dst = Dst + h[:, None].to(tl.int64) * stride_dst_h
    x1 = tl.load(src + first[None, :] * stride_src_d, mask=pair_ok, other=0.0).to(tl.float32)
    x2 = tl.load(src + second[None, :] * stride_src_d, mask=pair_ok, other=0.0).to(tl.float32)
    c, s = cos[None, :], sin[None, :]
    # (x1 + i x2) (cos + i sin), each product rounded before the sum as in torch's eager rotate
    out1 = x1 * c - x2 * s
    out2 = x1 * s + x2 * c
    tl.store(dst + first[None, :], _round_to(out1, Dst.dtype.element_ty), mask=pair_ok)
    tl.store(dst + second[None, :], _round_to(out2, Dst.dtype.element_ty), mask=pair_ok)
    if 2 * ROTARY_HALF < HEADDIM:  # the dims past rotary_dim pass through
        p = 2 * ROTARY_HALF + tl.arange(0, BLOCK_P)
        pass_ok = head_ok & (p < HEADDIM)[None, :]
        rest = tl.load(src + p[None, :] * stride_src_d, mask=pass_ok, other=0.0)
        tl.store(dst + p[None, :], rest, mask=pass_ok)


@triton.jit
def _copy_heads(Src, stride_src_h, stride_src_d, Dst, stride_dst_h, heads, head_block,
                DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_DIM: tl.constexpr):
    """Copy heads head_block * BLOCK_H .. heads - 1 of one (token, heads, DIM) row at Src into Dst (unit-stride
    dims)."""
    h = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_DIM)
    ok = (h < heads)[:, None] & (d < DIM)[None, :]
    row = tl.load(Src + h[:, None].to(tl.int64) * stride_src_h + d[None, :] * stride_src_d, mask=ok, other=0.0)
    tl.store(Dst + h[:, None].to(tl.int64) * stride_dst_h + d[None, :], row, mask=ok)


@triton.jit
def _table_row(Cos, Sin, position, rotary_len, stride_cos_p, stride_cos_j, stride_sin_p, stride_sin_j,
               ROTARY_HALF: tl.constexpr, BLOCK_R: tl.constexpr):
    """cos, sin (BLOCK_R float32) of a position, clamped into the tables' rows."""
    row = tl.minimum(tl.maximum(position, 0), rotary_len - 1)
    j = tl.arange(0, BLOCK_R)
    ok = j < ROTARY_HALF
    cos = tl.load(Cos + row * stride_cos_p + j * stride_cos_j, mask=ok, other=0.0).to(tl.float32)
    sin = tl.load(Sin + row * stride_sin_p + j * stride_sin_j, mask=ok, other=0.0).to(tl.float32)
    return cos, sin


@triton.jit
def kvcache_append_kernel(
    Q, KNew, VNew, Cos, Sin, CacheSeqlens, BlockTable, CacheBatchIdx, QOut, KCache, VCache,
    stride_qb, stride_qm, stride_qh,
    stride_knb, stride_knm, stride_knh, stride_knd,
    stride_vnb, stride_vnm, stride_vnh, stride_vnd,
    stride_cos_p, stride_cos_j, stride_sin_p, stride_sin_j,
    stride_qob, stride_qom, stride_qoh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_table_b,
    batch, seqlen_q, seqlen_new, nheads, nheads_k, rotary_len, capacity, page_size, cache_rows,
    HEADDIM: tl.constexpr, HEADDIM_V: tl.constexpr, ROTARY_HALF: tl.constexpr, INTERLEAVED: tl.constexpr,
    ROTARY: tl.constexpr, Q_SHIFTED: tl.constexpr, PAGED: tl.constexpr, HAS_BATCH_IDX: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    tl.static_assert(2 * ROTARY_HALF <= HEADDIM, "rotary_dim must not exceed the head dim")
    tl.static_assert(BLOCK_R >= ROTARY_HALF and BLOCK_DV >= HEADDIM_V, "a block narrower than its dims")
    row = tl.program_id(0)
    head_block = tl.program_id(1)
    q_rows = batch * seqlen_q if ROTARY else 0  # without tables q is not touched: every program is a new token
    if row < q_rows:
        b = (row // seqlen_q).to(tl.int64)
        i = row % seqlen_q
        position = tl.load(CacheSeqlens + b).to(tl.int64)
        if Q_SHIFTED:
            position += i
        cos, sin = _table_row(Cos, Sin, position, rotary_len, stride_cos_p, stride_cos_j, stride_sin_p, stride_sin_j,
                              ROTARY_HALF, BLOCK_R)
        _rotate_heads(Q + b * stride_qb + i * stride_qm, stride_qh, 1, QOut + b * stride_qob + i * stride_qom,
                      stride_qoh, nheads, head_block, cos, sin, HEADDIM, ROTARY_HALF, INTERLEAVED,
                      BLOCK_H, BLOCK_R, BLOCK_P)
    else:
        token = row - q_rows
        b = (token // seqlen_new).to(tl.int64)
        t = token % seqlen_new
        position = tl.load(CacheSeqlens + b).to(tl.int64) + t
        # where the token goes: (cache row or block, slot); positions and indices outside the cache write nothing
        inside = (position >= 0) & (position < capacity)
        slot_position = tl.minimum(tl.maximum(position, 0), capacity - 1)
        if PAGED:
            cache_row = tl.load(BlockTable + b * stride_table_b + slot_position // page_size).to(tl.int64)
            slot = slot_position % page_size
        else:
            cache_row = b
            if HAS_BATCH_IDX:
                cache_row = tl.load(CacheBatchIdx + b).to(tl.int64)
            slot = slot_position
        # a token that is not written has no heads to rotate or copy
        heads = tl.where(inside & (cache_row >= 0) & (cache_row < cache_rows), nheads_k, 0)
        if ROTARY:
            cos, sin = _table_row(Cos, Sin, position, rotary_len, stride_cos_p, stride_cos_j, stride_sin_p,
                                  stride_sin_j, ROTARY_HALF, BLOCK_R)
            _rotate_heads(KNew + b * stride_knb + t * stride_knm, stride_knh, stride_knd,
                          KCache + cache_row * stride_kb + slot * stride_kn, stride_kh, heads, head_block, cos, sin,
                          HEADDIM, ROTARY_HALF, INTERLEAVED, BLOCK_H, BLOCK_R, BLOCK_P)
        else:
            _copy_heads(KNew + b * stride_knb + t * stride_knm, stride_knh, stride_knd,
                        KCache + cache_row * stride_kb + slot * stride_kn, stride_kh, heads, head_block, HEADDIM,
                        BLOCK_H, BLOCK_P)
        _copy_heads(VNew + b * stride_vnb + t * stride_vnm, stride_vnh, stride_vnd,
                    VCache + cache_row * stride_vb + slot * stride_vn, stride_vh, heads, head_block, HEADDIM_V, BLOCK_H,
                    BLOCK_DV)


# Elements of one (heads x dims) tile of kvcache_append_kernel: a block of heads per program, all of a GQA group's K/V
# heads and the 32 query heads of a d = 128 model in one program
APPEND_TILE_ELEMENTS = 4096


@dataclass(frozen=True)
class _AppendPlan:
    """append_to_cache()'s launch, fixed per validated layout like a decode plan."""

    grid: tuple  # three ints
    kernel: FixedLaunch  # kvcache_append_kernel with its strides, sizes and constexprs
    rotary: bool  # the call has rotary tables: q is rotated into a new tensor of q_shape
    q_shape: tuple
    dtype: torch.dtype
    device: torch.device


def _new_tokens(call) -> tuple:
    """The call's new keys and values, or empty views of the cache where it has none (rotary tables rotate q alone)."""
    if call.k_new is None:
        return call.k_cache[:, :0], call.v_cache[:, :0]
    return call.k_new, call.v_new


def _append_plan(call) -> _AppendPlan:
    q, k_cache, v_cache = call.q, call.k_cache, call.v_cache
    k_new, v_new = _new_tokens(call)
    layout = call.layout
    rotary = call.rotary_cos is not None
    batch, seqlen_q, nheads, headdim = q.shape
    seqlen_new, nheads_k, headdim_v = k_new.shape[1], k_new.shape[2], v_new.shape[3]
    half = layout.rotary_dim // 2 if rotary else 0
    # a block of heads covers the query heads with tables (its programs rotate q), the K/V heads without
    block_h = min(next_power_of_2(nheads if rotary else nheads_k),
                  max(1, APPEND_TILE_ELEMENTS // next_power_of_2(max(headdim, headdim_v))))
    out_strides = row_strides(torch.empty(q.shape, device="meta"), 1)  # append_to_cache allocates it contiguous
    table_stride = call.block_table.stride(0) if call.block_table is not None else 0
    table_strides = (*call.rotary_cos.stride(), *call.rotary_sin.stride()) if rotary else (0, 0, 0, 0)
    kernel = FixedLaunch(
        kvcache_append_kernel,
        (*row_strides(q, 1), *k_new.stride(), *v_new.stride(), *table_strides, *out_strides,
         *row_strides(k_cache, 1), *row_strides(v_cache, 1), table_stride,
         batch, seqlen_q, seqlen_new, nheads, nheads_k, layout.rotary_len if rotary else 1, call.capacity,
         call.page_size or 1, k_cache.shape[0]),
        dict(HEADDIM=headdim, HEADDIM_V=headdim_v, ROTARY_HALF=half, INTERLEAVED=rotary and layout.rotary_interleaved,
             ROTARY=rotary, Q_SHIFTED=rotary and layout.rotary_shifted, PAGED=call.page_size is not None,
             HAS_BATCH_IDX=call.cache_batch_idx is not None, BLOCK_H=block_h, BLOCK_R=next_power_of_2(max(1, half)),
             BLOCK_P=next_power_of_2(max(1, headdim - 2 * half)), BLOCK_DV=next_power_of_2(headdim_v),
             num_warps=4,
             # every product and sum rounded on its own, as torch's eager rotate rounds them: the same bits
             enable_fp_fusion=False))
    rows = batch * (seqlen_q + seqlen_new) if rotary else batch * seqlen_new
    grid = (*program_grid(rows), cdiv(nheads if rotary else nheads_k, block_h), 1)
    return _AppendPlan(grid, kernel, rotary, tuple(q.shape), q.dtype, q.device)


# Append plans by validated layout (compared by identity, as _DECODE_PLANS)
_APPEND_PLANS: dict = {}
MAX_APPEND_PLANS = 1024  # validated layouts whose plans are kept (then the cache starts over)


def append_to_cache(call) -> None:
    """Append the new keys and values of a KV-cache call (kvcache.KVCacheCall) to its cache in one launch of
    kvcache_append_kernel; with rotary tables the same launch rotates q and the new keys first.

    Writes k_cache / v_cache in place at positions cache_seqlens[b] .. cache_seqlens[b] + seqlen_new - 1. With tables
    it replaces call.q by a new contiguous (batch, seqlen_q, nheads, headdim) tensor in q's dtype holding the rotated
    queries (the caller's q is not modified); call.k_new keeps the caller's unrotated keys: after the append only its
    length is read. The same bits as kvcache.apply_rotary then kvcache.append_to_cache for fp16, bf16 and fp32,
    except that an append outside the cache (values check_values did not check) is dropped instead of stopping at
    torch's index check. Nothing is read back from the GPU.
    """
    if call.k_new is None and call.rotary_cos is None:
        return
    plan = _APPEND_PLANS.get(call.layout)
    if plan is None:
        if len(_APPEND_PLANS) >= MAX_APPEND_PLANS:
            _APPEND_PLANS.clear()
        plan = _APPEND_PLANS[call.layout] = _append_plan(call)
    # without tables q is never read or written: an absent tensor is passed as cache_seqlens (int32, never read)
    q_out = torch.empty(plan.q_shape, dtype=plan.dtype, device=plan.device) if plan.rotary else call.cache_seqlens
    if plan.grid[0]:
        table = call.cache_seqlens if call.block_table is None else call.block_table
        batch_idx = call.cache_seqlens if call.cache_batch_idx is None else call.cache_batch_idx
        cos, sin = (call.rotary_cos, call.rotary_sin) if plan.rotary else (call.cache_seqlens, call.cache_seqlens)
        launch_fixed(plan.kernel, plan.grid, (call.q, *_new_tokens(call), cos, sin, call.cache_seqlens, table,
                                              batch_idx, q_out, call.k_cache, call.v_cache))
    if plan.rotary:
        call.q = q_out
