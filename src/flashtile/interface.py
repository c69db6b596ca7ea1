"""The public API: validate, dispatch, explain.

Causal and window masks in `flash_attn_func` are aligned to the bottom-right corner of the score
matrix, as in flash-attn >= 2.1: query i may attend key j iff

    i + seqlen_k - seqlen_q - left  <=  j  <=  i + seqlen_k - seqlen_q + right

(-1 = unbounded on that side; causal=True forces right = 0). For seqlen_q = 2, seqlen_k = 5,
causal (1 = attend):

    1 1 1 1 0        the last query row sees every key: queries are the newest tokens
    1 1 1 1 1

and for seqlen_q = 5, seqlen_k = 2, causal:

    0 0              rows 0..2 see no key at all: they get out = 0 and lse = -inf
    0 0              (with a learnable sink: out = 0 and lse = the sink)
    0 0
    1 0
    1 1

A learnable sink (`learnable_sink`, as in gpt-oss and flash-attn's CuTe interface) is one logit per query
head, s_h, in natural-log units and not multiplied by softmax_scale, that joins every query row's softmax
denominator without a value:

    out_i = sum_j exp(S_ij) v_j / (exp(s_h) + sum_j exp(S_ij)),   lse_i = log(exp(s_h) + sum_j exp(S_ij))

so a row may give less than all of its attention to the keys (a large sink: out near 0; s_h = -inf: no sink).
Its gradient is -sum_i exp(s_h - lse_i) * (rowsum(dO_i * out_i) - dlse_i) over the rows of head h.

`scaled_dot_product_attention` keeps torch's top-left alignment (query i sees keys j <= i).
"""

from __future__ import annotations

import inspect
from typing import Any

from torch import Tensor

from . import _dispatch
from ._validate import (prepare_flash_attn, prepare_flash_attn_varlen, prepare_flash_attn_varlen_paged,
                        prepare_kvcache, prepare_sdpa)
from .autograd import attention
from .torch_impl import attention_probabilities


def flash_attn_func(q: Tensor, k: Tensor, v: Tensor, dropout_p: float = 0.0, softmax_scale: float | None = None,
                    causal: bool = False, window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                    alibi_slopes: Tensor | None = None, deterministic: bool = False, return_attn_probs: bool = False,
                    *, return_lse: bool = False,
                    learnable_sink: Tensor | None = None) -> Tensor | tuple[Tensor, ...]:
    """Exact attention in linear memory, with flash-attn's signature and layout.

    Args:
        q: (batch, seqlen_q, nheads, headdim); float16, bfloat16, float32 or float64.
        k: (batch, seqlen_k, nheads_k, headdim), same dtype and device; nheads % nheads_k == 0
            (grouped-query / multi-query attention: query head h uses K/V head h // (nheads // nheads_k),
            without copying K or V).
        v: (batch, seqlen_k, nheads_k, headdim_v); headdim and headdim_v may differ, each 1..256.
        dropout_p: attention dropout, in [0, 1): out = (P * Z / (1 - dropout_p)) v with P = softmax(scores) and Z a
            keep-mask, each probability kept with probability 1 - dropout_p (the lse is that of the scores, without
            dropout). Z comes from a Philox stream seeded from torch's default generator of the tensors' device, so
            torch.manual_seed reproduces a call and consecutive calls draw fresh masks; Z[b, h, i, j] depends on the
            seed, the offset and the position alone (not on tiles, schedules or backends), and the backward
            regenerates it (nothing of size seqlen_q x seqlen_k is stored). Applied whenever dropout_p > 0, as in
            flash-attn: pass 0.0 at evaluation time.
        softmax_scale: multiplier of q.k; None means 1 / sqrt(headdim).
        causal: mask keys after the query's diagonal, bottom-right aligned (see the module docstring).
        window_size: (left, right) sliding window around the diagonal; -1 = unbounded. A tuple or list of
            two ints, or a 2-element integer tensor; the values are read on the host, so a tensor on a GPU
            costs a synchronisation and is refused (ValueError) while a CUDA graph is captured or
            torch.compile traces: pass a tuple there.
        softcap: if > 0, scores become softcap * tanh(score / softcap) before masking and ALiBi.
        alibi_slopes: (nheads,) or (batch, nheads) floating tensor; subtracts
            slope * |i + seqlen_k - seqlen_q - j| from each score (after softcap). Not differentiated.
        deterministic: accepted for compatibility; every flashtile backend is deterministic here (with dropout too:
            the same forward's backward gives the same bits), except the opt-in Triton setting backward_schedule=5,
            whose dq is not bitwise reproducible (it warns when it runs).
        return_attn_probs: return (out, lse, S_dmask), as flash-attn, for testing: S_dmask (batch, nheads,
            seqlen_q, seqlen_k) in q's dtype holds the probabilities P = softmax(scores) before dropout's
            scaling, with the entries dropout dropped negated, so torch.signbit(S_dmask) is the drop mask (a dropped
            0 is -0.0) and S_dmask.abs() is P. It is materialised (by a dense pass of the torch backend's code over
            the same Philox stream) only when dropout_p > 0; with dropout_p = 0 it is None, as in flash-attn.
        return_lse: also return the log-sum-exp of each row's final scores.
        learnable_sink: (nheads,) float32 or q's dtype, on q's device, or None: one logit per query head (GQA:
            per query head, not per K/V head) joining every row's softmax denominator without a value, in
            natural-log units and not multiplied by softmax_scale (see the module docstring). Differentiable:
            its gradient has its shape and dtype. Values must not be +inf or NaN (not checked: reading them
            would synchronise); -inf means no sink for that head. Keyword-only (flash-attn's CuTe interface
            takes it after window_size, where this signature keeps flash-attn 2's softcap).

    Returns:
        out (batch, seqlen_q, nheads, headdim_v) in q's dtype; with return_lse=True, (out, lse) where
        lse (batch, nheads, seqlen_q) is float32 (natural log; it includes the sink's term); with
        return_attn_probs=True, (out, lse, S_dmask) (with a sink, S_dmask's rows sum to less than 1: the sink's
        share is in the denominator). A row that sees no key (fully masked, or seqlen_k == 0) gets out = 0,
        lse = -inf and zero gradients; with a sink, out = 0 and lse = the sink (finite), and its gradient reaches the
        sink only through lse. Gradients flow to q, k, v and learnable_sink (and through lse when it is used).

    Raises:
        TypeError / ValueError naming the argument and the rule for any invalid input (dropout_p outside [0, 1)
        raises ValueError); ValueError for dropout_p > 0 while a CUDA graph is captured;
        BackendUnavailableError when the requested backend (use_backend / FLASHTILE_BACKEND) cannot serve the call;
        KernelCompileError, naming the kernel and its tile, when Triton cannot compile a kernel for the call.
    """
    call = prepare_flash_attn(q, k, v, dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal,
                              window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                              deterministic=deterministic, return_attn_probs=return_attn_probs, return_lse=return_lse,
                              learnable_sink=learnable_sink)
    if return_attn_probs:
        out, lse, rng_state = attention(call, *_dispatch.resolve(call.problem), with_rng_state=True)
        probs = attention_probabilities(call, rng_state) if call.problem.dropout_p > 0 else None
        return out, lse, probs
    out, lse = attention(call, *_dispatch.resolve(call.problem))
    return (out, lse) if return_lse else out


def flash_attn_varlen_func(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor | None,
                           max_seqlen_q: int, max_seqlen_k: int, dropout_p: float = 0.0,
                           softmax_scale: float | None = None, causal: bool = False,
                           window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                           alibi_slopes: Tensor | None = None, deterministic: bool = False,
                           return_attn_probs: bool = False, block_table: Tensor | None = None, *,
                           return_lse: bool = False, learnable_sink: Tensor | None = None,
                           seqused_k: Tensor | None = None) -> Tensor | tuple[Tensor, ...]:
    """Attention over packed variable-length sequences, with flash-attn's signature (no padding); with
    block_table, packed queries against paged K/V caches (forward only), as vLLM calls flash-attn.

    Args:
        q: (total_q, nheads, headdim), the query rows of every sequence one after another.
        k: (total_k, nheads_k, headdim); v: (total_k, nheads_k, headdim_v); same dtype and device.
            With block_table: paged caches k (num_blocks, page_block_size, nheads_k, headdim) and
            v (num_blocks, page_block_size, nheads_k, headdim_v), page_block_size a positive multiple of 16
            (as flash_attn_with_kvcache; flash-attn's multiples of 256 included), unit-stride last dims.
        cu_seqlens_q, cu_seqlens_k: int32 (nseq + 1,) on q's device: sequence i owns query rows
            cu_seqlens_q[i] .. cu_seqlens_q[i + 1] - 1 and key rows cu_seqlens_k[i] .. cu_seqlens_k[i + 1] - 1.
            Each starts at 0, never decreases and ends at total_q / total_k; zero-length sequences are
            allowed. Checked on CPU tensors; on a GPU only dtype, shape and device are checked (reading the
            values would synchronise every call), and offsets that break the rules give undefined results.
            With block_table, cu_seqlens_k only gives each sequence's key count (its differences; its end need
            not match k) and may be None when seqused_k is given.
        max_seqlen_q, max_seqlen_k: ints >= 0, hints for the GPU grid (the longest sequence is the right
            value); results never depend on them, and nothing is read back from the GPU to check them.
        dropout_p, softmax_scale, causal, window_size, softcap, deterministic, return_attn_probs,
        return_lse: as in `flash_attn_func`, applied to each sequence on its own; causal and windows are
            bottom-right aligned per sequence (a sequence's last query row sees its last key): for a
            sequence of 2 queries and 5 keys, causal,

                1 1 1 1 0
                1 1 1 1 1

            Dropout's keep-mask of sequence s is that of batch entry s in flash_attn_func (positions count from
            the sequence's start).
        alibi_slopes: (nheads,) or (nseq, nheads).
        block_table: int32 (nseq, max_blocks_per_seq) on q's device, or None (k and v packed as above).
            Sequence b's key j is row j % page_block_size of block block_table[b, j // page_block_size] of
            k and v; entries past a sequence's last page are never read. Positional after return_attn_probs,
            as in flash-attn >= 2.6.
        learnable_sink: (nheads,) or None, as in `flash_attn_func`: the same logits for every sequence.
        seqused_k: int32 (nseq,) on q's device, or None; with block_table only: sequence b has seqused_k[b]
            keys (its first seqused_k[b] positions in its pages). Without it, cu_seqlens_k[b + 1] -
            cu_seqlens_k[b]. Each count must lie within 0 .. max_blocks_per_seq * page_block_size, and the
            pages in use must be blocks of k: checked on CPU tensors; on a GPU the caller's guarantee (the
            kernel clamps counts and block ids into the caches, so broken values give undefined results but
            never read outside them).

    Returns:
        out (total_q, nheads, headdim_v) in q's dtype; with return_lse=True, (out, lse) with lse
        (nheads, total_q) float32; with return_attn_probs=True, (out, lse, S_dmask), S_dmask (nseq, nheads,
        max_seqlen_q, max_seqlen_k) with sequence s's probabilities at S_dmask[s, :, :len_q, :len_k] (each max at
        least the longest sequence), or None with dropout_p = 0. Rows that see no key (including every row of a
        sequence with no keys) get out 0, lse -inf (with a sink: the sink) and zero gradients for q, k, v; keys of a
        sequence with no queries get zero gradients. With block_table the result carries no gradient.
        The work is proportional to each sequence's own length (programs of short sequences exit early).

    Raises:
        TypeError / ValueError naming the argument and the rule, before anything runs; NotImplementedError
        for seqused_k without block_table, and for a paged call (block_table given) with dropout_p > 0,
        return_attn_probs=True or while gradients are required of q, k, v or learnable_sink (paged K/V is forward
        only, as in flash-attn: use torch.no_grad() or torch.inference_mode()); BackendUnavailableError as for
        flash_attn_func, also for schedules fa1 / fa3 / decode forced on a paged call.
    """
    if block_table is not None:
        call = prepare_flash_attn_varlen_paged(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table=block_table,
            seqused_k=seqused_k, dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal,
            window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes, deterministic=deterministic,
            return_attn_probs=return_attn_probs, return_lse=return_lse, learnable_sink=learnable_sink)
        name, tiles = _dispatch.resolve(call.problem)
        backend = _dispatch.BACKENDS[name]
        out, lse = backend.paged_varlen_forward(call, backend.tiles_from_list(tiles))
        return (out.squeeze(0), lse.float().squeeze(0)) if return_lse else out.squeeze(0)
    _refuse_seqused_k(seqused_k)
    call = prepare_flash_attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                     dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal,
                                     window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                                     deterministic=deterministic, return_attn_probs=return_attn_probs,
                                     return_lse=return_lse, learnable_sink=learnable_sink)
    if return_attn_probs:
        out, lse, rng_state = attention(call, *_dispatch.resolve(call.problem), with_rng_state=True)
        probs = attention_probabilities(call, rng_state) if call.problem.dropout_p > 0 else None
        return out.squeeze(0), lse.squeeze(0), probs
    out, lse = attention(call, *_dispatch.resolve(call.problem))
    # squeeze, not [0]: a view whose backward is a view too (indexing's backward filled a zero tensor and copied the
    # gradient into it, 0.18 ms of a 16 ms packed fwd+bwd step on an H200)
    return (out.squeeze(0), lse.squeeze(0)) if return_lse else out.squeeze(0)


def _refuse_seqused_k(seqused_k) -> None:
    if seqused_k is not None:
        raise NotImplementedError("seqused_k is taken with block_table (paged K/V) only; without it, give each "
                                  "sequence's keys through cu_seqlens_k")


def flash_attn_with_kvcache(q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Tensor | None = None,
                            v: Tensor | None = None, rotary_cos: Tensor | None = None,
                            rotary_sin: Tensor | None = None, cache_seqlens: int | Tensor | None = None,
                            cache_batch_idx: Tensor | None = None, cache_leftpad: Tensor | None = None,
                            block_table: Tensor | None = None, softmax_scale: float | None = None,
                            causal: bool = False, window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                            rotary_interleaved: bool = True, alibi_slopes: Tensor | None = None,
                            num_splits: int = 0, return_softmax_lse: bool = False, *,
                            check_values: bool | None = None,
                            learnable_sink: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
    """Decoding and chunked prefill against a KV cache, with flash-attn's signature and argument order
    (forward only), so positional calls written for flash-attn mean the same here.

    Args:
        q: (batch, seqlen_q, nheads, headdim), seqlen_q >= 1: the newest tokens of each sequence
            (one for decoding; several for speculative decoding or chunked prefill).
        k_cache, v_cache: contiguous (batch_cache, capacity, nheads_k, headdim[_v]) (batch_cache = batch
            unless cache_batch_idx picks the rows), or paged (num_blocks, page_size, nheads_k, headdim[_v])
            with block_table; page_size a multiple of 16. Same dtype and device as q; written in place when
            k and v are given.
        k, v: optional (batch, seqlen_new, nheads_k, headdim[_v]) new tokens, written into the cache at
            positions cache_seqlens[b] .. cache_seqlens[b] + seqlen_new - 1 (through block_table when paged)
            before attention runs.
        rotary_cos, rotary_sin: both None, or both (seqlen_ro, rotary_dim / 2), float32 or q's dtype, on q's
            device: cos and sin of the rotary embedding's angles (row p: position p, column j: frequency j), with
            rotary_dim = 2 * rotary_cos.shape[1] <= headdim. Only with k and v (as in flash-attn): the first
            rotary_dim dims of q and of the new k (never v) are rotated before the new tokens are appended, so the
            cache stores rotated keys. Positions, as in flash-attn:

                new token t of sequence b:   cache_seqlens[b] + t
                query row i, causal or a window narrower than the cache:   cache_seqlens[b] + i
                query row i otherwise:   cache_seqlens[b]   (every row at one position)

            counted from the start of the cache row (cache_leftpad does not move them). The tables must reach
            every position used: seqlen_ro >= cache_seqlens[b] + max(seqlen_new, seqlen_q if the rows are
            shifted else 1) (flash-attn asks for seqlen_ro >= the capacity, which is always enough). The rotation
            runs before the attention kernel, in float32 (float64 for float64 q) rounded once to q's dtype, into new
            tensors and the cache: the caller's q and k are not modified. On the Triton backend one kernel rotates q
            and the new k and appends the new tokens; the torch backend uses torch ops (the same bits).
        cache_seqlens: int or int32 (batch,): where each sequence's cached tokens end (without
            cache_leftpad: how many there are); None means every cache is full (capacity tokens) and then
            k, v must be None. An int (or None) becomes a device tensor at every call; a decode loop that
            keeps a tensor avoids that allocation.
        cache_batch_idx: int32 (batch,) or None: sequence b uses row cache_batch_idx[b] of a contiguous
            cache (None: row b), for appending and attending; rows must be distinct when k and v are given.
        cache_leftpad: int32 (batch,) or None: sequence b's cached tokens start at position cache_leftpad[b]
            of its row (None: 0). Its keys are then positions cache_leftpad[b] .. cache_seqlens[b] + seqlen_new
            - 1, the new tokens still written from cache_seqlens[b]; 0 <= cache_leftpad[b] <= cache_seqlens[b].
            The padding is invisible: causal masks, windows and ALiBi count from the sequence's last key.
            cache_batch_idx and cache_leftpad take contiguous caches only (as in flash-attn).
        block_table: int32 (batch, max_blocks): sequence b's page i is block block_table[b, i] of the cache;
            capacity = max_blocks * page_size.
        rotary_interleaved: with rotary tables, True (the default, as in flash-attn) rotates the pairs of dims
            (2j, 2j + 1) (GPT-J style), False the pairs (j, j + rotary_dim / 2) (GPT-NeoX style); pair j turns by
            the angle of column j. Dims past rotary_dim pass through. A bool; unused without tables.
        softmax_scale, causal, window_size, softcap, alibi_slopes: as in `flash_attn_func`, with sequence
            b's keys being its cached tokens and the new ones: causal and windows are bottom-right aligned
            to the end of each sequence.
        num_splits: split each sequence's keys into this many chunks, attended by separate programs and
            merged exactly by their log-sum-exps (Flash-Decoding); 0 chooses: on the Triton backend, when
            batch x nheads_k cannot fill the GPU, enough splits for a few waves of programs (the tuned
            number per cache layout is in flashtile.triton.launch), on the torch backend 1 (splitting adds
            work and no parallelism there). Results agree across split counts up to rounding.
        return_softmax_lse: also return lse (batch, nheads, seqlen_q) float32.
        check_values: whether the capacity and block-table rules, which need the values of cache_seqlens
            and block_table, are checked (see Raises). None (default): where that is free, i.e. for an
            int cache_seqlens and for tensors on the CPU. True: also for tensors on a GPU, at the cost
            of a few device ops and one synchronisation per call. False: only for an int cache_seqlens.
        learnable_sink: (nheads,) or None, as in `flash_attn_func` (no gradient here). With num_splits > 1
            the splits attend their keys without it and it joins their merge once.

    Returns:
        out (batch, seqlen_q, nheads, headdim_v) in q's dtype, carrying no gradient; with
        return_softmax_lse=True, (out, lse). Rows that see no key get out 0 and lse -inf (with a sink: lse =
        the sink).

    Raises:
        TypeError / ValueError naming the argument and the rule, including a write past a cache's capacity,
        a block_table entry that is not a block of the cache, a cache_batch_idx entry that is not a row of the
        cache (or repeats one while appending), a cache_leftpad entry outside 0 .. cache_seqlens[b], and rotary
        tables that are not a pair of (seqlen_ro, rotary_dim / 2) tensors of one dtype with rotary_dim <= headdim,
        come without k and v, or do not reach the positions used; every check runs before anything is written,
        so a call that raises leaves the cache unchanged. The last four need the values of cache_seqlens,
        block_table, cache_batch_idx and cache_leftpad (the tables' length: of a tensor cache_seqlens) and run as
        check_values says. On a GPU they are by default the
        caller's guarantee (as in flash-attn), because reading the values back would stall every decode
        step; while a CUDA graph is captured or torch.compile traces they cannot run at all. When they
        are not checked and are broken, the result is undefined but memory stays safe: the kernel reads
        at most `capacity` keys and only blocks and rows of the cache, rotary positions past the tables read
        their last row, and an append outside the cache stops at torch's device-side index check (with rotary
        tables on the Triton backend, the kernel drops those tokens instead of writing them).
        BackendUnavailableError when the requested backend cannot serve the call.
    """
    call = prepare_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, block_table, softmax_scale=softmax_scale,
                           causal=causal, window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                           num_splits=num_splits, return_softmax_lse=return_softmax_lse, check_values=check_values,
                           cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad, rotary_cos=rotary_cos,
                           rotary_sin=rotary_sin, rotary_interleaved=rotary_interleaved,
                           learnable_sink=learnable_sink)
    name, tiles = _dispatch.resolve(call.problem, call.layout.resolutions)  # raises before the cache is touched
    backend = _dispatch.BACKENDS[name]
    backend.append(call)  # rotates q and k into new tensors or the cache when rotary tables are given
    out, lse = backend.decode(call, backend.tiles_from_list(tiles), call.num_splits)
    return (out, lse) if return_softmax_lse else out


def scaled_dot_product_attention(query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None = None,
                                 dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                                 enable_gqa: bool = False) -> Tensor:
    """Drop-in for `torch.nn.functional.scaled_dot_product_attention`, computed by flashtile.

    Args:
        query: (..., Hq, L, E); key: (..., Hk, S, E); value: (..., Hk, S, Ev), same leading dims,
            one floating dtype, one device. Hq == Hk unless enable_gqa=True (then Hq % Hk == 0).
        attn_mask: optional, broadcastable to (..., Hq, L, S): bool (True = attend, as in torch) or
            floating (added to the scores). Mutually exclusive with is_causal.
        dropout_p: attention dropout in [0, 1), as in torch (applied whenever > 0): flashtile's Philox keep-mask
            (see flash_attn_func), so the dropped entries differ from torch's own.
        is_causal: top-left aligned causal mask: query i attends keys j <= i.
        scale: multiplier of q.k; None means 1 / sqrt(E).
        enable_gqa: allow Hq to be a multiple of Hk.

    Returns:
        (..., Hq, L, Ev) in query's dtype. Unlike torch, a query row whose keys are all masked returns
        zeros (torch returns NaN there on some backends).

    Raises:
        TypeError / ValueError for invalid inputs (naming the argument and the rule),
        BackendUnavailableError as for flash_attn_func.
    """
    call, out_shape = prepare_sdpa(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                   is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
    out, _ = attention(call, *_dispatch.resolve(call.problem))
    return out.transpose(1, 2).reshape(out_shape)


class Explanation(str):
    """A readable account of what a call would run (a str; print it)."""


def explain(q: Tensor, k: Tensor, v: Tensor, /, *, api: str = "flash_attn_func", **kwargs: Any) -> Explanation:
    """Describe the backend, schedule (Triton backend: fa1, fa2, fa3, fa4 or decode), kernels and tiles a call with
    these arguments would run, and why.

    Takes the same arguments as `flash_attn_func` (or, with api="flash_attn_varlen_func",
    "flash_attn_with_kvcache" or "scaled_dot_product_attention", as that function; pass the extra
    arguments by keyword; for the KV cache, the three tensors are q and the caches, passed by position, and new
    tokens go as k=, v=).
    Computes nothing. If the call would raise, the description names the error instead of raising it.
    """
    try:
        if api not in _EXPLAINED:
            raise ValueError(f"api must be one of {', '.join(map(repr, _EXPLAINED))}, got {api!r}")
        options = _merge(api, _keyword_defaults(_EXPLAINED[api]), kwargs)
        if api == "flash_attn_func":
            call = prepare_flash_attn(q, k, v, **options)
        elif api == "flash_attn_varlen_func":
            block_table, seqused_k = options.pop("block_table"), options.pop("seqused_k")
            if block_table is not None:
                call = prepare_flash_attn_varlen_paged(q, k, v, block_table=block_table, seqused_k=seqused_k,
                                                       **options)
            else:
                _refuse_seqused_k(seqused_k)
                call = prepare_flash_attn_varlen(q, k, v, **options)
        elif api == "flash_attn_with_kvcache":
            call = prepare_kvcache(q, k, v, options.pop("k"), options.pop("v"), options.pop("cache_seqlens"),
                                   options.pop("block_table"), **options)
        else:
            call, _ = prepare_sdpa(q, k, v, **options)
        chosen = _dispatch.plan(call.problem)
    except (TypeError, ValueError, NotImplementedError, _dispatch.BackendUnavailableError) as error:
        return Explanation(f"this call would raise {type(error).__name__}: {error}")
    p = call.problem
    lines = [f"backend: {chosen.backend.describe_kernel(p, chosen.tiles)}", f"why: {chosen.reason}"]
    shape = (f"nheads {p.nheads} (nheads_k {p.nheads_k}), headdim {p.headdim}, headdim_v {p.headdim_v}, "
             f"{str(p.dtype).replace('torch.', '')} on {p.device}")
    if p.paged:
        lines += [
            f"problem: {p.batch} packed sequences (max_seqlen_q {p.seqlen_q}: a grid hint) against paged K/V "
            f"({call.page_size}-token pages, up to {call.capacity} keys per sequence through block_table), {shape}",
            f"scores: scale {p.softmax_scale:.6g}; {p.describe_masking()} (aligned to each sequence's last key)",
            f"tiles: {chosen.backend.describe_tiles(p, chosen.tiles)}",
        ]
    elif p.kvcache:
        layout = "contiguous" if call.block_table is None else f"paged, {call.page_size}-token pages"
        lines += [
            f"problem: batch {p.batch}, seqlen_q {p.seqlen_q}, KV cache of {call.capacity} tokens per sequence "
            f"({layout}), {shape}",
            f"scores: scale {p.softmax_scale:.6g}; {p.describe_masking()} (aligned to each sequence's last key)",
            f"schedule: {chosen.backend.describe_decode(call, chosen.tiles)}",
        ]
        if call.rotary_cos is not None:
            lay = call.layout
            pairs = "interleaved pairs (2j, 2j + 1)" if lay.rotary_interleaved else "halves (j, j + rotary_dim / 2)"
            how = ("kvcache_append_kernel: rotated and appended in one launch before the attention" if
                   chosen.backend.name == "triton" else "torch ops before the attention")
            lines.append(f"rotary: the first {lay.rotary_dim} of {p.headdim} dims of q and the new k, {pairs}, q's row "
                         f"i at {'cache_seqlens + i' if lay.rotary_shifted else 'cache_seqlens'}; {how} (float32, "
                         f"rounded once)")
    else:
        lines += [
            f"problem: {_describe_batch(p)}, {shape}",
            f"scores: scale {p.softmax_scale:.6g}; {p.describe_masking()}",
            f"tiles: {chosen.backend.describe_tiles(p, chosen.tiles)}",
            f"arithmetic: {str(p.accumulation_dtype).replace('torch.', '')} accumulation; backward recomputes "
            f"probabilities from the saved log-sum-exp (no seqlen_q x seqlen_k tensor is stored)",
        ]
    return Explanation("\n".join(lines))


def _describe_batch(p) -> str:
    if p.varlen:
        return (f"{p.batch} packed sequences (max_seqlen_q {p.seqlen_q}, max_seqlen_k {p.seqlen_k}: grid hints; "
                f"each sequence's work follows its own length)")
    return f"batch {p.batch}, seqlen_q {p.seqlen_q}, seqlen_k {p.seqlen_k}"


_EXPLAINED = {"flash_attn_func": flash_attn_func, "flash_attn_varlen_func": flash_attn_varlen_func,
              "flash_attn_with_kvcache": flash_attn_with_kvcache,
              "scaled_dot_product_attention": scaled_dot_product_attention}


def _keyword_defaults(function) -> dict:
    """The API's arguments after its three tensors, with their defaults (None where it has none)."""
    parameters = list(inspect.signature(function).parameters.values())[3:]
    return {p.name: None if p.default is inspect.Parameter.empty else p.default for p in parameters}


def _merge(api: str, defaults: dict, kwargs: dict) -> dict:
    unknown = sorted(set(kwargs) - set(defaults))
    if unknown:
        raise TypeError(f"{api} has no argument(s) {unknown}; it takes {sorted(defaults)}")
    return {**defaults, **kwargs}
