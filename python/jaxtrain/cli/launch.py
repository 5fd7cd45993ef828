"""``jaxtrain run``, ``plan``, ``submit`` and ``status``: the commands that start runs or ask
where they would go."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from jaxtrain.cli.common import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, UsageError, say, table
from jaxtrain.worker.script_runner import run_script


def parse_resources(text: str) -> dict[str, float]:
    """``TPU=4,CPU=1`` or a JSON object; amounts are checked by ScalingConfig."""
    if text.lstrip().startswith("{"):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise UsageError(f"--resources-per-worker={text!r} is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise UsageError(f"--resources-per-worker={text!r} must be a JSON object")
        return value
    resources: dict[str, float] = {}
    for item in text.split(","):
        key, sep, amount = item.partition("=")
        key = key.strip()
        try:
            number = float(amount)
        except ValueError:
            number = None
        if not sep or not key or number is None:
            raise UsageError(
                f"--resources-per-worker={text!r}: {item.strip()!r} is not NAME=AMOUNT; write "
                "e.g. TPU=4,CPU=1 or {\"TPU\": 4}"
            )
        resources[key] = int(number) if number.is_integer() else number
    return resources


def cmd_run(args: argparse.Namespace) -> int:
    from jaxtrain.config import CheckpointConfig, FailureConfig, RunConfig
    from jaxtrain.driver.trainer import JaxTrainer

    if args.target is None:
        raise UsageError("give the script to run: jaxtrain run [options] script.py [args ...] "
                          "(or -m module)")
    if args.module:
        task: dict[str, Any] = {"module": args.target, "args": args.args}
        _check_module(args.target)
    else:
        script = os.path.abspath(args.target)
        if not os.path.isfile(script):
            raise UsageError(f"cannot find the script '{args.target}' (looked for {script})")
        task = {"script": script, "args": args.args}
    try:
        trainer = JaxTrainer(
            run_script,
            train_loop_config=task,
            scaling_config=scaling_config(args),
            run_config=RunConfig(
                name=args.name,
                storage_path=args.storage_path,
                failure_config=FailureConfig(max_failures=args.max_failures),
                checkpoint_config=CheckpointConfig(
                    num_to_keep=args.num_to_keep,
                    checkpoint_score_attribute=args.checkpoint_score_attribute,
                    checkpoint_score_order=args.checkpoint_score_order,
                ),
            ),
        )
        run_dir = _shown_run_dir(trainer.run_config)
    except ValueError as e:
        raise UsageError(as_options(str(e))) from None
    trainer.status_line = not args.no_status_line
    trainer.say_run_dir = False  # the last line says it
    if args.verbose:
        os.environ["JAXTRAIN_VERBOSE"] = "1"
    if args.hosts:
        os.environ["JAXTRAIN_SSH_HOSTS"] = args.hosts
    if args.hostfile:
        os.environ["JAXTRAIN_HOSTFILE"] = os.path.abspath(args.hostfile)
    if args.coordinator is None:
        return _fit(trainer, args, run_dir)
    from jaxtrain.hosts.join import SameCommand

    try:
        same = SameCommand.from_args(args.coordinator, args.host_rank, args.num_hosts,
                                     args.join_secret_file)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.join_timeout <= 0:
        raise UsageError(f"--join-timeout {args.join_timeout:g} is not allowed; give the "
                         "seconds to wait for the hosts to join (> 0)")
    if same.host_rank != 0:
        return same.join(timeout_s=args.join_timeout)
    status = EXIT_FAILED
    try:
        same.gather(timeout_s=args.join_timeout)
        status = _fit(trainer, args, run_dir)
    except (TimeoutError, OSError) as e:
        say(f"run '{trainer.run_config.name}' could not start: {e}")
    finally:
        same.end(status, run_dir)
    return status


def as_options(message: str) -> str:
    """A message of the Python API in the words of `run`'s command line: the RunConfig fields it
    takes as options named as those options."""
    for field, option in (("RunConfig.storage_path", "--storage-path"),
                          ("RunConfig.name", "--name")):
        message = message.replace(f"{field}=", f"{option} ").replace(field, option)
    return message


def _fit(trainer: Any, args: argparse.Namespace, run_dir: str) -> int:
    from jaxtrain.driver.trainer import make_storage_path
    from jaxtrain.errors import TrainingFailedError

    name = trainer.run_config.name
    try:
        make_storage_path(trainer.run_config)  # said before the run is announced
    except ValueError as e:
        raise UsageError(as_options(str(e))) from None
    say(f"run '{name}' on {_workers(args.num_workers)}; run directory {run_dir}")
    try:
        result = trainer.fit()
    except KeyboardInterrupt:
        say(f"run '{name}' interrupted; every worker was stopped ({run_dir})")
        return EXIT_INTERRUPTED
    except TrainingFailedError as e:
        sys.stderr.write(f"{e}\n")
        say(f"run '{name}' failed; see: jaxtrain show {run_dir}")
        return failed_run_status(e)
    except ValueError as e:
        raise UsageError(as_options(str(e))) from None
    except (RuntimeError, OSError) as e:
        say(f"run '{name}' could not start: {as_options(str(e))}")
        return EXIT_FAILED
    rounds = len(result.report_rounds())
    say(f"run '{name}' finished ({rounds} report round(s)); results in {result.path}")
    return EXIT_OK


def _shown_run_dir(run_config: Any) -> str:
    """The run directory as users name it: a path, or a URL on remote storage."""
    from jaxtrain.driver.trainer import local_run_dir

    path = run_config.storage_path
    if "://" in path and not path.startswith("file://"):
        return f"{path.rstrip('/')}/{run_config.name}"
    return local_run_dir(run_config)


def _workers(num_workers: int | tuple[int, int]) -> str:
    if isinstance(num_workers, tuple):
        return f"{num_workers[0]} to {num_workers[1]} workers"
    return f"{num_workers} worker(s)"


def scaling_config(args: argparse.Namespace) -> Any:
    """The ScalingConfig of the scaling options; its own validation reports bad values."""
    from jaxtrain.config import ScalingConfig

    resources = (
        parse_resources(args.resources_per_worker) if args.resources_per_worker else None
    )
    elastic = {} if args.resize_interval is None else {
        "elastic_resize_monitor_interval_s": args.resize_interval}
    return ScalingConfig(
        num_workers=args.num_workers,
        **elastic,
        use_tpu=args.use_tpu,
        use_gpu=args.use_gpu,
        topology=args.topology,
        accelerator_type=args.accelerator_type,
        resources_per_worker=resources,
        placement_strategy=args.placement_strategy,
    )


def cmd_plan(args: argparse.Namespace) -> int:
    from jaxtrain import _core

    if args.kubernetes:
        return _plan_kubernetes(args)
    try:
        config = scaling_config(args)._core
        from jaxtrain import launch

        ssh = isinstance(launch.choose(), launch.ssh.Ssh)  # listed hosts (docs/hosts.md)
        plan = (_core.plan_ssh(config) if ssh else _core.plan_local(config)).to_dict()
    except ValueError as e:
        raise UsageError(str(e)) from None
    except (RuntimeError, OSError) as e:
        say(f"no plan: {e}")
        return EXIT_FAILED
    if args.json:
        print(json.dumps(plan, indent=2))
        return EXIT_OK
    simulated = " (simulated on local CPU processes)" if plan["simulated"] else ""
    print(f"platform {plan['platform']}{simulated}; hosts from {plan['hosts_source']}; "
          f"{plan['num_slices']} slice(s)")
    rows = [[str(w["rank"]), w["host"], w["slice"] or "-", ",".join(w["devices"]) or "-",
             str(w["local_rank"]), str(w["node_rank"])] for w in plan["workers"]]
    print(table(["RANK", "HOST", "SLICE", "DEVICES", "LOCAL", "NODE"], rows))
    for w in plan["workers"]:
        env = " ".join(f"{k}={v}" for k, v in sorted(w["env"].items()))
        unset = "".join(f" -{k}" for k in w["unset_env"])
        print(f"rank {w['rank']} env: {env}{unset}")
    return EXIT_OK


def _plan_kubernetes(args: argparse.Namespace) -> int:
    """The JobSet of attempt 1, as the Kubernetes launcher would create it; no cluster asked."""
    from jaxtrain import _core
    from jaxtrain.kubernetes.api import load_pod_template
    from jaxtrain.kubernetes.launch import kueue_settings

    try:
        scaling = scaling_config(args)._core
        plan = _core.plan_kubernetes(scaling)
        options = {
            "namespace": os.environ.get("JAXTRAIN_K8S_NAMESPACE", "default"),
            "name": "jaxtrain-run-xxxxx",
            "image": os.environ.get("JAXTRAIN_K8S_IMAGE", "IMAGE"),
            "image_pull_policy": os.environ.get("JAXTRAIN_K8S_IMAGE_PULL_POLICY", ""),
            "service_account": os.environ.get("JAXTRAIN_K8S_SERVICE_ACCOUNT", ""),
            "request_dir": "/unused",
            "worker_command": [os.environ.get("JAXTRAIN_K8S_PYTHON", "python"), "-m",
                               "jaxtrain.worker"],
            "supervisor_argv": ["unused"],
            "pod_template": load_pod_template(
                os.environ.get("JAXTRAIN_K8S_POD_TEMPLATE")),
        }
        options["queue_name"], options["priority_class"] = kueue_settings(os.environ)
        env = dict(plan.to_dict()["workers"][0]["env"])
        workers = args.num_workers
        env["JAXTRAIN_WORLD_SIZE"] = str(workers[1] if isinstance(workers, tuple) else workers)
        jobset = _core.kubernetes_jobset(scaling, json.dumps(options), options["name"] + "-1", env)
    except ValueError as e:
        raise UsageError(str(e)) from None
    print(json.dumps(json.loads(jobset), indent=2))
    return EXIT_OK


def _check_module(name: str) -> None:
    import importlib.util

    top = name.split(".")[0]
    saved = list(sys.path)
    sys.path.insert(0, os.getcwd())
    try:
        found = importlib.util.find_spec(top) is not None
    except (ImportError, ValueError):
        found = False
    finally:
        sys.path[:] = saved
    if not found:
        raise UsageError(
            f"cannot find the module '{name}': no '{top}' in the working directory or on "
            "the Python path"
        )


def failed_run_status(error: Any) -> int:
    """The failing rank's exit status when its process exited with one, else 1."""
    code = getattr(error, "exit_code", None)
    if getattr(error, "cause", "") == "exit" and code is not None and 0 < code < 256:
        return code
    return EXIT_FAILED


# `jaxtrain run` options a submitted run passes on to the driver pod's `jaxtrain run`.
_RUN_VALUE_OPTIONS = ("num_workers", "resize_interval", "topology", "accelerator_type",
                      "resources_per_worker", "placement_strategy", "name", "storage_path",
                      "max_failures", "num_to_keep", "checkpoint_score_attribute",
                      "checkpoint_score_order")


def _run_argv(args: argparse.Namespace) -> list[str]:
    argv = [f"--{flag}" for flag in ("use_tpu", "use_gpu") if getattr(args, flag)]
    for dest in _RUN_VALUE_OPTIONS:
        value = getattr(args, dest)
        if isinstance(value, tuple):
            argv += [f"--{dest}", ":".join(map(str, value))]  # -n MIN:MAX
        elif value is not None:
            argv += [f"--{dest}", str(value)]
    return [a.replace("_", "-") if a.startswith("--") else a for a in argv]


def cmd_submit(args: argparse.Namespace) -> int:
    from jaxtrain.kubernetes import submit as kubernetes

    if args.target is None:
        raise UsageError("give the script to run: jaxtrain submit --kubernetes --image IMAGE "
                          "[options] script.py [args ...]")
    if not os.path.isfile(args.target):
        raise UsageError(f"cannot find the script '{args.target}'")
    env = {}
    for item in args.env:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise UsageError(f"--env '{item}' is not allowed; it must be NAME=VALUE")
        env[name] = value
    try:
        scaling_config(args)  # bad options are refused here, not in the pod
        return kubernetes.submit(args.target, args.args, _run_argv(args), args.image,
                                 args.namespace, args.service_account, args.name,
                                 args.pod_template, env, not args.detach, say)
    except (ValueError, LookupError) as e:
        raise UsageError(str(e)) from None
    except (PermissionError, ConnectionError, ImportError) as e:
        say(f"cannot submit: {e}")
        return EXIT_FAILED


def cmd_status(args: argparse.Namespace) -> int:
    from jaxtrain.kubernetes import submit as kubernetes

    try:
        rows = kubernetes.status(args.namespace, args.name)
    except LookupError as e:
        raise UsageError(str(e)) from None
    except (ValueError, PermissionError, ConnectionError, ImportError) as e:
        say(f"cannot list the submitted runs: {e}")
        return EXIT_FAILED
    print(table(["NAME", "PHASE", "EXIT", "SCRIPT", "CREATED"],
                 [[r["name"], r["phase"] + (f" ({r['detail']})" if r["detail"] else ""),
                   "-" if r["exit_code"] is None else str(r["exit_code"]), r["script"],
                   r["created"]] for r in rows]))
    return EXIT_OK

