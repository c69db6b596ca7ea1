"""`flashtile bench --fp8`: the error FP8 quantisation of q, k, v adds to attention, beside bf16.

What is measured: each precision's inputs are made (bf16-rounded, or quantised by flashtile.fp8.quantize
and dequantised by flashtile.fp8.dequantize), then attention is computed by the float64 oracle
(flashtile.reference) on them, and compared with the float64 attention of the original float32 inputs. So the FP8
rows give the error of the quantisation alone: the error an FP8 kernel adds on top (its float32 accumulation, and
in FlashAttention-3 the rounding of P to FP8 before P V) is not included and has to be measured on the GPU. The bf16
row is the oracle on bf16-rounded inputs with its output rounded to bf16 (the usual bf16 kernel's inputs and
output); the FP8 rows' outputs are not rounded.

Inputs follow FlashAttention-3's accuracy experiment: "gaussian" entries are N(0, 1); "outliers" entries are
N(0, 1) + N(0, outlier_scale^2) * Bernoulli(outlier_fraction), i.e. a small fraction of entries are about
outlier_scale times larger. Precisions:
    bf16              q, k, v rounded to bfloat16
    fp8-tensor        float8_e4m3fn, one scale per (batch, kv head) (flash-attn's FP8 descales)
    fp8-block         one scale per (batch, head, block of rows)
    fp8-block-rotated the same after the random Hadamard rotation of q and k (v is not rotated)
Errors: RMSE and max abs error of the compared output rows (query_rows sampled query positions of every batch and
head, each attending to all keys; accuracy_report) against the float64 reference, and the ratio of the fp8-tensor
RMSE to each row's (how many times lower its RMSE is).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

import flashtile
from flashtile import fp8
from flashtile.reference import flash_attn_reference

INPUT_KINDS = ("gaussian", "outliers")
PRECISIONS = ("bf16", "fp8-tensor", "fp8-block", "fp8-block-rotated")


@dataclass(frozen=True)
class AccuracyRow:
    """One (input kind, precision): errors of the attention output against float64 attention of the originals."""

    inputs: str  # one of INPUT_KINDS
    precision: str  # one of PRECISIONS
    rmse: float
    max_abs_error: float
    rmse_reduction: float  # fp8-tensor RMSE / this row's RMSE on the same inputs (> 1: lower error)


@dataclass
class AccuracyResult:
    """header: the shapes, seeds and settings; rows: one AccuracyRow per (input kind, precision).
    The same form as the timing grids' results, so flashtile.bench.report.write_json writes it."""

    header: dict
    rows: list[AccuracyRow]

    def row(self, inputs: str, precision: str) -> AccuracyRow:
        """The row of this input kind and precision (KeyError if absent)."""
        for r in self.rows:
            if r.inputs == inputs and r.precision == precision:
                return r
        raise KeyError((inputs, precision))


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def make_inputs(kind: str, *, batch: int, seqlen: int, nheads: int, headdim: int, outlier_fraction: float,
                outlier_scale: float, seed: int) -> tuple[Tensor, Tensor, Tensor]:
    """float32 q, k, v (batch, seqlen, nheads, headdim) on the CPU of one input kind, drawn from a generator
    seeded with `seed` (see the module docstring for the distributions)."""
    if kind not in INPUT_KINDS:
        raise ValueError(f"kind must be one of {', '.join(INPUT_KINDS)}, got {kind!r}")
    gen = torch.Generator().manual_seed(seed)
    shape = (batch, seqlen, nheads, headdim)
    tensors = []
    for _ in range(3):
        x = torch.randn(shape, generator=gen)
        if kind == "outliers":
            hit = torch.rand(shape, generator=gen) < outlier_fraction
            x = x + outlier_scale * torch.randn(shape, generator=gen) * hit
        tensors.append(x)
    return tensors[0], tensors[1], tensors[2]


def _errors(out: Tensor, ref: Tensor) -> tuple[float, float]:
    diff = out.to(torch.float64) - ref
    return math.sqrt(diff.pow(2).mean().item()), diff.abs().max().item()


def _precision_output(precision: str, q: Tensor, k: Tensor, v: Tensor, rows: Tensor, block: int,
                      rotation_seed: int) -> Tensor:
    """The output rows `rows` of attention computed at `precision`. The whole of q is quantised (its scales are
    those of the full tensor); only the sampled query rows go through the oracle."""
    if precision == "bf16":
        q, k, v = (t.to(torch.bfloat16) for t in (q, k, v))
        return flash_attn_reference(q[:, rows], k, v)[0].to(torch.bfloat16)
    quantized = fp8.quantize(q, k, v, block=None if precision == "fp8-tensor" else block,
                             rotate=precision == "fp8-block-rotated", seed=rotation_seed)
    q, k, v = quantized.dequantize()
    return flash_attn_reference(q[:, rows], k, v)[0]


def accuracy_report(*, batch: int = 1, seqlen: int = 16384, nheads: int = 2, headdim: int = 128, block: int = 128,
                    query_rows: int | None = 256, outlier_fraction: float = 0.001, outlier_scale: float = 10.0,
                    seed: int = 0, rotation_seed: int = 0) -> AccuracyResult:
    """Errors of bf16 and three FP8 quantisations of q, k, v against float64 attention, on two kinds of inputs.

    Shapes: q, k, v (batch, seqlen, nheads, headdim), seqlen_q = seqlen_k, MHA, no mask; headdim a power of two
    (the rotation). block: rows per scale of the block precisions. query_rows: how many query positions (drawn
    without replacement from the input generator, the same for every batch, head and precision) have their output
    rows compared, each against all seqlen keys; None, or a number >= seqlen, compares every row. Sampling rows keeps
    long sequences cheap on the CPU (the oracle costs query_rows * seqlen per head, not seqlen^2); the scales are
    always those of the whole tensors. outlier_fraction, outlier_scale: the "outliers" inputs' Bernoulli probability
    and outlier standard deviation. seed: the input generator's seed (the same inputs for every precision);
    rotation_seed: the Hadamard signs' seed. Runs on the CPU (the defaults take a few seconds).

    The default length is long on purpose: the gain of the rotation grows with the number of keys per row (a longer
    row puts more weight on its few largest scores, those an outlier produces, where unrotated quantisation errs
    most); docs/fp8.md has the measurements.

    Measures the quantisation's error only (the oracle on dequantised inputs; module docstring): an FP8 kernel's own
    accumulation error is not included. Returns an AccuracyResult with one row per (input kind, precision) in
    INPUT_KINDS x PRECISIONS order. Raises ValueError for non-positive sizes, a head dim that is not a power of two,
    or an outlier fraction outside [0, 1].
    """
    for name, value in (("batch", batch), ("seqlen", seqlen), ("nheads", nheads), ("headdim", headdim),
                        ("block", block)):
        _positive_int(name, value)
    if query_rows is not None:
        _positive_int("query_rows", query_rows)
    if headdim & (headdim - 1):
        raise ValueError(f"headdim must be a power of two (the Hadamard rotation), got {headdim}")
    if not 0.0 <= outlier_fraction <= 1.0:
        raise ValueError(f"outlier_fraction must be in [0, 1], got {outlier_fraction}")
    if query_rows is None or query_rows >= seqlen:
        rows = torch.arange(seqlen)
    else:
        rows = torch.randperm(seqlen, generator=torch.Generator().manual_seed(seed))[:query_rows].sort().values
    header = {"kind": "fp8-accuracy", "batch": batch, "seqlen": seqlen, "nheads": nheads, "headdim": headdim,
              "block": block, "query_rows": len(rows), "outlier_fraction": outlier_fraction,
              "outlier_scale": outlier_scale, "seed": seed, "rotation_seed": rotation_seed, "torch": torch.__version__,
              "flashtile": flashtile.__version__,
              "method": "float64 attention of the dequantised (or bf16-rounded) inputs against float64 attention of "
                        "the float32 originals, on the sampled query rows against all keys: the quantisation's error "
                        "only, not an FP8 kernel's accumulation"}
    result_rows = []
    for kind in INPUT_KINDS:
        q, k, v = make_inputs(kind, batch=batch, seqlen=seqlen, nheads=nheads, headdim=headdim,
                              outlier_fraction=outlier_fraction, outlier_scale=outlier_scale, seed=seed)
        ref = flash_attn_reference(q[:, rows], k, v)[0]
        errors = {p: _errors(_precision_output(p, q, k, v, rows, block, rotation_seed), ref) for p in PRECISIONS}
        baseline = errors["fp8-tensor"][0]
        for p in PRECISIONS:
            rmse, max_err = errors[p]
            result_rows.append(AccuracyRow(kind, p, rmse, max_err, baseline / rmse if rmse > 0 else math.inf))
    return AccuracyResult(header, result_rows)


def format_accuracy_table(result: AccuracyResult) -> str:
    """The terminal table: one line per (input kind, precision), then what was measured."""
    h = result.header
    lines = [f"FP8 accuracy: batch {h['batch']}, seqlen {h['seqlen']} ({h['query_rows']} query rows compared), "
             f"heads {h['nheads']}, headdim {h['headdim']}, block {h['block']}; outliers: fraction "
             f"{h['outlier_fraction']:g}, scale {h['outlier_scale']:g}; seed {h['seed']}, rotation seed "
             f"{h['rotation_seed']}; torch {h['torch']}",
             f"{'inputs':<10} {'precision':<18} {'RMSE':>10} {'max |err|':>10} {'RMSE vs fp8-tensor':>19}",
             "-" * 71]
    for r in result.rows:
        lines.append(f"{r.inputs:<10} {r.precision:<18} {r.rmse:10.3e} {r.max_abs_error:10.3e} "
                     f"{r.rmse_reduction:18.2f}x")
    lines.append("errors: attention output against float64 attention of the float32 inputs. The FP8 rows measure the "
                 "quantisation only (float64 attention of the dequantised inputs); an FP8 kernel's own accumulation "
                 "is not included and is measured on the GPU. bf16: inputs and output rounded to bf16.")
    return "\n".join(lines)
