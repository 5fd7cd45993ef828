"""Each worker process (``python -m jaxtrain.worker``, started by the controller): joining the
run, ``jax.distributed``, restoring, running the training function, and the worker's side of
checkpoints (uploads to object storage, copies in host memory and from peers)."""
