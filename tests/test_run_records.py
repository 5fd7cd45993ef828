"""A run's records as users read them (result.jsonl, progress.csv, Result, the callbacks,
`jaxtrain metrics`): jaxtrain's own columns never take a user's metric names, and a run directory
written by an earlier version is still read."""

from __future__ import annotations

import csv
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import run_command
from jaxtrain import JaxTrainer, RunConfig, ScalingConfig, TrainingFailedError, UserCallback
from jaxtrain.result import Result

_CONSOLE_SCRIPT = Path(sys.executable).parent / "jaxtrain"
JAXTRAIN = (
    [str(_CONSOLE_SCRIPT)] if _CONSOLE_SCRIPT.exists() else [sys.executable, "-m", "jaxtrain"]
)
OWN = ["jaxtrain/round", "jaxtrain/time"]
# Metric names that jaxtrain's records use for themselves, or did.
USERS = ["time", "round", "step", "checkpoint"]


def jaxtrain(*args) -> subprocess.CompletedProcess:
    return run_command([*JAXTRAIN, *map(str, args)], capture_output=True, text=True, timeout=120)


def _report_names_like_jaxtrains(config):
    from jaxtrain import report

    for step in range(3):
        report({"time": 100 + step, "round": 10 * step, "step": step, "checkpoint": f"c{step}"})


class _Seen(UserCallback):
    def __init__(self):
        self.metrics = []

    def after_report(self, run_context, metrics, checkpoint):
        self.metrics.append(metrics[0])


def test_metrics_named_like_jaxtrains_columns_keep_their_values(storage):
    seen = _Seen()
    result = JaxTrainer(
        _report_names_like_jaxtrains,
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(name="names", storage_path=storage, callbacks=[seen]),
    ).fit()
    expected = [{"time": 100 + s, "round": 10 * s, "step": s, "checkpoint": f"c{s}"}
                for s in range(3)]
    assert result.error is None
    assert result.metrics == expected[-1]
    assert seen.metrics == expected
    assert [json.loads(line)["metrics"] for line in
            Path(result.path, "result.jsonl").read_text().splitlines()] == expected

    frame = result.metrics_dataframe
    assert list(frame.columns) == OWN + USERS
    assert frame["jaxtrain/round"].tolist() == [1, 2, 3]
    assert all(t > 1e9 for t in frame["jaxtrain/time"])  # unix seconds, not the user's
    assert frame[USERS].to_dict("records") == expected

    progress = list(csv.reader(Path(result.path, "progress.csv").read_text().splitlines()))
    assert progress[0] == OWN + sorted(USERS)
    assert [dict(zip(progress[0][2:], row[2:], strict=True)) for row in progress[1:]] == [
        {k: str(v) for k, v in e.items()} for e in expected]

    table = jaxtrain("metrics", result.path)
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines[0].split() == OWN + USERS
    assert lines[-1].split()[2:] == ["102", "20", "2", "c2"]
    as_csv = jaxtrain("metrics", result.path, "--csv")
    assert as_csv.returncode == 0, as_csv.stderr
    rows = list(csv.DictReader(io.StringIO(as_csv.stdout)))
    assert [(r["jaxtrain/round"], r["round"], r["time"]) for r in rows] == [
        ("1", "0", "100"), ("2", "10", "101"), ("3", "20", "102")]
    as_json = jaxtrain("metrics", result.path, "--json")
    assert [json.loads(line)["metrics"] for line in as_json.stdout.splitlines()] == expected

    again = Result.from_path(result.path)
    assert list(again.metrics_dataframe.columns) == OWN + USERS


def _report_jaxtrains_own_name(config):
    from jaxtrain import report

    report({"loss": 1.0, "jaxtrain/round": 7})


def test_a_metric_in_jaxtrains_namespace_is_refused_naming_it(storage):
    with pytest.raises(TrainingFailedError) as failed:
        JaxTrainer(
            _report_jaxtrains_own_name,
            scaling_config=ScalingConfig(num_workers=1),
            run_config=RunConfig(name="reserved", storage_path=storage),
        ).fit()
    message = str(failed.value)
    assert "report(metrics): the metric 'jaxtrain/round' is not allowed" in message, message
    assert "rename the metric" in message


def test_a_run_directory_of_the_earlier_format_is_read(tmp_path):
    # As an earlier version wrote it: progress.csv began "round,time", and a metric named
    # "time" had a second "time" column.
    run = tmp_path / "old"
    (run / "logs").mkdir(parents=True)
    (run / "run.json").write_text(json.dumps({
        "status": "FINISHED", "rounds": 2, "start_time": 100.0, "end_time": 110.0,
        "world_size": 1, "config": {"scaling_config": {"num_workers": 1}},
        "attempts": [{"attempt": 0, "status": "FINISHED", "start_time": 100.0,
                      "ready_time": 101.0, "end_time": 110.0}]}))
    (run / "result.jsonl").write_text(
        '{"round":1,"time":105.5,"metrics":{"loss":0.5,"time":3}}\n'
        '{"round":2,"time":106.5,"metrics":{"loss":0.25,"time":4}}\n')
    (run / "progress.csv").write_text("round,time,loss,time\n1,105.5,0.5,105.5\n"
                                      "2,106.5,0.25,106.5\n")
    result = Result.from_path(run)
    assert result.metrics == {"loss": 0.25, "time": 4}
    assert result.metrics_dataframe.to_dict("records") == [
        {"jaxtrain/round": 1, "jaxtrain/time": 105.5, "loss": 0.5, "time": 3},
        {"jaxtrain/round": 2, "jaxtrain/time": 106.5, "loss": 0.25, "time": 4}]
    table = jaxtrain("metrics", run)
    assert table.returncode == 0, table.stderr
    assert table.stdout.splitlines()[0].split() == OWN + ["loss", "time"]


def test_a_result_reads_its_rounds_when_asked_and_a_torn_line_ends_them(tmp_path):
    """Result.from_path (and fit()'s Result) keeps only the last round's metrics and goodput's
    marks; the rounds are read when asked. A line torn by a crash ends the rounds for both."""
    from jaxtrain import records

    lines = [json.dumps({"round": r, "time": 10.0 + r, "metrics": {"step": r}}) for r in (1, 2)]
    lines.insert(1, json.dumps({"round": 9, "time": 11.5, "checkpoint": "checkpoint_000009",
                                "metrics": {"step": 9}}))
    (tmp_path / "result.jsonl").write_text("\n".join(lines) + '\n{"round": 3, "ti')
    (tmp_path / "run.json").write_text(json.dumps({"status": "ERRORED", "attempts": []}))
    marks, last = records.round_marks(str(tmp_path))
    assert marks == [{"time": 11.0}, {"time": 11.5, "checkpoint": "checkpoint_000009"},
                     {"time": 12.0}]
    assert last["metrics"] == {"step": 2}
    result = Result.from_path(str(tmp_path))
    assert result.metrics == {"step": 2}
    assert [r["round"] for r in result.report_rounds()] == [1, 9, 2]
    assert [r["round"] for r in records.read_rounds(str(tmp_path))] == [1, 9, 2]
