"""``python -m jaxtrain.kubernetes supervise REQUEST``: one attempt's supervisor
(jaxtrain.kubernetes.supervisor), started by the C++ Kubernetes launcher; ``hold`` and
``activate``: a worker pod's first process and the supervisor's way into it
(jaxtrain.kubernetes.pod), which import nothing of the Kubernetes client."""

import sys

if sys.argv[1:2] in (["hold"], ["activate"]):
    from jaxtrain.kubernetes import pod

    sys.exit(getattr(pod, sys.argv[1])(sys.argv[2:]))

from jaxtrain.kubernetes.supervisor import main

sys.exit(main(sys.argv[1:]))
