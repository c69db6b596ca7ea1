"""The Gluon backward kernels on an H200 (the dK/dV kernel, backward schedule 4, bwd_gluon.py; the fused backward,
schedule 5, bwd_gluon_fused.py): gradients against the float64 oracle with reruns, and backward times beside the
table's Triton backward, cuDNN and FA2 (SDPA's flash backend).

    python benchmarks/gluon_backward.py check          # small and ragged cases, bf16 and fp16, schedule 4 without
                                                       # and with the intra-warpgroup overlap (gluon_backward_overlap,
                                                       # where it serves the case) and schedule 5: dq, dk, dv (through
                                                       # out and lse) within 2x the eager error; a rerun bitwise equal
                                                       # (schedule 5: dk and dv; its dq's additions arrive in the copy
                                                       # engine's order, so whether dq's bits moved is reported);
                                                       # whether the settings give the same bits (reported)
    python benchmarks/gluon_backward.py time [CELLS]   # backward alone on the 12-cell grid (or CELLS like
                                                       # d128n4096c1,d64n1024c0): schedule 4 without and with the
                                                       # overlap, schedule 5, the table's schedule, cuDNN, FA2;
                                                       # TFLOP/s and the kernels' names from the profiler
    python benchmarks/gluon_backward.py reruns N [S]   # N forward + backward reruns of two shapes under schedule S
                                                       # (4 or 5, default 4): no NaN, no changed bit (schedule 5: in
                                                       # dk and dv; dq's changed reruns are counted apart)

Inputs are random from fixed seeds; times are triton.testing.do_bench medians of one torch.autograd.grad over a kept
graph, in the FlashAttention benchmark convention (16,384 tokens per batch, model width 2048; backward FLOPs 2.5 x
the forward's 4 B H N^2 d, halved for causal).
"""

from __future__ import annotations

import json
import sys
import warnings

import torch

import flashtile
from flashtile._measure import timed_kernels
from flashtile.reference import flash_attn_reference
from gluon_forward import _bench, _cells, _error  # the forward benchmark's timing, grid cells, error (this directory)

DEVICE = torch.device("cuda")
# (batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, headdim_v), options
CASES = {
    "d128 causal": ((2, 1024, 1024, 4, 4, 128, 128), {"causal": True}),
    "d64 GQA 4:1": ((2, 1024, 1024, 8, 2, 64, 64), {}),
    "d128 MQA causal sq < sk": ((1, 500, 1500, 8, 1, 128, 128), {"causal": True}),
    "d72 dv40 window": ((2, 777, 777, 4, 2, 72, 40), {"window_size": (100, 17)}),
    "d96 causal sq > sk (masked rows)": ((1, 1500, 400, 4, 2, 96, 96), {"causal": True}),
    "one key": ((2, 113, 1, 4, 4, 64, 64), {}),
    "one query causal": ((2, 1, 1023, 4, 4, 128, 128), {"causal": True}),
    "ragged 7 causal": ((3, 7, 7, 4, 2, 64, 64), {"causal": True}),
    "d64 dv128": ((2, 500, 600, 4, 4, 64, 128), {}),
    "|scores| ~ 1e3": ((1, 300, 700, 4, 4, 128, 128), {"scale_q": 30.0}),
}


def _inputs(shape, dtype, seed, scale_q=1.0):
    generator = torch.Generator(device=DEVICE).manual_seed(seed)
    batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, headdim_v = shape

    def make(*dims, scale=1.0):
        return (torch.randn(*dims, device=DEVICE, dtype=torch.float32, generator=generator) * scale).to(dtype)

    q = make(batch, seqlen_q, nheads, headdim, scale=scale_q)
    return (q.requires_grad_(), make(batch, seqlen_k, nheads_k, headdim).requires_grad_(),
            make(batch, seqlen_k, nheads_k, headdim_v).requires_grad_())


# (backward_schedule, gluon_backward_overlap, the name a row gives it, what explain() names where it serves the call)
SETTINGS = ((4, 0, "gluon", "attention_bwd_dkdv_gluon_kernel (Gluon"),
            (4, 1, "gluon overlap", "attention_bwd_dkdv_gluon_kernel (Gluon"),
            (5, 0, "fused", "attention_bwd_fused_gluon_kernel (Gluon"))
# the schedules whose dq is bitwise reproducible (schedule 5 adds dQ by TMA reduce, in the copy engine's order)
BITWISE_DQ = (4,)


def _grads(q, k, v, grad_out, grad_lse, options, schedule=None, overlap=0):
    """dq, dk, dv of <out, grad_out> + <lse, grad_lse> (rows that see no key left out of the lse term)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the opt-in schedule's warning
        if schedule is None:
            out, lse = flash_attn_reference(q, k, v, **options)
        else:
            with flashtile.use_backend("triton", backward_schedule=schedule, gluon_backward_overlap=overlap):
                out, lse = flashtile.flash_attn_func(q, k, v, return_lse=True, **options)
        lse = torch.where(lse.isfinite(), lse, torch.zeros_like(lse))
        loss = (out.double() * grad_out).sum() + (lse.double() * grad_lse).sum()
        return torch.autograd.grad(loss, (q, k, v))


def check() -> bool:
    ok = True
    for dtype in (torch.bfloat16, torch.float16):
        for seed, (name, (shape, options)) in enumerate(CASES.items()):
            options = dict(options)
            q, k, v = _inputs(shape, dtype, seed, options.pop("scale_q", 1.0))
            out = flash_attn_reference(q.detach(), k.detach(), v.detach(), **options)[0]
            grad_out = torch.randn(out.shape, device=DEVICE, dtype=torch.float64)
            grad_lse = torch.randn(out.shape[0], out.shape[2], out.shape[1], device=DEVICE, dtype=torch.float64)
            q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
            want = _grads(q64, k64, v64, grad_out, grad_lse, options)
            eager = _grads(q, k, v, grad_out, grad_lse, dict(options, dtype=dtype))
            results = {}
            for schedule, overlap, setting, kernel in SETTINGS:
                with flashtile.use_backend("triton", backward_schedule=schedule, gluon_backward_overlap=overlap):
                    text = flashtile.explain(q, k, v, **options)
                if kernel not in text:
                    # the overlap does not serve every case (configs.gluon_backward_unserved_reason says why)
                    print(f"{name} {dtype} {setting}: its Gluon kernel does not serve it: {text}", flush=True)
                    ok &= bool(overlap)
                    continue
                got = _grads(q, k, v, grad_out, grad_lse, options, schedule=schedule, overlap=overlap)
                again = _grads(q, k, v, grad_out, grad_lse, options, schedule=schedule, overlap=overlap)
                failed, notes = [], []
                for what, g, a, w, e in zip(("dq", "dk", "dv"), got, again, want, eager):
                    floor = 2 * torch.finfo(dtype).eps * max(1.0, w.abs().max().item() if w.numel() else 1.0)
                    if not _error(g, w) <= 2 * _error(e, w) + floor:
                        failed.append(f"{what} {_error(g, w):.2e} > 2 x {_error(e, w):.2e}")
                    if not torch.isfinite(g).all():
                        failed.append(f"{what} not finite")
                    if not torch.equal(g, a):
                        if what == "dq" and schedule not in BITWISE_DQ:
                            notes.append("dq's bits moved on a rerun")
                        else:
                            failed.append(f"{what}: a rerun changed bits")
                results[setting] = got
                if setting != "gluon" and "gluon" in results:
                    notes.append("bits as schedule 4 without overlap: " + ", ".join(
                        f"{what} {'same' if torch.equal(a, b) else 'differ'}"
                        for what, a, b in zip(("dq", "dk", "dv"), got, results["gluon"])))
                print(f"{name} {dtype} {setting}: {'ok' if not failed else 'FAILED ' + '; '.join(failed)}"
                      f"{''.join(', ' + note for note in notes)}", flush=True)
                ok &= not failed
    return ok


def timing(cells) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    a = torch.randn(8192, 8192, device=DEVICE, dtype=torch.bfloat16)
    print(json.dumps({"matmul_8192_tflops": round(2 * 8192 ** 3 / _bench(lambda: a @ a) / 1e9, 1)}), flush=True)
    warnings.simplefilter("ignore", RuntimeWarning)  # the opt-in schedule's warning
    for headdim, seqlen, causal in cells:
        batch, heads = 16384 // seqlen, 2048 // headdim
        q, k, v = (torch.randn(batch, seqlen, heads, headdim, device=DEVICE, dtype=torch.bfloat16,
                               requires_grad=True) for _ in range(3))
        grad_out = torch.randn(batch, seqlen, heads, headdim, device=DEVICE, dtype=torch.bfloat16)
        flops = 2.5 * 4 * batch * heads * seqlen * seqlen * headdim * (0.5 if causal else 1.0)
        row = {"d": headdim, "n": seqlen, "causal": causal}

        def backward_of(out):
            return lambda: torch.autograd.grad(out, (q, k, v), grad_out, retain_graph=True)

        for backend, name in ((SDPBackend.CUDNN_ATTENTION, "cudnn"), (SDPBackend.FLASH_ATTENTION, "fa2")):
            with sdpa_kernel([backend]):
                out = torch.nn.functional.scaled_dot_product_attention(
                    q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal).transpose(1, 2)
            row[name] = flops / _bench(backward_of(out)) / 1e9
        runs = [({}, "table", "")] + [({"backward_schedule": schedule, "gluon_backward_overlap": overlap}, setting,
                                        kernel) for schedule, overlap, setting, kernel in SETTINGS]
        for settings, name, kernel in runs:
            with flashtile.use_backend("triton", **settings):
                if settings and kernel not in flashtile.explain(q, k, v, causal=causal):
                    row[name] = "not served (explain() says why)"
                    continue
                out = flashtile.flash_attn_func(q, k, v, causal=causal)
                row[name] = flops / _bench(backward_of(out)) / 1e9
                row[f"{name} kernels"] = [kernel for kernel, _ in timed_kernels(backward_of(out), DEVICE)]
        print(json.dumps({key: (round(value, 1) if isinstance(value, float) else value)
                          for key, value in row.items()}), flush=True)


def reruns(count: int, schedule: int = 4) -> bool:
    """count forward + backward reruns of two shapes under backward `schedule` (4 or 5), each compared bitwise with
    the first (schedule 5: dk and dv; the reruns whose dq moved are counted apart)."""
    warnings.simplefilter("ignore", RuntimeWarning)  # the opt-in schedule's warning
    ok = True
    for shape, options in (((4, 4096, 4096, 16, 4, 128, 128), {"causal": True}), ((8, 2048, 2048, 32, 32, 64, 64), {})):
        q, k, v = _inputs(shape, torch.bfloat16, 0)
        grad_out = torch.randn(shape[0], shape[1], shape[3], shape[6], device=DEVICE, dtype=torch.bfloat16)
        with flashtile.use_backend("triton", backward_schedule=schedule):
            def run():
                out = flashtile.flash_attn_func(q, k, v, **options)
                return torch.autograd.grad(out, (q, k, v), grad_out)
            first = run()
            changed = dq_moved = nan = 0
            for _ in range(count):
                grads = run()
                bitwise = grads if schedule in BITWISE_DQ else grads[1:]
                changed += any(not torch.equal(a, b) for a, b in zip(bitwise, first[-len(bitwise):]))
                dq_moved += not torch.equal(grads[0], first[0])
                nan += any(not torch.isfinite(g).all() for g in grads)
        print(f"reruns schedule {schedule} {shape} {options}: {count}, {changed} differing"
              f"{'' if schedule in BITWISE_DQ else f' in dk or dv ({dq_moved} in dq)'}, {nan} with a non-finite value",
              flush=True)
        ok &= changed == 0 and nan == 0
    return ok


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "check":
        sys.exit(0 if check() else 1)
    if mode == "time":
        timing(_cells(sys.argv[2] if len(sys.argv) > 2 else ""))
    if mode == "reruns":
        sys.exit(0 if reruns(int(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else 4) else 1)
