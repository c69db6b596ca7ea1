"""Realistic shapes on a CUDA GPU: the Triton kernels against the float64 oracle, bf16 and fp16.

Runs with FLASHTILE_TEST_DEVICE=cuda (on the H200 of BENCHMARKS.md); elsewhere every test here
is skipped with that reason, since the CPU interpreter cannot run these sizes. The small-shape
suite (test_flash_attn.py and friends) runs on the GPU too under the same variable.
"""

from __future__ import annotations

import pytest
import torch

import flashtile
from flashtile.reference import flash_attn_reference

from conftest import DEVICE, assert_attention_follows_the_eager_rule, assert_close_to_oracle, random_qkv

pytestmark = pytest.mark.skipif(DEVICE.type != "cuda", reason="needs a CUDA GPU: run with FLASHTILE_TEST_DEVICE=cuda")

# (batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, headdim_v), options
CASES = {
    "d128-causal": ((2, 2048, 2048, 8, 8, 128, 128), {"causal": True}),
    "d64-gqa": ((2, 2048, 2048, 16, 4, 64, 64), {}),
    "d128-mqa-causal-rect": ((1, 1000, 3000, 8, 1, 128, 128), {"causal": True}),
    "d72-dv40-window": ((2, 1537, 1537, 4, 2, 72, 40), {"window_size": (256, 17)}),
    "d256-softcap-alibi": ((1, 1024, 1024, 4, 4, 256, 256), {"causal": True, "softcap": 30.0, "alibi": True}),
    "d96-long-q-causal": ((1, 3000, 700, 4, 2, 96, 96), {"causal": True}),
    # long enough for the Hopper forward schedules of the tile table (TMA; TMA + warp specialization)
    "d128-gqa-long-ragged": ((1, 4100, 4100, 8, 2, 128, 128), {}),
    "d64-causal-long-ragged": ((1, 4500, 4500, 4, 4, 64, 64), {"causal": True}),
    # short problems' tiles: d = 128 without a band (64-key blocks at most 128 registers), d = 64 with a band
    # (64 query rows); ragged ends
    "d128-gqa-short-ragged": ((2, 1000, 1000, 8, 2, 128, 128), {}),
    "d64-causal-short-ragged": ((2, 1000, 1000, 8, 8, 64, 64), {"causal": True}),
    # d = 64 causal below 4k keys: two launches with 32 x 64 dK/dV tiles; one K/V head, ragged
    "d64-mqa-causal-rect": ((1, 1000, 3000, 8, 1, 64, 64), {"causal": True}),
}


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=("bf16", "fp16"))
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_triton_realistic_shapes(case, dtype, seed):
    shape, options = case
    kwargs = dict(options)
    if kwargs.pop("alibi", False):
        kwargs["alibi_slopes"] = torch.rand(shape[3], device=DEVICE) * 0.1
    q, k, v = random_qkv(*shape, dtype, requires_grad=True)
    with flashtile.use_backend("triton"):
        got = flashtile.flash_attn_func(q, k, v, return_lse=True, **kwargs)
    assert_attention_follows_the_eager_rule(got, flash_attn_reference(q, k, v, **kwargs),
                                            flash_attn_reference(q, k, v, dtype=dtype, **kwargs), (q, k, v), dtype,
                                            seed)


# A learnable sink through the tile table's kernels: the Gluon forward on sm_90 (the sink joined in its epilogue) and
# the table's backward, with rows that see no key (causal, seqlen_q > seqlen_k) and ragged ends past 4k
SINK_CASES = {
    "d128-gqa-causal": ((2, 2048, 2048, 16, 4, 128, 128), {"causal": True}),
    "d64-long-q-causal-masked-rows": ((1, 3000, 700, 8, 2, 64, 64), {"causal": True}),
    "d128-gqa-long-ragged": ((1, 4100, 4100, 8, 2, 128, 128), {}),
}


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=("bf16", "fp16"))
@pytest.mark.parametrize("case", SINK_CASES.values(), ids=SINK_CASES.keys())
def test_triton_realistic_shapes_with_a_learnable_sink(case, dtype, seed):
    shape, kwargs = case
    q, k, v = random_qkv(*shape, dtype, requires_grad=True)
    sink = (torch.randn(shape[3], device=DEVICE) + 1.0).requires_grad_(True)
    with flashtile.use_backend("triton"):
        got = flashtile.flash_attn_func(q, k, v, return_lse=True, learnable_sink=sink, **kwargs)
    assert_attention_follows_the_eager_rule(got, flash_attn_reference(q, k, v, learnable_sink=sink, **kwargs),
                                            flash_attn_reference(q, k, v, dtype=dtype, learnable_sink=sink, **kwargs),
                                            (q, k, v, sink), dtype, seed, names=("dq", "dk", "dv", "dsink"))


# The Gluon forward (forward_schedule 3) in each of its settings, forced, on the edges its schedule has: one key or
# query, ragged ends of both, seqlen_q != seqlen_k both ways (fully masked rows when causal and seqlen_q > seqlen_k),
# GQA 8:1, dv != d, a padded head dim, windows, softcap and ALiBi (forward only: the backward is the Triton one)
# (settings that cannot start a tile under the last one's P V say gluon_across_tiles=0: the table adds it to short
# calls, and a forced setting it does not combine with would send the call to the Triton forward)
GLUON_SETTINGS = {"table": {}, "no-overlap": dict(gluon_overlap=0, gluon_across_tiles=0),
                  "pingpong": dict(gluon_pingpong=1),
                  "one-cta-per-tile": dict(gluon_persistent=0), "overlap-pingpong-one-cta": dict(
                      gluon_pingpong=1, gluon_persistent=0), "three-stages": dict(gluon_stages=3, gluon_across_tiles=0),
                  "three-consumers": dict(gluon_consumers=3, gluon_across_tiles=0),
                  "three-consumers-one-cta-per-tile": dict(
                      gluon_consumers=3, gluon_overlap=0, gluon_persistent=0, gluon_across_tiles=0),
                  "dealt-tiles": dict(gluon_persistent=1, gluon_balanced=1),
                  "256-key-blocks": dict(gluon_block_n=256, gluon_overlap=0, gluon_across_tiles=0),
                  "fma-exponentials": dict(gluon_exp2_emulated=4),
                  "across-tiles": dict(gluon_across_tiles=1),
                  "across-tiles-dealt-pingpong": dict(gluon_across_tiles=1, gluon_balanced=1, gluon_pingpong=1),
                  "across-tiles-dealt": dict(gluon_across_tiles=1, gluon_balanced=1),
                  "one-consumer": dict(gluon_consumers=1, gluon_block_n=64, gluon_pingpong=0),
                  "one-consumer-dealt-across-tiles": dict(gluon_consumers=1, gluon_balanced=1, gluon_across_tiles=1),
                  # the first consumer's last block on its first half (bands closing at a diagonal offset by a
                  # multiple of 128 only; with the table's across-tiles where it takes it)
                  "half-diagonal": dict(gluon_half_diagonal=1),
                  "half-diagonal-pingpong": dict(gluon_half_diagonal=1, gluon_pingpong=1, gluon_balanced=1),
                  "half-diagonal-one-cta": dict(gluon_half_diagonal=1, gluon_persistent=0, gluon_across_tiles=0)}
GLUON_CASES = {
    "one-key": ((2, 113, 1, 4, 4, 64, 64), {}),
    "one-query-causal": ((2, 1, 1023, 4, 4, 128, 128), {"causal": True}),
    "ragged-7": ((3, 7, 7, 4, 2, 64, 64), {"causal": True}),
    "long-q-causal-masked-rows": ((1, 1023, 113, 8, 1, 128, 128), {"causal": True}),
    "long-k-gqa8": ((1, 257, 4097, 16, 2, 128, 128), {"causal": True}),
    "dv64-d128": ((2, 500, 600, 4, 4, 128, 64), {}),
    "d96-window": ((2, 700, 700, 4, 4, 96, 96), {"window_size": (100, 50)}),
    "softcap-alibi": ((2, 600, 650, 4, 4, 128, 128), {"causal": True, "softcap": 30.0, "alibi": True}),
    # the output staged in the query rows' buffer: more tiles than SMs, so that a CTA loads a second tile's query
    # rows into the buffer its first tile's output left
    "d256-causal-many-tiles": ((4, 1000, 1000, 8, 2, 256, 256), {"causal": True}),
    # d = 64, where blocks of 256 keys run: rows that see no key, a ragged end past several blocks with GQA
    "d64-causal-masked-rows": ((1, 700, 300, 4, 4, 64, 64), {"causal": True}),
    "d64-long-k-gqa4": ((1, 257, 4097, 8, 2, 64, 64), {}),
    # more tiles than SMs, so that a CTA takes several (with gluon_across_tiles, starting each under the last):
    # ragged tiles with GQA, softcap with seqlen_q > seqlen_k, dv != d, ALiBi per head; causal with whole tiles
    # whose rows see no key, a window
    "d64-gqa8-many-tiles": ((8, 1000, 1000, 16, 2, 64, 64), {}),
    "d128-softcap-long-q-many-tiles": ((4, 1500, 400, 16, 4, 128, 128), {"softcap": 30.0}),
    "d128-alibi-many-tiles": ((4, 1000, 1000, 16, 4, 128, 128), {"alibi": True}),
    "d96-dv64-many-tiles": ((4, 1000, 1000, 16, 16, 96, 64), {}),
    "d128-causal-masked-tiles-alibi-many": ((4, 1500, 400, 16, 4, 128, 128), {"causal": True, "alibi": True}),
    "d96-window-many-tiles": ((4, 1000, 1000, 16, 16, 96, 96), {"window_size": (200, 0)}),
    # causal with every row seeing a key (where gluon_across_tiles serves a band), more tiles than SMs
    "d64-causal-gqa8-many-tiles": ((8, 1000, 1000, 16, 2, 64, 64), {"causal": True}),
    "d128-causal-long-k-many-tiles": ((4, 900, 1000, 16, 4, 128, 128), {"causal": True}),
    # a learnable sink (joined in the epilogue): rows that see no key (out 0, lse = the sink; one head's sink -inf,
    # whose such rows keep lse -inf), many tiles started under the last one's P V, a window with softcap
    "sink-causal-masked-rows": ((1, 1023, 113, 8, 1, 128, 128), {"causal": True, "sink": True}),
    "d64-sink-causal-gqa8-many-tiles": ((8, 1000, 1000, 16, 2, 64, 64), {"causal": True, "sink": True}),
    "d128-sink-window-softcap": ((2, 700, 650, 4, 4, 128, 128), {"window_size": (100, 50), "softcap": 30.0,
                                                                 "sink": True}),
}


def _gluon_serves(case, settings) -> bool:
    """Three consumer warpgroups (160 registers each) and blocks of 256 keys (their shared memory) are d <= 64 settings,
    whose 256-wide heads take blocks of 64 keys; one consumer (two CTAs per SM) takes heads up to 128 wide with blocks of
    64 keys and up to 64 with 128; three stages, and two tiles' query rows (gluon_across_tiles), do not fit 256-wide
    heads; the latter is built for calls without a left band edge or ALiBi whose every row sees a key. The first
    consumer's last block on its first half (gluon_half_diagonal) serves bands that close at the diagonal, offset by a
    multiple of 128 (_half_diagonal_admits), with blocks of 128 keys (not the 64 that 256-wide heads take)."""
    (_, seqlen_q, seqlen_k, *_), options = case
    unlike_across = ("window_size" in options or options.get("alibi")
                     or (options.get("causal") and seqlen_q > seqlen_k))
    return _serves_widths(case[0][5:], settings) and not (unlike_across and settings.get("gluon_across_tiles")) and \
        not (settings.get("gluon_half_diagonal") and not _half_diagonal_admits(seqlen_q, seqlen_k, options))


def _half_diagonal_admits(seqlen_q, seqlen_k, options) -> bool:
    """Whether a dense call's band closes at the diagonal (causal, or window_right 0) and seqlen_k - seqlen_q is a
    multiple of 128: where each tile's last block starts at its first row plus that offset
    (configs._half_diagonal_reason)."""
    closes_at_the_diagonal = options.get("causal") or options.get("window_size", (-1, -1))[1] == 0
    return bool(closes_at_the_diagonal) and (seqlen_k - seqlen_q) % 128 == 0


def _serves_widths(widths, settings) -> bool:
    width = max(widths)
    return not ((settings.get("gluon_consumers") == 3 and width > 64) or
                (settings.get("gluon_consumers") == 1 and width > (128 if settings.get("gluon_block_n") == 64 else 64))
                or
                (settings.get("gluon_block_n") == 256 and 64 < width <= 128) or
                ((settings.get("gluon_stages") == 3 or settings.get("gluon_across_tiles")
                  or settings.get("gluon_half_diagonal")) and width > 128))


GLUON_PARAMS = [pytest.param(case, settings, id=f"{case_id}-{settings_id}")
                for case_id, case in GLUON_CASES.items() for settings_id, settings in GLUON_SETTINGS.items()
                if _gluon_serves(case, settings)]


@pytest.mark.parametrize("case, settings", GLUON_PARAMS)
def test_gluon_forward_follows_the_oracle_and_repeats_its_bits(case, settings, seed):
    shape, options = case
    kwargs = dict(options)
    if kwargs.pop("alibi", False):
        kwargs["alibi_slopes"] = torch.rand(shape[3], device=DEVICE) * 0.1
    if kwargs.pop("sink", False):
        kwargs["learnable_sink"] = (torch.randn(shape[3], device=DEVICE) + 1.0).index_fill_(
            0, torch.tensor([0], device=DEVICE), float("-inf"))
    q, k, v = random_qkv(*shape, torch.bfloat16)
    with flashtile.use_backend("triton", forward_schedule=3, **settings):
        assert "attention_fwd_gluon_kernel" in flashtile.explain(q, k, v, **kwargs)
        out, lse = flashtile.flash_attn_func(q, k, v, return_lse=True, **kwargs)
        again = flashtile.flash_attn_func(q, k, v, return_lse=True, **kwargs)
    assert torch.equal(out, again[0]) and torch.equal(lse, again[1]), "a rerun changed bits"
    (ref_out, ref_lse), (eager_out, eager_lse) = (flash_attn_reference(q, k, v, **kwargs),
                                                  flash_attn_reference(q, k, v, dtype=torch.bfloat16, **kwargs))
    assert torch.equal(lse.isinf(), ref_lse.isinf()), "rows that see no key must have lse -inf, and only those"
    assert_close_to_oracle("out", out, ref_out, eager_out, torch.bfloat16, seed)
    assert_close_to_oracle("lse", lse, ref_lse, eager_lse, torch.bfloat16, seed)


# The first consumer's last block on its first half (gluon_half_diagonal, opt-in), forced with and without each
# tile started under the last: causal calls whose diagonal is offset by whole blocks of 128 keys (either way; many
# tiles per CTA at 1k), which it serves, and by one key (seqlen_k = seqlen_q + 1), which it turns away: those run the
# Triton forward, and explain() says why
HALF_DIAGONAL_CASES = {
    "d128-causal-256x384": ((2, 256, 384, 8, 8, 128, 128), {"causal": True}),
    "d64-causal-640x512-masked-rows": ((2, 640, 512, 8, 8, 64, 64), {"causal": True}),
    "d64-causal-1000-many-tiles": ((8, 1000, 1000, 16, 16, 64, 64), {"causal": True}),
    "d128-causal-1000-many-tiles": ((8, 1000, 1000, 16, 4, 128, 128), {"causal": True}),
    "d64-causal-1024-many-tiles": ((16, 1024, 1024, 32, 32, 64, 64), {"causal": True}),
    "d128-causal-1024-many-tiles": ((16, 1024, 1024, 16, 16, 128, 128), {"causal": True}),
    "d96-window-left-200": ((4, 1000, 1000, 16, 16, 96, 96), {"window_size": (200, 0)}),
    "d128-causal-300x301-offset-1": ((2, 300, 301, 8, 8, 128, 128), {"causal": True}),
    "d64-causal-1000x1001-offset-1": ((8, 1000, 1001, 16, 16, 64, 64), {"causal": True}),
    "d128-causal-1000x1001-offset-1": ((8, 1000, 1001, 16, 4, 128, 128), {"causal": True}),
}
HALF_DIAGONAL_SETTINGS = {
    "alone": dict(gluon_half_diagonal=1, gluon_across_tiles=0),
    "dealt-across-tiles": dict(gluon_half_diagonal=1, gluon_balanced=1, gluon_across_tiles=1),
    "dealt-across-tiles-pingpong": dict(gluon_half_diagonal=1, gluon_balanced=1, gluon_across_tiles=1,
                                        gluon_pingpong=1),
}
HALF_DIAGONAL_PARAMS = [pytest.param(case, settings, id=f"{case_id}-{settings_id}")
                        for case_id, case in HALF_DIAGONAL_CASES.items()
                        for settings_id, settings in HALF_DIAGONAL_SETTINGS.items()
                        # each tile started under the last needs every row to see a key, no left band edge
                        if not (settings["gluon_across_tiles"] and (case[0][1] > case[0][2] or
                                                                    "window_size" in case[1]))]


@pytest.mark.parametrize("case, settings", HALF_DIAGONAL_PARAMS)
def test_gluon_half_diagonal_serves_whole_block_offsets_and_turns_the_rest_away(case, settings, seed):
    shape, kwargs = case
    q, k, v = random_qkv(*shape, torch.bfloat16)
    with flashtile.use_backend("triton", forward_schedule=3, **settings):
        text = flashtile.explain(q, k, v, **kwargs)
        out, lse = flashtile.flash_attn_func(q, k, v, return_lse=True, **kwargs)
        again = flashtile.flash_attn_func(q, k, v, return_lse=True, **kwargs)
    if _half_diagonal_admits(shape[1], shape[2], kwargs):
        assert "attention_fwd_gluon_kernel" in text and \
            "each tile's last block computed on its first half by the first consumer" in text, text
    else:
        assert ("the Gluon forward does not serve this call (the first consumer's last block on its first half "
                "(gluon_half_diagonal) needs seqlen_k - seqlen_q (the diagonal's offset) to be a multiple of 128, "
                "got 1)") in text, text
    assert torch.equal(out, again[0]) and torch.equal(lse, again[1]), "a rerun changed bits"
    (ref_out, ref_lse), (eager_out, eager_lse) = (flash_attn_reference(q, k, v, **kwargs),
                                                  flash_attn_reference(q, k, v, dtype=torch.bfloat16, **kwargs))
    assert torch.equal(lse.isinf(), ref_lse.isinf()), "rows that see no key must have lse -inf, and only those"
    assert_close_to_oracle("out", out, ref_out, eager_out, torch.bfloat16, seed)
    assert_close_to_oracle("lse", lse, ref_lse, eager_lse, torch.bfloat16, seed)


# Ring attention attends pairs of chunks at their global diagonal offset (flashtile.distributed): a causal band whose
# diagonal lies past the last key (every key seen) or inside the keys, at 1k causal where the table (triton 3.6)
# halves the first consumer's last block wherever the diagonal crosses every tile; the table's choice and the half
# block forced on, which turns the offsets past the keys away
@pytest.mark.parametrize("offset", (0, 128, 1024, 2048))
@pytest.mark.parametrize("settings", ({}, dict(forward_schedule=3, gluon_half_diagonal=1, gluon_balanced=1,
                                               gluon_across_tiles=1)), ids=("table", "half-diagonal-forced"))
def test_gluon_forward_at_a_diagonal_offset_past_the_keys(offset, settings, seed):
    import dataclasses

    from flashtile._dispatch import BACKENDS, resolve
    from flashtile._validate import prepare_flash_attn
    from flashtile.autograd import attention
    from flashtile.reference import attention_reference
    from flashtile.triton import configs

    q, k, v = random_qkv(4, 1024, 1024, 8, 8, 64, 64, torch.bfloat16)
    call = prepare_flash_attn(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, 0),
                              softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False,
                              return_lse=True)
    call = dataclasses.replace(call, problem=dataclasses.replace(call.problem, diagonal_offset=offset))
    with flashtile.use_backend("triton", **settings):
        backend, tiles = resolve(call.problem)
        out, lse = attention(call, backend, tiles)
    described = BACKENDS[backend].tiles_from_list(tiles).describe(call.problem)
    half = "each tile's last block computed on its first half by the first consumer" in described
    assert half == (offset == 0 and (bool(settings) or configs._triton_version() == "3.6.0")), described
    (ref_out, ref_lse), (eager_out, eager_lse) = (
        attention_reference(*(t.transpose(1, 2) for t in (q, k, v)), window_size=(-1, 0), diagonal_offset=offset,
                            dtype=dtype) for dtype in (torch.float64, torch.bfloat16))
    assert_close_to_oracle("out", out, ref_out.transpose(1, 2), eager_out.transpose(1, 2), torch.bfloat16, seed)
    assert_close_to_oracle("lse", lse, ref_lse, eager_lse, torch.bfloat16, seed)


# SDPA's causal mask is aligned top-left (diagonal offset 0): with more queries than keys the last tiles' rows see
# every key, so the diagonal does not cross their keys and the table's half block stays off
@pytest.mark.parametrize("seqlen_q, seqlen_k, headdim", [(1024, 512, 64), (1024, 896, 128), (640, 256, 64)])
def test_sdpa_causal_with_more_queries_than_keys_on_the_table(seqlen_q, seqlen_k, headdim, seed):
    from flashtile.reference import sdpa_reference

    q, k, v = (torch.randn(4, 8, n, headdim, device=DEVICE, dtype=torch.bfloat16) for n in (seqlen_q, seqlen_k,
                                                                                           seqlen_k))
    out = flashtile.scaled_dot_product_attention(q, k, v, is_causal=True)
    ref_out, _ = sdpa_reference(q, k, v, is_causal=True)
    eager_out, _ = sdpa_reference(q, k, v, is_causal=True, dtype=torch.bfloat16)
    assert_close_to_oracle("out", out, ref_out, eager_out, torch.bfloat16, seed)


# The Gluon dK/dV kernel (backward schedule 4, opt-in) on the edges of its schedule: ragged key blocks and query
# blocks, one key, one query, rows that see no key (causal with seqlen_q > seqlen_k), GQA 4:1 and MQA, dv != d with
# padded widths, a window, both query-block sizes (64 rows at d = 64, 32 at 128), without and with the
# intra-warpgroup overlap (gluon_backward_overlap, where it serves the case); gradients through out and lse against
# the float64 oracle, and every gradient bitwise equal on a rerun
GLUON_BACKWARD_CASES = {
    "d128-causal": ((2, 2048, 2048, 8, 8, 128, 128), {"causal": True}),
    "d64-gqa4": ((2, 2048, 2048, 16, 4, 64, 64), {}),
    "d128-mqa-causal-rect": ((1, 1000, 3000, 8, 1, 128, 128), {"causal": True}),
    "d72-dv40-window": ((2, 1537, 1537, 4, 2, 72, 40), {"window_size": (256, 17)}),
    "d96-long-q-causal-masked-rows": ((1, 3000, 700, 4, 2, 96, 96), {"causal": True}),
    "one-key": ((2, 113, 1, 4, 4, 64, 64), {}),
    "one-query-causal": ((2, 1, 1023, 4, 4, 128, 128), {"causal": True}),
    "ragged-7-causal": ((3, 7, 7, 4, 2, 64, 64), {"causal": True}),
    "d64-dv128": ((2, 500, 600, 4, 4, 64, 128), {}),
    # 128-wide heads without a band (where the intra-warpgroup overlap serves them): ragged ends, GQA 2:1
    "d128-gqa2-ragged": ((2, 1000, 1100, 8, 4, 128, 128), {}),
}


def _gluon_backward_overlap_serves(case) -> bool:
    """gluon_backward_overlap serves every case but 128-wide heads (d and dv) with a band (configs)."""
    (*_, headdim, headdim_v), kwargs = case
    wide = all(64 < width <= 128 for width in (headdim, headdim_v))
    return not (wide and (kwargs.get("causal") or "window_size" in kwargs))


GLUON_BACKWARD_PARAMS = [pytest.param(case, overlap, id=f"{case_id}-{'overlap' if overlap else 'no-overlap'}")
                         for case_id, case in GLUON_BACKWARD_CASES.items() for overlap in (0, 1)
                         if not overlap or _gluon_backward_overlap_serves(case)]


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=("bf16", "fp16"))
@pytest.mark.parametrize("case, overlap", GLUON_BACKWARD_PARAMS)
def test_gluon_backward_follows_the_oracle_and_repeats_its_bits(case, overlap, dtype, seed):
    shape, kwargs = case
    q, k, v = random_qkv(*shape, dtype, requires_grad=True)
    with flashtile.use_backend("triton", backward_schedule=4, gluon_backward_overlap=overlap):
        text = flashtile.explain(q, k, v, **kwargs)
        assert "attention_bwd_dkdv_gluon_kernel (Gluon" in text, text
        assert ("(intra-warpgroup overlap)" in text) == bool(overlap), text
        with pytest.warns(RuntimeWarning, match="backward_schedule=4"):
            got = flashtile.flash_attn_func(q, k, v, return_lse=True, **kwargs)
            grads, (grad_out, grad_lse), _ = assert_attention_follows_the_eager_rule(
                got, flash_attn_reference(q, k, v, **kwargs), flash_attn_reference(q, k, v, dtype=dtype, **kwargs),
                (q, k, v), dtype, seed)
            out, lse = flashtile.flash_attn_func(q, k, v, return_lse=True, **kwargs)
            lse = torch.where(lse.isfinite(), lse, torch.zeros_like(lse))
            again = torch.autograd.grad((out.double() * grad_out).sum() + (lse.double() * grad_lse).sum(), (q, k, v))
    for name, first, second in zip(("dq", "dk", "dv"), grads, again):
        assert torch.equal(first.view(torch.int16), second.view(torch.int16)), f"{name}: a rerun changed bits"


# The fused Gluon backward (backward schedule 5, opt-in: dK, dV and dQ in one kernel per key block, dQ added by TMA
# reduce into a float32 accumulator) on the same edges as the dK/dV kernel: gradients through out and lse against the
# float64 oracle; dK and dV bitwise equal on a rerun (dQ's additions arrive in the copy engine's order, so its bits
# may move)
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=("bf16", "fp16"))
@pytest.mark.parametrize("case", GLUON_BACKWARD_CASES.values(), ids=GLUON_BACKWARD_CASES.keys())
def test_fused_gluon_backward_follows_the_oracle(case, dtype, seed):
    shape, kwargs = case
    q, k, v = random_qkv(*shape, dtype, requires_grad=True)
    with flashtile.use_backend("triton", backward_schedule=5):
        text = flashtile.explain(q, k, v, **kwargs)
        assert "attention_bwd_fused_gluon_kernel (Gluon" in text, text
        with pytest.warns(RuntimeWarning, match="backward_schedule=5"):
            got = flashtile.flash_attn_func(q, k, v, return_lse=True, **kwargs)
            grads, (grad_out, grad_lse), _ = assert_attention_follows_the_eager_rule(
                got, flash_attn_reference(q, k, v, **kwargs), flash_attn_reference(q, k, v, dtype=dtype, **kwargs),
                (q, k, v), dtype, seed)
            out, lse = flashtile.flash_attn_func(q, k, v, return_lse=True, **kwargs)
            lse = torch.where(lse.isfinite(), lse, torch.zeros_like(lse))
            again = torch.autograd.grad((out.double() * grad_out).sum() + (lse.double() * grad_lse).sum(), (q, k, v))
    for name, first, second in zip(("dk", "dv"), grads[1:], again[1:]):
        assert torch.equal(first.view(torch.int16), second.view(torch.int16)), f"{name}: a rerun changed bits"


# Packed batches through the Gluon forward, forced in each of its settings that serve them (the launcher's deal and
# three consumers do not): ragged sequences beside long ones (a tile of one runs past its end into the next, whose
# rows it must neither read into its result nor overwrite), a sequence without keys, one of a single key, GQA,
# dv != d, causal with seqlen_q != seqlen_k per sequence; a neighbour's infinite keys and values stay out of
# every other sequence
GLUON_PACKED_SETTINGS = {key: GLUON_SETTINGS[key] for key in ("table", "no-overlap", "pingpong", "one-cta-per-tile",
                                                               "three-stages", "256-key-blocks")}
GLUON_PACKED_CASES = {
    "mixed": (([300, 1, 77, 1029, 64, 200], [300, 1, 77, 1029, 64, 200]), (4, 2, 128, 128), {}),
    "mixed-causal-rect": (([130, 0, 500, 7, 700], [70, 33, 600, 0, 900]), (8, 2, 128, 128), {"causal": True}),
    "dv64-softcap": (([257, 191, 3], [300, 100, 5]), (4, 4, 128, 64), {"softcap": 20.0}),
    "inf-next-door": (([100, 130, 70], [100, 130, 70]), (4, 4, 128, 128), {"causal": True, "poison": 1}),
    "d64-mixed-causal": (([300, 1, 77, 1029, 64, 200], [300, 1, 77, 1029, 64, 200]), (4, 2, 64, 64),
                         {"causal": True}),
    "d64-inf-next-door": (([100, 300, 70], [100, 300, 70]), (4, 4, 64, 64), {"poison": 1}),
    "sink-mixed-causal-rect": (([130, 0, 500, 7, 700], [70, 33, 600, 0, 900]), (8, 2, 128, 128),
                               {"causal": True, "sink": True}),
}
GLUON_PACKED_PARAMS = [pytest.param(case, settings, id=f"{case_id}-{settings_id}")
                       for case_id, case in GLUON_PACKED_CASES.items()
                       for settings_id, settings in GLUON_PACKED_SETTINGS.items()
                       if _serves_widths(case[1][2:], settings)]


@pytest.mark.parametrize("case, settings", GLUON_PACKED_PARAMS)
def test_gluon_forward_of_packed_batches_follows_the_oracle(case, settings, seed):
    from flashtile.reference import flash_attn_varlen_reference

    (lengths_q, lengths_k), (heads, heads_k, d, dv), options = case
    kwargs = dict(options)
    poison = kwargs.pop("poison", None)
    if kwargs.pop("sink", False):
        kwargs["learnable_sink"] = torch.randn(heads, device=DEVICE) + 1.0
    dtype = torch.bfloat16
    q = torch.randn(sum(lengths_q), heads, d, dtype=torch.float64).to(DEVICE, dtype)
    k = torch.randn(sum(lengths_k), heads_k, d, dtype=torch.float64).to(DEVICE, dtype)
    v = torch.randn(sum(lengths_k), heads_k, dv, dtype=torch.float64).to(DEVICE, dtype)
    starts_q, starts_k = ([0] + torch.tensor(lengths).cumsum(0).tolist() for lengths in (lengths_q, lengths_k))
    cu_q, cu_k = (torch.tensor(starts, dtype=torch.int32, device=DEVICE) for starts in (starts_q, starts_k))
    keep = torch.ones(q.shape[0], dtype=torch.bool, device=DEVICE)
    if poison is not None:
        k[starts_k[poison]:starts_k[poison + 1]] = float("inf")
        v[starts_k[poison]:starts_k[poison + 1]] = float("inf")
        keep[starts_q[poison]:starts_q[poison + 1]] = False
    call = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(lengths_q), max_seqlen_k=max(lengths_k),
                return_lse=True, **kwargs)
    with flashtile.use_backend("triton", forward_schedule=3, **settings):
        explained = flashtile.explain(q, k, v, api="flash_attn_varlen_func",
                                      **{key: value for key, value in call.items() if key != "return_lse"})
        assert "attention_fwd_gluon_kernel" in explained, explained
        out, lse = flashtile.flash_attn_varlen_func(q, k, v, **call)
        again = flashtile.flash_attn_varlen_func(q, k, v, **call)
    assert torch.equal(out.view(torch.int16), again[0].view(torch.int16)) and \
        torch.equal(lse.view(torch.int32), again[1].view(torch.int32)), "a rerun changed bits"
    (ref_out, ref_lse), (eager_out, eager_lse) = (flash_attn_varlen_reference(q, k, v, cu_q, cu_k, **kwargs),
                                                  flash_attn_varlen_reference(q, k, v, cu_q, cu_k, dtype=dtype,
                                                                              **kwargs))
    out, ref_out, eager_out = out[keep], ref_out[keep], eager_out[keep]
    lse, ref_lse, eager_lse = lse[:, keep], ref_lse[:, keep], eager_lse[:, keep]
    assert torch.isfinite(out).all(), "a non-finite value reached the output (another sequence's, through 0 * inf?)"
    assert torch.equal(lse.isinf(), ref_lse.isinf()), "rows that see no key must have lse -inf, and only those"
    assert_close_to_oracle("out", out, ref_out, eager_out, dtype, seed)
    assert_close_to_oracle("lse", lse, ref_lse, eager_lse, dtype, seed)


# Small ragged shapes at the tile table's own tiles (the small-shape suite forces 16 x 16 tiles): a padded
# q/k head dim with a narrower value tile once made triton 3.6 read outside shared memory in the forward.
NARROW_VALUE_SHAPES = {f"d40-dv{dv}": (1, 70, 37, 3, 1, 40, dv) for dv in (3, 8, 12, 16, 24)}
# "d40-dv8-tma-forward": a long ragged key end for the TMA loop
NARROW_VALUE_SHAPES.update({"d8-dv40": (1, 70, 37, 3, 1, 8, 40), "d40-dv8-long-k": (1, 70, 300, 3, 1, 40, 8),
                            "d40-dv8-tma-forward": (1, 64, 4100, 2, 1, 40, 8)})


@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("shape", NARROW_VALUE_SHAPES.values(), ids=NARROW_VALUE_SHAPES.keys())
def test_default_tiles_with_a_value_tile_narrower_than_the_key_tile(shape, causal, seed):
    dtype = torch.float16
    q, k, v = random_qkv(*shape, dtype, requires_grad=True)
    with flashtile.use_backend("triton"):
        got = flashtile.flash_attn_func(q, k, v, causal=causal, return_lse=True)
    assert_attention_follows_the_eager_rule(got, flash_attn_reference(q, k, v, causal=causal),
                                            flash_attn_reference(q, k, v, causal=causal, dtype=dtype), (q, k, v),
                                            dtype, seed)
    with flashtile.use_backend("triton"):  # the decode kernel streams K and V the same way
        out = flashtile.flash_attn_with_kvcache(q[:, :4].detach(), k.detach(), v.detach(), cache_seqlens=shape[2],
                                                causal=causal, num_splits=3)
    want, _ = flash_attn_reference(q[:, :4].detach(), k.detach(), v.detach(), causal=causal)
    eager, _ = flash_attn_reference(q[:, :4].detach(), k.detach(), v.detach(), causal=causal, dtype=dtype)
    assert_close_to_oracle("decode out", out, want, eager, dtype, seed)


# The warp-specialized forward (opt-in) at its fastest tiles (128 x 128, two consumer warpgroups): GQA, several
# batch entries, softcap, a ragged query end, and the cases where the query positions enter the scores (a band,
# ALiBi, a ragged key end) or the lse store (seqlen_q % 4 != 0), which triton 3.6 offset twice for the second
# warpgroup before fwd_tma.py's m0_desc.
WS_TILES = dict(forward_schedule=2, block_m=128, block_n=128, num_warps=4, num_stages=2)
WARP_SPECIALIZED_SHAPES = {  # shape, and the options as a function of it
    "gqa-2k": ((2, 2048, 2048, 16, 4, 128, 128), lambda shape: {}),
    "mha-1k-softcap": ((4, 1024, 1024, 8, 8, 128, 128), lambda shape: {"softcap": 20.0}),
    "mqa-ragged-queries": ((1, 1000, 4096, 8, 1, 128, 128), lambda shape: {}),
    "gqa-2k-causal": ((2, 2048, 2048, 16, 4, 128, 128), lambda shape: {"causal": True}),
    "ragged-ends-window": ((1, 1001, 4100, 8, 2, 128, 128), lambda shape: {"window_size": (700, 0)}),
    "mha-1k-alibi": ((2, 1024, 1024, 8, 8, 128, 128),
                     lambda shape: {"alibi_slopes": torch.rand(shape[3], device=DEVICE, dtype=torch.float32)}),
}


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=("bf16", "fp16"))
@pytest.mark.parametrize("case", WARP_SPECIALIZED_SHAPES.values(), ids=WARP_SPECIALIZED_SHAPES.keys())
def test_warp_specialized_forward_at_its_fastest_tiles(case, dtype, seed):
    shape, options = case
    q, k, v = random_qkv(*shape, dtype, requires_grad=True)
    kwargs = options(shape)
    with flashtile.use_backend("triton", **WS_TILES):
        runs = [flashtile.flash_attn_func(q, k, v, return_lse=True, **kwargs) for _ in range(10)]
    for run in runs[1:]:
        assert torch.equal(run[0], runs[0][0]) and torch.equal(run[1], runs[0][1]), "a rerun differs bitwise"
    assert_attention_follows_the_eager_rule(runs[0], flash_attn_reference(q, k, v, **kwargs),
                                            flash_attn_reference(q, k, v, dtype=dtype, **kwargs), (q, k, v), dtype,
                                            seed)


def test_warp_specialized_forward_with_64_row_tiles_keeps_the_band(seed):
    """64-row tiles (one consumer warpgroup) with a band, at a realistic length."""
    q, k, v = random_qkv(1, 256, 256, 2, 2, 128, 128, torch.bfloat16)
    with flashtile.use_backend("triton", forward_schedule=2, block_m=64, block_n=64, num_warps=4, num_stages=2):
        out = flashtile.flash_attn_func(q, k, v, causal=True)
    want, _ = flash_attn_reference(q, k, v, causal=True)
    eager, _ = flash_attn_reference(q, k, v, causal=True, dtype=torch.bfloat16)
    assert_close_to_oracle("out", out, want, eager, torch.bfloat16, seed)


@pytest.mark.parametrize("backward_schedule", (0, 1, 2, 3),
                         ids=("two-launch-bwd", "one-launch-bwd", "two-launch-tma-bwd", "one-launch-tma-bwd"))
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
def test_triton_is_bitwise_deterministic_over_30_runs(causal, backward_schedule, seed):
    q, k, v = random_qkv(2, 2048, 2048, 16, 4, 128, 128, torch.bfloat16, requires_grad=True)
    grad_out = torch.randn(2, 2048, 16, 128, device=DEVICE, dtype=torch.bfloat16)
    first = None
    with flashtile.use_backend("triton", backward_schedule=backward_schedule):
        for run in range(30):
            out = flashtile.flash_attn_func(q, k, v, causal=causal, deterministic=True)
            results = (out,) + torch.autograd.grad(out, (q, k, v), grad_out)
            if first is None:
                first = results
                continue
            for name, a, b in zip(("out", "dq", "dk", "dv"), first, results):
                assert torch.equal(a, b), f"{name} differs in run {run} (seed {seed})"


def test_auto_picks_triton_for_cuda():
    q, k, v = random_qkv(1, 64, 64, 2, 2, 64, 64, torch.bfloat16)
    assert flashtile.explain(q, k, v).startswith("backend: 'triton'")


def test_128k_tokens_one_head_forward_backward_in_linear_memory(seed):
    """N = 128k, d = 128: the bf16 score matrix alone would be 32 GiB; nothing near that may be allocated."""
    seqlen = 128 * 1024
    q, k, v = random_qkv(1, seqlen, seqlen, 1, 1, 128, 128, torch.bfloat16, requires_grad=True)
    grad_out = torch.randn(1, seqlen, 1, 128, device=DEVICE, dtype=torch.bfloat16)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with flashtile.use_backend("triton"):
        out = flashtile.flash_attn_func(q, k, v, causal=True)
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad_out)
    torch.cuda.synchronize()
    growth = torch.cuda.max_memory_allocated() - before
    print(f"128k tokens, d 128, causal fwd+bwd: peak memory growth {growth / 2**20:.0f} MiB")
    assert growth < 2**30, f"forward+backward at 128k tokens grew memory by {growth / 2**20:.0f} MiB"
    # the last rows see every key: check them against float64 (bottom-right alignment: offset = r0)
    rows = slice(seqlen - 64, seqlen)
    ref = flash_attn_reference(q[:, rows].detach(), k.detach(), v.detach(), causal=True)[0]
    eager = flash_attn_reference(q[:, rows].detach(), k.detach(), v.detach(), causal=True, dtype=torch.bfloat16)[0]
    assert_close_to_oracle("out (last 64 rows)", out[:, rows], ref, eager, torch.bfloat16, seed)
    assert all(g.isfinite().all() for g in (dq, dk, dv))


def _packed(lengths_q, lengths_k, nheads, nheads_k, headdim, dtype):
    def cu(lengths):
        return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)

    q, k, v = random_qkv(1, sum(lengths_q), sum(lengths_k), nheads, nheads_k, headdim, headdim, dtype,
                         requires_grad=True)
    q, k, v = (t[0].detach().requires_grad_() for t in (q, k, v))
    return q, k, v, cu(lengths_q), cu(lengths_k)


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=("bf16", "fp16"))
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("headdim", (128, 64), ids=("d128", "d64"))  # the sm_90 table's two packed branches
def test_varlen_realistic_mixed_lengths(headdim, causal, dtype, seed):
    lengths_q = [1, 700, 2049, 0, 333, 1500]
    lengths_k = [900, 700, 2049, 65, 0, 1800]
    q, k, v, cu_q, cu_k = _packed(lengths_q, lengths_k, 8, 2, headdim, dtype)
    with flashtile.use_backend("triton"):
        got = flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 2049, 2049, causal=causal, return_lse=True)
    reference = flashtile.reference.flash_attn_varlen_reference
    assert_attention_follows_the_eager_rule(got, reference(q, k, v, cu_q, cu_k, causal=causal),
                                            reference(q, k, v, cu_q, cu_k, causal=causal, dtype=dtype), (q, k, v),
                                            dtype, seed)


def test_varlen_never_synchronises_so_cuda_graphs_capture_it():
    """No .item() / .tolist() on the GPU path: the call can be captured in a CUDA graph and replayed."""
    q, k, v, cu_q, cu_k = _packed([100, 3, 517], [100, 40, 600], 4, 4, 64, torch.bfloat16)
    q, k, v = (t.detach() for t in (q, k, v))
    with flashtile.use_backend("triton"):
        expected = flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 517, 600, causal=True)  # compiles
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 517, 600, causal=True)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, expected)


def test_tma_forward_and_backward_replay_from_a_cuda_graph():
    """The TMA forward's host-side descriptors hold the tensors' addresses: a captured call replays on new
    values copied into the same tensors. d = 128: the backward's TMA schedule too, whose host-side
    descriptors are captured the same way."""
    q, k, v = random_qkv(1, 4100, 4100, 4, 2, 128, 128, torch.bfloat16, requires_grad=True)
    grad = torch.randn(1, 4100, 4, 128, device=DEVICE, dtype=torch.bfloat16)

    def step():
        out = flashtile.flash_attn_func(q, k, v, causal=True)
        return (out, *torch.autograd.grad(out, (q, k, v), grad))

    with flashtile.use_backend("triton"):
        side = torch.cuda.Stream()  # warm-up (compiles) off the default stream, as torch's graph docs ask
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = step()
        with torch.no_grad():
            for t in (q, k, v, grad):
                t.copy_(torch.randn_like(t))
        expected = step()
    graph.replay()
    torch.cuda.synchronize()
    for got, want in zip(captured, expected):
        assert torch.equal(got, want)


@pytest.mark.parametrize("page_size", (None, 16, 256), ids=("contiguous", "page16", "page256"))
@pytest.mark.parametrize("num_splits", (0, 1, 3, 8, 64))
def test_kvcache_decode_realistic(page_size, num_splits, seed):
    """32 query heads on 8 K/V heads, d 128, bf16, caches of a few thousand tokens, one new token each (64 splits
    of pages of 16: 4 key blocks a split, the short-caches tile with 4 stages)."""
    batch, capacity, dtype = 4, 4096, torch.bfloat16
    lengths = torch.tensor([4000, 1, 2500, 333], dtype=torch.int32, device=DEVICE)
    k_all = torch.randn(batch, capacity, 8, 128, device=DEVICE, dtype=dtype)
    v_all = torch.randn(batch, capacity, 8, 128, device=DEVICE, dtype=dtype)
    if page_size is None:
        k_cache, v_cache, table = k_all.clone(), v_all.clone(), None
    else:
        pages = capacity // page_size
        order = torch.randperm(batch * pages, device=DEVICE)
        table = order.view(batch, pages).to(torch.int32)
        k_cache = torch.empty(batch * pages, page_size, 8, 128, device=DEVICE, dtype=dtype)
        v_cache = torch.empty_like(k_cache)
        k_cache[order] = k_all.view(batch * pages, page_size, 8, 128)
        v_cache[order] = v_all.view(batch * pages, page_size, 8, 128)
    q = torch.randn(batch, 1, 32, 128, device=DEVICE, dtype=dtype)
    k_new = torch.randn(batch, 1, 8, 128, device=DEVICE, dtype=dtype)
    v_new = torch.randn(batch, 1, 8, 128, device=DEVICE, dtype=dtype)
    with flashtile.use_backend("triton"):
        out, lse = flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=lengths, block_table=table,
                                                     causal=True, num_splits=num_splits, return_softmax_lse=True)
    for b in range(batch):
        n = int(lengths[b])
        keys = torch.cat([k_all[b, :n], k_new[b]])[None]
        values = torch.cat([v_all[b, :n], v_new[b]])[None]
        ref, ref_lse = flash_attn_reference(q[b:b + 1], keys, values, causal=True)
        eager, eager_lse = flash_attn_reference(q[b:b + 1], keys, values, causal=True, dtype=dtype)
        assert_close_to_oracle(f"out[{b}]", out[b:b + 1], ref, eager, dtype, seed)
        assert_close_to_oracle(f"lse[{b}]", lse[b:b + 1], ref_lse, eager_lse, dtype, seed)


def test_kvcache_decode_step_can_be_captured_in_a_cuda_graph():
    """A decode step (append + attention) replays from a CUDA graph; the value checks are skipped in capture."""
    dtype = torch.bfloat16
    k_cache = torch.randn(2, 1024, 8, 128, device=DEVICE, dtype=dtype)
    v_cache = torch.randn(2, 1024, 8, 128, device=DEVICE, dtype=dtype)
    lengths = torch.tensor([100, 900], dtype=torch.int32, device=DEVICE)
    q = torch.randn(2, 1, 32, 128, device=DEVICE, dtype=dtype)
    k_new = torch.randn(2, 1, 8, 128, device=DEVICE, dtype=dtype)
    v_new = torch.randn(2, 1, 8, 128, device=DEVICE, dtype=dtype)
    with flashtile.use_backend("triton"):
        expected = flashtile.flash_attn_with_kvcache(q, k_cache.clone(), v_cache.clone(), k_new, v_new, cache_seqlens=lengths)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=lengths)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, expected)
    assert torch.equal(k_cache[1, 900], k_new[1, 0])


@pytest.mark.parametrize("page_size", (None, 16), ids=("contiguous", "page16"))
def test_kvcache_decode_step_never_synchronises_by_default(page_size):
    """With device cache_seqlens and block_table, the default (check_values=None) reads no value back:
    torch's sync debug mode turns any synchronisation into an error. check_values=True does synchronise."""
    dtype, batch, capacity = torch.bfloat16, 2, 1024
    if page_size is None:
        k_cache = torch.randn(batch, capacity, 8, 128, device=DEVICE, dtype=dtype)
        table = None
    else:
        k_cache = torch.randn(batch * capacity // page_size, page_size, 8, 128, device=DEVICE, dtype=dtype)
        table = torch.randperm(k_cache.shape[0], device=DEVICE).view(batch, -1).to(torch.int32)
    v_cache = torch.randn_like(k_cache)
    lengths = torch.tensor([100, 900], dtype=torch.int32, device=DEVICE)
    q = torch.randn(batch, 1, 32, 128, device=DEVICE, dtype=dtype)
    k_new, v_new = (torch.randn(batch, 1, 8, 128, device=DEVICE, dtype=dtype) for _ in range(2))
    with flashtile.use_backend("triton"):
        flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=lengths, block_table=table)  # compiles
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=lengths, block_table=table)
            with pytest.raises(RuntimeError, match="synchroniz"):
                flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=lengths, block_table=table,
                                                  check_values=True)
        finally:
            torch.cuda.set_sync_debug_mode("default")


# One query or one key at every head dim the tile table tells apart (widths up to 64, up to 128 and above, powers of
# two and padded): Triton compiles an integer argument equal to 1 as a constant, a specialisation of its own, and
# triton 3.6's ptxas crashed on the TMA backward compiled for one key (launch.backward takes pointer loads there).
SEQLEN_ONE = {"q1-k1": (1, 1), "q1-k239": (1, 239), "q239-k1": (239, 1)}
SEQLEN_ONE_HEADDIMS = (16, 32, 40, 64, 80, 96, 128, 160, 192, 256)


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=("bf16", "fp16"))
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("headdim", SEQLEN_ONE_HEADDIMS, ids=[f"d{d}" for d in SEQLEN_ONE_HEADDIMS])
@pytest.mark.parametrize("lengths", SEQLEN_ONE.values(), ids=SEQLEN_ONE.keys())
def test_one_query_or_one_key_compiles_and_follows_the_oracle(lengths, headdim, causal, dtype, seed):
    seqlen_q, seqlen_k = lengths
    q, k, v = random_qkv(2, seqlen_q, seqlen_k, 6, 6, headdim, headdim, dtype, requires_grad=True)
    kwargs = {"causal": causal}
    with flashtile.use_backend("triton"):
        got = flashtile.flash_attn_func(q, k, v, return_lse=True, **kwargs)
    assert_attention_follows_the_eager_rule(got, flash_attn_reference(q, k, v, **kwargs),
                                            flash_attn_reference(q, k, v, dtype=dtype, **kwargs), (q, k, v), dtype,
                                            seed)


def test_more_than_65535_batch_heads_launch(seed):
    """batch x nheads = 131,072 programs' worth of (batch, head) pairs, past the 65,535 of CUDA's grid axes 1 and 2:
    the forward, the backward (one launch and two) and a split decode against the float64 oracle."""
    dtype = torch.float16
    for headdim, backward_schedule in ((64, 2), (128, 3)):
        q, k, v = random_qkv(4096, 5, 9, 32, 32, headdim, headdim, dtype, requires_grad=True)
        with flashtile.use_backend("triton", backward_schedule=backward_schedule):
            got = flashtile.flash_attn_func(q, k, v, return_lse=True, causal=True)
        assert_attention_follows_the_eager_rule(got, flash_attn_reference(q, k, v, causal=True),
                                                flash_attn_reference(q, k, v, causal=True, dtype=dtype), (q, k, v),
                                                dtype, seed)
    k_cache, v_cache = (torch.randn(4096, 128, 32, 64, device=DEVICE, dtype=dtype) for _ in range(2))
    query = torch.randn(4096, 1, 32, 64, device=DEVICE, dtype=dtype)
    lengths = torch.randint(1, 129, (4096,), device=DEVICE, dtype=torch.int32)
    out = flashtile.flash_attn_with_kvcache(query, k_cache, v_cache, cache_seqlens=lengths, num_splits=2)
    keys = torch.arange(128, device=DEVICE)[None, :] < lengths[:, None].long()  # (batch, keys)
    want = torch.nn.functional.scaled_dot_product_attention(
        query.double().transpose(1, 2), k_cache.double().transpose(1, 2), v_cache.double().transpose(1, 2),
        attn_mask=keys[:, None, None, :]).transpose(1, 2)
    eager = torch.nn.functional.scaled_dot_product_attention(
        query.transpose(1, 2), k_cache.transpose(1, 2), v_cache.transpose(1, 2),
        attn_mask=keys[:, None, None, :]).transpose(1, 2)
    assert_close_to_oracle("decode out", out, want, eager, dtype, seed)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_tensors_on_another_gpu_run_on_that_gpu(seed):
    """Tensors on cuda:1 while cuda:0 is the current device (a model split across GPUs): the kernels run on the
    tensors' GPU and give the bits they give there as the current device."""
    dtype = torch.bfloat16
    runs = []
    for current in (1, 0):
        torch.manual_seed(seed)
        q, k, v = (t.to("cuda:1").detach().requires_grad_() for t in random_qkv(2, 300, 300, 4, 2, 128, 128, dtype))
        k_cache, v_cache = (torch.randn(2, 512, 2, 128, device="cuda:1", dtype=dtype) for _ in range(2))
        with torch.cuda.device(current):
            out = flashtile.flash_attn_func(q, k, v, causal=True)
            grads = torch.autograd.grad(out.float().square().sum(), (q, k, v))
            decoded = flashtile.flash_attn_with_kvcache(q[:, :1].detach(), k_cache, v_cache, cache_seqlens=400,
                                                        num_splits=3)
            torch.cuda.synchronize("cuda:1")
        runs.append((out, *grads, decoded))
    for index, (a, b) in enumerate(zip(*runs)):
        assert a.device == torch.device("cuda:1") and torch.equal(a, b), f"result {index} differs"
