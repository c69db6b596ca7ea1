"""Attention backward, dK and dV with explicit warp roles (FlashAttention-3's schedule), written in Gluon.

The arithmetic of bwd.py's dK/dV programs (recompute P from the saved log-sum-exp, dV += Pᵀ dO, dP = dO Vᵀ,
dS = P ∘ (dP − delta), dK += dSᵀ Q, tiles transposed so that keys are rows), run by the roles of one CTA, each a
partition of `gl.warp_specialize`:

- the loads: the default partition (4 warps) loads the CTA's block of 128 keys of K and V once (each consumer's 64
  rows completing its own barrier), then streams, for every query head of the K/V head's group and every query block
  of BLOCK_M rows that sees the keys, Q and dO through a ring of NUM_STAGES shared-memory stages by TMA; a stage is
  refilled once both consumers have released it;
- two consumer warpgroups, each owning 64 of the block's keys and their dK and dV accumulators in registers. Per
  query block: Sᵀ = K Qᵀ and dPᵀ = V dOᵀ as asynchronous wgmma (every operand in shared memory), then Pᵀ and dSᵀ in
  registers, then dV += Pᵀ dO and dK += dSᵀ Q with Pᵀ and dSᵀ converted in registers to the wgmma's A operand.
  Once its query blocks are done a consumer stages dK (times the softmax scale) and dV in its K and V buffers and
  stores them by TMA.
- OVERLAP (intra-warpgroup overlap, opt-in: gluon_backward_overlap): a consumer issues Sᵀ and dPᵀ of query block
  j + 1 before dV and dK of block j and waits for the two score matmuls alone (`warpgroup_mma_wait(2)`), so that
  block j + 1's Pᵀ and dSᵀ are formed under block j's dV and dK; block j's Q / dO stage is released once those are
  complete (a consumer holds two stages, so the ring has three). The query blocks of all the group's heads form
  one sequence, with the first block alone before it and the last block's dV and dK after it. The additions into
  dK and dV keep their order. Not served with 128-wide heads and a band, where it spills.
dQ and delta come from bwd.py's dQ kernel, which runs first (backward schedule 4: every gradient bitwise
reproducible).

Tiles are key blocks of each (batch entry, K/V head), a head's blocks consecutive; with a band closing on the right
(causal) the first blocks see the most query rows, so the order is longest first. A CTA takes every
gl.num_programs(0)-th tile (the launcher gives one CTA per tile).

Descriptors: Q, K, V, dO, dK and dV are host-side 4-D (batch, heads, rows, dim) views of the (batch, rows, heads,
dim) tensors whose [1, 1, rows, width] box is one head's tile: the copy engine zero-fills rows past a sequence's
end (their queries have lse +inf and their keys are masked, so they contribute nothing) and clips the stores there.

What it serves: fp16 / bf16, dense batches, head dims whose padded widths are 64 or 128 (q/k and v apart), causal
(bottom-right) and sliding windows with block skipping, GQA/MQA summed over the group in registers, a gradient
through the lse (in delta). Softcap and ALiBi (whose extra tiles spill its registers) and everything else run
bwd.py's kernels (configs.gluon_backward_unserved_reason).
"""

from .common import band_mask, query_block_bounds
from .gluon_compat import (AVAILABLE, fence_async_shared, gl, gluon, mbarrier, thread_barrier, tma, tma_load,
                           tma_store, warpgroup_mma, warpgroup_mma_wait)

# key rows per consumer warpgroup (one wgmma's M is 64 for a warpgroup of 4 warps); a CTA's key block is two of them
WARPGROUP_KEYS = 64
CONSUMERS = 2

attention_bwd_dkdv_gluon_kernel = None  # without Gluon (configs.gluon_backward_unserved_reason then says so)

if AVAILABLE:
    _KEYS = gl.constexpr(WARPGROUP_KEYS)
    _CONSUMERS = gl.constexpr(CONSUMERS)

    @gluon.jit
    def _key_block(tile, key_programs, nheads_k):
        """(first key, batch entry, K/V head) of tile number `tile`: a head's key blocks consecutive, from its first
        (with a band closing on the right, the one that the most query rows see)."""
        bh = tile // key_programs
        return (tile % key_programs) * (_CONSUMERS * _KEYS), bh // nheads_k, bh % nheads_k

    @gluon.jit
    def _producer(descs, smem, bars, sizes, score_args, BLOCK_M: gl.constexpr, NUM_STAGES: gl.constexpr,
                  HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr):
        """The load warps: the CTA's K and V rows once, then Q and dO of every query block that sees them."""
        q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc = descs
        q_smem, k_smem, v_smem, do_smem = smem
        kv_ready, kv_empty, qdo_ready, qdo_empty = bars
        nheads_k, group_size, seqlen_q, seqlen_k, key_programs, tiles = sizes
        score_scale, softcap_scale, softcap_out, diagonal_offset, window_left, window_right = score_args
        it = 0
        tiles_done = 0
        for tile in range(gl.program_id(0), tiles, gl.num_programs(0)):
            n0, b, hk = _key_block(tile, key_programs, nheads_k)
            for w in gl.static_range(_CONSUMERS):
                # the consumer has stored the previous tile's dK and dV from these buffers
                mbarrier.wait(kv_empty.index(w), (tiles_done & 1) ^ 1)
                mbarrier.expect(kv_ready.index(w), k_desc.block_type.nbytes + v_desc.block_type.nbytes)
                tma_load(k_desc, [b, hk, n0 + w * _KEYS, 0], kv_ready.index(w), k_smem.index(w))
                tma_load(v_desc, [b, hk, n0 + w * _KEYS, 0], kv_ready.index(w), v_smem.index(w))
            lo, full_lo, full_hi, hi = query_block_bounds(n0, seqlen_q, seqlen_k, diagonal_offset, window_left,
                                                          window_right, BLOCK_M, _CONSUMERS * _KEYS, HAS_LEFT,
                                                          HAS_RIGHT)
            for g in range(group_size):
                h = hk * group_size + g
                for m0 in range(lo, hi, BLOCK_M):
                    stage = it % NUM_STAGES
                    mbarrier.wait(qdo_empty.index(stage), ((it // NUM_STAGES) & 1) ^ 1)
                    mbarrier.expect(qdo_ready.index(stage), q_desc.block_type.nbytes + do_desc.block_type.nbytes)
                    tma_load(q_desc, [b, h, m0, 0], qdo_ready.index(stage), q_smem.index(stage))
                    tma_load(do_desc, [b, h, m0, 0], qdo_ready.index(stage), do_smem.index(stage))
                    it += 1
            tiles_done += 1

    @gluon.jit
    def _transposed_scores(qk, offs_k, offs_q, seqlen_q, seqlen_k, score_args, masked, HAS_LEFT: gl.constexpr,
                           HAS_RIGHT: gl.constexpr, SCALE_IN_EXP2: gl.constexpr):
        """The scores of a transposed tile (keys as rows) from its raw products, as common.scores: base 2, or with
        SCALE_IN_EXP2 the unscaled products; -inf outside the band and past either end where `masked` (a runtime
        flag: only the band's edge blocks and the ragged ends pay for the mask)."""
        score_scale, softcap_scale, softcap_out, diagonal_offset, window_left, window_right = score_args
        if SCALE_IN_EXP2:
            s = qk
        else:
            s = qk * score_scale
        if masked:
            s = band_mask(s, offs_q[None, :], offs_k[:, None], seqlen_q, seqlen_k, diagonal_offset, window_left,
                          window_right, HAS_LEFT, HAS_RIGHT)
        return s

    @gluon.jit
    def _issue_transposed_scores(k_tile, v_tile, q_block, do_block, st_layout: gl.constexpr):
        """Sᵀ = K Qᵀ and dPᵀ = V dOᵀ of one query block as asynchronous wgmma (every operand in shared memory), in
        that order: two groups in flight."""
        KEYS: gl.constexpr = k_tile.shape[0]
        BLOCK_M: gl.constexpr = q_block.shape[0]
        st = warpgroup_mma(k_tile, q_block.permute((1, 0)), gl.zeros([KEYS, BLOCK_M], gl.float32, layout=st_layout),
                           use_acc=False, is_async=True)
        dpt = warpgroup_mma(v_tile, do_block.permute((1, 0)),
                            gl.zeros([KEYS, BLOCK_M], gl.float32, layout=st_layout), use_acc=False, is_async=True)
        return st, dpt

    @gluon.jit
    def _column_statistics(stats, row_base, offs_q, seqlen_q):
        """lse (base 2) and delta of a query block's rows, the columns of its transposed tiles. Rows past the queries
        read lse +inf, so that P = exp2(s - lse) = 0 there, as for rows that saw no key (lse -inf)."""
        Lse, Delta, sm_scale, stride_lse_b, stride_lse_h = stats
        in_rows = offs_q < seqlen_q
        lse = gl.load(Lse + row_base + offs_q, mask=in_rows, other=float("-inf"))
        lse2 = gl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
        delta = gl.load(Delta + row_base + offs_q, mask=in_rows, other=0.0)
        return lse2, delta

    @gluon.jit
    def _gradient_operands(st, dpt, lse2, delta, offs_k, offs_q, seqlen_q, seqlen_k, score_args, masked,
                           dtype: gl.constexpr, pt_layout: gl.constexpr, dst_layout: gl.constexpr,
                           HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, SCALE_IN_EXP2: gl.constexpr):
        """Pᵀ and dSᵀ = Pᵀ ∘ (dPᵀ − delta) of one query block, converted in registers to the A operands of
        dV += Pᵀ dO and dK += dSᵀ Q."""
        score_scale, softcap_scale, softcap_out, diagonal_offset, window_left, window_right = score_args
        s = _transposed_scores(st, offs_k, offs_q, seqlen_q, seqlen_k, score_args, masked, HAS_LEFT, HAS_RIGHT,
                               SCALE_IN_EXP2)
        if SCALE_IN_EXP2:
            p = gl.exp2(s * score_scale - lse2[None, :])
        else:
            p = gl.exp2(s - lse2[None, :])
        ds = p * (dpt - delta[None, :])
        return gl.convert_layout(p.to(dtype), pt_layout), gl.convert_layout(ds.to(dtype), dst_layout)

    @gluon.jit
    def _query_block(q_smem, do_smem, stage):
        """Q and dO of ring stage `stage` as 2-D tiles."""
        BLOCK_M: gl.constexpr = q_smem.shape[3]
        q_block = q_smem.index(stage).reshape([BLOCK_M, q_smem.shape[4]])
        do_block = do_smem.index(stage).reshape([BLOCK_M, do_smem.shape[4]])
        return q_block, do_block

    @gluon.jit
    def _first_query_block(k_tile, v_tile, q_smem, do_smem, qdo_ready, it, offs_k, offs_q, row_base, stats, seqlen_q,
                           seqlen_k, score_args, masked, st_layout: gl.constexpr, pt_layout: gl.constexpr,
                           dst_layout: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
                           SCALE_IN_EXP2: gl.constexpr):
        """OVERLAP: Pᵀ and dSᵀ (as A operands) of the `it`-th query block alone, the first of a tile; its stage stays
        held for its dV and dK, which the next block (_overlapped_query_block) or _last_gradients issues."""
        NUM_STAGES: gl.constexpr = q_smem.shape[0]
        stage = it % NUM_STAGES
        mbarrier.wait(qdo_ready.index(stage), (it // NUM_STAGES) & 1)
        q_block, do_block = _query_block(q_smem, do_smem, stage)
        st, dpt = _issue_transposed_scores(k_tile, v_tile, q_block, do_block, st_layout)
        lse2, delta = _column_statistics(stats, row_base, offs_q, seqlen_q)
        st, dpt = warpgroup_mma_wait(0, deps=[st, dpt])
        return _gradient_operands(st, dpt, lse2, delta, offs_k, offs_q, seqlen_q, seqlen_k, score_args, masked,
                                  q_smem.dtype, pt_layout, dst_layout, HAS_LEFT, HAS_RIGHT, SCALE_IN_EXP2)

    @gluon.jit
    def _overlapped_query_block(k_tile, v_tile, q_smem, do_smem, qdo_ready, qdo_empty, it, pt_op, dst_op, dk, dv,
                                offs_k, offs_q, row_base, stats, seqlen_q, seqlen_k, score_args, masked,
                                st_layout: gl.constexpr, pt_layout: gl.constexpr, dst_layout: gl.constexpr,
                                HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, SCALE_IN_EXP2: gl.constexpr):
        """OVERLAP: Sᵀ and dPᵀ of the `it`-th query block issued before dV += Pᵀ dO and dK += dSᵀ Q of block it - 1
        (pt_op, dst_op; Q and dO of its stage, still held), the new block's Pᵀ and dSᵀ formed under those two
        matmuls: (its A operands, dk, dv) once both are done and block it - 1's stage released."""
        NUM_STAGES: gl.constexpr = q_smem.shape[0]
        stage = it % NUM_STAGES
        prev_stage = (it - 1) % NUM_STAGES
        mbarrier.wait(qdo_ready.index(stage), (it // NUM_STAGES) & 1)
        q_block, do_block = _query_block(q_smem, do_smem, stage)
        prev_q, prev_do = _query_block(q_smem, do_smem, prev_stage)
        st, dpt = _issue_transposed_scores(k_tile, v_tile, q_block, do_block, st_layout)
        dv = warpgroup_mma(pt_op, prev_do, dv, is_async=True)
        dk = warpgroup_mma(dst_op, prev_q, dk, is_async=True)
        lse2, delta = _column_statistics(stats, row_base, offs_q, seqlen_q)
        # the two score matmuls alone (wgmma groups complete in issue order): the previous block's dV and dK keep
        # running under this block's exponentials. Their register operands are not passed through the waits, as in
        # fwd_gluon.py: ptxas tracks the registers of an in-flight wgmma itself
        st, dpt = warpgroup_mma_wait(2, deps=[st, dpt])
        pt_op, dst_op = _gradient_operands(st, dpt, lse2, delta, offs_k, offs_q, seqlen_q, seqlen_k, score_args,
                                           masked, q_smem.dtype, pt_layout, dst_layout, HAS_LEFT, HAS_RIGHT,
                                           SCALE_IN_EXP2)
        dv, dk = warpgroup_mma_wait(0, deps=[dv, dk])
        # block it - 1's Q and dO are read: release its stage (one thread arrives for the warpgroup)
        mbarrier.arrive(qdo_empty.index(prev_stage), count=1)
        return pt_op, dst_op, dk, dv

    @gluon.jit
    def _last_gradients(pt_op, dst_op, dk, dv, q_smem, do_smem, qdo_empty, it):
        """OVERLAP: dV and dK of the tile's last query block (the `it`-th), then its stage released."""
        NUM_STAGES: gl.constexpr = q_smem.shape[0]
        stage = it % NUM_STAGES
        q_block, do_block = _query_block(q_smem, do_smem, stage)
        dv = warpgroup_mma(pt_op, do_block, dv, is_async=True)
        dk = warpgroup_mma(dst_op, q_block, dk, is_async=True)
        dv, dk = warpgroup_mma_wait(0, deps=[dv, dk])
        mbarrier.arrive(qdo_empty.index(stage), count=1)
        return dk, dv

    @gluon.jit
    def _store_key_tile(dk, dv, k_smem, v_smem, dk_desc, dv_desc, kv_empty, b, hk, n0, sm_scale, WG: gl.constexpr):
        """Consumer WG's end of a key tile: dK (times sm_scale) and dV staged in its K and V rows, which no wgmma reads
        any more, stored by TMA at keys n0 + 64 WG of K/V head hk; once the stores have read them, the rows are
        released to the producer for the next tile."""
        BLOCK_D: gl.constexpr = k_smem.shape[4]
        BLOCK_DV: gl.constexpr = v_smem.shape[4]
        k_smem.index(WG).reshape([_KEYS, BLOCK_D]).store((dk * sm_scale).to(k_smem.dtype))
        v_smem.index(WG).reshape([_KEYS, BLOCK_DV]).store(dv.to(v_smem.dtype))
        fence_async_shared()
        thread_barrier()
        tma_store(dk_desc, [b, hk, n0 + WG * _KEYS, 0], k_smem.index(WG))
        tma_store(dv_desc, [b, hk, n0 + WG * _KEYS, 0], v_smem.index(WG))
        tma.store_wait(0)
        thread_barrier()
        mbarrier.arrive(kv_empty.index(WG), count=1)

    @gluon.jit
    def _consumer(descs, smem, bars, sizes, score_args, stats, BLOCK_M: gl.constexpr, NUM_STAGES: gl.constexpr,
                  HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, SCALE_IN_EXP2: gl.constexpr,
                  OVERLAP: gl.constexpr, WG: gl.constexpr):
        """Consumer warpgroup WG: dK and dV of keys [n0 + 64 WG, n0 + 64 WG + 64) of the CTA's block."""
        q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc = descs
        q_smem, k_smem, v_smem, do_smem = smem
        kv_ready, kv_empty, qdo_ready, qdo_empty = bars
        nheads_k, group_size, seqlen_q, seqlen_k, key_programs, tiles = sizes
        score_scale, softcap_scale, softcap_out, diagonal_offset, window_left, window_right = score_args
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
        it = 0
        tiles_done = 0
        for tile in range(gl.program_id(0), tiles, gl.num_programs(0)):
            n0, b, hk = _key_block(tile, key_programs, nheads_k)
            offs_k = n0 + WG * _KEYS + gl.arange(0, _KEYS, layout=key_layout)
            lo, full_lo, full_hi, hi = query_block_bounds(n0, seqlen_q, seqlen_k, diagonal_offset, window_left,
                                                          window_right, BLOCK_M, _CONSUMERS * _KEYS, HAS_LEFT,
                                                          HAS_RIGHT)
            dk = gl.zeros([_KEYS, BLOCK_D], gl.float32, layout=dk_layout)
            dv = gl.zeros([_KEYS, BLOCK_DV], gl.float32, layout=dv_layout)
            mbarrier.wait(kv_ready.index(WG), tiles_done & 1)
            if OVERLAP:
                # the tile's query blocks of every query head of the group as one sequence (the producer's order),
                # so that the pipeline runs on across heads: the first block alone, then each block's score matmuls
                # issued before the previous block's dV and dK, then the last block's dV and dK
                blocks = (hi - lo + BLOCK_M - 1) // BLOCK_M
                if blocks > 0:
                    row_base = b.to(gl.int64) * stride_lse_b + (hk * group_size).to(gl.int64) * stride_lse_h
                    pt_op, dst_op = _first_query_block(
                        k_tile, v_tile, q_smem, do_smem, qdo_ready, it, offs_k,
                        lo + gl.arange(0, BLOCK_M, layout=query_layout), row_base, stats, seqlen_q, seqlen_k,
                        score_args, (lo < full_lo) | (lo >= full_hi), st_layout, pt_layout, dst_layout, HAS_LEFT,
                        HAS_RIGHT, SCALE_IN_EXP2)
                    it += 1
                    for step in range(1, group_size * blocks):
                        g = step // blocks
                        m0 = lo + (step - g * blocks) * BLOCK_M
                        row_base = b.to(gl.int64) * stride_lse_b + (hk * group_size + g).to(gl.int64) * stride_lse_h
                        pt_op, dst_op, dk, dv = _overlapped_query_block(
                            k_tile, v_tile, q_smem, do_smem, qdo_ready, qdo_empty, it, pt_op, dst_op, dk, dv, offs_k,
                            m0 + gl.arange(0, BLOCK_M, layout=query_layout), row_base, stats, seqlen_q, seqlen_k,
                            score_args, (m0 < full_lo) | (m0 >= full_hi), st_layout, pt_layout, dst_layout, HAS_LEFT,
                            HAS_RIGHT, SCALE_IN_EXP2)
                        it += 1
                    dk, dv = _last_gradients(pt_op, dst_op, dk, dv, q_smem, do_smem, qdo_empty, it - 1)
            else:
                for g in range(group_size):
                    h = hk * group_size + g
                    row_base = b.to(gl.int64) * stride_lse_b + h.to(gl.int64) * stride_lse_h
                    for m0 in range(lo, hi, BLOCK_M):
                        stage = it % NUM_STAGES
                        offs_q = m0 + gl.arange(0, BLOCK_M, layout=query_layout)
                        mbarrier.wait(qdo_ready.index(stage), (it // NUM_STAGES) & 1)
                        q_block, do_block = _query_block(q_smem, do_smem, stage)
                        st, dpt = _issue_transposed_scores(k_tile, v_tile, q_block, do_block, st_layout)
                        # the columns' statistics load under the matmuls
                        lse2, delta = _column_statistics(stats, row_base, offs_q, seqlen_q)
                        st, dpt = warpgroup_mma_wait(0, deps=[st, dpt])
                        pt_op, dst_op = _gradient_operands(st, dpt, lse2, delta, offs_k, offs_q, seqlen_q, seqlen_k,
                                                           score_args, (m0 < full_lo) | (m0 >= full_hi), dtype,
                                                           pt_layout, dst_layout, HAS_LEFT, HAS_RIGHT, SCALE_IN_EXP2)
                        dv = warpgroup_mma(pt_op, do_block, dv, is_async=True)
                        dk = warpgroup_mma(dst_op, q_block, dk, is_async=True)
                        dv, dk = warpgroup_mma_wait(0, deps=[dv, dk])
                        # Q and dO are read: release the stage (one thread arrives; a warpgroup's wgmma is one
                        # collective operation)
                        mbarrier.arrive(qdo_empty.index(stage), count=1)
                        it += 1
            _store_key_tile(dk, dv, k_smem, v_smem, dk_desc, dv_desc, kv_empty, b, hk, n0, sm_scale, WG)
            tiles_done += 1
        tma.store_wait(0)

    @gluon.jit
    def attention_bwd_dkdv_gluon_kernel(
        q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, Lse, Delta, stride_lse_b, stride_lse_h,
        nheads_k, group_size, seqlen_q, seqlen_k, key_programs, tiles,
        sm_scale, score_scale, softcap_scale, softcap_out, diagonal_offset, window_left, window_right,
        BLOCK_M: gl.constexpr, NUM_STAGES: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
        SCALE_IN_EXP2: gl.constexpr, OVERLAP: gl.constexpr, CONSUMER_REGISTERS: gl.constexpr,
    ):
        # shared memory: each consumer's K and V rows (then its dK / dV staging), the Q / dO ring
        k_smem = gl.allocate_shared_memory(k_desc.dtype, [_CONSUMERS] + k_desc.block_type.shape, k_desc.layout)
        v_smem = gl.allocate_shared_memory(v_desc.dtype, [_CONSUMERS] + v_desc.block_type.shape, v_desc.layout)
        q_smem = gl.allocate_shared_memory(q_desc.dtype, [NUM_STAGES] + q_desc.block_type.shape, q_desc.layout)
        do_smem = gl.allocate_shared_memory(do_desc.dtype, [NUM_STAGES] + do_desc.block_type.shape, do_desc.layout)
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
        # as in fwd_gluon.py: the loads are the default partition (it calls no helper on distributed tensors), the
        # constexprs go in the partitions' argument lists themselves
        gl.warp_specialize([
            (_producer, (descs, smem, bars, sizes, score_args, BLOCK_M, NUM_STAGES, HAS_LEFT, HAS_RIGHT)),
            (_consumer, (descs, smem, bars, sizes, score_args, stats, BLOCK_M, NUM_STAGES, HAS_LEFT, HAS_RIGHT,
                         SCALE_IN_EXP2, OVERLAP, 0)),
            (_consumer, (descs, smem, bars, sizes, score_args, stats, BLOCK_M, NUM_STAGES, HAS_LEFT, HAS_RIGHT,
                         SCALE_IN_EXP2, OVERLAP, 1)),
        ], [4, 4], [CONSUMER_REGISTERS] * 2)
