"""torch.compile(fullgraph=True) of a model that uses flashtile: no graph breaks, same numbers."""

from __future__ import annotations

import pytest
import torch

import flashtile

from conftest import DEVICE


class Block(torch.nn.Module):
    """A self-attention block: projections around flashtile (and the SDPA drop-in for comparison)."""

    def __init__(self, width=64, heads=4, kv_heads=2, use_sdpa=False, sink=False, dropout_p=0.0):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.use_sdpa = heads, kv_heads, width // heads, use_sdpa
        # a learnable sink per query head (gpt-oss): a parameter the compiled graph differentiates
        self.sink = torch.nn.Parameter(torch.linspace(-1.0, 1.0, heads)) if sink else None
        self.dropout_p = dropout_p
        self.q = torch.nn.Linear(width, width)
        self.kv = torch.nn.Linear(width, 2 * kv_heads * self.head_dim)
        self.o = torch.nn.Linear(width, width)

    def forward(self, x):
        b, s, w = x.shape
        q = self.q(x).view(b, s, self.heads, self.head_dim)
        k, v = self.kv(x).view(b, s, 2, self.kv_heads, self.head_dim).unbind(2)
        if self.use_sdpa:
            out = flashtile.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                         dropout_p=self.dropout_p, is_causal=True,
                                                         enable_gqa=True).transpose(1, 2)
        else:
            out, lse = flashtile.flash_attn_func(q, k, v, dropout_p=self.dropout_p, causal=True, softcap=20.0,
                                                 return_lse=True, learnable_sink=self.sink)
            out = out + lse.transpose(1, 2).unsqueeze(-1) * 1e-3  # the lse output is differentiable too
        return self.o(out.reshape(b, s, w))


@pytest.mark.parametrize("use_sdpa, sink", ((False, False), (True, False), (False, True)),
                         ids=("flash_attn_func", "sdpa", "learnable_sink"))
def test_fullgraph_compile_matches_eager(backend, use_sdpa, sink):
    torch._dynamo.reset()  # the backend choice is baked in at trace time
    torch.manual_seed(0)
    model = Block(use_sdpa=use_sdpa, sink=sink).to(DEVICE)
    x = torch.randn(2, 37, 64, device=DEVICE, requires_grad=True)
    inputs = (x, model.sink) if sink else (x,)
    graphs = []

    def recording_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    with flashtile.use_backend(backend):
        eager = model(x)
        eager_grads = torch.autograd.grad(eager.square().sum(), inputs)
        compiled = torch.compile(model, fullgraph=True, backend=recording_backend)
        out = compiled(x)
        grads = torch.autograd.grad(out.square().sum(), inputs)
    torch.testing.assert_close(out, eager, atol=1e-5, rtol=1e-5)
    for grad, eager_grad in zip(grads, eager_grads):
        torch.testing.assert_close(grad, eager_grad, atol=1e-5, rtol=1e-5)
    ops = [str(node.target) for gm in graphs for node in gm.graph.nodes if node.op == "call_function"]
    assert any("flashtile.attention_forward" in op for op in ops), f"custom op not in the graph: {ops}"


@pytest.mark.parametrize("sink", (False, True), ids=("plain", "learnable_sink"))
def test_compile_with_aot_autograd_uses_the_fake_implementations(backend, sink):
    """aot_eager traces forward and backward with fake tensors: shapes and dtypes must agree (the sink's gradient
    too)."""
    torch._dynamo.reset()
    model = Block(sink=sink).to(DEVICE)
    x = torch.randn(1, 21, 64, device=DEVICE, requires_grad=True)
    with flashtile.use_backend(backend):
        compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
        out = compiled(x)
        out.sum().backward()
    assert out.shape == (1, 21, 64) and x.grad is not None and x.grad.isfinite().all()
    if sink:
        assert model.sink.grad is not None and model.sink.grad.isfinite().all() and model.sink.grad.abs().max() > 0


@pytest.mark.parametrize("use_sdpa,sink", ((False, False), (True, False), (False, True)),
                         ids=("flash_attn_func", "sdpa", "flash_attn_func-learnable_sink"))
def test_fullgraph_compile_with_dropout_draws_its_mask_at_run_time(backend, use_sdpa, sink):
    """With dropout the custom op draws the Philox state when the compiled graph runs, not when it is traced: seeded
    alike, the compiled and the eager model drop the same entries (forward and backward through AOTAutograd, whose
    fake implementations give the state's shape), and a second run of the compiled model draws a fresh mask. With a
    learnable sink too, the sink's gradient matches the eager one."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Block(use_sdpa=use_sdpa, sink=sink, dropout_p=0.25).to(DEVICE)
    x = torch.randn(1, 21, 64, device=DEVICE, requires_grad=True)
    inputs = (x, model.sink) if sink else (x,)
    with flashtile.use_backend(backend):
        torch.manual_seed(1)
        eager = model(x)
        eager_grads = torch.autograd.grad(eager.square().sum(), inputs)
        compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
        torch.manual_seed(1)
        out = compiled(x)
        grads = torch.autograd.grad(out.square().sum(), inputs)
        again = compiled(x)
    torch.testing.assert_close(out, eager, atol=1e-5, rtol=1e-5)
    for grad, eager_grad in zip(grads, eager_grads):
        torch.testing.assert_close(grad, eager_grad, atol=1e-5, rtol=1e-5)
    assert (again - out).abs().max() > 1e-3, "a second run of the compiled model reused the first run's mask"


def _validated_calls():
    from flashtile._validate import prepare_flash_attn, prepare_flash_attn_varlen, prepare_sdpa

    q, k, v = (torch.randn(2, n, h, d, device=DEVICE) for n, h, d in ((9, 4, 16), (13, 2, 16), (13, 2, 8)))
    flash = dict(dropout_p=0.0, softmax_scale=None, deterministic=False, return_attn_probs=False, return_lse=False)
    yield prepare_flash_attn(q, k, v, causal=True, window_size=(3, -1), softcap=2.0,
                             alibi_slopes=torch.rand(2, 4, device=DEVICE), **flash)
    yield prepare_flash_attn(q, k, v, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                             learnable_sink=torch.randn(4, device=DEVICE), **flash)
    yield prepare_flash_attn(q, k, v, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                             **dict(flash, dropout_p=0.25))
    yield prepare_flash_attn(q, k, v, causal=True, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                             learnable_sink=torch.randn(4, device=DEVICE), **dict(flash, dropout_p=0.25))
    cu_q, cu_k = (torch.tensor(c, dtype=torch.int32, device=DEVICE) for c in ([0, 4, 9], [0, 6, 13]))
    yield prepare_flash_attn_varlen(q[0], k[0], v[0], cu_q, cu_k, 5, 7, causal=True, window_size=(-1, -1),
                                    softcap=0.0, alibi_slopes=torch.rand(2, 4, device=DEVICE),
                                    learnable_sink=torch.randn(4, device=DEVICE), **flash)
    qs, ks, vs = (t.transpose(1, 2) for t in (q, k, v))
    for mask in (torch.rand(9, 13, device=DEVICE) > 0.3, torch.randn(9, 13, device=DEVICE), None):
        yield prepare_sdpa(qs, ks, vs, attn_mask=mask, dropout_p=0.0, is_causal=mask is None, scale=None,
                           enable_gqa=True)[0]


def test_custom_op_rebuilds_the_problem_the_eager_path_runs():
    """Eager calls hand the validated AttentionProblem to the backend; the custom op (torch.compile's path)
    rebuilds it from scalars. They must be the same problem, or compiled and eager results could differ."""
    from flashtile import autograd

    for call in _validated_calls():
        p = call.problem
        rebuilt = autograd._problem(call.q, call.k, call.v, call.learnable_sink, call.alibi_slopes, call.attn_mask,
                                    call.cu_seqlens_q, p.seqlen_q, p.seqlen_k, p.softmax_scale, p.window_left,
                                    p.window_right, p.diagonal_offset, p.softcap, p.alignment, p.dropout_p)
        assert rebuilt == p, (rebuilt, p)
