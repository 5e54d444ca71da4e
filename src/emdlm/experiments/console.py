"""The console of a grid: each line a cell prints (training log lines, the world-size line,
warnings, transformers' logging) starts with the cell's ``[<task>/<variant>/seed<k>]``, as the
workers' lines interleave on one terminal."""

from __future__ import annotations

import contextlib
import io
import logging
import sys
from collections.abc import Iterator
from typing import Any


class PrefixedLines(io.TextIOBase):
    """A text stream that writes every line it is given to ``stream`` with ``prefix`` in front
    (a line ends at "\n" or "\r"): a cell's console output, told apart from other cells'."""

    def __init__(self, stream: Any, prefix: str) -> None:
        self._stream = stream
        self._prefix = prefix
        self._at_line_start = True

    def write(self, text: str) -> int:
        parts = []
        for piece in text.splitlines(keepends=True):
            if self._at_line_start:
                parts.append(self._prefix)
            parts.append(piece)
            self._at_line_start = piece.endswith(("\n", "\r"))
        self._stream.write("".join(parts))
        return len(text)

    def flush(self) -> None:
        self._stream.flush()

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return bool(getattr(self._stream, "isatty", lambda: False)())

    def fileno(self) -> int:
        return int(self._stream.fileno())

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return str(getattr(self._stream, "encoding", None) or "utf-8")


@contextlib.contextmanager
def cell_console(key: str) -> Iterator[None]:
    """While a cell runs, every line it prints to ``sys.stdout`` / ``sys.stderr`` (the training
    log lines, the world-size line, warnings) starts with ``[<task>/<variant>/seed<k>] ``: the
    workers' output interleaves on one console."""
    prefix = f"[{key}] "
    out, err = PrefixedLines(sys.stdout, prefix), PrefixedLines(sys.stderr, prefix)
    # logging handlers (transformers' own among them) hold the stream they were made with:
    # point those on the console streams at the prefixed ones for the cell, then back
    swapped = _console_log_handlers({id(sys.stdout): out, id(sys.stderr): err})
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            yield
    finally:
        for handler, stream in swapped:
            handler.setStream(stream)
        with contextlib.suppress(Exception):
            out.flush()
            err.flush()


def _console_log_handlers(
    targets: dict[int, Any],
) -> list[tuple[logging.StreamHandler[Any], Any]]:
    """Point every logging ``StreamHandler`` (not a file handler) that writes to one of the
    streams keyed by id in ``targets`` at its replacement; returns (handler, old stream) pairs
    to restore."""
    loggers = [logging.getLogger()] + [
        lg for lg in logging.Logger.manager.loggerDict.values() if isinstance(lg, logging.Logger)
    ]
    swapped = []
    for handler in {h for lg in loggers for h in lg.handlers}:
        if (isinstance(handler, logging.StreamHandler)
                and not isinstance(handler, logging.FileHandler)
                # a handler whose stream is a property follows sys.stderr by itself
                and not isinstance(getattr(type(handler), "stream", None), property)
                and id(handler.stream) in targets):
            swapped.append((handler, handler.setStream(targets[id(handler.stream)])))
    return swapped


def set_hf_progress_bars(enabled: bool) -> bool:
    """Turn transformers' own progress bars (weights loading / saving) on or off; returns
    the previous state."""
    from transformers.utils import logging as hf_logging

    previous = hf_logging.is_progress_bar_enabled()
    if enabled:
        hf_logging.enable_progress_bar()
    else:
        hf_logging.disable_progress_bar()
    return previous


