"""Launchers: allocate outputs, compute grids, pass strides, pick constexprs for the Triton kernels.

The entry points the backend calls (_dispatch.TritonBackend): forward, paged_varlen_forward and backward here, and
the decode schedule's decode and decode_geometry (decode.py) and the KV-cache append's append_to_cache (append.py),
which this module passes on. Host-side arguments every launcher shares are in host.py.

Layout contract (shared with the torch backend): q (batch, seqlen_q, nheads, headdim), k and v
(batch, seqlen_k, nheads_k, headdim[_v]) with unit-stride last dims and any other strides;
out (batch, seqlen_q, nheads, headdim_v) and gradients are returned contiguous in the inputs'
dtype; lse (batch, nheads, seqlen_q) is contiguous float32, natural log. A learnable sink (nheads,) reaches the
forward kernels (the Gluon one too) as a contiguous array (HAS_SINK), the decode kernels likewise (split launches:
only the combine kernel takes it), and its gradient comes from the backward's delta and lse (flashtile._sink); the
backward kernels need nothing of it (the lse they read includes it).
"""

from __future__ import annotations

import functools
import heapq
import warnings

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from .. import _dropout
from .._geometry import visible_key_range
from .._sink import sink_gradient
from .._validate import AttentionProblem
from .bwd import (attention_bwd_dkdv_kernel, attention_bwd_dq_kernel, attention_bwd_kernel,
                  attention_bwd_preprocess_kernel)
from . import configs
from .configs import GluonTile, TritonTiles, interpreting
from .decode import decode, decode_geometry, forward_by_decode  # noqa: F401 - decode, decode_geometry: entry points
from ..errors import BackendUnavailableError
from .fwd import attention_fwd_kernel
from .fwd_fa1 import launch_fa1
from .fwd_tma import attention_fwd_tma_kernel
from . import gluon_compat
from .bwd_gluon import WARPGROUP_KEYS, attention_bwd_dkdv_gluon_kernel
from .bwd_gluon_fused import attention_bwd_dq_convert_kernel, attention_bwd_fused_gluon_kernel
from .fwd_gluon import WARPGROUP_ROWS, attention_fwd_gluon_kernel
from .relaunch import launch
from .append import append_to_cache  # noqa: F401 - an entry point
from .host import (cdiv, dot_precision, forward_widths, program_grid, row_strides, score_constants, sink_arg,
                   slopes_arg, sm_count)

configs.record_kernel_mode(attention_fwd_kernel)


# Host-side integer helpers. triton.cdiv / triton.next_power_of_2 are constexpr functions in recent
# Triton (triton 3.9 on the CI machine: 1.8 us a call from Python, 50x these), and a decode or fwd+bwd
# step calls them a dozen times.
def _score_args(q: torch.Tensor, alibi_slopes, attn_mask, problem: AttentionProblem):
    """The kernel arguments that describe scores: slopes, mask, their strides, the flags."""
    slopes, slopes_stride = slopes_arg(q, alibi_slopes)
    if attn_mask is not None:
        mask = attn_mask.view(torch.uint8) if attn_mask.dtype == torch.bool else attn_mask
        mask_strides = mask.stride()
        mask_kind = 1 if attn_mask.dtype == torch.bool else 2
    else:
        mask, mask_strides, mask_kind = q, (0, 0, 0, 0), 0  # never read
    scalars, flags = score_constants(problem, mask_kind, dot_precision(problem.dtype))
    return slopes, slopes_stride, mask, mask_strides, scalars, flags


def _dropout_args(q: torch.Tensor, problem: AttentionProblem, rng_state) -> tuple[torch.Tensor, tuple, dict]:
    """The dropout arguments of the forward and backward kernels: (RngState, (dropout_threshold, dropout_scale),
    constexprs). RngState holds the call's seed and stream word (flashtile._dropout) as two int64 on q's device;
    the threshold is the unsigned keep threshold - 2**31 (common.dropout_keep compares in int32). Without dropout, q
    (never read), (0, 1.0) and no constexpr (HAS_DROPOUT keeps its default, False)."""
    if problem.dropout_p == 0:
        return q, (0, 1.0), {}
    seed, offset = rng_state.tolist()
    state = torch.tensor([seed, _dropout.stream_of(offset)], dtype=torch.int64)
    if q.device.type != "cpu":
        state = state.to(q.device, non_blocking=True)
    return (state, (_dropout.threshold(problem.dropout_p) - 2**31, _dropout.keep_scale(problem.dropout_p)),
            {"HAS_DROPOUT": True})


@functools.lru_cache(maxsize=None)
def _has_tma(device_index: int) -> bool:
    # asked on every call; torch's query costs microseconds of Python that a short call's host time feels
    return torch.cuda.get_device_capability(device_index) >= (9, 0)


def _tma_ready(tensors, attn_mask) -> bool:
    """TMA needs 16-byte aligned base addresses and strides, a GPU of sm_90+ (or the interpreter), no mask,
    and tensors that are not empty (a descriptor's every dimension is >= 1; with no keys there is nothing
    to stream, and the pointer kernels write the empty rows)."""
    if attn_mask is not None:
        return False
    if not interpreting():
        device = tensors[0].device
        if device.type != "cuda" or not _has_tma(device.index):
            return False
    # plain loops: this runs on every call, and generator expressions cost host time here
    for t in tensors:
        if t.numel() == 0 or t.data_ptr() % 16:
            return False
        size = t.element_size()
        for stride in t.stride()[:-1]:
            if stride * size % 16:
                return False
    return True


# once per process (Python's default warning filter): the opt-in schedule 2 is not safe to train with
WARP_SPECIALIZED_WARNING = (
    "forward_schedule=2 (warp-specialized, opt-in) is experimental: on an H200 under triton 3.6, reruns beside "
    "other GPU processes returned NaN in out and inf in lse 3 times in 382,482 (BENCHMARKS.md); "
    "use the default table for anything that matters")


# once per process: the fused Gluon backward is opt-in, not bitwise reproducible in dQ, and slower than the table's
FUSED_GLUON_BACKWARD_WARNING = (
    "backward_schedule=5 (the fused Gluon backward, opt-in) is experimental: its dQ additions arrive in the copy "
    "engine's order (dQ is not bitwise reproducible), and on an H200 it ran 0.87x the table's backward at d = 128, "
    "4k (BENCHMARKS.md); the default table is faster")


# once per process: the Gluon dK/dV kernel is opt-in; right on its GPU tests, but slower than the table's backward
GLUON_BACKWARD_WARNING = (
    "backward_schedule=4 (the Gluon dK/dV kernel, opt-in) is experimental: it passed its tests on an H200 but ran "
    "2-9% slower than the table's backward there (BENCHMARKS.md); the default table is faster")


def _tma_scratch(size: int, alignment: int, stream):
    # a descriptor built in a kernel (the warp-specialized forward's query tile) needs a little global
    # scratch memory from the caller
    return torch.empty(size, dtype=torch.int8, device="cuda")


class _CheckedDescriptor(TensorDescriptor):
    """A host-side TMA descriptor whose rules (16-byte aligned base and strides, unit last stride, positive
    dims, power-of-two box) _tma_ready and the tile table have already checked: TensorDescriptor's own
    checks cost ~1.6 us of host time per descriptor (CI machine: 2.19 us to build one, 0.63 without them),
    three or four descriptors a call."""

    def __post_init__(self):
        pass


def _heads_view(t: torch.Tensor, block_rows: int, block_width: int) -> TensorDescriptor:
    """A host-side TMA descriptor over a (batch, rows, heads, dim) tensor, seen as (batch, heads, rows, dim) so
    that a [1, 1, block_rows, block_width] box is one head's tile: the copy engine zero-fills rows past the
    sequence and columns past dim, and clips stores there. Every dimension must be >= 1 and the tensor must
    pass _tma_ready."""
    batch, rows, heads, dim = t.shape
    stride_b, stride_m, stride_h, _ = t.stride()
    return _CheckedDescriptor(t, [batch, heads, rows, dim], [stride_b, stride_h, stride_m, 1],
                              [1, 1, block_rows, block_width])


def _packing(q, k, cu_seqlens_q, cu_seqlens_k):
    """Kernel arguments for packed sequences: (CuSeqlensQ, CuSeqlensK, VARLEN, batch strides of q and k).

    Packed tensors are (1, total, heads, dim) and their sequences start at cu_seqlens rows, so the
    kernels' batch strides must be 0; dense batches pass q (never read) and their own strides.
    """
    if cu_seqlens_q is None:
        return q, q, False, 1, 1
    return cu_seqlens_q, cu_seqlens_k, True, 0, 0


def _grid_rows(seqlen_hint: int, varlen: bool) -> int:
    """Rows of each sequence the grid covers: the hint, capped for packed batches (configs.VARLEN_GRID_ROWS)."""
    return min(seqlen_hint, configs.VARLEN_GRID_ROWS) if varlen else seqlen_hint


def _outputs(q, problem: AttentionProblem, packed: bool):
    """out (batch, seqlen_q, nheads, headdim_v) and lse (batch, nheads, seqlen_q); packed: batch 1, total rows."""
    p = problem
    batch, rows = (1, q.shape[1]) if packed else (p.batch, p.seqlen_q)
    out = torch.empty(batch, rows, p.nheads, p.headdim_v, dtype=q.dtype, device=q.device)
    lse = torch.empty(batch, p.nheads, rows, dtype=torch.float32, device=q.device)
    return out, lse


def _register_cap(registers: int) -> dict:
    """Triton's maxnreg launch option for a register cap per thread (0: none). The tiles set caps for the TMA
    forward (forward_max_registers; the pointer kernel, which a call reaches when its tensors are not TMA-ready,
    runs without one) and the two-launch backward's dQ kernel (dq_max_registers)."""
    return {"maxnreg": registers} if registers else {}


def forward(q, k, v, alibi_slopes, attn_mask, problem: AttentionProblem, tiles: TritonTiles,
            cu_seqlens_q=None, cu_seqlens_k=None, learnable_sink=None, rng_state=None):
    """Fused forward: returns out (batch, seqlen_q, nheads, headdim_v) and lse (batch, nheads, seqlen_q) float32.

    With cu_seqlens_q / cu_seqlens_k (int32, (nseq + 1,)), q, k, v are packed sequences of shape
    (1, total, heads, dim), problem.batch is nseq and problem.seqlen_* are the max_seqlen hints;
    out is then (1, total_q, nheads, headdim_v) and lse (1, nheads, total_q). learnable_sink: (nheads,) or None.
    rng_state: the call's dropout (seed, offset) (flashtile._dropout.draw_state) when problem.dropout_p > 0.
    """
    p = problem
    if tiles.forward_schedule == configs.DECODE_FORWARD_SCHEDULE:
        return forward_by_decode(q, k, v, alibi_slopes, p, learnable_sink)
    if tiles.forced_schedule == configs.SCHEDULE_CODES["fa1"]:
        # the dispatcher forced it only for calls it serves (_schedules.unserved_reason)
        return launch_fa1(q, k, v, p, tiles.block_m, tiles.block_n, tiles.num_warps, learnable_sink)
    if tiles.forward_schedule == 3:
        reason = gluon_unserved(q, k, v, p, tiles.gluon_tile)
        if not reason:
            return forward_gluon(q, k, v, alibi_slopes, p, tiles.gluon_tile, cu_seqlens_q, cu_seqlens_k,
                                 learnable_sink)
        if tiles.forced_schedule == configs.SCHEDULE_CODES["fa3"]:
            # forced: the tensors' alignment, known only here, turned it away; no fallback to schedule 1
            raise BackendUnavailableError(f"schedule 'fa3' of backend 'triton' cannot serve this call: {reason}")
    cu_q, cu_k, varlen, batch_q, batch_k = _packing(q, k, cu_seqlens_q, cu_seqlens_k)
    out, lse = _outputs(q, p, varlen)
    if (out.numel() == 0 and lse.numel() == 0) or p.batch == 0:
        return out, lse
    slopes, slopes_stride, mask, mask_strides, scalars, flags = _score_args(q, alibi_slopes, attn_mask, p)
    flags = forward_widths(flags)
    sink = sink_arg(q, learnable_sink)
    rng, dropout_scalars, dropout_flags = _dropout_args(q, p, rng_state)
    query_programs = max(1, cdiv(_grid_rows(p.seqlen_q, varlen), tiles.block_m))
    grid = program_grid(query_programs * p.batch * p.nheads)
    # packed batches take TMA loads under schedule 1 only (the warp-specialized loop keeps to dense batches)
    # schedule 3 (the Gluon forward) where that kernel does not serve the call: schedule 1
    tma_schedule = tiles.forward_schedule in (1, 3) or (tiles.forward_schedule == 2 and not varlen)
    if tma_schedule and _tma_ready((q, k, v), attn_mask):
        mask_all = problem.is_banded or p.seqlen_k % tiles.block_n != 0
        if tiles.forward_schedule == 2:
            warnings.warn(WARP_SPECIALIZED_WARNING, RuntimeWarning, stacklevel=2)
            if not interpreting():
                triton.set_allocator(_tma_scratch)  # its query tile's in-kernel descriptor (fwd_tma.py)
        del flags["MASK_KIND"]
        block_d, block_dv = flags["BLOCK_D"], flags["BLOCK_DV"]
        launch(
            attention_fwd_tma_kernel, grid,
            (q, _heads_view(q, tiles.block_m, block_d), _heads_view(k, tiles.block_n, block_d),
             _heads_view(v, tiles.block_n, block_dv), out, lse, slopes, sink, cu_q, cu_k, rng),
            (*row_strides(q, 1), *row_strides(out, batch_q), lse.stride(0) * batch_q, lse.stride(1),
             slopes_stride, p.nheads, p.group_size, p.seqlen_q, p.seqlen_k, query_programs, *scalars,
             *dropout_scalars),
            BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, num_warps=tiles.num_warps, num_stages=tiles.num_stages,
            WARP_SPECIALIZE=tiles.forward_schedule == 2, MASK_ALL=mask_all, VARLEN=varlen,
            SEPARATE_RAGGED_END=bool(tiles.forward_separate_ragged_end), RESCALE_THRESHOLD=tiles.rescale_threshold,
            EXP2_POLY_EVERY=tiles.exp2_poly_every, HAS_SINK=p.has_sink, **_register_cap(tiles.forward_max_registers),
            **flags, **dropout_flags)
        return out, lse
    launch(
        attention_fwd_kernel, grid, (q, k, v, out, lse, slopes, sink, mask, cu_q, cu_k, rng, q, q),
        (*row_strides(q, batch_q), *row_strides(k, batch_k), *row_strides(v, batch_k), *row_strides(out, batch_q),
         lse.stride(0) * batch_q, lse.stride(1), slopes_stride, *mask_strides,
         p.nheads, p.group_size, p.seqlen_q, p.seqlen_k, query_programs, *scalars, *dropout_scalars, *_UNPAGED),
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, num_warps=tiles.num_warps, num_stages=tiles.num_stages,
        VARLEN=varlen, RESCALE_THRESHOLD=tiles.rescale_threshold, EXP2_POLY_EVERY=tiles.exp2_poly_every,
        HAS_SINK=p.has_sink, **flags, **dropout_flags)
    return out, lse


# attention_fwd_kernel's block-table scalars when K and V are not paged (stride_table_b, stride_kblock, stride_vblock,
# page_size, num_blocks, capacity; never read)
_UNPAGED = (0, 0, 0, 1, 1, 0)


def paged_varlen_forward(call, tiles: TritonTiles):
    """flash_attn_varlen_func with block_table (a validated _validate.PagedVarlenCall): packed queries against paged
    K/V caches, attention_fwd_kernel with PAGED (forward only). Returns out (1, total_q, nheads, headdim_v) in q's
    dtype and lse (1, nheads, total_q) float32. Nothing is read back from the GPU.

    The kernel takes the tiles' block_m x block_n, warps and stages (the pointer kernel's: a paged cache has no
    single descriptor per sequence for the TMA and Gluon forwards) and the fa4 schedule's constexprs."""
    p = call.problem
    q, k, v = call.q, call.k_cache, call.v_cache
    out, lse = _outputs(q, p, True)
    if out.numel() == 0 or p.batch == 0:
        return out, lse
    slopes, slopes_stride, mask, mask_strides, scalars, flags = _score_args(q, call.alibi_slopes, None, p)
    flags = forward_widths(flags)
    sink = sink_arg(q, call.learnable_sink)
    query_programs = max(1, cdiv(_grid_rows(p.seqlen_q, True), tiles.block_m))
    grid = program_grid(query_programs * p.batch * p.nheads)
    # cu_seqlens_q stands in for the kernel's CuSeqlensK (its key bounds come from SeqlensK and the block table), q
    # for its RngState and (0, 1.0) for its dropout scalars (a paged call has no dropout: _validate)
    cu_q, table = call.cu_seqlens_q, call.block_table
    launch(
        attention_fwd_kernel, grid, (q, k, v, out, lse, slopes, sink, mask, cu_q, cu_q, q, table, call.seqlens_k),
        (*row_strides(q, 0), 0, k.stride(1), k.stride(2), 0, v.stride(1), v.stride(2), *row_strides(out, 0),
         0, lse.stride(1), slopes_stride, *mask_strides, p.nheads, p.group_size, p.seqlen_q, p.seqlen_k,
         query_programs, *scalars, 0, 1.0, table.stride(0), k.stride(0), v.stride(0), call.page_size, k.shape[0],
         table.shape[1] * call.page_size),
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, num_warps=tiles.num_warps, num_stages=tiles.num_stages,
        VARLEN=True, RESCALE_THRESHOLD=tiles.rescale_threshold, EXP2_POLY_EVERY=tiles.exp2_poly_every,
        HAS_SINK=p.has_sink, PAGED=True,
        PAGE_CHUNK=tiles.block_n if call.page_size % tiles.block_n == 0 else 0, **flags)
    return out, lse


GLUON_L2_GROUP_BYTES = 24 << 20  # K and V bytes of the heads that the longest-first order keeps together (L2 50 MB)


@functools.lru_cache(maxsize=1024)
def _gluon_plan(problem: AttentionProblem, tile: GluonTile) -> tuple[str, int, bool]:
    """(configs.gluon_unserved_reason, keys per block, whether the output shares the query rows' buffer) of a
    problem: functions of the problem, the tile and the process (its GPUs, its Triton), kept per problem so that a
    call does not recompute them."""
    return (configs.gluon_unserved_reason(problem, tile), configs.gluon_block_n(problem, tile),
            configs.gluon_shares_qo(problem, tile))


def gluon_unserved(q, k, v, problem: AttentionProblem, tile: GluonTile) -> str:
    """Why the Gluon forward cannot run this call ('' when it can): configs.gluon_unserved_reason (the problem's
    attn_mask and packing included), then the tensors."""
    reason = _gluon_plan(problem, tile)[0]
    if reason:
        return reason
    if not _tma_ready((q, k, v), None):
        return "TMA needs 16-byte aligned base addresses and strides and non-empty tensors"
    return ""


@functools.lru_cache(maxsize=None)
def _gluon_box_layout(dtype: torch.dtype, block_rows: int, block_width: int):
    """The NVMMA shared layout (swizzle) that a [1, 1, block_rows, block_width] box of `dtype` lands in."""
    gl = gluon_compat.gl
    element = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16}[dtype]
    return gl.NVMMASharedLayout.get_default_for([1, 1, block_rows, block_width], element)


def _gluon_heads_view(t: torch.Tensor, block_rows: int, block_width: int, layout_rows: int | None = None):
    """As _heads_view, a Gluon host descriptor with the shared layout its box lands in, or that of a box of
    layout_rows rows (a part of such a box; the rules that Gluon's descriptor checks on construction, gluon_unserved
    has checked)."""
    batch, rows, heads, dim = t.shape
    stride_b, stride_m, stride_h, _ = t.stride()
    descriptor = object.__new__(gluon_compat.TensorDescriptor)
    descriptor.__dict__.update(base=t, shape=[batch, heads, rows, dim], strides=[stride_b, stride_h, stride_m, 1],
                               block_shape=[1, 1, block_rows, block_width],
                               layout=_gluon_box_layout(t.dtype, layout_rows or block_rows, block_width),
                               padding="zero")
    return descriptor


@functools.lru_cache(maxsize=256)
def _dealt_tiles(device: torch.device, problem: AttentionProblem, programs: int, block_m: int, block_n: int,
                 group_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(TileList, TileStarts) for the Gluon forward's balanced persistent grid: the tiles in the kernel's order
    (fwd_gluon._tile_coordinates; longest first within groups of heads with a band closing on the right), each dealt
    to the CTA with the least work so far (list scheduling, so LPT within each group). CTA p takes
    TileList[TileStarts[p] .. TileStarts[p + 1]) in that order. A query block's work: the key blocks it visits
    (from its first visible key's block on, as the kernel's key_block_bounds), plus one for its prologue and
    epilogue. Built on the host once per shape and kept on the device."""
    query_blocks, batch_heads = cdiv(problem.seqlen_q, block_m), problem.batch * problem.nheads
    has_right = problem.window_right >= 0
    costs = []
    for m in range(query_blocks):
        lo, hi = visible_key_range(problem, m * block_m, (m + 1) * block_m)
        costs.append(1 + cdiv(hi - lo // block_n * block_n, block_n))
    loads = [(0, cta) for cta in range(programs)]
    dealt: list[list[int]] = [[] for _ in range(programs)]
    for tile in range(query_blocks * batch_heads):
        if has_right:
            group, within = divmod(tile, group_heads * query_blocks)
            heads = min(group_heads, batch_heads - group * group_heads)
            m_block = query_blocks - 1 - within // heads
        else:
            m_block = tile % query_blocks
        load, cta = heapq.heappop(loads)
        dealt[cta].append(tile)
        heapq.heappush(loads, (load + costs[m_block], cta))
    starts = [0]
    for tiles in dealt:
        starts.append(starts[-1] + len(tiles))
    flat = [tile for tiles in dealt for tile in tiles]
    return (torch.tensor(flat, dtype=torch.int32, device=device),
            torch.tensor(starts, dtype=torch.int32, device=device))


def forward_gluon(q, k, v, alibi_slopes, problem: AttentionProblem, tile: GluonTile, cu_seqlens_q=None,
                  cu_seqlens_k=None, learnable_sink=None):
    """The Gluon forward (fwd_gluon.py) of a call that gluon_unserved accepts, dense or packed (cu_seqlens_q and
    cu_seqlens_k), with a learnable sink (nheads,) or None: out, lse as forward()."""
    p = problem
    cu_q, cu_k, varlen, batch_q, _ = _packing(q, k, cu_seqlens_q, cu_seqlens_k)
    out, lse = _outputs(q, p, varlen)
    if out.numel() == 0 or p.batch == 0:
        return out, lse
    slopes, slopes_stride, _, _, scalars, flags = _score_args(q, alibi_slopes, None, p)
    block_d, block_dv = flags["BLOCK_D"], flags["BLOCK_DV"]
    query_blocks = cdiv(p.seqlen_q, tile.block_m)
    num_tiles = query_blocks * p.batch * p.nheads
    programs = min(num_tiles, tile.ctas_per_sm * sm_count(q.device)) if tile.persistent else num_tiles
    _, block_n, share_qo = _gluon_plan(p, tile)
    _, score_scale, softcap_scale, softcap_out, diagonal_offset, window_left, window_right = scalars
    # longest-first order (a band closing on the right, packed batches) takes heads in groups whose K and V fit in L2
    # together
    head_bytes = p.seqlen_k * (p.headdim + p.headdim_v) * q.element_size()
    group_heads = max(1, min(p.batch * p.nheads, GLUON_L2_GROUP_BYTES // max(1, head_bytes)))
    tile_list = tile.persistent and tile.balanced
    if tile_list:
        dealt, starts = _dealt_tiles(q.device, p, programs, tile.block_m, block_n, group_heads)
    else:
        dealt = starts = lse  # never read
    launch(
        attention_fwd_gluon_kernel, program_grid(programs),
        (_gluon_heads_view(q, WARPGROUP_ROWS, block_d), _gluon_heads_view(k, block_n, block_d),
         _gluon_heads_view(v, block_n, block_dv), _gluon_heads_view(out, WARPGROUP_ROWS, block_dv),
         # packed batches: an 8-row box for the rows before a sequence's end (dense: never read)
         _gluon_heads_view(out, 8, block_dv, layout_rows=WARPGROUP_ROWS) if varlen else lse, lse, slopes,
         sink_arg(q, learnable_sink), dealt, starts, cu_q, cu_k, out),
        (lse.stride(0) * batch_q, lse.stride(1), slopes_stride, out.stride(1), p.headdim_v, p.nheads, p.group_size,
         p.seqlen_q, p.seqlen_k, query_blocks, p.batch * p.nheads, group_heads, group_heads * query_blocks, programs,
         num_tiles // programs, num_tiles % programs, score_scale, softcap_scale, softcap_out, diagonal_offset,
         window_left, window_right),
        BLOCK_M=tile.block_m, BLOCK_N=block_n, NUM_STAGES=tile.num_stages, HAS_LEFT=flags["HAS_LEFT"],
        HAS_RIGHT=flags["HAS_RIGHT"], HAS_SOFTCAP=flags["HAS_SOFTCAP"], HAS_ALIBI=flags["HAS_ALIBI"],
        SCALE_IN_EXP2=flags["SCALE_IN_EXP2"], OVERLAP=tile.overlap, PINGPONG=tile.pingpong, TILE_LIST=tile_list,
        SHARE_QO=share_qo, VARLEN=varlen, CONSUMER_REGISTERS=tile.consumer_registers,
        EXP2_EMULATED=tile.exp2_emulated, RESCALE_THRESHOLD=tile.rescale_threshold, ACROSS_TILES=tile.across_tiles,
        HAS_SINK=p.has_sink, HALF_DIAGONAL=tile.half_diagonal, num_warps=4, maxnreg=tile.max_registers)
    return out, lse


def backward(grad_out, grad_lse, q, k, v, out, lse, alibi_slopes, attn_mask, problem: AttentionProblem,
             tiles: TritonTiles, cu_seqlens_q=None, cu_seqlens_k=None, learnable_sink=None, rng_state=None):
    """Recompute backward: returns dq, dk, dv contiguous in the flash layout and the inputs' dtype
    (for packed sequences, in the packed layout (1, total, heads, dim); see forward), and the gradient of
    learnable_sink (None without one), reduced by torch from the kernels' delta and the forward's lse (delta =
    rowsum(dO * O) - dlse holds with dropout too: O is the dropped-out output). rng_state: the forward's dropout
    (seed, offset), whose keep-mask the kernels regenerate, when problem.dropout_p > 0."""
    dq, dk, dv, delta = _backward_kernels(grad_out, grad_lse, q, k, v, out, lse, alibi_slopes, attn_mask, problem,
                                          tiles, cu_seqlens_q, cu_seqlens_k, rng_state)
    if learnable_sink is None:
        return dq, dk, dv, None
    if delta is None:  # no query row: nothing reaches the sink
        return dq, dk, dv, torch.zeros_like(learnable_sink)
    return dq, dk, dv, sink_gradient(learnable_sink, lse, delta)


def _backward_kernels(grad_out, grad_lse, q, k, v, out, lse, alibi_slopes, attn_mask, problem: AttentionProblem,
                      tiles: TritonTiles, cu_seqlens_q=None, cu_seqlens_k=None, rng_state=None):
    """backward's launches: dq, dk, dv and delta = rowsum(dO * O) - dlse (lse's layout, float32; None where no
    kernel ran because there is no query row)."""
    p = problem
    cu_q, cu_k, varlen, batch_q, batch_k = _packing(q, k, cu_seqlens_q, cu_seqlens_k)
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    if p.batch * p.nheads == 0 or q.shape[1] == 0:  # no query sees any key: no gradient flows to k and v
        return dq, dk.zero_(), dv.zero_(), None
    # no zero fill for packed batches either: every key row lies in some sequence (cu_seqlens_k ends at total_k,
    # checked on the CPU, the caller's guarantee on a GPU) and the dK/dV programs store every key block of their
    # sequence, zeros where no query sees it (a sequence without queries too); the fill of dk and dv took 0.34
    # ms of a 15 ms causal fwd+bwd (docs/varlen.md)
    slopes, slopes_stride, mask, mask_strides, scalars, flags = _score_args(q, alibi_slopes, attn_mask, p)
    rng, dropout_scalars, dropout_flags = _dropout_args(q, p, rng_state)
    has_dlse = grad_lse is not None
    grad_lse = grad_lse.float().contiguous() if has_dlse else lse  # never read without HAS_DLSE
    delta = torch.empty_like(lse)
    # backward schedule 4: the two-launch schedule with the Gluon dK/dV kernel where it serves the call; schedule 5:
    # the fused Gluon backward where it serves the call; elsewhere both run schedule 2
    fused = tiles.backward_schedule == configs.FUSED_GLUON_BACKWARD_SCHEDULE
    gluon_dkdv = (tiles.backward_schedule in configs.GLUON_BACKWARD_SCHEDULES and k.shape[1] > 0
                  and not gluon_backward_unserved(q, k, v, grad_out, p, bool(tiles.gluon_backward_overlap), fused))
    if gluon_dkdv:
        warnings.warn(FUSED_GLUON_BACKWARD_WARNING if fused else GLUON_BACKWARD_WARNING, RuntimeWarning,
                      stacklevel=2)
    if gluon_dkdv and fused:
        _launch_preprocess(out, grad_out, grad_lse, delta, p, flags, has_dlse)
        _launch_fused_gluon(q, k, v, grad_out, lse, delta, dq, dk, dv, p, scalars, flags)
        return dq, dk, dv, delta
    inputs = (*row_strides(q, batch_q), *row_strides(k, batch_k), *row_strides(v, batch_k),
              *row_strides(grad_out, batch_q))
    dq_strides, dk_strides, dv_strides = (row_strides(dq, batch_q), row_strides(dk, batch_k),
                                          row_strides(dv, batch_k))
    stats = (lse.stride(0) * batch_q, lse.stride(1), slopes_stride, *mask_strides)
    # packed batches: a host-side descriptor spans the packed tensor, so past a sequence's end it reads the next
    # sequence's rows; their kernels take only the interior blocks by TMA and the edge blocks by masked pointer
    # loads (zeroing the neighbour's rows in the kernel instead cost 4.5-11%, docs/varlen.md)
    # one key (seqlen_k 1, which Triton compiles as a constant): pointer loads. With the dQ programs' K/V stream
    # by TMA over one constant key block, triton 3.6's ptxas crashes (error -11; 27 of 216 seqlen-1 problems,
    # reproduced on a CPU by tests/sm90_launches.py, docs/compiler-workarounds.md); one key has nothing to stream
    use_tma = tiles.backward_tma and p.seqlen_k > 1 and _tma_ready((q, k, v, grad_out), attn_mask)
    dq_rows, dq_keys, dq_warps = tiles.dq_tile
    if use_tma:
        # the dK/dV programs stream bwd_block_m query rows (q, dO), the dQ programs dq_keys keys (k, v)
        rows, block_d, block_dv = tiles.bwd_block_m, flags["BLOCK_D"], flags["BLOCK_DV"]
        descriptors = (_heads_view(q, rows, block_d), _heads_view(k, dq_keys, block_d),
                       _heads_view(v, dq_keys, block_dv), _heads_view(grad_out, rows, block_dv))
    else:
        descriptors = (q, k, v, grad_out)  # never read
    bwd = dict(num_warps=tiles.bwd_num_warps, num_stages=tiles.bwd_num_stages, VARLEN=varlen, USE_TMA=use_tma,
               **flags, **dropout_flags)
    key_programs = max(1, cdiv(_grid_rows(p.seqlen_k, varlen), tiles.bwd_block_n))
    query_programs = max(1, cdiv(_grid_rows(p.seqlen_q, varlen), dq_rows))
    if tiles.backward_one_launch and k.shape[1] > 0:
        # a dK/dV program may run before the dQ program of its query rows: delta from a launch of its own
        _launch_preprocess(out, grad_out, grad_lse, delta, p, flags, has_dlse)
        launch(
            attention_bwd_kernel, program_grid((key_programs * p.nheads_k + query_programs * p.nheads) * p.batch),
            (q, k, v, grad_out, *descriptors, lse, delta, dq, dk, dv, slopes, mask, cu_q, cu_k, rng),
            (*inputs, *dq_strides, *dk_strides, *dv_strides, *stats,
             p.nheads, p.nheads_k, p.group_size, p.seqlen_q, p.seqlen_k, key_programs, query_programs, *scalars,
             *dropout_scalars),
            BLOCK_M=tiles.bwd_block_m, BLOCK_N=tiles.bwd_block_n, **bwd)
        return dq, dk, dv, delta
    # two launches: the dQ kernel first, which also computes each query row's delta (its programs hold the rows'
    # dO already) and stores it for the dK/dV kernel; its tile is by default the dK/dV tile transposed
    # (bwd_block_n query rows against bwd_block_m keys)
    launch(
        attention_bwd_dq_kernel, program_grid(query_programs * p.batch * p.nheads),
        (q, k, v, grad_out, out, *descriptors, lse, delta, grad_lse, dq, slopes, mask, cu_q, cu_k, rng),
        (*inputs, *row_strides(out, batch_q), *dq_strides, *stats, p.nheads, p.group_size, p.seqlen_q, p.seqlen_k,
         query_programs, *scalars, *dropout_scalars),
        BLOCK_M=dq_rows, BLOCK_N=dq_keys, HAS_DLSE=has_dlse, **dict(bwd, num_warps=dq_warps),
        **_register_cap(tiles.dq_max_registers))
    if gluon_dkdv:
        _launch_dkdv_gluon(q, k, v, grad_out, lse, delta, dk, dv, p, scalars, flags, bool(tiles.gluon_backward_overlap))
    elif k.shape[1] > 0:
        launch(
            attention_bwd_dkdv_kernel, program_grid(key_programs * p.batch * p.nheads_k),
            (q, k, v, grad_out, *descriptors, lse, delta, dk, dv, slopes, mask, cu_q, cu_k, rng),
            (*inputs, *dk_strides, *dv_strides, *stats, p.nheads, p.nheads_k, p.group_size, p.seqlen_q, p.seqlen_k,
             key_programs, *scalars, *dropout_scalars),
            BLOCK_M=tiles.bwd_block_m, BLOCK_N=tiles.bwd_block_n, **bwd)
    return dq, dk, dv, delta


def gluon_backward_unserved(q, k, v, grad_out, problem: AttentionProblem, overlap: bool = False,
                            fused: bool = False) -> str:
    """Why the Gluon dK/dV kernel (with the intra-warpgroup overlap where `overlap`), or with `fused` the fused Gluon
    backward, cannot run this call ('' when it can): configs.gluon_backward_unserved_reason, then the tensors."""
    reason = configs.gluon_backward_unserved_reason(problem, overlap, fused)
    if reason:
        return reason
    if not _tma_ready((q, k, v, grad_out), None):
        return "TMA needs 16-byte aligned base addresses and strides and non-empty tensors"
    return ""


def _launch_preprocess(out, grad_out, grad_lse, delta, problem: AttentionProblem, flags, has_dlse: bool) -> None:
    """delta = rowsum(dO * O) (- dlse with has_dlse) for every query row, in a launch of its own (the schedules whose
    dK/dV programs may run before the dQ programs of their rows). Rows are independent there: a packed batch is one
    long sequence to the preprocess kernel."""
    rows, batch = out.shape[1], out.shape[0]
    row_programs = cdiv(rows, 64)
    launch(
        attention_bwd_preprocess_kernel, program_grid(row_programs * batch * problem.nheads),
        (out, grad_out, grad_lse, delta),
        (*row_strides(out, 1), *row_strides(grad_out, 1), problem.nheads, rows, row_programs),
        HEADDIM_V=problem.headdim_v, BLOCK_M=64, BLOCK_DV=flags["BLOCK_DV"], HAS_DLSE=has_dlse)


def _gluon_backward_views(q, k, v, grad_out, dk, dv, block_m: int, block_d: int, block_dv: int) -> tuple:
    """The Gluon backward kernels' TMA views: q and grad_out in query blocks of block_m rows, k, v, dk and dv in one
    consumer's 64 keys (WARPGROUP_KEYS), each (batch, heads, rows, width) as _gluon_heads_view builds them."""
    return (_gluon_heads_view(q, block_m, block_d), _gluon_heads_view(k, WARPGROUP_KEYS, block_d),
            _gluon_heads_view(v, WARPGROUP_KEYS, block_dv), _gluon_heads_view(grad_out, block_m, block_dv),
            _gluon_heads_view(dk, WARPGROUP_KEYS, block_d), _gluon_heads_view(dv, WARPGROUP_KEYS, block_dv))


def _launch_dkdv_gluon(q, k, v, grad_out, lse, delta, dk, dv, problem: AttentionProblem, scalars, flags,
                       overlap: bool = False):
    """The Gluon dK/dV kernel (bwd_gluon.py) of a dense call that gluon_backward_unserved accepts: dk and dv (the
    flash layout, contiguous) from delta, which the dQ kernel stored; with the intra-warpgroup overlap where
    `overlap`."""
    p = problem
    block_m, stages = configs.gluon_backward_tile(p, overlap)
    block_d, block_dv = flags["BLOCK_D"], flags["BLOCK_DV"]
    key_programs = cdiv(p.seqlen_k, 2 * WARPGROUP_KEYS)
    programs = key_programs * p.batch * p.nheads_k  # one CTA per key block (of 128 keys, two consumers' 64)
    launch(
        attention_bwd_dkdv_gluon_kernel, program_grid(programs),
        (*_gluon_backward_views(q, k, v, grad_out, dk, dv, block_m, block_d, block_dv), lse, delta),
        (lse.stride(0), lse.stride(1), p.nheads_k, p.group_size, p.seqlen_q, p.seqlen_k, key_programs, programs,
         *scalars),
        BLOCK_M=block_m, NUM_STAGES=stages, HAS_LEFT=flags["HAS_LEFT"], HAS_RIGHT=flags["HAS_RIGHT"],
        SCALE_IN_EXP2=flags["SCALE_IN_EXP2"], OVERLAP=overlap, CONSUMER_REGISTERS=240, num_warps=4, maxnreg=168)


def _dq_accumulator(problem: AttentionProblem, device: torch.device) -> torch.Tensor:
    """The fused Gluon backward's zeroed float32 dQ accumulator: dQ transposed, (batch, heads, headdim, query rows
    rounded up to 4 so that TMA's 16-byte stride rule holds)."""
    p = problem
    return torch.zeros(p.batch, p.nheads, p.headdim, cdiv(p.seqlen_q, 4) * 4, dtype=torch.float32, device=device)


def _convert_dq(accumulator: torch.Tensor, dq: torch.Tensor, problem: AttentionProblem, block_d: int) -> None:
    """dq (batch, seqlen_q, nheads, headdim) = softmax_scale * the accumulator transposed, in dq's dtype
    (attention_bwd_dq_convert_kernel)."""
    p = problem
    row_programs = cdiv(p.seqlen_q, 64)
    launch(
        attention_bwd_dq_convert_kernel, program_grid(row_programs * p.batch * p.nheads), (accumulator, dq),
        (*accumulator.stride()[:3], *row_strides(dq, 1), p.nheads, p.seqlen_q, row_programs, p.softmax_scale),
        HEADDIM=p.headdim, BLOCK_M=64, BLOCK_D=block_d, num_warps=4)


def _launch_fused_gluon(q, k, v, grad_out, lse, delta, dq, dk, dv, problem: AttentionProblem, scalars, flags):
    """The fused Gluon backward (bwd_gluon_fused.py) of a dense call that gluon_backward_unserved accepts with
    `fused`: dk and dv (the flash layout, contiguous) and dq, through a zeroed float32 accumulator that the kernel
    adds into by TMA and attention_bwd_dq_convert_kernel converts; delta comes from the preprocess kernel."""
    p = problem
    block_m, stages = configs.fused_gluon_backward_tile(p)
    block_d, block_dv = flags["BLOCK_D"], flags["BLOCK_DV"]
    accumulator = _dq_accumulator(p, q.device)
    # one [1, 1, block_d, block_m] box is a query block's dQᵀ (rows past headdim and columns past seqlen_q clipped)
    dq_descriptor = object.__new__(gluon_compat.TensorDescriptor)
    dq_descriptor.__dict__.update(
        base=accumulator, shape=[p.batch, p.nheads, p.headdim, p.seqlen_q], strides=list(accumulator.stride()),
        block_shape=[1, 1, block_d, block_m],
        layout=gluon_compat.gl.NVMMASharedLayout.get_default_for([1, 1, block_d, block_m], gluon_compat.gl.float32),
        padding="zero")
    key_programs = cdiv(p.seqlen_k, 2 * WARPGROUP_KEYS)
    programs = key_programs * p.batch * p.nheads_k  # one CTA per key block (of 128 keys, two consumers' 64)
    launch(
        attention_bwd_fused_gluon_kernel, program_grid(programs),
        (*_gluon_backward_views(q, k, v, grad_out, dk, dv, block_m, block_d, block_dv), dq_descriptor, lse, delta),
        (lse.stride(0), lse.stride(1), p.nheads_k, p.group_size, p.seqlen_q, p.seqlen_k, key_programs, programs,
         *scalars),
        BLOCK_M=block_m, NUM_STAGES=stages, HAS_LEFT=flags["HAS_LEFT"], HAS_RIGHT=flags["HAS_RIGHT"],
        SCALE_IN_EXP2=flags["SCALE_IN_EXP2"], CONSUMER_REGISTERS=240, num_warps=4, maxnreg=168)
    _convert_dq(accumulator, dq, p, block_d)
