"""The launchers: one module each, holding what the driver and the worker know of the system
that starts the workers. The engine's side of each is in src/launch/ under the same name
(``slurm.py`` here, ``slurm_launcher.{h,cc}`` there).

=============  ==================================================  ===========================
launcher       starts the workers                                  chosen when
=============  ==================================================  ===========================
local          as processes of this host                           nothing else applies
ssh            over ssh on listed hosts (and TPU VMs)              JAXTRAIN_HOSTFILE, ..._HOSTS
slurm          as one srun step in an allocation                   inside an allocation, or
                                                                   JAXTRAIN_LAUNCHER=slurm
kubernetes     as the pods of a JobSet                             JAXTRAIN_LAUNCHER=kubernetes
=============  ==================================================  ===========================

``choose()`` decides once per fit() (the rules are the engine's, launch::ChooseLauncher); the
driver then asks the Launcher it got and never compares names.
"""

from __future__ import annotations

from jaxtrain import _core
from jaxtrain.launch import kubernetes, local, slurm, ssh
from jaxtrain.launch.base import Launcher


def choose() -> Launcher:
    """The launcher of a run started from this environment (docs/configuration.md)."""
    return by_name(_core.choose_launcher())


def by_name(name: str) -> Launcher:
    kinds: dict[str, type[Launcher]] = {
        "local": local.Local, "ssh": ssh.Ssh, "slurm": slurm.Slurm,
        "kubernetes": kubernetes.Kubernetes}
    try:
        return kinds[name]()
    except KeyError:
        raise ValueError(f"launcher {name!r} is not one of {', '.join(kinds)}") from None


__all__ = ["Launcher", "by_name", "choose", "kubernetes", "local", "slurm", "ssh"]
