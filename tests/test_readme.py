"""The README's Python blocks run as written (on the embedded bundle), and every StepStats
field they name exists."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_blocks_run():
    import torch

    from adt_core.results import StepStats

    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert blocks
    torch.set_num_threads(1)
    for code in blocks:
        exec(compile(code, "README.md", "exec"), {})  # noqa: S102 - our own README
        for name in re.findall(r"StepStats: ([^\n]+)", code):
            for field in (f.strip() for f in name.split(",")):
                assert hasattr(StepStats(), field), field
