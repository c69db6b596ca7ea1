"""The autograd function shared by every public entry point and every backend.

Forward saves q, k, v, out and the per-row lse (O(N * d) memory, never a seqlen x seqlen tensor);
backward hands them to the same backend's recompute-based backward pass. The lse is an output
with a gradient of its own (d lse / d s = P), so losses that use it (e.g. when merging attention
over several key shards) differentiate correctly.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from ._dispatch import Plan
from ._validate import PreparedCall, unit_last_stride


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, alibi_slopes, attn_mask, call: PreparedCall, plan: Plan):
        out, lse = plan.backend.forward(q, k, v, alibi_slopes, attn_mask, call.problem, plan.tiles)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.alibi_slopes, ctx.attn_mask = alibi_slopes, attn_mask
        ctx.problem, ctx.plan = call.problem, plan
        return out, lse.float()

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse = ctx.saved_tensors
        # a gradient built by expand() (e.g. from .sum().backward()) has stride 0 everywhere
        grad_out = unit_last_stride(grad_out)
        dq, dk, dv = ctx.plan.backend.backward(grad_out, grad_lse, q, k, v, out, lse, ctx.alibi_slopes,
                                               ctx.attn_mask, ctx.problem, ctx.plan.tiles)
        return dq, dk, dv, None, None, None, None


def attention(call: PreparedCall, plan: Plan) -> tuple[torch.Tensor, torch.Tensor]:
    """Run `plan` on `call`: returns out (batch, nheads, seqlen_q, headdim_v) and lse (batch, nheads, seqlen_q) float32."""
    return _Attention.apply(call.q, call.k, call.v, call.alibi_slopes, call.attn_mask, call, plan)
