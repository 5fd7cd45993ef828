"""examples/flax_char_lm.py as a user runs it: a Flax transformer LM on 4 CPU processes whose
loss goes down, which resumes from its Orbax checkpoint after a killed rank, and leaves
TensorBoard event files and a loss-curve PNG behind."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from conftest import run_command

pytest.importorskip("flax")
pytest.importorskip("orbax.checkpoint")
pytest.importorskip("tensorboardX")
pytest.importorskip("matplotlib")

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "flax_char_lm.py"


def test_the_flax_example_learns_and_resumes_after_a_killed_rank(tmp_path):
    env = dict(os.environ, HOME=str(tmp_path))
    env.pop("JAXTRAIN_SIMULATE", None)
    proc = run_command(
        [sys.executable, str(EXAMPLE), "--steps", "30", "--kill-at", "15"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "jaxtrain_results" / "flax_char_lm"
    state = json.loads((run / "run.json").read_text())
    attempts = state["attempts"]
    assert [a["status"] for a in attempts] == ["ERRORED", "FINISHED"]
    assert attempts[0]["failure"]["rank"] == 2 and attempts[0]["failure"]["cause"] == "signal"
    assert attempts[1]["restored_from"].endswith("checkpoint_000010")

    rows = [json.loads(line)["metrics"] for line in (run / "result.jsonl").read_text().splitlines()]
    # Attempt 0 reached step 14; attempt 1 went on from step 10's checkpoint to step 29.
    assert [r["step"] for r in rows] == list(range(15)) + list(range(10, 30))
    first, last = rows[0]["loss"], rows[-1]["loss"]
    assert last < 0.75 * first, (first, last)

    assert list((run / "tensorboard").glob("events.out.tfevents.*"))
    from matplotlib import image

    assert image.imread(run / "loss.png").shape[:2] == (320, 600)
    assert f"loss curve: {run / 'loss.png'}" in proc.stdout
