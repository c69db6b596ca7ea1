"""Determinism and accuracy of the warp-specialized forward (schedule 2) on a Hopper GPU.

For each tile configuration and shape, runs the forward 30 times on the same inputs and reports how
many runs differ bitwise from the first, how many hold NaN, and the largest error against float64 on
the last 64 rows — for schedule 2 (TMA + warp specialization) and, as a control, schedule 1 (TMA
only). The shapes include a ragged key end and a causal band: there the element mask applies, and
128-row warp-specialized tiles are right only if each consumer warpgroup masks its own query rows
(fwd_tma.py, m0_desc).

    python benchmarks/ws_determinism.py
    python benchmarks/ws_determinism.py --stress 120   # reruns for 120 s

--stress reruns the warp-specialized forward at its fastest tiles (d = 128, whole key blocks, no band) on two
shapes (with --target table-tma: the table's TMA forward and backward at 4k keys) for the given seconds and
counts the runs that differ bitwise from the first; run several at once, or beside other GPU work, to look for
a race that only shows under contention (benchmarks/h200_runbook.sh wsstress runs four beside the test suite).

    python benchmarks/ws_determinism.py --stress 120 --target table-tma
"""

from __future__ import annotations

import argparse
import re
import time

import torch
import triton

import flashtile
from flashtile.reference import flash_attn_reference

CONFIGS = [(128, 128, 2), (128, 64, 2), (64, 64, 2), (128, 128, 1)]  # BLOCK_M, BLOCK_N, stages (4 warps)
SHAPES = [  # batch, seqlen, nheads, nheads_k, headdim, causal
    (2, 2048, 16, 4, 128, False),
    (1, 4100, 8, 2, 128, False),
    (2, 2048, 16, 16, 64, False),
    (2, 2048, 16, 4, 128, True),
]


WS_TILES = dict(forward_schedule=2, block_m=128, block_n=128, num_warps=4, num_stages=2)  # the fastest measured


# what --stress reruns (tiles forced, with the backward, causal, head dim, shapes as (batch, seqlen, nheads,
# nheads_k)): the warp-specialized forward at its fastest tiles; as a control for its race, the table's TMA schedules
# at d = 128 and 4k keys (forward schedule 1, backward schedule 3, host-side descriptors); the Gluon forward
# (schedule 3) at the table's settings, without and with a causal band, at d = 128 (two consumers) and d = 64 (three
# consumers from 4k keys without a band and at 16k with one; two with the launcher's deal at 4k with one; below 4k
# without a band, "gluon" and "gluon-d64-short", two consumers starting each tile under the last one's P V)
SHORT = ((2, 2048, 16, 4), (4, 1024, 16, 16))
STRESS_TARGETS = {"ws": (WS_TILES, False, False, 128, SHORT),
                  "table-tma": ({"forward_schedule": 1}, True, False, 128, ((1, 4096, 16, 4), (2, 4096, 8, 8))),
                  "gluon": ({"forward_schedule": 3}, False, False, 128, SHORT),
                  "gluon-causal": ({"forward_schedule": 3}, False, True, 128, SHORT),
                  "gluon-d64": ({}, False, False, 64, ((1, 4096, 16, 4), (1, 16384, 8, 8))),
                  "gluon-d64-causal": ({}, False, True, 64, ((1, 4096, 16, 4), (1, 16384, 8, 8))),
                  "gluon-d64-short": ({}, False, False, 64, SHORT)}


def stress(seconds: float, target: str = "ws") -> None:
    """Rerun `target` for `seconds` (STRESS_TARGETS); report the runs whose out or lse (and gradients) differ
    bitwise from the first, and by how much."""
    tiles, backward, causal, headdim, shapes = STRESS_TARGETS[target]
    device = torch.device("cuda")
    torch.manual_seed(0)

    def call(q, k, v):
        out, lse = flashtile.flash_attn_func(q, k, v, return_lse=True, causal=causal)
        if not backward:
            return out, lse
        return (out, lse, *torch.autograd.grad(out, (q, k, v), torch.ones_like(out)))

    cases = []
    for batch, seqlen, nheads, nheads_k in shapes:
        q, k, v = (torch.randn(batch, seqlen, heads, headdim, device=device, dtype=torch.bfloat16,
                               requires_grad=backward) for heads in (nheads, nheads_k, nheads_k))
        with flashtile.use_backend("triton", **tiles):
            cases.append(((q, k, v), call(q, k, v)))
    with flashtile.use_backend("triton", **tiles):
        kernels = sorted({re.search(r"tiles: forward \((attention_\w+)", flashtile.explain(*inputs, causal=causal))
                          .group(1) for inputs, _ in cases})
    print(f"stress {target}: forward kernels {kernels}", flush=True)
    runs = differing = with_nan = 0
    end = time.monotonic() + seconds
    with flashtile.use_backend("triton", **tiles):
        while time.monotonic() < end:
            for inputs, first in cases:
                got = call(*inputs)
                runs += 1
                with_nan += any(bool(t.isnan().any()) for t in got)
                if not all(torch.equal(a, b) for a, b in zip(got, first)):
                    differing += 1
                    gaps = ", ".join(f"{name} {(a.float() - b.float()).abs().max():.3e}"
                                     for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, first))
                    print(f"run {runs} differs: max |x - first|: {gaps}", flush=True)
    print(f"stress: {runs} runs of {target} {tiles or 'the table'}{' with backward' if backward else ''}, "
          f"{differing} differ bitwise from the first, {with_nan} hold NaN", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stress", type=float, default=0.0, help="seconds of reruns (see --target)")
    parser.add_argument("--target", default="ws", choices=sorted(STRESS_TARGETS),
                        help="ws: the warp-specialized forward; table-tma: the table's TMA forward + backward; gluon, "
                             "gluon-causal, gluon-d64, gluon-d64-causal, gluon-d64-short: the Gluon forward at the "
                             "table's settings")
    args = parser.parse_args()
    if args.stress > 0:
        stress(args.stress, args.target)
        return
    device = torch.device("cuda")
    print(f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}, triton {triton.__version__}")
    torch.manual_seed(0)
    for batch, seqlen, nheads, nheads_k, headdim, causal in SHAPES:
        q = torch.randn(batch, seqlen, nheads, headdim, device=device, dtype=torch.bfloat16)
        k = torch.randn(batch, seqlen, nheads_k, headdim, device=device, dtype=torch.bfloat16)
        v = torch.randn(batch, seqlen, nheads_k, headdim, device=device, dtype=torch.bfloat16)
        rows = slice(seqlen - 64, seqlen)  # bottom-right alignment keeps these rows' view of the keys
        ref = flash_attn_reference(q[:1, rows], k[:1], v[:1], causal=causal)[0]
        for schedule in (2, 1):
            for block_m, block_n, stages in CONFIGS:
                tiles = dict(forward_schedule=schedule, block_m=block_m, block_n=block_n, num_warps=4,
                             num_stages=stages)
                try:
                    with flashtile.use_backend("triton", **tiles):
                        runs = [flashtile.flash_attn_func(q, k, v, causal=causal) for _ in range(30)]
                except Exception as error:  # noqa: BLE001 - a config that does not compile is reported
                    print(f"  schedule {schedule} {tiles}: failed ({type(error).__name__}: "
                          f"{str(error).splitlines()[0][:100]})")
                    continue
                differing = sum(not torch.equal(run, runs[0]) for run in runs[1:])
                nan = sum(bool(run.isnan().any()) for run in runs)
                error = max((run[:1, rows].double() - ref).abs().max().item() for run in runs)
                print(f"B{batch} N{seqlen} H{nheads}/{nheads_k} d{headdim} causal={int(causal)} schedule {schedule} "
                      f"{block_m}x{block_n} s{stages}: {differing}/29 runs differ, {nan} with NaN, "
                      f"max error vs float64 {error:.2e}", flush=True)


if __name__ == "__main__":
    main()
