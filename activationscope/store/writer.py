"""The store writer: native shard writer (``_C.ArrayWriter``) + the commit protocol.

Rows go from the hook path straight into native chunk buffers; one native writer thread per
store appends full chunks to shard files. Python runs once per forward (:meth:`add_batch`,
:meth:`maybe_commit`) and commits what the writer thread made durable:

1. data: complete shards (written to a temporary name, index appended, fsync'ed if asked,
   renamed; remote targets: uploaded from the local staging directory), and the partial
   shards of the arrays that hold the commits back (:meth:`_request_partial_shards`), whose
   rewrites are renamed over their key here (:meth:`_install_held_shard`);
2. row-table parts (Parquet), manifests (per-chunk crc32c), array ``zarr.json`` (shapes),
   each written atomically (temp + rename);
3. the root ``zarr.json`` last: it holds the committed sample / row counts, so a reader or a
   resumed writer sees exactly the committed prefix.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import functools
import hashlib
import io
import json
import math
import operator
import os
import re
import shutil
import stat
import sys
import threading
import time
import uuid
import weakref
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch

from ..capture import _native
from ..capture.hooks import check_column
from ..capture.results import main_result_key
from ..errors import (
    ActivationScopeError,
    ArgumentTypeError,
    ArgumentValueError,
    CaptureError,
    CaptureWarning,
    ReductionError,
    StoreCorruptError,
    StoreError,
    StoreExistsError,
    name_repr,
    warn_at_caller,
)
from .._args import check_reduction_name
from .._safeio import _kind, read_parquet_part
from . import _format as F
from . import _validate as V
from ._backend import (LocalBackend, ran_out_of_room, check_backend_not_in_store, check_local_store_path, check_remote_store_path,
                       refuse_foreign_entries, resolve, write_root_first)
from ._backend import _inside as _inside_folder
from ._backend import folds_names as _folds_names
from ._format import KEPT_SUFFIX, committed_reduction_files, committed_reduction_groups
from ._lock import WriterLock, refuse_rank_writers
from ._staging import make_staging_folder, remove_staging_folder


ROW_KINDS = F.ROW_KINDS
# threads writing a commit's manifests and array documents
_IO_THREADS = 4
#: A local folder whose first document write of a commit took less than this (seconds)
#: gets the commit's other documents written in the committing thread (see _set_many).
_SERIAL_WRITE_S = 0.001
#: The partial shards an array holding the commits back has written (:meth:`StoreWriter._request_partial_shards`)
#: stay within this share of the bytes the capture appends (uncompressed): at most 25% more written.
PARTIAL_REWRITE_SHARE = 0.25
#: Each commit rewrites documents: the root, which lists every row-table part (merges keep them few),
#: and each advanced array's manifest, which lists the shards after its segments (up to about twice
#: ``MANIFEST_SEGMENT_SHARDS``, FORMAT.md section 5): committed every interval, a capture of small
#: shards would write the manifests and the root far more often than its rows. Past
#: :data:`DOCUMENT_ALLOWANCE_BYTES` written by commits,
#: :meth:`StoreWriter.maybe_commit` waits until the documents written stay within this share of the
#: bytes the capture appended (uncompressed), or :data:`DOCUMENT_MAX_WAIT_S` passed since the last commit.
DOCUMENT_SHARE = 0.25
DOCUMENT_ALLOWANCE_BYTES = 64 << 20
DOCUMENT_MAX_WAIT_S = 60.0
#: Row-table parts (FORMAT.md section 4): each commit writes one part per row kind, and the root lists
#: every part. A commit that leaves a row kind with more than :data:`ROW_PARTS_BEFORE_MERGE` parts merges
#: each run of :data:`ROW_PART_MERGE_FACTOR` consecutive parts that hold as many commits' parts each
#: (``part-<i>.parquet`` one, ``part-<a>-<b>.parquet`` those of commits a..b) into one part of those
#: commits (:meth:`StoreWriter._merge_parts`): a K-ary counter, so a commit's rows are rewritten at most
#: log_K(commits) times and a capture of n commits keeps at most (K - 1) log_K(n) + 1 merged parts per
#: kind. A merge whose parts decode to more than :data:`ROW_PART_MERGE_MAX_BYTES` is not made (the
#: writer holds them in memory meanwhile, and a reader each part): those parts stay as they are.
ROW_PARTS_BEFORE_MERGE = 16
ROW_PART_MERGE_FACTOR = 4
ROW_PART_MERGE_MAX_BYTES = 64 << 20
#: A row-table part's file name: ``part-<i>.parquet`` (the part of commit i of the run, counted from 0
#: over the parts ever listed) or ``part-<a>-<b>.parquet`` (the parts of commits a..b merged into one).
_PART_NAME = re.compile(r"part-([0-9]{6,12})(?:-([0-9]{6,12}))?\.parquet")
# names the writer fills itself; "pos" is reserved for sample columns too: a token dataset joins the
# sample columns of each token's sample, where a sample column "pos" would hide the token position
_RESERVED = {"sample": ("sample_id", "pos", "batch"), "token": ("sample_id", "pos", "batch")}
# running encoder threads and the core each serves: stopped at interpreter exit (see
# _stop_encoders_at_exit); the core, not the writer, so that a writer dropped unclosed is collected
_ENCODING: "dict[threading.Thread, Any]" = {}


@atexit.register
def _stop_encoders_at_exit() -> None:
    """Write the queued chunks of writers left open and stop their encoder threads, while the
    interpreter is still whole. A daemon thread still inside native code when Python
    finalizes is ended with ``pthread_exit``, which aborts the process from any noexcept C++
    frame on its stack (torch's included). Nothing is committed: the store keeps its last
    commit (status ``incomplete``), as after a kill."""
    for thread, core in list(_ENCODING.items()):
        try:
            core.close()
            thread.join(timeout=60)
        except Exception:  # noqa: BLE001 - exiting: never mask the process's own outcome
            pass


if hasattr(os, "register_at_fork"):
    # a forked child holds copies of its parent's writers, not its own: its exit must not write
    # their queued chunks into the parent's store (the parent's shards renamed under it)
    os.register_at_fork(after_in_child=_ENCODING.clear)


# model weights being hashed in the background (_ModelIdentity): stopped at interpreter exit
_HASHING: "weakref.WeakSet[_ModelIdentity]" = weakref.WeakSet()


@atexit.register
def _stop_hashes_at_exit() -> None:
    """Stop the background hashes of model weights still running (a writer that failed to open,
    or was never closed), while the interpreter is still whole: a daemon thread inside torch's
    native code when Python finalizes is ended with ``pthread_exit``, which aborts the process
    ("terminate called without an active exception", exit status 134)."""
    for identity in list(_HASHING):
        try:
            identity.cancel()
        except Exception:  # noqa: BLE001 - exiting: never mask the process's own outcome
            pass


_folded = F.folded
_spelled = F.spelled_alike


def _remove_staging(core: Any, staging: str, pid: int, lock_fd: int | None) -> None:
    """Stop the native writer thread of ``core`` (it writes shards into ``staging``), then
    remove the staging folder of a remote store's writer and close its lock file ``lock_fd``
    (``store/_staging.py``): a ``weakref.finalize`` callback, so it holds no reference to the
    writer. Does nothing in a forked child (the folder, the lock and the writer thread are its
    parent's). Never raises."""
    if os.getpid() != pid:
        return
    try:
        core.close()  # (idempotent) no shard is written into the folder after this
    except Exception:  # noqa: BLE001 - a finalizer: never raises
        pass
    remove_staging_folder(staging, lock_fd)


_NAN_ID = ("nan",)  # every NaN float id, in _SampleIds' set


class _SampleIds:
    """The sample ids a capture has recorded, to warn when one repeats (a per-batch counter
    such as ``range(len(batch))`` is the usual cause; ``sample_ids=`` selections then pick
    the rows of every sample with that id).

    Non-negative int ids below :attr:`TABLE_IDS` cost one byte each (a table grown to the
    largest id seen); other ids (negative, larger, str, ...) are kept in a set, up to
    :attr:`SET_IDS` of them, after which they are no longer checked (said in the docs).
    Default ids (the running counter) are kept as merged ranges, a few integers whatever
    their number.
    """

    TABLE_IDS = 1 << 27  # at most 128 MiB, only when ids that large are used
    SET_IDS = 1 << 22

    def __init__(self) -> None:
        self.ranges: list[list[int]] = []  # merged [lo, hi) of default ids
        self.seen = np.zeros(0, dtype=bool)
        self.other: set = set()
        self.warned = False

    def add_range(self, lo: int, hi: int) -> None:
        if self.ranges and self.ranges[-1][1] == lo:
            self.ranges[-1][1] = hi
        elif hi > lo:
            self.ranges.append([lo, hi])

    def add(self, ids: Any) -> Any:
        """Record ``ids`` (one batch's); returns one id seen before (or twice in the batch),
        else None."""
        arr = ids if isinstance(ids, np.ndarray) else np.asarray(ids, dtype=object)
        if arr.dtype == object and len(arr):
            arr = self._int_list(arr)
        if arr.dtype.kind in "iu" and len(arr):
            vals = arr.astype(np.int64, copy=False)  # uint64 ids past 2**63 wrap to negative ones
            repeat = self._add_ints(vals)
            if repeat is not None and repeat < 0 and arr.dtype.kind == "u":
                repeat += 1 << 64  # named as given
        else:
            repeat = self._add_to_set(arr.tolist())
        return repeat

    def _add_to_set(self, values: list) -> Any:
        """Record ids kept in the set (up to :attr:`SET_IDS`); returns one seen before, else None."""
        repeat = None
        for v in values:
            if len(self.other) >= self.SET_IDS:
                break
            key = _NAN_ID if isinstance(v, float) and v != v else v  # (NaN is never equal to itself)
            if key in self.other and repeat is None:
                repeat = v
            self.other.add(key)
        return repeat

    @staticmethod
    def _int_list(arr: np.ndarray) -> np.ndarray:
        """A list of ints (Python ints or numpy integer scalars, as a ``numpy.int64`` array of
        ids stores the same) as the int64 array the table checks, so that it is checked
        against every int id recorded so far (ids at or past ``2**63`` as a ``numpy.uint64``
        array); else ``arr`` as given."""
        vals = [int(v) if isinstance(v, np.integer) else v for v in arr.tolist()]
        if not all(type(v) is int for v in vals):  # (bool is not int here)
            return arr
        if all(-(1 << 63) <= v < 1 << 63 for v in vals):
            return np.asarray(vals, dtype=np.int64)
        if all(0 <= v < 1 << 64 for v in vals):
            return np.asarray(vals, dtype=np.uint64)
        return arr

    def _add_ints(self, vals: np.ndarray) -> Any:
        repeat = None
        n = len(vals)
        if n > 1 and int(vals[-1]) - int(vals[0]) == n - 1 and bool((vals[1:] > vals[:-1]).all()):
            uniq = vals  # consecutive ids (the usual batch): no sort
        else:
            uniq, counts = np.unique(vals, return_counts=True)
            if len(uniq) != n:
                repeat = int(uniq[counts > 1][0])
        lo_id, hi_id = int(uniq[0]), int(uniq[-1])
        for lo, hi in self.ranges:
            if lo_id < hi and hi_id >= lo:
                hit = uniq[(uniq >= lo) & (uniq < hi)]
                if len(hit) and repeat is None:
                    repeat = int(hit[0])
        if lo_id >= 0 and hi_id < self.TABLE_IDS:
            small = uniq
        else:
            small = uniq[(uniq >= 0) & (uniq < self.TABLE_IDS)]
        if len(small):
            need = int(small[-1]) + 1
            if need > len(self.seen):
                grown = np.zeros(min(max(need, 2 * len(self.seen)), self.TABLE_IDS), dtype=bool)
                grown[: len(self.seen)] = self.seen
                self.seen = grown
            hit = small[self.seen[small]]
            if len(hit) and repeat is None:
                repeat = int(hit[0])
            self.seen[small] = True
        if len(small) != len(uniq):
            past = self._add_to_set(uniq[(uniq < 0) | (uniq >= self.TABLE_IDS)].tolist())
            repeat = past if repeat is None else repeat
        return repeat


@dataclass
class _Array:
    hook_point: str
    node: str
    path: str
    feature_shape: tuple[int, ...]
    dtype: str
    row_kind: str
    chunk_rows: int
    shard_chunks: int
    compression: dict | None
    writer: Any = None
    committed_rows: int = 0
    follows_row_table: bool = True
    manifest: dict = field(default_factory=dict)  # shard -> record, of the shards not in a segment
    # shard -> (record, its JSON): the manifest lists the shards not in a segment and is written whole
    # at each commit that lists a new one, so each record is encoded once, not at every commit
    manifest_json: dict = field(default_factory=dict)
    # the manifest's segments (FORMAT.md section 5), {"first", "end", "file_bytes", "crc32c"} each: the
    # records of their shards are written once, into the segment, and dropped from ``manifest``
    segments: list = field(default_factory=list)
    listed_rows: int = 0  # rows the shards taken into the manifest hold (their largest rows_end)
    manifest_dirty: bool = False  # a new array has no manifest until its first durable shard
    doc_rows: int = -1  # rows in the written zarr.json (-1: not written)
    folder_found: bool = True  # its folder existed when this writer opened the array (local stores)
    chunks_found: bool = True  # and its folder of shards (c/)
    # resume of a local store: the committed partial last shard the re-fed rows rewrite; its new
    # file is written as "<key>.resumed.tmp" and renamed over the key by the commit that lists it
    # (FORMAT.md section 7), so a resume killed before that commit leaves the committed file as it was.
    # A shard made durable early as a partial shard (_request_partial_shards) is rewritten the same way
    held_shard: int = -1
    # when (time.monotonic()) and at how many appended rows its partial shard was last asked for
    partial_at: float = -math.inf
    partial_rows: int = -1
    # shard records taken from the writer thread by a commit that failed before listing them (an
    # upload that failed, a Ctrl-C): the next commit lists them first
    untaken: list = field(default_factory=list)
    # a forward recorded by add_batch reached it (or the store as found lists it): only then does
    # a root list it. An array first opened in a forward that is never recorded (refused or raised
    # partway) is never listed, and its files are removed by the close
    recorded: bool = True

    @property
    def row_nbytes(self) -> int:
        """Bytes of one row, uncompressed."""
        return math.prod(self.feature_shape) * F.itemsize(self.dtype)

    @property
    def shard_rows(self) -> int:
        return self.chunk_rows * self.shard_chunks

    @property
    def max_shard_file_bytes(self) -> int:
        """The most bytes a shard file of this array can hold: each chunk as its encoder may
        grow it (zstd and blosc add less than 1/128 of it and a header), then the index and
        its crc32c."""
        chunk = self.chunk_rows * self.row_nbytes
        return min(V.MAX_FILE_BYTES, self.shard_chunks * (chunk + chunk // 128 + 1024 + 16) + 4)

    def _record_json(self, s: int, rec: dict) -> str:
        hit = self.manifest_json.get(s)
        if hit is None or hit[0] is not rec:
            hit = self.manifest_json[s] = (rec, json.dumps(rec))
        return hit[1]

    def manifest_bytes(self, sealable: int = 0) -> tuple[bytes, dict[str, bytes], list, list]:
        """The manifest document (FORMAT.md section 5), as ``json.dumps`` writes it, the new
        segments (``{key: bytes}``) to write before it, the segments it lists and the shards
        sealed (:func:`~activationscope.store._format.manifest_documents`; ``sealable``: full
        shards a root lists); :meth:`sealed` takes the result once they are written. Each
        shard's record is encoded once (a record replaced since, e.g. a partial shard's
        rewrite, again)."""
        for s in [s for s in self.manifest_json if s not in self.manifest]:
            del self.manifest_json[s]
        return F.manifest_documents(self.hook_point, self.chunk_rows, self.shard_rows, f"{self.path}/manifest.json",
                                    self.segments, self.manifest, sealable, self._record_json)

    def sealed(self, segments: list, shards: list) -> None:
        """The segments of :meth:`manifest_bytes` are written: drop their records from memory."""
        self.segments = segments
        for s in shards:
            del self.manifest[s]
            self.manifest_json.pop(s, None)

    def meta(self) -> dict:
        return {
            "path": self.path,
            "row_kind": self.row_kind,
            "feature_shape": list(self.feature_shape),
            "dtype": self.dtype,
            "storage_dtype": F.zarr_dtype(self.dtype),
            "n_rows": self.committed_rows,
            "chunk_rows": self.chunk_rows,
            "shard_rows": self.shard_rows,
            "compression": self.compression,
            "follows_row_table": self.follows_row_table,
            "manifest": f"{self.path}/manifest.json",
        }


@dataclass(slots=True)
class _Batch:
    index: int
    n_samples: int
    # rows of each array after this batch, in the writer's array order (int64: a batch stays
    # pending until every array's rows of it are durable, up to a shard of the slowest array,
    # thousands of forwards of hundreds of arrays, so it is 8 bytes an array, not a Python int)
    cums: np.ndarray
    sample: dict[str, Any] | None  # None: default sample ids first_id.. (made at the commit)
    token: dict[str, Any] | None
    first_id: int = 0  # the running counter's value before this batch
    next_id: int = 0  # the running counter's value after it (the next counted sample's id)
    # a store that keeps reductions only: {hook point: rows reduced} after this batch
    reduced: dict = field(default_factory=dict)


def _row_pieces(batches: list[_Batch], kind: str, keep_empty: bool = False) -> list[dict[str, Any]]:
    """The row-table columns of ``batches`` for row kind ``kind``, one dict per batch, except
    that a run of batches with default sample ids (numbered on from each other) is one dict
    made with one ``arange`` and one ``repeat``. Batches without rows of the kind are left out
    (``keep_empty``: kept)."""
    pieces: list[dict[str, Any]] = []
    run: list[_Batch] = []

    def flush() -> None:
        if run:
            first, total = run[0].first_id, sum(x.n_samples for x in run)
            pieces.append({"sample_id": np.arange(first, first + total, dtype=np.int64),
                           "batch": np.repeat(np.array([x.index for x in run], dtype=np.int64),
                                              [x.n_samples for x in run])})
            run.clear()

    for x in batches:
        if kind == "sample" and x.sample is None:
            if run and x.first_id != run[-1].first_id + run[-1].n_samples:
                flush()
            run.append(x)
            continue
        flush()
        part = getattr(x, kind)
        if part is not None:
            pieces.append(part)
    flush()
    return [p for p in pieces if keep_empty or len(p["batch"])]


def model_identity(model: torch.nn.Module | None) -> dict | None:
    """Class path and sha256 of the state dict (tensors' bytes in sorted name order).

    A store writer takes it when the store opens, before any forward, for a model in training
    mode (fine-tuning while capturing: recorded as it was then) and for a resume (compared
    with the stored one); for a new store's model in eval mode it is taken in a background
    thread while the first forwards run (see :class:`_ModelIdentity`).

    Parameters
    ----------
    model : torch.nn.Module or None

    Returns
    -------
    dict or None
        ``{"class": str, "state_dict_sha256": str (hex), "n_elements": int}``; None for
        ``model=None``.
    """
    if model is None:
        return None
    return _hash_state(type(model), _state_tensors(model))


def _state_tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The state dict's tensors in sorted name order (detached: they share the weights'
    memory and version counters); ArgumentValueError for one on the meta device."""
    with torch.no_grad():
        sd = model.state_dict()
    out = []
    for name in sorted(sd):
        t = sd[name]
        if not isinstance(t, torch.Tensor):
            continue
        if t.is_meta:
            t = _offloaded(model, name, t)
        if t.is_meta:
            raise ArgumentValueError(
                f"the model's state dict entry {name!r} is on the meta device (shapes only, no values): a "
                "store records the sha256 of the model's weights; load them (e.g. model.to_empty(device=...) "
                "then load_state_dict) before capturing into a store"
            )
        out.append((name, _hashable(name, t)))
    return out


def _offloaded(model: torch.nn.Module, name: str, meta: torch.Tensor) -> torch.Tensor:
    """The values Hugging Face accelerate keeps of a state dict entry it offloaded to the CPU or
    to disk (``cpu_offload``, ``disk_offload``, ``dispatch_model`` / ``device_map`` to ``"cpu"`` or
    ``"disk"``: the module's own is on the meta device between forwards), read from its module's
    ``AlignDevicesHook`` weights map; ``meta`` itself where there are none."""
    module_name, _, key = name.rpartition(".")
    try:
        module = model.get_submodule(module_name)
    except AttributeError:
        return meta
    hook = getattr(module, "_hf_hook", None)
    for h in getattr(hook, "hooks", None) or [hook]:  # (a SequentialHook holds several)
        weights = getattr(h, "weights_map", None)
        if weights is None or not getattr(h, "offload", False):
            continue
        try:
            value = weights[key]
        except (KeyError, TypeError, OSError, RuntimeError):
            continue
        if isinstance(value, torch.Tensor) and not value.is_meta and value.shape == meta.shape \
                and value.dtype == meta.dtype:
            return value
    return meta


def _hashable(name: str, t: torch.Tensor) -> torch.Tensor:
    """``t`` as a tensor whose memory holds its values: a ``DTensor`` (``fully_shard``, FSDP2;
    tensor parallelism) has no memory of its own (``data_ptr()`` 0), its local tensor holds
    them where no mesh dimension of more than one rank shards it or holds partial sums (a
    one-process group, replicated); ArgumentValueError for one split across ranks, and for any
    other tensor without memory, naming the entry."""
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    if dtensor is not None and isinstance(t, dtensor):
        mesh = t.device_mesh
        split = [(p, mesh.size(i)) for i, p in enumerate(t.placements) if not p.is_replicate() and mesh.size(i) > 1]
        if split:
            raise ArgumentValueError(
                f"the model's state dict entry {name!r} is a DTensor split across {split[0][1]} ranks "
                f"({split[0][0]!r}): a store records the sha256 of the model's whole weights, which no rank holds. "
                "Capture into a store a model whose every rank holds all of its weights (DistributedDataParallel, "
                "or fully_shard on a mesh of one rank), or capture in memory (store=None)"
            )
        t = t.to_local()
    if t.layout == torch.strided and t.numel() and t.data_ptr() == 0:
        raise ArgumentValueError(
            f"the model's state dict entry {name!r} is a {type(t).__name__} with no memory of its values "
            "(a tensor subclass without storage): a store records the sha256 of the model's weights; capture "
            "with plain tensors as weights, or in memory (store=None)"
        )
    return t


class _HashCancelled(Exception):
    """A background hash of model weights stopped before its end (see _ModelIdentity.cancel)."""


def _hash_state(cls: type, items: list[tuple[str, torch.Tensor]], stop: threading.Event | None = None) -> dict:
    h = hashlib.sha256()
    n_params = 0
    with torch.no_grad():
        for _name, t in items:
            if stop is not None and stop.is_set():
                raise _HashCancelled()
            t = t.detach().to("cpu")
            if t.layout != torch.strided:
                t = t.to_dense()  # a sparse buffer: its values (FORMAT.md)
            # the values, not the memory under a lazy conjugate or negation
            t = t.resolve_conj().resolve_neg().contiguous()
            n_params += t.numel()
            if t.numel():
                # the buffer itself, no copy, through ctypes: Tensor.numpy() would leave the
                # model's storage unresizable for good (code that frees parameter memory with
                # untyped_storage().resize_(0) then fails); hashlib releases the GIL on it
                h.update((ctypes.c_char * t.nbytes).from_address(t.data_ptr()))
    return {"class": f"{cls.__module__}.{cls.__qualname__}", "state_dict_sha256": h.hexdigest(), "n_elements": n_params}


def _version(t: torch.Tensor) -> int | None:
    try:
        return int(t._version)
    except RuntimeError:  # an inference tensor keeps no version counter
        return None


class _ModelIdentity:
    """:func:`model_identity` of a new store's model in eval mode, hashed in a background thread
    while the first forwards run (the sha256 of a model's weights costs about 1 ms per MB,
    once per capture); :meth:`get` waits for it. The weights' version counters are compared
    after the hash: weights changed in place while it ran are hashed again as they are then,
    with a warning (the record is no longer the weights of the open). The meta-device check
    runs at once."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._cls = type(model)
        self._items: list[tuple[str, torch.Tensor]] | None = _state_tensors(model)
        self._versions = [_version(t) for _, t in self._items]
        self._result: dict | None = None
        self._error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="activationscope-model-hash", daemon=True)
        _HASHING.add(self)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._result = _hash_state(self._cls, self._items or [], self._stop)
        except BaseException as e:  # noqa: BLE001 - reported by get()
            self._error = e

    def cancel(self) -> None:
        """Stop the hash (after the tensor it is reading) and wait for its thread: a writer that
        failed to open, or the interpreter's exit. :meth:`get` then returns None."""
        self._stop.set()
        self._thread.join()
        _HASHING.discard(self)
        self._items = None
        self._result = None

    def done(self) -> bool:
        return not self._thread.is_alive()

    def get(self) -> dict | None:
        """The identity (None, with a warning, when the weights could not be hashed; None when
        cancelled)."""
        self._thread.join()
        _HASHING.discard(self)
        if self._stop.is_set():
            return None
        items, self._items = self._items, None
        if items is not None:
            changed = [name for (name, t), v in zip(items, self._versions) if _version(t) != v]
            if self._error is None and changed:
                try:
                    self._result = _hash_state(self._cls, items)
                except BaseException as e:  # noqa: BLE001
                    self._error = e
                else:
                    warn_at_caller(
                        f"the model's weights changed in place ({', '.join(changed[:3])}"
                        f"{', ...' if len(changed) > 3 else ''}) while the store was taking their sha256 in the "
                        "background: the store records them as they are after that change, not as they were when it "
                        "opened, and a resume is checked against those. Put the model in training mode "
                        "(model.train()) before opening the store when it is fine-tuned while capturing: its "
                        "weights are then hashed at the open", CaptureWarning)
            if self._error is not None:
                warn_at_caller(f"the model's weights could not be hashed for the store's model record "
                               f"({type(self._error).__name__}: {self._error}); the store records no model, so a "
                               "resume cannot check that it continues with the same model", CaptureWarning)
                self._result = None
        return self._result


def resumed_provenance(stored: Any, given: Mapping[str, Any]) -> dict:
    """The provenance a resumed store records: the stored one, with ``given`` (the resume's
    own, when it gives one that differs) appended to its list ``resumes``.

    Parameters
    ----------
    stored : dict or None
        The store's provenance (anything else, from a damaged root, counts as none).
    given : dict
        The resuming run's provenance (empty: none given).

    Returns
    -------
    dict
        ``stored`` when ``given`` is empty or equal to it (or to its last resume); ``given``
        when nothing is stored; else ``{**stored, "resumes": [*stored["resumes"], given]}``
        (a stored ``resumes`` that is not a list is kept as the first entry of the list).
    """
    old = dict(stored) if isinstance(stored, Mapping) else {}
    new = dict(given)
    if not new:
        return old
    if not old:
        return new
    history = resume_history(old)
    if new == old or (history and history[-1] == new):
        return old
    return {**old, "resumes": [*history, new]}


def resume_history(provenance: Mapping[str, Any]) -> list:
    """The entries of a provenance's ``resumes`` as a list (one that is not a list: its only
    entry; none: empty)."""
    before = provenance.get("resumes")
    return list(before) if isinstance(before, list) else ([] if before is None else [before])


_library_versions = F.library_versions  # (named so where the writer and ranks use it)


def check_same_model(target: str, state: Mapping[str, Any], model: dict | None) -> None:
    """Refuse to resume the store ``target`` with another model than the one it records.

    Parameters
    ----------
    target : str
        The store, as named in the message.
    state : mapping
        The store's root attributes (``model``, ``status``, ``n_samples``).
    model : dict or None
        :func:`model_identity` of the resuming model (None: nothing to compare).

    Raises
    ------
    StoreError
        The state dict sha256 differs; nothing was changed.
    StoreCorruptError
        The recorded model is not an object (a damaged root document).
    """
    if model is None:
        return
    record = state.get("model")
    if record is not None and not isinstance(record, dict):
        raise StoreCorruptError(
            f"cannot resume {target!r}: its root document records the model as {type(record).__name__} "
            f"{str(record)[:60]!r}, not an object; nothing was changed. Run verify on it"
        )
    old = (record or {}).get("state_dict_sha256")
    if old is None or old == model["state_dict_sha256"]:
        return
    # the same class and number of weights: other values, or the same ones in another dtype
    # (model.to(torch.bfloat16) changes every byte of the state dict)
    same_shape = (record.get("class") == model.get("class") and record.get("n_elements") is not None
                  and record.get("n_elements") == model.get("n_elements"))
    hint = (" (the same class and number of weights: other weights, or the same weights in another dtype, as "
            "after model.to(torch.bfloat16) or model.half(); resume with the model in its dtype of the first run. "
            "A store records the weights as they were when the store was opened: after optimizer steps of a capture "
            "during training the model's weights are other ones, so capture the rest of such a run into a new store)"
            if same_shape else "")
    raise StoreError(
        f"cannot resume {target!r} (status {state.get('status')!r}, {int(state.get('n_samples', 0))} samples): it "
        f"was captured from a model with state dict sha256 {old[:12]}..., this model has "
        f"{model['state_dict_sha256'][:12]}...{hint}; nothing was changed. Resume with the model it was captured "
        "from, or pass overwrite=True (CLI: --overwrite) to capture it again with this model"
    )


#: Samples of one batch up to which its default sample ids are made at the commit (more: now,
#: as for given ids, so that memory for them is found, or not, before the batch is recorded).
_DEFERRED_IDS_MAX = 1 << 20
#: Samples of one batch at most (a row table of 2**31 rows from one forward is no batch).
_N_SAMPLES_MAX = (1 << 31) - 1


def _n_samples(value: Any) -> int:
    """``value`` as a batch's number of samples: an int (or an integer numpy / 0-d tensor
    value) in ``[0, 2**31)``.

    Raises
    ------
    ArgumentTypeError
        Not an integer (a float, a bool, a string).
    ArgumentValueError
        Negative, or 2**31 or more.
    """
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point() \
            and value.dtype is not torch.bool:
        value = value.item()
    if isinstance(value, (bool, np.bool_)):
        raise ArgumentTypeError(f"n_samples must be an int, got {value!r}")
    try:
        n = operator.index(value)
    except TypeError:
        raise ArgumentTypeError(f"n_samples must be an int, got {type(value).__name__} {value!r}") from None
    if not 0 <= n <= _N_SAMPLES_MAX:
        raise ArgumentValueError(f"n_samples must be an int in [0, 2**31), got {n}")
    return n


def _dtype_label(name: str | None, torch_name: bool = False) -> str:
    if name is None:
        return "None" if torch_name else "None (each hook point's own dtype)"
    return f"torch.{name}"


def _positive_int(value: Any, what: str, allow_none: bool = True) -> int | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ArgumentValueError(f"{what} must be a positive int{' or None' if allow_none else ''}, got {value!r}")
    return value


def _check_id_values(ids: Any) -> None:
    """Refuse a sample id of None: a sample without an id, which the row table stores as null,
    no ``sample_ids=`` selection names, and pooling per sample (:func:`.analysis.pooling.labelled_rows`)
    merges with the other None ids of its forward, without the warning a repeated id gets.

    Raises ArgumentTypeError naming the position; nothing is recorded."""
    values = ids if isinstance(ids, (list, tuple)) or getattr(ids, "dtype", None) == object else ()
    for i, v in enumerate(values):
        if v is None:
            raise ArgumentTypeError(
                f"sample_ids must not hold None, got None at position {i} of {_short_ids(values)}: a sample "
                "without an id (stored as null, selected by no sample_ids=, and pooled together with the other None "
                "ids of its forward); give every sample an id, or leave sample_ids out for the default counter")


def _short_ids(values: Any) -> str:
    shown = ", ".join(repr(v) for v in list(values)[:6])
    return f"[{shown}{', ...' if len(values) > 6 else ''}]"


def _to_column(value: Any) -> Any:
    """The values of a row-table column (or of sample ids) as an ndarray or a list, copied: the
    row table is written at a commit, after the caller may have reused its tensor or array."""
    if isinstance(value, torch.Tensor):
        t = value.detach().to("cpu")
        if t.dtype == torch.bfloat16 or t.dtype.is_floating_point and t.dtype.itemsize == 1:
            t = t.float()  # (numpy has no bfloat16 nor float8 types: float32 holds their values exactly)
        a = t.numpy().copy()
        return a if a.ndim <= 1 else list(a)
    if isinstance(value, np.ndarray):
        return value.copy() if value.ndim <= 1 else list(value.copy())
    return list(value)


def _arrow_type(values: Any) -> Any:
    """The Arrow type of a column's values (``_to_column``'s), or None when it has none yet
    (no values, or only Nones); TypeError-like pyarrow errors propagate."""
    if isinstance(values, np.ndarray) and values.dtype.kind in "biuf" and values.dtype.isnative and values.ndim == 1:
        return _numpy_arrow_type(values.dtype)  # the type pa.array gives them, without building it
    import pyarrow as pa

    typ = pa.array(list(values) if isinstance(values, np.ndarray) and values.dtype == object else values).type
    return None if pa.types.is_null(typ) else typ


@functools.cache
def _numpy_arrow_type(dtype: np.dtype) -> Any:
    """The Arrow type of a numeric or bool numpy dtype (as ``pyarrow.array`` of such an array
    gives it; an array of 32 ints costs about 25 us to build, once per captured forward)."""
    import pyarrow as pa

    return pa.from_numpy_dtype(dtype)


_EMPTY_IDS = np.zeros(0, dtype=np.int64)


def _int64_ids_type() -> Any:
    """The Arrow type of default sample ids (int64; one cached object)."""
    return _numpy_arrow_type(np.dtype(np.int64))


_NOT_CUSTOM = object()  # stored_reduction_state(script=...) not given: a built-in reduction
# a stored script more than twice the resumed one's size plus this is no save of the same
# program (only the archive's top folder name differs) and is not read
_SCRIPT_SIZE_SLACK_BYTES = 1 << 20


def _script_records(data: bytes) -> list[tuple[str, int, int]] | None:
    """The records of a ``torch.jit.save`` archive as ``(name below its top folder, size,
    crc32)``, from the zip directory alone (nothing is decompressed or loaded); None when
    ``data`` is not a zip archive. Two saves of one program differ only in the top folder's
    name (the file's name when it was saved)."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            return sorted((i.filename.split("/", 1)[-1], int(i.file_size), int(i.CRC)) for i in z.infolist())
    except (zipfile.BadZipFile, zipfile.LargeZipFile, ValueError, EOFError, OSError):
        return None


#: State keys a built-in keeps in int64 for integer rows (exact beyond 2**53), float64 for
#: float rows: min / max keep their ``value`` and topk its ``values`` in the rows' kind.
_INTEGER_STATE_KEYS = {"min": "value", "max": "value", "topk": "values"}


def _state_dtypes(kind: str, key: str, probe_dtype: torch.dtype, exact: bool) -> tuple[torch.dtype, ...]:
    """The dtypes a stored state's ``key`` of built-in ``kind`` may have: the probe's, and
    (``exact`` false: rows of a dtype not known) also the other of float64 and int64 where
    the reduction keeps integer rows exact (:data:`_INTEGER_STATE_KEYS`)."""
    if exact or _INTEGER_STATE_KEYS.get(kind) != key:
        return (probe_dtype,)
    return (torch.float64, torch.int64)


def _builtin_state_fits(kind: str, options: Mapping[str, Any], state: Mapping[str, torch.Tensor], n_rows: int,
                        feature_shape: tuple[int, ...], dtype: torch.dtype | None = None) -> bool:
    """Whether ``state`` is one that the built-in reduction ``kind`` with ``options`` can hold
    after ``n_rows`` rows of ``feature_shape`` (and of ``dtype``: min, max and topk keep
    integer rows in int64, float rows in float64; when None, either is taken, as a store
    written before integer states were kept holds float64 ones of integer rows): the keys,
    shapes and dtypes of a reduction of the same kind fed as many rows as shape it (zeros), the count of those rows, row ids
    among them, no negative count, sum of squares, co-moment diagonal or absmax, as many hist
    values (bins, under, over, NaN) and no more nonzero values than observations."""
    from ..capture.reductions import make_reduction

    try:
        probe = make_reduction(kind, **dict(options))
        n_probe = min(n_rows, int(options.get("k", 10))) if kind == "topk" else min(n_rows, 1)
        probe.update(torch.zeros((n_probe, *feature_shape), dtype=dtype or torch.float64), 0)
    except (ActivationScopeError, RuntimeError, ValueError, TypeError):
        return False
    want = probe.state()
    if set(want) != set(state):
        return False
    for key, t in want.items():
        if tuple(state[key].shape) != tuple(t.shape) or state[key].dtype not in _state_dtypes(kind, key, t.dtype, dtype is not None):
            return False
    per_row = 1 if options.get("per_feature", 1) else math.prod(feature_shape)
    if int(state["count"]) != n_rows * per_row:
        return False
    for key, high in (("row_ids", n_rows), ("feature_ids", math.prod(feature_shape))):
        ids = state.get(key)
        if ids is not None and ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= high):
            return False
    for key in ("counts", "nan", "overflow", "underflow", "n_nonzero", "m2", "sumsq"):
        if key in state and bool((state[key] < 0).any()):
            return False
    # a sum of squared deviations (the co-moment's diagonal) or a largest |x| is never negative
    # (NaN, from NaN rows, is no sign of damage)
    if kind == "cov" and "comoment" in state and bool((state["comoment"].diagonal() < 0).any()):
        return False
    if kind == "absmax" and "value" in state and bool((state["value"] < 0).any()):
        return False
    if kind == "hist" and "counts" in state and state["counts"].numel() and not bool(
            (state["counts"].sum(-1) + state["underflow"] + state["overflow"] + state["nan"] == state["count"]).all()):
        return False  # every value of a feature is in one bin, under, over or NaN
    if kind == "nonzero" and "n_nonzero" in state and bool((state["n_nonzero"] > state["count"]).any()):
        return False
    return True


def _unstorable(value: Any) -> str | None:
    """What makes a reduction's result or state value one a store cannot hold (None when it
    can): not a tensor or number, not dense and strided, on the meta device (no values),
    or a dtype the format has not."""
    if not isinstance(value, (torch.Tensor, bool, int, float)):
        return f"a {type(value).__name__}, not a Tensor"
    t = torch.as_tensor(value)
    if t.is_nested:
        return "a nested tensor"
    if t.layout != torch.strided:
        return f"a {str(t.layout).replace('torch.', '')} tensor (not strided)"
    if t.device.type == "meta":
        return "on the meta device (a shape but no values)"
    if t.is_quantized:
        return f"a quantized tensor ({t.dtype})"
    if F.dtype_name(t.dtype) not in F.SUPPORTED_DTYPES:
        return f"of dtype {F.dtype_name(t.dtype)}"
    return None


def _write_small_array(backend: Any, path: str, t: torch.Tensor, attrs: dict,
                       dimension_names: list[str] | None = None) -> dict[str, int]:
    """Write a one-chunk array; returns ``{chunk key: crc32c}`` (empty for a 0-size array)."""
    dname = F.dtype_name(t.dtype)
    data = t.view(torch.uint16) if dname == "bfloat16" else t
    arr = data.numpy()
    shape = tuple(arr.shape)
    doc = F.array_document(n_rows=shape[0] if shape else 0, feature_shape=shape[1:], dtype=dname,
                           chunk_rows=max(1, shape[0]) if shape else 1, shard_chunks=1,
                           compression=None, attributes={F.ATTRS_KEY: attrs},
                           dimension_names=dimension_names)
    # small arrays: one plain chunk, no sharding
    doc["shape"] = list(shape)
    doc["chunk_grid"]["configuration"]["chunk_shape"] = [max(1, d) for d in shape]
    doc["codecs"] = [F.bytes_codec(dname)]
    backend.set(f"{path}/zarr.json", F.dumps(doc))
    key = f"{path}/c" + ("/" + "/".join("0" for _ in shape) if shape else "")
    if not arr.size:
        return {}
    data = np.ascontiguousarray(arr).astype(arr.dtype.newbyteorder("<")).tobytes()
    backend.set(key, data)
    return {key: F.crc32c(data)}


#: A store that keeps reductions only commits at most once per this many times the seconds its
#: last commit took to write the reductions' states (StoreWriter._due_interval): about 10% of the time.
STATE_WRITE_SHARE = 10.0

#: The folder, in a hook point's reduction folder, of the reduction files one commit of a store
#: that keeps reductions only writes (FORMAT.md section 11): ``__c<batches>-<8 hex digits>``. A
#: reduction's name never starts with ``__`` (FORMAT.md section 6), so none is ever one.
_COMMIT_FOLDER = re.compile(r"__c[0-9]+-[0-9a-f]{8}")


def _same_values(a: Any, b: Any) -> bool:
    """Whether the ``pyarrow.Table`` ``a`` holds the values of ``b`` (same columns assumed),
    NaN equal to NaN in floating columns (``Table.equals`` takes NaN for unequal)."""
    import pyarrow.compute as pc
    import pyarrow.types as pt

    if a.equals(b):
        return True
    for name in b.column_names:
        x, y = a.column(name), b.column(name)
        if x.equals(y):
            continue
        if not pt.is_floating(y.type):
            return False
        if pc.all(pc.equal(pc.is_null(x), pc.is_null(y))).as_py() is False:
            return False
        same = pc.or_(pc.equal(x, y), pc.and_(pc.is_nan(x), pc.is_nan(y)))
        if pc.all(pc.fill_null(same, True)).as_py() is False:
            return False
    return True


def _commit_folders(reductions: Mapping[str, Any]) -> set[str]:
    """``reductions/<node>/__c...`` folders that the entries of ``reductions`` (a root's) list."""
    out = set()
    for entries in reductions.values():
        for e in (entries or {}).values() if isinstance(entries, Mapping) else ():
            if not isinstance(e, Mapping):
                continue
            paths = [e.get("path"), e.get("script")] + [p.get("path") for p in (e.get("state") or {}).values()
                                                         if isinstance(p, Mapping)]
            for path in paths:
                parts = path.split("/") if isinstance(path, str) else []
                if len(parts) >= 4 and parts[0] == "reductions" and _COMMIT_FOLDER.fullmatch(parts[2]):
                    out.add("/".join(parts[:3]))
    return out


def _link_or_copy(path: Path, keep: Path) -> None:
    """Make ``keep`` a hard link to ``path`` (a copy on a file system without hard links: some
    network and FUSE mounts), replacing any ``keep``; OSError with no ``keep`` left otherwise."""
    try:
        keep.unlink(missing_ok=True)
        try:
            os.link(path, keep)
        except OSError:
            shutil.copyfile(path, keep)
    except OSError:
        keep.unlink(missing_ok=True)
        raise


def _import_row_table_writer() -> None:
    """Import what a commit needs to write row tables (pyarrow, its parquet writer) while the
    writer opens. The first ``pyarrow.array`` also imports pandas where it is installed
    (pyarrow checks every input for pandas objects): together 0.3 s on an idle machine and
    several seconds on a loaded one, which otherwise landed in the first commit, in the middle
    of the capture loop, once in every rank of a multi-rank capture."""
    import pyarrow as pa
    import pyarrow.parquet  # noqa: F401

    pa.array(np.zeros(1, dtype=np.int64))


#: What a capture's store error adds about the store it leaves (a writer thread that failed, a
#: commit that ran out of room): its committed rows, and how to go on.
AFTER_FAILURE = ("rows committed before the failure stay readable (open_store), and resume=True continues from "
                 "them once the cause is fixed")

def _delete_aside(aside: Path) -> OSError | None:
    """Delete the folder an ``overwrite=True`` moved the old store into (its root document
    already gone); return the error that kept part of it there, None once it is gone."""
    shutil.rmtree(aside, ignore_errors=True)
    if os.path.lexists(aside):  # (a folder of it this process may not write in): once more, to say why
        try:
            shutil.rmtree(aside)
        except OSError as e:
            return e
    return None


class _AsideDelete:
    """The delete of an old store an ``overwrite=True`` replaced, on a daemon thread: a store of
    thousands of shard files takes seconds to delete, which the commit that settles it (in the
    capture's forwards) would otherwise wait for. :meth:`finish` waits for it and says what it
    could not delete. ``remains``: the folder is what an earlier writer's delete of it left
    (said so in that warning)."""

    def __init__(self, aside: Path, remains: bool = False) -> None:
        self.aside = aside
        self.remains = remains
        self.error: BaseException | None = None
        delete = _delete_aside  # (looked up now: the one in use when the delete starts)

        def run() -> None:
            try:
                self.error = delete(aside)
            except BaseException as e:  # noqa: BLE001 - kept for finish(), never raised in this thread
                self.error = e

        self._thread = threading.Thread(target=run, name="activationscope-delete-replaced", daemon=True)
        self._thread.start()

    def finish(self, store: str) -> None:
        """Wait for the delete (as long as the files left take to delete); warn (``RuntimeWarning``,
        naming the folder and the fix) when part of the folder could not be deleted."""
        self._thread.join()
        if self.error is not None:
            what = (f"deleting what is left in {str(self.aside)!r} of a store an earlier overwrite=True replaced"
                    if self.remains else
                    f"the new store has committed, but deleting the old one it replaced from {str(self.aside)!r}")
            warn_at_caller(
                f"store {store!r}: {what} failed ({self.error}); that folder holds no store any more: delete it "
                f"(rm -rf {str(self.aside)!r}, with the permission it needs)", RuntimeWarning)


class StoreWriter:
    """Writes one capture run into a store (local path, fsspec URL or zarr Store).

    Normally made by :class:`activationscope.ActivationScope` (``store=``, ``store_options=``).

    Parameters
    ----------
    target : str, os.PathLike or zarr Store
        Local directory, ``file://`` / ``memory://`` / ``s3://`` ... URL, or a zarr ``Store``.
    capture_config : dict
        JSON-able description of the capture (kept in the metadata).
    model : torch.nn.Module or None
        Its class path and a sha256 of its state dict are recorded.
    storage_dtype : torch.dtype or None
        Cast of the stored rows (informational here; the sink casts).
    overwrite : bool, default False
        Replace an existing store at ``target``. A local one is moved aside and deleted once
        the new store has committed a forward, in the background: :meth:`close` waits for
        that delete (FORMAT.md section 7).
    resume : bool, default False
        Continue an existing store: every array is truncated to the committed samples,
        :attr:`n_samples_committed` says how many sample rows it holds and
        :attr:`next_sample_id` how many samples of the data the caller must skip (the same,
        unless batches of samples recorded before, generation steps, stored them again); the
        default sample ids continue from :attr:`next_sample_id`. Nothing at
        ``target`` is an error (drop ``resume=True`` to start a new store).
    compression : None, "zstd", "zstd:<level>", "blosc-lz4", "blosc-lz4:<clevel>", or a zarr / numcodecs codec
        Inner-chunk compression (None keeps arrays zero-copy readable); zstd levels 1..22,
        blosc clevel 0..9.
    chunk_rows : int, optional
        Rows per chunk (default: about 256 KiB of rows in whole 4 KiB pages, at most 16384; with
        an explicit ``shard_bytes``, no larger than it and at most 65536 rows).
    shard_bytes : int, optional
        Target bytes per shard; a shard holds a whole number of chunks. Default: 64 MiB but
        at most 16384 rows, so that every array completes shards -- and so lets commits
        through -- every 16384 rows at the latest (rows become durable a whole shard at a time).
    shard_rows : int or dict, optional
        Exact rows per shard of every array of a row kind (an int for both kinds, or
        ``{"sample": int, "token": int}``); excludes ``shard_bytes``. Chunks are then the
        largest divisor of it not above the default chunk size (or ``chunk_rows``, which must
        divide it). Multi-rank captures use it so that every array of a kind, on every rank,
        has the same shards (``store/FORMAT.md`` §10).
    fsync : bool, default False
        fsync shards and metadata before they are renamed into place.
    commit_interval : float, default 1.0
        Seconds between two commits of :meth:`maybe_commit` (called after every captured
        forward): rows made durable since the last commit are listed by the next one, so a
        crash loses at most about this many seconds of captured rows (a resume captures them
        again). 0 commits after every forward that completed a shard. Each commit rewrites
        every advanced array's manifest (the shards after its segments, at most about
        2048: ``store/FORMAT.md`` section 5) and document and the root, so committing at every
        shard of a fast capture costs more than the capture's own bookkeeping. :meth:`commit` and
        :meth:`close` commit at once. An array that holds the commits back (a hook point called
        in some forwards only) has its open shard written as a partial shard at most once per
        interval, up to a shard's bytes each time, while the partial shards written stay within
        ``PARTIAL_REWRITE_SHARE`` (25%) of the bytes captured. Once commits wrote
        ``DOCUMENT_ALLOWANCE_BYTES`` (64 MiB) of documents and row-table parts (the root lists
        every part, one a commit; a manifest the shards after its segments), :meth:`maybe_commit` also waits until
        they are within ``DOCUMENT_SHARE`` (25%) of the bytes captured, or
        ``DOCUMENT_MAX_WAIT_S`` (60 s) passed since the last commit: a long capture commits less
        often, so that what its commits write grows with its rows, not with their square. A
        store that keeps reductions only writes every reduction's state at each commit: it
        commits at most once per ``STATE_WRITE_SHARE`` (10) times the seconds its last commit
        took to write them.
    max_pending_bytes : int, default 256 MiB
        Cap of the chunks queued for the writer thread, all arrays together; a full queue
        blocks the capture (backpressure).
    provenance : dict, optional
        User provenance (dataset, commit, ...), JSON-able. A resume keeps the store's
        provenance; a different one given to the resume is appended to its list ``resumes``
        (the history of the runs that wrote the store), see :func:`resumed_provenance`.
    storage_options : dict, optional
        fsspec options of a URL target (credentials, ``client_kwargs``).
    reductions_only : bool, default False
        A store that keeps reductions only (``store/FORMAT.md`` section 11, format version 3):
        no activation array, no token row table. Hook points are declared with
        :meth:`open_reduced` instead of :meth:`open_array`, each recorded forward gives its
        rows reduced per hook point (``add_batch(reduced_rows=...)``), and
        :meth:`add_reductions` stores the reductions, or, with :meth:`set_reduction_source`,
        every commit stores the states of the committed forwards. Made by
        ``ActivationScope(store=..., reduction_policy=ReductionPolicy.STREAMING)``. Only such a
        writer resumes such a store, and it resumes no store of rows (:class:`StoreError`
        before anything is changed).

    Notes
    -----
    A writer of a remote store (any target but a local directory) writes each shard into a
    local staging folder ``acs-staging-*`` in :func:`tempfile.gettempdir` (``$TMPDIR``) and
    uploads it at the commit that lists it. The folder is removed by :meth:`close`,
    :meth:`abort` and :meth:`discard`, and also when the writer fails to open, is dropped
    unclosed or is left open at interpreter exit. A killed process (``SIGKILL``, the
    out-of-memory killer, a preempted job) leaves it, with the shards it never uploaded; the
    next remote store's writer of this user on the host removes it (a lock file in the folder,
    whose ``flock`` the kernel releases when its writer's process ends, tells a dead writer's
    folder from a live one's; where ``flock`` cannot be taken, the folder has no lock file and
    is left).

    Raises
    ------
    StoreExistsError
        A store exists at ``target`` and neither ``overwrite`` nor ``resume`` is set.
    StoreError
        ``target`` is an existing file (not a directory), or ``resume`` is set and there is
        nothing at ``target``. Or this process may not write the store (a read-only mount, a
        store of another user): its writer lock cannot be made, a resume finds a folder of it
        this process may not write in, or ``overwrite`` cannot move it aside; the error names
        the path and the fix, and nothing of the store was changed. Or, for a remote store,
        its local staging folder cannot be made in ``$TMPDIR`` (missing, read-only or full):
        the error names the folder and the fix (another ``TMPDIR``).
    ValueError, TypeError
        Invalid options (checked before anything is written).
    """

    @staticmethod
    def check_options(
        *,
        overwrite: bool = False,
        resume: bool = False,
        compression: Any = None,
        chunk_rows: int | None = None,
        shard_bytes: int | None = None,
        shard_rows: int | Mapping[str, int] | None = None,
        fsync: bool = False,
        commit_interval: float = 1.0,
        max_pending_bytes: int = 256 << 20,
        provenance: Mapping[str, Any] | None = None,
        storage_options: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Check the writer's options (arguments as :class:`StoreWriter`) without opening anything.

        ``ActivationScope(store_options=...)`` calls it when the scope is made, so that a bad
        value is refused before the model runs; the writer calls it again when it opens.

        Returns
        -------
        dict
            The normalised ``compression`` (codec document or None), ``chunk_rows``,
            ``shard_bytes``, ``shard_rows`` (dict per row kind or None), ``commit_interval``
            (float seconds) and ``provenance`` (dict).

        Raises
        ------
        ArgumentValueError, ArgumentTypeError
            The option and the values it takes.
        """
        overwrite, resume = F.parse_flag(overwrite, "overwrite"), F.parse_flag(resume, "resume")
        F.parse_flag(fsync, "fsync")
        if overwrite and resume:
            raise ArgumentValueError("overwrite=True and resume=True exclude each other; pick one")
        compression = F.parse_compression(compression)
        chunk_rows = _positive_int(chunk_rows, "chunk_rows")
        shard_bytes = _positive_int(shard_bytes, "shard_bytes")
        shard_rows = F.parse_shard_rows(shard_rows, chunk_rows)
        if shard_rows is not None and shard_bytes is not None:
            raise ArgumentValueError("shard_rows and shard_bytes exclude each other; pick one")
        _positive_int(max_pending_bytes, "max_pending_bytes", allow_none=False)
        if isinstance(commit_interval, bool) or not isinstance(commit_interval, (int, float)) \
                or not math.isfinite(commit_interval) or commit_interval < 0:
            raise ArgumentValueError(f"commit_interval must be a number of seconds >= 0, got {commit_interval!r}")
        if provenance is not None and not isinstance(provenance, Mapping):
            raise ArgumentTypeError(f"provenance must be a dict or None, got {type(provenance).__name__}")
        if storage_options is not None and not isinstance(storage_options, Mapping):
            raise ArgumentTypeError(f"storage_options must be a dict or None, got {type(storage_options).__name__}")
        return {"compression": compression, "chunk_rows": chunk_rows, "shard_bytes": shard_bytes,
                "shard_rows": shard_rows, "commit_interval": float(commit_interval),
                "provenance": F.check_jsonable(dict(provenance or {}), "provenance")}

    def __init__(
        self,
        target: Any,
        *,
        capture_config: Mapping[str, Any] | None = None,
        model: torch.nn.Module | None = None,
        storage_dtype: torch.dtype | None = None,
        overwrite: bool = False,
        resume: bool = False,
        compression: Any = None,
        chunk_rows: int | None = None,
        shard_bytes: int | None = None,
        shard_rows: int | Mapping[str, int] | None = None,
        fsync: bool = False,
        commit_interval: float = 1.0,
        max_pending_bytes: int = 256 << 20,
        provenance: Mapping[str, Any] | None = None,
        storage_options: Mapping[str, Any] | None = None,
        reductions_only: bool = False,
    ) -> None:
        _native.load()  # writing needs the native extension (reading does not): say so first
        self.reductions_only = F.parse_flag(reductions_only, "reductions_only")
        if self.reductions_only:
            self.supports_aliases = False  # (no array for an alias to share)
        # ---- validate everything before the first byte is written
        opts = StoreWriter.check_options(
            overwrite=overwrite, resume=resume, compression=compression, chunk_rows=chunk_rows,
            shard_bytes=shard_bytes, shard_rows=shard_rows, fsync=fsync, commit_interval=commit_interval,
            max_pending_bytes=max_pending_bytes, provenance=provenance, storage_options=storage_options)
        self._compression, self._chunk_rows = opts["compression"], opts["chunk_rows"]
        self._shard_bytes, self._shard_rows = opts["shard_bytes"], opts["shard_rows"]
        self._commit_interval = opts["commit_interval"]
        self._last_commit = time.monotonic()
        if storage_dtype is not None:
            F.parse_dtype(storage_dtype, "storage_dtype")
        if model is not None and not isinstance(model, torch.nn.Module):
            raise ArgumentTypeError(f"model must be a torch.nn.Module or None, got {type(model).__name__}")
        self._capture_config = F.check_jsonable(dict(capture_config or {}), "capture_config")
        self._provenance = opts["provenance"]
        self._storage_dtype = None if storage_dtype is None else F.dtype_name(storage_dtype)
        self._fsync = bool(fsync)
        # before anything is made: a model it refuses leaves no trace. A resume compares it with the
        # stored one at once, and a model in training mode (fine-tuned while capturing) is hashed
        # as it is now; a new store's eval-mode model is hashed in the background while the first
        # forwards run, and recorded by the first commit that lists rows
        background = model is not None and not resume and not model.training
        self._model = None if background else model_identity(model)
        self._model_hash = _ModelIdentity(model) if background else None
        try:
            self._backend = resolve(target, fsync=self._fsync, storage_options=dict(storage_options or {}) or None)
            if isinstance(self._backend, LocalBackend):
                check_local_store_path(self._backend.root)
            check_remote_store_path(self._backend)
            check_backend_not_in_store(self._backend)
            self.target = target
            self._closed = True  # until the end of __init__: __del__ and close() do nothing
            self._settling = False  # closed, and not yet let go of the lock (_settle_interrupted)
            self._closing: str | None = None  # the status of a close a Ctrl-C cut short before its commit
            self._discarding = False  # a discard a Ctrl-C cut short before the store was put back as found
            self._lost: str | None = None  # why the store at the path is no longer this writer's (_check_still_held)
            self._aside: Path | None = None  # overwrite: the old store, until the new one commits
            self._aside_cleared = False  # its put-back removed the new store's files (_settle_aside)
            self._aside_deleted = False  # its delete began (_settle_aside): never put back
            # overwrite: the old store's delete, once the new one committed; and the delete of what a
            # cut-short delete of an earlier overwrite left (_warn_left_aside): each waited for by the close
            self._deleting: list[_AsideDelete] = []
            self._remains: Path | None = None  # that folder, deleted once this writer is set up
            self.put_back = False  # overwrite: the old store was put back (the new one committed nothing)
            self._replacing = False  # overwrite on object storage: the old objects go once this run's root is written
            # one writer at a time: the lock is held from here to close() / abort(); the try that gives it
            # back on a failure (or a Ctrl-C) comes right after it, nothing in between
            self._writer_lock = WriterLock(self._backend).acquire()
            try:
                if isinstance(self._backend, LocalBackend):  # (the lock made the folder: one removed later stays so)
                    self._backend.make_root = False
                self._open_existing(overwrite, resume)
                # a store this writer makes from nothing (a local one it replaces is put back by the
                # close of a run that committed no forward: see _settle_aside)
                self._made_new = not resume and self._aside is None
                self._setup(max_pending_bytes)
                if self._remains is not None:  # (in the background, as the writer that left it did)
                    self._deleting.append(_AsideDelete(self._remains, remains=True))
            except BaseException:
                self._settle_aside(keep_new=False)
                with contextlib.suppress(Exception):  # (a delete started: done before the lock goes)
                    self._finish_delete()
                self._writer_lock.discard_root()
                staging = getattr(self, "_staging_finalizer", None)
                if staging is not None:  # made before the failure: nothing of this writer needs it
                    staging()
                if getattr(self, "_made_new", False):
                    # its root may be written (interrupted, Ctrl-C, or failed after it): a new
                    # store of no row is removed, so that the rerun needs neither overwrite= nor resume=
                    from ._remove import remove_if_empty

                    try:
                        remove_if_empty(self._backend, remove_folder=self._writer_lock.created_root)
                    except Exception:  # noqa: BLE001 - the first error stays the one raised
                        pass
                raise
        except BaseException:
            if self._model_hash is not None:  # (no store to record it in)
                self._model_hash.cancel()
            raise

    def _warn_left_aside(self, adopted: Path | None = None) -> None:
        """Local stores: warn about a store an earlier ``overwrite=True`` moved aside next to
        this one (``.<name>.replaced-<hex>``, FORMAT.md section 7) and never settled: its writer
        was killed before its new store committed a forward (the old store should have gone
        back) or before it deleted the old one. Only a person can tell which to keep. The folder
        this writer took over (``adopted``, see ``LocalBackend.finish_move_aside``) is its own.
        What a delete cut short left (no root document) when the store at the path settled it
        (its root lists a committed forward, or ``complete``) and nothing else is aside
        (``LocalBackend.replaced_remains``) is garbage of this store: no warning, and this
        writer deletes it (``_remains``) once it is set up."""
        b = self._backend
        if not isinstance(b, LocalBackend):
            return
        try:
            left = [p for p in b.aside_folders() if p != adopted and any(p.iterdir())]
            remains = [str(p) for p in left if not os.path.lexists(p / "zarr.json")]
            left = [str(p) for p in left if str(p) not in remains]
        except OSError:
            return
        if adopted is None and remains and not left:
            garbage = b.replaced_remains()
            try:
                raw = b.get("zarr.json", max_bytes=V.MAX_JSON_BYTES)
                attrs = V.parse_root(raw, store=b) if raw is not None else None
                # (and the store at the path holds the manifests and row table parts it lists: a root moved back by hand
                # over the new one, its arrays still in that folder, is not garbage)
                settled = attrs is not None and F.settled_replaced(attrs) and all(
                    b.size(k) is not None for k in F.listed_keys(attrs))
            except StoreError:  # (a damaged root: the folder is named, as before)
                settled = False
            if garbage is not None and settled and remains == [str(garbage)]:
                self._remains, remains = garbage, []
        if remains:  # (a deletion of a settled old store cut short: its root document goes first)
            warn_at_caller(
                f"store {str(b)!r}: {remains[0]!r}{f' (and {len(remains) - 1} more)' if len(remains) > 1 else ''} "
                "holds what is left of a store an earlier overwrite=True replaced and was deleting (its root document "
                "is gone: nothing reads it as a store); delete it, unless it holds entries you are moving back by hand",
                RuntimeWarning)
        if left:
            warn_at_caller(
                f"store {str(b)!r}: {left[0]!r}{f' (and {len(left) - 1} more)' if len(left) > 1 else ''} holds a store "
                "that an earlier overwrite=True moved aside and never settled (its writer was killed before the new "
                "store there committed a forward, or before it deleted the old one); it is not this store. To keep "
                f"it, move its entries back into {str(b)!r} (by hand, with no writer running); else delete it",
                RuntimeWarning)

    def _drop_unstarted_store(self) -> None:
        """overwrite=True, local: the store at the path is the new store of an earlier overwrite
        killed before its first commit (no row; or the uncommitted root of a multi-rank overwrite,
        with its rank stores), whose old store is still in the one folder it was moved aside
        into: the unstarted store goes (``LocalBackend.drop_unstarted_store``) and that folder is
        then taken back as this overwrite's own (``finish_move_aside``), so the old store is put
        back if this run commits nothing and deleted once it commits, as in an overwrite never
        interrupted and as a multi-rank overwrite settles it (before, it stayed aside with a
        warning)."""
        b = self._backend
        if not os.path.lexists(b.root / "zarr.json") or not b.moved_roots():
            return
        raw = b.get("zarr.json", max_bytes=V.MAX_JSON_BYTES)
        try:
            attrs = V.parse_root(raw, store=b) if raw is not None else None
        except StoreError:
            return  # (a damaged root: moved aside as any other store)
        if attrs is not None:
            refuse_foreign_entries(b)  # (a file of the user's beside it is never removed)
            b.drop_unstarted_store(attrs)

    def _open_existing(self, overwrite: bool, resume: bool) -> None:
        """Check what is at the target (under the writer lock) and set up the state."""
        b = self._backend
        adopted = None  # overwrite: the folder an interrupted overwrite moved the old store into
        moved = ""  # a local folder with no root document whose root an interrupted overwrite moved aside
        if isinstance(b, LocalBackend) and (overwrite or resume):
            # (rank stores a live process writes under it: never taken over, FORMAT.md section 10)
            refuse_rank_writers(b, "overwrite=True" if overwrite else "resume=True")
            b.drop_empty_aside_folders()
            if overwrite and not self._writer_lock.created_root:  # (a folder that was not there holds nothing)
                self._drop_unstarted_store()
                adopted = b.finish_move_aside()  # (refuses, changing nothing, what it cannot tell apart)
            elif resume:
                moved = b.moved_aside_hint()
        elif isinstance(b, LocalBackend) and not self._writer_lock.created_root:
            # (a new store: the folder is half of an old one, not one to remove; or, empty, the whole old
            # store is in the folder aside, which a new store here would leave there without a word)
            moved = b.moved_aside_hint()
        if moved and resume:  # (resume: its error names the folder, no warning first)
            raise StoreError(f"resume=True needs a store to continue, but {str(b)!r} holds no root document "
                             f"(zarr.json): {moved}; nothing was changed")
        if moved:
            raise StoreExistsError(f"{str(b)!r} exists and is not empty but holds no root document (zarr.json): "
                                   f"{moved}; nothing was changed")
        if overwrite or resume:
            self._warn_left_aside(adopted)  # (before this writer moves one aside of its own)
        if overwrite:
            if adopted is not None:
                # the old store, whole again in the folder the killed overwrite made: settled as one
                # this writer moved (deleted once the new store commits, else put back)
                self._aside = adopted
            elif self._backend.size("zarr.json") is not None or self._backend.is_empty() or (
                    isinstance(b, LocalBackend) and b.rootless_store_entries()):
                # a store (even a damaged one: a root-less folder of a store's entries, what a removal cut
                # short leaves, too) or nothing: replaced. A local one is moved aside
                # and deleted only once the new one has committed (restored if it fails first).
                refuse_foreign_entries(self._backend)
                if isinstance(self._backend, LocalBackend):
                    self._aside = self._backend.move_aside()
                else:  # no rename: the root of this run replaces the old one first (_setup), then they go
                    self._replacing = not self._backend.is_empty()
            else:
                raise StoreExistsError(
                    f"{str(self._backend)!r} exists and is not empty but holds no Zarr store; choose another path "
                    "or remove it (overwrite=True only replaces stores)"
                )
        raw = None if self._replacing else self._backend.get("zarr.json", max_bytes=V.MAX_JSON_BYTES)
        self._state: dict | None = None
        self._found_root: bytes | None = None  # resume: the root as found (discard() puts it back)
        # a manifest of the store has segments (found so, or sealed by this run): format version 4
        self._segmented = False
        if raw is not None:
            ours = V.parse_root(raw, store=self._backend)  # every path and size checked before use
            status = (ours or {}).get("status", "not an activationscope store")
            if resume:
                if ours is None:
                    raise StoreError(
                        f"{self._backend!r} is a Zarr node but not an activationscope store; it cannot be resumed "
                        "(pass overwrite=True to replace it)"
                    )
                self._refuse_reductions_only_resume(ours)
                refused = V.builtin_reduction_problems(ours)
                for hp, problems in refused.items():  # (its readers refuse it: never carried on, never continued)
                    name, problem = next(iter(problems.items()))
                    raise V.corrupt(self._backend, f"hook point {hp!r}: reduction {name!r} is refused: {problem}; "
                                    "a resume neither continues nor carries such an entry, so this store cannot be "
                                    "resumed (nothing was written)", fix=V.REFUSED_REDUCTION_FIX)
                if isinstance(self._backend, LocalBackend):
                    self._refuse_unwritable_folder()
                self._state = ours
                self._found_root = bytes(raw)
                self._segmented = ours["format"]["version"] == F.SEGMENTS_VERSION
            else:
                aside = self._backend.unstarted_store_aside(ours) if isinstance(self._backend, LocalBackend) else None
                if aside is not None:
                    where = repr(str(self._backend))
                    raise StoreExistsError(
                        f"a store already exists at {where} (status {status!r}), but it is the new store of an "
                        f"overwrite=True killed before its first commit (it holds no row), and the store that "
                        f"overwrite=True was replacing is still whole in {str(aside)!r}; nothing was changed. To put that "
                        f"store back, with no writer running: StoreWriter({where}, overwrite=True).abort() (it removes "
                        f"the store of no row and moves the old one back), or by hand remove every entry of {where} and "
                        f"move those of {str(aside)!r} back into it (zarr.json last), then delete the empty folder. To "
                        f"drop the old store, delete {str(aside)!r} (or capture with overwrite=True: it deletes that "
                        "store once this capture commits, and puts it back if it commits nothing)"
                    )
                raise StoreExistsError(
                    f"a store already exists at {str(self._backend)!r} (status {status!r}); pass overwrite=True to "
                    "replace it or resume=True to continue it"
                )
        elif resume and self._backend.is_empty():
            raise StoreError(
                f"resume=True needs a store to continue, but there is nothing to resume at {str(self._backend)!r}; "
                "drop resume=True to start a new store"
            )
        elif not self._replacing and not self._backend.is_empty():
            left = b.rootless_store_entries() if isinstance(b, LocalBackend) else []
            if left:
                raise StoreExistsError(
                    f"{str(b)!r} holds entries of a store ({', '.join(map(repr, left))}) but no root document "
                    "(zarr.json): what is left of a store whose removal was cut short (a Ctrl-C while a capture that "
                    "committed no row removed its store), or of one whose root document was deleted; nothing reads it "
                    "as a store and nothing was changed. Pass overwrite=True (CLI: --overwrite) to replace it, or "
                    f"remove the folder {str(b)!r}"
                )
            raise StoreExistsError(
                f"{str(self._backend)!r} exists and is not empty but holds no Zarr store; choose another path "
                "or remove it (overwrite=True only replaces stores)"
            )

    def _refuse_reductions_only_resume(self, ours: Mapping[str, Any]) -> None:
        """Resume: refuse, before anything is changed, a store that keeps reductions only, or a
        capture that keeps reductions only into a store of rows (FORMAT.md section 11)."""
        stored_only = ours.get("rows_stored") is False
        if stored_only == self.reductions_only:
            return
        if stored_only:
            why = ("it keeps reductions only (captured with ReductionPolicy.STREAMING), and this capture stores "
                   "activation rows: one store cannot hold both (resume it with reduction_policy="
                   "ReductionPolicy.STREAMING and the same reductions=)")
        else:
            why = ("it stores activation rows, and this capture keeps reductions only (ReductionPolicy.STREAMING): "
                   "one store cannot hold both")
        raise StoreError(f"cannot resume {str(self._backend)!r}: {why}; nothing was changed. Capture again with "
                         "store_options={'overwrite': True} (CLI: --overwrite), or into another path")

    def _refuse_unwritable_folder(self) -> None:
        """Resume of a local store: refuse, before anything is deleted or written, a store with
        a folder this process may not write in (a store of another user whose own folder is
        writable to this one but not the folders under it; one on a read-only mount is refused
        earlier, by its writer lock). A resume writes in every folder of the store (the root,
        array documents and manifests, shards, row-table parts, reductions): it would fail there
        after its first root document, leaving a complete store marked incomplete."""
        found = self._backend.unwritable_folder()
        if found is not None:
            folder, why = found
            raise StoreError(
                f"cannot resume {str(self._backend)!r}: this process may not write in the folder {folder!r} of the "
                f"store ({why}); a resume writes in every folder of the store. Nothing of the store was deleted or "
                "written. Read it with open_store() (reading needs read permission only), or copy it "
                "(activationscope.store.copy_store) to a folder you may write to and resume the copy")

    # ------------------------------------------------------------------ helpers
    def _setup(self, max_pending_bytes: int) -> None:
        if self._state is not None:
            check_same_model(str(self._backend), self._state, self._model)
            self._provenance = resumed_provenance(self._state.get("provenance"), self._provenance)

        if self._state is not None:
            stored = self._state.get("storage_dtype")
            if stored != self._storage_dtype:
                # (a store that keeps reductions only: the hook points it reduced)
                arrays = sorted(self._state.get("arrays") or self._state.get("reduced") or {})
                shown = ", ".join(repr(a) for a in arrays[:4]) + (", ..." if len(arrays) > 4 else "")
                raise CaptureError(
                    f"cannot resume {str(self._backend)!r}: its hook points ({shown or 'none yet'}) are stored with "
                    f"storage_dtype={_dtype_label(stored)}, this capture has storage_dtype="
                    f"{_dtype_label(self._storage_dtype)}, and one array (or reduction) cannot mix the two; nothing "
                    "was changed. "
                    f"Resume with storage_dtype={_dtype_label(stored, torch_name=True)} (CLI: "
                    f"{'no --dtype' if stored is None else '--dtype ' + stored}), or overwrite=True (CLI: --overwrite) "
                    "to start again"
                )

        _import_row_table_writer()
        # ---- state
        self._core = _native.load().StoreCore(max_pending_bytes, self._fsync)
        # the process that made this writer: a process forked from it holds a copy of this
        # object, not the writer thread, the lock or the staging files (see _refuse_other_process)
        self._pid = os.getpid()
        self._staging_finalizer: weakref.finalize | None = None
        if isinstance(self._backend, LocalBackend):
            self._staging = self._backend.root
            self._own_staging = False
        else:
            # (the folders of writers killed before, on this host, go first: store/_staging.py)
            self._staging, lock_fd = make_staging_folder("acs-staging-", str(self._backend))
            self._own_staging = True
            # removed by close / abort / discard, and also when the writer fails to open, is
            # dropped without a close, or is left open at interpreter exit: its shards there
            # were never uploaded, and a resume captures their rows again
            self._staging_finalizer = weakref.finalize(self, _remove_staging, self._core, str(self._staging),
                                                       os.getpid(), lock_fd)
        self._threads_stopped = False
        self._arrays: dict[str, _Array] = {}
        # _refuse_folded_node: the folded node name of each array -> (hook point, node name)
        self._folded_nodes: dict[str, tuple[str, str]] | None = None
        self._order: list[_Array] = []  # the arrays in the order opened: _Batch.cums and _counts follow it
        self._counts = _native.load().RowCounts()  # each array's rows at the last recorded batch
        self._pending: list[_Batch] = []
        self._pending_samples = 0  # samples of the batches in _pending
        self._keep_held = False
        self._partial_bytes = 0  # bytes of the partial shards asked for (_request_partial_shards)
        self._document_bytes = 0  # bytes of the documents and row-table parts commits wrote (maybe_commit)
        # each array's rows at the last recorded batch (_Batch.cums), and the bytes of a row of
        # each (in _order): the bytes appended, in one product (_appended_bytes)
        self._last_cums: np.ndarray = np.zeros(0, dtype=np.int64)
        self._order_row_nbytes: np.ndarray = np.zeros(0, dtype=np.float64)
        self._warned_budget = False  # (its warning: once per capture)  # (the store left its path: its held files are left where it went)
        self._reductions: dict[str, dict] = {}
        self._encoders: dict[str, Any] = {}
        self._encoder_thread: threading.Thread | None = None
        self._seen_version = self._core.durable_version
        self._unpublished = False  # arrays recorded since the root was last written
        # arrays and aliases opened since the last recorded batch: listed from the batch that records
        # the forward they were first seen in (a forward refused or raised partway lists none)
        self._unrecorded: list[_Array] = []
        self._unrecorded_aliases: set[str] = set()
        self._io_pool: Any = None  # thread pool of _set_many, made on first use
        # resume of a local store: (shard file, hard link to it) of each committed last shard
        # the re-fed rows will rewrite; discard() puts them back, a commit drops the links
        self._kept_shards: list[tuple[Path, Path]] = []
        # resume: the reader of the committed rows of those partial last shards (_tail_reader)
        self._tails: Any = None
        self._committed: Any = None  # (_committed_reader)
        # of those, the shards whose rewrite a commit renamed over the key, until a root lists it
        self._installed_shards: set[Path] = set()
        # resume of a local store: key -> hard link to it, of each file of a committed reduction
        # this run rewrites or removes, until a root lists the rewrite (FORMAT.md section 6)
        self._kept_reductions: dict[str, Path] = {}
        self._closed = False
        self._failing = False  # closing after a failure (abort, or the writer thread failed)
        self._lock = threading.RLock()
        st = self._state or {}
        self._created = st.get("created") or F.utc_now()
        # one id per store written (kept by a resume, new for a new store or an overwrite): a
        # reader that opened the store tells a continued run from a replaced store by it
        self._run_id = st.get("run_id") or uuid.uuid4().hex
        self.n_samples_committed = int(st.get("n_samples", 0))
        # the samples the last root written lists (n_samples_committed counts a commit's batches
        # before its documents and root are written: a commit that failed there listed none)
        self._root_n_samples = self.n_samples_committed
        self._n_batches = int(st.get("n_batches", 0))
        self._batches_found = self._n_batches  # (a resume that records no batch changes nothing: see abort)
        # resume, until this run commits a batch: {key: its bytes as found, None where the found
        # store had no such file} of every file a commit of this run wrote besides the root,
        # so that discard() puts the store back as found (see _put_back_found_files)
        self._found_files: dict[str, bytes | None] | None = {} if self._found_root is not None else None
        self._row_tables = json.loads(json.dumps(st.get("row_tables") or {
            kind: {"parts": [], "n_rows": 0, "columns": []} for kind in self._row_kinds}))
        # row-table parts (_write_part, _merge_parts): the bytes decoded of each part known (written by this
        # writer; of a part found by a resume, its file's), the rows of each part known (written by this
        # writer; of a part found by a resume, its footer's, checked against n_rows), the next commit index of
        # each kind, the runs of parts found unfit to merge, and the parts to remove once a root no longer
        # lists them (replaced by a merge, or a merge its commit failed to list)
        self._part_sizes: dict[str, int] = {}
        self._part_rows: dict[str, int] = {}
        self._next_part: dict[str, int] = {}
        self._unmergeable: set[tuple[str, ...]] = set()
        self._dropped_parts: set[str] = set()
        # a store that keeps reductions only: {hook point: {"row_kind", "feature_shape", "dtype",
        # "n_rows"}} of the hook points whose rows were reduced (n_rows: those of committed forwards),
        # listed from the batch that records the forward each was first seen in
        self._reduced: dict[str, dict] = {hp: dict(e) for hp, e in (st.get("reduced") or {}).items()}
        # (the dtype each stored one's rows were reduced as, when this writer opened: stored_dtype)
        self._stored_reduced_dtypes: dict[str, Any] = {hp: e.get("dtype") for hp, e in self._reduced.items()}
        self._unrecorded_reduced: list[str] = []
        self._declared: set[str] = set()  # (open_reduced by this writer)
        # with set_reduction_source: where each commit takes the reductions' states from, the
        # folders of the reduction files the last root lists (per commit: FORMAT.md section 11),
        # and the reduction groups written so far
        self._reduction_source: Any = None
        self._state_write_s = 0.0  # (seconds the last commit took to write them: _due_interval)
        self._listed_commit_folders: set[str] = _commit_folders(st.get("reductions") or {})
        self._reduction_groups: set[str] = set()
        # (row kind, column) -> Arrow type of a user column: one type per column of a store (a
        # resume: those of each kind's first part, which _refuse_damaged_parts reads)
        self._column_types: dict[tuple[str, str], Any] = {}
        self._ids_seen: _SampleIds | None = None  # made with the first batch of given ids (see _check_ids)
        self._old_arrays: dict[str, dict] = dict(st.get("arrays") or {})
        self._warn_kept_compression()
        self._old_reductions: dict = dict(st.get("reductions") or {})
        self.aliases: dict[str, str] = dict(st.get("aliases") or {})
        #: Hook points the store held when this writer opened (arrays and aliases; resume).
        self.stored_hook_points: list[str] = sorted(set(self._old_arrays) | set(self.aliases) | set(self._reduced))
        #: Those whose rows no longer follow the row table (a module not called in every forward).
        self.stored_intermittent: list[str] = sorted(
            hp for hp in self.stored_hook_points
            if not (self._old_arrays.get(self.aliases.get(hp, hp)) or {}).get("follows_row_table", True))
        #: ``{hook point: [reduction names]}`` the store held when this writer opened (resume).
        self.stored_reductions: dict[str, list[str]] = {
            hp: sorted({e.get("reduction") for e in entries.values() if isinstance(e, dict)
                        and isinstance(e.get("reduction"), str)}) for hp, entries in self._old_reductions.items()}
        #: The capture_config the store recorded when this writer opened (resume; empty otherwise).
        config = st.get("capture_config")
        self.stored_capture_config: dict = dict(config) if isinstance(config, dict) else {}
        if self._state is not None:
            self._truncate_to_committed()
            if self.reductions_only:
                self._remove_unlisted_commit_folders()
        # the running counter of default sample ids, as the committed batches left it
        self._committed_next_id = self._stored_next_id(st)
        # the first byte: the root document (status incomplete). An overwrite on object storage writes
        # it over the old run's root before it deletes anything: a reader of the old run sees the store
        # replaced before any of its objects goes or one of this run's is written (FORMAT.md section 7),
        # and one killed in between leaves a new store with no rows (a resume removes the old arrays)
        write_root_first(self._backend, self._root_attrs("incomplete"), replacing=self._replacing)
        if not self.reductions_only:  # (no array: no acts/ group)
            self._backend.set("acts/zarr.json", F.dumps(F.group_document()))

    @property
    def _row_kinds(self) -> tuple[str, ...]:
        """The row tables this store holds: a store that keeps reductions only has no token
        table (one row per token of a large capture would be most of its bytes)."""
        return ("sample",) if self.reductions_only else ROW_KINDS

    def _load_column_types(self, kind: str, schema: Any) -> None:
        """Types of the user columns already stored (resume): from the Arrow ``schema`` of
        ``kind``'s first part (read once, by :meth:`_refuse_damaged_parts`)."""
        import pyarrow as pa

        for f in schema:
            if (f.name not in _RESERVED[kind] or f.name == "sample_id") and not pa.types.is_null(f.type):
                self._column_types[(kind, f.name)] = f.type

    def _user_columns(self, columns: Mapping[str, Any], mask: torch.Tensor | None, n: int | None
                      ) -> list[tuple[str, str, Any, Any]]:
        """``(kind, name, values, Arrow type or None for a column of Nones)`` of user columns, checked against the names
        the writer fills and the types of the same columns in earlier batches.

        Raises ArgumentValueError (a reserved name, a wrong length) or ArgumentTypeError (a
        type other than the column's earlier batches'); nothing is recorded.
        """
        import pyarrow as pa

        out = []
        for key, col in (columns or {}).items():
            if (isinstance(col, np.ndarray) and col.ndim >= 2 and col.dtype.kind in "biuf" and col.dtype.isnative
                    and mask is not None and tuple(col.shape[:2]) == tuple(mask.shape)):
                col = torch.from_numpy(np.ascontiguousarray(col))  # a (batch, pos) numpy column: per token, as a tensor
            is_token = isinstance(col, torch.Tensor) and _native.load().is_token_rows(col, mask)  # the sink's rule
            kind = "token" if is_token else "sample"
            other = "sample" if is_token else "token"
            if ((mask is not None or n is not None) and (other, key) in self._column_types
                    and (kind, key) not in self._column_types):
                # a column is per token or per sample for the whole store: a per-token column given
                # again at a forward of another pos (a sticky description at a generate() step)
                # would turn into per-sample lists, its token rows left null, without a word
                self._refuse_column_kind(key, col, mask, was_token=not is_token)
            if key in _RESERVED[kind]:
                raise ArgumentValueError(f"column {key!r} clashes with a reserved row-table column "
                                         f"{list(_RESERVED[kind])}; rename it")
            if key in self._arrays or key in self._old_arrays or key in self.aliases:
                # (a dataset and the exports name columns and hook points in one namespace: the
                # store would be written, then refused at every read that selects both)
                raise ArgumentValueError(
                    f"column {key!r} has the name of a hook point of store {str(self._backend)!r}: a dataset and an "
                    "export read columns and hook points by one name, so one would hide the other; rename the column")
            if key == "rank" and self.rank_store is not None:
                raise ArgumentValueError(
                    "column 'rank' clashes with the rank column a multi-rank store adds to its row tables (this "
                    f"is rank {self.rank_store.get('rank')} of {self.rank_store.get('world_size')}); rename it")
            if is_token:
                values = _to_column(col.detach().to("cpu")[mask])
            else:
                check_column(key, col)
                values = _to_column(col)
                if n is not None and len(values) != n:
                    raise ArgumentValueError(f"column {key!r} has {len(values)} entries, expected n_samples={n}")
            try:
                typ = _arrow_type(values)
            except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, TypeError) as e:
                # (complex values: Parquet has no such type, pyarrow says "Unsupported numpy type 14")
                cplx = getattr(values, "dtype", None) is not None and values.dtype.kind == "c"
                why = "complex values: Parquet has no complex type" if cplx else str(e)
                fix = ("store col.real and col.imag as two columns" if cplx
                       else "give it values of one type (numbers, strings or bools)")
                raise ArgumentTypeError(f"column {key!r} cannot be stored in the row table ({why}); {fix}") from None
            before = self._column_types.get((kind, key))
            if before is not None and typ is not None and typ != before:
                raise ArgumentTypeError(
                    f"column {key!r} holds {typ} values in this batch, but {before} in the earlier batches of "
                    f"{str(self._backend)!r}; a row-table column has one type: give it the same type in every "
                    "batch (e.g. labels.long() or labels.float()), or use another column name"
                )
            out.append((kind, key, values, typ))
        return out

    def _refuse_column_kind(self, key: str, col: Any, mask: torch.Tensor | None, *, was_token: bool) -> None:
        """Raise ArgumentValueError for a user column whose values this batch would store as the
        other row kind than in the earlier batches of the store (per token, then per sample, or
        the reverse): a column is one or the other for the whole store."""
        shape = tuple(col.shape) if hasattr(col, "shape") else f"a {type(col).__name__} of {len(col)} entries"
        forward = ("(batch, pos) = " + str(tuple(mask.shape))) if mask is not None else "no token mask"
        where = f"the earlier batches of {str(self._backend)!r}"
        if was_token:
            raise ArgumentValueError(
                f"column {key!r} is a per-token column in {where} (a (batch, pos) tensor, one value per real "
                f"token), but this batch gives it shape {shape} while the forward has {forward}, so it would be "
                "stored per sample and its token rows left null; a column is per token or per sample for the whole "
                "store. A generate() step after the prompt is a (batch, 1) forward that keeps the prompt's sticky "
                "description: describe each step from a forward pre-hook of the model with "
                f"set_batch(same_samples=True, {key}=<the step's (batch, 1) values, e.g. kwargs['input_ids']>), or "
                f"without {key!r}; otherwise give it this forward's (batch, pos) shape, or store per-sample values "
                "under another name")
        raise ArgumentValueError(
            f"column {key!r} is a per-sample column in {where}, but this batch gives it shape {shape}, the token "
            f"mask's {forward}, so it would be stored per token; a column is per token or per sample for the whole "
            f"store. A per-sample (batch, k) tensor whose k only happens to equal pos: give it as a list of one array "
            f"per sample ({key}=list(values.cpu().numpy()), the same Arrow type), which stays per sample; otherwise "
            "store per-token values under another name")

    def _sample_ids_type(self, ids: Any) -> Any:
        """The Arrow type of a batch's sample ids (``_to_column``'s), checked against the sample
        ids of the earlier batches (and of the store, on resume).

        Raises ArgumentTypeError naming both types; nothing is recorded."""
        try:
            typ = _arrow_type(ids)
        except Exception as e:  # pyarrow's ArrowInvalid / ArrowTypeError
            raise ArgumentTypeError(f"sample_ids cannot be stored in the row table ({e}); give ints or strings") from None
        import pyarrow as pa

        if typ is not None and pa.types.is_nested(typ):  # e.g. a (batch, k) tensor: k values a sample, no id
            raise ArgumentTypeError(
                f"sample_ids must hold one id per sample (ints or strings), got {typ} values (a sequence per "
                "sample, e.g. a 2-D tensor); give one id per sample, and keep other values per sample as a column")
        _check_id_values(ids)
        before = self._column_types.get(("sample", "sample_id"))
        if typ is not None and before is not None and typ != before:
            raise ArgumentTypeError(
                f"sample_ids holds {typ} values in this batch, but {before} in the earlier batches of "
                f"{str(self._backend)!r}; the sample_id column has one type: give every batch sample ids of the "
                "same type (e.g. torch.int64, as the default ids), or capture into another store"
            )
        return typ

    def check_sample_ids(self, sample_ids: Any) -> None:
        """Check a batch's sample ids before a forward (``Tracker.set_batch``) as
        :meth:`add_batch` will: their type against the earlier batches'. Records nothing.

        Parameters
        ----------
        sample_ids : sequence of int or str, 1-D Tensor / ndarray (batch,), or pyarrow Array
            The batch's sample ids, as ``Tracker.set_batch`` takes them.

        Raises
        ------
        TypeError
            Sample ids of another Arrow type than the earlier batches' (``int64`` then
            ``int32``, ints then strings).
        """
        with self._lock:
            self._sample_ids_type(_to_column(sample_ids))

    def check_columns(self, columns: Mapping[str, Any], token_mask: torch.Tensor | None = None) -> None:
        """Check user columns before a forward (``Tracker.set_batch``) as :meth:`add_batch`
        will: names, and types against the column's earlier batches. Records nothing.

        Parameters
        ----------
        columns : mapping of str to sequence, Tensor / ndarray (batch,) or (batch, pos)
            User columns of the batch, as ``Tracker.set_batch`` takes them.
        token_mask : Tensor, (batch, pos), bool or integer, any device, optional
            The attention mask of token rows: a ``(batch, pos)`` column keeps the values of real
            tokens only.

        Raises
        ------
        ValueError
            A reserved column name (``sample_id``, ``pos``, ``batch``).
        TypeError
            A column whose Arrow type differs from its type in earlier batches of the store
            (``int64`` then ``double``, ...), or values of no single type.
        """
        mask = None if token_mask is None else token_mask.detach().to("cpu").to(torch.bool)
        with self._lock:
            self._user_columns(columns, mask, None)

    def _root_reductions(self) -> dict:
        """The root's ``reductions``: the stored ones, each replaced by this run's of its name."""
        reductions = {hp: dict(entries) for hp, entries in self._old_reductions.items()}
        for hp, entries in self._reductions.items():  # per name: a reduction not continued stays (as partial)
            names = {e.get("reduction") for e in entries.values()}
            kept = {k: e for k, e in reductions.get(hp, {}).items() if e.get("reduction") not in names}
            reductions[hp] = {**kept, **entries}  # a rewritten reduction keeps none of its old keys
        return reductions

    def _root_attrs(self, status: str) -> dict:
        arrays = dict(self._old_arrays)
        for hp, a in self._arrays.items():
            if a.recorded:
                arrays[hp] = a.meta()
        reductions = self._root_reductions()
        # a store that keeps reductions only: version 3, rows_stored and reduced in place of arrays and
        # aliases (FORMAT.md section 11: a version 2 reader refuses it, never reads it as a store of no rows)
        only = self.reductions_only
        return {
            "format": {"name": F.FORMAT_NAME, "version": F.REDUCTIONS_ONLY_VERSION if only else
                       F.SEGMENTS_VERSION if self._segmented else F.FORMAT_VERSION},
            "status": status,
            "created": self._created,
            "run_id": self._run_id,
            "updated": F.utc_now(),
            "library": _library_versions(),
            "model": self._model_record(),
            "capture_config": self._capture_config,
            "storage_dtype": self._storage_dtype,
            "provenance": self._provenance,
            "n_samples": self.n_samples_committed,
            "n_batches": self._n_batches,
            "next_sample_id": self._committed_next_id,
            **({"rows_stored": False} if only else {"arrays": arrays}),
            "row_tables": self._row_tables,
            "reductions": reductions,
            **({"reduced": {hp: dict(e) for hp, e in self._reduced.items() if hp not in self._unrecorded_reduced}}
               if only else
               {"aliases": {hp: t for hp, t in self.aliases.items() if hp not in self._unrecorded_aliases}}),
            **({"rank_store": dict(self.rank_store)} if self.rank_store else {}),
        }

    def _model_record(self) -> dict | None:
        """The root document's ``model``: this writer's model's identity (a new store's is
        waited for by the first commit that lists rows, and by the close; roots written before,
        with no rows, have none while it is being hashed), else the stored one (a resume
        without a model)."""
        if self._model is None and self._model_hash is not None and (
                self._model_hash.done() or self._n_batches > 0 or self._closed):
            self._model, self._model_hash = self._model_hash.get(), None
        return self._model if self._model is not None else (self._state or {}).get("model")

    def _check_committed_counts(self) -> None:
        """Resume: refuse a root whose counts disagree with each other (FORMAT.md section 9:
        what ``verify`` checks of them), before anything is deleted or written.

        The resumed run continues after ``n_samples`` samples (what a caller skips) and after
        each array's ``n_rows`` rows: ``n_samples`` other than the sample table's ``n_rows``, or
        an array that follows its row table with more rows than the table, would put the
        resumed rows next to other samples than theirs.

        Raises
        ------
        StoreCorruptError
            Naming both counts; nothing was deleted or written.
        """
        tables = self._row_tables  # (n_samples is the sample table's n_rows: checked with the root at open)
        end = "; nothing was deleted or written"
        for hp, meta in self._old_arrays.items():
            if not meta.get("follows_row_table", True):
                continue
            kind = meta["row_kind"]
            table_rows = int((tables.get(kind) or {}).get("n_rows", 0))
            if int(meta["n_rows"]) > table_rows:
                raise V.corrupt(self._backend, f"zarr.json says hook point {hp!r} has n_rows {meta['n_rows']}, more "
                                f"than the {table_rows} rows of the {kind} row table it follows{end}")

    def _truncate_to_committed(self) -> None:
        """Resume: drop every shard and row-table part past the committed prefix.

        Each array's root entry is first checked against the array's own document (FORMAT.md
        section 9 rule 17): which shards are deleted, and how the rows appended next are laid
        out, follow the root's ``shard_rows`` and ``chunk_rows``, so a root that lies about them
        must not delete or mix committed rows. An array document whose ``shape[0]`` is past the
        committed rows (a commit killed before its root) is written again with ``n_rows`` rows
        before the shards past them are deleted: a plain Zarr reader never reads those rows as
        fill values, even when this resume is killed before its first commit.
        """
        b = self._backend
        self._check_committed_counts()
        ahead: dict[str, dict] = {}  # hook point -> its array document, whose shape[0] is past n_rows
        for hp, meta in self._old_arrays.items():
            doc_key = f"{meta['path']}/zarr.json"
            raw = b.get(doc_key, max_bytes=V.MAX_JSON_BYTES)
            if raw is not None:
                doc = V.loads_json(raw, store=b, key=doc_key)
                problems = V.array_document_problems(doc, meta, hook_point=hp, doc_key=doc_key)
                if problems:
                    raise V.corrupt(b, "; ".join(problems) + "; nothing was deleted or written")
                if doc["shape"][0] > int(meta["n_rows"]):
                    ahead[hp] = doc
        listed = self._refuse_missing_shards()
        parts = self._refuse_missing_parts()
        self._refuse_damaged_parts()
        if isinstance(b, LocalBackend):
            for hp, meta in self._old_arrays.items():
                self._refuse_linked_folders(meta["path"], hp, int(meta["n_rows"]) // int(meta["shard_rows"]),
                                            not meta["feature_shape"], "; nothing was deleted or written")
        if isinstance(b, LocalBackend):
            self._refuse_unwritable_reduction_keys()
        self._remove_temp_files()  # the writer killed before this one left them (no array writer of ours yet)
        if isinstance(b, LocalBackend):
            self._restore_kept_reductions()
        found = None
        if isinstance(b, LocalBackend) and self._old_arrays:
            from .reader import Store

            found = Store(b)
        for hp, meta in self._old_arrays.items():
            path, n = meta["path"], int(meta["n_rows"])
            shard_rows = int(meta["shard_rows"])
            keep_shards = -(-n // shard_rows)  # shards holding committed rows
            if found is not None:
                self._restore_kept_shard(found, hp)
            if hp in ahead:  # (a commit killed before its root wrote it): down to the committed rows before the
                # shards past them go, so that no plain Zarr reader reads their rows as fill values meanwhile
                ahead[hp]["shape"][0] = n
                b.set(f"{path}/zarr.json", F.dumps(ahead[hp]))
            for key in list(b.list(f"{path}/") if listed is None else listed[hp]):
                rel = key[len(path) + 1:]
                if rel.endswith(".tmp") or "/.tmp" in rel or rel.split("/")[-1].startswith("shard-"):
                    b.delete(key)
                elif rel.startswith("c/"):
                    try:
                        k = int(rel.split("/")[1])
                    except (IndexError, ValueError):
                        continue
                    # a shard past the committed ones (a file of another name there is no shard: kept)
                    if k >= keep_shards and key == F.shard_key(path, k, len(meta["feature_shape"])):
                        b.delete(key)
        for kind, tbl in self._row_tables.items():
            listed = set(tbl.get("parts", []))
            for key in parts[kind]:
                if key not in listed:
                    b.delete(key)
        if not isinstance(b, LocalBackend):
            self._remove_unlisted_arrays()

    def _remove_unlisted_arrays(self) -> None:
        """Resume of a store on object storage: delete the objects under ``acts/`` of arrays the
        root does not list. An overwrite killed after it replaced the root leaves the old run's
        there (FORMAT.md section 7): none of their rows is committed, and a hook point of this
        run must not find another run's document, manifest or shards at its array's path."""
        b = self._backend
        listed = {meta["path"] for meta in self._old_arrays.values()}
        for key in list(b.list("acts/")):
            if key != "acts/zarr.json" and "/".join(key.split("/")[:2]) not in listed:
                b.delete(key)

    def _refuse_missing_parts(self) -> dict[str, list[str]]:
        """Resume: refuse, before anything is deleted or written, a row table whose listed part
        is missing or (locally) not a regular file: the resume would mark the store complete
        without those rows. Returns the listing of each kind's folder (``{kind: keys}``), which
        the truncation deletes unlisted parts from.

        Raises
        ------
        StoreCorruptError
            Naming the row table, the part and the fix; nothing was deleted or written.
        """
        b = self._backend
        found: dict[str, list[str]] = {}
        for kind, tbl in self._row_tables.items():
            found[kind] = list(b.list(f"rows/{kind}/"))
            there = set(found[kind])
            for key in tbl.get("parts", []):
                if isinstance(b, LocalBackend):
                    damage = self._shard_damage(key, None)
                else:
                    damage = None if key in there else "missing"
                if damage is not None:
                    raise V.corrupt(
                        b, f"cannot resume: row table {kind!r}: its part {key!r}, listed in zarr.json, is {damage}, "
                           "and a resume would mark the store complete without its rows; nothing was deleted or "
                           "written",
                        fix="restore that file from an intact copy of the store, or capture it again "
                            "(`activationscope verify STORE` lists every damaged file)")
        return found

    def _refuse_damaged_parts(self) -> None:
        """Resume: refuse, before anything is deleted or written, a row table that readers and
        ``verify`` refuse (FORMAT.md section 9 rule 15): a listed part whose bytes fail the
        crc32c the root records for it, or that is not readable Parquet, or that lacks a required
        column or holds one of another type (FORMAT.md section 4: a part without ``sample_id``
        reads as rows of null ids), or parts that together hold another number of rows than
        the table's ``n_rows``. A resume keeps every listed part
        (it drops only unlisted ones, and recomputes none) and appends after them: it would mark
        the store complete on a table whose rows no reader returns. One part in memory at a time,
        and none decoded whose footer says more rows than ``n_rows`` leaves (Parquet allocates by it).
        The schema of each kind's first part gives the types of its user columns
        (:meth:`_load_column_types`): each part is read once.

        Raises
        ------
        StoreCorruptError
            Naming the row table, the part, both values and the fix; nothing was deleted or
            written.
        """
        import pyarrow as pa
        import pyarrow.parquet as pq

        b = self._backend
        end = "; a resume keeps every listed part and appends after it, so it would mark the store complete on " \
              "a row table no reader returns; nothing was deleted or written"
        fix = ("restore that file from an intact copy of the store, or capture the store again with overwrite=True "
               "(`activationscope verify STORE` lists every damaged file)")
        dist = self._state.get("distributed") if isinstance(self._state, dict) else None
        by_rank = isinstance(dist, dict) and dist.get("committed") is True
        for kind, tbl in self._row_tables.items():
            crcs = tbl.get("crc32c") or {}
            total = 0
            for i, key in enumerate(tbl.get("parts", [])):
                raw = b.get(key, max_bytes=V.MAX_FILE_BYTES)
                if raw is None:  # (gone since _refuse_missing_parts looked: refused as missing)
                    raise V.corrupt(b, f"cannot resume: row table {kind!r}: its part {key!r}, listed in zarr.json, is "
                                       f"missing{end}", fix=fix)
                self._part_sizes[key] = len(raw)  # (an estimate of its bytes decoded: the merge reads it)
                want = crcs.get(key)
                got = F.crc32c(raw) if want is not None else None
                if want is not None and got != int(want):
                    raise V.corrupt(b, f"cannot resume: row table {kind!r}: part {key!r} has crc32c {got:08x}, but "
                                       f"zarr.json records {int(want):08x} for it (its bytes changed since they were "
                                       f"committed){end}", fix=fix)
                try:
                    footer = pq.read_metadata(pa.BufferReader(raw))
                    schema = footer.schema.to_arrow_schema()
                except Exception as e:  # noqa: BLE001 - any Parquet failure
                    raise V.corrupt(b, f"cannot resume: row table {kind!r}: part {key!r} is not a readable Parquet "
                                       f"file ({e}){end}", fix=fix) from None
                if i == 0:
                    self._load_column_types(kind, schema)
                total += footer.num_rows
                self._part_rows[key] = footer.num_rows  # (their sum checked against n_rows below)
                if total > int(tbl.get("n_rows", 0)):  # (before its columns are decoded: allocated by that count)
                    raise V.corrupt(b, f"cannot resume: row table {kind!r}: its parts up to {key!r} hold {total} rows "
                                       f"by their footers, but zarr.json says n_rows {tbl.get('n_rows', 0)}{end}",
                                    fix=fix)
                # its required columns (FORMAT.md section 4): a part without sample_id reads as null ids
                problem = V.row_part_problem(schema, kind, by_rank)
                if problem is None:  # (their nulls: the integer columns decoded, bounded as a reader reads them)
                    ints = [c for c in V.required_columns(kind, by_rank) if c != "sample_id"]
                    problem = V.row_part_problem(schema, kind, by_rank,
                                                 read_parquet_part(raw, b, key, columns=ints, metadata=footer))
                if problem is not None:
                    raise V.corrupt(b, f"cannot resume: row table {kind!r}: part {key!r} {problem}{end}", fix=fix)
            if total != int(tbl.get("n_rows", 0)):
                raise V.corrupt(b, f"cannot resume: row table {kind!r}: its parts hold {total} rows, but zarr.json "
                                   f"says n_rows {tbl.get('n_rows', 0)}{end}", fix=fix)

    def _refuse_missing_shards(self) -> dict[str, list[str]] | None:
        """Resume: refuse, before anything is deleted or written, an array whose committed rows
        need a shard file that is not there (FORMAT.md section 9 rule 11). A resume re-reads
        only the partial last shard; it appended after a missing full one, leaving a hole that
        readers and ``verify`` then reported.

        A local store is checked by one ``stat`` per committed shard (the partial last one is
        also there when an earlier resume kept its committed file, ``<key>.committed.tmp``,
        which this resume puts back); an object store by one listing of each array's folder,
        the listing the truncation deletes from, which is returned (``{hook point: keys}``;
        None for a local store).

        Raises
        ------
        StoreCorruptError
            Naming the hook point, its array, the first missing shard's key and the fix;
            nothing was deleted or written.
        """
        b = self._backend
        local = isinstance(b, LocalBackend)
        listed: dict[str, list[str]] | None = None if local else {}
        for hp, meta in self._old_arrays.items():
            path, n, shard_rows = meta["path"], int(meta["n_rows"]), int(meta["shard_rows"])
            if listed is not None:
                listed[hp] = list(b.list(f"{path}/"))
                found = set(listed[hp])
            sizes = self._committed_shard_sizes(hp, meta) if local and n >= shard_rows else {}
            for k in range(-(-n // shard_rows)):
                key = F.shard_key(path, k, len(meta["feature_shape"]))
                damage = None
                if local:
                    there = os.path.exists(b.root / key) or (
                        (k + 1) * shard_rows > n and os.path.exists(b.root / (key + KEPT_SUFFIX)))
                    link = not there and os.path.islink(b.root / key)
                    if there and (k + 1) * shard_rows <= n:  # a whole shard, never read again by the resume
                        damage = self._shard_damage(key, sizes.get(k))
                else:
                    there, link = key in found, False
                if not there:
                    raise V.corrupt(
                        b, f"cannot resume: hook point {hp!r} (array {path!r}): its shard {key!r} is "
                           f"{'a symbolic link to a missing file' if link else 'missing'}, but its rows "
                           f"{k * shard_rows}.. are committed (n_rows {n}), and a resume would leave them a hole "
                           "that readers refuse; nothing was deleted or written")
                if damage is not None:
                    raise V.corrupt(
                        b, f"cannot resume: hook point {hp!r} (array {path!r}): its shard {key!r}, whose rows "
                           f"{k * shard_rows}..{(k + 1) * shard_rows - 1} are committed, is {damage}, and a resume "
                           "would mark the store complete around it; nothing was deleted or written",
                        fix="restore that file from an intact copy of the store, or capture it again "
                            "(`activationscope verify STORE` lists every damaged file)")
        return listed

    def _committed_shard_sizes(self, hook_point: str, meta: Mapping[str, Any]) -> dict[int, int]:
        """Resume of a local store: ``{shard: file_bytes}`` of the committed shards its manifest
        lists ({} without a manifest; a damaged one is named by the reads that need it)."""
        key = meta.get("manifest") or f"{meta['path']}/manifest.json"
        try:
            raw = self._backend.get(key, max_bytes=V.MAX_JSON_BYTES)
            if raw is None:
                return {}
            shards = V.parse_manifest(V.loads_json(raw, store=self._backend, key=key), meta, store=self._backend,
                                      key=key)
        except StoreError:
            return {}
        # (every segment read and checked: a damaged one refuses the resume, naming it, before anything is deleted)
        return {int(k): int(rec["file_bytes"]) for k, rec in shards.items() if isinstance(rec.get("file_bytes"), int)}

    def _shard_damage(self, key: str, file_bytes: int | None) -> str | None:
        """What is wrong with the committed file (a shard, a row-table part) at ``key`` of a
        local store (not a regular file, or of another size than ``file_bytes``), or None."""
        try:
            st = os.stat(self._backend.path(key))
        except FileNotFoundError:
            return "missing"
        except (OSError, StoreError) as e:
            return f"unreadable ({e})"
        if not stat.S_ISREG(st.st_mode):
            return _kind(st.st_mode)
        if file_bytes is not None and st.st_size != file_bytes:
            return f"{st.st_size} bytes where its manifest records {file_bytes} (truncated or written into)"
        return None

    def _refuse_linked_folders(self, path: str, hook_point: str, first_shard: int, flat: bool, done: str) -> None:
        """Local stores: refuse the folders the writer thread writes an array's shards into
        (``path``, ``path/c`` and ``path/c/<shard>`` from ``first_shard`` on) where one is a
        symbolic link or not a folder, and, for an array without features (``flat``: its
        shards are the files ``path/c/<shard>``), a folder where it writes a shard (the files
        there are shards past the committed rows, deleted by the resume): it writes
        no file through a link (one may point outside the store) and would fail at that shard,
        mid-capture. ``done``: what was changed so far."""
        root = self._backend.root
        found = []
        for rel in (path, f"{path}/c"):
            p = root / rel
            if p.is_symlink() or (p.exists() and not p.is_dir()):
                found.append(rel)
                break
        else:
            c = root / path / "c"
            if c.is_dir():
                with os.scandir(c) as entries:
                    found = sorted((f"{path}/c/{e.name}" for e in entries
                                    if (e.is_symlink() or e.is_dir(follow_symlinks=False) == flat)
                                    and e.name.isascii() and e.name.isdigit() and int(e.name) >= first_shard),
                                   key=lambda k: int(k.rsplit("/", 1)[1]))
        if found:
            link, folder = (root / found[0]).is_symlink(), (root / found[0]).is_dir()
            meta = self._old_arrays.get(hook_point)
            held = -(-int(meta["n_rows"]) // int(meta["shard_rows"])) if meta else 0  # shards of committed rows
            if found[0].count("/") > 2:  # c/<shard>: the partial last shard's may hold committed rows
                held = int(found[0].rsplit("/", 1)[1]) < held
            them = "them" if len(found) > 1 else "it"
            if link:
                what = "a symbolic link"
                why = "a writer writes no file through a link (one may point outside the store)"
                fix = ("replace it with a copy of the folder it points to (committed rows are in it)" if held else
                       f"remove {them} (the link, not what it points to)")
            elif folder:
                what, why, fix = "a folder", "a shard of an array without features is a file", f"move {them} away"
            else:
                what, why, fix = "not a folder", "the writer makes a folder there", f"move {them} away"
            raise StoreError(
                f"cannot write hook point {hook_point!r} into {str(self._backend)!r}: {found[0]!r} is {what}, where "
                f"the writer writes the array's shards{f' ({len(found)} such entries)' if len(found) > 1 else ''}; "
                f"{why}: {fix}, then resume again{done}")

    def _store_lost(self) -> str | None:
        """Why the store at this writer's path is no longer the one it locked (its folder
        moved, removed or replaced, or its lock deleted), remembered once found; None while
        it is. Nothing more may be written there: it may be another writer's store. Once
        found, the writer thread writes no chunk still queued and every later append of rows
        is refused (:class:`StoreError`, :meth:`_lost_message`)."""
        if self._lost is None:
            self._lost = self._writer_lock.lost()
            core = getattr(self, "_core", None)  # (none yet: a writer that failed to open)
            if self._lost is not None and core is not None:
                core.refuse(self._lost_message(self._lost))
        return self._lost

    def _lost_message(self, why: str) -> str:
        """The error of a writer whose store is no longer at its path (see :meth:`_store_lost`)."""
        where = str(self._backend)
        if isinstance(self._backend, LocalBackend):
            return (f"store {where!r} was moved, removed or replaced while this writer wrote it ({why}); nothing more "
                    f"is written at {where!r}, so whatever is there now stays as it is. The rows this writer committed "
                    "are in the store's folder wherever it went (moved: resume=True there continues them); write one "
                    "store from one capture at a time, and move or delete a store only once its capture has ended")
        return (f"store {where!r}: {why}, while this writer held it (deleted by hand, and maybe taken by another "
                "writer); this writer writes nothing more there, so another writer's rows stay as they are. Rows "
                "committed before stay readable; resume=True continues once no other writer holds the store")

    def _check_still_held(self) -> None:
        """Raise :class:`StoreError` when the store at this writer's path is no longer the
        one it locked (see :meth:`_store_lost`), before anything is written there."""
        why = self._store_lost()
        if why is not None:
            raise StoreError(self._lost_message(why))

    def _refuse_if_lost(self) -> None:
        """Raise :class:`StoreError` when a commit (or close) of this writer found its store
        no longer at its path: nothing more of it is recorded or written (no new stat here)."""
        if self._lost is not None:
            raise StoreError(self._lost_message(self._lost))

    def _raise_if_failed(self) -> None:
        self._refuse_if_lost()  # (the writer thread's error then is that one, without the advice below)
        if self._core.failed:
            raise StoreError(
                f"the store writer of {str(self._backend)!r} failed: {self._core.error}; {AFTER_FAILURE}")

    # ------------------------------------------------------------------ arrays
    def _warn_kept_compression(self) -> None:
        """A resume asking for another compression than its stored arrays': they keep theirs
        (their shards go on as they are), which the user is told."""
        if self._compression is None or not self._old_arrays:
            return
        other = {hp: meta.get("compression") for hp, meta in self._old_arrays.items()
                 if F.codec_for_array(self._compression, meta["dtype"]) != meta.get("compression")}
        if not other:
            return
        names = sorted(other)
        kept = sorted({c["name"] if c else "uncompressed" for c in other.values()})
        warn_at_caller(
            f"store {str(self._backend)!r}: the resumed capture asks for compression {self._compression['name']!r}, "
            f"but the stored hook points {names[:5]}{' ...' if len(names) > 5 else ''} are {', '.join(kept)}: a resume "
            "keeps each stored array's compression and layout, so compression= applies to hook points new in this "
            "run only (a capture into a new store compresses every hook point)",
            RuntimeWarning)

    def open_array(self, hook_point: str, feature_shape: tuple, dtype: torch.dtype, row_kind: str) -> Any:
        """Create (or, when resuming, reopen) the array of a hook point; returns its native writer.

        A new array is listed in the root from the :meth:`add_batch` that records the forward
        it was opened in; one whose forward is never recorded (refused or raised partway) is
        never listed, and :meth:`close` / :meth:`abort` remove its files
        (:attr:`unrecorded_hook_points`).

        Parameters
        ----------
        hook_point : str
        feature_shape : tuple of int
            Shape of one row.
        dtype : torch.dtype
            Stored dtype (rows of another dtype are cast on append).
        row_kind : {"sample", "token"}

        Returns
        -------
        _C.ArrayWriter
            A ``RowConsumer``: the sink calls ``append(rows, ready)`` without the GIL.

        Raises
        ------
        StoreError
            The writer is closed, or a resumed array has another shape / dtype / row kind; or
            an earlier commit or close found the store at the writer's path no longer the one
            it locked (moved, removed, or its lock deleted and taken): nothing more is written.
        ValueError, TypeError
            Unsupported dtype, invalid feature shape or row kind.
        """
        self._refuse_other_process("a hook point opened")
        self._refuse_if_lost()
        if self.reductions_only:
            raise StoreError(f"hook point {hook_point!r}: the store writer of {str(self._backend)!r} keeps reductions "
                             "only (reductions_only=True) and opens no array; declare the hook point with open_reduced")
        with self._lock:
            if self._closed:
                raise StoreError(f"the store writer of {str(self._backend)!r} is closed")
            if hook_point in self._arrays:
                raise StoreError(f"hook point {hook_point!r} already has an array in this store writer")
            if any(col == hook_point for _, col in self._column_types):
                raise ArgumentValueError(
                    f"hook point {hook_point!r} has the name of a row-table column of store {str(self._backend)!r} "
                    "(given to set_batch): a dataset and an export read columns and hook points by one name, so one "
                    f"would hide the other; rename the column, or leave the hook point out "
                    f"(exclude_hook_points=[{hook_point!r}])")
            name = F.parse_dtype(dtype, f"dtype of hook point {hook_point!r}")
            if row_kind not in ROW_KINDS:
                raise ArgumentValueError(f"row_kind must be one of {list(ROW_KINDS)}, got {row_kind!r}")
            feature_shape = tuple(int(d) for d in feature_shape)
            if any(d < 0 for d in feature_shape):
                raise ArgumentValueError(f"feature_shape of hook point {hook_point!r} must be non-negative, got {feature_shape}")
            node = F.node_name(hook_point)
            old = self._old_arrays.get(hook_point)
            if old is not None:  # (its stored folder: one of F.node_names, an older store's name too)
                node = str(old["path"]).partition("/")[2]
                got = (list(feature_shape), name, row_kind)
                want = (list(old["feature_shape"]), old["dtype"], old["row_kind"])
                if got != want:
                    floats = ("float16", "bfloat16", "float32", "float64")
                    fix = "resume with the same model and options, or overwrite=True"
                    if got[0::2] == want[0::2] and name in floats and old["dtype"] in floats:
                        # the same model and options give another float dtype under another autocast
                        fix = (f"its forwards now give {name} where the stored ones gave {old['dtype']}: a forward under "
                               "torch.autocast and one outside it (or a model cast with .half() / .to(dtype) since) "
                               "give such a change; resume with the forwards run as the stored ones were, or "
                               "overwrite=True")
                    raise StoreError(
                        f"hook point {hook_point!r} is stored with (feature_shape, dtype, row_kind) = {want} but the "
                        f"resumed capture gives {got}; {fix}"
                    )
                chunk_rows = int(old["chunk_rows"])
                shard_chunks = int(old["shard_rows"]) // chunk_rows
                compression = old.get("compression")
                committed = int(old["n_rows"])
            else:
                if self._shard_rows is not None:
                    chunk_rows, shard_chunks = F.chunk_layout_for_shard_rows(
                        feature_shape, name, self._shard_rows[row_kind], self._chunk_rows,
                        compressed=self._compression is not None)
                else:
                    chunk_rows, shard_chunks = F.chunk_layout(feature_shape, name, self._chunk_rows, self._shard_bytes,
                                                                compressed=self._compression is not None)
                compression = F.codec_for_array(self._compression, name)
                committed = 0
            if old is None:
                self._refuse_folded_node(hook_point, node)
            arr = _Array(hook_point, node, f"acts/{node}", feature_shape, name, row_kind, chunk_rows, shard_chunks,
                         compression, committed_rows=committed)
            if old is None and isinstance(self._backend, LocalBackend):  # (a stored array's: checked by the resume)
                self._refuse_linked_folders(arr.path, hook_point, 0, not feature_shape, "; the committed rows are unchanged")
            if isinstance(self._backend, LocalBackend) and (self._found_root is not None or old is None):
                # (for a discard, and for the close that removes the folders of an unrecorded array)
                arr.folder_found = os.path.lexists(self._backend.root / arr.path)
                arr.chunks_found = os.path.lexists(self._backend.root / arr.path / "c")
            start = (committed // arr.shard_rows) * arr.shard_rows
            if committed > start and isinstance(self._backend, LocalBackend):
                arr.held_shard = committed // arr.shard_rows
            array_dir = self._staging / arr.path  # made by the writer thread with the first shard
            writer = _native.load().ArrayWriter(
                self._core, hook_point, str(array_dir), str(array_dir), F.torch_dtype(name), list(feature_shape),
                chunk_rows, shard_chunks, start, compression is not None, arr.held_shard,
                # every folder from the store's (or staging) folder down opened without following a link
                root=str(self._staging),
            )
            arr.writer = writer
            if compression is not None:
                self._encoders[hook_point] = F.numcodecs_encoder(compression)
                self._start_encoder()
            if old is None and self._n_batches + len(self._pending) > 0:
                # first seen after some forwards: its row 0 is not the first sample's
                arr.follows_row_table = False
            if old is not None:
                arr.follows_row_table = bool(old.get("follows_row_table", True))
                arr.manifest = self._load_manifest(arr)
                arr.manifest_dirty = True  # rewritten without the shards past the committed rows
                if committed > start:  # re-feed the committed rows of the partial last shard
                    st = self._tail_reader()
                    try:
                        # read first: a missing or damaged shard is named as such (by the reader's checks)
                        rows = st._read_rows(hook_point, start, committed, copy=True)
                    finally:
                        st.close()  # (its mapping of the shard dropped: the rewrite replaces the file)
                    self._keep_committed_shard(arr, committed // arr.shard_rows)
                    writer.append(rows)
            self._arrays[hook_point] = arr
            self._order.append(arr)
            self._counts.add(writer, row_kind == "token", committed)
            if old is None:  # listed once a batch records the forward it is first seen in (_record)
                arr.recorded = False
                self._unrecorded.append(arr)
            self._reserve([f"{arr.path}/zarr.json", f"{arr.path}/manifest.json"])
            return writer

    def open_reduced(self, hook_point: str, feature_shape: tuple, dtype: torch.dtype, row_kind: str) -> None:
        """Declare a hook point whose rows are reduced, not stored (a writer made with
        ``reductions_only=True``): listed under ``reduced`` of the root (FORMAT.md section 11) from
        the :meth:`add_batch` that records the forward it was first seen in, with the rows
        reduced that ``add_batch(reduced_rows=...)`` gives; one whose forward is never recorded
        is never listed (:attr:`unrecorded_hook_points`).

        Parameters
        ----------
        hook_point : str
        feature_shape : tuple of int
            Shape of one row.
        dtype : torch.dtype
            Dtype of the rows reduced (after ``storage_dtype``).
        row_kind : {"sample", "token"}

        Raises
        ------
        StoreError
            The writer is closed, it stores rows (``reductions_only`` False), or the hook point
            was declared before.
        ValueError
            Unsupported dtype, invalid feature shape or row kind.
        """
        self._refuse_other_process("a hook point opened")
        self._refuse_if_lost()
        with self._lock:
            if self._closed:
                raise StoreError(f"the store writer of {str(self._backend)!r} is closed")
            if not self.reductions_only:
                raise StoreError(f"hook point {hook_point!r}: the store writer of {str(self._backend)!r} stores rows; "
                                 "open_reduced is for a writer made with reductions_only=True (use open_array)")
            if hook_point in self._declared:
                raise StoreError(f"hook point {hook_point!r} was already declared in this store writer")
            name = F.parse_dtype(dtype, f"dtype of hook point {hook_point!r}")
            if row_kind not in ROW_KINDS:
                raise ArgumentValueError(f"row_kind must be one of {list(ROW_KINDS)}, got {row_kind!r}")
            feature_shape = tuple(int(d) for d in feature_shape)
            if any(d < 0 for d in feature_shape):
                raise ArgumentValueError(f"feature_shape of hook point {hook_point!r} must be non-negative, got {feature_shape}")
            if math.prod(feature_shape) * F.itemsize(name) > V.MAX_ROW_BYTES:
                raise ArgumentValueError(f"hook point {hook_point!r}: rows of feature shape {feature_shape} ({name}) hold "
                                         f"more than {V.MAX_ROW_BYTES} bytes, which a store cannot describe")
            self._declared.add(hook_point)
            old = self._reduced.get(hook_point)
            if old is not None:  # (a resume: the stored hook point's rows)
                got = (list(feature_shape), name, row_kind)
                want = (list(old["feature_shape"]), old["dtype"], old["row_kind"])
                if got != want:
                    raise StoreError(
                        f"hook point {hook_point!r} has feature shape {got[0]}, dtype {got[1]}, {got[2]} rows, but the "
                        f"store {str(self._backend)!r} reduced rows of feature shape {want[0]}, dtype {want[1]}, "
                        f"{want[2]} rows; resume with the same model, storage_dtype and rows, or capture again with "
                        "overwrite=True")
                return
            self._reduced[hook_point] = {"row_kind": row_kind, "feature_shape": list(feature_shape), "dtype": name,
                                         "n_rows": 0}
            self._unrecorded_reduced.append(hook_point)

    def _refuse_folded_node(self, hook_point: str, node: str) -> None:
        """A new hook point whose node name equals another array's of this store but for case
        or Unicode normalization (``d.Attn.output`` and ``d.attn.output``; ``é`` written as one
        character or as ``e`` and an accent): a file system that folds names (macOS, Windows,
        ext4 with casefold) keeps both arrays' shards in one folder, so one hook point's rows
        would be read as the other's. Refused (StoreError, before anything of it is written)
        when the folder its shards are written in (the store's, or the staging folder of a
        remote store) folds the two names; elsewhere the capture goes on and a warning says
        that such a store cannot be copied to one that does."""
        if self._folded_nodes is None:  # (the stored arrays' node names, once)
            stored = ((hp, str(meta.get("path", "")).partition("/")[2]) for hp, meta in self._old_arrays.items())
            self._folded_nodes = {_folded(n): (hp, n) for hp, n in stored}
        key = _folded(node)
        other, other_node = self._folded_nodes.get(key, (None, node))
        if other_node == node:
            if other is not None and other != hook_point:  # (one name spelled as another's shortened one)
                raise StoreError(
                    f"hook points {other!r} and {hook_point!r} would share one folder {'acts/' + node!r} of store "
                    f"{str(self._backend)!r} (a name longer than {F.MAX_NODE_BYTES} bytes is kept as its first 100 "
                    "bytes, '~' and a hash of it, and the other is spelled so): rename one module, or leave one out "
                    f"(exclude_hook_points=[{name_repr(hook_point)}])")
            self._folded_nodes[key] = (hook_point, node)
            return
        if _folds_names(self._staging, node, other_node):
            staging = f" (its staging folder {str(self._staging)!r})" if self._own_staging else ""
            raise StoreError(
                f"hook points {other!r} and {hook_point!r}{_spelled(other, hook_point)} differ only in case or "
                f"Unicode normalization, and the file system of store {str(self._backend)!r}{staging} does not tell "
                f"such names apart: both arrays would be one folder, and the rows of one read as the other's; rename one module, "
                f"leave one out (track(exclude=...) or exclude_hook_points=[{name_repr(hook_point)}]), or capture into a "
                f"store on a case-sensitive file system"
            )
        warn_at_caller(
            f"store {str(self._backend)!r}: hook points {other!r} and {hook_point!r}{_spelled(other, hook_point)} differ "
            f"only in case or Unicode "
            f"normalization: they are stored apart here, but a copy of this store on a file system that does not "
            f"tell such names apart (macOS, Windows) holds one folder for both, and reads the rows of one as the "
            f"other's; rename one module, or leave one out (exclude_hook_points=[{name_repr(hook_point)}])", RuntimeWarning)

    def _tail_reader(self) -> Any:
        """The reader of the committed rows of the partial last shards a resume re-feeds: one
        store opened for every hook point (one read of the root, not one per hook point), on
        the first need, after this writer took its lock and put the store back to its committed
        rows. A hook point's last shard is untouched until that hook point is opened, so the
        rows read are its committed ones also after a commit of this run. Every chunk it reads
        is checked against its crc32c (a memory map is not: a damaged one would be committed
        again under a fresh crc32c)."""
        if self._tails is None:
            from .reader import Store

            st = Store(self._backend, verify=True)
            st._resume_tail = True  # a resume killed before its commit rewrote that chunk (FORMAT.md section 5)
            self._tails = st
        return self._tails

    def _committed_reader(self) -> Any:
        """The reader of what a resume continues from (the stored reductions' states, the committed
        rows a reduction is computed again over): one store opened for every hook point, on the
        first need, not one per hook point (each a read and check of the whole root: quadratic in
        the hook points). Its entries are those this writer found (``_old_reductions``); the rows a
        hook point's reductions read are read before that hook point's first commit of this run,
        which alone rewrites its last shard (as :meth:`_tail_reader`)."""
        if self._committed is None:
            from .reader import Store

            st = Store(self._backend)
            st._resume_tail = True  # as the re-fed rows: that chunk may be a killed resume's (FORMAT.md section 5)
            self._committed = st
        return self._committed

    def _keep_committed_shard(self, arr: _Array, shard: int, resuming: bool = True) -> None:
        """Hard-link (a copy where the file system has no hard links) the committed file of a
        partial last shard that this run will rewrite under the same name, so :meth:`discard`
        can put it back (local stores; remote ones upload only at a commit). The ``.tmp`` name
        is removed by the next resume. Raises StoreError when neither can be made."""
        if not isinstance(self._backend, LocalBackend):
            return
        path = self._backend.root / F.shard_key(arr.path, shard, len(arr.feature_shape))
        keep = path.with_name(path.name + KEPT_SUFFIX)
        try:
            _link_or_copy(path, keep)
        except OSError as e:
            if not resuming:
                raise StoreError(
                    f"store {str(self._backend)!r}: the committed partial shard {path.name!r} of hook point "
                    f"{arr.hook_point!r} cannot be kept while its rewrite replaces it (neither a hard link nor a copy "
                    f"at {keep}: {e}); the shard was not touched and the committed rows are unchanged (resume=True "
                    "continues from them). Free space or fix permissions in the store's folder"
                ) from e
            raise StoreError(
                f"cannot resume {str(self._backend)!r}: its partial last shard {path.name!r} of hook point "
                f"{arr.hook_point!r} cannot be kept (neither a hard link nor a copy at {keep}: {e}), so an "
                "aborted resume could not put it back; the shard was not touched. Free space or fix permissions "
                "in the store's folder, then resume again"
            ) from e
        self._kept_shards.append((path, keep))

    def _restore_kept_shard(self, found: Any, hook_point: str) -> None:
        """Resume of a local store: put back the committed partial last shard an earlier resume
        kept as ``<key>.committed.tmp`` when that resume was killed after renaming its rewrite
        over the key but before its root document listed it (FORMAT.md section 7): the file
        readers of the found store read for that shard (``Store._shard_file``) is kept at the key.
        ``found``: a reader of the store as found."""
        meta = found._meta(hook_point)
        n, shard_rows = int(meta["n_rows"]), int(meta["shard_rows"])
        if not n % shard_rows:
            return
        key = found._shard_key(meta, n // shard_rows)
        chosen = found._shard_file(meta, n // shard_rows)
        if chosen == key:
            return
        try:
            os.replace(self._backend.root / chosen, self._backend.root / key)
        except OSError as e:
            raise StoreError(f"cannot resume {str(self._backend)!r}: putting back the committed last shard {key!r} of "
                             f"hook point {hook_point!r} from {chosen} failed: {e.strerror or e}; nothing was deleted. "
                             "Fix permissions in the store's folder, then resume again") from e

    def _install_held_shard(self, arr: _Array, shards: list[int]) -> None:
        """Commit, step 1: rename the latest rewrite of a shard whose key may hold committed rows
        (the partial last shard a resume rewrites, or one made durable early as a partial shard,
        :meth:`_request_partial_shards`), written as ``<key>.resumed.tmp``, over its key, and list
        it. On a local store the file it replaces, when it holds committed rows, is kept as
        ``<key>.committed.tmp`` until a root lists the rewrite (readers meanwhile read that one:
        FORMAT.md section 7). A remote store's rewrite is staged: renamed there, then uploaded.
        ``shards``: those with a rewrite written (a shard's later rewrite, written since, is the
        one installed)."""
        local = isinstance(self._backend, LocalBackend)
        if local:
            kept = {p for p, _ in self._kept_shards}
            for shard in shards:
                if shard * arr.shard_rows < arr.committed_rows:  # (its key holds committed rows)
                    path = self._backend.root / F.shard_key(arr.path, shard, len(arr.feature_shape))
                    if path not in kept:
                        self._keep_committed_shard(arr, shard, resuming=False)
        try:
            records = arr.writer.install_held(list(shards))
        except StoreError as e:
            raise StoreError(f"store {str(self._backend)!r}: renaming the rewritten shard of hook point "
                             f"{arr.hook_point!r} to its key failed: {e}; the committed rows are unchanged "
                             "(resume=True continues from them)") from e
        for rec in records:
            if local:
                self._installed_shards.add(self._backend.root / F.shard_key(arr.path, int(rec["shard"]),
                                                                            len(arr.feature_shape)))
            self._list_shard(arr, rec)

    def _drop_held_shards(self) -> None:
        """Remove the rewritten shards no commit installed (an abort, a discard, a failure)."""
        for a in self._arrays.values():
            if a.writer is not None and not self._keep_held:
                try:
                    a.writer.drop_held()
                except (StoreError, OSError) as e:
                    warn_at_caller(f"store {str(self._backend)!r}: removing the rewritten shard of hook point "
                                   f"{a.hook_point!r}: {e}", RuntimeWarning)
            a.held_shard = -1

    def _drop_installed_kept_shards(self) -> None:
        """After a root document was written: remove the kept committed files of the shards
        whose rewrite a commit renamed over their key (the root now lists the rewrite). The
        others stay kept until the close (a failure before a root lists their rewrite puts
        them back: :meth:`_cleanup`)."""
        installed = self._installed_shards
        if not installed or self._found_files is not None:
            return  # (no batch committed yet: a discard() may still put the found files back)
        keep_on = []
        for path, keep in self._kept_shards:
            if path in installed:
                try:
                    keep.unlink(missing_ok=True)
                except OSError as e:
                    warn_at_caller(f"store {str(self._backend)!r}: removing {keep}: {e}", RuntimeWarning)
            else:
                keep_on.append((path, keep))
        self._kept_shards = keep_on
        installed.clear()

    def _drop_kept_shards(self, restore: bool) -> None:
        """Remove the kept committed files of rewritten last shards, or with ``restore`` put
        each back over its key (no root lists the rewrite: a close or abort that failed, a
        discard), unless the store's manifest as it is now lists the rewrite under the key and
        not the kept file: a commit that failed after writing that array's manifest (a full
        disk, another array's document) leaves a manifest that only the rewrite matches (the
        root, not written, still lists the committed rows, which the rewrite holds too). Each
        stays listed until it is done: one called again after a Ctrl-C finishes them."""
        listed = self._rewrite_listed() if restore and self._kept_shards else set()
        while self._kept_shards:
            path, keep = self._kept_shards[-1]
            try:
                if not os.path.lexists(keep) and os.path.lexists(path):
                    pass  # (put back, or removed, by a call a Ctrl-C cut short after it)
                elif restore and path not in listed and not (path.exists() and os.path.samefile(keep, path)):
                    os.replace(keep, path)  # (rename() of two links to one file does nothing)
                else:
                    keep.unlink(missing_ok=True)
            except OSError as e:
                warn_at_caller(f"store {str(self._backend)!r}: {'restoring' if restore else 'removing'} {keep}: {e}",
                               RuntimeWarning)
            self._kept_shards.pop()

    def _rewrite_listed(self) -> set[Path]:
        """The keys (paths) of the kept shards whose rewrite, now under the key, is the file
        the store's manifest as it is now describes, and the kept committed file is not (the
        test a reader's ``Store._shard_file`` makes). Empty where the store cannot be read."""
        from .reader import Store

        kept = {path for path, _keep in self._kept_shards} & self._installed_shards  # (the others hold the kept file)
        listed: set[Path] = set()
        if not kept:
            return listed
        try:
            store = Store(self._backend)
        except (ActivationScopeError, OSError, KeyError, TypeError, ValueError):
            return listed
        for hp in sorted(set(self._old_arrays) | set(self._arrays)):
            try:  # (an array that cannot be read has its kept file put back)
                meta = store._meta(hp)
                n, shard_rows = int(meta["n_rows"]), int(meta["shard_rows"])
                if not n % shard_rows:
                    continue
                key = store._shard_key(meta, n // shard_rows)
                path = self._backend.root / key
                if path in kept and store._matches_manifest(meta, n // shard_rows, key) is True \
                        and store._matches_manifest(meta, n // shard_rows, key + KEPT_SUFFIX) is False:
                    listed.add(path)
            except (ActivationScopeError, OSError, KeyError, TypeError, ValueError):
                continue
        return listed

    def _load_manifest(self, arr: _Array) -> dict:
        key = f"{arr.path}/manifest.json"
        raw = self._backend.get(key, max_bytes=V.MAX_JSON_BYTES)
        if raw is None:
            return {}
        shards = V.parse_manifest(V.loads_json(raw, store=self._backend, key=key), self._old_arrays[arr.hook_point],
                                  store=self._backend, key=key)
        # its segments of committed full shards stay as they are, checked once (a damaged one refuses the
        # resume, as a damaged manifest does, before anything is written); the records of the shards
        # after them, up to the committed rows, are the writer's again
        shards.load_all()
        full = arr.committed_rows // arr.shard_rows
        arr.segments = [dict(e) for e in shards.segments if e["end"] <= full]
        end = arr.segments[-1]["end"] if arr.segments else 0
        return {k: shards[k] for k in shards if k >= end and k * arr.shard_rows < arr.committed_rows}

    def _start_encoder(self) -> None:
        if self._encoder_thread is not None:
            return
        # (the thread holds the core and the encoders, not the writer: a writer dropped unclosed
        # is collected, and its finalizer stops the core, which ends this thread)
        t = threading.Thread(target=self._encode_loop, args=(self._core, self._encoders),
                             name="activationscope-encoder", daemon=True)
        self._encoder_thread = t
        _ENCODING[t] = self._core
        t.start()

    @staticmethod
    def _encode_loop(core: Any, encoders: dict[str, Any]) -> None:
        while True:
            item = core.next_to_encode()
            if item is None:
                _ENCODING.pop(threading.current_thread(), None)
                return
            ident, hook_point, flat, size = item
            try:
                data = flat.numpy()
                if size > 1:  # the element size is blosc's typesize (complex128: 16-byte elements)
                    data = data.view(f"<u{size}" if size <= 8 else f"V{size}")
                encoded = encoders[hook_point].encode(data)  # numcodecs releases the GIL
                core.submit_encoded(ident, encoded)
            except BaseException as e:  # never die silently: the store fails with the cause
                core.fail_encoded(ident, f"{type(e).__name__}: {e}")

    @property
    def close_pending(self) -> bool:
        """Whether a :meth:`close` was cut short by a Ctrl-C before its commit: the writer keeps
        its lock and the rows it flushed, and :meth:`close` called again commits them (as the
        cut-short close began: its status), where :meth:`abort` would give them up."""
        return self._closing is not None

    # ------------------------------------------------------------------ batches
    @property
    def n_batches_committed(self) -> int:
        """Batches (captured forwards) the store has committed, those of the run it resumes
        included."""
        return self._n_batches

    @property
    def n_batches_recorded(self) -> int:
        """Batches (captured forwards) recorded by :meth:`add_batch`, committed or not, those
        of the run it resumes included. It grows by one at the single step that records a batch,
        so a capture interrupted in :meth:`add_batch` (a Ctrl-C) tells from it whether its forward
        was recorded."""
        return self._n_batches + len(self._pending)

    @property
    def next_sample_id(self) -> int:
        """The id the running counter gives the next sample recorded without ids: the samples
        of the data fed so far, those of the run it resumes included, each counted once.

        Each batch advances the counter by its samples, whether their ids were given or
        counted, unless :meth:`add_batch` was told otherwise (``next_id=``: a generation step
        of samples already counted, or samples a capture policy skipped). A resume continues
        from the counter the store records (``next_sample_id`` of the root, FORMAT.md section
        2); a store written before that field continues from the number of distinct sample
        ids it holds (its samples, each counted once however many forwards stored it), which
        equals the counter for counted ids and for given ones that never repeat a sample.
        """
        with self._lock:
            return self._pending[-1].next_id if self._pending else self._committed_next_id

    def _stored_next_id(self, st: Mapping[str, Any]) -> int:
        """The running counter a resumed store left (0 for a new store): its root's
        ``next_sample_id``, or for a store written before that field, the number of distinct
        sample ids of its sample table (the rows count when they cannot be read, with a
        :class:`CaptureWarning`)."""
        if "next_sample_id" in st:
            return int(st["next_sample_id"])
        committed = self.n_samples_committed
        if not committed or not self._row_tables.get("sample", {}).get("parts"):
            return committed
        import pyarrow.compute as pc

        from .reader import Store

        try:
            col = Store(self._backend).row_table("sample").column("sample_id")
            return int(pc.count_distinct(col.slice(0, committed)).as_py())
        except (StoreError, OSError, KeyError) as e:
            warn_at_caller(f"store {str(self._backend)!r}: the stored sample ids could not be read to count its "
                           f"samples ({e}); default sample ids continue from its {committed} sample rows",
                           CaptureWarning)
            return committed

    def leave_row_table(self, hook_point: str) -> bool | None:
        """Store the rows of ``hook_point`` off the row table from now on, as a forward that gave
        it another number of rows than its samples does: ``follows_row_table`` False, its rows
        read by their own index without sample ids or columns (a mixture-of-experts expert's
        rows are the tokens routed to it, as many as the batch's samples only by chance).

        Parameters
        ----------
        hook_point : str
            The hook point's name, as given to :meth:`open_array`.

        Returns
        -------
        bool | None
            True when its rows followed the row table until now, False when they no longer did,
            None when the store has no array of it yet (nothing is changed).
        """
        with self._lock:
            a = self._arrays.get(hook_point)
            if a is None:
                return None
            followed, a.follows_row_table = a.follows_row_table, False
            return followed

    def add_batch(self, n_samples: int, sample_ids: Any = None, token_mask: torch.Tensor | None = None,
                  columns: Mapping[str, Any] | None = None, described_again: bool = False,
                  next_id: int | None = None, reduced_rows: Mapping[str, int] | None = None
                  ) -> dict[str, tuple[int, int]]:
        """Record one captured forward: its samples, token rows and user columns.

        Parameters
        ----------
        n_samples : int
            Samples in the forward (``batch``).
        sample_ids : Tensor (batch,) or list, optional
            Ids of the samples (default: the running counter, :attr:`next_sample_id` on).
        token_mask : Tensor, (batch, pos), bool, optional
            Real tokens: one token row per True entry, in row-major order.
        columns : dict, optional
            User columns: per sample (length ``batch``) or per token (``(batch, pos)``
            tensors, taken at the mask).
        described_again : bool, default False
            The forward has the previous forward's batch description again (``set_batch``
            is sticky: a generation loop runs several forwards of the same samples): its
            ``sample_ids`` are those samples again and are not checked for repeats.
        next_id : int, optional
            The running counter after this batch: the id the next counted sample gets
            (default: :attr:`next_sample_id` plus ``n_samples``; never below
            :attr:`next_sample_id`). A batch of samples counted
            before (a generation step) leaves it where it was; one after samples a capture
            policy skipped counts those too. The store records it at each commit, and a resume
            continues from it.
        reduced_rows : dict of str to int, optional
            A writer that keeps reductions only (``reductions_only=True``; required there,
            refused elsewhere): ``{hook point: rows}``, the rows reduced of each hook point
            declared with :meth:`open_reduced` after this batch, counted from the start of the
            capture (never going back). The token mask then only counts; no token row table is
            kept, nor per-token columns.

        Returns
        -------
        dict[str, tuple[int, int]]
            ``{hook_point: (rows, expected_rows)}`` of the arrays that stopped following the
            row table with this batch (their ``follows_row_table`` turned False: they got
            another number of rows since the last batch than its samples or tokens); empty
            when every array stays aligned.

        Raises
        ------
        ValueError
            Lengths that do not match ``n_samples``, or a column named like a reserved one.
        StoreError
            An earlier commit or close found the store at the writer's path no longer the one
            it locked (moved, removed, or its lock deleted and taken): nothing more is written.
        """
        self._refuse_other_process("a batch recorded")
        self._refuse_if_lost()
        with self._lock:
            if self._closed:
                raise StoreError(f"the store writer of {str(self._backend)!r} is closed")
            n = _n_samples(n_samples)
            if next_id is not None and not (isinstance(next_id, (int, np.integer)) and not isinstance(next_id, bool)
                                            and 0 <= next_id <= V.MAX_ROWS):
                raise ArgumentValueError(f"next_id must be an int in 0..{V.MAX_ROWS}, got {next_id!r}")
            if next_id is not None and next_id < self.next_sample_id:  # (later default ids would repeat stored ones)
                raise ArgumentValueError(
                    f"next_id must be at least next_sample_id {self.next_sample_id} (the running counter never goes "
                    f"back: the default ids below it are taken), got {next_id!r}; pass next_sample_id for a batch of "
                    "samples counted before")
            reduced = self._check_reduced_rows(reduced_rows)
            if self.reductions_only:
                token_mask = None if not columns else token_mask  # (it only tells per-token columns, not kept)
            if sample_ids is None and token_mask is None and not columns and n <= _DEFERRED_IDS_MAX:
                return self._add_plain_batch(n, next_id, reduced)
            if sample_ids is None:
                start = self.next_sample_id
                ids: Any = np.arange(start, start + n, dtype=np.int64)
            else:
                ids = _to_column(sample_ids)
            if len(ids) != n:
                raise ArgumentValueError(f"sample_ids has {len(ids)} entries, expected n_samples={n}")
            ids_type = self._sample_ids_type(ids)
            b = self._n_batches + len(self._pending)
            sample: dict[str, Any] = {"sample_id": ids, "batch": np.full(n, b, dtype=np.int64)}
            token: dict[str, Any] | None = None
            mask = None
            if token_mask is not None:
                mask = token_mask.detach().to("cpu").to(torch.bool)
                if mask.dim() != 2 or mask.shape[0] != n:
                    raise ArgumentValueError(f"token_mask must be (batch={n}, pos), got {tuple(mask.shape)}")
            if mask is not None and not self.reductions_only:
                idx = mask.nonzero()
                si, pos = idx[:, 0].numpy(), idx[:, 1].numpy()
                ids_arr = np.asarray(ids, dtype=object if not isinstance(ids, np.ndarray) else None)
                token = {"sample_id": ids_arr[si], "pos": pos.astype(np.int64), "batch": np.full(len(si), b, dtype=np.int64)}
            # checked (names, lengths, one type per column) before anything is recorded
            for kind, key, values, typ in self._user_columns(columns, mask, n):
                if kind == "token" and self.reductions_only:
                    continue  # (no token row table)
                (token if kind == "token" else sample)[key] = values
                if typ is not None:  # a column of Nones so far: its type comes with its first values
                    self._column_types[(kind, key)] = typ
            if ids_type is not None:
                self._column_types[("sample", "sample_id")] = ids_type
            if sample_ids is None:  # (the batch is checked: its ids are noted now, never for a refused one)
                self._default_ids(int(ids[0]) if n else 0, n)
            elif not described_again:
                self._check_ids(ids)
            return self._record(n, sample, token, next_id, reduced)

    def _check_reduced_rows(self, reduced_rows: Any) -> dict[str, int] | None:
        """:meth:`add_batch`'s ``reduced_rows``, checked: given exactly to a writer that keeps
        reductions only, of hook points :meth:`open_reduced` declared, counts that never go back."""
        if not self.reductions_only:
            if reduced_rows is not None:
                raise ArgumentValueError("reduced_rows is for a store writer that keeps reductions only "
                                         "(reductions_only=True); this one stores rows")
            return None
        if not isinstance(reduced_rows, Mapping):
            raise ArgumentTypeError("reduced_rows must be a dict {hook point: rows reduced} in a store writer that "
                                    f"keeps reductions only, got {type(reduced_rows).__name__}")
        out: dict[str, int] = {}
        for hp, rows in reduced_rows.items():
            if hp not in self._reduced:
                raise ArgumentValueError(f"reduced_rows names hook point {hp!r}, which open_reduced did not declare")
            if not (isinstance(rows, (int, np.integer)) and not isinstance(rows, bool) and 0 <= rows <= V.MAX_ROWS):
                raise ArgumentValueError(f"reduced_rows[{hp!r}] must be an int in 0..{V.MAX_ROWS}, got {rows!r}")
            # (its count after the last recorded batch, or the committed one where none since gave it)
            last = (self._pending[-1].reduced if self._pending else {}).get(hp, self._reduced[hp]["n_rows"])
            if rows < last:
                raise ArgumentValueError(f"reduced_rows[{hp!r}] counts rows from the start of the capture and never "
                                         f"goes back: {last} before, got {rows}")
            out[hp] = int(rows)
        if self._pending:  # (a hook point this forward did not reach keeps its count)
            out = {**self._pending[-1].reduced, **out}
        return out

    def _default_ids(self, start: int, n: int) -> None:
        """Default ids ``start .. start + n - 1`` recorded: noted while ids are checked (once
        ids were given), else nothing (the counter never repeats itself)."""
        if self._ids_seen is not None:
            repeat = self._ids_seen.add(np.arange(start, start + n, dtype=np.int64)) if n else None
            if repeat is not None:
                self._warn_repeated_id(repeat)

    def _check_ids(self, ids: Any) -> None:
        """Warn (once per writer, :class:`CaptureWarning`) when a given sample id was recorded
        before in this capture or the store it resumes, or twice in one batch."""
        seen = self._ids_seen
        if seen is None:
            seen = self._ids_seen = _SampleIds()
            stored = self.n_samples_committed + self._pending_samples
            if stored:
                self._seed_ids(seen, stored)
        repeat = seen.add(ids)
        if repeat is not None:
            self._warn_repeated_id(repeat)

    def _seed_ids(self, seen: _SampleIds, stored: int) -> None:
        """The ids of the samples recorded before ids were first given: the store's committed
        ones (a resume) and this run's pending ones."""
        committed = self.n_samples_committed
        if committed and self._row_tables.get("sample", {}).get("parts"):
            from .reader import Store

            try:
                col = Store(self._backend).row_table("sample", columns=["sample_id"]).column("sample_id")
                seen.add(col.to_numpy(zero_copy_only=False)[:committed])
            except (StoreError, OSError, KeyError) as e:  # the capture goes on unchecked against them
                warn_at_caller(f"store {str(self._backend)!r}: the stored sample ids could not be read to check "
                               f"the new ones against them ({e})", CaptureWarning)
        elif committed:
            seen.add_range(0, committed)
        for b in self._pending:
            if b.sample is None:
                seen.add_range(b.first_id, b.first_id + b.n_samples)
            else:
                seen.add(b.sample["sample_id"])

    def _warn_repeated_id(self, repeat: Any) -> None:
        if self._ids_seen is None or self._ids_seen.warned:
            return
        self._ids_seen.warned = True
        warn_at_caller(
            f"store {str(self._backend)!r}: sample id {repeat!r} was recorded more than once (batch "
            f"{self._n_batches + len(self._pending)}, counted from 0); each sample should have its own id "
            "(a per-batch counter such as sample_ids=range(len(batch)) repeats them: pass the sample's position "
            "in the dataset; a training loop that feeds the data set again records each sample once per epoch, "
            "as it should: give each batch an epoch column, epoch=[e] * len(batch), to tell those rows apart). "
            "The capture goes on and stores every row; a sample_ids= selection of the "
            "store picks the rows of every sample with that id. Warned once per capture",
            CaptureWarning)

    def _add_plain_batch(self, n: int, next_id: int | None = None, reduced: dict[str, int] | None = None
                         ) -> dict[str, tuple[int, int]]:
        """:meth:`add_batch` of a forward with default sample ids, no token rows and no
        columns (the common one, after every forward: kept short). Its row-table rows are made
        at the commit (:func:`_row_pieces`)."""
        key = ("sample", "sample_id")
        if self._ids_seen is not None:
            self._default_ids(self.next_sample_id, n)
        if self._column_types.get(key) is not _int64_ids_type():
            # default ids are int64: refused after ids of another type, as add_batch does
            self._column_types[key] = self._sample_ids_type(_EMPTY_IDS)
        return self._record(n, None, None, next_id, reduced)

    def _record(self, n: int, sample: dict[str, Any] | None, token: dict[str, Any] | None,
                next_id: int | None = None, reduced: dict[str, int] | None = None) -> dict[str, tuple[int, int]]:
        """Record a checked batch of ``n`` samples (``sample`` None: default ids, made at the
        commit; ``next_id``: the running counter after it, default its samples counted);
        returns :meth:`add_batch`'s arrays that stopped following the row table."""
        n_tokens = 0 if token is None else len(token["pos"])
        # every array's rows now, and those that got another number than this batch's
        # samples (sample rows) or tokens (token rows) since the last batch: one native call
        cums, off = self._counts.step(n, n_tokens)
        cums = self._last_cums = np.array(cums, dtype=np.int64)
        lost: dict[str, tuple[int, int]] = {}
        for i, got in off:
            a = self._order[i]
            if a.follows_row_table:
                a.follows_row_table = False
                lost[a.hook_point] = (int(got), int(n if a.row_kind == "sample" else n_tokens))
        if self._unrecorded or self._unrecorded_aliases:  # first seen in this forward: listed from now on
            for a in self._unrecorded:
                a.recorded = True
            self._unrecorded = []
            self._unrecorded_aliases = set()
            self._unpublished = True
        if self._unrecorded_reduced and reduced is not None:
            self._unrecorded_reduced = [hp for hp in self._unrecorded_reduced if hp not in reduced]
            self._unpublished = True
        first_id = self.next_sample_id
        self._pending.append(_Batch(self._n_batches + len(self._pending), n, cums, sample, token, first_id,
                                    first_id + n if next_id is None else int(next_id), reduced or {}))
        self._pending_samples += n
        return lost

    def _request_partial_shards(self, durable: np.ndarray) -> None:
        """Commit: ask the writer thread to make durable, as a partial shard, the rows of each
        array that holds the commit back, so that the next commit covers the forwards the other
        arrays hold durable (a hook point called in some forwards only fills its shard slowly,
        perhaps never, and would hold every commit back until it does).

        An array holds the commit back when, of the forwards waiting, fewer are durable in it than
        in any other array, and another array, which completed a shard since the commit, has more
        durable (or the forwards waiting are more than twice the rows of the largest shard: an array
        getting a row each forward would have filled a shard). Each such array's partial shard is written at most once per
        ``commit_interval``, only when rows came since the last one, and only while the partial
        shards written stay within ``PARTIAL_REWRITE_SHARE`` of the bytes appended (uncompressed):
        a rewrite costs up to a shard's bytes (FORMAT.md section 7)."""
        pending = self._pending
        n = len(self._order)
        if not pending or not n:
            return
        cums = np.zeros((len(pending), n), dtype=np.int64)
        for j, batch in enumerate(pending):
            cums[j, :len(batch.cums)] = batch.cums
        behind = cums > durable[None, :]
        # forwards (leading) durable in each array
        done = np.where(behind.any(axis=0), behind.argmax(axis=0), len(pending))
        low = int(done.min())
        holding = done == low
        # (only an array that completed a shard since the commit is ahead: one durable past it by a
        # partial shard of its own, or durable through every forward waiting because it got no row
        # since, shows no pace the others fall behind; they are not written for it)
        shard_rows = np.array([a.shard_rows for a in self._order], dtype=np.int64)
        committed = np.array([a.committed_rows for a in self._order], dtype=np.int64)
        moved = durable // shard_rows > committed // shard_rows
        ahead = bool((~holding & moved).any())
        rare = len(pending) - low > 2 * max(a.shard_rows for a in self._order)
        if not ahead and not rare:
            return
        now = time.monotonic()
        # byte budget: the partial shards written stay within PARTIAL_REWRITE_SHARE of the bytes the
        # capture appended (a sample array behind token arrays holds every commit back, and a rewrite
        # of its open shard each interval could write more than the capture itself on a slow model)
        appended = sum(int(a.writer.n_rows) * a.row_nbytes for a in self._order if a.writer is not None)
        for i in np.flatnonzero(holding).tolist():
            a = self._order[i]
            if not a.recorded or a.writer is None:
                continue
            rows = int(a.writer.n_rows)
            if rows == a.partial_rows or now - a.partial_at < self._commit_interval:
                continue
            if rows // a.shard_rows * a.shard_rows > durable[i]:
                # a complete shard past its durable rows is queued for the writer thread (many
                # arrays, each a shard a few forwards): it holds the commit back only until that
                # shard is written, which a partial shard, queued after it, cannot come before
                continue
            cost = (rows - rows // a.shard_rows * a.shard_rows) * a.row_nbytes
            if self._partial_bytes + cost > PARTIAL_REWRITE_SHARE * appended:
                if rare and not self._warned_budget:
                    self._warned_budget = True
                    warn_at_caller(
                        f"store {str(self._backend)!r}: the last {len(pending) - low} forwards are not committed: "
                        f"hook point {a.hook_point!r} holds them back (its shard is not full), and writing its "
                        f"{cost} bytes as a partial shard would take the partial shards written past "
                        f"{PARTIAL_REWRITE_SHARE:.0%} of the bytes captured. A crash now loses those forwards. "
                        "It is written once the other arrays have captured enough; to commit sooner, exclude it, "
                        "capture it into a store of its own, or pass a smaller shard_rows= or shard_bytes=. Warned "
                        "once per capture", CaptureWarning)
                continue
            a.writer.snapshot()
            a.partial_at, a.partial_rows = now, rows
            self._partial_bytes += cost

    def rows_since_last_batch(self) -> dict[str, int]:
        """``{hook_point: rows}`` appended since the last :meth:`add_batch` (rows of a forward
        that has not been recorded, e.g. one that raised); empty when every array is even."""
        with self._lock:
            out = {a.hook_point: int(k) for a, k in zip(self._order, self._counts.since_last())}
        return {hp: n for hp, n in out.items() if n}

    def maybe_commit(self) -> bool:
        """Commit when due: the writer thread made new shards durable and ``commit_interval``
        seconds passed since the last commit (or a recorded batch reached a new array, not listed yet),
        and, once commits wrote ``DOCUMENT_ALLOWANCE_BYTES`` of documents, those stay within
        ``DOCUMENT_SHARE`` of the bytes captured or ``DOCUMENT_MAX_WAIT_S`` seconds passed; cheap
        otherwise.

        Returns
        -------
        bool
            Whether a commit was written.

        Raises
        ------
        StoreError
            The writer thread failed (disk full, I/O error); committed rows stay readable. Or
            the store at the writer's path is no longer the one it locked (moved, removed, or
            its lock deleted and taken): nothing more is written there, and every later write
            (an append of rows included) raises this too.
        """
        self._refuse_other_process("a commit")
        self._raise_if_failed()
        version = self._core.durable_version
        if version == self._seen_version and not self._unpublished and not (self.reductions_only and self._pending):
            return False  # (a store of reductions only has no shard to wait for: every recorded forward is due)
        if not self._unpublished:
            waited = time.monotonic() - self._last_commit
            if waited < self._due_interval():
                return False
            if waited < DOCUMENT_MAX_WAIT_S and self._document_bytes > DOCUMENT_ALLOWANCE_BYTES:
                # (a long capture: each commit rewrites documents as large as the run is long)
                if self._document_bytes > DOCUMENT_ALLOWANCE_BYTES + DOCUMENT_SHARE * self._appended_bytes():
                    return False
        return self.commit()

    def _appended_bytes(self) -> float:
        """Bytes (uncompressed) of the rows appended to this writer's arrays up to the last
        recorded batch: one product of their row counts and row sizes, not a Python step per
        array (:meth:`maybe_commit` asks after every forward while it holds a commit back). A
        writer that keeps reductions only: the bytes of the rows reduced."""
        if self.reductions_only:  # (no array: the rows reduced, each hook point's counted since the start)
            last = self._pending[-1].reduced if self._pending else self._reduced_counts()
            sizes = self.__dict__.setdefault("_reduced_row_nbytes", {})  # (hook point -> bytes of a row)
            if len(sizes) != len(self._reduced):
                sizes.update({hp: V.row_bytes(e) for hp, e in self._reduced.items()})
            return float(sum(rows * sizes[hp] for hp, rows in last.items()))
        cums = self._last_cums
        if len(self._order_row_nbytes) != len(cums):
            self._order_row_nbytes = np.array([a.row_nbytes for a in self._order[:len(cums)]], dtype=np.float64)
        return float(np.dot(cums, self._order_row_nbytes)) if len(cums) else 0.0

    def _due_interval(self) -> float:
        """Seconds between two commits of :meth:`maybe_commit`: ``commit_interval``; with
        :meth:`set_reduction_source`, also at least ``STATE_WRITE_SHARE`` times the time the last
        commit took to write the reductions' states (a ``cov`` of wide rows is megabytes a
        commit), so that writing them stays a small share of the capture's time."""
        if self._reduction_source is None:
            return self._commit_interval
        return max(self._commit_interval, STATE_WRITE_SHARE * self._state_write_s)

    def commit(self) -> bool:
        """Commit now the rows the writer thread made durable (whole shards), whatever
        ``commit_interval`` says.

        Returns
        -------
        bool
            Whether a commit was written (False when nothing new was durable).

        Raises
        ------
        StoreError
            The writer thread failed (disk full, I/O error); committed rows stay readable. Or
            the store at the writer's path is no longer the one it locked (moved, removed, or
            its lock deleted and taken): nothing more is written there, and every later write
            (an append of rows included) raises this too.
        """
        self._refuse_other_process("a commit")
        self._raise_if_failed()
        with self._lock:
            self._seen_version = self._core.durable_version
            done = self._commit("incomplete")
        self._last_commit = time.monotonic()
        return done

    # ------------------------------------------------------------------ commit
    def _commit(self, status: str, force: bool = False) -> bool:
        """Commit (see :meth:`commit`); a write that ran out of room (a full disk) raises
        :class:`StoreError` saying what the store keeps and how to go on."""
        try:
            return self._commit_now(status, force)
        except StoreError as e:
            if not ran_out_of_room(e) or AFTER_FAILURE in str(e):
                raise
            raise StoreError(f"{e}; {AFTER_FAILURE}") from e

    def _commit_now(self, status: str, force: bool = False) -> bool:
        b = self._backend
        self._check_still_held()  # (its folder replaced: every write below would land in another store)
        # 1. data: shards made durable by the writer thread (remote: upload them first). The held
        # rewrites written so far are noted first: the records of the shards before each are then
        # among those taken below (the writer thread records a shard before it writes the next)
        held = {id(a): a.writer.held_shards() if a.recorded else [] for a in self._order}
        for a in self._arrays.values():
            if not a.recorded:  # its shards are taken once a batch records it; the close removes them
                if self._closed:
                    self._drop_unrecorded_shards(a)
                continue
            # each record stays in untaken until it is listed: one whose upload failed, and those
            # after it, are kept for the next commit, also where a Ctrl-C cuts this one short
            a.untaken.extend(a.writer.take_durable())
            while a.untaken:
                self._list_shard(a, a.untaken[0])
                del a.untaken[0]
        # rows listed in the manifests above (not the writer thread's durable_rows, read now: a
        # shard it finished since take_durable() is on disk but in no manifest until the next commit),
        # and those of the held rewrites written so far (installed below, each with at least those rows)
        durable = np.array([max([a.committed_rows, a.listed_rows] + [r for _s, r in held[id(a)]])
                            for a in self._order], dtype=np.int64)
        k = 0
        for batch in self._pending:  # (an array opened after a batch has no count in it)
            if bool((batch.cums <= durable[:len(batch.cums)]).all()):
                k += 1
            else:
                break
        if k < len(self._pending) and not self._closed:
            self._request_partial_shards(durable)
        live = None
        if self._reduction_source is not None and (k > 0 or force):
            live, k = self._reduction_states_due(k, status)
        if k == 0 and not force and not self._unpublished:
            return False  # (the shards taken above stay in the store, noted in _found_files)
        # the rewrites of shards whose key may hold committed rows (the partial last shard of a
        # resume, a partial shard written early) replace the committed files now, just before the
        # manifests that describe them (the root, written last, still lists the committed rows only
        # until it is written: FORMAT.md section 7)
        for a in self._order:
            if held[id(a)]:
                self._install_held_shard(a, [s for s, _r in held[id(a)]])
        batches = self._pending[:k]
        # 2. row-table parts, then the counts of the committed batches. A part that fails, or a
        # Ctrl-C anywhere before the last count is set, leaves the tables, the counts and the pending
        # batches as they were (a later commit writes them again): the arrays' rows of those batches,
        # in the shards, stay next to their row-table rows, and a root written next never lists
        # tables of more samples than its n_samples
        before = {kind: ({**t, **{k: type(t[k])(t[k]) for k in ("parts", "crc32c", "columns") if k in t}},
                         self._next_part.get(kind)) for kind, t in self._row_tables.items()}
        counts = (self._pending, self._pending_samples, [a.committed_rows for a in self._order],
                  self.n_samples_committed, self._n_batches, self._committed_next_id,
                  {hp: e.get("n_rows") for hp, e in self._reduced.items()})
        try:
            for kind in self._row_kinds:
                pieces = _row_pieces(batches, kind)
                table = self._row_tables.get(kind) or {}
                if not pieces and not table.get("parts"):
                    # batches of no rows so far: the user columns they named (with their types) are
                    # kept in one part of 0 rows, so that a store of no rows still has them
                    pieces = [p for p in _row_pieces(batches, kind, keep_empty=True)
                              if set(p) - set(table.get("columns") or ()) - {"sample_id", "pos", "batch"}]
                if pieces:
                    self._write_part(kind, pieces)
                    self._merge_parts(kind)
                    self._rename_part_an_older_writer_reuses(kind)
            self._pending = self._pending[k:]
            self._pending_samples -= sum(x.n_samples for x in batches)
            for x in batches:
                for a, cum in zip(self._order, x.cums.tolist()):
                    a.committed_rows = max(a.committed_rows, cum)
                self.n_samples_committed += x.n_samples
                self._n_batches += 1
                self._committed_next_id = x.next_id
                for hp, rows in x.reduced.items():
                    self._reduced[hp]["n_rows"] = rows
        except BaseException:
            for kind in [kind for kind in self._row_tables if kind not in before]:
                del self._row_tables[kind]
            for kind, (was, next_part) in before.items():
                t = self._row_tables[kind]
                t.clear()
                t.update(was)
                if next_part is None:
                    self._next_part.pop(kind, None)
                else:
                    self._next_part[kind] = next_part
            (self._pending, self._pending_samples, rows, self.n_samples_committed, self._n_batches,
             self._committed_next_id, reduced) = counts
            for a, n in zip(self._order, rows):
                a.committed_rows = n
            for hp, n in reduced.items():
                if n is not None:
                    self._reduced[hp]["n_rows"] = n
            raise
        # 3. manifests and array documents (independent objects: written concurrently)
        writes: list[tuple[str, bytes]] = []
        for a in self._arrays.values():
            if not a.recorded:  # no root lists it: it gets no document
                continue
            if a.manifest_dirty:
                writes.append((f"{a.path}/manifest.json", a.manifest_bytes()[0]))
            # an array without rows gets its document with its first rows, or at the close
            # (until then the root lists it with n_rows 0: one file per commit, not one per array)
            if a.doc_rows != a.committed_rows and (a.committed_rows > 0 or force):
                attrs = {F.ATTRS_KEY: {"hook_point": a.hook_point, "dtype": a.dtype, "row_kind": a.row_kind}}
                doc = F.array_document(n_rows=a.committed_rows, feature_shape=a.feature_shape, dtype=a.dtype,
                                       chunk_rows=a.chunk_rows, shard_chunks=a.shard_chunks,
                                       compression=a.compression, attributes=attrs,
                                       dimension_names=F.dimension_names(a.hook_point, a.row_kind,
                                                                         a.follows_row_table, len(a.feature_shape)))
                writes.append((f"{a.path}/zarr.json", F.dumps(doc)))
        if self._found_files is not None:
            if self._n_batches > self._batches_found or self._closed:
                # a batch committed (discard() puts back the root only), or closing: no discard follows
                self._found_files = None
            else:
                self._note_found_files([key for key, _ in writes])
        self._set_many(writes)
        self._document_bytes += sum(len(data) for _key, data in writes)
        for a in self._arrays.values():
            a.manifest_dirty = False
            if a.committed_rows > 0 or force:
                a.doc_rows = a.committed_rows
        if live:  # (a store that keeps reductions only: the states of the committed forwards, new files)
            self._write_commit_reductions(live)
        # 4. the root, last
        # (new arrays are listed, with their committed 0 rows, before their first shard)
        root = F.dumps(F.group_document({F.ATTRS_KEY: self._root_attrs(status)}))
        b.set("zarr.json", root)
        self._document_bytes += len(root)
        self._drop_unlisted_parts()  # (the parts a merge replaced: the root lists the merged one now)
        if self._reduction_source is not None:
            self._drop_unlisted_commit_folders()
        self._root_n_samples = self.n_samples_committed
        self._unpublished = False
        self._drop_installed_kept_shards()  # the root lists the rewrites now: the committed files go
        self._drop_kept_reductions(restore=False)  # (likewise the reductions' committed files)
        if self._aside is not None and (self._n_batches > 0 or (self._closed and not self._failing
                                                                and status == "complete")):
            self._settle_aside(keep_new=True)  # the new store has committed: the old one goes
        if self._found_files is None:  # (a resume that may still be discarded seals nothing)
            self._seal_manifests(status)
        if not self._closed:  # the next commit will rewrite these: make their files now
            self._reserve([key for key, _ in writes] + ["zarr.json"])
        return k > 0 or force

    def _seal_manifests(self, status: str) -> None:
        """After a commit's root: seal each block of ``MANIFEST_SEGMENT_SHARDS`` full shards that
        the root lists and no segment holds into a segment (FORMAT.md section 5), so that what a
        commit writes grows with its new shards, not with all of them. The root first again
        with format version 4 (the store's first segment), then the segments, then the
        manifests that list them. Only shards of committed rows are sealed, whose records never
        change: a writer killed at any point leaves segments that a later run writes again
        byte for byte, and manifests that list none past the root's rows."""
        segment_writes: list[tuple[str, bytes]] = []
        writes: list[tuple[str, bytes]] = []
        done = []
        for a in self._arrays.values():
            sealable = a.committed_rows // a.shard_rows
            end = int(a.segments[-1]["end"]) if a.segments else 0
            if not a.recorded or sealable - end < F.MANIFEST_SEGMENT_SHARDS:
                continue
            doc, new, segments, sealed = a.manifest_bytes(sealable)
            if sealed:
                segment_writes += list(new.items())
                writes.append((f"{a.path}/manifest.json", doc))
                done.append((a, segments, sealed))
        if not done:
            return
        if not self._segmented:
            self._segmented = True
            root = F.dumps(F.group_document({F.ATTRS_KEY: self._root_attrs(status)}))
            self._backend.set("zarr.json", root)
            self._document_bytes += len(root)
        self._set_many(segment_writes)
        self._set_many(writes)
        self._document_bytes += sum(len(data) for _key, data in segment_writes + writes)
        for a, segments, sealed in done:
            a.sealed(segments, sealed)

    def set_reduction_source(self, source: Any) -> None:
        """A writer that keeps reductions only: make every commit store the reductions of the
        forwards it commits (FORMAT.md section 11), so that a capture killed at any point leaves
        a store whose reductions cover exactly its committed forwards, which a resume continues.

        Parameters
        ----------
        source : callable
            ``source() -> [(hook point, name, reduction, rows)]``: each reduction of a hook
            point declared with :meth:`open_reduced` (an object with ``result()``, ``state()``
            and ``kind``, as :meth:`add_reductions` takes) and the rows its state covers, from
            the start of the capture. Called by each commit, in the thread that commits (after
            a forward, or the close); a commit stores a reduction only while its rows are those
            the committed forwards reduced (``add_batch(reduced_rows=...)``).

        Raises
        ------
        StoreError
            The writer stores rows (``reductions_only`` False).
        """
        if not self.reductions_only:
            raise StoreError(f"the store writer of {str(self._backend)!r} stores rows; set_reduction_source is for a "
                             "writer made with reductions_only=True")
        self._reduction_source = source

    def _reduction_states_due(self, k: int, status: str) -> tuple[list, int]:
        """Commit of a store that keeps reductions only: the reductions to store with the ``k``
        forwards it would commit, and how many forwards it commits. Each reduction's state must
        cover exactly the rows of those forwards: after a forward, it does. A close after a
        failure (status incomplete) whose states cover more (a forward cut short by the error)
        commits no new forward, so that the store ends at its last commit with states that a
        resume continues; a close with status complete stores them as they are (partial, as
        readers show them)."""
        live = [x for x in self._reduction_source()
                if x[0] in self._reduced and x[0] not in self._unrecorded_reduced]  # (never recorded: never listed)
        target = dict(self._reduced_counts())
        if k:
            target.update(self._pending[k - 1].reduced)
        exact = all(int(rows) == target.get(hp) for hp, _n, _r, rows in live)
        if not exact and self._closed and status == "incomplete":
            return [], 0
        if not exact and not self._closed:
            # (a commit between a forward cut short and the next forward: the states wait for it)
            live = [x for x in live if int(x[3]) == target.get(x[0])]
        return live, k

    def _reduced_counts(self) -> dict[str, int]:
        return {hp: int(e["n_rows"]) for hp, e in self._reduced.items()}

    def _write_commit_reductions(self, live: list) -> None:
        """Store ``live`` (:meth:`set_reduction_source`) under a new folder
        ``reductions/<node>/__c<batches>-<hex>/`` of each hook point: the root written next
        lists them, and the folders the root listed before are removed after it
        (:meth:`_drop_unlisted_commit_folders`), so that a commit killed at any point leaves the
        store as one root lists it."""
        tag = f"__c{self._n_batches}-{uuid.uuid4().hex[:8]}/"
        t0 = time.monotonic()
        for hp, name, reduction, rows in live:
            self._refuse_reduction_name(hp, name)
            self._add_reductions(hp, name, reduction, None, int(rows), folder=tag)
        self._state_write_s = time.monotonic() - t0

    def _drop_unlisted_commit_folders(self) -> None:
        """After a root: remove the reduction folders of earlier commits that it no longer lists."""
        listed = _commit_folders(self._root_reductions())
        for folder in sorted(self._listed_commit_folders - listed):
            self._remove_commit_folder(folder)
        self._listed_commit_folders = listed

    def _remove_unlisted_commit_folders(self) -> None:
        """Resume of a store that keeps reductions only: remove the reduction folders of commits
        that no root lists (a capture killed between writing them and its root, or before it
        removed those of its previous commit), before anything is written."""
        listed = _commit_folders(self._old_reductions)
        found = set()
        for key in self._backend.list("reductions/"):
            parts = key.split("/")
            if len(parts) >= 4 and _COMMIT_FOLDER.fullmatch(parts[2]):
                found.add("/".join(parts[:3]))
        for folder in sorted(found - listed):
            self._remove_commit_folder(folder)

    def _remove_commit_folder(self, folder: str) -> None:
        """Delete every file under ``folder`` (and, in a local store, its emptied folders)."""
        for key in list(self._backend.list(folder + "/")):
            self._backend.delete(key)
        if isinstance(self._backend, LocalBackend):
            top = self._backend.root / folder
            if os.path.isdir(top) and not os.path.islink(top):
                for dirpath, _dirs, _files in os.walk(top, topdown=False):
                    with contextlib.suppress(OSError):
                        os.rmdir(dirpath)

    def _list_shard(self, a: _Array, rec: Mapping[str, Any]) -> None:
        """Commit, step 1: list the shard ``rec`` the writer thread finished for ``a`` in its
        manifest (an object store's: uploaded first)."""
        b = self._backend
        key = F.shard_key(a.path, rec["shard"], len(a.feature_shape))
        if self._found_files is not None and not self._closed and key not in self._found_files:
            # noted as taken (before an upload that may fail): a discard removes a shard
            # past the found ones; the found partial last shard of a remote store, rewritten
            # with more rows, has no hard link keeping it, so its found bytes are read first
            if int(rec["shard"]) >= self._listed_shards(a):
                self._found_files[key] = None
            elif not isinstance(b, LocalBackend):
                # (up to the largest shard file: a capture killed after uploading its rewrite of
                # this shard, before the manifest that lists it, left more bytes than it lists,
                # FORMAT.md section 7, and readers of the store as found read that file)
                listed = a.manifest.get(int(rec["shard"])) or {}
                size = listed.get("file_bytes")
                self._found_files[key] = b.get(key, max_bytes=max(int(size) if isinstance(size, int) else 0,
                                                                  a.max_shard_file_bytes))
        if not isinstance(b, LocalBackend):
            local = self._staging / key
            b.put_file(key, local)
            local.unlink()
        a.manifest[int(rec["shard"])] = {
            "shard": int(rec["shard"]), "key": key, "rows_end": int(rec["rows_end"]),
            "file_bytes": int(rec["file_bytes"]),
            # tuples of ints: the garbage collector stops tracking them (a long capture holds
            # millions), JSON writes them as lists
            "chunks": [(int(j), int(o), int(nb), int(c)) for (j, o, nb, c) in rec["chunks"]],
        }
        a.manifest_dirty = True
        a.listed_rows = max(a.listed_rows, int(rec["rows_end"]))

    def _drop_unrecorded_shards(self, a: _Array) -> None:
        """Closing: remove the shards the writer thread finished for ``a``, an array first
        opened in a forward no batch recorded (refused or raised partway): no root lists it,
        so none of its rows is committed (a remote store's are in the staging folder, never
        uploaded)."""
        for rec in a.writer.take_durable():
            key = F.shard_key(a.path, int(rec["shard"]), len(a.feature_shape))
            if isinstance(self._backend, LocalBackend):
                self._backend.delete(key)
            else:
                (self._staging / key).unlink(missing_ok=True)

    def _unrecorded_folders(self) -> list[Path]:
        """Local stores: the folders this writer made for arrays no batch recorded, to remove
        when left empty (:meth:`_cleanup`): the array's folder, or its ``c`` folder when only
        that one is new."""
        if not isinstance(self._backend, LocalBackend):
            return []
        folders = []
        for a in self._unrecorded:
            key = a.path if not a.folder_found else f"{a.path}/c" if not a.chunks_found else None
            if key is None:
                continue
            try:
                folders.append(self._backend.path(key))  # checked to lie inside the store
            except StoreError:
                continue
        return folders

    @property
    def unrecorded_hook_points(self) -> list[str]:
        """Hook points (arrays and aliases) first seen since the last recorded batch: a
        forward refused or raised partway. No root lists them; once the writer is closed,
        none ever will (their files are removed by the close)."""
        with self._lock:
            return ([a.hook_point for a in self._unrecorded] + sorted(self._unrecorded_aliases)
                    + list(self._unrecorded_reduced))

    def _listed_shards(self, a: _Array) -> int:
        """Shards of ``a`` that the store as found lists (those holding its committed rows)."""
        old = self._old_arrays.get(a.hook_point)
        return 0 if old is None else -(-int(old["n_rows"]) // int(old["shard_rows"]))

    def _note_found_files(self, keys: list[str]) -> None:
        """Before a commit of a resume that committed no batch yet writes the documents
        ``keys``: remember what the store as found held there (``_found_files``). The found
        store holds no document of an array it does not list (None: removed by a discard); the
        documents of its own arrays are read (they were read when the resume opened them,
        within the same size limit). The shards a commit takes are noted as it takes them
        (:meth:`_commit`): those past the found ones as None; a found partial last shard is put
        back from its hard link (:meth:`_keep_committed_shard`) in a local store, and a remote
        store's is read before the commit uploads its rewrite."""
        found = self._found_files
        listed = {meta["path"] for meta in self._old_arrays.values()}
        for key in keys:
            if key not in found:
                folder = key.rsplit("/", 1)[0]
                found[key] = self._backend.get(key, max_bytes=V.MAX_JSON_BYTES) if folder in listed else None

    def _put_back_found_files(self) -> list[Path]:
        """:meth:`discard` of a resume that committed no batch, once the writer thread
        stopped: remove the files this run made that the store as found does not list (shards
        past the found ones, the writer thread's included, and the documents of new arrays),
        and put back the found bytes of the documents a commit of this run rewrote. Files the
        found store lists are never removed. Returns the folders to remove when left empty
        (local stores; after the temporary files go, :meth:`_cleanup`)."""
        if self._found_files is None:
            return []
        local = isinstance(self._backend, LocalBackend)
        if local:  # shards finished since the last commit: already in the store (remote: in the staging folder)
            for a in self._arrays.values():  # (kept in _found_files: a discard cut short removes them when called again)
                listed = self._listed_shards(a)
                for rec in a.writer.take_durable():
                    if int(rec["shard"]) >= listed:
                        self._found_files.setdefault(F.shard_key(a.path, int(rec["shard"]), len(a.feature_shape)), None)
        files = dict(self._found_files)
        for key, raw in files.items():
            if raw is None:
                self._backend.delete(key)
            else:
                self._backend.set(key, raw)
        if not local:
            return []
        keys = {a.path for a in self._arrays.values() if not a.folder_found}
        keys |= {f"{a.path}/c" for a in self._arrays.values() if not a.chunks_found}
        for key in files:
            parts = key.split("/")
            if len(parts) > 3 and parts[0] == "acts" and parts[2] == "c":  # acts/<node>/c/<shard>[/0...]
                keys.add("/".join(parts[:4]))
        for a in self._arrays.values():  # the writer thread makes a shard's folder when it opens the shard
            for shard in range(self._listed_shards(a), a.writer.n_rows // a.shard_rows + 1):
                parts = F.shard_key(a.path, shard, len(a.feature_shape)).split("/")
                if len(parts) > 4:
                    keys.add("/".join(parts[:4]))
        folders = []
        for key in sorted(keys):
            try:
                folders.append(self._backend.path(key))  # checked to lie inside the store
            except StoreError:
                continue
        return folders

    def _settle_aside(self, keep_new: bool) -> None:
        """Overwrite: delete the old store moved aside (``keep_new``, or the root at the path
        is a commit of the new store: :meth:`_new_store_committed`), or put it back in place
        of the new one (which committed nothing). Cut short by a Ctrl-C, it is finished when
        called again (``_aside`` is kept until it is done): a delete begun is begun again (never
        a put-back: the old store's root document may be gone); of a put-back, the new store's
        files are removed once, then the old ones still aside moved back."""
        aside = self._aside
        if aside is None:
            return
        # (its root document first: a delete cut short leaves no store there)
        if keep_new or self._aside_deleted or self._new_store_committed():
            self._aside_deleted = True
            try:
                (aside / "zarr.json").unlink()
            except OSError:
                pass
            # the rest off this thread: the commit returns at once; close() and abort() wait for it
            if all(d.aside != aside for d in self._deleting):  # (begun once)
                self._deleting.append(_AsideDelete(aside))
            self._aside = None
            return
        try:
            if not self._aside_cleared:  # (once only: the entries moved back since are the old store's)
                self._backend.clear_for_restore()
                self._aside_cleared = True
            self._backend.restore_aside(aside, cleared=True)
            self.put_back = True
        except OSError as e:
            warn_at_caller(f"store {str(self._backend)!r}: the new capture committed nothing, but putting the old "
                           f"store back from {str(aside)!r} failed ({e}); it is still there: move its contents "
                           "back by hand", RuntimeWarning)
        self._aside = None

    def _new_store_committed(self) -> bool:
        """Whether the root at the path is one this writer wrote that replaces the old store (a
        forward listed, or a close's ``complete``): a commit cut short after writing it (a
        Ctrl-C, a failure) and before settling the old store aside; that one then goes, as after
        the commit (FORMAT.md section 7: :func:`_format.settled_replaced`), never put back over
        the new store's committed rows."""
        try:
            raw = self._backend.get("zarr.json", max_bytes=V.MAX_JSON_BYTES)
            attrs = json.loads(raw)["attributes"][F.ATTRS_KEY]
            return isinstance(attrs, dict) and attrs.get("run_id") == self._run_id and F.settled_replaced(attrs)
        except (TypeError, KeyError, ValueError, RecursionError, OSError, StoreError):
            return False

    def _finish_delete(self) -> None:
        """Before the lock is released: wait for the delete of the old store an ``overwrite=True``
        replaced, started by the commit that settled it (:class:`_AsideDelete`), so that a closed
        writer leaves no ``.<name>.replaced-<hex>`` folder. The same for the delete of what an
        earlier writer's delete left (:meth:`_warn_left_aside`). Each stays listed until its wait
        is over: a Ctrl-C as it waits leaves it (and those after it) to the close called again."""
        raised: list[BaseException] = []
        while self._deleting:  # (each waited for, even when one's warning is raised: warnings as errors)
            d = self._deleting[0]
            try:
                d.finish(str(self._backend))
            except KeyboardInterrupt:
                raise
            except BaseException as e:  # noqa: BLE001 - raised below, once every delete is done
                raised.append(e)
            del self._deleting[0]
        if raised:
            raise raised[0]

    def _reserve(self, keys: list[str]) -> None:
        reserve = getattr(self._backend, "reserve", None)
        if reserve is not None:
            reserve(keys)

    def _set_many(self, writes: list[tuple[str, bytes]]) -> None:
        """Write independent objects; all are written (or one error raised) before returning.

        Putting an object, or writing a file on a network file system, is mostly waiting, so
        more than a few go through a small thread pool; the caller writes the root after. A
        local folder whose first write of the batch took under :data:`_SERIAL_WRITE_S` gets
        the rest in this thread: there, the pool's hand-offs of the GIL cost more than they
        overlap (98 documents of a 49-array store: 15-27 ms through the pool, 7-14 ms in one
        thread on a 2-vCPU machine).
        """
        if len(writes) < 8:
            for key, data in writes:
                self._backend.set(key, data)
            return
        if isinstance(self._backend, LocalBackend):
            t0 = time.perf_counter()
            self._backend.set(*writes[0])
            writes = writes[1:]
            if time.perf_counter() - t0 < _SERIAL_WRITE_S:
                for key, data in writes:
                    self._backend.set(key, data)
                return
        if self._io_pool is None:
            from concurrent.futures import ThreadPoolExecutor

            self._io_pool = ThreadPoolExecutor(_IO_THREADS, thread_name_prefix="activationscope-commit")
        futures, serial_error = [], None
        for i, (key, data) in enumerate(writes):
            try:
                futures.append(self._io_pool.submit(self._backend.set, key, data))
            except RuntimeError:  # the interpreter began its exit: concurrent.futures refuses new
                try:  # work from then on, before the threads still running are joined: the rest here
                    for key2, data2 in writes[i:]:
                        self._backend.set(key2, data2)
                except Exception as e:  # noqa: BLE001 - raised once every write has ended
                    serial_error = e
                break
        errors = [f.exception() for f in futures] + [serial_error]  # waits for every write
        for e in errors:
            if e is not None:
                raise e

    def _write_part(self, kind: str, pieces: list[dict]) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        keys = list(pieces[0])
        if all(list(p) == keys for p in pieces) and all(
            type(p[k]) is np.ndarray and p[k].dtype.kind in "biuf" and p[k].ndim == 1
            and p[k].dtype == pieces[0][k].dtype for p in pieces for k in keys
        ):
            # the common case (a batch's sample ids and numeric columns): one array per column
            # instead of one table per batch (a commit holds hundreds of batches)
            table = pa.table({k: pa.array(np.concatenate([p[k] for p in pieces])) for k in keys})
        else:
            tables = []
            for p in pieces:
                cols = {}
                for key, v in p.items():
                    cols[key] = pa.array(list(v) if isinstance(v, np.ndarray) and v.dtype == object else v)
                tables.append(pa.table(cols))
            table = pa.concat_tables(tables, promote_options="default")
        info = self._row_tables[kind]
        index = self._next_part_index(kind)
        key = f"rows/{kind}/part-{index:06d}.parquet"
        sink = io.BytesIO()
        pq.write_table(table, sink)
        data = sink.getvalue()
        self._backend.set(key, data)
        self._document_bytes += len(data)
        self._next_part[kind] = index + 1
        self._part_sizes[key] = table.nbytes
        self._part_rows[key] = table.num_rows
        info["parts"].append(key)
        info.setdefault("crc32c", {})[key] = F.crc32c(data)
        info["n_rows"] = int(info.get("n_rows", 0)) + table.num_rows
        for name in table.column_names:
            if name not in info["columns"]:
                info["columns"].append(name)

    def _part_span(self, kind: str, key: str) -> tuple[int, int] | None:
        """The commits ``(a, b)`` whose parts the row-table part ``key`` of ``kind`` holds, from
        its name (:data:`_PART_NAME`); None for a name of another form (a store written
        elsewhere): such a part is never merged."""
        prefix = f"rows/{kind}/"
        m = _PART_NAME.fullmatch(key[len(prefix):]) if isinstance(key, str) and key.startswith(prefix) else None
        if m is None:
            return None
        a = int(m.group(1))
        b = int(m.group(2)) if m.group(2) is not None else a
        return (a, b) if b >= a else None

    def _next_part_index(self, kind: str) -> int:
        """The commit index the next part of ``kind`` is named by: past every part the table
        lists (merged ones too), so that a name once listed never holds other rows, whatever a
        reader opened before reads; and never a listed name :data:`_PART_NAME` does not match
        (``part-1000000000000.parquet``, past 12 digits)."""
        parts = self._row_tables[kind].get("parts", [])
        index = self._next_part.get(kind)
        if index is None:
            spans = [self._part_span(kind, key) for key in parts]
            index = max([len(parts)] + [span[1] + 1 for span in spans if span is not None])
        listed = set(parts)
        while f"rows/{kind}/part-{index:06d}.parquet" in listed:
            index += 1
        self._next_part[kind] = index
        return index

    def _merge_parts(self, kind: str) -> None:
        """Commit, step 2 (after the commit's new part): when the row table of ``kind`` lists more
        than :data:`ROW_PARTS_BEFORE_MERGE` parts, replace each run of
        :data:`ROW_PART_MERGE_FACTOR` consecutive parts that hold as many commits' parts each,
        of consecutive commits, by one part of their rows, until no such run is left (planned
        first, so that each part written is one the table lists: :meth:`_merged_part`). The
        table reads as before: the same rows, columns, order and types. The merged part is
        written (and fsynced, with ``fsync``) before the root that lists it; the parts it
        replaces stay until a root no longer lists them (:meth:`_drop_unlisted_parts`), so a
        reader of the root before, or of a store killed in between, reads them."""
        parts = self._row_tables[kind]["parts"]
        if len(parts) <= ROW_PARTS_BEFORE_MERGE:
            return
        k = ROW_PART_MERGE_FACTOR
        groups = [[key] for key in parts]  # the parts listed now that each part of the plan is made of
        spans = [self._part_span(kind, key) for key in parts]
        listed = set(parts)
        merged = True
        while merged:  # (each pass one walk over the parts: a store of 36,000 parts is merged in 8)
            merged = False
            i, next_groups, next_spans = 0, [], []
            while i < len(groups):
                run = spans[i:i + k]
                if (len(run) == k and all(span is not None for span in run) and len({b - a for a, b in run}) == 1
                        and all(run[j][1] + 1 == run[j + 1][0] for j in range(k - 1))):
                    members = [key for group in groups[i:i + k] for key in group]
                    sizes = [self._part_sizes.get(key) for key in members]
                    span = (run[0][0], run[-1][1])
                    name = f"rows/{kind}/part-{span[0]:06d}-{span[1]:06d}.parquet"  # (listed: a store from elsewhere)
                    if (tuple(members) not in self._unmergeable and name not in listed
                            and (None in sizes or sum(sizes) <= ROW_PART_MERGE_MAX_BYTES)):
                        next_groups.append(members)
                        next_spans.append(span)
                        merged = True
                        i += k
                        continue
                next_groups.append(groups[i])
                next_spans.append(spans[i])
                i += 1
            groups, spans = next_groups, next_spans
        out: list[str] = []
        for group, span in zip(groups, spans):
            key = self._merged_part(kind, group, span) if len(group) > 1 else None
            out.extend(group if key is None else [key])
        parts[:] = out

    def _merged_part(self, kind: str, group: list[str], span: tuple[int, int]) -> str | None:
        """Write the parts ``group`` of ``kind`` (commits ``span``) as one part,
        ``part-<a>-<b>.parquet``, listed in their place in the table's crc32c; its key, or None
        (nothing written) when they are not merged: one is missing or fails its crc32c (left as
        it is for ``verify`` to name, never rewritten under a new crc32c), is no readable
        Parquet (or its footer says more rows than the table's ``n_rows`` leaves it once the
        rows of the table's other parts known to the writer and of the group's parts before it
        are taken off, refused before a value is decoded), they decode to more than :data:`ROW_PART_MERGE_MAX_BYTES`, or the merged part
        would not read back as their concatenation (the same columns, types and values).
        Raises as the backend's ``set`` does (a full disk)."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        b = self._backend
        info = self._row_tables[kind]
        crcs = info.get("crc32c") or {}
        tables = []
        members = set(group)  # (the rows of the table's other parts, known: written or checked by this writer)
        others = sum(self._part_rows.get(key, 0) for key in info.get("parts", []) if key not in members)
        n_rows = int(info.get("n_rows", 0)) - others
        for key in group:
            raw = b.get(key, max_bytes=V.MAX_FILE_BYTES)
            want = crcs.get(key)
            if raw is None or (want is not None and F.crc32c(raw) != int(want)):
                break
            try:  # (no more rows than the table's n_rows leaves after the other parts: Parquet allocates by
                # what a footer says)
                tables.append(read_parquet_part(raw, b, key, max_rows=n_rows - sum(t.num_rows for t in tables)))
            except StoreCorruptError:
                break
            if sum(t.nbytes for t in tables) > ROW_PART_MERGE_MAX_BYTES:
                break
        key = f"rows/{kind}/part-{span[0]:06d}-{span[1]:06d}.parquet"
        data = None
        if len(tables) == len(group):
            try:
                table = pa.concat_tables(tables, promote_options="default")
                sink = io.BytesIO()
                pq.write_table(table, sink)
                back = read_parquet_part(sink.getvalue(), b, key, max_rows=table.num_rows)
                if back.schema.equals(table.schema) and _same_values(back, table):
                    data = sink.getvalue()
            except Exception:  # noqa: BLE001 - parts pyarrow cannot join or write back: left as they are
                data = None
        if data is None:
            self._unmergeable.add(tuple(group))
            return None
        self._dropped_parts.add(key)  # (removed after a root that does not list it: this commit failed)
        b.set(key, data)
        self._document_bytes += len(data)
        self._part_sizes[key] = table.nbytes
        self._part_rows[key] = table.num_rows
        self._dropped_parts.update(group)
        crcs = info.setdefault("crc32c", {})
        for old in group:
            crcs.pop(old, None)
        crcs[key] = F.crc32c(data)
        return key

    def _rename_part_an_older_writer_reuses(self, kind: str) -> None:
        """Commit, step 2: a writer of an earlier version resuming this store names its next part
        ``part-<number of parts listed>.parquet``; once merges made the table shorter, that may
        be the name of a part it lists (``part-000016.parquet`` of a table of 16 parts), which
        it would overwrite with other rows. Such a part is copied to ``part-<i>-<i>.parquet``
        (the same bytes, the same commit), listed in its place, and removed after the root."""
        info = self._row_tables[kind]
        parts = info["parts"]
        i = len(parts)
        key = f"rows/{kind}/part-{i:06d}.parquet"
        if key not in parts:
            return
        crcs = info.get("crc32c") or {}
        raw = self._backend.get(key, max_bytes=V.MAX_FILE_BYTES)
        if raw is None or (key in crcs and F.crc32c(raw) != int(crcs[key])):
            return  # (damaged: left as it is for verify to name)
        new = f"rows/{kind}/part-{i:06d}-{i:06d}.parquet"
        if new in parts:  # (a store written elsewhere listing both)
            return
        self._dropped_parts.add(new)  # (removed after a root that does not list it: this commit failed)
        self._backend.set(new, raw)
        self._dropped_parts.add(key)
        parts[parts.index(key)] = new
        if key in crcs:
            crcs[new] = crcs.pop(key)
        if key in self._part_sizes:
            self._part_sizes[new] = self._part_sizes[key]
        if key in self._part_rows:
            self._part_rows[new] = self._part_rows[key]

    def _drop_unlisted_parts(self) -> None:
        """After a root: remove the row-table parts a merge replaced (and merged parts of a
        commit that failed before its root) that the root does not list. A part that cannot be
        removed now is tried again after the next root (a resume removes every part the root
        does not list)."""
        if not self._dropped_parts:
            return
        listed = {key for t in self._row_tables.values() for key in t.get("parts", [])}
        failed = set()
        for key in sorted(self._dropped_parts - listed):
            try:
                self._backend.delete(key)
            except (OSError, StoreError):
                failed.add(key)
                continue
            self._part_sizes.pop(key, None)
            self._part_rows.pop(key, None)
        self._dropped_parts = failed

    # ------------------------------------------------------------------ reductions
    def add_reductions(self, hook_point: str, name: str, reduction: Any, script_path: str | os.PathLike | None = None,
                       n_rows: int | None = None) -> None:
        """Store the current result of a reduction as ``reductions/<hook point>/<name>[.<key>]``,
        and its state (``state()``) as ``reductions/<hook point>/<name>.state.<key>``, so a
        resumed capture continues it (:meth:`stored_reduction_state`).

        Parameters
        ----------
        hook_point, name : str
        reduction : object with ``result() -> dict[str, Tensor]``, ``state()`` and ``kind``
        script_path : path, optional
            The ``.pt`` of a custom TorchScript reduction (when not given: the bytes on the
            reduction object as ``script_bytes``, the program as it was loaded, else the file
            it names as ``script_path`` / ``path``), kept as ``reductions/<hook point>/<name>.pt``.
        n_rows : int, optional
            Rows of the hook point's array the reduction covers (recorded as ``n_rows`` of
            each entry: a reader shows a reduction over fewer rows than its array as partial).

        Raises
        ------
        ReductionError
            Before anything is written: a name that is no portable node name, or one sharing a
            file with another reduction of the hook point (FORMAT.md section 6), naming both.
        StoreError
            The store could not be written.
        """
        self._refuse_reduction_name(hook_point, name)
        self._refuse_other_process("reductions stored")
        self._refuse_if_lost()
        try:
            self._add_reductions(hook_point, name, reduction, script_path, n_rows)
        except StoreError as e:
            if not ran_out_of_room(e):
                raise
            raise StoreError(
                f"storing reduction {name!r} of hook point {hook_point!r} failed: {e}. "
                "The rows stay as committed; once space is freed, resume=True with the same reductions= (and no "
                "new batch needed) computes the reductions again from the committed rows and stores them") from e

    def _refuse_reduction_name(self, hook_point: str, name: str) -> None:
        """Raise ReductionError, naming ``name``, ``hook_point`` and the fix, when reduction
        ``name`` cannot be stored as ``reductions/<node>/<name>`` (FORMAT.md section 6): a name
        that is no portable node name (unless the store, written before the rule, already holds
        it: it is resumed there), or one whose arrays share a file with those of another
        reduction of the hook point, stored or written by this run, on a file system that folds
        case and Unicode normalization (``Mean`` and ``mean``), or by its ``.<key>`` arrays
        (``var`` and ``var.mean``), unless the store already holds both."""
        # a name that is no portable node name is refused before anything is written, unless
        # the store (written before the rule, FORMAT.md section 6) already holds it: resumed there
        stored = {e.get("reduction") for e in (self._old_reductions.get(hook_point) or {}).values()
                  if isinstance(e, dict)}
        check_reduction_name(name, f" (hook point {hook_point!r})", portable=name not in stored)
        # one folder on a file system that folds case and Unicode normalization (macOS, Windows)
        others = stored | {e.get("reduction") for e in (self._reductions.get(hook_point) or {}).values()}
        others = {o for o in others if isinstance(o, str) and o != name and not (o in stored and name in stored)}
        for other in sorted(o for o in others if _folded(o) == _folded(name)):
            raise ReductionError(
                f"reduction {name!r} of hook point {hook_point!r} and the store's reduction {other!r}"
                f"{F.spelled_alike(name, other)} differ only in case or Unicode normalization: a file system that does "
                "not tell such names apart (macOS, Windows) holds their arrays as one, so a store there, or a copy of "
                f"it, would read one as the other; give it another name with (name, spec), or {other!r}")
        for other in sorted(o for o in others if _folded(o) != _folded(name)
                            and (_folded(name).startswith(_folded(o) + ".") or _folded(o).startswith(_folded(name) + "."))):
            raise ReductionError(
                f"reduction {name!r} of hook point {hook_point!r} and the store's reduction {other!r}: the arrays of "
                "a reduction 'r' are stored as 'r.<key>' (e.g. 'r.count', 'r.state.<key>'), so one would overwrite or "
                "be overwritten by an array of the other; give it another name with (name, spec)")

    def _add_reductions(self, hook_point: str, name: str, reduction: Any, script_path: str | os.PathLike | None,
                        n_rows: int | None, folder: str = "") -> None:
        """``folder``: a commit's folder (``__c<batches>-<hex>/``) in the hook point's reduction
        folder, where a store that keeps reductions only writes each commit's files: never a
        committed file, so none is kept or removed here (:meth:`_drop_unlisted_commit_folders`)."""
        with self._lock:
            self._check_still_held()
            result = reduction.result()
            for key, value in result.items():  # checked before anything of it is written
                what = _unstorable(value)
                if what is not None:
                    raise StoreError(
                        f"reduction {name!r} of hook point {hook_point!r}: result {key!r} is {what}, which a store "
                        "cannot hold; a reduction must give dense tensors with values (return e.g. acc.to_dense(), "
                        f"acc.cpu(), a dtype among {list(F.SUPPORTED_DTYPES)}), or drop it"
                    )
            kind = str(getattr(reduction, "kind", "custom"))
            if kind in V.BUILTIN_OPTIONS:  # (readers refuse a built-in's output of another dtype: FORMAT.md rule 10)
                for key, value in result.items():
                    dname = F.dtype_name(torch.as_tensor(value).dtype)
                    if dname not in V.BUILTIN_DTYPES:
                        raise StoreError(
                            f"reduction {name!r} of hook point {hook_point!r}: result {key!r} is {dname}, but a "
                            f"reduction of the built-in kind {kind!r} stores {' or '.join(V.BUILTIN_DTYPES)} outputs "
                            "only; cast it (.double()) or give the reduction another kind"
                        )
            main = main_result_key(kind, result)
            node = self._reduction_node(hook_point)
            entries = self._reductions.setdefault(hook_point, {})
            state_fn = getattr(reduction, "state", None)
            state = state_fn() if callable(state_fn) else None
            planned = {f"reductions/{node}/{name if key == main else f'{name}.{key}'}": tuple(torch.as_tensor(v).shape)
                       for key, v in result.items()}
            if state and result:
                planned.update({f"reductions/{node}/{name}.state.{key}": tuple(torch.as_tensor(v).shape)
                                for key, v in state.items()})
            if not folder:
                self._keep_committed_reduction(hook_point, name)
                self._drop_old_reduction(hook_point, name, planned)
            else:  # (the entries of this reduction from an earlier commit: replaced as a whole)
                for old in [k for k, e in entries.items() if e.get("reduction") == name]:
                    del entries[old]
            if node not in self._reduction_groups:  # (once per writer: a commit rewrites none)
                self._backend.set("reductions/zarr.json", F.dumps(F.group_document()))
                self._backend.set(f"reductions/{node}/zarr.json",
                                  F.dumps(F.group_document({F.ATTRS_KEY: {"hook_point": hook_point}})))
                if folder:
                    self._reduction_groups.add(node)
            for key, value in result.items():
                full = name if key == main else f"{name}.{key}"
                path = f"reductions/{node}/{folder}{full}"
                t = torch.as_tensor(value).detach().to("cpu").contiguous()
                dname = F.dtype_name(t.dtype)
                # an alias has no array: its reductions line up with its target's, which readers read for it
                rows_of = self.aliases.get(hook_point, hook_point)
                arr = self._arrays.get(rows_of)
                features = arr.feature_shape if arr is not None else (
                    tuple(self._reduced[hook_point]["feature_shape"]) if hook_point in self._reduced else None)
                dims = F.reduction_dimension_names(hook_point, full, key, kind, getattr(reduction, "options", None),
                                                   tuple(t.shape), features, features_of=rows_of)
                crcs = self._write_small_array(path, t, {"hook_point": hook_point, "reduction": name, "dtype": dname},
                                               dims)
                entries[full] = {"path": path, "reduction": name, "kind": kind, "dtype": dname, "shape": list(t.shape),
                                 "crc32c": crcs}
                if n_rows is not None:
                    entries[full]["n_rows"] = int(n_rows)
            if state and result:
                # the state is listed on the main entry (or the first one when there is no main)
                owner = entries[name] if name in entries else entries[f"{name}.{next(iter(result))}"]
                saved = {}
                for key, value in state.items():
                    path = f"reductions/{node}/{folder}{name}.state.{key}"
                    if _unstorable(value) is not None:
                        saved = None  # a state this format cannot hold: the result stays, resume rebuilds
                        break
                    t = torch.as_tensor(value).detach().to("cpu").contiguous()
                    dname = F.dtype_name(t.dtype)
                    if dname not in F.SUPPORTED_DTYPES or (kind in V.BUILTIN_OPTIONS and dname not in V.BUILTIN_DTYPES):
                        saved = None  # a state this format cannot hold: the result stays, resume rebuilds
                        break
                    crcs = self._write_small_array(path, t, {"hook_point": hook_point, "reduction": name,
                                                            "state": key, "dtype": dname},
                                                   [f"{hook_point}.{name}.state.{key}.dim{i}" for i in range(t.dim())])
                    saved[key] = {"path": path, "dtype": dname, "shape": list(t.shape), "crc32c": crcs}
                if saved is not None:
                    owner["state"] = saved
                    options = getattr(reduction, "options", None)
                    options = options() if callable(options) else options
                    if options:  # lets a commit of rank stores rebuild a built-in reduction to merge into
                        owner["options"] = F.check_jsonable(dict(options), "reduction options")
            pt = script_path
            # the program that ran, as read when the reduction was loaded (the file may have been
            # saved again with another one since); else the file as it is now
            data = getattr(reduction, "script_bytes", None) if pt is None else None
            if pt is None and data is None:
                for attr in ("script_path", "path"):
                    v = getattr(reduction, attr, None)
                    v = v() if callable(v) else v
                    if v:
                        pt = v
                        break
            if data is None and pt is not None and Path(pt).is_file():
                data = Path(pt).read_bytes()
            if isinstance(data, (bytes, bytearray)):
                key = f"reductions/{node}/{folder}{name}.pt"
                data = bytes(data)
                self._backend.set(key, data)
                if name in entries:
                    entries[name]["script"] = key
                    entries[name].setdefault("crc32c", {})[key] = F.crc32c(data)

    def _keep_committed_reduction(self, hook_point: str, name: str) -> None:
        """Local stores: keep every file of the committed reduction ``name`` of ``hook_point``
        (the documents and chunks of its results and states, its script) under
        :func:`~._format.kept_reduction_key` (a hard link, or a copy) before this run rewrites or removes
        it, until a root lists the rewrite: a writer killed in between leaves the committed
        bytes, which readers read and the next resume puts back (FORMAT.md section 6); a close
        that fails before then puts them back itself. Raises StoreError, before anything of
        the reduction is touched, when a file can be neither linked nor copied."""
        if not isinstance(self._backend, LocalBackend):
            return
        for key in committed_reduction_files(self._old_reductions.get(hook_point) or {}, name):
            if key in self._kept_reductions:
                continue  # (kept by an earlier write of this run: the committed bytes already)
            path = self._backend.path(key, write=True)
            if not path.is_file():
                continue
            keep = self._backend.path(F.kept_reduction_key(key), write=True)
            try:
                _link_or_copy(path, keep)
            except OSError as e:
                raise StoreError(
                    f"store {str(self._backend)!r}: the committed file {key!r} of reduction {name!r} of hook point "
                    f"{hook_point!r} cannot be kept while it is rewritten (neither a hard link nor a copy at {keep}: "
                    f"{e.strerror or e}); it was not touched. Free space or fix permissions in the store's folder"
                ) from e
            self._kept_reductions[key] = keep

    def _drop_kept_reductions(self, restore: bool) -> None:
        """Remove the kept committed reduction files (a root lists the rewrite), or with
        ``restore`` put them back over their keys (no root listed it: a close or abort that
        failed, a discard). Each stays listed until it is done: one called again after a Ctrl-C
        finishes them."""
        while self._kept_reductions:
            key, keep = next(reversed(self._kept_reductions.items()))
            try:
                if restore:
                    target = self._backend.path(key, write=True)
                    # (the kept file gone and one at its key: put back by a call a Ctrl-C cut short after it)
                    if os.path.lexists(keep) or not os.path.lexists(target):
                        # (its array's folder may be gone; the store's folder is never made again)
                        self._backend._make_parent(target, key, make_root=False)
                        os.replace(keep, target)
                else:
                    keep.unlink(missing_ok=True)
            except (OSError, StoreError) as e:
                warn_at_caller(f"store {str(self._backend)!r}: {'restoring' if restore else 'removing'} {keep}: {e}",
                               RuntimeWarning)
            del self._kept_reductions[key]

    def _refuse_unwritable_reduction_keys(self) -> None:
        """Resume of a local store: refuse, before anything is deleted, captured or written, a
        place where the root lists a committed reduction file (a result, a state, a document or
        a script) that no file can replace: neither the kept copy of its committed bytes that
        :meth:`_restore_kept_reductions` would put back, nor the close, which keeps and writes
        every reduction file again (it failed there after the whole capture, leaving the store
        incomplete). Such a place is

        - a folder at the key;
        - a key reached through a folder that is a symbolic link leaving the store (a writer
          writes no file through one: the kept copy could not go back either);
        - a symbolic link leaving the store at the key, unless the kept copy of its committed
          bytes goes back over it (the link, never what it points to, is replaced).
        """
        b = self._backend
        going_back: dict[str, str] | None = None  # kept file -> key, computed when a link needs it
        end = "then resume again. Nothing of the store was deleted or written"
        for doc, files in committed_reduction_groups(self._old_reductions):
            for key in sorted([*files, *([doc] if doc is not None else [])]):
                linked = self._linked_folder_leaving_the_store(key)
                if linked is not None:
                    raise V.corrupt(
                        b, f"cannot resume: {key!r} is reached through {linked[0]!r}, a symbolic link to "
                           f"{linked[1]!r}, outside the store; the root lists a committed reduction file there, which "
                           "this resume writes again at its close (or puts back from its kept copy), and a writer "
                           "writes no file through a link leaving the store",
                        fix="replace the link with a copy of the folder it points to (the committed reduction files "
                            f"are in it), {end}")
                place = b.root / key
                if place.is_symlink():
                    real = os.path.realpath(place)
                    if _inside_folder(real, b._root_real()):
                        continue  # (read as the file it leads to; the close replaces the link)
                    if going_back is None:
                        from .reader import Store

                        going_back = self._kept_reductions_going_back(Store(b))
                    keep = F.kept_reduction_key(key)
                    kept = b.root / keep
                    if going_back.get(keep) == key and kept.is_file() and not kept.is_symlink():
                        continue  # (the kept copy goes back over the link)
                    raise V.corrupt(
                        b, f"cannot resume: {key!r} is a symbolic link to {real!r}, outside the store, where the root "
                           "lists a committed reduction file with no kept copy of its committed bytes to put back "
                           "(FORMAT.md section 6); this resume keeps and writes that file again at its close, and a "
                           "writer follows no link leaving the store (it would fail there, after the capture)",
                        fix="replace the link with a copy of the file it points to (verify then checks it against "
                            "the crc32c the root records), or remove the link (not what it points to; the resume "
                            f"then computes a reduction whose state is gone again from the stored rows), {end}")
                if not place.is_dir():
                    continue
                keep = F.kept_reduction_key(key)
                kept = b.root / keep
                if kept.is_file() and not kept.is_symlink():
                    raise StoreError(
                        f"cannot resume {str(b)!r}: {key!r} is a folder, where the root lists a reduction file whose "
                        f"committed bytes are kept as {keep!r} (FORMAT.md section 6); remove that folder (never the "
                        "kept file), then resume again: the resume puts the kept file back. Nothing of the store was "
                        "deleted or written")
                raise StoreError(
                    f"cannot resume {str(b)!r}: {key!r} is a folder, where the root lists a committed reduction "
                    "file that this resume writes again at its close (it would fail there, after the capture); move "
                    "that folder away, then resume again. Nothing of the store was deleted or written")

    def _linked_folder_leaving_the_store(self, key: str) -> tuple[str, str] | None:
        """Local stores: ``(folder key, where it leads)`` of the first folder on the way to
        ``key`` (the key itself left out) that is a symbolic link whose target, resolved, is
        outside the store; None when there is none (a missing folder ends the walk)."""
        root = self._backend.root
        parts = key.split("/")[:-1]
        for i in range(1, len(parts) + 1):
            rel = "/".join(parts[:i])
            p = root / rel
            try:
                mode = os.lstat(p).st_mode
            except OSError:
                return None
            if stat.S_ISLNK(mode):
                real = os.path.realpath(p)
                return None if _inside_folder(real, self._backend._root_real()) else (rel, real)
            if not stat.S_ISDIR(mode):
                return None
        return None

    def _kept_reductions_going_back(self, found: Any) -> dict[str, str]:
        """``{kept file key: key}`` of the committed reduction files whose kept copy
        (:func:`~._format.kept_reduction_key`) holds the committed bytes where the key's file
        does not, as ``found`` (a reader of the store as found) reads them: those a resume puts
        back (a document goes back with a chunk of its array, or when it is missing)."""
        back: dict[str, str] = {}
        for doc, files in committed_reduction_groups(self._old_reductions):
            for key, crc in files.items():
                if found._reduction_file(key, crc) != key:
                    back[F.kept_reduction_key(key)] = key
            if doc is not None and found._reduction_document(doc, bool(set(back.values()) & set(files))) != doc:
                back[F.kept_reduction_key(doc)] = doc
        return back

    def _restore_kept_reductions(self) -> None:
        """Resume of a local store: settle the committed reduction files an earlier writer
        kept (:func:`~._format.kept_reduction_key`) and was killed before removing. One goes
        back over its key when the key's file does not have the crc32c the root records and the
        kept one does (a document goes back with a chunk of its array, or when it is missing);
        every other kept file is removed (the root lists the rewrite), and so is a symlink by
        such a name (the link, never what it points to; a link to a folder only where this
        resume may keep a file). A kept file goes back over a key's FIFO or symlink (replacing
        it, never following it). A folder where it may keep one (no writer makes one) is refused
        before anything is touched: the close could keep no file there (a folder at a key is
        refused before, :meth:`_refuse_unwritable_reduction_keys`)."""
        b = self._backend
        base = b.root / "reductions"
        if not base.is_dir() or base.is_symlink():
            return
        places = F.kept_reduction_places(self._old_reductions)  # (a reduction may be named m.committed.tmp)
        kept, links = set(), []
        for dirpath, dirs, files in os.walk(base):  # never follows a link (a link to a folder is in dirs)
            for name in files + dirs:
                if not name.endswith(KEPT_SUFFIX):
                    continue
                key = os.path.relpath(os.path.join(dirpath, name), b.root).replace(os.sep, "/")
                if name in dirs and key not in places:
                    continue
                if os.path.islink(os.path.join(dirpath, name)):
                    links.append(key)
                elif name in dirs:
                    raise StoreError(
                        f"cannot resume {str(b)!r}: {key!r} is a folder, where a resume keeps a committed reduction "
                        "file (FORMAT.md section 6; no writer makes such a folder); remove it, then resume again. "
                        "Nothing of the store was deleted or written")
                else:
                    kept.add(key)
            dirs[:] = [d for d in dirs if os.path.relpath(os.path.join(dirpath, d), b.root).replace(os.sep, "/")
                       not in places]
        for key in links:
            b.delete(key)  # the link itself, never what it points to (its folder is checked to be inside the store)
        if not kept:
            return
        from .reader import Store

        # kept file -> the key it goes back to (each file read from where a reader of the found store would)
        back = self._kept_reductions_going_back(Store(b))
        # (a folder at a key its kept file goes back to, or a linked folder on its way leaving the store, was
        # refused by _refuse_unwritable_reduction_keys)
        for keep in sorted(kept):
            try:
                if keep in back:
                    target = b.root / back[keep]
                    b._make_parent(target, back[keep])  # (checked inside the store; its array's folder may be gone)
                    # (over a FIFO or a link: replaces it, never follows it)
                    os.replace(b.path(keep, write=True), target)
                else:
                    os.unlink(b.path(keep, write=True))
            except (OSError, StoreError) as e:
                raise StoreError(f"cannot resume {str(b)!r}: settling the kept reduction file {keep!r} failed: "
                                 f"{getattr(e, 'strerror', None) or e}; fix permissions in the store's folder, then "
                                 "resume again") from e

    def _reduction_node(self, hook_point: str) -> str:
        """The node name of ``hook_point``'s reductions folder: the one its stored reductions are
        in when the store has some (a store written before a node name rule, FORMAT.md section 1,
        keeps its folder: a new one would leave the old one behind, empty), else
        :func:`F.node_name`. Only one of :func:`F.node_names` is taken from the store."""
        allowed = F.node_names(hook_point)
        for entry in (self._old_reductions.get(hook_point) or {}).values():
            path = entry.get("path") if isinstance(entry, dict) else None
            parts = path.split("/") if isinstance(path, str) else []
            if len(parts) == 3 and parts[0] == "reductions" and parts[1] in allowed:
                return parts[1]
        return F.node_name(hook_point)

    def _drop_old_reduction(self, hook_point: str, name: str, planned: Mapping[str, tuple[int, ...]]) -> None:
        """Remove the arrays of reduction ``name`` of ``hook_point`` that an earlier run (or
        an earlier write of this one) stored and that the write about to happen does not
        overwrite in place: results and states it will not write (a reduction resumed as
        another kind), and those of another shape (another chunk layout: ``c/0/0`` against
        ``c/0``). ``planned``: ``{array path: shape}`` of the write. Paths come from this
        store's own listing of reductions and stay under ``reductions/``."""
        old_entries = [e for entries in (self._old_reductions.get(hook_point, {}), self._reductions.get(hook_point, {}))
                       for e in entries.values() if isinstance(e, dict) and e.get("reduction") == name]
        stale: list[str] = []
        for e in old_entries:
            arrays = [(e.get("path"), e.get("shape"))]
            arrays += [(st.get("path"), st.get("shape")) for st in (e.get("state") or {}).values()
                       if isinstance(st, dict)]
            for path, shape in arrays:
                if not isinstance(path, str) or not path.startswith("reductions/") or ".." in path.split("/"):
                    continue
                if path not in planned or tuple(shape or ()) != planned[path]:
                    stale.append(path)
        for path in dict.fromkeys(stale):
            for key in list(self._backend.list(path + "/")):
                self._backend.delete(key)
            if isinstance(self._backend, LocalBackend):  # folders left empty (c/0 against a file c/0)
                base = self._backend.path(path)
                if base.is_dir():
                    for dirpath, _dirs, _files in os.walk(base, topdown=False):  # never follows a link
                        if not os.listdir(dirpath):
                            os.rmdir(dirpath)

    #: Whether :meth:`add_alias` is available (a capture stores repeated tensors once).
    supports_aliases: bool = True

    #: ``{"rank", "world_size"}`` when this store is one rank store of a multi-rank capture
    #: (set by the capture before its first commit); written into the root as ``rank_store``
    #: so that the commit of the rank stores can check every rank agrees on the world size.
    rank_store: dict | None = None

    #: Names of the torch dtypes an array can hold (``"float32"``, ``"complex64"``, ...).
    supported_dtypes: tuple[str, ...] = F.SUPPORTED_DTYPES

    def add_alias(self, hook_point: str, target: str) -> None:
        """Record that ``hook_point`` is stored as ``target``'s array (the same tensor at every
        captured call): no array of its own; readers resolve it (``aliases`` in the root).

        Parameters
        ----------
        hook_point : str
            The hook point stored as ``target``.
        target : str
            A hook point with an array in this writer.

        Raises
        ------
        StoreError
            ``target`` has no array in this writer, ``hook_point`` already has one, or the
            store holds ``hook_point`` as an alias of another hook point.
        """
        self._refuse_other_process("an alias recorded")
        self._refuse_if_lost()
        with self._lock:
            if target not in self._arrays and target not in self._old_arrays:
                raise StoreError(f"alias {hook_point!r}: its target {target!r} has no array in this store")
            if hook_point in self._arrays or hook_point in self._old_arrays:
                raise StoreError(f"hook point {hook_point!r} has an array in this store; it cannot become an alias")
            old = self.aliases.get(hook_point)
            if old is not None and old != target:
                raise StoreError(f"hook point {hook_point!r} is stored as an alias of {old!r}, not of {target!r}")
            if old is None:  # listed once a batch records the forward it is first seen in (_record)
                self.aliases[hook_point] = target
                self._unrecorded_aliases.add(hook_point)

    def stored_dtype(self, hook_point: str) -> str | None:
        """The dtype name (``"bfloat16"``, ``"int64"``, ...) of the array that held
        ``hook_point`` (or the target of its alias) when this writer opened, or in a store that
        keeps reductions only the dtype of the rows it reduced (``reduced``, FORMAT.md section
        11); None for a hook point the store did not hold (a new store: always None). A resume
        casts a stored integer hook point whose rows are ``storage_dtype`` (its first call was
        floating-point, or an earlier version cast every hook point) again, so its rows keep one
        dtype.

        Parameters
        ----------
        hook_point : str
            A hook point of this capture.
        """
        meta = self._old_arrays.get(self.aliases.get(hook_point, hook_point))
        if meta is None:  # (a store that keeps reductions only has no array: the rows it reduced)
            return self._stored_reduced_dtypes.get(hook_point)
        return meta.get("dtype")

    def stored_row_kind(self, hook_point: str) -> str | None:
        """The row kind (``"sample"`` or ``"token"``) of the array that held ``hook_point``
        (or the target of its alias) when this writer opened; None for a hook point the store
        did not hold (a new store: always None).

        Parameters
        ----------
        hook_point : str
            A hook point of this capture.
        """
        meta = self._old_arrays.get(self.aliases.get(hook_point, hook_point))
        return None if meta is None else meta.get("row_kind")

    def committed_rows(self, hook_point: str) -> int:
        """Rows of ``hook_point`` committed before this writer opened (0 for a new array).

        Parameters
        ----------
        hook_point : str
            A hook point of this capture.
        """
        old = self._old_arrays.get(hook_point) or ((self._state or {}).get("reduced") or {}).get(hook_point)
        return 0 if old is None else int(old["n_rows"])

    def stored_reduction_state(self, hook_point: str, name: str, kind: str, options: Mapping[str, Any] | None = None,
                               *, script: Any = _NOT_CUSTOM) -> tuple[dict[str, torch.Tensor], int] | None:
        """The state of reduction ``name`` of ``hook_point`` stored by an earlier run, and
        the rows it covers; None when the store holds no usable state for it (none stored,
        another kind, other options, another custom function, or written before states were
        stored): the caller then recomputes the reduction over the stored rows.

        Parameters
        ----------
        hook_point : str
            A hook point of this capture.
        name : str
            The reduction's name (``reductions/<hook point>/<name>``).
        kind : str
            The built-in's name (``"mean"``, ``"hist"``, ...), ``"script"`` or ``"eager"``; a
            stored state of another kind is not used.
        options : mapping, optional
            The reduction's options (its ``options``, defaults filled in); a stored state
            recorded with other options (``hist`` with another range or bin count, ``topk``
            with another ``k``) is not used. None skips that comparison.
        script : path, bytes or None, optional
            For a custom reduction: the ``.pt`` of the resumed one, or its bytes as loaded
            (None for one run as eager Python). Every custom reduction has the same ``kind``, so its stored state
            is used only when the store's ``<name>.pt`` is the same TorchScript program (the
            same records, by name, size and crc32, read from the archives' directories,
            never loaded; a stored script larger than twice the resumed one plus 1 MiB is
            another program, never read); an eager one's never is. Not given: a built-in
            reduction.

        A listed state file (or script) that is missing, or fails its checksum or its
        document, is treated as absent too: the committed rows are the record, and a run that
        failed while it closed (a full disk, a kill) may have rewritten those files without
        committing the root that lists them (FORMAT.md section 6).
        """
        self._refuse_reduction_name(hook_point, name)  # (before the capture goes on, not at its close)
        entries = self._old_reductions.get(hook_point) or {}
        owner = next((e for e in entries.values() if e.get("reduction") == name and "state" in e), None)
        if owner is None or owner.get("kind") != kind or "n_rows" not in owner:
            return None
        if options is not None and (owner.get("options") or {}) != dict(options):
            return None  # as a commit of rank stores compares them (ranks._merge_states)
        reader = self._committed_reader()
        if script is not _NOT_CUSTOM:
            key = owner.get("script")
            if script is None or not isinstance(key, str):
                return None
            if isinstance(script, (bytes, bytearray)):  # (the program as it was loaded)
                new = bytes(script)
            elif Path(script).is_file():
                new = Path(script).read_bytes()
            else:
                return None
            # the same program saved anew differs only in its archive's top folder name: a stored
            # file far larger than the resumed one is not it, and is never read (a huge or planted
            # file cannot make the resume read it whole)
            limit = 2 * len(new) + _SCRIPT_SIZE_SLACK_BYTES
            try:  # (a FIFO, a folder, a link leaving the store there: no program to compare, as missing)
                size = self._backend.size(key)
                if size is None or size > limit:
                    return None
                old = self._backend.get(key, max_bytes=limit)
            except StoreCorruptError:
                return None
            if old is None or reader._crc_problem(old, (owner.get("crc32c") or {}).get(key),
                                                  f"reduction {name!r}: script {key!r}") is not None:
                return None
            stored_records = _script_records(old)
            if stored_records is None or stored_records != _script_records(new):
                return None
        state = {}
        try:
            for key, e in owner["state"].items():
                state[key] = reader._read_small({**e, "reduction": name}).clone()
        except StoreCorruptError:
            return None  # (see above: recomputed from the committed rows)
        if script is _NOT_CUSTOM:
            array = (self._old_arrays.get(self.aliases.get(hook_point, hook_point))
                     or ((self._state or {}).get("reduced") or {}).get(hook_point) or {})
            feature_shape = array.get("feature_shape")
            # (of integer rows, a float64 min / max / topk state, as an older version wrote, is
            # not exact beyond 2**53: recomputed from the rows, in int64)
            dtype = F.torch_dtype(array["dtype"]) if array.get("dtype") in F.SUPPORTED_DTYPES else None
            if not isinstance(feature_shape, list) or not _builtin_state_fits(
                    kind, owner.get("options") or {}, state, int(owner["n_rows"]), tuple(feature_shape), dtype):
                return None  # a state no such reduction can have after those rows: recomputed from them
        return state, int(owner["n_rows"])

    def committed_batch_ends(self, hook_point: str) -> list[int] | None:
        """Where each captured forward's rows of ``hook_point`` end, among the rows committed
        before this writer opened: increasing ends, the last one its committed rows, from the
        ``batch`` column of its row table. None when those rows do not follow the row table
        (``follows_row_table`` false) or the table does not cover them: their forwards are
        not known.

        A reduction recomputed from the stored rows is fed them forward by forward, as the
        capture fed it: a custom one's result may depend on how the rows were cut (a count of
        batches, a maximum of batch means), and a built-in one's float64 round-off does.

        Parameters
        ----------
        hook_point : str
            A hook point of this capture.
        """
        array = self.aliases.get(hook_point, hook_point)
        meta = self._old_arrays.get(array)
        if not meta or not meta.get("follows_row_table", True) or meta.get("row_kind") not in ("sample", "token"):
            return None
        n = int(meta["n_rows"])
        if n == 0:
            return []
        from .reader import Store

        cache = self.__dict__.setdefault("_batch_column_cache", {})
        kind = meta["row_kind"]
        if kind not in cache:
            table = Store(self._backend).row_table(kind)
            cache[kind] = (np.asarray(table.column("batch").to_numpy(zero_copy_only=False), dtype=np.int64)
                           if "batch" in table.column_names else None)
        batches = cache[kind]
        if batches is None or len(batches) < n:
            return None
        batches = batches[:n]
        ends = (np.flatnonzero(batches[1:] != batches[:-1]) + 1).tolist()
        return [int(e) for e in ends] + [n]

    def read_committed_rows(self, hook_point: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``[start, stop)`` of ``hook_point`` as committed before this writer opened (a copy).

        Parameters
        ----------
        hook_point : str
            A hook point of this capture.
        start, stop : int
            Rows ``0 <= start <= stop <= committed_rows(hook_point)``.

        Returns
        -------
        Tensor, (stop - start, *feature_shape), the stored dtype, CPU
            A copy.
        """
        st = self._committed_reader()
        try:
            return st._read_rows(hook_point, start, stop, copy=True)
        finally:
            st.close()  # (its mapping of the shard dropped: a commit of this run may rewrite that file)

    def _write_small_array(self, path: str, t: torch.Tensor, attrs: dict,
                           dimension_names: list[str] | None = None) -> dict[str, int]:
        """Write a one-chunk array; returns ``{chunk key: crc32c}`` (empty for a 0-size array)."""
        return _write_small_array(self._backend, path, t, attrs, dimension_names)

    # ------------------------------------------------------------------ close
    def _stop_threads(self) -> None:
        self._core.close()
        self._threads_stopped = True  # no shard is filled any more
        if self._encoder_thread is not None:
            self._encoder_thread.join()
            _ENCODING.pop(self._encoder_thread, None)

    def _stop_threads_left_running(self) -> None:
        """:meth:`_stop_threads` where a close, abort or discard was interrupted (a Ctrl-C)
        before it stopped them: the chunks handed to the writer thread are written now, before
        the store is settled, cleaned or removed and its lock released, never after (a shard
        written into a store being removed left a folder with no root document)."""
        if not self._threads_stopped:
            self._stop_threads()

    def _other_process(self) -> bool:
        """Whether this is a copy of the writer in a process forked after it was made."""
        return os.getpid() != getattr(self, "_pid", os.getpid())

    def _refuse_other_process(self, what: str) -> None:
        """Raise :class:`StoreError` in a process forked after this writer was made: its copy
        must neither write, commit nor close the store of the process that owns it (a commit
        there would put back that process's committed rows and root, and a close would give
        up its lock)."""
        if self._other_process():
            raise StoreError(
                f"store {str(self._backend)!r}: {what} in process {os.getpid()}, but this writer belongs to process "
                f"{self._pid} (this process was forked after it was made); nothing was written. Capture into a "
                "store of this process's own (or pass the rows back to the owning process)"
            )

    def _unchanged_resume(self) -> bool:
        """A resume that recorded no batch and stored no reduction (its closing as
        "incomplete" or abort puts the store back as found, see :meth:`abort`). Call it
        holding ``self._lock`` and keep holding it through the :meth:`discard` it decides:
        a batch another thread records in between would be committed, then rolled back."""
        return (self._found_root is not None and not self._closed and not self._reductions
                and self._n_batches + len(self._pending) == self._batches_found)

    @property
    def found_status(self) -> str | None:
        """Status of the store this writer resumed, as found (``"complete"`` or
        ``"incomplete"``); None for a new store."""
        return None if self._state is None else self._state.get("status")

    def close(self, status: str = "complete") -> None:
        """Flush partial chunks and shards, commit everything, mark the store ``status``.

        ``"incomplete"`` for a resume that recorded no batch and stored no reduction: the
        store is left as it was found (:meth:`discard`), as by :meth:`abort`.

        With ``overwrite=True`` on a local store, the old store moved aside is deleted in the
        background from the first commit that lists a forward on; the close (and :meth:`abort`)
        waits for that delete to finish, as long as the files it has left take to delete (none
        once it is done), so that a closed store leaves no ``.<name>.replaced-<hex>`` folder. A
        part it could not delete is named in a ``RuntimeWarning`` here, never raised.

        A close cut short by a Ctrl-C before its commit keeps the lock, the rows it flushed and an
        old store ``overwrite=True`` moved aside: called again, it finishes that close as it began
        (its ``status``), every row handed to the writer before it committed, the store as an
        uninterrupted close leaves it. Called again after a close (cut short after its commit, or
        one that raised, such as a commit on a full disk), :meth:`abort` or :meth:`discard` that
        a Ctrl-C (or several) cut short before it released the lock, it finishes that one: the writer thread stopped (the chunks handed to it
        written first), the temporary files removed, the lock released; nothing more is
        committed, the store stays at its last commit (``resume=True`` continues it). Called
        again after a close cut short as it waited for the delete of the store ``overwrite=True``
        replaced, it waits for that delete. Otherwise a closed writer's close does nothing.

        Parameters
        ----------
        status : {"complete", "incomplete"}, default "complete"
            The status the store's root records.

        Raises
        ------
        ArgumentValueError
            ``status`` is neither; nothing is committed.
        StoreError
            The writer thread failed; what was durable before is committed (status
            "incomplete") and stays readable.
        """
        self._refuse_other_process("closed")
        if status not in ("complete", "incomplete"):
            raise ArgumentValueError(f"status must be one of ['complete', 'incomplete'], got {status!r}")
        with self._lock:  # (check and discard in one hold: no batch is recorded in between)
            if status == "incomplete" and self._unchanged_resume():  # stopped before its first batch
                self.discard()
                return
            if self._closed:
                if not self._settling:  # (one cut short as it waited for the delete of the store it replaced)
                    self._finish_delete()
                    return
                if self._closing is None:  # a close, abort or discard interrupted before it let go of the lock
                    self._settle_interrupted()
                    return
                status = self._closing  # a close interrupted before its commit: finished now, as it began
            clean = pending = False
            # (the last line before the try: a Ctrl-C before it leaves the close to abort)
            self._closed, self._settling, self._closing = True, True, status
            try:
                # the rows in the chunk buffers go to shards only while the store at the path is still
                # this writer's (the chunks queued before are written first): one moved, removed,
                # replaced or taken by another writer gets nothing more (see _check_still_held)
                self._core.drain()
                for a in self._arrays.values() if self._store_lost() is None else ():
                    try:
                        a.writer.flush()
                    except ActivationScopeError:
                        break
                self._core.drain()
                self._stop_threads()
                if self._core.failed:
                    self._failing = True
                    self._commit("incomplete", force=True)
                    self._raise_if_failed()
                self._commit(status, force=True)
                self._closing = None
                # every temporary file of this writer is gone (its spares go in _cleanup); those
                # of earlier writers went before its first write: no walk of the store's folders
                clean = not self._failing
            except KeyboardInterrupt:
                # (before its commit: the lock stays held, the rows flushed stay in their shards and
                # an old store moved aside stays there, for the close called again to commit them)
                pending = self._closing is not None
                raise
            except BaseException:
                # (failed: no commit is left to finish. Called again, after a Ctrl-C in the clean-up
                # below, the close only finishes that, as abort() does: a commit then would write this
                # run's root over the old store an overwrite put back)
                self._closing = None
                raise
            finally:
                if not pending:
                    self._stop_threads_left_running()
                    if self._aside is not None:  # closed (failed, or incomplete) before the new store committed a forward
                        self._settle_aside(keep_new=False)
                    try:
                        self._finish_delete()
                    finally:
                        self._cleanup(walk=not clean, remove_if_empty=self._unrecorded_folders())

    def abort(self, exc: BaseException | None = None) -> None:
        """After an exception in the capture loop: commit what is durable, status "incomplete".

        A resume that recorded no batch and stored no reduction (stopped before its first
        forward was recorded) is :meth:`discard`-ed instead: the store is left as it was found,
        its status (a complete store stays complete) and provenance included.

        Never raises (a failure here is reported as a warning, so the first error stays the
        one the caller sees). Called again after a close, abort or discard cut short by a
        Ctrl-C before it released the lock, it finishes that one as :meth:`close` does, but
        commits nothing more: a close cut short before its commit is given up, the store left
        at its last commit (status ``incomplete``, ``resume=True`` continues it). Called after
        a close cut short as it waited for the delete of the store ``overwrite=True`` replaced,
        it waits for that delete, as :meth:`close` does.

        Parameters
        ----------
        exc : BaseException, optional
            The exception that stopped the capture (named in the warning of a failed commit).
        """
        if self._other_process():  # a forked copy: the store is its owner's; nothing is done
            return
        with self._lock:  # (check and discard in one hold: no batch is recorded in between)
            if self._unchanged_resume():
                self.discard()
                return
            if self._closed:
                self._settle_interrupted_quietly()
                return
            self._failing = True
            self._closed = self._settling = True  # (the last line before the try)
            try:
                self._core.drain()
                self._stop_threads()
                self._commit("incomplete", force=True)
            except BaseException as e:  # noqa: BLE001 - never mask the original exception
                warn_at_caller(f"store {str(self._backend)!r}: committing after {exc!r} failed too: {e}",
                               RuntimeWarning)
            finally:
                try:
                    self._stop_threads_left_running()
                    if self._aside is not None:  # overwrite, and the new store committed no row: the old one back
                        self._settle_aside(keep_new=False)
                    try:
                        self._finish_delete()  # (a warning made an error must not keep the lock)
                    finally:
                        self._cleanup(remove_if_empty=self._unrecorded_folders())
                except BaseException:  # noqa: BLE001
                    pass

    def discard(self) -> None:
        """Close without committing anything of this run: a resumed store is left as it was
        found (its root document, so its status and committed rows, put back); rows given
        to this writer are dropped. Until this run commits a batch, the files it made that the
        found store does not list (shards, documents of new arrays) are removed too, and the
        documents its commits rewrote get their found bytes back: the store's files are the
        found ones. Never raises (failures are warned about). A Ctrl-C that cuts the put-back
        short is warned about and leaves the lock held with what the put-back needs: called
        again (or :meth:`close`, :meth:`abort`), it finishes putting the store back as found.
        Without a store to go back to (a new store), the same as :meth:`abort`."""
        if self._other_process():  # a forked copy: the store is its owner's; nothing is done
            return
        if self._found_root is None:
            self.abort()
            return
        with self._lock:
            if self._closed and not self._discarding:
                self._settle_interrupted_quietly()
                return
            empty: list[Path] = []
            pending = False
            self._closed = self._settling = self._discarding = True  # (the last line before the try)
            try:
                self._stop_threads_left_running()
                self._check_still_held()  # (the store there now is not the one found: left as it is)
                self._drop_kept_reductions(restore=True)
                self._backend.set("zarr.json", self._found_root)
                empty = self._put_back_found_files()
                # after the found manifests went back: a rewrite they do not list is never kept
                self._drop_kept_shards(restore=True)
                self._discarding = False
            except KeyboardInterrupt:
                # (the lock stays held and what the put-back needs kept: discard() called again finishes it)
                pending = self._discarding
                if pending:
                    warn_at_caller(f"store {str(self._backend)!r}: a Ctrl-C cut short putting it back as found; "
                                   "its writer still holds it: call discard() again to finish", RuntimeWarning)
            except BaseException as e:  # noqa: BLE001 - the refusal stays the error the caller sees
                self._discarding = False
                warn_at_caller(f"store {str(self._backend)!r}: putting it back as found failed: {e!r}",
                               RuntimeWarning)
            finally:
                if not pending:
                    try:
                        try:
                            self._finish_delete()  # (what an earlier overwrite's delete left: before the lock goes)
                        finally:
                            self._cleanup(remove_if_empty=empty)
                    except BaseException:  # noqa: BLE001
                        pass

    def _settle_interrupted_quietly(self) -> None:
        """:meth:`_settle_interrupted` where one is due (``_settling``), else the wait for the
        delete of the store ``overwrite=True`` replaced that a Ctrl-C cut short (as
        :meth:`close` called again), for :meth:`abort` and :meth:`discard`, which never raise."""
        try:
            if self._settling:  # a close, abort or discard interrupted before it let go of the lock
                self._settle_interrupted()
            else:
                self._finish_delete()
        except BaseException:  # noqa: BLE001 - never raises
            pass

    def _settle_interrupted(self) -> None:
        """Finish a :meth:`close`, :meth:`abort` or :meth:`discard` that a Ctrl-C interrupted
        (once or more: a second one in its own clean-up) after it marked the writer closed and
        before it released the lock: the threads are stopped (the chunks handed to the writer
        thread written first), an old store moved aside by ``overwrite=True`` put back, the
        background delete waited for, the temporary files removed and the lock released, in
        that order, as the interrupted one would have. Nothing more is committed: the store is
        left at its last commit, which ``resume=True`` continues (a close cut short before its
        commit is given up: only :meth:`close` called again commits it). A discard cut short is
        finished as :meth:`discard` called again."""
        if self._discarding:
            self.discard()
            return
        self._closing = None
        self._stop_threads_left_running()
        if self._aside is not None:  # (the new store committed no forward: the old one back)
            self._settle_aside(keep_new=False)
        try:
            self._finish_delete()
        finally:
            self._cleanup(remove_if_empty=self._unrecorded_folders())

    def remove_if_unused(self) -> bool:
        """Once closed (or aborted): remove the store this writer made, when it holds no
        committed row (a capture whose first forward raised), so that the corrected rerun needs
        neither ``overwrite=True`` nor ``resume=True``. A resumed store, a store that existed
        before (a local one replaced by ``overwrite=True`` is put back by the close), or one
        holding rows is never touched; a folder that existed before the writer is kept, empty.

        A close (or abort) interrupted by a Ctrl-C before it released the lock is finished
        first (:meth:`close`), the lock released, whether the store is removed or not.

        Returns
        -------
        bool
            Whether the store was removed. Never raises (a failure is warned about).
        """
        if self._closed and self._settling and not self._other_process():
            try:
                self._settle_interrupted()
            except Exception as e:  # noqa: BLE001 - the caller's error stays the one raised
                warn_at_caller(f"store {str(self._backend)!r}: finishing its interrupted close failed: {e}",
                               RuntimeWarning)
        if not self._closed or not getattr(self, "_made_new", False) or self._root_n_samples \
                or self._other_process() or self._lost is not None:
            return False
        from ._remove import remove_if_empty

        try:
            self._stop_threads_left_running()  # (a close interrupted before: no shard is written as it goes)
            return remove_if_empty(self._backend, remove_folder=self._writer_lock.created_root)
        except Exception as e:  # noqa: BLE001 - the caller's error stays the one raised
            warn_at_caller(f"store {str(self._backend)!r}: removing the store that holds no row failed: {e}",
                           RuntimeWarning)
            return False

    def _remove_temp_files(self, shards: bool = True) -> None:
        """Remove the backend's temporary files left by an earlier writer process (FORMAT.md
        section 1: a resume, and every close, leave none), with ``shards`` also the shard
        writer's, in every array folder (listed by the root or not): only while none of this
        writer's array writers can be filling one."""
        remove = getattr(self._backend, "remove_temp_files", None)
        if remove is None:  # object stores write in one put: no temporary objects
            return
        try:
            remove(shards=shards)
        except (OSError, StoreError) as e:
            warn_at_caller(f"store {str(self._backend)!r}: removing leftover temporary files: {e}", RuntimeWarning)

    def _cleanup(self, walk: bool = True, remove_if_empty: list[Path] = ()) -> None:
        """Release the writer's resources and the lock; with ``walk``, remove any temporary
        file left in the store's folders (after a failure or an abort); then the folders
        ``remove_if_empty`` (local, inside the store) and their subfolders that hold no file.
        A writer whose store is no longer at its path (:meth:`_store_lost`) touches no file
        there: it releases its resources and lock only."""
        self._stop_threads_left_running()
        if self._store_lost() is not None:  # (its kept and held files are where the store went: left there)
            walk, remove_if_empty = False, ()
            self._keep_held = True
            for a in self._arrays.values():
                a.held_shard = -1
            self._kept_shards, self._kept_reductions = [], {}
        self._drop_held_shards()
        # a kept committed file still here: no root lists its shard's rewrite (a close or abort
        # that failed after renaming it over the key): the committed file goes back, unless the
        # array's manifest lists the rewrite (FORMAT.md §7)
        self._drop_kept_shards(restore=True)
        self._drop_kept_reductions(restore=True)  # (likewise a reduction's, FORMAT.md section 6)
        release = getattr(self._backend, "release", None)
        if release is not None:
            release()
        if self._io_pool is not None:
            self._io_pool.shutdown(wait=True)
            self._io_pool = None
        # none of this writer's own, nor of a writer killed before it (shard temporaries only
        # once the writer thread stopped: an abort whose drain failed may still be filling one)
        if walk:
            self._remove_temp_files(shards=self._threads_stopped)
        for folder in remove_if_empty:
            if folder.is_dir() and not folder.is_symlink():
                for dirpath, _dirs, _files in os.walk(folder, topdown=False):  # never follows a link
                    try:
                        os.rmdir(dirpath)  # only an empty one
                    except OSError:
                        pass
        if self._staging_finalizer is not None:
            self._staging_finalizer()
        self._writer_lock.release()
        self._settling = False

    def __enter__(self) -> "StoreWriter":
        """Return the writer: :meth:`close` on a normal exit, :meth:`abort` when the body raised."""
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        """:meth:`close` (status ``complete``), or :meth:`abort` when the body raised."""
        if exc is None:
            self.close()
        else:
            self.abort(exc)

    def __del__(self) -> None:
        try:
            if not self._closed:
                self._core.close()  # (nothing in a process forked after the writer was made)
        except Exception:
            pass

    @property
    def path(self) -> str:
        """Where the store is written: a local directory or a URL."""
        return str(self._backend)

    def __repr__(self) -> str:
        return f"<StoreWriter {str(self._backend)!r} {len(self._arrays)} arrays, {self.n_samples_committed} samples committed>"
