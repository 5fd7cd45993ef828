"""``python -m jaxtrain.hosts relay [ssh options] TARGET COMMAND`` (jaxtrain.hosts.join)."""

from jaxtrain.hosts.join import main

main()
