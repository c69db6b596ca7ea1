"""What a feature costs on a GPU: the same call with and without it, bf16, random inputs from fixed seeds,
triton.testing.do_bench medians (warmup 25 ms, rep 200 ms), one JSON line per cell with the kernels explain() names.

    python benchmarks/feature_overhead.py sink      # learnable_sink in flash_attn_func: forward, forward + backward
    python benchmarks/feature_overhead.py dropout   # dropout_p = 0.1 against 0: forward, forward + backward
    python benchmarks/feature_overhead.py rotary    # a decode step of flash_attn_with_kvcache (one new token appended)
                                                    # with rotary tables against the same step without
    python benchmarks/feature_overhead.py all

Prefill cells take the grid's shapes (16,384 tokens per batch, model width 2048): d = 128 at 4k keys, causal and
not, and d = 64 at 1k causal. Decode cells: 32 query heads on 8 K/V heads, d = 128, caches of 4k and 32k keys.
"""

from __future__ import annotations

import json
import sys

import torch
import triton.testing

import flashtile

PREFILL_CELLS = ((128, 4096, False), (128, 4096, True), (64, 1024, True))
DECODE_CELLS = ((1, 32768), (8, 4096), (64, 4096))


def _ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=200)


def _tiles_line(explanation) -> str:
    """explain()'s line naming the kernels that run and their tiles."""
    return next((line for line in str(explanation).splitlines() if line.startswith("tiles:")), "")


def prefill(feature: str) -> None:
    """flash_attn_func with and without `feature` ("sink" or "dropout") in each prefill cell."""
    for d, n, causal in PREFILL_CELLS:
        torch.manual_seed(0)
        b, h = 16384 // n, 2048 // d
        q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        grad_out = torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16)
        with_it = ({"learnable_sink": torch.randn(h, device="cuda", requires_grad=True)} if feature == "sink"
                   else {"dropout_p": 0.1})
        row = {"feature": feature, "d": d, "n": n, "causal": causal}
        for name, options in (("without", {}), ("with", with_it)):
            def forward(options=options):
                return flashtile.flash_attn_func(q, k, v, causal=causal, **options)

            def both(forward=forward):
                torch.autograd.backward(forward(), grad_out)

            row[f"{name} fwd ms"] = _ms(forward)
            row[f"{name} fwd+bwd ms"] = _ms(both)
            row[f"{name} kernels"] = _tiles_line(flashtile.explain(q, k, v, causal=causal, **options))
        for part in ("fwd", "fwd+bwd"):
            row[f"cost {part} %"] = 100 * (row[f"with {part} ms"] / row[f"without {part} ms"] - 1)
        print(json.dumps({key: round(value, 4) if isinstance(value, float) else value for key, value in row.items()}),
              flush=True)


def rotary() -> None:
    """A decode step (one query token, one new key and value appended at cache_seqlens) with and without rotary
    tables (rotary_dim = d, GPT-NeoX's pairs), against a cache filled to `cache - 1` keys."""
    heads, heads_k, d = 32, 8, 128
    for batch, cache in DECODE_CELLS:
        torch.manual_seed(0)
        q = torch.randn(batch, 1, heads, d, device="cuda", dtype=torch.bfloat16)
        k_new, v_new = (torch.randn(batch, 1, heads_k, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        k_cache, v_cache = (torch.randn(batch, cache, heads_k, d, device="cuda", dtype=torch.bfloat16)
                            for _ in range(2))
        seqlens = torch.full((batch,), cache - 1, dtype=torch.int32, device="cuda")
        angles = torch.arange(cache, device="cuda")[:, None] * 10000.0 ** (
            -torch.arange(0, d, 2, device="cuda") / d)
        tables = {"rotary_cos": angles.cos(), "rotary_sin": angles.sin(), "rotary_interleaved": False}
        row = {"feature": "rotary", "batch": batch, "cache": cache}
        for name, options in (("without", {}), ("with", tables)):
            def step(options=options):
                return flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens,
                                                         causal=True, **options)

            row[f"{name} us"] = 1000 * _ms(step)
        row["cost %"] = 100 * (row["with us"] / row["without us"] - 1)
        print(json.dumps({key: round(value, 3) if isinstance(value, float) else value for key, value in row.items()}),
              flush=True)


def main(what: str) -> None:
    if what in ("sink", "all"):
        prefill("sink")
    if what in ("dropout", "all"):
        prefill("dropout")
    if what in ("rotary", "all"):
        rotary()
    if what not in ("sink", "dropout", "rotary", "all"):
        raise SystemExit(f"unknown feature {what!r}: sink, dropout, rotary or all")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "all")
