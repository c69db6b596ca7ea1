"""flash_attn_with_kvcache with rotary embeddings (rotary_cos, rotary_sin, rotary_interleaved), against a float64
oracle that rotates with complex numbers (flashtile.reference.rotary_reference) and attends with
flash_attn_reference: q and the new k rotated at flash-attn's positions, the cache holding the rotated k and the
unrotated v, the caller's q untouched, and a call that raises leaving the cache unchanged.

The Triton backend rotates and appends in one launch (flashtile.triton.append.kvcache_append_kernel); its results are
compared bit for bit with the torch ops it replaces (kvcache.apply_rotary then kvcache.append_to_cache), under the
interpreter on the CPU.

Positions (flash-attn's rule): new key t of sequence b at cache_seqlens[b] + t; query row i at cache_seqlens[b] + i
with causal or a window narrower than the cache, else every row at cache_seqlens[b]; cache_leftpad does not move
them (they count from the start of the cache row)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import flashtile
from flashtile import kvcache
from flashtile._validate import prepare_kvcache
from flashtile.reference import flash_attn_reference, rotary_reference

from conftest import DEVICE, assert_close_to_oracle, assert_exact_to_oracle, skip_unsupported
from test_kvcache import (BATCH, CACHED, HEADDIM, HEADDIM_V, LEFTPAD, NHEADS, NHEADS_K, ROWS, indexed_cache, logical,
                          make_cache)

# Each case: the cache (contiguous, paged with 16-key pages, or "indexed": rows picked by cache_batch_idx, left
# padded by cache_leftpad), the masking, the rotary layout and width, the query and new-token counts, and the table
# (rows; dtype None = q's). GQA throughout (NHEADS 4, NHEADS_K 2); cached lengths 5, 0, 41 of a 64-key capacity.
CASES = {
    "causal-contiguous-interleaved-full": dict(cache="contiguous", kwargs={"causal": True}, interleaved=True,
                                               rotary_dim=HEADDIM, seqlen_q=3, seqlen_new=3),
    "plain-paged-halves-partial": dict(cache="paged", kwargs={}, interleaved=False, rotary_dim=8, seqlen_q=3,
                                       seqlen_new=3),
    "window-indexed-halves": dict(cache="indexed", kwargs={"window_size": (6, 0)}, interleaved=False, rotary_dim=8,
                                  seqlen_q=2, seqlen_new=2),
    "plain-indexed-interleaved-decode": dict(cache="indexed", kwargs={}, interleaved=True, rotary_dim=12, seqlen_q=1,
                                             seqlen_new=1, table_dtype=torch.float32),
    "causal-paged-more-queries-than-new-tokens": dict(cache="paged", kwargs={"causal": True}, interleaved=True,
                                                      rotary_dim=8, seqlen_q=3, seqlen_new=1, rows=44),
    "causal-contiguous-no-new-tokens": dict(cache="contiguous", kwargs={"causal": True, "softcap": 4.0},
                                            interleaved=False, rotary_dim=HEADDIM, seqlen_q=2, seqlen_new=0),
    "window-wider-than-the-cache-is-none": dict(cache="contiguous", kwargs={"window_size": (64, 64)},
                                                interleaved=True, rotary_dim=8, seqlen_q=3, seqlen_new=3),
}
CAPACITY = 64


def shifted(kwargs) -> bool:
    """flash-attn's rule for q's positions: causal, or a window side in 0 .. capacity - 1."""
    left, right = kwargs.get("window_size", (-1, -1))
    return kwargs.get("causal", False) or 0 <= left < CAPACITY or 0 <= right < CAPACITY


def tables(rows, rotary_dim, dtype):
    angles = torch.rand(rows, rotary_dim // 2, dtype=torch.float64, device=DEVICE) * 2 * math.pi
    return angles.cos().to(dtype), angles.sin().to(dtype)


def setup(case, dtype):
    """Caches, their copies before the call, the index arguments, q, k, v, and the tables of one case."""
    if case["cache"] == "indexed":
        k_cache, v_cache = indexed_cache(dtype, CAPACITY)
        table, rows, starts = None, ROWS, LEFTPAD
        as_tensor = lambda values: torch.tensor(values, dtype=torch.int32, device=DEVICE)  # noqa: E731
        extra = dict(cache_batch_idx=as_tensor(rows), cache_leftpad=as_tensor(starts))
    else:
        k_cache, v_cache, table = make_cache(dtype, 16 if case["cache"] == "paged" else None)
        rows, starts, extra = list(range(BATCH)), [0] * BATCH, dict(block_table=table)
    q = torch.randn(BATCH, case["seqlen_q"], NHEADS, HEADDIM, dtype=torch.float64, device=DEVICE).to(dtype)
    k = torch.randn(BATCH, case["seqlen_new"], NHEADS_K, HEADDIM, dtype=torch.float64, device=DEVICE).to(dtype)
    v = torch.randn(BATCH, case["seqlen_new"], NHEADS_K, HEADDIM_V, dtype=torch.float64, device=DEVICE).to(dtype)
    cos, sin = tables(case.get("rows", CAPACITY), case["rotary_dim"], case.get("table_dtype") or dtype)
    return (k_cache, v_cache), (k_cache.clone(), v_cache.clone()), (table, rows, starts, extra), (q, k, v), (cos, sin)


def oracle(case, q, k, v, cos, sin, before, index, dtype):
    """out, lse, and the rotated new keys, computed in `dtype` (float64: the oracle; q's dtype: the eager baseline)."""
    k_cache, v_cache = before
    table, rows, starts, _ = index
    lengths = torch.tensor(CACHED, dtype=torch.int64, device=DEVICE)[:, None]
    seqlen_q, seqlen_new = case["seqlen_q"], case["seqlen_new"]
    q_steps = torch.arange(seqlen_q, device=DEVICE) if shifted(case["kwargs"]) else torch.zeros(seqlen_q, device=DEVICE)
    q_rot = rotary_reference(q, cos, sin, lengths + q_steps.long(), case["interleaved"], dtype)
    k_rot = rotary_reference(k, cos, sin, lengths + torch.arange(seqlen_new, device=DEVICE), case["interleaved"],
                             dtype)
    outs, lses = [], []
    for b, cached in enumerate(CACHED):
        if table is None:
            keys, values = k_cache[rows[b], starts[b]:cached], v_cache[rows[b], starts[b]:cached]
        else:
            keys, values = logical(k_cache, table, b, cached), logical(v_cache, table, b, cached)
        keys, values = torch.cat([keys.to(dtype), k_rot[b]]), torch.cat([values.to(dtype), v[b].to(dtype)])
        out, lse = flash_attn_reference(q_rot[b:b + 1], keys[None], values[None], dtype=dtype, **case["kwargs"])
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses), k_rot


def new_entries(cache, index, seqlen_new):
    """The cache entries the append wrote, (batch, seqlen_new, nheads_k, dim), read with plain loops."""
    table, rows, _, _ = index
    entries = []
    for b, cached in enumerate(CACHED):
        for t in range(seqlen_new):
            pos = cached + t
            entries.append(cache[rows[b], pos] if table is None else cache[table[b, pos // 16], pos % 16])
    if not entries:
        return cache.new_empty(BATCH, 0, *cache.shape[2:])
    return torch.stack(entries).view(BATCH, seqlen_new, *cache.shape[2:])


@pytest.mark.parametrize("dtype", (torch.float64, torch.float32, torch.float16), ids=("fp64", "fp32", "fp16"))
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_rotary_matches_the_oracle_and_the_cache_holds_the_rotated_keys(backend, case, dtype, seed):
    skip_unsupported(backend, dtype)
    caches, before, index, (q, k, v), (cos, sin) = setup(case, dtype)
    q_before = q.clone()
    with flashtile.use_backend(backend):
        out, lse = flashtile.flash_attn_with_kvcache(
            q, *caches, k, v, rotary_cos=cos, rotary_sin=sin, cache_seqlens=torch.tensor(CACHED, dtype=torch.int32,
                                                                                         device=DEVICE),
            rotary_interleaved=case["interleaved"], return_softmax_lse=True, **index[3], **case["kwargs"])
    assert torch.equal(q, q_before), "q was modified in place"
    ref_out, ref_lse, ref_k = oracle(case, q, k, v, cos, sin, before, index, torch.float64)
    written_k, written_v = (new_entries(c, index, case["seqlen_new"]) for c in caches)
    assert torch.equal(written_v, v), "v was not appended as given (it is never rotated)"
    if dtype == torch.float64:
        assert_exact_to_oracle("out", out, ref_out, seed)
        assert_exact_to_oracle("lse", lse, ref_lse, seed, tol=1e-5)
        assert_exact_to_oracle("rotated k in the cache", written_k, ref_k, seed)
    else:
        eager_out, eager_lse, eager_k = oracle(case, q, k, v, cos, sin, before, index, dtype)
        assert_close_to_oracle("out", out, ref_out, eager_out, dtype, seed)
        assert_close_to_oracle("lse", lse, ref_lse, eager_lse, torch.float32 if dtype == torch.float32 else dtype,
                               seed)
        assert_close_to_oracle("rotated k in the cache", written_k, ref_k, eager_k, dtype, seed)
    # nothing but the appended positions changed
    for cache, old in zip(caches, before):
        changed = (cache != old).flatten(2).any(-1).nonzero().tolist()
        table, rows, _, _ = index
        allowed = {(rows[b], c + t) if table is None else (int(table[b, (c + t) // 16]), (c + t) % 16)
                   for b, c in enumerate(CACHED) for t in range(case["seqlen_new"])}
        assert {tuple(p) for p in changed} <= allowed, "the call wrote cache positions other than the appended ones"


def test_a_decode_loop_stores_what_one_prefill_stores(seed):
    """Three single-token steps write the same rotated keys as one three-token append (absolute positions), and
    their last query sees what the prefill's last causal query sees."""
    k_cache, v_cache, _ = make_cache(torch.float32, None)
    loop_k, loop_v = k_cache.clone(), v_cache.clone()
    q = torch.randn(BATCH, 3, NHEADS, HEADDIM, device=DEVICE)
    k, v = torch.randn(BATCH, 3, NHEADS_K, HEADDIM, device=DEVICE), torch.randn(BATCH, 3, NHEADS_K, HEADDIM_V,
                                                                                 device=DEVICE)
    cos, sin = tables(CAPACITY, 8, torch.float32)
    lengths = torch.tensor(CACHED, dtype=torch.int32, device=DEVICE)
    with flashtile.use_backend("torch"):
        prefill = flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cos, sin, lengths, causal=True,
                                                    rotary_interleaved=False)
        for t in range(3):
            step = flashtile.flash_attn_with_kvcache(q[:, t:t + 1], loop_k, loop_v, k[:, t:t + 1], v[:, t:t + 1], cos,
                                                     sin, lengths + t, causal=True, rotary_interleaved=False)
    assert torch.equal(loop_k, k_cache) and torch.equal(loop_v, v_cache)
    torch.testing.assert_close(step, prefill[:, 2:], atol=1e-5, rtol=1e-5)


def test_positional_rotary_arguments_mean_what_they_mean_in_flash_attn(backend, seed):
    """rotary_cos, rotary_sin are the 6th and 7th arguments, rotary_interleaved the 16th."""
    k_cache, v_cache, table = make_cache(torch.float32, 16)
    q = torch.randn(BATCH, 2, NHEADS, HEADDIM, device=DEVICE)
    k, v = torch.randn(BATCH, 2, NHEADS_K, HEADDIM, device=DEVICE), torch.randn(BATCH, 2, NHEADS_K, HEADDIM_V,
                                                                                 device=DEVICE)
    cos, sin = tables(CAPACITY, 16, torch.float32)
    lengths = torch.tensor(CACHED, dtype=torch.int32, device=DEVICE)
    caches = [(k_cache.clone(), v_cache.clone()) for _ in range(2)]
    with flashtile.use_backend(backend):
        positional = flashtile.flash_attn_with_kvcache(q, *caches[0], k, v, cos, sin, lengths, None, None, table, None,
                                                       True, (-1, -1), 0.0, False)
        keyword = flashtile.flash_attn_with_kvcache(q, *caches[1], k=k, v=v, rotary_cos=cos, rotary_sin=sin,
                                                    cache_seqlens=lengths, block_table=table, causal=True,
                                                    rotary_interleaved=False)
    assert torch.equal(positional, keyword)
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])


def _rotary_call(**changes):
    k_cache, v_cache, _ = make_cache(torch.float32, None)
    cos, sin = tables(CAPACITY, 8, torch.float32)
    args = dict(q=torch.randn(BATCH, 3, NHEADS, HEADDIM, device=DEVICE), k_cache=k_cache, v_cache=v_cache,
                k=torch.randn(BATCH, 2, NHEADS_K, HEADDIM, device=DEVICE),
                v=torch.randn(BATCH, 2, NHEADS_K, HEADDIM_V, device=DEVICE), rotary_cos=cos, rotary_sin=sin,
                cache_seqlens=torch.tensor(CACHED, dtype=torch.int32, device=DEVICE))
    for key, change in changes.items():
        args[key] = change(args)
    return args


def _rows(n, width=4, dtype=torch.float32):
    return lambda a: torch.ones(n, width, dtype=dtype, device=DEVICE)


# An odd rotary_dim cannot be expressed: the tables hold rotary_dim / 2 columns.
BAD_ROTARY = {
    "table too short for cache_seqlens' values": (
        dict(rotary_cos=_rows(42), rotary_sin=_rows(42)), ValueError,
        r"rotary_cos / rotary_sin have 42 rows \(positions 0 \.\. 41\) but cache_seqlens\[2\] = 41 needs positions up "
        r"to 42.*at least 43 rows"),
    "table too short for an int cache_seqlens": (
        dict(rotary_cos=_rows(42), rotary_sin=_rows(42), cache_seqlens=lambda a: 41), ValueError,
        r"have 42 rows .* but cache_seqlens = 41 needs positions up to 42"),
    "causal queries reach further than the new tokens": (
        dict(rotary_cos=_rows(43), rotary_sin=_rows(43), causal=lambda a: True), ValueError,
        r"have 43 rows .* cache_seqlens\[2\] = 41 needs positions up to 43"),
    "rotary_dim past headdim": (dict(rotary_cos=_rows(64, 9), rotary_sin=_rows(64, 9)), ValueError,
                                r"rotary_dim = 18, but q's headdim is 16"),
    "tables without columns": (dict(rotary_cos=_rows(64, 0), rotary_sin=_rows(64, 0)), ValueError,
                               r"rotary_cos must have shape \(seqlen_ro, rotary_dim / 2\)"),
    "a 1-D table": (dict(rotary_cos=lambda a: a["rotary_cos"][:, 0], rotary_sin=lambda a: a["rotary_sin"][:, 0]),
                    ValueError, r"rotary_cos must have shape \(seqlen_ro, rotary_dim / 2\)"),
    "shapes differ": (dict(rotary_sin=_rows(64, 3)), ValueError,
                      r"rotary_sin has shape \(64, 3\) but rotary_cos has \(64, 4\)"),
    "only rotary_cos": (dict(rotary_sin=lambda a: None), ValueError, r"rotary_cos was given without rotary_sin"),
    "only rotary_sin": (dict(rotary_cos=lambda a: None), ValueError, r"rotary_sin was given without rotary_cos"),
    "dtypes differ": (dict(rotary_cos=_rows(64, 4, torch.float64)), TypeError,
                      r"rotary_cos \(torch\.float64\) and rotary_sin \(torch\.float32\) must share one dtype"),
    "no new tokens": (dict(k=lambda a: None, v=lambda a: None), ValueError,
                      r"rotary_cos / rotary_sin need new tokens k and v"),
    "rotary_interleaved not a bool": (dict(rotary_interleaved=lambda a: 1), TypeError,
                                      r"rotary_interleaved must be a bool"),
}


@pytest.mark.parametrize("check_values", (True, None), ids=("checked", "default"))
@pytest.mark.parametrize("changes, error, message", BAD_ROTARY.values(), ids=BAD_ROTARY.keys())
def test_bad_rotary_arguments_raise_and_leave_the_cache_unchanged(changes, error, message, check_values):
    """check_values=True, and the default (free on the CPU; on a GPU the table-length rule for a tensor
    cache_seqlens then is the caller's)."""
    args = _rotary_call(**changes)
    if check_values is None and DEVICE.type != "cpu" and "cache_seqlens\\[" in message:
        pytest.skip("a GPU checks the values only with check_values=True")
    before = {key: args[key].clone() for key in ("k_cache", "v_cache")}
    with pytest.raises(error, match=message):
        flashtile.flash_attn_with_kvcache(**args, check_values=check_values)
    for key, value in before.items():
        assert torch.equal(args[key], value), f"{key} changed although the call raised"


def test_a_shorter_table_is_enough_when_it_reaches_every_position_used(backend):
    """flash-attn asks for a table as long as the cache; flashtile for one reaching the positions used (here 41 + 3
    of a 64-key cache). Unchecked (check_values=False) positions past the table read its last row: the result is
    undefined, but nothing outside the tables is read."""
    args = _rotary_call(rotary_cos=_rows(44), rotary_sin=_rows(44), causal=lambda a: True)
    with flashtile.use_backend(backend):
        out = flashtile.flash_attn_with_kvcache(**args)
        assert bool(out.isfinite().all())
        short = dict(args, rotary_cos=args["rotary_cos"][:20], rotary_sin=args["rotary_sin"][:20])
        assert bool(flashtile.flash_attn_with_kvcache(**short, check_values=False).isfinite().all())


def test_explain_describes_the_rotation():
    args = _rotary_call(causal=lambda a: True)
    q, k_cache, v_cache = args.pop("q"), args.pop("k_cache"), args.pop("v_cache")
    text = str(flashtile.explain(q, k_cache, v_cache, api="flash_attn_with_kvcache", **args))
    assert ("rotary: the first 8 of 16 dims of q and the new k, interleaved pairs (2j, 2j + 1), q's row i at "
            "cache_seqlens + i") in text, text
    args.update(causal=False, rotary_interleaved=False)
    for backend, how in (("torch", "torch ops before the attention"),
                         ("triton", "kvcache_append_kernel: rotated and appended in one launch before the attention")):
        with flashtile.use_backend(backend):
            text = str(flashtile.explain(q, k_cache, v_cache, api="flash_attn_with_kvcache", **args))
        assert f"halves (j, j + rotary_dim / 2), q's row i at cache_seqlens; {how}" in text, text


# The rotary kernel against the torch path (kvcache.apply_rotary, then kvcache.append_to_cache), bit for bit. Each case
# as in CASES (table_dtype None: q's; "q_view": q and the new tokens passed as strided views); both pair conventions,
# rotary_dim < d and = d, 0, 1 and 3 new tokens, shifted and unshifted query rows, the three cache layouts.
KERNEL_CASES = {
    "decode-contiguous-interleaved-full": dict(cache="contiguous", kwargs={}, interleaved=True, rotary_dim=HEADDIM,
                                               seqlen_q=1, seqlen_new=1, table_dtype=torch.float32),
    "decode-paged-halves-full-causal": dict(cache="paged", kwargs={"causal": True}, interleaved=False,
                                            rotary_dim=HEADDIM, seqlen_q=1, seqlen_new=1),
    "prefill-paged-interleaved-partial-causal": dict(cache="paged", kwargs={"causal": True}, interleaved=True,
                                                     rotary_dim=8, seqlen_q=3, seqlen_new=3, q_view=True),
    "indexed-halves-partial-window": dict(cache="indexed", kwargs={"window_size": (6, 0)}, interleaved=False,
                                          rotary_dim=12, seqlen_q=2, seqlen_new=3),
    "indexed-interleaved-unshifted-rows": dict(cache="indexed", kwargs={}, interleaved=True, rotary_dim=4,
                                               seqlen_q=3, seqlen_new=1, q_view=True, table_dtype=torch.float32),
    "contiguous-halves-no-new-tokens": dict(cache="contiguous", kwargs={"causal": True}, interleaved=False,
                                            rotary_dim=HEADDIM, seqlen_q=3, seqlen_new=0),
    "paged-halves-table-ends-at-the-last-position": dict(cache="paged", kwargs={"causal": True}, interleaved=False,
                                                         rotary_dim=8, seqlen_q=3, seqlen_new=2, rows=44),
}


def _strided(t):
    """t's values as a view with permuted strides (heads outermost) and a last-dim stride of 1."""
    return t.transpose(1, 2).contiguous().transpose(1, 2)


def _kernel_and_torch_path(case, dtype, cache_seqlens=CACHED, check_values=None, table=None, inputs=None,
                           rotary=True):
    """The validated call run by the kernel and by the torch path on copies of one cache: (kernel's call, torch's
    call, the caller's q, k and v, their copies before the calls). table maps each random table to the one used;
    inputs may overwrite q, k, v, cos, sin in place; rotary=False: the call without tables (the append alone)."""
    from flashtile.triton.append import append_to_cache

    caches, _, (block_table, _, _, extra), (q, k, v), (cos, sin) = setup(case, dtype)
    if table is not None:
        cos, sin = table(cos), table(sin)
    if inputs is not None:
        inputs(q, k, v, cos, sin)
    if case.get("q_view"):
        q, k, v = _strided(q), _strided(k), _strided(v)
    given = (q.clone(), k.clone(), v.clone())
    if not rotary:
        cos = sin = None
    options = dict(dict(softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                        num_splits=0, return_softmax_lse=False), **case["kwargs"])
    call = prepare_kvcache(q, *caches, k, v, torch.tensor(cache_seqlens, dtype=torch.int32, device=DEVICE),
                           block_table, check_values=check_values, cache_batch_idx=extra.get("cache_batch_idx"),
                           cache_leftpad=extra.get("cache_leftpad"), rotary_cos=cos, rotary_sin=sin,
                           rotary_interleaved=case["interleaved"], **options)
    kernel_call, torch_call = (dataclasses.replace(call, k_cache=call.k_cache.clone(), v_cache=call.v_cache.clone())
                               for _ in range(2))
    append_to_cache(kernel_call)
    kvcache.apply_rotary(torch_call)
    kvcache.append_to_cache(torch_call)
    return kernel_call, torch_call, (q, k, v), given


def _assert_same_bits(kernel_call, torch_call):
    """The kernel's q and caches hold the torch path's bits (NaN where it has NaN, whatever the NaN's bits)."""
    for what in ("q", "k_cache", "v_cache"):
        ours, theirs = getattr(kernel_call, what), getattr(torch_call, what)
        assert ours.dtype == theirs.dtype and ours.shape == theirs.shape, f"{what}: {ours.dtype} {tuple(ours.shape)}"
        nan = theirs.isnan()
        assert torch.equal(ours.isnan(), nan), f"{what}: NaN where the torch path has none, or the reverse"
        ours, theirs = ours.masked_fill(nan, 0), theirs.masked_fill(nan, 0)
        if not torch.equal(ours, theirs):
            differ = (ours != theirs).nonzero()
            error = (ours.double() - theirs.double())[ours != theirs].abs().max().item()
            raise AssertionError(f"{what}: the kernel differs from the torch path at {len(differ)} entries, first "
                                 f"{differ[0].tolist()}, max error {error:.3e}")


@pytest.mark.parametrize("dtype", (torch.float32, torch.float16, torch.bfloat16), ids=("fp32", "fp16", "bf16"))
@pytest.mark.parametrize("case", KERNEL_CASES.values(), ids=KERNEL_CASES.keys())
def test_the_rotary_kernel_gives_the_bits_of_the_torch_path(case, dtype):
    """q rotated into a new contiguous tensor, the rotated keys and the values appended, as the torch ops give them;
    the caller's q, k and v untouched."""
    kernel_call, torch_call, (q, k, v), given = _kernel_and_torch_path(case, dtype)
    _assert_same_bits(kernel_call, torch_call)
    assert kernel_call.q.is_contiguous() and kernel_call.q.data_ptr() != q.data_ptr()
    for name, now, before in zip("qkv", (q, k, v), given):
        assert torch.equal(now, before), f"the caller's {name} was modified"


@pytest.mark.parametrize("dtype", (torch.float32, torch.float16, torch.bfloat16), ids=("fp32", "fp16", "bf16"))
@pytest.mark.parametrize("case", [KERNEL_CASES[name] for name in ("decode-contiguous-interleaved-full",
                                                                 "prefill-paged-interleaved-partial-causal",
                                                                 "indexed-halves-partial-window",
                                                                 "contiguous-halves-no-new-tokens")],
                         ids=("decode-contiguous", "paged-strided-inputs", "indexed", "no-new-tokens"))
def test_the_append_kernel_without_tables_gives_the_bits_of_the_torch_append(case, dtype):
    """Without rotary tables the same launch appends the new keys and values as given, as kvcache.append_to_cache
    writes them, and leaves q as it is (no copy)."""
    kernel_call, torch_call, (q, k, v), given = _kernel_and_torch_path(case, dtype, rotary=False)
    _assert_same_bits(kernel_call, torch_call)
    assert kernel_call.q is torch_call.q, "q was replaced without rotary tables"
    for name, now, before in zip("qkv", (q, k, v), given):
        assert torch.equal(now, before), f"the caller's {name} was modified"


def test_the_append_kernel_without_new_tokens_leaves_the_cache_alone():
    """A call without k and v (k_new None) launches nothing and writes nothing."""
    from flashtile.triton.append import append_to_cache

    caches, before, (block_table, _, _, _), (q, _, _), _ = setup(KERNEL_CASES["decode-paged-halves-full-causal"],
                                                                 torch.float32)
    call = prepare_kvcache(q, *caches, None, None, torch.tensor(CACHED, dtype=torch.int32, device=DEVICE),
                           block_table, softmax_scale=None, causal=True, window_size=(-1, -1), softcap=0.0,
                           alibi_slopes=None, num_splits=0, return_softmax_lse=False)
    append_to_cache(call)
    assert call.q is q or torch.equal(call.q, q)
    for cache, old in zip(caches, before):
        assert torch.equal(cache, old)


def test_the_rotary_kernel_takes_tables_in_q_dtype_and_strided_tables():
    """fp16 tables (q's dtype) and tables that are column slices of wider ones."""
    case = KERNEL_CASES["prefill-paged-interleaved-partial-causal"]
    kernel_call, torch_call, _, _ = _kernel_and_torch_path(
        case, torch.float16, table=lambda t: torch.cat([t, t], dim=1).to(torch.float16)[:, :t.shape[1]])
    _assert_same_bits(kernel_call, torch_call)


@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16), ids=("fp16", "bf16"))
def test_the_rotary_kernel_rounds_ties_to_even_and_keeps_infinities_and_nan(dtype):
    """Sums that fall exactly halfway between two fp16 / bf16 numbers round to the even one, as torch rounds them;
    infinities and NaN pass through the rotation as in torch's float32 arithmetic."""
    case = KERNEL_CASES["decode-contiguous-interleaved-full"]
    ulp = torch.finfo(dtype).eps  # of 1.0

    def inputs(q, k, v, cos, sin):
        # pair (1 + ulp, 1) turned by cos 1, sin -ulp / 2: its first half is 1 + 1.5 ulp, halfway between 1 + ulp
        # (odd) and 1 + 2 ulp (even); pair (1, 1) gives 1 + ulp / 2, halfway between 1 (even) and 1 + ulp
        cos.fill_(1.0)
        sin.fill_(-ulp / 2)
        for x in (q, k):
            x[..., 0::2], x[..., 1::2] = 1 + ulp, 1.0
            x[:, :, 0, 0:2] = 1.0
            x[:, :, -1, 2], x[:, :, -1, 5], x[:, :, -1, 6] = float("inf"), float("-inf"), float("nan")

    kernel_call, torch_call, _, _ = _kernel_and_torch_path(case, dtype, inputs=inputs)
    _assert_same_bits(kernel_call, torch_call)
    rotated = kernel_call.q[:, :, 1, 0].double()
    assert torch.equal(rotated, torch.full_like(rotated, 1 + 2 * ulp)), "a tie did not round to even"


def test_the_rotary_kernel_clamps_positions_into_the_tables():
    """Unchecked positions past a table's end (check_values=False) read its last row, as in the torch path."""
    case = dict(KERNEL_CASES["decode-paged-halves-full-causal"], rows=20, seqlen_q=2, seqlen_new=3)
    kernel_call, torch_call, _, _ = _kernel_and_torch_path(case, torch.float32, check_values=False)
    _assert_same_bits(kernel_call, torch_call)


def test_the_rotary_kernel_drops_appends_outside_the_cache():
    """Unchecked cache_seqlens reaching past the capacity and cache rows outside the cache (check_values=False):
    those tokens are not written (the torch path stops at its index check there); the rest is."""
    from flashtile.triton.append import append_to_cache

    case = dict(KERNEL_CASES["indexed-halves-partial-window"], seqlen_new=3)
    caches, before, _, (q, k, v), (cos, sin) = setup(case, torch.float32)
    rows = torch.tensor([4, 7, 2], dtype=torch.int32, device=DEVICE)  # row 7 of 5: outside
    lengths = [62, 0, 5]  # sequence 0's tokens at 62, 63 (inside) and 64 (past the capacity)
    call = prepare_kvcache(q, *caches, k, v, torch.tensor(lengths, dtype=torch.int32, device=DEVICE), None,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           num_splits=0, return_softmax_lse=False, check_values=False, cache_batch_idx=rows,
                           rotary_cos=cos, rotary_sin=sin, rotary_interleaved=False)
    append_to_cache(call)
    written = {(4, 62), (4, 63), (2, 5), (2, 6), (2, 7)}
    for cache, old in zip(caches, before):
        changed = {tuple(p) for p in (cache != old).flatten(2).any(-1).nonzero().tolist()}
        assert changed == written, f"changed cache entries {sorted(changed)}, expected {sorted(written)}"
    assert torch.equal(caches[1][4, 62:64], v[0, :2]) and torch.equal(caches[1][2, 5:8], v[2])


def test_the_triton_backend_rotates_in_the_kernel(monkeypatch):
    """flash_attn_with_kvcache with rotary tables on the Triton backend launches the kernel, not the torch ops."""
    from flashtile.triton import launch

    launched = []
    monkeypatch.setattr(launch, "append_to_cache", lambda call, run=launch.append_to_cache: (launched.append(1),
                                                                                              run(call)))
    monkeypatch.setattr(kvcache, "apply_rotary", lambda call: pytest.fail("the torch rotation ran"))
    args = _rotary_call(causal=lambda a: True)
    with flashtile.use_backend("triton"):
        flashtile.flash_attn_with_kvcache(**args)
    assert launched == [1]
