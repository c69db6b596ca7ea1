"""FP8 preparation (flashtile.fp8) and its accuracy report (flashtile.bench.fp8, `flashtile bench --fp8`).

The Hadamard transform is checked against the matrix written from its definition, H[i, j] = (-1)^popcount(i & j),
and for orthogonality in float64; quantisation against the dequantisation rule written out element by element and
e4m3's rounding bound; the report against the FlashAttention-3 bar for rotated block FP8 on inputs with outliers.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from flashtile import cli, fp8
from flashtile.bench import fp8 as fp8_report
from flashtile.reference import flash_attn_reference

HEADDIMS = (1, 2, 4, 8, 64, 256)


def hadamard_matrix(d: int) -> torch.Tensor:
    """H[i, j] = (-1)^popcount(i & j), float64: Sylvester's matrix from its definition, not from a recursion."""
    i = torch.arange(d).view(-1, 1)
    j = torch.arange(d).view(1, -1)
    bits = i & j
    parity = torch.zeros_like(bits)
    while bool(bits.any()):
        parity ^= bits & 1
        bits = bits >> 1
    return (1 - 2 * parity).to(torch.float64)


def qkv(batch=2, seqlen_q=113, seqlen_k=77, nheads=4, nheads_k=2, headdim=64, headdim_v=32, dtype=torch.float32):
    return (torch.randn(batch, seqlen_q, nheads, headdim, dtype=dtype),
            torch.randn(batch, seqlen_k, nheads_k, headdim, dtype=dtype),
            torch.randn(batch, seqlen_k, nheads_k, headdim_v, dtype=dtype))


# ---- the Hadamard transform -------------------------------------------------------------------------------------


@pytest.mark.parametrize("d", HEADDIMS)
@pytest.mark.parametrize("with_signs", [False, True])
def test_fast_transform_equals_the_explicit_matrix(d, with_signs):
    x = torch.randn(3, 5, d, dtype=torch.float64)
    signs = fp8.random_signs(d, seed=7) if with_signs else None
    diag = torch.diag(signs.double()) if with_signs else torch.eye(d, dtype=torch.float64)
    expected = x @ diag @ hadamard_matrix(d) / math.sqrt(d)
    err = (fp8.hadamard_transform(x, signs) - expected).abs().max().item()
    assert err < 1e-13, f"fast transform vs x diag(signs) H / sqrt(d) at d={d}: max error {err}"


@pytest.mark.parametrize("d", HEADDIMS)
def test_transform_is_orthogonal_in_float64(d):
    signs = fp8.random_signs(d, seed=1)
    rotation = fp8.hadamard_transform(torch.eye(d, dtype=torch.float64), signs)  # row i: e_i R, so this is R
    identity = torch.eye(d, dtype=torch.float64)
    assert (rotation @ rotation.T - identity).abs().max().item() < 1e-14, "R R^T != I"
    q, k = torch.randn(7, d, dtype=torch.float64), torch.randn(9, d, dtype=torch.float64)
    rq, rk = fp8.hadamard_transform(q, signs), fp8.hadamard_transform(k, signs)
    assert (rq @ rk.T - q @ k.T).abs().max().item() < 1e-12, "(qR)(kR)^T != q k^T"
    assert (rq.norm(dim=-1) - q.norm(dim=-1)).abs().max().item() < 1e-12, "norms changed"
    back = fp8.hadamard_transform(rq, signs, inverse=True)
    assert (back - q).abs().max().item() < 1e-14, "inverse=True does not undo the transform"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_transform_keeps_shape_and_dtype(dtype):
    x = torch.randn(2, 3, 4, 32).to(dtype)
    signs = fp8.random_signs(32, seed=0)
    out = fp8.hadamard_transform(x, signs)
    assert out.shape == x.shape and out.dtype == dtype
    expected = fp8.hadamard_transform(x.double(), signs)
    # computed in float32, rounded once to the input dtype
    assert torch.allclose(out.double(), expected, rtol=torch.finfo(dtype).eps, atol=1e-6)


def test_random_signs_are_reproducible_from_a_seed_or_a_generator():
    a = fp8.random_signs(128, seed=3)
    assert a.dtype == torch.float32 and a.shape == (128,)
    assert set(a.tolist()) == {-1.0, 1.0}
    assert torch.equal(a, fp8.random_signs(128, seed=3)), "one seed, two different sign vectors"
    assert not torch.equal(a, fp8.random_signs(128, seed=4)), "seeds 3 and 4 gave the same signs"
    assert torch.equal(fp8.random_signs(128), fp8.random_signs(128, seed=0)), "the default seed is 0"
    from_generator = fp8.random_signs(128, generator=torch.Generator().manual_seed(3))
    assert torch.equal(a, from_generator), "a generator seeded with 3 differs from seed=3"
    generator = torch.Generator().manual_seed(3)
    first, second = fp8.random_signs(64, generator=generator), fp8.random_signs(64, generator=generator)
    assert not torch.equal(first, second), "a generator must advance between draws"


TRANSFORM_BAD_INPUTS = {
    "head dim 96": (lambda: fp8.hadamard_transform(torch.randn(2, 96)), ValueError,
                    r"x has head dim 96; the Hadamard transform needs a power of two"),
    "integer x": (lambda: fp8.hadamard_transform(torch.ones(2, 8, dtype=torch.int32)), TypeError,
                  r"x has dtype torch\.int32"),
    "x not a tensor": (lambda: fp8.hadamard_transform([1.0, 2.0]), TypeError, r"x must be a torch\.Tensor"),
    "signs shape": (lambda: fp8.hadamard_transform(torch.randn(2, 8), torch.ones(4)), ValueError,
                    r"signs has shape \(4,\); it must be \(headdim,\) = \(8,\)"),
    "signs values": (lambda: fp8.hadamard_transform(torch.randn(2, 8), torch.full((8,), 0.5)), ValueError,
                     r"signs must hold only -1 and \+1"),
    "integer signs": (lambda: fp8.hadamard_transform(torch.randn(2, 8), torch.ones(8, dtype=torch.int64)), TypeError,
                      r"signs must be a floating tensor"),
    "d zero": (lambda: fp8.random_signs(0), ValueError, r"d must be >= 1"),
    "d float": (lambda: fp8.random_signs(8.0), TypeError, r"d must be an int, got 8\.0"),
    "seed and generator": (lambda: fp8.random_signs(8, seed=1, generator=torch.Generator()), ValueError,
                           r"pass seed or generator, not both"),
    "generator type": (lambda: fp8.random_signs(8, generator=3), TypeError, r"generator must be a torch\.Generator"),
}


@pytest.mark.parametrize("case", list(TRANSFORM_BAD_INPUTS))
def test_transform_bad_inputs_raise_naming_the_argument(case):
    call, error, message = TRANSFORM_BAD_INPUTS[case]
    with pytest.raises(error, match=message):
        call()


# ---- quantize / dequantize --------------------------------------------------------------------------------------


def dequantize_by_loops(x8: torch.Tensor, descale: torch.Tensor, block: int | None, nheads_k: int) -> torch.Tensor:
    """The module docstring's rule, one (b, s, h) at a time."""
    out = torch.empty(x8.shape, dtype=torch.float32)
    batch, seqlen, nheads, _ = x8.shape
    for b in range(batch):
        for s in range(seqlen):
            for h in range(nheads):
                scale = descale[b, h // (nheads // nheads_k)] if block is None else descale[b, h, s // block]
                out[b, s, h] = x8[b, s, h].to(torch.float32) * scale
    return out


@pytest.mark.parametrize("block", [None, 1, 32, 128])
@pytest.mark.parametrize("rotate", [False, True])
def test_quantize_shapes_dtypes_and_the_dequantisation_rule(block, rotate):
    q, k, v = qkv(seqlen_q=45, seqlen_k=19)  # GQA (4 query heads per 2), lengths that no block divides, dv != d
    result = fp8.quantize(q, k, v, block=block, rotate=rotate, seed=5)
    assert (result.q.shape, result.k.shape, result.v.shape) == (q.shape, k.shape, v.shape)
    assert {t.dtype for t in (result.q, result.k, result.v)} == {torch.float8_e4m3fn}
    expected_shapes = fp8.descale_shapes(2, 45, 19, 4, 2, block)
    shapes = tuple(tuple(t.shape) for t in (result.q_descale, result.k_descale, result.v_descale))
    assert shapes == expected_shapes
    if block is None:
        assert expected_shapes == ((2, 2), (2, 2), (2, 2)), "per-tensor descales are flash-attn's (batch, nheads_k)"
    else:
        nq, nk = -(-45 // block), -(-19 // block)
        assert expected_shapes == ((2, 4, nq), (2, 2, nk), (2, 2, nk))
    assert {t.dtype for t in (result.q_descale, result.k_descale, result.v_descale)} == {torch.float32}
    assert result.block == block and result.rotated == rotate
    dq, dk, dv = result.dequantize()
    for name, x8, descale, deq in (("q", result.q, result.q_descale, dq), ("k", result.k, result.k_descale, dk),
                                   ("v", result.v, result.v_descale, dv)):
        assert deq.dtype == torch.float32
        assert torch.equal(deq, dequantize_by_loops(x8, descale, block, 2)), f"{name}: dequantize breaks its rule"


@pytest.mark.parametrize("block", [None, 8])  # 8 divides 40: whole groups
def test_each_group_is_scaled_to_448_and_rounded_within_e4m3_bounds(block):
    q, k, v = qkv(seqlen_q=40, seqlen_k=40)
    result = fp8.quantize(q, k, v, block=block)
    for name, x, x8, descale in (("q", q, result.q, result.q_descale), ("k", k, result.k, result.k_descale),
                                 ("v", v, result.v, result.v_descale)):
        stored = x8.to(torch.float32).abs()
        if block is None:  # (batch, nheads_k): x's heads grouped by key/value head
            group_max = stored.reshape(2, 40, 2, -1).amax(dim=(1, 3))
            amax = x.abs().reshape(2, 40, 2, -1).amax(dim=(1, 3))
        else:
            group_max = stored.reshape(2, 40 // block, block, x.shape[2], -1).amax(dim=(2, 4)).transpose(1, 2)
            amax = x.abs().reshape(2, 40 // block, block, x.shape[2], -1).amax(dim=(2, 4)).transpose(1, 2)
        assert torch.equal(group_max, torch.full_like(group_max, 448.0)), f"{name}: a group's largest is not 448"
        assert torch.allclose(descale, amax / 448, rtol=1e-6, atol=0), f"{name}: descale is not amax / 448"
        deq = fp8.dequantize(result.q, result.k, result.v, q_descale=result.q_descale, k_descale=result.k_descale,
                             v_descale=result.v_descale, block=block)[("q", "k", "v").index(name)]
        # round to nearest: half an ulp, 2^-4 relative for normal numbers, 2^-10 * scale among subnormals
        scale = fp8._expand_descale(descale, x.shape, block)
        bound = torch.maximum(x.abs() * 2.0 ** -4, scale * 2.0 ** -10) * (1 + 1e-6)
        excess = ((deq - x).abs() - bound).max().item()
        assert excess <= 0, f"{name}: a rounding error exceeds e4m3's half ulp by {excess}"


def test_zero_groups_get_scale_one_and_empty_sequences_work():
    q, k, v = qkv(seqlen_q=10, seqlen_k=10)
    q[:, :4] = 0  # the first block of 4 rows of every head
    k.zero_()
    result = fp8.quantize(q, k, v, block=4)
    assert torch.equal(result.q_descale[:, :, 0], torch.ones(2, 4)), "an all-zero block must get scale 1"
    assert torch.equal(result.k_descale, torch.ones_like(result.k_descale))
    dq, dk, dv = result.dequantize()
    assert torch.equal(dq[:, :4], torch.zeros_like(dq[:, :4])) and torch.equal(dk, torch.zeros_like(dk))
    assert all(bool(t.isfinite().all()) for t in (dq, dk, dv))
    per_tensor = fp8.quantize(q, k, v)
    assert torch.equal(per_tensor.k_descale, torch.ones(2, 2))
    tiny = fp8.quantize(*(t * 1e-42 for t in qkv(seqlen_q=3, seqlen_k=3)))  # float32 subnormals
    assert all(bool(t.isfinite().all()) and bool((t > 0).all())
               for t in (tiny.q_descale, tiny.k_descale, tiny.v_descale))
    empty = fp8.quantize(*qkv(seqlen_q=0, seqlen_k=0), block=8)
    assert empty.q_descale.shape == (2, 4, 0) and empty.k_descale.shape == (2, 2, 0)
    assert fp8.quantize(*qkv(seqlen_q=0, seqlen_k=0)).k_descale.shape == (2, 2)
    assert fp8.quantize(*qkv(seqlen_q=0, seqlen_k=5), block=4, rotate=True).q.shape == (2, 0, 4, 64)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_rotation_cancels_in_the_scores_and_leaves_v_alone(dtype):
    q, k, v = qkv(dtype=dtype)
    plain = fp8.quantize(q, k, v, block=32)
    rotated = fp8.quantize(q, k, v, block=32, rotate=True, seed=11)
    assert torch.equal(rotated.signs, fp8.random_signs(64, seed=11)), "the signs are those of the seed"
    assert torch.equal(rotated.v.view(torch.uint8), plain.v.view(torch.uint8)), "v must not be rotated"
    assert torch.equal(rotated.v_descale, plain.v_descale)
    assert plain.signs is None and not plain.rotated
    # the rotated q and k, dequantised and rotated back, are the inputs up to FP8 rounding
    dq, dk, _ = rotated.dequantize()
    back = fp8.hadamard_transform(dq, rotated.signs, inverse=True)
    relative = ((back - q.float()).norm() / q.float().norm()).item()
    assert relative < 0.05, f"q rotated, quantised and rotated back is {relative:.3f} away (relative)"
    for result in (plain, rotated):
        out = flash_attn_reference(*result.dequantize())[0]
        ref = flash_attn_reference(q, k, v)[0]
        rmse = (out - ref).pow(2).mean().sqrt().item()
        assert rmse < 0.02, f"attention of the dequantised inputs (rotated={result.rotated}) is {rmse} from exact"


def test_quantize_is_deterministic_and_takes_a_generator():
    q, k, v = qkv()
    a = fp8.quantize(q, k, v, block=16, rotate=True, generator=torch.Generator().manual_seed(2))
    b = fp8.quantize(q, k, v, block=16, rotate=True, seed=2)
    for name in ("q", "k", "v"):
        assert torch.equal(getattr(a, name).view(torch.uint8), getattr(b, name).view(torch.uint8)), name
        assert torch.equal(getattr(a, f"{name}_descale"), getattr(b, f"{name}_descale")), f"{name}_descale"


def test_non_contiguous_views_quantize_like_their_copies_and_carry_no_autograd():
    # (batch, nheads, seqlen, headdim) storage read through flash-attn's layout, and a strided slice of heads
    q = torch.randn(2, 4, 33, 64).transpose(1, 2).requires_grad_()
    k = torch.randn(2, 33, 4, 64)[:, :, ::2]
    v = torch.randn(2, 2, 33, 32).transpose(1, 2)
    views = fp8.quantize(q, k, v, block=16, rotate=True)
    copies = fp8.quantize(q.detach().contiguous(), k.contiguous(), v.contiguous(), block=16, rotate=True)
    for name in ("q", "k", "v"):
        assert torch.equal(getattr(views, name).view(torch.uint8), getattr(copies, name).view(torch.uint8)), name
        assert torch.equal(getattr(views, f"{name}_descale"), getattr(copies, f"{name}_descale")), f"{name}_descale"
    assert not any(t.requires_grad for t in (views.q, views.q_descale)), "quantize's results must carry no autograd"


QUANTIZE_BAD_INPUTS = {
    "rotate with head dim 48": (lambda: fp8.quantize(*qkv(headdim=48), rotate=True), ValueError,
                                r"q has head dim 48; the Hadamard transform needs a power of two"),
    "block zero": (lambda: fp8.quantize(*qkv(), block=0), ValueError,
                   r"block must be None \(per-tensor scales\) or a positive number of rows per scale, got 0"),
    "block bool": (lambda: fp8.quantize(*qkv(), block=True), TypeError, r"block must be an int, got True"),
    "block float": (lambda: fp8.quantize(*qkv(), block=64.0), TypeError, r"block must be an int, got 64\.0"),
    "rotate not bool": (lambda: fp8.quantize(*qkv(), rotate="yes"), TypeError, r"rotate must be a bool"),
    "NaN in k": (lambda: fp8.quantize(*[t if i != 1 else t.fill_(float("nan")) for i, t in enumerate(qkv())]),
                 ValueError, r"k contains inf or NaN; FP8 quantisation needs finite values"),
    "huge float64 v": (lambda: fp8.quantize(*[t * (1e300 if i == 2 else 1) for i, t in
                                              enumerate(qkv(dtype=torch.float64))]),
                       ValueError, r"v holds magnitudes up to [0-9.]+e\+300, beyond what a float32 descale"),
    "mixed dtypes": (lambda: fp8.quantize(*[t.double() if i == 1 else t for i, t in enumerate(qkv())]), TypeError,
                     r"share one dtype"),
    "integer q": (lambda: fp8.quantize(*[t.int() if i == 0 else t for i, t in enumerate(qkv())]), TypeError,
                  r"q has dtype torch\.int32"),
    "heads not a multiple": (lambda: fp8.quantize(*qkv(nheads=3)), ValueError, r"nheads must be a multiple of"),
    "q rank 3": (lambda: fp8.quantize(torch.randn(5, 4, 8), *qkv()[1:]), ValueError, r"q must have rank 4"),
}


@pytest.mark.parametrize("case", list(QUANTIZE_BAD_INPUTS))
def test_quantize_bad_inputs_raise_naming_the_argument(case):
    call, error, message = QUANTIZE_BAD_INPUTS[case]
    with pytest.raises(error, match=message):
        call()


def _dequantize_with(**replace):
    result = fp8.quantize(*qkv(seqlen_q=20, seqlen_k=20), block=8)
    args = dict(q_descale=result.q_descale, k_descale=result.k_descale, v_descale=result.v_descale, block=8)
    tensors = dict(q=result.q, k=result.k, v=result.v)
    for key, value in replace.items():
        (tensors if key in tensors else args)[key] = value
    return fp8.dequantize(tensors["q"], tensors["k"], tensors["v"], **args)


DEQUANTIZE_BAD_INPUTS = {
    "missing k_descale": (dict(k_descale=None), TypeError,
                          r"k_descale is missing: an FP8 tensor carries no scale of its own.*\(2, 2, 3\)"),
    "block scales without block": (dict(block=None), ValueError,
                                   r"q_descale has shape \(2, 4, 3\); per-tensor scales \(block=None\): "
                                   r"\(batch, nheads_k\) gives \(2, 2\); a 3-dim descale holds block scales"),
    "wrong block": (dict(block=4), ValueError,
                    r"q_descale has shape \(2, 4, 3\); block scales \(block=4\).* gives \(2, 4, 5\)"),
    "per-tensor scales with block": (dict(v_descale=torch.ones(2, 2)), ValueError,
                                     r"v_descale has shape \(2, 2\);.*a 2-dim descale holds per-tensor scales"),
    "float16 descale": (dict(q_descale=torch.ones(2, 4, 3, dtype=torch.float16)), TypeError,
                        r"q_descale has dtype torch\.float16; descales are float32"),
    "bf16 q": (dict(q=torch.zeros(2, 20, 4, 64, dtype=torch.bfloat16)), TypeError,
               r"q has dtype torch\.bfloat16; dequantize takes float8_e4m3fn"),
    "e5m2 v": (dict(v=torch.zeros(2, 20, 2, 32, dtype=torch.float8_e5m2)), TypeError,
               r"v has dtype torch\.float8_e5m2"),
    "k/v lengths": (dict(v=torch.zeros(2, 19, 2, 32).to(torch.float8_e4m3fn)), ValueError,
                    r"k has seqlen 20 but v has 19"),
    "block zero": (dict(block=0), ValueError, r"block must be None"),
}


@pytest.mark.parametrize("case", list(DEQUANTIZE_BAD_INPUTS))
def test_dequantize_bad_inputs_raise_naming_the_argument(case):
    replace, error, message = DEQUANTIZE_BAD_INPUTS[case]
    with pytest.raises(error, match=message):
        _dequantize_with(**replace)


# ---- the accuracy report ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def default_report():
    return fp8_report.accuracy_report()


def test_report_covers_every_input_kind_and_precision(default_report):
    pairs = [(r.inputs, r.precision) for r in default_report.rows]
    assert pairs == [(i, p) for i in fp8_report.INPUT_KINDS for p in fp8_report.PRECISIONS]
    for r in default_report.rows:
        assert 0 < r.rmse <= r.max_abs_error and math.isfinite(r.max_abs_error), r
    for kind in fp8_report.INPUT_KINDS:
        bf16 = default_report.row(kind, "bf16").rmse
        worst_fp8 = min(default_report.row(kind, p).rmse for p in fp8_report.PRECISIONS[1:])
        assert bf16 * 4 < worst_fp8, f"{kind}: bf16 (3 more mantissa bits) should err far less than FP8"


def test_without_outliers_blocks_and_rotation_change_little(default_report):
    # e4m3 is floating point: with no outliers every scale leaves the same relative rounding
    for p in ("fp8-block", "fp8-block-rotated"):
        reduction = default_report.row("gaussian", p).rmse_reduction
        assert 0.9 < reduction < 1.1, f"gaussian inputs, {p}: RMSE {reduction:.2f}x lower than per-tensor"


def test_rotated_block_fp8_meets_the_bar_on_outliers(default_report):
    """FlashAttention-3's bar: block FP8 with the rotation at least 2.5x lower RMSE than per-tensor FP8 on inputs
    with outliers; block scales alone must not account for it."""
    rotated = default_report.row("outliers", "fp8-block-rotated").rmse_reduction
    blocks_only = default_report.row("outliers", "fp8-block").rmse_reduction
    assert rotated >= 2.5, f"rotated block FP8 is only {rotated:.2f}x below per-tensor FP8 (bar: 2.5x)"
    assert blocks_only < rotated / 1.5, (
        f"block scales alone give {blocks_only:.2f}x, close to the rotation's {rotated:.2f}x")


def test_report_rejects_bad_sizes():
    with pytest.raises(ValueError, match=r"headdim must be a power of two \(the Hadamard rotation\), got 96"):
        fp8_report.accuracy_report(headdim=96)
    with pytest.raises(ValueError, match=r"seqlen must be a positive int, got 0"):
        fp8_report.accuracy_report(seqlen=0)
    with pytest.raises(ValueError, match=r"outlier_fraction must be in \[0, 1\]"):
        fp8_report.accuracy_report(outlier_fraction=2.0)


def test_cli_prints_the_table_and_writes_json(tmp_path, capsys):
    path = tmp_path / "fp8.json"
    assert cli.main(["bench", "--fp8", "--seqlens", "256", "--headdim", "32", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "FP8 accuracy: batch 1, seqlen 256" in out and "quantisation only" in out
    for p in fp8_report.PRECISIONS:
        assert f"outliers   {p}" in out, out
    document = json.loads(path.read_text())
    assert document["header"]["kind"] == "fp8-accuracy" and document["header"]["headdim"] == 32
    assert len(document["rows"]) == len(fp8_report.INPUT_KINDS) * len(fp8_report.PRECISIONS)
    assert set(document["rows"][0]) == {"inputs", "precision", "rmse", "max_abs_error", "rmse_reduction"}


@pytest.mark.parametrize("argv, fragment", [
    (["--fp8", "--quick"], "drop --quick"),
    (["--fp8", "--plot", "x.png"], "drop --plot"),
    (["--fp8", "--headdim", "64,128"], "--headdim with --fp8 takes one integer"),
    (["--fp8", "--headdim", "96"], "headdim must be a power of two"),
    (["--fp8", "--json", "/no/such/dir/x.json"], "--json"),
])
def test_cli_fp8_reports_bad_options_without_running(argv, fragment, capsys):
    assert cli.main(["bench", *argv]) == 2
    assert fragment in capsys.readouterr().err
