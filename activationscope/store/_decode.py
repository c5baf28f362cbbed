"""Decoding compressed chunks of local stores, in parallel and ahead of the reader (private).

zarr-python decodes a sharded array one ``arr[lo:hi]`` call at a time through its async
machinery (a few milliseconds of overhead per chunk, one chunk at a time). For a local
store the reader knows every chunk's place from the shard index, so it reads the bytes with
``os.pread`` and decodes them with numcodecs (which releases the GIL) on a small thread
pool: the chunks of one read decode side by side, and a sequential reader gets the next
chunks decoded while it consumes the current ones.

Everything read from the file is checked before use: the shard index's crc32c, every
offset and size against the file size, and the decoded size against the chunk size
(from the codec's own frame header, before decoding into the destination).
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import BrokenExecutor, Future, ThreadPoolExecutor
from typing import Any, Callable

import numpy as np

from .._safeio import decode_into, decoded_size  # noqa: F401 - shared with Dask workers
from ..errors import StoreCorruptError

#: Shard index entry of a chunk that was never written (Zarr sharding: 2**64 - 1).
MISSING = np.uint64(2**64 - 1)


_pool: ThreadPoolExecutor | None = None
_pool_pid = -1
_pool_lock = threading.Lock()


def n_decode_threads() -> int:
    """Decode threads: the CPUs this process may run on, at most 4 (at least 1)."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    return max(1, min(4, n))


def pool() -> ThreadPoolExecutor:
    """The process's decode pool (made anew in a forked child: threads do not survive fork)."""
    global _pool, _pool_pid
    if _pool is None or _pool_pid != os.getpid():
        with _pool_lock:
            if _pool is None or _pool_pid != os.getpid():
                _pool = ThreadPoolExecutor(max_workers=n_decode_threads(), thread_name_prefix="activationscope-decode")
                _pool_pid = os.getpid()
    return _pool


class _Deferred(Future):
    """A call the decode pool refused, run in the first thread that asks for its result (or
    exception), once; never run when nobody asks (a chunk decoded ahead that is not read)."""

    def __init__(self, fn: Callable[..., Any], args: tuple) -> None:
        super().__init__()
        self._call: tuple[Callable[..., Any], tuple] | None = (fn, args)
        self._run_lock = threading.Lock()

    def _run_once(self) -> None:
        with self._run_lock:
            if self._call is None:
                return
            fn, args = self._call
            self._call = None
            if not self.set_running_or_notify_cancel():
                return
            try:
                result = fn(*args)
            except BaseException as e:  # noqa: BLE001 - handed to the caller of result()
                self.set_exception(e)
            else:
                self.set_result(result)

    def result(self, timeout: float | None = None) -> Any:
        self._run_once()
        return super().result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self._run_once()
        return super().exception(timeout)


def submit(fn: Callable[..., Any], *args: Any) -> Future:
    """``fn(*args)`` on the decode pool; once the interpreter is exiting, in the thread that
    asks for the result.

    From the moment the main thread returns, ``concurrent.futures`` refuses new work
    ("cannot schedule new futures after interpreter shutdown"): its exit hook runs before the
    threads still running are joined, so a thread that goes on reading a compressed store after
    the main thread returned (a training thread, a producer feeding a queue) would fail at
    its next chunk. Its chunks are then decoded in the reading thread itself.
    """
    try:
        return pool().submit(fn, *args)
    except BrokenExecutor:
        raise
    except RuntimeError:  # the pool, or every pool of the interpreter, is shut down
        return _Deferred(fn, args)


def _after_fork_in_child() -> None:
    global _pool, _pool_pid, _pool_lock
    _pool, _pool_pid, _pool_lock = None, -1, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def decoder(codec: dict) -> Any:
    """A numcodecs object that decodes chunks of the Zarr codec document ``codec``."""
    from . import _format as F

    return F.numcodecs_encoder(codec)


def read_index(path: str, n_chunks: int) -> tuple[np.ndarray, int]:
    """The shard index of the shard file ``path``: ``((n_chunks, 2) uint64 (offset, nbytes), file size)``.

    Checks the index's crc32c and that every written chunk lies inside the file, before the
    index's data is used. Raises StoreCorruptError naming the file and what is wrong.
    """
    from . import _format as F

    from ._backend import open_regular

    index_bytes = 16 * n_chunks + 4
    opened = open_regular(path, store=os.path.dirname(path), key=os.path.basename(path))
    if opened is None:
        raise StoreCorruptError(f"shard {path!r} is missing (committed rows need it)")
    fd, size = opened
    try:
        if size < index_bytes:
            raise StoreCorruptError(
                f"shard {path!r} has {size} bytes, fewer than its index ({index_bytes} bytes): the file is "
                "truncated; run `activationscope verify` on the store"
            )
        raw = os.pread(fd, index_bytes, size - index_bytes)
    finally:
        os.close(fd)
    stored = int.from_bytes(raw[-4:], "little")
    if F.crc32c(raw[:-4]) != stored:
        raise StoreCorruptError(f"shard {path!r}: shard index crc32c mismatch; run `activationscope verify` on the store")
    index = np.frombuffer(raw, dtype="<u8", count=2 * n_chunks).reshape(-1, 2).copy()
    present = index[:, 0] != MISSING
    ends = index[present, 0] + index[present, 1]
    if len(ends) and (int(ends.max()) > size - index_bytes or bool((ends < index[present, 0]).any())):
        raise StoreCorruptError(
            f"shard {path!r}: a shard index entry points past the end of the chunk data ({size - index_bytes} bytes); "
            "run `activationscope verify` on the store"
        )
    return index, size
