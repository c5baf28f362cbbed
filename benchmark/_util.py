"""Small helpers shared by the runner and the per-mode child processes."""

from __future__ import annotations

import gc
import os
import resource
import shutil
import statistics
import time
from collections.abc import Callable
from typing import Any


def rss_bytes() -> int:
    """Current resident set size of this process, in bytes (from /proc/self/statm)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # not Linux
        return 0


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far, in bytes (``getrusage`` ``ru_maxrss``)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def reset_peak_rss() -> bool:
    """Reset this process's peak RSS to its current RSS (Linux ``clear_refs`` 5); True if done."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def remove(path: str) -> None:
    """Delete a file or a directory tree if it exists."""
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.exists(path):
        os.unlink(path)


def timed_repeats(
    run: Callable[[int], Any],
    reset: Callable[[], None],
    repeats: int,
    budget_s: float,
    describe: Callable[[], Any] | None = None,
) -> tuple[float, list[float], Any]:
    """Run ``run(i)`` once cold, then up to ``repeats`` timed repeats.

    The first (cold) repeat doubles as the warm-up. Timed repeats stop early once their
    total exceeds ``budget_s`` (at least one timed repeat always runs). ``reset()`` runs
    between repeats, untimed, after a ``gc.collect()``.

    Returns
    -------
    cold_s : float
        Seconds of the first repeat.
    repeat_s : list of float
        Seconds of each timed repeat.
    first_info : Any
        What ``describe()`` returned right after the first repeat, untimed (bytes
        captured, ...); None without ``describe``.
    """
    gc.collect()
    t0 = time.perf_counter()
    run(0)
    cold_s = time.perf_counter() - t0
    first_info = describe() if describe is not None else None
    out: list[float] = []
    if repeats <= 0:  # a one-off (building a store): the cold run is the only one
        return cold_s, out, first_info
    spent = 0.0
    i = 1
    while len(out) < repeats and (not out or spent < budget_s):
        reset()
        gc.collect()
        t0 = time.perf_counter()
        run(i)
        dt = time.perf_counter() - t0
        out.append(dt)
        spent += dt
        i += 1
    reset()
    return cold_s, out, first_info


def median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None




def write_json(path: str | None, doc: Any) -> None:
    """Write a benchmark's JSON document to ``path`` (nothing when None) and say so."""
    if path:
        import json

        with open(path, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"wrote {path}")
