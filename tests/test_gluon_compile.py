"""The Gluon forward compiles for Hopper (sm_90), without a GPU, in every variant the tile table can pick, and the
Gluon backward kernels (dK/dV, schedule 4; fused, schedule 5) in their variants: with the installed Triton here, and
with the Triton the H200 has (3.6.0, installed into a side directory on first use) in test_gluon_compile_gpu_triton.py,
which runs these tests on its own compile. Each compile takes minutes; two files let pytest-xdist's --dist loadfile
give them to two workers. Gluon does not run in Triton's interpreter, so this is CI's check of it: the PTX uses wgmma
(with the overlap's wait depth 1, 2 in the dK/dV kernel and in the fused backward), setmaxnreg hands the consumers 240
registers and the load warps 24, TMA moves the tiles (the fused backward adds dQ by a TMA reduce), ptxas spills nothing
and serialises no wgmma under 3.6 (under 3.9 the variants SPILLING_UNDER_3_9 and SERIALISED_UNDER_3_9 list), and the
shared memory fits an H200."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import triton

from flashtile.triton import configs
from flashtile.triton.configs import SHARED_MEMORY_LIMIT

GPU_TRITON = "3.6.0"  # the H200's Triton (gluon-on-hopper notes, BENCHMARKS.md)
ROOT = Path(__file__).resolve().parents[1]
SIDE = ROOT / "build" / f"triton-{GPU_TRITON}"


def side_triton() -> Path:
    """A directory holding triton==GPU_TRITON alone, for PYTHONPATH (it shadows the installed Triton)."""
    if not (SIDE / "triton" / "__init__.py").exists():
        process = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target",
                                  str(SIDE), f"triton=={GPU_TRITON}"], capture_output=True, text=True, timeout=600)
        assert process.returncode == 0, f"pip could not install triton=={GPU_TRITON}:\n{process.stderr[-3000:]}"
    return SIDE


def compile_variants(tmp_path_factory, extra_path: str | None) -> list[dict]:
    """The rows tests/sm90_gluon_compile.py prints, run with `extra_path` (a side Triton) first on PYTHONPATH."""
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path_factory.mktemp("gluon-cache"))  # compile for real, not from a cache
    paths = [p for p in (extra_path, str(ROOT / "src"), env.get("PYTHONPATH")) if p]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    process = subprocess.run([sys.executable, str(Path(__file__).with_name("sm90_gluon_compile.py"))], env=env,
                             cwd=Path(__file__).parent, capture_output=True, text=True, timeout=900)
    assert process.returncode == 0, f"compiling the Gluon forward failed:\n{process.stdout[-4000:]}\n" \
                                    f"{process.stderr[-4000:]}"
    return [json.loads(line) for line in process.stdout.splitlines() if line.startswith("{")]


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    rows = compile_variants(tmp_path_factory, None)
    assert {row.get("triton") for row in rows if "triton" in row} == {triton.__version__}
    return rows


def _variants(rows):
    return [row for row in rows if "table" not in row]


def test_every_variant_compiles_with_hopper_matmuls_and_copies(compiled):
    variants = _variants(compiled)
    assert len(variants) >= 12, [row["label"] for row in variants]
    for row in variants:
        assert "error" not in row, f"{row['label']}: {row.get('error')}"
        assert row["wgmma"] and row["tma"], f"{row['label']}: wgmma {row['wgmma']}, TMA {row['tma']}"
        # with the overlap the forward waits for its score matmul alone (one P V in flight), the dK/dV kernel for its
        # two score matmuls alone (dV and dK in flight)
        overlap = row["constexprs"].get("OVERLAP", False)
        depth = 2 if row.get("kernel") == "dkdv" else 1
        # the fused backward always waits for dQᵀ alone (dV and dK in flight)
        expected = [0, 2] if row.get("kernel") == "fused" else [0, depth] if overlap else [0]
        assert row["wait_depths"] == expected, f"{row['label']}: waits {row['wait_depths']}"
    # ptxas keeps the in-flight wgmma's register operands apart without serialising the matmuls (under 3.9 but for
    # the variants SERIALISED_UNDER_3_9 lists)
    serialised = sorted(row["label"] for row in variants if row["wgmma_serialized"])
    assert serialised == (SERIALISED_UNDER_3_9 if variants[0]["triton"].startswith("3.9") else []), serialised


# What ptxas spills as Triton calls it (the report's ptxas takes Triton's flags; the stack frame is the compiled
# cubin's own): under triton 3.9, whose --regAllocOptLevel=2 allocates registers differently, three consumer
# warpgroups with overlap (160 registers each) and d = 128 softcap with each tile started under the last; nothing
# under 3.6, the H200's (docs/compiler-workarounds.md)
SPILLING_UNDER_3_9 = ["bf16 d64 n4096 causal False", "bf16 d64 three consumers", "fp16 d128 softcap n1024",
                      "fp16 d64 n4096 causal False"]


# Where ptxas serialises the wgmma ("insufficient register resources"), without spilling: under triton 3.9 the first
# consumer's last block on its first half (gluon_half_diagonal, opt-in) with each tile started under the last, whose
# tile end is compiled once per P width; nothing under 3.6, the H200's
SERIALISED_UNDER_3_9 = ["bf16 d128 n1024 causal, the table's setting, last block on its first half",
                        "bf16 d64 n1024 causal, the table's setting, last block on its first half"]


def test_registers_move_to_the_consumers_and_nothing_spills(compiled):
    spilling = sorted(row["label"] for row in _variants(compiled)
                      if row["spill_stores"] or row["spill_loads"] or row["stack"])
    assert spilling == (SPILLING_UNDER_3_9 if _variants(compiled)[0]["triton"].startswith("3.9") else []), spilling
    for row in _variants(compiled):
        # one consumer (two CTAs per SM): 232 registers, 24 for the loads; two consumers: 240 each, 24 for the
        # loads; three: 160 each, 32 for the loads
        consumers = 2 if row.get("kernel") in ("dkdv", "fused") else row["constexprs"]["BLOCK_M"] // 64
        registers = {1: ("232", "24"), 2: ("240", "24"), 3: ("160", "32")}[consumers]
        assert ["inc", registers[0]] in row["setmaxnreg"] and ["dec", registers[1]] in row["setmaxnreg"], \
            f"{row['label']}: setmaxnreg {row['setmaxnreg']} ({consumers} consumers)"
        assert row["shared"] <= SHARED_MEMORY_LIMIT, f"{row['label']}: {row['shared']} bytes of shared memory"


def test_the_table_takes_the_gluon_forward_in_every_grid_cell(compiled):
    """Every cell of the 12-cell grid (both dtypes) runs the Gluon forward (configs._gluon_forward)."""
    kept = sorted(row["label"] for row in compiled if "table" in row)
    assert kept == [], kept


def test_short_calls_without_a_band_start_each_tile_under_the_last(compiled):
    """Below 4k keys, without a band or causal with every row seeing a key, the table takes gluon_across_tiles
    (configs._gluon_forward): those variants, and only those with a forced one, carry it."""
    across = sorted(row["label"] for row in _variants(compiled) if row["constexprs"].get("ACROSS_TILES"))
    # the first consumer's half block forced on the table's 1k setting, where the table does not take it itself
    half = ([] if _variants(compiled)[0]["triton"] in configs.HALF_DIAGONAL_TABLE_TRITON else
            ["bf16 d128 n1024 causal, the table's setting, last block on its first half",
             "bf16 d64 n1024 causal, the table's setting, last block on its first half"])
    assert across == sorted(["bf16 d128 dv64 n1024", "bf16 d128 n1024 causal False", "bf16 d128 n1024 causal True",
                             "bf16 d128 pingpong, dealt tiles, each tile started under the last",
                             "bf16 d64 causal one consumer, dealt tiles, each tile started under the last",
                             "bf16 d64 n1024 causal False", "bf16 d64 n1024 causal True",
                             "bf16 d64 sink causal n1024",
                             "fp16 d128 n1024 causal False", "fp16 d128 n1024 causal True",
                             "fp16 d128 softcap n1024", "fp16 d64 n1024 causal False", "fp16 d64 n1024 causal True"]
                            + half), across


def test_calls_with_a_learnable_sink_compile_their_own_variant(compiled):
    """A learnable sink reaches the Gluon forward (HAS_SINK, joined in the epilogue): the table's variants with one
    carry it, and only those."""
    sinks = sorted(row["label"] for row in _variants(compiled) if row["constexprs"].get("HAS_SINK"))
    assert sinks == ["bf16 d128 sink causal", "bf16 d64 sink causal n1024"], sinks


def test_packed_batches_compile_at_the_tables_setting_and_the_forced_ones(compiled):
    """The table takes the Gluon forward for packed batches at d = 128 (both dtypes, with and without a causal band,
    dv != d); a forced setting without overlap compiles too."""
    packed = sorted(row["label"] for row in _variants(compiled) if row["constexprs"].get("VARLEN"))
    assert packed == ["bf16 d128 dv64 packed causal GQA", "bf16 d128 packed causal False",
                      "bf16 d128 packed causal True", "bf16 d64 packed causal, blocks of 256 keys",
                      "bf16 d64 packed window no overlap",
                      "fp16 d128 packed causal False", "fp16 d128 packed causal True"], packed


def test_the_gluon_dkdv_kernel_compiles_at_both_query_block_sizes(compiled):
    """Backward schedule 4: 64 query rows per block at d = 64, 32 where a head width is 128 (the spills, registers
    and shared memory are checked with the forward's variants above); with the intra-warpgroup overlap
    (gluon_backward_overlap, three Q / dO stages) wherever it serves: all but the 128-wide heads with a band."""
    rows = [row for row in _variants(compiled) if row.get("kernel") == "dkdv"]
    assert len(rows) == 12, [row["label"] for row in rows]
    assert {row["constexprs"]["BLOCK_M"] for row in rows} == {32, 64}
    overlapped = sorted(row["label"] for row in rows if row["constexprs"]["OVERLAP"])
    assert overlapped == ["bwd bf16 d128 dv64 causal GQA overlap", "bwd bf16 d64 dv128 window GQA overlap",
                          "bwd bf16 d64 overlap", "bwd fp16 d128 overlap", "bwd fp16 d64 ragged causal MQA overlap"], \
        overlapped
    assert all(row["constexprs"]["NUM_STAGES"] == (3 if row["constexprs"]["OVERLAP"] else 2) for row in rows)


def test_the_fused_backward_adds_dq_by_a_tma_reduce_at_both_query_block_sizes(compiled):
    """Backward schedule 5: every variant compiles (the checks above), adds its dQᵀ tiles by a bulk tensor reduce-add
    and has no other reduce; 64 query rows per block at d = 64, 32 where a head width is 128, 16 where both are and a
    window has a left edge. The forward and the dK/dV kernel have none."""
    rows = [row for row in _variants(compiled) if row.get("kernel") == "fused"]
    assert len(rows) == 6, [row["label"] for row in rows]
    for row in rows:
        assert row["tma_reduce"] == ["cp.reduce.async.bulk.tensor.4d.global.shared::cta.add.bulk_group"], \
            f"{row['label']}: {row['tma_reduce']}"
    assert {row["label"]: row["constexprs"]["BLOCK_M"] for row in rows} == {
        "fused bwd bf16 d64": 64, "fused bwd fp16 d64 ragged causal MQA": 64, "fused bwd bf16 d128 causal": 32,
        "fused bwd bf16 d128 window GQA": 16, "fused bwd bf16 d128 dv64 causal GQA": 32,
        "fused bwd bf16 d64 dv128 window GQA": 32}
    assert all(row["tma_reduce"] == [] for row in _variants(compiled) if row.get("kernel") != "fused")


def test_the_first_consumer_halves_its_last_block_where_the_table_or_a_forced_setting_takes_it(compiled):
    """gluon_half_diagonal compiles at d = 64 and 128 causal, with and without each tile started under the last,
    without spills (the checks above) and on the setting's tile: two consumers, blocks of 128 keys, the overlap, a
    band closing on the right, a dense batch. The table takes it at 1k causal keys under triton 3.6 only
    (configs.HALF_DIAGONAL_TABLE_TRITON); the forced variants compile under both releases."""
    rows = [row for row in _variants(compiled) if row["constexprs"].get("HALF_DIAGONAL")]
    in_table = _variants(compiled)[0]["triton"] in configs.HALF_DIAGONAL_TABLE_TRITON
    table = (["bf16 d128 n1024 causal True", "bf16 d64 n1024 causal True", "bf16 d64 sink causal n1024",
              "fp16 d128 n1024 causal True", "fp16 d64 n1024 causal True"] if in_table else [])
    # forced on the table's 1k setting only where the table does not take it (else that is the table's variant)
    on_the_tables_setting = [] if in_table else [
        "bf16 d128 n1024 causal, the table's setting, last block on its first half",
        "bf16 d64 n1024 causal, the table's setting, last block on its first half"]
    forced = ["bf16 d128 causal dealt tiles, last block on its first half",
              "bf16 d64 causal dealt tiles, last block on its first half"] + on_the_tables_setting
    assert sorted(row["label"] for row in rows) == sorted(table + forced), [row["label"] for row in rows]
    for row in rows:
        constexprs = row["constexprs"]
        assert (constexprs["BLOCK_M"], constexprs["BLOCK_N"], constexprs["OVERLAP"], constexprs["HAS_RIGHT"],
                constexprs["VARLEN"]) == (128, 128, True, True, False), row["label"]
        assert row["spill_stores"] == row["spill_loads"] == row["stack"] == 0, row["label"]
    assert sorted(row["label"] for row in rows if row["constexprs"]["ACROSS_TILES"]) == sorted(
        table + on_the_tables_setting)
