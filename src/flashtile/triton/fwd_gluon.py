"""Attention forward, Hopper schedule with explicit warp roles (FlashAttention-3's), written in Gluon.

The same algorithm as fwd.py (online softmax in base 2, one normalisation at the end, the log-sum-exp kept per
row), run by the roles of one CTA, each a partition of `gl.warp_specialize`:

- the loads: the default partition (4 warps, 24 registers a thread after `setmaxnreg`, 32 with three consumers)
  loads each tile's query rows once and streams K and V blocks through a ring of NUM_STAGES shared-memory stages
  with TMA, each copy completing a "ready" mbarrier; it refills a K (or V) stage once every consumer has released
  it ("empty"): K after its score matmul, V after its P V;
- BLOCK_M / 64 consumer warpgroups (two, three for 192-row tiles, or one with two CTAs per SM; workers of 4 warps,
  CONSUMER_REGISTERS each through `setmaxnreg`), each owning 64 of the tile's query rows. Each issues S = Q Kᵀ as
  an asynchronous wgmma (Q and K from shared memory), runs the online softmax on S in registers, and issues
  O += P V with P converted in registers to the wgmma's A operand (no round trip through shared memory), then
  normalises once and stores its rows by TMA (staged in its query rows' buffer with SHARE_QO, where a buffer of
  its own would not fit).
- OVERLAP (intra-warpgroup overlap): a consumer issues Q Kᵀ of block j + 1 before the P V of block j and waits for
  the score matmul alone (`warpgroup_mma_wait(1)`), so its softmax of block j + 1 runs under its P V of block j;
  the accumulator's rescale waits for that P V.
- ACROSS_TILES (with OVERLAP; dense calls without a left band edge or ALiBi whose every row sees a key, so without a
  band or causal with seqlen_q <= seqlen_k): the same across tiles: a consumer issues the
  next tile's first Q Kᵀ before its tile's last P V and runs that block's softmax under it, the query rows of
  consecutive tiles in two buffers taken in turn. Every tile sees a key there, so every tile's first block is done
  before the tile (the CTA's first before the tile loop) and the loop carries P without a branch on it.
- EXP2_EMULATED = n (FlashAttention-4's offload of the exponentials; the fa4 schedule, or opt-in): one probability
  in n is computed on the FMA units by a cubic in the fraction of its exponent (_exp2_on_fma_units) instead of by
  the MUFU unit.
- RESCALE_THRESHOLD = t > 0 (FlashAttention-4's conditional rescaling; the fa4 schedule): a row keeps its running
  max while a block raises it by at most t (base 2), so its probabilities stay below 2^t and alpha is 1; out and
  lse use the max that was kept, so the result is exact up to rounding. Every consumer still multiplies its
  accumulator by alpha (a select per row): skipping the multiply would need a branch on a reduction across the
  warpgroup's four warps per key block.
- HALF_DIAGONAL (with OVERLAP; dense batches, 128-row tiles against blocks of 128 keys, a band closing at the
  diagonal, its offset a multiple of 128 that crosses every tile's keys): the first consumer, whose rows see only
  the first half of a tile's last key block (its causal diagonal block), takes that block's Q Kᵀ, softmax and P V
  on its first half (N = BLOCK_N / 2 wgmma and a K / V slice), where the block is not the tile's first. A
  constexpr choice for that consumer (the second sees the whole block). At 1k causal keys it halves 7 of a head's
  72 consumer block steps: 4.9% of the matmuls and exponentials.
- PINGPONG (two consumers): they take turns through a pair of mbarriers: one issues its matmuls only on its turn
  and passes the turn on once they are issued, so one warpgroup's exponentials run under the other's matmuls.

The grid is min(#SMs, tiles) CTAs for a persistent launch, or one CTA per tile. A CTA takes one tile per wave of
gl.num_programs(0) tiles, waves dealt in alternating directions (_tile_number), or with TILE_LIST the tiles the
launcher dealt it; all roles walk the same sequence. With a band that closes on the right (causal), and in packed
batches, the tiles are ordered longest first (last query blocks first) within groups of heads whose K and V fit in
L2; otherwise a head's query blocks are consecutive, which keeps its K and V in L2.

Descriptors: Q, K, V and O are host-side 4-D (batch, heads, rows, dim) views of the (batch, rows, heads, dim)
tensors whose [1, 1, rows, width] box is one head's tile: the copy engine zero-fills rows past a sequence's end
(K and V blocks past the last key read zeros, masked to -inf in the scores) and clips the output's stores there.

Packed batches (VARLEN, `cu_seqlens`): the descriptors view the packed (1, total, heads, dim) tensors, a sequence's
rows start at its cu_seqlens entry, and the tiles cover max_seqlen_q rows of every sequence (a tile past its
sequence's end is skipped by every role). Past a sequence's end the copy engine reads the next sequence's rows:
their scores are masked as any key past the end, the consumers zero those value rows in shared memory before
their P V (0 * inf would carry a non-finite value of another sequence into this one), and a tile whose query rows
run past the end stores its output by masked pointer stores instead of TMA.

What it serves: fp16 / bf16, head dims whose padded widths are 64 or 128 (q/k and v apart) or 256 (d = dv),
dense and packed batches, causal (bottom-right) and sliding windows with block skipping, GQA/MQA by head
arithmetic, softcap, ALiBi, a learnable sink (joined to each row's statistics in the epilogue), the lse. The
launcher (launch.py) sends everything else to the Triton kernels, and explain() says why
(configs.gluon_unserved_reason). Design notes and measurements: docs/schedules.md.
"""

from .common import band_mask, descriptor_origin, key_block_bounds, sequence_bounds, tanh
from .gluon_compat import (AVAILABLE, fence_async_shared, gl, gluon, mbarrier, thread_barrier, tma, tma_load,
                           tma_store, warpgroup_mma, warpgroup_mma_wait)

# rows per consumer warpgroup (one wgmma's M is 64 for a warpgroup of 4 warps)
WARPGROUP_ROWS = 64


def _exp2_on_fma_units(x: str, out: str) -> str:
    """PTX computing out = 2^x (x < 128, f32 registers: the kernel's are at most 0, or at most RESCALE_THRESHOLD
    with the conditional rescale) without the MUFU unit: x clamped at -127, split as
    n + f with n = round(x) (adding 1.5 * 2^23 leaves n in the low bits) and f in [-0.5, 0.5]; 2^f by a cubic
    (1 + f (c1 + f (c2 + f c3)), relative error 1.0e-4, a minimax fit with 1 exact at f = 0), and n added to its
    exponent bits. At x = -127 (and -inf) the result is exactly 0: f = 0 gives 1.0, whose exponent 127 - 127 is 0."""
    return f"""{{
    .reg .f32 t, r, j, f, p;
    .reg .b32 rb, pb;
    max.ftz.f32 t, {x}, 0fC2FE0000;
    add.rn.ftz.f32 r, t, 0f4B400000;
    sub.rn.ftz.f32 j, r, 0f4B400000;
    sub.rn.ftz.f32 f, t, j;
    fma.rn.ftz.f32 p, f, 0f3D6150CB, 0f3E780610;
    fma.rn.ftz.f32 p, p, f, 0f3F317AFD;
    fma.rn.ftz.f32 p, p, f, 0f3F800000;
    mov.b32 rb, r;
    shl.b32 rb, rb, 23;
    mov.b32 pb, p;
    add.s32 pb, pb, rb;
    mov.b32 {out}, pb;
    }}"""


def _exp2_mixed(pack: int) -> str:
    """PTX for gl.inline_asm_elementwise over `pack` elements: the last on the FMA units, the others by MUFU."""
    lines = [f"ex2.approx.ftz.f32 ${i}, ${pack + i};" for i in range(pack - 1)]
    return "\n".join(lines + [_exp2_on_fma_units(f"${2 * pack - 1}", f"${pack - 1}")])


attention_fwd_gluon_kernel = None  # without Gluon (configs.gluon_unserved_reason then says so)

if AVAILABLE:
    _EXP2_ONE_IN_2 = gl.constexpr(_exp2_mixed(2))
    _EXP2_ONE_IN_4 = gl.constexpr(_exp2_mixed(4))
    _EXP2_ONE_IN_8 = gl.constexpr(_exp2_mixed(8))
    _F32_2 = gl.constexpr(",".join(["=f"] * 2 + ["f"] * 2))  # the constraints: pack outputs, then pack inputs
    _F32_4 = gl.constexpr(",".join(["=f"] * 4 + ["f"] * 4))
    _F32_8 = gl.constexpr(",".join(["=f"] * 8 + ["f"] * 8))

    @gluon.jit
    def _exp2(x, EMULATED: gl.constexpr):
        """2^x elementwise for x <= RESCALE_THRESHOLD (0 without the conditional rescale; or -inf): by the MUFU
        unit, or with EMULATED = n one element in n on the FMA units (_exp2_on_fma_units), which the MUFU unit's 16
        results per clock and SM would otherwise bound."""
        if EMULATED == 2:
            y = gl.inline_asm_elementwise(_EXP2_ONE_IN_2, _F32_2, [x], dtype=gl.float32, is_pure=True, pack=2)
        elif EMULATED == 4:
            y = gl.inline_asm_elementwise(_EXP2_ONE_IN_4, _F32_4, [x], dtype=gl.float32, is_pure=True, pack=4)
        elif EMULATED == 8:
            y = gl.inline_asm_elementwise(_EXP2_ONE_IN_8, _F32_8, [x], dtype=gl.float32, is_pure=True, pack=8)
        else:
            gl.static_assert(EMULATED == 0, "one exponential in 2, 4 or 8 on the FMA units, or none")
            y = gl.exp2(x)
        return y

    @gluon.jit
    def _tiles_of_this_cta(programs, waves, extra, TileStarts, TILE_LIST: gl.constexpr):
        """(first entry, count) of this CTA's tiles. With TILE_LIST, a list the launcher dealt (TileList from
        TileStarts[pid] to TileStarts[pid + 1], longest first onto the least loaded CTA); otherwise one tile per
        wave of `programs` (the grid's size) tiles (see _tile_number): `waves` whole waves and `extra` tiles in a
        last one. (The launcher divides: a division here, shared by the roles, was computed before they split and
        held in local memory.)"""
        pid = gl.program_id(0)
        if TILE_LIST:
            first = gl.load(TileStarts + pid)
            count = gl.load(TileStarts + pid + 1) - first
        else:
            last = gl.where(waves % 2 == 0, pid, programs - 1 - pid)
            first = 0
            count = waves + (last < extra).to(gl.int32)
        return first, count

    @gluon.jit
    def _tile_number(wave, first, programs, TileList, TILE_LIST: gl.constexpr):
        """The tile this CTA takes in its `wave`-th turn: the launcher's list, or waves of `programs` (the grid's
        size) consecutive tiles dealt to the CTAs in alternating directions (snake order), so that a CTA given a long
        tile in one wave gets a short one in the next when the order is longest first."""
        if TILE_LIST:
            tile = gl.load(TileList + first + wave)
        else:
            pid = gl.program_id(0)
            tile = wave * programs + gl.where(wave % 2 == 0, pid, programs - 1 - pid)
        return tile

    @gluon.jit
    def _tile_coordinates(tile, query_blocks, batch_heads, group_heads, group_tiles, LONGEST_FIRST: gl.constexpr):
        """(query block, batch * nheads index) of tile number `tile`.

        In order: a head's query blocks are consecutive (its K and V stay in L2). LONGEST_FIRST (a band closing on
        the right, where later query blocks see more keys; packed batches, where only long sequences have late
        query blocks): heads in groups of group_heads (group_tiles = group_heads * query_blocks tiles), whose K and V
        fit in L2 together; within a group every head's last query block first, then the one before, and so on."""
        if LONGEST_FIRST:
            group = tile // group_tiles
            heads = gl.minimum(group_heads, batch_heads - group * group_heads)
            within = tile - group * group_tiles
            m_block = query_blocks - 1 - within // heads
            bh = group * group_heads + within % heads
        else:
            m_block = tile % query_blocks
            bh = tile // query_blocks
        return m_block, bh

    @gluon.jit
    def _tile_sequence(tile, sizes, diagonal_offset, packing, BLOCK_M: gl.constexpr, LONGEST_FIRST: gl.constexpr,
                       VARLEN: gl.constexpr):
        """Where tile number `tile` lies: (batch entry, head, first query row within its sequence, and the sequence: the
        descriptors' batch coordinate, its first query and key rows there (int32, as descriptor coordinates are),
        seqlen_q, seqlen_k, diagonal_offset), by common.sequence_bounds and common.descriptor_origin: a dense batch
        entry starts at row 0 of its own batch coordinate, a packed sequence (VARLEN) at its cu_seqlens rows of the
        one packed batch entry, its causal diagonal bottom-right aligned."""
        (nheads, group_size, seqlen_q, seqlen_k, query_blocks, batch_heads, group_heads, group_tiles, programs, waves,
         extra) = sizes
        CuSeqlensQ, CuSeqlensK, Out, o8_desc, stride_om, headdim_v = packing
        m_block, bh = _tile_coordinates(tile, query_blocks, batch_heads, group_heads, group_tiles, LONGEST_FIRST)
        b = bh // nheads
        q_start, k_start, seqlen_q, seqlen_k, diagonal_offset = sequence_bounds(
            CuSeqlensQ, CuSeqlensK, b, seqlen_q, seqlen_k, diagonal_offset, VARLEN)
        batch, q_row0 = descriptor_origin(b, q_start, VARLEN)
        _, k_row0 = descriptor_origin(b, k_start, VARLEN)
        return b, bh % nheads, m_block * BLOCK_M, (batch, q_row0, k_row0, seqlen_q, seqlen_k, diagonal_offset)

    @gluon.jit
    def _query_buffer(tile_index, WG: gl.constexpr, CONSUMERS: gl.constexpr, Q_BUFFERS: gl.constexpr):
        """(buffer, mbarrier phase) of consumer WG's query rows in the CTA's tile_index-th tile: Q_BUFFERS buffers
        per consumer taken in turn (two where the next tile's first block starts under this tile's last P V)."""
        return (tile_index % Q_BUFFERS) * CONSUMERS + WG, (tile_index // Q_BUFFERS) & 1

    @gluon.jit
    def _producer(descs, smem, bars, sizes, score_args, stats, packing, BLOCK_M: gl.constexpr,
                  BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
                  HAS_SOFTCAP: gl.constexpr, HAS_ALIBI: gl.constexpr, SCALE_IN_EXP2: gl.constexpr,
                  OVERLAP: gl.constexpr, PINGPONG: gl.constexpr, TILE_LIST: gl.constexpr, SHARE_QO: gl.constexpr,
                  VARLEN: gl.constexpr, ACROSS_TILES: gl.constexpr):
        """The load warp: per tile, every consumer's query rows, then every visible K and V block into the ring."""
        CONSUMERS: gl.constexpr = BLOCK_M // 64
        Q_BUFFERS: gl.constexpr = 1 + ACROSS_TILES  # query rows of consecutive tiles in turn (_query_buffer)
        q_desc, k_desc, v_desc, o_desc = descs
        q_smem, k_smem, v_smem, o_smem = smem
        q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, v_clean, turn = bars
        (nheads, group_size, seqlen_q, seqlen_k, query_blocks, batch_heads, group_heads, group_tiles, programs, waves,
         extra) = sizes
        score_scale, softcap_scale, softcap_out, diagonal_offset, window_left, window_right = score_args
        Lse, Slopes, Sink, TileList, TileStarts, stride_lse_b, stride_lse_h, stride_slopes_b = stats
        it = 0
        tiles_done = 0
        first, count = _tiles_of_this_cta(programs, waves, extra, TileStarts, TILE_LIST)
        for wave in range(count):
            b, h, m0, sequence = _tile_sequence(_tile_number(wave, first, programs, TileList, TILE_LIST), sizes,
                                                diagonal_offset, packing, BLOCK_M, HAS_RIGHT or VARLEN, VARLEN)
            batch, q_start, k_start, seqlen_q_b, seqlen_k_b, diagonal_b = sequence
            # a packed batch's tiles cover its longest sequence: past a shorter one's end, every role skips the tile
            if m0 < seqlen_q_b:
                hk = h // group_size
                lo, full_lo, full_hi, hi = key_block_bounds(m0, seqlen_k_b, diagonal_b, window_left, window_right,
                                                            BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
                for w in gl.static_range(CONSUMERS):
                    # the consumer frees its query rows once its last score matmul of the buffer's previous tile is
                    # done
                    buffer, phase = _query_buffer(tiles_done, w, CONSUMERS, Q_BUFFERS)
                    mbarrier.wait(q_empty.index(buffer), phase ^ 1)
                    mbarrier.expect(q_ready.index(buffer), q_desc.block_type.nbytes)
                    tma_load(q_desc, [batch, h, q_start + m0 + w * 64, 0], q_ready.index(buffer),
                             q_smem.index(buffer))
                for n0 in range(lo, hi, BLOCK_N):
                    stage = it % NUM_STAGES
                    phase = (it // NUM_STAGES) & 1
                    # K and V stages are released apart: a score matmul is done with its K block a P V earlier
                    mbarrier.wait(k_empty.index(stage), phase ^ 1)
                    mbarrier.expect(k_ready.index(stage), k_desc.block_type.nbytes)
                    tma_load(k_desc, [batch, hk, k_start + n0, 0], k_ready.index(stage), k_smem.index(stage))
                    mbarrier.wait(v_empty.index(stage), phase ^ 1)
                    mbarrier.expect(v_ready.index(stage), v_desc.block_type.nbytes)
                    tma_load(v_desc, [batch, hk, k_start + n0, 0], v_ready.index(stage), v_smem.index(stage))
                    it += 1
                tiles_done += 1

    @gluon.jit
    def _scores(s, offs_m, offs_n, seqlen_q, seqlen_k, score_scale, softcap_scale, softcap_out, slope,
                diagonal_offset, window_left, window_right, MASKED, HAS_LEFT: gl.constexpr,
                HAS_RIGHT: gl.constexpr, HAS_SOFTCAP: gl.constexpr, HAS_ALIBI: gl.constexpr,
                SCALE_IN_EXP2: gl.constexpr):
        """The tile's scores from its raw products, as common.scores (whose tanh and band_mask it calls): base 2, or
        with SCALE_IN_EXP2 the unscaled products (the scale goes into the exponent); -inf outside the band and past
        the keys where MASKED, a runtime flag here (only the band's edge blocks and the keys' ragged end pay for the
        mask), where common.scores takes a constexpr."""
        if HAS_SOFTCAP:
            s = tanh(s * softcap_scale) * softcap_out
        elif not SCALE_IN_EXP2:
            s = s * score_scale
        if HAS_ALIBI:
            distance = gl.abs(offs_m[:, None] + diagonal_offset - offs_n[None, :]).to(gl.float32)
            s = s - slope * distance
        if MASKED:
            s = band_mask(s, offs_m[:, None], offs_n[None, :], seqlen_q, seqlen_k, diagonal_offset, window_left,
                          window_right, HAS_LEFT, HAS_RIGHT)
        return s

    @gluon.jit
    def _softmax_update(s, m_i, l_i, score_scale, SCALE_IN_EXP2: gl.constexpr, EXP2_EMULATED: gl.constexpr,
                        RESCALE_THRESHOLD: gl.constexpr):
        """One online-softmax step on scores s: (p, alpha, m_new, l_new); alpha rescales what was accumulated."""
        row_max = gl.max(s, axis=1)
        if SCALE_IN_EXP2:
            row_max = row_max * score_scale
        if RESCALE_THRESHOLD > 0:
            # the max moves only when the block raises it by more than the threshold (a row's first finite block
            # always moves it: -inf + t is -inf)
            m_new = gl.where(row_max > m_i + RESCALE_THRESHOLD, row_max, m_i)
        else:
            m_new = gl.maximum(m_i, row_max)
        # any block may be masked (the keys' ragged end is known at run time), so a row may have seen only -inf
        # scores so far: it keeps max -inf and is shifted by 0, so that exp2 gives 0, not NaN
        m_shift = gl.where(m_new == float("-inf"), 0.0, m_new)
        if SCALE_IN_EXP2:
            p = _exp2(s * score_scale - m_shift[:, None], EXP2_EMULATED)
        else:
            p = _exp2(s - m_shift[:, None], EXP2_EMULATED)
        alpha = gl.exp2(m_i - m_shift)
        l_new = l_i * alpha + gl.sum(p, axis=1)
        return p, alpha, m_new, l_new

    @gluon.jit
    def _ring_rows(ring, stage, ROWS: gl.constexpr):
        """The first ROWS rows of stage `stage` of the K or V ring as a 2-D [ROWS, width] view: the whole block, or
        (HALF_DIAGONAL) its first half, where a consumer's rows see none of the block's later keys."""
        BLOCK_N: gl.constexpr = ring.shape[3]
        WIDTH: gl.constexpr = ring.shape[4]
        rows = ring.index(stage).reshape([BLOCK_N, WIDTH])
        if ROWS < BLOCK_N:
            rows = rows.slice(0, ROWS)
        return rows

    @gluon.jit
    def _issue_scores(q_tile, k_rows, s_layout: gl.constexpr):
        """S = Q Kᵀ of one key block (k_rows: its [keys, d] view) as an asynchronous wgmma, Q and K from shared
        memory; the caller waits."""
        KEYS: gl.constexpr = k_rows.shape[0]
        return warpgroup_mma(q_tile, k_rows.permute((1, 0)), gl.zeros([64, KEYS], gl.float32, layout=s_layout),
                             use_acc=False, is_async=True)

    @gluon.jit
    def _block_probabilities(s, n0, row0, m_i, l_i, seqlen_q, seqlen_k, score_args, slope, masked,
                             col_layout: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
                             HAS_SOFTCAP: gl.constexpr, HAS_ALIBI: gl.constexpr, SCALE_IN_EXP2: gl.constexpr,
                             EXP2_EMULATED: gl.constexpr, RESCALE_THRESHOLD: gl.constexpr):
        """The online-softmax step of the key block at n0 from its raw products s: (p, alpha, m_new, l_new) as
        _softmax_update, the element mask applied where `masked` (the block straddles a band edge or the keys' end)."""
        score_scale, softcap_scale, softcap_out, diagonal_offset, window_left, window_right = score_args
        BLOCK_N: gl.constexpr = s.shape[1]
        # the rows' indices are built here, where they are used, not held through the block loop
        offs_m = row0 + gl.arange(0, 64, layout=gl.SliceLayout(1, s.type.layout))
        s = _scores(s, offs_m, n0 + gl.arange(0, BLOCK_N, layout=col_layout), seqlen_q, seqlen_k, score_scale,
                    softcap_scale, softcap_out, slope, diagonal_offset, window_left, window_right, masked, HAS_LEFT,
                    HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, SCALE_IN_EXP2)
        return _softmax_update(s, m_i, l_i, score_scale, SCALE_IN_EXP2, EXP2_EMULATED, RESCALE_THRESHOLD)

    @gluon.jit
    def _take_turn(my_turn, turns, WG: gl.constexpr, PINGPONG: gl.constexpr):
        """Wait until the other consumer has issued its matmuls (pingpong); consumer 0 starts. Returns turns + 1."""
        if PINGPONG:
            mbarrier.wait(my_turn, (turns & 1) ^ (1 - WG))
        return turns + 1

    @gluon.jit
    def _pass_turn(other_turn, PINGPONG: gl.constexpr):
        """This consumer's matmuls are issued: the other may issue its own."""
        if PINGPONG:
            mbarrier.arrive(other_turn, count=1)

    @gluon.jit
    def _zero_values_past_end(v_smem, stage, valid, v_clean, cleaned, WG: gl.constexpr, CONSUMERS: gl.constexpr):
        """Zero the rows [valid, BLOCK_N) of V stage `stage`, a packed sequence's last key block whose rows past the
        sequence's end the copy engine read from the next sequence, each consumer its share of 16-row chunks; then
        wait until every consumer has (the `cleaned`-th such block of this CTA), so that no P V reads them before."""
        BLOCK_N: gl.constexpr = v_smem.shape[3]
        BLOCK_DV: gl.constexpr = v_smem.shape[4]
        ROWS: gl.constexpr = 16
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (BLOCK_DV // 8), BLOCK_DV // 8], [4, 1], [1, 0])
        block = v_smem.index(stage).reshape([BLOCK_N, BLOCK_DV])
        for c in gl.static_range(WG, BLOCK_N // ROWS, CONSUMERS):
            if (c + 1) * ROWS > valid:
                chunk = block.slice(c * ROWS, ROWS)
                rows = c * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
                values = chunk.load(layout)
                chunk.store(gl.where((rows < valid)[:, None], values, gl.zeros_like(values)))
        # the writes reach the wgmma's (async) view of shared memory, then every consumer's are done
        fence_async_shared()
        thread_barrier()
        mbarrier.arrive(v_clean, count=1)
        mbarrier.wait(v_clean, cleaned & 1)

    @gluon.jit
    def _last_values(p_op, acc, v_smem, v_ready, v_empty, block, my_turn, other_turn, turns,
                     WG: gl.constexpr, PINGPONG: gl.constexpr):
        """A tile's last P V (of the CTA's `block`-th K/V block; P may cover its first half only, HALF_DIAGONAL) on
        its own, nothing left to overlap it with: (acc, turns) once it is done and its V stage released."""
        NUM_STAGES: gl.constexpr = v_smem.shape[0]
        stage = block % NUM_STAGES
        phase = (block // NUM_STAGES) & 1
        mbarrier.wait(v_ready.index(stage), phase)
        turns = _take_turn(my_turn, turns, WG, PINGPONG)
        acc = warpgroup_mma(p_op, _ring_rows(v_smem, stage, p_op.shape[1]), acc, is_async=True)
        _pass_turn(other_turn, PINGPONG)
        acc = warpgroup_mma_wait(0, deps=[acc])
        mbarrier.arrive(v_empty.index(stage), count=1)
        return acc, turns

    @gluon.jit
    def _finish_tile(acc, m_i, l_i, sink, o_tile, o_desc, h, row0, sequence, stats, packing,
                     o_row_layout: gl.constexpr, VARLEN: gl.constexpr, HAS_SINK: gl.constexpr):
        """A tile's epilogue for one consumer's 64 rows from row0 of its sequence: with HAS_SINK, the sink's term
        (`sink`, its head's logit in base 2) joins each row's statistics; normalise once (one reciprocal per row;
        rows that saw no key give out 0 and lse -inf, or with a sink the sink), store the lse rows and the output
        rows (_store_rows)."""
        batch, q_start, k_start, seqlen_q, seqlen_k, diagonal_offset = sequence
        Lse, Slopes, Sink, TileList, TileStarts, stride_lse_b, stride_lse_h, stride_slopes_b = stats
        l_o = gl.convert_layout(l_i, o_row_layout)
        m_o = gl.convert_layout(m_i, o_row_layout)
        keys_share = 1.0
        if HAS_SINK:
            # the sink is one more term of the denominator, added once after the keys (the Triton forwards start
            # from it instead): the key loop and its registers stay as without one
            m_new = gl.maximum(m_o, sink)
            # a row without a key and a sink of -inf keeps max -inf: shifted by 0, exp2 gives 0, not NaN
            m_shift = gl.where(m_new == float("-inf"), 0.0, m_new)
            keys_share = gl.exp2(m_o - m_shift)
            l_o = l_o * keys_share + gl.exp2(sink - m_shift)
            m_o = m_new
        seen = l_o > 0
        l_safe = gl.where(seen, l_o, 1.0)
        out = acc * gl.where(seen, keys_share / l_safe, 0.0)[:, None]
        lse = gl.where(seen, (m_o + gl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
        rows = row0 + gl.arange(0, 64, layout=o_row_layout)
        gl.store(Lse + batch.to(gl.int64) * stride_lse_b + h.to(gl.int64) * stride_lse_h + q_start + rows, lse,
                 mask=rows < seqlen_q)
        _store_rows(out, o_tile, o_desc, h, row0, sequence, packing, VARLEN)

    @gluon.jit
    def _store_rows(out, o_tile, o_desc, h, row0, sequence, packing, VARLEN: gl.constexpr):
        """Store one consumer's 64 output rows from row0 of its sequence, staged in o_tile (once the previous store
        has read it): by TMA, except in a packed batch where the rows run past the sequence's end (the next
        sequence's rows are there)."""
        batch, q_start, k_start, seqlen_q, seqlen_k, diagonal_offset = sequence
        CuSeqlensQ, CuSeqlensK, Out, o8_desc, stride_om, headdim_v = packing
        BLOCK_DV: gl.constexpr = o_tile.shape[3]
        # the previous tile's store has read this buffer
        tma.store_wait(0)
        thread_barrier()
        staged = o_tile.reshape([64, BLOCK_DV])
        staged.store(out.to(o_desc.dtype))
        fence_async_shared()
        thread_barrier()
        if VARLEN:
            if row0 + 64 > seqlen_q:
                # the rows before the sequence's end in groups of 8 (a swizzle period of the staging buffer): the
                # whole groups by TMA (o8_desc, an 8-row box), the last one's rows by masked pointer stores, 16 bytes
                # a thread (few registers: pointer stores of all 64 rows made ptxas spill at d = 128)
                layout: gl.constexpr = gl.BlockedLayout([1, BLOCK_DV // 16], [2, 16], [4, 1], [1, 0])
                valid = seqlen_q - row0
                c = gl.arange(0, BLOCK_DV, layout=gl.SliceLayout(0, layout))
                # the output is contiguous: (1, total rows, nheads, headdim_v)
                base = Out + (q_start + row0).to(gl.int64) * stride_om + h.to(gl.int64) * headdim_v
                for group in gl.static_range(8):
                    if (group + 1) * 8 <= valid:
                        tma_store(o8_desc, [batch, h, q_start + row0 + group * 8, 0], o_tile.slice(group * 8, 8, dim=2))
                    elif group * 8 < valid:
                        r = group * 8 + gl.arange(0, 8, layout=gl.SliceLayout(1, layout))
                        gl.store(base + r[:, None] * stride_om + c[None, :], staged.slice(group * 8, 8).load(layout),
                                 mask=(r < valid)[:, None] & (c < headdim_v)[None, :])
            else:
                tma_store(o_desc, [batch, h, q_start + row0, 0], o_tile)
        else:
            tma_store(o_desc, [batch, h, q_start + row0, 0], o_tile)

    @gluon.jit
    def _block_alone(q_tile, k_smem, k_ready, k_empty, it, n0, row0, m_i, l_i, seqlen_q, seqlen_k, score_args,
                     slope, masked, my_turn, other_turn, turns, s_layout: gl.constexpr, col_layout: gl.constexpr,
                     HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, HAS_SOFTCAP: gl.constexpr,
                     HAS_ALIBI: gl.constexpr, SCALE_IN_EXP2: gl.constexpr, EXP2_EMULATED: gl.constexpr,
                     RESCALE_THRESHOLD: gl.constexpr,
                     WG: gl.constexpr, PINGPONG: gl.constexpr):
        """The scores and online-softmax step of the CTA's `it`-th key block (at n0) with nothing to overlap them
        with (a tile's first block under overlap, every block without): (p, alpha, m, l, turns) as
        _block_probabilities, its K stage released."""
        NUM_STAGES: gl.constexpr = k_smem.shape[0]
        stage = it % NUM_STAGES
        mbarrier.wait(k_ready.index(stage), (it // NUM_STAGES) & 1)
        turns = _take_turn(my_turn, turns, WG, PINGPONG)
        s = _issue_scores(q_tile, _ring_rows(k_smem, stage, k_smem.shape[3]), s_layout)
        _pass_turn(other_turn, PINGPONG)
        s = warpgroup_mma_wait(0, deps=[s])
        # the K block is read: release it (one thread arrives, past its wait; a warpgroup's wgmma is one collective
        # operation, docs/compiler-workarounds.md)
        mbarrier.arrive(k_empty.index(stage), count=1)
        p, alpha, m_i, l_i = _block_probabilities(s, n0, row0, m_i, l_i, seqlen_q, seqlen_k, score_args, slope,
                                                  masked, col_layout, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI,
                                                  SCALE_IN_EXP2, EXP2_EMULATED, RESCALE_THRESHOLD)
        return p, alpha, m_i, l_i, turns

    @gluon.jit
    def _first_block_of(wave, first, programs, TileList, sizes, score_args, packing, BLOCK_M: gl.constexpr,
                        BLOCK_N: gl.constexpr, TILE_LIST: gl.constexpr, HAS_RIGHT: gl.constexpr, WG: gl.constexpr):
        """Where consumer WG's first key block of the CTA's `wave`-th tile lies, in a dense batch without a left
        band edge and ALiBi, where every row sees a key (ACROSS_TILES): (the consumer's first query row, the
        sequence as _tile_sequence, the score arguments, the block's first key, whether it needs the element
        mask)."""
        score_scale, softcap_scale, softcap_out, diagonal_offset, window_left, window_right = score_args
        b, h, m0, sequence = _tile_sequence(_tile_number(wave, first, programs, TileList, TILE_LIST), sizes,
                                            diagonal_offset, packing, BLOCK_M, HAS_RIGHT, False)
        batch, q_start, k_start, seqlen_q, seqlen_k, diagonal = sequence
        lo, full_lo, full_hi, hi = key_block_bounds(m0, seqlen_k, diagonal, window_left, window_right, BLOCK_M,
                                                    BLOCK_N, False, HAS_RIGHT)
        args = (score_scale, softcap_scale, softcap_out, diagonal, window_left, window_right)
        return m0 + WG * 64, sequence, args, lo, (lo < full_lo) | (lo >= full_hi)

    @gluon.jit
    def _nothing_carried(p_op, m, l):
        """Fresh values in the layouts of a carried first block (P, m, l) where none is carried."""
        return gl.zeros_like(p_op), gl.full_like(m, float("-inf")), gl.zeros_like(l)

    @gluon.jit
    def _first_block(q_tile, k_smem, k_ready, k_empty, it, n0, row0, m_i, l_i, seqlen_q, seqlen_k, score_args,
                     slope, masked, my_turn, other_turn, turns, s_layout: gl.constexpr, col_layout: gl.constexpr,
                     p_layout: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
                     HAS_SOFTCAP: gl.constexpr, HAS_ALIBI: gl.constexpr, SCALE_IN_EXP2: gl.constexpr,
                     EXP2_EMULATED: gl.constexpr, RESCALE_THRESHOLD: gl.constexpr, WG: gl.constexpr,
                     PINGPONG: gl.constexpr):
        """A tile's first block under overlap, nothing to overlap its scores and softmax with yet: (P as the P V
        matmul's A operand, m, l, turns) as _block_alone."""
        p, alpha, m_i, l_i, turns = _block_alone(q_tile, k_smem, k_ready, k_empty, it, n0, row0, m_i, l_i,
                                                 seqlen_q, seqlen_k, score_args, slope, masked, my_turn, other_turn,
                                                 turns, s_layout, col_layout, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP,
                                                 HAS_ALIBI, SCALE_IN_EXP2, EXP2_EMULATED, RESCALE_THRESHOLD, WG,
                                                 PINGPONG)
        return gl.convert_layout(p.to(q_tile.dtype), p_layout), m_i, l_i, turns

    @gluon.jit
    def _overlapped_block(q_tile, p_op, acc, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, it, n0, row0, m_i,
                          l_i, seqlen_q, seqlen_k, score_args, slope, masked, my_turn, other_turn, turns,
                          s_layout: gl.constexpr, col_layout: gl.constexpr, HAS_LEFT: gl.constexpr,
                          HAS_RIGHT: gl.constexpr, HAS_SOFTCAP: gl.constexpr, HAS_ALIBI: gl.constexpr,
                          SCALE_IN_EXP2: gl.constexpr, EXP2_EMULATED: gl.constexpr, RESCALE_THRESHOLD: gl.constexpr,
                          WG: gl.constexpr,
                          PINGPONG: gl.constexpr, KEYS: gl.constexpr):
        """Q Kᵀ of the first KEYS keys (the block, or its first half: HALF_DIAGONAL; s_layout and col_layout of that
        width) of the CTA's `it`-th key block (at n0, against q_tile) issued before the P V of block it - 1 (p_op
        into acc; P of that block's width or first half), the new block's online-softmax step (from m_i, l_i) run
        under that P V: (p, alpha, m, l, acc, turns) once both are done and their stages released. q_tile may be the
        next tile's query rows: then the softmax step starts that tile while acc finishes this one."""
        NUM_STAGES: gl.constexpr = k_smem.shape[0]
        stage = it % NUM_STAGES
        prev_stage = (it - 1) % NUM_STAGES
        mbarrier.wait(k_ready.index(stage), (it // NUM_STAGES) & 1)
        mbarrier.wait(v_ready.index(prev_stage), ((it - 1) // NUM_STAGES) & 1)
        turns = _take_turn(my_turn, turns, WG, PINGPONG)
        s = _issue_scores(q_tile, _ring_rows(k_smem, stage, KEYS), s_layout)
        acc = warpgroup_mma(p_op, _ring_rows(v_smem, prev_stage, p_op.shape[1]), acc, is_async=True)
        _pass_turn(other_turn, PINGPONG)
        # the scores alone: the previous block's P V keeps running under this block's softmax. Its register operand
        # P is not passed through the waits: ptxas tracks the registers of an in-flight wgmma itself (and would
        # serialise wgmma, with a warning, where it could not), while passing P added 96 register moves to the
        # compiled kernel (triton 3.6) and made the three-consumer variant spill under 3.9
        s = warpgroup_mma_wait(1, deps=[s])
        mbarrier.arrive(k_empty.index(stage), count=1)
        p, alpha, m_i, l_i = _block_probabilities(s, n0, row0, m_i, l_i, seqlen_q, seqlen_k, score_args, slope,
                                                  masked, col_layout, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI,
                                                  SCALE_IN_EXP2, EXP2_EMULATED, RESCALE_THRESHOLD)
        acc = warpgroup_mma_wait(0, deps=[acc])
        mbarrier.arrive(v_empty.index(prev_stage), count=1)
        return p, alpha, m_i, l_i, acc, turns

    @gluon.jit
    def _end_tile(p_op, acc, carried, wave, count, first, tiles_done, it, turns, cleaned, q_buffer, lo, hi,
                  seqlen_k, my_turn, other_turn, smem, bars, sizes, score_args, packing, TileList, programs,
                  s_layout: gl.constexpr, col_layout: gl.constexpr, p_layout: gl.constexpr, row_layout: gl.constexpr,
                  BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, TILE_LIST: gl.constexpr, HAS_LEFT: gl.constexpr,
                  HAS_RIGHT: gl.constexpr, HAS_SOFTCAP: gl.constexpr, HAS_ALIBI: gl.constexpr,
                  SCALE_IN_EXP2: gl.constexpr, EXP2_EMULATED: gl.constexpr, RESCALE_THRESHOLD: gl.constexpr,
                  WG: gl.constexpr, PINGPONG: gl.constexpr,
                  SHARE_QO: gl.constexpr, VARLEN: gl.constexpr, ACROSS_TILES: gl.constexpr):
        """The end of the CTA's `wave`-th tile under overlap, its last score matmul done and its last P V (p_op into
        acc; P of a whole block or, HALF_DIAGONAL, of its first half) pending: free the query rows, zero a packed
        sequence's last value rows past its end, then run that P V, with ACROSS_TILES under the CTA's next tile's first
        score matmul and softmax step. Returns (acc, carried, it, turns, cleaned): `carried` the next tile's first P, m
        and l with ACROSS_TILES (fresh values after the CTA's last tile), else as passed."""
        q_smem, k_smem, v_smem, o_smem = smem
        q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, v_clean, turn = bars
        CONSUMERS: gl.constexpr = BLOCK_M // 64
        Q_BUFFERS: gl.constexpr = 1 + ACROSS_TILES
        NUM_STAGES: gl.constexpr = v_smem.shape[0]
        BLOCK_D: gl.constexpr = q_smem.shape[4]
        # the producer may load the next tile's query rows (unless they share their buffer with the output's
        # staging: then once it is stored)
        mbarrier.arrive(q_empty.index(q_buffer), count=1, pred=not SHARE_QO)
        if VARLEN:
            last = lo + (hi - 1 - lo) // BLOCK_N * BLOCK_N
            if last + BLOCK_N > seqlen_k:
                mbarrier.wait(v_ready.index((it - 1) % NUM_STAGES), ((it - 1) // NUM_STAGES) & 1)
                _zero_values_past_end(v_smem, (it - 1) % NUM_STAGES, seqlen_k - last, v_clean, cleaned, WG,
                                      CONSUMERS)
                cleaned += 1
        if ACROSS_TILES:
            next_p_op, next_m, next_l = carried
            if wave + 1 < count:
                row0_n, sequence_n, args_n, n0_n, masked_n = _first_block_of(
                    wave + 1, first, programs, TileList, sizes, score_args, packing, BLOCK_M, BLOCK_N, TILE_LIST,
                    HAS_RIGHT, WG)
                batch_n, q_start_n, k_start_n, seqlen_q_n, seqlen_k_n, diagonal_n = sequence_n
                next_buffer, next_phase = _query_buffer(tiles_done + 1, WG, CONSUMERS, Q_BUFFERS)
                mbarrier.wait(q_ready.index(next_buffer), next_phase)
                p, alpha, next_m, next_l, acc, turns = _overlapped_block(
                    q_smem.index(next_buffer).reshape([64, BLOCK_D]), p_op, acc, k_smem, v_smem, k_ready, k_empty,
                    v_ready, v_empty, it, n0_n, row0_n, gl.full([64], float("-inf"), gl.float32, layout=row_layout),
                    gl.full([64], 0.0, gl.float32, layout=row_layout), seqlen_q_n, seqlen_k_n, args_n, 0.0, masked_n,
                    my_turn, other_turn, turns, s_layout, col_layout, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI,
                    SCALE_IN_EXP2, EXP2_EMULATED, RESCALE_THRESHOLD, WG, PINGPONG, BLOCK_N)
                next_p_op = gl.convert_layout(p.to(p_op.dtype), p_layout)
                it += 1
            else:
                acc, turns = _last_values(p_op, acc, v_smem, v_ready, v_empty, it - 1, my_turn, other_turn, turns,
                                          WG, PINGPONG)
                # nothing carried; every path assigns the carried values, so that none holds its registers through
                # a tile that does not use it
                next_p_op, next_m, next_l = _nothing_carried(next_p_op, next_m, next_l)
            carried = (next_p_op, next_m, next_l)
        else:
            acc, turns = _last_values(p_op, acc, v_smem, v_ready, v_empty, it - 1, my_turn, other_turn, turns, WG,
                                      PINGPONG)
        return acc, carried, it, turns, cleaned

    @gluon.jit
    def _consumer(descs, smem, bars, sizes, score_args, stats, packing, BLOCK_M: gl.constexpr,
                  BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
                  HAS_SOFTCAP: gl.constexpr, HAS_ALIBI: gl.constexpr, SCALE_IN_EXP2: gl.constexpr,
                  OVERLAP: gl.constexpr, PINGPONG: gl.constexpr, TILE_LIST: gl.constexpr, SHARE_QO: gl.constexpr,
                  VARLEN: gl.constexpr, ACROSS_TILES: gl.constexpr, EXP2_EMULATED: gl.constexpr,
                  RESCALE_THRESHOLD: gl.constexpr,
                  HAS_SINK: gl.constexpr, HALF_DIAGONAL: gl.constexpr, WG: gl.constexpr):
        """Consumer warpgroup WG (0 .. BLOCK_M / 64 - 1): rows [64 WG, 64 WG + 64) of every tile this CTA takes."""
        q_desc, k_desc, v_desc, o_desc = descs
        q_smem, k_smem, v_smem, o_smem = smem
        q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, v_clean, turn = bars
        (nheads, group_size, seqlen_q, seqlen_k, query_blocks, batch_heads, group_heads, group_tiles, programs, waves,
         extra) = sizes
        score_scale, softcap_scale, softcap_out, diagonal_offset, window_left, window_right = score_args
        Lse, Slopes, Sink, TileList, TileStarts, stride_lse_b, stride_lse_h, stride_slopes_b = stats
        CONSUMERS: gl.constexpr = BLOCK_M // 64
        Q_BUFFERS: gl.constexpr = 1 + ACROSS_TILES
        BLOCK_D: gl.constexpr = q_desc.block_type.shape[3]
        BLOCK_DV: gl.constexpr = v_desc.block_type.shape[3]
        dtype: gl.constexpr = q_desc.dtype
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_DV, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
        col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
        # the scores of a block's first half (HALF_DIAGONAL)
        half_s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                                instr_shape=[16, BLOCK_N // 2, 16])
        half_col_layout: gl.constexpr = gl.SliceLayout(0, half_s_layout)
        half_row_layout: gl.constexpr = gl.SliceLayout(1, half_s_layout)
        o_row_layout: gl.constexpr = gl.SliceLayout(1, o_layout)
        # HALF_DIAGONAL is a choice for the first consumer alone, fixed at compile time. The launcher admits it for
        # dense batches, 128-row tiles against blocks of 128 keys, a band that closes at the diagonal
        # (window_right = 0) and a diagonal offset d that is a multiple of 128 with m0 + d < seqlen_k for every
        # tile (configs.gluon_unserved_reason; d = seqlen_k - seqlen_q gives it, as m0 < seqlen_q). Then a tile's key
        # blocks start on multiples of 128 from lo, and so does m0 + d; its band ends at
        # hi = min(m0 + 128 + d, seqlen_k), with m0 + d < hi (a tile with m0 + d < 0 has hi <= 0 and no key), so its
        # last block starts at last = m0 + d (lo <= m0 + d, both multiples of 128). The first consumer's rows
        # [m0, m0 + 64) see keys up to m0 + 63 + d = last + 63: none of that block's second half. The second
        # consumer's rows see all of it.
        # With another offset the two consumers' rows need not split at the middle of the last block (their half
        # would be a run-time property of each tile, in either consumer), so the launcher turns the setting away.
        HALF: gl.constexpr = HALF_DIAGONAL and WG == 0
        # pingpong's two turns (two consumers only; a third consumer never takes a turn)
        my_turn = turn.index(WG % 2)
        other_turn = turn.index(1 - WG % 2)
        o_tile = o_smem.index(WG)
        it = 0
        turns = 0
        tiles_done = 0
        cleaned = 0  # VARLEN: the value blocks zeroed past a sequence's end so far (_zero_values_past_end)
        first, count = _tiles_of_this_cta(programs, waves, extra, TileStarts, TILE_LIST)
        if ACROSS_TILES:
            # each tile's first block is done before the tile (under the previous tile's last P V): its P and
            # statistics. Every tile sees a key (a dense batch without a left band edge, every row seeing a key), so
            # every tile after the CTA's first has its first block done at the previous one's end, and the tile loop
            # holds no branch on it (such a branch made ptxas split P's bf16 pairs and spill them at d = 128). The
            # CTA's first tile:
            next_p_op = gl.zeros([64, BLOCK_N], dtype, layout=p_layout)
            next_m = gl.full([64], float("-inf"), gl.float32, layout=row_layout)
            next_l = gl.full([64], 0.0, gl.float32, layout=row_layout)
            if count > 0:
                row0_n, sequence_n, args_n, n0_n, masked_n = _first_block_of(
                    0, first, programs, TileList, sizes, score_args, packing, BLOCK_M, BLOCK_N, TILE_LIST, HAS_RIGHT,
                    WG)
                batch_n, q_start_n, k_start_n, seqlen_q_n, seqlen_k_n, diagonal_n = sequence_n
                q_buffer, q_phase = _query_buffer(0, WG, CONSUMERS, Q_BUFFERS)
                mbarrier.wait(q_ready.index(q_buffer), q_phase)
                next_p_op, next_m, next_l, turns = _first_block(
                    q_smem.index(q_buffer).reshape([64, BLOCK_D]), k_smem, k_ready, k_empty, it, n0_n, row0_n,
                    next_m, next_l, seqlen_q_n, seqlen_k_n, args_n, 0.0, masked_n, my_turn, other_turn, turns,
                    s_layout, col_layout, p_layout, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, SCALE_IN_EXP2,
                    EXP2_EMULATED, RESCALE_THRESHOLD, WG, PINGPONG)
                it += 1
        for wave in range(count):
            b, h, m0, sequence = _tile_sequence(_tile_number(wave, first, programs, TileList, TILE_LIST), sizes,
                                                diagonal_offset, packing, BLOCK_M, HAS_RIGHT or VARLEN, VARLEN)
            batch, q_start, k_start, seqlen_q_b, seqlen_k_b, diagonal_b = sequence
            # a packed batch's tiles cover its longest sequence: past a shorter one's end, every role skips the tile
            if m0 < seqlen_q_b:
                tile_args = (score_scale, softcap_scale, softcap_out, diagonal_b, window_left, window_right)
                lo, full_lo, full_hi, hi = key_block_bounds(m0, seqlen_k_b, diagonal_b, window_left, window_right,
                                                            BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
                row0 = m0 + WG * 64
                slope = 0.0
                if HAS_ALIBI:
                    slope = gl.load(Slopes + b * stride_slopes_b + h)
                sink = 0.0
                if HAS_SINK:
                    # loaded here, where the key loop hides its latency, for the epilogue (a natural-log logit; base 2)
                    sink = gl.load(Sink + h).to(gl.float32) * 1.4426950408889634
                acc = gl.zeros([64, BLOCK_DV], gl.float32, layout=o_layout)
                m_i = gl.full([64], float("-inf"), gl.float32, layout=row_layout)
                l_i = gl.full([64], 0.0, gl.float32, layout=row_layout)
                q_buffer, q_phase = _query_buffer(tiles_done, WG, CONSUMERS, Q_BUFFERS)
                q_tile = q_smem.index(q_buffer).reshape([64, BLOCK_D])
                # (with ACROSS_TILES already complete: the buffer is not refilled before this consumer frees it)
                mbarrier.wait(q_ready.index(q_buffer), q_phase)
                if lo < hi:
                    if OVERLAP:
                        if ACROSS_TILES:
                            p_op = next_p_op
                            m_i = next_m
                            l_i = next_l
                        else:
                            p_op, m_i, l_i, turns = _first_block(
                                q_tile, k_smem, k_ready, k_empty, it, lo, row0, m_i, l_i, seqlen_q_b, seqlen_k_b,
                                tile_args, slope, (lo < full_lo) | (lo >= full_hi), my_turn, other_turn, turns,
                                s_layout, col_layout, p_layout, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI,
                                SCALE_IN_EXP2, EXP2_EMULATED, RESCALE_THRESHOLD, WG, PINGPONG)
                            it += 1
                        # HALF: the tile's last block, where it is not its first, takes this consumer's Q Kᵀ,
                        # softmax and P V on its first half only (see HALF's definition: these rows see none of its
                        # second half's keys)
                        steps_end = hi
                        if HALF:
                            last = lo + (hi - 1 - lo) // BLOCK_N * BLOCK_N
                            # false only where the tile's band is one block (m0 + d = 0, e.g. the first query
                            # block at d = 0, or a left window edge within that block)
                            half = last > lo
                            if half:
                                steps_end = last
                        for n0 in range(lo + BLOCK_N, steps_end, BLOCK_N):
                            p, alpha, m_i, l_i, acc, turns = _overlapped_block(
                                q_tile, p_op, acc, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, it, n0, row0,
                                m_i, l_i, seqlen_q_b, seqlen_k_b, tile_args, slope, (n0 < full_lo) | (n0 >= full_hi),
                                my_turn, other_turn, turns, s_layout, col_layout, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP,
                                HAS_ALIBI, SCALE_IN_EXP2, EXP2_EMULATED, RESCALE_THRESHOLD, WG, PINGPONG, BLOCK_N)
                            acc = acc * gl.convert_layout(alpha, o_row_layout)[:, None]
                            p_op = gl.convert_layout(p.to(dtype), p_layout)
                            it += 1
                        # (without ACROSS_TILES nothing is carried: _end_tile hands these back unused)
                        carried = (next_p_op, next_m, next_l) if ACROSS_TILES else (p_op, m_i, l_i)
                        if HALF:
                            if half:
                                # the statistics move to the half block's row layout and back (the same rows in
                                # the same threads)
                                p, alpha, m_half, l_half, acc, turns = _overlapped_block(
                                    q_tile, p_op, acc, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, it, last,
                                    row0, gl.convert_layout(m_i, half_row_layout),
                                    gl.convert_layout(l_i, half_row_layout), seqlen_q_b, seqlen_k_b, tile_args,
                                    slope, True, my_turn, other_turn, turns, half_s_layout, half_col_layout,
                                    HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, SCALE_IN_EXP2, EXP2_EMULATED,
                                    RESCALE_THRESHOLD, WG,
                                    PINGPONG, BLOCK_N // 2)
                                m_i = gl.convert_layout(m_half, row_layout)
                                l_i = gl.convert_layout(l_half, row_layout)
                                acc = acc * gl.convert_layout(alpha, o_row_layout)[:, None]
                                it += 1
                                acc, carried, it, turns, cleaned = _end_tile(
                                    gl.convert_layout(p.to(dtype), p_layout), acc, carried, wave, count, first,
                                    tiles_done, it, turns, cleaned, q_buffer, lo, hi, seqlen_k_b, my_turn,
                                    other_turn, smem, bars, sizes, score_args, packing, TileList, programs, s_layout,
                                    col_layout, p_layout, row_layout, BLOCK_M, BLOCK_N, TILE_LIST, HAS_LEFT,
                                    HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, SCALE_IN_EXP2, EXP2_EMULATED,
                                    RESCALE_THRESHOLD, WG, PINGPONG,
                                    SHARE_QO, VARLEN, ACROSS_TILES)
                            else:
                                acc, carried, it, turns, cleaned = _end_tile(
                                    p_op, acc, carried, wave, count, first, tiles_done, it, turns, cleaned, q_buffer,
                                    lo, hi, seqlen_k_b, my_turn, other_turn, smem, bars, sizes, score_args, packing,
                                    TileList, programs, s_layout, col_layout, p_layout, row_layout, BLOCK_M, BLOCK_N,
                                    TILE_LIST, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, SCALE_IN_EXP2,
                                    EXP2_EMULATED, RESCALE_THRESHOLD, WG, PINGPONG, SHARE_QO, VARLEN, ACROSS_TILES)
                        else:
                            acc, carried, it, turns, cleaned = _end_tile(
                                p_op, acc, carried, wave, count, first, tiles_done, it, turns, cleaned, q_buffer, lo,
                                hi, seqlen_k_b, my_turn, other_turn, smem, bars, sizes, score_args, packing, TileList,
                                programs, s_layout, col_layout, p_layout, row_layout, BLOCK_M, BLOCK_N, TILE_LIST,
                                HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, SCALE_IN_EXP2, EXP2_EMULATED,
                                RESCALE_THRESHOLD, WG,
                                PINGPONG, SHARE_QO, VARLEN, ACROSS_TILES)
                        if ACROSS_TILES:
                            next_p_op, next_m, next_l = carried
                    else:
                        for n0 in range(lo, hi, BLOCK_N):
                            stage = it % NUM_STAGES
                            phase = (it // NUM_STAGES) & 1
                            p, alpha, m_i, l_i, turns = _block_alone(
                                q_tile, k_smem, k_ready, k_empty, it, n0, row0, m_i, l_i, seqlen_q_b, seqlen_k_b,
                                tile_args, slope, (n0 < full_lo) | (n0 >= full_hi), my_turn, other_turn, turns,
                                s_layout, col_layout, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, SCALE_IN_EXP2,
                                EXP2_EMULATED, RESCALE_THRESHOLD, WG, PINGPONG)
                            acc = acc * gl.convert_layout(alpha, o_row_layout)[:, None]
                            p_op = gl.convert_layout(p.to(dtype), p_layout)
                            mbarrier.wait(v_ready.index(stage), phase)
                            if VARLEN:
                                if n0 + BLOCK_N > seqlen_k_b:
                                    _zero_values_past_end(v_smem, stage, seqlen_k_b - n0, v_clean, cleaned, WG,
                                                          CONSUMERS)
                                    cleaned += 1
                            acc = warpgroup_mma(p_op, v_smem.index(stage).reshape([BLOCK_N, BLOCK_DV]), acc,
                                                is_async=True)
                            acc = warpgroup_mma_wait(0, deps=[acc])
                            mbarrier.arrive(v_empty.index(stage), count=1)
                            it += 1
                        mbarrier.arrive(q_empty.index(q_buffer), count=1, pred=not SHARE_QO)
                else:
                    # no visible key: nothing to compute, the query rows are free at once
                    mbarrier.arrive(q_empty.index(q_buffer), count=1, pred=not SHARE_QO)
                    if ACROSS_TILES:
                        # not reached (there every tile sees a key); assigned so that this branch, too, leaves no
                        # earlier P held through the tile
                        next_p_op, next_m, next_l = _nothing_carried(next_p_op, next_m, next_l)
                _finish_tile(acc, m_i, l_i, sink, o_tile, o_desc, h, row0, sequence, stats, packing, o_row_layout,
                             VARLEN, HAS_SINK)
                if SHARE_QO:
                    # the output was staged in the query rows' buffer: free it once the store has read it
                    tma.store_wait(0)
                    thread_barrier()
                    mbarrier.arrive(q_empty.index(q_buffer), count=1)
                tiles_done += 1
        tma.store_wait(0)

    @gluon.jit
    def attention_fwd_gluon_kernel(
        q_desc, k_desc, v_desc, o_desc, o8_desc, Lse, Slopes, Sink, TileList, TileStarts, CuSeqlensQ, CuSeqlensK,
        Out,
        stride_lse_b, stride_lse_h, stride_slopes_b, stride_om, headdim_v,
        nheads, group_size, seqlen_q, seqlen_k, query_blocks, batch_heads, group_heads, group_tiles, programs, waves,
        extra,
        score_scale, softcap_scale, softcap_out, diagonal_offset, window_left, window_right,
        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
        HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, HAS_SOFTCAP: gl.constexpr, HAS_ALIBI: gl.constexpr,
        SCALE_IN_EXP2: gl.constexpr, OVERLAP: gl.constexpr, PINGPONG: gl.constexpr, TILE_LIST: gl.constexpr,
        SHARE_QO: gl.constexpr, VARLEN: gl.constexpr, CONSUMER_REGISTERS: gl.constexpr, EXP2_EMULATED: gl.constexpr,
        RESCALE_THRESHOLD: gl.constexpr,
        ACROSS_TILES: gl.constexpr, HAS_SINK: gl.constexpr, HALF_DIAGONAL: gl.constexpr,
    ):
        CONSUMERS: gl.constexpr = BLOCK_M // 64
        gl.static_assert(CONSUMERS * 64 == BLOCK_M and CONSUMERS >= 1 and CONSUMERS <= 3,
                         "one, two or three consumer warpgroups of 64 query rows")
        gl.static_assert(not PINGPONG or CONSUMERS == 2, "pingpong takes turns between two consumers")
        gl.static_assert(not (VARLEN and TILE_LIST), "the launcher deals no packed batch's tiles")
        gl.static_assert(not ACROSS_TILES or (OVERLAP and not (VARLEN or SHARE_QO or HAS_LEFT or HAS_ALIBI)),
                         "the next tile's first block under this tile's last P V: with overlap, dense batches "
                         "without a left band edge or ALiBi, the output staged apart from the query rows")
        gl.static_assert(not HALF_DIAGONAL or (OVERLAP and HAS_RIGHT and not VARLEN and BLOCK_M == 128
                                               and BLOCK_N == 128),
                         "the first consumer's last block on its first half: with overlap, a band closing on the "
                         "right, dense batches, 128-row tiles and blocks of 128 keys")
        Q_BUFFERS: gl.constexpr = 1 + ACROSS_TILES
        # shared memory: each consumer's query rows (of two tiles in turn with ACROSS_TILES) and output staging, the
        # K/V ring
        q_smem = gl.allocate_shared_memory(q_desc.dtype, [Q_BUFFERS * CONSUMERS] + q_desc.block_type.shape,
                                           q_desc.layout)
        k_smem = gl.allocate_shared_memory(k_desc.dtype, [NUM_STAGES] + k_desc.block_type.shape, k_desc.layout)
        v_smem = gl.allocate_shared_memory(v_desc.dtype, [NUM_STAGES] + v_desc.block_type.shape, v_desc.layout)
        if SHARE_QO:
            # the output is staged in the query rows' buffer (d = dv: one box shape and layout), which is free once
            # the tile's last score matmul is done: what lets wide heads fit shared memory
            gl.static_assert(q_desc.block_type.shape == o_desc.block_type.shape, "shared Q / O staging needs d == dv")
            o_smem = q_smem
        else:
            o_smem = gl.allocate_shared_memory(o_desc.dtype, [CONSUMERS] + o_desc.block_type.shape, o_desc.layout)
        q_ready = gl.allocate_shared_memory(gl.int64, [Q_BUFFERS * CONSUMERS, 1], mbarrier.MBarrierLayout())
        q_empty = gl.allocate_shared_memory(gl.int64, [Q_BUFFERS * CONSUMERS, 1], mbarrier.MBarrierLayout())
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        k_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        k_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        v_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        v_clean = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(Q_BUFFERS * CONSUMERS):
            mbarrier.init(q_ready.index(i), count=1)
            mbarrier.init(q_empty.index(i), count=1)
        for i in gl.static_range(2):
            mbarrier.init(turn.index(i), count=1)
        for i in gl.static_range(NUM_STAGES):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(k_empty.index(i), count=CONSUMERS)  # every consumer releases a stage
            mbarrier.init(v_empty.index(i), count=CONSUMERS)
        mbarrier.init(v_clean.index(0), count=CONSUMERS)  # every consumer has zeroed its share of a value block
        bars = (q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, v_clean.index(0), turn)
        descs = (q_desc, k_desc, v_desc, o_desc)
        smem = (q_smem, k_smem, v_smem, o_smem)
        sizes = (nheads, group_size, seqlen_q, seqlen_k, query_blocks, batch_heads, group_heads, group_tiles, programs,
                 waves, extra)
        score_args = (score_scale, softcap_scale, softcap_out, diagonal_offset, window_left, window_right)
        stats = (Lse, Slopes, Sink, TileList, TileStarts, stride_lse_b, stride_lse_h, stride_slopes_b)
        packing = (CuSeqlensQ, CuSeqlensK, Out, o8_desc, stride_om, headdim_v)
        # the default partition (num_warps = 4 warps) loads; the consumers are workers of 4 warps each. Workaround
        # (triton 3.6.0, 2026-12-01): the functions that a default partition calls get no warp count, so it cannot
        # call helpers on distributed tensors (the consumers' softmax); the loads need none. The constexprs go in
        # the partitions' argument lists themselves: put in a tuple first, they reach the partitions as tensors
        # (docs/compiler-workarounds.md)
        # one consumer function for every consumer warpgroup, its index WG the last argument
        if CONSUMERS == 1:
            gl.warp_specialize([
                (_producer, (descs, smem, bars, sizes, score_args, stats, packing, BLOCK_M, BLOCK_N, NUM_STAGES,
                             HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, SCALE_IN_EXP2, OVERLAP, PINGPONG,
                             TILE_LIST, SHARE_QO, VARLEN, ACROSS_TILES)),
                (_consumer, (descs, smem, bars, sizes, score_args, stats, packing, BLOCK_M, BLOCK_N, NUM_STAGES,
                             HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, SCALE_IN_EXP2, OVERLAP, PINGPONG,
                             TILE_LIST, SHARE_QO, VARLEN, ACROSS_TILES, EXP2_EMULATED, RESCALE_THRESHOLD, HAS_SINK,
                             HALF_DIAGONAL, 0)),
            ], [4], [CONSUMER_REGISTERS])
        elif CONSUMERS == 2:
            gl.warp_specialize([
                (_producer, (descs, smem, bars, sizes, score_args, stats, packing, BLOCK_M, BLOCK_N, NUM_STAGES,
                             HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, SCALE_IN_EXP2, OVERLAP, PINGPONG,
                             TILE_LIST, SHARE_QO, VARLEN, ACROSS_TILES)),
                (_consumer, (descs, smem, bars, sizes, score_args, stats, packing, BLOCK_M, BLOCK_N, NUM_STAGES,
                             HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, SCALE_IN_EXP2, OVERLAP, PINGPONG,
                             TILE_LIST, SHARE_QO, VARLEN, ACROSS_TILES, EXP2_EMULATED, RESCALE_THRESHOLD, HAS_SINK,
                             HALF_DIAGONAL, 0)),
                (_consumer, (descs, smem, bars, sizes, score_args, stats, packing, BLOCK_M, BLOCK_N, NUM_STAGES,
                             HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, SCALE_IN_EXP2, OVERLAP, PINGPONG,
                             TILE_LIST, SHARE_QO, VARLEN, ACROSS_TILES, EXP2_EMULATED, RESCALE_THRESHOLD, HAS_SINK,
                             HALF_DIAGONAL, 1)),
            ], [4, 4], [CONSUMER_REGISTERS] * 2)
        else:
            gl.warp_specialize([
                (_producer, (descs, smem, bars, sizes, score_args, stats, packing, BLOCK_M, BLOCK_N, NUM_STAGES,
                             HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, SCALE_IN_EXP2, OVERLAP, PINGPONG,
                             TILE_LIST, SHARE_QO, VARLEN, ACROSS_TILES)),
                (_consumer, (descs, smem, bars, sizes, score_args, stats, packing, BLOCK_M, BLOCK_N, NUM_STAGES,
                             HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, SCALE_IN_EXP2, OVERLAP, PINGPONG,
                             TILE_LIST, SHARE_QO, VARLEN, ACROSS_TILES, EXP2_EMULATED, RESCALE_THRESHOLD, HAS_SINK,
                             HALF_DIAGONAL, 0)),
                (_consumer, (descs, smem, bars, sizes, score_args, stats, packing, BLOCK_M, BLOCK_N, NUM_STAGES,
                             HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, SCALE_IN_EXP2, OVERLAP, PINGPONG,
                             TILE_LIST, SHARE_QO, VARLEN, ACROSS_TILES, EXP2_EMULATED, RESCALE_THRESHOLD, HAS_SINK,
                             HALF_DIAGONAL, 1)),
                (_consumer, (descs, smem, bars, sizes, score_args, stats, packing, BLOCK_M, BLOCK_N, NUM_STAGES,
                             HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, SCALE_IN_EXP2, OVERLAP, PINGPONG,
                             TILE_LIST, SHARE_QO, VARLEN, ACROSS_TILES, EXP2_EMULATED, RESCALE_THRESHOLD, HAS_SINK,
                             HALF_DIAGONAL, 2)),
            ], [4, 4, 4], [CONSUMER_REGISTERS] * 3)
