"""The README's usage example runs as written (it is the first thing users copy)."""

from __future__ import annotations

import re
from pathlib import Path

import torch


def test_readme_usage_example_runs():
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    example = re.search(r"```python\n(.*?)```", text, re.S)
    assert example, "README.md has no ```python block"
    namespace: dict = {}
    exec(compile(example.group(1).replace("print(", "str("), "README.md", "exec"), namespace)
    assert namespace["packed"].shape == (2 * 1024, 8, 32)  # the varlen result
    assert namespace["step"].shape == (2, 1, 8, 32)
    assert torch.equal(namespace["k_cache"][1, 900], namespace["k"][1, -1].detach())  # appended in place
