"""The README's usage examples run as written (they are the first thing users copy)."""

from __future__ import annotations

import re
from pathlib import Path

import torch


def test_readme_usage_examples_run():
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    examples = re.findall(r"```python\n(.*?)```", text, re.S)
    assert len(examples) == 2, "README.md shows a model's example and the kernels' example"
    namespace: dict = {}
    for example in examples:  # in order, one namespace, as a user pastes them
        exec(compile(example.replace("print(", "str("), "README.md", "exec"), namespace)
    assert namespace["tokens"].shape == (1, 7)  # three tokens and four generated
    assert namespace["y"].shape == (2, 100, 512) and namespace["y"].isfinite().all()
    assert namespace["packed"].shape == (2 * 1024, 8, 32)  # the varlen result
    assert namespace["step"].shape == (2, 1, 8, 32)
    assert torch.equal(namespace["k_cache"][1, 900], namespace["k"][1, -1].detach())  # appended in place
