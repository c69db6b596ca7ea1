"""flash_attn_varlen_func with block_table: packed queries against paged K/V caches, on every backend.

The oracle gathers each sequence's keys from the pages with plain indexing into contiguous packed K/V and runs
flashtile.reference per sequence in float64. Block tables are shuffled permutations of the cache's blocks, entries
past a sequence's last page are -1, and every cache slot no sequence uses holds NaN, so a read outside the pages in
use shows in the result.
"""

from __future__ import annotations

import pytest
import torch

import flashtile
from flashtile.errors import BackendUnavailableError
from flashtile.reference import flash_attn_varlen_reference

from conftest import DEVICE, assert_close_to_oracle, assert_exact_to_oracle, skip_unsupported

# per-sequence (query length, key length): ragged key lengths (1, 7, 113), queries fewer and more than keys, a
# sequence without queries and one without keys
LENGTHS = [(1, 7), (5, 113), (9, 1), (0, 20), (3, 0), (12, 40)]
NHEADS, NHEADS_K, HEADDIM, HEADDIM_V = 4, 2, 24, 40

SCENARIOS = {
    "causal": lambda nseq: {"causal": True},
    "window": lambda nseq: {"window_size": (6, 2)},
    "everything": lambda nseq: {"causal": True, "window_size": (17, -1), "softcap": 3.0, "softmax_scale": 0.3,
                                "alibi_slopes": torch.rand(nseq, NHEADS, device=DEVICE),
                                "learnable_sink": torch.randn(NHEADS, device=DEVICE)},
}


def _cu(lengths) -> torch.Tensor:
    return torch.tensor([0] + torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist(), dtype=torch.int32,
                        device=DEVICE)


def paged_inputs(lengths, page_size, dtype, spare_blocks=3, spare_entries=1):
    """q (total_q, nheads, headdim), paged caches, a shuffled block table, cu_seqlens, seqused_k, and the packed
    contiguous k, v gathered from the pages (float64, for the oracle)."""
    lens_q, lens_k = [q for q, _ in lengths], [k for _, k in lengths]
    pages = [-(-length // page_size) for length in lens_k]
    max_blocks = max(pages) + spare_entries
    num_blocks = sum(pages) + spare_blocks
    q = torch.randn(sum(lens_q), NHEADS, HEADDIM, dtype=torch.float64)
    k_cache = torch.full((num_blocks, page_size, NHEADS_K, HEADDIM), float("nan"), dtype=torch.float64)
    v_cache = torch.full((num_blocks, page_size, NHEADS_K, HEADDIM_V), float("nan"), dtype=torch.float64)
    table = torch.full((len(lengths), max_blocks), -1, dtype=torch.int32)
    order = torch.randperm(num_blocks).tolist()
    keys, values = [], []
    for b, (length, used) in enumerate(zip(lens_k, pages)):
        table[b, :used] = torch.tensor([order.pop() for _ in range(used)], dtype=torch.int32)
        position = torch.arange(length)
        block, slot = table[b].long()[position // page_size], position % page_size
        k_cache[block, slot] = torch.randn(length, NHEADS_K, HEADDIM, dtype=torch.float64)
        v_cache[block, slot] = torch.randn(length, NHEADS_K, HEADDIM_V, dtype=torch.float64)
        keys.append(k_cache[block, slot])
        values.append(v_cache[block, slot])
    k, v = torch.cat(keys), torch.cat(values)
    # the caches and q in the tested dtype; the oracle's k and v gathered from them, so both see the same rounding
    q, k_cache, v_cache = (t.to(device=DEVICE, dtype=dtype) for t in (q, k_cache, v_cache))
    k, v = (t.to(device=DEVICE, dtype=dtype) for t in (k, v))
    return dict(q=q, k_cache=k_cache, v_cache=v_cache, block_table=table.to(DEVICE), cu_q=_cu(lens_q),
                cu_k=_cu(lens_k), seqused_k=torch.tensor(lens_k, dtype=torch.int32, device=DEVICE),
                max_q=max(lens_q), max_k=max(lens_k), k=k, v=v)


def _tiles(backend: str):
    # Triton: 32-key blocks look a 16-key page up per key and a 64-key page once per block (both kernel paths)
    if backend == "torch":
        return flashtile.use_backend("torch", block_q=7, block_k=13)
    return flashtile.use_backend("triton", block_m=16, block_n=32)


def _paged(x, cu_k="given", seqused_k=False, **kwargs):
    cu_seqlens_k = {"given": x["cu_k"], "none": None}[cu_k] if isinstance(cu_k, str) else cu_k
    return flashtile.flash_attn_varlen_func(x["q"], x["k_cache"], x["v_cache"], x["cu_q"], cu_seqlens_k, x["max_q"],
                                            x["max_k"], block_table=x["block_table"],
                                            seqused_k=x["seqused_k"] if seqused_k else None, **kwargs)


def _oracle(x, dtype=torch.float64, **kwargs):
    return flash_attn_varlen_reference(x["q"], x["k"], x["v"], x["cu_q"], x["cu_k"], dtype=dtype, **kwargs)


def _assert_follows_the_oracle(got, x, dtype, seed, **kwargs):
    out, lse = got
    assert out.shape == (x["q"].shape[0], NHEADS, HEADDIM_V) and out.dtype == dtype, (out.shape, out.dtype)
    assert lse.shape == (NHEADS, x["q"].shape[0]) and lse.dtype == torch.float32, (lse.shape, lse.dtype)
    (ref_out, ref_lse), (eager_out, eager_lse) = _oracle(x, **kwargs), _oracle(x, dtype=dtype, **kwargs)
    assert_close_to_oracle("out", out, ref_out, eager_out, dtype, seed)
    assert_close_to_oracle("lse", lse, ref_lse, eager_lse, torch.float32 if dtype == torch.float32 else dtype, seed)


@pytest.mark.parametrize("scenario", SCENARIOS.keys())
@pytest.mark.parametrize("page_size", (16, 64))
@pytest.mark.parametrize("dtype", (torch.float32, torch.float16, torch.bfloat16), ids=("fp32", "fp16", "bf16"))
def test_paged_follows_the_oracle(backend, dtype, page_size, scenario, seed):
    """out and lse of every sequence within 2x the same-dtype eager error + floor of the float64 oracle on the
    gathered keys: GQA, dv != d, causal with seqlen_q != seqlen_k per sequence, windows, softcap, ALiBi, a sink."""
    skip_unsupported(backend, dtype)
    x = paged_inputs(LENGTHS, page_size, dtype)
    kwargs = SCENARIOS[scenario](len(LENGTHS))
    with _tiles(backend):
        got = _paged(x, return_lse=True, **kwargs)
    _assert_follows_the_oracle(got, x, dtype, seed, **kwargs)


def test_float64_is_exact_on_the_torch_backend(seed):
    """The torch backend in float64 equals the oracle to rounding (lse to float32's), every option on."""
    x = paged_inputs(LENGTHS, 16, torch.float64)
    kwargs = SCENARIOS["everything"](len(LENGTHS))
    with flashtile.use_backend("torch", block_q=7, block_k=13):
        out, lse = _paged(x, return_lse=True, **kwargs)
    ref_out, ref_lse = _oracle(x, **kwargs)
    assert_exact_to_oracle("out", out, ref_out, seed)
    assert_exact_to_oracle("lse", lse, ref_lse, seed, tol=1e-5)


@pytest.mark.parametrize("keys", ("seqused_k only", "seqused_k and cu_seqlens_k", "cu_seqlens_k only"))
def test_key_counts_from_seqused_k_or_cu_seqlens_k(backend, keys, seed):
    """seqused_k gives the key counts, with cu_seqlens_k None or ignored beside it (here: offsets of longer
    sequences); without it the differences of cu_seqlens_k do. 256-key pages, flash-attn's page size; no mask."""
    x = paged_inputs([(3, 7), (1, 1), (6, 113), (2, 300)], 256, torch.float32)
    if keys == "seqused_k only":
        call = dict(cu_k="none", seqused_k=True)
    elif keys == "seqused_k and cu_seqlens_k":
        call = dict(cu_k=_cu([9, 4, 120, 400]), seqused_k=True)
    else:
        call = dict(cu_k="given")
    with _tiles(backend):
        got = _paged(x, return_lse=True, **call)
    _assert_follows_the_oracle(got, x, torch.float32, seed)


def test_paged_equals_the_packed_call_on_gathered_keys(backend):
    """The same sequences with contiguous packed K/V (no block_table) give the same result, and return_lse=False
    returns out alone."""
    x = paged_inputs(LENGTHS, 16, torch.float32)
    with _tiles(backend):
        paged = _paged(x, causal=True)
        packed = flashtile.flash_attn_varlen_func(x["q"], x["k"], x["v"], x["cu_q"], x["cu_k"], x["max_q"],
                                                  x["max_k"], causal=True)
    assert isinstance(paged, torch.Tensor)
    torch.testing.assert_close(paged, packed, atol=1e-5, rtol=1e-5)


def test_forced_schedules(seed):
    """fa4 runs the paged kernel with its constexprs; fa1, fa3 and decode refuse a paged call, naming why."""
    x = paged_inputs(LENGTHS, 16, torch.float32)
    with flashtile.use_backend("triton", schedule="fa4", block_m=16, block_n=32):
        got = _paged(x, causal=True, return_lse=True)
    _assert_follows_the_oracle(got, x, torch.float32, seed, causal=True)
    for schedule in ("fa1", "fa3", "decode"):
        with flashtile.use_backend("triton", schedule=schedule), pytest.raises(BackendUnavailableError) as error:
            _paged(x)
        assert schedule in str(error.value)


def test_explain_describes_the_paged_call():
    x = paged_inputs(LENGTHS, 16, torch.float32)
    args = dict(cu_seqlens_q=x["cu_q"], cu_seqlens_k=None, max_seqlen_q=x["max_q"], max_seqlen_k=x["max_k"],
                block_table=x["block_table"], seqused_k=x["seqused_k"], causal=True)
    for backend, kernel in (("torch", "gathered from the pages"), ("triton", "attention_fwd_kernel with PAGED")):
        with flashtile.use_backend(backend):
            text = flashtile.explain(x["q"], x["k_cache"], x["v_cache"], api="flash_attn_varlen_func", **args)
        assert "against paged K/V (16-token pages, up to 144 keys per sequence" in text, text
        assert kernel in text, text
    text = flashtile.explain(x["q"], x["k_cache"], x["v_cache"], api="flash_attn_varlen_func",
                             **dict(args, block_table=x["block_table"].long()))
    assert text.startswith("this call would raise TypeError: block_table must be int32"), text


def _break(x, what):
    """x with one argument broken; returns (arguments to _paged, expected error, message fragment)."""
    table, lens = x["block_table"], x["seqused_k"]
    nseq = len(lens)
    if what == "block id past the cache":
        bad = table.clone()
        bad[1, 3] = x["k_cache"].shape[0]
        return dict(x, block_table=bad), {}, ValueError, "block_table[1, 3]"
    if what == "negative block id":
        bad = table.clone()
        bad[5, 0] = -2
        return dict(x, block_table=bad), {}, ValueError, "block_table[5, 0] = -2"
    if what == "int64 block_table":
        return dict(x, block_table=table.long()), {}, TypeError, "block_table must be int32"
    if what == "block_table rows":
        return dict(x, block_table=table[:-1]), {}, ValueError, "block_table must have shape (nseq"
    if what == "int64 seqused_k":
        return dict(x, seqused_k=lens.long()), {"seqused_k": True}, TypeError, "seqused_k must be int32"
    if what == "seqused_k shape":
        return dict(x, seqused_k=lens[:-1]), {"seqused_k": True}, ValueError, f"shape (nseq,) = ({nseq},)"
    if what == "keys past the table":
        bad = lens.clone()
        bad[2] = table.shape[1] * 16 + 1
        return dict(x, seqused_k=bad), {"seqused_k": True}, ValueError, "sequence 2 has seqused_k[2]"
    if what == "no key counts":
        return x, {"cu_k": "none"}, ValueError, "seqused_k or cu_seqlens_k"
    if what == "page size":
        return (dict(x, k_cache=x["k_cache"][:, :8], v_cache=x["v_cache"][:, :8]), {}, ValueError,
                "a positive multiple of 16")
    if what == "packed k":
        return dict(x, k_cache=x["k"], v_cache=x["v"]), {}, ValueError, "paged cache of rank 4"
    if what == "k and v blocks":
        return dict(x, v_cache=x["v_cache"][:-1]), {}, ValueError, "must agree in (num_blocks"
    if what == "gradients":
        return dict(x, q=x["q"].clone().requires_grad_()), {}, NotImplementedError, "forward only"
    if what == "dropout":
        return x, {"dropout_p": 0.1}, NotImplementedError, "forward-only inference: it takes dropout_p = 0"
    if what == "attention probabilities":
        return x, {"return_attn_probs": True}, NotImplementedError, "return_attn_probs=False"
    raise AssertionError(what)


BROKEN = ("block id past the cache", "negative block id", "int64 block_table", "block_table rows", "int64 seqused_k",
          "seqused_k shape", "keys past the table", "no key counts", "page size", "packed k", "k and v blocks",
          "gradients", "dropout", "attention probabilities")


# rules on the values of block_table and seqused_k, which are read on CPU tensors only (on a GPU, reading them would
# synchronise the call; flash_attn_varlen_func's documentation says so)
VALUE_RULES = ("block id past the cache", "negative block id", "keys past the table")


@pytest.mark.parametrize("what", BROKEN)
def test_invalid_calls_raise_before_anything_runs(what, monkeypatch):
    """Each broken argument raises naming it; no backend is reached."""
    if what in VALUE_RULES and DEVICE.type != "cpu":
        pytest.skip("the values of block_table and seqused_k are checked on CPU tensors only (documented)")
    x, call, error, fragment = _break(paged_inputs(LENGTHS, 16, torch.float32), what)
    for backend in flashtile._dispatch.BACKENDS.values():
        monkeypatch.setattr(backend, "paged_varlen_forward", lambda *a: pytest.fail("a backend ran"), raising=False)
    with pytest.raises(error) as raised:
        _paged(x, **call)
    assert fragment in str(raised.value), str(raised.value)


def test_gradients_off_and_seqused_k_without_block_table():
    """Under no_grad a q that requires grad is fine (inference); seqused_k without block_table is refused."""
    x = paged_inputs(LENGTHS, 16, torch.float32)
    with torch.no_grad():
        out = _paged(dict(x, q=x["q"].clone().requires_grad_()))
    assert not out.requires_grad
    with pytest.raises(NotImplementedError, match="seqused_k is taken with block_table"):
        flashtile.flash_attn_varlen_func(x["q"], x["k"], x["v"], x["cu_q"], x["cu_k"], x["max_q"], x["max_k"],
                                         seqused_k=x["seqused_k"])
