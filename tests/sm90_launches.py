"""Compile for sm_90 (Hopper), on a machine without a GPU, exactly the kernels one call would launch on an H200.

The launchers in flashtile.triton.launch run on CPU tensors with the sm_90 tile table and a recorder in place of
the launch; each recorded launch is bound by Triton's own binder for an sm_90 target, so the compiled variant has
the specialisation a GPU launch would give it (an integer argument equal to 1 becomes a constant, multiples of 16
are marked divisible, pointers are marked 16-byte aligned), and is then compiled by Triton and ptxas.

    python tests/sm90_launches.py SEQLEN_Q SEQLEN_K HEADDIM [--causal] [--sink] [--dtype fp16|bf16] [--headdim-v N]

prints one JSON line per launch: kernel, constexprs that name the tile, registers, spills, shared memory, or the
compiler's error. TRITON_INTERPRET must be off (the kernels must be JIT functions, not interpreted ones).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass

import torch
import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import create_function_from_signature

from flashtile._validate import AttentionProblem
from flashtile.triton import configs, decode as decode_schedule, launch as launchers, relaunch

SM90 = GPUTarget("cuda", 90, 32)


@dataclass
class RecordedLaunch:
    kernel: object
    grid: tuple
    arguments: tuple
    options: dict

    @property
    def name(self) -> str:
        return self.kernel.fn.__name__

    @property
    def tile(self) -> dict:
        return {name: self.options[name] for name in relaunch.TILE_OPTIONS if name in self.options}


@contextlib.contextmanager
def recorded_launches():
    """Replace the launchers' launch with a recorder (and let TMA descriptors be built over CPU tensors, as the
    sm_90 table would use them on a GPU); yields the list of RecordedLaunch."""
    recorded: list[RecordedLaunch] = []
    saved = launchers.launch, launchers.interpreting, decode_schedule.launch_fixed

    def record(kernel, grid, tensors, scalars, **options):
        recorded.append(RecordedLaunch(kernel, tuple(grid), (*tensors, *scalars), options))

    def record_fixed(fixed, grid, tensors):
        recorded.append(RecordedLaunch(fixed.kernel, tuple(grid), (*tensors, *fixed.scalars), fixed.options))

    # interpreting: _tma_ready skips the device; the decode schedule's launch_fixed: the decode kernels' launches
    # (forward schedule 5)
    launchers.launch, launchers.interpreting, decode_schedule.launch_fixed = record, lambda: True, record_fixed
    try:
        yield recorded
    finally:
        launchers.launch, launchers.interpreting, decode_schedule.launch_fixed = saved


def problem_for(seqlen_q: int, seqlen_k: int, headdim: int, headdim_v: int, dtype: torch.dtype, causal: bool,
                batch: int = 1, nheads: int = 2, nheads_k: int | None = None, alibi: bool = False,
                sink: bool = False) -> AttentionProblem:
    """A dense flash_attn_func problem (bottom-right causal alignment), with a learnable sink where `sink`."""
    return AttentionProblem(batch=batch, nheads=nheads, nheads_k=nheads_k or nheads, seqlen_q=seqlen_q,
                            seqlen_k=seqlen_k,
                            headdim=headdim, headdim_v=headdim_v, dtype=dtype, device=torch.device("cpu"),
                            softmax_scale=headdim ** -0.5, window_left=-1, window_right=0 if causal else -1,
                            diagonal_offset=seqlen_k - seqlen_q, alignment="bottom-right", softcap=0.0,
                            has_alibi=alibi, mask_kind=None, has_sink=sink)


def launches_of(problem: AttentionProblem, tiles: configs.TritonTiles | None = None) -> list[RecordedLaunch]:
    """The launches of a forward and a backward of `problem` (dense, no mask) under `tiles` (default: the sm_90
    table's)."""
    p = problem
    tiles = tiles or configs.default_tiles(p, (9, 0))
    q = torch.zeros(p.batch, p.seqlen_q, p.nheads, p.headdim, dtype=p.dtype)
    k = torch.zeros(p.batch, p.seqlen_k, p.nheads_k, p.headdim, dtype=p.dtype)
    v = torch.zeros(p.batch, p.seqlen_k, p.nheads_k, p.headdim_v, dtype=p.dtype)
    slopes = torch.ones(p.nheads) if p.has_alibi else None
    sink = torch.zeros(p.nheads) if p.has_sink else None
    with recorded_launches() as recorded:
        out, lse = launchers.forward(q, k, v, slopes, None, p, tiles, learnable_sink=sink)
        launchers.backward(torch.zeros_like(out), None, q, k, v, out, lse, slopes, None, p, tiles,
                           learnable_sink=sink)
    return recorded


def compile_for_sm90(recorded: RecordedLaunch):
    """Triton's (or Gluon's) compiled kernel for this launch on sm_90, specialised as Triton's binder specialises it."""
    fn = recorded.kernel
    backend = make_backend(SM90)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*recorded.arguments, **recorded.options)
    options, signature, constexprs, attrs = fn._pack_args(backend, recorded.options, bound, specialization, options)
    source = ASTSource
    if getattr(fn, "is_gluon", lambda: False)():  # a Gluon kernel: Gluon's front end
        from triton.experimental.gluon._runtime import GluonASTSource as source
    return triton.compile(source(fn, signature, constexprs, attrs), target=SM90, options=options.__dict__)


def resource_usage(cubin: bytes) -> dict:
    """Registers per thread and spill bytes of a cubin's kernel, from the cuobjdump that Triton carries."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        report = subprocess.run([knobs.nvidia.cuobjdump.path, "--dump-resource-usage", f.name], capture_output=True,
                                text=True, check=True).stdout
    registers = re.search(r"REG:(\d+)", report)
    stack = re.search(r"STACK:(\d+)", report)
    return {"registers": int(registers.group(1)) if registers else None,
            "stack": int(stack.group(1)) if stack else None}


def compile_report(recorded: RecordedLaunch) -> dict:
    """What compiling the launch gave: registers, spills and shared memory, or the error."""
    row = {"kernel": recorded.name, "tile": recorded.tile, "grid": list(recorded.grid)}
    try:
        compiled = compile_for_sm90(recorded)
    except Exception as error:  # noqa: BLE001 - the report names any compiler failure
        return dict(row, error=f"{type(error).__name__}: {str(error)[-2000:]}")
    return dict(row, **resource_usage(compiled.asm["cubin"]), shared=compiled.metadata.shared,
                wgmma="wgmma" in compiled.asm["ptx"])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("seqlen_q", type=int)
    parser.add_argument("seqlen_k", type=int)
    parser.add_argument("headdim", type=int)
    parser.add_argument("--headdim-v", type=int)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--alibi", action="store_true")
    parser.add_argument("--sink", action="store_true", help="with a learnable sink")
    parser.add_argument("--nheads", type=int, default=2)
    parser.add_argument("--nheads-k", type=int)
    parser.add_argument("--dtype", choices=("fp16", "bf16"), default="fp16")
    args = parser.parse_args(argv)
    dtype = torch.float16 if args.dtype == "fp16" else torch.bfloat16
    problem = problem_for(args.seqlen_q, args.seqlen_k, args.headdim, args.headdim_v or args.headdim, dtype,
                          args.causal, nheads=args.nheads, nheads_k=args.nheads_k, alibi=args.alibi, sink=args.sink)
    failed = False
    for recorded in launches_of(problem):
        row = compile_report(recorded)
        failed |= "error" in row
        print(json.dumps(row), flush=True)
    return int(failed)


if __name__ == "__main__":
    sys.exit(main())
