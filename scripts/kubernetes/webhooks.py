"""Writes the admission webhook configurations of the JobSet and Kueue controllers for the test
cluster.

    python webhooks.py CA_CERT OUT.json                        JobSet's
    python webhooks.py --kueue CA_CERT MANIFESTS.yaml OUT.json  Kueue's (needs PyYAML)

Their own manifests point the webhooks at an in-cluster Service; here the controllers run on the
node, so they point at https://127.0.0.1:9443 (JobSet) and :9444 (Kueue) and trust the test
cluster's CA. JobSet's paths and rules are those of its config/components/webhook/manifests.yaml;
Kueue's are read from its manifests (config/components/webhook/manifests.yaml), keeping the
webhooks of Kueue's own objects and of the integrations the cluster enables (batch/job, JobSet):
a webhook of a disabled integration has no handler, and would refuse every object it matches.
"""

import base64
import json
import sys

kueue = sys.argv[1:2] == ["--kueue"]
if kueue:
    ca_path, manifests, out = sys.argv[2:]
else:
    ca_path, out = sys.argv[1:]
with open(ca_path, "rb") as f:
    ca = base64.b64encode(f.read()).decode()


def webhook(name, path, group, version, resource, operations, pods=False):
    w = {"name": name, "admissionReviewVersions": ["v1"], "sideEffects": "None",
         "failurePolicy": "Fail",
         "clientConfig": {"url": f"https://127.0.0.1:9443{path}", "caBundle": ca},
         "rules": [{"apiGroups": [group], "apiVersions": [version], "operations": operations,
                    "resources": [resource]}]}
    if pods:  # only the pods of JobSets
        w["objectSelector"] = {"matchExpressions": [
            {"key": "jobset.sigs.k8s.io/jobset-name", "operator": "Exists"}]}
    return w


jobset = ("jobset.x-k8s.io", "v1alpha2", "jobsets")
configurations = [
    {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingWebhookConfiguration",
     "metadata": {"name": "jobset-mutating-webhook-configuration"},
     "webhooks": [webhook("mjobset.kb.io", "/mutate-jobset-x-k8s-io-v1alpha2-jobset", *jobset,
                          ["CREATE"]),
                  webhook("mpod.kb.io", "/mutate--v1-pod", "", "v1", "pods", ["CREATE"], True)]},
    {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingWebhookConfiguration",
     "metadata": {"name": "jobset-validating-webhook-configuration"},
     "webhooks": [webhook("vjobset.kb.io", "/validate-jobset-x-k8s-io-v1alpha2-jobset", *jobset,
                          ["CREATE", "UPDATE"]),
                  webhook("vpod.kb.io", "/validate--v1-pod", "", "v1", "pods", ["CREATE"], True)]},
]
if kueue:
    import yaml

    kept = {"kueue.x-k8s.io", "batch", "jobset.x-k8s.io"}
    with open(manifests) as f:
        configurations = [c for c in yaml.safe_load_all(f) if c]
    for c in configurations:
        c["metadata"]["name"] = "kueue-" + c["metadata"]["name"]
        c["webhooks"] = [w for w in c["webhooks"]
                         if {g for r in w["rules"] for g in r["apiGroups"]} <= kept]
        for w in c["webhooks"]:
            path = w["clientConfig"]["service"]["path"]
            w["clientConfig"] = {"url": f"https://127.0.0.1:9444{path}", "caBundle": ca}
with open(out, "w") as f:
    json.dump({"apiVersion": "v1", "kind": "List", "items": configurations}, f, indent=1)
