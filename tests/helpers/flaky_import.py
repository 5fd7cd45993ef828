"""A module whose first import fails: it stands for a worker that cannot start (a missing
dependency on one host, a shared filesystem not yet mounted). The marker file makes later imports
succeed."""

import os

_MARKER = os.environ["FLAKY_IMPORT_MARKER"]
if not os.path.exists(_MARKER):
    open(_MARKER, "w").close()
    raise ImportError("flaky_import: the first import fails on purpose")


def train():
    from jaxtrain import report

    report({"started": 1})
