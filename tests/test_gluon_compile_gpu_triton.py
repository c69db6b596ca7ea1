"""The checks of test_gluon_compile.py on the Gluon kernels compiled for sm_90 with the Triton the H200 has (3.6.0,
installed into a side directory on first use). A file of its own, so that pytest-xdist's --dist loadfile can run this
compile (minutes) on one worker while the other compiles with the installed Triton."""

from __future__ import annotations

import pytest

import test_gluon_compile
from test_gluon_compile import GPU_TRITON, compile_variants, side_triton

# every test of test_gluon_compile.py, run here on this file's `compiled` (a test added there runs here too)
globals().update({name: value for name, value in vars(test_gluon_compile).items() if name.startswith("test_")})


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    rows = compile_variants(tmp_path_factory, str(side_triton()))
    assert {row.get("triton") for row in rows if "triton" in row} == {GPU_TRITON}
    return rows
