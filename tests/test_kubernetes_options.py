"""The Kubernetes launcher's choices that need no cluster: names, pod templates, the JobSet that
`jaxtrain plan --kubernetes` prints, the errors for what GKE cannot give, the supervisor's log
lines and its objects (on a fake API server), and the Role and NetworkPolicy of docs/."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from kubernetes.client import ApiException

from jaxtrain import _core
from jaxtrain.kubernetes import api, launch, pod, submit, supervisor

REPO = Path(__file__).resolve().parent.parent


def test_run_names_become_dns_labels():
    assert api.dns_name("My_Run 2026.12", 30) == "my-run-2026-12"
    assert api.dns_name("42-answers", 30) == "r-42-answers"
    assert api.dns_name("x" * 80, 30) == "x" * 30
    assert api.dns_name("--", 30) == "r"


def test_a_pod_template_is_read_as_yaml_and_refused_when_not_a_pod(tmp_path):
    good = tmp_path / "pod.yaml"
    good.write_text("spec:\n  tolerations: [{key: tpu, operator: Exists}]\n")
    assert api.load_pod_template(str(good)) == {
        "spec": {"tolerations": [{"key": "tpu", "operator": "Exists"}]}}
    bad = tmp_path / "list.yaml"
    bad.write_text("- a\n- b\n")
    with pytest.raises(ValueError, match=r"JAXTRAIN_K8S_POD_TEMPLATE='.*list.yaml' must hold a "
                                         r"Pod"):
        api.load_pod_template(str(bad))
    with pytest.raises(ValueError, match="cannot be read"):
        api.load_pod_template(str(tmp_path / "absent.yaml"))


def test_the_run_directory_must_be_on_a_volume_the_workers_mount():
    mount = {"name": "r", "mountPath": "/mnt/runs"}
    template = {"spec": {"containers": [{"volumeMounts": [mount]}]}}
    assert launch._mounts_covering("/mnt/runs/my_run", template)
    assert launch._mounts_covering("/mnt/runs", template)
    assert not launch._mounts_covering("/mnt/runs2/x", template)
    assert not launch._mounts_covering("/mnt/runs/x", None)


def _plan(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jaxtrain", "plan", "--kubernetes", *args],
                          capture_output=True, text=True,
                          env={**os.environ, "JAXTRAIN_K8S_IMAGE": "example/train:1", **env})


def test_plan_prints_the_jobset_of_a_multislice_tpu_config():
    proc = _plan("-n", "4", "--use-tpu", "--topology", "2x2x2", "--accelerator-type", "TPU-V4")
    assert proc.returncode == 0, proc.stderr
    jobset = json.loads(proc.stdout)
    job = jobset["spec"]["replicatedJobs"][0]
    assert (job["name"], job["replicas"], job["template"]["spec"]["parallelism"]) == ("slice", 2, 2)
    container = job["template"]["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == "example/train:1"
    assert {e["name"] for e in container["env"]} >= {"MEGASCALE_NUM_SLICES",
                                                     "MEGASCALE_SLICE_ID",
                                                     "MEGASCALE_COORDINATOR_ADDRESS"}


@pytest.mark.parametrize("args, message", [
    (["-n", "4", "--use-tpu", "--topology", "4x4", "--accelerator-type", "TPU-V3"],
     "TPU v3 is not offered on GKE"),
    (["-n", "8", "--use-tpu", "--topology", "2x2x2", "--accelerator-type", "TPU-V4",
      "--resources-per-worker", "TPU=2"], "one worker runs per TPU VM host"),
    (["-n", "2", "--use-gpu", "--resources-per-worker", "GPU=0.5"], "nvidia.com/gpu"),
    (["-n", "1", "--use-tpu"], "on Kubernetes a TPU ScalingConfig needs it"),
])
def test_plan_names_what_kubernetes_cannot_give(args, message):
    proc = _plan(*args)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr


def test_plan_shows_kueues_labels_on_a_suspended_jobset():
    proc = _plan("-n", "2", JAXTRAIN_K8S_QUEUE_NAME="team-a", JAXTRAIN_K8S_PRIORITY_CLASS="low")
    assert proc.returncode == 0, proc.stderr
    jobset = json.loads(proc.stdout)
    assert jobset["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
    assert jobset["metadata"]["labels"]["kueue.x-k8s.io/priority-class"] == "low"
    assert jobset["spec"]["suspend"] is True


@pytest.mark.parametrize("env, message", [
    ({"JAXTRAIN_K8S_QUEUE_NAME": "Team_A"}, "JAXTRAIN_K8S_QUEUE_NAME='Team_A' is not allowed"),
    ({"JAXTRAIN_K8S_QUEUE_NAME": "q", "JAXTRAIN_K8S_PRIORITY_CLASS": "x" * 64},
     "JAXTRAIN_K8S_PRIORITY_CLASS='" + "x" * 64 + "' is not allowed"),
    ({"JAXTRAIN_K8S_PRIORITY_CLASS": "high"}, "set JAXTRAIN_K8S_QUEUE_NAME to the LocalQueue"),
])
def test_kueue_settings_are_refused_with_the_setting_and_value(env, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        launch.kueue_settings(env)
    proc = _plan("-n", "2", **env)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr
    assert launch.kueue_settings({"JAXTRAIN_K8S_QUEUE_NAME": "team-a.gpu"}) == (
        "team-a.gpu", "")


def test_run_names_differ_after_user_code_seeds_random():
    # User code seeding `random` before fit() must not repeat a name another run has.
    names = set()
    for _ in range(2):
        random.seed(0)
        names.add(api.object_name("jaxtrain_run-2026-12-05_14-55-07.123-abcdef"))
    assert len(names) == 2
    # Names that differ only past the cut keep apart in their hash, and fit the budget.
    base = "a-very-long-sweep-name-for-the-learning-rate-trial"
    one, two = (api.object_name(f"{base}{n}").rsplit("-", 1)[0] for n in (1, 2))
    assert one != two
    assert len(one) <= 30 and one.startswith("a-very-long-sweep-name")
    assert re.fullmatch(r"my-run-[a-z0-9]{6}", api.object_name("My_Run"))


def test_log_lines_end_at_newline_or_carriage_return_and_are_capped():
    lines = supervisor._Lines(cap=8)
    assert lines.take(b"a\nb\r") == [b"a\n"]  # a '\r' at the end waits for what follows
    assert lines.take(b"\nc\rd") == [b"b\r\n", b"c\r"]
    assert lines.take(b"0123456789") == [b"d0123456\n"]  # a line without an end, capped
    assert lines.take(b"") == []
    assert lines.close() == [b"789\n"]
    assert lines.close() == []
    # A progress bar that never sends '\n' keeps no more than the cap.
    bar = supervisor._Lines(cap=8)
    for _ in range(1000):
        bar.take(b"\r 50%|#####")
    assert len(bar._partial) < 8


def test_labelled_lines_end_in_newline_for_the_controller(capfd):
    out = supervisor._Output(labelled=True)
    out.rank_lines(1, [b"\r", b" 10%|#\r", b"done\r\n", b"x\n"])
    out.rank_lines(0, [])
    assert capfd.readouterr().out == "1:  10%|#\n1: done\r\n1: x\n"
    supervisor._Output(labelled=False).rank_lines(0, [b" 10%|#\r", b"x\n"])
    assert capfd.readouterr().out == " 10%|#\rx\n"  # the controller shows the bar move


def _roles() -> dict[str, set[tuple[str, str, str, str]]]:
    """The Roles of docs/kubernetes-rbac.yaml, as (verb, group, resource, subresource)."""
    roles = {}
    for doc in yaml.safe_load_all((REPO / "docs" / "kubernetes-rbac.yaml").read_text()):
        granted = set()
        for rule in doc["rules"]:
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    name, _, sub = resource.partition("/")
                    granted |= {(verb, group, name, sub) for verb in rule["verbs"]}
        roles[doc["metadata"]["name"]] = granted
    return roles


def test_the_documented_roles_grant_exactly_what_the_code_uses():
    roles = _roles()
    assert roles["jaxtrain"] == set(api._NEEDED + api._NEEDED_IN_PLACE)
    assert roles["jaxtrain-submit"] == set(api._NEEDED_TO_SUBMIT)
    assert roles["jaxtrain-cluster"] == set(api._NEEDED_CLUSTER)
    for granted in roles.values():
        assert not {g for g in granted if g[2] == "secrets" and g[0] in ("get", "list", "watch")}


def test_the_network_policy_covers_the_pods_a_run_makes():
    proc = _plan("-n", "2")
    assert proc.returncode == 0, proc.stderr
    labels = json.loads(proc.stdout)["spec"]["replicatedJobs"][0]["template"]["spec"][
        "template"]["metadata"]["labels"]
    policy = yaml.safe_load((REPO / "docs" / "kubernetes-networkpolicy.yaml").read_text())
    selected = policy["spec"]["podSelector"]["matchLabels"]
    admitted = [f["podSelector"]["matchLabels"] for f in policy["spec"]["ingress"][0]["from"]]
    assert selected.items() <= labels.items()
    assert any(a.items() <= labels.items() for a in admitted)
    # The driver pods of jaxtrain submit too.
    assert selected.items() <= submit.MANAGED_BY.items()


class _FakeServer:
    """The API calls of the supervisor's create() and delete(), on a dict of objects, with the
    API server's answers: 409 for a name taken or a uid precondition unmet, 404 for none."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str], dict] = {}
        self._made = 0

    def add(self, kind: str, name: str, **fields) -> dict:
        self._made += 1
        obj = {"uid": f"uid-{self._made}", **fields}
        self.objects[(kind, name)] = obj
        return obj

    def _create(self, kind: str, name: str, **fields) -> dict:
        if (kind, name) in self.objects:
            raise ApiException(status=409, reason="AlreadyExists")
        return self.add(kind, name, **fields)

    def _delete(self, kind: str, name: str, body) -> None:
        obj = self.objects.get((kind, name))
        if obj is None:
            raise ApiException(status=404, reason="NotFound")
        if body is not None and body.preconditions and body.preconditions.uid != obj["uid"]:
            raise ApiException(status=409, reason="Conflict")
        del self.objects[(kind, name)]

    def create_namespaced_secret(self, namespace, body):
        obj = self._create("Secret", body.metadata.name, data=body.string_data)
        return SimpleNamespace(metadata=SimpleNamespace(uid=obj["uid"]))

    def patch_namespaced_secret(self, name, namespace, patch):
        obj = self.objects[("Secret", name)]
        if patch["metadata"].get("uid", obj["uid"]) != obj["uid"]:
            raise ApiException(status=409, reason="Conflict")
        obj["owners"] = patch["metadata"]["ownerReferences"]

    def delete_namespaced_secret(self, name, namespace, body=None):
        self._delete("Secret", name, body)

    def create_namespaced_custom_object(self, group, version, namespace, plural, body):
        return {"metadata": {"uid": self._create("JobSet", body["metadata"]["name"])["uid"]}}

    def get_namespaced_custom_object(self, group, version, namespace, plural, name):
        if ("JobSet", name) not in self.objects:
            raise ApiException(status=404, reason="NotFound")
        return {"metadata": {"uid": self.objects[("JobSet", name)]["uid"]}}

    def delete_namespaced_custom_object(self, group, version, namespace, plural, name, body=None):
        self._delete("JobSet", name, body)

    def list_namespaced_pod(self, namespace, label_selector):
        return SimpleNamespace(items=[])


@pytest.fixture(autouse=True)
def _keep_signal_handlers():
    """Supervisor.run() takes SIGTERM and SIGUSR1; this process gets its own back."""
    import signal

    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)}
    yield
    for s, handler in saved.items():
        signal.signal(s, handler)


def _supervisor(server: _FakeServer) -> supervisor.Supervisor:
    from kubernetes import client

    container = {"name": "worker", "image": "example/train:1"}
    jobset = {"metadata": {"name": "run-x-1", "labels": {}},
              "spec": {"replicatedJobs": [{"template": {"spec": {
                  "parallelism": 1, "template": {"spec": {"containers": [container]}}}}}]}}
    request = {"namespace": "ml", "jobset": jobset, "ranks": 1,
               "secret": {"name": "run-x-1", "key": "k" * 64, "env": {"env.API_KEY": "v"}}}
    cluster = SimpleNamespace(client=client, core=server, custom=server)
    return supervisor.Supervisor(cluster, request, supervisor._Output(labelled=False))


def test_an_existing_secret_of_the_same_name_is_left_untouched(capfd):
    server = _FakeServer()
    theirs = server.add("Secret", "run-x-1", data={"secret": "theirs"})
    assert _supervisor(server).run() == 3
    assert server.objects == {("Secret", "run-x-1"): theirs}
    assert theirs == {"uid": "uid-1", "data": {"secret": "theirs"}}
    assert "cannot create Secret ml/run-x-1: one of that name already exists" in \
        capfd.readouterr().out


def test_an_existing_jobset_of_the_same_name_is_left_untouched(capfd):
    server = _FakeServer()
    theirs = server.add("JobSet", "run-x-1")
    assert _supervisor(server).run() == 3
    assert server.objects == {("JobSet", "run-x-1"): theirs}  # and the Secret made is gone
    assert "cannot create JobSet ml/run-x-1: one of that name already exists" in \
        capfd.readouterr().out


def test_the_supervisor_deletes_only_the_objects_it_created():
    server = _FakeServer()
    running = _supervisor(server)
    running.create()
    secret = server.objects[("Secret", "run-x-1")]
    assert secret["data"] == {"env.API_KEY": "v", "secret": "k" * 64}
    assert secret["owners"][0]["uid"] == running.jobset_uid
    # Both replaced by another's objects of the same names (say, after a restart of the driver).
    del server.objects[("Secret", "run-x-1")], server.objects[("JobSet", "run-x-1")]
    others = {("Secret", "run-x-1"): server.add("Secret", "run-x-1"),
              ("JobSet", "run-x-1"): server.add("JobSet", "run-x-1")}
    running.delete(grace=True)
    assert server.objects == others


class _FakeKueue:
    """The custom objects API of a cluster with Kueue (`installed`), a LocalQueue 'team' and a
    WorkloadPriorityClass 'high'; the identity may read them unless `forbidden`."""

    def __init__(self, installed: bool = True, forbidden: bool = False) -> None:
        self.installed, self.forbidden = installed, forbidden

    def _refuse(self, plural: str, name: str) -> None:
        if self.forbidden:
            raise ApiException(status=403, reason="Forbidden")
        if not self.installed:
            raise ApiException(status=404, reason="NotFound")
        if (plural, name) not in {("localqueues", "team"), ("workloadpriorityclasses", "high")}:
            e = ApiException(status=404, reason="NotFound")
            e.body = json.dumps({"message": f'{plural}.kueue.x-k8s.io "{name}" not found'})
            raise e

    def get_namespaced_custom_object(self, group, version, namespace, plural, name):
        self._refuse(plural, name)

    def get_cluster_custom_object(self, group, version, plural, name):
        self._refuse(plural, name)

    def list_namespaced_custom_object(self, group, version, namespace, plural, limit=None):
        self._refuse(plural, "team")
        return {"items": []}


@pytest.mark.parametrize("fake, queue, priority, message", [
    (_FakeKueue(), "team", "high", None),
    (_FakeKueue(forbidden=True), "other", "low", None),  # not the run's to check then
    (_FakeKueue(), "other", "", "JAXTRAIN_K8S_QUEUE_NAME='other': no Kueue LocalQueue of that "
                                "name in namespace 'ml'"),
    (_FakeKueue(), "team", "low", "JAXTRAIN_K8S_PRIORITY_CLASS='low': no Kueue "
                                  "WorkloadPriorityClass of that name"),
    (_FakeKueue(installed=False), "team", "", "Kueue is not installed in this cluster"),
])
def test_fit_checks_the_kueue_queue_and_priority_class(fake, queue, priority, message):
    from kubernetes import client

    cluster = SimpleNamespace(client=client, custom=fake)
    if message is None:
        api.Api.check_kueue(cluster, "ml", queue, priority)
    else:
        with pytest.raises(ValueError, match=re.escape(message)):
            api.Api.check_kueue(cluster, "ml", queue, priority)


@pytest.mark.parametrize("env, message", [
    ({"JAXTRAIN_K8S_IN_PLACE": "yes"}, "JAXTRAIN_K8S_IN_PLACE='yes' is not allowed; it must be 1"),
    ({"JAXTRAIN_WARM_WORKERS": "on"}, "JAXTRAIN_WARM_WORKERS='on' is not allowed: use 1"),
])
def test_restart_settings_are_refused_with_the_setting_and_value(env, message, monkeypatch):
    for name, value in env.items():
        monkeypatch.setenv(name, value)  # JAXTRAIN_WARM_WORKERS is the engine's to read
    with pytest.raises(ValueError, match=re.escape(message)):
        launch.in_place_setting(env)
        _core.warm_workers_requested()


def test_the_worker_container_runs_the_holder_when_restarts_are_in_place(monkeypatch):
    monkeypatch.delenv("JAXTRAIN_WARM_WORKERS", raising=False)
    assert launch.in_place_setting({}) and _core.warm_workers_requested()
    held = launch.worker_command("python3", True)
    assert held == ["python3", "-m", "jaxtrain.kubernetes", "hold", "--", "python3", "-m",
                    "jaxtrain.worker"]
    assert pod.holds(held)
    assert launch.worker_command("python3", True, warm=False)[4] == "--no-standby"
    assert pod.holds(launch.worker_command("python3", True, warm=False))
    plain = launch.worker_command("python3", False)
    assert plain == ["python3", "-m", "jaxtrain.worker"] and not pod.holds(plain)


def test_an_attempts_lines_are_cut_from_a_kept_pods_log_at_its_holders_lines():
    log = [b"old output\n", b"jaxtrain pod: attempt 0: worker started (first)\n",
           b"attempt 0 trains\n", b"jaxtrain pod: attempt 0: worker exited with status 3\n",
           b"jaxtrain pod: attempt 1: worker started (warm)\n", b"attempt 1 trains\n",
           b"jaxtrain pod: attempt 1: worker killed by signal 9\n", b"later\n"]
    marker = "jaxtrain pod: attempt 1: worker "
    lines, started, end = supervisor.Supervisor._this_attempts(log[:3], False, marker)
    assert (lines, started, end) == ([], False, None)
    lines, started, end = supervisor.Supervisor._this_attempts(log[3:], False, marker)
    assert lines == [b"attempt 1 trains\n"] and started and end == "killed by signal 9"
    # A worker that died in the middle of a line: the holder's line follows that part.
    cut = [log[4], b"half a line" + log[6]]
    lines, started, end = supervisor.Supervisor._this_attempts(cut, False, marker)
    assert lines == [b"half a line\n"] and end == "killed by signal 9"


def test_a_kept_jobset_is_taken_over_only_by_an_attempt_of_the_same_pods():
    proc = _plan("-n", "2")
    jobset = json.loads(proc.stdout)
    container = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"][
        "containers"][0]

    def attempt(n: int, **changes: str) -> dict:
        text = json.dumps(jobset).replace(jobset["metadata"]["name"], f"run-x-{n}")
        made = json.loads(text)
        env = made["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"][
            "containers"][0].setdefault("env", [])
        env.append({"name": "JAXTRAIN_ATTEMPT", "value": str(n)})
        env.extend({"name": k, "value": v} for k, v in changes.items())
        return made

    assert container  # the plan has a worker container
    shape = supervisor.Supervisor._shape
    one, two = attempt(1), attempt(2)
    assert shape(one, "run-x-1") == shape(two, "run-x-2")
    assert shape(one, "run-x-1") != shape(attempt(2, FOO="bar"), "run-x-2")
