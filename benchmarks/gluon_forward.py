"""The Gluon Hopper forward (fwd_gluon.py) on an H200: correctness against the float64 oracle, bitwise reruns, and
times of its variants beside cuDNN, FA2 (SDPA's flash backend) and flashtile's Triton forward.

    python benchmarks/gluon_forward.py check [SETTINGS] [bf16]  # every option against the oracle (the 2x eager
                                                      # rule), packed and dense batches, in each setting (default:
                                                      # two consumers and three), fp16 and bf16 (or bf16 alone)
    python benchmarks/gluon_forward.py time [CELLS|all] [SETTINGS]  # the 12-cell grid (or CELLS like
                                                      # d128n4096c1,d64n1024c0), each setting (like c2s2o1p1);
                                                      # or groups "CELLS:SETTINGS;CELLS:SETTINGS" in one process
    python benchmarks/gluon_forward.py varlen [SETTINGS]  # packed batches of mixed lengths: the Gluon forward in
                                                      # each setting against the Triton forward, same call
    python benchmarks/gluon_forward.py reruns N [SETTING]  # N reruns of a few shapes: no NaN, no changed bit
    python benchmarks/gluon_forward.py reruns-packed N  # the same for a packed batch
    python benchmarks/gluon_forward.py reruns-table N CELLS  # N reruns of grid cells (like d64n1024c1) in the
                                                      # table's setting
    python benchmarks/gluon_forward.py small [SETTINGS]  # small cases of every setting (or of SETTINGS), for
                                                      # compute-sanitizer
    python benchmarks/gluon_forward.py compile-time   # the first call's wall time (with an empty Triton cache)
    python benchmarks/gluon_forward.py profile CELL WHAT  # one grid cell (like d64n1024c1) called 4 times, for a
                                                      # profiler: WHAT a setting, "table" (flashtile's choice) or
                                                      # "cudnn"

SETTINGS are comma-separated names c<consumers>s<stages>o<overlap>p<grid>[pp][n<keys>][e<n>][x1][h1], grid 0 one
CTA per tile, 1 persistent in snake order, 2 persistent with the launcher's deal, pp pingpong, n keys per block
(default 128), e one exponential in n on the FMA units, x1 the next tile's first block under each tile's last P V, h1
each tile's last block computed on its first half by the first consumer (two consumers, blocks of 128 keys, dense
calls whose band closes at the diagonal, seqlen_k - seqlen_q a multiple of 128; other calls skipped); e.g.
c2s2o1p1,c3s2o0p0,c2s2o0p1n256,c2s3o1p1e8,c2s2o1p2x1,c2s2o1p2x1h1.

Inputs are random from fixed seeds; times are triton.testing.do_bench medians in the FlashAttention benchmark
convention (16,384 tokens per batch, model width 2048; forward FLOPs 4 B H N^2 d, halved for causal).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import re
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


def gluon_packed(q, k, v, cu_q, cu_k, max_q, max_k, slopes=None, tile=launch.GluonTile(), **options):
    """The Gluon forward of a packed batch: q (total_q, heads, d), k / v (total_k, heads_k, d), cu_seqlens int32."""
    if slopes is not None and slopes.dim() == 1:
        slopes = slopes[None]
    problem = dataclasses.replace(problem_of(q[None, :max_q], k[None, :max_k], v[None, :max_k],
                                             alibi=slopes is not None, **options),
                                  batch=cu_q.numel() - 1, seqlen_q=max_q, seqlen_k=max_k, varlen=True,
                                  diagonal_offset=0)
    reason = launch.gluon_unserved(q[None], k[None], v[None], problem, tile)
    assert not reason, reason
    out, lse = launch.forward_gluon(q[None], k[None], v[None], slopes, problem, tile, cu_q, cu_k)
    return out[0], lse[0]


def _packed(lengths_q, lengths_k, heads, heads_k, d, dv, dtype, seed):
    generator = torch.Generator(device=DEVICE).manual_seed(seed)
    q = torch.randn(sum(lengths_q), heads, d, device=DEVICE, dtype=dtype, generator=generator)
    k = torch.randn(sum(lengths_k), heads_k, d, device=DEVICE, dtype=dtype, generator=generator)
    v = torch.randn(sum(lengths_k), heads_k, dv, device=DEVICE, dtype=dtype, generator=generator)
    cu = [torch.tensor([0] + list(itertools.accumulate(lengths)), device=DEVICE, dtype=torch.int32)
          for lengths in (lengths_q, lengths_k)]
    return q, k, v, cu[0], cu[1]


def _same_bits(a, b) -> bool:
    """Bitwise equality, NaN included (a poisoned sequence's own rows are NaN)."""
    return torch.equal(a.view(torch.int16) if a.element_size() == 2 else a.view(torch.int32),
                       b.view(torch.int16) if b.element_size() == 2 else b.view(torch.int32))


def check_packed_case(name, lengths_q, lengths_k, shape, tile, dtype, seed, slopes=None, poison=None,
                      **options) -> bool:
    """One packed batch against flash_attn_varlen_reference (the 2x eager rule), run twice bitwise. poison: the
    index of a sequence whose K and V are set to inf, which must reach no other sequence."""
    from flashtile.reference import flash_attn_varlen_reference

    heads, heads_k, d, dv = shape
    q, k, v, cu_q, cu_k = _packed(lengths_q, lengths_k, heads, heads_k, d, dv, dtype, seed)
    if poison is not None:
        rows = slice(cu_k[poison].item(), cu_k[poison + 1].item())
        k[rows] = float("inf")
        v[rows] = float("inf")
    try:
        out, lse = gluon_packed(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), slopes, tile, **options)
        again = gluon_packed(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), slopes, tile, **options)
        torch.cuda.synchronize()
    except Exception as error:  # noqa: BLE001 - every failure is reported
        print(f"{name}: {type(error).__name__}: {str(error).splitlines()[0][:300]}", flush=True)
        return False
    ref = dict(causal=options.get("causal", False), window_size=options.get("window", (-1, -1)),
               softcap=options.get("softcap", 0.0), alibi_slopes=slopes)
    want, want_lse = flash_attn_varlen_reference(q, k, v, cu_q, cu_k, **ref)
    eager, eager_lse = flash_attn_varlen_reference(q, k, v, cu_q, cu_k, dtype=dtype, **ref)
    keep = torch.ones(q.shape[0], dtype=torch.bool, device=DEVICE)
    if poison is not None:
        keep[cu_q[poison].item():cu_q[poison + 1].item()] = False
    failed = []
    if not (_same_bits(out, again[0]) and _same_bits(lse, again[1])):
        failed.append("rerun changed bits")
    out, want, eager = out[keep], want[keep], eager[keep]
    lse, want_lse, eager_lse = lse[:, keep], want_lse[:, keep], eager_lse[:, keep]
    floor = 2 * torch.finfo(dtype).eps * max(1.0, want.abs().max().item() if want.numel() else 1.0)
    if not torch.isfinite(out).all():
        failed.append("non-finite out")
    elif not _error(out, want) <= 2 * _error(eager, want) + floor:
        failed.append(f"out {_error(out, want):.2e} > 2 x {_error(eager, want):.2e}")
    finite = want_lse.isfinite()
    if not torch.equal(finite, lse.isfinite()):
        failed.append(f"lse -inf pattern ({(finite != lse.isfinite()).sum().item()} rows differ)")
    elif finite.any():
        e = _error(lse[finite], want_lse[finite])
        if not e <= 2 * _error(eager_lse.float()[finite], want_lse[finite]) + 1e-5 * want_lse[finite].abs().max():
            failed.append(f"lse {e:.2e}")
    print(f"{name}: {'ok' if not failed else 'FAILED ' + '; '.join(failed)}", flush=True)
    return not failed


# packed batches: every length ragged against the tiles, a sequence without keys or queries, one of a single key,
# long and short ones side by side (a tile of one runs past its end into the next)
PACKED_CASES = [
    ("mixed", [300, 1, 77, 1029, 64, 200], [300, 1, 77, 1029, 64, 200], (4, 2, 128, 128), {}),
    ("mixed causal", [300, 1, 77, 1029, 64, 200], [300, 1, 77, 1029, 64, 200], (4, 2, 128, 128), {"causal": True}),
    ("sq != sk causal, empty", [130, 0, 500, 7], [70, 33, 600, 0], (4, 4, 64, 64), {"causal": True}),
    ("d64 window", [513, 129, 1000], [513, 129, 1000], (8, 1, 64, 64), {"window": (100, 30)}),
    ("dv 64 d 128 softcap", [257, 191, 3], [300, 100, 5], (4, 2, 128, 64), {"softcap": 20.0}),
    ("d 96", [250, 61], [250, 61], (4, 4, 96, 96), {"causal": True}),
]


def _takes(tile, headdims, packed=False, banded=False, alibi=False) -> bool:
    """Whether the setting serves heads this wide (configs.gluon_unserved_reason): three consumers and blocks of 256
    keys take head dims up to 64, and three consumers no packed batch; one consumer (two CTAs per SM) up to 64, or
    128 with blocks of 64 keys; the next tile's first block under each tile's last P V takes head dims up to 128,
    dense batches without ALiBi or a band other than causal with every row seeing a key (`banded`: such a band); the
    first consumer's last block on its first half, dense batches (which of them: _half_admits)."""
    narrow = tile.consumers == 3 or tile.block_n == 256 or (tile.consumers == 1 and tile.block_n > 64)
    return not (narrow and max(headdims) > 64) and not (packed and tile.consumers == 3) and \
        not (tile.consumers == 1 and max(headdims) > 128) and \
        not (tile.across_tiles and (packed or banded or alibi or max(headdims) > 128)) and \
        not (tile.half_diagonal and packed)


def _half_admits(tile, q, k, v, **options) -> bool:
    """Whether the call admits the setting's first-consumer last block on its first half (gluon_half_diagonal: a band
    closing at the diagonal, seqlen_k - seqlen_q a multiple of 128, head dims up to 128; configs.
    gluon_unserved_reason); True for a setting without it."""
    return not tile.half_diagonal or not configs.gluon_unserved_reason(problem_of(q, k, v, **options), tile)


def check_packed(tiles, dtypes=(torch.bfloat16, torch.float16)) -> bool:
    ok = True
    for tile in tiles:
        for seed, (name, lengths_q, lengths_k, shape, options) in enumerate(PACKED_CASES):
            if not _takes(tile, shape[2:], packed=True):
                continue
            for dtype in dtypes:
                ok &= check_packed_case(f"{_name(tile)} packed {name} {dtype}", lengths_q, lengths_k, shape, tile,
                                        dtype, seed, **options)
        if not _takes(tile, (64,), packed=True):
            continue
        ok &= check_packed_case(f"{_name(tile)} packed alibi (nseq, nheads)", [300, 45, 700], [300, 45, 700],
                                (4, 4, 64, 64), tile, torch.bfloat16, 50,
                                slopes=torch.rand(3, 4, device=DEVICE), causal=True)
        # another sequence's infinite keys and values reach no other sequence (0 * inf)
        if not _takes(tile, (128,), packed=True):
            continue
        ok &= check_packed_case(f"{_name(tile)} packed inf next door", [100, 130, 70], [100, 130, 70],
                                (4, 4, 128, 128), tile, torch.bfloat16, 51, poison=1)
    return ok


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


def _name(tile) -> str:
    return (f"c{tile.consumers}s{tile.num_stages}o{int(tile.overlap)}"
            f"p{int(tile.persistent) + int(tile.persistent and tile.balanced)}" + ("pp" if tile.pingpong else "")
            + (f"n{tile.block_n}" if tile.block_n != G().block_n else "")
            + (f"e{tile.exp2_emulated}" if tile.exp2_emulated else "") + ("x1" if tile.across_tiles else "")
            + ("h1" if tile.half_diagonal else ""))


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
        # the diagonal offset by whole blocks of 128 keys, either way
        ("causal sq 256 sk 384", (2, 256, 384, 4, 4, 128, 128), dict(causal=True)),
        ("causal sq 640 sk 512 (masked rows)", (2, 640, 512, 4, 4, 64, 64), dict(causal=True)),
        # more tiles than SMs: a CTA takes several (with gluon_across_tiles, starting each under the last)
        ("many tiles: GQA 8:1 d 64", (8, 1000, 1000, 16, 2, 64, 64), dict()),
        ("many tiles: softcap, sq > sk, d 128", (4, 1500, 400, 16, 4, 128, 128), dict(softcap=30.0)),
        ("many tiles: dv 64 d 96", (4, 1000, 1000, 16, 16, 96, 64), dict()),
        ("many tiles: GQA 8:1 d 64 causal", (8, 1000, 1000, 16, 2, 64, 64), dict(causal=True)),
        ("many tiles: causal sq > sk (tiles that see no key)", (4, 1500, 400, 16, 4, 128, 128), dict(causal=True)),
        ("many tiles: window (200, 0)", (4, 1000, 1000, 16, 16, 96, 96), dict(window=(200, 0))),
    ]
    for tile in tiles:
        for dtype in dtypes:
            for i, (name, shape, options) in enumerate(cases):
                q, k, v = _inputs(*shape, dtype, seed=i)
                causal_unseen = options.get("causal", False) and shape[1] > shape[2]  # rows that see no key
                if not (_takes(tile, shape[5:], banded=causal_unseen or "window" in options)
                        and _half_admits(tile, q, k, v, **options)):
                    continue
                ok &= check_case(f"{_name(tile)} {dtype} {name}", q, k, v, tile=tile, **options)
        if _takes(tile, (128,), alibi=True) and not tile.half_diagonal:
            # ALiBi (per head and per batch entry)
            q, k, v = _inputs(2, 600, 700, 4, 4, 128, 128, torch.bfloat16, seed=100)
            ok &= check_case(f"{_name(tile)} alibi (nheads,)", q, k, v, torch.rand(4, device=DEVICE), tile=tile,
                             causal=True)
            ok &= check_case(f"{_name(tile)} alibi (batch, nheads)", q, k, v, torch.rand(2, 4, device=DEVICE),
                             tile=tile)
        if _takes(tile, (128,)) and not tile.half_diagonal:
            # large scores
            q, k, v = _inputs(2, 500, 1000, 4, 4, 128, 128, torch.bfloat16, seed=101, scale=30.0)
            ok &= check_case(f"{_name(tile)} |scores| ~ 1e3", q, k, v, tile=tile)
        # a late maximum (causal, 512 keys more than queries, for the first consumer's last block on its first half:
        # the last rows see it)
        q, k, v = _inputs(2, 500, 1012 if tile.half_diagonal else 1000, 4, 4, 64, 64, torch.float16, seed=102)
        k[:, -3:] = q[:, :1].mean(dim=1, keepdim=True).expand(-1, 3, -1, -1) * 8  # the largest scores in the last tile
        ok &= check_case(f"{_name(tile)} late maximum", q, k, v, tile=tile, causal=tile.half_diagonal)
    return ok


def _sdpa(backend):
    from torch.nn.attention import sdpa_kernel

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

    cudnn = _sdpa(SDPBackend.CUDNN_ATTENTION)
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
        row["cudnn"] = flops / _bench(lambda: cudnn(qt, kt, vt, causal)) / 1e9
        for tile in tiles:
            key = _name(tile)
            if configs.gluon_unserved_reason(problem, tile):
                continue  # e.g. three consumers (160 registers each) at d > 64
            try:
                row[key] = flops / _bench(lambda: gluon(q, k, v, tile=tile, causal=causal)) / 1e9
            except Exception as error:  # noqa: BLE001
                row[key] = f"{type(error).__name__}: {str(error)[:200]}"
        row["cudnn again"] = flops / _bench(lambda: cudnn(qt, kt, vt, causal)) / 1e9
        print(json.dumps({k: (round(v, 1) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)


def reruns(count: int, tile=launch.GluonTile()) -> bool:
    ok = True
    for seed, (shape, options) in enumerate([((4, 4096, 4096, 16, 16, 128, 128), dict(causal=True)),
                                             ((8, 1000, 1000, 16, 4, 64, 64), dict()),
                                             ((2, 2049, 3001, 8, 8, 128, 128), dict(window=(500, 10))),
                                             ((16, 1024, 1024, 16, 16, 64, 64), dict(causal=True)),
                                             ((8, 1000, 1100, 16, 4, 128, 128), dict(causal=True))]):
        q, k, v = _inputs(*shape, torch.bfloat16, seed=seed)
        if configs.gluon_unserved_reason(problem_of(q, k, v, **options), tile):
            continue
        out0, lse0 = gluon(q, k, v, tile=tile, **options)
        bad = 0
        start = time.time()
        for _ in range(count):
            out, lse = gluon(q, k, v, tile=tile, **options)
            if not (torch.equal(out, out0) and torch.equal(lse, lse0)):
                bad += 1
        torch.cuda.synchronize()
        nan = bool(torch.isnan(out0).any())
        print(f"reruns {_name(tile)} {shape} {options}: {count} runs, {bad} changed, nan {nan}, {time.time() - start:.1f} s",
              flush=True)
        ok &= bad == 0 and not nan
    return ok


def reruns_table(count: int, cells) -> bool:
    """`count` reruns of each grid cell (like d64n1024c1; the grid's shapes) in the setting the tile table takes for
    it: no NaN, no changed bit. The comparisons stay on the GPU (one synchronisation per 1,000 reruns)."""
    ok = True
    for seed, (d, n, causal) in enumerate(cells):
        batch, heads = 16384 // n, 2048 // d
        q, k, v = _inputs(batch, n, n, heads, heads, d, d, torch.bfloat16, seed=seed)
        problem = problem_of(q, k, v, causal=causal)
        tile = default_tiles(problem, (9, 0)).gluon_tile
        assert default_tiles(problem, (9, 0)).forward_schedule == 3, "the table runs the Triton forward here"
        out0, lse0 = gluon(q, k, v, tile=tile, causal=causal)
        changed = torch.zeros((), dtype=torch.int64, device=DEVICE)
        start = time.time()
        for i in range(count):
            out, lse = gluon(q, k, v, tile=tile, causal=causal)
            changed += (out.view(torch.int16) != out0.view(torch.int16)).any() | (
                lse.view(torch.int32) != lse0.view(torch.int32)).any()
            if i % 1000 == 999:
                torch.cuda.synchronize()
        bad = int(changed)
        nan = bool(torch.isnan(out0).any() or torch.isnan(lse0).any())
        print(f"reruns-table d{d}n{n}c{int(causal)} {_name(tile)}: {count} runs, {bad} changed, nan {nan}, "
              f"{time.time() - start:.1f} s", flush=True)
        ok &= bad == 0 and not nan
    return ok


def reruns_packed(count: int) -> bool:
    """`count` reruns of a packed batch (mixed lengths, d = 128, causal, the table's setting): no NaN, no changed
    bit."""
    lengths = [300, 1, 77, 1029, 64, 200, 2050, 513]
    q, k, v, cu_q, cu_k = _packed(lengths, lengths, 16, 4, 128, 128, torch.bfloat16, 7)
    out0, lse0 = gluon_packed(q, k, v, cu_q, cu_k, max(lengths), max(lengths), causal=True)
    bad = 0
    start = time.time()
    for _ in range(count):
        out, lse = gluon_packed(q, k, v, cu_q, cu_k, max(lengths), max(lengths), causal=True)
        if not (torch.equal(out, out0) and torch.equal(lse, lse0)):
            bad += 1
    torch.cuda.synchronize()
    nan = bool(torch.isnan(out0).any())
    print(f"reruns packed {lengths}: {count} runs, {bad} changed, nan {nan}, {time.time() - start:.1f} s", flush=True)
    return bad == 0 and not nan


def compile_time() -> None:
    """Wall time of the first call (Gluon's front end, ptxas, module load) and of the second, for the table's
    forward at d = 128 and d = 64: 4k keys causal (tiles dealt by the launcher), then 1k keys without a band (each
    tile started under the last one's P V); run with an empty TRITON_CACHE_DIR."""
    import flashtile

    for seqlen, causal in ((4096, True), (1024, False)):
        for headdim in (128, 64):
            q, k, v = _inputs(4, seqlen, seqlen, 2048 // headdim, 2048 // headdim, headdim, headdim, torch.bfloat16,
                              seed=0)
            times = []
            with flashtile.use_backend("triton"):
                kernel = flashtile.explain(q, k, v, causal=causal)
                for _ in range(2):
                    torch.cuda.synchronize()
                    start = time.perf_counter()
                    flashtile.flash_attn_func(q, k, v, causal=causal)
                    torch.cuda.synchronize()
                    times.append(time.perf_counter() - start)
            name = "attention_fwd_gluon_kernel" if "attention_fwd_gluon_kernel" in kernel else "another kernel"
            across = ", across tiles" if "next tile's first block" in kernel else ""
            print(f"d {headdim} {seqlen // 1024}k {'causal' if causal else 'non-causal'} ({name}{across}): first call "
                  f"{times[0]:.2f} s, second {times[1] * 1e3:.2f} ms", flush=True)


def profile(cell: str, what: str) -> None:
    """One grid cell's call, four times (a profiler skips the first ones): `what` a Gluon setting (as the timing
    rows name them), "table" (flashtile's own choice) or "cudnn" (SDPA's cuDNN backend)."""
    import flashtile
    from torch.nn.attention import SDPBackend

    (headdim, seqlen, causal), = _cells(cell)
    batch, heads = 16384 // seqlen, 2048 // headdim
    q, k, v = (torch.randn(batch, seqlen, heads, headdim, device=DEVICE, dtype=torch.bfloat16) for _ in range(3))
    if what == "cudnn":
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        run = lambda: _sdpa(SDPBackend.CUDNN_ATTENTION)(qt, kt, vt, causal)  # noqa: E731
    elif what == "table":
        def run():
            with flashtile.use_backend("triton"):
                return flashtile.flash_attn_func(q, k, v, causal=causal)
    else:
        tile, = _variants(what)
        run = lambda: gluon(q, k, v, tile=tile, causal=causal)  # noqa: E731
    for _ in range(4):
        run()
    torch.cuda.synchronize()
    print(f"profile {cell} {what}: done", flush=True)


def small(tiles=None) -> bool:
    """A few small cases in each setting of the Gluon forward (ragged ends, causal with masked rows, GQA, a window,
    ALiBi), each checked against the oracle: short enough for compute-sanitizer's memcheck and racecheck."""
    tiles = tiles or [G(), G(overlap=False), G(pingpong=True), G(persistent=False),
                      G(consumers=3, overlap=False, persistent=False), G(consumers=3), G(balanced=True),
                      G(block_n=256, overlap=False), G(across_tiles=True)]
    ok = True
    for t, tile in enumerate(tiles):
        # the fourth: 192 tiles of 70 keys each, more than the SMs, so that a CTA takes several; the last: causal
        # with the diagonal offset by a block of 128 keys
        for i, (shape, options) in enumerate([((1, 200, 150, 4, 2, 64, 64), dict(causal=True)),
                                               ((1, 130, 257, 2, 2, 128, 128), dict()),
                                               ((1, 100, 300, 2, 1, 128, 64), dict(window=(40, 20))),
                                               ((1, 300, 70, 64, 8, 64, 64), dict()),
                                               ((1, 256, 384, 2, 2, 64, 64), dict(causal=True))]):
            q, k, v = _inputs(*shape, torch.bfloat16, seed=10 * t + i)
            if not (_takes(tile, shape[5:], banded=bool(options)) and _half_admits(tile, q, k, v, **options)):
                continue
            ok &= check_case(f"small {tile} {shape} {options}", q, k, v, tile=tile, **options)
        if _takes(tile, (64,), alibi=True) and not tile.half_diagonal:
            q, k, v = _inputs(1, 90, 90, 2, 2, 64, 64, torch.float16, seed=100 + t)
            ok &= check_case(f"small {tile} alibi", q, k, v, torch.rand(2, device=DEVICE), tile=tile, causal=True)
        if _takes(tile, (64,), packed=True) and not tile.balanced and tile.consumers == 2:
            # the packed batches' settings
            ok &= check_packed_case(f"small {_name(tile)} packed", [70, 1, 150], [70, 5, 150], (2, 1, 64, 64), tile,
                                    torch.bfloat16, 200 + t, causal=True)
    return ok


G = launch.GluonTile


def _variants(text):
    """Settings named as in the timing rows, comma-separated (see the module's docstring)."""
    tiles = []
    for name in text.split(","):
        fields = {key: int(value) for key, value in re.findall(r"([a-z])(\d+)", name)}
        tiles.append(G(consumers=fields["c"], num_stages=fields["s"], overlap=bool(fields["o"]),
                       persistent=fields["p"] > 0, balanced=fields["p"] == 2, pingpong="pp" in name,
                       block_n=fields.get("n", G().block_n), exp2_emulated=fields.get("e", 0),
                       across_tiles=bool(fields.get("x", 0)), half_diagonal=bool(fields.get("h", 0))))
    return tiles


def varlen_timing(tiles) -> None:
    """Packed batches (16,384 tokens, lengths log-uniform in 64..4096, seeded), d = 64 and 128, causal or not: the
    Gluon forward in each setting against the Triton forward on the same call, TFLOP/s of the real tokens."""
    import math

    generator = torch.Generator().manual_seed(0)
    lengths = []
    while sum(lengths) < 16384:
        lengths.append(int(math.exp(math.log(64) + (math.log(4096) - math.log(64)) * torch.rand(1, generator=generator)
                                    .item())))
    for headdim in (128, 64):
        heads = 2048 // headdim
        q, k, v, cu_q, cu_k = _packed(lengths, lengths, heads, heads, headdim, headdim, torch.bfloat16, 1)
        for causal in (False, True):
            flops = sum(4 * n * n * headdim * heads * (0.5 if causal else 1.0) for n in lengths)
            problem = dataclasses.replace(problem_of(q[None, :max(lengths)], k[None, :max(lengths)],
                                                     v[None, :max(lengths)], causal=causal),
                                          batch=len(lengths), varlen=True, diagonal_offset=0)
            table = default_tiles(dataclasses.replace(problem, varlen=True), (9, 0))
            triton_tiles = dataclasses.replace(table, forward_schedule=1)
            row = {"d": headdim, "causal": causal, "sequences": len(lengths), "tokens": sum(lengths)}
            row["triton"] = flops / _bench(lambda: launch.forward(q[None], k[None], v[None], None, None, problem,
                                                                 triton_tiles, cu_q, cu_k)) / 1e9
            for tile in tiles:
                if configs.gluon_unserved_reason(problem, tile):
                    continue
                try:
                    row[_name(tile)] = flops / _bench(lambda: launch.forward_gluon(
                        q[None], k[None], v[None], None, problem, tile, cu_q, cu_k)) / 1e9
                except Exception as error:  # noqa: BLE001
                    row[_name(tile)] = f"{type(error).__name__}: {str(error)[:200]}"
            print(json.dumps({k: (round(v, 1) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)


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
        tiles = _variants(sys.argv[2]) if len(sys.argv) > 2 else [G(), G(consumers=3)]
        dtypes = (torch.bfloat16,) if sys.argv[3:] == ["bf16"] else (torch.bfloat16, torch.float16)
        ok = check_packed([tile for tile in tiles if not tile.balanced], dtypes)
        ok &= check(tiles, dtypes)
        sys.exit(0 if ok else 1)
    if mode == "varlen":
        varlen_timing(_variants(sys.argv[2]) if len(sys.argv) > 2 else [G(), G(num_stages=3), G(consumers=3)])
    if mode == "time" and ":" in sys.argv[2]:
        # groups CELLS:SETTINGS separated by ';', timed in one process
        for group in sys.argv[2].split(";"):
            cells, settings = group.split(":")
            timing(_cells(cells), _variants(settings))
    elif mode == "time":
        variants = _variants(sys.argv[3]) if len(sys.argv) > 3 else [
            G(overlap=False, persistent=False), G(persistent=False), G(), G(num_stages=3),
            G(num_stages=3, persistent=False), G(consumers=3), G(consumers=3, num_stages=3),
            G(consumers=3, persistent=False), G(consumers=3, overlap=False, persistent=False),
            G(balanced=True), G(balanced=True, overlap=False), G(consumers=3, balanced=True)]
        timing(_cells(sys.argv[2] if len(sys.argv) > 2 and sys.argv[2] != "all" else ""), variants)
    if mode == "small":
        sys.exit(0 if small(_variants(sys.argv[2]) if len(sys.argv) > 2 else None) else 1)
    if mode == "profile":
        profile(sys.argv[2], sys.argv[3])
    if mode == "reruns":
        sys.exit(0 if reruns(int(sys.argv[2]), *_variants(sys.argv[3])[:1] if len(sys.argv) > 3 else ()) else 1)
    if mode == "compile-time":
        compile_time()
    if mode == "reruns-table":
        sys.exit(0 if reruns_table(int(sys.argv[2]), _cells(sys.argv[3])) else 1)
    if mode == "reruns-packed":
        sys.exit(0 if reruns_packed(int(sys.argv[2])) else 1)
