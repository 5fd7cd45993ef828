"""What a Ray Train V2 user relies on beyond fit(): configs as dataclasses, Ray's order of
best_checkpoints, get_best_checkpoint, worker_runtime_env, resume_from_checkpoint, the error
classes to catch, and clear refusals of Ray-only arguments."""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from pathlib import Path

import pytest

import jaxtrain
from jaxtrain import (
    Checkpoint,
    CheckpointConfig,
    ControllerError,
    FailureConfig,
    JaxTrainer,
    Result,
    RunConfig,
    ScalingConfig,
    TrainingFailedError,
    UserCallback,
    WorkerGroupError,
)


def test_configs_are_dataclasses_compared_by_value_and_replaced_with_validation():
    assert ScalingConfig(num_workers=2) == ScalingConfig(num_workers=2)
    assert ScalingConfig(num_workers=2) != ScalingConfig(num_workers=3)
    assert FailureConfig(max_failures=2) == FailureConfig(max_failures=2)
    assert CheckpointConfig(num_to_keep=2) == CheckpointConfig(num_to_keep=2)
    run = RunConfig(name="a", storage_path="/tmp/x")
    assert run == RunConfig(name="a", storage_path="/tmp/x")
    assert dataclasses.is_dataclass(run)

    wider = dataclasses.replace(ScalingConfig(num_workers=2), num_workers=4)
    assert wider.num_workers == 4 and wider == ScalingConfig(num_workers=4)
    assert dataclasses.replace(run, name="b").name == "b"
    assert dataclasses.asdict(FailureConfig(max_failures=-1)) == {
        "max_failures": -1, "controller_failure_limit": 3, "progress_timeout_s": "auto",
        "max_preemption_failures": -1, "preemption_grace_s": 30.0,
        "unreachable_host_timeout_s": 300.0}
    # A replaced field is validated like a given one.
    with pytest.raises(ValueError, match=r"ScalingConfig.num_workers=-1"):
        dataclasses.replace(wider, num_workers=-1)
    with pytest.raises(ValueError, match=r"FailureConfig.max_failures=-2"):
        dataclasses.replace(FailureConfig(), max_failures=-2)
    with pytest.raises(ValueError, match=r"FailureConfig.unreachable_host_timeout_s=-1.*>= 0"):
        FailureConfig(unreachable_host_timeout_s=-1)
    with pytest.raises(ValueError, match=r"FailureConfig.unreachable_host_timeout_s=.5m."):
        FailureConfig(unreachable_host_timeout_s="5m")


def test_run_config_takes_callbacks_and_a_worker_runtime_env(tmp_path):
    callback = UserCallback()
    run = RunConfig(callbacks=[callback], worker_runtime_env={
        "env_vars": {"A": "1"}, "working_dir": str(tmp_path)})
    assert run.callbacks == [callback]
    assert run.worker_runtime_env == {"env_vars": {"A": "1"}, "working_dir": str(tmp_path)}


@pytest.mark.parametrize("kwargs,fragments", [
    ({"callbacks": [object()]}, ["RunConfig.callbacks[0]=", "jaxtrain.UserCallback"]),
    ({"callbacks": UserCallback()}, ["RunConfig.callbacks=", "list"]),
    ({"worker_runtime_env": {"pip": ["x"]}}, ["worker_runtime_env key 'pip'",
                                              "allowed: 'env_vars', 'working_dir'"]),
    ({"worker_runtime_env": {"env_vars": {"A": 1}}}, ["['env_vars']['A']=1", "strings"]),
    ({"worker_runtime_env": {"env_vars": {"JAXTRAIN_RANK": "3"}}}, ["'JAXTRAIN_RANK'"]),
    ({"worker_runtime_env": {"working_dir": "/no/such/dir"}}, ["'/no/such/dir'",
                                                                "not a directory"]),
    ({"worker_runtime_env": ["env_vars"]}, ["worker_runtime_env=['env_vars']"]),
])
def test_bad_run_config_fields_are_named_with_what_is_allowed(kwargs, fragments):
    with pytest.raises(ValueError) as e:
        RunConfig(**kwargs)
    for f in fragments:
        assert f in str(e.value), str(e.value)


@pytest.mark.parametrize("kwargs,fragment", [
    ({"jax_config": object()}, "jax_config="),
    ({"datasets": {"train": [1, 2]}}, "jaxtrain.data.shard()"),
    ({"dataset_config": object()}, "dataset_config=...) is not supported"),
    ({"resume_from_checkpoint": "/some/dir"}, "resume_from_checkpoint='/some/dir'"),
])
def test_ray_only_arguments_are_refused_with_what_to_do(kwargs, fragment):
    with pytest.raises(ValueError) as e:
        JaxTrainer(lambda: None, **kwargs)
    assert fragment in str(e.value)


def test_error_classes_are_training_failed_errors_as_in_ray():
    assert issubclass(WorkerGroupError, TrainingFailedError)
    assert issubclass(ControllerError, TrainingFailedError)
    assert jaxtrain.train.WorkerGroupError is WorkerGroupError
    failure = {"rank": 1, "host": "h", "attempt": 0, "cause": "exception", "message": "boom",
               "traceback": "Traceback ...\nValueError: boom\n", "log_path": "", "log_tail": ""}
    e = TrainingFailedError.from_failure(failure, [failure])
    assert isinstance(e, WorkerGroupError)
    assert list(e.worker_failures) == [1] and "ValueError: boom" in str(e.worker_failures[1])
    start_up = dict(failure, cause="start-up", traceback="")
    c = TrainingFailedError.from_failure(failure, [failure, start_up])
    assert isinstance(c, ControllerError) and "boom" in str(c.controller_failure)


def _train_scores(config):
    from jaxtrain import report

    for score in config["scores"]:
        with tempfile.TemporaryDirectory() as d:
            Path(d, "score").write_text(str(score))
            report({"score": score, "nested": {"acc": -score}},
                   checkpoint=Checkpoint.from_directory(d))


def test_best_checkpoints_are_in_rays_order_and_get_best_checkpoint_picks_by_metric(storage):
    config = CheckpointConfig(num_to_keep=3, checkpoint_score_attribute="score",
                              checkpoint_score_order="max")
    result = JaxTrainer(
        _train_scores, train_loop_config={"scores": [1, 5, 3, 2, 4, 0]},
        run_config=RunConfig(name="order", storage_path=storage, checkpoint_config=config),
    ).fit()
    # Ray's checkpoint manager: ascending score, the best last; the latest is always kept.
    assert [m["score"] for _, m in result.best_checkpoints] == [0, 3, 4, 5]
    assert result.best_checkpoints[-1][0].path.endswith("checkpoint_000002")
    assert result.get_best_checkpoint("score", "max").path.endswith("checkpoint_000002")
    assert result.get_best_checkpoint("score", "min").path.endswith("checkpoint_000006")
    assert result.get_best_checkpoint("nested/acc", "max").path.endswith("checkpoint_000006")
    assert Result.from_path(result.path).best_checkpoints == result.best_checkpoints
    with pytest.raises(ValueError, match=r"metric='loss'.*\['nested/acc', 'score'\]"):
        result.get_best_checkpoint("loss", "max")
    with pytest.raises(ValueError, match=r"mode='best' is not allowed; use 'max' or 'min'"):
        result.get_best_checkpoint("score", "best")


def test_without_a_score_best_checkpoints_are_oldest_first(storage):
    result = JaxTrainer(
        _train_scores, train_loop_config={"scores": [3, 1, 2]},
        run_config=RunConfig(name="recency", storage_path=storage,
                             checkpoint_config=CheckpointConfig(num_to_keep=2)),
    ).fit()
    assert [os.path.basename(c.path) for c, _ in result.best_checkpoints] == [
        "checkpoint_000002", "checkpoint_000003"]
    assert result.best_checkpoints[-1][0] == result.checkpoint


def _train_from(config):
    from jaxtrain import get_checkpoint, get_context, report

    checkpoint = get_checkpoint()
    with checkpoint.as_directory() as d:
        seen = Path(d, "score").read_text()
    report({"seen": seen, "attempt": get_context().get_attempt(), "cwd": os.getcwd(),
            "env": os.environ.get("MY_SETTING"), "platforms": os.environ.get("JAX_PLATFORMS"),
            "imports": __import__("helper_in_working_dir").VALUE})


def test_resume_from_checkpoint_and_the_runtime_env_reach_every_worker(storage, tmp_path):
    first = JaxTrainer(_train_scores, train_loop_config={"scores": [7]},
                       run_config=RunConfig(name="source", storage_path=storage)).fit()
    work = tmp_path / "work"
    work.mkdir()
    (work / "helper_in_working_dir.py").write_text("VALUE = 42\n")
    result = JaxTrainer(
        _train_from, resume_from_checkpoint=first.checkpoint,
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(name="resumed", storage_path=storage, worker_runtime_env={
            # JAX_PLATFORMS is placement's: the user's value does not override it.
            "env_vars": {"MY_SETTING": "on", "JAX_PLATFORMS": "tpu"},
            "working_dir": str(work)}),
    ).fit()
    assert result.metrics == {"seen": "7", "attempt": 0, "cwd": str(work), "env": "on",
                              "platforms": "cpu", "imports": 42}


def test_a_failed_run_raises_a_worker_group_error_and_from_path_rebuilds_it(storage):
    def fail():
        raise ValueError("no good")

    with pytest.raises(WorkerGroupError) as e:
        JaxTrainer(fail, run_config=RunConfig(name="fails", storage_path=storage)).fit()
    assert "ValueError: no good" in str(e.value.worker_failures[0])
    again = Result.from_path(Path(storage, "fails"))
    assert isinstance(again.error, WorkerGroupError)
    state = json.loads(Path(storage, "fails", "run.json").read_text())
    assert state["status"] == "ERRORED"


# A notebook cell, as IPython compiles it: a file name that exists nowhere but in linecache.
_CELL_FILE = "/nonexistent/ipykernel_0/4242.py"
_CELL = 'def cell_step(x):\n    raise ValueError(f"cell step failed at {x}")\n'


def test_a_workers_traceback_shows_the_users_files_and_lines_and_no_jaxtrain_frame(storage):
    import linecache

    linecache.cache[_CELL_FILE] = (len(_CELL), None, _CELL.splitlines(True), _CELL_FILE)
    cell: dict = {}
    exec(compile(_CELL, _CELL_FILE, "exec"), cell)
    cell_step = cell["cell_step"]

    def train_func():
        cell_step(7)  # the line the traceback must show

    with pytest.raises(WorkerGroupError) as e:
        JaxTrainer(train_func, scaling_config=ScalingConfig(num_workers=2),
                   run_config=RunConfig(name="traceback", storage_path=storage)).fit()
    error_txt = Path(storage, "traceback", "error.txt").read_text()
    for shown in (str(e.value), e.value.worker_traceback, error_txt):
        # The worker has this test's file and not the cell's: the cell's lines came with the
        # function.
        assert f'File "{__file__}", line ' in shown and ", in train_func\n" in shown, shown
        assert "cell_step(7)  # the line the traceback must show" in shown, shown
        assert f'File "{_CELL_FILE}", line 2, in cell_step\n' in shown, shown
        assert 'raise ValueError(f"cell step failed at {x}")' in shown, shown
        assert "<dynamic-code>" not in shown, shown
        assert "jaxtrain/worker" not in shown, shown
        # The traceback starts at the user's function.
        assert "Traceback (most recent call last):\n  File \"" + __file__ in shown, shown


def test_ray_init_is_initialized_and_shutdown_work_after_import_jaxtrain_as_ray():
    import jaxtrain as ray

    assert ray.init() is None  # as Ray's JaxTrainer example calls it
    assert ray.is_initialized()
    ray.init(address="auto", ignore_reinit_error=True)  # what jaxtrain has no use for: ignored
    ray.shutdown()
    assert not ray.is_initialized()
    with pytest.raises(ValueError, match=r"runtime_env=.*RunConfig\(worker_runtime_env=\.\.\.\)"):
        ray.init(runtime_env={"pip": ["optax"]})
    assert {"init", "is_initialized", "shutdown"}.isdisjoint(jaxtrain.__all__)  # star imports


def test_rays_import_paths_give_the_trainer_or_say_what_to_do_instead():
    from jaxtrain.jax import JaxTrainer as Short
    from jaxtrain.train.v2.jax import JaxTrainer as V2

    assert V2 is Short is JaxTrainer
    for module in ("jaxtrain.jax", "jaxtrain.train.v2.jax"):
        with pytest.raises(ImportError, match=rf"{module}.JaxConfig: jaxtrain has no JaxConfig: "
                                              r".*from scaling_config \(use_tpu / use_gpu"):
            exec(f"from {module} import JaxConfig", {})


def test_get_dataset_shard_in_a_worker_fails_with_what_to_use_instead(storage):
    def train_func():
        import jaxtrain as ray

        ray.train.get_dataset_shard("train")

    with pytest.raises(WorkerGroupError) as e:
        JaxTrainer(train_func, scaling_config=ScalingConfig(num_workers=1),
                   run_config=RunConfig(name="dataset-shard", storage_path=storage)).fit()
    assert ("NotImplementedError: get_dataset_shard('train') is not supported: jaxtrain has no "
            "Ray Data") in str(e.value)
    assert "jaxtrain.data.shard()" in str(e.value)


def test_a_results_repr_is_short_as_rays():
    from jaxtrain.goodput import Goodput

    checkpoint = Checkpoint("/runs/r/checkpoint_000002")
    result = Result(metrics={"loss": 0.5, "step": 1}, path="/runs/r", checkpoint=checkpoint,
                    best_checkpoints=[(checkpoint, {"loss": 0.5})] * 20,
                    goodput=Goodput(training=5.0, attempts=(Goodput(attempt=0),) * 10))
    assert repr(result) == str(result) == (
        "Result(\n  metrics={'loss': 0.5, 'step': 1},\n  path='/runs/r',\n  filesystem='local',\n"
        "  checkpoint=Checkpoint(path='/runs/r/checkpoint_000002')\n)")
    failed = Result(metrics=None, path="/runs/f", error=WorkerGroupError("Training failed: ..."))
    assert repr(failed) == ("Result(\n  error='WorkerGroupError',\n  metrics=None,\n"
                            "  path='/runs/f',\n  filesystem='local',\n  checkpoint=None\n)")
