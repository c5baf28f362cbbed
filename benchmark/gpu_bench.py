"""Short GPU benchmark (CUDA only): ``python -m benchmark.gpu_bench [--json PATH]``.

On one CUDA device, with ``torch.no_grad()``, eval models, medians of ``--repeats`` timed
repeats after a warm one, ``torch.cuda.synchronize()`` before every clock read:

* ``plain``: the forward alone;
* ``snapshot``: ``ActivationScope(capture=..., capture_mode=SNAPSHOT)`` with the default
  storage (AUTO: pinned host buffers, asynchronous device-to-host copies);
* ``gpu_storage``: ``storage=StoragePolicy.GPU`` (copies stay on the device);
* ``store``: streamed into an uncompressed store on local disk;
* ``copy_only``: the same bytes copied device-to-host into pinned memory with
  ``non_blocking=True`` on a side stream, no forward: the copy engine's time alone (a hook
  point that is another's tensor, an input that is the previous module's output, shares that
  record and is counted once, as the capture copies it once).

``overlap`` = (plain + copy_only - snapshot) / min(plain, copy_only): 1 when the copies hide
entirely behind compute (or the reverse), 0 when they run one after the other.

Before timing, the values captured on the GPU are checked against plain PyTorch hooks that
clone and move every tensor to the host (``torch.equal``): a mismatch is an error.

Workloads: the seed's toy model (48 x ``Linear(256, 256)``, batch 32, and batch 4096: about
200 MB copied per forward, copy-bound), and a transformer (``torch.nn.TransformerEncoder``, 8
layers, d_model 512, 8 heads, batch 16 x 256 tokens; every layer's output).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from typing import Any

import torch

from ._util import write_json


def _timed(fn: Any, repeats: int, dev: torch.device) -> float:
    out = []
    for _ in range(repeats + 1):
        _sync(dev)
        t0 = time.perf_counter()
        fn()
        _sync(dev)
        out.append(time.perf_counter() - t0)
    return statistics.median(out[1:])


def toy(batch: int, dev: torch.device) -> tuple[torch.nn.Module, torch.Tensor, str, list[str] | None]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(48)]).to(dev).eval()
    return model, torch.randn(batch, 256, device=dev), "both", None


def encoder(dev: torch.device, batch: int = 16) -> tuple[torch.nn.Module, torch.Tensor, str, list[str] | None]:
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(512, 8, 2048, batch_first=True, dropout=0.0)
    model = torch.nn.TransformerEncoder(layer, 8, enable_nested_tensor=False).to(dev).eval()
    return model, torch.randn(batch, 256, 512, device=dev), "output", [f"layers.{i}" for i in range(8)]


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def reference(model: torch.nn.Module, x: torch.Tensor, capture: str, include: list[str] | None) -> dict[str, torch.Tensor]:
    """Plain PyTorch hooks: ``{hook point: host copy}`` of every captured tensor of one
    forward, named as ActivationScope names them (``<module>.input.<k>``, ``<module>.output``)."""
    from activationscope.capture.hooks import select_modules

    out: dict[str, torch.Tensor] = {}
    handles = []
    for name, mod in select_modules(model, include, None):
        def hook(m, args, output, _n=name):
            if capture in ("input", "both"):
                for k, a in enumerate(t for t in args if isinstance(t, torch.Tensor)):
                    out[f"{_n}.input.{k}"] = a.detach().cpu().clone()
            if capture in ("output", "both"):
                o = output if isinstance(output, torch.Tensor) else output[0]
                out[f"{_n}.output"] = o.detach().cpu().clone()
        handles.append(mod.register_forward_hook(hook))
    try:
        model(x)
    finally:
        for h in handles:
            h.remove()
    return out


def check_values(model: torch.nn.Module, x: torch.Tensor, capture: str, include: list[str] | None) -> int:
    """Capture one forward with SNAPSHOT and compare every hook point with :func:`reference`
    (``torch.equal`` on the host); returns the number of tensors compared.

    Raises
    ------
    AssertionError
        A hook point is missing on either side, or its values differ.
    """
    import activationscope as acs

    want = reference(model, x, capture, include)
    scope = acs.ActivationScope(capture=capture, capture_mode=acs.CaptureMode.SNAPSHOT)
    with scope.track(model, include=include) as tr:
        model(x)
    _sync(x.device)
    got = {hp: ts[0] for hp, ts in tr.activations.items()}
    assert set(got) == set(want), f"hook points differ: {sorted(set(got) ^ set(want))[:6]}"
    for hp, t in want.items():
        g = got[hp].cpu()
        assert g.shape == t.shape and torch.equal(g, t), f"captured values of {hp!r} differ from plain PyTorch hooks"
    assert want, "nothing was captured"
    return len(want)


def bench(name: str, model: torch.nn.Module, x: torch.Tensor, capture: str, include: list[str] | None,
          forwards: int, repeats: int, workdir: str) -> dict[str, Any]:
    import activationscope as acs

    rec: dict[str, Any] = {"workload": name, "batch_shape": list(x.shape), "forwards": forwards}
    rec["tensors_checked"] = check_values(model, x, capture, include)

    def run_plain() -> None:
        for _ in range(forwards):
            model(x)

    def run_scope(**kw: Any) -> Any:
        def go() -> None:
            scope = acs.ActivationScope(capture=capture, **kw)
            with scope.track(model, include=include):
                for _ in range(forwards):
                    model(x)
        return go

    store_path = os.path.join(workdir, f"{name}.zarr")

    def run_store() -> None:
        shutil.rmtree(store_path, ignore_errors=True)
        run_scope(store=store_path)()

    # the bytes one forward copies, for copy_only: a hook point that is another's tensor (an
    # input that is the previous module's output) shares that record and is copied once
    dev = x.device
    with acs.ActivationScope(capture=capture).track(model, include=include) as tr:
        model(x)
    _sync(dev)
    copied = {(t.data_ptr(), t.nbytes): t.nbytes for ts in tr.activations.values() for t in ts}
    sizes = list(copied.values())
    cuda = dev.type == "cuda"
    src = [torch.empty(n, dtype=torch.uint8, device=dev) for n in sizes]
    dst = [torch.empty(n, dtype=torch.uint8, pin_memory=cuda) for n in sizes]
    side = torch.cuda.Stream() if cuda else None

    def run_copy() -> None:
        if side is None:  # CPU dry run
            for _ in range(forwards):
                for s, d in zip(src, dst):
                    d.copy_(s)
            return
        with torch.cuda.stream(side):
            for _ in range(forwards):
                for s, d in zip(src, dst):
                    d.copy_(s, non_blocking=True)
        side.synchronize()

    t = {
        "plain": _timed(run_plain, repeats, dev),
        "snapshot": _timed(run_scope(capture_mode=acs.CaptureMode.SNAPSHOT), repeats, dev),
        "gpu_storage": _timed(run_scope(storage=acs.StoragePolicy.GPU), repeats, dev),
        "store": _timed(run_store, repeats, dev),
        "copy_only": _timed(run_copy, repeats, dev),
    }
    t["plain_end"] = _timed(run_plain, repeats, dev)
    rec["seconds"] = t
    rec["captured_bytes_per_forward"] = sum(sizes)
    rec["ms_per_forward"] = {k: v / forwards * 1e3 for k, v in t.items()}
    rec["ratio_vs_plain"] = {k: v / t["plain"] for k, v in t.items()}
    rec["overlap"] = (t["plain"] + t["copy_only"] - t["snapshot"]) / min(t["plain"], t["copy_only"])
    rec["d2h_bytes_per_s"] = sum(sizes) * forwards / t["copy_only"]
    return rec


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmark.gpu_bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write the figures to PATH")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--forwards", type=int, default=50)
    ap.add_argument("--device", default="cuda", help="cuda (default); cpu only checks the script itself (no GPU figure)")
    a = ap.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("benchmark.gpu_bench needs a CUDA device (torch.cuda.is_available() is False)")
    grad_was = torch.is_grad_enabled()
    torch.set_grad_enabled(False)
    dev = torch.device(a.device)
    work = tempfile.mkdtemp(prefix="acs-gpu-bench-")
    doc: dict[str, Any] = {
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "device": torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu (dry run, not a GPU figure)",
        "torch": torch.__version__, "cuda": torch.version.cuda,
        "platform": platform.platform(), "repeats": a.repeats, "results": [],
    }
    failures: dict[str, str] = {}
    doc["failures"] = failures
    doc["complete"] = False
    try:
        big = 4096 if dev.type == "cuda" else 256  # the CPU dry run only checks the script
        for name, build, fw in (("toy_b32", lambda: toy(32, dev), a.forwards),
                                (f"toy_b{big}", lambda: toy(big, dev), max(3, a.forwards // 10)),
                                ("encoder", lambda: encoder(dev, 16 if dev.type == "cuda" else 1),
                                 max(5, a.forwards // 5))):
            t0 = time.perf_counter()
            try:
                model, x, capture, include = build()
                rec = bench(name, model, x, capture, include, fw, a.repeats, work)
            except Exception as e:  # the other workloads still run: one short run on a lent machine
                failures[name] = f"{type(e).__name__}: {e}"
                print(f"{name:>10}: FAILED {failures[name]}", flush=True)
                continue
            finally:
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
            rec["wall_s"] = time.perf_counter() - t0
            doc["results"].append(rec)
            r = rec["ratio_vs_plain"]
            print(f"{name:>10}: plain {rec['ms_per_forward']['plain']:.3f} ms/fwd; x plain: snapshot {r['snapshot']:.2f}, "
                  f"gpu storage {r['gpu_storage']:.2f}, store {r['store']:.2f}, copy only {r['copy_only']:.2f}; "
                  f"overlap {rec['overlap']:.2f}; D2H {rec['d2h_bytes_per_s'] / 1e9:.1f} GB/s; "
                  f"{rec['tensors_checked']} tensors checked; {rec['wall_s']:.1f} s", flush=True)
            if a.json:  # after each workload: a run stopped at its time limit keeps what it measured
                with open(a.json, "w") as f:
                    json.dump(doc, f, indent=1)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        torch.set_grad_enabled(grad_was)  # (main() is also called in-process, by the tests)
    doc["complete"] = True
    write_json(a.json, doc)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
