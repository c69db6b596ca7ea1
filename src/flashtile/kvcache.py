"""Attention over a KV cache: appending new tokens in place, and split-KV (Flash-Decoding) attention.

Decoding asks few queries (often one per sequence) against a long cache, so batch x heads alone
cannot keep a processor busy. Flash-Decoding splits each sequence's keys into `num_splits`
chunks, attends to each chunk independently (a partial output o_s and its log-sum-exp lse_s), and
merges them exactly with the log-sum-exp identity:

    lse = log(sum_s exp(lse_s)),   out = sum_s exp(lse_s - lse) * o_s

(a chunk no query row can see has lse_s = -inf and weight 0). The result equals unsplit attention
up to rounding, whatever the split count. A learnable sink joins the merge once, as one more term
with lse_s = the sink and o_s = 0 (the chunks themselves are attended without it).

The cache is either contiguous, (batch_cache, capacity, nheads_k, dim), or paged, (num_blocks, page_size,
nheads_k, dim) with a block table mapping sequence b's page i to block block_table[b, i]. A contiguous
cache's row for sequence b is cache_batch_idx[b] (b without it). Sequence b's keys are positions
cache_leftpad[b] (0 without it) .. cache_seqlens[b] + seqlen_new - 1 of its row, the new tokens written at
cache_seqlens[b] onwards; its queries are its newest tokens (causal and windows bottom-right aligned to the
end of its keys, so the left padding is invisible to them).

Rotary embeddings (rotary_cos / rotary_sin, as in flash-attn) rotate q and the new keys before the append: the new
key t of sequence b at position cache_seqlens[b] + t, query row i at cache_seqlens[b] + i with causal or a window,
else at cache_seqlens[b]. The rotated keys are what the cache stores; v is never rotated. Here they are torch ops on
the tensors' device (rotate, apply_rotary, then append_to_cache): the torch backend's path, and the definition
whose bits the Triton backend's one-launch kernel (flashtile.triton.append.kvcache_append_kernel, which appends and,
with tables, rotates first) gives.

The append runs on the tensors' device. attention_over_cache is the torch backend's attention (any
device; one dense tiled pass per sequence and split; it reads cache_seqlens on the host); the Triton
backend's is flashtile.triton.decode.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from . import torch_impl
from ._validate import KVCacheCall, PagedVarlenCall


def _paged_slots(table: torch.Tensor, positions: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(block, slot) of key positions through block-table rows: table (..., max_blocks), positions (..., n)."""
    return table.to(torch.int64).gather(-1, positions // page_size), positions % page_size


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """x (batch, n, heads, headdim) with its first rotary_dim = 2 * cos.shape[-1] dims rotated by the angles whose
    cosines and sines are cos, sin (batch, n, rotary_dim / 2): pair j is (2j, 2j + 1) when interleaved (GPT-J),
    else (j, j + rotary_dim / 2) (GPT-NeoX). Computed in float32 (float64 for float64 x) and rounded once to x's
    dtype; the dims past rotary_dim are copied. Returns a new contiguous tensor."""
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    half = cos.shape[-1]
    c, s = cos.to(compute)[:, :, None], sin.to(compute)[:, :, None]  # broadcast over heads
    head = x[..., :2 * half].to(compute)
    if interleaved:
        first, second = head[..., 0::2], head[..., 1::2]
    else:
        first, second = head[..., :half], head[..., half:]
    # (first + i second) * (cos + i sin)
    new_first, new_second = first * c - second * s, first * s + second * c
    if interleaved:
        rotated = torch.stack((new_first, new_second), dim=-1).flatten(-2)
    else:
        rotated = torch.cat((new_first, new_second), dim=-1)
    return torch.cat((rotated.to(x.dtype), x[..., 2 * half:]), dim=-1)


def apply_rotary(call: KVCacheCall) -> None:
    """Replace call.q and call.k_new by their rotated copies (the caller's tensors are not modified); nothing
    without rotary tables.

    Positions are cache_seqlens[b] + t for the new key t, and for query row i the same with layout.rotary_shifted
    (causal or a window), else cache_seqlens[b]. They are clamped into the tables, so unchecked values
    (check_values) that would reach past them give undefined results but never read outside the tables.
    """
    if call.rotary_cos is None:
        return
    layout = call.layout
    cos, sin = call.rotary_cos, call.rotary_sin
    start = call.cache_seqlens.to(torch.int64)[:, None]

    def tables(n: int, shifted: bool) -> tuple[torch.Tensor, torch.Tensor]:
        steps = torch.arange(n, device=start.device) if shifted else torch.zeros(n, dtype=torch.int64,
                                                                                  device=start.device)
        positions = (start + steps).clamp_(0, layout.rotary_len - 1)  # (batch, n)
        return cos[positions], sin[positions]

    with torch.no_grad():  # the call returns no gradient
        call.q = rotate(call.q, *tables(call.q.shape[1], layout.rotary_shifted), layout.rotary_interleaved)
        if call.k_new.shape[1]:
            call.k_new = rotate(call.k_new, *tables(call.k_new.shape[1], True), layout.rotary_interleaved)


def append_to_cache(call: KVCacheCall) -> None:
    """Write k_new / v_new into the caches in place at positions cache_seqlens[b] .. + seqlen_new - 1 (of row
    cache_batch_idx[b] when given).

    Device-side indexing only (nothing is read back to the host). Where prepare_kvcache checked the
    capacity and block indices this cannot fail halfway; where it did not (check_values), an index outside
    the cache stops at torch's own bounds check instead of writing outside it.
    """
    if call.k_new is None or call.k_new.shape[1] == 0:
        return
    batch, seqlen_new = call.k_new.shape[:2]
    positions = call.cache_seqlens.to(torch.int64)[:, None] + torch.arange(seqlen_new, device=call.q.device)
    if call.block_table is None:
        rows = (torch.arange(batch, device=call.q.device) if call.cache_batch_idx is None
                else call.cache_batch_idx.to(torch.int64))
        first, second = rows[:, None].expand(-1, seqlen_new), positions
    else:
        first, second = _paged_slots(call.block_table, positions, call.page_size)
    call.k_cache[first, second] = call.k_new
    call.v_cache[first, second] = call.v_new


def sequence_keys(call: KVCacheCall, b: int, length: int, row: int | None = None,
                  start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values start .. length - 1 of sequence b (of cache row `row`, default b, for a contiguous cache)
    as (1, length - start, nheads_k, dim) tensors."""
    if call.block_table is None:
        row = b if row is None else row
        return call.k_cache[row:row + 1, start:length], call.v_cache[row:row + 1, start:length]
    first, second = _paged_slots(call.block_table[b], torch.arange(length, device=call.q.device), call.page_size)
    return call.k_cache[first, second].unsqueeze(0), call.v_cache[first, second].unsqueeze(0)


def combine_splits(outs: list[torch.Tensor], lses: list[torch.Tensor],
                   learnable_sink: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge partial results exactly: outs (..., seqlen_q, nheads, dv) and lses (..., nheads, seqlen_q) per split,
    with learnable_sink (nheads,) as one more term of the denominator (a split of lse = sink and out = 0).

    Rows that no split could see keep out = 0 and lse = -inf (with a sink: lse = the sink).
    """
    lse_stack = torch.stack(lses)  # (splits, ..., nheads, seqlen_q)
    if learnable_sink is None:
        lse = torch.logsumexp(lse_stack, dim=0)
    else:
        sink = learnable_sink.to(lse_stack.dtype)[:, None].expand(lse_stack.shape[1:])
        lse = torch.logsumexp(torch.cat([lse_stack, sink[None]]), dim=0)
    finite = torch.where(lse.isfinite(), lse, torch.zeros_like(lse))
    weights = torch.exp(lse_stack - finite)  # exp(-inf) = 0 for splits a row never saw
    out = sum(w.transpose(-1, -2).unsqueeze(-1) * o.to(w.dtype) for w, o in zip(weights, outs))
    return out, lse


def split_bounds(length: int, num_splits: int) -> list[tuple[int, int]]:
    """[k0, k1) key chunks of nearly equal size covering 0 .. length - 1 (at least one chunk)."""
    if length == 0:
        return [(0, 0)]
    step = -(-length // max(1, min(num_splits, length)))
    return [(k0, min(k0 + step, length)) for k0 in range(0, length, step)]


def attention_over_cache(call: KVCacheCall, tiles: torch_impl.TorchTiles,
                         num_splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch backend: out (batch, seqlen_q, nheads, headdim_v) in q's dtype and lse (batch, nheads, seqlen_q).

    Each sequence's keys are split into num_splits chunks, each attended by the dense tiled forward
    with the diagonal shifted to the chunk, then merged by combine_splits.
    """
    p = call.problem
    seqlen_q = p.seqlen_q
    seqlen_new = 0 if call.k_new is None else call.k_new.shape[1]
    outs, lses = [], []
    batch = len(call.q)
    rows = list(range(batch)) if call.cache_batch_idx is None else call.cache_batch_idx.tolist()
    starts = [0] * batch if call.cache_leftpad is None else call.cache_leftpad.tolist()
    for b, cached in enumerate(call.cache_seqlens.tolist()):
        keys, values = sequence_keys(call, b, cached + seqlen_new, rows[b], starts[b])
        length = keys.shape[1]
        slopes = torch_impl.sequence_slopes(call.alibi_slopes, b)
        partial_outs, partial_lses = [], []
        for k0, k1 in split_bounds(length, num_splits):
            # the chunks are attended without the sink, which joins their merge once
            chunk = replace(p, batch=1, seqlen_k=k1 - k0, diagonal_offset=length - seqlen_q - k0, kvcache=False,
                            has_sink=False)
            out, lse = torch_impl.attention_forward(call.q[b:b + 1], keys[:, k0:k1], values[:, k0:k1], slopes,
                                                    None, chunk, tiles)
            partial_outs.append(out)
            partial_lses.append(lse)
        out, lse = combine_splits(partial_outs, partial_lses, call.learnable_sink)
        outs.append(out.to(p.dtype))
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses).float()


def paged_varlen_forward(call: PagedVarlenCall, tiles: torch_impl.TorchTiles) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch backend of flash_attn_varlen_func with block_table: out (1, total_q, nheads, headdim_v) in q's dtype and
    lse (1, nheads, total_q) in the accumulation dtype.

    Per sequence, its keys are gathered from the pages through its block-table row (the gather
    flash_attn_with_kvcache uses) and attended by the dense tiled forward, bottom-right aligned. Reads the offsets
    and key counts on the host (one synchronisation on a GPU).
    """
    p = call.problem
    q = call.q
    out = torch.zeros(1, q.shape[1], p.nheads, p.headdim_v, dtype=p.dtype, device=p.device)
    lse = torch.full((1, p.nheads, q.shape[1]), float("-inf"), dtype=p.accumulation_dtype, device=p.device)
    starts = call.cu_seqlens_q.tolist()
    for b, length in enumerate(call.seqlens_k.tolist()):
        rows = slice(starts[b], starts[b + 1])
        seqlen_q = rows.stop - rows.start
        if seqlen_q == 0:
            continue
        first, second = _paged_slots(call.block_table[b], torch.arange(length, device=p.device), call.page_size)
        keys, values = call.k_cache[first, second].unsqueeze(0), call.v_cache[first, second].unsqueeze(0)
        sequence = replace(p, batch=1, seqlen_q=seqlen_q, seqlen_k=length, diagonal_offset=length - seqlen_q,
                           varlen=False, paged=False)
        out[:, rows], lse[:, :, rows] = torch_impl.attention_forward(
            q[:, rows], keys, values, torch_impl.sequence_slopes(call.alibi_slopes, b), None, sequence, tiles,
            call.learnable_sink)
    return out, lse
