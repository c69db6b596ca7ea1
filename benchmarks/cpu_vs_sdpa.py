"""flashtile's torch backend against torch SDPA's fused CPU kernel: time, and memory, on the CPU.

Times flashtile's torch backend and torch.nn.functional.scaled_dot_product_attention on the same
random inputs (batch 1, 8 heads, 2048 tokens, d 64, fp32; forward and forward+backward, causal and
not), interleaving the two so that machine noise hits both, and reports medians, the kernels each ran
and the ratio; then measures the peak memory growth of forward+backward at 16k tokens.

    .venv/bin/python benchmarks/cpu_vs_sdpa.py
"""

from __future__ import annotations

import platform
import statistics
import time

import torch
import torch.nn.functional as F

import flashtile
from flashtile._measure import executed_kernels, peak_memory_growth_bytes


def main(batch=1, heads=8, seqlen=2048, headdim=64, repeats=9):
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.processor() or platform.machine()}")
    torch.manual_seed(0)
    q, k, v = (torch.randn(batch, heads, seqlen, headdim, requires_grad=True) for _ in range(3))
    grad = torch.randn(batch, heads, seqlen, headdim)
    impls = {"torch SDPA": F.scaled_dot_product_attention, "flashtile": flashtile.scaled_dot_product_attention}
    for causal in (False, True):
        modes = {
            "fwd": lambda fn: (lambda: fn(q.detach(), k.detach(), v.detach(), is_causal=causal)),
            "fwd+bwd": lambda fn: (lambda: fn(q, k, v, is_causal=causal).backward(grad)),
        }
        for mode, make in modes.items():
            samples = {name: [] for name in impls}
            for name, fn in impls.items():
                make(fn)()  # warm-up
            for _ in range(repeats):
                for name, fn in impls.items():
                    t0 = time.perf_counter()
                    make(fn)()
                    samples[name].append((time.perf_counter() - t0) * 1e3)
            ms = {name: statistics.median(s) for name, s in samples.items()}
            ran = {name: ", ".join(executed_kernels(make(fn), torch.device("cpu"), limit=2)) for name, fn in impls.items()}
            print(f"B{batch} H{heads} N{seqlen} d{headdim} fp32 causal={causal} {mode:8s}: "
                  f"SDPA {ms['torch SDPA']:.1f} ms [{ran['torch SDPA']}], flashtile {ms['flashtile']:.1f} ms "
                  f"[{ran['flashtile']}], ratio {ms['flashtile'] / ms['torch SDPA']:.2f}x")

    n = 16384
    for causal in (False, True):
        q, k, v = (torch.randn(1, n, 1, 64, requires_grad=True) for _ in range(3))
        g = torch.randn(1, n, 1, 64)
        growth = peak_memory_growth_bytes(lambda: flashtile.flash_attn_func(q, k, v, causal=causal).backward(g),
                                          torch.device("cpu"))
        print(f"fwd+bwd N={n} d=64 one head causal={causal}: peak memory growth {growth / 2**20:.1f} MiB "
              f"(the fp32 score matrix alone would be {n * n * 4 / 2**30:.1f} GiB)")


if __name__ == "__main__":
    main()
