"""Host time against kernel time for the grid's 1k forward cells, on a GPU.

`triton.testing.do_bench` records its start event before the timed call is issued, so when issuing the call
from Python takes longer than the GPU has queued (the L2 flush before it, ~0.1 ms on an H200), the GPU idles
inside the measurement. Per cell (d 128 / 64, causal or not, batch 16 x 1,024 tokens, bf16, twice), this
prints do_bench as `flashtile bench` runs it (two rotating input sets) and with one set, the kernel's own
time from the profiler, and the host time of one call (200 calls issued back to back, before waiting).

    python benchmarks/host_vs_kernel.py
"""
import time
import torch
import triton.testing
from torch.profiler import ProfilerActivity, profile
import flashtile

def kernel_us(fn, calls=20):
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return sum(e.self_device_time_total for e in prof.key_averages()) / calls

def host_us(fn, calls=200):
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    issued = time.perf_counter() - start
    torch.cuda.synchronize()
    return issued / calls * 1e6

for rnd in range(2):
    for d, causal in ((128, True), (64, False), (128, False), (64, True)):
        b, h, n = 16, 2048 // d, 1024
        sets = [tuple(torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3)) for _ in range(2)]
        turn = [0]
        def rotating():
            turn[0] ^= 1
            return flashtile.flash_attn_func(*sets[turn[0]], causal=causal)
        def single():
            return flashtile.flash_attn_func(*sets[0], causal=causal)
        flops = 4 * b * h * n * n * d * (0.5 if causal else 1.0)
        single()
        r = triton.testing.do_bench(rotating, warmup=25, rep=100, return_mode="median")
        s = triton.testing.do_bench(single, warmup=25, rep=100, return_mode="median")
        k = kernel_us(single)
        hu = host_us(single)
        print(f"round {rnd} d{d} causal={int(causal)}: do_bench rotating {r*1e3:.0f} us ({flops/r/1e9:.0f} TFLOP/s), "
              f"single {s*1e3:.0f} us ({flops/s/1e9:.0f}), kernel {k:.0f} us ({flops/k/1e6:.0f}), host {hu:.0f} us/call",
              flush=True)
