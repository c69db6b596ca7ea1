"""The Gluon dK/dV kernel (backward schedule 4, opt-in) and the fused Gluon backward (schedule 5, opt-in): which calls
they serve and why they turn the others away, what explain() says, and that a call they do not serve runs backward
schedule 2 with the same result. CI compiles them for sm_90 (tests/test_gluon_compile.py); tests/test_gpu.py checks
their gradients on an H200."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import flashtile
from flashtile.triton import configs, launch

from conftest import DEVICE, random_qkv
from sm90_launches import problem_for

HOPPER = (9, 0)


def _on_a_hopper(monkeypatch):
    """gluon_backward_unserved_reason as on an H200: a CUDA problem, compute capability 9.0, the kernels compiled."""
    monkeypatch.setattr(configs, "interpreting", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: HOPPER)


@pytest.mark.parametrize("change, reason", [
    (dict(), ""),
    (dict(window_left=100, window_right=20), ""),
    (dict(nheads_k=1), ""),  # MQA: the group's query heads summed in registers
    (dict(headdim=96, headdim_v=40), ""),  # pads to 128 / 64
    (dict(dtype=torch.float32), "it takes fp16 / bf16, not torch.float32"),
    (dict(mask_kind="bool"), "an attn_mask (bool) runs the Triton kernels"),
    (dict(varlen=True), "packed batches run the Triton backward (the Gluon dK/dV kernel takes dense batches)"),
    (dict(softcap=30.0), "softcap and ALiBi run the Triton backward (their extra score tiles spill the Gluon "
                         "kernel's registers)"),
    (dict(has_alibi=True), "softcap and ALiBi run the Triton backward (their extra score tiles spill the Gluon "
                           "kernel's registers)"),
    (dict(headdim=256, headdim_v=256), "head dims 256 / 256 pad to widths 256 / 256, not 64 or 128"),
    (dict(headdim=32, headdim_v=32), "head dims 32 / 32 pad to widths 32 / 32, not 64 or 128")])
def test_the_gluon_backward_names_why_it_turns_a_call_away(monkeypatch, change, reason):
    _on_a_hopper(monkeypatch)
    problem = dataclasses.replace(problem_for(1024, 1024, 128, 128, torch.bfloat16, True), device=torch.device("cuda"),
                                  **change)
    assert configs.gluon_backward_unserved_reason(problem) == reason


def test_its_query_blocks_are_64_rows_at_d64_and_32_where_a_head_is_128_wide():
    tile = lambda d, dv: configs.gluon_backward_tile(problem_for(1024, 1024, d, dv, torch.bfloat16, False))  # noqa
    assert (tile(64, 64), tile(128, 128), tile(64, 128), tile(128, 64), tile(40, 40)) == (
        (64, 2), (32, 2), (32, 2), (32, 2), (64, 2))


def test_with_the_overlap_the_ring_has_three_stages():
    """A consumer holds two query blocks' stages at once (the previous block's dV and dK read them under the next
    block's scores): a third stage lets the block after load meanwhile."""
    tile = lambda d: configs.gluon_backward_tile(problem_for(1024, 1024, d, d, torch.bfloat16, False), True)  # noqa
    assert (tile(64), tile(128)) == ((64, 3), (32, 3))


OVERLAP_SPILLS = ("the intra-warpgroup overlap (gluon_backward_overlap) with 128-wide heads (d and dv) and a band "
                  "(causal or a window) spills registers; it serves head width 64, widths 64 / 128 apart, and 128-wide "
                  "heads without a band")


@pytest.mark.parametrize("headdim, headdim_v, causal, window, reason", [
    (64, 64, True, None, ""),
    (64, 64, False, (100, 20), ""),
    (128, 64, True, None, ""),
    (64, 128, False, (100, 20), ""),
    (128, 128, False, None, ""),
    (96, 96, False, None, ""),
    (128, 128, True, None, OVERLAP_SPILLS),
    (96, 72, False, (100, 20), OVERLAP_SPILLS),
    (128, 128, False, (-1, 0), OVERLAP_SPILLS)])
def test_the_overlap_names_where_it_does_not_serve(monkeypatch, headdim, headdim_v, causal, window, reason):
    _on_a_hopper(monkeypatch)
    problem = dataclasses.replace(problem_for(1024, 1024, headdim, headdim_v, torch.bfloat16, causal),
                                  device=torch.device("cuda"))
    if window is not None:
        problem = dataclasses.replace(problem, window_left=window[0], window_right=window[1])
    assert configs.gluon_backward_unserved_reason(problem, overlap=True) == reason
    assert configs.gluon_backward_unserved_reason(problem) == ""  # without the overlap it serves every one


def test_the_overlap_is_off_unless_forced_and_its_setting_is_checked():
    assert configs.TritonTiles(16, 16, 4, 1, 16, 16, 4, 1).gluon_backward_overlap == 0
    for headdim in (64, 128):
        for causal in (False, True):
            problem = problem_for(4096, 4096, headdim, headdim, torch.bfloat16, causal)
            assert configs.default_tiles(problem, HOPPER).gluon_backward_overlap == 0
    with pytest.raises(ValueError, match="tile setting gluon_backward_overlap must be 0 or 1, got 2"):
        with flashtile.use_backend("triton", gluon_backward_overlap=2):
            pass


def test_explain_names_the_overlap_where_forced_and_why_it_does_not_serve(monkeypatch):
    _on_a_hopper(monkeypatch)
    served = dataclasses.replace(problem_for(4096, 4096, 64, 64, torch.bfloat16, True), device=torch.device("cuda"))
    tiles = dataclasses.replace(configs.default_tiles(served, HOPPER), backward_schedule=4, gluon_backward_overlap=1)
    assert ("128 keys per CTA against 64 query rows per block, 3 Q / dO stages, the next query block's score matmuls "
            "issued before each block's dV and dK (intra-warpgroup overlap), one CTA per key block; dQ programs"
            in tiles.describe(served))
    assert "(intra-warpgroup overlap)" not in dataclasses.replace(tiles, gluon_backward_overlap=0).describe(served)
    unserved = dataclasses.replace(served, headdim=128, headdim_v=128)
    assert (f"backward: the Gluon dK/dV kernel does not serve this call ({OVERLAP_SPILLS}), so backward "
            "(attention_bwd_dq_kernel") in tiles.describe(unserved)


@pytest.mark.parametrize("headdim", (64, 128))
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
def test_the_table_does_not_pick_it_before_it_is_measured(headdim, causal):
    for seqlen in (1024, 4096, 16384):
        tiles = configs.default_tiles(problem_for(seqlen, seqlen, headdim, headdim, torch.bfloat16, causal), HOPPER)
        assert tiles.backward_schedule not in configs.GLUON_BACKWARD_SCHEDULES


def test_explain_names_the_gluon_dkdv_kernel_and_its_tile(monkeypatch):
    _on_a_hopper(monkeypatch)
    problem = dataclasses.replace(problem_for(4096, 4096, 128, 128, torch.bfloat16, True), device=torch.device("cuda"))
    tiles = dataclasses.replace(configs.default_tiles(problem, HOPPER), backward_schedule=4)
    text = tiles.describe(problem)
    assert ("backward (attention_bwd_dq_kernel (which also computes each row's delta), then "
            "attention_bwd_dkdv_gluon_kernel (Gluon, explicit warp roles") in text
    assert "128 keys per CTA against 32 query rows per block, 2 Q / dO stages, one CTA per key block; dQ programs" \
        in text


# what explain() says of a call that each Gluon backward schedule turns away (on a CPU: every call)
TURNED_AWAY = {4: "backward: the Gluon dK/dV kernel does not serve this call (Gluon kernels do not run in Triton's "
                  "CPU interpreter), so backward (attention_bwd_dq_kernel (which also computes each row's delta), "
                  "then attention_bwd_dkdv_kernel, streamed tiles",
               5: "backward: the fused Gluon backward does not serve this call (Gluon kernels do not run in Triton's "
                  "CPU interpreter), so backward (attention_bwd_dq_kernel"}


@pytest.mark.skipif(DEVICE.type != "cpu", reason="on a CPU: the Gluon kernel cannot run there, so it turns the call "
                                                 "away (on an H200 tests/test_gpu.py runs it)")
@pytest.mark.parametrize("schedule", (4, 5), ids=("dkdv-overlap", "fused"))
def test_a_call_it_turns_away_runs_backward_schedule_2_and_explain_says_why(schedule, seed):
    q, k, v = random_qkv(1, 40, 50, 2, 1, 64, 64, torch.float16, requires_grad=True)
    grad_out = torch.randn(1, 40, 2, 64, dtype=torch.float16)
    grads = {}
    for forced in (schedule, 2):
        with flashtile.use_backend("triton", backward_schedule=forced, block_m=16, block_n=16, bwd_block_m=16,
                                   bwd_block_n=16, gluon_backward_overlap=int(forced == 4)):
            text = flashtile.explain(q, k, v, causal=True)
            out = flashtile.flash_attn_func(q, k, v, causal=True)
            grads[forced] = torch.autograd.grad(out, (q, k, v), grad_out)
        if forced == schedule:
            assert TURNED_AWAY[schedule] in text, text
    for name, a, b in zip(("dq", "dk", "dv"), grads[schedule], grads[2]):
        assert torch.equal(a, b), name


# The fused Gluon backward (backward schedule 5, opt-in): dK, dV and dQ in one kernel per key block, dQ added by TMA
# reduce (bwd_gluon_fused.py)

FUSED_OVERLAP = ("the fused Gluon backward (backward_schedule=5) has no intra-warpgroup overlap; use "
                 "gluon_backward_overlap=0")


@pytest.mark.parametrize("change, reason", [
    (dict(), ""),
    (dict(window_left=100, window_right=20), ""),
    (dict(nheads_k=1), ""),
    (dict(headdim=96, headdim_v=40), ""),
    (dict(dtype=torch.float32), "it takes fp16 / bf16, not torch.float32"),
    (dict(varlen=True), "packed batches run the Triton backward (the Gluon dK/dV kernel takes dense batches)"),
    (dict(softcap=30.0), "softcap and ALiBi run the Triton backward (their extra score tiles spill the Gluon "
                         "kernel's registers)"),
    (dict(dropout_p=0.1), "dropout runs the Triton backward (the Gluon dK/dV kernel has no dropout)"),
    (dict(headdim=256, headdim_v=256), "head dims 256 / 256 pad to widths 256 / 256, not 64 or 128")])
def test_the_fused_backward_serves_what_the_dkdv_kernel_serves(monkeypatch, change, reason):
    _on_a_hopper(monkeypatch)
    problem = dataclasses.replace(problem_for(1024, 1024, 128, 128, torch.bfloat16, True), device=torch.device("cuda"),
                                  **change)
    assert configs.gluon_backward_unserved_reason(problem, fused=True) == reason
    assert configs.gluon_backward_unserved_reason(problem, overlap=True, fused=True) == FUSED_OVERLAP


def test_the_fused_backward_takes_16_query_rows_where_128_wide_heads_meet_a_window():
    def tile(d, dv, window_left=-1, window_right=-1):
        problem = dataclasses.replace(problem_for(1024, 1024, d, dv, torch.bfloat16, False), window_left=window_left,
                                      window_right=window_right)
        return configs.fused_gluon_backward_tile(problem)
    assert (tile(64, 64), tile(128, 128), tile(128, 128, -1, 0), tile(128, 128, 100, 20), tile(128, 64, 100, 20),
            tile(64, 64, 100, 20)) == ((64, 2), (32, 2), (32, 2), (16, 2), (32, 2), (64, 2))


def test_explain_names_the_fused_backward_and_its_tile(monkeypatch):
    _on_a_hopper(monkeypatch)
    problem = dataclasses.replace(problem_for(4096, 4096, 128, 128, torch.bfloat16, True), device=torch.device("cuda"))
    tiles = dataclasses.replace(configs.default_tiles(problem, HOPPER), backward_schedule=5)
    text = tiles.describe(problem)
    assert ("backward (attention_bwd_preprocess_kernel, then attention_bwd_fused_gluon_kernel (Gluon, "
            "FlashAttention-3's dataflow") in text, text
    assert ("128 keys per CTA against 32 query rows per block, 2 Q / dO stages, one CTA per key block; dQ added by TMA "
            "reduce into a float32 accumulator, then converted") in text, text
    assert "dQ programs" not in text
    unserved = dataclasses.replace(tiles, gluon_backward_overlap=1).describe(problem)
    assert (f"backward: the fused Gluon backward does not serve this call ({FUSED_OVERLAP}), so backward "
            "(attention_bwd_dq_kernel") in unserved, unserved


def test_the_fused_backward_is_a_backward_schedule_a_caller_can_force():
    with flashtile.use_backend("triton", backward_schedule=5):
        pass
    with pytest.raises(ValueError, match=r"tile setting backward_schedule must be one of \[0, 1, 2, 3, 4, 5\], got 6"):
        with flashtile.use_backend("triton", backward_schedule=6):
            pass


@pytest.mark.skipif(DEVICE.type != "cpu", reason="the conversion alone, under the interpreter (on an H200 "
                                                 "tests/test_gpu.py checks the whole schedule)")
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16))
def test_the_fused_backwards_dq_conversion_transposes_and_scales_the_accumulator(dtype):
    """attention_bwd_dq_convert_kernel: dq[b, m, h, :] = softmax_scale * accumulator[b, h, :, m], over a ragged
    query length (113: columns 113-115 of the rounded-up accumulator never read) and a padded head dim (72)."""
    problem = dataclasses.replace(problem_for(113, 200, 72, 72, dtype, False, batch=2, nheads=3), softmax_scale=0.3)
    accumulator = launch._dq_accumulator(problem, torch.device("cpu"))
    assert accumulator.shape == (2, 3, 72, 116)
    accumulator.normal_()
    accumulator[..., 113:] = float("nan")  # past the queries: must never reach dq
    dq = torch.empty(2, 113, 3, 72, dtype=dtype)
    launch._convert_dq(accumulator, dq, problem, block_d=128)
    want = accumulator[..., :113].permute(0, 3, 1, 2) * 0.3
    # within one rounding to dtype (the interpreter rounds bf16 its own way; fp16's subnormals have absolute steps)
    excess = ((dq.float() - want).abs() - torch.finfo(dtype).eps * want.abs() - torch.finfo(dtype).tiny).max().item()
    assert excess <= 0, f"dq: beyond one rounding by {excess:.2e}"
