"""Runs started by the same command on every host (docs/hosts.md): the joins at host 0, the agent
servers, the relays that stand in for ssh, and the secure channel they (and the peer copies of
checkpoints) use."""
