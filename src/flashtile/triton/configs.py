"""Tile shapes, warps and pipeline stages of the Triton kernels, per head dim, dtype and GPU.

The table is small on purpose: every entry was chosen by timing on the GPU named in BENCHMARKS.md.
Under the CPU interpreter (TRITON_INTERPRET=1) the tiles are 16 x 16, the smallest that tl.dot
accepts, so CI exercises many blocks, ragged edges and masks quickly.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from .._validate import AttentionProblem


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
    forward_schedule: int = 0  # 0: pointer loads (fwd.py); 1: TMA descriptors; 2: TMA + warp specialization (fwd_tma.py)
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

    @property
    def dq_tile(self) -> tuple[int, int, int]:
        """(query rows, keys per step, warps) of the dQ programs."""
        return (self.dq_block_m or self.bwd_block_n, self.dq_block_n or self.bwd_block_m,
                self.dq_num_warps or self.bwd_num_warps)

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
        return (f"forward ({FORWARD_SCHEDULES[self.forward_schedule]}) BLOCK_M {self.block_m} x BLOCK_N "
                f"{self.block_n}, {self.num_warps} warps, {self.num_stages} stages{registers}; backward "
                f"({BACKWARD_SCHEDULES[self.backward_schedule]}) BLOCK_M {self.bwd_block_m} x BLOCK_N "
                f"{self.bwd_block_n}, {self.bwd_num_warps} warps, {self.bwd_num_stages} stages; dQ programs "
                f"{dq_rows} query rows x {dq_keys} keys, {dq_warps} warps{dq_registers}")


FORWARD_SCHEDULES = {
    0: "attention_fwd_kernel, pointer loads",
    1: ("attention_fwd_tma_kernel, host-side TMA descriptors, when strides are 16-byte aligned, there are keys "
        "and there is no attn_mask (dense or packed batches)"),
    2: ("attention_fwd_tma_kernel, TMA + warp specialization, when strides are 16-byte aligned, the batch is "
        "dense, there are keys and there is no attn_mask (opt-in and experimental: under triton 3.6 on an H200, "
        "beside other GPU processes, 3 of 382,482 reruns returned NaN; it warns when it runs)"),
}

BACKWARD_SCHEDULES = {
    0: "attention_bwd_dq_kernel (which also computes each row's delta), then attention_bwd_dkdv_kernel",
    1: "attention_bwd_preprocess_kernel, then attention_bwd_kernel, the dK/dV and dQ programs in one launch",
    2: ("attention_bwd_dq_kernel (which also computes each row's delta), then attention_bwd_dkdv_kernel, streamed "
        "tiles loaded through host-side TMA "
        "descriptors when strides are 16-byte aligned and there is no attn_mask (packed batches: the interior "
        "blocks; their edge blocks by pointer loads)"),
    3: ("attention_bwd_preprocess_kernel, then attention_bwd_kernel, the dK/dV and dQ programs in one launch, "
        "streamed tiles loaded through host-side "
        "TMA descriptors when strides are 16-byte aligned and there is no attn_mask (packed batches: the interior "
        "blocks; their edge blocks by pointer loads)"),
}

TILE_KEYS = tuple(TritonTiles.__dataclass_fields__)
DQ_TILE_KEYS = ("dq_block_m", "dq_block_n", "dq_num_warps")  # 0 = the dK/dV tile transposed (TritonTiles.dq_tile)
DQ_KEYS = DQ_TILE_KEYS + ("dq_max_registers",)  # what only the two-launch schedules' dQ kernel has
FORWARD_TILE_KEYS = ("block_m", "block_n", "num_warps", "num_stages", "forward_schedule")  # forced: no table cap
ZERO_MEANS_DEFAULT = DQ_KEYS + ("forward_max_registers",)  # tile settings for which 0 is the default
FLAG_KEYS = ("forward_separate_ragged_end",)  # tile settings that are 0 or 1

# Packed batches: each sequence's programs cover at most this many of its rows (queries in the forward and
# dQ grids, keys in the dK/dV grid) and loop over the rest, so that a long max_seqlen does not launch a full
# column of programs for every short sequence that exit at once. H200, d = 128, 64 log-uniform lengths up to
# 8,076 (session 6, BENCHMARKS.md): covering 2,048 rows instead of 8,076, fwd+bwd +1.2% non-causal, +2.0%
# causal; 4,096 -0.6% / +1.2%; 1,024 -2.8% / -1.7% (long sequences' programs then loop 8 times, in the tail).
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
    """1 where the TMA forward should give the keys' ragged end its own loop: problems of 4k keys and more without
    a band (H200, session 13: with the end inside the interior loop, d = 64 non-causal lost 3.3% at 4k and 1.2% at
    16k, d = 128 1-2% at 16k, while d = 128 1k gained 3%; banded problems keep their right edge inside the loop,
    +5% at 1k causal, session 12)."""
    return int(not problem.is_banded and problem.seqlen_k >= 4096)


def default_tiles(problem: AttentionProblem, capability: tuple[int, int] | None) -> TritonTiles:
    """The table. capability is the CUDA compute capability, or None under the interpreter.

    Measured on the H200 (BENCHMARKS.md, 2026-11-29 sweeps, bf16, d = 64 and 128, N = 1k..16k):
    - Hopper forward for fp16/bf16: TMA loads (schedule 1) at every length. Until session 7 the kernel
      built its descriptors itself and lost 4-15% to the pointer kernel at 1k keys; with host-side
      descriptors it gained 11-62% there and beats the pointer kernel (d = 128 +9% / +11%, d = 64 +4% /
      +6%, non-causal / causal, same run). Packed batches too since session 8 (forward 0.93x / 0.91-0.95x
      the dense rate against the pointer kernel's 0.85x / 0.89x, non-causal / causal). 8 warps, 128 query
      rows; d = 128 without a sliding window or mask takes 128-key blocks (403 / 487 TFLOP/s at 1k / 4k
      against 390 / 472 with 64; causal +1.6% / +3.4% / +4% at 1k / 4k / 16k), sliding windows 64-key
      blocks; d = 64 takes 64-key blocks (8 warps 368 against 4 warps 355 at 1k, but banded problems
      below 4k keys keep 4 warps: 264-266 against 254 at 1k causal).
    - Short forwards (session 13): at one program per SM each program's pipeline fill and drain is exposed.
      d = 128 without a band below 4k keys takes 128 x 64 tiles, 2 stages, at most 128 registers (two
      programs per SM): 1k non-causal 440 TFLOP/s, 1.34x FA2 (the 128-key tile 406-418); d = 64 banded below
      4k keys 64 query rows, 4 warps (three per SM): 1k causal 296, 1.38x FA2 (128 rows 266-273).
    - The warp-specialized loop (schedule 2, 128 x 128, 4 warps, 2 stages) is the fastest forward
      measured at d = 128 without a band (450 / 521 / 531 TFLOP/s at 1k / 4k / 16k in session 7), but it
      stays opt-in and warns: under triton 3.6, rerun beside other GPU processes, one of 6 x 10^5 runs
      returned a different out (session 5); with session 6's fix of its 128-row tiles' query positions
      (fwd_tma.py) 11 of 530,172 returned NaN, clustered in time across processes; with host-side K/V
      descriptors and a pointer store of out (session 7) still 3 of 382,482 (an unexplained race; the
      in-kernel descriptors of K, V and out were not its cause).
    - Hopper backward for fp16/bf16, d = 128: 64 query rows against 128 keys, 8 warps, 3 stages, the
      dK/dV and dQ programs in one launch: +4% to +10% fwd+bwd over 32 x 64 with 4 warps in two
      launches at 1k non-causal, 4k and 16k; at 1k causal +2% or +24% against the old tile's two runs
      (host noise); 2 stages had been within 3% of the old tile. The streamed tiles come by TMA through
      host-side descriptors (schedule 3) at every length (session 8: +2% to +10% against pointer loads
      except 16k causal, 0%); 32 x 128 lost 9-11%; the dK/dV
      and dQ program bodies as separate (noinline) functions lost 8-11% (ptxas serialises wgmma
      across a call). d = 64: the 32 x 128 tile in one launch (the table's until session 10), +1% to +4%
      below 16k keys, -2% to +0% at 16k (two launches kept there); 64 x 128 with 8 warps lost 11-14%; TMA loads -9% to +2%;
      tiles that ptxas compiles without spills lost too (session 9, fwd+bwd: 64 x 64 and 128 x 64 with 8
      warps about half the table's rate, 64 x 64 / 4 warps -1..-8%, 32 x 128 / 8 warps -16..-19%). What did
      pay was the dQ kernel's own tile (session 10): its default, the 32 x 128 tile transposed (128 query
      rows against 32 keys, 4 warps), spills; 128 x 64 with 8 warps does not, and with TMA loads in two
      launches it took dense d = 64 problems +4% to +10% past the previous table except 1k causal (below).
      Packed d = 64 batches (session 16) take the same two launches, their dQ kernel capped at 128 registers.
    - Short causal problems at d = 128 (session 17): two programs per SM in every kernel, a 64 x 64 / 4-warp
      forward and a two-launch backward with 4-warp 32 x 64 dK/dV tiles and a dQ kernel capped at 128
      registers (1k causal forward +14%, fwd+bwd +2..+5% in two of three runs; -3..-7% from 4k keys).
    - Short causal problems at d = 64 (session 18): two launches, 32 x 64 dK/dV tiles and the 128 x 64 dQ tile
      (fwd+bwd +5.5% / +6.5% at 1k / 2k causal against the one launch).
    - other GPUs and dtypes: 32 query rows per step against 64 (d = 128) or 128 (d = 64) keys, two
      launches (the first sweeps: best or within 5% of the best of six dK/dV and six dQ tilings).
    """
    if capability is None:
        return TritonTiles(16, 16, 1, 1, 16, 16, 1, 1)
    width = max(problem.headdim, problem.headdim_v)
    hopper_16bit = capability == (9, 0) and problem.dtype in (torch.float16, torch.bfloat16)
    # packed sequences too (session 8: TMA for packed batches, value rows past a sequence's end zeroed)
    hopper_forward = hopper_16bit
    forward_schedule = 1 if hopper_forward else 0
    if width <= 64:
        # the TMA forward with 8 warps (session 7, 1k keys: 368 TFLOP/s against 355 with 4 warps, non-causal),
        # but 4 warps for banded problems below 4k keys (1k causal: 264-266 in three runs against 254 with 8)
        banded_short = problem.is_banded and problem.seqlen_k < 4096
        # dense causal problems below 4k keys (a band on the right only, no mask)
        causal_short_dense = (hopper_16bit and banded_short and problem.window_left < 0 and not problem.varlen
                              and problem.mask_kind is None)
        warps = 8 if hopper_forward and not banded_short else 4
        bwd_block_n = 128
        if causal_short_dense:
            # two launches with the dQ kernel's 128 x 64 / 8-warp tile, as below, and 32 x 64 dK/dV tiles (session
            # 18, medians of 11 rotated rounds against the one launch of 32 x 128 tiles: 1k causal 258.3 against
            # 244.8 TFLOP/s, 1.386x FA2 against 1.313x, kernels 922 us against 983; 2k causal 306.1 against 287.5,
            # kernels 1,561 against 1,671; the 32 x 128 dK/dV tile in the same two launches 256.1 / 300.9)
            backward = dict(backward_schedule=2, dq_block_m=128, dq_block_n=64, dq_num_warps=8)
            bwd_block_n = 64
        elif hopper_16bit and not banded_short:
            # two launches, TMA loads (packed batches: in their interior blocks), the dQ kernel with its own
            # 128 x 64 / 8-warp tile (session 10, dense fwd+bwd in one run against the previous table: +5..+7% /
            # +5% / +5% at 1k / 4k / 16k non-causal, +5..+10% / +4% at 4k / 16k causal; at 1k causal the one launch
            # stayed ahead, 239 / 225 against 205; session 16, 64 packed log-uniform lengths up to 8k, 32 heads:
            # 30.69 / 16.78 ms against 30.72 / 17.37 in one launch, non-causal / causal). Packed batches cap that dQ
            # kernel at 128 registers, so that two programs share an SM as in a dense batch (triton 3.6, sm_90:
            # 207 / 176 registers packed non-causal / causal, 126 / 128 dense; capped, 276 / 40 bytes of spills;
            # session 16: the packed dQ kernel 7.29 / 4.34 ms against 10.15 / 5.57 uncapped, dense 6.94 / 3.83)
            backward = dict(backward_schedule=2, dq_block_m=128, dq_block_n=64, dq_num_warps=8,
                            dq_max_registers=128 if problem.varlen else 0)
        else:
            backward = dict(backward_schedule=int(hopper_16bit and problem.seqlen_k < 16384))
        # banded problems below 4k keys on Hopper: 64 query rows (106 registers, 57 KB of shared memory, so three
        # programs share an SM and hide each other's pipeline fill and drain; session 13, 1k causal: 288 / 286
        # TFLOP/s against 272 / 273 with 128 rows; 4k: 332 / 348 against 359 / 357)
        block_m = 64 if hopper_forward and banded_short and not problem.varlen else 128
        # packed batches with 8 warps: at most 128 registers, so that two programs share an SM as in a dense batch
        # (triton 3.6, sm_90, 128 x 64 non-causal: 146 registers packed, 107 dense; 127 with the cap, no spills;
        # session 15 measured the packed non-causal forward at 10.61 ms against the dense 7.10, causal (122
        # registers) 3.87 against 3.84; session 16 with the cap: 7.30 / 3.83 ms against the dense 6.90 / 3.56;
        # the packed dQ kernel likewise, above)
        cap = 128 if hopper_forward and problem.varlen and warps == 8 else 0
        return TritonTiles(block_m, 64, warps, 3, 32, bwd_block_n, 4, 3, forward_schedule=forward_schedule,
                           forward_separate_ragged_end=_separate_ragged_end(problem), forward_max_registers=cap,
                           **backward)
    if width <= 128:
        if hopper_16bit:
            # packed sequences: two launches (session 5: 0.97x / 0.90x the dense rate against one launch's
            # 0.95x / 0.87x, non-causal / causal; with equal lengths, causal 0.91x against 0.81x; in the SASS
            # the packed causal one-launch kernel's dK/dV loop spills 2.5x more than the dense one's: a lead).
            # Dense batches take TMA loads at every length (host-side descriptors, session 8, backward against
            # the pointer loads in the same run: +6% / +2% at 1k non-causal / causal, +8% / +7% at 4k, +10% / 0%
            # at 16k); packed batches take them in their interior blocks (session 15, fwd+bwd of 64 log-uniform
            # lengths up to 8k: 0.91x / 0.92x the dense rate against 0.87x / 0.89x with pointer loads and 0.91x /
            # 0.85x in one launch)
            backward_schedule = 2 if problem.varlen else 3
            # the TMA forward: 128-key blocks (session 7, non-causal: 403 / 487 TFLOP/s at 1k / 4k against 390 /
            # 472 with 64-key blocks; session 8, causal: 288 / 429 against 286 / 416); sliding windows (a left
            # edge: two edges to mask, not measured with 128) keep 64, and so do masked problems (an attn_mask
            # keeps to the pointer kernel, measured with 64)
            wide_keys = hopper_forward and problem.window_left < 0 and problem.mask_kind is None
            short_dense = wide_keys and not problem.varlen and problem.seqlen_k < 4096
            if short_dense and not problem.is_banded:
                # short problems without a band: 64-key blocks, 2 stages, at most 128 registers (no spills, 98 KB
                # of shared memory), so that two programs share an SM and one's pipeline fill and drain overlap
                # the other's matmuls (session 13, 1k: 430 / 432 TFLOP/s against 418 / 415 with the 128-key
                # tile, one program per SM; 4k: 455 / 481 against 483 / 471; causal 1k lost, 272 / 291 against
                # 287 / 310)
                return TritonTiles(128, 64, 8, 2, 64, 128, 8, 3, forward_schedule=forward_schedule,
                                   backward_schedule=backward_schedule, forward_max_registers=128)
            if short_dense:
                # short causal problems, two programs per SM in every kernel, so that one's pipeline fill and drain
                # run under the other's matmuls (session 17, d = 128 1k causal, medians of rotated rounds):
                # - forward: 64 query rows against 64 keys, 4 warps, 3 stages (112 KB of shared memory): 366 / 368
                #   TFLOP/s against 320 / 322 with the 128 x 128 tile, kernels 188-190 us against 216; at 4k causal
                #   +1.4%, at 16k -4.6%; against this tile 64 x 64 with 4 stages lost 32% and 64 x 32 18%;
                # - backward: two launches; dK/dV 32 query rows against 64 keys, 4 warps, 3 stages (255 registers,
                #   83 KB); dQ 128 rows against 32 keys, 8 warps, at most 128 registers (115 KB): fwd+bwd 290 / 282
                #   TFLOP/s in two of three runs (1.36x / 1.31x FA2; the third 258, its rounds 212-291) against 277 /
                #   276 with the one-launch 64 x 128 backward; kernels 826-836 us against 873-884; at 4k causal -3%
                return TritonTiles(64, 64, 4, 3, 32, 64, 4, 3, forward_schedule=forward_schedule,
                                   backward_schedule=2, dq_block_m=128, dq_block_n=32, dq_num_warps=8,
                                   dq_max_registers=128)
            block_n = 128 if wide_keys else 64
            return TritonTiles(128, block_n, 8, 3, 64, 128, 8, 3, forward_schedule=forward_schedule,
                               backward_schedule=backward_schedule,
                               forward_separate_ragged_end=_separate_ragged_end(problem))
        return TritonTiles(128, 64, 8, 3, 32, 64, 4, 3, forward_schedule=forward_schedule)
    return TritonTiles(64, 32, 4, 2, 32, 64, 4, 1)
