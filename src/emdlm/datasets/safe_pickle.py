"""A restricted unpickler for pickles of builtin containers and scalars (the RefCOCO refs files).

Such a file is a list of dicts of str / int / float / list; pickled at any protocol 0..5 it needs
no global. The opcodes are walked first (nothing is called or allocated beyond the file's size),
then loaded by an unpickler that admits no global but ``set`` / ``frozenset``. The unpickler
follows the "Restricting Globals" recipe of Python's :mod:`pickle` documentation
(https://docs.python.org/3/library/pickle.html#restricting-globals).
"""

from __future__ import annotations

import functools
import io
import pickle
import pickletools
from pathlib import Path
from typing import Any

from emdlm.config import ConfigError
from emdlm.datasets.reading import PathLike

# A refs file is a list of dicts of str / int / float / list: pickled at any protocol 0..5 it
# needs no global at all. set / frozenset (protocols 0..3 pickle them as a call) are the only
# callables admitted, and the items they build are capped by the file's size (see
# _RestrictedUnpickler). Everything else that calls or mutates objects is refused up front.
_SET_TYPES: dict[str, type] = {"set": set, "frozenset": frozenset}
_PICKLE_OPCODES = frozenset(
    (
        "PROTO", "FRAME", "STOP", "MARK", "POP", "POP_MARK", "DUP", "NONE", "NEWTRUE",
        "NEWFALSE", "INT", "BININT", "BININT1", "BININT2", "LONG", "LONG1", "LONG4", "FLOAT",
        "BINFLOAT", "STRING", "BINSTRING", "SHORT_BINSTRING", "UNICODE", "BINUNICODE",
        "SHORT_BINUNICODE", "BINUNICODE8", "BINBYTES", "SHORT_BINBYTES", "BINBYTES8",
        "BYTEARRAY8", "EMPTY_LIST", "APPEND", "APPENDS", "LIST", "EMPTY_TUPLE", "TUPLE",
        "TUPLE1", "TUPLE2", "TUPLE3", "EMPTY_DICT", "DICT", "SETITEM", "SETITEMS", "EMPTY_SET",
        "ADDITEMS", "FROZENSET", "GET", "BINGET", "LONG_BINGET", "PUT", "BINPUT", "LONG_BINPUT",
        "MEMOIZE", "GLOBAL", "STACK_GLOBAL", "REDUCE",
    )
)
_OPCODES_BY_CODE = {op.code.encode("latin-1"): op for op in pickletools.opcodes}
_PY2_MODULES = {"__builtin__": "builtins"}

class _RestrictedUnpickler(pickle.Unpickler):
    """Admits no global but ``set`` / ``frozenset``, and those build at most as many items in
    all as the file has bytes: a few bytes that call ``set`` on one big list again and again
    would otherwise allocate without bound. Any other global (``os.system``, ``bytearray``
    whose ``bytearray(10**9)`` takes 1 GB from a 33-byte file) is refused."""

    def __init__(self, data: bytes) -> None:
        # Python 2 pickles (the RefCOCO refs files): byte strings decoded as UTF-8
        super().__init__(io.BytesIO(data), encoding="utf-8", errors="replace")
        self._items_left = len(data)

    def find_class(self, module: str, name: str) -> Any:
        # Python 2 pickles (and protocol <= 2) name the builtins module "__builtin__".
        if _PY2_MODULES.get(module, module) == "builtins" and name in _SET_TYPES:
            return functools.partial(self._build_set, _SET_TYPES[name])
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed")

    def _build_set(self, kind: type, items: Any = ()) -> Any:
        if not isinstance(items, (list, tuple)):
            raise pickle.UnpicklingError(
                f"{kind.__name__}() of {type(items).__name__} is not allowed"
            )
        self._items_left -= len(items)
        if self._items_left < 0:
            raise pickle.UnpicklingError(
                "set/frozenset calls build more items than the file has bytes"
            )
        return kind(items)


def _check_opcodes(data: bytes) -> None:
    """UnpicklingError for an opcode outside :data:`_PICKLE_OPCODES` (object building, BUILD,
    extensions, persistent ids), an unknown opcode, or an argument that runs past the end of
    the file (ValueError from ``pickletools``' readers). Nothing is called here, and nothing
    larger than the file is allocated: this walks the opcodes before the unpickler runs."""
    stream = io.BytesIO(data)
    while True:
        pos = stream.tell()
        code = stream.read(1)
        op = _OPCODES_BY_CODE.get(code)
        if op is None:
            raise pickle.UnpicklingError(
                f"truncated: the file ends at byte {pos} before its STOP opcode" if not code
                else f"unknown opcode {code!r} at byte {pos}"
            )
        if op.name not in _PICKLE_OPCODES:
            raise pickle.UnpicklingError(
                f"opcode {op.name} at byte {pos} is not allowed (a refs file holds only lists, "
                "dicts, strings and numbers)"
            )
        if op.name == "STRING":  # Python 2 str: pickletools decodes it as ASCII, Python 2
            if not stream.readline().endswith(b"\n"):  # escaped UTF-8 bytes are not
                raise pickle.UnpicklingError(f"STRING at byte {pos} is truncated")
        elif op.arg is not None:
            op.arg.reader(stream)
        if op.name == "STOP":
            return


def safe_load_pickle(path: PathLike) -> Any:
    """Load a pickle of builtin containers and scalars (dict, list, str, int, ...) only.

    Python 2 pickles (the RefCOCO refs files) load too: their byte strings are decoded as UTF-8
    (invalid bytes replaced). The opcodes are checked first (:func:`_check_opcodes`), then
    loaded by :class:`_RestrictedUnpickler`. Every failure (a forbidden global or opcode, a
    truncated or corrupt file, running out of memory) is a one-line ConfigError naming the file.
    """
    try:
        data = Path(path).read_bytes()
    except OSError as err:
        raise ConfigError(f"{path}: cannot read: {err.strerror or err}") from err
    try:
        _check_opcodes(data)
        return _RestrictedUnpickler(data).load()
    except Exception as err:  # every way a hostile file can fail, MemoryError included
        reason = " ".join(str(err).split()) or type(err).__name__
        raise ConfigError(f"{path}: refused or unreadable pickle: {reason}") from err
