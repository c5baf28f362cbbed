"""Cold reads without root: drop a folder's files from the page cache and count what stays.

``evict(path)`` fsyncs every regular file under ``path`` (dirty pages cannot be dropped) and
then asks the kernel to drop its cached pages (``posix_fadvise(POSIX_FADV_DONTNEED)``).
The kernel keeps pages that a process still maps, so ``resident(path)`` counts the pages
that are still in memory (``mincore`` on a fresh mapping of each file): a cold measurement
is only made when that count is 0 (``evict_checked``).
"""

from __future__ import annotations

import ctypes
import mmap
import os

__all__ = ["files", "evict", "resident", "evict_checked"]

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
_libc.mincore.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value


def files(path: str) -> list[str]:
    """Every regular file under ``path`` (``path`` itself when it is a file)."""
    if os.path.isfile(path):
        return [path]
    out = []
    for root, _dirs, names in os.walk(path):
        for name in names:
            p = os.path.join(root, name)
            if os.path.isfile(p) and not os.path.islink(p):
                out.append(p)
    return sorted(out)


def evict(path: str) -> None:
    """fsync, then ``posix_fadvise(DONTNEED)`` every file under ``path``."""
    for f in files(path):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def resident(path: str) -> tuple[int, int]:
    """(pages in the page cache, pages in all) of the files under ``path`` (``mincore``)."""
    n_res = n_all = 0
    page = mmap.PAGESIZE
    for f in files(path):
        size = os.path.getsize(f)
        if size == 0:
            continue
        n = (size + page - 1) // page
        fd = os.open(f, os.O_RDONLY)
        try:
            addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if addr in (None, _MAP_FAILED):
                raise OSError(ctypes.get_errno(), f"mmap of {f} failed")
            try:
                vec = (ctypes.c_ubyte * n)()
                if _libc.mincore(addr, size, vec) != 0:
                    raise OSError(ctypes.get_errno(), f"mincore of {f} failed")
                n_res += sum(v & 1 for v in bytes(vec))
            finally:
                _libc.munmap(addr, size)
        finally:
            os.close(fd)
        n_all += n
    return n_res, n_all


def evict_checked(*paths: str) -> dict[str, tuple[int, int]]:
    """Evict every path; returns ``{path: (resident pages after, pages)}``. Raises RuntimeError
    when pages stay resident (a process still maps them, or the filesystem keeps them:
    tmpfs), since a "cold" read of them would not be cold."""
    out = {}
    for p in paths:
        evict(p)
        out[p] = resident(p)
        if out[p][0]:
            raise RuntimeError(
                f"{out[p][0]} of {out[p][1]} pages of {p} stay in the page cache after posix_fadvise(DONTNEED) "
                "(still mapped by a process, or a memory filesystem such as tmpfs): a cold read cannot be measured"
            )
    return out
