"""Compile for sm_90 (Hopper), on a machine without a GPU, every variant of the Gluon forward that the tile table
can pick, the Gluon dK/dV kernel's variants (backward schedule 4) and the fused Gluon backward's (schedule 5), and
report what came out.

Gluon kernels do not run in Triton's interpreter, so CI checks them by compiling: the launcher (launch.forward_gluon)
runs on CPU tensors with a recorder in place of the launch, each recorded launch is bound by Triton's binder for an
sm_90 target and compiled by Gluon's front end and ptxas. Run in a subprocess by tests/test_gluon_compile.py with the
installed Triton and by tests/test_gluon_compile_gpu_triton.py with the Triton the H200 has (3.6.0, from a side
directory on PYTHONPATH).

    python tests/sm90_gluon_compile.py             # every variant
    python tests/sm90_gluon_compile.py backward    # the Gluon backward kernels' variants alone

prints one JSON line per variant: its label, the constexprs that name it, whether the PTX has wgmma (and which
wait depths), setmaxnreg, TMA copies, the registers and spill bytes ptxas reports (and whether it serialised the
wgmma), the TMA reduce instructions, the shared memory, or the error.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile

import torch
import triton

from flashtile.triton import configs, launch as launchers
from sm90_launches import compile_for_sm90, problem_for, recorded_launches, resource_usage


def table_problems():
    """(label, problem) for the cells where the sm_90 table takes the Gluon forward, one per distinct variant, and
    the options it serves that the table's cells do not exercise (dv != d, softcap, ALiBi, a left window edge)."""
    cases = []
    for dtype, name in ((torch.bfloat16, "bf16"), (torch.float16, "fp16")):
        for headdim in (64, 128):
            for seqlen in (1024, 4096, 16384):
                for causal in (False, True):
                    cases.append((f"{name} d{headdim} n{seqlen} causal {causal}",
                                  problem_for(seqlen, seqlen, headdim, headdim, dtype, causal)))
    cases += [
        ("bf16 d128 dv64 causal", problem_for(4096, 4096, 128, 64, torch.bfloat16, True)),
        ("bf16 d64 dv128", problem_for(4096, 4096, 64, 128, torch.bfloat16, False)),
        ("bf16 d128 alibi causal", problem_for(4096, 4096, 128, 128, torch.bfloat16, True, alibi=True)),
        ("bf16 d96 GQA", problem_for(4096, 4096, 96, 96, torch.bfloat16, False, nheads=8, nheads_k=2)),
        # below 4k keys without a band the table starts each tile under the last one's P V (gluon_across_tiles)
        ("bf16 d128 dv64 n1024", problem_for(1024, 1024, 128, 64, torch.bfloat16, False)),
        ("fp16 d128 softcap n1024", dataclasses.replace(problem_for(1024, 1024, 128, 128, torch.float16, False),
                                                        softcap=30.0)),
        # a learnable sink joins each row's statistics in the epilogue
        ("bf16 d128 sink causal", problem_for(4096, 4096, 128, 128, torch.bfloat16, True, sink=True)),
        ("bf16 d64 sink causal n1024", problem_for(1024, 1024, 64, 64, torch.bfloat16, True, sink=True)),
    ]
    # packed batches (the table takes the Gluon forward for them at d = 128)
    for dtype, name in ((torch.bfloat16, "bf16"), (torch.float16, "fp16")):
        for causal in (False, True):
            cases.append((f"{name} d128 packed causal {causal}",
                          dataclasses.replace(problem_for(1000, 1000, 128, 128, dtype, causal, batch=3), varlen=True)))
    cases.append(("bf16 d128 dv64 packed causal GQA",
                  dataclasses.replace(problem_for(1000, 900, 128, 64, torch.bfloat16, True, batch=3, nheads=8,
                                                  nheads_k=2), varlen=True)))
    return cases


def extra_tiles():
    """Settings a user can force (forward_schedule=3 with other gluon_* values) beyond the table's own."""
    return [("bf16 d128 causal pingpong", problem_for(4096, 4096, 128, 128, torch.bfloat16, True),
             configs.GluonTile(pingpong=True)),
            ("bf16 d64 three consumers", problem_for(4096, 4096, 64, 64, torch.bfloat16, False),
             configs.GluonTile(consumers=3, num_stages=3)),
            ("fp16 d64 causal three consumers", problem_for(4096, 4096, 64, 64, torch.float16, True),
             configs.GluonTile(consumers=3, overlap=False, persistent=False)),
            # 256-wide heads without overlap: with it (two score tiles live beside a 64 x 256 accumulator) triton 3.9
            # spills 20 bytes (3.6 none)
            ("bf16 d256 causal (output staged in the query buffer)",
             problem_for(4096, 4096, 256, 256, torch.bfloat16, True), configs.GluonTile(overlap=False)),
            ("bf16 d128 three stages (output staged in the query buffer)",
             problem_for(4096, 4096, 128, 128, torch.bfloat16, False), configs.GluonTile(num_stages=3)),
            ("fp16 d256 softcap no overlap",
             dataclasses.replace(problem_for(4096, 4096, 256, 256, torch.float16, False), softcap=20.0),
             configs.GluonTile(overlap=False)),
            ("bf16 d128 causal dealt tiles", problem_for(4096, 4096, 128, 128, torch.bfloat16, True),
             configs.GluonTile(balanced=True)),
            ("bf16 d128 pingpong, dealt tiles, each tile started under the last",
             problem_for(4096, 4096, 128, 128, torch.bfloat16, False),
             configs.GluonTile(pingpong=True, balanced=True, across_tiles=True)),
            ("bf16 d128 softcap", dataclasses.replace(problem_for(4096, 4096, 128, 128, torch.bfloat16, False),
                                                    softcap=30.0), configs.GluonTile()),
            ("bf16 d64 window (64, 32)", dataclasses.replace(problem_for(4096, 4096, 64, 64, torch.bfloat16, False),
                                                           window_left=64, window_right=32), configs.GluonTile()),
            ("bf16 d64 packed window no overlap",
             dataclasses.replace(problem_for(1000, 1000, 64, 64, torch.bfloat16, False, batch=3), varlen=True,
                                 window_left=100, window_right=20), configs.GluonTile(overlap=False, num_stages=3)),
            # FlashAttention-4's exponentials on the FMA units (opt-in, inline PTX)
            ("bf16 d64 one exponential in 8 on the FMA units", problem_for(1024, 1024, 64, 64, torch.bfloat16, False),
             configs.GluonTile(num_stages=3, exp2_emulated=8)),
            ("fp16 d128 causal one exponential in 2 on the FMA units",
             problem_for(4096, 4096, 128, 128, torch.float16, True), configs.GluonTile(balanced=True, exp2_emulated=2)),
            # one consumer warpgroup, two CTAs per SM (opt-in)
            ("bf16 d64 causal one consumer, dealt tiles, each tile started under the last",
             problem_for(1024, 1024, 64, 64, torch.bfloat16, True),
             configs.GluonTile(consumers=1, balanced=True, across_tiles=True)),
            ("bf16 d128 one consumer, blocks of 64 keys", problem_for(4096, 4096, 128, 128, torch.bfloat16, False),
             configs.GluonTile(consumers=1, block_n=64)),
            *half_diagonal_tiles(),
            *fa4_tiles(),
            ("bf16 d64 packed causal, blocks of 256 keys",
             dataclasses.replace(problem_for(1000, 1000, 64, 64, torch.bfloat16, True, batch=3), varlen=True),
             configs.GluonTile(block_n=256, overlap=False))]


def half_diagonal_tiles():
    """The first consumer's last block on its first half (gluon_half_diagonal, opt-in) on causal calls at d = 64 and
    128: at 1k keys on the table's setting (dealt tiles, each started under the last one's P V; pingpong at d = 128),
    at 4k on dealt tiles alone."""
    tiles = []
    for headdim in (64, 128):
        short = problem_for(1024, 1024, headdim, headdim, torch.bfloat16, True)
        table = configs.default_tiles(short, (9, 0)).gluon_tile
        tiles += [(f"bf16 d{headdim} n1024 causal, the table's setting, last block on its first half", short,
                   dataclasses.replace(table, half_diagonal=True)),
                  (f"bf16 d{headdim} causal dealt tiles, last block on its first half",
                   problem_for(4096, 4096, headdim, headdim, torch.bfloat16, True),
                   configs.GluonTile(balanced=True, half_diagonal=True))]
    return tiles


def fa4_tiles():
    """The fa4 schedule on top of fa3 (configs.fa4_tiles): the table's setting with FlashAttention-4's two moves, on a
    short causal cell and a long non-causal one at each head width."""
    tiles = []
    for headdim, seqlen, causal in ((64, 1024, True), (128, 1024, True), (64, 16384, False), (128, 16384, False)):
        problem = problem_for(seqlen, seqlen, headdim, headdim, torch.bfloat16, causal)
        tiles.append((f"bf16 d{headdim} n{seqlen} causal {causal}, the fa4 schedule (the table's setting with "
                      "FlashAttention-4's moves)", problem, configs.fa4_tiles(problem, (9, 0)).gluon_tile))
    return tiles


def recorded_gluon_launch(problem, tile):
    """The launch forward_gluon makes for `problem` under `tile`, recorded on CPU tensors (a packed batch: its
    sequences of seqlen_q / seqlen_k rows each, packed)."""
    p = problem
    rows = (1, p.batch * p.seqlen_q, p.batch * p.seqlen_k) if p.varlen else (p.batch, p.seqlen_q, p.seqlen_k)
    q = torch.zeros(rows[0], rows[1], p.nheads, p.headdim, dtype=p.dtype)
    k = torch.zeros(rows[0], rows[2], p.nheads_k, p.headdim, dtype=p.dtype)
    v = torch.zeros(rows[0], rows[2], p.nheads_k, p.headdim_v, dtype=p.dtype)
    cu = ([torch.arange(p.batch + 1, dtype=torch.int32) * n for n in (p.seqlen_q, p.seqlen_k)] if p.varlen
          else [None, None])
    slopes = torch.ones(1, p.nheads) if p.has_alibi else None
    sink = torch.zeros(p.nheads) if p.has_sink else None
    saved = launchers.sm_count
    launchers.sm_count = lambda device: 132  # an H200's SMs: the persistent grid's size
    try:
        with recorded_launches() as recorded:
            launchers.forward_gluon(q, k, v, slopes, p, tile, *cu, learnable_sink=sink)
    finally:
        launchers.sm_count = saved
    (launch,) = recorded
    return launch


def backward_problems():
    """(label, problem, overlap) for the Gluon dK/dV kernel (backward schedule 4), one per distinct variant that
    configs.gluon_backward_unserved_reason lets through: both query-block sizes (64 rows at d = 64, 32 where a width
    is 128), causal and windows, GQA / MQA with ragged ends, dv != d, fp16; each without and with the
    intra-warpgroup overlap (gluon_backward_overlap) where it serves the problem."""
    problems = [
        ("bwd bf16 d64", problem_for(1024, 1024, 64, 64, torch.bfloat16, False)),
        ("bwd fp16 d64 ragged causal MQA", problem_for(1000, 900, 64, 64, torch.float16, True, nheads=8, nheads_k=1)),
        ("bwd bf16 d128 causal", problem_for(1024, 1024, 128, 128, torch.bfloat16, True)),
        ("bwd bf16 d128 window GQA", dataclasses.replace(
            problem_for(1000, 900, 128, 128, torch.bfloat16, False, nheads=8, nheads_k=2), window_left=100,
            window_right=20)),
        ("bwd bf16 d128 dv64 causal GQA", problem_for(1000, 900, 128, 64, torch.bfloat16, True, nheads=8, nheads_k=2)),
        ("bwd bf16 d64 dv128 window GQA", dataclasses.replace(
            problem_for(1000, 900, 64, 128, torch.bfloat16, False, nheads=8, nheads_k=2), window_left=100,
            window_right=20)),
        ("bwd fp16 d128", problem_for(1024, 1024, 128, 128, torch.float16, False)),
    ]
    cases = [(label, problem, False) for label, problem in problems]
    cases += [(f"{label} overlap", problem, True) for label, problem in problems
              if not configs._backward_overlap_reason(problem)]
    return cases


def fused_backward_problems():
    """(label, problem) for the fused Gluon backward (backward schedule 5), one per distinct variant: both query-block
    sizes, causal and windows, GQA / MQA with ragged ends, dv != d, fp16."""
    labels = ("bwd bf16 d64", "bwd fp16 d64 ragged causal MQA", "bwd bf16 d128 causal", "bwd bf16 d128 window GQA",
              "bwd bf16 d128 dv64 causal GQA", "bwd bf16 d64 dv128 window GQA")
    return [(label.replace("bwd", "fused bwd"), problem) for label, problem, overlap in backward_problems()
            if label in labels and not overlap]


def _backward_tensors(p):
    """Zero CPU tensors of a dense backward of `p`: q, k, v, dO and lse."""
    return (torch.zeros(p.batch, p.seqlen_q, p.nheads, p.headdim, dtype=p.dtype),
            torch.zeros(p.batch, p.seqlen_k, p.nheads_k, p.headdim, dtype=p.dtype),
            torch.zeros(p.batch, p.seqlen_k, p.nheads_k, p.headdim_v, dtype=p.dtype),
            torch.zeros(p.batch, p.seqlen_q, p.nheads, p.headdim_v, dtype=p.dtype),
            torch.zeros(p.batch, p.nheads, p.seqlen_q))


def recorded_fused_backward_launch(problem):
    """The fused Gluon backward's launch for `problem` (dense), recorded on CPU tensors (the dQ conversion after it,
    a plain Triton kernel, left out)."""
    q, k, v, grad_out, lse = _backward_tensors(problem)
    _, _, _, _, scalars, flags = launchers._score_args(q, None, None, problem)
    with recorded_launches() as recorded:
        launchers._launch_fused_gluon(q, k, v, grad_out, lse, torch.zeros_like(lse), torch.zeros_like(q),
                                      torch.zeros_like(k), torch.zeros_like(v), problem, scalars, flags)
    fused, convert = recorded
    assert convert.name == "attention_bwd_dq_convert_kernel", convert.name
    return fused


def recorded_gluon_backward_launch(problem, overlap=False):
    """The launch of the Gluon dK/dV kernel for `problem` (dense), recorded on CPU tensors."""
    p = problem
    q = torch.zeros(p.batch, p.seqlen_q, p.nheads, p.headdim, dtype=p.dtype)
    k = torch.zeros(p.batch, p.seqlen_k, p.nheads_k, p.headdim, dtype=p.dtype)
    v = torch.zeros(p.batch, p.seqlen_k, p.nheads_k, p.headdim_v, dtype=p.dtype)
    grad_out = torch.zeros(p.batch, p.seqlen_q, p.nheads, p.headdim_v, dtype=p.dtype)
    lse = torch.zeros(p.batch, p.nheads, p.seqlen_q)
    _, _, _, _, scalars, flags = launchers._score_args(q, None, None, p)
    with recorded_launches() as recorded:
        launchers._launch_dkdv_gluon(q, k, v, grad_out, lse, torch.zeros_like(lse), torch.zeros_like(k),
                                     torch.zeros_like(v), p, scalars, flags, overlap)
    (launch,) = recorded
    return launch


NAMED = ("BLOCK_M", "BLOCK_N", "NUM_STAGES", "HAS_LEFT", "HAS_RIGHT", "HAS_SOFTCAP", "HAS_ALIBI", "SCALE_IN_EXP2",
         "OVERLAP", "PINGPONG", "TILE_LIST", "SHARE_QO", "VARLEN", "EXP2_EMULATED", "RESCALE_THRESHOLD", "ACROSS_TILES",
         "CONSUMER_REGISTERS", "HAS_SINK", "HALF_DIAGONAL", "maxnreg")


def _triton_ptxas_flags() -> list[str]:
    """The register-allocation flag Triton's own ptxas call adds (triton 3.9 passes --regAllocOptLevel=2, working
    around a ptxas 13 bug; 3.6 passes none), so that the report's ptxas allocates as the compiled kernel's did."""
    import inspect

    from triton.backends.nvidia import compiler
    return ["--regAllocOptLevel=2"] if "--regAllocOptLevel=2" in inspect.getsource(compiler) else []


def ptxas_report(ptx: str) -> dict:
    """Spill stores and loads (bytes per thread) as the ptxas that Triton uses for sm_90 reports them (-v), with
    Triton's register-allocation flag."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas
        ptxas = get_ptxas(90).path
    except ImportError:  # triton 3.6: one ptxas
        from triton import knobs
        ptxas = knobs.nvidia.ptxas.path
    with tempfile.TemporaryDirectory() as directory:
        source = os.path.join(directory, "kernel.ptx")
        with open(source, "w") as f:
            f.write(ptx)
        log = subprocess.run([ptxas, "-arch=sm_90a", "-v", *_triton_ptxas_flags(), source, "-o",
                              os.path.join(directory, "kernel.o")], capture_output=True, text=True).stderr
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    if not spills:
        return {"ptxas": log[-500:]}
    return {"spill_stores": int(spills.group(1)), "spill_loads": int(spills.group(2)),
            "wgmma_serialized": "wgmma.mma_async instructions are serialized" in log}


def report(label, recorded) -> dict:
    row = {"label": label, "triton": triton.__version__,
           "constexprs": {name: recorded.options[name] for name in NAMED if name in recorded.options},
           "widths": [recorded.arguments[0].block_shape[3], recorded.arguments[2].block_shape[3]],
           "dtype": str(recorded.arguments[0].base.dtype)}
    try:
        compiled = compile_for_sm90(recorded)
    except Exception as error:  # noqa: BLE001 - the report names any compiler failure
        return dict(row, error=f"{type(error).__name__}: {str(error)[-1500:]}")
    ptx = compiled.asm["ptx"]
    return dict(row, **resource_usage(compiled.asm["cubin"]), shared=compiled.metadata.shared,
                wgmma="wgmma.mma_async" in ptx, setmaxnreg=sorted(set(re.findall(r"setmaxnreg\.(\w+)\.sync\.aligned"
                                                                               r"\.u32\s+(\d+)", ptx))),
                wait_depths=sorted(set(int(n) for n in re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", ptx))),
                tma="cp.async.bulk.tensor" in ptx,
                tma_reduce=sorted(set(re.findall(r"cp\.reduce\.async\.bulk\.tensor[\w.:]*", ptx))), **ptxas_report(ptx))


def main(backward_only: bool = False) -> int:
    failed = False
    seen = set()
    jobs = []
    for label, problem in [] if backward_only else table_problems():
        tiles = configs.default_tiles(problem, (9, 0))
        if tiles.forward_schedule != 3:
            print(json.dumps({"label": label, "table": "the Triton forward"}), flush=True)
            continue
        jobs.append((label, problem, tiles.gluon_tile))
    jobs += [] if backward_only else extra_tiles()
    for label, problem, tile in jobs:
        recorded = recorded_gluon_launch(problem, tile)
        key = (tuple(sorted(recorded.options.items())), recorded.arguments[0].base.dtype,
               recorded.arguments[0].block_shape[3], recorded.arguments[2].block_shape[3])
        if key in seen:
            continue  # the same compiled variant as an earlier cell
        seen.add(key)
        row = report(label, recorded)
        failed |= "error" in row
        print(json.dumps(row), flush=True)
    for label, problem, overlap in backward_problems():
        row = dict(report(label, recorded_gluon_backward_launch(problem, overlap)), kernel="dkdv")
        failed |= "error" in row
        print(json.dumps(row), flush=True)
    for label, problem in fused_backward_problems():
        row = dict(report(label, recorded_fused_backward_launch(problem)), kernel="fused")
        failed |= "error" in row
        print(json.dumps(row), flush=True)
    return int(failed)


if __name__ == "__main__":
    sys.exit(main(backward_only=sys.argv[1:] == ["backward"]))
