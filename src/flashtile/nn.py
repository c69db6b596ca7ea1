"""torch.nn modules computed by flashtile.

    MultiheadAttention   drop-in for torch.nn.MultiheadAttention (same constructor, parameters and forward
                         signature); attention runs through flashtile.scaled_dot_product_attention
    Attention            a parameter-free module over flash_attn_func, for model code in flash-attn's layout

Both run on whichever backend flashtile chooses for the call (`flashtile.use_backend` picks one).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ._validate import _check_softcap, _check_window, _require_bool, _require_real
from .interface import flash_attn_func, scaled_dot_product_attention

__all__ = ["Attention", "MultiheadAttention"]


def _check_dropout_probability(name: str, value: object) -> float:
    p = _require_real(name, value)
    if not 0.0 <= p < 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {p}")
    return p


def _run_with_dropout(module: str, setting: str, p: float, function, *args, **kwargs) -> Tensor:
    """function(*args, **kwargs); when flashtile refuses its dropout_p = p > 0, the error is re-raised in the
    module's terms, naming its `setting` (flashtile validates before it computes, so nothing has run)."""
    try:
        return function(*args, **kwargs)
    except NotImplementedError as error:
        if p > 0.0 and "dropout" in str(error):
            raise NotImplementedError(
                f"{module}({setting}={p}) in training mode needs attention dropout, which flashtile refused "
                f"({error}). Construct the module with {setting}=0.0, or call .eval() (in evaluation mode dropout "
                f"is not applied, as in torch)") from error
        raise


class MultiheadAttention(torch.nn.MultiheadAttention):
    """Drop-in for `torch.nn.MultiheadAttention` whose attention is computed by flashtile.

    A subclass of torch's module: the constructor, the parameters (in_proj_weight, or q_proj_weight /
    k_proj_weight / v_proj_weight when kdim or vdim differ from embed_dim; in_proj_bias; out_proj.weight /
    out_proj.bias; bias_k / bias_v), their initialisation and the state_dict are torch's, so weights load in
    both directions and isinstance(m, torch.nn.MultiheadAttention) holds. Only `forward` differs.

    Args (as torch's):
        embed_dim: E, the model width (query features and output features); num_heads divides it, each head
            having head_dim = E // num_heads features (1..256, flashtile's limit).
        num_heads: number of attention heads.
        dropout: attention-dropout probability, applied only in training mode (see forward's Raises).
        bias: input and output projections have biases.
        add_bias_kv: append a learned key and value (bias_k, bias_v) to every sequence's keys and values.
        add_zero_attn: append a key and a value of zeros after the projections.
        kdim, vdim: key and value features (None: embed_dim).
        batch_first: inputs and output are (batch, seq, feature) rather than (seq, batch, feature).
        device, dtype: of the parameters. flashtile computes float16, bfloat16, float32 and float64 (the last
            on the 'torch' backend only).

    Differences from torch's module:
        - need_weights defaults to False, and need_weights=True raises ValueError: the attention weights
          (an L x S matrix per head) are exactly what FlashAttention never forms. The second element of the
          returned pair is always None.
        - is_causal=True may be passed without attn_mask (torch requires one): it applies torch's top-left
          causal mask (query i attends keys j <= i).
        - A query row whose every key is masked attends to nothing: zeros before the output projection, so the
          output is out_proj.bias there (torch gives the same on the CPU; some of its GPU kernels give NaN).
        - torch.nn.TransformerEncoderLayer's inference fast path calls torch's own kernels with this module's
          weights (it reads them directly, bypassing forward); flashtile computes only what goes through forward.
    """

    def forward(self, query: Tensor, key: Tensor, value: Tensor, key_padding_mask: Tensor | None = None,
                need_weights: bool = False, attn_mask: Tensor | None = None, average_attn_weights: bool = True,
                is_causal: bool = False) -> tuple[Tensor, None]:
        """Multi-head attention: project, attend with flashtile, project out.

        Shapes (N batch, L target length, S source length, E = embed_dim, H = num_heads):

        Args:
            query: (L, N, E), or (N, L, E) with batch_first=True, or unbatched (L, E).
            key: (S, N, kdim) / (N, S, kdim) / (S, kdim); value: (S, N, vdim) / (N, S, vdim) / (S, vdim).
                Floating, in the parameters' dtype (float16, bfloat16, float32; float64 on the 'torch' backend).
            key_padding_mask: optional (N, S), unbatched (S,): bool, True = ignore that key (padding), or
                floating, added to the scores of that key.
            need_weights: must be False (the default here; torch's default is True). True raises ValueError.
            attn_mask: optional (L, S), or (N * H, L, S) (unbatched: (H, L, S)), one mask per batch entry and
                head, entry n * H + h for batch n and head h: bool, True = NOT allowed to attend (torch's
                nn.MultiheadAttention convention, the opposite of scaled_dot_product_attention's), or
                floating, added to the scores. Combined with key_padding_mask as torch does (a bool and a
                floating mask are combined as the floating -inf / 0 mask of the bool one plus the other).
            average_attn_weights: accepted for compatibility; has no effect (no weights are returned).
            is_causal: apply the top-left causal mask (query i attends keys j <= i). As in torch, this is a
                promise that attn_mask, when given, is that causal mask: without key_padding_mask the causal
                mask is applied by skipping the masked blocks, without reading attn_mask (on the CPU its
                values are checked against the promise, which on a GPU would cost a synchronisation); with
                key_padding_mask, attn_mask (or, when None, the causal mask) is combined with it and applied.

        Returns:
            (attn_output, None): attn_output (L, N, E) / (N, L, E) with batch_first=True / (L, E) unbatched,
            in query's dtype. Gradients flow to query, key, value and the parameters (not to the masks).

        Raises:
            ValueError for need_weights=True, for a mask of the wrong shape, for an attn_mask given with
                is_causal=True that (checked on the CPU) is not the causal mask, and for inputs of the wrong rank
                or width; TypeError for a mask that is neither bool nor floating.
            NotImplementedError naming `dropout` when the module is in training mode with dropout > 0 and
                flashtile does not implement attention dropout (call .eval(), or construct with dropout=0.0).
            flashtile's own errors (BackendUnavailableError, KernelCompileError, ...) as for
                flashtile.scaled_dot_product_attention.
        """
        if _require_bool("need_weights", need_weights):
            raise ValueError(
                "need_weights=True asks for the attention weights (an L x S matrix per head), which FlashAttention "
                "never forms: that is where its memory saving comes from. Call with need_weights=False (the "
                "default of flashtile.nn.MultiheadAttention), or use torch.nn.MultiheadAttention with the same "
                "state_dict to inspect the weights")
        _require_bool("average_attn_weights", average_attn_weights)
        _require_bool("is_causal", is_causal)
        batched = self._check_inputs(query, key, value)
        self_attention = query is key and key is value  # before the views below make three tensors of one
        if not batched:
            query, key, value = (x.unsqueeze(0) for x in (query, key, value))
        elif not self.batch_first:
            query, key, value = (x.transpose(0, 1) for x in (query, key, value))  # views: (N, seq, features)
        batch, seqlen_q, seqlen_k = query.shape[0], query.shape[1], key.shape[1]
        if key.shape[:2] != value.shape[:2] or query.shape[0] != key.shape[0]:
            raise ValueError(f"query, key and value must share the batch size and key and value the length: got "
                             f"(batch, length) {tuple(query.shape[:2])}, {tuple(key.shape[:2])} and "
                             f"{tuple(value.shape[:2])}")

        q, k, v = self._project(query, key, value, self_attention)  # (N, L or S, H, head_dim) each
        extra_keys = 0
        if self.bias_k is not None:
            k = torch.cat([k, self.bias_k.view(1, 1, *k.shape[2:]).expand(batch, 1, -1, -1)], dim=1)
            v = torch.cat([v, self.bias_v.view(1, 1, *v.shape[2:]).expand(batch, 1, -1, -1)], dim=1)
            extra_keys += 1
        if self.add_zero_attn:
            k = torch.cat([k, k.new_zeros(batch, 1, *k.shape[2:])], dim=1)
            v = torch.cat([v, v.new_zeros(batch, 1, *v.shape[2:])], dim=1)
            extra_keys += 1
        mask, causal = self._sdpa_mask(key_padding_mask, attn_mask, is_causal, batched, batch, seqlen_q, seqlen_k,
                                       extra_keys, query.dtype)

        p = self.dropout if self.training else 0.0
        out = _run_with_dropout("MultiheadAttention", "dropout", p, scaled_dot_product_attention,
                                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                dropout_p=p, is_causal=causal)
        out = out.transpose(1, 2)  # (N, L, H, head_dim)
        if batched and not self.batch_first:
            out = out.transpose(0, 1).reshape(seqlen_q, batch, self.embed_dim)
        else:
            out = out.flatten(-2)
        out = F.linear(out, self.out_proj.weight, self.out_proj.bias)
        return (out if batched else out.squeeze(0)), None

    def _check_inputs(self, query, key, value) -> bool:
        """torch's rank and width rules; returns whether the inputs are batched."""
        for name, t in (("query", query), ("key", key), ("value", value)):
            if not isinstance(t, Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if query.dim() not in (2, 3):
            raise ValueError(f"query must be 2-D (L, E) unbatched or 3-D batched, got shape {tuple(query.shape)}")
        if key.dim() != query.dim() or value.dim() != query.dim():
            raise ValueError(f"query is {query.dim()}-D, so key and value must be too; got key "
                             f"{tuple(key.shape)} and value {tuple(value.shape)}")
        for name, t, width in (("query", query, self.embed_dim), ("key", key, self.kdim),
                               ("value", value, self.vdim)):
            if t.shape[-1] != width:
                attribute = {"query": "embed_dim", "key": "kdim", "value": "vdim"}[name]
                raise ValueError(f"{name} has {t.shape[-1]} features (last dim) but the module's {attribute} is "
                                 f"{width}")
        return query.dim() == 3

    def _project(self, query, key, value, self_attention: bool) -> tuple[Tensor, Tensor, Tensor]:
        """The input projections, as (N, seq, H, head_dim) views of the projected tensors (self-attention: one
        matmul, as in torch)."""
        bias = self.in_proj_bias
        b_q, b_k, b_v = (None, None, None) if bias is None else bias.chunk(3)
        if self._qkv_same_embed_dim:
            if self_attention:
                q, k, v = F.linear(query, self.in_proj_weight, bias).chunk(3, dim=-1)
            else:
                w_q, w_k, w_v = self.in_proj_weight.chunk(3)
                q, k, v = F.linear(query, w_q, b_q), F.linear(key, w_k, b_k), F.linear(value, w_v, b_v)
        else:
            q = F.linear(query, self.q_proj_weight, b_q)
            k = F.linear(key, self.k_proj_weight, b_k)
            v = F.linear(value, self.v_proj_weight, b_v)
        heads = (self.num_heads, self.head_dim)
        return q.unflatten(-1, heads), k.unflatten(-1, heads), v.unflatten(-1, heads)

    def _sdpa_mask(self, key_padding_mask, attn_mask, is_causal, batched, batch, seqlen_q, seqlen_k, extra_keys,
                   dtype) -> tuple[Tensor | None, bool]:
        """torch's key_padding_mask and attn_mask (True = masked) as one scaled_dot_product_attention mask
        (True = attend, or additive) broadcastable to (N, H, L, S + extra_keys), and its is_causal."""
        heads = self.num_heads
        for name, mask in (("key_padding_mask", key_padding_mask), ("attn_mask", attn_mask)):
            if mask is not None:
                if not isinstance(mask, Tensor):
                    raise TypeError(f"{name} must be a torch.Tensor or None, got {type(mask).__name__}")
                if mask.dtype != torch.bool and not mask.is_floating_point():
                    raise TypeError(f"{name} must be bool (True = masked) or floating (added to the scores), "
                                    f"got {mask.dtype}")
        if key_padding_mask is not None:
            expected = (batch, seqlen_k) if batched else (seqlen_k,)
            if tuple(key_padding_mask.shape) != expected:
                raise ValueError(f"key_padding_mask has shape {tuple(key_padding_mask.shape)}; it must be "
                                 f"{'(N, S)' if batched else '(S,)'} = {expected}")
            key_padding_mask = key_padding_mask.reshape(batch, 1, 1, seqlen_k)
        if attn_mask is not None:
            per_head = (batch * heads if batched else heads, seqlen_q, seqlen_k)
            if attn_mask.dim() == 2 and tuple(attn_mask.shape) == (seqlen_q, seqlen_k):
                attn_mask = attn_mask.view(1, 1, seqlen_q, seqlen_k)
            elif attn_mask.dim() == 3 and tuple(attn_mask.shape) == per_head:
                attn_mask = attn_mask.view(batch, heads, seqlen_q, seqlen_k)
            else:
                rows = "N * num_heads" if batched else "num_heads"
                raise ValueError(f"attn_mask has shape {tuple(attn_mask.shape)}; it must be (L, S) = "
                                 f"{(seqlen_q, seqlen_k)} or ({rows}, L, S) = {per_head}")
        if is_causal:
            if key_padding_mask is None:  # the causal mask alone, applied by skipping blocks (torch's hint)
                if attn_mask is not None:
                    _check_causal_promise(attn_mask, seqlen_q, seqlen_k)
                return None, True
            if attn_mask is None:
                attn_mask = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=key_padding_mask.device).triu(1)
        masks = [m for m in (attn_mask, key_padding_mask) if m is not None]
        if not masks:
            return None, False
        if extra_keys:  # the appended keys are visible to every query, as in torch
            masks = [F.pad(m, (0, extra_keys)) for m in masks]
        if all(m.dtype == torch.bool for m in masks):
            masked = masks[0] if len(masks) == 1 else masks[0] | masks[1]
            return ~masked, False
        additive = [m if m.is_floating_point() else torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill(
            m, float("-inf")) for m in masks]
        return (additive[0] if len(additive) == 1 else additive[0] + additive[1]), False


def _check_causal_promise(attn_mask: Tensor, seqlen_q: int, seqlen_k: int) -> None:
    """is_causal=True promises attn_mask is the top-left causal mask (True or -inf above the diagonal, else False
    or 0); check it where that is free (a CPU mask, outside torch.compile)."""
    if attn_mask.device.type != "cpu" or torch.compiler.is_compiling():
        return
    masked = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool).triu(1)
    if attn_mask.dtype == torch.bool:
        expected = masked
    else:
        expected = torch.zeros(seqlen_q, seqlen_k, dtype=attn_mask.dtype).masked_fill(masked, float("-inf"))
    if not torch.equal(attn_mask, expected.expand(attn_mask.shape)):
        raise ValueError(
            "is_causal=True promises that attn_mask is the causal mask (True, or -inf, exactly above the diagonal: "
            "query i attends keys j <= i), which is then applied without reading attn_mask, as in torch; this "
            "attn_mask is a different mask. Pass is_causal=False to apply it as given, or drop attn_mask")


class Attention(torch.nn.Module):
    """Attention without parameters, for model code in flash-attn's layout: calls `flashtile.flash_attn_func`.

    The constructor holds the defaults; each forward call may override them by keyword.

    Args:
        causal: mask keys after the query's diagonal, bottom-right aligned as in flash-attn (with seqlen_q <
            seqlen_k the last query row sees every key; see flashtile.interface).
        softmax_scale: multiplier of q.k; None means 1 / sqrt(headdim).
        window_size: (left, right) sliding window around the diagonal; -1 = unbounded on that side.
        dropout_p: attention-dropout probability, applied only in training mode (module.train()); 0.0 in
            evaluation mode, as torch modules do.
        softcap: if > 0, scores become softcap * tanh(score / softcap).

    Raises (constructor): TypeError / ValueError for an argument of the wrong type or out of range.
    """

    def __init__(self, causal: bool = False, softmax_scale: float | None = None,
                 window_size: tuple[int, int] = (-1, -1), dropout_p: float = 0.0, softcap: float = 0.0) -> None:
        super().__init__()
        self.causal = _require_bool("causal", causal)
        self.softmax_scale = None if softmax_scale is None else _require_real("softmax_scale", softmax_scale)
        self.window_size = _check_window(window_size, causal=False)
        self.dropout_p = _check_dropout_probability("dropout_p", dropout_p)
        self.softcap = _check_softcap(softcap)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool | None = None,
                softmax_scale: float | None = None, window_size: tuple[int, int] | None = None,
                softcap: float | None = None, alibi_slopes: Tensor | None = None) -> Tensor:
        """Exact attention of q over k, v.

        Args:
            q: (batch, seqlen_q, nheads, headdim); float16, bfloat16, float32 or float64 (float64 on the
                'torch' backend only).
            k: (batch, seqlen_k, nheads_k, headdim), v: (batch, seqlen_k, nheads_k, headdim_v); q's dtype and
                device; nheads % nheads_k == 0 (grouped-query / multi-query attention: query head h uses
                K/V head h // (nheads // nheads_k)).
            causal, softmax_scale, window_size, softcap: None uses the module's value (softmax_scale None
                in the module means 1 / sqrt(headdim)).
            alibi_slopes: (nheads,) or (batch, nheads) floating, or None; as in flash_attn_func.

        Returns:
            (batch, seqlen_q, nheads, headdim_v) in q's dtype; gradients flow to q, k and v. A row that sees no
            key returns zeros.

        Raises:
            flash_attn_func's TypeError / ValueError for invalid inputs (naming the argument and the rule);
            NotImplementedError naming `dropout_p` in training mode with dropout_p > 0 if flashtile does not
            implement attention dropout (call .eval(), or construct with dropout_p=0.0);
            BackendUnavailableError / KernelCompileError as flash_attn_func.
        """
        p = self.dropout_p if self.training else 0.0
        return _run_with_dropout(
            "Attention", "dropout_p", p, flash_attn_func, q, k, v, dropout_p=p,
            softmax_scale=self.softmax_scale if softmax_scale is None else softmax_scale,
            causal=self.causal if causal is None else causal,
            window_size=self.window_size if window_size is None else window_size,
            softcap=self.softcap if softcap is None else softcap, alibi_slopes=alibi_slopes)

    def extra_repr(self) -> str:
        scale = "1/sqrt(headdim)" if self.softmax_scale is None else f"{self.softmax_scale:g}"
        return (f"causal={self.causal}, softmax_scale={scale}, window_size={self.window_size}, "
                f"dropout_p={self.dropout_p}, softcap={self.softcap:g}")
