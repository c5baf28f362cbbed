"""Cold and compressed read-back, side by side: ``python -m benchmark.cold``.

Figures of cold and compressed reads, each measured side by side in one run:

- **cold**: rows/s of a sequential epoch (batches of ``--batch`` rows, every batch copied into
  a training-sized buffer and summed) through ``ActivationDataset`` on an uncompressed store,
  and through an HF ``datasets`` Arrow file of the same rows (``load_from_disk``, Arrow
  format, each batch's fixed-size-list column flattened to one zero-copy tensor: the fastest
  way HF datasets hands out a batch). Before every repeat both are evicted from the page
  cache (``benchmark.pagecache``: fsync, ``posix_fadvise(DONTNEED)``) and the eviction is
  checked with a residency count (``mincore``: 0 pages resident, else the run fails). Each
  repeat opens its dataset anew (the open is timed too). Warm epochs follow each cold one.
- **zstd** and **blosc-lz4**: the same epoch on a zstd store and on a blosc-lz4 store (byte
  shuffle) against the uncompressed store, warm, with the decode threads the process may use
  (``taskset -c 0,1`` for 2 cores), and each store's bytes on disk (its ``acts/`` folder):
  what the compression saves for what it costs to read.
- **cold shuffled**: the first ``--shuffled-batches`` batches of ``--shuffled-batch`` rows at uniformly
  random positions of a cold layer of ``--shuffled-mib`` MiB of 16 KiB rows (4096 float32),
  every batch copied and summed, the start of a shuffled epoch: ``ActivationDataset`` (its
  rule: in blocks around each row for a layer that fits in half the memory, else each row's
  own pages; see ``GATHER_HINT_BLOCK`` in ``activationscope/data/_source.py``), the same
  dataset asking each row's own pages whatever the layer's size (the rule for a layer larger
  than memory), the dataset without hints (page faults and the kernel's read-around), numpy's ``np.load(mmap_mode="r")[positions]`` of a ``.npy`` of the same rows
  (page faults with the kernel's read-around), and an HF ``datasets`` Arrow file
  (``ds[positions]``). A layer larger than memory (``--shuffled-mib`` above the RAM, with
  ``--no-shuffled-peers`` when the disk has no room for three copies) shows the second rule on
  its own.

Ratios are medians over ``--repeats`` repeats, the two sides alternating within a repeat.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any, Callable

import torch

from . import pagecache

WIDTH = 256


def _consume(x: torch.Tensor, buf: torch.Tensor) -> float:
    dst = buf[: x.shape[0]]
    dst.copy_(x)
    return float(dst.sum(dtype=torch.float64))


def build(workdir: str, n_rows: int) -> dict[str, str]:
    """An uncompressed, a zstd and a blosc-lz4 store of one (n_rows, 256) float32 layer (a
    random linear layer's outputs), and an HF Arrow dataset of the same rows."""
    import datasets
    import numpy as np

    import activationscope as acs

    datasets.disable_progress_bars()
    paths = {"raw": os.path.join(workdir, "raw.zarr"), "zstd": os.path.join(workdir, "zstd.zarr"),
             "blosc": os.path.join(workdir, "blosc.zarr"), "hf": os.path.join(workdir, "hf")}
    torch.manual_seed(0)
    model = torch.nn.Linear(WIDTH, WIDTH)
    for key, opts in (("raw", {}), ("zstd", {"compression": "zstd"}), ("blosc", {"compression": "blosc-lz4"})):
        scope = acs.ActivationScope(store=paths[key], store_options={"overwrite": True, **opts})
        with torch.no_grad(), scope.track(model):
            for k in range(0, n_rows, 4096):
                g = torch.Generator().manual_seed(k)
                model(torch.randn(min(4096, n_rows - k), WIDTH, generator=g))
    store = acs.open_store(paths["raw"])
    layer = store["output"]
    feats = datasets.Features({"act": datasets.Sequence(datasets.Value("float32"), length=WIDTH)})

    def gen():
        for a in range(0, n_rows, 8192):
            yield {"act": np.asarray(layer[a:a + 8192].numpy())}

    tables = [datasets.Dataset.from_dict(part, features=feats) for part in gen()]
    datasets.concatenate_datasets(tables).save_to_disk(paths["hf"])
    del layer, store, tables
    gc.collect()
    return paths


SHUFFLED_WIDTH = 4096
SHUFFLED_HOOK_POINT = "0.output"


def build_shuffled(workdir: str, mib: int, peers: bool = True) -> dict[str, str]:
    """An uncompressed store of one (rows, 4096) float32 layer of ``mib`` MiB and, with
    ``peers``, a ``.npy`` and an HF Arrow dataset of the same rows."""
    import datasets
    import numpy as np

    import activationscope as acs

    datasets.disable_progress_bars()
    n_rows = mib * 64
    paths = {"acs": os.path.join(workdir, "wide.zarr")}
    if peers:
        paths.update(npy=os.path.join(workdir, "wide.npy"), hf=os.path.join(workdir, "wide-hf"))
    model = torch.nn.Sequential(torch.nn.Identity())
    with torch.no_grad(), acs.ActivationScope(store=paths["acs"]).track(model):
        for k in range(0, n_rows, 1024):
            model(torch.randn(min(1024, n_rows - k), SHUFFLED_WIDTH, generator=torch.Generator().manual_seed(k)))
    if not peers:
        return paths
    store = acs.open_store(paths["acs"])
    layer = store[store.hook_points[0]]
    out = np.lib.format.open_memmap(paths["npy"], mode="w+", dtype=np.float32, shape=(n_rows, SHUFFLED_WIDTH))
    feats = datasets.Features({"act": datasets.Sequence(datasets.Value("float32"), length=SHUFFLED_WIDTH)})
    tables = []
    for a in range(0, n_rows, 2048):
        part = np.asarray(layer[a:a + 2048].numpy())
        out[a:a + 2048] = part
        tables.append(datasets.Dataset.from_dict({"act": part}, features=feats))
    out.flush()
    datasets.concatenate_datasets(tables).save_to_disk(paths["hf"])
    del out, layer, store, tables
    gc.collect()
    return paths


def shuffled_acs(path: str, batches: list[list[int]], buf: torch.Tensor) -> tuple[int, float]:
    """(rows, checksum) of the batches read through ActivationDataset (each reader alike)."""
    from activationscope.data import ActivationDataset

    ds = ActivationDataset(path)
    hp = ds.hook_points[0]
    rows, total = 0, 0.0
    for idx in batches:
        x = ds.get_batch(idx)[hp]
        total += _consume(x, buf)
        rows += x.shape[0]
    return rows, total


def shuffled_acs_rows(path: str, batches: list[list[int]], buf: torch.Tensor) -> tuple[int, float]:
    from activationscope.data import _source

    before = _source.GATHER_BLOCK_MEMORY_FRACTION
    _source.GATHER_BLOCK_MEMORY_FRACTION = 0.0  # as for a layer larger than memory
    try:
        return shuffled_acs(path, batches, buf)
    finally:
        _source.GATHER_BLOCK_MEMORY_FRACTION = before


def shuffled_acs_faults(path: str, batches: list[list[int]], buf: torch.Tensor) -> tuple[int, float]:
    from activationscope.data import _source

    before = _source.gather_hint_block
    _source.gather_hint_block = lambda array_bytes: -1  # no hint: page faults and the kernel's read-around
    try:
        return shuffled_acs(path, batches, buf)
    finally:
        _source.gather_hint_block = before


def shuffled_npy(path: str, batches: list[list[int]], buf: torch.Tensor) -> tuple[int, float]:
    import numpy as np

    arr = np.load(path, mmap_mode="r")
    rows, total = 0, 0.0
    for idx in batches:
        x = torch.from_numpy(arr[np.asarray(idx)])
        total += _consume(x, buf)
        rows += x.shape[0]
    del arr
    return rows, total


def shuffled_hf(path: str, batches: list[list[int]], buf: torch.Tensor) -> tuple[int, float]:
    import datasets

    ds = datasets.load_from_disk(path).with_format("arrow")
    rows, total = 0, 0.0
    for idx in batches:
        col = ds[idx]["act"]
        flat = col.combine_chunks().values if hasattr(col, "combine_chunks") else col.values
        x = torch.from_numpy(flat.to_numpy(zero_copy_only=True)).view(-1, SHUFFLED_WIDTH)
        total += _consume(x, buf)
        rows += x.shape[0]
    return rows, total


def measure_shuffled(paths: dict[str, str], batch: int, n_batches: int, repeats: int) -> dict[str, Any]:
    """rows/s of the first ``n_batches`` shuffled batches of the cold layer, per reader
    (median over ``repeats``, the readers' order rotated each repeat): the dataset (its rule),
    the dataset row by row (``acs_rows``), the dataset without hints (``acs_faults``: page
    faults and the kernel's read-around) and, when ``paths`` has them, numpy and HF datasets.
    Every reader's checksum of a repeat's batches must agree."""
    import activationscope as acs

    n_rows = acs.open_store(paths["acs"]).n_rows(SHUFFLED_HOOK_POINT)
    buf = torch.empty(batch, SHUFFLED_WIDTH)
    readers = [("acs", paths["acs"], shuffled_acs), ("acs_rows", paths["acs"], shuffled_acs_rows),
               ("acs_faults", paths["acs"], shuffled_acs_faults)]
    if "npy" in paths:
        readers += [("npy", paths["npy"], shuffled_npy), ("hf", paths["hf"], shuffled_hf)]
    out: dict[str, list[float]] = {name: [] for name, _p, _f in readers}
    for r in range(repeats):
        g = torch.Generator().manual_seed(r)
        perm = torch.randperm(n_rows, generator=g)[: batch * n_batches].tolist()
        batches = [perm[i:i + batch] for i in range(0, len(perm), batch)]
        sums = {}
        for name, path, fn in readers[r % len(readers):] + readers[: r % len(readers)]:
            gc.collect()
            pagecache.evict_checked(path)
            dt, (rows, sums[name]) = timed(lambda: fn(path, batches, buf))
            out[name].append(rows / dt)
        if max(sums.values()) - min(sums.values()) > 1e-6 * max(1.0, max(abs(v) for v in sums.values())):
            raise RuntimeError(f"the readers read other rows: checksums {sums}")
    med = {k: statistics.median(v) for k, v in out.items()}
    res = {"rows": n_rows, "row_bytes": SHUFFLED_WIDTH * 4, "batch": batch, "batches": n_batches,
           "repeats": repeats, "rows_per_s": med, "memory_bytes": _source_memory(),
           "acs_vs_faults": med["acs"] / med["acs_faults"], "acs_rows_vs_faults": med["acs_rows"] / med["acs_faults"]}
    if "npy" in med:
        res.update(acs_vs_npy=med["acs"] / med["npy"], acs_vs_hf=med["acs"] / med["hf"],
                   acs_rows_vs_npy=med["acs_rows"] / med["npy"])
    return res


def _source_memory() -> int:
    from activationscope.data import _source

    return _source._memory_bytes()


def epoch_acs(path: str, batch: int, buf: torch.Tensor, sums: set[float] | None = None) -> int:
    """Rows of one sequential epoch of the store's first hook point (the epoch's checksum, the
    sum of every batch's sums, added to ``sums`` when given)."""
    from activationscope.data import ActivationDataset, SequentialBatchSampler

    ds = ActivationDataset(path)
    hp = ds.hook_points[0]
    rows = 0
    total = 0.0
    for b in SequentialBatchSampler(ds, batch_size=batch):
        x = ds.get_batch(b)[hp]
        total += _consume(x, buf)
        rows += x.shape[0]
    if sums is not None:
        sums.add(total)
    return rows


def epoch_hf(path: str, batch: int, buf: torch.Tensor) -> int:
    import datasets

    ds = datasets.load_from_disk(path).with_format("arrow")
    rows = 0
    for a in range(0, len(ds), batch):
        col = ds[a:a + batch]["act"]
        flat = col.combine_chunks().values if hasattr(col, "combine_chunks") else col.values
        x = torch.from_numpy(flat.to_numpy(zero_copy_only=True)).view(-1, WIDTH)
        _consume(x, buf)
        rows += x.shape[0]
    return rows


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t = time.perf_counter()
    rows = fn()
    return time.perf_counter() - t, rows


def acts_bytes(path: str) -> int:
    """Bytes of a store's arrays on disk (its ``acts/`` folder)."""
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(os.path.join(path, "acts"))
               for f in files)


def measure(paths: dict[str, str], batch: int, repeats: int) -> dict[str, Any]:
    buf = torch.empty(max(batch, 8192), WIDTH)
    out: dict[str, list[float]] = {k: [] for k in ("acs_cold", "hf_cold", "acs_warm", "hf_warm", "raw_warm",
                                                   "zstd_warm", "blosc_warm")}
    sums: dict[str, set[float]] = {k: set() for k in ("raw", "zstd", "blosc")}
    n = None
    for r in range(repeats):
        order = [("acs", paths["raw"], epoch_acs), ("hf", paths["hf"], epoch_hf)]
        if r % 2:
            order.reverse()
        for name, path, fn in order:
            gc.collect()
            pagecache.evict_checked(path)
            dt, rows = timed(lambda: fn(path, batch, buf))
            out[f"{name}_cold"].append(rows / dt)
            dt, rows = timed(lambda: fn(path, batch, buf))
            out[f"{name}_warm"].append(rows / dt)
            n = rows
        names = ("raw", "zstd", "blosc")
        for name in (names if r % 2 == 0 else names[::-1]):
            epoch_acs(paths[name], batch, buf, sums[name])  # pages cached, decode pool started
            dt, rows = timed(lambda: epoch_acs(paths[name], batch, buf))
            out[f"{name}_warm"].append(rows / dt)
    if len(set.union(*sums.values())) != 1:
        raise RuntimeError(f"the uncompressed and compressed stores read different rows: checksums {sums}")
    sizes = {name: acts_bytes(paths[name]) for name in ("raw", "zstd", "blosc")}
    med = {k: statistics.median(v) for k, v in out.items()}
    return {
        "rows": n, "batch": batch, "repeats": repeats,
        "rows_per_s": med,
        "cold_acs_vs_hf": med["acs_cold"] / med["hf_cold"],
        "warm_acs_vs_hf": med["acs_warm"] / med["hf_warm"],
        "zstd_vs_uncompressed": med["zstd_warm"] / med["raw_warm"],
        "blosc_vs_uncompressed": med["blosc_warm"] / med["raw_warm"],
        "acts_bytes": sizes,
        "zstd_size_ratio": sizes["raw"] / sizes["zstd"],
        "blosc_size_ratio": sizes["raw"] / sizes["blosc"],
        "cpus": len(os.sched_getaffinity(0)),
        "goals": {"cold_acs_vs_hf >= 1.0": med["acs_cold"] / med["hf_cold"] >= 1.0,
                  "zstd_vs_uncompressed >= 0.5": med["zstd_warm"] / med["raw_warm"] >= 0.5},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmark.cold", description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=256, help="layer size in MiB (default: %(default)s)")
    p.add_argument("--batch", type=int, default=4096, help="rows per batch (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--shuffled-mib", type=int, default=2048,
                   help="size of the cold shuffled layer in MiB, rows of 16 KiB (default: %(default)s; 0: skip)")
    p.add_argument("--shuffled-batches", type=int, default=8, help="shuffled batches timed per repeat")
    p.add_argument("--shuffled-batch", type=int, default=1024, help="rows per shuffled batch (default: %(default)s)")
    p.add_argument("--no-shuffled-peers", dest="shuffled_peers", action="store_false",
                   help="no numpy / HF copies of the shuffled layer (a layer larger than memory, on a disk "
                        "without room for three copies)")
    p.add_argument("--workdir", default=None, help="parent of the scratch folder (a disk, not tmpfs)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    work = tempfile.mkdtemp(prefix="acs-cold-", dir=args.workdir)
    try:
        paths = build(work, args.mib * 1024)
        res = measure(paths, args.batch, args.repeats)
        shutil.rmtree(work, ignore_errors=True)
        os.makedirs(work, exist_ok=True)
        if args.shuffled_mib > 0:
            wide = build_shuffled(work, args.shuffled_mib, args.shuffled_peers)
            res["shuffled"] = measure_shuffled(wide, args.shuffled_batch, args.shuffled_batches, args.repeats)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    r = res["rows_per_s"]
    print(f"{res['rows']} rows of {WIDTH} float32, batches of {res['batch']}, median of {res['repeats']}, "
          f"{res['cpus']} CPUs")
    print(f"cold:  ActivationScope {r['acs_cold'] / 1e6:.3f} M rows/s, HF datasets Arrow {r['hf_cold'] / 1e6:.3f}: "
          f"{res['cold_acs_vs_hf']:.2f}x (goal >= 1.0)")
    print(f"warm:  ActivationScope {r['acs_warm'] / 1e6:.3f} M rows/s, HF datasets Arrow {r['hf_warm'] / 1e6:.3f}: "
          f"{res['warm_acs_vs_hf']:.2f}x")
    print(f"zstd:  {r['zstd_warm'] / 1e6:.3f} M rows/s vs uncompressed {r['raw_warm'] / 1e6:.3f}: "
          f"{res['zstd_vs_uncompressed']:.2f}x (goal >= 0.5); {res['zstd_size_ratio']:.3f}x smaller on disk")
    print(f"blosc-lz4: {r['blosc_warm'] / 1e6:.3f} M rows/s: {res['blosc_vs_uncompressed']:.2f}x the uncompressed "
          f"store's rate; {res['blosc_size_ratio']:.3f}x smaller on disk")
    sh = res.get("shuffled")
    if sh:
        r = sh["rows_per_s"]
        print(f"cold shuffled: first {sh['batches']} batches of {sh['batch']} random rows of {SHUFFLED_WIDTH} float32 "
              f"({sh['rows']} rows, {sh['rows'] * sh['row_bytes'] / sh['memory_bytes']:.2f}x the memory), rows/s: "
              f"ActivationScope {r['acs']:,.0f} (each row's own pages: {r['acs_rows']:,.0f}; no hints, page faults: "
              f"{r['acs_faults']:,.0f}): {sh['acs_vs_faults']:.2f}x page faults (row pages {sh['acs_rows_vs_faults']:.2f}x)")
        if "npy" in r:
            print(f"               numpy memmap {r['npy']:,.0f}, HF datasets Arrow {r['hf']:,.0f}: "
                  f"{sh['acs_vs_npy']:.2f}x numpy, {sh['acs_vs_hf']:.2f}x HF (row pages {sh['acs_rows_vs_npy']:.2f}x numpy)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
