"""Where the time of a capture into a store goes: ``python -m benchmark.store_profile [--json PATH]``.

On the toy workload (48 x ``Linear(256, 256)``, batch 32, ``capture="both"``: 3 MiB per
forward), interleaved in one process, ``--rounds`` rounds of: the plain forward, a raw write
of the same bytes (one ``os.write`` per forward, page cache), and the capture into an
uncompressed store (in a child process with one torch thread). Per forward it reports wall
time, the CPU time of the
thread that runs the model (``time.thread_time``), the CPU time of every other thread of the
process (the store's writer, ``time.process_time`` minus the former) and minor page faults.
CPU times do not depend on how busy the shared machine is the way wall times do, so they
show which thread does the extra work: medians over rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from ._util import write_json


def _child(n_forwards: int, rounds: int, workdir: str) -> dict[str, Any]:
    import numpy as np
    import torch

    import activationscope as acs

    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(48)]).eval()
    xs = [torch.randn(32, 256) for _ in range(8)]
    per_forward = 96 * 32 * 256 * 4
    src = np.random.default_rng(0).integers(0, 255, per_forward, dtype=np.uint8)
    store_path = os.path.join(workdir, "profile.zarr")
    raw_path = os.path.join(workdir, "raw.bin")

    def plain() -> None:
        for f in range(n_forwards):
            model(xs[f % 8])

    def raw() -> None:
        fd = os.open(raw_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for _ in range(n_forwards):
                view = memoryview(src)
                while view:
                    view = view[os.write(fd, view):]
        finally:
            os.close(fd)

    def store() -> None:
        with acs.ActivationScope(capture="both", store=store_path).track(model):
            for f in range(n_forwards):
                model(xs[f % 8])

    def measure(fn: Any) -> dict[str, float]:
        flt = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        w, m, p = time.perf_counter(), time.thread_time(), time.process_time()
        fn()
        w, m, p = time.perf_counter() - w, time.thread_time() - m, time.process_time() - p
        flt = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - flt
        return {"wall_ms": w * 1e3 / n_forwards, "model_thread_cpu_ms": m * 1e3 / n_forwards,
                "other_threads_cpu_ms": (p - m) * 1e3 / n_forwards, "minor_faults": flt / n_forwards}

    parts = {"plain": plain, "raw_write": raw, "store": store}
    for fn in parts.values():  # warm: imports, first touch
        fn()
    shutil.rmtree(store_path, ignore_errors=True)
    out: dict[str, list[dict[str, float]]] = {k: [] for k in parts}
    for r in range(rounds):
        names = list(parts)
        names = names[r % 3:] + names[: r % 3]
        for name in names:
            out[name].append(measure(parts[name]))
            shutil.rmtree(store_path, ignore_errors=True)
            if os.path.exists(raw_path):
                os.unlink(raw_path)
    return {k: {m: statistics.median(x[m] for x in v) for m in v[0]} for k, v in out.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmark.store_profile", description=__doc__.split("\n\n")[0])
    ap.add_argument("--forwards", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", help="write the figures to PATH")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--workdir", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        print(json.dumps(_child(a.forwards, a.rounds, a.workdir)))
        return 0
    doc: dict[str, Any] = {"started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "forwards": a.forwards,
                           "rounds": a.rounds, "loadavg_start": list(os.getloadavg())}
    work = tempfile.mkdtemp(prefix="acs-store-profile-")
    try:
        e = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        proc = subprocess.run([sys.executable, "-m", "benchmark.store_profile", "--child", "--forwards",
                               str(a.forwards), "--rounds", str(a.rounds), "--workdir", work],
                              env=e, capture_output=True, text=True, check=True)
        doc["parts"] = json.loads(proc.stdout.strip().splitlines()[-1])
    finally:
        shutil.rmtree(work, ignore_errors=True)
    doc["loadavg_end"] = list(os.getloadavg())
    for part, m in doc["parts"].items():
        print(f"  {part:<10} wall {m['wall_ms']:6.2f} ms/fwd  model thread cpu {m['model_thread_cpu_ms']:5.2f}  "
              f"other threads cpu {m['other_threads_cpu_ms']:5.2f}  minor faults {m['minor_faults']:6.1f}")
    write_json(a.json, doc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
