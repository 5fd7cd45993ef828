"""A real S3-protocol server for the tests: moto's standalone server, started once per session on
a free port of every interface (0.0.0.0), with the AWS_* environment pointing every S3 client
(s3fs, pyarrow, boto3) of this machine at it through 127.0.0.1.

The test hosts are network namespaces (scripts/lib/netns.sh): their 127.0.0.1 is their own, so a
host reaches the server through its bridge's address, `endpoint_on(s3_endpoint, BRIDGES["ssh"])`.
tests/gcs_server.py does the same for gs:// and uses the helpers below."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

# Where a test host finds this machine: the address of its bridge in the root namespace
# (scripts/ssh_hosts.sh and scripts/slurm_cluster.sh set these).
BRIDGES = {"ssh": "198.19.13.1", "slurm": "198.18.0.1"}

# The interface the servers listen on: every one, so that the test hosts reach them through their
# bridges (which may be made after the server starts). JAXTRAIN_TEST_STORES_HOST narrows it.
LISTEN = os.environ.get("JAXTRAIN_TEST_STORES_HOST", "0.0.0.0")


def endpoint_on(endpoint: str, address: str) -> str:
    """`endpoint` (http://127.0.0.1:PORT) as a client at `address`'s side must name it, e.g.
    endpoint_on(s3_endpoint, BRIDGES["ssh"]) for a process on an ssh test host."""
    parts = urllib.parse.urlsplit(endpoint)
    return parts._replace(netloc=f"{address}:{parts.port}").geturl()


def free_port(host: str = LISTEN) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def server_process(argv: list[str], url: str, log: Path, what: str) -> Iterator[None]:
    """Runs `argv` (its output in `log`) until the block ends; the block starts once `url`
    answers HTTP, with any status."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(url, timeout=1).close()
                break
            except urllib.error.HTTPError:
                break  # it answers
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"{what} did not start ({' '.join(argv)}): {log.read_text()}")
                time.sleep(0.1)
        yield
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def environ(**values: str) -> Iterator[None]:
    """Sets `values` in os.environ for the block, then restores what was there."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def s3_server(log_dir: Path, host: str = LISTEN) -> Iterator[str]:
    """moto's server on a free port of `host`; yields its URL as this machine reaches it."""
    port = free_port(host)
    local = "127.0.0.1" if host == "0.0.0.0" else host
    endpoint = f"http://{local}:{port}"
    with server_process([sys.executable, "-m", "moto.server", "-H", host, "-p", str(port)],
                        endpoint, log_dir / "s3-server.log", "the S3 server"):
        yield endpoint


@pytest.fixture(scope="session")
def s3_endpoint(tmp_path_factory):
    """The server's URL; the session's environment has credentials and AWS_ENDPOINT_URL for it."""
    with s3_server(tmp_path_factory.mktemp("s3")) as endpoint, environ(
            AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
            AWS_DEFAULT_REGION="us-east-1", AWS_ENDPOINT_URL=endpoint):
        yield endpoint


@pytest.fixture
def bucket(s3_endpoint) -> str:
    """A new, empty bucket for one test."""
    import boto3

    name = f"runs-{uuid.uuid4().hex[:12]}"
    boto3.client("s3").create_bucket(Bucket=name)
    return name
