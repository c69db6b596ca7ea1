"""flashtile as an attention implementation of Hugging Face transformers: `attn_implementation="flashtile"`.

    import flashtile.integrations.transformers  # registers the name
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="flashtile")

Importing this module registers "flashtile" with transformers (>=5.4,<6); after that the name works wherever
transformers takes an attention implementation: `from_pretrained`, `from_config`, `set_attn_implementation`.
docs/transformers.md describes what is served, what raises and how torch.compile behaves.

How the name resolves. transformers treats every implementation whose name contains "flash" as a flash-attention
kernel with flash-attn's API; flashtile is one, so it runs on transformers' flash-attention path, the one
`flash_attention_2` takes (`modeling_flash_attention_utils._flash_attention_forward`):
- `attention_forward` is registered in `AttentionInterface`: it refuses what flashtile cannot serve, naming it, and
  hands the rest to that path;
- the mask function is flash_attention_2's (`AttentionMaskInterface`): the padding mask arrives as a 2-D
  (batch, seqlen_k) bool tensor, or None when nothing is padded, never as a dense 4-D mask; the path unpads a
  padded batch into packed sequences for `flash_attn_varlen_func` and pads the output back;
- transformers' flash-attention loader (`modeling_flash_attention_utils._lazy_imports`) learns the name: for
  "flashtile" it returns flashtile's `flash_attn_func`, `flash_attn_varlen_func` and `flash_attn_with_kvcache`
  (through `_with_sinks`) and `pad_input` / `unpad_input` below; every other name goes to transformers' loader;
- the model-level checks transformers runs for its flash names run for "flashtile" too: the model class must
  declare `_supports_flash_attn` (`PreTrainedModel.get_correct_attn_implementation`), and a model that lists the
  flash kernels it works with (`_compatible_flash_implementations`, the attention-sink models) gets flashtile only
  when flashtile takes sinks (`PreTrainedModel._check_and_adjust_attn_implementation`); transformers would
  otherwise swap in the first kernel of that list.
The hooks (`_HOOKS`) extend private parts of transformers, so this module checks the transformers version
(`SUPPORTED_TRANSFORMERS`) and their signatures at import and raises ImportError when either differs.
"""

from __future__ import annotations

import functools
import inspect

import torch

from .. import interface

try:
    import transformers
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError("flashtile.integrations.transformers needs transformers: pip install 'transformers>=5.4,<6' "
                      "(or flashtile's [transformers] extra)") from error

from packaging.version import Version
from transformers import modeling_flash_attention_utils
from transformers.integrations.flash_attention import get_target_dtype
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import AttentionInterface, PreTrainedModel

NAME = "flashtile"
# the releases this module was tested with; the hooks below read private parts of transformers that can change
SUPPORTED_TRANSFORMERS = (Version("5.4"), Version("6"))
# flashtile's keyword for attention sinks (one learnable logit per head that takes softmax mass but no value);
# transformers passes them as `s_aux`
SINK_KEYWORD = "learnable_sink"


def unpad_input(hidden_states: torch.Tensor, attention_mask: torch.Tensor, unused_mask: torch.Tensor | None = None):
    """flash-attn's `bert_padding.unpad_input`: the rows of a padded batch that hold tokens, packed.

    Args:
        hidden_states: (batch, seqlen, ...).
        attention_mask: (batch, seqlen) bool or int, nonzero (True) = a token, zero = padding (anywhere: left,
            right or between tokens).
        unused_mask: optional (batch, seqlen), nonzero = a row allocated to the sequence but not attended;
            such rows are kept in the packed tensor and counted in cu_seqlens, not in the last return value.

    Returns:
        (packed (total, ...), indices (total,) int64 into the flattened batch x seqlen rows, cu_seqlens (batch + 1,)
        int32, max_seqlen (a Python int), seqused (batch,) int32: the tokens of each sequence).
    """
    rows = attention_mask if unused_mask is None else attention_mask + unused_mask
    seqlens = rows.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(rows.flatten(), as_tuple=False).flatten()
    cu_seqlens = torch.nn.functional.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    packed = hidden_states.reshape(-1, *hidden_states.shape[2:])[indices]
    return packed, indices, cu_seqlens, int(seqlens.max()), attention_mask.sum(dim=-1, dtype=torch.int32)


def pad_input(hidden_states: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    """flash-attn's `bert_padding.pad_input`, the inverse of `unpad_input`: packed rows (total, ...) back into a
    (batch, seqlen, ...) tensor, zeros in the padded rows."""
    out = hidden_states.new_zeros(batch * seqlen, *hidden_states.shape[1:])
    out[indices] = hidden_states
    return out.view(batch, seqlen, *hidden_states.shape[1:])


def _takes_sinks(function) -> bool:
    return SINK_KEYWORD in inspect.signature(function).parameters


def _with_sinks(name: str):
    """flashtile's function `name`, taking transformers' `s_aux` (attention sinks) and passing it on as flashtile's
    `learnable_sink`, and taking `max_seqlen_q` / `max_seqlen_k` as 0-d tensors too.

    transformers decides which keywords to pass from the loaded function's signature and drops the others, so the
    adapter's signature is the function's plus `s_aux`: sinks always reach flashtile, which serves them or raises.
    While flashtile's function has no `learnable_sink` argument the adapter raises NotImplementedError itself.
    The function is looked up in flashtile.interface at each call: transformers keeps the adapter for the process's
    lifetime, and a replaced function (a test's stand-in) must still be the one called.
    """
    function = getattr(interface, name)

    @functools.wraps(function)
    def adapter(*args, s_aux=None, **kwargs):
        current = getattr(interface, name)
        if s_aux is not None:
            if not _takes_sinks(current):
                raise NotImplementedError(
                    f"the model passes attention sinks (s_aux, shape {tuple(s_aux.shape)}), but flashtile.{name} "
                    f"takes no {SINK_KEYWORD} argument in this flashtile version; use attn_implementation='eager'")
            kwargs[SINK_KEYWORD] = s_aux
        for hint in ("max_seqlen_q", "max_seqlen_k"):
            # transformers computes these grid hints from position_ids as 0-d tensors (flash-attn reads them on the
            # host); flashtile takes ints
            if isinstance(kwargs.get(hint), torch.Tensor):
                kwargs[hint] = int(kwargs[hint])
        return current(*args, **kwargs)

    signature = inspect.signature(function)
    parameters = list(signature.parameters.values())
    at = next((i for i, p in enumerate(parameters) if p.kind is inspect.Parameter.VAR_KEYWORD), len(parameters))
    if "s_aux" not in signature.parameters:
        parameters.insert(at, inspect.Parameter("s_aux", inspect.Parameter.KEYWORD_ONLY, default=None))
    adapter.__signature__ = signature.replace(parameters=parameters)
    return adapter


def _flash_functions():
    """What transformers' flash-attention loader returns for "flashtile"."""
    return (_with_sinks("flash_attn_func"), _with_sinks("flash_attn_varlen_func"),
            _with_sinks("flash_attn_with_kvcache"), pad_input, unpad_input)


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      sliding_window: int | None = None, softcap: float | None = None, is_causal: bool | None = None,
                      s_aux: torch.Tensor | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """The attention function transformers calls for attn_implementation="flashtile".

    Args (transformers' attention interface):
        module: the model's attention layer (its `is_causal`, `config` and `layer_idx` are read).
        query: (batch, nheads, seqlen_q, headdim); key, value: (batch, nheads_k, seqlen_k, headdim[_v]).
        attention_mask: None or the (batch, seqlen_k) bool padding mask (True = token) of the flash-attention
            mask function; a 4-D mask raises ValueError (a model or caller that builds its own dense mask needs
            attn_implementation="sdpa" or "eager").
        dropout, scaling, sliding_window, softcap, is_causal, s_aux: the layer's options, passed on to flashtile.
        kwargs: position_ids, cu_seq_lens_q / cu_seq_lens_k / max_length_q / max_length_k for packed batches,
            and the model's other keywords (output_attentions=True raises ValueError: flashtile never forms the
            attention probabilities).

    Returns:
        (out (batch, seqlen_q, nheads, headdim_v), None).
    """
    layer = type(module).__name__
    if attention_mask is not None and attention_mask.dim() != 2:
        raise ValueError(
            f"{layer} passed a {attention_mask.dim()}-D attention mask of shape {tuple(attention_mask.shape)} to "
            f"attn_implementation='flashtile', which takes padding masks only (2-D, batch x seqlen_k, from "
            f"transformers' flash-attention mask function); a dense or custom mask needs attn_implementation='sdpa' "
            f"or 'eager'")
    if kwargs.get("output_attentions"):
        raise ValueError(f"output_attentions=True ({layer}): flashtile never forms the attention probabilities; use "
                         f"attn_implementation='eager' to get them")
    seqlen_q = query.shape[2]
    if seqlen_q == 1:
        # one query row per sequence cannot be a packed batch: without position_ids the flash-attention path skips its
        # packing test, which in some releases (5.17; not 5.24) reads the ids' values and so waits for the GPU in
        # every layer of every decode step
        kwargs.pop("position_ids", None)
    query, key, value = (t.transpose(1, 2) for t in (query, key, value))  # flash-attn's (batch, seqlen, heads, dim)
    # transformers casts float32 q, k, v to the dtype of the model's linear layers (float32 layer norms under PEFT,
    # autocast); flashtile takes float32 as it is, so only a real change of dtype is passed on
    target_dtype = get_target_dtype(query, module)
    out = modeling_flash_attention_utils._flash_attention_forward(
        query, key, value, attention_mask, query_length=seqlen_q,
        is_causal=module.is_causal if is_causal is None else is_causal, dropout=dropout, softmax_scale=scaling,
        sliding_window=sliding_window, softcap=softcap, use_top_left_mask=False,
        target_dtype=None if target_dtype == query.dtype else target_dtype, attn_implementation=NAME,
        layer_idx=getattr(module, "layer_idx", None), s_aux=None if s_aux is None else s_aux.to(query.dtype),
        **kwargs)
    return out, None


def _check_model(model: PreTrainedModel) -> None:
    """The model-level checks transformers runs for its own flash-attention names, for "flashtile"."""
    cls = type(model).__name__
    if not (model._supports_flash_attn or getattr(model, "_supports_flash_attn_2", False)):
        raise ValueError(f"{cls} does not support flash attention in transformers (its _supports_flash_attn is False), "
                         f"so attn_implementation='flashtile' cannot serve it; use 'sdpa' or 'eager'")


def _admit_to_flash_list(model: PreTrainedModel) -> None:
    """A model may list the flash-attention kernels it works with (`_compatible_flash_implementations`; transformers
    replaces any other flash name by the first of them). The models that list flash_attention_4 do so for attention
    sinks; flashtile, with flash-attn's API, stands in for flash_attention_4 there once it takes sinks
    (`learnable_sink`), and is refused, naming the list, otherwise."""
    listed = getattr(model, "_compatible_flash_implementations", None)
    if listed is None or NAME in listed:
        return
    cls = type(model).__name__
    if "flash_attention_4" not in listed:
        raise ValueError(f"{cls} works only with the flash-attention kernels it lists ({', '.join(listed)}); "
                         f"attn_implementation='flashtile' is not one of them; use 'eager'")
    if not all(_takes_sinks(f) for f in (interface.flash_attn_func, interface.flash_attn_varlen_func)):
        raise NotImplementedError(
            f"{cls} needs attention sinks (transformers' s_aux), which flashtile serves through flash_attn_func's "
            f"{SINK_KEYWORD} argument; this flashtile version has none, so attn_implementation='flashtile' cannot "
            f"serve {cls}; use 'eager'")
    model._compatible_flash_implementations = [*listed, NAME]


def _check_transformers() -> None:
    version = Version(transformers.__version__)
    low, high = SUPPORTED_TRANSFORMERS
    if not low <= version < high:
        raise ImportError(f"flashtile.integrations.transformers supports transformers >={low},<{high}; found "
                          f"{transformers.__version__}")
    for owner, name, needed in [(owner, name, needed) for owner, name, needed, _ in _HOOKS] + _CALLED:
        function = getattr(owner, name, None)
        if function is None or not set(needed) <= set(inspect.signature(function).parameters):
            raise ImportError(f"transformers {transformers.__version__} has no {owner.__name__}.{name} taking "
                              f"{', '.join(needed)}, which flashtile.integrations.transformers needs; it was tested "
                              f"with transformers >={low},<{high}")


def _lazy_imports(load):
    """transformers' flash-attention loader, resolving "flashtile" to flashtile's functions."""
    def hooked(implementation, *args, **kwargs):
        if implementation == NAME:
            return _flash_functions()
        return load(implementation, *args, **kwargs)
    return hooked


def _check_and_adjust_attn_implementation(check):
    """PreTrainedModel's resolution of a requested name (from_pretrained, from_config, set_attn_implementation)."""
    def hooked(self, attn_implementation, *args, **kwargs):
        if attn_implementation == NAME:
            _admit_to_flash_list(self)
        return check(self, attn_implementation, *args, **kwargs)
    return hooked


def _get_correct_attn_implementation(check):
    """PreTrainedModel's check of a name against the model (also run for the submodels of a composite model)."""
    def hooked(self, requested_attention, *args, **kwargs):
        if requested_attention == NAME:
            _check_model(self)
        return check(self, requested_attention, *args, **kwargs)
    return hooked


# (owner, attribute, parameters it must take, the wrapper): the private parts of transformers extended for
# "flashtile"; each wrapper handles the name "flashtile" and hands every other name to transformers unchanged
_HOOKS = (
    (modeling_flash_attention_utils, "_lazy_imports", ("implementation",), _lazy_imports),
    (PreTrainedModel, "_check_and_adjust_attn_implementation", ("self", "attn_implementation"),
     _check_and_adjust_attn_implementation),
    (PreTrainedModel, "get_correct_attn_implementation", ("self", "requested_attention"),
     _get_correct_attn_implementation),
)
# private functions of transformers that attention_forward calls, with the parameters it passes by name
_CALLED = [
    (modeling_flash_attention_utils, "_flash_attention_forward",
     ("query_length", "is_causal", "dropout", "softmax_scale", "sliding_window", "softcap", "use_top_left_mask",
      "target_dtype", "attn_implementation")),
]


def _install() -> None:
    _check_transformers()
    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, ALL_MASK_ATTENTION_FUNCTIONS["flash_attention_2"])
    for owner, name, _, wrap in _HOOKS:
        original = getattr(owner, name)
        if not getattr(original, "_flashtile_hook", False):  # once, even if this module is reloaded
            hooked = functools.wraps(original)(wrap(original))
            hooked._flashtile_hook = True
            setattr(owner, name, hooked)


_install()
