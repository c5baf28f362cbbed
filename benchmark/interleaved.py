"""Modes measured side by side in one process, round-robin: a floor in the store's conditions.

``store_floor_interleaved`` (toy) runs, in every round, one repeat each of ``plain``,
``raw_write`` (the store's durability) and ``scope_store``, in a rotating order, in the same
process, with the same page cache and the same neighbours on the machine. The goal is the
median over rounds of ``scope_store / max(plain, raw_write)`` of the *same* round: slow
phases of a shared machine hit all three alike instead of one mode's whole child.
"""

from __future__ import annotations

import gc
import statistics
import time
from typing import Any

from .capture import Plain, RawWrite, ScopeStore
from .registry import register_mode
from .workloads import Workload


class Interleaved:
    """Round-robin repeats of several modes; ``median_s`` is the first mode's (``scope_store``)."""

    def __init__(self, wl: Workload, ctx: dict[str, Any], rounds: int | None = None) -> None:
        self.wl, self.ctx = wl, ctx
        self.parts = {
            "scope_store": ScopeStore(wl, ctx, None),
            "plain": Plain(wl, ctx),
            "raw_write": RawWrite(wl, ctx, fsync=ctx.get("durability") == "fsync"),
        }
        self.times: dict[str, list[float]] = {k: [] for k in self.parts}
        self.info: dict[str, Any] = {}

    def setup(self) -> None:
        for m in self.parts.values():
            m.setup()
        # warm every part once (untimed): imports, first touch, the store's staging pool
        for m in self.parts.values():
            m.run(0)
            m.reset()
        gc.collect()

    def run(self, i: int) -> None:
        """One round: each part once, order rotated by ``i``; the round's time is the store's."""
        names = list(self.parts)
        k = i % len(names)
        for name in names[k:] + names[:k]:
            m = self.parts[name]
            gc.collect()
            t0 = time.perf_counter()
            m.run(i)
            self.times[name].append(time.perf_counter() - t0)
            if name == "scope_store" and not self.info:
                self.info = m.describe()
            m.reset()

    def describe(self) -> dict[str, Any]:
        return dict(self.info)

    def reset(self) -> None:
        pass

    def summary(self) -> dict[str, Any]:
        # round 0 is the timed_repeats cold round: left out of the ratios
        t = {k: v[1:] or v for k, v in self.times.items()}
        n = min(len(v) for v in t.values())
        ratios = [t["scope_store"][r] / max(t["plain"][r], t["raw_write"][r]) for r in range(n)]
        vs_plain = [t["scope_store"][r] / t["plain"][r] for r in range(n)]
        return {
            "rounds": n,
            "part_median_s": {k: statistics.median(v) for k, v in t.items()},
            "part_repeat_s": t,
            "store_vs_floor_per_round": ratios,
            "store_vs_floor_median": statistics.median(ratios),
            "store_vs_plain_median": statistics.median(vs_plain),
            "raw_write_vs_plain_median": statistics.median(t["raw_write"][r] / t["plain"][r] for r in range(n)),
        }


register_mode("store_floor_interleaved", workloads=("toy",), repeats=7, budget_s=600.0,
              doc="plain, raw_write (the store's durability) and scope_store round-robin in one process, "
              "rotating order, 7 rounds after a warm one: the disk floor in the store's conditions; the goal "
              "is the median over rounds of scope_store / max(plain, raw_write) of the same round")(Interleaved)
