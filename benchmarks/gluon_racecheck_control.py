"""A control for compute-sanitizer's racecheck on Gluon kernels: the smallest kernel with `gl.warp_specialize` (a
default partition that does nothing, one worker warpgroup that writes 128 floats to global memory and touches no
shared memory of its own). Whatever racecheck reports here comes from the code Triton generates around the
partitions (the workers' start and exit handshake through shared memory), not from a kernel's own buffers.

    compute-sanitizer --tool racecheck python benchmarks/gluon_racecheck_control.py
"""

from __future__ import annotations

import torch

from flashtile.triton.gluon_compat import gl, gluon


@gluon.jit
def _idle(out, n):
    pass


@gluon.jit
def _write(out, n):
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    offs = gl.arange(0, 128, layout=layout)
    gl.store(out + offs, offs.to(gl.float32), mask=offs < n)


@gluon.jit
def warp_specialize_control_kernel(out, n):
    gl.warp_specialize([(_idle, (out, n)), (_write, (out, n))], [4], [48])


if __name__ == "__main__":
    out = torch.zeros(128, device="cuda")
    warp_specialize_control_kernel[(1,)](out, 128, num_warps=4)
    torch.cuda.synchronize()
    assert torch.equal(out, torch.arange(128, device="cuda", dtype=torch.float32)), out
    print("control kernel: ok")
