"""attn_implementation="flashtile" in Hugging Face transformers: tiny random-init models against "eager".

The rule: in float32, every compared tensor (logits at token positions, the logits of each generated step,
hidden states, parameter gradients) is within 1e-4 x max(1, largest |eager value|) of eager's. Padded positions
are left out: flash-attention implementations return zeros there, while eager attends over a fully masked row.
Weights are drawn with a larger spread than the models' defaults so that attention is far from uniform and the
sliding windows and the softcap change the result (test_the_checked_options_change_the_result checks that they do).
The eager side of each comparison does not depend on flashtile's backend and is computed once (`once`).
"""

from __future__ import annotations

import importlib

import pytest
import torch

import flashtile

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed; flashtile's [test] extra installs it")

import flashtile.integrations.transformers as ft_transformers  # noqa: E402  (registers "flashtile")
from transformers import (AutoModelForCausalLM, BertConfig, BertModel, Gemma2Config, GptOssConfig,  # noqa: E402
                          LlamaConfig, LlamaForCausalLM, MistralConfig, Qwen2Config)
from transformers import modeling_flash_attention_utils  # noqa: E402

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=128, max_position_embeddings=64, initializer_range=0.2, pad_token_id=0)
WINDOW = 4  # shorter than the sequences
SEQLEN = 11
CONFIGS = {
    "llama": lambda: LlamaConfig(**TINY),
    "mistral": lambda: MistralConfig(**TINY, sliding_window=WINDOW),
    # one sliding and one global layer; softcap small enough to bend the scores
    "gemma2": lambda: Gemma2Config(**TINY, head_dim=16, query_pre_attn_scalar=16, sliding_window=WINDOW,
                                   attn_logit_softcapping=2.0, final_logit_softcapping=None),
    "qwen2": lambda: Qwen2Config(**TINY),
}


def within_rule(what: str, got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != eager's {tuple(want.shape)}"
    bound = 1e-4 * max(1.0, want.abs().max().item())
    error = (got - want).abs()
    worst = error.max().item() if error.numel() else 0.0
    where = tuple(int(i) for i in torch.unravel_index(error.argmax(), error.shape)) if error.numel() else ()
    assert worst <= bound, f"{what}: max |flashtile - eager| = {worst:.3e} at {where} exceeds {bound:.1e}"


def make_model(name: str, attn_implementation: str = "eager", **overrides):
    config = CONFIGS[name]()
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation).eval()


def padded_batch(*rows: str):
    """Token ids and the padding mask of a batch, one row per entry of rows: "left" (the first 3 positions are
    padding), "right" (the last 3) or "none"."""
    ids = torch.randint(1, TINY["vocab_size"], (len(rows), SEQLEN), generator=torch.Generator().manual_seed(len(rows)))
    mask = torch.ones_like(ids)
    for row, side in enumerate(rows):
        if side == "left":
            mask[row, :3] = 0
        elif side == "right":
            mask[row, -3:] = 0
    return ids.masked_fill(mask == 0, 0), mask


_EAGER: dict = {}


def once(key, compute):
    """eager's result for `key`: it does not depend on flashtile's backend, so each is computed once per run (the
    models and inputs are the same in every test that uses the key)."""
    if key not in _EAGER:
        _EAGER[key] = compute()
    return _EAGER[key]


def logits(model, implementation, backend, *args, **kwargs):
    model.set_attn_implementation(implementation)
    with torch.no_grad(), flashtile.use_backend(backend):
        return model(*args, **kwargs).logits


@pytest.mark.parametrize("name", CONFIGS)
def test_logits_of_a_padded_batch_match_eager(name, backend):
    """One batch with a left-padded, a right-padded and an unpadded row."""
    ids, mask = padded_batch("left", "right", "none")
    eager = once(("logits", name), lambda: logits(make_model(name), "eager", "torch", ids, attention_mask=mask))
    got = logits(make_model(name), "flashtile", backend, ids, attention_mask=mask)
    tokens = mask.bool()
    within_rule(f"{name} logits ({backend})", got[tokens], eager[tokens])


@pytest.mark.parametrize("name, option, neutral", (("mistral", "sliding_window", None),
                                                  ("gemma2", "sliding_window", 4 * SEQLEN),
                                                  ("gemma2", "attn_logit_softcapping", None)))
def test_the_checked_options_change_the_result(name, option, neutral):
    """The comparisons above have power: without the window or the softcap, eager's logits move by far more than
    the rule's 1e-4."""
    ids, mask = padded_batch("left", "none")
    with torch.no_grad():
        with_option = make_model(name)(ids, attention_mask=mask).logits
        without = make_model(name, **{option: neutral})(ids, attention_mask=mask).logits
    change = (with_option - without)[mask.bool()].abs().max().item()
    assert change > 1e-2, f"{name}: {option} changes the logits by only {change:.2e}"


@pytest.mark.parametrize("name", CONFIGS)
def test_greedy_generation_with_the_kv_cache_matches_eager(name, backend):
    ids, mask = padded_batch("left", "none")

    def generate(implementation):
        model = make_model(name)
        model.set_attn_implementation(implementation)
        with flashtile.use_backend(backend):
            return model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, output_logits=True,
                                  return_dict_in_generate=True, pad_token_id=0)

    runs = {"eager": once(("generate", name), lambda: generate("eager")), "flashtile": generate("flashtile")}
    assert torch.equal(runs["flashtile"].sequences, runs["eager"].sequences), (
        f"{name}: generated {runs['flashtile'].sequences[:, SEQLEN:].tolist()}, eager "
        f"{runs['eager'].sequences[:, SEQLEN:].tolist()}")
    for step, (got, want) in enumerate(zip(runs["flashtile"].logits, runs["eager"].logits)):
        within_rule(f"{name} logits of generated token {step} ({backend})", got, want)


def next_token_loss(logits, ids, mask):
    """Cross-entropy of each token predicted from a token (never from a padded row, whose output differs by
    convention: zeros in flash attention, an average over masked keys in eager)."""
    pairs = (mask[:, :-1] * mask[:, 1:]).bool()
    return torch.nn.functional.cross_entropy(logits[:, :-1][pairs], ids[:, 1:][pairs])


def gradients(model, implementation, backend, ids, mask):
    model.set_attn_implementation(implementation)
    model.train()
    model.zero_grad()
    with flashtile.use_backend(backend):
        next_token_loss(model(ids, attention_mask=mask).logits, ids, mask).backward()
    model.eval()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", CONFIGS)
def test_training_step_gradients_match_eager(name, backend):
    """The gradients of every parameter after one backward pass through a padded batch (loss on the tokens)."""
    ids, mask = padded_batch("left", "right")
    eager = once(("gradients", name), lambda: gradients(make_model(name), "eager", "torch", ids, mask))
    got = gradients(make_model(name), "flashtile", backend, ids, mask)
    assert got.keys() == eager.keys()
    for parameter, grad in eager.items():
        within_rule(f"{name} gradient of {parameter} ({backend})", got[parameter], grad)


def test_packed_sequences_match_each_sequence_alone(backend):
    """Padding-free batches: sequences packed into one row, told apart by position_ids restarting at 0 or by
    DataCollatorWithFlattening's cu_seq_lens / max_length keywords, go through flash_attn_varlen_func."""
    model = make_model("mistral")
    lengths = (5, 7, 4)
    sequences = [torch.randint(1, TINY["vocab_size"], (1, n), generator=torch.Generator().manual_seed(n))
                 for n in lengths]
    alone = once(("alone", lengths), lambda: torch.cat([logits(model, "eager", "torch", s) for s in sequences], 1))
    packed = torch.cat(sequences, dim=1)
    position_ids = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    within_rule(f"packed by position_ids ({backend})",
                logits(model, "flashtile", backend, packed, position_ids=position_ids), alone)
    cu_seqlens = torch.tensor([0, 5, 12, 16], dtype=torch.int32)
    flattened = dict(cu_seq_lens_q=cu_seqlens, cu_seq_lens_k=cu_seqlens, max_length_q=7, max_length_k=7)
    within_rule(f"packed by cu_seq_lens ({backend})",
                logits(model, "flashtile", backend, packed, position_ids=position_ids, **flattened), alone)


def test_bert_encoder_matches_eager(backend):
    """A bidirectional encoder (random init: no small, reliably packaged BERT weights are installed here)."""
    config = BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                        vocab_size=128, max_position_embeddings=64, initializer_range=0.2, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    model = BertModel(config).eval()
    ids, mask = padded_batch("right", "none")
    outputs = {}
    for implementation in ("eager", "flashtile"):
        model.set_attn_implementation(implementation)
        model.zero_grad()
        with flashtile.use_backend(backend):
            hidden = model(ids, attention_mask=mask).last_hidden_state
            hidden[mask.bool()].square().sum().backward()
        outputs[implementation] = hidden.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                                                    if p.grad is not None}
    (got, got_grads), (want, want_grads) = outputs["flashtile"], outputs["eager"]
    within_rule(f"BERT hidden states ({backend})", got[mask.bool()], want[mask.bool()])
    for parameter, grad in want_grads.items():
        within_rule(f"BERT gradient of {parameter} ({backend})", got_grads[parameter], grad)


def test_the_name_resolves_in_from_pretrained_from_config_and_set(tmp_path):
    model = make_model("llama", attn_implementation="flashtile")
    assert model.config._attn_implementation == "flashtile"
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="flashtile")
    assert loaded.config._attn_implementation == "flashtile"
    loaded.set_attn_implementation("eager")
    assert loaded.config._attn_implementation == "eager"
    loaded.set_attn_implementation("flashtile")
    assert loaded.config._attn_implementation == "flashtile"


def test_other_flash_names_still_reach_transformers():
    """The hooks answer for "flashtile" only: flash_attention_2 still gets transformers' own checks and errors."""
    error = None
    try:
        make_model("llama", attn_implementation="flash_attention_2")
    except (ImportError, ValueError) as raised:
        error = raised
    if error is not None:
        assert "flashtile" not in str(error), f"flash_attention_2's error mentions flashtile: {error}"
    assert modeling_flash_attention_utils._lazy_imports.__wrapped__.__module__ == modeling_flash_attention_utils.__name__


def test_reimporting_does_not_stack_hooks():
    importlib.reload(ft_transformers)
    for owner, name, _, _ in ft_transformers._HOOKS:
        hooked = getattr(owner, name)
        assert not getattr(hooked.__wrapped__, "_flashtile_hook", False), f"{name} is hooked twice"


def test_an_untested_transformers_is_refused(monkeypatch):
    """The hooks extend private parts of transformers: another major version, or a changed signature, raises
    ImportError at import instead of misbehaving later."""
    monkeypatch.setattr(ft_transformers.transformers, "__version__", "6.0.0")
    with pytest.raises(ImportError, match=r"supports transformers >=5\.4,<6; found 6\.0\.0"):
        ft_transformers._check_transformers()
    monkeypatch.undo()
    monkeypatch.setattr(modeling_flash_attention_utils, "_flash_attention_forward", lambda q, k, v, mask: None)
    with pytest.raises(ImportError, match="_flash_attention_forward taking query_length"):
        ft_transformers._check_transformers()


def test_a_model_without_flash_attention_support_is_refused():
    class NoFlashLlama(LlamaForCausalLM):
        _supports_flash_attn = False

    model = NoFlashLlama(LlamaConfig(**TINY))
    with pytest.raises(ValueError, match="NoFlashLlama does not support flash attention.*_supports_flash_attn"):
        model.set_attn_implementation("flashtile")


def test_dense_masks_and_attention_probabilities_are_refused():
    model = make_model("llama", attn_implementation="flashtile")
    ids, _ = padded_batch("left", "none")
    dense = torch.zeros(2, 1, SEQLEN, SEQLEN)
    with pytest.raises(ValueError, match="4-D attention mask"):
        model(ids, attention_mask=dense)
    with pytest.raises(ValueError, match="output_attentions=True"):
        model(ids, output_attentions=True)


def test_a_decode_step_passes_no_position_ids_to_the_packing_test(monkeypatch):
    """A query of one token per sequence cannot be a packed batch: its position_ids are not passed on, so that the
    flash-attention path does not read their values (a GPU synchronisation per layer in some transformers releases);
    a prompt's are."""
    seen = []
    forward = modeling_flash_attention_utils._flash_attention_forward
    monkeypatch.setattr(modeling_flash_attention_utils, "_flash_attention_forward",
                        lambda *args, **kwargs: (seen.append("position_ids" in kwargs), forward(*args, **kwargs))[1])
    model = make_model("llama", attn_implementation="flashtile")
    ids = torch.randint(1, 100, (1, 6))
    with torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, do_sample=False)
    layers = model.config.num_hidden_layers
    assert seen == [True] * layers + [False] * layers, seen


def _flashtile_has_dropout() -> bool:
    q = torch.randn(1, 4, 1, 8)
    try:
        flashtile.flash_attn_func(q, q, q, dropout_p=0.5)
    except NotImplementedError:
        return False
    return True


def test_attention_dropout_reaches_flashtile():
    """Training with attention dropout passes dropout_p on; while flashtile has no dropout its error reaches the user."""
    model = make_model("llama", attn_implementation="flashtile", attention_dropout=0.25)
    ids, mask = padded_batch("right", "none")
    with torch.no_grad():
        model(ids, attention_mask=mask)  # eval: transformers passes dropout 0
    model.train()
    if _flashtile_has_dropout():
        loss = model(ids, attention_mask=mask, labels=ids).loss
        loss.backward()
        with torch.no_grad():
            without = model.eval()(ids, attention_mask=mask, labels=ids).loss
        assert loss.isfinite() and loss != without, "attention dropout changed nothing in training"
    else:
        with pytest.raises(NotImplementedError, match="dropout_p=0.25"):
            model(ids, attention_mask=mask, labels=ids)


def test_attention_sinks_pass_through_as_learnable_sink(backend):
    """gpt-oss's sinks (s_aux) reach flashtile as learnable_sink."""
    config = GptOssConfig(**{**TINY, "intermediate_size": 64}, head_dim=16, num_local_experts=4,
                          num_experts_per_tok=2, sliding_window=WINDOW)
    assert ft_transformers._takes_sinks(flashtile.flash_attn_func)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0, 2)
    ids, mask = padded_batch("left", "none")
    for kwargs in ({}, {"attention_mask": mask}):
        eager = logits(model, "eager", backend, ids, **kwargs)
        got = logits(model, "flashtile", backend, ids, **kwargs)
        tokens = mask.bool() if kwargs else torch.ones_like(mask, dtype=torch.bool)
        within_rule(f"gpt-oss logits ({backend}, {'padded' if kwargs else 'unpadded'})", got[tokens], eager[tokens])


class _Recorder:
    def __init__(self):
        self.graphs = []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return gm.forward


def test_whole_model_compiles_with_fullgraph(backend):
    """torch.compile(fullgraph=True) of a training step on an unpadded batch: one graph, flashtile's custom op in
    it, eager's gradients. (Padded batches graph-break in transformers' flash-attention mask code: docs/transformers.md.)"""
    torch._dynamo.reset()  # the backend choice is baked in at trace time
    ids, mask = padded_batch("none", "none")
    eager = once(("gradients", "llama", "unpadded"), lambda: gradients(make_model("llama"), "eager", "torch", ids, mask))
    model = make_model("llama", attn_implementation="flashtile").train()
    recorder = _Recorder()
    compiled = torch.compile(model, fullgraph=True, backend=recorder)
    with flashtile.use_backend(backend):
        next_token_loss(compiled(ids).logits, ids, mask).backward()
    ops = [str(node.target) for gm in recorder.graphs for node in gm.graph.nodes if node.op == "call_function"]
    assert any("flashtile.attention_forward" in op for op in ops), "flashtile's custom op is not in the graph"
    for parameter, grad in eager.items():
        within_rule(f"compiled gradient of {parameter} ({backend})", model.get_parameter(parameter).grad, grad)
