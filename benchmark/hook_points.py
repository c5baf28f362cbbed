"""How a capture and its store scale with the number of hook points and of commits:
``python -m benchmark.hook_points [--sizes 50,300,1500] [--forwards 200] [--json PATH]``.

For each size N, in a child process of its own (one torch thread, gradients off): an
``nn.Sequential`` of N ``Linear(4, 4)`` (random weights; N hook points, 16 bytes a row, so
the bytes stay small and the per-hook-point and per-commit work shows), batch 2, a ``mean``
reduction on every hook point, 8-row shards and ``commit_interval=0`` (a commit every 4
forwards: many commits). It reports, per size: the plain forward and the capture's forward
(ms, the first forward apart: it makes every array and looks for aliases), the commits,
their time (ms each), the metadata bytes and files written per commit
(every ``zarr.json`` and ``manifest.json`` written while capturing), the partial shards asked
for (``ArrayWriter.snapshot``: none is needed here, every array gets every forward's rows),
the stores opened by a resume, files in the store, the writer's threads and open file
descriptors mid-capture, and the time of ``open_store``, ``Store.info()``, an
``ActivationDataset`` of every hook point, reading one row of one hook point, ``verify()``,
and a resume's setup and first forward. Wall times on a shared machine are noisy; the counts
are not.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

from ._util import write_json


def _child(n: int, n_forwards: int, workdir: str) -> dict[str, Any]:
    import torch

    import activationscope as acs
    from activationscope.capture import _native
    from activationscope.data import ActivationDataset
    from activationscope.store import reader as R
    from activationscope.store import writer as W
    from activationscope.store._backend import LocalBackend

    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(n)]).eval()
    xs = [torch.randn(2, 4) for _ in range(n_forwards)]
    out: dict[str, Any] = {"hook_points": n, "forwards": n_forwards}
    t = time.perf_counter()
    for x in xs:
        model(x)
    out["plain_ms_per_forward"] = (time.perf_counter() - t) / n_forwards * 1e3

    counts = {"commits": 0, "commit_s": 0.0, "meta_bytes": 0, "meta_files": 0, "snapshots": 0, "stores_opened": 0}
    commit_now, set_ = W.StoreWriter._commit_now, LocalBackend.set
    C = _native.load()
    snapshot, store_init = C.ArrayWriter.snapshot, R.Store.__init__

    def timed_commit(self, *a, **k):
        t0 = time.perf_counter()
        try:
            return commit_now(self, *a, **k)
        finally:
            counts["commit_s"] += time.perf_counter() - t0
            counts["commits"] += 1

    def counted_set(self, key, data):
        if key.endswith(".json"):
            counts["meta_bytes"] += len(data)
            counts["meta_files"] += 1
        return set_(self, key, data)

    def counted_snapshot(self):
        counts["snapshots"] += 1
        return snapshot(self)

    def counted_init(self, *a, **k):
        counts["stores_opened"] += 1
        return store_init(self, *a, **k)

    W.StoreWriter._commit_now, LocalBackend.set, C.ArrayWriter.snapshot = timed_commit, counted_set, counted_snapshot
    R.Store.__init__ = counted_init
    path = os.path.join(workdir, f"h{n}.zarr")
    opts = {"commit_interval": 0, "shard_rows": 8, "chunk_rows": 8}
    t = time.perf_counter()
    with acs.ActivationScope(store=path, store_options=opts, reductions=["mean"]).track(model):
        t1 = time.perf_counter()
        for i, x in enumerate(xs):
            model(x)
            if i == 0:  # (the first forward makes every array and looks for aliases among the hook points)
                out["first_forward_s"] = time.perf_counter() - t1
            if i == n_forwards // 2:
                out["threads_mid_capture"] = threading.active_count()
                out["open_fds_mid_capture"] = len(os.listdir("/proc/self/fd"))
        t2 = time.perf_counter()
    out["track_s"] = t1 - t
    out["capture_ms_per_forward"] = (t2 - t1 - out["first_forward_s"]) / max(1, n_forwards - 1) * 1e3
    out["close_s"] = time.perf_counter() - t2
    commits = max(1, counts["commits"])
    out.update(commits=counts["commits"], ms_per_commit=counts["commit_s"] / commits * 1e3,
               metadata_bytes_per_commit=counts["meta_bytes"] / commits,
               metadata_files_per_commit=counts["meta_files"] / commits, partial_shards_asked=counts["snapshots"],
               root_bytes=os.path.getsize(os.path.join(path, "zarr.json")),
               files_in_store=sum(len(f) for _, _, f in os.walk(path)),
               open_fds_after=len(os.listdir("/proc/self/fd")))

    def timed(name: str, fn):
        t0 = time.perf_counter()
        value = fn()
        out[name] = time.perf_counter() - t0
        return value

    st = timed("open_store_s", lambda: acs.open_store(path))
    timed("read_one_row_s", lambda: st.rows(f"{n - 1}.output", 5, 6))
    info = timed("info_s", st.info)
    out["info_hook_points"] = len(info["arrays"])
    timed("dataset_every_hook_point_s", lambda: ActivationDataset(path))
    out["verify_problems"] = len(timed("verify_s", st.verify))
    st.close()
    counts["stores_opened"] = 0
    opts["resume"] = True
    t = time.perf_counter()
    with acs.ActivationScope(store=path, store_options=opts, reductions=["mean"]).track(model):
        t1 = time.perf_counter()
        model(xs[0])
        out["resume_first_forward_s"] = time.perf_counter() - t1
    out["resume_track_s"] = t1 - t
    out["resume_stores_opened"] = counts["stores_opened"]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmark.hook_points", description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="50,300,1500", help="hook point counts, comma-separated")
    ap.add_argument("--forwards", type=int, default=200)
    ap.add_argument("--json", help="write the figures to PATH")
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--workdir", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        print(json.dumps(_child(a.child, a.forwards, a.workdir)))
        return 0
    doc: dict[str, Any] = {"started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "forwards": a.forwards,
                           "loadavg_start": list(os.getloadavg()), "sizes": {}}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    for n in [int(s) for s in a.sizes.split(",") if s.strip()]:
        work = tempfile.mkdtemp(prefix="acs-hook-points-")
        try:
            proc = subprocess.run([sys.executable, "-W", "ignore", "-m", "benchmark.hook_points", "--child", str(n),
                                   "--forwards", str(a.forwards), "--workdir", work],
                                  env=env, capture_output=True, text=True, cwd=root)
            if proc.returncode != 0:  # (what failed, not only that it did)
                print(proc.stderr[-4000:], file=sys.stderr)
                proc.check_returncode()
        finally:
            shutil.rmtree(work, ignore_errors=True)
        m = doc["sizes"][str(n)] = json.loads(proc.stdout.strip().splitlines()[-1])
        print(f"  {n:>5} hook points: {m['capture_ms_per_forward']:8.2f} ms/fwd (plain {m['plain_ms_per_forward']:.2f}; first forward {m['first_forward_s']:.2f} s), "
              f"{m['commits']} commits {m['ms_per_commit']:.1f} ms / {m['metadata_bytes_per_commit'] / 1024:.0f} KiB / "
              f"{m['metadata_files_per_commit']:.0f} files each, {m['partial_shards_asked']} partial shards, "
              f"{m['files_in_store']} files; open {m['open_store_s'] * 1e3:.0f} ms, info {m['info_s']:.2f} s, "
              f"verify {m['verify_s']:.2f} s, resume {m['resume_track_s'] + m['resume_first_forward_s']:.2f} s "
              f"({m['resume_stores_opened']} stores opened)")
    doc["loadavg_end"] = list(os.getloadavg())
    write_json(a.json, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
