"""Ring attention (flashtile.distributed.ring_flash_attn_func) against plain flash_attn_func on one device.

Every rank holds seqlen_local tokens of a sequence of W * seqlen_local tokens. For each cell (seqlen_local, causal,
layout) the script first checks that the ring's output equals plain attention over the whole sequence (max abs
error of this rank's rows, the largest over the ranks; it stops when over --atol), then times, after --warmup
calls, --reps calls each of:

    ring    ring_flash_attn_func over the W ranks (forward, or forward + backward through out)
    plain   flashtile.flash_attn_func on the whole W * seqlen_local sequence on one device (every rank runs the
            same one; no communication)

and prints one JSON line per cell and mode with the medians in ms (the slowest rank's median for the ring), and
ratio = ring_ms / plain_ms. With --rounds R the two are timed in turns R times and the medians of the R medians are
reported. With W = 1 the ring communicates nothing and the ratio is its own overhead (the
float32 merge and the recomputation in the backward); with W ranks, ideal work sharing gives 1 / W.

    torchrun --nproc-per-node 8 benchmarks/ring_attention.py            # 8 GPUs, NCCL
    python benchmarks/ring_attention.py                                 # 1 GPU (a 1-process group of its own)
    python benchmarks/ring_attention.py --seqlens 4096 --layouts zigzag --causal true --modes fwd
    python benchmarks/ring_attention.py --device cpu --seqlens 64 --heads 2 --headdim 16 --reps 2
                                                                        # CPU smoke run (gloo, float32)

Defaults: batch 1, 16 heads (--kv-heads for GQA), d = 128, bf16 on CUDA (float32 on CPU), seqlen_local 4096,
16384 and 65536, causal and not, contiguous and zigzag, modes fwd and fwd_bwd, 3 warm-up calls and 10 timed ones.
The timing uses CUDA events around each of the calls, run back to back and synchronised once at the end (as
triton's do_bench times them), with the same number of calls on every rank (do_bench picks its repetition count
from its own timings, which can differ between ranks and then leave a rank waiting in the ring forever).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist

import flashtile
from flashtile.distributed import LAYOUTS, contiguous_shard, ring_flash_attn_func, zigzag_shard

# NVLink multicast (NVLS) stays off: the ring needs only point-to-point transfers. NCCL reads this when a
# communicator is created, which happens after this line (torch.distributed creates them lazily).
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

SHARD = {"contiguous": contiguous_shard, "zigzag": zigzag_shard}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cuda: NCCL, one GPU per rank (LOCAL_RANK); cpu: gloo, for a smoke run")
    parser.add_argument("--seqlens", default="4096,16384,65536", help="tokens per rank, comma-separated")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=None, help="K/V heads (GQA); default: --heads")
    parser.add_argument("--headdim", type=int, default=128)
    parser.add_argument("--dtype", choices=tuple(DTYPES), default=None, help="default: bf16 on cuda, fp32 on cpu")
    parser.add_argument("--causal", choices=("both", "true", "false"), default="both")
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--modes", default="fwd,fwd_bwd")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=1,
                        help="times plain and ring are timed in turns; the medians over the rounds are reported")
    parser.add_argument("--atol", type=float, default=None,
                        help="largest max abs error of the ring's output against plain attention; default 2e-2 "
                             "for bf16/fp16, 1e-4 for fp32")
    args = parser.parse_args(argv)
    args.seqlens = [int(s) for s in args.seqlens.split(",")]
    args.layouts = args.layouts.split(",")
    args.modes = args.modes.split(",")
    args.causals = {"both": (False, True), "true": (True,), "false": (False,)}[args.causal]
    args.dtype = args.dtype or ("bf16" if args.device == "cuda" else "fp32")
    args.kv_heads = args.kv_heads or args.heads
    if args.atol is None:
        args.atol = 1e-4 if args.dtype == "fp32" else 2e-2
    for layout in args.layouts:
        if layout not in LAYOUTS:
            parser.error(f"--layouts: {layout!r} is not one of {LAYOUTS}")
    for mode in args.modes:
        if mode not in ("fwd", "fwd_bwd"):
            parser.error(f"--modes: {mode!r} is not fwd or fwd_bwd")
    return args


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_group(device: str) -> bool:
    """Joins torchrun's group (RANK and WORLD_SIZE in the environment) or makes a 1-process group; returns
    whether this call created the group (and so should destroy it). An existing group is used as it is."""
    if device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("ring_attention.py: CUDA is not available; pass --device cpu for a smoke run with gloo "
                             "on the CPU")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if dist.is_initialized():
        return False
    if "RANK" not in os.environ:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("nccl" if device == "cuda" else "gloo")
    return True


def _median_ms(fn, warmup: int, reps: int, device: str) -> float:
    """The median time of `reps` calls of fn after `warmup` calls, in ms, the largest over the ranks. On CUDA the
    calls run back to back, each between two events, with one synchronisation at the end (as triton's do_bench
    times): a call's host work overlaps the GPU work queued before it, as in a training loop, so a GPU-bound call
    reads its GPU time and a host-bound one its host time."""
    for _ in range(warmup):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        for start, end in events:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        times = [start.elapsed_time(end) for start, end in events]
    else:
        times = []
        for _ in range(reps):
            begin = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - begin))
    return _largest(statistics.median(times), device)


def _largest(value: float, device: str) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def run_cells(args) -> list[dict]:
    """Every (seqlen_local, causal, layout, mode) cell on this rank; the records (the same on every rank)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    device, dtype = args.device, DTYPES[args.dtype]
    records = []
    for seqlen in args.seqlens:
        gen = torch.Generator(device=device).manual_seed(seqlen)   # the same whole sequence on every rank
        total = world * seqlen
        def draw(heads, gen=gen, total=total):
            return torch.randn(args.batch, total, heads, args.headdim, generator=gen, device=device, dtype=dtype)
        q, k, v, grad_out = draw(args.heads), draw(args.kv_heads), draw(args.kv_heads), draw(args.heads)
        for causal in args.causals:
            with torch.no_grad():
                want = flashtile.flash_attn_func(q, k, v, causal=causal)
            for layout in args.layouts:
                shard = SHARD[layout]
                ql, kl, vl, gl = (shard(t, rank, world).contiguous() for t in (q, k, v, grad_out))
                with torch.no_grad():
                    got = ring_flash_attn_func(ql, kl, vl, causal=causal, layout=layout)
                error = _largest((got.float() - shard(want, rank, world).float()).abs().max().item(), device)
                if error > args.atol:
                    raise SystemExit(f"ring_attention.py: the ring's output differs from plain attention by "
                                     f"{error:.3e} (over --atol {args.atol:g}) at seqlen_local {seqlen}, "
                                     f"causal {causal}, layout {layout}")
                for mode in args.modes:
                    plain = _call(flashtile.flash_attn_func, mode, q, k, v, grad_out, causal)
                    ring = _call(ring_flash_attn_func, mode, ql, kl, vl, gl, causal, layout=layout)
                    # plain and ring in turns, --rounds times: the GPU's rate drifts between measurements of the
                    # same work, and taking turns exposes both to it alike
                    times = {"plain": [], "ring": []}
                    for _ in range(args.rounds):
                        times["plain"].append(_median_ms(plain, args.warmup, args.reps, device))
                        times["ring"].append(_median_ms(ring, args.warmup, args.reps, device))
                    plain_ms = statistics.median(times["plain"])
                    ring_ms = statistics.median(times["ring"])
                    records.append(dict(world=world, device=device, dtype=args.dtype, batch=args.batch,
                                        heads=args.heads, kv_heads=args.kv_heads, headdim=args.headdim,
                                        seqlen_local=seqlen, seqlen_global=total, causal=causal, layout=layout,
                                        mode=mode, ring_ms=round(ring_ms, 4), plain_ms=round(plain_ms, 4),
                                        ratio=round(ring_ms / plain_ms, 4), max_abs_err=error))
                    if rank == 0:
                        print(json.dumps(records[-1]), flush=True)
    return records


def _call(function, mode, q, k, v, grad_out, causal, **kwargs):
    """A closure running function forward (without autograd) or forward + backward (gradients of q, k, v)."""
    if mode == "fwd":
        def forward():
            with torch.no_grad():
                function(q, k, v, causal=causal, **kwargs)
        return forward
    inputs = [t.detach().requires_grad_() for t in (q, k, v)]
    def forward_backward():
        out = function(*inputs, causal=causal, **kwargs)
        torch.autograd.grad(out, inputs, grad_out)
    return forward_backward


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    created = init_group(args.device)
    try:
        return run_cells(args)
    finally:
        if created:
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
