"""The fa4 schedule's two moves one at a time on a GPU: the forward's TFLOP/s with fa3 (the Gluon forward at the
table's settings), fa4 (fa3 with both moves), fa4 with the conditional rescale alone (no exponential on the FMA
units), fa4 with the polynomial exponentials alone (rescale_threshold=0), then fa2 and fa4 on fa2's TMA kernel
(forward_schedule=1), and fa3 again; bf16, model width 2048, 16,384 tokens per batch, on the cells below.

    python benchmarks/fa4_moves.py

Times are triton.testing.do_bench medians; one JSON line per cell, with the kernel each variant ran (profiler).
"""

from __future__ import annotations

import json

import torch
import triton.testing

import flashtile
from flashtile._measure import timed_kernels

VARIANTS = [("fa3", dict(schedule="fa3")), ("fa4 both", dict(schedule="fa4")),
            ("fa4 rescale only", dict(schedule="fa4", gluon_exp2_emulated=0, exp2_poly_every=0)),
            ("fa4 poly only", dict(schedule="fa4", rescale_threshold=0)), ("fa2", dict(schedule="fa2")),
            ("fa4 on fa2", dict(schedule="fa4", forward_schedule=1)), ("fa3 again", dict(schedule="fa3"))]
CELLS = [(128, 4096, False), (64, 4096, False), (128, 16384, False), (64, 1024, True)]


def _bench(fn) -> float:
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=25, rep=100)


def main() -> None:
    for headdim, seqlen, causal in CELLS:
        batch, heads = 16384 // seqlen, 2048 // headdim
        q, k, v = (torch.randn(batch, seqlen, heads, headdim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        flops = 4 * batch * heads * seqlen * seqlen * headdim * (0.5 if causal else 1.0)
        row = {"d": headdim, "n": seqlen, "causal": causal}
        for name, settings in VARIANTS:
            def run(settings=settings):
                with flashtile.use_backend("triton", **settings):
                    return flashtile.flash_attn_func(q, k, v, causal=causal)
            try:
                row[name] = round(flops / _bench(run) / 1e9, 1)
                row[f"{name} kernel"] = ", ".join(kernel for kernel, _ in timed_kernels(run, q.device))
            except Exception as error:  # noqa: BLE001 - the row names any failure
                row[name] = f"{type(error).__name__}: {str(error)[:150]}"
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
