"""gluon_compat.tma_reduce_add compiles for sm_90, without a GPU, to a TMA reduce-add (`cp.reduce.async.bulk.tensor`
... `.add`) under the installed Triton (whose Gluon has `tma.async_atomic_add`) and under the H200's (3.6.0, whose
Gluon has only the op builder's `create_async_tma_reduce`). The fused Gluon backward adds its dQ tiles that way."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from test_gluon_compile import GPU_TRITON, ROOT, side_triton


@pytest.mark.parametrize("side", [False, True], ids=["installed triton", f"triton {GPU_TRITON}"])
def test_the_tma_reduce_add_compiles_to_a_bulk_tensor_reduce(tmp_path, side):
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    paths = [str(side_triton()) if side else None, str(ROOT / "src"), env.get("PYTHONPATH")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    process = subprocess.run([sys.executable, str(Path(__file__).with_name("sm90_tma_reduce.py"))], env=env,
                             cwd=Path(__file__).parent, capture_output=True, text=True, timeout=300)
    rows = [json.loads(line) for line in process.stdout.splitlines() if line.startswith("{")]
    assert process.returncode == 0 and rows, f"{process.stdout[-3000:]}\n{process.stderr[-3000:]}"
    (row,) = rows
    if side:
        assert row["triton"] == GPU_TRITON
    assert row["reduce"] == ["cp.reduce.async.bulk.tensor.2d.global.shared::cta.add.bulk_group"], row
