"""Config files: a YAML file (or a packaged config's name) read into a raw mapping, then
overridden, built and validated into a :class:`RunConfig`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from emdlm.config.coerce import build_config
from emdlm.config.errors import ConfigError
from emdlm.config.overrides import apply_overrides
from emdlm.config.packaged import packaged_run_config
from emdlm.config.schema import RunConfig
from emdlm.yaml_io import RefusedYAMLError, safe_load_unique


def read_yaml_file(path: Path) -> Any:
    """The YAML document in ``path``; ConfigError naming the file for invalid YAML or a key given
    twice in one mapping, or a document past the size limits of
    :func:`emdlm.yaml_io.safe_load_unique`."""
    try:
        return safe_load_unique(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: not UTF-8 text (byte {err.start}: {err.reason})") from err
    except RefusedYAMLError as err:  # a key given twice, a bomb of aliases
        raise ConfigError(f"{path}: {err}") from err
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from err


def read_yaml_mapping(path: Path, *, empty_ok: bool = False) -> dict[str, Any]:
    """The mapping at the top of the YAML file ``path`` (:func:`read_yaml_file`); ConfigError
    naming the file when it is anything else (an empty file: ``{}`` when ``empty_ok``)."""
    data = read_yaml_file(path)
    if data is None and empty_ok:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping, got {type(data).__name__}")
    return data


def load_config_dict(path: str | Path | None) -> dict[str, Any]:
    """Raw mapping from a YAML file (a packaged config name like "arithmetic_ntil" also works)."""
    if path is None:
        return {}
    p = Path(path)
    if not p.exists():
        packaged = packaged_run_config(str(path))
        if packaged is not None:
            p = packaged
        else:
            raise ConfigError(f"config file not found: {path}")
    return read_yaml_mapping(p, empty_ok=True)


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Load a YAML config (or the defaults), apply ``key=value`` overrides, validate."""
    return build_config(apply_overrides(load_config_dict(path), overrides or []))
