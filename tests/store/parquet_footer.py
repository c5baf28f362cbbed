"""Read and rewrite the footer of a Parquet file (its Thrift compact-protocol ``FileMetaData``),
to make files whose metadata says what pyarrow never writes: row groups that lie about their
row counts. Fields are kept as ``[field id, type, value]`` lists, in order, so that a footer
read and written again is the same bytes."""

from __future__ import annotations

import struct

# compact protocol types: 1/2 bool, 3 byte, 4/5/6 i16/i32/i64, 7 double, 8 binary, 9 list, 10 set, 12 struct
_BOOLS, _INTS, _LISTS = (1, 2), (4, 5, 6), (9, 10)


def _varint(b: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = b[i]
        i += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, i


def _unzigzag(n: int) -> int:
    return (n >> 1) ^ -(n & 1)


def _put_varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _put_zigzag(n: int) -> bytes:
    return _put_varint((n << 1) ^ (n >> 63))


def _read_value(b: bytes, i: int, t: int):
    if t in _BOOLS:
        return t == 1, i
    if t == 3:
        return b[i], i + 1
    if t in _INTS:
        v, i = _varint(b, i)
        return _unzigzag(v), i
    if t == 7:
        return struct.unpack_from("<d", b, i)[0], i + 8
    if t == 8:
        n, i = _varint(b, i)
        return bytes(b[i:i + n]), i + n
    if t in _LISTS:
        head = b[i]
        i += 1
        n, et = head >> 4, head & 0x0F
        if n == 15:
            n, i = _varint(b, i)
        items = []
        for _ in range(n):
            if et in _BOOLS:
                items.append(b[i] == 1)
                i += 1
            else:
                v, i = _read_value(b, i, et)
                items.append(v)
        return (et, items), i
    if t == 12:
        return _read_struct(b, i)
    raise ValueError(f"Thrift compact type {t} is not read here")


def _read_struct(b: bytes, i: int):
    fields, fid = [], 0
    while True:
        head = b[i]
        i += 1
        if head == 0:
            return fields, i
        t, delta = head & 0x0F, head >> 4
        if delta:
            fid += delta
        else:
            v, i = _varint(b, i)
            fid = _unzigzag(v)
        v, i = _read_value(b, i, t)
        fields.append([fid, t, v])


def _write_value(t: int, v) -> bytes:
    if t in _BOOLS:
        return b""
    if t == 3:
        return bytes([v])
    if t in _INTS:
        return _put_zigzag(v)
    if t == 7:
        return struct.pack("<d", v)
    if t == 8:
        return _put_varint(len(v)) + v
    if t in _LISTS:
        et, items = v
        out = bytes([(len(items) << 4) | et]) if len(items) < 15 else bytes([0xF0 | et]) + _put_varint(len(items))
        for x in items:
            out += bytes([1 if x else 2]) if et in _BOOLS else _write_value(et, x)
        return out
    if t == 12:
        return _write_struct(v)
    raise ValueError(f"Thrift compact type {t} is not written here")


def _write_struct(fields) -> bytes:
    out, last = bytearray(), 0
    for fid, t, v in fields:
        if t in _BOOLS:
            t = 1 if v else 2
        delta = fid - last
        out += bytes([(delta << 4) | t]) if 0 < delta <= 15 else bytes([t]) + _put_zigzag(fid)
        out += _write_value(t, v)
        last = fid
    out.append(0)
    return bytes(out)


def field(fields, fid: int) -> list:
    """The ``[field id, type, value]`` of ``fid`` in a struct's ``fields``."""
    (found,) = [f for f in fields if f[0] == fid]
    return found


def read_footer(data: bytes):
    """The ``FileMetaData`` of the Parquet file ``data``, as a struct's fields."""
    n = struct.unpack("<I", data[-8:-4])[0]
    meta, end = _read_struct(data, len(data) - 8 - n)
    assert end == len(data) - 8
    return meta


def with_footer(data: bytes, meta) -> bytes:
    """The Parquet file ``data`` with its footer replaced by ``meta``."""
    n = struct.unpack("<I", data[-8:-4])[0]
    footer = _write_struct(meta)
    return data[:len(data) - 8 - n] + footer + struct.pack("<I", len(footer)) + b"PAR1"


def lying_row_counts(data: bytes, groups: dict[int, int], file_rows: int | None = None,
                     values: bool = False) -> bytes:
    """``data`` whose footer says row group ``g`` holds ``groups[g]`` rows (FileMetaData field
    4, RowGroup field 3), the file ``file_rows`` rows (field 3) where given, and with ``values``
    each column chunk of those groups as many values (ColumnMetaData field 5): the pages are
    those of the file as written."""
    meta = read_footer(data)
    row_groups = field(meta, 4)[2][1]
    for g, n in groups.items():
        field(row_groups[g], 3)[2] = n
        if values:
            for chunk in field(row_groups[g], 1)[2][1]:
                field(field(chunk, 3)[2], 5)[2] = n
    if file_rows is not None:
        field(meta, 3)[2] = file_rows
    return with_footer(data, meta)


def spy_decodes(monkeypatch) -> list[str]:
    """The list that every later ``pyarrow.parquet.ParquetFile.read`` / ``read_row_group`` call
    (a decode of a part's values) appends its method's name to."""
    import pyarrow.parquet as pq

    decoded: list[str] = []
    for name in ("read", "read_row_group"):
        def spy(self, *args, _read=getattr(pq.ParquetFile, name), _name=name, **kwargs):
            decoded.append(_name)
            return _read(self, *args, **kwargs)

        monkeypatch.setattr(pq.ParquetFile, name, spy)
    return decoded


def spy_footer_parses(monkeypatch) -> list[str]:
    """The list that every later ``pyarrow.parquet.ParquetFile`` made without a footer parsed
    before (no ``metadata=``; ``pq.read_metadata`` makes one too), one parse of a footer each,
    appends the name of its source's type to."""
    import pyarrow.parquet as pq

    parsed: list[str] = []

    def spy(self, source, *args, _init=pq.ParquetFile.__init__, metadata=None, **kwargs):
        if metadata is None:
            parsed.append(type(source).__name__)
        return _init(self, source, *args, metadata=metadata, **kwargs)

    monkeypatch.setattr(pq.ParquetFile, "__init__", spy)
    return parsed
