"""A control for compute-sanitizer's racecheck on Gluon kernels: the smallest kernels with `gl.warp_specialize` (a
default partition that does nothing, one, two or three worker warpgroups that each write 128 floats of their own to
global memory and touch no shared memory of their own; the Gluon forward has two or three consumer warpgroups and
the load warps). Whatever racecheck reports here comes from the code Triton generates around the partitions (the
workers' start and exit handshake through shared memory), not from a kernel's own buffers. With SPIN, each worker
first spins that many dependent steps, so that the default partition reaches its end long before the workers do
(as the Gluon forward's load warps do before its consumers).

    compute-sanitizer --tool racecheck python benchmarks/gluon_racecheck_control.py [WORKERS [SPIN [forward-registers]]]
                                                  # 1 worker, 0 steps, 48 registers a worker by default
"""

from __future__ import annotations

import sys

import torch

from flashtile.triton.gluon_compat import gl, gluon


@gluon.jit
def _idle(out, n):
    pass


@gluon.jit
def _write(out, n, spin, WORKER: gl.constexpr):
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    offs = gl.arange(0, 128, layout=layout)
    x = offs.to(gl.float32)
    for _ in range(spin):
        x = x * 0.5 + x * 0.5  # x again, one dependent step at a time
    gl.store(out + WORKER * 128 + offs, x + WORKER, mask=offs < n)


@gluon.jit
def warp_specialize_control_kernel(out, n, spin, WORKERS: gl.constexpr, REGISTERS: gl.constexpr):
    if WORKERS == 1:
        gl.warp_specialize([(_idle, (out, n)), (_write, (out, n, spin, 0))], [4], [REGISTERS])
    elif WORKERS == 2:
        gl.warp_specialize([(_idle, (out, n)), (_write, (out, n, spin, 0)), (_write, (out, n, spin, 1))], [4, 4],
                           [REGISTERS] * 2)
    else:
        gl.warp_specialize([(_idle, (out, n)), (_write, (out, n, spin, 0)), (_write, (out, n, spin, 1)),
                            (_write, (out, n, spin, 2))], [4, 4, 4], [REGISTERS] * 3)


if __name__ == "__main__":
    workers = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    spin = int(sys.argv[2]) if len(sys.argv) > 2 else 0
    # the Gluon forward's register plan with two workers: a cap of 168 a thread at launch, 240 for each worker (the
    # load warps left 24); otherwise 48 a worker, under the compiler's own cap
    plan = dict(REGISTERS=240, maxnreg=168) if len(sys.argv) > 3 and sys.argv[3] == "forward-registers" else \
        dict(REGISTERS=48)
    out = torch.zeros(workers, 128, device="cuda")
    warp_specialize_control_kernel[(1,)](out, 128, spin, WORKERS=workers, num_warps=4, **plan)
    torch.cuda.synchronize()
    want = torch.arange(128, device="cuda", dtype=torch.float32) + torch.arange(workers, device="cuda")[:, None]
    assert torch.equal(out, want), out
    print(f"control kernel, {workers} worker warpgroup(s), {spin} spin steps, {plan}: ok")
