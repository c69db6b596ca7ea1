"""Fused attention forward pass in Triton (FA1 schedule: the FlashAttention paper's Algorithm 1).

One program per (batch entry, query head). Key/value blocks are the outer loop and query blocks the inner one:
the program loads K_j and V_j once, then for every query block i that sees them it loads Q_i and the block's
running state from float32 workspace in global memory (the output O_i, normalised, the row max m_i in base 2
and the row sum l_i), folds in the tile (S = Q_i K_jᵀ, m̃ = rowmax(S), P̃ = exp2(S - m̃), l̃ = rowsum(P̃),
m_new = max(m_i, m̃), l_new = 2^(m_i - m_new) l_i + 2^(m̃ - m_new) l̃) and writes back
O_i = (l_i 2^(m_i - m_new) O_i + 2^(m̃ - m_new) P̃ V_j) / l_new, m_new and l_new. A last pass over the query
blocks writes out = O in the output dtype and the natural log-sum-exp lse = (m + log2 l) * ln 2, with out = 0
and lse = -inf for rows that saw no key.

How it differs from fwd.py's FA2 schedule, which computes the same function:
- loop order: FA2 gives each program one query block and streams the key blocks past it, so the online softmax
  stays in registers and is normalised once; here every (key block, query block) pair round-trips O, m and l
  through global memory and normalises O at every step. That read-modify-write of the output is the HBM traffic
  FA2 removed: O is read and written once per visible key block instead of written once.
- parallelism: FA1 spreads only batch * nheads programs over the GPU, so at small batch x heads it leaves most
  SMs idle, where FA2 also splits the query blocks across programs.
- one program reads back rows that other threads of the same program stored, so every outer step ends with a
  CTA barrier (tl.debug_barrier) before the next one loads the state.

The band is bottom-right aligned as in the rest of flashtile: query row i sees key j iff
(window_left < 0 or j >= i + seqlen_k - seqlen_q - window_left) and
(window_right < 0 or j <= i + seqlen_k - seqlen_q + window_right); causal is window_right = 0. Key blocks no
query sees are never loaded; for each key block, query blocks wholly outside the band are skipped, those wholly
inside run without the element mask, and only those that straddle a band edge or a ragged end pay for it
(common.query_block_bounds).

Serves: fp16 / bf16 / fp32 inputs (fp32 accumulation; fp32 dots in IEEE fp32), head dims d and dv up to 256
(dv != d allowed; each padded to a power of two >= 16 in the kernel and masked), GQA / MQA by index arithmetic
(query head h reads K/V head h // (nheads // nheads_k)), seqlen_q != seqlen_k, causal, sliding windows,
softmax_scale, any strides with a unit-stride head dim (others are copied), a learnable sink (the launcher starts
each row's state in the workspace from it: m = the sink in base 2, l = 1, O = 0, so the kernel needs nothing of its
own). Not served: softcap, ALiBi, masks, dropout, packed variable-length batches. The backward needs nothing of
its own: out and lse are those of the FA2 schedule, so the shared recompute backward (bwd.py) differentiates them.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from .._validate import AttentionProblem, prepare_flash_attn
from .common import LOG2E, band_mask, load_tile, program_heads, query_block_bounds
from .configs import padded_width

__all__ = ["attention_fwd_fa1_kernel", "default_fa1_blocks", "forward_fa1", "launch_fa1"]


@triton.jit
def _store_tile(ptrs, tile, in_sequence, in_width, CHECK_SEQUENCE: tl.constexpr, CHECK_WIDTH: tl.constexpr):
    """Store a 2-D tile, masked only along the axes that may leave the tensor (load_tile's mirror)."""
    if CHECK_SEQUENCE and CHECK_WIDTH:
        tl.store(ptrs, tile, mask=in_sequence & in_width)
    elif CHECK_SEQUENCE:
        tl.store(ptrs, tile, mask=in_sequence)
    elif CHECK_WIDTH:
        tl.store(ptrs, tile, mask=in_width)
    else:
        tl.store(ptrs, tile)


@triton.jit
def _load_rows(ptrs, in_sequence, other, CHECK_SEQUENCE: tl.constexpr):
    """Load one value per query row (m or l), masked only where rows may lie past the queries' end."""
    if CHECK_SEQUENCE:
        rows = tl.load(ptrs, mask=in_sequence, other=other)
    else:
        rows = tl.load(ptrs)
    return rows


@triton.jit
def _update_query_block(m0, n0, k_t, v, q_base, o_base, m_base, l_base, stride_qm, stride_wm,
                        seqlen_q, seqlen_k, score_scale, diagonal_offset, window_left, window_right,
                        HEADDIM: tl.constexpr, HEADDIM_V: tl.constexpr, BLOCK_D: tl.constexpr,
                        BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
                        HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Fold key block [n0, n0 + BLOCK_N) (k_t: (BLOCK_D, BLOCK_N), v: (BLOCK_N, BLOCK_DV)) into the state of query
    rows [m0, m0 + BLOCK_M): load Q_i, O_i, m_i, l_i, update them and store O_i, m_i, l_i back.

    MASKED applies the band and sequence-end masks; without it every row is a query and every key in the band, so
    loads and stores go unmasked along the sequence and every row's block max is finite.
    """
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = offs_m < seqlen_q
    rows = offs_m.to(tl.int64)
    q = load_tile(q_base + rows[:, None] * stride_qm + offs_d[None, :], row_ok[:, None],
                  offs_d[None, :] < HEADDIM, MASKED, BLOCK_D != HEADDIM)
    o_ptrs = o_base + rows[:, None] * stride_wm + offs_dv[None, :]
    o_i = load_tile(o_ptrs, row_ok[:, None], offs_dv[None, :] < HEADDIM_V, MASKED, BLOCK_DV != HEADDIM_V)
    m_i = _load_rows(m_base + rows, row_ok, float("-inf"), MASKED)
    l_i = _load_rows(l_base + rows, row_ok, 0.0, MASKED)

    s = tl.dot(q, k_t, input_precision=DOT_PRECISION) * score_scale  # base-2 scores
    if MASKED:
        s = band_mask(s, offs_m[:, None], offs_n[None, :], seqlen_q, seqlen_k, diagonal_offset, window_left,
                      window_right, HAS_LEFT, HAS_RIGHT)
    m_block = tl.max(s, 1)
    m_new = tl.maximum(m_i, m_block)
    if MASKED:
        # a row with no visible key in this block (m_block -inf), or in any block so far (m_new -inf too): shift
        # by 0 so that exp2 gives 0, not NaN, and its state stays as it was
        m_block_shift = tl.where(m_block == float("-inf"), 0.0, m_block)
        m_new_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_block_shift = m_block
        m_new_shift = m_new
    p = tl.exp2(s - m_block_shift[:, None])
    l_block = tl.sum(p, 1)
    alpha = tl.exp2(m_i - m_new_shift)  # 0 on a row's first visible block (m_i = -inf)
    beta = tl.exp2(m_block - m_new_shift)  # 0 where the block has no visible key
    l_new = alpha * l_i + beta * l_block
    if MASKED:
        l_div = tl.where(l_new > 0, l_new, 1.0)  # rows that have seen no key keep O = 0
    else:
        l_div = l_new
    pv = tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    o_new = ((alpha * l_i)[:, None] * o_i + beta[:, None] * pv) / l_div[:, None]

    _store_tile(o_ptrs, o_new, row_ok[:, None], offs_dv[None, :] < HEADDIM_V, MASKED, BLOCK_DV != HEADDIM_V)
    if MASKED:
        tl.store(m_base + rows, m_new, mask=row_ok)
        tl.store(l_base + rows, l_new, mask=row_ok)
    else:
        tl.store(m_base + rows, m_new)
        tl.store(l_base + rows, l_new)


@triton.jit
def attention_fwd_fa1_kernel(
    Q, K, V, Out, Lse, OAcc, RowMax, RowSum,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_ob, stride_om, stride_oh,
    stride_lse_b, stride_lse_h,
    stride_wb, stride_wh, stride_wm,
    stride_rb, stride_rh,
    nheads, group_size, seqlen_q, seqlen_k, score_scale, diagonal_offset, window_left, window_right,
    HEADDIM: tl.constexpr, HEADDIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One (batch entry, query head) per program over a grid of batch * nheads.

    Q (batch, seqlen_q, nheads, HEADDIM), K (batch, seqlen_k, nheads_k, HEADDIM), V (batch, seqlen_k, nheads_k,
    HEADDIM_V), Out like Q with HEADDIM_V, Lse (batch, nheads, seqlen_q) float32, all with a unit-stride last dim.
    Workspace, float32, initialised by the launcher: OAcc (batch, nheads, seqlen_q, HEADDIM_V) zeros, RowMax
    (batch, nheads, seqlen_q) -inf (base-2 row max), RowSum like RowMax zeros (strides stride_w* and stride_r*); with
    a learnable sink RowMax holds each row's sink in base 2 and RowSum ones (a row that sees no key keeps them).
    score_scale = softmax_scale * log2(e); window_left / window_right are read only where HAS_LEFT / HAS_RIGHT.
    """
    tl.static_assert(BLOCK_D >= HEADDIM and BLOCK_DV >= HEADDIM_V)
    b, h, hk = program_heads(tl.program_id(0), nheads, group_size)
    q_base = Q + b * stride_qb + h * stride_qh
    k_base = K + b * stride_kb + hk * stride_kh
    v_base = V + b * stride_vb + hk * stride_vh
    o_base = OAcc + b * stride_wb + h * stride_wh
    m_base = RowMax + b * stride_rb + h * stride_rh
    l_base = RowSum + b * stride_rb + h * stride_rh
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)

    # key blocks that some query sees: from the first row's left edge to the last row's right edge
    # (bottom-right alignment: the last row's diagonal is the last key, so no band ends before it)
    n_lo = 0
    if HAS_LEFT:
        n_lo = (tl.maximum(diagonal_offset - window_left, 0) // BLOCK_N) * BLOCK_N
    for n0 in range(n_lo, seqlen_k, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        key_ok = offs_n < seqlen_k
        keys = offs_n.to(tl.int64)
        # loaded once per outer step and kept for every query block, so the mask's cost is not worth avoiding
        k_t = tl.load(k_base + keys[None, :] * stride_kn + offs_d[:, None],
                      mask=key_ok[None, :] & (offs_d[:, None] < HEADDIM), other=0.0)
        v = tl.load(v_base + keys[:, None] * stride_vn + offs_dv[None, :],
                    mask=key_ok[:, None] & (offs_dv[None, :] < HEADDIM_V), other=0.0)
        lo, full_lo, full_hi, hi = query_block_bounds(n0, seqlen_q, seqlen_k, diagonal_offset, window_left,
                                                      window_right, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
        # the three query ranges: right band edge (masked), interior (unmasked), left edge and ragged end (masked)
        for m0 in range(lo, tl.minimum(full_lo, hi), BLOCK_M):
            _update_query_block(m0, n0, k_t, v, q_base, o_base, m_base, l_base, stride_qm, stride_wm, seqlen_q,
                                seqlen_k, score_scale, diagonal_offset, window_left, window_right, HEADDIM,
                                HEADDIM_V, BLOCK_D, BLOCK_DV, BLOCK_M, BLOCK_N, True, HAS_LEFT, HAS_RIGHT,
                                DOT_PRECISION)
        for m0 in range(full_lo, full_hi, BLOCK_M):
            _update_query_block(m0, n0, k_t, v, q_base, o_base, m_base, l_base, stride_qm, stride_wm, seqlen_q,
                                seqlen_k, score_scale, diagonal_offset, window_left, window_right, HEADDIM,
                                HEADDIM_V, BLOCK_D, BLOCK_DV, BLOCK_M, BLOCK_N, False, HAS_LEFT, HAS_RIGHT,
                                DOT_PRECISION)
        for m0 in range(full_hi, hi, BLOCK_M):
            _update_query_block(m0, n0, k_t, v, q_base, o_base, m_base, l_base, stride_qm, stride_wm, seqlen_q,
                                seqlen_k, score_scale, diagonal_offset, window_left, window_right, HEADDIM,
                                HEADDIM_V, BLOCK_D, BLOCK_DV, BLOCK_M, BLOCK_N, True, HAS_LEFT, HAS_RIGHT,
                                DOT_PRECISION)
        # the next step (or the final pass) reads rows that other threads of this program just stored: the
        # barrier orders those stores before these loads and makes them visible across the CTA
        tl.debug_barrier()

    # final pass: O is already normalised; rows that saw no key (l = 0, or 1 with a sink) were never changed from
    # O = 0
    for m0 in range(0, seqlen_q, BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        row_ok = offs_m < seqlen_q
        rows = offs_m.to(tl.int64)
        width_ok = offs_dv[None, :] < HEADDIM_V
        o = tl.load(o_base + rows[:, None] * stride_wm + offs_dv[None, :], mask=row_ok[:, None] & width_ok,
                    other=0.0)
        m = tl.load(m_base + rows, mask=row_ok, other=float("-inf"))
        l = tl.load(l_base + rows, mask=row_ok, other=0.0)
        seen = l > 0
        out = tl.where(seen[:, None], o, 0.0)
        lse = tl.where(seen, (m + tl.log2(tl.where(seen, l, 1.0))) * 0.6931471805599453, float("-inf"))  # ln 2
        tl.store(Out + b * stride_ob + h * stride_oh + rows[:, None] * stride_om + offs_dv[None, :],
                 out.to(Out.dtype.element_ty), mask=row_ok[:, None] & width_ok)
        tl.store(Lse + b * stride_lse_b + h * stride_lse_h + rows, lse, mask=row_ok)


FA1_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def default_fa1_blocks(headdim: int, headdim_v: int, dtype: torch.dtype) -> tuple[int, int]:
    """(block_m, block_n) when the caller names none: 16 x 16 under Triton's CPU interpreter (the smallest tile
    tl.dot takes, so that small test shapes still cross several blocks quickly); on a GPU 64 x 64, halved along
    the keys for 256-wide fp32 heads, whose K and V blocks are held through the whole inner loop."""
    if _interpreted():
        return 16, 16
    wide = max(padded_width(headdim), padded_width(headdim_v)) * torch.finfo(dtype).bits // 8
    return 64, (32 if wide > 512 else 64)


def _interpreted() -> bool:
    """Whether the kernel was defined under Triton's CPU interpreter (triton.jit reads TRITON_INTERPRET then)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(attention_fwd_fa1_kernel, InterpretedFunction)


def _check_block(name: str, value: object) -> int:
    if type(value) is not int or value < 16 or value & (value - 1):
        raise ValueError(f"{name} must be a power of two >= 16 (tl.dot's smallest tile), got {value!r}")
    return value


def forward_fa1(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float | None = None,
                causal: bool = False, window_size: tuple[int, int] = (-1, -1), block_m: int | None = None,
                block_n: int | None = None, num_warps: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention forward in the FA1 schedule: returns out (batch, seqlen_q, nheads, headdim_v) in q's dtype and
    lse (batch, nheads, seqlen_q) float32, natural log (out = 0, lse = -inf for rows that see no key).

    q (batch, seqlen_q, nheads, headdim), k (batch, seqlen_k, nheads_k, headdim), v (batch, seqlen_k, nheads_k,
    headdim_v), one dtype (float16, bfloat16 or float32) and one device: CUDA, or CPU under Triton's interpreter
    (TRITON_INTERPRET=1 before triton is imported). softmax_scale defaults to 1 / sqrt(headdim); causal and
    window_size = (left, right) (-1 unbounded) are aligned to the bottom-right corner, as flash_attn_func's.
    block_m / block_n (powers of two >= 16) default to default_fa1_blocks.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if isinstance(t, torch.Tensor) and t.dtype not in FA1_DTYPES:
            raise TypeError(f"{name} has dtype {t.dtype}; the FA1 kernel takes float16, bfloat16 or float32")
    call = prepare_flash_attn(q, k, v, dropout_p=0.0, softmax_scale=softmax_scale, causal=causal,
                              window_size=window_size, softcap=0.0, alibi_slopes=None, deterministic=False,
                              return_attn_probs=False, return_lse=True)
    q, k, v, p = call.q, call.k, call.v, call.problem
    if p.device.type != "cuda" and not (p.device.type == "cpu" and _interpreted()):
        raise ValueError(f"q, k and v are on {p.device}; the FA1 kernel runs on CUDA tensors, or on CPU tensors "
                         "under Triton's interpreter (TRITON_INTERPRET=1 set before triton is imported)")
    default_m, default_n = default_fa1_blocks(p.headdim, p.headdim_v, p.dtype)
    block_m = _check_block("block_m", default_m if block_m is None else block_m)
    block_n = _check_block("block_n", default_n if block_n is None else block_n)
    if type(num_warps) is not int or num_warps < 1 or num_warps & (num_warps - 1):
        raise ValueError(f"num_warps must be a power of two >= 1, got {num_warps!r}")

    return launch_fa1(q, k, v, p, block_m, block_n, num_warps)


def launch_fa1(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: AttentionProblem, block_m: int, block_n: int,
               num_warps: int, learnable_sink: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The launcher behind forward_fa1 and the backend's fa1 schedule: q, k, v already validated into problem `p`
    (dense batch, unit-stride head dims, no softcap / ALiBi / mask); returns out and lse as forward_fa1 does.
    learnable_sink (nheads,): each row's state starts from its head's sink (row max = sink * log2(e), row sum 1)."""
    out = torch.empty(p.batch, p.seqlen_q, p.nheads, p.headdim_v, dtype=p.dtype, device=p.device)
    lse = torch.empty(p.batch, p.nheads, p.seqlen_q, dtype=torch.float32, device=p.device)
    if out.numel() == 0 and lse.numel() == 0:
        return out, lse
    o_acc = torch.zeros(p.batch, p.nheads, p.seqlen_q, p.headdim_v, dtype=torch.float32, device=p.device)
    if learnable_sink is None:
        row_max = torch.full((p.batch, p.nheads, p.seqlen_q), float("-inf"), dtype=torch.float32, device=p.device)
        row_sum = torch.zeros(p.batch, p.nheads, p.seqlen_q, dtype=torch.float32, device=p.device)
    else:  # the sink's own term of each row's softmax: max = the sink (base 2), sum = exp2(0) = 1
        row_max = (learnable_sink.detach().float() * LOG2E)[None, :, None].expand(p.batch, -1, p.seqlen_q).contiguous()
        row_sum = torch.ones(p.batch, p.nheads, p.seqlen_q, dtype=torch.float32, device=p.device)

    block_d, block_dv = padded_width(p.headdim), padded_width(p.headdim_v)
    if p.headdim < block_d and block_dv < block_d:
        # a padded q/k width with a narrower value tile made triton compute P @ V from outside its shared-memory
        # buffers (docs/compiler-workarounds.md); the value tile padded to the key tile's width is correct
        block_dv = block_d
    # the launch goes to the tensors' GPU, not the current one; CPU tensors run in the interpreter. One stage: no
    # load of the state is software-pipelined ahead of the barrier that orders it after the previous step's stores
    with torch.cuda.device(p.device) if p.device.type == "cuda" else contextlib.nullcontext():
        attention_fwd_fa1_kernel[(p.batch * p.nheads,)](
            q, k, v, out, lse, o_acc, row_max, row_sum,
            q.stride(0), q.stride(1), q.stride(2),
            k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2),
            out.stride(0), out.stride(1), out.stride(2),
            lse.stride(0), lse.stride(1),
            o_acc.stride(0), o_acc.stride(1), o_acc.stride(2),
            row_max.stride(0), row_max.stride(1),
            p.nheads, p.group_size, p.seqlen_q, p.seqlen_k, p.softmax_scale * LOG2E, p.diagonal_offset,
            max(p.window_left, 0), max(p.window_right, 0),
            HEADDIM=p.headdim, HEADDIM_V=p.headdim_v, BLOCK_D=block_d, BLOCK_DV=block_dv,
            BLOCK_M=block_m, BLOCK_N=block_n, HAS_LEFT=p.window_left >= 0, HAS_RIGHT=p.window_right >= 0,
            DOT_PRECISION="ieee", num_warps=num_warps, num_stages=1,
        )
    return out, lse
