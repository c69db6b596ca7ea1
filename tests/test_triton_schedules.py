"""The Triton schedules compute the same function: forward (pointer loads, TMA descriptors, TMA + warp
specialization) and backward (two launches, or the dK/dV and dQ programs in one)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Callable

import pytest
import torch

import flashtile
from flashtile.reference import flash_attn_reference, flash_attn_varlen_reference
from flashtile.triton import launch

from conftest import (DEVICE, assert_attention_follows_the_eager_rule, assert_close_to_oracle, assert_within_bounds,
                      attention_grads, eager_rule_bound, random_qkv)
from test_flash_attn import SCENARIOS, SHAPES
from test_varlen import LENGTHS, packed_inputs
from test_varlen import SCENARIOS as VARLEN_SCENARIOS


class _MustNotLaunch:
    """Stands in for a kernel that the chosen schedule must not use."""

    def __getitem__(self, grid):
        raise AssertionError("a kernel ran that the requested schedule does not use")


class _RecordingKernel:
    """Wraps a kernel and records the keyword arguments (constexprs, launch options) of every launch."""

    def __init__(self, kernel):
        self.kernel, self.calls = kernel, []

    @property
    def use_tma(self) -> list:
        return [call["USE_TMA"] for call in self.calls]

    def __getitem__(self, grid):
        def launch_kernel(*args, **kwargs):
            self.calls.append(kwargs)
            return self.kernel[grid](*args, **kwargs)
        return launch_kernel


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


# score settings and whether the kernels may keep the scores unscaled and scale them inside exp2
SCALE_CASES = {"positive": (dict(softmax_scale=0.37), True), "negative": (dict(softmax_scale=-0.3), False),
               "zero": (dict(softmax_scale=0.0), False), "softcap": (dict(softmax_scale=0.37, softcap=3.0), False)}


@pytest.mark.parametrize("case", tuple(SCALE_CASES))
@pytest.mark.parametrize("forward_schedule", (0, 1), ids=("pointer", "tma"))
def test_the_scale_moves_into_the_exponent_only_where_that_is_exact(monkeypatch, forward_schedule, case, seed):
    """A positive scale as the scores' only transformation is applied inside exp2 (the row max taken on the raw
    products, then scaled); a negative scale would flip that max, a zero one make 0 * -inf of the masked keys, and
    softcap is not a scale: those keep scaled scores. Causal with ragged ends (masked keys in edge tiles): out, lse
    and gradients within the eager rule, and the flag every forward and backward launch was given."""
    dtype = torch.float16
    names = ("attention_fwd_kernel", "attention_fwd_tma_kernel", "attention_bwd_kernel", "attention_bwd_dkdv_kernel",
             "attention_bwd_dq_kernel")
    recorded = [_RecordingKernel(getattr(launch, name)) for name in names]
    for name, kernel in zip(names, recorded):
        monkeypatch.setattr(launch, name, kernel)
    score_kwargs, in_exponent = SCALE_CASES[case]
    kwargs = dict(causal=True, **score_kwargs)
    q, k, v = random_qkv(2, 45, 37, 4, 2, 16, 24, dtype, requires_grad=True)
    with flashtile.use_backend("triton", forward_schedule=forward_schedule, block_m=16, block_n=16):
        got = flashtile.flash_attn_func(q, k, v, return_lse=True, **kwargs)
    assert_attention_follows_the_eager_rule(got, flash_attn_reference(q, k, v, **kwargs),
                                            flash_attn_reference(q, k, v, dtype=dtype, **kwargs), (q, k, v), dtype,
                                            seed)
    launches = [call for kernel in recorded for call in kernel.calls]
    assert len(launches) >= 2 and {call["SCALE_IN_EXP2"] for call in launches} == {in_exponent}


def test_tma_forward_causal_rows_without_keys_are_empty_not_nan(monkeypatch, seed):
    """The causal TMA forward masks its edge blocks inside the interior loop (a runtime branch): rows that see
    no key at all (seqlen_q > seqlen_k, bottom-right causal) must still come out 0 with lse -inf, the others
    as the oracle says, with a ragged key end and several key blocks per query block."""
    dtype = torch.float16
    monkeypatch.setattr(launch, "attention_fwd_kernel", _MustNotLaunch())
    q, k, v = random_qkv(2, 70, 37, 4, 2, 16, 8, dtype)
    with flashtile.use_backend("triton", forward_schedule=1, block_m=16, block_n=16):
        out, lse = flashtile.flash_attn_func(q, k, v, causal=True, return_lse=True)
    empty = 70 - 37
    assert torch.equal(out[:, :empty], torch.zeros_like(out[:, :empty]))
    assert torch.isneginf(lse[:, :, :empty]).all() and lse[:, :, empty:].isfinite().all()
    ref_out, ref_lse = flash_attn_reference(q, k, v, causal=True)
    eager_out, eager_lse = flash_attn_reference(q, k, v, causal=True, dtype=dtype)
    assert_close_to_oracle("out", out, ref_out, eager_out, dtype, seed)
    finite = ref_lse.isfinite()
    assert_close_to_oracle("lse", lse[finite], ref_lse[finite], eager_lse[finite], dtype, seed)


@pytest.mark.parametrize("scenario", ("plain", "window-left-only", "softcap", "alibi"))
@pytest.mark.parametrize("shape", ("mha-square", "gqa-short-q-dv", "mqa-long-q"))
def test_tma_forward_ragged_key_end_in_its_own_loop_or_inside_the_interior_loop(monkeypatch, scenario, shape, seed):
    """Without a band on the right the keys' ragged end (53, 70 and 37 keys against 16-key blocks) is masked
    either in a loop of its own (forward_separate_ragged_end=1, the table's choice from 4k keys) or by a
    runtime branch inside the interior loop (0): both follow the oracle and agree within its bounds."""
    dtype = torch.float16
    monkeypatch.setattr(launch, "attention_fwd_kernel", _MustNotLaunch())
    recorder = _RecordingKernel(launch.attention_fwd_tma_kernel)
    monkeypatch.setattr(launch, "attention_fwd_tma_kernel", recorder)
    kwargs = SCENARIOS[scenario](SHAPES[shape])
    q, k, v = random_qkv(*SHAPES[shape], dtype)
    results = []
    for separate in (0, 1):
        with flashtile.use_backend("triton", forward_schedule=1, block_m=16, block_n=16,
                                   forward_separate_ragged_end=separate):
            results.append(flashtile.flash_attn_func(q, k, v, return_lse=True, **kwargs))
    assert [call["SEPARATE_RAGGED_END"] for call in recorder.calls] == [False, True]
    ref_out, ref_lse = flash_attn_reference(q, k, v, **kwargs)
    eager_out, eager_lse = flash_attn_reference(q, k, v, dtype=dtype, **kwargs)
    for out, lse in results:
        assert_close_to_oracle("out", out, ref_out, eager_out, dtype, seed)
        assert_close_to_oracle("lse", lse, ref_lse, eager_lse, dtype, seed)
    bounds = {"out": eager_rule_bound(ref_out, eager_out, dtype), "lse": eager_rule_bound(ref_lse, eager_lse, dtype)}
    assert_within_bounds(("out", "lse"), *results, bounds, "the two ragged-end loops", seed)


def test_forward_register_cap_reaches_the_launch_and_is_reported(monkeypatch):
    """forward_max_registers becomes Triton's maxnreg launch option (0: none passed) and explain() states it."""
    recorder = _RecordingKernel(launch.attention_fwd_tma_kernel)
    monkeypatch.setattr(launch, "attention_fwd_tma_kernel", recorder)
    q, k, v = random_qkv(1, 40, 40, 2, 2, 16, 16, torch.float16)
    for cap in (0, 128):
        with flashtile.use_backend("triton", forward_schedule=1, block_m=16, block_n=16, forward_max_registers=cap):
            flashtile.flash_attn_func(q, k, v)
            text = str(flashtile.explain(q, k, v))
        assert ("at most 128 registers" in text) == (cap == 128), text
    assert "maxnreg" not in recorder.calls[0] and recorder.calls[1]["maxnreg"] == 128
    # the cap was measured on the TMA forward: a call that takes the pointer kernel (a user mask) runs without it
    pointer = _RecordingKernel(launch.attention_fwd_kernel)
    monkeypatch.setattr(launch, "attention_fwd_kernel", pointer)
    mask = torch.rand(40, 40, device=DEVICE) > 0.3
    with flashtile.use_backend("triton", forward_schedule=1, block_m=16, block_n=16, forward_max_registers=128):
        flashtile.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), attn_mask=mask)
    assert len(pointer.calls) == 1 and "maxnreg" not in pointer.calls[0]


def test_forced_forward_tile_drops_the_tables_register_cap(monkeypatch):
    """The table's cap belongs to its tile: forcing a forward tile drops it, unless the cap is forced too; the cap
    and warp specialization exclude each other; both new settings are validated."""
    import dataclasses

    from flashtile._dispatch import BACKENDS
    from flashtile.triton import configs

    capped = dataclasses.replace(configs.TritonTiles(16, 16, 1, 1, 16, 16, 1, 1), forward_max_registers=128)
    monkeypatch.setattr(configs, "default_tiles", lambda problem, capability: capped)
    problem = _table_problem(1024, 128)
    choose = BACKENDS["triton"].choose_tiles
    assert choose(problem, {}).forward_max_registers == 128
    assert choose(problem, {"bwd_block_m": 32}).forward_max_registers == 128
    assert choose(problem, {"block_n": 32}).forward_max_registers == 0
    assert choose(problem, {"num_warps": 4, "forward_max_registers": 96}).forward_max_registers == 96
    assert choose(problem, {"forward_schedule": 2}).forward_max_registers == 0
    with pytest.raises(ValueError, match="forward_max_registers cannot be combined with forward_schedule=2"):
        choose(problem, {"forward_schedule": 2, "forward_max_registers": 128})
    for key, value, rule in (("forward_max_registers", -1, "a positive int"),
                             ("forward_separate_ragged_end", 2, "0 or 1")):
        with pytest.raises(ValueError, match=rf"{key} must be {rule}, got {value}"):
            with flashtile.use_backend("triton", **{key: value}):
                pass


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


def test_tma_forward_without_keys_gives_empty_rows():
    """A host-side descriptor needs every dimension >= 1: with no keys the pointer kernel writes the rows
    (out 0, lse -inf), whatever the forward schedule."""
    q = torch.randn(2, 5, 2, 16, device=DEVICE)
    k = torch.randn(2, 0, 2, 16, device=DEVICE)
    for schedule in (1, 2):
        with flashtile.use_backend("triton", forward_schedule=schedule), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # schedule 2's warning
            out, lse = flashtile.flash_attn_func(q, k, k, return_lse=True)
        assert torch.equal(out, torch.zeros_like(out)) and torch.all(lse == float("-inf")), schedule


def _table_problem(seqlen: int, headdim: int, dtype=torch.bfloat16):
    """A dense self-attention problem as the tile table sees it (the device does not matter to it)."""
    from flashtile._validate import AttentionProblem

    return AttentionProblem(batch=1, nheads=16, nheads_k=16, seqlen_q=seqlen, seqlen_k=seqlen, headdim=headdim,
                            headdim_v=headdim, dtype=dtype, device=torch.device("cpu"), softmax_scale=0.1,
                            window_left=-1, window_right=-1, diagonal_offset=0, alignment="bottom-right", softcap=0.0,
                            has_alibi=False, mask_kind=None)


def test_tile_table_uses_tma_only_where_it_was_measured_to_pay():
    """sm_90, fp16/bf16, dense: schedule 1 at every length in the Triton kernels' table (the Gluon forward, schedule
    3, takes most of these cells: tests/test_gluon_forward.py); other GPUs, fp32, packed: the pointer kernel.
    The warp-specialized schedule 2 is never the table's choice (opt-in: a rare race under triton 3.6)."""
    import dataclasses

    from flashtile.triton.configs import _triton_tiles, default_tiles

    base = _table_problem(8192, 128)
    for seqlen_k in (64, 1024, 8192):
        for width in (64, 128):
            dense = dataclasses.replace(base, seqlen_k=seqlen_k, headdim=width, headdim_v=width)
            assert _triton_tiles(dense, (9, 0)).forward_schedule == 1, dense
            assert default_tiles(dense, (9, 0)).forward_schedule in (1, 3), dense
    # d = 64: 8 warps, but 4 for a band below 4k keys
    d64 = dataclasses.replace(base, headdim=64, headdim_v=64)
    assert default_tiles(d64, (9, 0)).num_warps == 8
    assert default_tiles(dataclasses.replace(d64, seqlen_k=1024, window_right=0), (9, 0)).num_warps == 4
    # d = 128: 128-key blocks, causal included; a sliding window (a left edge) keeps 64
    assert default_tiles(base, (9, 0)).block_n == 128
    assert default_tiles(dataclasses.replace(base, window_right=0), (9, 0)).block_n == 128
    assert default_tiles(dataclasses.replace(base, window_left=256, window_right=0), (9, 0)).block_n == 64
    # short problems: d = 128 without a band takes 64-key blocks capped at 128 registers (two programs per SM),
    # d = 64 with a band 64 query rows (three per SM); long problems without a band give the ragged key end its
    # own loop
    short = default_tiles(dataclasses.replace(base, seqlen_q=1024, seqlen_k=1024), (9, 0))
    assert (short.block_n, short.num_stages, short.forward_max_registers) == (64, 2, 128), short
    assert short.forward_separate_ragged_end == 0 and default_tiles(base, (9, 0)).forward_separate_ragged_end == 1
    # d = 128 causal below 4k keys: 64 x 64 forward tiles with 4 warps, and the two-launch backward with 4-warp
    # dK/dV tiles and a dQ kernel capped at 128 registers (two programs per SM in each kernel); 4k keys keep 128 x 128
    short_causal = default_tiles(dataclasses.replace(base, seqlen_k=1024, window_right=0), (9, 0))
    assert (short_causal.block_m, short_causal.block_n, short_causal.num_warps) == (64, 64, 4), short_causal
    assert (short_causal.backward_schedule, short_causal.bwd_num_warps, short_causal.dq_max_registers) == (2, 4, 128)
    long_causal = default_tiles(dataclasses.replace(base, seqlen_k=4096, window_right=0), (9, 0))
    assert (long_causal.block_m, long_causal.block_n, long_causal.backward_schedule) == (128, 128, 3), long_causal
    windowed = default_tiles(dataclasses.replace(base, seqlen_k=1024, window_left=256, window_right=0), (9, 0))
    assert (windowed.block_m, windowed.block_n) == (128, 64), windowed
    assert default_tiles(dataclasses.replace(base, seqlen_k=1024, window_right=0, varlen=True), (9, 0)).block_m == 128
    assert default_tiles(dataclasses.replace(base, window_right=0), (9, 0)).forward_separate_ragged_end == 0
    assert default_tiles(dataclasses.replace(d64, seqlen_k=1024, window_right=0), (9, 0)).block_m == 64
    assert default_tiles(dataclasses.replace(d64, window_right=0), (9, 0)).block_m == 128
    # packed batches: the Gluon forward at d = 128 (schedule 3, its Triton tile kept for the calls it turns away), the
    # TMA forward at d = 64
    assert default_tiles(dataclasses.replace(base, varlen=True), (9, 0)).forward_schedule == 3
    assert default_tiles(dataclasses.replace(d64, varlen=True), (9, 0)).forward_schedule == 1
    # packed d = 64 batches: 8 warps capped at 128 registers (two programs per SM, as the dense kernel's 107)
    assert default_tiles(dataclasses.replace(d64, varlen=True), (9, 0)).forward_max_registers == 128
    assert default_tiles(d64, (9, 0)).forward_max_registers == 0
    assert default_tiles(dataclasses.replace(base, dtype=torch.float32), (9, 0)).forward_schedule == 0
    assert default_tiles(base, (8, 0)).forward_schedule == 0
    assert all(default_tiles(base, cap).forward_schedule != 2 for cap in ((8, 0), (9, 0), (10, 0)))


def _packed_forward(schedule, q, k, v, cu_q, cu_k, max_q, max_k, kwargs):
    with flashtile.use_backend("triton", forward_schedule=schedule, block_m=16, block_n=16):
        return flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, return_lse=True, **kwargs)


@pytest.mark.parametrize("grid_rows", (2048, 16), ids=("grid-covers-all", "programs-loop"))
@pytest.mark.parametrize("scenario", ("plain", "causal", "window", "everything"))
@pytest.mark.parametrize("lengths", ("mixed", "decode-like"))
def test_tma_forward_of_packed_sequences_equals_pointer_loads(monkeypatch, lengths, scenario, grid_rows, seed):
    """Schedule 1 on packed sequences (sequences without queries or keys among them): descriptors over the packed
    tensors, each sequence's tiles from its cu_seqlens row; the eager rule against float64, out and lse within its
    bounds of the pointer kernel's; with a grid smaller than the longest sequence the programs loop over its
    blocks."""
    from flashtile.triton import configs

    monkeypatch.setattr(configs, "VARLEN_GRID_ROWS", grid_rows)
    dtype = torch.float16
    q, k, v, cu_q, cu_k, max_q, max_k = packed_inputs(LENGTHS[lengths], 4, 2, 24, 40, dtype)
    kwargs = VARLEN_SCENARIOS[scenario](len(LENGTHS[lengths]), 4)
    pointer = _packed_forward(0, q, k, v, cu_q, cu_k, max_q, max_k, kwargs)
    monkeypatch.setattr(launch, "attention_fwd_kernel", _MustNotLaunch())
    tma = _packed_forward(1, q, k, v, cu_q, cu_k, max_q, max_k, kwargs)
    _, _, bounds = assert_attention_follows_the_eager_rule(
        tma, flash_attn_varlen_reference(q, k, v, cu_q, cu_k, **kwargs),
        flash_attn_varlen_reference(q, k, v, cu_q, cu_k, dtype=dtype, **kwargs), (q, k, v), dtype, seed)
    assert_within_bounds(("out", "lse"), tma, pointer, bounds, "TMA and pointer loads", seed)


def test_tma_forward_of_packed_sequences_is_not_reached_by_the_next_sequences_values(monkeypatch, seed):
    """A tile that runs past a packed sequence's last key reads the next sequence's rows; their scores are masked,
    and their values must not reach the output even when they are inf (0 * inf): the first sequence's out and lse
    stay finite, follow the oracle of that sequence alone and agree with the pointer kernel's."""
    lengths = [(20, 20), (20, 20)]  # 16-key tiles: keys 16..31 of the first sequence's last tile are 20..31
    q, k, v, cu_q, cu_k, max_q, max_k = packed_inputs(lengths, 2, 2, 16, 16, torch.float16, requires_grad=False)
    k[20:23], v[20:23] = float("inf"), float("inf")
    pointer = _packed_forward(0, q, k, v, cu_q, cu_k, max_q, max_k, {})
    monkeypatch.setattr(launch, "attention_fwd_kernel", _MustNotLaunch())
    tma = _packed_forward(1, q, k, v, cu_q, cu_k, max_q, max_k, {})
    first = {"out": (slice(0, 20),), "lse": (slice(None), slice(0, 20))}
    ref = flash_attn_varlen_reference(q[:20], k[:20], v[:20], cu_q[:2], cu_k[:2])
    eager = flash_attn_varlen_reference(q[:20], k[:20], v[:20], cu_q[:2], cu_k[:2], dtype=torch.float16)
    for (name, rows), a, b, r, e in zip(first.items(), tma, pointer, ref, eager):
        assert torch.isfinite(a[rows]).all(), f"{name} of the first sequence is not finite"
        assert_close_to_oracle(name, a[rows], r, e, torch.float16, seed)
        assert_within_bounds((name,), (a[rows],), (b[rows],), {name: eager_rule_bound(r, e, torch.float16)},
                             "TMA and pointer loads", seed)


def test_warp_specialized_forward_warns_that_it_is_experimental():
    q, k, v = random_qkv(1, 40, 40, 2, 2, 16, 16, torch.float16)
    with flashtile.use_backend("triton", forward_schedule=2):
        with pytest.warns(RuntimeWarning, match=r"forward_schedule=2 .* NaN"):
            flashtile.flash_attn_func(q, k, v)


WS_POSITION_SHAPE = (2, 301, 333, 4, 2, 64, 64)  # seqlen_q % 4 != 0, ragged key end
WS_POSITION_CASES = {"causal": SCENARIOS["causal"], "window": lambda shape: {"window_size": (100, 20)},
                     "alibi": lambda shape: {"alibi_slopes": torch.rand(shape[0], shape[3], device=DEVICE)},
                     "ragged-ends": SCENARIOS["plain"]}


@pytest.mark.parametrize("case", WS_POSITION_CASES.values(), ids=WS_POSITION_CASES.keys())
def test_warp_specialized_128_row_tiles_use_the_right_query_positions(case, seed):
    """Schedule 2 with 128-row tiles (two consumer warpgroups on a GPU) where the query positions enter the
    scores (a band, ALiBi, the mask of a ragged key end) and the lse store (seqlen_q % 4 != 0). Triton's
    warp-specialization pass offset the second warpgroup's positions twice (errors ~0.15 and lse rows one
    tile too far on an H200) until fwd_tma.py gave the descriptors a row value of their own. Three runs:
    the misplaced lse rows had raced with the next tile's."""
    dtype = torch.float16
    q, k, v = random_qkv(*WS_POSITION_SHAPE, dtype)
    kwargs = case(WS_POSITION_SHAPE)
    with flashtile.use_backend("triton", forward_schedule=2, block_m=128, block_n=64, num_warps=4, num_stages=2):
        runs = [flashtile.flash_attn_func(q, k, v, return_lse=True, **kwargs) for _ in range(3)]
    for out, lse in runs[1:]:
        assert torch.equal(out, runs[0][0]) and torch.equal(lse, runs[0][1]), "a rerun differs bitwise"
    (out, lse), (ref_out, ref_lse) = runs[0], flash_attn_reference(q, k, v, **kwargs)
    eager_out, eager_lse = flash_attn_reference(q, k, v, dtype=dtype, **kwargs)
    assert_close_to_oracle("out", out, ref_out, eager_out, dtype, seed)
    assert_close_to_oracle("lse", lse, ref_lse, eager_lse, dtype, seed)


def test_tile_table_uses_the_one_launch_backward_only_where_it_was_measured_to_pay():
    """sm_90 fp16/bf16: one launch with 64 x 128 tiles at d = 128; at d = 64 dense batches take two launches with
    TMA loads and the dQ kernel's own 128 x 64 / 8-warp tile, packed or not, except banded problems below 4k keys
    (one launch; dense causal ones: two launches with 32 x 64 dK/dV tiles); other GPUs and fp32 keep the two
    launches and their tiles; packed batches at d = 128 take two launches with TMA loads in their interior blocks;
    dense ones at d = 128 load the streamed tiles by TMA at every length."""
    import dataclasses

    from flashtile.triton.configs import default_tiles

    d128, d64 = _table_problem(4096, 128), _table_problem(4096, 64)
    tiles = default_tiles(d128, (9, 0))
    assert (tiles.backward_schedule, tiles.bwd_block_m, tiles.bwd_block_n, tiles.bwd_num_warps) == (3, 64, 128, 8)
    assert default_tiles(_table_problem(1024, 128), (9, 0)).backward_schedule == 3
    for seqlen in (1024, 4096, 16384):
        tiles = default_tiles(_table_problem(seqlen, 64), (9, 0))
        assert (tiles.backward_schedule, tiles.dq_tile) == (2, (128, 64, 8)), seqlen
    banded_short = dataclasses.replace(_table_problem(1024, 64), window_right=0)
    tiles = default_tiles(banded_short, (9, 0))  # dense causal below 4k keys: two launches, 32 x 64 dK/dV tiles
    assert (tiles.backward_schedule, tiles.bwd_block_m, tiles.bwd_block_n, tiles.dq_tile) == (2, 32, 64, (128, 64, 8))
    windowed = default_tiles(dataclasses.replace(banded_short, window_left=100), (9, 0))  # a sliding window
    assert (windowed.backward_schedule, windowed.bwd_block_n, windowed.dq_block_m) == (1, 128, 0)
    for seqlen in (4096, 16384):  # packed d = 64 batches as the dense ones (TMA in their interior blocks), their
        # dQ kernel capped at 128 registers (the dense one needs no cap)
        tiles = default_tiles(dataclasses.replace(_table_problem(seqlen, 64), varlen=True), (9, 0))
        assert (tiles.backward_schedule, tiles.dq_tile, tiles.dq_max_registers) == (2, (128, 64, 8), 128), seqlen
        assert default_tiles(_table_problem(seqlen, 64), (9, 0)).dq_max_registers == 0
    packed_banded_short = default_tiles(dataclasses.replace(banded_short, varlen=True), (9, 0))
    assert (packed_banded_short.backward_schedule, packed_banded_short.dq_block_m) == (1, 0)
    packed = default_tiles(dataclasses.replace(d128, varlen=True), (9, 0))  # packed batches: two launches, TMA
    assert (packed.backward_schedule, packed.bwd_block_m, packed.bwd_block_n) == (2, 64, 128)
    for other, capability in ((d128, (8, 0)), (_table_problem(4096, 128, torch.float32), (9, 0)), (d64, (8, 6))):
        tiles = default_tiles(other, capability)
        assert tiles.backward_schedule == 0 and tiles.bwd_block_m == 32, (other, capability)


def test_pipelined_kernels_pad_a_narrow_value_tile_to_the_key_tile_when_the_key_tile_is_padded():
    """The workaround for triton 3.6's out-of-range shared reads (d 40 with dv < 32 on an H200): only where the
    q/k head dim is padded and the value tile is narrower; every other width pair is left alone."""
    from flashtile.triton.host import forward_widths

    def widths(d, block_d, dv, block_dv):
        flags = forward_widths(dict(HEADDIM=d, BLOCK_D=block_d, HEADDIM_V=dv, BLOCK_DV=block_dv))
        return flags["BLOCK_D"], flags["BLOCK_DV"]

    assert widths(40, 64, 8, 16) == (64, 64)
    assert widths(40, 64, 24, 32) == (64, 64)
    assert widths(64, 64, 8, 16) == (64, 16)      # the key tile is not padded: measured correct as it was
    assert widths(8, 16, 40, 64) == (16, 64)      # the value tile is the wider one
    assert widths(128, 128, 128, 128) == (128, 128)


OUTPUTS = ("out", "lse", "dq", "dk", "dv")


@dataclass(frozen=True)
class _Case:
    """A call returning (out, lse), the oracle of the same call (reference(dtype): in float64 by default, or the
    same formula evaluated eagerly in dtype), and the inputs that gradients are taken of."""

    call: Callable
    reference: Callable
    inputs: tuple


def _dense_case(q, k, v, kwargs) -> _Case:
    return _Case(lambda: flashtile.flash_attn_func(q, k, v, return_lse=True, **kwargs),
                 lambda dtype=torch.float64: flash_attn_reference(q, k, v, dtype=dtype, **kwargs), (q, k, v))


def _packed_case(q, k, v, cu_q, cu_k, max_q, max_k, kwargs) -> _Case:
    return _Case(lambda: flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, return_lse=True,
                                                          **kwargs),
                 lambda dtype=torch.float64: flash_attn_varlen_reference(q, k, v, cu_q, cu_k, dtype=dtype, **kwargs),
                 (q, k, v))


def _scenario_inputs(scenario, shape, dtype):
    """q, k, v (requiring gradients) and the flash_attn_func options of SCENARIOS[scenario] on SHAPES[shape]."""
    return (*random_qkv(*SHAPES[shape], dtype, requires_grad=True), SCENARIOS[scenario](SHAPES[shape]))


def _backward_schedule(schedule):
    """Backward schedule `schedule` with ragged 16 x 32 backward tiles."""
    return flashtile.use_backend("triton", backward_schedule=schedule, bwd_block_m=16, bwd_block_n=32)


def _assert_eager_rule_under_backward_schedule(schedule, case: _Case, dtype, seed):
    """case.call() under backward schedule `schedule`: out, lse and the gradients within the eager rule against
    float64. Returns (out, lse, dq, dk, dv), the cotangents used and the eager rule's bound of each output."""
    with _backward_schedule(schedule):
        got = case.call()
        grads, cotangents, bounds = assert_attention_follows_the_eager_rule(
            got, case.reference(), case.reference(dtype), case.inputs, dtype, seed)
    return tuple(got) + tuple(grads), cotangents, bounds


def _run_under_backward_schedule(schedule, case: _Case, cotangents):
    """(out, lse, dq, dk, dv) of case.call() under backward schedule `schedule`, the gradients taken with
    `cotangents` (grad_out, grad_lse)."""
    with _backward_schedule(schedule):
        out, lse = case.call()
        return (out, lse) + tuple(attention_grads(out, lse, case.inputs, *cotangents))


def _assert_backward_schedules_agree(monkeypatch, case: _Case, schedule, other, dtype, seed, kernels_not_run=()):
    """Backward schedule `schedule` within the eager rule against float64 (the launcher's kernels named in
    kernels_not_run must not run under it), and backward schedule `other` within the same bounds of it (each
    output; see conftest: compared bit for bit they would depend on the host's BLAS)."""
    for name in kernels_not_run:
        monkeypatch.setattr(launch, name, _MustNotLaunch())
    first, cotangents, bounds = _assert_eager_rule_under_backward_schedule(schedule, case, dtype, seed)
    monkeypatch.undo()
    second = _run_under_backward_schedule(other, case, cotangents)
    assert_within_bounds(OUTPUTS, first, second, bounds, f"backward schedules {schedule} and {other}", seed)


TWO_LAUNCH_KERNELS = ("attention_bwd_dkdv_kernel", "attention_bwd_dq_kernel")


@pytest.mark.parametrize("scenario", ("plain", "causal", "causal-window", "softcap", "everything"))
@pytest.mark.parametrize("shape", ("mha-square", "gqa-short-q-dv", "mqa-long-q"))
def test_one_launch_backward_follows_the_eager_rule_and_equals_two_launches(monkeypatch, scenario, shape, seed):
    """Backward schedule 1 (attention_bwd_kernel) runs the per-program arithmetic of schedule 0: the eager rule
    against float64, and the gradients of the two launches within its bounds."""
    dtype = torch.float16
    q, k, v, kwargs = _scenario_inputs(scenario, shape, dtype)
    _assert_backward_schedules_agree(monkeypatch, _dense_case(q, k, v, kwargs), 1, 0, dtype, seed,
                                     kernels_not_run=TWO_LAUNCH_KERNELS)


@pytest.mark.parametrize("lengths", ("mixed", "decode-like"))
def test_one_launch_backward_of_packed_sequences_equals_two_launches(monkeypatch, lengths, seed):
    dtype = torch.float32
    q, k, v, cu_q, cu_k, max_q, max_k = packed_inputs(LENGTHS[lengths], 4, 2, 16, 24, dtype)
    case = _packed_case(q, k, v, cu_q, cu_k, max_q, max_k, {"causal": True})
    _assert_backward_schedules_agree(monkeypatch, case, 1, 0, dtype, seed, kernels_not_run=TWO_LAUNCH_KERNELS)


def _record_backward_kernels(monkeypatch, schedule):
    """Recorders replacing the kernels that backward schedule `schedule` launches."""
    names = (("attention_bwd_kernel",) if schedule in (1, 3) else
             ("attention_bwd_dkdv_kernel", "attention_bwd_dq_kernel"))
    recorders = [_RecordingKernel(getattr(launch, name)) for name in names]
    for name, recorder in zip(names, recorders):
        monkeypatch.setattr(launch, name, recorder)
    return recorders


def _assert_tma_backward_agrees_with_pointer_loads(monkeypatch, case: _Case, one_launch, dtype, seed):
    """Backward schedule 2 / 3 (TMA; the TMA path must run) within the eager rule against float64, and 0 / 1
    (pointer loads) within its bounds of it."""
    recorders = _record_backward_kernels(monkeypatch, 2 + int(one_launch))
    tma, cotangents, bounds = _assert_eager_rule_under_backward_schedule(2 + int(one_launch), case, dtype, seed)
    assert all(r.use_tma == [True] for r in recorders), [r.use_tma for r in recorders]
    monkeypatch.undo()
    pointer = _run_under_backward_schedule(int(one_launch), case, cotangents)
    assert_within_bounds(OUTPUTS, tma, pointer, bounds, "TMA and pointer loads", seed)


@pytest.mark.parametrize("one_launch", (False, True), ids=("two-launches", "one-launch"))
@pytest.mark.parametrize("scenario", ("plain", "causal", "causal-window", "everything"))
@pytest.mark.parametrize("shape", ("mha-square", "gqa-short-q-dv", "mqa-long-q"))
def test_tma_backward_follows_the_eager_rule_and_equals_pointer_loads(monkeypatch, one_launch, scenario, shape,
                                                                        seed):
    """Backward schedules 2 / 3 load the streamed Q/dO and K/V tiles by TMA descriptor (rows past the end and
    columns past a padded head dim zero-filled by the copy engine), otherwise the arithmetic of 0 / 1: the eager
    rule against float64, the gradients of 0 / 1 within its bounds; the TMA path must run."""
    dtype = torch.float16
    q, k, v, kwargs = _scenario_inputs(scenario, shape, dtype)
    _assert_tma_backward_agrees_with_pointer_loads(monkeypatch, _dense_case(q, k, v, kwargs), one_launch, dtype, seed)


@pytest.mark.parametrize("one_launch", (False, True), ids=("two-launches", "one-launch"))
@pytest.mark.parametrize("scenario", ("plain", "causal", "everything"))
@pytest.mark.parametrize("lengths", ("mixed", "decode-like"))
def test_tma_backward_of_packed_sequences_equals_pointer_loads(monkeypatch, one_launch, scenario, lengths, seed):
    """Schedules 2 / 3 on packed sequences (among them sequences without queries or without keys): the interior
    blocks come through descriptors over the whole packed tensor, the edge blocks through masked pointer loads
    (past a sequence's end a descriptor reads the next sequence's rows); the eager rule against the per-sequence
    float64 oracle, the gradients of 0 / 1 within its bounds; the TMA path must run."""
    dtype = torch.float32
    q, k, v, cu_q, cu_k, max_q, max_k = packed_inputs(LENGTHS[lengths], 4, 2, 16, 24, dtype)
    case = _packed_case(q, k, v, cu_q, cu_k, max_q, max_k, VARLEN_SCENARIOS[scenario](len(LENGTHS[lengths]), 4))
    _assert_tma_backward_agrees_with_pointer_loads(monkeypatch, case, one_launch, dtype, seed)


@pytest.mark.parametrize("one_launch", (False, True), ids=("two-launches", "one-launch"))
def test_tma_backward_of_packed_sequences_is_not_reached_by_the_next_sequences_values(monkeypatch, one_launch,
                                                                                        seed):
    """With 16-row / 32-key backward tiles a 40-token sequence has interior blocks (by TMA) and edge blocks that
    run into the next sequence's rows (by masked pointer loads). inf in the next sequence's q, k, v and output
    gradient must not reach the first sequence's gradients: finite, within the eager rule of that sequence's own
    oracle, and the pointer loads' within its bounds."""
    dtype = torch.float16
    lengths = [(40, 40), (40, 40)]
    q, k, v, cu_q, cu_k, max_q, max_k = packed_inputs(lengths, 2, 2, 16, 16, dtype, requires_grad=False)
    alone = [t[:40].clone().requires_grad_() for t in (q, k, v)]  # the first sequence by itself, before the inf
    with torch.no_grad():
        for t in (q, k, v):
            t[40:43] = float("inf")
    inputs = tuple(t.requires_grad_() for t in (q, k, v))
    grad_out = torch.randn(80, 2, 16).to(q)
    grad_out[40:43] = float("inf")
    grads = {}
    for schedule in (int(one_launch), 2 + int(one_launch)):
        recorders = _record_backward_kernels(monkeypatch, schedule)
        with flashtile.use_backend("triton", backward_schedule=schedule, bwd_block_m=16, bwd_block_n=32):
            out = flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k)
            grads[schedule] = [g[:40] for g in torch.autograd.grad(out, inputs, grad_out)]
        monkeypatch.undo()
        assert all(r.use_tma == [schedule >= 2] for r in recorders), [r.use_tma for r in recorders]
    oracle, eager = (torch.autograd.grad(flash_attn_varlen_reference(*alone, cu_q[:2], cu_k[:2], dtype=d)[0], alone,
                                         grad_out[:40].to(d)) for d in (torch.float64, dtype))
    bounds = {}
    for name, a, want, e in zip(("dq", "dk", "dv"), grads[2 + int(one_launch)], oracle, eager):
        assert torch.isfinite(a).all(), f"{name} of the first sequence is not finite"
        assert_close_to_oracle(name, a, want, e, dtype, seed)
        bounds[name] = eager_rule_bound(want, e, dtype)
    assert_within_bounds(("dq", "dk", "dv"), grads[2 + int(one_launch)], grads[int(one_launch)], bounds,
                         "TMA and pointer loads (the first sequence)", seed)


@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("schedule", (2, 3), ids=("two-launches", "one-launch"))
def test_tma_backward_takes_pointer_loads_for_one_key(monkeypatch, schedule, causal, seed):
    """seqlen_k 1, which Triton compiles as a constant: the backward compiled with a TMA stream of one constant
    key block crashed triton 3.6's ptxas, so schedules 2 / 3 take pointer loads there (tests/sm90_launches.py
    compiles such launches for sm_90 on a CPU); the gradients follow the eager rule."""
    dtype = torch.float16
    recorders = _record_backward_kernels(monkeypatch, schedule)
    q, k, v = random_qkv(2, 23, 1, 4, 2, 16, 16, dtype, requires_grad=True)
    _assert_eager_rule_under_backward_schedule(schedule, _dense_case(q, k, v, {"causal": causal}), dtype, seed)
    assert all(r.use_tma == [False] for r in recorders), [r.use_tma for r in recorders]


def test_tma_backward_keeps_pointer_loads_where_rows_are_not_16_byte_aligned(monkeypatch):
    """A head dim of 12 fp16 values (24-byte rows) cannot be described to TMA: schedule 3 runs the pointer
    loads, with the gradients of schedule 1."""
    recorder = _RecordingKernel(launch.attention_bwd_kernel)
    monkeypatch.setattr(launch, "attention_bwd_kernel", recorder)
    inputs = random_qkv(1, 20, 30, 1, 1, 12, 12, torch.float16, requires_grad=True)
    grads = []
    for schedule in (1, 3):
        with flashtile.use_backend("triton", backward_schedule=schedule):
            out = flashtile.flash_attn_func(*inputs)
        grads.append(torch.autograd.grad(out.float().square().sum(), inputs))
    for a, b in zip(*grads):
        assert torch.equal(a, b)
    assert recorder.use_tma == [False, False], recorder.use_tma


def test_backward_schedule_is_validated_and_reported():
    with pytest.raises(ValueError, match=r"backward_schedule must be one of \[0, 1, 2, 3, 4, 5\], got 6"):
        with flashtile.use_backend("triton", backward_schedule=6):
            pass
    q = torch.randn(1, 40, 2, 16, device=DEVICE)
    with flashtile.use_backend("triton", backward_schedule=1):
        text = str(flashtile.explain(q, q, q))
    assert "attention_bwd_kernel, the dK/dV and dQ programs in one launch" in text, text
    with flashtile.use_backend("triton"):
        text = str(flashtile.explain(q, q, q))
    assert "attention_bwd_dq_kernel (which also computes each row's delta), then attention_bwd_dkdv_kernel" in text, text


def test_checked_descriptors_equal_triton_descriptors_field_for_field():
    """_heads_view skips TensorDescriptor's checks (already made by _tma_ready); the descriptor it builds must
    still carry every field Triton's own constructor sets (padding and any field a Triton version adds)."""
    import dataclasses

    from triton.tools.tensor_descriptor import TensorDescriptor

    t = torch.randn(2, 37, 3, 24, device=DEVICE).transpose(1, 2).contiguous().transpose(1, 2)  # head-major rows
    assert launch._tma_ready([t], None)
    checked = launch._heads_view(t, 16, 32)
    plain = TensorDescriptor(t, [2, 3, 37, 24], [t.stride(0), t.stride(2), t.stride(1), 1], [1, 1, 16, 32])
    for field in dataclasses.fields(TensorDescriptor):
        if field.name != "base":
            assert getattr(checked, field.name) == getattr(plain, field.name), field.name
    assert checked.base is t


@pytest.mark.parametrize("schedule", (0, 2), ids=("pointer-loads", "tma"))
@pytest.mark.parametrize("scenario", ("plain", "causal", "everything"))
@pytest.mark.parametrize("shape", ("mha-square", "gqa-short-q-dv", "mqa-long-q"))
def test_dq_kernel_with_its_own_tile_follows_the_eager_rule(monkeypatch, schedule, scenario, shape, seed):
    """The two-launch backward with a dQ tile that is not the dK/dV tile transposed (32 query rows against
    16 keys per step, where the transposed dK/dV tile would be 16 rows against 32 keys): gradients within the
    eager rule against float64; dk and dv those of the default dQ tile within its bounds (the dK/dV kernel is the
    same, the delta it reads comes from the dQ kernel)."""
    dtype = torch.float16
    q, k, v, kwargs = _scenario_inputs(scenario, shape, dtype)
    tiles = dict(backward_schedule=schedule, bwd_block_m=32, bwd_block_n=16)
    # two launches: the dQ kernel computes delta (a wrong or missing delta breaks dk and dv against the oracle)
    monkeypatch.setattr(launch, "attention_bwd_preprocess_kernel", _MustNotLaunch())
    with flashtile.use_backend("triton", dq_block_m=32, dq_block_n=16, dq_num_warps=2, **tiles):
        got = flashtile.flash_attn_func(q, k, v, return_lse=True, **kwargs)
    own, cotangents, bounds = assert_attention_follows_the_eager_rule(
        got, flash_attn_reference(q, k, v, **kwargs), flash_attn_reference(q, k, v, dtype=dtype, **kwargs),
        (q, k, v), dtype, seed)
    # the transposed tile named explicitly (on an H200 the d <= 64 table sets a dQ tile of its own), same cotangents
    with flashtile.use_backend("triton", dq_block_m=0, dq_block_n=0, dq_num_warps=0, **tiles):
        default = attention_grads(*flashtile.flash_attn_func(q, k, v, return_lse=True, **kwargs), (q, k, v),
                                  *cotangents)
    # the dQ kernel computes each row's delta for the dK/dV kernel, and a row sum's order follows the tile's layout
    assert_within_bounds(("dk", "dv"), own[1:], default[1:], bounds, "the two dQ tiles", seed)


def test_dq_tile_settings_are_validated_and_reported():
    with pytest.raises(ValueError, match=r"dq_block_m must be a power of two >= 16, got 24"):
        with flashtile.use_backend("triton", dq_block_m=24):
            pass
    # 0 is each dQ setting's default (the dK/dV tile transposed): a full tile tuple with zeros there is valid
    # (tune_triton passes every field; the first GPU run of this branch rejected the table's own tiles)
    with flashtile.use_backend("triton", dq_block_m=0, dq_block_n=0, dq_num_warps=0):
        pass
    q = torch.randn(1, 40, 2, 16, device=DEVICE, requires_grad=True)
    with flashtile.use_backend("triton", backward_schedule=1, dq_block_m=64):
        with pytest.raises(ValueError, match=r"dq_block_m set the dQ kernel's tile or register cap, which only the "
                                             r"two-launch"):
            flashtile.flash_attn_func(q, q, q)
    with flashtile.use_backend("triton", backward_schedule=3, dq_max_registers=128):
        with pytest.raises(ValueError, match=r"dq_max_registers set the dQ kernel's tile or register cap"):
            flashtile.flash_attn_func(q, q, q)
    with pytest.raises(ValueError, match=r"dq_max_registers must be a positive int, got -1"):
        with flashtile.use_backend("triton", dq_max_registers=-1):
            pass
    with flashtile.use_backend("triton", backward_schedule=0, bwd_block_m=16, bwd_block_n=32, dq_block_n=64,
                                dq_num_warps=2):
        text = str(flashtile.explain(q, q, q))
    assert "dQ programs 32 query rows x 64 keys, 2 warps" in text and "2 warps, at most" not in text, text


def test_dq_register_cap_reaches_the_dq_launch_only(monkeypatch):
    """dq_max_registers becomes the dQ kernel's maxnreg launch option (the dK/dV kernel's launch has none) and
    explain() states it; a forced dQ tile drops the table's cap unless the cap is forced too."""
    import dataclasses

    from flashtile._dispatch import BACKENDS
    from flashtile.triton import configs

    dq_recorder = _RecordingKernel(launch.attention_bwd_dq_kernel)
    dkdv_recorder = _RecordingKernel(launch.attention_bwd_dkdv_kernel)
    monkeypatch.setattr(launch, "attention_bwd_dq_kernel", dq_recorder)
    monkeypatch.setattr(launch, "attention_bwd_dkdv_kernel", dkdv_recorder)
    q, k, v = (t.requires_grad_(True) for t in random_qkv(1, 40, 40, 2, 2, 16, 16, torch.float16))
    for cap in (0, 96):
        with flashtile.use_backend("triton", backward_schedule=0, bwd_block_m=16, bwd_block_n=16,
                                   dq_max_registers=cap):
            flashtile.flash_attn_func(q, k, v).sum().backward()
            text = str(flashtile.explain(q, k, v))
        assert ("at most 96 registers" in text) == (cap == 96), text
    assert "maxnreg" not in dq_recorder.calls[0] and dq_recorder.calls[1]["maxnreg"] == 96
    assert all("maxnreg" not in call for call in dkdv_recorder.calls)

    capped = dataclasses.replace(configs.TritonTiles(16, 16, 1, 1, 16, 16, 1, 1), dq_block_m=32, dq_max_registers=128)
    monkeypatch.setattr(configs, "default_tiles", lambda problem, capability: capped)
    problem, choose = _table_problem(1024, 64), BACKENDS["triton"].choose_tiles
    assert choose(problem, {}).dq_max_registers == 128
    assert choose(problem, {"bwd_block_m": 32}).dq_max_registers == 128
    assert choose(problem, {"dq_num_warps": 4}).dq_max_registers == 0
    assert choose(problem, {"dq_block_m": 64, "dq_max_registers": 96}).dq_max_registers == 96
    assert choose(problem, {"backward_schedule": 1}).dq_max_registers == 0  # one launch: no dQ kernel of its own


def test_a_forced_one_launch_schedule_drops_the_tables_dq_tile(monkeypatch):
    """The table's dQ tile belongs to its two-launch schedule: forcing a one-launch schedule over it runs the
    one-launch kernel (the GPU suite's first run with the d = 64 table raised ValueError there instead)."""
    from flashtile.triton import configs

    table = configs.TritonTiles(16, 16, 1, 1, 16, 16, 1, 1, backward_schedule=2, dq_block_m=32, dq_block_n=16,
                                dq_num_warps=2)
    monkeypatch.setattr(configs, "default_tiles", lambda problem, capability: table)
    q = torch.randn(1, 40, 2, 16, device=DEVICE)
    with flashtile.use_backend("triton"):
        text = str(flashtile.explain(q, q, q))
    assert "dQ programs 32 query rows x 16 keys, 2 warps" in text, text
    with flashtile.use_backend("triton", backward_schedule=1):
        text = str(flashtile.explain(q, q, q))
    assert "in one launch" in text and "dQ programs 16 query rows x 16 keys, 1 warps" in text, text
