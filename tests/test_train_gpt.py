"""examples/train_gpt.py: a few training steps of a tiny model with both attentions, on the CPU.

The two runs start from the same weights and see the same batches, so in float32 their first-step losses (the
initial model on the first batch) agree up to rounding; the script's own step-0 check must say so too.
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "train_gpt.py"
TINY = ["--device", "cpu", "--precision", "fp32", "--threads", "1", "--steps", "3", "--n-layer", "1", "--n-embd", "32",
        "--n-head", "2", "--block-size", "32", "--batch-size", "4", "--eval-every", "2", "--eval-batches", "1",
        "--sample-chars", "4", "--dropout", "0.1"]


@pytest.fixture(scope="module")
def train_gpt():
    """The example imported by path (examples/ is not a package); registered while it runs, as dataclasses need."""
    spec = importlib.util.spec_from_file_location("train_gpt", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[spec.name]


def test_both_attentions_train_and_agree_at_step_0(train_gpt, tmp_path):
    plot, numbers = tmp_path / "loss.png", tmp_path / "numbers.json"
    result = train_gpt.main([*TINY, "--attn", "both", "--plot", str(plot), "--json", str(numbers)])

    runs = {run["attn"]: run for run in result["runs"]}
    assert list(runs) == ["flashtile", "sdpa"], f"runs: {list(runs)}"
    for name, run in runs.items():
        values = {"step losses": run["step_losses"], "final train loss": [run["final_train_loss"]],
                  "final val loss": [run["final_val_loss"]], "tokens/s": [run["tokens_per_s"]]}
        for what, losses in values.items():
            assert all(math.isfinite(v) for v in losses), f"{name}: {what} not finite: {losses}"
        assert len(run["step_losses"]) == 3, f"{name}: {len(run['step_losses'])} step losses for 3 steps"
        prompt = train_gpt.SAMPLE_PROMPT
        assert run["sample"].startswith(prompt) and len(run["sample"]) == len(prompt) + 4, \
            f"{name}: greedy sample {run['sample']!r} is not {prompt!r} and 4 characters"
    first = {name: run["step_losses"][0] for name, run in runs.items()}
    assert abs(first["flashtile"] - first["sdpa"]) <= 1e-4, f"first-step losses differ: {first}"
    check = result["step0_check"]
    assert check["agree"] and check["loss_difference"] <= 1e-4, f"the script's step-0 check: {check}"

    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", f"{plot} is not a PNG"
    written = json.loads(numbers.read_text())
    assert [run["step_losses"] for run in written["runs"]] == [run["step_losses"] for run in result["runs"]], \
        "the JSON file's losses differ from main's result"


def test_missing_tqdm_is_named_with_the_extra(train_gpt, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm", None)  # None in sys.modules: importing it raises ImportError
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)
    with pytest.raises(SystemExit, match=r"needs tqdm.*\[examples\]"):
        train_gpt.main([*TINY, "--plot", str(tmp_path / "loss.png")])
    assert not (tmp_path / "loss.png").exists(), "nothing should run without tqdm"
