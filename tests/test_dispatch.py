"""Backend selection (environment, context manager, auto), explicit failures, and explain()."""

from __future__ import annotations

import pytest
import torch

import flashtile
from flashtile import BackendUnavailableError

from conftest import random_qkv


@pytest.fixture
def tensors():
    return random_qkv(1, 20, 30, 2, 1, 16, 8, torch.float32)


def test_auto_picks_torch_on_cpu(tensors):
    text = flashtile.explain(*tensors)
    assert text.startswith("backend: 'torch'")
    assert "default (auto) on cpu tensors" in text


def test_environment_variable_selects(tensors, monkeypatch):
    monkeypatch.setenv("FLASHTILE_BACKEND", "torch")
    assert "requested by FLASHTILE_BACKEND=torch" in flashtile.explain(*tensors)
    monkeypatch.setenv("FLASHTILE_BACKEND", "cudnn")
    with pytest.raises(ValueError, match=r"environment variable FLASHTILE_BACKEND is 'cudnn'"):
        flashtile.flash_attn_func(*tensors)


def test_requested_backend_that_cannot_serve_raises(tensors, monkeypatch):
    monkeypatch.setenv("FLASHTILE_BACKEND", "triton")
    with pytest.raises(BackendUnavailableError, match=r"backend 'triton' \(requested by FLASHTILE_BACKEND=triton\) cannot serve"):
        flashtile.flash_attn_func(*tensors)
    text = flashtile.explain(*tensors)
    assert text.startswith("this call would raise BackendUnavailableError")


def test_context_manager_overrides_environment_and_nests(tensors, monkeypatch):
    monkeypatch.setenv("FLASHTILE_BACKEND", "triton")
    with flashtile.use_backend("torch", block_q=4, block_k=8):
        assert "block_q 4 x block_k 8" in flashtile.explain(*tensors)
        with flashtile.use_backend("triton"):
            with pytest.raises(BackendUnavailableError):
                flashtile.flash_attn_func(*tensors)
        out = flashtile.flash_attn_func(*tensors)  # back to the outer context
    assert out.shape == (1, 20, 2, 8)


@pytest.mark.parametrize("name, overrides, message", [
    ("cuda", {}, r"use_backend name is 'cuda'"),
    ("torch", {"block_m": 4}, r"backend 'torch' has no tile setting 'block_m'"),
    ("torch", {"block_q": 0}, r"tile setting block_q must be a positive int"),
    ("auto", {"block_q": 8}, r"tile overrides need a named backend"),
])
def test_use_backend_rejects(name, overrides, message):
    with pytest.raises(ValueError, match=message):
        with flashtile.use_backend(name, **overrides):
            pass


def test_explain_describes_the_call(tensors):
    q, k, v = tensors
    slopes = torch.rand(2)
    text = flashtile.explain(q, k, v, causal=True, window_size=(4, -1), softcap=3.0, alibi_slopes=slopes)
    for fragment in ("backend: 'torch'", "batch 1, nheads 2 (nheads_k 1)", "seqlen_q 20", "seqlen_k 30",
                     "headdim 16, headdim_v 8", "float32 on cpu", "window_size=(4, 0)", "bottom-right",
                     "softcap 3", "ALiBi", "tiles visited", "float32 accumulation"):
        assert fragment in text, f"{fragment!r} missing from:\n{text}"


def test_explain_reports_skipped_tiles():
    q, k, v = random_qkv(1, 1024, 1024, 1, 1, 16, 16, torch.float32)
    with flashtile.use_backend("torch", block_q=128, block_k=128):
        text = flashtile.explain(q, k, v, causal=True)
    assert "36 of 64 tiles visited" in text and "(8 with an element mask)" in text


def test_explain_sdpa_and_errors():
    q = torch.randn(2, 4, 9, 8)
    assert "top-left" in flashtile.explain(q, q, q, api="scaled_dot_product_attention", is_causal=True)
    text = flashtile.explain(q, q, q.double(), api="scaled_dot_product_attention")
    assert text.startswith("this call would raise TypeError") and "share one dtype" in text
    assert "has no argument(s) ['causal']" in flashtile.explain(q, q, q, api="scaled_dot_product_attention", causal=True)
