"""The local staging folders of remote stores' writers (``acs-staging-*``, ``acs-commit-*`` in
:func:`tempfile.gettempdir`, that is ``$TMPDIR``).

A writer of a remote store writes each shard into a local folder of its own and uploads it at
the commit that lists it (see :class:`~activationscope.store.StoreWriter`); the merge of a
multi-rank store does the same for the shards it rewrites. The writer removes its folder when
it closes, aborts or is dropped; a process killed (``SIGKILL``, the out-of-memory killer, a
preempted job) cannot, and its folder keeps the shards it never uploaded, as much as the
writer's pending budget.

So each folder holds :data:`LOCK_NAME`, whose ``flock`` its writer holds as long as it lives:
the kernel releases it when the process ends, however it ends. :func:`make_staging_folder`
first removes the folders of the current user and host whose lock no process holds (their
shards were never uploaded, and a resume captures their rows again), then makes the new one. The lock is
taken on a file of another name, renamed to :data:`LOCK_NAME` only once held, so that no
folder is ever seen unlocked while its writer lives. A folder without :data:`LOCK_NAME` (one
being made, or where ``flock`` cannot be taken) is never removed; so a folder loses its lock
file last, once all else in it is gone, whether its writer or a sweep removes it (a removal that
fails, or is killed, part way leaves the rest with the lock file, and the next sweep takes it).
Where there is no ``flock`` (no :mod:`fcntl`) no folder has a lock file and the sweep removes
none.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import tempfile
import time
from pathlib import Path

from ..errors import StoreError, docs_page

#: The lock file in each staging folder; its writer holds its ``flock`` while it lives.
LOCK_NAME = ".activationscope-staging.lock"

#: The prefixes of the staging folders (a remote store's writer; the merge of a multi-rank store).
PREFIXES = ("acs-staging-", "acs-commit-")


def _take_lock(fd: int) -> bool:
    """Take the exclusive ``flock`` of ``fd`` without blocking: False when a process holds it
    (or ``flock`` cannot be taken here)."""
    try:
        import fcntl

        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except (ImportError, OSError):
        return False
    return True


def remove_dead_staging_folders(tmp: str | os.PathLike | None = None) -> list[str]:
    """Remove the staging folders in ``tmp`` (default :func:`tempfile.gettempdir`) that writers
    of processes now gone left: a folder named ``acs-staging-*`` or ``acs-commit-*``, not a
    link, owned by this user, whose :data:`LOCK_NAME` (a regular file, not a link, naming this
    host: a ``$TMPDIR`` shared between hosts may not share their locks) this process can lock.
    A folder whose lock a live process holds (its writer, or a process forked from it), or
    that has no lock file, is left; without :mod:`fcntl` every folder is. A folder is emptied
    before its lock file goes: one whose removal fails part way keeps it, with what remains,
    for the next sweep. Returns the paths removed. Never raises (whatever a lock file holds): a
    folder that cannot be read or removed is left as it is."""
    removed: list[str] = []
    try:
        import fcntl  # noqa: F401 - (without it no folder has a lock file: none is removed)
    except ImportError:
        return removed
    try:
        root = Path(tmp) if tmp is not None else Path(tempfile.gettempdir())
        entries = list(os.scandir(root))
    except OSError:  # (gettempdir: no usable folder; the mkdtemp after it says so)
        return removed
    uid = os.getuid() if hasattr(os, "getuid") else None
    for entry in entries:
        if not entry.name.startswith(PREFIXES):
            continue
        try:
            if not entry.is_dir(follow_symlinks=False):
                continue
            fd = os.open(os.path.join(entry.path, LOCK_NAME),
                         os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
                         | getattr(os, "O_NONBLOCK", 0))
        except Exception:  # noqa: BLE001 - (no lock file: being made, made where flock fails, or by an older version)
            continue
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or (uid is not None and st.st_uid != uid):
                continue
            if entry.stat(follow_symlinks=False).st_uid != st.st_uid:
                continue
            # only a folder of this host: on a $TMPDIR shared between hosts (a network file system
            # mounted without locks across them) another host's live writer's lock is not seen here
            try:
                holder = json.loads(os.pread(fd, 4096, 0))
            except ValueError:
                continue
            if not isinstance(holder, dict) or holder.get("host") != socket.gethostname():
                continue
            if not _take_lock(fd):  # (held: its writer lives)
                continue
            # no process holds it: the folder's writer is gone (locked by this process while removed)
            _remove_lock_last(entry.path)
            if not os.path.lexists(entry.path):
                removed.append(entry.path)
        except Exception:  # noqa: BLE001 - never raises into the capture (a lock file of any content)
            continue
        finally:
            os.close(fd)
    return removed


def _remove_lock_last(path: str) -> None:
    """Remove the staging folder ``path`` (its lock held by this process: its writer's, or a
    sweep's), its :data:`LOCK_NAME` last: a removal that fails part way (a file that cannot go)
    or is killed leaves the lock file with what remains, and the next sweep removes it. Never
    follows a link; never raises."""
    try:
        dfd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0)
                      | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return
    try:
        for name in os.listdir(dfd):
            if name == LOCK_NAME:
                continue
            try:
                if stat.S_ISDIR(os.stat(name, dir_fd=dfd, follow_symlinks=False).st_mode):
                    try:
                        shutil.rmtree(name, dir_fd=dfd, ignore_errors=True)
                    except NotImplementedError:  # (no fd-based rmtree here)
                        shutil.rmtree(os.path.join(path, name), ignore_errors=True)
                else:
                    os.unlink(name, dir_fd=dfd)
            except Exception:  # noqa: BLE001 - (what stays is removed by a later sweep)
                pass
        if any(name != LOCK_NAME for name in os.listdir(dfd)):
            return  # (the lock file stays with what could not go)
        try:
            os.unlink(LOCK_NAME, dir_fd=dfd)
        except FileNotFoundError:
            pass
    except Exception:  # noqa: BLE001
        return
    finally:
        os.close(dfd)
    try:
        os.rmdir(path)
    except OSError:
        pass


def make_staging_folder(prefix: str = "acs-staging-", store: str | None = None) -> tuple[Path, int | None]:
    """Make a new staging folder ``<prefix>*`` in :func:`tempfile.gettempdir` holding the
    ``flock`` of its :data:`LOCK_NAME` (the open file returned, to close with
    :func:`remove_staging_folder`), after removing the folders dead writers left
    (:func:`remove_dead_staging_folders`). The lock file holds ``{"pid", "host", "started"}``
    of this process: only a folder of this host is ever removed. Where ``flock`` cannot be
    taken (no ``fcntl``, a file system without locks) the folder has no lock file and the
    returned file is None: it is removed only by its writer.

    Raises
    ------
    StoreError
        The folder cannot be made (``$TMPDIR`` missing, full or read-only): the message names
        it, and ``store`` (the remote store written) when given.
    """
    if prefix not in PREFIXES:
        raise ValueError(f"prefix must be one of {PREFIXES}, got {prefix!r}")
    remove_dead_staging_folders()
    try:
        folder = Path(tempfile.mkdtemp(prefix=prefix))
    except OSError as e:
        try:
            where = repr(tempfile.gettempdir())
        except OSError:
            where = "no folder"
        of = f" of store {store!r}" if store is not None else ""
        raise StoreError(
            f"the local staging folder{of} cannot be made in {where} (the temporary folder, TMPDIR): "
            f"{e.strerror or e}. A remote store's shards are written there first and uploaded at each "
            "commit: set TMPDIR to a folder of this host that exists, is writable and has room for the "
            f"shards written between two commits (see {docs_page('docs/usage/capture.md', 'Into a store')})"
        ) from e
    taking = folder / (LOCK_NAME + ".new")
    fd: int | None = None
    try:
        fd = os.open(taking, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
                     | getattr(os, "O_CLOEXEC", 0), 0o600)
        if not _take_lock(fd):
            raise OSError("flock")
        os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                 "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}).encode())
        os.rename(taking, folder / LOCK_NAME)  # (the lock is on the file: held under its new name)
    except OSError:  # (no lock here: the folder stays without one, removed by its writer alone)
        if fd is not None:
            os.close(fd)
            fd = None
        try:
            os.unlink(taking)
        except OSError:
            pass
    return folder, fd


def remove_staging_folder(folder: str | os.PathLike, fd: int | None) -> None:
    """Remove a staging folder made by :func:`make_staging_folder`, its lock file last (a
    removal that fails, or is killed, part way leaves the rest to the next sweep, not a folder
    without a lock file that none removes), then close its lock file ``fd`` (so no other
    process takes the folder for a dead writer's while it goes). Never raises."""
    if fd is None:  # (no lock file)
        shutil.rmtree(folder, ignore_errors=True)
    else:
        _remove_lock_last(os.fspath(folder))
    if fd is not None:
        try:
            os.close(fd)
        except OSError:
            pass
