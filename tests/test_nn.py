"""flashtile.nn: MultiheadAttention against torch.nn.MultiheadAttention with the same weights, Attention against
flash_attn_func and the float64 oracle.

The rule for MultiheadAttention: the oracle is torch's own module evaluated in float64 (same weights, same inputs).
In float32, flashtile's output and every gradient (inputs and parameters) may differ from the oracle by at most
twice torch's own float32 module's error plus the rounding floor (conftest.assert_close_to_oracle). In float64
(the 'torch' backend), flashtile's module agrees with the oracle within 1e-10.
"""

from __future__ import annotations

import copy

import pytest
import torch

import flashtile
from flashtile.reference import flash_attn_reference

from conftest import DEVICE, assert_close_to_oracle, assert_exact_to_oracle

EMBED, HEADS = 16, 2  # head_dim 8
BATCH, SEQLEN_Q, SEQLEN_K = 2, 5, 7
# torch warns when key_padding_mask and attn_mask differ in type; flashtile combines them as torch does, silently
pytestmark = pytest.mark.filterwarnings("ignore:Support for mismatched key_padding_mask and attn_mask")
CONSTRUCTOR_KEYS = ("dropout", "bias", "add_bias_kv", "add_zero_attn", "kdim", "vdim", "batch_first")

# one row per feature; masks are named by kind (torch's MHA convention: bool True = masked, floating = added)
CASES = {
    "self-attention": dict(self_attention=True),
    "batch-first-cross": dict(batch_first=True),
    "unbatched": dict(batched=False, key_padding_mask="bool", attn_mask="bool-3d"),
    "kdim-vdim": dict(kdim=12, vdim=20, batch_first=True, key_padding_mask="bool", load_from_ours=True),
    "padding-bool": dict(key_padding_mask="bool"),
    "padding-float": dict(key_padding_mask="float"),
    "mask-bool-2d": dict(attn_mask="bool-2d"),
    "mask-bool-3d": dict(attn_mask="bool-3d", batch_first=True),
    "mask-float-2d": dict(attn_mask="float-2d"),
    "mask-float-3d": dict(attn_mask="float-3d"),
    "padding-bool-mask-float": dict(key_padding_mask="bool", attn_mask="float-3d"),
    "causal-with-mask": dict(self_attention=True, attn_mask="causal-float", is_causal=True),
    "causal-without-mask": dict(self_attention=True, attn_mask="causal-torch-only", is_causal=True),
    "causal-cross-padding": dict(attn_mask="causal-bool", is_causal=True, key_padding_mask="bool"),
    "causal-padding-without-mask": dict(attn_mask="causal-torch-only", is_causal=True, key_padding_mask="float"),
    "no-bias": dict(bias=False, attn_mask="bool-2d"),
    "bias-kv": dict(add_bias_kv=True, key_padding_mask="bool", attn_mask="float-2d", load_from_ours=True),
    "zero-attn": dict(add_zero_attn=True, attn_mask="bool-3d", batch_first=True),
    "bias-kv-zero-attn-unbatched": dict(add_bias_kv=True, add_zero_attn=True, batched=False,
                                        key_padding_mask="float"),
    "dropout-in-eval": dict(dropout=0.5, eval=True, attn_mask="bool-2d"),
}


def _randomise(module: torch.nn.Module) -> None:
    """Every parameter random (torch initialises the biases to zero, which would hide them)."""
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, dtype=torch.float64) * 0.3)


def _mask(kind, batched, seqlen_k):
    """A mask in torch's MHA convention; key 0 stays visible to every query (no row is fully masked)."""
    if kind is None:
        return None
    rows = BATCH * HEADS if batched else HEADS
    if kind in ("causal-bool", "causal-float", "causal-torch-only"):
        masked = torch.ones(SEQLEN_Q, seqlen_k, dtype=torch.bool, device=DEVICE).triu(1)
        if kind == "causal-bool":
            return masked
        return torch.zeros(masked.shape, device=DEVICE).masked_fill(masked, float("-inf"))
    if kind in ("bool", "float"):  # key_padding_mask
        shape = (BATCH, seqlen_k) if batched else (seqlen_k,)
    else:
        shape = (SEQLEN_Q, seqlen_k) if kind.endswith("2d") else (rows, SEQLEN_Q, seqlen_k)
    masked = torch.rand(shape) < 0.3
    masked[..., 0] = False
    if kind.startswith("bool"):
        return masked.to(DEVICE)
    return torch.randn(shape).masked_fill(masked, float("-inf")).to(DEVICE)


def _inputs(case):
    """float64 leaves (query, key, value) in the case's layout; the same tensor thrice for self-attention."""
    batched, batch_first = case.get("batched", True), case.get("batch_first", False)

    def make(length, features):
        shape = (length, features)
        if batched:
            shape = (BATCH, length, features) if batch_first else (length, BATCH, features)
        return torch.randn(shape, dtype=torch.float64, device=DEVICE)

    if case.get("self_attention"):
        x = make(SEQLEN_Q, EMBED)
        return x, x, x
    return make(SEQLEN_Q, EMBED), make(SEQLEN_K, case.get("kdim") or EMBED), make(SEQLEN_K, case.get("vdim") or EMBED)


def _modules(case, dtype):
    """(flashtile's module, torch's module, torch's module in float64), one set of weights."""
    kwargs = {key: case[key] for key in CONSTRUCTOR_KEYS if key in case}
    ours = flashtile.nn.MultiheadAttention(EMBED, HEADS, **kwargs, device=DEVICE, dtype=dtype)
    theirs = torch.nn.MultiheadAttention(EMBED, HEADS, **kwargs, device=DEVICE, dtype=dtype)
    source, target = (ours, theirs) if case.get("load_from_ours") else (theirs, ours)
    _randomise(source)
    target.load_state_dict(source.state_dict())
    oracle = copy.deepcopy(theirs).double()
    for module in (ours, theirs, oracle):
        module.train(not case.get("eval", False))
    return ours, theirs, oracle


def _run(module, inputs, case, masks, flashtile_module):
    key_padding_mask, attn_mask = masks
    if flashtile_module and case.get("attn_mask") == "causal-torch-only":
        attn_mask = None  # torch needs the causal mask beside is_causal=True; flashtile does not
    out, weights = module(*inputs, key_padding_mask=key_padding_mask, attn_mask=attn_mask, need_weights=False,
                          is_causal=case.get("is_causal", False))
    assert weights is None
    return out


def _gradients(out, grad, inputs, module):
    leaves = list(dict.fromkeys(inputs))  # self-attention: one leaf
    names = [f"d{name}" for name in ("query", "key", "value")[:len(leaves)]]
    named = list(module.named_parameters())
    grads = torch.autograd.grad((out.double() * grad).sum(), leaves + [p for _, p in named])
    return dict(zip(names + [f"d{name}" for name, _ in named], grads))


def _compare_with_torch(case, backend, dtype, seed):
    ours, theirs, oracle = _modules(case, dtype)
    batched = case.get("batched", True)
    seqlen_k = SEQLEN_Q if case.get("self_attention") else SEQLEN_K
    masks = tuple(_mask(case.get(name), batched, seqlen_k) for name in ("key_padding_mask", "attn_mask"))
    inputs64 = [x.requires_grad_() for x in dict.fromkeys(_inputs(case))]
    inputs64 = inputs64 * 3 if len(inputs64) == 1 else inputs64
    inputs = [x.detach().to(dtype).requires_grad_() for x in dict.fromkeys(inputs64)]
    inputs = inputs * 3 if len(inputs) == 1 else inputs

    with flashtile.use_backend(backend):
        got = _run(ours, inputs, case, masks, flashtile_module=True)
    want = _run(oracle, inputs64, case, masks, flashtile_module=False)
    assert got.shape == want.shape and got.dtype == dtype, f"out: {got.shape} {got.dtype} vs {want.shape}"
    grad = torch.randn_like(want)
    with flashtile.use_backend(backend):
        got_grads = _gradients(got, grad, inputs, ours)
    want_grads = _gradients(want, grad, inputs64, oracle)
    if dtype == torch.float64:
        assert_exact_to_oracle("out", got, want, seed)
        for name, g in got_grads.items():
            assert_exact_to_oracle(name, g, want_grads[name], seed)
        return
    eager = _run(theirs, inputs, case, masks, flashtile_module=False)
    eager_grads = _gradients(eager, grad, inputs, theirs)
    assert_close_to_oracle("out", got, want, eager, dtype, seed)
    for name, g in got_grads.items():
        assert_close_to_oracle(name, g, want_grads[name], eager_grads[name], dtype, seed)


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_multihead_attention_matches_torch_float32(backend, case, seed):
    _compare_with_torch(case, backend, torch.float32, seed)


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_multihead_attention_matches_torch_float64(case, seed):
    _compare_with_torch(case, "torch", torch.float64, seed)


@pytest.mark.parametrize("kwargs", [dict(), dict(kdim=12, vdim=20), dict(bias=False, add_bias_kv=True)],
                         ids=["packed", "separate", "no-bias-bias-kv"])
def test_parameters_and_state_dict_are_torchs(kwargs):
    ours = flashtile.nn.MultiheadAttention(EMBED, HEADS, **kwargs)
    theirs = torch.nn.MultiheadAttention(EMBED, HEADS, **kwargs)
    assert isinstance(ours, torch.nn.MultiheadAttention)
    shapes = [[(name, t.shape) for name, t in m.state_dict().items()] for m in (ours, theirs)]
    assert shapes[0] == shapes[1], f"state_dict entries differ: {shapes}"
    theirs.load_state_dict(ours.state_dict())
    ours.load_state_dict(theirs.state_dict())


def test_need_weights_is_refused_and_off_by_default():
    module = flashtile.nn.MultiheadAttention(EMBED, HEADS)
    x = torch.randn(SEQLEN_Q, BATCH, EMBED, device=DEVICE)
    out, weights = module(x, x, x)
    assert weights is None and out.shape == x.shape
    with pytest.raises(ValueError, match="need_weights=True asks for the attention weights.*never forms"):
        module(x, x, x, need_weights=True)


def test_fully_masked_row_gives_the_output_bias(backend):
    module = flashtile.nn.MultiheadAttention(EMBED, HEADS, batch_first=True, device=DEVICE)
    _randomise(module)
    x = torch.randn(BATCH, SEQLEN_Q, EMBED, device=DEVICE)
    masked = torch.zeros(SEQLEN_Q, SEQLEN_Q, dtype=torch.bool, device=DEVICE)
    masked[2] = True  # query 2 may attend no key
    with flashtile.use_backend(backend):
        out, _ = module(x, x, x, attn_mask=masked)
    torch.testing.assert_close(out[:, 2], module.out_proj.bias.detach().expand(BATCH, -1), rtol=0, atol=0)


def test_invalid_masks_raise_naming_them():
    module = flashtile.nn.MultiheadAttention(EMBED, HEADS)
    q = torch.randn(SEQLEN_Q, BATCH, EMBED, device=DEVICE)
    kv = torch.randn(SEQLEN_K, BATCH, EMBED, device=DEVICE)
    boolean = dict(dtype=torch.bool, device=DEVICE)
    bad = [
        (dict(attn_mask=torch.zeros(SEQLEN_K, SEQLEN_Q, **boolean)), ValueError, r"attn_mask has shape \(7, 5\)"),
        (dict(attn_mask=torch.zeros(HEADS, SEQLEN_Q, SEQLEN_K, **boolean)), ValueError,
         r"\(N \* num_heads, L, S\) = \(4, 5, 7\)"),
        (dict(key_padding_mask=torch.zeros(SEQLEN_K, BATCH, **boolean)), ValueError, "key_padding_mask has shape"),
        (dict(key_padding_mask=torch.zeros(BATCH, SEQLEN_K, dtype=torch.int64, device=DEVICE)), TypeError,
         "key_padding_mask must be bool"),
        # the causal promise is checked on CPU masks (on a GPU that would cost a synchronisation)
        (dict(attn_mask=torch.ones(SEQLEN_Q, SEQLEN_K, dtype=torch.bool), is_causal=True), ValueError,
         "is_causal=True promises that attn_mask is the causal mask"),
    ]
    for kwargs, error, message in bad:
        with pytest.raises(error, match=message):
            module(q, kv, kv, **kwargs)
    with pytest.raises(ValueError, match="key has 12 features .* kdim is 16"):
        module(q, kv[..., :12], kv)


def _refuses_dropout(function, *args) -> bool:
    """Whether this flashtile build refuses dropout_p > 0 in `function` (at validation, before computing)."""
    try:
        with flashtile.use_backend("torch"):
            function(*args, dropout_p=0.5)
    except NotImplementedError as error:
        assert "dropout" in str(error)
        return True
    return False


def test_multihead_attention_dropout_in_training(seed):
    module = flashtile.nn.MultiheadAttention(EMBED, HEADS, dropout=0.5, device=DEVICE)
    x = torch.randn(SEQLEN_Q, BATCH, EMBED, device=DEVICE)
    y = torch.randn(1, 1, 3, 8, device=DEVICE)
    with flashtile.use_backend("torch"):
        if _refuses_dropout(flashtile.scaled_dot_product_attention, y, y, y):
            with pytest.raises(NotImplementedError,
                               match=r"MultiheadAttention\(dropout=0.5\) in training mode.*dropout=0.0.*\.eval\(\)"):
                module(x, x, x)
        else:
            dropped, _ = module(x, x, x)
            assert dropped.shape == x.shape and dropped.isfinite().all()
            assert not torch.equal(dropped, module.eval()(x, x, x)[0]), "dropout changed nothing"


def _attention_inputs(dtype, requires_grad=True):
    def make(*shape):
        return torch.randn(*shape, dtype=torch.float64).to(device=DEVICE, dtype=dtype).requires_grad_(requires_grad)

    # GQA: 4 query heads over 2 key/value heads; seqlen_q < seqlen_k; headdim_v != headdim
    return make(2, 7, 4, 16), make(2, 11, 2, 16), make(2, 11, 2, 12)


OPTIONS = {
    "defaults": (dict(), dict()),
    "causal": (dict(causal=True), dict()),
    "window-softcap": (dict(window_size=(3, 1), softcap=2.0, softmax_scale=0.3), dict()),
    "forward-overrides": (dict(causal=True, window_size=(2, 2)), dict(causal=False, window_size=(-1, 1))),
}


@pytest.mark.parametrize("options", OPTIONS.values(), ids=OPTIONS.keys())
def test_attention_module_is_flash_attn_func(backend, options, seed):
    constructor, call = options
    module = flashtile.nn.Attention(**constructor)
    assert list(module.parameters()) == []
    effective = {"causal": False, "window_size": (-1, -1), "softcap": 0.0, "softmax_scale": None,
                 **constructor, **call}
    q, k, v = _attention_inputs(torch.float32)
    with flashtile.use_backend(backend):
        got = module(q, k, v, **call)
        direct = flashtile.flash_attn_func(q, k, v, **effective)
    assert torch.equal(got, direct), "the module and flash_attn_func differ"
    want, _ = flash_attn_reference(q, k, v, **effective)
    eager, _ = flash_attn_reference(q, k, v, dtype=torch.float32, **effective)
    assert_close_to_oracle("out", got, want, eager, torch.float32, seed)
    grad = torch.randn_like(want)
    for name, g, w, e in zip(("dq", "dk", "dv"), *(torch.autograd.grad((o.double() * grad).sum(), (q, k, v))
                                                   for o in (got, want, eager))):
        assert_close_to_oracle(name, g, w, e, torch.float32, seed)


def test_attention_module_float64_and_alibi(seed):
    q, k, v = _attention_inputs(torch.float64, requires_grad=False)
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625], dtype=torch.float64, device=DEVICE)
    with flashtile.use_backend("torch"):
        got = flashtile.nn.Attention(causal=True)(q, k, v, alibi_slopes=slopes)
    want, _ = flash_attn_reference(q, k, v, causal=True, alibi_slopes=slopes)
    assert_exact_to_oracle("out", got, want, seed)


def test_attention_module_validates_its_defaults():
    with pytest.raises(ValueError, match=r"dropout_p must be in \[0, 1\)"):
        flashtile.nn.Attention(dropout_p=1.5)
    with pytest.raises(TypeError, match="causal must be a bool"):
        flashtile.nn.Attention(causal=1)
    with pytest.raises(ValueError, match="window_size left is -2"):
        flashtile.nn.Attention(window_size=(-2, 0))
    assert "causal=True" in repr(flashtile.nn.Attention(causal=True))


def test_attention_module_dropout_in_training():
    q, k, v = _attention_inputs(torch.float32, requires_grad=False)
    module = flashtile.nn.Attention(dropout_p=0.5)
    with flashtile.use_backend("torch"):
        evaluated = module.eval()(q, k, v)
        assert torch.equal(evaluated, flashtile.flash_attn_func(q, k, v)), "dropout applied in evaluation mode"
        module.train()
        if _refuses_dropout(flashtile.flash_attn_func, q, k, v):
            with pytest.raises(NotImplementedError,
                               match=r"Attention\(dropout_p=0.5\) in training mode.*dropout_p=0.0.*\.eval\(\)"):
                module(q, k, v)
        else:
            assert not torch.equal(module(q, k, v), evaluated), "dropout changed nothing"


@pytest.mark.parametrize("case", [CASES[name] for name in ("self-attention", "padding-bool-mask-float")],
                         ids=["self-attention", "padding-bool-mask-float"])
def test_multihead_attention_float16_follows_the_eager_rule(backend, case, seed):
    _compare_with_torch(case, backend, torch.float16, seed)
