"""Tile shapes, warps and pipeline stages of the Triton kernels, per head dim, dtype and GPU.

The table is small on purpose: every entry was chosen by timing on the GPU named in BENCHMARKS.md.
Under the CPU interpreter (TRITON_INTERPRET=1) the tiles are 16 x 16, the smallest that tl.dot
accepts, so CI exercises many blocks, ragged edges and masks quickly.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

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

    def describe(self, problem: AttentionProblem) -> str:
        schedule = FORWARD_SCHEDULES[self.forward_schedule]
        return (f"forward ({schedule}) BLOCK_M {self.block_m} x BLOCK_N {self.block_n}, {self.num_warps} warps, "
                f"{self.num_stages} stages; backward BLOCK_M {self.bwd_block_m} x BLOCK_N {self.bwd_block_n}, "
                f"{self.bwd_num_warps} warps, {self.bwd_num_stages} stages")


FORWARD_SCHEDULES = {
    0: "attention_fwd_kernel, pointer loads",
    1: "attention_fwd_tma_kernel, TMA descriptors, when strides are 16-byte aligned and there is no attn_mask",
    2: "attention_fwd_tma_kernel, TMA + warp specialization, when strides are 16-byte aligned and there is no attn_mask",
}


TILE_KEYS = tuple(TritonTiles.__dataclass_fields__)


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def default_tiles(problem: AttentionProblem, capability: tuple[int, int] | None) -> TritonTiles:
    """The table. capability is the CUDA compute capability, or None under the interpreter."""
    if capability is None:
        return TritonTiles(16, 16, 1, 1, 16, 16, 1, 1)
    width = max(problem.headdim, problem.headdim_v)
    if width <= 64:
        return TritonTiles(128, 64, 4, 3, 32, 128, 4, 3)
    if width <= 128:
        return TritonTiles(128, 64, 8, 3, 32, 64, 4, 3)
    return TritonTiles(64, 32, 4, 2, 32, 64, 4, 1)
