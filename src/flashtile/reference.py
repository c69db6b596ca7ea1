"""The float64 oracle: dense, materialised attention with every option flashtile supports.

Deliberately the obvious algorithm and independent of the tiled code (it shares no helper with
it): build the whole seqlen_q x seqlen_k score matrix in float64, apply softcap, ALiBi and masks,
take the softmax, apply a given dropout keep-mask (the caller supplies it; the oracle has no random
generator of its own), multiply by V. A learnable sink is one more column of the score matrix, holding
its head's logit, whose probability multiplies no value (and is never dropped). It is differentiable with
ordinary autograd (and NaN-free for fully masked rows), so tests take gradients of it too. Use it for
checking, never for speed: it needs O(seqlen_q * seqlen_k) memory per head.

rotary_reference is the oracle of the KV cache's rotary embeddings: a multiplication by e^(i angle) of complex
numbers made of pairs of dims.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["attention_reference", "flash_attn_reference", "flash_attn_varlen_reference", "rotary_reference",
           "sdpa_reference"]


def attention_reference(q: Tensor, k: Tensor, v: Tensor, *, softmax_scale: float | None = None,
                        window_size: tuple[int, int] = (-1, -1), diagonal_offset: int = 0, softcap: float = 0.0,
                        alibi_slopes: Tensor | None = None, attn_mask: Tensor | None = None,
                        learnable_sink: Tensor | None = None,
                        dtype: torch.dtype = torch.float64, dropout_mask: Tensor | None = None,
                        dropout_p: float = 0.0) -> tuple[Tensor, Tensor]:
    """Dense float64 attention in the (batch, nheads, seqlen, headdim) layout.

    q (B, H, Sq, D), k (B, Hk, Sk, D), v (B, Hk, Sk, Dv) with H % Hk == 0 (query head h uses K/V
    head h // (H // Hk)). Query i may attend key j iff (left < 0 or j >= i + diagonal_offset - left)
    and (right < 0 or j <= i + diagonal_offset + right) with (left, right) = window_size.
    Scores: softmax_scale * q.k, then softcap * tanh(score / softcap) when softcap > 0, then
    - slope[b, h] * |i + diagonal_offset - j| for alibi_slopes (H,) or (B, H), then attn_mask
    (bool, True = attend; or float, added), broadcastable to (B, H, Sq, Sk). learnable_sink (H,): the
    logit of an extra key column of every row of head h that has no value (natural log, not scaled).
    Dropout: dropout_mask, a bool keep-mask broadcastable to (B, H, Sq, Sk) (True = kept), multiplies the
    normalised probabilities, the kept ones scaled by 1 / (1 - dropout_p): out = (P * mask / (1 - p)) V. The lse
    is that of the scores, unaffected (with a sink, P's denominator includes the sink's term).

    Returns (out (B, H, Sq, Dv), lse (B, H, Sq)), both in `dtype` (float64: the oracle; the input
    dtype gives the "same-dtype eager" baseline of the low-precision test rule). A row that sees no
    key gets out = 0 and lse = -inf (with a sink: lse = the sink).
    """
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    batch, nheads, seqlen_q, headdim = q.shape
    group = nheads // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    seqlen_k = k.shape[2]
    scale = 1.0 / math.sqrt(headdim) if softmax_scale is None else softmax_scale

    scores = scale * torch.einsum("bhid,bhjd->bhij", q, k)
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    i = torch.arange(seqlen_q, device=q.device).view(-1, 1) + diagonal_offset
    j = torch.arange(seqlen_k, device=q.device).view(1, -1)
    if alibi_slopes is not None:
        slopes = alibi_slopes.to(dtype).reshape(-1, nheads)  # (1 or B, H)
        scores = scores - slopes[:, :, None, None] * (i - j).abs().to(dtype)
    allowed = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=q.device)
    left, right = window_size
    if left >= 0:
        allowed = allowed & (j >= i - left)
    if right >= 0:
        allowed = allowed & (j <= i + right)
    allowed = allowed.expand(batch, nheads, seqlen_q, seqlen_k)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            allowed = allowed & attn_mask
        else:
            scores = scores + attn_mask.to(dtype)
            allowed = allowed & (attn_mask != float("-inf"))

    # softmax written out so that fully masked rows give 0 (not NaN) in both passes
    masked = scores.masked_fill(~allowed, float("-inf"))
    if learnable_sink is not None:  # the sink's column, last: it joins the softmax and multiplies no value
        sink_column = learnable_sink.to(dtype).reshape(1, nheads, 1, 1).expand(batch, nheads, seqlen_q, 1)
        masked = torch.cat([masked, sink_column], dim=-1)
    if masked.shape[-1] == 0:  # no keys at all: amax has nothing to reduce
        row_max = torch.zeros(batch, nheads, seqlen_q, 1, dtype=dtype, device=q.device)
    else:
        row_max = masked.amax(dim=-1, keepdim=True).detach()
    row_max = row_max.masked_fill(row_max == float("-inf"), 0.0)
    weights = torch.exp(masked - row_max)
    total = weights.sum(dim=-1, keepdim=True)
    has_keys = total > 0
    probs = weights / torch.where(has_keys, total, torch.ones_like(total))
    probs = probs[..., :seqlen_k]  # the sink's column multiplies no value
    if dropout_mask is not None:
        probs = probs * dropout_mask.to(dtype) / (1.0 - dropout_p)
    out = probs @ v
    lse = torch.where(has_keys, row_max + torch.log(torch.where(has_keys, total, torch.ones_like(total))),
                      torch.full_like(total, float("-inf")))
    return out, lse.squeeze(-1)


def flash_attn_reference(q: Tensor, k: Tensor, v: Tensor, softmax_scale: float | None = None, causal: bool = False,
                         window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                         alibi_slopes: Tensor | None = None, dtype: torch.dtype = torch.float64,
                         learnable_sink: Tensor | None = None, *, dropout_mask: Tensor | None = None,
                         dropout_p: float = 0.0) -> tuple[Tensor, Tensor]:
    """Oracle for `flashtile.flash_attn_func`: flash-attn layout, bottom-right alignment.

    q (batch, seqlen_q, nheads, headdim), k/v (batch, seqlen_k, nheads_k, headdim[_v]); learnable_sink (nheads,);
    dropout_mask: a bool keep-mask (batch, nheads, seqlen_q, seqlen_k) applied with dropout_p as in
    `attention_reference` (for a call's own mask: ~torch.signbit of its S_dmask, or
    flashtile._dropout.dense_keep_mask).
    Returns (out (batch, seqlen_q, nheads, headdim_v), lse (batch, nheads, seqlen_q)) in `dtype`.
    """
    left, right = window_size
    if causal:
        right = 0
    out, lse = attention_reference(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                   softmax_scale=softmax_scale, window_size=(left, right),
                                   diagonal_offset=k.shape[1] - q.shape[1], softcap=softcap,
                                   alibi_slopes=alibi_slopes, learnable_sink=learnable_sink, dtype=dtype,
                                   dropout_mask=dropout_mask, dropout_p=dropout_p)
    return out.transpose(1, 2), lse


def flash_attn_varlen_reference(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                                softmax_scale: float | None = None, causal: bool = False,
                                window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                                alibi_slopes: Tensor | None = None, dtype: torch.dtype = torch.float64,
                                learnable_sink: Tensor | None = None, *, dropout_mask: Tensor | None = None,
                                dropout_p: float = 0.0) -> tuple[Tensor, Tensor]:
    """Oracle for `flashtile.flash_attn_varlen_func`: each packed sequence on its own, bottom-right aligned.

    q (total_q, nheads, headdim), k/v (total_k, nheads_k, headdim[_v]), cu_seqlens_* (nseq + 1,);
    alibi_slopes (nheads,) or (nseq, nheads); learnable_sink (nheads,); dropout_mask (nseq, nheads, >= max len_q,
    >= max len_k), sequence i's keep-mask at dropout_mask[i, :, :len_q, :len_k], applied with dropout_p. Returns
    (out (total_q, nheads, headdim_v), lse (nheads, total_q)) in `dtype`; rows of a sequence with no keys get out 0
    and lse -inf (with a sink: lse = the sink).
    """
    starts_q, starts_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    outs, lses = [], []
    for i in range(len(starts_q) - 1):
        rows_q, rows_k = slice(starts_q[i], starts_q[i + 1]), slice(starts_k[i], starts_k[i + 1])
        slopes = alibi_slopes
        if alibi_slopes is not None and alibi_slopes.dim() == 2:
            slopes = alibi_slopes[i:i + 1]
        mask = None
        if dropout_mask is not None:
            mask = dropout_mask[i:i + 1, :, :rows_q.stop - rows_q.start, :rows_k.stop - rows_k.start]
        out, lse = flash_attn_reference(q[None, rows_q], k[None, rows_k], v[None, rows_k], softmax_scale=softmax_scale,
                                        causal=causal, window_size=window_size, softcap=softcap,
                                        alibi_slopes=slopes, dtype=dtype, learnable_sink=learnable_sink,
                                        dropout_mask=mask, dropout_p=dropout_p)
        outs.append(out[0])
        lses.append(lse[0])
    if not outs:  # no sequences: empty results, still connected to q for autograd
        empty = q.to(dtype)[:, :, :1] * 0
        return empty.expand(-1, -1, v.shape[2]), empty[:, :, 0].t()
    return torch.cat(outs, dim=0), torch.cat(lses, dim=1)


def sdpa_reference(query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None = None,
                   is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False,
                   dtype: torch.dtype = torch.float64) -> tuple[Tensor, Tensor]:
    """Oracle for `flashtile.scaled_dot_product_attention`: torch layout (..., heads, L, E), top-left causal.

    Returns (out (..., heads, L, Ev), lse (..., heads, L)) in `dtype`. (enable_gqa is implied by
    the head counts and accepted for signature parity.)
    """
    lead = query.shape[:-3] if query.dim() > 2 else ()

    def four_d(t):
        return t.reshape(-1, *t.shape[-3:]) if t.dim() > 2 else t.reshape(1, 1, *t.shape)

    mask = None
    if attn_mask is not None:
        full = tuple(query.shape[:-1]) + (key.shape[-2],)
        mask = four_d(attn_mask.expand(full))
    out, lse = attention_reference(four_d(query), four_d(key), four_d(value), softmax_scale=scale,
                                   window_size=(-1, 0 if is_causal else -1), diagonal_offset=0,
                                   attn_mask=mask, dtype=dtype)
    if query.dim() == 2:
        return out[0, 0], lse[0, 0]
    return out.reshape(*lead, *out.shape[1:]), lse.reshape(*lead, *lse.shape[1:])


def rotary_reference(x: Tensor, cos: Tensor, sin: Tensor, positions: Tensor, interleaved: bool,
                     dtype: torch.dtype = torch.float64) -> Tensor:
    """Rotary embedding of x (batch, n, heads, headdim) at positions (batch, n), in `dtype`.

    cos, sin (seqlen_ro, rotary_dim / 2) hold cos and sin of the angles of each position and frequency. Pair j of
    dims, (2j, 2j + 1) when interleaved else (j, j + rotary_dim / 2), read as the complex number x_a + i x_b, is
    multiplied by cos + i sin of its position's angle j; dims past rotary_dim are unchanged. float64 and float32
    multiply complex numbers; other dtypes (the same-dtype eager baseline of fp16 / bf16) take the real formula
    (x_a cos - x_b sin, x_a sin + x_b cos) in that dtype.
    """
    half = cos.shape[-1]
    x = x.to(dtype)
    c, s = cos.to(dtype)[positions.long()][:, :, None], sin.to(dtype)[positions.long()][:, :, None]
    if interleaved:
        a, b = x[..., :2 * half:2], x[..., 1:2 * half:2]
    else:
        a, b = x[..., :half], x[..., half:2 * half]
    if dtype in (torch.float64, torch.float32):
        turned = torch.complex(a, b) * torch.complex(c, s)
        a, b = turned.real, turned.imag
    else:
        a, b = a * c - b * s, a * s + b * c
    out = x.clone()
    if interleaved:
        out[..., :2 * half:2], out[..., 1:2 * half:2] = a, b
    else:
        out[..., :half], out[..., half:2 * half] = a, b
    return out
