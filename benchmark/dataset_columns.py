"""The ``columns=`` of an ``ActivationDataset`` at scale: ``python -m benchmark.dataset_columns``.

A store of ``--rows`` token rows (samples of ``--pos`` tokens, a per-sample int64 ``label``
given to ``set_batch``, one float16 feature per row) is written once into ``--workdir``
(kept: a later run with the same sizes reuses it). Then, each in a fresh process:

- ``build``: ``ActivationDataset(path, columns=["label"])``: seconds, and the process's peak
  RSS above its RSS before the constructor (the store already open), in MB; the column
  tensor's own bytes for comparison.
- ``spawn``: a ``DataLoader`` of that dataset with ``--workers`` workers started with
  ``--context`` (``spawn`` or ``forkserver``): seconds from ``iter(loader)`` to one batch of
  every worker, and per worker its RSS and USS (private pages: ``Private_Clean +
  Private_Dirty`` of ``/proc/PID/smaps_rollup``) once it has read that batch, in MB.

Linux only (``/proc``). Figures are of one run on a shared machine: compare runs of the same
sizes made one after the other.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

MB = 1 << 20


def _rss_bytes(pid: int | str = "self") -> dict[str, int]:
    got = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 3 and parts[2] == "kB":
                got[parts[0].rstrip(":")] = int(parts[1]) * 1024
    return {"rss": got.get("Rss", 0), "uss": got.get("Private_Clean", 0) + got.get("Private_Dirty", 0),
            "pss": got.get("Pss", 0)}


def build_store(path: Path, n_rows: int, pos: int) -> None:
    """A token store of ``n_rows`` rows: forwards of 4096 samples of ``pos`` tokens each."""
    import torch

    from activationscope.store import StoreWriter

    per_forward = 4096
    w = StoreWriter(path, overwrite=True, commit_interval=60.0)
    x = w.open_array("x", (1,), torch.float16, "token")
    sample, done = 0, 0
    while done < n_rows:
        n = min(per_forward, -(-(n_rows - done) // pos))
        mask = torch.ones(n, pos, dtype=torch.bool)
        extra = n * pos - (n_rows - done)
        if extra > 0:
            mask[-1, pos - extra:] = False
        rows = int(mask.sum())
        x.append(torch.zeros(rows, 1, dtype=torch.float16))
        ids = list(range(sample, sample + n))
        w.add_batch(n, ids, mask, columns={"label": torch.tensor([i % 7 for i in ids], dtype=torch.int64)})
        sample, done = sample + n, done + rows
    w.close()


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run_build(path: str) -> dict[str, Any]:
    import activationscope as acs
    from activationscope.data import ActivationDataset

    store = acs.open_store(path)
    store.row_table("sample", ["sample_id"])  # (the store's own first reads, not the dataset's)
    before = _rss_bytes()["rss"]
    t0 = time.perf_counter()
    ds = ActivationDataset(store, columns=["label"])
    seconds = time.perf_counter() - t0
    label = ds[0:1]["label"]
    col = ds._column_values()["label"]
    return {"rows": len(ds), "seconds": round(seconds, 2), "peak_rss_above_mb": round((_peak_rss_bytes() - before) / MB),
            "rss_after_mb": round((_rss_bytes()["rss"] - before) / MB), "column_mb": round(col.nbytes / MB),
            "column_dtype": str(col.dtype), "first_label": int(label[0])}


def run_spawn(path: str, workers: int, context: str) -> dict[str, Any]:
    import torch
    from torch.utils.data import DataLoader

    from activationscope.data import ActivationDataset, ShuffledBatchSampler

    ds = ActivationDataset(path, columns=["label"])
    sampler = ShuffledBatchSampler(ds, 1024, seed=0)
    loader = DataLoader(ds, batch_sampler=sampler, num_workers=workers, multiprocessing_context=context,
                        persistent_workers=True, prefetch_factor=1)
    t0 = time.perf_counter()
    it = iter(loader)
    batches = [next(it) for _ in range(workers)]  # (one per worker: batches go round the workers)
    seconds = time.perf_counter() - t0
    per_worker = [_rss_bytes(w.pid) for w in it._workers]
    assert all(isinstance(b["label"], torch.Tensor) for b in batches)
    out = {"rows": len(ds), "workers": workers, "context": context, "seconds_to_first_batches": round(seconds, 2),
           "worker_rss_mb": [round(m["rss"] / MB) for m in per_worker],
           "worker_uss_mb": [round(m["uss"] / MB) for m in per_worker],
           "worker_pss_mb": [round(m["pss"] / MB) for m in per_worker]}
    del it
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=5_000_000, help="token rows of the store (default 5000000)")
    p.add_argument("--pos", type=int, default=128, help="tokens per sample (default 128)")
    p.add_argument("--workers", type=int, default=2, help="DataLoader workers of the spawn mode (default 2)")
    p.add_argument("--context", default="spawn", choices=["spawn", "forkserver"])
    p.add_argument("--modes", default="build,spawn", help="comma-separated: build, spawn")
    p.add_argument("--workdir", default=os.environ.get("TMPDIR", "/tmp"), help="where the store is written and kept")
    p.add_argument("--json", help="also write the figures to this file")
    p.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        mode, path = args.child[0], args.child[1]
        got = run_build(path) if mode == "build" else run_spawn(path, args.workers, args.context)
        print(json.dumps(got))
        return 0
    path = Path(args.workdir) / f"acs-columns-{args.rows}x{args.pos}.zarr"
    if not (path / "zarr.json").exists():
        t0 = time.perf_counter()
        build_store(path, args.rows, args.pos)
        print(f"wrote {path} in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    results = {}
    for mode in args.modes.split(","):
        cmd = [sys.executable, "-m", "benchmark.dataset_columns", "--workers", str(args.workers),
               "--context", args.context, "--child", mode, str(path)]
        out = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if out.returncode:
            print(out.stderr, file=sys.stderr)
            return 1
        results[mode] = json.loads(out.stdout.strip().splitlines()[-1])
        print(mode, json.dumps(results[mode]))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
