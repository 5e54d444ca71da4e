"""The RefCOCO refs pickle is untrusted input: hand-made hostile pickles (a 33-byte bytearray
bomb, forbidden globals, BUILD on a list, set() amplification, truncated or corrupt files) are
one-line ConfigErrors naming the file; nothing runs and nothing large is allocated. Realistic refs
data loads at every pickle protocol."""

from __future__ import annotations

import pickle
import pickletools
import resource
from pathlib import Path

import pytest

from emdlm.config import ConfigError
from emdlm.datasets.grounding import read_refcoco
from emdlm.datasets.safe_pickle import safe_load_pickle

REFS = [
    {
        "ref_id": 0, "ann_id": 10, "image_id": 1, "split": "val", "category_id": 1,
        "file_name": "COCO_train2014_000000000001_10.jpg", "sent_ids": [0, 1],
        "sentences": [
            {"sent": "man on the left", "raw": "Man on the left.", "sent_id": 0,
             "tokens": ["man", "on", "the", "left"]},
            {"sent": "guy in red", "raw": "guy in red", "sent_id": 1, "tokens": ["guy"]},
        ],
    },
    {"ref_id": 1, "ann_id": 11, "image_id": 2, "split": "testA", "category_id": 1,
     "sentences": [{"sent": "left half", "raw": "left half", "sent_id": 2, "tokens": []}],
     "score": 0.75, "big": 10**30, "none": None, "flag": True},
]

# Hand-made pickles. Each would, under plain pickle.load, allocate, mutate or fail oddly.
HOSTILE = {
    # bytearray(1_000_000_000) through REDUCE: 1 GB from 33 bytes (protocol 2, py2 name)
    "bytearray_bomb": b"\x80\x02c__builtin__\nbytearray\nJ\x00\xca\x9a;\x85R.",
    # bytes(10**15): a MemoryError under plain pickle
    "bytes_memory_error": b"\x80\x02c__builtin__\nbytes\n\x8a\x07\x00\x80\xc6\xa4~\x8d\x03\x85R.",
    # globals that refs files never need, by GLOBAL and by STACK_GLOBAL (protocol 4)
    "global_int": b"cbuiltins\nint\n(V7\ntR.",
    "stack_global_str": b"\x80\x04\x8c\x08builtins\x8c\x03str\x93\x8c\x017\x85R.",
    # BUILD on a list (plain pickle: AttributeError from inside the unpickler)
    "build_on_list": b"\x80\x02]}b.",
    # SETITEM on a list, APPEND on a dict (plain pickle: IndexError / AttributeError)
    "setitem_on_list": b"\x80\x02]K\x01K\x02s.",
    "append_on_dict": b"\x80\x02}K\x01a.",
    # INST / OBJ build objects by calling a class
    "inst": b"(i__builtin__\nset\n.",
}


def _write(tmp_path: Path, data: bytes, name: str = "refs(unc).p") -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    return path


def _refused(path: Path) -> str:
    with pytest.raises(ConfigError) as err:
        safe_load_pickle(path)
    message = str(err.value)
    assert message.startswith(f"{path}: refused or unreadable pickle: ")
    assert "\n" not in message
    return message


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_pickle_is_refused_without_allocating(tmp_path: Path, name: str) -> None:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    message = _refused(_write(tmp_path, HOSTILE[name]))
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert grown_mib < 50, f"peak memory grew by {grown_mib:.0f} MiB"
    assert "is not allowed" in message or name in ("setitem_on_list", "append_on_dict")


def test_bytearray_bomb_names_the_global(tmp_path: Path) -> None:
    message = _refused(_write(tmp_path, HOSTILE["bytearray_bomb"]))
    assert "global __builtin__.bytearray is not allowed" in message
    assert len(HOSTILE["bytearray_bomb"]) == 33


def test_set_calls_cannot_amplify_a_small_file(tmp_path: Path) -> None:
    """set(big_list) repeated from the memo costs ~6 bytes a call but builds len(big_list)
    items each time: the items all set() / frozenset() calls build are capped by the file size
    (here 1000 calls x 1000 items from an ~8 KB file)."""
    # a list L of 1000 ints kept in memo 1, set kept in memo 2, then [set(L)] * 1000 calls
    head = b"\x80\x02](" + b"".join(b"K" + bytes([i % 256]) for i in range(1000)) + b"eq\x010"
    calls = b"](c__builtin__\nset\nq\x020" + b"h\x02h\x01\x85R" * 1000 + b"e."
    data = head + calls
    path = _write(tmp_path, data)
    assert len(data) < 10_000
    assert "set/frozenset calls build more items than the file has bytes" in _refused(path)
    # within the cap, sets still load (protocols 0..3 pickle them as set([...]))
    fine = [{1, 2}, frozenset({3}), [{4}] * 3]
    assert safe_load_pickle(_write(tmp_path, pickle.dumps(fine, protocol=2), "ok.p")) == fine


# Already one-line errors before this fix (kept as pins of the whole contract): truncated or
# corrupt files and a top level that is not a list.
@pytest.mark.parametrize(
    "data",
    [b"", b"\x80\x02](K\x01K\x02", b"\x80\x02X\xff\x00\x00\x00abc", b"\x80\x02\xff.",
     b"\x80\x04\x95\xff\xff\xff\xff\xff\xff\x00\x00N."],
    ids=["empty", "truncated_list", "truncated_string", "unknown_opcode", "frame_past_end"],
)
def test_truncated_or_corrupt_pickle_is_one_line(tmp_path: Path, data: bytes) -> None:
    _refused(_write(tmp_path, data))


def test_missing_refs_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"refs\(unc\)\.p: cannot read"):
        safe_load_pickle(tmp_path / "refs(unc).p")


@pytest.mark.parametrize("top", [{"refs": []}, "refs", 5], ids=["dict", "str", "int"])
def test_top_level_not_a_list_is_refused_by_the_reader(tmp_path: Path, top: object) -> None:
    refs = _write(tmp_path, pickle.dumps(top, protocol=2))
    with pytest.raises(ConfigError, match=r"refs\(unc\)\.p: expected a list of refs"):
        read_refcoco(refs, tmp_path / "instances.json", tmp_path)


@pytest.mark.parametrize(
    "data",
    [b"(lp0\n(dp1\nS'sent'\np2\nS'caf\\xc3\\xa9'\np3\nsS'ok'\np4\nI01\nsS'n'\np5\n"
     b"L10000000000000000000L\nsS'x'\np6\nF0.5\nsa.",
     b"\x80\x02]q\x00}q\x01(U\x04sentq\x02U\x05caf\xc3\xa9q\x03U\x02okq\x04\x88ua."],
    ids=["protocol0", "protocol2"],
)
def test_python2_refs_with_non_ascii_byte_strings_load(tmp_path: Path, data: bytes) -> None:
    """Python 2 pickles (how lichengunc/refer wrote the refs files) hold sentences as byte
    strings, escaped at protocol 0; the opcode check must not choke on non-ASCII ones (as
    ``pickletools.genops`` does) and the loader decodes them as UTF-8."""
    got = safe_load_pickle(_write(tmp_path, data))
    assert got[0]["sent"] == "café" and got[0]["ok"] is True


@pytest.mark.parametrize("protocol", range(6))
def test_realistic_refs_load_at_every_protocol_without_globals(
    tmp_path: Path, protocol: int
) -> None:
    """Real refs files (lists of dicts of str / int / float / list) need no global at any
    protocol, which is why no constructor but set / frozenset is admitted; bytes(...) and
    bytearray(...) calls, which the old allowlist admitted, are refused."""
    data = pickle.dumps(REFS, protocol=protocol)
    ops = {op.name for op, _, _ in pickletools.genops(data)}
    assert not ops & {"GLOBAL", "STACK_GLOBAL", "REDUCE", "BUILD", "NEWOBJ", "INST", "OBJ"}
    assert safe_load_pickle(_write(tmp_path, data)) == REFS
    small_bytes_call = b"c__builtin__\nbytes\n(K\x03tR."
    assert "global __builtin__.bytes is not allowed" in _refused(
        _write(tmp_path, small_bytes_call, "call.p"))
