"""GPU checks of robustness, run by benchmarks/gpu_checks.sh on an H200 (or any CUDA GPU).

    python benchmarks/gpu_checks.py seqlen-one   # flash-attn's one-query / one-key shapes, fp16 fwd+bwd, oracle
    python benchmarks/gpu_checks.py memcheck     # small padded-head-dim cases for compute-sanitizer memcheck
    python benchmarks/gpu_checks.py timing LABEL # the kernels' times at a few grid cells (A/B of two trees)

Every case draws random inputs from a fixed seed and compares the outputs and gradients with the float64
oracle under the eager rule (2 x the error of the same formula in the input dtype + 2 ulp): a line per case,
"ok" or the first line of the error it raised.
"""

from __future__ import annotations

import sys
import traceback

import torch
import triton
import triton.testing

import flashtile
from flashtile.reference import flash_attn_reference, flash_attn_varlen_reference

DEVICE = torch.device("cuda")


def _error(a, b) -> float:
    return (a.double() - b.double()).abs().nan_to_num(nan=float("inf")).max().item() if a.numel() else 0.0


def _check(got, want, eager, dtype) -> list[str]:
    """Names of the tensors past the eager rule (lse: its finite entries)."""
    failed = []
    for what, g, w, e in zip(("out", "lse", "dq", "dk", "dv"), got, want, eager):
        if what == "lse":
            finite = w.isfinite()
            if not torch.equal(finite, g.isfinite()):
                failed.append("lse (where -inf)")
                continue
            g, w, e = g[finite], w[finite], e[finite]
        floor = 2 * torch.finfo(dtype).eps * max(1.0, w.double().abs().max().item() if w.numel() else 1.0)
        if not _error(g, w) <= 2 * _error(e, w) + floor:
            failed.append(f"{what} {_error(g, w):.2e} > 2 x {_error(e, w):.2e}")
    return failed


def _run(call, reference, inputs, grad_seed=1):
    """(out, lse, dq, dk, dv) of call() and of reference(dtype) in float64 and eagerly in the inputs' dtype."""
    results = []
    for fn in (call, lambda: reference(torch.float64), lambda: reference(inputs[0].dtype)):
        out, lse = fn()
        generator = torch.Generator(device=DEVICE).manual_seed(grad_seed)
        grad = torch.randn(out.shape, device=DEVICE, generator=generator, dtype=torch.float64)
        grads = torch.autograd.grad((out.double() * grad).sum(), inputs)
        results.append((out, lse, *grads))
    return results


def _case(name: str, call, reference, inputs) -> bool:
    try:
        got, want, eager = _run(call, reference, inputs)
        failed = _check(got, want, eager, inputs[0].dtype)
    except Exception as error:  # noqa: BLE001 - every failure is reported, with its first line
        first = next((line for line in str(error).splitlines() if line.strip()), "")
        print(f"{name}: {type(error).__name__}: {first[:300]}", flush=True)
        traceback.print_exc(limit=3, file=sys.stderr)
        return False
    print(f"{name}: {'ok' if not failed else 'FAILED ' + ', '.join(failed)}", flush=True)
    return not failed


def _dense(batch, seqlen_q, seqlen_k, nheads, headdim, dtype, seed, alibi=False, **kwargs):
    torch.manual_seed(seed)
    q, k, v = (torch.randn(batch, n, nheads, headdim, device=DEVICE, dtype=dtype, requires_grad=True)
               for n in (seqlen_q, seqlen_k, seqlen_k))
    if alibi:
        kwargs["alibi_slopes"] = torch.rand(nheads, device=DEVICE)
    return (lambda: flashtile.flash_attn_func(q, k, v, return_lse=True, **kwargs),
            lambda dtype: flash_attn_reference(q, k, v, dtype=dtype, **kwargs), (q, k, v))


def seqlen_one() -> bool:
    """The shapes on which flash-attn's own suite saw ptxas crash (fp16, forward + backward; test_gpu.py covers
    one query or one key at every head dim, fp16 and bf16)."""
    shapes = [(239, 1, 40, False), (239, 1, 80, False), (239, 1, 96, False), (239, 1, 128, False),
              (239, 1, 40, True), (1, 1, 16, True), (1, 1, 32, True), (1, 1, 64, True)]
    ok = True
    for seqlen_q, seqlen_k, headdim, causal in shapes:
        name = f"fp16 seqlen_q {seqlen_q} seqlen_k {seqlen_k} d {headdim} causal {causal}"
        ok &= _case(name, *_dense(4, seqlen_q, seqlen_k, 6, headdim, torch.float16, seed=headdim, causal=causal))
    return ok


def memcheck() -> bool:
    """Padded head dims (the kernels' tiles are wider than d), ALiBi, causal, q / k / v as views of one packed
    tensor (flash-attn's qkv-packed and kv-packed layouts), packed sequences: small shapes, fp16."""
    ok = True
    dtype = torch.float16
    for headdim, causal, alibi in ((160, True, True), (160, False, False), (96, True, True), (40, False, True),
                                   (72, True, False), (192, True, True), (256, True, False), (128, False, True)):
        torch.manual_seed(headdim)
        qkv = torch.randn(2, 200, 3, 4, headdim, device=DEVICE, dtype=dtype, requires_grad=True)
        q, k, v = qkv.unbind(2)  # strided views, as flash_attn_qkvpacked_func passes them
        kwargs = {"causal": causal, "alibi_slopes": torch.rand(4, device=DEVICE) if alibi else None}
        ok &= _case(f"qkv-packed views seqlen 200 d {headdim} causal {causal} alibi {alibi}",
                    lambda: flashtile.flash_attn_func(q, k, v, return_lse=True, **kwargs),
                    lambda dt: flash_attn_reference(q, k, v, dtype=dt, **kwargs), (qkv,))
    torch.manual_seed(0)
    q = torch.randn(1, 150, 4, 160, device=DEVICE, dtype=dtype, requires_grad=True)
    kv = torch.randn(1, 233, 2, 2, 160, device=DEVICE, dtype=dtype, requires_grad=True)
    k, v = kv.unbind(2)
    kwargs = {"causal": True, "alibi_slopes": torch.rand(4, device=DEVICE)}
    ok &= _case("kv-packed views seqlen 150 / 233 d 160 GQA causal alibi",
                lambda: flashtile.flash_attn_func(q, k, v, return_lse=True, **kwargs),
                lambda dt: flash_attn_reference(q, k, v, dtype=dt, **kwargs), (q, kv))
    lengths = [(37, 50), (1, 7), (200, 200), (0, 5), (90, 13)]
    cu_q, cu_k = (torch.tensor([0] + torch.tensor([p[i] for p in lengths]).cumsum(0).tolist(), device=DEVICE,
                               dtype=torch.int32) for i in (0, 1))
    for headdim in (160, 72):
        torch.manual_seed(headdim)
        qkv = torch.randn(int(cu_q[-1]), 3, 4, headdim, device=DEVICE, dtype=dtype)
        q = qkv[:, 0].detach().requires_grad_()
        k, v = (torch.randn(int(cu_k[-1]), 4, headdim, device=DEVICE, dtype=dtype, requires_grad=True)
                for _ in range(2))
        kwargs = {"causal": True, "alibi_slopes": torch.rand(4, device=DEVICE)}
        ok &= _case(f"packed sequences d {headdim} causal alibi",
                    lambda: flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 200, 200, return_lse=True,
                                                             **kwargs),
                    lambda dt: flash_attn_varlen_reference(q, k, v, cu_q, cu_k, dtype=dt, **kwargs), (q, k, v))
    return ok


def timing(label: str) -> bool:
    """Forward, backward and decode times at a few cells (bf16; 16k tokens per batch, width 2048): do_bench
    medians, for two source trees run one after the other."""
    for headdim, seqlen, causal in ((128, 4096, True), (128, 1024, False), (64, 1024, True), (64, 16384, False)):
        batch, heads = 16384 // seqlen, 2048 // headdim
        q, k, v = (torch.randn(batch, seqlen, heads, headdim, device=DEVICE, dtype=torch.bfloat16,
                               requires_grad=True) for _ in range(3))
        grad = torch.randn_like(q)
        out = flashtile.flash_attn_func(q, k, v, causal=causal)
        forward = triton.testing.do_bench(lambda: flashtile.flash_attn_func(q, k, v, causal=causal), warmup=25,
                                          rep=200, return_mode="median")
        backward = triton.testing.do_bench(lambda: torch.autograd.grad(out, (q, k, v), grad, retain_graph=True),
                                           warmup=25, rep=200, return_mode="median")
        flops = 4 * batch * heads * seqlen * seqlen * headdim * (0.5 if causal else 1.0)
        print(f"{label} d{headdim} N{seqlen} causal {int(causal)}: forward {forward * 1e3:8.1f} us "
              f"({flops / forward / 1e9:5.1f} TFLOP/s), backward {backward * 1e3:8.1f} us "
              f"({2.5 * flops / backward / 1e9:5.1f})", flush=True)
    for batch, cache in ((1, 32768), (64, 4096)):
        k_cache, v_cache = (torch.randn(batch, cache, 8, 128, device=DEVICE, dtype=torch.bfloat16) for _ in range(2))
        query = torch.randn(batch, 1, 32, 128, device=DEVICE, dtype=torch.bfloat16)
        lengths = torch.full((batch,), cache, device=DEVICE, dtype=torch.int32)
        def step():
            return flashtile.flash_attn_with_kvcache(query, k_cache, v_cache, cache_seqlens=lengths)

        step()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        us = triton.testing.do_bench(graph.replay, warmup=25, rep=200, return_mode="median") * 1e3
        print(f"{label} decode {batch} x {cache}: {us:7.1f} us ({2 * k_cache.numel() * 2 / us / 1e3:6.0f} GB/s, "
              f"graph replay)", flush=True)
    return True


if __name__ == "__main__":
    stage = sys.argv[1]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
          f"flashtile from {flashtile.__file__}", flush=True)
    passed = {"seqlen-one": seqlen_one, "memcheck": memcheck,
              "timing": lambda: timing(sys.argv[2] if len(sys.argv) > 2 else "run")}[stage]()
    sys.exit(0 if passed else 1)
