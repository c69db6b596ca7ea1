"""Host time against kernel time for the grid's 1k forward cells, on a GPU.

`triton.testing.do_bench` records its start event before the timed call is issued, so when issuing the call
from Python takes longer than the GPU has queued (the L2 flush before it, ~0.1 ms on an H200), the GPU idles
inside the measurement. Per cell (d 128 / 64, causal or not, batch 16 x 1,024 tokens, bf16, twice), this
prints do_bench as `flashtile bench` runs it (two rotating input sets) and with one set, the kernel's own
time from the profiler, and the host time of one call (200 calls issued back to back, before waiting).

    python benchmarks/host_vs_kernel.py
"""
from __future__ import annotations

import torch
import triton.testing

import flashtile

from host_overhead import host_ms, kernel_ms


def main() -> None:
    for round_ in range(2):
        for d, causal in ((128, True), (64, False), (128, False), (64, True)):
            batch, heads, n = 16, 2048 // d, 1024
            sets = [tuple(torch.randn(batch, n, heads, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
                    for _ in range(2)]
            turn = [0]

            def rotating():
                turn[0] ^= 1
                return flashtile.flash_attn_func(*sets[turn[0]], causal=causal)

            def single():
                return flashtile.flash_attn_func(*sets[0], causal=causal)

            flops = 4 * batch * heads * n * n * d * (0.5 if causal else 1.0)
            single()
            rotating_ms = triton.testing.do_bench(rotating, warmup=25, rep=100, return_mode="median")
            single_ms = triton.testing.do_bench(single, warmup=25, rep=100, return_mode="median")
            kernel = kernel_ms(single, calls=20)
            host = host_ms(single, calls=200)
            print(f"round {round_} d{d} causal={int(causal)}: do_bench rotating {rotating_ms * 1e3:.0f} us "
                  f"({flops / rotating_ms / 1e9:.0f} TFLOP/s), single {single_ms * 1e3:.0f} us "
                  f"({flops / single_ms / 1e9:.0f}), kernel {kernel * 1e3:.0f} us ({flops / kernel / 1e9:.0f}), "
                  f"host {host * 1e3:.0f} us/call", flush=True)


if __name__ == "__main__":
    main()
