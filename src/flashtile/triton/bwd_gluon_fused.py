"""Attention backward in one Gluon kernel per key block: dK, dV and dQ from one S and one dP (FlashAttention-3's
dataflow), written in Gluon.

bwd_gluon.py's dK/dV kernel recomputes Sᵀ and dPᵀ per (key block, query block) and leaves dQ to bwd.py's dQ kernel,
which computes S and dP a second time. Here the consumer that has dSᵀ of its 64 keys against a query block also
forms that block's share of dQ and adds it into a float32 accumulator in global memory:

- the loads: bwd_gluon._producer unchanged (K and V of the CTA's 128 keys once, then Q and dO of every query block
  of every query head of the K/V head's group that sees them, through a ring of NUM_STAGES stages by TMA);
- two consumer warpgroups of 64 keys each, per query block: Sᵀ = K Qᵀ and dPᵀ = V dOᵀ (asynchronous wgmma), Pᵀ and
  dSᵀ in registers; dSᵀ (fp16 / bf16) is also stored in a shared tile of the consumer's own; then three matmuls are
  issued: dQᵀ = Kᵀ dSᵀ (both operands in shared memory, a fresh float32 accumulator), dV += Pᵀ dO and dK += dSᵀ Q
  (Pᵀ and dSᵀ from registers). The consumer waits for dQᵀ alone (`warpgroup_mma_wait(2)`; wgmma groups complete in
  issue order), writes it to a float32 shared tile and hands that tile to the copy engine, which adds it into the
  accumulator by a TMA reduce (`cp.reduce.async.bulk.tensor ... add`, gluon_compat.tma_reduce_add), while dV and dK
  still run. Each consumer has two such tiles: before writing one, it waits until at most one bulk operation of its
  own is in flight (`tma.store_wait(1)`), i.e. until the reduce issued two blocks before has read it;
- dK (times the softmax scale) and dV are stored by TMA from the K and V buffers as in bwd_gluon.py.

dQᵀ, not dQ: a warpgroup's wgmma has M = 64 rows, and the query blocks are 32 or 16 rows where a head is 128 wide
(configs.fused_gluon_backward_tile). dQᵀ of a block has as many rows as the head is wide (64 or 128) against the
block's query columns; so the accumulator is stored transposed, (batch, heads, headdim, seqlen_q rounded up to 4),
each query head's [headdim, BLOCK_M] box one block's dQᵀ (the copy engine clips rows past headdim and columns past
seqlen_q). Each of the two consumers adds its own 64 keys' share: two reduces per (key block, query block).
attention_bwd_dq_convert_kernel then writes dq = softmax_scale * accumulatorᵀ in the inputs' dtype and layout.

The additions into the accumulator arrive in the order the copy engine completes them, so dQ is not bitwise
reproducible from run to run (dK and dV are: their additions keep their order). Delta = rowsum(dO ∘ O) − dlse comes
from bwd.py's preprocess kernel, launched first; the accumulator is zeroed before.

What it serves is what bwd_gluon.py serves without its intra-warpgroup overlap (configs.gluon_backward_unserved_reason
with backward schedule 5): fp16 / bf16 dense batches, padded head widths 64 or 128 (q/k and v apart), causal and
windows with block skipping, GQA / MQA, ragged ends, a gradient through the lse. Not served (backward schedule 2 runs
them): dropout, softcap, ALiBi, attn_mask, packed batches, 256-wide heads, the intra-warpgroup overlap. Design notes
and the forms that were tried and spilled: docs/schedules.md (backward schedule 5).
"""

import triton
import triton.language as tl

from .bwd_gluon import (_column_statistics, _issue_transposed_scores, _key_block, _producer, _query_block,
                        _store_key_tile, _transposed_scores)
from .common import query_block_bounds
from .gluon_compat import (AVAILABLE, fence_async_shared, gl, gluon, mbarrier, thread_barrier, tma, tma_reduce_add,
                           tma_store, warpgroup_mma, warpgroup_mma_wait)

# the float32 dQᵀ tiles each consumer alternates between (one being read by the copy engine, one being written)
DQ_BUFFERS = 2


@triton.jit
def attention_bwd_dq_convert_kernel(DqAccum, Dq, stride_ab, stride_ah, stride_ad, stride_qb, stride_qm, stride_qh,
                                    nheads, seqlen_q, row_programs, sm_scale,
                                    HEADDIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """dq[b, m, h, :] = sm_scale * DqAccum[b, h, :, m] (the fused kernel's transposed float32 sums), in dq's dtype."""
    pid = tl.program_id(0)
    pid_m = pid % row_programs
    bh = pid // row_programs
    b = bh // nheads
    h = bh % nheads
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    ok = (offs_m[:, None] < seqlen_q) & (offs_d[None, :] < HEADDIM)
    acc = tl.load(DqAccum + b.to(tl.int64) * stride_ab + h.to(tl.int64) * stride_ah + offs_d[None, :] * stride_ad
                  + offs_m[:, None], mask=ok, other=0.0)
    tl.store(Dq + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh + offs_m[:, None].to(tl.int64) * stride_qm
             + offs_d[None, :], (acc * sm_scale).to(Dq.dtype.element_ty), mask=ok)


attention_bwd_fused_gluon_kernel = None  # without Gluon (configs.gluon_backward_unserved_reason then says so)

if AVAILABLE:
    _KEYS = gl.constexpr(64)
    _CONSUMERS = gl.constexpr(2)
    _DQ_BUFFERS = gl.constexpr(DQ_BUFFERS)

    @gluon.jit
    def _fused_query_block(k_tile, v_tile, q_block, do_block, ds_tile, dq_buffer, dq_desc, dq_coord, dk, dv, offs_k,
                           offs_q, row_base, stats, seqlen_q, seqlen_k, score_args, masked, st_layout: gl.constexpr,
                           pt_layout: gl.constexpr, dst_layout: gl.constexpr, HAS_LEFT: gl.constexpr,
                           HAS_RIGHT: gl.constexpr, SCALE_IN_EXP2: gl.constexpr):
        """One query block for one consumer: (dk, dv) with the block added, and the block's dQᵀ share (its 64 keys)
        handed to the copy engine from dq_buffer, a float32 [1, 1, BLOCK_D, BLOCK_M] box that no bulk operation still
        reads."""
        score_scale, softcap_scale, softcap_out, diagonal_offset, window_left, window_right = score_args
        dtype: gl.constexpr = q_block.dtype
        BLOCK_M: gl.constexpr = q_block.shape[0]
        BLOCK_D: gl.constexpr = q_block.shape[1]
        st, dpt = _issue_transposed_scores(k_tile, v_tile, q_block, do_block, st_layout)
        # the columns' statistics load under the matmuls
        lse2, delta = _column_statistics(stats, row_base, offs_q, seqlen_q)
        st, dpt = warpgroup_mma_wait(0, deps=[st, dpt])
        s = _transposed_scores(st, offs_k, offs_q, seqlen_q, seqlen_k, score_args, masked, HAS_LEFT, HAS_RIGHT,
                               SCALE_IN_EXP2)
        if SCALE_IN_EXP2:
            p = gl.exp2(s * score_scale - lse2[None, :])
        else:
            p = gl.exp2(s - lse2[None, :])
        ds = (p * (dpt - delta[None, :])).to(dtype)
        # dSᵀ in shared memory: the B operand of dQᵀ = Kᵀ dSᵀ (a wgmma's B is never in registers)
        ds_tile.store(ds)
        pt_op = gl.convert_layout(p.to(dtype), pt_layout)
        dst_op = gl.convert_layout(ds, dst_layout)
        fence_async_shared()
        thread_barrier()
        dqt = warpgroup_mma(k_tile.permute((1, 0)), ds_tile, gl.zeros([BLOCK_D, BLOCK_M], gl.float32,
                                                                       layout=st_layout),
                            use_acc=False, is_async=True)
        dv = warpgroup_mma(pt_op, do_block, dv, is_async=True)
        dk = warpgroup_mma(dst_op, q_block, dk, is_async=True)
        # dQᵀ alone (issued first, so complete first): its reduce runs under dV and dK
        dqt = warpgroup_mma_wait(2, deps=[dqt])
        dq_buffer.reshape([BLOCK_D, BLOCK_M]).store(dqt)
        fence_async_shared()
        thread_barrier()
        b, h, m0 = dq_coord
        tma_reduce_add(dq_desc, [b, h, 0, m0], dq_buffer)
        dv, dk = warpgroup_mma_wait(0, deps=[dv, dk])
        return dk, dv

    @gluon.jit
    def _fused_consumer(descs, dq_desc, smem, ds_smem, dq_smem, bars, sizes, score_args, stats, BLOCK_M: gl.constexpr,
                        NUM_STAGES: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
                        SCALE_IN_EXP2: gl.constexpr, WG: gl.constexpr):
        """Consumer warpgroup WG: dK and dV of keys [n0 + 64 WG, n0 + 64 WG + 64) of the CTA's block, and their share
        of every visited query block's dQ, added into the accumulator by TMA."""
        q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc = descs
        q_smem, k_smem, v_smem, do_smem = smem
        kv_ready, kv_empty, qdo_ready, qdo_empty = bars
        nheads_k, group_size, seqlen_q, seqlen_k, key_programs, tiles = sizes
        Lse, Delta, sm_scale, stride_lse_b, stride_lse_h = stats
        BLOCK_D: gl.constexpr = q_desc.block_type.shape[3]
        BLOCK_DV: gl.constexpr = do_desc.block_type.shape[3]
        dtype: gl.constexpr = q_desc.dtype
        st_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                            instr_shape=[16, BLOCK_M, 16])
        dk_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                            instr_shape=[16, BLOCK_D, 16])
        dv_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                            instr_shape=[16, BLOCK_DV, 16])
        pt_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dv_layout, k_width=2)
        dst_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dk_layout, k_width=2)
        key_layout: gl.constexpr = gl.SliceLayout(1, st_layout)
        query_layout: gl.constexpr = gl.SliceLayout(0, st_layout)
        k_tile = k_smem.index(WG).reshape([_KEYS, BLOCK_D])
        v_tile = v_smem.index(WG).reshape([_KEYS, BLOCK_DV])
        ds_tile = ds_smem.index(WG)
        it = 0
        tiles_done = 0
        for tile in range(gl.program_id(0), tiles, gl.num_programs(0)):
            n0, b, hk = _key_block(tile, key_programs, nheads_k)
            offs_k = n0 + WG * _KEYS + gl.arange(0, _KEYS, layout=key_layout)
            lo, full_lo, full_hi, hi = query_block_bounds(n0, seqlen_q, seqlen_k, score_args[3], score_args[4],
                                                          score_args[5], BLOCK_M, _CONSUMERS * _KEYS, HAS_LEFT,
                                                          HAS_RIGHT)
            dk = gl.zeros([_KEYS, BLOCK_D], gl.float32, layout=dk_layout)
            dv = gl.zeros([_KEYS, BLOCK_DV], gl.float32, layout=dv_layout)
            mbarrier.wait(kv_ready.index(WG), tiles_done & 1)
            for g in range(group_size):
                h = hk * group_size + g
                row_base = b.to(gl.int64) * stride_lse_b + h.to(gl.int64) * stride_lse_h
                for m0 in range(lo, hi, BLOCK_M):
                    stage = it % NUM_STAGES
                    mbarrier.wait(qdo_ready.index(stage), (it // NUM_STAGES) & 1)
                    q_block, do_block = _query_block(q_smem, do_smem, stage)
                    # this consumer's last bulk operation may still read its other dQᵀ tile; the one before it (which
                    # read this tile) is done. Every thread waits: only the thread that issued them has groups
                    tma.store_wait(_DQ_BUFFERS - 1)
                    thread_barrier()
                    dq_buffer = dq_smem.index(WG * _DQ_BUFFERS + it % _DQ_BUFFERS)
                    dk, dv = _fused_query_block(
                        k_tile, v_tile, q_block, do_block, ds_tile, dq_buffer, dq_desc, (b, h, m0), dk, dv, offs_k,
                        m0 + gl.arange(0, BLOCK_M, layout=query_layout), row_base, stats, seqlen_q, seqlen_k,
                        score_args, (m0 < full_lo) | (m0 >= full_hi), st_layout, pt_layout, dst_layout, HAS_LEFT,
                        HAS_RIGHT, SCALE_IN_EXP2)
                    # Q and dO are read (every matmul of the block is complete): release the stage (one thread
                    # arrives; a warpgroup's wgmma is one collective operation)
                    mbarrier.arrive(qdo_empty.index(stage), count=1)
                    it += 1
            _store_key_tile(dk, dv, k_smem, v_smem, dk_desc, dv_desc, kv_empty, b, hk, n0, sm_scale, WG)
            tiles_done += 1
        # the kernel's last reduces complete before it exits
        tma.store_wait(0)

    @gluon.jit
    def attention_bwd_fused_gluon_kernel(
        q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, dq_desc, Lse, Delta, stride_lse_b, stride_lse_h,
        nheads_k, group_size, seqlen_q, seqlen_k, key_programs, tiles,
        sm_scale, score_scale, softcap_scale, softcap_out, diagonal_offset, window_left, window_right,
        BLOCK_M: gl.constexpr, NUM_STAGES: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
        SCALE_IN_EXP2: gl.constexpr, CONSUMER_REGISTERS: gl.constexpr,
    ):
        # shared memory: bwd_gluon.py's (each consumer's K and V rows, then its dK / dV staging; the Q / dO ring), and
        # per consumer a dSᵀ tile and two float32 dQᵀ tiles
        BLOCK_D: gl.constexpr = q_desc.block_type.shape[3]
        k_smem = gl.allocate_shared_memory(k_desc.dtype, [_CONSUMERS] + k_desc.block_type.shape, k_desc.layout)
        v_smem = gl.allocate_shared_memory(v_desc.dtype, [_CONSUMERS] + v_desc.block_type.shape, v_desc.layout)
        q_smem = gl.allocate_shared_memory(q_desc.dtype, [NUM_STAGES] + q_desc.block_type.shape, q_desc.layout)
        do_smem = gl.allocate_shared_memory(do_desc.dtype, [NUM_STAGES] + do_desc.block_type.shape, do_desc.layout)
        ds_smem = gl.allocate_shared_memory(q_desc.dtype, [_CONSUMERS, _KEYS, BLOCK_M],
                                            gl.NVMMASharedLayout.get_default_for([_KEYS, BLOCK_M], q_desc.dtype))
        dq_smem = gl.allocate_shared_memory(gl.float32, [_CONSUMERS * _DQ_BUFFERS] + dq_desc.block_type.shape,
                                            dq_desc.layout)
        kv_ready = gl.allocate_shared_memory(gl.int64, [_CONSUMERS, 1], mbarrier.MBarrierLayout())
        kv_empty = gl.allocate_shared_memory(gl.int64, [_CONSUMERS, 1], mbarrier.MBarrierLayout())
        qdo_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        qdo_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(_CONSUMERS):
            mbarrier.init(kv_ready.index(i), count=1)
            mbarrier.init(kv_empty.index(i), count=1)
        for i in gl.static_range(NUM_STAGES):
            mbarrier.init(qdo_ready.index(i), count=1)
            mbarrier.init(qdo_empty.index(i), count=_CONSUMERS)  # both consumers release a stage
        descs = (q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc)
        smem = (q_smem, k_smem, v_smem, do_smem)
        bars = (kv_ready, kv_empty, qdo_ready, qdo_empty)
        sizes = (nheads_k, group_size, seqlen_q, seqlen_k, key_programs, tiles)
        score_args = (score_scale, softcap_scale, softcap_out, diagonal_offset, window_left, window_right)
        stats = (Lse, Delta, sm_scale, stride_lse_b, stride_lse_h)
        gl.warp_specialize([
            (_producer, (descs, smem, bars, sizes, score_args, BLOCK_M, NUM_STAGES, HAS_LEFT, HAS_RIGHT)),
            (_fused_consumer, (descs, dq_desc, smem, ds_smem, dq_smem, bars, sizes, score_args, stats, BLOCK_M,
                               NUM_STAGES, HAS_LEFT, HAS_RIGHT, SCALE_IN_EXP2, 0)),
            (_fused_consumer, (descs, dq_desc, smem, ds_smem, dq_smem, bars, sizes, score_args, stats, BLOCK_M,
                               NUM_STAGES, HAS_LEFT, HAS_RIGHT, SCALE_IN_EXP2, 1)),
        ], [4, 4], [CONSUMER_REGISTERS] * 2)
