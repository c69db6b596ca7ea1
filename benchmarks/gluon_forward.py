"""The Gluon Hopper forward (fwd_gluon.py) on an H200: correctness against the float64 oracle, bitwise reruns, and
times of its variants beside cuDNN, FA2 (SDPA's flash backend) and flashtile's Triton forward.

    python benchmarks/gluon_forward.py check          # every option against the oracle (the 2x eager rule)
    python benchmarks/gluon_forward.py time [CELLS|all] [SETTINGS]  # the 12-cell grid (or CELLS like
                                                      # d128n4096c1,d64n1024c0), each setting (like c2s2o1p1,c3s2o0p0)
    python benchmarks/gluon_forward.py reruns N       # N reruns of a few shapes: no NaN, no changed bit
    python benchmarks/gluon_forward.py small          # small cases of every setting, for compute-sanitizer

Inputs are random from fixed seeds; times are triton.testing.do_bench medians in the FlashAttention benchmark
convention (16,384 tokens per batch, model width 2048; forward FLOPs 4 B H N^2 d, halved for causal).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import sys
import time

import torch
import triton
import triton.testing

from flashtile._validate import AttentionProblem
from flashtile.reference import flash_attn_reference
from flashtile.triton import launch
from flashtile.triton import configs
from flashtile.triton.configs import default_tiles

DEVICE = torch.device("cuda")


def problem_of(q, k, v, causal=False, window=(-1, -1), softcap=0.0, alibi=False, scale=None) -> AttentionProblem:
    batch, seqlen_q, nheads, headdim = q.shape
    seqlen_k, nheads_k, headdim_v = k.shape[1], k.shape[2], v.shape[3]
    left, right = window
    if causal:
        right = 0
    return AttentionProblem(batch=batch, nheads=nheads, nheads_k=nheads_k, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
                            headdim=headdim, headdim_v=headdim_v, dtype=q.dtype, device=q.device,
                            softmax_scale=scale or headdim ** -0.5, window_left=left, window_right=right,
                            diagonal_offset=seqlen_k - seqlen_q, alignment="bottom-right", softcap=softcap,
                            has_alibi=alibi, mask_kind=None)


def gluon(q, k, v, slopes=None, tile=launch.GluonTile(), **options):
    if slopes is not None and slopes.dim() == 1:
        slopes = slopes[None]  # the launchers take (batch or 1, nheads), as flashtile's validation hands them over
    problem = problem_of(q, k, v, alibi=slopes is not None, **options)
    reason = launch.gluon_unserved(q, k, v, problem, tile)
    assert not reason, reason
    return launch.forward_gluon(q, k, v, slopes, problem, tile)


def _error(a, b) -> float:
    return (a.double() - b.double()).abs().nan_to_num(nan=float("inf")).max().item() if a.numel() else 0.0


def check_case(name, q, k, v, slopes=None, tile=launch.GluonTile(), **options) -> bool:
    try:
        out, lse = gluon(q, k, v, slopes, tile, **options)
        torch.cuda.synchronize()
    except Exception as error:  # noqa: BLE001 - every failure is reported
        print(f"{name}: {type(error).__name__}: {str(error).splitlines()[0][:300]}", flush=True)
        return False
    ref_options = dict(causal=options.get("causal", False), window_size=options.get("window", (-1, -1)),
                       softcap=options.get("softcap", 0.0), alibi_slopes=slopes, softmax_scale=options.get("scale"))
    want, want_lse = flash_attn_reference(q, k, v, dtype=torch.float64, **ref_options)
    eager, eager_lse = flash_attn_reference(q, k, v, dtype=q.dtype, **ref_options)
    failed = []
    floor = 2 * torch.finfo(q.dtype).eps * max(1.0, want.abs().max().item() if want.numel() else 1.0)
    if not _error(out, want) <= 2 * _error(eager, want) + floor:
        failed.append(f"out {_error(out, want):.2e} > 2 x {_error(eager, want):.2e}")
    finite = want_lse.isfinite()
    if not torch.equal(finite, lse.isfinite()):
        failed.append(f"lse -inf pattern ({(finite != lse.isfinite()).sum().item()} rows differ)")
    else:
        e = _error(lse[finite], want_lse[finite])
        lse_floor = 1e-5 * max(1.0, want_lse[finite].abs().max().item() if finite.any() else 1.0)
        if not e <= 2 * _error(eager_lse.float()[finite], want_lse[finite]) + lse_floor:
            failed.append(f"lse {e:.2e}")
    if not torch.isfinite(out).all():
        failed.append("non-finite out")
    again, again_lse = gluon(q, k, v, slopes, tile, **options)
    if not (torch.equal(again, out) and torch.equal(again_lse, lse)):
        failed.append("rerun changed bits")
    print(f"{name}: {'ok' if not failed else 'FAILED ' + '; '.join(failed)}", flush=True)
    return not failed


def _inputs(batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, headdim_v, dtype, seed, scale=1.0):
    generator = torch.Generator(device=DEVICE).manual_seed(seed)
    q = torch.randn(batch, seqlen_q, nheads, headdim, device=DEVICE, dtype=dtype, generator=generator) * scale
    k = torch.randn(batch, seqlen_k, nheads_k, headdim, device=DEVICE, dtype=dtype, generator=generator)
    v = torch.randn(batch, seqlen_k, nheads_k, headdim_v, device=DEVICE, dtype=dtype, generator=generator)
    return q, k, v


def check(tiles=None, dtypes=(torch.bfloat16, torch.float16)) -> bool:
    tiles = tiles or [launch.GluonTile()]
    ok = True
    cases = []
    for (sq, sk), d, causal in itertools.product([(1, 1), (7, 7), (113, 113), (1023, 1023), (4097, 4097), (113, 1023),
                                                  (1023, 113), (1, 4097), (4097, 7)], (64, 128), (False, True)):
        cases.append((f"sq {sq} sk {sk} d {d} causal {causal}", (2, sq, sk, 4, 4, d, d), dict(causal=causal)))
    cases += [
        ("GQA 8:1 d 128 causal", (2, 1000, 1000, 16, 2, 128, 128), dict(causal=True)),
        ("MQA d 64", (2, 777, 900, 8, 1, 64, 64), dict()),
        ("dv 64 d 128", (2, 500, 600, 4, 4, 128, 64), dict(causal=True)),
        ("dv 128 d 64", (2, 500, 600, 4, 4, 64, 128), dict()),
        ("d 96 (pads to 128)", (2, 300, 301, 4, 4, 96, 96), dict(causal=True)),
        ("d 40 (pads to 64)", (2, 300, 301, 4, 4, 40, 40), dict()),
        ("d 256 (output staged in the query buffer), more tiles than SMs", (4, 1000, 1000, 8, 2, 256, 256),
         dict(causal=True)),
        ("window (100, 50)", (2, 1000, 1000, 4, 4, 128, 128), dict(window=(100, 50))),
        ("window (0, 0)", (2, 300, 300, 4, 4, 64, 64), dict(window=(0, 0))),
        ("window (-1, 20) sq < sk", (2, 200, 900, 4, 4, 128, 128), dict(window=(-1, 20))),
        ("window (30, -1)", (2, 600, 600, 4, 4, 64, 64), dict(window=(30, -1))),
        ("softcap 30", (2, 500, 500, 4, 4, 128, 128), dict(softcap=30.0, causal=True)),
        ("causal sq > sk (masked rows)", (2, 700, 300, 4, 4, 128, 128), dict(causal=True)),
        ("scale 0.5", (2, 300, 300, 4, 4, 64, 64), dict(scale=0.5)),
    ]
    for tile in tiles:
        for dtype in dtypes:
            for i, (name, shape, options) in enumerate(cases):
                q, k, v = _inputs(*shape, dtype, seed=i)
                ok &= check_case(f"{tile} {dtype} {name}", q, k, v, tile=tile, **options)
        # ALiBi (per head and per batch entry), large scores, a late maximum
        q, k, v = _inputs(2, 600, 700, 4, 4, 128, 128, torch.bfloat16, seed=100)
        ok &= check_case(f"{tile} alibi (nheads,)", q, k, v, torch.rand(4, device=DEVICE), tile=tile, causal=True)
        ok &= check_case(f"{tile} alibi (batch, nheads)", q, k, v, torch.rand(2, 4, device=DEVICE), tile=tile)
        q, k, v = _inputs(2, 500, 1000, 4, 4, 128, 128, torch.bfloat16, seed=101, scale=30.0)
        ok &= check_case(f"{tile} |scores| ~ 1e3", q, k, v, tile=tile)
        q, k, v = _inputs(2, 500, 1000, 4, 4, 64, 64, torch.float16, seed=102)
        k[:, -3:] = q[:, :1].mean(dim=1, keepdim=True).expand(-1, 3, -1, -1) * 8  # the largest scores in the last tile
        ok &= check_case(f"{tile} late maximum", q, k, v, tile=tile)
    return ok


def _sdpa(backend):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def run(q, k, v, causal):
        with sdpa_kernel([backend]):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return run


def _bench(fn) -> float:
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=25, rep=100)


def timing(cells, tiles) -> None:
    from torch.nn.attention import SDPBackend

    cudnn, flash = _sdpa(SDPBackend.CUDNN_ATTENTION), _sdpa(SDPBackend.FLASH_ATTENTION)
    a = torch.randn(8192, 8192, device=DEVICE, dtype=torch.bfloat16)
    ms = _bench(lambda: a @ a)
    print(json.dumps({"matmul_8192_tflops": round(2 * 8192 ** 3 / ms / 1e9, 1)}), flush=True)
    for headdim, seqlen, causal in cells:
        batch, heads = 16384 // seqlen, 2048 // headdim
        q, k, v = (torch.randn(batch, seqlen, heads, headdim, device=DEVICE, dtype=torch.bfloat16) for _ in range(3))
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))  # SDPA's (B, H, N, d) view of the same memory
        flops = 4 * batch * heads * seqlen * seqlen * headdim * (0.5 if causal else 1.0)
        row = {"d": headdim, "n": seqlen, "causal": causal}
        problem = problem_of(q, k, v, causal=causal)
        table = default_tiles(problem, (9, 0))
        row["cudnn"] = flops / _bench(lambda: cudnn(qt, kt, vt, causal)) / 1e9
        row["fa2"] = flops / _bench(lambda: flash(qt, kt, vt, causal)) / 1e9
        row["triton"] = flops / _bench(lambda: launch.forward(q, k, v, None, None, problem, table)) / 1e9
        for tile in tiles:
            key = (f"c{tile.consumers} s{tile.num_stages} o{int(tile.overlap)} "
                   f"p{int(tile.persistent) + int(tile.persistent and tile.balanced)} pp{int(tile.pingpong)}")
            if configs.gluon_unserved_reason(problem, tile):
                continue  # e.g. three consumers (160 registers each) at d > 64
            try:
                row[key] = flops / _bench(lambda: gluon(q, k, v, tile=tile, causal=causal)) / 1e9
            except Exception as error:  # noqa: BLE001
                row[key] = f"{type(error).__name__}: {str(error)[:200]}"
        print(json.dumps({k: (round(v, 1) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)


def reruns(count: int) -> bool:
    ok = True
    for seed, (shape, options) in enumerate([((4, 4096, 4096, 16, 16, 128, 128), dict(causal=True)),
                                             ((8, 1000, 1000, 16, 4, 64, 64), dict()),
                                             ((2, 2049, 3001, 8, 8, 128, 128), dict(window=(500, 10)))]):
        q, k, v = _inputs(*shape, torch.bfloat16, seed=seed)
        out0, lse0 = gluon(q, k, v, **options)
        bad = 0
        start = time.time()
        for _ in range(count):
            out, lse = gluon(q, k, v, **options)
            if not (torch.equal(out, out0) and torch.equal(lse, lse0)):
                bad += 1
        torch.cuda.synchronize()
        nan = bool(torch.isnan(out0).any())
        print(f"reruns {shape} {options}: {count} runs, {bad} changed, nan {nan}, {time.time() - start:.1f} s",
              flush=True)
        ok &= bad == 0 and not nan
    return ok


def small() -> bool:
    """A few small cases in each setting of the Gluon forward (ragged ends, causal with masked rows, GQA, a window,
    ALiBi), each checked against the oracle: short enough for compute-sanitizer's memcheck and racecheck."""
    tiles = [G(), G(overlap=False), G(pingpong=True), G(persistent=False),
             G(consumers=3, overlap=False, persistent=False), G(consumers=3), G(balanced=True)]
    ok = True
    for t, tile in enumerate(tiles):
        for i, (shape, options) in enumerate([((1, 200, 150, 4, 2, 64, 64), dict(causal=True)),
                                               ((1, 130, 257, 2, 2, 128, 128), dict()),
                                               ((1, 100, 300, 2, 1, 128, 64), dict(window=(40, 20)))]):
            if tile.consumers == 3 and max(shape[5:]) > 64:
                continue  # three consumers: a d <= 64 tile
            q, k, v = _inputs(*shape, torch.bfloat16, seed=10 * t + i)
            ok &= check_case(f"small {tile} {shape} {options}", q, k, v, tile=tile, **options)
        q, k, v = _inputs(1, 90, 90, 2, 2, 64, 64, torch.float16, seed=100 + t)
        ok &= check_case(f"small {tile} alibi", q, k, v, torch.rand(2, device=DEVICE), tile=tile, causal=True)
    return ok


G = launch.GluonTile


def _variants(text):
    """Settings named as in the timing rows, comma-separated: c<consumers>s<stages>o<overlap>p<grid>, grid 0 one CTA
    per tile, 1 persistent in snake order, 2 persistent with the launcher's deal; e.g. c2s2o1p1,c3s2o0p0."""
    tiles = []
    for name in text.split(","):
        consumers, stages, overlap, grid = (int(c) for c in name[1::2])
        tiles.append(G(consumers=consumers, num_stages=stages, overlap=bool(overlap), persistent=grid > 0,
                       balanced=grid == 2))
    return tiles


def _cells(text):
    if not text:
        return [(d, n, c) for d in (64, 128) for n in (1024, 4096, 16384) for c in (False, True)]
    cells = []
    for cell in text.split(","):
        d, rest = cell[1:].split("n")
        n, c = rest.split("c")
        cells.append((int(d), int(n), bool(int(c))))
    return cells


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "check":
        tiles = [launch.GluonTile(overlap=sys.argv[2] == "overlap")] if len(sys.argv) > 2 else None
        dtypes = (torch.bfloat16,) if len(sys.argv) > 3 else (torch.bfloat16, torch.float16)
        sys.exit(0 if check(tiles, dtypes) else 1)
    if mode == "time":
        variants = _variants(sys.argv[3]) if len(sys.argv) > 3 else [
            G(overlap=False, persistent=False), G(persistent=False), G(), G(num_stages=3),
            G(num_stages=3, persistent=False), G(consumers=3), G(consumers=3, num_stages=3),
            G(consumers=3, persistent=False), G(consumers=3, overlap=False, persistent=False),
            G(balanced=True), G(balanced=True, overlap=False), G(consumers=3, balanced=True)]
        timing(_cells(sys.argv[2] if len(sys.argv) > 2 and sys.argv[2] != "all" else ""), variants)
    if mode == "small":
        sys.exit(0 if small() else 1)
    if mode == "reruns":
        sys.exit(0 if reruns(int(sys.argv[2])) else 1)
