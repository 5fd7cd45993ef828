"""The tests' object stores (tests/s3_server.py, tests/gcs_server.py) are reached by the test hosts
over their network: a client in an ssh test host's network namespace writes and reads through
the bridge's address, as jaxtrain's workers on those hosts will."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import uuid
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ssh_fixtures import SshHosts

pytest_plugins = ["s3_server", "gcs_server", "ssh_fixtures"]

# Runs on the host: writes `data` to `url`, reads it back, lists its directory.
CLIENT = textwrap.dedent("""
    import sys
    import fsspec

    url, data = sys.argv[1], sys.argv[2].encode()
    fs, path = fsspec.core.url_to_fs(url)
    fs.pipe_file(path, data)
    fs.invalidate_cache()
    assert fs.cat_file(path) == data, fs.cat_file(path)
    print(type(fs).__name__, sorted(fs.ls(path.rsplit("/", 1)[0])))
""")


def test_a_test_host_reaches_both_stores_through_its_bridge(ssh_hosts: SshHosts, bucket,
                                                            s3_endpoint, gcs_bucket, gcs_endpoint):
    import fsspec
    from s3_server import BRIDGES, endpoint_on  # after pytest_plugins has loaded it

    bridge = BRIDGES["ssh"]
    # The host's own 127.0.0.1 has no server: only the bridge's address leads to this machine.
    env = {"PATH": "/usr/bin:/bin", "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_ENDPOINT_URL": endpoint_on(s3_endpoint, bridge),
           "STORAGE_EMULATOR_HOST": endpoint_on(gcs_endpoint, bridge), "FSSPEC_GS_TOKEN": "anon",
           "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}
    for url in [f"s3://{bucket}/from-host1/object", f"{gcs_bucket}/from-host1/object"]:
        data = uuid.uuid4().hex
        done = subprocess.run(["ip", "netns", "exec", ssh_hosts.namespace("host1"), sys.executable,
                               "-c", CLIENT, url, data], env=env, capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, done.stderr
        # The object is on this machine's server, where the host put it.
        fs, path = fsspec.core.url_to_fs(url)
        fs.invalidate_cache()
        assert fs.cat_file(path) == data.encode()
