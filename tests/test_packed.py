"""flash-attn's packed variants and window_size as a list or tensor: against the float64 oracle on every
backend, gradients into the packed tensor, flash-attn's signatures, and no copy of the packed tensor."""

from __future__ import annotations

import inspect

import pytest
import torch

import flashtile
from flashtile.reference import flash_attn_reference, flash_attn_varlen_reference

from conftest import (DEVICE, LOW_PRECISION, assert_close_to_oracle, assert_exact_to_oracle, attention_grads,
                      skip_unsupported)

# flash-attn 2's signatures (flash_attn/flash_attn_interface.py): names, order and defaults
_OPTIONS = [("dropout_p", 0.0), ("softmax_scale", None), ("causal", False), ("window_size", (-1, -1)),
            ("softcap", 0.0), ("alibi_slopes", None), ("deterministic", False), ("return_attn_probs", False)]
_REQUIRED = inspect.Parameter.empty
FLASH_ATTN_SIGNATURES = {
    "flash_attn_qkvpacked_func": [("qkv", _REQUIRED)] + _OPTIONS,
    "flash_attn_kvpacked_func": [("q", _REQUIRED), ("kv", _REQUIRED)] + _OPTIONS,
    "flash_attn_varlen_qkvpacked_func": [("qkv", _REQUIRED), ("cu_seqlens", _REQUIRED),
                                         ("max_seqlen", _REQUIRED)] + _OPTIONS,
    "flash_attn_varlen_kvpacked_func": [(name, _REQUIRED) for name in ("q", "kv", "cu_seqlens_q", "cu_seqlens_k",
                                                                        "max_seqlen_q", "max_seqlen_k")] + _OPTIONS,
    # flash-attn >= 2.6 takes block_table (paged K/V) after return_attn_probs
    "flash_attn_varlen_func": [(name, _REQUIRED) for name in ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k",
                                                               "max_seqlen_q", "max_seqlen_k")]
                              + _OPTIONS + [("block_table", None)],
    "flash_attn_with_kvcache": [("q", _REQUIRED), ("k_cache", _REQUIRED), ("v_cache", _REQUIRED), ("k", None),
                                ("v", None), ("rotary_cos", None), ("rotary_sin", None), ("cache_seqlens", None),
                                ("cache_batch_idx", None), ("cache_leftpad", None), ("block_table", None),
                                ("softmax_scale", None), ("causal", False), ("window_size", (-1, -1)),
                                ("softcap", 0.0), ("rotary_interleaved", True), ("alibi_slopes", None),
                                ("num_splits", 0), ("return_softmax_lse", False)],
}


@pytest.mark.parametrize("name", FLASH_ATTN_SIGNATURES)
def test_signatures_are_flash_attns(name):
    """Positional arguments, their names and defaults as in flash-attn; flashtile's extras are keyword-only."""
    parameters = inspect.signature(getattr(flashtile, name)).parameters.values()
    positional = [(p.name, p.default) for p in parameters if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    assert positional == FLASH_ATTN_SIGNATURES[name]
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in parameters if p.name not in dict(positional))


def _packed_call(variant, dtype, causal, requires_grad=True):
    """(packed inputs, flashtile call, oracle call): the oracle takes the unpacked views of the same tensors."""
    def make(*shape):
        return torch.randn(*shape, dtype=torch.float64).to(device=DEVICE, dtype=dtype).requires_grad_(requires_grad)

    lengths = [37, 0, 20]  # ragged, one empty sequence
    cu = torch.tensor([0, 37, 37, 57], dtype=torch.int32, device=DEVICE)
    options = dict(causal=causal, window_size=[9, -1] if not causal else (-1, -1))
    if variant == "qkv":
        qkv = make(2, 29, 3, 4, 16)
        return ((qkv,), lambda **o: flashtile.flash_attn_qkvpacked_func(qkv, return_lse=True, **options, **o),
                lambda **o: flash_attn_reference(*qkv.unbind(2), **options, **o))
    if variant == "kv":  # GQA, seqlen_q != seqlen_k
        q, kv = make(2, 23, 4, 16), make(2, 41, 2, 2, 16)
        return ((q, kv), lambda **o: flashtile.flash_attn_kvpacked_func(q, kv, return_lse=True, **options, **o),
                lambda **o: flash_attn_reference(q, *kv.unbind(2), **options, **o))
    if variant == "varlen-qkv":
        qkv = make(sum(lengths), 3, 4, 16)
        return ((qkv,), lambda **o: flashtile.flash_attn_varlen_qkvpacked_func(qkv, cu, max(lengths), return_lse=True,
                                                                                **options, **o),
                lambda **o: flash_attn_varlen_reference(*qkv.unbind(1), cu, cu, **options, **o))
    cu_k = torch.tensor([0, 30, 45, 45], dtype=torch.int32, device=DEVICE)  # a sequence with queries and no keys
    q, kv = make(sum(lengths), 4, 16), make(45, 2, 1, 16)  # MQA
    return ((q, kv), lambda **o: flashtile.flash_attn_varlen_kvpacked_func(q, kv, cu, cu_k, 37, 30, return_lse=True,
                                                                            **options, **o),
            lambda **o: flash_attn_varlen_reference(q, *kv.unbind(1), cu, cu_k, **options, **o))


VARIANTS = ("qkv", "kv", "varlen-qkv", "varlen-kv")


@pytest.mark.parametrize("causal", (False, True), ids=("window-list", "causal"))
@pytest.mark.parametrize("variant", VARIANTS)
def test_float64_is_exact_with_one_gradient_for_the_packed_tensor(variant, causal, seed):
    """Torch backend, float64: out, lse and the gradient of each packed tensor (one tensor of its shape) equal the
    oracle's on the unpacked views."""
    inputs, call, oracle = _packed_call(variant, torch.float64, causal)
    with flashtile.use_backend("torch"):
        out, lse = call()
    ref_out, ref_lse = oracle()
    assert_exact_to_oracle("out", out, ref_out, seed)
    assert_exact_to_oracle("lse", lse, ref_lse, seed, tol=1e-5)
    # through out only: lse comes back in float32, so a gradient through it is exact to float32 only
    grad_out, grad_lse = torch.randn_like(ref_out), torch.zeros_like(ref_lse)
    got = attention_grads(out, lse, inputs, grad_out, grad_lse)
    want = attention_grads(ref_out, ref_lse, inputs, grad_out, grad_lse)
    for t, g, w in zip(inputs, got, want):
        assert g.shape == t.shape
        assert_exact_to_oracle(f"gradient of the {tuple(t.shape)} input", g, w, seed)


def _spy_on_backend_inputs(monkeypatch) -> list:
    """Record the q, k, v that the backend's forward and backward passes receive."""
    from flashtile import autograd

    seen = []
    real_forward, real_backward = autograd._run_forward, autograd._run_backward

    def forward(q, k, v, *rest):
        seen.append(("forward", q, k, v))
        return real_forward(q, k, v, *rest)

    def backward(grad_out, grad_lse, q, k, v, *rest):
        seen.append(("backward", q, k, v))
        return real_backward(grad_out, grad_lse, q, k, v, *rest)

    monkeypatch.setattr(autograd, "_run_forward", forward)
    monkeypatch.setattr(autograd, "_run_backward", backward)
    return seen


@pytest.mark.parametrize("dtype", (torch.float32,) + LOW_PRECISION, ids=("fp32", "fp16", "bf16"))
@pytest.mark.parametrize("variant", VARIANTS)
def test_low_precision_follows_the_eager_rule_reading_views(backend, variant, dtype, monkeypatch, seed):
    """Every backend: out, lse and the packed gradients within 2x the same-dtype eager error of the oracle. No copy:
    what the backend's forward and backward receive as q, k, v are the packed tensor's own memory (the addresses
    and strides of its views; the Triton launcher passes those strides to the kernels)."""
    skip_unsupported(backend, dtype)
    seen = _spy_on_backend_inputs(monkeypatch)
    inputs, call, oracle = _packed_call(variant, dtype, causal=True)
    with flashtile.use_backend(backend):
        got = call()
    want, eager = oracle(), oracle(dtype=dtype)
    lse_dtype = torch.float32 if dtype == torch.float32 else dtype
    assert got[0].dtype == dtype and got[1].dtype == torch.float32
    for name, i, kind in (("out", 0, dtype), ("lse", 1, lse_dtype)):
        assert_close_to_oracle(name, got[i], want[i], eager[i], kind, seed)
    grad_out, grad_lse = torch.randn_like(want[0]), torch.randn_like(want[1])
    grads = [attention_grads(*result, inputs, grad_out, grad_lse) for result in (got, want, eager)]
    for t, g, w, e in zip(inputs, *grads):
        assert g.dtype == dtype
        assert_close_to_oracle(f"gradient of the {tuple(t.shape)} input", g, w, e, dtype, seed)

    # the views of the packed tensor (its dimension -3 holds q, k, v or k, v)
    expected = list(inputs[0].unbind(-3)) if len(inputs) == 1 else [inputs[0], *inputs[1].unbind(-3)]
    assert [name for name, *_ in seen] == ["forward", "backward"]
    for name, *received in seen:
        for which, r, view in zip("qkv", received, expected):
            r = r.squeeze(0) if r.dim() == view.dim() + 1 else r  # packed sequences travel as (1, total, ...)
            assert (r.data_ptr(), r.stride()) == (view.data_ptr(), view.stride()), f"{name} got a copy of {which}"


def test_packed_shapes_are_checked():
    with pytest.raises(ValueError, match=r"qkv must have shape \(batch, seqlen, 3, nheads, headdim\)"):
        flashtile.flash_attn_qkvpacked_func(torch.randn(2, 5, 2, 4, 8))
    with pytest.raises(ValueError, match=r"kv must have shape \(total_k, 2, nheads_k, headdim\)"):
        flashtile.flash_attn_varlen_kvpacked_func(torch.randn(5, 4, 8), torch.randn(5, 4, 8), None, None, 5, 5)
    with pytest.raises(TypeError, match=r"qkv must be a torch\.Tensor"):
        flashtile.flash_attn_varlen_qkvpacked_func([1.0], None, 5)


WINDOWS = {"tuple": (7, 2), "list": [7, 2], "tensor": torch.tensor([7, 2]), "int32-tensor":
           torch.tensor([7, 2], dtype=torch.int32), "tensor-elements": tuple(torch.tensor([7, 2]))}


@pytest.mark.parametrize("window", WINDOWS.values(), ids=WINDOWS.keys())
def test_window_size_as_a_list_or_tensor_means_its_values(window, seed):
    """flash_attn_func, flash_attn_varlen_func and flash_attn_with_kvcache take the window as a tuple, a list, a
    2-element integer tensor (CPU here; a GPU tensor is read with one synchronisation) or a pair of 0-d tensors."""
    q, k, v = (torch.randn(1, 19, 2, 8, device=DEVICE) for _ in range(3))
    cu = torch.tensor([0, 19], dtype=torch.int32, device=DEVICE)
    window = window.to(DEVICE) if isinstance(window, torch.Tensor) else window
    with flashtile.use_backend("torch"):
        want = flashtile.flash_attn_func(q, k, v, window_size=(7, 2))
        assert torch.equal(flashtile.flash_attn_func(q, k, v, window_size=window), want)
        packed = flashtile.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 19, 19, window_size=window)
        assert torch.equal(packed, flashtile.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 19, 19,
                                                                    window_size=(7, 2)))
        cached = flashtile.flash_attn_with_kvcache(q[:, -3:], k, v, window_size=window)
        assert torch.equal(cached, flashtile.flash_attn_with_kvcache(q[:, -3:], k, v, window_size=(7, 2)))


BAD_WINDOWS = {
    "float tensor": (torch.tensor([1.0, 2.0]), TypeError, r"window_size as a tensor must have an integer dtype"),
    "bool tensor": (torch.tensor([True, False]), TypeError, r"integer dtype, got torch\.bool"),
    "three elements": (torch.tensor([1, 2, 3]), ValueError, r"must have shape \(2,\) \(left, right\), got \(3,\)"),
    "2-d tensor": (torch.tensor([[1, 2]]), ValueError, r"must have shape \(2,\).*got \(1, 2\)"),
    "below -1 in a tensor": (torch.tensor([-3, 0]), ValueError, r"window_size left is -3"),
    "float 0-d tensor": ((torch.tensor(1.0), 2), TypeError, r"window_size left must be an int, got a tensor"),
    "an int": (5, TypeError, r"window_size must be a \(left, right\) pair"),
    "a string": ("ab", TypeError, r"window_size must be a \(left, right\) pair"),
}


@pytest.mark.parametrize("window, error, message", BAD_WINDOWS.values(), ids=BAD_WINDOWS.keys())
def test_bad_window_sizes_raise_in_every_entry_point(window, error, message):
    q, k, v = (torch.randn(1, 5, 2, 8) for _ in range(3))
    cu = torch.tensor([0, 5], dtype=torch.int32)
    calls = [lambda: flashtile.flash_attn_func(q, k, v, window_size=window),
             lambda: flashtile.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 5, 5, window_size=window),
             lambda: flashtile.flash_attn_qkvpacked_func(torch.stack([q, k, v], 2), window_size=window),
             lambda: flashtile.flash_attn_with_kvcache(q, k, v, window_size=window)]
    for call in calls:
        with pytest.raises(error, match=message):
            call()


def test_packed_variants_compile_with_fullgraph(seed):
    """torch.compile(fullgraph=True): the unbind and the attention op trace without a break; same out and gradient."""
    qkv = torch.randn(2, 19, 3, 2, 16, device=DEVICE, requires_grad=True)

    def call(x):
        return flashtile.flash_attn_qkvpacked_func(x, causal=True, window_size=(4, 0))

    with flashtile.use_backend("torch"):
        want = call(qkv)
        got = torch.compile(call, fullgraph=True, backend="aot_eager")(qkv)
        assert torch.equal(want, got)
        assert torch.equal(*(torch.autograd.grad(out.sum(), qkv)[0] for out in (want, got)))
