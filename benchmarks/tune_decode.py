"""Where a decode call's time goes, and which decode-kernel geometry reads the cache fastest, on a GPU.

For each cell (batch x cache length, 32 query heads on 8 K/V heads, d 128, bf16, contiguous or paged):
  api      flashtile.flash_attn_with_kvcache as users call it (do_bench median: host work included)
  launch   flashtile.triton.decode.decode on an already validated call (no argument checks)
  host     microseconds of Python per API call (200 calls issued back to back, then one wait; only
           meaningful where the GPU is faster than the host, i.e. small caches)
  sdpa     torch SDPA's default on the same contiguous cache (do_bench median)
then (--variants) the decode kernel alone, replayed from a CUDA graph (triton.testing.do_bench_cudagraph),
for tile variants (keys per block, warps, pipeline stages) and split counts (multiples of the heuristic's),
or (--graphs) the API call and SDPA both replayed from CUDA graphs, as a serving loop runs them (where the
host time goes: benchmarks/host_overhead.py).

    python benchmarks/tune_decode.py --variants
    python benchmarks/tune_decode.py --graphs
    python benchmarks/tune_decode.py --variants --cells 8x131072x16,8x131072x256 \
        --tiles 128x4x2,128x4x3,128x8x2,256x8x2 --split-factors 1,2,3,4,6,8
(cells: batch x cache length x page size, 0 = contiguous; tiles: keys per block x warps x stages (a key block
larger than a page looks up each page it spans); split factors multiply the split count that two
waves of programs would give; --splits 40,49,64 times those split counts instead.)
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
import triton
import triton.testing

import flashtile
from flashtile._validate import prepare_kvcache
from flashtile.bench.decode import paged_cache
from flashtile.triton import decode as schedule

from host_overhead import host_ms  # the script beside this one

CELLS = [(1, 4096, 0), (1, 32768, 0), (1, 131072, 0), (8, 4096, 0), (8, 32768, 0), (8, 131072, 0),
         (64, 4096, 0), (64, 32768, 0), (8, 131072, 16), (8, 131072, 256), (1, 131072, 16)]
TILES = [schedule.DecodeTile(n, w, s, waves=2) for n, w, s in
         [(64, 4, 2), (64, 4, 3), (64, 4, 4), (64, 8, 3), (128, 4, 2), (128, 8, 3), (32, 4, 3), (16, 2, 8)]]
SPLIT_FACTORS = (1, 2, 4)


def parse_tile(text: str) -> schedule.DecodeTile:
    """BLOCK_NxWARPSxSTAGES."""
    block_n, warps, stages = (int(x) for x in text.split("x"))
    return schedule.DecodeTile(block_n, warps, stages, waves=2)


def graph_us(fn) -> float:
    return 1e3 * triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median")


def sweep_variants(call, batch: int, kv_bytes: int, tiles=TILES, split_factors=SPLIT_FACTORS, top: int = 4,
                   splits=()) -> None:
    auto = schedule.decode_geometry(call.problem, call.page_size, 0)
    results = []
    page = call.page_size
    # split counts: the given ones, else multiples of two waves'
    counts = [(t, None, n) for t in tiles for n in splits] or [(t, f, None) for t in tiles for f in split_factors]
    for tile, factor, count in counts:
        base = schedule.decode_geometry(call.problem, call.page_size, 0, tile)
        if count is None and factor > 1 and base.splits == 1 and batch * 8 >= 132:
            continue  # the heuristic's single split already fills the GPU
        geometry = schedule.decode_geometry(call.problem, call.page_size, count or base.splits * factor, tile)
        try:
            schedule.decode(call, 0, geometry)
            us = graph_us(lambda: schedule.decode(call, 0, geometry))
        except Exception as error:  # noqa: BLE001 - a variant that does not compile is reported and skipped
            print(f"    {geometry.describe()}: {type(error).__name__}: {str(error)[:120]}")
            continue
        results.append((us, geometry))
    results.sort(key=lambda item: item[0])
    default = [(us, g) for us, g in results if g == auto][:1]  # absent when the tiles swept exclude it
    for us, geometry in results[:top] + default:
        mark = " (default)" if geometry == auto else ""
        print(f"    kernel {us:8.1f} us {kv_bytes / us / 1e3:6.0f} GB/s  block_n {geometry.block_n:3d} "
              f"warps {geometry.num_warps} stages {geometry.num_stages} splits {geometry.splits:3d}{mark}",
              flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--variants", action="store_true", help="sweep decode tiles and split counts")
    parser.add_argument("--graphs", action="store_true", help="API and SDPA replayed from CUDA graphs; host profile")
    parser.add_argument("--cells", default="", help="BATCHxLENGTHxPAGE,... (default: the built-in list)")
    parser.add_argument("--tiles", default="", help="BLOCK_NxWARPSxSTAGES,... for --variants")
    parser.add_argument("--split-factors", default="", help="comma-separated multiples of the two-wave split count")
    parser.add_argument("--splits", default="", help="comma-separated split counts (instead of --split-factors)")
    parser.add_argument("--top", type=int, default=4, help="variants printed per cell, fastest first")
    args = parser.parse_args()
    cells = [tuple(int(x) for x in c.split("x")) for c in args.cells.split(",") if c] or CELLS
    tiles = [parse_tile(t) for t in args.tiles.split(",") if t] or TILES
    factors = tuple(int(f) for f in args.split_factors.split(",") if f) or SPLIT_FACTORS
    splits = tuple(int(n) for n in args.splits.split(",") if n)
    device, dtype = torch.device("cuda"), torch.bfloat16
    print(f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}, triton {triton.__version__}; "
          "32 query heads / 8 K/V heads, d 128, bf16")
    for batch, length, page in cells:
        q = torch.randn(batch, 1, 32, 128, device=device, dtype=dtype)
        k = torch.randn(batch, length, 8, 128, device=device, dtype=dtype)
        v = torch.randn(batch, length, 8, 128, device=device, dtype=dtype)
        lengths = torch.full((batch,), length, dtype=torch.int32, device=device)
        k, v, table = paged_cache(k, v, page) if page else (k, v, None)
        kv_bytes = 2 * batch * length * 8 * 128 * 2

        def api():
            return flashtile.flash_attn_with_kvcache(q, k, v, cache_seqlens=lengths, block_table=table)

        call = prepare_kvcache(q, k, v, None, None, lengths, table, softmax_scale=None, causal=False,
                               window_size=(-1, -1), softcap=0.0, alibi_slopes=None, num_splits=0,
                               return_softmax_lse=False)
        with flashtile.use_backend("triton"):
            api()
            ms_api = triton.testing.do_bench(api, warmup=25, rep=100, return_mode="median")
            host_us = 1e3 * host_ms(api, calls=200)
        ms_launch = triton.testing.do_bench(lambda: schedule.decode(call, 0), warmup=25, rep=100, return_mode="median")
        line = (f"batch {batch:3d} cache {length:6d} page {page:3d}: api {ms_api * 1e3:8.1f} us "
                f"({kv_bytes / ms_api / 1e6:6.0f} GB/s)  launch {ms_launch * 1e3:8.1f} us  host {host_us:6.1f} us/call")
        if not page:
            qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
            ms_sdpa = triton.testing.do_bench(lambda: F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True),
                                              warmup=25, rep=100, return_mode="median")
            line += f"  sdpa {ms_sdpa * 1e3:8.1f} us ({kv_bytes / ms_sdpa / 1e6:6.0f} GB/s)"
        print(line, flush=True)
        if args.variants:
            sweep_variants(call, batch, kv_bytes, tiles, factors, args.top, splits)
        if args.graphs:
            with flashtile.use_backend("triton"):
                line = f"    from CUDA graphs: flashtile {graph_us(api):8.1f} us"
            if not page:
                line += f"  sdpa {graph_us(lambda: F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)):8.1f} us"
            print(line, flush=True)
        del q, k, v, call


if __name__ == "__main__":
    main()
