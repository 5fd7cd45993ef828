"""The seed's programs in examples/, run as users run them (imports changed, nothing else)."""

import os
import re
import sys
from pathlib import Path

import pytest

from conftest import run_command

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def run_example(name, tmp_path, simulate):
    env = dict(os.environ, HOME=str(tmp_path))  # default storage_path: ~/jaxtrain_results
    env.pop("JAXTRAIN_SIMULATE", None)
    if simulate:
        env["JAXTRAIN_SIMULATE"] = "1"
    return run_command([sys.executable, str(EXAMPLES / name)], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=300)


def test_linear_regression_trains_on_a_simulated_v6e_slice(tmp_path):
    proc = run_example("linear_regression.py", tmp_path, simulate=True)
    assert proc.returncode == 0, proc.stderr
    match = re.search(r"Training finished\. Final loss: (\d+\.\d{4})", proc.stdout)
    assert match, proc.stdout[-2000:]
    runs = list((tmp_path / "jaxtrain_results").iterdir())
    assert len(runs) == 1
    rounds = (runs[0] / "result.jsonl").read_text().splitlines()
    assert len(rounds) == 100  # one per epoch


def test_minimal_program_runs_on_a_simulated_slice(tmp_path):
    proc = run_example("minimal.py", tmp_path, simulate=True)
    assert proc.returncode == 0, proc.stderr


def test_storage_snippet_builds_its_run_configs(tmp_path):
    proc = run_example("storage_paths.py", tmp_path, simulate=False)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("name", ["minimal.py"])
def test_tpu_without_tpus_or_the_switch_fails_at_once_and_names_the_switch(name, tmp_path):
    proc = run_example(name, tmp_path, simulate=False)
    assert proc.returncode != 0
    assert "asks for TPU chips, but this machine has none" in proc.stderr
    assert "JAXTRAIN_SIMULATE=1" in proc.stderr
    assert not (tmp_path / "jaxtrain_results").exists() or not any(
        (tmp_path / "jaxtrain_results").iterdir())


def test_the_readme_usage_example_is_examples_usage_py_and_runs_and_resumes(tmp_path):
    code = (EXAMPLES / "usage.py").read_text()
    program = code[code.index("import json"):]  # less its opening comment
    readme = (EXAMPLES.parent / "README.md").read_text()
    assert f"```python\n{program}```" in readme, "README's usage example is not examples/usage.py"

    proc = run_example("usage.py", tmp_path, simulate=False)
    assert proc.returncode == 0, proc.stderr
    run = tmp_path / "jaxtrain_results" / "my_run"
    assert len((run / "result.jsonl").read_text().splitlines()) == 20
    # Named by step, the two best (lowest loss: the last two) kept.
    assert sorted(p.name for p in run.iterdir() if p.name.startswith("step_")) == [
        "step_18", "step_19"]
    assert "step_19" in proc.stdout
    # Run again: it resumes from step_19 and has no step left to train.
    again = run_example("usage.py", tmp_path, simulate=False)
    assert again.returncode == 0, again.stderr
    assert len((run / "result.jsonl").read_text().splitlines()) == 20
