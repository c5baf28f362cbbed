"""What tracking costs a ``torch.compile``d model.

ActivationScope replaces each tracked module's ``forward`` with a native callable that
TorchDynamo cannot trace: with a tracker attached, dynamo compiles no graph at all
(``torch._dynamo.explain`` counts 0 graphs) and the compiled model runs eagerly. The records
stay exact (checked here against the eager model). This measures, side by side in
one process:

  * ``eager_plain`` / ``eager_tracked``: the eager model, without / with a tracker;
  * ``compiled_plain`` / ``compiled_tracked``: ``torch.compile(model)`` without / with a
    tracker attached (the tracker attached before the first compiled call, so compilation
    happens once per mode, outside the timing);
  * ``compiled_custom_op``: ``torch.compile(model)`` with the same modules recorded by a
    prototype of an in-graph path (not the product): each tracked module's ``forward`` is a
    Python function that calls the original and hands its output to a ``torch.library``
    custom op (``acsbench::record``, ``mutates_args=("token",)`` so the compiler keeps it,
    in order; a fake implementation for tracing) whose implementation copies it into a list.
    With ``--cpp-op`` the same with a C++ ``TORCH_LIBRARY`` op (``compile_record_op.cpp``,
    built with ``torch.utils.cpp_extension.load`` on first use: a minute or two), which
    leaves out the Python call per recorded module.
    It shows what a custom op does to the compiled graph: ``torch._dynamo.explain`` counts
    one graph and no break, and its records are checked against plain PyTorch forward hooks
    (clone) on the eager model, for batch sizes that make dynamo recompile;
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


_RECORDS: list = []   # (site, tensor) of the custom-op prototype, in call order
_SITES: list[str] = []
_TOKEN = torch.zeros(1)


@torch.library.custom_op("acsbench::record", mutates_args=("token",))
def _record(token: torch.Tensor, x: torch.Tensor, site: int) -> None:
    _RECORDS.append((_SITES[site], x.detach().clone()))


@_record.register_fake
def _(token: torch.Tensor, x: torch.Tensor, site: int) -> None:
    return None


def _install_custom_op(model: torch.nn.Module, names: list[str]) -> None:
    """The prototype: each named module's forward records its output through ``_record``."""
    for name in names:
        module = model.get_submodule(name)
        original = module.forward
        site = len(_SITES)
        _SITES.append(name)

        def forward(*args, _original=original, _site=site, **kwargs):
            out = _original(*args, **kwargs)
            _record(_TOKEN, out, _site)
            return out

        object.__setattr__(module, "forward", forward)


def _hook_records(model: torch.nn.Module, names: list[str], x: torch.Tensor) -> list:
    """(name, output clone) per call, in call order: plain PyTorch forward hooks."""
    records: list = []
    handles = [model.get_submodule(n).register_forward_hook(lambda m, i, o, n=n: records.append((n, o.clone())))
               for n in names]
    try:
        model(x)
    finally:
        for h in handles:
            h.remove()
    return records


_CPP: list = []  # the built C++ prototype extension, once


def _cpp_ext():
    if not _CPP:
        from torch.utils.cpp_extension import load

        ext = load("acs_bench_record_op", [os.path.join(os.path.dirname(__file__), "compile_record_op.cpp")],
                   extra_cflags=["-O2"], verbose=False)

        @torch.library.register_fake("acsc::record")
        def _(token: torch.Tensor, x: torch.Tensor, site: int) -> None:
            return None

        _CPP.append(ext)
    return _CPP[0]


def _install_cpp_op(model: torch.nn.Module, names: list[str]) -> None:
    op = torch.ops.acsc.record.default
    for i, name in enumerate(names):
        module = model.get_submodule(name)

        def forward(*args, _original=module.forward, _site=i, **kwargs):
            out = _original(*args, **kwargs)
            op(_TOKEN, out, _site)
            return out

        object.__setattr__(module, "forward", forward)


def _take_cpp(names: list[str]) -> list:
    ext = _cpp_ext()
    records = ext.take()
    return [(names[s], t) for s, t in zip(ext.sites(), records)]


def custom_op_prototype(width: int, depth: int, batch: int, forwards: int, repeats: int, cpp: bool = False) -> dict:
    """The in-graph prototype: graphs and breaks (explain), exactness, time per forward;
    ``cpp``: the C++ op of ``compile_record_op.cpp`` instead of the Python custom op."""
    from torch._dynamo.utils import counters

    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    model = make_model(width, depth)
    names = [n for n, _ in model.named_modules() if n.count(".") == 1]  # the Linear / GELU / LayerNorm
    xs = [torch.randn(b, width) for b in (batch, batch, batch // 2 + 1, 2 * batch + 3)]
    refs = [_hook_records(model, names, x) for x in xs]
    if cpp:
        _cpp_ext()
        _install_cpp_op(model, names)
        take = lambda: _take_cpp(names)  # noqa: E731
    else:
        _install_custom_op(model, names)

        def take() -> list:
            got = _RECORDS[:]
            _RECORDS.clear()
            return got
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(xs[0])
    take()
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model)
    exact = True
    for x, ref in zip(xs, refs):
        compiled(x)
        got = take()
        exact &= [n for n, _ in got] == [n for n, _ in ref] and all(
            torch.allclose(a, b, rtol=1e-5, atol=1e-5) for (_, a), (_, b) in zip(got, ref))
    graphs = int(counters["stats"]["unique_graphs"])
    x = xs[0]

    def step(inp):
        compiled(inp)
        take()  # keep memory flat, as FINAL_ONLY does for the tracker

    key = "cpp_op" if cpp else "custom_op"
    return {f"{key}_explain_graphs": explained.graph_count,
            f"{key}_explain_breaks": explained.graph_break_count,
            f"{key}_graphs_over_4_batch_sizes": graphs,
            f"{key}_records_exact": bool(exact),
            f"compiled_{key}_s": _time(step, x, forwards, repeats)}


def run(width: int, depth: int, batch: int, forwards: int, repeats: int, cpp_op: bool = False) -> dict:
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
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with scope.track(model, include=include):
            explained = torch._dynamo.explain(model)(x)
    out["compiled_tracked_explain_graphs"] = explained.graph_count
    out.update(custom_op_prototype(width, depth, batch, forwards, repeats))
    out["custom_op_ratio"] = out["compiled_custom_op_s"] / out["compiled_plain_s"]
    if cpp_op:
        out.update(custom_op_prototype(width, depth, batch, forwards, repeats, cpp=True))
        out["cpp_op_ratio"] = out["compiled_cpp_op_s"] / out["compiled_plain_s"]
    out["eager_ratio"] = out["eager_tracked_s"] / out["eager_plain_s"]
    out["compiled_ratio"] = out["compiled_tracked_s"] / out["compiled_plain_s"]
    out["compiled_tracked_vs_eager_tracked"] = out["compiled_tracked_s"] / out["eager_tracked_s"]
    out["loadavg"] = os.getloadavg()
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small model, 2 repeats")
    p.add_argument("--json", default=None, help="also write the figures as JSON to this file")
    p.add_argument("--cpp-op", action="store_true",
                   help="also the C++ TORCH_LIBRARY op prototype (builds compile_record_op.cpp first)")
    args = p.parse_args(argv)
    if args.quick:
        res = [run(width=128, depth=4, batch=16, forwards=50, repeats=2, cpp_op=args.cpp_op)]
    else:
        res = [run(width=256, depth=8, batch=32, forwards=200, repeats=5, cpp_op=args.cpp_op),
               run(width=1024, depth=8, batch=64, forwards=50, repeats=5, cpp_op=args.cpp_op)]
    for r in res:
        print(f"width {r['width']}, {r['depth']} blocks, batch {r['batch']}, {r['tracked_modules']} tracked modules:")
        for mode in ("eager_plain", "eager_tracked", "compiled_plain", "compiled_tracked", "compiled_custom_op"):
            print(f"  {mode:17s} {r[mode + '_s'] * 1e6:10.1f} us/forward")
        print(f"  tracked / plain: eager {r['eager_ratio']:.2f}x, compiled {r['compiled_ratio']:.2f}x; "
              f"compiled graphs {r['compiled_plain_graphs']} plain, {r['compiled_tracked_graphs']} tracked; "
              f"records exact: {r['records_exact']}; load average {r['loadavg'][0]:.1f}")
        print(f"  custom-op prototype: {r['custom_op_ratio']:.2f}x compiled plain; explain: "
              f"{r['custom_op_explain_graphs']} graph, {r['custom_op_explain_breaks']} breaks "
              f"(tracked: {r['compiled_tracked_explain_graphs']} graphs); "
              f"{r['custom_op_graphs_over_4_batch_sizes']} graphs over 4 batch sizes; "
              f"records exact vs forward hooks: {r['custom_op_records_exact']}")
        if "cpp_op_ratio" in r:
            print(f"  C++ op prototype: {r['compiled_cpp_op_s'] * 1e6:.1f} us/forward, {r['cpp_op_ratio']:.2f}x "
                  f"compiled plain; explain: {r['cpp_op_explain_graphs']} graph, {r['cpp_op_explain_breaks']} "
                  f"breaks; records exact vs forward hooks: {r['cpp_op_records_exact']}")
    doc = {"runs": res}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=2)
    return doc


if __name__ == "__main__":
    main()
