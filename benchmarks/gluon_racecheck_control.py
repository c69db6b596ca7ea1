"""A control for compute-sanitizer's racecheck on Gluon kernels: the smallest kernels with `gl.warp_specialize` (a
default partition that does nothing, one, two or three worker warpgroups that each write 128 floats of their own to
global memory and touch no shared memory of their own; the Gluon forward has two or three consumer warpgroups and
the load warps). Whatever racecheck reports here comes from the code Triton generates around the partitions (the
workers' start and exit handshake through shared memory), not from a kernel's own buffers. With SPIN, each worker
first spins that many dependent steps, so that the default partition reaches its end long before the workers do
(as the Gluon forward's load warps do before its consumers).

    compute-sanitizer --tool racecheck python benchmarks/gluon_racecheck_control.py [WORKERS [SPIN [forward-registers]]]
                                                  # 1 worker, 0 steps, 48 registers a worker by default
    compute-sanitizer --tool racecheck python benchmarks/gluon_racecheck_control.py barrier|mbarrier|tma

The three last controls add, one at a time, what the Gluon forward has and the first ones do not: a barrier of the
default partition's own 128 threads (`BAR.SYNC 0x0, 0x80`, which Triton also places before an mbarrier arrive), an
mbarrier (the default partition initialises one before the partitions split and arrives on it; two workers wait on
it before their writes), and a TMA copy (the default partition loads a 64 x 64 tile into shared memory, completing
the mbarrier; the workers wait and read the tile from shared memory). Whichever of them makes racecheck report
hazards on the generated start/exit table names the construct racecheck does not order.
"""

from __future__ import annotations

import sys

import torch

from flashtile.triton.gluon_compat import TensorDescriptor, gl, gluon, mbarrier, thread_barrier, tma_load


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


@gluon.jit
def _partition_barrier(out):
    thread_barrier()


@gluon.jit
def barrier_control_kernel(out, REGISTERS: gl.constexpr):
    gl.warp_specialize([(_partition_barrier, (out,)), (_write, (out, 128, 0, 0)), (_write, (out, 128, 0, 1))],
                       [4, 4], [REGISTERS] * 2)


@gluon.jit
def _arrive(bar):
    mbarrier.arrive(bar, count=1)


@gluon.jit
def _load_tile(desc, tile, bar):
    mbarrier.expect(bar, desc.block_type.nbytes)
    tma_load(desc, [0, 0], bar, tile)


@gluon.jit
def _wait_and_write(out, bar, WORKER: gl.constexpr):
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    offs = gl.arange(0, 128, layout=layout)
    mbarrier.wait(bar, 0)
    gl.store(out + WORKER * 128 + offs, offs.to(gl.float32) + WORKER)


@gluon.jit
def _wait_and_copy(out, tile, bar, WORKER: gl.constexpr):
    layout: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [4, 1], [1, 0])
    mbarrier.wait(bar, 0)
    values = tile.load(layout)
    rows = gl.arange(0, 64, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, 64, layout=gl.SliceLayout(0, layout))
    gl.store(out + WORKER * 4096 + rows[:, None] * 64 + cols[None, :], values + WORKER)


@gluon.jit
def mbarrier_control_kernel(out, REGISTERS: gl.constexpr):
    bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(bar, count=1)
    gl.warp_specialize([(_arrive, (bar,)), (_wait_and_write, (out, bar, 0)), (_wait_and_write, (out, bar, 1))],
                       [4, 4], [REGISTERS] * 2)


@gluon.jit
def tma_control_kernel(desc, out, REGISTERS: gl.constexpr):
    tile = gl.allocate_shared_memory(desc.dtype, desc.block_type.shape, desc.layout)
    bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(bar, count=1)
    gl.warp_specialize([(_load_tile, (desc, tile, bar)), (_wait_and_copy, (out, tile, bar, 0)),
                        (_wait_and_copy, (out, tile, bar, 1))], [4, 4], [REGISTERS] * 2)


def _run_protocol_control(mode: str) -> None:
    if mode == "barrier":
        out = torch.zeros(2, 128, device="cuda")
        barrier_control_kernel[(1,)](out, REGISTERS=48, num_warps=4)
        want = torch.arange(128, device="cuda", dtype=torch.float32) + torch.arange(2, device="cuda")[:, None]
    elif mode == "mbarrier":
        out = torch.zeros(2, 128, device="cuda")
        mbarrier_control_kernel[(1,)](out, REGISTERS=48, num_warps=4)
        want = torch.arange(128, device="cuda", dtype=torch.float32) + torch.arange(2, device="cuda")[:, None]
    else:
        source = torch.randn(64, 64, device="cuda")
        layout = gl.NVMMASharedLayout.get_default_for([64, 64], gl.float32)
        desc = TensorDescriptor.from_tensor(source, [64, 64], layout)
        out = torch.zeros(2, 64, 64, device="cuda")
        tma_control_kernel[(1,)](desc, out, REGISTERS=48, num_warps=4)
        want = torch.stack([source, source + 1])
    torch.cuda.synchronize()
    assert torch.equal(out, want), out
    print(f"control kernel with {mode}: ok")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] in ("barrier", "mbarrier", "tma"):
        _run_protocol_control(sys.argv[1])
        sys.exit(0)
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
