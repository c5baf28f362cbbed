"""Where a store's objects live: the storage contract and its backends.

One contract, :class:`StoreBackend` (as zarr-python keeps its ``abc/store.py``): a flat
``key -> bytes`` map with atomic ``set`` and stated :class:`Capabilities`. Backends:
:class:`LocalBackend` (a directory; temp file + rename; memory-mappable), :class:`MemoryBackend`
(a zarr ``MemoryStore``), :class:`FsspecBackend` (a zarr ``FsspecStore``: ``s3://``, ``gs://``,
``memory://``, ...) and :class:`ZarrBackend` (any other zarr ``Store``). Every key is checked
(:func:`_validate.check_key`) before use: a key can never name anything outside the store.
The reusable test suite every backend passes is ``tests/store/backend_suite.py``.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import errno
import functools
import json
import os
import queue
import re
import shutil
import stat
import tempfile
import threading
import uuid
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Protocol, runtime_checkable

from ..errors import ArgumentTypeError, ArgumentValueError, StoreError, StoreExistsError
from .._safeio import _kind, open_regular, read_regular  # noqa: F401 - the one way a local file is opened
from . import _format
from ._validate import MAX_FILE_BYTES, MAX_JSON_BYTES, check_key, corrupt

#: Key of the writer lock (FORMAT.md §7): never part of the data, never listed or copied.
LOCK_KEY = ".activationscope-writer.lock"


@dataclass(frozen=True)
class Capabilities:
    """What a backend guarantees.

    Attributes
    ----------
    atomic_write : bool
        ``set`` replaces an object whole: a reader sees the old bytes or the new ones.
    atomic_rename : bool
        ``set`` writes a temporary file and renames it into place (a local file system).
    conditional_write : bool
        ``set_if_absent`` is atomic across processes (``O_EXCL``, S3 ``If-None-Match``).
    mmap : bool
        Objects are regular local files that :meth:`LocalBackend.path` names and readers
        memory-map (zero-copy views).
    """

    atomic_write: bool
    atomic_rename: bool
    conditional_write: bool
    mmap: bool


@runtime_checkable
class StoreBackend(Protocol):
    """The storage contract of a store: a flat map of ``/``-separated keys to bytes.

    Every method validates its key (relative, no ``..``); a key naming something that is not
    a regular file inside the store raises :class:`StoreCorruptError`, never reads or
    writes elsewhere.
    """

    capabilities: Capabilities

    def get(self, key: str, max_bytes: int | None = MAX_JSON_BYTES) -> bytes | None:
        """The whole object, None when absent; :class:`StoreCorruptError` when it is larger than ``max_bytes``."""

    def get_range(self, key: str, start: int, length: int) -> bytes | None:
        """``length`` bytes from ``start`` (fewer at the end of the object), None when absent."""

    def size(self, key: str) -> int | None:
        """The object's size in bytes, None when absent."""

    def tail(self, key: str, length: int, size_hint: int | None = None) -> tuple[int, bytes] | None:
        """``(size, last min(length, size) bytes)`` of the object (a shard's size and index),
        None when absent. ``size_hint``: the size the object is expected to have (a manifest's
        record), which a backend may use to save a request; the result is its real size."""

    def set(self, key: str, data: bytes) -> None:
        """Write an object atomically (readers see the old bytes or the new ones)."""

    def set_if_absent(self, key: str, data: bytes) -> bool:
        """Write an object only if there is none; True when this call wrote it."""

    def put_file(self, key: str, local: Path) -> None:
        """Upload a local file as ``key``."""

    def delete(self, key: str) -> None:
        """Remove an object (nothing when absent)."""

    def list(self, prefix: str = "") -> Iterator[str]:
        """Keys starting with ``prefix`` (the writer lock excluded)."""

    def exists(self) -> bool:
        """Whether the store location exists (a local directory, or a root ``zarr.json``)."""

    def is_empty(self) -> bool:
        """Whether the location holds no object (the writer lock excluded)."""

    def clear(self, keep: Collection[str] = ()) -> None:
        """Remove every object but the writer lock and the keys (of the store's top level) in ``keep``."""

    def zarr_store(self, read_only: bool = True) -> Any:
        """The zarr ``Store`` of the same objects (for plain zarr-python access)."""


#: errno values of a write this process may not make (permissions, a read-only file system).
_NO_WRITE = frozenset({errno.EACCES, errno.EPERM, errno.EROFS})
_NO_WRITE_FIX = ("This process may not write there: capture into another path (whose folder you may write to), or "
                 "remove the old store yourself (its entries, leaving the folder empty) and capture into it without "
                 "overwrite=True")

#: errno values of a write that ran out of room: a full disk, a disk quota, a file size limit.
NO_ROOM = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})


def no_room_hint(e: BaseException | None) -> str:
    """What a write that failed with ``e`` adds to its message when it ran out of room (a full
    disk, a quota, a file size limit: :data:`NO_ROOM`), else ``""``."""
    if isinstance(e, OSError) and e.errno in NO_ROOM:
        return (": the disk holding it is full, or a disk quota or file size limit was reached; free space there "
                "(or write elsewhere)")
    return ""


def ran_out_of_room(e: BaseException) -> bool:
    """Whether ``e`` (or the error it was raised from) is a write that ran out of room."""
    while e is not None:
        if isinstance(e, OSError) and e.errno in NO_ROOM:
            return True
        e = e.__cause__
    return False


def _inside(real: str, root_real: str) -> bool:
    return real == root_real or real.startswith(root_real.rstrip(os.sep) + os.sep)


def relation_to_store(path: str | os.PathLike, store: Any) -> str | None:
    """Where ``path`` lies against the local store ``store`` (an object with ``path``, the
    store's folder), symlinks resolved: ``"inside"`` (the store itself or a path in it),
    ``"holds"`` (a folder above it), or None (elsewhere, or a store not in a local folder).
    Used to refuse outputs that would write among a store's files."""
    root = getattr(store, "path", None)
    if not isinstance(root, str) or "://" in root or not os.path.isdir(root):
        return None
    root_p, out = Path(root).resolve(), Path(path).resolve()
    if out == root_p or root_p in out.parents:
        return "inside"
    return "holds" if out in root_p.parents else None


def enclosing_store(path: str | os.PathLike) -> str | None:
    """The folder of the outermost activationscope store that ``path`` is or lies inside
    (symlinks resolved; :func:`store_above`, then ``path`` itself), or None. Used to refuse
    outputs (an export, a report) written among a store's files: replacing that store
    (``overwrite=True``) removes its folder with them."""
    above = store_above(path)
    if above is not None:
        return str(above)
    out = Path(expand_local(os.fspath(path))).resolve()
    return str(out) if _store_marks(out)[0] else None


#: The name of the temporary file that :meth:`LocalBackend.set` and :meth:`LocalBackend.reserve`
#: write a key's new bytes to before renaming it to the key: ``.<name>.<8 lowercase hex>.tmp``,
#: next to the key.
TEMP_NAME = re.compile(r"\.[^/]+\.[0-9a-f]{8}\.tmp")

#: The name of the temporary file the native shard writer (``csrc/shard_writer.cpp``,
#: ``ArrayWriter::write_chunk``) fills before renaming it to its shard key:
#: ``shard-<writer id>-<shard>-<pid>.tmp`` (decimal numbers), in its array's folder
#: ``acts/<node>/``.
SHARD_TEMP_NAME = re.compile(r"shard-[0-9]+-[0-9]+-[0-9]+(?:\.snap)?\.tmp")

#: The name of the temporary link (or copy) of a rank shard that the commit of rank stores
#: (``ranks._link_or_copy``) makes before renaming it to its shard key: ``.<name>.link.tmp``,
#: next to the key.
LINK_TEMP_NAME = re.compile(r"\.[^/]+\.link\.tmp")


def fsync_dir(path: str | os.PathLike) -> None:
    """fsync a directory, so that the renames and creations in it are durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LocalBackend:
    """A store in a local directory; ``set`` is atomic (temp file, optional fsync, rename).

    Creating a file is the slow part of a small atomic write on many file systems (a new
    inode and directory entry; about 1 ms on some virtual disks, against about 0.1 ms to
    fill an existing one). A writer that knows which keys its next commit will write can
    :meth:`reserve` them: a background thread creates their (empty) temporary files ahead of
    time, and ``set`` then only fills and renames one. :meth:`release` removes the unused.

    ``make_root`` (default True): whether ``set`` / ``set_if_absent`` make the store's folder
    when it is missing. A writer turns it off once its lock is taken (the folder exists then):
    a folder moved or removed under it is never made again, and the write fails with
    :class:`StoreError` instead of leaving a half store at the path.
    """

    is_local = True
    capabilities = Capabilities(atomic_write=True, atomic_rename=True, conditional_write=True, mmap=True)

    def __init__(self, root: str | os.PathLike, fsync: bool = False) -> None:
        self.root = Path(root).absolute()
        self.fsync = fsync
        self._spare: dict[str, Path] = {}  # key -> an empty temporary file made for it
        self._spare_lock = threading.Lock()
        self._spare_queue: queue.SimpleQueue | None = None
        self._spare_thread: threading.Thread | None = None
        self._releasing = False
        self._reserved_folders: set[Path] = set()  # folders below the root _reserve_loop made or found
        self.make_root = True  # False: set() never makes the store's folder (see the class docstring)

    @staticmethod
    def _temp_name(p: Path) -> Path:
        return p.parent / f".{p.name}.{uuid.uuid4().hex[:8]}.tmp"  # TEMP_NAME matches it, nothing else

    #: Folders of the store whose files :meth:`set` writes (the root's own files, not its
    #: subfolders, for ""): where :meth:`remove_temp_files` looks.
    TEMP_FOLDERS = ("", "acts", "rows", "reductions")

    def remove_temp_files(self, shards: bool = True) -> list[str]:
        """Remove the temporary files of :meth:`set` / :meth:`reserve` (``.<name>.<8 hex
        digits>.tmp``, :data:`TEMP_NAME`), of the commit of rank stores (``.<name>.link.tmp``,
        :data:`LINK_TEMP_NAME`) and, with ``shards``, of the native shard writer
        (``shard-<writer id>-<shard>-<pid>.tmp``, ``.snap.tmp`` for a partial shard's copy, directly
        in an array folder ``acts/<node>/``,
        :data:`SHARD_TEMP_NAME`) that an earlier writer process left in the store (killed
        between creating one and renaming it), in every array folder, whether the root
        document lists its array or not (a writer killed before the array's first commit).
        Only files of exactly those names, only in the store's own folders
        (:data:`TEMP_FOLDERS`: the root's files, ``acts/``, ``rows/``, ``reductions/``; never
        ``ranks/`` or anything a user put elsewhere), never following a link, never this
        backend's own reserved ones. Call it only while holding the writer lock (no other
        writer can be filling one), and with ``shards`` only while no array writer of this
        process is (before the first is opened, after the writer thread stopped). Returns the
        keys removed.
        """
        with self._spare_lock:
            own = {str(p) for p in self._spare.values()}
        removed = []
        for folder in self.TEMP_FOLDERS:
            base = self.root / folder if folder else self.root
            if not base.is_dir() or base.is_symlink():
                continue
            for dirpath, dirnames, files in os.walk(base):  # never follows a symlinked folder
                if not folder:
                    dirnames.clear()  # the root's own files only: its folders are listed above
                # the shard writer's temporaries: in acts/<node>/ itself, never deeper
                in_array = shards and folder == "acts" and os.path.dirname(dirpath) == str(base)
                for name in files:
                    p = os.path.join(dirpath, name)
                    ours = (TEMP_NAME.fullmatch(name) or LINK_TEMP_NAME.fullmatch(name)
                            or (in_array and SHARD_TEMP_NAME.fullmatch(name)))
                    if not ours or p in own:
                        continue
                    key = os.path.relpath(p, self.root).replace(os.sep, "/")
                    try:
                        self._check_inside(Path(p).parent, key, cached=False)
                        os.unlink(p)  # a link is removed, never followed
                    except FileNotFoundError:
                        continue
                    removed.append(key)
        return removed

    def reserve(self, keys: list[str]) -> None:
        """Create empty temporary files for ``keys`` in the background (best effort)."""
        if not keys or self._releasing:
            return
        if self._spare_thread is None:
            self._spare_queue = queue.SimpleQueue()
            self._spare_thread = threading.Thread(target=self._reserve_loop, name="activationscope-reserve",
                                                  daemon=True)
            self._spare_thread.start()
        for key in keys:
            self._spare_queue.put(key)

    def _reserve_loop(self) -> None:
        q = self._spare_queue
        while True:
            key = q.get()
            if key is None or self._releasing:
                return
            with self._spare_lock:
                if key in self._spare:
                    continue
            tmp = self._temp_name(self.root / key)
            try:  # (the store's folder, or a folder made before, moved or removed meanwhile: never made again)
                self._make_parent(tmp, key, make_root=False, not_again=self._reserved_folders)
                os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
            except OSError:
                continue  # set() makes its own
            with self._spare_lock:
                if self._releasing or key in self._spare:
                    _unlink_quietly(tmp)
                else:
                    self._spare[key] = tmp

    def release(self) -> None:
        """Stop reserving and remove the temporary files no ``set`` used."""
        self._releasing = True
        if self._spare_thread is not None:
            self._spare_queue.put(None)
            if self._spare_thread.ident is not None:  # (not a thread whose start a Ctrl-C cut off)
                self._spare_thread.join()
            self._spare_thread = None
        with self._spare_lock:
            spare, self._spare = self._spare, {}
        for key, tmp in spare.items():
            try:
                self._check_inside(tmp.parent, key, cached=False)  # (never through a folder swapped for a link)
            except StoreError:
                continue
            _unlink_quietly(tmp)

    def __repr__(self) -> str:
        return str(self.root)

    # ------------------------------------------------------------------ safe paths
    def _root_real(self) -> str:
        # Resolved once the root exists (a reader opens hundreds of keys: resolving the
        # root's own components again for each was half the cost of opening a layer).
        real = self.__dict__.get("_root_real_cached")
        if real is None:
            real = os.path.realpath(self.root)
            if os.path.isdir(real):
                self.__dict__["_root_real_cached"] = real
        return real

    def _check_inside(self, p: Path, key: str, cached: bool = True) -> None:
        """Refuse a path whose real location (symlinks resolved) is outside the store.

        Walks the components below the store's root with ``lstat``, remembering the folders
        found to be real folders (not symlinks) inside the store: a layer's hundreds of shard
        files share most of their folders, and resolving every component of every path
        again (``os.path.realpath``) was most of the cost of opening a layer. A component that
        is a symlink has the whole path resolved and checked; a missing one ends the walk
        (nothing below it to follow). Without ``cached`` (every write: a folder found real
        before may have been swapped for a link since, e.g. ``rows/`` during a capture) each
        component is looked at again."""
        sp, rootp = str(p), str(self.root)
        if sp == rootp:
            return
        if not sp.startswith(rootp + os.sep):
            self._check_resolved(sp, key)
            return
        known = self.__dict__.setdefault("_dirs_inside", set()) if cached else set()
        prefix = rootp
        for part in sp[len(rootp) + 1:].split(os.sep):
            prefix = prefix + os.sep + part
            if prefix in known:
                continue
            if part in ("", ".", ".."):
                self._check_resolved(sp, key)
                return
            try:
                mode = os.lstat(prefix).st_mode
            except OSError:
                return
            if stat.S_ISLNK(mode):
                self._check_resolved(sp, key)
                return
            if stat.S_ISDIR(mode):
                if len(known) >= 65536:
                    known.clear()
                known.add(prefix)

    def _check_resolved(self, sp: str, key: str) -> None:
        real = os.path.realpath(sp)
        if not _inside(real, self._root_real()):
            raise corrupt(self, f"{key!r} resolves to {real!r}, outside the store (a symlink "
                                "leaving the store); a store never refers to files outside itself")

    def _make_parent(self, p: Path, key: str, make_root: bool = True, not_again: set[Path] | None = None) -> None:
        """Make the folders of ``p``, checking first that the deepest existing one is inside the
        store (without ``make_root``, only below the store's folder: FileNotFoundError when it
        is gone). ``not_again`` (without ``make_root``): folders made or found by earlier calls,
        never made again (one gone since was removed: FileNotFoundError below it); the folders
        of ``p`` are added to it."""
        if make_root:
            self.root.mkdir(parents=True, exist_ok=True)
        elif not self.root.is_dir():
            raise FileNotFoundError(f"no store folder at {str(self.root)!r}")
        q = p.parent
        while not q.exists() and q != q.parent:
            q = q.parent
        self._check_inside(q, key, cached=False)
        if make_root:
            p.parent.mkdir(parents=True, exist_ok=True)
        else:  # one folder at a time below the root, never the root itself (gone: FileNotFoundError)
            d = self.root
            for part in p.parent.relative_to(self.root).parts:
                d = d / part
                if not_again is None or d not in not_again:
                    d.mkdir(exist_ok=True)
        self._check_inside(p.parent, key, cached=False)
        if not_again is not None:
            d = p.parent
            while d != self.root and d not in not_again:
                not_again.add(d)
                d = d.parent

    def _make_parent_or_fail(self, p: Path, key: str) -> None:
        """:meth:`_make_parent` of a write (the store's folder made only with :attr:`make_root`);
        the store's folder gone (without ``make_root``) raises :class:`StoreError`."""
        try:
            self._make_parent(p, key, make_root=self.make_root)
        except FileNotFoundError as e:
            if self.make_root or self.root.is_dir():
                raise
            raise StoreError(f"writing {str(p)!r} failed: the store's folder {str(self.root)!r} is gone (moved or "
                             "removed while it was written); it is not made again") from e

    def path(self, key: str, write: bool = False) -> Path:
        """The local path of a key: checked to be inside the store (symlinks resolved; with
        ``write``, every folder on the way looked at again, see :meth:`_check_inside`)."""
        made = self.__dict__.setdefault("_key_paths", {})  # key -> Path: the key's own checks are pure
        p = made.get(key)
        if p is None:
            check_key(key, store=self, what="key")
            p = self.root / key
            if len(made) >= 65536:
                made.clear()
            made[key] = p
        self._check_inside(p, key, cached=not write)  # every time: the file system may have changed
        return p

    def _open_regular(self, key: str) -> tuple[int, int] | None:
        """(fd, size) of a regular file inside the store, None when absent (:func:`open_regular`)."""
        return open_regular(self.path(key), store=self, key=key)

    def get(self, key: str, max_bytes: int | None = MAX_JSON_BYTES) -> bytes | None:
        """The bytes of a regular file inside the store (None when absent).

        Raises
        ------
        StoreCorruptError
            Not a regular file, outside the store, or larger than ``max_bytes``.
        """
        return read_regular(self.path(key), store=self, key=key, max_bytes=max_bytes)

    def get_range(self, key: str, start: int, length: int) -> bytes | None:
        return read_regular(self.path(key), store=self, key=key, start=start, length=max(0, length))

    def size(self, key: str) -> int | None:
        opened = self._open_regular(key)
        if opened is None:
            return None
        os.close(opened[0])
        return opened[1]

    def tail(self, key: str, length: int, size_hint: int | None = None) -> tuple[int, bytes] | None:
        """``(size, last min(length, size) bytes)`` of a regular file inside the store, from
        one open (a shard's size and index: opening a layer reads one per shard); None when
        absent. Raises as :meth:`get`. (``size_hint`` is not needed here.)"""
        opened = self._open_regular(key)
        if opened is None:
            return None
        fd, size = opened
        try:
            n = max(0, min(length, size))
            return size, os.pread(fd, n, size - n)
        finally:
            os.close(fd)

    def set(self, key: str, data: bytes) -> None:
        check_key(key, store=self, what="key")
        p = self.root / key
        with self._spare_lock:
            tmp = self._spare.pop(key, None)
        fd = -1
        if tmp is not None:
            self._check_inside(p.parent, key, cached=False)
            fd = _open_spare(tmp)
        if fd < 0:
            self._make_parent_or_fail(p, key)
            tmp = self._temp_name(p)
        try:
            if fd < 0:  # a new name, made here (never a file or link someone put there)
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
            with os.fdopen(fd, "wb") as f:
                fd = -1
                f.write(data)
                if self.fsync:
                    f.flush()
                    os.fsync(f.fileno())
                written = os.fstat(f.fileno())
            os.replace(tmp, p)
            now = os.lstat(p)
        except BaseException as e:  # (Ctrl-C too: no temporary file is left in the store)
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:  # (closed by the file object it was given to)
                    pass
            try:
                tmp.unlink()
            except OSError:
                pass
            if not isinstance(e, OSError):
                raise
            if isinstance(e, IsADirectoryError) or (p.is_dir() and not p.is_symlink()):
                raise corrupt(self, f"{key!r} must be a regular file, got a directory",
                              fix=f"move the folder at {str(p)!r} away (the store writes that file there), then try "
                                  "again (a capture: resume=True continues from its committed rows)") from e
            raise StoreError(f"writing {str(p)!r} failed: {e.strerror or e}{no_room_hint(e)}") from e
        # (a link swapped in for the temporary file is now at the key; another inode alone is no proof:
        # a FUSE mount may rename by copying)
        if not stat.S_ISREG(now.st_mode) or ((now.st_dev, now.st_ino) != (written.st_dev, written.st_ino)
                                             and now.st_nlink > 1):
            raise corrupt(self, f"{key!r}: its temporary file {tmp.name!r} was replaced by another process while it "
                                "was written, so what was renamed over the key is not what was written",
                          fix="make sure no other process writes in the store's folder, then try again (a capture: "
                              "resume=True continues from its committed rows)")
        if self.fsync:
            fsync_dir(p.parent)

    def set_if_absent(self, key: str, data: bytes) -> bool:
        """Create ``key`` with ``data`` unless it exists (``O_EXCL``: atomic); True when created."""
        check_key(key, store=self, what="key")
        p = self.root / key
        self._make_parent_or_fail(p, key)
        try:
            fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
        except FileExistsError:
            return False
        try:
            os.write(fd, data)
        finally:
            os.close(fd)
        return True

    def put_file(self, key: str, local: Path) -> None:
        if Path(local) != self.root / key:
            self.set(key, Path(local).read_bytes())

    def delete(self, key: str) -> None:
        check_key(key, store=self, what="key")
        p = self.root / key
        if not p.parent.exists():
            return
        self._check_inside(p.parent, key, cached=False)  # the key itself may be a link: unlink removes the link only
        try:
            p.unlink()
        except FileNotFoundError:
            pass

    def list(self, prefix: str = "") -> Iterator[str]:
        if prefix:
            check_key(prefix.rstrip("/"), store=self, what="prefix")
        base = self.root / prefix if prefix else self.root
        if not base.exists():
            return
        self._check_inside(base, prefix or ".")
        for dirpath, _, files in os.walk(base):  # never follows a symlinked folder
            for name in files:
                key = os.path.relpath(os.path.join(dirpath, name), self.root).replace(os.sep, "/")
                if key != LOCK_KEY:
                    yield key

    def exists(self) -> bool:
        return self.root.exists()

    def is_empty(self) -> bool:
        return not self.root.exists() or not any(p.name != LOCK_KEY for p in self.root.iterdir())

    def clear(self, keep: Collection[str] = ()) -> None:
        """Remove everything in the store folder but the writer lock and the names in ``keep``
        (links removed, never followed)."""
        if not self.root.exists():
            return
        for p in self.root.iterdir():
            if p.name == LOCK_KEY or p.name in keep:
                continue
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink()

    def zarr_store(self, read_only: bool = True) -> Any:
        return safe_local_store(self, read_only=read_only)

    def move_aside(self) -> Path | None:
        """Move every entry of the store folder but the writer lock into a new folder next to
        it (``.<name>.replaced-<hex>``, on the same file system: renames only, no copy), the
        root document first (readers then see no store, never a mix). Returns that folder,
        None when there was nothing to move. ``overwrite=True`` keeps the old store there
        until the new one has committed (:meth:`restore_aside`, or delete the folder)."""
        if not self.root.is_dir():
            return None
        entries = sorted((p for p in self.root.iterdir() if p.name != LOCK_KEY), key=lambda p: p.name != "zarr.json")
        if not entries:
            return None
        real = Path(os.path.realpath(self.root))
        aside = real.parent / f".{real.name}.replaced-{uuid.uuid4().hex[:8]}"
        try:
            aside.mkdir()
        except OSError as e:  # (a folder of another user, a read-only mount: the parent only may be so)
            raise StoreError(
                f"overwrite: the old store {str(self.root)!r} is moved aside into a new folder next to it until the "
                f"new one commits, and making {str(aside)!r} failed: {e.strerror or e}; nothing was changed. "
                f"{_NO_WRITE_FIX if e.errno in _NO_WRITE else 'Fix the cause, then run again'}") from e
        done: list[str] = []
        try:
            for p in entries:
                os.rename(p, aside / p.name)
                done.append(p.name)
        except OSError as e:
            # only what was moved goes back (root document last); the entries still at the path are
            # the old store's own, never removed (restore_aside would clear them as a new store's).
            # The root goes back only after every other entry did: else it stays in the folder with
            # them, a split that finish_move_aside recognises (a root at the path over missing
            # entries would read as a damaged store, and its folder aside as remains to delete)
            undone = True
            for name in sorted(reversed(done), key=lambda n: n == "zarr.json"):
                if name == "zarr.json" and not undone:
                    break
                try:
                    os.rename(aside / name, self.root / name)
                except OSError:
                    undone = False
            if undone:
                with contextlib.suppress(OSError):
                    aside.rmdir()
            fix = f". {_NO_WRITE_FIX}" if e.errno in _NO_WRITE else ""
            raise StoreError(f"overwrite: moving the old store {str(self.root)!r} aside to {str(aside)!r} failed: "
                             f"{e.strerror or e}; " + (f"nothing was changed{fix}" if undone else
                             "some of its entries could not be moved back and are in that folder, with its root "
                             "document: once the cause is fixed, run again with overwrite=True (it finishes the "
                             "move)")) from e
        return aside

    def restore_aside(self, aside: Path, cleared: bool = False) -> None:
        """Put back a store :meth:`move_aside` moved: remove what is in the folder now
        (:meth:`clear_for_restore`), move the old entries back (root document last), remove
        ``aside``. ``cleared``: that removal is done already (a put-back cut short by a Ctrl-C
        after it, run again: the entries moved back so far are the old store's, kept); then
        ``aside`` gone means the put-back is done."""
        if not cleared:
            self.clear_for_restore()
        elif not os.path.lexists(aside):
            return
        for p in sorted(Path(aside).iterdir(), key=lambda p: p.name == "zarr.json"):
            os.rename(p, self.root / p.name)
        Path(aside).rmdir()

    def clear_for_restore(self) -> None:
        """:meth:`restore_aside`, step 1: remove what is in the folder (but the writer lock; the
        new root document first, so that a process killed meanwhile leaves no root at the path,
        which :meth:`finish_move_aside` recognises). Run again, it removes what is left. The
        spare files are given up first (:meth:`release`): none is made in a folder being removed."""
        self.release()
        try:
            (self.root / "zarr.json").unlink()
        except (FileNotFoundError, IsADirectoryError):  # (a folder there: clear() removes it)
            pass
        self.clear()

    def aside_folders(self) -> list[Path]:
        """The folders :meth:`move_aside` made for this store that are still there
        (``.<name>.replaced-<8 hex>`` next to the store folder's real path; real directories,
        never links), empty ones included, sorted."""
        try:
            real = Path(os.path.realpath(self.root))
            pattern = re.compile(re.escape(f".{real.name}.replaced-") + "[0-9a-f]{8}")
            return sorted(p for p in real.parent.iterdir()
                          if pattern.fullmatch(p.name) and p.is_dir() and not p.is_symlink())
        except OSError:
            return []

    def drop_empty_aside_folders(self) -> None:
        """Remove the empty folders of :meth:`aside_folders` (a process killed right after it
        made one, or right before it removed one it emptied). A writer calls it under its
        lock: no other :meth:`move_aside` of this store is filling one meanwhile."""
        for p in self.aside_folders():
            try:
                p.rmdir()  # (fails, changing nothing, on a folder that is not empty)
            except OSError:
                pass

    def unwritable_folder(self) -> tuple[str, str] | None:
        """``(folder, why)`` of the first folder of the store (its own folder, then every
        folder under it, links not followed) in which this process may not make, rename or
        remove entries: a read-only mount, a folder of another user that is not writable to
        this one, a folder it may not list. None when it may write in every one. A writer
        that changes an existing store (resume, copy_store over it) asks before its first
        write, so that such a store is refused whole rather than left half written."""
        found: list[tuple[str, str]] = []

        def unlisted(e: OSError) -> None:
            if not found:
                found.append((str(e.filename or self.root), e.strerror or str(e)))

        flags = os.W_OK | os.X_OK
        effective = os.access in os.supports_effective_ids
        for folder, _dirs, _files in os.walk(self.root, onerror=unlisted):
            if found:
                break
            if not os.access(folder, flags, effective_ids=effective):
                try:  # (why: a read-only file system says so; else the folder's permissions)
                    read_only = bool(os.statvfs(folder).f_flag & os.ST_RDONLY)
                except OSError:
                    read_only = False
                return folder, ("read-only file system" if read_only
                                else "permission denied: not writable by this process")
        return found[0] if found else None

    def replaced_remains(self) -> Path | None:
        """The folder of :meth:`aside_folders` that is what a cut-short delete of a replaced store
        left (FORMAT.md section 7: the delete removes its root document first): the one folder
        of them that is not empty, holding no root document and nothing but a store's entries
        (``acts``, ``rows``, ``reductions``, ``ranks`` as real folders; temporary files and
        file-manager clutter as regular files). None when there is none, two or more folders
        are not empty, or that folder holds anything else (a root document, the lock, a link,
        an entry of another name). Whether it is garbage depends on the store at the path too:
        see :func:`_format.settled_replaced`."""
        try:
            held = [p for p in self.aside_folders() if any(p.iterdir())]
            if len(held) != 1:
                return None
            for p in held[0].iterdir():
                if p.is_symlink():
                    return None
                if p.name in _STORE_FOLDERS:
                    if not p.is_dir():
                        return None
                elif p.name in ("zarr.json", LOCK_KEY) or _foreign_names([p.name]) or not p.is_file():
                    return None
            return held[0]
        except OSError:
            return None

    def rootless_store_entries(self) -> list[str]:
        """The entries (but the writer lock) of a store folder that holds no root document and
        nothing but a store's entries (``acts``, ``rows``, ``reductions``, ``ranks`` as real
        folders; temporary files and file-manager clutter as regular files), while nothing next to
        it is named as a folder of :meth:`aside_folders` (a link, or one without a root document,
        included: the root, or the rest of a store, may be there): what a removal of the store
        cut short leaves (its root document gone, e.g. a Ctrl-C while a capture that committed
        no row removed its store), which nothing reads as a store. Sorted; empty when the folder is not such a one
        (a root document there, an entry of another kind, none of a store's folders: temporary files or clutter
        alone, which are no store's, unless one is a temporary file of the store's own naming
        (:data:`TEMP_NAME`, :data:`LINK_TEMP_NAME`), or nothing but the lock)."""
        try:
            if not self.root.is_dir() or os.path.lexists(self.root / "zarr.json"):
                return []
            real = Path(os.path.realpath(self.root))
            pattern = re.compile(re.escape(f".{real.name}.replaced-") + "[0-9a-f]{8}")
            if any(pattern.fullmatch(p.name) for p in real.parent.iterdir()):
                return []
            entries = [p for p in self.root.iterdir() if p.name != LOCK_KEY]
            for p in entries:
                if p.is_symlink() or _foreign_names([p.name]):
                    return []
                if (p.name in _STORE_FOLDERS) != p.is_dir() or not (p.is_dir() or p.is_file()):
                    return []
            # (a draft.tmp or .DS_Store alone: a folder of the user's, whose files overwrite=True would delete;
            # a temporary file of the store's own name, .zarr.json.<8 hex>.tmp, is what a new store killed
            # while it wrote its first root document leaves)
            if not any(p.name in _STORE_FOLDERS or TEMP_NAME.fullmatch(p.name) or LINK_TEMP_NAME.fullmatch(p.name)
                       for p in entries):
                return []
            return sorted(p.name for p in entries)
        except OSError:
            return []

    def moved_roots(self) -> list[Path]:
        """The folders of :meth:`aside_folders` that hold the root document of an
        activationscope store (``zarr.json`` with our attributes): a store an overwrite moved
        aside, whole or in part."""
        return [p for p in self.aside_folders() if (describe_local_path(p) or ("",))[0] == "store"]

    def moved_aside_hint(self) -> str:
        """For a message about a store folder that holds no root document: a sentence naming
        the folder an interrupted overwrite moved the store's root into, and the ways out; ""
        when there is none (or the store folder holds a root document)."""
        try:
            if not self.root.is_dir() or os.path.lexists(self.root / "zarr.json"):
                return ""
        except OSError:
            return ""
        moved = self.moved_roots()
        if not moved:
            return ""
        shown = " and ".join(repr(str(p)) for p in moved)
        left = sorted(p.name for p in self.root.iterdir() if p.name != LOCK_KEY)
        here = (f"the path holds the rest of its entries ({', '.join(map(repr, left))})" if left
                else "the path holds none of its entries")
        return (f"an overwrite=True moved the store's root document (zarr.json) into {shown} and has not finished "
                f"({here}): its writer was killed, or is still running. With no writer running, run the capture "
                "again with overwrite=True (StoreWriter(..., overwrite=True) finishes the move, and puts the old store "
                "back whole if the new one commits nothing), or, to keep the old store, move every entry of that "
                f"folder back into {str(self.root)!r} (zarr.json last) and delete the empty folder")

    def unstarted_store_aside(self, attrs: dict | None) -> Path | None:
        """The folder of :meth:`aside_folders` that holds the whole store an ``overwrite=True``
        was replacing, when the root at the path (``attrs``, its parsed attributes) is that of
        its run killed before its first commit (the store :meth:`drop_unstarted_store` removes:
        status ``incomplete``, no batch, no array with rows, no rank store's; or the uncommitted
        root of a multi-rank run) and exactly one such folder holds a store's root; else None."""
        if (not isinstance(attrs, dict) or attrs.get("status") != "incomplete" or attrs.get("n_batches") != 0
                or "rank_store" in attrs):  # (rank stores hold rows of their own)
            return None
        dist = attrs.get("distributed")
        if "distributed" in attrs and not (isinstance(dist, dict) and dist.get("committed") is False):
            return None
        arrays = attrs.get("arrays") or {}
        if any(not isinstance(a, dict) or a.get("n_rows") != 0 for a in arrays.values()):
            return None
        moved = self.moved_roots()
        return moved[0] if len(moved) == 1 else None

    def drop_unstarted_store(self, attrs: dict | None) -> bool:
        """``overwrite=True`` of a store folder whose root (``attrs``, its parsed attributes) is
        that of a run that committed no forward (status ``incomplete``, no batch, no array with
        rows) while exactly one folder of :meth:`aside_folders` holds a whole store's root: an
        overwrite killed after its new store's first root and before its first commit, which
        should have put that old store back. Removes the unstarted store (its root document
        last: killed here, what is left is that store again, or a folder with only the lock,
        which :meth:`finish_move_aside` then takes the old store back into) and returns True;
        else returns False, changing nothing. Entries that are not a store's are never removed
        (the caller refuses them first). Call it under the writer lock.

        The root may also be the uncommitted root of a multi-rank run (``distributed.committed``
        false): its rank stores (``ranks/``), whose rows no commit took, go with it, for an
        overwrite of one process (``StoreWriter``) as of many ranks (``prepare_root``) alike."""
        if self.unstarted_store_aside(attrs) is None:
            return False
        for p in sorted(self.root.iterdir(), key=lambda q: q.name):
            if p.name in (LOCK_KEY, "zarr.json"):
                continue
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink()
        (self.root / "zarr.json").unlink()
        return True

    def finish_move_aside(self) -> Path | None:
        """``overwrite=True`` of a store folder that holds no root document: finish the move of
        an overwrite whose process was killed in :meth:`move_aside` (or in
        :meth:`restore_aside`), and return the folder that now holds the whole old store, for
        the caller to settle as its own (delete once the new store commits, else put back).

        Returns None, changing nothing, when no folder of :meth:`aside_folders` holds a root
        document, or the store folder holds no entry (but the lock) and two or more do. Raises
        StoreExistsError, changing nothing, when what is left is ambiguous: two or more such
        folders and entries left at the path, an entry that is not a store's, or a name held
        both at the path and in the folder; StoreError when a rename fails (the entries it
        moved are moved back). Call it under the writer lock."""
        if not self.root.is_dir() or os.path.lexists(self.root / "zarr.json"):
            return None
        moved = self.moved_roots()
        if not moved:
            return None
        left = sorted(p.name for p in self.root.iterdir() if p.name != LOCK_KEY)
        where = repr(str(self.root))
        if not left:
            return moved[0] if len(moved) == 1 else None
        shown = _shown(left)
        if len(moved) > 1:
            raise StoreExistsError(
                f"{where} holds no root document (zarr.json) but entries of a store ({shown}), and "
                f"{len(moved)} folders next to it hold the root of a store that an overwrite=True moved aside and never "
                f"settled ({', '.join(repr(str(p)) for p in moved)}): which one those entries belong to cannot be "
                "told; nothing was changed. Move them by hand into the folder they came from (or that folder's "
                f"entries back into {where}, zarr.json last), delete what you do not keep, and run again")
        aside = moved[0]
        foreign = _foreign_names(left)
        if foreign:
            raise StoreExistsError(
                f"{where} holds no root document (zarr.json): an overwrite=True moved it into {str(aside)!r} and was "
                f"killed before it finished; but {where} also holds entries that are not a store's "
                f"({_shown(foreign)}), which overwrite=True would delete with the old store; nothing was changed. "
                f"Move them out of {where} (or remove them) and run again")
        both = sorted(set(left) & {p.name for p in aside.iterdir()})
        if both:
            raise StoreExistsError(
                f"{where} holds no root document (zarr.json): an overwrite=True moved it into {str(aside)!r}, but "
                f"both hold {_shown(both)}, so those are not the two halves of one interrupted move (a writer killed "
                f"while it removed a new store that committed nothing, to put the old one back, leaves its files "
                f"at the path); nothing was changed. If open_store({str(aside)!r}).verify() reports no problem, the "
                f"old store is whole there: remove those entries from {where} and run again; else move the entries "
                f"you keep back into {where} by hand (zarr.json last)")
        done: list[str] = []
        try:
            for name in left:
                os.rename(self.root / name, aside / name)
                done.append(name)
        except OSError as e:
            undone = True
            for name in reversed(done):  # as found
                try:
                    os.rename(aside / name, self.root / name)
                except OSError:
                    undone = False
            raise StoreError(
                f"overwrite: finishing the move of the old store {where} into {str(aside)!r} failed: {e.strerror or e}; "
                + ("nothing was changed" if undone else "some of its entries could not be moved back, and are in that "
                   "folder with the rest: once the cause is fixed, run again with overwrite=True")) from e
        return aside


def _read_for_zarr(backend: "LocalBackend", key: str, prototype: Any, byte_range: Any) -> Any:
    from zarr.abc.store import OffsetByteRequest, RangeByteRequest, SuffixByteRequest
    from zarr.core.buffer import default_buffer_prototype

    path = backend.path(key)
    if byte_range is None:
        cap = MAX_JSON_BYTES if key.rsplit("/", 1)[-1].endswith(".json") else MAX_FILE_BYTES
        data = read_regular(path, store=backend, key=key, max_bytes=cap)
    else:
        size = backend.size(key)
        if size is None:
            return None
        if isinstance(byte_range, RangeByteRequest):
            start, length = byte_range.start, byte_range.end - byte_range.start
        elif isinstance(byte_range, OffsetByteRequest):
            start, length = byte_range.offset, size - byte_range.offset
        elif isinstance(byte_range, SuffixByteRequest):
            start, length = max(0, size - byte_range.suffix), byte_range.suffix
        else:
            raise TypeError(f"byte_range must be a zarr ByteRequest, got {type(byte_range).__name__}")
        data = read_regular(path, store=backend, key=key, start=start, length=max(0, length))
    if data is None:
        return None
    return (prototype or default_buffer_prototype()).buffer.from_bytes(data)


@functools.cache
def _safe_local_store_class() -> type:
    import asyncio

    import zarr

    class SafeLocalStore(zarr.storage.LocalStore):
        """A zarr ``LocalStore`` that reads through :func:`read_regular` (see :func:`safe_local_store`)."""

        def _acs_backend(self) -> "LocalBackend":
            return LocalBackend(self.root)

        def get_sync(self, key: str, *, prototype: Any = None, byte_range: Any = None) -> Any:
            self._ensure_open_sync()
            return _read_for_zarr(self._acs_backend(), key, prototype, byte_range)

        async def get(self, key: str, prototype: Any = None, byte_range: Any = None) -> Any:
            if not self._is_open:
                await self._open()
            return await asyncio.to_thread(_read_for_zarr, self._acs_backend(), key, prototype, byte_range)

        async def get_partial_values(self, prototype: Any, key_ranges: Any) -> list:
            return list(await asyncio.gather(*(self.get(k, prototype, r) for k, r in key_ranges)))

    SafeLocalStore.__module__ = __name__  # picklable (dask workers) through the module __getattr__ below
    return SafeLocalStore


def __getattr__(name: str) -> Any:
    if name == "SafeLocalStore":  # made on first use: importing this module does not import zarr
        return _safe_local_store_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def safe_local_store(backend: "LocalBackend", *, read_only: bool = True) -> Any:
    """A zarr ``LocalStore`` of a local store whose reads go through :func:`read_regular`.

    zarr-python opens files with a plain ``open``: a FIFO in a ``zarr.json``'s or a shard's
    place would block it forever, a link to ``/dev/zero`` read until memory runs out, a link
    leaving the store read outside it. This one reads only regular files inside the store
    (``LocalBackend.path``), documents (``*.json``) capped at ``MAX_JSON_BYTES``; anything
    else raises :class:`StoreCorruptError` naming the key. Picklable (dask workers).
    """
    return _safe_local_store_class()(backend.root, read_only=read_only)


def _open_spare(tmp: Path) -> int:
    """The spare temporary file ``tmp`` (made empty ahead of time by :meth:`LocalBackend.reserve`)
    opened for writing, or -1 when what is at its name is no longer it: anything but a regular
    file of one name (a link or a file another process swapped in, a hard link to a file
    elsewhere) is never written through; its name is removed (a link: the link only)."""
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        _unlink_quietly(tmp)
        return -1
    st = os.fstat(fd)
    if stat.S_ISREG(st.st_mode) and st.st_nlink <= 1 and st.st_size == 0:
        return fd
    os.close(fd)
    _unlink_quietly(tmp)
    return -1


def _unlink_quietly(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass



def _no_bucket(bucket: str) -> str:
    """What to say of a bucket that does not exist, and the fix."""
    shown = "the bucket" if bucket.startswith("<") else f"the bucket {bucket!r}"
    return (f"{shown} does not exist at this endpoint: create it (e.g. `aws s3 mb s3://{bucket}`) or correct the "
            "bucket's name in the URL")


#: Limits an ``s3://`` (``s3a://``) store's client gets unless its ``storage_options`` set them
#: (``config_kwargs``, botocore's ``Config``; each key the caller gives wins): seconds to connect
#: and to wait for an answer, and the tries of each request by botocore. s3fs tries each
#: request again around botocore's tries (``S3FS_TRIES`` times). An endpoint that takes the
#: connection but never answers then fails a request after ``S3FS_TRIES * 2`` waits of
#: ``read_timeout`` (about a minute), not after 25 (botocore's 5 tries within each of s3fs's 5).
S3_CONFIG_DEFAULTS: dict[str, Any] = {"connect_timeout": 5, "read_timeout": 15,
                                      "retries": {"mode": "standard", "total_max_attempts": 2}}
#: Tries s3fs makes of each request of a store (its own default: 5), each one a whole series
#: of botocore's tries.
S3FS_TRIES = 2
_S3_PROTOCOLS = ("s3", "s3a")


def with_remote_defaults(url: str, storage_options: Mapping | None) -> dict | None:
    """``storage_options`` of ``url`` with :data:`S3_CONFIG_DEFAULTS` added to its
    ``config_kwargs`` where the URL is ``s3://`` or ``s3a://`` (the caller's own keys kept
    as given); other URLs' options unchanged. Never changes the caller's dict."""
    if url.split("://", 1)[0].lower() not in _S3_PROTOCOLS:
        return None if storage_options is None else dict(storage_options)
    options = dict(storage_options or {})
    given = options.get("config_kwargs")
    if given is not None and not isinstance(given, Mapping):
        return options  # (s3fs says what is wrong with it)
    # (copies: botocore rewrites the retries dict it is given, e.g. max_attempts to total_max_attempts)
    options["config_kwargs"] = copy.deepcopy({**S3_CONFIG_DEFAULTS, **(given or {})})
    return options


def _no_expect_continue(request: Any, **kwargs: Any) -> None:
    """botocore ``before-send`` handler of an s3 store's client: drops the header
    ``Expect: 100-continue`` that botocore puts on every upload (PutObject, UploadPart). With
    it, aiohttp waits for the endpoint's "100 Continue" before sending the body, and that wait
    has no timeout (``read_timeout`` starts once the body is sent): an endpoint that takes the
    connection and never answers held a capture's first write (its lock) forever. Without it
    the body is sent at once and ``read_timeout`` bounds the wait for the answer. The header is
    not signed (SigV4 leaves ``expect`` out), so the request stays valid."""
    headers = getattr(request, "headers", None)
    if headers is not None and "Expect" in headers:
        del headers["Expect"]


def unreachable(e: BaseException) -> bool:
    """Whether ``e`` (or what caused it) says the object store did not answer (no connection,
    or no answer in time): asking again at once would wait again."""
    seen, n = e, 0
    while seen is not None and n < 8:
        if type(seen).__name__ in _UNREACHABLE or isinstance(seen, TimeoutError):
            return True
        seen, n = seen.__cause__ or seen.__context__, n + 1
    return False


_UNREACHABLE = frozenset({"EndpointConnectionError", "ConnectTimeoutError", "ClientConnectorError",
                          "ReadTimeoutError", "ReadTimeout", "FSTimeoutError", "ConnectionClosedError"})


def _botocore_tries(retries: Any) -> int | None:
    """Tries of one request that botocore's ``retries`` config makes (None: unknown)."""
    if not isinstance(retries, Mapping):
        return None
    total = retries.get("total_max_attempts")
    if isinstance(total, int) and not isinstance(total, bool) and total >= 1:
        return total
    more = retries.get("max_attempts")
    if isinstance(more, int) and not isinstance(more, bool) and more >= 0:
        return more + 1
    return None


def remote_failure(e: BaseException, endpoint: str | None = None, config: Mapping | None = None,
                   s3fs_tries: int | None = None) -> str:
    """``e`` (an error of an object store's client) as text, with the fix where it is a missing
    credential, a refused one or an endpoint that does not answer: where ``storage_options``
    (``store_options={"storage_options": ...}`` of a capture) or the environment the command
    line reads (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_PROFILE``,
    ``AWS_ENDPOINT_URL``) give them. ``endpoint``, ``config`` (the client's ``config_kwargs``)
    and ``s3fs_tries``, when known, name the endpoint, its waits and its tries."""
    chain, seen = [], e
    while seen is not None and len(chain) < 8:
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__
    names = {type(x).__name__ for x in chain}
    text = " ".join(str(x) for x in chain)
    config = config if isinstance(config, Mapping) else {}
    at = f" {endpoint}" if endpoint else ""
    tries = _botocore_tries(config.get("retries"))
    tried = (f"; each request was tried {tries * s3fs_tries} times ({s3fs_tries} by s3fs, each {tries} by botocore)"
             if tries and s3fs_tries else "; each request was tried again by s3fs and botocore")

    def waited(key: str) -> str:
        value = config.get(key)
        return f"{key} {value} s" if isinstance(value, (int, float)) and not isinstance(value, bool) else key

    if names & {"NoCredentialsError", "PartialCredentialsError"} or "Unable to locate credentials" in text:
        hint = ("no credentials were found: pass storage_options={'key': ..., 'secret': ...} (a capture: "
                "store_options={'storage_options': ...}), or set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
                "(or AWS_PROFILE) in the environment, as the command line reads them")
    elif names & {"EndpointConnectionError", "ConnectTimeoutError", "ClientConnectorError"} or \
            "Could not connect to the endpoint URL" in text:
        how = (f"no connection within {waited('connect_timeout')}" if "ConnectTimeoutError" in names or
               "Connect timeout on endpoint" in text else "the connection was refused, or the host is unknown")
        hint = (f"the endpoint{at} did not answer ({how}{tried}): check "
                "storage_options={'client_kwargs': {'endpoint_url': ...}} or AWS_ENDPOINT_URL in the environment "
                "(the command line reads it); where it is slow to take a connection, give it longer: "
                "storage_options={'config_kwargs': {'connect_timeout': 30}}")
    elif names & {"ReadTimeoutError", "ReadTimeout", "TimeoutError", "FSTimeoutError"} or "Read timeout on endpoint" in text:
        hint = (f"the endpoint{at} took the connection but did not answer within {waited('read_timeout')}{tried}: "
                "check that the endpoint (storage_options={'client_kwargs': {'endpoint_url': ...}} or "
                "AWS_ENDPOINT_URL) is an S3 service that is up; on a slow link give it longer: "
                "storage_options={'config_kwargs': {'read_timeout': 60}}")
    elif "NoSuchBucket" in names or "NoSuchBucket" in text or "specified bucket does not exist" in text:
        hint = (f"{_no_bucket('<bucket>')} (and the endpoint: storage_options={{'client_kwargs': "
                "{'endpoint_url': ...}} or AWS_ENDPOINT_URL)")
    elif isinstance(e, PermissionError) or any(w in text for w in (
            "AccessDenied", "Access Denied", "Forbidden", "InvalidAccessKeyId", "SignatureDoesNotMatch")):
        hint = ("the object store refused the credentials or this bucket: check the key and secret "
                "(storage_options=, or AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY) and the bucket's permissions")
    else:
        return str(e)
    return f"{e}; {hint}"


class ZarrBackend:
    """Any zarr ``Store``; :class:`MemoryBackend` and :class:`FsspecBackend` are its common kinds.

    ``set`` is one ``put`` (object stores replace an object whole). ``set_if_absent`` is
    atomic only where :attr:`capabilities` says so (the generic one checks, then writes).
    """

    is_local = False
    capabilities = Capabilities(atomic_write=True, atomic_rename=False, conditional_write=False, mmap=False)

    def __init__(self, store: Any, label: str | None = None) -> None:
        self.store = store
        self.label = label or repr(store)

    def __repr__(self) -> str:
        return self.label

    def _failure(self, e: BaseException) -> str:
        """``e`` as :func:`remote_failure` says it, with what this store knows of its endpoint."""
        return remote_failure(e)

    def _sync(self, coro: Any) -> Any:
        from .._safeio import zarr_sync

        return zarr_sync(coro)

    def _get(self, key: str, byte_range: Any = None) -> bytes | None:
        from zarr.core.buffer import default_buffer_prototype

        try:
            buf = self._sync(self.store.get(key, prototype=default_buffer_prototype(), byte_range=byte_range))
        except (FileNotFoundError, KeyError):
            return None
        except OSError as e:
            raise StoreError(f"reading {key!r} from {self.label} failed: {self._failure(e)}") from e
        return None if buf is None else buf.to_bytes()

    def get(self, key: str, max_bytes: int | None = MAX_JSON_BYTES) -> bytes | None:
        """The object's bytes, None when it is not there; with ``max_bytes``, a
        :class:`StoreCorruptError` for an object larger than that, read no further.

        An object store's request costs its latency: a bound of at most ``MAX_JSON_BYTES`` (a
        document, a manifest, the lock) is one ranged read of ``max_bytes + 1`` bytes, which
        tells a larger object by its length, with no size asked first; a larger bound asks for
        the size first (one metadata request), then reads it in one request (a file system that
        reads a large object in parallel parts does so above that bound)."""
        from zarr.abc.store import RangeByteRequest

        check_key(key, store=self, what="key")
        if max_bytes is None:
            return self._get(key)
        if max_bytes > MAX_JSON_BYTES:
            size = self.size(key)
            if size is None:
                return None
            if size > max_bytes:
                raise corrupt(self, f"{key!r} holds {size} bytes, more than the {max_bytes} such a file may hold")
            if size > MAX_JSON_BYTES:
                return self._get(key)
        try:
            data = self._get(key, RangeByteRequest(0, max_bytes + 1))
        except StoreError as e:
            if unreachable(e):
                raise
            data = self._get(key)  # (a store that refuses a range past the end of the object)
        if data is not None and len(data) > max_bytes:
            size = self.size(key) if len(data) == max_bytes + 1 else len(data)
            shown = f"{size} bytes" if size is not None and size > max_bytes else f"more than {max_bytes} bytes"
            raise corrupt(self, f"{key!r} holds {shown}, more than the {max_bytes} such a file may hold")
        return data

    def get_range(self, key: str, start: int, length: int) -> bytes | None:
        from zarr.abc.store import RangeByteRequest

        check_key(key, store=self, what="key")
        if start < 0:
            raise ArgumentValueError(f"get_range of {key!r}: start must be 0 or more, got {start}")
        if length <= 0:
            return b"" if self.size(key) is not None else None
        try:  # one ranged read (an object store's request costs its latency: no size asked first)
            data = self._get(key, RangeByteRequest(start, start + length))
        except StoreError as e:
            if unreachable(e):  # (asked again, it would be waited for again)
                raise
            data = None  # (a range past the end is refused by some stores: asked again with the size)
        else:
            if data is None or len(data) <= length:
                return data
        size = self.size(key)
        if size is None:
            return None
        if start >= size:
            return b""
        return self._get(key, RangeByteRequest(start, min(size, start + length)))

    def size(self, key: str) -> int | None:
        check_key(key, store=self, what="key")

        async def getsize() -> int | None:
            try:  # (one metadata request: a missing key raises FileNotFoundError)
                return await self.store.getsize(key)
            except (FileNotFoundError, KeyError):
                return None

        try:
            n = self._sync(getsize())
        except (FileNotFoundError, KeyError):
            return None
        except OSError as e:  # (a refused credential, an endpoint that does not answer: with the fix)
            raise StoreError(f"reading the size of {key!r} in {self.label} failed: {self._failure(e)}") from e
        return None if n is None else int(n)

    def tail(self, key: str, length: int, size_hint: int | None = None) -> tuple[int, bytes] | None:
        """``(size, last min(length, size) bytes)`` of the object, None when absent: its size
        (one metadata request), then a ranged read. With ``size_hint`` (the size a manifest
        records), one ranged read of ``length + 1`` bytes from ``size_hint - length``: it comes
        back as exactly ``length`` bytes only when the object ends at ``size_hint`` (a read past
        the end stops there), so the hint is only a guess that the read confirms; any other
        answer asks for the size as without it."""
        if (isinstance(size_hint, int) and not isinstance(size_hint, bool) and length > 0
                and length <= size_hint <= MAX_FILE_BYTES):
            data = self.get_range(key, size_hint - length, length + 1)
            if data is not None and len(data) == length:
                return size_hint, data
        size = self.size(key)
        if size is None:
            return None
        n = max(0, min(length, size))
        data = self.get_range(key, size - n, n)
        return None if data is None else (size, data)

    def set(self, key: str, data: bytes) -> None:
        from zarr.core.buffer import cpu

        check_key(key, store=self, what="key")
        try:
            self._sync(self.store.set(key, cpu.Buffer.from_bytes(data)))
        except Exception as e:  # remote errors come in many classes
            raise StoreError(f"writing {key!r} to {self.label} failed: {self._failure(e)}") from e

    def set_if_absent(self, key: str, data: bytes) -> bool:
        """Write ``key`` unless it exists; True when this call wrote it (not atomic here)."""
        check_key(key, store=self, what="key")
        if self.size(key) is not None:
            return False
        self.set(key, data)
        return self._get(key) == data

    def put_file(self, key: str, local: Path) -> None:
        self.set(key, Path(local).read_bytes())

    def delete(self, key: str) -> None:
        check_key(key, store=self, what="key")
        try:
            self._sync(self.store.delete(key))
        except (FileNotFoundError, KeyError):
            pass
        except Exception as e:  # remote errors come in many classes (botocore's are no OSError)
            if isinstance(e, StoreError):
                raise
            raise StoreError(f"deleting {key!r} from {self.label} failed: {self._failure(e)}") from e

    def list(self, prefix: str = "") -> Iterator[str]:
        if prefix:
            check_key(prefix.rstrip("/"), store=self, what="prefix")

        async def collect() -> list[str]:
            return [k async for k in self.store.list_prefix(prefix)]

        try:
            keys = self._sync(collect())
        except (FileNotFoundError, KeyError, StoreError):
            raise
        except Exception as e:  # remote errors come in many classes (botocore's are no OSError)
            raise StoreError(f"listing {prefix or 'the objects'!r} of {self.label} failed: {self._failure(e)}") from e
        for key in keys:
            if key != LOCK_KEY:
                yield key

    def exists(self) -> bool:
        return self.size("zarr.json") is not None

    def stamp(self, key: str) -> tuple | None:
        """What changes when the object ``key`` is written again, read fresh from the store
        (never from a cached listing): here its size and the crc32c of its bytes (at most
        ``MAX_JSON_BYTES``; a larger one stamps by its size alone). None when it is not there.
        A reader compares stamps of the root document to see a store replaced under it."""
        from . import _format as F

        size = self.size(key)
        if size is None:
            return None
        if size > MAX_JSON_BYTES:
            return (size,)
        data = self._get(key)
        return None if data is None else (len(data), F.crc32c(data))

    def is_empty(self) -> bool:
        return next(iter(self.list("")), None) is None

    def clear(self, keep: Collection[str] = ()) -> None:
        for key in list(self.list("")):
            if key not in keep:
                self.delete(key)

    def zarr_store(self, read_only: bool = True) -> Any:
        return self.store


class MemoryBackend(ZarrBackend):
    """A zarr ``MemoryStore`` (one process); ``set_if_absent`` is atomic (one dict insert)."""

    capabilities = Capabilities(atomic_write=True, atomic_rename=False, conditional_write=True, mmap=False)

    def set_if_absent(self, key: str, data: bytes) -> bool:
        from zarr.core.buffer import cpu

        check_key(key, store=self, what="key")
        buf = cpu.Buffer.from_bytes(data)
        self._sync(self.store.set_if_not_exists(key, buf))
        return self._get(key) == data


class FsspecBackend(ZarrBackend):
    """A zarr ``FsspecStore`` (``s3://``, ``gs://``, ``memory://`` ...).

    ``set_if_absent`` is a conditional put (S3 ``If-None-Match: *``; fsspec memory: exclusive
    create) where the file system offers one, atomic across processes and hosts; elsewhere a
    check then a write (:attr:`capabilities` ``conditional_write`` False).
    """

    def __init__(self, store: Any, label: str | None = None) -> None:
        super().__init__(store, label)
        fs = getattr(store, "fs", None)
        inner = getattr(fs, "sync_fs", fs)  # zarr wraps synchronous file systems
        names = {type(fs).__name__, type(inner).__name__}
        self._conditional = bool(names & {"S3FileSystem", "MemoryFileSystem"})
        self.capabilities = Capabilities(atomic_write=True, atomic_rename=False,
                                         conditional_write=self._conditional, mmap=False)
        if "S3FileSystem" in names:  # (its own tries, around botocore's: see S3_CONFIG_DEFAULTS)
            for f in {id(x): x for x in (fs, inner) if type(x).__name__ == "S3FileSystem"}.values():
                f.retries = S3FS_TRIES
                self._drop_expect_continue(f)
        self.forget_listings()

    def reopened(self) -> "FsspecBackend":
        """This backend over a new file system object, made with the options of this one, for a
        forked child: the parent's object holds client sessions of the parent's event loop (s3fs:
        aiobotocore), which fail in the child ("attached to a different loop"). fsspec makes a
        new object in a process other than the one that cached it."""
        import zarr

        zstore = self.store
        fs = zstore.fs
        fresh = type(fs)(*getattr(fs, "storage_args", ()), **getattr(fs, "storage_options", {}))
        return FsspecBackend(zarr.storage.FsspecStore(fresh, read_only=zstore.read_only, path=zstore.path),
                             label=self.label)

    def _drop_expect_continue(self, fs: Any) -> None:
        """Have ``fs`` (an s3fs file system) send its uploads without ``Expect: 100-continue``
        (:func:`_no_expect_continue`). Its client is made here (no request is sent); a file
        system whose client cannot be made is left as it is (its first request says why)."""
        try:
            if fs.asynchronous:
                self._sync(fs.set_session())
            else:
                fs.connect()
            fs._s3.meta.events.register("before-send.s3", _no_expect_continue,
                                        unique_id="activationscope-no-expect-continue")
        except Exception:  # noqa: BLE001 - (see above)
            pass

    def _failure(self, e: BaseException) -> str:
        fs = getattr(self.store, "fs", None)
        fs = getattr(fs, "sync_fs", fs)
        if type(fs).__name__ != "S3FileSystem":
            return remote_failure(e)
        client = getattr(fs, "_s3", None)  # (the endpoint the client was made for, once it is made)
        endpoint = getattr(getattr(client, "meta", None), "endpoint_url", None)
        if not endpoint:
            endpoint = ((getattr(fs, "client_kwargs", None) or {}).get("endpoint_url") or getattr(fs, "endpoint_url", None)
                        or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL"))
        return remote_failure(e, endpoint=str(endpoint) if endpoint else None,
                              config=getattr(fs, "_prepare_config_kwargs", dict)(), s3fs_tries=getattr(fs, "retries", None))

    def forget_listings(self) -> None:
        """Drop the listings of this store's folders that the file system cached (s3fs and
        others keep one file system object per process, options alike, and answer whether a
        key exists from a listing made earlier): files another process wrote since, e.g. a
        resume's documents, shards and row-table parts, would read as missing. Called when a
        backend is made (a store opened, a writer started) and by ``Store.refresh``."""
        fs = getattr(self.store, "fs", None)
        for f in {id(x): x for x in (fs, getattr(fs, "sync_fs", None)) if x is not None}.values():
            cache = getattr(f, "dircache", None)
            if not cache:
                continue
            try:
                root = f._strip_protocol(self.store.path).rstrip("/")
                for key in [k for k in list(cache) if k == root or str(k).startswith(root + "/")]:
                    cache.pop(key, None)
                f.invalidate_cache(root)  # (and its parents' listings, which name it)
            except Exception:  # noqa: BLE001 - a cache it cannot drop: reads as before
                pass

    def path_info(self) -> Any:
        """The file system's info of the store's own path (``{"type": "file" | "directory",
        ...}``; raises what the file system raises: FileNotFoundError when nothing is there);
        None for a file system without async info."""
        fs = getattr(self.store, "fs", None)
        if fs is None or not hasattr(fs, "_info"):
            return None
        return self._sync(fs._info(self.store.path.rstrip("/")))

    def why_no_root(self) -> str:
        """Why this URL holds no store root, where the file system can tell in a request or
        two (called once ``zarr.json`` was found missing): its bucket does not exist, or an
        object (a file) sits at the store's own path. '' when neither."""
        fs = getattr(self.store, "fs", None)
        if fs is None or not hasattr(fs, "_info"):
            return ""
        path = self.store.path.rstrip("/")
        protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
        try:
            info = self.path_info()
        except FileNotFoundError as e:
            bucket = path.split("/", 1)[0]
            missing = "bucket does not exist" in str(e) or "NoSuchBucket" in str(e)
            if not missing and set(protocols) & {"s3", "s3a", "gs", "gcs"} and bucket != path:
                try:
                    self._sync(fs._info(bucket))
                except FileNotFoundError:
                    missing = True
                except Exception:  # noqa: BLE001 - said by the caller's message as it is
                    return ""
            return _no_bucket(bucket) if missing else ""
        except Exception:  # noqa: BLE001 - a refused credential or an endpoint down: the next request says it
            return ""
        if isinstance(info, dict) and info.get("type") == "file":
            return ("an object (a file) is at that path, and a store is a prefix (folder) of objects: "
                    "give the store's own URL (the prefix that holds its zarr.json)")
        return ""

    def stamp(self, key: str) -> tuple | None:
        """The object's size and identity (S3: ETag and last-modified; fsspec memory: its
        creation time) from one metadata request that bypasses the file system's cached
        listings; the bytes' crc32c (:meth:`ZarrBackend.stamp`) where the file system gives
        no identity. None when it is not there."""
        check_key(key, store=self, what="key")
        fs = getattr(self.store, "fs", None)
        if fs is None or not hasattr(fs, "_info"):
            return super().stamp(key)
        path = f"{self.store.path.rstrip('/')}/{key}"
        try:
            inner = getattr(fs, "sync_fs", None)  # (zarr wraps a synchronous file system)
            if inner is not None:
                inner.invalidate_cache(path)
                info = inner.info(path)
            else:
                fs.invalidate_cache(path)
                info = self._sync(fs._info(path))
        except FileNotFoundError:
            return None
        except Exception as e:  # remote errors come in many classes
            raise StoreError(f"reading the size of {key!r} in {self.label} failed: {self._failure(e)}") from e
        ident = tuple(str(info.get(k)) for k in ("ETag", "LastModified", "created", "mtime", "VersionId")
                      if info.get(k) is not None)
        if not ident:
            return super().stamp(key)
        return (info.get("size"), *ident)

    def set_if_absent(self, key: str, data: bytes) -> bool:
        check_key(key, store=self, what="key")
        if not self._conditional:
            return super().set_if_absent(key, data)
        path = f"{self.store.path.rstrip('/')}/{key}"

        async def put() -> bool:
            try:
                await self.store.fs._pipe_file(path, data, mode="create")
            except FileExistsError:
                return False
            except OSError as e:
                if "PreconditionFailed" in str(e) or "412" in str(e):
                    return False
                raise
            return True

        try:
            return bool(self._sync(put()))
        except FileExistsError:
            return False
        except Exception as e:  # remote errors come in many classes
            if "PreconditionFailed" in str(e) or "412" in str(e):
                return False
            raise StoreError(f"writing {key!r} to {self.label} failed: {self._failure(e)}") from e


def describe_local_path(path: str | os.PathLike) -> tuple[str, str] | None:
    """What is at a local path, for messages that must not guess: ``None`` when nothing is
    there, else ``(kind, description)`` with ``kind`` one of ``"store"`` (an activationscope
    store), ``"zarr"`` (a Zarr node that is not one), ``"empty"`` (an empty folder),
    ``"folder"`` (a folder with other things in it) and ``"file"``.

    Reads only the root ``zarr.json`` (at most ``MAX_JSON_BYTES``) and the folder listing.
    """
    p = Path(expand_local(os.fspath(path)))
    if not p.exists() and not p.is_symlink():
        return None
    if not p.is_dir():
        size = p.stat().st_size if p.exists() else 0
        return "file", f"a file ({size:,} bytes)"
    entries = sorted(e.name for e in p.iterdir())
    if not entries:
        return "empty", "an empty folder"
    try:
        raw = read_regular(p / "zarr.json", store=p, key="zarr.json")
    except StoreError:  # not a regular file, or too large: described as a folder below
        raw = None
    if raw is not None:
        try:
            meta = json.loads(raw)
        except (ValueError, RecursionError):
            meta = None
        attrs = meta.get("attributes") if isinstance(meta, dict) else None
        ours = attrs.get("activationscope") if isinstance(attrs, dict) else None
        if isinstance(ours, dict):
            return "store", (f"an activationscope store (status {ours.get('status', '?')!r}, "
                             f"{int(ours.get('n_samples', 0) or 0):,} samples)")
        if isinstance(meta, dict):
            return "zarr", "a Zarr node that is not an activationscope store"
    shown = ", ".join(repr(e) for e in entries[:3]) + (", ..." if len(entries) > 3 else "")
    count = f"{len(entries)} entr{'y' if len(entries) == 1 else 'ies'}"
    return "folder", f"a folder that is not a store ({count}: {shown})"

#: A rank store's folder in its multi-rank store (FORMAT.md §10): ``ranks/<rank, 5 digits>``.
_RANK_FOLDER = re.compile(r"ranks/[0-9]{5}")
#: The stores (a local store's resolved folder, an fsspec store's path) under which a rank task
#: that captures the store again (FORMAT.md section 10, "Capturing a store again") writes its rank
#: store while the root is a complete store: set by the rank task around the making of its writer.
_CAPTURED_AGAIN: contextvars.ContextVar[frozenset[str]] = contextvars.ContextVar("captured_again",
                                                                                default=frozenset())


@contextlib.contextmanager
def rank_stores_allowed(backend: Any) -> Iterator[None]:
    """Within the block, a rank store ``ranks/<rank, 5 digits>`` of the store ``backend`` may be
    written under its root even when that root is complete (a rank task capturing the store
    again, FORMAT.md section 10); elsewhere such a path is a store inside another store."""
    key = (str(backend.root.resolve()) if isinstance(backend, LocalBackend) else
           backend.store.path.strip("/") if isinstance(backend, FsspecBackend) else None)
    token = _CAPTURED_AGAIN.set(_CAPTURED_AGAIN.get() | {key}) if key is not None else None
    try:
        yield
    finally:
        if token is not None:
            _CAPTURED_AGAIN.reset(token)


def _store_marks(folder: Path) -> tuple[bool, dict | None]:
    """Whether ``folder`` is an activationscope store (its root document has our attributes,
    or it holds a writer lock: a store being made, or one whose root is damaged), and those
    attributes (None when unreadable)."""
    try:
        raw = read_regular(folder / "zarr.json", store=folder, key="zarr.json")
    except (StoreError, OSError):
        raw = None
    is_store, attrs = _parse_marks(raw, False)
    if is_store:
        return True, attrs
    try:
        locked = (folder / LOCK_KEY).is_file()
    except OSError:
        locked = False
    return locked, None


def store_above(path: str | os.PathLike) -> Path | None:
    """The outermost activationscope store that a local ``path`` lies inside (symlinks
    resolved), None when no folder above it is one.

    A folder above counts as a store when its ``zarr.json`` carries our attributes or it holds
    a writer lock. A rank store's own folder ``ranks/<rank, 5 digits>`` in its multi-rank
    store (one not committed yet, FORMAT.md §10, or whose root document is missing or
    unreadable) is where rank stores belong: that store does not count for it (a store above
    that one still does).

    Reads at most one root document (``MAX_JSON_BYTES``) per folder above ``path``.
    """
    p = Path(expand_local(os.fspath(path))).resolve()
    found = None
    for q in p.parents:
        is_store, attrs = _store_marks(q)
        if not is_store:
            continue
        dist = (attrs or {}).get("distributed")
        rank_root = attrs is None or (isinstance(dist, dict) and dist.get("committed") is not True) \
            or str(q) in _CAPTURED_AGAIN.get()
        if rank_root and _RANK_FOLDER.fullmatch(p.relative_to(q).as_posix()):
            continue
        found = q
    return found


def check_not_in_store(root: str | os.PathLike) -> None:
    """Raise :class:`StoreError` when a new or resumed local store at ``root`` would lie
    inside another store (:func:`store_above`): its files would be written among that
    store's, and a store cannot hold another one. Checked before anything is written."""
    outer = store_above(root)
    if outer is None:
        return
    p = Path(expand_local(os.fspath(root))).resolve()
    rel = p.relative_to(outer).as_posix()
    raise StoreError(
        f"store path {str(root)!r} lies inside the store {str(outer)!r} (as {rel!r}); "
        f"a store cannot be written inside another store, and nothing was written. "
        + (_committed_rank_hint(str(outer)) if _RANK_FOLDER.fullmatch(rel) else
           f"Choose a path outside {str(outer)!r} (e.g. {str(outer.parent / p.name)!r})")
    )


def _committed_rank_hint(outer: str) -> str:
    """The fix for a rank store path ``ranks/<rank>`` of a store already committed from its
    rank stores (a commit stopped before it removed them): the capture is done there."""
    return (f"It is a rank store left over from the commit of {outer!r}, which already holds every rank's rows: "
            f"run `activationscope consolidate {outer}` to finish that commit (it removes the rank stores); to "
            "capture that store again, run every task with store_options overwrite=True and "
            "process_group=acs.RankStore(rank, world_size)")


def _parse_marks(raw: bytes | None, locked: bool) -> tuple[bool, dict | None]:
    """:func:`_store_marks` from a root document's bytes and whether a writer lock is there."""
    attrs = None
    if raw is not None:
        try:
            meta = json.loads(raw)
        except (ValueError, RecursionError):
            meta = None
        got = meta.get("attributes") if isinstance(meta, dict) else None
        got = got.get("activationscope") if isinstance(got, dict) else None
        attrs = got if isinstance(got, dict) else None
    return (True, attrs) if attrs is not None else (locked, None)


def remote_store_above(backend: "FsspecBackend") -> str | None:
    """:func:`store_above` for a store on an fsspec file system (``s3://``, ``memory://``
    ...): the outermost prefix above the backend's path that is an activationscope store (its
    ``zarr.json`` carries our attributes, or it holds a writer lock marker), None when none
    is. The same rank-store exception applies. Reads at most one root document
    (``MAX_JSON_BYTES``) and checks one lock marker per prefix above the path."""
    fs = backend.store.fs
    path = backend.store.path.strip("/")
    parts = [p for p in path.split("/") if p]

    async def marks(prefix: str) -> tuple[bool, dict | None]:
        raw = None
        try:
            if await fs._size(f"{prefix}/zarr.json") <= MAX_JSON_BYTES:
                raw = await fs._cat_file(f"{prefix}/zarr.json")
        except (FileNotFoundError, OSError, ValueError, TypeError) as e:
            if unreachable(e):
                raise
            raw = None
        try:
            locked = bool(await fs._exists(f"{prefix}/{LOCK_KEY}"))
        except (OSError, ValueError) as e:
            if unreachable(e):
                raise
            locked = False
        return _parse_marks(raw, locked)

    found = None
    for i in range(1, len(parts)):
        prefix = "/".join(parts[:i])
        try:
            is_store, attrs = backend._sync(marks(prefix))
        except Exception as e:  # noqa: BLE001 - a prefix that cannot be read (no permission): not known as a store
            if unreachable(e):  # (an endpoint that does not answer: each next request would wait as long)
                raise StoreError(f"reading the prefix {prefix!r} above {backend.label} failed: "
                                 f"{backend._failure(e)}") from e
            continue
        if not is_store:
            continue
        dist = (attrs or {}).get("distributed")
        rank_root = attrs is None or (isinstance(dist, dict) and dist.get("committed") is not True) \
            or prefix in _CAPTURED_AGAIN.get()
        if rank_root and _RANK_FOLDER.fullmatch("/".join(parts[i:])):
            continue
        found = prefix
    return found


def check_backend_not_in_store(backend: Any) -> None:
    """:func:`check_not_in_store` for any backend: a local folder, or a prefix of an fsspec
    file system (:func:`remote_store_above`). Other backends (a zarr ``MemoryStore``) hold one
    store each and pass."""
    if isinstance(backend, LocalBackend):
        check_not_in_store(backend.root)
        return
    if not isinstance(backend, FsspecBackend):
        return
    outer = remote_store_above(backend)
    if outer is None:
        return
    path = backend.store.path.strip("/")
    protocol = getattr(backend.store.fs, "protocol", None)
    protocol = protocol[0] if isinstance(protocol, (tuple, list)) else protocol
    scheme = f"{protocol}://" if protocol else ""
    rel = path[len(outer) + 1:]
    raise StoreError(
        f"store {backend.label!r} lies inside the store {scheme + outer!r} (as {rel!r}); a store "
        f"cannot be written inside another store, and nothing was written. "
        + (_committed_rank_hint(scheme + outer) if _RANK_FOLDER.fullmatch(rel) else
           f"Choose a path outside {scheme + outer!r}")
    )


def check_local_store_path(root: str | os.PathLike) -> None:
    """Raise :class:`StoreError` when a local store path (or a folder above it) is a file.

    A store is a directory; an existing regular file there is never replaced, not even with
    ``overwrite=True`` (which only deletes stores).
    """
    p = Path(expand_local(os.fspath(root))).absolute()
    for q in (p, *p.parents):
        if q.exists():
            if not q.is_dir():
                what = "" if q == p else f" (its folder {str(q)!r} is a file)"
                raise StoreError(
                    f"store path {str(p)!r} must be a directory or a path that does not exist yet, got an existing "
                    f"file{what}; choose a directory path (overwrite=True never deletes a file that is not a store)"
                )
            return


def check_remote_store_path(backend: Any) -> None:
    """:func:`check_local_store_path` for a prefix of an fsspec file system (``s3://``, ...):
    raise :class:`StoreError` when an object (a file) sits at the store's own path and no store
    is under it. Object storage would keep both (the object, and the store's objects under the
    prefix of the same name), so the mistyped path of a file would become a store beside it."""
    if not isinstance(backend, FsspecBackend):
        return
    try:
        info = backend.path_info()
    except Exception as e:  # noqa: BLE001 - nothing there, or a failure the writer's next request names
        if unreachable(e):  # (... after waiting as long again: said now)
            raise StoreError(f"reading {backend.label} failed: {backend._failure(e)}") from e
        return
    if not isinstance(info, dict) or info.get("type") != "file" or backend.size("zarr.json") is not None:
        return
    raise StoreError(
        f"store path {backend.label!r} must be a prefix (folder) of objects or a path where nothing is yet, got an "
        f"existing object (a file) of {info.get('size')} bytes; choose another path, or delete that object if it "
        "is not needed (overwrite=True never deletes an object that is not a store)"
    )


def folds_names(folder: Path, a: str, b: str) -> bool:
    """Whether the file system of the local ``folder`` takes the file names ``a`` and ``b`` for
    one (macOS and Windows fold case and Unicode normalization): a file ``a`` is made in a new
    temporary folder there (``.names-<...>.tmp``, which readers ignore) and ``b`` looked up
    beside it; the folder is removed."""
    probe = Path(tempfile.mkdtemp(prefix=".names-", suffix=".tmp", dir=folder))
    try:
        (probe / a).touch()
        return os.path.lexists(probe / b)
    finally:
        shutil.rmtree(probe, ignore_errors=True)


_PERCENT_ESCAPE = re.compile(r"%[0-9A-Fa-f]{2}")


def _refuse_misread_file_url(target: str) -> None:
    """Refuse the ``file:`` URLs whose path would be read other than the URL standard (RFC 8089)
    reads it: a local path is ``file://`` followed by the path as it is (``file:///runs/a.zarr``
    is ``/runs/a.zarr``), so ``file:/runs/a.zarr`` would be a folder ``file:`` in the current
    one, ``file://localhost/runs/a.zarr`` a folder ``localhost``, and the ``%20`` of
    ``pathlib.Path.as_uri()`` a ``%20`` in the folder's name. ArgumentValueError naming the URL
    and the path to give instead."""
    if target.startswith("file:") and not target.startswith("file://"):
        raise ArgumentValueError(
            f"path {target!r} must be a local path or a file:// URL (two slashes before the path, "
            f"file:///runs/a.zarr for /runs/a.zarr), got a 'file:' URL that would be read as a path relative to the "
            f"current folder; give {'file://' + target[len('file:'):]!r} or the path {target[len('file:'):]!r} "
            f"({'./' + target!r} for a folder of that name)"
        )
    if not target.startswith("file://"):
        return
    path = target[len("file://"):]
    if path == "localhost" or path.startswith("localhost/"):
        raise ArgumentValueError(
            f"path {target!r} names the host 'localhost', which is read as a folder 'localhost' in the current "
            f"one (as fsspec reads it); give {'file://' + path[len('localhost'):]!r} or the path "
            f"{path[len('localhost'):] or '/'!r}"
        )
    if _PERCENT_ESCAPE.search(path):
        import urllib.parse

        raise ArgumentValueError(
            f"path {target!r} holds percent escapes (such as pathlib's Path.as_uri() writes), which are not "
            f"decoded: the file or folder would be named with them; give the path itself, "
            f"{urllib.parse.unquote(path)!r} (or {path!r} if that is its real name)"
        )


def expand_local(target: Any) -> Any:
    """``target`` with a leading ``~`` or ``~user`` of a local path expanded (as a shell does,
    ``os.path.expanduser``): a str without ``://``, a ``file://~...`` URL, or an
    ``os.PathLike``. Anything else (URLs, zarr Stores, backends) is returned unchanged."""
    if isinstance(target, (LocalBackend, ZarrBackend)):
        return target
    if isinstance(target, os.PathLike):
        fs = os.fspath(target)
        if isinstance(fs, str) and fs.startswith("~"):
            return Path(os.path.expanduser(fs))
        return target
    if isinstance(target, str):
        _refuse_misread_file_url(target)
        if target.startswith("file://~"):
            return "file://" + os.path.expanduser(target[len("file://"):])
        if target.startswith("~") and "://" not in target:
            return os.path.expanduser(target)
    return target


def local_path(target: str | os.PathLike) -> str | None:
    """The local path that ``target`` names, as :func:`resolve` reads it: a path (a leading
    ``~`` expanded), or the path of a ``file://`` URL (``file:///runs/a.zarr`` is
    ``/runs/a.zarr``); None for any other URL (``memory://``, ``s3://``, ...).

    Every check of a local output (an existing store, a folder that is not one, a path inside
    a store, what ``overwrite`` may replace) is made on this path, so a ``file://`` URL is
    checked exactly as the path it names."""
    target = expand_local(target)
    text = os.fspath(target)
    if isinstance(text, bytes):
        text = os.fsdecode(text)
    if text.startswith("file://"):
        return text[len("file://"):]
    return None if "://" in text else text


def resolve(target: Any, *, fsync: bool = False, read_only: bool = False,
            storage_options: dict | None = None) -> StoreBackend:
    """A backend for a path, a URL (``file://``, ``memory://``, ``s3://``, ...) or a zarr Store.

    A local path's leading ``~`` is expanded (:func:`expand_local`). ``storage_options`` go
    to fsspec for URLs (credentials, ``client_kwargs``, ...)."""
    import zarr

    if storage_options is not None and not isinstance(storage_options, Mapping):
        raise ArgumentTypeError(f"storage_options must be a dict of fsspec options (credentials, client_kwargs, ...) "
                                f"or None, got {type(storage_options).__name__}")
    target = expand_local(target)

    if isinstance(target, (LocalBackend, ZarrBackend)):
        return target
    if isinstance(target, os.PathLike):
        return LocalBackend(target, fsync=fsync)
    if isinstance(target, str):
        if target.startswith("file://"):
            return LocalBackend(target[len("file://"):], fsync=fsync)
        if "://" not in target:
            return LocalBackend(target, fsync=fsync)
        try:
            zstore = zarr.storage.FsspecStore.from_url(target, read_only=read_only,
                                                       storage_options=with_remote_defaults(target, storage_options))
        except Exception as e:
            raise StoreError(f"cannot open the store URL {target!r} through fsspec: {e}") from e
        return FsspecBackend(zstore, label=target)
    if isinstance(target, zarr.storage.LocalStore):
        return LocalBackend(target.root, fsync=fsync)
    if isinstance(target, zarr.storage.MemoryStore):
        return MemoryBackend(target)
    if isinstance(target, zarr.storage.FsspecStore):
        return FsspecBackend(target)
    if isinstance(target, zarr.abc.store.Store):
        return ZarrBackend(target)
    raise ArgumentTypeError(
        f"store must be a local path, an fsspec URL (s3://..., memory://...) or a zarr Store, got {type(target).__name__}"
    )


#: The folders of a local store's folder that are the store's own (FORMAT.md section 1).
_STORE_FOLDERS = frozenset({"acts", "rows", "reductions", "ranks"})
#: The entries of a local store's folder that are the store's own (FORMAT.md section 1; names
#: ending in ``.tmp`` are unfinished writes, also the store's).
_STORE_ENTRIES = frozenset({"zarr.json", *_STORE_FOLDERS, LOCK_KEY})
#: Files a file manager leaves in any folder it shows: not the user's data, removed with the store.
_OS_CLUTTER = frozenset({".DS_Store", "Thumbs.db", "desktop.ini"})


def _foreign_names(names: Collection[str]) -> list[str]:
    """The names of ``names`` (top-level entries of a store folder) that are not a store's:
    neither a store entry, nor file-manager clutter, nor a temporary file. Sorted."""
    return sorted(n for n in names if n not in _STORE_ENTRIES and n not in _OS_CLUTTER
                  and not n.endswith(".tmp") and not n.startswith("._"))  # (._*: macOS AppleDouble)


def _shown(names: list[str]) -> str:
    """At most five names quoted, for a message."""
    return ", ".join(repr(n) for n in names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def refuse_foreign_entries(backend: Any) -> None:
    """Refuse replacing an activationscope store (``overwrite=True``, ``copy_store``) whose
    folder (or prefix, on object storage and ``memory://``) also holds entries that are not
    the store's (notes, a report or an export written there, a folder of one's own): replacing
    the store removes them with it. A Zarr node that is not an activationscope store is left
    to the caller's rules (its arrays are its entries).

    Raises StoreExistsError naming them; nothing is changed."""
    if isinstance(backend, LocalBackend):
        if (describe_local_path(backend.root) or ("",))[0] != "store":
            return
        names = {p.name for p in backend.root.iterdir()}
    else:
        try:
            attrs = json.loads(backend.get("zarr.json", max_bytes=MAX_JSON_BYTES) or b"null").get("attributes")
        except (ValueError, AttributeError, RecursionError):
            return
        if not isinstance(attrs, dict) or not isinstance(attrs.get(_format.ATTRS_KEY), dict):
            return
        names = {key.split("/", 1)[0] for key in backend.list("")}
    foreign = _foreign_names(names)
    if foreign:
        shown = _shown(foreign)
        raise StoreExistsError(
            f"overwrite=True would delete {len(foreign)} entr{'y' if len(foreign) == 1 else 'ies'} of "
            f"{str(backend)!r} that {'is' if len(foreign) == 1 else 'are'} not the store's ({shown}) together with "
            "the old store; move them out of the store's folder (or remove them) and run again; nothing was changed"
        )


def write_root_first(backend: Any, attrs: dict, *, replacing: bool) -> None:
    """Write the root document of a run that starts (``attrs``: its ``activationscope``
    attributes, status ``incomplete``), over the root of the store it replaces if any; then,
    with ``replacing``, delete every other object of the old store (the writer lock kept).

    The root goes first (FORMAT.md section 7): from that atomic write on, a reader of the old
    run is told the store was replaced and no object of the old run is read as this store's, so
    a process killed at any point leaves the old store intact or an incomplete store of the new
    run listing no row of the old one (what is left of its objects is removed by a resume or an
    overwrite). Used by an overwrite on object storage (``StoreWriter``), ``copy_store`` and a
    multi-rank overwrite (``prepare_root``); a local ``StoreWriter`` moves the old store aside
    instead."""
    backend.set("zarr.json", _format.dumps(_format.group_document({_format.ATTRS_KEY: attrs})))
    if replacing:
        backend.clear(keep=("zarr.json",))
