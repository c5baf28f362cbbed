"""``ActivationDataset``: a map-style torch dataset over the rows of a store.

One item is one *row* (a sample, or a token of a sequence model) of every chosen hook point,
plus chosen columns of the store's row table. Reads are zero-copy views of the store's
memory-mapped shards where the store is uncompressed and the rows lie within one shard;
whole batches go through :meth:`ActivationDataset.__getitems__` (one view per hook point for
a contiguous batch, one ``torch.index_select`` gather for a random one).
"""

from __future__ import annotations

import copyreg
import math
import operator
import os
import re
import reprlib
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from multiprocessing.reduction import ForkingPickler
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
from torch.utils.data import Dataset, get_worker_info
from torch.utils.data._utils import collate as _torch_collate

from ..errors import (
    ArgumentTypeError,
    ArgumentValueError,
    HookPointNotFoundError,
    RowIndexError,
    StoreCorruptError,
    StoreError,
    column_hint,
    hook_point_hint,
    name_repr,
    names_repr,
    warn_at_caller,
)
from ..capture.hooks import bracket_hint, pattern_hits
from ..store._validate import row_table_type_clashes, short_of_row_table_line, token_rows_without_sample_lines
from ._source import StoreSource, as_source

__all__ = ["ActivationDataset", "Batch", "collate"]

_ROW_ID = "__activationscope_row__"

#: The most an ActivationDataset raises the cache of decoded chunks of the store it opened to by
#: itself, so that a shuffle window of compressed or remote rows is decoded once
#: (:meth:`ActivationDataset.fit_cache_to_window`), in bytes per store so opened, in each
#: process: each DataLoader worker holds a cache of its own, and so does each dataset that
#: opened a store (two datasets over one path open it twice; a dataset built on another,
#: ``ActivationDataset(ds, rows=...)``, shares its store).
WINDOW_CACHE_MAX_BYTES = 1 << 30


class Batch(Sequence):
    """One batch as returned by :meth:`ActivationDataset.__getitems__`.

    ``batch.data`` holds the batch itself: ``{hook point: Tensor (rows, *feature_shape)}``
    plus ``{column: Tensor (rows,) | list}``. As a sequence it has one lightweight mapping per
    row so that torch's ``default_collate`` accepts it; activationscope registers a collate
    function for those rows that returns ``batch.data`` without stacking (no copy), see
    :func:`collate`.

    Parameters
    ----------
    data : dict
        ``{hook point: Tensor (rows, *feature_shape)}`` plus ``{column: Tensor (rows,) | list}``.
    n_rows : int
        The batch's rows (its length as a sequence).
    """

    __slots__ = ("data", "_n")

    def __init__(self, data: dict[str, Any], n_rows: int) -> None:
        self.data = data
        self._n = n_rows

    def __len__(self) -> int:
        """Number of rows of the batch."""
        return self._n

    def __getitem__(self, i: int) -> "_Row":  # type: ignore[override]
        """Row ``i`` as a mapping of views into the batch's tensors (for ``default_collate``).

        Parameters
        ----------
        i : int
            A position in ``[-len(batch), len(batch))``.

        Raises
        ------
        ArgumentTypeError
            ``i`` is a slice, a str or no int (read ``batch.data`` instead); a TypeError.
        RowIndexError
            ``i`` is out of range; an IndexError.
        """
        if type(i) is int and i == 0 and self._n:  # default_collate looks at the first row of every batch
            return _Row(self, 0)
        if isinstance(i, slice):
            raise ArgumentTypeError("Batch does not support slicing; index batch.data instead")
        if isinstance(i, str):
            raise ArgumentTypeError(f"a Batch is indexed by row, not by name: read batch.data[{i!r}] "
                                    f"(keys: {', '.join(self.data)})")
        if not _is_int(i):
            raise ArgumentTypeError(f"a Batch is indexed by row (an int), got {type(i).__name__}")
        if not -self._n <= i < self._n:
            raise RowIndexError(f"row {i} out of range for a batch of {self._n} rows")
        return _Row(self, i % self._n)

    def __repr__(self) -> str:
        keys = ", ".join(self.data)
        return f"<Batch {self._n} rows: {keys}>"


class _Row(Mapping):
    """Row ``i`` of a :class:`Batch` (views into the batch's tensors)."""

    __slots__ = ("batch", "i")

    def __init__(self, batch: Batch, i: int) -> None:
        self.batch = batch
        self.i = i

    def __getitem__(self, key: str) -> Any:
        return self.batch.data[key][self.i]

    def __iter__(self):
        return iter(self.batch.data)

    def __len__(self) -> int:
        return len(self.batch.data)


class _Plan(NamedTuple):
    """The source's gather plan of a dataset's shuffled batches (see ``__getitems__``)."""

    gather: Any  # the native gather (StoreSource.gather_plan)
    bounds: list[int]  # row boundaries of the mapped segments
    segments: list[Any]  # the mapped segments (None: not yet)
    token: tuple[Any, Any]  # (source._seg_lists, store metadata object) the plan holds for
    hint: torch.Tensor  # how cold rows are asked of the kernel (see StoreSource._hint)
    n: int  # dataset rows (positions are taken modulo n)
    start: int  # first store row of the dataset
    hook_point: str
    feature_shape: tuple[int, ...]
    dtype: torch.dtype
    in_worker: bool  # made in a DataLoader worker: batches gathered into shared memory


def _shared_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A new CPU tensor in shared memory (uninitialised), as ``default_collate`` makes in a
    DataLoader worker: pickled to the main process by its handle, not its bytes."""
    t = torch.empty(0, dtype=dtype)
    return t.new(t._typed_storage()._new_shared(math.prod(shape), device=t.device)).resize_(shape)


def _to_shared(t: torch.Tensor) -> torch.Tensor:
    # In a DataLoader worker a batch crosses to the main process through shared memory: copy
    # it there once (as default_collate does) instead of letting pickling move the store map;
    # a batch already gathered into shared memory of its own (see __getitems__) goes as it is.
    if (t.is_shared() and t.storage_offset() == 0 and t.is_contiguous()
            and t.untyped_storage().nbytes() == t.nbytes):
        return t
    return _shared_empty(tuple(t.shape), t.dtype).copy_(t)


def _owned(data: Mapping[str, Any]) -> dict[str, Any]:
    """``data`` with each tensor that is a view of a larger storage (a row of the store's
    map) copied, so that pickling it (a DataLoader worker) sends its own bytes, not its
    whole storage."""
    return {k: v.clone() if isinstance(v, torch.Tensor) and (
        v.storage_offset() or v.untyped_storage().nbytes() != v.nbytes or not v.is_contiguous()) else v
        for k, v in data.items()}


class _Item(dict):
    """One row, ``ds[i]``: a plain dict whose type sends torch's ``default_collate`` to
    :func:`collate`, so that rows read one by one (a ``ConcatDataset``, which has no
    ``__getitems__``) collate as a batch of the dataset does: string, list and struct column
    values stay a list of the rows' values (``default_collate`` would transpose lists and refuse
    ``None``)."""

    __slots__ = ()


def _collate_values(values: list[Any], fn_map: Any) -> Any:
    """One key of rows being collated: tensors stacked (a copy, in shared memory inside a
    DataLoader worker, as ``default_collate`` does); the values of string, list, struct and
    null columns as the list of the rows' values, as a batch of the dataset holds them."""
    if any(isinstance(v, torch.Tensor) for v in values):
        return _torch_collate.collate(values, collate_fn_map=fn_map)
    return list(values)


def _finish(data: Mapping[str, Any]) -> dict[str, Any]:
    if get_worker_info() is None:
        return data if type(data) is dict else dict(data)
    return {k: _to_shared(v) if isinstance(v, torch.Tensor) else v for k, v in data.items()}


def collate(batch: Any, *, collate_fn_map: Any = None) -> Any:
    """Collate function for :class:`ActivationDataset` batches (also used by ``default_collate``).

    Parameters
    ----------
    batch : Batch or list of row mappings
        What :meth:`ActivationDataset.__getitems__` returned, or rows of one.
    collate_fn_map : dict, optional
        ``{type: collate function}`` for the values of rows from elsewhere (what
        ``default_collate`` passes to the functions it registers); default: torch's
        ``default_collate_fn_map``.

    Returns
    -------
    dict
        ``{hook point: Tensor (rows, *feature_shape)}`` plus row-table columns. For a whole
        :class:`Batch` these are the batch's own tensors (a view of the store for a contiguous
        batch within one shard; otherwise the one gathered copy) in the main process, and one
        copy into shared memory inside a DataLoader worker. Rows from elsewhere (items
        ``ds[i]``, as a ``ConcatDataset`` reads them, or rows of several batches) have their
        tensors stacked (a copy), as ``default_collate`` would, and their string, list,
        struct and null column values kept as the list of the rows' values, as in a batch
        of the dataset (``default_collate`` would transpose a list column's lists and refuse
        ``None``).

    Raises
    ------
    ArgumentValueError
        Rows with different keys (a ``ConcatDataset`` of datasets reading other hook points
        or columns).
    """
    if type(batch) is Batch:  # the common case first: no per-row work
        data = batch.data
        if type(data) is dict and get_worker_info() is None:  # in the main process: as is
            return data
        return _finish(data)
    if isinstance(batch, Batch):
        return _finish(batch.data)
    rows = list(batch)
    if rows and all(isinstance(r, _Row) for r in rows):
        parent = rows[0].batch
        if len(rows) == len(parent) and all(r.batch is parent and r.i == k for k, r in enumerate(rows)):
            return _finish(parent.data)
    if isinstance(batch, dict):
        return _finish(batch)
    fn_map = collate_fn_map if collate_fn_map is not None else _torch_collate.default_collate_fn_map
    keys = list(rows[0])
    for r in rows[1:]:
        if len(r) != len(keys) or any(k not in r for k in keys):
            raise ArgumentValueError(
                f"rows collated into one batch must have the same keys, got {keys} and {list(r)}: the datasets of a "
                "ConcatDataset must read the same hook points and columns (pass the same hook_points= and columns= "
                "to each ActivationDataset)"
            )
    return {k: _collate_values([r[k] for r in rows], fn_map) for k in keys}


# torch's documented extension point of default_collate: rows of our batches collate to the
# batch itself, so DataLoader(ActivationDataset(...), batch_size=...) makes no per-row copies;
# items read one by one (ds[i]) collate as a batch of the dataset does.
_torch_collate.default_collate_fn_map[_Row] = collate
_torch_collate.default_collate_fn_map[_Item] = collate


def _is_int(x: Any) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


# What ds[...] and rows= take (named in the messages of refused indexes).
_ITEM_KINDS = (
    "an int (or a 0-d integer Tensor / numpy array) for one row, or for a batch a slice, a range, "
    "a list or tuple of ints, or a 1-D integer Tensor / numpy array"
)
_ROWS_KINDS = "a slice, a range, a list or tuple of ints, a 1-D integer Tensor / numpy array, or a bool mask"
_INT_DTYPES = frozenset(
    d
    for d in (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8,
              getattr(torch, "uint16", None), getattr(torch, "uint32", None), getattr(torch, "uint64", None))
    if d is not None
)
_UINT64 = getattr(torch, "uint64", None)
_I64_MIN, _I64_MAX = -(2**63), 2**63 - 1


def _short(x: Any) -> str:
    """``repr(x)`` cut to a readable length (an index may hold a million positions)."""
    if isinstance(x, torch.Tensor):
        return f"a {x.dtype} Tensor of shape {tuple(x.shape)} on {x.device}"
    if isinstance(x, np.ndarray) and x.size > 8:
        return f"a {x.dtype} numpy array of shape {x.shape}"
    return reprlib.repr(x)


def _kind_error(x: Any, what: str, kinds: str) -> ArgumentTypeError:
    """The error for ``x`` given as ``what`` when it is no index at all (None, a set, a str...)."""
    if isinstance(x, (set, frozenset)):
        hint = "; a set has no order, so the rows would come back in no defined order: pass sorted(...) or list(...) of it"
    elif x is None:
        hint = "; use a slice (ds[:]) for every row"  # (rows=None itself is every row: never refused)
    elif isinstance(x, (str, bytes)):
        hint = "; rows are selected by position, not by name"
    elif isinstance(x, (float, complex)) or isinstance(x, np.floating):
        hint = "; positions are ints: int(...) of it if it is a whole number"
    elif isinstance(x, (bool, np.bool_)):
        hint = "; a bool is not a position: use 0 or 1"
    elif isinstance(x, Iterable):
        hint = "; pass list(...) of it"
    else:
        hint = ""
    return ArgumentTypeError(f"{what} must be {kinds}, got {_short(x)} ({type(x).__name__}){hint}")


def _sample_id_array(ids: Any) -> np.ndarray:
    """``sample_ids=`` as int64 (k,): any collection of ints (a set too: it selects samples,
    in no order), a 1-D integer tensor or numpy array, or one int.

    Raises ArgumentTypeError for anything else (None in it, floats, bools, strings), naming
    the first element that is no sample id."""
    what = "sample_ids="
    if isinstance(ids, torch.Tensor):
        if ids.device.type == "meta":
            raise ArgumentValueError(f"{what} is a meta tensor, which holds no values: build it on the CPU")
        if ids.dtype not in _INT_DTYPES or ids.dim() > 1:
            raise ArgumentTypeError(f"{what} must be ints (a 1-D integer Tensor), got {_short(ids)}")
        return ids.detach().to("cpu", torch.int64).reshape(-1).numpy()
    if isinstance(ids, np.ndarray):
        if ids.dtype.kind not in "iu" or ids.ndim > 1:
            raise ArgumentTypeError(f"{what} must be ints (a 1-D integer numpy array), got {_short(ids)}")
        if ids.dtype.kind == "u" and ids.size and int(ids.max()) > _I64_MAX:
            raise ArgumentValueError(f"{what} holds {int(ids.max())}, beyond int64: no sample has that id")
        return ids.astype(np.int64).reshape(-1)
    if _is_int(ids):
        ids = [ids]
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable):
        raise ArgumentTypeError(f"{what} must be a collection of ints (sample ids), got {_short(ids)} "
                                f"({type(ids).__name__})")
    try:
        return np.asarray(_int64_items(ids), dtype=np.int64)
    except _BadItem as e:
        if e.beyond:
            raise ArgumentValueError(f"{what} holds {e.value}, beyond int64: no sample has that id") from None
        raise ArgumentTypeError(f"{what} must be ints (sample ids), got {_short(e.value)} "
                                f"({type(e.value).__name__}) in {_short(ids)}") from None


def _sample_id_numbers(ids: Any, id_type: pa.DataType) -> np.ndarray:
    """``sample_ids=`` of a store whose sample ids are uint64 (uint64 (k,)) or floats (float64
    (k,)): any collection of such numbers, a 1-D Tensor or numpy array of them, or one.

    Raises ArgumentTypeError for what is no such number (None, a str, a bool; a float for
    uint64 ids) and ArgumentValueError for one no sample can have (a negative or >= 2**64
    uint64 id, NaN)."""
    what = "sample_ids="
    unsigned = pa.types.is_uint64(id_type)
    kinds = "ints in [0, 2**64)" if unsigned else "numbers"
    where = f"this store's sample ids are {id_type}"
    if isinstance(ids, (torch.Tensor, np.ndarray)):
        if isinstance(ids, torch.Tensor):
            if ids.device.type == "meta":
                raise ArgumentValueError(f"{what} is a meta tensor, which holds no values: build it on the CPU")
            t = ids.detach().to("cpu")
            good = t.dtype in _INT_DTYPES or not unsigned and t.dtype.is_floating_point
            # (numpy takes no torch.uint64: its bits, as int64, read back as uint64)
            arr = None if not good else t.view(torch.int64).numpy().view(np.uint64) if t.dtype == _UINT64 else t.numpy()
        else:
            good = ids.dtype.kind in ("iu" if unsigned else "iuf")
            arr = ids
        if not good or ids.ndim > 1:
            raise ArgumentTypeError(f"{what} must be {kinds} ({where}; a 1-D Tensor or numpy array of them), got "
                                    f"{_short(ids)}")
        items: list = arr.reshape(-1).tolist()
    else:
        items = [ids] if _is_int(ids) or isinstance(ids, (float, np.floating)) else ids
        if isinstance(items, (str, bytes)) or not isinstance(items, Iterable):
            raise ArgumentTypeError(f"{what} must be a collection of {kinds} ({where}), got {_short(ids)} "
                                    f"({type(ids).__name__})")
        items = list(items)
    for v in items:
        number = (_is_int(v) or not unsigned and isinstance(v, (float, np.floating))) and not isinstance(v, np.bool_)
        if not number:
            raise ArgumentTypeError(f"{what} must be {kinds} ({where}), got {_short(v)} ({type(v).__name__}) in "
                                    f"{_short(ids)}")
        if unsigned and not 0 <= int(v) < 2**64 or not unsigned and v != v:
            raise ArgumentValueError(f"{what} holds {v!r}, which no sample has ({where})")
    return np.array(items, dtype=np.uint64 if unsigned else np.float64)


def _sample_id_strings(ids: Any) -> list[str]:
    """``sample_ids=`` of a store whose sample ids are strings: any collection of str, or one str.

    Raises ArgumentTypeError naming the first element that is no str."""
    if isinstance(ids, np.ndarray) and ids.ndim == 0 and ids.dtype.kind == "U":
        ids = str(ids.item())  # one str id, as a 0-d array
    if isinstance(ids, str):
        return [ids]
    if (isinstance(ids, bytes) or not isinstance(ids, Iterable)
            or isinstance(ids, (torch.Tensor, np.ndarray)) and ids.ndim == 0):  # (a 0-d one cannot be iterated)
        raise ArgumentTypeError(f"sample_ids= must be a collection of str (this store's sample ids are strings), got "
                                f"{_short(ids)} ({type(ids).__name__})")
    out = list(ids)
    for v in out:
        if not isinstance(v, str):
            raise ArgumentTypeError(f"sample_ids= must be str (this store's sample ids are strings), got {_short(v)} "
                                    f"({type(v).__name__}) in {_short(ids)}")
    return out


def _slice_range(s: slice, n: int, what: str) -> range:
    """``s`` over ``n`` rows as a range, with Python's clipping (``slice(290, 310)`` of 299 rows
    is rows 290..298)."""
    try:
        return range(n)[s]
    except TypeError:
        raise ArgumentTypeError(f"{what} slice must have int or None start, stop and step, got {s!r}") from None
    except ValueError:
        raise ArgumentValueError(f"{what} slice step must not be zero, got {s!r}") from None


def _out_of_range(what: str, n: int, unit: str, bad: int, where: str = "", fix: str = "") -> RowIndexError:
    return RowIndexError(
        f"{what} must be positions in [-{n}, {n}) ({n} {unit}; negative positions count from the end), "
        f"got {bad}{where}{fix}"
    )


def _range_positions(r: range, n: int, what: str, unit: str) -> torch.Tensor:
    """The positions of a non-empty range as int64 (k,), each in ``[-n, n)``: a range is its
    list of positions, never clipped as a slice is."""
    r0, r1 = r[0], r[-1]
    lo, hi = min(r0, r1), max(r0, r1)
    if lo < -n or hi >= n:
        fix = (
            f"; a range is taken position by position, like a list, and is not clipped as a slice is: "
            f"keep it within [-{n}, {n}), or use slice({r.start}, {r.stop}{'' if r.step == 1 else f', {r.step}'}) "
            "to read only the rows there are"
        )
        raise _out_of_range(f"{what} {r}", n, unit, hi if hi >= n else lo, fix=fix)
    return torch.arange(r.start, r.stop, r.step, dtype=torch.int64)


def _index_from_items(x: Sequence[Any], what: str, n: int, unit: str) -> torch.Tensor:
    """A list / tuple numpy could not make an int, bool or float array of: each element must be
    an int within int64 (the error names the first that is not)."""
    try:
        return torch.tensor(_int64_items(x), dtype=torch.int64)
    except _BadItem as e:
        if e.beyond:
            raise _out_of_range(what, n, unit, e.value, where=f" at element {e.k}") from None
        v = e.value
        fix = "" if v is not None else "; rows=None selects every row" if what == "rows" else "; use ds[:] for every row"
        if what != "rows" and all(isinstance(b, (list, tuple, range)) for b in x):
            # (what a DataLoader makes of a batch sampler given as sampler=: its batches grouped by batch_size=)
            fix = ("; this is a list of batches, as DataLoader(ds, sampler=batch_sampler, batch_size=n) makes of a "
                   "batch sampler given as sampler=: pass it as DataLoader(ds, batch_sampler=batch_sampler)")
        raise ArgumentTypeError(
            f"{what} must be a sequence of ints (positions), got {_short(v)} ({type(v).__name__}) at "
            f"element {e.k} of {_short(x)}{fix}"
        ) from None


class _BadItem(Exception):
    """Element ``k`` of a collection of ints is ``value``: no int (``beyond`` False) or an
    int beyond int64 (``beyond`` True)."""

    def __init__(self, k: int, value: Any, beyond: bool) -> None:
        super().__init__(k, value, beyond)
        self.k, self.value, self.beyond = k, value, beyond


def _int64_items(items: Iterable[Any]) -> list[int]:
    """Each element as a Python int within int64 (bools are no ints here, nor are 0-d bool
    tensors, which ``operator.index`` reads as 0 / 1, nor tensors of one or more dimensions).

    Raises _BadItem for the first element that is not, for the caller's message."""
    out = []
    for k, v in enumerate(items):
        try:
            if isinstance(v, (bool, np.bool_)) or isinstance(v, torch.Tensor) and (v.dtype == torch.bool or v.dim()):
                raise TypeError
            i = operator.index(v)
        except TypeError:
            raise _BadItem(k, v, False) from None
        if not _I64_MIN <= i <= _I64_MAX:
            raise _BadItem(k, i, True)
        out.append(i)
    return out


_NO_BOOLS = frozenset({int, np.int64, np.int32, np.int16, np.int8, np.uint8, np.uint16, np.uint32})


def _as_index(x: Any, what: str, n: int, unit: str, kinds: str) -> torch.Tensor:
    """An index as a CPU tensor, with its dtype as given (ints, bools or floats, any number
    of dimensions, for the caller's checks); an empty list or tuple is an empty int64 index
    (not float32).

    A list or tuple (a batch sampler's batch) goes through numpy: ``np.asarray`` of 256
    Python ints takes about 5 us, ``torch.as_tensor`` about 30 us; the dtype is inferred the
    same way (ints -> int64, bools -> bool, floats -> float64). Anything else numpy makes of
    it (None, strings, ints beyond int64) is checked element by element. Other array-likes
    (``__array__``: pandas, pyarrow) go through numpy, other sequences through a list.

    Raises ArgumentTypeError for what is no index (``what`` names it in the message, ``kinds``
    says what is taken), ArgumentValueError for a tensor on the meta device, RowIndexError
    for ints beyond int64 (out of range for any ``n``).
    """
    if isinstance(x, (list, tuple)):
        if len(x) == 0:
            return torch.empty(0, dtype=torch.int64)
        try:
            arr = np.asarray(x)
        except (ValueError, TypeError, OverflowError):  # ragged, or an element numpy refuses
            arr = None
        if arr is not None and arr.dtype.kind in "ib":
            if arr.dtype.kind == "i" and not _NO_BOOLS.issuperset(map(type, x)):
                return _index_from_items(x, what, n, unit)  # numpy reads True as 1: refused, naming it
            return torch.from_numpy(arr)
        if arr is not None and arr.dtype.kind == "f" and any(isinstance(v, (float, np.floating)) for v in x):
            return torch.from_numpy(arr)  # floats: refused by the caller, with its message
        return _index_from_items(x, what, n, unit)  # (numpy makes float64 of np.uint64 with ints)
    if isinstance(x, torch.Tensor):
        if x.device.type != "cpu" or x.layout != torch.strided:
            if x.device.type == "meta":
                raise ArgumentValueError(
                    f"{what} must be a tensor with values, got a tensor on the meta device (it holds none); "
                    "build the index on the CPU, e.g. torch.tensor([0, 1])"
                )
            if x.layout != torch.strided:
                raise ArgumentTypeError(f"{what} must be a dense tensor, got layout {x.layout}; pass index.to_dense()")
            x = x.cpu()
        if x.dtype == torch.uint8 and x.dim() > 0:
            raise ArgumentTypeError(
                f"{what} must not be a uint8 Tensor, got {_short(x)}: torch indexing reads a uint8 tensor as a "
                "mask (deprecated) and numpy a uint8 array as positions, so its meaning is ambiguous; pass "
                "index.bool() for a mask or index.long() for positions"
            )
        if x.dtype == _UINT64 and x.numel():
            x = _uint64_positions(x.view(torch.int64), what, n, unit)
        return x
    if isinstance(x, np.ndarray):
        if x.dtype.kind not in "iubf":
            if x.dtype.kind == "O" and x.ndim == 1:
                return _index_from_items(list(x), what, n, unit)
            raise _kind_error(x, what, kinds)
        if x.dtype.kind == "u" and x.dtype.itemsize == 8:  # (in native byte order first)
            as_int64 = np.array(x, dtype=np.uint64).view(np.int64)
            return _uint64_positions(torch.from_numpy(as_int64), what, n, unit)
        try:
            return torch.from_numpy(x if x.flags.writeable else x.copy())  # (torch warns on read-only arrays)
        except (ValueError, TypeError):  # negative strides, non-native byte order: one copy
            return torch.from_numpy(np.array(x, dtype=x.dtype.newbyteorder("=")))
    if hasattr(x, "__array__") and not isinstance(x, (str, bytes, np.generic)):  # pandas, pyarrow, ... arrays
        return _as_index(np.asarray(x), what, n, unit, kinds)
    if isinstance(x, Sequence) and not isinstance(x, (str, bytes)):  # a deque, an array.array, ...
        return _as_index(list(x), what, n, unit, kinds)
    raise _kind_error(x, what, kinds)


def _uint64_positions(as_int64: torch.Tensor, what: str, n: int, unit: str) -> torch.Tensor:
    """uint64 positions (viewed as int64) as int64; values of 2**63 and beyond are out of range
    (a plain cast would wrap them round to negative positions)."""
    flat = as_int64.reshape(-1)
    wrapped = (flat < 0).nonzero()
    if wrapped.numel():
        k = int(wrapped[0, 0])
        where = f" at element {k}" if as_int64.dim() == 1 else ""
        raise _out_of_range(what, n, unit, int(flat[k]) + 2**64, where=where)
    return as_int64


def _check_positions(pos: torch.Tensor, n: int, what: str, unit: str) -> None:
    """Raise RowIndexError naming the first of the int64 positions ``pos`` (k,) outside ``[-n, n)``."""
    bad = ((pos < -n) | (pos >= n)).nonzero()
    if bad.numel():
        k = int(bad[0, 0])
        raise _out_of_range(what, n, unit, int(pos[k]), where=f" at element {k}")


def _tensor_fix(t: torch.Tensor, what: str) -> str:
    """How to make the index tensor ``t`` (right kind, wrong dtype or shape) one that is taken."""
    if t.dtype == torch.bool:
        if what == "rows":
            return f"; a bool rows mask must be 1-D with one entry per store row, got shape {tuple(t.shape)}"
        return f"; a bool mask must be 1-D with one entry per dataset row, got shape {tuple(t.shape)}"
    if t.dtype.is_floating_point or t.dtype.is_complex:
        return f"; positions must be ints, got dtype {t.dtype}: convert whole numbers with .long() / .astype(int)"
    if t.dim() != 1:
        one = "; for one row use ds[i]" if t.dim() == 0 and what != "rows" else ""
        return f"; the index must be 1-D, got shape {tuple(t.shape)}: flatten it with .reshape(-1){one}"
    return f"; got dtype {t.dtype}"


def _scalar_position(x: torch.Tensor | np.ndarray, what: str) -> int:
    """A 0-d integer tensor or numpy array as a Python int (it reads one row, like an int)."""
    if isinstance(x, torch.Tensor):
        if x.device.type == "meta":
            raise ArgumentValueError(
                f"{what} must be a tensor with values, got a 0-d tensor on the meta device (it holds none); "
                "pass the position as an int"
            )
        if x.dtype not in _INT_DTYPES:
            raise ArgumentTypeError(
                f"{what} as a 0-d tensor must have an integer dtype (it reads one row, like an int), got "
                f"{x.dtype}{'; a bool is not a position' if x.dtype == torch.bool else '; convert it with int(...) if it is a whole number'}"
            )
        if x.dtype == _UINT64:
            v = int(x.view(torch.int64))
            return v + 2**64 if v < 0 else v
        return int(x)
    if x.dtype.kind not in "iu":
        raise ArgumentTypeError(
            f"{what} as a 0-d numpy array must have an integer dtype (it reads one row, like an int), "
            f"got {x.dtype}"
        )
    return int(x)


def _names(value: Any, what: str, kind: str) -> list[str]:
    """``value`` (a str, or an iterable of str) as a list of str.

    Raises
    ------
    ArgumentTypeError
        Neither a str nor an iterable (``columns=3``), or an item that is not a str.
    """
    if isinstance(value, str):
        return [value]
    if not isinstance(value, Iterable):
        raise ArgumentTypeError(f"{what} must be a str or a list of str ({kind}), got {_short(value)}")
    names = list(value)
    for name in names:
        if not isinstance(name, str):
            raise ArgumentTypeError(f"{what} must be a str or a list of str ({kind}), got {_short(name)} in {_short(value)}")
    return names


def select_hook_points(source: StoreSource, hook_points: Any) -> list[str]:
    """The hook points of ``source`` that ``hook_points`` names, in the order given.

    ``None`` selects every hook point; each name or fnmatch pattern selects what
    :func:`~activationscope.capture.hooks.pattern_hits` gives (a pattern equal to a hook
    point selects that hook point only).

    Raises
    ------
    HookPointNotFoundError
        A pattern that matches no hook point, or a store without hook points.
    ArgumentValueError
        An empty list.
    ArgumentTypeError
        A pattern that is not a str.
    """
    available = source.hook_points
    status = getattr(getattr(source, "store", None), "status", None)
    # (a capture still running lists its hook points with its first commit)
    pending = ("" if status in (None, "complete") else
               f": the store is {status} (a capture still running, or stopped before its first commit?), and a "
               "capture's hook points appear with its first commit; call store.refresh() and make the dataset "
               "again once rows are committed")
    if hook_points is None:
        if not available:
            raise HookPointNotFoundError(f"the store {source.describe()} has no hook points{pending}")
        return available
    patterns = _names(hook_points, "hook_points", "hook point names or fnmatch patterns")
    if not patterns:
        raise ArgumentValueError("hook_points must name at least one hook point, got an empty list")
    chosen: list[str] = []
    for pat in patterns:
        if not isinstance(pat, str):
            raise ArgumentTypeError(f"hook_points must be str patterns, got {pat!r}")
        hits = pattern_hits(pat, available)
        bracket = bracket_hint(pat, available, hits, "hook_points")
        if not hits:
            what = (f"pattern {name_repr(pat)} matches no hook point of" if any(c in pat for c in "*?[")
                    else f"hook point {name_repr(pat)} is not in")
            raise HookPointNotFoundError(f"{what} the store {source.describe()}"
                                         + (bracket or f"; it has {names_repr(available)}"
                                            + ("" if what.startswith("pattern") else hook_point_hint(pat, available)))
                                         + (pending if not available else ""))
        if bracket:
            warn_at_caller(f"hook_points pattern {name_repr(pat)} selects {names_repr(hits, 8)}{bracket}")
        chosen.extend(h for h in hits if h not in chosen)
    return chosen


class ActivationDataset(Dataset):
    """Map-style dataset over the rows of a store.

    Parameters
    ----------
    store : str, os.PathLike, store object or ActivationDataset
        A store path or URL (opened read-only with ``activationscope.open_store``), an open
        store, or a dataset whose store is reused.
    hook_points : str or list of str, optional
        Hook points to read; fnmatch patterns allowed (``"blocks.*.output"``); a pattern
        equal to a hook point selects that hook point only. Default: every hook point of
        the store. All must have the same row kind (``"sample"`` or
        ``"token"``) and the same number of rows; a hook point whose rows do not follow the
        row table (``store.follows_row_table(hp)`` False) must be alone (ArgumentValueError).
    rows : slice, range, sequence of int, Tensor / ndarray (k,) integer or bool mask (n_rows,), optional
        Store rows to use (before ``filter`` / ``sample_ids``), in the order given. Default:
        all rows. A slice is clipped to the rows there are, as Python slices are
        (``slice(290, 310)`` of 299 rows is rows 290..298); a range is taken position by
        position like the list of its positions, never clipped: ``range(290, 310)`` of 299
        rows raises RowIndexError, as ``list(range(290, 310))`` does. Negative positions
        count from the end. Index tensors on any device but ``meta`` are taken.
    columns : str or list of str, optional
        Row-table columns to return with each item (``"label"``, ``"sample_id"``, ``"pos"``,
        user columns). Numeric and bool columns come back as tensors of their row-table
        type (a ``uint16`` column as ``torch.uint16``), strings as ``str``.
        Token rows also see the per-sample columns of their sample (``label`` given to
        ``set_batch``), joined on ``(rank, batch, sample_id)``: the sample of the same forward
        (and rank), so ids repeated across forwards or ranks get their own sample's values
        (ActivationScopeError when one forward gave one id to two samples whose column differs
        and that column is read, by ``columns`` or by a ``filter`` that names it, or by a
        callable filter, which sees every column; ``rows`` and ``sample_ids`` select such a
        store's token rows). Only these columns are read of the row table (Parquet column
        projection), and only they are kept in memory with the dataset.
    filter : pyarrow.compute.Expression or callable, optional
        Keep rows where the predicate holds: an expression over row-table columns
        (``pc.field("label") == 1``, ``pc.field("pos") > 0`` to drop BOS tokens), or a
        callable ``f(table: pyarrow.Table) -> bool mask (rows,)`` (pyarrow / numpy / torch /
        list) over the row table. Evaluated once, in the constructor. An expression reads
        the columns whose names it holds (and the row table's checks theirs), a callable the
        whole table, as does an expression naming a column by its position (``pc.field(1)``:
        a position in the whole table); neither is kept after the constructor.
    sample_ids : collection of int, optional
        Keep rows of these samples only (every token row of a sample for token hook points):
        a list, tuple, set, range, 1-D integer Tensor or numpy array, or one int (a collection
        of str, or one str, for a store captured with str sample ids; ints up to 2**64 - 1 for
        uint64 ids, and floats too for float ids; a pyarrow Array that casts to the store's
        sample_id type); the rows stay in store
        order whatever the order given. ArgumentTypeError for anything else. An empty
        collection gives an empty dataset; ids none of which is in the dataset's rows raise
        ArgumentValueError, and so do ids some of which no sample of the store has (those that
        ``rows=`` or ``filter=`` leave out are no error: the selections intersect).
    open_options : dict, optional
        Keyword arguments of ``open_store`` when ``store`` is a path or URL. With an open
        store, options other than those it was opened with reopen it from its path with
        them (in this process and in DataLoader workers alike); with a dataset, they
        raise ArgumentValueError (its store is reused as it was opened).

    Notes
    -----
    Items: ``ds[i]`` is ``{hook point: Tensor (*feature_shape)}`` (a view of the store row,
    stored dtype: float32 / float16 / bfloat16 / integers as stored) plus the chosen
    columns; ``i`` is an int, a numpy integer or a 0-d integer Tensor / ndarray.
    ``ds[indices]`` and ``ds.__getitems__(indices)`` read a whole batch; see
    :meth:`get_batch` for the indexes taken and view-or-copy. Rows are selected by position
    only: ``ds["name"]`` raises ArgumentTypeError (read ``ds[i]["name"]``).

    Lifetime: views keep their memory map alive; they stay valid after the dataset is gone.
    Writing into a view never changes the store on disk (the store maps copy-on-write).

    Processes: the dataset pickles as the store's path plus options and the resolved row
    selection; DataLoader workers (fork or spawn) reopen the store lazily. After ``fork``
    the child drops the parent's store objects (``os.register_at_fork``) and reopens. The
    ``columns`` are never read again by a worker: ``fork`` ones share the parent's, and
    ``torch.multiprocessing`` (``spawn`` and ``forkserver`` workers, a ``Queue.put``) sends
    them with the dataset, their tensors moved into shared memory once (in place) and
    mapped by each worker; a plain ``pickle`` leaves them out (read again where needed). A
    ``memory://`` store exists only in the process that made it: a ``spawn`` worker raises
    :class:`~activationscope.errors.StoreError` saying so (use ``fork``, ``num_workers=0``
    or a local path).

    Raises
    ------
    HookPointNotFoundError
        A hook point or pattern names nothing in the store.
    ValueError
        Hook points of different row kinds or row counts; an unknown column; a numeric or
        bool column that is null in a row of the dataset (a tensor has no null: select the
        rows where it is set with ``filter=pc.field(name).is_valid()``); a filter
        expression naming a field the row table lacks, or that Arrow cannot evaluate on it
        (the message lists the table's columns); a filter mask of the wrong length; ``rows=``
        a tensor on the meta device (ArgumentValueError).
    ArgumentTypeError
        ``rows=`` of a kind that selects no rows (a set, None inside a list, a str, floats,
        2-D, a uint8 tensor: pass ``.bool()`` or ``.long()``); ``hook_points=`` or ``columns=`` neither a str nor an iterable of str;
        ``open_options=`` not a dict, or with a key ``open_store`` does not take. A TypeError.
    RowIndexError
        ``rows=`` positions outside ``[-n_rows, n_rows)``, a range past the end included; an
        IndexError.

    Example
    -------
    >>> ds = ActivationDataset("runs/demo.zarr", hook_points=["blocks.3.output"],
    ...                        columns=["label"], filter=pc.field("pos") > 0)  # doctest: +SKIP
    >>> loader = DataLoader(ds, batch_sampler=ShuffledBatchSampler(ds, 256, seed=0))  # doctest: +SKIP
    """

    def __init__(
        self,
        store: Any,
        hook_points: str | Iterable[str] | None = None,
        rows: slice | range | Sequence[int] | torch.Tensor | None = None,
        columns: str | Iterable[str] | None = None,
        filter: pc.Expression | Callable[[pa.Table], Any] | None = None,
        sample_ids: Iterable[int] | torch.Tensor | None = None,
        open_options: Mapping[str, Any] | None = None,
    ) -> None:
        self.source: StoreSource = as_source(store, open_options)
        self._run = self.source.run()  # the run whose rows, row table and selection these are
        self.hook_points = self._select_hook_points(hook_points)
        self.row_kind = self.source.row_kind(self.hook_points[0])
        self.n_store_rows = self.source.n_rows(self.hook_points[0])
        self._check_consistent(hook_points_given=hook_points is not None)
        self.columns = _names(columns, "columns", "row-table column names") if columns is not None else []
        # the per-sample columns read from token rows (None: any, as a filter sees every column)
        self._columns_read: list[str] | None = None if filter is not None else self.columns
        self._col_cache: dict[str, Any] | None = None
        if self.columns:
            have = self._row_columns()  # (the columns read once rows are selected: _column_values)
            missing = [c for c in self.columns if c not in have]
            if missing:
                raise self._missing_columns_error(missing, have)
        clash = set(self.columns) & set(self.hook_points)
        if clash:
            raise ArgumentValueError(f"column names clash with hook point names: {sorted(clash)}")
        # the rows of the dataset: a range of store rows, or an int64 tensor of store rows
        self._start, self._stop, self._ids = 0, self.n_store_rows, None
        self._window: tuple[int, int, torch.Tensor, dict, str, Any] | None = None  # see _remember_window
        # the source's gather plan of the last shuffled batch, for the next ones
        self._plan: _Plan | None = None
        self._select_rows(rows)
        if filter is not None or sample_ids is not None:
            self._apply_filter(filter, sample_ids)
        if self.columns:
            # the columns as tensors now: a null in a row of the dataset is refused here, not at
            # the first read (in a DataLoader worker, after the training loop started), and
            # DataLoader workers share these tensors instead of each reading the row table
            # again (45 s before the first batch and 3 GB more per worker, of a store of 50
            # million token rows): forked ones as the parent's memory, spawned ones in shared
            # memory (_reduce_for_processes)
            self._column_values()

    # ------------------------------------------------------------------ construction
    def _select_hook_points(self, hook_points: Any) -> list[str]:
        return select_hook_points(self.source, hook_points)

    def _check_consistent(self, hook_points_given: bool = True) -> None:
        kinds = {hp: self.source.row_kind(hp) for hp in self.hook_points}
        if len(set(kinds.values())) > 1:
            by_kind: dict[str, list[str]] = {}
            for hp, k in kinds.items():
                by_kind.setdefault(k, []).append(hp)
            default = ("" if hook_points_given else
                       "; hook_points= was not given, so every hook point of the store was taken")
            raise ArgumentValueError(
                "hook points of one ActivationDataset must have the same row kind, got "
                + ", ".join(f"{hp!r}: {k}" for hp, k in kinds.items())
                + default + "; make one dataset per row kind: "
                + " or ".join(f"hook_points={hps!r} ({k} rows)" for k, hps in by_kind.items())
            )
        lost = [hp for hp in self.hook_points if not self.source.follows_row_table(hp)]
        if lost and len(self.hook_points) > 1:
            raise ArgumentValueError(
                f"hook points {lost} of {self.source.describe()} do not follow the row table (store.follows_row_table() "
                "is False: first captured after some forwards, or missing from one), so their row i is not row i of the other hook points "
                f"{[hp for hp in self.hook_points if hp not in lost]}; make a dataset of each of them alone"
            )
        counts = {hp: self.source.n_rows(hp) for hp in self.hook_points}
        if len(set(counts.values())) > 1:
            lost = [hp for hp in self.hook_points if not self.source.follows_row_table(hp)]
            raise ArgumentValueError(
                "hook points of one ActivationDataset must have the same number of rows, got "
                + ", ".join(f"{hp!r}: {n}" for hp, n in counts.items())
                + (f"; {lost} do not follow the row table (first captured after some forwards, or missing from one): make a dataset "
                   "of each of them alone" if lost else "")
            )

    def _refuse_lost(self) -> None:
        lost = [hp for hp in self.hook_points if not self.source.follows_row_table(hp)]
        if lost:
            # columns=, filter= or sample_ids= given for such a hook point: an argument this
            # dataset cannot honour, refused as export_parquet / export_arrow refuse it
            raise ArgumentValueError(
                f"the rows of hook points {lost} do not follow the {self.row_kind} row table of "
                f"{self.source.describe()} (store.follows_row_table() is False: first captured after some forwards, or "
                "missing from one, their row i is not row i of the table), so columns, filter and sample_ids cannot be used "
                "with them; read them without those (rows= still selects stored rows)"
            )

    def _missing_columns_error(self, missing: list[str], have: list[str]) -> ArgumentValueError:
        """The error of ``columns=`` naming columns ``missing`` that the row table (its columns
        ``have``) lacks, with the closest names, and, of a store whose capture has committed no
        row yet, that set_batch's columns appear with its first commit (a dataset's and an
        export's ``columns=`` alike)."""
        store = getattr(self.source, "store", None)
        status = getattr(store, "status", None)
        empty = ""
        if self.n_store_rows == 0 and status not in (None, "complete"):
            # (set_batch's columns reach the row table with the first commit)
            empty = (f": the store is {status} with no committed row yet (a capture still running?), and "
                     "columns given to set_batch appear with its first commit; call store.refresh() and "
                     "make the dataset (or export) again once rows are committed")
        return ArgumentValueError(
            f"columns {missing} are not in the {self.row_kind} row table of {self.source.describe()}; "
            f"it has {have}{column_hint(missing, have)}{empty}"
        )

    def _row_columns(self) -> list[str]:
        """The columns of the dataset's row table (a token table's with its samples' columns),
        from the tables' schemas: no column is decoded but those the table's checks read."""
        self._refuse_lost()
        names = list(self.source.row_schema(self.row_kind).names)
        if self.row_kind == "token" and "sample_id" in names:
            # (a store with no sample rows has an empty sample table: a failed read is damage, raised)
            samples = self.source.row_schema("sample").names
            if "sample_id" in samples:
                names += [c for c in samples if c not in names]
        return names

    def _token_columns(self, names: list[str]) -> pa.Table:
        """The columns ``names`` of the token rows (those the token table or its samples have),
        in the order of ``names``, the token table's own columns first: the per-sample ones
        read of the sample table with its keys, and paired with the token rows through the
        token table's keys, read one at a time (only those columns of both tables decoded; a
        key not in ``names`` let go of before the next is read, and before the per-sample
        columns are repeated onto the token rows), see :func:`_sample_runs`."""
        own = self.source.row_schema("token").names
        if all(c in own for c in names):
            return self.source.row_table("token", names)
        table = self.source.row_table("token", names)  # (the token table's own columns of names)

        def key_column(key: str) -> pa.ChunkedArray:  # (a key not in names: read for the join only)
            return self.source.row_table("token", [key]).column(key)

        runs = _sample_runs(table, self.source, names, own, key_column, self.source.row_schema("token"))
        if runs is not None:
            pa.default_memory_pool().release_unused()  # (the keys' memory back to the system first)
            table = _append_runs(table, *runs)
        return table.select([c for c in table.column_names if c in names])

    def _row_table(self, names: list[str] | None = None) -> pa.Table:
        """The row table of the dataset's store rows (token rows with their sample's columns),
        checked against the hook points' rows. ``names``: only these columns are read (those
        the tables have: the others are left out), in their order (a token table's own columns
        first); None: every column.

        Raises ArgumentValueError for hook points that do not follow the row table, and
        StoreCorruptError where the table and the rows disagree."""
        self._refuse_lost()
        if names is None:
            table = self.source.row_table(self.row_kind)
            if self.row_kind == "token":
                table = _with_sample_columns(table, self.source, getattr(self, "_columns_read", None))
        elif self.row_kind == "token":
            table = self._token_columns(names)
        else:
            table = self.source.row_table(self.row_kind, names)
        if table.num_rows > self.n_store_rows:  # rows committed for other hook points only
            attrs = getattr(getattr(self.source, "store", None), "attrs", None)
            dist = attrs.get("distributed") if isinstance(attrs, dict) else None
            told = table  # (the batch column tells where the rows end: read for that where not read)
            if "batch" not in told.column_names and names is not None:
                told = self.source.row_table(self.row_kind, ["batch"])
            damage = short_of_row_table_line(
                self.hook_points[0], self.n_store_rows, self.row_kind, table.num_rows, told,
                isinstance(dist, dict) and dist.get("committed") is True,
                "its rows cannot be paired with the table's; run store.verify() and restore the store from its source")
            if damage is not None:  # (where verify names it: never trimmed without a word)
                raise StoreCorruptError(f"{self.source.describe()}: {damage}")
            table = table.slice(0, self.n_store_rows)
        if table.num_rows != self.n_store_rows:
            # the table and the hook point's rows are committed together: fewer rows is damage
            raise StoreCorruptError(
                f"the {self.row_kind} row table of {self.source.describe()} has {table.num_rows} rows, "
                f"but hook point {self.hook_points[0]!r}, which follows it, has {self.n_store_rows}: the store's "
                "root and its row-table files disagree; run store.verify() and restore the store from its source"
            )
        return table

    def _select_rows(self, rows: Any) -> None:
        n = self.n_store_rows
        if rows is None:
            return
        if isinstance(rows, slice):
            rows = _slice_range(rows, n, "rows")  # a slice clips to the rows there are, as in Python
        if isinstance(rows, range):
            if not rows:
                self._start = self._stop = 0
                return
            r0, r1 = rows[0], rows[-1]
            if (rows.step == 1 or r0 == r1) and 0 <= r0 and r1 < n:
                self._start, self._stop = r0, r1 + 1
                return
            ids = _range_positions(rows, n, "rows", "store rows")  # a range is its positions: never clipped
        else:
            ids = _as_index(rows, "rows", n, "store rows", _ROWS_KINDS)
            if ids.dtype == torch.bool:
                if ids.shape != (n,):
                    raise ArgumentValueError(f"a bool rows mask must have shape ({n},), got {tuple(ids.shape)}")
                ids = ids.nonzero().squeeze(1)
            if ids.dtype not in _INT_DTYPES or ids.dim() != 1:
                raise ArgumentTypeError(
                    f"rows must be {_ROWS_KINDS}, got {_short(rows)}" + _tensor_fix(ids, "rows")
                )
            ids = ids.to(torch.int64)
            _check_positions(ids, n, "rows", "store rows")
        self._ids = torch.where(ids < 0, ids + n, ids).contiguous()

    def _store_ids(self) -> torch.Tensor:
        return self._ids if self._ids is not None else torch.arange(self._start, self._stop, dtype=torch.int64)

    def _filter_columns(self, filter: Any, sample_ids: Any) -> list[str] | None:
        """The row-table columns ``filter=`` and ``sample_ids=`` read: ``sample_id``, and every
        column whose name is in the expression's text (a superset of the fields it names:
        an expression that names another reads the whole table, see :meth:`_apply_filter`);
        None (every column) for a callable, which sees the whole table, and for an expression
        that names a column by its position (``pc.field(3)``: the 4th column of the whole
        table, another one of a table of some columns)."""
        if filter is not None and not isinstance(filter, pc.Expression):
            return None
        names = ["sample_id"] if sample_ids is not None else []
        if filter is not None:
            text = str(filter)
            if "FieldPath(" in text:  # (how str() shows a field named by position)
                return None
            names += [c for c in self._row_columns() if c in text and c not in names]
        return names

    def _apply_filter(self, filter: Any, sample_ids: Any) -> None:
        names = self._filter_columns(filter, sample_ids)
        table = self._row_table(names)
        n = table.num_rows
        mask = np.ones(n, dtype=bool)
        if sample_ids is not None:
            if "sample_id" not in table.column_names:
                raise ArgumentValueError(f"sample_ids= needs a 'sample_id' column in the {self.row_kind} row table")
            id_type = table.schema.field("sample_id").type
            if isinstance(sample_ids, pa.Array):
                ids = sample_ids
            elif pa.types.is_string(id_type) or pa.types.is_large_string(id_type):
                ids = _sample_id_strings(sample_ids)  # a store captured with str sample ids
            elif pa.types.is_uint64(id_type) or pa.types.is_floating(id_type):
                ids = _sample_id_numbers(sample_ids, id_type)  # beyond int64, or fractions
            else:
                ids = _sample_id_array(sample_ids)
            try:
                wanted = pa.array(ids).cast(id_type)
            except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as e:
                # (a pyarrow Array of another type: strings for int ids, fractions)
                raise ArgumentTypeError(
                    f"sample_ids= must hold ids of the store's sample_id type ({id_type}), got {_short(sample_ids)}: "
                    f"{str(e).splitlines()[0] if str(e) else type(e).__name__}"
                ) from None
            hit = pc.is_in(table.column("sample_id"), value_set=wanted)
            mask &= hit.to_numpy(zero_copy_only=False).astype(bool)
            some = wanted.slice(0, 5).to_pylist()
        if filter is not None:
            if isinstance(filter, pc.Expression):
                try:
                    fmask = _expression_mask(filter, table)
                except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as e:
                    if names is None:
                        raise self._filter_error(filter, table, e) from None
                    # the columns read may lack one it names: said of (or evaluated on) every column
                    whole = self._row_table()
                    try:
                        fmask = _expression_mask(filter, whole)
                    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as e:
                        raise self._filter_error(filter, whole, e) from None
            elif callable(filter):
                fmask = _as_bool_mask(filter(table), n, self.row_kind)
            else:
                raise ArgumentTypeError(f"filter must be a pyarrow.compute.Expression or a callable, got {filter!r}")
            mask &= fmask
        keep = torch.from_numpy(mask)
        if self._ids is None:  # (a range of rows: no index of every row made)
            chosen = np.flatnonzero(mask[self._start:self._stop])
            if self._start:
                chosen += self._start
            chosen = torch.from_numpy(chosen.astype(np.int64, copy=False))
        else:
            chosen = self._ids[keep[self._ids]]
        n_rows = len(self)
        if sample_ids is not None and len(wanted) and not chosen.numel() and n_rows:
            # an intersection with rows= and filter=, but none at all is a mistake (an empty
            # collection selects no sample: an empty dataset, as rows=[] is)
            if bool(hit.to_numpy(zero_copy_only=False).any()):  # rows there are, left out by rows= / filter=
                rows_given = self._ids is not None or (self._start, self._stop) != (0, n)
                where = [w for w, on in (("within rows=", rows_given), ("after filter=", filter is not None)) if on]
                why = f" ({' and '.join(where)})"
            elif self.row_kind == "token" and self._samples_without_rows(wanted):
                why = (": those samples have no token rows in this store (the attention mask left out every position "
                       "of theirs)")
            else:
                why = ""
            raise ArgumentValueError(
                f"none of the sample_ids= (e.g. {some}) is in this dataset's {self.row_kind} row table{why}; read the "
                f"ids there are with store.row_table({self.row_kind!r})['sample_id']"
            )
        if sample_ids is not None and len(wanted):
            self._refuse_unknown_ids(wanted, table)
        self._ids = chosen.contiguous()

    def _stored_sample_ids(self, id_type: pa.DataType) -> pa.ChunkedArray | None:
        """The ids of the store's ``sample`` row table as ``id_type``; None where it has no
        ``sample_id`` column or its ids are not of that type. A table that cannot be read
        (StoreCorruptError of a damaged part) raises: never taken as a store without samples."""
        ids = self.source.row_table("sample", ["sample_id"])
        if "sample_id" not in ids.column_names:
            return None
        try:
            return ids.column("sample_id").cast(id_type)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            return None

    def _samples_without_rows(self, wanted: pa.Array) -> bool:
        """Whether some of ``wanted`` are samples of the store's ``sample`` row table (a token
        dataset's ids that select no token row: samples with none)."""
        samples = self._stored_sample_ids(wanted.type)
        return samples is not None and bool(pc.any(pc.is_in(wanted, value_set=samples)).as_py())

    def _refuse_unknown_ids(self, wanted: pa.Array, table: pa.Table) -> None:
        """ArgumentValueError when ``sample_ids=`` holds ids that no sample of the store has (a
        typo, ids of another store): the selection would leave them out without a word. The
        store's samples are those of the dataset's row table and of the store's ``sample`` row
        table (a sample with no token row is one). Ids that ``rows=`` or ``filter=`` leave out
        are no error."""
        # (each table's ids looked up in a set of the wanted ids, never a set of the table's:
        # a token table of tens of millions of rows made a hash set of every row's id)
        known = _ids_in(wanted, table.column("sample_id").cast(wanted.type))
        samples = self._stored_sample_ids(wanted.type) if self.row_kind != "sample" else None
        if samples is not None:  # (no sample table: the dataset's own)
            known = pc.or_(known, _ids_in(wanted, samples))
        absent = pc.invert(known)
        n_absent = pc.sum(absent).as_py() or 0
        if n_absent:
            missing = wanted.filter(absent)
            raise ArgumentValueError(
                f"sample_ids= holds {n_absent} id(s) that no sample of {self.source.describe()} has (e.g. "
                f"{missing.slice(0, 5).to_pylist()}): the dataset would leave them out without a word; pass only ids "
                "the store has (store.row_table('sample')['sample_id']; intersect your ids with them to select what "
                "there is)"
            )

    def _filter_error(self, filter: pc.Expression, table: pa.Table, error: Exception) -> ArgumentValueError:
        """ArgumentValueError for a filter expression Arrow cannot evaluate on the row table:
        the fields it names that the table lacks, or Arrow's reason, and the table's columns."""
        columns = ", ".join(f"{f.name}: {f.type}" for f in table.schema)
        message = str(error)
        unknown = re.match(r"No match for (FieldRef\..*?) in ", message, re.DOTALL)
        if unknown:
            names = re.findall(r"FieldRef\.Name\(([^)]*)\)", unknown.group(1))
            field = ".".join(names) if names else unknown.group(1)
            return ArgumentValueError(
                f"filter {filter} names field {field!r}, which is not a column of the {self.row_kind} row table of "
                f"{self.source.describe()}; its columns are [{columns}]"
            )
        return ArgumentValueError(
            f"filter {filter} cannot be evaluated on the {self.row_kind} row table of {self.source.describe()}: "
            f"{message.splitlines()[0] if message else type(error).__name__}; its columns are [{columns}]"
        )

    # ------------------------------------------------------------------ pickling
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_col_cache"] = None  # (read again where unpickled; see _reduce_for_processes)
        state["_window"] = None  # (a view of the mapped rows: never pickled)
        state["_plan"] = None  # (nor the mapped segments)
        return state

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        ForkingPickler.register(cls, _reduce_for_processes)  # (found by exact type, as every reducer)

    # ------------------------------------------------------------------ size and index
    def __len__(self) -> int:
        """Number of rows in the dataset (after ``rows=``, ``sample_ids=`` and ``filter=``)."""
        return int(self._ids.numel()) if self._ids is not None else self._stop - self._start

    @property
    def store(self) -> Any:
        """The open store (reopened lazily in each process)."""
        return self.source.store

    def store_rows(self) -> torch.Tensor | range:
        """Store rows of the dataset, in dataset order: a ``range`` or an int64 Tensor (len,) (a copy)."""
        return range(self._start, self._stop) if self._ids is None else self._ids.clone()

    def fit_cache_to_window(self, window_rows: int, sampler: str = "a shuffled sampler") -> None:
        """Make the store's cache of decoded chunks hold a shuffle window of ``window_rows``
        dataset rows of every hook point read by decoding (compressed, or of a remote store),
        so that each of its chunks is decoded once while the window is read in a random
        order; a no-op for uncompressed local hook points (read as views).
        :class:`ChunkShuffleBatchSampler` (its windows) and :class:`ShuffledBatchSampler` (the
        whole dataset) call it when built on this dataset.

        The cache (default 64 MiB) is raised, here and in DataLoader workers, up to
        :data:`WINDOW_CACHE_MAX_BYTES` (1 GiB per store a dataset opened, in each process),
        when its size was not given (``open_options={"cache_bytes": ...}``, a store opened by
        the caller, or an ``opener=`` in ``open_options``, which opens the store as it says).
        Otherwise, when the window needs more, warns (``RuntimeWarning``) naming the bytes it
        needs and the fix: batches then decode chunks again, up to one per row.

        Parameters
        ----------
        window_rows : int
            Dataset rows of one window (at most the dataset's length: the whole dataset). The
            chunks it decodes are counted per hook point, from the blocks a window is made of
            (:meth:`block_boundaries`): more than its rows where a block's rows lie in larger
            chunks (a narrower hook point than the first) or are a sparse or unsorted selection
            (``rows=``, ``filter=``, ``sample_ids=``).
        sampler : str
            What asks, for the warning.
        """
        n = len(self)
        window_rows = min(max(0, int(window_rows)), n)
        if window_rows == 0:
            return
        fit = getattr(self.source, "fit_decoded_cache", None)
        if not callable(fit):
            return
        memo: dict[int, int] = {}

        def rows_of(chunk_rows: int) -> int:
            if chunk_rows not in memo:
                memo[chunk_rows] = self._window_chunk_rows(window_rows, chunk_rows)
            return memo[chunk_rows]

        out = fit(self.hook_points, rows_of, WINDOW_CACHE_MAX_BYTES)
        if out is None:
            return
        need, have, decoded, given = out
        mib = 1 << 20
        why = ("the size given" if given else
               f"{WINDOW_CACHE_MAX_BYTES // mib} MiB is the most a dataset raises it to by itself")
        warn_at_caller(
            f"{sampler}: a window of {window_rows:,} rows of {decoded} (compressed or remote: read by decoding "
            f"chunks) needs about {-(-need // mib):,} MiB of decoded chunks, more than the store's cache of "
            f"{have // mib:,} MiB ({why}): its batches decode chunks again, up to one per row (tens of times "
            f"slower); open the dataset with open_options={{'cache_bytes': {need}}} (a store: open_store(..., "
            f"cache_bytes={need})), or read smaller windows (ChunkShuffleBatchSampler(..., buffer_rows=...))",
            RuntimeWarning)

    def _window_chunk_rows(self, window_rows: int, chunk_rows: int) -> int:
        """Rows of the whole chunks of ``chunk_rows`` rows that a shuffle window of
        ``window_rows`` dataset rows decodes at most (all of the dataset's chunks for a window of
        the whole dataset). A window of :class:`ChunkShuffleBatchSampler` is made of whole blocks
        (:meth:`block_boundaries`: the chunks of the first hook point, for a compressed one) in
        any order; each block decodes the chunks its store rows lie in, which for a hook point
        of other chunks (another width) or a sparse or unsorted selection of rows are more rows
        than its own. Bounded by the blocks that decode the most rows per dataset row, taken
        first until they hold ``window_rows`` rows (the last one in part)."""
        n, c = len(self), max(1, int(chunk_rows))
        ids = self._ids
        if ids is None:
            if window_rows >= n:
                return ((self._stop - 1) // c - self._start // c + 1) * c if n else 0
            bounds = self.block_boundaries()
            lo, hi = bounds[:-1] + self._start, bounds[1:] + self._start
            chunks = torch.where(hi > lo, (hi - 1) // c - lo // c + 1, 0)
        else:
            chunk = ids // c
            if window_rows >= n:
                return int(torch.unique(chunk).numel()) * c
            bounds = self.block_boundaries()
            sizes = torch.diff(bounds)
            block = torch.repeat_interleave(torch.arange(sizes.numel(), dtype=torch.int64), sizes)
            if bool((ids[1:] >= ids[:-1]).all()):  # (sorted: a block's chunks in order, a new one where it changes)
                new = torch.ones(n, dtype=torch.bool)
                new[1:] = (chunk[1:] != chunk[:-1]) | (block[1:] != block[:-1])
                chunks = torch.bincount(block[new], minlength=sizes.numel())
            else:  # (the chunks of each block, each once: (block, chunk) pairs made one key)
                span = int(chunk.max()) + 1
                chunks = torch.bincount(torch.unique(block * span + chunk) // span, minlength=sizes.numel())
        sizes = torch.diff(bounds)
        keep = sizes > 0
        rows, sizes = (chunks[keep] * c).double(), sizes[keep].double()
        ratio = rows / sizes
        order = torch.argsort(ratio, descending=True, stable=True)
        rows, sizes, ratio = rows[order], sizes[order], ratio[order]
        held = torch.cumsum(sizes, 0)
        k = min(int(torch.searchsorted(held, float(window_rows))), held.numel() - 1)
        before = float(held[k - 1]) if k else 0.0
        return math.ceil(float(rows[:k].sum()) + (window_rows - before) * float(ratio[k]))

    def block_boundaries(self) -> torch.Tensor:
        """Dataset positions where the store's segments (shards) begin, int64 ``(n_blocks + 1,)``.

        Runs of dataset positions between two boundaries lie in one shard. Used by
        :class:`ChunkShuffleBatchSampler`.
        """
        bounds = self.source.boundaries(self.hook_points[0])
        n = len(self)
        if self._ids is None:
            inner = (bounds - self._start).clamp(0, n)
        else:
            ids = self._ids
            if ids.numel() > 1 and not bool((ids[1:] >= ids[:-1]).all()):
                # unsorted selection: each maximal run inside one shard is a block
                seg = torch.searchsorted(bounds, ids, right=True)
                change = (seg[1:] != seg[:-1]).nonzero().squeeze(1) + 1
                return torch.cat([torch.tensor([0]), change, torch.tensor([n])]).to(torch.int64)
            inner = torch.searchsorted(ids, bounds)
        return torch.unique_consecutive(torch.cat([torch.tensor([0]), inner, torch.tensor([n])]).to(torch.int64))

    def _resolve(self, index: Any) -> tuple[int, int] | torch.Tensor:
        """Dataset positions -> (start, stop) of contiguous store rows, or an int64 Tensor of store rows."""
        n = len(self)
        if isinstance(index, slice):
            index = _slice_range(index, n, "ds[index]: index")  # clipped, as in Python
        if isinstance(index, range):
            if not index:
                return (self._start, self._start) if self._ids is None else (0, 0)
            r0, r1 = index[0], index[-1]
            if (index.step == 1 or r0 == r1) and 0 <= r0 and r1 < n:
                if self._ids is None:
                    return (self._start + r0, self._start + r1 + 1)
                pos = torch.arange(r0, r1 + 1, dtype=torch.int64)
            else:  # a range is its positions, as a list: never clipped, negatives count from the end
                pos = _range_positions(index, n, "ds[index]: index", "dataset rows")
                pos = torch.where(pos < 0, pos + n, pos)
        else:
            if isinstance(index, str):
                raise self._name_index_error(index)
            pos = _as_index(index, "ds[index]: index", n, "dataset rows", _ITEM_KINDS)
            if pos.dtype == torch.bool and pos.dim() == 1:  # a mask, as in tensor[mask]
                if pos.shape[0] != n:
                    raise ArgumentValueError(
                        f"ds[index]: a bool mask must have one entry per dataset row, shape ({n},), got shape "
                        f"({pos.shape[0]},); build it over the dataset's rows (e.g. from ds.columns)"
                    )
                pos = pos.nonzero().squeeze(1)
            if pos.dtype not in _INT_DTYPES or pos.dim() != 1:
                raise ArgumentTypeError(
                    f"ds[index]: a batch index must be a 1-D sequence of ints, got {_short(index)}"
                    + _tensor_fix(pos, "ds[index]")
                )
            pos = pos.to(torch.int64)
            if pos.numel():
                lo, hi = (int(v) for v in torch.aminmax(pos))
                if lo < -n or hi >= n:
                    _check_positions(pos, n, "ds[index]: index", "dataset rows")
                if lo < 0:
                    pos = torch.where(pos < 0, pos + n, pos)
        if self._ids is None:
            ids = pos + self._start if self._start else pos
        else:
            ids = self._ids[pos]
        k = ids.numel()
        if k == 0:
            return (0, 0)
        first, last = ids[0].item(), ids[-1].item()
        if last - first == k - 1 and (k == 1 or bool((ids[1:] - ids[:-1] == 1).all())):
            return (first, last + 1)
        return ids

    # ------------------------------------------------------------------ columns
    def _column_values(self) -> dict[str, Any]:
        if self._col_cache is None:
            cache: dict[str, Any] = {}
            if self.columns:
                table = self._row_table(self.columns)  # (those columns only: never the whole table)
                for name in self.columns:
                    col = table.column(name)
                    col = col.chunk(0) if col.num_chunks == 1 else col.combine_chunks()  # (one chunk: no copy)
                    if col.null_count and _numeric(col.type):
                        col = self._fill_unread_nulls(col, name)
                    cache[name] = _column_to_torch(col, name)
            self._col_cache = cache
        return self._col_cache

    def _fill_unread_nulls(self, col: pa.Array, name: str) -> pa.Array:
        """A numeric column with nulls, its nulls filled with 0 when none is in a row of this
        dataset (the values are kept per store row; those rows are never read).

        Raises ArgumentValueError when a row of the dataset has a null: a tensor has no null."""
        nulls = col.is_null().to_numpy(zero_copy_only=False)
        ids = self._store_ids().numpy()
        bad = np.flatnonzero(nulls[ids])
        if bad.size:
            raise ArgumentValueError(
                f"row-table column {name!r} of {self.source.describe()} is null in {bad.size} of this dataset's rows "
                f"(first: dataset row {int(bad[0])}, store row {int(ids[bad[0]])}), and a tensor has no null; keep "
                f"the rows where it is set with filter=pc.field({name!r}).is_valid(), or leave it out of columns="
            )
        return pc.fill_null(col, pa.scalar(False if pa.types.is_boolean(col.type) else 0, type=col.type))

    # ------------------------------------------------------------------ reading
    def get_batch(self, index: Any) -> dict[str, Any]:
        """Read a whole batch.

        Parameters
        ----------
        index : slice, range, list or tuple of int, Tensor or ndarray (k,) integer, or bool mask (len(ds),)
            Dataset positions, in ``[-len(ds), len(ds))`` (negative ones count from the
            end); a 1-D bool tensor, ndarray or list with one entry per dataset row reads the
            rows where it is True, in order (as ``tensor[mask]``). A slice is clipped to the rows there are, as in Python; a range is its list
            of positions and is never clipped. Integer tensors of any device but ``meta`` and
            any integer dtype but uint8 are taken (uint64 positions of 2**63 and beyond are
            out of range, not wrapped round; a uint8 tensor is refused, as torch indexing
            reads it as a mask: pass ``.bool()`` or ``.long()``; a uint8 ndarray is positions).

        Returns
        -------
        dict
            ``{hook point: Tensor (k, *feature_shape), stored dtype}`` and
            ``{column: Tensor (k,) | list of str}``. For a slice or range inside one shard
            of an uncompressed store, each hook point's tensor is a view of the memory-mapped
            shard (no copy; writing into it changes neither the store on disk nor other
            readers' data, but does change what this process reads from those rows later).
            Otherwise it is one new tensor: one copy across shards, and for positions given
            as a list, tuple or tensor always a gather of the rows into a new tensor (a native
            pass over the mapped shards of an uncompressed local store, else
            ``torch.index_select``), also when they happen to be consecutive. Column tensors
            are always new tensors (the dataset's values are never handed out to be changed).

        Raises
        ------
        ArgumentTypeError
            An index of a kind that selects no rows: a set or frozenset (no order), a str
            (rows are selected by position; the message names the hook points and columns),
            None, a float or bool, a list holding anything but ints (a bool among ints
            included), a float, uint8 or 2-D tensor, a 2-D bool mask, a sparse tensor. A TypeError; the message names the index and the fix.
        ArgumentValueError
            An index tensor on the meta device (it holds no values); a bool mask whose
            length is not ``len(ds)``.
        RowIndexError
            A position outside ``[-len(ds), len(ds))`` (also ints beyond int64, and a range
            past the end); the message names the first such position. An IndexError.
        StoreError
            Another run was written in the store's place (an overwrite) and the store
            refreshed since this dataset was made (see :meth:`_check_run`).

        Notes
        -----
        In a DataLoader worker every tensor is the batch's own (a view is copied): a view of
        the store's map would reach the main process as a copy of the whole map into shared
        memory (torch pickles a tensor's whole storage), the whole store for each worker.
        """
        data = self._get_batch(index)
        return data if get_worker_info() is None else _owned(data)

    def _get_batch(self, index: Any) -> dict[str, Any]:
        """:meth:`get_batch`, views included also in a DataLoader worker (for :meth:`__getitems__`,
        which copies its batch into shared memory there)."""
        self._check_run()
        try:
            data = self._read_batch(index)
        except Exception:
            # (a hook point missing from a run being written in the store's place, refreshed
            # while the batch was read: said as what it is)
            self._check_run()
            raise
        # again: another thread's ``store.refresh()`` of an overwritten store while the batch
        # was read gives the new run's rows of the hook points read after it (and the old run's
        # of those before): never such a batch (a read after a refresh syncs the source's run)
        if self.source._run != self._run:
            self._check_run()
        return data

    def _read_batch(self, index: Any) -> dict[str, Any]:
        if self._ids is None and isinstance(index, (list, tuple, torch.Tensor)):
            data = self._gather(index)
            if data is not None:
                return data
        where = self._resolve(index)
        if isinstance(where, tuple) and not isinstance(index, (slice, range)):
            where = torch.arange(*where, dtype=torch.int64)  # positions: a new tensor, never a view
        cols = self._col_cache if self._col_cache is not None else self._column_values()
        if isinstance(where, tuple):
            a, b = where
            read = self.source.read
            data: dict[str, Any] = {hp: read(hp, a, b) for hp in self.hook_points}
            for name, col in cols.items():
                # (the dataset's own column values, not the store's: each batch gets a copy, so
                # that an in-place change, ``batch["label"] -= 1``, never reaches later reads)
                data[name] = col[a:b].clone() if isinstance(col, torch.Tensor) else col[a:b]
        else:
            take = self.source.take
            data = {hp: take(hp, where) for hp in self.hook_points}
            for name, col in cols.items():
                data[name] = col[where] if isinstance(col, torch.Tensor) else _pick(col, where.tolist())
        return data

    def _gather(self, index: Any) -> dict[str, Any] | None:
        """The batch at dataset positions ``index`` (list, tuple or int64 tensor) through the
        native gather of the source (one pass: positions checked, rows copied), or None when
        it does not apply (see :meth:`StoreSource.gather`); only for unfiltered datasets."""
        hps = self.hook_points
        cols = self._col_cache if self._col_cache is not None else self._column_values()
        source = self.source
        got = source.gather(hps[0], index, self._stop - self._start, self._start, bool(cols) or len(hps) > 1)
        if got is None:
            return None
        rows, a, b, ids = got
        if a >= 0:  # consecutive store rows [a, b) within one segment: a view, but a batch
            # given as positions is always the caller's own copy (a shuffled sampler's batch is
            # consecutive now and then: an in-place change must not reach later reads)
            data: dict[str, Any] = {hps[0]: rows.clone()}
            for hp in hps[1:]:
                data[hp] = source.read(hp, a, b).clone()
            for name, col in cols.items():
                data[name] = col[a:b].clone() if isinstance(col, torch.Tensor) else col[a:b]
            return data
        data = {hps[0]: rows}
        for hp in hps[1:]:
            other = source.gather(hp, ids, source.n_rows(hp), 0, False)
            if other is None:
                data[hp] = source.take(hp, ids)
            else:  # (consecutive rows within one of this array's shards, which may hold more rows: a view)
                data[hp] = other[0].clone() if other[1] >= 0 else other[0]
        for name, col in cols.items():
            data[name] = col[ids] if isinstance(col, torch.Tensor) else _pick(col, ids.tolist())
        return data

    def __getitems__(self, indices: Sequence[int]) -> Batch:
        """Read a batch for ``DataLoader`` (called with the batch sampler's index list).

        Returns a :class:`Batch`; ``default_collate`` (and :func:`collate`) turn it into the
        dict of :meth:`get_batch` without stacking rows. In a DataLoader worker its tensors
        are already in shared memory (one copy, also for a view of the store), so that the
        batch crosses to the main process as it is, whatever ``collate_fn`` does with it.

        Parameters
        ----------
        indices : sequence of int
            Dataset positions (a list or range, as a batch sampler yields them); taken as
            :meth:`get_batch` takes them.
        """
        batch = self._getitems(indices)
        if get_worker_info() is not None:  # (never a view of the store's map: see get_batch)
            batch.data = _finish(batch.data)
        return batch

    def _getitems(self, indices: Sequence[int]) -> Batch:
        if type(indices) is range:
            # a sequential batch sampler's batch: rows [start, stop) of every hook point
            # (per-batch Python here costs as much as the batch's own bookkeeping: keep it short)
            w = self._window
            if w is not None:  # one hook point: the mapped rows the last batch came from
                a, b, lo = indices.start, indices.stop, w[0]
                if lo <= a < b <= w[1] and indices.step == 1 and w[3] is self.source._recent:
                    # ... while the source reads the same store: not after a refresh (or a reopen)
                    if getattr(self.source._store, "attrs", None) is w[5]:
                        return Batch({w[4]: w[2][a - lo : b - lo]}, b - a)
            if self._ids is None and not self.columns:
                start = self._start
                a, b = indices.start + start, indices.stop + start
                if indices.step == 1 and start <= a < b <= self._stop:
                    self._check_run()
                    read = self.source.read
                    hps = self.hook_points
                    if len(hps) == 1:
                        rows = read(hps[0], a, b)
                        self._remember_window(hps[0])
                        return Batch({hps[0]: rows}, b - a)
                    data = {hp: read(hp, a, b) for hp in hps}
                    if self.source._run != self._run:  # (one run's rows: see _get_batch)
                        self._check_run()
                    return Batch(data, b - a)
        elif type(indices) is list:
            # a shuffled batch sampler's batch: one native gather, as get_batch's would be
            g = self._plan
            if g is not None and g.token[0] is self.source._seg_lists and (
                    getattr(self.source._store, "attrs", None) is g.token[1]):
                # in a DataLoader worker the rows go straight into shared memory (one copy
                # fewer: the batch then crosses to the main process as it is)
                out = _shared_empty((len(indices), *g.feature_shape), g.dtype) if g.in_worker else None
                got = g.gather(indices, g.n, g.start, g.bounds, g.segments, False, out, g.hint)
                if type(got) is tuple and got[1] < 0:  # (not a view of consecutive rows: get_batch clones those)
                    rows = got[0]
                    return Batch({g.hook_point: rows}, rows.shape[0])
            data = self._get_batch(indices)
            if self._ids is None and not self.columns and len(self.hook_points) == 1:
                hp = self.hook_points[0]
                plan = self.source.gather_plan(hp)
                self._plan = None if plan is None or self.source._run != self._run else _Plan(
                    *plan, self._stop - self._start, self._start, hp, tuple(self.source.feature_shape(hp)),
                    self.source.dtype(hp), get_worker_info() is not None)
            return Batch(data, len(data[self.hook_points[0]]))
        data = self._get_batch(indices)
        return Batch(data, len(data[self.hook_points[0]]))  # (a bool mask reads fewer rows than its length)

    def _check_run(self) -> None:
        """Raise :class:`StoreError` when the store now holds another run than when this
        dataset was made (``overwrite=True`` by another capture, then ``store.refresh()``):
        the dataset's length, row selection (``rows=``, ``filter=``, ``sample_ids=``) and
        columns are the old run's, and would be paired with the new run's rows. A store grown
        by a resume keeps its run: the dataset reads its old rows as before."""
        run = self.source.run()
        if run != self._run:
            was = "none" if self._run is None else (self._run[0] or f"created {self._run[1]}")
            now = "none" if run is None else (run[0] or f"created {run[1]}")
            raise StoreError(
                f"the store {self.source.describe()} holds another run than when this dataset was made (run {was} "
                f"then, {now} now: another run was written in its place, and the store was refreshed or reopened, e.g. by a "
                "DataLoader worker); this dataset's length, rows and columns are "
                "the old run's. Make a new ActivationDataset of the store"
            )

    def _remember_window(self, hp: str) -> None:
        """Keep, in dataset positions, the mapped rows the source's last read of ``hp`` came
        from (``StoreSource._recent``: within one mapped segment and its read-ahead hint), so
        that the next sequential batches inside them are sliced here directly; the window is
        used only while the source keeps the same ``_recent`` (a fork or a pickle replaces it)
        and its store the same metadata object (``store.refresh()`` replaces it: the store may
        have grown, or another run may have been written in its place)."""
        recent = self.source._recent
        got = recent.get(hp)
        if got is None:
            self._window = None
            return
        lo, hi, view = got
        start = self._start
        lo, hi = max(lo, start), min(hi, self._stop)
        seen = self.source._seen  # the store's metadata object the source's caches are of
        self._window = None if hi <= lo else (lo - start, hi - start, view[lo - got[0] :], recent, hp, seen)

    def __getitem__(self, index: Any) -> dict[str, Any]:
        """``ds[i]``: one row (views of the store row); ``ds[slice | range | list | Tensor]``: :meth:`get_batch`.

        ``i`` is an int, a numpy integer, or a 0-d integer Tensor / ndarray (any device but
        ``meta``); a 0-d float or bool one raises ArgumentTypeError, a position outside
        ``[-len(ds), len(ds))`` RowIndexError. Other indexes raise as :meth:`get_batch` says.

        Parameters
        ----------
        index : int, slice, range, sequence of int, or Tensor / ndarray
            A position, or the positions of a batch.
        """
        if _is_int(index):
            i = int(index)
        elif isinstance(index, (torch.Tensor, np.ndarray)) and index.ndim == 0:
            i = _scalar_position(index, "ds[index]: index")
        else:
            return self.get_batch(index)
        self._check_run()
        n = len(self)
        if not n:
            raise RowIndexError(
                f"ds[{i}]: the dataset has no rows (rows=, sample_ids= or filter= selected none, or the store had "
                "no committed row when it was opened); check len(ds) before reading a row"
            )
        if not -n <= i < n:
            raise RowIndexError(
                f"ds[index]: index must be in [-{n}, {n}) for a dataset of {n} rows (negative positions "
                f"count from the end), got {i}"
            )
        i %= n
        row = self._start + i if self._ids is None else int(self._ids[i])
        data = _Item((hp, self.source.read(hp, row, row + 1)[0]) for hp in self.hook_points)
        for name, col in self._column_values().items():
            data[name] = col[row].clone() if isinstance(col, torch.Tensor) else col[row]  # (a copy: see get_batch)
        return data if get_worker_info() is None else _Item(_owned(data))  # (no view of the map: see get_batch)

    def _name_index_error(self, name: str) -> ArgumentTypeError:
        """The error for ``ds["name"]``: positions select rows; names select within an item."""
        known = self.hook_points + self.columns
        if name in known:
            fix = (
                f"; {name!r} is a key of each item and batch, so read ds[i][{name!r}] for one row or "
                f"ds[:][{name!r}] for all of them"
            )
        else:
            fix = f"; items and batches are dicts keyed by the hook points and columns {known}"
        return ArgumentTypeError(f"ds[index]: index must be {_ITEM_KINDS}, got the name {name!r}{fix}")

    def __repr__(self) -> str:
        return (
            f"ActivationDataset({self.source.describe()}, hook_points={self.hook_points}, "
            f"columns={self.columns}, rows={len(self)} {self.row_kind} rows)"
        )


def _reduce_for_processes(ds: ActivationDataset) -> tuple[Any, tuple[type], dict[str, Any]]:
    """How ``torch.multiprocessing`` sends a dataset to another process of this machine
    (``ForkingPickler``: the dataset of ``spawn`` and ``forkserver`` DataLoader workers, a
    ``Queue.put``): :meth:`ActivationDataset.__getstate__` plus the column values made when
    the dataset was, so that the other process does not read the row table and make them
    again (29-57 s and 3 GB per worker of a store of 50 million token rows). Their tensors go
    by torch's reductions: moved into shared memory once (in place, in this process), then
    mapped by every process they are sent to, never copied into each. The activations go as
    always: the other process maps the store's shards itself. A plain ``pickle`` (a file,
    ``copy.deepcopy``) leaves the columns out (:meth:`ActivationDataset.__getstate__`)."""
    state = ds.__getstate__()
    cols = ds._col_cache
    need = sum(t.untyped_storage().nbytes() for t in (cols or {}).values()
               if isinstance(t, torch.Tensor) and not t.is_shared())
    free = _shared_memory_free_bytes()
    if need and free is not None and need > free // 2:
        # (shared memory is a tmpfs of its own size, 64 MB in a default Docker container: filling
        # it kills the process with SIGBUS, not an error; half of it is left for the batches)
        if not getattr(ds, "_warned_shared_memory", False):
            ds._warned_shared_memory = True
            warnings.warn(
                f"ActivationDataset: the columns= tensors ({need:,} bytes) do not fit in half of the free shared "
                f"memory ({SHARED_MEMORY} has {free:,} bytes free), so each spawn or forkserver "
                "worker reads them from the row table again; give the container more shared memory (docker run "
                "--shm-size=...) or use fork workers (multiprocessing_context='fork'), which share them",
                RuntimeWarning, stacklevel=2)
        cols = None
    state["_col_cache"] = cols
    return copyreg.__newobj__, (type(ds),), state  # (restored as pickle restores the dataset's own state)


#: Where torch.multiprocessing puts the tensors it shares (shm_open) on Linux.
SHARED_MEMORY = "/dev/shm"


def _shared_memory_free_bytes() -> int | None:
    """Bytes free in :data:`SHARED_MEMORY`, or None where there is none to ask (not Linux)."""
    try:
        st = os.statvfs(SHARED_MEMORY)
    except (OSError, AttributeError):
        return None
    return st.f_bavail * st.f_frsize


ForkingPickler.register(ActivationDataset, _reduce_for_processes)


#: What identifies the sample of a token row in both row tables: ``sample_id`` repeats across
#: forwards (the same data captured twice) and across ranks (default ids count per rank)
_SAMPLE_KEY = ("rank", "batch", "sample_id")


def _ids_in(wanted: pa.Array, ids: pa.ChunkedArray) -> pa.BooleanArray:
    """Which of ``wanted`` occur in ``ids`` (bool, one per wanted id), as ``pc.is_in(wanted,
    value_set=ids)`` but with a hash set of the wanted ids and of those found: memory and time of
    the few wanted ids, not of every row of ``ids``."""
    found = ids.filter(pc.is_in(ids, value_set=wanted))
    return pc.is_in(wanted, value_set=pc.unique(found))


def _first_sample_rows(samples: pa.Table, tokens: pa.Table, keys: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """For the ``keys`` values of each row: the first sample row with those values.

    Returns ``(of_samples, of_tokens)``: int64 arrays, one entry per sample row and per token row
    (-1: a token row whose values no sample row has). Each key is coded by a hash lookup
    (``pc.index_in``), and the codes so far with it (linear in the rows)."""
    ns, nt = samples.num_rows, tokens.num_rows
    s_code = np.zeros(ns, dtype=np.int64)
    t_code = np.zeros(nt, dtype=np.int64)
    for key in keys:
        values = samples.column(key).combine_chunks()
        uniq = pc.unique(values)
        s = pc.index_in(values, value_set=uniq).to_numpy(zero_copy_only=False).astype(np.int64)
        t = pc.index_in(tokens.column(key), value_set=uniq)  # (null: no sample row has it)
        t = np.asarray(pc.fill_null(t, -1).to_numpy(zero_copy_only=False), dtype=np.int64)
        s_both = s_code * len(uniq) + s  # (< ns * ns: within int64)
        t_both = np.where((t < 0) | (t_code < 0), -1, t_code * len(uniq) + t)
        codes = pc.unique(pa.array(s_both))  # renumbered 0.. in order of first appearance
        s_code = pc.index_in(pa.array(s_both), value_set=codes).to_numpy(zero_copy_only=False).astype(np.int64)
        t_code = np.asarray(pc.fill_null(pc.index_in(pa.array(t_both), value_set=codes), -1)
                            .to_numpy(zero_copy_only=False), dtype=np.int64)
    first = np.zeros(int(s_code.max()) + 1 if ns else 0, dtype=np.int64)
    first[s_code[::-1]] = np.arange(ns - 1, -1, -1, dtype=np.int64)  # (the last write, the first row, wins)
    of_tokens = np.where(t_code >= 0, first[np.maximum(t_code, 0)] if ns else -1, -1)
    return first[s_code], of_tokens


def _with_sample_columns(tokens: pa.Table, source: StoreSource, wanted: Iterable[str] | None = None,
                         token_columns: Iterable[str] | None = None) -> pa.Table:
    """Token rows plus the per-sample columns (labels, text) of their sample, joined on
    ``(rank, batch, sample_id)`` (those of the three both tables have).

    ``wanted``: the per-sample columns the caller reads (None: any of them, as a filter may).
    A column whose values differ between two samples of one id in one forward (their token
    rows cannot be told apart) is left out of the table when it is not wanted.
    ``token_columns``: every column of the token table, when ``tokens`` holds some of them
    (and its keys): only the keys and the ``wanted`` columns the token table lacks are then
    read of the sample table (``wanted`` must be given).

    Raises ActivationScopeError when such a column is wanted, and what the source raises when
    the sample table cannot be read (StoreCorruptError of a damaged part): a store with no
    sample rows has an empty sample table (as ``Store.row_table`` gives it), never an error."""
    runs = _sample_runs(tokens, source, wanted, token_columns)
    return tokens if runs is None else _append_runs(tokens, *runs)


def _sample_runs(tokens: pa.Table, source: StoreSource, wanted: Iterable[str] | None = None,
                 token_columns: Iterable[str] | None = None, key_column: Callable[[str], Any] | None = None,
                 token_schema: pa.Schema | None = None) -> tuple[pa.Table, np.ndarray] | None:
    """The per-sample columns of the token rows ``tokens``, one row per *run* of token rows of
    one sample: ``(values, lengths)``, ``values`` the sample table's columns the token table
    lacks (null in a run of no sample row), taken at each run's sample, and ``lengths`` the
    token rows of each run, int64 ``(runs,)``, in order (their sum is ``tokens.num_rows``).
    None when there is no such column. :func:`_append_runs` repeats them onto the token rows;
    nothing of the size of the token rows is made here but a bool per row (the runs' starts).
    Arguments and errors as :func:`_with_sample_columns`, and ``key_column(name)``: the token
    table's column ``name``, for the keys ``tokens`` does not hold, read one at a time and let
    go of before the next (``token_schema``: the token table's, whose columns ``tokens`` then
    has some of)."""
    if token_columns is None:
        samples = source.row_table("sample")
    else:
        own = set(token_columns)
        samples = source.row_table("sample", [*_SAMPLE_KEY, *(c for c in wanted if c not in own)])
    schema = tokens.schema if token_schema is None else token_schema
    extra = [c for c in samples.column_names if c not in schema.names]
    if not extra or "sample_id" not in samples.column_names or "sample_id" not in schema.names:
        return None
    keys = [k for k in _SAMPLE_KEY if k in samples.column_names and k in schema.names]
    clashes = row_table_type_clashes(samples.schema, schema, keys)  # (one writer wrote both: damage)
    if clashes:
        raise StoreCorruptError(
            f"the row tables of {source.describe()} disagree: {clashes[0]}, so token rows cannot be paired with "
            "their samples; run store.verify() and restore the store from its source"
        )
    # token rows come in runs, one per sample (row-major mask): look up the first row of each run
    def column(key: str) -> Any:
        return tokens.column(key) if key_column is None or key in tokens.column_names else key_column(key)

    nt = tokens.num_rows
    head = np.zeros(nt, dtype=bool)  # the first token row of each run
    head[:1] = True
    changes = {}  # key -> (its value's runs' first rows, their values): small, where the column is not
    for key in keys:
        col = column(key)  # (chunk by chunk: never combined into one copy of the column)
        change = np.ones(nt, dtype=bool)
        if nt > 1:
            change[1:] = pc.fill_null(pc.not_equal(col.slice(1), col.slice(0, nt - 1)), True).to_numpy(
                zero_copy_only=False)
        head |= change
        changes[key] = (np.flatnonzero(change), col.filter(pa.array(change)))
        del col, change
    starts = np.flatnonzero(head)
    del head
    # each key's value at each run's first row: that of the last change of the key at or before it
    at_heads = pa.table({k: values.take(pa.array(np.searchsorted(first, starts, side="right") - 1))
                         for k, (first, values) in changes.items()})
    del changes
    firsts, of_runs = _first_sample_rows(samples, at_heads, keys)
    lengths = np.diff(np.append(starts, nt)) if nt else np.zeros(0, dtype=np.int64)
    del starts, at_heads
    dup_rows = np.flatnonzero(firsts != np.arange(samples.num_rows))
    if dup_rows.size:  # one id twice in a forward: fine while their columns agree
        ambiguous = []
        for name in extra:
            col = samples.column(name)
            got, want = col.take(pa.array(dup_rows)).to_pylist(), col.take(pa.array(firsts[dup_rows])).to_pylist()
            for row, a, b in zip(dup_rows.tolist(), got, want):
                if a != b and not (a != a and b != b) and wanted is not None and name not in wanted:
                    ambiguous.append(name)  # not read: left out rather than paired with one sample
                    break
                if a != b and not (a != a and b != b):  # (NaN == NaN here)
                    ident = ", ".join(f"{k} {samples.column(k)[row].as_py()!r}" for k in keys)
                    raise ArgumentValueError(
                        f"the sample row table of {source.describe()} holds two samples with {ident} (one forward "
                        f"gave one sample id twice) whose column {name!r} differs ({b!r}, {a!r}): their token "
                        f"rows cannot be paired with their sample's columns. Read the token rows without {name!r} in "
                        "columns= and in filter= (a callable filter sees every column; an expression those it names; "
                        "rows= and sample_ids= select without it), or capture with sample ids unique within each "
                        "forward (set_batch(sample_ids=...))"
                    )
        extra = [c for c in extra if c not in ambiguous]
    hit = of_runs >= 0  # (a token row of no sample gets nulls where no sample column is read)
    found = []
    if not hit.all() and (wanted is None or any(name in wanted for name in extra)):
        # a writer records each token row with its sample: a store whose row tables were edited or mixed
        found = token_rows_without_sample_lines(samples, pa.table({k: column(k) for k in keys}), keys, "")
    if found:
        raise StoreCorruptError(
            f"the row tables of {source.describe()} are damaged: {int(lengths[~hit].sum())} token rows have no sample "
            f"row to take the sample columns {extra} from ({'; '.join(f.rstrip('; ') for f in found)}); a null there "
            "is no missing value to filter out. Run `activationscope verify` on the store and restore it from its source"
        )
    where = pa.array(of_runs) if hit.all() else pa.array(np.where(hit, of_runs, 0), mask=~hit)
    return samples.select(extra).take(where), lengths


def _append_runs(tokens: pa.Table, values: pa.Table, lengths: np.ndarray) -> pa.Table:
    """``tokens`` with the columns of ``values`` appended, row ``r`` of ``values`` repeated
    ``lengths[r]`` times (see :func:`_sample_runs`). A numeric or bool column without nulls is
    repeated as one numpy array, which the Arrow column then holds (no index of the token rows
    made, nor a second copy); any other column is taken at the run of each token row."""
    index = None
    for field, col in zip(values.schema, values.columns):
        t = field.type
        if (pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)) and not col.null_count:
            flat = np.repeat(col.to_numpy(), lengths)
            repeated = pa.array(flat, type=t)  # (zero-copy of flat but for bools: a bitmap)
        else:
            if index is None:
                kind = np.int32 if len(lengths) < 2**31 else np.int64
                index = pa.array(np.repeat(np.arange(len(lengths), dtype=kind), lengths))
            repeated = col.take(index)
        tokens = tokens.append_column(field, repeated)
    return tokens


def _expression_mask(filter: pc.Expression, table: pa.Table) -> np.ndarray:
    """Where ``filter`` holds on the rows of ``table``: bool ``(rows,)`` (null: False, as
    ``Table.filter`` drops such rows), evaluated as one bool column, not by filtering a copy of
    the table. Raises what ``table.filter(filter)`` raises (pyarrow errors)."""
    import pyarrow.dataset as pds

    if table.num_columns == 0:  # (a dataset of no column: its rows counted by the slow way)
        indexed = table.append_column(_ROW_ID, pa.array(np.arange(table.num_rows, dtype=np.int64)))
        mask = np.zeros(table.num_rows, dtype=bool)
        mask[indexed.filter(filter).column(_ROW_ID).to_numpy()] = True
        return mask
    got = pds.dataset(table).to_table(columns={_ROW_ID: filter}, use_threads=False).column(_ROW_ID)
    if not pa.types.is_boolean(got.type):
        table.filter(filter)  # (raises: "Filter expression must evaluate to bool")
        raise pa.ArrowTypeError(f"Filter expression must evaluate to bool, but {filter} evaluates to {got.type}")
    if got.num_chunks == 0:
        return np.zeros(table.num_rows, dtype=bool)
    return np.asarray(pc.fill_null(got, False).to_numpy(zero_copy_only=False), dtype=bool)


def _as_bool_mask(result: Any, n: int, kind: str) -> np.ndarray:
    if isinstance(result, (pa.ChunkedArray, pa.Array)):
        if result.null_count:
            result = pc.fill_null(result, False)
        arr = result.to_numpy(zero_copy_only=False)
    elif isinstance(result, torch.Tensor):
        arr = result.detach().cpu().numpy()
    else:
        arr = np.asarray(result)
        if arr.shape == (0,) and isinstance(result, (list, tuple)):  # (numpy makes float64 of [])
            arr = arr.astype(bool)
    if arr.dtype != bool or arr.shape != (n,):
        raise ArgumentValueError(
            f"a filter callable must return a bool mask of shape ({n},) over the {kind} row table, "
            f"got dtype {arr.dtype} shape {arr.shape}"
        )
    return arr


def _numeric(t: pa.DataType) -> bool:
    """Whether a row-table column of Arrow type ``t`` comes back as a tensor."""
    return pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)


def _column_to_torch(col: pa.Array, name: str) -> Any:
    t = col.type
    if _numeric(t):
        if col.null_count:
            raise ArgumentValueError(f"row-table column {name!r} has {col.null_count} nulls; filter them out first")
        # the column's own dtype (uint16 / uint32 included: torch has them, and a column's
        # tensor is only sliced and indexed, which they support). The tensor holds the Arrow
        # column's memory (no second copy of a column of every store row: 160 MB of 20 million
        # int64 labels made 320 MB at once): the dataset never writes into it, and hands out copies
        if not pa.types.is_boolean(t):  # (bools are bits in Arrow: a copy, bytes)
            try:
                return torch.from_dlpack(col)
            except (TypeError, ValueError, BufferError, pa.ArrowException):
                pass
        return torch.from_numpy(np.array(col.to_numpy(zero_copy_only=False), copy=True))
    if pa.types.is_nested(t):
        return _NestedColumn(col)
    return col.to_pylist()


class _NestedColumn:
    """A list / struct / map column of a dataset: every read makes new Python lists and dicts
    from the Arrow values, so that a batch's ``batch["tags"][0].append(x)`` never reaches
    later reads (a cached list of lists would hand out the same inner lists every time)."""

    __slots__ = ("values",)

    def __init__(self, values: pa.Array) -> None:
        self.values = values

    def __len__(self) -> int:
        return len(self.values)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            a, b, step = i.indices(len(self.values))
            return self.values.slice(a, max(0, b - a)).to_pylist() if step == 1 else self.values.to_pylist()[i]
        return self.values[i].as_py()

    def take(self, positions: list[int]) -> list:
        return self.values.take(pa.array(positions, pa.int64())).to_pylist()


def _pick(col: Any, positions: list[int]) -> list:
    """The values of a non-tensor column at ``positions``, as a new list."""
    return col.take(positions) if type(col) is _NestedColumn else [col[i] for i in positions]
