"""Sizes in bytes: how much a folder holds, and how every report prints it.

One unit system everywhere (command line, demo, report, benchmark, README): binary units,
KiB = 1024 B, MiB = 1024 KiB, ..., as the store's own defaults (256 KiB chunks, 64 MiB
shards) are written.
"""

from __future__ import annotations

import os
from typing import Any

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def format_bytes(n: Any) -> str:
    """``n`` bytes in binary units with one decimal: ``"512 B"``, ``"8.6 MiB"``, ``"1.5 GiB"``.

    Parameters
    ----------
    n : int or float or None
        A byte count; anything that is not a number (None: unknown) prints as ``"-"``.
    """
    if isinstance(n, bool) or not isinstance(n, (int, float)):
        return "-"
    value = float(n)
    for unit in _UNITS:
        if abs(value) < 1024 or unit == _UNITS[-1]:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def dir_bytes(path: str | os.PathLike) -> int:
    """Bytes of the regular files under ``path`` (a path or a ``file://`` URL; a file: its size;
    0 for a path that does not exist or a remote URL). Files removed while walking are skipped."""
    path = os.fspath(path)
    if path.startswith("file://"):  # the local path it names, as the store backends read it
        path = path[len("file://"):]
    if "://" in path:
        return 0
    if os.path.isfile(path):
        return os.path.getsize(path)
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(root, name))
            except OSError:
                pass
    return total
