"""``python -m jaxtrain.kubernetes supervise REQUEST``: one attempt's supervisor
(jaxtrain.kubernetes.supervisor), started by the C++ Kubernetes launcher."""

import sys

from jaxtrain.kubernetes.supervisor import main

sys.exit(main(sys.argv[1:]))
