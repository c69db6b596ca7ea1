"""Every Triton kernel compiles for Hopper (sm_90) with the installed triton, without a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path_factory.mktemp("triton-cache"))  # compile for real, not from a cache
    process = subprocess.run([sys.executable, str(Path(__file__).with_name("sm90_compile.py"))], env=env,
                             capture_output=True, text=True, timeout=900)
    assert process.returncode == 0, f"compiling for sm_90 failed:\n{process.stderr[-4000:]}"
    return {row["label"]: row for row in json.loads(process.stdout)}


def _ieee_fp32(label: str) -> bool:
    # full-precision fp32 dots have no Hopper tensor-core form (wgmma takes tf32 at best): FMA path
    return " fp32 " in label


def test_every_variant_uses_hopper_matmuls(compiled):
    matmul_kernels = [label for label in compiled
                      if not label.startswith(("bwd-preprocess", "decode", "rotary", "append"))]
    assert len(matmul_kernels) == 28  # three of them with dropout, one paged
    missing = [label for label in matmul_kernels if not compiled[label]["wgmma"] and not _ieee_fp32(label)]
    assert not missing, f"no wgmma in {missing}"
    assert not any(compiled[label]["wgmma"] for label in matmul_kernels if _ieee_fp32(label))


def test_tma_schedules_use_bulk_tensor_copies_and_warp_specialization(compiled):
    for label, row in compiled.items():
        if label.startswith("fwd-tma"):
            assert row["tma"], f"{label}: no TMA bulk tensor copy in the PTX"
            expected = "schedule 2" in label and not _ieee_fp32(label)
            assert row["setmaxnreg"] == expected, f"{label}: warp specialization {row['setmaxnreg']}"
        elif label.startswith(("bwd-one-launch", "bwd-dq", "bwd-dkdv")):
            assert row["tma"] == (" tma " in label), f"{label}: TMA {row['tma']}"
        elif label.startswith("fwd "):
            assert not row["tma"], f"{label}: the pointer-load kernel should not use TMA"


def test_shared_memory_fits_an_h200(compiled):
    too_big = {label: row["shared"] for label, row in compiled.items() if row["shared"] > 232_448}
    assert not too_big, f"over the 227 KiB per-block limit: {too_big}"


def test_decode_kernels_use_tensor_cores_on_small_tiles(compiled):
    """A decode tile has 16 rows (one query per head of a group): too few for wgmma's 64, so mma.sync."""
    decode = [label for label in compiled if label.startswith("decode ")]
    assert len(decode) == 5
    for label in decode:
        assert compiled[label]["mma"] != _ieee_fp32(label), f"{label}: mma.sync {compiled[label]['mma']}"
    assert "decode-combine bf16 d128" in compiled


def test_the_rotary_kernel_rounds_like_torch(compiled):
    """kvcache_append_kernel compiles without FMA contraction: each product and sum rounded as torch's eager ops
    round them, for the same bits."""
    rotary = [label for label in compiled if label.startswith(("rotary-append", "append "))]
    assert len(rotary) == 3
    fused = [label for label in rotary if compiled[label]["fma"]]
    assert not fused, f"fused multiply-adds in {fused}"
