"""The fa4 schedule's two moves one at a time on a GPU: the forward's TFLOP/s with fa2, fa4 (both moves), fa4 with
the conditional rescale alone (exp2_poly_every=0) and fa4 with the polynomial exponentials alone
(rescale_threshold=0), then fa2 again; bf16, batch 4, model width 2048, 4k keys, non-causal.

    python benchmarks/fa4_moves.py

Times are triton.testing.do_bench medians; one JSON line per head dim.
"""

from __future__ import annotations

import json

import torch
import triton.testing

import flashtile

VARIANTS = [("fa2", dict(schedule="fa2")), ("fa4 both", dict(schedule="fa4")),
            ("fa4 rescale only", dict(schedule="fa4", exp2_poly_every=0)),
            ("fa4 poly only", dict(schedule="fa4", rescale_threshold=0)), ("fa2 again", dict(schedule="fa2"))]


def _bench(fn) -> float:
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=25, rep=100)


def main() -> None:
    for headdim in (128, 64):
        batch, heads, seqlen = 4, 2048 // headdim, 4096
        q, k, v = (torch.randn(batch, seqlen, heads, headdim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        flops = 4 * batch * heads * seqlen * seqlen * headdim
        row = {"d": headdim, "n": seqlen}
        for name, settings in VARIANTS:
            def run(settings=settings):
                with flashtile.use_backend("triton", **settings):
                    return flashtile.flash_attn_func(q, k, v)
            try:
                row[name] = round(flops / _bench(run) / 1e9, 1)
            except Exception as error:  # noqa: BLE001 - the row names any failure
                row[name] = f"{type(error).__name__}: {str(error)[:150]}"
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
