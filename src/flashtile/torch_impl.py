"""The tiled FlashAttention algorithm in pure PyTorch: the "torch" backend.

Schedule (FA2 order): the outer loop walks blocks of query rows; for each, the inner loop streams
key/value blocks and keeps an online softmax per row — running max m, running sum l of
exp(s - m), and an unnormalised output o — rescaling l and o by the same factor exp(m_old - m_new)
whenever a block raises the max. Normalisation happens once, after the last key block. The
forward pass returns the output and the per-row log-sum-exp (lse = m + log l); the backward pass
recomputes each score tile from q, k and lse (P = exp(S - lse)) instead of storing P, with
delta = rowsum(dO * O) (minus the lse cotangent) supplying the softmax Jacobian's row term.

Everything is vectorised over batch and heads. Grouped-query attention is handled without
repeating K/V: the G = nheads // nheads_k query heads that share one K/V head are stacked as extra
rows of the query tile, so one matmul serves them all. Key blocks outside the causal/window band
are never touched; only blocks straddling a band edge pay for an element mask.

A learnable sink (one logit per query head, in every row's softmax denominator without a value) is the
online softmax's starting point: running max = the sink, running sum = 1 (exp(sink - sink)), so the lse includes
it and a row that sees no key ends with out = 0 and lse = the sink. The backward needs nothing new for dq, dk, dv;
the sink's gradient comes from delta and lse (flashtile._sink).

Memory is O(N * d): the largest seqlen-by-seqlen object is one (rows x block_k) tile. Arithmetic
is fp32 for fp16/bf16/fp32 inputs and fp64 for fp64 inputs. The working copies of K and V are
laid out (batch * nheads_k, seqlen_k, headdim) in the accumulation dtype.

Dropout (problem.dropout_p > 0, with the call's rng_state): each tile's keep-mask is generated from the Philox stream
by position (flashtile._dropout, the bits the Triton kernels use); the row sums take every probability, the
accumulator only the kept ones, and the finished rows are scaled by 1 / (1 - p). The backward regenerates the
masks: dV takes the kept probabilities, dP = dO V^T only on the kept entries (scaled), delta is unchanged.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch

from . import _dropout
from ._geometry import key_blocks, query_blocks
from ._sink import sink_gradient
from ._validate import AttentionProblem

NEG_INF = float("-inf")


@dataclass(frozen=True)
class TorchTiles:
    """Tile shape of the torch backend: block_q query positions (times the GQA group) by block_k keys."""

    block_q: int
    block_k: int

    def describe(self, problem: AttentionProblem) -> str:
        rows = self.block_q * problem.group_size
        return (f"block_q {self.block_q} x block_k {self.block_k} "
                f"({rows} score rows per tile = {problem.group_size} query heads per K/V head x {self.block_q})")


def default_tiles(problem: AttentionProblem) -> TorchTiles:
    """Tiles that give every tile about the same work whatever batch * heads is.

    Each torch call in the tile loop has a fixed cost of several microseconds, so a tile should
    carry enough work to hide it, yet its fp32 scores (batch*nheads_k x rows x block_k) should stay
    near the CPU's L2. Tuned on a 2-core x86 CPU (BENCHMARKS.md): ~512k scores per tile, 512 keys wide.
    """
    block_k = 512
    rows = (512 * 1024) // (block_k * max(1, problem.batch * problem.nheads_k))
    rows = min(1024, max(64, rows))
    block_q = max(16, rows // problem.group_size)
    return TorchTiles(block_q=min(block_q, max(16, problem.seqlen_q)), block_k=block_k)


@dataclass
class _Operands:
    """Per-call working state shared by the forward and backward tile loops."""

    problem: AttentionProblem
    acc: torch.dtype
    q: torch.Tensor  # (batch, nheads_k, group, seqlen_q, headdim) view of the caller's q
    k: torch.Tensor  # (batch * nheads_k, seqlen_k, headdim), acc dtype, contiguous
    k_t: torch.Tensor  # (batch * nheads_k, headdim, seqlen_k): K transposed, so score matmuls read unit-stride rows
    v: torch.Tensor  # (batch * nheads_k, seqlen_k, headdim_v), acc dtype, contiguous
    slopes: torch.Tensor | None  # (batch * nheads_k, group, 1, 1), acc dtype
    mask: torch.Tensor | None  # (batch, nheads, seqlen_q, seqlen_k), possibly stride-0 broadcast

    @property
    def batch_heads(self) -> int:
        return self.problem.batch * self.problem.nheads_k


def _prepare(q, k, v, alibi_slopes, attn_mask, problem: AttentionProblem) -> _Operands:
    """Working state from q, k, v in the flash layout (batch, seqlen, heads, dim)."""
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    acc = problem.accumulation_dtype
    b, hk, g = problem.batch, problem.nheads_k, problem.group_size

    def working(t: torch.Tensor) -> torch.Tensor:
        return t.to(acc).reshape(b * hk, t.shape[2], t.shape[3]).contiguous()

    k_work = working(k)

    slopes = None
    if alibi_slopes is not None:
        slopes = alibi_slopes.to(acc).expand(b, problem.nheads).reshape(b * hk, g, 1, 1)
    q5 = q.view(b, hk, g, problem.seqlen_q, problem.headdim)
    return _Operands(problem, acc, q5, k_work, k_work.transpose(1, 2).contiguous(), working(v), slopes, attn_mask)


def _query_block(ops: _Operands, i0: int, i1: int, extra_column: torch.Tensor | None = None) -> torch.Tensor:
    """Rows (group, position) of query block [i0, i1), pre-multiplied by the softmax scale.

    With extra_column (batch*nheads_k, rows, 1), it is appended as column headdim, so that a
    product with a key matrix carrying a row of ones subtracts a per-row constant for free.
    """
    p = ops.problem
    n, width = i1 - i0, p.headdim + (extra_column is not None)
    block = torch.empty(p.batch, p.nheads_k, p.group_size, n, width, dtype=ops.acc, device=p.device)
    block[..., :p.headdim] = ops.q[:, :, :, i0:i1]
    block[..., :p.headdim].mul_(p.softmax_scale)
    block = block.view(ops.batch_heads, p.group_size * n, width)
    if extra_column is not None:
        block[..., p.headdim:] = extra_column
    return block


def _append_ones_row(t: torch.Tensor) -> torch.Tensor:
    """(BH, X, S) -> (BH, X + 1, S) with a last row of ones (pairs with `_query_block`'s extra column)."""
    return torch.cat([t, torch.ones_like(t[:, :1])], dim=1)


def _rows_to_block(ops: _Operands, rows: torch.Tensor, i0: int, i1: int) -> torch.Tensor:
    """(batch*nheads_k, group*n, X) -> (batch, n, nheads, X): the flash-attn layout of a block."""
    p = ops.problem
    x = rows.view(p.batch, p.nheads_k, p.group_size, i1 - i0, rows.shape[-1])
    return x.permute(0, 3, 1, 2, 4).reshape(p.batch, i1 - i0, p.nheads, x.shape[-1])


def _score_tile(ops: _Operands, q_block: torch.Tensor, k_t_tile: torch.Tensor, i0: int, i1: int, j0: int, j1: int,
                needs_band_mask: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Final scores of rows [i0, i1) against keys [j0, j1): (batch*nheads_k, group*n, m).

    k_t_tile is keys [j0, j1) of K transposed, (batch*nheads_k, headdim, m), or with
    `_append_ones_row` when q_block carries an extra column (which then shifts each row's scores).
    Also returns tanh(raw / softcap) when softcap is on (the backward pass needs its derivative).
    Masked entries are -inf.
    """
    p = ops.problem
    n, m = i1 - i0, j1 - j0
    scores = torch.bmm(q_block, k_t_tile)
    tanh = None
    if p.softcap > 0:
        tanh = scores.div_(p.softcap).tanh_()
        scores = tanh * p.softcap
    if ops.slopes is None and ops.mask is None and not needs_band_mask:
        return scores, tanh
    grouped = scores.view(ops.batch_heads, p.group_size, n, m)
    rows = torch.arange(i0, i1, device=p.device).unsqueeze(1) + p.diagonal_offset  # aligned key index
    cols = torch.arange(j0, j1, device=p.device).unsqueeze(0)
    if ops.slopes is not None:
        distance = (rows - cols).abs().to(ops.acc)
        grouped.addcmul_(ops.slopes, distance, value=-1.0)
    if needs_band_mask:
        allowed = torch.ones(n, m, dtype=torch.bool, device=p.device)
        if p.window_left >= 0:
            allowed &= cols >= rows - p.window_left
        if p.window_right >= 0:
            allowed &= cols <= rows + p.window_right
        grouped.masked_fill_(~allowed, NEG_INF)
    if ops.mask is not None:
        tile = ops.mask[:, :, i0:i1, j0:j1].reshape(ops.batch_heads, p.group_size, n, m)
        if tile.dtype == torch.bool:
            grouped.masked_fill_(~tile, NEG_INF)
        else:
            grouped.add_(tile.to(ops.acc))
    return scores, tanh


def _initial_row_stats(ops: _Operands, learnable_sink: torch.Tensor | None,
                       n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(running max, running sum) the online softmax of a block of n query positions starts from, each
    (batch*nheads_k, group*n): (-inf, 0) without a sink; with one, (the sink of each row's head, 1), the sink's own
    term exp(sink - max) of the denominator."""
    p = ops.problem
    shape = (ops.batch_heads, p.group_size * n)
    if learnable_sink is None:
        return (torch.full(shape, NEG_INF, dtype=ops.acc, device=p.device),
                torch.zeros(shape, dtype=ops.acc, device=p.device))
    # rows are (group member g, position i) -> g * n + i within each (batch, K/V head): query head hk * group + g
    heads = learnable_sink.detach().to(ops.acc).view(1, p.nheads_k, p.group_size, 1)
    row_max = heads.expand(p.batch, p.nheads_k, p.group_size, n).reshape(shape)
    return row_max, torch.ones(shape, dtype=ops.acc, device=p.device)


def _keep_tile(ops: _Operands, rng_state: torch.Tensor, first_batch: int, i0: int, i1: int, j0: int,
               j1: int) -> torch.Tensor:
    """The dropout keep-mask of rows [i0, i1) against keys [j0, j1) in the tile layout (batch*nheads_k, group*n, m)
    (bool), batch entries counted from first_batch (a packed sequence's index)."""
    p = ops.problem
    heads = torch.arange(first_batch * p.nheads, (first_batch + p.batch) * p.nheads, dtype=torch.int64)
    keep = _dropout.keep_mask(rng_state, p.dropout_p, heads, i0, i1, j0, j1, p.device)
    return keep.view(ops.batch_heads, p.group_size * (i1 - i0), j1 - j0)  # (b, h) = (b, hk, g) in order


def _in_the_inputs_dtype(function):
    """Run a backend entry point with autocast off on its tensors' device: the inputs' dtype sets the precision, as
    in the Triton kernels (under autocast the tiles' matmuls would otherwise run in autocast's dtype against
    float32 statistics and fail on mixed dtypes)."""
    @functools.wraps(function)
    def run(first, *args, **kwargs):
        with torch.autocast(first.device.type, enabled=False):
            return function(first, *args, **kwargs)
    return run


@_in_the_inputs_dtype
def attention_forward(q, k, v, alibi_slopes, attn_mask, problem: AttentionProblem, tiles: TorchTiles,
                      learnable_sink: torch.Tensor | None = None, rng_state=None,
                      first_batch: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Tiled forward pass.

    q (batch, seqlen_q, nheads, headdim), k (batch, seqlen_k, nheads_k, headdim),
    v (batch, seqlen_k, nheads_k, headdim_v), any strides; alibi_slopes (batch or 1, nheads) or None;
    attn_mask broadcast to (batch, nheads, seqlen_q, seqlen_k) or None; learnable_sink (nheads,) or None.
    rng_state: the call's dropout (seed, offset) when problem.dropout_p > 0; first_batch: the batch index of entry 0
    in the dropout stream.
    Returns out (batch, seqlen_q, nheads, headdim_v), contiguous, in q's dtype, and lse
    (batch, nheads, seqlen_q), contiguous, in the accumulation dtype: for rows that see no key, out = 0 and
    lse = -inf (with a sink: lse = the sink).
    """
    p = problem
    ops = _prepare(q, k, v, alibi_slopes, attn_mask, p)
    dropout = p.dropout_p > 0
    out = torch.empty(p.batch, p.seqlen_q, p.nheads, p.headdim_v, dtype=p.dtype, device=p.device)
    lse = torch.empty(p.batch, p.seqlen_q, p.nheads, dtype=ops.acc, device=p.device)
    for i0 in range(0, p.seqlen_q, tiles.block_q):
        i1 = min(i0 + tiles.block_q, p.seqlen_q)
        rows = p.group_size * (i1 - i0)
        q_block = _query_block(ops, i0, i1)
        row_max, row_sum = _initial_row_stats(ops, learnable_sink, i1 - i0)
        acc = torch.zeros(ops.batch_heads, rows, p.headdim_v, dtype=ops.acc, device=p.device)
        for j0, j1, needs_mask in key_blocks(p, i0, i1, tiles.block_k):
            scores, _ = _score_tile(ops, q_block, ops.k_t[:, :, j0:j1], i0, i1, j0, j1, needs_mask)
            new_max = torch.maximum(row_max, scores.amax(dim=-1))
            # a row that has seen only masked keys keeps max -inf; shift it by 0 so exp gives 0, not NaN
            shift = new_max.masked_fill(new_max == NEG_INF, 0.0)
            probs = scores.sub_(shift.unsqueeze(-1)).exp_()
            # rescale what was accumulated against the old max (factor 0 on the first visible block)
            correction = (row_max - shift).exp_()
            row_sum.mul_(correction).add_(probs.sum(dim=-1))
            if dropout:  # the row sum takes every probability, the output only the kept ones
                probs.masked_fill_(~_keep_tile(ops, rng_state, first_batch, i0, i1, j0, j1), 0.0)
            acc.mul_(correction.unsqueeze(-1)).baddbmm_(probs, ops.v[:, j0:j1])
            row_max = new_max
        seen = row_sum > 0
        acc.div_(torch.where(seen, row_sum, 1.0).unsqueeze(-1))
        if dropout:
            acc.mul_(_dropout.keep_scale(p.dropout_p))
        out[:, i0:i1] = _rows_to_block(ops, acc, i0, i1)
        block_lse = torch.where(seen, row_max + torch.log(row_sum), NEG_INF)
        lse[:, i0:i1] = _rows_to_block(ops, block_lse.unsqueeze(-1), i0, i1).squeeze(-1)
    return out, lse.transpose(1, 2).contiguous()


@_in_the_inputs_dtype
def attention_backward(grad_out, grad_lse, q, k, v, out, lse, alibi_slopes, attn_mask,
                       problem: AttentionProblem, tiles: TorchTiles, learnable_sink: torch.Tensor | None = None,
                       rng_state=None, first_batch: int = 0):
    """Recompute-based backward pass: returns (dq, dk, dv), contiguous, shaped like q, k, v, in their dtype, and
    the sink's gradient (shaped like learnable_sink; None without a sink).

    Layouts as in attention_forward; grad_out is shaped like out, grad_lse like lse or None (zero);
    either may have any strides, stride 0 included. rng_state, first_batch: the forward's.
    Schedule (FA2 backward): the outer loop walks key blocks, accumulating dK and dV for the block
    locally; the inner loop visits the query blocks that can see it, recomputing P = exp(S - lse)
    and dS = P * (dP - delta) with delta = rowsum(dO * O) - dlse (since d lse / d s = P), and
    accumulating dQ per query block. With dropout, dP = dO V^T * Z / (1 - p) and dV = (P * Z / (1 - p))^T dO for
    the regenerated keep-mask Z; delta is unchanged (sum_j P_ij dP_ij = rowsum(dO * O)_i still).
    """
    p = problem
    dropout = p.dropout_p > 0
    ops = _prepare(q, k, v, alibi_slopes, attn_mask, p)
    b, hk, g = p.batch, p.nheads_k, p.group_size
    grad_out, out = grad_out.transpose(1, 2), out.transpose(1, 2)
    # Rows that saw no key have lse = -inf; every score of theirs is masked to -inf, so any finite
    # stand-in gives exp(-inf) = 0 there (never inf - inf = NaN).
    lse_finite = lse.masked_fill(lse == NEG_INF, 0.0).to(ops.acc)
    delta = (grad_out.to(ops.acc) * out.to(ops.acc)).sum(dim=-1)
    if grad_lse is not None:
        delta -= grad_lse.to(ops.acc)
    dsink = None if learnable_sink is None else sink_gradient(learnable_sink, lse, delta)
    grad_out5 = grad_out.view(b, hk, g, p.seqlen_q, p.headdim_v)
    # The per-row constants (-lse for S, -delta for dP) ride along the matmuls as an extra column
    # of Q / dO against a row of ones in K^T / V^T, saving one pass over every tile. Softcap
    # applies tanh before the lse shift, so there the shift stays a separate step.
    fold_lse = p.softcap == 0
    k_t = _append_ones_row(ops.k_t) if fold_lse else ops.k_t
    v_t = _append_ones_row(ops.v.transpose(1, 2))

    def block_rows(t: torch.Tensor, i0: int, i1: int) -> torch.Tensor:
        """(batch, nheads, seqlen_q) statistics of block [i0, i1) as (batch*nheads_k, rows, 1)."""
        return t.view(b, hk, g, p.seqlen_q)[..., i0:i1].reshape(ops.batch_heads, g * (i1 - i0), 1)

    # per query block, built once: Q (scaled) and dO, each plain and with its extra column
    q_blocks, q_aug_blocks, do_blocks, do_aug_blocks, neg_lse_blocks, dq_blocks = [], [], [], [], [], []
    for i0 in range(0, p.seqlen_q, tiles.block_q):
        i1 = min(i0 + tiles.block_q, p.seqlen_q)
        neg_lse = -block_rows(lse_finite, i0, i1)
        q_aug_blocks.append(_query_block(ops, i0, i1, extra_column=neg_lse if fold_lse else None))
        q_blocks.append(q_aug_blocks[-1][..., :p.headdim].contiguous())
        do_aug = torch.empty(ops.batch_heads, g * (i1 - i0), p.headdim_v + 1, dtype=ops.acc, device=p.device)
        do_aug.view(b, hk, g, i1 - i0, p.headdim_v + 1)[..., :p.headdim_v] = grad_out5[:, :, :, i0:i1]
        do_aug[..., p.headdim_v:] = -block_rows(delta, i0, i1)
        do_aug_blocks.append(do_aug)
        do_blocks.append(do_aug[..., :p.headdim_v].contiguous())
        neg_lse_blocks.append(neg_lse)
        dq_blocks.append(torch.zeros(ops.batch_heads, g * (i1 - i0), p.headdim, dtype=ops.acc, device=p.device))

    dk = torch.empty(b, p.seqlen_k, hk, p.headdim, dtype=p.dtype, device=p.device)
    dv = torch.empty(b, p.seqlen_k, hk, p.headdim_v, dtype=p.dtype, device=p.device)
    for j0 in range(0, p.seqlen_k, tiles.block_k):
        j1 = min(j0 + tiles.block_k, p.seqlen_k)
        dk_block = torch.zeros(ops.batch_heads, j1 - j0, p.headdim, dtype=ops.acc, device=p.device)
        dv_block = torch.zeros(ops.batch_heads, j1 - j0, p.headdim_v, dtype=ops.acc, device=p.device)
        # contiguous copies of this key block, reused by every query block (faster matmuls than slices)
        k_t_block, v_t_block = k_t[:, :, j0:j1].contiguous(), v_t[:, :, j0:j1].contiguous()
        k_block = ops.k[:, j0:j1].contiguous()
        for index, i0, i1, k0, k1, needs_mask in query_blocks(p, j0, j1, tiles.block_q):
            trim = slice(k0 - j0, k1 - j0)
            scores, tanh = _score_tile(ops, q_aug_blocks[index], k_t_block[:, :, trim], i0, i1, k0, k1, needs_mask)
            if not fold_lse:
                scores.add_(neg_lse_blocks[index])
            probs = scores.exp_()
            if dropout:
                # dP on the kept entries (scaled), then P * (dP - delta); dV below takes the kept probabilities
                kept = _keep_tile(ops, rng_state, first_batch, i0, i1, k0, k1).to(ops.acc)
                kept.mul_(_dropout.keep_scale(p.dropout_p))
                grad_scores = torch.bmm(do_blocks[index], v_t_block[:, :p.headdim_v, trim]).mul_(kept)
                grad_scores.add_(do_aug_blocks[index][..., p.headdim_v:]).mul_(probs)
                probs = probs.mul_(kept)
            else:
                grad_scores = torch.bmm(do_aug_blocks[index], v_t_block[:, :, trim]).mul_(probs)  # P * (dP - delta)
            if tanh is not None:  # d(c * tanh(x / c)) / dx = 1 - tanh^2
                grad_scores.mul_(1.0 - tanh * tanh)
            dq_blocks[index].baddbmm_(grad_scores, k_block[:, trim])
            # the Q rows already carry the softmax scale, so dK needs no further factor
            if (k0, k1) == (j0, j1):
                dv_block.baddbmm_(probs.transpose(1, 2), do_blocks[index])
                dk_block.baddbmm_(grad_scores.transpose(1, 2), q_blocks[index])
            else:  # a tile trimmed to the band: a strided slice as baddbmm_'s output is slow, so add
                dv_block[:, trim].add_(torch.bmm(probs.transpose(1, 2), do_blocks[index]))
                dk_block[:, trim].add_(torch.bmm(grad_scores.transpose(1, 2), q_blocks[index]))
        dk[:, j0:j1] = dk_block.view(b, hk, j1 - j0, p.headdim).transpose(1, 2)
        dv[:, j0:j1] = dv_block.view(b, hk, j1 - j0, p.headdim_v).transpose(1, 2)

    dq = torch.empty(b, p.seqlen_q, p.nheads, p.headdim, dtype=p.dtype, device=p.device)
    for index, i0 in enumerate(range(0, p.seqlen_q, tiles.block_q)):
        i1 = min(i0 + tiles.block_q, p.seqlen_q)
        dq[:, i0:i1] = _rows_to_block(ops, dq_blocks[index].mul_(p.softmax_scale), i0, i1)
    return dq, dk, dv, dsink


def _sequences(problem: AttentionProblem, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor):
    """Per packed sequence: (index, query rows, key rows, its dense AttentionProblem, bottom-right aligned)."""
    starts_q, starts_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()  # the host path reads the offsets once
    for index in range(problem.batch):
        rows_q = slice(starts_q[index], starts_q[index + 1])
        rows_k = slice(starts_k[index], starts_k[index + 1])
        length_q, length_k = rows_q.stop - rows_q.start, rows_k.stop - rows_k.start
        yield index, rows_q, rows_k, replace(problem, batch=1, seqlen_q=length_q, seqlen_k=length_k,
                                             diagonal_offset=length_k - length_q, varlen=False)


def sequence_slopes(alibi_slopes: torch.Tensor | None, index: int) -> torch.Tensor | None:
    """The ALiBi slopes of batch entry `index` as (1, nheads) (shared (1, nheads) slopes pass through)."""
    if alibi_slopes is None or alibi_slopes.shape[0] == 1:
        return alibi_slopes
    return alibi_slopes[index:index + 1]


@_in_the_inputs_dtype
def varlen_attention_forward(q, k, v, alibi_slopes, problem: AttentionProblem, tiles: TorchTiles,
                             cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                             learnable_sink: torch.Tensor | None = None, rng_state=None):
    """Packed sequences, one dense tiled forward per sequence (work follows the real lengths).

    q (1, total_q, nheads, headdim), k / v (1, total_k, nheads_k, headdim[_v]); problem.batch is the
    number of sequences. Returns out (1, total_q, nheads, headdim_v) and lse (1, nheads, total_q).
    """
    out = torch.zeros(1, q.shape[1], problem.nheads, problem.headdim_v, dtype=problem.dtype, device=problem.device)
    lse = torch.full((1, problem.nheads, q.shape[1]), NEG_INF, dtype=problem.accumulation_dtype,
                     device=problem.device)
    for index, rows_q, rows_k, sequence in _sequences(problem, cu_seqlens_q, cu_seqlens_k):
        if sequence.seqlen_q == 0:
            continue
        out[:, rows_q], lse[:, :, rows_q] = attention_forward(
            q[:, rows_q], k[:, rows_k], v[:, rows_k], sequence_slopes(alibi_slopes, index), None, sequence, tiles,
            learnable_sink, rng_state, index)
    return out, lse


@_in_the_inputs_dtype
def varlen_attention_backward(grad_out, grad_lse, q, k, v, out, lse, alibi_slopes, problem: AttentionProblem,
                              tiles: TorchTiles, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                              learnable_sink: torch.Tensor | None = None, rng_state=None):
    """Backward of varlen_attention_forward: (dq, dk, dv) in the packed layout, keys no query sees getting 0, and the
    sink's gradient summed over the sequences (None without a sink)."""
    dq = torch.zeros(q.shape, dtype=problem.dtype, device=problem.device)
    dk = torch.zeros(k.shape, dtype=problem.dtype, device=problem.device)
    dv = torch.zeros(v.shape, dtype=problem.dtype, device=problem.device)
    dsink = None if learnable_sink is None else torch.zeros_like(learnable_sink, dtype=problem.accumulation_dtype)
    for index, rows_q, rows_k, sequence in _sequences(problem, cu_seqlens_q, cu_seqlens_k):
        if sequence.seqlen_q == 0:
            continue
        dq[:, rows_q], dk[:, rows_k], dv[:, rows_k], sequence_dsink = attention_backward(
            grad_out[:, rows_q], None if grad_lse is None else grad_lse[:, :, rows_q], q[:, rows_q], k[:, rows_k],
            v[:, rows_k], out[:, rows_q], lse[:, :, rows_q], sequence_slopes(alibi_slopes, index), None, sequence,
            tiles, None if learnable_sink is None else learnable_sink.to(problem.accumulation_dtype), rng_state, index)
        if dsink is not None:
            dsink += sequence_dsink
    return dq, dk, dv, None if dsink is None else dsink.to(learnable_sink.dtype)


def _dense_probabilities(q, k, v, alibi_slopes, attn_mask, problem: AttentionProblem, rng_state,
                         first_batch: int = 0, learnable_sink: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(S) of every (batch, head, query, key), (batch, nheads, seqlen_q, seqlen_k) in the accumulation dtype,
    the entries the dropout keep-mask drops negated (see attention_probabilities); with a learnable sink its term is
    in every row's denominator (the rows then sum to less than 1)."""
    p = problem
    ops = _prepare(q, k, v, alibi_slopes, attn_mask, p)
    scores, _ = _score_tile(ops, _query_block(ops, 0, p.seqlen_q), ops.k_t, 0, p.seqlen_q, 0, p.seqlen_k, True)
    # the sink's term (running max the sink, sum 1) or none (-inf, 0), as the forward starts every row
    start_max, start_sum = _initial_row_stats(ops, learnable_sink, p.seqlen_q)
    row_max = torch.maximum(start_max, scores.amax(dim=-1)) if p.seqlen_k else start_max
    # a row that sees no key (and no sink) keeps max -inf: shift it by 0 so that exp gives 0, not NaN
    shift = row_max.masked_fill(row_max == NEG_INF, 0.0)
    probs = scores.sub_(shift.unsqueeze(-1)).exp_()
    total = probs.sum(dim=-1) + start_sum * (start_max - shift).exp()
    probs.div_(total.masked_fill_(total == 0, 1.0).unsqueeze(-1))
    keep = _keep_tile(ops, rng_state, first_batch, 0, p.seqlen_q, 0, p.seqlen_k)
    probs = torch.where(keep, probs, -probs)
    return probs.view(p.batch, p.nheads, p.seqlen_q, p.seqlen_k)


def attention_probabilities(call, rng_state: torch.Tensor) -> torch.Tensor:
    """The attention probabilities of a call with dropout, as flash-attn's return_attn_probs gives them (for testing:
    this materialises seqlen_q x seqlen_k per head). P = softmax(S), computed densely in the accumulation dtype from
    the call's q, k and masks, before dropout's 1 / (1 - p) scaling, with the entries the call dropped negated:
    torch.signbit(result) is the drop mask exactly (a dropped 0, past a causal edge say, is -0.0), and result.abs()
    is P. In q's dtype, without gradient.

    call: the PreparedCall; rng_state: its dropout (seed, offset). Returns (batch, nheads, seqlen_q, seqlen_k); for
    packed sequences (nseq, nheads, max_seqlen_q, max_seqlen_k), each sequence's block at the top left, zeros
    elsewhere (each max at least the longest sequence).
    """
    p = call.problem
    with torch.no_grad():
        if not p.varlen:
            probs = _dense_probabilities(call.q, call.k, call.v, call.alibi_slopes, call.attn_mask, p, rng_state,
                                         learnable_sink=call.learnable_sink)
            return probs.to(p.dtype)
        sequences = list(_sequences(p, call.cu_seqlens_q, call.cu_seqlens_k))
        longest_q = max([p.seqlen_q] + [s.seqlen_q for *_, s in sequences])
        longest_k = max([p.seqlen_k] + [s.seqlen_k for *_, s in sequences])
        result = torch.zeros(p.batch, p.nheads, longest_q, longest_k, dtype=p.dtype, device=p.device)
        for index, rows_q, rows_k, sequence in sequences:
            probs = _dense_probabilities(call.q[:, rows_q], call.k[:, rows_k], call.v[:, rows_k],
                                         sequence_slopes(call.alibi_slopes, index), None, sequence, rng_state, index,
                                         call.learnable_sink)
            result[index, :, :sequence.seqlen_q, :sequence.seqlen_k] = probs[0]
        return result
