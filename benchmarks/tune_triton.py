"""Time the Triton kernels under several tile configurations beside cuDNN and FA2 (SDPA), on a GPU.

For each shape of the FlashAttention benchmark convention (16k tokens per batch, model width
2048, bf16) and each candidate config, prints forward and forward+backward TFLOP/s (median of
triton.testing.do_bench) and the ratio to the peers measured in the same run. Used to fill the
table in src/flashtile/triton/configs.py; the benchmark of record is `flashtile bench`.

    python benchmarks/tune_triton.py --headdim 128 --seqlens 4096,16384 --configs 128x64w8s3,128x128w8s2
Config syntax: {BLOCK_M}x{BLOCK_N}w{warps}s{stages}[t{schedule}] for the forward (schedule 0: pointer
loads, 1: TMA descriptors, 2: TMA + warp specialization; default 0); the backward keeps its default
unless --bwd-configs is given (same syntax; there t is the backward schedule: 0 two launches, 1 the
dK/dV and dQ programs in one launch, 2 and 3 the same with TMA loads; a suffix q{M}x{N}w{warps} gives the dQ
kernel of schedules 0 and 2 its own tile, e.g. 32x128w4s3t0q128x64w8).
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import time

import torch
import torch.nn.functional as F
import triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashtile
from flashtile._measure import executed_kernels
from flashtile._validate import prepare_flash_attn
from flashtile._dispatch import BACKENDS
from flashtile.iomodel import AttentionShape, benchmark_flops


def parse_config(text: str) -> tuple[int, int, int, int, int]:
    match = re.fullmatch(r"(\d+)x(\d+)w(\d+)s(\d+)(?:t(\d))?", text)
    if not match:
        raise ValueError(f"config {text!r} is not of the form 128x64w8s3 or 128x64w4s2t2")
    return tuple(int(x or 0) for x in match.groups())


def parse_bwd_config(text: str) -> tuple[int, ...]:
    """A backward config, optionally with the dQ kernel's own tile: 32x128w4s3t0 or 32x128w4s3t0q128x64w8."""
    tile, _, dq = text.partition("q")
    match = re.fullmatch(r"(\d+)x(\d+)w(\d+)", dq) if dq else None
    if dq and not match:
        raise ValueError(f"dQ tile {dq!r} (after 'q') is not of the form 128x64w8")
    return parse_config(tile) + (tuple(int(x) for x in match.groups()) if match else (0, 0, 0))


def tflops(ms: float, batch: int, heads: int, seqlen: int, headdim: int, causal: bool, mode: str) -> float:
    shape = AttentionShape(batch=batch, nheads=heads, seqlen_q=seqlen, seqlen_k=seqlen, headdim=headdim, causal=causal)
    return benchmark_flops(shape, mode) / ms / 1e9


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--headdim", default="64,128")
    parser.add_argument("--seqlens", default="1024,4096,16384")
    parser.add_argument("--causal", default="both", choices=("both", "yes", "no"))
    parser.add_argument("--modes", default="fwd,fwd+bwd")
    parser.add_argument("--configs", default="", help="comma-separated forward configs; empty = the table's")
    parser.add_argument("--bwd-configs", default="", help="comma-separated backward configs; empty = the table's")
    parser.add_argument("--peers", default="cudnn,flash")
    args = parser.parse_args()
    device = torch.device("cuda")
    print(f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}, triton {triton.__version__}")
    causals = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    modes = args.modes.split(",")
    fwd_configs = [parse_config(c) for c in args.configs.split(",") if c]
    bwd_configs = [parse_bwd_config(c) for c in args.bwd_configs.split(",") if c]
    peers = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}
    peers = {name: peers[name] for name in args.peers.split(",") if name}

    for headdim in (int(d) for d in args.headdim.split(",")):
        for seqlen in (int(n) for n in args.seqlens.split(",")):
            batch, heads = 16384 // seqlen, 2048 // headdim
            q, k, v = (torch.randn(batch, seqlen, heads, headdim, device=device, dtype=torch.bfloat16,
                                   requires_grad=True) for _ in range(3))
            grad = torch.randn_like(q)
            start = time.perf_counter()
            torch.autograd.grad(flashtile.flash_attn_func(q, k, v, causal=True), (q, k, v), grad)
            torch.cuda.synchronize()
            print(f"  d{headdim} N{seqlen}: first causal fwd+bwd call (compiles the four kernels unless "
                  f"TRITON_CACHE_DIR holds them) {time.perf_counter() - start:.1f} s", flush=True)
            for causal in causals:
                # the table's tiles for this problem (causal and not differ), then each config in their place
                call = prepare_flash_attn(q, k, v, dropout_p=0.0, softmax_scale=None, causal=causal,
                                          window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                                          return_attn_probs=False, return_lse=False)
                default = BACKENDS["triton"].choose_tiles(call.problem, {})
                candidates = [default]
                for bm, bn, w, s, schedule in fwd_configs:
                    # the table's register cap belongs to its own forward tile
                    candidates.append(dataclasses.replace(default, block_m=bm, block_n=bn, num_warps=w, num_stages=s,
                                                          forward_schedule=schedule, forward_max_registers=0))
                for bm, bn, w, s, schedule, dq_m, dq_n, dq_w in bwd_configs:
                    candidates.append(dataclasses.replace(default, bwd_block_m=bm, bwd_block_n=bn, bwd_num_warps=w,
                                                          bwd_num_stages=s, backward_schedule=schedule,
                                                          dq_block_m=dq_m, dq_block_n=dq_n, dq_num_warps=dq_w))
                for mode in modes:
                    def step(fn):
                        if mode == "fwd":
                            return lambda: fn()
                        return lambda: torch.autograd.grad(fn(), (q, k, v), grad)

                    peer_rates = {}
                    for name, sdpa_backend in peers.items():
                        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))

                        def sdpa(b=sdpa_backend):
                            with sdpa_kernel(b):  # back to (batch, seqlen, heads, dim) so dO fits
                                return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal).transpose(1, 2)

                        try:
                            peer_rates[name] = tflops(bench(step(sdpa)), batch, heads, seqlen, headdim, causal, mode)
                        except RuntimeError as error:
                            print(f"  {name}: not run ({str(error).splitlines()[0][:80]})")
                    for tiles in candidates:
                        overrides = dataclasses.asdict(tiles)

                        def ours():
                            with flashtile.use_backend("triton", **overrides):
                                return flashtile.flash_attn_func(q, k, v, causal=causal)

                        try:
                            rate = tflops(bench(step(ours)), batch, heads, seqlen, headdim, causal, mode)
                        except Exception as error:  # noqa: BLE001 - e.g. a tile that needs more shared memory
                            print(f"  {tiles}: not run ({type(error).__name__}: {str(error).splitlines()[0][:100]})")
                            continue
                        ratios = " ".join(f"{rate / r:.2f}x {n}" for n, r in peer_rates.items())
                        dq = f"q{tiles.dq_block_m}x{tiles.dq_block_n}w{tiles.dq_num_warps}" if tiles.dq_block_m else ""
                        cap = f"r{tiles.forward_max_registers}" if tiles.forward_max_registers else ""
                        print(f"d{headdim} N{seqlen} B{batch} H{heads} causal={int(causal)} {mode:7s} "
                              f"fwd {tiles.block_m}x{tiles.block_n}w{tiles.num_warps}s{tiles.num_stages}t{tiles.forward_schedule}{cap} "
                              f"bwd {tiles.bwd_block_m}x{tiles.bwd_block_n}w{tiles.bwd_num_warps}s{tiles.bwd_num_stages}"
                              f"t{tiles.backward_schedule}{dq}: "
                              f"{rate:6.1f} TFLOP/s | peers " + " ".join(f"{n} {r:.0f}" for n, r in peer_rates.items())
                              + f" | {ratios}", flush=True)
            names = executed_kernels(lambda: torch.autograd.grad(flashtile.flash_attn_func(q, k, v, causal=True),
                                                                 (q, k, v), grad), device, limit=6)
            print(f"  kernels (fwd+bwd, causal): {names}")


if __name__ == "__main__":
    main()
