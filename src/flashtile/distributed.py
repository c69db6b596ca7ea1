"""Ring attention over torch.distributed: exact attention of a sequence sharded across ranks.

Each rank of the group holds one shard of the sequence's queries, keys and values. The K/V shards travel
around the ring (rank r sends to r + 1 and receives from r - 1, the group's ranks in order) with batched
point-to-point operations (`torch.distributed.batch_isend_irecv`); while one shard is attended, the next one is
already in flight. Each step attends the local queries to the visiting shard with flash_attn_func's kernels
(returning the log-sum-exp) and merges the partial results in float32 by the log-sum-exp identity
(Flash-Decoding's merge; the first partial that covers every row is kept as it is):

    lse = log(sum_i exp(lse_i)),   out = sum_i exp(lse_i - lse) * out_i

The backward re-runs the ring: the K/V shards travel again and each rank runs the kernels' own backward on the
visiting shard with the merged out and lse, whose probabilities exp(S - lse) and delta = rowsum(dO * out) are
those of the whole sequence, so each shard's gradients are exactly its share (nothing recomputed under autograd).
dQ stays on its rank; float32 dK/dV accumulators travel with the shards, one hop behind, until they reach their
owners. Communication, memory and the overlap are described in docs/distributed.md.

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

`ring_flash_attn_varlen_func` is the same ring over packed variable-length batches (flash_attn_varlen_func's
layout): every sequence of the batch is sharded over the ranks in the layout above, each rank's shard of each
sequence packed one after another in sequence order, and `cu_seqlens` gives the boundaries of the local shards
(the same on every rank). `shard_cu_seqlens` turns the batch's global boundaries into the local ones;
`contiguous_shard_varlen` / `zigzag_shard_varlen` and their `_unshard_` inverses convert packed tensors.
Dense and varlen calls share one ring (forward and backward); they differ only in how a step's pieces select
rows and call the attention kernel (`_DensePlan`, `_VarlenPlan`).

Sliding windows and ALiBi depend on global positions: there a step's pieces are pairs of chunks (one per rank in
the contiguous layout, two in the zigzag one), each attended with the diagonal offset of its global positions (the
query chunk's first position minus the key chunk's), and a pair that the window leaves empty is skipped. In a
packed batch that offset is a multiple of each sequence's own chunk length, so there each sequence's pairs are
attended by calls of their own.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist
from torch import Tensor

from . import _dispatch
from ._validate import (PreparedCall, _check_flash_options, prepare_flash_attn, prepare_flash_attn_varlen,
                        unit_last_stride)
from .autograd import attention

__all__ = ["LAYOUTS", "contiguous_shard", "contiguous_shard_varlen", "contiguous_unshard", "contiguous_unshard_varlen",
           "ring_flash_attn_func", "ring_flash_attn_varlen_func", "shard_cu_seqlens", "zigzag_shard",
           "zigzag_shard_varlen", "zigzag_unshard", "zigzag_unshard_varlen"]

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


def shard_cu_seqlens(cu_seqlens: Tensor, world: int, layout: str = "contiguous") -> Tensor:
    """The boundaries of each rank's shards of a packed batch: cu_seqlens // world.

    Args:
        cu_seqlens: (nseq + 1,) integer tensor, the global boundaries: sequence i owns the packed rows
            cu_seqlens[i] .. cu_seqlens[i + 1] - 1 (cu_seqlens[0] = 0, non-decreasing).
        world: the number of ranks.
        layout: "contiguous" (every length a multiple of world) or "zigzag" (a multiple of 2 * world).

    Returns:
        (nseq + 1,) tensor of cu_seqlens' dtype and device: the boundaries of the local shards, the same on every
        rank (what ring_flash_attn_varlen_func takes).

    Raises:
        ValueError when cu_seqlens is not 1-D, does not start at 0, decreases, or a sequence's length is not a
        multiple of world (2 * world for zigzag); ValueError for an unknown layout.
    """
    _sequence_lengths(cu_seqlens, world, layout)
    return cu_seqlens // world


def contiguous_shard_varlen(x: Tensor, cu_seqlens: Tensor, rank: int, world: int, dim: int = 0) -> Tensor:
    """Rank `rank`'s packed shard of a packed batch in the contiguous layout: chunk `rank` of `world` equal chunks
    of every sequence, the sequences' chunks one after another.

    Args:
        x: a packed tensor whose dim `dim` holds the cu_seqlens[-1] rows of all sequences, e.g. q
            (total, nheads, headdim) with dim=0 or flash_attn_varlen_func's lse (nheads, total) with dim=1.
        cu_seqlens: (nseq + 1,) global boundaries (see shard_cu_seqlens); every length a multiple of world.

    Returns:
        x's rows of this rank, cu_seqlens[-1] / world along dim; the local boundaries are
        shard_cu_seqlens(cu_seqlens, world).

    Raises:
        ValueError as shard_cu_seqlens, when x.shape[dim] != cu_seqlens[-1], or rank is not in 0 .. world - 1.
    """
    lengths = _packed_lengths(x, cu_seqlens, rank, world, dim, "contiguous")
    return torch.cat([seq.narrow(dim, rank * (n // world), n // world)
                      for seq, n in zip(x.split(lengths, dim=dim), lengths)], dim=dim)


def zigzag_shard_varlen(x: Tensor, cu_seqlens: Tensor, rank: int, world: int, dim: int = 0) -> Tensor:
    """Rank `rank`'s packed shard of a packed batch in the zigzag layout: chunks rank and 2 * world - 1 - rank of
    2 * world equal chunks of every sequence (as zigzag_shard does to one sequence), the sequences' shards one
    after another. Arguments, result and errors as contiguous_shard_varlen, with every length a multiple of
    2 * world."""
    lengths = _packed_lengths(x, cu_seqlens, rank, world, dim, "zigzag")
    shards = []
    for seq, n in zip(x.split(lengths, dim=dim), lengths):
        chunk = n // (2 * world)
        shards += [seq.narrow(dim, rank * chunk, chunk), seq.narrow(dim, (2 * world - 1 - rank) * chunk, chunk)]
    return torch.cat(shards, dim=dim)


def contiguous_unshard_varlen(shards: list[Tensor] | tuple[Tensor, ...], cu_seqlens: Tensor, dim: int = 0) -> Tensor:
    """The packed batch from the contiguous-layout packed shards of ranks 0 .. W - 1 (in that order); cu_seqlens
    are the global boundaries (as given to contiguous_shard_varlen). Raises ValueError as shard_cu_seqlens and when
    a shard's length along dim is not cu_seqlens[-1] / W."""
    per_rank = _split_shards(shards, cu_seqlens, dim, "contiguous")
    return torch.cat([piece for sequence in zip(*per_rank) for piece in sequence], dim=dim)


def zigzag_unshard_varlen(shards: list[Tensor] | tuple[Tensor, ...], cu_seqlens: Tensor, dim: int = 0) -> Tensor:
    """The packed batch from the zigzag-layout packed shards of ranks 0 .. W - 1 (in that order); cu_seqlens are the
    global boundaries (as given to zigzag_shard_varlen). Raises ValueError as contiguous_unshard_varlen."""
    per_rank = _split_shards(shards, cu_seqlens, dim, "zigzag")
    return torch.cat([zigzag_unshard(sequence, dim=dim) for sequence in zip(*per_rank)], dim=dim)


def _sequence_lengths(cu_seqlens: Tensor, world: int, layout: str) -> list[int]:
    """The global sequence lengths of cu_seqlens, checked to shard evenly over world ranks in layout."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    if not isinstance(cu_seqlens, Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError("cu_seqlens must be a 1-D tensor (nseq + 1,), got "
                         f"{tuple(cu_seqlens.shape) if isinstance(cu_seqlens, Tensor) else type(cu_seqlens).__name__}")
    bounds = cu_seqlens.tolist()
    lengths = [b - a for a, b in zip(bounds, bounds[1:])]
    if bounds[0] != 0 or any(n < 0 for n in lengths):
        raise ValueError(f"cu_seqlens must start at 0 and never decrease, got {bounds}")
    parts = world if layout == "contiguous" else 2 * world
    uneven = [(i, n) for i, n in enumerate(lengths) if n % parts]
    if uneven:
        raise ValueError(f"every sequence's length must be a multiple of {parts} to shard over {world} ranks in "
                         f"the {layout} layout, got (sequence, length) {uneven[:4]}; pad the sequences")
    return lengths


def _packed_lengths(x, cu_seqlens, rank, world, dim, layout) -> list[int]:
    lengths = _sequence_lengths(cu_seqlens, world, layout)
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in 0 .. {world - 1}")
    if x.shape[dim] != sum(lengths):
        raise ValueError(f"x has {x.shape[dim]} rows along dim {dim} but cu_seqlens ends at {sum(lengths)}")
    return lengths


def _split_shards(shards, cu_seqlens, dim, layout) -> list[tuple[Tensor, ...]]:
    """Each rank's shard split into its pieces of the sequences."""
    lengths = _sequence_lengths(cu_seqlens, len(shards), layout)
    local = [n // len(shards) for n in lengths]
    for rank, shard in enumerate(shards):
        if shard.shape[dim] != sum(local):
            raise ValueError(f"rank {rank}'s shard has {shard.shape[dim]} rows along dim {dim}, but cu_seqlens "
                             f"gives {sum(local)} per rank")
    return [shard.split(local, dim=dim) for shard in shards]


def ring_flash_attn_func(q: Tensor, k: Tensor, v: Tensor, *, group: dist.ProcessGroup | None = None,
                         causal: bool = False, softmax_scale: float | None = None,
                         window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                         alibi_slopes: Tensor | None = None, return_lse: bool = False,
                         layout: str = "contiguous") -> Tensor | tuple[Tensor, Tensor]:
    """Exact attention of a sequence sharded over the ranks of `group`, by ring attention (see the module docstring).

    Every rank of the group must call it with the same arguments apart from its own shards. With a group of one
    rank it is plain attention and communicates nothing.

    Args:
        q: (batch, seqlen_local, nheads, headdim): this rank's query rows, in `layout`. Any dtype flash_attn_func
            takes; on the device the process group's backend serves (CPU for gloo, CUDA for NCCL).
        k: (batch, seqlen_local, nheads_k, headdim), v: (batch, seqlen_local, nheads_k, headdim_v): this rank's
            keys and values, nheads % nheads_k == 0 (grouped-query attention without copies). Every rank's
            shards have the same shapes and dtype.
        group: the process group whose ranks form the ring, in rank order; None: the default group.
        causal: causal attention over the global sequence (query at global position i sees keys j <= i).
        softmax_scale: multiplier of q.k; None means 1 / sqrt(headdim).
        window_size: (left, right) over global positions, as in flash_attn_func (-1: unbounded); with causal the
            right side is 0.
        softcap: as in flash_attn_func (position-independent, so exact here).
        alibi_slopes: (nheads,) or (batch, nheads) float32, as in flash_attn_func: -slope * |i - j| over global
            positions.
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
        that raised); ValueError for an unknown layout. Errors of flash_attn_func's own validation (head counts,
        dtypes, window sides, the slopes' shape) are raised identically on every rank, before any transfer.
    """
    _check_arguments("ring_flash_attn_func", layout)
    window = _window(window_size, causal)
    # flash_attn_func's own rules on these arguments, on the local shards: every rank raises alike, before sending
    prepare_flash_attn(q, k, v, dropout_p=0.0, softmax_scale=softmax_scale, causal=causal, window_size=window,
                       softcap=softcap, alibi_slopes=alibi_slopes, deterministic=False, return_attn_probs=False,
                       return_lse=True)
    ring = _Ring(group)
    _check_shapes_collectively(q, k, v, ring, layout)
    plan = _DensePlan(layout, causal, _scale(softmax_scale, q), float(softcap), q.shape[1], window, alibi_slopes,
                      ring.world)
    out, lse = _RingAttention.apply(q, k, v, ring, plan)
    return (out, lse) if return_lse else out


def ring_flash_attn_varlen_func(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int, *,
                                group: dist.ProcessGroup | None = None, causal: bool = False,
                                softmax_scale: float | None = None, window_size: tuple[int, int] = (-1, -1),
                                softcap: float = 0.0, alibi_slopes: Tensor | None = None, return_lse: bool = False,
                                layout: str = "contiguous") -> Tensor | tuple[Tensor, Tensor]:
    """Exact attention of a packed variable-length batch whose every sequence is sharded over the ranks of `group`:
    ring attention (see the module docstring) with flash_attn_varlen_func at each step.

    Every sequence of the packed batch is split over the W ranks in `layout` (its global length a multiple of W,
    of 2 * W for zigzag); each rank packs its shards of the sequences one after another, in sequence order. For a
    global packed batch with boundaries cu_global, rank r passes

        q = contiguous_shard_varlen(q_global, cu_global, r, W)     (zigzag_shard_varlen for layout="zigzag")
        cu_seqlens = shard_cu_seqlens(cu_global, W, layout)        (= cu_global // W, the same on every rank)

    Every rank of the group must call it with the same arguments apart from its own shards. With a group of one
    rank it is flash_attn_varlen_func and communicates nothing.

    Args:
        q: (total_local, nheads, headdim): this rank's query rows of every sequence, packed.
        k: (total_local, nheads_k, headdim), v: (total_local, nheads_k, headdim_v): this rank's keys and values,
            nheads % nheads_k == 0 (grouped-query attention without copies). Every rank's tensors have the same
            shapes and dtype.
        cu_seqlens: int32 (nseq + 1,) on q's device, the boundaries of the LOCAL shards: this rank's shard of
            sequence i is rows cu_seqlens[i] .. cu_seqlens[i + 1] - 1 of q, k and v; cu_seqlens[-1] = total_local.
            Identical on every rank (each sequence's shards have equal lengths).
        max_seqlen: the longest local shard (an upper bound, as flash_attn_varlen_func's max_seqlen_q and
            max_seqlen_k hints), the same on every rank.
        group, causal, softmax_scale, window_size, softcap, layout: as in ring_flash_attn_func (causal and the
            window: within each sequence, over its global positions).
        alibi_slopes: (nheads,) or (nseq, nheads) float32, as in flash_attn_varlen_func, over each sequence's
            global positions.
        return_lse: also return the log-sum-exp of each local query row over its sequence's keys.

    Returns:
        out (total_local, nheads, headdim_v) in q's dtype; with return_lse=True, (out, lse) with lse
        (nheads, total_local) float32, natural log (flash_attn_varlen_func's layout); an empty sequence has no
        rows. Differentiable with respect to q, k, v (and through lse): the backward runs the ring again (every
        rank must run it).

    Raises:
        ValueError on every rank, before any point-to-point transfer (all checked collectively by all_gather, so
        no rank waits for a rank that raised): when q, k, v are not 3-D or disagree on total_local; when the
        ranks' tensors differ in shape or dtype; when cu_seqlens is not int32 and 1-D, differs between ranks,
        does not start at 0, decreases, or does not end at total_local; when layout is "zigzag" and a local
        shard's length is odd. TypeError/ValueError for a max_seqlen that is not an int >= 0; ValueError for an
        unknown layout. Errors of flash_attn_varlen_func's own validation (head counts, dtypes, window sides, the
        slopes' shape) are raised identically on every rank, before any transfer.
    """
    _check_arguments("ring_flash_attn_varlen_func", layout)
    # the options' own rules (the window's sides, softcap, the scale): the same arguments on every rank
    _check_flash_options(0.0, softmax_scale, causal, window_size, softcap, False, False, return_lse,
                         q.shape[-1] if isinstance(q, Tensor) else 1)
    window = _window(window_size, causal)
    if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int):
        raise TypeError(f"max_seqlen must be an int, got {max_seqlen!r} ({type(max_seqlen).__name__})")
    if max_seqlen < 0:
        raise ValueError(f"max_seqlen must be >= 0, got {max_seqlen}")
    ring = _Ring(group)
    bounds = _check_varlen_collectively(q, k, v, cu_seqlens, ring, layout)
    # flash_attn_varlen_func's own rules on the other arguments (the window, the slopes' shape, softcap), on shards
    # that every rank now knows to be alike: every rank raises alike, before sending
    prepare_flash_attn_varlen(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p=0.0,
                              softmax_scale=softmax_scale, causal=causal, window_size=window, softcap=softcap,
                              alibi_slopes=alibi_slopes, deterministic=False, return_attn_probs=False,
                              return_lse=True)
    plan = _VarlenPlan(layout, causal, _scale(softmax_scale, q), float(softcap), bounds, max_seqlen, q.device,
                       window, alibi_slopes, ring.world)
    out, lse = _RingAttention.apply(q, k, v, ring, plan)
    return (out, lse) if return_lse else out


def _check_arguments(function: str, layout) -> None:
    """The arguments every rank passes alike: refused before any communication."""
    if layout not in LAYOUTS:
        raise ValueError(f"{function}: layout must be one of {LAYOUTS}, got {layout!r}")


def _window(window_size, causal: bool) -> tuple[int, int]:
    """window_size as flash_attn_func reads it, with causal's right side of 0 (its other rules are
    flash_attn_func's, checked on the shards)."""
    if isinstance(window_size, Tensor):
        window_size = tuple(window_size.tolist())
    left, right = window_size
    return left, 0 if causal else right


def _scale(softmax_scale: float | None, q: Tensor) -> float:
    return 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)


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

    def gather(self, row: list[int], device) -> list[list[int]]:
        """Every rank's `row` (equal lengths on every rank), in rank order: one all_gather; none for one rank."""
        if self.world == 1:
            return [list(row)]
        mine = torch.tensor(row, dtype=torch.int64, device=device)
        every = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(every, mine, group=self.group)
        return [r.tolist() for r in every]


def _shape_row(tensors, ndim: int) -> list[int]:
    """The tensors' dims, their shapes (padded or cut to ndim dims) and dtype codes, as one list of ints."""
    dims = [t.dim() for t in tensors]
    shapes = [size for t in tensors for size in (list(t.shape) + [0] * ndim)[:ndim]]
    return dims + shapes + [_DTYPE_CODES.get(t.dtype, -1) for t in tensors]


def _check_shapes_collectively(q, k, v, ring: _Ring, layout: str) -> None:
    # one row per rank: the tensors' dims, their shapes (padded or cut to 4 dims), the three dtypes
    rows = ring.gather(_shape_row((q, k, v), 4), q.device)
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


def _check_varlen_collectively(q, k, v, cu_seqlens, ring: _Ring, layout: str) -> list[int]:
    """Checks the packed shards of every rank together; returns the local boundaries (a list, equal on every rank).

    Two all_gathers: the shapes with cu_seqlens' size, then, when every rank passed cu_seqlens of one size,
    its values. Every rank sees the same rows and so takes the same branch and raises the same error."""
    cu_ok = isinstance(cu_seqlens, Tensor)
    cu_row = [cu_seqlens.dim(), cu_seqlens.numel(), int(cu_seqlens.dtype == torch.int32)] if cu_ok else [-1, -1, 0]
    rows = ring.gather(_shape_row((q, k, v), 3) + cu_row, q.device)
    problems = []
    for rank, row in enumerate(rows):
        if row[:3] != [3, 3, 3]:
            problems.append(f"rank {rank}: q, k, v must be 3-D (total_local, heads, headdim), got "
                            f"{row[0]}-D, {row[1]}-D, {row[2]}-D")
        elif not row[3] == row[6] == row[9]:
            problems.append(f"rank {rank}: q, k, v must share total_local, got q {tuple(row[3:6])}, "
                            f"k {tuple(row[6:9])}, v {tuple(row[9:12])}")
        if row[15] != 1 or row[16] < 1 or row[17] != 1:
            got = "no tensor" if row[15] < 0 else f"{row[15]}-D, {row[16]} elements, int32: {bool(row[17])}"
            problems.append(f"rank {rank}: cu_seqlens must be a 1-D int32 tensor (nseq + 1,), got {got}")
    if len({tuple(r) for r in rows}) > 1:
        described = "; ".join(f"rank {rank}: q {tuple(r[3:6])} k {tuple(r[6:9])} v {tuple(r[9:12])} "
                              f"dtypes {_dtype_names(r[12:15])} cu_seqlens of {r[16]}" for rank, r in enumerate(rows))
        problems.append("every rank's shards must have the same shapes and dtypes and the same number of sequences "
                        f"(shard every sequence evenly: shard_cu_seqlens), got {described}")
    if problems:
        raise ValueError("ring_flash_attn_varlen_func: " + "; ".join(problems))
    every = ring.gather(cu_seqlens.to(device=q.device, dtype=torch.int64).tolist(), q.device)
    bounds, total = every[0], rows[0][3]
    if any(b != bounds for b in every):
        different = [rank for rank, b in enumerate(every) if b != bounds]
        problems.append(f"cu_seqlens must be the same on every rank (each sequence sharded evenly), but ranks "
                        f"{different} differ from rank 0's {bounds[:8]}")
    elif bounds[0] != 0 or any(b < a for a, b in zip(bounds, bounds[1:])) or bounds[-1] != total:
        problems.append(f"cu_seqlens must start at 0, never decrease and end at total_local = {total}, got "
                        f"{bounds[:8]}{' ...' if len(bounds) > 8 else ''}")
    elif layout == "zigzag":
        odd = [(i, b - a) for i, (a, b) in enumerate(zip(bounds, bounds[1:])) if (b - a) % 2]
        if odd:
            problems.append(f"the zigzag layout holds two equal chunks of every sequence per rank, but these local "
                            f"shards have odd lengths (sequence, length): {odd[:4]}")
    if problems:
        raise ValueError("ring_flash_attn_varlen_func: " + "; ".join(problems))
    return bounds


_DTYPE_CODES = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2, torch.float64: 3}


def _dtype_names(codes) -> str:
    names = {code: str(dtype).removeprefix("torch.") for dtype, code in _DTYPE_CODES.items()}
    return "/".join(names.get(c, "other") for c in codes)


def _pieces(layout: str, causal: bool, rank: int, src: int) -> list[tuple[str, str, bool]]:
    """What the local queries attend of the shard of rank `src`: (query rows, key rows, causal) triples, the rows
    named "all", "first" or "second" (the first or second half of each local sequence's shard); [] when nothing
    (a later shard under causal contiguous attention)."""
    if not causal:
        return [("all", "all", False)]
    if src == rank:
        # the diagonal: in both layouts, local order is global order within the shard, so local causal is global
        # causal (zigzag: the second chunk's queries see all of the first chunk, whose queries see none of it)
        return [("all", "all", True)]
    if layout == "contiguous":
        return [("all", "all", False)] if src < rank else []
    if src < rank:
        # chunks src < rank and 2W-1-src > 2W-1-rank: both local chunks see the first visiting chunk only
        return [("all", "first", False)]
    # src > rank: the first local chunk (rank < src) sees nothing; the second (2W-1-rank) sees both visiting chunks
    return [("second", "all", False)]


class _DensePlan:
    """Pieces of (batch, seqlen_local, heads, d) shards: halves are slices of the sequence dim.

    A piece is (query rows, key rows, argument): without a window or ALiBi the argument is causal, as _pieces gives
    it; with them (`banded`) the diagonal offset of the rows' global positions, see _banded_pieces."""

    token_dim = 1

    def __init__(self, layout, causal, scale, softcap, seqlen, window=(-1, -1), alibi_slopes=None, world=1):
        self.layout, self.causal, self.scale, self.softcap = layout, causal, scale, softcap
        self.window, self.alibi_slopes, self.world, self.seqlen = window, alibi_slopes, world, seqlen
        # causal attention alone takes _pieces' causal flags: the diagonal step is one causal call over the shard
        self.banded = _is_banded(window, causal, alibi_slopes)
        half = seqlen // 2
        self.rows = {"all": slice(None), "first": slice(0, half), "second": slice(half, None)}

    def pieces(self, rank: int, src: int) -> list[tuple]:
        parts = (_banded_pieces(self.layout, self.seqlen, self.world, self.window, rank, src) if self.banded else
                 _pieces(self.layout, self.causal, rank, src))
        return [(self.rows[q_part], self.rows[k_part], argument) for q_part, k_part, argument in parts]

    def prepare(self, q, k, v, argument) -> PreparedCall:
        """flash_attn_func's validated call of one piece; q, k, v the piece's rows."""
        if not self.banded:
            return prepare_flash_attn(q, k, v, dropout_p=0.0, softmax_scale=self.scale, causal=argument,
                                      window_size=(-1, -1), softcap=self.softcap, alibi_slopes=None,
                                      deterministic=False, return_attn_probs=False, return_lse=True)
        return _at_offset(q, k, v, self, self.alibi_slopes, argument)

    @staticmethod
    def ring_rows(t: Tensor) -> Tensor:
        """A piece's per-row result (out, lse, a gradient) as the kernels return it, in the ring's layout."""
        return t

    @staticmethod
    def kernel_layout(t: Tensor) -> Tensor:
        """One of the ring's per-row tensors (out, its gradient, lse) as the kernels take it."""
        return t


def _is_banded(window: tuple[int, int], causal: bool, alibi_slopes) -> bool:
    """Whether the pieces depend on global positions (a window other than causal's, or ALiBi)."""
    return alibi_slopes is not None or window != ((-1, 0) if causal else (-1, -1))


def _at_offset(q, k, v, plan, alibi_slopes, offset: int) -> PreparedCall:
    """flash_attn_func's call of dense q, k, v with the plan's window and ALiBi at the global diagonal offset
    `offset` (query row i and key column j are global positions q0 + i and k0 + j, offset = q0 - k0)."""
    call = prepare_flash_attn(q, k, v, dropout_p=0.0, softmax_scale=plan.scale, causal=False, window_size=plan.window,
                              softcap=plan.softcap, alibi_slopes=alibi_slopes, deterministic=False,
                              return_attn_probs=False, return_lse=True)
    return dataclasses.replace(call, problem=dataclasses.replace(call.problem, diagonal_offset=offset))


def _banded_pieces(layout: str, seqlen: int, world: int, window: tuple[int, int], rank: int,
                   src: int) -> list[tuple[str, str, int]]:
    """What the local queries attend of the shard of rank `src` under a window (or ALiBi): (query rows, key rows,
    diagonal offset) for each pair of chunks, one chunk per rank (contiguous) or two (zigzag: chunks r and
    2W - 1 - r of seqlen_local / 2 rows), whose global positions the band (left, right; -1 unbounded) connects."""
    if layout == "contiguous":
        size = seqlen
        pairs = [("all", "all", rank, src)]
    else:
        size = seqlen // 2
        own, visiting = (rank, 2 * world - 1 - rank), (src, 2 * world - 1 - src)
        pairs = [(q_part, k_part, own[a], visiting[b]) for a, q_part in enumerate(("first", "second"))
                 for b, k_part in enumerate(("first", "second"))]
    left, right = window
    pieces = []
    for q_part, k_part, q_chunk, k_chunk in pairs:
        offset = (q_chunk - k_chunk) * size
        # key j - query i over the pair spans -(size - 1) .. size - 1; the band keeps offset - left .. offset + right
        low = -(size - 1) if left < 0 else max(-(size - 1), offset - left)
        high = size - 1 if right < 0 else min(size - 1, offset + right)
        if low <= high:
            pieces.append((q_part, k_part, offset))
    return pieces


class _VarlenPlan:
    """Pieces of packed (total_local, heads, d) shards.

    Without a window or ALiBi a piece covers every sequence at once: one flash_attn_varlen_func call, the argument
    (the rows' names, causal); the halves of every sequence's shard are gathered by index (only zigzag's causal
    steps use them), with their own boundaries cu_seqlens // 2. With them (`banded`) the diagonal offset of a pair
    of chunks is a multiple of each sequence's own chunk length, so each sequence's pairs are attended apart, as
    dense calls on slices of its rows (the argument: the sequence, the offset)."""

    token_dim = 0

    def __init__(self, layout, causal, scale, softcap, bounds: list[int], max_seqlen: int, device, window=(-1, -1),
                 alibi_slopes=None, world=1):
        self.layout, self.causal, self.scale, self.softcap = layout, causal, scale, softcap
        self.window, self.alibi_slopes, self.world, self.bounds = window, alibi_slopes, world, bounds
        self.banded = _is_banded(window, causal, alibi_slopes)
        cu = torch.tensor(bounds, dtype=torch.int32, device=device)
        self.cu = {"all": cu, "first": cu // 2, "second": cu // 2}
        self.max = {"all": max_seqlen, "first": (max_seqlen + 1) // 2, "second": (max_seqlen + 1) // 2}
        self.rows = {"all": slice(None)}
        if layout == "zigzag" and causal and not self.banded:
            cu64 = cu.long()
            position = torch.arange(bounds[-1], device=device)
            sequence = torch.searchsorted(cu64[1:], position, right=True)
            in_first = (position - cu64[sequence]) < (cu64[sequence + 1] - cu64[sequence]) // 2
            self.rows["first"], self.rows["second"] = position[in_first], position[~in_first]

    def pieces(self, rank: int, src: int) -> list[tuple]:
        if not self.banded:
            return [(self.rows[q_part], self.rows[k_part], (q_part, k_part, causal))
                    for q_part, k_part, causal in _pieces(self.layout, self.causal, rank, src)]
        pieces = []
        for i, (start, end) in enumerate(zip(self.bounds[:-1], self.bounds[1:])):
            if end == start:
                continue   # an empty sequence has no rows
            half = (end - start) // 2
            rows = {"all": slice(start, end), "first": slice(start, start + half), "second": slice(start + half, end)}
            for q_part, k_part, offset in _banded_pieces(self.layout, end - start, self.world, self.window, rank, src):
                pieces.append((rows[q_part], rows[k_part], (i, offset)))
        return pieces

    def prepare(self, q, k, v, argument) -> PreparedCall:
        """The validated call of one piece; q, k, v the piece's rows, packed."""
        if self.banded:
            sequence, offset = argument
            slopes = self.alibi_slopes
            if slopes is not None and slopes.dim() == 2:   # (nseq, nheads): this sequence's row
                slopes = slopes[sequence:sequence + 1]
            return _at_offset(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), self, slopes, offset)
        q_part, k_part, causal = argument
        return prepare_flash_attn_varlen(q, k, v, self.cu[q_part], self.cu[k_part], self.max[q_part],
                                         self.max[k_part], dropout_p=0.0, softmax_scale=self.scale, causal=causal,
                                         window_size=(-1, -1), softcap=self.softcap, alibi_slopes=None,
                                         deterministic=False, return_attn_probs=False, return_lse=True)

    @staticmethod
    def ring_rows(t: Tensor) -> Tensor:
        """A piece's per-row result (out (1, total, ...), lse (1, nheads, total), a gradient) in the ring's layout,
        without the leading 1."""
        return t.squeeze(0)

    @staticmethod
    def kernel_layout(t: Tensor) -> Tensor:
        """One of the ring's per-row tensors (out, its gradient, lse) as the kernels take it: a leading 1."""
        return t.unsqueeze(0)


def _take(x: Tensor, dim: int, rows: slice | Tensor) -> Tensor:
    """x's rows along dim: a view for a slice, a gathered copy for an index tensor."""
    if isinstance(rows, slice):
        return x[(slice(None),) * (dim % x.dim()) + (rows,)]
    return x.index_select(dim, rows)


def _put(x: Tensor, dim: int, rows: slice | Tensor, value: Tensor, add: bool = False) -> None:
    """x's rows along dim <- value (or += value), in place."""
    if isinstance(rows, slice):
        view = _take(x, dim, rows)
        view.add_(value) if add else view.copy_(value)
    elif add:
        x.index_add_(dim % x.dim(), rows, value)
    else:
        x.index_copy_(dim % x.dim(), rows, value)


def _every_row(rows) -> bool:
    return isinstance(rows, slice) and rows == slice(None)


class _Rows:
    """A sum over query (or key) rows of per-piece results: the first result that covers every row is kept as it
    is (in its dtype: a ring of one rank, or one piece per step, returns the kernel's result untouched); a second
    one, or one of some rows only, starts a float32 sum."""

    def __init__(self, shape, device, token_dim: int):
        self.shape, self.device, self.token_dim, self.value = tuple(shape), device, token_dim, None

    def add(self, rows, value: Tensor) -> None:
        if self.value is None and _every_row(rows):
            self.value = value
            return
        if self.value is None:
            self.value = torch.zeros(self.shape, dtype=torch.float32, device=self.device)
        elif self.value.dtype != torch.float32:
            self.value = self.value.float()
        _put(self.value, self.token_dim, rows, value.float(), add=True)

    def float32(self) -> Tensor:
        """The sum in float32 (what travels around the ring: every rank's buffers have one dtype)."""
        if self.value is None:
            return torch.zeros(self.shape, dtype=torch.float32, device=self.device)
        return self.value.float()

    def result(self, dtype: torch.dtype) -> Tensor:
        return self.float32().to(dtype) if self.value is None else self.value.to(dtype)


class _Merged:
    """The ring's output and log-sum-exp, merged piece by piece by the log-sum-exp identity. The first piece that
    covers every query row is kept as the kernel returned it (out in q's dtype); later pieces merge in float32."""

    def __init__(self, out_shape, lse_shape, device, token_dim: int):
        self.out_shape, self.lse_shape, self.device, self.token_dim = out_shape, lse_shape, device, token_dim
        self.out = self.lse = None

    def add(self, rows, part_out: Tensor, part_lse: Tensor) -> None:
        if self.out is None and _every_row(rows):
            self.out, self.lse = part_out, part_lse
            return
        if self.out is None:
            self.out = torch.zeros(self.out_shape, dtype=torch.float32, device=self.device)
            self.lse = torch.full(self.lse_shape, float("-inf"), dtype=torch.float32, device=self.device)
        elif self.out.dtype != torch.float32:
            self.out = self.out.float()
        _merge(self.out, self.lse, rows, self.token_dim, part_out, part_lse)

    def result(self, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        if self.out is None:   # no piece at all (a rank whose queries see no key): out 0, lse -inf
            return (torch.zeros(self.out_shape, dtype=dtype, device=self.device),
                    torch.full(self.lse_shape, float("-inf"), dtype=torch.float32, device=self.device))
        return self.out.to(dtype), self.lse


def _merge(out: Tensor, lse: Tensor, rows, token_dim: int, part_out: Tensor, part_lse: Tensor) -> None:
    """out, lse (float32, in place) <- on the query rows `rows`, the log-sum-exp merge of themselves with a partial
    result. Rows where both are -inf (no key yet) stay out = 0, lse = -inf. lse's token dim is its last, after the
    heads (out's heads dim follows its token dim), so lse.transpose(-1, -2) lines up with out."""
    cur_out, cur_lse = _take(out, token_dim, rows), _take(lse, -1, rows)
    new_lse = torch.logaddexp(cur_lse, part_lse)
    empty = new_lse == float("-inf")
    safe = torch.where(empty, 0.0, new_lse)
    w_old = torch.exp(cur_lse - safe).masked_fill(empty, 0.0).transpose(-1, -2).unsqueeze(-1)
    w_new = torch.exp(part_lse - safe).masked_fill(empty, 0.0).transpose(-1, -2).unsqueeze(-1)
    _put(out, token_dim, rows, cur_out * w_old + part_out.float() * w_new)
    _put(lse, -1, rows, new_lse)


def _attend(plan, q, k, v, rank: int, src: int):
    """The pieces of the local queries against the visiting shard of rank `src`: (query rows, key rows, the
    validated call, its backend and tiles) each, the tensors the pieces' rows of q, k, v."""
    td = plan.token_dim
    for rows, keys, argument in plan.pieces(rank, src):
        call = plan.prepare(_take(q, td, rows), _take(k, td, keys), _take(v, td, keys), argument)
        yield rows, keys, call, *_dispatch.resolve(call.problem)


class _RingAttention(torch.autograd.Function):
    """The ring for dense and packed shards alike; `plan` says what each step attends and how."""

    @staticmethod
    def forward(ctx, q, k, v, ring, plan):
        ctx.set_materialize_grads(False)   # an unused lse (or out) gets no gradient tensor of zeros
        td = plan.token_dim
        # lse: (batch, nheads, seqlen) or (nheads, total): the heads before the tokens
        merged = _Merged((*q.shape[:-1], v.shape[-1]), (*q.shape[:td], q.shape[td + 1], q.shape[td]), q.device, td)
        k_cur, v_cur = k.detach(), v.detach()
        q_det = q.detach()
        for step in range(ring.world):
            pending = None
            if step < ring.world - 1:
                pending = ring.exchange([k_cur, v_cur], _KV_TAG)   # the next shard travels while this one is attended
            src = (ring.rank - step) % ring.world
            for rows, _, call, backend, tiles in _attend(plan, q_det, k_cur, v_cur, ring.rank, src):
                merged.add(rows, *map(plan.ring_rows, attention(call, backend, tiles)))
            if pending is not None:
                (k_cur, v_cur), requests = pending
                for request in requests:
                    request.wait()
        out, lse = merged.result(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.plan = ring, plan
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse = ctx.saved_tensors
        ring, plan = ctx.ring, ctx.plan
        td = plan.token_dim
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        grad_out = grad_out.to(out.dtype)
        dq = _Rows(q.shape, q.device, td)
        k_cur, v_cur = k.detach(), v.detach()
        own = None          # this rank's contribution to its own dK, dV
        incoming = None     # (buffers, requests): the accumulator of the next visiting shard, from the previous rank
        for step in range(ring.world):
            pending = ring.exchange([k_cur, v_cur], _KV_TAG) if step < ring.world - 1 else None
            src = (ring.rank - step) % ring.world
            dk, dv = _shard_gradients(q.detach(), k_cur, v_cur, out, lse, grad_out, grad_lse, dq, plan, ring.rank,
                                      src)
            if step == 0:
                own = (dk, dv)
            else:
                dk, dv = dk.float32(), dv.float32()
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
        if incoming is None:
            dk, dv = dk.result(k.dtype), dv.result(v.dtype)
        else:
            (dk_in, dv_in), requests = incoming
            for request in requests:
                request.wait()
            dk, dv = (dk.float32() + dk_in).to(k.dtype), (dv.float32() + dv_in).to(v.dtype)
        return dq.result(q.dtype), dk, dv, None, None


def _shard_gradients(q, k_vis, v_vis, out, lse, grad_out, grad_lse, dq: _Rows, plan, rank: int, src: int):
    """The gradients through the visiting shard of rank `src`: adds to dq, returns its dK and dV sums (_Rows).

    Each piece runs the backend's own backward on the piece's rows with the ring's final out and lse: the
    probabilities exp(S - lse) and delta = rowsum(dO * out) - dlse of the whole sequence are those a single call
    over it would use, so the piece's gradients are exactly its share of the whole call's (nothing recomputed
    under autograd, no reweighting)."""
    td = plan.token_dim
    dk, dv = _Rows(k_vis.shape, k_vis.device, td), _Rows(v_vis.shape, v_vis.device, td)
    for rows, keys, call, backend, tiles in _attend(plan, q, k_vis, v_vis, rank, src):
        kernels = _dispatch.BACKENDS[backend]

        def rows_of(t, dim=td):
            return plan.kernel_layout(_take(t, dim, rows))

        # the kernels read lse (and write delta like it) with the rows contiguous
        lse_rows = rows_of(lse, -1).contiguous()
        grad_lse_rows = None if grad_lse is None else rows_of(grad_lse, -1).float().contiguous()
        gq, gk, gv, _ = kernels.backward(unit_last_stride(rows_of(grad_out)), grad_lse_rows, call.q, call.k, call.v,
                                         rows_of(out), lse_rows, call.alibi_slopes, None, call.problem,
                                         kernels.tiles_from_list(tiles), call.cu_seqlens_q, call.cu_seqlens_k)
        dq.add(rows, plan.ring_rows(gq))
        dk.add(keys, plan.ring_rows(gk))
        dv.add(keys, plan.ring_rows(gv))
    return dk, dv
