"""flash_attn_func calls of a few query rows run by the decode kernels (forward schedule 5): the table's rule
(configs.decode_forward), the forward against the float64 oracle with its gradients through the table's backward,
what explain() says, and the calls the schedule turns away.

The table takes the schedule on sm_90 only; here the tile setting forward_schedule=5 forces it, so that the
interpreter (CI) runs the same launcher and kernels on CPU tensors as an H200 runs for a decode step."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import flashtile
from flashtile.errors import BackendUnavailableError
from flashtile.reference import flash_attn_reference
from flashtile.triton import configs

from conftest import DEVICE, assert_attention_follows_the_eager_rule, random_qkv, skip_unsupported
from sm90_launches import problem_for

# (batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, headdim_v), options: one decode row per sequence with GQA,
# a few rows with a window, softcap with ALiBi and a sink, dv != d, and more rows than the keys (masked rows)
CASES = {
    "decode-gqa-causal": ((2, 1, 70, 4, 2, 16, 16), dict(causal=True)),
    "rows-window": ((1, 3, 45, 2, 2, 32, 32), dict(window_size=(9, 0))),
    "softcap-alibi-sink": ((2, 2, 33, 4, 1, 16, 16), dict(causal=True, softcap=5.0, alibi=True, sink=True)),
    "dv-differs": ((1, 2, 40, 2, 1, 24, 40), {}),
    "rows-past-the-keys": ((1, 5, 3, 2, 2, 16, 16), dict(causal=True)),
}


def _problem(seqlen_q=1, **changes):
    """A bf16 decode-shaped problem (32 query heads on 8 K/V heads, d = 64, 600 keys, causal) with `changes`."""
    return dataclasses.replace(problem_for(seqlen_q, 600, 64, 64, torch.bfloat16, True, nheads=32, nheads_k=8),
                               **changes)


def test_the_table_takes_the_decode_kernels_for_a_few_rows_per_kv_head_on_sm90():
    hopper = (9, 0)
    assert configs.default_tiles(_problem(), hopper).forward_schedule == configs.DECODE_FORWARD_SCHEDULE
    # 16 rows x a group of 4 = 64 rows per K/V head: one tile; 17 rows: not
    assert configs.default_tiles(_problem(seqlen_q=16), hopper).forward_schedule == configs.DECODE_FORWARD_SCHEDULE
    assert configs.default_tiles(_problem(seqlen_q=17), hopper).forward_schedule != configs.DECODE_FORWARD_SCHEDULE
    for turned_away in (dict(dropout_p=0.1), dict(mask_kind="bool"), dict(diagonal_offset=0, alignment="top-left"),
                        dict(varlen=True), dict(dtype=torch.float32)):
        tiles = configs.default_tiles(_problem(**turned_away), hopper)
        assert tiles.forward_schedule != configs.DECODE_FORWARD_SCHEDULE, turned_away
    assert configs.default_tiles(_problem(), (8, 0)).forward_schedule != configs.DECODE_FORWARD_SCHEDULE
    assert configs.default_tiles(_problem(), None).forward_schedule != configs.DECODE_FORWARD_SCHEDULE
    # top-left alignment without a band is the same call
    assert configs.default_tiles(_problem(window_right=-1, diagonal_offset=0, alignment="top-left"),
                                 hopper).forward_schedule == configs.DECODE_FORWARD_SCHEDULE


@pytest.mark.parametrize("dtype", (torch.float32, torch.float16), ids=("fp32", "fp16"))
@pytest.mark.parametrize("shape, options", CASES.values(), ids=CASES.keys())
def test_the_decode_forward_follows_the_eager_rule_with_gradients(shape, options, dtype, seed):
    skip_unsupported("triton", dtype)
    batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, headdim_v = shape
    q, k, v = random_qkv(*shape, dtype, requires_grad=True)
    kwargs = dict(causal=options.get("causal", False), window_size=options.get("window_size", (-1, -1)),
                  softcap=options.get("softcap", 0.0))
    if options.get("alibi"):
        kwargs["alibi_slopes"] = torch.rand(nheads, dtype=torch.float32, device=DEVICE)
    if options.get("sink"):
        kwargs["learnable_sink"] = torch.randn(nheads, dtype=torch.float32, device=DEVICE)
    with flashtile.use_backend("triton", forward_schedule=configs.DECODE_FORWARD_SCHEDULE):
        text = str(flashtile.explain(q, k, v, **kwargs))
        got = flashtile.flash_attn_func(q, k, v, return_lse=True, **kwargs)
    assert "schedule 'decode'" in text and "attention_decode_kernel" in text, text
    assert "k and v as a full cache" in text and "attention_bwd" in text, text
    oracle = flash_attn_reference(*(t.double() for t in (q, k, v)), **kwargs)
    eager = flash_attn_reference(q, k, v, dtype=dtype, **kwargs)
    assert_attention_follows_the_eager_rule(got, oracle, eager, (q, k, v), dtype, seed)


@pytest.mark.parametrize("call", ("sdpa-causal", "varlen", "dropout"))
def test_the_decode_forward_turns_away_what_it_does_not_serve(call):
    q, k, v = random_qkv(1, 2, 20, 2, 2, 16, 16, torch.float32)
    with flashtile.use_backend("triton", forward_schedule=configs.DECODE_FORWARD_SCHEDULE):
        with pytest.raises(BackendUnavailableError, match="forward_schedule=5 .* cannot serve this call: the decode "
                                                          "kernels' forward does not take"):
            if call == "sdpa-causal":
                flashtile.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True)
            elif call == "varlen":
                cu = torch.tensor([0, 2], dtype=torch.int32, device=DEVICE)
                cu_k = torch.tensor([0, 20], dtype=torch.int32, device=DEVICE)
                flashtile.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu_k, 2, 20)
            else:
                flashtile.flash_attn_func(q, k, v, dropout_p=0.1)


@pytest.mark.skipif(DEVICE.type != "cuda" or torch.cuda.get_device_capability(DEVICE) != (9, 0),
                    reason="the table takes the decode kernels for flash_attn_func on sm_90 only")
@pytest.mark.parametrize("shape, options", [((1, 1, 600, 32, 8, 64, 64), dict(causal=True)),
                                            ((4, 4, 4099, 16, 4, 128, 128), dict(causal=True)),
                                            ((2, 16, 777, 8, 2, 64, 64), {})],
                         ids=("decode-step", "four-rows-long-keys", "sixteen-rows-no-band"))
def test_the_table_runs_decode_shaped_calls_by_the_decode_kernels_on_sm90(shape, options, seed):
    dtype = torch.bfloat16
    q, k, v = random_qkv(*shape, dtype, requires_grad=True)
    text = str(flashtile.explain(q, k, v, **options))
    assert "schedule 'decode'" in text and "attention_decode_kernel" in text, text
    got = flashtile.flash_attn_func(q, k, v, return_lse=True, **options)
    oracle = flash_attn_reference(*(t.double() for t in (q, k, v)), **options)
    eager = flash_attn_reference(q, k, v, dtype=dtype, **options)
    assert_attention_follows_the_eager_rule(got, oracle, eager, (q, k, v), dtype, seed)
    again = flashtile.flash_attn_func(q, k, v, return_lse=True, **options)
    assert all(torch.equal(a, b) for a, b in zip(got, again)), "a rerun changed bits"
