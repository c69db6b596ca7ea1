"""Compile every Triton kernel for sm_90 (Hopper) on a machine without a GPU, and report what came out.

Run by tests/test_triton_compile.py in a subprocess (TRITON_INTERPRET must be off when the kernels are
defined). Prints one line per kernel variant: name, whether the PTX uses wgmma, TMA bulk copies and
warp-specialization register reallocation (setmaxnreg), and the shared memory used. Compiling with
the installed triton (not the GPU machine's) catches code-generation errors the interpreter cannot.
"""

import dataclasses
import json
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from flashtile.triton.bwd import (attention_bwd_dkdv_kernel, attention_bwd_dq_kernel, attention_bwd_kernel,
                                  attention_bwd_preprocess_kernel)
from flashtile.triton.decode import attention_decode_combine_kernel, attention_decode_kernel
from flashtile.triton.fwd import attention_fwd_kernel
from flashtile.triton.fwd_tma import attention_fwd_tma_kernel
from flashtile.triton.configs import default_tiles, fa4_tiles
from flashtile.triton.decode import default_decode_tile, page_chunk
from flashtile.triton.append import kvcache_append_kernel
from flashtile._validate import AttentionProblem

FLOATS = {"sm_scale", "score_scale", "softcap_scale", "softcap_out", "dropout_scale"}


def compile_variant(label, fn, constexprs, pointers, num_warps, num_stages, **options):
    # constexprs left out take their defaults (the fa4 schedule's RESCALE_THRESHOLD and EXP2_POLY_EVERY, 0 elsewhere)
    constexprs = dict({p.name: p.default for p in fn.params if p.is_constexpr and p.has_default}, **constexprs)
    signature = {}
    for name in fn.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in pointers:
            signature[name] = pointers[name]
        else:
            signature[name] = "fp32" if name in FLOATS else "i32"
    kernel = triton.compile(ASTSource(fn, signature, constexprs=constexprs), target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": num_warps, "num_stages": num_stages, **options})
    ptx = kernel.asm["ptx"]
    return {"label": label, "wgmma": "wgmma" in ptx, "mma": "mma.sync" in ptx, "tma": "cp.async.bulk.tensor" in ptx,
            "setmaxnreg": "setmaxnreg" in ptx, "fma": "fma.rn.f32" in ptx, "shared": kernel.metadata.shared}


def table_tiles(dtype: str, headdim: int, causal: bool = False, varlen: bool = False):
    """The tile table's sm_90 choice for a 4k-token call of this dtype and head dim (a packed batch with varlen)."""
    return default_tiles(table_problem(dtype, headdim, causal, varlen), (9, 0))


def table_problem(dtype: str, headdim: int, causal: bool = False, varlen: bool = False):
    """A 4k-token call of this dtype and head dim (a packed batch with varlen)."""
    import torch

    return AttentionProblem(batch=1, nheads=16, nheads_k=16, seqlen_q=4096, seqlen_k=4096, headdim=headdim,
                            headdim_v=headdim, dtype=getattr(torch, {"bf16": "bfloat16", "fp16": "float16",
                                                                     "fp32": "float32"}[dtype]),
                            device=torch.device("cpu"), softmax_scale=0.1, window_left=-1,
                            window_right=0 if causal else -1,
                            diagonal_offset=0, alignment="bottom-right", softcap=0.0, has_alibi=False,
                            mask_kind=None, varlen=varlen)


def main():
    results = []
    # fp32 at d = 32: the same kernels and tiles as at d = 64 (the table's d <= 64 row), but full-precision dots
    # unroll into FMAs in proportion to the head dim: 74 s of compiling against 204 s at d = 64 on the CI machine
    for dtype, headdim, causal in (("bf16", 128, True), ("bf16", 64, False), ("fp16", 72, True), ("fp32", 32, True)):
        ptr = "*" + dtype
        width = triton.next_power_of_2(headdim)
        flags = dict(HEADDIM=headdim, HEADDIM_V=headdim, BLOCK_D=width, BLOCK_DV=width, HAS_LEFT=False,
                     HAS_RIGHT=causal, HAS_SOFTCAP=not causal, HAS_ALIBI=causal, DOT_PRECISION="ieee",
                     SCALE_IN_EXP2=False)
        # the bf16 d128 causal variants of the TMA forward and the backward as the benchmarks run them: no ALiBi,
        # the scale inside exp2
        plain = dict(HAS_ALIBI=False, SCALE_IN_EXP2=True) if dtype == "bf16" and headdim == 128 else {}
        fwd_ptrs = {"Q": ptr, "K": ptr, "V": ptr, "Out": ptr, "Lse": "*fp32", "Slopes": "*fp32", "Sink": "*fp32",
                    "Mask": "*u8", "CuSeqlensQ": "*i32", "CuSeqlensK": "*i32", "BlockTable": "*i32", "SeqlensK": "*i32"}
        bwd_ptrs = {"Q": ptr, "K": ptr, "V": ptr, "dOut": ptr, "Out": ptr, "Lse": "*fp32", "Delta": "*fp32",
                    "dLse": "*fp32", "dK": ptr,
                    "dV": ptr, "dQ": ptr, "Slopes": "*fp32", "Mask": "*u8",
                    "CuSeqlensQ": "*i32", "CuSeqlensK": "*i32"}
        tag = f"{dtype} d{headdim} {'causal' if causal else 'full'}"
        # packed variable-length sequences in the bf16 d128 variants, dense batches elsewhere
        varlen = dtype == "bf16" and headdim == 128
        tag_varlen = tag + (" varlen" if varlen else "")
        results.append(compile_variant(f"fwd {tag_varlen}", attention_fwd_kernel,
                                       dict(flags, BLOCK_M=128, BLOCK_N=64, MASK_KIND=1 if dtype == "fp16" else 0,
                                            VARLEN=varlen, HAS_SINK=causal), fwd_ptrs, 8, 3))
        if varlen:
            # paged K/V (flash_attn_varlen_func with block_table) with 16-key pages: one table entry per key
            results.append(compile_variant(f"fwd {tag_varlen} paged", attention_fwd_kernel,
                                           dict(flags, BLOCK_M=128, BLOCK_N=64, MASK_KIND=0, VARLEN=True,
                                                HAS_SINK=causal, PAGED=True, PAGE_CHUNK=0), fwd_ptrs, 8, 3))
        # schedule 1 at the table's tiles (for bf16 d = 128 128-key blocks, the largest forward tile, with the
        # band); schedule 2 (opt-in) at its 128-row tiles, band on every tile
        forward = table_tiles(dtype, headdim, causal)
        for schedule, block_n, warps, stages in ((1, forward.block_n, forward.num_warps, forward.num_stages),
                                                 (2, 128, 4, 2)):
            # host-side descriptors: (batch, heads, rows, dim) views, one head's tile per box
            descriptors = {"q_desc": f"tensordesc<{dtype}[1,1,128,{width}]>",
                           "k_desc": f"tensordesc<{dtype}[1,1,{block_n},{width}]>",
                           "v_desc": f"tensordesc<{dtype}[1,1,{block_n},{width}]>"}
            # schedule 1 on packed sequences in the bf16 d128 variants (schedule 2 keeps to dense batches)
            packed = varlen and schedule == 1
            results.append(compile_variant(
                f"fwd-tma schedule {schedule} {tag}{' varlen' if packed else ''}", attention_fwd_tma_kernel,
                dict(flags, BLOCK_M=128, BLOCK_N=block_n, WARP_SPECIALIZE=schedule == 2, MASK_ALL=causal,
                     VARLEN=packed, SEPARATE_RAGGED_END=bool(forward.forward_separate_ragged_end), HAS_SINK=causal,
                     **plain),
                dict(descriptors, Q=ptr, Out=ptr, Lse="*fp32", Slopes="*fp32", Sink="*fp32", CuSeqlensQ="*i32",
                     CuSeqlensK="*i32"),
                warps, stages))
        if dtype == "bf16" and headdim == 128:
            # the fa4 schedule (FlashAttention-4's moves) at its tiles: the column split of its exponentials takes
            # shared memory, which its 2 stages leave room for (configs.fa4_tiles)
            fa4 = fa4_tiles(table_problem(dtype, headdim, causal), (9, 0))
            descriptors = {"q_desc": f"tensordesc<{dtype}[1,1,{fa4.block_m},{width}]>",
                           "k_desc": f"tensordesc<{dtype}[1,1,{fa4.block_n},{width}]>",
                           "v_desc": f"tensordesc<{dtype}[1,1,{fa4.block_n},{width}]>"}
            results.append(compile_variant(
                f"fwd-tma schedule 1 fa4 {tag}", attention_fwd_tma_kernel,
                dict(flags, BLOCK_M=fa4.block_m, BLOCK_N=fa4.block_n, WARP_SPECIALIZE=False, MASK_ALL=causal,
                     VARLEN=False, SEPARATE_RAGGED_END=bool(fa4.forward_separate_ragged_end),
                     RESCALE_THRESHOLD=fa4.rescale_threshold, EXP2_POLY_EVERY=fa4.exp2_poly_every, **plain),
                dict(descriptors, Q=ptr, Out=ptr, Lse="*fp32", Slopes="*fp32", Sink="*fp32", CuSeqlensQ="*i32",
                     CuSeqlensK="*i32"),
                fa4.num_warps, fa4.num_stages))
        results.append(compile_variant(f"bwd-preprocess {tag}", attention_bwd_preprocess_kernel,
                                       dict(HEADDIM_V=headdim, BLOCK_M=64, BLOCK_DV=width, HAS_DLSE=causal),
                                       {"Out": ptr, "dOut": ptr, "dLse": "*fp32", "Delta": "*fp32"}, 4, 1))
        # the backward at the table's tiles for this dtype and head dim (the packed table in the varlen variants);
        # the two-launch kernels with TMA loads where the table's schedule takes them (packed batches: in their
        # interior blocks), the one-launch kernel with TMA loads where the batch is dense
        t = table_tiles(dtype, headdim, varlen=varlen)
        two_launch_tma = t.backward_tma and not t.backward_one_launch
        m, n, warps, stages = t.bwd_block_m, t.bwd_block_n, t.bwd_num_warps, t.bwd_num_stages
        # the descriptor arguments: pointers (never read) without TMA, host-side 4-D views of bwd_block_m rows with it
        bwd_ptrs.update(q_desc=ptr, k_desc=ptr, v_desc=ptr, do_desc=ptr)
        bwd_tma_ptrs = dict(bwd_ptrs, **{name: f"tensordesc<{dtype}[1,1,{m},{width}]>"
                                         for name in ("q_desc", "k_desc", "v_desc", "do_desc")})
        results.append(compile_variant(f"bwd-dkdv{' tma' if two_launch_tma else ''} {tag_varlen}",
                                       attention_bwd_dkdv_kernel,
                                       dict(flags, BLOCK_M=m, BLOCK_N=n, MASK_KIND=0, VARLEN=varlen,
                                            USE_TMA=two_launch_tma),
                                       bwd_tma_ptrs if two_launch_tma else bwd_ptrs, warps, stages))
        # the dQ kernel at the table's dQ tile (its own where the table sets one, else the transposed tile),
        # with TMA loads of its key / value tiles where the table's two-launch schedule uses them
        dq_rows, dq_keys, dq_warps = t.dq_tile
        dq_tma = two_launch_tma
        dq_ptrs = dict(bwd_ptrs,
                       **{name: f"tensordesc<{dtype}[1,1,{dq_keys},{width}]>" for name in ("k_desc", "v_desc")},
                       **{name: f"tensordesc<{dtype}[1,1,{m},{width}]>" for name in ("q_desc", "do_desc")})
        dq_label = f"bwd-dq {dq_rows}x{dq_keys}w{dq_warps}{' tma' if dq_tma else ''} {tag_varlen}"
        results.append(compile_variant(dq_label, attention_bwd_dq_kernel,
                                       dict(flags, BLOCK_M=dq_rows, BLOCK_N=dq_keys,
                                            MASK_KIND=0 if varlen or dq_tma else 2, VARLEN=varlen, USE_TMA=dq_tma,
                                            HAS_DLSE=causal),
                                       dq_ptrs if dq_tma else bwd_ptrs, dq_warps, stages))
        # the one-launch kernel where the sm_90 table can take it (fp16 / bf16): fp32 keeps two launches there, and
        # its full-precision FMA form of this kernel took 123 s (at d = 64) of the 463 s this script ran on a CI-sized
        # machine
        if dtype != "fp32":
            one_launch_tma = not varlen
            results.append(compile_variant(f"bwd-one-launch{' tma' if one_launch_tma else ''} {tag_varlen}",
                                           attention_bwd_kernel,
                                           dict(flags, BLOCK_M=m, BLOCK_N=n, MASK_KIND=0, VARLEN=varlen,
                                                USE_TMA=one_launch_tma, **plain),
                                           bwd_tma_ptrs if one_launch_tma else bwd_ptrs, warps, stages))
        paged, split = dtype == "bf16", causal
        decode_flags = {key: value for key, value in flags.items() if key not in ("HEADDIM_V", "SCALE_IN_EXP2")}
        decode_ptrs = {"Q": ptr, "KCache": ptr, "VCache": ptr, "CacheSeqlens": "*i32", "BlockTable": "*i32",
                       "CacheBatchIdx": "*i32", "CacheLeftpad": "*i32", "Slopes": "*fp32", "Sink": "*fp32", "Out": ptr,
                       "Lse": "*fp32", "Part": "*fp32"}
        # paged bf16 with both page tiles (16-key blocks for pages of 16, 64-key blocks for pages of 256)
        for large_pages in (False, True) if paged and headdim == 128 else (False,):
            page_size = (256 if large_pages else 16) if paged else None
            decode_tile = default_decode_tile(page_size, split=split)
            pages = " large-pages" if large_pages else ""
            results.append(compile_variant(
                f"decode{' paged' if paged else ''}{pages}{' split' if split else ''} {tag}",
                attention_decode_kernel,
                dict(decode_flags, HEADDIM_V=headdim, BLOCK_M=16, BLOCK_N=decode_tile.block_n, PAGED=paged,
                     PAGE_CHUNK=page_chunk(decode_tile.block_n, page_size),
                     SPLIT=split, STORE_LSE=not split, HAS_BATCH_IDX=False, HAS_LEFTPAD=False, HAS_SINK=not split),
                decode_ptrs, decode_tile.num_warps, decode_tile.num_stages))
    # dropout (HAS_DROPOUT) in the TMA forward and the one-launch TMA backward, whose dQ and dK/dV loops hold the rest
    # of the dropout code (common.dropout_keep in every loop; the dK/dV loop's transposed mask), bf16 d = 64 causal
    flags = dict(HEADDIM=64, HEADDIM_V=64, BLOCK_D=64, BLOCK_DV=64, HAS_LEFT=False, HAS_RIGHT=True, HAS_SOFTCAP=False,
                 HAS_ALIBI=False, DOT_PRECISION="ieee", SCALE_IN_EXP2=True, HAS_DROPOUT=True)
    rng = {"RngState": "*i64"}
    box = {name: f"tensordesc<bf16[1,1,{rows},64]>" for name, rows in (("q_desc", 128), ("k_desc", 128),
                                                                           ("v_desc", 128))}
    # the forward with a learnable sink too (HAS_SINK beside HAS_DROPOUT: the sink starts the row state that the
    # dropped-out accumulation divides by)
    results.append(compile_variant(
        "fwd-tma schedule 1 dropout sink bf16 d64 causal", attention_fwd_tma_kernel,
        dict(flags, BLOCK_M=128, BLOCK_N=128, WARP_SPECIALIZE=False, MASK_ALL=True, VARLEN=False,
             SEPARATE_RAGGED_END=False, HAS_SINK=True),
        dict(box, Q="*bf16", Out="*bf16", Lse="*fp32", Slopes="*fp32", Sink="*fp32", CuSeqlensQ="*i32",
             CuSeqlensK="*i32", **rng),
        8, 2))
    # the table's forward tile for dropout at d = 128 (4k, causal): its Philox words beside a 128 x 128 score tile
    # take shared memory, which the table's stages must leave room for
    drop = default_tiles(dataclasses.replace(table_problem("bf16", 128, True), dropout_p=0.1), (9, 0))
    results.append(compile_variant(
        "fwd-tma schedule 1 dropout bf16 d128 causal (the table's tile)", attention_fwd_tma_kernel,
        dict(flags, HEADDIM=128, HEADDIM_V=128, BLOCK_D=128, BLOCK_DV=128, BLOCK_M=drop.block_m,
             BLOCK_N=drop.block_n, WARP_SPECIALIZE=False, MASK_ALL=True, VARLEN=False,
             SEPARATE_RAGGED_END=bool(drop.forward_separate_ragged_end), HAS_SINK=False),
        dict({name: f"tensordesc<bf16[1,1,{rows},128]>" for name, rows in (
            ("q_desc", drop.block_m), ("k_desc", drop.block_n), ("v_desc", drop.block_n))},
             Q="*bf16", Out="*bf16", Lse="*fp32", Slopes="*fp32", Sink="*fp32", CuSeqlensQ="*i32",
             CuSeqlensK="*i32", **rng),
        drop.num_warps, drop.num_stages))
    bwd_box = {**{name: "*bf16" for name in ("Q", "K", "V", "dOut", "dK", "dV", "dQ")},
               **{name: "*fp32" for name in ("Lse", "Delta", "Slopes")}, "Mask": "*u8", "CuSeqlensQ": "*i32",
               "CuSeqlensK": "*i32", **{name: "tensordesc<bf16[1,1,64,64]>" for name in ("q_desc", "k_desc",
                                                                                          "v_desc", "do_desc")},
               **rng}
    results.append(compile_variant("bwd-one-launch tma dropout bf16 d64 causal", attention_bwd_kernel,
                                   dict(flags, BLOCK_M=64, BLOCK_N=128, MASK_KIND=0, VARLEN=False, USE_TMA=True),
                                   bwd_box, 8, 2))
    results.append(compile_variant("decode-combine bf16 d128", attention_decode_combine_kernel,
                                   dict(HEADDIM_V=128, BLOCK_DV=128, BLOCK_S=16, STORE_LSE=True, HAS_SINK=True),
                                   {"Part": "*fp32", "Out": "*bf16", "Lse": "*fp32", "Sink": "*fp32"}, 4, 1))
    # the KV-cache append as launch.append_to_cache launches it, without FMA contraction: with rotary tables, a
    # decode step's bf16 d = 128 GQA heads into a paged cache with float32 tables, and fp16 d = 72 with a partial
    # interleaved rotation into a contiguous cache picked by cache_batch_idx; without tables (half 0), bf16 d = 128
    for dtype, headdim, half, interleaved, paged, table in (("bf16", 128, 64, False, True, "fp32"),
                                                            ("fp16", 72, 16, True, False, "fp16"),
                                                            ("bf16", 128, 0, False, False, "i32")):
        ptr = "*" + dtype
        results.append(compile_variant(
            (f"rotary-append {'interleaved' if interleaved else 'halves'}{' paged' if paged else ''} {dtype} "
             f"d{headdim}") if half else f"append {dtype} d{headdim}", kvcache_append_kernel,
            dict(HEADDIM=headdim, HEADDIM_V=headdim, ROTARY_HALF=half, INTERLEAVED=interleaved, ROTARY=half > 0,
                 Q_SHIFTED=half > 0, PAGED=paged, HAS_BATCH_IDX=not paged, BLOCK_H=32,
                 BLOCK_R=triton.next_power_of_2(max(1, half)),
                 BLOCK_P=triton.next_power_of_2(max(1, headdim - 2 * half)),
                 BLOCK_DV=triton.next_power_of_2(headdim)),
            {"Q": ptr, "KNew": ptr, "VNew": ptr, "Cos": "*" + table, "Sin": "*" + table, "CacheSeqlens": "*i32",
             "BlockTable": "*i32", "CacheBatchIdx": "*i32", "QOut": ptr, "KCache": ptr, "VCache": ptr},
            4, 1, enable_fp_fusion=False))
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    main()
