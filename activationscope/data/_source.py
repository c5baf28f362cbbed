"""Row access on top of the store's public read API (private).

:class:`StoreSource` is what datasets, samplers and exporters hold instead of a store. It
knows how to reopen the store (a path, URL or picklable store object), drops its handles in
forked children (``os.register_at_fork``, as fsspec does), and turns row requests into as
few reads as possible:

- ``read(hp, start, stop)``: a contiguous run of rows. A view of the store's memory-mapped
  data when the run lies within one *segment* (a shard file of a local uncompressed store);
  one copy across segments. Compressed and remote arrays are read through the store, which
  decodes chunk by chunk through zarr-python with its bounded chunk cache.
- ``take(hp, index)``: rows at arbitrary positions: one ``torch.index_select`` per segment
  touched, written into one output tensor; of decoded chunks, the store's ``take`` (each row
  copied once out of the store's cached decoded chunks, no chunk copied whole).

What a source needs from a store is the :class:`RowSource` protocol: the store decides its
segments (``row_blocks``: mapped shards, kept as views, or chunks decoded per read), this
module only routes row requests to them. :class:`activationscope.store.Store` implements
it, and so do the test fakes (``tests/data/fake_store.py``).
"""

from __future__ import annotations

import bisect
import inspect
import os
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import torch

from ..errors import ArgumentTypeError, ArgumentValueError, RowIndexError, StoreError
from ..store._format import run_of

__all__ = ["RowSource", "StoreSource", "as_source"]


@runtime_checkable
class RowSource(Protocol):
    """The read contract of a store, as the data layer uses it.

    Rows of a hook point are a ``(n_rows, *feature_shape)`` tensor of ``dtype``; the row
    table of ``kind`` (``"sample"`` / ``"token"``) describes them when
    ``follows_row_table(hook_point)``.

    Optional: an ``attrs`` attribute, the store's metadata object, replaced by a new object
    whenever the rows may have changed (``Store.refresh()``): a source forgets the row
    layouts and segments it cached when it is no longer the object they were cached under.
    A store without it is taken as never changing. And an ``on_unmap(callback)`` method
    (``Store.on_unmap``): the store calls ``callback()`` when it drops mappings from its
    cache, and the source then drops the segment views it keeps, which would hold those
    mappings alive (the process has a limited number of them). And a ``take(hook_point,
    rows)`` method (``Store.take``): the rows at store positions ``rows`` (int64 (k,)) of a
    hook point whose row blocks are not views, a new tensor; a store without it has each
    block a batch touches read whole (``rows``) and the batch's rows picked from it.
    """

    @property
    def hook_points(self) -> list[str]: ...

    def n_rows(self, hook_point: str) -> int: ...

    def row_kind(self, hook_point: str) -> str: ...

    def dtype(self, hook_point: str) -> torch.dtype: ...

    def feature_shape(self, hook_point: str) -> tuple[int, ...]: ...

    def follows_row_table(self, hook_point: str) -> bool: ...

    def row_table(self, kind: str) -> Any:
        """The row table of ``kind`` as a ``pyarrow.Table`` (optionally with a ``columns``
        keyword: only those columns, as ``Store.row_table`` reads them). A store with no rows
        of ``kind`` gives an empty table (as ``Store.row_table`` does): what it raises is
        damage or a failed read, never taken as a store without that table."""

    def row_blocks(self, hook_point: str) -> tuple[list[int], bool]:
        """``(bounds [0, ..., n_rows], views)``: the units to read in; ``views`` True when
        ``rows`` within one unit is a view a reader may keep, False when each read decodes."""

    def rows(self, hook_point: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``[start, stop)``; raises IndexError outside ``[0, n_rows]``."""

    def will_read(self, hook_point: str, start: int, stop: int) -> tuple[int, int] | None:
        """Hint that rows ``[start, stop)`` are read next (may do nothing). May return
        ``(lo, hi)``: hints for rows within ``[lo, hi)`` would do nothing until the next
        hint outside it (the reader then skips them)."""


def _row_table_parameters(store: Any) -> Any:
    """The parameters of ``store.row_table`` (``columns`` where it projects, and ``_schemas``,
    the full schema, as :class:`activationscope.store.Store` takes them); none where they
    cannot be read."""
    try:
        return inspect.signature(store.row_table).parameters
    except (TypeError, ValueError):
        return {}


_LIVE: "weakref.WeakSet[StoreSource]" = weakref.WeakSet()
#: In a forked child, the parent's store objects its sources dropped (see ``_drop_handles``).
_PARENTS_STORES: list = []


def _after_fork_in_child() -> None:
    # A forked DataLoader worker must not use the parent's store objects: zarr-python's event
    # loop thread and fsspec's handles do not survive fork. Drop them; reopen lazily.
    for src in list(_LIVE):
        src._drop_handles()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _check_open_options(open_options: Any) -> dict[str, Any]:
    """``open_options=`` as a dict of keyword arguments of ``open_store`` (or of its ``opener``).

    Raises
    ------
    ArgumentTypeError
        Not a mapping, or a key that ``open_store`` does not take (named, with the ones it
        takes), before anything is opened: not the bare ``TypeError`` of the call.
    """
    if open_options is None:
        return {}
    if not isinstance(open_options, Mapping):
        raise ArgumentTypeError(
            f"open_options must be a dict of keyword arguments of open_store (verify=, cache_bytes=, "
            f"storage_options=), got {open_options!r}"
        )
    options = dict(open_options)
    if "opener" not in options:
        from ..store import open_store

        known = [n for n, p in inspect.signature(open_store).parameters.items() if p.kind is p.KEYWORD_ONLY]
        unknown = [k for k in options if k not in known]
        if unknown:
            raise ArgumentTypeError(
                f"open_options has keys {unknown} that open_store does not take; it takes {known} "
                "(and opener=, a callable opener(spec, **options) that opens another kind of store)"
            )
    return options


def _absolute(spec: str) -> str:
    """A local store path (a str without ``://``, or a ``file://`` URL) made absolute, a
    leading ``~`` expanded: it names the same store in every process and after ``os.chdir``
    (a DataLoader worker reopens it; a relative path would name another folder, or a
    store of another run, there). Other URLs are returned as they are."""
    from ..store._backend import expand_local

    if spec.startswith("file://"):
        return "file://" + os.path.abspath(expand_local(spec)[len("file://"):])
    if "://" in spec:
        return spec
    return os.path.abspath(expand_local(spec))


def _open_store(spec: Any, options: Mapping[str, Any]) -> Any:
    options = dict(options)
    opener = options.pop("opener", None)
    if opener is None:
        from ..store import open_store as opener
    return opener(spec, **options)


_CONTRACT = [n for n in RowSource.__dict__ if not n.startswith("_")]


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
        self._options = _check_open_options(open_options)
        # the store's cache of decoded chunks was sized by the caller (cache_bytes=, a store
        # opened by them, or their opener=, which may take no cache_bytes=): fit_decoded_cache
        # never changes it then
        self._cache_given = ("cache_bytes" in self._options or "opener" in self._options
                             or not isinstance(spec, (str, os.PathLike)))
        self._lock = threading.Lock()
        self._given: str | None = None  # a path or URL as given (for messages)
        if isinstance(spec, (str, os.PathLike)):
            self._given = os.fsdecode(os.fspath(spec))
            # (reopened in a DataLoader worker, maybe after os.chdir; a custom opener's str is its own)
            self._spec = self._given if "opener" in self._options else _absolute(self._given)
            self._store = None
        else:
            self._spec = spec
            self._store = spec if isinstance(spec, RowSource) else None
            self._watch_unmaps(self._store)
            opened_with = getattr(spec, "open_options", None)  # (a Store: verify=, cache_bytes=, ...)
            if callable(opened_with) and "opener" not in self._options:  # reopened elsewhere (a DataLoader
                # worker) by open_store as it was opened here
                was = opened_with()
                self._options = {**was, **self._options}
                if self._options != was:
                    # other options than the open store's (verify=True on a store opened without):
                    # reopened with them here too, so that every process reads alike
                    if not isinstance(self._reopen_spec(), str):
                        raise ArgumentValueError(
                            f"open_options {dict(open_options or {})} differ from those the store was opened with "
                            f"({was}), and {self.describe()} has no path or URL to reopen it with them; open it "
                            "with those options (open_store(..., **open_options)) instead"
                        )
                    self._store = None
        self._pid = os.getpid()
        self._pickled_in: int | None = None  # pid of the process this source was pickled in (None: made here)
        self._views: dict[str, tuple[torch.Tensor, dict[int, torch.Tensor], bool, list[int]]] = {}
        self._hinted: dict[str, tuple[int, int]] = {}  # hook point -> rows a read-ahead hint already covers
        # hook point -> (lo, hi, view of rows [lo, hi)): the mapped segment that served the last
        # read, where that range is also inside the read-ahead hint (a sequential epoch's batches
        # hit it: one comparison and one slice per batch)
        self._recent: dict[str, tuple[int, int, torch.Tensor]] = {}
        self._tables: dict[str, Any] = {}
        self._schemas: dict[str, Any] = {}  # kind -> the full schema of its row table (see row_schema)
        self._seg_lists: dict[str, list[Any]] = {}  # hook point -> mapped segments (None: not yet), for gather
        self._hints: dict[str, torch.Tensor] = {}  # hook point -> the gather's hint (see _hint)
        # the store's metadata object (``store.attrs``) the caches above were filled under:
        # ``Store.refresh()`` replaces it, and the layouts it cached may then be stale
        self._seen: Any = None
        self._run: tuple | None = None  # run_of(self._seen)
        _LIVE.add(self)

    # ------------------------------------------------------------------ lifecycle
    def _drop_handles(self) -> None:
        self._lock = threading.Lock()
        self._forget_layouts()
        if isinstance(self._reopen_spec(), str):
            # reopened lazily from its path or URL; the parent's store object is kept, never
            # finalised here: its file system's client sessions belong to the parent's event
            # loop, and closing them in the child prints "Unclosed client session" (aiohttp)
            _PARENTS_STORES.append(self._store)
            self._store = None
        self._pid = os.getpid()

    def _forget_layouts(self) -> None:
        """Drop every cached layout, segment view, read-ahead hint and row table. Each cache
        is replaced by a new dict, never cleared in place: a reader holding the old one keeps
        rows of one layout, and a dataset's sequential window (tied to ``_recent`` by
        identity) is not used again. A reader takes each dict it fills *before* it asks the
        store (and caches into that one): what it read from the commit before another
        thread's ``refresh()`` then goes into the old dicts, never into these."""
        self._views = {}
        self._hinted = {}
        self._recent = {}
        self._tables = {}
        self._schemas = {}
        self._seg_lists = {}
        self._hints = {}
        self._seen = None

    def _watch_unmaps(self, store: Any) -> None:
        """Have ``store`` (if it says so: ``on_unmap``) call :meth:`_drop_views` when it drops
        mappings from its cache."""
        on_unmap = getattr(store, "on_unmap", None)
        if callable(on_unmap):
            on_unmap(self._drop_views)

    def _drop_views(self) -> None:
        """Drop the segment views kept (the memo of each layout, the gather's segment lists,
        the last read's window): the store dropped mappings from its cache, and a view kept
        here would hold its mapping alive past the store's budget of the process's mappings.
        Each dict is replaced, never cleared in place (see :meth:`_forget_layouts`): a reader
        filling the old one meanwhile fills a dict no longer used; a dataset's gather plan and
        sequential window (tied to ``_seg_lists`` and ``_recent`` by identity) are made again."""
        self._views = {}
        self._recent = {}
        self._seg_lists = {}

    def _sync(self, store: Any) -> None:
        """Forget the cached layouts when ``store`` was refreshed since they were cached
        (``Store.refresh()`` replaces ``store.attrs``): another writer may have committed rows
        since, which the old row boundaries and the memo of the last segment do not hold, or
        another run may have been written in its place."""
        seen = getattr(store, "attrs", None)
        if seen is not self._seen:
            self._forget_layouts()
            # the run first: a reader in another thread that finds ``_seen`` current (and so
            # does not sync itself) then checks its dataset against the run it holds
            self._run = run_of(seen)
            self._seen = seen

    def run(self) -> tuple | None:
        """``(run_id, created)`` of the run the store holds now (as of its last refresh), or
        None for a store without them. Another run written in the store's place (an overwrite)
        changes it; a resume that grows the store does not."""
        self.store  # opens it, and syncs after a refresh
        return self._run

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
                    try:
                        self._store = spec if isinstance(spec, RowSource) else _open_store(spec, self._options)
                    except StoreError as e:
                        self._raise_if_memory_elsewhere(spec, e)
                        raise
                    self._watch_unmaps(self._store)
                    if not isinstance(self._store, RowSource):
                        missing = [m for m in _CONTRACT if not hasattr(self._store, m)]
                        raise ArgumentTypeError(
                            f"{type(self._store).__name__} from {self.describe()} is not a store the data layer can "
                            f"read: it lacks {missing} of the RowSource protocol (activationscope.data._source)"
                        )
        store = self._store
        if getattr(store, "attrs", None) is not self._seen:
            self._sync(store)
        return store

    def _check_refreshed(self) -> None:
        """:meth:`_sync` with the open store, if any (nothing is cached before it opens)."""
        store = self._store
        if store is not None and getattr(store, "attrs", None) is not self._seen:
            self._sync(store)

    def _raise_if_memory_elsewhere(self, spec: Any, error: BaseException) -> None:
        """A ``memory://`` store lives in the memory of the process that made it: in a process
        this source was pickled to (a ``spawn`` DataLoader worker) it is not there."""
        made_in = self._pickled_in
        if not (isinstance(spec, str) and spec.startswith("memory:")) or made_in in (None, os.getpid()):
            return
        raise StoreError(
            f"no store at {spec!r} in this process (pid {os.getpid()}): a memory:// store exists only inside the "
            f"process that made it (pid {made_in}), and this dataset was pickled to another one (a DataLoader worker "
            "started with 'spawn' or 'forkserver'); use DataLoader(..., multiprocessing_context='fork'), "
            "num_workers=0, or capture into a local path instead of memory://"
        ) from error

    def __getstate__(self) -> dict[str, Any]:
        return {"spec": self._reopen_spec(), "options": self._options, "pid": os.getpid()}

    def fit_decoded_cache(self, hook_points: Sequence[str], window_rows: Callable[[int], int],
                          most: int) -> tuple[int, int, list[str], bool] | None:
        """Make the store's cache of decoded chunks hold the chunks one shuffle window reads of
        each of ``hook_points`` read by decoding (compressed, or of a remote store; an alias
        counted once with its array): ``window_rows(chunk_rows)`` rows of each such array (its
        whole chunks a window touches at most, for its size of chunk: hook points of other
        widths have chunks of other sizes), plus two chunks, each array's at most its whole
        decoded size (:meth:`~activationscope.data.ActivationDataset.fit_cache_to_window`).

        The cache is raised to that (here, and in the processes this source is pickled to:
        DataLoader workers) when its size was not given by the caller (``cache_bytes=`` in
        ``open_options``, a store object opened by them, or an ``opener=``: a worker reopens
        the store with ``opener(spec, **options)``, which may not take ``cache_bytes=``) and it
        is at most ``most`` bytes.
        Returns None when the cache holds it (now), else ``(bytes needed, cache_bytes,
        hook points read by decoding, whether the size was given)``. Only for an
        :class:`~activationscope.store.Store` (not a rank view of an uncommitted multi-rank
        store, whose rank stores cache their own chunks); None for other row sources."""
        from ..store import _validate as V
        from ..store.reader import Store

        store = self.store
        if not isinstance(store, Store) or getattr(store, "_parts", None):
            return None
        need, decoded, arrays = 0, [], set()
        for hp in dict.fromkeys(hook_points):
            meta = store._checked_meta(hp)
            if store._mappable(meta) or meta["path"] in arrays:
                continue
            arrays.add(meta["path"])
            decoded.append(hp)
            chunk_rows, n = max(1, int(meta["chunk_rows"])), int(meta["n_rows"])
            whole = -(-n // chunk_rows) * chunk_rows  # (its decoded chunks, the last one whole)
            need += min(max(0, int(window_rows(chunk_rows))) + 2 * chunk_rows, whole) * V.row_bytes(meta)
        have = int(store._cache_bytes)
        if not decoded or need <= have:
            return None
        given = self._cache_given
        if given or need > most:
            return need, have, decoded, given
        with self._lock:  # (no reader takes the options meanwhile: a worker pickled now gets these)
            self._options = {**self._options, "cache_bytes": need}
        store._raise_cache_bytes(need)
        return None

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["spec"], state["options"])
        self._pickled_in = state.get("pid")

    def describe(self) -> str:
        spec = self._given if self._given is not None else self._reopen_spec()
        return repr(spec) if isinstance(spec, str) else type(spec).__name__

    # ------------------------------------------------------------------ metadata
    @property
    def hook_points(self) -> list[str]:
        return list(self.store.hook_points)

    def n_rows(self, hp: str) -> int:
        return int(self.store.n_rows(hp))

    def row_kind(self, hp: str) -> str:
        return str(self.store.row_kind(hp))

    def row_table(self, kind: str, columns: list[str] | None = None) -> Any:
        """The row table of ``kind`` as a ``pyarrow.Table``.

        ``columns``: read only these (Parquet column projection, the table's checks as
        ``Store.row_table(kind, columns)`` makes them), in this order; a name the table has no
        column of is left out. Such a read is not cached: a dataset that needs one column of
        a token table of 10**9 rows holds that column, not every column (a store whose
        ``row_table`` takes no ``columns`` is read whole, as for None). Default (None): every
        column, cached until the store is refreshed.
        """
        store = self.store
        tables = self._tables  # (taken before the store is read: see _forget_layouts)
        schemas = self._schemas
        table = tables.get(kind)
        if columns is None:
            if table is None:
                table = store.row_table(kind)
                tables[kind] = table
                schemas[kind] = table.schema
            return table
        names = list(dict.fromkeys(columns))
        if table is None:
            params = _row_table_parameters(store)
            if "columns" not in params:  # (read whole either way: once, and cached)
                table = self.row_table(kind)
            elif "_schemas" not in params:
                table = store.row_table(kind, columns=names)
            else:
                found: list = []
                table = store.row_table(kind, columns=names, _schemas=found)
                if found:
                    schemas[kind] = found[0]
        return table.select([c for c in names if c in table.column_names])

    def row_schema(self, kind: str) -> Any:
        """The ``pyarrow.Schema`` of every column of the row table of ``kind`` (read from the
        Parquet footers of its parts with the columns a check needs, no other decoded; cached
        until the store is refreshed)."""
        schemas = self._schemas
        schema = schemas.get(kind)
        if schema is None:
            self.row_table(kind, [])
            schema = schemas.get(kind)
        if schema is None:  # (a store that reads whole tables only)
            schema = self.row_table(kind).schema
        return schema

    def dtype(self, hp: str) -> torch.dtype:
        return self.store.dtype(hp)

    def feature_shape(self, hp: str) -> tuple[int, ...]:
        return tuple(self.store.feature_shape(hp))

    def follows_row_table(self, hp: str) -> bool:
        """Whether row i of ``hp`` is row i of its row table."""
        return bool(self.store.follows_row_table(hp))

    # ------------------------------------------------------------------ segments
    def _layout(self, hp: str) -> tuple[torch.Tensor, dict[int, torch.Tensor], bool, list[int]]:
        """(bounds (n_segments + 1,) int64, memo of segment tensors, memoize?, bounds as a
        list of int) of ``hp``; cached.

        The store's ``row_blocks``: its shards for local uncompressed arrays (each read is a
        view of one mapped shard file, kept), its chunks for compressed or remote arrays (each
        read goes through the store's bounded chunk cache, so segments are not kept here).
        Dropped when the store is refreshed (:meth:`_sync`).
        """
        store = self.store  # opened (lazily), and the cached layouts forgotten after a refresh
        views = self._views  # (taken before the store is read: see _forget_layouts)
        cached = views.get(hp)
        if cached is not None:
            return cached
        bounds, memoize = store.row_blocks(hp)
        bounds = [int(b) for b in bounds]
        if not bounds or bounds[0] != 0:
            bounds = [0, *bounds]
        cached = (torch.tensor(bounds, dtype=torch.int64), {}, bool(memoize), bounds)
        views[hp] = cached
        return cached

    def _rows(self, hp: str, start: int, stop: int) -> torch.Tensor:
        return self.store.rows(hp, start, stop)

    def _segment(self, hp: str, k: int, layout: tuple | None = None) -> torch.Tensor:
        """Segment ``k`` of ``layout`` (the caller's, whose bounds it indexes with; default:
        the current one)."""
        _bounds, memo, memoize, bl = self._layout(hp) if layout is None else layout
        seg = memo.get(k)
        if seg is None:
            seg = self._rows(hp, bl[k], bl[k + 1])
            if memoize:
                memo[k] = seg
        return seg

    def boundaries(self, hp: str) -> torch.Tensor:
        """Row boundaries of the segments of ``hp``: int64 ``(n_segments + 1,)``, from 0 to n_rows."""
        return self._layout(hp)[0]

    def read(self, hp: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``[start, stop)`` of ``hp``: a view within one shard of a mapped store, else one copy."""
        # The per-batch path of ActivationDataset: plain Python on cached lists, no small
        # tensor operations (each costs microseconds, as much as a batch's own bookkeeping).
        store = self._store
        if store is None or getattr(store, "attrs", None) is not self._seen:
            self.store  # opened (lazily); refreshed: the cached layouts may be stale
        recents, hinted = self._recent, self._hinted  # (taken before the store is read: see _forget_layouts)
        recent = recents.get(hp)
        if recent is not None and recent[0] <= start <= stop <= recent[1]:
            lo = recent[0]
            return recent[2][start - lo : stop - lo]
        layout = self._layout(hp)
        _bounds, memo, memoize, bl = layout
        n = bl[-1]
        if not (0 <= start <= stop <= n):
            raise RowIndexError(f"rows [{start}, {stop}) out of range for hook point {hp!r} with {n} rows")
        if not memoize:  # decoded by the store: read just these rows through its cache
            return self._rows(hp, start, stop)
        lo, hi = hinted.get(hp, (1, 0))
        if not (lo <= start and stop <= hi):  # cold pages: have the kernel read ahead of the consumer
            got = self.store.will_read(hp, start, stop)
            ok = isinstance(got, tuple) and len(got) == 2 and all(isinstance(v, int) for v in got)
            lo, hi = got if ok else (1, 0)
            hinted[hp] = (lo, hi)  # (1, 0), no range given: hint every read
        k = bisect.bisect_right(bl, start) - 1
        if k < len(bl) - 1 and stop <= bl[k + 1]:
            b = bl[k]
            seg = memo.get(k)
            if seg is None:
                seg = self._segment(hp, k, layout)
            r_lo, r_hi = max(b, lo), min(bl[k + 1], hi)  # rows both mapped here and hinted
            if r_lo <= start <= stop <= r_hi:
                recents[hp] = (r_lo, r_hi, seg[r_lo - b : r_hi - b])
            return seg[start - b : stop - b]
        return self._rows(hp, start, stop)

    def gather(self, hp: str, positions: Any, n: int, start: int, want_ids: bool) -> Any:
        """Rows of ``hp`` at dataset positions (a list / tuple of ints or an int64 (k,) tensor;
        position ``p`` in ``[-n, n)`` is store row ``start + p mod n``) in one native pass over
        the mapped segments.

        Returns ``(rows, a, b, ids)`` (see ``csrc/row_gather.h``: a view and its store rows
        ``[a, b)`` for a consecutive run within one segment, else a new tensor and
        ``a = b = -1``; ``ids`` the int64 store rows when ``want_ids``), or None when this path
        does not apply (no native extension, compressed or remote rows, an index it does
        not take): the caller then takes its general path, which raises the right errors.
        """
        gather = _gather_rows()
        if gather is None:
            return None
        store = self._store
        if store is None or getattr(store, "attrs", None) is not self._seen:
            self.store  # opened (lazily); refreshed: the cached layouts may be stale
        seg_lists, hints = self._seg_lists, self._hints  # (taken before the store is read: see _forget_layouts)
        layout = self._layout(hp)
        _bounds, memo, memoize, bl = layout
        if not memoize:
            return None
        segs = seg_lists.get(hp)
        if segs is None or len(segs) != len(bl) - 1:
            segs = [memo.get(k) for k in range(len(bl) - 1)]
            seg_lists[hp] = segs
        hint = self._hint(hints, hp, bl[-1])
        for _ in range(len(bl)):
            got = gather(positions, n, start, bl, segs, want_ids, None, hint)
            if type(got) is not int:
                return got
            segs[got] = self._segment(hp, got, layout)  # a segment this batch needs, mapped once
        return None

    def hint_block(self, hp: str, n_rows: int) -> int:
        """The native gather's ``hint_block`` for ``n_rows`` rows of ``hp`` (:func:`gather_hint_block`)."""
        shape = self.feature_shape(hp)
        row_bytes = self.dtype(hp).itemsize
        for d in shape:
            row_bytes *= int(d)
        return gather_hint_block(int(n_rows) * row_bytes)

    def _hint(self, hints: dict[str, torch.Tensor], hp: str, n_rows: int) -> torch.Tensor:
        """The native gather's ``hint`` of ``hp``, kept in ``hints`` (``self._hints`` as the
        caller took it): int64 ``[hint_block, 0, 0]`` at first, the block and the gather's state
        of the array (how many batches it takes as warm unchecked, and its warm streak; see
        ``csrc/row_gather.h``). Made once per hook point, source and commit (a batch costs
        microseconds)."""
        hint = hints.get(hp)
        if hint is None:
            hint = hints[hp] = torch.tensor([self.hint_block(hp, n_rows), 0, 0], dtype=torch.int64)
        return hint

    def gather_plan(self, hp: str) -> tuple[Any, list[int], list[Any], Any, torch.Tensor] | None:
        """``(gather, boundaries, segments, token, hint)`` for calling the native gather
        of ``hp`` directly, batch after batch, as :meth:`gather` does (``gather(positions, n,
        start, boundaries, segments, False, out, hint)``; ``hint`` is the one :meth:`gather`
        uses, see :meth:`_hint`), or None when :meth:`gather` would not apply.

        ``token`` is ``(self._seg_lists, store metadata object)``: the plan holds while
        ``token[0] is self._seg_lists`` and the open store's ``attrs`` is ``token[1]`` (a
        refresh, reopen or fork replaces either).
        """
        gather = _gather_rows()
        if gather is None:
            return None
        self._check_refreshed()
        seg_lists, seen = self._seg_lists, self._seen
        _bounds, _memo, memoize, bl = self._layout(hp)
        segs = seg_lists.get(hp)
        if not memoize or segs is None or len(segs) != len(bl) - 1:
            return None
        return gather, bl, segs, (seg_lists, seen), self._hint(self._hints, hp, bl[-1])

    def take(self, hp: str, index: torch.Tensor) -> torch.Tensor:
        """Rows at ``index`` (int64, (k,)) of ``hp``: a new tensor. Of decoded chunks, the store's
        ``take`` where it has one (only those rows copied out of its cached chunks), else one
        gather per segment touched."""
        layout = self._layout(hp)
        bounds, _memo, _memoize, bl = layout
        if index.numel() == 0:
            return torch.empty((0, *self.feature_shape(hp)), dtype=self.dtype(hp))
        index = index.contiguous()  # (a strided view of the caller's index: searchsorted warns on it)
        if not _memoize:
            take = getattr(self.store, "take", None)
            if callable(take):  # decoded chunks: the rows copied out of the store's cached chunks, not each chunk whole
                return take(hp, index)
        if not _memoize and index.numel() > 1:  # decoded chunks (object storage): asked for at once, not one by one
            prefetch = getattr(self.store, "prefetch", None)
            if prefetch is not None:
                prefetch(hp, index.tolist())
        if len(bl) <= 2:
            return torch.index_select(self._segment(hp, 0, layout), 0, index)
        lo, hi = int(index.min()), int(index.max())
        k = bisect.bisect_right(bl, lo) - 1
        if 0 <= k < len(bl) - 1 and hi < bl[k + 1]:  # all in one segment: one gather, no scatter
            return torch.index_select(self._segment(hp, k, layout), 0, index - bl[k] if bl[k] else index)
        seg = torch.searchsorted(bounds, index, right=True) - 1
        out = torch.empty((index.numel(), *self.feature_shape(hp)), dtype=self.dtype(hp))
        bits = _INDEXABLE.get(out.dtype)  # (index_put has no kernel for uint16 / uint32 / uint64)
        dst = out if bits is None else out.view(bits)
        for s in torch.unique(seg).tolist():
            pos = (seg == s).nonzero().squeeze(1)
            rows = torch.index_select(self._segment(hp, s, layout), 0, index[pos] - bl[s])
            dst[pos] = rows if bits is None else rows.view(bits)
        return out


#: The cold rows of a shuffled batch (a gather, see ``csrc/row_gather.h``) are asked of the
#: kernel before they are copied: in aligned blocks of this many bytes around each row when the
#: array is at most ``GATHER_BLOCK_MEMORY_FRACTION`` of the machine's memory (an epoch reads it
#: all, and the page cache can keep it: fewer, larger reads), else each row's own pages (a
#: store larger than memory: the rows asked for and nothing around them). On a 2-core VM
#: disk (read_ahead_kb 8192) an epoch of a cold 256 MiB store of 1 KiB rows took 0.45 s in
#: 256 KiB blocks, 0.66 s with the kernel's own read-around, 1.4 s row by row (one run,
#: side by side); the first shuffled batches of a cold 26 GiB layer: README, "Read-back of a
#: cold layer" (benchmark/cold.py).
GATHER_HINT_BLOCK = 256 << 10
GATHER_BLOCK_MEMORY_FRACTION = 0.5


#: cgroup files that may hold this process's memory limit (v2, then v1)
_CGROUP_MEMORY_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


def _memory_bytes() -> int:
    """The memory this process's page cache can hope for, in bytes: the machine's physical
    memory, or a container's (cgroup) memory limit when lower (0 when the platform says
    neither)."""
    try:
        total = int(os.sysconf("SC_PHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        total = 0
    for name in _CGROUP_MEMORY_LIMITS:
        try:
            with open(name) as f:
                text = f.read(64).strip()
        except OSError:
            continue
        if text.isdigit() and int(text) > 0:  # ("max": no limit)
            total = min(total, int(text)) if total else int(text)
        break
    return total


def gather_hint_block(array_bytes: int) -> int:
    """The ``hint_block`` of the native gather for an array of ``array_bytes`` bytes (see
    :data:`GATHER_HINT_BLOCK`): that block size, or 0 (each row's own pages)."""
    return GATHER_HINT_BLOCK if array_bytes <= _memory_bytes() * GATHER_BLOCK_MEMORY_FRACTION else 0


_GATHER: list[Any] = []
#: dtypes whose rows are scattered as the signed integers of their size (same bits): torch
#: has no index_put kernel for them
_INDEXABLE = {torch.uint16: torch.int16, torch.uint32: torch.int32, torch.uint64: torch.int64}


def _gather_rows() -> Any:
    """The native ``gather_rows`` (None without a working extension: the Python path reads)."""
    if not _GATHER:
        from ..capture import _native

        mod = _native.optional()
        _GATHER.append(getattr(mod, "gather_rows", None) if mod is not None else None)
    return _GATHER[0]


def as_source(store_or_path: Any, open_options: Mapping[str, Any] | None = None) -> StoreSource:
    """A :class:`StoreSource` for a path, URL, store object or another source."""
    src = store_or_path if isinstance(store_or_path, StoreSource) else getattr(store_or_path, "source", None)
    if isinstance(src, StoreSource):  # a source, or an ActivationDataset: its open store, as it was opened
        if open_options is not None and {**src._options, **_check_open_options(open_options)} != src._options:
            raise ArgumentValueError(
                f"open_options {dict(open_options)} cannot apply to {src.describe()}: a dataset or source given as "
                f"the store is reused as it was opened ({src._options}); pass the store's path or URL with "
                "open_options= to open it with those"
            )
        return src
    if store_or_path is None:
        raise ArgumentTypeError("a store (path, URL or store object) is required, got None")
    return StoreSource(store_or_path, open_options)
