"""Multi-rank capture (``torchrun``): every rank captures its share into ONE store.

Made by :class:`activationscope.ActivationScope` when ``torch.distributed`` is initialised
with more than one rank (or ``process_group=`` is given) and ``store=`` is a path. In the
style of ``torch.distributed.checkpoint``:

1. attach: rank 0 prepares the root (or checks it on resume); every rank then writes into
   its own rank store ``<store>/ranks/<rank>`` with the ordinary store writer (its own
   commits, resume, crash safety). Nothing on the capture path touches a collective.
2. finish: every rank closes its rank store (with its reductions' float64 states) and the
   ranks exchange a summary or their exception (``all_gather_object``); if every rank
   succeeded, rank 0 commits once (:func:`activationscope.store.ranks.commit_ranks`, root
   metadata last) and tells the others the outcome. A failure on any rank means no global
   commit: every rank raises, the rank stores stay, and rerunning with ``resume=True``
   continues each rank (``activationscope consolidate STORE`` commits complete rank stores
   without a process group).
"""

from __future__ import annotations

import os
from typing import Any

from .errors import StoreError


class RankStore:
    """``process_group=`` for a rank without a process group (Slurm array task, Ray task).

    The capture writes rank ``rank`` of ``world_size`` into ``<store>/ranks/<rank>`` and
    commits nothing; once every rank store is complete, ``activationscope consolidate STORE``
    (or :func:`activationscope.store.ranks.commit_ranks`) commits them into one store.

    Parameters
    ----------
    rank : int
        0 .. world_size - 1.
    world_size : int
        Number of rank stores the store will hold.
    """

    def __init__(self, rank: int, world_size: int) -> None:
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {world_size!r}")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(f"rank must be an int in 0..{world_size - 1}, got {rank!r}")
        self.rank, self.world_size = rank, world_size

    def __repr__(self) -> str:
        return f"RankStore(rank={self.rank}, world_size={self.world_size})"


def detect(process_group: Any, store: Any) -> "RankSession | None":
    """The rank session of a capture, or None for a one-process capture.

    ``process_group``: None (use the default group when ``torch.distributed`` is initialised
    with more than one rank), False (never; e.g. a store per rank), or a process group.
    """
    if process_group is False or store is None:
        return None
    import torch.distributed as dist

    if isinstance(process_group, RankStore):
        return RankSession(None, process_group.rank, process_group.world_size, _local_root(store), standalone=True)
    if process_group is None:
        if not (dist.is_available() and dist.is_initialized()):
            return None
        group = None
    else:
        group = process_group
    world = dist.get_world_size(group)
    if world <= 1 and process_group is None:
        return None
    return RankSession(group, dist.get_rank(group), world, _local_root(store))


def _local_root(store: Any) -> str:
    path = os.fspath(store) if isinstance(store, (str, os.PathLike)) else None
    if path is not None and path.startswith("file://"):
        path = path[len("file://"):]
    if path is None:
        raise StoreError(
            f"a multi-rank capture needs store= a path every rank can reach (a shared file system) or a URL "
            f"(s3://...), got {store!r}; pass process_group=False to give each rank its own store"
        )
    return path


class RankSession:
    """One rank's part of a multi-rank capture (see the module docstring)."""

    def __init__(self, group: Any, rank: int, world_size: int, root: str, standalone: bool = False) -> None:
        self.group, self.rank, self.world_size, self.root = group, rank, world_size, root
        self.standalone = standalone
        self.summary: dict | None = None
        self.storage_options: dict | None = None

    def _gather(self, obj: Any) -> list:
        import torch.distributed as dist

        out: list = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def writer_options(self, store_options: dict) -> tuple[str, dict]:
        """Prepare the root (rank 0), agree on it, and return this rank's store and options."""
        from .store import _format as F
        from .store import ranks as R

        opts = dict(store_options)
        overwrite, resume = bool(opts.pop("overwrite", False)), bool(opts.pop("resume", False))
        if opts.get("shard_bytes") is not None:
            raise ValueError("a multi-rank capture takes store_options shard_rows= (rows per shard, the same on every "
                             "rank), not shard_bytes=")
        opts.setdefault("shard_rows", F.MAX_SHARD_ROWS)
        if self.standalone:  # no process group: the first task makes the root, nobody clears it
            from .errors import StoreExistsError
            from .store._backend import resolve as _resolve

            so = opts.get("storage_options")
            if _resolve(self.root, storage_options=so).get("zarr.json") is None:
                try:
                    R.prepare_root(self.root, world_size=self.world_size, storage_options=so)
                except StoreExistsError:
                    pass  # another task made it first
            target = R.rank_target(self.root, self.rank)
            exists = _resolve(target, storage_options=so).get("zarr.json") is not None
            opts["resume"], opts["overwrite"] = resume and exists, overwrite and exists
            return target, opts
        error = None
        if self.rank == 0:
            try:
                R.prepare_root(self.root, world_size=self.world_size, overwrite=overwrite, resume=resume,
                               storage_options=opts.get("storage_options"))
            except Exception as e:  # noqa: BLE001 - every rank must learn it
                error = e
        seen = self._gather({"root": self.root if "://" in self.root else os.path.abspath(self.root),
                             "error": None if error is None else f"{type(error).__name__}: {error}"})
        roots = {s["root"] for s in seen}
        if len(roots) != 1:
            raise StoreError(f"the ranks of a multi-rank capture must name one store, got {sorted(roots)}; pass "
                             "process_group=False to give each rank its own store")
        if error is not None:
            raise error
        if seen[0]["error"] is not None:
            raise StoreError(f"rank 0 could not prepare the store {self.root!r}: {seen[0]['error']}")
        target = R.rank_target(self.root, self.rank)
        self.storage_options = opts.get("storage_options")
        from .store._backend import resolve

        exists = resolve(target, storage_options=opts.get("storage_options")).get("zarr.json") is not None
        opts["resume"] = resume and exists
        opts["overwrite"] = overwrite or (not resume and exists)
        return target, opts

    def _save_states(self, tracker: Any) -> None:
        """Store every reduction's state over ALL rows of this rank store.

        A resumed rank continues the state stored by the run before it (when that run
        finished) or, when it was killed before storing one, folds the committed rows it
        left back into the reduction (read from the rank store), so the merged reductions
        cover every row.
        """
        w = tracker.writer
        if tracker.scope.reductions is None:
            return
        from . import reductions as _red
        from .store.reader import Store

        old_states = ((w._state or {}).get("reduction_states") or {})
        hps = list(dict.fromkeys([*w._old_arrays, *w._arrays]))
        reader = None
        for hp in hps:
            live = tracker.reduction_objects(hp)
            n_open = w.committed_rows(hp) if hasattr(w, "committed_rows") else int(w._old_arrays.get(hp, {}).get("n_rows", 0))
            n_total = int(w._arrays[hp].last_cum) if hp in w._arrays else n_open  # rows of whole forwards
            for name, factory in _red.resolve_reductions(tracker.scope.reductions, hp):
                red = live.get(name)
                if red is None:
                    red = factory()
                if n_open > 0:
                    if reader is None:
                        reader = Store(w._backend)
                    part = red.fresh()
                    old = (old_states.get(hp) or {}).get(name)
                    if old is not None and int(old.get("n_rows", -1)) == n_open and old.get("kind") == str(red.kind):
                        part.load_state({k: reader._read_small({**e, "reduction": name}).clone()
                                         for k, e in old["state"].items()})
                    else:
                        part.update(reader._read_rows(hp, 0, n_open, copy=True))
                    red.merge(part)
                w.add_reduction_state(hp, name, red, n_rows=n_total)

    def finish(self, tracker: Any, exc: BaseException | None) -> None:
        """Close this rank's store, agree on the outcome, commit on rank 0 (see the module)."""
        from .store import ranks as R

        error = None
        if exc is None:
            try:
                tracker._write_reductions()
                self._save_states(tracker)
                tracker.writer.close(status="complete")
            except BaseException as e:  # noqa: BLE001 - the other ranks must hear of it
                error = e
                tracker.writer.abort(e)
        else:
            tracker.writer.abort(exc)
        mine = exc or error
        if self.standalone:
            if error is not None and exc is None:
                raise error
            return
        seen = self._gather(None if mine is None else f"{type(mine).__name__}: {mine}")
        failed = {r: s for r, s in enumerate(seen) if s is not None}
        outcome = None
        if not failed and self.rank == 0:
            try:
                def make(hp: str, name: str, entry: dict) -> Any:
                    return tracker.reduction_objects(hp).get(name)

                self.summary = R.commit_ranks(self.root, make_reduction=make, world_size=self.world_size,
                                              storage_options=self.storage_options)
            except BaseException as e:  # noqa: BLE001
                outcome = f"{type(e).__name__}: {e}"
        outcomes = self._gather(outcome)
        if exc is not None:
            return  # the caller's exception propagates
        if error is not None:
            raise error
        if failed:
            raise StoreError(
                f"multi-rank capture into {self.root!r}: rank(s) {sorted(failed)} failed ({'; '.join(failed.values())}); "
                "nothing was committed. Every rank's committed rows are kept in its rank store: rerun with "
                "store_options resume=True to continue, or run `activationscope consolidate` once every rank store "
                "is complete"
            )
        if outcomes[0] is not None:
            raise StoreError(f"rank 0 could not commit the multi-rank store {self.root!r}: {outcomes[0]}; the rank "
                             "stores are kept: run `activationscope consolidate STORE` to finish the commit")
