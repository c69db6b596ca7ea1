"""Compile, for sm_90 and without a GPU, a minimal Gluon kernel that adds a float32 tile into global memory by a TMA
reduce (gluon_compat.tma_reduce_add), and print one JSON line: the Triton version, whether the PTX holds
`cp.reduce.async.bulk.tensor` with `.add`, or the compiler's error. Run by tests/test_gluon_tma_reduce.py with the
installed Triton and with the H200's (a side directory first on PYTHONPATH)."""

from __future__ import annotations

import json
import re
import sys

import torch
import triton

from flashtile.triton import gluon_compat
from sm90_launches import RecordedLaunch, compile_for_sm90

if gluon_compat.AVAILABLE:
    gl, gluon = gluon_compat.gl, gluon_compat.gluon

    @gluon.jit
    def _add_tile(desc, ROWS: gl.constexpr, COLS: gl.constexpr):
        # a tile of ones through shared memory into the global tile at (program_id * ROWS, 0)
        layout: gl.constexpr = gl.BlockedLayout([1, 4], [8, 4], [4, 1], [1, 0])
        smem = gl.allocate_shared_memory(gl.float32, [ROWS, COLS], desc.layout)
        smem.store(gl.full([ROWS, COLS], 1.0, gl.float32, layout=layout))
        gluon_compat.fence_async_shared()
        gluon_compat.tma_reduce_add(desc, [gl.program_id(0) * ROWS, 0], smem)
        gluon_compat.tma.store_wait(0)


def main() -> int:
    row = {"triton": triton.__version__}
    try:
        target = torch.zeros(256, 64, dtype=torch.float32)
        layout = gluon_compat.gl.NVMMASharedLayout.get_default_for([64, 64], gluon_compat.gl.float32)
        desc = gluon_compat.TensorDescriptor.from_tensor(target, [64, 64], layout)
        ptx = compile_for_sm90(RecordedLaunch(_add_tile, (4,), (desc,), dict(ROWS=64, COLS=64, num_warps=4))).asm["ptx"]
    except Exception as error:  # noqa: BLE001 - the report names any compiler failure
        row["error"] = f"{type(error).__name__}: {str(error)[-1500:]}"
    else:
        row["reduce"] = sorted(set(re.findall(r"cp\.reduce\.async\.bulk\.tensor[\w.:]*", ptx)))
    print(json.dumps(row), flush=True)
    return int("error" in row)


if __name__ == "__main__":
    sys.exit(main())
