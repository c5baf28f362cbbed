"""Removing a store that holds no committed row (what a capture failing on its first
batches leaves behind), so that the corrected rerun does not need ``overwrite=True``."""

from __future__ import annotations

from typing import Any

from .._args import parse_flag
from ._backend import LOCK_KEY, LocalBackend, resolve
from ._lock import WriterLock


def remove_if_empty(target: Any, *, remove_folder: bool = True, storage_options: dict | None = None) -> bool:
    """Remove the store at ``target`` if it is an activationscope store with no committed row.

    A store qualifies when it opens, ``n_samples == 0`` and every hook point has 0 committed
    rows (in a store that keeps reductions only, 0 rows reduced). Everything is removed under the store's writer lock (a store being written by
    someone else is left alone), a local store's root document first (a removal cut short
    leaves entries of a store with no root document, which a writer with ``overwrite=True``
    replaces); anything that is not such a store is never touched.

    Parameters
    ----------
    target : str, os.PathLike or zarr Store
        As :func:`open_store`.
    remove_folder : bool, default True
        For a local store, also remove its (then empty) folder; pass False when the folder
        existed before the capture.
    storage_options : dict, optional
        fsspec options of a URL ``target`` (credentials, ``client_kwargs``), as
        :func:`open_store` takes them.

    Returns
    -------
    bool
        Whether the store was removed.

    Raises
    ------
    ArgumentTypeError
        ``remove_folder`` is not a bool; nothing is removed.
    """
    from .reader import open_store

    remove_folder = parse_flag(remove_folder, "remove_folder")  # (before anything is removed)
    try:
        backend = resolve(target, storage_options=storage_options)
    except Exception:  # noqa: BLE001 - not a store location: nothing to remove
        return False
    lock = WriterLock(backend)
    try:
        lock.acquire()
    except Exception:  # noqa: BLE001 - another writer holds it
        return False
    removed = False
    try:
        # looked at under the lock: a writer that took the store and committed rows since it was
        # first seen empty keeps them
        try:
            store = open_store(backend)
        except Exception:  # noqa: BLE001 - not a readable store: not ours to remove
            return False
        try:
            # (a store that keeps reductions only has no row to count: the rows its hook points reduced)
            rows = ((store.n_rows(hp) for hp in store.hook_points) if store.rows_stored
                    else (int(e.get("n_rows", 0)) for e in store.reduced.values()))
            if store.n_samples != 0 or any(rows):
                return False
        finally:
            store.close()
        if isinstance(backend, LocalBackend):  # (its root document first, as a put-back clears: cut short, what is
            # left reads as no store, and a capture with overwrite=True replaces it)
            try:
                (backend.root / "zarr.json").unlink()
            except (FileNotFoundError, IsADirectoryError):  # (a folder there: clear() removes it)
                pass
        backend.clear()
        removed = True
        if isinstance(backend, LocalBackend):  # (while held: no other writer holds the file it removes)
            try:
                (backend.root / LOCK_KEY).unlink(missing_ok=True)
            except OSError:
                pass
    finally:
        if removed:
            lock.release()
        else:  # left as found (a lock file or folder the lock made for nothing there goes again)
            lock.discard_root()
    if remove_folder and isinstance(backend, LocalBackend):
        try:
            backend.root.rmdir()
        except OSError:
            pass
    return True
