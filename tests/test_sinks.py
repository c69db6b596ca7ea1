"""Learnable attention sinks (learnable_sink): one logit per query head in every row's softmax denominator.

Against the float64 oracle (flashtile.reference with its sink column): out, lse (which includes the sink) and the
gradients of q, k, v and the sink, on every backend; ragged lengths, seqlen_q != seqlen_k, causal and windows, GQA,
extreme sinks, rows that see no key (out 0, lse = the sink), packed sequences, KV caches (contiguous and paged,
split so that the merge adds the sink), the packed-tensor variants, the schedules and the input rules.
"""

from __future__ import annotations

import math

import pytest
import torch

import flashtile
from flashtile import packed
from flashtile._validate import prepare_flash_attn
from flashtile.reference import flash_attn_reference, flash_attn_varlen_reference

from conftest import (DEVICE, assert_attention_follows_the_eager_rule, assert_close_to_oracle,
                      assert_exact_to_oracle, attention_grads, forced_tiles, random_qkv, skip_unsupported)

# (batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, headdim_v): lengths that divide no tile
SHAPES = {
    "gqa-7x113": (1, 7, 113, 4, 2, 16, 16),
    "mha-37x7-dv": (2, 37, 7, 2, 2, 16, 24),  # seqlen_q > seqlen_k: causal leaves rows with no key
}
SCENARIOS = {
    "plain": {},
    "causal": {"causal": True},
    "window": {"window_size": (5, 3)},
}


def sinks(nheads, dtype=torch.float32, scale=1.0, requires_grad=True):
    """Random sink logits (nheads,) on the test device, about as large as the scores."""
    sink = (torch.randn(nheads, dtype=torch.float64) * scale + 0.5).to(device=DEVICE, dtype=dtype)
    return sink.requires_grad_(requires_grad)


@pytest.mark.parametrize("scenario", SCENARIOS.keys())
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_float64_matches_the_oracle(shape, scenario, seed):
    """The torch backend in float64 reproduces the oracle to rounding: out, lse and dq, dk, dv, dsink through out;
    through lse too, to the float32 rounding of the returned lse."""
    q, k, v = random_qkv(*shape, torch.float64, requires_grad=True)
    sink = sinks(shape[3], torch.float64)
    with forced_tiles("torch", 7, 13):
        out, lse = flashtile.flash_attn_func(q, k, v, return_lse=True, learnable_sink=sink, **SCENARIOS[scenario])
    ref_out, ref_lse = flash_attn_reference(q, k, v, learnable_sink=sink, **SCENARIOS[scenario])
    assert_exact_to_oracle("out", out, ref_out, seed)
    assert_exact_to_oracle("lse", lse, ref_lse, seed, tol=1e-5)  # lse is returned in float32
    assert lse.isfinite().all(), "with a finite sink every row's lse is finite"
    inputs = (q, k, v, sink)
    grad_out = torch.randn_like(ref_out)
    got = torch.autograd.grad((out * grad_out).sum(), inputs, retain_graph=True)
    want = torch.autograd.grad((ref_out * grad_out).sum(), inputs, retain_graph=True)
    for name, g, w in zip(("dq", "dk", "dv", "dsink"), got, want):
        assert_exact_to_oracle(name, g, w, seed)
    grad_lse = torch.randn_like(ref_lse)
    got = attention_grads(out, lse, inputs, grad_out, grad_lse)
    want = attention_grads(ref_out, ref_lse, inputs, grad_out, grad_lse)
    for name, g, w in zip(("dq", "dk", "dv", "dsink"), got, want):
        assert_exact_to_oracle(f"{name} through lse", g, w, seed, tol=1e-5)


@pytest.mark.parametrize("dtype", (torch.float32, torch.float16, torch.bfloat16), ids=("fp32", "fp16", "bf16"))
@pytest.mark.parametrize("scenario", SCENARIOS.keys())
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_low_precision_follows_the_eager_rule(backend, shape, scenario, dtype, seed):
    """Every backend: out, lse and the gradients of q, k, v and the sink (through out and lse) within 2x the
    same-dtype eager error of the oracle. The sink comes in float32 (the fp32 case) or in q's dtype."""
    skip_unsupported(backend, dtype)
    q, k, v = random_qkv(*shape, dtype, requires_grad=True)
    sink = sinks(shape[3], dtype)
    kwargs = SCENARIOS[scenario]
    with forced_tiles(backend, 16, 32):
        got = flashtile.flash_attn_func(q, k, v, return_lse=True, learnable_sink=sink, **kwargs)
    assert_attention_follows_the_eager_rule(
        got, flash_attn_reference(q, k, v, learnable_sink=sink, **kwargs),
        flash_attn_reference(q, k, v, learnable_sink=sink, dtype=dtype, **kwargs), (q, k, v, sink), dtype, seed,
        names=("dq", "dk", "dv", "dsink"))


@pytest.mark.parametrize("logit", (60.0, 1e4, -1e4, -math.inf), ids=("60", "1e4", "-1e4", "-inf"))
def test_extreme_sinks(backend, logit, seed):
    """A sink far above every score takes the whole row (out ~ 0, lse = the sink); one far below (or -inf) changes
    nothing (out and lse as without a sink, no gradient to the sink). Nothing overflows, nothing is NaN."""
    shape = (1, 19, 23, 4, 2, 16, 16)
    q, k, v = random_qkv(*shape, torch.float32, requires_grad=True)
    sink = torch.full((4,), logit, device=DEVICE).requires_grad_(True)
    with forced_tiles(backend, 16, 16):
        out, lse = flashtile.flash_attn_func(q, k, v, causal=True, return_lse=True, learnable_sink=sink)
    grads = attention_grads(out, lse, (q, k, v, sink), torch.randn_like(out.double()), torch.randn_like(lse.double()))
    for name, g in zip(("dq", "dk", "dv", "dsink"), grads):
        assert g.isfinite().all(), f"{name} is not finite (sink {logit}, seed {seed})"
    assert not out.isnan().any() and not lse.isnan().any()
    if logit > 0:
        assert out.abs().max() < 1e-20, f"out {out.abs().max():.3e}: a dominant sink leaves almost nothing"
        torch.testing.assert_close(lse, torch.full_like(lse, logit), atol=1e-6, rtol=1e-6)
        return
    with forced_tiles(backend, 16, 16):
        plain_out, plain_lse = flashtile.flash_attn_func(q, k, v, causal=True, return_lse=True)
    torch.testing.assert_close(out, plain_out, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(lse, plain_lse, atol=1e-6, rtol=1e-6)
    assert torch.equal(grads[3], torch.zeros_like(grads[3])), f"dsink {grads[3]}: a negligible sink gets none"


def test_rows_without_keys_give_zero_and_the_sink(backend, seed):
    """seqlen_q > seqlen_k, causal: the first rows see no key. They get out 0 and lse = the sink, finite gradients,
    and their lse cotangent reaches the sink whole (d lse / d sink = 1 there); the rest matches the oracle."""
    q, k, v = random_qkv(1, 29, 6, 4, 1, 16, 8, torch.float32, requires_grad=True)
    sink = sinks(4)
    with forced_tiles(backend, 16, 16):
        out, lse = flashtile.flash_attn_func(q, k, v, causal=True, return_lse=True, learnable_sink=sink)
    empty = slice(0, 29 - 6)  # rows i < seqlen_q - seqlen_k see no key
    assert torch.equal(out[:, empty], torch.zeros_like(out[:, empty]))
    torch.testing.assert_close(lse[:, :, empty], sink.detach()[None, :, None].expand(1, 4, 23))
    # the lse of the empty rows alone: each passes its cotangent to the sink whole
    grad_lse = torch.zeros_like(lse)
    grad_lse[:, :, empty] = 1.0
    (dsink,) = torch.autograd.grad((lse * grad_lse).sum(), sink, retain_graph=True)
    torch.testing.assert_close(dsink, torch.full_like(dsink, 23.0))
    ref = flash_attn_reference(q, k, v, causal=True, learnable_sink=sink)
    eager = flash_attn_reference(q, k, v, causal=True, learnable_sink=sink, dtype=torch.float32)
    grads, _, _ = assert_attention_follows_the_eager_rule((out, lse), ref, eager, (q, k, v, sink), torch.float32,
                                                          seed, names=("dq", "dk", "dv", "dsink"))
    assert all(g.isfinite().all() for g in grads)


def test_packed_sequences_match_the_oracle(backend, seed):
    """flash_attn_varlen_func: the same sink for every sequence, lengths that divide no tile, a sequence without
    keys (its rows: out 0, lse = the sink) and one without queries; dsink sums over the sequences."""
    lengths_q, lengths_k = [7, 0, 20, 5], [13, 9, 31, 0]
    cu_q = torch.tensor([0] + torch.tensor(lengths_q).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0] + torch.tensor(lengths_k).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    q, k, v = (t[0] for t in random_qkv(1, sum(lengths_q), sum(lengths_k), 4, 2, 16, 24, torch.float32))
    for t in (q, k, v):
        t.requires_grad_(True)
    sink = sinks(4)
    with forced_tiles(backend, 16, 16):
        out, lse = flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), causal=True,
                                                    return_lse=True, learnable_sink=sink)
    kwargs = dict(causal=True, learnable_sink=sink)
    ref = flash_attn_varlen_reference(q, k, v, cu_q, cu_k, **kwargs)
    eager = flash_attn_varlen_reference(q, k, v, cu_q, cu_k, dtype=torch.float32, **kwargs)
    assert_attention_follows_the_eager_rule((out, lse), ref, eager, (q, k, v, sink), torch.float32, seed,
                                            names=("dq", "dk", "dv", "dsink"))
    last = slice(sum(lengths_q) - lengths_q[-1], sum(lengths_q))  # the sequence without keys
    assert torch.equal(out[last], torch.zeros_like(out[last]))
    assert torch.equal(lse[:, last], sink.detach()[:, None].expand(4, lengths_q[-1]))


CACHED = [5, 0, 150]  # tokens already in each sequence's cache
CAPACITY = 192  # three 64-key blocks: the Triton decode kernel's contiguous tile can split them three ways


def _cache(page_size, nheads_k, headdim, dtype):
    """k_cache, v_cache (contiguous, or paged with scattered pages) holding CACHED tokens, the block table, and a
    function giving sequence b's first n keys and values."""
    batch = len(CACHED)
    keys = torch.randn(batch, CAPACITY, nheads_k, headdim, dtype=torch.float64, device=DEVICE).to(dtype)
    values = torch.randn(batch, CAPACITY, nheads_k, headdim, dtype=torch.float64, device=DEVICE).to(dtype)
    if page_size is None:
        return keys, values, None, lambda b, n: (keys[b, :n].clone(), values[b, :n].clone())
    blocks = CAPACITY // page_size
    table = torch.randperm(batch * blocks + 1, device=DEVICE)[:batch * blocks].view(batch, blocks).to(torch.int32)
    k_cache = torch.zeros(batch * blocks + 1, page_size, nheads_k, headdim, dtype=dtype, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    for b in range(batch):
        for i in range(blocks):
            k_cache[table[b, i]] = keys[b, i * page_size:(i + 1) * page_size]
            v_cache[table[b, i]] = values[b, i * page_size:(i + 1) * page_size]
    return k_cache, v_cache, table, lambda b, n: (keys[b, :n].clone(), values[b, :n].clone())


@pytest.mark.parametrize("num_splits", (1, 3), ids=("unsplit", "3-splits"))
@pytest.mark.parametrize("page_size", (None, 16), ids=("contiguous", "page16"))
def test_kvcache_adds_the_sink_once(backend, page_size, num_splits, seed):
    """flash_attn_with_kvcache, appending one token per sequence (one has no other key), two causal query tokens:
    out and lse as the oracle's with the sink, whether the keys are split (the merge adds the sink once, splits
    without keys included) or not. A query row that sees no key: out 0, lse = the sink."""
    dtype, nheads, nheads_k, headdim = torch.float32, 4, 2, 16
    k_cache, v_cache, table, prefix = _cache(page_size, nheads_k, headdim, dtype)
    q = torch.randn(len(CACHED), 2, nheads, headdim, device=DEVICE)
    k_new, v_new = (torch.randn(len(CACHED), 1, nheads_k, headdim, device=DEVICE) for _ in range(2))
    sink = sinks(nheads, requires_grad=False)
    cache_seqlens = torch.tensor(CACHED, dtype=torch.int32, device=DEVICE)
    kwargs = dict(causal=True)
    with flashtile.use_backend(backend):
        out, lse = flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=cache_seqlens,
                                                     block_table=table, num_splits=num_splits,
                                                     return_softmax_lse=True, learnable_sink=sink, **kwargs)
    for b, cached in enumerate(CACHED):
        keys, values = prefix(b, cached)
        keys, values = torch.cat([keys, k_new[b]]), torch.cat([values, v_new[b]])
        ref = flash_attn_reference(q[b:b + 1], keys[None], values[None], learnable_sink=sink, **kwargs)
        eager = flash_attn_reference(q[b:b + 1], keys[None], values[None], learnable_sink=sink, dtype=dtype, **kwargs)
        assert_close_to_oracle(f"out of sequence {b}", out[b:b + 1], ref[0], eager[0], dtype, seed)
        assert_close_to_oracle(f"lse of sequence {b}", lse[b:b + 1], ref[1], eager[1], dtype, seed)
    # sequence 1 has one key (the new token), which its first query token (position -1) cannot see
    assert torch.equal(out[1, 0], torch.zeros_like(out[1, 0]))
    torch.testing.assert_close(lse[1, :, 0], sink)


@pytest.mark.parametrize("variant", ("qkv", "kv", "varlen-qkv", "varlen-kv"))
def test_packed_tensor_variants_pass_the_sink(backend, variant, seed):
    """The packed variants take learnable_sink as flash_attn_func / flash_attn_varlen_func do: same out, lse and
    sink gradient as the unpacked call on the same views."""
    qkv = torch.randn(2, 13, 3, 2, 16, device=DEVICE, requires_grad=True)
    sink = sinks(2)
    cu = torch.tensor([0, 13, 26], dtype=torch.int32, device=DEVICE)
    flat = qkv.view(26, 3, 2, 16)
    calls = {
        "qkv": (lambda **kw: packed.flash_attn_qkvpacked_func(qkv, **kw),
                lambda **kw: flashtile.flash_attn_func(*qkv.unbind(2), **kw)),
        "kv": (lambda **kw: packed.flash_attn_kvpacked_func(qkv[:, :, 0], qkv[:, :, 1:], **kw),
               lambda **kw: flashtile.flash_attn_func(*qkv.unbind(2), **kw)),
        "varlen-qkv": (lambda **kw: packed.flash_attn_varlen_qkvpacked_func(flat, cu, 13, **kw),
                       lambda **kw: flashtile.flash_attn_varlen_func(*flat.unbind(1), cu, cu, 13, 13, **kw)),
        "varlen-kv": (lambda **kw: packed.flash_attn_varlen_kvpacked_func(flat[:, 0], flat[:, 1:], cu, cu, 13, 13,
                                                                          **kw),
                      lambda **kw: flashtile.flash_attn_varlen_func(*flat.unbind(1), cu, cu, 13, 13, **kw)),
    }
    results = []
    for call in calls[variant]:
        with forced_tiles(backend, 16, 16):
            out, lse = call(causal=True, return_lse=True, learnable_sink=sink)
        (dsink,) = torch.autograd.grad(out.sum() + lse.sum(), sink)
        results.append((out, lse, dsink))
    for name, a, b in zip(("out", "lse", "dsink"), *results):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6, msg=lambda m: f"{name} ({variant}, seed {seed}): {m}")
    assert results[0][2].abs().max() > 0


@pytest.mark.parametrize("schedule", ("fa1", "fa4"))
def test_triton_schedules_serve_the_sink(schedule, seed):
    """fa1 (the launcher starts the workspace's row state from the sink) and fa4 (fa2's kernels with its moves)
    serve a sink: out and lse against the oracle."""
    q, k, v = random_qkv(1, 37, 21, 4, 2, 16, 16, torch.float16)
    sink = sinks(4, requires_grad=False)
    with flashtile.use_backend("triton", schedule=schedule):
        got = flashtile.flash_attn_func(q, k, v, causal=True, return_lse=True, learnable_sink=sink)
    ref = flash_attn_reference(q, k, v, causal=True, learnable_sink=sink)
    eager = flash_attn_reference(q, k, v, causal=True, learnable_sink=sink, dtype=torch.float16)
    assert_close_to_oracle("out", got[0], ref[0], eager[0], torch.float16, seed)
    assert_close_to_oracle("lse", got[1], ref[1], eager[1], torch.float16, seed)


def test_gluon_kernels_take_the_sink():
    """The Gluon forward joins the sink to each row's statistics in its epilogue and the Gluon dK/dV kernel reads an
    lse that includes it, so neither turns a sink away: where they do not serve a call (here the interpreter, or a
    CPU), the reason is the platform's, not the sink. explain() describes the sink among the scores."""
    from flashtile.triton import configs

    q, k, v = random_qkv(1, 16, 16, 2, 2, 64, 64, torch.float16)
    sink = sinks(2, requires_grad=False)
    call = prepare_flash_attn(
        q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
        alibi_slopes=None, deterministic=False, return_attn_probs=False, return_lse=False, learnable_sink=sink)
    without = prepare_flash_attn(
        q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
        alibi_slopes=None, deterministic=False, return_attn_probs=False, return_lse=False, learnable_sink=None)
    tile = configs.default_tiles(call.problem, (9, 0)).gluon_tile
    assert configs.gluon_unserved_reason(call.problem, tile) == configs.gluon_unserved_reason(without.problem, tile)
    assert "sink" not in configs.gluon_unserved_reason(call.problem, tile)
    assert "sink" not in configs.gluon_backward_unserved_reason(call.problem)
    assert "learnable sink" in flashtile.explain(q, k, v, learnable_sink=sink)


def _qkv():
    return tuple(torch.randn(2, n, h, 8) for n, h in ((5, 4), (7, 2), (7, 2)))


BAD_SINKS = {
    "not a tensor": ([0.0] * 4, TypeError, r"learnable_sink must be a torch\.Tensor"),
    "integer": (torch.zeros(4, dtype=torch.int64), TypeError, r"learnable_sink has dtype torch\.int64; it must be "
                                                              r"float32"),
    "float64 with float32 q": (torch.zeros(4, dtype=torch.float64), TypeError, r"learnable_sink has dtype "
                                                                               r"torch\.float64"),
    "per K/V head": (torch.zeros(2), ValueError, r"learnable_sink has shape \(2,\); it must be \(nheads,\) = \(4,\)"),
    "per batch": (torch.zeros(2, 4), ValueError, r"learnable_sink has shape \(2, 4\)"),
    "device": (torch.zeros(4, device="meta"), ValueError, r"learnable_sink is on meta but q is on cpu"),
}


@pytest.mark.parametrize("sink, error, message", BAD_SINKS.values(), ids=BAD_SINKS.keys())
def test_bad_sinks_raise_before_anything_runs(sink, error, message):
    """Every entry point rejects a bad sink naming learnable_sink and the rule; the KV cache is left unchanged."""
    q, k, v = _qkv()
    with pytest.raises(error, match=message):
        flashtile.flash_attn_func(q, k, v, learnable_sink=sink)
    cu = torch.tensor([0, 5, 10], dtype=torch.int32)
    with pytest.raises(error, match=message):
        flashtile.flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu,
                                         torch.tensor([0, 7, 14], dtype=torch.int32), 5, 7, learnable_sink=sink)
    with pytest.raises(error, match=message):
        packed.flash_attn_qkvpacked_func(torch.randn(2, 5, 3, 4, 8), learnable_sink=sink)
    k_cache, v_cache = torch.zeros(2, 16, 2, 8), torch.zeros(2, 16, 2, 8)
    with pytest.raises(error, match=message):
        flashtile.flash_attn_with_kvcache(q[:, :1], k_cache, v_cache, k[:, :1], v[:, :1], cache_seqlens=3,
                                          learnable_sink=sink)
    assert not k_cache.any() and not v_cache.any(), "the cache was written by a call that raised"
    assert "would raise" in flashtile.explain(q, k, v, learnable_sink=sink)


def test_sink_in_q_dtype_is_accepted():
    """float32 or q's dtype: an fp16 sink with fp16 q and an fp32 sink with fp16 q both run."""
    q, k, v = (t.half() for t in _qkv())
    for dtype in (torch.float16, torch.float32):
        out = flashtile.flash_attn_func(q, k, v, learnable_sink=torch.zeros(4, dtype=dtype))
        assert out.dtype == torch.float16 and out.isfinite().all()
