"""Attention dropout: the Philox 4x32-10 stream that decides which probabilities are kept.

Dropout acts on the normalised probabilities, as in flash-attn: out = (P * Z / (1 - p)) V with P = softmax(S) and
Z in {0, 1} the keep-mask; the log-sum-exp is that of S, unaffected. Nothing of size seqlen_q x seqlen_k is ever
stored: every pass (forward, backward, the torch backend, the Triton kernels, `return_attn_probs`) regenerates
the bits of Z it needs from a counter-based generator, so the decision for score element (b, h, i, j) is a
function of (seed, offset, b, h, i, j) alone, never of tiles, block sizes, schedules or backends.

The generator (one call's random numbers):
    key     = seed (64 bits: the low half is Philox's first key word, the high half its second)
    counter = (j // 4, i, b * nheads + h, stream),   stream = (offset // 4) mod 2**32
    r       = word j % 4 of Philox4x32-10(key, counter), an unsigned 32-bit integer
    keep    = r >= threshold,   threshold = min(round(p * 2**32), 2**32 - 1)
b is the batch entry (for packed sequences, the sequence's index), h the query head, i and j the query and key
positions within the sequence. Kept values are scaled by 1 / (1 - p); a value is kept with probability
(2**32 - threshold) / 2**32, 1 - p to within 2**-32. The four words of one Philox call serve four neighbouring
keys, so the Triton kernels run one call per four scores (triton.language.philox, whose rounds and constants are
those of Random123's philox4x32 and of `philox4x32` below, which reproduces them in int64 torch arithmetic: the
torch backend and the float64 oracle's tests use the same bits).

(seed, offset) come from torch's default generator of the tensors' device, so `torch.manual_seed` reproduces a
run: on a CUDA device its Philox seed and offset, the offset then advanced by OFFSET_STEP as torch's own Philox
ops advance it (consecutive calls get fresh masks); on any other device two draws from the CPU generator. A
call's (seed, offset) travel with it to the backward as a CPU int64 tensor of two elements (`draw_state`).
"""

from __future__ import annotations

import torch

# Philox 4x32 (Random123; triton.language.random uses the same)
ROUND_A = 0xD2511F53
ROUND_B = 0xCD9E8D57
KEY_A = 0x9E3779B9
KEY_B = 0xBB67AE85
ROUNDS = 10
MASK32 = 0xFFFFFFFF

# how far a call advances a CUDA generator's Philox offset (torch rounds its own increments to multiples of 4; a
# call takes one stream of counters, `stream` = offset // 4)
OFFSET_STEP = 4


def threshold(dropout_p: float) -> int:
    """The unsigned 32-bit threshold a random word must reach for its score to be kept."""
    return min(round(dropout_p * 2.0**32), MASK32)


def keep_scale(dropout_p: float) -> float:
    """The factor 1 / (1 - p) of kept probabilities."""
    return 1.0 / (1.0 - dropout_p)


def stream_of(offset: int) -> int:
    """The fourth counter word of a call with this generator offset."""
    return (offset >> 2) & MASK32


def draw_state(device: torch.device) -> torch.Tensor:
    """A call's (seed, offset) as a CPU int64 tensor of two elements (the seed's 64 bits stored as a signed value),
    taken from torch's default generator of `device` (module docstring).

    Raises ValueError while a CUDA graph is being captured: the generator's offset is read and advanced on the host,
    which a replayed graph would not repeat (every replay would drop the same entries)."""
    if device.type == "cuda":
        if torch.cuda.is_current_stream_capturing():
            raise ValueError("dropout_p > 0 cannot be captured in a CUDA graph: the dropout mask's seed and offset are "
                             "read from torch's generator on the host at every call; capture with dropout_p=0.0")
        index = device.index if device.index is not None else torch.cuda.current_device()
        generator = torch.cuda.default_generators[index]
        seed, offset = generator.initial_seed(), generator.get_offset()
        generator.set_offset(offset + OFFSET_STEP)
        if seed >= 2**63:
            seed -= 2**64
        return torch.tensor([seed, offset], dtype=torch.int64)
    return torch.randint(0, 2**63 - 1, (2,), dtype=torch.int64)


def _mulhilo(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32-bit halves of a * b for a 32-bit constant a and int64 b holding values in [0, 2**32), without
    leaving int64: a is split into 16-bit halves, so no product exceeds 2**48."""
    a_hi, a_lo = a >> 16, a & 0xFFFF
    p_lo = b * a_lo
    p_hi = b * a_hi
    return (p_hi + (p_lo >> 16)) >> 16, (((p_hi & 0xFFFF) << 16) + p_lo) & MASK32


def philox4x32(seed: int, c0, c1, c2, c3) -> tuple[torch.Tensor, ...]:
    """Philox4x32-10 of the counter (c0, c1, c2, c3) under the 64-bit key `seed` (low half first), as
    triton.language.philox computes it: four int64 tensors of unsigned 32-bit words. The counter words are int64
    tensors (or ints) in [0, 2**32) that broadcast together."""
    k0, k1 = seed & MASK32, (seed >> 32) & MASK32
    # the words live on the device of the tensors among them (an int becomes a tensor there, not on the CPU)
    device = next((c.device for c in (c0, c1, c2, c3) if isinstance(c, torch.Tensor)), None)
    c0, c1, c2, c3 = torch.broadcast_tensors(*(torch.as_tensor(c, dtype=torch.int64, device=device)
                                               for c in (c0, c1, c2, c3)))
    for _ in range(ROUNDS):
        hi_b, lo_b = _mulhilo(ROUND_B, c2)
        hi_a, lo_a = _mulhilo(ROUND_A, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = (k0 + KEY_A) & MASK32, (k1 + KEY_B) & MASK32
    return c0, c1, c2, c3


def keep_mask(rng_state: torch.Tensor, dropout_p: float, heads: torch.Tensor, i0: int, i1: int, j0: int, j1: int,
              device: torch.device) -> torch.Tensor:
    """The keep-mask (len(heads), i1 - i0, j1 - j0), bool, of query positions [i0, i1) and key positions [j0, j1) of
    the (batch entry, head) pairs `heads` (an int64 tensor of b * nheads + h), for a call whose (seed, offset) is
    rng_state (draw_state's tensor)."""
    seed, offset = (int(x) for x in rng_state.tolist())
    q0, q1 = j0 >> 2, (j1 + 3) >> 2  # the four-key groups that cover [j0, j1)
    quads = torch.arange(q0, q1, dtype=torch.int64, device=device)
    rows = torch.arange(i0, i1, dtype=torch.int64, device=device)
    words = philox4x32(seed, quads.view(1, 1, -1), rows.view(1, -1, 1), heads.to(device).view(-1, 1, 1),
                       stream_of(offset))
    r = torch.stack(words, dim=-1).flatten(-2)  # word j % 4 of group j // 4, in key order from 4 * q0
    r = r[..., j0 - 4 * q0:j1 - 4 * q0]
    return r >= threshold(dropout_p)


def dense_keep_mask(rng_state: torch.Tensor, dropout_p: float, batch: int, nheads: int, seqlen_q: int, seqlen_k: int,
                    device: torch.device | str = "cpu", first_batch: int = 0) -> torch.Tensor:
    """The whole keep-mask (batch, nheads, seqlen_q, seqlen_k), bool, of a call with this rng_state and dropout_p,
    for batch entries first_batch .. first_batch + batch - 1 (first_batch: a packed sequence's index)."""
    heads = torch.arange(first_batch * nheads, (first_batch + batch) * nheads, dtype=torch.int64)
    mask = keep_mask(rng_state, dropout_p, heads, 0, seqlen_q, 0, seqlen_k, torch.device(device))
    return mask.view(batch, nheads, seqlen_q, seqlen_k)
