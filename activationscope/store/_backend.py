"""Where a store's objects live: a local directory, or any zarr ``Store`` (memory, fsspec).

A backend is a flat key -> bytes map with atomic ``set`` (local: temp file + rename).
"""

from __future__ import annotations

import os
import queue
import shutil
import threading
import uuid
from pathlib import Path
from typing import Any, Iterator

from ..errors import StoreError


class LocalBackend:
    """A store in a local directory; ``set`` is atomic (temp file, optional fsync, rename).

    Creating a file is the slow part of a small atomic write on many file systems (a new
    inode and directory entry; about 1 ms on some virtual disks, against about 0.1 ms to
    fill an existing one). A writer that knows which keys its next commit will write can
    :meth:`reserve` them: a background thread creates their (empty) temporary files ahead of
    time, and ``set`` then only fills and renames one. :meth:`release` removes the unused.
    """

    is_local = True

    def __init__(self, root: str | os.PathLike, fsync: bool = False) -> None:
        self.root = Path(root).absolute()
        self.fsync = fsync
        self._spare: dict[str, Path] = {}  # key -> an empty temporary file made for it
        self._spare_lock = threading.Lock()
        self._spare_queue: queue.SimpleQueue | None = None
        self._spare_thread: threading.Thread | None = None
        self._releasing = False

    @staticmethod
    def _temp_name(p: Path) -> Path:
        return p.parent / f".{p.name}.{uuid.uuid4().hex[:8]}.tmp"

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
            try:
                tmp.parent.mkdir(parents=True, exist_ok=True)
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
            self._spare_thread.join()
            self._spare_thread = None
        with self._spare_lock:
            spare, self._spare = self._spare, {}
        for tmp in spare.values():
            _unlink_quietly(tmp)

    def __repr__(self) -> str:
        return str(self.root)

    def path(self, key: str) -> Path:
        return self.root / key

    def get(self, key: str) -> bytes | None:
        try:
            with open(self.root / key, "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None
        except NotADirectoryError:
            return None

    def set(self, key: str, data: bytes) -> None:
        p = self.root / key
        with self._spare_lock:
            tmp = self._spare.pop(key, None)
        if tmp is None:
            p.parent.mkdir(parents=True, exist_ok=True)
            tmp = self._temp_name(p)
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                if self.fsync:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, p)
        except OSError as e:
            try:
                tmp.unlink()
            except OSError:
                pass
            raise StoreError(f"writing {str(p)!r} failed: {e.strerror or e}") from e
        if self.fsync:
            fd = os.open(p.parent, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def put_file(self, key: str, local: Path) -> None:
        if Path(local) != self.root / key:
            self.set(key, Path(local).read_bytes())

    def delete(self, key: str) -> None:
        try:
            (self.root / key).unlink()
        except FileNotFoundError:
            pass

    def list(self, prefix: str = "") -> Iterator[str]:
        base = self.root / prefix if prefix else self.root
        if not base.exists():
            return
        for dirpath, _, files in os.walk(base):
            for name in files:
                yield os.path.relpath(os.path.join(dirpath, name), self.root).replace(os.sep, "/")

    def exists(self) -> bool:
        return self.root.exists()

    def is_empty(self) -> bool:
        return not self.root.exists() or not any(self.root.iterdir())

    def clear(self) -> None:
        if self.root.exists():
            shutil.rmtree(self.root)

    def size(self, key: str) -> int:
        try:
            return (self.root / key).stat().st_size
        except FileNotFoundError:
            return 0

    def zarr_store(self, read_only: bool = True) -> Any:
        import zarr

        return zarr.storage.LocalStore(self.root, read_only=read_only)


def _unlink_quietly(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass


class ZarrBackend:
    """Any zarr ``Store`` (``MemoryStore``, ``FsspecStore`` for s3:// gs:// memory:// ...)."""

    is_local = False

    def __init__(self, store: Any, label: str | None = None) -> None:
        self.store = store
        self.label = label or repr(store)

    def __repr__(self) -> str:
        return self.label

    def _sync(self, coro: Any) -> Any:
        from zarr.core.sync import sync

        return sync(coro)

    def get(self, key: str) -> bytes | None:
        from zarr.core.buffer import default_buffer_prototype

        buf = self._sync(self.store.get(key, prototype=default_buffer_prototype()))
        return None if buf is None else buf.to_bytes()

    def set(self, key: str, data: bytes) -> None:
        from zarr.core.buffer import cpu

        try:
            self._sync(self.store.set(key, cpu.Buffer.from_bytes(data)))
        except Exception as e:  # remote errors come in many classes
            raise StoreError(f"writing {key!r} to {self.label} failed: {e}") from e

    def put_file(self, key: str, local: Path) -> None:
        self.set(key, Path(local).read_bytes())

    def delete(self, key: str) -> None:
        try:
            self._sync(self.store.delete(key))
        except (FileNotFoundError, KeyError):
            pass

    def list(self, prefix: str = "") -> Iterator[str]:
        async def collect() -> list[str]:
            return [k async for k in self.store.list_prefix(prefix)]

        yield from self._sync(collect())

    def exists(self) -> bool:
        return self.get("zarr.json") is not None

    def is_empty(self) -> bool:
        return next(iter(self.list("")), None) is None

    def clear(self) -> None:
        for key in list(self.list("")):
            self.delete(key)

    def size(self, key: str) -> int:
        async def getsize() -> int:
            return await self.store.getsize(key)

        try:
            return int(self._sync(getsize()))
        except Exception:
            data = self.get(key)
            return 0 if data is None else len(data)

    def zarr_store(self, read_only: bool = True) -> Any:
        return self.store


def check_local_store_path(root: str | os.PathLike) -> None:
    """Raise :class:`StoreError` when a local store path (or a folder above it) is a file.

    A store is a directory; an existing regular file there is never replaced, not even with
    ``overwrite=True`` (which only deletes stores).
    """
    p = Path(root).absolute()
    for q in (p, *p.parents):
        if q.exists():
            if not q.is_dir():
                what = "" if q == p else f" (its folder {str(q)!r} is a file)"
                raise StoreError(
                    f"store path {str(p)!r} must be a directory or a path that does not exist yet, got an existing "
                    f"file{what}; choose a directory path (overwrite=True never deletes a file that is not a store)"
                )
            return


def resolve(target: Any, *, fsync: bool = False, read_only: bool = False,
            storage_options: dict | None = None) -> LocalBackend | ZarrBackend:
    """A backend for a path, a URL (``file://``, ``memory://``, ``s3://``, ...) or a zarr Store.

    ``storage_options`` go to fsspec for URLs (credentials, ``client_kwargs``, ...)."""
    import zarr

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
            zstore = zarr.storage.FsspecStore.from_url(target, read_only=read_only, storage_options=storage_options)
        except Exception as e:
            raise StoreError(f"cannot open the store URL {target!r} through fsspec: {e}") from e
        return ZarrBackend(zstore, label=target)
    if isinstance(target, zarr.storage.LocalStore):
        return LocalBackend(target.root, fsync=fsync)
    if isinstance(target, zarr.abc.store.Store):
        return ZarrBackend(target)
    raise TypeError(
        f"store must be a local path, an fsspec URL (s3://..., memory://...) or a zarr Store, got {type(target).__name__}"
    )
