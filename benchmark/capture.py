"""Capture modes: each runs one workload's ``n_forwards`` forwards once per repeat.

Each is registered with :func:`benchmark.registry.register_mode`. A mode has ``setup()``
(untimed; only a missing optional package may raise :class:`~benchmark.registry.MissingOptional`), ``run(i)`` (repeat ``i``; timed,
including attaching and removing hooks and, for disk modes, closing / flushing files),
``describe()`` (untimed, after the first repeat: bytes captured, hook points, ...) and
``reset()`` (untimed, between repeats: drops the records and deletes files).
"""

from __future__ import annotations

import dataclasses
import os
from collections import defaultdict
from typing import Any

import torch

from activationscope.sizes import dir_bytes

from ._util import remove
from .registry import register_mode, require_optional
from .workloads import Workload

REDUCTIONS = ["mean", "var", "min", "max"]


def leaf_tensors(obj: Any) -> list[torch.Tensor]:
    """Tensors of an input / output structure, in order (tuples, lists, dicts, dataclasses)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in leaf_tensors(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in leaf_tensors(o)]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [t for f in dataclasses.fields(obj) for t in leaf_tensors(getattr(obj, f.name))]
    return []


def selected_modules(wl: Workload) -> list[tuple[str, torch.nn.Module]]:
    """The modules ActivationScope tracks for this workload (same selection for every mode)."""
    from activationscope.capture.hooks import select_modules

    return select_modules(wl.model, wl.include, None)


#: Workloads of the ActivationScope modes (every model workload).
ALL = "*"
#: The model workloads where naive hooks and in-memory captures are compared.
CLASSIC = ("toy", "resnet18", "minilm")


class Mode:
    name = ""
    doc = ""

    def __init__(self, wl: Workload, ctx: dict[str, Any]) -> None:
        self.wl = wl
        self.ctx = ctx
        self.workdir = ctx["workdir"]
        self.fsync = ctx.get("durability") == "fsync"

    def setup(self) -> None:
        pass

    def run(self, i: int) -> None:
        raise NotImplementedError

    def describe(self) -> dict[str, Any]:
        return {}

    def reset(self) -> None:
        pass

    # helpers
    def _set_batch(self, tracker: Any, f: int) -> None:
        m = self.wl.mask(f)
        if m is not None:
            tracker.set_batch(attention_mask=m)


@register_mode("plain", workloads=ALL, position=-1, quick=("toy",), doc="the model's forward, no hooks: the baseline of every ratio")
@register_mode("plain_end", workloads=ALL, position=1, quick=False,
               doc="plain again, last of the workload: shows drift of the machine during the run")
class Plain(Mode):

    def run(self, i: int) -> None:
        wl = self.wl
        for f in range(wl.n_forwards):
            wl.forward(f)


class _HookCollector:
    """Python ``register_forward_hook`` hooks that hand every captured tensor to ``take``."""

    def __init__(self, wl: Workload, take, copy: bool = False) -> None:
        self.wl = wl
        self.copy = copy
        self.take = take
        self.modules = selected_modules(wl)
        self.handles: list[Any] = []
        self.mask: torch.Tensor | None = None
        self.cap_in = wl.capture in ("input", "both")
        self.cap_out = wl.capture in ("output", "both")

    def _rows(self, t: torch.Tensor) -> torch.Tensor:
        m = self.mask
        if m is not None and t.dim() >= 2 and tuple(t.shape[:2]) == tuple(m.shape):
            return t[m]  # token rows; boolean indexing copies already
        return t.clone() if self.copy else t

    def attach(self) -> None:
        for name, mod in self.modules:
            def hook(module, args, kwargs, output, _name=name):
                if self.cap_in:
                    for k, t in enumerate(leaf_tensors(args)):
                        self.take(f"{_name}.input.{k}", self._rows(t.detach()))
                    for key, v in kwargs.items():
                        for k, t in enumerate(leaf_tensors(v)):
                            self.take(f"{_name}.input.kw.{key}.{k}", self._rows(t.detach()))
                if self.cap_out:
                    for k, t in enumerate(leaf_tensors(output)):
                        self.take(f"{_name}.output.{k}", self._rows(t.detach()))

            self.handles.append(mod.register_forward_hook(hook, with_kwargs=True))

    def detach(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()


class HeldFloor(Mode):
    """The floor of an in-memory capture, without hooks: the ``nn.Sequential``'s layers run by
    hand, the input and every layer's output held until the repeat ends (``copy``: a clone of
    each, as SNAPSHOT keeps; else the tensors themselves, as REFERENCE keeps), detached from
    the autograd graph as both keep them (holding the graph instead keeps every node and saved
    tensor alive, which frees nothing during the forward and so spares the allocator the work
    that dropping the graph while the data stays held costs). These are the tensors a
    ``capture="both"`` capture of the toy model keeps (a layer's input is the previous layer's
    output, kept once). Held tensors cost the plain forward its cache reuse:
    it writes each layer's output into fresh memory instead of a buffer just freed."""

    def __init__(self, wl: Workload, ctx: dict[str, Any], copy: bool) -> None:
        super().__init__(wl, ctx)
        if not isinstance(wl.model, torch.nn.Sequential) or wl.capture != "both" or wl.include is not None:
            raise RuntimeError(f"the held-tensor floor needs an nn.Sequential captured whole, got workload {wl.name!r}")
        self.copy = copy
        self.held: list[torch.Tensor] | None = None

    def run(self, i: int) -> None:
        wl, layers, copy = self.wl, list(self.wl.model), self.copy
        held: list[torch.Tensor] = []
        for f in range(wl.n_forwards):
            x = wl.batch(f)
            held.append(x.detach().clone() if copy else x.detach())
            for layer in layers:
                x = layer(x)
                held.append(x.detach().clone() if copy else x.detach())
        self.held = held

    def describe(self) -> dict[str, Any]:
        held = self.held or []
        return {"captured_bytes": sum(t.nbytes for t in held), "n_tensors": len(held)}

    def reset(self) -> None:
        self.held = None


register_mode("keep_floor", workloads=("toy",), quick=False,
              doc="no hooks: the layers of the toy model run by hand, its input and every layer's output held, detached, until "
              "the repeat ends (what REFERENCE keeps): the cost of holding the tensors")(
    lambda wl, ctx: HeldFloor(wl, ctx, copy=False))
register_mode("copy_floor", workloads=("toy",), quick=False,
              doc="no hooks: as keep_floor with a clone of each tensor held (what SNAPSHOT keeps): the cost of copying "
              "and holding them")(lambda wl, ctx: HeldFloor(wl, ctx, copy=True))


@register_mode("naive_clone", workloads=CLASSIC, quick=False,
               doc="Python register_forward_hook(..., with_kwargs=True) on the same modules, detach().clone() of "
               "every tensor into per-hook-point lists (token rows: t[mask], which copies)")
class NaiveClone(Mode):

    def run(self, i: int) -> None:
        wl = self.wl
        records: dict[str, list[torch.Tensor]] = defaultdict(list)

        def take(name: str, t: torch.Tensor) -> None:
            records[name].append(t)

        col = _HookCollector(wl, take, copy=True)
        col.attach()
        try:
            for f in range(wl.n_forwards):
                col.mask = wl.mask(f)
                wl.forward(f)
        finally:
            col.detach()
        self.records = records

    def describe(self) -> dict[str, Any]:
        return {
            "captured_bytes": sum(t.nbytes for v in self.records.values() for t in v),
            "n_hook_points": len(self.records),
        }

    def reset(self) -> None:
        self.records = None


class ScopeMemory(Mode):
    """ActivationScope in memory (SNAPSHOT / REFERENCE), or streaming reductions."""

    def __init__(self, wl: Workload, ctx: dict[str, Any], capture_mode: str, reductions: bool = False) -> None:
        super().__init__(wl, ctx)
        self.capture_mode = capture_mode
        self.reductions = reductions
        self.tracker = None

    def _scope(self):
        import activationscope as acs

        kwargs: dict[str, Any] = {"capture": self.wl.capture, "capture_mode": getattr(acs.CaptureMode, self.capture_mode)}
        if self.reductions:
            kwargs.update(reductions=list(REDUCTIONS), reduction_policy=acs.ReductionPolicy.STREAMING)
        return acs.ActivationScope(**kwargs)

    def setup(self) -> None:
        import warnings

        warnings.simplefilter("ignore", RuntimeWarning)  # REFERENCE in-place warnings are not timed here
        self.scope = self._scope()

    def run(self, i: int) -> None:
        wl = self.wl
        with self.scope.track(wl.model, include=wl.include) as tr:
            for f in range(wl.n_forwards):
                self._set_batch(tr, f)
                wl.forward(f)
        self.tracker = tr

    def describe(self) -> dict[str, Any]:
        tr = self.tracker
        acts = tr.activations
        out = {
            "captured_bytes": sum(t.nbytes for v in acts.values() for t in v),
            "n_hook_points": len(tr.hook_points),
        }
        if self.reductions:
            reds = tr.reductions
            out["n_reduced_hook_points"] = len(reds)
            out["reductions"] = list(REDUCTIONS)
        del acts
        return out

    def reset(self) -> None:
        if self.tracker is not None:
            self.tracker.clear()
        self.tracker = None


class ScopeStore(Mode):
    """ActivationScope streaming into a store on disk (uncompressed or zstd)."""

    def __init__(self, wl: Workload, ctx: dict[str, Any], compression: str | None) -> None:
        super().__init__(wl, ctx)
        self.compression = compression

    def setup(self) -> None:
        import activationscope as acs

        self.acs = acs
        self.path = None

    def run(self, i: int) -> None:
        acs = self.acs
        wl = self.wl
        self.path = os.path.join(self.workdir, f"{wl.name}-store-{self.compression or 'raw'}-{i}.zarr")
        opts: dict[str, Any] = {}
        if self.compression:
            opts["compression"] = self.compression
        scope = acs.ActivationScope(capture=wl.capture, store=self.path, store_options=opts)
        with scope.track(wl.model, include=wl.include) as tr:
            for f in range(wl.n_forwards):
                self._set_batch(tr, f)
                wl.forward(f)
        self.tracker = tr

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"stored_bytes": dir_bytes(self.path), "n_hook_points": len(self.tracker.hook_points)}
        store = self.acs.open_store(self.path)  # an unreadable store is an error of the run
        out["captured_bytes"] = int(sum(store[hp].nbytes for hp in store.hook_points))
        return out

    def reset(self) -> None:
        self.tracker = None
        if self.path:
            remove(self.path)


register_mode("scope_snapshot", workloads=ALL, quick=False, doc="ActivationScope in memory, CaptureMode.SNAPSHOT (copies)")(
    lambda wl, ctx: ScopeMemory(wl, ctx, "SNAPSHOT"))
register_mode("scope_reference", workloads=CLASSIC, quick=False,
              doc="ActivationScope in memory, CaptureMode.REFERENCE (keeps the model's tensors, no copy)")(
    lambda wl, ctx: ScopeMemory(wl, ctx, "REFERENCE"))
register_mode("scope_reductions", workloads=CLASSIC, quick=False,
              doc="ActivationScope reductions=['mean','var','min','max'], ReductionPolicy.STREAMING: every hook "
              "point reduced, nothing stored")(lambda wl, ctx: ScopeMemory(wl, ctx, "SNAPSHOT", reductions=True))
register_mode("scope_store", workloads=ALL, quick=("toy",),
              doc="ActivationScope(store=path): streamed into an uncompressed store on disk; the repeat includes "
              "closing the store")(lambda wl, ctx: ScopeStore(wl, ctx, None))
register_mode("scope_store_zstd", workloads=CLASSIC, quick=False,
              doc="the same with store_options={'compression': 'zstd'}")(lambda wl, ctx: ScopeStore(wl, ctx, "zstd"))

class _PerBatchFiles(Mode):
    """Base of the hand-written disk alternatives: hooks keep references for one forward."""

    def _forwards(self, after_forward) -> None:
        wl = self.wl
        batch: dict[str, torch.Tensor] = {}

        def take(name: str, t: torch.Tensor) -> None:
            batch[name] = t

        col = _HookCollector(wl, take)
        col.attach()
        try:
            for f in range(wl.n_forwards):
                col.mask = wl.mask(f)
                wl.forward(f)
                after_forward(f, batch)
                batch.clear()
        finally:
            col.detach()

    def describe(self) -> dict[str, Any]:
        return {"stored_bytes": dir_bytes(self.dir)}

    def reset(self) -> None:
        remove(self.dir)


def _fsync_close(f) -> None:
    f.flush()
    os.fsync(f.fileno())
    f.close()


@register_mode("torch_save", peer=True, workloads=("toy", "transformer_all"), quick=("toy",),
               doc="hooks keep references for one forward, then torch.save({hook point: tensor}, batch-N.pt): "
               "one file per batch (torch.save writes a storage shared by several hook points once: a module's "
               "input that is the previous module's output)")
class TorchSave(_PerBatchFiles):
    def run(self, i: int) -> None:
        self.dir = os.path.join(self.workdir, f"torch_save-{i}")
        os.makedirs(self.dir)

        def save(f: int, batch: dict[str, torch.Tensor]) -> None:
            path = os.path.join(self.dir, f"batch-{f:06d}.pt")
            with open(path, "wb") as fh:
                torch.save(batch, fh)
                if self.fsync:
                    fh.flush()
                    os.fsync(fh.fileno())

        self._forwards(save)


@register_mode("safetensors_save", peer=True, workloads=("toy", "transformer_all"), optional=True, quick=False,
               doc="hooks keep references for one forward, then safetensors.torch.save_file({hook point: tensor}, "
               "batch-N.safetensors): one file per batch (optional `bench` extra)")
class SafetensorsSave(_PerBatchFiles):
    def setup(self) -> None:
        require_optional("safetensors", "bench")
        from safetensors.torch import save_file

        self.save_file = save_file

    def run(self, i: int) -> None:
        self.dir = os.path.join(self.workdir, f"safetensors-{i}")
        os.makedirs(self.dir)

        def save(f: int, batch: dict[str, torch.Tensor]) -> None:
            path = os.path.join(self.dir, f"batch-{f:06d}.safetensors")
            # safetensors refuses tensors that share memory (a module's input is the previous
            # module's output): those are cloned, so every hook point is written, as the store does
            seen: set[int] = set()
            out = {}
            for k, v in batch.items():
                ptr = v.untyped_storage().data_ptr()
                out[k] = v.clone() if ptr in seen else v.contiguous()
                seen.add(ptr)
            self.save_file(out, path)
            if self.fsync:
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)

        self._forwards(save)


@register_mode("np_save", peer=True, workloads=("toy",), quick=False,
               doc="hooks keep references, then np.save of each tensor appended to one open .npys file per hook "
               "point (the appending np.save pattern)")
class NpSave(_PerBatchFiles):
    def run(self, i: int) -> None:
        import numpy as np

        self.dir = os.path.join(self.workdir, f"np_save-{i}")
        os.makedirs(self.dir)
        files: dict[str, Any] = {}

        def save(f: int, batch: dict[str, torch.Tensor]) -> None:
            for name, t in batch.items():
                fh = files.get(name)
                if fh is None:
                    fh = files[name] = open(os.path.join(self.dir, name + ".npys"), "wb")
                np.save(fh, t.numpy())

        try:
            self._forwards(save)
        finally:
            for fh in files.values():
                _fsync_close(fh) if self.fsync else fh.close()


def store_layout(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[int, int]:
    """(chunk rows, chunks per shard) ActivationScope's store gives rows of this shape and dtype."""
    from activationscope.store import _format as F

    return F.chunk_layout(tuple(shape), str(dtype).replace("torch.", ""), None, None)


class _Zarr(_PerBatchFiles):
    """zarr-python (v3), one uncompressed array per hook point, with the store's chunk rows.

    ``append``: ``Array.append`` of every batch (zarr-python rewrites the partial last chunk).
    ``chunked``: arrays pre-sized to the repeat's rows; each hook point's rows are buffered
    to whole chunks and written chunk-aligned (``a[start:stop] = block``): no read-modify-write.
    ``sharded``: the same, into arrays with the store's chunk *and* shard sizes (zarr-python
    reads and rewrites the whole shard on every partial-shard write).
    """

    def __init__(self, wl: Workload, ctx: dict[str, Any], how: str) -> None:
        super().__init__(wl, ctx)
        self.how = how

    def setup(self) -> None:
        import zarr  # noqa: F401  (a dependency of the store)

        self.rows_total = sum(self.wl.rows(f) for f in range(self.wl.n_forwards))

    def run(self, i: int) -> None:
        import numpy as np
        import zarr

        self.dir = os.path.join(self.workdir, f"zarr_{self.how}-{i}.zarr")
        group = zarr.open_group(self.dir, mode="w")
        arrays: dict[str, Any] = {}
        pending: dict[str, list[Any]] = defaultdict(list)
        written: dict[str, int] = defaultdict(int)
        chunk_rows: dict[str, int] = {}

        def flush(name: str) -> None:
            block = np.concatenate(pending[name]) if len(pending[name]) > 1 else pending[name][0]
            s = written[name]
            arrays[name][s : s + block.shape[0]] = block
            written[name] = s + block.shape[0]
            pending[name].clear()

        def save(f: int, batch: dict[str, torch.Tensor]) -> None:
            for name, t in batch.items():
                x = t.numpy()
                a = arrays.get(name)
                if a is None:
                    cr, sc = store_layout(x.shape[1:], t.dtype)
                    chunk_rows[name] = cr
                    shape = (0 if self.how == "append" else self.rows_total, *x.shape[1:])
                    chunks = (cr, *x.shape[1:])
                    shards = (cr * sc, *x.shape[1:]) if self.how == "sharded" else None
                    a = arrays[name] = group.create_array(name, shape=shape, chunks=chunks, shards=shards,
                                                          dtype=x.dtype, compressors=None)
                if self.how == "append":
                    a.append(x)
                    continue
                pending[name].append(x.copy())  # the model may reuse its buffers next forward
                if sum(p.shape[0] for p in pending[name]) >= chunk_rows[name]:
                    flush(name)

        self._forwards(save)
        for name in arrays:
            if pending[name]:
                flush(name)
        if self.fsync:
            _fsync_tree(self.dir)


register_mode("zarr_append", peer=True, workloads=("toy",), quick=False,
              doc="hooks keep references, then zarr-python Array.append per batch into one uncompressed array per "
              "hook point, chunks of the store's chunk rows (256 rows here), no shards")(
    lambda wl, ctx: _Zarr(wl, ctx, "append"))
register_mode("zarr_chunked", peer=True, workloads=("toy",),
              doc="zarr-python, arrays pre-sized to the repeat's rows with the store's chunk rows, rows buffered "
              "to whole chunks and written chunk-aligned (no read-modify-write), no shards")(
    lambda wl, ctx: _Zarr(wl, ctx, "chunked"))
register_mode("zarr_sharded", peer=True, workloads=("toy",), slow=True, quick=False,
              doc="the same with the store's chunk and shard sizes (zarr-python rewrites the whole shard on each "
              "partial-shard write)")(lambda wl, ctx: _Zarr(wl, ctx, "sharded"))


def _fsync_tree(path: str) -> None:
    for root, _dirs, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def _bytes_per_forward(wl: Workload, distinct: bool = False) -> list[int]:
    """Bytes captured by each distinct forward of the workload (probe with reference hooks).

    ``distinct``: count a tensor met twice in one forward once (the output of one layer that
    is the input of the next), as the store writes it once."""
    n_distinct = len(wl.batches)
    out = []
    total = [0]
    seen: dict[tuple[int, int], torch.Tensor] = {}  # held until the forward ends: no address is reused

    def take(name: str, t: torch.Tensor) -> None:
        if distinct:
            key = (t.data_ptr(), t.nbytes)
            if key in seen:
                return
            seen[key] = t
        total[0] += t.nbytes

    col = _HookCollector(wl, take)
    col.attach()
    try:
        for f in range(n_distinct):
            total[0] = 0
            seen.clear()
            col.mask = wl.mask(f)
            wl.forward(f)
            out.append(total[0])
            seen.clear()
    finally:
        col.detach()
    return out


class Memcpy(Mode):
    name = "memcpy"
    doc = "limit: copy the captured bytes (one block per forward) into memory reused across repeats"

    def setup(self) -> None:
        self.per_fwd = _bytes_per_forward(self.wl)
        self.total = sum(self.per_fwd[f % len(self.per_fwd)] for f in range(self.wl.n_forwards))
        self.src = torch.randint(0, 255, (max(self.per_fwd),), dtype=torch.uint8)
        self.dst = None

    def run(self, i: int) -> None:
        if self.dst is None:  # first repeat: fresh memory, first-touch page faults included
            self.dst = torch.empty(self.total, dtype=torch.uint8)
        dst, src, per = self.dst, self.src, self.per_fwd
        off = 0
        for f in range(self.wl.n_forwards):
            b = per[f % len(per)]
            dst[off : off + b].copy_(src[:b])
            off += b

    def describe(self) -> dict[str, Any]:
        return {"captured_bytes": self.total}


class RawWrite(Mode):
    doc = "limit: sequential os.write of the captured bytes (one block per forward) to one file"

    def __init__(self, wl: Workload, ctx: dict[str, Any], fsync: bool) -> None:
        super().__init__(wl, ctx)
        self.fsync = fsync

    def setup(self) -> None:
        import numpy as np

        self.per_fwd = _bytes_per_forward(self.wl)
        self.total = sum(self.per_fwd[f % len(self.per_fwd)] for f in range(self.wl.n_forwards))
        self.src = memoryview(np.random.default_rng(0).integers(0, 255, max(self.per_fwd), dtype=np.uint8))
        self.path = os.path.join(self.workdir, f"raw-write-{os.getpid()}.bin")

    def run(self, i: int) -> None:
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            per, src = self.per_fwd, self.src
            for f in range(self.wl.n_forwards):
                view = src[: per[f % len(per)]]
                while view:
                    n = os.write(fd, view)
                    view = view[n:]
            if self.fsync:
                os.fsync(fd)
        finally:
            os.close(fd)

    def describe(self) -> dict[str, Any]:
        return {"captured_bytes": self.total, "stored_bytes": dir_bytes(self.path), "fsync": self.fsync}

    def reset(self) -> None:
        remove(self.path)


class WriteBeside(Mode):
    """The plain forward while a second thread writes each forward's bytes to one file.

    After every forward the main thread hands the forward's byte count to a writer thread,
    which ``os.write``s that many bytes (page cache; ``fsync`` before close with the fsync
    durability), as the store's writer does with the rows, but with no copy and no checksum:
    the forward and the write of its bytes at the same time on this machine, the floor of a
    capture whose writer overlaps the forward. A repeat ends when the last byte is written.
    The bytes are those the store writes: each distinct tensor of a forward once
    (``_bytes_per_forward(distinct=True)``).
    """

    doc = ("limit: the plain forward while a second thread writes each forward's distinct captured bytes "
           "(one os.write per forward, page cache): a writer that overlaps the forward, with no copy and no checksum")

    def setup(self) -> None:
        import numpy as np

        self.per_fwd = _bytes_per_forward(self.wl, distinct=True)
        self.total = sum(self.per_fwd[f % len(self.per_fwd)] for f in range(self.wl.n_forwards))
        self.src = memoryview(np.random.default_rng(0).integers(0, 255, max(self.per_fwd), dtype=np.uint8))
        self.path = os.path.join(self.workdir, f"write-beside-{os.getpid()}.bin")

    def _writer(self, fd: int, todo: Any, failed: list[BaseException]) -> None:
        try:
            while True:
                n = todo.get()
                if n is None:
                    return
                view = self.src[:n]
                while view:
                    view = view[os.write(fd, view):]
        except BaseException as e:  # noqa: BLE001 - re-raised by run()
            failed.append(e)
            while todo.get() is not None:  # drain: run() must not block on a dead writer
                pass

    def run(self, i: int) -> None:
        import queue
        import threading

        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        todo: Any = queue.SimpleQueue()
        failed: list[BaseException] = []
        th = threading.Thread(target=self._writer, args=(fd, todo, failed), name="write-beside")
        th.start()
        try:
            wl, per = self.wl, self.per_fwd
            for f in range(wl.n_forwards):
                wl.forward(f)
                todo.put(per[f % len(per)])
        finally:
            todo.put(None)
            th.join()
            try:
                if self.fsync and not failed:
                    os.fsync(fd)
            finally:
                os.close(fd)
        if failed:
            raise failed[0]

    def describe(self) -> dict[str, Any]:
        return {"written_bytes": self.total, "stored_bytes": dir_bytes(self.path), "fsync": self.fsync}

    def reset(self) -> None:
        remove(self.path)


register_mode("memcpy", workloads=("toy",), quick=False, doc=Memcpy.doc)(Memcpy)
register_mode("raw_write", workloads=("toy",), doc=RawWrite.doc + ", closed, no fsync (page cache)")(
    lambda wl, ctx: RawWrite(wl, ctx, fsync=False))
register_mode("raw_write_fsync", workloads=("toy",), quick=False, doc=RawWrite.doc + ", fsync before close")(
    lambda wl, ctx: RawWrite(wl, ctx, fsync=True))
register_mode("write_beside", workloads=("toy",), quick=False, doc=WriteBeside.doc)(WriteBeside)
