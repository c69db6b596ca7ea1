"""The schedule registry: the FlashAttention versions as schedules of one algorithm.

Every schedule computes the same function (out and the natural-log lse of softmax(scale * q kᵀ + masks) v); they
differ in loop order, in where the softmax state lives and in how the work is split across the GPU. The Triton
backend runs one of them per call: the tile table's choice (`triton.configs.default_tiles`), or the one a caller
forces with `use_backend("triton", schedule=...)` or the environment variable FLASHTILE_SCHEDULE. A forced schedule
that cannot serve a call raises BackendUnavailableError naming the schedule and the reason; nothing falls back.
Only schedules that are built are listed (docs/schedules.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._validate import AttentionProblem
from .triton import configs as triton_configs

SCHEDULE_NAMES = tuple(triton_configs.SCHEDULE_CODES)  # ("fa1", "fa2", "fa3", "fa4", "decode")
SCHEDULE_ENV_VAR = "FLASHTILE_SCHEDULE"

_TABLE_BACKWARD = ("attention_bwd_dq_kernel then attention_bwd_dkdv_kernel, or attention_bwd_preprocess_kernel then "
                   "attention_bwd_kernel (the tile table's backward_schedule)")


@dataclass(frozen=True)
class Schedule:
    """One schedule of the registry, as `schedules()` reports it for a device and dtype.

    name: what use_backend(..., schedule=name) and FLASHTILE_SCHEDULE take; description: its loop order and where
    its state lives; bottleneck: what it addresses; forward_kernel / backward_kernel: the Triton kernels it runs
    (backward_kernel None: forward only); available: whether it can run on the device and dtype asked about;
    reason: why not ('' when available).
    """

    name: str
    description: str
    bottleneck: str
    forward_kernel: str
    backward_kernel: str | None
    available: bool
    reason: str


# What FlashAttention-4 does that sm_90 has no counterpart for; explain() says it with every fa4 call.
FA4_BLACKWELL_ONLY = ("FA4's Blackwell-only moves do not exist on sm_90: tensor memory (TMEM) holding S, P and O "
                      "beside the tensor cores, two-CTA MMA (tcgen05 with a CTA pair sharing one tile), and its "
                      "tcgen05 warp roles (a correction warpgroup rescaling O in tensor memory); they are not built")

# name -> (description, bottleneck, forward kernel, backward kernel)
_REGISTRY = {
    "fa1": ("key blocks outer, query blocks inner: each program (batch entry, query head) loads K_j and V_j once and "
            "folds them into every query block's O, m and l, kept in float32 global memory (triton/fwd_fa1.py)",
            "the HBM traffic of the seqlen x seqlen score matrix: scores stay on chip, only O, m and l go to memory",
            "attention_fwd_fa1_kernel",
            _TABLE_BACKWARD + "; out and lse are the fa2 schedule's, so the shared recompute backward (bwd.py) "
            "differentiates them"),
    "fa2": ("query blocks outer, key blocks inner: one program per query block keeps its softmax state in registers "
            "and normalises once; the query blocks are spread over programs (triton/fwd.py, triton/fwd_tma.py)",
            "fa1's read-modify-write of O per key block and its batch x heads parallelism",
            "attention_fwd_kernel (pointer loads) or attention_fwd_tma_kernel (TMA descriptors, sm_90)",
            _TABLE_BACKWARD),
    "fa3": ("fa2's loop order with explicit warp roles in Gluon: a load warpgroup streaming K/V by TMA, consumer "
            "warpgroups issuing asynchronous wgmma with P in registers (triton/fwd_gluon.py)",
            "on Hopper, the matmul units idling while loads and the softmax run: roles overlap them",
            "attention_fwd_gluon_kernel (sm_90, fp16 / bf16)",
            _TABLE_BACKWARD),
    "fa4": ("fa3's kernel (the Gluon forward at the table's settings) where it serves the call, else fa2's kernels, "
            "with FlashAttention-4's two moves that exist on Hopper, compiled in as constexprs (fwd_gluon.py "
            "_softmax_update, triton/common.py online_softmax_step): a row's running max is moved only when a key "
            "block raises it by more than 8 (base 2, a factor 256), so its probabilities stay below 2^8 and alpha is "
            "1 for smaller rises (exact: out and lse use the same max); and for fp16 / bf16 one exponential in 4 is a "
            "cubic in 2^f on the FMA units with the integer part added to the exponent bits. " + FA4_BLACKWELL_ONLY,
            "the exp2 unit and the rescaling multiplies beside the matmuls (on Blackwell the matmuls outrun them)",
            "attention_fwd_gluon_kernel (sm_90, fp16 / bf16, where fa3 serves the call) compiled with "
            "RESCALE_THRESHOLD=8 and EXP2_EMULATED=4; else attention_fwd_kernel or attention_fwd_tma_kernel as fa2 "
            "chooses, compiled with RESCALE_THRESHOLD=8 and EXP2_POLY_EVERY=4 (0 for fp32)",
            _TABLE_BACKWARD + "; lse is the true natural-log lse, so the shared recompute backward differentiates it"),
    "decode": ("Flash-Decoding for flash_attn_with_kvcache: each sequence's cached keys split into chunks attended by "
               "separate programs, merged exactly by their log-sum-exps (triton/decode.py)",
               "few query rows against a long KV cache: batch x heads alone cannot fill the GPU",
               "attention_decode_kernel (+ attention_decode_combine_kernel when split)",
               None),
}


def check_schedule(name: object, source: str) -> str:
    """`name` if it names a schedule, else ValueError listing the names (source: where the name came from)."""
    if not isinstance(name, str) or name not in triton_configs.SCHEDULE_CODES:
        raise ValueError(f"{source} is {name!r}; expected one of " + ", ".join(map(repr, SCHEDULE_NAMES)))
    return name


def unserved_reason(name: str, problem: AttentionProblem, tiles: triton_configs.TritonTiles) -> str:
    """Why schedule `name` cannot serve `problem` with `tiles` on a device where the Triton backend runs ('' where
    it can). The fa3 forward's tensor alignment is checked at launch."""
    p = problem
    if name == "decode":
        return "" if p.kvcache else "it serves flash_attn_with_kvcache calls only"
    if p.kvcache:
        return "KV-cache calls (flash_attn_with_kvcache) are the decode schedule's"
    if p.paged and name in ("fa1", "fa3"):
        return ("paged K/V (flash_attn_varlen_func with block_table) runs attention_fwd_kernel, the fa2 / fa4 "
                "pointer kernel")
    if name == "fa1":
        served = ("softcap", p.softcap > 0), ("ALiBi", p.has_alibi), ("an attn_mask", p.mask_kind is not None), \
            ("packed variable-length batches", p.varlen), ("dropout", p.dropout_p > 0)
        unserved = [what for what, present in served if present]
        return f"its kernel (fwd_fa1.py) does not take {', '.join(unserved)}" if unserved else ""
    if name == "fa3":
        return triton_configs.gluon_unserved_reason(p, tiles.gluon_tile)
    return ""


def running_schedule(problem: AttentionProblem, tiles: triton_configs.TritonTiles) -> str:
    """The schedule the Triton backend runs for `problem` with `tiles`: the forced one, else the table's (decode for
    KV-cache calls and for the few-row calls it runs by the decode kernels, fa3 where forward_schedule 3 serves the
    call, else fa2)."""
    if tiles.forced_schedule:
        return triton_configs.SCHEDULE_NAMES[tiles.forced_schedule]
    if problem.kvcache or tiles.forward_schedule == triton_configs.DECODE_FORWARD_SCHEDULE:
        return "decode"
    if (tiles.forward_schedule == 3 and not problem.paged
            and not triton_configs.gluon_unserved_reason(problem, tiles.gluon_tile)):
        return "fa3"
    return "fa2"


def describe_kernels(name: str, kvcache: bool = True) -> str:
    """The forward and backward kernels of schedule `name`, for explain(); kvcache=False: of a call without a KV
    cache (the decode schedule's forward then comes with the table's backward)."""
    _, _, forward, backward = _REGISTRY[name]
    if name == "decode" and not kvcache:
        forward, backward = f"{forward}, the keys as a full KV cache (a call of a few query rows)", _TABLE_BACKWARD
    text = f"forward {forward}; " + (f"backward {backward}" if backward else "forward only")
    return text + (f". {FA4_BLACKWELL_ONLY}" if name == "fa4" else "")


def _probe(device: torch.device, dtype: torch.dtype, kvcache: bool) -> AttentionProblem:
    # a plain call (d = 64, 128 keys, no masks): what a schedule needs of the device and dtype alone
    return AttentionProblem(batch=1, nheads=1, nheads_k=1, seqlen_q=1 if kvcache else 128, seqlen_k=128, headdim=64,
                            headdim_v=64, dtype=dtype, device=device, softmax_scale=0.125, window_left=-1,
                            window_right=-1, diagonal_offset=0 if not kvcache else 127, alignment="bottom-right",
                            softcap=0.0, has_alibi=False, mask_kind=None, kvcache=kvcache)


def schedules(device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> list[Schedule]:
    """The schedules that exist, in order fa1, fa2, fa3, fa4, decode, each with whether it can run on `device` /
    `dtype`.

    Args:
        device: a torch.device or its name ("cuda", "cuda:1", "cpu"); None: the current CUDA device if there is
            one, else the CPU. CPU tensors run the Triton kernels only under TRITON_INTERPRET=1 (for testing).
        dtype: torch.float16, torch.bfloat16, torch.float32 or torch.float64; None: float16, which every schedule
            takes.

    Returns:
        a list of Schedule records. Availability is judged for a plain call (d = 64, no masks) on that device and
        dtype; a call's own features (softcap, ALiBi, masks, packed batches, head dims) may still turn a schedule
        away, which `explain()` and BackendUnavailableError report.

    Raises:
        TypeError if device is not a torch.device, str or None, or dtype not a torch.dtype or None;
        ValueError (from torch) for an unknown device name.
    """
    from ._dispatch import BACKENDS  # the dispatcher imports this module

    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    elif isinstance(device, str):
        device = torch.device(device)
    elif not isinstance(device, torch.device):
        raise TypeError(f"device must be a torch.device, a str or None, got {type(device).__name__}")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if dtype is None:
        dtype = torch.float16
    elif not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype or None, got {dtype!r}")
    backend = BACKENDS["triton"]
    records = []
    for name, (description, bottleneck, forward, backward) in _REGISTRY.items():
        problem = _probe(device, dtype, kvcache=name == "decode")
        reason = backend.unavailable_reason(problem) or ""
        if not reason:
            reason = unserved_reason(name, problem, backend.choose_tiles(problem, {}, name))
        records.append(Schedule(name, description, bottleneck, forward, backward, not reason, reason))
    return records
