"""The attention operator that every entry point and every backend goes through.

One implementation (`_run_forward`, `_run_backward`: the chosen backend's passes) reached two ways:
- eagerly, through `_EagerAttention`, a plain `torch.autograd.Function` that carries the validated
  problem and tiles as objects (a custom op's dispatch costs ~100 us per call on the host, 8x an
  autograd.Function's, which short sequences on a GPU feel; so does rebuilding the problem), or
  straight to the backend's forward when no input needs a gradient (inference);
- under `torch.compile`, through the `torch.library.custom_op`s `flashtile::attention_forward` and
  `flashtile::attention_backward` with fake (meta) implementations and `register_autograd`, so the
  call is opaque to the compiler: a model using flashtile compiles with `fullgraph=True`, the kernels
  run as they are, and the graph sees the right output shapes.

The forward saves q, k, v, out and the per-row lse (O(N * d) memory, never a seqlen x seqlen
tensor); the backward hands them to the same backend's recompute-based backward pass. The lse is
an output with a gradient of its own (d lse / d s = P), so losses that use it (e.g. when merging
attention over several key shards) differentiate correctly. A learnable sink (one logit per query
head in every row's softmax denominator) is a differentiable input: the backends return its gradient
beside dq, dk and dv.

The custom ops take the problem as plain scalars (custom ops accept tensors, numbers and strings),
the backend by name and its tiles as a list of ints; `_problem` rebuilds the AttentionProblem.

Dropout (dropout_p > 0): each call draws its Philox (seed, offset) from torch's generator when it runs
(flashtile._dropout.draw_state): on the eager paths in `attention`, under torch.compile inside the forward custom op
(opaque to the compiler, so a compiled graph draws afresh at every run; the op is tagged nondeterministic_seeded so
that two calls are never merged). The state, a CPU int64 tensor of two elements, goes with the saved tensors to the
backward, which regenerates the same keep-mask from it.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.autograd.function import once_differentiable

from . import _dropout
from ._dispatch import BACKENDS
from ._validate import AttentionProblem, PreparedCall, unit_last_stride

# the operator's tensor arguments after q, k, v and the learnable sink (the inputs with a gradient): optional ones
# that get no gradient (the non-tensor arguments after them differ between the two paths, see _save)
_NO_GRAD_TENSORS = ("alibi_slopes", "attn_mask", "cu_seqlens_q", "cu_seqlens_k")
_GRAD_TENSORS = 4  # q, k, v, learnable_sink


def _problem(q, k, v, learnable_sink, alibi_slopes, attn_mask, cu_seqlens_q, max_seqlen_q, max_seqlen_k,
             softmax_scale, window_left, window_right, diagonal_offset, softcap, alignment,
             dropout_p=0.0) -> AttentionProblem:
    batch, seqlen_q, nheads, headdim = q.shape
    seqlen_k = k.shape[1]
    if cu_seqlens_q is not None:  # packed sequences: (1, total, heads, dim); batch = number of sequences
        batch, seqlen_q, seqlen_k = cu_seqlens_q.shape[0] - 1, max_seqlen_q, max_seqlen_k
    return AttentionProblem(
        batch=batch, nheads=nheads, nheads_k=k.shape[2], seqlen_q=seqlen_q, seqlen_k=seqlen_k, headdim=headdim,
        headdim_v=v.shape[3], dtype=q.dtype, device=q.device, softmax_scale=softmax_scale, window_left=window_left,
        window_right=window_right, diagonal_offset=diagonal_offset, alignment=alignment, softcap=softcap,
        has_alibi=alibi_slopes is not None,
        mask_kind=None if attn_mask is None else ("bool" if attn_mask.dtype == torch.bool else "additive"),
        varlen=cu_seqlens_q is not None, has_sink=learnable_sink is not None, dropout_p=dropout_p)


def _run_forward(q, k, v, learnable_sink, alibi_slopes, attn_mask, cu_seqlens_q, cu_seqlens_k, problem, backend,
                 tiles, rng_state=None):
    return BACKENDS[backend].forward(q, k, v, alibi_slopes, attn_mask, problem, tiles, cu_seqlens_q, cu_seqlens_k,
                                     learnable_sink, rng_state)


def _run_backward(grad_out, grad_lse, q, k, v, out, lse, learnable_sink, alibi_slopes, attn_mask, cu_seqlens_q,
                  cu_seqlens_k, problem, backend, tiles, rng_state=None):
    """dq, dk, dv and the sink's gradient (None without a sink)."""
    return BACKENDS[backend].backward(grad_out, grad_lse, q, k, v, out, lse, alibi_slopes, attn_mask, problem,
                                      tiles, cu_seqlens_q, cu_seqlens_k, learnable_sink, rng_state)


def _from_scalars(q, k, v, learnable_sink, alibi_slopes, attn_mask, cu_seqlens_q, max_seqlen_q, max_seqlen_k,
                  softmax_scale, window_left, window_right, diagonal_offset, softcap, alignment, backend, tiles,
                  dropout_p=0.0):
    """(problem, backend, tiles object) from the custom ops' plain arguments."""
    problem = _problem(q, k, v, learnable_sink, alibi_slopes, attn_mask, cu_seqlens_q, max_seqlen_q, max_seqlen_k,
                       softmax_scale, window_left, window_right, diagonal_offset, softcap, alignment, dropout_p)
    return problem, backend, BACKENDS[backend].tiles_from_list(tiles)


@torch.library.custom_op("flashtile::attention_forward", mutates_args=(), tags=(torch.Tag.nondeterministic_seeded,))
def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, learnable_sink: Optional[torch.Tensor],
                      alibi_slopes: Optional[torch.Tensor], attn_mask: Optional[torch.Tensor],
                      cu_seqlens_q: Optional[torch.Tensor], cu_seqlens_k: Optional[torch.Tensor], max_seqlen_q: int,
                      max_seqlen_k: int, softmax_scale: float, window_left: int, window_right: int,
                      diagonal_offset: int, softcap: float, alignment: str, backend: str, tiles: list[int],
                      dropout_p: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """out (batch, seqlen_q, nheads, headdim_v) in q's dtype; lse (batch, nheads, seqlen_q) in the accumulation
    dtype. Packed sequences (cu_seqlens given): q (1, total_q, ...), out (1, total_q, ...), lse (1, nheads, total_q).
    rng_state: with dropout_p > 0, the (seed, offset) drawn for this call (CPU int64, two elements); else empty."""
    plan = _from_scalars(q, k, v, learnable_sink, alibi_slopes, attn_mask, cu_seqlens_q, max_seqlen_q, max_seqlen_k,
                         softmax_scale, window_left, window_right, diagonal_offset, softcap, alignment, backend, tiles,
                         dropout_p)
    tensors = (q, k, v, learnable_sink, alibi_slopes, attn_mask, cu_seqlens_q, cu_seqlens_k)
    if dropout_p > 0:
        rng_state = _dropout.draw_state(q.device)
        return (*_run_forward(*tensors, *plan, rng_state), rng_state)
    out, lse = _run_forward(*tensors, *plan)
    return out, lse, torch.empty(0, dtype=torch.int64)


@attention_forward.register_fake
def _(q, k, v, learnable_sink, alibi_slopes, attn_mask, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
      softmax_scale, window_left, window_right, diagonal_offset, softcap, alignment, backend, tiles, dropout_p=0.0):
    batch, seqlen_q, nheads, _ = q.shape
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    return (q.new_empty(batch, seqlen_q, nheads, v.shape[3]), q.new_empty(batch, nheads, seqlen_q, dtype=acc),
            torch.empty(2 if dropout_p > 0 else 0, dtype=torch.int64))


@torch.library.custom_op("flashtile::attention_backward", mutates_args=())
def attention_backward(grad_out: torch.Tensor, grad_lse: Optional[torch.Tensor], q: torch.Tensor, k: torch.Tensor,
                       v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, learnable_sink: Optional[torch.Tensor],
                       alibi_slopes: Optional[torch.Tensor], attn_mask: Optional[torch.Tensor],
                       cu_seqlens_q: Optional[torch.Tensor], cu_seqlens_k: Optional[torch.Tensor], max_seqlen_q: int,
                       max_seqlen_k: int, softmax_scale: float, window_left: int, window_right: int,
                       diagonal_offset: int, softcap: float, alignment: str, backend: str, tiles: list[int],
                       dropout_p: float = 0.0, rng_state: Optional[torch.Tensor] = None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv: contiguous, shaped like q, k, v, in their dtype; and the sink's gradient shaped like learnable_sink
    in its dtype (an empty tensor without a sink: a custom op returns tensors only). grad_lse None means zero.
    rng_state: the forward's (with dropout_p > 0)."""
    plan = _from_scalars(q, k, v, learnable_sink, alibi_slopes, attn_mask, cu_seqlens_q, max_seqlen_q, max_seqlen_k,
                         softmax_scale, window_left, window_right, diagonal_offset, softcap, alignment, backend, tiles,
                         dropout_p)
    dq, dk, dv, dsink = _run_backward(grad_out, grad_lse, q, k, v, out, lse, learnable_sink, alibi_slopes, attn_mask,
                                      cu_seqlens_q, cu_seqlens_k, *plan, rng_state if dropout_p > 0 else None)
    return dq, dk, dv, q.new_empty(0) if dsink is None else dsink


@attention_backward.register_fake
def _(grad_out, grad_lse, q, k, v, out, lse, learnable_sink, alibi_slopes, attn_mask, cu_seqlens_q, cu_seqlens_k,
      max_seqlen_q, max_seqlen_k, softmax_scale, window_left, window_right, diagonal_offset, softcap, alignment,
      backend, tiles, dropout_p=0.0, rng_state=None):
    dsink = q.new_empty(0) if learnable_sink is None else torch.empty_like(learnable_sink)
    return (torch.empty(q.shape, dtype=q.dtype, device=q.device), torch.empty(k.shape, dtype=k.dtype, device=k.device),
            torch.empty(v.shape, dtype=v.dtype, device=v.device), dsink)


def _save(ctx, inputs, output) -> None:
    """Keep q, k, v, out, lse, the learnable sink, the _NO_GRAD_TENSORS and the custom op's third output (its dropout
    rng_state) for the backward; the rest of `inputs` (the custom op's scalars, or the eager path's problem, backend,
    tiles and rng_state) goes to ctx.rest as it is."""
    out, lse, *rng_state = output
    tensors = _GRAD_TENSORS + len(_NO_GRAD_TENSORS)
    ctx.save_for_backward(*inputs[:3], out, lse, *inputs[3:tensors], *rng_state)
    ctx.rest = inputs[tensors:]


def _gradients(ctx, grad_out, grad_lse, backward):
    """The autograd formula of both paths; `backward` is the custom op (it takes ctx.rest as scalars) or
    _run_backward (problem, backend, tiles, rng_state)."""
    q, k, v, out, lse, learnable_sink, *saved = ctx.saved_tensors
    no_grad_tensors, rng_state = saved[:len(_NO_GRAD_TENSORS)], saved[len(_NO_GRAD_TENSORS):]
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    # grad_lse stays None when the caller never used lse: the backends skip that term
    # a gradient built by expand() (e.g. from .sum().backward()) has stride 0 everywhere
    grad_out = unit_last_stride(grad_out)
    dq, dk, dv, dsink = backward(grad_out, grad_lse, q, k, v, out, lse, learnable_sink, *no_grad_tensors, *ctx.rest,
                                 *rng_state)
    if learnable_sink is None:
        dsink = None
    return (dq, dk, dv, dsink) + (None,) * (len(_NO_GRAD_TENSORS) + len(ctx.rest))


attention_forward.register_autograd(
    lambda ctx, grad_out, grad_lse, grad_rng_state: _gradients(ctx, grad_out, grad_lse, attention_backward),
    setup_context=_save)


class _EagerAttention(torch.autograd.Function):
    """Inputs: q, k, v, learnable_sink, the _NO_GRAD_TENSORS, then (problem, backend name, the backend's tiles
    object, dropout rng_state or None)."""

    @staticmethod
    def forward(ctx, *inputs):
        ctx.set_materialize_grads(False)  # an unused lse must not cost a tensor of zeros
        output = _run_forward(*inputs)
        _save(ctx, inputs, output)
        return output

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out, grad_lse):
        return _gradients(ctx, grad_out, grad_lse, _run_backward)


def attention(call: PreparedCall, backend: str, tiles: tuple[int, ...], *, with_rng_state: bool = False):
    """Run `call` on backend `backend` with `tiles` (from _dispatch.resolve).

    Returns out (batch, seqlen_q, nheads, headdim_v) and lse (batch, nheads, seqlen_q) float32; for packed
    sequences out (1, total_q, nheads, headdim_v) and lse (1, nheads, total_q). with_rng_state: also the call's
    dropout (seed, offset) as a CPU int64 tensor of two elements (None, or empty, without dropout).
    """
    p = call.problem
    sink = call.learnable_sink
    tensors = (call.q, call.k, call.v, sink, call.alibi_slopes, call.attn_mask, call.cu_seqlens_q,
               call.cu_seqlens_k)
    if torch.compiler.is_compiling():
        out, lse, rng_state = attention_forward(*tensors, p.seqlen_q, p.seqlen_k, p.softmax_scale, p.window_left,
                                                p.window_right, p.diagonal_offset, p.softcap, p.alignment, backend,
                                                list(tiles), p.dropout_p)
    else:
        rng_state = _dropout.draw_state(call.q.device) if p.dropout_p > 0 else None
        if torch.is_grad_enabled() and (call.q.requires_grad or call.k.requires_grad or call.v.requires_grad
                                        or (sink is not None and sink.requires_grad)):
            out, lse = _EagerAttention.apply(*tensors, p, backend, BACKENDS[backend].tiles_from_list(tiles),
                                             rng_state)
        else:
            # nothing to differentiate: the backend directly (the autograd.Function's own cost, ~15 us of host time
            # per call on the CI machine, is felt by short GPU calls, whose issue can take as long as their kernels)
            out, lse = _run_forward(*tensors, p, backend, BACKENDS[backend].tiles_from_list(tiles), rng_state)
    if with_rng_state:
        return out, lse.float(), rng_state
    return out, lse.float()
