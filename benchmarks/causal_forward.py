"""The causal forward at the grid's shapes, for A/B runs of two source trees, on a GPU.

For d 128 (64- and 128-key blocks) and d 64, N 1k / 4k / 16k (16k tokens per batch, width 2048, bf16), prints
the kernel's own time from the profiler (mean of 20 calls: immune to the host's noise) and do_bench's median,
each line tagged with the label given. Run it once per tree, interleaved, e.g.

    PYTHONPATH=old/src python benchmarks/causal_forward.py old1; PYTHONPATH=src python benchmarks/causal_forward.py new1
"""
import sys
import torch
import triton.testing
from torch.profiler import ProfilerActivity, profile
import flashtile

label = sys.argv[1]

def kernel_us(fn, calls=20):
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return sum(e.self_device_time_total for e in prof.key_averages()) / calls

for d in (128, 64):
    for n in (1024, 4096, 16384):
        b, h = 16384 // n, 2048 // d
        q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        flops = 2 * b * h * n * n * d
        for block_n in ((64, 128) if d == 128 else (64,)):
            def fn():
                with flashtile.use_backend("triton", block_n=block_n):
                    return flashtile.flash_attn_func(q, k, v, causal=True)
            fn()
            ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
            us = kernel_us(fn)
            print(f"{label} d{d} N{n} causal block_n {block_n}: kernel {us:7.1f} us ({flops / us / 1e6:5.1f} TFLOP/s), "
                  f"do_bench {ms * 1e3:7.1f} us ({flops / ms / 1e9:5.1f})", flush=True)
