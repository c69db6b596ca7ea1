"""The fa4 schedule: FlashAttention-4's conditional rescaling and polynomial exponentials in the Triton forwards.

The two moves are tested where they live (the cubic exp2 helper against torch.exp2, the online-softmax step's
decision to keep or move a row's max) and through flash_attn_func against the float64 oracle under the eager rule
(conftest), beside the fa2 schedule: ragged lengths, GQA / MQA, causal rows that see no key, packed batches, the
TMA forward, scores whose maximum rises late by less and by more than the threshold, and gradients through the
shared recompute backward.
"""

from __future__ import annotations

import struct

import pytest
import torch
import triton
import triton.language as tl

import flashtile
from flashtile.reference import flash_attn_reference
from flashtile.triton import configs, launch
from flashtile.triton.common import (EXP2_POLY_COEFFICIENTS, EXP2_POLY_MAX_RELATIVE_ERROR, exp2_columns, exp2_poly,
                                     online_softmax_step)

from conftest import (DEVICE, INTERPRETED, assert_attention_follows_the_eager_rule, assert_close_to_oracle,
                      assert_within_bounds, eager_rule_bound, random_qkv, skip_unsupported)

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@triton.jit
def _exp2_poly_kernel(X, Y, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(Y + offs, exp2_poly(tl.load(X + offs)))


@triton.jit
def _exp2_columns_kernel(X, Y, M: tl.constexpr, N: tl.constexpr, POLY_EVERY: tl.constexpr):
    offs = tl.arange(0, M)[:, None] * N + tl.arange(0, N)[None, :]
    tl.store(Y + offs, exp2_columns(tl.load(X + offs), POLY_EVERY))


@triton.jit
def _two_blocks_kernel(S, V, M_out, L_out, Acc_out, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       THRESHOLD: tl.constexpr):
    """Two online-softmax steps over the score blocks S[0] and S[1] (base 2) with values V[0], V[1]: the running
    max, sum and accumulator after each step."""
    rows = tl.arange(0, BLOCK_M)
    tile = rows[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for step in range(2):
        s = tl.load(S + step * BLOCK_M * BLOCK_N + tile)
        v = tl.load(V + step * BLOCK_M * BLOCK_N + tile)
        acc, l_i, m_i = online_softmax_step(acc, l_i, m_i, s, v, 1.0, True, 0, "ieee", False, THRESHOLD, 0)
        tl.store(M_out + step * BLOCK_M + rows, m_i)
        tl.store(L_out + step * BLOCK_M + rows, l_i)
        tl.store(Acc_out + step * BLOCK_M * BLOCK_N + tile, acc)


def test_exp2_poly_against_torch_exp2():
    """Relative error within EXP2_POLY_MAX_RELATIVE_ERROR (below bf16's and fp16's rounding) from 2^-126 up,
    exactly 0 from -127 down and at -inf, within 2^-126 in between, never NaN."""
    x = torch.cat([torch.linspace(-160.0, 8.0, 8188), torch.tensor([float("-inf"), -1e30, -127.0, 0.0])]).to(DEVICE)
    y = torch.empty_like(x)
    _exp2_poly_kernel[(1,)](x, y, x.numel())
    expected = torch.exp2(x.double())
    assert not y.isnan().any(), "exp2_poly gave NaN"
    normal = x >= -126
    relative = ((y.double() - expected) / expected)[normal].abs().max().item()
    assert relative <= EXP2_POLY_MAX_RELATIVE_ERROR < 2.0**-11, f"exp2_poly: max relative error {relative:.3e}"
    assert (y[x <= -127] == 0).all(), "exp2_poly must give exactly 0 from -127 down and at -inf"
    tiny = (y.double() - expected)[~normal].abs().max().item()
    assert tiny <= 2.0**-126, f"exp2_poly below -126: error {tiny:.3e}"
    assert y[x == 0].item() == 1.0


def test_exp2_poly_coefficients_are_the_gluon_kernels():
    """The Gluon forward's PTX (fwd_gluon._exp2_on_fma_units) evaluates the same cubic."""
    from flashtile.triton.fwd_gluon import _exp2_on_fma_units

    ptx = _exp2_on_fma_units("%x", "%y")
    for c in EXP2_POLY_COEFFICIENTS:
        bits = struct.unpack(">I", struct.pack(">f", c))[0]
        assert f"0f{bits:08X}" in ptx, f"coefficient {c!r} (0f{bits:08X}) not in the Gluon kernel's PTX"


@pytest.mark.parametrize("every", (2, 4, 8))
def test_exp2_columns_takes_one_column_in_n_by_the_polynomial(every):
    x = (torch.randn(16, 32, dtype=torch.float64) * 4 - 4).float().to(DEVICE)
    plain, mixed, poly = (torch.empty_like(x) for _ in range(3))
    _exp2_columns_kernel[(1,)](x, plain, 16, 32, 0)
    _exp2_columns_kernel[(1,)](x, mixed, 16, 32, every)
    _exp2_poly_kernel[(1,)](x.flatten(), poly, x.numel())
    by_poly = torch.arange(32, device=DEVICE) % every == every - 1
    assert torch.equal(mixed[:, by_poly], poly.view(16, 32)[:, by_poly]), "the polynomial's columns differ"
    assert torch.equal(mixed[:, ~by_poly], plain[:, ~by_poly]), "the exp2 unit's columns differ"


def test_the_step_keeps_the_max_below_the_threshold_and_moves_it_above():
    """Rows of the second block whose max rises by 5 keep the first block's max (probabilities up to 2^5, acc and l
    not rescaled); a rise of 20 moves it; a row whose first block was all masked takes the second block's max; a
    row whose max falls keeps it. acc / l and m + log2(l) are the softmax's either way."""
    block_m, block_n, threshold = 16, 16, 8
    s = torch.randn(2, block_m, block_n, dtype=torch.float64)
    rise = torch.zeros(block_m, dtype=torch.float64)
    rise[:4], rise[4:8], rise[8:12] = 5.0, 20.0, -3.0  # rows 12..15: the first block masked
    s[1] += (s[0].amax(1) - s[1].amax(1) + rise)[:, None]  # second block's max = first's + rise
    s[0, 12:] = float("-inf")
    v = torch.randn(2, block_m, block_n, dtype=torch.float64)
    m, l_out, acc = (torch.empty(2, block_m, device=DEVICE), torch.empty(2, block_m, device=DEVICE),
                     torch.empty(2, block_m, block_n, device=DEVICE))
    s32, v32 = s.float().to(DEVICE), v.float().to(DEVICE)
    _two_blocks_kernel[(1,)](s32, v32, m, l_out, acc, block_m, block_n, threshold)
    s, v = s32.double().cpu(), v32.double().cpu()
    first_max, second_max = s[0].amax(1), s[1].amax(1)
    kept = torch.tensor([True] * 4 + [False] * 4 + [True] * 4 + [False] * 4)
    want_m = torch.where(kept, first_max, second_max)
    assert torch.equal(m[0].cpu().double(), first_max), "the first block sets every visible row's max"
    assert torch.equal(m[1].cpu().double(), want_m), f"max after the second block: {m[1]} expected {want_m}"
    assert (l_out[1, :4] > 2.0**4).all(), "rows that kept their max sum probabilities up to 2^5"
    p = torch.exp2(s - want_m[None, :, None])
    p[0, 12:] = 0.0
    want_l = p.sum((0, 2))
    want_acc = torch.einsum("bmn,bnd->md", p, v)
    torch.testing.assert_close(l_out[1].cpu().double(), want_l, rtol=1e-5, atol=0)
    torch.testing.assert_close(acc[1].cpu().double(), want_acc, rtol=1e-5, atol=1e-5)
    softmax = torch.softmax(torch.cat([s[0], s[1]], 1) * torch.log(torch.tensor(2.0)), 1)
    torch.testing.assert_close((acc[1].cpu() / l_out[1].cpu()[:, None]).double(),
                               softmax @ torch.cat([v[0], v[1]], 0), rtol=1e-5, atol=1e-5)


def _fa4_and_fa2(q, k, v, dtype, seed, **kwargs):
    """fa4 and fa2 through flash_attn_func, each within the eager rule of the oracle and within its bound of the
    other; rows that see no key exactly out = 0, lse = -inf in fa4."""
    ref = flash_attn_reference(q, k, v, **kwargs)
    eager = flash_attn_reference(q, k, v, dtype=dtype, **kwargs)
    lse_dtype = torch.float32 if dtype == torch.float32 else dtype
    bounds = {"out": eager_rule_bound(ref[0], eager[0], dtype), "lse": eager_rule_bound(ref[1], eager[1], lse_dtype)}
    results = {}
    for name in ("fa4", "fa2"):
        with flashtile.use_backend("triton", schedule=name):
            results[name] = flashtile.flash_attn_func(q, k, v, return_lse=True, **kwargs)
        out, lse = results[name]
        assert out.dtype == dtype and lse.dtype == torch.float32
        assert_close_to_oracle(f"out ({name})", out, ref[0], eager[0], dtype, seed)
        assert_close_to_oracle(f"lse ({name})", lse, ref[1], eager[1], lse_dtype, seed)
    out, lse = results["fa4"]
    empty = ref[1].isneginf()
    assert torch.equal(lse.isneginf(), empty), f"fa4: rows with lse -inf differ from the oracle's (seed {seed})"
    assert (out.transpose(1, 2)[empty] == 0).all(), f"fa4: a row that sees no key has a nonzero output (seed {seed})"
    assert_within_bounds(("out", "lse"), results["fa4"], results["fa2"], bounds, "fa4 and fa2", seed)
    return results


# (batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, headdim_v), keyword arguments
CASES = {
    "q37-k100-gqa-dv": ((1, 37, 100, 4, 2, 32, 48), {}),
    "q75-k30-causal-mqa": ((2, 75, 30, 2, 1, 16, 16), {"causal": True}),  # the first 45 rows see no key
    "window-scale": ((1, 70, 53, 2, 2, 16, 16), {"window_size": (5, 3), "softmax_scale": 0.5}),
}


@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16), ids=("fp16", "bf16"))
@pytest.mark.parametrize("case", CASES.keys())
def test_fa4_follows_the_eager_rule_beside_fa2(case, dtype, seed):
    """fp16 / bf16, where both moves run (fp32 keeps every exponential on the exp2 unit; its fa4 is checked in
    test_schedules.py's invariant, the rising scores and the gradients here)."""
    skip_unsupported("triton", dtype)
    shape, kwargs = CASES[case]
    q, k, v = random_qkv(*shape, dtype)
    _fa4_and_fa2(q, k, v, dtype, seed, **kwargs)


def _growing_scores(rise_per_key: float, seqlen_k: int, dtype):
    """One head whose scores grow by rise_per_key (natural units, softmax_scale 1) with every key: each 16-key
    block raises every row's max by 16 x rise_per_key; values random."""
    q = torch.zeros(1, 16, 1, 16, dtype=torch.float64)
    q[..., 0] = 1.0
    q[..., 1] = torch.randn(1, 16, 1, dtype=torch.float64)
    k = torch.zeros(1, seqlen_k, 1, 16, dtype=torch.float64)
    k[0, :, 0, 0] = rise_per_key * torch.arange(seqlen_k, dtype=torch.float64)
    k[0, :, 0, 1] = torch.randn(seqlen_k, dtype=torch.float64)
    v = torch.randn(1, seqlen_k, 1, 16, dtype=torch.float64)
    return tuple(t.to(device=DEVICE, dtype=dtype) for t in (q, k, v))


@pytest.mark.parametrize("rise", (100.0 / 16, 0.25), ids=("by-100-per-block", "by-4-per-block"))
@pytest.mark.parametrize("dtype", (torch.float32, torch.float16), ids=("fp32", "fp16"))
def test_scores_rising_in_every_block(rise, dtype, seed):
    """The max rises in every key block, the last one included: by 100 (natural units; 144 in base 2, far over the
    threshold: every block must move it, or exp2 overflows) or by 4 (5.8 in base 2: a block keeps the stale max,
    the next moves it; kept forever, probabilities would reach 2^52 and overflow fp16's P). fa4 within the eager
    rule of the oracle and of fa2."""
    q, k, v = _growing_scores(rise, 144, dtype)
    _fa4_and_fa2(q, k, v, dtype, seed, softmax_scale=1.0)


def test_fa4_tma_forward_and_packed_batches(seed):
    """The TMA forward (forward_schedule=1) and a packed batch with the fa4 moves, against the oracle."""
    dtype = torch.float16
    q, k, v = random_qkv(1, 45, 61, 4, 2, 32, 32, dtype)
    kwargs = {"causal": True}
    ref, eager = flash_attn_reference(q, k, v, **kwargs), flash_attn_reference(q, k, v, dtype=dtype, **kwargs)
    with flashtile.use_backend("triton", schedule="fa4", forward_schedule=1):
        out, lse = flashtile.flash_attn_func(q, k, v, return_lse=True, **kwargs)
    assert_close_to_oracle("out (fa4, TMA)", out, ref[0], eager[0], dtype, seed)
    assert_close_to_oracle("lse (fa4, TMA)", lse, ref[1], eager[1], dtype, seed)
    lengths = (7, 40, 19)
    cu = torch.tensor([0, 7, 47, 66], dtype=torch.int32, device=DEVICE)
    q, k, v = random_qkv(1, 66, 66, 2, 1, 16, 16, dtype)
    with flashtile.use_backend("triton", schedule="fa4"):
        out = flashtile.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, max(lengths), max(lengths), causal=True)
    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist()):
        piece = (t[:, start:end] for t in (q, k, v))
        q_i, k_i, v_i = piece
        ref_out, _ = flash_attn_reference(q_i, k_i, v_i, causal=True)
        eager_out, _ = flash_attn_reference(q_i, k_i, v_i, causal=True, dtype=dtype)
        assert_close_to_oracle(f"out (fa4, packed rows {start}..{end})", out[start:end][None], ref_out, eager_out,
                               dtype, seed)


@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16), ids=("fp16", "bf16"))
def test_fa4_gradients_through_the_shared_backward(dtype, seed):
    """fp16 / bf16, where both moves run; the backward recomputes P from fa4's lse, which must be the true one."""
    skip_unsupported("triton", dtype)
    q, k, v = random_qkv(2, 45, 61, 4, 2, 32, 24, dtype, requires_grad=True)
    with flashtile.use_backend("triton", schedule="fa4"):
        got = flashtile.flash_attn_func(q, k, v, causal=True, return_lse=True)
        assert_attention_follows_the_eager_rule(got, flash_attn_reference(q, k, v, causal=True),
                                                flash_attn_reference(q, k, v, causal=True, dtype=dtype), (q, k, v),
                                                dtype, seed)


class _Recorder:
    """Wraps a kernel and records the keyword arguments of its launches."""

    def __init__(self, kernel):
        self.kernel, self.calls = kernel, []

    def __getitem__(self, grid):
        def launch_kernel(*args, **kwargs):
            self.calls.append(kwargs)
            return self.kernel[grid](*args, **kwargs)
        return launch_kernel


@pytest.mark.skipif(not INTERPRETED, reason="the interpreter's tiles")
def test_fa4_compiles_its_own_kernel_and_fa2_the_plain_one(monkeypatch):
    """fa4 launches the forward with RESCALE_THRESHOLD 8 and EXP2_POLY_EVERY 4 (fp16 / bf16) or 0 (fp32); fa2 with
    both 0: two compiled kernels, not one under two names. explain() says which and what sm_90 lacks."""
    recorder = _Recorder(launch.attention_fwd_kernel)
    monkeypatch.setattr(launch, "attention_fwd_kernel", recorder)
    for dtype, every in ((torch.float16, configs.FA4_EXP2_POLY_EVERY), (torch.float32, 0)):
        q, k, v = random_qkv(1, 20, 30, 2, 1, 16, 16, dtype)
        for name, expected in (("fa4", (configs.FA4_RESCALE_THRESHOLD, every)), ("fa2", (0, 0))):
            recorder.calls.clear()
            with flashtile.use_backend("triton", schedule=name):
                flashtile.flash_attn_func(q, k, v)
                text = flashtile.explain(q, k, v)
            call = recorder.calls[-1]
            assert (call["RESCALE_THRESHOLD"], call["EXP2_POLY_EVERY"]) == expected, (name, dtype, call)
            assert text.startswith(f"backend: 'triton', schedule {name!r} (forced)"), text
            assert ("FA4's Blackwell-only moves do not exist on sm_90" in text) == (name == "fa4"), text
            assert ("FlashAttention-4's moves" in text) == (name == "fa4"), text
    with flashtile.use_backend("triton", schedule="fa4", rescale_threshold=4, exp2_poly_every=0):
        recorder.calls.clear()
        flashtile.flash_attn_func(q, k, v)
    assert (recorder.calls[-1]["RESCALE_THRESHOLD"], recorder.calls[-1]["EXP2_POLY_EVERY"]) == (4, 0)


def test_fa4_in_the_registry():
    by_name = {s.name: s for s in flashtile.schedules(DEVICE, torch.bfloat16)}
    fa4 = by_name["fa4"]
    assert "RESCALE_THRESHOLD=8" in fa4.forward_kernel and "attention_fwd_tma_kernel" in fa4.forward_kernel
    assert "attention_fwd_gluon_kernel" in fa4.forward_kernel and "EXP2_EMULATED=4" in fa4.forward_kernel
    assert "two-CTA MMA" in fa4.description and "tensor memory" in fa4.description
    assert fa4.backward_kernel.startswith(by_name["fa2"].backward_kernel)
    if INTERPRETED:
        assert fa4.available, fa4.reason


def test_fa4_tiles_take_two_stages_at_128_key_blocks_on_a_gpu():
    """The column split of the exponentials needs shared memory: fa4's d = 128 sm_90 tile (128 keys per block) takes
    2 stages where fa2's takes 3; fp32 runs the rescaling alone; the interpreter keeps fa2's tiles."""
    from flashtile._validate import AttentionProblem

    def problem(dtype, headdim):
        return AttentionProblem(batch=1, nheads=16, nheads_k=16, seqlen_q=4096, seqlen_k=4096, headdim=headdim,
                                headdim_v=headdim, dtype=dtype, device=torch.device("cpu"), softmax_scale=0.1,
                                window_left=-1, window_right=-1, diagonal_offset=0, alignment="bottom-right",
                                softcap=0.0, has_alibi=False, mask_kind=None)

    wide = problem(torch.bfloat16, 128)
    fa2, fa4 = configs.portable_tiles(wide, (9, 0)), configs.fa4_tiles(wide, (9, 0))
    assert (fa2.block_n, fa2.num_stages) == (128, 3) and (fa4.block_n, fa4.num_stages) == (128, 2)
    assert (fa4.rescale_threshold, fa4.exp2_poly_every) == (8, 4)
    narrow = problem(torch.bfloat16, 64)
    assert configs.fa4_tiles(narrow, (9, 0)).num_stages == configs.portable_tiles(narrow, (9, 0)).num_stages
    assert configs.fa4_tiles(problem(torch.float32, 64), (9, 0)).exp2_poly_every == 0
    assert configs.fa4_tiles(wide, None).num_stages == configs.portable_tiles(wide, None).num_stages


@pytest.mark.parametrize("headdim, seqlen, causal", [(64, 1024, True), (128, 1024, True), (64, 16384, False),
                                                     (128, 4096, False)])
def test_fa4_runs_on_top_of_fa3_where_the_gluon_forward_serves_the_call(headdim, seqlen, causal, monkeypatch):
    """On sm_90 for fp16 / bf16 fa4 is the table's Gluon setting with both moves (the Triton settings beside it, for a
    call whose tensors the Gluon forward turns away at launch); fp32, which the Gluon forward does not take, runs them
    on fa2's kernels."""
    from sm90_launches import problem_for

    monkeypatch.setattr(configs, "interpreting", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    import dataclasses

    problem = dataclasses.replace(problem_for(seqlen, seqlen, headdim, headdim, torch.bfloat16, causal),
                                  device=torch.device("cuda"))
    table, fa4 = configs.default_tiles(problem, (9, 0)), configs.fa4_tiles(problem, (9, 0))
    assert fa4.forward_schedule == 3 and configs.gluon_unserved_reason(problem, fa4.gluon_tile) == ""
    assert fa4.gluon_tile == dataclasses.replace(table.gluon_tile, exp2_emulated=4, rescale_threshold=8)
    assert (fa4.rescale_threshold, fa4.exp2_poly_every) == (8, 4)
    text = fa4.describe(problem)
    assert "one exponential in 4 on the FMA units" in text and "moved only when a block raises it by more than 8" in text
    fp32 = dataclasses.replace(problem, dtype=torch.float32)
    assert configs.fa4_tiles(fp32, (9, 0)).forward_schedule != 3


SETTING_ERRORS = {
    "threshold with fa2": ({"schedule": "fa2", "rescale_threshold": 8}, torch.float16,
                           "rescale_threshold belong to schedule 'fa4'"),
    "poly without a schedule": ({"exp2_poly_every": 2}, torch.float16, "exp2_poly_every belong to schedule 'fa4'"),
    "threshold 16": ({"schedule": "fa4", "rescale_threshold": 16}, torch.float16,
                     "rescale_threshold must be in 0..15"),
    "poly every 3": ({"schedule": "fa4", "exp2_poly_every": 3}, torch.float16, "exp2_poly_every must be 0, 2, 4 or 8"),
    "poly with fp32": ({"schedule": "fa4", "exp2_poly_every": 4}, torch.float32,
                       "exp2_poly_every=4 needs fp16 or bf16 inputs, got torch.float32"),
    "forward schedule 3": ({"schedule": "fa4", "forward_schedule": 3}, torch.float16,
                           "forward_schedule=3 contradicts schedule 'fa4'"),
}


@pytest.mark.parametrize("settings, dtype, message", SETTING_ERRORS.values(), ids=SETTING_ERRORS.keys())
def test_fa4_settings_are_checked(settings, dtype, message):
    q, k, v = random_qkv(1, 20, 30, 2, 1, 16, 16, dtype)
    with pytest.raises(ValueError, match=message):
        with flashtile.use_backend("triton", **settings):
            flashtile.flash_attn_func(q, k, v)


def test_fa4_does_not_serve_the_kv_cache():
    q, k, v = random_qkv(2, 1, 9, 2, 1, 16, 16, torch.float32)
    with flashtile.use_backend("triton", schedule="fa4"):
        with pytest.raises(flashtile.BackendUnavailableError, match="schedule 'fa4' .*the decode schedule's"):
            flashtile.flash_attn_with_kvcache(q, k, v, cache_seqlens=4)
