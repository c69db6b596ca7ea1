"""Ring attention over torch.distributed: exact attention of a sequence sharded across ranks.

Each rank of the group holds one shard of the sequence's queries, keys and values. The K/V shards travel
around the ring (rank r sends to r + 1 and receives from r - 1, the group's ranks in order) with batched
point-to-point operations (`torch.distributed.batch_isend_irecv`); while one shard is attended, the next one is
already in flight. Each step attends the local queries to the visiting shard with `flash_attn_func(...,
return_lse=True)` and merges the partial results in float32 by the log-sum-exp identity (Flash-Decoding's merge):

    lse = log(sum_i exp(lse_i)),   out = sum_i exp(lse_i - lse) * out_i

The backward re-runs the ring: the K/V shards travel again, each rank recomputes its partial for the visiting
shard under autograd and takes its gradients for the weights exp(lse_i - lse) above, and float32 dK/dV
accumulators travel with the shards, one hop behind, until they reach their owners. Communication, memory and the
overlap are described in docs/distributed.md.

Layouts (how the global sequence of length W * seqlen_local is split over the W ranks; only causal attention
depends on it):

    contiguous   rank r holds chunk r of W equal chunks. Causal: the shards of later ranks are skipped, the
                 diagonal shard is causal, earlier shards are attended in full. Rank 0 does 1 step of work,
                 rank W - 1 does W: the work is unbalanced.
    zigzag       rank r holds chunks r and 2W - 1 - r of 2W equal chunks (seqlen_local even). Causal: every
                 step costs every rank the same half of a full shard's work (the diagonal step: a causal
                 shard), so the work is balanced.

`contiguous_shard` / `zigzag_shard` cut a full sequence into a rank's shard; `contiguous_unshard` /
`zigzag_unshard` put the shards of all ranks back in order.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor

from .interface import flash_attn_func

LAYOUTS = ("contiguous", "zigzag")
_KV_TAG = 0      # K and V shards: tags 0 and 1
_GRAD_TAG = 2    # dK and dV accumulators: tags 2 and 3


def contiguous_shard(x: Tensor, rank: int, world: int, dim: int = 1) -> Tensor:
    """Rank `rank`'s shard of `x` in the contiguous layout: chunk `rank` of `world` equal chunks along `dim`.

    Raises ValueError when x.shape[dim] is not a multiple of world or rank is not in 0 .. world - 1.
    """
    _check_split(x, rank, world, dim, world)
    return x.chunk(world, dim=dim)[rank]


def contiguous_unshard(shards: list[Tensor] | tuple[Tensor, ...], dim: int = 1) -> Tensor:
    """The full sequence from the contiguous-layout shards of ranks 0 .. W - 1 (in that order)."""
    return torch.cat(list(shards), dim=dim)


def zigzag_shard(x: Tensor, rank: int, world: int, dim: int = 1) -> Tensor:
    """Rank `rank`'s shard of `x` in the zigzag layout: chunks rank and 2 * world - 1 - rank of 2 * world equal
    chunks along `dim`, concatenated in that order. For world = 2 and a sequence of chunks 0 1 2 3:

        rank 0: 0 3      rank 1: 1 2

    Raises ValueError when x.shape[dim] is not a multiple of 2 * world or rank is not in 0 .. world - 1.
    """
    _check_split(x, rank, world, dim, 2 * world)
    chunks = x.chunk(2 * world, dim=dim)
    return torch.cat([chunks[rank], chunks[2 * world - 1 - rank]], dim=dim)


def zigzag_unshard(shards: list[Tensor] | tuple[Tensor, ...], dim: int = 1) -> Tensor:
    """The full sequence from the zigzag-layout shards of ranks 0 .. W - 1 (in that order); each shard's length
    along `dim` must be even."""
    world = len(shards)
    halves = []
    for shard in shards:
        if shard.shape[dim] % 2:
            raise ValueError(f"a zigzag shard has two equal halves, but a shard has length {shard.shape[dim]} "
                             f"along dim {dim}")
        halves.append(shard.chunk(2, dim=dim))
    return torch.cat([halves[i][0] for i in range(world)] + [halves[i][1] for i in reversed(range(world))], dim=dim)


def _check_split(x: Tensor, rank: int, world: int, dim: int, parts: int) -> None:
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in 0 .. {world - 1}")
    if x.shape[dim] % parts:
        raise ValueError(f"length {x.shape[dim]} along dim {dim} does not split into {parts} equal chunks")


def ring_flash_attn_func(q: Tensor, k: Tensor, v: Tensor, *, group: dist.ProcessGroup | None = None,
                         causal: bool = False, softmax_scale: float | None = None,
                         window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                         alibi_slopes: Tensor | None = None, return_lse: bool = False,
                         layout: str = "contiguous") -> Tensor | tuple[Tensor, Tensor]:
    """Exact attention of a sequence sharded over the ranks of `group`, by ring attention (see the module docstring).

    Every rank of the group must call it with the same arguments apart from its own shards.

    Args:
        q: (batch, seqlen_local, nheads, headdim): this rank's query rows, in `layout`. Any dtype flash_attn_func
            takes; on the device the process group's backend serves (CPU for gloo, CUDA for NCCL).
        k: (batch, seqlen_local, nheads_k, headdim), v: (batch, seqlen_local, nheads_k, headdim_v): this rank's
            keys and values, nheads % nheads_k == 0 (grouped-query attention without copies). Every rank's
            shards have the same shapes and dtype.
        group: the process group whose ranks form the ring, in rank order; None: the default group.
        causal: causal attention over the global sequence (query at global position i sees keys j <= i).
        softmax_scale: multiplier of q.k; None means 1 / sqrt(headdim).
        window_size: only (-1, -1) (no window) is supported.
        softcap: as in flash_attn_func (position-independent, so exact here).
        alibi_slopes: only None is supported.
        return_lse: also return the log-sum-exp of each local query row over all keys.
        layout: "contiguous" or "zigzag" (see the module docstring); only causal attention depends on it.

    Returns:
        out (batch, seqlen_local, nheads, headdim_v) in q's dtype; with return_lse=True, (out, lse) with lse
        (batch, nheads, seqlen_local) float32, natural log. Differentiable with respect to q, k, v (and through
        lse): the backward runs the ring again (every rank must run it).

    Raises:
        ValueError on every rank, before any point-to-point transfer, when the ranks' shards differ in shape or
        dtype, when a rank's q, k, v disagree on batch or seqlen_local, or when layout is "zigzag" and
        seqlen_local is odd (the shapes are checked collectively by one all_gather, so no rank waits for a rank
        that raised); ValueError for an unknown layout; NotImplementedError for a window or ALiBi slopes
        (position-dependent masks and biases need each step's global offsets, which flash_attn_func cannot take).
        Errors of flash_attn_func's own validation (head counts, dtypes) are raised identically on every rank.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if tuple(int(w) for w in window_size) != (-1, -1):
        raise NotImplementedError("ring_flash_attn_func supports no sliding window yet "
                                  f"(window_size={tuple(window_size)}); pass (-1, -1)")
    if alibi_slopes is not None:
        raise NotImplementedError("ring_flash_attn_func does not take alibi_slopes yet; pass None")
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[-1])
    ring = _Ring(group)
    _check_shapes_collectively(q, k, v, ring, layout)
    out, lse = _RingAttention.apply(q, k, v, ring, causal, float(softmax_scale), float(softcap), layout)
    return (out, lse) if return_lse else out


class _Ring:
    """The group, this rank's place in it, and its neighbours as global ranks (what P2POp takes)."""

    def __init__(self, group):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.next = self._global((self.rank + 1) % self.world)
        self.prev = self._global((self.rank - 1) % self.world)

    def _global(self, rank: int) -> int:
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    def exchange(self, tensors: list[Tensor], tag: int) -> tuple[list[Tensor], list]:
        """Start sending `tensors` to the next rank and receiving as many of the same shapes from the previous one:
        one batch_isend_irecv call of 2 * len(tensors) operations, tagged tag, tag + 1, ... (K/V shards and
        gradient accumulators use different tags, so transfers of one kind never match receives of the other).
        Returns the receive buffers and the requests."""
        tensors = [t.contiguous() for t in tensors]   # gloo and NCCL send whole contiguous buffers
        received = [torch.empty_like(t) for t in tensors]
        ops = [dist.P2POp(dist.isend, t, self.next, self.group, tag + i) for i, t in enumerate(tensors)]
        ops += [dist.P2POp(dist.irecv, t, self.prev, self.group, tag + i) for i, t in enumerate(received)]
        return received, dist.batch_isend_irecv(ops)


def _check_shapes_collectively(q, k, v, ring: _Ring, layout: str) -> None:
    # one row per rank: the tensors' dims, their shapes (padded or cut to 4 dims), the three dtypes
    dims = [q.dim(), k.dim(), v.dim()]
    shapes = [size for t in (q, k, v) for size in (list(t.shape) + [0] * 4)[:4]]
    dtypes = [_DTYPE_CODES.get(t.dtype, -1) for t in (q, k, v)]
    mine = torch.tensor(dims + shapes + dtypes, dtype=torch.int64, device=q.device)
    every = [torch.empty_like(mine) for _ in range(ring.world)]
    dist.all_gather(every, mine, group=ring.group)
    rows = [r.tolist() for r in every]
    problems = []
    for rank, row in enumerate(rows):
        if row[:3] != [4, 4, 4]:
            problems.append(f"rank {rank}: q, k, v must be 4-D (batch, seqlen_local, heads, headdim), got "
                            f"{row[0]}-D, {row[1]}-D, {row[2]}-D")
            continue
        bq, sq, bk, sk, bv, sv = row[3], row[4], row[7], row[8], row[11], row[12]
        if not (bq == bk == bv and sq == sk == sv):
            problems.append(f"rank {rank}: q, k, v must share batch and seqlen_local, got q {tuple(row[3:7])}, "
                            f"k {tuple(row[7:11])}, v {tuple(row[11:15])}")
    if len({tuple(r) for r in rows}) > 1:
        described = "; ".join(f"rank {rank}: q {tuple(r[3:7])} k {tuple(r[7:11])} v {tuple(r[11:15])} "
                              f"dtypes {_dtype_names(r[15:])}" for rank, r in enumerate(rows))
        problems.append("every rank's shards must have the same shapes and dtypes (equal seqlen_local: pad the "
                        f"sequence or shard it evenly), got {described}")
    if layout == "zigzag" and not problems and rows[0][4] % 2:
        problems.append(f"the zigzag layout holds two equal chunks per rank, but seqlen_local is {rows[0][4]} (odd)")
    if problems:
        raise ValueError("ring_flash_attn_func: " + "; ".join(problems))


_DTYPE_CODES = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2, torch.float64: 3}


def _dtype_names(codes) -> str:
    names = {code: str(dtype).removeprefix("torch.") for dtype, code in _DTYPE_CODES.items()}
    return "/".join(names.get(c, "other") for c in codes)


def _pieces(layout: str, causal: bool, rank: int, src: int, seqlen: int) -> list[tuple[slice, slice, bool]]:
    """What the local queries attend of the shard of rank `src`: (query rows, key rows, causal) triples, in
    local positions; [] when nothing (a later shard under causal contiguous attention)."""
    every = slice(None)
    if not causal:
        return [(every, every, False)]
    if src == rank:
        # the diagonal: in both layouts, local order is global order within the shard, so local causal is global
        # causal (zigzag: the second chunk's queries see all of the first chunk, whose queries see none of it)
        return [(every, every, True)]
    if layout == "contiguous":
        return [(every, every, False)] if src < rank else []
    half = seqlen // 2
    if src < rank:
        # chunks src < rank and 2W-1-src > 2W-1-rank: both local chunks see the first visiting chunk only
        return [(every, slice(0, half), False)]
    # src > rank: the first local chunk (rank < src) sees nothing; the second (2W-1-rank) sees both visiting chunks
    return [(slice(half, None), every, False)]


def _merge(out: Tensor, lse: Tensor, part_out: Tensor, part_lse: Tensor) -> None:
    """out, lse (float32, in place) <- the log-sum-exp merge of themselves with a partial result. Rows where both
    are -inf (no key yet) stay out = 0, lse = -inf."""
    new_lse = torch.logaddexp(lse, part_lse)
    empty = new_lse == float("-inf")
    safe = torch.where(empty, 0.0, new_lse)
    w_old = torch.exp(lse - safe).masked_fill(empty, 0.0).transpose(1, 2).unsqueeze(-1)
    w_new = torch.exp(part_lse - safe).masked_fill(empty, 0.0).transpose(1, 2).unsqueeze(-1)
    out.copy_(out * w_old + part_out.float() * w_new)
    lse.copy_(new_lse)


class _RingAttention(torch.autograd.Function):

    @staticmethod
    def forward(ctx, q, k, v, ring, causal, scale, softcap, layout):
        batch, seqlen, nheads, _ = q.shape
        out = torch.zeros(batch, seqlen, nheads, v.shape[-1], dtype=torch.float32, device=q.device)
        lse = torch.full((batch, nheads, seqlen), float("-inf"), dtype=torch.float32, device=q.device)
        k_cur, v_cur = k.detach(), v.detach()
        q_det = q.detach()
        for step in range(ring.world):
            pending = None
            if step < ring.world - 1:
                pending = ring.exchange([k_cur, v_cur], _KV_TAG)   # the next shard travels while this one is attended
            src = (ring.rank - step) % ring.world
            for rows, keys, piece_causal in _pieces(layout, causal, ring.rank, src, seqlen):
                part_out, part_lse = flash_attn_func(q_det[:, rows], k_cur[:, keys], v_cur[:, keys],
                                                     softmax_scale=scale, causal=piece_causal, softcap=softcap,
                                                     return_lse=True)
                _merge(out[:, rows], lse[:, :, rows], part_out, part_lse)
            if pending is not None:
                (k_cur, v_cur), requests = pending
                for request in requests:
                    request.wait()
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.causal, ctx.scale, ctx.softcap, ctx.layout = ring, causal, scale, softcap, layout
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse = ctx.saved_tensors
        ring = ctx.ring
        seqlen = q.shape[1]
        grad_out = torch.zeros_like(out, dtype=torch.float32) if grad_out is None else grad_out.float()
        grad_lse = torch.zeros_like(lse) if grad_lse is None else grad_lse.float()
        # sum over dv of dO * (out_i - out) enters each partial's lse gradient; its out part is shared by all steps
        d_out_dot = (grad_out * out.float()).sum(-1).transpose(1, 2)   # (batch, nheads, seqlen)
        dq = torch.zeros_like(q, dtype=torch.float32)
        k_cur, v_cur = k.detach(), v.detach()
        own = None          # this rank's contribution to its own dK, dV
        incoming = None     # (buffers, requests): the accumulator of the next visiting shard, from the previous rank
        for step in range(ring.world):
            pending = ring.exchange([k_cur, v_cur], _KV_TAG) if step < ring.world - 1 else None
            src = (ring.rank - step) % ring.world
            dk, dv = _partial_gradients(q, k_cur, v_cur, lse, grad_out, grad_lse, d_out_dot, dq, ctx, src, seqlen)
            if step == 0:
                own = (dk, dv)
            else:
                if incoming is not None:
                    # the accumulator of shard src holds the ranks src + 1 .. rank - 1 already (waiting on the
                    # batch also completes this rank's previous send; each request is waited on once)
                    (dk_in, dv_in), requests = incoming
                    for request in requests:
                        request.wait()
                    dk, dv = dk + dk_in, dv + dv_in
                # pass it on: after the last step the next rank is the shard's owner
                incoming = ring.exchange([dk, dv], _GRAD_TAG)
            if pending is not None:
                (k_cur, v_cur), requests = pending
                for request in requests:
                    request.wait()
        dk, dv = own
        if incoming is not None:
            (dk_in, dv_in), requests = incoming
            for request in requests:
                request.wait()
            dk, dv = dk + dk_in, dv + dv_in
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None


def _partial_gradients(q, k_vis, v_vis, lse, grad_out, grad_lse, d_out_dot, dq, ctx, src, seqlen):
    """Gradients of the merged result through the partial of the visiting shard of rank `src`: adds to dq in place,
    returns (dK, dV) of that shard in float32.

    With w = exp(lse_i - lse): out = sum_i w_i out_i gives d out_i = w_i dO and
    d lse_i = w_i (dlse + sum_d dO (out_i - out)); the partial is recomputed under autograd and differentiated."""
    dk = torch.zeros_like(k_vis, dtype=torch.float32)
    dv = torch.zeros_like(v_vis, dtype=torch.float32)
    for rows, keys, piece_causal in _pieces(ctx.layout, ctx.causal, ctx.ring.rank, src, seqlen):
        with torch.enable_grad():
            q_in = q.detach()[:, rows].requires_grad_()
            k_in = k_vis[:, keys].detach().requires_grad_()
            v_in = v_vis[:, keys].detach().requires_grad_()
            part_out, part_lse = flash_attn_func(q_in, k_in, v_in, softmax_scale=ctx.scale, causal=piece_causal,
                                                 softcap=ctx.softcap, return_lse=True)
            total = lse[:, :, rows]
            finite = total > float("-inf")
            weight = torch.exp(part_lse.detach() - torch.where(finite, total, 0.0)).masked_fill(~finite, 0.0)
            g_out = grad_out[:, rows] * weight.transpose(1, 2).unsqueeze(-1)
            part_dot = (grad_out[:, rows] * part_out.detach().float()).sum(-1).transpose(1, 2)
            g_lse = weight * (grad_lse[:, :, rows] + part_dot - d_out_dot[:, :, rows])
            gq, gk, gv = torch.autograd.grad((part_out, part_lse), (q_in, k_in, v_in),
                                             (g_out.to(part_out.dtype), g_lse))
        dq[:, rows] += gq.float()
        dk[:, keys] += gk.float()
        dv[:, keys] += gv.float()
    return dk, dv
