"""The schedule registry: flashtile.schedules(), selecting a schedule (use_backend, FLASHTILE_SCHEDULE), the errors
of a schedule that cannot serve a call, explain(), and the invariant that fa1, fa2 and fa4 compute one function.

The schedules are compared against the float64 oracle under the eager rule (conftest) and within the rule's bound of
each other, never bit for bit: their sums run in different orders (fa1 normalises O at every key block, fa4 keeps a
stale max and computes some exponentials by a cubic).
"""

from __future__ import annotations

import pytest
import torch

import flashtile
from flashtile.reference import flash_attn_reference

from conftest import (DEVICE, INTERPRETED, assert_attention_follows_the_eager_rule, assert_close_to_oracle,
                      assert_within_bounds, eager_rule_bound, max_abs_error, random_qkv, skip_unsupported)

DTYPES = {"fp32": torch.float32, "fp16": torch.float16}
NAMES = ("fa1", "fa2", "fa3", "fa4", "decode")


def _by_name(device=DEVICE, dtype=None) -> dict:
    return {s.name: s for s in flashtile.schedules(device, dtype)}


def test_schedules_lists_the_built_schedules():
    records = flashtile.schedules(DEVICE, torch.float16)
    assert tuple(s.name for s in records) == NAMES, [s.name for s in records]
    for s in records:
        assert s.description and s.bottleneck and s.forward_kernel, f"{s.name}: an empty field"
        assert s.available == (s.reason == ""), f"{s.name}: available {s.available} with reason {s.reason!r}"
    by_name = {s.name: s for s in records}
    assert by_name["fa1"].forward_kernel == "attention_fwd_fa1_kernel"
    assert "attention_fwd_kernel" in by_name["fa2"].forward_kernel
    assert "attention_fwd_tma_kernel" in by_name["fa2"].forward_kernel
    assert "attention_fwd_gluon_kernel" in by_name["fa3"].forward_kernel
    assert "attention_decode_kernel" in by_name["decode"].forward_kernel and by_name["decode"].backward_kernel is None
    # fa1's backward is the shared recompute backward
    assert by_name["fa1"].backward_kernel.startswith(by_name["fa2"].backward_kernel)
    assert "attention_bwd_dq_kernel" in by_name["fa1"].backward_kernel


@pytest.mark.skipif(not INTERPRETED, reason="availability under Triton's CPU interpreter")
def test_availability_under_the_interpreter():
    by_name = _by_name("cpu", torch.float32)
    assert all(by_name[n].available for n in ("fa1", "fa2", "fa4", "decode")), by_name
    assert not by_name["fa3"].available and "interpreter" in by_name["fa3"].reason
    for s in flashtile.schedules("cpu", torch.float64):
        assert not s.available and "float64" in s.reason, s
    assert flashtile.schedules() == flashtile.schedules(None, None)


def test_schedules_rejects_bad_arguments():
    with pytest.raises(TypeError, match="device must be a torch.device, a str or None"):
        flashtile.schedules(3)
    with pytest.raises(TypeError, match="dtype must be a torch.dtype or None"):
        flashtile.schedules(DEVICE, "float16")


def test_selection_by_use_backend_and_explain():
    q, k, v = random_qkv(1, 20, 30, 2, 1, 16, 16, torch.float32)
    for name in ("fa1", "fa2", "fa4"):
        with flashtile.use_backend("triton", schedule=name):
            text = flashtile.explain(q, k, v, causal=True)
        assert text.startswith(f"backend: 'triton', schedule {name!r} (forced)"), text
        assert f"schedule={name!r}" in text, text
    with flashtile.use_backend("triton", schedule="fa1", block_n=32):
        text = flashtile.explain(q, k, v)
    assert "tiles: forward (attention_fwd_fa1_kernel" in text and "BLOCK_N 32" in text, text
    with flashtile.use_backend("triton"):
        text = flashtile.explain(q, k, v)
    assert text.startswith("backend: 'triton', schedule 'fa2' —") and "(forced)" not in text, text


def test_selection_by_environment(monkeypatch):
    q, k, v = random_qkv(1, 20, 30, 2, 1, 16, 16, torch.float32)
    monkeypatch.setenv("FLASHTILE_SCHEDULE", "fa1")
    text = flashtile.explain(q, k, v)
    assert text.startswith("backend: 'triton', schedule 'fa1' (forced)") and "FLASHTILE_SCHEDULE=fa1" in text, text
    monkeypatch.setenv("FLASHTILE_BACKEND", "triton")
    assert flashtile.explain(q, k, v).startswith("backend: 'triton', schedule 'fa1'")
    with flashtile.use_backend("torch"):  # a context replaces the environment's request whole
        assert flashtile.explain(q, k, v).startswith("backend: 'torch'")
    monkeypatch.setenv("FLASHTILE_BACKEND", "torch")
    with pytest.raises(ValueError, match="FLASHTILE_SCHEDULE is 'fa1', a schedule of the 'triton' backend"):
        flashtile.flash_attn_func(q, k, v)
    monkeypatch.delenv("FLASHTILE_BACKEND")
    monkeypatch.setenv("FLASHTILE_SCHEDULE", "fa5")
    with pytest.raises(ValueError, match="FLASHTILE_SCHEDULE is 'fa5'; expected one of 'fa1', 'fa2', 'fa3', 'fa4', "
                                         "'decode'"):
        flashtile.flash_attn_func(q, k, v)


def test_selection_errors():
    with pytest.raises(ValueError, match="use_backend schedule is 'fa5'; expected one of 'fa1', 'fa2', 'fa3', 'fa4'"):
        with flashtile.use_backend("triton", schedule="fa5"):
            pass
    for backend in ("torch", "auto"):
        with pytest.raises(ValueError, match="a schedule of the 'triton' backend"):
            with flashtile.use_backend(backend, schedule="fa1"):
                pass
    q, k, v = random_qkv(1, 20, 30, 2, 1, 16, 16, torch.float32)
    with pytest.raises(ValueError, match="forward_schedule=1 contradicts schedule 'fa1'"):
        with flashtile.use_backend("triton", schedule="fa1", forward_schedule=1):
            flashtile.flash_attn_func(q, k, v)
    with pytest.raises(ValueError, match="forward_schedule=3 contradicts schedule 'fa2'"):
        with flashtile.use_backend("triton", schedule="fa2", forward_schedule=3):
            flashtile.flash_attn_func(q, k, v)


UNSERVED = {
    "fa1 softcap": ("fa1", "flash_attn_func", {"softcap": 5.0}, "does not take softcap"),
    "fa1 alibi": ("fa1", "flash_attn_func", {"alibi_slopes": "slopes"}, "does not take ALiBi"),
    "fa1 mask": ("fa1", "scaled_dot_product_attention", {"attn_mask": "mask"}, "does not take an attn_mask"),
    "fa1 packed": ("fa1", "flash_attn_varlen_func", {}, "does not take packed variable-length batches"),
    "fa1 kv cache": ("fa1", "flash_attn_with_kvcache", {}, "KV-cache calls .* are the decode schedule's"),
    "fa2 kv cache": ("fa2", "flash_attn_with_kvcache", {}, "KV-cache calls .* are the decode schedule's"),
    "fa4 kv cache": ("fa4", "flash_attn_with_kvcache", {}, "KV-cache calls .* are the decode schedule's"),
    "fa3 cpu": ("fa3", "flash_attn_func", {}, "Gluon kernels do not run in Triton's CPU interpreter"),
    "decode dense": ("decode", "flash_attn_func", {}, "serves flash_attn_with_kvcache calls only"),
}


@pytest.mark.skipif(not INTERPRETED, reason="fa3's reason here is the interpreter's")
@pytest.mark.parametrize("schedule, api, kwargs, message", UNSERVED.values(), ids=UNSERVED.keys())
def test_a_forced_schedule_that_cannot_serve_raises(schedule, api, kwargs, message):
    """Never a silent fallback: the call raises BackendUnavailableError naming the schedule and the reason, and
    explain() says the same."""
    q, k, v = random_qkv(2, 5, 9, 2, 1, 16, 16, torch.float32)
    kwargs = dict(kwargs)
    if kwargs.get("alibi_slopes") == "slopes":
        kwargs["alibi_slopes"] = torch.rand(2, device=DEVICE)
    if api == "scaled_dot_product_attention":
        q, k, v = (t.transpose(1, 2) for t in (q, k, v[..., :16]))
        k, v = k.expand(-1, 2, -1, -1), v.expand(-1, 2, -1, -1)
        kwargs["attn_mask"] = torch.ones(5, 9, dtype=torch.bool, device=DEVICE)
        call = lambda: flashtile.scaled_dot_product_attention(q, k, v, **kwargs)  # noqa: E731
    elif api == "flash_attn_varlen_func":
        cu = torch.tensor([0, 2, 5], dtype=torch.int32, device=DEVICE)
        q, k, v = q[0], k[0, :5], v[0, :5]
        kwargs.update(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=3, max_seqlen_k=3)
        call = lambda: flashtile.flash_attn_varlen_func(q, k, v, **kwargs)  # noqa: E731
    elif api == "flash_attn_with_kvcache":
        q = q[:, :1]
        kwargs["cache_seqlens"] = 4
        call = lambda: flashtile.flash_attn_with_kvcache(q, k, v, **kwargs)  # noqa: E731
    else:
        call = lambda: flashtile.flash_attn_func(q, k, v, **kwargs)  # noqa: E731
    with flashtile.use_backend("triton", schedule=schedule):
        pattern = f"schedule '{schedule}' .*cannot serve this call: .*{message}"
        with pytest.raises(flashtile.BackendUnavailableError, match=pattern):
            call()
        text = flashtile.explain(q, k, v, api=api, **kwargs)
    assert text.startswith("this call would raise BackendUnavailableError") and f"'{schedule}'" in text, text


def test_decode_schedule_serves_the_kv_cache():
    q, k, v = random_qkv(2, 1, 40, 4, 2, 16, 16, torch.float32)
    with flashtile.use_backend("triton", schedule="decode"):
        out, lse = flashtile.flash_attn_with_kvcache(q, k, v, cache_seqlens=33, return_softmax_lse=True)
        text = flashtile.explain(q, k, v, api="flash_attn_with_kvcache", cache_seqlens=33)
    assert text.startswith("backend: 'triton', schedule 'decode' (forced)"), text
    ref_out, _ = flash_attn_reference(q, k[:, :33], v[:, :33])
    assert max_abs_error(out, ref_out)[0] < 1e-5
    with flashtile.use_backend("triton"):  # the table's choice for a KV-cache call is the decode schedule
        assert flashtile.explain(q, k, v, api="flash_attn_with_kvcache").startswith(
            "backend: 'triton', schedule 'decode' —")


def test_forced_schedules_keep_int_tiles():
    """The tiles travel as lists of ints (the custom ops, the resolution cache): a forced schedule is an int field
    that survives the round trip."""
    from flashtile import _dispatch

    q, k, v = random_qkv(1, 20, 30, 2, 1, 16, 16, torch.float32)
    call = flashtile._validate.prepare_flash_attn(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                                                  window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                                                  deterministic=False, return_attn_probs=False, return_lse=False)
    backend = _dispatch.BACKENDS["triton"]
    for name, code in (("fa1", 1), ("fa2", 2), ("fa4", 4)):
        with flashtile.use_backend("triton", schedule=name):
            resolved_name, values = _dispatch.resolve(call.problem)
        assert resolved_name == "triton" and all(type(x) is int for x in values), values
        tiles = backend.tiles_from_list(values)
        assert tiles.forced_schedule == code and backend.tiles_to_list(tiles) == list(values)
    with flashtile.use_backend("triton"):
        assert backend.tiles_from_list(_dispatch.resolve(call.problem)[1]).forced_schedule == 0


# (batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, headdim_v): lengths that divide no block, GQA
INVARIANT_SHAPE = (1, 255, 263, 4, 2, 64, 64)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_the_schedules_compute_one_function(dtype, causal, seed):
    """fa1, fa2 and fa4 (the schedules the interpreter runs on dense calls): each within the eager rule of the float64
    oracle, within the rule's bound of fa2, and their max errors against the oracle within that bound of fa2's.
    Their max errors are not equal to three significant digits in general: fa1 rescales and rounds the normalised O
    at every key block, fa2 once at the end, fa4 rescales only where a row's max rises by more than its threshold and
    (fp16) computes a quarter of the exponentials by a cubic, so the last bits differ, and so, at times, does the
    largest error (docs/schedules.md)."""
    skip_unsupported("triton", dtype)
    q, k, v = random_qkv(*INVARIANT_SHAPE, dtype)
    ref_out, _ = flash_attn_reference(q, k, v, causal=causal)
    eager_out, _ = flash_attn_reference(q, k, v, causal=causal, dtype=dtype)
    outs = {}
    for name in ("fa1", "fa2", "fa4"):
        with flashtile.use_backend("triton", schedule=name):
            outs[name] = flashtile.flash_attn_func(q, k, v, causal=causal)
        assert_close_to_oracle(f"out ({name})", outs[name], ref_out, eager_out, dtype, seed)
    bound = eager_rule_bound(ref_out, eager_out, dtype)
    errors = {name: max_abs_error(out, ref_out)[0] for name, out in outs.items()}
    for name in ("fa1", "fa4"):
        assert_within_bounds(("out",), (outs[name],), (outs["fa2"],), {"out": bound}, f"{name} and fa2", seed)
        assert abs(errors[name] - errors["fa2"]) <= bound, \
            f"max errors against the oracle {errors}, bound {bound:.3e}"


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_fa1_forward_and_shared_backward(dtype, seed):
    """Forward through fa1 and torch.autograd.grad through the shared recompute backward, against the oracle."""
    skip_unsupported("triton", dtype)
    shape, kwargs = (2, 45, 61, 4, 2, 32, 24), {"causal": True}
    q, k, v = random_qkv(*shape, dtype, requires_grad=True)
    with flashtile.use_backend("triton", schedule="fa1"):
        got = flashtile.flash_attn_func(q, k, v, return_lse=True, **kwargs)
        assert_attention_follows_the_eager_rule(got, flash_attn_reference(q, k, v, **kwargs),
                                                flash_attn_reference(q, k, v, dtype=dtype, **kwargs), (q, k, v),
                                                dtype, seed)
