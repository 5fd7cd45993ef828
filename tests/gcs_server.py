"""gs:// for the tests through a real GCS emulator: fake-gcs-server (in-memory, plain HTTP), built
from the Go module proxy by scripts/stores/fake-gcs-server.sh and started once per session on a
free port of every interface, as tests/s3_server.py starts the S3 server. A test host (a network
namespace) reaches it at `endpoint_on(gcs_endpoint, BRIDGES["ssh"])`.

For the session the environment points gcsfs at it: STORAGE_EMULATOR_HOST (gcsfs and Google's
clients read it), FSSPEC_GS_TOKEN=anon (no credentials: the emulator checks none, and gcsfs then
asks no metadata server), and GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false (gcsfs's default class asks
the Storage Control API over gRPC for each bucket's layout, which the emulator does not serve: a
minute's timeout per bucket). Child processes read them as they import fsspec and gcsfs; this
process, which may have imported them already, gets the same settings from fsspec's registry and
config.

Where the emulator cannot be built (no Go, no module proxy) or gcsfs is missing, the tests that
use it are skipped with the reason, unless JAXTRAIN_REQUIRE_GCS=1 (scripts/test.sh sets it):
then they fail instead."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import subprocess
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from s3_server import LISTEN, environ, free_port, server_process

REPO = Path(__file__).resolve().parent.parent
BUILD = REPO / "scripts" / "stores" / "fake-gcs-server.sh"


def _build() -> str:
    """The emulator's binary, built on first use; skips (or fails under JAXTRAIN_REQUIRE_GCS=1)
    with the reason where it cannot be had."""
    why = None
    if importlib.util.find_spec("gcsfs") is None:
        why = "gs:// tests need gcsfs (requirements-dev.txt)"
    else:
        built = subprocess.run([str(BUILD)], capture_output=True, text=True, timeout=3600)
        if built.returncode == 0:
            return built.stdout.strip()
        lines = built.stderr.strip().splitlines() or [f"exit status {built.returncode}"]
        why = f"the GCS emulator cannot be built: {lines[-1]}"
        if shutil.which("go") is not None:
            why += f" (see {BUILD.relative_to(REPO)})"
    if os.environ.get("JAXTRAIN_REQUIRE_GCS") == "1":
        pytest.fail(f"JAXTRAIN_REQUIRE_GCS=1, but {why}")
    pytest.skip(why)


@contextlib.contextmanager
def gcs_server(log_dir: Path, host: str = LISTEN) -> Iterator[str]:
    """fake-gcs-server on a free port of `host`; yields its URL as this machine reaches it."""
    binary = _build()
    port = free_port(host)
    local = "127.0.0.1" if host == "0.0.0.0" else host
    endpoint = f"http://{local}:{port}"
    # Resumable uploads continue at the URL the client used (the request's Host), so one server
    # serves clients on this machine and on the test hosts alike.
    argv = [binary, "-backend", "memory", "-scheme", "http", "-host", host, "-port", str(port),
            "-log-level", "warn"]
    with server_process(argv, f"{endpoint}/storage/v1/b", log_dir / "gcs-server.log",
                        "the GCS emulator"):
        yield endpoint


@contextlib.contextmanager
def _gcsfs_in_this_process() -> Iterator[None]:
    """What FSSPEC_GS_TOKEN and GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT do in a process that imports
    fsspec and gcsfs after they are set, done here, where both may be imported already."""
    import fsspec.config
    from fsspec.registry import _registry, register_implementation
    from gcsfs.core import GCSFileSystem

    protocols = ("gs", "gcs")
    classes = {p: _registry.get(p) for p in protocols}
    configs = {p: fsspec.config.conf.get(p) for p in protocols}
    for p in protocols:
        register_implementation(p, GCSFileSystem, clobber=True)
        fsspec.config.conf[p] = {**(configs[p] or {}), "token": "anon"}
    try:
        yield
    finally:
        for p in protocols:
            if classes[p] is None:
                _registry.pop(p, None)
            else:
                register_implementation(p, classes[p], clobber=True)
            if configs[p] is None:
                fsspec.config.conf.pop(p, None)
            else:
                fsspec.config.conf[p] = configs[p]


@pytest.fixture(scope="session")
def gcs_endpoint(tmp_path_factory):
    """The emulator's URL; the session's environment points gcsfs at it."""
    with gcs_server(tmp_path_factory.mktemp("gcs")) as endpoint, environ(
            STORAGE_EMULATOR_HOST=endpoint, FSSPEC_GS_TOKEN="anon",
            GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT="false"), _gcsfs_in_this_process():
        yield endpoint


def create_bucket(endpoint: str, name: str) -> None:
    request = urllib.request.Request(
        f"{endpoint}/storage/v1/b?project=test", data=json.dumps({"name": name}).encode(),
        headers={"Content-Type": "application/json"}, method="POST")
    urllib.request.urlopen(request, timeout=30).close()


@pytest.fixture
def gcs_bucket(gcs_endpoint) -> str:
    """A new, empty bucket for one test, as gs://<bucket>."""
    name = f"runs-{uuid.uuid4().hex[:12]}"
    create_bucket(gcs_endpoint, name)
    return f"gs://{name}"


@pytest.fixture(params=["s3", "gs"])
def store_bucket(request) -> str:
    """A new, empty bucket on each object store in turn: s3://<bucket>, then gs://<bucket> (a
    test that uses it needs both s3_server and gcs_server in its pytest_plugins)."""
    if request.param == "s3":
        return f"s3://{request.getfixturevalue('bucket')}"
    return request.getfixturevalue("gcs_bucket")
