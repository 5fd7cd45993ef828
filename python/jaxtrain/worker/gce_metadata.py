"""Preemption notices from the GCE metadata server, on GCE VMs and TPU VMs (docs/preemption.md).

On each host the worker of local rank 0 long-polls two keys of its VM's metadata, as Google
documents (``?wait_for_change=true``, header ``Metadata-Flavor: Google``):

* ``instance/preempted``: ``TRUE`` once the VM is being preempted (a spot or preemptible VM is
  stopped about 30 s later);
* ``instance/maintenance-event``: ``NONE``, or the host maintenance about to happen, about 60 s
  ahead: ``TERMINATE_ON_HOST_MAINTENANCE`` (the VM stops: every GPU and TPU VM) is a notice,
  ``MIGRATE_ON_HOST_MAINTENANCE`` (a live migration: the VM and its processes keep running) is
  not.

A notice goes to the controller as one from this host (``WorkerClient.send_preemption_notice``);
from there on it is a notice as a SIGTERM's is. The watcher runs only where the metadata server
is: on a GCE VM (its DMI product name starts with "Google", as google-auth checks), or where
``GCE_METADATA_HOST`` names a server (google-auth's variable, for tests and emulators).
``JAXTRAIN_GCE_METADATA=0`` turns it off, ``=1`` on. Requests never go through an HTTP proxy
(http.client reads no proxy variables). The watcher never fails a run: one that cannot reach the
server says so once in the rank's log and stops.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Mapping

ENV = "JAXTRAIN_GCE_METADATA"
# google-auth's variables for where the metadata server is (GCE_METADATA_ROOT is the old name).
HOST_ENVS = ("GCE_METADATA_HOST", "GCE_METADATA_ROOT")
DEFAULT_HOST = "metadata.google.internal"
PRODUCT_NAME_FILE = "/sys/class/dmi/id/product_name"
PATH = "/computeMetadata/v1/instance/"
KEYS = ("preempted", "maintenance-event")

# How long after a notice the VM goes, by Google's documentation: a preempted VM gets about 30 s,
# a maintenance event is announced 60 s ahead. The controller takes the earlier of this and
# FailureConfig.preemption_grace_s.
NOTICE_S = {"preempted": 30.0, "maintenance-event": 60.0}
# How long one long poll may wait on the server (its timeout_sec), and on the socket beyond it.
POLL_S = 300
SOCKET_SLACK_S = 30.0
# Failures in a row (connection refused or reset, timeout, HTTP 5xx) before the watcher gives up:
# the pause before each next try doubles from RETRY_S.
TRIES = 4
RETRY_S = 0.5


def setting(environ: Mapping[str, str] = os.environ) -> str:
    """JAXTRAIN_GCE_METADATA: "0" (off), "1" (on), or "" (unset: on where the metadata server
    is). Raises ValueError naming the variable, its value and what is allowed."""
    value = environ.get(ENV, "")
    if value not in ("", "0", "1"):
        raise ValueError(
            f"{ENV}={value!r} is not allowed; use 1 (watch the GCE metadata server for preemption "
            "and maintenance notices), 0 (do not), or leave it unset (watch it on GCE VMs, and "
            "where GCE_METADATA_HOST names a metadata server)")
    return value


def metadata_host(environ: Mapping[str, str] = os.environ,
                  product_name_file: str = PRODUCT_NAME_FILE) -> str | None:
    """The metadata server this host's watcher asks (host or host:port), or None when there is
    to be no watcher: JAXTRAIN_GCE_METADATA=0, or unset and this is not a GCE VM and no
    GCE_METADATA_HOST is set."""
    forced = setting(environ)
    if forced == "0":
        return None
    named = next((environ[name] for name in HOST_ENVS if environ.get(name)), None)
    if named:
        return named
    if forced == "1" or _is_gce_vm(product_name_file):
        return DEFAULT_HOST
    return None


def _is_gce_vm(product_name_file: str) -> bool:
    try:
        with open(product_name_file, encoding="utf-8", errors="replace") as f:
            return f.read().strip().startswith("Google")
    except OSError:
        return False


def notice_source(key: str, value: str) -> str | None:
    """What a value of `key` announces, as the notice's source, or None when it is no notice."""
    value = value.strip()
    if key == "preempted":
        return "GCE metadata: preempted" if value.upper() == "TRUE" else None
    if value.upper() in ("", "NONE") or value.upper().startswith("MIGRATE"):
        return None
    return f"GCE metadata: maintenance-event {value}"


class Unreachable(Exception):
    """The server cannot be asked (again): the watcher stops."""


class Watcher:
    """Long-polls KEYS on the metadata server at `host`, one daemon thread per key, and calls
    ``notify(source, deadline_ms)`` once per key whose value becomes a notice (at once when it
    already is one). ``log`` gets the lines for the rank's log. stop() ends the notices (the
    threads end with the process)."""

    def __init__(self, host: str, notify: Callable[[str, int], None],
                 log: Callable[[str], None]) -> None:
        self.host = host
        self._notify = notify
        self._log = log
        self._stopped = threading.Event()
        self._said_unreachable = threading.Lock()  # taken by the first thread that says so
        self.threads = [threading.Thread(target=self._watch, args=(key,), daemon=True,
                                         name=f"jaxtrain-gce-metadata-{key}") for key in KEYS]

    def start(self) -> Watcher:
        self._log(f"watching the GCE metadata server at {self.host} for preemption and "
                  "maintenance notices")
        for t in self.threads:
            t.start()
        return self

    def stop(self) -> None:
        self._stopped.set()

    def _watch(self, key: str) -> None:
        etag = None  # None: the first request, answered at once
        try:
            while not self._stopped.is_set():
                value, etag = self._get(key, etag)
                source = notice_source(key, value)
                if source is None:
                    continue
                if not self._stopped.is_set():
                    self._log(f"the GCE metadata server says {key} = {value.strip()}: a "
                              "preemption notice for this host")
                    self._notify(source, int((time.time() + NOTICE_S[key]) * 1000))
                return
        except Unreachable as e:
            if not self._stopped.is_set() and self._said_unreachable.acquire(blocking=False):
                self._log(f"the GCE metadata server at {self.host} cannot be asked ({e}); no "
                          "preemption notices from it in this attempt")
        except Exception as e:  # the controller gone, or anything else: never the run's failure
            if not self._stopped.is_set():
                self._log(f"the GCE metadata watcher of {key} stopped: {type(e).__name__}: {e}")

    def _get(self, key: str, etag: str | None) -> tuple[str, str]:
        """The value of `key` and its ETag: at once when `etag` is None, else once the value
        differs from the one `etag` names (or after POLL_S, unchanged). Retries what may pass,
        TRIES times in a row; raises Unreachable for the rest."""
        query = ""
        if etag is not None:
            query = f"?wait_for_change=true&timeout_sec={POLL_S}"
            query += f"&last_etag={etag}" if etag else ""
        import http.client  # here: only a watcher on a GCE VM loads it

        tries = 0
        while True:
            tries += 1
            conn = http.client.HTTPConnection(self.host, timeout=POLL_S + SOCKET_SLACK_S)
            try:
                conn.request("GET", PATH + key + query, headers={"Metadata-Flavor": "Google"})
                response = conn.getresponse()
                body = response.read().decode("utf-8", errors="replace")
                if response.status == 200:
                    if response.getheader("Metadata-Flavor") != "Google":
                        raise Unreachable(f"{PATH}{key} was answered without the header "
                                          "Metadata-Flavor: Google: not a metadata server")
                    return body, response.getheader("ETag") or ""
                error = f"HTTP {response.status} for {PATH}{key}"
                if response.status < 500:
                    raise Unreachable(error)
            except (OSError, http.client.HTTPException) as e:
                error = f"{type(e).__name__}: {e}"
            finally:
                conn.close()
            if tries == TRIES or self._stopped.wait(retry_delay(tries)):
                raise Unreachable(error)


def retry_delay(tries: int) -> float:
    """The pause after the `tries`-th failure in a row: RETRY_S, doubling."""
    return RETRY_S * 2 ** (tries - 1)


def start(rank: int, notify: Callable[[str, int], None],
          environ: Mapping[str, str] = os.environ) -> Watcher | None:
    """This host's watcher, started, or None where there is none (see metadata_host())."""
    host = metadata_host(environ)
    if host is None:
        return None

    def log(line: str) -> None:
        sys.stderr.write(f"jaxtrain worker: rank {rank}: {line}\n")
        sys.stderr.flush()

    return Watcher(host, notify, log).start()
