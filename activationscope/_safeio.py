"""Reading the files of a local store safely, without torch (a base module).

Shared by the store (``store/_backend.py``, ``store/_decode.py``, ``store/_validate.py``) and
by the tasks of Dask workers (:func:`read_shard`, used by ``analysis/dask.to_dask``), which
must not import torch (a worker's memory is for the data). Imports numpy, numcodecs and
google_crc32c (zarr dependencies) only, and those on first use.

Everything here follows store/FORMAT.md section 9: only regular files inside the store are
opened (non-blocking, ``fstat`` of the opened descriptor), sizes are checked before reading,
a shard's index crc32c before its entries are used, each chunk's crc32c against its manifest
record before it is decoded, and a decoded size against the chunk's before decoding into it.
"""

from __future__ import annotations

import errno
import os
import stat
import threading
from concurrent.futures import BrokenExecutor, Future, ThreadPoolExecutor
from typing import Any

from .errors import StoreCorruptError, StoreError

#: The fix named when a file of a store may not be read by this process (a store of another user,
#: an archive unpacked with the permissions of its maker): the store is not damaged.
READ_PERMISSION_FIX = (" (this process may not read it; the store is not damaged: reading a store needs read "
                       "permission on all its files and folders, e.g. its owner runs `chmod -R a+rX` on its folder, "
                       "or read a copy made by someone who may read it)")

#: Cap of a metadata document (root / array ``zarr.json``, manifest) read from a store.
MAX_JSON_BYTES = 64 << 20
#: Cap of a row-table part or a reduction script file read whole.
MAX_FILE_BYTES = 4 << 30

FIX = "restore the store from an intact copy or capture it again (`activationscope verify STORE` lists every damaged file)"

_ZSTD_MAGIC = 0xFD2FB528
#: Shard index entry of a chunk that was never written (Zarr sharding: 2**64 - 1).
_MISSING = 2**64 - 1


#: What :data:`FIX` says after the advice that a damaged chunk's own cause may already give.
_VERIFY_HINT = "`activationscope verify STORE` lists every damaged file"


def corrupt(store: Any, what: str, fix: str = FIX) -> StoreCorruptError:
    """``StoreCorruptError("store <path>: <what>; <fix>")``. Where ``what`` already advises to
    restore the store or capture it again (a damaged chunk's cause), :data:`FIX` adds only its
    pointer to ``verify``, so the advice is given once."""
    if fix == FIX and "restore the store from an intact copy" in what:
        fix = _VERIFY_HINT
    return StoreCorruptError(f"store {str(store)!r}: {what}; {fix}")


def crc32c(data: Any) -> int:
    """CRC-32C (Castagnoli) of a bytes-like object with google_crc32c (no torch, no native
    extension: what a Dask worker has)."""
    import google_crc32c

    return int(google_crc32c.value(data if isinstance(data, bytes) else bytes(data)))


def _decoded_bytes(arr: Any) -> int:
    """Bytes an Arrow array holds once its dictionary-encoded strings and binaries are decoded
    (each index counts its value's length, and an offset), nested lists, maps and structs
    included; an array with no dictionary counts its buffers as they are."""
    import pyarrow as pa
    import pyarrow.compute as pc

    t = arr.type
    if pa.types.is_dictionary(t):
        if not (pa.types.is_string(t.value_type) or pa.types.is_binary(t.value_type)
                or pa.types.is_large_string(t.value_type) or pa.types.is_large_binary(t.value_type)):
            return arr.nbytes
        taken = pc.sum(pc.take(pc.binary_length(arr.dictionary), arr.indices)).as_py()
        return int(taken or 0) + 8 * len(arr)
    if pa.types.is_struct(t):
        return sum(_decoded_bytes(arr.field(i)) for i in range(t.num_fields)) + len(arr) // 8 + 1
    if (pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_map(t) or pa.types.is_fixed_size_list(t)
            or pa.types.is_list_view(t) or pa.types.is_large_list_view(t)):
        return _decoded_bytes(arr.values) + 8 * len(arr)
    return arr.nbytes


def read_parquet_part(raw: bytes, where: Any, key: str, max_decoded: int = MAX_FILE_BYTES,
                      columns: Any = None, schemas: list | None = None, each: Any = None,
                      max_rows: int | None = None, metadata: Any = None) -> Any:
    """A row-table part (Parquet bytes, read whole and checked already) as a ``pyarrow.Table``,
    read on this thread, whose decoded size is bounded before it is decoded.

    ``columns``: the names of the columns to decode (the others are not: Parquet column
    projection), those of them the part has, in the part's order; None: every column.
    ``schemas``: a list the part's full Arrow schema (every column's, read from the Parquet
    footer, none decoded) is appended to.
    ``each``: a function of a ``pyarrow.Table`` returning one (checks, and the columns kept):
    called with each row group of the part as it is decoded, the part is the concatenation of
    what it returns (one chunk per row group). The columns read only for its checks are then
    never decoded for the whole part at once, nor the part's columns combined into one array
    (a part of 20 million token rows read for two columns held its three decoded columns and
    a combined copy of each: 760 MB for 320 MB kept). None: the part is read whole (row group
    by row group where it holds strings inside lists or structs, which Arrow reads as
    dictionaries a row group at a time only).
    ``max_rows``: the most rows the part may hold (the rows its table's metadata has left for
    it); None: no bound but the footer's own.
    ``metadata``: the part's footer as the caller parsed it already from ``raw`` (a
    ``pyarrow.parquet.FileMetaData``, e.g. ``pq.read_metadata``'s), checked here as it is and
    not parsed again; None: parsed here. The footer is parsed once per call either way: the
    checks read it, and the readers that decode the part are given it.

    The footer's row counts are checked before a value is decoded (Parquet allocates each
    column of a row group by the row count its footer gives): every row group holds 0 rows or
    more, each of its columns at least as many values, the file as many rows as its row groups
    together, and at most ``max_rows`` -- a footer that says a row group of a few rows holds
    2**31 never has 16 GB allocated for it.

    A part may hold at most ``max_decoded`` bytes once decoded (4 GiB, as a part's file): its
    strings and binaries, at any depth, are first read as dictionaries (no larger than the
    file), their decoded size added up, and the part refused above the bound -- a small file
    of dictionary-encoded long strings (one 4 MiB value taken by every row: 200 KB on disk,
    400 MB decoded) never expands in memory. Then they are decoded to the file's own types
    (read again as those where Arrow casts no dictionary to them: views of strings or lists).

    The bytes are copied into an Arrow-owned buffer and read through ``ParquetFile`` without
    threads: a reader over a Python object (``io.BytesIO``, a bytes-backed buffer) whose last
    reference is dropped by one of pyarrow's pool threads at interpreter exit takes the GIL
    there and aborts the process ("terminate called without an active exception",
    apache/arrow#34314).

    Raises
    ------
    StoreCorruptError
        The bytes are no readable Parquet file, their footer's row counts disagree (or are more
        than ``max_rows``), or they decode to more than ``max_decoded`` bytes; the message
        names ``key``.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        buf = pa.allocate_buffer(len(raw))
        memoryview(buf).cast("B")[:] = raw
        plain = pq.ParquetFile(pa.BufferReader(buf), metadata=metadata)  # (the footer, parsed once)
        meta = plain.metadata
        schema, target = plain.schema, plain.schema_arrow  # (the types the file's columns read as)
        if schemas is not None:
            schemas.append(target)
        names = None
        if columns is not None:
            wanted = set(columns)
            names = [name for name in target.names if name in wanted]
            target = pa.schema([target.field(name) for name in names])
        strings = [schema.column(i).path for i in range(len(schema)) if schema.column(i).physical_type == "BYTE_ARRAY"]
        reader = pq.ParquetFile(pa.BufferReader(buf), metadata=meta, read_dictionary=strings) if strings else plain
        # (strings inside lists or structs, read as dictionaries, one per row group: Arrow reads
        # them a row group at a time only, "Nested data conversions not implemented for chunked
        # array outputs")
        nested = any("." in path for path in strings)
        by_group = (each is not None or nested) and reader.num_row_groups >= 2
        groups = list(range(reader.num_row_groups)) if by_group else [None]
        lie = _footer_row_count_problem(meta, max_rows)
    except Exception as e:  # noqa: BLE001 - pyarrow raises ArrowInvalid / OSError / ...
        raise corrupt(where, f"row-table part {key!r} is not a readable Parquet file ({type(e).__name__}: {e})") from None
    if lie is not None:
        raise corrupt(where, f"row-table part {key!r} {lie}")
    n = 0  # (the decoded bytes of the row groups read so far)
    done = []
    for group in groups:
        try:
            if group is None:
                table = reader.read(columns=names, use_threads=False)
            else:
                table = reader.read_row_group(group, columns=names, use_threads=False)
        except Exception as e:  # noqa: BLE001 - pyarrow raises ArrowInvalid / OSError / ...
            raise corrupt(where, f"row-table part {key!r} is not a readable Parquet file ({type(e).__name__}: {e})"
                          ) from None
        for i, col in enumerate(table.columns):  # (a column the file keeps as a dictionary stays one)
            kept = pa.types.is_dictionary(target.field(i).type)
            n += col.nbytes if kept else sum(_decoded_bytes(chunk) for chunk in col.chunks)
        if n > max_decoded:
            raise corrupt(where, f"row-table part {key!r} decodes to {n} bytes ({len(raw)} in the file), more than "
                                 f"the {max_decoded} a part may hold")
        if strings:
            table = _as_file_types(table, target, buf, meta, names, group, where, key)
        done.append(table if each is None else each(table))
        del table
    if len(done) == 1:
        return done[0]
    if not done[0].column_names:  # (Arrow counts no rows of tables of no column when it concatenates them)
        return pa.table({"rows": pa.nulls(sum(t.num_rows for t in done))}).select([])
    return pa.concat_tables(done)


def _footer_row_count_problem(meta: Any, max_rows: int | None) -> str | None:
    """What is wrong with the row counts of a Parquet footer ``meta``, as a phrase after
    "part 'KEY' " (None: nothing): see :func:`read_parquet_part`."""
    total = 0
    for i in range(meta.num_row_groups):
        group = meta.row_group(i)
        n = group.num_rows
        if n < 0:
            return f"says in its footer that its row group {i} holds {n} rows"
        for j in range(group.num_columns):
            if group.column(j).num_values < n:
                return (f"says in its footer that its row group {i} holds {n} rows, but its column "
                        f"{group.column(j).path_in_schema!r} {group.column(j).num_values} values")
        total += n
    if total != meta.num_rows:
        return f"says in its footer that it holds {meta.num_rows} rows, but its row groups {total}"
    if max_rows is not None and total > max_rows:
        return (f"says in its footer that it holds {total} rows, more than the {max_rows} rows the "
                "table's metadata (n_rows) leaves for it")
    return None


def _as_file_types(table: Any, target: Any, buf: Any, meta: Any, names: Any, group: int | None, where: Any,
                   key: str) -> Any:
    """``table`` (of :func:`read_parquet_part`, its strings read as dictionaries) with the
    file's own types ``target`` (row group ``group`` of the part in ``buf``; None: all;
    ``meta``: the part's footer, parsed already)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return table.cast(target)
    except Exception:  # noqa: BLE001 - a type Arrow casts no dictionary to (string_view, list_view, ...)
        pass
    try:  # (its decoded size is bounded above: read again as the file's own types)
        plain = pq.ParquetFile(pa.BufferReader(buf), metadata=meta)
        if group is None:
            return plain.read(columns=names, use_threads=False)
        return plain.read_row_group(group, columns=names, use_threads=False)
    except Exception as e:  # noqa: BLE001
        raise corrupt(where, f"row-table part {key!r} is not a readable Parquet file ({type(e).__name__}: {e})") from None


#: The columns every part of a row table holds (FORMAT.md section 4): a writer fills them for
#: every row. A store committed from rank stores adds ``rank`` (section 10).
REQUIRED_COLUMNS = {"sample": ("sample_id", "batch"), "token": ("sample_id", "pos", "batch")}


def required_columns(kind: str, by_rank: bool = False) -> tuple[str, ...]:
    """The columns every part of row table ``kind`` holds (``rank`` too when ``by_rank``)."""
    return REQUIRED_COLUMNS[kind] + (("rank",) if by_rank else ())


def row_part_problem(schema: Any, kind: str, by_rank: bool = False, table: Any = None) -> str | None:
    """What is wrong with the required columns of a part of row table ``kind`` (FORMAT.md
    section 4, section 9 rule 15), as a phrase after "part 'KEY' " (None: nothing).

    ``schema``: the part's full Arrow schema (its Parquet footer's). Each required column is
    there once; ``sample_id`` holds one value a row (any type a writer stores ids as: ints,
    floats, strings, bytes, bools; not lists or structs); ``pos``, ``batch`` (and ``rank``) are
    integers. ``table``: the part's decoded columns, whose ``pos`` (and ``batch``, ``rank``),
    where decoded, must hold no nulls. A part without its ``sample_id`` column would read
    as rows of null ids next to the other parts' ids (Arrow fills a missing column with
    nulls), and a resume would append after them."""
    import pyarrow as pa

    required = required_columns(kind, by_rank)
    listed = " and ".join([", ".join(required[:-1]), required[-1]])
    names = list(schema.names)
    for c in required:
        if c not in names:
            return (f"has no {c!r} column (every part of the {kind} row table holds {listed}: FORMAT.md section 4), "
                    f"so its rows would read with null {c} values")
        if names.count(c) > 1:
            return f"has {names.count(c)} columns named {c!r} (one each of {listed})"
        typ = schema.field(c).type
        if c == "sample_id":
            if pa.types.is_nested(typ) or pa.types.is_dictionary(typ) and pa.types.is_nested(typ.value_type):
                return f"has a 'sample_id' column of {typ}, where a sample id is one value a row (an int or a string)"
        elif not pa.types.is_integer(typ):
            return f"has a {c!r} column of {typ}, where the format says integers (FORMAT.md section 4)"
    if table is not None:
        for c in required:
            if c != "sample_id" and c in table.column_names and table.column(c).null_count:
                return (f"has {table.column(c).null_count} nulls in its {c!r} column, which a writer fills for every "
                        "row")
    return None


def batch_order(table: Any, by_rank: bool) -> tuple[str, tuple] | None:
    """Where a row table (with a ``batch`` column) breaks the order a writer appends its
    forwards in (FORMAT.md section 5, section 9 rule 15), per ``rank`` when ``by_rank`` (a
    store committed from rank stores, section 10) and it has a ``rank`` column.

    Returns ``("type", (column, type, null_count))`` for a ``batch`` (or that ``rank``) column
    that is not integers without nulls, ``("back", (row, from, to))`` at the first row (of its
    rank) where ``batch`` goes back, None when the table is in order."""
    import numpy as np
    import pyarrow as pa

    names = table.column_names
    cols = {c: table.column(c) for c in ("batch", "rank") if c in names and (c == "batch" or by_rank)}
    for c, col in cols.items():
        if not pa.types.is_integer(col.type) or col.null_count:
            return "type", (c, col.type, col.null_count)
    if "rank" not in cols:
        # one part's chunk at a time, never the whole column as one array (and its np.diff): a
        # token table of tens of millions of rows made two copies of its batch column per read
        start, last = 0, None
        for chunk in cols["batch"].chunks:
            b = chunk.to_numpy(zero_copy_only=False)
            if not len(b):
                continue
            if last is not None and b[0] < last:
                return "back", (start, int(last), int(b[0]))
            back = b[1:] < b[:-1]
            if back.any():
                i = int(np.argmax(back))
                return "back", (start + i + 1, int(b[i]), int(b[i + 1]))
            start, last = start + len(b), b[-1]
        return None
    batch = cols["batch"].to_numpy().astype(np.int64, copy=False)
    rank = cols["rank"].to_numpy().astype(np.int64, copy=False)
    order = np.argsort(rank, kind="stable")
    rank, batch = rank[order], batch[order]
    back = (np.diff(batch) < 0) & (np.diff(rank) == 0)
    if back.any():
        i = int(np.flatnonzero(back)[0])
        return "back", (i + 1, int(batch[i]), int(batch[i + 1]))
    return None


def _kind(mode: int) -> str:
    return ("a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode)
            else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
            else "a socket" if stat.S_ISSOCK(mode) else "not a regular file")


def open_regular(path: str | os.PathLike, *, store: Any, key: str) -> tuple[int, int] | None:
    """``(fd, size)`` of the regular file at a local path of a store; None when absent.

    The one way a local file of a store (metadata, manifest, shard, row-table part, script,
    lock) is opened for reading: non-blocking (``O_NONBLOCK``: a FIFO in its place never
    blocks the open), then ``fstat`` of the opened descriptor (no race with a swap of the
    file), and anything but a regular file is refused. Size caps are the caller's (on the
    returned size, before reading). The caller closes ``fd``.

    Raises
    ------
    StoreCorruptError
        A FIFO, directory, device or socket in the file's place (``key`` named).
    StoreError
        Any other failure to open it (permissions, too many links, ...).
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except IsADirectoryError:
        raise corrupt(store, f"{key!r} must be a regular file, got a directory") from None
    except OSError as e:
        raise StoreError(f"store {str(store)!r}: cannot open {key!r}: {e.strerror or e}"
                         + (READ_PERMISSION_FIX if e.errno in (errno.EACCES, errno.EPERM) else "")) from e
    try:
        st = os.fstat(fd)
    except OSError as e:
        os.close(fd)
        raise StoreError(f"store {str(store)!r}: cannot stat {key!r}: {e.strerror or e}") from e
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise corrupt(store, f"{key!r} must be a regular file, got {_kind(st.st_mode)}")
    return fd, st.st_size


def read_regular(path: str | os.PathLike, *, store: Any, key: str, max_bytes: int | None = MAX_JSON_BYTES,
                 start: int = 0, length: int | None = None) -> bytes | None:
    """Bytes of the regular file at a local path of a store (:func:`open_regular`); None when absent.

    The whole file (refused when larger than ``max_bytes``), or ``length`` bytes from
    ``start`` (fewer at its end; ``None``: to the end, capped by ``max_bytes``).
    """
    opened = open_regular(path, store=store, key=key)
    if opened is None:
        return None
    fd, size = opened
    try:
        start = min(max(0, start), size)
        n = size - start if length is None else max(0, min(length, size - start))
        if length is None and max_bytes is not None and n > max_bytes:
            raise corrupt(store, f"{key!r} holds {size} bytes, more than the {max_bytes} such a file may hold")
        if n <= 1 << 30:  # one read, one buffer (the common case; no copy of a join)
            first = os.pread(fd, n, start)
            if len(first) == n or not first:
                return first
            chunks, at, left = [first], start + len(first), n - len(first)
        else:
            chunks, at, left = [], start, n
        while left > 0:
            b = os.pread(fd, min(left, 1 << 30), at)
            if not b:
                break
            chunks.append(b)
            at += len(b)
            left -= len(b)
        return b"".join(chunks)
    finally:
        os.close(fd)



def decoded_size(codec: dict, data: bytes | memoryview) -> int | None:
    """Bytes the encoded chunk ``data`` decodes to, from the codec's frame header.

    Zstd: the frame content size (RFC 8878, section 3.1.1.1); None when the frame does not
    record it. Blosc: ``nbytes`` of the blosc header. Raises ValueError on a malformed header.
    """
    name = codec.get("name")
    if name == "zstd":
        if len(data) < 6 or int.from_bytes(data[0:4], "little") != _ZSTD_MAGIC:
            raise ValueError("not a zstd frame (bad magic number)")
        fhd = data[4]
        fcs_flag, single_segment, dict_flag = fhd >> 6, (fhd >> 5) & 1, fhd & 3
        pos = 5 + (0 if single_segment else 1) + (0, 1, 2, 4)[dict_flag]
        size_bytes = (1 if single_segment else 0, 2, 4, 8)[fcs_flag]
        if size_bytes == 0:
            return None
        if len(data) < pos + size_bytes:
            raise ValueError("zstd frame header is truncated")
        value = int.from_bytes(data[pos:pos + size_bytes], "little")
        return value + 256 if size_bytes == 2 else value
    if name == "blosc":
        if len(data) < 16:
            raise ValueError("blosc header is truncated")
        # c-blosc reads as many input bytes as the header's cbytes says (it is not given the
        # buffer's length): another value than the chunk's length would read past its end
        cbytes = int.from_bytes(data[12:16], "little")
        if cbytes != len(data):
            raise ValueError(f"blosc header says {cbytes} compressed bytes, the chunk holds {len(data)}")
        return int.from_bytes(data[4:8], "little")
    raise ValueError(f"unknown codec {name!r}")


def decode_into(codec: dict, dec: Any, data: bytes, out: np.ndarray, where: str) -> None:
    """Decode ``data`` into ``out`` (a uint8 array of exactly the chunk's size), or raise
    StoreCorruptError naming ``where`` when the chunk does not decode to that size."""
    try:
        n = decoded_size(codec, data)
    except ValueError as e:
        raise StoreCorruptError(f"{where} does not decode: {e}; run `activationscope verify` on the store") from None
    if n is not None and n != out.nbytes:
        raise StoreCorruptError(
            f"{where} decodes to {n} bytes, expected {out.nbytes}; run `activationscope verify` on the store"
        )
    if n == 0:  # an empty chunk (rows of a feature shape with a 0 dimension): nothing to decode into
        return
    try:
        if n is None:  # a frame that does not say its size could decode to any size: refused
            raise StoreCorruptError(f"{where} is a zstd frame without its content size (activationscope and zarr "
                                    "write it); run `activationscope verify` on the store")
        dec.decode(data, out=out)
    except StoreCorruptError:
        raise
    except Exception as e:  # noqa: BLE001 (numcodecs raises RuntimeError / ValueError)
        raise StoreCorruptError(f"{where} does not decode: {e}; run `activationscope verify` on the store") from None


def _decoder(codec: dict) -> Any:
    """A numcodecs decoder of the Zarr codec document ``codec`` (validated by the reader)."""
    import numcodecs

    conf = codec.get("configuration") or {}
    if codec.get("name") == "zstd":
        return numcodecs.Zstd(level=int(conf.get("level", 0)))
    if codec.get("name") == "blosc":
        return numcodecs.Blosc(cname=conf.get("cname", "lz4"))
    raise ValueError(f"unknown codec {codec.get('name')!r}")


def _inside(real: str, root_real: str) -> bool:
    return real == root_real or real.startswith(root_real.rstrip(os.sep) + os.sep)


def _run(root: str) -> tuple | None:
    """(run_id, created) of the root document of the store at ``root``, None when unreadable."""
    import json

    try:
        raw = read_regular(os.path.join(root, "zarr.json"), store=root, key="zarr.json")
        attrs = json.loads(raw or b"null")["attributes"]["activationscope"]
        return (attrs.get("run_id"), attrs.get("created"))
    except (StoreError, ValueError, KeyError, TypeError, AttributeError):
        return None


def read_shard(root: str, spec: dict) -> Any:
    """The committed rows of one shard of a local store, as a new numpy array, checked as the
    reader checks them (the task of a Dask worker: no torch).

    Parameters
    ----------
    root : str
        The store's folder.
    spec : dict
        ``key`` (the shard's key), ``rows`` (its committed rows), ``chunk_rows``, ``n_chunks``
        (chunks per shard), ``row_bytes``, ``codec`` (the Zarr codec document or None),
        ``chunks`` (``{slot: (nbytes, crc32c)}`` of the manifest), ``dtype`` (numpy dtype of
        the stored data type), ``feature_shape``, ``run`` ((run_id, created) of the root
        document when the task was made), ``first_row`` (for messages), and optionally
        ``file_bytes`` (the shard file's size its manifest records) and ``manifest`` (that
        manifest's key), for the message of a file of another size.

    Returns
    -------
    numpy.ndarray, (rows, *feature_shape), ``dtype``

    Raises
    ------
    StoreCorruptError
        The shard is missing, not a regular file inside the store, truncated, its index
        damaged, a committed chunk missing, out of range, of another size than its manifest
        record or not matching its crc32c, or not decoding to its size; the message names the
        shard file.
    StoreError
        The store was replaced since the task was made (another run in its place), or is
        no longer there (removed or moved).
    """
    try:
        return _read_shard(root, spec)
    except StoreCorruptError:
        now = _run(root)
        if now != tuple(spec["run"]):
            raise _changed_since_graph(root, now) from None
        raise


def _changed_since_graph(where: str, now: tuple | None) -> StoreError:
    """The error of a Dask task whose store is no longer the one its graph was made of:
    another run in its place, or no readable store there (removed or moved; a rank store
    removed by the commit of its multi-rank store)."""
    what = ("was replaced since the Dask graph was made (another run is there now)" if now is not None else
            "was removed or moved since the Dask graph was made (no readable store is there now; a rank store is "
            "removed once its multi-rank store is committed, which then holds its rows)")
    return StoreError(f"store at {where!r} {what}; make the graph again (to_dask) of the store there is")


def _read_shard(root: str, spec: dict) -> Any:
    key = spec["key"]
    path = os.path.join(root, key)
    real = os.path.realpath(path)
    if not _inside(real, os.path.realpath(root)):
        raise corrupt(root, f"{key!r} resolves to {real!r}, outside the store (a symlink leaving the store)")
    opened = open_regular(path, store=root, key=key)
    if opened is None:
        raise corrupt(root, f"shard {key!r} is missing; its rows {spec['first_row']}.. are committed")
    fd, size = opened
    try:
        return _checked_shard(root, spec, size, lambda n, off: os.pread(fd, n, off))
    finally:
        os.close(fd)


def read_remote_shard(zarr_store: Any, label: str, spec: dict) -> Any:
    """:func:`read_shard` for a store that is not a local folder (object storage, fsspec):
    the shard's index and each committed chunk are fetched by byte range through the zarr
    ``Store`` and checked exactly as for a local store before anything is decoded.

    Parameters
    ----------
    zarr_store : zarr.abc.store.Store
        The store's zarr ``Store`` (its keys are the store's keys).
    label : str
        The store, as named in messages.
    spec : dict
        As for :func:`read_shard`.

    Returns
    -------
    numpy.ndarray, (rows, *feature_shape), ``dtype``

    Raises
    ------
    StoreCorruptError, StoreError
        As :func:`read_shard` (a remote read that fails: :class:`StoreError`).
    """
    try:
        return _read_remote_shard(zarr_store, label, spec)
    except StoreCorruptError:
        now = _remote_run(zarr_store)
        if now != tuple(spec["run"]):
            raise _changed_since_graph(label, now) from None
        raise


class _ExitSafeExecutor(ThreadPoolExecutor):
    """A ThreadPoolExecutor whose calls refused once the interpreter began its exit run in the
    calling thread (zarr's event loop thread) instead of failing."""

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Future:
        try:
            return super().submit(fn, *args, **kwargs)
        except BrokenExecutor:
            raise
        except RuntimeError:  # "cannot schedule new futures after interpreter shutdown"
            fut: Future = Future()
            fut.set_running_or_notify_cancel()
            try:
                fut.set_result(fn(*args, **kwargs))
            except BaseException as e:  # noqa: BLE001 - handed to the awaiting coroutine
                fut.set_exception(e)
            return fut


_zarr_lock = threading.Lock()


def _after_fork_in_child() -> None:
    global _zarr_lock
    _zarr_lock = threading.Lock()  # (another thread of the parent may have held it at the fork)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def exit_safe_zarr() -> None:
    """Give zarr's event loop a default executor that keeps working once the interpreter began
    its exit; call before each use of zarr's synchronous API.

    zarr runs local file reads and fsspec's synchronous file systems (``memory://``) through
    ``asyncio.to_thread``, on its loop's default executor. From the moment the main thread
    returns, ``concurrent.futures`` refuses new work (its exit hook runs before the threads still
    running are joined), so a thread that went on opening or reading a store, or capturing into
    an object store, failed with "cannot schedule new futures after interpreter shutdown" (a
    compressed array's document was even reported damaged). Those calls now run in zarr's loop
    thread itself.
    """
    try:
        from zarr.core import sync as zsync

        loop = zsync._get_loop()  # (zarr's own loop; a zarr without it: nothing to do)
    except (ImportError, AttributeError):
        return
    current = getattr(loop, "_default_executor", None)
    if isinstance(current, _ExitSafeExecutor):
        return
    with _zarr_lock:
        current = getattr(loop, "_default_executor", None)
        if current is None or type(current) is ThreadPoolExecutor:  # (never one of another kind)
            # as many threads as zarr's own (its ``threading.max_workers`` setting), when it made one
            workers = getattr(current, "_max_workers", None)
            loop.set_default_executor(_ExitSafeExecutor(max_workers=workers, thread_name_prefix="activationscope-zarr"))


def zarr_sync(coro: Any) -> Any:
    """``zarr.core.sync.sync(coro)``, working also once the interpreter began its exit
    (:func:`exit_safe_zarr`)."""
    from zarr.core.sync import sync

    exit_safe_zarr()
    return sync(coro)


def _remote_get(zarr_store: Any, label: str, key: str, byte_range: Any = None) -> bytes | None:
    from zarr.core.buffer import default_buffer_prototype

    try:
        buf = zarr_sync(zarr_store.get(key, prototype=default_buffer_prototype(), byte_range=byte_range))
    except (FileNotFoundError, KeyError):
        return None
    except OSError as e:
        raise StoreError(f"reading {key!r} from {label} failed: {e}") from e
    return None if buf is None else buf.to_bytes()


def _remote_run(zarr_store: Any) -> tuple | None:
    """(run_id, created) of a remote store's root document, None when unreadable."""
    import json

    try:
        raw = _remote_get(zarr_store, "", "zarr.json")
        if raw is None or len(raw) > MAX_JSON_BYTES:
            return None
        attrs = json.loads(raw)["attributes"]["activationscope"]
        return (attrs.get("run_id"), attrs.get("created"))
    except (StoreError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _read_remote_shard(zarr_store: Any, label: str, spec: dict) -> Any:
    from zarr.abc.store import RangeByteRequest

    key = spec["key"]
    try:
        size = zarr_sync(zarr_store.getsize(key))
    except (FileNotFoundError, KeyError):
        size = None
    except OSError as e:
        raise StoreError(f"reading {key!r} from {label} failed: {e}") from e
    if size is None:
        raise corrupt(label, f"shard {key!r} is missing; its rows {spec['first_row']}.. are committed")

    def pread(n: int, off: int) -> bytes:
        if n <= 0:
            return b""
        got = _remote_get(zarr_store, label, key, RangeByteRequest(off, off + n))
        return b"" if got is None else got

    return _checked_shard(label, spec, int(size), pread)


def _checked_shard(root: Any, spec: dict, size: int, pread: Any) -> Any:
    """The committed rows of one shard of ``size`` bytes, read with ``pread(n, offset)``:
    its index crc32c checked before its entries are used, each chunk's size and crc32c
    against its manifest record before it is decoded, its decoded size before it is copied."""
    import numpy as np

    key, rows = spec["key"], int(spec["rows"])
    chunk_rows, n_chunks, row_bytes = int(spec["chunk_rows"]), int(spec["n_chunks"]), int(spec["row_bytes"])
    codec, chunks = spec["codec"], spec["chunks"]
    chunk_bytes = chunk_rows * row_bytes
    index_bytes = 16 * n_chunks + 4
    if size < index_bytes:
        raise corrupt(root, f"shard {key!r} is truncated: {size} bytes, fewer than its {index_bytes}-byte index")
    raw = pread(index_bytes, size - index_bytes)
    if len(raw) != index_bytes:
        raise corrupt(root, f"shard {key!r} changed while it was read")
    stored, got = int.from_bytes(raw[-4:], "little"), crc32c(raw[:-4])
    if got != stored:  # (the index is read at the file's end: a file cut short reads other bytes there)
        recorded = spec.get("file_bytes")
        cut = "" if not isinstance(recorded, int) or recorded == size else (
            f": it holds {size} bytes, its manifest {spec.get('manifest')} records {recorded} (file_bytes), so it "
            f"was {'cut short' if size < recorded else 'written over'} after its commit")
        raise corrupt(root, f"shard {key!r}: shard index crc32c mismatch (stored {stored:08x}, computed {got:08x})"
                            f"{cut}")
    entries = np.frombuffer(raw, dtype="<u8", count=2 * n_chunks).tolist()
    data_end = size - index_bytes
    out = np.empty(rows * row_bytes, dtype=np.uint8)
    dec = _decoder(codec) if codec is not None else None
    full = np.empty(chunk_bytes, dtype=np.uint8) if codec is not None else None
    for j in range(-(-rows // chunk_rows)):
        off, nb = entries[2 * j], entries[2 * j + 1]
        lo = j * chunk_rows
        hi = min(rows, lo + chunk_rows)
        where = f"chunk {j} of shard {key!r} (its rows {lo}-{hi - 1})"
        if off == _MISSING and nb == _MISSING:
            raise corrupt(root, f"{where} is missing from the shard index although its rows are committed")
        if off > data_end or nb > data_end - off:
            raise corrupt(root, f"{where}: its index entry (offset {off}, {nb} bytes) points past the end of the "
                                f"chunk data ({data_end} bytes)")
        if codec is None and nb != chunk_bytes:
            raise corrupt(root, f"{where}: {nb} bytes, expected chunk_bytes {chunk_bytes} (uncompressed chunk)")
        rec = chunks.get(j)
        if rec is None:
            raise corrupt(root, f"{where} is not listed in the manifest (its crc32c cannot be checked)")
        if int(rec[0]) != nb:
            raise corrupt(root, f"{where}: the shard index gives it {nb} bytes, the manifest {rec[0]}")
        data = pread(nb, off)
        if len(data) != nb:
            raise corrupt(root, f"{where}: read {len(data)} of its {nb} bytes (the file shrank)")
        got = crc32c(data)
        if got != int(rec[1]):
            raise corrupt(root, f"{where}: shard file {key!r} bytes {off}-{off + nb - 1}: crc32c mismatch "
                                f"(manifest {int(rec[1]):08x}, data {got:08x}): the chunk is damaged")
        dst = out[lo * row_bytes:hi * row_bytes]
        if codec is None:
            dst[:] = np.frombuffer(data, dtype=np.uint8, count=(hi - lo) * row_bytes)
        else:
            decode_into(codec, dec, data, full, f"store {root!r}: {where}")
            dst[:] = full[:(hi - lo) * row_bytes]
    return out.view(np.dtype(spec["dtype"])).reshape(rows, *spec["feature_shape"])
