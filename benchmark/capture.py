"""Capture modes: each runs one workload's ``n_forwards`` forwards once per repeat.

A mode has ``setup()`` (untimed, may raise :class:`Skip`), ``run(i)`` (repeat ``i``; timed,
including attaching and removing hooks and, for disk modes, closing / flushing files),
``describe()`` (untimed, after the first repeat: bytes captured, hook points, ...) and
``reset()`` (untimed, between repeats: drops the records and deletes files).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from collections import defaultdict
from typing import Any

import torch

from activationscope.sizes import dir_bytes

from ._util import Skip, remove
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


def require_store() -> None:
    try:
        import activationscope.store  # noqa: F401
        from activationscope.store import StoreWriter  # noqa: F401
    except Exception as e:  # ImportError, or a half-written module
        raise Skip(f"activationscope.store is not importable yet ({type(e).__name__}: {e})") from e


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


class Plain(Mode):
    name = "plain"
    doc = "the model's forward, no hooks"

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


class NaiveClone(Mode):
    name = "naive_clone"
    doc = "Python register_forward_hook on the same modules, detach().clone() into lists"

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
        require_store()
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
        try:
            store = self.acs.open_store(self.path)
            out["captured_bytes"] = int(sum(store[hp].nbytes for hp in store.hook_points))
        except Exception as e:  # the reader may not be there yet
            out["note"] = f"could not read the store back to count bytes ({type(e).__name__}: {e})"
        return out

    def reset(self) -> None:
        self.tracker = None
        if self.path:
            remove(self.path)


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


class TorchSave(_PerBatchFiles):
    name = "torch_save"
    doc = "hooks keep references; torch.save({hook point: tensor}) to one file per batch"

    def run(self, i: int) -> None:
        self.dir = os.path.join(self.workdir, f"torch_save-{i}")
        os.makedirs(self.dir)

        def save(f: int, batch: dict[str, torch.Tensor]) -> None:
            path = os.path.join(self.dir, f"batch-{f:06d}.pt")
            if self.fsync:
                with open(path, "wb") as fh:
                    torch.save(batch, fh)
                    fh.flush()
                    os.fsync(fh.fileno())
            else:
                torch.save(batch, path)

        self._forwards(save)


class NpSave(_PerBatchFiles):
    name = "np_save"
    doc = "hooks keep references; np.save appended to one open .npy-stream file per hook point"

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


class ZarrAppend(_PerBatchFiles):
    name = "zarr_append"
    doc = "hooks keep references; zarr-python Array.append per batch, one uncompressed array per hook point"

    def setup(self) -> None:
        try:
            import zarr  # noqa: F401
        except ImportError as e:
            raise Skip(f"zarr-python is not installed ({e})") from e

    def run(self, i: int) -> None:
        import zarr

        self.dir = os.path.join(self.workdir, f"zarr_append-{i}.zarr")
        group = zarr.open_group(self.dir, mode="w")
        arrays: dict[str, Any] = {}

        def save(f: int, batch: dict[str, torch.Tensor]) -> None:
            for name, t in batch.items():
                a = arrays.get(name)
                x = t.numpy()
                if a is None:
                    a = arrays[name] = group.create_array(
                        name, shape=(0, *x.shape[1:]), chunks=(max(1, x.shape[0]), *x.shape[1:]),
                        dtype=x.dtype, compressors=None,
                    )
                a.append(x)

        self._forwards(save)
        if self.fsync:
            _fsync_tree(self.dir)


def _fsync_tree(path: str) -> None:
    for root, _dirs, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


class NNsightMode(Mode):
    name = "nnsight"
    doc = "nnsight NNsight(model).trace(x) saving every selected module's input and/or output"

    def setup(self) -> None:
        if importlib.util.find_spec("nnsight") is None:
            raise Skip("nnsight is not installed (optional `bench` extra: pip install nnsight)")
        from nnsight import NNsight

        self.nm = NNsight(self.wl.model)
        self.envoys = []
        for name, _mod in selected_modules(self.wl):
            env = self.nm
            for part in name.split("."):
                env = getattr(env, part)
            self.envoys.append(env)

    def run(self, i: int) -> None:
        wl = self.wl
        saved = []
        for f in range(wl.n_forwards):
            b = wl.batch(f)
            with self.nm.trace(**b) if isinstance(b, dict) else self.nm.trace(b):
                for env in self.envoys:
                    if wl.capture in ("input", "both"):
                        saved.append(env.input.save())
                    if wl.capture in ("output", "both"):
                        saved.append(env.output.save())
        self.saved = saved

    def describe(self) -> dict[str, Any]:
        total = 0
        for s in self.saved:
            v = getattr(s, "value", s)
            total += sum(t.nbytes for t in leaf_tensors(v))
        return {"captured_bytes": total}

    def reset(self) -> None:
        self.saved = None


class TorchLensMode(Mode):
    name = "torchlens"
    doc = ("TorchLens trace(model, x) (2.x; log_forward_pass(..., layers_to_save='all') before) per forward, "
           "saving every op's output (every op, not only modules)")

    def setup(self) -> None:
        if importlib.util.find_spec("torchlens") is None:
            raise Skip("TorchLens is not installed (optional `bench` extra: pip install torchlens)")
        import torchlens

        self.tl = torchlens

    def run(self, i: int) -> None:
        wl = self.wl
        logs = []
        trace = getattr(self.tl, "trace", None)
        for f in range(wl.n_forwards):
            b = wl.batch(f)
            if trace is not None:  # TorchLens 2.x: saves every op's output by default
                logs.append(trace(wl.model, None, input_kwargs=b) if isinstance(b, dict) else trace(wl.model, b))
            else:
                x = b if not isinstance(b, dict) else [b]
                logs.append(self.tl.log_forward_pass(wl.model, x, layers_to_save="all", vis_opt="none"))
        self.logs = logs

    def describe(self) -> dict[str, Any]:
        """Bytes TorchLens saved (every op's output, so more than the modules' outputs)."""
        total = 0
        for log in self.logs or []:
            for layer in getattr(log, "layer_list", []):
                v = getattr(layer, "out", None)
                if v is None:
                    v = getattr(layer, "tensor_contents", None)
                total += sum(t.nbytes for t in leaf_tensors(v)) if v is not None else 0
        return {"captured_bytes": total} if total else {}

    def reset(self) -> None:
        self.logs = None


def _bytes_per_forward(wl: Workload) -> list[int]:
    """Bytes captured by each distinct forward of the workload (probe with reference hooks)."""
    n_distinct = len(wl.batches)
    out = []
    total = [0]

    def take(name: str, t: torch.Tensor) -> None:
        total[0] += t.nbytes

    col = _HookCollector(wl, take)
    col.attach()
    try:
        for f in range(n_distinct):
            total[0] = 0
            col.mask = wl.mask(f)
            wl.forward(f)
            out.append(total[0])
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


def make(mode: str, wl: Workload, ctx: dict[str, Any]) -> Mode:
    """The capture mode called ``mode`` (see :data:`CAPTURE_MODES`)."""
    if mode in ("plain", "plain_end"):
        return Plain(wl, ctx)
    if mode == "naive_clone":
        return NaiveClone(wl, ctx)
    if mode == "scope_snapshot":
        return ScopeMemory(wl, ctx, "SNAPSHOT")
    if mode == "scope_reference":
        return ScopeMemory(wl, ctx, "REFERENCE")
    if mode == "scope_reductions":
        return ScopeMemory(wl, ctx, "SNAPSHOT", reductions=True)
    if mode == "scope_store":
        return ScopeStore(wl, ctx, None)
    if mode == "scope_store_zstd":
        return ScopeStore(wl, ctx, "zstd")
    if mode == "torch_save":
        return TorchSave(wl, ctx)
    if mode == "np_save":
        return NpSave(wl, ctx)
    if mode == "zarr_append":
        return ZarrAppend(wl, ctx)
    if mode == "nnsight":
        return NNsightMode(wl, ctx)
    if mode == "torchlens":
        return TorchLensMode(wl, ctx)
    if mode == "memcpy":
        return Memcpy(wl, ctx)
    if mode == "raw_write":
        return RawWrite(wl, ctx, fsync=False)
    if mode == "raw_write_fsync":
        return RawWrite(wl, ctx, fsync=True)
    raise ValueError(f"capture mode must be one of {list(CAPTURE_MODES)}, got {mode!r}")


# mode name -> what it does (the README's table follows this)
CAPTURE_MODES = {
    "plain": "the model's forward, no hooks (the baseline of every ratio)",
    "naive_clone": NaiveClone.doc,
    "scope_snapshot": "ActivationScope in memory, CaptureMode.SNAPSHOT (copies)",
    "scope_reference": "ActivationScope in memory, CaptureMode.REFERENCE (keeps the tensors)",
    "scope_store": "ActivationScope(store=path): streamed into an uncompressed store on disk",
    "scope_store_zstd": "ActivationScope(store=path, store_options={'compression': 'zstd'})",
    "torch_save": TorchSave.doc,
    "np_save": NpSave.doc,
    "zarr_append": ZarrAppend.doc,
    "nnsight": NNsightMode.doc,
    "torchlens": TorchLensMode.doc,
    "scope_reductions": "ActivationScope reductions=['mean','var','min','max'], ReductionPolicy.STREAMING, nothing stored",
    "memcpy": Memcpy.doc,
    "raw_write": RawWrite.doc + ", closed, no fsync (page cache)",
    "raw_write_fsync": RawWrite.doc + ", fsync before close",
    "plain_end": "plain again, last of the workload: shows drift of the machine during the run",
}
