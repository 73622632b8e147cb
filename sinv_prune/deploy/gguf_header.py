"""A few key/value fields of a GGUF file's header, read without parsing the rest.

``gguf.GGUFReader`` builds a numpy view of every value and every tensor's info: for SmolLM2's
file (49,152 tokens, 48,900 merges) that took 14 s here, for three scalar fields a model card
needs. This reads the header in order with ``struct`` on a memory map, skipping the arrays, and
stops at the last field asked for. Little-endian GGUF versions 2 and 3 (what llama.cpp and the
``gguf`` package write).
"""

from __future__ import annotations

import mmap
import os
import struct

from gguf import GGUF_MAGIC, GGUFValueType

#: struct format of each fixed-size value type.
_FORMATS = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H", GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i", GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q", GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}  # fmt: skip


def header_fields(path: str | os.PathLike, keys: set[str]) -> dict[str, str | int | float | bool]:
    """The scalar (string, number, bool) values of ``keys`` in the header of the GGUF file ``path``.

    Keys the file lacks, or whose value is an array, are left out. ``ValueError`` (one line) for a file
    that is not a GGUF file this reads.
    """
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        if len(data) < 24 or struct.unpack_from("<I", data, 0)[0] != GGUF_MAGIC:
            raise ValueError(f"{path}: not a GGUF file")
        version, _, count = struct.unpack_from("<IQQ", data, 4)
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {version} (this reads little-endian versions 2 and 3)")
        out: dict[str, str | int | float | bool] = {}
        offset = 24
        for _ in range(count):
            if len(out) == len(keys):
                break
            key, offset = _string(data, offset)
            kind = GGUFValueType(struct.unpack_from("<I", data, offset)[0])
            if key in keys and kind != GGUFValueType.ARRAY:
                out[key], offset = _value(data, offset + 4, kind)
            else:
                offset = _skip(data, offset + 4, kind)
        return out


def _string(data, offset: int) -> tuple[str, int]:
    (length,) = struct.unpack_from("<Q", data, offset)
    start = offset + 8
    return bytes(data[start : start + length]).decode("utf-8"), start + length


def _value(data, offset: int, kind: GGUFValueType):
    if kind == GGUFValueType.STRING:
        return _string(data, offset)
    fmt = _FORMATS[kind]
    return struct.unpack_from(fmt, data, offset)[0], offset + struct.calcsize(fmt)


def _skip(data, offset: int, kind: GGUFValueType) -> int:
    """The offset after a value of type ``kind`` at ``offset``."""
    if kind == GGUFValueType.STRING:
        return offset + 8 + struct.unpack_from("<Q", data, offset)[0]
    if kind != GGUFValueType.ARRAY:
        return offset + struct.calcsize(_FORMATS[kind])
    item, length = struct.unpack_from("<IQ", data, offset)
    offset += 12
    item = GGUFValueType(item)
    if item in _FORMATS:
        return offset + length * struct.calcsize(_FORMATS[item])
    for _ in range(length):  # strings (or nested arrays): each carries its own length
        offset = _skip(data, offset, item)
    return offset
