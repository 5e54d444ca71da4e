"""The configs shipped with emdlm: one folder, ``emdlm/configs``, holding run configs
(``arithmetic_ntil.yaml``), launcher configs (``accelerate_*.yaml``) and experiments
(``experiments/*.yaml``), found by name so that commands work without the repository."""

from __future__ import annotations

from pathlib import Path

from emdlm.config.errors import ConfigError, did_you_mean

#: The installed folder of the packaged configs (the one place it is looked up).
PACKAGED_FOLDER = Path(__file__).resolve().parent.parent / "configs"


def packaged_run_config(name: str) -> Path | None:
    """The packaged run or launcher config ``<name>.yaml``, or None when there is none."""
    path = PACKAGED_FOLDER / f"{name}.yaml"
    return path if path.is_file() else None


def packaged_experiment(name: str) -> Path | None:
    """The packaged experiment ``experiments/<name>.yaml``, or None when there is none."""
    path = PACKAGED_FOLDER / "experiments" / f"{name}.yaml"
    return path if path.is_file() else None


def packaged_config_path(name: str) -> Path:
    """The installed file of a packaged config: a run config (``arithmetic_ntil``), a launcher
    config (``accelerate_ddp_cpu``) or an experiment (``experiments/...`` or its bare name), so
    that commands work without the repository (``emdlm config-path NAME``)."""
    stem = name.removesuffix(".yaml")
    found = packaged_run_config(stem) or packaged_experiment(stem)
    if found is not None:
        return found
    names = sorted(p.stem for p in (*PACKAGED_FOLDER.glob("*.yaml"),
                                    *PACKAGED_FOLDER.glob("experiments/*.yaml")))
    raise ConfigError(f"no packaged config {name!r}{did_you_mean(stem, names)}; packaged: "
                      f"{', '.join(names)}")


def packaged_configs() -> list[Path]:
    """The run configs shipped with emdlm (accelerate launcher configs excluded)."""
    return sorted(p for p in PACKAGED_FOLDER.glob("*.yaml")
                  if not p.name.startswith("accelerate_"))


def packaged_experiments() -> list[Path]:
    """The experiment configs shipped with emdlm (``emdlm/configs/experiments/*.yaml``)."""
    return sorted((PACKAGED_FOLDER / "experiments").glob("*.yaml"))
