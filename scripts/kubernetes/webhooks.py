"""Writes the JobSet controller's admission webhook configurations for the test cluster.

    python webhooks.py CA_CERT OUT.json

JobSet's own manifests point the webhooks at an in-cluster Service; here the controller runs on
the node, so they point at https://127.0.0.1:9443 and trust the test cluster's CA. The paths and
rules are those of JobSet's config/components/webhook/manifests.yaml.
"""

import base64
import json
import sys

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
with open(out, "w") as f:
    json.dump({"apiVersion": "v1", "kind": "List", "items": configurations}, f, indent=1)
