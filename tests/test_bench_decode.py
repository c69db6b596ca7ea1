"""`flashtile bench --mode decode` end to end on the test device: on the CPU the Triton decode kernel runs
through the interpreter; with FLASHTILE_TEST_DEVICE=cuda on the GPU (fp32 in both, so the float64 check is tight)."""

from __future__ import annotations

import json

import pytest

from flashtile import cli
from flashtile.bench import decode

from conftest import DEVICE


@pytest.fixture(scope="module")
def decode_run(tmp_path_factory):
    path = tmp_path_factory.mktemp("decode") / "decode.json"
    code = cli.main(["bench", "--mode", "decode", "--device", DEVICE.type, "--dtype", "fp32", "--quick",
                     "--batches", "2", "--cache-lens", "80", "--pages", "0,16", "--json", str(path)])
    assert code == 0
    return json.loads(path.read_text())


def test_rows_cover_the_grid_and_say_why_when_skipped(decode_run):
    rows = decode_run["rows"]
    assert decode_run["header"]["kind"] == "decode" and decode_run["header"]["copy_gbps"] > 0
    assert {(r["provider"], r["page_size"]) for r in rows} == {
        (p, page) for p in decode.PROVIDERS for page in (0, 16)}
    for row in rows:
        if row["status"] == "ok":
            assert row["gbps"] > 0 and row["ms"] > 0 and row["kernels"] and row["kernel_ms"] > 0, row
            assert row["rel_error"] < 1e-5, row
        else:
            assert row["status"] == "skipped" and row["reason"], row
    paged_sdpa = [r for r in rows if r["provider"] == "sdpa" and r["page_size"] == 16]
    assert paged_sdpa[0]["reason"].startswith("torch SDPA reads only a contiguous cache")
    assert all(r["status"] == "ok" for r in rows if r["provider"].startswith("flashtile"))


def test_table_compares_with_sdpa(decode_run, capsys):
    result = decode.DecodeResult(decode_run["header"], [decode.DecodeRow(**r) for r in decode_run["rows"]])
    table = decode.format_decode_table(result).splitlines()
    sdpa = {r.batch: r.gbps for r in result.rows if r.provider == "sdpa" and r.status == "ok"}
    checked = 0
    for row in result.rows:
        if row.provider.startswith("flashtile") and row.status == "ok" and row.batch in sdpa:
            page = "contig" if row.page_size == 0 else str(row.page_size)
            line = next(l for l in table if l.split()[:4] == [row.provider, str(row.batch), str(row.cache_len), page])
            assert f" {row.gbps / sdpa[row.batch]:.2f} " in line, line  # each flashtile row's ratio to SDPA
            checked += 1
    assert checked == 4, table


@pytest.mark.parametrize("argv, message", [
    (["--pages", "0,24"], "--pages: 24 is not 0 (contiguous) or a multiple of 16"),
    (["--batches", "0"], "--batches: 0 is not >= 1"),
    (["--max-call-seconds", "soon"], "--max-call-seconds: 'soon' is not a number of seconds"),
    (["--providers", "flashtile[jax]"], "unknown decode provider 'flashtile[jax]'"),
    (["--plot", "x.png"], "the decode mode draws no plot"),
])
def test_bad_options_exit_2_naming_the_option(argv, message, capsys):
    assert cli.main(["bench", "--mode", "decode", "--device", "cpu", "--quick"] + argv) == 2
    assert message in capsys.readouterr().err
