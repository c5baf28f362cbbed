"""Export store rows to Arrow IPC and Parquet files; read Arrow IPC back as torch views.

File layout (readable by plain pyarrow, polars, duckdb, HF datasets; no activationscope
needed):

- one column per hook point, named by the hook point. Scalars per row are a primitive
  column; a feature shape ``(d_model,)`` or larger is Arrow's fixed-shape tensor extension
  type ``arrow.fixed_shape_tensor`` (``tensor_type="fixed_shape_tensor"``, the default) whose
  storage is ``fixed_size_list<value>[prod(feature_shape)]``, or that fixed-size list itself
  (``tensor_type="fixed_size_list"``, for readers that dislike extension types). Fixed-size
  lists have no offsets buffer, so hook point columns cannot overflow 32-bit offsets at any
  file size;
- the chosen row-table columns (``sample_id``, ``pos``, ``batch``, labels, text); strings,
  binaries and lists are written as their ``large_*`` types (64-bit offsets) so a column over
  2 GiB is fine;
- dtypes as stored: float32/float64/float16 and integers (uint16, uint32 and uint64
  included) as the Arrow type of that name; complex hook points are refused (no Arrow type).
  **bfloat16** has no Arrow type: it is written bit-exact as **uint16 bit patterns** (the
  upper half of the float32 pattern) with field metadata ``activationscope.dtype =
  bfloat16``. :func:`read_arrow` turns it back into ``torch.bfloat16``; other readers can
  upcast with ``(uint32(bits) << 16)`` reinterpreted as float32;
- field metadata on every hook point column: ``activationscope.dtype`` (torch dtype name),
  ``activationscope.shape`` (feature shape as JSON), ``activationscope.hook_point``; schema
  metadata ``activationscope.row_kind`` and ``activationscope.format = "activationscope-
  export/1"``.

Files are written in record batches (row groups for Parquet) of ``batch_rows`` rows, to a
temporary name then renamed, so a failed export leaves no partial file.
"""

from __future__ import annotations

import copy
import json
import math
import mmap
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from ..errors import (ActivationScopeError, ArgumentTypeError, ArgumentValueError, ColumnNotFoundError, ExportError,
                      ExportExistsError)
from ..store._backend import enclosing_store, local_path, no_room_hint, relation_to_store
from ..store._lock import _pid_alive
from .._args import parse_flag
from ._source import as_source
from .dataset import ActivationDataset, _names, select_hook_points
from .samplers import _int_arg

__all__ = ["export_arrow", "export_parquet", "export_hf", "to_pandas", "read_arrow", "arrow_to_torch", "EXPORT_FORMAT",
           "EXPORT_FORMATS", "EXPORT_FORMAT_OPTIONS", "EXPORT_COMPRESSIONS", "check_format_options",
           "check_compression"]

EXPORT_FORMAT = "activationscope-export/1"

#: The export formats: ``"parquet"`` (:func:`export_parquet`), ``"arrow"``
#: (:func:`export_arrow`) and ``"hf"`` (:func:`export_hf`).
EXPORT_FORMATS = ("parquet", "arrow", "hf")

#: The options that apply to only some export formats, and those formats: an option given
#: for another format would have no effect, so :func:`check_format_options` refuses it.
EXPORT_FORMAT_OPTIONS: dict[str, tuple[str, ...]] = {
    "tensor_type": ("parquet", "arrow"),
    "compression": ("parquet", "arrow"),
    "overwrite": ("parquet", "arrow"),
    "context_size": ("hf",),
    "drop_last": ("hf",),
}


#: The compression names each file export accepts (``None`` is ``"none"``; names are
#: case-insensitive): Parquet codecs, and Arrow IPC buffer compression.
EXPORT_COMPRESSIONS: dict[str, tuple[str, ...]] = {
    "parquet": ("none", "snappy", "gzip", "brotli", "lz4", "zstd"),
    "arrow": ("none", "lz4", "zstd"),
}


def check_compression(format: str, compression: str | None) -> str | None:
    """``compression`` of a ``format`` export as pyarrow takes it (``None`` for none), checked
    against :data:`EXPORT_COMPRESSIONS` before anything is read or written.

    Parameters
    ----------
    format : {"parquet", "arrow", "hf"}
        The export format (:data:`EXPORT_FORMATS`).
    compression : str or None
        A codec name (any case), ``"none"`` or None.

    Raises
    ------
    ArgumentValueError
        A name that ``format`` does not accept (the message lists those it does), a ``format``
        that takes no compression (``"hf"``, even with ``compression=None``), or one that is not
        an export format.
    """
    if format not in EXPORT_FORMATS:
        raise ArgumentValueError(f"format must be one of {list(EXPORT_FORMATS)}, got {format!r} (nothing was written)")
    if format not in EXPORT_COMPRESSIONS:
        raise ArgumentValueError(f"compression applies to the export formats {list(EXPORT_COMPRESSIONS)}, got "
                                 f"{format!r}; leave compression out (nothing was written)")
    accepted = EXPORT_COMPRESSIONS[format]
    name = compression.lower() if isinstance(compression, str) else compression
    if name is None or name == "none":
        return None
    if name not in accepted:
        raise ArgumentValueError(
            f"export compression must be one of {list(accepted)} for the export format {format!r}, got "
            f"{compression!r} (nothing was written)"
        )
    return name


def check_format_options(format: str, **options: Any) -> None:
    """Refuse options that have no effect for the export ``format``, before anything is read or
    written.

    Parameters
    ----------
    format : {"parquet", "arrow", "hf"}
        The export format (:data:`EXPORT_FORMATS`).
    **options
        Options of :data:`EXPORT_FORMAT_OPTIONS` as given by the caller; ``None`` and ``False``
        mean not given. ``drop_last`` also needs ``context_size``.

    Raises
    ------
    ArgumentValueError
        An unknown ``format`` or option name; an option given (not ``None`` / ``False``) for a
        format it does not apply to, naming the option, the format and the formats it applies
        to; ``drop_last`` without ``context_size``.

    Example
    -------
    >>> check_format_options("hf", tensor_type="fixed_size_list")   # doctest: +SKIP
    ArgumentValueError: option tensor_type= has no effect for the export format 'hf' ...
    """
    if format not in EXPORT_FORMATS:
        raise ArgumentValueError(f"format must be one of {list(EXPORT_FORMATS)}, got {format!r}")
    for name, value in options.items():
        if name not in EXPORT_FORMAT_OPTIONS:
            raise ArgumentValueError(f"option {name!r} must be one of {list(EXPORT_FORMAT_OPTIONS)}, got {name!r}")
        applies = EXPORT_FORMAT_OPTIONS[name]
        if value is None or value is False or format in applies:
            continue
        formats = " and ".join(f"the export format {f!r}" for f in applies)
        raise ArgumentValueError(
            f"option {name}= has no effect for the export format {format!r}: it applies to {formats} only; leave it "
            "out (nothing was written)"
        )
    if options.get("drop_last") and options.get("context_size") is None:
        raise ArgumentValueError(
            "option drop_last= applies only with option context_size= (the export format 'hf'); give both, or "
            "leave out option drop_last= (nothing was written)"
        )
_META_DTYPE = b"activationscope.dtype"
_META_SHAPE = b"activationscope.shape"
_META_HP = b"activationscope.hook_point"

_TORCH_TO_ARROW = {
    torch.float32: pa.float32(),
    torch.float64: pa.float64(),
    torch.float16: pa.float16(),
    torch.bfloat16: pa.uint16(),  # bit patterns, see the module docstring
    torch.int8: pa.int8(),
    torch.int16: pa.int16(),
    torch.int32: pa.int32(),
    torch.int64: pa.int64(),
    torch.uint8: pa.uint8(),
    torch.uint16: pa.uint16(),
    torch.uint32: pa.uint32(),
    torch.uint64: pa.uint64(),
    torch.bool: pa.bool_(),
}
_ARROW_TO_TORCH = {
    pa.float32(): torch.float32,
    pa.float64(): torch.float64,
    pa.float16(): torch.float16,
    pa.int8(): torch.int8,
    pa.int16(): torch.int16,
    pa.int32(): torch.int32,
    pa.int64(): torch.int64,
    pa.uint8(): torch.uint8,
    pa.uint16(): torch.uint16,
    pa.uint32(): torch.uint32,
    pa.uint64(): torch.uint64,
}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _large(t: pa.DataType) -> pa.DataType:
    """The 64-bit-offset twin of ``t`` (recursively for nested types)."""
    if pa.types.is_string(t):
        return pa.large_string()
    if pa.types.is_binary(t):
        return pa.large_binary()
    if pa.types.is_list(t):
        return pa.large_list(pa.field(t.value_field.name, _large(t.value_type), t.value_field.nullable))
    if pa.types.is_large_list(t):
        return pa.large_list(pa.field(t.value_field.name, _large(t.value_type), t.value_field.nullable))
    if pa.types.is_struct(t):
        return pa.struct([pa.field(f.name, _large(f.type), f.nullable, f.metadata) for f in t])
    return t


def _check_has_values(name: str, shape: tuple[int, ...]) -> None:
    """Arrow's fixed-size lists (and datasets' fixed-length lists) hold at least one value."""
    if shape and not int(np.prod(shape)):
        raise ArgumentValueError(
            f"hook point {name!r} has feature shape {tuple(shape)}: its rows hold no values, and Arrow's fixed-size "
            "lists hold at least one; leave it out of hook_points (CLI: --hook-points)"
        )


def _unsupported_dtype(name: str, dtype: torch.dtype, format: str) -> ArgumentValueError:
    """The refusal of a hook point whose dtype has no column type in the export ``format``."""
    held = ", ".join(_dtype_name(d) for d in _TORCH_TO_ARROW if format != "hf" or d != torch.uint64)
    return ArgumentValueError(
        f"hook point {name!r} has dtype {dtype}, which the export format {format!r} does not support (it writes "
        f"{held}; nothing was written); leave it out of hook_points (CLI: --hook-points), and read it with "
        "open_store or ActivationDataset, which give every stored dtype"
    )


def _hf_uint64(name: str) -> ArgumentValueError:
    """The refusal of a uint64 hook point in a Hugging Face ``datasets`` export."""
    return ArgumentValueError(
        f"hook point {name!r} has dtype torch.uint64, which the export format 'hf' does not keep exactly: datasets "
        "reads uint64 columns with with_format('torch') and with_format('numpy') as int64, values of 2**63 or more "
        "turned negative (nothing was written); export it with export_parquet or export_arrow (CLI: --format "
        "parquet / arrow), which keep uint64 exactly (read_arrow gives torch.uint64), or leave it out of "
        "hook_points (CLI: --hook-points)"
    )


def _hook_point_field(name: str, dtype: torch.dtype, shape: tuple[int, ...], tensor_type: str,
                      format: str) -> pa.Field:
    if dtype not in _TORCH_TO_ARROW:
        raise _unsupported_dtype(name, dtype, format)
    _check_has_values(name, shape)
    value_type = _TORCH_TO_ARROW[dtype]
    if not shape:
        arrow_type = value_type
    elif tensor_type == "fixed_shape_tensor":
        arrow_type = pa.fixed_shape_tensor(value_type, list(shape))
    else:
        arrow_type = pa.list_(value_type, int(np.prod(shape)))
    meta = {_META_DTYPE: _dtype_name(dtype).encode(), _META_SHAPE: json.dumps(list(shape)).encode(), _META_HP: name.encode()}
    return pa.field(name, arrow_type, nullable=False, metadata=meta)


def _tensor_to_arrow(t: torch.Tensor, field: pa.Field) -> pa.Array:
    """(rows, *shape) tensor -> Arrow array of ``field``'s type (zero-copy of ``t``'s memory)."""
    t = t.detach().cpu().contiguous()
    rows = t.shape[0]
    if t.dtype == torch.bfloat16:
        flat = t.view(torch.int16).reshape(-1).numpy().view(np.uint16)
    elif t.dtype == torch.bool:
        flat = t.reshape(-1).numpy()
    else:
        flat = t.reshape(-1).numpy()
    values = pa.array(flat) if t.dtype == torch.bool else pa.Array.from_buffers(
        pa.from_numpy_dtype(flat.dtype), flat.size, [None, pa.py_buffer(flat)]
    )
    ftype = field.type
    if isinstance(ftype, pa.FixedShapeTensorType):
        storage = pa.FixedSizeListArray.from_arrays(values, int(np.prod(ftype.shape)))
        return pa.ExtensionArray.from_storage(ftype, storage)
    if pa.types.is_fixed_size_list(ftype):
        return pa.FixedSizeListArray.from_arrays(values, ftype.list_size)
    assert values.type == ftype and len(values) == rows  # internal invariant
    return values


def _dataset_for(source: Any, hook_points: Any, columns: Any, rows: Any, filter: Any,
                 sample_ids: Any = None) -> ActivationDataset:
    # an export reads every byte it writes: a store given by path or URL is opened with every
    # chunk checked against its crc32c (a damaged chunk is an error, never exported values);
    # a store object or dataset is read as it was opened
    src = as_source(source, {"verify": True} if isinstance(source, (str, os.PathLike)) else None)
    if isinstance(source, ActivationDataset) and hook_points is None:
        names = source.hook_points
    else:
        names = select_hook_points(src, hook_points)
    lost = [hp for hp in names if not src.follows_row_table(hp)]
    if lost:
        _check_alone(src, names, lost, columns, filter, sample_ids)
    if isinstance(source, ActivationDataset):  # its own row selection, whatever the hook points
        if rows is not None or filter is not None or sample_ids is not None:
            raise ArgumentValueError(
                f"rows=, filter= and sample_ids= select rows of a store, but a dataset was given, which exports its "
                f"own {len(source)} rows; select them when making the dataset, or pass its store "
                f"({src.describe()}) with rows= / filter= / sample_ids="
            )
        if hook_points is None:
            ds = copy.copy(source)  # other columns
        else:
            other = [hp for hp in names
                     if src.row_kind(hp) != source.row_kind or src.n_rows(hp) != source.n_store_rows]
            if other:
                raise ArgumentValueError(
                    f"hook points {other} have other rows than the dataset's {source.hook_points} "
                    f"({source.n_store_rows} {source.row_kind} rows), so the dataset's row selection does not apply "
                    "to them; export them from the store, or from a dataset made for them"
                )
            ds = ActivationDataset(src, hook_points=names, rows=source.store_rows())
    else:
        _check_one_row_kind(src, names)
        ds = ActivationDataset(src, hook_points=names, rows=rows, filter=filter, sample_ids=sample_ids)
    if lost:  # rows as stored: no row-table column lines up with them
        ds._export_columns = []  # type: ignore[attr-defined]
        ds._export_table = None  # type: ignore[attr-defined]
        return ds
    if columns is None:  # every column read (and cached by the source, as its whole table is)
        ds._columns_read = None
        table = ds._row_table()
        chosen = _default_columns(ds, table.column_names)
    else:
        # (a column named twice is exported once, as the dataset reads it)
        chosen = list(dict.fromkeys(_names(columns, "columns", "row-table column names")))
        have = ds._row_columns()  # (from the tables' schemas: no column decoded for it)
        missing = [c for c in chosen if c not in have]
        if missing:
            raise ds._missing_columns_error(missing, have)
        # only the columns it writes are decoded (of a token table of 10**8 rows, not every
        # column), held by this export alone: the source caches no table of them
        table = ds._row_table(chosen)
    ds._export_columns = chosen  # type: ignore[attr-defined]
    ds._export_table = table  # type: ignore[attr-defined]
    return ds


#: The per-sample column that an export of token rows leaves out unless ``columns=`` names it:
#: the whole text of a sample (``activationscope capture`` of text data), which every token row
#: of the sample would repeat.
TEXT_COLUMN = "text"


def _default_columns(ds: ActivationDataset, names: list[str]) -> list[str]:
    """The row-table columns an export writes when ``columns=`` is not given: every one, but
    for token rows not the per-sample :data:`TEXT_COLUMN`, which would repeat a sample's whole
    text on each of its token rows (an Arrow or Hugging Face file many times the size of its
    activations; a token is named by its ``token_ids``, and the text is one per sample in the
    sample row table or an export of sample rows, joined on ``sample_id``)."""
    if ds.row_kind != "token":
        return list(names)
    own = ds.source.row_table("token").column_names  # (a column of the token table itself is kept)
    return [c for c in names if c != TEXT_COLUMN or c in own]


def _check_one_row_kind(src: Any, names: list[str]) -> None:
    """One file holds rows of one kind: name the hook points of each kind, and the fix."""
    kinds: dict[str, list[str]] = {}
    for hp in names:
        kinds.setdefault(str(src.row_kind(hp)), []).append(hp)
    if len(kinds) > 1:
        listing = "; ".join(f"{kind} rows: {hps}" for kind, hps in kinds.items())
        raise ArgumentValueError(
            f"exported hook points must have one row kind (token or sample rows), got {listing}; pass hook_points= "
            "of one kind and export the others to another file"
        )


def _check_alone(src: Any, names: list[str], lost: list[str], columns: Any, filter: Any, sample_ids: Any = None) -> None:
    """A hook point whose rows do not follow the row table is exported alone, without row-table
    columns, a filter or sample ids: its row i is not row i of the table (nor of another hook
    point)."""
    where = src.describe()
    if len(names) > 1:
        others = [hp for hp in names if hp not in lost]
        raise ArgumentValueError(
            f"the rows of hook points {lost} of {where} do not follow the row table (store.follows_row_table() "
            f"is False: first captured after some forwards, or missing from one), so they cannot be exported in one table with "
            f"{others if others else 'each other'}; export them separately, each alone "
            f"(hook_points={lost[0]!r}, CLI: --hook-points {lost[0]}; its rows as stored, without columns or filter)"
            + (f", and the others in their own file (hook_points={others}, CLI: --hook-points {' '.join(others)})"
               if others else "")
        )
    chosen = [] if columns is None else _names(columns, "columns", "row-table column names")
    if chosen or filter is not None or sample_ids is not None:
        raise ArgumentValueError(
            f"the rows of hook point {lost[0]!r} of {where} do not follow the row table "
            "(store.follows_row_table() is False: first captured after some forwards, or missing from one), so "
            + (f"columns={chosen!r}" if chosen else "a filter" if filter is not None else "sample_ids=")
            + " cannot be exported with them; export it without columns, filter and sample_ids (its rows as stored)"
        )


def _export_columns(ds: ActivationDataset, columns: Any) -> list[str]:
    """Row-table columns to export: those chosen by ``columns=``, else :func:`_default_columns`."""
    chosen = getattr(ds, "_export_columns", None)
    if chosen is not None:
        return chosen
    return ds._row_table().column_names if columns is None else list(ds.columns)


def _export_table(ds: ActivationDataset, col_names: list[str]) -> pa.Table | None:
    """The row table of the export's store rows with (at least) the columns ``col_names``, read
    once by :func:`_dataset_for`; None when no column is exported."""
    return ds._export_table if col_names else None  # type: ignore[attr-defined]


def _schema(ds: ActivationDataset, col_names: list[str], tensor_type: str, format: str) -> pa.Schema:
    if tensor_type not in ("fixed_shape_tensor", "fixed_size_list"):
        raise ArgumentValueError(f"tensor_type must be one of ['fixed_shape_tensor', 'fixed_size_list'], got {tensor_type!r}")
    fields = []
    for hp in ds.hook_points:
        fields.append(_hook_point_field(hp, ds.source.dtype(hp), ds.source.feature_shape(hp), tensor_type, format))
    table = _export_table(ds, col_names)
    for name in col_names:
        if name in ds.hook_points:
            raise ArgumentValueError(f"row-table column {name!r} clashes with a hook point of the same name")
        f = table.schema.field(name)
        fields.append(pa.field(name, _large(f.type), f.nullable, f.metadata))
    meta = {b"activationscope.row_kind": ds.row_kind.encode(), b"activationscope.format": EXPORT_FORMAT.encode()}
    return pa.schema(fields, metadata=meta)


def _record_batches(ds: ActivationDataset, schema: pa.Schema, col_names: list[str], batch_rows: int):
    table = _export_table(ds, col_names)
    ids = ds.store_rows()
    n = len(ds)
    for start in range(0, n, batch_rows):
        stop = min(start + batch_rows, n)
        batch = ds.get_batch(range(start, stop))
        arrays = [_tensor_to_arrow(batch[hp], schema.field(hp)) for hp in ds.hook_points]
        if col_names:
            if isinstance(ids, range):
                part = table.slice(ids.start + start, stop - start)
            else:
                part = table.take(pa.array(ids[start:stop].numpy()))
            for name in col_names:
                arrays.append(part.column(name).cast(schema.field(name).type).combine_chunks())
        yield pa.RecordBatch.from_arrays(arrays, schema=schema)


def _temp_sibling(path: Path, suffix: str = ".tmp") -> Path:
    """A fresh name next to ``path`` to write the export to before it is renamed into place:
    unique to this call, so an existing file or folder of the user's (``out.parquet.tmp``)
    is never written over or removed. The name, ``<out>.<host>-<pid>-<8 hex><suffix>``,
    says which process writes it; the files an export of ``path`` that was killed on this
    host left behind (its process is gone) are removed first (:func:`_remove_stale_temps`)."""
    import secrets

    base = path.name.encode("utf-8", "surrogateescape")[:200].decode("utf-8", "ignore")  # a name has <= 255 bytes
    host = _host_tag()
    _remove_stale_temps(path.parent, base, host)
    while True:
        tmp = path.with_name(f"{base}.{host}-{os.getpid()}-{secrets.token_hex(4)}{suffix}")
        if not tmp.exists() and not tmp.is_symlink():
            return tmp


def _host_tag() -> str:
    """This host in at most 20 letters and digits: the first 8 letters and digits of its
    name, then 12 hex digits of the sha256 of its whole name and of the process id space it
    runs in (Linux: its pid namespace). Hosts whose names agree in their first letters (cluster
    nodes on one shared file system), or once their other characters are left out, and
    containers of one host name each with their own process ids, get tags of their own: a
    process id is only ever looked up where it means that process."""
    import hashlib
    import socket

    name = socket.gethostname()
    try:
        space = str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        space = ""
    digest = hashlib.sha256(f"{name}\0{space}".encode("utf-8", "surrogatepass")).hexdigest()[:12]
    return "".join(c for c in name if c.isascii() and c.isalnum())[:8] + digest


def _remove_stale_temps(folder: Path, base: str, host: str) -> None:
    """Remove the temporary files of earlier exports to ``folder / base`` that were killed
    before they could (SIGKILL, a power loss): plain files named as :func:`_temp_sibling`
    names them, on this host, whose process no longer runs. Files of a process still
    running, of another host (a shared file system), and anything else are left alone."""
    import re

    pattern = re.compile(re.escape(base) + r"\." + re.escape(host) + r"-(\d{1,10})-[0-9a-f]{8}(?:\.stream)?\.tmp")
    try:
        names = os.listdir(folder)
    except OSError:
        return
    for name in names:
        m = pattern.fullmatch(name)
        pid = int(m.group(1)) if m is not None else 0
        if pid <= 0 or _pid_alive(pid):  # (a name of pid 0 is no process's: left alone)
            continue
        stale = folder / name
        try:
            if stale.is_file() and not stale.is_symlink():
                stale.unlink()
        except OSError:
            pass


def _is_export(path: Path, kind: str) -> bool:
    """Whether ``path`` is a file this module wrote (its Arrow schema carries our format key)."""
    try:
        if kind == "arrow":
            with pa.memory_map(str(path)) as f:
                meta = pa.ipc.open_file(f).schema.metadata or {}
        else:
            meta = pq.read_schema(str(path)).metadata or {}
    except Exception:  # noqa: BLE001 - not a file of that format
        return False
    return b"activationscope.format" in meta


def _refuse_inside_store(path: Path, ds: ActivationDataset, folders: bool = True) -> None:
    """Refuse an output path inside the local store being read (or the store itself, or with
    ``folders`` a folder holding it): writing or replacing it would change or destroy the
    store's files. A one-file export leaves the folders to :func:`_check_out`."""
    store = getattr(ds.source, "store", None)
    rel = relation_to_store(path, store)
    if rel == "inside" or (folders and rel == "holds"):
        where, root = ("holds the store" if rel == "holds" else "is inside the store"), store.path
        raise ArgumentValueError(
            f"export path {str(path)!r} {where} {root!r} being exported: the export would write among, replace or "
            "remove the store's files (overwrite does not allow it); give a path outside the store"
        )
    other = enclosing_store(path)
    if other is not None:  # another store: replacing it (overwrite=True) would remove the export with it
        raise ArgumentValueError(
            f"export path {str(path)!r} is inside the store {other!r}: the export would lie among that store's "
            "files (and capturing it again with overwrite=True removes its folder, the export with it); give a path "
            "outside the store"
        )


def _local_out(path: str | os.PathLike) -> Path:
    """The local file or folder an export ``path`` names: a path (``~`` expanded) or a
    ``file://`` URL's path, checked exactly as that path. Other URLs are refused: an export
    writes local files."""
    local = local_path(path)
    if local is None:
        raise ArgumentValueError(
            f"export path {os.fspath(path)!r} must be a local path or a file:// URL, got a URL of another "
            "filesystem; export to a local file and copy it there (nothing was written)"
        )
    return Path(local)


def _check_parent(path: Path) -> None:
    """Refuse a ``path`` whose folder is missing, is a file or is not writable (before a
    temporary file is made there)."""
    parent = path.parent
    if not parent.is_dir():
        what = "is not a folder" if parent.exists() else "does not exist"
        raise ArgumentValueError(f"export path {str(path)!r}: its folder {str(parent)!r} {what}; give a path in an existing folder")
    if not os.access(parent, os.W_OK | os.X_OK):  # (a read-only folder or file system, an immutable folder)
        raise ArgumentValueError(
            f"export path {str(path)!r}: its folder {str(parent)!r} is not writable by this process (the export "
            "writes a file there and renames it into place); give a path in a folder you may write (nothing was "
            "written)")


def _refuse_special(path: Path) -> None:
    """Refuse a ``path`` that is a device, a pipe or a socket (or a link to one): the export is
    renamed into place, which would replace it (``/dev/null`` made a file), and reading it to
    tell whether it is an earlier export could wait for ever (a pipe)."""
    if path.exists() and not path.is_file() and not path.is_dir():
        raise ArgumentValueError(
            f"export path {str(path)!r} is not a regular file (a device, a pipe or a socket); an export writes a "
            "file and renames it into place, which would replace it: give a file path"
        )


def _check_out(path: Path, kind: str, overwrite: bool) -> None:
    """Refuse to replace a folder, a device, a pipe or a socket, or a file that is not an
    earlier export (unless ``overwrite``)."""
    _check_parent(path)
    _refuse_special(path)
    if path.is_dir():
        raise ArgumentValueError(f"{str(path)!r} is a folder; {'an' if kind[:1] in 'aeiou' else 'a'} {kind} export writes one file: give a file path")
    if path.exists() and not overwrite and not _is_export(path, kind):
        raise ArgumentValueError(
            f"{str(path)!r} exists and is not an earlier {kind} export; it is left as it is: give another path, "
            "or pass overwrite=True (--overwrite) to replace it"
        )


def _export(kind: str, source: Any, path: Any, hook_points: Any, columns: Any, batch_rows: int,
            rows: Any, filter: Any, tensor_type: str, compression: Any, overwrite: bool = False,
            sample_ids: Any = None) -> Path:
    batch_rows = _int_arg(batch_rows, "batch_rows", 1)  # (a bool is refused, not written in 1-row batches)
    overwrite = parse_flag(overwrite, "overwrite")  # (overwrite="False" is a true string)
    compression = check_compression(kind, compression)  # before the store is read or a file made
    path = _local_out(path)
    ds = _dataset_for(source, hook_points, columns, rows, filter, sample_ids)
    _refuse_inside_store(path, ds, folders=False)
    _check_out(path, kind, overwrite)
    col_names = _export_columns(ds, columns)
    schema = _schema(ds, col_names, tensor_type, kind)
    tmp = _temp_sibling(path)
    try:
        if kind == "arrow":
            options = pa.ipc.IpcWriteOptions(compression=compression)
            with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, schema, options=options) as writer:
                for rb in _record_batches(ds, schema, col_names, batch_rows):
                    writer.write_batch(rb)
        else:
            with pq.ParquetWriter(str(tmp), schema, compression=compression or "none") as writer:
                for rb in _record_batches(ds, schema, col_names, batch_rows):
                    writer.write_batch(rb, row_group_size=batch_rows)
        os.replace(tmp, path)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        _raise_write_failure(e, path)
        raise
    return path


def _raise_write_failure(e: BaseException, path: Path, replaced: bool = False) -> None:
    """Raise :class:`ExportError` for ``e`` when it is an OS error of the export's own writes
    (a full disk, a folder that cannot be written; our errors, e.g. of the store read, pass).
    ``replaced``: the export found at ``path`` was removed already."""
    if isinstance(e, OSError) and not isinstance(e, ActivationScopeError):
        fate = (f"the export there before was removed already, so {str(path)!r} holds none" if replaced
                else f"nothing at {str(path)!r} was changed")
        raise ExportError(
            f"writing the export {str(path)!r} failed: {e.strerror or e}{no_room_hint(e)}; its temporary files were "
            f"removed, and {fate}: fix the cause, then export again") from e


def export_arrow(
    store: Any,
    path: str | os.PathLike,
    hook_points: str | Iterable[str] | None = None,
    columns: str | Iterable[str] | None = None,
    batch_rows: int = 65536,
    *,
    rows: Any = None,
    filter: Any = None,
    sample_ids: Any = None,
    tensor_type: str = "fixed_shape_tensor",
    compression: str | None = None,
    overwrite: bool = False,
) -> Path:
    """Write rows of a store to an Arrow IPC file (``.arrow``, the Feather v2 format).

    Parameters
    ----------
    store : str, os.PathLike, store object or ActivationDataset
        The rows to export (a dataset exports its own selection). A path or URL is opened
        with ``verify=True``: every chunk read is checked against its crc32c, a damaged one
        raises StoreCorruptError naming it before the file is replaced (a store object or
        dataset is read as it was opened: ``open_store(path, verify=True)`` checks it too).
    path : str or os.PathLike
        The file to write (replaced atomically): a local path, or a ``file://`` URL checked
        exactly as the path it names (other URLs are refused). An existing file that is not
        an earlier export of this format is refused (``ArgumentValueError``) unless
        ``overwrite``.
    hook_points : str or list of str, optional
        Hook points (patterns allowed) to export, one column each; default all, which must
        share a row kind and row count. A hook point whose rows do not follow the row table
        (``store.follows_row_table(hp)`` False: first captured after some forwards) is
        exported alone, its rows as stored, without row-table columns.
    columns : str or list of str, optional
        Row-table columns; default all of them (none for a hook point that does not follow
        the row table), but for token rows not the per-sample ``text`` column, which would
        repeat a sample's whole text on each of its token rows: name it to write it.
    batch_rows : int, default 65536
        Rows per record batch: bounds memory during export (a batch of rows of every hook
        point is held at once).
    rows, filter, sample_ids
        Row selection of a store, as :class:`ActivationDataset`. A dataset given as ``store``
        exports its own selection (also with ``hook_points``); with it these are refused.
    tensor_type : {"fixed_shape_tensor", "fixed_size_list"}
        Arrow type of hook point columns (see the module docstring).
    compression : {None, "none", "lz4", "zstd"}
        IPC buffer compression (``EXPORT_COMPRESSIONS["arrow"]``; another name is refused
        before anything is written). Compressed files cannot be read zero-copy.
    overwrite : bool, default False
        Replace ``path`` even when it is not an earlier export.

    Returns
    -------
    pathlib.Path
        ``path``.

    Raises
    ------
    ArgumentValueError
        A hook point that does not follow the row table exported with other hook points,
        or with ``columns`` / ``filter`` (the message names it: export it alone); a
        ``path`` inside the local store being exported or the store itself (even with
        ``overwrite``); a ``path`` that is a folder; bad arguments (``batch_rows`` below 1).
    ArgumentTypeError
        ``batch_rows`` that is no int (a bool, float or str; numpy and 0-d torch integers are
        taken). A TypeError.
    HookPointNotFoundError
        A hook point or pattern that is not in the store.

    Example
    -------
    >>> export_arrow("runs/demo.zarr", "demo.arrow", hook_points=["blocks.0.output"])  # doctest: +SKIP
    >>> acts = read_arrow("demo.arrow")["blocks.0.output"]                             # doctest: +SKIP
    """
    return _export("arrow", store, path, hook_points, columns, batch_rows, rows, filter, tensor_type, compression,
                   overwrite, sample_ids)


def export_parquet(
    store: Any,
    path: str | os.PathLike,
    hook_points: str | Iterable[str] | None = None,
    columns: str | Iterable[str] | None = None,
    batch_rows: int = 65536,
    *,
    rows: Any = None,
    filter: Any = None,
    sample_ids: Any = None,
    tensor_type: str = "fixed_shape_tensor",
    compression: str | None = "zstd",
    overwrite: bool = False,
) -> Path:
    """Write rows of a store to a Parquet file, one row group per ``batch_rows`` rows.

    Same columns, types and metadata as :func:`export_arrow` (pyarrow restores the
    fixed-shape tensor type and field metadata from the file's stored Arrow schema; other
    readers see hook point columns as lists of ``prod(feature_shape)`` values).

    Parameters
    ----------
    compression : str or None, default "zstd"
        Parquet codec, one of ``EXPORT_COMPRESSIONS["parquet"]`` (``"snappy"``, ``"zstd"``,
        ``None``...; another name is refused before anything is written).
    others
        As :func:`export_arrow`.

    Returns
    -------
    pathlib.Path
        ``path``.
    """
    return _export("parquet", store, path, hook_points, columns, batch_rows, rows, filter, tensor_type, compression,
                   overwrite, sample_ids)


# ---------------------------------------------------------------------- Hugging Face datasets
# HF Array2D..Array5D store nested lists with 32-bit offsets: bound the values per record batch
_HF_MAX_VALUES = (1 << 31) - 1


def _hf_feature(shape: tuple[int, ...], dtype_name: str) -> Any:
    """The ``datasets`` feature of one example of ``shape`` (``()`` a scalar)."""
    from datasets import Array2D, Array3D, Array4D, Array5D, List, Value

    if not shape:
        return Value(dtype_name)
    if len(shape) == 1:
        return List(Value(dtype_name), length=int(shape[0]))
    kinds = {2: Array2D, 3: Array3D, 4: Array4D, 5: Array5D}
    if len(shape) not in kinds:
        raise ArgumentValueError(
            f"Hugging Face datasets holds arrays of at most 5 dimensions per example, got {shape}; "
            "export one row per example (context_size=None) or fewer feature dimensions"
        )
    return kinds[len(shape)](shape=tuple(int(d) for d in shape), dtype=dtype_name)


def _hf_values(t: torch.Tensor, bfloat16: str) -> pa.Array:
    """All values of ``t`` as one flat Arrow array (bfloat16 upcast to float32, or its bits)."""
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        t = t.float() if bfloat16 == "float32" else t.view(torch.int16)
    flat = t.contiguous().reshape(-1).numpy()
    if t.dtype == torch.int16 and bfloat16 == "bits" and flat.dtype == np.int16:
        flat = flat.view(np.uint16)
    if flat.dtype == np.bool_:
        return pa.array(flat)
    return pa.Array.from_buffers(pa.from_numpy_dtype(flat.dtype), flat.size, [None, pa.py_buffer(flat)])


def _hf_column(values: pa.Array, shape: tuple[int, ...], feature: Any) -> pa.Array:
    """Flat values of whole examples of ``shape`` -> the Arrow array of ``feature``."""
    if not shape:
        return values
    if len(shape) == 1:
        return pa.FixedSizeListArray.from_arrays(values, int(shape[0]))
    arr: pa.Array = values
    for d in reversed(shape):  # lists of the innermost dimension first
        count = len(arr) // d
        arr = pa.ListArray.from_arrays(pa.array(np.arange(0, count * d + 1, d, dtype=np.int32)), arr)
    return pa.ExtensionArray.from_storage(feature(), arr)  # an ArrayND feature, called, is its Arrow type


def _hf_plan(ds: ActivationDataset, col_names: list[str], context_size: int | None, bfloat16: str):
    """``datasets.Features`` of the export, and the example shape of each hook point."""
    import datasets

    group = () if context_size is None else (context_size,)
    table = _export_table(ds, col_names)
    features: dict[str, Any] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for hp in ds.hook_points:
        dtype = ds.source.dtype(hp)
        if dtype == torch.bfloat16:
            name = "float32" if bfloat16 == "float32" else "uint16"
        elif dtype == torch.uint64:
            raise _hf_uint64(hp)
        elif dtype in _TORCH_TO_ARROW:
            name = _dtype_name(dtype)
        else:
            raise _unsupported_dtype(hp, dtype, "hf")
        feature_shape = tuple(ds.source.feature_shape(hp))
        _check_has_values(hp, feature_shape)
        if context_size is not None and len(feature_shape) > 1:
            # SAELens's layout is (context_size, d_in) whatever the hook: it caches a head-split
            # hook (hook_z, (n_heads, d_head)) with its heads side by side, d_in = n_heads * d_head
            feature_shape = (int(np.prod(feature_shape)),)
        shapes[hp] = group + feature_shape
        features[hp] = _hf_feature(shapes[hp], name)
    for name in col_names:
        if name in ds.hook_points:
            raise ArgumentValueError(f"row-table column {name!r} clashes with a hook point of the same name")
        inner = datasets.Features.from_arrow_schema(pa.schema([table.schema.field(name)]))[name]
        features[name] = inner if context_size is None else datasets.List(inner, length=context_size)
    return datasets.Features(features), shapes


def _hf_tables(ds: ActivationDataset, features: Any, shapes: dict[str, tuple[int, ...]], col_names: list[str],
               n_rows: int, context_size: int | None, batch_rows: int, bfloat16: str):
    """pyarrow tables of the export's schema, ``batch_rows`` store rows (whole examples) each."""
    group = context_size or 1
    per_row = max([1] + [int(np.prod(shapes[hp][1 if context_size else 0:])) for hp in ds.hook_points])
    step = max(group, min(batch_rows, _HF_MAX_VALUES // per_row) // group * group)
    schema = features.arrow_schema
    table = _export_table(ds, col_names)
    ids = ds.store_rows()
    for start in range(0, n_rows, step):
        stop = min(start + step, n_rows)
        batch = ds.get_batch(range(start, stop))
        arrays = [_hf_column(_hf_values(batch[hp], bfloat16), shapes[hp], features[hp]) for hp in ds.hook_points]
        if col_names:
            part = table.slice(ids.start + start, stop - start) if isinstance(ids, range) else \
                table.take(pa.array(ids[start:stop].numpy()))
            for name in col_names:
                col = part.column(name).combine_chunks()
                arrays.append(col if context_size is None else pa.FixedSizeListArray.from_arrays(col, context_size))
        # cast only the columns whose type differs (pyarrow 26 fails to cast a fixed-size list of
        # nulls, an all-None column in context_size groups, even to its own type)
        arrays = [a if a.type == f.type else a.cast(f.type) for a, f in zip(arrays, schema)]
        yield pa.Table.from_arrays(arrays, schema=schema)


def export_hf(
    store: Any,
    path: str | os.PathLike,
    hook_points: str | Iterable[str] | None = None,
    columns: str | Iterable[str] | None = None,
    *,
    context_size: int | None = None,
    drop_last: bool = False,
    file_format: str = "arrow",
    bfloat16: str = "float32",
    rows: Any = None,
    filter: Any = None,
    sample_ids: Any = None,
    batch_rows: int = 65536,
) -> Path:
    """Write rows of a store as a Hugging Face ``datasets`` dataset.

    ``file_format="arrow"`` writes a directory in the layout of ``Dataset.save_to_disk``
    (read it with ``datasets.load_from_disk(path)``); ``"parquet"`` writes one Parquet file
    whose schema carries the ``datasets`` features (``datasets.Dataset.from_parquet(path)``
    or ``load_dataset("parquet", data_files=path)``). Either way the columns are typed, so
    ``with_format("torch")`` gives tensors of the right shapes.

    Columns: one per hook point, named by the hook point; the chosen row-table columns with
    their own types. An example is one store row (``context_size=None``): a feature shape
    ``(d,)`` is ``List(Value(dtype), length=d)``, 2 to 5 dimensions ``Array2D`` ..
    ``Array5D``. With ``context_size=n`` an example is ``n`` consecutive rows: hook point
    columns ``Array2D((n, d_in))`` (the layout of SAELens's cached activations, whose
    ``ActivationsStore(cached_activations_path=path)`` reads it), ``d_in`` the product of the
    feature shape (rows of ``(n_heads, d_head)``, a ``hook_z``, are flattened to
    ``n_heads * d_head`` values, heads side by side, as SAELens caches them; rows of one
    value stay ``List(length=n)``) and row-table columns
    ``List(..., length=n)`` (``token_ids`` becomes SAELens's token id column). Token rows are
    packed in store order, so a group can span samples (as SAELens packs documents into
    its context windows); padding never enters, since the store holds none.

    Dtypes: float32, float16, float64 and integers as stored, but uint64: ``datasets`` reads a
    uint64 column with ``with_format("torch")`` or ``"numpy"`` as int64, values of ``2**63`` or
    more negative, so a uint64 hook point is refused (:func:`export_parquet` and
    :func:`export_arrow` keep it exactly). **bfloat16** has no
    ``datasets`` dtype: ``bfloat16="float32"`` (default) writes the exact float32 values,
    ``"bits"`` the uint16 bit patterns (``with_format("torch")`` shows them as int64;
    ``torch.from_numpy(x.numpy().astype(np.uint16).view(np.int16)).view(torch.bfloat16)``
    restores the values). Note that ``with_format("torch")`` converts floating columns to float32
    and integer columns to int64 unless given ``dtype=``; float16 and bfloat16 values
    survive that exactly, float64 values do not (pass ``with_format("torch", dtype=torch.float64)``).

    Parameters
    ----------
    store : str, os.PathLike, store object or ActivationDataset
        The rows to export (a dataset exports its own selection). A path or URL is opened
        with ``verify=True``: every chunk read is checked against its crc32c, a damaged one
        raises StoreCorruptError naming it before the file is replaced (a store object or
        dataset is read as it was opened: ``open_store(path, verify=True)`` checks it too).
    path : str or os.PathLike
        The directory (``"arrow"``) or file (``"parquet"``) to write; replaced as a whole
        at the end (written to a temporary name first), so a failed export leaves nothing.
        A local path, or a ``file://`` URL checked exactly as the path it names (other URLs
        are refused).
    hook_points : str or list of str, optional
        Hook points (patterns allowed); default all, which must share a row kind and count.
    columns : str or list of str, optional
        Row-table columns; default all of them (``[]`` for none), but for token rows not the
        per-sample ``text`` column, which would repeat a sample's whole text on each of its
        token rows: name it to write it.
    context_size : int, optional
        Rows per example (see above); default one row per example.
    drop_last : bool, default False
        With ``context_size``, leave out the last ``n_rows % context_size`` rows instead of
        raising.
    file_format : {"arrow", "parquet"}
    bfloat16 : {"float32", "bits"}
    rows, filter, sample_ids
        Row selection of a store, as :class:`ActivationDataset`. A dataset given as ``store``
        exports its own selection (also with ``hook_points``); with it these are refused.
    batch_rows : int, default 65536
        Store rows per record batch (bounds the memory held during the export).

    Returns
    -------
    pathlib.Path
        ``path``.

    Raises
    ------
    ValueError
        Bad arguments; no rows to export (a dataset of 0 rows cannot be loaded back);
        ``n_rows`` not a multiple of ``context_size`` without ``drop_last``;
        a ``path`` inside the local store being exported, the store itself or a folder
        holding it (``ArgumentValueError``).
    ArgumentValueError
        A hook point of more than 5 dimensions per example, or a dtype without an Arrow type
        (complex) or that ``datasets`` does not read back exactly (uint64).
    ExportExistsError
        (a ``FileExistsError``) ``path`` exists and is not an earlier export of ``file_format`` (a directory of other
        files or another ``datasets`` dataset, a file this function did not write), or is an
        earlier export folder that also holds other files (the ``cache-*.arrow`` Arrow
        streams ``datasets`` writes there are replaced with the export): it is left as it is.
    ArgumentTypeError
        ``batch_rows`` that is no int (a bool, float or str). A TypeError.
    ImportError
        ``datasets`` is not installed (``pip install datasets``).

    Example
    -------
    >>> export_hf("runs/demo.zarr", "runs/demo-hf", hook_points="encoder.layer.3.output")  # doctest: +SKIP
    >>> datasets.load_from_disk("runs/demo-hf").with_format("torch")[:8]                   # doctest: +SKIP
    """
    if file_format not in ("arrow", "parquet"):
        raise ArgumentValueError(f"file_format must be one of ['arrow', 'parquet'], got {file_format!r}")
    drop_last = parse_flag(drop_last, "drop_last")  # (drop_last="False" is a true string)
    check_format_options("hf", context_size=context_size, drop_last=drop_last)
    if bfloat16 not in ("float32", "bits"):
        raise ArgumentValueError(f"bfloat16 must be one of ['float32', 'bits'], got {bfloat16!r}")
    if context_size is not None and (not isinstance(context_size, int) or isinstance(context_size, bool)
                                     or context_size < 1):
        raise ArgumentValueError(f"context_size must be a positive int or None, got {context_size!r}")
    batch_rows = _int_arg(batch_rows, "batch_rows", 1)  # (a bool is refused, not written in 1-row batches)
    try:
        import datasets
    except ImportError as e:
        raise ImportError("export_hf needs the Hugging Face datasets library: pip install datasets") from e
    ds = _dataset_for(source=store, hook_points=hook_points, columns=columns, rows=rows, filter=filter,
                      sample_ids=sample_ids)
    col_names = _export_columns(ds, columns)
    n_rows = len(ds)
    if n_rows == 0:
        raise ArgumentValueError(
            f"{ds.hook_points} have no rows to export from {ds.source.describe()} (none committed, or none selected "
            "by rows= / filter= / sample_ids=): datasets cannot load a dataset of 0 rows back (load_from_disk and from_parquet "
            "fail on it), so nothing is written; select some rows, or use export_parquet / export_arrow, which "
            "write an empty table"
        )
    if context_size is not None and context_size > n_rows:  # (drop_last=True would leave nothing)
        raise ArgumentValueError(
            f"context_size={context_size} is more than the {n_rows} rows of {ds.hook_points}: not one example "
            f"can be filled{', and with drop_last=True nothing would be exported' if drop_last else ''}; pass a "
            f"context_size of at most {n_rows} or capture more rows"
        )
    if context_size is not None and n_rows % context_size:
        if not drop_last:
            raise ArgumentValueError(
                f"the {n_rows} rows of {ds.hook_points} must be a multiple of context_size={context_size} "
                f"(remainder {n_rows % context_size}); pass drop_last=True to leave out the last "
                f"{n_rows % context_size} rows, or another context_size"
            )
        n_rows -= n_rows % context_size
    features, shapes = _hf_plan(ds, col_names, context_size, bfloat16)
    path = _local_out(path)
    _refuse_inside_store(path, ds)
    _check_replaceable(path, file_format)
    tmp = _temp_sibling(path)
    stream = _temp_sibling(path, ".stream.tmp")
    replaced = False
    try:
        tables = _hf_tables(ds, features, shapes, col_names, n_rows, context_size, batch_rows, bfloat16)
        if file_format == "parquet":
            schema = features.arrow_schema
            schema = schema.with_metadata({**(schema.metadata or {}), b"activationscope.format": EXPORT_FORMAT.encode()})
            with pq.ParquetWriter(str(tmp), schema, compression="zstd") as writer:
                for t in tables:
                    writer.write_table(t)
        else:
            with pa.OSFile(str(stream), "wb") as sink, pa.ipc.new_stream(sink, features.arrow_schema) as writer:
                for t in tables:
                    writer.write_table(t)
            with _quiet_datasets():
                info = datasets.DatasetInfo(description=_HF_DESCRIPTION, features=features)  # marks it as ours
                datasets.Dataset.from_file(str(stream), info=info).save_to_disk(str(tmp))
        replaced = True  # (from here the export there before is gone)
        _remove(path)
        os.replace(tmp, path)
    except BaseException as e:
        _remove(tmp)
        _raise_write_failure(e, path, replaced)
        raise
    finally:
        stream.unlink(missing_ok=True)
    return path


#: The ``description`` of the ``DatasetInfo`` of an :func:`export_hf` folder: how a later
#: export knows the folder is one it may replace.
_HF_DESCRIPTION = f"{EXPORT_FORMAT}: rows of an activationscope store"


def _check_replaceable(path: Path, file_format: str) -> None:
    """An existing ``path`` is replaced only if it is what this export writes: an earlier
    export's Parquet file for Parquet (schema metadata ``activationscope.format``), an earlier
    export's ``save_to_disk`` directory (its ``dataset_info.json`` description; the
    ``cache-*.arrow`` files ``datasets`` wrote there when the export was loaded and
    transformed go with it) or an empty directory for Arrow. Any other ``datasets`` dataset
    is the user's and is left alone, and so is an earlier export folder holding any other
    file."""
    _check_parent(path)
    _refuse_special(path)
    if not path.exists() and not path.is_symlink():
        return
    if file_format == "parquet":
        if path.is_dir():
            raise ExportExistsError(f"export path {str(path)!r} must be a file for file_format='parquet', got a directory")
        try:
            earlier = b"activationscope.format" in (pq.read_schema(str(path)).metadata or {})
        except Exception:  # noqa: BLE001 - not a Parquet file
            earlier = False
        if not earlier:
            raise ExportExistsError(
                f"export path {str(path)!r} exists and is not an earlier export_hf Parquet file; it is left alone: "
                "remove it or choose another path"
            )
        return
    if not path.is_dir():
        raise ExportExistsError(
            f"export path {str(path)!r} must be a directory (a datasets save_to_disk layout) for "
            "file_format='arrow', got an existing file; remove it or choose another path"
        )
    entries = {p.name for p in path.iterdir()}
    if entries and not _is_hf_export(path):
        raise ExportExistsError(
            f"export path {str(path)!r} is a directory that is not an earlier export_hf export ({len(entries)} "
            "entries; a datasets folder of other data is not replaced either); it is left alone: remove it or "
            "choose another path"
        )
    import re

    others = sorted(e for e in entries if e not in ("state.json", "dataset_info.json")
                    and not re.fullmatch(r"data-\d{5}-of-\d{5}\.arrow", e)
                    and not _is_datasets_cache(path / e))
    if others:
        raise ExportExistsError(
            f"export path {str(path)!r} is an earlier export_hf export that now also holds {others[:4]}"
            f"{' ...' if len(others) > 4 else ''}, which the export did not write; it is left alone: move those "
            "away, or choose another path"
        )


def _is_datasets_cache(p: Path) -> bool:
    """Whether ``p`` is a cache file that ``datasets`` wrote next to a dataset it loaded from
    disk (``map``, ``filter``, ``sort``... of ``load_from_disk(path)``): a regular file named
    ``cache-*.arrow`` (the rule of ``Dataset.cleanup_cache_files``) holding an Arrow IPC
    stream. Such a file caches a transform of the earlier export, and goes with it."""
    if not (p.name.startswith("cache-") and p.name.endswith(".arrow")) or p.is_symlink() or not p.is_file():
        return False
    try:
        with pa.memory_map(str(p)) as f:
            pa.ipc.open_stream(f).schema  # noqa: B018 - reads the schema message only
    except Exception:  # noqa: BLE001 - not an Arrow stream: not a datasets cache file
        return False
    return True


def _is_hf_export(path: Path) -> bool:
    """Whether the folder ``path`` is a ``save_to_disk`` folder written by :func:`export_hf`."""
    if not (path / "state.json").is_file():
        return False
    try:
        info = json.loads((path / "dataset_info.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(info, dict) and info.get("description") == _HF_DESCRIPTION


def _remove(p: Path) -> None:
    import shutil

    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p)
    elif p.exists() or p.is_symlink():
        p.unlink()


class _quiet_datasets:
    """Hide ``datasets``' progress bars while it copies an export into place."""

    def __enter__(self) -> None:
        from datasets.utils import logging as hf_logging

        self._was = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()

    def __exit__(self, *exc: Any) -> None:
        from datasets.utils import logging as hf_logging

        if self._was:
            hf_logging.enable_progress_bar()


# ---------------------------------------------------------------------- pandas
def to_pandas(table: pa.Table, **kwargs: Any) -> Any:
    """An exported table as a pandas DataFrame, whatever the hook point column type.

    ``pa.Table.to_pandas(split_blocks=True)`` raises ``KeyError`` on fixed-shape tensor
    columns in pyarrow 26 (an upstream fault). This hands pandas the storage of such
    columns (fixed-size lists of ``prod(feature_shape)`` values) instead; other columns and
    the field metadata are unchanged.

    Parameters
    ----------
    table : pyarrow.Table
        E.g. ``pq.read_table(path)`` of :func:`export_parquet` or an Arrow IPC export.
    **kwargs
        Passed to ``pyarrow.Table.to_pandas`` (``split_blocks``, ``self_destruct``, ...).

    Returns
    -------
    pandas.DataFrame
        Hook point cells are flat numpy arrays ``(prod(feature_shape),)`` of the stored
        dtype (bfloat16 as uint16 bits, as in the file).
    """
    columns, fields = [], []
    for field, col in zip(table.schema, table.columns):
        if isinstance(field.type, pa.BaseExtensionType):
            storage = field.type.storage_type
            col = pa.chunked_array([c.storage for c in col.chunks], type=storage)
            field = pa.field(field.name, storage, field.nullable, field.metadata)
        columns.append(col)
        fields.append(field)
    return pa.Table.from_arrays(columns, schema=pa.schema(fields, metadata=table.schema.metadata)).to_pandas(**kwargs)


# ---------------------------------------------------------------------- reading back
class _MapBase:
    """A private (copy-on-write) memory map of a file and a uint8 tensor over all of it."""

    def __init__(self, path: str | os.PathLike) -> None:
        with open(path, "rb") as f:
            self.mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        self.bytes = torch.frombuffer(self.mm, dtype=torch.uint8)
        self.address = self.bytes.data_ptr()
        self.nbytes = self.bytes.numel()


def _buffer_view(buf: pa.Buffer, offset_bytes: int, nbytes: int, dtype: torch.dtype, base: _MapBase | None) -> torch.Tensor | None:
    if base is None or buf is None:
        return None
    start = buf.address - base.address + offset_bytes
    if start < 0 or start + nbytes > base.nbytes:
        return None
    item = torch.empty((), dtype=dtype).element_size()
    if start % item:
        return None
    return base.bytes[start : start + nbytes].view(dtype)


def _primitive_to_torch(values: pa.Array, base: _MapBase | None) -> torch.Tensor:
    if values.null_count:
        raise ArgumentValueError(f"cannot convert an Arrow array with {values.null_count} nulls to a tensor")
    if pa.types.is_boolean(values.type):
        return torch.from_numpy(values.to_numpy(zero_copy_only=False).copy())
    dtype = _ARROW_TO_TORCH.get(values.type)
    if dtype is None:
        raise ArgumentTypeError(f"Arrow type {values.type} has no torch dtype")
    item = values.type.bit_width // 8
    n = len(values)
    data = values.buffers()[1]
    view = _buffer_view(data, values.offset * item, n * item, dtype, base)
    if view is not None:
        return view
    arr = values.to_numpy(zero_copy_only=False)  # honours the offset
    return torch.from_numpy(arr.copy()).view(dtype) if arr.dtype.kind != "u" or dtype != torch.uint16 else torch.from_numpy(arr.astype(np.int32)).to(torch.uint16)


#: At most this many feature dimensions (as a store's ``feature_shape``, FORMAT.md §9 rule 8).
_MAX_FEATURE_DIMS = 32


def _feature_shape(raw: bytes, column_type: pa.DataType, storage_type: pa.DataType, shape: tuple[int, ...],
                   name: str) -> tuple[int, ...]:
    """The feature shape a hook point column's ``activationscope.shape`` field metadata
    (``raw``) gives, checked against the column: a JSON list of at most 32 ints >= 0 equal to
    a fixed-shape tensor's shape, whose product is a fixed-size list's size, and ``[]`` for a
    primitive column (``shape``: what the type says)."""
    def bad(constraint: str) -> ArgumentValueError:
        shown = raw.decode("utf-8", "replace")
        shown = shown if len(shown) <= 200 else shown[:200] + "..."
        return ArgumentValueError(
            f"column {name!r}: field metadata {_META_SHAPE.decode()} must be {constraint}, got {shown!r}; the file is "
            "damaged or was not written by export_arrow / export_parquet: export the store again"
        )

    try:
        got = json.loads(raw)
    except (ValueError, RecursionError):
        raise bad("a JSON list of ints") from None
    if not isinstance(got, list) or len(got) > _MAX_FEATURE_DIMS or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in got):
        raise bad(f"a JSON list of at most {_MAX_FEATURE_DIMS} ints >= 0")
    if isinstance(column_type, pa.FixedShapeTensorType):
        if tuple(got) != shape:
            raise bad(f"the column's fixed_shape_tensor shape {list(shape)}")
    elif pa.types.is_fixed_size_list(storage_type):
        if math.prod(got) != storage_type.list_size or not got:
            raise bad(f"a shape of {storage_type.list_size} values (the column's fixed_size_list size)")
    elif got:
        raise bad(f"[] (the column is {storage_type}, one value per row)")
    return tuple(got)


def arrow_to_torch(array: pa.Array | pa.ChunkedArray, field: pa.Field | None = None, _base: _MapBase | None = None) -> torch.Tensor:
    """A hook point column (or any primitive / fixed-size list / fixed-shape tensor array) as a tensor.

    Parameters
    ----------
    array : pyarrow.Array or ChunkedArray
        Honours the array's offset (sliced arrays) at every level.
    field : pyarrow.Field, optional
        Its field; ``activationscope.dtype = bfloat16`` metadata turns uint16 bit patterns
        back into ``torch.bfloat16``, and ``activationscope.shape`` restores the feature
        shape of fixed-size lists.

    Returns
    -------
    Tensor, (rows, *feature_shape), the stored dtype
        A copy, except for arrays read by :func:`read_arrow` (views of its map).

    Raises
    ------
    ArgumentValueError
        (``ArgumentTypeError`` for a type with no tensor equivalent, or no hook point column)
        Nulls, a type with no tensor equivalent, or an ``activationscope.shape`` that does not
        describe the column (not a JSON list of ints >= 0, another shape than a fixed-shape
        tensor's, another number of values than a fixed-size list's, not ``[]`` for a
        primitive column).
    """
    if isinstance(array, pa.ChunkedArray):
        parts = [arrow_to_torch(c, field, _base) for c in array.chunks]
        if len(parts) == 1:
            return parts[0]
        if not parts:  # no chunks (an Arrow file of 0 record batches): 0 rows of its type
            return arrow_to_torch(array.combine_chunks(), field, _base)
        return torch.cat(parts)
    shape: tuple[int, ...] = ()
    arr = array
    if isinstance(arr.type, pa.FixedShapeTensorType):
        shape = tuple(arr.type.shape)
        arr = arr.storage
        if math.prod(shape) != arr.type.list_size:
            raise ArgumentValueError(
                f"column of type {array.type}: its fixed_shape_tensor shape {list(shape)} holds {math.prod(shape)} "
                f"values, its storage {arr.type} {arr.type.list_size}; the file is damaged: export the store again")
    if pa.types.is_fixed_size_list(arr.type):
        if arr.null_count:
            raise ArgumentValueError(f"cannot convert a fixed-size list array with {arr.null_count} nulls")
        size = arr.type.list_size
        if not shape:
            shape = (size,)
        values = arr.flatten()  # honours the list array's offset (and the child's)
    elif pa.types.is_primitive(arr.type):
        values = arr
    else:
        raise ArgumentTypeError(f"Arrow type {arr.type} is not a hook point column (primitive, fixed-size list or fixed-shape tensor)")
    meta = (field.metadata or {}) if field is not None else {}
    if _META_SHAPE in meta:
        shape = _feature_shape(meta[_META_SHAPE], array.type, arr.type, shape, field.name)
    flat = _primitive_to_torch(values, _base)
    if meta.get(_META_DTYPE) == b"bfloat16" and flat.dtype == torch.uint16:
        flat = flat.view(torch.bfloat16)
    return flat.reshape(len(array), *shape)


def _column_to_python(col: pa.ChunkedArray | pa.Array, base: _MapBase) -> Any:
    t = col.type
    if pa.types.is_integer(t) or pa.types.is_floating(t):
        if col.null_count == 0 and t != pa.uint32() and t != pa.uint64():
            return arrow_to_torch(col, None, base)
    if pa.types.is_boolean(t) and col.null_count == 0:
        return torch.from_numpy(col.to_numpy(zero_copy_only=False).copy())
    return col.to_pylist()


def read_arrow(
    path: str | os.PathLike,
    columns: Iterable[str] | None = None,
    *,
    batches: bool = False,
) -> dict[str, Any] | list[dict[str, Any]]:
    """Read an Arrow IPC file written by :func:`export_arrow` as torch tensors.

    The file is memory-mapped privately (copy-on-write) and read with pyarrow without copying;
    each hook point column becomes a tensor view of the map.

    Parameters
    ----------
    path : str or os.PathLike
        An Arrow IPC file of :func:`export_arrow`. Uncompressed (``compression=None``, the
        default) its columns are read as views; a compressed one (``"lz4"``, ``"zstd"``) is
        decompressed into new memory (one copy).
    columns : list of str, optional
        Columns to read (default all).
    batches : bool, default False
        Return one dict per record batch (every tensor a view) instead of one dict.

    Returns
    -------
    dict or list of dict
        ``{hook point: Tensor (rows, *feature_shape), stored dtype (bfloat16 restored)}`` and
        ``{column: Tensor (rows,) | list}``. Views of the map when the file has one record
        batch (or with ``batches=True``); with several batches and ``batches=False`` each
        column is concatenated (one copy). Views keep the map alive; writing into them never
        changes the file.

    Raises
    ------
    ColumnNotFoundError
        A column of ``columns`` is not in the file.
    ArgumentValueError
        (``ArgumentTypeError`` for a type) A hook point column that cannot be read as a tensor: nulls, a type with no tensor
        equivalent, or field metadata ``activationscope.shape`` that does not describe it
        (see :func:`arrow_to_torch`).
    ArgumentValueError
        ``path`` is not an Arrow IPC file: a Parquet file, an Arrow stream, a folder (a
        ``--format hf`` export), an empty file or other bytes; the message names the path and
        how to read what it is.

    Example
    -------
    >>> acts = read_arrow("demo.arrow")["blocks.0.output"]   # doctest: +SKIP
    """
    batches = parse_flag(batches, "batches")
    _check_arrow_file(path)
    base = _MapBase(path)
    reader = pa.ipc.open_file(pa.py_buffer(base.mm))
    schema = reader.schema
    names = list(columns) if columns is not None else schema.names
    for name in names:
        if name not in schema.names:
            raise ColumnNotFoundError(f"column {name!r} is not in {os.fspath(path)!r}; it has {schema.names}")

    def convert(rb: pa.RecordBatch) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name in names:
            field = schema.field(name)
            col = rb.column(name)
            if _META_HP in (field.metadata or {}):
                out[name] = arrow_to_torch(col, field, base)
            else:
                out[name] = _column_to_python(col, base)
        return out

    parts = [convert(reader.get_batch(i)) for i in range(reader.num_record_batches)]
    if batches:
        return parts
    if len(parts) == 1:
        return parts[0]
    if not parts:  # an export of zero rows
        return convert(_empty_batch(schema))
    merged: dict[str, Any] = {}
    for name in names:
        vals = [p[name] for p in parts]
        merged[name] = torch.cat(vals) if isinstance(vals[0], torch.Tensor) else [x for v in vals for x in v]
    return merged


#: The first bytes of an Arrow IPC file, of a Parquet file, and of an Arrow IPC stream
#: (a continuation marker; streams have no magic bytes).
_ARROW_MAGIC, _PARQUET_MAGIC, _STREAM_START = b"ARROW1", b"PAR1", b"\xff\xff\xff\xff"


def _check_arrow_file(path: str | os.PathLike) -> None:
    """Refuse what :func:`read_arrow` cannot map as an Arrow IPC file, saying what it is and
    how to read it (pyarrow's own error names neither the path nor the fix)."""
    where = repr(os.fspath(path))
    if os.path.isdir(path):
        raise ArgumentValueError(
            f"read_arrow: {where} is a folder, not an Arrow IPC file: read a store with open_store(path) or "
            "ActivationDataset(path), a Hugging Face datasets export (export_hf, --format hf) with "
            "datasets.load_from_disk(path)"
        )
    with open(path, "rb") as f:  # (a missing path: FileNotFoundError, which names it)
        head = f.read(len(_ARROW_MAGIC))
    if head == _ARROW_MAGIC:
        return
    if not head:
        what = "is empty"
    elif head.startswith(_PARQUET_MAGIC):
        what = ("is a Parquet file (export_parquet, --format parquet): read it with pyarrow.parquet.read_table(path), "
                "and a hook point column as a tensor with arrow_to_torch(table[name], table.schema.field(name))")
    elif head.startswith(_STREAM_START):
        what = ("is an Arrow IPC stream, not a file: read it with pyarrow.ipc.open_stream(path).read_all(), "
                "and a hook point column as a tensor with arrow_to_torch(table[name], table.schema.field(name))")
    else:
        what = f"does not start with the Arrow file magic {_ARROW_MAGIC!r} (got {head!r})"
    raise ArgumentValueError(
        f"read_arrow: {where} {what}" + ("" if "read it" in what else "; give a file written by export_arrow "
                                          "(activationscope export --format arrow)")
    )


def _empty_batch(schema: pa.Schema) -> pa.RecordBatch:
    return pa.RecordBatch.from_arrays([pa.array([], type=f.type) for f in schema], schema=schema)
