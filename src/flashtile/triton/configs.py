"""Tile shapes, warps and pipeline stages of the Triton kernels, per head dim, dtype and GPU.

`default_tiles` is the table. Each of its rules says what it chooses, why, and which result file measured it
(paths relative to benchmarks/results/; raw/ holds the logs); docs/tuning.md has the full reasoning and the
variants that lost. Under the CPU interpreter (TRITON_INTERPRET=1) the tiles are 16 x 16, the smallest that
tl.dot accepts, so CI exercises many blocks, ragged edges and masks quickly.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass

import torch

from .._validate import AttentionProblem


@dataclass(frozen=True)
class GluonTile:
    """One launch configuration of the Gluon forward (fwd_gluon.py). Its tile is 64 query rows per consumer
    warpgroup (two or three) against blocks of block_n keys."""

    block_n: int = 128  # 64, 128 or 256 (256-wide heads take 64: gluon_block_n)
    num_stages: int = 2  # K and V blocks in flight (the ring's stages)
    overlap: bool = True  # within each consumer, Q Kᵀ of block j + 1 issued before P V of block j
    pingpong: bool = False  # the two consumers take turns issuing their matmuls (two consumers only)
    persistent: bool = True  # one CTA per SM looping over tiles; False: one CTA per tile
    balanced: bool = False  # persistent: tiles dealt by the launcher to the least loaded CTA, not in snake order
    # consumer warpgroups; three (192 query rows) is FlashAttention-3's tile at d = 64; one (64 query rows) runs two
    # CTAs per SM, which the warp schedulers interleave as pingpong interleaves two consumers, from one copy of code
    consumers: int = 2
    exp2_emulated: int = 0  # n: one exponential in n on the FMA units (FlashAttention-4's move; 0 none, 2, 4 or 8)
    # with overlap: the next tile's first score matmul and softmax step issued under this tile's last P V (each
    # consumer holds the query rows of two tiles)
    across_tiles: bool = False
    # with overlap, two consumers, blocks of 128 keys and a band closing at the diagonal offset by a multiple of 128
    # (configs._half_diagonal_reason): a tile's last key block, whose second half the first consumer's rows do not
    # see (their causal diagonal block), computed on its first half by that consumer
    half_diagonal: bool = False
    # FlashAttention-4's conditional rescaling (the fa4 schedule): a row's max moved only when a block raises it by
    # more than this (base 2; 0: always moved)
    rescale_threshold: int = 0

    @property
    def block_m(self) -> int:
        return 64 * self.consumers

    @property
    def consumer_registers(self) -> int:
        """setmaxnreg of each consumer warpgroup: with the load warpgroup's 24 (two consumers) or 32 (three), the
        warpgroups fill the 64K registers of an SM."""
        return {1: 232, 2: 240, 3: 160}[self.consumers]

    @property
    def max_registers(self) -> int:
        """The launch's cap per thread: ctas_per_sm x (1 + consumers) warpgroups x 128 threads x the cap fit 64K
        registers."""
        return 168 if self.consumers == 2 else 128

    @property
    def ctas_per_sm(self) -> int:
        """CTAs resident per SM (a persistent grid launches this many per SM): two with one consumer (two load and
        two consumer warpgroups, 128 registers a thread on average), else one."""
        return 2 if self.consumers == 1 else 1

    def _grid(self) -> str:
        if not self.persistent:
            return "one CTA per tile"
        return "a persistent grid, " + ("tiles dealt to the least loaded CTA" if self.balanced else
                                        "tiles dealt in snake order")

    def describe(self) -> str:
        consumers = ("1 consumer warpgroup of 64 rows, 2 CTAs per SM" if self.consumers == 1 else
                     f"{self.consumers} consumer warpgroups of 64 rows")
        return (f"BLOCK_M {self.block_m} ({consumers}) x BLOCK_N {self.block_n}, "
                f"{self.num_stages} K/V stages, {'with' if self.overlap else 'without'} intra-warpgroup overlap, "
                f"{'with' if self.pingpong else 'without'} pingpong, "
                f"{self._grid()}"
                + (", the next tile's first block under each tile's last P V, " if self.across_tiles else ", ")
                + f"{self.consumer_registers} registers per consumer thread"
                + (f", one exponential in {self.exp2_emulated} on the FMA units" if self.exp2_emulated else "")
                + (f", a row's max moved only when a block raises it by more than {self.rescale_threshold} (base 2)"
                   if self.rescale_threshold else "")
                + (", each tile's last block computed on its first half by the first consumer (whose rows do not "
                   "see its second half)" if self.half_diagonal else ""))


@functools.lru_cache(maxsize=256)
def _gluon_tile_of(block_n: int, stages: int, overlap: int, pingpong: int, persistent: int, consumers: int,
                   balanced: int, exp2_emulated: int, across_tiles: int, half_diagonal: int,
                   rescale_threshold: int) -> GluonTile:
    return GluonTile(block_n=block_n, num_stages=stages, overlap=bool(overlap), pingpong=bool(pingpong),
                     persistent=bool(persistent), consumers=consumers, balanced=bool(balanced),
                     exp2_emulated=exp2_emulated, across_tiles=bool(across_tiles), half_diagonal=bool(half_diagonal),
                     rescale_threshold=rescale_threshold)


GLUON_WIDTHS = (64, 128, 256)  # padded q/k and v head widths the Gluon forward serves (256: d == dv only)
# Gluon is an experimental API that moves between Triton releases: the releases whose names gluon_compat.py maps
# and whose compile CI checks (tests/test_gluon_compile.py; 3.6.0 is also the H200's, where it runs)
GLUON_TRITON_VERSIONS = ("3.6.0", "3.9.0")
# the releases under which the table takes gluon_half_diagonal: measured faster on the H200 under 3.6.0, where ptxas
# keeps its wgmma in flight; under 3.9.0 ptxas serialises the wgmma of that variant with each tile started under the
# last (tests/test_gluon_compile.py), so the table leaves it off there
HALF_DIAGONAL_TABLE_TRITON = ("3.6.0",)
SHARED_MEMORY_LIMIT = 232448  # bytes of shared memory one CTA may use on sm_90


def padded_width(dim: int) -> int:
    """The tile width a head dim takes in the kernels: the next power of two, at least 16."""
    return max(16, 1 << max(0, dim - 1).bit_length())


def gluon_block_n(problem: AttentionProblem, tile: GluonTile) -> int:
    """Keys per block of the Gluon forward: the tile's, or 64 for 256-wide heads (their K and V blocks of 128 keys
    leave no room for two stages)."""
    wide = max(padded_width(problem.headdim), padded_width(problem.headdim_v)) > 128
    return 64 if wide else tile.block_n


def gluon_shares_qo(problem: AttentionProblem, tile: GluonTile) -> bool:
    """Whether the output is staged in the query rows' buffer: where a buffer of its own would not fit (256-wide
    heads); it needs d == dv (one box shape)."""
    return padded_width(problem.headdim) == padded_width(problem.headdim_v) and \
        _gluon_bytes(problem, tile, shared_qo=False) > SHARED_MEMORY_LIMIT


def _gluon_bytes(problem: AttentionProblem, tile: GluonTile, shared_qo: bool) -> int:
    d, dv = padded_width(problem.headdim), padded_width(problem.headdim_v)
    queries = tile.block_m * d * (2 if tile.across_tiles else 1)
    staging = queries if shared_qo else queries + tile.block_m * dv
    return 2 * (staging + tile.num_stages * gluon_block_n(problem, tile) * (d + dv)) + 1024


def gluon_shared_bytes(problem: AttentionProblem, tile: GluonTile) -> int:
    """Shared memory of the Gluon forward: the consumers' query rows and output staging (one buffer for both where
    gluon_shares_qo), the K/V ring, barriers."""
    return _gluon_bytes(problem, tile, gluon_shares_qo(problem, tile))


def _triton_version() -> str:
    import triton

    return triton.__version__


def _gluon_platform_reason(p: AttentionProblem) -> str:
    """Why no Gluon kernel serves `p` on this process's Triton and GPU ('' where one may): no Gluon, another Triton
    release, the interpreter or another GPU, another dtype, an attn_mask."""
    import triton

    from . import gluon_compat

    if not gluon_compat.AVAILABLE:
        return gluon_compat.UNAVAILABLE_REASON
    if triton.__version__ not in GLUON_TRITON_VERSIONS:
        return (f"it is checked with triton {' and '.join(GLUON_TRITON_VERSIONS)}, and this is triton "
                f"{triton.__version__}")
    if interpreting() or p.device.type != "cuda":
        return "Gluon kernels do not run in Triton's CPU interpreter"
    major, minor = torch.cuda.get_device_capability(p.device)
    if (major, minor) != (9, 0):
        return f"it is written for sm_90 (Hopper), this GPU is sm_{major}{minor}"
    if p.dtype not in (torch.float16, torch.bfloat16):
        return f"it takes fp16 / bf16, not {p.dtype}"
    if p.mask_kind is not None:
        return f"an attn_mask ({p.mask_kind}) runs the Triton kernels"
    return ""


def gluon_backward_tile(problem: AttentionProblem, overlap: bool = False) -> tuple[int, int]:
    """(query rows per block, Q / dO ring stages) of the Gluon dK/dV kernel (bwd_gluon.py): 64 rows where both head
    widths pad to 64, else 32 (at 64, with a 128-wide dK or dV accumulator, ptxas spills: the transposed score tiles'
    per-column lse and delta take 16 registers each); 2 stages, 3 with the intra-warpgroup overlap
    (gluon_backward_overlap: a consumer holds two blocks' stages at once, so a third lets the next block load under
    them). Not tuned on a GPU."""
    wide = max(padded_width(problem.headdim), padded_width(problem.headdim_v)) > 64
    return (32 if wide else 64), (3 if overlap else 2)


def fused_gluon_backward_tile(problem: AttentionProblem) -> tuple[int, int]:
    """(query rows per block, Q / dO ring stages) of the fused Gluon backward (backward schedule 5,
    bwd_gluon_fused.py): gluon_backward_tile's, except 16 rows where both head widths pad to 128 and the band has a
    left edge (a window): at 32 there, beside the 128-wide dK, dV and dQᵀ accumulators, triton 3.6's ptxas spills
    16 / 28 bytes per thread (triton 3.9 none). Not tuned on a GPU."""
    rows, stages = gluon_backward_tile(problem)
    if padded_width(problem.headdim) == padded_width(problem.headdim_v) == 128 and problem.window_left >= 0:
        rows = 16
    return rows, stages


def gluon_backward_unserved_reason(problem: AttentionProblem, overlap: bool = False, fused: bool = False) -> str:
    """Why the Gluon dK/dV kernel (backward schedule 4, bwd_gluon.py), or with `fused` the fused Gluon backward
    (schedule 5, bwd_gluon_fused.py), does not serve `problem` ('' where it does), with the intra-warpgroup overlap
    where `overlap` (gluon_backward_overlap); the tensors' alignment is checked at launch."""
    p = problem
    if fused and overlap:
        return ("the fused Gluon backward (backward_schedule=5) has no intra-warpgroup overlap; use "
                "gluon_backward_overlap=0")
    if p.dropout_p > 0:  # a property of the call, reported before the platform's reasons
        return "dropout runs the Triton backward (the Gluon dK/dV kernel has no dropout)"
    reason = _gluon_platform_reason(p)
    if reason:
        return reason
    if p.varlen:
        return "packed batches run the Triton backward (the Gluon dK/dV kernel takes dense batches)"
    if p.softcap > 0 or p.has_alibi:
        return "softcap and ALiBi run the Triton backward (their extra score tiles spill the Gluon kernel's registers)"
    widths = padded_width(p.headdim), padded_width(p.headdim_v)
    if not all(w in (64, 128) for w in widths):
        return f"head dims {p.headdim} / {p.headdim_v} pad to widths {widths[0]} / {widths[1]}, not 64 or 128"
    if overlap:
        return _backward_overlap_reason(p)
    return ""


def _backward_overlap_reason(p: AttentionProblem) -> str:
    """Why the Gluon dK/dV kernel cannot run `p` with the intra-warpgroup overlap (gluon_backward_overlap) ('' where
    it can): with both head widths 128 and a band, the band's mask beside the 64 x 128 dK and dV accumulators and two
    query blocks' operands spilled 8-28 bytes per thread under triton 3.6 and 20-24 under 3.9."""
    if padded_width(p.headdim) == padded_width(p.headdim_v) == 128 and p.is_banded:
        return ("the intra-warpgroup overlap (gluon_backward_overlap) with 128-wide heads (d and dv) and a band "
                "(causal or a window) spills registers; it serves head width 64, widths 64 / 128 apart, and 128-wide "
                "heads without a band")
    return ""


def _across_tiles_reason(p: AttentionProblem, tile: GluonTile) -> str:
    """Why the next tile's first block cannot start under a tile's last P V (gluon_across_tiles) here ('' where it
    can). The kernel takes each tile's first block as done before the tile, which holds where every tile sees a key."""
    setting = "the next tile's first block under a tile's last P V (gluon_across_tiles)"
    if not tile.overlap:
        return f"{setting} continues the intra-warpgroup overlap: it needs gluon_overlap=1"
    if p.varlen or p.window_left >= 0 or (p.window_right >= 0 and p.diagonal_offset + p.window_right < 0):
        return (f"{setting} is built for dense batches without a left band edge where every row sees a key (no "
                "band, or causal with seqlen_q <= seqlen_k)")
    if tile.consumers == 3:
        return f"{setting} with three consumer warpgroups (160 registers each) spills"
    if p.has_alibi:
        return f"{setting} with ALiBi spills under triton 3.9"
    if gluon_shares_qo(p, tile):
        return (f"{setting} keeps two tiles' query rows beside the output's staging, which does not fit shared "
                "memory here")
    return ""


def _half_diagonal_reason(p: AttentionProblem, tile: GluonTile) -> str:
    """Why the first consumer cannot compute a tile's last block on its first half (gluon_half_diagonal) here ('' where
    it can). The kernel takes it as a compile-time choice for that consumer, exact where the band closes at the
    diagonal, tiles of 128 rows meet blocks of 128 keys, the diagonal offset is a multiple of 128 and the diagonal
    crosses the keys of every tile: then each tile's last block starts at m0 + diagonal_offset and the first
    consumer's 64 rows see its first 64 keys only (fwd_gluon._consumer). A diagonal past the last key (an offset of
    seqlen_k - seqlen_q or less always crosses them; ring attention's pairs of chunks pass larger ones) leaves a
    tile's last block whole to both consumers."""
    setting = "the first consumer's last block on its first half (gluon_half_diagonal)"
    if not tile.overlap:
        return f"{setting} is built into the intra-warpgroup overlap: it needs gluon_overlap=1"
    if p.varlen:
        return f"{setting} is built for dense batches"
    if tile.consumers != 2 or gluon_block_n(p, tile) != 128:
        return (f"{setting} is built for two consumer warpgroups (128-row tiles) and blocks of 128 keys, got "
                f"{tile.consumers} and {gluon_block_n(p, tile)}")
    if p.window_right != 0:
        return f"{setting} needs a band that closes at the diagonal (causal, or a window with window_right = 0)"
    if p.diagonal_offset % 128:
        return (f"{setting} needs seqlen_k - seqlen_q (the diagonal's offset) to be a multiple of 128, got "
                f"{p.diagonal_offset}")
    if not _diagonal_crosses_every_tile(p):
        return (f"{setting} needs the diagonal to cross every tile's keys (diagonal offset + the last tile's first "
                f"row < seqlen_k), got offset {p.diagonal_offset} with {p.seqlen_q} query rows and {p.seqlen_k} keys")
    return ""


def _diagonal_crosses_every_tile(p: AttentionProblem) -> bool:
    """Whether the band's diagonal (key j = query i + diagonal_offset) passes through the keys of every 128-row tile:
    the last tile's first row plus the offset is a key (a tile whose rows all lie before it sees no key at all)."""
    return p.diagonal_offset + (p.seqlen_q - 1) // 128 * 128 < p.seqlen_k


def gluon_unserved_reason(problem: AttentionProblem, tile: GluonTile) -> str:
    """Why the Gluon forward does not serve `problem` ('' where it does); the tensors' alignment is checked at
    launch (launch.gluon_unserved)."""
    p = problem
    if p.dropout_p > 0:  # a property of the call, reported before the platform's reasons
        return "dropout runs the Triton kernels (the Gluon forward has no dropout)"
    reason = _gluon_platform_reason(p)
    if reason:
        return reason
    if p.varlen and tile.persistent and tile.balanced:
        return ("the launcher's deal of tiles (gluon_balanced) needs the sequences' lengths on the host, which a "
                "packed batch keeps on the GPU")
    if p.kvcache:
        return "KV-cache calls run the Triton kernels"
    widths = padded_width(p.headdim), padded_width(p.headdim_v)
    if not all(w in GLUON_WIDTHS for w in widths):
        return f"head dims {p.headdim} / {p.headdim_v} pad to widths {widths[0]} / {widths[1]}, not 64, 128 or 256"
    if tile.consumers not in (1, 2, 3) or (tile.pingpong and tile.consumers != 2):
        pingpong = " in pingpong" if tile.pingpong else ""
        return f"{tile.consumers} consumer warpgroups{pingpong}: it takes one, two or three, pingpong two"
    if tile.consumers == 3 and max(widths) > 64:
        return "three consumer warpgroups (160 registers each) take head widths up to 64"
    if tile.exp2_emulated not in (0, 2, 4, 8):
        return (f"one exponential in n on the FMA units (gluon_exp2_emulated) takes n = 2, 4 or 8, got "
                f"{tile.exp2_emulated}")
    if tile.block_n not in (64, 128, 256):
        return f"keys per block (gluon_block_n) are 64, 128 or 256, got {tile.block_n}"
    if gluon_block_n(p, tile) == 256 and tile.consumers == 3:
        return "three consumer warpgroups (160 registers each) take blocks of up to 128 keys (256: ptxas fails)"
    if gluon_block_n(p, tile) == 256 and tile.overlap:
        return ("blocks of 256 keys with intra-warpgroup overlap hold two 64 x 256 score tiles at once and spill; "
                "they run without it (gluon_overlap=0)")
    if tile.across_tiles:
        reason = _across_tiles_reason(p, tile)
        if reason:
            return reason
    if tile.half_diagonal:
        reason = _half_diagonal_reason(p, tile)
        if reason:
            return reason
    if tile.consumers == 3 and p.varlen:
        return "three consumer warpgroups (160 registers each) spill with a packed batch's bookkeeping"
    if max(widths) > 128 and widths[0] != widths[1]:
        return (f"256-wide heads need d == dv (the output shares the query rows' buffer), got {p.headdim} / "
                f"{p.headdim_v}")
    if gluon_shared_bytes(p, tile) > SHARED_MEMORY_LIMIT:
        return (f"{tile.num_stages} stages need {gluon_shared_bytes(p, tile):,} bytes of shared memory, more than "
                f"sm_90's {SHARED_MEMORY_LIMIT:,}")
    if tile.ctas_per_sm > 1 and tile.ctas_per_sm * gluon_shared_bytes(p, tile) > SHARED_MEMORY_LIMIT:
        return (f"one consumer warpgroup runs {tile.ctas_per_sm} CTAs per SM, and {tile.num_stages} stages of "
                f"{gluon_block_n(p, tile)} keys need {gluon_shared_bytes(p, tile):,} bytes of shared memory each, "
                f"more than sm_90's {SHARED_MEMORY_LIMIT:,} for {tile.ctas_per_sm}")
    return ""


@dataclass(frozen=True)
class TritonTiles:
    """One launch configuration for the forward kernel and one for the backward kernels.

    The backward's dK/dV kernel takes bwd_block_m query rows against bwd_block_n keys; its dQ
    kernel uses the transposed tile (bwd_block_n query rows against bwd_block_m keys).
    """

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    bwd_block_m: int
    bwd_block_n: int
    bwd_num_warps: int
    bwd_num_stages: int
    # 0: pointer loads (fwd.py); 1: TMA descriptors; 2: TMA + warp specialization (fwd_tma.py); 3: the Gluon forward
    # (fwd_gluon.py) where it serves the call, schedule 1 where not; 5: the decode kernels (decode.py) over the keys as
    # a full cache (decode_forward)
    forward_schedule: int = 0
    # backward: 0 the dK/dV then the dQ kernel; 1 both kinds of program in one launch; 2, 3 as 0, 1 with the
    # streamed Q/dO (dK/dV programs) and K/V (dQ programs) tiles loaded by TMA (bwd.py)
    backward_schedule: int = 0
    # the dQ kernel's own tile in the two-launch schedules (0, 2): query rows, keys per step, warps; 0 = the
    # dK/dV tile transposed (bwd_block_n query rows against bwd_block_m keys, bwd_num_warps)
    dq_block_m: int = 0
    dq_block_n: int = 0
    dq_num_warps: int = 0
    # the TMA forward's register cap per thread (ptxas .maxnreg); 0 = the compiler's choice. A cap low enough lets
    # two programs share an SM, so that one's pipeline fill and drain overlap the other's matmuls
    forward_max_registers: int = 0
    # 1: without a band closing on the right, the TMA forward gives the keys' ragged end a loop of its own instead
    # of masking it inside the interior loop by a runtime branch (a flag, 0 or 1)
    forward_separate_ragged_end: int = 0
    # the dQ kernel's register cap per thread in the two-launch schedules (ptxas .maxnreg); 0 = the compiler's choice
    dq_max_registers: int = 0
    # the Gluon forward (forward_schedule 3, fwd_gluon.py): keys per block (64, 128 or 256; 256-wide heads take 64),
    # K/V ring stages, and three flags: Q Kᵀ of block j + 1 issued before P V of block j (overlap), the consumer
    # warpgroups taking turns (pingpong), one CTA per SM looping over tiles (persistent)
    gluon_block_n: int = 128
    gluon_stages: int = 2
    gluon_overlap: int = 1
    gluon_pingpong: int = 0
    gluon_persistent: int = 1
    gluon_consumers: int = 2  # consumer warpgroups of 64 query rows: 2 or 3
    gluon_balanced: int = 0  # persistent grid: the launcher deals the tiles (longest first, least loaded CTA)
    gluon_exp2_emulated: int = 0  # GluonTile.exp2_emulated; never chosen by the table (it measured slower)
    gluon_across_tiles: int = 0  # GluonTile.across_tiles
    gluon_half_diagonal: int = 0  # GluonTile.half_diagonal
    # FlashAttention-4's moves in the Triton forwards (fwd.py, fwd_tma.py), set by the fa4 schedule only (0 elsewhere):
    # a row's running max kept while a block raises it by at most rescale_threshold (base 2; 0: always moved), and
    # one probability column in exp2_poly_every (2, 4 or 8; 0 none) by a cubic on the FMA units
    rescale_threshold: int = 0
    exp2_poly_every: int = 0
    # the Gluon dK/dV kernel (backward schedule 4): within each consumer, Sᵀ and dPᵀ of query block j + 1 issued
    # before dV and dK of block j (a flag; measured slower on the H200, so never chosen by the table)
    gluon_backward_overlap: int = 0
    # the schedule a caller forced (use_backend(..., schedule=...) or FLASHTILE_SCHEDULE), as SCHEDULE_CODES[name];
    # 0: the table's choice. An int like every other field, so that the tiles travel as a list of ints (the custom
    # ops, the resolution cache); not a tile setting (TILE_KEYS leaves it out)
    forced_schedule: int = 0

    @property
    def dq_tile(self) -> tuple[int, int, int]:
        """(query rows, keys per step, warps) of the dQ programs."""
        return (self.dq_block_m or self.bwd_block_n, self.dq_block_n or self.bwd_block_m,
                self.dq_num_warps or self.bwd_num_warps)

    @property
    def gluon_tile(self) -> GluonTile:
        """The Gluon forward's launch configuration (one object per distinct setting: a call reads it twice)."""
        return _gluon_tile_of(self.gluon_block_n, self.gluon_stages, self.gluon_overlap, self.gluon_pingpong,
                              self.gluon_persistent, self.gluon_consumers, self.gluon_balanced,
                              self.gluon_exp2_emulated, self.gluon_across_tiles, self.gluon_half_diagonal,
                              self.rescale_threshold)

    @property
    def backward_one_launch(self) -> bool:
        """Backward schedules 1 and 3: the dK/dV and dQ programs in one launch (attention_bwd_kernel)."""
        return self.backward_schedule in (1, 3)

    @property
    def backward_tma(self) -> bool:
        """Backward schedules 2 and 3: the streamed tiles by TMA where the tensors allow it (launch.backward)."""
        return self.backward_schedule >= 2

    def describe(self, problem: AttentionProblem) -> str:
        dq_rows, dq_keys, dq_warps = self.dq_tile
        registers = f", at most {self.forward_max_registers} registers" if self.forward_max_registers else ""
        dq_registers = f", at most {self.dq_max_registers} registers" if self.dq_max_registers else ""
        triton_forward = (f"forward ({FORWARD_SCHEDULES[self.forward_schedule if self.forward_schedule < 3 else 1]}) "
                          f"BLOCK_M {self.block_m} x BLOCK_N {self.block_n}, {self.num_warps} warps, "
                          f"{self.num_stages} stages{registers}")
        if self.rescale_threshold or self.exp2_poly_every:
            moves = []
            if self.rescale_threshold:
                moves.append(f"a row's max moved only when a block raises it by more than {self.rescale_threshold} "
                             f"(base 2, a factor {2 ** self.rescale_threshold})")
            if self.exp2_poly_every:
                moves.append(f"one exponential in {self.exp2_poly_every} by a cubic on the FMA units")
            triton_forward += f", with FlashAttention-4's moves: {'; '.join(moves)}"
        forward = triton_forward
        if self.forced_schedule == SCHEDULE_CODES["fa1"]:
            forward = (f"forward (attention_fwd_fa1_kernel, key blocks outer, O / m / l through global memory) "
                       f"BLOCK_M {self.block_m} x BLOCK_N {self.block_n}, {self.num_warps} warps")
        elif self.forward_schedule == DECODE_FORWARD_SCHEDULE:
            forward = f"forward ({FORWARD_SCHEDULES[DECODE_FORWARD_SCHEDULE]})"
        elif self.forward_schedule == 3:
            reason = gluon_unserved_reason(problem, self.gluon_tile)
            forward = (f"forward: the Gluon forward does not serve this call ({reason}), so {triton_forward}" if reason
                       else f"forward ({FORWARD_SCHEDULES[3]}): {self.gluon_tile.describe()}")
        dq_programs = f"; dQ programs {dq_rows} query rows x {dq_keys} keys, {dq_warps} warps{dq_registers}"
        # where the Gluon dK/dV kernel does not serve a call, the two-launch TMA schedule runs
        triton_schedule = 2 if self.backward_schedule in GLUON_BACKWARD_SCHEDULES else self.backward_schedule
        triton_backward = (f"backward ({BACKWARD_SCHEDULES[triton_schedule]}) BLOCK_M "
                           f"{self.bwd_block_m} x BLOCK_N {self.bwd_block_n}, {self.bwd_num_warps} warps, "
                           f"{self.bwd_num_stages} stages{dq_programs}")
        backward = triton_backward
        if self.backward_schedule in GLUON_BACKWARD_SCHEDULES:
            overlap = bool(self.gluon_backward_overlap)
            fused = self.backward_schedule == FUSED_GLUON_BACKWARD_SCHEDULE
            reason = gluon_backward_unserved_reason(problem, overlap, fused)
            rows, stages = fused_gluon_backward_tile(problem) if fused else gluon_backward_tile(problem, overlap)
            overlapped = (", the next query block's score matmuls issued before each block's dV and dK "
                          "(intra-warpgroup overlap)" if overlap else "")
            kernel = "the fused Gluon backward" if fused else "the Gluon dK/dV kernel"
            after = ("; dQ added by TMA reduce into a float32 accumulator, then converted" if fused else dq_programs)
            backward = (f"backward: {kernel} does not serve this call ({reason}), so "
                        f"{triton_backward}" if reason else
                        f"backward ({BACKWARD_SCHEDULES[self.backward_schedule]}): 128 keys per CTA against "
                        f"{rows} query rows per block, {stages} Q / dO stages{overlapped}, one CTA per key block"
                        f"{after}")
        return f"{forward}; {backward}"


FORWARD_SCHEDULES = {
    0: "attention_fwd_kernel, pointer loads",
    1: ("attention_fwd_tma_kernel, host-side TMA descriptors, when strides are 16-byte aligned, there are keys "
        "and there is no attn_mask (dense or packed batches)"),
    2: ("attention_fwd_tma_kernel, TMA + warp specialization, when strides are 16-byte aligned, the batch is "
        "dense, there are keys and there is no attn_mask (opt-in and experimental: under triton 3.6 on an H200, "
        "beside other GPU processes, 3 of 382,482 reruns returned NaN; it warns when it runs)"),
    3: ("attention_fwd_gluon_kernel (Gluon, explicit warp roles: a load warpgroup streaming K/V by TMA, two "
        "consumer warpgroups with asynchronous wgmma and P in registers) on sm_90 for fp16 / bf16 dense or packed "
        "calls of padded head widths 64 / 128 (256 with d == dv) without attn_mask; any other call takes "
        "attention_fwd_tma_kernel as schedule 1"),
    5: ("attention_decode_kernel (+ attention_decode_combine_kernel when the keys are split): Flash-Decoding over "
        "the keys as a full KV cache, a K/V head's query rows in one tile"),
}
DECODE_FORWARD_SCHEDULE = 5
# query rows per K/V head (seqlen_q x the GQA group) that one tile of the decode kernel holds: up to these, calls
# without a KV cache take the decode kernels (decode_forward)
DECODE_FORWARD_ROWS = 64

BACKWARD_SCHEDULES = {
    0: "attention_bwd_dq_kernel (which also computes each row's delta), then attention_bwd_dkdv_kernel",
    1: "attention_bwd_preprocess_kernel, then attention_bwd_kernel, the dK/dV and dQ programs in one launch",
    2: ("attention_bwd_dq_kernel (which also computes each row's delta), then attention_bwd_dkdv_kernel, streamed "
        "tiles loaded through host-side TMA descriptors when strides are 16-byte aligned, there is more than one key "
        "and there is no attn_mask (packed batches: the interior blocks; their edge blocks by pointer loads)"),
    3: ("attention_bwd_preprocess_kernel, then attention_bwd_kernel, the dK/dV and dQ programs in one launch, "
        "streamed tiles loaded through host-side TMA descriptors when strides are 16-byte aligned, there is more "
        "than one key and there is no attn_mask (packed batches: the interior blocks; their edge blocks by pointer "
        "loads)"),
    4: ("attention_bwd_dq_kernel (which also computes each row's delta), then attention_bwd_dkdv_gluon_kernel "
        "(Gluon, explicit warp roles: a load warpgroup streaming Q and dO by TMA, two wgmma consumer warpgroups of "
        "64 keys each)"),
    5: ("attention_bwd_preprocess_kernel, then attention_bwd_fused_gluon_kernel (Gluon, FlashAttention-3's "
        "dataflow: a load warpgroup streaming Q and dO by TMA, two wgmma consumer warpgroups of 64 keys each computing "
        "dK, dV and each query block's dQ from one S and one dP, dQ added into a float32 accumulator by TMA "
        "reduce-add), then attention_bwd_dq_convert_kernel (dQ is not bitwise reproducible)"),
}
# the Gluon backward kernels (4: dK/dV beside bwd.py's dQ kernel; 5: dK, dV and dQ in one kernel); where the
# schedule's kernel does not serve a call, schedule 2 runs
GLUON_BACKWARD_SCHEDULES = (4, 5)
FUSED_GLUON_BACKWARD_SCHEDULE = 5

# the schedules of the registry (flashtile.schedules) as TritonTiles.forced_schedule encodes them; 0 is none
SCHEDULE_CODES = {"fa1": 1, "fa2": 2, "fa3": 3, "fa4": 4, "decode": 5}
# the fa4 schedule's settings (TritonTiles.rescale_threshold, exp2_poly_every, and on the Gluon forward
# gluon_exp2_emulated; docs/schedules.md): FlashAttention-4's threshold of 8 (a factor 256), and one exponential in
# 4 on the FMA units where P is rounded to fp16 / bf16 for its matmul (the cubic's 1.0e-4 relative error lies below
# that rounding; fp32 keeps P in fp32, and every exponential on the exp2 unit). Measured one at a time on the H200:
# BENCHMARKS.md, "One algorithm, five schedules on one GPU".
FA4_RESCALE_THRESHOLD = 8
FA4_EXP2_POLY_EVERY = 4
# at most 15: probabilities up to 2^15 stay finite in fp16 (65,504) when P is rounded for its matmul
MAX_RESCALE_THRESHOLD = 15
EXP2_POLY_CHOICES = (0, 2, 4, 8)
FA4_KEYS = ("rescale_threshold", "exp2_poly_every")  # tile settings that only the fa4 schedule takes
SCHEDULE_NAMES = {code: name for name, code in SCHEDULE_CODES.items()}

TILE_KEYS = tuple(key for key in TritonTiles.__dataclass_fields__ if key != "forced_schedule")
DQ_TILE_KEYS = ("dq_block_m", "dq_block_n", "dq_num_warps")  # 0 = the dK/dV tile transposed (TritonTiles.dq_tile)
DQ_KEYS = DQ_TILE_KEYS + ("dq_max_registers",)  # what only the two-launch schedules' dQ kernel has
FORWARD_TILE_KEYS = ("block_m", "block_n", "num_warps", "num_stages", "forward_schedule")  # forced: no table cap
ZERO_MEANS_DEFAULT = DQ_KEYS + ("forward_max_registers",)  # tile settings for which 0 is the default
# tile settings that are 0 or 1
FLAG_KEYS = ("forward_separate_ragged_end", "gluon_overlap", "gluon_pingpong", "gluon_persistent",
             "gluon_balanced", "gluon_across_tiles", "gluon_half_diagonal", "gluon_backward_overlap")

# Packed batches: each sequence's programs cover at most this many of its rows (queries in the forward and dQ grids,
# keys in the dK/dV grid) and loop over the rest, so that a long max_seqlen does not launch, for every short sequence,
# a column of programs that exit at once. 64 log-uniform lengths up to 8,076 (d = 128), fwd+bwd against the dense
# rate: 0.898x / 0.917x (non-causal / causal) covering 2,048 rows, 0.887x / 0.899x covering all, 0.862x / 0.884x
# covering 1,024 (raw/2026-11-29-h200-s6-varlen-grid-hints.txt).
VARLEN_GRID_ROWS = 2048


# Whether flashtile's kernels run in Triton's CPU interpreter. Triton decides that when a kernel is defined
# (TRITON_INTERPRET at that moment), so once launch.py has defined them the answer is theirs and is no longer
# read from the environment (a read cost ~1-2 us, and a decode step asked three times).
_kernels_interpreted: bool | None = None


def interpreting() -> bool:
    """Whether the Triton kernels run in the CPU interpreter: as defined, once they are (record_kernel_mode);
    before that, whether TRITON_INTERPRET is set now."""
    if _kernels_interpreted is not None:
        return _kernels_interpreted
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def record_kernel_mode(kernel) -> None:
    """Called by launch.py with one of its kernels once they are defined: fixes interpreting()'s answer."""
    from triton.runtime.interpreter import InterpretedFunction

    global _kernels_interpreted
    _kernels_interpreted = isinstance(kernel, InterpretedFunction)


def _separate_ragged_end(problem: AttentionProblem) -> int:
    """1 where the TMA forward gives the keys' ragged end a loop of its own: 4k keys and more, without a band.

    Below 4k keys the end shares the interior loop, masked there by a runtime branch: one pipelined loop per
    program instead of two saves a drain and refill. From 4k keys the shared loop measured slower (d = 64
    non-causal 4k: 389.2 against 402.5 TFLOP/s, raw/2026-11-30-h200-s13-call3-ragged-end-ab-bwd-suite.txt).
    Banded problems keep their right edge inside the interior loop at every length (d = 128 1k causal: 304.3
    against 289.6 TFLOP/s with two loops, raw/2026-11-30-h200-s12-call8-causal-forward-ab.txt).
    """
    return int(not problem.is_banded and problem.seqlen_k >= 4096)


def _gluon_forward(problem: AttentionProblem, hopper: bool) -> dict:
    """The Gluon forward's settings where the table takes it (forward_schedule 3), {} where it keeps the Triton
    forward. From runs of the settings on the 12-cell grid, bf16, beside cuDNN in the same run (TFLOP/s): run A
    (raw/2026-12-02-h200-gluon-forward-settings.jsonl, 12 settings at 9 cells), run B (-settings-one-loop.jsonl, 3
    settings at 12 cells), run C (-settings-loops-split-at-the-mask.jsonl: 10 settings of a build not kept, whose
    block loop was split at the band's edges and whose P was converted two elements at a time: it read the same
    within the runs' spread, and its conversion made the three-consumer tile spill under triton 3.9).
    - no band, below 4k queries or keys: two consumers, overlap, 2 stages, persistent in snake order, each tile
      started under the last one's P V (gluon_across_tiles; raw/2026-12-02-h200-gluon-forward-across-tiles.jsonl
      and -across-tiles-2.jsonl, the first of a build that also started causal tiles so, which spilled 16 bytes at
      d = 128 and gained nothing causal): d = 128 1k 602.3 / 577.7 against 561.6 / 562.1 without it (cuDNN
      567-580); d = 64 1k 430.0 / 432.8 against blocks of 256 keys without overlap 427.0 / 423.4 (which read
      424.3 / 421.8 against 408.1 / 410.7 for blocks of 128 with overlap and 3 stages, blocks of 64 keys 354-358:
      raw/2026-12-02-h200-gluon-forward-key-blocks.jsonl). From 4k it reads -1..+2%: off there. Not with ALiBi
      (it spills under triton 3.9): those calls take two consumers with overlap (d = 64: not measured).
    - no band, d = 128 from 4k: two consumers, overlap, persistent in snake order, no pingpong: 4k / 16k, B: 604 / 616
      against cuDNN 603 / 625.
    - no band, d = 64 from 4k queries and keys: three consumers (192-row tiles), 2 stages, overlap; persistent in
      snake order up to 16k (4k: A / B / C 479 / 469 / 481 against two consumers' 456 / 455 / 452, cuDNN 461 / 457 /
      457), one CTA per tile from 16k (A / C 502 / 504, where the snake order read 498 / 445 / 506; cuDNN 468 / 456).
      At 1k the third consumer's 192-row tiles leave a sixth of the last tile empty (A 384 against 413).
    - causal (a band on the right only), d = 128: two consumers, overlap, tiles dealt by the launcher (longest first
      onto the least loaded CTA): 1k / 4k / 16k, A / B: 427 / 425, 566 / 567, 604 / 607 against the snake order's
      389 / 381, 510 / 499, 554 / 547 (cuDNN 430 / 423, 541 / 529, 586 / 558).
    - causal, d = 64: at 4k keys as d = 128 (A / B 430 / 425 against one CTA per tile's 395 in A; cuDNN 423 / 415);
      from 16k keys three consumers without overlap, one CTA per tile (A / C 484 / 470 against the dealt two
      consumers' 460 / 444; cuDNN 442 / 438).
    - causal below 4k keys where every row sees a key, without ALiBi (raw/2026-12-03-h200-gluon-forward-causal-
      across-tiles.jsonl): dealt tiles, each started under the last one's P V; d = 128 with pingpong: 432.4 against
      423.3 dealt alone and 425.4 without pingpong (cuDNN 418 / 411); d = 64: 319.1 against 313.1 (cuDNN 336 / 331;
      the Triton forward, which d = 64 kept before, read 309 / 302 in A / B). From 4k keys it read -1.5..-2.5%.
      Elsewhere below 4k: d = 128 dealt tiles, d = 64 the Triton forward.
    - there, where the causal diagonal's offset is a multiple of 128 keys (seqlen_q == seqlen_k among them), the
      first consumer's last block on its first half (gluon_half_diagonal; raw/2026-12-03-h200-gluon-forward-half-
      diagonal-static.txt): d = 64 1k 318.2 -> 325.8 / 325.1 (cuDNN 336.7 / 335.2 / 332.6), d = 128 1k with pingpong
      425.4 -> 442.8 (cuDNN 428.2 / 413.8). Under triton 3.6 only (HALF_DIAGONAL_TABLE_TRITON).
    - a left window edge: not measured, the Triton forward stays.
    - packed batches (22 sequences of 64..4,096 tokens, 16,682 in all, raw/2026-12-02-h200-gluon-forward-packed.jsonl):
      d = 128 two consumers, overlap, persistent in snake order (the launcher's deal needs the lengths on the host):
      397.9 / 350.1 TFLOP/s non-causal / causal against the Triton forward's 362.1 / 292.4; d = 64 the Triton
      forward stays (329.5 / 274.7 against 291.2 / 250.8).
    Between the measured lengths (2k, 8k) a rule holds from the measured length at which it starts.
    """
    served = (hopper and not problem.kvcache and problem.mask_kind is None
              and padded_width(problem.headdim) in (64, 128) and padded_width(problem.headdim_v) in (64, 128))
    if not served or problem.window_left >= 0:
        return {}
    wide = max(padded_width(problem.headdim), padded_width(problem.headdim_v)) == 128
    # the gluon_* settings not named stay at TritonTiles' defaults: two consumers, 2 stages, overlap, persistent in
    # snake order, no pingpong
    base = dict(forward_schedule=3)
    if problem.varlen:
        return base if wide else {}
    if not problem.is_banded:
        shortest = min(problem.seqlen_q, problem.seqlen_k)
        if not wide and shortest >= 4096:
            return dict(base, gluon_consumers=3, gluon_persistent=int(shortest < 16384))
        return dict(base, gluon_across_tiles=1) if shortest < 4096 and not problem.has_alibi else base
    # below 4k keys, where every row sees a key and without ALiBi, each tile starts under the last one's P V, and
    # where the causal diagonal is offset by whole blocks the first consumer takes its last block on its first half
    across = (problem.seqlen_k < 4096 and not problem.has_alibi
              and problem.diagonal_offset + problem.window_right >= 0)
    # the half block where its own rule admits it on the table's tile (a band closing at a diagonal offset by whole
    # blocks that crosses every tile's keys), under the releases where it measured faster
    half = dict(gluon_half_diagonal=1) if (across and not _half_diagonal_reason(problem, GluonTile(across_tiles=True))
                                           and _triton_version() in HALF_DIAGONAL_TABLE_TRITON) else {}
    if wide:
        return dict(base, gluon_balanced=1, gluon_across_tiles=1, gluon_pingpong=1, **half) if across else \
            dict(base, gluon_balanced=1)
    if problem.seqlen_k >= 16384:
        return dict(base, gluon_consumers=3, gluon_overlap=0, gluon_persistent=0)
    if problem.seqlen_k >= 4096:
        return dict(base, gluon_balanced=1)
    return dict(base, gluon_balanced=1, gluon_across_tiles=1, **half) if across else {}


def decode_forward_unserved_reason(problem: AttentionProblem) -> str:
    """Why the decode kernels cannot run `problem`'s forward with k and v as a full KV cache ('' where they can): they
    take dense calls with keys, without attn_mask or dropout, whose band, if any, is aligned to the last key."""
    p = problem
    aligned = not p.is_banded or p.diagonal_offset == p.seqlen_k - p.seqlen_q
    for unserved, reason in ((p.varlen or p.paged, "packed batches"), (p.kvcache, "KV-cache calls"),
                             (p.mask_kind is not None, "an attn_mask"), (p.dropout_p > 0, "dropout"),
                             (not aligned, "a band aligned to the first key (SDPA's top-left causal)"),
                             (p.seqlen_k == 0, "calls without keys")):
        if unserved:
            return f"the decode kernels' forward does not take {reason}"
    return ""


def decode_forward(problem: AttentionProblem, hopper: bool) -> bool:
    """Whether the table runs a call's forward by the decode kernels, as flash_attn_with_kvcache would with k and v as
    a full cache (the backward stays the table's): on sm_90 for fp16 / bf16, a call they serve
    (decode_forward_unserved_reason) of at most DECODE_FORWARD_ROWS query rows per K/V head, such as a decode step
    through flash_attn_func (transformers' generate calls it so). There the Gluon forward fills a 128-row tile per
    query head, while the decode kernel reads each K/V head once for its whole GQA group and splits long key ranges
    over the SMs: 0.10-0.89x the Gluon forward's kernel time in nine such cells on the H200, 4 to 64 rows per K/V
    head, 600 to 32k keys (raw/2026-12-03-h200-decode-forward.jsonl, benchmarks/decode_forward.py)."""
    return (hopper and problem.seqlen_q * problem.group_size <= DECODE_FORWARD_ROWS
            and not decode_forward_unserved_reason(problem))


def default_tiles(problem: AttentionProblem, capability: tuple[int, int] | None) -> TritonTiles:
    """The table: the launch settings for `problem` on a GPU of compute capability `capability` (None: the CPU
    interpreter). The Triton kernels' tiles (_triton_tiles), with the decode kernels' forward for calls of a few
    query rows (decode_forward) and elsewhere the Gluon forward (schedule 3) in the cells where it measured faster
    (_gluon_forward); its Triton tile stays for the calls the Gluon forward turns away."""
    tiles = _triton_tiles(problem, capability)
    hopper = capability == (9, 0) and problem.dtype in (torch.float16, torch.bfloat16)
    if decode_forward(problem, hopper):
        return dataclasses.replace(tiles, forward_schedule=DECODE_FORWARD_SCHEDULE)
    return dataclasses.replace(tiles, **_gluon_forward(problem, hopper))


def portable_tiles(problem: AttentionProblem, capability: tuple[int, int] | None) -> TritonTiles:
    """The table without the Gluon forward: the Triton kernels' settings (the fa2 schedule). Its forward is
    attention_fwd_tma_kernel (schedule 1) on sm_90 for fp16 / bf16 with head dims up to 128, attention_fwd_kernel
    (schedule 0) elsewhere."""
    return _triton_tiles(problem, capability)


def fa4_tiles(problem: AttentionProblem, capability: tuple[int, int] | None) -> TritonTiles:
    """The fa4 schedule's settings: FlashAttention-4's moves, FA4_RESCALE_THRESHOLD and FA4_EXP2_POLY_EVERY, on top
    of the fa3 schedule (the Gluon forward at the table's settings) where it serves the call, else on top of the fa2
    schedule (portable_tiles).

    On the Gluon forward (fp16 / bf16, sm_90) both apply as GluonTile.rescale_threshold and exp2_emulated. On the
    Triton forwards the cubic takes fp16 / bf16 only (fp32 keeps P in fp32 for its matmul, where the cubic's 1.0e-4
    would exceed the rounding: every exponential on the exp2 unit). There, on a GPU, 128-key blocks take 2 stages
    instead of 3: splitting the score tile into its columns (tl.split / tl.join in common.exp2_columns) converts
    layouts through shared memory, and the d = 128 forward's 128 x 128 tile needed 262,200 bytes with 3 stages
    (triton 3.6, sm_90), over sm_90's 232,448; 196,640 with 2. With dropout on a GPU every exponential stays on the
    exp2 unit: triton 3.6 fails an assertion (applyLinearLayout, lowering to LLVM) compiling the TMA forward with
    both the cubic's column split and the dropout mask (H200). The Triton settings stay in the row where the fa3
    version is chosen: a call whose tensors the Gluon forward turns away at launch (their alignment) runs them."""
    tiles = portable_tiles(problem, capability)
    cubic = problem.dtype in (torch.float16, torch.bfloat16) and not (capability is not None and problem.dropout_p > 0)
    every = FA4_EXP2_POLY_EVERY if cubic else 0
    stages = 2 if capability is not None and every and tiles.block_n >= 128 else tiles.num_stages
    on_fa2 = dataclasses.replace(tiles, rescale_threshold=FA4_RESCALE_THRESHOLD, exp2_poly_every=every,
                                 num_stages=min(stages, tiles.num_stages))
    table = default_tiles(problem, capability)
    if table.forward_schedule != 3:
        return on_fa2
    gluon = {key: getattr(table, key) for key in TritonTiles.__dataclass_fields__ if key.startswith("gluon_")}
    on_fa3 = dataclasses.replace(on_fa2, forward_schedule=3, **dict(gluon, gluon_exp2_emulated=FA4_EXP2_POLY_EVERY))
    return on_fa2 if gluon_unserved_reason(problem, on_fa3.gluon_tile) else on_fa3


def _triton_tiles(problem: AttentionProblem, capability: tuple[int, int] | None) -> TritonTiles:
    """The Triton kernels' launch settings for `problem` on a GPU of compute capability `capability` (None: the CPU
    interpreter).

    One rule per statement below, each with the file that measured it (bf16 on an H200 under triton 3.6; shapes of
    the benchmark convention, 16k tokens per batch at model width 2048, unless it says otherwise):
    - Hopper (sm_90) with fp16 / bf16, head dims up to 128: the TMA forward (schedule 1) at every length, dense or
      packed, and per head dim the backward schedule, tiles and register caps below. Most rules fit two or three
      programs on an SM where one would leave its pipeline fill and drain exposed.
    - Other GPUs and dtypes: the pointer kernels at generic tiles, the backward in two launches (on the H200 none
      of six dK/dV and six dQ tilings was more than 5% faster: raw/2026-11-29-h200-profile-backward.txt); not tuned
      per GPU.
    - Never chosen: the warp-specialized forward (schedule 2), the fastest measured at d = 128 without a band (450 /
      521 / 531 TFLOP/s at 1k / 4k / 16k keys, raw/2026-11-29-h200-s7-host-descriptor-forward-ab.txt), because 3
      of 382,482 reruns beside other GPU work returned NaN (raw/2026-11-29-h200-s7-stress-host-descriptors.txt);
      it is opt-in and warns.
    """
    if capability is None:
        return TritonTiles(block_m=16, block_n=16, num_warps=1, num_stages=1,
                           bwd_block_m=16, bwd_block_n=16, bwd_num_warps=1, bwd_num_stages=1)
    width = max(problem.headdim, problem.headdim_v)
    hopper = capability == (9, 0) and problem.dtype in (torch.float16, torch.bfloat16)
    # the TMA forward, host-side descriptors: at 1k keys +9% / +11% (d = 128) and +4% / +6% (d = 64) over the pointer
    # kernel, non-causal / causal (raw/2026-11-29-h200-s7-host-descriptor-forward-ab.txt); packed batches at 0.93x /
    # 0.95x the dense rate (raw/2026-11-29-h200-s8-call7.txt), by pointer loads 0.88x / 0.89x
    # (raw/2026-11-29-h200-s8-call4.txt)
    forward_schedule = 1 if hopper else 0
    ragged_end = _separate_ragged_end(problem)
    if width <= 64:
        short_band = problem.is_banded and problem.seqlen_k < 4096
        # forward 128 x 64 tiles, 3 stages; 8 warps on Hopper: 368.2 against 355.0 TFLOP/s with 4 at 1k non-causal
        # (raw/2026-11-29-h200-s7-forward-tiles.txt); banded problems below 4k keys 4 warps: 1k causal 264 against
        # 254 with 8 (raw/2026-11-29-h200-s7-grid-fwd-before-tiles.txt, raw/2026-11-29-h200-s7-grid-fwd-final.txt)
        warps = 8 if hopper and not short_band else 4
        # banded below 4k keys, dense: 64 query rows (106 registers, 57 KB of shared memory), three programs per SM:
        # 1k causal 287.9 / 286.4 TFLOP/s against 271.8 / 272.9 with 128 (raw/2026-11-30-h200-s13-call1-forward-ab.txt)
        block_m = 64 if hopper and short_band and not problem.varlen else 128
        # packed batches with 8 warps: at most 128 registers (146 uncapped, 107 in a dense batch), so that two programs
        # share an SM as in a dense batch: non-causal 7.29 ms against 10.18
        # (raw/2026-11-30-h200-s16-call1-batch1-packed-d64.txt)
        cap = 128 if hopper and problem.varlen and warps == 8 else 0
        if hopper and short_band and problem.window_left < 0 and not problem.varlen and problem.mask_kind is None:
            # dense causal below 4k keys (a band on the right only): two launches (the dQ kernel, which computes
            # delta, then dK/dV), 32 x 64 dK/dV tiles, the dQ kernel's 128 x 64 / 8-warp tile: fwd+bwd 258.3 / 306.1
            # TFLOP/s at 1k / 2k against 244.8 / 287.5 in one launch (raw/2026-11-30-h200-s18-call3-ab-d64-causal.txt)
            backward = dict(bwd_block_n=64, backward_schedule=2, dq_block_m=128, dq_block_n=64, dq_num_warps=8)
        elif hopper and not short_band:
            # two launches, TMA loads, the dQ kernel on a 128 x 64 / 8-warp tile of its own (the dK/dV tile
            # transposed spills): fwd+bwd +4..+10% over one launch at 1k-16k but 1k causal
            # (raw/2026-11-30-h200-s10-call2-dq-baseline.txt). Packed batches too (30.69 / 16.78 ms against 30.72 /
            # 17.37 in one launch, raw/2026-11-30-h200-s16-call2-decode-stages-packed-d64.txt), their dQ kernel capped
            # at 128 registers for two programs per SM: 7.29 / 4.34 ms against 10.15 / 5.57
            # (raw/2026-11-30-h200-s16-call7-8-dq-register-cap.txt)
            backward = dict(bwd_block_n=128, backward_schedule=2, dq_block_m=128, dq_block_n=64, dq_num_warps=8,
                            dq_max_registers=128 if problem.varlen else 0)
        else:
            # other banded problems below 4k keys (a left window edge, packed, masked): one launch, which beat two at
            # 1k causal, 239.2 / 224.6 against 205.1 TFLOP/s (raw/2026-11-30-h200-s10-call2-dq-baseline.txt); other
            # GPUs and dtypes: two launches
            backward = dict(bwd_block_n=128, backward_schedule=int(hopper))
        return TritonTiles(block_m=block_m, block_n=64, num_warps=warps, num_stages=3,
                           forward_schedule=forward_schedule, forward_max_registers=cap,
                           forward_separate_ragged_end=ragged_end,
                           bwd_block_m=32, bwd_num_warps=4, bwd_num_stages=3, **backward)
    if width <= 128:
        if not hopper:
            return TritonTiles(block_m=128, block_n=64, num_warps=8, num_stages=3,
                               bwd_block_m=32, bwd_block_n=64, bwd_num_warps=4, bwd_num_stages=3)
        # dense problems below 4k keys without a left window edge or an attn_mask: tiles that fit two programs on an
        # SM (the 128 x 128 tile below fits one)
        short = (problem.seqlen_k < 4096 and not problem.varlen and problem.window_left < 0
                 and problem.mask_kind is None)
        if short and not problem.is_banded:
            # no band: forward 128 x 64 tiles, 2 stages, at most 128 registers (no spills, 98 KB): 1k 429.8 / 432.0
            # TFLOP/s against 417.6 / 415.4 with 128 x 128 (raw/2026-11-30-h200-s13-call1-forward-ab.txt); backward
            # as for long problems
            return TritonTiles(block_m=128, block_n=64, num_warps=8, num_stages=2, forward_schedule=1,
                               forward_max_registers=128,
                               bwd_block_m=64, bwd_block_n=128, bwd_num_warps=8, bwd_num_stages=3, backward_schedule=3)
        if short:
            # causal (a band on the right only): forward 64 x 64, 4 warps, 3 stages (112 KB): 1k causal 366.4 / 367.5
            # TFLOP/s against 319.9 / 322.1 with 128 x 128 (raw/2026-11-30-h200-s17-call1-ab_fwd.json,
            # raw/2026-11-30-h200-s17-call2-ab_fwd.json); backward in two launches, dK/dV 32 x 64 / 4 warps, dQ
            # 128 x 32 / 8 warps at most 128 registers: fwd+bwd 290.4 / 282.0 against 277.3 / 276.0 in one launch, in
            # two runs of three (raw/2026-11-30-h200-s17-call4-ab_bwd4.json, raw/2026-11-30-h200-s17-call2-ab_bwd.json;
            # the third 258.1 against 276.9, raw/2026-11-30-h200-s17-call3-ab_bwd3.json)
            return TritonTiles(block_m=64, block_n=64, num_warps=4, num_stages=3, forward_schedule=1,
                               bwd_block_m=32, bwd_block_n=64, bwd_num_warps=4, bwd_num_stages=3, backward_schedule=2,
                               dq_block_m=128, dq_block_n=32, dq_num_warps=8, dq_max_registers=128)
        # forward 128 x 128 tiles: 402.7 against 389.8 TFLOP/s with 64-key blocks at 1k non-causal, 486.9 against
        # 469.8 / 474.9 at 4k (raw/2026-11-29-h200-s7-forward-tiles.txt); causal +1.6% / +3.4% / +4% at 1k / 4k / 16k
        # (raw/2026-11-29-h200-s8-call3.txt). A left window edge (two edges to mask) or an attn_mask (the pointer
        # kernel) keeps 64-key blocks, not measured with 128
        block_n = 128 if problem.window_left < 0 and problem.mask_kind is None else 64
        # dropout converts its Philox words beside the 128 x 128 score tile through shared memory: 3 stages took
        # 246,784 bytes (triton 3.6, sm_90), over the SM's 232,448; 2 stages fit
        stages = 2 if problem.dropout_p > 0 and block_n == 128 else 3
        # backward 64 x 128, 8 warps, 3 stages, the streamed tiles by TMA. Dense batches in one launch: fwd+bwd
        # +4..+10% over 32 x 64 / 4 warps in two at 1k non-causal, 4k and 16k
        # (raw/2026-11-29-h200-tune-backward-one-launch.txt); TMA +2..+10% over pointer loads but 16k causal, 0%
        # (raw/2026-11-29-h200-s8-call1.txt). Packed batches in two launches, TMA in
        # their interior blocks: 0.91x / 0.92x the dense rate, one launch 0.91x / 0.85x
        # (raw/2026-11-30-h200-s15-call4-packed-tma-backward.txt)
        return TritonTiles(block_m=128, block_n=block_n, num_warps=8, num_stages=stages, forward_schedule=1,
                           forward_separate_ragged_end=ragged_end,
                           bwd_block_m=64, bwd_block_n=128, bwd_num_warps=8, bwd_num_stages=3,
                           backward_schedule=2 if problem.varlen else 3)
    # wider heads (up to 256): small tiles, pointer loads, two launches; not tuned by measurement
    return TritonTiles(block_m=64, block_n=32, num_warps=4, num_stages=2,
                       bwd_block_m=32, bwd_block_n=64, bwd_num_warps=4, bwd_num_stages=1)
