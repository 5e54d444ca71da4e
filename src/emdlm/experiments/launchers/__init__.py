"""How ``emdlm experiment`` runs the cells of a grid: the launcher registry.

``experiment.launcher`` names one of :data:`LAUNCHERS` (``local``, the default: worker
processes on this machine; ``ray``: Ray tasks; ``slurm``: a SLURM job array through submitit,
or submitit's local jobs), with its options. Whichever runs them, every cell goes through
:func:`emdlm.experiments.runner.run_cell` into its own folder (lock, resume from the newest
checkpoint, done record), and the report is built from the folders on the submitting machine.
"""

from __future__ import annotations

from typing import Any

from emdlm.config import ConfigError
from emdlm.experiments.launchers.base import CLUSTER_EXTRA, Launcher
from emdlm.experiments.launchers.local import LocalLauncher
from emdlm.experiments.launchers.ray import RayLauncher
from emdlm.experiments.launchers.slurm import SlurmLauncher

LAUNCHERS: dict[str, type[Launcher]] = {
    launcher.name: launcher for launcher in (LocalLauncher, RayLauncher, SlurmLauncher)
}


def make_launcher(mapping: dict[str, Any]) -> Launcher:
    """The launcher that ``experiment.launcher`` (``{"name": ..., <options>}``) describes;
    ConfigError naming an unknown launcher or a bad option. Imports nothing of Ray / submitit
    (see :meth:`Launcher.check_installed`)."""
    options = dict(mapping)
    name = options.pop("name")
    if name not in LAUNCHERS:
        raise ConfigError(f"experiment.launcher={name!r} is not a launcher; known: "
                          f"{', '.join(LAUNCHERS)}")
    return LAUNCHERS[name].from_options(options)


__all__ = ["CLUSTER_EXTRA", "LAUNCHERS", "Launcher", "make_launcher"]
