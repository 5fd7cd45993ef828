"""The Kubernetes supervisor of one attempt: ``python -m jaxtrain.kubernetes supervise REQUEST``,
started by the C++ Kubernetes launcher (src/launch/kubernetes_launcher.h). It creates the attempt's
Secret and JobSet, watches its pods, streams their logs as ``<rank>: `` lines, says how each rank
ended, and deletes the JobSet — waiting until its pods are gone — when a pod fails, when all have
succeeded, or when it is told to stop (SIGTERM: with the pods' grace period; SIGUSR1: at once). It
dies with the driver. docs/kubernetes.md has the user's view.
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import sys
import threading
import time
from typing import Any

from jaxtrain.kubernetes import pod as holder
from jaxtrain.kubernetes.api import (
    COMPLETION_INDEX,
    DEFAULT_PENDING_TIMEOUT_S,
    IMAGE_ERRORS,
    JOB_INDEX_LABEL,
    JOBSET_GROUP,
    JOBSET_PLURAL,
    JOBSET_VERSION,
    KUEUE_GROUP,
    KUEUE_VERSION,
    Api,
    error_reason,
)

_JOBSET_NAME_LABEL = "jobset.sigs.k8s.io/jobset-name"
_TEARDOWN_TIMEOUT_S = 60.0
# Where, in the launcher's request directory, an attempt's supervisor leaves the JobSet it kept
# for the next attempt (restarts in place; src/launch/kubernetes_launcher.h deletes it at the end).
KEPT_FILE = "kept.json"
# How long the supervisor waits for one exec into a pod (the holder answers at once).
_EXEC_TIMEOUT_S = 30.0
_KUEUE_JOB_UID_LABEL = "kueue.x-k8s.io/job-uid"
# How often the supervisor of a queued JobSet asks whether Kueue admitted (or evicted) it.
_JOBSET_POLL_S = 1.0
# GKE's taint on a node about to be reclaimed (a spot or preemptible VM's preemption, a host
# maintenance that terminates it), put by its node termination handler with effect NoSchedule; a
# spot or preemptible VM goes 30 s after the notice (k8s-node-termination-handler's
# preemptibleNodeTerminationDuration, GCE's preemption notice).
GKE_TERMINATION_TAINT = "cloud.google.com/impending-node-termination"
_GKE_SPOT_LABELS = ("cloud.google.com/gke-spot", "cloud.google.com/gke-preemptible")
_GKE_SPOT_NOTICE_S = 30.0
# The longest line the supervisor buffers, as the controller's (RankOutput::kLineCap): a longer
# one is passed on in pieces.
_LINE_CAP = 64 << 10


# ---- the supervisor -------------------------------------------------------------------------


class _Lines:
    r"""A log stream cut into whole lines, as the controller cuts a worker's output
    (src/controller/rank_output.h): a line ends at ``\n``, at ``\r`` (a progress bar redraws its
    line after one; ``\r\n`` ends one line), or after ``_LINE_CAP`` bytes without an end, so that
    output without newlines never grows a buffer without bound. A ``\r`` at the end of a chunk
    waits for the next one, which may hold its ``\n``."""

    _END = re.compile(rb"\r\n|\r(?!\Z)|\n")

    def __init__(self, cap: int = _LINE_CAP) -> None:
        self._cap = cap
        self._partial = b""

    def take(self, chunk: bytes) -> list[bytes]:
        r"""The lines that ``chunk`` ends, each with its end (a line cut at the cap: ``\n``)."""
        data = self._partial + chunk
        lines = []
        start = 0
        for end in self._END.finditer(data):
            lines.append(data[start:end.end()])
            start = end.end()
        while len(data) - start >= self._cap:
            lines.append(data[start:start + self._cap] + b"\n")
            start += self._cap
        self._partial = data[start:]
        return lines

    def close(self) -> list[bytes]:
        """The rest, an unended line, taken as ended."""
        return self.take(b"\n") if self._partial else []


class _Output:
    """Whole lines to stdout from several threads; ``<rank>: `` labels when there are several."""

    def __init__(self, labelled: bool) -> None:
        self._lock = threading.Lock()
        self._labelled = labelled

    def rank_lines(self, rank: int, lines: list[bytes]) -> None:
        r"""Writes `lines` (_Lines's) of `rank`. Labelled, a line that a lone ``\r`` ended ends in
        ``\n`` instead: the controller splits labelled output at ``\n`` only."""
        if self._labelled:
            label = f"{rank}: ".encode()
            lines = [label + (line[:-1] + b"\n" if line.endswith(b"\r") else line)
                     for line in lines if line != b"\r"]
        if lines:
            self._write(b"".join(lines))

    def say(self, line: str) -> None:
        self._write(f"jaxtrain kubernetes: {line}\n".encode())

    def _write(self, data: bytes) -> None:
        with self._lock:
            view = memoryview(data)
            while view:
                try:
                    n = os.write(1, view)
                except InterruptedError:
                    continue
                view = view[n:]


def _die_with_parent() -> None:
    """SIGTERM when the driver dies, even by SIGKILL (Linux's PR_SET_PDEATHSIG)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:
        pass
    # The driver may already be gone (and this process re-parented) before prctl took effect. The
    # driver may itself be PID 1 (jaxtrain submit's pod), so compare with its pid, not with 1.
    if os.getppid() != int(os.environ.get("JAXTRAIN_DRIVER_PID", os.getppid())):
        os.kill(os.getpid(), signal.SIGTERM)


class ObjectExists(Exception):
    """An object the supervisor was to create is already there: another's, left as it is."""

    def __init__(self, kind: str, namespace: str, name: str) -> None:
        super().__init__(
            f"cannot create {kind} {namespace}/{name}: one of that name already exists and is "
            "not this run's, so it was left as it is; this attempt created nothing that is left "
            "(if the object is a leftover of an earlier run, delete it)")


class _Pod:
    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.uid = ""
        self.node = "?"
        self.lost = False  # deleted, failed, or its container ended: not kept for the next attempt
        self.deleted_for_taint = False
        self.logs: threading.Thread | None = None
        self.ended = False
        self.pending_since: float | None = None
        self.pending_message = ""


class Supervisor:
    def __init__(self, api: Api, request: dict, out: _Output, kept_path: str = "") -> None:
        self.api = api
        self.namespace = request["namespace"]
        self.jobset = request["jobset"]
        self.name = self.jobset["metadata"]["name"]
        self.secret = request["secret"]
        self.ranks = int(request["ranks"])
        self.pending_timeout = float(request.get("pending_timeout_s", DEFAULT_PENDING_TIMEOUT_S))
        job = self.jobset["spec"]["replicatedJobs"][0]["template"]["spec"]
        self.pods_per_job = int(job["parallelism"])
        container = job["template"]["spec"]["containers"][0]
        self.container = container["name"]
        # Restarts in place (jaxtrain.kubernetes.pod): the pods' first process is the holder,
        # which outlives a failed worker; a stopped attempt's JobSet is kept in `kept_path` for
        # the next attempt's supervisor to take over.
        self.in_place = holder.holds(container.get("command") or [])
        self.python = (container.get("command") or ["python"])[0]
        plain = {e["name"]: e["value"] for e in container.get("env") or [] if "value" in e}
        self.attempt = plain.get("JAXTRAIN_ATTEMPT", "0")
        self.activation_env = {k: plain[k] for k in holder.activation_names() if k in plain}
        self.kept_path = kept_path
        self.log_since_s: int | None = None  # the log window of the pods taken over
        self.out = out
        self.events: queue.Queue = queue.Queue()
        self.pods: dict[str, _Pod] = {}
        self.succeeded: set[int] = set()
        self.stop_requested: str | None = None  # "grace" or "now"
        self.secret_uid: str | None = None  # what this supervisor created
        self.jobset_uid: str | None = None
        # Kueue: the LocalQueue of a queued JobSet; admitted once Kueue has unsuspended it.
        self.queue_name = request.get("queue_name") or ""
        self.admitted = not self.queue_name
        self.queued_since = time.monotonic()
        self.queue_reason = ""
        self.evicted = False
        # GKE's impending-termination taint: the nodes of the pods, watched; those that have it
        # (node -> (when it was seen, a spot or preemptible node)).
        self.watched_nodes: set[str] = set()
        self.tainted: dict[str, tuple[float, bool]] = {}
        self.cannot_watch_nodes = False

    # -- objects --

    def create(self) -> None:
        """Creates the attempt's Secret, then its JobSet, keeping the uid of each. An object of
        the same name that is already there is not this run's (names end in a random suffix): it
        is left as it is, and ObjectExists names it."""
        client = self.api.client
        meta = self.jobset["metadata"]
        secret = client.V1Secret(
            metadata=client.V1ObjectMeta(
                name=self.secret["name"], namespace=self.namespace, labels=meta.get("labels"),
                owner_references=meta.get("ownerReferences")),
            string_data={**(self.secret.get("env") or {}), "secret": self.secret["key"]},
            type="Opaque")
        try:
            made = self.api.core.create_namespaced_secret(self.namespace, secret)
        except client.ApiException as e:
            if e.status == 409:
                raise ObjectExists("Secret", self.namespace, self.secret["name"]) from None
            raise
        self.secret_uid = made.metadata.uid
        try:
            created = self.api.custom.create_namespaced_custom_object(
                JOBSET_GROUP, JOBSET_VERSION, self.namespace, JOBSET_PLURAL, self.jobset)
        except client.ApiException as e:
            if e.status == 409:
                raise ObjectExists("JobSet", self.namespace, self.name) from None
            raise
        self.jobset_uid = created["metadata"]["uid"]
        # The Secret now goes with the JobSet. Its uid in the patch: only this Secret is changed.
        owner = {"apiVersion": f"{JOBSET_GROUP}/{JOBSET_VERSION}", "kind": "JobSet",
                 "name": self.name, "uid": self.jobset_uid}
        self.api.core.patch_namespaced_secret(
            self.secret["name"], self.namespace,
            {"metadata": {"uid": self.secret_uid,
                          "ownerReferences": [owner, *(meta.get("ownerReferences") or [])]}})

    def _delete_options(self, uid: str, **kw: Any) -> Any:
        """Deletion of the object whose uid is `uid` only (a precondition the server checks)."""
        client = self.api.client
        return client.V1DeleteOptions(preconditions=client.V1Preconditions(uid=uid), **kw)

    def delete(self, grace: bool) -> None:
        """Deletes what this supervisor created — the JobSet and its Secret, each by its uid, so
        that an object of the same name made by another is never touched; returns once no pod of
        the JobSet is left."""
        client = self.api.client
        if self.jobset_uid is not None:
            body = self._delete_options(self.jobset_uid, propagation_policy="Foreground",
                                        grace_period_seconds=None if grace else 0)
            try:
                self.api.custom.delete_namespaced_custom_object(
                    JOBSET_GROUP, JOBSET_VERSION, self.namespace, JOBSET_PLURAL, self.name,
                    body=body)
            except client.ApiException as e:
                if e.status not in (404, 409):  # 409: the uid differs, ours is gone
                    self.out.say(f"error: cannot delete JobSet {self.namespace}/{self.name}: "
                                 f"{error_reason(e)}")
        if self.secret_uid is not None:
            try:
                self.api.core.delete_namespaced_secret(
                    self.secret["name"], self.namespace,
                    body=self._delete_options(self.secret_uid))
            except client.ApiException:
                pass
        if self.jobset_uid is None:
            return
        deadline = time.monotonic() + _TEARDOWN_TIMEOUT_S
        forced = not grace
        while time.monotonic() < deadline:
            try:
                left = self.api.core.list_namespaced_pod(
                    self.namespace, label_selector=f"{_JOBSET_NAME_LABEL}={self.name}").items
            except Exception as e:
                self.out.say(f"error: cannot list the pods of {self.name}: {error_reason(e)}")
                left = [None]
            if not left and self._jobset_gone():
                return
            if not forced and self.stop_requested == "now":
                forced = True
                for pod in left:
                    if pod is not None:
                        self._delete_pod_now(pod)
            time.sleep(0.2)
        self.out.say(f"error: pods of JobSet {self.namespace}/{self.name} were still there "
                     f"{_TEARDOWN_TIMEOUT_S:.0f} s after it was deleted")

    def _jobset_gone(self) -> bool:
        try:
            jobset = self.api.custom.get_namespaced_custom_object(
                JOBSET_GROUP, JOBSET_VERSION, self.namespace, JOBSET_PLURAL, self.name)
        except self.api.client.ApiException as e:
            return e.status == 404
        except Exception:
            return False
        return jobset["metadata"]["uid"] != self.jobset_uid

    def _delete_pod_now(self, pod: Any) -> None:
        try:
            self.api.core.delete_namespaced_pod(
                pod.metadata.name, self.namespace,
                body=self._delete_options(pod.metadata.uid, grace_period_seconds=0))
        except Exception:
            pass

    # -- pods --

    def _rank_of(self, pod: Any) -> int | None:
        try:
            job = int(pod.metadata.labels[JOB_INDEX_LABEL])
            index = int(pod.metadata.annotations[COMPLETION_INDEX])
        except (KeyError, TypeError, ValueError):
            return None
        return job * self.pods_per_job + index

    def _follow_logs(self, name: str, state: _Pod) -> None:
        # In place, a pod's log holds every attempt's output: this attempt's begins at its
        # holder's "worker started" line and ends at its "worker exited" line, which is how the
        # rank ended (a WORKER-END event).
        started = not self.in_place
        marker = f"{holder.PREFIX}attempt {self.attempt}: worker "
        for _ in range(3):
            try:
                stream = self.api.core.read_namespaced_pod_log(
                    name, self.namespace, container=self.container, follow=True,
                    since_seconds=self.log_since_s, _preload_content=False)
                lines = _Lines()
                for chunk in stream.stream(65536):
                    taken = lines.take(chunk)
                    if self.in_place:
                        taken, started, end = self._this_attempts(taken, started, marker)
                        self.out.rank_lines(state.rank, taken)
                        if end is not None:
                            stream.close()
                            self.events.put({"type": "WORKER-END", "pod": name, "how": end})
                            return
                    else:
                        self.out.rank_lines(state.rank, taken)
                self.out.rank_lines(state.rank, lines.close() if started else [])
                return
            except Exception:
                time.sleep(0.5)  # the container may not have started yet

    @staticmethod
    def _this_attempts(lines: list[bytes], started: bool,
                       marker: str) -> tuple[list[bytes], bool, str | None]:
        """Of a pod's log `lines`, this attempt's; whether it has started; how its worker ended
        (the rest of the holder's line) once it has."""
        kept = []
        for line in lines:
            # The holder writes its line whole, but it may follow a part of a line that the
            # worker left unended when it died: that part is the worker's.
            at = line.find(marker.encode())
            if at >= 0:
                if started and at > 0:
                    kept.append(line[:at] + b"\n")
                said = line[at + len(marker):].decode(errors="replace").strip()
                if said.startswith("started"):
                    started = True
                elif started:
                    return kept, started, said
                continue  # the holder's word to the supervisor, not the worker's output
            if started:
                kept.append(line)
        return kept, started, None

    def _watch(self) -> None:
        from kubernetes import watch

        version = None
        while True:
            try:
                stream = watch.Watch().stream(
                    self.api.core.list_namespaced_pod, self.namespace,
                    label_selector=f"{_JOBSET_NAME_LABEL}={self.name}", resource_version=version,
                    timeout_seconds=300)
                for event in stream:
                    version = event["object"].metadata.resource_version
                    self.events.put(event)
            except Exception as e:
                if getattr(e, "status", None) == 410:
                    version = None
                self.events.put({"type": "WATCH-ERROR", "error": error_reason(e)})
                time.sleep(1.0)

    def _handle(self, event: dict) -> tuple[int, str] | None:
        """An event's consequence: (exit status, why) when the group must end, else None."""
        if event["type"] == "WATCH-ERROR":
            return None
        pod = event["object"]
        rank = self._rank_of(pod)
        if rank is None:
            return None
        state = self.pods.setdefault(pod.metadata.name, _Pod(rank))
        state.node = pod.spec.node_name or state.node
        state.uid = pod.metadata.uid or state.uid
        statuses = pod.status.container_statuses or []
        main = next((s for s in statuses if s.name == self.container), None)
        # In place, a pod is kept for the next attempt only while it stays: not going, not
        # failed, its first process (the holder) still there. Its rank may have ended already.
        if (event["type"] == "DELETED" or pod.metadata.deletion_timestamp
                or pod.status.phase in ("Failed", "Succeeded")
                or (main is not None and main.state.terminated)):
            state.lost = True
        if state.ended:
            return None
        if pod.spec.node_name and pod.spec.node_name not in self.watched_nodes:
            self.watched_nodes.add(pod.spec.node_name)
            threading.Thread(target=self._watch_node, args=(pod.spec.node_name,),
                             daemon=True).start()
        if state.node in self.tainted and event["type"] != "DELETED":
            self._leave_tainted_node(state.node)
        if (pod.metadata.deletion_timestamp and self.queue_name and self.admitted
                and not self.evicted and self._suspended()):
            self._say_evicted()  # at once: the group may be stopped before the next poll
        if event["type"] == "DELETED":
            state.ended = True
            why = pod.status.reason or "its pod was deleted or its node was lost"
            self.out.say(f"rank {rank} on {state.node}: deleted ({why})")
            return 137, "deleted"
        if pod.status.phase == "Failed" and (main is None or main.state.terminated is None):
            state.ended = True
            self.out.say(f"rank {rank} on {state.node}: {pod.status.reason or 'failed'} "
                         f"({pod.status.message or 'its pod failed'})")
            return 137, "failed"
        if main is not None and main.state.waiting and main.state.waiting.reason in IMAGE_ERRORS:
            state.lost = True
            state.ended = True
            image = self.jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"][
                "spec"]["containers"][0].get("image")
            self.out.say(f"error: rank {rank}'s pod {pod.metadata.name} cannot start its "
                         f"container ({main.state.waiting.reason}: "
                         f"{main.state.waiting.message or ''}); image '{image}'")
            return 3, "image"
        if main is not None and (main.state.running or main.state.terminated) and not state.logs:
            state.logs = threading.Thread(target=self._follow_logs, args=(pod.metadata.name,
                                                                          state), daemon=True)
            state.logs.start()
        if main is not None and main.state.terminated:
            t = main.state.terminated
            state.ended = True
            if t.exit_code == 0:
                self.succeeded.add(rank)
                return (0, "succeeded") if len(self.succeeded) == self.ranks else None
            if t.reason == "OOMKilled":
                how = "killed by signal 9 (OOMKilled)"
            elif t.signal:
                how = f"killed by signal {t.signal}"
            elif t.exit_code > 128:
                how = f"killed by signal {t.exit_code - 128}"
            else:
                how = f"exited with status {t.exit_code}"
            self.out.say(f"rank {rank} on {state.node}: {how}")
            return t.exit_code, "failed"
        if pod.status.phase == "Pending" and not pod.spec.node_name:
            unschedulable = next((c for c in pod.status.conditions or []
                                  if c.type == "PodScheduled" and c.status == "False"), None)
            if unschedulable is not None and state.pending_since is None:
                state.pending_since = time.monotonic()
                state.pending_message = unschedulable.message
        else:
            state.pending_since = None
        return None

    # -- Kueue --

    def _poll_jobset(self) -> None:
        """Puts a JOBSET event whenever the JobSet's suspension changes: Kueue admitting it
        (unsuspended) or evicting it (suspended again)."""
        suspended = True
        while True:
            try:
                jobset = self.api.custom.get_namespaced_custom_object(
                    JOBSET_GROUP, JOBSET_VERSION, self.namespace, JOBSET_PLURAL, self.name)
            except Exception as e:
                if getattr(e, "status", None) == 404:
                    return
                time.sleep(_JOBSET_POLL_S)
                continue
            if jobset["metadata"].get("uid") != self.jobset_uid:
                return
            now = bool(jobset.get("spec", {}).get("suspend"))
            if now != suspended:
                suspended = now
                self.events.put({"type": "JOBSET", "suspended": now})
            elif now and not self.admitted:
                reason = self._workload_condition("QuotaReserved", "False")
                if reason and reason != self.queue_reason:
                    self.events.put({"type": "QUEUED", "reason": reason})
            time.sleep(_JOBSET_POLL_S)

    def _workload_condition(self, kind: str, status: str = "True") -> str:
        """The message of the JobSet's Kueue Workload's condition `kind` when its status is
        `status` ("" if none can be read: an identity may not read Workloads)."""
        try:
            workloads = self.api.custom.list_namespaced_custom_object(
                KUEUE_GROUP, KUEUE_VERSION, self.namespace, "workloads",
                label_selector=f"{_KUEUE_JOB_UID_LABEL}={self.jobset_uid}")["items"]
        except Exception:
            return ""
        for workload in workloads:
            for c in workload.get("status", {}).get("conditions") or []:
                if c.get("type") == kind and c.get("status") == status:
                    return c.get("message") or c.get("reason") or ""
        return ""

    def _on_jobset(self, event: dict) -> None:
        if event["type"] == "QUEUED":
            self.queue_reason = event["reason"]
            self.out.say(f"queued: {event['reason']}")
        elif not event["suspended"] and not self.admitted:
            self.admitted = True
            self.out.say(f"admitted by Kueue from LocalQueue '{self.queue_name}' after "
                         f"{time.monotonic() - self.queued_since:.0f} s queued")
        elif event["suspended"] and self.admitted:
            self._say_evicted()

    def _say_evicted(self) -> None:
        if self.evicted:
            return
        self.evicted = True
        why = self._workload_condition("Evicted") or "suspended by Kueue"
        self.out.say(f"evicted by Kueue ({why}): the pods of JobSet {self.namespace}/"
                     f"{self.name} are deleted, and their SIGTERM is the workers' preemption "
                     "notice; the next attempt is queued again")

    def _suspended(self) -> bool:
        try:
            return bool(self.api.custom.get_namespaced_custom_object(
                JOBSET_GROUP, JOBSET_VERSION, self.namespace, JOBSET_PLURAL,
                self.name).get("spec", {}).get("suspend"))
        except Exception:
            return False

    # -- GKE's impending node termination --

    def _watch_node(self, node: str) -> None:
        """Puts a TAINT event when `node` gets GKE's impending-termination taint."""
        from kubernetes import watch

        version = None
        while node not in self.tainted:
            try:
                stream = watch.Watch().stream(
                    self.api.core.list_node, field_selector=f"metadata.name={node}",
                    resource_version=version, timeout_seconds=300)
                for event in stream:
                    obj = event["object"]
                    version = obj.metadata.resource_version
                    if any(t.key == GKE_TERMINATION_TAINT for t in obj.spec.taints or []):
                        labels = obj.metadata.labels or {}
                        spot = any(labels.get(k) == "true" for k in _GKE_SPOT_LABELS)
                        self.events.put({"type": "TAINT", "node": node, "spot": spot})
                        return
            except Exception as e:
                status = getattr(e, "status", None)
                if status in (401, 403):
                    if not self.cannot_watch_nodes:
                        self.cannot_watch_nodes = True
                        self.out.say(f"cannot watch node {node} ({error_reason(e)}): GKE's "
                                     f"{GKE_TERMINATION_TAINT} taint is not seen in this attempt "
                                     "(the ClusterRole jaxtrain-cluster of "
                                     "docs/kubernetes-rbac.yaml lets it be)")
                    return
                if status == 410:
                    version = None
                time.sleep(1.0)

    def _leave_tainted_node(self, node: str) -> None:
        """Deletes the pods on `node`, which GKE is about to reclaim: their workers' SIGTERM is
        a preemption notice, and a spot node's pods get the grace period its 30 s notice leaves
        (others, their own terminationGracePeriodSeconds)."""
        seen, spot = self.tainted[node]
        grace = max(1, int(_GKE_SPOT_NOTICE_S - (time.monotonic() - seen))) if spot else None
        leaving = [(name, state) for name, state in self.pods.items()
                   if state.node == node and not state.ended and not state.deleted_for_taint]
        if not leaving:
            return
        ranks = ", ".join(str(state.rank) for _, state in sorted(leaving, key=lambda p: p[1].rank))
        self.out.say(f"node {node} has GKE's {GKE_TERMINATION_TAINT} taint: deleting its pods "
                     f"(rank{'s' if len(leaving) > 1 else ''} {ranks}) with "
                     + (f"a grace period of {grace} s" if grace else "their grace period")
                     + "; their SIGTERM is the workers' preemption notice")
        for name, state in leaving:
            state.deleted_for_taint = True
            try:
                self.api.core.delete_namespaced_pod(
                    name, self.namespace,
                    body=self._delete_options(state.uid, grace_period_seconds=grace))
            except Exception as e:
                self.out.say(f"cannot delete pod {name} on {node}: {error_reason(e)}")

    def _pending_too_long(self) -> tuple[int, str] | None:
        if not self.admitted:
            return None  # queued in Kueue: a wait for quota, not a pod that cannot be scheduled
        now = time.monotonic()
        for name, state in self.pods.items():
            if state.pending_since is not None and now - state.pending_since > self.pending_timeout:
                self.out.say(
                    f"error: rank {state.rank}'s pod {name} could not be scheduled for "
                    f"{self.pending_timeout:.0f} s (JAXTRAIN_K8S_PENDING_TIMEOUT_S): "
                    f"{state.pending_message or 'Pending'}")
                return 3, "pending"
        return None

    # -- restarts in place --

    def _worker_end(self, event: dict) -> tuple[int, str] | None:
        """A WORKER-END event (the holder's line): the rank ended as _handle's terminated
        container would say."""
        state = self.pods.get(event["pod"])
        if state is None or state.ended:
            return None
        state.ended = True
        said = event["how"]
        code = holder.exit_code(said)
        if code == 0:
            self.succeeded.add(state.rank)
            return (0, "succeeded") if len(self.succeeded) == self.ranks else None
        self.out.say(f"rank {state.rank} on {state.node}: {said}")
        return code, "failed"

    @staticmethod
    def _shape(jobset: dict, name: str) -> str:
        """What must not change for an attempt to run in the kept pods: the JobSet's spec with
        its name (which the Secret's references carry) and the activation's variables left out."""
        spec = json.loads(json.dumps(jobset["spec"]).replace(json.dumps(name)[1:-1], "{name}"))
        pod = spec["replicatedJobs"][0]["template"]["spec"]["template"]
        for c in pod["spec"]["containers"][:1]:
            c["env"] = [e for e in c.get("env") or []
                        if e.get("name") not in holder.activation_names()]
        return json.dumps(spec, sort_keys=True)

    def _tell(self, name: str, message: dict) -> dict:
        """Sends `message` to the holder of pod `name` (jaxtrain.kubernetes.pod) through the API
        server's exec; its answer, or {"error": ...}."""
        command = [self.python, "-m", "jaxtrain.kubernetes", "activate", json.dumps(message)]
        try:
            code, out, err = self.api.exec(self.namespace, name, self.container, command,
                                           _EXEC_TIMEOUT_S)
        except Exception as e:
            return {"error": f"cannot exec in pod {name}: {error_reason(e)}"}
        try:
            answer = json.loads(out.strip().splitlines()[-1])
        except (ValueError, IndexError):
            answer = {"error": f"exit status {code}: {(err or out).strip()[-300:]}"}
        return answer

    def _tell_all(self, names: list[str], message: dict) -> dict[str, dict]:
        answers: dict[str, dict] = {}

        def tell(name: str) -> None:
            answers[name] = self._tell(name, message)

        threads = [threading.Thread(target=tell, args=(n,), daemon=True) for n in names]
        for t in threads:
            t.start()
        deadline = time.monotonic() + _EXEC_TIMEOUT_S + 10
        for t in threads:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
        return {n: answers.get(n) or {"error": f"no answer from pod {n}"} for n in names}

    def adopt(self) -> bool:
        """Takes over the JobSet an earlier attempt kept (self.kept_path) and starts this
        attempt's worker in each of its pods. False, having deleted what was kept, when that
        cannot be done: a pod gone or not running, the pods' spec changed, a holder that does not
        answer; the attempt then makes a new JobSet, as without restarts in place."""
        with open(self.kept_path) as f:
            kept = json.load(f)
        name = kept["jobset"]["metadata"]["name"]
        why = ""
        if int(kept.get("ranks", self.ranks)) != self.ranks:
            why = f"the run resized from {kept['ranks']} to {self.ranks} pods"
        elif kept["shape"] != self._shape(self.jobset, self.name):
            why = "the pods' spec changed"
        pods: dict[str, Any] = {}
        if not why:
            try:
                for p in self.api.core.list_namespaced_pod(
                        self.namespace, label_selector=f"{_JOBSET_NAME_LABEL}={name}").items:
                    pods[p.metadata.name] = p
            except Exception as e:
                why = f"its pods cannot be listed ({error_reason(e)})"
        if not why and len(kept["pods"]) != self.ranks:
            why = "its last attempt did not end with every pod kept"
        for pod_name, uid in sorted(kept["pods"].items()) if not why else []:
            p = pods.get(pod_name)
            if p is None or p.metadata.uid != uid:
                why = f"pod {pod_name} is gone"
            elif p.metadata.deletion_timestamp:
                why = f"pod {pod_name} is terminating"
            elif p.status.phase != "Running":
                why = f"pod {pod_name} is {p.status.phase}"
            if why:
                break
        if not why and len(pods) != len(kept["pods"]):
            why = f"the JobSet has {len(pods)} pods, not {len(kept['pods'])}"
        if not why:
            self.log_since_s = int(time.time() - kept["written"]) + 60
            answers = self._tell_all(sorted(kept["pods"]), {
                "start": {"attempt": self.attempt, "env": self.activation_env}})
            failed = sorted((n, a) for n, a in answers.items() if not a.get("ok"))
            if failed:
                why = f"pod {failed[0][0]} did not start its worker ({failed[0][1].get('error')})"
                # The workers that did start would wait for the others in vain: ended at once.
                self._tell_all([n for n, a in answers.items() if a.get("ok")],
                               {"signal": "KILL"})
        if why:
            self.out.say(f"attempt {self.attempt} cannot restart in place in JobSet "
                         f"{self.namespace}/{name} ({why}): it is deleted and a new one made")
            self._release(kept, grace=False)
            self.log_since_s = None
            return False
        self.name = name
        self.jobset = kept["jobset"]
        self.jobset_uid, self.secret_uid = kept["jobset_uid"], kept["secret_uid"]
        self.secret = {"name": kept["secret"]}
        self.admitted = True  # by Kueue, for the attempt that made the JobSet
        # The record stays, this attempt's now: deleted or written again at its end; a supervisor
        # killed before then leaves it to the next attempt's or to the run's end to delete.
        warm = sum(1 for a in answers.values() if a.get("warm"))
        cold = "; ".join(f"{n}: {a.get('why', 'no standby')}"
                         for n, a in sorted(answers.items()) if not a.get("warm"))
        self.out.say(f"attempt {self.attempt} restarted in place in JobSet {self.namespace}/"
                     f"{name}: {len(answers)} pods kept, {warm} of their workers warm"
                     + (f" (started afresh: {cold})" if cold else ""))
        return True

    @classmethod
    def of_kept(cls, api: Api, kept: dict, out: _Output, kept_path: str = "") -> Supervisor:
        """A supervisor of the JobSet a record of _keep() names, as the one that created it."""
        made = cls(api, {"namespace": kept["namespace"], "jobset": kept["jobset"],
                         "secret": {"name": kept["secret"]}, "ranks": kept["ranks"]}, out,
                   kept_path)
        made.jobset_uid, made.secret_uid = kept["jobset_uid"], kept["secret_uid"]
        return made

    def _release(self, kept: dict, grace: bool = True) -> None:
        """Deletes a kept JobSet and its Secret (by uid), waits for its pods to be gone, and
        removes the record."""
        try:
            Supervisor.of_kept(self.api, kept, self.out).delete(grace=grace)
        finally:
            self._forget_kept()

    def _adopt_or_release(self) -> bool:
        """adopt(), and on any error there, the kept JobSet deleted (when the record can be read)
        and the record removed: each attempt after it would fail the same way."""
        try:
            return self.adopt()
        except Exception as e:
            self.out.say(f"attempt {self.attempt} cannot restart in place ({error_reason(e)}): a "
                         "new JobSet is made")
            try:
                with open(self.kept_path) as f:
                    self._release(json.load(f), grace=False)
            except Exception:
                self._forget_kept()
            return False

    def _forget_kept(self) -> None:
        try:
            os.unlink(self.kept_path)
        except FileNotFoundError:
            pass

    def _stop_in_place(self) -> bool:
        """Stops the workers still running (TERM through their holders, KILL once told to stop
        at once) and waits for each to end. True when every pod is left running its holder, to
        be kept for the next attempt."""
        told = ""
        deadline = time.monotonic() + _TEARDOWN_TIMEOUT_S
        while time.monotonic() < deadline:
            if any(state.lost for state in self.pods.values()) or not self._driver_alive():
                return False
            running = sorted(n for n, state in self.pods.items() if not state.ended)
            if not running:
                return True
            signal_name = "KILL" if self.stop_requested == "now" else "TERM"
            if told != signal_name:
                told = signal_name
                for name, answer in self._tell_all(running, {"signal": signal_name}).items():
                    if not answer.get("ok"):
                        self.out.say(f"error: {answer.get('error')}")
                        return False
                    if (not answer.get("running") and answer.get("ended")
                            and answer.get("attempt") == self.attempt):
                        # Its end line was not read from the log: the holder's word stands.
                        self._worker_end({"pod": name, "how": answer["ended"]})
            try:
                event = self.events.get(timeout=0.5)
            except queue.Empty:
                continue
            if event["type"] == "WORKER-END":
                self._worker_end(event)
            elif event["type"] == "TAINT":
                return False  # a node about to be reclaimed: its pods are not kept
            elif event["type"] not in ("JOBSET", "QUEUED", "STOP"):
                self._handle(event)
        return False

    def _keep(self, stopped: bool = True) -> bool:
        """Records the attempt's JobSet in self.kept_path: once created (so that a supervisor
        killed before it could delete it leaves it to the next one, or to the run's end, to
        delete), and when `stopped` with every pod kept for the next attempt."""
        kept = {"namespace": self.namespace, "jobset": self.jobset, "ranks": self.ranks,
                "jobset_uid": self.jobset_uid, "secret": self.secret["name"],
                "secret_uid": self.secret_uid, "shape": self._shape(self.jobset, self.name),
                "pods": {n: state.uid for n, state in self.pods.items()}, "written": time.time()}
        partial = f"{self.kept_path}.partial"
        try:
            fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump(kept, f)
            os.replace(partial, self.kept_path)  # whole, or the last record stays
        except OSError as e:
            self.out.say(f"error: cannot record JobSet {self.namespace}/{self.name} in "
                         f"{self.kept_path}: {e}")
            return False
        if stopped:
            self.out.say(f"JobSet {self.namespace}/{self.name} kept for the next attempt: its "
                         f"{len(self.pods)} pods wait for it")
        return True

    @staticmethod
    def _driver_alive() -> bool:
        return os.getppid() == int(os.environ.get("JAXTRAIN_DRIVER_PID", os.getppid()))

    def _keepable(self, ended: tuple[int, str] | None) -> bool:
        """Whether the stopped attempt's pods may be kept for the next one: restarts in place,
        a failure or a stop (not the run's end, nor a pod that cannot start), every rank's pod
        there and not going, and the driver still there to restart."""
        return (self.in_place and bool(self.kept_path) and self.admitted and not self.evicted
                and not self.tainted and (ended is None or ended[1] == "failed")
                and self._driver_alive()
                and len(self.pods) == self.ranks
                and not any(state.lost for state in self.pods.values()))

    def run(self) -> int:
        def on_signal(signum, frame):
            self.stop_requested = "now" if signum == signal.SIGUSR1 else (
                self.stop_requested or "grace")
            self.events.put({"type": "STOP"})

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGUSR1, on_signal)
        # The attempt trains (the launcher's PrepareNext): the holders start their standbys.
        signal.signal(signal.SIGUSR2, lambda signum, frame: self.events.put({"type": "PREPARE"}))
        adopted = False
        try:
            adopted = (self.in_place and os.path.exists(self.kept_path)
                       and self._adopt_or_release())
            if not adopted:
                self.create()
                if self.in_place:
                    self._keep(stopped=False)
        except ObjectExists as e:
            self.out.say(f"error: {e}")
            self.delete(grace=False)
            return 3
        except Exception as e:
            self.out.say(f"error: cannot create JobSet {self.namespace}/{self.name}: "
                         f"{error_reason(e)}")
            self.delete(grace=False)
            return 3
        if self.queue_name and adopted:
            self.out.say(f"admitted by Kueue from LocalQueue '{self.queue_name}' for an earlier "
                         "attempt, whose JobSet this one runs in")
            threading.Thread(target=self._poll_jobset, daemon=True).start()
        elif self.queue_name:
            # Created suspended: Launch() waits for the "admitted" line (kubernetes_launcher.h).
            self.out.say(f"queued: JobSet {self.namespace}/{self.name} waits for Kueue to admit "
                         f"it from LocalQueue '{self.queue_name}'")
            threading.Thread(target=self._poll_jobset, daemon=True).start()
        threading.Thread(target=self._watch, daemon=True).start()
        ended: tuple[int, str] | None = None
        while ended is None and self.stop_requested is None:
            try:
                event = self.events.get(timeout=1.0)
            except queue.Empty:
                ended = self._pending_too_long()
                continue
            if event["type"] in ("JOBSET", "QUEUED"):
                self._on_jobset(event)
            elif event["type"] == "TAINT":
                self.tainted.setdefault(event["node"], (time.monotonic(), event["spot"]))
                self._leave_tainted_node(event["node"])
            elif event["type"] == "WORKER-END":
                ended = self._worker_end(event)
            elif event["type"] == "PREPARE":
                if self.in_place:
                    running = sorted(n for n, state in self.pods.items() if not state.ended)
                    threading.Thread(target=self._tell_all, args=(running, {"prepare": {}}),
                                     daemon=True).start()
            elif event["type"] != "STOP":
                ended = self._handle(event)
        if self._keepable(ended) and self._stop_in_place() and self._driver_alive() \
                and self._keep():
            pass
        else:
            self.delete(grace=self.stop_requested != "now")
            if self.in_place:
                self._forget_kept()
        for state in self.pods.values():
            if state.logs is not None:
                state.logs.join(timeout=5.0)
        if self.stop_requested is not None:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM if self.stop_requested == "grace"
                    else signal.SIGKILL)
        return ended[0] if ended else 0


def supervise(request_path: str) -> int:
    _die_with_parent()
    with open(request_path) as f:
        request = json.load(f)
    os.unlink(request_path)  # it holds the run's key
    out = _Output(labelled=int(request["ranks"]) > 1)
    try:
        api = Api()
    except Exception as e:
        out.say(f"error: {e}")
        return 3
    kept_path = os.path.join(os.path.dirname(os.path.abspath(request_path)), KEPT_FILE)
    return Supervisor(api, request, out, kept_path).run()


def release(kept_path: str) -> int:
    """Deletes the JobSet the run's last attempt kept (at the run's end): `supervise --release`."""
    out = _Output(labelled=False)
    try:
        with open(kept_path) as f:
            kept = json.load(f)
        api = Api()
    except FileNotFoundError:
        return 0
    except Exception as e:
        out.say(f"error: cannot delete the kept JobSet of {kept_path}: {error_reason(e)}")
        return 3
    Supervisor.of_kept(api, kept, out, kept_path)._release(kept)
    return 0


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "supervise":
        return supervise(argv[1])
    if len(argv) == 3 and argv[:2] == ["supervise", "--release"]:
        return release(argv[2])
    if len(argv) == 3 and argv[:2] == ["supervise", "--capacity"]:
        from jaxtrain.kubernetes.capacity import capacity

        return capacity(argv[2])
    sys.stderr.write("python -m jaxtrain.kubernetes is started by jaxtrain's Kubernetes "
                     "launcher; it is not run by hand\n")
    return 2
