"""The cost of a learnable sink on a GPU: flash_attn_func with and without `learnable_sink`, forward and forward +
backward, on the grid's shapes (16,384 tokens, model width 2048), bf16, triton.testing.do_bench medians.

    python benchmarks/sink_overhead.py      # one JSON line per cell, with the kernels explain() names
"""

import json

import torch
import triton.testing

import flashtile


def main() -> None:
    torch.manual_seed(0)
    for d, n, causal in ((128, 4096, False), (128, 4096, True), (64, 1024, True)):
        b, h = 16384 // n, 2048 // d
        q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        sink = torch.randn(h, device="cuda", requires_grad=True)
        grad_out = torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16)
        row = {"d": d, "n": n, "causal": causal}
        for name, s in (("no sink", None), ("sink", sink)):
            def forward(s=s):
                return flashtile.flash_attn_func(q, k, v, causal=causal, learnable_sink=s)

            def both(forward=forward):
                torch.autograd.backward(forward(), grad_out)

            row[name + " fwd ms"] = triton.testing.do_bench(forward, warmup=25, rep=200)
            row[name + " fwd+bwd ms"] = triton.testing.do_bench(both, warmup=25, rep=200)
        row["kernel"] = flashtile.explain(q, k, v, causal=causal, learnable_sink=sink).splitlines()[0][:160]
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
