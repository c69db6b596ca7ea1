"""The Gluon forward (forward_schedule 3): where the sm_90 table takes it, why it turns a call away, what explain()
says, and that a call it does not serve runs the Triton forward with the same result. Its numbers are checked on an
H200 (benchmarks/gluon_forward.py, tests/test_gpu.py); CI compiles it (tests/test_gluon_compile.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import flashtile
from flashtile.triton import configs

from conftest import DEVICE, random_qkv
from sm90_launches import problem_for

HOPPER = (9, 0)


@pytest.mark.parametrize("headdim", (64, 128))
@pytest.mark.parametrize("seqlen", (1024, 4096, 16384))
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
def test_the_sm90_table_takes_the_gluon_forward_where_it_measured_faster(headdim, seqlen, causal):
    tiles = configs.default_tiles(problem_for(seqlen, seqlen, headdim, headdim, torch.bfloat16, causal), HOPPER)
    assert tiles.forward_schedule == 3
    # the Triton tile stays in the row for the calls the Gluon forward turns away
    assert tiles.block_m >= 64 and tiles.block_n >= 64 and tiles.num_warps >= 4


# (keys per block, consumers, stages, overlap, persistent, balanced, across tiles, pingpong) per cell of the grid
GLUON_TABLE = {(64, 1024, False): (128, 2, 2, 1, 1, 0, 1, 0), (64, 4096, False): (128, 3, 2, 1, 1, 0, 0, 0),
               (64, 16384, False): (128, 3, 2, 1, 0, 0, 0, 0), (64, 1024, True): (128, 2, 2, 1, 1, 1, 1, 0),
               (64, 4096, True): (128, 2, 2, 1, 1, 1, 0, 0), (64, 16384, True): (128, 3, 2, 0, 0, 0, 0, 0),
               (128, 1024, False): (128, 2, 2, 1, 1, 0, 1, 0),
               **{(128, n, False): (128, 2, 2, 1, 1, 0, 0, 0) for n in (4096, 16384)},
               (128, 1024, True): (128, 2, 2, 1, 1, 1, 1, 1),
               **{(128, n, True): (128, 2, 2, 1, 1, 1, 0, 0) for n in (4096, 16384)}}


@pytest.mark.parametrize("cell, settings", GLUON_TABLE.items(), ids=[f"d{d}-n{n}-{'causal' if c else 'full'}"
                                                                      for d, n, c in GLUON_TABLE])
def test_the_sm90_table_picks_the_measured_gluon_settings_per_cell(cell, settings, monkeypatch):
    headdim, seqlen, causal = cell
    problem = problem_for(seqlen, seqlen, headdim, headdim, torch.bfloat16, causal)
    tiles = configs.default_tiles(problem, HOPPER)
    assert (tiles.gluon_block_n, tiles.gluon_consumers, tiles.gluon_stages, tiles.gluon_overlap,
            tiles.gluon_persistent, tiles.gluon_balanced, tiles.gluon_across_tiles, tiles.gluon_pingpong) == settings
    # every setting the table picks is one the Gluon forward serves for the cell
    _on_a_hopper(monkeypatch)
    assert configs.gluon_unserved_reason(dataclasses.replace(problem, device=torch.device("cuda")),
                                         tiles.gluon_tile) == ""


@pytest.mark.parametrize("seqlen_k, offset, half", [(1024, 0, 1), (1024, 128, 0), (1024, 1024, 0), (1024, 2048, 0),
                                                    (512, 0, 0), (2048, 1024, 1)])
def test_the_table_halves_the_last_block_only_where_the_diagonal_crosses_every_tile(seqlen_k, offset, half,
                                                                                  monkeypatch):
    """Ring attention attends pairs of 1k chunks at their global diagonal offset: a chunk of keys wholly before the
    queries (offset 1024 or more) leaves each tile's last block whole to both consumers, and so does SDPA's top-left
    causal mask (offset 0) with fewer keys than queries, so the table's half block, taken under triton 3.6 at 1k
    causal, stays off there."""
    monkeypatch.setattr(configs, "_triton_version", lambda: "3.6.0")
    problem = dataclasses.replace(problem_for(1024, seqlen_k, 64, 64, torch.bfloat16, True), diagonal_offset=offset)
    tiles = configs.default_tiles(problem, HOPPER)
    assert (tiles.forward_schedule, tiles.gluon_half_diagonal) == (3, half)
    _on_a_hopper(monkeypatch)
    assert configs.gluon_unserved_reason(dataclasses.replace(problem, device=torch.device("cuda")),
                                         tiles.gluon_tile) == ""


@pytest.mark.parametrize("change", [
    dict(window_left=100, window_right=0),  # a left window edge: not measured
    dict(varlen=True, headdim=64, headdim_v=64),  # packed d = 64: the Triton forward measured faster
    dict(mask_kind="bool"), dict(dtype=torch.float32), dict(headdim=256, headdim_v=256),
    dict(headdim=32, headdim_v=32)])
def test_the_table_keeps_the_triton_forward_for_what_the_gluon_forward_does_not_take(change):
    problem = dataclasses.replace(problem_for(4096, 4096, 128, 128, torch.bfloat16, False), **change)
    assert configs.default_tiles(problem, HOPPER).forward_schedule != 3
    assert configs.default_tiles(problem_for(4096, 4096, 128, 128, torch.bfloat16, False), (8, 0)).forward_schedule == 0


def _on_a_hopper(monkeypatch):
    """gluon_unserved_reason as on an H200: a CUDA problem, compute capability 9.0, the kernels compiled."""
    monkeypatch.setattr(configs, "interpreting", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: HOPPER)


@pytest.mark.parametrize("change, reason", [
    (dict(), ""),
    (dict(headdim=96, headdim_v=64), ""),  # pads to 128 / 64
    (dict(dtype=torch.float32), "it takes fp16 / bf16, not torch.float32"),
    (dict(mask_kind="additive"), "an attn_mask (additive) runs the Triton kernels"),
    (dict(varlen=True), ""),
    (dict(kvcache=True), "KV-cache calls run the Triton kernels"),
    (dict(headdim=256, headdim_v=256), ""),  # 64-key blocks, the output staged in the query buffer
    (dict(headdim=256, headdim_v=128), "256-wide heads need d == dv (the output shares the query rows' buffer), "
                                       "got 256 / 128"),
    (dict(headdim=40, headdim_v=16), "head dims 40 / 16 pad to widths 64 / 16, not 64, 128 or 256")])
def test_the_gluon_forward_names_why_it_turns_a_call_away(monkeypatch, change, reason):
    _on_a_hopper(monkeypatch)
    problem = dataclasses.replace(problem_for(1024, 1024, 128, 128, torch.bfloat16, True), device=torch.device("cuda"),
                                  **change)
    assert configs.gluon_unserved_reason(problem, configs.GluonTile()) == reason


@pytest.mark.parametrize("tile, headdim, reason", [
    (configs.GluonTile(block_n=256, overlap=False), 64, ""),
    (configs.GluonTile(block_n=256, overlap=False, pingpong=True), 64, ""),
    (configs.GluonTile(block_n=256), 64, "blocks of 256 keys with intra-warpgroup overlap hold two 64 x 256 score "
                                         "tiles at once and spill; they run without it (gluon_overlap=0)"),
    (configs.GluonTile(block_n=256, overlap=False, consumers=3), 64,
     "three consumer warpgroups (160 registers each) take blocks of up to 128 keys (256: ptxas fails)"),
    (configs.GluonTile(block_n=256, overlap=False), 128,
     "2 stages need 295,936 bytes of shared memory, more than sm_90's 232,448"),
    (configs.GluonTile(block_n=256), 256, ""),  # 256-wide heads take blocks of 64 keys whatever the setting
    (configs.GluonTile(block_n=32), 64, "keys per block (gluon_block_n) are 64, 128 or 256, got 32")])
def test_blocks_of_256_keys_are_a_narrow_head_setting_without_overlap(monkeypatch, tile, headdim, reason):
    _on_a_hopper(monkeypatch)
    problem = dataclasses.replace(problem_for(1024, 1024, headdim, headdim, torch.bfloat16, False),
                                  device=torch.device("cuda"))
    assert configs.gluon_unserved_reason(problem, tile) == reason


ACROSS = "the next tile's first block under a tile's last P V (gluon_across_tiles)"
UNSEEN = (f"{ACROSS} is built for dense batches without a left band edge where every row sees a key (no band, or "
          "causal with seqlen_q <= seqlen_k)")


@pytest.mark.parametrize("tile, change, reason", [
    (configs.GluonTile(across_tiles=True), dict(), ""),
    (configs.GluonTile(across_tiles=True, pingpong=True, balanced=True), dict(headdim_v=64), ""),
    (configs.GluonTile(across_tiles=True, overlap=False), dict(),
     f"{ACROSS} continues the intra-warpgroup overlap: it needs gluon_overlap=1"),
    # causal where every row sees a key: seqlen_q <= seqlen_k, or a window reaching right of the diagonal
    (configs.GluonTile(across_tiles=True, balanced=True), dict(window_right=0), ""),
    (configs.GluonTile(across_tiles=True), dict(window_right=0, seqlen_q=900, diagonal_offset=124), ""),
    (configs.GluonTile(across_tiles=True), dict(window_right=30, seqlen_k=1000, diagonal_offset=-24), ""),
    (configs.GluonTile(across_tiles=True), dict(window_right=0, seqlen_k=1000, diagonal_offset=-24), UNSEEN),
    (configs.GluonTile(across_tiles=True), dict(window_left=100), UNSEEN),
    (configs.GluonTile(across_tiles=True), dict(window_left=100, window_right=0), UNSEEN),
    (configs.GluonTile(across_tiles=True), dict(varlen=True), UNSEEN),
    (configs.GluonTile(across_tiles=True, consumers=3), dict(headdim=64, headdim_v=64),
     f"{ACROSS} with three consumer warpgroups (160 registers each) spills"),
    (configs.GluonTile(across_tiles=True), dict(has_alibi=True), f"{ACROSS} with ALiBi spills under triton 3.9"),
    (configs.GluonTile(across_tiles=True, num_stages=3), dict(),
     f"{ACROSS} keeps two tiles' query rows beside the output's staging, which does not fit shared memory here"),
    (configs.GluonTile(across_tiles=True), dict(headdim=256, headdim_v=256),
     f"{ACROSS} keeps two tiles' query rows beside the output's staging, which does not fit shared memory here")])
def test_each_tile_starts_under_the_last_only_where_every_tile_sees_a_key(monkeypatch, tile, change, reason):
    _on_a_hopper(monkeypatch)
    problem = dataclasses.replace(problem_for(1024, 1024, 128, 128, torch.bfloat16, False), device=torch.device("cuda"),
                                  **change)
    assert configs.gluon_unserved_reason(problem, tile) == reason


HALF = "the first consumer's last block on its first half (gluon_half_diagonal)"
CLOSES_AT_THE_DIAGONAL = f"{HALF} needs a band that closes at the diagonal (causal, or a window with window_right = 0)"


def _offset(n):
    return f"{HALF} needs seqlen_k - seqlen_q (the diagonal's offset) to be a multiple of 128, got {n}"


def _past(offset, seqlen_q, seqlen_k):
    return (f"{HALF} needs the diagonal to cross every tile's keys (diagonal offset + the last tile's first row < "
            f"seqlen_k), got offset {offset} with {seqlen_q} query rows and {seqlen_k} keys")


@pytest.mark.parametrize("tile, shape, change, reason", [
    # exact: the band closes at the diagonal, offset by a multiple of 128 either way (a left window edge too)
    (configs.GluonTile(half_diagonal=True), (1024, 1024, 128), dict(), ""),
    (configs.GluonTile(half_diagonal=True, balanced=True, across_tiles=True), (1024, 1024, 64), dict(), ""),
    (configs.GluonTile(half_diagonal=True, balanced=True, across_tiles=True, pingpong=True), (1000, 1000, 128),
     dict(), ""),
    (configs.GluonTile(half_diagonal=True), (256, 384, 128), dict(), ""),
    (configs.GluonTile(half_diagonal=True), (640, 512, 128), dict(), ""),
    (configs.GluonTile(half_diagonal=True), (1000, 1000, 96), dict(window_left=100), ""),
    # the diagonal offset by other than whole blocks of 128 keys
    (configs.GluonTile(half_diagonal=True), (300, 301, 128), dict(), _offset(1)),
    (configs.GluonTile(half_diagonal=True, balanced=True, across_tiles=True), (1000, 1001, 64), dict(), _offset(1)),
    (configs.GluonTile(half_diagonal=True), (1024, 1000, 128), dict(), _offset(-24)),
    (configs.GluonTile(half_diagonal=True), (256, 448, 128), dict(), _offset(192)),
    # a diagonal past the last key (ring attention's pairs of chunks): a tile's last block is whole to both consumers
    (configs.GluonTile(half_diagonal=True), (1024, 1024, 128), dict(diagonal_offset=1024), _past(1024, 1024, 1024)),
    (configs.GluonTile(half_diagonal=True, balanced=True, across_tiles=True), (1000, 1000, 64),
     dict(diagonal_offset=128), _past(128, 1000, 1000)),
    (configs.GluonTile(half_diagonal=True), (1000, 1000, 64), dict(diagonal_offset=-128), ""),
    # a band that does not close at the diagonal
    (configs.GluonTile(half_diagonal=True), (1024, 1024, 128), dict(window_right=20), CLOSES_AT_THE_DIAGONAL),
    (configs.GluonTile(half_diagonal=True), (1024, 1024, 128), dict(window_right=-1), CLOSES_AT_THE_DIAGONAL),
    (configs.GluonTile(half_diagonal=True), (1024, 1024, 128), dict(window_left=64, window_right=64),
     CLOSES_AT_THE_DIAGONAL),
    # packed batches, other tiles
    (configs.GluonTile(half_diagonal=True), (1024, 1024, 128), dict(varlen=True), f"{HALF} is built for dense batches"),
    (configs.GluonTile(half_diagonal=True, consumers=3), (1024, 1024, 64), dict(),
     f"{HALF} is built for two consumer warpgroups (128-row tiles) and blocks of 128 keys, got 3 and 128"),
    (configs.GluonTile(half_diagonal=True, consumers=1, block_n=64), (1024, 1024, 64), dict(),
     f"{HALF} is built for two consumer warpgroups (128-row tiles) and blocks of 128 keys, got 1 and 64"),
    (configs.GluonTile(half_diagonal=True, block_n=64), (1024, 1024, 128), dict(),
     f"{HALF} is built for two consumer warpgroups (128-row tiles) and blocks of 128 keys, got 2 and 64"),
    (configs.GluonTile(half_diagonal=True), (1024, 1024, 256), dict(),  # 256-wide heads take blocks of 64 keys
     f"{HALF} is built for two consumer warpgroups (128-row tiles) and blocks of 128 keys, got 2 and 64"),
    (configs.GluonTile(half_diagonal=True, overlap=False), (1024, 1024, 128), dict(),
     f"{HALF} is built into the intra-warpgroup overlap: it needs gluon_overlap=1")])
def test_the_first_consumer_halves_its_last_block_only_where_its_rows_end_at_the_middle(monkeypatch, tile, shape,
                                                                                       change, reason):
    """gluon_half_diagonal is a compile-time choice for the first consumer: admitted where each tile's last block
    starts at m0 + seqlen_k - seqlen_q (blocks and tiles of 128, the offset a multiple of 128, the band closing at
    the diagonal), turned away elsewhere (the Triton forward runs, explain() says why)."""
    _on_a_hopper(monkeypatch)
    seqlen_q, seqlen_k, headdim = shape
    problem = dataclasses.replace(problem_for(seqlen_q, seqlen_k, headdim, headdim, torch.bfloat16, True),
                                  device=torch.device("cuda"), **change)
    assert configs.gluon_unserved_reason(problem, tile) == reason
    # the setting forced on top of the table's, as use_backend(..., forward_schedule=3, gluon_*=...) does
    tiles = dataclasses.replace(configs.default_tiles(problem, HOPPER), forward_schedule=3, gluon_block_n=tile.block_n,
                                gluon_overlap=int(tile.overlap), gluon_pingpong=int(tile.pingpong),
                                gluon_balanced=int(tile.balanced), gluon_consumers=tile.consumers,
                                gluon_across_tiles=int(tile.across_tiles), gluon_half_diagonal=1)
    assert tiles.gluon_tile == tile
    text = tiles.describe(problem)
    if reason:
        assert f"forward: the Gluon forward does not serve this call ({reason}), so forward (" in text, text
    else:
        assert "each tile's last block computed on its first half by the first consumer" in text, text


@pytest.mark.parametrize("headdim", (64, 128))
def test_the_table_halves_the_last_block_below_4k_causal_keys_where_the_offset_is_whole_blocks(monkeypatch, headdim):
    """The table takes gluon_half_diagonal with each tile started under the last (causal, below 4k keys) where the
    diagonal's offset is a multiple of 128, and only where the setting serves the call (never a turned-away call
    that would leave the Gluon forward)."""
    _on_a_hopper(monkeypatch)
    # the table takes it under the Triton releases measured (configs.HALF_DIAGONAL_TABLE_TRITON); this one, here
    monkeypatch.setattr(configs, "HALF_DIAGONAL_TABLE_TRITON", (configs._triton_version(),))

    def half(seqlen_q, seqlen_k, causal):
        problem = dataclasses.replace(problem_for(seqlen_q, seqlen_k, headdim, headdim, torch.bfloat16, causal),
                                      device=torch.device("cuda"))
        tiles = configs.default_tiles(problem, HOPPER)
        if tiles.gluon_tile.half_diagonal:
            assert tiles.forward_schedule == 3 and not configs.gluon_unserved_reason(problem, tiles.gluon_tile)
        return tiles.gluon_tile.half_diagonal

    assert half(1024, 1024, True) and half(896, 1024, True) and half(1000, 1000, True)
    assert not half(1000, 1001, True) and not half(1024, 1000, True)  # offsets 1 and -24
    assert not half(4096, 4096, True) and not half(16384, 16384, True)
    assert not any(half(n, n, False) for n in (1024, 4096, 16384))
    monkeypatch.setattr(configs, "HALF_DIAGONAL_TABLE_TRITON", ())
    assert not half(1024, 1024, True), "taken under a Triton release it was not measured with"


@pytest.mark.parametrize("headdim", (64, 128))
def test_the_table_starts_each_tile_under_the_last_below_4k_keys_where_every_row_sees_a_key(headdim):
    def across(seqlen_q, seqlen_k, causal):
        tiles = configs.default_tiles(problem_for(seqlen_q, seqlen_k, headdim, headdim, torch.bfloat16, causal),
                                      HOPPER)
        return tiles.forward_schedule == 3 and tiles.gluon_tile.across_tiles
    assert across(1024, 1024, False) and across(100, 4096, False) and across(2048, 2048, False)
    assert across(1024, 1024, True) and across(1000, 2048, True)
    assert not across(4096, 4096, False) and not across(4096, 4096, True)
    # causal with seqlen_q > seqlen_k: rows that see no key
    causal_unseen = configs.default_tiles(problem_for(2000, 1000, headdim, headdim, torch.bfloat16, True), HOPPER)
    assert not causal_unseen.gluon_tile.across_tiles
    assert causal_unseen.forward_schedule == (3 if headdim == 128 else 1)
    for causal in (False, True):
        alibi = configs.default_tiles(problem_for(1024, 1024, headdim, headdim, torch.bfloat16, causal, alibi=True),
                                      HOPPER)
        assert not alibi.gluon_tile.across_tiles and alibi.forward_schedule == (3 if headdim == 128 or not causal
                                                                               else 1)
    # two tiles' query rows fit beside two stages and the output's staging: 2 x (128 x 128 x 2 + 128 x 128) bf16
    # + 2 x 128 x (128 + 128) bf16 + barriers
    problem = problem_for(1024, 1024, 128, 128, torch.bfloat16, False)
    assert configs.gluon_shared_bytes(problem, configs.GluonTile(across_tiles=True)) == 230400


@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
def test_the_table_takes_the_gluon_forward_for_packed_batches_at_d128(causal, monkeypatch):
    problem = dataclasses.replace(problem_for(2000, 2000, 128, 128, torch.bfloat16, causal, batch=7), varlen=True)
    tiles = configs.default_tiles(problem, HOPPER)
    # the snake order: the launcher's deal would need the sequences' lengths, which stay on the GPU
    assert tiles.forward_schedule == 3 and tiles.gluon_tile == configs.GluonTile()
    _on_a_hopper(monkeypatch)
    cuda_problem = dataclasses.replace(problem, device=torch.device("cuda"))
    assert configs.gluon_unserved_reason(cuda_problem, tiles.gluon_tile) == ""
    assert configs.gluon_unserved_reason(cuda_problem, configs.GluonTile(balanced=True)) == (
        "the launcher's deal of tiles (gluon_balanced) needs the sequences' lengths on the host, which a packed batch "
        "keeps on the GPU")
    narrow = dataclasses.replace(cuda_problem, headdim=64, headdim_v=64)
    assert configs.gluon_unserved_reason(narrow, configs.GluonTile(consumers=3)) == \
        "three consumer warpgroups (160 registers each) spill with a packed batch's bookkeeping"


def test_the_gluon_forward_needs_hopper_and_fitting_shared_memory(monkeypatch):
    _on_a_hopper(monkeypatch)
    problem = dataclasses.replace(problem_for(1024, 1024, 128, 128, torch.bfloat16, False), device=torch.device("cuda"))
    assert configs.gluon_unserved_reason(problem, configs.GluonTile(num_stages=4)) == \
        "4 stages need 295,936 bytes of shared memory, more than sm_90's 232,448"
    # three stages fit once the output is staged in the query rows' buffer
    assert configs.gluon_shares_qo(problem, configs.GluonTile(num_stages=3))
    assert not configs.gluon_shares_qo(problem, configs.GluonTile())
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    assert configs.gluon_unserved_reason(problem, configs.GluonTile()) == \
        "it is written for sm_90 (Hopper), this GPU is sm_100"


def test_the_gluon_forward_keeps_to_the_triton_releases_it_is_checked_with(monkeypatch):
    _on_a_hopper(monkeypatch)
    problem = dataclasses.replace(problem_for(1024, 1024, 128, 128, torch.bfloat16, False), device=torch.device("cuda"))
    import triton
    monkeypatch.setattr(triton, "__version__", "3.7.1")
    assert configs.gluon_unserved_reason(problem, configs.GluonTile()) == \
        "it is checked with triton 3.6.0 and 3.9.0, and this is triton 3.7.1"


def test_three_consumers_take_192_rows_and_no_pingpong(monkeypatch):
    _on_a_hopper(monkeypatch)
    problem = dataclasses.replace(problem_for(1024, 1024, 64, 64, torch.bfloat16, False), device=torch.device("cuda"))
    three = configs.GluonTile(consumers=3)
    assert (three.block_m, three.consumer_registers, three.max_registers) == (192, 160, 128)
    assert configs.gluon_unserved_reason(problem, three) == ""
    assert configs.gluon_unserved_reason(problem, configs.GluonTile(consumers=3, pingpong=True)) == \
        "3 consumer warpgroups in pingpong: it takes one, two or three, pingpong two"


def test_one_consumer_runs_two_ctas_per_sm_where_two_fit_shared_memory(monkeypatch):
    _on_a_hopper(monkeypatch)
    one = configs.GluonTile(consumers=1)
    assert (one.block_m, one.consumer_registers, one.max_registers, one.ctas_per_sm) == (64, 232, 128, 2)
    # two CTAs of 2 x 64 query / output rows and 2 stages of 128 keys fit at d = 64; at d = 128 with 64 keys a block
    narrow = dataclasses.replace(problem_for(1024, 1024, 64, 64, torch.bfloat16, True), device=torch.device("cuda"))
    wide = dataclasses.replace(narrow, headdim=128, headdim_v=128)
    assert configs.gluon_unserved_reason(narrow, one) == ""
    assert configs.gluon_unserved_reason(wide, configs.GluonTile(consumers=1, block_n=64)) == ""
    assert configs.gluon_unserved_reason(wide, one) == (
        "one consumer warpgroup runs 2 CTAs per SM, and 2 stages of 128 keys need 164,864 bytes of shared memory "
        "each, more than sm_90's 232,448 for 2")
    assert configs.gluon_unserved_reason(narrow, configs.GluonTile(consumers=1, pingpong=True)) == \
        "1 consumer warpgroups in pingpong: it takes one, two or three, pingpong two"


def test_explain_names_the_gluon_forward_and_its_settings(monkeypatch):
    _on_a_hopper(monkeypatch)
    problem = dataclasses.replace(problem_for(4096, 4096, 128, 128, torch.bfloat16, True), device=torch.device("cuda"))
    text = configs.default_tiles(problem, HOPPER).describe(problem)
    assert text.startswith("forward (attention_fwd_gluon_kernel (Gluon, explicit warp roles")
    from flashtile import _dispatch
    described = _dispatch.BACKENDS["triton"].describe_tiles(problem, configs.default_tiles(problem, HOPPER))
    assert described.endswith("forward visits 528 of 1024 tiles per (batch, head) (32 with an element mask)"), \
        described  # the Gluon forward's 128 x 128 tiles over 4k x 4k keys, causal
    assert ("BLOCK_M 128 (2 consumer warpgroups of 64 rows) x BLOCK_N 128, 2 K/V stages, with intra-warpgroup "
            "overlap, without pingpong, a persistent grid, tiles dealt to the least loaded CTA, 240 registers per "
            "consumer thread") in text


@pytest.mark.skipif(DEVICE.type != "cpu", reason="on a CPU: the Gluon forward cannot run there, so it turns the "
                                                 "call away (on an H200 tests/test_gpu.py runs it)")
def test_a_call_it_turns_away_runs_the_triton_forward_and_explain_says_why(seed):
    q, k, v = random_qkv(2, 100, 130, 4, 2, 64, 64, torch.float16)
    with flashtile.use_backend("triton", forward_schedule=3, block_m=16, block_n=16):
        text = flashtile.explain(q, k, v, causal=True)
        out = flashtile.flash_attn_func(q, k, v, causal=True)
    assert ("forward: the Gluon forward does not serve this call (Gluon kernels do not run in Triton's CPU "
            "interpreter), so forward (attention_fwd_tma_kernel") in text
    with flashtile.use_backend("triton", forward_schedule=1, block_m=16, block_n=16):
        expected = flashtile.flash_attn_func(q, k, v, causal=True)
    assert torch.equal(out, expected)


@pytest.mark.parametrize("setting, value, message", [
    ("gluon_overlap", 2, "tile setting gluon_overlap must be 0 or 1, got 2"),
    ("gluon_persistent", -1, "tile setting gluon_persistent must be 0 or 1, got -1"),
    ("gluon_across_tiles", 2, "tile setting gluon_across_tiles must be 0 or 1, got 2"),
    ("gluon_half_diagonal", 2, "tile setting gluon_half_diagonal must be 0 or 1, got 2"),
    ("gluon_stages", 0, "tile setting gluon_stages must be a positive int, got 0"),
    ("gluon_consumers", 4, "tile setting gluon_consumers must be 1, 2 or 3, got 4"),
    ("gluon_block_n", 96, "tile setting gluon_block_n must be 64, 128 or 256, got 96"),
    ("forward_schedule", 4, "tile setting forward_schedule must be one of [0, 1, 2, 3, 5], got 4")])
def test_gluon_settings_are_checked(setting, value, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        with flashtile.use_backend("triton", **{setting: value}):
            pass


@pytest.mark.parametrize("query_blocks, batch_heads, group_heads, programs, causal", [
    (8, 256, 48, 132, True), (32, 64, 12, 132, True), (128, 16, 3, 132, True), (8, 5, 2, 7, True),
    (8, 256, 256, 132, False), (3, 2, 2, 132, False)])
def test_the_launcher_deals_every_tile_once_and_evenly(query_blocks, batch_heads, group_heads, programs, causal):
    from flashtile.triton.launch import _dealt_tiles

    problem = problem_for(query_blocks * 128, query_blocks * 128, 128, 128, torch.bfloat16, causal, batch=1,
                          nheads=batch_heads)
    tiles, starts = _dealt_tiles(torch.device("cpu"), problem, programs, 128, 128, group_heads)
    num_tiles = query_blocks * batch_heads
    assert sorted(tiles.tolist()) == list(range(num_tiles)) and starts[0] == 0 and starts[-1] == num_tiles
    assert starts.shape == (programs + 1,) and bool((starts[1:] >= starts[:-1]).all())
    # a query block's work: its key blocks (all of them, or those up to the diagonal), plus one
    costs = [1 + (m + 1 if causal else query_blocks) for m in range(query_blocks)]

    def m_block(tile):  # fwd_gluon._tile_coordinates
        if not causal:
            return tile % query_blocks
        group, within = divmod(tile, group_heads * query_blocks)
        heads = min(group_heads, batch_heads - group * group_heads)
        return query_blocks - 1 - within // heads

    loads = [sum(costs[m_block(t)] for t in tiles[starts[p]:starts[p + 1]].tolist()) for p in range(programs)]
    # list scheduling: no CTA ends more than the longest tile after the least loaded one
    assert max(loads) - min(loads) <= max(costs), loads


def test_exponentials_on_the_fma_units_are_an_opt_in_setting(monkeypatch):
    """FlashAttention-4's offload of one exponential in n to the FMA units: a tile setting the table never picks
    (it measured slower on the H200, docs/schedules.md), named by explain()."""
    _on_a_hopper(monkeypatch)
    problem = dataclasses.replace(problem_for(1024, 1024, 64, 64, torch.bfloat16, False), device=torch.device("cuda"))
    assert configs.default_tiles(problem, HOPPER).gluon_tile.exp2_emulated == 0
    tile = configs.GluonTile(exp2_emulated=8)
    assert configs.gluon_unserved_reason(problem, tile) == ""
    assert tile.describe().endswith(", one exponential in 8 on the FMA units")
    assert configs.gluon_unserved_reason(problem, configs.GluonTile(exp2_emulated=3)) == \
        "one exponential in n on the FMA units (gluon_exp2_emulated) takes n = 2, 4 or 8, got 3"
    with pytest.raises(ValueError, match="tile setting gluon_exp2_emulated must be 0, 2, 4 or 8, got 16"):
        with flashtile.use_backend("triton", gluon_exp2_emulated=16):
            pass


def test_the_fma_unit_exponential_is_2_to_the_x_within_1e_4_and_0_at_minus_infinity():
    """_exp2_on_fma_units' arithmetic, step by step in float32 as the PTX does it (no GPU needed): the clamp, the
    rounding by 1.5 * 2^23, the cubic, the exponent bits."""
    import re

    import numpy as np

    from flashtile.triton import fwd_gluon

    ptx = fwd_gluon._exp2_on_fma_units("%x", "%y")
    hexes = [int(h, 16) for h in re.findall(r"0f([0-9A-F]{8})", ptx)]
    clamp, magic, _, c3, c2, c1, one = (np.array([h], dtype=np.uint32).view(np.float32)[0] for h in hexes)

    def emulated(x):
        t = np.maximum(x, clamp)
        r = (t + magic).astype(np.float32)
        f = (t - (r - magic).astype(np.float32)).astype(np.float32)
        p = ((c3 * f + c2).astype(np.float32) * f + c1).astype(np.float32)
        p = (p * f + one).astype(np.float32)
        return (p.view(np.uint32) + (r.view(np.uint32) << np.uint32(23))).astype(np.uint32).view(np.float32)

    x = -np.random.default_rng(0).uniform(0, 126, 200_000).astype(np.float32)
    assert np.abs(emulated(x) / np.exp2(x.astype(np.float64)) - 1).max() < 1.1e-4
    assert emulated(np.array([0.0], dtype=np.float32))[0] == 1.0
    assert (emulated(np.array([-127.0, -300.0, -np.inf], dtype=np.float32)) == 0.0).all()
