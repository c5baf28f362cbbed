"""What tracking costs a ``torch.compile``d model.

With a tracker attached, a compiled model records through two custom ops of the extension
per tracked module call (``activationscope::call_begin`` / ``call_end``, registered with
``TORCH_LIBRARY``; see docs/design.md, "torch.compile") that TorchDynamo keeps in its graph.
This measures, in one process, on two copies of one model:

  * ``eager_plain`` / ``eager_tracked``: the eager model, without / with a tracker;
  * ``compiled_plain`` / ``compiled_tracked``: ``torch.compile(model)`` without / with a
    tracker attached (attached before the first compiled call, so compilation happens once
    per mode, in the warm-up, outside the timing);
  * the compiled graphs and breaks of the tracked model: ``torch._dynamo.explain`` (one call)
    and dynamo's counters over 4 batch sizes (recompiles), and whether its records equal
    plain PyTorch forward hooks (clone) on the eager model, hook point by hook point, in
    order, for every batch size.

Timing: the four modes take turns within each repeat (side by side, so the machine's drift
hits all of them), ``--forwards`` forwards per repeat, medians over repeats,
``torch.set_num_threads(1)``, gradients off, CPU. The tracker keeps only the last record per
hook point (``ReductionPolicy.FINAL_ONLY``) so memory stays flat; each tracked module's output
is copied (SNAPSHOT), as in the default capture. The load average is recorded: on a shared
machine figures under load are noise.

Run: ``.venv/bin/python -m benchmark.compile_cost [--quick] [--json out.json]``.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import time

import torch

import activationscope as acs


def make_model(width: int, depth: int) -> torch.nn.Module:
    torch.manual_seed(0)
    blocks = [torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU(), torch.nn.LayerNorm(width))
              for _ in range(depth)]
    return torch.nn.Sequential(*blocks).eval()


def _hook_records(model: torch.nn.Module, names: list[str], x: torch.Tensor) -> dict[str, torch.Tensor]:
    """{"<name>.output": clone}: plain PyTorch forward hooks on the eager model."""
    records: dict[str, torch.Tensor] = {}
    handles = [model.get_submodule(n).register_forward_hook(
        lambda m, i, o, n=n: records.__setitem__(f"{n}.output", o.clone())) for n in names]
    try:
        model(x)
    finally:
        for h in handles:
            h.remove()
    return records


def check(width: int, depth: int, batch: int) -> dict:
    """Graphs, breaks and exactness of the tracked compiled model (its own copy)."""
    from torch._dynamo.utils import counters

    model = make_model(width, depth)
    names = [n for n, _ in model.named_modules() if n.count(".") == 1]  # the Linear / GELU / LayerNorm
    xs = [torch.randn(b, width) for b in (batch, batch, batch // 2 + 1, 2 * batch + 3)]
    refs = [_hook_records(model, names, x) for x in xs]
    scope = acs.ActivationScope(reduction_policy="final_only")
    torch._dynamo.reset()
    with scope.track(model, include=names):
        explained = torch._dynamo.explain(model)(xs[0])
    torch._dynamo.reset()
    counters.clear()
    exact = True
    with scope.track(model, include=names) as tracker:
        compiled = torch.compile(model)
        for x, ref in zip(xs, refs):
            compiled(x)
            got = {k: v[-1] for k, v in tracker.activations.items()}
            exact &= got.keys() == ref.keys() and all(
                torch.allclose(got[k], ref[k], rtol=1e-5, atol=1e-5) for k in ref)
    return {"explain_graphs": explained.graph_count,
            "explain_breaks": explained.graph_break_count,
            "graphs_over_4_batch_sizes": int(counters["stats"]["unique_graphs"]),
            "graph_breaks_over_4_batch_sizes": int(sum(counters["graph_break"].values())),
            "records_exact": bool(exact)}


def run(width: int, depth: int, batch: int, forwards: int, repeats: int) -> dict:
    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    out: dict = {"width": width, "depth": depth, "batch": batch, "forwards": forwards, "repeats": repeats,
                 "tracked_modules": 3 * depth, "torch": torch.__version__, "loadavg_start": os.getloadavg()}
    out.update(check(width, depth, batch))

    plain = make_model(width, depth)
    tracked = copy.deepcopy(plain)
    include = [f"{i}.*" for i in range(depth)]  # every Linear / GELU / LayerNorm: 3 per block
    scope = acs.ActivationScope(reduction_policy="final_only")
    x = torch.randn(batch, width)
    torch._dynamo.reset()
    with scope.track(tracked, include=include):
        modes = {"eager_plain": plain, "eager_tracked": tracked,
                 "compiled_plain": torch.compile(plain), "compiled_tracked": torch.compile(tracked)}
        for fn in modes.values():  # warm-up (and compilation)
            fn(x)
            fn(x)
        times: dict[str, list[float]] = {m: [] for m in modes}
        for _ in range(repeats):
            for mode, fn in modes.items():
                t0 = time.perf_counter()
                for _ in range(forwards):
                    fn(x)
                times[mode].append((time.perf_counter() - t0) / forwards)
    for mode, ts in times.items():
        out[f"{mode}_s"] = statistics.median(ts)
    out["eager_ratio"] = out["eager_tracked_s"] / out["eager_plain_s"]
    out["compiled_ratio"] = out["compiled_tracked_s"] / out["compiled_plain_s"]
    out["compiled_tracked_vs_eager_tracked"] = out["compiled_tracked_s"] / out["eager_tracked_s"]
    out["per_tracked_module_us"] = (out["compiled_tracked_s"] - out["compiled_plain_s"]) / (3 * depth) * 1e6
    out["loadavg"] = os.getloadavg()
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small model, 3 repeats")
    p.add_argument("--json", default=None, help="also write the figures as JSON to this file")
    args = p.parse_args(argv)
    if args.quick:
        res = [run(width=128, depth=4, batch=16, forwards=50, repeats=3)]
    else:
        res = [run(width=256, depth=8, batch=32, forwards=200, repeats=7),
               run(width=1024, depth=8, batch=64, forwards=50, repeats=7)]
    for r in res:
        print(f"width {r['width']}, {r['depth']} blocks, batch {r['batch']}, {r['tracked_modules']} tracked modules:")
        for mode in ("eager_plain", "eager_tracked", "compiled_plain", "compiled_tracked"):
            print(f"  {mode:17s} {r[mode + '_s'] * 1e6:10.1f} us/forward")
        print(f"  tracked / plain: eager {r['eager_ratio']:.2f}x, compiled {r['compiled_ratio']:.2f}x "
              f"({r['per_tracked_module_us']:.1f} us per tracked module); explain: {r['explain_graphs']} graph, "
              f"{r['explain_breaks']} breaks; over 4 batch sizes {r['graphs_over_4_batch_sizes']} graphs, "
              f"{r['graph_breaks_over_4_batch_sizes']} breaks; records exact vs forward hooks: {r['records_exact']}; "
              f"load average {r['loadavg_start'][0]:.1f} -> {r['loadavg'][0]:.1f}")
    doc = {"runs": res}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=2)
    return doc


if __name__ == "__main__":
    main()
