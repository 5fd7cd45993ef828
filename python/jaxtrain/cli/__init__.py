"""The ``jaxtrain`` command: run an unmodified JAX script SPMD, and inspect runs.

    jaxtrain run -n 4 train.py --lr 3e-4     # like torchrun, on the same engine as JaxTrainer
    jaxtrain ls | show RUN | logs RUN -f | metrics RUN --csv | dashboard [STORAGE_PATH]

``run`` is a second front door to ``JaxTrainer``: its training function is ``run_script``, which
runs the script as ``__main__`` in every worker (jax.distributed already initialised). The other
commands only read run directories (docs/architecture.md); they never import jax or start workers.

Exit codes (docs/cli.md): 0 success; 1 the run failed or could not start; N a rank's script exited
with status N; 2 bad usage (an option, a value, an unknown run or script); 130 interrupted.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import os
import sys
from collections.abc import Sequence

from jaxtrain.cli import dashboard
from jaxtrain.cli.common import EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, UsageError, outlive_readers
from jaxtrain.cli.launch import cmd_plan, cmd_run, cmd_status, cmd_submit
from jaxtrain.cli.runs import cmd_logs, cmd_ls, cmd_metrics, cmd_profile, cmd_show, cmd_stack

# --- the parser -----------------------------------------------------------------------------------


_EXIT_CODES = """\
exit status:
  0    success
  1    the run failed (a rank raised, was killed or could not start)
  N    a rank's script exited with status N (sys.exit(N))
  2    bad usage: an unknown option or value, an unknown run, a missing script
  130  interrupted (Ctrl-C); every worker was stopped
"""


def _add_scaling_options(parser: argparse.ArgumentParser) -> None:
    scaling = parser.add_argument_group("scaling (ScalingConfig)")
    scaling.add_argument("-n", "--num-workers", type=_num_workers, default=1, metavar="N",
                         help="worker processes (default 1); 0 for local mode: the script runs "
                         "in this process, without jax.distributed, as Ray's local mode; "
                         "MIN:MAX for an elastic run that trains on MIN to MAX workers as hosts "
                         "come and go (docs/elastic.md)")
    scaling.add_argument("--resize-interval", type=float, default=None, metavar="SECONDS",
                         help="an elastic run below MAX looks for the hosts it lacks this often "
                         "(ScalingConfig.elastic_resize_monitor_interval_s; default 60)")
    scaling.add_argument("--use-tpu", action="store_true", help="run on TPUs")
    scaling.add_argument("--use-gpu", action="store_true", help="run on GPUs")
    scaling.add_argument("--topology", help="TPU slice topology, e.g. 4x4")
    scaling.add_argument("--accelerator-type", help="e.g. TPU-V6E")
    scaling.add_argument("--resources-per-worker", metavar="SPEC",
                         help="e.g. TPU=4,CPU=1 or '{\"TPU\": 4}'")
    scaling.add_argument("--placement-strategy", default="PACK",
                         help="PACK (default), SPREAD, STRICT_PACK or STRICT_SPREAD")


def _num_workers(text: str) -> int | tuple[int, int]:
    """-n N, or -n MIN:MAX (torchrun's --nnodes form) for ScalingConfig(num_workers=(MIN, MAX));
    ScalingConfig checks the numbers themselves."""
    low, sep, high = text.partition(":")
    try:
        return (int(low), int(high)) if sep else int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"'{text}' is not allowed; give a number of workers N, or MIN:MAX") from None


def _add_run_options(parser: argparse.ArgumentParser) -> None:
    where = parser.add_argument_group("run directory (RunConfig)")
    where.add_argument("--name", help="the run's name (default jaxtrain_run-<UTC time>); "
                       "an existing run of this name is resumed from its latest checkpoint")
    where.add_argument("--storage-path", metavar="PATH",
                       help="where runs live (default ~/jaxtrain_results)")
    policy = parser.add_argument_group("failures and checkpoints")
    policy.add_argument("--max-failures", type=int, default=0, metavar="N",
                        help="restart the worker group up to N times (-1: no limit; default 0)")
    policy.add_argument("--num-to-keep", type=int, metavar="N",
                        help="checkpoints to keep (default all)")
    policy.add_argument("--checkpoint-score-attribute", metavar="METRIC",
                        help="keep the best checkpoints by this reported metric")
    policy.add_argument("--checkpoint-score-order", default="max", metavar="ORDER",
                        help="max (default) or min")


def _add_kubernetes_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--namespace", metavar="NS",
                        help="the namespace (default: JAXTRAIN_K8S_NAMESPACE, the kubeconfig "
                        "context's, or default)")


class _Parser(argparse.ArgumentParser):
    """argparse's parser without abbreviations (`--num-worker 2` is an unknown option, not
    --num-workers), whose unknown options are refused by the command they were given to, with
    the option it has that is closest to each ("did you mean --num-workers?")."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        self.commands: dict[str, argparse.ArgumentParser] = {}

    def parse_args(self, args: Sequence[str] | None = None,
                   namespace: argparse.Namespace | None = None) -> argparse.Namespace:
        parsed, unknown = self.parse_known_args(args, namespace)
        if unknown:
            command = self.commands.get(getattr(parsed, "command", None) or "", self)
            command.error(_unrecognized(command, unknown))
        return parsed


def _unrecognized(parser: argparse.ArgumentParser, unknown: list[str]) -> str:
    """argparse's message for `unknown` arguments of `parser`, with a guess per unknown option."""
    known = [o for action in parser._actions for o in action.option_strings if o.startswith("--")]
    guesses = []
    for arg in unknown:
        if arg.startswith("--"):
            close = difflib.get_close_matches(arg.split("=", 1)[0], known, n=1, cutoff=0.6)
            if close:
                guesses.append(f"did you mean {close[0]}?")
    return "; ".join([f"unrecognized arguments: {' '.join(unknown)}", *guesses])


def build_parser() -> argparse.ArgumentParser:
    from jaxtrain import __version__

    formatter = argparse.RawDescriptionHelpFormatter
    parser = _Parser(
        prog="jaxtrain",
        description="Run a JAX script SPMD on N worker processes with jax.distributed "
        "initialised, and inspect runs.",
        epilog="examples:\n  jaxtrain run -n 4 train.py --lr 3e-4\n  jaxtrain ls\n"
        "  jaxtrain show my_run\n\n" + _EXIT_CODES + "\nSee 'jaxtrain COMMAND --help'.",
        formatter_class=formatter,
    )
    parser.add_argument("--version", action="version", version=f"jaxtrain {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    run = commands.add_parser(
        "run",
        help="run a script (or -m module) on every worker",
        usage="jaxtrain run [options] script.py [args ...]\n"
        "       jaxtrain run [options] -m module [args ...]",
        description="Starts the script on every worker with jax.distributed initialised before "
        "its first line (a script's own jax.distributed.initialize() does nothing); "
        "jaxtrain.report() and get_checkpoint() work inside it. Worker output is printed "
        "prefixed '(rank=N) '; on a terminal a live status line stays below it. Everything "
        "after the script (or module) goes to it.",
        epilog="example:\n  jaxtrain run -n 4 --name my_run train.py --epochs 10\n"
        "  JAXTRAIN_SIMULATE=1 jaxtrain run --use-tpu --topology 4x4 -n 4 train.py\n\n"
        + _EXIT_CODES,
        formatter_class=formatter,
    )
    _add_scaling_options(run)
    hosts = run.add_argument_group("hosts (ssh; docs/hosts.md)")
    listed = hosts.add_mutually_exclusive_group()
    listed.add_argument("--hosts", metavar="H1,H2",
                        help="start the workers over ssh on these hosts (h1:4 gives h1 4 workers; "
                        "without counts they share -n equally); sets JAXTRAIN_SSH_HOSTS")
    listed.add_argument("--hostfile", metavar="FILE",
                        help="the hosts as MPI and DeepSpeed list them, 'host slots=N' per line; "
                        "sets JAXTRAIN_HOSTFILE")
    listed.add_argument("--coordinator", metavar="HOST:PORT",
                        help="the same command runs on every host: host 0 (at HOST:PORT) drives "
                        "the run, the others join it; 'tpu': host 0 of this TPU VM slice, port "
                        "8490, and --host-rank/--num-hosts from the slice")
    hosts.add_argument("--host-rank", type=int, metavar="K", help="with --coordinator: this "
                       "host's index, 0 for the host that drives the run")
    hosts.add_argument("--num-hosts", type=int, metavar="M",
                       help="with --coordinator: how many hosts run this command")
    hosts.add_argument("--join-secret-file", metavar="FILE", help="with --coordinator: the secret "
                       "every host holds (mode 600), else JAXTRAIN_JOIN_SECRET")
    hosts.add_argument("--join-timeout", type=float, default=600.0, metavar="S",
                       help="with --coordinator: how long host 0 waits for the other hosts, and "
                       "each other host tries to join (default 600)")
    _add_run_options(run)
    run.add_argument("--no-status-line", action="store_true",
                     help="on a terminal, do not keep the live status line (attempt, ranks up, "
                     "last round, rank 0's metrics, rounds/s) below the output")
    run.add_argument("--verbose", action="store_true",
                     help="also say how jaxtrain goes about the run (ranks started from standby "
                     "workers, the training function preloaded, status codes); sets "
                     "JAXTRAIN_VERBOSE=1")
    run.add_argument("-m", "--module", action="store_true",
                     help="run the target as a module, as python -m does")
    run.add_argument("target", nargs="?", metavar="script.py | module")
    run.add_argument("args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    run.set_defaults(handler=cmd_run)

    submit = commands.add_parser(
        "submit",
        help="run a script on a Kubernetes cluster, its driver in a pod",
        usage="jaxtrain submit --kubernetes --image IMAGE [options] script.py [args ...]",
        description="Creates a driver pod that runs 'jaxtrain run [options] script.py [args]' "
        "in the cluster of the current kubeconfig; its workers are one JobSet (see "
        "docs/kubernetes.md). The script travels in a ConfigMap, mounted in the driver's and "
        "the workers' pods. The console is streamed until the run ends (Ctrl-C only stops the "
        "streaming; --detach returns at once); 'jaxtrain status --kubernetes' and 'jaxtrain "
        "logs --kubernetes NAME' find the run again.",
        epilog="example:\n  jaxtrain submit --kubernetes --image us-docker.pkg.dev/p/r/train:1 "
        "\\\n      --use-tpu --topology 4x4 --accelerator-type TPU-V6E -n 4 \\\n"
        "      --storage-path gs://bucket/runs train.py --epochs 10\n\n" + _EXIT_CODES,
        formatter_class=formatter,
    )
    submit.add_argument("--kubernetes", action="store_true",
                        help="submit to Kubernetes (the only target today; the default)")
    _add_kubernetes_options(submit)
    submit.add_argument("--image", required=True,
                        help="the driver's image, also the workers' unless JAXTRAIN_K8S_IMAGE "
                        "is given with --env; it must have jaxtrain[kubernetes] and jax")
    submit.add_argument("--service-account", metavar="NAME",
                        help="the driver pod's service account (see the Role in "
                        "docs/kubernetes.md)")
    submit.add_argument("--pod-template", metavar="FILE",
                        help="a Pod (YAML or JSON) merged into the driver's and the workers' "
                        "pods: volumes for the storage, tolerations, ...")
    submit.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                        help="an environment variable of the driver (repeatable)")
    submit.add_argument("--detach", action="store_true",
                        help="return once the driver pod is created")
    _add_scaling_options(submit)
    _add_run_options(submit)
    submit.add_argument("target", nargs="?", metavar="script.py")
    submit.add_argument("args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    submit.set_defaults(handler=cmd_submit)

    status = commands.add_parser(
        "status", help="the runs submitted to Kubernetes (jaxtrain submit)",
        description="Lists the driver pods that 'jaxtrain submit' created in the namespace, "
        "oldest first: name, phase, exit status, script and creation time; or one of them.",
        epilog="example:\n  jaxtrain status --kubernetes\n\n" + _EXIT_CODES,
        formatter_class=formatter,
    )
    status.add_argument("--kubernetes", action="store_true",
                        help="look on Kubernetes (the only place today; the default)")
    _add_kubernetes_options(status)
    status.add_argument("name", nargs="?", metavar="NAME", help="one submitted run")
    status.set_defaults(handler=cmd_status)

    plan = commands.add_parser(
        "plan", help="print where each rank would run, its devices and environment",
        description="Prints the placement that 'run' (and JaxTrainer.fit) would use for these "
        "scaling options, without starting anything: rank -> host, slice, devices, and the "
        "environment each worker starts with. Honours JAXTRAIN_HOSTS (a host description) and "
        "JAXTRAIN_SIMULATE=1, as runs do.",
        epilog="example:\n  JAXTRAIN_SIMULATE=1 jaxtrain plan -n 4 --use-tpu --topology 2x2x2 "
        "--accelerator-type TPU-V4\n  JAXTRAIN_HOSTS=hosts.json jaxtrain plan -n 2 --use-gpu "
        "--json\n\n" + _EXIT_CODES,
        formatter_class=formatter,
    )
    _add_scaling_options(plan)
    plan.add_argument("--json", action="store_true", help="the whole plan as JSON")
    plan.add_argument("--kubernetes", action="store_true",
                      help="print the JobSet the Kubernetes launcher would create (JSON; "
                      "honours JAXTRAIN_K8S_IMAGE, _NAMESPACE, _POD_TEMPLATE; asks no cluster)")
    plan.set_defaults(handler=cmd_plan)

    ls = commands.add_parser(
        "ls", help="list the runs under a storage path",
        description="Lists the runs under STORAGE_PATH (or --storage-path; default "
        "~/jaxtrain_results), oldest first: status, attempts, workers, report rounds, start "
        "(UTC, as in the default run names) and duration ('+': running). Before the first run "
        "the default storage path lists none.",
        epilog="example:\n  jaxtrain ls /mnt/nfs/runs\n  jaxtrain ls --storage-path "
        "/mnt/nfs/runs\n\n" + _EXIT_CODES,
        formatter_class=formatter,
    )
    ls.add_argument("storage_path", nargs="?", metavar="STORAGE_PATH")
    ls.add_argument("--storage-path", dest="storage_path_option", metavar="PATH",
                    help="the same as STORAGE_PATH, as show, logs and metrics take it")
    ls.set_defaults(handler=cmd_ls)

    run_help = ("a run's name (under --storage-path, default ~/jaxtrain_results) or its "
                "directory")

    show = commands.add_parser(
        "show", help="a run's config, status, attempts, last metrics, checkpoints and error",
        description="Shows a run, running or finished: config, status, attempts, rank 0's last "
        "metrics, the kept checkpoints (best first, with their scores) and the error, if any.",
        epilog="example:\n  jaxtrain show my_run\n  jaxtrain show /mnt/nfs/runs/my_run\n\n"
        + _EXIT_CODES,
        formatter_class=formatter,
    )
    show.add_argument("run", metavar="RUN", help=run_help)
    show.add_argument("--storage-path", metavar="PATH", help="where to look for RUN by name")
    show.add_argument("--plot", nargs="?", const="", metavar="FILE",
                      help="also draw the metrics per round as a PNG (default RUN/metrics.png; "
                      "needs matplotlib)")
    show.set_defaults(handler=cmd_show)

    stack = commands.add_parser(
        "stack", help="every rank's Python stacks of a live run, now",
        description="Prints every rank's Python stacks now (every thread: file, line, function), "
        "with what jaxtrain knows of each rank (its report() calls, the collective it waits in), "
        "without stopping the run: like py-spy dump over the whole job, on every launcher. The "
        "stacks are also kept under the run directory (stacks/attempt-N/live-K). Run it on the "
        "driver's host.",
        epilog="example:\n  jaxtrain stack my_run\n\n" + _EXIT_CODES,
        formatter_class=formatter,
    )
    stack.add_argument("run", metavar="RUN", help=run_help)
    stack.add_argument("--storage-path", metavar="PATH", help="where to look for RUN by name")
    stack.set_defaults(handler=cmd_stack)

    profile = commands.add_parser(
        "profile", help="trace N steps of a live run on every rank with jax.profiler",
        description="Every rank of a live run traces its next N steps with jax.profiler, from "
        "its next report() to N reports later, into the run directory "
        "(profiles/attempt-A/profile-K/rank-R). View them in TensorBoard's profile plugin "
        "(tensorboard --logdir that folder; pip install tensorboard tensorboard-plugin-profile) "
        "or in Perfetto (open a rank's perfetto_trace.json.gz at https://ui.perfetto.dev). Run "
        "it on the driver's host.",
        epilog="example:\n  jaxtrain profile my_run --steps 5\n\n" + _EXIT_CODES,
        formatter_class=formatter,
    )
    profile.add_argument("run", metavar="RUN", help=run_help)
    profile.add_argument("--steps", type=int, default=5, metavar="N",
                         help="how many steps (report() calls) to trace (default 5)")
    profile.add_argument("--storage-path", metavar="PATH", help="where to look for RUN by name")
    profile.set_defaults(handler=cmd_profile)

    logs = commands.add_parser(
        "logs", help="print (or follow) the workers' output",
        description="Prints the output of every rank, each line prefixed '(rank=N) ', or of one "
        "rank as it is. Each attempt begins with a '===== jaxtrain: attempt N =====' line.",
        epilog="example:\n  jaxtrain logs my_run --rank 1\n  jaxtrain logs my_run -f\n\n"
        + _EXIT_CODES,
        formatter_class=formatter,
    )
    logs.add_argument("run", metavar="RUN", help=run_help)
    logs.add_argument("--rank", type=int, metavar="R", help="only this rank, without prefix")
    logs.add_argument("-f", "--follow", action="store_true",
                      help="keep printing new output until the run is no longer RUNNING")
    logs.add_argument("--storage-path", metavar="PATH", help="where to look for RUN by name")
    logs.add_argument("--kubernetes", action="store_true",
                      help="RUN is a run submitted to Kubernetes: its driver pod's output")
    _add_kubernetes_options(logs)
    logs.set_defaults(handler=cmd_logs)

    metrics = commands.add_parser(
        "metrics", help="rank 0's reported metrics, one row per report round",
        description="Prints rank 0's metrics per report round: a table (nested keys joined "
        "with '/', after jaxtrain's own columns jaxtrain/round and jaxtrain/time), CSV with "
        "--csv (unix times), or JSON Lines with --json (one "
        '{"round", "time", "metrics"} object per round, as in result.jsonl).',
        epilog="example:\n  jaxtrain metrics my_run --csv > my_run.csv\n\n" + _EXIT_CODES,
        formatter_class=formatter,
    )
    metrics.add_argument("run", metavar="RUN", help=run_help)
    form = metrics.add_mutually_exclusive_group()
    form.add_argument("--csv", action="store_true", help="CSV")
    form.add_argument("--json", action="store_true", help="JSON Lines")
    metrics.add_argument("--storage-path", metavar="PATH", help="where to look for RUN by name")
    metrics.set_defaults(handler=cmd_metrics)

    dashboard.add_parser(commands, formatter, _EXIT_CODES)
    parser.commands = commands.choices
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """The ``jaxtrain`` command; returns its exit status."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # --help, --version, or argparse's own usage errors (2)
        return e.code if isinstance(e.code, int) else EXIT_USAGE
    # A run's status is the command's, also when its output's reader has gone away.
    with outlive_readers() if args.command == "run" else contextlib.nullcontext():
        try:
            return args.handler(args)
        except UsageError as e:
            sys.stderr.write(f"jaxtrain {args.command}: error: {e}\n")
            return EXIT_USAGE
        except KeyboardInterrupt:
            return EXIT_INTERRUPTED
        except BrokenPipeError:
            # The reader of a command that only shows something went away (`jaxtrain logs RUN
            # | head`): stop quietly.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return EXIT_OK
