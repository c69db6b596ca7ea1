"""flash_attn_func at decode shapes (a few query rows against many keys, as transformers' generate calls it): the
table's choice (the decode kernels over k and v as a full cache, forward schedule 5) beside the Gluon forward (fa3)
and the Triton forward (fa2) forced, cuDNN and FA2 through SDPA, and flash_attn_with_kvcache on the same tensors.

    python benchmarks/decode_forward.py

bf16, random inputs from fixed seeds, no gradient; causal (bottom-right) unless the cell says otherwise. Per cell
and provider: the triton.testing.do_bench median of one call in µs (warmup 25 ms, rep 200 ms; a call whose host
work outlasts its kernels reads its host time), and the profiler's kernel time of one call in µs. One JSON line per
cell.
"""

from __future__ import annotations

import json

import torch
import triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashtile
from flashtile._measure import timed_kernels

DEVICE = torch.device("cuda")
# (batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, causal)
CELLS = ((1, 1, 600, 32, 8, 64, True), (1, 1, 4096, 32, 8, 64, True), (1, 1, 32768, 32, 8, 128, True),
         (16, 1, 4096, 32, 8, 128, True), (1, 4, 4096, 32, 8, 128, True), (1, 16, 4096, 32, 8, 128, True),
         (4, 16, 2048, 16, 16, 128, False), (1, 64, 4096, 8, 8, 128, True), (8, 8, 8192, 32, 8, 128, True))


def _us(fn) -> float:
    return 1000 * triton.testing.do_bench(fn, warmup=25, rep=200)


def _kernel_us(fn) -> float:
    return sum(us for _, us in timed_kernels(fn, DEVICE))


def main() -> None:
    for batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, causal in CELLS:
        generator = torch.Generator(device=DEVICE).manual_seed(0)
        q = torch.randn(batch, seqlen_q, nheads, headdim, device=DEVICE, dtype=torch.bfloat16, generator=generator)
        k, v = (torch.randn(batch, seqlen_k, nheads_k, headdim, device=DEVICE, dtype=torch.bfloat16,
                            generator=generator) for _ in range(2))
        row = {"batch": batch, "seqlen_q": seqlen_q, "seqlen_k": seqlen_k, "nheads": nheads, "nheads_k": nheads_k,
               "headdim": headdim, "causal": causal,
               "table": str(flashtile.explain(q, k, v, causal=causal)).splitlines()[0]}
        # the table's choice as a user's call makes it, without a backend context (whose entry and exit cost host time)
        providers = {"table": lambda: flashtile.flash_attn_func(q, k, v, causal=causal)}
        for name, settings in (("fa3", {"schedule": "fa3"}), ("fa2", {"schedule": "fa2"})):
            def call(settings=settings):
                with flashtile.use_backend("triton", **settings):
                    return flashtile.flash_attn_func(q, k, v, causal=causal)
            providers[name] = call
        providers["with_kvcache"] = lambda: flashtile.flash_attn_with_kvcache(q, k, v, cache_seqlens=seqlen_k,
                                                                              causal=causal)
        # SDPA's causal is top-left: the bottom-right band of one query row is no band at all; more rows take an
        # explicit bottom-right mask only where SDPA accepts it, so those cells time SDPA without the band
        sdpa_causal = causal and seqlen_q == seqlen_k
        for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa-flash", SDPBackend.FLASH_ATTENTION)):
            def sdpa(backend=backend):
                with sdpa_kernel([backend]):
                    return torch.nn.functional.scaled_dot_product_attention(
                        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=sdpa_causal,
                        enable_gqa=nheads != nheads_k)
            providers[name] = sdpa
        for name, fn in providers.items():
            try:
                fn()
                row[f"{name} us"] = round(_us(fn), 2)
                row[f"{name} kernel us"] = round(_kernel_us(fn), 2)
            except Exception as error:  # a peer that refuses the shape: reported, not fatal
                row[f"{name} us"] = f"{type(error).__name__}: {str(error)[:120]}"
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
