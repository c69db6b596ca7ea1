"""The input contract: turn user arguments into one validated `AttentionProblem`.

Every public entry point calls into this module before any backend sees a tensor, so every
backend can rely on the same invariants. Each violation raises `TypeError` (wrong kind of
object or dtype) or `ValueError` (wrong value or shape) naming the argument, the actual value
and the rule.

The canonical layout handed to backends is flash-attn's: q (batch, seqlen_q, nheads, headdim),
k (batch, seqlen_k, nheads_k, headdim), v (batch, seqlen_k, nheads_k, headdim_v), as views of the
caller's tensors (no copies unless the last dimension is not unit-stride).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

import torch

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
MAX_HEADDIM = 256


@dataclass(frozen=True)
class AttentionProblem:
    """A validated attention call, independent of layout and backend.

    Query row i may attend key column j iff
        (window_left  < 0 or j >= i + diagonal_offset - window_left) and
        (window_right < 0 or j <= i + diagonal_offset + window_right),
    where diagonal_offset is seqlen_k - seqlen_q for bottom-right alignment (flash-attn) and 0 for
    top-left alignment (torch SDPA). Scores are softmax_scale * q·k, then softcapped, then ALiBi
    (-slope * |i + diagonal_offset - j|) and the user's attn_mask are applied. With dropout_p > 0 the
    normalised probabilities are dropped with probability dropout_p and the kept ones scaled by
    1 / (1 - dropout_p) (flashtile._dropout); the lse is that of the scores.
    """

    batch: int
    nheads: int
    nheads_k: int
    seqlen_q: int
    seqlen_k: int
    headdim: int
    headdim_v: int
    dtype: torch.dtype
    device: torch.device
    softmax_scale: float
    window_left: int
    window_right: int
    diagonal_offset: int
    alignment: str  # "bottom-right" (flash-attn) or "top-left" (torch SDPA); fixes diagonal_offset
    softcap: float
    has_alibi: bool
    mask_kind: str | None  # None, "bool" (True = attend) or "additive"
    # packed variable-length sequences (flash_attn_varlen_func): batch is the number of sequences,
    # seqlen_q / seqlen_k are the caller's max_seqlen hints, and each sequence's own lengths (and
    # bottom-right diagonal offset) come from cu_seqlens at run time
    varlen: bool = False
    # attention over a KV cache (flash_attn_with_kvcache): seqlen_k is the cache's capacity and each
    # sequence's own length (cache_seqlens + new tokens, bottom-right aligned) is known at run time
    kvcache: bool = False
    # a learnable sink (learnable_sink): one logit per query head that joins every row's softmax denominator
    # without a value, so the lse includes it and a row that sees no key gets out 0 and lse = the sink
    has_sink: bool = False
    # attention dropout on the probabilities, in [0, 1); each call draws its own Philox (seed, offset)
    dropout_p: float = 0.0
    # paged K/V (flash_attn_varlen_func with block_table; varlen is then set too): keys are read from paged caches
    # through a block table, forward only; seqlen_k is the max_seqlen_k hint
    paged: bool = False

    @property
    def group_size(self) -> int:
        """Query heads that share one key/value head (1 for MHA, nheads for MQA)."""
        return self.nheads // self.nheads_k

    @property
    def is_banded(self) -> bool:
        """True when causal or a sliding window restricts which keys a row sees."""
        return self.window_left >= 0 or self.window_right >= 0

    @property
    def accumulation_dtype(self) -> torch.dtype:
        return torch.float64 if self.dtype == torch.float64 else torch.float32

    def describe_masking(self) -> str:
        if not self.is_banded:
            band = "no causal/window mask"
        else:
            kind = "causal" if self.window_right == 0 and self.window_left < 0 else "window"
            band = f"{kind} (window_size=({self.window_left}, {self.window_right}), {self.alignment} aligned, diagonal offset {self.diagonal_offset})"
        parts = [band, f"softcap {self.softcap:g}" if self.softcap > 0 else "no softcap",
                 "ALiBi" if self.has_alibi else "no ALiBi"]
        if self.mask_kind is not None:
            parts.append(f"{self.mask_kind} attn_mask")
        if self.has_sink:
            parts.append("learnable sink (one logit per query head in every row's softmax denominator)")
        if self.dropout_p > 0:
            parts.append(f"dropout {self.dropout_p:g} (Philox keep-mask, regenerated in the backward)")
        return ", ".join(parts)


def _require_tensor(name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return t


def _require_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r} ({type(value).__name__})")
    return value


def _require_real(name: str, value: object) -> float:
    # plain floats and ints first: the numbers.Real check is an ABC lookup, on every call's host time
    if type(value) is not float and type(value) is not int and (
            isinstance(value, bool) or not isinstance(value, numbers.Real)):
        raise TypeError(f"{name} must be a real number, got {value!r} ({type(value).__name__})")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


def _check_qkv_dtypes_devices(names: tuple[str, str, str], tensors: tuple[torch.Tensor, ...]) -> None:
    for name, t in zip(names, tensors):
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(
                f"{name} has dtype {t.dtype}; supported dtypes are float16, bfloat16, float32 and float64")
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) != 1:
        listing = ", ".join(f"{n}={t.dtype}" for n, t in zip(names, tensors))
        raise TypeError(f"{', '.join(names)} must share one dtype, got {listing}")
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        listing = ", ".join(f"{n} on {t.device}" for n, t in zip(names, tensors))
        raise ValueError(f"{', '.join(names)} must be on one device, got {listing}")


def _check_headdims(headdim: int, headdim_v: int, q_name: str, v_name: str) -> None:
    if not 1 <= headdim <= MAX_HEADDIM:
        raise ValueError(f"{q_name} has head dim {headdim}; it must be between 1 and {MAX_HEADDIM}")
    if not 1 <= headdim_v <= MAX_HEADDIM:
        raise ValueError(f"{v_name} has head dim {headdim_v}; it must be between 1 and {MAX_HEADDIM}")


def _check_heads(nheads: int, nheads_k: int, q_name: str, k_name: str) -> None:
    if nheads < 1 or nheads_k < 1:
        raise ValueError(f"{q_name} has {nheads} heads and {k_name} has {nheads_k}; both need at least one")
    if nheads % nheads_k != 0:
        raise ValueError(
            f"{k_name} has {nheads_k} heads but {q_name} has {nheads}; nheads must be a multiple of "
            f"nheads_k (grouped-query attention shares each key/value head among nheads // nheads_k query heads)")


def unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    """Return t, or a contiguous copy when its last dimension is not unit-stride (kernels need it)."""
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        return t.contiguous()
    return t


def _check_dropout(dropout_p: object) -> float:
    p = _require_real("dropout_p", dropout_p)
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1) (the probability of dropping an attention probability), "
                         f"got {p}")
    return p


def _check_scale(scale: object, name: str, headdim: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(headdim)
    return _require_real(name, scale)


def _window_side(side: str, value: object) -> int:
    """One side of window_size as an int: a Python int or an integer 0-d tensor (what indexing a tensor gives)."""
    if isinstance(value, torch.Tensor):
        if value.dim() != 0 or value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
            raise TypeError(f"window_size {side} must be an int, got a tensor of shape {tuple(value.shape)} and "
                            f"dtype {value.dtype}")
        value = int(value.item())
    elif type(value) is not int and (isinstance(value, bool) or not isinstance(value, numbers.Integral)):
        raise TypeError(f"window_size {side} must be an int, got {value!r} ({type(value).__name__})")
    if value < -1:
        raise ValueError(f"window_size {side} is {value}; it must be -1 (unbounded) or >= 0")
    return int(value)


def _check_window(window_size: object, causal: bool) -> tuple[int, int]:
    """(left, right) from a tuple or list of two ints, or a 2-element integer tensor (on any device).

    The values set the kernels' masks and constexprs, so they are read on the host: a tensor on a GPU costs one
    synchronisation, and cannot be read while a CUDA graph is captured or torch.compile traces (then this raises;
    pass a tuple, or a CPU tensor, which is read without synchronising)."""
    if isinstance(window_size, torch.Tensor):
        if window_size.dtype.is_floating_point or window_size.dtype.is_complex or window_size.dtype == torch.bool:
            raise TypeError(f"window_size as a tensor must have an integer dtype, got {window_size.dtype}")
        if window_size.shape != (2,):
            raise ValueError(f"window_size as a tensor must have shape (2,) (left, right), got "
                             f"{tuple(window_size.shape)}")
        if window_size.device.type != "cpu" and _capturing(window_size.device):
            raise ValueError(f"window_size is a tensor on {window_size.device}, whose values cannot be read while a "
                             f"CUDA graph is captured or torch.compile traces; pass a (left, right) tuple of ints")
        window_size = tuple(window_size.tolist())
    elif not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise TypeError(f"window_size must be a (left, right) pair of ints (a tuple, a list or a 2-element integer "
                        f"tensor), got {window_size!r}")
    left, right = window_size
    if type(left) is not int or type(right) is not int or left < -1 or right < -1:
        left, right = _window_side("left", left), _window_side("right", right)
    if causal:
        right = 0  # causal means no key to the right of the diagonal
    return left, right


def _check_alibi(alibi_slopes: object, batch: int, nheads: int, device: torch.device,
                 batch_name: str = "batch") -> torch.Tensor | None:
    """Return slopes as (batch or 1, nheads), or None."""
    if alibi_slopes is None:
        return None
    slopes = _require_tensor("alibi_slopes", alibi_slopes)
    if not slopes.is_floating_point():
        raise TypeError(f"alibi_slopes must be a floating tensor, got dtype {slopes.dtype}")
    if slopes.device != device:
        raise ValueError(f"alibi_slopes is on {slopes.device} but q is on {device}")
    if tuple(slopes.shape) == (nheads,):
        slopes = slopes.unsqueeze(0)
    elif tuple(slopes.shape) != (batch, nheads):
        raise ValueError(
            f"alibi_slopes has shape {tuple(slopes.shape)}; it must be (nheads,) = ({nheads},) or "
            f"({batch_name}, nheads) = ({batch}, {nheads})")
    if slopes.requires_grad and torch.is_grad_enabled():
        raise ValueError("alibi_slopes requires grad, but flashtile does not differentiate with respect to "
                         "ALiBi slopes; pass alibi_slopes.detach()")
    return slopes


def _check_sink(learnable_sink: object, nheads: int, dtype: torch.dtype,
                device: torch.device) -> torch.Tensor | None:
    """Return the sink logits (nheads,) as given, or None. The values are not read (a tensor on a GPU would cost a
    synchronisation): a sink of -inf acts as no sink, +inf or NaN gives undefined results."""
    if learnable_sink is None:
        return None
    sink = _require_tensor("learnable_sink", learnable_sink)
    if sink.dtype not in (torch.float32, dtype):
        allowed = "float32" if dtype == torch.float32 else f"float32 or q's dtype ({dtype})"
        raise TypeError(f"learnable_sink has dtype {sink.dtype}; it must be {allowed}")
    if sink.device != device:
        raise ValueError(f"learnable_sink is on {sink.device} but q is on {device}")
    if tuple(sink.shape) != (nheads,):
        raise ValueError(f"learnable_sink has shape {tuple(sink.shape)}; it must be (nheads,) = ({nheads},): one "
                         f"logit per query head")
    return sink


@dataclass(frozen=True)
class PreparedCall:
    """Validated tensors in the flash layout (batch, seqlen, heads, dim) plus the problem description."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    alibi_slopes: torch.Tensor | None  # (batch or 1, nheads)
    attn_mask: torch.Tensor | None  # 4-D, broadcastable to (batch, nheads, seqlen_q, seqlen_k)
    problem: AttentionProblem
    # packed sequences: q, k, v are (1, total, heads, dim) and these int32 (nseq + 1,) offsets split them
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    learnable_sink: torch.Tensor | None = None  # (nheads,), float32 or q's dtype


def _check_flash_qkv(q, k, v, dims: tuple[str, ...]) -> None:
    """The rules q, k, v share in flash-attn layouts, dims naming each dimension (the last three are
    length, heads, head dim): tensors of that rank, one dtype and device, equal leading (batch)
    dims, k and v of one length and head count, q and k of one head dim, valid head dims and groups."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        _require_tensor(name, t)
        if t.dim() != len(dims):
            raise ValueError(f"{name} must have rank {len(dims)} ({', '.join(dims)}), got shape {tuple(t.shape)}")
    _check_qkv_dtypes_devices(("q", "k", "v"), (q, k, v))
    if k.shape[:-3] != q.shape[:-3] or v.shape[:-3] != q.shape[:-3]:
        raise ValueError(f"batch sizes differ: q has {q.shape[0]}, k has {k.shape[0]}, v has {v.shape[0]}")
    length = dims[-3]
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(f"q has head dim {q.shape[-1]} but k has {k.shape[-1]}; q and k head dims must match")
    if v.shape[-3] != k.shape[-3]:
        raise ValueError(f"k has {length} {k.shape[-3]} but v has {v.shape[-3]}; k and v must have the same {length}")
    if v.shape[-2] != k.shape[-2]:
        raise ValueError(f"k has {k.shape[-2]} heads but v has {v.shape[-2]}; k and v must have the same heads")
    _check_headdims(q.shape[-1], v.shape[-1], "q", "v")
    _check_heads(q.shape[-2], k.shape[-2], "q", "k")


def _check_softcap(softcap: object) -> float:
    cap = _require_real("softcap", softcap)
    if cap < 0:
        raise ValueError(f"softcap must be >= 0 (0 disables it), got {cap}")
    return cap


def _check_flash_options(dropout_p, softmax_scale, causal, window_size, softcap, deterministic, return_attn_probs,
                         return_lse, headdim) -> tuple[float, int, int, float, float]:
    """The options flash_attn_func and flash_attn_varlen_func share: returns (scale, left, right, softcap,
    dropout_p)."""
    dropout = _check_dropout(dropout_p)
    _require_bool("causal", causal)
    _require_bool("deterministic", deterministic)
    _require_bool("return_lse", return_lse)
    _require_bool("return_attn_probs", return_attn_probs)
    scale = _check_scale(softmax_scale, "softmax_scale", headdim)
    left, right = _check_window(window_size, causal)
    return scale, left, right, _check_softcap(softcap), dropout


def prepare_flash_attn(q, k, v, *, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                       deterministic, return_attn_probs, return_lse, learnable_sink=None) -> PreparedCall:
    """Validate `flash_attn_func` arguments (flash-attn layout, bottom-right alignment)."""
    _check_flash_qkv(q, k, v, ("batch", "seqlen", "nheads", "headdim"))
    batch, seqlen_q, nheads, headdim = q.shape
    seqlen_k, nheads_k, headdim_v = k.shape[1], k.shape[2], v.shape[3]
    scale, left, right, cap, dropout = _check_flash_options(dropout_p, softmax_scale, causal, window_size, softcap,
                                                            deterministic, return_attn_probs, return_lse, headdim)
    slopes = _check_alibi(alibi_slopes, batch, nheads, q.device)
    sink = _check_sink(learnable_sink, nheads, q.dtype, q.device)

    problem = AttentionProblem(
        batch=batch, nheads=nheads, nheads_k=nheads_k, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
        headdim=headdim, headdim_v=headdim_v, dtype=q.dtype, device=q.device, softmax_scale=scale,
        window_left=left, window_right=right, diagonal_offset=seqlen_k - seqlen_q, alignment="bottom-right", softcap=cap,
        has_alibi=slopes is not None, mask_kind=None, has_sink=sink is not None, dropout_p=dropout)
    return PreparedCall(*(unit_last_stride(t) for t in (q, k, v)), alibi_slopes=slopes, attn_mask=None, problem=problem,
                        learnable_sink=sink)


def _check_cu_seqlens(name: str, cu: object, total: int, total_name: str, device: torch.device) -> int:
    """Validate one cu_seqlens tensor; returns the number of sequences (the kernels read it contiguous:
    prepare_flash_attn_varlen passes a strided one on as a copy).

    On the CPU every rule is checked, except while torch.compile traces (the values are not known
    then). On a GPU only dtype, shape and device are (checking the values would copy them to the host
    and wait for the GPU on every call); values that break the rules there are the caller's error,
    with undefined results.
    """
    cu = _require_tensor(name, cu)
    if cu.dtype != torch.int32:
        raise TypeError(f"{name} must be int32 (cumulative sequence lengths), got {cu.dtype}")
    if cu.dim() != 1 or cu.shape[0] < 1:
        raise ValueError(f"{name} must have shape (nseq + 1,) with nseq >= 0, got {tuple(cu.shape)}")
    if cu.device != device:
        raise ValueError(f"{name} is on {cu.device} but q is on {device}")
    if cu.device.type == "cpu" and not torch.compiler.is_compiling():
        values = cu.tolist()
        if values[0] != 0:
            raise ValueError(f"{name}[0] must be 0, got {values[0]}")
        steps = [b - a for a, b in zip(values, values[1:])]
        if any(step < 0 for step in steps):
            i = next(i for i, step in enumerate(steps) if step < 0)
            raise ValueError(f"{name} must be non-decreasing, but {name}[{i + 1}] = {values[i + 1]} < "
                             f"{name}[{i}] = {values[i]}")
        if values[-1] != total:
            raise ValueError(f"{name}[-1] must equal {total_name} = {total} (every row in exactly one sequence), "
                             f"got {values[-1]}")
    return cu.shape[0] - 1


def _check_max_seqlen(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return int(value)


def prepare_flash_attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, dropout_p,
                              softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                              return_attn_probs, return_lse, learnable_sink=None) -> PreparedCall:
    """Validate `flash_attn_varlen_func` arguments; q, k, v come back as (1, total, heads, dim) views."""
    _check_flash_qkv(q, k, v, ("total_tokens", "nheads", "headdim"))
    total_q, nheads, headdim = q.shape
    total_k, nheads_k, headdim_v = k.shape[0], k.shape[1], v.shape[2]
    nseq = _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, total_q, "total_q (q.shape[0])", q.device)
    nseq_k = _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, total_k, "total_k (k.shape[0])", q.device)
    if nseq_k != nseq:
        raise ValueError(f"cu_seqlens_q describes {nseq} sequences but cu_seqlens_k describes {nseq_k}; "
                         f"they must have the same length")
    max_q = _check_max_seqlen("max_seqlen_q", max_seqlen_q)
    max_k = _check_max_seqlen("max_seqlen_k", max_seqlen_k)
    scale, left, right, cap, dropout = _check_flash_options(dropout_p, softmax_scale, causal, window_size, softcap,
                                                            deterministic, return_attn_probs, return_lse, headdim)
    slopes = _check_alibi(alibi_slopes, nseq, nheads, q.device, batch_name="nseq")
    sink = _check_sink(learnable_sink, nheads, q.dtype, q.device)
    problem = AttentionProblem(
        batch=nseq, nheads=nheads, nheads_k=nheads_k, seqlen_q=max_q, seqlen_k=max_k, headdim=headdim,
        headdim_v=headdim_v, dtype=q.dtype, device=q.device, softmax_scale=scale, window_left=left,
        window_right=right, diagonal_offset=0, alignment="bottom-right", softcap=cap,
        has_alibi=slopes is not None, mask_kind=None, varlen=True, has_sink=sink is not None, dropout_p=dropout)
    packed = (unit_last_stride(t).unsqueeze(0) for t in (q, k, v))
    # the kernels index cu_seqlens as a contiguous array; a strided view is copied (nseq + 1 ints)
    return PreparedCall(*packed, alibi_slopes=slopes, attn_mask=None, problem=problem,
                        cu_seqlens_q=cu_seqlens_q.contiguous(), cu_seqlens_k=cu_seqlens_k.contiguous(),
                        learnable_sink=sink)


@dataclass(frozen=True)
class PagedVarlenCall:
    """A validated `flash_attn_varlen_func` call with block_table: packed queries against paged K/V caches.

    q (1, total_q, nheads, headdim); k_cache / v_cache (num_blocks, page_size, nheads_k, headdim[_v]) as given;
    block_table (nseq, max_blocks) int32: sequence b's key j is row j % page_size of block
    block_table[b, j // page_size]; seqlens_k (nseq,) int32: each sequence's number of keys (seqused_k, or the
    differences of cu_seqlens_k); cu_seqlens_q (nseq + 1,) int32. Index tensors are contiguous (copies of strided
    arguments)."""

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    cu_seqlens_q: torch.Tensor
    block_table: torch.Tensor
    seqlens_k: torch.Tensor
    alibi_slopes: torch.Tensor | None  # (nseq or 1, nheads)
    learnable_sink: torch.Tensor | None  # (nheads,)
    problem: AttentionProblem
    page_size: int

    @property
    def capacity(self) -> int:
        """Keys each sequence's block-table row can address."""
        return self.block_table.shape[1] * self.page_size


def prepare_flash_attn_varlen_paged(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, block_table,
                                    seqused_k, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                                    deterministic, return_attn_probs, return_lse,
                                    learnable_sink=None) -> PagedVarlenCall:
    """Validate `flash_attn_varlen_func` arguments with block_table (k and v are paged caches), before anything runs.

    On CPU tensors (outside torch.compile) the values are checked too: cu_seqlens, every sequence's key count within
    0 .. max_blocks * page_size, and the block-table entries of the pages in use within 0 .. num_blocks - 1. On a GPU
    they are the caller's guarantee (reading them would synchronise); the kernel clamps lengths and block ids into
    the caches, so broken values give undefined results without reading outside them.
    """
    _require_tensor("q", q)
    if q.dim() != 3:
        raise ValueError(f"q must have rank 3 (total_q, nheads, headdim), got shape {tuple(q.shape)}")
    for name, t in (("k", k), ("v", v)):
        _require_tensor(name, t)
        if t.dim() != 4:
            raise ValueError(f"with block_table, {name} is a paged cache of rank 4 (num_blocks, page_block_size, "
                             f"nheads_k, headdim), got shape {tuple(t.shape)}")
    _check_qkv_dtypes_devices(("q", "k", "v"), (q, k, v))
    total_q, nheads, headdim = q.shape
    num_blocks, page_size, nheads_k, headdim_k = k.shape
    headdim_v = v.shape[3]
    if tuple(v.shape[:3]) != tuple(k.shape[:3]):
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must agree in (num_blocks, page_block_size, "
                         f"nheads_k)")
    if headdim_k != headdim:
        raise ValueError(f"q has head dim {headdim} but k has {headdim_k}; q and k head dims must match")
    _check_headdims(headdim, headdim_v, "q", "v")
    _check_heads(nheads, nheads_k, "q", "k")
    if page_size == 0 or page_size % 16 != 0:
        raise ValueError(f"a paged k (num_blocks, page_block_size, nheads_k, headdim) needs page_block_size to be a "
                         f"positive multiple of 16 (as flash_attn_with_kvcache), got {page_size}")
    for name, t in (("k", k), ("v", v)):
        if t.shape[-1] > 1 and t.stride(-1) != 1:
            raise ValueError(f"the paged {name} must have a unit-stride last dimension (a cache is not copied)")

    table = _require_tensor("block_table", block_table)
    if table.dtype != torch.int32:
        raise TypeError(f"block_table must be int32, got {table.dtype}")
    if table.device != q.device:
        raise ValueError(f"block_table is on {table.device} but q is on {q.device}")
    nseq = _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, total_q, "total_q (q.shape[0])", q.device)
    if table.dim() != 2 or table.shape[0] != nseq:
        raise ValueError(f"block_table must have shape (nseq, max_blocks_per_seq) = ({nseq}, ...) (nseq from "
                         f"cu_seqlens_q), got {tuple(table.shape)}")
    capacity = table.shape[1] * page_size

    if seqused_k is not None:
        _require_tensor("seqused_k", seqused_k)
        if seqused_k.dtype != torch.int32:
            raise TypeError(f"seqused_k must be int32, got {seqused_k.dtype}")
        if tuple(seqused_k.shape) != (nseq,):
            raise ValueError(f"seqused_k must have shape (nseq,) = ({nseq},), got {tuple(seqused_k.shape)}")
        if seqused_k.device != q.device:
            raise ValueError(f"seqused_k is on {seqused_k.device} but q is on {q.device}")
    if cu_seqlens_k is not None:
        cu_k = _require_tensor("cu_seqlens_k", cu_seqlens_k)
        if cu_k.dtype != torch.int32:
            raise TypeError(f"cu_seqlens_k must be int32 (cumulative sequence lengths), got {cu_k.dtype}")
        if tuple(cu_k.shape) != (nseq + 1,):
            raise ValueError(f"cu_seqlens_k must have shape (nseq + 1,) = ({nseq + 1},) like cu_seqlens_q, got "
                             f"{tuple(cu_k.shape)}")
        if cu_k.device != q.device:
            raise ValueError(f"cu_seqlens_k is on {cu_k.device} but q is on {q.device}")
    elif seqused_k is None:
        raise ValueError("with block_table, each sequence's key count comes from seqused_k or cu_seqlens_k; "
                         "both are None")
    if seqused_k is not None:
        seqlens_k = seqused_k.contiguous()
    else:
        seqlens_k = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).contiguous()  # a device op: nothing is read back

    max_q = _check_max_seqlen("max_seqlen_q", max_seqlen_q)
    max_k = _check_max_seqlen("max_seqlen_k", max_seqlen_k)
    scale, left, right, cap, dropout = _check_flash_options(dropout_p, softmax_scale, causal, window_size, softcap,
                                                            deterministic, return_attn_probs, return_lse, headdim)
    if dropout > 0 or return_attn_probs:
        raise NotImplementedError(
            f"flash_attn_varlen_func with block_table (paged K/V) is forward-only inference: it takes dropout_p = 0 "
            f"and return_attn_probs=False, got dropout_p={dropout_p!r}, return_attn_probs={return_attn_probs!r}")
    slopes = _check_alibi(alibi_slopes, nseq, nheads, q.device, batch_name="nseq")
    sink = _check_sink(learnable_sink, nheads, q.dtype, q.device)
    if torch.is_grad_enabled():
        needing = [name for name, t in (("q", q), ("k", k), ("v", v), ("learnable_sink", sink))
                   if t is not None and t.requires_grad]
        if needing:
            raise NotImplementedError(
                f"{', '.join(needing)} require(s) grad, but flash_attn_varlen_func with block_table (paged K/V) is "
                f"forward only, as in flash-attn; call it under torch.no_grad() or torch.inference_mode(), or pass "
                f"detached tensors")
    if q.device.type == "cpu" and not torch.compiler.is_compiling():
        _check_paged_values(cu_seqlens_k, seqused_k, seqlens_k, table, page_size, num_blocks)
    problem = AttentionProblem(
        batch=nseq, nheads=nheads, nheads_k=nheads_k, seqlen_q=max_q, seqlen_k=max_k, headdim=headdim,
        headdim_v=headdim_v, dtype=q.dtype, device=q.device, softmax_scale=scale, window_left=left,
        window_right=right, diagonal_offset=0, alignment="bottom-right", softcap=cap,
        has_alibi=slopes is not None, mask_kind=None, varlen=True, has_sink=sink is not None, paged=True)
    return PagedVarlenCall(q=unit_last_stride(q).unsqueeze(0), k_cache=k, v_cache=v,
                           cu_seqlens_q=cu_seqlens_q.contiguous(), block_table=table.contiguous(), seqlens_k=seqlens_k,
                           alibi_slopes=slopes, learnable_sink=sink, problem=problem, page_size=page_size)


def _check_paged_values(cu_seqlens_k, seqused_k, seqlens_k, table, page_size: int, num_blocks: int) -> None:
    """The rules on index values of a paged call (CPU tensors): cu_seqlens_k starts at 0 and never decreases, each
    key count is within 0 .. max_blocks * page_size, and the pages in use are blocks of the cache."""
    capacity = table.shape[1] * page_size
    if cu_seqlens_k is not None:
        offsets = cu_seqlens_k.tolist()
        if offsets[0] != 0:
            raise ValueError(f"cu_seqlens_k[0] must be 0, got {offsets[0]}")
        for i, (a, b) in enumerate(zip(offsets, offsets[1:])):
            if b < a:
                raise ValueError(f"cu_seqlens_k must be non-decreasing, but cu_seqlens_k[{i + 1}] = {b} < "
                                 f"cu_seqlens_k[{i}] = {a}")
    source = "seqused_k[{b}]" if seqused_k is not None else "cu_seqlens_k[{c}] - cu_seqlens_k[{b}]"
    rows = table.tolist()
    for b, length in enumerate(seqlens_k.tolist()):
        if not 0 <= length <= capacity:
            name = source.format(b=b, c=b + 1)
            raise ValueError(f"sequence {b} has {name} = {length} keys; it must be within 0 .. {capacity} "
                             f"(max_blocks_per_seq {table.shape[1]} x page_block_size {page_size})")
        for j in range(-(-length // page_size)):
            if not 0 <= rows[b][j] < num_blocks:
                raise ValueError(f"block_table[{b}, {j}] = {rows[b][j]} is not a block of the paged k / v "
                                 f"(0 .. {num_blocks - 1}); sequence {b} uses its first {-(-length // page_size)} "
                                 f"entries")


def _check_attn_mask(attn_mask: object, full_shape: tuple[int, ...], device: torch.device) -> torch.Tensor | None:
    """Return the mask broadcast (as a stride-0 view where possible) to full_shape, or None."""
    if attn_mask is None:
        return None
    mask = _require_tensor("attn_mask", attn_mask)
    if mask.dtype != torch.bool and not mask.is_floating_point():
        raise TypeError(f"attn_mask must be bool (True = attend) or floating (added to scores), got {mask.dtype}")
    if mask.device != device:
        raise ValueError(f"attn_mask is on {mask.device} but query is on {device}")
    if mask.requires_grad and torch.is_grad_enabled():
        raise ValueError("attn_mask requires grad, but flashtile does not compute gradients for attn_mask; "
                         "pass attn_mask.detach()")
    try:
        return mask.expand(full_shape)
    except RuntimeError:
        raise ValueError(f"attn_mask has shape {tuple(mask.shape)}, which does not broadcast to "
                         f"(..., L, S) = {full_shape}") from None


def prepare_sdpa(query, key, value, *, attn_mask, dropout_p, is_causal, scale, enable_gqa) -> tuple[PreparedCall, tuple[int, ...]]:
    """Validate `scaled_dot_product_attention` arguments (torch layout, top-left alignment).

    Returns the prepared call and the shape of the output, (..., L, Ev).
    """
    for name, t in (("query", query), ("key", key), ("value", value)):
        _require_tensor(name, t)
    if query.dim() < 2:
        raise ValueError(f"query must have rank >= 2 (..., L, E), got shape {tuple(query.shape)}")
    for name, t in (("key", key), ("value", value)):
        if t.dim() != query.dim():
            raise ValueError(f"{name} has rank {t.dim()} but query has rank {query.dim()}; they must match")
    _check_qkv_dtypes_devices(("query", "key", "value"), (query, key, value))
    _require_bool("is_causal", is_causal)
    _require_bool("enable_gqa", enable_gqa)
    dropout = _check_dropout(dropout_p)

    rank = query.dim()
    out_shape = tuple(query.shape[:-1]) + (value.shape[-1],)
    if rank == 2:  # (L, E): one head, no batch
        query, key, value = (t.unsqueeze(0) for t in (query, key, value))
    lead = tuple(query.shape[:-3])
    seqlen_q, headdim = query.shape[-2:]
    seqlen_k, headdim_k = key.shape[-2:]
    seqlen_v, headdim_v = value.shape[-2:]
    nheads, nheads_k, nheads_v = query.shape[-3], key.shape[-3], value.shape[-3]
    for name, t in (("key", key), ("value", value)):
        if tuple(t.shape[:-3]) != lead:
            raise ValueError(f"{name} has leading dims {tuple(t.shape[:-3])} but query has {lead}; they must match")
    if headdim_k != headdim:
        raise ValueError(f"query has head dim E={headdim} but key has {headdim_k}; they must match")
    if seqlen_v != seqlen_k:
        raise ValueError(f"key has length S={seqlen_k} but value has {seqlen_v}; they must match")
    if nheads_v != nheads_k:
        raise ValueError(f"key has {nheads_k} heads but value has {nheads_v}; they must match")
    if nheads != nheads_k and not enable_gqa:
        raise ValueError(f"query has {nheads} heads but key has {nheads_k}; pass enable_gqa=True for grouped-query attention")
    _check_headdims(headdim, headdim_v, "query", "value")
    _check_heads(nheads, nheads_k, "query", "key")
    softmax_scale = _check_scale(scale, "scale", headdim)

    batch = math.prod(lead)
    full_mask_shape = lead + (nheads, seqlen_q, seqlen_k)
    mask = _check_attn_mask(attn_mask, full_mask_shape if rank > 2 else (seqlen_q, seqlen_k), query.device)
    if mask is not None and is_causal:
        raise ValueError("attn_mask and is_causal=True are mutually exclusive (as in torch); fold the causal mask into attn_mask")
    if mask is not None:
        mask = mask.expand(full_mask_shape).reshape(batch, nheads, seqlen_q, seqlen_k)

    problem = AttentionProblem(
        batch=batch, nheads=nheads, nheads_k=nheads_k, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
        headdim=headdim, headdim_v=headdim_v, dtype=query.dtype, device=query.device,
        softmax_scale=softmax_scale, window_left=-1, window_right=0 if is_causal else -1,
        diagonal_offset=0, alignment="top-left", softcap=0.0, has_alibi=False,
        mask_kind=None if mask is None else ("bool" if mask.dtype == torch.bool else "additive"), dropout_p=dropout)
    bshd = [unit_last_stride(t).reshape(batch, *t.shape[-3:]).transpose(1, 2) for t in (query, key, value)]
    return PreparedCall(*bshd, alibi_slopes=None, attn_mask=mask, problem=problem), out_shape


@dataclass(slots=True)  # not frozen: a frozen dataclass's __init__ cost a decode step ~1 us more (CI machine)
class KVCacheCall:
    """A validated `flash_attn_with_kvcache` call.

    k_cache / v_cache are (batch_cache, capacity, nheads_k, dim) when contiguous, or (num_blocks, page_size,
    nheads_k, dim) with block_table (batch, max_blocks) int32 when paged; k_new / v_new (batch,
    seqlen_new, nheads_k, dim) or None; cache_seqlens (batch,) int32 on q's device: the end of each
    sequence's cached tokens. cache_batch_idx (batch,) int32 or None: the cache row of each sequence
    (contiguous caches; None = row b). cache_leftpad (batch,) int32 or None: where each sequence's cached
    tokens start (None = 0). After the append, sequence b attends to the keys at positions cache_leftpad[b]
    .. cache_seqlens[b] + seqlen_new - 1 of its row. rotary_cos / rotary_sin (seqlen_ro, rotary_dim / 2) or
    None: the rotary tables, applied to q and k_new before the append by the backend's append (the torch backend's
    kvcache.apply_rotary replaces q and k_new with their rotated copies; the Triton backend's kernel replaces q and
    writes the rotated keys straight into the cache, leaving k_new as given). q and the index tensors are
    contiguous where the kernels need them to be (copies of strided arguments). layout holds what validation
    concluded from everything but tensor values; one layout object serves every call with the same signature, so
    backends may key per-layout launch plans on it.
    """

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    k_new: torch.Tensor | None
    v_new: torch.Tensor | None
    cache_seqlens: torch.Tensor
    block_table: torch.Tensor | None
    alibi_slopes: torch.Tensor | None  # (batch or 1, nheads)
    layout: "_KVCacheLayout"
    cache_batch_idx: torch.Tensor | None = None
    cache_leftpad: torch.Tensor | None = None
    learnable_sink: torch.Tensor | None = None  # (nheads,), float32 or q's dtype
    rotary_cos: torch.Tensor | None = None  # (seqlen_ro, rotary_dim / 2), float32 or q's dtype
    rotary_sin: torch.Tensor | None = None

    @property
    def problem(self) -> AttentionProblem:
        return self.layout.problem

    @property
    def num_splits(self) -> int:
        return self.layout.num_splits

    @property
    def page_size(self) -> int | None:
        return self.layout.page_size

    @property
    def capacity(self) -> int:
        """Keys each sequence's cache can hold."""
        return self.layout.capacity


def _check_index_values(cache_seqlens: torch.Tensor, cache_batch_idx: torch.Tensor | None,
                        cache_leftpad: torch.Tensor | None, batch_cache: int, appending: bool) -> None:
    """The rules on the values of cache_batch_idx (a row of the cache; distinct rows when appending) and
    cache_leftpad (0 <= cache_leftpad[b] <= cache_seqlens[b]); one synchronisation on a GPU."""
    checks = []
    if cache_batch_idx is not None:
        checks.append((cache_batch_idx < 0) | (cache_batch_idx >= batch_cache))
    if cache_leftpad is not None:
        checks.append((cache_leftpad < 0) | (cache_leftpad > cache_seqlens))
    duplicate = appending and cache_batch_idx is not None and cache_batch_idx.numel() > 1
    flags = torch.stack([c.any() for c in checks]).tolist()
    if cache_batch_idx is not None and flags[0]:
        b = int(checks[0].nonzero()[0, 0])
        raise ValueError(f"cache_batch_idx[{b}] = {int(cache_batch_idx[b])} is not a row of the cache "
                         f"(0 .. {batch_cache - 1}); nothing was written")
    if cache_leftpad is not None and flags[-1]:
        b = int(checks[-1].nonzero()[0, 0])
        raise ValueError(f"cache_leftpad[{b}] = {int(cache_leftpad[b])} must be within 0 .. cache_seqlens[{b}] = "
                         f"{int(cache_seqlens[b])} (the cached tokens are positions cache_leftpad .. cache_seqlens - 1)"
                         f"; nothing was written")
    if duplicate:
        rows = torch.sort(cache_batch_idx).values
        repeated = rows[1:] == rows[:-1]
        if bool(repeated.any()):
            row = int(rows[1:][repeated][0])
            raise ValueError(f"cache_batch_idx names cache row {row} more than once; appending k and v needs distinct "
                             f"rows (which sequence's tokens would the row keep?); nothing was written")


def _check_cache_values(cache_seqlens: torch.Tensor, block_table: torch.Tensor | None, seqlen_new: int,
                        capacity: int, num_blocks: int, page_size: int | None, lengths_checked: bool,
                        rotary_len: int = 0, rotary_span: int = 0) -> None:
    """The rules that need the values of cache_seqlens (unless lengths_checked: the caller checked them on
    the host), block_table, and, with rotary tables (rotary_span > 0), that the table's rotary_len rows reach
    every position used: cache_seqlens[b] + rotary_span <= rotary_len.

    Evaluated on the tensors' device with few small ops; only a few booleans travel to the host
    (one synchronisation), and the offending entry is looked up only when a rule is broken.
    """
    no = torch.zeros((), dtype=torch.bool, device=cache_seqlens.device)
    if lengths_checked:
        bad_length, bad_rotary = no, no
    else:
        bad_length = (cache_seqlens < 0) | (cache_seqlens > capacity - seqlen_new)
        bad_rotary = cache_seqlens > rotary_len - rotary_span if rotary_span else no
    if block_table is None:
        bad_block = no
    else:
        used = (cache_seqlens + (seqlen_new + page_size - 1)) // page_size  # pages holding each sequence
        needed = torch.arange(block_table.shape[1], device=block_table.device) < used[:, None]
        bad_block = needed & ((block_table < 0) | (block_table >= num_blocks))
    any_length, any_block, any_rotary = torch.stack([bad_length.any(), bad_block.any(), bad_rotary.any()]).tolist()
    if any_length:
        b = int(bad_length.nonzero()[0, 0])
        length = int(cache_seqlens[b])
        if length < 0:
            raise ValueError(f"cache_seqlens[{b}] is {length}; it must be >= 0")
        raise ValueError(f"sequence {b}: cache_seqlens[{b}] = {length} plus {seqlen_new} new tokens exceeds the "
                         f"cache capacity of {capacity} tokens; nothing was written")
    if any_block:
        b, i = (int(x) for x in bad_block.nonzero()[0])
        raise ValueError(f"block_table[{b}, {i}] = {int(block_table[b, i])} is not a block of the cache "
                         f"(0 .. {num_blocks - 1}); nothing was written")
    if any_rotary:
        b = int(bad_rotary.nonzero()[0, 0])
        raise _rotary_too_short(f"cache_seqlens[{b}] = {int(cache_seqlens[b])}", int(cache_seqlens[b]), rotary_span,
                                rotary_len)


def _rotary_too_short(what: str, length: int, span: int, rotary_len: int) -> ValueError:
    return ValueError(f"rotary_cos / rotary_sin have {rotary_len} rows (positions 0 .. {rotary_len - 1}) but {what} "
                      f"needs positions up to {length + span - 1}: q and the new k are rotated at cache_seqlens "
                      f"onwards; pass tables of at least {length + span} rows (flash-attn asks for one row per "
                      f"cache position); nothing was written")


def _capturing(device: torch.device) -> bool:
    """True while a CUDA graph is being captured on the current stream or torch.compile traces: values
    cannot be read back then, so the value checks are the caller's (documented) responsibility."""
    if torch.compiler.is_compiling():
        return True
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


@dataclass(frozen=True, eq=False)
class _KVCacheLayout:
    """What validating a `flash_attn_with_kvcache` call concluded from everything but tensor values.

    Compared and hashed by identity (eq=False): prepare_kvcache keeps one per signature, and the Triton
    backend keys its launch plans on it without hashing its fields at every decode step."""

    problem: AttentionProblem
    num_splits: int
    capacity: int
    num_blocks: int
    page_size: int | None
    seqlen_new: int
    return_lse: bool  # return_softmax_lse
    host_length: int | None  # every sequence's cached length, when cache_seqlens is an int or None
    check_values: bool  # run the rules that read cache_seqlens / block_table (unless capturing)
    index_copy: bool  # cache_seqlens, block_table, cache_batch_idx or cache_leftpad is strided: the kernels, which
    # index them as contiguous arrays, get contiguous copies
    batch_cache: int  # rows of a contiguous cache (cache_batch_idx picks among them), else the batch
    slopes_row: bool  # alibi_slopes came as (nheads,): used as (1, nheads)
    rotary_dim: int = 0  # leading dims of q and k rotated (0: no rotary tables)
    rotary_interleaved: bool = True  # rotate pairs (0, 1), (2, 3), ... (else halves: (i, i + rotary_dim / 2))
    rotary_shifted: bool = False  # q's row i is rotated at cache_seqlens + i (causal or local), else at cache_seqlens
    rotary_len: int = 0  # rows of the rotary tables (seqlen_ro)
    rotary_span: int = 0  # positions used from cache_seqlens on: max(seqlen_new, seqlen_q if shifted else 1)
    # the backend and tiles chosen for this layout's problem, per backend request (_dispatch.resolve's memo)
    resolutions: dict = field(default_factory=dict)


# Validated layouts by signature (see _kvcache_signature): a decode loop repeats one layout at every step,
# and on the H200's host its validation was a large part of a short call's ~100 us (BENCHMARKS.md).
_KVCACHE_LAYOUTS: dict = {}
MAX_KVCACHE_LAYOUTS = 1024
_PLAIN_VALUES = frozenset((type(None), bool, int, float))


def _kvcache_signature(tensors: tuple, values: tuple) -> tuple | None:
    """Everything the layout checks read: per tensor argument (None or a plain torch.Tensor) its dtype,
    device, shape, strides and requires_grad; per other argument its type and value (None, bool, int or
    float, so that True and 1 differ); and whether grad mode is on (the ALiBi rule reads it). None when an
    argument is anything else (a list, a tensor subclass, a numpy int) or torch.compile is tracing: those
    calls are validated in full every time."""
    key = [torch.is_grad_enabled()]
    for t in tensors:
        if t is None:
            key.append(None)
        elif type(t) is torch.Tensor:
            key.append((t.dtype, t.device, t.shape, t.stride(), t.requires_grad))
        else:
            return None
    types = tuple(map(type, values))
    if not _PLAIN_VALUES.issuperset(types) or torch.compiler.is_compiling():
        return None
    key.append(types)
    key.append(values)
    return tuple(key)


def prepare_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, block_table, *, softmax_scale, causal, window_size,
                    softcap, alibi_slopes, num_splits, return_softmax_lse, check_values=None, cache_batch_idx=None,
                    cache_leftpad=None, rotary_cos=None, rotary_sin=None, rotary_interleaved=True,
                    learnable_sink=None) -> KVCacheCall:
    """Validate `flash_attn_with_kvcache` arguments before anything is written.

    The capacity and block-table rules need the values of cache_seqlens and block_table. They are
    checked when that is free (an int cache_seqlens; tensors on the CPU) or when check_values is True
    (tensors on a GPU: a few device ops and one synchronisation). check_values=False skips them for
    tensors; an int cache_seqlens is always checked. None of them run while a CUDA graph is captured
    or torch.compile traces.

    The other rules read only dtypes, devices, shapes, strides and plain values; their conclusion is
    kept per signature of those (_kvcache_signature), so a repeated layout is not checked again.
    The rotary tables' length rule (they must reach position cache_seqlens[b] + rotary_span - 1) is a value rule
    like the capacity's."""
    window = window_size if type(window_size) is tuple and len(window_size) == 2 else (window_size, None)
    tensor_seqlens = type(cache_seqlens) is torch.Tensor
    signature = _kvcache_signature(
        (q, k_cache, v_cache, k, v, block_table, alibi_slopes, cache_seqlens if tensor_seqlens else None,
         cache_batch_idx, cache_leftpad, learnable_sink, rotary_cos, rotary_sin),
        (None if tensor_seqlens else cache_seqlens, softmax_scale, causal, *window, softcap, num_splits,
         return_softmax_lse, check_values, rotary_interleaved))
    layout = _KVCACHE_LAYOUTS.get(signature) if signature is not None else None
    if layout is None:
        layout = _kvcache_layout(q, k_cache, v_cache, k, v, cache_seqlens, block_table, softmax_scale=softmax_scale,
                                 causal=causal, window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                                 num_splits=num_splits, return_softmax_lse=return_softmax_lse,
                                 check_values=check_values, cache_batch_idx=cache_batch_idx,
                                 cache_leftpad=cache_leftpad, learnable_sink=learnable_sink, rotary_cos=rotary_cos,
                                 rotary_sin=rotary_sin, rotary_interleaved=rotary_interleaved)
        if signature is not None:
            if len(_KVCACHE_LAYOUTS) >= MAX_KVCACHE_LAYOUTS:
                _KVCACHE_LAYOUTS.clear()
            _KVCACHE_LAYOUTS[signature] = layout
    if layout.host_length is not None:
        cache_seqlens = torch.full((layout.problem.batch,), layout.host_length, dtype=torch.int32, device=q.device)
    if layout.check_values and not _capturing(q.device):
        _check_cache_values(cache_seqlens, block_table, layout.seqlen_new, layout.capacity, layout.num_blocks,
                            layout.page_size, lengths_checked=layout.host_length is not None,
                            rotary_len=layout.rotary_len, rotary_span=layout.rotary_span)
        if cache_batch_idx is not None or cache_leftpad is not None:
            _check_index_values(cache_seqlens, cache_batch_idx, cache_leftpad, layout.batch_cache,
                                appending=layout.seqlen_new > 0)
    if layout.index_copy:
        cache_seqlens, block_table, cache_batch_idx, cache_leftpad = (
            None if t is None else t.contiguous() for t in (cache_seqlens, block_table, cache_batch_idx, cache_leftpad))
    return KVCacheCall(q=unit_last_stride(q), k_cache=k_cache, v_cache=v_cache, k_new=k, v_new=v,
                       cache_seqlens=cache_seqlens, block_table=block_table,
                       alibi_slopes=alibi_slopes.unsqueeze(0) if layout.slopes_row else alibi_slopes,
                       layout=layout, cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad,
                       learnable_sink=learnable_sink, rotary_cos=rotary_cos, rotary_sin=rotary_sin)


def _kvcache_layout(q, k_cache, v_cache, k, v, cache_seqlens, block_table, *, softmax_scale, causal, window_size,
                    softcap, alibi_slopes, num_splits, return_softmax_lse, check_values, cache_batch_idx,
                    cache_leftpad, learnable_sink, rotary_cos=None, rotary_sin=None,
                    rotary_interleaved=True) -> _KVCacheLayout:
    """prepare_kvcache's rules that need no tensor values (raising TypeError / ValueError)."""
    _require_tensor("q", q)
    if q.dim() != 4:
        raise ValueError(f"q must have rank 4 (batch, seqlen_q, nheads, headdim), got shape {tuple(q.shape)}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        _require_tensor(name, t)
        if t.dim() != 4:
            raise ValueError(f"{name} must have rank 4, got shape {tuple(t.shape)}")
    _check_qkv_dtypes_devices(("q", "k_cache", "v_cache"), (q, k_cache, v_cache))
    batch, seqlen_q, nheads, headdim = q.shape
    if seqlen_q < 1:
        raise ValueError(f"q has seqlen_q = {seqlen_q}; it needs at least one query token")
    if k_cache.shape[:3] != v_cache.shape[:3]:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must agree in all "
                         f"but the last dimension")
    nheads_k, headdim_k, headdim_v = k_cache.shape[2], k_cache.shape[3], v_cache.shape[3]
    if headdim_k != headdim:
        raise ValueError(f"q has head dim {headdim} but k_cache has {headdim_k}; they must match")
    _check_headdims(headdim, headdim_v, "q", "v_cache")
    _check_heads(nheads, nheads_k, "q", "k_cache")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.shape[-1] > 1 and t.stride(-1) != 1:
            raise ValueError(f"{name} must have a unit-stride last dimension (it is written in place)")

    if block_table is not None:
        _require_tensor("block_table", block_table)
        if block_table.dtype != torch.int32:
            raise TypeError(f"block_table must be int32, got {block_table.dtype}")
        if block_table.dim() != 2 or block_table.shape[0] != batch:
            raise ValueError(f"block_table must have shape (batch, max_blocks) = ({batch}, ...), "
                             f"got {tuple(block_table.shape)}")
        if block_table.device != q.device:
            raise ValueError(f"block_table is on {block_table.device} but q is on {q.device}")
        page_size = k_cache.shape[1]
        if page_size % 16 != 0 or page_size == 0:
            raise ValueError(f"a paged k_cache (num_blocks, page_size, nheads_k, headdim) needs page_size to be a "
                             f"positive multiple of 16, got {page_size}")
        capacity, num_blocks = block_table.shape[1] * page_size, k_cache.shape[0]
    else:
        if k_cache.shape[0] != batch and cache_batch_idx is None:
            raise ValueError(f"k_cache has batch {k_cache.shape[0]} but q has {batch}; a contiguous cache is "
                             f"(batch, seqlen_cache, nheads_k, headdim) (pass cache_batch_idx to use other rows, "
                             f"block_table for a paged cache)")
        page_size, capacity, num_blocks = None, k_cache.shape[1], 0
    for name, t in (("cache_batch_idx", cache_batch_idx), ("cache_leftpad", cache_leftpad)):
        if t is None:
            continue
        _require_tensor(name, t)
        if t.dtype != torch.int32:
            raise TypeError(f"{name} must be an int32 tensor, got {t.dtype}")
        if tuple(t.shape) != (batch,):
            raise ValueError(f"{name} must have shape (batch,) = ({batch},), got {tuple(t.shape)}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
        if block_table is not None:
            raise ValueError(f"{name} cannot be combined with block_table (as in flash-attn): a paged cache "
                             f"already maps each sequence to its own blocks")

    if (k is None) != (v is None):
        raise ValueError("k and v must be given together (new tokens to append) or both be None")
    seqlen_new = 0
    if k is not None:
        for name, t, dim in (("k", k, headdim), ("v", v, headdim_v)):
            _require_tensor(name, t)
            if t.dtype != q.dtype or t.device != q.device:
                raise TypeError(f"{name} must have q's dtype and device ({q.dtype} on {q.device}), "
                                f"got {t.dtype} on {t.device}")
            if t.dim() != 4 or t.shape[0] != batch or t.shape[2] != nheads_k or t.shape[3] != dim:
                raise ValueError(f"{name} must have shape (batch, seqlen_new, nheads_k, {dim}) = "
                                 f"({batch}, ..., {nheads_k}, {dim}), got {tuple(t.shape)}")
        if k.shape[1] != v.shape[1]:
            raise ValueError(f"k has {k.shape[1]} new tokens but v has {v.shape[1]}; they must match")
        seqlen_new = k.shape[1]

    host_length = None  # every sequence's cached length, when the caller gave it on the host
    if cache_seqlens is None:
        if seqlen_new:
            raise ValueError("appending k and v needs cache_seqlens (where each sequence's new tokens go)")
        host_length = capacity
    elif isinstance(cache_seqlens, numbers.Integral) and not isinstance(cache_seqlens, bool):
        host_length = int(cache_seqlens)
    else:
        _require_tensor("cache_seqlens", cache_seqlens)
        if cache_seqlens.dtype != torch.int32:
            raise TypeError(f"cache_seqlens must be an int or an int32 tensor, got {cache_seqlens.dtype}")
        if tuple(cache_seqlens.shape) != (batch,):
            raise ValueError(f"cache_seqlens must have shape (batch,) = ({batch},), got {tuple(cache_seqlens.shape)}")
        if cache_seqlens.device != q.device:
            raise ValueError(f"cache_seqlens is on {cache_seqlens.device} but q is on {q.device}")
    if host_length is not None:
        # the length rules need no device work; the block table (if any) is checked for the pages in use
        if cache_seqlens is None and cache_leftpad is not None:
            raise ValueError("cache_leftpad needs cache_seqlens (the cached tokens are positions cache_leftpad .. "
                             "cache_seqlens - 1)")
        if host_length < 0 or host_length + seqlen_new > capacity:
            raise ValueError(f"cache_seqlens is {host_length}; with {seqlen_new} new tokens it must stay within "
                             f"0 .. {capacity} (the cache capacity); nothing was written")
    if check_values is not None and not isinstance(check_values, bool):
        raise TypeError(f"check_values must be None, True or False, got {check_values!r}")
    on_host = q.device.type == "cpu"  # reading the values costs no synchronisation
    wanted = check_values if check_values is not None else on_host

    if isinstance(num_splits, bool) or not isinstance(num_splits, numbers.Integral) or num_splits < 0:
        raise ValueError(f"num_splits must be an int >= 0 (0 = choose automatically), got {num_splits!r}")
    _require_bool("causal", causal)
    _require_bool("return_softmax_lse", return_softmax_lse)
    scale = _check_scale(softmax_scale, "softmax_scale", headdim)
    left, right = _check_window(window_size, causal)
    cap = _check_softcap(softcap)
    slopes = _check_alibi(alibi_slopes, batch, nheads, q.device)
    sink = _check_sink(learnable_sink, nheads, q.dtype, q.device)
    _require_bool("rotary_interleaved", rotary_interleaved)
    rotary_dim, rotary_len = _check_rotary(rotary_cos, rotary_sin, q, k)
    # flash-attn's rule: with causal or a window (one narrower than the cache, as flash-attn drops wider ones), q's
    # row i sits at position cache_seqlens + i, like the new tokens; otherwise every row sits at cache_seqlens
    shifted = causal or 0 <= left < capacity or 0 <= right < capacity
    rotary_span = max(seqlen_new, seqlen_q if shifted else 1) if rotary_dim else 0
    if rotary_dim and host_length is not None and host_length + rotary_span > rotary_len:
        raise _rotary_too_short(f"cache_seqlens = {host_length}", host_length, rotary_span, rotary_len)
    problem = AttentionProblem(
        batch=batch, nheads=nheads, nheads_k=nheads_k, seqlen_q=seqlen_q, seqlen_k=capacity, headdim=headdim,
        headdim_v=headdim_v, dtype=q.dtype, device=q.device, softmax_scale=scale, window_left=left,
        window_right=right, diagonal_offset=0, alignment="bottom-right", softcap=cap, has_alibi=slopes is not None,
        mask_kind=None, kvcache=True, has_sink=sink is not None)
    indices = (cache_seqlens, block_table, cache_batch_idx, cache_leftpad)
    strided_index = any(isinstance(t, torch.Tensor) and not t.is_contiguous() for t in indices)
    index_values = cache_batch_idx is not None or cache_leftpad is not None
    return _KVCacheLayout(problem=problem, num_splits=int(num_splits), capacity=capacity, num_blocks=num_blocks,
                          page_size=page_size,
                          seqlen_new=seqlen_new, return_lse=return_softmax_lse, host_length=host_length,
                          check_values=wanted and (host_length is None or block_table is not None or index_values),
                          index_copy=strided_index, batch_cache=batch if block_table is not None else k_cache.shape[0],
                          slopes_row=slopes is not None and slopes is not alibi_slopes, rotary_dim=rotary_dim,
                          rotary_interleaved=rotary_interleaved, rotary_shifted=shifted, rotary_len=rotary_len,
                          rotary_span=rotary_span)


def _check_rotary(rotary_cos: object, rotary_sin: object, q: torch.Tensor, k: torch.Tensor | None) -> tuple[int, int]:
    """(rotary_dim, seqlen_ro) of the rotary tables, (0, 0) without them; the rules that need no values."""
    if rotary_cos is None and rotary_sin is None:
        return 0, 0
    if rotary_cos is None or rotary_sin is None:
        given, missing = ("rotary_cos", "rotary_sin") if rotary_sin is None else ("rotary_sin", "rotary_cos")
        raise ValueError(f"{given} was given without {missing}; pass both tables (seqlen_ro, rotary_dim / 2) or "
                         f"neither")
    cos, sin = _require_tensor("rotary_cos", rotary_cos), _require_tensor("rotary_sin", rotary_sin)
    if k is None:
        raise ValueError("rotary_cos / rotary_sin need new tokens k and v: the tables rotate q and the new k at "
                         "cache_seqlens onwards before the append (as in flash-attn); without new tokens, rotate q "
                         "before the call")
    if cos.dim() != 2 or cos.shape[1] == 0:
        raise ValueError(f"rotary_cos must have shape (seqlen_ro, rotary_dim / 2) with rotary_dim / 2 >= 1, got "
                         f"{tuple(cos.shape)}")
    if sin.shape != cos.shape:
        raise ValueError(f"rotary_sin has shape {tuple(sin.shape)} but rotary_cos has {tuple(cos.shape)}; they must "
                         f"match")
    if cos.dtype != sin.dtype or cos.dtype not in (torch.float32, q.dtype):
        allowed = "float32" if q.dtype == torch.float32 else f"float32 or q's dtype ({q.dtype})"
        raise TypeError(f"rotary_cos ({cos.dtype}) and rotary_sin ({sin.dtype}) must share one dtype, {allowed}")
    for name, t in (("rotary_cos", cos), ("rotary_sin", sin)):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
    rotary_dim, headdim = 2 * cos.shape[1], q.shape[3]
    if rotary_dim > headdim:
        raise ValueError(f"rotary_cos has {cos.shape[1]} columns, so rotary_dim = {rotary_dim}, but q's headdim is "
                         f"{headdim}; rotary_dim must be <= headdim (the tables are (seqlen_ro, rotary_dim / 2))")
    return rotary_dim, cos.shape[0]
