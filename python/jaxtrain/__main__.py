"""``python -m jaxtrain``: the ``jaxtrain`` command (see jaxtrain.cli)."""

import sys

from jaxtrain.cli import main

sys.exit(main())
