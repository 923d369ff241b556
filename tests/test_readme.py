"""The README's Python examples run as written."""
import re
from pathlib import Path

import pytest

BLOCKS = re.findall(r"```python\n(.*?)```", (Path(__file__).parents[1] / "README.md").read_text(), re.S)


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_example_runs(index):
    exec(compile(BLOCKS[index], f"README.md block {index}", "exec"), {})
