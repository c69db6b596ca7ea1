"""Tile math shared by the forward and backward Triton kernels.

Scores are kept in base 2: s2 = log2(e) * s, so the softmax uses exp2 (LOG2E folded by the launcher
into the score scale, the softcap factor and the ALiBi slopes) and the log-sum-exp stays in log2
until the kernels' epilogue. The causal / window
band is the same as `flashtile._geometry`: query row i may attend key j iff
    (not HAS_LEFT  or j >= i + diagonal_offset - window_left) and
    (not HAS_RIGHT or j <= i + diagonal_offset + window_right).
Key blocks wholly outside the band are never visited; blocks wholly inside it skip the element
mask; only blocks that straddle an edge (or the ragged end of the sequence) pay for it.
A learnable sink (one natural-log logit per query head in every row's softmax denominator, flashtile._sink) is
where the online softmax starts (initial_row_stats): running max = the sink in base 2, running sum = 1.
"""

import triton
import triton.language as tl

# Written as literals inside the kernels (a module-level tl.constexpr breaks nested calls in the
# 3.9 CPU interpreter, and triton 3.6 rejects annotated globals): log2(e) = 1.4426950408889634,
# ln(2) = 0.6931471805599453.
LOG2E = 1.4426950408889634


@triton.jit
def tanh(x):
    """tanh through exp, stable for every |x|. (libdevice.tanh does not run in the CPU interpreter, triton 3.9.)"""
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def program_coordinates(inner_programs):
    """(inner index, outer index) of this program in a grid of inner_programs x outer programs laid out along
    CUDA's grid axis 0, the inner index fastest: axis 0 holds 2**31 - 1 programs, axes 1 and 2 only 65,535, which
    batch * nheads passes (4,096 sequences of 32 heads). Programs are dispatched in the order of a two-dimensional
    (inner, outer) grid: consecutive programs share an outer index (a head's K and V stay in L2)."""
    pid = tl.program_id(0)
    return pid % inner_programs, pid // inner_programs


@triton.jit
def program_heads(pid_bh, nheads, group_size):
    """(batch, head, K/V head) of a program over batch * nheads, as int64 so offsets cannot overflow.

    Grouped-query attention by index arithmetic: head h reads K/V head h // group_size.
    """
    b = (pid_bh // nheads).to(tl.int64)
    h = (pid_bh % nheads).to(tl.int64)
    return b, h, h // group_size


@triton.jit
def load_tile(ptrs, in_sequence, in_width, CHECK_SEQUENCE: tl.constexpr, CHECK_WIDTH: tl.constexpr):
    """Load a 2-D tile, zero-filled only along the axes that may leave the tensor.

    in_sequence / in_width are boolean tensors that broadcast to ptrs' shape: the tile's positions
    inside the sequence and inside the head dim. A mask costs predicates on every element of every
    load even where it is all true, and the compiler cannot prove that for a tile of a runtime range;
    so interior tiles of a loop (CHECK_SEQUENCE false: the caller knows they lie inside the sequence)
    and unpadded head dims (CHECK_WIDTH false: BLOCK_D == HEADDIM) load unmasked.
    """
    if CHECK_SEQUENCE and CHECK_WIDTH:
        tile = tl.load(ptrs, mask=in_sequence & in_width, other=0.0)
    elif CHECK_SEQUENCE:
        tile = tl.load(ptrs, mask=in_sequence, other=0.0)
    elif CHECK_WIDTH:
        tile = tl.load(ptrs, mask=in_width, other=0.0)
    else:
        tile = tl.load(ptrs)
    return tile


@triton.jit
def alibi_slope(Slopes, b, h, stride_slopes_b, HAS_ALIBI: tl.constexpr):
    """The (base-2 scaled) ALiBi slope of head h in batch b, or 0 without ALiBi."""
    slope = 0.0
    if HAS_ALIBI:
        slope = tl.load(Slopes + b * stride_slopes_b + h)
    return slope


@triton.jit
def sequence_bounds(CuSeqlensQ, CuSeqlensK, b, seqlen_q, seqlen_k, diagonal_offset, VARLEN: tl.constexpr):
    """(first query row, first key row, seqlen_q, seqlen_k, diagonal_offset) of batch entry b.

    Dense batches start every entry at row 0 and pass the arguments through. In a packed
    variable-length batch (VARLEN) entry b is sequence b: its rows are cu_seqlens[b] ..
    cu_seqlens[b + 1] - 1 of the packed tensors, and its causal diagonal is bottom-right aligned.
    """
    q_start = b * 0
    k_start = b * 0
    if VARLEN:
        q_start = tl.load(CuSeqlensQ + b).to(tl.int64)
        k_start = tl.load(CuSeqlensK + b).to(tl.int64)
        seqlen_q = (tl.load(CuSeqlensQ + b + 1) - q_start).to(tl.int32)
        seqlen_k = (tl.load(CuSeqlensK + b + 1) - k_start).to(tl.int32)
        diagonal_offset = seqlen_k - seqlen_q
    return q_start, k_start, seqlen_q, seqlen_k, diagonal_offset


@triton.jit
def descriptor_origin(b, start, VARLEN: tl.constexpr):
    """(batch coordinate, first row) of batch entry b in a host-side (batch, heads, rows, dim) descriptor, both int32
    (descriptor coordinates are; program_heads gives int64 for pointer offsets): a dense entry is the descriptors'
    batch b from row 0, a packed sequence (VARLEN) is in their one batch entry from its first row, `start`
    (sequence_bounds' q_start or k_start)."""
    batch = b.to(tl.int32)
    if VARLEN:
        batch = 0
    return batch, start.to(tl.int32)


@triton.jit
def key_block_bounds(m0, seqlen_k, diagonal_offset, window_left, window_right,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """Key blocks for query rows [m0, m0 + BLOCK_M): (lo, full_lo, full_hi, hi).

    Blocks start on multiples of BLOCK_N. [lo, full_lo) and [full_hi, hi) straddle a band edge or the
    ragged end of the keys and need the element mask; [full_lo, full_hi) lie wholly inside.
    """
    lo = 0
    full_lo = 0
    hi = seqlen_k
    full_hi = (seqlen_k // BLOCK_N) * BLOCK_N
    if HAS_LEFT:
        first_visible = tl.maximum(m0 + diagonal_offset - window_left, 0)
        lo = (first_visible // BLOCK_N) * BLOCK_N
        # the last row's left edge: blocks starting at or after it are visible to every row
        last_row_edge = tl.maximum(m0 + BLOCK_M - 1 + diagonal_offset - window_left, 0)
        full_lo = ((last_row_edge + BLOCK_N - 1) // BLOCK_N) * BLOCK_N
    if HAS_RIGHT:
        hi = tl.minimum(m0 + BLOCK_M + diagonal_offset + window_right, seqlen_k)
        # the first row's right edge (exclusive): blocks ending at or before it are visible to every row
        first_row_end = tl.maximum(m0 + diagonal_offset + window_right + 1, 0)
        full_hi = tl.minimum(full_hi, (first_row_end // BLOCK_N) * BLOCK_N)
    full_hi = tl.maximum(full_hi, full_lo)
    return lo, full_lo, full_hi, hi


@triton.jit
def query_block_bounds(n0, seqlen_q, seqlen_k, diagonal_offset, window_left, window_right,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """Query blocks that see keys [n0, n0 + BLOCK_N): (lo, full_lo, full_hi, hi), the mirror of key_block_bounds."""
    lo = 0
    full_lo = 0
    hi = seqlen_q
    full_hi = (seqlen_q // BLOCK_M) * BLOCK_M
    if HAS_RIGHT:
        first_visible = tl.maximum(n0 - diagonal_offset - window_right, 0)
        lo = (first_visible // BLOCK_M) * BLOCK_M
        # rows at or after this see the block's last key
        last_key_row = tl.maximum(n0 + BLOCK_N - 1 - diagonal_offset - window_right, 0)
        full_lo = ((last_key_row + BLOCK_M - 1) // BLOCK_M) * BLOCK_M
    if HAS_LEFT:
        hi = tl.minimum(n0 + BLOCK_N - diagonal_offset + window_left, seqlen_q)
        # rows before this (exclusive) still see the block's first key
        first_key_end = tl.maximum(n0 - diagonal_offset + window_left + 1, 0)
        full_hi = tl.minimum(full_hi, (first_key_end // BLOCK_M) * BLOCK_M)
    if n0 + BLOCK_N > seqlen_k:  # a ragged key block needs the mask in every tile
        full_hi = full_lo
    full_hi = tl.maximum(full_hi, full_lo)
    return lo, full_lo, full_hi, hi


@triton.jit
def band_mask(s, q_idx, k_idx, seqlen_q, seqlen_k, diagonal_offset, window_left, window_right,
              HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, PER_ROW_BAND: tl.constexpr = True):
    """s with -inf where a key lies outside the band or past the end of the keys, or the query past the end of the
    queries (positions as in scores).

    PER_ROW_BAND folds the bounds per query position first (its last visible key; -1 past the queries' end), so that
    each element of the tile pays one comparison per band edge: written as three conditions and-ed per element,
    triton 3.6 gave each its own select (three per element on a causal diagonal tile of the forward, one with the
    fold; with the scale inside the exponent, the d = 128 1k causal forward ran 5% faster on an H200;
    docs/schedules.md). Two kernels keep the per-element form, where the fold changed ptxas's register allocation
    for the worse: the decode kernel (197 -> 168 registers at 128-key page tiles, a third program per SM and a
    1.3-wave tail at batch 64 x 8 K/V heads, 18% slower) and the packed-batch backward (bwd.py; its dK/dV kernel
    spilled 536 -> 1,652 bytes per thread and ran 32% slower); docs/compiler-workarounds.md.
    """
    if PER_ROW_BAND:
        last_key = tl.where(q_idx < seqlen_q, seqlen_k - 1, -1)
        if HAS_RIGHT:
            last_key = tl.minimum(last_key, q_idx + diagonal_offset + window_right)
        allowed = k_idx <= last_key
    else:
        allowed = (k_idx < seqlen_k) & (q_idx < seqlen_q)
        if HAS_RIGHT:
            allowed = allowed & (k_idx <= q_idx + diagonal_offset + window_right)
    if HAS_LEFT:
        allowed = allowed & (k_idx >= q_idx + diagonal_offset - window_left)
    return tl.where(allowed, s, float("-inf"))


@triton.jit
def scores(qk, q_idx, k_idx, seqlen_q, seqlen_k, score_scale, softcap_scale, softcap_out, slope,
           diagonal_offset, window_left, window_right, mask_ptrs,
           MASKED: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
           HAS_ALIBI: tl.constexpr, MASK_KIND: tl.constexpr, UNSCALED: tl.constexpr = False,
           PER_ROW_BAND: tl.constexpr = True):
    """Final scores of a tile in base-2 units from its raw products qk, and tanh(raw / softcap) (for the backward).

    UNSCALED (no softcap, ALiBi or additive mask, and a positive scale; see online_softmax_step) leaves the
    products unscaled, masked entries -inf: the caller applies score_scale inside its exponent (exp2_of_scores).
    PER_ROW_BAND chooses band_mask's form.

    The tile may be oriented either way: q_idx and k_idx are the query and key positions as 2-D
    tensors that broadcast to qk's shape (queries as rows: q_idx (M, 1), k_idx (1, N); keys as rows
    in the dK/dV kernel: q_idx (1, M), k_idx (N, 1)); mask_ptrs has qk's shape.
    score_scale = softmax_scale * log2(e); with softcap, softcap_scale = softmax_scale / softcap and
    softcap_out = softcap * log2(e); slope is the ALiBi slope times log2(e). MASKED applies the band
    and sequence-end masks (-inf); MASK_KIND 1 / 2 applies a boolean / additive user mask.
    """
    if HAS_SOFTCAP:
        t = tanh(qk * softcap_scale)
        s = t * softcap_out
    else:
        t = qk
        s = qk if UNSCALED else qk * score_scale
    if HAS_ALIBI:
        distance = tl.abs(q_idx + diagonal_offset - k_idx).to(tl.float32)
        s = s - slope * distance
    tl.static_assert(not UNSCALED or not (HAS_SOFTCAP or HAS_ALIBI or MASK_KIND == 2),
                     "unscaled scores only where the scale is the sole transformation")
    if MASKED:
        s = band_mask(s, q_idx, k_idx, seqlen_q, seqlen_k, diagonal_offset, window_left, window_right, HAS_LEFT,
                      HAS_RIGHT, PER_ROW_BAND)
    if MASK_KIND != 0:
        in_bounds = (q_idx < seqlen_q) & (k_idx < seqlen_k)
        if MASK_KIND == 1:
            keep = tl.load(mask_ptrs, mask=in_bounds, other=0)  # uint8 view of a bool mask
            s = tl.where(keep != 0, s, float("-inf"))
        else:
            s = s + tl.load(mask_ptrs, mask=in_bounds, other=float("-inf")).to(tl.float32) * 1.4426950408889634
    return s, t


@triton.jit
def exp2_of_scores(s, shift, scale, SCALE_IN_EXP2: tl.constexpr):
    """exp2(s - shift) for base-2 scores s, or with SCALE_IN_EXP2 for the unscaled products that scale (> 0) turns
    into base-2 scores: exp2(s * scale - shift), one fused multiply-add per score instead of a multiply and a
    subtraction (shift broadcasts to s: the forward's row max, the backward's lse)."""
    if SCALE_IN_EXP2:
        p = tl.exp2(s * scale - shift)
    else:
        p = tl.exp2(s - shift)
    return p


# 2^f for f in [-0.5, 0.5] as 1 + f (c1 + f (c2 + f c3)): a minimax cubic with p(0) = 1 exact, maximum relative
# error 1.014e-4 (float32 evaluation included), below the rounding of P to fp16 (2^-11 = 4.9e-4) or bf16 (2^-9 =
# 2.0e-3) for its matmul. The coefficients are float32 values; fwd_gluon._exp2_on_fma_units writes the same three in
# PTX hex (0f3F317AFD, 0f3E780610, 0f3D6150CB; tests/test_fa4.py checks that they agree). docs/schedules.md.
EXP2_POLY_COEFFICIENTS = (0.6932829022407532, 0.24221062660217285, 0.05500869080424309)  # c1, c2, c3
EXP2_POLY_MAX_RELATIVE_ERROR = 1.015e-4


@triton.jit
def exp2_poly(x):
    """2^x on the FMA units, without the exp2 (MUFU) instruction: x (float32, x < 128, -inf allowed) is clamped at
    -127 and split as n + f, n = round(x) and f = x - n in [-0.5, 0.5]; 2^f by the cubic of EXP2_POLY_COEFFICIENTS;
    n added into the float's exponent bits (bitcast). Relative error 1.0e-4 for x >= -126; from -127 down (and
    -inf) the result is exactly 0 (f = 0 gives 1.0, whose biased exponent 127 drops to 0); between -127 and -126
    (values below 2^-126, float32's subnormals) it is within 2^-126 of 2^x."""
    x = tl.maximum(x, -127.0)
    n = tl.floor(x + 0.5)
    f = x - n
    p = tl.fma(f, 0.05500869080424309, 0.24221062660217285)
    p = tl.fma(p, f, 0.6932829022407532)
    p = tl.fma(p, f, 1.0)
    bits = p.to(tl.int32, bitcast=True) + (n.to(tl.int32) << 23)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def exp2_columns(x, POLY_EVERY: tl.constexpr):
    """2^x of an (M, N) tile of float32, one column in POLY_EVERY (2, 4 or 8; columns j with j % POLY_EVERY ==
    POLY_EVERY - 1) by exp2_poly on the FMA units and the others by exp2 (FlashAttention-4's split of the
    exponentials between the two units); POLY_EVERY 0: every column by exp2. N is a multiple of POLY_EVERY."""
    if POLY_EVERY == 0:
        y = tl.exp2(x)
    elif POLY_EVERY == 2:
        # columns 2i + 1 by the polynomial
        M: tl.constexpr = x.shape[0]
        N: tl.constexpr = x.shape[1]
        even, odd = tl.split(tl.reshape(x, (M, N // 2, 2)))
        y = tl.reshape(tl.join(tl.exp2(even), exp2_poly(odd)), (M, N))
    elif POLY_EVERY == 4:
        # the odd columns' odd columns: 4i + 3
        M: tl.constexpr = x.shape[0]
        N: tl.constexpr = x.shape[1]
        even, odd = tl.split(tl.reshape(x, (M, N // 2, 2)))
        odd_even, odd_odd = tl.split(tl.reshape(odd, (M, N // 4, 2)))
        odd = tl.reshape(tl.join(tl.exp2(odd_even), exp2_poly(odd_odd)), (M, N // 2))
        y = tl.reshape(tl.join(tl.exp2(even), odd), (M, N))
    else:
        # columns 8i + 7
        tl.static_assert(POLY_EVERY == 8, "one exponential in 2, 4 or 8 on the FMA units, or none")
        M: tl.constexpr = x.shape[0]
        N: tl.constexpr = x.shape[1]
        even, odd = tl.split(tl.reshape(x, (M, N // 2, 2)))
        odd_even, odd_odd = tl.split(tl.reshape(odd, (M, N // 4, 2)))
        odd3_even, odd3_odd = tl.split(tl.reshape(odd_odd, (M, N // 8, 2)))
        odd_odd = tl.reshape(tl.join(tl.exp2(odd3_even), exp2_poly(odd3_odd)), (M, N // 4))
        odd = tl.reshape(tl.join(tl.exp2(odd_even), odd_odd), (M, N // 2))
        y = tl.reshape(tl.join(tl.exp2(even), odd), (M, N))
    return y


@triton.jit
def online_softmax_step(acc, l_i, m_i, s, v, scale, MASKED: tl.constexpr, MASK_KIND: tl.constexpr,
                        DOT_PRECISION: tl.constexpr, SCALE_IN_EXP2: tl.constexpr,
                        RESCALE_THRESHOLD: tl.constexpr = 0, EXP2_POLY_EVERY: tl.constexpr = 0,
                        HAS_DROPOUT: tl.constexpr = False, keep=None):
    """Fold one tile of scores s (M, N) and its values v (N, DV) into (acc, l, m); m is in base-2 units.

    s is in base-2 units, or with SCALE_IN_EXP2 the unscaled products (scores(..., UNSCALED=True)) that
    scale (> 0) turns into base-2 units: the row max is then scaled once per row and the scale goes inside the
    exponent (exp2_of_scores; with the max taken on the scaled tile the compiler cannot fuse the multiply). A
    positive scale keeps the max where it was.
    With a band mask (MASKED) or a user mask a row may have seen only -inf scores so far.

    FlashAttention-4's two moves (the fa4 schedule; both 0 elsewhere, which compiles to the plain step):
    RESCALE_THRESHOLD = t > 0: a row keeps its running max m while the block's max exceeds it by at most t (base-2
    units), so that its acc and l are not rescaled (their factor is exactly 1); a larger rise moves m to the new
    max. Every probability stays at most 2^t, and out = acc / l is exact because both use the same m. The acc
    multiply is skipped for the whole tile when no row moved. EXP2_POLY_EVERY = n: one probability column in n by
    exp2_poly (exp2_columns).

    HAS_DROPOUT: only the probabilities where keep (M, N) is true reach acc; l sums them all (dropout acts on the
    normalised probabilities, so the caller scales the finished rows by 1 / (1 - p)).
    """
    row_max = tl.max(s, 1)
    if SCALE_IN_EXP2:
        row_max = row_max * scale
    if RESCALE_THRESHOLD > 0:
        # move a row's max only when the block's max exceeds it by more than the threshold (-inf rows: any key)
        m_new = tl.where(row_max > m_i + RESCALE_THRESHOLD, row_max, m_i)
    else:
        m_new = tl.maximum(m_i, row_max)
    if MASKED or MASK_KIND != 0:
        # a row that has seen only masked keys keeps max -inf: shift by 0 so exp2 gives 0, not NaN
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_shift = m_new
    if EXP2_POLY_EVERY == 0:
        p = exp2_of_scores(s, m_shift[:, None], scale, SCALE_IN_EXP2)
    elif SCALE_IN_EXP2:
        p = exp2_columns(s * scale - m_shift[:, None], EXP2_POLY_EVERY)
    else:
        p = exp2_columns(s - m_shift[:, None], EXP2_POLY_EVERY)
    # rescale what was accumulated against the old max (0 on the first visible block)
    alpha = tl.exp2(m_i - m_shift)
    l_i = l_i * alpha + tl.sum(p, 1)
    if HAS_DROPOUT:
        p = tl.where(keep, p, 0.0)
    if RESCALE_THRESHOLD > 0:
        # alpha is exactly 1 for the rows that kept their max: skip the multiply when every row did
        if tl.max((m_new != m_i).to(tl.int32), 0) > 0:
            acc = acc * alpha[:, None]
        acc = acc + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, l_i, m_new


@triton.jit
def initial_row_stats(Sink, heads, BLOCK_M: tl.constexpr, HAS_SINK: tl.constexpr):
    """(m, l) of BLOCK_M rows before their first key block: (-inf, 0), or with HAS_SINK the sink's own term of the
    softmax, m = the sink of each row's head in base 2 (Sink[heads] * log2(e): a natural-log logit, not multiplied
    by the softmax scale) and l = exp2(m - m) = 1. heads: the query head of every row (a scalar, or BLOCK_M heads,
    each a valid index into Sink, which holds nheads logits, any float dtype). Every later step keeps the sink's
    term in l (rescaled with it), so finish_rows' lse includes it and a row that sees no key ends with out = 0 and
    lse = the sink."""
    if HAS_SINK:
        sink = tl.load(Sink + heads).to(tl.float32) * 1.4426950408889634
        m_i = tl.zeros([BLOCK_M], dtype=tl.float32) + sink
        l_i = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    return m_i, l_i


@triton.jit
def finish_rows(acc, l_i, m_i):
    """Normalise once: (out, natural lse); rows that saw no key give out = 0 and lse = -inf (with a sink, l
    counts the sink's term: out = 0 and lse = the sink)."""
    seen = l_i > 0
    l_safe = tl.where(seen, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = tl.where(seen, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))  # ln 2: back to natural log
    return out, lse


@triton.jit
def dropout_state(RngState):
    """(seed, stream) of a call's dropout stream (flashtile._dropout): RngState holds the 64-bit seed and the stream
    word as two int64 (launch._dropout_args)."""
    seed = tl.load(RngState)
    stream = tl.load(RngState + 1).to(tl.int32)
    return seed, stream


@triton.jit
def dropout_keep(seed, stream, row, q_idx, n0, threshold, BLOCK_N: tl.constexpr):
    """The dropout keep-mask (M, BLOCK_N) of query positions q_idx (M,) against keys [n0, n0 + BLOCK_N), n0 a multiple
    of 4, of the (batch entry, head) pair row = b * nheads + h: key j is kept where word j % 4 of
    Philox4x32-10(seed; j // 4, i, row, stream) reaches the unsigned threshold (flashtile._dropout). `threshold` is
    that threshold - 2**31, compared with the words' top bit flipped, which maps unsigned order onto int32 order. One
    Philox call serves four keys; a function of the positions alone, so any tile gives the same bits."""
    M: tl.constexpr = q_idx.shape[0]
    quads = n0 // 4 + tl.arange(0, BLOCK_N // 4)
    c0 = quads[None, :] + q_idx[:, None] * 0
    c1 = q_idx[:, None] + quads[None, :] * 0
    c2 = c0 * 0 + row.to(tl.int32)
    c3 = c0 * 0 + stream
    r0, r1, r2, r3 = tl.philox(seed, c0, c1, c2, c3)
    # the four words of each call side by side: key 4g + w takes word w of call g
    r = tl.reshape(tl.join(tl.join(r0, r2), tl.join(r1, r3)), (M, BLOCK_N))
    return (r.to(tl.int32, bitcast=True) ^ -2147483648) >= threshold
