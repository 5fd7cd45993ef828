"""The driver: the user's process that calls ``JaxTrainer.fit()``. It plans the run, chooses the
launcher, hosts the C++ controller, mirrors a remote run directory, serves the metrics endpoint and
runs the validation of checkpoints. Workers never import this package."""
