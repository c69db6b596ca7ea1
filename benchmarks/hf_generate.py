"""Generation throughput of a transformers model: attn_implementation="flashtile" against "sdpa".

A random-init Llama-style model (hidden 2048, 16 layers, 32 query heads and 8 K/V heads of head_dim 64, MLP 5632,
vocabulary 32000: about 0.9B parameters) in bf16 generates greedily with the KV cache (`model.generate(...,
do_sample=False)`) 128 new tokens after a 512-token prompt, at batch 1 and 16, once with each implementation
(the same weights; the implementation is switched with set_attn_implementation). Each measurement follows a
warm-up run of the same shape (Triton compiles its kernels there, and flashtile's backend is recorded there), and
the two implementations alternate over the repeats so that a slow spell of the machine hits both. Times are wall
times between CUDA synchronisations, the best of the repeats.

Also timed: the prefill alone, one forward over the prompt with the cache (the logits of the last position only,
as generate computes them).

Before timing, the first generated tokens of the two implementations are compared and the agreement is reported,
not asserted: in bf16 two near-tied logits can be ordered differently by two correct kernels, after which the
sequences differ; a kernel that is wrong disagrees from the first tokens on.

Output: one JSON line describing the set-up, then one per (batch, implementation) with tokens/s (batch x new tokens
/ generate time), the prefill time and tokens/s, and the ratio to sdpa (flashtile / sdpa throughput, >1 = flashtile
faster); the flashtile lines carry the agreement and the backends flashtile's calls ran on.

    PYTHONPATH=src python benchmarks/hf_generate.py                      # H200: under a minute
    PYTHONPATH=src python benchmarks/hf_generate.py --device cpu --tiny  # a tiny float32 model: a smoke test

Without a CUDA device (and without --device cpu) it exits with an error saying so.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time

import torch

import flashtile
from flashtile import _dispatch

MODEL = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=32,
             num_key_value_heads=8, vocab_size=32000, max_position_embeddings=4096)
TINY_MODEL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=128, max_position_embeddings=256)
IMPLEMENTATIONS = ("sdpa", "flashtile")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (with --tiny, a smoke test)")
    parser.add_argument("--tiny", action="store_true",
                        help="a tiny float32 model, prompt 16, 8 new tokens, batches 1 and 2, one repeat")
    parser.add_argument("--batches", type=lambda s: [int(b) for b in s.split(",")], default=None,
                        help="comma-separated batch sizes (default 1,16)")
    parser.add_argument("--prompt", type=int, default=None, help="prompt tokens (default 512)")
    parser.add_argument("--new-tokens", type=int, default=None, help="generated tokens (default 128)")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per implementation (default 2)")
    args = parser.parse_args(argv)
    defaults = dict(batches=[1, 2], prompt=16, new_tokens=8, repeats=1) if args.tiny else dict(
        batches=[1, 16], prompt=512, new_tokens=128, repeats=2)
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def make_model(device: torch.device, tiny: bool):
    import flashtile.integrations.transformers  # noqa: F401  (registers "flashtile")
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(**(TINY_MODEL if tiny else MODEL))
    dtype = torch.float32 if tiny else torch.bfloat16
    torch.manual_seed(0)
    with device:  # initialised where it runs: a CPU initialisation of 0.9B parameters would take longer than the runs
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device, function):
    synchronize(device)
    start = time.perf_counter()
    result = function()
    synchronize(device)
    return time.perf_counter() - start, result


class BackendRecorder:
    """The backends flashtile's calls resolve to while it is active (used in warm-up runs only: it adds a Python
    call per attention call)."""

    def __init__(self):
        self.names: set[str] = set()
        self._resolve = _dispatch.resolve

    def __enter__(self):
        def recording(problem, *args, **kwargs):
            resolved = self._resolve(problem, *args, **kwargs)
            self.names.add(resolved[0])
            return resolved
        _dispatch.resolve = recording
        return self

    def __exit__(self, *exc):
        _dispatch.resolve = self._resolve


def common_prefix(a: torch.Tensor, b: torch.Tensor) -> list[int]:
    """For each row, how many leading tokens a and b share."""
    differs = (a != b).int()
    first = torch.where(differs.any(dim=1), differs.argmax(dim=1), torch.full_like(differs[:, 0], a.shape[1]))
    return first.tolist()


def main(argv=None) -> None:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("hf_generate.py: no CUDA device is available (torch.cuda.is_available() is False); this benchmark "
                 "times GPU generation. For a CPU smoke test of the script itself: --device cpu --tiny")
    import transformers

    model = make_model(device, args.tiny)
    vocab = model.config.vocab_size
    print(json.dumps({
        "setup": "hf_generate", "device": torch.cuda.get_device_name(device) if device.type == "cuda" else
        platform.processor() or platform.machine(), "torch": torch.__version__,
        "transformers": transformers.__version__, "flashtile": getattr(flashtile, "__version__", None),
        "model": TINY_MODEL if args.tiny else MODEL, "dtype": str(next(model.parameters()).dtype),
        "parameters": sum(p.numel() for p in model.parameters()), "prompt": args.prompt,
        "new_tokens": args.new_tokens, "repeats": args.repeats}), flush=True)

    for batch in args.batches:
        generator = torch.Generator().manual_seed(batch)
        ids = torch.randint(3, vocab, (batch, args.prompt), generator=generator).to(device)
        mask = torch.ones_like(ids)

        def generate():
            # min_new_tokens: every run generates all the tokens even if the random model emits its end token
            return model.generate(ids, attention_mask=mask, max_new_tokens=args.new_tokens,
                                  min_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0)

        def prefill():
            return model(ids, attention_mask=mask, use_cache=True, logits_to_keep=1).logits

        sequences, backends = {}, None
        with torch.no_grad():
            for implementation in IMPLEMENTATIONS:  # warm-up: compiles kernels, gives the tokens compared below
                model.set_attn_implementation(implementation)
                with BackendRecorder() as recorder:
                    sequences[implementation] = generate()[:, args.prompt:]
                    prefill()
                if implementation == "flashtile":
                    backends = sorted(recorder.names)
            seconds = {name: [] for name in IMPLEMENTATIONS}
            prefill_seconds = {name: [] for name in IMPLEMENTATIONS}
            for _ in range(args.repeats):
                for implementation in IMPLEMENTATIONS:
                    model.set_attn_implementation(implementation)
                    seconds[implementation].append(timed(device, generate)[0])
                    for _ in range(3):
                        prefill_seconds[implementation].append(timed(device, prefill)[0])

        agree = common_prefix(sequences["flashtile"], sequences["sdpa"])
        throughput = {name: batch * args.new_tokens / min(s) for name, s in seconds.items()}
        prefill_throughput = {name: batch * args.prompt / min(s) for name, s in prefill_seconds.items()}
        for implementation in IMPLEMENTATIONS:
            line = {"batch": batch, "implementation": implementation, "prompt": args.prompt,
                    "new_tokens": args.new_tokens, "generate_s": round(min(seconds[implementation]), 4),
                    "tokens_per_s": round(throughput[implementation], 1),
                    "ratio_to_sdpa": round(throughput[implementation] / throughput["sdpa"], 3),
                    "prefill_ms": round(1e3 * min(prefill_seconds[implementation]), 3),
                    "prefill_tokens_per_s": round(prefill_throughput[implementation], 1),
                    "prefill_ratio_to_sdpa": round(prefill_throughput[implementation] / prefill_throughput["sdpa"], 3)}
            if implementation == "flashtile":
                line.update({"flashtile_backends": backends,
                             "leading_tokens_agreeing_with_sdpa": {"min": min(agree), "mean": sum(agree) / len(agree),
                                                                   "of": args.new_tokens}})
            print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
