"""The causal forward at the grid's shapes, for A/B runs of two source trees, on a GPU.

For d 128 (64- and 128-key blocks) and d 64, N 1k / 4k / 16k (16k tokens per batch, width 2048, bf16), prints
the kernel's own time from the profiler (mean of 20 calls: immune to the host's noise) and do_bench's median,
each line tagged with the label given. Run it once per tree, interleaved, e.g.

    PYTHONPATH=old/src python benchmarks/causal_forward.py old1; PYTHONPATH=src python benchmarks/causal_forward.py new1
"""
from __future__ import annotations

import sys

import torch
import triton.testing

import flashtile

from host_overhead import kernel_ms


def main(label: str) -> None:
    for d in (128, 64):
        for n in (1024, 4096, 16384):
            batch, heads = 16384 // n, 2048 // d
            q, k, v = (torch.randn(batch, n, heads, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            flops = 2 * batch * heads * n * n * d
            for block_n in ((64, 128) if d == 128 else (64,)):
                def forward():
                    with flashtile.use_backend("triton", block_n=block_n):
                        return flashtile.flash_attn_func(q, k, v, causal=True)

                forward()
                timed = triton.testing.do_bench(forward, warmup=25, rep=100, return_mode="median")
                kernel = kernel_ms(forward, calls=20)
                print(f"{label} d{d} N{n} causal block_n {block_n}: kernel {kernel * 1e3:7.1f} us "
                      f"({flops / kernel / 1e9:5.1f} TFLOP/s), do_bench {timed * 1e3:7.1f} us "
                      f"({flops / timed / 1e9:5.1f})", flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "run")
