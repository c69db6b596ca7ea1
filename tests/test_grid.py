"""Every kernel's grid lies along CUDA's axis 0 (2**31 - 1 programs), so any batch x nheads launches: axes 1 and 2
hold at most 65,535 programs, which 4,096 sequences of 32 heads pass. The launches are recorded, not run (the
interpreter would take minutes over 131,072 programs); test_gpu.py runs such a call on a GPU."""

from __future__ import annotations

import pytest
import torch

import flashtile
from flashtile.triton import decode, host, launch

from conftest import DEVICE
from sm90_launches import launches_of, problem_for

BATCH, NHEADS = 4096, 32  # batch x nheads = 131,072


@pytest.mark.parametrize("forward", ("decode kernels", "prefill kernels"))
@pytest.mark.parametrize("headdim, causal", [(64, True), (64, False), (128, True), (128, False), (256, False)])
def test_forward_and_backward_grids_cover_every_program_along_axis_0(monkeypatch, headdim, causal, forward):
    """The table's sm_90 launches (forward, one- or two-launch backward) of a problem with 131,072 (batch, head)
    pairs: grids of (programs per (batch, head)) x batch x heads programs along axis 0. Its 5 query rows take the
    decode kernels' forward (configs.decode_forward); with that rule off, the prefill forward's."""
    from flashtile.triton import configs

    if forward == "prefill kernels":
        monkeypatch.setattr(configs, "DECODE_FORWARD_ROWS", 0)
    problem = problem_for(5, 9, headdim, headdim, torch.float16, causal, batch=BATCH, nheads=NHEADS)
    recorded = launches_of(problem)
    names = [r.name for r in recorded]
    assert ("attention_decode_kernel" in names) == (forward == "decode kernels"), names
    assert recorded and all(set(r.grid[1:]) <= {1} for r in recorded), [(r.name, r.grid) for r in recorded]
    for r in recorded:
        assert r.grid[0] >= BATCH * NHEADS and r.grid[0] % BATCH == 0, (r.name, r.grid)


def test_a_split_decode_lays_splits_rows_and_heads_along_axis_0(monkeypatch):
    grids = []
    monkeypatch.setattr(decode, "launch_fixed", lambda fixed, grid, tensors: grids.append(
        (fixed.kernel.fn.__name__, grid)))
    # recorded only: never written or read
    k_cache = torch.empty(BATCH, 256, NHEADS, 16, dtype=torch.float16, device=DEVICE)
    q = torch.empty(BATCH, 3, NHEADS, 16, dtype=torch.float16, device=DEVICE)  # 3 query tokens per K/V head
    with flashtile.use_backend("triton"):
        flashtile.flash_attn_with_kvcache(q, k_cache, k_cache, cache_seqlens=256, num_splits=4)
    assert [name for name, _ in grids] == ["attention_decode_kernel", "attention_decode_combine_kernel"]
    splits = 4  # 256 keys in four 64-key blocks, one a split
    assert grids[0][1] == (splits * 1 * BATCH * NHEADS, 1, 1), grids  # one 16-row block holds a tile's 3 rows
    assert grids[1][1] == (3 * BATCH * NHEADS, 1, 1), grids


def test_a_grid_past_cudas_axis_0_raises_instead_of_launching():
    with pytest.raises(ValueError, match=r"needs 2,147,483,648 programs, more than a CUDA grid axis holds"):
        host.program_grid(2**31)
    assert host.program_grid(2**31 - 1) == (2**31 - 1,)
