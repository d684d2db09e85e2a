"""The README's example runs as written and prints what it says."""

import re
import sys
from pathlib import Path

from conftest import run_checked

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_example_runs(tmp_path):
    code = re.search(r"```python\n(.*?)```", README.read_text(), re.S).group(1)
    script = tmp_path / "example.py"
    script.write_text(code)
    out = run_checked([sys.executable, str(script)])
    assert out.stdout.strip() == "150000.0"
    assert len(code.strip().splitlines()) <= 12
