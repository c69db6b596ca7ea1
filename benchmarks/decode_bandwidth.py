"""KV-cache decoding bandwidth on a GPU: flashtile's split-KV kernel beside torch SDPA on the same inputs.

One query token per sequence, 32 query heads on 8 K/V heads, d = 128, bf16; batch in {1, 8, 64},
cache length in {4k, 32k, 128k} (cells above --max-cache-gib of K+V are skipped); contiguous
and paged caches (page 16 and 256, pages in shuffled order). Achieved bandwidth = bytes of K and V
read (batch x length x 8 heads x 128 x 2 bytes x 2) / median time (triton.testing.do_bench).
SDPA runs on the contiguous cache (its default backend choice, GQA enabled); the executed kernels
are printed for both.

    python benchmarks/decode_bandwidth.py
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
import triton
import triton.testing

import flashtile
from flashtile._measure import executed_kernels


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", default="1,8,64")
    parser.add_argument("--lengths", default="4096,32768,131072")
    parser.add_argument("--max-cache-gib", type=float, default=40.0)
    args = parser.parse_args()
    device, dtype = torch.device("cuda"), torch.bfloat16
    heads, kv_heads, d = 32, 8, 128
    print(f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}, triton {triton.__version__}")
    for batch in (int(x) for x in args.batches.split(",")):
        for length in (int(x) for x in args.lengths.split(",")):
            kv_bytes = 2 * batch * length * kv_heads * d * 2
            if kv_bytes > args.max_cache_gib * 2**30:
                print(f"B{batch} L{length}: skipped ({kv_bytes / 2**30:.0f} GiB of K+V > --max-cache-gib)")
                continue
            q = torch.randn(batch, 1, heads, d, device=device, dtype=dtype)
            k = torch.randn(batch, length, kv_heads, d, device=device, dtype=dtype)
            v = torch.randn(batch, length, kv_heads, d, device=device, dtype=dtype)
            seqlens = torch.full((batch,), length, dtype=torch.int32, device=device)
            qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

            def sdpa():
                return F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)

            ms = triton.testing.do_bench(sdpa, warmup=25, rep=100, return_mode="median")
            peer = kv_bytes / ms / 1e6
            print(f"B{batch} L{length} sdpa (contiguous)     {ms:8.3f} ms {peer:7.0f} GB/s  "
                  f"{executed_kernels(sdpa, device, limit=3)}", flush=True)
            reference = sdpa().transpose(1, 2)
            for page in (None, 16, 256):
                if page is None:
                    k_cache, v_cache, table = k, v, None
                else:
                    pages = length // page
                    order = torch.randperm(batch * pages, device=device)
                    table = order.view(batch, pages).to(torch.int32)
                    k_cache = torch.empty(batch * pages, page, kv_heads, d, device=device, dtype=dtype)
                    v_cache = torch.empty_like(k_cache)
                    k_cache[order] = k.view(batch * pages, page, kv_heads, d)
                    v_cache[order] = v.view(batch * pages, page, kv_heads, d)

                def ours():
                    return flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens,
                                                             block_table=table)

                with flashtile.use_backend("triton"):
                    error = (ours().float() - reference.float()).abs().max().item()
                    ms = triton.testing.do_bench(ours, warmup=25, rep=100, return_mode="median")
                    names = executed_kernels(ours, device, limit=3)
                rate = kv_bytes / ms / 1e6
                label = "contiguous" if page is None else f"page {page}"
                print(f"B{batch} L{length} flashtile ({label:10s}) {ms:8.3f} ms {rate:7.0f} GB/s = "
                      f"{rate / peer:.2f}x sdpa, max |diff| vs sdpa {error:.1e}  {names}", flush=True)
                del k_cache, v_cache


if __name__ == "__main__":
    main()
