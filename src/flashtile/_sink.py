"""The learnable sink's arithmetic outside the kernels, shared by the backends.

A sink is one logit per query head, s_h (natural log, not multiplied by softmax_scale), that joins every query
row's softmax denominator without a value (as in gpt-oss and flash-attn's CuTe interface):

    out_i = sum_j exp(S_ij - m) v_j / (exp(s_h - m) + sum_j exp(S_ij - m)),   lse_i = log(exp(s_h) + sum_j exp(S_ij))

The forward passes start each row's online softmax from the sink (running max s_h, running sum 1), so the lse they
store includes it and a row that sees no key gets out = 0 and lse = s_h. Split-KV decoding adds it once, where the
splits are merged.

Gradient. With p_i = exp(s_h - lse_i) (the sink's share of row i), d lse_i / d s_h = p_i and d out_i / d s_h =
-p_i out_i, so for a loss with cotangents dO_i (on out) and dlse_i (on lse)

    dL / ds_h = sum_i p_i (dlse_i - dO_i . out_i) = -sum_i exp(s_h - lse_i) delta_i

over the rows of head h in every batch entry, where delta_i = rowsum(dO_i * out_i) - dlse_i is the row term the
backward passes compute anyway. dq, dk and dv keep their formulas given the lse that includes the sink:
dS_ij = P_ij (dP_ij - delta_i) with P_ij = exp(S_ij - lse_i).
"""

from __future__ import annotations

import torch


def sink_gradient(learnable_sink: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """The sink's gradient, shaped like learnable_sink (nheads,) in its dtype, from the forward's lse and the
    backward's delta, both (batch, nheads, rows) (packed sequences: (1, nheads, total_q)), computed in float32
    (float64 for float64 inputs)."""
    acc = torch.float64 if lse.dtype == torch.float64 else torch.float32
    sink = learnable_sink.detach().to(acc)[None, :, None]
    lse = lse.to(acc)
    # a row whose lse is -inf (a sink of -inf and no visible key) carries no sink share: exp(-inf), not exp(nan)
    share = torch.exp(sink - lse.masked_fill(lse == float("-inf"), float("inf")))
    return torch.linalg.vecdot(share, delta.to(acc)).sum(dim=0).neg().to(learnable_sink.dtype)
