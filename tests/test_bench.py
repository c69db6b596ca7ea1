"""`flashtile bench`: one quick CPU run end to end, and the pieces it is built from."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys

import pytest
import torch

from flashtile import _dispatch, cli
from flashtile.bench import providers as prov
from flashtile.bench import runner
from flashtile.bench import report
from flashtile.iomodel import AttentionShape, benchmark_flops
from flashtile.reference import flash_attn_reference

from conftest import DEVICE

HEADER_KEYS = {"device", "device_name", "driver", "cpu_threads", "torch", "triton", "cuda", "flashtile", "date",
               "dtype", "quick", "tokens_per_batch", "model_width", "seed", "timing", "flops_convention", "ceilings",
               "datasheet", "max_call_seconds"}
CEILING_KEYS = {"matmul_tflops", "matmul_size", "copy_gbps", "copy_bytes"}
ROW_KEYS = {"provider", "batch", "heads", "seqlen_q", "seqlen_k", "headdim", "causal", "mode", "dtype", "status",
            "reason", "ms", "tflops", "matmul_fraction", "roofline_fraction", "io_model", "peak_mib", "rel_error",
            "error_of", "kernels", "kernel_ms", "max_abs_error", "io_bytes"}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """Run `python -m flashtile bench --device cpu --quick` once; return (process, json document, png path)."""
    out = tmp_path_factory.mktemp("bench")
    json_path, png_path = out / "bench.json", out / "bench.png"
    # conftest switches Triton's interpreter on for the CPU suite; the bench must see the environment a
    # user's shell has, where the Triton backend does not serve CPU tensors (interpreted it takes minutes)
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    # a call limit well above the default 2 s: beside a busy test machine's other workers the torch rows took
    # 2.6-3.4 s a call (GPU machine, 16 workers) and the default skipped them
    process = subprocess.run([sys.executable, "-m", "flashtile", "bench", "--device", "cpu", "--quick",
                              "--max-call-seconds", "30", "--json", str(json_path), "--plot", str(png_path)],
                             capture_output=True, text=True, timeout=600, env=env)
    assert process.returncode == 0, f"bench exited {process.returncode}\nstdout:\n{process.stdout}\nstderr:\n{process.stderr}"
    return process, json.loads(json_path.read_text()), png_path


def _rows(document, **match):
    return [r for r in document["rows"] if all(r[key] == value for key, value in match.items())]


def test_header_records_machine_versions_and_ceilings(quick_run):
    _, document, _ = quick_run
    header = document["header"]
    assert set(header) == HEADER_KEYS
    assert set(header["ceilings"]) == CEILING_KEYS
    assert header["device"] == "cpu" and header["dtype"] == "fp32" and header["quick"] is True
    assert header["torch"] == torch.__version__
    assert header["ceilings"]["matmul_size"] == 2048
    assert header["ceilings"]["matmul_tflops"] > 0 and header["ceilings"]["copy_gbps"] > 0


def test_rows_cover_the_quick_grid(quick_run):
    _, document, _ = quick_run
    rows = document["rows"]
    for row in rows:
        assert set(row) == ROW_KEYS, f"row keys differ: {set(row) ^ ROW_KEYS}"
        assert row["status"] in ("ok", "skipped", "failed"), row
    names = [p.name for p in prov.select_providers(None)]
    assert "flashtile[triton:tma]" not in names  # forced schedules run only when named
    cells = {(r["headdim"], r["seqlen_q"], r["causal"], r["mode"]) for r in rows}
    assert cells == {(64, n, c, m) for n in (256, 512) for c in (False, True) for m in ("fwd", "fwd+bwd")}
    assert len(rows) == len(cells) * len(names)
    # the FlashAttention convention at 1024 tokens per batch and model width 256
    assert {(r["seqlen_q"], r["batch"], r["heads"]) for r in rows} == {(256, 4, 4), (512, 2, 4)}


def test_ok_rows_are_measured_and_accurate(quick_run):
    _, document, _ = quick_run
    matmul_tflops = document["header"]["ceilings"]["matmul_tflops"]
    ok = _rows(document, status="ok")
    assert ok, "no provider produced a measurement"
    for row in ok:
        where = f"{row['provider']} N={row['seqlen_q']} causal={row['causal']} {row['mode']}"
        assert row["ms"] > 0 and row["tflops"] > 0, where
        assert row["kernels"] and all(isinstance(k, str) and k for k in row["kernels"]), where
        assert row["rel_error"] < 1e-4, f"{where}: rel error of {row['error_of']} is {row['rel_error']}"
        assert row["error_of"] == ("out" if row["mode"] == "fwd" else "dq"), where
        shape = AttentionShape(row["batch"], row["heads"], row["seqlen_q"], row["seqlen_k"], row["headdim"], row["causal"])
        assert row["tflops"] == pytest.approx(benchmark_flops(shape, row["mode"]) / (row["ms"] * 1e-3) / 1e12), where
        assert row["matmul_fraction"] == pytest.approx(row["tflops"] / matmul_tflops), where
        assert row["roofline_fraction"] > 0 and row["io_model"] in ("tiled", "materialised"), where
        assert row["peak_mib"] is None or row["peak_mib"] >= 0, where
        assert row["kernel_ms"] is None, where  # GPU time of the call's work: CUDA rows only


def test_flashtile_sdpa_and_naive_run_on_the_cpu(quick_run):
    _, document, _ = quick_run
    for provider in ("flashtile[torch]", "sdpa-math", "naive"):
        statuses = {(r["status"], r["reason"]) for r in _rows(document, provider=provider)}
        assert statuses == {("ok", None)}, f"{provider}: {statuses}"
    assert all(r["kernels"][0].startswith("aten::") for r in _rows(document, provider="flashtile[torch]"))


def test_skipped_rows_say_why(quick_run):
    _, document, _ = quick_run
    not_ok = [r for r in document["rows"] if r["status"] != "ok"]
    assert all(r["reason"] for r in not_ok), [r for r in not_ok if not r["reason"]]
    flex = _rows(document, provider="flex")
    assert flex and all(r["status"] == "skipped" and "CUDA" in r["reason"] for r in flex)


def test_terminal_table_and_progress(quick_run):
    process, document, _ = quick_run
    assert "provider" in process.stdout and "TFLOP/s" in process.stdout
    ok = len(_rows(document, status="ok"))
    assert f"{len(document['rows'])} rows: {ok} ok" in process.stdout
    assert f"[{len(document['rows'])}/{len(document['rows'])}]" in process.stderr


def test_rows_that_waited_on_the_host_are_marked():
    """A row timed well above its GPU work (the profiler's) is host-bound, and the table says so."""
    base = dict(provider="flashtile[triton]", batch=16, heads=16, seqlen_q=1024, seqlen_k=1024, headdim=128,
                causal=True, mode="fwd", dtype="bf16", tflops=172.0, matmul_fraction=0.2, roofline_fraction=0.1,
                io_model="tiled", rel_error=2e-3, error_of="out", kernels=["attention_fwd_tma_kernel"])
    waited = runner.Row(ms=0.400, kernel_ms=0.241, **base)
    kernel_bound = runner.Row(ms=0.250, kernel_ms=0.241, **base)
    on_cpu = runner.Row(ms=0.400, **base)
    assert waited.host_bound and not kernel_bound.host_bound and not on_cpu.host_bound
    table = report.format_table(runner.BenchResult(header=_TABLE_HEADER, rows=[waited, kernel_bound, on_cpu]))
    assert table.count("[host-bound: GPU work 0.241 ms]") == 1, table


_TABLE_HEADER = {"device": "cuda", "device_name": "NVIDIA H200", "driver": "580", "cuda": "13.0", "flashtile": "0",
                 "torch": "2", "triton": "3", "date": "2026-11-29", "dtype": "bf16", "datasheet": None,
                 "ceilings": {"matmul_size": 8192, "matmul_tflops": 789.0, "copy_gbps": 4245.0},
                 "tokens_per_batch": 16384, "model_width": 2048, "timing": "median of do_bench"}


def test_plot_is_a_png(quick_run):
    _, _, png_path = quick_run
    data = png_path.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 10_000


def test_a_saved_run_prints_and_plots_again(quick_run, tmp_path, capsys):
    _, document, _ = quick_run
    saved, png = tmp_path / "saved.json", tmp_path / "again.png"
    saved.write_text(json.dumps(document))
    assert cli.main(["bench", "--from-json", str(saved), "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert f"{len(document['rows'])} rows:" in out and png.read_bytes().startswith(PNG_MAGIC)
    assert cli.main(["bench", "--from-json", str(tmp_path / "missing.json")]) == 2


def test_rows_are_reported_as_they_finish(monkeypatch):
    """The CLI rewrites --json after every row, so a run cut short by a time limit keeps its rows."""
    config = runner.make_config(device="cpu", quick=True, seqlens="64", causal="no", mode="fwd", providers="naive")
    seen = []
    result = runner.run_benchmark(config, on_row=lambda partial: seen.append(len(partial.rows)))
    assert seen == list(range(1, len(result.rows) + 1)) and len(result.rows) == config.row_count


def test_a_provider_over_the_call_limit_is_skipped_with_its_time():
    """A row whose single call exceeds --max-call-seconds says so instead of holding the grid."""
    config = runner.make_config(device="cpu", quick=True, seqlens="64", causal="no", mode="fwd", providers="naive",
                                max_call_seconds="1e-9")
    (row,) = runner.run_benchmark(config).rows
    assert row.status == "skipped" and row.ms is None
    assert re.fullmatch(r"one call takes \d+\.\d s, over the limit of 1e-09 s per call \(--max-call-seconds\); "
                        r"not timed", row.reason), row.reason
    unlimited = runner.make_config(device="cpu", quick=True, seqlens="64", causal="no", mode="fwd",
                                   providers="naive", max_call_seconds="0")
    assert unlimited.max_call_seconds is None and runner.run_benchmark(unlimited).rows[0].status == "ok"


@pytest.mark.parametrize("seqlen_q, seqlen_k, causal", [(37, 70, True), (70, 37, True), (50, 50, True), (40, 60, False)])
def test_subsample_oracle_matches_full_reference(seqlen_q, seqlen_k, causal):
    batch, nheads, headdim = 2, 3, 8
    s = runner.InputSet(*(torch.randn(batch, n, nheads, headdim, dtype=torch.float64)
                          for n in (seqlen_q, seqlen_k, seqlen_k, seqlen_q)))
    sub = runner.Subsample.of(seqlen_q, nheads, max_rows=16)
    assert sub.heads == (0, 2) and sub.row_start == seqlen_q - 16
    out, dq = runner.subsample_reference(sub, s, causal, with_dq=True)

    q = s.q.clone().requires_grad_(True)
    full_out, _ = flash_attn_reference(q, s.k, s.v, causal=causal)
    (full_dq,) = torch.autograd.grad(full_out, q, s.dout)
    torch.testing.assert_close(out, sub.take(full_out.detach()), rtol=0, atol=1e-12, msg="out rows differ")
    torch.testing.assert_close(dq, sub.take(full_dq), rtol=0, atol=1e-12, msg="dq rows differ")
    if causal:
        # the mask must matter for these rows, or the offset would go untested
        unmasked, _ = runner.subsample_reference(sub, s, causal=False, with_dq=False)
        assert (unmasked - out).abs().max() > 1e-3


def test_subsample_keeps_all_rows_of_short_sequences():
    assert runner.Subsample.of(seqlen_q=100, nheads=1) == runner.Subsample(heads=(0,), row_start=0)
    assert runner.Subsample.of(seqlen_q=1000, nheads=8) == runner.Subsample(heads=(0, 7), row_start=1000 - 256)


def test_relative_error():
    x = torch.randn(5, 7, dtype=torch.float64)
    assert runner.relative_error(x, x) == 0
    assert runner.relative_error(3 * x, x) == pytest.approx(2.0)


def test_steps_rotate_input_sets_and_check_the_first():
    shape = AttentionShape(batch=1, nheads=2, seqlen_q=8, seqlen_k=8, headdim=4, causal=False)
    sets = runner.make_input_sets(shape, torch.float32, torch.device("cpu"), requires_grad=True)
    assert len(sets) == 2 and not torch.equal(sets[0].q, sets[1].q)
    calls = []

    def forward(q, k, v):
        calls.append(next(i for i, s in enumerate(sets) if s.q.data_ptr() == q.data_ptr()))
        return q * (k.sum() + v.sum())

    def expected(i, mode):  # out of set i, or its dq = dout * (sum k + sum v)
        s = sets[i]
        return (s.q if mode == "fwd" else s.dout) * (s.k.sum() + s.v.sum())

    # bwd runs the forward once per set while building, then only backward passes
    for mode, forward_calls in (("fwd", [0, 1, 0, 1, 0]), ("bwd", [0, 1]), ("fwd+bwd", [0, 1, 0, 1, 0])):
        calls.clear()
        timed, checked = runner.build_step(forward, sets, mode)
        results = [timed() for _ in range(4)]
        value = checked()
        assert calls == forward_calls, (mode, calls)
        for i, result in enumerate(results):
            got = result if mode == "fwd" else result[0]
            torch.testing.assert_close(got, expected(i % 2, mode), msg=f"{mode}: call {i} did not use set {i % 2}")
        torch.testing.assert_close(value, expected(0, mode), msg=f"{mode}: checked() is not set 0's")
        assert not value.requires_grad, mode


def test_quick_cpu_config_follows_the_spec():
    config = runner.make_config(device="cpu", quick=True)
    assert (config.headdims, config.seqlens, config.causal, config.modes) == ((64,), (256, 512), (False, True),
                                                                              ("fwd", "fwd+bwd"))
    assert config.dtype == torch.float32
    assert config.shape(64, 256, causal=True) == AttentionShape(4, 4, 256, 256, 64, True)
    explicit = runner.make_config(device="cpu", quick=True, seqlens="128", mode="bwd", causal="yes")
    assert (explicit.seqlens, explicit.modes, explicit.causal) == ((128,), ("bwd",), (True,))


def test_full_config_follows_the_flash_attention_convention():
    config = runner.make_config(device="cpu")
    assert (config.headdims, config.seqlens, config.modes) == ((64, 128), (1024, 4096, 16384), ("fwd", "bwd", "fwd+bwd"))
    assert config.shape(128, 4096, causal=False) == AttentionShape(4, 16, 4096, 4096, 128, False)


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(headdim="300"), "--headdim: 300 is not in 1..256"),
    (dict(headdim="0"), "--headdim"),
    (dict(headdim="64,abc"), "--headdim: 'abc' is not an integer"),
    (dict(seqlens="-4"), "--seqlens"),
    (dict(mode="fwd,backward"), "--mode: 'backward'"),
    (dict(causal="maybe"), "--causal"),
    (dict(dtype="fp8"), "--dtype"),
    (dict(device="tpu"), "--device"),
    (dict(max_call_seconds="-1"), "--max-call-seconds: '-1' must be >= 0"),
    (dict(max_call_seconds="soon"), "--max-call-seconds: 'soon' is not a number"),
])
def test_bad_values_raise_value_error_naming_the_argument(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment.replace("+", r"\+").replace(".", r"\.")):
        runner.make_config(device=kwargs.pop("device", "cpu"), **kwargs)


def test_unknown_provider_lists_the_known_ones():
    with pytest.raises(ValueError) as raised:
        runner.make_config(device="cpu", providers="flashtile,fa3")
    message = str(raised.value)
    assert message.startswith("--providers: unknown provider 'fa3'")
    assert all(p.name in message for p in prov.all_providers())


def test_forced_forward_schedules_compute_the_same_function():
    """flashtile[triton:tma] / [triton:tma-ws] (named explicitly) run their schedule and agree with float64
    (on the test device: the interpreter in fp32 on CPU, the GPU's bf16 kernels with FLASHTILE_TEST_DEVICE=cuda)."""
    config = runner.make_config(device=DEVICE.type, quick=True, seqlens="128", causal="no", mode="fwd",
                                providers="flashtile[triton:tma],flashtile[triton:tma-ws]",
                                max_call_seconds="0")  # the interpreter is slow
    if DEVICE.type == "cpu":
        # the interpreter: one sequence of 128 tokens (a 128-row tile per head) and one timed call, not 8 and 3
        config = dataclasses.replace(config, tokens_per_batch=128,
                                     timing=dataclasses.replace(config.timing, cpu_repeats=1))
    rows = runner.run_benchmark(config).rows
    assert [r.provider for r in rows] == ["flashtile[triton:tma]", "flashtile[triton:tma-ws]"]
    for row in rows:
        assert row.status == "ok", row.reason
        # bf16 rounding of out alone is ~2e-3 (the grid's every provider measures 2.2e-3 to 2.4e-3)
        assert row.rel_error < (1e-5 if config.dtype == torch.float32 else 5e-3), row


def test_provider_families():
    assert [p.name for p in prov.select_providers(["flashtile"])] == (
        [f"flashtile[{b}]" for b in _dispatch.BACKENDS] + ["flashtile[triton:tma]", "flashtile[triton:gluon]",
                                                           "flashtile[triton:tma-ws]",
                                                           "flashtile[triton:bwd0]", "flashtile[triton:bwd1]",
                                                           "flashtile[triton:bwd2]", "flashtile[triton:bwd3]"])
    assert [p.name for p in prov.select_providers(["sdpa", "naive"])] == ["sdpa-flash", "sdpa-cudnn", "sdpa-efficient",
                                                                          "sdpa-math", "naive"]


def test_cli_reports_bad_values_without_running(capsys):
    assert cli.main(["bench", "--device", "cpu", "--headdim", "512"]) == 2
    assert "--headdim: 512 is not in 1..256" in capsys.readouterr().err
    assert cli.main(["bench", "--device", "cpu", "--quick", "--json", "/no/such/dir/x.json"]) == 2
    assert "--json" in capsys.readouterr().err


def test_flex_fallback_is_detected_from_kernel_names():
    flex = prov.FlexProvider()
    assert flex.kernels_reason(["aten::mm", "aten::_softmax", "aten::bmm"]) == "fell back to eager"
    assert flex.kernels_reason(["triton_tem_fused_0", "aten::fill_"]) is None
    assert flex.kernels_reason(["triton_per_fused_flex_attention_backward_1"]) is None


def test_naive_is_skipped_when_the_score_matrix_is_too_large():
    naive, cpu = prov.NaiveProvider(), torch.device("cpu")
    big = prov.Problem(AttentionShape(1, 32, 16384, 16384, 64, False), torch.float32, cpu, "fwd")
    reason = naive.unavailable_reason(big)
    assert reason is not None and "32.0 GiB" in reason and "4 GiB" in reason
    small = prov.Problem(AttentionShape(4, 4, 512, 512, 64, False), torch.float32, cpu, "fwd")
    assert naive.unavailable_reason(small) is None


def test_optional_packages_say_why_they_cannot_run():
    cpu_problem = prov.Problem(AttentionShape(1, 1, 8, 8, 8, False), torch.float16, torch.device("cpu"), "fwd")
    assert prov.OptionalPackageProvider("flashtile_no_such_package").unavailable_reason(cpu_problem) == "not installed"
    assert prov.OptionalPackageProvider("json").unavailable_reason(cpu_problem) == \
        "json is installed but exposes no flash_attn_func"
