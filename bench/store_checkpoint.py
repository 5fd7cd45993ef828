"""Benchmark: checkpoints straight to object storage from 4 ranks on 2 hosts, against fsspec
uploading and downloading the same files from the same hosts.

    flock /tmp/jaxtrain-clusters.lock .venv/bin/python bench/store_checkpoint.py [--mib 1024]

Needs root: the hosts are the ssh test hosts (scripts/ssh_hosts.sh: network namespaces with
sshd), started by the benchmark when they are not up and stopped again at its end. Run it under
``flock /tmp/jaxtrain-clusters.lock``, as the tests that use those hosts are. ``--local`` runs the
same with 4 ranks on this host instead (``JAXTRAIN_STORE_DIRECT=1``, no root): an additional mode,
not the issue's figure. ``--gcs`` runs everything against the GCS emulator (tests/gcs_server.py:
fake-gcs-server, in memory) with gcsfs, the floor included, instead of moto's S3 server.

The S3 server is moto's (tests/s3_server.py), on every interface of this machine; the hosts reach
it over their bridge (198.19.13.1). Before any run the driver writes one shard per rank
(``--mib`` / 4 MiB each, a 4 MiB random block repeated) into a directory every host sees and
fsyncs it, so that both sides upload the very same files from the page cache. Each repeat then
runs, in turn (ABAB... so that machine noise hits both), in a fresh bucket:

* jaxtrain, commit: ``JaxTrainer.fit()`` of 4 workers on host1 and host2 with ``storage_path`` on
  the bucket (nothing shared: each rank uploads its own files, checkpoint_store.py). Every rank
  waits at a barrier, notes ``time.time()`` and calls ``report(checkpoint=)`` of its shard
  ``--rounds`` times. Commit: the first rank's call to the moment the driver's upload of the
  checkpoint's manifest (the commit on the store) returned.
* floor, upload: one process per rank, 2 per host started over ssh, each uploading its rank's
  files with s3fs ``put_file`` on as many threads as a rank uses (8), all told to start at once;
  from the first one's start to the last one's end.
* jaxtrain, restore: a second ``fit()`` of the run resumes from its last checkpoint; every rank
  waits at a barrier and calls ``get_checkpoint().to_directory()`` (every file of the checkpoint,
  1 GiB per rank, checked against the manifest's size and CRC-32C), first rank's call to last
  rank's return; then each rank in turn, alone, reads only its own file through
  ``checkpoint.filesystem.open(checkpoint.path + '/' + name)``, and the bytes its host received
  meanwhile (``/proc/net/dev``: the host's interface; loopback with ``--local``) are printed per
  rank against the checkpoint's size.
* floor, download: the same processes download every file of that checkpoint with s3fs
  ``get_file`` on 8 threads each into a fresh local directory.

Training time blocked per checkpoint comes from the commit runs: the slowest rank's
``report(checkpoint=)`` call to its return, against a synchronous commit (its call to the notice
that the round's commit ended, which the next ``report(checkpoint=)`` would wait for), later
rounds (the first reads into fresh memory; printed apart); beside it the floor's slowest rank's
upload of the same files.

CPU seconds per GiB committed: the ranks' processes' CPU time (every thread) from each
``report(checkpoint=)`` call to the notice that its commit ended, against the floor processes'
CPU time for their uploads.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from checkpoint_commit import BLOCK_BYTES, sync_filesystem, write_sources
from startup_and_report import console_to, measure, spread

from jaxtrain import JaxTrainer, RunConfig, ScalingConfig, TrainingFailedError, storage

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
from gcs_server import _gcsfs_in_this_process, create_bucket, gcs_server  # noqa: E402
from s3_server import BRIDGES, endpoint_on, s3_server  # noqa: E402

TARGET_COMMIT = 1.1  # commit <= 1.1 x the parallel upload, first and later checkpoints alike
TARGET_BLOCKED = 0.05  # report(checkpoint=) blocks <= 0.05 x a synchronous commit (later ones)
TARGET_BLOCKED_FIRST = 0.1  # and <= 0.1 x for a worker's first checkpoint
TARGET_RESTORE = 1.0  # to_directory() <= 1.0 x the parallel download
WORKERS = 4
THREADS = 8  # checkpoint_store._UPLOADS, storage._DOWNLOADS
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
               "AWS_DEFAULT_REGION": "us-east-1"}
# gcsfs against the emulator (tests/gcs_server.py says why each is needed).
GCS_ENV = {"FSSPEC_GS_TOKEN": "anon", "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}
HOSTS_SCRIPT = REPO / "scripts" / "ssh_hosts.sh"
HOSTS_STATE = Path(os.environ.get("JAXTRAIN_SSH_TEST_STATE", "/var/tmp/jaxtrain-ssh"))

# One rank of the floor: waits for "go" on stdin, then moves its files with s3fs (gcsfs with
# --gcs) on THREADS threads and prints when it started and ended. argv: put|get, bucket, JSON
# [[local, remote]...] (get: local names inside a fresh temporary directory, deleted after),
# threads, the fsspec protocol.
FLOOR = """
import json, os, shutil, sys, tempfile, time
from concurrent.futures import ThreadPoolExecutor
import fsspec
mode, bucket, pairs, threads = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4])
fs = fsspec.filesystem(sys.argv[5])
fs.ls(bucket)  # connected, as a worker's client is by the time it checkpoints
target = tempfile.mkdtemp(prefix="floor-get-") if mode == "get" else None
def move(pair):
    local, remote = pair
    if mode == "put":
        fs.put_file(local, remote)
    else:
        fs.get_file(remote, os.path.join(target, local))
print("ready", flush=True)
sys.stdin.readline()
start, cpu = time.time(), time.process_time()
with ThreadPoolExecutor(threads) as pool:
    for done in [pool.submit(move, p) for p in pairs]:
        done.result()
end = time.time()
print(json.dumps({"start": start, "end": end, "cpu": time.process_time() - cpu}), flush=True)
if target:
    shutil.rmtree(target)
"""


@dataclass
class Figures:
    """One jaxtrain run pair (commit, restore) or one floor pair (upload, download)."""

    commit_s: float = 0.0  # first call -> manifest on the store; floor: first start -> last end
    controller_s: float = 0.0  # first call -> the controller's commit (result.jsonl "time")
    later_commit_s: float = 0.0  # the same, rounds 2.. (median)
    blocked_first_s: float = 0.0  # slowest rank's report() call -> return, round 1
    sync_first_s: float = 0.0  # slowest rank's call -> commit-ended notice, round 1
    blocked_s: float = 0.0  # the same two, rounds 2.. (median)
    sync_s: float = 0.0
    rank_upload_s: float = 0.0  # floor: the slowest rank's own upload
    restore_s: float = 0.0  # first to_directory() call -> last return; floor: get_file, all
    own_s: float = 0.0  # slowest rank's read of its own file through checkpoint.filesystem
    own_bytes: list[int] = field(default_factory=list)  # bytes its host received meanwhile
    checkpoint_bytes: int = 0
    # CPU seconds per GiB the ranks' processes spent: report(checkpoint=) call -> commit-ended
    # notice (first checkpoint; later ones, median); floor: its processes' upload.
    cpu_per_gib_first: float = 0.0
    cpu_per_gib: float = 0.0


class Hosts:
    """Where the ranks run: host1 and host2 over ssh, 2 ranks each, or this host (--local)."""

    def __init__(self, local: bool, endpoint: str, protocol: str) -> None:
        self.local = local
        self.protocol = protocol
        self.server = endpoint  # as this machine reaches it
        self.names = ["localhost"] if local else ["host1", "host2"]
        # The store's server as a process on a host reaches it.
        self.endpoint = endpoint if local else endpoint_on(endpoint, BRIDGES["ssh"])
        self.env = (dict(GCS_ENV, STORAGE_EMULATOR_HOST=self.endpoint) if protocol == "gs"
                    else dict(CREDENTIALS, AWS_ENDPOINT_URL=self.endpoint))

    def host_of(self, rank: int) -> str:
        return self.names[rank * len(self.names) // WORKERS]

    def command(self, rank: int, argv: list[str]) -> list[str]:
        """`argv` as run on the host of `rank`, with the store's environment."""
        env = [f"{k}={v}" for k, v in self.env.items()]
        if self.local:
            return ["env", *env, *argv]
        import shlex

        return ["ssh", "-F", str(HOSTS_STATE / "ssh_config"), "-o", "BatchMode=yes",
                self.host_of(rank), shlex.join(["env", *env, *argv])]


@contextlib.contextmanager
def ssh_hosts() -> Iterator[Path]:
    """The ssh test hosts, started when they are not up (and then stopped at the end); yields the
    directory every host sees."""
    if os.geteuid() != 0:
        sys.exit("the ssh test hosts need root (network namespaces, sshd); run as root under "
                 "flock /tmp/jaxtrain-clusters.lock, or use --local")
    up = subprocess.run([str(HOSTS_SCRIPT), "status"], capture_output=True).returncode == 0
    if not up:
        started = subprocess.run([str(HOSTS_SCRIPT), "start"], capture_output=True, text=True)
        if started.returncode != 0:
            sys.exit(f"scripts/ssh_hosts.sh start failed:\n{started.stdout}{started.stderr}")
    try:
        yield HOSTS_STATE / "shared"
    finally:
        if not up:
            subprocess.run([str(HOSTS_SCRIPT), "stop"], capture_output=True, check=False)


class StoreCommits:
    """When the driver's Mirror finished uploading each checkpoint's manifest: the commit on the
    store (storage.Mirror._upload_checkpoint returns after it)."""

    def __init__(self) -> None:
        self.times: dict[str, float] = {}

    def __enter__(self) -> StoreCommits:
        self._original = original = storage.Mirror._upload_checkpoint

        def upload(mirror: storage.Mirror, record: dict, progress: object) -> bool:
            done = original(mirror, record, progress)
            if done:
                self.times.setdefault(record["dir_name"], time.time())
            return done

        storage.Mirror._upload_checkpoint = upload
        return self

    def __exit__(self, *exc: object) -> None:
        storage.Mirror._upload_checkpoint = self._original


def received_bytes(interface: str | None) -> int:
    """Bytes received by this network namespace's interfaces (/proc/net/dev): `interface`, or
    every one but the loopback when None (a host's own traffic is on loopback)."""
    total = 0
    with open("/proc/net/dev") as f:
        for line in f.readlines()[2:]:
            name, counters = line.split(":", 1)
            name = name.strip()
            if name == interface or (interface is None and name != "lo"):
                total += int(counters.split()[0])
    return total


def train_func(config: dict) -> None:
    from jax.experimental import multihost_utils

    from jaxtrain import Checkpoint, get_checkpoint, get_context, report, session

    rank = get_context().get_world_rank()
    out = {}
    if config["restore"]:
        checkpoint = get_checkpoint()
        multihost_utils.sync_global_devices("restore")
        start = time.time()
        target = checkpoint.to_directory()
        out["restore"] = {"start": start, "end": time.time()}
        shutil.rmtree(target)
        # Then each rank alone (its host's counters see no other rank's traffic) reads only its
        # own file, straight from the store.
        for turn in range(get_context().get_world_size()):
            multihost_utils.sync_global_devices(f"own-{turn}")
            if turn == rank:
                received, start = received_bytes(config["interface"]), time.time()
                with checkpoint.filesystem.open(f"{checkpoint.path}/shard-{rank}.bin", "rb") as f:
                    while f.read(8 << 20):
                        pass
                out["own"] = {"seconds": time.time() - start,
                              "bytes": received_bytes(config["interface"]) - received}
    else:
        source = Checkpoint.from_directory(config["sources"][rank])
        out["rounds"] = []
        for round_ in range(config["rounds"]):
            multihost_utils.sync_global_devices(f"commit-{round_}")
            t_call, cpu_call = time.time(), time.process_time()
            report({"rank": rank}, checkpoint=source)
            t_staged = time.time()
            session.require("report").wait_checkpoints_settled()
            # The process's CPU time (every thread's: the stager's checksums and upload) while
            # the training thread waits for the commit.
            out["rounds"].append({"t_call": t_call, "t_staged": t_staged,
                                  "t_settled": time.time(),
                                  "cpu": time.process_time() - cpu_call})
    with open(os.path.join(config["out_dir"], f"rank{rank}.json"), "w") as f:
        json.dump(out, f)


def fit(hosts: Hosts, config: dict, url: str, name: str) -> list[dict]:
    out_dir = config["out_dir"]
    for rank in range(WORKERS):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(out_dir, f"rank{rank}.json"))
    try:
        with console_to(os.path.join(out_dir, "console.log")):
            JaxTrainer(
                train_func, train_loop_config=config,
                scaling_config=ScalingConfig(num_workers=WORKERS),
                run_config=RunConfig(name=name, storage_path=url,
                                     worker_runtime_env={"env_vars": hosts.env}),
            ).fit()
    except TrainingFailedError as e:
        sys.exit(f"jaxtrain fit() failed during the benchmark: {e} (log: {out_dir}/console.log)")
    by_rank = []
    for rank in range(WORKERS):
        with open(os.path.join(out_dir, f"rank{rank}.json")) as f:
            by_rank.append(json.load(f))
    return by_rank


def run_jaxtrain(hosts: Hosts, fs: object, sources: list[str], rounds: int,
                 out_dir: str) -> Figures:
    bucket = new_bucket(fs, hosts)
    # A name no other run on this machine has: the hosts' staging directories are named by the
    # run's name (checkpoint_store.Store.staging), and this machine's /tmp is every host's.
    name = f"bench-{uuid.uuid4().hex[:8]}"
    url, root = f"{hosts.protocol}://{bucket}/runs", f"{bucket}/runs/{name}"
    config = {"sources": sources, "out_dir": out_dir, "rounds": rounds, "restore": False,
              "interface": "lo" if hosts.local else None}
    try:
        with StoreCommits() as commits:
            by_rank = fit(hosts, config, url, name)
        results = [json.loads(line) for line in fs.cat_file(f"{root}/result.jsonl").splitlines()]
        names = [r["checkpoint"] for r in results]
        manifest = json.loads(fs.cat_file(f"{root}/{names[-1]}/{storage.MANIFEST_NAME}"))

        def slowest(i: int, start: str, end: str) -> float:
            return max(r["rounds"][i][end] - r["rounds"][i][start] for r in by_rank)

        def first_call(i: int) -> float:
            return min(r["rounds"][i]["t_call"] for r in by_rank)

        later = range(1, rounds)
        gib = manifest["bytes"] / (1 << 30)

        def cpu_per_gib(i: int) -> float:
            return sum(r["rounds"][i]["cpu"] for r in by_rank) / gib

        figures = Figures(
            commit_s=commits.times[names[0]] - first_call(0),
            controller_s=results[0]["time"] - first_call(0),
            later_commit_s=statistics.median(commits.times[names[i]] - first_call(i)
                                             for i in later),
            blocked_first_s=slowest(0, "t_call", "t_staged"),
            sync_first_s=slowest(0, "t_call", "t_settled"),
            blocked_s=statistics.median(slowest(i, "t_call", "t_staged") for i in later),
            sync_s=statistics.median(slowest(i, "t_call", "t_settled") for i in later),
            checkpoint_bytes=manifest["bytes"],
            cpu_per_gib_first=cpu_per_gib(0),
            cpu_per_gib=statistics.median(cpu_per_gib(i) for i in later),
        )
        by_rank = fit(hosts, dict(config, restore=True), url, name)  # resumes from the last one
        figures.restore_s = (max(r["restore"]["end"] for r in by_rank)
                             - min(r["restore"]["start"] for r in by_rank))
        figures.own_s = max(r["own"]["seconds"] for r in by_rank)
        figures.own_bytes = [r["own"]["bytes"] for r in by_rank]
        shutil.rmtree(storage.staging_dir(fs, root), ignore_errors=True)
    finally:
        drop_bucket(fs, bucket)
    sync_filesystem(out_dir)
    return figures


def run_floor(hosts: Hosts, fs: object, sources: list[str], out_dir: str) -> Figures:
    bucket = new_bucket(fs, hosts)
    try:
        files = [[os.path.join(d, name) for name in sorted(os.listdir(d))] for d in sources]
        puts = [[[f, f"{bucket}/floor/{os.path.basename(f)}"] for f in rank_files]
                for rank_files in files]
        ranks = run_floor_ranks(hosts, "put", bucket, puts, out_dir)
        gib = sum(os.path.getsize(f) for rank_files in files for f in rank_files) / (1 << 30)
        cpu = sum(r["cpu"] for r in ranks) / gib
        figures = Figures(commit_s=max(r["end"] for r in ranks) - min(r["start"] for r in ranks),
                          rank_upload_s=max(r["end"] - r["start"] for r in ranks),
                          cpu_per_gib_first=cpu, cpu_per_gib=cpu)
        every = [[os.path.basename(f), remote] for rank_puts in puts for f, remote in rank_puts]
        ranks = run_floor_ranks(hosts, "get", bucket, [every] * WORKERS, out_dir)
        figures.restore_s = max(r["end"] for r in ranks) - min(r["start"] for r in ranks)
    finally:
        drop_bucket(fs, bucket)
    sync_filesystem(out_dir)
    return figures


def run_floor_ranks(hosts: Hosts, mode: str, bucket: str, pairs: list[list[list[str]]],
                    out_dir: str) -> list[dict]:
    """One floor process per rank on its host, told to go together once all are ready."""
    script = os.path.join(out_dir, "floor.py")
    Path(script).write_text(FLOOR)
    procs = [subprocess.Popen(
        hosts.command(rank, [sys.executable, script, mode, bucket, json.dumps(pairs[rank]),
                             str(THREADS), hosts.protocol]),
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for rank in range(WORKERS)]
    for p in procs:
        if p.stdout.readline().strip() != "ready":
            sys.exit(f"a floor process ({mode}) did not start")
    for p in procs:
        p.stdin.write("go\n")
        p.stdin.flush()
    ranks = [json.loads(p.communicate()[0].splitlines()[0]) for p in procs]
    if any(p.returncode for p in procs):
        sys.exit(f"a floor process ({mode}) failed")
    return ranks


def new_bucket(fs: object, hosts: Hosts) -> str:
    bucket = f"bench-{uuid.uuid4().hex[:12]}"
    if hosts.protocol == "gs":
        create_bucket(hosts.server, bucket)
    else:
        fs.mkdir(bucket)
    return bucket


def drop_bucket(fs: object, bucket: str) -> None:
    """Deletes the bucket and everything in it (moto keeps objects in memory and on its temp)."""
    fs.invalidate_cache()
    with contextlib.suppress(FileNotFoundError):
        fs.rm(bucket, recursive=True)


def main() -> None:
    os.environ.setdefault("JAXTRAIN_WARM_WORKERS", "0")  # no standbys importing jax meanwhile
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0],
        epilog="Needs root (the ssh test hosts are network namespaces with sshd): run it as "
        "`flock /tmp/jaxtrain-clusters.lock .venv/bin/python bench/store_checkpoint.py`. "
        "--local needs neither.")
    parser.add_argument("--mib", type=int, default=1024,
                        help="MiB checkpointed by the 4 ranks together (default 1024; a multiple "
                        "of 16)")
    parser.add_argument("--repeats", type=int, default=2,
                        help="measured jaxtrain/floor pairs (default 2)")
    parser.add_argument("--warmup", type=int, default=0,
                        help="unmeasured pairs run first (default 0)")
    parser.add_argument("--rounds", type=int, default=2,
                        help="checkpoints of the same files per run, at least 2 (default 2)")
    parser.add_argument("--gcs", action="store_true",
                        help="against the GCS emulator (tests/gcs_server.py, gcsfs) instead of "
                        "moto's S3 server")
    parser.add_argument("--local", action="store_true",
                        help="4 ranks on this host (JAXTRAIN_STORE_DIRECT=1) instead of 2 per "
                        "host on host1 and host2; no root needed")
    args = parser.parse_args()
    if min(args.mib, args.repeats) < 1 or args.warmup < 0 or args.rounds < 2:
        parser.error("--mib and --repeats must be >= 1, --warmup >= 0, --rounds >= 2")
    shard_bytes = (args.mib << 20) // WORKERS
    if shard_bytes % BLOCK_BYTES or shard_bytes == 0:
        parser.error(f"--mib must be a multiple of {WORKERS * BLOCK_BYTES >> 20}")

    results: dict[str, list[Figures]] = {"jaxtrain": [], "floor": []}
    others: list[float] = []
    with contextlib.ExitStack() as stack:
        if args.local:
            os.environ["JAXTRAIN_STORE_DIRECT"] = "1"
            shared = Path(tempfile.gettempdir())
        else:
            shared = stack.enter_context(ssh_hosts())
            os.environ.update(JAXTRAIN_SSH_COMMAND=f"ssh -F {HOSTS_STATE / 'ssh_config'}",
                              JAXTRAIN_SSH_HOSTS="host1,host2", JAXTRAIN_SHARED_STORAGE="")
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-store-",
                                                              dir=shared))
        if args.gcs:
            endpoint = stack.enter_context(gcs_server(Path(tmp)))
            os.environ.update(GCS_ENV, STORAGE_EMULATOR_HOST=endpoint)
            stack.enter_context(_gcsfs_in_this_process())
            import gcsfs

            fs = gcsfs.GCSFileSystem(token="anon")
        else:
            endpoint = stack.enter_context(s3_server(Path(tmp)))
            os.environ.update(CREDENTIALS, AWS_ENDPOINT_URL=endpoint)
            import s3fs

            fs = s3fs.S3FileSystem()
        hosts = Hosts(args.local, endpoint, "gs" if args.gcs else "s3")
        sources = write_sources(os.path.join(tmp, "src"), WORKERS, shard_bytes)
        runners = {
            "jaxtrain": functools.partial(run_jaxtrain, hosts, fs, sources, args.rounds),
            "floor": functools.partial(run_floor, hosts, fs, sources),
        }
        for i in range(args.warmup + args.repeats):
            warm = i < args.warmup
            label = (f"warm-up {i + 1}/{args.warmup}" if warm
                     else f"repeat {i - args.warmup + 1}/{args.repeats}")
            line = []
            for name, runner in runners.items():
                out_dir = tempfile.mkdtemp(prefix=f"{name}-{i}-", dir=tmp)
                figures, other = measure(functools.partial(runner, out_dir))
                if not warm:
                    results[name].append(figures)
                    others.append(other)
                line.append(f"{name} commit {figures.commit_s:.2f} s, restore "
                            f"{figures.restore_s:.2f} s, others busy {other:.1f} cores")
            print(f"{label}: " + "; ".join(line), flush=True)
    report(args, results, others)


def ratio_rows(rows: list[tuple[str, list[float], list[float]]], base_title: str) -> None:
    print(f"{'figure':<36}{'value':<24}{base_title:<24}value/baseline")
    for title, values, base in rows:
        ratios = [a / b for a, b in zip(values, base, strict=True)]
        print(f"{title:<36}{spread(values, 's'):<24}{spread(base, 's'):<24}"
              f"{spread(ratios, 'x', digits=3)}")


def verdict(values: list[float], base: list[float], target: float, what: str) -> None:
    ratio = statistics.median(a / b for a, b in zip(values, base, strict=True))
    print(f"target {what} <= {target} x: {'met' if ratio <= target else 'NOT met'} "
          f"(median {ratio:.3f} x)")


def report(args: argparse.Namespace, results: dict[str, list[Figures]],
           others: list[float]) -> None:
    jt, floor = results["jaxtrain"], results["floor"]
    where = "4 ranks on this host (--local)" if args.local else "4 ranks on 2 hosts (host1, host2)"
    print(f"\n{where}, {args.mib} MiB in all ({args.mib // WORKERS} MiB per rank, one file each), "
          f"{'the GCS emulator' if args.gcs else 'moto S3 server'} on this machine, "
          f"{args.repeats} repeats; median [min-max]")
    print(f"other processes kept {spread(others, 'cores')} of {os.cpu_count()} busy during the "
          "runs (the store's server, the hosts and the floor's processes count as others)")
    print("\ncommit: first rank's report(checkpoint=) call -> the checkpoint's manifest uploaded "
          "by the driver (the commit on the store)\nfloor: the same files put_file'd from the "
          f"same hosts, one process per rank, {THREADS} threads each, all at once")
    commit = [f.commit_s for f in jt]
    floor_put = [f.commit_s for f in floor]
    verdict(commit, floor_put, TARGET_COMMIT, "commit")
    verdict([f.later_commit_s for f in jt], floor_put, TARGET_COMMIT, "commit (later checkpoints)")
    ratio_rows([("commit, first checkpoint", commit, floor_put),
                ("  of which the controller's commit", [f.controller_s for f in jt], floor_put),
                ("commit, later checkpoints", [f.later_commit_s for f in jt], floor_put)],
               "floor (put_file)")
    print("CPU seconds per GiB committed (the ranks' processes, report(checkpoint=) call -> "
          "commit ended; floor: its processes' uploads): first checkpoint "
          f"{spread([f.cpu_per_gib_first for f in jt], 's')}, later "
          f"{spread([f.cpu_per_gib for f in jt], 's')}, floor "
          f"{spread([f.cpu_per_gib for f in floor], 's')}")

    print("\ntraining blocked: the slowest rank's report(checkpoint=) call -> return; baseline: "
          "a synchronous commit, its call -> the notice that the commit ended")
    blocked, sync = [f.blocked_s for f in jt], [f.sync_s for f in jt]
    verdict(blocked, sync, TARGET_BLOCKED, "blocked (later checkpoints)")
    verdict([f.blocked_first_s for f in jt], [f.sync_first_s for f in jt], TARGET_BLOCKED_FIRST,
            "blocked (first checkpoint)")
    ratio_rows([("blocked, later checkpoints", blocked, sync),
                ("blocked, first checkpoint", [f.blocked_first_s for f in jt],
                 [f.sync_first_s for f in jt]),
                ("blocked, later, vs floor's upload", blocked,
                 [f.rank_upload_s for f in floor])],
               "baseline")

    print("\nrestore: a second fit() of the run; every rank's get_checkpoint().to_directory() "
          "(all files), first call -> last return\nfloor: get_file of every file of the "
          f"checkpoint, one process per rank, {THREADS} threads each, all at once")
    restore, floor_get = [f.restore_s for f in jt], [f.restore_s for f in floor]
    verdict(restore, floor_get, TARGET_RESTORE, "restore")
    ratio_rows([("restore, to_directory()", restore, floor_get)], "floor (get_file)")

    total, own = jt[-1].checkpoint_bytes, jt[-1].own_bytes
    counted = "loopback" if args.local else "its host's network interface"
    print(f"\na rank that reads only its own file (checkpoint.filesystem.open, ranks in turn): "
          f"bytes received ({counted}, /proc/net/dev), last repeat; the checkpoint has "
          f"{total / (1 << 20):.1f} MiB, each rank's file {total / WORKERS / (1 << 20):.1f} MiB")
    for rank, received in enumerate(own):
        print(f"  rank {rank}: {received / (1 << 20):.1f} MiB, {received / total:.3f} of the "
              "checkpoint")
    print(f"  slowest rank's read: {spread([f.own_s for f in jt], 's')}")


if __name__ == "__main__":
    main()
