"""flashtile.iomodel: FLOPs, HBM bytes, roofline and the paper's access counts, against hand arithmetic."""

from __future__ import annotations

import pytest

from flashtile import iomodel
from flashtile.iomodel import AttentionShape, Cost, Roofline

# B=1, H=2, Sq=3, Sk=5, d=4: a query-side tensor has 1*2*3*4 = 24 elements, a key-side one 1*2*5*4 = 40,
# the score matrix 2*3*5 = 30 entries (15 when causal), and the log-sum-exp 2*3 = 6 floats (24 bytes).
SMALL = AttentionShape(batch=1, nheads=2, seqlen_q=3, seqlen_k=5, headdim=4, causal=False)
SMALL_CAUSAL = AttentionShape(batch=1, nheads=2, seqlen_q=3, seqlen_k=5, headdim=4, causal=True)


def test_forward_flops_by_hand():
    shape = AttentionShape(batch=2, nheads=3, seqlen_q=5, seqlen_k=7, headdim=11, causal=False)
    assert iomodel.forward_flops(shape) == 4 * 2 * 3 * 5 * 7 * 11 == 9240


def test_benchmark_flop_convention():
    shape = AttentionShape(batch=2, nheads=3, seqlen_q=5, seqlen_k=7, headdim=11, causal=False)
    assert iomodel.benchmark_flops(shape, "fwd") == 9240
    assert iomodel.benchmark_flops(shape, "bwd") == 2.5 * 9240
    assert iomodel.benchmark_flops(shape, "fwd+bwd") == 3.5 * 9240


@pytest.mark.parametrize("mode", iomodel.MODES)
def test_causal_halves_flops(mode):
    assert iomodel.benchmark_flops(SMALL_CAUSAL, mode) == iomodel.benchmark_flops(SMALL, mode) / 2
    for model in iomodel.MODELS:
        assert iomodel.cost(model, SMALL_CAUSAL, mode, 2).flops == iomodel.cost(model, SMALL, mode, 2).flops / 2


def test_materialised_bytes_by_hand():
    # forward: Q, O (2 x 24) + K, V (2 x 40) + 4 x 30 score crossings = 248 elements, 4 bytes each
    assert iomodel.materialised_cost(SMALL, "fwd", 4) == Cost(flops=4 * 30 * 4, hbm_bytes=4 * 248)
    # causal halves only the score traffic: 128 + 4 x 15 = 188 elements
    assert iomodel.materialised_cost(SMALL_CAUSAL, "fwd", 4).hbm_bytes == 4 * 188
    # backward: 4 x 24 + 4 x 40 + 7 x 30 = 466 elements; 4 matmuls = 2x the forward's 480 FLOPs
    assert iomodel.materialised_cost(SMALL, "bwd", 4) == Cost(flops=960, hbm_bytes=4 * 466)
    assert iomodel.materialised_cost(SMALL, "fwd+bwd", 4) == Cost(flops=480 + 960, hbm_bytes=4 * (248 + 466))


def test_tiled_bytes_by_hand():
    # forward: Q, O, K, V once (128 elements, 4 bytes each) + the float32 log-sum-exp (24 bytes)
    assert iomodel.tiled_cost(SMALL, "fwd", 4) == Cost(flops=480, hbm_bytes=4 * 128 + 24)
    # causal leaves the tiled traffic unchanged
    assert iomodel.tiled_cost(SMALL_CAUSAL, "fwd", 4).hbm_bytes == 4 * 128 + 24
    # backward: Q, O, dO, dQ, K, V, dK, dV (256 elements) + lse; 5 matmuls (recompute) = 2.5x
    assert iomodel.tiled_cost(SMALL, "bwd", 4) == Cost(flops=1200, hbm_bytes=4 * 256 + 24)
    # 2-byte elements: only the tensors shrink, the log-sum-exp stays float32
    assert iomodel.tiled_cost(SMALL, "fwd", 2).hbm_bytes == 2 * 128 + 24


@pytest.mark.parametrize("causal", [False, True])
def test_materialised_intensity_tends_to_half_headdim(causal):
    d = 64
    large = AttentionShape(batch=1, nheads=1, seqlen_q=2**20, seqlen_k=2**20, headdim=d, causal=causal)
    intensity = iomodel.materialised_cost(large, "fwd", element_bytes=2).intensity
    assert intensity == pytest.approx(d / 2, rel=1e-3)
    short = AttentionShape(batch=1, nheads=1, seqlen_q=d, seqlen_k=d, headdim=d, causal=False)
    # at N = d the Q/K/V/O traffic equals the score traffic: half the asymptote
    assert iomodel.materialised_cost(short, "fwd", element_bytes=2).intensity == pytest.approx(d / 4)


def test_tiled_intensity_grows_with_sequence_length():
    d, n = 128, 16384
    shape = AttentionShape(batch=1, nheads=1, seqlen_q=n, seqlen_k=n, headdim=d, causal=False)
    # 4 N^2 d FLOPs over 2 bytes x 4 N d + 4 N bytes of lse = N d / (2 d + 1)
    assert iomodel.tiled_cost(shape, "fwd", 2).intensity == pytest.approx(n * d / (2 * d + 1))
    ridge = iomodel.DATASHEET_ROOFLINES["H200"].ridge_intensity
    assert iomodel.tiled_cost(shape, "fwd", 2).intensity > ridge > iomodel.materialised_cost(shape, "fwd", 2).intensity


def test_roofline_takes_the_slower_of_compute_and_memory():
    roof = Roofline(peak_flops=100e12, bandwidth=1e12, source="test")
    assert roof.ridge_intensity == 100
    assert roof.predicted_seconds(Cost(flops=1e12, hbm_bytes=1e9)) == pytest.approx(0.01)  # compute-bound
    assert roof.predicted_seconds(Cost(flops=1e9, hbm_bytes=1e11)) == pytest.approx(0.1)  # memory-bound


@pytest.mark.parametrize("name, key", [("NVIDIA H200", "H200"), ("NVIDIA H100 80GB HBM3", "H100 SXM"),
                                       ("NVIDIA A100-SXM4-80GB", "A100"), ("NVIDIA B200", "B200")])
def test_datasheet_lookup(name, key):
    assert iomodel.datasheet_roofline(name) is iomodel.DATASHEET_ROOFLINES[key]


def test_datasheet_values_and_unknown_parts():
    h200 = iomodel.DATASHEET_ROOFLINES["H200"]
    assert (h200.peak_flops, h200.bandwidth) == (989e12, 4.8e12)
    assert iomodel.datasheet_roofline("NVIDIA H100 PCIe") is None  # lower peaks than the SXM part
    assert iomodel.datasheet_roofline("NVIDIA GeForce RTX 4090") is None


def test_access_counts_by_hand():
    assert iomodel.standard_accesses(1024, 64) == 1024**2 + 1024 * 64
    assert iomodel.tiled_accesses(1024, 64, 48000) == pytest.approx(1024**2 * 64**2 / 48000 + 1024 * 64)


def test_access_ratio_matches_design_doc():
    assert round(iomodel.access_ratio(1024, 64, 48000), 2) == 7.19
    assert round(iomodel.access_ratio(8192, 64, 48000), 2) == 10.82
    assert round(iomodel.access_ratio_limit(64, 48000), 1) == 11.7


def test_access_ratio_saturates_at_sram_over_headdim_squared():
    limit = iomodel.access_ratio_limit(64, 48000)
    ratios = [iomodel.access_ratio(2**k, 64, 48000) for k in range(8, 25)]
    assert all(a < b < limit for a, b in zip(ratios, ratios[1:])), ratios
    assert ratios[-1] == pytest.approx(limit, rel=1e-3)


@pytest.mark.parametrize("call, fragment", [
    (lambda: iomodel.benchmark_flops(SMALL, "forward"), "mode"),
    (lambda: iomodel.cost("dense", SMALL, "fwd", 2), "model"),
    (lambda: iomodel.tiled_cost(SMALL, "fwd", 0), "element_bytes"),
    (lambda: AttentionShape(batch=0, nheads=1, seqlen_q=1, seqlen_k=1, headdim=1, causal=False), "batch"),
    (lambda: iomodel.tiled_accesses(1024, 64, 0), "sram_elements"),
])
def test_bad_arguments_raise_value_error(call, fragment):
    with pytest.raises(ValueError, match=fragment):
        call()
