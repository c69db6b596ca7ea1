"""flash_attn_varlen_func on every backend against the float64 oracle, sequence by sequence.

Packed batches mix lengths that divide no tile size, zero-length query and key sequences, more
queries than keys and the reverse, GQA and dv != d. The max_seqlen hints are given both right and
too small: results must not depend on them.
"""

from __future__ import annotations

import pytest
import torch

import flashtile
from flashtile.reference import flash_attn_varlen_reference

from conftest import (DEVICE, assert_attention_follows_the_eager_rule, assert_exact_to_oracle, attention_grads,
                      forced_tiles, random_qkv, skip_unsupported)

# per-sequence (query length, key length): ragged, empty on either side, q longer and shorter than k
LENGTHS = {
    "mixed": [(5, 9), (0, 4), (17, 17), (33, 20), (1, 0), (12, 30)],
    "decode-like": [(1, 40), (1, 7), (2, 19)],
    "single": [(37, 53)],
    "empty-batch": [],
}


def _cu(lengths) -> torch.Tensor:
    return torch.tensor([0] + torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist(), dtype=torch.int32,
                        device=DEVICE)


def packed_inputs(lengths, nheads, nheads_k, headdim, headdim_v, dtype, requires_grad=True):
    lens_q, lens_k = [q for q, _ in lengths], [k for _, k in lengths]
    q, k, v = random_qkv(1, sum(lens_q), sum(lens_k), nheads, nheads_k, headdim, headdim_v, dtype)
    q, k, v = (t[0].detach().requires_grad_(requires_grad) for t in (q, k, v))
    return q, k, v, _cu(lens_q), _cu(lens_k), max(lens_q, default=0), max(lens_k, default=0)


SCENARIOS = {
    "plain": lambda nseq, nheads: {},
    "causal": lambda nseq, nheads: {"causal": True},
    "window": lambda nseq, nheads: {"window_size": (4, 3)},
    "everything": lambda nseq, nheads: {"causal": True, "window_size": (9, -1), "softcap": 3.0,
                                        "softmax_scale": 0.4,
                                        "alibi_slopes": torch.rand(nseq, nheads, device=DEVICE) if nseq
                                        else torch.rand(nheads, device=DEVICE)},
}


def _run(q, k, v, cu_q, cu_k, max_q, max_k, kwargs):
    return flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, return_lse=True, **kwargs)


@pytest.mark.parametrize("hint", ("exact", "too-small"))
@pytest.mark.parametrize("scenario", SCENARIOS.keys())
@pytest.mark.parametrize("lengths", LENGTHS.values(), ids=LENGTHS.keys())
def test_float64_is_exact_per_sequence(lengths, scenario, hint, seed):
    """torch backend in float64: out, lse and gradients equal the per-sequence oracle to rounding."""
    q, k, v, cu_q, cu_k, max_q, max_k = packed_inputs(lengths, 4, 2, 24, 40, torch.float64)
    kwargs = SCENARIOS[scenario](len(lengths), 4)
    if hint == "too-small":
        max_q, max_k = max_q // 3, max_k // 3
    with flashtile.use_backend("torch", block_q=7, block_k=5):
        out, lse = _run(q, k, v, cu_q, cu_k, max_q, max_k, kwargs)
    ref_out, ref_lse = flash_attn_varlen_reference(q, k, v, cu_q, cu_k, **kwargs)
    assert out.shape == (q.shape[0], 4, 40) and lse.shape == (4, q.shape[0]) and lse.dtype == torch.float32
    assert_exact_to_oracle("out", out, ref_out, seed)
    assert_exact_to_oracle("lse", lse, ref_lse, seed, tol=1e-5)
    # through out only: the public lse is float32, so a cotangent on it is rounded to float32
    grad_out, grad_lse = torch.randn_like(ref_out), torch.zeros_like(ref_lse)
    with flashtile.use_backend("torch", block_q=7, block_k=5):
        got = attention_grads(out, lse, (q, k, v), grad_out, grad_lse)
    want = attention_grads(ref_out, ref_lse, (q, k, v), grad_out, grad_lse)
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        assert_exact_to_oracle(name, g, w, seed)


@pytest.mark.parametrize("dtype", (torch.float32, torch.float16, torch.bfloat16), ids=("fp32", "fp16", "bf16"))
@pytest.mark.parametrize("hint", ("exact", "too-small"))
@pytest.mark.parametrize("scenario", SCENARIOS.keys())
@pytest.mark.parametrize("lengths", [LENGTHS["mixed"], LENGTHS["decode-like"]], ids=("mixed", "decode-like"))
def test_low_precision_follows_the_eager_rule(backend, lengths, scenario, hint, dtype, seed):
    """Every backend in fp32/fp16/bf16: out, lse and gradients within 2x the same-dtype eager error + floor."""
    skip_unsupported(backend, dtype)
    q, k, v, cu_q, cu_k, max_q, max_k = packed_inputs(lengths, 4, 2, 24, 40, dtype)
    kwargs = SCENARIOS[scenario](len(lengths), 4)
    if hint == "too-small":
        max_q, max_k = 1, 1
    with forced_tiles(backend, 7, 13):
        got = _run(q, k, v, cu_q, cu_k, max_q, max_k, kwargs)
    assert_attention_follows_the_eager_rule(got, flash_attn_varlen_reference(q, k, v, cu_q, cu_k, **kwargs),
                                            flash_attn_varlen_reference(q, k, v, cu_q, cu_k, dtype=dtype, **kwargs),
                                            (q, k, v), dtype, seed)


def test_equal_lengths_match_the_dense_batch(backend, seed):
    """Packing a dense batch and unpacking the result changes nothing but the layout."""
    q, k, v = random_qkv(3, 21, 34, 4, 1, 16, 16, torch.float32)
    cu_q, cu_k = _cu([21] * 3), _cu([34] * 3)
    with flashtile.use_backend(backend):
        dense, dense_lse = flashtile.flash_attn_func(q, k, v, causal=True, return_lse=True)
        packed, packed_lse = flashtile.flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1),
                                                              cu_q, cu_k, 21, 34, causal=True, return_lse=True)
    torch.testing.assert_close(packed.view(3, 21, 4, 16), dense, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(packed_lse.view(4, 3, 21).transpose(0, 1), dense_lse, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("backward_schedule", (0, 1), ids=("two-launches", "one-launch"))
@pytest.mark.parametrize("scenario", ("plain", "everything"))
def test_triton_backward_writes_every_gradient_row(monkeypatch, backward_schedule, scenario, seed):
    """The kernels' gradient buffers start uninitialised (no zero fill): with every new float tensor filled
    with NaN, dq, dk and dv still match the oracle, including the keys of a sequence without queries (zero
    gradient) and keys that a window hides from every query."""
    lengths = LENGTHS["mixed"]
    q, k, v, cu_q, cu_k, max_q, max_k = packed_inputs(lengths, 4, 2, 16, 24, torch.float32)
    kwargs = SCENARIOS[scenario](len(lengths), 4)
    grad_out = torch.randn(q.shape[0], 4, 24, dtype=torch.float64, device=DEVICE)
    real_empty = torch.empty

    def poisoned_empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    with flashtile.use_backend("triton", backward_schedule=backward_schedule):
        out = flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs)
        monkeypatch.setattr(torch, "empty", poisoned_empty)
        grads = torch.autograd.grad((out.double() * grad_out).sum(), (q, k, v))
        monkeypatch.setattr(torch, "empty", real_empty)
    ref, _ = flash_attn_varlen_reference(q, k, v, cu_q, cu_k, **kwargs)
    want = torch.autograd.grad((ref * grad_out).sum(), (q, k, v))
    for name, got, expected in zip("qkv", grads, want):
        assert bool(got.isfinite().all()), f"d{name} has rows the kernels never wrote"
        torch.testing.assert_close(got.double(), expected.double(), atol=1e-4, rtol=1e-4)


def test_strided_cu_seqlens_read_as_their_values(backend, seed):
    """cu_seqlens given as a strided view (every other entry of a longer tensor) mean their values, in the
    forward and the backward (the kernels index a contiguous array: validation passes a copy on)."""
    q, k, v, cu_q, cu_k, max_q, max_k = packed_inputs([(5, 9), (0, 3), (7, 7)], 4, 2, 16, 16, torch.float32)
    spread = [torch.stack([cu, torch.full_like(cu, 10**6)], dim=1).flatten()[::2] for cu in (cu_q, cu_k)]
    assert not spread[0].is_contiguous() and torch.equal(spread[0], cu_q)
    with flashtile.use_backend(backend):
        out = flashtile.flash_attn_varlen_func(q, k, v, *spread, max_q, max_k, causal=True)
        grads = torch.autograd.grad(out.sum(), (q, k, v))
        plain = flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=True)
        plain_grads = torch.autograd.grad(plain.sum(), (q, k, v))
    assert torch.equal(out, plain)
    for name, a, b in zip("qkv", grads, plain_grads):
        assert torch.equal(a, b), f"d{name} differs with strided cu_seqlens"


def test_late_maximum_in_a_later_sequence_does_not_leak(backend, seed):
    """A huge score in one sequence must not touch its neighbours (sequences never see each other's keys)."""
    q, k, v, cu_q, cu_k, max_q, max_k = packed_inputs([(20, 20), (20, 20)], 2, 2, 16, 16, torch.float32,
                                                      requires_grad=False)
    k[39] = q[0] * 50  # the last key of sequence 1 would dominate sequence 0's first row if it leaked
    with flashtile.use_backend(backend):
        out = flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k)
    ref, _ = flash_attn_varlen_reference(q, k, v, cu_q, cu_k)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_packed_outputs_are_views_whose_backward_copies_nothing(backend):
    """out and lse come back as views of the kernels' batch of one whose backward is a view too: indexing's backward
    zero-fills a tensor of the whole output and copies the gradient into it (a fill and a copy of the whole output
    in every packed backward step, which views avoid)."""
    q, k, v, cu_q, cu_k, max_q, max_k = packed_inputs([(20, 20), (7, 30)], 2, 2, 16, 16, torch.float32)
    with flashtile.use_backend(backend):
        out, lse = flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, return_lse=True)
    for t in (out, lse):
        assert t._base is not None and t.grad_fn.name().startswith("Squeeze"), t.grad_fn.name()


def test_torch_compile_fullgraph(backend):
    torch._dynamo.reset()
    q, k, v, cu_q, cu_k, max_q, max_k = packed_inputs(LENGTHS["mixed"], 4, 2, 16, 16, torch.float32)

    def f(q, k, v):
        return flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=True).square().sum()

    with flashtile.use_backend(backend):
        compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
        got = torch.autograd.grad(compiled(q, k, v), (q, k, v))
        want = torch.autograd.grad(f(q, k, v), (q, k, v))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


def test_explain_describes_packed_sequences():
    q, k, v, cu_q, cu_k, max_q, max_k = packed_inputs(LENGTHS["mixed"], 4, 2, 16, 16, torch.float32)
    text = str(flashtile.explain(q, k, v, api="flash_attn_varlen_func", cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                 max_seqlen_q=max_q, max_seqlen_k=max_k, causal=True))
    assert "6 packed sequences" in text and "max_seqlen_q 33" in text, text
    assert "tiles visited per" not in text, text  # counts from the hints would mislead


def _valid():
    q, k, v, cu_q, cu_k, max_q, max_k = packed_inputs(LENGTHS["mixed"], 4, 2, 16, 16, torch.float32,
                                                      requires_grad=False)
    return dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k)


BAD = [
    (lambda a: a.update(cu_seqlens_q=a["cu_seqlens_q"].long()), TypeError, "cu_seqlens_q must be int32"),
    (lambda a: a.update(cu_seqlens_k=a["cu_seqlens_k"].float()), TypeError, "cu_seqlens_k must be int32"),
    (lambda a: a.update(cu_seqlens_q=a["cu_seqlens_q"].view(1, -1)), ValueError, r"shape \(nseq \+ 1,\)"),
    (lambda a: a.update(cu_seqlens_k=torch.cat([a["cu_seqlens_k"], a["cu_seqlens_k"][-1:]])), ValueError,
     "describes 6 sequences but cu_seqlens_k describes 7"),
    (lambda a: a.update(q=a["q"][None]), ValueError, "q must have rank 3"),
    (lambda a: a.update(max_seqlen_q=-1), ValueError, "max_seqlen_q must be >= 0"),
    (lambda a: a.update(max_seqlen_k=2.5), TypeError, "max_seqlen_k must be an int"),
    (lambda a: a.update(cu_seqlens_q=[0, 5]), TypeError, "cu_seqlens_q must be a torch.Tensor"),
    (lambda a: a.update(alibi_slopes=torch.rand(5, 4, device=DEVICE)), ValueError, r"\(nseq, nheads\) = \(6, 4\)"),
    (lambda a: a.update(v=a["v"][:-1]), ValueError, "k has total_tokens 80 but v has 79; k and v must have the same total_tokens"),
]


# Rules on the values of cu_seqlens: checked where the values are on the host (CPU tensors). On a GPU
# only dtype, shape and device are checked, so a call never waits for the device (the documented contract).
BAD_VALUES = [
    (lambda a: a.update(cu_seqlens_q=a["cu_seqlens_q"].flip(0)), ValueError, r"cu_seqlens_q\[0\] must be 0"),
    (lambda a: a["cu_seqlens_q"].__setitem__(2, 40), ValueError, "cu_seqlens_q must be non-decreasing"),
    (lambda a: a["cu_seqlens_k"].__setitem__(-1, 3), ValueError, "must be non-decreasing|must equal total_k"),
    (lambda a: a.update(q=a["q"][:-1]), ValueError, r"cu_seqlens_q\[-1\] must equal total_q"),
]


@pytest.mark.parametrize("mutate, error, message", BAD)
def test_bad_inputs_raise_naming_the_argument(mutate, error, message):
    args = _valid()
    mutate(args)
    with pytest.raises(error, match=message):
        flashtile.flash_attn_varlen_func(**args)


@pytest.mark.parametrize("mutate, error, message", BAD_VALUES)
def test_bad_cu_seqlens_values_raise_on_the_host(mutate, error, message):
    args = _valid()
    mutate(args)
    args = {name: value.cpu() if isinstance(value, torch.Tensor) else value for name, value in args.items()}
    with pytest.raises(error, match=message):
        flashtile.flash_attn_varlen_func(**args)


def test_bitwise_deterministic(backend):
    q, k, v, cu_q, cu_k, max_q, max_k = packed_inputs(LENGTHS["mixed"], 4, 2, 16, 16, torch.float32)
    runs = []
    with flashtile.use_backend(backend):
        for _ in range(3):
            out = flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=True, deterministic=True)
            runs.append((out,) + torch.autograd.grad(out.square().sum(), (q, k, v)))
    for run in runs[1:]:
        for name, a, b in zip(("out", "dq", "dk", "dv"), runs[0], run):
            assert torch.equal(a, b), f"{name} differs between identical calls"


def test_triton_grid_covers_at_most_varlen_grid_rows_of_a_sequence(monkeypatch):
    """The Triton grids cover at most configs.VARLEN_GRID_ROWS rows of each packed sequence and loop over the
    rest (forward, dK/dV and dQ, both backward schedules): each block's arithmetic is the same whichever
    program takes it, so a 16-row cap gives bitwise the results of the default cap (which covers them all)."""
    from flashtile.triton import configs

    q, k, v, cu_q, cu_k, max_q, max_k = packed_inputs(LENGTHS["mixed"], 4, 2, 16, 24, torch.float32)
    default_cap = configs.VARLEN_GRID_ROWS
    assert 16 < max(max_q, max_k) <= default_cap  # the 16-row cap makes programs loop; the default does not
    results = {}
    for cap, schedule in ((default_cap, 0), (16, 0), (default_cap, 1), (16, 1)):
        monkeypatch.setattr(configs, "VARLEN_GRID_ROWS", cap)
        with flashtile.use_backend("triton", block_m=16, block_n=16, bwd_block_m=16, bwd_block_n=16,
                                   backward_schedule=schedule):
            out, lse = flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=True,
                                                        return_lse=True)
            grads = torch.autograd.grad(out.square().sum(), (q, k, v))
        results[cap, schedule] = (out, lse, *grads)
    for schedule in (0, 1):
        for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), results[16, schedule],
                              results[default_cap, schedule]):
            assert torch.equal(a, b), f"{name} depends on the grid's cover (backward schedule {schedule})"
