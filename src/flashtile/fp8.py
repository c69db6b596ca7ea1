"""FP8 (float8_e4m3fn) quantisation of attention inputs, with an optional random Hadamard rotation.

What this module provides: the preparation of q, k, v for an FP8 attention kernel and the exact definition of
what such a kernel computes with. It contains no kernel; flashtile's attention functions do not accept FP8
tensors yet (docs/fp8.md).

Scales ("descales", flash-attn's name: the factor that turns the stored FP8 number back into the real value).
Tensors are in flash-attn's layout, q (batch, seqlen_q, nheads, headdim), k (batch, seqlen_k, nheads_k, headdim),
v (batch, seqlen_k, nheads_k, headdim_v), and query head h belongs to key/value head h // (nheads // nheads_k).

  per-tensor (block=None), flash-attn's FP8 interface: q_descale, k_descale and v_descale are float32 of shape
      (batch, nheads_k). One scale covers all rows of one key/value head of one sequence; for q it covers the
      nheads // nheads_k query heads of that group together.
          q[b, s, h, :] = float32(q_fp8[b, s, h, :]) * q_descale[b, h // (nheads // nheads_k)]
          k[b, s, h, :] = float32(k_fp8[b, s, h, :]) * k_descale[b, h]          (v likewise)
  block (block=B), FlashAttention-3's block quantisation: one scale per (batch, head, block of B rows), each
      tensor over its own heads:
          q_descale (batch, nheads,   ceil(seqlen_q / B)),   k_descale, v_descale (batch, nheads_k, ceil(seqlen_k / B))
          x[b, s, h, :] = float32(x_fp8[b, s, h, :]) * x_descale[b, h, s // B]
      The last block of a length that B does not divide holds the remaining rows. A kernel whose tile is B rows
      (or a multiple of B) applies one scale per tile of scores; 128 is the Hopper kernels' tile.

Each scale is amax / 448, where amax is the largest magnitude in the group (after the rotation, if any) and 448 the
largest finite e4m3 number, so the largest element maps to +-448. A group of zeros (including padding past a
sequence's end) gets the scale 1, never 0 or NaN. Values are divided by the scale in float32 (float64 for float64
inputs) and rounded to nearest in e4m3.

Rotation (rotate=True): q and k are multiplied on the right by the orthogonal matrix R = diag(signs) H / sqrt(d) (H
the d x d Sylvester-Hadamard matrix, signs a random +-1 vector, the same for every head), computed by the fast
Walsh-Hadamard transform in O(d log d) per row. Because R R^T = I, (q R)(k R)^T = q k^T: the scores, and so the
attention output, are unchanged, and a kernel needs to know nothing about the rotation. v is never rotated (its
rotation would not cancel inside P V). Why it helps: an outlier channel l makes the product q_l k_l dominate the
scores it enters, and rounding each factor to e4m3's 3 mantissa bits errs by up to 2^-4 of that large product; after
the rotation every channel is a +-1 mix of all d channels over sqrt(d), the outlier's energy is spread over the row,
and the rounding errors of d comparable products average out instead. The head dim must be a power of two for the
transform.

When to use what: e4m3 is floating point, so a scale mostly decides which values fall below its normal range; the
relative rounding of the rest is the same under any scale. Block scales therefore help only where magnitudes vary by
orders along the sequence, and cost one more scale per tile in a kernel. The rotation helps when individual channels
of q and k carry outliers (the usual case in trained language models), and the more keys a row has, the more it
helps; it costs a transform of q per call and of k once per key (when it enters a cache). With Gaussian inputs
neither changes the error measurably. The accuracy report (`flashtile bench --fp8`,
flashtile.bench.fp8.accuracy_report) measures all of them; docs/fp8.md has its results.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch
from torch import Tensor

from ._validate import _check_flash_qkv, _require_bool, _require_tensor

__all__ = ["E4M3_MAX", "FP8_DTYPE", "QuantizedQKV", "dequantize", "descale_shapes", "hadamard_transform",
           "quantize", "random_signs"]

FP8_DTYPE = torch.float8_e4m3fn
E4M3_MAX = 448.0  # the largest finite float8_e4m3fn value
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_DIMS = ("batch", "seqlen", "nheads", "headdim")


def _working_dtype(dtype: torch.dtype) -> torch.dtype:
    # half-precision inputs are transformed and scaled in float32 (the kernel's dequantisation dtype); float64 stays
    # float64 so that exactness can be checked
    return torch.float64 if dtype == torch.float64 else torch.float32


def _require_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    return int(value)


def _check_power_of_two(name: str, d: int) -> None:
    if d < 1 or d & (d - 1):
        raise ValueError(f"{name} has head dim {d}; the Hadamard transform needs a power of two "
                         f"(1, 2, 4, ..., 64, 128, 256)")


def random_signs(d: int, *, seed: int | None = None, generator: torch.Generator | None = None) -> Tensor:
    """A reproducible random +-1 vector, the diagonal of the rotation's sign matrix.

    d: its length (the head dim), >= 1. The signs are drawn on the CPU from `generator` when given (which advances
    it), else from a fresh generator seeded with `seed` (0 when None), so equal seeds give equal signs on every
    machine. Returns float32 (d,) on the CPU with values -1.0 and +1.0.

    Raises TypeError for a non-int d or seed or a generator that is not a torch.Generator, ValueError for d < 1,
    for both seed and generator, or for a generator that is not on the CPU.
    """
    d = _require_int("d", d)
    if d < 1:
        raise ValueError(f"d must be >= 1 (the head dim), got {d}")
    if generator is not None and seed is not None:
        raise ValueError("pass seed or generator, not both: the signs come from one source")
    if generator is None:
        generator = torch.Generator().manual_seed(0 if seed is None else _require_int("seed", seed))
    elif not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
    elif generator.device.type != "cpu":
        raise ValueError(f"generator must be a CPU generator (the signs are drawn on the CPU so that a seed gives the "
                         f"same signs everywhere), got one on {generator.device}")
    bits = torch.randint(0, 2, (d,), generator=generator)
    return (2 * bits - 1).to(torch.float32)


def _fwht(x: Tensor) -> Tensor:
    """The unnormalised Walsh-Hadamard transform over the last dim (a power of two): x @ H, H Sylvester's matrix.

    log2(d) butterfly passes; pass h combines the elements h apart within blocks of 2h (a + b, a - b), which is
    multiplication by the Kronecker factor of H acting at that stride."""
    d = x.shape[-1]
    lead = x.shape[:-1]
    y = x.reshape(-1, d)
    rows = y.shape[0]  # explicit, not -1: a view of zero rows cannot infer it
    h = 1
    while h < d:
        pairs = y.view(rows, d // (2 * h), 2, h)
        a, b = pairs[:, :, 0], pairs[:, :, 1]
        y = torch.stack((a + b, a - b), dim=2).view(rows, d)
        h *= 2
    return y.view(*lead, d)


def hadamard_transform(x: Tensor, signs: Tensor | None = None, *, inverse: bool = False) -> Tensor:
    """The orthogonal (randomised) Hadamard transform over the last dim: x @ diag(signs) @ H / sqrt(d).

    x: (..., d), floating (float16, bfloat16, float32 or float64), d a power of two. signs: None (all +1) or a
    (d,) tensor of +-1 values (random_signs), any floating dtype, on x's device. H is the d x d Sylvester-Hadamard
    matrix (H[i, j] = (-1)^popcount(i & j), symmetric, H H = d I), so the matrix R = diag(signs) H / sqrt(d) is
    orthogonal and the transform preserves norms and inner products: hadamard_transform(q, s) @
    hadamard_transform(k, s).T == q @ k.T up to rounding. inverse=True applies R^T = H diag(signs) / sqrt(d), undoing
    the transform. Computed by the fast transform in O(d log d) per row, in float32 for 16-bit inputs (float64 for
    float64); returns a new tensor of x's shape and dtype.

    Raises TypeError for a non-tensor or non-floating x or signs, ValueError for a head dim that is not a power of
    two, a signs shape other than (d,), signs on another device, or sign values other than +-1 (checking them reads
    the signs, a synchronisation when they live on a GPU).
    """
    x = _require_tensor("x", x)
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"x has dtype {x.dtype}; the Hadamard transform takes float16, bfloat16, float32 or float64")
    if x.dim() < 1:
        raise ValueError("x must have at least one dimension (the transform acts on the last)")
    inverse = _require_bool("inverse", inverse)
    d = x.shape[-1]
    _check_power_of_two("x", d)
    work = x.to(_working_dtype(x.dtype))
    if signs is not None:
        signs = _check_signs(signs, d, x.device).to(work.dtype)
    if signs is not None and not inverse:
        work = work * signs
    out = _fwht(work) * (1.0 / math.sqrt(d))
    if signs is not None and inverse:
        out = out * signs
    return out.to(x.dtype)


def _check_signs(signs: object, d: int, device: torch.device) -> Tensor:
    signs = _require_tensor("signs", signs)
    if not signs.is_floating_point():
        raise TypeError(f"signs must be a floating tensor of +-1 values, got dtype {signs.dtype}")
    if tuple(signs.shape) != (d,):
        raise ValueError(f"signs has shape {tuple(signs.shape)}; it must be (headdim,) = ({d},)")
    if signs.device != device:
        raise ValueError(f"signs is on {signs.device} but the tensor to transform is on {device}")
    if not bool((signs.abs() == 1).all()):
        raise ValueError("signs must hold only -1 and +1 (the rotation is orthogonal only then)")
    return signs


def descale_shapes(batch: int, seqlen_q: int, seqlen_k: int, nheads: int, nheads_k: int,
                   block: int | None) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """The shapes of (q_descale, k_descale, v_descale) for these dims and block (None = per-tensor).

    Per-tensor: (batch, nheads_k) each. Block: q (batch, nheads, ceil(seqlen_q / block)), k and v
    (batch, nheads_k, ceil(seqlen_k / block)). See the module docstring for the dequantisation rule.
    """
    if block is None:
        return (batch, nheads_k), (batch, nheads_k), (batch, nheads_k)
    blocks_q, blocks_k = -(-seqlen_q // block), -(-seqlen_k // block)
    return (batch, nheads, blocks_q), (batch, nheads_k, blocks_k), (batch, nheads_k, blocks_k)


def _check_block(block: object) -> int | None:
    if block is None:
        return None
    block = _require_int("block", block)
    if block < 1:
        raise ValueError(f"block must be None (per-tensor scales) or a positive number of rows per scale, got {block}")
    return block


@dataclass(frozen=True)
class QuantizedQKV:
    """The result of `quantize`: FP8 tensors, their float32 descales, and how they were made.

    q, k, v: float8_e4m3fn in the inputs' shapes (q and k rotated when signs is not None).
    q_descale, k_descale, v_descale: float32, shapes from `descale_shapes` (block None: (batch, nheads_k) each).
    block: rows per scale, or None for per-tensor scales.
    signs: the rotation's (headdim,) float32 +-1 vector on the inputs' device, or None when not rotated.
    """

    q: Tensor
    k: Tensor
    v: Tensor
    q_descale: Tensor
    k_descale: Tensor
    v_descale: Tensor
    block: int | None
    signs: Tensor | None

    @property
    def rotated(self) -> bool:
        """Whether q and k hold the rotated inputs (their product, and the attention, are unchanged)."""
        return self.signs is not None

    def dequantize(self) -> tuple[Tensor, Tensor, Tensor]:
        """`dequantize` of these tensors and scales: float32 (q, k, v), q and k still rotated."""
        return dequantize(self.q, self.k, self.v, q_descale=self.q_descale, k_descale=self.k_descale,
                          v_descale=self.v_descale, block=self.block)


def _group_amax(x: Tensor, nheads_k: int, block: int | None) -> Tensor:
    """Largest magnitude per scale group: (batch, nheads_k) per-tensor (x's heads grouped by key/value head), or
    (batch, x's heads, nblocks) per block."""
    batch, seqlen, nheads, headdim = x.shape
    mag = x.abs()
    if block is None:
        if seqlen == 0 or headdim == 0:
            return mag.new_zeros(batch, nheads_k)
        return mag.reshape(batch, seqlen, nheads_k, nheads // nheads_k, headdim).amax(dim=(1, 3, 4))
    nblocks = -(-seqlen // block)
    if nblocks == 0:
        return mag.new_zeros(batch, nheads, 0)
    # zero rows past the end do not change a maximum of magnitudes
    padded = torch.nn.functional.pad(mag, (0, 0, 0, 0, 0, nblocks * block - seqlen))
    return padded.view(batch, nblocks, block, nheads, headdim).amax(dim=(2, 4)).transpose(1, 2)


def _expand_descale(descale: Tensor, x_shape: torch.Size, block: int | None) -> Tensor:
    """descale broadcast to (batch, seqlen, nheads, 1) along the rule of the module docstring."""
    batch, seqlen, nheads, _ = x_shape
    if block is None:  # (batch, nheads_k): each key/value head's scale to its group of heads
        group = nheads // descale.shape[1]
        return descale.repeat_interleave(group, dim=1)[:, None, :, None]
    per_row = descale.repeat_interleave(block, dim=2)[:, :, :seqlen]  # (batch, nheads, seqlen)
    return per_row.transpose(1, 2)[..., None]


def _quantize_one(name: str, x: Tensor, nheads_k: int, block: int | None) -> tuple[Tensor, Tensor]:
    amax = _group_amax(x, nheads_k, block)  # in x's working dtype, so the message below shows the true value
    descale = (amax / E4M3_MAX).to(torch.float32)
    if not bool(torch.isfinite(descale).all()):
        raise ValueError(f"{name} holds magnitudes up to {amax.max().item():g}, beyond what a float32 descale "
                         f"({torch.finfo(torch.float32).max:g} * 448) can represent")
    # a zero group gets scale 1 (its FP8 values are 0 whatever the scale); the floor keeps a group of subnormals
    # from dividing by an underflowed 0
    descale = torch.where(amax > 0, descale.clamp(min=torch.finfo(torch.float32).tiny), torch.ones_like(descale))
    scaled = x / _expand_descale(descale, x.shape, block).to(x.dtype)
    # the rounding of amax / 448 can put the largest element a hair past 448, which e4m3 cannot hold
    return scaled.clamp(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE), descale


def quantize(q: Tensor, k: Tensor, v: Tensor, *, block: int | None = None, rotate: bool = False,
             seed: int | None = None, generator: torch.Generator | None = None) -> QuantizedQKV:
    """Quantise q, k, v to float8_e4m3fn with float32 descales, optionally rotating q and k first.

    q: (batch, seqlen_q, nheads, headdim), k: (batch, seqlen_k, nheads_k, headdim), v: (batch, seqlen_k, nheads_k,
    headdim_v), one floating dtype (float16, bfloat16, float32 or float64) and one device, nheads a multiple of
    nheads_k. The values must be finite (checked, which reads them: a synchronisation when they live on a GPU).
    Not differentiable: the results carry no autograd history, whatever the inputs' requires_grad.
    block: None for per-tensor scales, one per (batch, key/value head) as in flash-attn's FP8 interface; or a
        number of rows: one scale per (batch, head, block of `block` rows) of each tensor (FlashAttention-3).
    rotate: multiply q and k by diag(signs) H / sqrt(headdim) before quantising (headdim a power of two); v is not
        rotated. The attention of the dequantised tensors approximates the attention of the originals either way.
    seed, generator: the source of the rotation's signs (random_signs); ignored without rotate. Default: seed 0.

    Returns a QuantizedQKV: fp8 q, k, v of the inputs' shapes, the descales (shapes in `descale_shapes`, the rule in
    the module docstring), block and the signs used (None without rotate). Each scale is the group's amax / 448, 1
    for a group of zeros.

    Raises TypeError / ValueError naming the argument for tensors that do not form an attention call (the rules of
    flash_attn_func), a block that is not a positive int, a non-bool rotate, a head dim that is not a power of two
    with rotate=True, non-finite values, or a bad seed / generator.
    """
    _check_flash_qkv(q, k, v, _DIMS)
    block = _check_block(block)
    rotate = _require_bool("rotate", rotate)
    if rotate:
        _check_power_of_two("q", q.shape[-1])
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.numel() and not bool(torch.isfinite(t).all()):
            raise ValueError(f"{name} contains inf or NaN; FP8 quantisation needs finite values (a scale is set by "
                             f"the largest magnitude)")
    with torch.no_grad():  # rounding to e4m3 has no useful gradient; the results are data for a kernel
        return _quantize(q, k, v, block, rotate, seed, generator)


def _quantize(q: Tensor, k: Tensor, v: Tensor, block: int | None, rotate: bool, seed: int | None,
              generator: torch.Generator | None) -> QuantizedQKV:
    nheads_k = k.shape[2]
    work = _working_dtype(q.dtype)
    q, k, v = q.to(work), k.to(work), v.to(work)
    signs = None
    if rotate:
        signs = random_signs(q.shape[-1], seed=seed, generator=generator).to(q.device)
        q, k = hadamard_transform(q, signs), hadamard_transform(k, signs)
    q8, q_descale = _quantize_one("q", q, nheads_k, block)
    k8, k_descale = _quantize_one("k", k, nheads_k, block)
    v8, v_descale = _quantize_one("v", v, nheads_k, block)
    return QuantizedQKV(q8, k8, v8, q_descale, k_descale, v_descale, block, signs)


def dequantize(q: Tensor, k: Tensor, v: Tensor, *, q_descale: Tensor | None, k_descale: Tensor | None,
               v_descale: Tensor | None, block: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """The float32 tensors an FP8 attention kernel computes with: each FP8 value times its descale.

    q: (batch, seqlen_q, nheads, headdim), k: (batch, seqlen_k, nheads_k, headdim), v: (batch, seqlen_k, nheads_k,
    headdim_v), all float8_e4m3fn on one device. q_descale, k_descale, v_descale: float32 on that device, shaped as
    `descale_shapes` says for `block` (None: (batch, nheads_k) each, flash-attn's convention). The rule, exactly
    (one float32 multiplication per element):
        block None:  x[b, s, h, :] = float32(x_fp8[b, s, h, :]) * x_descale[b, h // (x's heads // nheads_k)]
        block B:     x[b, s, h, :] = float32(x_fp8[b, s, h, :]) * x_descale[b, h, s // B]
    Rotated inputs stay rotated: their attention equals the unrotated inputs', which is what a kernel computes.

    Returns float32 (q, k, v) of the inputs' shapes.

    Raises TypeError for a missing descale (None), a descale that is not float32, or FP8 tensors of another dtype;
    ValueError for a descale of the wrong shape (the message gives the expected one), devices that differ, or
    shapes that do not form an attention call.
    """
    tensors = {"q": q, "k": k, "v": v}
    for name, t in tensors.items():
        _require_tensor(name, t)
        if t.dtype != FP8_DTYPE:
            raise TypeError(f"{name} has dtype {t.dtype}; dequantize takes float8_e4m3fn tensors (quantize makes them)")
        if t.dim() != 4:
            raise ValueError(f"{name} must have rank 4 (batch, seqlen, nheads, headdim), got shape {tuple(t.shape)}")
    # the shape rules of an attention call, checked on shape-only copies so the messages are flash_attn_func's
    _check_flash_qkv(*(torch.empty(t.shape, device="meta") for t in (q, k, v)), _DIMS)
    devices = {t.device for t in (q, k, v)}
    if len(devices) != 1:
        raise ValueError(f"q, k, v must be on one device, got q on {q.device}, k on {k.device}, v on {v.device}")
    block = _check_block(block)
    batch, seqlen_q, nheads, _ = q.shape
    seqlen_k, nheads_k = k.shape[1], k.shape[2]
    expected = descale_shapes(batch, seqlen_q, seqlen_k, nheads, nheads_k, block)
    rule = ("per-tensor scales (block=None): (batch, nheads_k)" if block is None else
            f"block scales (block={block}): (batch, heads, ceil(seqlen / {block}))")
    out = []
    for (name, t), descale, shape in zip(tensors.items(), (q_descale, k_descale, v_descale), expected):
        dname = f"{name}_descale"
        if descale is None:
            raise TypeError(f"{dname} is missing: an FP8 tensor carries no scale of its own; pass the descale that "
                            f"quantize returned, shape {shape}")
        _require_tensor(dname, descale)
        if descale.dtype != torch.float32:
            raise TypeError(f"{dname} has dtype {descale.dtype}; descales are float32")
        if tuple(descale.shape) != shape:
            hint = ""
            if descale.dim() == 3 and block is None:
                hint = "; a 3-dim descale holds block scales, so pass block="
            elif descale.dim() == 2 and block is not None:
                hint = "; a 2-dim descale holds per-tensor scales, so pass block=None"
            raise ValueError(f"{dname} has shape {tuple(descale.shape)}; {rule} gives {shape}{hint}")
        if descale.device != t.device:
            raise ValueError(f"{dname} is on {descale.device} but {name} is on {t.device}")
        out.append(t.to(torch.float32) * _expand_descale(descale, t.shape, block))
    return out[0], out[1], out[2]
