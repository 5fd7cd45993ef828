"""Kubernetes (docs/kubernetes.md): the glue between the C++ Kubernetes launcher and the API
server, on the official ``kubernetes`` client (``pip install jaxtrain[kubernetes]``), one module
per program that uses it:

* ``launch`` — the driver at ``fit()``: the launch options, before anything starts;
* ``supervisor`` — one attempt's supervisor process (``python -m jaxtrain.kubernetes supervise``);
* ``pod`` — a worker pod's first process when restarts are in place (``hold``), and the
  supervisor's way into it (``activate``);
* ``submit`` — ``jaxtrain submit``, ``status`` and ``logs``: a driver pod in the cluster;
* ``api`` — what they share: the API server, the names of what a run creates, the permissions.
"""
