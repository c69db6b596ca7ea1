"""Ring attention in a group of one rank against flash_attn_func on one GPU: out, lse and the gradients of q, k, v
(through out and lse), max abs difference and whether bitwise equal.

With one piece a call (no window or ALiBi beside causal, or a contiguous shard) the ring runs the same kernels on the
same tensors as flash_attn_func and keeps the result unmerged, so every tensor is bitwise equal; with several pieces
(zigzag with a window, packed batches with windows) the pieces merge in float32 and differ by rounding.

    python benchmarks/ring_world1_check.py          # on a CUDA GPU (NCCL), bf16
"""

from __future__ import annotations


import torch
import torch.distributed as dist

import flashtile
from flashtile.distributed import ring_flash_attn_func, ring_flash_attn_varlen_func

from ring_attention import init_group

DENSE_CASES = [(4096, False, "contiguous", {}), (4096, True, "contiguous", {}), (4096, True, "zigzag", {}),
               (2048, True, "zigzag", {"window_size": (300, 0)}), (2048, False, "contiguous", {"alibi": True})]


def _compare(name, plain, ring) -> None:
    text = "; ".join(f"{what} {(a.float() - b.float()).abs().max().item():.3e}" + (" (bitwise)" if torch.equal(a, b)
                                                                                   else "")
                     for what, a, b in zip(("out", "lse", "dq", "dk", "dv"), plain, ring))
    print(f"{name}: {text}", flush=True)


def dense(device) -> None:
    gen = torch.Generator(device=device).manual_seed(0)
    for seqlen, causal, layout, options in DENSE_CASES:
        q, k, v, grad_out = (torch.randn(2, seqlen, 16, 128, device=device, dtype=torch.bfloat16, generator=gen)
                             for _ in range(4))
        grad_lse = torch.randn(2, 16, seqlen, device=device, generator=gen)
        kwargs = dict(options)
        if kwargs.pop("alibi", False):
            kwargs["alibi_slopes"] = torch.rand(16, device=device, generator=gen) * 0.1
        results = []
        for ring in (False, True):
            inputs = [t.detach().requires_grad_() for t in (q, k, v)]
            if ring:
                out, lse = ring_flash_attn_func(*inputs, causal=causal, layout=layout, return_lse=True, **kwargs)
            else:
                out, lse = flashtile.flash_attn_func(*inputs, causal=causal, return_lse=True, **kwargs)
            results.append((out, lse, *torch.autograd.grad((out, lse), inputs, (grad_out, grad_lse))))
        _compare(f"{seqlen} tokens, causal {causal}, {layout}, {sorted(kwargs)}", *results)


def packed(device) -> None:
    gen = torch.Generator(device=device).manual_seed(1)
    cu = torch.tensor([0, 1000, 1000, 3048, 4096], dtype=torch.int32, device=device)
    q, k, v, grad_out = (torch.randn(4096, 16, 128, device=device, dtype=torch.bfloat16, generator=gen)
                         for _ in range(4))
    slopes = torch.rand(4, 16, device=device, generator=gen) * 0.1   # a row per sequence
    options = dict(causal=True, window_size=(300, 0), alibi_slopes=slopes)
    results = []
    for ring in (False, True):
        inputs = [t.detach().requires_grad_() for t in (q, k, v)]
        if ring:
            out, lse = ring_flash_attn_varlen_func(*inputs, cu, 2048, layout="zigzag", return_lse=True, **options)
        else:
            out, lse = flashtile.flash_attn_varlen_func(*inputs, cu, cu, 2048, 2048, return_lse=True, **options)
        results.append((out, lse, *torch.autograd.grad(out, inputs, grad_out)))
    _compare("packed 1000/0/2048/1048 tokens, zigzag, causal, window 300, ALiBi per sequence", *results)


if __name__ == "__main__":
    created = init_group("cuda")
    try:
        dense("cuda")
        packed("cuda")
    finally:
        if created:
            dist.destroy_process_group()
