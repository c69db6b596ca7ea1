"""torch.compile(fullgraph=True) of a model that uses flashtile: no graph breaks, same numbers."""

from __future__ import annotations

import pytest
import torch

import flashtile

from conftest import DEVICE


class Block(torch.nn.Module):
    """A self-attention block: projections around flashtile (and the SDPA drop-in for comparison)."""

    def __init__(self, width=64, heads=4, kv_heads=2, use_sdpa=False):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.use_sdpa = heads, kv_heads, width // heads, use_sdpa
        self.q = torch.nn.Linear(width, width)
        self.kv = torch.nn.Linear(width, 2 * kv_heads * self.head_dim)
        self.o = torch.nn.Linear(width, width)

    def forward(self, x):
        b, s, w = x.shape
        q = self.q(x).view(b, s, self.heads, self.head_dim)
        k, v = self.kv(x).view(b, s, 2, self.kv_heads, self.head_dim).unbind(2)
        if self.use_sdpa:
            out = flashtile.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                         is_causal=True, enable_gqa=True).transpose(1, 2)
        else:
            out, lse = flashtile.flash_attn_func(q, k, v, causal=True, softcap=20.0, return_lse=True)
            out = out + lse.transpose(1, 2).unsqueeze(-1) * 1e-3  # the lse output is differentiable too
        return self.o(out.reshape(b, s, w))


@pytest.mark.parametrize("use_sdpa", (False, True), ids=("flash_attn_func", "sdpa"))
def test_fullgraph_compile_matches_eager(backend, use_sdpa):
    torch._dynamo.reset()  # the backend choice is baked in at trace time
    torch.manual_seed(0)
    model = Block(use_sdpa=use_sdpa).to(DEVICE)
    x = torch.randn(2, 37, 64, device=DEVICE, requires_grad=True)
    graphs = []

    def recording_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    with flashtile.use_backend(backend):
        eager = model(x)
        (eager_grad,) = torch.autograd.grad(eager.square().sum(), x)
        compiled = torch.compile(model, fullgraph=True, backend=recording_backend)
        out = compiled(x)
        (grad,) = torch.autograd.grad(out.square().sum(), x)
    torch.testing.assert_close(out, eager, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad, eager_grad, atol=1e-5, rtol=1e-5)
    ops = [str(node.target) for gm in graphs for node in gm.graph.nodes if node.op == "call_function"]
    assert any("flashtile.attention_forward" in op for op in ops), f"custom op not in the graph: {ops}"


def test_compile_with_aot_autograd_uses_the_fake_implementations(backend):
    """aot_eager traces forward and backward with fake tensors: shapes and dtypes must agree."""
    torch._dynamo.reset()
    model = Block().to(DEVICE)
    x = torch.randn(1, 21, 64, device=DEVICE, requires_grad=True)
    with flashtile.use_backend(backend):
        compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
        out = compiled(x)
        out.sum().backward()
    assert out.shape == (1, 21, 64) and x.grad is not None and x.grad.isfinite().all()
