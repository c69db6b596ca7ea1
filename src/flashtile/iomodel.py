"""How much work and memory traffic attention needs: materialised versus tiled, and the roofline.

This module turns the design docs' accounting into functions. It only does arithmetic; it never
touches a tensor.

Notation: batch B, heads H, query length Sq, key length Sk, head dim d (the value head dim is d too),
and `element_bytes` bytes per element of q, k, v, o and the gradients (2 for bf16/fp16, 4 for fp32).

FLOPs count only the matrix multiplications; the exp, max and sum of the softmax are left out.
  - Forward: S = Q K^T and O = P V, 2*Sq*Sk*d each, so 4*B*H*Sq*Sk*d.
  - Backward: dV = P^T dO, dP = dO V^T, dQ = dS K and dK = dS^T Q are 4 matmuls (2x the forward).
    A tiled backward also recomputes S = Q K^T from the saved log-sum-exp: 5 matmuls (2.5x).
  - Causal: only the half of the score matrix on or below the diagonal is computed (x0.5).
`benchmark_flops` is the convention that benchmarks divide by to report TFLOP/s (the FlashAttention
papers'): 2.5x the forward for every backward, 3.5x for forward + backward, whichever algorithm
ran, so that TFLOP/s compare the same useful work.

HBM bytes count each tensor crossing between off-chip memory and the chip once per crossing:
  - Materialised forward: read Q, K, V, write O, and 4 crossings of the Sq x Sk matrices: write S,
    read S (for the softmax), write P, read P (for P V). For Sq = Sk = N >> d the score traffic
    dominates and the arithmetic intensity tends to 4*N^2*d / (4*N^2*element_bytes) = d / element_bytes,
    i.e. d/2 FLOP/byte at 2 bytes per element: far below any GPU's ridge point, so it is memory-bound.
  - Materialised backward (P saved by the forward; D = rowsum(dO * O) costs O(Sq*d)): read Q, K, V,
    O, dO, write dQ, dK, dV, and 7 crossings of Sq x Sk matrices: read P twice (for dV = P^T dO and
    for dS), write dP and read it back (for dS), write dS and read it twice (for dQ and for dK).
  - Tiled forward: read Q, K, V once, write O once, and write the float32 log-sum-exp (4 bytes per
    query row). Scores live only on chip.
  - Tiled backward: read Q, K, V, O, dO and the float32 log-sum-exp, write dQ, dK, dV.
  - Causal: the materialised models move half the score traffic (an implementation that touched only
    the lower triangle; eager PyTorch writes the whole matrix and moves up to twice this). The tiled
    models are unchanged: every row of Q, K, V, O still crosses once.
The tiled counts are the compulsory traffic. Real kernels re-read K and V once per query block (mostly
served by L2) and keep a float32 dQ accumulator, so they move somewhat more; the bound is optimistic.

The roofline turns a (FLOPs, bytes) cost into the shortest possible time on a device:
max(flops / peak FLOP/s, bytes / bandwidth). Peaks come from measurement (what `flashtile bench` does)
or from the datasheet table below.

Finally the FlashAttention paper's asymptotic access counts (in elements, constants dropped), with
sequence length T and M elements of on-chip memory: standard attention makes T^2 + T*d accesses, the
tiled algorithm T^2*d^2/M + T*d. Their ratio grows with T towards M/d^2 (11.7 for d = 64, M = 48000).
"""

from __future__ import annotations

from dataclasses import dataclass

MODES = ("fwd", "bwd", "fwd+bwd")
MODELS = ("materialised", "tiled")
LSE_BYTES = 4  # the log-sum-exp is float32 whatever the input dtype

# Reporting convention: FLOPs of each mode as a multiple of the forward's.
BENCHMARK_FLOP_FACTORS = {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}
# Matmuls each algorithm actually runs, as a multiple of the forward's (see the module docstring).
_BACKWARD_FLOP_FACTORS = {"materialised": 2.0, "tiled": 2.5}
# Crossings of an Sq x Sk matrix in the materialised algorithm.
_MATERIALISED_FORWARD_SCORE_CROSSINGS = 4
_MATERIALISED_BACKWARD_SCORE_CROSSINGS = 7


@dataclass(frozen=True)
class AttentionShape:
    """One attention problem's sizes: q (batch, nheads, seqlen_q, headdim), k and v
    (batch, nheads, seqlen_k, headdim); `causal` masks keys after each query's diagonal."""

    batch: int
    nheads: int
    seqlen_q: int
    seqlen_k: int
    headdim: int
    causal: bool

    def __post_init__(self) -> None:
        for name in ("batch", "nheads", "seqlen_q", "seqlen_k", "headdim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")

    @property
    def score_pairs(self) -> float:
        """(query, key) pairs whose score is computed, over all batches and heads: B*H*Sq*Sk, x0.5 causal."""
        return self.batch * self.nheads * self.seqlen_q * self.seqlen_k * (0.5 if self.causal else 1.0)

    @property
    def query_elements(self) -> int:
        """Elements of one query-side tensor (Q, O, dO or dQ): B*H*Sq*d."""
        return self.batch * self.nheads * self.seqlen_q * self.headdim

    @property
    def key_elements(self) -> int:
        """Elements of one key-side tensor (K, V, dK or dV): B*H*Sk*d."""
        return self.batch * self.nheads * self.seqlen_k * self.headdim


@dataclass(frozen=True)
class Cost:
    """FLOPs and HBM bytes of one call; `intensity` is FLOPs per byte."""

    flops: float
    hbm_bytes: float

    @property
    def intensity(self) -> float:
        return self.flops / self.hbm_bytes

    def __add__(self, other: Cost) -> Cost:
        return Cost(self.flops + other.flops, self.hbm_bytes + other.hbm_bytes)


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}; got {mode!r}")


def _check_element_bytes(element_bytes: int) -> None:
    if isinstance(element_bytes, bool) or not isinstance(element_bytes, int) or element_bytes < 1:
        raise ValueError(f"element_bytes must be a positive int, got {element_bytes!r}")


def forward_flops(shape: AttentionShape) -> float:
    """Matmul FLOPs of the forward pass: 4 * B * H * Sq * Sk * d, x0.5 when causal."""
    return 4.0 * shape.score_pairs * shape.headdim


def benchmark_flops(shape: AttentionShape, mode: str) -> float:
    """FLOPs that benchmarks divide by to report TFLOP/s: the forward's, x2.5 for "bwd", x3.5 for
    "fwd+bwd", the same for every implementation (the FlashAttention papers' convention)."""
    _check_mode(mode)
    return BENCHMARK_FLOP_FACTORS[mode] * forward_flops(shape)


def materialised_cost(shape: AttentionShape, mode: str, element_bytes: int) -> Cost:
    """FLOPs and HBM bytes of attention that writes the Sq x Sk scores and probabilities to memory.

    Forward: Q, K, V read, O written, 4 crossings of the score matrix. Backward: Q, K, V, O, dO
    read, dQ, dK, dV written, 7 crossings (see the module docstring). "fwd+bwd" is their sum.
    """
    _check_mode(mode)
    _check_element_bytes(element_bytes)
    forward = Cost(
        flops=forward_flops(shape),
        # Q, O on the query side and K, V on the key side, plus the score-matrix crossings
        hbm_bytes=element_bytes * (2 * shape.query_elements + 2 * shape.key_elements
                                   + _MATERIALISED_FORWARD_SCORE_CROSSINGS * shape.score_pairs))
    backward = Cost(
        flops=_BACKWARD_FLOP_FACTORS["materialised"] * forward_flops(shape),
        # Q, O, dO read and dQ written; K, V read and dK, dV written; plus the score-matrix crossings
        hbm_bytes=element_bytes * (4 * shape.query_elements + 4 * shape.key_elements
                                   + _MATERIALISED_BACKWARD_SCORE_CROSSINGS * shape.score_pairs))
    return {"fwd": forward, "bwd": backward, "fwd+bwd": forward + backward}[mode]


def tiled_cost(shape: AttentionShape, mode: str, element_bytes: int) -> Cost:
    """FLOPs and compulsory HBM bytes of tiled (FlashAttention) attention, scores kept on chip.

    Forward: Q, K, V read, O and the float32 log-sum-exp written. Backward: Q, K, V, O, dO and the
    log-sum-exp read, dQ, dK, dV written; it recomputes S, so it runs 2.5x the forward's FLOPs.
    """
    _check_mode(mode)
    _check_element_bytes(element_bytes)
    lse_bytes = LSE_BYTES * shape.batch * shape.nheads * shape.seqlen_q
    forward = Cost(flops=forward_flops(shape),
                   hbm_bytes=element_bytes * (2 * shape.query_elements + 2 * shape.key_elements) + lse_bytes)
    backward = Cost(flops=_BACKWARD_FLOP_FACTORS["tiled"] * forward_flops(shape),
                    hbm_bytes=element_bytes * (4 * shape.query_elements + 4 * shape.key_elements) + lse_bytes)
    return {"fwd": forward, "bwd": backward, "fwd+bwd": forward + backward}[mode]


def fa1_forward_cost(shape: AttentionShape, element_bytes: int, block_n: int) -> Cost:
    """FLOPs and HBM bytes of the FA1 loop order's forward (key blocks outer, query blocks inner): the tiled forward's
    compulsory traffic, plus, for every block of `block_n` keys, the float32 output, row max and row sum of every
    query row it reaches read and written once (B*H*Sq*(4*d + 8) bytes each way; about half the blocks reach a row
    when causal). The state's first read and last write are counted like the others: an upper estimate by one pass.
    """
    _check_element_bytes(element_bytes)
    if isinstance(block_n, bool) or not isinstance(block_n, int) or block_n < 1:
        raise ValueError(f"block_n must be a positive int, got {block_n!r}")
    passes = -(-shape.seqlen_k // block_n) * (0.5 if shape.causal else 1.0)
    state_bytes = shape.batch * shape.nheads * shape.seqlen_q * (4 * shape.headdim + 8)
    forward = tiled_cost(shape, "fwd", element_bytes)
    return Cost(forward.flops, forward.hbm_bytes + 2 * passes * state_bytes)


def cost(model: str, shape: AttentionShape, mode: str, element_bytes: int) -> Cost:
    """`materialised_cost` or `tiled_cost`, chosen by `model` ("materialised" or "tiled")."""
    if model == "materialised":
        return materialised_cost(shape, mode, element_bytes)
    if model == "tiled":
        return tiled_cost(shape, mode, element_bytes)
    raise ValueError(f"model must be one of {', '.join(MODELS)}; got {model!r}")


@dataclass(frozen=True)
class Roofline:
    """A device's ceilings: `peak_flops` in FLOP/s and `bandwidth` in bytes/s (read + written)."""

    peak_flops: float
    bandwidth: float
    source: str

    def __post_init__(self) -> None:
        if not (self.peak_flops > 0 and self.bandwidth > 0):
            raise ValueError(f"peak_flops and bandwidth must be positive, got {self.peak_flops} and {self.bandwidth}")

    @property
    def ridge_intensity(self) -> float:
        """FLOPs per byte above which a kernel is compute-bound on this device."""
        return self.peak_flops / self.bandwidth

    def predicted_seconds(self, cost: Cost) -> float:
        """The roofline bound: the shortest time `cost` can take, max(flops / peak, bytes / bandwidth)."""
        return max(cost.flops / self.peak_flops, cost.hbm_bytes / self.bandwidth)


# Dense bf16/fp16 tensor-core peaks and HBM bandwidth from the vendors' datasheets (SXM parts).
DATASHEET_ROOFLINES = {
    "A100": Roofline(peak_flops=312e12, bandwidth=2.0e12, source="A100 datasheet (dense bf16, HBM2e)"),
    "H100 SXM": Roofline(peak_flops=989e12, bandwidth=3.35e12, source="H100 SXM datasheet (dense bf16, HBM3)"),
    "H200": Roofline(peak_flops=989e12, bandwidth=4.8e12, source="H200 datasheet (dense bf16, HBM3e)"),
    "B200": Roofline(peak_flops=2250e12, bandwidth=8.0e12, source="B200 datasheet (dense bf16, HBM3e)"),
}


def datasheet_roofline(device_name: str) -> Roofline | None:
    """The table entry for a device name as torch reports it ("NVIDIA H200", "NVIDIA H100 80GB HBM3",
    "NVIDIA A100-SXM4-80GB", ...), or None when the table has no entry for it.

    H100 PCIe and NVL parts have lower peaks than the SXM part and get None, as does any other device.
    """
    name = device_name.upper()
    if "H200" in name:
        return DATASHEET_ROOFLINES["H200"]
    if "B200" in name:
        return DATASHEET_ROOFLINES["B200"]
    if "A100" in name:
        return DATASHEET_ROOFLINES["A100"]
    if "H100" in name and ("SXM" in name or "HBM3" in name):
        return DATASHEET_ROOFLINES["H100 SXM"]
    return None


def _check_access_model(seqlen: int, headdim: int, sram_elements: float | None = None) -> None:
    if seqlen < 1 or headdim < 1:
        raise ValueError(f"seqlen and headdim must be positive, got {seqlen} and {headdim}")
    if sram_elements is not None and not sram_elements > 0:
        raise ValueError(f"sram_elements must be positive, got {sram_elements}")


def standard_accesses(seqlen: int, headdim: int) -> float:
    """The FlashAttention paper's HBM access count of standard attention: T^2 + T*d (elements, per head)."""
    _check_access_model(seqlen, headdim)
    return float(seqlen) ** 2 + seqlen * headdim


def tiled_accesses(seqlen: int, headdim: int, sram_elements: float) -> float:
    """The paper's count for the tiled algorithm with `sram_elements` (M) of on-chip memory:
    T^2 * d^2 / M + T*d. A block of about M/d query rows fits on chip, so K and V (T*d elements)
    are read once for each of the T*d/M query blocks: T^2 * d^2 / M in all."""
    _check_access_model(seqlen, headdim, sram_elements)
    return float(seqlen) ** 2 * headdim ** 2 / sram_elements + seqlen * headdim


def access_ratio(seqlen: int, headdim: int, sram_elements: float) -> float:
    """standard_accesses / tiled_accesses: how many times fewer accesses tiling makes at length T."""
    return standard_accesses(seqlen, headdim) / tiled_accesses(seqlen, headdim, sram_elements)


def access_ratio_limit(headdim: int, sram_elements: float) -> float:
    """The limit of `access_ratio` as T grows: M / d^2."""
    _check_access_model(1, headdim, sram_elements)
    return sram_elements / headdim ** 2
