"""Backend selection (environment, context manager, auto), explicit failures, and explain()."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import flashtile
from flashtile import BackendUnavailableError
from flashtile.triton import configs as triton_configs

from conftest import DEVICE, random_qkv


@pytest.fixture
def tensors():
    return random_qkv(1, 20, 30, 2, 1, 16, 8, torch.float32)


def test_auto_picks_by_device(tensors):
    text = flashtile.explain(*tensors)
    if DEVICE.type == "cpu":
        assert text.startswith("backend: 'torch'") and "default (auto) on cpu tensors" in text
        assert "the Triton interpreter is a test vehicle" in text
    else:
        assert text.startswith("backend: 'triton'") and "fused Triton kernels for CUDA tensors" in text
    q64 = [t.double() for t in tensors]
    assert flashtile.explain(*q64).startswith("backend: 'torch'"), "float64 is served by the torch backend"


def test_environment_variable_selects(tensors, monkeypatch):
    monkeypatch.setenv("FLASHTILE_BACKEND", "torch")
    assert "requested by FLASHTILE_BACKEND=torch" in flashtile.explain(*tensors)
    monkeypatch.setenv("FLASHTILE_BACKEND", "cudnn")
    with pytest.raises(ValueError, match=r"environment variable FLASHTILE_BACKEND is 'cudnn'"):
        flashtile.flash_attn_func(*tensors)


def test_requested_backend_that_cannot_serve_raises(tensors, monkeypatch):
    monkeypatch.setenv("FLASHTILE_BACKEND", "triton")
    as_float64 = [t.double() for t in tensors]
    with pytest.raises(BackendUnavailableError, match=r"backend 'triton' \(requested by FLASHTILE_BACKEND=triton\) "
                                                      r"cannot serve this call: float64 is not supported"):
        flashtile.flash_attn_func(*as_float64)
    text = flashtile.explain(*as_float64)
    assert text.startswith("this call would raise BackendUnavailableError")


def test_triton_on_cpu_needs_the_interpreter(tensors, monkeypatch):
    # kernels defined outside the interpreter (once they are defined, TRITON_INTERPRET is no longer read)
    monkeypatch.setattr(triton_configs, "_kernels_interpreted", False)
    if DEVICE.type != "cpu":
        pytest.skip("about CPU tensors")
    with flashtile.use_backend("triton"):
        with pytest.raises(BackendUnavailableError, match=r"only under the interpreter \(TRITON_INTERPRET=1"):
            flashtile.flash_attn_func(*tensors)


def test_interpreting_follows_the_kernels_once_they_are_defined(monkeypatch):
    monkeypatch.setattr(triton_configs, "_kernels_interpreted", None)  # restored after the test
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not triton_configs.interpreting()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert triton_configs.interpreting()
    from flashtile.triton import launch

    triton_configs.record_kernel_mode(launch.attention_fwd_kernel)
    monkeypatch.setenv("TRITON_INTERPRET", "0" if DEVICE.type == "cpu" else "1")  # the other way from the kernels
    assert triton_configs.interpreting() == (DEVICE.type == "cpu")  # CI interprets them; the GPU suite compiles


def test_context_manager_overrides_environment_and_nests(tensors, monkeypatch):
    monkeypatch.setenv("FLASHTILE_BACKEND", "triton")
    with flashtile.use_backend("torch", block_q=4, block_k=8):
        assert "block_q 4 x block_k 8" in flashtile.explain(*tensors)
        with flashtile.use_backend("triton"):
            with pytest.raises(BackendUnavailableError):
                flashtile.flash_attn_func(*[t.double() for t in tensors])
        out = flashtile.flash_attn_func(*[t.double() for t in tensors])  # back to the outer (torch) context
    assert out.shape == (1, 20, 2, 8)


@pytest.mark.parametrize("name, overrides, message", [
    ("cuda", {}, r"use_backend name is 'cuda'"),
    ("torch", {"block_m": 4}, r"backend 'torch' has no tile setting 'block_m'"),
    ("torch", {"block_q": 0}, r"tile setting block_q must be a positive int"),
    ("triton", {"block_m": 24}, r"tile setting block_m must be a power of two >= 16, got 24"),
    ("triton", {"block_q": 16}, r"backend 'triton' has no tile setting 'block_q'"),
    ("auto", {"block_q": 8}, r"tile overrides need a named backend"),
])
def test_use_backend_rejects(name, overrides, message):
    with pytest.raises(ValueError, match=message):
        with flashtile.use_backend(name, **overrides):
            pass


def test_explain_describes_the_call(tensors):
    q, k, v = (t.cpu() for t in tensors)
    slopes = torch.rand(2)
    text = flashtile.explain(q, k, v, causal=True, window_size=(4, -1), softcap=3.0, alibi_slopes=slopes)
    for fragment in ("backend: 'torch'", "batch 1, seqlen_q 20, seqlen_k 30", "nheads 2 (nheads_k 1)",
                     "headdim 16, headdim_v 8", "float32 on cpu", "window_size=(4, 0)", "bottom-right",
                     "softcap 3", "ALiBi", "tiles visited", "float32 accumulation"):
        assert fragment in text, f"{fragment!r} missing from:\n{text}"


def test_explain_reports_skipped_tiles():
    q, k, v = random_qkv(1, 1024, 1024, 1, 1, 16, 16, torch.float32)
    with flashtile.use_backend("torch", block_q=128, block_k=128):
        text = flashtile.explain(q, k, v, causal=True)
    assert "36 of 64 tiles visited" in text and "(8 with an element mask)" in text
    with flashtile.use_backend("triton", block_m=128, block_n=64):
        text = flashtile.explain(q, k, v, causal=True)
    assert "BLOCK_M 128 x BLOCK_N 64" in text and "forward visits 72 of 128 tiles" in text


def test_explain_sdpa_and_errors():
    q = torch.randn(2, 4, 9, 8)
    assert "top-left" in flashtile.explain(q, q, q, api="scaled_dot_product_attention", is_causal=True)
    text = flashtile.explain(q, q, q.double(), api="scaled_dot_product_attention")
    assert text.startswith("this call would raise TypeError") and "share one dtype" in text
    assert "has no argument(s) ['causal']" in flashtile.explain(q, q, q, api="scaled_dot_product_attention", causal=True)


def test_kernels_launch_on_the_tensors_gpu_not_the_current_one(monkeypatch):
    """Triton launches on the current CUDA device: the Triton backend makes the tensors' device current for every
    pass (tensors on cuda:1 while cuda:0 is current, a model split across GPUs) and leaves it alone otherwise.
    test_gpu.py runs this on two GPUs."""
    from flashtile import _dispatch

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert isinstance(_dispatch.on_device(torch.device("cuda", 1)), torch.cuda.device)
    assert _dispatch.on_device(torch.device("cuda", 1)).idx == 1
    for device in (torch.device("cuda", 0), torch.device("cpu")):
        assert not isinstance(_dispatch.on_device(device), torch.cuda.device), device
    entered = []

    class Guard:
        def __init__(self, device):
            self.device = device

        def __enter__(self):
            entered.append(self.device)

        def __exit__(self, *exc):
            entered.append("exit")

    class Launchers:
        def __getattr__(self, name):
            return lambda *args, **kwargs: entered.append(name)

    monkeypatch.setattr(_dispatch, "on_device", Guard)
    monkeypatch.setattr(_dispatch, "_triton_launch", lambda: Launchers())
    backend, gpu = _dispatch.BACKENDS["triton"], torch.device("cuda", 1)
    q = SimpleNamespace(device=gpu)  # what the backend reads of a tensor before handing it to the launchers
    backend.forward(q, q, q, None, None, None, None)
    backend.backward(q, None, q, q, q, q, q, None, None, None, None)
    backend.decode(SimpleNamespace(q=q), None, 0)
    assert entered == [gpu, "forward", "exit", gpu, "backward", "exit", gpu, "decode", "exit"]
