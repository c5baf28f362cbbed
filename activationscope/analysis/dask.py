"""Stores bigger than one process's memory: Dask arrays and data frames over a store.

Dask (``dask.array``, ``dask.dataframe``, ``dask.distributed``) does the scheduling, the
spilling and the cluster; this module only describes a store's committed rows to it:

- :func:`to_dask`: one hook point as a ``dask.array`` whose blocks are the store's shards
  (one task reads one shard), only the committed rows, the stored dtype (bfloat16 as
  ``ml_dtypes.bfloat16``);
- :func:`row_table_dask`: a row table as a ``dask.dataframe`` (one partition per committed
  Parquet part);
- :func:`moments` and :func:`pca`: float64 reductions over such an array, computed by
  whatever scheduler is active (threads, processes, or a ``dask.distributed`` cluster).

The task graphs hold only zarr-python, numpy and pandas callables, and the shard reader of
``activationscope._safeio`` (numpy, numcodecs, google_crc32c): a worker reading them never
imports torch (so a worker's memory limit is about the data). A local store's shards are read
as the store's own reader reads them: regular files inside the store only, every index and
every chunk's crc32c checked (a store damaged or replaced after the graph was made is an error
of ours, never other rows).

Needs the ``dask`` extra: ``pip install 'activationscope[dask]'``.

Example
-------
>>> import dask
>>> from activationscope.analysis.dask import to_dask, pca
>>> x = to_dask("runs/demo.zarr", "encoder.layer.0.output")   # doctest: +SKIP
>>> x.mean(axis=0, dtype="float64").compute()                  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import (ArgumentTypeError, ArgumentValueError, NonFiniteRowsWarning, StoreCorruptError, StoreError,
                      warn_at_caller)
from ..store import _format as F
from ..store import _validate as V
from ..store._backend import LocalBackend
from ..store.reader import Store, open_store

__all__ = ["to_dask", "row_table_dask", "moments", "pca", "numpy_dtype"]


def _require(module: str) -> Any:
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(
            f"{module} is needed for Dask analysis but is not installed ({e}); install the extra: "
            "pip install 'activationscope[dask]'"
        ) from None


def numpy_dtype(dtype_name: str) -> np.dtype:
    """The numpy dtype of a stored torch dtype name; ``"bfloat16"`` -> ``ml_dtypes.bfloat16``.

    Parameters
    ----------
    dtype_name : str
        A dtype name of FORMAT.md (``"float32"``, ``"bfloat16"``, ``"int64"``, ``"bool"``, ...).

    Raises
    ------
    ArgumentValueError
        A name the format does not have.
    """
    if dtype_name == "bfloat16":
        return np.dtype(_require("ml_dtypes").bfloat16)
    if dtype_name not in F.SUPPORTED_DTYPES:
        raise ArgumentValueError(f"dtype must be one of {list(F.SUPPORTED_DTYPES)}, got {dtype_name!r}")
    return np.dtype("bool" if dtype_name == "bool" else dtype_name)


def _open(store: Any, storage_options: dict | None) -> Store:
    if isinstance(store, Store):
        return store
    return open_store(store, storage_options=storage_options)


def to_dask(store: Any, hook_point: str, *, storage_options: dict | None = None) -> Any:
    """The committed rows of a hook point as a lazy ``dask.array``, one block per shard.

    Parameters
    ----------
    store : str, os.PathLike, zarr Store or :class:`~activationscope.store.Store`
        A local path, an fsspec URL (``s3://...``) or an opened store.
    hook_point : str
    storage_options : dict, optional
        fsspec options of a URL.

    Returns
    -------
    dask.array.Array, (rows, *feature_shape)
        ``rows`` = the committed ``n_rows`` of the root metadata at the time of the call (rows
        written after it, or past the last commit, are never read). Blocks along ``rows`` are
        the shards (``shard_rows`` rows each, the last one shorter); feature dimensions are
        whole. dtype: the stored dtype as numpy; bfloat16 is ``ml_dtypes.bfloat16`` (the
        stored uint16 bit patterns reinterpreted, bit-exact; ``.astype("float32")`` is
        exact). Each block is read (decoded when compressed) when computed, a copy (nothing
        stays mapped): for a local store by :func:`activationscope._safeio.read_shard`, which
        checks the shard's index and every chunk's crc32c (FORMAT.md section 9) in the
        worker; for a remote store through zarr-python.

    Raises
    ------
    HookPointNotFoundError
        ``hook_point`` is not in the store.
    StoreCorruptError
        The array's ``zarr.json`` disagrees with the root metadata (shape, dtype, chunks),
        or is missing while rows are committed; when computed (local stores), a shard that
        is missing, damaged or does not match its manifest crc32c (named).
    StoreError
        When computed (local stores): the store was replaced since the graph was made.
    ImportError
        dask (or ml_dtypes for bfloat16) is not installed.

    Example
    -------
    >>> x = to_dask("runs/demo.zarr", "encoder.layer.0.output")     # doctest: +SKIP
    >>> x.astype("float64").mean(axis=0).compute()                   # doctest: +SKIP
    """
    da = _require("dask.array")
    import zarr

    st = _open(store, storage_options)
    meta = st._meta(hook_point)
    if st._parts:  # an uncommitted multi-rank store: its rank stores' rows, rank after rank
        pieces = [to_dask(sub, hook_point) for _, sub, _ in st._parts.get(hook_point, [])
                  if sub.n_rows(hook_point)]
        if pieces:
            return da.concatenate(pieces, axis=0)
    if not st._parts:
        st._array_crcs(meta)  # the root's entry against the array's own files (FORMAT.md section 9 rules 16-17)
    n = int(meta["n_rows"])
    feat = tuple(int(d) for d in meta["feature_shape"])
    shard_rows = int(meta["shard_rows"])
    dtype = numpy_dtype(meta["dtype"])
    if n < 0 or shard_rows <= 0:
        raise StoreCorruptError(f"hook point {hook_point!r}: n_rows {n} / shard_rows {shard_rows} in the metadata are invalid")
    if n == 0:
        return da.zeros((0, *feat), dtype=dtype, chunks=(shard_rows, *feat))
    try:
        arr = zarr.open_array(st._backend.zarr_store(read_only=True), path=meta["path"], mode="r")
    except StoreError:
        raise
    except Exception as e:  # zarr raises several classes for a missing or broken document
        raise StoreCorruptError(
            f"hook point {hook_point!r}: the array {meta['path']!r} of store {st.path!r} cannot be opened ({e}) "
            f"although {n} rows are committed; run verify"
        ) from e
    stored = np.dtype(F.zarr_dtype(meta["dtype"]))
    want_chunks = (shard_rows, *(max(1, d) for d in feat))
    problems = []
    if tuple(arr.shape[1:]) != feat or arr.shape[0] < n:
        problems.append(f"shape {tuple(arr.shape)} does not hold ({n}, *{feat})")
    if arr.dtype != stored:
        problems.append(f"data type {arr.dtype} is not {stored}")
    shards = tuple(getattr(arr, "shards", None) or arr.chunks)
    if shards != want_chunks:
        problems.append(f"shard shape {shards} is not {want_chunks}")
    if problems:
        raise StoreCorruptError(
            f"hook point {hook_point!r}: the array document {meta['path']}/zarr.json disagrees with the root "
            f"metadata of {st.path!r}: {'; '.join(problems)}"
        )
    if V.row_bytes(meta) > 0:
        x = _checked_shards(st, meta, n, stored)
    else:  # rows of 0 bytes: nothing to read or check
        x = da.from_zarr(arr, chunks=(shard_rows, *feat))[:n]
    if meta["dtype"] == "bfloat16":
        x = x.view(dtype)
    return x


def _checked_shards(st: Store, meta: dict, n: int, stored: np.dtype) -> Any:
    """A dask array of the committed rows of an array, one task per shard.

    Each task is :func:`activationscope._safeio.read_shard` (a local store) or
    :func:`~activationscope._safeio.read_remote_shard` (object storage, fsspec: byte-range
    reads through the zarr ``Store``); numpy, numcodecs, google_crc32c and zarr only, no
    torch in the workers. The shard is opened as the reader opens it (local: a regular file
    inside the store, non-blocking), its index checked, and every chunk checked against its
    manifest crc32c (taken here, when the graph is made) and its decoded size before it is
    decoded; a store replaced since is named as such.
    """
    import dask.array as da
    from dask.base import tokenize

    from .._safeio import read_remote_shard, read_shard

    crcs = st._array_crcs(meta)  # n_rows checked against the array's files; each chunk's crc32c
    feat = tuple(int(d) for d in meta["feature_shape"])
    chunk_rows, shard_rows = int(meta["chunk_rows"]), int(meta["shard_rows"])
    n_chunks = shard_rows // chunk_rows
    run = list(st._run)
    if isinstance(st._backend, LocalBackend):
        root = str(st._backend.root)
        task: tuple = (read_shard, root)
    else:
        root = str(st._backend)
        task = (read_remote_shard, st._backend.zarr_store(read_only=True), root)
    name = "activationscope-shard-" + tokenize(root, meta["path"], n, run)
    dsk, sizes = {}, []
    for k in range(-(-n // shard_rows)):
        rows = min(shard_rows, n - k * shard_rows)
        committed = -(-rows // chunk_rows)
        spec = {
            "key": F.shard_key(meta["path"], k, len(feat)), "rows": rows, "first_row": k * shard_rows,
            "chunk_rows": chunk_rows, "n_chunks": n_chunks, "row_bytes": V.row_bytes(meta),
            "codec": meta.get("compression"), "dtype": stored.str, "feature_shape": feat, "run": run,
            "chunks": {j: (crcs[(k, j)][1], crcs[(k, j)][2]) for j in range(committed) if (k, j) in crcs},
            # (for the message of a shard whose file is not the size its manifest recorded)
            "file_bytes": st._recorded_bytes(meta, k), "manifest": meta.get("manifest"),
        }
        dsk[(name, k) + (0,) * len(feat)] = (*task, spec)
        sizes.append(rows)
    return da.Array(dsk, name, chunks=(tuple(sizes), *((d,) for d in feat)), dtype=stored)


def row_table_dask(store: Any, kind: str = "sample", *, storage_options: dict | None = None) -> Any:
    """A row table as a ``dask.dataframe``: one partition per committed Parquet part.

    Parameters
    ----------
    store : str, os.PathLike, zarr Store or :class:`~activationscope.store.Store`
    kind : {"sample", "token"}
    storage_options : dict, optional
        fsspec options of a URL.

    Returns
    -------
    dask.dataframe.DataFrame
        Rows in row-table order (partition ``p`` is part ``p``); row *i* describes row *i* of
        every ``kind`` array whose ``follows_row_table`` is true. The index is that row
        number *i* (int64, over the whole table, not restarting in each partition; divisions
        known when no part is empty), so ``ddf[ddf.label == 1].index`` selects the rows of
        ``to_dask(store, hp)``. Only the parts listed in
        the root metadata are read. Each partition is read when computed, checked as
        :meth:`Store.row_table` checks its parts (FORMAT.md section 9 rule 15): a regular
        file inside the store, its crc32c when recorded, its rows and ``batch`` column as its
        Parquet footer said when the graph was made (the footers' row counts sum to the
        metadata's ``n_rows``, checked here). Parts whose schemas differ (a user column first
        seen in a later forward) or repeat a column name, parts without ``batch`` statistics
        in their footers, and an uncommitted multi-rank store are read eagerly with
        :meth:`Store.row_table` and split into as many partitions.

    Raises
    ------
    ValueError
        ``kind`` is not "sample" or "token".
    StoreCorruptError
        A listed part is missing, has no readable Parquet footer, lacks a required column or
        holds one of another type (FORMAT.md section 4), or the parts hold another number of
        rows than the metadata's ``n_rows`` (named); when computed, a part that is damaged,
        lacks a required column or disagrees with its footer (named).
    StoreError
        When computed: the store was replaced since the graph was made.
    """
    dd = _require("dask.dataframe")
    if kind not in ("sample", "token"):
        raise ArgumentValueError(f"kind must be one of ['sample', 'token'], got {kind!r}")
    st = _open(store, storage_options)
    info = (st.attrs.get("row_tables") or {}).get(kind) or {}
    parts = list(info.get("parts", []))
    for key in parts:
        if not isinstance(key, str) or not key.startswith(f"rows/{kind}/") or ".." in key.split("/"):
            raise StoreCorruptError(f"row table {kind!r}: part key {key!r} in the metadata of {st.path!r} is not under rows/{kind}/")
    specs = _part_specs(st, kind, info, parts) if parts and not st._parts else None
    if specs is not None:
        import pyarrow as pa

        schema = specs.pop()
        meta = pa.Table.from_batches([], schema=schema).to_pandas()
        local = isinstance(st._backend, LocalBackend)
        root = str(st._backend.root) if local else str(st._backend)
        zstore = None if local else st._backend.zarr_store(read_only=True)
        # the index is the row number: partition p holds rows [first_row, first_row + n_rows)
        starts = [sp["first_row"] for sp in specs]
        divisions = (*starts, starts[-1] + specs[-1]["n_rows"] - 1) \
            if all(sp["n_rows"] for sp in specs) else None  # (a part of 0 rows: divisions unknown)
        return dd.from_map(_read_part, [root] * len(specs), [zstore] * len(specs), specs, meta=meta,
                           divisions=divisions, enforce_metadata=False)
    table = st.row_table(kind).to_pandas()
    return dd.from_pandas(table, npartitions=max(1, len(parts)), sort=False)


def _part_specs(st: Store, kind: str, info: dict, parts: list[str]) -> list | None:
    """The tasks of :func:`row_table_dask`'s partitions (one per part, then the parts' common
    Arrow schema), from each part's Parquet footer (:func:`_footer`), or None where the parts must be read
    eagerly (:meth:`Store.row_table`, which checks them all): schemas that differ or repeat a
    column name, footers without ``batch`` statistics to check the parts' order by.

    Raises StoreCorruptError naming the part when a listed part is missing, not a regular file
    inside the store, or has no readable footer, or its footer's row counts disagree with
    themselves or say more rows than the metadata's ``n_rows`` leaves after the parts before
    it, and naming both counts when the footers hold another number of rows than the
    metadata's ``n_rows`` (FORMAT.md section 9 rule 15)."""
    from .._safeio import _footer_row_count_problem

    dist = st.attrs.get("distributed")
    by_rank = isinstance(dist, dict) and dist.get("committed") is True
    crcs = info.get("crc32c") if isinstance(info.get("crc32c"), dict) else {}
    run = list(st._run)
    specs: list = []
    schema = None
    with st._reads_of_the_opened_run():  # the footers of the opened run (the root checked once they are read)
        footers = [_footer(st, kind, key) for key in parts]
    n_rows = info.get("n_rows")
    seen = 0  # (the rows of the parts before, by their footers)
    for key, footer in zip(parts, footers):
        # its row counts agree with themselves and leave the table's n_rows for the parts after
        # (a part that says 2**31 rows, and one after that says -2**31, sum to n_rows): the
        # worker reads it no larger than that (Parquet allocates by what its footer says)
        lie = _footer_row_count_problem(footer, n_rows - seen if isinstance(n_rows, int) else None)
        if lie is not None:
            raise V.corrupt(st._backend, f"row table {kind!r}: part {key!r} {lie}")
        seen += footer.num_rows
        part_schema = footer.schema.to_arrow_schema()
        problem = V.row_part_problem(part_schema, kind, by_rank)  # (its required columns: FORMAT.md section 4)
        if problem is not None:
            raise V.corrupt(st._backend, f"row table {kind!r}: part {key!r} {problem}")
        names = part_schema.names
        if len(set(names)) != len(names) or (schema is not None and not part_schema.equals(schema)):
            return None
        schema = part_schema
        try:
            batch = _batch_range(footer, names)
        except Exception:  # noqa: BLE001 - statistics pyarrow cannot give: the eager read checks the rows
            batch = None
        if batch is None:
            return None
        if specs and not by_rank and batch[0] < specs[-1]["batch"][1]:
            return None  # parts out of order: the eager read names the row where the batch goes back
        first = specs[-1]["first_row"] + specs[-1]["n_rows"] if specs else 0
        specs.append({"key": key, "kind": kind, "n_rows": footer.num_rows, "first_row": first, "batch": batch,
                      "crc32c": crcs.get(key), "by_rank": by_rank, "run": run})
    if by_rank and len(specs) > 1:
        return None  # (the order is per rank: checked on the whole table)
    total = sum(sp["n_rows"] for sp in specs)
    if "n_rows" in info and total != int(info["n_rows"]):
        raise V.corrupt(st._backend, f"row table {kind!r} has {total} rows in its parts, but the metadata says "
                                     f"n_rows {info['n_rows']}")
    return [*specs, schema]


def _footer(st: Store, kind: str, key: str) -> Any:
    """The Parquet footer (``pyarrow.parquet.FileMetaData``) of row-table part ``key``, read
    through the store's backend (its last bytes only: a regular file inside the store).

    Raises StoreCorruptError naming the part when it is missing or has no readable footer."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    end = st._backend.tail(key, 8)
    if end is None:
        raise V.corrupt(st._backend, f"row table {kind!r}: part {key!r} listed in the metadata is missing")
    size, last = end
    problem = None
    n = int.from_bytes(last[:4], "little") if len(last) == 8 else -1
    if len(last) < 8 or last[4:] != b"PAR1":
        problem = f"it does not end with a Parquet footer ({size} bytes)"
    elif n + 12 > size or n > V.MAX_JSON_BYTES:
        problem = f"its footer of {n} bytes does not fit in its {size} bytes"
    else:
        got = st._backend.tail(key, n + 8)
        try:
            if got is None or got[0] != size:
                raise ValueError("the file changed while its footer was read")
            footer = pq.read_metadata(pa.BufferReader(b"PAR1" + got[1]))
            footer.schema.to_arrow_schema()  # (raises on a schema Arrow cannot read)
            return footer
        except Exception as e:  # noqa: BLE001 - pyarrow raises ArrowInvalid / OSError / ...
            problem = f"{type(e).__name__}: {e}"
    raise V.corrupt(st._backend, f"row-table part {key!r} is not a readable Parquet file ({problem})")


def _batch_range(footer: Any, names: list[str]) -> tuple[int, int] | None:
    """(min, max) of a part's integer ``batch`` column from its footer's statistics ((0, 0)
    for no rows); None when it has none to give."""
    if "batch" not in names:
        return None
    if footer.num_rows == 0:
        return (0, 0)
    col = names.index("batch")
    lo, hi = [], []
    for g in range(footer.num_row_groups):
        c = footer.row_group(g).column(col)
        stats = c.statistics
        if c.num_values == 0:
            continue
        if stats is None or not stats.has_min_max or stats.null_count != 0:
            return None
        if type(stats.min) is not int or type(stats.max) is not int:
            return None
        lo.append(stats.min)
        hi.append(stats.max)
    return (min(lo), max(hi)) if lo else None


def _read_part(root: str, zarr_store: Any, spec: dict) -> Any:
    """One partition of :func:`row_table_dask`: the part ``spec["key"]`` as a pandas frame,
    read and checked as :meth:`Store.row_table` checks it (a Dask task: no torch).

    The part is read as a regular file inside the store (local) or through the zarr store
    (object storage), its crc32c (when recorded) checked, and its rows counted and its
    ``batch`` column checked against its footer as read when the graph was made (integers
    without nulls that never go back; per ``rank`` in a store committed from rank stores).

    Raises
    ------
    StoreCorruptError
        The part is missing, damaged (crc32c, Parquet), or disagrees with its footer; named.
    StoreError
        The store was replaced since the graph was made, or removed; or a commit since merged
        the part with others (FORMAT.md section 4): the root no longer lists it.
    """
    from .._safeio import _changed_since_graph, _remote_run, _run

    try:
        part = _checked_part(root, zarr_store, spec)
    except StoreCorruptError:
        now = _run(root) if zarr_store is None else _remote_run(zarr_store)
        if now != tuple(spec["run"]):
            raise _changed_since_graph(root, now) from None
        if _merged_since(root, zarr_store, spec):
            raise StoreError(f"store at {root!r}: row-table part {spec['key']!r} of the Dask graph was merged with "
                             "other parts by a commit since the graph was made (a capture is writing the store); "
                             "make the graph again (row_table_dask) of the store as it is now") from None
        raise
    if spec["crc32c"] is None:  # (no crc32c to tell another run's part: the root read after the part)
        now = _run(root) if zarr_store is None else _remote_run(zarr_store)
        if now != tuple(spec["run"]):
            raise _changed_since_graph(root, now)
    return part


def _merged_since(root: str, zarr_store: Any, spec: dict) -> bool:
    """Whether the root of the store (of the graph's run) now lists no part ``spec["key"]`` of
    its table: a commit merged it with others (FORMAT.md section 4), its rows in the parts listed."""
    import json
    import os

    from .._safeio import MAX_JSON_BYTES, _remote_get, read_regular

    try:
        if zarr_store is None:
            raw = read_regular(os.path.join(root, "zarr.json"), store=root, key="zarr.json", max_bytes=MAX_JSON_BYTES)
        else:
            raw = _remote_get(zarr_store, root, "zarr.json")
        tables = json.loads(raw or b"null")["attributes"]["activationscope"]["row_tables"]
        parts = tables[spec["kind"]]["parts"]
    except (StoreError, ValueError, KeyError, TypeError):
        return False
    return isinstance(parts, list) and spec["key"] not in parts


def _checked_part(root: str, zarr_store: Any, spec: dict) -> Any:
    import os

    import pandas as pd
    import pyarrow.compute as pc

    from .._safeio import (MAX_FILE_BYTES, _inside, _remote_get, batch_order, corrupt, crc32c, read_parquet_part,
                          read_regular, row_part_problem)

    key, kind = spec["key"], spec["kind"]
    if zarr_store is None:
        path = os.path.join(root, key)
        real = os.path.realpath(path)
        if not _inside(real, os.path.realpath(root)):
            raise corrupt(root, f"{key!r} resolves to {real!r}, outside the store (a symlink leaving the store)")
        raw = read_regular(path, store=root, key=key, max_bytes=MAX_FILE_BYTES)
    else:
        raw = _remote_get(zarr_store, root, key)
    if raw is None:
        raise corrupt(root, f"row-table part {key!r} listed in the metadata is missing")
    if spec["crc32c"] is not None and crc32c(raw) != spec["crc32c"]:
        raise corrupt(root, f"row table {kind!r}: part {key!r}: crc32c mismatch (recorded {spec['crc32c']}, "
                            f"computed {crc32c(raw)})")
    # (no more rows than its footer said when the graph was made, which the table's n_rows bounds:
    # the file read now may be another)
    table = read_parquet_part(raw, root, key, max_rows=spec["n_rows"])
    batch = table.column("batch") if "batch" in table.column_names else None
    found = batch_order(table, spec["by_rank"]) if batch is not None else ("type", ("batch",))
    problem = row_part_problem(table.schema, kind, spec["by_rank"], table)  # (its required columns)
    if problem is not None:
        pass  # (named first: the checks below read its batch column)
    elif table.num_rows != spec["n_rows"]:
        problem = f"holds {table.num_rows} rows, but its footer said {spec['n_rows']} when the graph was made"
    elif found is not None and found[0] == "type":
        problem = f"has no {found[1][0]} column of integers without nulls"
    elif found is not None:
        problem = "has a batch column that goes back: its rows are not in the order they were written"
    elif table.num_rows and (int(pc.min(batch).as_py()), int(pc.max(batch).as_py())) != tuple(spec["batch"]):
        problem = "has batch values other than its footer's statistics"
    if problem is not None:
        raise corrupt(root, f"row table {kind!r}: part {key!r} {problem}")
    frame = table.to_pandas()
    frame.index = pd.RangeIndex(spec["first_row"], spec["first_row"] + len(frame))  # the rows' numbers in the store
    return frame


def _rows_named(rows: np.ndarray, n: int) -> str:
    """``"rows 3, 17, ..."``: the first 10 row indices of ``rows`` (of ``n`` rows)."""
    shown = ", ".join(str(int(r)) for r in rows[:10]) + (", ..." if len(rows) > 10 else "")
    return f"{len(rows)} of the {n} rows (row {shown})" if len(rows) == 1 else f"{len(rows)} of the {n} rows (rows {shown})"


def _nonfinite_rows(x64: Any) -> tuple[Any, Any]:
    """(a (rows, 1) dask bool array: the row is finite; the indices of the other rows, lazy)."""
    da = _require("dask.array")
    finite = da.isfinite(x64).all(axis=tuple(range(1, x64.ndim))) if x64.ndim > 1 else da.isfinite(x64)
    return finite.reshape(-1, *([1] * (x64.ndim - 1))), da.flatnonzero(~finite)


def _check_real(x: Any, what: str) -> None:
    """ArgumentTypeError for a complex dask array: its float64 statistics would drop the
    imaginary parts."""
    if np.dtype(x.dtype).kind == "c":
        raise ArgumentTypeError(
            f"{what} needs real values, got a {np.dtype(x.dtype).name} array (float64 statistics of it would drop "
            f"the imaginary parts); pass x.real, x.imag or abs(x), or both parts as features: "
            f"dask.array.concatenate([x.real, x.imag], axis=1)"
        )


def _check_known_shape(x: Any, what: str) -> None:
    """ArgumentValueError for a dask array whose shape is not known (``nan``: a selection by
    a dask boolean mask), naming the ways to a known one."""
    if any(isinstance(d, float) and np.isnan(d) for d in x.shape):
        raise ArgumentValueError(
            f"{what} needs an array of known shape, got shape {tuple(x.shape)} (rows selected by a dask mask, "
            f"x[mask], are counted only when computed); select with a numpy mask, x[mask.compute()], or call "
            f"x = x.compute_chunk_sizes() first (one more read of the selection)"
        )


def moments(x: Any, *, drop_nonfinite: bool = False) -> dict[str, Any]:
    """Per-feature mean and population variance (ddof 0) of a dask array, in float64.

    Two passes (the mean, then the squared deviations from it; a third when rows are left
    out), each a tree reduction of per-block partial sums in float64; no block is held
    longer than its own task. A finite mean is kept within its column's [min, max] (``sum / n`` may round out of it), so a
    constant column has its value as mean and a variance of exactly 0, as ``torch.var`` and
    the built-in ``var`` reduction give.

    Rows holding NaN or inf: by default every row counts (as in the store's ``mean`` / ``var``
    reductions), so a column with NaN or inf in some row has a NaN or inf mean and a NaN
    variance, and a :class:`~activationscope.errors.NonFiniteRowsWarning` says how many rows
    and which (:func:`pca` leaves those rows out). With ``drop_nonfinite=True`` they are left
    out of both passes, as :func:`pca` leaves them out (the same rows, the same mean), and the
    warning says how many were left out.

    Parameters
    ----------
    x : dask.array.Array, (rows, *feature_shape), any real dtype (bfloat16 as ml_dtypes)
    drop_nonfinite : bool, default False
        Leave out the rows holding NaN or inf (any feature).

    Returns
    -------
    dict
        ``{"mean": ndarray (*feature_shape,) float64, "var": same, "count": int}``: ``count``
        the rows used; ``n_nonfinite`` the rows holding NaN or inf, ``nonfinite_rows`` their
        indices (int64 ndarray), ``n_dropped`` those left out (``n_nonfinite`` with
        ``drop_nonfinite``, else 0).

    Raises
    ------
    ArgumentValueError
        ``drop_nonfinite`` is not a bool, or ``x``'s shape is not known (``nan`` rows: a
        selection by a dask mask; select with ``x[mask.compute()]`` or call
        ``x.compute_chunk_sizes()``).
    ArgumentTypeError
        ``x`` is complex (float64 sums would drop the imaginary parts).

    Warns
    -----
    NonFiniteRowsWarning
        Some row holds NaN or inf (how many, the first indices, and what was done).
    """
    if not isinstance(drop_nonfinite, bool):
        raise ArgumentValueError(f"drop_nonfinite must be a bool, got {drop_nonfinite!r}")
    _check_real(x, "moments")
    _check_known_shape(x, "moments")
    dask = _require("dask")
    n = int(x.shape[0])
    x64 = x.astype(np.float64)
    if not n:
        mean = np.full(x.shape[1:], np.nan)
        return {"mean": mean, "var": mean.copy(), "count": 0, "n_nonfinite": 0,
                "nonfinite_rows": np.zeros(0, dtype=np.int64), "n_dropped": 0}
    da = _require("dask.array")
    finite, bad_rows = _nonfinite_rows(x64)
    # (the rows holding NaN or inf found in the first pass; rows left out take one more)
    bad, mean, lo, hi = dask.compute(bad_rows, x64.mean(axis=0), x64.min(axis=0), x64.max(axis=0))
    bad = np.asarray(bad, dtype=np.int64)
    count = n - len(bad) if drop_nonfinite else n
    if drop_nonfinite and len(bad):
        if count == 0:
            mean = np.full(x.shape[1:], np.nan)
            var = mean.copy()
        else:
            xs = da.where(finite, x64, 0.0)
            total, lo, hi = dask.compute(xs.sum(axis=0), da.where(finite, x64, np.inf).min(axis=0),
                                         da.where(finite, x64, -np.inf).max(axis=0))
            mean = np.clip(total / count, lo, hi)
            (var,) = dask.compute((da.where(finite, x64 - mean, 0.0) ** 2).sum(axis=0))
            var = var / count
    else:
        with np.errstate(invalid="ignore"):
            mean = np.where(np.isfinite(mean), np.clip(mean, lo, hi), mean)
        (var,) = dask.compute(((x64 - mean) ** 2).mean(axis=0))
    if len(bad):
        if drop_nonfinite:
            done = (f"left out of the mean and var (count {count}), as pca leaves them out"
                    if count else "left out: no row is left, mean and var are NaN")
        else:
            done = ("counted: the mean and var of the features they touch are NaN or inf (pca leaves those rows "
                    "out); moments(x, drop_nonfinite=True) gives the statistics of the rows pca uses")
        warn_at_caller(f"{_rows_named(bad, n)} hold NaN or inf, {done}", NonFiniteRowsWarning)
    return {"mean": mean, "var": var, "count": count, "n_nonfinite": len(bad), "nonfinite_rows": bad,
            "n_dropped": len(bad) if drop_nonfinite else 0}


def pca(x: Any, n_components: int | None = None) -> dict[str, Any]:
    """Principal components of the rows of a dask array, from the float64 covariance.

    Two passes: the mean, then ``C = (X - mean)^T (X - mean) / rows`` (population
    covariance, as the store's ``cov`` reduction) as a tree sum of per-block products in
    float64; then ``numpy.linalg.eigh`` of ``C`` on the client. Rows holding NaN or inf are
    left out of both passes (as the report's PCA leaves them out; ``moments(x,
    drop_nonfinite=True)`` leaves out the same rows); ``n_dropped`` says how many and a
    warning names them. The client holds only
    ``(features, features)`` float64, so the feature count must be moderate (a few
    thousand); the rows can be any number. A worker holds, besides a block and its float64
    copy, the ``(features, features)`` float64 products of several blocks until they are
    summed (a dozen or more; 128 MiB each for 4096 features): size ``memory_limit`` for them.

    Parameters
    ----------
    x : dask.array.Array, (rows, features), any real dtype
    n_components : int, optional
        Components kept (default: all).

    Returns
    -------
    dict
        ``mean`` (features,), ``cov`` (features, features), ``explained_variance``
        (k,) in decreasing order, ``explained_variance_ratio`` (k,), ``components``
        (k, features), unit rows (the sign of each is fixed so that its largest-magnitude
        entry is positive); all float64 numpy arrays. ``count``: rows used;
        ``n_dropped``: rows left out for holding NaN or inf, ``dropped_rows`` their indices
        (int64 ndarray).

    Warns
    -----
    NonFiniteRowsWarning
        Some row holds NaN or inf: how many were left out, and the first indices.

    Raises
    ------
    ValueError
        ``x`` is not 2-d, has fewer than 2 rows (without NaN or inf), its shape is not known
        (as for :func:`moments`), or ``n_components`` is out of range.
    ArgumentTypeError
        ``x`` is complex (a float64 covariance would drop the imaginary parts).
    """
    _check_real(x, "pca")
    _check_known_shape(x, "pca")
    if x.ndim != 2:
        raise ArgumentValueError(
            f"pca needs a (rows, features) array, got shape {tuple(x.shape)}; flatten each row first, "
            "pca(x.reshape(x.shape[0], -1)) (the feature order of the store's cov reduction: conv maps "
            "(C, H, W) give C * H * W features)"
        )
    n, d = int(x.shape[0]), int(x.shape[1])
    if n < 2:
        raise ArgumentValueError(f"pca needs at least 2 rows, got {n}")
    k = d if n_components is None else n_components
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= d:
        raise ArgumentValueError(f"n_components must be an int in 1..{d}, got {n_components!r}")
    dask, da = _require("dask"), _require("dask.array")
    x64 = x.astype(np.float64)
    finite, bad_rows = _nonfinite_rows(x64)  # rows holding NaN or inf are left out
    bad, total = dask.compute(bad_rows, da.where(finite, x64, 0.0).sum(axis=0))
    bad = np.asarray(bad, dtype=np.int64)
    n_ok = n - len(bad)
    if n_ok < 2:
        raise ArgumentValueError(f"pca needs at least 2 rows without NaN or inf, got {n_ok} of {n}; check the "
                                 "capture (e.g. its dtype: float16 overflows above 65504)")
    if len(bad):
        warn_at_caller(f"{_rows_named(bad, n)} hold NaN or inf, left out of the PCA (count {n_ok}); moments(x) counts "
                       "them unless given drop_nonfinite=True", NonFiniteRowsWarning)
    mean = total / n_ok
    xc = da.where(finite, x64 - mean, 0.0)
    cov = (xc.T @ xc).compute() / n_ok
    values, vectors = np.linalg.eigh(cov)
    order = np.argsort(values)[::-1][:k]
    values, comps = values[order], vectors[:, order].T
    signs = np.sign(comps[np.arange(k), np.argmax(np.abs(comps), axis=1)])
    comps = comps * np.where(signs == 0, 1.0, signs)[:, None]
    total = float(np.trace(cov))
    return {
        "mean": mean, "cov": cov, "explained_variance": values,
        "explained_variance_ratio": values / total if total > 0 else np.full(k, np.nan),
        "components": comps, "count": n_ok, "n_dropped": n - n_ok, "dropped_rows": bad,
    }
