"""attn_implementation="flashtile" in bf16 on a CUDA GPU: small random-init models against a float64 eager oracle.

Runs with FLASHTILE_TEST_DEVICE=cuda; elsewhere every test here is skipped with that reason (the CPU suite,
test_transformers.py, checks the same integration in float32 against eager within 1e-4).

The rule (conftest's eager rule, applied to whole models): the oracle is the same model with the same bf16 weights,
converted to float64 (float32 for gpt-oss, see ORACLE_DTYPE) and run with attn_implementation="eager", one
sequence at a time without padding (rows_alone). For every compared tensor (logits at token positions, the logits of
each generated step, the gradient of each parameter),

    max |flashtile_bf16 - oracle_fp64|  <=  2 * max |eager_bf16 - oracle_fp64|  +  2 ulp(bf16) * max |oracle_fp64|

where eager_bf16 is the bf16 model run with attn_implementation="eager" (conftest.assert_close_to_oracle with the
floor given explicitly: 2 bf16 ulps of the tensor's own largest value, not of max(1, that value), because gradients
are far smaller than 1 and a floor of 2 ulps of 1 would accept anything there). Padded positions are left out:
flash-attention implementations return zeros there, while eager attends over a fully masked row.

The shapes make the kernels run real tiles: head_dim 64 (128 for Gemma 2), grouped-query attention, 3 sequences of
up to 280 tokens, one left-padded, one right-padded, one unpadded, sliding windows of 64 keys. Each test records the
backend of every flashtile call and requires it to be "triton": on CUDA tensors flashtile's automatic choice must be
its Triton kernels, never the pure-torch path (and a test in which flashtile was never called fails too).
"""

from __future__ import annotations

import copy

import pytest
import torch

import flashtile
from flashtile import _dispatch

from conftest import DEVICE, assert_close_to_oracle

pytestmark = pytest.mark.skipif(DEVICE.type != "cuda", reason="needs a CUDA GPU: run with FLASHTILE_TEST_DEVICE=cuda")

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed; flashtile's [test] extra installs it")

import flashtile.integrations.transformers  # noqa: E402,F401  (registers "flashtile")
from transformers import (AutoModelForCausalLM, Gemma2Config, GptOssConfig, LlamaConfig, MistralConfig,  # noqa: E402
                          Qwen2Config)

from test_transformers import next_token_loss  # noqa: E402

# The dtype under test and the backend flashtile must choose for it on DEVICE. Module constants so that the module
# can be exercised on the CPU in float32 (where "auto" picks the torch backend) when the code itself changes.
DTYPE = torch.bfloat16
EXPECTED_BACKEND = "triton"

# initializer_range 0.05 at width 512 gives attention scores of standard deviation about 1: far from uniform
# attention, so that the windows and the softcap change the logits (test_the_rule_catches_a_missing_option)
SMALL = dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=8,
             num_key_value_heads=2, vocab_size=512, max_position_embeddings=512, initializer_range=0.05,
             pad_token_id=0)
WINDOW = 64
SEQLEN = 280
PADDING = {"left": 37, "right": 50}  # padded positions of the padded rows: ragged against every tile size
NEW_TOKENS = 8
CONFIGS = {
    "llama": lambda: LlamaConfig(**SMALL),
    "mistral": lambda: MistralConfig(**SMALL, sliding_window=WINDOW),
    # one sliding and one global layer, head_dim 128; the softcap bends the larger scores
    "gemma2": lambda: Gemma2Config(**SMALL, head_dim=128, query_pre_attn_scalar=128, sliding_window=WINDOW,
                                   attn_logit_softcapping=5.0, final_logit_softcapping=None),
    "qwen2": lambda: Qwen2Config(**SMALL),
    # attention sinks; two experts both routed to every token, so that no routing decision can flip between the
    # bf16 and float64 runs (a flip changes a token's logits by far more than rounding does)
    "gpt-oss": lambda: GptOssConfig(**SMALL, head_dim=64, num_local_experts=2, num_experts_per_tok=2,
                                    sliding_window=WINDOW),
}


# gpt-oss's experts run through torch's grouped matmul, which takes no float64: its oracle is float32, still far
# more precise than bf16 (16 more bits of mantissa)
ORACLE_DTYPE = {"gpt-oss": torch.float32}


def make_models(name: str, **overrides):
    """(the bf16 model, the oracle: the bf16 model's weights in float64), both in eval mode on DEVICE."""
    config = CONFIGS[name]()
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    if name == "gpt-oss":  # the sinks start at zero; spread them so that they take a real share of the softmax
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_(0, 2)
    model = model.to(device=DEVICE, dtype=DTYPE).eval()
    return model, copy.deepcopy(model).to(ORACLE_DTYPE.get(name, torch.float64))


def padded_batch(*rows: str, seqlen: int = SEQLEN):
    """Token ids and padding mask on DEVICE, one row per entry of rows: "left", "right" or "none"."""
    generator = torch.Generator().manual_seed(len(rows))
    ids = torch.randint(1, SMALL["vocab_size"], (len(rows), seqlen), generator=generator)
    mask = torch.ones_like(ids)
    for row, side in enumerate(rows):
        if side == "left":
            mask[row, :PADDING["left"]] = 0
        elif side == "right":
            mask[row, -PADDING["right"]:] = 0
    return ids.masked_fill(mask == 0, 0).to(DEVICE), mask.to(DEVICE)


class BackendRecorder:
    """Records the backend name of every flashtile call (flashtile's dispatcher resolves each call once)."""

    def __init__(self, monkeypatch):
        self.names: set[str] = set()
        resolve = _dispatch.resolve

        def recording(problem, *args, **kwargs):
            resolved = resolve(problem, *args, **kwargs)
            self.names.add(resolved[0])
            return resolved

        monkeypatch.setattr(_dispatch, "resolve", recording)

    def check(self, what: str) -> None:
        assert self.names == {EXPECTED_BACKEND}, (
            f"{what}: flashtile's calls ran on {sorted(self.names) or 'nothing (flashtile was never called)'}, "
            f"expected {EXPECTED_BACKEND!r} only")


def floor_of(oracle: torch.Tensor) -> float:
    """2 ulps (of DTYPE) of the largest |value| of the oracle tensor."""
    return 2 * torch.finfo(DTYPE).eps * oracle.abs().max().item()


def follows_rule(what, got, oracle, eager, seed):
    assert_close_to_oracle(what, got, oracle, eager, DTYPE, seed, floor=floor_of(oracle))


_ONCE: dict = {}


def once(key, compute):
    """The oracle's and eager's results for `key`, computed once per run (several tests compare against them)."""
    if key not in _ONCE:
        _ONCE[key] = compute()
    return _ONCE[key]


def rows_alone(model, ids, mask, position_ids=None):
    """Logits of a padded batch computed one sequence at a time without padding (zeros at padded positions), each
    token at the position it has in the batch (position_ids, or by default its index in the row).

    The oracle runs this way: transformers' eager attention takes its softmax in float32, where the float64 mask
    value of a fully masked row (a padded query) becomes -inf and the row NaN, which reaches every token of the
    sequence through the values of the next layer (NaN x 0 is NaN)."""
    if position_ids is None:
        position_ids = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    logits = None
    for row in range(ids.shape[0]):
        tokens = mask[row].bool()
        alone = model(ids[row, tokens][None], position_ids=position_ids[row, tokens][None]).logits[0]
        if logits is None:
            logits = alone.new_zeros(*ids.shape, alone.shape[-1])
        logits = logits.index_put((torch.tensor(row, device=ids.device), tokens.nonzero()[:, 0]), alone)
    return logits


def forward_and_gradients(model, implementation, ids, mask, alone=False):
    """Logits of a training-mode forward over the batch and the gradient of every parameter after one backward of
    the next-token loss (taken in float64 from the logits, so that the runs differ only inside the model); alone:
    the batch's rows one at a time (rows_alone)."""
    model.set_attn_implementation(implementation)
    model.train()
    model.zero_grad()
    logits = rows_alone(model, ids, mask) if alone else model(ids, attention_mask=mask).logits
    next_token_loss(logits.double(), ids, mask).backward()
    model.eval()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def reference_runs(name, ids, mask):
    """(oracle, eager bf16) forward_and_gradients of model `name`."""
    def compute():
        model, oracle = make_models(name)
        return (forward_and_gradients(oracle, "eager", ids, mask, alone=True),
                forward_and_gradients(model, "eager", ids, mask))
    return once(("training step", name), compute)


@pytest.mark.parametrize("name", CONFIGS)
def test_logits_and_gradients_of_a_padded_batch_follow_the_eager_rule(name, monkeypatch, seed):
    """One training step over a batch with a left-padded, a right-padded and an unpadded row: the logits at token
    positions and every parameter's gradient."""
    ids, mask = padded_batch("left", "right", "none")
    (oracle_logits, oracle_grads), (eager_logits, eager_grads) = reference_runs(name, ids, mask)
    model, _ = make_models(name)
    recorder = BackendRecorder(monkeypatch)
    logits, grads = forward_and_gradients(model, "flashtile", ids, mask)
    recorder.check(f"{name} training step")
    tokens = mask.bool()
    follows_rule(f"{name} logits", logits[tokens], oracle_logits[tokens], eager_logits[tokens], seed)
    assert grads.keys() == oracle_grads.keys()
    for parameter, oracle in oracle_grads.items():
        follows_rule(f"{name} gradient of {parameter}", grads[parameter], oracle, eager_grads[parameter], seed)


@pytest.mark.parametrize("name, option, neutral", (("mistral", "sliding_window", None),
                                                  ("gemma2", "attn_logit_softcapping", None)))
def test_the_rule_catches_a_missing_option(name, option, neutral, monkeypatch):
    """The comparisons above have power at these sizes: flashtile's logits computed without the sliding window or
    the softcap (a kernel that ignored the option) fall outside the rule's bound."""
    ids, mask = padded_batch("left", "right", "none")
    (oracle_logits, _), (eager_logits, _) = reference_runs(name, ids, mask)
    model, _ = make_models(name, **{option: neutral})
    model.set_attn_implementation("flashtile")
    with torch.no_grad():
        wrong = model(ids, attention_mask=mask).logits
    tokens = mask.bool()
    oracle, eager, wrong = oracle_logits[tokens], eager_logits[tokens], wrong[tokens]
    bound = 2 * (eager - oracle).double().abs().max().item() + floor_of(oracle)
    error = (wrong - oracle).double().abs().max().item()
    assert error > 2 * bound, f"{name} without {option}: error {error:.3e}, only within 2x the rule's {bound:.3e}"


@pytest.mark.parametrize("name", CONFIGS)
def test_greedy_generation_with_the_kv_cache_follows_the_eager_rule(name, monkeypatch, seed):
    """Greedy generation of a few tokens with the KV cache, from a left-padded and an unpadded prompt.

    bf16 runs may pick different tokens where two logits are within rounding of each other, and from there on
    compare different sequences; so the tokens are not compared. Instead the references are evaluated on the
    sequences flashtile generated: the logits of each generated step (from flashtile's cached prefill and decode
    steps) must follow the rule against the float64 oracle's and eager bf16's logits at the same positions of an
    uncached forward over the generated sequences. A decoding kernel that mishandled the cache, the padding or
    the window would move these logits far outside the bound; two near-tied tokens cannot make the test flaky.
    """
    ids, mask = padded_batch("left", "none")
    model, oracle_model = make_models(name)
    model.set_attn_implementation("flashtile")
    recorder = BackendRecorder(monkeypatch)
    generated = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                               do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    recorder.check(f"{name} generation")
    sequences = generated.sequences
    assert sequences.shape[1] == SEQLEN + NEW_TOKENS, f"generated {sequences.shape[1] - SEQLEN} tokens"
    full_mask = torch.cat([mask, torch.ones_like(sequences[:, SEQLEN:])], dim=1)
    # the positions generate gives a left-padded row: its tokens count from 0
    positions = (full_mask.cumsum(-1) - 1).clamp(min=0)
    steps = slice(SEQLEN - 1, SEQLEN - 1 + NEW_TOKENS)  # the logits that chose each generated token

    model.set_attn_implementation("eager")
    with torch.no_grad():
        oracle = rows_alone(oracle_model, sequences, full_mask, positions)[:, steps]
        eager = model(sequences, attention_mask=full_mask, position_ids=positions).logits[:, steps]
    for step, got in enumerate(generated.logits):
        follows_rule(f"{name} logits of generated token {step}", got, oracle[:, step], eager[:, step], seed)


# torch.nn.MultiheadAttention against flashtile.nn.MultiheadAttention: (batch, seqlen_q, seqlen_k), options
MHA_EMBED, MHA_HEADS = 512, 8  # head_dim 64
MHA_CASES = {
    "self-causal": ((3, 300, 300), dict(self_attention=True, is_causal=True)),
    "cross-key-padding": ((3, 200, 300), dict(key_padding_mask=True)),
    "self-causal-key-padding": ((2, 257, 257), dict(self_attention=True, is_causal=True, key_padding_mask=True)),
}


@pytest.mark.parametrize("case", MHA_CASES.values(), ids=MHA_CASES.keys())
def test_multihead_attention_follows_the_eager_rule(case, monkeypatch, seed):
    """flashtile.nn.MultiheadAttention against torch.nn.MultiheadAttention with the same bf16 weights (batch_first):
    the output and the gradients of the inputs and of every parameter; the oracle is torch's module in float64."""
    (batch, seqlen_q, seqlen_k), options = case
    theirs = torch.nn.MultiheadAttention(MHA_EMBED, MHA_HEADS, batch_first=True, device=DEVICE, dtype=DTYPE)
    with torch.no_grad():  # every parameter random: torch initialises the biases to zero, which would hide them
        for p in theirs.parameters():
            p.copy_(torch.randn(p.shape) * 0.05)
    ours = flashtile.nn.MultiheadAttention(MHA_EMBED, MHA_HEADS, batch_first=True, device=DEVICE, dtype=DTYPE)
    ours.load_state_dict(theirs.state_dict())
    oracle = copy.deepcopy(theirs).double()

    query = torch.randn(batch, seqlen_q, MHA_EMBED).to(DEVICE, DTYPE)
    key = query if options.get("self_attention") else torch.randn(batch, seqlen_k, MHA_EMBED).to(DEVICE, DTYPE)
    padding = None
    if options.get("key_padding_mask"):  # True = ignored; each row keeps its first keys (no query sees no key)
        lengths = torch.tensor([seqlen_k, seqlen_k - 45, seqlen_k // 2 + 3][:batch], device=DEVICE)
        padding = torch.arange(seqlen_k, device=DEVICE) >= lengths[:, None]
    is_causal = options.get("is_causal", False)
    causal_mask = (torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=DEVICE).triu(1) if is_causal else None)
    grad_out = torch.randn(batch, seqlen_q, MHA_EMBED, dtype=torch.float64, device=DEVICE)

    def run(module, dtype, attn_mask):
        leaves = [x.detach().to(dtype).requires_grad_() for x in dict.fromkeys((query, key))]
        q, k = leaves[0], leaves[-1]  # self-attention: one leaf for query, key and value
        out, _ = module(q, k, k, key_padding_mask=padding, attn_mask=attn_mask, need_weights=False,
                        is_causal=is_causal)
        named = list(module.named_parameters())
        grads = torch.autograd.grad((out.double() * grad_out).sum(), leaves + [p for _, p in named])
        names = ["dquery", "dkey"][:len(leaves)] + [f"d{n}" for n, _ in named]
        return out.detach(), dict(zip(names, grads))

    recorder = BackendRecorder(monkeypatch)
    got, got_grads = run(ours, DTYPE, None)  # flashtile takes is_causal alone; torch needs the mask beside it
    recorder.check("MultiheadAttention")
    want, want_grads = run(oracle, torch.float64, causal_mask)
    eager, eager_grads = run(theirs, DTYPE, causal_mask)
    follows_rule("out", got, want, eager, seed)
    for name, oracle_grad in want_grads.items():
        follows_rule(name, got_grads[name], oracle_grad, eager_grads[name], seed)
