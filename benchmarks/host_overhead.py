"""How much host (Python) time a flashtile call costs next to its GPU time, and where it goes.

Short calls are limited by the host when issuing the work takes longer than running it. For the grid's
1k-token shapes (batch 16, d 128 x 16 heads and d 64 x 32 heads, bf16) and for a KV-cache decode step
(batch 1, 4k cache, 32 query heads on 8 K/V heads, d 128) this prints:
  median     triton.testing.do_bench median of one call (ms)
  host       ms of Python per call: 50 calls issued back to back, timed before waiting for the GPU
  kernels    ms of GPU kernels per call (torch.profiler)
then a cProfile of 50 calls (internal time), to show which Python functions the host time goes to;
and the floors any Python-launched kernel pays on that host: one launch of an empty Triton kernel with
one argument and with 40 (about what the attention kernels take), the same compiled kernel relaunched
without Triton's argument binder (what a launcher caching its compiled kernels would pay), and one
torch.empty. The fwd+bwd steps are timed with the table's backward and with each backward schedule forced.
With --quick: only the table's calls, no cProfile, the host time as the lowest and the median of 9 rounds of
40 calls, each line tagged with the label after --quick (for A/B runs of two source trees, interleaved:
PYTHONPATH=old/src python benchmarks/host_overhead.py --quick old1).

With --decode: only decode steps (batch 1 with a contiguous cache, pages of 16 and of 256 keys; batch 8).

    python benchmarks/host_overhead.py [--quick LABEL] [--decode]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch
import triton
import triton.language as tl
import triton.testing
from torch.profiler import ProfilerActivity, profile

import flashtile


def kernel_ms(fn, calls: int = 5) -> float:
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    device = torch.autograd.DeviceType.CUDA
    return sum(e.self_device_time_total for e in prof.key_averages()
               if getattr(e, "device_type", None) == device) / calls / 1e3


def host_ms(fn, calls: int = 50) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    seconds = time.perf_counter() - start
    torch.cuda.synchronize()
    return seconds / calls * 1e3


def report(name: str, fn, quick_label: str | None = None) -> None:
    """One call's do_bench median, host and kernel time, then a cProfile; with quick_label (A/B runs), the
    host time as the lowest and median of 9 rounds and no cProfile, the line tagged with the label."""
    fn()
    torch.cuda.synchronize()
    median = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
    if quick_label is not None:  # the host's noise is large between runs: lowest and median of 9 x 40 calls
        rounds = sorted(host_ms(fn, calls=40) for _ in range(9))
        print(f"{quick_label}{name}: median {median:.3f} ms, host min {rounds[0] * 1e3:.1f} / median "
              f"{rounds[4] * 1e3:.1f} us/call, kernels {kernel_ms(fn):.3f} ms/call", flush=True)
        return
    print(f"{name}: median {median:.3f} ms, host {host_ms(fn):.3f} ms/call, kernels {kernel_ms(fn):.3f} ms/call",
          flush=True)
    profiler = cProfile.Profile()
    profiler.runcall(lambda: [fn() for _ in range(50)])
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(14)
    body = text.getvalue()
    print(body[body.index("ncalls"):] if "ncalls" in body else body, flush=True)


@triton.jit
def _empty_kernel(X):
    pass


@triton.jit
def _empty_kernel_40_args(X, a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15, a16, a17, a18,
                          a19, a20, a21, a22, a23, a24, a25, a26, a27, a28, a29, a30, a31, a32, a33, a34,
                          B0: tl.constexpr, B1: tl.constexpr, B2: tl.constexpr, B3: tl.constexpr):
    pass


def launch_floors(device: torch.device) -> None:
    x = torch.empty(1, device=device)
    ints = list(range(1, 36))
    calls = {
        "empty Triton kernel, 1 argument": lambda: _empty_kernel[(1,)](x),
        "empty Triton kernel, 36 arguments + 4 constexprs": lambda: _empty_kernel_40_args[(1,)](
            x, *ints, B0=16, B1=32, B2=True, B3="ieee"),
        "torch.empty": lambda: torch.empty(64, device=device),
    }
    # The compiled kernel that JITFunction.run returns can be launched again without the binder (argument
    # specialisation and cache lookup): what a launcher that caches its compiled kernels would pay.
    compiled = _empty_kernel_40_args[(1,)](x, *ints, B0=16, B1=32, B2=True, B3="ieee")
    if hasattr(compiled, "__getitem__"):
        runner = compiled[(1, 1, 1)]
        calls["compiled kernel relaunched, 36 arguments + 4 constexprs"] = lambda: runner(x, *ints, 16, 32, True, "ieee")
    for name, fn in calls.items():
        try:
            fn()
        except Exception as error:  # an API that differs between triton versions: report, go on
            print(f"floor: {name}: failed ({type(error).__name__}: {error})", flush=True)
            continue
        print(f"floor: {name}: {1e3 * host_ms(fn, calls=2000):.1f} us of host time per call", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", metavar="LABEL", nargs="?", const="", default=None,
                        help="the table's calls only, no cProfile, lines tagged with LABEL")
    parser.add_argument("--decode", action="store_true",
                        help="only decode steps (4k caches: batch 1 contiguous, page 16 and page 256; batch 8)")
    arguments = parser.parse_args()
    quick = arguments.quick
    label = None if quick is None else (quick + " " if quick else "")

    def timed(name, fn):
        report(name, fn, label)

    device, dtype = torch.device("cuda"), torch.bfloat16
    print(f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}, triton {triton.__version__}")
    if quick is None and not arguments.decode:
        launch_floors(device)
    with flashtile.use_backend("triton"):
        for d, h in ((128, 16), (64, 32)) if not arguments.decode else ():
            q, k, v = (torch.randn(16, 1024, h, d, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
            grad = torch.randn(16, 1024, h, d, device=device, dtype=dtype)

            def step():
                return torch.autograd.grad(flashtile.flash_attn_func(q, k, v, causal=True), (q, k, v), grad)

            timed(f"d {d}, {h} heads, 1k causal fwd+bwd", step)
            for schedule, launches in (((0, "two-launch"), (1, "one-launch")) if quick is None else ()):
                with flashtile.use_backend("triton", backward_schedule=schedule):
                    timed(f"d {d}, {h} heads, 1k causal fwd+bwd, {launches} backward", step)
            # the forward alone, causal and not: at 1k tokens a forward's kernels take about as long as issuing
            # the call, so these rows show which of the two sets the pace
            for causal in (True, False):
                with torch.no_grad():
                    timed(f"d {d}, {h} heads, 1k {'causal' if causal else 'non-causal'} forward alone",
                          lambda: flashtile.flash_attn_func(q, k, v, causal=causal))
        for batch, page in ((1, None), (1, 16), (1, 256), (8, None)) if arguments.decode else ((1, None),):
            timed(f"decode, batch {batch}, 4k cache{f', page {page}' if page else ''}", decode_step(batch, page))


def decode_step(batch: int, page: int | None):
    """One decode step against full 4k caches (32 query heads on 8 K/V heads, d 128, bf16): contiguous, or
    paged with the pages in order (the host's work does not depend on their order)."""
    device, dtype = torch.device("cuda"), torch.bfloat16
    q = torch.randn(batch, 1, 32, 128, device=device, dtype=dtype)
    k_cache, v_cache = (torch.randn(batch, 4096, 8, 128, device=device, dtype=dtype) for _ in range(2))
    lengths = torch.full((batch,), 4096, dtype=torch.int32, device=device)
    table = None
    if page:
        k_cache, v_cache = (t.view(-1, page, 8, 128) for t in (k_cache, v_cache))
        table = torch.arange(k_cache.shape[0], dtype=torch.int32, device=device).view(batch, -1)
    return lambda: flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, block_table=table)


if __name__ == "__main__":
    main()
