"""Row access on top of the store's public read API (private).

:class:`StoreSource` is what datasets, samplers and exporters hold instead of a store. It
knows how to reopen the store (a path, URL or picklable store object), drops its handles in
forked children (``os.register_at_fork``, as fsspec does), and turns row requests into as
few reads as possible:

- ``read(hp, start, stop)``: a contiguous run of rows. A view of the store's memory-mapped
  data when the run lies within one *segment* (the store's unit of contiguous, zero-copy
  memory: a shard file); one copy (``torch.cat``) across segments.
- ``take(hp, index)``: rows at arbitrary positions: one ``torch.index_select`` per segment
  touched, written into one output tensor.

Segments come from the store: ``store.segments(hp)`` (row boundaries) if it has one, else
the whole array is one segment read with ``store[hp]``.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Mapping
from typing import Any

import torch

from ..errors import ActivationScopeError

__all__ = ["StoreSource", "as_source", "ChunkCache"]

#: Default budget of decoded chunks kept per process for compressed stores.
DEFAULT_CACHE_BYTES = 256 << 20

_LIVE: "weakref.WeakSet[StoreSource]" = weakref.WeakSet()


def _after_fork_in_child() -> None:
    # A forked DataLoader worker must not use the parent's store objects: zarr-python's event
    # loop thread and fsspec's handles do not survive fork. Drop them; reopen lazily.
    for src in list(_LIVE):
        src._drop_handles()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class ChunkCache:
    """A least-recently-used cache of decoded chunks, bounded in bytes.

    Parameters
    ----------
    max_bytes : int
        Budget for decoded chunks (bytes); the most recently used chunk is always kept, even
        when it alone is larger.
    """

    def __init__(self, max_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        from collections import OrderedDict

        if not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(f"cache_bytes must be a non-negative int, got {max_bytes!r}")
        self.max_bytes = max_bytes
        self.n_bytes = 0
        self.n_decoded = 0
        self._items: "OrderedDict[Any, torch.Tensor]" = OrderedDict()

    def get(self, key: Any, decode: Any) -> torch.Tensor:
        hit = self._items.get(key)
        if hit is not None:
            self._items.move_to_end(key)
            return hit
        value = decode()
        self.n_decoded += 1
        self._items[key] = value
        self.n_bytes += value.numel() * value.element_size()
        while self.n_bytes > self.max_bytes and len(self._items) > 1:
            _, old = self._items.popitem(last=False)
            self.n_bytes -= old.numel() * old.element_size()
        return value


class _DecodedSegments(list):
    """Lazily decoded chunks of a compressed array, as the per-segment list of ``_segments``."""

    def __init__(self, hp: str, array: Any, dtype: torch.dtype, bounds: list[int], cache: ChunkCache) -> None:
        super().__init__(range(len(bounds) - 1))
        self.hp, self.array, self.dtype, self.bounds, self.cache = hp, array, dtype, bounds, cache

    def __getitem__(self, k: Any) -> torch.Tensor:  # type: ignore[override]
        if isinstance(k, slice):
            return [self[i] for i in range(len(self))[k]]
        if k < 0:
            k += len(self)
        a, b = self.bounds[k], self.bounds[k + 1]
        return self.cache.get((id(self.array), self.hp, k), lambda: _decode(self.array, a, b, self.dtype))

    def __iter__(self):
        return (self[k] for k in range(len(self)))


def _decode(array: Any, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
    import numpy as np

    arr = np.ascontiguousarray(array[start:stop])
    t = torch.from_numpy(arr)
    if dtype == torch.bfloat16:
        t = t.view(torch.int16).view(torch.bfloat16) if t.dtype != torch.bfloat16 else t
    return t


def _open_store(spec: Any, options: Mapping[str, Any]) -> Any:
    options = dict(options)
    options.pop("cache_bytes", None)
    opener = options.pop("opener", None)
    if opener is None:
        from ..store import open_store as opener
    return opener(spec, **options)


class StoreSource:
    """A reopenable handle on a store, with cached per-hook-point segment views.

    Parameters
    ----------
    spec : str, os.PathLike or store object
        What to open. A store object is used as is in this process; when pickled, a store
        object that has a ``path`` / ``url`` attribute travels as that, else the store object
        itself is pickled.
    open_options : dict, optional
        Keyword arguments of ``open_store``; ``opener=`` a picklable callable
        ``opener(spec, **options) -> store`` replaces ``activationscope.open_store`` (other
        store backends).
    """

    def __init__(self, spec: Any, open_options: Mapping[str, Any] | None = None) -> None:
        self._options = dict(open_options or {})
        self._lock = threading.Lock()
        if isinstance(spec, (str, os.PathLike)):
            self._spec = os.fspath(spec)
            self._store = None
        else:
            self._spec = spec
            self._store = spec if hasattr(spec, "hook_points") else None
        self._pid = os.getpid()
        self._views: dict[str, tuple[torch.Tensor, list[torch.Tensor]]] = {}
        self._tables: dict[str, Any] = {}
        self._cache: ChunkCache | None = None
        _LIVE.add(self)

    # ------------------------------------------------------------------ lifecycle
    def _drop_handles(self) -> None:
        self._lock = threading.Lock()
        self._views = {}
        self._tables = {}
        self._cache = None
        if isinstance(self._reopen_spec(), str):
            self._store = None  # reopened lazily from its path or URL
        self._pid = os.getpid()

    def _reopen_spec(self) -> Any:
        if isinstance(self._spec, str):
            return self._spec
        for attr in ("url", "path"):
            value = getattr(self._spec, attr, None)
            if isinstance(value, (str, os.PathLike)):
                return os.fspath(value)
        return self._spec

    @property
    def store(self) -> Any:
        """The open store (opened on first use in this process)."""
        if self._pid != os.getpid():  # forked without our hook (should not happen)
            self._drop_handles()
        if self._store is None:
            with self._lock:
                if self._store is None:
                    spec = self._reopen_spec()
                    self._store = spec if hasattr(spec, "hook_points") else _open_store(spec, self._options)
        return self._store

    def __getstate__(self) -> dict[str, Any]:
        return {"spec": self._reopen_spec(), "options": self._options}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["spec"], state["options"])

    def describe(self) -> str:
        spec = self._reopen_spec()
        return repr(spec) if isinstance(spec, str) else type(spec).__name__

    # ------------------------------------------------------------------ metadata
    @property
    def hook_points(self) -> list[str]:
        return list(self.store.hook_points)

    def n_rows(self, hp: str) -> int:
        return int(self.store.n_rows(hp))

    def row_kind(self, hp: str) -> str:
        return str(self.store.row_kind(hp))

    def row_table(self, kind: str) -> Any:
        """The row table of ``kind`` as a ``pyarrow.Table`` (cached)."""
        table = self._tables.get(kind)
        if table is None:
            table = self.store.row_table(kind)
            self._tables[kind] = table
        return table

    def dtype(self, hp: str) -> torch.dtype:
        return self._segments(hp)[1][0].dtype if self._segments(hp)[1] else self.store[hp].dtype

    def feature_shape(self, hp: str) -> tuple[int, ...]:
        segs = self._segments(hp)[1]
        return tuple(segs[0].shape[1:]) if segs else tuple(self.store[hp].shape[1:])

    # ------------------------------------------------------------------ segments
    def _segments(self, hp: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """(bounds (n_segments + 1,) int64, [view per segment]) of ``hp``; cached."""
        cached = self._views.get(hp)
        if cached is not None:
            return cached
        store = self.store
        decoded = self._compressed(store, hp)
        if decoded is not None:
            cached = (torch.tensor(decoded.bounds, dtype=torch.int64), decoded)
            self._views[hp] = cached
            return cached
        bounds = None
        seg_fn = getattr(store, "segments", None)
        if callable(seg_fn):
            bounds = [int(b) for b in seg_fn(hp)]
        if bounds is None or len(bounds) <= 2:
            full = store[hp]
            views = [full]
            bounds = [0, int(full.shape[0])]
        else:
            rows = getattr(store, "rows")
            views = [rows(hp, a, b) for a, b in zip(bounds[:-1], bounds[1:])]
        cached = (torch.tensor(bounds, dtype=torch.int64), views)
        self._views[hp] = cached
        return cached

    def _compressed(self, store: Any, hp: str) -> "_DecodedSegments | None":
        """Chunk-wise decoding through zarr-python for compressed arrays (else None)."""
        info = getattr(store, "compressed_array", None)
        if not callable(info):
            return None
        found = info(hp)  # (zarr array, chunk_rows, torch dtype) or None when uncompressed
        if found is None:
            return None
        array, chunk_rows, dtype = found
        n = int(array.shape[0])
        bounds = list(range(0, n, chunk_rows)) + [n]
        return _DecodedSegments(hp, array, dtype, bounds, self.cache)

    @property
    def cache(self) -> ChunkCache:
        if self._cache is None:
            self._cache = ChunkCache(int(self._options.get("cache_bytes", DEFAULT_CACHE_BYTES)))
        return self._cache

    def boundaries(self, hp: str) -> torch.Tensor:
        """Row boundaries of the segments of ``hp``: int64 ``(n_segments + 1,)``, from 0 to n_rows."""
        return self._segments(hp)[0]

    def read(self, hp: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``[start, stop)`` of ``hp``: a view within one segment, else one copy."""
        bounds, views = self._segments(hp)
        n = int(bounds[-1])
        if not (0 <= start <= stop <= n):
            raise IndexError(f"rows [{start}, {stop}) out of range for hook point {hp!r} with {n} rows")
        if len(views) == 1:
            return views[0][start:stop]
        s0 = int(torch.searchsorted(bounds, start, right=True)) - 1
        s1 = int(torch.searchsorted(bounds, max(stop - 1, start), right=True)) - 1
        s0 = min(s0, len(views) - 1)
        s1 = min(max(s1, s0), len(views) - 1)
        if s0 == s1:
            b = int(bounds[s0])
            return views[s0][start - b : stop - b]
        parts = []
        for s in range(s0, s1 + 1):
            b, e = int(bounds[s]), int(bounds[s + 1])
            parts.append(views[s][max(start, b) - b : min(stop, e) - b])
        return torch.cat(parts)

    def take(self, hp: str, index: torch.Tensor) -> torch.Tensor:
        """Rows at ``index`` (int64, (k,)) of ``hp``: a new tensor (one gather per segment)."""
        bounds, views = self._segments(hp)
        if len(views) == 1:
            return torch.index_select(views[0], 0, index)
        seg = torch.searchsorted(bounds, index, right=True) - 1
        first = views[0]
        out = torch.empty((index.numel(), *first.shape[1:]), dtype=first.dtype)
        for s in torch.unique(seg).tolist():
            pos = (seg == s).nonzero().squeeze(1)
            out[pos] = torch.index_select(views[s], 0, index[pos] - bounds[s])
        return out


def as_source(store_or_path: Any, open_options: Mapping[str, Any] | None = None) -> StoreSource:
    """A :class:`StoreSource` for a path, URL, store object or another source."""
    if isinstance(store_or_path, StoreSource):
        return store_or_path
    src = getattr(store_or_path, "source", None)
    if isinstance(src, StoreSource):  # an ActivationDataset
        return src
    if store_or_path is None:
        raise ActivationScopeError("a store (path, URL or store object) is required, got None")
    return StoreSource(store_or_path, open_options)
