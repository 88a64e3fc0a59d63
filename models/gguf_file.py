"""A GGUF file's header read directly: its key-value fields and its tensor table, each
tensor's data a numpy view of the mapped file (the layout gguf-py's `GGUFReader` gives).

gguf-py's reader makes a numpy view for every part of every field, the tokenizer's ~49k
token strings included: ~5 s for the default model's file each time it is opened, and a
GGUF load opened it twice. This walks the same header with `struct` (~0.1 s), skipping
array fields' items until one is asked for.

Layout (GGUF v2 and v3, little-endian): magic `GGUF`, version u32, tensor count u64,
field count u64; each field: key (u64 length + UTF-8), value type u32, value (an array
is item type u32, count u64, items); each tensor: name, dims count u32, dims u64 (the
fastest-varying first), block type u32, data offset u64; the data starts at the next
multiple of `general.alignment` (32 unless set).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}  # fmt: skip
_STRING, _ARRAY = 8, 9
_TYPED = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8,
          "I16": np.int16, "I32": np.int32, "I64": np.int64}  # fmt: skip


# Nesting of array fields a reader follows: GGUF writers nest at most once (arrays of
# arrays are rare); deeper is a damaged or hostile header, not a deep Python stack.
MAX_ARRAY_DEPTH = 16
# The largest tensor this reader maps: numpy counts bytes in int64.
MAX_TENSOR_VALUES = 2**62


class GGUFFormatError(ValueError):
    """A file that is not a well-formed GGUF. `truncated`: the header or a tensor ran past
    the end of the file (a partial download or copy is the likely cause)."""

    def __init__(self, message: str, truncated: bool = False):
        super().__init__(message)
        self.truncated = truncated


@dataclass(frozen=True)
class GGUFArray:
    """An array field, read only when asked: `items()`."""

    file: GGUFFile
    item_type: int
    count: int
    offset: int
    depth: int = 1  # arrays around (and including) this one

    def items(self) -> list[Any]:
        return self.file._array_items(self)


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF's order: the fastest-varying dimension first
    data: np.ndarray  # typed for float and int types, else uint8 [rows..., bytes a row]


class GGUFFile:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        with open(self.path, "rb") as f:
            if self.path.stat().st_size == 0:  # mmap refuses an empty file
                raise GGUFFormatError("the file is empty (0 bytes)", truncated=True)
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._buf = memoryview(self._map)  # slices are cheap; numpy memmap slices are not
        self._at = 0
        try:
            self._read_header()
        except GGUFFormatError:
            raise
        except struct.error as e:  # a fixed-size read past the end
            raise GGUFFormatError(f"the header ends early ({e})", truncated=True) from e
        except (IndexError, UnicodeDecodeError, ValueError, OverflowError) as e:
            raise GGUFFormatError(f"{type(e).__name__}: {e}") from e

    def field(self, key: str) -> Any:
        """A field's value (numbers, strings, a GGUFArray), None when absent."""
        return self.fields.get(key)

    def _read_header(self) -> None:
        if bytes(self._buf[:4]) != b"GGUF":
            raise GGUFFormatError("no GGUF magic at the start of the file")
        self._at = 4
        version = self._scalar("<I")
        if version not in (2, 3):
            raise GGUFFormatError(f"GGUF version {version} (2 and 3 are read)")
        n_tensors, n_fields = self._scalar("<Q"), self._scalar("<Q")
        self.fields: dict[str, Any] = {}
        for _ in range(n_fields):
            key = self._string()
            self.fields[key] = self._value(self._scalar("<I"))
        infos = [self._tensor_info() for _ in range(n_tensors)]
        alignment = self.fields.get("general.alignment", 32)
        if not isinstance(alignment, int) or alignment <= 0 or alignment % 8:
            raise GGUFFormatError(
                f"general.alignment is {alignment!r}: the GGUF spec wants a positive "
                "multiple of 8"
            )
        start = -(-self._at // alignment) * alignment
        self.tensors = [self._tensor(*info, start) for info in infos]

    def _scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self._buf, self._at)
        self._at += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        n = self._scalar("<Q")
        if self._at + n > len(self._buf):
            raise GGUFFormatError("a string runs past the end of the file", truncated=True)
        text = bytes(self._buf[self._at : self._at + n]).decode("utf-8")
        self._at += n
        return text

    def _value(self, kind: int, depth: int = 0) -> Any:
        if kind in _SCALARS:
            return self._scalar(_SCALARS[kind])
        if kind == _STRING:
            return self._string()
        if kind != _ARRAY:
            raise GGUFFormatError(f"unknown field type {kind}")
        if depth >= MAX_ARRAY_DEPTH:
            raise GGUFFormatError(f"arrays nested more than {MAX_ARRAY_DEPTH} deep")
        item_type, count = self._scalar("<I"), self._scalar("<Q")
        array = GGUFArray(self, item_type, count, self._at, depth + 1)
        if item_type in _SCALARS:
            self._at += count * struct.calcsize(_SCALARS[item_type])
            if self._at > len(self._buf):
                raise GGUFFormatError("an array runs past the end of the file", truncated=True)
        else:  # strings or nested arrays: walked to find the end
            for _ in range(count):
                self._value(item_type, depth + 1)
        return array

    def _array_items(self, array: GGUFArray) -> list[Any]:
        at, self._at = self._at, array.offset
        try:
            return [self._value(array.item_type, array.depth) for _ in range(array.count)]
        finally:
            self._at = at

    def _tensor_info(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self._string()
        dims = tuple(self._scalar("<Q") for _ in range(self._scalar("<I")))
        return name, dims, self._scalar("<I"), self._scalar("<Q")

    def _tensor(self, name: str, dims: tuple, type_id: int, offset: int, start: int):
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        try:
            tensor_type = GGMLQuantizationType(type_id)
        except ValueError as e:
            raise GGUFFormatError(f"tensor {name!r} has unknown block type {type_id}") from e
        block, type_size = GGML_QUANT_SIZES[tensor_type]
        rows = tuple(reversed(dims))  # numpy's order
        values = 1
        for d in dims:
            values *= d  # Python ints: a product past int64 is caught, not wrapped
        if values > MAX_TENSOR_VALUES:
            raise GGUFFormatError(f"tensor {name!r} has dimensions {dims}: too large to hold")
        if dims and dims[0] % block:
            raise GGUFFormatError(f"tensor {name!r}: {dims[0]} values a row, blocks of {block}")
        n_bytes = values // block * type_size
        begin = start + offset
        if begin + n_bytes > len(self._buf):
            raise GGUFFormatError(f"tensor {name!r} runs past the end of the file", truncated=True)
        raw = np.frombuffer(self._map, dtype=np.uint8, count=n_bytes, offset=begin)
        typed = _TYPED.get(tensor_type.name)
        if typed is not None:
            data = raw.view(typed).reshape(rows)
        else:
            data = raw.reshape(*rows[:-1], rows[-1] // block * type_size)
        return GGUFTensor(name, tensor_type, dims, data)
