"""The ``emdlm`` console script: :func:`emdlm.cli.main`, and one line instead of a traceback
when the command's own packages (the ``[train]`` extra: typer, pyyaml, ...) are missing."""

from __future__ import annotations

import sys

from emdlm._extras import MissingExtraError, missing_extra


def main() -> None:
    """Entry point of ``emdlm`` (pyproject.toml ``[project.scripts]``)."""
    try:
        from emdlm.cli import main as cli_main
    except ModuleNotFoundError as err:
        problem = missing_extra(err, "the emdlm command")
        if not isinstance(problem, MissingExtraError):
            raise
        print(f"error: {problem}", file=sys.stderr)
        sys.exit(2)
    cli_main()
