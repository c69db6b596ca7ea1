"""Where a 1k causal fwd+bwd step's host time goes, and whether the GPU waits for it, on a GPU.

For d 128 x 16 heads and d 64 x 32 heads (batch 16, 1k tokens, causal, bf16):
1. host us per step (lowest / median of 9 x 40 calls issued back to back) for flashtile, for flashtile with the
   autograd engine's multithreading off, for SDPA's flash backend (FA2) and for flashtile's forward alone, each
   with its do_bench median;
2. a timeline: perf_counter_ns taken around flashtile's pieces (validation, the autograd Function, the backend's
   forward and backward, every kernel launch), wrapped in place for this run only; each event's median offset
   from the step's start and the thread it ran on (main, or the autograd engine's device thread), for steps
   issued back to back and for steps after a 256 MB L2 flush (as do_bench times them);
3. the GPU side of do_bench-like steps under the profiler: the gaps between the flush, the forward kernel and
   the backward kernels (median over 18 steps). A gap near zero means the host kept ahead of the GPU.

    python benchmarks/host_timeline.py
"""
import statistics
import threading
import time

import torch
import triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashtile
import flashtile.autograd as fa
import flashtile.interface as fi
import flashtile.triton.launch as fl

events = []  # (label, perf_counter_ns, thread id)
on = [False]  # recording only inside the timed steps


def rec(name):
    if on[0]:
        events.append((name, time.perf_counter_ns(), threading.get_ident()))


def wrap(module, attr, label):
    orig = getattr(module, attr)

    def w(*a, **k):
        rec(label + ">")
        r = orig(*a, **k)
        rec(label + "<")
        return r
    setattr(module, attr, w)


orig_launch = fl.launch


def launch_w(kernel, *a, **k):
    name = getattr(getattr(kernel, "fn", kernel), "__name__", "k").replace("attention_", "")
    rec("L " + name + ">")
    r = orig_launch(kernel, *a, **k)
    rec("L " + name + "<")
    return r


def host_rounds(fn):
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(9):
        torch.cuda.synchronize()
        s = time.perf_counter()
        for _ in range(40):
            fn()
        out.append((time.perf_counter() - s) / 40 * 1e6)
        torch.cuda.synchronize()
    out.sort()
    return out[0], out[4]


flush = torch.empty(256 * 1024 * 1024 // 4, dtype=torch.int32, device="cuda")
for d, h in ((128, 16), (64, 32)):
    torch.manual_seed(0)
    q, k, v = (torch.randn(16, 1024, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    g = torch.randn(16, 1024, h, d, device="cuda", dtype=torch.bfloat16)
    qt, kt, vt, gt = (x.transpose(1, 2) for x in (q, k, v, g))

    def ours():
        return torch.autograd.grad(flashtile.flash_attn_func(q, k, v, causal=True), (q, k, v), g)

    def fa2():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            o = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
        return torch.autograd.grad(o, (qt, kt, vt), gt)

    def ours_st():
        with torch.autograd.set_multithreading_enabled(False):
            return ours()

    def fwd_only():
        with torch.no_grad():
            return flashtile.flash_attn_func(q, k, v, causal=True)

    with flashtile.use_backend("triton"):
        print(f"== d {d}, {h} heads, 1k causal fwd+bwd", flush=True)
        for name, fn in (("flashtile", ours), ("flashtile single-thread autograd", ours_st), ("fa2", fa2),
                         ("flashtile forward no-grad", fwd_only)):
            for rep in range(2):
                lo, med = host_rounds(fn)
                bench = triton.testing.do_bench(fn, warmup=25, rep=150, return_mode="median")
                print(f"{name}: host min {lo:.1f} med {med:.1f} us/step; do_bench median {bench * 1e3:.1f} us",
                      flush=True)
        # 2. instrumented timeline
        saved = (fl.launch, fa._gradients, fi.prepare_flash_attn, fi.attention, fa._run_forward, fa._run_backward)
        fl.launch = launch_w
        wrap(fa, "_gradients", "gradients")
        wrap(fi, "prepare_flash_attn", "prepare")
        wrap(fi, "attention", "attention")
        wrap(fa, "_run_forward", "run_forward")
        wrap(fa, "_run_backward", "run_backward")
        main_thread = threading.get_ident()
        for mode in ("back-to-back", "flush-between"):
            per = {}
            for i in range(60):
                if mode == "flush-between":
                    flush.zero_()
                events.clear()
                on[0] = True
                rec("step>")
                o = flashtile.flash_attn_func(q, k, v, causal=True)
                rec("fwd returned")
                torch.autograd.grad(o, (q, k, v), g)
                rec("grad returned")
                on[0] = False
                if mode == "flush-between" and i % 10 == 9:
                    torch.cuda.synchronize()
                if i < 10:
                    continue
                t0 = events[0][1]
                for j, (n, t, th) in enumerate(events):
                    per.setdefault((j, n, th == main_thread), []).append((t - t0) / 1e3)
            torch.cuda.synchronize()
            print(f"-- timeline ({mode}): median us from step start [thread]", flush=True)
            for (j, n, main), ts in sorted(per.items()):
                print(f"   {statistics.median(ts):8.1f}  {'main  ' if main else 'device'}  {n}")
        fl.launch, fa._gradients, fi.prepare_flash_attn, fi.attention, fa._run_forward, fa._run_backward = saved
        # 3. GPU gaps under the profiler, do_bench-like steps
        for name, fn in (("flashtile", ours), ("fa2", fa2)):
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(20):
                    flush.zero_()
                    fn()
                torch.cuda.synchronize()
            ks = sorted(((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                         if e.device_type == torch.autograd.DeviceType.CUDA), key=lambda x: x[0])
            steps, cur = [], None
            for s_, e_, n_ in ks:
                if "elementwise" in n_ and e_ - s_ > 40:  # the 256 MB flush, not FA2's dq accumulator fill
                    if cur:
                        steps.append(cur)
                    cur = [(s_, e_, "flush")]
                elif cur is not None:
                    cur.append((s_, e_, n_[:40]))
            if cur:
                steps.append(cur)
            gaps = {}
            for st in steps[2:]:
                for a, b in zip(st, st[1:]):
                    gaps.setdefault(f"{a[2]} -> {b[2]}", []).append(b[0] - a[1])
                for s_, e_, n_ in st:
                    gaps.setdefault(f"run {n_}", []).append(e_ - s_)
                gaps.setdefault("flush end -> last end", []).append(st[-1][1] - st[0][1])
            print(f"-- GPU, {name}: median us over {len(steps) - 2} steps", flush=True)
            for key, vals in gaps.items():
                print(f"   {key}: {statistics.median(vals):.1f} (min {min(vals):.1f}, max {max(vals):.1f}, n {len(vals)})")
