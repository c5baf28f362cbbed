"""Read-back modes: a layer is captured once into a store (``build``), then read back.

Stores (built by the ``build_raw`` / ``build_zstd`` modes into ``ctx["readback_dir"]``):
one hook point, rows of 256 float32 (1 KiB per row), ``layer_bytes`` in all, written by
ActivationScope from a ``Linear(256, 256)`` on random inputs; ``build_hf`` converts the
uncompressed store to an HF ``datasets`` Arrow dataset on disk (``save_to_disk``).

Every timed batch is consumed by :func:`consume`: copied into a training-sized buffer and
summed, for every dataset alike, so each byte is really read; the running sum is the
epoch's checksum, which must agree between the datasets of one order (the same rows).
"""

from __future__ import annotations

import gc
import os
import time
from typing import Any

import numpy as np
import torch

from activationscope.sizes import dir_bytes

from ._util import remove, rss_bytes
from .registry import add_mode, ModeSpec, WorkloadSpec, register_workload, require_optional

WIDTH = 256
BUILD_BATCH = 8192


def store_path(ctx: dict[str, Any], compression: str | None) -> str:
    return os.path.join(ctx["readback_dir"], f"layer-{compression or 'raw'}.zarr")


def _open_hook_point(path: str) -> tuple[Any, str]:
    """The store and its (only) hook point, without touching the layer."""
    from activationscope import open_store

    if not os.path.exists(path):
        raise RuntimeError(f"the read-back store {path} was not built (see the build_* records)")
    store = open_store(path)
    if not store.hook_points:
        raise RuntimeError(f"the read-back store {path} holds no hook point (did its build fail? see build_*)")
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
        self.path = store_path(self.ctx, None)
        if not os.path.exists(self.path):
            raise RuntimeError(f"the read-back store {self.path} was not built (see the build_raw record)")
        # import the reader's modules and run its code once, on a tiny store of its own: the
        # reader's code (Python modules, the native extension's pages, first-use set-up) is not
        # the layer's memory
        import activationscope as acs
        import activationscope.store  # noqa: F401
        import numpy  # noqa: F401
        import pyarrow  # noqa: F401
        import zarr  # noqa: F401

        tiny = os.path.join(self.ctx["readback_dir"], "open-warmup.zarr")
        remove(tiny)
        m = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH)).eval()
        with acs.ActivationScope(store=tiny).track(m), torch.no_grad():
            m(torch.randn(4, WIDTH))
        _s, _hp, t = _open_layer(tiny)
        float(t.sum())
        del _s, t

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
        self.ds, self.n_rows, _collate = _dataset(self.dataset, self.ctx)
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


class BatchedTensor(torch.utils.data.Dataset):
    """The fair in-RAM baseline: whole batches by indexing the tensor (``__getitems__``).

    A contiguous batch (a ``range``) is a slice (a view); any other batch is one
    ``index_select`` gather, its index list converted through numpy (about 9 us for 256
    ints, against about 70 us for ``torch.as_tensor`` of the list). With :func:`identity` as
    ``collate_fn`` the DataLoader hands the batch tensor through as is: no per-row
    ``__getitem__``, no stacking.
    """

    def __init__(self, data: torch.Tensor) -> None:
        self.data = data

    def __len__(self) -> int:
        return self.data.shape[0]

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.data[i]

    def __getitems__(self, idx: Any) -> torch.Tensor:
        if isinstance(idx, range) and idx.step == 1:
            return self.data[idx.start : idx.stop]
        return self.data.index_select(0, torch.from_numpy(np.asarray(idx, dtype=np.int64)))


class HFBatched(torch.utils.data.Dataset):
    """HF ``datasets`` (torch format) read a batch at a time: ``ds[indices]["act"]``, as a
    competent user of HF datasets would (one Arrow ``take`` per batch, no per-row access)."""

    def __init__(self, path: str) -> None:
        import datasets

        self.path = path
        self.ds = datasets.load_from_disk(path).with_format("torch")

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.ds[int(i)]["act"]

    def __getitems__(self, idx: Any) -> torch.Tensor:
        if isinstance(idx, range) and idx.step == 1:
            return self.ds[idx.start : idx.stop]["act"]
        return self.ds[list(idx)]["act"]


def identity(batch: Any) -> Any:
    """``collate_fn`` of the batched datasets: the batch is already one tensor."""
    return batch


def _dataset(kind: str, ctx: dict[str, Any]) -> tuple[Any, int, Any]:
    """(dataset, n_rows, collate_fn) for ``tensor`` (TensorDataset in RAM, per-row
    ``__getitem__`` + ``default_collate``), ``tensor_batched`` (the same rows in RAM, whole
    batches), ``acs`` / ``acs_zstd`` (ActivationDataset) or ``hf`` (HF datasets)."""
    if kind in ("tensor", "tensor_batched"):
        _store, _hp, layer = _open_layer(store_path(ctx, None))
        data = layer.clone()  # the same rows, in RAM
        del layer, _store
        if kind == "tensor":
            return torch.utils.data.TensorDataset(data), data.shape[0], None
        return BatchedTensor(data), data.shape[0], identity
    if kind == "hf":
        require_optional("datasets", "bench", "HF datasets")
        path = hf_path(ctx)
        if not os.path.exists(path):
            raise RuntimeError(f"the HF dataset {path} was not built (see the build_hf record)")
        ds = HFBatched(path)
        return ds, len(ds), identity
    from activationscope import ActivationDataset

    path = store_path(ctx, "zstd" if kind == "acs_zstd" else None)
    if not os.path.exists(path):
        raise RuntimeError(f"the read-back store {path} was not built (see the build_* records)")
    _store, hp = _open_hook_point(path)
    ds = ActivationDataset(path, hook_points=[hp])
    return ds, len(ds), None


def hf_path(ctx: dict[str, Any]) -> str:
    return os.path.join(ctx["readback_dir"], "layer-hf")


def batches(kind: str, dl_rows: int, batch_size: int, ctx: dict[str, Any]) -> list[Any]:
    """The batches of one read-back epoch: the first ``dl_rows`` rows' worth of batches of
    the library's batch sampler for ``kind``, built over the uncompressed ActivationDataset.

    The same batches (``range`` objects for sequential, lists of positions otherwise) are
    given as ``batch_sampler`` to every dataset of one ordering, so each reads the same rows
    in the same batches. Shuffled orders are drawn over the whole layer.
    """
    from activationscope.data import ChunkShuffleBatchSampler, SequentialBatchSampler, ShuffledBatchSampler

    ds, _n, _c = _dataset("acs", ctx)
    if kind == "sequential":
        sampler = SequentialBatchSampler(ds, batch_size=batch_size)
    elif kind == "shuffled":
        sampler = ShuffledBatchSampler(ds, batch_size=batch_size, seed=0)
    elif kind == "chunk_shuffled":
        sampler = ChunkShuffleBatchSampler(ds, batch_size=batch_size, seed=0)
    else:
        raise ValueError(f"order must be one of ['sequential', 'shuffled', 'chunk_shuffled'], got {kind!r}")
    out, rows = [], 0
    for b in sampler:
        if rows >= dl_rows:
            break
        out.append(b)
        rows += len(b)
    return out


def activations(batch: Any, key: str | None = None) -> torch.Tensor:
    """The activation tensor of a batch: the tensor itself, or the dict's hook-point entry
    (``batch[key]`` when the hook point ``key`` is given, as a training loop indexes it)."""
    if isinstance(batch, torch.Tensor):
        return batch
    if key is not None and type(batch) is dict:
        return batch[key]
    if isinstance(batch, (list, tuple)) and len(batch) == 1 and isinstance(batch[0], torch.Tensor):
        return batch[0]  # TensorDataset rows collate to [tensor]
    if isinstance(batch, dict):
        ts = [v for v in batch.values() if isinstance(v, torch.Tensor) and v.dim() == 2]
        if len(ts) == 1:
            return ts[0]
    raise TypeError(f"a read-back batch must be a (rows, 256) tensor or a dict holding one, got {type(batch)!r}")


def consume(batch: Any, buf: torch.Tensor, key: str | None = None) -> tuple[int, float]:
    """Consume one batch as a probe's training step would: copy it into the training-sized
    buffer ``buf`` (every byte read) and sum the copy (every element used). ``key``: the
    hook point of a dict batch (see :func:`activations`).

    Returns (rows, sum of the batch in float64 over the float32 copy's per-row sums).
    """
    x = activations(batch, key)
    n = x.shape[0]
    if x.dim() != 2 or x.shape[1] != buf.shape[1]:
        raise ValueError(f"a read-back batch must have shape (rows, {buf.shape[1]}), got {tuple(x.shape)}")
    dst = buf[:n]
    dst.copy_(x)
    return n, float(dst.sum(dtype=torch.float64))


class Loader:
    """One epoch of ``dl_rows`` rows through ``torch.utils.data.DataLoader(batch_sampler=...)``,
    every batch consumed (:func:`consume`)."""

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
        self.ds, self.n_rows, self.collate = _dataset(self.dataset, self.ctx)
        if self.dataset == "acs_zstd" and self.kind != "sequential":
            # as a sampler built on it does (ActivationDataset.fit_cache_to_window): its cache of
            # decoded chunks raised to hold a window of the batches' order (drawn by the sampler
            # of batches() over the uncompressed store's shards), the whole layer for a global shuffle
            if self.kind == "shuffled":
                window = self.n_rows
            else:
                from activationscope.data import ChunkShuffleBatchSampler

                raw, _n, _c = _dataset("acs", self.ctx)
                window = ChunkShuffleBatchSampler(raw, batch_size=self.params["batch_size"], seed=0).window_rows
            self.ds.fit_cache_to_window(window, f"read-back {self.kind}")
        hps = getattr(self.ds, "hook_points", None)
        self.key = hps[0] if hps and len(hps) == 1 else None  # an ActivationDataset's batches: dicts
        self.buf = torch.empty(self.params["batch_size"], WIDTH)
        self.buf.zero_()
        self.rows = 0
        self.checksum = None

    def run(self, i: int) -> None:
        dl = torch.utils.data.DataLoader(self.ds, batch_sampler=self.batches, num_workers=self.workers,
                                         collate_fn=self.collate)
        rows, total = 0, 0.0
        for batch in dl:
            n, s = consume(batch, self.buf, self.key)
            rows += n
            total += s
        self.rows = rows
        expected = sum(len(b) for b in self.batches)
        if rows != expected:
            raise RuntimeError(f"the epoch read {rows} rows, its batches hold {expected}")
        if self.checksum is None:
            self.checksum = total
        elif total != self.checksum:
            raise RuntimeError(f"repeat {i} read other values than the first (sum {total!r} != {self.checksum!r})")

    def describe(self) -> dict[str, Any]:
        import multiprocessing

        return {"rows_per_epoch": self.rows, "batch_size": self.params["batch_size"], "num_workers": self.workers,
                "n_batches": len(self.batches), "epoch_shortened": self.shortened, "checksum": self.checksum,
                "worker_start_method": multiprocessing.get_start_method()}

    def reset(self) -> None:
        pass


class LoaderSideBySide:
    """Ours (``acs``) and the fair in-RAM baseline (``tensor_batched``) read the same epoch
    round-robin in one process (:class:`benchmark.interleaved.Interleaved`): the goal is the
    median over rounds of the baseline's epoch time over ours in the same round, free of the
    10 % two processes can differ by. Both must read the same values (their checksums)."""

    def __init__(self, params: dict[str, Any], ctx: dict[str, Any], kind: str, workers: int) -> None:
        from .interleaved import Interleaved

        self.inner = Interleaved(None, ctx, {"tensor_batched": Loader(params, ctx, "tensor_batched", kind, workers),
                                             "acs": Loader(params, ctx, "acs", kind, workers)})

    def setup(self) -> None:
        self.inner.setup()

    def run(self, i: int) -> None:
        self.inner.run(i)

    def describe(self) -> dict[str, Any]:
        return self.inner.parts["acs"].describe()

    def reset(self) -> None:
        pass

    def summary(self) -> dict[str, Any]:
        sums = {k: m.checksum for k, m in self.inner.parts.items()}
        if len(set(sums.values())) != 1:
            raise RuntimeError(f"the datasets read other values in the same epoch (checksums {sums!r})")
        out = self.inner.summary()
        out["acs_vs_tensor_batched_median"] = out["ratio_median"]["tensor_batched/acs"]  # rows/s ratio
        return out


class BuildHF:
    """Convert the uncompressed store's layer to an HF ``datasets`` Arrow dataset on disk
    (the library's Parquet export, ``Dataset.from_parquet``, ``save_to_disk``): a one-off."""

    def __init__(self, params: dict[str, Any], ctx: dict[str, Any]) -> None:
        self.params, self.ctx = params, ctx

    def setup(self) -> None:
        require_optional("datasets", "bench", "HF datasets")
        import datasets

        from activationscope.data import export_parquet

        datasets.disable_progress_bars()
        self.datasets, self.export_parquet = datasets, export_parquet
        self.src = store_path(self.ctx, None)
        self.out = hf_path(self.ctx)
        self.parquet = os.path.join(self.ctx["readback_dir"], "export.parquet")
        remove(self.out)

    def run(self, i: int) -> None:
        _store, hp = _open_hook_point(self.src)
        # plain lists: HF datasets does not take Arrow's fixed-shape tensor extension type
        self.export_parquet(self.src, self.parquet, hook_points=[hp], tensor_type="fixed_size_list",
                            compression=None)
        ds = self.datasets.Dataset.from_parquet(self.parquet, cache_dir=os.path.join(self.ctx["readback_dir"], "hf-cache"))
        cols = [c for c in ds.column_names if c != hp]
        ds = ds.remove_columns(cols).rename_column(hp, "act")
        ds.save_to_disk(self.out)
        remove(self.parquet)
        remove(os.path.join(self.ctx["readback_dir"], "hf-cache"))

    def describe(self) -> dict[str, Any]:
        n = len(self.datasets.load_from_disk(self.out))
        return {"rows": n, "captured_bytes": n * WIDTH * 4, "stored_bytes": dir_bytes(self.out)}

    def reset(self) -> None:
        pass


DATASETS = ("tensor", "tensor_batched", "acs", "acs_zstd", "hf")
ORDERS = ("sequential", "shuffled", "chunk_shuffled")
WORKERS = (0, 2)
OPTIONAL_DATASETS = {"hf"}
#: rounds of the side-by-side read-back modes by worker count (an epoch with workers is
#: mostly their start-up: ten times as long, and noisier; an epoch without workers takes
#: about 50 ms and two of them differ by up to 20 %: 45 rounds)
SIDE_BY_SIDE_ROUNDS = {0: 45, 2: 9}

register_workload(WorkloadSpec(
    "readback", "data", None,
    {"full": {"layer_bytes": 512 << 20, "dl_rows": 1 << 17, "batch_size": 256, "latency_rows": 2000},
     "quick": {"layer_bytes": 64 << 20, "dl_rows": 1 << 14, "batch_size": 256, "latency_rows": 200}},
    "one layer (rows of 256 float32) captured once into an uncompressed and a zstd store, read back",
    repeats={"full": 3},
    describe=lambda p: f"one layer of {p['layer_bytes'] / (1 << 20):.0f} MiB (rows of 256 float32), epochs of "
    f"{p['dl_rows']} rows, batch {p['batch_size']}, every batch consumed"))


def _reg(name: str, factory: Any, doc: str, **kw: Any) -> None:
    add_mode(ModeSpec(name=name, factory=factory, workloads=("readback",), doc=doc, **kw))


_reg("build_raw", lambda p, c: Build(p, c, None), "capture the layer into an uncompressed store (a one-off, timed once)",
     repeats=0, timeout="build_timeout_s")
_reg("build_zstd", lambda p, c: Build(p, c, "zstd"), "the same into a zstd store", repeats=0,
     timeout="build_timeout_s", needs=("build_raw",), quick=False)
_reg("build_hf", BuildHF, "convert the uncompressed layer to an HF datasets Arrow dataset (export_parquet, "
     "Dataset.from_parquet, save_to_disk; a one-off)", repeats=0, timeout="build_timeout_s", optional=True, peer=True,
     needs=("build_raw",))
_reg("open_layer", OpenLayer, "open_store(path) then store[hook_point] (a zero-copy tensor of the whole layer)",
     repeats=20, needs=("build_raw",))
for _ds in ("tensor", "acs", "acs_zstd"):
    _reg(f"row_latency:{_ds}", lambda p, c, _ds=_ds: RowLatency(p, c, _ds),
         "random single rows one at a time, ds[i] then .clone()", quick=False,
         needs=("build_raw",) + (("build_zstd",) if _ds == "acs_zstd" else ()))
for _kind in ORDERS:
    for _w in WORKERS:
        for _ds in DATASETS:
            _quick = _w == 0 and (_ds in ("tensor_batched", "acs") or (_kind == "sequential" and _ds == "hf"))
            _needs = ("build_raw",) + (("build_zstd",) if _ds == "acs_zstd" else ()) + (
                ("build_hf",) if _ds == "hf" else ())
            _reg(f"dl:{_ds}:{_kind}:w{_w}",
                 lambda p, c, _ds=_ds, _kind=_kind, _w=_w: Loader(p, c, _ds, _kind, _w),
                 f"one epoch through DataLoader, {_kind}, num_workers={_w}, every batch consumed",
                 quick=_quick, optional=_ds in OPTIONAL_DATASETS, peer=_ds in OPTIONAL_DATASETS, needs=_needs)
        _reg(f"dl_side_by_side:{_kind}:w{_w}",
             lambda p, c, _kind=_kind, _w=_w: LoaderSideBySide(p, c, _kind, _w),
             f"ActivationDataset and the in-RAM tensor read a batch at a time, one {_kind} epoch each per round "
             f"(num_workers={_w}), round-robin in one process, rotating order; every batch consumed",
             quick=_w == 0, repeats=SIDE_BY_SIDE_ROUNDS[_w], needs=("build_raw",))
