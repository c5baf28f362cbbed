"""Cold and compressed read-back, side by side: ``python -m benchmark.cold``.

Two figures of issue 16, measured on the same rows in the same run:

- **cold**: rows/s of a sequential epoch (batches of ``--batch`` rows, every batch copied into
  a training-sized buffer and summed) through ``ActivationDataset`` on an uncompressed store,
  and through an HF ``datasets`` Arrow file of the same rows (``load_from_disk``, Arrow
  format, each batch's fixed-size-list column flattened to one zero-copy tensor: the fastest
  way HF datasets hands out a batch). Before every repeat both are evicted from the page
  cache (``benchmark.pagecache``: fsync, ``posix_fadvise(DONTNEED)``) and the eviction is
  checked with a residency count (``mincore``: 0 pages resident, else the run fails). Each
  repeat opens its dataset anew (the open is timed too). Warm epochs follow each cold one.
- **zstd**: the same epoch on a zstd store against the uncompressed store, warm, with the
  decode threads the process may use (``taskset -c 0,1`` for 2 cores).

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
    """An uncompressed and a zstd store of one (n_rows, 256) float32 layer, and an HF Arrow
    dataset of the same rows."""
    import datasets
    import numpy as np

    import activationscope as acs

    datasets.disable_progress_bars()
    paths = {"raw": os.path.join(workdir, "raw.zarr"), "zstd": os.path.join(workdir, "zstd.zarr"),
             "hf": os.path.join(workdir, "hf")}
    torch.manual_seed(0)
    model = torch.nn.Linear(WIDTH, WIDTH)
    for key, opts in (("raw", {}), ("zstd", {"compression": "zstd"})):
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


def epoch_acs(path: str, batch: int, buf: torch.Tensor) -> int:
    from activationscope.data import ActivationDataset, SequentialBatchSampler

    ds = ActivationDataset(path)
    hp = ds.hook_points[0]
    rows = 0
    for b in SequentialBatchSampler(ds, batch_size=batch):
        x = ds.get_batch(b)[hp]
        _consume(x, buf)
        rows += x.shape[0]
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


def timed(fn: Callable[[], int]) -> tuple[float, int]:
    t = time.perf_counter()
    rows = fn()
    return time.perf_counter() - t, rows


def measure(paths: dict[str, str], batch: int, repeats: int) -> dict[str, Any]:
    buf = torch.empty(max(batch, 8192), WIDTH)
    out: dict[str, list[float]] = {k: [] for k in ("acs_cold", "hf_cold", "acs_warm", "hf_warm", "raw_warm",
                                                   "zstd_warm")}
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
        for name in (("raw", "zstd") if r % 2 == 0 else ("zstd", "raw")):
            epoch_acs(paths[name], batch, buf)  # pages cached, decode pool started
            dt, rows = timed(lambda: epoch_acs(paths[name], batch, buf))
            out[f"{name}_warm"].append(rows / dt)
    med = {k: statistics.median(v) for k, v in out.items()}
    return {
        "rows": n, "batch": batch, "repeats": repeats,
        "rows_per_s": med,
        "cold_acs_vs_hf": med["acs_cold"] / med["hf_cold"],
        "warm_acs_vs_hf": med["acs_warm"] / med["hf_warm"],
        "zstd_vs_uncompressed": med["zstd_warm"] / med["raw_warm"],
        "cpus": len(os.sched_getaffinity(0)),
        "goals": {"cold_acs_vs_hf >= 1.0": med["acs_cold"] / med["hf_cold"] >= 1.0,
                  "zstd_vs_uncompressed >= 0.5": med["zstd_warm"] / med["raw_warm"] >= 0.5},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmark.cold", description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=256, help="layer size in MiB (default: %(default)s)")
    p.add_argument("--batch", type=int, default=4096, help="rows per batch (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--workdir", default=None, help="parent of the scratch folder (a disk, not tmpfs)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    work = tempfile.mkdtemp(prefix="acs-cold-", dir=args.workdir)
    try:
        paths = build(work, args.mib * 1024)
        res = measure(paths, args.batch, args.repeats)
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
          f"{res['zstd_vs_uncompressed']:.2f}x (goal >= 0.5)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
