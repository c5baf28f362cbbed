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
- dtypes as stored: float32/float64/float16 and integers as the Arrow type of that name.
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

import json
import mmap
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from ..errors import ActivationScopeError, ArgumentValueError
from .dataset import ActivationDataset

__all__ = ["export_arrow", "export_parquet", "read_arrow", "arrow_to_torch", "EXPORT_FORMAT"]

EXPORT_FORMAT = "activationscope-export/1"
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


def _hook_point_field(name: str, dtype: torch.dtype, shape: tuple[int, ...], tensor_type: str) -> pa.Field:
    if dtype not in _TORCH_TO_ARROW:
        raise ActivationScopeError(f"hook point {name!r} has dtype {dtype}, which export does not support")
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


def _dataset_for(source: Any, hook_points: Any, columns: Any, rows: Any, filter: Any) -> ActivationDataset:
    if isinstance(source, ActivationDataset):
        if hook_points is None and columns is None and rows is None and filter is None:
            return source
        source = source.source
    ds = ActivationDataset(source, hook_points=hook_points, rows=rows, filter=filter)
    table = ds._row_table()
    chosen = table.column_names if columns is None else ([columns] if isinstance(columns, str) else list(columns))
    missing = [c for c in chosen if c not in table.column_names]
    if missing:
        raise ArgumentValueError(f"columns {missing} are not in the {ds.row_kind} row table; it has {table.column_names}")
    ds._export_columns = chosen  # type: ignore[attr-defined]
    return ds


def _schema(ds: ActivationDataset, col_names: list[str], tensor_type: str) -> pa.Schema:
    if tensor_type not in ("fixed_shape_tensor", "fixed_size_list"):
        raise ArgumentValueError(f"tensor_type must be one of ['fixed_shape_tensor', 'fixed_size_list'], got {tensor_type!r}")
    fields = []
    for hp in ds.hook_points:
        fields.append(_hook_point_field(hp, ds.source.dtype(hp), ds.source.feature_shape(hp), tensor_type))
    table = ds._row_table()
    for name in col_names:
        if name in ds.hook_points:
            raise ArgumentValueError(f"row-table column {name!r} clashes with a hook point of the same name")
        f = table.schema.field(name)
        fields.append(pa.field(name, _large(f.type), f.nullable, f.metadata))
    meta = {b"activationscope.row_kind": ds.row_kind.encode(), b"activationscope.format": EXPORT_FORMAT.encode()}
    return pa.schema(fields, metadata=meta)


def _record_batches(ds: ActivationDataset, schema: pa.Schema, col_names: list[str], batch_rows: int):
    table = ds._row_table()
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


def _export(kind: str, source: Any, path: Any, hook_points: Any, columns: Any, batch_rows: int,
            rows: Any, filter: Any, tensor_type: str, compression: Any) -> Path:
    if not isinstance(batch_rows, int) or batch_rows < 1:
        raise ArgumentValueError(f"batch_rows must be a positive int, got {batch_rows!r}")
    ds = _dataset_for(source, hook_points, columns, rows, filter)
    col_names = getattr(ds, "_export_columns", None)
    if col_names is None:
        col_names = ds._row_table().column_names if columns is None else list(ds.columns)
    schema = _schema(ds, col_names, tensor_type)
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
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
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def export_arrow(
    store: Any,
    path: str | os.PathLike,
    hook_points: str | Iterable[str] | None = None,
    columns: str | Iterable[str] | None = None,
    batch_rows: int = 65536,
    *,
    rows: Any = None,
    filter: Any = None,
    tensor_type: str = "fixed_shape_tensor",
    compression: str | None = None,
) -> Path:
    """Write rows of a store to an Arrow IPC file (``.arrow``, the Feather v2 format).

    Parameters
    ----------
    store : str, os.PathLike, store object or ActivationDataset
        The rows to export (a dataset exports its own selection).
    path : str or os.PathLike
        The file to write (replaced atomically).
    hook_points : str or list of str, optional
        Hook points (patterns allowed) to export, one column each; default all, which must
        share a row kind and row count.
    columns : str or list of str, optional
        Row-table columns; default all of them.
    batch_rows : int, default 65536
        Rows per record batch: bounds memory during export (a batch of rows of every hook
        point is held at once).
    rows, filter
        Row selection, as :class:`ActivationDataset`.
    tensor_type : {"fixed_shape_tensor", "fixed_size_list"}
        Arrow type of hook point columns (see the module docstring).
    compression : {None, "lz4", "zstd"}
        IPC buffer compression. Compressed files cannot be read zero-copy.

    Returns
    -------
    pathlib.Path
        ``path``.

    Example
    -------
    >>> export_arrow("runs/demo.zarr", "demo.arrow", hook_points=["blocks.0.output"])  # doctest: +SKIP
    >>> acts = read_arrow("demo.arrow")["blocks.0.output"]                             # doctest: +SKIP
    """
    return _export("arrow", store, path, hook_points, columns, batch_rows, rows, filter, tensor_type, compression)


def export_parquet(
    store: Any,
    path: str | os.PathLike,
    hook_points: str | Iterable[str] | None = None,
    columns: str | Iterable[str] | None = None,
    batch_rows: int = 65536,
    *,
    rows: Any = None,
    filter: Any = None,
    tensor_type: str = "fixed_shape_tensor",
    compression: str | None = "zstd",
) -> Path:
    """Write rows of a store to a Parquet file, one row group per ``batch_rows`` rows.

    Same columns, types and metadata as :func:`export_arrow` (pyarrow restores the
    fixed-shape tensor type and field metadata from the file's stored Arrow schema; other
    readers see hook point columns as lists of ``prod(feature_shape)`` values).

    Parameters
    ----------
    compression : str or None, default "zstd"
        Parquet codec (``"snappy"``, ``"zstd"``, ``None``...).
    others
        As :func:`export_arrow`.

    Returns
    -------
    pathlib.Path
        ``path``.
    """
    return _export("parquet", store, path, hook_points, columns, batch_rows, rows, filter, tensor_type, compression)


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
        raise ActivationScopeError(f"cannot convert an Arrow array with {values.null_count} nulls to a tensor")
    if pa.types.is_boolean(values.type):
        return torch.from_numpy(values.to_numpy(zero_copy_only=False).copy())
    dtype = _ARROW_TO_TORCH.get(values.type)
    if dtype is None:
        raise ActivationScopeError(f"Arrow type {values.type} has no torch dtype")
    item = values.type.bit_width // 8
    n = len(values)
    data = values.buffers()[1]
    view = _buffer_view(data, values.offset * item, n * item, dtype, base)
    if view is not None:
        return view
    arr = values.to_numpy(zero_copy_only=False)  # honours the offset
    return torch.from_numpy(arr.copy()).view(dtype) if arr.dtype.kind != "u" or dtype != torch.uint16 else torch.from_numpy(arr.astype(np.int32)).to(torch.uint16)


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
    ActivationScopeError
        Nulls, or a type with no tensor equivalent.
    """
    if isinstance(array, pa.ChunkedArray):
        parts = [arrow_to_torch(c, field, _base) for c in array.chunks]
        if len(parts) == 1:
            return parts[0]
        if not parts:
            raise ActivationScopeError("cannot convert an empty ChunkedArray without chunks")
        return torch.cat(parts)
    shape: tuple[int, ...] = ()
    arr = array
    if isinstance(arr.type, pa.FixedShapeTensorType):
        shape = tuple(arr.type.shape)
        arr = arr.storage
    if pa.types.is_fixed_size_list(arr.type):
        if arr.null_count:
            raise ActivationScopeError(f"cannot convert a fixed-size list array with {arr.null_count} nulls")
        size = arr.type.list_size
        if not shape:
            shape = (size,)
        values = arr.flatten()  # honours the list array's offset (and the child's)
    elif pa.types.is_primitive(arr.type):
        values = arr
    else:
        raise ActivationScopeError(f"Arrow type {arr.type} is not a hook point column (primitive, fixed-size list or fixed-shape tensor)")
    meta = (field.metadata or {}) if field is not None else {}
    if _META_SHAPE in meta and shape:
        shape = tuple(json.loads(meta[_META_SHAPE]))
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
        An uncompressed Arrow IPC file (``export_arrow(..., compression=None)``).
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

    Example
    -------
    >>> acts = read_arrow("demo.arrow")["blocks.0.output"]   # doctest: +SKIP
    """
    base = _MapBase(path)
    reader = pa.ipc.open_file(pa.py_buffer(base.mm))
    schema = reader.schema
    names = list(columns) if columns is not None else schema.names
    for name in names:
        if name not in schema.names:
            raise KeyError(f"column {name!r} is not in {os.fspath(path)!r}; it has {schema.names}")

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


def _empty_batch(schema: pa.Schema) -> pa.RecordBatch:
    return pa.RecordBatch.from_arrays([pa.array([], type=f.type) for f in schema], schema=schema)
