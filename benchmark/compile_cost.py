"""What tracking costs a ``torch.compile``d model.

ActivationScope replaces each tracked module's ``forward`` with a native callable that
TorchDynamo cannot trace: a compiled model with tracking runs as several compiled graphs
with the tracked modules' calls between them (a graph break at each tracked module). The
records stay exact (checked here against the eager model). This measures, side by side in
one process:

  * ``eager_plain`` / ``eager_tracked``: the eager model, without / with a tracker;
  * ``compiled_plain`` / ``compiled_tracked``: ``torch.compile(model)`` without / with a
    tracker attached (the tracker attached before the first compiled call, so compilation
    happens once per mode, outside the timing);
  * the compiled graphs of each compiled mode (``torch._dynamo`` counters).

Ratios, medians over repeats of ``--forwards`` forwards, ``torch.set_num_threads(1)``,
gradients off, CPU. The tracker keeps only the last record per hook point
(``ReductionPolicy.FINAL_ONLY``) so memory stays flat; each tracked module's output is
copied (SNAPSHOT), as in the default capture.

Run: ``.venv/bin/python -m benchmark.compile_cost [--quick] [--json out.json]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import warnings

import torch

import activationscope as acs


def make_model(width: int, depth: int) -> torch.nn.Module:
    torch.manual_seed(0)
    blocks = [torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU(), torch.nn.LayerNorm(width))
              for _ in range(depth)]
    return torch.nn.Sequential(*blocks).eval()


def _time(fn, x, forwards: int, repeats: int) -> float:
    fn(x)  # warm-up (and compilation)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(forwards):
            fn(x)
        times.append((time.perf_counter() - t0) / forwards)
    return statistics.median(times)


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def run(width: int, depth: int, batch: int, forwards: int, repeats: int) -> dict:
    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    model = make_model(width, depth)
    x = torch.randn(batch, width)
    include = [f"{i}.*" for i in range(depth)]  # every Linear / GELU / LayerNorm: 3 per block
    scope = acs.ActivationScope(reduction_policy="final_only")
    out: dict = {"width": width, "depth": depth, "batch": batch, "forwards": forwards, "repeats": repeats,
                 "tracked_modules": 3 * depth, "torch": torch.__version__}

    out["eager_plain_s"] = _time(model, x, forwards, repeats)
    with scope.track(model, include=include) as tracker:
        out["eager_tracked_s"] = _time(model, x, forwards, repeats)
    eager_records = {k: v[-1].clone() for k, v in tracker.activations.items()}

    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model)
    out["compiled_plain_s"] = _time(compiled, x, forwards, repeats)
    out["compiled_plain_graphs"] = _graphs()

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # dynamo's note that it cannot trace the native wrapper
        with scope.track(model, include=include) as tracker:
            out["compiled_tracked_s"] = _time(compiled, x, forwards, repeats)
    out["compiled_tracked_graphs"] = _graphs()
    out["compiled_tracked_graph_breaks"] = int(sum(counters["graph_break"].values()))
    got = {k: v[-1] for k, v in tracker.activations.items()}
    out["records_exact"] = bool(
        got.keys() == eager_records.keys()
        and all(torch.allclose(got[k], eager_records[k], rtol=1e-5, atol=1e-5) for k in got)
    )
    out["eager_ratio"] = out["eager_tracked_s"] / out["eager_plain_s"]
    out["compiled_ratio"] = out["compiled_tracked_s"] / out["compiled_plain_s"]
    out["compiled_tracked_vs_eager_tracked"] = out["compiled_tracked_s"] / out["eager_tracked_s"]
    out["loadavg"] = os.getloadavg()
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small model, 2 repeats")
    p.add_argument("--json", default=None, help="also write the figures as JSON to this file")
    args = p.parse_args(argv)
    if args.quick:
        res = [run(width=128, depth=4, batch=16, forwards=50, repeats=2)]
    else:
        res = [run(width=256, depth=8, batch=32, forwards=200, repeats=5),
               run(width=1024, depth=8, batch=64, forwards=50, repeats=5)]
    for r in res:
        print(f"width {r['width']}, {r['depth']} blocks, batch {r['batch']}, {r['tracked_modules']} tracked modules:")
        for mode in ("eager_plain", "eager_tracked", "compiled_plain", "compiled_tracked"):
            print(f"  {mode:17s} {r[mode + '_s'] * 1e6:10.1f} us/forward")
        print(f"  tracked / plain: eager {r['eager_ratio']:.2f}x, compiled {r['compiled_ratio']:.2f}x; "
              f"compiled graphs {r['compiled_plain_graphs']} plain, {r['compiled_tracked_graphs']} tracked; "
              f"records exact: {r['records_exact']}; load average {r['loadavg'][0]:.1f}")
    doc = {"runs": res}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=2)
    return doc


if __name__ == "__main__":
    main()
