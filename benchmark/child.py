"""One mode of one workload in its own process: ``python -m benchmark.child SPEC.json OUT.json``.

The spec names the workload (and its parameters), the mode, the repeats, the thread count
and the work directory. The child pins torch threads, builds the workload, runs the mode
once cold and then its timed repeats, and writes one JSON record (see README: per-mode
record) to ``OUT.json``. Peak RSS is this process's own ``getrusage`` maximum.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from typing import Any


def _pin_threads(n: int) -> None:
    import torch

    torch.set_num_threads(n)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass


def run_spec(spec: dict[str, Any]) -> dict[str, Any]:
    from . import _util, registry

    rec: dict[str, Any] = {"workload": spec["workload"], "mode": spec["mode"], "status": "ok", "note": ""}
    t_start = time.perf_counter()
    try:
        import torch

        _pin_threads(spec["threads"])
        torch.set_grad_enabled(False)
        registry.load_all()
        wspec = registry.WORKLOADS[spec["workload"]]
        mspec = registry.MODES[spec["mode"]]
        if wspec.kind == "data":
            mode = mspec.factory(spec["params"], spec["ctx"])
            rec["n_forwards"] = None
        else:
            from . import workloads

            wl = workloads.build(spec["workload"], spec["params"])
            mode = mspec.factory(wl, spec["ctx"])
            rec["n_forwards"] = wl.n_forwards
            rec["rows_per_repeat"] = sum(wl.rows(f) for f in range(wl.n_forwards))
        mode.setup()
        rec["rss_setup_bytes"] = _util.rss_bytes()
        rec["peak_reset_after_setup"] = _util.reset_peak_rss()
        cold, reps, info = _util.timed_repeats(
            mode.run, mode.reset, spec["repeats"], spec["budget_s"], describe=mode.describe
        )
        info = dict(info or {})
        if hasattr(mode, "summary"):
            info.update(mode.summary())
        note = info.pop("note", "")
        rec.update(
            cold_s=cold,
            repeat_s=reps,
            n_repeats=len(reps),
            median_s=_util.median(reps) if reps else cold,
            min_s=min(reps) if reps else cold,
            extra=info,
            note=note,
        )
        for key in ("captured_bytes", "stored_bytes", "n_hook_points"):
            if key in info:
                rec[key] = info.pop(key)
    except registry.MissingOptional as e:
        rec.update(status="skipped", note=str(e))
    except Exception as e:
        rec.update(status="error", note=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()[-4000:])
    # ru_maxrss is synced lazily by the kernel; never report a peak below a value seen
    rec["peak_rss_bytes"] = max(_util.peak_rss_bytes(), _util.rss_bytes(), rec.get("rss_setup_bytes") or 0)
    if rec.get("rss_setup_bytes") is not None:
        rec["peak_rss_growth_bytes"] = rec["peak_rss_bytes"] - rec["rss_setup_bytes"]
    rec["child_wall_s"] = time.perf_counter() - t_start
    return rec


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    spec_path, out_path = argv
    with open(spec_path) as f:
        spec = json.load(f)
    rec = run_spec(spec)
    tmp = out_path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(rec, f)
    os.replace(tmp, out_path)
    sys.stdout.flush()
    # skip interpreter teardown (DataLoader workers, zarr thread pools): the record is written
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
