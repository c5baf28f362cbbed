"""Read-back modes: a layer is captured once into a store (``build``), then read back.

Stores (built by the ``build_raw`` / ``build_zstd`` modes into ``ctx["readback_dir"]``):
one hook point, rows of 256 float32 (1 KiB per row), ``layer_bytes`` in all, written by
ActivationScope from a ``Linear(256, 256)`` on random inputs.
"""

from __future__ import annotations

import gc
import importlib.util
import os
import time
from typing import Any

import torch

from activationscope.sizes import dir_bytes

from ._util import Skip, remove, rss_bytes

WIDTH = 256
BUILD_BATCH = 8192


def store_path(ctx: dict[str, Any], compression: str | None) -> str:
    return os.path.join(ctx["readback_dir"], f"layer-{compression or 'raw'}.zarr")


def _require(feature: str) -> Any:
    """Import a read-side feature of the library, or skip naming what is missing."""
    try:
        import activationscope as acs

        if feature == "open_store":
            return acs.open_store
        if feature == "ActivationDataset":
            return acs.ActivationDataset
        if feature == "StoreWriter":
            from activationscope.store import StoreWriter

            return StoreWriter
    except Exception as e:
        raise Skip(f"activationscope.{feature} is not importable yet ({type(e).__name__}: {e})") from e
    raise ValueError(feature)


def _open_hook_point(path: str) -> tuple[Any, str]:
    """The store and its (only) hook point, without touching the layer."""
    open_store = _require("open_store")
    if not os.path.exists(path):
        raise Skip(f"the read-back store {path} was not built (see the build_* modes' notes)")
    store = open_store(path)
    if not store.hook_points:
        raise Skip(f"the read-back store {path} holds no hook point (did its build fail? see build_*)")
    return store, store.hook_points[0]


def _open_layer(path: str) -> tuple[Any, str, torch.Tensor]:
    store, hp = _open_hook_point(path)
    return store, hp, store[hp]


def _first_tensor(obj: Any) -> torch.Tensor | None:
    if isinstance(obj, torch.Tensor):
        return obj
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, (list, tuple)):
        for o in obj:
            t = _first_tensor(o)
            if t is not None:
                return t
    return None


class Build:
    """Capture ``layer_bytes`` of rows into a store with ActivationScope (a one-off, timed)."""

    def __init__(self, params: dict[str, Any], ctx: dict[str, Any], compression: str | None) -> None:
        self.params, self.ctx, self.compression = params, ctx, compression

    def setup(self) -> None:
        _require("StoreWriter")
        import activationscope as acs

        self.acs = acs
        self.path = store_path(self.ctx, self.compression)
        remove(self.path)
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH)).eval()
        self.n_rows = self.params["layer_bytes"] // (WIDTH * 4)
        self.x = [torch.randn(BUILD_BATCH, WIDTH) for _ in range(4)]

    def run(self, i: int) -> None:
        opts = {"compression": self.compression} if self.compression else {}
        scope = self.acs.ActivationScope(store=self.path, store_options=opts)
        done = 0
        with scope.track(self.model) as tr:
            k = 0
            while done < self.n_rows:
                n = min(BUILD_BATCH, self.n_rows - done)
                tr.set_batch(sample_ids=torch.arange(done, done + n))
                self.model(self.x[k % 4][:n])
                done += n
                k += 1

    def describe(self) -> dict[str, Any]:
        return {"captured_bytes": self.n_rows * WIDTH * 4, "stored_bytes": dir_bytes(self.path), "rows": self.n_rows}

    def reset(self) -> None:
        pass


class OpenLayer:
    """Open the store and take the layer as a tensor; time and RSS growth per open."""

    def __init__(self, params: dict[str, Any], ctx: dict[str, Any]) -> None:
        self.params, self.ctx = params, ctx
        self.growth: list[int] = []
        self.held = None

    def setup(self) -> None:
        _require("open_store")
        self.path = store_path(self.ctx, None)
        if not os.path.exists(self.path):
            raise Skip(f"the read-back store {self.path} was not built (see the build_raw note)")
        # import the reader's modules now: their code is not the layer's memory
        import activationscope.store  # noqa: F401
        import numpy  # noqa: F401
        import pyarrow  # noqa: F401
        import zarr  # noqa: F401

    def run(self, i: int) -> None:
        before = rss_bytes()
        store, hp, layer = _open_layer(self.path)
        self.growth.append(rss_bytes() - before)
        self.held = (store, layer)

    def describe(self) -> dict[str, Any]:
        layer = self.held[1]
        self.layer_bytes = int(layer.nbytes)
        return {"layer_bytes": self.layer_bytes, "layer_shape": list(layer.shape), "layer_dtype": str(layer.dtype)}

    def summary(self) -> dict[str, Any]:
        return {
            "rss_growth_bytes": self.growth[0],
            "rss_growth_max_bytes": max(self.growth),
            "rss_growth_fraction": self.growth[0] / max(1, self.layer_bytes),
        }

    def reset(self) -> None:
        self.held = None
        gc.collect()


class RowLatency:
    """Random single-row reads ``ds[i].clone()`` (the bytes are really read), one at a time."""

    def __init__(self, params: dict[str, Any], ctx: dict[str, Any], dataset: str) -> None:
        self.params, self.ctx, self.dataset = params, ctx, dataset
        self.lat: list[list[float]] = []

    def setup(self) -> None:
        self.ds, self.n_rows = _dataset(self.dataset, self.ctx)
        g = torch.Generator().manual_seed(1)
        self.idx = torch.randint(0, self.n_rows, (self.params["latency_rows"],), generator=g).tolist()

    def run(self, i: int) -> None:
        ds, out = self.ds, []
        pc = time.perf_counter
        for k in self.idx:
            t0 = pc()
            item = ds[k]
            t = _first_tensor(item)
            if t is not None:
                t.clone()
            out.append(pc() - t0)
        self.lat.append(out)

    def describe(self) -> dict[str, Any]:
        return {"n_reads_per_repeat": len(self.idx), "first_read_us": self.lat[0][0] * 1e6}

    def reset(self) -> None:
        pass

    def summary(self) -> dict[str, Any]:
        timed = sorted(x for rep in self.lat[1:] for x in rep) or sorted(self.lat[0])
        return {
            "median_us": timed[len(timed) // 2] * 1e6,
            "p99_us": timed[min(len(timed) - 1, int(len(timed) * 0.99))] * 1e6,
            "cold_median_us": sorted(self.lat[0])[len(self.lat[0]) // 2] * 1e6,
        }


def _dataset(kind: str, ctx: dict[str, Any]) -> tuple[Any, int]:
    """(dataset, n_rows) for ``tensor`` (TensorDataset in RAM), ``acs`` or ``acs_zstd``."""
    if kind == "tensor":
        _store, _hp, layer = _open_layer(store_path(ctx, None))
        data = layer.clone()  # the same rows, in RAM
        del layer, _store
        return torch.utils.data.TensorDataset(data), data.shape[0]
    ActivationDataset = _require("ActivationDataset")
    path = store_path(ctx, "zstd" if kind == "acs_zstd" else None)
    if not os.path.exists(path):
        raise Skip(f"the read-back store {path} was not built (see the build_* notes)")
    _store, hp = _open_hook_point(path)
    ds = ActivationDataset(path, hook_points=[hp])
    return ds, len(ds)


def _sampler_classes() -> Any:
    try:
        from activationscope.data import ChunkShuffleBatchSampler, SequentialBatchSampler, ShuffledBatchSampler
    except Exception as e:
        raise Skip(f"activationscope.data batch samplers are not importable yet ({type(e).__name__}: {e})") from e
    return SequentialBatchSampler, ShuffledBatchSampler, ChunkShuffleBatchSampler


def batches(kind: str, dl_rows: int, batch_size: int, ctx: dict[str, Any]) -> list[Any]:
    """The batches of one read-back epoch: the first ``dl_rows`` rows' worth of batches of
    the library's batch sampler for ``kind``, built over the uncompressed ActivationDataset.

    The same batches (``range`` objects for sequential, lists of positions otherwise) are
    given as ``batch_sampler`` to every dataset of one ordering, so each reads the same rows
    in the same batches. Shuffled orders are drawn over the whole layer.
    """
    seq, shuf, chunk = _sampler_classes()
    ds, _n = _dataset("acs", ctx)
    if kind == "sequential":
        sampler = seq(ds, batch_size=batch_size)
    elif kind == "shuffled":
        sampler = shuf(ds, batch_size=batch_size, seed=0)
    elif kind == "chunk_shuffled":
        sampler = chunk(ds, batch_size=batch_size, seed=0)
    else:
        raise ValueError(f"order must be one of ['sequential', 'shuffled', 'chunk_shuffled'], got {kind!r}")
    out, rows = [], 0
    for b in sampler:
        if rows >= dl_rows:
            break
        out.append(b)
        rows += len(b)
    return out


class Loader:
    """One epoch of ``dl_rows`` rows through ``torch.utils.data.DataLoader(batch_sampler=...)``."""

    def __init__(self, params: dict[str, Any], ctx: dict[str, Any], dataset: str, kind: str, workers: int) -> None:
        self.params, self.ctx = params, ctx
        self.dataset, self.kind, self.workers = dataset, kind, workers

    def setup(self) -> None:
        self.batches = batches(self.kind, self.params["dl_rows"], self.params["batch_size"], self.ctx)
        self.shortened = False
        if self.dataset == "acs_zstd" and self.kind == "shuffled":
            # A globally shuffled batch of a compressed layer decodes about one chunk per row:
            # measure the rate on 1/64 of the epoch (the chunk-shuffled order is the fast one).
            self.batches = self.batches[: max(2, len(self.batches) // 64)]
            self.shortened = True
        self.ds, self.n_rows = _dataset(self.dataset, self.ctx)
        self.rows = 0

    def run(self, i: int) -> None:
        dl = torch.utils.data.DataLoader(self.ds, batch_sampler=self.batches, num_workers=self.workers)
        rows = 0
        for batch in dl:
            rows += _first_tensor(batch).shape[0]
        self.rows = rows

    def describe(self) -> dict[str, Any]:
        return {"rows_per_epoch": self.rows, "batch_size": self.params["batch_size"], "num_workers": self.workers,
                "n_batches": len(self.batches), "epoch_shortened": self.shortened}

    def reset(self) -> None:
        pass


class HFDatasets:
    """HF ``datasets`` over the library's Parquet export, through a DataLoader (sequential)."""

    def __init__(self, params: dict[str, Any], ctx: dict[str, Any]) -> None:
        self.params, self.ctx = params, ctx

    def setup(self) -> None:
        if importlib.util.find_spec("datasets") is None:
            raise Skip("HF datasets is not installed (pip install datasets); Parquet read-back skipped")
        try:
            import activationscope.data as data
        except Exception as e:
            raise Skip(f"activationscope.data is not importable yet ({type(e).__name__}: {e})") from e
        if not hasattr(data, "export_parquet"):
            raise Skip("activationscope.data.export_parquet is not there yet")
        import datasets

        src = store_path(self.ctx, None)
        _store, hp = _open_hook_point(src)
        out = os.path.join(self.ctx["readback_dir"], "export.parquet")
        remove(out)
        # plain lists: HF datasets does not take Arrow's fixed-shape tensor extension type
        data.export_parquet(src, out, hook_points=[hp], rows=slice(0, self.params["dl_rows"]),
                            tensor_type="fixed_size_list", compression=None)
        self.ds = datasets.load_dataset("parquet", data_files=[out], split="train").with_format("torch")
        self.n = min(self.params["dl_rows"], len(self.ds))

    def run(self, i: int) -> None:
        dl = torch.utils.data.DataLoader(self.ds, batch_size=self.params["batch_size"], sampler=range(self.n))
        for _batch in dl:
            pass

    def describe(self) -> dict[str, Any]:
        return {"rows_per_epoch": self.n}

    def reset(self) -> None:
        pass


def make(mode: str, params: dict[str, Any], ctx: dict[str, Any]) -> Any:
    if mode == "build_raw":
        return Build(params, ctx, None)
    if mode == "build_zstd":
        return Build(params, ctx, "zstd")
    if mode == "open_layer":
        return OpenLayer(params, ctx)
    if mode.startswith("row_latency:"):
        return RowLatency(params, ctx, mode.split(":", 1)[1])
    if mode.startswith("dl:"):
        _, dataset, kind, workers = mode.split(":")
        return Loader(params, ctx, dataset, kind, int(workers[1:]))
    if mode == "hf_datasets":
        return HFDatasets(params, ctx)
    raise ValueError(f"unknown read-back mode {mode!r}")


DATASETS = ("tensor", "acs", "acs_zstd")
ORDERS = ("sequential", "shuffled", "chunk_shuffled")
WORKERS = (0, 2)


def modes(workers: tuple[int, ...] = WORKERS) -> list[str]:
    out = ["build_raw", "build_zstd", "open_layer", "row_latency:tensor", "row_latency:acs", "row_latency:acs_zstd"]
    for kind in ORDERS:
        for w in workers:
            for ds in DATASETS:
                out.append(f"dl:{ds}:{kind}:w{w}")
    out.append("hf_datasets")
    return out
