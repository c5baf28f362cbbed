"""The read side: :func:`open_store` and :class:`Store`.

Local, uncompressed arrays are read as zero-copy views of memory-mapped shard files
(``MAP_PRIVATE``: writing into a returned tensor changes only the process's copy, never the
file). Local compressed arrays are decoded chunk by chunk from the shard files on a small
thread pool (``_decode``): the chunks of one read side by side, and the next chunks of a
sequential reader ahead of it. Remote arrays are decoded through zarr-python. Decoded chunks
go through a bounded cache.
"""

from __future__ import annotations

import ctypes
import io
import json
import mmap
import os
import threading
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any, Iterator

import numpy as np
import torch

from .. import _native
from ..errors import HookPointNotFoundError, ReductionResults, StoreCorruptError, StoreError
from . import _decode
from . import _format as F
from ._backend import LocalBackend, ZarrBackend, resolve

_C = _native.load()


# shard index entry of a chunk that is not there (Zarr sharding: 2**64 - 1)
_MISSING = np.uint64(2**64 - 1)

#: Read-ahead of a sequential reader of memory-mapped rows: the next READ_AHEAD_BYTES after a
#: read are advised (``madvise(MADV_WILLNEED)``), renewed when less than half is left.
READ_AHEAD_BYTES = 16 << 20
_MADV_WILLNEED = 3


def _load_madvise() -> Any:
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):  # not a POSIX libc: no hints, reads work the same
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_madvise = _load_madvise()


def _will_need(addr: int, nbytes: int) -> None:
    """Ask the kernel to start reading the pages of ``[addr, addr + nbytes)`` of a file
    mapping (asynchronous; a hint, errors ignored): page faults on them then find the data
    in the page cache instead of waiting for one read-around each."""
    if _madvise is None or nbytes <= 0:
        return
    lo = addr - addr % mmap.PAGESIZE
    _madvise(lo, nbytes + (addr - lo), _MADV_WILLNEED)


class _Reductions(Mapping):
    """``store.reductions[hook_point][name] -> Tensor`` (read on access)."""

    def __init__(self, store: "Store") -> None:
        self._store = store

    def __getitem__(self, hook_point: str) -> dict[str, torch.Tensor]:
        entries = self._store._attrs.get("reductions", {}).get(hook_point)
        if entries is None:
            raise HookPointNotFoundError(
                f"hook point {hook_point!r} has no reductions in this store; hook points with reductions: {list(self)}"
            )
        return ReductionResults(hook_point, {name: self._store._read_small(e) for name, e in entries.items()})

    def __iter__(self) -> Iterator[str]:
        return iter(self._store._attrs.get("reductions", {}))

    def __len__(self) -> int:
        return len(self._store._attrs.get("reductions", {}))


class Store:
    """A read-only activationscope store (a snapshot of its last commit).

    Made by :func:`open_store`. Attributes and arrays reflect the commit that was current
    when the store was opened (or :meth:`refresh` was called): a writer appending at the same
    time never shows a partial commit.

    Parameters
    ----------
    target : str, os.PathLike, or zarr Store
    cache_bytes : int, default 64 MiB
        Bound of the cache of decoded chunks (compressed / remote arrays).
    """

    def __init__(self, target: Any, *, cache_bytes: int = 64 << 20, storage_options: dict | None = None) -> None:
        self._backend = resolve(target, read_only=True, storage_options=storage_options)
        self._cache_bytes = int(cache_bytes)
        self._cache: OrderedDict[tuple, torch.Tensor] = OrderedDict()
        self._cached = 0
        self._maps: dict[str, tuple[mmap.mmap, bool]] = {}
        self._whole: dict[str, tuple[int, torch.Tensor]] = {}
        self._zarrays: dict[str, Any] = {}
        self._lock = threading.RLock()
        self._indexes: dict[str, tuple[np.ndarray, int]] = {}  # shard file -> (checked index, size)
        self._inflight: dict[tuple, Any] = {}  # (hook point, chunk) -> Future of its decode
        self._next_start: dict[str, int] = {}  # where a sequential reader of a hook point goes next
        self._advised: dict[str, tuple[int, int]] = {}  # hook point -> (last hinted start, advised until row)
        self._pid = os.getpid()
        self.refresh()

    # ------------------------------------------------------------------ metadata
    def refresh(self) -> None:
        """Re-read the root metadata (see rows committed since opening)."""
        raw = self._backend.get("zarr.json")
        if raw is None:
            raise StoreError(f"no store at {str(self._backend)!r} (no zarr.json)")
        doc = json.loads(raw)
        attrs = doc.get("attributes", {}).get(F.ATTRS_KEY)
        if attrs is None:
            raise StoreError(f"{str(self._backend)!r} is a Zarr node but not an activationscope store")
        fmt = attrs.get("format") or {}
        if fmt.get("name") != F.FORMAT_NAME or int(fmt.get("version", 0)) > F.FORMAT_VERSION:
            raise StoreError(
                f"{str(self._backend)!r} has store format {fmt!r}; this version reads {F.FORMAT_NAME} up to "
                f"v{F.FORMAT_VERSION} (upgrade activationscope)"
            )
        with self._lock:
            self._attrs = attrs
            self._zarrays.clear()
            self._cache.clear()
            self._cached = 0
            self._indexes.clear()

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
        """Names of the stored hook points (``acts/<hook point>``), in capture order."""
        return list(self._attrs.get("arrays", {}))

    @property
    def n_samples(self) -> int:
        """Committed samples (rows of the sample row table); 0 for a store killed before its
        first commit."""
        return int(self._attrs.get("n_samples", 0))

    @property
    def path(self) -> str:
        """Where the store lives: a local directory or a URL."""
        return str(self._backend)

    def _meta(self, hook_point: str) -> dict:
        try:
            return self._attrs["arrays"][hook_point]
        except KeyError:
            raise HookPointNotFoundError(
                f"hook point {hook_point!r} is not in the store {str(self._backend)!r}; it has {self.hook_points}"
            ) from None

    def n_rows(self, hook_point: str) -> int:
        """Committed rows of a hook point."""
        return int(self._meta(hook_point)["n_rows"])

    def row_kind(self, hook_point: str) -> str:
        """``"sample"`` or ``"token"``."""
        return self._meta(hook_point)["row_kind"]

    def feature_shape(self, hook_point: str) -> tuple[int, ...]:
        """Shape of one row of ``hook_point`` (its array is ``(rows, *feature_shape)``).

        Raises
        ------
        HookPointNotFoundError
            ``hook_point`` is not in the store.
        """
        return tuple(self._meta(hook_point)["feature_shape"])

    def dtype(self, hook_point: str) -> torch.dtype:
        """The stored torch dtype of ``hook_point`` (``torch.bfloat16`` included).

        Raises
        ------
        HookPointNotFoundError
            ``hook_point`` is not in the store.
        """
        return F.torch_dtype(self._meta(hook_point)["dtype"])

    def __contains__(self, hook_point: object) -> bool:
        """Whether ``hook_point`` is stored."""
        return hook_point in self._attrs.get("arrays", {})

    def __len__(self) -> int:
        """Number of stored hook points."""
        return len(self.hook_points)

    def __iter__(self) -> Iterator[str]:
        """Iterate over the stored hook point names."""
        return iter(self.hook_points)

    # ------------------------------------------------------------------ arrays
    def __getitem__(self, key: Any) -> torch.Tensor:
        """``store[hook_point]`` or ``store[hook_point, start:stop]``.

        Returns
        -------
        Tensor, (rows, *feature_shape), the stored dtype, CPU
            A zero-copy view of the memory-mapped shard when the array is local and
            uncompressed and the rows lie in one shard (the view keeps the mapping alive;
            writing into it never changes the file); otherwise one copy.
        """
        if isinstance(key, tuple):
            if len(key) != 2 or not isinstance(key[1], slice):
                raise TypeError(f"store[...] takes a hook point or (hook point, slice), got {key!r}")
            hook_point, sl = key
        else:
            hook_point, sl = key, slice(None)
        n = self.n_rows(hook_point)
        start, stop, step = sl.indices(n)
        if step != 1:
            return self._read_rows(hook_point, start, stop)[::step] if stop > start else self._read_rows(hook_point, 0, 0)
        return self._read_rows(hook_point, start, max(start, stop))

    def array(self, hook_point: str) -> torch.Tensor:
        """Same as ``store[hook_point]``."""
        return self[hook_point]

    def segments(self, hook_point: str) -> list[int]:
        """Row boundaries ``[0, ..., n_rows]`` of the units of zero-copy memory.

        One segment ``[0, n_rows]`` when the array's shards are mapped back to back as one
        view (local, uncompressed, the default layout); otherwise one segment per shard.
        ``rows(hook_point, a, b)`` within one segment is a view; across segments one copy.
        """
        meta = self._meta(hook_point)
        n, shard_rows = int(meta["n_rows"]), int(meta["shard_rows"])
        if (n > shard_rows and isinstance(self._backend, LocalBackend) and meta.get("compression") is None
                and self._whole_rows(meta) is not None):
            return [0, n]
        return list(range(0, n, shard_rows)) + [n]

    def rows(self, hook_point: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``[start, stop)`` of a hook point (a view within one shard, else one copy)."""
        n = self.n_rows(hook_point)
        if not (0 <= start <= stop <= n):
            raise IndexError(f"rows [{start}, {stop}) out of range for hook point {hook_point!r} with {n} rows")
        return self._read_rows(hook_point, start, stop)

    def will_read(self, hook_point: str, start: int, stop: int) -> None:
        """Hint that rows ``[start, stop)`` of a hook point are read next (cold reads).

        For a local uncompressed array, the kernel is asked to start reading those rows'
        pages (``madvise(MADV_WILLNEED)`` on the mapping) before they are touched, and, for a
        reader that moves forward (each hinted read starting at or after the last one, at
        most half a read-ahead past the advised range: sequential batches, also when
        DataLoader workers take turns), the next ``READ_AHEAD_BYTES`` after them, so that
        the disk reads ahead of the consumer instead of one page-fault read-around at a
        time. Costs one ``madvise`` per
        about 8 MiB read when the pages are already cached. Other arrays: nothing.
        ``ActivationDataset`` calls it for every contiguous batch.
        """
        meta = self._meta(hook_point)
        n = int(meta["n_rows"])
        if _madvise is None or not isinstance(self._backend, LocalBackend) or meta.get("compression") is not None:
            return
        start, stop = max(0, int(start)), min(n, int(stop))
        if stop <= start:
            return
        feat = tuple(meta["feature_shape"])
        row_bytes = (int(np.prod(feat)) if feat else 1) * F.itemsize(meta["dtype"])
        if row_bytes == 0:
            return
        ahead_rows = max(1, READ_AHEAD_BYTES // row_bytes)
        with self._lock:
            last_start, until = self._advised.get(hook_point, (-1, 0))
            forward = last_start <= start <= until + ahead_rows // 2  # small gaps: workers taking turns
            if forward and stop + ahead_rows // 2 <= until:
                self._advised[hook_point] = (start, until)
                return  # already advised
            lo = max(start, until) if forward else start
            hi = min(n, stop + ahead_rows) if (forward or start == 0) else stop
            self._advised[hook_point] = (start, hi)
        self._advise_rows(meta, lo, hi, row_bytes)

    def _advise_rows(self, meta: dict, lo: int, hi: int, row_bytes: int) -> None:
        shard_rows = int(meta["shard_rows"])
        whole = None
        if hi - 1 >= shard_rows:
            whole = self._whole_rows(meta)
        if whole is not None:
            _will_need(whole.data_ptr() + lo * row_bytes, (hi - lo) * row_bytes)
            return
        s = lo
        while s < hi:
            k = s // shard_rows
            e = min(hi, (k + 1) * shard_rows)
            view = self._mapped_rows(meta, k, s - k * shard_rows, e - s)
            if view is None:
                return
            _will_need(view.data_ptr(), (e - s) * row_bytes)
            s = e

    def compressed_array(self, hook_point: str) -> tuple[Any, int, torch.dtype] | None:
        """``(zarr array, chunk_rows, torch dtype)`` of an array read through zarr-python
        (compressed or non-local), or None when it is read zero-copy from memory-mapped shards.
        The zarr array holds bfloat16 as uint16 bit patterns."""
        meta = self._meta(hook_point)
        if isinstance(self._backend, LocalBackend) and meta.get("compression") is None:
            return None
        return self._zarray(meta), int(meta["chunk_rows"]), F.torch_dtype(meta["dtype"])

    def _read_rows(self, hook_point: str, start: int, stop: int, copy: bool = False) -> torch.Tensor:
        meta = self._meta(hook_point)
        dtype = F.torch_dtype(meta["dtype"])
        feat = tuple(meta["feature_shape"])
        if stop <= start:
            return torch.empty((0, *feat), dtype=dtype)
        shard_rows = int(meta["shard_rows"])
        if isinstance(self._backend, LocalBackend) and meta.get("compression") is None:
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
        if self._decodes_locally(meta):
            return self._read_decoded(hook_point, meta, start, stop)
        return self._read_zarr(hook_point, meta, start, stop)

    # ------------------------------------------------------------------ local compressed arrays
    def _decodes_locally(self, meta: dict) -> bool:
        comp = meta.get("compression")
        return (isinstance(self._backend, LocalBackend) and isinstance(comp, dict)
                and comp.get("name") in ("zstd", "blosc"))

    def _shard_index(self, path: str, n_chunks: int) -> tuple[np.ndarray, int]:
        with self._lock:
            entry = self._indexes.get(path)
        if entry is None:
            entry = _decode.read_index(path, n_chunks)
            with self._lock:
                self._indexes[path] = entry
        return entry

    def _decode_chunk(self, hook_point: str, meta: dict, c: int, out: np.ndarray | None = None) -> torch.Tensor | None:
        """Decode chunk ``c`` of a local compressed array (runs on the decode pool).

        Into ``out`` (uint8, exactly the chunk's committed bytes) when given (returns None),
        else into a new tensor ``(rows of the chunk, *feature_shape)``.
        """
        feat = tuple(meta["feature_shape"])
        chunk_rows, shard_rows, n = int(meta["chunk_rows"]), int(meta["shard_rows"]), int(meta["n_rows"])
        row_bytes = (int(np.prod(feat)) if feat else 1) * F.itemsize(meta["dtype"])
        shard_chunks = shard_rows // chunk_rows
        shard, j = divmod(c, shard_chunks)
        key = F.shard_key(meta["path"], shard, len(feat))
        path = str(self._backend.path(key))
        index, _size = self._shard_index(path, shard_chunks)
        lo, hi = c * chunk_rows, min(n, (c + 1) * chunk_rows)
        off, nbytes = int(index[j, 0]), int(index[j, 1])
        where = f"hook point {hook_point!r}: chunk {c} (rows {lo}-{hi - 1}, shard {key})"
        if index[j, 0] == _decode.MISSING:
            raise StoreCorruptError(f"{where} is missing from its shard, but its rows are committed; "
                                    "run `activationscope verify` on the store")
        with open(path, "rb") as f:
            data = os.pread(f.fileno(), nbytes, off)
        if len(data) != nbytes:
            raise StoreCorruptError(f"{where}: read {len(data)} of its {nbytes} bytes (the file shrank)")
        full = chunk_rows * row_bytes  # every chunk is written whole (the last one too)
        if out is not None and out.nbytes == full:
            _decode.decode_into(meta["compression"], self._decoder(meta), data, out, where)
            return None
        buf = np.empty(full, dtype=np.uint8)
        _decode.decode_into(meta["compression"], self._decoder(meta), data, buf, where)
        if out is not None:
            out[:] = buf[: out.nbytes]
            return None
        t = torch.from_numpy(buf[: (hi - lo) * row_bytes]).view(F.torch_dtype(meta["dtype"]))
        return t.view(hi - lo, *feat)

    def _decoder(self, meta: dict) -> Any:
        key = ("decoder", meta["path"])
        dec = self._zarrays.get(key)
        if dec is None:
            dec = _decode.decoder(meta["compression"])
            self._zarrays[key] = dec
        return dec

    def _cache_put(self, key: tuple, t: torch.Tensor) -> None:
        with self._lock:
            self._inflight.pop(key, None)
            if key in self._cache:
                return
            self._cache[key] = t
            self._cached += t.nbytes
            while self._cached > self._cache_bytes and len(self._cache) > 1:
                _, old = self._cache.popitem(last=False)
                self._cached -= old.nbytes

    def _chunk_future(self, hook_point: str, meta: dict, c: int) -> Any:
        """A future of decoded chunk ``c`` (cached; one decode per chunk however many readers)."""
        key = (hook_point, c)
        with self._lock:
            fut = self._inflight.get(key)
            if fut is not None:
                return fut

            def work() -> torch.Tensor:
                try:
                    t = self._decode_chunk(hook_point, meta, c)
                except BaseException:
                    with self._lock:
                        self._inflight.pop(key, None)
                    raise
                self._cache_put(key, t)
                return t

            fut = _decode.pool().submit(work)
            self._inflight[key] = fut
            return fut

    def _read_decoded(self, hook_point: str, meta: dict, start: int, stop: int) -> torch.Tensor:
        """Rows ``[start, stop)`` of a local compressed array: one new tensor.

        Chunks decode on the decode pool side by side; a read that starts where the last one
        of this hook point stopped (a sequential reader) also starts decoding the next chunks.
        Reads larger than half the cache decode straight into the result, without caching.
        """
        if self._pid != os.getpid():  # forked: the parent's decode futures never finish here
            with self._lock:
                self._inflight.clear()
                self._pid = os.getpid()
        dtype = F.torch_dtype(meta["dtype"])
        feat = tuple(meta["feature_shape"])
        chunk_rows, n = int(meta["chunk_rows"]), int(meta["n_rows"])
        row_bytes = (int(np.prod(feat)) if feat else 1) * F.itemsize(meta["dtype"])
        out = torch.empty((stop - start, *feat), dtype=dtype)
        if row_bytes == 0:
            return out
        flat = out.view(-1).view(torch.uint8).numpy()
        c0, c1 = start // chunk_rows, (stop - 1) // chunk_rows
        big = (c1 - c0 + 1) * chunk_rows * row_bytes > self._cache_bytes // 2
        waits = []
        for c in range(c0, c1 + 1):
            lo, hi = max(start, c * chunk_rows), min(stop, (c + 1) * chunk_rows)
            dst = flat[(lo - start) * row_bytes:(hi - start) * row_bytes]
            with self._lock:
                t = self._cache.get((hook_point, c))
                if t is not None:
                    self._cache.move_to_end((hook_point, c))
            if t is not None:
                dst[:] = t.view(-1).view(torch.uint8).numpy()[(lo - c * chunk_rows) * row_bytes:(hi - c * chunk_rows) * row_bytes]
            elif big and lo == c * chunk_rows and (hi == (c + 1) * chunk_rows or hi == n):
                waits.append((None, _decode.pool().submit(self._decode_chunk, hook_point, meta, c, dst), None))
            else:
                waits.append((c, self._chunk_future(hook_point, meta, c), (lo, hi, dst)))
        # a sequential reader: decode the chunks after this read while it is consumed
        with self._lock:
            sequential = self._next_start.get(hook_point, 0) == start
            self._next_start[hook_point] = stop
        if sequential and not big:
            ahead = min(_decode.n_decode_threads(), max(1, (self._cache_bytes // 4) // max(1, chunk_rows * row_bytes)))
            last = (n - 1) // chunk_rows
            for c in range(c1 + 1, min(last, c1 + ahead) + 1):
                with self._lock:
                    known = (hook_point, c) in self._cache or (hook_point, c) in self._inflight
                if not known:
                    self._chunk_future(hook_point, meta, c)
        for c, fut, part in waits:
            t = fut.result()
            if part is not None:
                lo, hi, dst = part
                dst[:] = t.view(-1).view(torch.uint8).numpy()[(lo - c * chunk_rows) * row_bytes:(hi - c * chunk_rows) * row_bytes]
        return out

    def _shard_entry(self, meta: dict, shard: int) -> tuple[mmap.mmap, bool]:
        """(copy-on-write map of one shard file, whether its chunks lie back to back)."""
        key = F.shard_key(meta["path"], shard, len(meta["feature_shape"]))
        with self._lock:
            entry = self._maps.get(key)
            if entry is None:
                path = self._backend.path(key)
                try:
                    with open(path, "rb") as f:
                        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
                        # the index with pread, not through the map: a page fault there would
                        # read the kernel's whole read-around window (MiBs) of a cold file
                        index_bytes = 16 * (int(meta["shard_rows"]) // int(meta["chunk_rows"])) + 4
                        tail = os.pread(f.fileno(), index_bytes, max(0, len(mm) - index_bytes))
                except FileNotFoundError:
                    raise StoreCorruptError(
                        f"hook point {meta['path']!r}: shard {key!r} is missing (committed rows need it)"
                    ) from None
                entry = (mm, self._contiguous(tail, meta))
                self._maps[key] = entry
        return entry

    def _mapped_rows(self, meta: dict, shard: int, local_start: int, n: int) -> torch.Tensor | None:
        """A view of rows of one shard, or None when its chunks are not laid back to back."""
        feat = tuple(meta["feature_shape"])
        dtype = F.torch_dtype(meta["dtype"])
        mm, contiguous = self._shard_entry(meta, shard)
        if not contiguous:
            return None
        row_elems = int(np.prod(feat)) if feat else 1
        item = torch.empty((), dtype=dtype).element_size()
        if row_elems == 0:
            return torch.empty((n, *feat), dtype=dtype)
        t = torch.frombuffer(mm, dtype=dtype, count=n * row_elems, offset=local_start * row_elems * item)
        return t.view(n, *feat)

    def _whole_rows(self, meta: dict) -> torch.Tensor | None:
        """Every committed row of a local uncompressed array as ONE zero-copy view.

        The shard files are mapped back to back into one contiguous range of address space
        (``_C.map_files_contiguous``), which works when a shard's data is a whole number of
        pages (the default chunk layout ensures it) and each shard's chunks lie back to back.
        Cached per array and committed row count; None when the layout does not allow it.
        """
        feat = tuple(meta["feature_shape"])
        n, shard_rows = int(meta["n_rows"]), int(meta["shard_rows"])
        row_bytes = (int(np.prod(feat)) if feat else 1) * F.itemsize(meta["dtype"])
        stride = shard_rows * row_bytes
        if n == 0 or row_bytes == 0 or stride % mmap.PAGESIZE:
            return None
        with self._lock:
            cached = self._whole.get(meta["path"])
        if cached is not None and cached[0] == n:
            return cached[1]
        n_shards = -(-n // shard_rows)
        if not all(self._shard_entry(meta, k)[1] for k in range(n_shards)):
            return None
        paths = [str(self._backend.path(F.shard_key(meta["path"], k, len(feat)))) for k in range(n_shards)]
        flat = _C.map_files_contiguous(paths, stride, n * row_bytes)
        view = flat.view(F.torch_dtype(meta["dtype"])).view(n, *feat)
        with self._lock:
            self._whole[meta["path"]] = (n, view)
        return view

    @staticmethod
    def _contiguous(tail: bytes, meta: dict) -> bool:
        """Whether the shard whose last bytes (its index) are ``tail`` holds its chunks back to back."""
        chunk_rows = int(meta["chunk_rows"])
        n_chunks = int(meta["shard_rows"]) // chunk_rows
        feat = meta["feature_shape"]
        chunk_bytes = chunk_rows * int(np.prod(feat) if feat else 1) * F.itemsize(meta["dtype"])
        index_bytes = 16 * n_chunks + 4
        if len(tail) < index_bytes:
            return False
        index = np.frombuffer(tail, dtype="<u8", count=2 * n_chunks, offset=len(tail) - index_bytes).reshape(-1, 2)
        present = index[:, 0] != _MISSING
        at = np.arange(n_chunks, dtype=np.uint64) * np.uint64(chunk_bytes)
        return bool(np.all(~present | ((index[:, 0] == at) & (index[:, 1] == chunk_bytes))))

    def _zarray(self, meta: dict) -> Any:
        import zarr

        path = meta["path"]
        arr = self._zarrays.get(path)
        if arr is None:
            arr = zarr.open_array(self._backend.zarr_store(read_only=True), path=path, mode="r")
            self._zarrays[path] = arr
        return arr

    def _to_torch(self, data: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        t = torch.from_numpy(np.ascontiguousarray(data))
        if dtype == torch.bfloat16:
            t = t.view(torch.bfloat16)
        return t

    def _read_zarr(self, hook_point: str, meta: dict, start: int, stop: int) -> torch.Tensor:
        """Decode rows through zarr-python, chunk by chunk, through the bounded chunk cache."""
        dtype = F.torch_dtype(meta["dtype"])
        arr = self._zarray(meta)
        chunk_rows = int(meta["chunk_rows"])
        c0, c1 = start // chunk_rows, (stop - 1) // chunk_rows
        feat = meta["feature_shape"]
        row_bytes = max(1, int(np.prod(feat)) if feat else 1) * F.itemsize(meta["dtype"])
        if (c1 - c0 + 1) * chunk_rows * row_bytes > self._cache_bytes // 2:
            return self._to_torch(arr[start:stop], dtype)  # big reads bypass the cache
        parts = []
        n = int(meta["n_rows"])
        for c in range(c0, c1 + 1):
            key = (hook_point, c)
            with self._lock:
                t = self._cache.get(key)
                if t is not None:
                    self._cache.move_to_end(key)
            if t is None:
                lo, hi = c * chunk_rows, min(n, (c + 1) * chunk_rows)
                t = self._to_torch(arr[lo:hi], dtype)
                with self._lock:
                    self._cache[key] = t
                    self._cached += t.nbytes
                    while self._cached > self._cache_bytes and len(self._cache) > 1:
                        _, old = self._cache.popitem(last=False)
                        self._cached -= old.nbytes
            lo = max(start, c * chunk_rows) - c * chunk_rows
            hi = min(stop, (c + 1) * chunk_rows) - c * chunk_rows
            parts.append(t[lo:hi])
        return parts[0].clone() if len(parts) == 1 else torch.cat(parts)

    @staticmethod
    def _crc_problem(data: bytes, expected: int | None, where: str) -> str | None:
        """A problem line when ``data`` does not have the recorded crc32c (None: not recorded)."""
        if expected is None:
            return None
        got = int(_C.crc32c(data))
        if got != int(expected):
            return f"{where}: crc32c mismatch (metadata {int(expected):08x}, data {got:08x})"
        return None

    def _check_crc(self, data: bytes, expected: int | None, where: str) -> None:
        problem = self._crc_problem(data, expected, where)
        if problem is not None:
            raise StoreCorruptError(f"{problem} in store {str(self._backend)!r}; run verify to list every damaged file")

    def _read_small(self, entry: dict) -> torch.Tensor:
        import zarr

        for key, crc in (entry.get("crc32c") or {}).items():
            if key.endswith(".pt"):
                continue  # the script is checked where it is read
            raw = self._backend.get(key)
            if raw is None:
                raise StoreCorruptError(f"reduction chunk {key!r} listed in the metadata of {str(self._backend)!r} is missing")
            self._check_crc(raw, crc, f"reduction {entry.get('reduction')!r}: chunk {key!r}")
        arr = zarr.open_array(self._backend.zarr_store(read_only=True), path=entry["path"], mode="r")
        data = np.asarray(arr[...])
        return self._to_torch(data, F.torch_dtype(entry["dtype"])).reshape(entry["shape"])

    @property
    def reductions(self) -> Mapping[str, dict[str, torch.Tensor]]:
        """``{hook_point: {name: Tensor}}`` of the reductions stored at close.

        Read on access from ``reductions/<hook point>/<name>`` (each value a copy on the
        host, checked against its crc32c). Keys, shapes and dtypes are those of
        :attr:`Tracker.reductions <activationscope.Tracker.reductions>` at the end of the
        capture: for rows ``(rows, *feature_shape)``, ``mean`` / ``var`` / ``std`` /
        ``min`` / ``max`` / ``absmax`` / ``l2`` / ``nonzero`` are ``(*feature_shape)``
        float64; ``<hist>.counts`` ``(*feature_shape, bins)`` int64 and ``<hist>.edges``
        ``(bins + 1,)`` float64; ``cov`` ``(D, D)`` float64, ``D = prod(feature_shape)``;
        ``<topk>.values`` ``(k, *feature_shape)`` float64 and ``<topk>.row_ids`` int64;
        ``<name>.count`` an int64 scalar (observations per output value).

        Returns
        -------
        Mapping of str to dict of str to Tensor
            Hook points with reductions (``list(store.reductions)``) to their results.

        Raises
        ------
        HookPointNotFoundError
            Indexing a hook point without reductions (the message lists those with some).
        StoreCorruptError
            A reduction's bytes do not match their recorded crc32c.
        """
        return _Reductions(self)

    def reduction_script(self, hook_point: str, name: str) -> bytes | None:
        """The ``.pt`` bytes of a custom TorchScript reduction (``torch.jit.load(io.BytesIO(b))``)."""
        entry = self._attrs.get("reductions", {}).get(hook_point, {}).get(name) or {}
        key = entry.get("script")
        if key is None:
            return None
        data = self._backend.get(key)
        if data is not None:
            self._check_crc(data, (entry.get("crc32c") or {}).get(key), f"reduction {name!r}: script {key!r}")
        return data

    # ------------------------------------------------------------------ row tables
    def row_table(self, kind: str = "sample") -> Any:
        """The row table of ``kind`` ("sample" or "token") as a ``pyarrow.Table``.

        Row ``i`` of a ``kind`` array whose ``follows_row_table`` is true is described by
        row ``i`` of this table.
        """
        import pyarrow as pa
        import pyarrow.parquet as pq

        if kind not in ("sample", "token"):
            raise ValueError(f"kind must be one of ['sample', 'token'], got {kind!r}")
        info = (self._attrs.get("row_tables") or {}).get(kind) or {"parts": []}
        crcs = info.get("crc32c") or {}
        tables = []
        for key in info["parts"]:
            raw = self._backend.get(key)
            if raw is None:
                raise StoreCorruptError(f"row-table part {key!r} listed in the metadata is missing")
            self._check_crc(raw, crcs.get(key), f"row table {kind!r}: part {key!r}")
            tables.append(pq.read_table(io.BytesIO(raw)))
        if not tables:
            cols = {"sample_id": pa.array([], pa.int64()), "batch": pa.array([], pa.int64())}
            if kind == "token":
                cols = {"sample_id": pa.array([], pa.int64()), "pos": pa.array([], pa.int64()), "batch": pa.array([], pa.int64())}
            return pa.table(cols)
        return pa.concat_tables(tables, promote_options="default")

    # ------------------------------------------------------------------ checks and info
    def verify(self) -> list[str]:
        """Recompute every committed chunk's crc32c and check the structure.

        Also checks the crc32c recorded in the metadata of every row-table part and every
        reduction chunk and script (stores written before they were recorded: presence only).

        Returns
        -------
        list of str
            One line per problem, naming the hook point and the chunk (empty: all good).
        """
        from .. import _native

        crc32c = _native.load().crc32c
        problems: list[str] = []
        for hp in self.hook_points:
            meta = self._meta(hp)
            n = int(meta["n_rows"])
            chunk_rows, shard_rows = int(meta["chunk_rows"]), int(meta["shard_rows"])
            n_chunks = shard_rows // chunk_rows
            raw = self._backend.get(meta["manifest"]) if meta.get("manifest") else None
            if raw is None:
                if n:
                    problems.append(f"hook point {hp!r}: manifest {meta.get('manifest')!r} is missing")
                continue
            shards = {int(r["shard"]): r for r in json.loads(raw).get("shards", [])}
            doc_raw = self._backend.get(f"{meta['path']}/zarr.json")
            if doc_raw is None:
                problems.append(f"hook point {hp!r}: array document {meta['path']}/zarr.json is missing")
            elif json.loads(doc_raw)["shape"][0] < n:
                problems.append(f"hook point {hp!r}: array shape {json.loads(doc_raw)['shape']} has fewer than the {n} committed rows")
            for k in range(-(-n // shard_rows)):
                rec = shards.get(k)
                key = F.shard_key(meta["path"], k, len(meta["feature_shape"]))
                if rec is None:
                    problems.append(f"hook point {hp!r}: shard {k} ({key}) has no manifest entry")
                    continue
                data = self._backend.get(key)
                if data is None:
                    problems.append(f"hook point {hp!r}: shard {k} ({key}) is missing")
                    continue
                ib = 16 * n_chunks + 4
                if len(data) < ib:
                    problems.append(f"hook point {hp!r}: shard {k} ({key}) is truncated ({len(data)} bytes)")
                    continue
                index = np.frombuffer(data, dtype="<u8", count=2 * n_chunks, offset=len(data) - ib).reshape(-1, 2)
                stored = int.from_bytes(data[-4:], "little")
                if crc32c(data[len(data) - ib:-4]) != stored:
                    problems.append(f"hook point {hp!r}: shard {k} ({key}): shard index crc32c mismatch")
                for j, off, nb, crc in rec["chunks"]:
                    chunk = k * n_chunks + j
                    if chunk * chunk_rows >= n:
                        continue  # past the committed rows
                    r0, r1 = chunk * chunk_rows, min(n, (chunk + 1) * chunk_rows)
                    where = f"hook point {hp!r}: chunk {chunk} (rows {r0}-{r1 - 1}, shard {key}, bytes {off}-{off + nb - 1})"
                    if (int(index[j, 0]), int(index[j, 1])) != (off, nb):
                        problems.append(f"{where}: shard index entry {tuple(int(x) for x in index[j])} differs from the manifest")
                        continue
                    got = crc32c(data[off:off + nb])
                    if got != crc:
                        problems.append(f"{where}: crc32c mismatch (manifest {crc:08x}, data {got:08x})")
        for kind, info in (self._attrs.get("row_tables") or {}).items():
            crcs = info.get("crc32c") or {}  # absent in stores written before it was recorded
            for key in info.get("parts", []):
                data = self._backend.get(key)
                if data is None:
                    problems.append(f"row table {kind!r}: part {key!r} is missing")
                    continue
                problem = self._crc_problem(data, crcs.get(key), f"row table {kind!r}: part {key!r}")
                if problem:
                    problems.append(problem)
        for hp, entries in (self._attrs.get("reductions") or {}).items():
            for name, entry in entries.items():
                for key, crc in (entry.get("crc32c") or {}).items():
                    where = f"hook point {hp!r}: reduction {name!r}: file {key!r}"
                    data = self._backend.get(key)
                    if data is None:
                        problems.append(f"{where} is missing")
                        continue
                    problem = self._crc_problem(data, crc, where)
                    if problem:
                        problems.append(problem)
        return problems

    def info(self) -> dict:
        """A summary: arrays (shape, dtype, rows, bytes), compression ratio, reductions, provenance, status."""
        arrays = {}
        total_raw = total_disk = 0
        for hp in self.hook_points:
            meta = self._meta(hp)
            n = int(meta["n_rows"])
            feat = tuple(meta["feature_shape"])
            raw_bytes = n * (int(np.prod(feat)) if feat else 1) * F.itemsize(meta["dtype"])
            disk = 0
            man = self._backend.get(meta["manifest"]) if meta.get("manifest") else None
            if man is not None:
                for rec in json.loads(man).get("shards", []):
                    if rec["shard"] * int(meta["shard_rows"]) < n:
                        disk += int(rec["file_bytes"])
            total_raw += raw_bytes
            total_disk += disk
            arrays[hp] = {
                "shape": [n, *feat], "dtype": meta["dtype"], "storage_dtype": meta["storage_dtype"],
                "row_kind": meta["row_kind"], "n_rows": n, "bytes": raw_bytes, "bytes_on_disk": disk,
                "compression": (meta.get("compression") or {}).get("name"),
                "compression_ratio": (raw_bytes / disk) if disk else None,
                "follows_row_table": meta.get("follows_row_table", True),
            }
        return {
            "path": str(self._backend),
            "format": self._attrs.get("format"),
            "status": self.status,
            "n_samples": self.n_samples,
            "arrays": arrays,
            "bytes": total_raw,
            "bytes_on_disk": total_disk,
            "compression_ratio": (total_raw / total_disk) if total_disk else None,
            "reductions": {hp: sorted(v) for hp, v in (self._attrs.get("reductions") or {}).items()},
            "row_tables": {k: v.get("n_rows", 0) for k, v in (self._attrs.get("row_tables") or {}).items()},
            "model": self._attrs.get("model"),
            "provenance": self._attrs.get("provenance"),
            "library": self._attrs.get("library"),
            "created": self._attrs.get("created"),
        }

    # ------------------------------------------------------------------ copies
    def save(self, target: Any, *, overwrite: bool = False) -> "Store":
        """Copy the store to ``target`` (a path, URL or zarr Store); returns it opened."""
        copy_store(self, target, overwrite=overwrite)
        return open_store(target)

    def close(self) -> None:
        """Drop the store's own references to its mappings (views keep theirs alive)."""
        with self._lock:
            self._maps.clear()
            self._whole.clear()
            self._zarrays.clear()
            self._cache.clear()
            self._cached = 0
            self._indexes.clear()

    def __enter__(self) -> "Store":
        """Return the store; :meth:`close` on exit."""
        return self

    def __exit__(self, *exc: Any) -> None:
        """:meth:`close` the store."""
        self.close()

    def __repr__(self) -> str:
        return f"<Store {str(self._backend)!r} {self.status}, {len(self.hook_points)} hook points, {self.n_samples} samples>"


def open_store(target: Any, *, cache_bytes: int = 64 << 20, storage_options: dict | None = None) -> Store:
    """Open a store read-only.

    Parameters
    ----------
    target : str, os.PathLike, or zarr Store
        Local path, ``file://`` / ``memory://`` / ``s3://`` URL, or a zarr ``Store``.
    cache_bytes : int, default 64 MiB
        Bound of the decoded-chunk cache of compressed / remote arrays.
    storage_options : dict, optional
        fsspec options of a URL (credentials, ``client_kwargs``).

    Raises
    ------
    StoreError
        Nothing there, not an activationscope store, or a newer format.

    Example
    -------
    >>> store = open_store("runs/demo.zarr")              # doctest: +SKIP
    >>> store["encoder.layer.0.output"].shape             # doctest: +SKIP
    """
    if isinstance(target, Store):
        return target
    return Store(target, cache_bytes=cache_bytes, storage_options=storage_options)


def copy_store(source: Any, target: Any, *, overwrite: bool = False) -> None:
    """Copy every object of a store (e.g. an in-memory one) to ``target``; root metadata last.

    Raises
    ------
    StoreExistsError
        ``target`` is not empty and ``overwrite`` is False.
    """
    from ..errors import StoreExistsError

    src = source._backend if isinstance(source, Store) else resolve(source, read_only=True)
    dst = resolve(target)
    if not dst.is_empty():
        if not overwrite:
            raise StoreExistsError(f"{str(dst)!r} is not empty; pass overwrite=True to replace it")
        dst.clear()
    keys = sorted(src.list(""))
    for key in keys:
        if key == "zarr.json":
            continue
        data = src.get(key)
        if data is not None:
            dst.set(key, data)
    root = src.get("zarr.json")
    if root is not None:
        dst.set("zarr.json", root)
