"""The exclusive writer lock of a store: one writer at a time (FORMAT.md §7).

Local stores: ``fcntl.flock`` on ``<store>/.activationscope-writer.lock`` (released by the
kernel when the holder exits, however it exits). Object stores: a marker object of the same
key created with a conditional put (S3 ``If-None-Match: *``), deleted by :meth:`release`; a
marker left by a writer that died on this host (or by a writer of this process dropped
without a close) is taken over, one left from another host must be deleted by hand (the
error says which). The lock file holds ``{"pid", "host",
"started", "token"}`` of the holder (and ``role``, when it says what holds it: a multi-rank
capture's rank 0), which the error of a second writer names.

Readers never take the lock: they see the last commit.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import stat
import time
import uuid
from typing import Any

from ..errors import StoreError, StoreLockedError
from . import _format as F
from ._backend import LOCK_KEY, LocalBackend, no_room_hint
from ._validate import corrupt


def _holder_text(raw: bytes | None) -> str:
    try:
        h = json.loads(raw or b"")
        role = h.get("role")
        what = f"{role[:200]}, " if isinstance(role, str) and role else ""
        return f"pid {h['pid']} on host {h['host']!r} ({what}since {h['started']})"
    except (ValueError, KeyError, TypeError, AttributeError):
        return "another process (it has not written its pid yet)"


def _holder_role(raw: bytes | None) -> str | None:
    """The ``role`` the holder named in the lock file (a multi-rank capture's rank 0), or None."""
    try:
        role = json.loads(raw or b"").get("role")
    except (ValueError, AttributeError):
        return None
    return role if isinstance(role, str) and role else None


#: Tokens of the marker locks this process holds now (object stores): a marker of this process
#: whose token is not here was left by a writer dropped without a close (garbage collected),
#: and is taken over like one of a process that is gone.
_HELD_TOKENS: set[str] = set()


def _pid_alive(pid: Any) -> bool:
    """Whether a process ``pid`` runs on this host (one of another user's counts as running,
    and so does a number no process id can be); False for what is no process id (not a
    positive int)."""
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, OSError):
        return True
    return True


def _flock_held(fd: int) -> bool | None:
    """Whether a process holds the ``flock`` of the open lock file ``fd`` (tried as a shared
    lock without blocking, released at once); None where ``flock`` cannot be tried."""
    try:
        import fcntl

        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except (ImportError, OSError):  # (no flock here: a file system without locks)
        return None
    fcntl.flock(fd, fcntl.LOCK_UN)
    return False


def writer_holding(backend: Any) -> str | None:
    """Who holds the writer lock of the store at ``backend`` now (``pid ... on host ...``), or
    None when no writer is known to. A local store: whether a process holds the lock file's
    ``flock`` (the lock a writer takes; a shared lock tried without blocking and dropped at once:
    a writer starting at that moment tries again, and is never turned away by it), its holder
    named by the file; so a lock file that a killed writer left, on this host or another (a store
    copied or unpacked from a capture killed elsewhere), holds nothing. Where ``flock`` cannot be
    tried, the file alone: a holder named (a writer truncates it when it releases the lock) whose
    pid is gone on this host holds nothing, one of another host is taken to hold the store. An
    object store: its marker exists (one of this host whose pid is gone holds nothing)."""
    if isinstance(backend, LocalBackend):
        try:
            fd = os.open(backend.root / LOCK_KEY, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:  # (none, or not a regular file a writer could hold: that writer is refused)
            return None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return None
            raw = os.pread(fd, 4096, 0)
            held = _flock_held(fd)
        finally:
            os.close(fd)
        if held is not None:
            return _holder_text(raw) if held else None
    else:
        try:
            raw = backend.get(LOCK_KEY, max_bytes=4096)
        except StoreError:
            return None
        if raw is None:
            return None
    if not raw and isinstance(backend, LocalBackend):
        return None  # (released: its last writer truncated it)
    try:
        h = json.loads(raw)
    except ValueError:
        h = None
    if isinstance(h, dict) and h.get("host") == socket.gethostname() and not _pid_alive(h.get("pid")):
        return None
    return _holder_text(raw)


def rank_writers_holding(backend: Any) -> list[str]:
    """The rank stores ``ranks/<rank, 5 digits>`` under the local store at ``backend`` whose
    writer lock a live process holds now (:func:`writer_holding`), each as ``"ranks/<rank> (pid
    ... on host ...)"``, in rank order; empty when none, and for an object store (no such lock
    outlives its writer there: not asked)."""
    if not isinstance(backend, LocalBackend):
        return []
    folder = backend.root / "ranks"
    try:
        names = sorted(p.name for p in folder.iterdir() if F.is_rank_name(p.name))
    except OSError:  # (none, or not a folder)
        return []
    out = []
    for name in names:
        holder = writer_holding(LocalBackend(folder / name))
        if holder is not None:
            out.append(f"ranks/{name} ({holder})")
    return out


def refuse_rank_writers(backend: Any, what: str) -> None:
    """Refuse ``what`` (``"overwrite=True"``, ``"resume=True"``) of the local store at
    ``backend`` while a live process writes one of its rank stores (a multi-rank capture, or its
    tasks without a process group, ``RankStore``): it would take them over.

    Raises
    ------
    StoreLockedError
        Such a rank store; its message names the store, the rank stores and their writers
        (pid, host). Nothing was changed.
    """
    live = rank_writers_holding(backend)
    if live:
        shown = ", ".join(live[:4]) + (f" and {len(live) - 4} more" if len(live) > 4 else "")
        raise StoreLockedError(
            f"store {str(backend)!r}: its rank stores are being written ({shown}); {what} would take them over; "
            "nothing was changed: wait for that capture (or its tasks) to finish, or stop it, then run again, or "
            "write elsewhere")


class WriterLock:
    """The exclusive writer lock of one store; :meth:`acquire` raises when another writer holds it.

    Parameters
    ----------
    backend : StoreBackend
        The store's backend (local: a lock file; elsewhere: a marker object).
    role : str, optional
        What holds it, written to the lock file as ``role`` and named by the refusal of
        another writer (a multi-rank capture's rank 0: ``"rank 0 of a multi-rank capture of N
        ranks"``).
    """

    def __init__(self, backend: Any, role: str | None = None) -> None:
        self.backend = backend
        self.role = role
        self._kept = False  # keep(): the `with` block ends without releasing it
        self.token = uuid.uuid4().hex
        self._fd: int | None = None
        self._held = False
        self._pid = os.getpid()  # the process that took it (acquire)
        self.created_root = False  # whether acquire() made the store folder
        self.created_file = False  # whether acquire() made the lock file (a local store)

    def _me(self) -> bytes:
        return json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": F.utc_now(),
                           "token": self.token, **({"role": self.role} if self.role else {})}).encode()

    def keep(self) -> "WriterLock":
        """Keep the lock held past the end of the ``with`` block it was taken in (when that block
        ends without an exception); :meth:`release` gives it back. Returns the lock."""
        self._kept = True
        return self

    def acquire(self) -> "WriterLock":
        """Take the lock.

        Raises
        ------
        StoreLockedError
            Another writer (this process or another one) holds it; the message names its pid
            and host.
        """
        self._pid = os.getpid()
        try:
            if isinstance(self.backend, LocalBackend):
                self._acquire_local()
            else:
                self._acquire_marker()
            self._held = True
            return self
        except BaseException:
            if self._fd is not None or self.token in _HELD_TOKENS:
                # taken, then interrupted (Ctrl-C) before the caller got it: given back, since the
                # traceback a notebook keeps would hold it for as long
                self._held = True
                self.discard_root()
            elif self.created_root and isinstance(self.backend, LocalBackend):
                try:  # (the folder it made, left as it was found when nothing is in it)
                    self.backend.root.rmdir()
                except OSError:
                    pass
            raise

    def _locked_error(self, holder: bytes | None, extra: str = "") -> StoreLockedError:
        try:
            h = json.loads(holder) if holder else None
        except ValueError:
            h = None
        if isinstance(h, dict) and h.get("pid") == os.getpid() and h.get("host") == socket.gethostname():
            # (the holder is a writer of this very process that is still open: no file to delete; a
            # marker of this process whose writer was dropped unclosed is taken over before this)
            extra = ("; that writer is in this process and still open: close it first (leave its `with` block, "
                     "or call its close(), tracker.remove() for a tracker; one whose close a Ctrl-C cut short "
                     "holds the store until that close() or tracker.remove() is called again, which finishes it)")
        elif _holder_role(holder) is not None:
            # (rank 0 holds it from its preparation of the store to its commit of the ranks' stores)
            return StoreLockedError(
                f"store {str(self.backend)!r} is being written by {_holder_text(holder)}: that capture's ranks write "
                "their rank stores under it and its rank 0 commits them at its end; one writer at a time, nothing "
                "was changed: wait for that capture to finish, or stop it (every rank: the lock goes with rank 0's "
                f"process, however it ends) and run again, or write elsewhere{extra}")
        return StoreLockedError(
            f"store {str(self.backend)!r} is being written by {_holder_text(holder)}; one writer at a time: wait "
            f"for it to finish, or write elsewhere (overwrite=True is refused while a writer holds the store){extra}"
        )

    def _open_lock_file(self, path: Any) -> tuple[int, bool]:
        """The lock file, opened (created when absent) without blocking or following a link,
        and whether this call created it; anything but a regular file in its place raises
        StoreCorruptError."""
        flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
        try:
            try:
                return os.open(path, flags | os.O_EXCL, 0o666), True
            except FileExistsError:
                fd = os.open(path, flags, 0o666)
        except (IsADirectoryError, OSError) as e:
            if not isinstance(e, IsADirectoryError) and e.errno != errno.ELOOP:
                fix = ("; the store is read-only to this process: read it with open_store(), or copy it "
                       "(activationscope.store.copy_store) to a folder you may write to and resume or overwrite the copy"
                       ) if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS) else ""
                raise StoreError(f"store {str(self.backend)!r}: cannot open the writer lock {str(path)!r}: "
                                 f"{e.strerror or e}{fix}") from e
            kind = "a directory" if isinstance(e, IsADirectoryError) else "a symbolic link"
            raise corrupt(self.backend, f"the writer lock {LOCK_KEY!r} must be a regular file, got {kind}",
                          fix=f"delete what is at {str(path)!r}") from None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            raise corrupt(self.backend, f"the writer lock {LOCK_KEY!r} must be a regular file, got another kind "
                                        "of file", fix=f"delete what is at {str(path)!r}")
        if st.st_nlink > 1:  # the writer truncates and writes it: never another name's file
            os.close(fd)
            raise corrupt(self.backend, f"the writer lock {LOCK_KEY!r} must be a file of its own, got a file with "
                                        f"{st.st_nlink} names (a hard link: another name elsewhere, maybe outside the "
                                        "store, that a writer would truncate; a store copied with `cp -al` shares "
                                        "it)", fix=f"delete {str(path)!r} (it holds no data; the writer makes a new "
                                                   "one)")
        return fd, False

    @staticmethod
    def _holder_unless_freed(fd: int) -> bytes | None:
        """After the exclusive ``flock`` of ``fd`` was refused: try it again over 200 ms, and
        return None once it is taken, else what the lock file then says of its holder. A writer
        names itself just after it locks (so it is named by then); a process asking whether a
        writer holds the store (:func:`writer_holding`) drops its shared lock at once, though
        one descheduled meanwhile (a busy machine) holds it for a few time slices."""
        import fcntl

        holder = b""
        for _ in range(40):
            time.sleep(0.005)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return None
            except BlockingIOError:
                holder = os.pread(fd, 4096, 0)
        return holder

    def _acquire_local(self) -> None:
        import fcntl

        root = self.backend.root
        if not root.exists():
            self.created_root = True  # (set first: a Ctrl-C just after mkdir leaves no folder behind)
            try:
                root.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                self.created_root = False
                if root.is_symlink():  # (a link to nothing: 'File exists' would say nothing of it)
                    raise StoreError(f"store {str(self.backend)!r}: its path is a symbolic link to "
                                     f"{os.readlink(root)!r}, which does not exist; create that folder (the store "
                                     "is written into it), or choose another store path") from e
                raise StoreError(f"store {str(self.backend)!r}: cannot create its folder: {e.strerror or e} "
                                 f"({e.filename or root}); choose a store path where this process may create "
                                 "folders") from e
        path = root / LOCK_KEY
        fd: int | None = None  # (open, not yet this lock's: closed by the handler below)
        try:
            while True:
                fd, created = self._open_lock_file(path)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    holder = self._holder_unless_freed(fd)
                    if holder is not None:
                        os.close(fd)
                        fd = None
                        raise self._locked_error(holder) from None
                try:  # the file may have been replaced between open and flock: lock the current one
                    same = os.stat(path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino
                except FileNotFoundError:
                    same = False
                if same:
                    break
                os.close(fd)
                fd = None
            self._fd, self._held, self.created_file = fd, True, created
            fd = None
            try:
                os.ftruncate(self._fd, 0)
                os.pwrite(self._fd, self._me(), 0)
            except OSError as e:  # (a full disk): released, and the target left as it was found
                self.discard_root()
                raise StoreError(
                    f"store {str(self.backend)!r}: writing its writer lock {str(path)!r} failed: {e.strerror or e}"
                    f"{no_room_hint(e)}; the store was left as it was found: try again once the cause is fixed"
                ) from e
        except BaseException:
            # interrupted partway (Ctrl-C in a notebook): no lock is kept by the traceback's frames,
            # which a notebook keeps alive, and the target is left as it was found
            if self._fd is not None:  # (fd is None, or this one)
                self.discard_root()
            elif fd is not None:
                try:  # (in a folder this lock made: the lock file it made goes, while this fd locks it)
                    if self.created_root and created:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        if os.stat(path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino:
                            path.unlink()
                except OSError:
                    pass
                finally:
                    os.close(fd)
            raise

    def _acquire_marker(self) -> None:
        b = self.backend
        for _ in range(5):
            # (the token first: a Ctrl-C once the marker is written, before this returns, finds the
            # marker this lock's, and acquire deletes it)
            _HELD_TOKENS.add(self.token)
            if b.set_if_absent(LOCK_KEY, self._me()):
                return
            _HELD_TOKENS.discard(self.token)
            raw = b.get(LOCK_KEY, max_bytes=4096)
            if raw is None:  # released by its holder since (a writer that was refused, or closed): free again
                continue
            try:
                h = json.loads(raw or b"")
            except ValueError:
                h = {}
            dropped = isinstance(h, dict) and h.get("pid") == os.getpid() and h.get("token") not in _HELD_TOKENS
            if isinstance(h, dict) and h.get("host") == socket.gethostname() and (
                    not _pid_alive(h.get("pid")) or dropped):
                b.delete(LOCK_KEY)  # left by a writer of this host that died (or was dropped unclosed): taken over
                continue
            raise self._locked_error(raw, f"; if that writer is gone, delete {str(b).rstrip('/')}/{LOCK_KEY}")
        raise self._locked_error(None)

    def lost(self) -> str | None:
        """Why this writer no longer holds the store at its path, or None while it does.

        A local store: the lock file at the store's path is not the file this writer locked
        (one ``stat`` and one ``fstat``): the store's folder was moved, removed or replaced
        since (e.g. ``rm -rf`` and another capture made a new store there), or the lock file
        deleted, which lets another writer take the store. An object store: the marker is not
        this writer's (deleted by hand while this writer was alive, and maybe taken by
        another writer). Nothing once the lock was released."""
        if not self._held or os.getpid() != self._pid:
            return None
        if self._fd is not None:
            path = self.backend.root / LOCK_KEY
            try:
                now = os.stat(path, follow_symlinks=False)
            except OSError:
                return f"its writer lock {str(path)!r} is gone"
            if now.st_ino != os.fstat(self._fd).st_ino:  # (as acquire compares them)
                return f"its writer lock {str(path)!r} is not the file this writer locked any more"
            return None
        try:
            raw = self.backend.get(LOCK_KEY, max_bytes=4096)
        except Exception as e:  # noqa: BLE001 - unreadable: not known to be ours
            return f"its writer lock marker {LOCK_KEY!r} cannot be read ({e})"
        try:
            token = json.loads(raw or b"").get("token") if raw else None
        except (ValueError, AttributeError):
            token = None
        if token != self.token:
            held = "gone" if raw is None else f"now held by {_holder_text(raw)}"
            return f"its writer lock marker {LOCK_KEY!r} is {held}"
        return None

    def release(self) -> None:
        """Give the lock back (nothing when not held, or in a process forked after it was
        taken: the lock is the taking process's, and its file description is shared)."""
        if not self._held or os.getpid() != self._pid:
            return
        try:
            self._give_back()
        except BaseException:
            # interrupted partway (Ctrl-C): given back all the same (a marker left on object storage
            # would refuse every writer of another host), then the interruption goes on
            try:
                self._give_back()
            except Exception:  # noqa: BLE001 - the error stays the one raised
                pass
            raise

    def _give_back(self) -> None:
        """:meth:`release`'s steps, each marked done as it is done: running it again after an
        interruption finishes what is left."""
        if self._fd is not None:
            import fcntl

            fd = self._fd
            try:
                os.ftruncate(fd, 0)
                fcntl.flock(fd, fcntl.LOCK_UN)
            finally:
                # (forgotten first: interrupted between the two, the descriptor leaks, where the
                # other order left a closed number to truncate, unlock and close again, by then
                # perhaps another file's)
                self._fd = None
                os.close(fd)
            self._held = False
            return
        try:
            raw = self.backend.get(LOCK_KEY, max_bytes=4096)
            if raw is not None and json.loads(raw).get("token") == self.token:
                self.backend.delete(LOCK_KEY)
        except Exception:  # noqa: BLE001 - a marker we cannot delete only blocks later writers, who are told how
            pass
        _HELD_TOKENS.discard(self.token)
        self._held = False

    def discard_root(self) -> None:
        """Release, leaving the target as it was found: the lock file goes when :meth:`acquire`
        made it (removed while still held, so no other writer can hold it), and the store
        folder when :meth:`acquire` made it and nothing else is in it."""
        if (self._held and self._fd is not None and os.getpid() == self._pid
                and (self.created_file or self.created_root)):
            try:
                (self.backend.root / LOCK_KEY).unlink()
            except OSError:
                pass
        self.release()
        if self.created_root and isinstance(self.backend, LocalBackend):
            try:
                self.backend.root.rmdir()
            except OSError:
                pass

    def __del__(self) -> None:
        try:
            if self._fd is not None:  # a writer dropped without close(): the lock goes with it
                os.close(self._fd)
                self._fd = None
            if os.getpid() == self._pid:  # (a marker: left, and taken over by this process's next writer)
                _HELD_TOKENS.discard(self.token)
        except Exception:  # noqa: BLE001
            pass

    def __enter__(self) -> "WriterLock":
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        try:
            if exc[0] is None:
                if not self._kept:  # (kept: see keep)
                    self.release()
            else:  # refused or failed: the target is left as it was found (see discard_root)
                self.discard_root()
        except BaseException:  # interrupted (Ctrl-C) before that was done: done all the same
            try:
                (self.release if exc[0] is None else self.discard_root)()
            except Exception:  # noqa: BLE001 - the error stays the one raised
                pass
            raise
