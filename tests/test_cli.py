"""`python -m flashtile demo` end to end at a small size."""

from __future__ import annotations

import re
import subprocess
import sys


def test_demo_prints_checked_table():
    result = subprocess.run(
        [sys.executable, "-m", "flashtile", "demo", "--batch", "1", "--heads", "2", "--seqlen", "300",
         "--headdim", "32", "--causal", "--repeats", "1", "--device", "cpu"],
        capture_output=True, text=True, timeout=300, check=True)
    lines = result.stdout.splitlines()
    assert any(line.startswith("flashtile backend: 'torch'") for line in lines), result.stdout
    rows = {line.split()[0]: line for line in lines if re.match(r"^(flashtile\[|torch SDPA|naive)", line)}
    assert set(rows) == {"flashtile[torch]", "torch", "naive"}, result.stdout
    max_err = float(rows["flashtile[torch]"].split()[1])
    assert max_err < 1e-5, f"flashtile's error vs float64 is {max_err}"
    assert "aten::" in rows["flashtile[torch]"], "the demo must name what ran"
    assert result.stderr.strip() == "", result.stderr
