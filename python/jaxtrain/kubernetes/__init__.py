"""Kubernetes (docs/kubernetes.md): the glue between the C++ Kubernetes launcher and the API
server, on the official ``kubernetes`` client (``pip install jaxtrain[kubernetes]``)."""
