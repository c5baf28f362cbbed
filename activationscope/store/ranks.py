"""Many writers, one store: rank stores and their commit into one store (format v2).

In the style of ``torch.distributed.checkpoint``: every rank (or Slurm array task, Ray task)
writes its rows into its own namespace ``ranks/<rank>`` of the store with the ordinary
:class:`~activationscope.store.StoreWriter` and its commits; then ONE committer
(:func:`commit_ranks`: rank 0 of a ``torchrun`` capture, or ``activationscope consolidate``)
builds the store from the complete rank stores, the root ``zarr.json`` last. Nothing goes
through a collective while capturing.

Row order (``store/FORMAT.md`` §10): every array of a row kind has the same ``shard_rows``
``S`` on every rank. Rank ``r`` with ``n_r`` rows has ``f_r = n_r // S`` full shards and a
tail of ``n_r - f_r * S`` rows. The store holds the full shards of rank 0, then those of rank
1, ... (the shard files themselves, linked, never rewritten), then the tails of rank 0, 1, ...
re-chunked into new shards (at most one shard of rows copied per rank per array). The row
tables follow the same order, with a ``rank`` column, so row *i* of every array that follows
its table is still row *i* of the table.
"""

from __future__ import annotations

import atexit
import contextlib
import inspect
import io
import itertools
import json
import math
import os
import shutil
import sys
import threading
import time
import types
import uuid
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from ..capture import _native
from ..errors import (ArgumentTypeError, ArgumentValueError, CaptureError, CaptureWarning, StoreCorruptError, StoreError,
                      StoreExistsError, StoreLockedError, warn_at_caller)
from . import _format as F
from . import _validate as V
from ._backend import (LocalBackend, _foreign_names, check_backend_not_in_store, rank_stores_allowed,
                       refuse_foreign_entries, resolve, write_root_first)
from ._lock import WriterLock, refuse_rank_writers, writer_holding
from ._staging import make_staging_folder, remove_staging_folder
from .reader import (Store, _no_rank_column, _sub_backend, capture_again_run_id, check_rank_column_types,
                     listed_rank_stores, rank_store_run_id, ranks_run_id, split_rank_stores_by_run)
from .reader import other_feature_shape
from .reader import recorded_world_size as _recorded_world_size
from .writer import (ROW_KINDS, _AsideDelete, _builtin_state_fits, _library_versions, _write_small_array,
                     resume_history)

RANKS_DIR = "ranks"
#: Version of stores committed from rank stores (one-process stores stay version 1).
DISTRIBUTED_FORMAT_VERSION = 2


def rank_target(target: Any, rank: int) -> str:
    """Where rank ``rank`` writes: ``<store>/ranks/<rank, 5 digits>`` (a path or URL)."""
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise ArgumentValueError(f"rank must be a non-negative int, got {rank!r}")
    if isinstance(target, os.PathLike):
        target = os.fspath(target)
    if not isinstance(target, str):
        raise ArgumentTypeError(f"a multi-rank store must be a local path or a URL, got {type(target).__name__}")
    return f"{target.rstrip('/')}/{RANKS_DIR}/{rank:05d}"


def _root_doc(attrs: dict) -> bytes:
    return F.dumps(F.group_document({F.ATTRS_KEY: attrs}))


def prepare_root(target: Any, *, world_size: int, overwrite: bool = False, resume: bool = False,
                 storage_options: dict | None = None) -> str | None:
    """Make (or check) the root of a multi-rank store before the ranks write (rank 0 only).

    Writes a root ``zarr.json`` with status ``incomplete``, no arrays, and
    ``distributed = {"world_size", "committed": false, "run_id"}``, so the store opens (as
    incomplete) while the ranks write. With ``overwrite``, that root is written over the old
    one first, and the old store's objects are deleted after it; a resume removes rank stores
    of another run (FORMAT.md section 10). (A multi-rank capture's rank 0 instead moves a
    local old store aside and deletes it only once the ranks' commit is written, putting it
    back when nothing is committed.)

    Returns
    -------
    str or None
        The run the rank stores must record (``rank_store.run_id``): the root's
        ``distributed.run_id``, None for a resumed root written before it was recorded.

    Raises
    ------
    StoreExistsError
        Something is at ``target`` and neither ``overwrite`` nor ``resume`` is set; with
        ``overwrite``, a non-empty folder (prefix) that holds no store, or a store whose folder
        also holds entries that are not the store's (they would be deleted with it): nothing
        is changed.
    StoreError
        ``resume`` of a store captured with another world size, or of a store whose ranks
        were already committed.
    """
    return _prepare(target, world_size, overwrite, resume, storage_options, None)


def _prepare(target: Any, world_size: int, overwrite: bool, resume: bool, storage_options: dict | None,
             aside: list | None, held: list | None = None) -> str | None:
    """:func:`prepare_root`; with ``aside`` (a list: the capture's rank 0), a local overwrite
    moves the old store aside instead of deleting it and appends that folder to ``aside``
    (the capture settles it: :meth:`RankSession.settle_aside`; a preparation that fails after
    the move puts it back itself, under the writer lock). With ``held`` (a list: the
    capture's rank 0), a local store's writer lock is kept once the root is prepared and
    appended to ``held``: rank 0 holds it until its commit is done (FORMAT.md section 10), so
    no other writer, resume, overwrite or ``consolidate`` takes the store meanwhile."""
    b = resolve(target, storage_options=storage_options)
    check_backend_not_in_store(b)
    existed = True
    if isinstance(b, LocalBackend):
        existed = b.root.is_dir()  # (a folder that was not there holds nothing to take over)
        b.root.mkdir(parents=True, exist_ok=True)
    keep = held is not None and isinstance(b, LocalBackend)  # (a flock: it dies with rank 0's process)
    lock = WriterLock(b, role=f"rank 0 of a multi-rank capture of {int(world_size)} ranks" if keep else None)
    with lock:  # the store's writer lock, as every writer takes it
        n_aside = len(aside) if aside is not None else 0
        try:
            run = _prepare_root(b, world_size, overwrite, resume, aside, adopt=existed)
        except BaseException as e:
            if aside is not None and len(aside) > n_aside:
                # the old store was moved aside (or taken back) before the failure: put back under this
                # lock, as one process does, never once it is released; and once only (a second try
                # would clear the entries the first one moved back)
                moved = aside.pop()
                try:
                    b.restore_aside(moved)
                except Exception as f:  # noqa: BLE001 - the error stays the one raised
                    e.add_note(_put_back_failed(moved, str(b), f))
            raise
        if keep:
            held.append(lock.keep())  # (kept past the with block: released by the capture's end)
        return run


def _put_back_failed(aside: Path, root: str, e: BaseException) -> str:
    """The sentence of a put-back of the old store of a local multi-rank overwrite
    (``LocalBackend.restore_aside`` from ``aside`` into ``root``) that raised ``e``: it may have
    failed after moving some entries back, so the old store is in the folder with its root
    document, whole or for the part not put back, and an overwrite finishes the move."""
    return (f"putting the store that overwrite=True was to replace back from {str(aside)!r} failed "
            f"({type(e).__name__}: {e}); that folder still holds it with its root document (all of it, or what was "
            "not put back yet): run the capture again with overwrite=True (it finishes the move), or, with no writer "
            f"running, move every entry of that folder back into {root!r} (zarr.json last)")


def _uncommitted_root_attrs(world_size: int, run_id: str | None, created: str, ranks_run: str | None) -> dict:
    """The attributes of the root of a multi-rank store whose ranks write (FORMAT.md section 10):
    a run's first root (:func:`F.first_root_attrs`: status ``incomplete``, no arrays; no
    ``run_id`` when ``run_id`` is None) with ``distributed = {"world_size", "committed": false,
    "run_id": ranks_run}`` (no ``run_id`` there when ``ranks_run`` is None)."""
    attrs = F.first_root_attrs(run_id, created, version=DISTRIBUTED_FORMAT_VERSION)
    attrs["distributed"] = {"world_size": int(world_size), "committed": False}
    if ranks_run is not None:
        attrs["distributed"]["run_id"] = ranks_run
    return attrs


def _root_committed(root: str, storage_options: dict | None) -> bool:
    """Whether the root of the multi-rank store ``root`` records its ranks' commit
    (``distributed.committed`` true: the commit wrote it, whatever failed after)."""
    try:
        b = resolve(root, storage_options=storage_options)
        dist = json.loads(b.get("zarr.json"))["attributes"][F.ATTRS_KEY]["distributed"]
        return isinstance(dist, dict) and dist.get("committed") is True
    except Exception:  # noqa: BLE001 - unreadable: not known to be committed
        return False


def _root_ranks_run(b: Any) -> str | None:
    """The ``distributed.run_id`` of the root of ``b`` while uncommitted, else None."""
    try:
        dist = json.loads(b.get("zarr.json"))["attributes"][F.ATTRS_KEY]["distributed"]
    except (TypeError, KeyError, ValueError, RecursionError):
        return None
    return None if not isinstance(dist, dict) or dist.get("committed") is not False else ranks_run_id(dist)


def _adopt_aside(b: LocalBackend) -> Path | None:
    """A local multi-rank overwrite (under the writer lock): what an earlier overwrite killed
    before it settled the old store left, taken over as a one-process writer does
    (``StoreWriter._open_existing``): an unstarted store at the path (a one-process run that
    committed no forward, or an uncommitted multi-rank root with its rank stores) whose old
    store is whole in the one folder aside goes, and a move cut short is finished. Returns the
    folder that now holds the whole old store (settled as this overwrite's own), or None."""
    b.drop_empty_aside_folders()
    raw = b.get("zarr.json", max_bytes=V.MAX_JSON_BYTES)
    if raw is not None and b.moved_roots():
        try:
            attrs = V.parse_root(raw, store=b)
        except StoreError:
            attrs = None  # (a damaged root: moved aside as any other store)
        if attrs is not None:
            refuse_foreign_entries(b)  # (a file of the user's beside it is never removed)
            b.drop_unstarted_store(attrs)
    return b.finish_move_aside()  # (refuses, changing nothing, what it cannot tell apart)


def _prepare_root(b: Any, world_size: int, overwrite: bool, resume: bool, aside: list | None = None,
                  adopt: bool = True) -> str | None:
    # a local overwrite of the capture moves the old store aside (FORMAT.md section 7), as one process
    local_aside = aside is not None and overwrite and isinstance(b, LocalBackend)
    if overwrite or resume:  # (rank stores a live process writes: never taken over)
        refuse_rank_writers(b, "overwrite=True" if overwrite else "resume=True")
    adopted = _adopt_aside(b) if local_aside and adopt else None
    raw = b.get("zarr.json")
    kept: dict | None = None  # the root a resume continues: its run (run_id, created) stays
    replacing = False  # overwrite: the old objects go once the new root is written
    if raw is not None:
        try:
            attrs = (json.loads(raw).get("attributes") or {}).get(F.ATTRS_KEY)
            if attrs is not None and (not isinstance(attrs, dict)
                                      or not isinstance(attrs.get("distributed") or {}, dict)):
                raise TypeError(attrs)
        except (ValueError, AttributeError, TypeError, RecursionError):
            if not overwrite:
                raise StoreCorruptError(
                    f"the root document zarr.json of {str(b)!r} is not a JSON object with an {F.ATTRS_KEY!r} object "
                    "in its attributes; nothing was changed. Pass overwrite=True to replace the store, or run "
                    "verify on it") from None
            attrs = None
        if overwrite:
            # (entries of the user's in the store's folder would go with the old store: refused,
            # as a one-process overwrite does)
            refuse_foreign_entries(b)
            replacing = True
        elif resume and attrs is not None:
            dist = attrs.get("distributed") or {}
            if dist.get("committed"):
                left = sorted({k.split("/")[1] for k in b.list(f"{RANKS_DIR}/")
                               if k.count("/") >= 2 and k.split("/")[1].isdigit() and len(k.split("/")[1]) == 5})
                if left:  # (a commit stopped after its root: a restart of its ranks finds it so)
                    raise StoreError(
                        f"the multi-rank store {str(b)!r} is already committed (it holds every rank's rows); its "
                        f"commit stopped before it removed the rank stores {left} under {_ranks_dir(b)!r}; there is "
                        f"nothing to resume: run {_consolidate_call(str(b))} to remove them (the store reads as "
                        "committed meanwhile), or pass overwrite=True to capture it again; nothing was changed")
                raise StoreError(f"the multi-rank store {str(b)!r} is already committed; there is nothing to resume "
                                 "(pass overwrite=True to capture it again)")
            if dist.get("world_size") not in (None, world_size):
                raise StoreError(f"{str(b)!r} was captured by {dist.get('world_size')} ranks, this run has "
                                 f"{world_size}; resume with the same number of ranks or overwrite=True")
            kept = attrs
            left = b.moved_roots() if isinstance(b, LocalBackend) else []
            if left:  # (an overwrite killed before its ranks' commit: as a one-process resume, named and kept)
                warn_at_caller(
                    f"store {str(b)!r}: {str(left[0])!r}{f' (and {len(left) - 1} more)' if len(left) > 1 else ''} "
                    "holds a store that an earlier overwrite=True moved aside and never settled (its writer was killed "
                    "before the new store there committed); it is not this store. To keep it, move its entries back "
                    f"into {str(b)!r} (by hand, with no writer running); else delete it", RuntimeWarning)
        else:
            status = (attrs or {}).get("status", "not an activationscope store")
            raise StoreExistsError(f"a store already exists at {str(b)!r} (status {status!r}); pass overwrite=True to "
                                   "replace it or resume=True to continue it")
    elif adopted is None and (moved := b.moved_aside_hint() if isinstance(b, LocalBackend) else ""):
        # (a one-process overwrite killed partway: its folder aside holds the old root; the path
        # holds the rest of the old store, or nothing)
        raise StoreExistsError(f"{str(b)!r} holds no root document (zarr.json): {moved}; then run this capture "
                               "again; nothing was changed")
    elif not b.is_empty():
        # not a store: never cleared, also with overwrite=True (as a one-process overwrite)
        raise StoreExistsError(f"{str(b)!r} exists and is not empty but holds no Zarr store; choose another path "
                               "or remove it (overwrite=True only replaces stores)")
    # FORMAT.md section 2: a new store (or an overwrite) is a new run with a run_id of its own; a
    # resume keeps the run it continues (its run_id, or none as written before run ids, and its
    # created), so readers opened before it read on rather than see another run in its place
    run_id, created = uuid.uuid4().hex, F.utc_now()
    if kept is not None:
        run_id = kept.get("run_id") if isinstance(kept.get("run_id"), str) else None
        created = kept["created"] if isinstance(kept.get("created"), str) else created
    # FORMAT.md section 10: the root names the run whose rank stores it shows (a resume of a root
    # written before that keeps showing every rank store, as it did)
    ranks_run = ranks_run_id((kept or {}).get("distributed")) if kept is not None else run_id
    attrs = _uncommitted_root_attrs(world_size, run_id, created, ranks_run)
    if local_aside:
        # the old store (every entry, root first, one rename each) goes aside until the ranks'
        # commit: deleted then, put back whole if nothing is committed
        moved = adopted if adopted is not None else b.move_aside() if replacing else None
        if moved is not None:
            aside.append(moved)
        replacing = False
    # the new run's root first, over the old one: from here on no object of the old run is read as
    # this store's (its arrays are not listed, its rank stores record another run), whatever is left
    # of them when the process dies; then they go
    write_root_first(b, attrs, replacing=replacing)
    if kept is not None and ranks_run is not None:  # (a resume: its root was kept, nothing is replaced)
        _remove_other_runs(b, ranks_run)
    return ranks_run


def _capture_again(b: Any, root: str, rank: int, world_size: int, overwrite: bool, resume: bool) -> str | None:
    """A rank task (``RankStore(rank, world_size)``) under a root that is not the uncommitted root
    of a capture it can join: a complete store (committed from rank stores, or written by one
    process), or an uncommitted multi-rank root of another world size. Returns the run its rank
    store records (:func:`capture_again_run_id`: a new run, which ``consolidate`` commits over the
    store once all its ranks are complete, FORMAT.md section 10), or None for any other root (the
    task joins the capture the root names, as before). Nothing is written here: the store reads as
    it is until that commit.

    Raises
    ------
    StoreExistsError
        A complete store and neither ``overwrite`` nor ``resume``.
    StoreError
        An uncommitted root of another world size and neither; ``resume`` when no task has
        captured the store again yet (nothing to resume); rank stores that a commit of the store
        left behind (``consolidate`` finishes that commit first).
    """
    raw = b.get("zarr.json", max_bytes=V.MAX_JSON_BYTES)
    try:
        attrs = json.loads(raw)["attributes"][F.ATTRS_KEY]
    except (TypeError, KeyError, ValueError, RecursionError):
        return None  # no root, or not ours: as before (the writer or consolidate names it)
    if not isinstance(attrs, dict):
        return None
    dist = attrs.get("distributed")
    n = dist.get("world_size") if isinstance(dist, dict) else None
    committed = isinstance(dist, dict) and dist.get("committed") is True
    one_process = dist is None and attrs.get("status") == "complete"
    other_world = (isinstance(dist, dict) and not committed and isinstance(n, int) and not isinstance(n, bool)
                   and n != world_size)
    run = capture_again_run_id(attrs, raw)
    if not (committed or one_process or other_world):
        _refuse_stale_attempt(b, root, rank, world_size, run)
        return None
    runs = _rank_runs(b, listed_rank_stores(b))
    left = [r for r, x in runs.items() if committed and x is not None and x != run]
    if left:  # what a commit killed before it removed its rank stores left (consolidate removes them)
        raise StoreError(
            f"store path {rank_target(root, rank)!r}: under {_ranks_dir(b)!r}, {[f'{r:05d}' for r in left]} is each a "
            f"rank store left over from the commit of {root!r}, which already holds every rank's rows: run "
            f"{_consolidate_call(root)} to finish that commit (it removes the rank stores), then run the task "
            "again; nothing was written")
    if overwrite or resume:
        _refuse_stale_attempt(b, root, rank, world_size, run, runs)
    if overwrite:
        return run
    if committed or one_process:
        what = (f"committed from {n} rank stores" if committed else "written by one process")
        state = f"a complete store ({what}) is at {root!r}"
    else:
        state = (f"the store {root!r} is being captured by {n} ranks (distributed.world_size of its root, not "
                 f"committed yet), this task is RankStore({rank}, {world_size})")
    again = (f"to capture it again{'' if committed or one_process else f' with {world_size} ranks'}, pass "
             "overwrite=True on every task: each task then writes its rank store as a new run, and the store reads as "
             f"it is until {_consolidate_call(root)} replaces it with that run")
    if resume:
        if run in runs.values():
            # a capture again: this task resumes (or starts) its rank store of it, with the world size
            # its rank stores record (another one would split the data into other parts)
            n_run = _recorded_world_size(b, [r for r, x in runs.items() if x == run])
            if n_run is not None and n_run != world_size:
                raise StoreError(
                    f"store path {rank_target(root, rank)!r}: the capture again of {root!r} (run {run!r}) is by "
                    f"{n_run} ranks (rank_store.world_size in the zarr.json of its rank stores under "
                    f"{_ranks_dir(b)!r}), this task is RankStore({rank}, {world_size}); nothing was written. Pass "
                    f"RankStore(rank, {n_run}) to resume that capture; or, to capture it again with {world_size} "
                    "ranks, pass overwrite=True on every task")
            return run
        raise StoreError(f"{state}, and no task has captured it again (no rank store of run {run!r} under "
                         f"{_ranks_dir(b)!r}): there is nothing to resume; nothing was written. "
                         f"{again[0].upper()}{again[1:]}")
    if committed or one_process:
        raise StoreExistsError(f"{state}; nothing was written. {again[0].upper()}{again[1:]}; or choose another "
                               "path")
    raise StoreError(f"{state}; nothing was written. Pass RankStore(rank, {n}) to join that capture; or, {again}")


def _refuse_stale_attempt(b: Any, root: str, rank: int, world_size: int, run: str,
                          runs: dict[int, str | None] | None = None) -> None:
    """Refuse a task of ``world_size`` ranks under a store where rank stores of the capture again
    ``run`` (:func:`capture_again_run_id` of the store's root) lie at ranks ``world_size`` and
    beyond: what an earlier attempt with more tasks left (3 tasks, then rerun with 2 after an
    allocation changed). No task of this capture ever writes over them, ``consolidate`` could
    neither commit them with this capture's rank stores nor leave their rows out, so the task
    stops before its first forward, naming them. ``runs``: the run of each rank store, when
    already read (else only the rank stores beyond ``world_size`` are read).

    Raises
    ------
    StoreError
        Such rank stores; nothing was written.
    """
    if runs is None:
        beyond = [r for r in listed_rank_stores(b) if r >= world_size]
        runs = _rank_runs(b, beyond) if beyond else {}
    stale = [r for r, x in runs.items() if r >= world_size and x == run]
    if not stale:
        return
    n = _recorded_world_size(b, stale)
    by = f"{n} tasks" if n is not None else "more tasks"
    names = [f"{r:05d}" for r in stale[:10]] + ([f"... ({len(stale)} in all)"] if len(stale) > 10 else [])
    paths = " ".join(rank_target(root, r) for r in stale[:10]) + (" ..." if len(stale) > 10 else "")
    remove = f"`rm -r {paths}`" if "://" not in root else f"every object under {paths}"
    raise StoreError(
        f"store path {rank_target(root, rank)!r}: under {_ranks_dir(b)!r}, rank store(s) {names} are of an earlier "
        f"attempt to capture {root!r} again by {by} (run {run!r}: rank_store.run_id and rank_store.world_size in "
        f"their zarr.json), beyond the {world_size} ranks of this task, RankStore({rank}, {world_size}): no task of "
        f"this capture writes over them, and consolidate can neither commit them with its {world_size} rank stores "
        "nor leave their rows out; nothing was written. To capture the store with "
        f"{world_size} tasks, remove them ({remove}: they hold rows of that attempt only, the store itself is "
        "not changed), then run the tasks again; to finish that attempt instead, run its tasks as RankStore(rank, "
        f"{n if n is not None else 'its world size'})")


def _consolidate_call(root: str) -> str:
    """How to commit the rank stores of ``root``: the command for a local path, the function for a URL."""
    return (f"`activationscope.store.ranks.commit_ranks({root!r}, storage_options=...)`" if "://" in root else
            f"`activationscope consolidate {root}`")


def _rank_runs(b: Any, ranks: list[int]) -> dict[int, str | None]:
    """``{rank: rank_store.run_id}`` of the rank stores ``ranks`` (None: none recorded)."""
    out = {}
    for r in ranks:
        sub = _sub_backend(b, f"{RANKS_DIR}/{r:05d}")
        out[r] = None if sub is None else rank_store_run_id(sub)
    return out


_STORE_OBJECTS = ("acts", "rows", "reductions")  # a store's entries beside the root and ranks/


def _remove_store_objects(b: Any) -> None:
    """Remove every object under ``acts/``, ``rows/`` and ``reductions/`` (a link there is
    unlinked, never followed); nothing else is touched."""
    if isinstance(b, LocalBackend):
        for name in _STORE_OBJECTS:
            p = b.root / name
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            elif p.is_symlink() or p.exists():
                p.unlink()
        return
    for name in _STORE_OBJECTS:
        for key in list(b.list(f"{name}/")):
            b.delete(key)


def _remove_other_runs(b: Any, run: str) -> None:
    """Resume of an uncommitted multi-rank store whose root records ``distributed.run_id``:
    remove what is not that run's before a rank writes: the rank stores recording another run
    (or none), and every object beside the root and ``ranks/`` (what an ``overwrite=True``
    killed after writing its root left of the old run, or a commit killed before its root
    wrote, which the next commit writes again)."""
    other = split_rank_stores_by_run(b, listed_rank_stores(b), {"run_id": run})[1]
    _remove_store_objects(b)  # (a store's entries beside the root and ranks/: nothing else is touched)
    if isinstance(b, LocalBackend):
        for r in other:
            p = b.root / RANKS_DIR / f"{r:05d}"
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink(missing_ok=True)
        return
    for r in other:
        for key in list(b.list(f"{RANKS_DIR}/{r:05d}/")):
            b.delete(key)



def _check_same(stores: list[Store], what: str, get: Callable[[Store], Any], ranks: list[int] | None = None) -> Any:
    """``get`` of the first store, once every store gives the same; ``ranks``: the rank of
    each store (default 0, 1, ...), for the message."""
    ranks = list(range(len(stores))) if ranks is None else ranks
    first = get(stores[0])
    for r, st in zip(ranks[1:], stores[1:]):
        if get(st) != first:
            raise StoreError(f"rank stores disagree on {what}: rank {ranks[0]} has {first!r}, rank {r} has "
                             f"{get(st)!r}; every rank must capture the same model with the same options (capture "
                             f"rank {r} again with those of rank {ranks[0]}); nothing was written")
    return first


def _check_same_hook_points(stores: list[Store], ranks: list[int]) -> None:
    """Refuse rank stores (each of which captured a forward) that do not hold the same hook points.

    A committed store holds each hook point for the rows of every rank, in the order of the row
    tables: a hook point that a rank lacks (captured with other ``include=`` / ``exclude=``, or
    whose module no forward of that rank ran) cannot be committed as following its table, nor its
    rows placed among the other ranks'.

    Raises
    ------
    StoreError
        Naming the hook points each rank lacks and the fixes; nothing was written.
    """
    every = sorted(set().union(*(s.hook_points for s in stores)))
    lacking = {r: [hp for hp in every if hp not in s.hook_points] for r, s in zip(ranks, stores)}
    lacking = {r: hps for r, hps in lacking.items() if hps}
    if not lacking:
        return

    def shown(hps: list[str]) -> str:
        return str(hps) if len(hps) <= 10 else f"{str(hps[:10])[:-1]}, ...] ({len(hps)} in all)"
    r, hps = next(iter(lacking.items()))
    holder = next(q for q, s in zip(ranks, stores) if hps[0] in s.hook_points)
    more = f" (and rank(s) {sorted(lacking)[1:10]} lack others)" if len(lacking) > 1 else ""

    def side(q: int) -> Any:  # capture= "output" | "input" | "both" of rank q's store
        config = stores[ranks.index(q)].attrs.get("capture_config")
        return config.get("capture") if isinstance(config, dict) else None
    if isinstance(side(r), str) and isinstance(side(holder), str) and side(r) != side(holder):
        raise StoreError(
            f"rank stores disagree on the hook points: rank {r} lacks {shown(hps)}, which rank {holder} holds{more}: "
            f"rank {r} was captured with capture={side(r)!r}, rank {holder} with capture={side(holder)!r}; a committed "
            "store holds every hook point for the rows of every rank, so these rank stores cannot be committed as they "
            f"are; nothing was written. Capture rank {r} again with capture={side(holder)!r} (store_options "
            f"overwrite=True), or rank {holder} with capture={side(r)!r}")
    raise StoreError(
        f"rank stores disagree on the hook points: rank {r} lacks {shown(hps)}, which rank {holder} holds{more}; "
        "a committed store holds every hook point for the rows of every rank, so these rank stores cannot be committed as they are; "
        "nothing was written. Either the ranks were captured with other include=/exclude= (capture rank "
        f"{r} again with those of rank {holder}, store_options overwrite=True), or no forward of rank {r} ran "
        f"those modules (its data never reaches them): capture every rank again leaving them out (exclude=), or "
        f"capture them into a store of their own")


def _capture_policy(st: Store) -> dict:
    """The rule that picked a rank store's forwards (``capture_config["capture_policy"]``, and
    its ``sample_every`` or ``max_k``; ``SAMPLE_N`` with ``sample_every=1`` is ``EVERY``), as
    the commit compares it: a committed store records one ``capture_config`` for the rows of
    every rank. ``{}`` for a rank store without the record."""
    config = st.attrs.get("capture_config")
    name = config.get("capture_policy") if isinstance(config, dict) else None
    if name is None:
        return {}
    if name == "SAMPLE_N" and config.get("sample_every") == 1:
        name = "EVERY"
    extra = {"SAMPLE_N": "sample_every", "MAX_K": "max_k"}.get(name)
    return {"capture_policy": name, **({extra: config.get(extra)} if extra else {})}


def _n_rows(st: Store, hp: str) -> int:
    """Rows of ``hp`` in a rank store; 0 in a rank store that captured no forward."""
    return st.n_rows(hp) if hp in st.hook_points else 0


def _captured(st: Store) -> bool:
    """Whether a rank store holds anything: False for a rank whose share of the data was
    empty (it captured no forward: no hook point, no sample, no reduction state)."""
    return bool(st.hook_points or st.n_samples or _rank_states(st))


class _TailWriter:
    """The native shard writer of one array, writing shards from a given shard index on."""

    def __init__(self, directory: Path, meta: dict, first_shard: int, root: Path) -> None:
        _C = _native.load()
        self.compression = meta.get("compression")
        self.core = _C.StoreCore(64 << 20, False)
        self.writer = _C.ArrayWriter(
            self.core, meta["path"], str(directory), str(directory), F.torch_dtype(meta["dtype"]),
            list(meta["feature_shape"]), int(meta["chunk_rows"]), int(meta["shard_rows"]) // int(meta["chunk_rows"]),
            first_shard * int(meta["shard_rows"]), self.compression is not None,
            root=str(root))  # (every folder from the store's down opened without following a link)
        self.thread = None
        if self.compression is not None:
            self.encoder = F.numcodecs_encoder(self.compression)
            self.thread = threading.Thread(target=self._encode_loop, daemon=True)
            self.thread.start()

    def _encode_loop(self) -> None:
        while True:
            item = self.core.next_to_encode()
            if item is None:
                return
            ident, _, flat, size = item
            try:
                data = flat.numpy()
                if size > 1:
                    data = data.view(f"<u{size}")
                self.core.submit_encoded(ident, self.encoder.encode(data))
            except BaseException as e:  # noqa: BLE001 - the writer fails with the cause
                self.core.fail_encoded(ident, f"{type(e).__name__}: {e}")

    def write(self, rows: torch.Tensor) -> list[dict]:
        try:
            if len(rows):
                self.writer.append(rows)
            self.writer.flush()
            self.core.drain()
        finally:
            self.core.close()
            if self.thread is not None:
                self.thread.join()
        if self.core.failed:
            raise StoreError(f"writing the re-chunked tail rows of {self.writer.hook_point!r} failed: {self.core.error}")
        return list(self.writer.take_durable())


def _link_or_copy(src: Path, dst: Path) -> None:
    """Put ``src``'s bytes at ``dst`` without rewriting them (a hard link; a copy where the
    file system has none); an existing ``dst`` (a rerun) is replaced."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    if dst.exists() and os.path.samefile(src, dst):
        return  # a rerun: already linked (rename onto the same inode would leave the temporary)
    tmp = dst.parent / f".{dst.name}.link.tmp"  # LINK_TEMP_NAME: remove_temp_files knows it
    try:
        tmp.unlink()
    except FileNotFoundError:
        pass
    try:
        os.link(src, tmp)
    except OSError:
        shutil.copyfile(src, tmp)
    os.replace(tmp, dst)


def _rank_states(st: Store) -> dict[str, dict[str, dict]]:
    """``{hook point: {name: {"kind", "options", "n_rows", "state"}}}`` of a rank store.

    The state is the one every store keeps for resume (FORMAT.md section 6: ``state`` on the
    main reduction entry, files ``<name>.state.<key>``). Rank stores written before that was
    the one format list it apart, under ``reduction_states`` (files ``<name>.rank_state.<key>``):
    still read."""
    old = st.attrs.get("reduction_states")
    if isinstance(old, dict) and old:
        return old
    out: dict[str, dict[str, dict]] = {}
    for hp, entries in (st.attrs.get("reductions") or {}).items():
        for e in entries.values():
            if isinstance(e, dict) and isinstance(e.get("state"), dict) and "reduction" in e:
                out.setdefault(hp, {})[e["reduction"]] = {
                    "kind": e.get("kind"), "options": e.get("options") or {}, "state": e["state"],
                    **({"n_rows": e["n_rows"]} if "n_rows" in e else {})}
    return out


def _read_state(st: Store, name: str, entry: dict) -> dict[str, torch.Tensor]:
    """The state arrays of reduction ``name`` of a rank store (its entry of :func:`_rank_states`)."""
    return {key: st._read_small({**arr, "reduction": name}) for key, arr in entry["state"].items()}


def _committed_row_ids(row_ids: torch.Tensor, i: int, ns: list[int], shard_rows: int) -> torch.Tensor:
    """Row ids of the ``i``-th rank store (``ns``: every rank store's rows of the array, in
    rank order) as rows of the committed store, in its row order (module docstring): a row
    in one of the rank's ``f_i`` full shards follows the full shards of the ranks before it;
    a row of its tail follows every full shard and the tails of the ranks before it."""
    fulls = [n // shard_rows * shard_rows for n in ns]  # rows in full shards, per rank
    head = sum(fulls[:i])
    tail = sum(fulls) + sum(n - f for n, f in zip(ns[:i], fulls[:i]))
    return torch.where(row_ids < fulls[i], row_ids + head, row_ids - fulls[i] + tail)


def _merge_states(hp: str, name: str, entries: list[dict], stores: list[Store],
                  make: Callable[[str, str, dict], Any] | None,
                  read: dict[tuple[int, str, str], dict] | None = None, ranks: list[int] | None = None) -> Any:
    """The rank states of reduction ``name`` of ``hp`` merged; ``read``: states already read
    (by :func:`_check_states_fit`), by ``(rank, hook point, name)``; ``ranks``: the rank of
    each store (default 0, 1, ...)."""
    from ..capture import reductions as R

    kind = entries[0]["kind"]
    for e in entries[1:]:
        if e["kind"] != kind or e["options"] != entries[0]["options"]:
            raise StoreError(f"rank stores disagree on reduction {name!r} of hook point {hp!r}: "
                             f"{entries[0]['kind']}{entries[0]['options']} vs {e['kind']}{e['options']}; every rank must "
                             "capture the same reductions (capture the other rank again with those of rank 0); nothing "
                             "was written")
    total = make(hp, name, entries[0]) if make is not None else None
    if total is None:
        if kind not in R.BUILTIN_REDUCTIONS:
            raise StoreError(
                f"reduction {name!r} of hook point {hp!r} is a custom reduction ({kind!r}); its rank states can only "
                "be merged by the capture that defined it (torchrun), never by running code from a store; nothing "
                "was written. Commit them from Python with your mergeable reduction (a scripted module with a merge "
                "method): commit_ranks(store, make_reduction=lambda hook_point, name, entry: "
                f"make_reduction(<yours>) if name == {name!r} else None), None for the others (built-in ones)")
        total = R.make_reduction(kind, **entries[0]["options"])
    total = total.fresh()
    read = read or {}
    ns = [_n_rows(st, hp) for st in stores]
    for i, (r, st, e) in enumerate(zip(range(len(stores)) if ranks is None else ranks, stores, entries)):
        state = read[(r, hp, name)] if (r, hp, name) in read else _read_state(st, name, e)
        if kind == "topk" and "row_ids" in state:  # rank rows -> the committed store's rows
            shard_rows = int(st.attrs["arrays"][st.aliases.get(hp, hp)]["shard_rows"])
            state = {**state, "row_ids": _committed_row_ids(state["row_ids"], i, ns, shard_rows)}
        part = total.fresh()
        part.load_state(state)
        total.merge(part)
    return total


def _check_states_fit(stores: list[Store]) -> dict[tuple[int, str, str], dict]:
    """Refuse a rank store whose built-in reduction state no such reduction can hold after the
    rows it has (as a resume refuses to continue one, StoreWriter.stored_reduction_state;
    here there are no rows to compute it again from), before anything is written.

    Returns the states it read, by ``(rank, hook point, name)`` (for :func:`_merge_states`).
    Raises StoreCorruptError naming the rank store, hook point and reduction."""
    from ..capture import reductions as R

    read: dict[tuple[int, str, str], dict] = {}
    for r, st in enumerate(stores):
        for hp, entries in _rank_states(st).items():
            if hp not in st.hook_points:
                continue
            meta = st.attrs["arrays"][st.aliases.get(hp, hp)]
            for name, e in entries.items():
                if e.get("kind") not in R.BUILTIN_REDUCTIONS or not isinstance(e.get("state"), dict):
                    continue
                state = read[(r, hp, name)] = _read_state(st, name, e)
                if not _builtin_state_fits(e["kind"], e.get("options") or {}, state, st.n_rows(hp),
                                           tuple(meta["feature_shape"])):
                    raise StoreCorruptError(
                        f"rank {r} store {st.path!r}: the state of reduction {name!r} of hook point {hp!r} is not one "
                        f"a {e['kind']!r} reduction can hold after its {st.n_rows(hp)} rows (keys, shapes, dtypes, "
                        "count or row ids); the rank store is damaged: capture that rank again; nothing was written")
    return read


def _rank_row_tables(stores: list[Store], hps: list[str], metas: dict[str, dict]) -> dict[str, list]:
    """Every rank's row tables with a ``rank`` column, by row kind, checked against the rows
    of the arrays that follow them (read before a commit writes anything).

    Raises
    ------
    StoreError
        A rank store with a user column named ``rank``, ranks whose tables hold a column of
        the same name with other types, or an array whose rows are not its row table's rows;
        nothing was written.
    """
    import pyarrow as pa

    out: dict[str, list] = {}
    for kind in ROW_KINDS:
        tables = [s.row_table(kind) for s in stores]
        for r, (t, rank_st) in enumerate(zip(tables, stores)):
            _no_rank_column(t, rank_st, r)
        for hp in hps:
            if metas[hp]["row_kind"] != kind or not all(
                    bool(s.attrs["arrays"][hp].get("follows_row_table", True)) for s in stores if hp in s.hook_points):
                continue
            for r, (t, st) in enumerate(zip(tables, stores)):
                if _n_rows(st, hp) != t.num_rows:
                    raise StoreError(f"rank {r}: hook point {hp!r} has {_n_rows(st, hp)} rows but its {kind} row table "
                                     f"{t.num_rows}; run verify on the rank store {st.path!r}; nothing was written")
        out[kind] = [t.append_column("rank", pa.array(np.full(t.num_rows, r, dtype=np.int64)))
                     for r, t in enumerate(tables)]
        check_rank_column_types(out[kind], list(range(len(stores))), stores, kind, "; nothing was written")
    return out


def _check_same_reductions(states: list[dict[str, dict[str, dict]]], used: list[int]) -> None:
    """Refuse rank stores whose reductions differ (names, kinds or options of a hook point's
    reductions: their states cannot be merged into one result), before anything is merged or
    written; the error names the hook point, the two ranks and the difference. ``states``:
    every rank store's :func:`_rank_states`; ``used``: the ranks that captured rows."""
    def shown(entry: dict) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in sorted(entry["options"].items()))
        return f"{entry['kind']}({opts})"

    fix = "every rank must capture the same reductions (capture rank {r} again with those of rank {first}: " \
          "store_options overwrite=True replaces only its rank store); nothing was written"
    first = used[0]
    for r in used[1:]:
        a, b = states[first], states[r]
        for hp in [*a, *(h for h in b if h not in a)]:
            names_a, names_b = sorted(a.get(hp, {})), sorted(b.get(hp, {}))
            if names_a != names_b:
                only_a = [n for n in names_a if n not in names_b]
                only_b = [n for n in names_b if n not in names_a]
                raise StoreError(
                    f"rank stores disagree on the reductions of hook point {hp!r}: rank {first} has {names_a}, rank "
                    f"{r} has {names_b} ({f'only rank {first}: {only_a}' if only_a else ''}"
                    f"{'; ' if only_a and only_b else ''}{f'only rank {r}: {only_b}' if only_b else ''}); "
                    + fix.format(r=r, first=first))
            for name in names_a:
                ea, eb = a[hp][name], b[hp][name]
                if ea["kind"] != eb["kind"] or ea["options"] != eb["options"]:
                    if ea["kind"] != eb["kind"]:
                        diff = f"kind {ea['kind']!r} vs {eb['kind']!r}"
                    else:
                        keys = sorted(set(ea["options"]) | set(eb["options"]))
                        diff = ", ".join(f"{k} {ea['options'].get(k)!r} vs {eb['options'].get(k)!r}" for k in keys
                                         if ea["options"].get(k) != eb["options"].get(k))
                    raise StoreError(
                        f"rank stores disagree on reduction {name!r} of hook point {hp!r}: rank {first} has "
                        f"{shown(ea)}, rank {r} has {shown(eb)} ({diff}); " + fix.format(r=r, first=first))


def _merged_reductions(stores: list[Store], make_reduction: Callable[[str, str, dict], Any] | None,
                       states_read: dict[tuple[int, str, str], dict]) -> dict[str, dict[str, tuple[str, Any, dict]]]:
    """Every reduction of the rank stores merged from their float64 states (before a commit
    writes anything): ``{hook point: {name: (kind, options, result)}}``.

    Raises
    ------
    StoreError
        Rank stores with other reductions (names, kinds or options), results without
        states, a state covering other rows than its rank store holds, or a custom reduction
        without ``make_reduction``; nothing was written. A StoreCorruptError for an entry a
        rank store refuses (:attr:`Store.refused_reductions`).
    """
    for st in stores:  # (merged, such an entry would give values no reduction wrote)
        for hp, problems in st.refused_reductions.items():
            raise st._refused_error(hp, problems)
    states = [_rank_states(s) for s in stores]
    used = [r for r, s in enumerate(stores) if _captured(s)]  # a rank that captured nothing adds no state
    _check_same_reductions(states, used)
    state_hps = {hp: sorted(v) for hp, v in states[used[0]].items()}
    if stores[used[0]].attrs.get("reductions") and not state_hps:
        raise StoreError("the rank stores hold reduction results but no reduction states; they cannot be merged; "
                         "nothing was written")
    out: dict[str, dict[str, tuple[str, Any, dict]]] = {}
    for hp, names in state_hps.items():
        for name in names:
            entries = [states[r][hp][name] for r in used]
            for r, e in zip(used, entries):
                st = stores[r]
                n = _n_rows(st, hp)
                if "n_rows" in e and int(e["n_rows"]) != n:
                    raise StoreError(f"rank {r}: the state of reduction {name!r} of hook point {hp!r} covers "
                                     f"{e['n_rows']} rows, the rank store holds {n}; it would give a partial result; "
                                     "nothing was written")
            total = _merge_states(hp, name, entries, [stores[r] for r in used], make_reduction, states_read, used)
            out.setdefault(hp, {})[name] = (str(getattr(total, "kind", entries[0]["kind"])), entries[0]["options"],
                                            total.result())
    return out


def commit_ranks(target: Any, *, storage_options: dict | None = None,
                 make_reduction: Callable[[str, str, dict], Any] | None = None,
                 world_size: int | None = None, verify: bool = True) -> dict:
    """Commit the complete rank stores under ``<target>/ranks/`` into one store (format v2).

    Idempotent: a commit that crashed part way is finished by running it again (the rank
    stores stay until the root ``zarr.json`` is written, then are removed). Under a complete
    store, the rank stores of the run that captures it again (``RankStore`` tasks with
    ``overwrite=True``) are committed over it, once every check passed, root first. Temporary files
    that a killed writer or commit left in the store's own folders (our own temporary names
    only, never through a link) are removed once the store is committed, as a resume does.

    Parameters
    ----------
    target : str or os.PathLike
        The store: a local path or an fsspec URL (``s3://bucket/run.zarr``); the rank stores
        are ``<target>/ranks/<rank>``.
    storage_options : dict, optional
        fsspec options of a URL ``target`` (credentials, ``client_kwargs``).
    make_reduction : callable, optional
        ``(hook_point, name, entry) -> reduction`` for custom reductions (the capture's own
        objects); built-in reductions are made from their recorded kind and options.
    world_size : int, optional
        Expected number of rank stores (default: the root's ``distributed.world_size``). It
        must agree with the world size the root and every rank store record (``RankStore(rank,
        world_size)``, the ``torchrun`` world), also on a store already committed.
    verify : bool, default True
        Check the crc32c of every chunk of every rank shard, local or on object storage, before
        writing anything (one read of every shard: stores from elsewhere, ``activationscope
        consolidate``). False checks only the tail shards, which the commit reads anyway; the
        end of a ``torchrun`` capture commits so, its ranks having just written the shards
        with their crc32c. File sizes against the manifests are always checked.

    Returns
    -------
    dict
        ``{"n_ranks", "n_samples", "arrays": {hook point: {"n_rows", "linked_shards",
        "copied_rows", "copied_bytes", "copied_shards"}}, "commit_s", "cleanup_s", "replaced"}``:
        seconds to the commit point (root written) and then to remove the rank stores;
        ``replaced``: the rank stores captured the store again (``RankStore`` tasks with
        ``overwrite=True`` on a complete store) and their run replaced the store it held
        (its root first, store/FORMAT.md section 10). ``{"n_ranks", "n_samples", "arrays": {},
        "already_committed": True}`` for a store committed before, with no such rank stores.

    Raises
    ------
    StoreError
        A local path that does not exist, is a file, or holds neither a store nor rank stores
        (nothing is created there); no rank stores, a rank store that is not complete (resume it first), rank stores
        that disagree (model, arrays, layout), ``world_size`` other than the world size the
        root or a rank store records (nothing written), a rank store of another run in the place
        of a rank of a capture again (nothing written: the store stays the old one), or a custom
        reduction without ``make_reduction``.
    StoreCorruptError
        A root ``zarr.json`` that is not ours (not JSON, attributes other than one
        ``activationscope`` object with our ``format``, a malformed ``distributed`` record), a
        damaged rank manifest or rank shard; nothing was changed.
    ArgumentValueError
        ``world_size`` not a positive int.
    ArgumentTypeError
        ``verify`` not a bool.
    """
    verify = F.parse_flag(verify, "verify")  # (verify="False" is a true string)
    if world_size is not None and (isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1):
        raise ArgumentValueError(f"world_size must be a positive int or None, got {world_size!r}")
    b = resolve(target, storage_options=storage_options)
    if not isinstance(b, LocalBackend) and not (isinstance(target, str) and "://" in target):
        raise StoreError(f"committing rank stores needs a local path or a URL, got {target!r}")
    if isinstance(b, LocalBackend):
        _check_local_target(b)
    check_backend_not_in_store(b)  # (a multi-rank store made inside another one before that was refused)
    with WriterLock(b):  # one committer (or writer) at a time: a second one gets StoreLockedError
        return _commit_ranks(b, target, storage_options, make_reduction, world_size, verify)


def _commit_held(root: str, lock: WriterLock, *, storage_options: dict | None,
                 make_reduction: Callable[[str, str, dict], Any] | None, world_size: int) -> dict:
    """:func:`commit_ranks` (``verify=False``) by the capture's rank 0 under the store's writer
    lock ``lock`` it has held since its preparation of the store (:func:`_prepare`).

    Raises
    ------
    StoreError
        The lock no longer holds the store at ``root`` (its folder moved, removed or replaced
        since): nothing is written there; else as :func:`commit_ranks`.
    """
    b = resolve(root, storage_options=storage_options)
    why = lock.lost()
    if why is not None:
        raise StoreError(f"the multi-rank store {root!r} is no longer the one rank 0 prepared: {why} (moved, removed "
                         "or replaced since); nothing was committed or written there")
    return _commit_ranks(b, root, storage_options, make_reduction, world_size, False)


def _remove_ranks(b: Any) -> None:
    """Remove the rank stores ``ranks/<r, 5 digits>/`` (a link in their place is unlinked,
    never followed), then ``ranks/`` itself when nothing else is left in it: any other file
    or folder a user put under ``ranks/`` stays where it is."""
    if isinstance(b, LocalBackend):
        top = b.root / RANKS_DIR
        if not top.is_dir() or top.is_symlink():
            return
        for p in sorted(top.iterdir()):
            if F.is_rank_name(p.name):
                if p.is_symlink() or not p.is_dir():
                    p.unlink(missing_ok=True)
                else:
                    shutil.rmtree(p, ignore_errors=True)
        try:
            top.rmdir()
        except OSError:  # user files left in it
            pass
        return
    for key in list(b.list(f"{RANKS_DIR}/")):
        parts = key.split("/")
        if len(parts) >= 3 and F.is_rank_name(parts[1]):
            b.delete(key)


def _remove_temp_files(b: Any) -> None:
    """Remove the temporary files that an earlier writer or commit, killed between creating
    one and renaming it, left in the committed store (``LocalBackend.remove_temp_files``: only
    our own temporary names, only in the store's own folders, never following a link). Called
    under the writer lock, once no shard writer of this commit is running; object stores have
    no temporaries."""
    remove = getattr(b, "remove_temp_files", None)
    if remove is not None:
        remove(shards=True)


def _remote_path(b: Any, key: str) -> str:
    return f"{b.store.path.rstrip('/')}/{key}"


def _put_root(b: Any, data: bytes, etag: str | None) -> None:
    """The commit point. Local: atomic rename. S3: a conditional put (``If-Match`` the root
    read at the start of the commit, ``If-None-Match: *`` when there was none), so of two
    committers racing past the lock only one replaces the root; the other gets StoreError."""
    if isinstance(b, LocalBackend) or not getattr(b, "_conditional", False) or \
            type(getattr(b.store.fs, "sync_fs", b.store.fs)).__name__ != "S3FileSystem":
        b.set("zarr.json", data)
        return
    fs = b.store.fs
    path = _remote_path(b, "zarr.json")
    bucket, key, _ = fs.split_path(path)
    cond = {"IfMatch": etag} if etag else {"IfNoneMatch": "*"}

    async def put() -> None:
        await fs._call_s3("put_object", Bucket=bucket, Key=key, Body=data, **cond)

    try:
        b._sync(put())
    except Exception as e:  # botocore / s3fs wrap the 412 in several classes
        text = str(e)
        if any(m in text for m in ("PreconditionFailed", "412", "ConditionalRequestConflict", "pre-conditions")):
            raise StoreError(f"another committer replaced the root of {str(b)!r} first (conditional write "
                             f"{cond} failed); this commit is void, the store holds the other one") from e
        raise StoreError(f"writing the root of {str(b)!r} failed: {e}") from e


def _root_etag(b: Any) -> str | None:
    if isinstance(b, LocalBackend) or type(getattr(b.store.fs, "sync_fs", b.store.fs)).__name__ != "S3FileSystem":
        return None

    async def info() -> dict:
        return await b.store.fs._info(_remote_path(b, "zarr.json"), refresh=True)

    try:
        return b._sync(info()).get("ETag")
    except FileNotFoundError:
        return None


def _check_rank_shards(hp: str, meta: dict, stores: list[Store], local: bool,
                       verify: bool = True) -> list[dict[int, dict]]:
    """Check the rank shards of ``hp`` that a commit links, copies or re-chunks, before
    anything is written: each full shard is listed in its rank's manifest and its file holds
    the bytes the manifest lists; on a local store every committed chunk of every rank shard
    (full or tail; with ``verify=False`` the tails only, which the commit reads anyway)
    matches its manifest crc32c (``Store._check_shard_crcs``: one read of each shard, which
    the page cache then serves to the copy of the tails). On object storage the tails are
    read through decoded reads, which check each chunk's crc32c; the full shards, copied
    server-side, are read and checked once before anything is written with ``verify=True``
    (``consolidate``), and not read with ``verify=False``.

    Returns
    -------
    list[dict[int, dict]]
        Per rank, ``{shard: manifest record}``.

    Raises
    ------
    StoreError
        A full shard without a manifest entry, or missing.
    StoreCorruptError
        A shard of another size than its manifest lists, a damaged chunk (naming the rank
        store and the shard file), or a manifest whose ``hook_point``, a shard's ``key`` or
        ``rows_end`` is not what the format prescribes (naming the file and the field);
        nothing was written.
    """
    S = int(meta["shard_rows"])
    nd = len(meta["feature_shape"])
    path = next(st.attrs["arrays"][hp]["path"] for st in stores if hp in st.hook_points)
    out = []
    for r, st in enumerate(stores):
        if hp not in st.hook_points:  # a rank that captured no forward: no shard
            out.append({})
            continue
        key = f"{path}/manifest.json"
        raw = st._backend.get(key, max_bytes=V.MAX_JSON_BYTES)
        fix = (f"nothing was committed. Run `activationscope verify {st.path}`, and rerun rank {r} (or restore "
               "the file from an intact copy) before committing")
        entry = {**st.attrs["arrays"][hp], **meta}
        try:
            doc = None if raw is None else V.loads_json(raw, store=st._backend, key=key)
            recs = {} if raw is None else V.parse_manifest(doc, entry, store=st._backend, key=key,
                                                           check_chunks=False)
            if isinstance(recs, V.Manifest):
                recs.load_all()  # (its segments, each checked: every record is used below)
        except StoreCorruptError as e:
            what = str(e).removesuffix(f"; {V.FIX}")
            raise StoreCorruptError(f"rank {r}: {what}; {fix}") from None
        # hook_point, each shard's key and rows_end: what the format prescribes (FORMAT.md §9 rule 18)
        problems = [] if raw is None else V.manifest_problems(doc, recs, entry, hook_point=hp, key=key)
        if problems:
            raise StoreCorruptError(f"rank {r}: store {st.path!r}: {'; '.join(problems)}; {fix}")
        n = st.n_rows(hp)
        for k in range(n // S):
            rec = recs.get(k)
            if rec is None:
                raise StoreError(f"rank {r}: shard {k} of {hp!r} has no manifest entry; run verify on {st.path!r}")
            size = st._backend.size(F.shard_key(path, k, nd))  # a regular file (never a FIFO)
            if size is None:
                raise StoreError(f"rank {r}: shard {k} of {hp!r} is missing; run verify on {st.path!r}")
            if size != int(rec.get("file_bytes", -1)):  # a truncated or swapped shard is not committed
                raise StoreCorruptError(
                    f"rank {r}: shard {k} of {hp!r} ({F.shard_key(path, k, nd)}) holds {size} bytes, its manifest "
                    f"says {rec.get('file_bytes')!r}; nothing was committed. Run verify on {st.path!r}, and "
                    "rerun that rank (or restore the shard) before committing")
        if local or verify:  # object storage: the tails are read (and checked) by the commit anyway
            fix = (f"nothing was committed. Rerun rank {r} (or restore the shard from an intact copy) and "
                   f"consolidate again; `activationscope verify {st.path}` lists every damaged file")
            for k in range(0 if verify else n // S, -(-n // S) if local else n // S):
                st._check_shard_crcs(hp, k, fix)
        out.append(recs)
    return out


def _ranks_dir(b: Any) -> str:
    """``<store>/ranks/``, one path to quote in messages."""
    return f"{str(b).rstrip('/')}/{RANKS_DIR}/"


def _check_local_target(b: LocalBackend) -> None:
    """Refuse, before the writer lock is taken (so nothing is created), a local path that is
    not a folder holding a store or rank stores."""
    root = b.root
    if not root.exists():
        raise StoreError(f"store {str(root)!r} does not exist; pass the folder the capture wrote (it holds "
                         f"{RANKS_DIR}/)")
    if not root.is_dir():
        raise StoreError(f"{str(root)!r} is a file, not a store folder; pass the folder the capture wrote (it holds "
                         f"{RANKS_DIR}/)")
    if b.get("zarr.json") is None and not listed_rank_stores(b):
        raise StoreError(f"{str(root)!r} holds no store: no zarr.json and no rank stores under {_ranks_dir(b)!r}; "
                         "nothing to commit. Pass the folder a multi-rank capture wrote")


def _check_rank_world_sizes(b: Any, stores: list[Store], expected: int | None) -> None:
    """Every rank store that records its rank and world size (``rank_store`` in its root)
    must be rank ``r`` of ``expected`` ranks: a commit of part of a capture as ``complete``
    (a task of ``RankStore(0, 2)`` committed with ``world_size=1``) raises StoreError."""
    for r, st in enumerate(stores):
        rec = st.attrs.get("rank_store")
        if not isinstance(rec, dict):
            continue  # a rank store written before ranks recorded it
        n, rank = rec.get("world_size"), rec.get("rank")
        if expected is None and n is not None and n != len(stores):
            if n > len(stores):
                why = (f"rank(s) {list(range(len(stores), n))} are missing: capture (or resume) them, then "
                       "consolidate again")
            else:
                beyond = list(range(n, len(stores)))
                theirs = {(stores[k].attrs.get("rank_store") or {}).get("world_size") for k in beyond
                          if isinstance(stores[k].attrs.get("rank_store"), dict)}
                earlier = (f" (captured as ranks of {theirs.pop()} ranks: an earlier attempt with more tasks, whose "
                           "rows are no part of this capture)" if len(theirs) == 1 and None not in theirs else "")
                why = (f"rank(s) {beyond} are beyond its {n} ranks{earlier}: remove (or move away) the rank store(s) "
                       f"{[rank_target(str(b), k) for k in beyond]} if they belong to another capture or attempt, "
                       "then consolidate again")
            raise StoreError(
                f"the rank store {st.path!r} was captured as rank {rank} of {n} ranks, but {len(stores)} rank "
                f"store(s) are under {_ranks_dir(b)!r}: {why}; nothing was written")
        if expected is not None and n is not None and n != int(expected):
            raise StoreError(
                f"world_size={expected} (CLI: --world-size {expected}) disagrees with the rank store {st.path!r}, "
                f"which was captured as rank {rank} of {n} ranks (rank_store.world_size in its zarr.json); nothing "
                f"was written. Pass world_size={n} (CLI: --world-size {n}) once every one of its {n} ranks is "
                f"complete, or capture every task again with RankStore(rank, {expected})")
        if rank is not None and rank != r:
            raise StoreError(f"the rank store {st.path!r} was captured as rank {rank}, but is stored as rank {r}; "
                             f"nothing was written. Move it to {rank_target(str(b), int(rank))!r} or capture rank "
                             f"{r} again")


def _root_attrs_to_commit(b: Any, raw: bytes) -> dict:
    """The ``activationscope`` attributes of the root document ``raw`` of a store to commit:
    those :func:`prepare_root` or a commit wrote, and nothing else in its attributes.

    Raises
    ------
    StoreCorruptError
        A root document that is not JSON, whose attributes hold anything but one
        ``activationscope`` object with our ``format``, or whose ``distributed`` record is
        not ``{"world_size": positive int, "committed": bool}``; nothing was changed.
    """
    what = None
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError):
        doc, what = None, "is not valid JSON"
    attributes = doc.get("attributes") if isinstance(doc, dict) else None
    attrs = attributes.get(F.ATTRS_KEY) if isinstance(attributes, dict) else None
    if what is not None:
        pass
    elif not isinstance(attrs, dict):
        what = (f"is not a JSON object with an {F.ATTRS_KEY!r} object in its attributes (attributes "
                f"{_short(attributes if isinstance(doc, dict) else doc)})")
    elif set(attributes) != {F.ATTRS_KEY}:
        what = (f"has attributes that are not ours: {sorted(k for k in attributes if k != F.ATTRS_KEY)!r} beside "
                f"{F.ATTRS_KEY!r}")
    elif not isinstance(attrs.get("format"), dict) or attrs["format"].get("name") != F.FORMAT_NAME:
        what = f"has {F.ATTRS_KEY}.format {_short(attrs.get('format'))}, not {{'name': {F.FORMAT_NAME!r}, ...}}"
    else:
        dist = attrs.get("distributed") or {}
        n = dist.get("world_size") if isinstance(dist, dict) else None
        if not isinstance(dist, dict):
            what = f"has {F.ATTRS_KEY}.distributed {_short(dist)}, not a JSON object"
        elif n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            what = f"has {F.ATTRS_KEY}.distributed.world_size {_short(n)}, not a positive int"
        elif not isinstance(dist.get("committed", False), bool):
            what = f"has {F.ATTRS_KEY}.distributed.committed {_short(dist.get('committed'))}, not a bool"
    if what is not None:
        raise StoreCorruptError(
            f"the root document zarr.json of {str(b)!r} {what}, so consolidate cannot tell whether its ranks were "
            "committed; nothing was changed. Run verify on it; if that zarr.json is not this capture's, move it "
            "away and consolidate again (the rank stores record their world size)")
    try:  # a root a newer activationscope wrote: its ranks and their commit are that version's to read
        V.check_format(attrs, store=b)
    except StoreCorruptError as e:
        raise StoreCorruptError(f"{e}; consolidate changed nothing") from None
    except StoreError as e:
        raise StoreError(f"{e} to commit its rank stores; nothing was changed") from None
    return attrs


def _short(value: Any) -> str:
    r = repr(value)
    return r if len(r) <= 120 else r[:120] + "..."


def _check_commit_record(b: Any, attrs: dict, dist: dict, ranks: list[int]) -> None:
    """Before the rank stores of a store whose root says ``committed`` are removed: the root
    is the record a commit writes (status ``complete``, ``distributed.ranks`` listing ranks 0
    .. world_size - 1), so a root whose flag alone was edited never deletes the rank stores
    that hold every row.

    Raises
    ------
    StoreCorruptError
        Another root; nothing was changed or removed.
    """
    n = dist.get("world_size")
    recorded = dist.get("ranks")
    listed = [e.get("rank") if isinstance(e, dict) else None for e in recorded] if isinstance(recorded, list) else None
    if attrs.get("status") == "complete" and isinstance(n, int) and listed == list(range(n)):
        return
    raise StoreCorruptError(
        f"the root document zarr.json of {str(b)!r} says distributed.committed true, but it is not the record of a "
        f"commit (status {_short(attrs.get('status'))}, distributed.ranks {_short(recorded)}; a commit writes status "
        f"'complete' and one entry per rank), while rank stores {[f'{r:05d}' for r in ranks]} remain under "
        f"{_ranks_dir(b)!r}; nothing was changed or removed. Set distributed.committed to false in that zarr.json (or "
        "move it away) and consolidate again")


def _refuse_held_ranks(b: Any, ranks: list[int], held: contextlib.ExitStack) -> None:
    """Take the writer lock of each of the rank stores ``ranks`` of the local store ``b``, kept
    in ``held`` (released when it closes: after the commit, which removes those stores); raise
    :class:`StoreError` when a writer still holds one (a local lock is held only by a live
    writer: flock, FORMAT.md section 7), whatever that rank store's root says: its close may
    still be running, or be cut short by a Ctrl-C (complete or not, it is that writer's until
    that close is called again), and nothing is read, written or removed under it meanwhile.
    The lock is taken, not only asked about: a writer of a rank store (a ``RankStore`` task
    resumed) starting after the question was asked was let in, and wrote into a rank store the
    commit was reading and then removed; it is refused now, as a second writer is.

    A rank store whose lock file cannot be taken for another cause (not a folder, a lock file
    that is no regular file) can be held by no writer either: only asked about, as before
    (the commit refuses it, or removes it, as it does any damaged rank store)."""
    if not isinstance(b, LocalBackend):
        return
    for r in ranks:
        path = rank_target(str(b), r)
        holder = None
        if Path(path).is_dir():
            try:
                held.enter_context(WriterLock(LocalBackend(path)))
                continue
            except StoreLockedError:
                holder = writer_holding(LocalBackend(path)) or "another process"
            except StoreError:
                holder = None
        if holder is None:
            holder = writer_holding(LocalBackend(path))
        if holder is not None:
            raise StoreError(f"rank {r} store {path!r} is still being written (its writer lock is held by {holder}): "
                             "wait for it to finish (a capture whose close a Ctrl-C cut short holds it until its "
                             "close() or tracker.remove() is called again in that process), then consolidate again; "
                             "nothing was written")


def _commit_ranks(b: Any, target: Any, storage_options: dict | None,
                  make_reduction: Callable[[str, str, dict], Any] | None, world_size: int | None,
                  verify: bool = True) -> dict:
    with contextlib.ExitStack() as held:  # (the rank stores' writer locks: _refuse_held_ranks)
        return _commit_ranks_held(b, target, storage_options, make_reduction, world_size, verify, held)


def _commit_ranks_held(b: Any, target: Any, storage_options: dict | None,
                       make_reduction: Callable[[str, str, dict], Any] | None, world_size: int | None,
                       verify: bool, held: contextlib.ExitStack) -> dict:
    t_start = time.monotonic()
    etag = _root_etag(b)
    raw = b.get("zarr.json")
    root_attrs: Any = _root_attrs_to_commit(b, raw) if raw else {}
    dist = root_attrs.get("distributed") or {}
    ranks = listed_rank_stores(b)
    _refuse_held_ranks(b, ranks, held)
    # FORMAT.md section 10, "Capturing a store again": rank stores of the run that captures this
    # root's store again make the commit a new run that replaces the store (its root first)
    again = capture_again_run_id(root_attrs, raw) if raw else None
    runs = _rank_runs(b, ranks) if again is not None else {}
    if again is not None and again not in runs.values():
        again = None
    if again is not None:
        n_again = _recorded_world_size(b, [r for r, x in runs.items() if x == again])
        dist = {**({"world_size": n_again} if n_again is not None else {}), "committed": False, "run_id": again}
    recorded = dist.get("world_size")
    if world_size is not None and recorded is not None and int(recorded) != world_size:
        state = "committed from" if dist.get("committed") else "captured by"
        where = "distributed.world_size in its root zarr.json"
        if again is not None:
            state, where = "captured again by", "rank_store.world_size in the zarr.json of its rank stores"
        raise StoreError(
            f"world_size={world_size} (CLI: --world-size {world_size}) disagrees with the store {str(b)!r}, which "
            f"was {state} {recorded} ranks ({where}); nothing was written. "
            f"Pass world_size={recorded} (CLI: --world-size {recorded}) or leave it out, or, if {world_size} is "
            f"right, capture the store again with RankStore(rank, {world_size}) on every task")
    if dist.get("committed"):
        if ranks:  # crashed while removing the rank stores: finish that
            _check_commit_record(b, root_attrs, dist, ranks)
        # (also what a removal killed midway leaves without a zarr.json: rank folders whose
        # zarr.json went first, an empty ranks/; _remove_ranks takes rank names only)
        _remove_ranks(b)
        _remove_temp_files(b)
        return {"n_ranks": int(dist.get("world_size", 0)), "n_samples": int(root_attrs.get("n_samples", 0)),
                "arrays": {}, "already_committed": True}
    expected = world_size or dist.get("world_size")
    # FORMAT.md section 10: under a root naming its run (distributed.run_id), rank stores of another run
    # (left by an overwrite killed before it removed them) are no part of the commit
    ranks, other = split_rank_stores_by_run(b, ranks, dist)
    inside = [r for r in other if expected is None or r < int(expected)]
    shown = f"{inside[:10]}"[:-1] + (f", ...] ({len(inside)} in all)" if len(inside) > 10 else "]")
    own_run = ranks_run_id(root_attrs.get("distributed"))
    own = [r for r in inside if again is not None and own_run is not None and runs.get(r) == own_run]
    if own:  # (an uncommitted root's capture, and an attempt to capture it again: never a mix)
        n_root = (root_attrs.get("distributed") or {}).get("world_size")
        paths = " ".join(rank_target(str(b), r) for r in ranks[:10]) + (" ..." if len(ranks) > 10 else "")
        remove = f"`rm -r {paths}`" if isinstance(b, LocalBackend) else f"every object under {paths}"
        raise StoreError(
            f"the rank stores under {_ranks_dir(b)!r} are of two captures of {str(b)!r}: {own[:10]} of the capture "
            f"its root names (run {own_run!r}, {n_root} ranks: distributed in its root zarr.json), and {ranks[:10]} of "
            f"an attempt to capture it again by {recorded if recorded is not None else 'other'} tasks (run {again!r}: "
            "rank_store.run_id and rank_store.world_size in their zarr.json); consolidate commits one capture, never "
            "a mix; nothing was written. Remove the rank stores of the one you do not keep (to commit the capture of "
            f"{n_root} ranks: {remove}; else capture the others again with overwrite=True), then consolidate again")
    if inside and again is not None:
        raise StoreError(
            f"rank store(s) {shown} under {_ranks_dir(b)!r} are not of the capture again of {str(b)!r} (run "
            f"{again!r}, rank_store.run_id in the zarr.json of the other rank stores) but of an earlier run: capture "
            "those ranks again with store_options overwrite=True, then consolidate again; nothing was written (the "
            "store reads as it was)")
    if inside:
        raise StoreError(
            f"rank store(s) {shown} under {_ranks_dir(b)!r} were written under another run than the root's "
            f"(distributed.run_id {ranks_run_id(dist)!r}, rank_store.run_id in their zarr.json): an overwrite=True "
            "killed before it removed them, or a capture into the store it replaced; none of their rows is this "
            "run's. Rerun the capture with store_options resume=True (those ranks capture again) or "
            "overwrite=True; nothing was written")
    if not ranks:
        if raw and not dist:  # a store of one process: nothing was ever split into rank stores
            raise StoreError(f"{str(b)!r} is a store written by one process (its root zarr.json records no ranks) "
                             f"and there are no rank stores under {_ranks_dir(b)!r}; it needs no consolidate: open "
                             "it as it is (activationscope info / verify)")
        raise StoreError(f"no rank stores under {_ranks_dir(b)!r}; nothing to commit")
    source = ""
    if expected is None:  # no root to say it: the world size every rank store records
        expected = _recorded_world_size(b, ranks)
        source = "" if expected is None else " (the world size the rank stores record: rank_store.world_size)"
    if ranks != list(range(len(ranks))) or (expected is not None and len(ranks) != int(expected)):
        n = int(expected) if expected is not None else ranks[-1] + 1
        present = set(ranks)
        n_missing = n - len(present & set(range(min(n, ranks[-1] + 1))))
        missing = list(itertools.islice((r for r in range(n) if r not in present), 10))  # (n may be 10**9)
        extra = [r for r in ranks if r >= n]
        why = []
        if missing:
            shown = str(missing) if n_missing <= len(missing) else f"{str(missing)[:-1]}, ...] ({n_missing} in all)"
            why.append(f"rank(s) {shown} are missing: capture (or resume) them, then consolidate again")
        if extra:
            paths = [rank_target(str(b), r) for r in extra]
            hint = (f", or, if the capture had {ranks[-1] + 1} ranks, pass world_size={ranks[-1] + 1} (CLI: "
                    f"--world-size {ranks[-1] + 1})" if world_size is not None and not dist.get("world_size") else "")
            why.append(f"rank(s) {extra} are beyond the {n} ranks of this capture (0..{n - 1}): move the rank "
                       f"store(s) {paths} away if they belong to another capture{hint}")
        raise StoreError(f"rank stores under {_ranks_dir(b)!r} are ranks {ranks}, expected 0..{n - 1}{source}; "
                         + "; ".join(why) + "; nothing was written")
    local = isinstance(b, LocalBackend)
    stores = [Store(b.root / RANKS_DIR / f"{r:05d}") if local else
              Store(rank_target(target, r), storage_options=storage_options) for r in ranks]
    for r, st in enumerate(stores):
        if st.status != "complete":  # (none is held by a writer: _refuse_held_ranks)
            raise StoreError(f"rank {r} store {st.path!r} is {st.status!r}: resume that rank (resume=True) so it "
                             "completes, then commit")
    _check_rank_world_sizes(b, stores, expected)
    for st in stores:  # (each one's n_samples is its sample table's rows: checked at its open)
        if not isinstance(st.attrs.get("model") or {}, dict):
            raise StoreCorruptError(f"rank store {st.path!r}: the model record of its zarr.json is not a JSON object; "
                                    "the rank store is damaged: capture that rank again; nothing was written")
    model = _check_same(stores, "the model (class, state dict sha256)",
                        lambda s: (s.attrs.get("model") or {}).get("state_dict_sha256"))
    del model
    # a rank whose share of the data was empty captured no forward: it adds no row (and no state)
    used = [r for r, s in enumerate(stores) if _captured(s)]
    if not used:
        raise StoreError(f"none of the {len(stores)} rank stores under {_ranks_dir(b)!r} captured a forward: there "
                         "is no row to commit; nothing was written. Check that the ranks' data yielded batches")
    held = [stores[r] for r in used]
    _check_same_hook_points(held, used)
    _check_same(held, "the capture policy", _capture_policy, used)
    hps = list(held[0].hook_points)  # (capture order, as a store of one process lists them)
    layout_keys = ("row_kind", "feature_shape", "dtype", "storage_dtype", "chunk_rows", "shard_rows", "compression")
    shard_rows: dict[str, int] = {}
    metas: dict[str, dict] = {}
    for hp in hps:
        metas_hp = [{k: s.attrs["arrays"][hp].get(k) for k in layout_keys} for s in held]
        for r, m in zip(used[1:], metas_hp[1:]):
            if m != metas_hp[0] and all(m[k] == metas_hp[0][k] for k in layout_keys if k != "feature_shape"):
                why, fix = other_feature_shape(hp, r, m["feature_shape"], used[0], metas_hp[0]["feature_shape"])
                raise StoreError(f"{why}; their rows cannot be one array, so these rank stores cannot be committed "
                                 f"as they are; nothing was written. Fix: {fix}")
        meta = _check_same(held, f"the layout of hook point {hp!r}",
                           lambda s: {k: s.attrs["arrays"][hp].get(k) for k in layout_keys}, used)
        kind, S = meta["row_kind"], int(meta["shard_rows"])
        if shard_rows.setdefault(kind, S) != S:
            raise StoreError(f"arrays of row kind {kind!r} have shard_rows {shard_rows[kind]} and {S} ({hp!r}); a "
                             "multi-rank capture needs one shard_rows per row kind (store_options shard_rows=...)")
        metas[hp] = meta
    # every rank shard that is linked, copied or re-chunked is checked before anything is written
    manifests = {hp: _check_rank_shards(hp, metas[hp], stores, local, verify) for hp in hps}
    states_read = _check_states_fit(stores)
    # everything else that can refuse the commit, before its first write: the row tables
    # against the arrays' rows, and every reduction merged from the ranks' states
    tables = _rank_row_tables(stores, hps, metas)
    merged = _merged_reductions(stores, make_reduction, states_read)
    # the programs of custom reductions, kept as rank 0 holds them: read (and their crc32c checked)
    # now, so a damaged one refuses the commit before its first write, never committed with a new crc32c
    scripts = {(hp, name): held[0].reduction_script(hp, name) for hp, by_name in merged.items() for name in by_name}
    if again is not None:
        # the new run's root first, over the old store's (as every overwrite, FORMAT.md section 10):
        # from here on the old store's objects are no part of the store, whatever is left of them
        # when the process dies (a rerun of the commit continues under this root)
        replaced = root_attrs.get("run_id")
        root_attrs = _uncommitted_root_attrs(len(stores), again, F.utc_now(), again)
        root_attrs["distributed"]["replaces_run"] = replaced if isinstance(replaced, str) else None
        _put_root(b, _root_doc(root_attrs), etag)
        etag = _root_etag(b)
    if "replaces_run" in root_attrs.get("distributed", {}):
        # (also a rerun of such a commit killed after that root) what lies under acts/, rows/ and
        # reductions/ is the replaced store's, or this commit's own, which it writes again
        _remove_store_objects(b)
    arrays: dict[str, dict] = {}
    summary: dict[str, dict] = {}
    segmented = False  # a manifest with segments (FORMAT.md section 5): format version 4
    for hp in hps:
        meta = metas[hp]
        kind, S = meta["row_kind"], int(meta["shard_rows"])
        path = held[0].attrs["arrays"][hp]["path"]
        ns = [_n_rows(s, hp) for s in stores]
        fulls = [n // S for n in ns]
        F_total = sum(fulls)
        nd = len(meta["feature_shape"])
        staging, lock_fd = (None, None) if local else make_staging_folder("acs-commit-", str(b))
        try:
            array_dir = b.root / path if local else Path(staging) / path
            manifest: list[dict] = []
            base = 0
            for r, st in enumerate(stores):
                recs = manifests[hp][r]
                for k in range(fulls[r]):
                    rec = recs[k]
                    if local:
                        src = st._backend.path(F.shard_key(path, k, nd))
                        key = F.shard_key(path, base + k, nd)
                        dst = b.path(key)  # (a link in the store's folders that leaves it is refused)
                        b._make_parent(dst, key)
                        _link_or_copy(src, dst)
                    else:  # object storage: a server-side copy, no bytes through this process
                        src = _remote_path(b, f"{RANKS_DIR}/{r:05d}/{F.shard_key(path, k, nd)}")
                        b._sync(b.store.fs._copy(src, _remote_path(b, F.shard_key(path, base + k, nd))))
                    manifest.append({**rec, "shard": base + k, "key": F.shard_key(path, base + k, nd),
                                     "rows_end": (base + k + 1) * S})
                base += fulls[r]
            # views of the rank shards (mapped, local): the one copy is the concatenation
            tails = [st._read_rows(hp, f * S, n) for st, f, n in zip(stores, fulls, ns) if hp in st.hook_points]
            tail = torch.cat(tails) if tails else torch.empty(0)
            for stale in list(b.list(f"{path}/c/")):  # shards of an earlier, crashed commit past the full ones
                try:
                    if int(stale[len(path) + 3:].split("/")[0]) >= F_total:
                        b.delete(stale)
                except ValueError:
                    continue
            recs = _TailWriter(array_dir, held[0].attrs["arrays"][hp], F_total,
                               b.root if local else Path(staging)).write(tail) if len(tail) else []
            for rec in recs:
                if not local:
                    key = F.shard_key(path, int(rec["shard"]), nd)
                    b.put_file(key, Path(staging) / key)
                manifest.append({"shard": int(rec["shard"]), "key": F.shard_key(path, int(rec["shard"]), nd),
                                 "rows_end": int(rec["rows_end"]), "file_bytes": int(rec["file_bytes"]),
                                 "chunks": [[int(j), int(o), int(nb), int(c)] for (j, o, nb, c) in rec["chunks"]]})
        finally:  # also when a write fails: the tails written there are of no use
            if staging is not None:
                remove_staging_folder(staging, lock_fd)
        n_total = sum(ns)
        follows = all(bool(s.attrs["arrays"][hp].get("follows_row_table", True)) for s in held)
        # every full shard is committed by this commit's root (written last; a rerun writes the same
        # segments again): each block of MANIFEST_SEGMENT_SHARDS is sealed into a segment, written first
        man_doc, segment_docs, segments, _sealed = F.manifest_documents(
            hp, meta["chunk_rows"], S, f"{path}/manifest.json", [], {int(r["shard"]): r for r in manifest}, n_total // S)
        for key, data in segment_docs.items():
            b.set(key, data)
        b.set(f"{path}/manifest.json", man_doc)
        segmented = segmented or bool(segments)
        attrs = {F.ATTRS_KEY: {"hook_point": hp, "dtype": meta["dtype"], "row_kind": kind}}
        doc = F.array_document(n_rows=n_total, feature_shape=tuple(meta["feature_shape"]), dtype=meta["dtype"],
                               chunk_rows=int(meta["chunk_rows"]), shard_chunks=S // int(meta["chunk_rows"]),
                               compression=meta["compression"], attributes=attrs,
                               dimension_names=F.dimension_names(hp, kind, follows, nd))
        b.set(f"{path}/zarr.json", F.dumps(doc))
        arrays[hp] = {**held[0].attrs["arrays"][hp], "n_rows": n_total, "follows_row_table": follows}
        summary[hp] = {"n_rows": n_total, "rank_rows": ns, "linked_shards": F_total, "copied_rows": int(len(tail)),
                       "copied_shards": len(recs), "copied_bytes": sum(int(r["file_bytes"]) for r in recs)}
    b.set("acts/zarr.json", F.dumps(F.group_document()))
    # row tables: same order (full shards of every rank, then tails), a rank column
    row_tables = {}
    import pyarrow as pa
    import pyarrow.parquet as pq

    for kind in ROW_KINDS:
        S = shard_rows.get(kind)
        if S is None:
            heads, tails = tables[kind], []
        else:
            heads = [t.slice(0, (t.num_rows // S) * S) for t in tables[kind]]
            tails = [t.slice((t.num_rows // S) * S) for t in tables[kind]]
        parts = [t for t in heads + tails if t.num_rows]
        info = {"parts": [], "n_rows": 0, "columns": []}
        if parts:
            table = pa.concat_tables(parts, promote_options="default")
            sink = io.BytesIO()
            pq.write_table(table, sink)
            data = sink.getvalue()
            key = f"rows/{kind}/part-000000.parquet"
            b.set(key, data)
            info = {"parts": [key], "n_rows": table.num_rows, "columns": list(table.column_names),
                    "crc32c": {key: int(_native.load().crc32c(data))}}
        row_tables[kind] = info
    # reductions: every rank's float64 state merged (Chan et al. for moments), results written
    reductions: dict[str, dict] = {}
    for hp, by_name in merged.items():
        node = F.node_name(hp)
        b.set("reductions/zarr.json", F.dumps(F.group_document()))
        b.set(f"reductions/{node}/zarr.json", F.dumps(F.group_document({F.ATTRS_KEY: {"hook_point": hp}})))
        entries_out = reductions.setdefault(hp, {})
        for name, (kind, options, result) in by_name.items():
            main = kind if kind in result else ("value" if "value" in result else None)
            if main is None and len(result) == 1:
                main = next(iter(result))
            feat = tuple(arrays[hp]["feature_shape"]) if hp in arrays else None
            for key, value in result.items():
                full = name if key == main else f"{name}.{key}"
                path = f"reductions/{node}/{full}"
                t = torch.as_tensor(value).detach().to("cpu").contiguous()
                dname = F.dtype_name(t.dtype)
                dims = F.reduction_dimension_names(hp, full, key, kind, options, tuple(t.shape), feat)
                crcs = _write_small_array(b, path, t, {"hook_point": hp, "reduction": name, "dtype": dname}, dims)
                entries_out[full] = {"path": path, "reduction": name, "kind": kind, "dtype": dname,
                                     "shape": list(t.shape), "crc32c": crcs}
            src_script = (held[0].attrs.get("reductions") or {}).get(hp, {}).get(name, {}).get("script")
            if src_script:
                data = scripts.get((hp, name))
                if data is not None and name in entries_out:
                    b.set(src_script, data)
                    entries_out[name]["script"] = src_script
                    entries_out[name].setdefault("crc32c", {})[src_script] = int(_native.load().crc32c(data))
    first = held[0].attrs
    attrs = {
        "format": {"name": F.FORMAT_NAME, "version": F.SEGMENTS_VERSION if segmented else DISTRIBUTED_FORMAT_VERSION},
        "status": "complete",
        "created": root_attrs.get("created") or first.get("created"),
        **({"run_id": root_attrs["run_id"]} if isinstance(root_attrs.get("run_id"), str) else {}),
        "updated": F.utc_now(),
        "library": _library_versions(),
        "model": first.get("model"),
        "capture_config": first.get("capture_config", {}),
        "storage_dtype": first.get("storage_dtype"),
        "provenance": _ranks_provenance(stores),
        "n_samples": sum(s.n_samples for s in stores),
        "n_batches": sum(int(s.attrs.get("n_batches", 0)) for s in stores),
        "arrays": arrays,
        "row_tables": row_tables,
        "reductions": reductions,
        "distributed": {
            "world_size": len(stores), "committed": True, "shard_rows": shard_rows,
            "row_order": "full shards of rank 0, 1, ..., then the tails of rank 0, 1, ... (FORMAT.md section 10)",
            "ranks": [{"rank": r, "n_samples": s.n_samples, "n_batches": int(s.attrs.get("n_batches", 0)),
                       "n_rows": {hp: _n_rows(s, hp) for hp in hps}} for r, s in enumerate(stores)],
        },
    }
    for st in stores:
        st.close()
    _put_root(b, _root_doc(attrs), etag)  # the commit point
    t_commit = time.monotonic() - t_start
    t0 = time.monotonic()
    _remove_ranks(b)
    _remove_temp_files(b)
    return {"n_ranks": len(stores), "n_samples": attrs["n_samples"], "arrays": summary,
            "commit_s": t_commit, "cleanup_s": time.monotonic() - t0, "replaced": again is not None}


# ---------------------------------------------------------------------------- process group
def init_process_group(backend: str = "gloo", **kwargs: Any) -> None:
    """``torch.distributed.init_process_group`` that also works after a ``torchrun`` restart.

    Under ``torchrun`` (``--standalone`` or any c10d rendezvous) the workers of every attempt
    share the agent's TCPStore, which keeps the keys of the attempt before: after
    ``--max-restarts`` restarts the workers, a new worker reads the *dead* worker's gloo
    address from them and fails with "Gloo connectFullMesh failed ... Connection refused"
    (torch 2.13). This connects to that store under a prefix of the attempt
    (``TORCHELASTIC_RESTART_COUNT``), so every attempt meets in fresh keys. Outside
    ``torchrun``'s shared store (no ``TORCHELASTIC_USE_AGENT_STORE=True``, or ``store=`` /
    ``init_method=`` given), it is plain ``init_process_group``. The alternative without
    code: launch with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (each attempt gets a new store).

    It imports ``torch.distributed.nn`` first: imported after the group exists, that module
    keeps the group alive past ``destroy_process_group`` (see :func:`release_destroyed_groups`).

    Parameters
    ----------
    backend : str, default "gloo"
        ``"gloo"`` (CPU) or ``"nccl"`` (GPUs).
    **kwargs
        Passed to ``torch.distributed.init_process_group`` (``timeout``, ``device_id``...).
    """
    import datetime

    import torch.distributed as dist

    if dist.is_available():  # before the group exists (see release_destroyed_groups)
        import torch.distributed.nn  # noqa: F401
    env = os.environ
    shared = env.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and "MASTER_ADDR" in env and "MASTER_PORT" in env
    if not shared or "store" in kwargs or "init_method" in kwargs:
        dist.init_process_group(backend, **kwargs)
        return
    timeout = kwargs.get("timeout") or datetime.timedelta(minutes=10)
    base = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False, timeout=timeout)
    store = dist.PrefixStore(f"activationscope/attempt-{env.get('TORCHELASTIC_RESTART_COUNT', '0')}", base)
    dist.init_process_group(backend, store=store, rank=int(env["RANK"]), world_size=int(env["WORLD_SIZE"]), **kwargs)


def release_destroyed_groups(module: types.ModuleType | None = None) -> list[str]:
    """Drop the references that ``torch.distributed.nn.functional`` keeps to destroyed process groups.

    That module's functions take ``group=group.WORLD`` as a default argument, evaluated when
    it is first imported: imported after ``init_process_group`` (``transformers`` 5 imports
    it from ``from_pretrained`` through its FSDP integration, torch 2.13), they hold the
    default group, so ``destroy_process_group`` no longer destroys it and its gloo threads
    run on. The last collective's work (e.g. the ranks' outcome exchange at the end of a
    capture) can then be freed on a gloo thread while the interpreter finalizes; freeing its
    tensors takes the GIL, CPython ends that thread with ``pthread_exit``, and the forced
    unwinding through the work's noexcept destructor aborts the rank ("terminate called
    without an active exception", SIGABRT) after everything was written. Run at interpreter
    exit (registered when this module is imported), this replaces every such default that
    is a process group other than the current default group by None (the default group, as
    when the module is imported before any group exists), so a destroyed group is destroyed
    then, its threads joined while the interpreter is still whole.
    :func:`init_process_group` imports the module before it creates the group, so the
    defaults never hold it.

    Parameters
    ----------
    module : module, optional
        The module whose functions' defaults are released; default
        ``torch.distributed.nn.functional`` when it is imported (else nothing to do).

    Returns
    -------
    list of str
        The names of the functions whose defaults were changed.
    """
    module = module if module is not None else sys.modules.get("torch.distributed.nn.functional")
    if module is None:
        return []
    import torch.distributed as dist

    if not dist.is_available():
        return []
    live = dist.group.WORLD if dist.is_initialized() else None

    def stale(value: Any) -> bool:
        return isinstance(value, dist.ProcessGroup) and value is not live

    changed = []
    for name, fn in list(vars(module).items()):
        if not isinstance(fn, types.FunctionType):
            continue
        positional = fn.__defaults__ is not None and any(stale(d) for d in fn.__defaults__)
        keyword = fn.__kwdefaults__ is not None and any(stale(d) for d in fn.__kwdefaults__.values())
        if positional:
            fn.__defaults__ = tuple(None if stale(d) else d for d in fn.__defaults__)
        if keyword:
            fn.__kwdefaults__ = {k: None if stale(d) else d for k, d in fn.__kwdefaults__.items()}
        if positional or keyword:
            changed.append(name)
    return changed


atexit.register(release_destroyed_groups)


# ---------------------------------------------------------------------------- the capture side
class RankStore:
    """``store_options={"process_group": ...}`` for a rank without a process group (Slurm array task, Ray task).

    The capture writes rank ``rank`` of ``world_size`` into ``<store>/ranks/<rank>`` and
    commits nothing; once every rank store is complete, ``activationscope consolidate STORE``
    (or :func:`activationscope.store.ranks.commit_ranks`) commits them into one store.

    On a store that is already complete (committed, or written by one process), or uncommitted
    with another world size, every task needs ``store_options`` ``overwrite=True`` to capture it
    again: each task writes its rank store as a new run, the store reads as it is until the
    commit replaces it with that run (store/FORMAT.md section 10). Without it the task raises
    StoreExistsError (StoreError for another world size) before its first forward.

    Parameters
    ----------
    rank : int
        0 .. world_size - 1.
    world_size : int
        Number of rank stores the store will hold.

    Raises
    ------
    ArgumentValueError
        ``world_size`` is not a positive int, or ``rank`` not an int in
        ``0 .. world_size - 1`` (a bool or a float is no int).
    """

    def __init__(self, rank: int, world_size: int) -> None:
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ArgumentValueError(f"world_size must be a positive int, got {world_size!r}")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ArgumentValueError(f"rank must be an int in 0..{world_size - 1}, got {rank!r}")
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


#: Default of ``store_options={"rank_wait_s": ...}``: seconds a rank of a multi-rank capture
#: waits for rank 0 to prepare the store, and at the end for the other ranks to finish their
#: share and for rank 0's commit (the timeout of the group of those waits): 30 minutes.
RANK_WAIT_S = 30 * 60
#: The former name of :data:`RANK_WAIT_S`.
OUTCOME_WAIT_S = RANK_WAIT_S


def _check_rank_wait_s(value: Any) -> float:
    """``rank_wait_s`` as a float, once it is a positive finite number of seconds."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ArgumentTypeError(
            f"store_options rank_wait_s must be a positive finite number of seconds, got {value!r}; e.g. "
            f"rank_wait_s={RANK_WAIT_S} (the default: 30 minutes)")
    if not math.isfinite(value) or value <= 0:
        raise ArgumentValueError(
            f"store_options rank_wait_s must be a positive finite number of seconds, got {value!r}; e.g. "
            f"rank_wait_s={RANK_WAIT_S} (the default: 30 minutes)")
    return float(value)


class RankSession:
    """One rank's part of a multi-rank capture (see the module docstring)."""

    def __init__(self, group: Any, rank: int, world_size: int, root: str, standalone: bool = False,
                 wait_s: float = RANK_WAIT_S) -> None:
        self.group, self.rank, self.world_size, self.root = group, rank, world_size, root
        self.standalone = standalone
        #: the timeout, in seconds, of the group of the waits (``store_options`` ``rank_wait_s``)
        self.wait_s = wait_s
        #: keys of this capture in the default group's store: each rank sets ``<prefix>/<rank>``
        #: when it reaches the end (:meth:`_finish`), so that a wait that times out names the
        #: ranks that did not (None: no such store)
        self._arrival: tuple[Any, str] | None = None
        #: a task capturing the store again (:func:`_capture_again`): its rank store is of a new run
        self.again = False
        #: the run the root names (``distributed.run_id``), recorded by this rank's store
        self.run_id: str | None = None
        self.summary: dict | None = None
        self.storage_options: dict | None = None
        #: ``time.monotonic()`` when this rank's store was closed, and the seconds spent after
        #: it: waiting for the other ranks' outcome, and (rank 0) committing.
        self.timings: dict[str, float] = {}
        #: the group of the waits (rank 0's preparation in :meth:`writer_options`, the exchanges
        #: at the end in :meth:`finish`): a gloo group of the default group's ranks whose timeout
        #: is ``wait_s``, made by :meth:`writer_options` before the preparation (None: the
        #: default group, when that gloo group could not be made)
        self._wait_group: Any = None
        #: rank 0, local ``overwrite=True``: the folder the old store was moved into
        #: (``.<name>.replaced-<hex>``, FORMAT.md section 7) until the ranks' commit (settled by
        #: :meth:`_settle_aside`); one entry at most
        self._aside: list[Path] = []
        #: the old store was put back (the ranks committed nothing): every rank knows it after the close
        self.put_back = False
        #: rank 0, local store: the store's writer lock, held from its preparation of the store
        #: to the end of its commit (and of the settling of ``_aside``); one entry at most
        self._held: list[WriterLock] = []

    def _release_held(self) -> None:
        """Rank 0: release the store's writer lock held since the preparation (nothing when none)."""
        while self._held:
            self._held.pop().release()

    def _settle_aside(self, committed: bool) -> str | None:
        """Rank 0, local ``overwrite=True``: once the ranks' commit is written (``committed``),
        delete the old store moved aside (its root document first, as one process does), under
        the store's writer lock as a one-process writer's close waits for that delete (readers
        then say a running writer deletes the folder): the lock held since the preparation
        (``_held``, a local store), else taken now (when another writer took the store since the
        commit, the delete goes on without it); else, every rank's store closed, put it back
        whole in place of the new run's root and rank stores, under the store's writer lock
        (not when the held lock no longer holds the store at the path: what is there is
        never removed). Returns None when there was nothing to settle or it went well, else a sentence
        naming the folder that still holds the old store."""
        if not self._aside:
            return None
        aside = self._aside.pop()
        held = self._held[0] if self._held else None  # (held since the preparation: released by the caller)
        if committed:
            with contextlib.suppress(OSError):
                (aside / "zarr.json").unlink()
            lock: WriterLock | None = None
            if held is None:
                try:
                    lock = WriterLock(resolve(self.root, storage_options=self.storage_options)).acquire()
                except Exception:  # noqa: BLE001 - (another writer holds the store now): the delete goes on all the same
                    lock = None
            try:
                _AsideDelete(aside).finish(self.root)  # (warns, naming the folder, when part of it stays)
            finally:
                if lock is not None:
                    lock.release()
            return None
        b = resolve(self.root, storage_options=self.storage_options)
        try:
            if held is not None:
                why = held.lost()
                if why is not None:  # (what is at the path now is not this capture's: never removed)
                    raise StoreError(f"the store at the path is no longer the one rank 0 prepared: {why}")
                b.restore_aside(aside)
            else:
                with WriterLock(b):
                    b.restore_aside(aside)
        except Exception as e:  # noqa: BLE001 - said by every rank
            return _put_back_failed(aside, self.root, e)
        self.put_back = True
        return None

    def _gather(self, obj: Any, group: Any = None) -> list:
        import torch.distributed as dist

        out: list = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group if group is None else group)
        return out

    def writer_options(self, store_options: dict) -> tuple[str, dict]:
        """Prepare the root (rank 0), agree on it, and return this rank's store and options."""
        
        opts = dict(store_options)
        overwrite, resume = bool(opts.pop("overwrite", False)), bool(opts.pop("resume", False))
        if opts.get("shard_bytes") is not None:
            raise ArgumentValueError("a multi-rank capture takes store_options shard_rows= (rows per shard, the same on every "
                             "rank), not shard_bytes=")
        opts.setdefault("shard_rows", F.MAX_SHARD_ROWS)
        if self.standalone:  # no process group: the first task makes the root, nobody clears it
            so = opts.get("storage_options")
            b = resolve(self.root, storage_options=so)
            if b.get("zarr.json") is None:
                try:
                    prepare_root(self.root, world_size=self.world_size, storage_options=so)
                except StoreExistsError:
                    # another task made it first; but a local folder with no root that holds a
                    # store an overwrite left split, or entries of the user's, is no store to join
                    if b.get("zarr.json") is None and isinstance(b, LocalBackend) and (
                            b.moved_aside_hint() or _foreign_names(p.name for p in b.root.iterdir())):
                        raise
            again = _capture_again(b, self.root, self.rank, self.world_size, overwrite, resume)
            self.run_id = _root_ranks_run(b) if again is None else again
            self.again = again is not None
            target = rank_target(self.root, self.rank)
            exists, other = self._rank_store_found(target, so)
            opts["resume"], opts["overwrite"] = resume and exists, (overwrite and exists) or other
            return target, opts
        if self.group is None:
            # rank 0 prepares the root while the others wait (an overwrite=True of a large old
            # store on object storage deletes for a long time), and a rank whose share ends first
            # waits at the end for the slowest one (uneven data: hours, maybe): the default
            # group's timeout (30 minutes for gloo, 10 for nccl) would end either wait with a
            # timeout of every rank, so both go through a group of their own, made before the
            # preparation (a rank that dies closes its connections: noticed at once)
            import datetime

            import torch.distributed as dist

            try:
                self._wait_group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=self.wait_s))
            except Exception as e:  # noqa: BLE001 - e.g. gloo finds no network interface (nccl clusters)
                warn_at_caller(
                    f"rank {self.rank}: the gloo group of the long waits of a multi-rank capture could not be made "
                    f"({type(e).__name__}: {e}); the waits (rank 0 preparing the store, the ranks waiting for each "
                    "other and for rank 0's commit at the end) go through the default group instead, and end with "
                    "its timeout (30 minutes for gloo, 10 for nccl by default). Set GLOO_SOCKET_IFNAME to the "
                    "network interface the ranks reach each other by (e.g. GLOO_SOCKET_IFNAME=eth0), or pass a "
                    "longer timeout= to init_process_group",
                    CaptureWarning,
                )
        try:
            error = run_id = None
            if self.rank == 0:
                try:
                    run_id = _prepare(self.root, self.world_size, overwrite, resume, opts.get("storage_options"),
                                      self._aside, self._held)
                except Exception as e:  # noqa: BLE001 - every rank must learn it
                    error = e
            try:
                seen = self._gather({"root": self.root if "://" in self.root else os.path.abspath(self.root),
                                     "error": None if error is None else f"{type(error).__name__}: {error}",
                                     "run_id": run_id, "token": uuid.uuid4().hex if self.rank == 0 else None},
                                    self._wait_group)
            except Exception as e:
                if self.rank == 0 and error is not None:
                    raise error from e
                raise StoreError(
                    f"rank {self.rank}: the ranks of the multi-rank capture into {self.root!r} did not all meet at its "
                    f"start within {self._wait_text()} ({type(e).__name__}: {e}); nothing was captured. Rank 0 "
                    "prepares the store meanwhile (an overwrite=True of a large store on object storage may take "
                    "longer: give every rank a longer store_options rank_wait_s, in seconds), or a rank did not "
                    "start its capture (hung, or died: see its log)"
                ) from e
            roots = {s["root"] for s in seen}
            if len(roots) != 1:
                raise StoreError(f"the ranks of a multi-rank capture must name one store, got {sorted(roots)}; pass "
                                 "process_group=False to give each rank its own store")
            if error is not None:
                raise error
            if seen[0]["error"] is not None:
                raise StoreError(f"rank 0 could not prepare the store {self.root!r}: {seen[0]['error']}")
        except BaseException:  # (every rank raises here alike: nothing more to exchange)
            self._release_wait_group()
            try:
                if self._aside:  # (rank 0: no rank writes; the old store goes back)
                    self.storage_options = opts.get("storage_options")
                    failed = self._settle_aside(committed=False)
                    if failed is not None:
                        warn_at_caller(f"store {self.root!r}: {failed}", RuntimeWarning)
            finally:
                self._release_held()
            raise
        try:  # (from here on a failure, or a Ctrl-C, is told to the other ranks and lets go of the lock)
            target = rank_target(self.root, self.rank)
            self.storage_options = opts.get("storage_options")
            self.run_id = seen[0].get("run_id")
            self._arrival = _arrival_keys(seen[0]["token"])
            exists, other = self._rank_store_found(target, opts.get("storage_options"))
        except BaseException as e:
            self.fail(e)
            raise
        opts["resume"] = resume and exists
        opts["overwrite"] = overwrite or (not resume and exists) or other
        return target, opts

    def fail(self, exc: BaseException) -> None:
        """Tell the other ranks that this rank failed before its capture started (its rank
        store not opened, or discarded: ``exc`` about to be raised to the caller) and release
        the wait group.

        The failure goes through the outcome exchange of :meth:`finish`, which the other ranks
        reach at the end of their capture: they then raise naming this rank and ``exc`` (and
        rank 0 commits nothing) instead of waiting for an outcome this rank would never send,
        up to ``rank_wait_s``, when the caller catches ``exc`` and its process goes on. This
        rank returns once they got there. Never raises.
        """
        if self.standalone:
            return
        try:
            self._finish(None, {}, exc, None, exc)
        except Exception:  # noqa: BLE001 - the caller raises exc
            pass
        finally:
            self._release_wait_group()
            self._release_held()
        if self.put_back:
            exc.add_note(f"the store that overwrite=True was to replace at {self.root!r} is put back as it was")

    def _not_arrived(self) -> list[int]:
        """The ranks that did not reach :meth:`_finish` (their key unset), in order; empty when
        unknown (no store of the default group)."""
        if self._arrival is None:
            return []
        store, prefix = self._arrival
        try:
            return [r for r in range(self.world_size) if not store.check([f"{prefix}/{r}"])]
        except Exception:  # noqa: BLE001 - the store is gone with the group: unknown
            return []

    def _wait_text(self) -> str:
        """The bound of the waits, for a message."""
        if self._wait_group is not None:
            return f"store_options rank_wait_s={self.wait_s:g} seconds"
        return "the timeout of the process group of the waits"

    def _release_wait_group(self) -> None:
        """Destroy the group of the waits (:meth:`writer_options`), when there is one."""
        if self._wait_group is not None:
            import torch.distributed as dist

            group, self._wait_group = self._wait_group, None
            dist.destroy_process_group(group)

    def _rank_store_found(self, target: str, storage_options: dict | None) -> tuple[bool, bool]:
        """``(exists, of another run)`` of this rank's store: one recording another run than the
        root's (FORMAT.md section 10) is never resumed but overwritten."""
        sub = resolve(target, storage_options=storage_options)
        if sub.get("zarr.json") is None:
            return False, False
        if self.run_id is not None and rank_store_run_id(sub) != self.run_id:
            return False, True
        return True, False

    def finish(self, w: Any, live: dict, exc: BaseException | None) -> None:
        """Close this rank's store, agree on the outcome, commit on rank 0 (see the module)."""
        error = None
        if exc is None:
            try:  # the reductions are in the rank store with their state (FORMAT.md section 6)
                w.close(status="complete")
                self.timings["closed_at"] = time.monotonic()
            except BaseException as e:  # noqa: BLE001 - the other ranks must hear of it
                if self.standalone and isinstance(e, KeyboardInterrupt) and _close_left_to_retry(w):
                    raise  # (no other rank to tell: the close called again commits what this one would have)
                error = e
                w.abort(e)
        else:
            w.abort(exc)
        mine = exc or error
        if self.standalone:
            if error is not None:
                raise error
            return
        try:
            self._finish(w, live, exc, error, mine)
        finally:
            self._release_wait_group()
            self._release_held()

    def _finish(self, w: Any, live: dict, exc: BaseException | None, error: BaseException | None,
                mine: BaseException | None) -> None:
        """:meth:`finish` once this rank's store is closed: the outcome exchange and rank 0's commit."""
        t0 = time.monotonic()
        if self._arrival is not None:
            try:
                self._arrival[0].set(f"{self._arrival[1]}/{self.rank}", "1")
            except Exception:  # noqa: BLE001 - only for the message of a wait that times out
                self._arrival = None
        try:
            seen = self._gather(None if mine is None else f"{type(mine).__name__}: {mine}", self._wait_group)
        except Exception as e:
            absent = self._not_arrived()
            if not absent:
                raise
            raise StoreError(
                f"multi-rank capture into {self.root!r}: rank(s) {absent} did not reach the end of the capture within "
                f"{self._wait_text()} (hung in user code or stuck in I/O, or died: {type(e).__name__}: {e}); nothing "
                "was committed. Every rank's committed rows are kept in its rank store: stop the run and rerun it "
                "with store_options resume=True to continue every rank, or run `activationscope consolidate STORE` "
                "once every rank store is complete. Ranks that finish their share further apart than that (uneven "
                "data) need a longer store_options rank_wait_s (in seconds, the same on every rank)"
                + (f". The store that overwrite=True replaces is still whole in {str(self._aside[0])!r}: run the "
                   "capture again with overwrite=True (it is put back if that capture commits nothing, deleted once it "
                   "commits), or move its entries back by hand (zarr.json last)" if self._aside else "")
            ) from e
        self.timings["wait_s"] = time.monotonic() - t0
        failed = {r: s for r, s in enumerate(seen) if s is not None}
        outcome = None
        if not failed and self.rank == 0:
            try:
                def make(hp: str, name: str, entry: dict) -> Any:
                    return live.get((hp, name))

                t0 = time.monotonic()
                # the ranks just wrote their shards with their crc32c: only the tails, read
                # anyway, are checked again (consolidate checks every shard)
                if self._held:  # (under the store's writer lock, held since the preparation)
                    self.summary = _commit_held(self.root, self._held[0], make_reduction=make,
                                                world_size=self.world_size, storage_options=self.storage_options)
                else:
                    self.summary = commit_ranks(self.root, make_reduction=make, world_size=self.world_size,
                                                storage_options=self.storage_options, verify=False)
                self.timings["commit_s"] = time.monotonic() - t0
            except BaseException as e:  # noqa: BLE001
                outcome = f"{type(e).__name__}: {e}"
        # rank 0, local overwrite=True with nothing committed (every rank's store is closed): the
        # old store goes back before the ranks learn the outcome, so that every rank's error says it
        committed = not failed and (outcome is None or _root_committed(self.root, self.storage_options))
        kept = None if committed else self._settle_aside(committed=False)
        try:
            outcomes = self._gather((outcome, self.put_back, kept), self._wait_group)
        except Exception as e:
            if self.rank == 0 or failed:
                raise
            raise StoreError(
                f"rank 0's commit of the multi-rank store {self.root!r} did not finish within {self._wait_text()} "
                f"({type(e).__name__}: {e}); it may still finish: `activationscope info STORE` says whether the store "
                "is complete; if not, run `activationscope consolidate STORE` (the rank stores are kept). Commits "
                "that take longer (a large store on object storage) need a longer store_options rank_wait_s (in seconds)"
            ) from e
        if committed and self.rank == 0:
            self._settle_aside(committed=True)  # (the ranks' commit is written: the old store goes)
        outcome, self.put_back, kept = outcomes[0]
        # (overwrite=True: the old store put back, or still in the folder aside)
        fate = (f"the store that overwrite=True was to replace at {self.root!r} is put back as it was (open_store "
                "reads it; no row of this capture is kept): once the cause is fixed, run the capture again with "
                "overwrite=True" if self.put_back else kept)
        if error is not None:
            if fate is not None:
                error.add_note(fate)
            raise error
        if exc is not None and fate is not None and not self.put_back:
            exc.add_note(fate)  # (put back: the capture's note says it, from put_back)
        if failed and exc is None:
            raise StoreError(
                f"multi-rank capture into {self.root!r}: rank(s) {sorted(failed)} failed "
                f"({'; '.join(f'rank {r}: {e}' for r, e in sorted(failed.items()))}); "
                "nothing was committed" + (f", and {fate}" if fate is not None else
                ". Fix what they report; every rank's committed rows are kept in its rank store: rerun with "
                "store_options resume=True to continue, or run `activationscope consolidate` once every rank store "
                "is complete")
            )
        if outcome is not None and exc is None:
            raise StoreError(f"rank 0 could not commit the multi-rank store {self.root!r}: {outcome}; " + (
                fate if fate is not None else
                "the rank stores are kept: run `activationscope consolidate STORE` to finish the commit"))


def _close_left_to_retry(w: Any) -> bool:
    """Whether the close of the rank store's writer ``w`` was cut short by a Ctrl-C before its
    commit (or before it began): a rank store of its own (``RankStore`` with no process group)
    is left so, for :meth:`RankWriter.close` called again to commit it."""
    return getattr(w, "_closing", None) is not None or not getattr(w, "_closed", True)


class RankWriter:
    """The writer of one rank of a multi-rank capture: its rank store's :class:`StoreWriter`,
    plus the end of the capture (states, outcome exchange, rank 0's commit).

    Made by :func:`open_capture_writer` (the writer ``ActivationScope(store=...)`` uses);
    ``summary`` holds rank 0's commit summary after a successful close.
    """

    def __init__(self, session: RankSession, inner: Any) -> None:
        self._session, self._inner = session, inner
        self._live: dict = {}
        self._done: bool | str = False  # closed or aborted (True), discarded ("discard")
        self._stopped_by: BaseException | None = None

    #: The merge of rank stores (commit_ranks) copies arrays only: every hook point keeps its own.
    supports_aliases = False
    #: A rank whose share of the data is empty closes a rank store without rows (the commit
    #: takes its hook points from the other ranks), where a one-process capture raises.
    may_be_empty = True

    def remove_if_unused(self) -> bool:
        """A rank store is the rank session's to keep or remove: never removed here."""
        return False

    def __getattr__(self, name: str) -> Any:  # open_array, add_batch, maybe_commit, n_samples_committed, ...
        value = getattr(self._inner, name)
        if inspect.ismethod(value):  # add_batch, maybe_commit (once per forward): found here once, then directly
            self.__dict__[name] = value
        return value

    @property
    def path(self) -> str:
        """Where this rank writes (its rank store)."""
        return self._inner.path

    @property
    def summary(self) -> dict | None:
        """Rank 0's commit summary (``commit_ranks``), None elsewhere or before the close."""
        return self._session.summary

    @property
    def timings(self) -> dict[str, float]:
        """After the close: ``closed_at`` (``time.monotonic()`` when this rank's store was
        complete), ``wait_s`` (waiting for every rank's outcome), ``commit_s`` (rank 0)."""
        return dict(self._session.timings)

    @property
    def rank(self) -> int:
        """This process's rank."""
        return self._session.rank

    @property
    def put_back(self) -> bool:
        """After the close of a local ``overwrite=True`` capture whose ranks committed nothing:
        True when rank 0 put the store it was to replace back whole (on every rank)."""
        return self._session.put_back

    def add_reductions(self, hook_point: str, name: str, reduction: Any, *args: Any, **kwargs: Any) -> None:
        """Store the reduction (result and state, FORMAT.md section 6) in the rank store; keep
        the object, so that rank 0's commit can merge custom reductions of its kind."""
        self._inner.add_reductions(hook_point, name, reduction, *args, **kwargs)
        self._live[(hook_point, name)] = reduction

    def close(self, status: str = "complete") -> None:
        """Close the rank store; every rank then learns the outcome and rank 0 commits once.

        Called again after a close cut short by Ctrl-C: the rank store's close is finished. A
        rank store of its own (``RankStore`` with no process group) whose close was cut short
        before its commit then commits, as :meth:`StoreWriter.close` called again does; one of
        a process group told the other ranks that it failed, and only lets go of its lock
        (``resume=True`` continues it). Called after a :meth:`discard` that a Ctrl-C cut short,
        it finishes that discard (:meth:`StoreWriter.discard`), committing nothing of this run.

        Raises
        ------
        StoreError
            This or another rank failed, or rank 0's commit failed (nothing committed; the
            rank stores stay for resume / ``consolidate``).
        """
        if self._done == "discard":  # (one a Ctrl-C cut short: finished, nothing of this run committed)
            self._inner.discard()
            return
        if self._done:
            if _close_left_to_retry(self._inner):  # (a rank store of its own: see _settle_inner)
                self._inner.close()
                self._session.timings["closed_at"] = time.monotonic()
                return
            self._settle_inner()
            return
        self._done = True
        exc = None if status == "complete" else self._stopped_by or StoreError("the capture on this rank stopped early")
        self._session.finish(self._inner, self._live, exc)

    def _settle_inner(self) -> None:
        """Called again after this rank's close, abort or discard: where a Ctrl-C (or several)
        cut short the rank store's close before it released its lock, the rank store's writer
        finishes that close (:meth:`StoreWriter.abort`: threads stopped, files cleaned, lock
        released; nothing more committed). Otherwise nothing. Never raises. (A rank store of its
        own, ``RankStore`` with no process group, whose close a Ctrl-C cut short before its
        commit, or before it began, is left so by that close: :meth:`close` called again
        commits it, as :meth:`StoreWriter.close` called again does; this gives it up.)"""
        if self._done == "discard":  # (a discard cut short, before the rank store's began or in it)
            self._inner.discard()
        elif getattr(self._inner, "_settling", False) or _close_left_to_retry(self._inner):
            self._inner.abort()

    def stopped_by(self, exc: BaseException) -> None:
        """The exception that stopped this rank's capture (the tracker gives it before
        ``close(status="incomplete")``): the other ranks raise naming it, so the cause is in
        every rank's log, not only in this rank's."""
        self._stopped_by = exc

    def discard(self, exc: BaseException | None = None) -> None:
        """Close the rank store without committing anything of this run (as
        :meth:`StoreWriter.discard`: a capture refused, or whose setup failed before its first
        forward); the other ranks learn that this rank failed, with ``exc``, and nothing is
        committed. Never raises.

        A Ctrl-C that cuts it short (before the rank store's discard began, or in it) leaves
        the discard to finish: called again (or :meth:`close`, :meth:`abort`), it puts a
        resumed rank store back as found, committing nothing of this run."""
        if self._done:
            self._settle_inner()
            return
        self._done = "discard"  # (from here on, close, abort or discard called again finish the discard)
        try:
            self._inner.discard()
        finally:
            self._session.fail(exc if exc is not None else StoreError("the capture on this rank was discarded"))

    def abort(self, exc: BaseException | None = None) -> None:
        """After an exception: the rank store keeps its commits; the others learn of it. Never raises."""
        if self._done:
            self._settle_inner()
            return
        self._done = True
        try:
            self._session.finish(self._inner, self._live, exc or StoreError("aborted"))
        except BaseException:  # noqa: BLE001 - never mask the caller's exception
            pass


def open_capture_writer(target: Any, *, process_group: Any = None, rank_wait_s: float = RANK_WAIT_S,
                        **options: Any) -> Any:
    """The writer of ``ActivationScope(store=...)`` captures (registered with the capture layer).

    A :class:`StoreWriter` for a one-process capture, or a :class:`RankWriter` writing this
    rank's rank store when ``torch.distributed`` is initialised with more than one rank (or
    ``process_group`` is a process group or a :class:`RankStore`).

    Parameters
    ----------
    target, **options
        As :class:`StoreWriter`.
    process_group : ProcessGroup, RankStore, False or None
        None: the default group when ``torch.distributed`` is initialised with more than one
        rank; False: never (one store per process); a process group; or a
        :class:`RankStore` (a task without a process group).
    rank_wait_s : float, default RANK_WAIT_S (1800 seconds)
        How long, in seconds, a rank of a multi-rank capture waits for rank 0 to prepare the
        store, at the end for every other rank to finish its share, then for rank 0's commit
        (the timeout of the gloo group of those waits; with a ``process_group`` of your own,
        or where that gloo group cannot be made, the timeout of the group they go through).
        Unused by a one-process capture or a :class:`RankStore` task.

    Raises
    ------
    StoreError
        At the close: a rank did not reach the end within ``rank_wait_s`` (the error names
        it), or rank 0's commit did not finish within it.

    Warns
    -----
    CaptureWarning
        The gloo group of the long waits (up to ``rank_wait_s``) of a capture on the
        default group could not be made (gloo found no network interface): the waits go
        through the default group, ending with its timeout; set ``GLOO_SOCKET_IFNAME`` or
        pass a longer ``timeout=`` to ``init_process_group``.
    """
    from .writer import StoreWriter

    if options.get("reductions_only") and _merges_reductions(target, process_group=process_group):
        raise CaptureError("a multi-rank capture cannot keep reductions only (reductions_only=True): its rank stores "
                           "are merged from their rows; capture a store per rank with process_group=False, or store "
                           "the rows; nothing was written")
    session = detect(process_group, target)
    if session is not None:
        session.wait_s = _check_rank_wait_s(rank_wait_s)
    if session is None:
        try:
            return StoreWriter(target, **options)
        except StoreLockedError as e:
            if process_group is not False or not _several_ranks():
                raise  # (one process of its own: the lock's holder is another program, as it says)
            # (under torchrun, every rank given one path with process_group=False: all but one are refused)
            raise StoreLockedError(
                f"{e}. With store_options process_group=False each process writes a store of its own: give each "
                "rank its own path (with its rank in it, e.g. f'runs/x.rank{torch.distributed.get_rank()}.zarr'), or "
                "leave process_group out to capture every rank of a torch.distributed run into this one store"
            ) from None
    fixed = {k: options.pop(k) for k in ("capture_config", "model", "storage_dtype") if k in options}
    prepared = session.writer_options(options)  # (its own errors let go of the wait group)
    try:  # (from the return on: a Ctrl-C, even at the unpacking, lets go of the lock rank 0 took)
        rank_target_, opts = prepared
        # a task capturing a complete store again writes its rank store under that store's root
        allowed = rank_stores_allowed(resolve(session.root, storage_options=opts.get("storage_options"))) \
            if session.again else contextlib.nullcontext()
        with allowed:
            inner = StoreWriter(rank_target_, **fixed, **opts)
    except BaseException as e:
        # (the other ranks go on capturing, then wait for this rank's outcome: it is sent now,
        # and the wait group let go of)
        session.fail(e)
        raise
    inner.rank_store = {"rank": session.rank, "world_size": session.world_size,  # checked by commit_ranks
                        **({"run_id": session.run_id} if session.run_id is not None else {})}
    return RankWriter(session, inner)


def _arrival_keys(token: str | None) -> tuple[Any, str] | None:
    """The default group's store and the key prefix of a capture (``token``: made by rank 0),
    or None where there is none (the waits then cannot name the ranks that did not arrive)."""
    if token is None:
        return None
    try:
        from torch.distributed import distributed_c10d

        return distributed_c10d._get_default_store(), f"activationscope/arrived/{token}"
    except Exception:  # noqa: BLE001 - a torch without it
        return None


def _several_ranks() -> bool:
    """Whether this process is one of several ranks: ``torch.distributed`` initialised with
    more than one, or a launcher's ``WORLD_SIZE`` (torchrun) above 1."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size() > 1
    try:
        return int(os.environ.get("WORLD_SIZE", "1")) > 1
    except ValueError:
        return False


def _capture_writer_signature() -> Any:
    import inspect

    from .writer import StoreWriter

    params = [p for n, p in inspect.signature(StoreWriter.__init__).parameters.items() if n != "self"]
    params.append(inspect.Parameter("process_group", inspect.Parameter.KEYWORD_ONLY, default=None))
    params.append(inspect.Parameter("rank_wait_s", inspect.Parameter.KEYWORD_ONLY, default=RANK_WAIT_S))
    return inspect.Signature(params)


def _check_capture_writer_options(*, process_group: Any = None, rank_wait_s: float = RANK_WAIT_S,
                                  **options: Any) -> None:
    """Check ``store_options`` values as :meth:`StoreWriter.check_options`, that
    ``process_group`` is one of the values it takes (whether the group works is learnt when the
    writer opens) and that ``rank_wait_s`` is a positive number of seconds."""
    _check_rank_wait_s(rank_wait_s)
    from .writer import StoreWriter

    if not (process_group is None or process_group is False or isinstance(process_group, RankStore)
            or _is_process_group(process_group)):
        raise ArgumentTypeError(
            "process_group must be None, False, a torch.distributed process group or an acs.RankStore, got "
            f"{process_group!r}; pass None to use the default group of an initialised torch.distributed")
    StoreWriter.check_options(**options)


def _is_process_group(group: Any) -> bool:
    import torch.distributed as dist

    return dist.is_available() and isinstance(group, dist.ProcessGroup)


# the valid store_options are StoreWriter's plus process_group (capture.writer.writer_options);
# their values are checked when the scope is made (capture.writer.check_writer_options)
open_capture_writer.__signature__ = _capture_writer_signature()  # type: ignore[attr-defined]
def _merges_reductions(target: Any, *, process_group: Any = None, **_options: Any) -> bool:
    """Whether a capture with these options is multi-rank (its reduction states are merged
    when it commits), as :func:`detect` decides, without starting anything."""
    if process_group is False or target is None:
        return False
    if isinstance(process_group, RankStore) or process_group is not None:
        return True
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


open_capture_writer.check_options = _check_capture_writer_options  # type: ignore[attr-defined]
open_capture_writer.merges_reductions = _merges_reductions  # type: ignore[attr-defined]


def _ranks_provenance(stores: list) -> dict:
    """The provenance of a store committed from rank stores: rank 0's, with every other
    rank's that differs, and every rank's resumes (each rank resumed on its own, e.g. a
    Slurm task run again), appended to its list ``resumes`` in rank order, once each (as
    :func:`~activationscope.store.writer.resumed_provenance` does for one store)."""
    def own(st) -> dict:
        prov = st.attrs.get("provenance")
        return dict(prov) if isinstance(prov, dict) else {}

    merged = own(stores[0]) if stores else {}
    base = {k: v for k, v in merged.items() if k != "resumes"}
    history: list = []
    for k, st in enumerate(stores):
        prov = own(st)
        resumes = resume_history(prov)
        prov.pop("resumes", None)
        for entry in ([prov] if k and prov else []) + resumes:
            if entry != base and entry not in history:
                history.append(entry)
    if history:
        merged = {**base, "resumes": history} if base else {"resumes": history}
    return merged
