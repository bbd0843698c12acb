"""The README's code example runs as written and gives the shapes it promises."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).parents[1] / "README.md"


def test_readme_example_runs():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), re.S)
    assert blocks, "README.md has no python example"
    namespace: dict = {}
    exec(compile(blocks[0], str(README), "exec"), namespace)  # noqa: S102 - our own documentation
    torch = namespace["torch"]
    assert namespace["o"].shape == (2, 4, 256, 32)
    assert namespace["om"].shape == (2, 4, 64, 4, 8)
    assert torch.isfinite(namespace["o"]).all() and torch.isfinite(namespace["om"]).all()
    assert namespace["attn"](torch.randn(2, 16, 128)).shape == (2, 16, 128)
    mv, _ = namespace["net"](torch.randn(2, 5, 2, 8), torch.randn(2, 5, 1))
    assert mv.shape == (2, 5, 1, 8)
