"""``python -m jaxtrain.worker``: the worker process (jaxtrain.worker.entry)."""

from jaxtrain.worker.entry import main

main()
