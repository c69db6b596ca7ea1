"""Which key positions a block of query rows can see: the arithmetic behind block skipping.

Causal and sliding-window masks are a band around a diagonal (see `AttentionProblem`). A tile of
query rows [i0, i1) x key columns [j0, j1) is either wholly outside the band (skipped: never
loaded, never computed), wholly inside it (no element mask needed), or straddles an edge (the
only tiles that pay for an element mask). Pure integer arithmetic, shared by every backend.
"""

from __future__ import annotations

from ._validate import AttentionProblem


def visible_key_range(problem: AttentionProblem, i0: int, i1: int) -> tuple[int, int]:
    """Half-open range [lo, hi) of keys that at least one row in [i0, i1) may attend (may be empty)."""
    lo, hi = 0, problem.seqlen_k
    if problem.window_left >= 0:
        lo = max(lo, i0 + problem.diagonal_offset - problem.window_left)
    if problem.window_right >= 0:
        hi = min(hi, i1 - 1 + problem.diagonal_offset + problem.window_right + 1)
    return lo, max(lo, hi)


def visible_query_range(problem: AttentionProblem, j0: int, j1: int) -> tuple[int, int]:
    """Half-open range [lo, hi) of query rows that may attend at least one key in [j0, j1)."""
    lo, hi = 0, problem.seqlen_q
    if problem.window_right >= 0:
        lo = max(lo, j0 - problem.diagonal_offset - problem.window_right)
    if problem.window_left >= 0:
        hi = min(hi, j1 - 1 - problem.diagonal_offset + problem.window_left + 1)
    return lo, max(lo, hi)


def tile_is_inside_band(problem: AttentionProblem, i0: int, i1: int, j0: int, j1: int) -> bool:
    """True when every row in [i0, i1) may attend every key in [j0, j1): no element mask needed."""
    if problem.window_left >= 0 and j0 < (i1 - 1) + problem.diagonal_offset - problem.window_left:
        return False
    if problem.window_right >= 0 and j1 - 1 > i0 + problem.diagonal_offset + problem.window_right:
        return False
    return True


def key_blocks(problem: AttentionProblem, i0: int, i1: int, block_k: int, aligned: bool = False):
    """Yield (j0, j1, needs_element_mask) for the key blocks that rows [i0, i1) must visit.

    aligned=False starts the first block exactly at the band's edge (tightest, for the torch path);
    aligned=True keeps blocks on multiples of block_k (what a GPU grid with fixed tiles does).
    """
    lo, hi = visible_key_range(problem, i0, i1)
    start = lo - lo % block_k if aligned else lo
    for j0 in range(start, hi, block_k):
        j1 = min(j0 + block_k, problem.seqlen_k if aligned else hi)
        yield j0, j1, not tile_is_inside_band(problem, i0, i1, j0, j1)


def query_blocks(problem: AttentionProblem, j0: int, j1: int, block_q: int):
    """Yield (block index, i0, i1, k0, k1, needs_element_mask) for the aligned query blocks that see
    keys [j0, j1), where [k0, k1) is the part of [j0, j1) that rows [i0, i1) can see at all (the
    key block trimmed to the band, so tiles on the diagonal do not compute their invisible half)."""
    lo, hi = visible_query_range(problem, j0, j1)
    for i0 in range(lo - lo % block_q, hi, block_q):
        i1 = min(i0 + block_q, problem.seqlen_q)
        k_lo, k_hi = visible_key_range(problem, i0, i1)
        k0, k1 = max(j0, k_lo), min(j1, k_hi)
        if k0 < k1:
            yield i0 // block_q, i0, i1, k0, k1, not tile_is_inside_band(problem, i0, i1, k0, k1)


def count_visited_tiles(problem: AttentionProblem, block_q: int, block_k: int,
                        aligned: bool = False) -> tuple[int, int, int]:
    """(tiles visited, of which need an element mask, tiles in the full grid)."""
    visited = masked = 0
    for i0 in range(0, problem.seqlen_q, block_q):
        for _, _, needs_mask in key_blocks(problem, i0, min(i0 + block_q, problem.seqlen_q), block_k, aligned):
            visited += 1
            masked += needs_mask
    full = -(-problem.seqlen_q // block_q) * -(-problem.seqlen_k // block_k)
    return visited, masked, full
