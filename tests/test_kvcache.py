"""flash_attn_with_kvcache: in-place append (contiguous and paged caches) and split-KV attention,
against the float64 oracle per sequence; the cache is untouched by a call that raises."""

from __future__ import annotations

import pytest
import torch

import flashtile
from flashtile.reference import flash_attn_reference

from conftest import DEVICE, assert_close_to_oracle, assert_exact_to_oracle, skip_unsupported

BATCH, NHEADS, NHEADS_K, HEADDIM, HEADDIM_V = 3, 4, 2, 16, 24
CACHED = [5, 0, 41]  # tokens already in each sequence's cache


def make_cache(dtype, page_size, max_blocks=4):
    """A cache holding CACHED tokens per sequence: contiguous (page_size None) or paged with scattered pages."""
    capacity = max_blocks * (page_size or 16)
    keys = torch.randn(BATCH, capacity, NHEADS_K, HEADDIM, dtype=torch.float64, device=DEVICE).to(dtype)
    values = torch.randn(BATCH, capacity, NHEADS_K, HEADDIM_V, dtype=torch.float64, device=DEVICE).to(dtype)
    if page_size is None:
        return keys, values, None
    num_blocks = BATCH * max_blocks + 2  # two spare blocks that no sequence owns
    order = torch.randperm(num_blocks, device=DEVICE)[:BATCH * max_blocks]
    table = order.view(BATCH, max_blocks).to(torch.int32)
    k_cache = torch.randn(num_blocks, page_size, NHEADS_K, HEADDIM, dtype=torch.float64, device=DEVICE).to(dtype)
    v_cache = torch.randn(num_blocks, page_size, NHEADS_K, HEADDIM_V, dtype=torch.float64, device=DEVICE).to(dtype)
    for b in range(BATCH):  # the same logical contents as the contiguous cache, through the block table
        for i in range(max_blocks):
            k_cache[table[b, i]] = keys[b, i * page_size:(i + 1) * page_size]
            v_cache[table[b, i]] = values[b, i * page_size:(i + 1) * page_size]
    return k_cache, v_cache, table


def logical(cache, table, b, length):
    """Positions 0 .. length - 1 of sequence b, read with plain loops (independent of flashtile)."""
    if table is None:
        return cache[b, :length]
    page = cache.shape[1]
    rows = [cache[table[b, pos // page], pos % page] for pos in range(length)]
    return torch.stack(rows) if rows else cache[0, :0]


def expected(q, k_cache, v_cache, table, k_new, v_new, kwargs, dtype=torch.float64):
    """Per-sequence oracle over the cache contents before the call plus the new tokens."""
    outs, lses = [], []
    for b, cached in enumerate(CACHED):
        keys, values = logical(k_cache, table, b, cached), logical(v_cache, table, b, cached)
        if k_new is not None:
            keys, values = torch.cat([keys, k_new[b]]), torch.cat([values, v_new[b]])
        slopes = kwargs.get("alibi_slopes")
        out, lse = flash_attn_reference(q[b:b + 1], keys[None], values[None], dtype=dtype,
                                        **dict(kwargs, alibi_slopes=None if slopes is None else slopes[b:b + 1]))
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


SCENARIOS = {
    "plain": {},
    "causal": {"causal": True},
    "window": {"window_size": (6, 0)},
    "everything": {"causal": True, "softcap": 4.0, "softmax_scale": 0.5},
}


@pytest.mark.parametrize("num_splits", (1, 3, 8))
@pytest.mark.parametrize("scenario", SCENARIOS.keys())
@pytest.mark.parametrize("seqlen_q, seqlen_new", [(1, 1), (3, 3), (2, 0)], ids=("decode", "speculative", "no-append"))
@pytest.mark.parametrize("page_size", (None, 16, 32), ids=("contiguous", "page16", "page32"))
def test_float64_matches_the_oracle_and_appends(page_size, seqlen_q, seqlen_new, scenario, num_splits, seed):
    dtype = torch.float64
    k_cache, v_cache, table = make_cache(dtype, page_size)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    q = torch.randn(BATCH, seqlen_q, NHEADS, HEADDIM, dtype=dtype, device=DEVICE)
    k_new = torch.randn(BATCH, seqlen_new, NHEADS_K, HEADDIM, dtype=dtype, device=DEVICE) if seqlen_new else None
    v_new = torch.randn(BATCH, seqlen_new, NHEADS_K, HEADDIM_V, dtype=dtype, device=DEVICE) if seqlen_new else None
    kwargs = dict(SCENARIOS[scenario])
    if scenario == "everything":
        kwargs["alibi_slopes"] = torch.rand(BATCH, NHEADS, dtype=dtype, device=DEVICE)
    cache_seqlens = torch.tensor(CACHED, dtype=torch.int32, device=DEVICE)
    out, lse = flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=cache_seqlens,
                                                 block_table=table, num_splits=num_splits, return_softmax_lse=True,
                                                 **kwargs)
    ref_out, ref_lse = expected(q, before_k, before_v, table, k_new, v_new, kwargs)
    assert out.shape == (BATCH, seqlen_q, NHEADS, HEADDIM_V) and lse.dtype == torch.float32
    assert_exact_to_oracle("out", out, ref_out, seed)
    assert_exact_to_oracle("lse", lse, ref_lse, seed, tol=1e-5)
    # the cache now holds the new tokens at cache_seqlens .. + seqlen_new, and nothing else changed
    want_k, want_v = before_k.clone(), before_v.clone()
    for b, cached in enumerate(CACHED):
        for t in range(seqlen_new):
            pos = cached + t
            where = (b, pos) if table is None else (table[b, pos // page_size], pos % page_size)
            want_k[where] = k_new[b, t]
            want_v[where] = v_new[b, t]
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


@pytest.mark.parametrize("dtype", (torch.float32, torch.float16, torch.bfloat16), ids=("fp32", "fp16", "bf16"))
@pytest.mark.parametrize("scenario", SCENARIOS.keys())
@pytest.mark.parametrize("seqlen_q", (1, 3), ids=("decode", "speculative"))
@pytest.mark.parametrize("page_size", (None, 16, 48), ids=("contiguous", "page16", "page48"))
def test_low_precision_follows_the_eager_rule_and_splits_agree(backend, page_size, seqlen_q, scenario, dtype, seed):
    """Every backend, contiguous and paged caches (48: a page that key blocks straddle), 0, 1, 3, 8 splits."""
    skip_unsupported(backend, dtype)
    k_cache, v_cache, table = make_cache(dtype, page_size)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    q = torch.randn(BATCH, seqlen_q, NHEADS, HEADDIM, device=DEVICE).to(dtype)
    k_new = torch.randn(BATCH, seqlen_q, NHEADS_K, HEADDIM, device=DEVICE).to(dtype)
    v_new = torch.randn(BATCH, seqlen_q, NHEADS_K, HEADDIM_V, device=DEVICE).to(dtype)
    kwargs = dict(SCENARIOS[scenario])
    if scenario == "everything":
        kwargs["alibi_slopes"] = torch.rand(BATCH, NHEADS, device=DEVICE)
    cache_seqlens = torch.tensor(CACHED, dtype=torch.int32, device=DEVICE)
    results = []
    for num_splits in (0, 1, 3, 8):
        k_cache.copy_(before_k)
        v_cache.copy_(before_v)
        with flashtile.use_backend(backend):
            results.append(flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new,
                                                             cache_seqlens=cache_seqlens, block_table=table,
                                                             num_splits=num_splits, return_softmax_lse=True, **kwargs))
    ref_out, ref_lse = expected(q, before_k, before_v, table, k_new, v_new, kwargs)
    eager_out, eager_lse = expected(q, before_k, before_v, table, k_new, v_new, kwargs, dtype=dtype)
    for out, lse in results:
        assert out.dtype == dtype and lse.dtype == torch.float32
        assert_close_to_oracle("out", out, ref_out, eager_out, dtype, seed)
        assert_close_to_oracle("lse", lse, ref_lse, eager_lse, torch.float32 if dtype == torch.float32 else dtype,
                               seed)
    magnitude = max(1.0, results[0][0].abs().max().item())
    for out, _ in results[1:]:  # the split count changes only the rounding
        torch.testing.assert_close(out.float(), results[0][0].float(), rtol=0,
                                   atol=8 * torch.finfo(dtype).eps * magnitude)


def test_query_groups_larger_than_one_tile(backend, seed):
    """32 query heads per K/V head x 5 tokens = 160 rows: several row blocks per (batch, K/V head)."""
    dtype = torch.float32
    q = torch.randn(2, 5, 64, 16, device=DEVICE)
    k_cache, v_cache = torch.randn(2, 100, 2, 16, device=DEVICE), torch.randn(2, 100, 2, 16, device=DEVICE)
    with flashtile.use_backend(backend):
        out = flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=77, causal=True, num_splits=3)
    ref, _ = flash_attn_reference(q, k_cache[:, :77], v_cache[:, :77], causal=True)
    eager, _ = flash_attn_reference(q, k_cache[:, :77], v_cache[:, :77], causal=True, dtype=dtype)
    assert_close_to_oracle("out", out, ref, eager, dtype, seed)


def test_split_heuristic_fills_the_gpu_only_when_needed():
    from flashtile.triton.decode import choose_num_splits

    assert choose_num_splits(programs=264, key_blocks=2048, sm_count=132) == 1  # batch x heads fill the GPU
    assert choose_num_splits(programs=64, key_blocks=2048, sm_count=132) == 8  # four programs per SM, not a few more
    assert choose_num_splits(programs=64, key_blocks=2048, sm_count=132, waves=2) == 4
    assert choose_num_splits(programs=8, key_blocks=2048, sm_count=132) == 64  # capped
    assert choose_num_splits(programs=1, key_blocks=2048, sm_count=132) == 64  # capped
    assert choose_num_splits(programs=8, key_blocks=12, sm_count=132) == 3  # >= 4 key blocks per split
    assert choose_num_splits(programs=8, key_blocks=2, sm_count=132) == 1
    # a tile's own limits: 2 key blocks a split, 128 splits
    assert choose_num_splits(programs=8, key_blocks=256, sm_count=132, waves=8, min_blocks=2, max_splits=128) == 128
    assert choose_num_splits(programs=8, key_blocks=100, sm_count=132, waves=8, min_blocks=2, max_splits=128) == 50


def test_split_launches_take_their_own_tiles_only_where_the_keys_are_split(monkeypatch):
    """On a 132-SM GPU: batch 1 of a contiguous cache splits at about two waves with 3 stages, batch 64 fills the GPU
    unsplit with 2, a cache of two key blocks stays unsplit, pages of 256 keep the four-wave tile (down to 2 key
    blocks a split), pages of 16 take 16-key blocks when split (4 stages and up to 128 splits where 8 stages would
    outnumber a split's key blocks) and 64-key blocks when not, and an explicit split count picks the tile by whether
    it splits."""
    from flashtile._validate import prepare_kvcache
    from flashtile.triton import decode as schedule

    monkeypatch.setattr(schedule, "sm_count", lambda device: 132)
    schedule.decode_geometry.cache_clear()  # entries computed for the interpreter's pretend GPU

    def geometry(batch, length, page=None, num_splits=0):
        q = torch.randn(batch, 1, 32, 16)
        k_cache = torch.randn(batch * length // (page or length), page or length, 8, 16)
        table = None if page is None else torch.arange(k_cache.shape[0], dtype=torch.int32).view(batch, -1)
        call = prepare_kvcache(q, k_cache, k_cache, None, None, length, table, softmax_scale=None, causal=False,
                               window_size=(-1, -1), softcap=0.0, alibi_slopes=None, num_splits=num_splits,
                               return_softmax_lse=False)
        found = schedule.decode_geometry(call.problem, call.page_size, num_splits)
        return found.splits, found.block_n, found.num_stages

    try:
        assert geometry(1, 32768) == (32, 64, 3)  # 33 wanted (two programs per SM), 16 of 512 key blocks each
        assert geometry(64, 256) == (1, 64, 2)  # 512 programs fill the GPU
        assert geometry(1, 128) == (1, 64, 2)  # two key blocks: nothing to split
        assert geometry(1, 32768, page=256) == (64, 64, 2)
        assert geometry(1, 8192, page=256) == (64, 64, 2)  # 2 key blocks a split
        assert geometry(1, 4096, page=256) == (32, 64, 2)
        assert geometry(8, 4096, page=256) == (8, 64, 2)  # four waves: 8 blocks a split
        assert geometry(1, 32768, page=16) == (64, 16, 8)
        assert geometry(1, 16384, page=16) == (64, 16, 8)  # 16 key blocks a split
        assert geometry(1, 8192, page=16) == (128, 16, 4)  # 8 at 64 splits: no more than the 8 stages
        assert geometry(1, 4096, page=16) == (128, 16, 4)  # 2 key blocks a split
        assert geometry(8, 4096, page=16) == (8, 16, 8)  # 32 key blocks a split
        assert geometry(1, 4096, page=16, num_splits=8) == (8, 16, 8)
        assert geometry(64, 256, page=16) == (1, 64, 2)  # unsplit: 64-key blocks over four pages
        assert geometry(1, 32768, num_splits=1) == (1, 64, 2)
        assert geometry(1, 32768, num_splits=3) == (3, 64, 3)
    finally:
        schedule.decode_geometry.cache_clear()


def test_rows_without_keys_get_zero_and_minus_infinity():
    k_cache, v_cache, _ = make_cache(torch.float32, None)
    q = torch.randn(BATCH, 2, NHEADS, HEADDIM, device=DEVICE)
    out, lse = flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=0, return_softmax_lse=True)
    assert torch.equal(out, torch.zeros_like(out)) and bool((lse == float("-inf")).all())


def test_cache_seqlens_none_means_full_caches():
    k_cache, v_cache, _ = make_cache(torch.float64, None)
    q = torch.randn(BATCH, 1, NHEADS, HEADDIM, dtype=torch.float64, device=DEVICE)
    out = flashtile.flash_attn_with_kvcache(q, k_cache, v_cache)
    ref, _ = flash_attn_reference(q, k_cache, v_cache)
    assert_exact_to_oracle("out", out, ref, 0)


def _call(**changes):
    k_cache, v_cache, table = make_cache(torch.float32, 16)
    args = dict(q=torch.randn(BATCH, 1, NHEADS, HEADDIM, device=DEVICE), k_cache=k_cache, v_cache=v_cache,
                k=torch.randn(BATCH, 2, NHEADS_K, HEADDIM, device=DEVICE),
                v=torch.randn(BATCH, 2, NHEADS_K, HEADDIM_V, device=DEVICE),
                cache_seqlens=torch.tensor(CACHED, dtype=torch.int32, device=DEVICE), block_table=table)
    for key, change in changes.items():
        args[key] = change(args)
    return args


BAD = [
    (dict(cache_seqlens=lambda a: torch.tensor([5, 0, 63], dtype=torch.int32, device=DEVICE)), ValueError,
     r"cache_seqlens\[2\] = 63 plus 2 new tokens exceeds the cache capacity of 64"),
    (dict(block_table=lambda a: a["block_table"].index_fill(1, torch.tensor([0], device=DEVICE), 99)), ValueError,
     r"block_table\[0, 0\] = 99 is not a block of the cache \(0 \.\. 13\)"),
    (dict(cache_seqlens=lambda a: 63), ValueError, r"cache_seqlens is 63; with 2 new tokens it must stay within 0 \.\. 64"),
    (dict(cache_seqlens=lambda a: -1), ValueError, r"cache_seqlens is -1"),
    (dict(cache_seqlens=lambda a: 3, block_table=lambda a: a["block_table"].index_fill(
        1, torch.tensor([0], device=DEVICE), -5)), ValueError, r"block_table\[0, 0\] = -5 is not a block"),
    (dict(block_table=lambda a: a["block_table"].long()), TypeError, "block_table must be int32"),
    (dict(cache_seqlens=lambda a: a["cache_seqlens"].long()), TypeError, "cache_seqlens must be an int or an int32"),
    (dict(cache_seqlens=lambda a: a["cache_seqlens"][:2]), ValueError, r"cache_seqlens must have shape \(batch,\)"),
    (dict(cache_seqlens=lambda a: torch.tensor([5, -1, 4], dtype=torch.int32, device=DEVICE)), ValueError,
     r"cache_seqlens\[1\] is -1"),
    (dict(v=lambda a: None), ValueError, "k and v must be given together"),
    (dict(k=lambda a: a["k"].half()), TypeError, "k must have q's dtype"),
    (dict(k=lambda a: a["k"][:, :, :1]), ValueError, r"k must have shape \(batch, seqlen_new, nheads_k, 16\)"),
    (dict(q=lambda a: a["q"][:, :0]), ValueError, "at least one query token"),
    (dict(k_cache=lambda a: a["k_cache"][:, :8], v_cache=lambda a: a["v_cache"][:, :8]), ValueError,
     "page_size to be a positive multiple of 16, got 8"),
    (dict(k_cache=lambda a: a["k_cache"].double()), TypeError, "must share one dtype"),
]


@pytest.mark.parametrize("changes, error, message", BAD)
def test_bad_inputs_raise_and_leave_the_cache_unchanged(changes, error, message):
    """check_values=True: the value rules run on a GPU too (by default they run where they are free)."""
    args = _call(**changes)
    before = {key: args[key].clone() for key in ("k_cache", "v_cache")}
    with pytest.raises(error, match=message):
        flashtile.flash_attn_with_kvcache(**args, check_values=True)
    for key, value in before.items():
        assert torch.equal(args[key], value), f"{key} changed although the call raised"


def test_validated_layouts_are_reused_and_every_rule_still_holds(monkeypatch):
    """prepare_kvcache keeps what its shape, dtype and option rules concluded per signature: a repeated call
    is not validated again, but each call's values are still checked, and an argument that differs only in
    type (1 for True), in grad mode, or in strides is validated anew."""
    from flashtile import _validate

    layouts = []
    original = _validate._kvcache_layout
    monkeypatch.setattr(_validate, "_kvcache_layout", lambda *a, **kw: layouts.append(1) or original(*a, **kw))
    monkeypatch.setattr(_validate, "_KVCACHE_LAYOUTS", {})
    args = _call()
    args.update(k=None, v=None)
    first = flashtile.flash_attn_with_kvcache(**args, causal=True, check_values=True)
    again = flashtile.flash_attn_with_kvcache(**args, causal=True, check_values=True)
    assert len(layouts) == 1, "the second call with the same signature was validated again"
    assert torch.equal(first, again)
    too_long = torch.tensor([5, 0, 70], dtype=torch.int32, device=DEVICE)  # same signature, a value past capacity
    with pytest.raises(ValueError, match=r"cache_seqlens\[2\] = 70 plus 0 new tokens exceeds"):
        flashtile.flash_attn_with_kvcache(**dict(args, cache_seqlens=too_long), causal=True, check_values=True)
    assert len(layouts) == 1
    with pytest.raises(TypeError, match="causal must be a bool"):
        flashtile.flash_attn_with_kvcache(**args, causal=1, check_values=True)
    flashtile.flash_attn_with_kvcache(**dict(args, cache_seqlens=5))
    with pytest.raises(ValueError, match="cache_seqlens is 70; with 0 new tokens"):  # an int length is in the key
        flashtile.flash_attn_with_kvcache(**dict(args, cache_seqlens=70))
    slopes = torch.rand(NHEADS, device=DEVICE, requires_grad=True)
    with torch.no_grad():
        flashtile.flash_attn_with_kvcache(**args, alibi_slopes=slopes)
    with pytest.raises(ValueError, match="alibi_slopes requires grad"):
        flashtile.flash_attn_with_kvcache(**args, alibi_slopes=slopes)
    strided = torch.randn(BATCH, 1, NHEADS, 2 * HEADDIM, device=DEVICE)[..., ::2]  # q's shape, another layout
    out = flashtile.flash_attn_with_kvcache(**dict(args, q=strided))
    assert torch.equal(out, flashtile.flash_attn_with_kvcache(**dict(args, q=strided.contiguous())))


class _TaggedTensor(torch.Tensor):
    """A tensor subclass (what a framework's wrapper tensor looks like to flashtile)."""


@pytest.mark.parametrize("subclass", (False, True), ids=("tensor", "tensor-subclass"))
@pytest.mark.parametrize("num_splits", (1, 3))
def test_strided_cache_seqlens_and_block_table_read_as_their_values(backend, num_splits, subclass, seed):
    """cache_seqlens and block_table given as strided views (plain tensors or a tensor subclass) mean their
    values (appending and attending): the kernels index both as contiguous arrays, so validation passes
    contiguous copies on."""
    args = _call()
    spread_lengths = torch.stack([args["cache_seqlens"], torch.full_like(args["cache_seqlens"], 10**6)], 1)
    table = args["block_table"]
    spread_table = torch.stack([table, torch.full_like(table, 10**6)], dim=2).flatten(1)
    strided = dict(cache_seqlens=spread_lengths[:, 0], block_table=spread_table[:, ::2])
    if subclass:
        strided = {name: t.as_subclass(_TaggedTensor) for name, t in strided.items()}
    assert not any(t.is_contiguous() for t in strided.values())
    caches = [(args["k_cache"].clone(), args["v_cache"].clone()) for _ in range(2)]
    with flashtile.use_backend(backend):
        outs = [flashtile.flash_attn_with_kvcache(**dict(args, k_cache=kc, v_cache=vc, **extra), causal=True,
                                                 num_splits=num_splits)
                for (kc, vc), extra in zip(caches, (strided, {}))]
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])


def test_a_layout_keeps_its_backend_choice_per_backend_request(monkeypatch, seed):
    """A validated layout keeps the backend chosen for it per backend request: the same tensors called again
    under another use_backend context (and the environment variable) go to that context's backend."""
    from flashtile import _dispatch

    served = []
    for name, backend in _dispatch.BACKENDS.items():
        monkeypatch.setattr(backend, "decode", lambda call, tiles, splits, name=name, real=backend.decode:
                            served.append(name) or real(call, tiles, splits))
    args = _call()
    args.update(k=None, v=None)
    for name in ("torch", "triton", "torch", "triton"):
        with flashtile.use_backend(name):
            flashtile.flash_attn_with_kvcache(**args)
    monkeypatch.setenv("FLASHTILE_BACKEND", "torch")
    flashtile.flash_attn_with_kvcache(**args)
    assert served == ["torch", "triton", "torch", "triton", "torch"]


def test_decode_plans_are_kept_per_layout_and_serve_each_calls_tensors(monkeypatch, seed):
    """The Triton decode keeps its launch constants per validated layout: a later step with the same
    layout (new q, cache contents and lengths) reuses the plan and still reads its own tensors; caches with
    other strides (a view into wider rows) are another layout with a plan of their own."""
    from flashtile.triton import decode as schedule

    monkeypatch.setattr(schedule, "_DECODE_PLANS", {})

    def step(**changes):
        args = _call(**changes)
        args.update(k=None, v=None)
        with flashtile.use_backend("triton"):
            out = flashtile.flash_attn_with_kvcache(**args, causal=True, num_splits=3)
        with flashtile.use_backend("torch"):
            want = flashtile.flash_attn_with_kvcache(**args, causal=True, num_splits=3)
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)

    step()
    assert len(schedule._DECODE_PLANS) == 1
    step(cache_seqlens=lambda a: torch.tensor([60, 17, 1], dtype=torch.int32, device=DEVICE))
    assert len(schedule._DECODE_PLANS) == 1, "a step with the same layout built a new plan"

    def wider(name):
        def view(args):
            cache = args[name]
            rows = torch.randn(*cache.shape[:-1], cache.shape[-1] + 8, device=DEVICE)
            rows[..., :cache.shape[-1]] = cache
            return rows[..., :cache.shape[-1]]
        return view
    step(k_cache=wider("k_cache"), v_cache=wider("v_cache"))
    assert len(schedule._DECODE_PLANS) == 2


@pytest.mark.parametrize("num_splits", (1, 3))
@pytest.mark.parametrize("page_size", (None, 16), ids=("contiguous", "page16"))
def test_out_without_lse_is_out_with_it(backend, page_size, num_splits, seed):
    """return_softmax_lse=False: the Triton kernels skip storing lse (nothing is allocated for it); out is
    bitwise the out of the same call with lse returned."""
    k_cache, v_cache, table = make_cache(torch.float32, page_size)
    q = torch.randn(BATCH, 2, NHEADS, HEADDIM, device=DEVICE)
    lengths = torch.tensor(CACHED, dtype=torch.int32, device=DEVICE)
    with flashtile.use_backend(backend):
        alone = flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, block_table=table,
                                                 causal=True, num_splits=num_splits)
        out, lse = flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, block_table=table,
                                                     causal=True, num_splits=num_splits, return_softmax_lse=True)
    assert torch.equal(alone, out) and lse.shape == (BATCH, NHEADS, 2)


def test_value_rules_run_by_default_only_where_they_are_free():
    args = _call(cache_seqlens=lambda a: torch.tensor([5, 0, 70], dtype=torch.int32, device=DEVICE))
    args.update(k=None, v=None)  # a read past capacity: unchecked, it must stay inside the cache
    if DEVICE.type == "cpu":
        with pytest.raises(ValueError, match="exceeds the cache capacity"):
            flashtile.flash_attn_with_kvcache(**args)
    with flashtile.use_backend("triton"):
        out = flashtile.flash_attn_with_kvcache(**args, check_values=False)
    assert bool(out.isfinite().all())
    with pytest.raises(TypeError, match="check_values must be None, True or False"):
        flashtile.flash_attn_with_kvcache(**args, check_values="yes")


def test_unchecked_values_never_take_the_kernel_outside_the_cache():
    """check_values=False with lengths past the capacity and block indices outside the cache: the Triton
    kernel clamps both (reads `capacity` keys of in-range blocks), so it equals the clamped call."""
    args = _call()
    args.update(k=None, v=None, cache_seqlens=torch.full((BATCH,), 1000, dtype=torch.int32, device=DEVICE))
    table = args["block_table"]
    wild = table.clone()
    wild[:, 0] = -7
    wild[:, 1] = table.shape[0] * 100
    clamped = wild.clamp(0, args["k_cache"].shape[0] - 1).to(torch.int32)
    with flashtile.use_backend("triton"):
        out = flashtile.flash_attn_with_kvcache(**dict(args, block_table=wild), check_values=False)
        expected = flashtile.flash_attn_with_kvcache(**dict(args, block_table=clamped, cache_seqlens=None))
    assert torch.equal(out, expected)


@pytest.mark.parametrize("num_splits", (1, 3))
@pytest.mark.parametrize("page_size, block_n", ((16, 16), (48, 16), (128, 16), (128, 128), (256, 128), (256, 64),
                                                 (16, 64), (48, 64), (32, 128)))
def test_paged_decode_reads_each_key_block_from_its_page(page_size, block_n, num_splits, seed):
    """Key blocks that divide the pages look their page up once, larger ones once per run of keys within a page
    (16 keys of a 48-key page: runs that start mid-page): scattered pages, a window, lengths that end inside a
    page, 16-key blocks walking several pages, 128-key blocks within one and 64-key blocks over four, against the
    oracle; a table entry past every sequence's pages is never followed."""
    from flashtile._validate import prepare_kvcache
    from flashtile.triton import decode as schedule

    lengths, max_blocks = [3 * page_size - 5, page_size + 1], 4
    num_blocks = len(lengths) * max_blocks + 1
    k_cache = torch.randn(num_blocks, page_size, NHEADS_K, HEADDIM, dtype=torch.float64, device=DEVICE).float()
    v_cache = torch.randn(num_blocks, page_size, NHEADS_K, HEADDIM_V, dtype=torch.float64, device=DEVICE).float()
    table = torch.randperm(num_blocks, device=DEVICE)[:len(lengths) * max_blocks].view(len(lengths), max_blocks)
    table = table.to(torch.int32)
    table[1, 3] = 10_000  # past every sequence's pages: never read, and clamped if it were
    q = torch.randn(len(lengths), 2, NHEADS, HEADDIM, dtype=torch.float64, device=DEVICE).float()
    cache_seqlens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    call = prepare_kvcache(q, k_cache, v_cache, None, None, cache_seqlens, table, softmax_scale=None, causal=True,
                           window_size=(page_size + 7, 0), softcap=0.0, alibi_slopes=None, num_splits=num_splits,
                           return_softmax_lse=True, check_values=False)
    tile = schedule.DecodeTile(block_n, 2, 3, waves=2)
    geometry = schedule.decode_geometry(call.problem, page_size, num_splits, tile)
    out, lse = schedule.decode(call, num_splits, geometry)
    for b, length in enumerate(lengths):
        keys, values = logical(k_cache, table, b, length), logical(v_cache, table, b, length)
        want, want_lse = flash_attn_reference(q[b:b + 1], keys[None], values[None], causal=True,
                                              window_size=(page_size + 7, 0))
        torch.testing.assert_close(out[b:b + 1].double(), want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse[b:b + 1].double(), want_lse, atol=1e-5, rtol=1e-5)


def test_num_splits_must_be_a_non_negative_int():
    args = _call()
    with pytest.raises(ValueError, match="num_splits must be an int >= 0"):
        flashtile.flash_attn_with_kvcache(**args, num_splits=-2)


def test_explain_names_the_decode_schedule(backend):
    k_cache, v_cache, table = make_cache(torch.float32, 16, max_blocks=12)  # 192 keys: more than one key block
    q = torch.randn(BATCH, 1, NHEADS, HEADDIM, device=DEVICE)
    with flashtile.use_backend(backend):
        text = str(flashtile.explain(q, k_cache, v_cache, api="flash_attn_with_kvcache", cache_seqlens=10,
                                     block_table=table, num_splits=3, causal=True))
    assert "KV cache of 192 tokens per sequence (paged, 16-token pages)" in text, text
    expected = "attention_decode_kernel + attention_decode_combine_kernel" if backend == "triton" else "3 split(s)"
    assert expected in text, text
    bad = flashtile.explain(q, k_cache, v_cache, api="flash_attn_with_kvcache", cache_seqlens=200, block_table=table)
    assert str(bad).startswith("this call would raise ValueError"), bad


def test_default_decode_tile_per_cache_layout():
    """Unsplit launches share one measured tile; split launches over a contiguous cache take one of their own, over
    pages a multiple of 64 keys the same blocks with splits of fewer key blocks, and over other page sizes (multiples
    of 16) 16-key blocks, which divide the page."""
    from flashtile.triton import decode as schedule

    for page_size in (None, 16, 96, 64, 256):
        assert schedule.default_decode_tile(page_size) is schedule.DECODE_TILE
    assert schedule.default_decode_tile(None, split=True) is schedule.DECODE_TILE_CONTIGUOUS_SPLIT
    assert schedule.default_decode_tile(256, split=True) is schedule.DECODE_TILE_LARGE_PAGES_SPLIT
    assert schedule.default_decode_tile(64, split=True) is schedule.DECODE_TILE_LARGE_PAGES_SPLIT
    assert schedule.default_decode_tile(16, split=True) is schedule.DECODE_TILE_SMALL_PAGES
    assert schedule.default_decode_tile(96, split=True) is schedule.DECODE_TILE_SMALL_PAGES
    for page_size in range(16, 1025, 16):
        assert page_size % schedule.default_decode_tile(page_size, split=True).block_n == 0


# cache_batch_idx and cache_leftpad (contiguous caches): sequence b lives in row ROWS[b] of a 5-row cache, its cached
# tokens at positions LEFTPAD[b] .. CACHED[b] - 1
ROWS, LEFTPAD, CACHE_ROWS = [4, 0, 2], [3, 0, 7], 5


def indexed_cache(dtype, capacity=64):
    keys = torch.randn(CACHE_ROWS, capacity, NHEADS_K, HEADDIM, dtype=torch.float64, device=DEVICE).to(dtype)
    values = torch.randn(CACHE_ROWS, capacity, NHEADS_K, HEADDIM_V, dtype=torch.float64, device=DEVICE).to(dtype)
    return keys, values


def indexed_expected(q, k_cache, v_cache, k_new, v_new, rows, starts, kwargs, dtype=torch.float64):
    """Per-sequence oracle: row rows[b], positions starts[b] .. CACHED[b] - 1, then the new tokens."""
    outs, lses = [], []
    for b, cached in enumerate(CACHED):
        keys, values = k_cache[rows[b], starts[b]:cached], v_cache[rows[b], starts[b]:cached]
        if k_new is not None:
            keys, values = torch.cat([keys, k_new[b]]), torch.cat([values, v_new[b]])
        slopes = kwargs.get("alibi_slopes")
        out, lse = flash_attn_reference(q[b:b + 1], keys[None], values[None], dtype=dtype,
                                        **dict(kwargs, alibi_slopes=None if slopes is None else slopes[b:b + 1]))
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


@pytest.mark.parametrize("index", ("rows", "leftpad", "both"))
@pytest.mark.parametrize("backend, dtype", [("torch", torch.float64), ("torch", torch.float16),
                                            ("triton", torch.float32), ("triton", torch.float16)],
                         ids=("torch-fp64", "torch-fp16", "triton-fp32", "triton-fp16"))
def test_cache_batch_idx_and_leftpad_append_and_attend_like_flash_attn(backend, dtype, index, seed):
    """Appends go to row cache_batch_idx[b] at cache_seqlens[b] onwards; attention sees positions cache_leftpad[b] ..
    end of that row (GQA, ragged lengths, an empty cache, causal with ALiBi and a split, a window unsplit)."""
    k_cache, v_cache = indexed_cache(dtype)
    if index == "leftpad":  # one row per sequence
        k_cache, v_cache = k_cache[:BATCH], v_cache[:BATCH]
    before_k, before_v = k_cache.clone(), v_cache.clone()
    rows = ROWS if index != "leftpad" else [0, 1, 2]
    starts = LEFTPAD if index != "rows" else [0, 0, 0]
    as_tensor = lambda values: torch.tensor(values, dtype=torch.int32, device=DEVICE)  # noqa: E731
    extra = dict(cache_batch_idx=as_tensor(rows) if index != "leftpad" else None,
                 cache_leftpad=as_tensor(starts) if index != "rows" else None)
    q = torch.randn(BATCH, 3, NHEADS, HEADDIM, device=DEVICE).to(dtype)
    k_new = torch.randn(BATCH, 3, NHEADS_K, HEADDIM, device=DEVICE).to(dtype)
    v_new = torch.randn(BATCH, 3, NHEADS_K, HEADDIM_V, device=DEVICE).to(dtype)
    for kwargs, num_splits in (({"causal": True, "alibi_slopes": torch.rand(BATCH, NHEADS, device=DEVICE)}, 3),
                               ({"window_size": (6, 0), "softcap": 4.0}, 1)):
        k_cache.copy_(before_k)
        v_cache.copy_(before_v)
        with flashtile.use_backend(backend):
            out, lse = flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=as_tensor(
                CACHED), num_splits=num_splits, return_softmax_lse=True, **extra, **kwargs)
        ref_out, ref_lse = indexed_expected(q, before_k, before_v, k_new, v_new, rows, starts, kwargs)
        if dtype == torch.float64:
            assert_exact_to_oracle("out", out, ref_out, seed)
            assert_exact_to_oracle("lse", lse, ref_lse, seed, tol=1e-5)
        else:
            eager_out, eager_lse = indexed_expected(q, before_k, before_v, k_new, v_new, rows, starts, kwargs, dtype)
            assert_close_to_oracle("out", out, ref_out, eager_out, dtype, seed)
            assert_close_to_oracle("lse", lse, ref_lse, eager_lse, torch.float32 if dtype == torch.float32 else dtype,
                                   seed)
        want_k, want_v = before_k.clone(), before_v.clone()
        for b, cached in enumerate(CACHED):
            want_k[rows[b], cached:cached + 3] = k_new[b]
            want_v[rows[b], cached:cached + 3] = v_new[b]
        assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v), "the append wrote other positions"


def test_positional_calls_mean_what_they_mean_in_flash_attn(backend, seed):
    """flash-attn's order: q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
    cache_leftpad, block_table, softmax_scale, causal, window_size, softcap, rotary_interleaved, alibi_slopes,
    num_splits, return_softmax_lse. Several sequences may read one row when nothing is appended."""
    k_cache, v_cache = indexed_cache(torch.float32)
    q = torch.randn(BATCH, 2, NHEADS, HEADDIM, device=DEVICE)
    lengths = torch.tensor(CACHED, dtype=torch.int32, device=DEVICE)
    rows = torch.tensor([2, 2, 0], dtype=torch.int32, device=DEVICE)
    pad = torch.tensor([1, 0, 7], dtype=torch.int32, device=DEVICE)
    with flashtile.use_backend(backend):
        positional = flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, None, None, None, None, lengths, rows, pad,
                                                       None, 0.3, True, (5, 0), 0.0, True, None, 2, True)
        keyword = flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, cache_batch_idx=rows,
                                                    cache_leftpad=pad, softmax_scale=0.3, causal=True,
                                                    window_size=(5, 0), num_splits=2, return_softmax_lse=True)
    assert torch.equal(positional[0], keyword[0]) and torch.equal(positional[1], keyword[1])
    ref, _ = indexed_expected(q, k_cache, v_cache, None, None, rows.tolist(), pad.tolist(),
                              dict(softmax_scale=0.3, causal=True, window_size=(5, 0)))
    torch.testing.assert_close(positional[0].double(), ref, atol=1e-5, rtol=1e-5)


def _indexed_call(**changes):
    k_cache, v_cache = indexed_cache(torch.float32)
    as_tensor = lambda values: torch.tensor(values, dtype=torch.int32, device=DEVICE)  # noqa: E731
    args = dict(q=torch.randn(BATCH, 1, NHEADS, HEADDIM, device=DEVICE), k_cache=k_cache, v_cache=v_cache,
                k=torch.randn(BATCH, 2, NHEADS_K, HEADDIM, device=DEVICE),
                v=torch.randn(BATCH, 2, NHEADS_K, HEADDIM_V, device=DEVICE), cache_seqlens=as_tensor(CACHED),
                cache_batch_idx=as_tensor(ROWS), cache_leftpad=as_tensor(LEFTPAD))
    for key, change in changes.items():
        args[key] = change(args)
    return args


def _int32(*values):
    return lambda a: torch.tensor(values, dtype=torch.int32, device=DEVICE)


BAD_INDICES = {
    "row past the cache": (dict(cache_batch_idx=_int32(4, 0, 5)), ValueError,
                           r"cache_batch_idx\[2\] = 5 is not a row of the cache \(0 \.\. 4\); nothing was written"),
    "negative row": (dict(cache_batch_idx=_int32(-1, 0, 2)), ValueError, r"cache_batch_idx\[0\] = -1 is not a row"),
    "a row twice while appending": (dict(cache_batch_idx=_int32(3, 1, 3)), ValueError,
                                    r"names cache row 3 more than once; appending k and v needs distinct rows"),
    "leftpad past cache_seqlens": (dict(cache_leftpad=_int32(6, 0, 7)), ValueError,
                                   r"cache_leftpad\[0\] = 6 must be within 0 \.\. cache_seqlens\[0\] = 5"),
    "negative leftpad": (dict(cache_leftpad=_int32(0, -2, 7)), ValueError, r"cache_leftpad\[1\] = -2 must be within"),
    "leftpad past an int cache_seqlens": (dict(cache_seqlens=lambda a: 4), ValueError,
                                          r"cache_leftpad\[2\] = 7 must be within 0 \.\. cache_seqlens\[2\] = 4"),
    "int64 rows": (dict(cache_batch_idx=lambda a: a["cache_batch_idx"].long()), TypeError,
                   r"cache_batch_idx must be an int32 tensor, got torch\.int64"),
    "float leftpad": (dict(cache_leftpad=lambda a: a["cache_leftpad"].float()), TypeError,
                      r"cache_leftpad must be an int32 tensor"),
    "rows of another shape": (dict(cache_batch_idx=_int32(4, 0)), ValueError,
                              r"cache_batch_idx must have shape \(batch,\) = \(3,\), got \(2,\)"),
    "rows not a tensor": (dict(cache_batch_idx=lambda a: [4, 0, 2]), TypeError,
                          r"cache_batch_idx must be a torch\.Tensor"),
    "leftpad without cache_seqlens": (dict(cache_seqlens=lambda a: None, k=lambda a: None, v=lambda a: None),
                                      ValueError, r"cache_leftpad needs cache_seqlens"),
    "a batch of other rows without cache_batch_idx": (dict(cache_batch_idx=lambda a: None), ValueError,
                                                      r"k_cache has batch 5 but q has 3.*pass cache_batch_idx"),
    "with a paged cache": (dict(block_table=lambda a: torch.zeros(BATCH, 4, dtype=torch.int32, device=DEVICE),
                                k_cache=lambda a: a["k_cache"][:, :16], v_cache=lambda a: a["v_cache"][:, :16]),
                           ValueError, r"cache_batch_idx cannot be combined with block_table"),
    "rotary_interleaved not a bool": (dict(rotary_interleaved=lambda a: 1), TypeError,
                                      r"rotary_interleaved must be a bool"),
}


@pytest.mark.parametrize("check_values", (True, None), ids=("checked", "default"))
@pytest.mark.parametrize("changes, error, message", BAD_INDICES.values(), ids=BAD_INDICES.keys())
def test_bad_cache_indices_raise_and_leave_the_cache_unchanged(changes, error, message, check_values):
    """check_values=True, and the default (free on the CPU; on a GPU the value rules then are the caller's)."""
    args = _indexed_call(**changes)
    # the rules on values (a row or pad out of range, named "x[b] = value"; a row named twice) are read on the host,
    # which a GPU does only when asked; the rules on types and shapes hold everywhere
    value_rule = error is ValueError and ("=" in message or "more than once" in message)
    if check_values is None and DEVICE.type != "cpu" and value_rule:
        pytest.skip("a GPU checks the values only with check_values=True")
    before = {key: args[key].clone() for key in ("k_cache", "v_cache")}
    with pytest.raises(error, match=message):
        flashtile.flash_attn_with_kvcache(**args, check_values=check_values)
    for key, value in before.items():
        assert torch.equal(args[key], value), f"{key} changed although the call raised"
