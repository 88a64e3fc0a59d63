"""Malformed GGUF files: each is refused as a `GGUFError` that says what is wrong, and says
"is it truncated?" only where the file ends early. Headers are written byte by byte here
(models/gguf_file.py's docstring has the layout), so each test damages one thing."""

from __future__ import annotations

import struct

import pytest

from models import gguf
from models.gguf_file import MAX_ARRAY_DEPTH, GGUFFile

_U32, _U64, _STRING, _ARRAY = 4, 10, 8, 9


def _string(text: str) -> bytes:
    data = text.encode()
    return struct.pack("<Q", len(data)) + data


def _header(fields: list[bytes], tensors: list[bytes]) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(fields)) + b"".join(fields + tensors)


def _u32_field(key: str, value: int) -> bytes:
    return _string(key) + struct.pack("<II", _U32, value)


def _tensor_info(name: str, dims: tuple[int, ...], type_id: int = 0, offset: int = 0) -> bytes:
    out = _string(name) + struct.pack("<I", len(dims))
    return out + b"".join(struct.pack("<Q", d) for d in dims) + struct.pack("<IQ", type_id, offset)


def _refused(path, match: str, truncated: bool) -> str:
    with pytest.raises(gguf.GGUFError, match=match) as info:
        gguf.quant_config(path)
    message = str(info.value)
    assert ("is it truncated?" in message) == truncated, message
    return message


def test_a_well_formed_header_reads(tmp_path):
    """The control: the writer above makes a file the reader takes (so each refusal below
    is the damage's doing)."""
    path = tmp_path / "ok.gguf"
    body = _header([_u32_field("general.alignment", 32)], [_tensor_info("t", (4, 2))])
    path.write_bytes(body + bytes(-len(body) % 32) + bytes(4 * 2 * 4))
    f = GGUFFile(path)
    assert f.field("general.alignment") == 32
    assert [(t.name, t.shape) for t in f.tensors] == [("t", (4, 2))]


def test_an_empty_file_is_refused_as_empty(tmp_path):
    path = tmp_path / "empty.gguf"
    path.write_bytes(b"")
    _refused(path, "empty", truncated=True)


def test_a_dimension_past_int64_is_refused(tmp_path):
    path = tmp_path / "huge.gguf"
    path.write_bytes(_header([], [_tensor_info("t", (2**63 + 5, 4))]) + bytes(64))
    message = _refused(path, "too large", truncated=False)
    assert "'t'" in message


def test_arrays_nested_without_end_are_refused(tmp_path):
    """An array of arrays of arrays ...: a bounded walk, not a RecursionError."""
    nested = b"".join(struct.pack("<IQ", _ARRAY, 1) for _ in range(5000))
    path = tmp_path / "nested.gguf"
    path.write_bytes(_header([_string("x") + struct.pack("<I", _ARRAY) + nested], []))
    _refused(path, f"nested more than {MAX_ARRAY_DEPTH} deep", truncated=False)


def test_arrays_nested_within_the_limit_read(tmp_path):
    depth = MAX_ARRAY_DEPTH - 1
    value = struct.pack("<IQ", _U32, 1) + struct.pack("<I", 7)
    for _ in range(depth - 1):
        value = struct.pack("<IQ", _ARRAY, 1) + value
    path = tmp_path / "nested_ok.gguf"
    path.write_bytes(_header([_string("x") + struct.pack("<I", _ARRAY) + value], []))
    items = GGUFFile(path).field("x").items()
    for _ in range(depth - 1):
        (items,) = items
        items = items.items()
    assert items == [7]


@pytest.mark.parametrize("alignment", [0, 12])
def test_an_alignment_that_is_not_a_positive_multiple_of_8_is_refused(tmp_path, alignment):
    path = tmp_path / "align.gguf"
    path.write_bytes(_header([_u32_field("general.alignment", alignment)], []) + bytes(64))
    _refused(path, f"general.alignment is {alignment}", truncated=False)


def test_a_header_cut_short_says_truncated(tmp_path):
    path = tmp_path / "cut.gguf"
    path.write_bytes(_header([_u32_field("general.alignment", 32)], [])[:-3])
    _refused(path, "ends early", truncated=True)
