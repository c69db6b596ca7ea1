"""Where the backward's time goes on a GPU: per-kernel times, and each backward kernel's own tile sweep.

For each shape of the FlashAttention benchmark convention (16k tokens per batch, model width 2048,
bf16) this prints
1. the CUDA time of every kernel of one forward + backward (torch.profiler, mean of 5 calls);
2. the backward's time (median of triton.testing.do_bench) when only the dK/dV kernel, or only
   the dQ kernel, runs with another tile configuration than the table's.
The kernels are re-launched with the overriding constexprs through a stand-in for the kernel object,
so the library itself is unchanged. Used to choose the backward rows of src/flashtile/triton/configs.py.

    python benchmarks/profile_backward.py --headdim 64,128 --seqlens 4096,16384
    --dkdv 32x128w4s3,64x128w8s2 --dq 64x32w4s3,128x32w4s3   (BLOCK_M x BLOCK_N, warps, stages)
"""

from __future__ import annotations

import argparse
import collections
import re

import torch
import triton
import triton.testing

import flashtile
from flashtile._dispatch import BACKENDS
from flashtile._validate import prepare_flash_attn
from flashtile.iomodel import AttentionShape, benchmark_flops
from flashtile.triton import launch


def parse(text: str) -> tuple[int, int, int, int]:
    match = re.fullmatch(r"(\d+)x(\d+)w(\d+)s(\d+)", text)
    if not match:
        raise ValueError(f"config {text!r} is not of the form 64x32w4s3")
    return tuple(int(x) for x in match.groups())


class Relaunch:
    """Stands in for a Triton kernel: launches it with other tiles, recomputing its programs per (batch, head) (the
    scalar argument `programs_arg`) and the one-axis grid."""

    def __init__(self, kernel, config: tuple[int, int, int, int], length_arg: str, programs_arg: str):
        self.kernel, self.config, self.length_arg, self.programs_arg = kernel, config, length_arg, programs_arg

    def __getitem__(self, grid):
        def launch_with(*args, **kwargs):
            block_m, block_n, warps, stages = self.config
            names, args = self.kernel.arg_names, list(args)
            rows = block_n if self.length_arg == "seqlen_k" else block_m  # dK/dV programs own key blocks
            count = names.index(self.programs_arg)
            pairs = grid[0] // args[count]  # (batch, head) pairs: the grid is programs x pairs
            args[count] = triton.cdiv(args[names.index(self.length_arg)], rows)
            kwargs.update(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages)
            return self.kernel[(args[count] * pairs,)](*args, **kwargs)
        return launch_with


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--headdim", default="64,128")
    parser.add_argument("--seqlens", default="4096,16384")
    parser.add_argument("--causal", default="both", choices=("both", "yes", "no"))
    parser.add_argument("--dkdv", default="32x128w4s3,32x64w4s3,64x128w8s2,64x64w4s3,16x128w4s3")
    parser.add_argument("--dq", default="64x32w4s3,128x32w4s3,128x32w8s3,128x64w8s2,64x64w4s3,128x32w4s5")
    args = parser.parse_args()
    device = torch.device("cuda")
    print(f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}, triton {triton.__version__}")
    causals = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    for headdim in (int(d) for d in args.headdim.split(",")):
        for seqlen in (int(n) for n in args.seqlens.split(",")):
            batch, heads = 16384 // seqlen, 2048 // headdim
            q, k, v = (torch.randn(batch, seqlen, heads, headdim, device=device, dtype=torch.bfloat16,
                                   requires_grad=True) for _ in range(3))
            grad = torch.randn_like(q)
            for causal in causals:
                call = prepare_flash_attn(q, k, v, dropout_p=0.0, softmax_scale=None, causal=causal,
                                          window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                                          return_attn_probs=False, return_lse=False)
                tiles = BACKENDS["triton"].choose_tiles(call.problem, {})
                flops = benchmark_flops(AttentionShape(batch=batch, nheads=heads, seqlen_q=seqlen, seqlen_k=seqlen,
                                                       headdim=headdim, causal=causal), "bwd")
                tag = f"d{headdim} N{seqlen} B{batch} H{heads} causal={int(causal)}"

                def step():
                    torch.autograd.grad(flashtile.flash_attn_func(q, k, v, causal=causal), (q, k, v), grad)

                step()
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                    for _ in range(5):
                        step()
                    torch.cuda.synchronize()
                totals = collections.Counter()
                for event in prof.events():
                    if event.device_type == torch.autograd.DeviceType.CUDA:
                        totals[event.name] += event.device_time / 5
                shares = ", ".join(f"{name} {us:.0f} us" for name, us in totals.most_common(6))
                print(f"{tag}: per fwd+bwd call {shares}", flush=True)

                with torch.no_grad():
                    out, lse = launch.forward(call.q, call.k, call.v, None, None, call.problem, tiles)

                def backward():
                    launch.backward(grad, None, call.q, call.k, call.v, out, lse, None, None, call.problem, tiles)

                base = triton.testing.do_bench(backward, warmup=25, rep=100, return_mode="median")
                print(f"{tag}: backward with the table's tiles {base:.3f} ms = {flops / base / 1e9:.0f} "
                      f"TFLOP/s ({tiles.describe(call.problem)})", flush=True)
                for kind, configs, name, length_arg, programs_arg in (
                        ("dkdv", args.dkdv, "attention_bwd_dkdv_kernel", "seqlen_k", "key_programs"),
                        ("dq", args.dq, "attention_bwd_dq_kernel", "seqlen_q", "query_programs")):
                    original = getattr(launch, name)
                    for text in filter(None, configs.split(",")):
                        setattr(launch, name, Relaunch(original, parse(text), length_arg, programs_arg))
                        try:
                            ms = triton.testing.do_bench(backward, warmup=25, rep=100, return_mode="median")
                            print(f"{tag}: {kind} {text}: backward {ms:.3f} ms = {flops / ms / 1e9:.0f} "
                                  f"TFLOP/s ({base / ms:.2f}x the table)", flush=True)
                        except Exception as error:  # a config that does not compile (shared memory) is skipped
                            print(f"{tag}: {kind} {text}: failed ({type(error).__name__}: "
                                  f"{str(error).splitlines()[0][:100]})", flush=True)
                        finally:
                            setattr(launch, name, original)


if __name__ == "__main__":
    main()
