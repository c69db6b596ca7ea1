"""Host-side launch arguments that every schedule's launcher shares: grids, strides, the scalars and constexpr
flags that describe scores, the ALiBi slopes and the learnable sink as the kernels read them, the GPU's SM count."""

from __future__ import annotations

import functools

import torch

from .._validate import AttentionProblem
from . import configs
from .common import LOG2E


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def forward_widths(flags: dict) -> dict:
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


def dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs are multiplied in full fp32 unless the user allowed TF32, as torch's matmul does
    if dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return "ieee"


def sink_arg(q: torch.Tensor, learnable_sink) -> torch.Tensor:
    """The learnable sink as the kernels read it, a contiguous (nheads,) array of its own dtype (they convert to
    float32); q when there is none (never read)."""
    if learnable_sink is None:
        return q
    return learnable_sink.detach().contiguous()


def slopes_arg(q: torch.Tensor, alibi_slopes) -> tuple[torch.Tensor, int]:
    """The ALiBi slopes as the kernels read them (float32, base 2) and their batch stride; q when there are none."""
    if alibi_slopes is None:
        return q, 0  # never read
    with torch.no_grad():
        slopes = (alibi_slopes.float() * LOG2E).contiguous()  # the kernels work in base 2
    return slopes, 0 if slopes.shape[0] == 1 else slopes.stride(0)


def scale_in_exp2(problem: AttentionProblem, flags: dict) -> bool:
    """Whether the kernels keep scores unscaled and apply the scale inside the softmax's exponent (one fused
    multiply-add per score; common.online_softmax_step, bwd.py): where the scale is the scores' only transformation
    and positive, so that the row max of the unscaled products, scaled, is the max of the scores."""
    return (problem.softmax_scale > 0 and not flags["HAS_SOFTCAP"] and not flags["HAS_ALIBI"]
            and flags["MASK_KIND"] != 2)


def score_constants(problem: AttentionProblem, mask_kind: int, precision: str) -> tuple[tuple, dict]:
    """The scalars and constexpr flags that describe scores (mask_kind 0 none, 1 bool, 2 additive; precision
    from dot_precision, which reads a torch setting that may change between calls)."""
    softcap = problem.softcap if problem.softcap > 0 else 1.0
    # scale of the final scores in base 2; with softcap, tanh(q.k * softcap_scale) * softcap_out
    scalars = (problem.softmax_scale, problem.softmax_scale * LOG2E, problem.softmax_scale / softcap,
               softcap * LOG2E, problem.diagonal_offset, max(problem.window_left, 0), max(problem.window_right, 0))
    flags = dict(HEADDIM=problem.headdim, HEADDIM_V=problem.headdim_v, BLOCK_D=configs.padded_width(problem.headdim),
                 BLOCK_DV=configs.padded_width(problem.headdim_v), HAS_LEFT=problem.window_left >= 0,
                 HAS_RIGHT=problem.window_right >= 0, HAS_SOFTCAP=problem.softcap > 0,
                 HAS_ALIBI=problem.has_alibi, MASK_KIND=mask_kind, DOT_PRECISION=precision)
    flags["SCALE_IN_EXP2"] = scale_in_exp2(problem, flags)
    return scalars, flags


def row_strides(t: torch.Tensor, batch_stride: int) -> tuple[int, int, int]:
    """(batch, row, head) strides of a (batch, rows, heads, dim) tensor as the kernels take them; batch_stride
    0 for packed sequences, whose batch entries are found through cu_seqlens instead (see launch._packing)."""
    stride_b, stride_m, stride_h, _ = t.stride()  # one call: a fwd+bwd step asks for a dozen tensors' strides
    return stride_b * batch_stride, stride_m, stride_h


# CUDA's grid axis 0 (axes 1 and 2 hold 65,535 programs; every kernel lays its programs along axis 0)
MAX_PROGRAMS = 2**31 - 1


def program_grid(programs: int) -> tuple[int]:
    """A one-axis grid of `programs` programs (the kernels split their index with common.program_coordinates)."""
    if programs > MAX_PROGRAMS:
        raise ValueError(f"this call needs {programs:,} programs, more than a CUDA grid axis holds "
                         f"({MAX_PROGRAMS:,}); split the batch into several calls")
    return (programs,)


@functools.lru_cache(maxsize=None)
def sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: a pretend GPU small enough that tests exercise the split path
    return torch.cuda.get_device_properties(device).multi_processor_count
