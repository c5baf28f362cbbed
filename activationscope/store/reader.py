"""The read side: :func:`open_store` and :class:`Store`.

Everything read from a store is validated before use (``_validate``, FORMAT.md §9): the root
metadata when the store is opened, each shard's index (its crc32c, every committed chunk
present and inside the file) before a row of it is returned, sizes before any allocation.

Local, uncompressed arrays are read as zero-copy views of memory-mapped shard files
(private mappings: writing into a returned tensor changes only the process's copy, never the
file). Other arrays (compressed, remote, or shards whose chunks are not back to back) are
decoded chunk by chunk on a small thread pool (``_decode``): the chunks of one read side by
side, and the next chunks of a sequential reader ahead of it; each chunk's place comes from
the checked shard index and its decoded size is checked. Decoded chunks go through a bounded
cache.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import io
import itertools
import json
import math
import mmap
import shlex
import operator
import os
import re
import stat
import sys
import threading
import uuid
import weakref
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import numpy as np
import torch

from ..capture import _native
from ..capture.results import ReductionResults
from ..errors import (
    ArgumentTypeError,
    ArgumentValueError,
    HookPointNotFoundError,
    ReductionNotFoundError,
    RowIndexError,
    StoreCorruptError,
    StoreError,
    hook_point_hint,
    name_repr,
    names_repr,
    warn_at_caller,
)
from .._args import parse_flag
from .._safeio import batch_order, read_parquet_part, row_part_problem
from . import _decode
from . import _format as F
from . import _validate as V
from ._lock import writer_holding
from ._backend import (LocalBackend, _kind, check_backend_not_in_store, check_remote_store_path, folds_names,
                       open_regular, refuse_foreign_entries, resolve,
                       store_above, write_root_first)

def missing_store_hint(path: Any) -> str:
    """``"; did you mean '<store>'?"`` for a local store path where nothing is: the stores
    beside it (folders whose ``zarr.json`` is an activationscope store's, or that hold a writer
    lock; never a group inside a store) whose names are closest to its name (a typo,
    ``run.zar`` for ``run.zarr``); ``"; its folder '<parent>' does not exist either"`` when its
    folder is missing too, ``"; '<parent>' is a file, not a folder"`` when that is a file; else
    ``""`` (a URL, a path that cannot be looked at). Looks at the first 1000 entries of the
    folder only; never raises."""
    import difflib
    from pathlib import Path

    from ._backend import _store_marks

    try:
        given = os.fspath(path)
        if not isinstance(given, str) or "://" in given or given.startswith("file:"):
            return ""  # (a URL: its folder is no local folder to look in)
        path = Path(os.path.expanduser(given))
        parent = path.parent
        if not parent.is_dir():
            if parent.exists():
                return f"; {str(parent)!r} is a file, not a folder"
            return f"; its folder {str(parent)!r} does not exist either"
        if store_above(path) is not None:
            return ""  # (its folder is inside a store: the folders beside it are its groups and arrays)
        with os.scandir(parent) as entries:
            names = [e.name for e in itertools.islice(entries, 1000) if e.is_dir() and e.name != path.name]
        close = [n for n in difflib.get_close_matches(path.name, names, n=3, cutoff=0.85)
                 if _store_marks(parent / n)[0]]
    except (OSError, ValueError, TypeError):  # (a name too long, a NUL byte, a folder not readable)
        return ""
    shown = Path(given).parent  # (as given: '~' not expanded)
    return f"; did you mean {', '.join(repr(str(shown / n)) for n in close)}?" if close else ""


# shard index entry of a chunk that is not there (Zarr sharding: 2**64 - 1)
_MISSING = 2**64 - 1
REFUSED_REDUCTION_FIX = V.REFUSED_REDUCTION_FIX

#: Read-ahead of a sequential reader of memory-mapped rows: the next READ_AHEAD_BYTES after a
#: read are advised (``madvise(MADV_WILLNEED)``), renewed when less than half is left.
READ_AHEAD_BYTES = 64 << 20
#: ... and at most this many shards: an array read per shard is advised one shard at a time, so a
#: window of 64 MiB of small shards (thousands of them) cost milliseconds of each hinted read.
READ_AHEAD_SHARDS = 16
#: A window found warm (no hint needed) grows by this many read-aheads when the rows after
#: it are warm too (``Store.will_read``).
WARM_WINDOW_FACTOR = 3
_MADV_WILLNEED = 3

#: The most memory mappings the open stores of a process keep cached, all together, for their
#: zero-copy reads (each shard file mapped is one; an array's shards mapped back to back as one
#: view count one each). None: :func:`_default_map_budget`, taken when the process first maps.
#: Past it, the mappings used least recently, of whichever store, are dropped from the cache (a
#: tensor returned before keeps its own).
_MAP_BUDGET: int | None = None
#: The least :func:`_default_map_budget` gives.
_MIN_MAP_BUDGET = 1024


def _available_memory_bytes() -> int | None:
    """The memory the system can give this process without swapping, in bytes
    (``MemAvailable`` of ``/proc/meminfo``); None where it cannot be read (no check then)."""
    try:  # (Linux)
        with open("/proc/meminfo", "rb") as f:
            for line in f:
                if line.startswith(b"MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


#: The share of :func:`_available_memory_bytes` one copy made by ``store[...]`` may take: a larger
#: copy raises instead of being killed by the kernel's out-of-memory killer half way through.
_COPY_MEMORY_SHARE = 0.9
#: Copies smaller than this are never checked against the memory available.
_COPY_CHECK_BYTES = 64 << 20


def _default_map_budget() -> int:
    """Half of the process's limit of memory mappings (``vm.max_map_count``, 65530 where it
    cannot be read) less the mappings it holds now, at least ``_MIN_MAP_BUDGET``."""
    limit, held = 65530, 0
    try:  # (Linux)
        with open("/proc/sys/vm/max_map_count", "rb") as f:
            limit = int(f.read())
        with open("/proc/self/maps", "rb") as f:
            held = sum(1 for _ in f)
    except (OSError, ValueError):
        pass
    return max(_MIN_MAP_BUDGET, limit // 2 - held)


class _PartProblem(Exception):
    """A row group of a row-table part read group by group has a problem (``row_part_problem``):
    the part is read whole again to say it of the whole part."""


class _ProcessMappings:
    """The memory mappings the open stores of this process keep cached (each store's
    ``_maps`` and ``_whole``), least recently used first across all of them, under one budget
    (:meth:`Store._budget`): ``vm.max_map_count`` is a limit of the process, however many
    stores it opens (one per layer, a sweep over many, a DataLoader worker's reopened ones).

    ``lock`` guards every store's ``_maps``, ``_whole``, ``_mapped`` and ``_n_mapped`` and the
    state here. It is taken after a store's own lock, never before, and nothing under it takes
    another lock, calls back, or unmaps: what is dropped is handed back to be let go of once
    it is released. It is held across ``fork`` (taken before, released after in both
    processes), so that a child starts with the state whole. A forked child (a DataLoader
    worker) keeps the parent's count: it holds the parent's mappings too (``fork`` copies
    them, and the parent's Store objects live on in the child with their caches), and drops
    them, least recently used first, like its own.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        # (store's token, "shard" | "whole", key) -> how many of the process's mappings it is
        self.lru: OrderedDict[tuple[int, str, str], int] = OrderedDict()
        self.n = 0
        self.stores: dict[int, weakref.ref] = {}  # token -> the store (weakly)
        self.gone: list[weakref.ref] = []  # weak references of stores collected since (appended without the lock)
        self.default_budget: int | None = None  # _default_map_budget(), taken once per process
        self._tokens = itertools.count()

    def register(self, store: "Store") -> int:
        """A token for ``store``'s entries; they are forgotten once the store is collected
        (its cached mappings with it), at the next store opened or file mapped, so that a
        process that opens stores it never maps keeps no entry per store it ever opened."""
        token = next(self._tokens)
        with self.lock:
            self.purge()
            # (the callback is list.append itself, no Python code: a callback run by the garbage
            # collector is where a Ctrl-C delivered is printed and ignored)
            self.stores[token] = weakref.ref(store, self.gone.append)
        return token

    def purge(self) -> None:
        """Forget the entries of the stores collected since (call with the lock held)."""
        if not self.gone:
            return
        refs = set()
        while self.gone:
            refs.add(id(self.gone.pop()))
        tokens = {token for token, ref in self.stores.items() if id(ref) in refs}
        for token in tokens:
            del self.stores[token]
        for slot in [slot for slot in self.lru if slot[0] in tokens]:
            self.n -= self.lru.pop(slot)


_MAPPINGS = _ProcessMappings()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_MAPPINGS.lock.acquire, after_in_parent=_MAPPINGS.lock.release,
                        after_in_child=_MAPPINGS.lock.release)

#: The stores open in this process (weakly): a forked child gives each new locks (:meth:`Store._forked`).
_LIVE_STORES: "weakref.WeakSet[Store]" = weakref.WeakSet()


def _after_fork_in_child() -> None:
    # Another thread of the parent (a read-ahead, a refresh in a background thread, a prefetch
    # thread) may have held a store's lock at the fork: the child has no such thread, and its
    # first read would wait for it forever.
    for st in list(_LIVE_STORES):
        st._forked()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _let_go(dropped: list) -> None:
    """Let go of the cached mappings ``dropped`` (``(store, mapping)`` pairs a store's cache
    handed back; each is unmapped here unless a view still holds it), then call the
    :meth:`Store.on_unmap` callbacks of each store they were of. Call with no lock held."""
    if not dropped:
        return
    stores = list({id(st): st for st, _ in dropped}.values())
    del dropped[:]
    for st in stores:
        st._said_unmapped()


def _load_libc(name: str, argtypes: list) -> Any:
    try:
        fn = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):  # not a POSIX libc: no hints, reads work the same
        return None
    fn.argtypes = argtypes
    fn.restype = ctypes.c_int
    return fn


_madvise = _load_libc("madvise", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int])
_mincore = _load_libc("mincore", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p])
_resident_vec = ctypes.create_string_buffer(1)


def _resident(page: int) -> bool:
    """Whether the page at ``page`` (page-aligned address of a mapping) is in the page cache."""
    if _mincore is None or _mincore(page, mmap.PAGESIZE, _resident_vec) != 0:
        return False
    return bool(_resident_vec.raw[0] & 1)


def _range_resident(addr: int, nbytes: int) -> bool:
    """Whether the first, middle and last pages of ``[addr, addr + nbytes)`` of a file
    mapping are in the page cache (three ``mincore`` calls of one page each, about 1 us; a
    sample, not a guarantee: a page may be evicted at any time)."""
    page = mmap.PAGESIZE
    end = addr + nbytes - 1
    mid = addr + nbytes // 2
    return (_resident(addr - addr % page) and _resident(end - end % page)
            and _resident(mid - mid % page))


def _will_need(addr: int, nbytes: int) -> bool:
    """Ask the kernel to start reading the pages of ``[addr, addr + nbytes)`` of a file
    mapping (asynchronous; a hint, errors ignored): page faults on them then find the data
    in the page cache instead of waiting for one read-around each.

    When the range's first, middle and last pages are already in the page cache (a warm
    store: the common case of a second epoch), no hint is given: ``madvise`` walks every
    page of the range in the page cache, about 0.2 ms per 8 MiB, a tenth of the cost of
    reading those bytes once more. Three ``mincore`` calls of one page each cost about 1 us.

    Returns True when no hint was needed (the range is warm), False otherwise.
    """
    if _madvise is None or nbytes <= 0:
        return False
    if _range_resident(addr, nbytes):
        return True
    lo = addr - addr % mmap.PAGESIZE
    _madvise(lo, nbytes + (addr - lo), _MADV_WILLNEED)
    return False


@dataclass(frozen=True)
class _ShardIndex:
    key: str
    file_bytes: int
    entries: tuple[tuple[int, int], ...]  # (offset, nbytes) per slot; _MISSING for absent
    contiguous: bool  # every committed chunk at slot * chunk_bytes, chunk_bytes long
    bad: dict  # slot -> what is wrong with a committed chunk (it raises when read)

    def check(self, slot: int, backend: Any) -> None:
        """Raise :class:`StoreCorruptError` when committed chunk ``slot`` cannot be read."""
        if slot in self.bad:
            raise V.corrupt(backend, self.bad[slot])


#: Most bytes of a shard one read takes when its chunks' crc32c are checked on object storage.
_CHECK_READ_BYTES = 64 << 20
class _Run:
    """Neighbouring chunks of a shard read in one request (:meth:`Store._read_run`), asked of
    the decode pool when its first chunk's decode is (just before it): the pool takes work in
    the order given, so a decode waiting for its run never waits for work queued behind it,
    and a large read holds a few runs' bytes at a time, not all of them."""

    def __init__(self, read: Any) -> None:
        self._read = read
        self._future: Any = None

    @staticmethod
    def future(runs: dict[int, "_Run"], chunk: int) -> Any:
        """The future of ``chunk``'s run (submitted now if it is its first), None without one."""
        run = runs.get(chunk)
        if run is None:
            return None
        if run._future is None:
            run._future = _decode.submit(run._read)
        return run._future


#: Most bytes of one ranged request that reads neighbouring chunks of a shard together on
#: object storage (a sequential read): one round trip for a run of chunks, not one per chunk.
_RUN_READ_BYTES = 8 << 20
#: Most bytes of committed chunks between two chunks of a shuffled batch (:meth:`Store.prefetch`)
#: that a ranged request reads with them, to read both in one request: about what S3 sends in
#: the time of one more request's latency.
_RUN_GAP_BYTES = 1 << 20
#: rows of a strided read that is a copy (``store[hp, ::k]``) are read this many bytes at a time
_STRIDED_BLOCK_BYTES = 64 << 20
# bytes of one read of a file whose crc32c is checked in pieces (a reduction file, its script):
# memory stays bounded whatever the file's size
_CRC_PIECE_BYTES = 16 << 20


#: Shards of at most this many chunks are compared with their dense index (the templates are
#: cached: a hostile store of millions of chunks per shard would otherwise keep them alive).
_DENSE_MAX_CHUNKS = 4096


@functools.lru_cache(maxsize=64)
def _dense_index(n_chunks: int, committed: int, chunk_bytes: int) -> tuple[bytes, tuple[tuple[int, int], ...]]:
    """The shard index (without its crc32c) of an uncompressed shard whose ``committed``
    chunks lie back to back from offset 0, ``chunk_bytes`` each, the other slots empty
    (``_MISSING``), and its entries: a shard index equal to it needs no per-chunk check."""
    entries = tuple((j * chunk_bytes, chunk_bytes) if j < committed else (_MISSING, _MISSING)
                    for j in range(n_chunks))
    return np.asarray(entries, dtype="<u8").reshape(-1).tobytes(), entries


def _mismatch_cause(meta: dict, chunk: int, restorable: bool = True) -> str:
    """What a crc32c mismatch of ``chunk`` means: damage, or, for the chunk holding the last
    committed rows when they end inside it, possibly a resume's rewrite (FORMAT.md section 5).
    ``restorable``: a resume can put the committed shard back (an object store, or a local
    one holding the committed copy a resume kept, ``<shard key>.committed.tmp``); else the
    advice is to restore or capture again (a resume would refuse the damaged shard)."""
    _rb, chunk_rows, _nc, _cb = _layout(meta)
    n = int(meta["n_rows"])
    if n % chunk_rows and (chunk + 1) * chunk_rows > n:
        last = f"{n - n % chunk_rows}-{n - 1}"
        if restorable:
            return (f"the chunk was rewritten by a capture killed while it committed (it holds the last committed "
                    f"rows, {last}: a resume appends to it, and a running capture rewrites the partial shard of an "
                    "array that held its commits back, FORMAT.md section 7), or by an older version's resume still "
                    "running (resume the capture: it puts the committed shard back, or check again once that capture "
                    "has ended), or it is damaged")
        return (f"the chunk holds the last committed rows ({last}), which a resumed capture appends to, and no "
                "committed copy of its shard is kept: it is damaged, or an older version's resume is still running "
                "(check again once that capture has ended); restore the store from an intact copy, or capture it again")
    return "the chunk is damaged"


def _out_of_mappings(backend: Any, what: str, e: BaseException) -> StoreError | None:
    """The error of a shard mapping refused for want of memory or of mappings (ENOMEM: the
    process holds ``vm.max_map_count`` mappings, one per shard file read zero-copy, e.g. every
    hook point of a store of hundreds read at once), which says so: the store is not damaged.
    None for any other failure."""
    import errno as _errno

    if not (getattr(e, "errno", None) == _errno.ENOMEM or os.strerror(_errno.ENOMEM) in str(e)):
        return None
    held = ""
    try:  # (Linux)
        with open("/proc/self/maps", "rb") as f:
            held = f" (it holds {sum(1 for _ in f)}"
        with open("/proc/sys/vm/max_map_count", "rb") as f:
            held += f", the limit vm.max_map_count is {int(f.read())}"
    except (OSError, ValueError):
        pass
    held += ")" if held else ""
    return StoreError(
        f"store {str(backend)!r}: {what} cannot be mapped: {e}. The store is not damaged: this process has run "
        f"out of memory mappings{held}, and each shard file read zero-copy is one. Read fewer hook points at a "
        "time and drop the tensors and datasets of the others (Store.close() releases the store's own), capture "
        "with larger shards (store_options={'shard_bytes': ...}), or raise the limit (sysctl vm.max_map_count)")


def _layout(meta: dict) -> tuple[int, int, int, int]:
    """(row_bytes, chunk_rows, chunks per shard, chunk_bytes) of an array entry (validated)."""
    rb = V.row_bytes(meta)
    chunk_rows = int(meta["chunk_rows"])
    return rb, chunk_rows, int(meta["shard_rows"]) // chunk_rows, chunk_rows * rb


class _Reductions(Mapping):
    """``store.reductions[hook_point][name] -> Tensor`` (read on access)."""

    def __init__(self, store: "Store") -> None:
        self._store = store

    def __getitem__(self, hook_point: str) -> dict[str, torch.Tensor]:
        entries = self._store._complete_reductions().get(hook_point)
        if entries is None:
            # (the resume in Python: store_options needs store=, refused without it)
            # (and the storage_options it was opened with: their keys, never their values, which may be
            # credentials, as ActivationScope's repr shows them)
            opened = self._store._open_options.get("storage_options")
            so = (f", 'storage_options': {({k: '...' for k in opened})!r}" if isinstance(opened, Mapping)
                  else "")
            resume = (f"ActivationScope(store={self._store.path!r}, store_options={{'resume': True{so}}}, "
                      "reductions=...)")
            partial = self._store.partial_reductions.get(hook_point)
            why = (f"; its reductions {sorted(partial)} cover only part of its rows (see store.partial_reductions)"
                   if partial else "")
            beyond = sorted(n for n, (covered, stored) in (partial or {}).items() if covered > stored)
            if beyond:  # (stored by a close that failed after them, e.g. on a full disk: its last rows lost)
                covered, stored = partial[beyond[0]]
                why = (f"; its reductions {beyond} cover {covered} rows, more than the {stored} it stores: rows "
                       "captured but never committed (the capture failed while it closed, e.g. on a full disk), so "
                       "they are not the stored rows' (see store.partial_reductions); resume=True with the same "
                       f"reductions= ({resume}; command line: capture --resume --reduce ...) computes them again "
                       "over the stored rows")
            if not partial and self._store.status != "complete":
                why = (f" (yet: the store is {self._store.status!r} as this handle last read it, and a capture writes "
                       "its reductions when it closes; store.refresh() sees them once it has)")
                if self._store.status == "incomplete" and writer_holding(self._store._backend) is None:
                    # (no capture writes it now: killed before its close, its reductions never written)
                    why = (" (the store is 'incomplete' and no capture is writing it: its capture stopped before "
                           "it closed, killed or crashed, and a capture writes its reductions when it closes, so "
                           "they were never written; resume it, resume=True with the reductions= it was captured "
                           f"with ({resume}; command line: capture --resume --reduce ...), to compute them over "
                           "every stored row)")
            raise HookPointNotFoundError(
                f"hook point {name_repr(hook_point)} has no reductions in this store{why}; "
                f"hook points with reductions: {names_repr(self)}"
                + ("" if hook_point in self._store.hook_points else hook_point_hint(hook_point, self._store.hook_points))
            )
        refused = self._store._refused.get(hook_point) or {}
        out = ReductionResults(hook_point, {name: self._store._read_small(e) for name, e in entries.items()
                                            if name not in refused})
        names = [n for n in entries if n in refused]  # (a refused entry covering part of the rows is not here)
        if names:
            error = self._store._refused_error(hook_point, names)
            out.refused = {n: functools.partial(self._store._refused_error, hook_point, [n]) for n in names}
            warn_at_caller(f"{error}; the hook point's other reductions are returned without "
                           f"{'it' if len(names) == 1 else 'them'}", UserWarning)
        return out

    def __iter__(self) -> Iterator[str]:
        return iter(self._store._complete_reductions())

    def __len__(self) -> int:
        return len(self._store._complete_reductions())

    def __repr__(self) -> str:
        # (names only, from the root document: nothing is read)
        names = {hp: sorted(entries) for hp, entries in self._store._complete_reductions().items()}
        return f"<reductions of {str(self._store._backend)!r}: {names}>"

    def __reduce__(self):
        # pickled as an OrderedDict of every hook point's results, read now (torch.save(store.reductions)):
        # torch.load, whose weights_only=True loads no class of ours, reads it back without the store
        return OrderedDict, (), None, None, iter([(hp, self[hp]) for hp in self])



class _ChunkCrcs:
    """``{(shard, slot): (offset, nbytes, crc32c)}`` of an array's committed shards (those up
    to ``last``), from its checked manifest records; each shard's entries are checked
    (:func:`~activationscope.store._validate.check_chunk_entries`) and gathered the first
    time one of its chunks is looked up (a 512 MiB layer lists 8192 chunks, which
    every open paid for while only decoded reads and ``verify`` look at them)."""

    __slots__ = ("_shards", "_last", "_by_shard", "_n_chunks", "_store", "_key")

    def __init__(self, shards: dict[int, dict], last: int, n_chunks: int, store: Any, key: str) -> None:
        self._shards, self._last, self._by_shard = shards, last, {}
        self._n_chunks, self._store, self._key = n_chunks, store, key

    def get(self, key: tuple[int, int]) -> tuple[int, int, int] | None:
        shard, slot = key
        if shard > self._last:
            return None
        got = self._by_shard.get(shard)
        if got is None:
            rec = self._shards.get(shard) or {}
            key = self._shards.key_of(shard) if isinstance(self._shards, V.Manifest) else self._key
            chunks = V.check_chunk_entries(rec, self._n_chunks, store=self._store, key=key,
                                           field=f"shards[{shard}]") if rec else []
            got = {ch[0]: (ch[1], ch[2], ch[3]) for ch in chunks}
            self._by_shard[shard] = got
        return got.get(slot)

    @property
    def shards(self) -> dict[int, dict]:
        """``{shard: record}`` of the manifest as :func:`~activationscope.store._validate.parse_manifest`
        gave it (``check_chunks=False``), every listed shard; empty for an array without
        committed rows."""
        return self._shards

    def __contains__(self, key: tuple[int, int]) -> bool:
        return self.get(key) is not None

    def __getitem__(self, key: tuple[int, int]) -> tuple[int, int, int]:
        got = self.get(key)
        if got is None:
            raise KeyError(key)
        return got


def _take_positions(hook_point: str, rows: Any, n: int) -> torch.Tensor:
    """``rows`` of :meth:`Store.take` as store rows: int64 (k,) CPU, each in ``[0, n)``."""
    what = f"take({hook_point!r}, rows)"
    if isinstance(rows, torch.Tensor):
        if rows.device.type == "meta":
            raise ArgumentValueError(f"{what}: rows is a tensor on the meta device, which holds no values; pass "
                                     "the positions as a CPU (or any other device's) integer tensor")
        if rows.dim() != 1 or rows.dtype == torch.bool or rows.is_floating_point() or rows.is_complex():
            fix = ("rows.reshape(-1) for its positions in one row" if rows.dim() != 1 else
                   "rows.nonzero().squeeze(1) for the positions of a mask" if rows.dtype == torch.bool else
                   "rows.long() for positions")
            raise ArgumentTypeError(f"{what}: rows must be a 1-D integer tensor of store positions, got a "
                                    f"{rows.dim()}-D {rows.dtype} tensor; {fix}")
        rows = rows.detach().cpu()
        if rows.dtype in (torch.uint32, torch.uint64):  # (values past int64 are out of range, never wrapped round)
            rows = rows.numpy()
    if isinstance(rows, np.ndarray):
        if rows.ndim != 1 or rows.dtype.kind not in "iu":
            fix = ("rows.reshape(-1) for its positions in one row" if rows.ndim != 1 else
                   "rows.nonzero()[0] for the positions of a mask" if rows.dtype.kind == "b" else
                   "rows.astype(np.int64) for positions" if rows.dtype.kind in "fc" else
                   "an integer array of positions")
            raise ArgumentTypeError(f"{what}: rows must be a 1-D integer array of store positions, got a "
                                    f"{rows.ndim}-D {rows.dtype} array; {fix}")
        if rows.dtype.kind == "u" and rows.size and int(rows.max()) >= n:
            raise RowIndexError(f"{what}: row {int(rows[rows >= n][0])} out of range for hook point {hook_point!r} "
                                f"with {n} rows; rows must be store positions in [0, {n})")
        rows = torch.from_numpy(rows.astype(np.int64))
    elif isinstance(rows, (list, tuple, range)):
        if type(rows) is not range and any(isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer))
                                           for v in rows):
            bad = next(v for v in rows if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)))
            raise ArgumentTypeError(f"{what}: rows must hold ints (store positions), got {bad!r} among them")
        try:
            rows = torch.tensor(list(rows), dtype=torch.int64)
        except (RuntimeError, OverflowError, ValueError):  # (an int beyond int64)
            big = next(int(v) for v in rows if not -2**63 <= int(v) < 2**63)
            raise RowIndexError(f"{what}: row {big} out of range for hook point {hook_point!r} with {n} rows; "
                                f"rows must be store positions in [0, {n})") from None
    elif not isinstance(rows, torch.Tensor):
        raise ArgumentTypeError(f"{what}: rows must be a 1-D integer tensor or array, or a list, tuple or range "
                                f"of ints (store positions), got {type(rows).__name__}")
    idx = rows.to(torch.int64).contiguous()
    if idx.numel():
        bad = (idx < 0) | (idx >= n)
        if bool(bad.any()):
            raise RowIndexError(f"{what}: row {int(idx[bad][0])} out of range for hook point {hook_point!r} with {n} "
                                f"rows; rows must be store positions in [0, {n}) (none negative)")
    return idx


def _take_within(hook_point: str, idx: torch.Tensor, n: int) -> None:
    """Raise :class:`RowIndexError` when a row of ``idx`` (checked by :func:`_take_positions`
    against the rows a commit had) is not below ``n``, the rows of the commit read: another
    thread's ``refresh()`` in between may show a store replaced by one of fewer rows."""
    top = int(idx.max())
    if top >= n:
        raise RowIndexError(f"take({hook_point!r}, rows): row {top} out of range for hook point {hook_point!r} with {n} "
                            f"rows (the store was refreshed meanwhile, and another run of it shown); rows must be "
                            f"store positions in [0, {n})")


def _word_rows(t: torch.Tensor) -> torch.Tensor:
    """Contiguous ``t`` ((rows, ...), rows > 0, rows of > 0 bytes) as (rows, words) of the
    widest of int64, int32, int16 and uint8 whose size divides a row's bytes, the same
    memory: rows of any dtype are copied by their bits (torch has no index_put kernel for
    uint16 / uint32 / uint64), in words (``index_copy_`` of 1 KiB rows as bytes takes about
    six times as long as in int64 words)."""
    row_bytes = t[0].numel() * t.element_size()  # (rows start at whole rows of their storage: aligned alike)
    word = next(w for w in (torch.int64, torch.int32, torch.int16, torch.uint8) if row_bytes % w.itemsize == 0)
    return t.view(-1).view(torch.uint8).view(word).view(t.shape[0], -1)


def _put_rows(out: torch.Tensor, pos: torch.Tensor, rows: torch.Tensor) -> None:
    """``out[pos] = rows`` (``pos`` int64 (k,), ``rows`` (k, ...) of ``out``'s dtype and row shape)."""
    _word_rows(out).index_copy_(0, pos, _word_rows(rows))


_GATHER: list[Any] = []


def _native_gather() -> Any:
    """The native ``gather_rows`` (None without a working extension: rows are copied by torch)."""
    if not _GATHER:
        mod = _native.optional()
        _GATHER.append(getattr(mod, "gather_rows", None) if mod is not None else None)
    return _GATHER[0]


def _gather_into(out: torch.Tensor, idx: torch.Tensor, units: list[tuple[int, int, torch.Tensor]]) -> None:
    """Copy store rows ``idx`` (int64 (k,), k > 0) into ``out`` ((k, *feature), contiguous), in
    that order, each row once, from ``units``: ``(first row, end row, rows [first, end))``,
    ascending and not overlapping, each a contiguous tensor of ``out``'s dtype and row shape
    holding every row of ``idx`` in its range. One native pass (``_C.gather_rows`` over the
    units as its segments, without the GIL) where the extension is built, else one
    ``index_select`` per unit, by the rows' bytes."""
    gather = _native_gather()
    if gather is not None:
        bounds: list[int] = []
        segments: list[Any] = []
        for lo, hi, t in units:
            if bounds and bounds[-1] != lo:
                segments.append(None)  # (rows between two units: none of idx is there)
            if not bounds or bounds[-1] != lo:
                bounds.append(lo)
            segments.append(t)
            bounds.append(hi)
        if type(gather(idx, bounds[-1], 0, bounds, segments, False, out, None)) is tuple:
            return
    order = torch.argsort(idx)
    ordered = idx[order]
    ends = torch.searchsorted(ordered, torch.tensor([[lo, hi] for lo, hi, _ in units], dtype=torch.int64).view(-1))
    ends_l = ends.tolist()
    dst = _word_rows(out)
    for (lo, _hi, t), a, b in zip(units, ends_l[0::2], ends_l[1::2]):
        if a < b:
            dst.index_copy_(0, order[a:b], _word_rows(t).index_select(0, ordered[a:b] - lo))


def _no_rank_column(table: Any, st: Any, rank: int) -> None:
    """Refuse a rank store whose row table has a user column named ``rank``: the multi-rank
    view adds its own column of that name (a writer refuses such a column since)."""
    if "rank" in table.column_names:
        raise StoreError(
            f"rank store {rank} ({str(st._backend)!r}) has a user row-table column named 'rank', which clashes "
            "with the rank column a multi-rank store adds; its rows cannot be combined with the other ranks': "
            "capture again with that column renamed"
        )

def concat_rank_tables(tables: list, ranks: list[int], stores: list, kind: str) -> Any:
    """The row tables of rank stores (each with its ``rank`` column) as one table, in the
    order given; a column missing from a rank is null there.

    Raises
    ------
    StoreError
        As :func:`check_rank_column_types`.
    """
    import pyarrow as pa

    check_rank_column_types(tables, ranks, stores, kind)
    return pa.concat_tables(tables, promote_options="default")


def check_rank_column_types(tables: list, ranks: list[int], stores: list, kind: str, after: str = "") -> None:
    """Raise :class:`StoreError` when two ranks' row tables hold a column of the same name
    with other types (a user column given as int64 by one rank and float by another; a
    column all null on a rank takes any type), naming the column, both ranks and types.
    ``tables``: each rank's table, or its ``pyarrow.Schema``. ``after``: the end of the message."""
    import pyarrow as pa

    seen: dict[str, tuple[int, Any]] = {}
    for r, st, t in zip(ranks, stores, tables):
        for field in (t if isinstance(t, pa.Schema) else t.schema):
            first = seen.setdefault(field.name, (r, field.type))
            if first[1] != field.type and not pa.types.is_null(first[1]) and not pa.types.is_null(field.type):
                raise StoreError(
                    f"the {kind} row tables of the rank stores disagree on column {field.name!r}: rank {first[0]} "
                    f"holds {first[1]}, rank {r} ({str(st._backend)!r}) holds {field.type}; their rows cannot be "
                    "one table. Capture that rank again giving the column the same dtype on every rank (e.g. "
                    f"set_batch({field.name}=tensor.to(one dtype))){after}")
            if pa.types.is_null(first[1]):
                seen[field.name] = (r, field.type)


class Store:
    """A read-only activationscope store (a snapshot of its last commit).

    Made by :func:`open_store`. Attributes and arrays reflect the commit that was current
    when the store was opened (or :meth:`refresh` was called): a writer appending at the same
    time never shows a partial commit.

    Methods that take a ``hook_point`` (str) take a stored hook point or an alias of one
    (:attr:`aliases`); a name that is not stored raises
    :class:`~activationscope.errors.HookPointNotFoundError` (a KeyError).

    Parameters
    ----------
    target, cache_bytes, verify, storage_options
        As in :func:`open_store` (``target``: str, os.PathLike or zarr Store; ``cache_bytes``:
        int, bytes; ``verify``: bool; ``storage_options``: dict or None).

    Raises
    ------
    StoreError, StoreCorruptError
        As :func:`open_store` raises them.
    """

    def __init__(self, target: Any, *, cache_bytes: int = 64 << 20, storage_options: dict | None = None,
                 verify: bool = False, _rank_view: bool = True) -> None:
        if isinstance(cache_bytes, bool) or not isinstance(cache_bytes, int) or cache_bytes < 0:
            raise ArgumentTypeError(f"cache_bytes must be a non-negative int, got {cache_bytes!r}")
        self._verify_reads = verify = parse_flag(verify, "verify")
        # what reopens this store as it was opened, in another process (a DataLoader worker)
        self._open_options = {"cache_bytes": int(cache_bytes), "verify": verify}
        if storage_options is not None:
            self._open_options["storage_options"] = storage_options
        self._backend = resolve(target, read_only=True, storage_options=storage_options)
        self._cache_bytes = int(cache_bytes)
        self._cache: OrderedDict[tuple, torch.Tensor] = OrderedDict()  # (array path, chunk, id(entry)) -> decoded
        self._cached = 0
        self._maps: dict[str, torch.Tensor] = {}
        self._indexes: dict[str, _ShardIndex] = {}
        self._index_gates: dict[str, threading.Lock] = {}  # (see _shard_index)
        self._gates_pid = os.getpid()  # the process whose threads hold _index_gates
        self._whole: dict[str, tuple[int, torch.Tensor]] = {}
        # the mappings _maps and _whole hold: ("shard", key) or ("whole", array path) -> how many
        # of the process's mappings it is (_keep_mapping; the order of use is _MAPPINGS's, of
        # every store of the process). These four change under _MAPPINGS.lock only.
        self._mapped: dict[tuple[str, str], int] = {}
        self._n_mapped = 0
        self._map_token = _MAPPINGS.register(self)
        self._total_shards: tuple[dict, int] | None = None  # (root attrs, their arrays' shards): _whole_fits
        self._unmap_listeners: list[Any] = []  # (on_unmap)
        self._zarrays: dict[str, Any] = {}
        self._checked: dict[str, _ChunkCrcs] = {}  # array path -> (shard, slot) -> (offset, nbytes, crc32c)
        # A resuming writer re-reads the chunk holding its last committed row unchecked: after a
        # resume killed before its next commit, that chunk was rewritten (FORMAT.md section 5).
        self._resume_tail = False
        self._lock = threading.RLock()
        # ids of the array entries (``meta``) of the commit read last, to their hook point: a cache
        # entry built from another commit's entry (a reader that took it before another thread's
        # refresh()) is returned to that reader but never kept for the others (``_current``)
        self._live: dict[int, str] = {}
        self._refreshes = self._shown = 0  # refresh() calls started; the one whose commit is shown
        # (hook point, chunk, id of the array entry it is decoded for) -> Future of its decode;
        # the decoded chunks cache under the same keys, of the commit read last only
        self._inflight: dict[tuple, Any] = {}
        self._next_start: dict[str, int] = {}  # where a sequential reader of a hook point goes next
        self._prefetched: dict[str, frozenset[int]] = {}  # the chunks of a hook point's last prefetch()
        self._advised: dict[str, tuple[int, int]] = {}  # hook point -> (last hinted start, advised until row)
        self._hints: dict[str, tuple] = {}  # hook point -> (meta, eligible, n_rows, row_bytes, read-ahead rows)
        self._pid = os.getpid()
        self._rank_view_allowed = _rank_view  # rank stores are opened without a view of their own
        self._ranks: list[tuple[int, "Store"]] = []  # an uncommitted multi-rank store: its rank stores
        self._parts: dict[str, list[tuple[int, "Store", int]]] = {}  # hook point -> (rank, store, first row)
        _LIVE_STORES.add(self)
        self.refresh()
        self._warn_store_moved_aside()

    def _forked(self) -> None:
        """In a forked child (``os.register_at_fork``): new locks, free, in place of the
        parent's (a thread of the parent may have held one at the fork, and the child has no
        such thread), and the caches a thread of the parent may have been filling emptied
        (re-read when used). The parent's decode futures never finish here: forgotten. The
        mapping caches are whole (their lock is held across the fork) and kept. On object
        storage the backend (and the zarr arrays made over it) is dropped: its file system's
        client sessions belong to the parent's event loop; the next use makes it again
        (:meth:`__getattr__`). The parent's is kept, never finalised here: closing its sessions
        in the child would print "Unclosed client session" (aiohttp)."""
        self._lock = threading.RLock()
        self._index_gates, self._gates_pid = {}, os.getpid()
        self._inflight = {}
        self._pid = os.getpid()
        self._indexes = {}
        self._checked = {}
        self._zarrays = {}
        self._cache = OrderedDict()
        self._cached = 0
        self._advised = {}
        backend = self.__dict__.get("_backend")
        if callable(getattr(backend, "reopened", None)):
            self._parent_backend = self.__dict__.pop("_backend")

    def __getattr__(self, name: str) -> Any:
        # (only for attributes not set: the backend of a forked child, made again on first use)
        if name == "_backend":
            parent = self.__dict__.get("_parent_backend")
            if parent is not None:
                backend = self.__dict__["_backend"] = parent.reopened()
                return backend
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def _warn_store_moved_aside(self) -> None:
        """A local store that holds no committed forward yet (its root may list hook points, of
        0 rows, or reduced hook points) while a folder next to it holds the store an
        ``overwrite=True`` moved aside (FORMAT.md section 7): the new run is still before its
        first commit, or its writer was killed there. Said once, when the store is opened: the
        rows a reader expected are in that folder, not lost."""
        if (not isinstance(self._backend, LocalBackend) or self.status == "complete"
                or F.committed_a_forward(self._attrs)):
            return
        try:
            moved = self._backend.moved_roots()
        except OSError:
            return
        if moved:
            shown = " and ".join(repr(str(p)) for p in moved)
            warn_at_caller(
                f"store {str(self._backend)!r} holds no rows yet: an overwrite=True is writing a new store there "
                f"and has not committed (or its writer was killed before its first commit); the store it replaces "
                f"is in {shown} until then. With no writer running, run the capture again with overwrite=True "
                "(the old store is put back whole if the new one commits nothing), or, to keep the old store, "
                f"delete the new one's entries in {str(self._backend.root)!r} and move every entry of that folder "
                "back into it (zarr.json last)",
                UserWarning)

    # ------------------------------------------------------------------ metadata
    def refresh(self) -> None:
        """Re-read (and re-validate) the root metadata: see rows committed since opening.

        Threads may call it at once (and read meanwhile): the commit shown is that of the
        refresh that started last, never an older one read by a slower call."""
        with self._lock:
            self._refreshes += 1
            seq = self._refreshes
        stamp = self._root_stamp()  # before the read: a commit in between only costs one re-read later
        forget = getattr(self._backend, "forget_listings", None)
        if forget is not None:  # (a remote file system's cached listings predate the commits since)
            forget()
        raw = self._backend.get("zarr.json", max_bytes=V.MAX_JSON_BYTES)
        if raw is None:
            self._refuse_node_of_a_store(raw)
            if isinstance(self._backend, LocalBackend):
                root = self._backend.root
                if root.exists() and not root.is_dir():
                    raise StoreError(f"no store at {str(self._backend)!r}: it is a file, and a store is a folder")
                if not root.exists():
                    raise StoreError(f"no store at {str(self._backend)!r}: nothing is there{missing_store_hint(root)}")
                moved = self._backend.moved_aside_hint()
                if moved:
                    raise StoreError(f"no store at {str(self._backend)!r}: it holds no root document (zarr.json); "
                                     f"{moved}")
            why = getattr(self._backend, "why_no_root", None)
            why = why() if why is not None else ""
            raise StoreError(f"no store at {str(self._backend)!r} (no zarr.json)" + (f": {why}" if why else ""))
        try:
            attrs = V.parse_root(raw, store=self._backend)
        except StoreCorruptError:
            self._refuse_node_of_a_store(raw)  # an array document read as a root, not damage
            raise
        if attrs is None:
            self._refuse_node_of_a_store(raw)
            raise StoreError(f"{str(self._backend)!r} is a Zarr node but not an activationscope store")
        run = F.run_of(attrs)
        refused = V.builtin_reduction_problems(attrs)  # (refused by the readers of each: FORMAT.md §9 rule 10)
        ranks: list[tuple[int, Store]] = []
        parts: dict[str, list[tuple[int, Store, int]]] = {}
        dist = attrs.get("distributed")
        if self._rank_view_allowed and isinstance(dist, dict) and dist.get("committed") is False:
            attrs, ranks, parts = _rank_view(self, attrs, dist)
        with self._lock:
            if seq < self._shown:  # a refresh that started after this one has shown a newer commit
                for _, st in ranks:
                    st.close()
                return
            self._shown = seq
            replaced = self._ranks  # (closed once the lock is released: on_unmap callbacks run without it)
            for _, st in ranks:  # (their mappings dropped are said to this store's listeners)
                st._unmap_listeners = self._unmap_listeners
            self._ranks, self._parts = ranks, parts
            self._attrs, self._refused = attrs, refused
            dropped: list = []
            if getattr(self, "_run", run) != run:  # another run in its place: nothing mapped is its
                dropped = self._clear_mappings()
            self._stamp, self._run = stamp, run
            self._shown_stamp = stamp  # (_stamp moves on with commits of the same run; this does not)
            self._live = {id(m): hp for hp, m in (attrs.get("arrays") or {}).items()}
            self._zarrays.clear()
            self._indexes.clear()
            self._checked.clear()
            self._cache.clear()
            self._cached = 0
            # the rows hinted so far were of the old commit's files: another run in its place,
            # or a last shard a resume rewrote (a new file), whose pages were never hinted. A new
            # dict: a hint given meanwhile (from the old commit) goes into the old one
            self._advised = {}
        for _, old in replaced:
            old.close()
        _let_go(dropped)

    def _refuse_node_of_a_store(self, raw: bytes | None) -> None:
        """Raise :class:`StoreError` naming the store to open when this local path, which holds
        no store root, is a folder inside a store (``acts``, ``acts/<node>``, ``rows/sample``,
        ``reductions/<node>/<name>``, ...): its ``zarr.json`` (``raw``), if any, is a Zarr node
        without the root's ``format``. Returns when it is not."""
        if not isinstance(self._backend, LocalBackend) or not self._backend.root.is_dir():
            return
        ours = None
        if raw is not None:
            try:
                doc = json.loads(raw)
            except (ValueError, RecursionError):
                return  # a damaged document: said as such by the caller
            attrs = doc.get("attributes") if isinstance(doc, dict) else None
            ours = attrs.get(F.ATTRS_KEY) if isinstance(attrs, dict) else None
            if isinstance(ours, dict) and "format" in ours:
                return  # a store root (perhaps damaged), not a node
        outer = store_above(self._backend.root)
        if outer is None:
            return
        rel = self._backend.root.resolve().relative_to(outer).as_posix()
        hp = ours.get("hook_point") if isinstance(ours, dict) else None
        array = isinstance(hp, str) and rel.startswith("acts/")
        raise StoreError(
            f"{str(self._backend)!r} is not a store: it is {rel!r}"
            + (f" (the array of hook point {hp!r})" if array else "")
            + f" inside the store {str(outer)!r}. Open that store instead (open_store({str(outer)!r}); "
            f"`activationscope verify {shlex.quote(str(outer))}`)"
            + (f" and read {hp!r} from it" if array else "")
        )

    def _root_stamp(self) -> tuple | None:
        """(device, inode, mtime, size) of a local store's root document; of another store,
        what its backend's ``stamp`` says changes when the root is written again (object
        storage: size, ETag, last-modified); None when it is not there or the backend cannot
        tell."""
        if not isinstance(self._backend, LocalBackend):
            stamp = getattr(self._backend, "stamp", None)
            return None if stamp is None else stamp("zarr.json")
        doc = self.__dict__.get("_root_doc_path")
        if doc is None:
            doc = self.__dict__["_root_doc_path"] = os.path.join(str(self._backend.root), "zarr.json")
        try:
            st = os.stat(doc)
        except OSError:
            return None
        return (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)

    @contextlib.contextmanager
    def _reads_of_the_opened_run(self) -> Iterator[None]:
        """Around the reads of a file opened lazily (an array's documents and manifest, a shard
        index or mapping, row-table parts, reduction files): once they are done, and before what
        they read is used or cached, :meth:`_check_same_store`; also when they raise
        :class:`StoreCorruptError` (a file of another run, or one an overwrite deleted, is not
        damage). Checking after the read, not before, is what makes it sound: a writer that
        replaces the store writes the root document of its run before it deletes or writes
        anything else (FORMAT.md section 7), so a root unchanged after the read was unchanged
        during it, and what was read is the opened run's (object stores read their latest
        write: S3, fsspec memory)."""
        try:
            yield
        except StoreCorruptError:
            self._check_same_store()
            raise
        self._check_same_store()

    def _check_same_store(self, per_chunk: bool = False) -> None:
        """Raise :class:`StoreError` when the local store was replaced (another run written in
        its place: ``overwrite=True``, a copy, a delete and a new capture) since it was opened
        or refreshed. Called after a file opened lazily was read (:meth:`_reads_of_the_opened_run`),
        and before a read error is blamed on damage. One ``stat`` of the root document (object
        storage: one metadata request, and not per chunk, where a chunk of another run fails
        its crc32c); the root is re-read only when it changed (a commit), to compare its
        ``run_id`` (``created`` for stores written before run ids)."""
        stamp = getattr(self, "_stamp", None)
        if stamp is None:
            return
        if per_chunk and not isinstance(self._backend, LocalBackend):
            return  # one request per chunk is too many; a chunk of another run fails its manifest's crc32c
        now = self._root_stamp()
        if now == stamp:
            return
        replaced = f"store at {str(self._backend)!r} was replaced since it was opened"
        fix = "reopen it (open_store again, or store.refresh()); a dataset of it: make a new ActivationDataset"
        if now is None:
            gone = f"store at {str(self._backend)!r} was removed or moved since it was opened (its root document " \
                   "zarr.json is gone)"
            raise StoreError(f"{gone}; if another store was put in its place, {fix}; if it was moved or renamed, "
                             "open it at its new path (open_store(new path); a dataset: a new ActivationDataset of "
                             "that path)")
        raw = self._backend.get("zarr.json", max_bytes=V.MAX_JSON_BYTES)
        doc = V.loads_json(raw, store=self._backend, key="zarr.json") if raw is not None else None
        attributes = doc.get("attributes") if isinstance(doc, dict) else None
        attrs = attributes.get(F.ATTRS_KEY) if isinstance(attributes, dict) else None
        run = F.run_of(attrs)
        if run != self._run:
            was = self._run[0] or f"created {self._run[1]}"
            new = "no activationscope store" if run is None else (run[0] or f"created {run[1]}")
            raise StoreError(f"{replaced} (opened: run {was}; now: {new}); {fix}")
        self._stamp = now

    def _reduction_damage(self, what: str) -> StoreError:
        """The error for a reduction file that is missing or does not match its entry: a
        :class:`StoreError` telling to refresh when the local store's root was committed again
        since the reader showed it (a resumed capture rewrites its reductions, and the new
        root lists their new sizes and crc32c), else :class:`StoreCorruptError`. Raises
        :class:`StoreError` when another run is in the store's place now (:meth:`_check_same_store`)."""
        self._check_same_store()  # another run in its place: said as such, not as damage
        shown = getattr(self, "_shown_stamp", None)
        if shown is not None and self._root_stamp() != shown:
            return StoreError(
                f"store at {str(self._backend)!r}: {what}: the store was committed again since it was opened (a "
                "resumed capture rewrites its reductions, and each commit of a store that keeps reductions only "
                "writes them anew); call store.refresh() (or open_store again) to read them"
            )
        return V.corrupt(self._backend, what)

    def __reduce__(self) -> tuple:
        """Pickle as the store's path or URL and :meth:`open_options` (a Dataset holding a
        store, in a DataLoader worker started with ``spawn``): unpickled, the store is opened
        again there, and raises StoreError when another run has been written in its place
        since (its rows would not be the ones read here)."""
        return (_reopen_pickled, (self.path, self.open_options(), self._run, os.getpid()))

    def _raise_cache_bytes(self, nbytes: int) -> None:
        """Raise the bound of the cache of decoded chunks to ``nbytes`` (never lower it), also
        in :meth:`open_options` (a DataLoader worker reopens the store with it): read at each
        insertion, so the cache grows as chunks are decoded."""
        with self._lock:
            if int(nbytes) > self._cache_bytes:
                self._cache_bytes = int(nbytes)
                self._open_options["cache_bytes"] = int(nbytes)

    def open_options(self) -> dict:
        """The keyword arguments of :func:`open_store` this store was opened with
        (``cache_bytes``, ``verify``, ``storage_options`` when given): what reopens it the same
        way in another process (``ActivationDataset`` in a DataLoader worker). A new dict."""
        return dict(self._open_options)

    @property
    def attrs(self) -> dict:
        """The store's metadata (root attribute ``activationscope``), a plain dict."""
        return self._attrs

    @property
    def status(self) -> str:
        """``"complete"`` or ``"incomplete"`` (a run that stopped early, or is still writing)."""
        return self._attrs["status"]

    @property
    def hook_points(self) -> list[str]:
        """Names of the stored hook points (``acts/<hook point>``) in capture order, then
        those stored as aliases (:attr:`aliases`); in a store that keeps reductions only
        (:attr:`rows_stored` False), the hook points it reduced (:attr:`reduced`)."""
        if not self.rows_stored:
            return list(self._attrs.get("reduced") or {})
        return list(self._attrs.get("arrays", {})) + [a for a in self.aliases if a not in self._attrs.get("arrays", {})]

    @property
    def rows_stored(self) -> bool:
        """Whether the store holds activation rows: False for a store that keeps reductions only
        (captured with ``store=`` and ``reduction_policy=ReductionPolicy.STREAMING``, FORMAT.md
        section 11), whose readers of rows (``store[hook_point]``, :meth:`rows`, :meth:`n_rows`,
        :meth:`feature_shape`, :meth:`dtype`, ``ActivationDataset``, ``to_dask``, exports, the
        report) raise :class:`StoreError`; its :attr:`reductions`, :attr:`reduced`, sample row
        table, :meth:`info` and :meth:`verify` read as in any store."""
        return self._attrs.get("rows_stored", True) is not False

    @property
    def reduced(self) -> dict[str, dict]:
        """``{hook point: {"row_kind", "feature_shape", "dtype", "n_rows"}}`` of a store that keeps
        reductions only: the rows each hook point reduced (``n_rows``, those of the committed
        forwards), their shape and dtype; ``{}`` for a store of rows (see :meth:`n_rows`,
        :meth:`feature_shape`, :meth:`dtype`). A copy."""
        return {hp: {**e, "feature_shape": list(e["feature_shape"])}
                for hp, e in (self._attrs.get("reduced") or {}).items()}

    def _refuse_rows(self, hook_point: str) -> StoreError:
        """The error of every reader of rows of a store that keeps reductions only."""
        return StoreError(
            f"store {str(self._backend)!r} keeps reductions only (captured with store= and "
            f"reduction_policy=ReductionPolicy.STREAMING): it holds no activation row of hook point "
            f"{name_repr(hook_point)}. Read its reductions (store.reductions[{hook_point!r}]) and store.reduced; "
            "to store rows, capture again without reduction_policy")

    @property
    def aliases(self) -> dict[str, str]:
        """``{hook point: hook point it repeats}``: hook points whose activation was, at every
        captured call, the very tensor of another (a container returning its last child's
        output, a module's input that is the previous module's output). Stored once; reading
        an alias reads its target's array."""
        arrays = self._attrs.get("arrays", {})
        raw = self._attrs.get("aliases") or {}
        return {a: t for a, t in raw.items() if isinstance(a, str) and isinstance(t, str) and t in arrays}

    @property
    def n_samples(self) -> int:
        """Committed samples (rows of the sample row table); 0 for a store killed before its
        first commit."""
        return int(self._attrs.get("n_samples", 0))

    @property
    def path(self) -> str:
        """Where the store lives: a local directory or a URL."""
        return str(self._backend)

    def _reduction_coverage(self, hook_point: str, entry: dict) -> tuple[int, int] | None:
        """(rows covered, rows stored) of a reduction entry that covers fewer rows than its
        hook point's array; None when it covers all (or the store predates the record)."""
        if "n_rows" not in entry:
            return None
        array = self.aliases.get(hook_point, hook_point)
        stored = int((self._attrs.get("arrays", {}).get(array) or (self._attrs.get("reduced") or {}).get(array)
                      or {}).get("n_rows", 0))
        covered = int(entry["n_rows"])
        return None if covered == stored else (covered, stored)

    def _complete_reductions(self) -> dict[str, dict]:
        out = {}
        for hp, entries in (self._attrs.get("reductions") or {}).items():
            keep = {n: e for n, e in entries.items() if self._reduction_coverage(hp, e) is None}
            if keep:
                out[hp] = keep
        return out

    @property
    def partial_reductions(self) -> dict[str, dict[str, tuple[int, int]]]:
        """``{hook_point: {name: (rows covered, rows stored)}}`` of the reductions that do not
        cover exactly the stored rows of their hook point: fewer (a resumed run that did not
        continue them), or more (a capture whose close failed after storing them, e.g. on a
        full disk, so that its last rows were never committed). They are left out of
        :attr:`reductions`."""
        out: dict[str, dict[str, tuple[int, int]]] = {}
        for hp, entries in (self._attrs.get("reductions") or {}).items():
            for name, entry in entries.items():
                cov = self._reduction_coverage(hp, entry)
                if cov is not None:
                    out.setdefault(hp, {})[name] = cov
        return out

    @property
    def refused_reductions(self) -> dict[str, dict[str, str]]:
        """``{hook_point: {name: problem}}`` of the reduction entries of a built-in kind
        (``mean``, ``var``, ``hist``, ...) that no built-in reduction writes: a dtype other than
        float64 / int64 (a ``bool`` ``mean``, a user's own float32 values given a built-in kind,
        which earlier versions stored), options that reduction cannot have, or an output or shape
        it does not have (FORMAT.md §9 rule 10). ``problem`` names the field, the rule and the
        value. The store opens and reads the rest as usual: ``store.reductions[hook_point]``
        returns that hook point's other reductions with a ``UserWarning`` naming the entry, and
        indexing the entry there raises :class:`StoreCorruptError` naming it;
        :meth:`reduction_specs` leaves it out; the report uses none of that hook point's
        reductions; a resume and a commit of rank stores refuse it; :meth:`verify` lists each."""
        return {hp: dict(v) for hp, v in self._refused.items()}

    def _refused_error(self, hook_point: str, names: Iterable[str]) -> StoreCorruptError:
        refused = self._refused.get(hook_point) or {}
        names = [n for n in names if n in refused]
        return V.corrupt(self._backend, f"hook point {hook_point!r}: reduction {names[0]!r} is refused: "
                         f"{refused[names[0]]}" + (f" (and {names[1:]} likewise)" if len(names) > 1 else ""),
                         fix=REFUSED_REDUCTION_FIX)

    def _meta(self, hook_point: str) -> dict:
        if not isinstance(hook_point, str):
            raise HookPointNotFoundError(f"hook point must be a str, got {hook_point!r}; this store has "
                                         f"{names_repr(self.hook_points)}")
        arrays = self._attrs.get("arrays", {})
        if not self.rows_stored and hook_point in (self._attrs.get("reduced") or {}):
            raise self._refuse_rows(hook_point)
        if hook_point not in arrays and hook_point in self.aliases:
            hook_point = self.aliases[hook_point]  # stored once, as its target
        try:
            return arrays[hook_point]
        except KeyError:
            pending = ""
            if not self.hook_points and self.status != "complete":
                # (a capture still running lists its hook points with its first commit)
                pending = (f": the store is {self.status} (a capture still running, or stopped before its first "
                           "commit?), and a capture's hook points appear with its first commit; call "
                           "store.refresh() once rows are committed")
            raise HookPointNotFoundError(
                f"hook point {name_repr(hook_point)} is not in the store {str(self._backend)!r}; it has "
                f"{names_repr(self.hook_points)}{hook_point_hint(hook_point, self.hook_points)}"
                f"{pending}"
            ) from None

    def n_rows(self, hook_point: str) -> int:
        """Committed rows of a hook point.

        Checked against the array's own files on first use (FORMAT.md section 9 rule 16),
        since readers size buffers and index lists from it.

        Parameters
        ----------
        hook_point : str
            A stored hook point (or an alias of one).

        Raises
        ------
        HookPointNotFoundError
            ``hook_point`` is not in the store.
        StoreCorruptError
            The root document's count disagrees with the array's document or manifest, or the
            shard holding its last row is missing.
        """
        return int(self._checked_meta(hook_point)["n_rows"])

    def _checked_meta(self, hook_point: str) -> dict:
        """The root's entry of ``hook_point``, checked against the array's own files once
        (rules 16-17) before a caller sizes or interprets rows from it."""
        meta = self._meta(hook_point)
        if not self._parts and meta["path"] not in self._checked:
            self._array_crcs(meta)
        return meta

    def row_kind(self, hook_point: str) -> str:
        """``"sample"`` or ``"token"``.

        Parameters
        ----------
        hook_point : str
            A stored hook point (or an alias of one).
        """
        return self._meta(hook_point)["row_kind"]

    def feature_shape(self, hook_point: str) -> tuple[int, ...]:
        """Shape of one row of ``hook_point`` (its array is ``(rows, *feature_shape)``).

        Parameters
        ----------
        hook_point : str
            A stored hook point (or an alias of one).

        Raises
        ------
        HookPointNotFoundError
            ``hook_point`` is not in the store.
        StoreCorruptError
            The root document and the array's document disagree (FORMAT.md section 9 rule 17).
        """
        return tuple(self._checked_meta(hook_point)["feature_shape"])

    def dtype(self, hook_point: str) -> torch.dtype:
        """The stored torch dtype of ``hook_point`` (``torch.bfloat16`` included).

        Parameters
        ----------
        hook_point : str
            A stored hook point (or an alias of one).

        Raises
        ------
        HookPointNotFoundError, StoreCorruptError
            As :meth:`feature_shape` raises them.
        """
        return F.torch_dtype(self._checked_meta(hook_point)["dtype"])

    def __contains__(self, hook_point: object) -> bool:
        """Whether ``hook_point`` is stored (or, in a store that keeps reductions only, reduced)."""
        if not self.rows_stored:
            return hook_point in (self._attrs.get("reduced") or {})
        return hook_point in self._attrs.get("arrays", {}) or hook_point in self.aliases

    def __len__(self) -> int:
        """Number of stored hook points."""
        return len(self.hook_points)

    def __iter__(self) -> Iterator[str]:
        """Iterate over the stored hook point names."""
        return iter(self.hook_points)

    # ------------------------------------------------------------------ arrays
    def __getitem__(self, key: Any) -> torch.Tensor:
        """``store[hook_point]`` or ``store[hook_point, rows]`` with ``rows`` a slice (any step).

        Parameters
        ----------
        key : str or (str, slice)
            A hook point, or a hook point and a slice of its rows (any step but 0).

        Returns
        -------
        Tensor, (rows, *feature_shape), the stored dtype, CPU
            A zero-copy view of the memory-mapped shard when the array is local and
            uncompressed, the rows lie in one shard (or the shards map back to back) and the
            step is positive (the view keeps the mapping alive; writing into it never changes
            the file); otherwise one copy (a negative step is always a copy).

        Raises
        ------
        HookPointNotFoundError
            The hook point is not in the store.
        ArgumentTypeError
            ``key`` is neither a str nor a (str, slice) pair, or ``rows`` is not a slice of
            ints; a TypeError.
        ArgumentValueError
            The slice's step is 0; a ValueError.
        StoreError
            The read is a copy (not a view) of more bytes than 90% of the memory the system
            has available (``MemAvailable``): read it in slices or through ``ActivationDataset``.
            Or another run replaced the store while the rows were read, three reads in a row
            (a ``refresh()`` of another thread that shows another run while this one reads
            makes it read that run's rows, as :meth:`rows` does).
        """
        if isinstance(key, tuple):
            if len(key) != 2 or not isinstance(key[1], slice):
                raise ArgumentTypeError(
                    f"store[...] takes a hook point or (hook point, slice), got {key!r}"
                    + ("; rows are read by a slice: store[hook_point, i:i + 1] for row i, or for rows at other "
                       "positions ActivationDataset(store, hook_points=hook_point)[positions]" if len(key) == 2 else ""))
            hook_point, sl = key
        else:
            hook_point, sl = key, slice(None)
        ends = [("" if v is None else str(v)) for v in (sl.start, sl.stop)] + ([] if sl.step is None else [str(sl.step)])
        shown = f"store[{hook_point!r}" + ("]" if not any(ends) else f", {':'.join(ends)}]")
        return self._of_the_commit_shown(shown, lambda: self._slice_rows(hook_point, sl))

    def _slice_rows(self, hook_point: str, sl: slice) -> torch.Tensor:
        """``store[hook_point, sl]`` of the commit shown when called (:meth:`__getitem__`)."""
        n = self.n_rows(hook_point)
        try:
            start, stop, step = sl.indices(n)
        except TypeError:
            raise ArgumentTypeError(f"store[{hook_point!r}, rows]: rows must be a slice of ints or None, got {sl!r}") from None
        except ValueError:
            raise ArgumentValueError(f"store[{hook_point!r}, rows]: the slice step must not be zero, got {sl!r}; "
                                     "use a step of 1 (or None) for every row") from None
        r = range(start, stop, step)
        if len(r) == 0:
            return self._read_rows(hook_point, 0, 0)
        self._refuse_copy_past_memory(hook_point, r)
        if step == 1:
            return self._read_rows(hook_point, start, stop)
        lo, hi = min(r[0], r[-1]), max(r[0], r[-1]) + 1
        if step > 0 and self._span_is_view(hook_point, lo, hi):
            return self._read_rows(hook_point, lo, hi)[::step]  # a strided view of the mapped rows
        # Otherwise the result is a copy: read the span in bounded blocks and keep only the rows
        # taken (reading the whole span at once would allocate, and keep alive in the result,
        # every row between the first and the last: all of a compressed array for [::1000]).
        meta = self._meta(hook_point)
        block_rows = max(1, _STRIDED_BLOCK_BYTES // max(1, V.row_bytes(meta)))
        asc = r if step > 0 else r[::-1]
        k = abs(step)
        per = max(1, block_rows // k)  # result rows per block read
        out = torch.empty((len(r), *meta["feature_shape"]), dtype=F.torch_dtype(meta["dtype"]))
        for i in range(0, len(asc), per):
            part = asc[i : i + per]
            out[i : i + len(part)] = self._read_rows(hook_point, part[0], part[-1] + 1)[::k]
        return out if step > 0 else out.flip(0)

    def _refuse_copy_past_memory(self, hook_point: str, r: range) -> None:
        """Raise before ``store[...]`` copies rows ``r`` of ``hook_point`` into more memory than
        the system has available (``_COPY_MEMORY_SHARE`` of ``MemAvailable``): such a copy is
        killed by the out-of-memory killer, not refused. A read that is a view copies nothing."""
        nbytes = len(r) * V.row_bytes(self._meta(hook_point))
        if nbytes < _COPY_CHECK_BYTES:  # (small reads skip reading /proc/meminfo)
            return
        available = _available_memory_bytes()
        if available is None or nbytes <= _COPY_MEMORY_SHARE * available:
            return
        lo, hi = min(r[0], r[-1]), max(r[0], r[-1]) + 1
        if r.step > 0 and self._span_is_view(hook_point, lo, hi):
            return
        meta = self._meta(hook_point)
        n = int(meta["n_rows"])
        why, fix = self._why_no_view(meta, lo, hi) if r.step > 0 else ("a negative step is always a copy", "")
        raise StoreError(
            f"store[{hook_point!r}{'' if (r.start, r.stop, r.step) == (0, n, 1) else ', rows'}] would copy "
            f"{len(r)} rows ({nbytes} bytes) into memory, more than the {available} bytes available (MemAvailable): "
            f"{why}. Read it in slices, store[{hook_point!r}, a:b], or through ActivationDataset(store, "
            f"hook_points={hook_point!r}) in batches" + (f"; {fix}" if fix else ""))

    def _why_no_view(self, meta: dict, lo: int, hi: int) -> tuple[str, str]:
        """Why rows ``[lo, hi)`` of the array ``meta`` read as a copy rather than a view (the
        cases :meth:`_span_is_view` and :meth:`_whole_rows` turn down), and what makes a view of
        them ("" when nothing a capture chooses does), for the message of a refused copy."""
        if self._parts:
            return ("its rows are in the rank stores of a multi-rank store not committed yet, read as one copy",
                    "for views of its rows, commit the store first (`activationscope consolidate STORE`)")
        if not isinstance(self._backend, LocalBackend):
            return "the store is not local, so each read decodes a copy", ""
        if meta.get("compression") is not None:
            return ("its array is compressed, so each read decodes a copy",
                    "for views of its rows, capture with store_options={'compression': None}")
        shard_rows = max(1, int(meta["shard_rows"]))
        n_shards = -(-int(meta["n_rows"]) // shard_rows)
        scattered = ("a shard of it does not hold its chunks back to back in the default layout, so its rows are "
                     "decoded chunk by chunk", "")
        if lo // shard_rows == (hi - 1) // shard_rows:  # (one shard: a view unless its chunks are scattered)
            return scattered
        # (in the order _whole_rows tries them: the shard indexes are read last)
        if _native.optional() is None:
            return ("the native extension (activationscope._C), which maps its shards back to back as one view, is "
                    "not built", "for a view of every row, install the package with its native extension")
        if shard_rows * V.row_bytes(meta) % mmap.PAGESIZE:
            return (f"a shard's rows ({shard_rows} of {V.row_bytes(meta)} bytes) are not a whole number of memory "
                    f"pages ({mmap.PAGESIZE} bytes), so its shards cannot be mapped back to back as one view",
                    "for a view of every row, capture with the default shard_rows (or one whose shards are whole "
                    "pages)")
        if not self._whole_fits(n_shards):
            return (f"its {n_shards} shards (of {self._total_shards_now()} in the store) cannot be mapped as one view "
                    f"within the process's budget of {self._budget()} memory mappings (reader._MAP_BUDGET, half of "
                    "vm.max_map_count)",
                    "for a view of every row, capture with fewer, larger shards (store_options={'shard_bytes': ...}) "
                    "or raise vm.max_map_count")
        return scattered

    def _total_shards_now(self) -> int:
        """The shards of every uncompressed array of the store (what :meth:`_whole_fits` counts
        against the budget), counted once per root read."""
        attrs = self._attrs
        total = self._total_shards
        if total is None or total[0] is not attrs:
            n = 0
            for m in (attrs.get("arrays") or {}).values():
                if isinstance(m, dict) and m.get("compression") is None:
                    try:
                        n += -(-int(m["n_rows"]) // max(1, int(m["shard_rows"])))
                    except (KeyError, TypeError, ValueError):
                        pass
            total = self._total_shards = (attrs, n)
        return total[1]

    def _span_is_view(self, hook_point: str, lo: int, hi: int) -> bool:
        """Whether rows ``[lo, hi)`` read as a view of mapped memory (no copy)."""
        if self._parts:
            return False
        meta = self._checked_meta(hook_point)
        if not self._mappable(meta) or V.row_bytes(meta) == 0:
            return False
        shard_rows = int(meta["shard_rows"])
        if lo // shard_rows == (hi - 1) // shard_rows:
            return self._shard_index(meta, lo // shard_rows).contiguous
        return self._whole_rows(meta) is not None

    def array(self, hook_point: str) -> torch.Tensor:
        """Same as ``store[hook_point]``.

        Parameters
        ----------
        hook_point : str
            A stored hook point (or an alias of one).
        """
        return self[hook_point]

    def _mappable(self, meta: dict) -> bool:
        return isinstance(self._backend, LocalBackend) and meta.get("compression") is None

    def segments(self, hook_point: str) -> list[int]:
        """Row boundaries ``[0, ..., n_rows]`` of the units of zero-copy memory.

        One segment ``[0, n_rows]`` when the array's shards are mapped back to back as one
        view (local, uncompressed, the default layout, native extension present, and the
        shards of all the store's arrays fit in its budget of memory mappings: see section
        "Zero-copy reads" of docs/usage/store.md in the source distribution); otherwise one segment per shard. ``rows(hook_point, a, b)`` within one segment is a view;
        across segments one copy.

        Parameters
        ----------
        hook_point : str
            A stored hook point (or an alias of one).
        """
        if self._parts:
            return self._rank_bounds(hook_point, lambda st, hp: (st.segments(hp), True))[0]
        meta = self._meta(hook_point)
        if meta["path"] not in self._checked:
            self._array_crcs(meta)
        n, shard_rows = int(meta["n_rows"]), int(meta["shard_rows"])
        if n > shard_rows and self._mappable(meta) and self._whole_rows(meta) is not None:
            return [0, n]
        return list(range(0, n, shard_rows)) + [n]

    def row_blocks(self, hook_point: str) -> tuple[list[int], bool]:
        """The units a reader should read ``hook_point`` in, and whether they are views.

        Parameters
        ----------
        hook_point : str
            A stored hook point (or an alias of one).

        Returns
        -------
        (bounds, views) : list of int, ``[0, ..., n_rows]``, and bool. ``views`` True: the
            units are :meth:`segments`, and ``rows(a, b)`` within one is a view of mapped
            memory that a reader may keep. False (compressed or non-local arrays): the units
            are chunks, each read is decoded through the store's bounded chunk cache and
            should not be kept.
        """
        if self._parts:
            return self._rank_bounds(hook_point, lambda st, hp: st.row_blocks(hp))
        meta = self._checked_meta(hook_point)
        if self._mappable(meta):
            return self.segments(hook_point), True
        n, step = int(meta["n_rows"]), int(meta["chunk_rows"])
        return list(range(0, n, step)) + [n], False

    def follows_row_table(self, hook_point: str) -> bool:
        """Whether row i of ``hook_point`` is row i of its row table (the array's
        ``follows_row_table`` metadata, store/FORMAT.md; True when absent).

        Parameters
        ----------
        hook_point : str
            A stored hook point (or an alias of one).
        """
        return bool(self._meta(hook_point).get("follows_row_table", True))

    def rows(self, hook_point: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``[start, stop)`` of a hook point (a view within one shard, else one copy).

        Parameters
        ----------
        hook_point : str
        start, stop : int
            Row positions, ``0 <= start <= stop <= n_rows(hook_point)``; Python, numpy or
            0-d integer torch ints (a bool is no position).

        Returns
        -------
        Tensor, (stop - start, *feature_shape), the stored dtype, CPU
            Read-only in effect: writing into a view never changes the store.

        Raises
        ------
        HookPointNotFoundError
            ``hook_point`` is not in the store (a KeyError).
        ArgumentTypeError
            ``start`` or ``stop`` is not an int (a bool, a float, ...); a TypeError.
        RowIndexError
            Not ``0 <= start <= stop <= n_rows``; an IndexError (``start > stop`` says so,
            naming both). A ``refresh()`` of another thread that shows another run of the
            store while this call reads (an overwrite replaced it) makes it read that run's
            rows (rows past them are this error).
        StoreCorruptError
            A chunk or shard of those rows fails its checks.
        StoreError
            Another run replaced the store while the rows were read, three reads in a row.
        """
        return self._of_the_commit_shown(f"rows [{start}, {stop}) of hook point {hook_point!r}",
                                         lambda: self._rows_in_range(hook_point, start, stop))

    def _rows_in_range(self, hook_point: str, start: Any, stop: Any) -> torch.Tensor:
        """:meth:`rows`, of the commit shown when called."""
        n = self.n_rows(hook_point)
        try:
            if any(isinstance(v, (bool, np.bool_)) or (isinstance(v, torch.Tensor) and v.dtype == torch.bool)
                   for v in (start, stop)):
                raise TypeError("a bool is no row position")
            start, stop = operator.index(start), operator.index(stop)
        except TypeError:
            raise ArgumentTypeError(f"rows({hook_point!r}, start, stop): start and stop must be ints, got {start!r}, {stop!r}") from None
        if start > stop:  # (a slice store[hp, start:stop] would read nothing: no fix to offer)
            raise RowIndexError(
                f"rows [{start}, {stop}) of hook point {hook_point!r}: start must not exceed stop, got start={start} > "
                f"stop={stop}; rows(hook_point, start, stop) reads the stop - start rows from start, with "
                f"0 <= start <= stop <= {n}")
        if not (0 <= start <= stop <= n):
            raise RowIndexError(
                f"rows [{start}, {stop}) out of range for hook point {hook_point!r} with {n} rows: start and stop must "
                f"satisfy 0 <= start <= stop <= {n} (positions from 0, none negative); store[{hook_point!r}, "
                f"{start}:{stop}] reads a slice, clipped to the rows there are and counting negative positions from "
                "the end")
        return self._read_rows(hook_point, start, stop)

    def take(self, hook_point: str, rows: Any) -> torch.Tensor:
        """Rows of a hook point at store positions ``rows``, in that order (a shuffled batch).

        Of an array read by decoding chunks (compressed or remote), only the rows asked for
        are copied out of the decoded chunks, each once, straight into the result (never a
        whole chunk per batch): the chunks the rows lie in that the chunk cache does not hold
        are decoded side by side, at most half the cache at a time, and checked as
        :meth:`rows` checks them. Of a memory-mapped array, the rows are copied out of the
        mapped shards.

        Parameters
        ----------
        hook_point : str
        rows : Tensor (rows,) integer, any device but meta; ndarray (rows,) integer; or list,
            tuple or range of int
            Store rows, in ``[0, n_rows)``, in any order, repeats allowed.

        Returns
        -------
        Tensor, (rows, *feature_shape), the stored dtype, CPU
            A new tensor (never a view of the store's memory or of its cache of decoded chunks).

        Raises
        ------
        HookPointNotFoundError
            ``hook_point`` is not in the store (a KeyError).
        ArgumentTypeError
            ``rows`` is not positions: a bool, float or 2-D tensor, a list holding anything
            but ints (a bool included); a TypeError.
        RowIndexError
            A row outside ``[0, n_rows)`` (the first one named); an IndexError. A
            ``refresh()`` of another thread that shows another run of the store while this
            call reads (an overwrite replaced it) makes it read that run's rows (a row past
            them is this error).
        StoreCorruptError
            A chunk or shard of those rows fails its checks (as :meth:`rows`).
        StoreError
            Another run replaced the store while the rows were read, three reads in a row.

        Example
        -------
        >>> store.take("blocks.0.output", [17, 3, 99_000])        # doctest: +SKIP
        """
        return self._of_the_commit_shown(
            f"take({hook_point!r}, rows)",
            lambda: self._take_checked(hook_point, _take_positions(hook_point, rows, self.n_rows(hook_point))))

    def _of_the_commit_shown(self, what: str, read: Callable[[], torch.Tensor]) -> torch.Tensor:
        """``read()`` (rows checked against the commit shown, then read: :meth:`rows`,
        :meth:`take`), again when a ``refresh()`` of another thread showed another commit
        while it read (a run that replaced it: its files, not the ones the rows were checked
        against), twice at most: when it raised, and when it returned while another run was
        shown (rows of both runs, maybe: one shard's file of each). A
        :class:`StoreCorruptError` of the opened run's files is raised as such
        (:meth:`_check_same_store`: a store replaced since is said as such); rows read while
        a third run was shown, a :class:`StoreError` saying the store was replaced."""
        tries = 0
        while True:
            attrs = self._attrs
            try:
                out = read()
            except (StoreCorruptError, RowIndexError) as e:
                tries += 1
                if tries < 3 and self._attrs is not attrs:
                    continue  # again, of the commit shown now
                if isinstance(e, StoreCorruptError):
                    self._check_same_store()  # a store replaced under this reader is not damage
                raise
            now = self._attrs
            if now is attrs or F.run_of(now) == F.run_of(attrs):
                return out  # (a commit of the same run since: the rows read are committed rows of it too)
            tries += 1
            if tries < 3:
                continue  # again, of the run shown now
            was, new = F.run_of(attrs), F.run_of(now)
            raise StoreError(
                f"{what}: store at {str(self._backend)!r} was replaced while they were read, {tries} times (another "
                f"run written in its place, overwrite=True, and shown by a refresh(): run {was[0] or was[1]}, now "
                f"run {new[0] or new[1]}); read them again once no capture overwrites the store")

    def _take_checked(self, hook_point: str, idx: torch.Tensor) -> torch.Tensor:
        """:meth:`take` of checked store rows ``idx`` (int64, (k,), in range)."""
        meta = self._meta(hook_point) if self._parts else self._checked_meta(hook_point)
        feat, dtype = tuple(meta["feature_shape"]), F.torch_dtype(meta["dtype"])
        if idx.numel() == 0 or V.row_bytes(meta) == 0:
            return torch.empty((idx.numel(), *feat), dtype=dtype)
        if self._parts:  # an uncommitted multi-rank store: each rank store's rows from it
            parts = self._parts.get(hook_point, [])
            _take_within(hook_point, idx, max((first + st.n_rows(hook_point) for _, st, first in parts), default=0))
            out = torch.empty((idx.numel(), *feat), dtype=dtype)
            for _, st, first in parts:
                pos = ((idx >= first) & (idx < first + st.n_rows(hook_point))).nonzero().squeeze(1)
                if pos.numel():
                    _put_rows(out, pos, st._take_checked(hook_point, idx[pos] - first))
            return out
        _take_within(hook_point, idx, int(meta["n_rows"]))
        if self._mappable(meta):
            bl = self.segments(hook_point)
            _take_within(hook_point, idx, bl[-1])
            seg = (torch.searchsorted(torch.tensor(bl, dtype=torch.int64), idx, right=True) - 1).unique().tolist()
            if all(self._span_is_view(hook_point, bl[s], bl[s + 1]) for s in seg):
                out = torch.empty((idx.numel(), *feat), dtype=dtype)
                _gather_into(out, idx, [(bl[s], bl[s + 1], self._read_rows(hook_point, bl[s], bl[s + 1])) for s in seg])
                return out
        return self._take_decoded(hook_point, meta, idx)

    def _take_decoded(self, hook_point: str, meta: dict, idx: torch.Tensor) -> torch.Tensor:
        """Rows ``idx`` (int64, (k,), in range, k > 0) of an array read by decoding chunks:
        one new tensor, each row copied once out of its decoded chunk (held, from the chunk
        cache or decoded for this read, until its rows are copied: a chunk evicted meanwhile is
        still read whole). The chunks are taken in store order, at most half the cache at a time
        (at least one): the rows of each such group of chunks are gathered together, in store
        order, and then put in the batch's order."""
        self._forget_parent_decodes()
        feat, dtype = tuple(meta["feature_shape"]), F.torch_dtype(meta["dtype"])
        _row_bytes, chunk_rows, shard_chunks, per_chunk = _layout(meta)
        n = int(meta["n_rows"])
        chunks = torch.unique(idx // chunk_rows).tolist()  # ascending
        # Every shard of the read exists with a valid index, every chunk of it read present
        # and inside its file, before the result is allocated: the last one first (a raised
        # n_rows names a shard that is not there), as a read of a span checks them
        by_shard: dict[int, list[int]] = {}
        for c in chunks:
            by_shard.setdefault(c // shard_chunks, []).append(c)
        shards = sorted(by_shard)
        for k in itertools.chain(shards[-1:], shards[:-1]):
            sidx = self._shard_index(meta, k)
            for c in by_shard[k]:
                sidx.check(c - k * shard_chunks, self._backend)
        if not isinstance(self._backend, LocalBackend):  # object storage: the chunks in as few requests as may be
            self.prefetch(hook_point, [c * chunk_rows for c in chunks])
        out = torch.empty((idx.numel(), *feat), dtype=dtype)
        group = max(1, (self._cache_bytes // 2) // max(1, per_chunk))
        if len(chunks) <= group:  # every chunk of the read at once: its rows gathered in place
            units = [(c * chunk_rows, min(n, (c + 1) * chunk_rows), t)
                     for c, t in zip(chunks, self._decoded_chunks(hook_point, meta, chunks))]
            _gather_into(out, idx, units)
            return out
        # else group after group: each group's rows (a run of the rows in store order) gathered
        # into their place in store order, then the batch put in its order (one more gather)
        order = torch.argsort(idx, stable=True)
        ordered = idx[order]
        in_order = torch.empty_like(out)
        runs = []  # (first, end row of in_order, its rows): each group's
        for g in range(0, len(chunks), group):
            part = chunks[g:g + group]
            units = [(c * chunk_rows, min(n, (c + 1) * chunk_rows), t)
                     for c, t in zip(part, self._decoded_chunks(hook_point, meta, part))]
            a, b = torch.searchsorted(ordered, torch.tensor([units[0][0], units[-1][1]])).tolist()
            _gather_into(in_order[a:b], ordered[a:b], units)
            runs.append((a, b, in_order[a:b]))
            del units  # (the group's chunks let go before the next group's are decoded)
        where = torch.empty_like(order)
        where[order] = torch.arange(order.numel())  # row i of the batch is row where[i] in store order
        # (from each group's rows as a unit of their own: the native gather copies rows of
        # several units on the calling thread; of one, on torch's threads, which a busy core
        # stalls for milliseconds)
        _gather_into(out, where, runs)
        return out

    def _forget_parent_decodes(self) -> None:
        """In a forked child (a DataLoader worker), drop the decode futures the parent had in
        flight: their threads are not in this process, so they never finish here."""
        if self._pid != os.getpid():
            with self._lock:
                self._inflight.clear()
                self._pid = os.getpid()

    def _decoded_chunks(self, hook_point: str, meta: dict, chunks: list[int]) -> list[torch.Tensor]:
        """The decoded chunks ``chunks`` (ascending) of an array read by decoding, the tensors
        the cache holds (never written into): those it holds, and the others decoded side by
        side (one decode per chunk however many readers: :meth:`_chunk_future`), on object
        storage in one request per run of neighbours."""
        mid = id(meta)
        got: dict[int, torch.Tensor] = {}
        with self._lock:
            for c in chunks:
                t = self._cache.get((meta["path"], c, mid))
                if t is not None:
                    self._cache.move_to_end((meta["path"], c, mid))
                    got[c] = t
            missing = [c for c in chunks if c not in got]
            fetch = [c for c in missing if (meta["path"], c, mid) not in self._inflight]
        if missing:
            runs = self._plan_runs(meta, fetch)
            futures = [(c, self._chunk_future(hook_point, meta, c, _Run.future(runs, c))) for c in missing]
            for c, fut in futures:
                got[c] = fut.result()
        return [got[c] for c in chunks]

    def will_read(self, hook_point: str, start: int, stop: int) -> tuple[int, int]:
        """Hint that rows ``[start, stop)`` of a hook point are read next (cold reads).

        For a local uncompressed array, the kernel is asked to start reading those rows'
        pages (``madvise(MADV_WILLNEED)`` on the mapping) before they are touched, and, for a
        reader that moves forward (each hinted read starting at or after the last one, at
        most half a read-ahead past the advised range: sequential batches, also when
        DataLoader workers take turns), the next ``READ_AHEAD_BYTES`` after them (at most
        ``READ_AHEAD_SHARDS`` shards: each shard of an array read per shard is one call), so
        that the disk reads ahead of the consumer instead of one page-fault read-around at a
        time. Costs one ``madvise`` per
        about 8 MiB read when the pages are already cached, and none when the range's pages
        are already in the page cache; such a warm range also takes in the rows after it
        that are warm too, up to ``WARM_WINDOW_FACTOR`` more read-aheads (three ``mincore``
        calls each), so that a sequential reader of a warm store asks a quarter as often.
        Other arrays: nothing.
        ``ActivationDataset`` calls it for contiguous batches.

        A store keeps one read-ahead window per hook point. Readers in several threads that
        each move forward through the same hook point at different places (a training loop
        and an evaluator sharing one opened store) take it from one another: each then gets
        its own rows hinted but no read-ahead after them (their reads return the same rows,
        the cold ones page in one fault at a time). Give each such reader its own
        ``open_store`` (or ``ActivationDataset`` of the path) to keep each one's read-ahead.

        Parameters
        ----------
        hook_point : str
            A stored hook point (or an alias of one).
        start, stop : int
            The rows ``[start, stop)`` to be read; positions outside ``[0, n_rows]`` are clipped
            (a hint raises nothing for them).

        Returns
        -------
        (int, int)
            ``(lo, hi)``: a later hint for rows ``[s, e)`` with ``lo <= s`` and ``e <= hi``
            would do nothing; a caller may skip it.
        """
        if self._parts:
            for _, st, lo, hi in self._rank_spans(hook_point, int(start), int(stop)):
                st.will_read(hook_point, lo, hi)
            return int(start), int(stop)  # (each rank store's own read-ahead is its own)
        advised = self._advised  # (before the metadata: a refresh() meanwhile replaces it)
        meta = self._meta(hook_point)
        hint = self._hints.get(hook_point)
        if hint is None or hint[0] is not meta:  # per array, once (and again after a refresh)
            feat = tuple(meta["feature_shape"])
            row_bytes = (int(np.prod(feat)) if feat else 1) * F.itemsize(meta["dtype"])
            eligible = (_madvise is not None and isinstance(self._backend, LocalBackend)
                        and meta.get("compression") is None and row_bytes > 0)
            ahead_rows = min(READ_AHEAD_BYTES // max(1, row_bytes), READ_AHEAD_SHARDS * int(meta["shard_rows"]))
            hint = (meta, eligible, int(meta["n_rows"]), row_bytes, max(1, ahead_rows))
            self._hints[hook_point] = hint
        _meta, eligible, n, row_bytes, ahead_rows = hint
        if not eligible:
            return (0, sys.maxsize)
        start, stop = max(0, int(start)), min(n, int(stop))
        if stop <= start:
            return (0, 0)
        half = ahead_rows // 2
        adv = advised.get(hook_point)
        if adv is not None and adv[0] <= start and (stop + half <= adv[1] or adv[1] >= n):
            advised[hook_point] = (start, adv[1])  # already advised (the common case: no lock)
            return (start, adv[1] if adv[1] >= n else adv[1] - half)
        with self._lock:
            last_start, until = advised.get(hook_point, (-1, 0))
            forward = last_start <= start <= until + half  # small gaps: workers taking turns
            if forward and (stop + half <= until or until >= n):
                advised[hook_point] = (start, until)
                return (start, until if until >= n else until - half)  # already advised
            lo = max(start, until) if forward else start
            ahead = forward or start == 0  # a reader moving forward: read ahead of it
            hi = min(n, stop + ahead_rows) if ahead else stop
            advised[hook_point] = (start, hi)
        # A hint: a shard it cannot map (missing, damaged, replaced) is not an error here. The
        # read-ahead lies past the rows asked for, which may never be read (a dataset of some
        # rows); the read of rows of such a shard raises, naming it.
        warm = self._advise_quietly(meta, lo, hi, row_bytes, _will_need)
        if warm and ahead and hi < n:
            # A warm store (read before: a later epoch): no hint was needed. When the rows
            # after the window are warm too, they join it, so that a sequential reader comes
            # back here a quarter as often (each visit costs tens of microseconds of Python
            # and mincore calls between batches of its consumer).
            ext = hi
            for _ in range(WARM_WINDOW_FACTOR):  # one read-ahead at a time, while warm
                nxt = min(n, ext + ahead_rows)
                if ext >= n or not self._advise_quietly(meta, ext, nxt, row_bytes, _range_resident):
                    break
                ext = nxt
            if ext > hi:
                with self._lock:
                    if advised.get(hook_point) == (start, hi):
                        advised[hook_point] = (start, ext)
                hi = ext
        return (start, hi if hi >= n else max(stop, hi - half))

    def _advise_quietly(self, meta: dict, lo: int, hi: int, row_bytes: int, advise: Any) -> bool:
        """:meth:`_advise_rows`, False instead of the error of rows that cannot be mapped."""
        try:
            return self._advise_rows(meta, lo, hi, row_bytes, advise)
        except OSError:  # (StoreError and StoreCorruptError among them)
            return False

    def _advise_rows(self, meta: dict, lo: int, hi: int, row_bytes: int, advise: Any) -> bool:
        """``advise(addr, nbytes)`` over the mapped bytes of rows ``[lo, hi)`` (one range, or
        one per shard); True when every call returned True (e.g. :func:`_will_need`: every
        part was warm), False otherwise or when the rows are not mapped back to back."""
        shard_rows = int(meta["shard_rows"])
        whole = None
        if hi - 1 >= shard_rows:
            whole = self._whole_rows(meta)
        if whole is not None:
            return bool(advise(whole.data_ptr() + lo * row_bytes, (hi - lo) * row_bytes))
        s, ok = lo, True
        while s < hi:
            k = s // shard_rows
            e = min(hi, (k + 1) * shard_rows)
            view = self._mapped_rows(meta, k, s - k * shard_rows, e - s)
            if view is None:
                return False
            ok = bool(advise(view.data_ptr(), (e - s) * row_bytes)) and ok
            s = e
        return ok

    def compressed_array(self, hook_point: str) -> tuple[Any, int, torch.dtype] | None:
        """``(zarr array, chunk_rows, torch dtype)`` of an array read by decoding chunks
        (compressed or non-local), or None when it is read zero-copy from memory-mapped shards.
        The zarr array holds bfloat16 as uint16 bit patterns (plain zarr-python access; the
        store's own reads validate each shard first).

        Parameters
        ----------
        hook_point : str
            A stored hook point (or an alias of one).
        """
        if self._parts:
            self._meta(hook_point)  # HookPointNotFoundError for a hook point no rank has
            return None  # an uncommitted multi-rank store: read it with rows() / row_blocks()
        meta = self._checked_meta(hook_point)
        if self._mappable(meta):
            return None
        return self._zarray(meta), int(meta["chunk_rows"]), F.torch_dtype(meta["dtype"])

    def _read_rows(self, hook_point: str, start: int, stop: int, copy: bool = False) -> torch.Tensor:
        try:
            return self._read_rows_checked(hook_point, start, stop, copy)
        except StoreCorruptError:
            self._check_same_store()  # a store replaced under this reader is not damage
            raise

    def _read_rows_checked(self, hook_point: str, start: int, stop: int, copy: bool = False) -> torch.Tensor:
        if self._parts:
            return self._read_rank_rows(hook_point, start, stop, copy)
        meta = self._checked_meta(hook_point)  # once per array: the root's entry against the array's own files
        dtype = F.torch_dtype(meta["dtype"])
        feat = tuple(meta["feature_shape"])
        if stop <= start:
            return torch.empty((0, *feat), dtype=dtype)
        if stop > int(meta["n_rows"]):
            raise RowIndexError(f"rows [{start}, {stop}) out of range for hook point {hook_point!r} with {meta['n_rows']} rows")
        if V.row_bytes(meta) == 0:
            return torch.empty((stop - start, *feat), dtype=dtype)
        shard_rows = int(meta["shard_rows"])
        if self._mappable(meta):
            if start // shard_rows != (stop - 1) // shard_rows:  # spans shards: one mapping of all
                whole = self._whole_rows(meta)
                if whole is not None:
                    out = whole[start:stop]
                    return out.clone() if copy else out
            parts = []
            s = start
            while s < stop:
                k = s // shard_rows
                e = min(stop, (k + 1) * shard_rows)
                view = self._mapped_rows(meta, k, s - k * shard_rows, e - s)
                if view is None:
                    parts = None
                    break
                parts.append(view)
                s = e
            if parts is not None:
                out = parts[0] if len(parts) == 1 else torch.cat(parts)
                return out.clone() if copy and len(parts) == 1 else out
        return self._read_decoded(hook_point, meta, start, stop)

    # ---------------------------------------------------------------- rank stores
    def _rank_spans(self, hook_point: str, start: int, stop: int) -> list[tuple[int, "Store", int, int]]:
        """(rank, rank store, local start, local stop) of the rows [start, stop) of an
        uncommitted multi-rank store (rank 0's committed rows first, then rank 1's, ...)."""
        self._meta(hook_point)  # HookPointNotFoundError for a hook point no rank has
        out = []
        for rank, st, first in self._parts.get(hook_point, []):
            n = st.n_rows(hook_point)
            lo, hi = max(start, first), min(stop, first + n)
            if lo < hi:
                out.append((rank, st, lo - first, hi - first))
        return out

    def _read_rank_rows(self, hook_point: str, start: int, stop: int, copy: bool) -> torch.Tensor:
        meta = self._meta(hook_point)
        n = int(meta["n_rows"])
        if stop <= start:
            return torch.empty((0, *meta["feature_shape"]), dtype=F.torch_dtype(meta["dtype"]))
        if start < 0 or stop > n:
            raise RowIndexError(f"rows [{start}, {stop}) out of range for hook point {hook_point!r} with {n} rows")
        pieces = [st._read_rows(hook_point, lo, hi, copy) for _, st, lo, hi in self._rank_spans(hook_point, start, stop)]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)

    def _rank_bounds(self, hook_point: str, get: Any) -> tuple[list[int], bool]:
        self._meta(hook_point)
        bounds, views = [0], True
        for _, st, first in self._parts.get(hook_point, []):
            b, v = get(st, hook_point) if st.n_rows(hook_point) else ([0], True)
            views = views and v
            bounds += [first + int(x) for x in b[1:]]
        return bounds, views

    @property
    def ranks(self) -> list[int]:
        """The ranks whose rank stores an uncommitted multi-rank store shows (FORMAT.md
        section 10; empty for every other store)."""
        return [r for r, _ in self._ranks]

    # ---------------------------------------------------------------- array check
    def _array_crcs(self, meta: dict) -> _ChunkCrcs:
        """Check an array against its own files before its first read; its chunks' crc32c.

        The root document's ``n_rows`` sizes every read and every buffer of the array, so it
        is checked against what the array's files say first (FORMAT.md section 9 rule 16):
        the array document exists and its ``shape[0]`` is at least ``n_rows`` (it may be
        ahead, never behind), the manifest lists the shard holding the last committed row
        with ``rows_end >= n_rows``, and that shard file exists with a valid index. Every
        other field of the root's entry that sizes or interprets rows (``dtype``,
        ``feature_shape``, ``chunk_rows``, ``shard_rows``, ``compression``) is checked against
        the array document first (rule 17). Once per array (until :meth:`refresh`); an array
        with no committed rows is checked only against a document that exists (its files may
        not exist yet, section 7).

        Returns
        -------
        _ChunkCrcs
            ``{(shard, slot): (offset, nbytes, crc32c)}`` of the committed shards' chunks, from
            the manifest (what decoded reads check each chunk against).

        Raises
        ------
        StoreCorruptError
            Naming the file, the two counts (or values) and the fix.
        """
        path = meta["path"]
        got = self._checked.get(path)
        if got is not None:
            return got
        n = int(meta["n_rows"])
        crcs: Any = _ChunkCrcs({}, -1, 1, self._backend, "")
        doc_key = f"{path}/zarr.json"
        if n == 0:  # no committed rows: the document may not exist yet (section 7); when it does, it agrees
            try:  # (nothing of it is used: the root is checked only when it disagrees)
                self._check_document(meta, self._backend.get(doc_key, max_bytes=V.MAX_JSON_BYTES), doc_key)
            except StoreCorruptError:
                self._check_same_store()  # a document of another run is not damage
                raise
        if n:
            # the files of the opened run: the root checked after they were read (an overwrite meanwhile
            # wrote another run's manifest, whose crc32c its chunks would match)
            with self._reads_of_the_opened_run():
                _rb, chunk_rows, n_chunks, _cb = _layout(meta)
                shard_rows = n_chunks * chunk_rows
                last = (n - 1) // shard_rows
                root = f"the root document zarr.json says {n} rows of array {path!r} are committed (its n_rows)"
                raw = self._backend.get(doc_key, max_bytes=V.MAX_JSON_BYTES)
                if raw is None:
                    raise V.corrupt(self._backend, f"array document {doc_key} is missing, but {root}")
                shape = self._check_document(meta, raw, doc_key)["shape"]
                if shape[0] < n:
                    raise V.corrupt(self._backend, f"array document {doc_key} holds {shape[0]} rows (shape[0]), but "
                                                   f"{root}: the two disagree (the root's count may be behind the "
                                                   "array's, never ahead)")
                man_key = meta["manifest"]
                man = self._backend.get(man_key, max_bytes=V.MAX_JSON_BYTES)
                if man is None:
                    raise V.corrupt(self._backend, f"manifest {man_key} is missing, but {root}")
                shards = V.parse_manifest(V.loads_json(man, store=self._backend, key=man_key), meta,
                                          store=self._backend, key=man_key, check_chunks=False,
                                          fetch=self._read_manifest_segment, hook_point=self._hook_point_of(meta))
                rec = shards.get(last)
                if rec is None:
                    raise V.corrupt(self._backend, f"manifest {man_key} lists no shard {last}, but {root}, which "
                                                   f"needs shards 0..{last} ({shard_rows} rows each)")
                listed = shards.n_listed(last)  # (not one step per shard of the segments: they may claim any number)
                if listed != last + 1:  # every shard of the committed rows is listed (bounds what n_rows can claim)
                    first = next(k for k in range(last + 1) if k not in shards)
                    raise V.corrupt(self._backend, f"manifest {man_key} lists {listed} of the {last + 1} shards that "
                                                   f"{root} needs (first missing: shard {first})")
                rows_end = rec.get("rows_end")
                if isinstance(rows_end, int) and not isinstance(rows_end, bool) and rows_end < n:
                    raise V.corrupt(self._backend, f"manifest {man_key} says shard {last} ends at row {rows_end}, but "
                                                   f"{root}: the two disagree")
                crcs = _ChunkCrcs(shards, last, meta["shard_rows"] // meta["chunk_rows"], self._backend, man_key)
                last_key = self._shard_key(meta, last)
                if self._backend.size(last_key) is None:  # the file holding the last committed row exists
                    raise V.corrupt(self._backend, f"shard {last_key!r} is missing, but {root}")
        with self._lock:
            if self._current(meta):
                self._checked[path] = crcs
        return crcs

    def _read_manifest_segment(self, key: str) -> bytes | None:
        """A manifest segment (FORMAT.md section 5), read when a shard of it is first looked up:
        a file opened lazily, so the root is checked after the read (:meth:`_reads_of_the_opened_run`)."""
        with self._reads_of_the_opened_run():
            return self._backend.get(key, max_bytes=V.MAX_JSON_BYTES)

    def _current(self, meta: dict) -> bool:
        """Whether ``meta`` is an array entry of the commit read last (not one a reader took
        before a ``refresh()``): what is built from it may be cached (call with the lock held,
        the caches' publication and ``refresh()`` being under it)."""
        return id(meta) in self._live

    def _hook_point_of(self, meta: dict) -> str:
        """The hook point whose root entry is ``meta``: that entry, or (an entry of a commit
        read before a ``refresh()`` of another thread replaced it) the one of the same array
        path."""
        arrays = self._attrs.get("arrays") or {}
        hp = self._live.get(id(meta))
        if hp is not None and arrays.get(hp) is meta:  # an entry of the commit read last: no scan
            return hp
        for hp, m in arrays.items():
            if m is meta:
                return hp
        for hp, m in arrays.items():
            if isinstance(m, dict) and m.get("path") == meta["path"]:
                return hp
        return str(meta["path"])

    def _check_document(self, meta: dict, raw: bytes | None, doc_key: str) -> dict:
        """The array document ``raw`` (None: absent), checked against the root's entry ``meta``
        before anything is sized or read from the entry (FORMAT.md section 9 rule 17).

        Raises
        ------
        StoreCorruptError
            Naming the array, both files and both values of every field that disagrees.
        """
        if raw is None:
            return {}
        doc = V.loads_json(raw, store=self._backend, key=doc_key)
        problems = V.array_document_problems(doc, meta, hook_point=self._hook_point_of(meta), doc_key=doc_key)
        if problems:
            raise V.corrupt(self._backend, "; ".join(problems))
        return doc

    def _check_chunk_crc(self, meta: dict, shard: int, slot: int, entry: tuple[int, int], data: Any,
                         where: str, key: str) -> None:
        """Raise :class:`StoreCorruptError` naming the shard file when chunk ``slot`` of ``shard``
        (its encoded bytes ``data``, read at ``entry`` of the shard index) does not match its
        manifest record (FORMAT.md section 9 rule 12)."""
        problem = self._chunk_crc_problem(meta, shard, slot, entry, data, where, key)
        if problem is not None:
            raise V.corrupt(self._backend, problem)

    def _chunk_crc_problem(self, meta: dict, shard: int, slot: int, entry: tuple[int, int], data: Any,
                           where: str, key: str) -> str | None:
        problem = self._chunk_crc_problem_of(meta, shard, slot, entry, data, where, key)
        if problem is not None and self._matches_current_manifest(meta, shard, slot, entry, data):
            return None  # the chunk holding the last committed rows, rewritten by a resume that committed since
        if problem is not None and self._committed_rows_match(meta, shard, slot, data):
            return None  # that chunk rewritten with more rows, its committed rows as committed
        return problem

    def _committed_rows_match(self, meta: dict, shard: int, slot: int, data: Any) -> bool:
        """Whether the chunk holding this store's last committed rows (when they end inside it),
        as ``data`` holds it, has those rows exactly as committed: its committed rows followed
        by zeros, encoded again, are the bytes whose size and crc32c the manifest records.
        A rewrite of that chunk (a resume's, or a running capture's partial shard, FORMAT.md
        section 7) keeps the committed rows and adds rows after them; on object storage, which
        keeps no committed copy, a capture killed between uploading the rewrite and writing
        its manifest leaves only the rewrite. False when they differ, or the encoder does not
        give the bytes the writer gave."""
        row_bytes, chunk_rows, n_chunks, full = _layout(meta)
        n = int(meta["n_rows"])
        if not (n % chunk_rows and (shard * n_chunks + slot + 1) * chunk_rows > n):
            return False
        crcs = self._checked.get(meta["path"])
        rec = (crcs if crcs is not None else self._array_crcs(meta)).get((shard, slot))
        if rec is None:
            return False
        codec = meta.get("compression")
        try:
            buf = np.empty(full, dtype=np.uint8)
            if codec is None:
                if len(data) != full:
                    return False
                buf[:] = np.frombuffer(data, dtype=np.uint8)
            else:
                _decode.decode_into(codec, self._decoder(meta), data, buf, "")
            buf[(n % chunk_rows) * row_bytes:] = 0
            if codec is not None:
                size = F.itemsize(meta["dtype"])
                typed = buf.view(f"u{size}") if size in (1, 2, 4, 8) and full % size == 0 else buf
                encoded = bytes(F.numcodecs_encoder(codec).encode(typed))
            else:
                encoded = buf.tobytes()
        except Exception:  # (undecodable, or no encoder here: not shown to match)
            return False
        return len(encoded) == rec[1] and F.crc32c(encoded) == rec[2]

    def _matches_current_manifest(self, meta: dict, shard: int, slot: int, entry: tuple[int, int], data: Any) -> bool:
        """Whether the chunk holding this store's last committed rows (when they end inside it)
        matches the record the array's manifest has *now*. A resume rewrites that chunk with
        its new rows after the committed ones (which stay byte-identical, FORMAT.md section 7)
        and lists it in the manifest at its commit: a reader opened before then (not
        refreshed) checks it against its newer record instead of calling it damaged."""
        _rb, chunk_rows, n_chunks, _cb = _layout(meta)
        n = int(meta["n_rows"])
        chunk = shard * n_chunks + slot
        if not (n % chunk_rows and (chunk + 1) * chunk_rows > n):
            return False
        man_key = meta["manifest"]
        try:
            raw = self._backend.get(man_key, max_bytes=V.MAX_JSON_BYTES)
            if raw is None:
                return False
            shards = V.parse_manifest(V.loads_json(raw, store=self._backend, key=man_key), meta,
                                      store=self._backend, key=man_key, check_chunks=False)
            rec = _ChunkCrcs(shards, shard, n_chunks, self._backend, man_key).get((shard, slot))
        except StoreCorruptError:
            self._check_same_store()
            return False
        # the manifest of a resume of the opened run, not of another run written in its place, whose
        # chunk would match its own manifest (the root is written first: unchanged now, unchanged then)
        self._check_same_store()
        return rec is not None and rec[1] == entry[1] and F.crc32c(data) == rec[2]

    def _chunk_crc_problem_of(self, meta: dict, shard: int, slot: int, entry: tuple[int, int], data: Any,
                              where: str, key: str) -> str | None:
        crcs = self._checked.get(meta["path"])
        if crcs is None:
            crcs = self._array_crcs(meta)
        rec = crcs.get((shard, slot))
        if rec is None:
            return (f"{where}: shard file {key!r} holds a committed chunk that the manifest {meta['manifest']} does not "
                    "list (its crc32c cannot be checked)")
        if rec[1] != entry[1]:  # (a chunk may move within its shard: its bytes are what count)
            return (f"{where}: the shard index of {key!r} gives the chunk {entry[1]} bytes, the manifest "
                    f"{meta['manifest']} {rec[1]}: {_mismatch_cause(meta, shard * _layout(meta)[2] + slot, self._restorable(meta, shard))}")
        got = F.crc32c(data)
        if got == rec[2]:
            return None
        return (f"{where}: shard file {key!r} bytes {entry[0]}-{entry[0] + entry[1] - 1}: crc32c mismatch "
                f"(manifest {rec[2]:08x}, data {got:08x}): "
                f"{_mismatch_cause(meta, shard * _layout(meta)[2] + slot, self._restorable(meta, shard))}")

    # ---------------------------------------------------------------- shard index
    def _shard_key(self, meta: dict, shard: int) -> str:
        return F.shard_key(meta["path"], shard, len(meta["feature_shape"]))

    def _shard_file(self, meta: dict, shard: int) -> str:
        """The key of the file that holds shard ``shard``'s committed chunks: the shard key, or
        ``<shard key>.committed.tmp`` in a local store whose resume renamed its rewrite of the
        partial last shard over the key but has not yet written (or was killed before writing)
        the manifest that lists it (FORMAT.md section 7): that resume kept the committed file
        under this name, and it is the one of the size the manifest records whose chunk holding
        the last committed row has the crc32c it records (the only committed chunk the rewrite
        can change) while the key's file is not."""
        key = self._shard_key(meta, shard)
        n, shard_rows = int(meta["n_rows"]), int(meta["shard_rows"])
        if not isinstance(self._backend, LocalBackend) or not n % shard_rows or shard != n // shard_rows:
            return key
        kept = key + ".committed.tmp"
        try:
            if self._backend.size(kept) is None:
                return key
            if self._matches_manifest(meta, shard, key) is False and self._matches_manifest(meta, shard, kept):
                return kept
        except StoreError:  # (the key's own checks name what is wrong)
            pass
        return key

    def _restorable(self, meta: dict, shard: int) -> bool:
        """Whether a resume can put back the committed partial last shard ``shard``: a store
        that is not a local folder (a resume rewrites its shards from what it committed), or a
        local one holding the committed copy a resume kept (``<shard key>.committed.tmp``) as
        the manifest records it."""
        if not isinstance(self._backend, LocalBackend):
            return True
        kept = self._shard_key(meta, shard) + ".committed.tmp"
        try:
            return self._backend.size(kept) is not None and bool(self._matches_manifest(meta, shard, kept))
        except StoreError:
            return False

    def _matches_manifest(self, meta: dict, shard: int, key: str) -> bool | None:
        """Whether the file ``key`` is the partial last shard ``shard`` as the manifest records
        it: its size (``file_bytes``) and the crc32c of its chunk holding the last committed row
        (the only committed chunk a resume's rewrite can change); None when the manifest has no
        record of that chunk. Raises StoreError as reading the file does."""
        n, shard_rows = int(meta["n_rows"]), int(meta["shard_rows"])
        chunk_rows = int(meta["chunk_rows"])
        slot = ((n - 1) // chunk_rows) % (shard_rows // chunk_rows)
        crcs = self._array_crcs(meta)
        rec = crcs.get((shard, slot))
        if rec is None:
            return None
        off, nb, crc = rec
        file_bytes = (crcs._shards.get(shard) or {}).get("file_bytes")
        if self._backend.size(key) != file_bytes:
            return False
        data = self._backend.get_range(key, off, nb)
        return data is not None and len(data) == nb and F.crc32c(data) == crc

    def _shard_index(self, meta: dict, shard: int, _key: str | None = None) -> _ShardIndex:
        """Read and check a shard's index before any of its rows is used.

        Checks: the file exists and is a regular file, holds at least the index, and the
        index crc32c matches (else raises). Each chunk holding committed rows must be present
        and lie inside the data part of the file (uncompressed: exactly ``chunk_bytes``
        long); one that is not is recorded in ``bad`` and raises when it is read, so the
        other chunks of the shard stay readable.

        The file read is :meth:`_shard_file`'s (``_key``: that one, not cached first). A
        resume's kept file (``<key>.committed.tmp``) that it removes meanwhile (its commit
        ended) is read at the key instead, as a reader opened then would.

        Raises
        ------
        StoreCorruptError
            Naming the shard file and what is wrong.
        """
        shard_key = self._shard_key(meta, shard)
        if _key is None:
            with self._lock:
                cached = self._indexes.get(shard_key)
                if self._gates_pid != os.getpid():  # a forked child: a gate its parent's thread held
                    self._index_gates, self._gates_pid = {}, os.getpid()  # at the fork is never released
                gate = None if cached is not None else self._index_gates.setdefault(shard_key, threading.Lock())
            if cached is not None:
                return cached
            # one read of a shard's index however many threads want it at once (the decode pool's
            # chunks of one shard): a request, or three, each on object storage
            with gate:
                with self._lock:
                    cached = self._indexes.get(shard_key)
                if cached is not None:
                    return cached
                try:
                    return self._shard_index(meta, shard, self._shard_file(meta, shard))
                finally:
                    with self._lock:
                        if self._index_gates.get(shard_key) is gate:
                            del self._index_gates[shard_key]
        key = _key  # (cached under the shard key: checked once)
        rb, chunk_rows, n_chunks, chunk_bytes = _layout(meta)
        n = int(meta["n_rows"])
        shard_rows = n_chunks * chunk_rows
        hp = meta["path"]
        index_bytes = 16 * n_chunks + 4
        # Locally the root is checked once the index is read (a mapped shard's rows are not checksummed:
        # the index of a shard another run wrote since is refused here). On object storage every chunk
        # read through the index is checked against the opened run's manifest (its size and crc32c), and
        # a read that fails asks the root then (_read_rows, verify): a request per shard here made a read
        # ask for the root document once per shard.
        local = isinstance(self._backend, LocalBackend)
        with self._reads_of_the_opened_run() if local else contextlib.nullcontext():
            # size and index (locally: from one open; on object storage at the size the manifest records)
            got_tail = (self._backend.tail(key, index_bytes) if local
                        else self._backend.tail(key, index_bytes, size_hint=self._recorded_bytes(meta, shard)))
            if got_tail is None and key != shard_key:  # a resume's kept file, removed since (its commit ended)
                key = shard_key
                got_tail = self._backend.tail(key, index_bytes)
            if got_tail is None:
                raise V.corrupt(self._backend, f"shard {key!r} of array {hp!r} is missing; its rows "
                                               f"{shard * shard_rows}.. are committed (n_rows {n})")
        size, raw = got_tail
        if size < index_bytes:
            raise V.corrupt(self._backend, f"shard {key!r} is truncated: {size} bytes, fewer than its "
                                           f"{index_bytes}-byte index")
        if len(raw) != index_bytes:
            raise V.corrupt(self._backend, f"shard {key!r} changed while it was read")
        stored = int.from_bytes(raw[-4:], "little")
        got = F.crc32c(raw[:-4])
        if got != stored:
            try:  # (the index is read at the file's end: a file cut short reads other bytes there)
                recorded = self._recorded_bytes(meta, shard)
            except StoreError:
                recorded = None
            cut = "" if recorded is None or recorded == size else (
                f": it holds {size} bytes, its manifest {meta['manifest']} records {recorded} (file_bytes), so it "
                f"was {'cut short' if size < recorded else 'written over'} after its commit")
            raise V.corrupt(self._backend, f"shard {key!r}: shard index crc32c mismatch (stored {stored:08x}, "
                                           f"computed {got:08x}){cut}")
        data_end = size - index_bytes
        committed = max(0, min(n_chunks, -(-(n - shard * shard_rows) // chunk_rows)))
        compressed = meta.get("compression") is not None
        if (not compressed and not self._verify_reads and committed * chunk_bytes <= data_end
                and n_chunks <= _DENSE_MAX_CHUNKS):
            dense, dense_entries = _dense_index(n_chunks, committed, chunk_bytes)
            if raw[:-4] == dense:  # the layout every uncompressed capture writes: one compare
                out = _ShardIndex(key, size, dense_entries, True, {})
                with self._lock:
                    if self._current(meta):
                        self._indexes[shard_key] = out
                return out
        arr = np.frombuffer(raw, dtype="<u8", count=2 * n_chunks)
        flat = arr.tolist()
        entries = tuple(zip(flat[0::2], flat[1::2]))
        # One vectorised pass over the committed entries (a 1 GiB layer has thousands of
        # chunks: a Python loop per chunk made opening it take tens of ms); messages only for
        # the entries that fail.
        offs, nbs = arr[0 : 2 * committed : 2], arr[1 : 2 * committed : 2]
        missing = (offs == _MISSING) & (nbs == _MISSING)
        # offset + nbytes > data_end without uint64 overflow
        past = ~missing & ((offs > data_end) | (nbs > np.uint64(data_end) - np.minimum(offs, np.uint64(data_end))))
        wrong_size = ~missing & ~past & (nbs != chunk_bytes) if not compressed else np.zeros(committed, bool)
        bad: dict[int, str] = {}
        for j in np.flatnonzero(missing | past | wrong_size).tolist():
            off, nb = entries[j]
            c = shard * n_chunks + j
            where = (f"chunk {c} (rows {c * chunk_rows}-{min(n, (c + 1) * chunk_rows) - 1}, shard {key!r}) of "
                     f"array {hp!r}")
            if missing[j]:
                bad[j] = f"{where} is missing from the shard index although its rows are committed (it would read as fill values)"
            elif past[j]:
                bad[j] = (f"{where}: its index entry (offset {off}, {nb} bytes) points past the end of the chunk data "
                          f"({data_end} bytes)")
            else:
                bad[j] = f"{where}: {nb} bytes, expected chunk_bytes {chunk_bytes} (uncompressed chunk)"
        if self._verify_reads and not compressed:  # opt-in: every mapped chunk's crc32c, once per shard
            # (a resuming writer's read: the chunk holding the last committed row, when it straddles
            # n_rows, is not checked, as on the decoded path: FORMAT.md section 5)
            straddles = self._resume_tail and shard == (n - 1) // shard_rows and n % chunk_rows != 0
            for j in range(committed - 1 if straddles else committed):
                if j not in bad:
                    c = shard * n_chunks + j
                    where = f"chunk {c} (rows {c * chunk_rows}-{min(n, (c + 1) * chunk_rows) - 1}) of array {hp!r}"
                    data = self._backend.get_range(key, *entries[j])
                    if data is None and key != shard_key:  # a resume's kept file, removed since
                        return self._shard_index(meta, shard, shard_key)
                    problem = self._chunk_crc_problem(meta, shard, j, entries[j], data or b"", where, key)
                    if problem is not None:
                        bad[j] = problem
        expected = np.arange(committed, dtype=np.uint64) * np.uint64(chunk_bytes)
        contiguous = not bad and bool((offs == expected).all())
        out = _ShardIndex(key, size, entries, contiguous and not compressed, bad)
        with self._lock:
            if self._current(meta):
                self._indexes[shard_key] = out
        return out

    def _recorded_bytes(self, meta: dict, shard: int) -> int | None:
        """The size of shard ``shard``'s file the manifest records (``file_bytes``), None when
        it records none: a hint for reading its index (``tail``), which the read confirms."""
        rec = self._array_crcs(meta)._shards.get(shard)
        hint = rec.get("file_bytes") if isinstance(rec, dict) else None
        return hint if isinstance(hint, int) and not isinstance(hint, bool) else None

    def _forget_kept(self, meta: dict, shard: int, idx: _ShardIndex) -> bool:
        """When ``idx`` (shard ``shard``'s cached index) is of a resume's kept file
        (``<key>.committed.tmp``, FORMAT.md section 7) that is gone now (the resume's commit
        ended and removed it), forget it (its rows are read at the key from then on) and
        return True; else False (a file missing is then what it says)."""
        key = self._shard_key(meta, shard)
        if idx.key == key or self._backend.size(idx.key) is not None:
            return False
        with self._lock:
            if self._indexes.get(key) is idx:
                del self._indexes[key]
            dropped = self._forget_mapping("shard", idx.key)
        _let_go(dropped)
        return True

    def _check_shard_crcs(self, hook_point: str, shard: int, fix: str = V.FIX) -> None:
        """Check every committed chunk of shard ``shard`` of ``hook_point`` against the crc32c
        of its manifest record (FORMAT.md section 9 rule 12), reading each chunk's stored
        (encoded) bytes once, compressed or not; the shard index is checked first (its own
        crc32c, every committed chunk present and inside the file).

        Raises
        ------
        StoreCorruptError
            Naming the shard file, the chunk, its rows and both crc32c values; ``fix`` ends
            the message of a chunk that does not match.
        """
        meta = self._checked_meta(hook_point)
        self._array_crcs(meta)
        idx = self._shard_index(meta, shard)
        _rb, chunk_rows, n_chunks, _cb = _layout(meta)
        n = int(meta["n_rows"])
        committed = max(0, min(n_chunks, -(-(n - shard * n_chunks * chunk_rows) // chunk_rows)))
        # Object storage: the chunks' bytes in reads of up to _CHECK_READ_BYTES each (one request
        # for a whole default shard) instead of one ranged request (and a size look-up) per chunk.
        local = isinstance(self._backend, LocalBackend)
        window, w0 = b"", 0
        for j in range(committed):
            idx.check(j, self._backend)
            c = shard * n_chunks + j
            where = f"chunk {c} (rows {c * chunk_rows}-{min(n, (c + 1) * chunk_rows) - 1}) of hook point {hook_point!r}"
            off, nb = idx.entries[j]
            if local:
                data = self._backend.get_range(idx.key, off, nb)
            else:
                if not (w0 <= off and off + nb <= w0 + len(window)):
                    data_end = idx.file_bytes - (16 * n_chunks + 4)
                    w0 = off
                    window = self._backend.get_range(idx.key, off, max(nb, min(_CHECK_READ_BYTES, data_end - off))) or b""
                data = window[off - w0 : off - w0 + nb]
            problem = self._chunk_crc_problem(meta, shard, j, idx.entries[j], data or b"", where, idx.key)
            if problem is not None:
                raise V.corrupt(self._backend, problem, fix)

    # ---------------------------------------------------------------- mapped reads
    def _map(self, key: str, nbytes: int, meta: dict | None = None) -> torch.Tensor:
        """A private (copy-on-write) read mapping of the first ``nbytes`` (or more) of a shard,
        uint8; cached (:meth:`_keep_mapping`)."""
        t = self._cached_mapping("shard", key)
        if t is not None and t.numel() >= nbytes:
            return t
        path = str(self._backend.path(key))
        C = _native.optional()
        self._make_room(1)
        with self._reads_of_the_opened_run():  # (the root checked once the file is mapped)
            try:
                if C is not None:  # opens non-blocking and maps regular files only
                    stride = -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
                    t = C.map_files_contiguous([path], stride, nbytes)
                else:
                    opened = open_regular(path, store=self._backend, key=key)
                    if opened is None:
                        raise V.corrupt(self._backend, f"shard {key!r} is missing (committed rows need it)")
                    fd, size = opened
                    with os.fdopen(fd, "rb") as f:
                        if size < nbytes:
                            raise V.corrupt(self._backend, f"shard {key!r} holds {size} bytes, fewer than the "
                                                           f"{nbytes} its committed rows need")
                        t = torch.from_numpy(np.memmap(f, dtype=np.uint8, mode="c", shape=(nbytes,)))
            except StoreError:
                raise
            except (OSError, ValueError, RuntimeError) as e:
                raise (_out_of_mappings(self._backend, f"shard {key!r}", e)
                       or V.corrupt(self._backend, f"shard {key!r} cannot be mapped: {e}")) from None
        dropped: list = []
        with self._lock:
            if meta is None or self._current(meta):
                t, dropped = self._keep_mapping("shard", key, t, 1)
        _let_go(dropped)
        return t

    def _mapped_rows(self, meta: dict, shard: int, local_start: int, n: int) -> torch.Tensor | None:
        """A view of rows of one shard, or None when its chunks are not laid back to back. Of
        the array's shards mapped back to back when the cache holds them (:meth:`_whole_rows`
        of the same rows), so that a file is never mapped twice, else of the shard's mapping."""
        feat = tuple(meta["feature_shape"])
        dtype = F.torch_dtype(meta["dtype"])
        idx = self._shard_index(meta, shard)
        if not idx.contiguous:
            return None
        whole = self._cached_mapping("whole", meta["path"])
        if whole is not None and whole[0] == int(meta["n_rows"]):
            first = shard * int(meta["shard_rows"]) + local_start
            return whole[1][first:first + n]
        rb, chunk_rows, n_chunks, _ = _layout(meta)
        committed = min(int(meta["n_rows"]) - shard * n_chunks * chunk_rows, n_chunks * chunk_rows)
        try:
            flat = self._map(idx.key, committed * rb, meta)
        except StoreCorruptError:
            if not self._forget_kept(meta, shard, idx):
                raise
            return self._mapped_rows(meta, shard, local_start, n)
        return flat[local_start * rb:(local_start + n) * rb].view(dtype).view(n, *feat)

    def _whole_rows(self, meta: dict) -> torch.Tensor | None:
        """Every committed row of a local uncompressed array as ONE zero-copy view.

        The shard files are mapped back to back into one contiguous range of address space
        (``_C.map_files_contiguous``), which works when a shard's data is a whole number of
        pages (the default chunk layout ensures it) and each shard's chunks lie back to back.
        Cached per array and committed row count (it counts one mapping per shard against the
        process's budget, ``_MAP_BUDGET``, and takes the place of the shards' own mappings in
        the cache); None when the layout does not allow it, the native extension is absent,
        or the store has more shards than the budget (:meth:`_whole_fits`: its rows are then
        read per shard).
        """
        n = int(meta["n_rows"])
        cached = self._cached_mapping("whole", meta["path"])
        if cached is not None and cached[0] == n:
            return cached[1]
        C = _native.optional()
        rb = V.row_bytes(meta)
        shard_rows = int(meta["shard_rows"])
        stride = shard_rows * rb
        if C is None or n == 0 or rb == 0 or stride % mmap.PAGESIZE:
            return None
        n_shards = -(-n // shard_rows)
        if not self._whole_fits(n_shards):
            return None
        if not all(self._shard_index(meta, k).contiguous for k in range(n_shards)):
            return None
        keys = [self._shard_index(meta, k).key for k in range(n_shards)]
        paths = [str(self._backend.path(key)) for key in keys]
        self._make_room(n_shards)
        failed: Exception | None = None
        with self._reads_of_the_opened_run():
            try:
                flat = C.map_files_contiguous(paths, stride, n * rb)
            except (OSError, RuntimeError) as e:
                failed = e
        if failed is not None:
            if self._forget_kept(meta, n_shards - 1, self._shard_index(meta, n_shards - 1)):
                return self._whole_rows(meta)  # (the kept file of the last shard, gone: at its key)
            raise (_out_of_mappings(self._backend, f"the shards of array {meta['path']!r}", failed)
                   or V.corrupt(self._backend, f"the shards of array {meta['path']!r} cannot be mapped: {failed}")) from None
        view = flat.view(F.torch_dtype(meta["dtype"])).view(n, *meta["feature_shape"])
        dropped: list = []
        with self._lock:
            if self._current(meta):
                (_, view), dropped = self._keep_mapping("whole", meta["path"], (n, view), n_shards, keys)
        _let_go(dropped)
        return view

    def _whole_fits(self, n_shards: int) -> bool:
        """Whether an array of ``n_shards`` shards may be mapped back to back as one view:
        when the shards of every uncompressed array of the store together fit in
        :meth:`_budget`. A store of more is read per shard: a view of some rows then holds
        the mapping of their shard only, not of every shard of the array, so that a batch of
        a dataset of every hook point (a view of each) holds one mapping per hook point, and
        the cache holds the most recently used shards, not a few whole arrays."""
        budget = self._budget()
        return n_shards <= budget and self._total_shards_now() <= budget

    def _budget(self) -> int:
        """The most mappings the caches of all the process's open stores hold together
        (``_MAP_BUDGET``, else :func:`_default_map_budget` as it was when the process first
        asked)."""
        if _MAP_BUDGET is not None:
            return max(1, int(_MAP_BUDGET))
        if _MAPPINGS.default_budget is None:
            _MAPPINGS.default_budget = _default_map_budget()
        return _MAPPINGS.default_budget

    def _cached_mapping(self, kind: str, key: str) -> Any:
        """The cached mapping of ``kind`` ("shard": a shard's, ``_maps``; "whole": an array's
        shards back to back, ``_whole``) at ``key``, marked as the most recently used, or None."""
        with _MAPPINGS.lock:
            value = (self._maps if kind == "shard" else self._whole).get(key)
            slot = (self._map_token, kind, key)
            if value is not None and slot in _MAPPINGS.lru:
                _MAPPINGS.lru.move_to_end(slot)
        return value

    def _keep_mapping(self, kind: str, key: str, value: Any, n_maps: int, covers: Sequence[str] = ()) -> tuple:
        """Cache ``value`` (a shard's mapping, ``kind`` "shard", in ``_maps``; an array's
        shards mapped back to back, "whole", in ``_whole``) as ``n_maps`` of the process's
        mappings, and drop the least recently used others, of any store, while the caches
        hold more than :meth:`_budget` (never the one just kept). A mapping of the same file
        that another thread kept meanwhile, at least as long, is kept instead (``value`` is
        then let go of: a file is mapped once), and marked as the most recently used. ``covers``: the shard keys a "whole" mapping
        maps, whose own mappings are dropped (they map the same files once more).

        Returns ``(what to use, dropped)``: ``dropped`` holds ``(store, mapping)`` pairs the
        caller lets go of with :func:`_let_go` once every lock is released (a view of one
        keeps its mapping alive; the mapping is unmapped with the last reference). Call with
        this store's lock held."""
        M = _MAPPINGS
        cache = self._maps if kind == "shard" else self._whole
        dropped: list = []
        with M.lock:
            M.purge()
            old = cache.get(key)
            if old is not None:
                if (old.numel() >= value.numel()) if kind == "shard" else (old[0] == value[0]):
                    if (self._map_token, kind, key) in M.lru:  # (used now: not the next dropped)
                        M.lru.move_to_end((self._map_token, kind, key))
                    return old, dropped
                dropped.append((self, old))
            cache[key] = value
            slot = (kind, key)
            n_old = self._mapped.pop(slot, 0)
            M.lru.pop((self._map_token, kind, key), None)
            self._mapped[slot] = n_maps
            self._n_mapped += n_maps - n_old
            M.lru[(self._map_token, kind, key)] = n_maps
            M.n += n_maps - n_old
            for shard_key in covers:
                dropped += self._forget_locked("shard", shard_key)
            dropped += self._drop_least_recent(0, keep=(self._map_token, kind, key))
        return value, dropped

    def _drop_least_recent(self, n_new: int, keep: tuple | None = None) -> list:
        """Drop the least recently used cached mappings of the process's stores, but ``keep``,
        until they and ``n_new`` more fit in :meth:`_budget`; returns ``(store, mapping)``
        pairs of what was dropped (see :meth:`_keep_mapping`). Call with ``_MAPPINGS.lock``
        held."""
        M = _MAPPINGS
        M.purge()
        budget = self._budget()
        dropped = []
        while len(M.lru) > (keep is not None) and M.n + n_new > budget:
            slot, n_old = M.lru.popitem(last=False)
            if slot == keep:  # (never: it was used last; kept all the same)
                M.lru[slot] = n_old
                continue
            M.n -= n_old
            ref = M.stores.get(slot[0])
            st = ref() if ref is not None else None
            if st is None:  # (collected: its mappings went with it)
                continue
            _, kind, key = slot
            st._n_mapped -= st._mapped.pop((kind, key), 0)
            value = (st._maps if kind == "shard" else st._whole).pop(key, None)
            if value is not None:
                dropped.append((st, value))
        return dropped

    def _make_room(self, n_maps: int) -> None:
        """Before ``n_maps`` mappings are made: drop the least recently used cached ones (of
        any store of the process) until they fit in :meth:`_budget` with them (the caches
        never hold more than the budget, also while a new mapping is made)."""
        with _MAPPINGS.lock:
            dropped = self._drop_least_recent(n_maps)
        _let_go(dropped)

    def _forget_locked(self, kind: str, key: str) -> list:
        """Drop one cached mapping; ``(store, mapping)`` pairs of what was dropped (see
        :meth:`_keep_mapping`). Call with ``_MAPPINGS.lock`` held."""
        _MAPPINGS.n -= _MAPPINGS.lru.pop((self._map_token, kind, key), 0)
        self._n_mapped -= self._mapped.pop((kind, key), 0)
        value = (self._maps if kind == "shard" else self._whole).pop(key, None)
        return [] if value is None else [(self, value)]

    def _forget_mapping(self, kind: str, key: str) -> list:
        """Drop one cached mapping; what was dropped, for :func:`_let_go` (call it without
        any lock held)."""
        with _MAPPINGS.lock:
            return self._forget_locked(kind, key)

    def _clear_mappings(self) -> list:
        """Drop every cached mapping of this store; what was dropped, for :func:`_let_go`
        (call it without any lock held)."""
        with _MAPPINGS.lock:
            dropped = []
            for kind, key in list(self._mapped):
                dropped += self._forget_locked(kind, key)
            dropped += [(self, v) for v in itertools.chain(self._maps.values(), self._whole.values())]
            self._maps.clear()
            self._whole.clear()
            self._mapped.clear()
            self._n_mapped = 0
        return dropped

    def on_unmap(self, callback: Any) -> None:
        """Have ``callback()`` (no arguments) called whenever this store drops mappings from
        its cache: to stay within the process's budget of memory mappings
        (``vm.max_map_count``, shared by every open store; see section "Zero-copy reads" of
        docs/usage/store.md in the source distribution), when a
        mapping is replaced by a longer one of the same file (rows committed since) or by
        the array's shards mapped back to back, when :meth:`refresh` finds another run in
        the store's place, after :meth:`verify`, or on :meth:`close`.

        A reader that keeps views of the store's rows between reads (a dataset's views of
        whole shards) drops them then, so that the mappings behind them are released too; it
        reads them again from the store when it needs them. Called in the thread whose read
        made the store drop them (for the budget, also a read of another store), without any
        store's lock held. A bound method is held weakly (it does not keep its object alive);
        any other callable strongly.

        Parameters
        ----------
        callback : callable
            Called as ``callback()``; its return value is ignored.
        """
        ref: Any = weakref.WeakMethod(callback) if hasattr(callback, "__self__") else (lambda: callback)
        with self._lock:
            self._unmap_listeners.append(ref)
            self._unmap_listeners[:] = [r for r in self._unmap_listeners if r() is not None]

    def _said_unmapped(self) -> None:
        """Call the :meth:`on_unmap` callbacks (without the lock held)."""
        for ref in list(self._unmap_listeners):
            callback = ref()
            if callback is not None:
                callback()

    # ---------------------------------------------------------------- decoded reads
    def _zarray(self, meta: dict) -> Any:
        import zarr

        path = meta["path"]
        arr = self._zarrays.get(path)
        if arr is None:
            from .._safeio import exit_safe_zarr

            exit_safe_zarr()
            try:
                # (format 3 named: zarr looks for no format 2 documents, a request each on object storage)
                arr = zarr.open_array(self._backend.zarr_store(read_only=True), path=path, mode="r", zarr_format=3)
            except StoreError:  # the document is not a regular file, or too large (named)
                raise
            except Exception as e:  # zarr raises many classes for a damaged document
                raise V.corrupt(self._backend, f"array document {path}/zarr.json does not open with zarr "
                                               f"({type(e).__name__}: {e})") from None
            with self._lock:
                if self._current(meta):
                    self._zarrays[path] = arr
        return arr

    def _decodes_locally(self, meta: dict) -> bool:
        comp = meta.get("compression")
        return (isinstance(self._backend, LocalBackend) and isinstance(comp, dict)
                and comp.get("name") in ("zstd", "blosc"))

    def _decode_chunk(self, hook_point: str, meta: dict, c: int, out: np.ndarray | None = None,
                      run: Any = None) -> torch.Tensor | None:
        """Decode chunk ``c`` of an array read by decoding (runs on the decode pool).

        Its place comes from the checked shard index (:meth:`_shard_index`); the decoded size
        must be exactly the chunk's (from the codec's frame header, before decoding). Into
        ``out`` (uint8, exactly the chunk's committed bytes) when given (returns None), else
        into a new tensor ``(rows of the chunk, *feature_shape)``. ``run``: a future of
        :meth:`_read_run` whose result may hold the chunk's stored bytes (read with its
        neighbours); they are taken when the index still places the chunk where the run read
        it, and checked as a read of the chunk alone is.
        """
        feat = tuple(meta["feature_shape"])
        row_bytes, chunk_rows, shard_chunks, full = _layout(meta)
        n = int(meta["n_rows"])
        shard, j = divmod(c, shard_chunks)
        lo, hi = c * chunk_rows, min(n, (c + 1) * chunk_rows)
        tail = hi == n and n % chunk_rows != 0  # the chunk holding the last committed rows
        for attempt in range(2):
            idx = self._shard_index(meta, shard)
            idx.check(j, self._backend)
            off, nbytes = idx.entries[j]
            where = f"hook point {hook_point!r}: chunk {c} (rows {lo}-{hi - 1}, shard {idx.key})"
            self._check_same_store(per_chunk=True)
            try:
                got = run.result().get(c) if run is not None and attempt == 0 else None
                if got is not None and got[0] == idx.key and got[1] == (off, nbytes):
                    data = got[2]
                else:
                    data = self._backend.get_range(idx.key, off, nbytes)
                if data is None or len(data) != nbytes:
                    raise V.corrupt(self._backend,
                                    f"{where}: read {len(data or b'')} of its {nbytes} bytes (the file shrank)")
                if not (self._resume_tail and tail):
                    self._check_chunk_crc(meta, shard, j, (off, nbytes), data, where, idx.key)
                break
            except StoreCorruptError:
                if attempt or not (tail or self._forget_kept(meta, shard, idx)):
                    raise
                # a resume may have rewritten that chunk's shard (and listed it in the manifest)
                # since this reader read its index: read the index again, once
                with self._lock:
                    self._indexes.pop(self._shard_key(meta, shard), None)
        codec = meta.get("compression")
        buf = out if out is not None and out.nbytes == full else np.empty(full, dtype=np.uint8)
        if codec is None:
            buf[:] = np.frombuffer(data, dtype=np.uint8)
        else:
            _decode.decode_into(codec, self._decoder(meta), data, buf, where)
        if out is not None:
            if buf is not out:
                out[:] = buf[: out.nbytes]
            return None
        if row_bytes == 0:  # (a feature shape with a 0 dimension: a 0-byte buffer does not view as the dtype)
            return torch.empty((hi - lo, *feat), dtype=F.torch_dtype(meta["dtype"]))
        t = torch.from_numpy(buf[: (hi - lo) * row_bytes]).view(F.torch_dtype(meta["dtype"]))
        return t.view(hi - lo, *feat)

    def _decoder(self, meta: dict) -> Any:
        key = ("decoder", meta["path"])
        dec = self._zarrays.get(key)
        if dec is None:
            dec = _decode.decoder(meta["compression"])
            self._zarrays[key] = dec
        return dec

    def _cache_put(self, key: tuple, t: torch.Tensor, meta: dict) -> None:
        with self._lock:
            self._inflight.pop(key, None)
            if key in self._cache or not self._current(meta):  # (a chunk of a commit before a refresh: not kept)
                return
            self._cache[key] = t
            self._cached += t.nbytes
            while self._cached > self._cache_bytes and len(self._cache) > 1:
                _, old = self._cache.popitem(last=False)
                self._cached -= old.nbytes

    def _chunk_future(self, hook_point: str, meta: dict, c: int, run: Any = None) -> Any:
        """A future of decoded chunk ``c`` (cached; one decode per chunk however many readers of
        the same commit: a chunk that a commit read since (``refresh()``) may have rewritten
        with more rows is decoded again for it). ``run``: as :meth:`_decode_chunk`'s."""
        key = (meta["path"], c, id(meta))  # (an alias's chunks are its hook point's: the array's path)
        with self._lock:
            fut = self._inflight.get(key)
            if fut is not None:
                return fut

            def work() -> torch.Tensor:
                try:
                    t = self._decode_chunk(hook_point, meta, c, run=run)
                except BaseException:
                    with self._lock:
                        self._inflight.pop(key, None)
                    raise
                self._cache_put(key, t, meta)
                return t

            fut = _decode.submit(work)
            self._inflight[key] = fut
            return fut

    def _read_run(self, meta: dict, shard: int, slots: list[int]) -> dict[int, tuple[str, tuple[int, int], bytes]]:
        """The stored bytes of chunks ``slots`` of shard ``shard`` (neighbours, back to back in
        its file) in one ranged read: chunk number -> (shard key, (offset, nbytes), bytes).
        Empty when the index no longer places them back to back or the read comes back short:
        each chunk is then read on its own, which raises what is wrong."""
        idx = self._shard_index(meta, shard)
        entries = [idx.entries[j] for j in slots]
        off0 = entries[0][0]
        total = sum(nb for _, nb in entries)
        if any(j in idx.bad for j in slots) or any(
                entries[i + 1][0] != entries[i][0] + entries[i][1] for i in range(len(entries) - 1)):
            return {}
        data = self._backend.get_range(idx.key, off0, total)
        if data is None or len(data) != total:
            return {}
        n_chunks = _layout(meta)[2]
        out = {}
        view = memoryview(data)
        for j, (off, nb) in zip(slots, entries):
            out[shard * n_chunks + j] = (idx.key, (off, nb), bytes(view[off - off0 : off - off0 + nb]))
        return out

    def _plan_runs(self, meta: dict, chunks: list[int], gap_bytes: int = 0) -> dict[int, "_Run"]:
        """On object storage: chunk -> its :class:`_Run` for each chunk of ``chunks``
        (ascending) that lies back to back with a neighbour of the list in the same shard, at
        most ``_RUN_READ_BYTES`` a run: a sequential read of a shard makes a few requests, not
        one per chunk. With ``gap_bytes``, two chunks of the list in a shard with committed
        chunks of at most that many bytes between them are read in one run with those chunks
        (planned too: the caller decodes them, their bytes being read anyway). Elsewhere (a
        local folder: each chunk is a pread) none."""
        if isinstance(self._backend, LocalBackend) or len(chunks) < 2:
            return {}
        n_chunks = _layout(meta)[2]
        runs: list[tuple[int, list[int]]] = []
        for c in chunks:
            shard, j = divmod(c, n_chunks)
            try:
                idx = self._shard_index(meta, shard)
            except StoreError:  # (a shard read ahead: its chunk's own read raises it, if it is read)
                continue
            if j >= len(idx.entries) or j in idx.bad:
                continue
            if runs and runs[-1][0] == shard and j > runs[-1][1][-1]:
                slots = runs[-1][1]
                added = list(range(slots[-1] + 1, j + 1))
                gap = added[:-1]
                if (not gap or gap_bytes > 0) and not any(i in idx.bad for i in gap):
                    entries = [idx.entries[i] for i in (slots[-1], *added)]
                    back_to_back = all(entries[t + 1][0] == entries[t][0] + entries[t][1]
                                       for t in range(len(entries) - 1))
                    size = sum(idx.entries[i][1] for i in slots) + sum(nb for _, nb in entries[1:])
                    if back_to_back and sum(nb for _, nb in entries[1:-1]) <= gap_bytes and size <= _RUN_READ_BYTES:
                        slots.extend(added)
                        continue
            runs.append((shard, [j]))
        planned: dict[int, _Run] = {}
        for shard, slots in runs:
            if len(slots) > 1:
                run = _Run(functools.partial(self._read_run, meta, shard, slots))
                for j in slots:
                    planned[shard * n_chunks + j] = run
        return planned

    def prefetch(self, hook_point: str, rows: Iterable[int]) -> None:
        """Hint that store rows ``rows`` (any order) of ``hook_point`` are read next, as a
        shuffled batch's are: on object storage the chunks holding them that are not cached are
        asked for at once, side by side, those of a shard in one ranged request (also across
        up to ``_RUN_GAP_BYTES`` of other chunks between them, decoded and cached too: the
        batches after it read neighbouring rows; an array of at most a quarter of the cache
        has the whole shard of each such chunk read so), and decoded into the chunk cache, for
        the reads that follow. At most half the cache is asked for at a time. For a local
        compressed array the chunks holding them that are not cached are decoded side by
        side (those only: no shard around them), and the reads of them that follow are not
        taken for a sequential reader's (whose next chunks would be decoded ahead: a batch
        read chunk after chunk in store order looks like one, and what it decoded ahead
        evicted the chunks of the batches after it). Elsewhere (a local uncompressed array:
        a read is a pread or a mapped view) nothing.

        Parameters
        ----------
        hook_point : str
        rows : iterable of int
            Store rows, in ``[0, n_rows)`` (others are left to the read, which raises).

        Example
        -------
        >>> store.prefetch("blocks.0.output", batch_rows)          # doctest: +SKIP
        >>> x = torch.stack([store.rows("blocks.0.output", r, r + 1)[0] for r in batch_rows])  # doctest: +SKIP
        """
        if self._parts:
            return
        meta = self._checked_meta(hook_point)
        local = isinstance(self._backend, LocalBackend)
        if local and self._mappable(meta):
            return
        chunk_rows, n = int(meta["chunk_rows"]), int(meta["n_rows"])
        per_chunk = chunk_rows * V.row_bytes(meta)
        if per_chunk <= 0 or n == 0:
            return
        self._forget_parent_decodes()
        wanted = sorted({int(r) // chunk_rows for r in rows if 0 <= int(r) < n})
        if not local and n * V.row_bytes(meta) <= self._cache_bytes // 4:  # an array that fits in the cache:
            # each whole shard (its other rows are read by the batches that follow), as a read of one row does
            shard_chunks, last = int(meta["shard_rows"]) // chunk_rows, (n - 1) // chunk_rows
            wanted = sorted({x for k in {c // shard_chunks for c in wanted}
                             for x in range(k * shard_chunks, min((k + 1) * shard_chunks - 1, last) + 1)})
        budget = max(0, (self._cache_bytes // 2) // per_chunk)
        mid = id(meta)
        with self._lock:
            self._prefetched[hook_point] = frozenset(wanted)
            wanted = [c for c in wanted if (meta["path"], c, mid) not in self._cache
                      and (meta["path"], c, mid) not in self._inflight][:budget]
        if not wanted:
            return
        if local:  # (a read of a chunk is a pread: the cost is its decoding, of the chunks asked for only)
            runs = self._plan_runs(meta, wanted)
            for c in wanted:
                self._chunk_future(hook_point, meta, c, _Run.future(runs, c))
            return
        runs = self._plan_runs(meta, wanted, gap_bytes=_RUN_GAP_BYTES)
        extra = sorted(set(runs) - set(wanted))
        if len(wanted) + len(extra) > budget:  # (the chunks between rows asked for only while they fit)
            runs = self._plan_runs(meta, wanted)
            extra = []
        with self._lock:
            self._prefetched[hook_point] = self._prefetched.get(hook_point, frozenset()) | set(extra)
            # (a chunk between them that is cached or on its way already: its bytes come with the
            # run, but it is not decoded again)
            extra = [c for c in extra if (meta["path"], c, mid) not in self._cache
                     and (meta["path"], c, mid) not in self._inflight]
        for c in sorted([*wanted, *extra]):
            self._chunk_future(hook_point, meta, c, _Run.future(runs, c))

    def _read_decoded(self, hook_point: str, meta: dict, start: int, stop: int) -> torch.Tensor:
        """Rows ``[start, stop)`` of a local compressed array: one new tensor.

        Chunks decode on the decode pool side by side; a read that starts where the last one
        of this hook point stopped (a sequential reader) also starts decoding the next chunks.
        Reads larger than half the cache decode straight into the result, without caching.
        """
        self._forget_parent_decodes()
        dtype = F.torch_dtype(meta["dtype"])
        feat = tuple(meta["feature_shape"])
        chunk_rows, n = int(meta["chunk_rows"]), int(meta["n_rows"])
        row_bytes = (int(np.prod(feat)) if feat else 1) * F.itemsize(meta["dtype"])
        if row_bytes == 0:
            return torch.empty((stop - start, *feat), dtype=dtype)
        # Every shard of the read exists with a valid index, every chunk of it present and
        # inside its file, before the result (sized from the metadata) is allocated: the last
        # one first (a raised n_rows names a shard that is not there).
        shard_rows = int(meta["shard_rows"])
        first, last = start // shard_rows, (stop - 1) // shard_rows
        for k in itertools.chain((last,), range(first, last)):
            idx = self._shard_index(meta, k)
            for j in sorted(idx.bad):
                row0 = k * shard_rows + j * chunk_rows
                if row0 < stop and row0 + chunk_rows > start:
                    idx.check(j, self._backend)
        out = torch.empty((stop - start, *feat), dtype=dtype)
        flat = out.view(-1).view(torch.uint8).numpy()
        c0, c1 = start // chunk_rows, (stop - 1) // chunk_rows
        big = (c1 - c0 + 1) * chunk_rows * row_bytes > self._cache_bytes // 2
        mid = id(meta)  # (the cache's keys: chunks as this commit has them)
        todo = []  # (chunk, first row, end row, destination) of the chunks not cached
        for c in range(c0, c1 + 1):
            lo, hi = max(start, c * chunk_rows), min(stop, (c + 1) * chunk_rows)
            dst = flat[(lo - start) * row_bytes:(hi - start) * row_bytes]
            with self._lock:
                t = self._cache.get((meta["path"], c, mid))
                if t is not None:
                    self._cache.move_to_end((meta["path"], c, mid))
            if t is not None:
                dst[:] = t.view(-1).view(torch.uint8).numpy()[(lo - c * chunk_rows) * row_bytes:(hi - c * chunk_rows) * row_bytes]
            else:
                todo.append((c, lo, hi, dst))
        # a sequential reader: decode the chunks after this read while it is consumed (on object
        # storage, in runs read together, asked for when half the window is left)
        with self._lock:  # (a shuffled batch's chunks read in turn after its prefetch() are not a sequential read)
            sequential = self._next_start.get(hook_point, 0) == start and c0 not in self._prefetched.get(hook_point, ())
            self._next_start[hook_point] = stop
        remote = not isinstance(self._backend, LocalBackend)
        ahead_chunks: list[int] = []
        if sequential and not big:
            per_chunk = max(1, chunk_rows * row_bytes)
            ahead = max(1, (self._cache_bytes // 4) // per_chunk)
            ahead = min(ahead, max(_decode.n_decode_threads(), _RUN_READ_BYTES // per_chunk) if remote
                        else _decode.n_decode_threads())
            last = (n - 1) // chunk_rows
            if remote:  # (within the shard being read: the next one's index is read when a read gets there)
                shard_chunks = int(meta["shard_rows"]) // chunk_rows
                last = min(last, (c1 // shard_chunks + 1) * shard_chunks - 1)
            with self._lock:
                ahead_chunks = [c for c in range(c1 + 1, min(last, c1 + ahead) + 1)
                                if (meta["path"], c, mid) not in self._cache and (meta["path"], c, mid) not in self._inflight]
            if remote and ahead_chunks and c1 + 1 not in ahead_chunks and len(ahead_chunks) < max(1, ahead // 2):
                ahead_chunks = []  # (more than half the window is on its way: the rest with the next run)
        elif remote and todo and not big and n * row_bytes <= self._cache_bytes // 4:
            # a read elsewhere (a shuffled reader's) of an array that fits in the cache: the chunks
            # around the one it misses, in its shard, come in the same request, cached for the
            # reads of their rows that follow (one request per run of the shard, not per chunk)
            shard_chunks = int(meta["shard_rows"]) // chunk_rows
            window = max(1, _RUN_READ_BYTES // max(1, chunk_rows * row_bytes))
            c = todo[0][0]
            first_c = (c // shard_chunks) * shard_chunks
            lo_c = max(first_c, c - window // 2)
            hi_c = min(first_c + shard_chunks - 1, (n - 1) // chunk_rows, lo_c + window - 1)
            with self._lock:
                ahead_chunks = [x for x in range(lo_c, hi_c + 1) if x not in {t[0] for t in todo}
                                and (meta["path"], x, mid) not in self._cache and (meta["path"], x, mid) not in self._inflight]
        with self._lock:
            fetch = sorted({c for c, *_ in todo if (meta["path"], c, mid) not in self._inflight} | set(ahead_chunks))
        runs = self._plan_runs(meta, fetch)
        waits = []
        for c, lo, hi, dst in todo:
            if big and lo == c * chunk_rows and (hi == (c + 1) * chunk_rows or hi == n):
                waits.append((None, _decode.submit(self._decode_chunk, hook_point, meta, c, dst, _Run.future(runs, c)), None))
            else:
                waits.append((c, self._chunk_future(hook_point, meta, c, _Run.future(runs, c)), (lo, hi, dst)))
        for c in ahead_chunks:
            self._chunk_future(hook_point, meta, c, _Run.future(runs, c))
        for c, fut, part in waits:
            t = fut.result()
            if part is not None:
                lo, hi, dst = part
                dst[:] = t.view(-1).view(torch.uint8).numpy()[(lo - c * chunk_rows) * row_bytes:(hi - c * chunk_rows) * row_bytes]
        return out

    # ------------------------------------------------------------------ small files
    def _crc_problem(self, data: bytes, expected: int | None, where: str, *, parquet: bool = False) -> str | None:
        """A problem line when ``data`` does not have the recorded crc32c (None: not recorded);
        for a Parquet file (``parquet``) saying too when it does not end as Parquet files end
        (cut short or written over)."""
        if expected is None:
            return None
        got = F.crc32c(data)
        if got != int(expected):
            cut = ("" if not parquet or bytes(data[-4:]) == b"PAR1" else
                   f": its {len(data)} bytes do not end with Parquet's magic 'PAR1', so it was cut short or written "
                   "over after its commit")
            return f"{where}: crc32c mismatch (metadata {int(expected):08x}, data {got:08x}){cut}"
        return None

    def _check_crc(self, data: bytes, expected: int | None, where: str, *, parquet: bool = False) -> None:
        problem = self._crc_problem(data, expected, where, parquet=parquet)
        if problem is not None:
            raise V.corrupt(self._backend, problem)

    def _file_crc(self, key: str, size: int | None = None) -> tuple[int, int] | None:
        """``(bytes, crc32c)`` of the regular file ``key``, None when absent. Read in pieces
        of 16 MiB (``_CRC_PIECE_BYTES``; ranged reads on object storage), so memory stays
        bounded whatever its size; with ``size``, one that holds another number of bytes is
        not read (None). Raises StoreCorruptError as ``get`` (not a regular file, outside the
        store, larger than 4 GiB)."""
        fd = None
        if isinstance(self._backend, LocalBackend):
            opened = self._backend._open_regular(key)
            if opened is None:
                return None
            fd, n = opened
            read = lambda at, k: os.pread(fd, k, at)  # noqa: E731
        else:
            n = self._backend.size(key)
            if n is None:
                return None
            read = lambda at, k: self._backend.get_range(key, at, k)  # noqa: E731
        try:
            if size is not None and n != size:
                return None
            if n > V.MAX_FILE_BYTES:
                raise V.corrupt(self._backend, f"{key!r} holds {n} bytes, more than the {V.MAX_FILE_BYTES} such a "
                                               "file may hold")
            crc = at = 0
            while at < n:
                piece = read(at, min(n - at, _CRC_PIECE_BYTES))
                if piece is None and at == 0:  # (an object removed since its size was read)
                    return None
                if not piece:
                    break
                crc, at = F.crc32c(piece, crc), at + len(piece)
            return at, crc
        finally:
            if fd is not None:
                os.close(fd)

    def _reduction_file(self, key: str, crc: int | None, size: int | None = None) -> str:
        """The key of the file that holds the committed bytes of reduction file ``key``: the
        key, or the file a resume kept it as (:func:`~._format.kept_reduction_key`) in a local
        store whose resume rewrote it but was killed before its root listed the rewrite
        (FORMAT.md section 6), when that one has the crc32c ``crc`` and the key's file does
        not (missing, other bytes, or damaged: no regular file inside the store, such as a
        folder, a FIFO or a symlink leaving the store, which is never opened nor followed).
        ``size``: the bytes the file must hold, when known (a file of another size is not
        read). Neither file is ever read whole."""
        if crc is None or not isinstance(self._backend, LocalBackend):
            return key
        kept = F.kept_reduction_key(key)
        try:
            if self._backend.size(kept) is None:
                return key

            def matches(k: str) -> bool:
                got = self._file_crc(k, size)
                return got is not None and got[1] == int(crc)

            try:
                key_matches = matches(key)
            except StoreCorruptError:  # (no regular file inside the store: damaged, as one of other bytes)
                key_matches = False
            if not key_matches and matches(kept):
                return kept
        except StoreError:  # (the key's own checks name what is wrong)
            pass
        return key

    def _damaged_file(self, key: str) -> str | None:
        """Local stores: what is in the place of reduction file ``key`` (under ``reductions/``)
        when that is no regular file inside the store ("a directory", "a FIFO", "a symlink to
        '...', outside the store", ...); None for a regular file, for none, and for a key
        that is none of a reduction file. Opens nothing but what a reader opens (a FIFO without
        waiting, :func:`~.._safeio.open_regular`) and reads nothing outside the store."""
        if not isinstance(self._backend, LocalBackend) or F._reduction_key(key) is None:
            return None
        try:
            self._backend.size(key)
            return None
        except StoreCorruptError:
            pass
        except StoreError:  # (permissions: no damage)
            return None
        p = self._backend.root / key
        real, root = os.path.realpath(p), self._backend._root_real()  # (links resolved, nothing opened)
        if real != root and not real.startswith(root + os.sep):
            return (f"a symlink to {real!r}, outside the store" if os.path.islink(p)
                    else f"reached through a symlink leaving the store (to {real!r})")
        try:
            mode = os.lstat(p).st_mode
        except OSError:
            return "not a regular file"
        return f"a symlink to {real!r}, not a regular file" if stat.S_ISLNK(mode) else _kind(mode)

    def _reduction_document(self, doc_key: str, chunk_from_kept: bool) -> str:
        """The key of a reduction array's document to read: the kept committed one when its
        chunk is read from the kept file, or when the document itself is missing or damaged (no
        regular file inside the store) and a kept one is there (see :meth:`_reduction_file`)."""
        if not isinstance(self._backend, LocalBackend):
            return doc_key
        kept = F.kept_reduction_key(doc_key)
        try:
            if self._backend.size(kept) is None:
                return doc_key
            if chunk_from_kept:
                return kept
            try:
                missing = self._backend.size(doc_key) is None
            except StoreCorruptError:  # (no regular file inside the store: damaged, as missing)
                missing = True
            if missing:
                return kept
        except StoreError:
            pass
        return doc_key

    def _read_small(self, entry: dict) -> torch.Tensor:
        """A reduction result: its one chunk, size-checked against its shape before it is read."""
        shape = [int(d) for d in entry["shape"]]
        dtype = F.torch_dtype(entry["dtype"])
        numel = math.prod(shape)
        if numel == 0:
            return torch.empty(shape, dtype=dtype)
        key = entry["path"] + "/c" + "".join("/0" for _ in shape)
        with self._reads_of_the_opened_run():  # (the root checked once its files are read)
            expected = numel * F.itemsize(entry["dtype"])
            where = f"reduction {entry.get('reduction')!r}: chunk {key!r}"
            crc = self._listed_crc(entry, key, where)
            chosen = self._reduction_file(key, crc, expected)
            # the bytes are interpreted as the root says: its dtype and shape must be the array's own
            doc_key = self._reduction_document(f"{entry['path']}/zarr.json", chosen != key)
            raw_doc = self._backend.get(doc_key)
            doc = None if raw_doc is None else V.loads_json(raw_doc, store=self._backend, key=doc_key)
            if doc is None:  # (a commit of a store that keeps reductions only since: its files are new ones)
                raise self._reduction_damage(f"reduction {entry.get('reduction')!r}: its array document {doc_key} "
                                             "is missing")
            if not isinstance(doc, dict):
                raise V.corrupt(self._backend, f"reduction {entry.get('reduction')!r}: its array document {doc_key} "
                                               "is not a JSON object")
            attr = doc.get("attributes")
            attr = attr.get(F.ATTRS_KEY) if isinstance(attr, dict) else None
            said = (doc.get("data_type"), doc.get("shape"),
                    attr.get("dtype", entry["dtype"]) if isinstance(attr, dict) else entry["dtype"])
            if said != (F.zarr_dtype(entry["dtype"]), shape, entry["dtype"]):
                raise V.corrupt(self._backend, f"reduction {entry.get('reduction')!r}: its array document {doc_key} "
                                               f"says data_type {said[0]!r}, shape {said[1]!r} (dtype {said[2]!r}), but the "
                                               f"root document zarr.json says dtype {entry['dtype']!r} (data_type "
                                               f"{F.zarr_dtype(entry['dtype'])!r}), shape {shape}: the two disagree")
            problems = V.small_array_document_problems(doc, entry["dtype"], shape, doc_key=doc_key)
            if problems:
                raise V.corrupt(self._backend, f"reduction {entry.get('reduction')!r}: " + "; ".join(problems))
            size = self._backend.size(chosen)
            if size is None:
                raise self._reduction_damage(f"{where} listed in the metadata is missing")
            if size != expected:
                raise self._reduction_damage(f"{where} holds {size} bytes, but its shape {shape} and dtype "
                                             f"{entry['dtype']} need {expected}")
            raw = self._backend.get(chosen, max_bytes=expected)
            if raw is None or len(raw) != expected:
                raise self._reduction_damage(f"{where} changed while it was read")
            problem = self._crc_problem(raw, crc, where)
            if problem is not None:
                raise self._reduction_damage(problem)
            return torch.frombuffer(bytearray(raw), dtype=dtype).reshape(shape)

    def _listed_crc(self, entry: dict, key: str, where: str) -> int | None:
        """The crc32c the entry records for its file ``key``; None when it records none (stores
        written before they were recorded). An entry whose ``crc32c`` lists other files but not
        ``key`` has had its ``path`` or ``script`` edited to another file: refused, never read
        unchecked."""
        crcs = entry.get("crc32c") or {}
        if crcs and key not in crcs:
            raise V.corrupt(self._backend, f"{where}: the entry's crc32c lists {sorted(crcs)} but not this file "
                                           "(its path or script names another file than the one it was written with)")
        return crcs.get(key)

    @property
    def reductions(self) -> Mapping[str, dict[str, torch.Tensor]]:
        """``{hook_point: {name: Tensor}}`` of the reductions stored at close, each over every
        stored row of its hook point (:attr:`partial_reductions` lists the others).

        Read on access from ``reductions/<hook point>/<name>`` (each value a copy on the
        host, checked against its crc32c). Keys, shapes and dtypes are those of
        :attr:`Tracker.reductions <activationscope.Tracker.reductions>` at the end of the
        capture: for rows ``(rows, *feature_shape)``, ``mean`` / ``var`` / ``std`` /
        ``min`` / ``max`` / ``absmax`` / ``l2`` / ``nonzero`` are ``(*feature_shape)``
        float64 (``min`` / ``max`` of integer rows int64, exact; a store written before
        that holds them as float64); ``<hist>.counts`` ``(*feature_shape, bins)`` int64 and ``<hist>.edges``
        ``(bins + 1,)`` float64; ``cov`` ``(D, D)`` float64, ``D = prod(feature_shape)``;
        ``<topk>.values`` ``(n, *feature_shape)`` float64 (int64 of integer rows;
        ``n = min(k, rows)``) and
        ``<topk>.row_ids`` int64 of the same shape;
        ``<name>.count`` an int64 scalar (observations per output value).
        Pickled (``torch.save(store.reductions, f)``), every hook point's results are read
        and saved as an ``OrderedDict`` of ``OrderedDict`` objects of tensors, which ``torch.load``
        reads with ``weights_only=True``.

        Returns
        -------
        Mapping of str to dict of str to Tensor
            Hook points with reductions (``list(store.reductions)``) to their results.

        Raises
        ------
        HookPointNotFoundError
            Indexing a hook point without reductions (the message lists those with some).
        StoreCorruptError
            A reduction's file is missing, of another size than its shape and dtype need,
            or does not match its recorded crc32c; indexing the result with an entry the
            store refuses (:attr:`refused_reductions`: left out of the result, with a
            ``UserWarning`` naming it).
        """
        return _Reductions(self)

    def reduction_specs(self, hook_point: str) -> dict[str, tuple[str, dict[str, float]]]:
        """``{name: (kind, options)}`` of the reductions of ``hook_point`` in :attr:`reductions`
        (each name as given at capture, e.g. ``"var"``; its results are ``name`` and
        ``name.<key>``), so a reader can pick a statistic by kind rather than by name.
        ``{}`` when the hook point is stored without reductions. ``kind`` is the built-in's name, ``"script"`` for a
        custom TorchScript reduction and ``"eager"`` for a custom one run as Python (an entry
        that records no kind, from another writer, reads as ``"custom"``; a reduction one of whose
        entries the store refuses, :attr:`refused_reductions`, is left out).

        Parameters
        ----------
        hook_point : str
            A stored hook point (or an alias of one).

        Raises
        ------
        HookPointNotFoundError
            ``hook_point`` is not in the store (a misspelt name is not "no reductions").
        """
        out: dict[str, tuple[str, dict[str, float]]] = {}
        entries = self._complete_reductions().get(hook_point) or {}
        if not entries:
            self._meta(hook_point)  # HookPointNotFoundError for a hook point the store lacks
        refused = {str(e.get("reduction", n)) if isinstance(e, dict) else n
                   for n, e in entries.items() if n in (self._refused.get(hook_point) or {})}
        for full, entry in entries.items():
            if not isinstance(entry, dict):
                continue
            name = str(entry.get("reduction", full))
            if name in refused:
                continue
            options = entry.get("options")
            if name not in out or (full == name and isinstance(options, dict)):
                out[name] = (str(entry.get("kind", "custom")), dict(options) if isinstance(options, dict) else {})
        return out

    def reduction_script(self, hook_point: str, name: str) -> bytes | None:
        """The ``.pt`` bytes of a custom TorchScript reduction, or None for a reduction
        without a program (a built-in one, or a custom one that ran as eager Python).

        Never loaded or run here. ``torch.jit.load(io.BytesIO(b))`` of a file from a store
        someone else wrote runs code of theirs: load it only from a store you trust.

        Parameters
        ----------
        hook_point : str
            A stored hook point (or an alias of one).
        name : str
            The reduction's name (a key of ``store.reductions[hook_point]``).

        Raises
        ------
        HookPointNotFoundError
            ``hook_point`` has no reductions in the store.
        ReductionNotFoundError
            ``hook_point`` has no reduction named ``name``.
        """
        stored = self._attrs.get("reductions") or {}
        entries = stored.get(hook_point) if isinstance(hook_point, str) else None
        if entries is None and isinstance(hook_point, str) and hook_point in self.aliases:
            entries = stored.get(self.aliases[hook_point])
        if entries is None:
            raise HookPointNotFoundError(
                f"hook point {name_repr(hook_point)} has no reductions in the store {str(self._backend)!r}; hook "
                f"points with reductions: {names_repr(sorted(stored))}"
                + ("" if hook_point in self.hook_points else hook_point_hint(hook_point, self.hook_points))
            )
        # (an entry per result array, "var.mean", "var.count": each names its reduction)
        of = {n: (e.get("reduction") if isinstance(e, dict) and isinstance(e.get("reduction"), str) else n)
              for n, e in entries.items()}
        entry = entries.get(name) if isinstance(name, str) else None
        if entry is None:
            if name not in of.values():
                scripts = sorted({of[n] for n, e in entries.items() if isinstance(e, dict) and e.get("script")})
                raise ReductionNotFoundError(
                    f"hook point {hook_point!r} has no reduction named {name!r}; its reductions are "
                    f"{sorted(set(of.values()))} (those with a program: {scripts})"
                )
            entry = {}  # a built-in's results, none of them named the reduction itself: no program
        return self._read_script(entry, name)

    def _read_script(self, entry: dict, name: str) -> bytes | None:
        key = entry.get("script")
        if key is None:
            return None
        where = f"reduction {name!r}: script {key!r}"
        with self._reads_of_the_opened_run():  # (the root checked once the script is read)
            expected = self._listed_crc(entry, key, where)
            data = self._backend.get(self._reduction_file(key, expected), max_bytes=V.MAX_FILE_BYTES)
            if data is None:
                raise self._reduction_damage(f"{where} listed in the metadata is missing")
            problem = self._crc_problem(data, expected, where)
            if problem is not None:
                raise self._reduction_damage(problem)
            return data

    def _check_script(self, entry: dict, name: str) -> None:
        """``verify``'s check of the ``.pt`` script of a custom reduction: the file exists and,
        when recorded, has its crc32c. Read in pieces (:meth:`_file_crc`): a huge or hostile
        file never lands in memory whole, and nothing of it is loaded or run.

        Raises
        ------
        StoreCorruptError
            The script is missing, is no regular file inside the store, or has another crc32c.
        """
        key = entry.get("script")
        if key is None:
            return
        where = f"reduction {name!r}: script {key!r}"
        with self._reads_of_the_opened_run():  # (the root checked once the script is read)
            expected = self._listed_crc(entry, key, where)
            got = self._file_crc(self._reduction_file(key, expected))
            if got is None:
                raise self._reduction_damage(f"{where} listed in the metadata is missing")
            if expected is not None and got[1] != int(expected):
                raise self._reduction_damage(f"{where}: crc32c mismatch (metadata {int(expected):08x}, data "
                                             f"{got[1]:08x})")

    # ------------------------------------------------------------------ row tables
    def row_table(self, kind: str = "sample", columns: Sequence[str] | None = None, *,
                  _schemas: list | None = None, _decode_all: bool = False) -> Any:
        """The row table of ``kind`` ("sample" or "token") as a ``pyarrow.Table``.

        Row ``i`` of a ``kind`` array whose ``follows_row_table`` is true is described by
        row ``i`` of this table. A store opened while a capture writes it reads the rows of the
        commit it shows, also once a later commit merged the parts it lists (read from the parts
        listed now: store/FORMAT.md section 7, point 6).

        Parameters
        ----------
        kind : {"sample", "token"}
        columns : sequence of str, optional
            Read only these columns (Parquet column projection: the others are not decoded,
            e.g. ``["sample_id", "token_ids"]`` of a token table), in this order; a name the
            table has no column of is left out (``table.column_names`` says which were
            found). Its parts are fetched and checked as for the whole table (crc32c, rows,
            the order of the ``batch`` column, and every column's type, read from each
            part's Parquet footer without decoding the columns not read: parts, or the ranks
            of a store of rank stores, that disagree on the type of a column not read raise
            as the whole table's read does). A part is decoded row group by row group: the
            columns read for the checks alone (``pos``, ``batch``) are held for one row group at
            a time, and the table holds a chunk per row group (no combined copy); in a store of
            rank stores each rank's table is checked whole. Default: every column.

        Raises
        ------
        ValueError
            ``kind`` is neither "sample" nor "token".
        TypeError
            ``columns`` is not a sequence of str (a single str is refused too).
        StoreCorruptError
            A listed part is missing, damaged (crc32c, Parquet), lacks a required column
            (``sample_id``, ``batch``; ``pos`` of the token table: FORMAT.md section 4) or
            holds one of another type (named with the part), or the parts hold another
            number of rows than the metadata's ``n_rows``, or columns of other types.
        StoreError
            Of a store of rank stores: two ranks hold a column (read or not) of other types.
            Commits of a capture writing the store merged its parts 3 times while they were
            read: call :meth:`refresh` and read again.
            ``kind`` "token" of a store that keeps reductions only (:attr:`rows_stored`
            False), which has no token table.
        """
        import pyarrow as pa

        if kind not in ("sample", "token"):
            raise ArgumentValueError(f"kind must be one of ['sample', 'token'], got {kind!r}")
        if kind == "token" and not self.rows_stored:  # (an empty table would say that no token was reduced)
            raise StoreError(
                f"store {str(self._backend)!r} keeps reductions only (captured with store= and "
                "reduction_policy=ReductionPolicy.STREAMING): it has no token row table (its token rows were reduced "
                "and not stored; store.reduced gives how many); read row_table('sample')")
        read = None  # the columns decoded: those asked for, and those the checks below read
        if columns is not None:
            names = list(columns) if isinstance(columns, Iterable) and not isinstance(columns, (str, bytes)) else None
            if names is None or not all(isinstance(c, str) for c in names):
                raise ArgumentTypeError(f"columns must be a list of column names (str), got {columns!r}")
            columns = list(dict.fromkeys(names))
            # (and the required integer columns, whose nulls are checked: a projected read raises where the whole
            # table's does)
            read = [*columns, *(c for c in (*V.required_columns(kind), "rank") if c not in columns and c != "sample_id")]
        if self._ranks:  # every rank's committed rows, in rank order, with a rank column
            tables, full = [], []
            for rank, st in self._ranks:
                schema: list = []  # the rank's whole table's schema
                t = st.row_table(kind, read, _schemas=schema)
                _no_rank_column(t, st, rank)
                tables.append(t.append_column("rank", pa.array(np.full(t.num_rows, rank, dtype=np.int64))))
                full.append(schema[0].append(pa.field("rank", pa.int64())))
            ranks, stores = [r for r, _ in self._ranks], [st for _, st in self._ranks]
            if columns is not None:  # every column's type, as the whole table's read checks them
                check_rank_column_types(full, ranks, stores, kind)
            table = concat_rank_tables(tables, ranks, stores, kind)
            if _schemas is not None:  # (the types agree: checked above, or by the concatenation)
                try:
                    _schemas.append(pa.unify_schemas(full, promote_options="default"))
                except (pa.ArrowInvalid, pa.ArrowTypeError):
                    pass
            return table if columns is None else table.select([c for c in columns if c in table.column_names])
        info = (self._attrs.get("row_tables") or {}).get(kind) or {"parts": []}
        # (_decode_all: every column of each part decoded, as a whole read does, those not asked for dropped)
        table = self._row_table_of(kind, info, None if _decode_all else read, _schemas, keep=columns)
        return table if columns is None else table.select([c for c in columns if c in table.column_names])

    def _row_table_of(self, kind: str, info: dict, read: list | None, _schemas: list | None, tries: int = 0,
                      keep: list | None = None) -> Any:
        """The row table ``info`` (the root's ``row_tables[kind]``) lists, its columns ``read``
        (None: all), checked (see :meth:`row_table`). ``keep``: the columns of ``read`` the
        caller asked for; the others (read for the checks) are checked part by part and
        dropped with each part, never held for the whole table (None: all kept). A listed part that is gone while the
        root now lists other parts of the table (a commit since merged it, FORMAT.md section
        4) is read from those: the first ``n_rows`` rows and the columns ``info`` lists, the
        rows of this commit (within a run a table only grows at its end)."""
        import pyarrow as pa

        crcs = info.get("crc32c") or {}
        tables: list = []
        schemas: list = []  # each part's full schema (from its Parquet footer)
        dist = self._attrs.get("distributed")
        by_rank = isinstance(dist, dict) and dist.get("committed") is True
        order = (0, None)  # (rows before the part, the batch of the last row) of the parts read
        # (a part's footer never says it holds more rows than the table has left: Parquet
        # allocates by what it says; each part read takes its rows off, None: no bound)
        left = info.get("n_rows") if isinstance(info.get("n_rows"), int) else None
        with self._reads_of_the_opened_run():  # (the root checked once the parts are read)
            for key in info.get("parts", []):
                if left is not None and tables:
                    left -= tables[-1].num_rows  # (the part before: each part read appends one table)
                raw = self._backend.get(key, max_bytes=V.MAX_FILE_BYTES)
                if raw is None:
                    later = self._later_row_table(kind, info, tries)
                    if later is not None:
                        return self._rows_of_a_later_commit(kind, info, later, read, _schemas, tries, keep)
                    raise V.corrupt(self._backend, f"row-table part {key!r} listed in the metadata is missing")
                self._check_crc(raw, crcs.get(key), f"row table {kind!r}: part {key!r}", parquet=True)
                if keep is not None and not by_rank:  # (by rank: checked on the whole table, below)
                    # checked and projected row group by row group: the columns read for the checks
                    # only are never decoded for the whole part
                    def each(group: Any) -> Any:
                        nonlocal order
                        if row_part_problem(schemas[-1], kind, by_rank, group) is not None:
                            raise _PartProblem  # (said of the whole part, below)
                        order = self._check_part_batch_order(group, kind, order)
                        return group.select([c for c in group.column_names if c in keep])

                    try:
                        tables.append(read_parquet_part(raw, self._backend, key, columns=read, schemas=schemas,
                                                        each=each, max_rows=left))
                        continue
                    except _PartProblem:
                        part = read_parquet_part(raw, self._backend, key, columns=read, max_rows=left)
                else:
                    part = read_parquet_part(raw, self._backend, key, columns=read, schemas=schemas, max_rows=left)
                tables.append(part)
                problem = row_part_problem(schemas[-1], kind, by_rank, part)
                if problem is not None:  # (a missing column would read as nulls: ids no sample has)
                    raise V.corrupt(self._backend, f"row table {kind!r}: part {key!r} {problem}")
        if tables:
            try:  # the columns not read too: a projected read raises where the whole table's does
                full = pa.unify_schemas(schemas, promote_options="default")
            except Exception as e:  # parts whose columns do not fit together
                raise V.corrupt(self._backend, f"the parts of row table {kind!r} do not fit together ({e})") from None
            if _schemas is not None:
                _schemas.append(full)
        if not tables:
            if int(info.get("n_rows", 0)):
                raise V.corrupt(self._backend, f"row table {kind!r} lists no parts, but the metadata says n_rows "
                                               f"{info['n_rows']}")
            cols = {"sample_id": pa.array([], pa.int64()), "batch": pa.array([], pa.int64())}
            if kind == "token":
                cols = {"sample_id": pa.array([], pa.int64()), "pos": pa.array([], pa.int64()), "batch": pa.array([], pa.int64())}
            table = pa.table(cols)
            if _schemas is not None:
                _schemas.append(table.schema)
            return table
        try:
            table = pa.concat_tables(tables, promote_options="default")
        except Exception as e:  # parts whose columns do not fit together
            raise V.corrupt(self._backend, f"the parts of row table {kind!r} do not fit together ({e})") from None
        if not table.column_names:  # (parts holding none of the columns read: Arrow counts no rows of theirs)
            table = pa.table({"rows": pa.nulls(sum(t.num_rows for t in tables))}).select([])
        if "n_rows" in info and table.num_rows != int(info["n_rows"]):
            raise V.corrupt(self._backend, f"row table {kind!r} has {table.num_rows} rows in its parts, but the "
                                           f"metadata says n_rows {info['n_rows']}")
        self._check_batch_order(table, kind)
        return table

    def _later_row_table(self, kind: str, info: dict, tries: int) -> dict | None:
        """The root's ``row_tables[kind]`` as the store is now, when a listed part of ``info``
        (the table as this reader shows it) is gone because a commit of this run since merged
        it (FORMAT.md section 4): it lists other parts and at least as many rows. None when
        it does not (the part is missing: damage).

        Raises
        ------
        StoreError
            Another run is in the store's place now (:meth:`_check_same_store`), or commits
            merged the parts again each time they were read (``tries``): refresh and read again.
        """
        self._check_same_store()  # another run in its place: said as such, not as damage
        if tries >= _LATER_COMMITS:
            raise StoreError(
                f"store at {str(self._backend)!r}: row table {kind!r}: commits since it was opened merged its parts "
                f"{tries} times while they were read (a capture is writing it); call store.refresh() (or open_store "
                "again) and read it again")
        raw = self._backend.get("zarr.json", max_bytes=V.MAX_JSON_BYTES)
        attrs = V.parse_root(raw, store=self._backend) if raw is not None else None
        if attrs is None or F.run_of(attrs) != self._run:
            return None
        later = (attrs.get("row_tables") or {}).get(kind)
        if not isinstance(later, dict) or later.get("parts") == info.get("parts"):
            return None
        if int(later.get("n_rows", 0)) < int(info.get("n_rows", 0)):
            return None
        return later

    def _rows_of_a_later_commit(self, kind: str, info: dict, later: dict, read: list | None, _schemas: list | None,
                                tries: int, keep: list | None = None) -> Any:
        """The row table ``info`` lists, read from the parts ``later`` (a later commit's table of
        the same run, :meth:`_later_row_table`) lists: its first ``info["n_rows"]`` rows, and the
        columns ``info`` lists (a column first given after them is left out)."""
        import pyarrow as pa

        schemas: list = []
        table = self._row_table_of(kind, later, read, schemas, tries + 1, keep)
        table = table.slice(0, int(info.get("n_rows", 0)))
        names = info.get("columns")
        full = schemas[0] if schemas else table.schema
        if isinstance(names, list) and all(isinstance(c, str) for c in names):
            table = table.select([c for c in table.column_names if c in names])
            full = pa.schema([f for f in full if f.name in names])
        if _schemas is not None:
            _schemas.append(full)
        return table

    def _check_part_batch_order(self, part: Any, kind: str, order: tuple) -> tuple:
        """:meth:`_check_batch_order` of the next part of a table (not committed from rank
        stores) read part by part: ``order`` is ``(rows before it, the batch of the last row
        before it or None)``, and the same for the parts up to this one is returned. Raises as
        the check of the whole table does, at the same row."""
        start, last = order
        if "batch" not in part.column_names or part.num_rows == 0:
            return start + part.num_rows, last
        self._check_batch_order(part, kind, start)  # (within the part)
        col = part.column("batch")
        first = col[0].as_py()
        if last is not None and first < last:
            self._batch_went_back(kind, start, last, first, False)
        return start + part.num_rows, col[part.num_rows - 1].as_py()

    def _batch_went_back(self, kind: str, row: int, before: int, after: int, of_rank: bool) -> None:
        raise V.corrupt(
            self._backend,
            f"row table {kind!r}: its batch column goes back from {before} to {after} "
            f"(row {row}{' of its rank' if of_rank else ''}): its parts are not in the order they "
            "were written (an edited zarr.json), so its rows would describe other rows of the arrays",
        )

    def _check_batch_order(self, table: Any, kind: str, offset: int = 0) -> None:
        """Raise :class:`StoreCorruptError` when the row table's ``batch`` column goes back
        (per ``rank`` in a store committed from rank stores, whose ``rank`` column is the
        rank's: FORMAT.md §10): a writer appends its forwards in order (FORMAT.md §5, §9 rule
        15), so parts listed in another order than written (an edited root, checksums intact)
        would pair rows with other samples' ids and columns. In any other store a ``rank``
        column is a user column (``set_batch(rank=...)``) like any other. ``offset``: the rows
        before ``table`` (a part checked alone)."""
        names = table.column_names
        if "batch" not in names or table.num_rows < 2:
            return
        dist = self._attrs.get("distributed")
        by_rank = isinstance(dist, dict) and dist.get("committed") is True
        found = batch_order(table, by_rank)
        if found is None:
            return
        what, detail = found
        if what == "type":
            c, col_type, nulls = detail
            raise V.corrupt(self._backend, f"row table {kind!r}: its {c} column must hold integers without "
                                           f"nulls, got {col_type} with {nulls} nulls")
        row, before, after = detail
        self._batch_went_back(kind, offset + row, before, after, by_rank and "rank" in names)

    # ------------------------------------------------------------------ checks and info
    def _table_problem(self, kind: str, e: StoreCorruptError) -> str:
        """A verify() line of row table ``kind`` from the error a read of it raised: the table
        named once, without the store the error names again (every line is this store's)."""
        text = str(e)
        own = f"store {str(self._backend)!r}: "
        if text.startswith(own):
            text = text[len(own):]
        head = f"row table {kind!r}: "
        return text if text.startswith(head) else head + text

    def verify(self) -> list[str]:
        """Check that every read succeeds and returns what was written.

        Per array with committed rows: its array document (shape, and every field of the
        root's entry: data type, feature shape, chunk shapes, codecs), its manifest covering
        every committed chunk and its other fields (each shard's key, rows_end and
        file_bytes, which reads do not use), every shard's index (crc32c, each
        committed chunk present and inside the file), each committed chunk's crc32c and (for
        compressed arrays) that it decodes to the right size. Row tables: every part present,
        its crc32c (when recorded), readable, its required columns there and of their types
        (FORMAT.md section 4), the parts' rows equal to ``n_rows``; every token
        row paired with a sample row (its ``sample_id``, and its ``batch`` and ``rank`` with it,
        in the sample table: FORMAT.md section 9 rule 15); no array that follows its row table
        holding more rows than the table, nor fewer where no writer leaves that (inside a
        forward, or at all in a store committed from rank stores). Reductions:
        every file's crc32c (when recorded) and its size against shape and dtype. Every file
        of the store (what :meth:`save` copies): a regular file inside the store. An array
        with no committed rows may lack its document and manifest (FORMAT.md §7). An array
        document whose ``shape[0]`` is past ``n_rows`` (which this library reads) must not be
        past the rows its shards hold, nor, in a complete store, past ``n_rows`` at all: a
        plain Zarr reader reads the document's shape (fill values, zeros, where no row was
        written). Files a killed writer left that nothing reads are no problem: :meth:`leftovers`
        names them.

        Returns
        -------
        list of str
            One line per problem, naming the hook point, the file and what is wrong (empty:
            all good); at most 20 lines per array.

        Raises
        ------
        StoreError
            The store was replaced (another run written in its place) since it was opened,
            before or while it was verified: its files are not this store's.
        """
        problems: list[str] = []
        if self._ranks:  # an uncommitted multi-rank store: its rank stores hold every file
            for rank, st in self._ranks:
                problems += [f"rank {rank} ({st.path}): {p}" for p in st.verify()]
            return problems
        # the shard indexes as the files are now (those read before may be of files a resume
        # has since rewritten and listed in the manifests this reads now)
        with self._lock:
            self._indexes.clear()
            with _MAPPINGS.lock:
                kept = set(self._maps)
        for hp in list(self._attrs.get("arrays", {})):  # aliases have no files of their own
            mine: list[str] = []
            try:
                self._verify_array(hp, mine)
            except StoreCorruptError as e:
                mine.append(f"hook point {hp!r}: {e}")
            finally:
                # the shards it mapped to check them are unmapped again: each is one of the process's
                # vm.max_map_count mappings (65530), which a store of 1500 hook points of 50 shards
                # each would use up, every check after that failing
                dropped: list = []
                with self._lock, _MAPPINGS.lock:
                    for key in [key for key in self._maps if key not in kept]:
                        dropped += self._forget_locked("shard", key)
                _let_go(dropped)  # (a reader in another thread may hold views of them: said)
            if len(mine) > 20:
                mine = mine[:20] + [f"hook point {hp!r}: ... and {len(mine) - 20} more problems"]
            problems += mine
        tables = self._attrs.get("row_tables") or {}
        read = {}  # each table as read once (a token table of tens of millions of rows: read it once, not twice)
        for kind, info in tables.items():
            tries = 0
            while True:  # (again on the parts the root lists now, when a commit since merged a part: row_table())
                crcs = info.get("crc32c") or {}  # absent in stores written before it was recorded
                total = 0
                readable = True
                mine, later = [], None
                for key in info.get("parts", []):
                    try:
                        data = self._backend.get(key, max_bytes=V.MAX_FILE_BYTES)
                    except StoreCorruptError as e:
                        mine.append(self._table_problem(kind, e))
                        readable = False
                        continue
                    if data is None:
                        later = self._later_row_table(kind, info, tries)
                        if later is not None:
                            break
                        mine.append(f"row table {kind!r}: part {key!r} is missing")
                        readable = False
                        continue
                    problem = self._crc_problem(data, crcs.get(key), f"row table {kind!r}: part {key!r}", parquet=True)
                    if problem:
                        mine.append(problem)
                        readable = False
                        continue
                    try:
                        import pyarrow.parquet as pq

                        total += pq.read_metadata(io.BytesIO(data)).num_rows
                    except Exception as e:  # noqa: BLE001 - any Parquet failure
                        mine.append(f"row table {kind!r}: part {key!r} is not a readable Parquet file ({e})")
                        readable = False
                if later is None:
                    break
                info, tries = later, tries + 1
            problems += mine
            if readable and total != int(info.get("n_rows", 0)):
                problems.append(f"row table {kind!r}: its parts hold {total} rows, the metadata says n_rows "
                                f"{info.get('n_rows', 0)}")
            elif readable:  # each part is fine: the table is their concatenation (columns of one type)
                try:
                    # (every column of each part decoded and checked, and only the columns the checks below
                    # read kept: a token table of 10**9 rows is never held whole)
                    table = self.row_table(kind, columns=["rank", "batch", "sample_id"], _decode_all=True)
                except StoreCorruptError as e:
                    problems.append(self._table_problem(kind, e))
                else:
                    if kind in ("sample", "token") and info.get("parts"):
                        read[kind] = table
        if len(read) == 2:  # token rows are paired with their sample by these columns: one type in both
            keys = [k for k in ("rank", "batch", "sample_id")
                    if k in read["sample"].column_names and k in read["token"].column_names]
            clashes = V.row_table_type_clashes(read["sample"].schema, read["token"].schema, keys)
            problems += [f"row tables: {clash} (one writer writes both from the same values)" for clash in clashes]
            if not clashes and "sample_id" in keys:  # and every token row has its sample (FORMAT.md section 4)
                problems += V.token_rows_without_sample_lines(
                    read["sample"], read["token"], keys, "reads of the sample columns on token rows refuse the store; "
                    "restore it from its source")
        # a row table the root does not list reads as one of 0 rows (row_table(), datasets, exports)
        if self.n_samples != int((tables.get("sample") or {}).get("n_rows", 0)):
            problems.append(f"n_samples {self.n_samples} differs from the sample row table's n_rows "
                            f"{(tables.get('sample') or {}).get('n_rows', 0)}"
                            + ("" if "sample" in tables else " (zarr.json lists no row_tables['sample'])"))
        for hp in list(self._attrs.get("arrays", {})):
            meta = self._meta(hp)
            table = tables.get(meta["row_kind"])
            table_rows = int((table or {}).get("n_rows", 0))
            if meta.get("follows_row_table", True) and int(meta["n_rows"]) > table_rows:
                listed = "" if table is not None else f" (zarr.json lists no row_tables[{meta['row_kind']!r}])"
                problems.append(f"hook point {hp!r}: n_rows {meta['n_rows']} exceeds the {table_rows} "
                                f"rows of the {meta['row_kind']} row table it follows{listed}")
            elif meta.get("follows_row_table", True) and int(meta["n_rows"]) < table_rows:
                problems += self._short_of_row_table(hp, int(meta["n_rows"]), meta["row_kind"], table_rows,
                                                     read.get(meta["row_kind"]))
        del read
        for hp, entries in (self._attrs.get("reductions") or {}).items():
            for name, entry in entries.items():
                where = f"hook point {hp!r}: reduction {name!r}"
                if name in (self._refused.get(hp) or {}):
                    problems.append(f"{where} is refused: {self._refused[hp][name]}; {REFUSED_REDUCTION_FIX}")
                files = dict(entry.get("crc32c") or {})
                for part in (entry.get("state") or {}).values():  # the state a resume continues from
                    files.update(part.get("crc32c") or {})
                docs = [arr.get("path") for arr in [entry, *(entry.get("state") or {}).values()]
                        if isinstance(arr, dict) and isinstance(arr.get("path"), str)]
                for key in [f"{d}/zarr.json" for d in docs] + list(files):
                    # a key's file that is no regular file inside the store, where readers read its committed
                    # bytes from the file a resume kept (FORMAT.md section 6): damage all the same
                    damage, kept = self._damaged_file(key), F.kept_reduction_key(key)
                    if damage is None:
                        continue
                    chosen = (self._reduction_document(key, False) if key.endswith("/zarr.json")
                              else self._reduction_file(key, files[key]))
                    if chosen == key:
                        continue  # (reading the key's file names what is wrong, below)
                    fix = ("remove that folder (never the kept file), then resume the capture: it puts the kept "
                           "file back" if damage == "a directory" else "resume the capture: it puts the kept file "
                           "back in its place" + (" (replacing the link, never what it points to)"
                                                  if damage.startswith("a symlink") else ""))
                    problems.append(f"{where}: file {key!r} is {damage} (no regular file inside the store); readers "
                                    f"read its committed bytes from the file kept as {kept!r} (FORMAT.md section 6); "
                                    f"{fix}, or copy the kept file to {key!r} yourself")
                for key, crc in files.items():
                    try:  # (read in pieces: a file of any size never lands in memory whole)
                        got = self._file_crc(self._reduction_file(key, crc))
                    except StoreCorruptError as e:
                        problems.append(f"{where}: {e}")
                        continue
                    if got is None:
                        problems.append(f"{where}: file {key!r} is missing")
                        continue
                    if crc is not None and got[1] != int(crc):
                        problems.append(f"{where}: file {key!r}: crc32c mismatch (metadata {int(crc):08x}, data "
                                        f"{got[1]:08x})")
                try:
                    self._read_small(entry)
                    self._check_script(entry, name)  # (in pieces: never whole in memory, never loaded)
                    for part in (entry.get("state") or {}).values():  # plain Zarr readers see these arrays too
                        self._read_small({**part, "reduction": name})
                except StoreCorruptError as e:
                    line = f"{where}: {e}"
                    if line not in problems and not any(line.startswith(p.split(":")[0]) and "crc32c" in p
                                                        for p in problems[-3:]):
                        problems.append(line)
        for key in self._backend.list(""):  # every file a copy (save) reads: regular, inside the store
            try:
                self._backend.size(key)
            except StoreError as e:
                if not any(repr(key) in p for p in problems):
                    problems.append(f"file {key!r}: {e}")
        base = getattr(self._backend, "root", None)
        base = base / "reductions" if isinstance(self._backend, LocalBackend) else None
        if base is not None and base.is_dir() and not base.is_symlink():  # (what no file listing shows)
            places = F.kept_reduction_places(self._attrs.get("reductions"))  # (a reduction may be m.committed.tmp)
            for dirpath, dirs, _files in os.walk(base):  # a link to a folder is in dirs, never followed
                for name in list(dirs):
                    key = os.path.relpath(os.path.join(dirpath, name), self._backend.root).replace(os.sep, "/")
                    if key not in places:
                        continue
                    dirs.remove(name)
                    if os.path.islink(os.path.join(dirpath, name)):
                        problems.append(f"file {key!r}: a symlink to a folder, where a resume keeps a committed "
                                        "reduction file (FORMAT.md section 6); a resume removes the link")
                    else:
                        problems.append(f"file {key!r}: a folder, where a resume keeps a committed reduction file "
                                        "(FORMAT.md section 6); a resume refuses the store until it is removed")
        self._check_same_store()  # the files read were the opened run's: another run's are no damage of it
        return problems

    def leftovers(self) -> list[str]:
        """Files a writer killed between two of its writes left behind, which no document lists
        and no reader reads: harmless, not damage (:meth:`verify` does not count them). Such a
        file is a manifest segment ``acts/<node>/manifest.<first>.json`` that the array's
        manifest does not list (FORMAT.md section 5: a capture killed after writing a segment,
        before the manifest that lists it); the next commit that seals that block of shards (a
        resume's first commit) writes it again, byte for byte as it should be, and lists it.
        On a local store, so is a folder next to it, ``.<name>.replaced-<hex>``, that holds what
        is left of the store an ``overwrite=True`` replaced, its delete cut short (FORMAT.md
        section 7): named when it is the one such folder, holds no root document and nothing but
        a store's entries, and this store's root lists a committed forward (or says
        ``complete``) and every manifest and row table part it lists is here; the next ``resume=True`` or
        ``overwrite=True`` deletes it. While a writer holds the store's lock (a live process: the
        writer of that overwrite deletes the folder in the background until its close), the line
        says a writer runs (the writer of an overwrite deletes the folder before its close; another
        keeps it for the next resume or overwrite), not that a writer was killed. Opening the store
        (:func:`open_store`) says nothing about such a folder: it holds no row of this store.

        Returns
        -------
        list of str
            One line per file or folder, naming it (its key, or the folder's path) and why it is
            there; empty when there is none. An array whose manifest cannot be read is left out
            (:meth:`verify` names it).
        """
        out: list[str] = []
        if isinstance(self._backend, LocalBackend) and F.settled_replaced(self._attrs) and all(
                self._backend.size(k) is not None for k in F.listed_keys(self._attrs)):
            remains = self._backend.replaced_remains()
            holder = None
            if remains is not None:
                from ._lock import writer_holding  # (a local lock is held only by a live writer)

                holder = writer_holding(self._backend)
            if remains is not None and holder is not None:
                out.append(f"folder {str(remains)!r}: what is left of the store an overwrite=True replaced here (its "
                           "root document is gone: nothing reads it); a writer of this store is running "
                           f"({holder}): nothing to do. The writer of an overwrite=True deletes it before its close "
                           "returns; if it is still here once that writer has ended (another writer keeps it), the "
                           "next resume=True or overwrite=True of this store deletes it")
            elif remains is not None:
                out.append(f"folder {str(remains)!r}: what is left of the store an overwrite=True replaced here, its "
                           "delete cut short (its writer was killed after this store's commit; its root document is "
                           "gone: nothing reads it); harmless, the next resume=True or overwrite=True of this store "
                           f"deletes it, or delete it now: rm -rf {shlex.quote(str(remains))}")
        if self._ranks:  # an uncommitted multi-rank store: its rank stores hold every file
            return out + [f"rank {rank} ({st.path}): {line}" for rank, st in self._ranks for line in st.leftovers()]
        for hp, meta in (self._attrs.get("arrays") or {}).items():
            man_key = meta["manifest"]
            folder = man_key.rpartition("/")[0]
            try:
                raw = self._backend.get(man_key, max_bytes=V.MAX_JSON_BYTES)
                listed = set() if raw is None else {F.segment_key(man_key, e["first"]) for e in V.parse_manifest(
                    V.loads_json(raw, store=self._backend, key=man_key), meta, store=self._backend, key=man_key,
                    check_chunks=False).segments}
                found = sorted(k for k in self._backend.list(f"{folder}/")
                               if re.fullmatch(r"manifest\.\d+\.json", k[len(folder) + 1:]))
            except StoreError:  # (a damaged manifest or folder: verify names it)
                continue
            out += [f"hook point {hp!r}: manifest segment {k} is listed by no manifest ({man_key} does not list "
                    "it): a capture was killed after writing it, before the manifest that lists it; harmless "
                    "(never read), the next commit that seals its shards (resuming the capture) writes it again "
                    "and lists it" for k in found if k not in listed]
        return out

    def _short_of_row_table(self, hp: str, n_rows: int, kind: str, table_rows: int, table: Any) -> list[str]:
        """verify: an array that follows its row table with fewer rows than the table (see
        :func:`V.short_of_row_table_line`). ``table``: the row table as read (None: unreadable,
        reported already)."""
        dist = self._attrs.get("distributed")
        line = V.short_of_row_table_line(hp, n_rows, kind, table_rows, table,
                                         isinstance(dist, dict) and dist.get("committed") is True,
                                         "the root's n_rows or the row table was edited (its parts rewritten); "
                                         "restore the store from its source")
        return [] if line is None else [line]

    def _verify_array(self, hp: str, problems: list[str]) -> None:
        meta = self._meta(hp)
        n = int(meta["n_rows"])
        doc_key = f"{meta['path']}/zarr.json"
        raw = self._backend.get(doc_key)
        if n == 0:  # nothing committed: the document and manifest may not exist yet; one that does agrees
            if raw is not None:
                doc = V.loads_json(raw, store=self._backend, key=doc_key)
                disagree = V.array_document_problems(doc, meta, hook_point=hp, doc_key=doc_key)
                problems += disagree
                if not disagree and doc["shape"][0] > 0:  # (a commit killed before its root: rows held, or not)
                    man_raw = self._backend.get(meta["manifest"], max_bytes=V.MAX_JSON_BYTES)
                    shards = {} if man_raw is None else V.parse_manifest(
                        V.loads_json(man_raw, store=self._backend, key=meta["manifest"]), meta, store=self._backend,
                        key=meta["manifest"], check_chunks=False)
                    problems += self._shape_problems(hp, meta, doc_key, doc["shape"][0], shards)
            return
        rb, chunk_rows, n_chunks, chunk_bytes = _layout(meta)
        shard_rows = n_chunks * chunk_rows
        if raw is None:
            problems.append(f"hook point {hp!r}: array document {doc_key} is missing")
        else:
            doc = V.loads_json(raw, store=self._backend, key=doc_key)
            disagree = V.array_document_problems(doc, meta, hook_point=hp, doc_key=doc_key)
            if disagree:  # the root's layout is not the array's: its chunks cannot be checked by it
                problems += disagree
                return
            doc_rows = doc["shape"][0]
            if doc_rows < n:
                problems.append(f"hook point {hp!r}: array document {doc_key} has shape {doc['shape']!r}, expected "
                                f"[>= {n} committed rows, *{list(meta['feature_shape'])}]")
            try:  # what decoded reads, to_dask and plain zarr readers open (fill value, names, extra fields)
                self._zarray(meta)
            except StoreCorruptError as e:
                problems.append(f"hook point {hp!r}: {e}")
        man_raw = self._backend.get(meta["manifest"])
        if man_raw is None:
            problems.append(f"hook point {hp!r}: manifest {meta['manifest']!r} is missing")
            return
        man_doc = V.loads_json(man_raw, store=self._backend, key=meta["manifest"])
        # (each segment's hook_point checked against the array's: a lie of the index's own is named by
        # manifest_problems below, as the index's, not as its segments')
        shards = V.parse_manifest(man_doc, meta, store=self._backend, key=meta["manifest"], hook_point=hp)
        shards.load_all()  # (every segment read and checked: a bad one is named as such)
        if raw is not None and doc_rows > n:
            problems += self._shape_problems(hp, meta, doc_key, doc_rows, shards)
        committed_shards = [k for k in shards if k * shard_rows < n]
        sizes: dict[int, int | None] = {}
        for k in committed_shards:
            try:
                sizes[k] = self._backend.size(self._shard_file(meta, k))
            except StoreError:  # not a regular file, or outside the store: the shard checks below name it
                sizes[k] = None
        problems += [f"hook point {hp!r}: {p}" for p in V.manifest_problems(
            man_doc, shards, meta, hook_point=hp, key=meta["manifest"], sizes=sizes,
            restorable={k for k in committed_shards if self._restorable(meta, k)})]
        needed = -(-n // shard_rows)
        listed = sorted(k for k in shards if k < needed)
        if len(listed) < needed:
            first = next(k for k in range(needed) if k not in shards)
            problems.append(f"hook point {hp!r}: {needed - len(listed)} of the {needed} shards holding its {n} "
                            f"committed rows have no manifest entry (first: shard {first}, "
                            f"{self._shard_key(meta, first)})")
        for k in listed:
            rec = shards[k]
            key = self._shard_key(meta, k)
            try:
                idx = self._shard_index(meta, k)
            except StoreCorruptError as e:
                problems.append(f"hook point {hp!r}: {e}")
                continue
            in_manifest = {int(c[0]): c for c in rec.get("chunks", [])}
            committed = min(n_chunks, -(-(n - k * shard_rows) // chunk_rows))
            for j in range(committed):
                chunk = k * n_chunks + j
                r0, r1 = chunk * chunk_rows, min(n, (chunk + 1) * chunk_rows)
                c = in_manifest.get(j)
                if c is None:
                    problems.append(f"hook point {hp!r}: chunk {chunk} (rows {r0}-{r1 - 1}, shard {key}) has no "
                                    "manifest entry (its crc32c cannot be checked)")
                    continue
                if j in idx.bad:
                    problems.append(f"hook point {hp!r}: {idx.bad[j]}")
                    continue
                _, off, nb, crc = c
                where = f"hook point {hp!r}: chunk {chunk} (rows {r0}-{r1 - 1}, shard {key}, bytes {off}-{off + nb - 1})"
                if idx.entries[j] != (off, nb):
                    problems.append(f"{where}: shard index entry {idx.entries[j]} differs from the manifest: "
                                    f"{_mismatch_cause(meta, chunk, self._restorable(meta, k))}")
                    continue
                data = self._backend.get_range(idx.key, off, nb)
                got = F.crc32c(data or b"")
                if got != crc:
                    problems.append(f"{where}: crc32c mismatch (manifest {crc:08x}, data {got:08x}): "
                                    f"{_mismatch_cause(meta, chunk, self._restorable(meta, k))}")
                    continue
                if meta.get("compression") is not None:
                    try:
                        self._decode_chunk(hp, meta, chunk)
                    except StoreCorruptError as e:
                        problems.append(f"{where}: {e}")
        if not problems and self._mappable(meta):
            try:
                self._read_rows(hp, 0, n)
            except StoreCorruptError as e:
                problems.append(f"hook point {hp!r}: {e}")

    def _shape_problems(self, hp: str, meta: dict, doc_key: str, doc_rows: int, shards: dict[int, dict]) -> list[str]:
        """What a plain Zarr reader of an array whose document's ``shape[0]`` (``doc_rows``) is
        ahead of its committed ``n_rows`` would misread (FORMAT.md section 9, what ``verify``
        checks): rows past the ones its shards hold, read as fill values (zeros) though never
        written, and, in a complete store (the root as it is now), rows that no row table lists.
        Rows between ``n_rows`` and ``shape[0]`` are held when their shard files exist and their
        own indexes list their chunks, from the first one on: what a plain Zarr reader reads as
        written (a commit killed or failed before its root leaves such rows; its manifests may
        list an earlier, shorter version of a rewritten last shard, or not list it yet)."""
        n, shard_rows = int(meta["n_rows"]), int(meta["shard_rows"])
        held, k, why = n, n // shard_rows, ""
        while held < doc_rows:
            key = self._shard_key(meta, k)
            try:
                size = self._backend.size(key)
            except StoreError:
                size = None
            if size is None:
                why = f"shard {k}'s file {key} is missing or not a regular file inside the store"
                break
            # what a plain Zarr reader reads as written is what the shard's own index lists (the
            # manifest may list an earlier version of a rewritten last shard: a commit killed or
            # failed between its shards and its manifests leaves that)
            end = k * shard_rows + self._rows_in_index(meta, key, size)
            if end <= held:
                why = (f"{key} holds no chunk past row {held}" + ("" if shards.get(k) is not None else
                       f", and its manifest {meta['manifest']} lists no shard {k}"))
                break
            held = min(end, (k + 1) * shard_rows)
            if held < min(doc_rows, (k + 1) * shard_rows):
                why = f"shard {k}'s file {key} holds chunks up to row {end}"
                break
            k += 1
        fix = (f"set shape[0] in {doc_key} to {n} (the root's n_rows, which activationscope reads), or resume the "
               "capture (it writes that document again)")
        where = f"hook point {hp!r}: array document {doc_key} has shape[0] {doc_rows}"
        if held < doc_rows:
            return [f"{where}, but its shards hold {f'rows 0..{held - 1} only' if held else 'no rows'} ({why}): a "
                    f"plain Zarr reader would read rows {held}..{doc_rows - 1}, never written, as fill values (zeros); "
                    f"{fix}"]
        if self.status == "complete" and self._committed_rows_now(hp) < doc_rows:
            return [f"{where}, more than the {n} committed rows (n_rows of the root document zarr.json) of a complete "
                    f"store: a plain Zarr reader would read {doc_rows - n} rows that were never committed and that no "
                    f"row table lists; {fix}"]
        return []

    def _committed_rows_now(self, hp: str) -> int:
        """``n_rows`` of ``hp``'s array in the root document as it is now (this reader may hold
        an earlier snapshot: a resume since has committed more rows and written the array's
        document for them); 0 when that root cannot be read or does not list the array."""
        try:
            raw = self._backend.get("zarr.json", max_bytes=V.MAX_JSON_BYTES)
            attrs = V.parse_root(raw, store=self._backend) if raw is not None else None
            rows = ((attrs or {}).get("arrays") or {}).get(hp, {}).get("n_rows", 0)
        except (StoreError, AttributeError, TypeError):
            return 0
        return rows if isinstance(rows, int) and not isinstance(rows, bool) else 0

    def _rows_in_index(self, meta: dict, key: str, size: int) -> int:
        """Rows of the shard file ``key`` (``size`` bytes) that its index lists chunks for, from
        its first chunk on (what a plain Zarr reader reads as written): whole chunks, 0 for an
        index that is damaged (crc32c) or a file shorter than one."""
        n_chunks = int(meta["shard_rows"]) // int(meta["chunk_rows"])
        index_bytes = 16 * n_chunks + 4
        if size < index_bytes:
            return 0
        raw = self._backend.get_range(key, size - index_bytes, index_bytes) or b""
        if len(raw) != index_bytes or F.crc32c(raw[:-4]) != int.from_bytes(raw[-4:], "little"):
            return 0
        entries = np.frombuffer(raw[:-4], dtype="<u8").reshape(-1, 2)
        data_end = size - index_bytes
        present = 0
        for off, nb in entries.tolist():
            if off == _MISSING or nb == _MISSING or off > data_end or nb > data_end - off:
                break
            present += 1
        return present * int(meta["chunk_rows"])

    def info(self) -> dict:
        """A summary: arrays (shape, dtype, rows, bytes), reductions, provenance, status.

        Sizes: ``bytes`` is the size of the committed rows (``rows x prod(feature_shape) x
        itemsize``), ``bytes_on_disk`` the size of their shard files (in a local folder the
        files as they are, a missing one 0: a size other than the manifest's is damage, which
        :meth:`verify` names; no manifest segment, FORMAT.md section 5, is read for them; in an
        object store the sizes its manifests record, which reads each of their segments, one
        request each, as only their records give those sizes), and
        ``data_to_disk_ratio`` = ``bytes / bytes_on_disk``. That ratio is not a compression
        ratio: shard files also hold the padding of each array's last chunk (written full
        size) and the shard index, so a small uncompressed store shows well below 1; only
        for arrays much larger than a chunk does it approach the codec's compression ratio.
        ``row_tables`` gives the rows of each row table, ``row_table_columns`` its columns
        (``["sample_id", "pos", "batch", "token_ids"]`` for the token rows of a text capture),
        ``row_table_parts`` the number of Parquet parts it is split into (FORMAT.md section 4).
        Each array's ``n_manifest_segments`` is the number of manifest segments holding the
        records of its committed shards (FORMAT.md section 5: one per 1024 full shards), taken
        from its manifest's index (no segment is read for it). ``format_reason`` says why
        ``format.version`` is above 1 (FORMAT.md section 8: 2, a multi-rank capture, committed
        from rank stores; 3, reductions only; 4, manifest segments), None at version 1.
        ``rows_stored`` is False for a store that keeps reductions only (FORMAT.md section 11):
        it then has no ``arrays``, and ``reduced`` gives each reduced hook point's
        ``row_kind``, ``feature_shape``, ``dtype`` and ``n_rows`` (rows reduced).
        ``reduction_bytes`` is the size in bytes of every reduction the store holds (complete,
        partial and refused ones: their results and their states, as stored values, e.g. 8 bytes
        per float64; a custom reduction's ``.pt`` program not counted), and
        ``hook_point_reduction_bytes`` the same per hook point; ``bytes`` counts activations only.

        Every array's entry in the root document is checked against the array's own files
        before it is shown, as before its first read (FORMAT.md section 9 rules 16-17): a root
        that says another dtype, feature shape, layout or row count than the array's document
        and manifest is an error, never a summary of rows that are not there.

        Rank stores under ``ranks/`` that ``activationscope consolidate`` would commit are
        described under ``pending_ranks`` (:func:`pending_ranks`: a capture again of this store,
        whose commit replaces its rows, or the ranks of an uncommitted multi-rank store: which
        ranks, their run, rows and status, which are missing or incomplete, whether every rank
        is ready); the key is absent when there is no rank store. The rows, sizes and status
        above are always those the store reads now.

        Raises
        ------
        StoreCorruptError
            A manifest is damaged, or the root document disagrees with an array's document
            (naming the hook point, both files and both values; run :meth:`verify` for the
            full list).
        """
        arrays = {}
        total_raw = total_disk = 0
        any_segments = False
        for hp in list(self._attrs.get("arrays", {})):  # aliases are listed apart: no bytes of their own
            meta = self._meta(hp)
            # checked against its own files (once: rules 16-17), which parses its manifest; that
            # parse's shards are the ones sized here (a store of many arrays: each manifest once)
            crcs = None if self._parts else self._array_crcs(meta)
            n = int(meta["n_rows"])
            feat = tuple(meta["feature_shape"])
            raw_bytes = n * V.row_bytes(meta)
            disk = n_segments = 0
            for _, st, _first in self._parts.get(hp, []):
                part = st.info()["arrays"][hp]
                disk += int(part["bytes_on_disk"])
                n_segments += int(part["n_manifest_segments"])
            shards = None
            if crcs is not None and n:
                shards = crcs.shards
                n_chunks = int(meta["shard_rows"]) // int(meta["chunk_rows"])
                # (the chunk entries of the records the index lists, as a full parse checks them; a
                # segment's are checked when it is read, by a read that needs one of its shards or verify)
                for i, rec in enumerate(shards.tail.values()):
                    V.check_chunk_entries(rec, n_chunks, store=self._backend, key=meta["manifest"],
                                          field=f"shards[{i}]")
            elif crcs is not None:  # no committed rows: a manifest there may be, checked as any
                man = self._backend.get(meta["manifest"])
                if man is not None:
                    shards = V.parse_manifest(V.loads_json(man, store=self._backend, key=meta["manifest"]), meta,
                                              store=self._backend, key=meta["manifest"])
            if shards is not None:
                # (from the index: no segment read; those of committed rows only, as the shards sized)
                n_segments = sum(1 for e in shards.segments if int(e["first"]) * int(meta["shard_rows"]) < n)
                local = isinstance(self._backend, LocalBackend)
                for k in shards:  # (the shard numbers: no segment read, FORMAT.md section 5)
                    if k * int(meta["shard_rows"]) >= n:
                        continue
                    if not local:  # an object store: as its manifest records them (no request per shard;
                        disk += int(shards[k]["file_bytes"])  # one per segment, read for its records)
                        continue
                    key = self._shard_file(meta, k)
                    try:  # the files as they are
                        disk += int(self._backend.size(key) or 0)
                    except StoreCorruptError:  # (not a regular file: verify names it)
                        pass
                    except StoreError:  # (one this process may not open: sized as it is, as ls would)
                        with contextlib.suppress(OSError, StoreError):
                            st_ = os.stat(self._backend.path(key), follow_symlinks=False)
                            disk += st_.st_size if stat.S_ISREG(st_.st_mode) else 0
            total_raw += raw_bytes
            total_disk += disk
            arrays[hp] = {
                "shape": [n, *feat], "dtype": meta["dtype"], "storage_dtype": F.zarr_dtype(meta["dtype"]),
                "row_kind": meta["row_kind"], "n_rows": n, "bytes": raw_bytes, "bytes_on_disk": disk,
                "compression": (meta.get("compression") or {}).get("name"),
                "data_to_disk_ratio": (raw_bytes / disk) if disk else None,
                "follows_row_table": meta.get("follows_row_table", True),
                "n_manifest_segments": n_segments,
            }
            any_segments = any_segments or n_segments > 0
        # rank stores under ranks/ that consolidate would commit (a capture again of this store, or
        # this uncommitted store's own capture), read as the commit reads them
        # (what cannot be read there is shown, never an info that fails: the store's own rows read as above)
        try:
            pending = pending_ranks(self._backend, self._attrs, opened=dict(self._ranks), cache_bytes=self._cache_bytes)
        except StoreError as e:
            pending = {"capture": "unreadable", "error": " ".join(str(e).split()), "run_id": None, "world_size": None,
                       "ranks": [], "missing": [], "n_missing": 0, "beyond": [], "incomplete": [], "other_runs": [],
                       "ready": False}
        # the reductions' values and states, as their (checked) entries give them, each file once
        reduction_bytes: dict[str, int] = {}
        for hp, entries in (self._attrs.get("reductions") or {}).items():
            sized: dict[str, int] = {}
            for entry in entries.values():
                for part in [entry, *(entry.get("state") or {}).values()]:
                    sized[part["path"]] = math.prod(part["shape"]) * F.itemsize(part["dtype"])
            reduction_bytes[hp] = sum(sized.values())
        return {
            "path": str(self._backend),
            "format": self._attrs.get("format"),
            "format_reason": self._format_reason(any_segments),
            "status": self.status,
            "n_samples": self.n_samples,
            # (False: a store that keeps reductions only, whose reduced hook points are in "reduced")
            "rows_stored": self.rows_stored,
            **({} if self.rows_stored else {"reduced": self.reduced}),
            "arrays": arrays,
            "bytes": total_raw,
            "bytes_on_disk": total_disk,
            "data_to_disk_ratio": (total_raw / total_disk) if total_disk else None,
            "aliases": self.aliases,
            **({"rank_stores": self.ranks} if self._ranks else {}),
            **({"pending_ranks": pending} if pending is not None else {}),
            "reductions": {hp: sorted(v) for hp, v in self._complete_reductions().items()},
            "partial_reductions": {hp: {n: {"n_rows": c[0], "of_rows": c[1]} for n, c in v.items()}
                                   for hp, v in self.partial_reductions.items()},
            "refused_reductions": self.refused_reductions,
            "reduction_bytes": sum(reduction_bytes.values()),
            "hook_point_reduction_bytes": reduction_bytes,
            "row_tables": {k: v.get("n_rows", 0) for k, v in (self._attrs.get("row_tables") or {}).items()},
            # (the columns each row table has: a text capture's token_ids, labels, ...)
            "row_table_columns": {k: list(v.get("columns") or [])
                                  for k, v in (self._attrs.get("row_tables") or {}).items()},
            # (the Parquet parts each row table is split into: FORMAT.md section 4)
            "row_table_parts": {k: len(v.get("parts") or [])
                                for k, v in (self._attrs.get("row_tables") or {}).items()},
            "model": self._attrs.get("model"),
            "provenance": self._attrs.get("provenance"),
            "library": self._attrs.get("library"),
            "created": self._attrs.get("created"),
        }

    def _format_reason(self, segments: bool) -> str | None:
        """Why the store's format version is above 1 (FORMAT.md section 8), or None at version 1.

        ``segments``: whether an array's manifest lists segments (read from the indexes only)."""
        fmt = self._attrs.get("format")
        version = fmt.get("version") if isinstance(fmt, dict) else None
        if version == 1 or not isinstance(version, int) or isinstance(version, bool):
            return None
        ranks = None
        if isinstance(self._attrs.get("distributed"), dict):
            ranks = ("a multi-rank capture, its rank stores not committed yet" if self._ranks
                     else "committed from rank stores")
        if version == 2:
            return ranks or "a multi-rank capture"
        if version == 3:
            return "reductions only, no activation row"
        if version == 4:
            why = ("manifest segments: a long array's full shard records sealed in blocks" if segments else
                   "manifest segments, none listed for the committed rows")
            return f"{why}; {ranks}" if ranks else why
        return None

    # ------------------------------------------------------------------ copies
    def save(self, target: Any, *, overwrite: bool = False, storage_options: dict | None = None) -> "Store":
        """Copy the store to ``target`` (a path, URL or zarr Store); returns it opened.

        Parameters
        ----------
        target : str, os.PathLike, or zarr Store
            Where the copy goes.
        overwrite : bool, default False
            Replace a store already at ``target`` (see :func:`copy_store`).
        storage_options : dict, optional
            The fsspec options (credentials, endpoint) of a URL ``target`` (``s3://...``), as
            :func:`copy_store` takes them.

        Returns
        -------
        Store
            The copy, opened read-only.

        Raises
        ------
        StoreExistsError, StoreLockedError, StoreError, StoreCorruptError, ArgumentTypeError
            As :func:`copy_store` raises them.
        """
        copy_store(self, target, overwrite=overwrite, storage_options=storage_options)
        return open_store(target, storage_options=storage_options)

    def close(self) -> None:
        """Drop the store's own references to its mappings (views keep theirs alive)."""
        for _, st in self._ranks:
            st.close()
        with self._lock:
            dropped = self._clear_mappings()
            self._indexes.clear()
            self._zarrays.clear()
            self._checked.clear()
            self._cache.clear()
            self._cached = 0
        _let_go(dropped)

    def __enter__(self) -> "Store":
        """Return the store; :meth:`close` on exit."""
        return self

    def __exit__(self, *exc: Any) -> None:
        """:meth:`close` the store."""
        self.close()

    def __repr__(self) -> str:
        return f"<Store {str(self._backend)!r} {self.status}, {len(self.hook_points)} hook points, {self.n_samples} samples>"


def _sub_backend(backend: Any, prefix: str) -> Any:
    """The backend of ``<store>/<prefix>`` (a rank store), or None where it cannot be made."""
    if isinstance(backend, LocalBackend):
        from ._backend import _inside

        sub = backend.root / prefix
        if not _inside(os.path.realpath(sub), os.path.realpath(backend.root)):
            raise V.corrupt(backend, f"rank store {prefix!r} is a link leaving the store (FORMAT.md section 9 rule 2)")
        return LocalBackend(sub)
    zstore = getattr(backend, "store", None)
    fs, path = getattr(zstore, "fs", None), getattr(zstore, "path", None)
    if fs is None or path is None:
        return None
    import zarr

    from ._backend import FsspecBackend

    sub = zarr.storage.FsspecStore(fs, read_only=True, path=f"{path.rstrip('/')}/{prefix}")
    return FsspecBackend(sub, label=f"{str(backend).rstrip('/')}/{prefix}")


#: How many commits merging a row table's parts a reader follows while it reads the table
#: (:meth:`Store._later_row_table`) before it asks for a refresh.
_LATER_COMMITS = 3


#: Most rank stores an uncommitted multi-rank store is shown with.
MAX_RANK_VIEW = 1 << 16


def listed_rank_stores(backend: Any) -> list[int]:
    """The ranks whose store (``ranks/<r, 5 digits>/zarr.json``) a listing of ``ranks/`` shows, sorted."""
    ranks = set()
    for key in backend.list("ranks/"):
        parts = key.split("/")
        if len(parts) == 3 and parts[2] == "zarr.json" and parts[1].isdigit() and len(parts[1]) == 5:
            ranks.add(int(parts[1]))
    return sorted(ranks)


def _rank_folders(backend: Any, world: int | None) -> list[int]:
    """The ranks whose store exists under ``ranks/`` (``ranks/<r, 5 digits>/zarr.json``), sorted.

    Every store is asked for ranks 0 .. ``world`` (one past the last, or rank 0 alone when
    ``world`` is None); a local store's folder is listed as well (for ranks further on). An
    object store is not listed: a listing there goes through the filesystem's listing cache,
    which a commit removing the rank stores in another thread at the same time could leave
    stale."""
    # (the listing does not enter a linked rank folder: the ranks asked for below do)
    ranks = set(listed_rank_stores(backend)) if isinstance(backend, LocalBackend) else set()
    for r in range(1 if world is None else world + 1):
        sub = _sub_backend(backend, f"ranks/{r:05d}")
        if sub is not None and sub.get("zarr.json", max_bytes=V.MAX_JSON_BYTES) is not None:
            ranks.add(r)
    return sorted(ranks)


def ranks_run_id(dist: Any) -> str | None:
    """The run whose rank stores an uncommitted multi-rank root shows (``distributed.run_id``,
    FORMAT.md section 10), or None for a root written before rank stores recorded their run."""
    run = dist.get("run_id") if isinstance(dist, dict) else None
    return run if isinstance(run, str) and run else None


def rank_store_run_id(sub: Any) -> str | None:
    """The ``rank_store.run_id`` a rank store records in its root (the run of the multi-rank
    store it was written under), or None when it records none or its root cannot be read."""
    try:
        raw = sub.get("zarr.json", max_bytes=V.MAX_JSON_BYTES)
        run = json.loads(raw)["attributes"][F.ATTRS_KEY]["rank_store"]["run_id"]
    except (TypeError, KeyError, ValueError, RecursionError, StoreError):
        return None
    return run if isinstance(run, str) else None


def split_rank_stores_by_run(backend: Any, ranks: list[int], dist: Any) -> tuple[list[int], list[int]]:
    """``(this run's ranks, other runs' ranks)`` of the rank stores ``ranks``: under a root that
    records ``distributed.run_id``, a rank store is this run's only when its ``rank_store.run_id``
    is that one (a store of the run the root replaced, or one recording no run, is not); under an
    older root, every rank store is (FORMAT.md section 10)."""
    run = ranks_run_id(dist)
    if run is None:
        return list(ranks), []
    mine, other = [], []
    for r in ranks:
        sub = _sub_backend(backend, f"ranks/{r:05d}")
        (mine if sub is None or rank_store_run_id(sub) == run else other).append(r)
    return mine, other


#: The namespace of the run ids of a capture again (:func:`capture_again_run_id`).
_AGAIN_NAMESPACE = uuid.UUID("5b0c3a52-6f0e-4e8f-9a51-3d1c9c2f7e10")


def capture_again_run_id(attrs: dict, raw: bytes) -> str:
    """The run that rank tasks record when they capture again the store whose root document is
    ``raw`` (attributes ``attrs``; FORMAT.md section 10, "Capturing a store again").

    Derived from the root's ``run_id`` (from its bytes when it has none), so that every task of
    the capture finds the same one without talking to the others, and a store committed since
    (a new ``run_id``) gives its next capture again another one."""
    run = attrs.get("run_id")
    seed = run if isinstance(run, str) and run else "sha256:" + hashlib.sha256(raw).hexdigest()
    return uuid.uuid5(_AGAIN_NAMESPACE, seed).hex


def recorded_world_size(backend: Any, ranks: list[int]) -> int | None:
    """The world size the rank stores ``ranks`` record (``rank_store.world_size``), when they
    agree on one; None when none records it or they disagree (each is checked once opened)."""
    sizes = set()
    for r in ranks:
        try:
            attrs = json.loads(backend.get(f"ranks/{r:05d}/zarr.json", max_bytes=V.MAX_JSON_BYTES))
            n = attrs["attributes"][F.ATTRS_KEY]["rank_store"]["world_size"]
        except (ValueError, TypeError, KeyError, RecursionError, StoreCorruptError):
            continue  # an unreadable rank store is named when it is opened
        if isinstance(n, int) and not isinstance(n, bool) and n >= 1:
            sizes.add(n)
    return sizes.pop() if len(sizes) == 1 else None


#: Most missing ranks :func:`pending_ranks` lists (a recorded world size may be any number).
_MAX_LISTED_MISSING = 100


def pending_ranks(backend: Any, attrs: dict, raw: Any = ..., opened: dict[int, "Store"] | None = None,
                  cache_bytes: int = 64 << 20) -> dict | None:
    """What waits under ``ranks/`` of the store at ``backend`` (root attributes ``attrs``, root
    document ``raw``) for ``activationscope consolidate``, as :meth:`Store.info` shows it under
    ``pending_ranks``; None when there is no rank store. The rank stores are read as the commit
    reads them (FORMAT.md section 10): those recording the run that captures the store again
    (:func:`capture_again_run_id`) are that capture; else, under an uncommitted root, those of
    the run its ``distributed.run_id`` names; under a committed root, rank stores its commit
    left (``consolidate`` removes them).

    Parameters
    ----------
    raw : bytes or None, optional
        The root document; read from ``backend`` when left out (only where a rank store is
        listed: a store without one costs one listing of ``ranks/``).
    opened : dict, optional
        ``{rank: Store}`` of rank stores already open (not closed here); the others are opened
        and closed here.

    Returns
    -------
    dict or None
        ``{"capture": "again" | "this" | "left_by_commit" | "other", "run_id": str | None,
        "world_size": int | None, "ranks": [{"rank", "status", "n_samples", "n_rows": {hook
        point: rows}, "world_size"} (and ``"writer"``, ``"pid ... on host ..."``, for an incomplete
        local rank store whose writer lock a live task holds: still being written) | {"rank",
        "error"}], "missing": [int] (at most 100),
        "n_missing": int, "beyond": [int], "incomplete": [int], "other_runs": [int], "ready":
        bool}`` (:meth:`Store.info` shows ``capture`` ``"unreadable"`` and the ``error`` where
        ``ranks/`` cannot be listed or read). ``capture``: ``"again"`` a capture again (its commit replaces the store's rows),
        ``"this"`` the store's own uncommitted capture, ``"left_by_commit"`` what a committed
        store's commit left, ``"other"`` rank stores of no run of this store. ``world_size``: the
        root's ``distributed.world_size`` (``"this"``) or the one the rank stores record (None
        when they disagree). ``missing``: ranks below the world size without a rank store;
        ``beyond``: rank stores at or past it; ``incomplete``: rank stores not complete or that
        do not open (``error`` names why); ``other_runs``: rank stores of another run, no part of
        it. ``ready``: every rank is there and complete, and no other run's rank store lies in
        their places (``consolidate`` may still refuse on what only it checks: layouts, shards).
    """
    ranks = listed_rank_stores(backend)
    if not ranks:
        return None
    if raw is ...:
        raw = backend.get("zarr.json", max_bytes=V.MAX_JSON_BYTES)
    opened = opened or {}
    dist = attrs.get("distributed")
    dist = dist if isinstance(dist, dict) else None

    def run_of(r: int) -> str | None:
        if r in opened:
            rec = opened[r].attrs.get("rank_store")
            run = rec.get("run_id") if isinstance(rec, dict) else None
            return run if isinstance(run, str) else None
        sub = _sub_backend(backend, f"ranks/{r:05d}")
        return None if sub is None else rank_store_run_id(sub)

    runs = {r: run_of(r) for r in ranks}
    again = capture_again_run_id(attrs, raw) if raw is not None else None
    world: Any = None
    if again is not None and again in runs.values():
        capture, run = "again", again
        mine = [r for r in ranks if runs[r] == again]
        world = recorded_world_size(backend, mine)
    elif dist is not None and dist.get("committed") is True:
        capture, run, mine = "left_by_commit", None, list(ranks)
        world = dist.get("world_size")
    elif dist is not None and dist.get("committed") is False:
        capture, run = "this", ranks_run_id(dist)
        mine = [r for r in ranks if run is None or runs[r] == run]
        world = dist.get("world_size")
    else:
        capture, run, mine = "other", None, []
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        world = None  # (read from a store: a world size that is not one tells nothing)
    entries, incomplete = [], []
    for r in mine:
        st, own = opened.get(r), False
        if st is None:
            try:
                sub = _sub_backend(backend, f"ranks/{r:05d}")
                if sub is None:
                    raise StoreError(f"rank store 'ranks/{r:05d}' cannot be opened")
                st, own = Store(sub, cache_bytes=cache_bytes, _rank_view=False), True
            except StoreError as e:
                entries.append({"rank": r, "error": " ".join(str(e).split())})
                incomplete.append(r)
                continue
        try:
            rec = st.attrs.get("rank_store")
            n = rec.get("world_size") if isinstance(rec, dict) else None
            entries.append({"rank": r, "status": st.status, "n_samples": st.n_samples,
                            "n_rows": {hp: st.n_rows(hp) for hp in st.hook_points},
                            "world_size": n if isinstance(n, int) and not isinstance(n, bool) else None})
            if st.status != "complete":
                incomplete.append(r)
                from ._lock import writer_holding  # (a local lock is held only by a live writer)

                holder = writer_holding(st._backend) if isinstance(st._backend, LocalBackend) else None
                if holder is not None:
                    entries[-1]["writer"] = holder
        finally:
            if own:
                st.close()
    present = set(mine)
    missing = [] if world is None else list(itertools.islice(
        (r for r in range(world) if r not in present), _MAX_LISTED_MISSING))
    n_missing = 0 if world is None else world - len([r for r in present if r < world])
    beyond = [] if world is None else [r for r in mine if r >= world]
    others = [r for r in ranks if r not in present]
    ready = (capture == "left_by_commit" or (
        capture in ("again", "this") and world is not None and bool(mine) and not n_missing and not beyond
        and not incomplete and not [r for r in others if r < world]))
    return {"capture": capture, "run_id": run, "world_size": world, "ranks": entries, "missing": missing,
            "n_missing": n_missing, "beyond": beyond, "incomplete": incomplete, "other_runs": others,
            "ready": ready}


def other_feature_shape(hp: str, r: int, shape: Any, first: int, first_shape: Any) -> tuple[str, str]:
    """Why rank stores of one capture hold hook point ``hp`` with other feature shapes (the
    same options and model, inputs of other sizes), and what to do: the errors of the
    uncommitted view and of the commit."""
    why = (f"rank {r} stores hook point {hp!r} with feature shape {shape}, rank {first} with {first_shape}: the "
           "model gave activations of other shapes on the two ranks, so their inputs had other sizes (sequences "
           "of another length without an attention mask, images of another size)")
    fix = ("give every rank inputs of one size (pad or crop them; for one row per token, give set_batch an attention "
           f"mask), then capture rank {r} again (store_options overwrite=True and the same process_group "
           f"RankStore({r}, world size)), or rank {first} if its sizes were the wrong ones")
    return why, fix


def _rank_view(store: "Store", attrs: dict, dist: dict) -> tuple[dict, list, dict]:
    """The root metadata of an uncommitted multi-rank store, showing its rank stores' rows.

    Every rank store of the root's run that exists is opened (read-only, validated as any
    store; one of another run is left out, and listed in ``distributed.other_runs``); each hook
    point's rows are rank 0's committed rows, then rank 1's, ... (no copy: reads go to the
    rank stores' shards), the row tables are the ranks' tables in the same order with a
    ``rank`` column (FORMAT.md section 10). Status stays ``incomplete``; no reductions (the
    ranks have not been merged).
    """
    world = dist.get("world_size")
    valid = not isinstance(world, bool) and isinstance(world, int) and 1 <= world <= MAX_RANK_VIEW
    present = _rank_folders(store._backend, world if valid else None)  # rank stores that exist (their zarr.json)
    present, other = split_rank_stores_by_run(store._backend, present, dist)
    if other:  # another run's (an overwrite killed before it removed them): none of their rows is this run's
        attrs = {**attrs, "distributed": {**dist, "other_runs": other}}
        dist = attrs["distributed"]
    beyond = present if not valid else [r for r in present if r >= world]
    if beyond:  # their rows would be left out of the view without a word
        shown = f"{beyond[:10]}"[:-1] + (f", ...] ({len(beyond)} in all)" if len(beyond) > 10 else "]")
        raise V.corrupt(store._backend, (
            f"the root's distributed.world_size is {world!r}, " + (
                f"but rank stores {shown} under 'ranks/' lie beyond ranks 0..{world - 1}" if valid else
                f"not a number of ranks in 1..{MAX_RANK_VIEW}, and rank stores {shown} exist under 'ranks/'")
            + ": the store would show only part of its rows. Restore the root zarr.json (its world_size is the "
            "number of ranks that captured it), or move rank stores that belong to another capture away"))
    if not valid:
        return attrs, [], {}
    ranks: list[tuple[int, Store]] = []
    for r in present:
        sub = _sub_backend(store._backend, f"ranks/{r:05d}")
        if sub is None:
            return attrs, [], {}
        st = Store(sub, cache_bytes=store._cache_bytes, verify=store._verify_reads, _rank_view=False)
        recorded = (st.attrs.get("rank_store") or {}).get("rank") if isinstance(st.attrs.get("rank_store"), dict) else None
        if recorded is not None and recorded != r:  # another rank's store (a copy, or a link to it) shown twice
            raise V.corrupt(store._backend, f"rank store 'ranks/{r:05d}' records rank {recorded!r} (rank_store.rank in "
                                            f"its zarr.json), but is stored as rank {r}")
        ranks.append((r, st))
    if not ranks:
        return attrs, [], {}
    arrays: dict[str, dict] = {}
    parts: dict[str, list[tuple[int, Store, int]]] = {}
    layout = ("row_kind", "feature_shape", "dtype")
    for r, st in ranks:
        for hp in st.attrs.get("arrays", {}):
            meta = st.attrs["arrays"][hp]
            if hp in arrays and any(arrays[hp][k] != meta[k] for k in layout):
                first = arrays[hp]["ranks"][0]["rank"]
                if all(arrays[hp][k] == meta[k] for k in layout if k != "feature_shape"):
                    why, fix = other_feature_shape(hp, r, meta["feature_shape"], first, arrays[hp]["feature_shape"])
                    raise V.corrupt(store._backend, f"{why}, and their rows cannot be shown as one array",
                                    f"{fix}; until then each rank store opens on its own: "
                                    f"open_store('{str(store._backend).rstrip('/')}/ranks/{r:05d}')")
                raise V.corrupt(
                    store._backend,
                    f"rank {r} stores hook point {hp!r} as {dict((k, meta[k]) for k in layout)}, rank {first} as "
                    f"{dict((k, arrays[hp][k]) for k in layout)} (row kind, feature shape, dtype): the rank stores "
                    "were captured with other options, and their rows cannot be shown as one array",
                    f"capture rank {r} again with the options of rank {first} (store_options overwrite=True and the "
                    f"same process_group RankStore({r}, world size)); until then each rank store opens on its own: "
                    f"open_store('{str(store._backend).rstrip('/')}/ranks/{r:05d}')")
            entry = arrays.setdefault(hp, {**meta, "n_rows": 0, "ranks": [], "follows_row_table": True})
            parts.setdefault(hp, []).append((r, st, int(entry["n_rows"])))
            entry["n_rows"] += st.n_rows(hp)
            entry["ranks"].append({"rank": r, "n_rows": st.n_rows(hp)})
    tables = {kind: sum(int(((st.attrs.get("row_tables") or {}).get(kind) or {}).get("n_rows", 0)) for _, st in ranks)
              for kind in ("sample", "token")}
    for hp, entry in arrays.items():  # row i of the array is row i of the table: every rank's counts agree
        kind = entry["row_kind"]
        entry["follows_row_table"] = all(
            st.follows_row_table(hp) and st.n_rows(hp) == int(((st.attrs.get("row_tables") or {}).get(kind) or {})
                                                              .get("n_rows", 0)) if hp in st.attrs["arrays"]
            else int(((st.attrs.get("row_tables") or {}).get(kind) or {}).get("n_rows", 0)) == 0
            for _, st in ranks)
    view = {
        **attrs, "status": "incomplete", "arrays": arrays, "reductions": {}, "aliases": {},
        "model": ranks[0][1].attrs.get("model"), "capture_config": ranks[0][1].attrs.get("capture_config", {}),
        "storage_dtype": ranks[0][1].attrs.get("storage_dtype"),
        "n_samples": sum(st.n_samples for _, st in ranks),
        "n_batches": sum(int(st.attrs.get("n_batches", 0)) for _, st in ranks),
        "row_tables": {k: {"parts": [], "n_rows": n, "columns": []} for k, n in tables.items()},
        "distributed": {**dist, "view": "ranks", "ranks": [
            {"rank": r, "status": st.status, "n_samples": st.n_samples} for r, st in ranks]},
    }
    return view, ranks, parts


def open_store(target: Any, *, cache_bytes: int = 64 << 20, storage_options: dict | None = None,
               verify: bool = False) -> Store:
    """Open a store read-only.

    Parameters
    ----------
    target : str, os.PathLike, or zarr Store
        Local path, ``file://`` / ``memory://`` / ``s3://`` URL, or a zarr ``Store``.
    cache_bytes : int, default 64 MiB
        Bound of the cache of decoded chunks (compressed / remote arrays), in bytes.
    verify : bool, default False
        Also check the crc32c of every chunk of a memory-mapped (local, uncompressed) shard,
        once, the first time a row of the shard is read: reads stay zero-copy views, but each
        shard's bytes are read once more (about the cost of reading it). Decoded reads check
        every chunk whatever this says. Off, flipped bytes inside a mapped shard read as they
        are (``verify()`` finds them).
    storage_options : dict, optional
        fsspec options of a URL ``target`` (credentials, ``client_kwargs``).

    Raises
    ------
    StoreError
        Nothing at ``target`` (a local path names the stores beside it of a close name, a
        typo's ``run.zar`` the store ``run.zarr``), not an activationscope store, or a newer
        format version; a folder inside a store (`acts`, an array's folder, ...) names the
        store to open instead.
    StoreCorruptError
        The root metadata breaks a rule of FORMAT.md §9 (the message names the field).

    Warns
    -----
    UserWarning
        A local store that lists no committed forward while a folder next to it
        (``.<name>.replaced-<hex>``) holds the store an ``overwrite=True`` moved aside: the rows
        a reader expected are there (FORMAT.md section 7). Nothing is said of files a killed
        writer left that nothing reads, such a folder's remains included: :meth:`Store.leftovers`
        and ``verify`` name those.

    Example
    -------
    >>> store = open_store("runs/demo.zarr")              # doctest: +SKIP
    >>> store["encoder.layer.0.output"].shape             # doctest: +SKIP
    """
    if isinstance(target, Store):
        return target
    return Store(target, cache_bytes=cache_bytes, storage_options=storage_options, verify=verify)


def _reopen_pickled(target: str, options: dict, run: Any, pid: int) -> Store:
    """The store a pickled :class:`Store` names (``Store.__reduce__``), opened again.

    Raises
    ------
    StoreError
        Nothing there (a ``memory://`` store pickled to another process: it lives only in
        the one that made it), or another run than the pickled store's."""
    try:
        st = Store(target, **options)
    except StoreError as e:
        if target.startswith("memory:") and pid != os.getpid():
            raise StoreError(
                f"no store at {target!r} in this process (pid {os.getpid()}): a memory:// store exists only inside "
                f"the process that made it (pid {pid}), and it was pickled to another one (a DataLoader worker "
                "started with 'spawn' or 'forkserver'); use multiprocessing_context='fork', num_workers=0, or a "
                "store on a local path"
            ) from e
        raise
    if run is not None and st._run != run:
        raise StoreError(
            f"the store at {target!r} holds another run than when it was pickled (run {run[0] or run[1]} then, "
            f"{'none' if st._run is None else st._run[0] or st._run[1]} now): another run was written in its place; "
            "open it again (open_store) to read the new run"
        )
    return st


def _committed_shard_files(source: Any) -> dict[str, str]:
    """``{key: file}`` of the shards whose committed chunks, and the reduction files whose
    committed bytes, a reader of ``source`` (a Store or a backend) reads from another file
    than the key (:meth:`Store._shard_file`, :meth:`Store._reduction_file`: a resume killed
    while it committed); empty when it does not open as a store."""
    try:
        st = source if isinstance(source, Store) else Store(source)
        out = {}
        for hp in st.hook_points:
            meta = st._checked_meta(hp)
            n, shard_rows = int(meta["n_rows"]), int(meta["shard_rows"])
            if n % shard_rows:
                key = st._shard_key(meta, n // shard_rows)
                got = st._shard_file(meta, n // shard_rows)
                if got != key:
                    out[key] = got
        # (likewise the files of reductions a resume rewrote but no root lists: FORMAT.md section 6)
        for doc, files in F.committed_reduction_groups(st._attrs.get("reductions")):
            kept = False
            for key, crc in files.items():
                got = st._reduction_file(key, crc)
                if got != key:
                    out[key], kept = got, True
            if doc is not None and st._reduction_document(doc, kept) != doc:
                out[doc] = F.kept_reduction_key(doc)
        return out
    except (StoreError, OSError):  # (not a store: its files are copied as they are)
        return {}


def _refuse_newer_format(src: Any, dst: Any) -> None:
    """Refuse to copy a store of a format version this reader does not know: which of its files
    make up the store (temporary files are left out, kept files read instead of damaged ones) is
    known only for the versions it reads, so such a copy could miss files. A root that does not
    parse, or names no version, is copied as it is (a damaged store may still be salvaged)."""
    try:
        attrs = json.loads(src.get("zarr.json", max_bytes=V.MAX_JSON_BYTES) or b"")["attributes"]["activationscope"]
        V.check_format(attrs, store=src)
    except (ValueError, KeyError, TypeError, StoreCorruptError):
        return
    except StoreError as e:  # a newer version
        raise StoreError(
            f"source of copy_store: {e} to copy it, or copy its folder as it is (cp -a, rsync -a, tar) while no "
            f"writer runs; nothing was copied and the target {str(dst)!r} was not changed") from None


def _refuse_copy_onto_itself(src: Any, dst: Any) -> None:
    """Refuse a copy whose target is its source, or a folder holding it, or inside it
    (symlinks resolved): clearing the target would delete what the copy reads."""
    if isinstance(src, LocalBackend) and isinstance(dst, LocalBackend):
        a, b = os.path.realpath(src.root), os.path.realpath(dst.root)
    elif isinstance(src, LocalBackend) or isinstance(dst, LocalBackend):
        return
    elif getattr(src, "store", None) is not None and src.store is getattr(dst, "store", None):
        a = b = str(src)
    else:
        a, b = str(src).rstrip("/"), str(dst).rstrip("/")
    if a == b or a.startswith(b.rstrip("/") + "/") or b.startswith(a.rstrip("/") + "/"):
        raise StoreError(f"cannot copy store {str(src)!r} onto {str(dst)!r}: that is the store itself, a folder "
                         "holding it or a folder inside it, and the copy would delete what it reads; copy it to "
                         "another path")


#: Times copy_store copies a source that a writer commits to meanwhile before it gives up.
_COPY_ATTEMPTS = 3


def _copy_write(dst: Any, key: str, data: bytes) -> None:
    """One write of :func:`copy_store` into the target ``dst``; a failed one (a full disk)
    raises :class:`StoreError` saying what the target is left as and how to go on."""
    try:
        dst.set(key, data)
    except StoreError as e:
        if isinstance(e, StoreCorruptError):
            raise
        raise StoreError(
            f"copy_store into {str(dst)!r}: {e}; the target is left an incomplete store with no rows (the files "
            "copied so far take their space until it is replaced or deleted): once the cause is fixed, copy again "
            "with overwrite=True") from e


def _refuse_folded_keys(src: Any, dst: LocalBackend) -> None:
    """copy_store into a local folder whose file system folds case and Unicode normalization
    (macOS, Windows): refuse a source two of whose objects would be one file there (the
    arrays of hook points ``d.Attn.output`` and ``d.attn.output``, stored apart on Linux or
    object storage), before anything is written: the copy would read the rows of one as the
    other's."""
    seen: dict[str, str] = {}
    probed: dict[tuple[str, str], bool] = {}
    for key in sorted(src.list("")):
        if key.endswith(".tmp"):
            continue
        other = seen.setdefault(F.folded(key), key)
        if other == key:
            continue
        a, b = next((x, y) for x, y in zip(other.split("/"), key.split("/")) if x != y)  # the names that differ
        if (a, b) not in probed:
            probed[(a, b)] = folds_names(dst.root, a, b)
        if probed[(a, b)]:
            raise StoreError(
                f"source {str(src)!r} of copy_store holds {other!r} and {key!r}{F.spelled_alike(other, key)}, which "
                f"differ only in case or Unicode normalization, and the file system of {str(dst)!r} does not tell "
                f"such names apart: the copy would hold them as one file, and read the rows of one hook point as "
                f"another's; nothing was copied. Copy to a case-sensitive file system or to object storage"
            )


def copy_store(source: Any, target: Any, *, overwrite: bool = False, storage_options: dict | None = None) -> None:
    """Copy every object of a store (e.g. an in-memory one) to ``target``; root metadata last.

    Parameters
    ----------
    source : str, os.PathLike, zarr Store, or Store
        A local path, an fsspec URL (``s3://bucket/run.zarr``), a zarr Store, or an opened
        :class:`Store` (which reads with the options it was opened with).
    target : str, os.PathLike, or zarr Store
        A local path, an fsspec URL or a zarr Store.
    overwrite : bool, default False
        Replace a store already at ``target`` (see Raises for what is never replaced).
    storage_options : dict, optional
        The fsspec options (credentials, ``client_kwargs={"endpoint_url": ...}``) of
        whichever of ``source`` and ``target`` is a URL; to copy between two services that
        need different ones, pass the source opened (``open_store(url, storage_options=...)``).

    The target's first write is the root of a new, incomplete store with no rows (over the old
    root, with ``overwrite``); then the old store's objects are deleted and the source's copied.
    A copy killed partway leaves an incomplete store listing no row (never the old root over
    missing files): run it again with ``overwrite=True`` (FORMAT.md section 7).

    Temporary files (``*.tmp``: a writer's, or left by one killed) are not copied; a shard
    or reduction file whose committed bytes a reader reads from the file a killed resume
    kept (``<key>.committed.tmp``, FORMAT.md sections 6 and 7) is copied from that file (also
    when the key's own file is damaged: a folder, a FIFO, a symlink leaving the store).

    Raises
    ------
    StoreExistsError
        ``target`` is not empty and ``overwrite`` is False; or, with ``overwrite``, it holds
        no Zarr store (a folder of other files is never cleared), or is a store whose folder
        (or prefix) also holds entries that are not the store's. Nothing is changed.
    StoreLockedError
        A writer holds ``target``; or, with ``overwrite`` replacing a store at ``target``, a
        writer holds ``source`` (a process holds its lock file's ``flock``, or its lock marker exists;
        a lock file left by a writer killed elsewhere is none):
        a copy of a store being written may fail after the old store was deleted. Nothing is
        changed; copy into a new path, or once the writer has finished.
    StoreError
        ``target`` is a local path inside another store, or the source itself, a folder
        holding it or a folder inside it (symlinks resolved); nothing is deleted. Or the
        source's root document changed while its objects were copied, three times in a row (a
        capture writing it commits meanwhile): the target is left an incomplete store with no
        rows. A source a writer commits to is copied as the commit its root named when the copy
        started, whenever no commit lands while the copy runs. Or the source's root names a
        format version newer than this reader's (its files are known only to a newer
        activationscope); nothing is changed.
        Or ``target`` is a local folder whose file system takes two of the source's objects for
        one file (names that differ only in case or Unicode normalization, on macOS or Windows);
        nothing is copied. Or, with ``overwrite``, ``target`` is a local store with a folder this
        process may not write in (a read-only mount, a store of another user); nothing is changed.
    StoreCorruptError
        The source holds a file that is not a regular file inside it (a symlink leaving it,
        a FIFO, a device): nothing is copied through it.
    ArgumentTypeError
        ``overwrite`` that is not a bool; nothing is changed.
    """
    from ..errors import StoreExistsError

    from ._lock import WriterLock, writer_holding

    overwrite = F.parse_flag(overwrite, "overwrite")  # (overwrite="False" is a true string)
    src = source._backend if isinstance(source, Store) else resolve(source, read_only=True,
                                                                    storage_options=storage_options)
    dst = resolve(target, storage_options=storage_options)
    if src.size("zarr.json") is None:  # (a mistyped source would replace the target with an empty store)
        moved = src.moved_aside_hint() if isinstance(src, LocalBackend) else ""
        raise StoreError(f"source {str(src)!r} of copy_store must be a store, got a path with no root document "
                         f"(zarr.json){f': {moved}' if moved else '; check the path'}; nothing was copied and "
                         f"the target {str(dst)!r} was not changed")
    _refuse_newer_format(src, dst)
    check_backend_not_in_store(dst)  # its objects would land among another store's
    check_remote_store_path(dst)  # (an object at the target's own path: its store would sit beside it)
    with WriterLock(dst):  # no writer may be writing the target meanwhile
        _refuse_copy_onto_itself(src, dst)
        moved = dst.moved_aside_hint() if isinstance(dst, LocalBackend) else ""
        if moved:  # (an empty folder too: the whole old store is in the folder aside)
            raise StoreExistsError(f"{str(dst)!r} holds no root document (zarr.json): {moved}; then copy "
                                   "again; nothing was changed")
        if not dst.is_empty():
            if not overwrite:
                raise StoreExistsError(f"{str(dst)!r} is not empty; pass overwrite=True to replace it")
            # as StoreWriter(overwrite=True): a store is replaced, nothing else (a folder of one's own files,
            # or a store's folder holding other entries, was cleared with it)
            if dst.size("zarr.json") is None:
                raise StoreExistsError(
                    f"{str(dst)!r} exists and is not empty but holds no Zarr store; choose another path or remove it "
                    "(overwrite=True only replaces stores); nothing was changed")
            refuse_foreign_entries(dst)
            # a copy of a store being written may fail (a commit landing during every attempt) after the
            # target's store was deleted: the store overwrite replaces goes only for a copy that can finish
            holder = writer_holding(src)
            if holder is not None:
                from ..errors import StoreLockedError

                from ._backend import LOCK_KEY

                gone = f"; if that writer is gone (killed on another host), delete {str(src).rstrip('/')}/{LOCK_KEY}"
                raise StoreLockedError(
                    f"source {str(src)!r} of copy_store is being written by {holder}: a commit landing while it is "
                    f"copied makes the copy start again, and after {_COPY_ATTEMPTS} it fails, when overwrite=True "
                    f"would already have deleted the store at {str(dst)!r}; nothing was changed. Copy once the writer "
                    f"has finished (activationscope info shows status complete), or copy into a new path (a copy "
                    f"failing there loses nothing){gone}")
            # the old store's files go from every one of its folders: one this process may not write in
            # would stop the copy after the old root was replaced, the old rows unreadable (FORMAT.md section 7)
            found = dst.unwritable_folder() if isinstance(dst, LocalBackend) else None
            if found is not None:
                raise StoreError(
                    f"copy_store cannot replace the store at {str(dst)!r}: this process may not write in its folder "
                    f"{found[0]!r} ({found[1]}), and replacing it deletes the files of every folder of the store; "
                    "nothing was changed. Copy into a new path, or ask the store's owner for write permission")
        if isinstance(dst, LocalBackend):
            _refuse_folded_keys(src, dst)
        # FORMAT.md section 7: the root of the copy's run comes first (incomplete, no rows), over the old
        # store's root, then the old objects go, then the copy's objects, its own root last. Killed at any
        # point, the target is the old store intact or an incomplete store listing no row of the old one;
        # copy_store(..., overwrite=True) again completes it
        write_root_first(dst, F.first_root_attrs(uuid.uuid4().hex, F.utc_now()), replacing=True)
        for _ in range(_COPY_ATTEMPTS):
            # the source's root is read before its objects, and the copy is of that commit only if the
            # root is the same after them: a writer committing meanwhile (a capture still running) writes
            # its objects first and its root last, so a root read at the end could list rows, shards or
            # reductions that the objects copied before it do not hold
            root = src.get("zarr.json")
            files = _committed_shard_files(source if isinstance(source, Store) else src)
            # (a key read from its kept file is copied even when its own is a folder, which lists no file by
            # that name; the files inside such a folder are no part of the store)
            keys = sorted(set(src.list("")) | set(files))
            in_damaged = tuple(key + "/" for key in files)
            for key in keys:
                # (temporary files are no part of the store)
                if key == "zarr.json" or key.endswith(".tmp") or key.startswith(in_damaged):
                    continue
                data = src.get(files.get(key, key), max_bytes=None)  # regular files inside the store only (links are refused)
                if data is not None:
                    _copy_write(dst, key, data)
            if src.get("zarr.json") == root:
                break
        else:
            raise StoreError(
                f"source {str(src)!r} of copy_store was committed again while it was copied, {_COPY_ATTEMPTS} times "
                f"(a capture or resume is writing it), so the copy would not be one commit of it; the target "
                f"{str(dst)!r} is left an incomplete store with no rows: copy again once the writer has finished "
                f"(activationscope info shows status complete), with overwrite=True")
        if root is not None:
            _copy_write(dst, "zarr.json", root)
