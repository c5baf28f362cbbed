"""Modes measured side by side in one process, round-robin: ratios free of process luck.

Two processes running the same forward can differ by 10–25 % on this kind of machine (the
transformer's plain forward measured 129 ms per forward in one child and 144 ms in another
of the same run, and peers in their own children measured "faster than the plain forward").
A ratio of two modes each timed in its own child carries that luck. The modes here run, in
every round, one repeat of each of their parts, in a rotating order, in the same process,
with the same model memory, page cache and neighbours on the machine; a goal is the median
over rounds of the ratio *within* a round.

- ``store_floor_interleaved`` (toy): ``scope_store``, ``plain``, ``raw_write`` (the store's
  durability) and ``write_beside`` (the plain forward while a second thread writes the same
  bytes the store writes): the disk floor in the store's conditions (``store_vs_floor_*``),
  and what writing beside the forward costs on this machine (``*_write_beside_*``).
- ``side_by_side`` (toy, minilm, transformer, transformer_all): the modes that the ratio
  goals compare (:data:`SIDE_BY_SIDE`). A peer whose package is missing is left out (named
  in ``skipped_parts``); anything else that fails is an error of the run.

Every part is the same mode class as its own child mode (same setup, same work per repeat).
"""

from __future__ import annotations

import gc
import statistics
import time
from typing import Any

from .capture import Plain, RawWrite, ScopeStore, WriteBeside
from .registry import MODES, MissingOptional, register_mode
from .workloads import Workload

#: The parts of ``side_by_side`` per workload: the baseline first, then ours, then the modes
#: our goals are compared with.
SIDE_BY_SIDE: dict[str, tuple[str, ...]] = {
    "toy": ("plain", "scope_snapshot", "scope_reference", "scope_reductions", "naive_clone", "keep_floor",
            "copy_floor"),
    "minilm": ("plain", "scope_store"),
    "transformer": ("plain", "scope_store", "tl_cache_torch_save", "saelens_runner"),
    "transformer_all": ("plain", "scope_store", "tl_cache_torch_save"),
}


class Interleaved:
    """Round-robin repeats of several modes (``parts``: name -> mode object).

    ``run(i)`` runs each part once, order rotated by ``i``; the round's time (what the runner
    records as the mode's repeat) is the first part's. ``summary()`` gives every part's
    times and, for every ordered pair of parts, the median over rounds of their ratio in
    the same round (``ratio_median["a/b"]``).
    """

    def __init__(self, wl: Workload, ctx: dict[str, Any], parts: dict[str, Any] | None = None) -> None:
        self.wl, self.ctx = wl, ctx
        self.parts = parts if parts is not None else {
            "scope_store": ScopeStore(wl, ctx, None),
            "plain": Plain(wl, ctx),
            "raw_write": RawWrite(wl, ctx, fsync=ctx.get("durability") == "fsync"),
            "write_beside": WriteBeside(wl, ctx),
        }
        self.skipped: dict[str, str] = {}
        self.times: dict[str, list[float]] = {}
        self.info: dict[str, Any] = {}
        self.part_info: dict[str, dict[str, Any]] = {}

    def setup(self) -> None:
        for name, m in list(self.parts.items()):
            try:
                m.setup()
            except MissingOptional as e:  # a peer that is not installed: left out, said so
                self.skipped[name] = str(e)
                del self.parts[name]
        if not self.parts:
            raise MissingOptional("; ".join(self.skipped.values()))
        self.times = {k: [] for k in self.parts}
        # warm every part once (untimed): imports, first touch, the store's staging pool
        for m in self.parts.values():
            m.run(0)
            m.reset()
        gc.collect()

    def run(self, i: int) -> None:
        """One round: each part once, order rotated by ``i``."""
        names = list(self.parts)
        k = i % len(names)
        first = names[0]
        for name in names[k:] + names[:k]:
            m = self.parts[name]
            gc.collect()
            t0 = time.perf_counter()
            m.run(i)
            self.times[name].append(time.perf_counter() - t0)
            if name == first and not self.info:
                self.info = m.describe()
            if name not in self.part_info:  # what each part captured / stored, once
                self.part_info[name] = m.describe()
            m.reset()

    def describe(self) -> dict[str, Any]:
        return dict(self.info)

    def reset(self) -> None:
        pass

    def _rounds(self) -> tuple[dict[str, list[float]], int]:
        # round 0 is the timed_repeats cold round: left out of the ratios
        t = {k: v[1:] or v for k, v in self.times.items()}
        return t, min(len(v) for v in t.values())

    def summary(self) -> dict[str, Any]:
        t, n = self._rounds()
        names = list(t)
        out: dict[str, Any] = {
            "rounds": n,
            "parts": names,
            "part_median_s": {k: statistics.median(v) for k, v in t.items()},
            "part_repeat_s": t,
            "ratio_median": {f"{a}/{b}": statistics.median(t[a][r] / t[b][r] for r in range(n))
                             for a in names for b in names if a != b},
            "part_info": {k: v for k, v in self.part_info.items() if v},
        }
        if self.skipped:
            out["skipped_parts"] = dict(self.skipped)
        if {"scope_store", "plain", "raw_write"} <= set(t):
            ratios = [t["scope_store"][r] / max(t["plain"][r], t["raw_write"][r]) for r in range(n)]
            out.update(
                store_vs_floor_per_round=ratios,
                store_vs_floor_median=statistics.median(ratios),
                store_vs_plain_median=out["ratio_median"]["scope_store/plain"],
                raw_write_vs_plain_median=out["ratio_median"]["raw_write/plain"],
            )
        if {"scope_store", "plain", "write_beside"} <= set(t):
            out.update(
                store_vs_write_beside_median=out["ratio_median"]["scope_store/write_beside"],
                write_beside_vs_plain_median=out["ratio_median"]["write_beside/plain"],
            )
        return out


register_mode("store_floor_interleaved", workloads=("toy",), repeats=9, budget_s=600.0,
              doc="plain, raw_write (the store's durability), write_beside and scope_store round-robin in one "
              "process, rotating order, 9 rounds after a warm one: the disk floor in the store's conditions; the "
              "goal is the median over rounds of scope_store / max(plain, raw_write) of the same round")(Interleaved)


def side_by_side(wl: Workload, ctx: dict[str, Any]) -> Interleaved:
    """The ratio goals' modes of ``wl`` (:data:`SIDE_BY_SIDE`) interleaved in one process."""
    return Interleaved(wl, ctx, {name: MODES[name].factory(wl, ctx) for name in SIDE_BY_SIDE[wl.name]})


register_mode("side_by_side", workloads=tuple(SIDE_BY_SIDE), repeats=9, budget_s=600.0,
              quick=("toy", "minilm", "transformer"),
              doc="the modes each ratio goal compares (toy: plain, SNAPSHOT, REFERENCE, reductions, naive hooks, and the "
              "floors of holding the tensors without hooks, keep_floor and copy_floor; "
              "minilm: plain, store; transformer: plain, store, TransformerLens + torch.save, SAELens runner) "
              "round-robin in one process, rotating order, 9 rounds after a warm one; each goal is the median over "
              "rounds of the ratio within a round")(side_by_side)


def side_by_side_text(rec: dict[str, Any] | None, code: str = "") -> str:
    """One line for a ``side_by_side`` record: each part's ms per forward and its ratio to
    ``plain`` (medians over rounds); ``""`` when the record is missing or not ok.
    ``code`` wraps mode names (``"`"`` in Markdown)."""
    if not rec or rec.get("status") != "ok":
        return ""
    ex, n = rec.get("extra") or {}, rec.get("n_forwards") or 1
    pm, rm = ex.get("part_median_s") or {}, ex.get("ratio_median") or {}
    bits = []
    for name in ex.get("parts") or pm:
        s = f"{code}{name}{code} {pm[name] * 1e3 / n:.2f} ms"
        if name != "plain" and f"{name}/plain" in rm:
            s += f" ({rm[f'{name}/plain']:.2f}x plain)"
        bits.append(s)
    line = f"side by side in one process, median of {ex.get('rounds')} rounds, per forward: " + ", ".join(bits)
    if ex.get("skipped_parts"):
        line += "; left out (not installed): " + ", ".join(f"{code}{k}{code}" for k in ex["skipped_parts"])
    return line
