"""flash-attn's packed variants: q, k, v (or k, v) stacked in one tensor, with flash-attn's signatures.

Each function splits the packed tensor with `Tensor.unbind` into strided views (no copy: qkv[:, :, 0] of a
(batch, seqlen, 3, nheads, headdim) tensor has row stride 3 * nheads * headdim) and calls `flash_attn_func` or
`flash_attn_varlen_func` on them, so they take the same backends, options, errors and results. The kernels read
the views through their strides (the Triton backend reads the packed tensor's memory in place; the torch backend
works, as for any input, on per-head copies in its accumulation dtype). The backward of `unbind` stacks the three
(or two) gradients into one gradient of the packed tensor: a single allocation, no sum of zero-padded tensors.

`explain` describes a packed call when given the views: `explain(*qkv.unbind(2), causal=True)`.
"""

from __future__ import annotations

from torch import Tensor

from ._validate import _require_tensor
from .interface import flash_attn_func, flash_attn_varlen_func


def _unpack(name: str, packed: object, rank: int, dim: int, parts: int, layout: str) -> tuple[Tensor, ...]:
    """The views of `packed` along `dim` (which must have size `parts`), after checking its rank."""
    _require_tensor(name, packed)
    if packed.dim() != rank or packed.shape[dim] != parts:
        raise ValueError(f"{name} must have shape {layout} (dimension {dim} of size {parts}), got "
                         f"{tuple(packed.shape)}")
    return packed.unbind(dim)


def flash_attn_qkvpacked_func(qkv: Tensor, dropout_p: float = 0.0, softmax_scale: float | None = None,
                              causal: bool = False, window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                              alibi_slopes: Tensor | None = None, deterministic: bool = False,
                              return_attn_probs: bool = False, *, return_lse: bool = False,
                              learnable_sink: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
    """`flash_attn_func` on q, k, v stacked in one tensor, with flash-attn's signature.

    Args:
        qkv: (batch, seqlen, 3, nheads, headdim); float16, bfloat16, float32 or float64. q, k and v are its
            views qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2] (read in place, not copied), so seqlen_q = seqlen_k,
            nheads_k = nheads and headdim_v = headdim (for GQA use `flash_attn_kvpacked_func`).
        dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
        return_attn_probs, return_lse, learnable_sink: as in `flash_attn_func` (dropout included: passed through).

    Returns:
        out (batch, seqlen, nheads, headdim) in qkv's dtype; with return_lse=True, (out, lse) with lse
        (batch, nheads, seqlen) float32 (natural log). The gradient reaches qkv as one tensor of its shape.

    Raises:
        ValueError when qkv is not (batch, seqlen, 3, nheads, headdim); otherwise as `flash_attn_func`.
    """
    q, k, v = _unpack("qkv", qkv, 5, 2, 3, "(batch, seqlen, 3, nheads, headdim)")
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs, return_lse=return_lse, learnable_sink=learnable_sink)


def flash_attn_kvpacked_func(q: Tensor, kv: Tensor, dropout_p: float = 0.0, softmax_scale: float | None = None,
                             causal: bool = False, window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                             alibi_slopes: Tensor | None = None, deterministic: bool = False,
                             return_attn_probs: bool = False, *, return_lse: bool = False,
                             learnable_sink: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
    """`flash_attn_func` with k and v stacked in one tensor, with flash-attn's signature.

    Args:
        q: (batch, seqlen_q, nheads, headdim).
        kv: (batch, seqlen_k, 2, nheads_k, headdim), q's dtype and device; k and v are its views kv[:, :, 0]
            and kv[:, :, 1] (read in place), so headdim_v = headdim. nheads % nheads_k == 0 (GQA / MQA).
        dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
        return_attn_probs, return_lse, learnable_sink: as in `flash_attn_func`; causal and windows are bottom-right
            aligned.

    Returns:
        out (batch, seqlen_q, nheads, headdim) in q's dtype; with return_lse=True, (out, lse) with lse
        (batch, nheads, seqlen_q) float32. The gradient reaches kv as one tensor of its shape.

    Raises:
        ValueError when kv is not (batch, seqlen_k, 2, nheads_k, headdim); otherwise as `flash_attn_func`.
    """
    k, v = _unpack("kv", kv, 5, 2, 2, "(batch, seqlen_k, 2, nheads_k, headdim)")
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs, return_lse=return_lse, learnable_sink=learnable_sink)


def flash_attn_varlen_qkvpacked_func(qkv: Tensor, cu_seqlens: Tensor, max_seqlen: int, dropout_p: float = 0.0,
                                     softmax_scale: float | None = None, causal: bool = False,
                                     window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                                     alibi_slopes: Tensor | None = None, deterministic: bool = False,
                                     return_attn_probs: bool = False, *, return_lse: bool = False,
                                     learnable_sink: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
    """`flash_attn_varlen_func` on packed sequences whose q, k, v are stacked in one tensor (flash-attn's signature).

    Args:
        qkv: (total, 3, nheads, headdim): the rows of every sequence one after another; q, k, v are its views
            qkv[:, 0], qkv[:, 1], qkv[:, 2] (read in place).
        cu_seqlens: int32 (nseq + 1,) on qkv's device, used for both queries and keys: sequence i owns rows
            cu_seqlens[i] .. cu_seqlens[i + 1] - 1 (rules as for cu_seqlens_q in `flash_attn_varlen_func`).
        max_seqlen: int >= 0, the grid hint for both max_seqlen_q and max_seqlen_k.
        dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes ((nheads,) or (nseq, nheads)),
        deterministic, return_attn_probs, return_lse, learnable_sink: as in `flash_attn_varlen_func`, per sequence.

    Returns:
        out (total, nheads, headdim) in qkv's dtype; with return_lse=True, (out, lse) with lse (nheads, total)
        float32. The gradient reaches qkv as one tensor of its shape.

    Raises:
        ValueError when qkv is not (total, 3, nheads, headdim); otherwise as `flash_attn_varlen_func`.
    """
    q, k, v = _unpack("qkv", qkv, 4, 1, 3, "(total, 3, nheads, headdim)")
    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p, softmax_scale,
                                  causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs,
                                  return_lse=return_lse, learnable_sink=learnable_sink)


def flash_attn_varlen_kvpacked_func(q: Tensor, kv: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                                    max_seqlen_q: int, max_seqlen_k: int, dropout_p: float = 0.0,
                                    softmax_scale: float | None = None, causal: bool = False,
                                    window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                                    alibi_slopes: Tensor | None = None, deterministic: bool = False,
                                    return_attn_probs: bool = False, *, return_lse: bool = False,
                                    learnable_sink: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
    """`flash_attn_varlen_func` with k and v stacked in one tensor, with flash-attn's signature.

    Args:
        q: (total_q, nheads, headdim).
        kv: (total_k, 2, nheads_k, headdim), q's dtype and device; k and v are its views kv[:, 0] and kv[:, 1]
            (read in place). nheads % nheads_k == 0.
        cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_size,
        softcap, alibi_slopes, deterministic, return_attn_probs, return_lse, learnable_sink: as in
            `flash_attn_varlen_func`.

    Returns:
        out (total_q, nheads, headdim) in q's dtype; with return_lse=True, (out, lse) with lse
        (nheads, total_q) float32. The gradient reaches kv as one tensor of its shape.

    Raises:
        ValueError when kv is not (total_k, 2, nheads_k, headdim); otherwise as `flash_attn_varlen_func`.
    """
    k, v = _unpack("kv", kv, 4, 1, 2, "(total_k, 2, nheads_k, headdim)")
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                  softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs, return_lse=return_lse, learnable_sink=learnable_sink)
