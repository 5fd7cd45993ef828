"""Every ```python block of the pages on callbacks, data and Orbax runs as a user would paste it
(a fresh script each, default storage under a temporary HOME); a block fenced
```python fragment is an excerpt and is not run."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

from conftest import run_command

DOCS = Path(__file__).resolve().parent.parent / "docs"
_BLOCK = re.compile(r"^```python\n(.*?)^```$", re.M | re.S)


def _blocks():
    return [pytest.param(code, id=f"{page}-{i}")
            for page in ("callbacks.md", "data.md", "orbax.md")
            for i, code in enumerate(_BLOCK.findall((DOCS / page).read_text()))]


@pytest.mark.parametrize("code", _blocks())
def test_docs_snippet_runs(code, tmp_path):
    if "orbax" in code:
        pytest.importorskip("orbax.checkpoint")
    if "TensorBoardLogger" in code:
        pytest.importorskip("tensorboardX")
    if "MLflowLogger" in code:
        pytest.importorskip("mlflow")
    script = tmp_path / "snippet.py"
    script.write_text(code)
    env = dict(os.environ, HOME=str(tmp_path))
    env.pop("JAXTRAIN_SIMULATE", None)
    proc = run_command([sys.executable, str(script)], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
