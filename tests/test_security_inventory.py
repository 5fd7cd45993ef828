"""Every socket a run listens on and every path it makes under shared locations is in
docs/security.md: a run on the local launcher with the metrics endpoint, checkpoints in host
memory and a dashboard beside it; while it runs, the listening sockets of its processes and the
files under its $TMPDIR and memory directory are listed, and each must match a row of the
document's tables (parsed from the page). A new socket or path without a row fails here."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

from conftest import end_session, finish_driver, start_driver, wait_for

DOC = Path(__file__).resolve().parent.parent / "docs" / "security.md"

_DRIVER = """
    import os, sys, time
    from pathlib import Path
    from jaxtrain import Checkpoint, JaxTrainer, RunConfig, ScalingConfig, report

    STORAGE, METRICS_PORT, SPOT = sys.argv[1], int(sys.argv[2]), sys.argv[3]


    def train(config):
        import tempfile
        from jaxtrain import get_context

        step = 0
        while not Path(config["spot"], "release").exists() and step < 4000:
            with tempfile.TemporaryDirectory(dir=config["ckpt"]) as d:
                Path(d, f"w{get_context().get_world_rank()}").write_text(str(step))
                report({"step": step}, checkpoint=Checkpoint.from_directory(d))
            if step == 2:
                Path(config["spot"], f"up-{get_context().get_world_rank()}").write_text(
                    str(os.getpid()))
            step += 1
            time.sleep(0.05)


    JaxTrainer(train, train_loop_config={"spot": SPOT, "ckpt": os.path.join(SPOT, "ckpt")},
               scaling_config=ScalingConfig(num_workers=2),
               run_config=RunConfig(name="inventory", storage_path=STORAGE,
                                    metrics_port=METRICS_PORT)).fit()
"""


def _table(heading: str) -> list[str]:
    """The first cells of the table under `heading` in docs/security.md."""
    text = DOC.read_text()
    section = text.split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ")]
    return [row.split("|")[1].strip() for row in rows[1:]]  # the header row left out


def _path_rules(tmp: Path, shm: Path) -> list[tuple[str, re.Pattern]]:
    rules = []
    for cell in _table("Paths under shared locations"):
        for pattern in re.findall(r"`([^`]+)`", cell):
            rx = re.escape(pattern)
            rx = rx.replace(re.escape("<tmp>"), re.escape(str(tmp)))
            rx = rx.replace(re.escape("<shm>"), re.escape(str(shm)))
            rx = re.sub(r"\\<[a-z0-9]+\\>|<[a-z0-9]+>", "[^/]+", rx, flags=re.IGNORECASE)
            rx = rx.replace(r"\*", "[^/]*").rstrip("/")
            rules.append((pattern, re.compile(rx + "(/.*)?$")))
    return rules


def _listening_inodes() -> dict[int, str]:
    """inode -> 'tcp PORT' or 'unix PATH' of every listening socket of this host's namespace."""
    found = {}
    for name in ("tcp", "tcp6"):
        with open(f"/proc/net/{name}") as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A":  # LISTEN
                    found[int(fields[9])] = f"tcp {int(fields[1].rsplit(':', 1)[1], 16)}"
    with open("/proc/net/unix") as f:
        for line in f.readlines()[1:]:
            fields = line.split()
            if fields[5] == "01" and fields[3] == "00010000":  # listening stream sockets
                found[int(fields[6])] = f"unix {fields[7] if len(fields) > 7 else ''}"
    return found


def _sockets_of(pid: int, listening: dict[int, str]) -> set[str]:
    out = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if m := re.fullmatch(r"socket:\[(\d+)\]", target):
            if int(m.group(1)) in listening:
                out.add(listening[int(m.group(1))])
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_every_socket_and_shared_path_of_a_run_is_in_the_security_tables(tmp_path):
    tmp, shm, spot, storage = (tmp_path / n for n in ("tmp", "shm", "spot", "runs"))
    for d in (tmp, shm, spot, storage, spot / "ckpt"):
        d.mkdir()
    tmp.chmod(0o1777)
    shm.chmod(0o1777)
    env = {**os.environ, "TMPDIR": str(tmp), "JAXTRAIN_MEMORY_DIR": str(shm),
           "JAXTRAIN_CHECKPOINT_IN_MEMORY": "1"}
    metrics_port = _free_port()
    script = tmp_path / "driver.py"
    script.write_text(textwrap.dedent(_DRIVER))
    run = start_driver([sys.executable, str(script), str(storage), str(metrics_port), str(spot)],
                       cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True)
    dashboard = start_driver([sys.executable, "-m", "jaxtrain", "dashboard", str(storage),
                              "--port", "0"], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        url = dashboard.stdout.readline()
        assert url.startswith("jaxtrain dashboard: http://"), url
        dashboard_port = int(url.split(":")[3].split("/")[0])
        wait_for("both ranks to be checkpointing",
                 lambda: all((spot / f"up-{r}").exists() for r in (0, 1)), 180)
        ranks = {r: int((spot / f"up-{r}").read_text()) for r in (0, 1)}
        listening = _listening_inodes()
        servers = set(_table("The ports"))
        found = {
            "driver": _sockets_of(run.pid, listening),
            "dashboard": _sockets_of(dashboard.pid, listening),
            **{f"rank {r}": _sockets_of(pid, listening) for r, pid in ranks.items()},
        }
        # Each socket by who listens, named as the ports table names it.
        named = []
        for who, sockets in found.items():
            for s in sockets:
                if who == "dashboard" and s == f"tcp {dashboard_port}":
                    named.append((who, s, "dashboard"))
                elif who == "driver" and s == f"tcp {metrics_port}":
                    named.append((who, s, "metrics"))
                elif who == "driver" and s.startswith("tcp"):
                    named.append((who, s, "control port"))
                elif who == "rank 0" and s.startswith("tcp"):
                    named.append((who, s, "JAX coordinator"))
                elif who == "driver" and s.startswith("unix @jaxtrain-run-"):
                    named.append((who, s, "live-run socket"))
                else:
                    named.append((who, s, None))
        rows = {name: next((row for row in servers if row.startswith(name)), None)
                for _, _, name in named if name}
        assert all(rows.values()), (named, servers)
        unknown = [(who, s) for who, s, name in named if name is None]
        assert not unknown, f"listening sockets with no row in docs/security.md: {unknown}"
        assert {n for _, _, n in named} >= {"dashboard", "metrics", "control port"}
        # Every path under the shared locations, by the paths table.
        rules = _path_rules(tmp, shm)
        paths = [p for root in (tmp, shm) for p in root.rglob("*")]
        assert any(str(p).startswith(str(shm)) for p in paths), "no copy in host memory"
        missing = [str(p) for p in paths if not any(rx.match(str(p)) for _, rx in rules)]
        assert not missing, f"paths with no row in docs/security.md: {missing}"
    finally:
        (spot / "release").write_text("")
        end_session(dashboard)
    done = finish_driver(run, timeout=180)
    assert done.returncode == 0, done.stdout[-3000:]
