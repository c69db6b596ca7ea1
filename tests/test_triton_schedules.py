"""The Triton forward schedules (pointer loads, TMA descriptors, TMA + warp specialization) compute the same function."""

from __future__ import annotations

import pytest
import torch

import flashtile
from flashtile.reference import flash_attn_reference
from flashtile.triton import launch

from conftest import DEVICE, assert_close_to_oracle, random_qkv
from test_flash_attn import SCENARIOS, SHAPES


class _MustNotLaunch:
    """Stands in for a kernel that the chosen schedule must not use."""

    def __getitem__(self, grid):
        raise AssertionError("the pointer-load forward kernel ran although a TMA schedule was requested")


@pytest.mark.parametrize("schedule", (1, 2), ids=("tma", "tma-warp-specialized"))
@pytest.mark.parametrize("scenario", ("plain", "causal", "window", "softcap", "everything"))
@pytest.mark.parametrize("shape", ("mha-square", "gqa-short-q-dv", "decode-d72"))
def test_tma_schedules_follow_the_eager_rule(monkeypatch, schedule, scenario, shape, seed):
    dtype = torch.float16
    monkeypatch.setattr(launch, "attention_fwd_kernel", _MustNotLaunch())
    kwargs = SCENARIOS[scenario](SHAPES[shape])
    q, k, v = random_qkv(*SHAPES[shape], dtype)
    with flashtile.use_backend("triton", forward_schedule=schedule, block_m=16, block_n=16):
        out, lse = flashtile.flash_attn_func(q, k, v, return_lse=True, **kwargs)
    ref_out, ref_lse = flash_attn_reference(q, k, v, **kwargs)
    eager_out, eager_lse = flash_attn_reference(q, k, v, dtype=dtype, **kwargs)
    assert_close_to_oracle("out", out, ref_out, eager_out, dtype, seed)
    assert_close_to_oracle("lse", lse, ref_lse, eager_lse, dtype, seed)


def test_masks_and_unaligned_strides_keep_the_pointer_kernel(seed):
    """TMA needs 16-byte aligned strides and takes no attn_mask: those calls run fwd.py's kernel."""
    q = torch.randn(2, 3, 37, 8, device=DEVICE)
    mask = torch.rand(37, 37, device=DEVICE) > 0.2
    mask[:, 0] = True
    shifted = q[..., 1:6]  # a view starting 4 bytes into each row: not 16-byte aligned
    for tensors, kwargs in (((q, q, q), {"attn_mask": mask}), ((shifted, shifted, shifted), {})):
        assert not launch._tma_ready([t.transpose(1, 2) for t in tensors], kwargs.get("attn_mask"))
        with flashtile.use_backend("triton", forward_schedule=1):
            out = flashtile.scaled_dot_product_attention(*tensors, **kwargs)
        ref, _ = flashtile.reference.sdpa_reference(*tensors, **kwargs)
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_tile_table_uses_tma_only_where_it_was_measured_to_pay():
    """sm_90, fp16/bf16, >= 4k keys, dense: schedule 1; shorter, other GPUs, fp32, packed: the pointer kernel."""
    import dataclasses

    from flashtile._validate import AttentionProblem
    from flashtile.triton.configs import default_tiles

    base = AttentionProblem(batch=1, nheads=16, nheads_k=16, seqlen_q=8192, seqlen_k=8192, headdim=128, headdim_v=128,
                            dtype=torch.bfloat16, device=torch.device("cpu"), softmax_scale=0.1, window_left=-1,
                            window_right=-1, diagonal_offset=0, alignment="bottom-right", softcap=0.0,
                            has_alibi=False, mask_kind=None)
    assert default_tiles(base, (9, 0)).forward_schedule == 1
    assert default_tiles(dataclasses.replace(base, headdim=64, headdim_v=64), (9, 0)).forward_schedule == 1
    for other in (dataclasses.replace(base, seqlen_k=2048), dataclasses.replace(base, dtype=torch.float32),
                  dataclasses.replace(base, varlen=True)):
        assert default_tiles(other, (9, 0)).forward_schedule == 0, other
    assert default_tiles(base, (8, 0)).forward_schedule == 0
    assert all(default_tiles(base, cap).forward_schedule != 2 for cap in ((8, 0), (9, 0), (10, 0)))  # opt-in only
