"""Launchers: allocate outputs, compute grids, pass strides, pick constexprs for the Triton kernels.

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
import math
import warnings
from dataclasses import dataclass

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from .. import _dropout
from .._geometry import visible_key_range
from .._sink import sink_gradient
from .._validate import AttentionProblem
from .common import LOG2E
from .bwd import (attention_bwd_dkdv_kernel, attention_bwd_dq_kernel, attention_bwd_kernel,
                  attention_bwd_preprocess_kernel)
from . import configs
from .configs import GluonTile, TritonTiles, interpreting
from .decode import attention_decode_combine_kernel, attention_decode_kernel
from ..errors import BackendUnavailableError
from .fwd import attention_fwd_kernel
from .fwd_fa1 import launch_fa1
from .fwd_tma import attention_fwd_tma_kernel
from . import gluon_compat
from .bwd_gluon import WARPGROUP_KEYS, attention_bwd_dkdv_gluon_kernel
from .bwd_gluon_fused import attention_bwd_dq_convert_kernel, attention_bwd_fused_gluon_kernel
from .fwd_gluon import WARPGROUP_ROWS, attention_fwd_gluon_kernel
from .relaunch import FixedLaunch, launch, launch_fixed
from .append import kvcache_append_kernel

configs.record_kernel_mode(attention_fwd_kernel)


# Host-side integer helpers. triton.cdiv / triton.next_power_of_2 are constexpr functions in recent
# Triton (triton 3.9 on the CI machine: 1.8 us a call from Python, 50x these), and a decode or fwd+bwd
# step calls them a dozen times.
def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _forward_widths(flags: dict) -> dict:
    """The score flags for a kernel that streams K and V tiles through a pipelined loop (the forwards, decode).

    Where the q/k head dim is padded (HEADDIM < BLOCK_D) and the value tile is narrower than the key tile,
    triton 3.6 on an H200 computed P @ V from outside its shared-memory buffers (compute-sanitizer:
    out-of-range shared address; wrong outputs, sometimes an illegal-address fault; headdim 40 with
    headdim_v 3, 8, 12 or 24 at 128 x 64 tiles, and 16 at one pipeline stage; 2026-11-29,
    docs/compiler-workarounds.md).
    Padding the value tile to the key tile's width was measured correct in every such case; the result
    is the same (the extra columns are masked), the cost is a wider P @ V for those uncommon shapes.
    """
    if flags["HEADDIM"] < flags["BLOCK_D"] and flags["BLOCK_DV"] < flags["BLOCK_D"]:
        return dict(flags, BLOCK_DV=flags["BLOCK_D"])
    return flags


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs are multiplied in full fp32 unless the user allowed TF32, as torch's matmul does
    if dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return "ieee"


def _sink_arg(q: torch.Tensor, learnable_sink) -> torch.Tensor:
    """The learnable sink as the kernels read it, a contiguous (nheads,) array of its own dtype (they convert to
    float32); q when there is none (never read)."""
    if learnable_sink is None:
        return q
    return learnable_sink.detach().contiguous()


def _slopes_arg(q: torch.Tensor, alibi_slopes) -> tuple[torch.Tensor, int]:
    """The ALiBi slopes as the kernels read them (float32, base 2) and their batch stride; q when there are none."""
    if alibi_slopes is None:
        return q, 0  # never read
    with torch.no_grad():
        slopes = (alibi_slopes.float() * LOG2E).contiguous()  # the kernels work in base 2
    return slopes, 0 if slopes.shape[0] == 1 else slopes.stride(0)


def _scale_in_exp2(problem: AttentionProblem, flags: dict) -> bool:
    """Whether the kernels keep scores unscaled and apply the scale inside the softmax's exponent (one fused
    multiply-add per score; common.online_softmax_step, bwd.py): where the scale is the scores' only transformation
    and positive, so that the row max of the unscaled products, scaled, is the max of the scores."""
    return (problem.softmax_scale > 0 and not flags["HAS_SOFTCAP"] and not flags["HAS_ALIBI"]
            and flags["MASK_KIND"] != 2)


def _score_constants(problem: AttentionProblem, mask_kind: int, precision: str) -> tuple[tuple, dict]:
    """The scalars and constexpr flags that describe scores (mask_kind 0 none, 1 bool, 2 additive; precision
    from _dot_precision, which reads a torch setting that may change between calls)."""
    softcap = problem.softcap if problem.softcap > 0 else 1.0
    # scale of the final scores in base 2; with softcap, tanh(q.k * softcap_scale) * softcap_out
    scalars = (problem.softmax_scale, problem.softmax_scale * LOG2E, problem.softmax_scale / softcap,
               softcap * LOG2E, problem.diagonal_offset, max(problem.window_left, 0), max(problem.window_right, 0))
    flags = dict(HEADDIM=problem.headdim, HEADDIM_V=problem.headdim_v, BLOCK_D=configs.padded_width(problem.headdim),
                 BLOCK_DV=configs.padded_width(problem.headdim_v), HAS_LEFT=problem.window_left >= 0,
                 HAS_RIGHT=problem.window_right >= 0, HAS_SOFTCAP=problem.softcap > 0,
                 HAS_ALIBI=problem.has_alibi, MASK_KIND=mask_kind, DOT_PRECISION=precision)
    flags["SCALE_IN_EXP2"] = _scale_in_exp2(problem, flags)
    return scalars, flags


def _score_args(q: torch.Tensor, alibi_slopes, attn_mask, problem: AttentionProblem):
    """The kernel arguments that describe scores: slopes, mask, their strides, the flags."""
    slopes, slopes_stride = _slopes_arg(q, alibi_slopes)
    if attn_mask is not None:
        mask = attn_mask.view(torch.uint8) if attn_mask.dtype == torch.bool else attn_mask
        mask_strides = mask.stride()
        mask_kind = 1 if attn_mask.dtype == torch.bool else 2
    else:
        mask, mask_strides, mask_kind = q, (0, 0, 0, 0), 0  # never read
    scalars, flags = _score_constants(problem, mask_kind, _dot_precision(problem.dtype))
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


def _row_strides(t: torch.Tensor, batch_stride: int) -> tuple[int, int, int]:
    """(batch, row, head) strides of a (batch, rows, heads, dim) tensor as the kernels take them; batch_stride
    0 for packed sequences, whose batch entries are found through cu_seqlens instead (see _packing)."""
    stride_b, stride_m, stride_h, _ = t.stride()  # one call: a fwd+bwd step asks for a dozen tensors' strides
    return stride_b * batch_stride, stride_m, stride_h


def _outputs(q, problem: AttentionProblem, packed: bool):
    """out (batch, seqlen_q, nheads, headdim_v) and lse (batch, nheads, seqlen_q); packed: batch 1, total rows."""
    p = problem
    batch, rows = (1, q.shape[1]) if packed else (p.batch, p.seqlen_q)
    out = torch.empty(batch, rows, p.nheads, p.headdim_v, dtype=q.dtype, device=q.device)
    lse = torch.empty(batch, p.nheads, rows, dtype=torch.float32, device=q.device)
    return out, lse


# CUDA's grid axis 0 (axes 1 and 2 hold 65,535 programs; every kernel lays its programs along axis 0)
MAX_PROGRAMS = 2**31 - 1


def _grid(programs: int) -> tuple[int]:
    """A one-axis grid of `programs` programs (the kernels split their index with common.program_coordinates)."""
    if programs > MAX_PROGRAMS:
        raise ValueError(f"this call needs {programs:,} programs, more than a CUDA grid axis holds "
                         f"({MAX_PROGRAMS:,}); split the batch into several calls")
    return (programs,)


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
    flags = _forward_widths(flags)
    sink = _sink_arg(q, learnable_sink)
    rng, dropout_scalars, dropout_flags = _dropout_args(q, p, rng_state)
    query_programs = max(1, _cdiv(_grid_rows(p.seqlen_q, varlen), tiles.block_m))
    grid = _grid(query_programs * p.batch * p.nheads)
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
            (*_row_strides(q, 1), *_row_strides(out, batch_q), lse.stride(0) * batch_q, lse.stride(1),
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
        (*_row_strides(q, batch_q), *_row_strides(k, batch_k), *_row_strides(v, batch_k), *_row_strides(out, batch_q),
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
    flags = _forward_widths(flags)
    sink = _sink_arg(q, call.learnable_sink)
    query_programs = max(1, _cdiv(_grid_rows(p.seqlen_q, True), tiles.block_m))
    grid = _grid(query_programs * p.batch * p.nheads)
    # cu_seqlens_q stands in for the kernel's CuSeqlensK (its key bounds come from SeqlensK and the block table), q
    # for its RngState and (0, 1.0) for its dropout scalars (a paged call has no dropout: _validate)
    cu_q, table = call.cu_seqlens_q, call.block_table
    launch(
        attention_fwd_kernel, grid, (q, k, v, out, lse, slopes, sink, mask, cu_q, cu_q, q, table, call.seqlens_k),
        (*_row_strides(q, 0), 0, k.stride(1), k.stride(2), 0, v.stride(1), v.stride(2), *_row_strides(out, 0),
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
    query_blocks, batch_heads = _cdiv(problem.seqlen_q, block_m), problem.batch * problem.nheads
    has_right = problem.window_right >= 0
    costs = []
    for m in range(query_blocks):
        lo, hi = visible_key_range(problem, m * block_m, (m + 1) * block_m)
        costs.append(1 + _cdiv(hi - lo // block_n * block_n, block_n))
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
    query_blocks = _cdiv(p.seqlen_q, tile.block_m)
    num_tiles = query_blocks * p.batch * p.nheads
    programs = min(num_tiles, tile.ctas_per_sm * _sm_count(q.device)) if tile.persistent else num_tiles
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
        attention_fwd_gluon_kernel, _grid(programs),
        (_gluon_heads_view(q, WARPGROUP_ROWS, block_d), _gluon_heads_view(k, block_n, block_d),
         _gluon_heads_view(v, block_n, block_dv), _gluon_heads_view(out, WARPGROUP_ROWS, block_dv),
         # packed batches: an 8-row box for the rows before a sequence's end (dense: never read)
         _gluon_heads_view(out, 8, block_dv, layout_rows=WARPGROUP_ROWS) if varlen else lse, lse, slopes,
         _sink_arg(q, learnable_sink), dealt, starts, cu_q, cu_k, out),
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
    inputs = (*_row_strides(q, batch_q), *_row_strides(k, batch_k), *_row_strides(v, batch_k),
              *_row_strides(grad_out, batch_q))
    dq_strides, dk_strides, dv_strides = (_row_strides(dq, batch_q), _row_strides(dk, batch_k),
                                          _row_strides(dv, batch_k))
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
    key_programs = max(1, _cdiv(_grid_rows(p.seqlen_k, varlen), tiles.bwd_block_n))
    query_programs = max(1, _cdiv(_grid_rows(p.seqlen_q, varlen), dq_rows))
    if tiles.backward_one_launch and k.shape[1] > 0:
        # a dK/dV program may run before the dQ program of its query rows: delta from a launch of its own
        _launch_preprocess(out, grad_out, grad_lse, delta, p, flags, has_dlse)
        launch(
            attention_bwd_kernel, _grid((key_programs * p.nheads_k + query_programs * p.nheads) * p.batch),
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
        attention_bwd_dq_kernel, _grid(query_programs * p.batch * p.nheads),
        (q, k, v, grad_out, out, *descriptors, lse, delta, grad_lse, dq, slopes, mask, cu_q, cu_k, rng),
        (*inputs, *_row_strides(out, batch_q), *dq_strides, *stats, p.nheads, p.group_size, p.seqlen_q, p.seqlen_k,
         query_programs, *scalars, *dropout_scalars),
        BLOCK_M=dq_rows, BLOCK_N=dq_keys, HAS_DLSE=has_dlse, **dict(bwd, num_warps=dq_warps),
        **_register_cap(tiles.dq_max_registers))
    if gluon_dkdv:
        _launch_dkdv_gluon(q, k, v, grad_out, lse, delta, dk, dv, p, scalars, flags, bool(tiles.gluon_backward_overlap))
    elif k.shape[1] > 0:
        launch(
            attention_bwd_dkdv_kernel, _grid(key_programs * p.batch * p.nheads_k),
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
    row_programs = _cdiv(rows, 64)
    launch(
        attention_bwd_preprocess_kernel, _grid(row_programs * batch * problem.nheads), (out, grad_out, grad_lse, delta),
        (*_row_strides(out, 1), *_row_strides(grad_out, 1), problem.nheads, rows, row_programs),
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
    key_programs = _cdiv(p.seqlen_k, 2 * WARPGROUP_KEYS)
    programs = key_programs * p.batch * p.nheads_k  # one CTA per key block (of 128 keys, two consumers' 64)
    launch(
        attention_bwd_dkdv_gluon_kernel, _grid(programs),
        (*_gluon_backward_views(q, k, v, grad_out, dk, dv, block_m, block_d, block_dv), lse, delta),
        (lse.stride(0), lse.stride(1), p.nheads_k, p.group_size, p.seqlen_q, p.seqlen_k, key_programs, programs,
         *scalars),
        BLOCK_M=block_m, NUM_STAGES=stages, HAS_LEFT=flags["HAS_LEFT"], HAS_RIGHT=flags["HAS_RIGHT"],
        SCALE_IN_EXP2=flags["SCALE_IN_EXP2"], OVERLAP=overlap, CONSUMER_REGISTERS=240, num_warps=4, maxnreg=168)


def _dq_accumulator(problem: AttentionProblem, device: torch.device) -> torch.Tensor:
    """The fused Gluon backward's zeroed float32 dQ accumulator: dQ transposed, (batch, heads, headdim, query rows
    rounded up to 4 so that TMA's 16-byte stride rule holds)."""
    p = problem
    return torch.zeros(p.batch, p.nheads, p.headdim, _cdiv(p.seqlen_q, 4) * 4, dtype=torch.float32, device=device)


def _convert_dq(accumulator: torch.Tensor, dq: torch.Tensor, problem: AttentionProblem, block_d: int) -> None:
    """dq (batch, seqlen_q, nheads, headdim) = softmax_scale * the accumulator transposed, in dq's dtype
    (attention_bwd_dq_convert_kernel)."""
    p = problem
    row_programs = _cdiv(p.seqlen_q, 64)
    launch(
        attention_bwd_dq_convert_kernel, _grid(row_programs * p.batch * p.nheads), (accumulator, dq),
        (*accumulator.stride()[:3], *_row_strides(dq, 1), p.nheads, p.seqlen_q, row_programs, p.softmax_scale),
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
    key_programs = _cdiv(p.seqlen_k, 2 * WARPGROUP_KEYS)
    programs = key_programs * p.batch * p.nheads_k  # one CTA per key block (of 128 keys, two consumers' 64)
    launch(
        attention_bwd_fused_gluon_kernel, _grid(programs),
        (*_gluon_backward_views(q, k, v, grad_out, dk, dv, block_m, block_d, block_dv), dq_descriptor, lse, delta),
        (lse.stride(0), lse.stride(1), p.nheads_k, p.group_size, p.seqlen_q, p.seqlen_k, key_programs, programs,
         *scalars),
        BLOCK_M=block_m, NUM_STAGES=stages, HAS_LEFT=flags["HAS_LEFT"], HAS_RIGHT=flags["HAS_RIGHT"],
        SCALE_IN_EXP2=flags["SCALE_IN_EXP2"], CONSUMER_REGISTERS=240, num_warps=4, maxnreg=168)
    _convert_dq(accumulator, dq, p, block_d)


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


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: a pretend GPU small enough that tests exercise the split path
    return torch.cuda.get_device_properties(device).multi_processor_count


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
    block_m = min(64, max(16, _next_power_of_2(rows)))
    row_blocks = _cdiv(rows, block_m)

    def key_blocks_and_splits(tile: DecodeTile) -> tuple[int, int]:
        key_blocks = max(1, _cdiv(problem.seqlen_k, tile.block_n))
        return key_blocks, num_splits or choose_num_splits(problem.batch * problem.nheads_k * row_blocks, key_blocks,
                                                           _sm_count(problem.device), tile.waves,
                                                           tile.min_blocks_per_split, tile.max_splits)

    if tile is None:
        # the layout's tile for split launches where the keys do end up split, else its unsplit tile
        tile = default_decode_tile(page_size, split=True)
        key_blocks, splits = key_blocks_and_splits(tile)
        if splits == 1:
            tile = default_decode_tile(page_size)
        elif tile is DECODE_TILE_SMALL_PAGES and _cdiv(key_blocks, splits) <= tile.num_stages:
            tile = DECODE_TILE_SHORT_SMALL_PAGES
    key_blocks, splits = key_blocks_and_splits(tile)
    blocks_per_split = _cdiv(key_blocks, max(1, min(splits, key_blocks)))
    return DecodeGeometry(block_m, row_blocks, tile.block_n, _cdiv(key_blocks, blocks_per_split),
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
    scalars, flags = _score_constants(p, 0, precision)
    flags = _forward_widths(flags)
    # a KV cache takes no attn_mask; and the decode kernel keeps its scores scaled and masked per element (see
    # decode.py: memory-bound, it gains nothing from the fused exponent, and the per-row band cost it 18% at batch 64)
    del flags["MASK_KIND"], flags["SCALE_IN_EXP2"]
    _, score_scale, softcap_scale, softcap_out, _, window_left, window_right = scalars
    out_shape = (batch, seqlen_q, p.nheads, p.headdim_v)
    out_strides = _row_strides(torch.empty(out_shape, device="meta"), 1)  # decode() allocates out contiguous
    tile_rows = p.group_size * seqlen_q  # the rows of a (batch, K/V head) tile that exist (not its padding)
    # the split partials: outputs (batch * nheads_k, splits, tile_rows, BLOCK_DV), then their lse from part_lse_start
    partial_rows = batch * p.nheads_k * shape.splits * tile_rows if shape.splits > 1 else 0
    part_lse_start = partial_rows * flags["BLOCK_DV"]
    seqlen_new = 0 if call.k_new is None else call.k_new.shape[1]
    store_lse = call.layout.return_lse
    kernel = FixedLaunch(
        attention_decode_kernel,
        (*_row_strides(q, 1), *_row_strides(k_cache, 1), *_row_strides(v_cache, 1), table.stride(0), slopes_stride,
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
            dict(HEADDIM_V=p.headdim_v, BLOCK_DV=flags["BLOCK_DV"], BLOCK_S=_next_power_of_2(shape.splits),
                 STORE_LSE=store_lse, HAS_SINK=p.has_sink))
    # one-axis grids (common.program_coordinates), kept as three ints for the relaunch
    return _DecodePlan((*_grid(shape.splits * shape.row_blocks * batch * p.nheads_k), 1, 1), kernel,
                       (*_grid(tile_rows * batch * p.nheads_k), 1, 1), combine, out_shape,
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
    precision = _dot_precision(q.dtype)
    key = (call.layout, num_splits, geometry, precision)
    slopes, slopes_stride = _slopes_arg(q, call.alibi_slopes)
    sink = _sink_arg(q, call.learnable_sink)
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
    block_h = min(_next_power_of_2(nheads if rotary else nheads_k),
                  max(1, APPEND_TILE_ELEMENTS // _next_power_of_2(max(headdim, headdim_v))))
    out_strides = _row_strides(torch.empty(q.shape, device="meta"), 1)  # append_to_cache allocates it contiguous
    table_stride = call.block_table.stride(0) if call.block_table is not None else 0
    table_strides = (*call.rotary_cos.stride(), *call.rotary_sin.stride()) if rotary else (0, 0, 0, 0)
    kernel = FixedLaunch(
        kvcache_append_kernel,
        (*_row_strides(q, 1), *k_new.stride(), *v_new.stride(), *table_strides, *out_strides,
         *_row_strides(k_cache, 1), *_row_strides(v_cache, 1), table_stride,
         batch, seqlen_q, seqlen_new, nheads, nheads_k, layout.rotary_len if rotary else 1, call.capacity,
         call.page_size or 1, k_cache.shape[0]),
        dict(HEADDIM=headdim, HEADDIM_V=headdim_v, ROTARY_HALF=half, INTERLEAVED=rotary and layout.rotary_interleaved,
             ROTARY=rotary, Q_SHIFTED=rotary and layout.rotary_shifted, PAGED=call.page_size is not None,
             HAS_BATCH_IDX=call.cache_batch_idx is not None, BLOCK_H=block_h, BLOCK_R=_next_power_of_2(max(1, half)),
             BLOCK_P=_next_power_of_2(max(1, headdim - 2 * half)), BLOCK_DV=_next_power_of_2(headdim_v),
             num_warps=4,
             # every product and sum rounded on its own, as torch's eager rotate rounds them: the same bits
             enable_fp_fusion=False))
    rows = batch * (seqlen_q + seqlen_new) if rotary else batch * seqlen_new
    grid = (*_grid(rows), _cdiv(nheads if rotary else nheads_k, block_h), 1)
    return _AppendPlan(grid, kernel, rotary, tuple(q.shape), q.dtype, q.device)


# Append plans by validated layout (compared by identity, as _DECODE_PLANS)
_APPEND_PLANS: dict = {}


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
        if len(_APPEND_PLANS) >= MAX_DECODE_PLANS:
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
