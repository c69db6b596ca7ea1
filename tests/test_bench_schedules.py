"""`flashtile bench --schedules`: the registry's schedules on the same inputs, on the CPU under the interpreter."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from flashtile import cli
from flashtile.bench import providers as prov
from flashtile.bench import report, runner
from flashtile.iomodel import AttentionShape, fa1_forward_cost, tiled_cost

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def schedules_run(tmp_path_factory):
    """`TRITON_INTERPRET=1 python -m flashtile bench --device cpu --schedules --mode fwd --causal no` once, at the
    CPU's tiny default grid (d = 16, N = 32, one sequence of 2 heads); returns (process, json document, png)."""
    out = tmp_path_factory.mktemp("bench-schedules")
    json_path, png_path = out / "schedules.json", out / "schedules.png"
    env = dict(os.environ, TRITON_INTERPRET="1")
    process = subprocess.run([sys.executable, "-m", "flashtile", "bench", "--device", "cpu", "--schedules", "--mode",
                              "fwd", "--causal", "no", "--max-call-seconds", "0", "--json", str(json_path), "--plot",
                              str(png_path)], capture_output=True, text=True, timeout=600, env=env)
    assert process.returncode == 0, \
        f"bench exited {process.returncode}\nstdout:\n{process.stdout}\nstderr:\n{process.stderr}"
    return process, json.loads(json_path.read_text()), png_path


def test_every_schedule_has_a_row_on_the_same_inputs(schedules_run):
    process, document, png_path = schedules_run
    rows = {row["provider"]: row for row in document["rows"]}
    assert list(rows) == ["schedule:fa1", "schedule:fa2", "schedule:fa3", "schedule:fa4", "schedule:decode"]
    assert {(r["headdim"], r["seqlen_q"], r["batch"], r["heads"], r["mode"]) for r in rows.values()} == {
        (16, 32, 1, 2, "fwd")}
    assert rows["schedule:fa3"]["status"] == "skipped" and "interpreter" in rows["schedule:fa3"]["reason"]
    for name in ("fa1", "fa2", "fa4", "decode"):
        row = rows[f"schedule:{name}"]
        assert row["status"] == "ok", row
        assert row["tflops"] > 0 and 0 < row["matmul_fraction"] and row["kernels"], row
        assert row["max_abs_error"] < 1e-5 and row["rel_error"] < 1e-5, row  # fp32
    # the IO model: fa1's forward also moves O, m and l per key block; fa2 and fa4 the compulsory bytes
    assert rows["schedule:fa1"]["io_bytes"] > rows["schedule:fa2"]["io_bytes"] == rows["schedule:fa4"]["io_bytes"]
    table = process.stdout
    assert "max err" in table and "model MB" in table and "5 rows: 4 ok, 1 skipped, 0 failed" in table, table
    assert png_path.read_bytes().startswith(PNG_MAGIC)


def test_a_saved_schedules_run_prints_its_own_table(schedules_run, tmp_path, capsys):
    _, document, _ = schedules_run
    path = tmp_path / "saved.json"
    path.write_text(json.dumps(document))
    assert cli.main(["bench", "--from-json", str(path)]) == 0
    assert "schedule " in capsys.readouterr().out


def test_schedules_on_the_cpu_need_the_interpreter(monkeypatch, capsys):
    from flashtile.triton import configs

    monkeypatch.setattr(configs, "interpreting", lambda: False)
    assert cli.main(["bench", "--device", "cpu", "--schedules"]) == 2
    assert "set TRITON_INTERPRET=1" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--providers", "sdpa"], "cannot be combined with --providers"),
    (["--mode", "decode"], "the decode schedule has its own grid"),
])
def test_schedules_refuses_what_it_cannot_do(argv, message, capsys):
    assert cli.main(["bench", "--device", "cpu", "--schedules", *argv]) == 2
    assert message in capsys.readouterr().err


def test_schedule_providers_are_named_and_not_in_the_default_grid():
    assert [p.name for p in prov.select_providers(["schedules"])] == [f"schedule:fa{i}" for i in (1, 2, 3, 4)] + [
        "schedule:decode"]
    assert not any(p.name.startswith("schedule:") for p in prov.select_providers(None))
    config = runner.make_config(device="cpu", providers="schedule:fa4")
    assert [p.name for p in config.providers] == ["schedule:fa4"]


def test_fa1_io_model_adds_the_state_per_key_block():
    shape = AttentionShape(batch=2, nheads=3, seqlen_q=100, seqlen_k=130, headdim=64, causal=False)
    extra = fa1_forward_cost(shape, 2, 64).hbm_bytes - tiled_cost(shape, "fwd", 2).hbm_bytes
    assert extra == 2 * 3 * (2 * 3 * 100 * (4 * 64 + 8))  # 3 key blocks, O / m / l read and written
    causal = AttentionShape(batch=2, nheads=3, seqlen_q=100, seqlen_k=130, headdim=64, causal=True)
    assert fa1_forward_cost(causal, 2, 64).hbm_bytes - tiled_cost(causal, "fwd", 2).hbm_bytes == extra / 2
    with pytest.raises(ValueError, match="block_n must be a positive int"):
        fa1_forward_cost(shape, 2, 0)
    assert report.is_schedule_run(runner.BenchResult(header={}, rows=[])) is False
