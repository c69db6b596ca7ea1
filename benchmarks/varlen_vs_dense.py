"""Packed variable-length batch against the dense kernel and against padding, on a GPU.

64 sequences with lengths drawn log-uniformly from 64..8192 (seeded), 16 heads of d = 128, bf16 (--sequences,
--min-len, --max-len, --heads, --headdim change them).
Rows (median of triton.testing.do_bench, forward and forward+backward, causal and not):
  varlen   flash_attn_varlen_func on the packed batch; FLOPs of the real tokens, sum_i 4 L_i^2 d H
  padded   flash_attn_func on the batch padded to the longest sequence; the same real FLOPs
           (the padding is wasted work), so its TFLOP/s is directly comparable
  dense    flash_attn_func on batch x 4096 with the same total tokens (the dense kernel's rate; with
           --equal-lengths, the same sequences as a dense batch)
Then, per mode, varlen / dense and varlen / padded.
With --bwd-tiles (backward configs in tune_triton.py's syntax, e.g. 32x64w4s3t1 or, with the dQ kernel's own
tile, 32x128w4s3t2q128x64w8) it then times the varlen
forward+backward under each of them, beside the dense rate measured above with the table's tiles; with
--fwd-tiles (forward configs, e.g. 128x128w8s3) the varlen forward likewise (--fwd-max-registers 128: under a
register cap; --dq-max-registers 128 likewise caps the dQ kernel under each --bwd-tiles config).
With --hints (comma-separated max_seqlen values, e.g. 2048,4096) it times the varlen forward and forward+
backward with that max_seqlen hint instead of the longest length: the grids then cover fewer blocks per
sequence and the programs of longer sequences loop (fewer programs that exit at once, longer ones in the tail).
With --equal-lengths every sequence has the mean length of the log-uniform draw (same sequence count,
about the same tokens) and "dense" is the same batch unpacked: what the varlen code path itself costs,
without short sequences beside long ones.

    python benchmarks/varlen_vs_dense.py [--bwd-tiles 64x128w8s3t1,32x64w4s3t1] [--equal-lengths]
"""

from __future__ import annotations

import argparse
import math

import torch
import triton
import triton.testing

import flashtile
from flashtile._measure import timed_kernels

from tune_triton import parse_bwd_config, parse_config


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sequences", type=int, default=64)
    parser.add_argument("--min-len", type=int, default=64)
    parser.add_argument("--max-len", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--headdim", type=int, default=128)
    parser.add_argument("--bwd-tiles", default="", help="comma-separated backward configs to time varlen under")
    parser.add_argument("--fwd-tiles", default="", help="comma-separated forward configs to time varlen under")
    parser.add_argument("--fwd-max-registers", type=int, default=0,
                        help="with --fwd-tiles: the TMA forward's register cap (forward_max_registers; 0 = none)")
    parser.add_argument("--dq-max-registers", type=int, default=0,
                        help="with --bwd-tiles: the dQ kernel's register cap (maxnreg) under each of them")
    parser.add_argument("--skip-padded", action="store_true", help="leave out the (slow) padded rows")
    parser.add_argument("--equal-lengths", action="store_true", help="every sequence of the draw's mean length")
    parser.add_argument("--hints", default="", help="comma-separated max_seqlen hints to time varlen under")
    args = parser.parse_args()
    device, dtype = torch.device("cuda"), torch.bfloat16
    generator = torch.Generator().manual_seed(0)
    logs = torch.empty(args.sequences).uniform_(math.log(args.min_len), math.log(args.max_len), generator=generator)
    lengths = logs.exp().round().long().tolist()
    if args.equal_lengths:
        lengths = [round(sum(lengths) / len(lengths))] * len(lengths)
    total, longest = sum(lengths), max(lengths)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=device)
    h, d = args.heads, args.headdim
    print(f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}, triton {triton.__version__}; "
          f"{args.sequences} sequences, {total} tokens, longest {longest}, {h} heads, d {d}, bf16")

    def randn(*shape):
        return torch.randn(*shape, device=device, dtype=dtype, requires_grad=True)

    q, k, v = randn(total, h, d), randn(total, h, d), randn(total, h, d)
    grad = torch.randn(total, h, d, device=device, dtype=dtype)
    padded = [randn(args.sequences, longest, h, d) for _ in range(3)]
    padded_grad = torch.randn(args.sequences, longest, h, d, device=device, dtype=dtype)
    # equal lengths: the dense batch is the same sequences unpacked, so the two differ only in the varlen code path
    dense_len = lengths[0] if args.equal_lengths else 4096
    dense_batch = len(lengths) if args.equal_lengths else max(1, total // 4096)
    dense = [randn(dense_batch, dense_len, h, d) for _ in range(3)]
    dense_grad = torch.randn(dense_batch, dense_len, h, d, device=device, dtype=dtype)

    for causal in (False, True):
        factor = 0.5 if causal else 1.0
        real_flops = sum(4 * n * n * d * h * factor for n in lengths)
        dense_flops = 4 * dense_batch * dense_len * dense_len * d * h * factor
        cases = {
            "varlen": (lambda: flashtile.flash_attn_varlen_func(q, k, v, cu, cu, longest, longest, causal=causal),
                       (q, k, v), grad, real_flops),
            **({} if args.skip_padded else {"padded": (lambda: flashtile.flash_attn_func(*padded, causal=causal),
                                                         padded, padded_grad, real_flops)}),
            "dense": (lambda: flashtile.flash_attn_func(*dense, causal=causal), dense, dense_grad, dense_flops),
        }
        rates = {}
        for mode, multiplier in (("fwd", 1.0), ("fwd+bwd", 3.5)):
            for name, (fn, inputs, g, flops) in cases.items():
                if mode == "fwd":
                    def step(fn=fn):
                        with torch.no_grad():
                            return fn()
                else:
                    def step(fn=fn, inputs=inputs, g=g):
                        return torch.autograd.grad(fn(), inputs, g)
                ms = bench(step)
                rates[name, mode] = multiplier * flops / ms / 1e9
                # each kernel's GPU time in one call: where the packed and dense batches differ
                kernels = [f"{name[:40]} {us / 1e3:.2f} ms" for name, us in timed_kernels(step, device)[:4]]
                print(f"causal={int(causal)} {mode:7s} {name:6s} {ms:8.3f} ms {rates[name, mode]:6.1f} TFLOP/s  "
                      f"{kernels}", flush=True)
            versus_padded = (f", varlen / padded {rates['varlen', mode] / rates['padded', mode]:.2f}x"
                             if "padded" in cases else "")
            print(f"causal={int(causal)} {mode:7s} varlen / dense {rates['varlen', mode] / rates['dense', mode]:.2f}x"
                  f"{versus_padded}", flush=True)
        fn, inputs, g, flops = cases["varlen"]
        for text in filter(None, args.fwd_tiles.split(",")):
            m, n, warps, stages, _ = parse_config(text)
            with flashtile.use_backend("triton", block_m=m, block_n=n, num_warps=warps, num_stages=stages,
                                       forward_max_registers=args.fwd_max_registers):
                with torch.no_grad():
                    ms = bench(fn)
            rate = flops / ms / 1e9
            cap = f" cap {args.fwd_max_registers}" if args.fwd_max_registers else ""
            print(f"causal={int(causal)} fwd     varlen forward {text:13s}{cap} {ms:8.3f} ms {rate:6.1f} TFLOP/s, "
                  f"{rate / rates['dense', 'fwd']:.2f}x dense", flush=True)
        for text in filter(None, args.bwd_tiles.split(",")):
            m, n, warps, stages, schedule, dq_m, dq_n, dq_warps = parse_bwd_config(text)
            # without a dQ tile the override leaves dQ on the dK/dV tile transposed (0 is not a tile setting)
            dq = dict(dq_block_m=dq_m, dq_block_n=dq_n, dq_num_warps=dq_warps) if dq_m else {}
            if args.dq_max_registers:
                dq["dq_max_registers"] = args.dq_max_registers
            with flashtile.use_backend("triton", bwd_block_m=m, bwd_block_n=n, bwd_num_warps=warps,
                                       bwd_num_stages=stages, backward_schedule=schedule, **dq):
                ms = bench(lambda: torch.autograd.grad(fn(), inputs, g))
                kernels = [f"{name[:40]} {us / 1e3:.2f} ms" for name, us in
                           timed_kernels(lambda: torch.autograd.grad(fn(), inputs, g), device)[:3]]
            rate = 3.5 * flops / ms / 1e9
            text += f" dq cap {args.dq_max_registers}" if args.dq_max_registers else ""
            print(f"causal={int(causal)} fwd+bwd varlen backward {text:13s} {ms:8.3f} ms {rate:6.1f} TFLOP/s, "
                  f"{rate / rates['dense', 'fwd+bwd']:.2f}x dense  {kernels}", flush=True)
        for hint in (int(h) for h in filter(None, args.hints.split(","))):
            def hinted(hint=hint):
                return flashtile.flash_attn_varlen_func(q, k, v, cu, cu, hint, hint, causal=causal)
            with torch.no_grad():
                forward_ms = bench(hinted)
            ms = bench(lambda: torch.autograd.grad(hinted(), (q, k, v), grad))
            forward_rate, rate = real_flops / forward_ms / 1e9, 3.5 * real_flops / ms / 1e9
            print(f"causal={int(causal)} varlen max_seqlen hint {hint:5d}: fwd {forward_ms:7.3f} ms "
                  f"{forward_rate:6.1f} TFLOP/s {forward_rate / rates['dense', 'fwd']:.3f}x dense; "
                  f"fwd+bwd {ms:7.3f} ms {rate:6.1f} TFLOP/s {rate / rates['dense', 'fwd+bwd']:.3f}x dense", flush=True)


if __name__ == "__main__":
    main()
