"""``python -m benchmark.runner``: ActivationScope side by side with naive hooks, hand-written
alternatives, peers and the hardware limits, on the same machine in the same run.

Each (workload, mode) runs in its own subprocess (``benchmark.child``) with the same torch
thread count: setup, one cold repeat (also the warm-up), then timed repeats; the figures are
medians of the timed repeats, ratios against the plain forward of the same workload. See
``benchmark/README.md`` for the modes, every JSON key and how to read the goals.
"""

from __future__ import annotations

import argparse
import fnmatch
import importlib.util
import inspect
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

from activationscope.sizes import format_bytes as fmt_bytes

from . import goals as goals_mod
from . import readback

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCHEMA_VERSION = 1

TOY_MODES = [
    "plain", "naive_clone", "scope_snapshot", "scope_reference", "scope_reductions",
    "scope_store", "scope_store_zstd", "torch_save", "np_save", "zarr_append",
    "nnsight", "torchlens", "memcpy", "raw_write", "raw_write_fsync", "plain_end",
]
MODEL_MODES = ["plain", "naive_clone", "scope_snapshot", "scope_reference", "scope_reductions",
               "scope_store", "scope_store_zstd", "plain_end"]
STORE_MODES = {"scope_store", "scope_store_zstd"}

PROFILES: dict[str, dict[str, Any]] = {
    "full": {
        "toy": {"n_forwards": 200, "batch": 32},
        "resnet18": {"n_forwards": 10, "batch": 8},
        "minilm": {"n_passes": 1, "batch": 32},
        "readback": {"layer_bytes": 1 << 30, "dl_rows": 1 << 18, "batch_size": 256, "latency_rows": 2000},
        "repeats": 5, "budget_s": 25.0, "slow_budget_s": 5.0, "open_repeats": 20, "child_timeout_s": 300,
        "build_timeout_s": 120, "repeats_by_workload": {"minilm": 3, "resnet18": 3, "readback": 3},
        "readback_workers": (0, 2),
    },
    "quick": {
        "toy": {"n_forwards": 20, "batch": 32},
        "resnet18": {"n_forwards": 2, "batch": 2},
        "minilm": {"n_passes": 1, "batch": 32, "max_sentences": 32},
        "readback": {"layer_bytes": 64 << 20, "dl_rows": 1 << 14, "batch_size": 256, "latency_rows": 200},
        "repeats": 2, "budget_s": 3.0, "slow_budget_s": 1.0, "open_repeats": 5, "child_timeout_s": 60,
        "build_timeout_s": 30,
        "readback_workers": (0, 2),
        # fewer children to stay under 2 minutes (each costs ~2 s of imports)
        "modes": {
            "resnet18": ["plain", "scope_snapshot", "scope_store"],
            "minilm": ["plain", "naive_clone", "scope_snapshot", "scope_store"],
            "readback": ["build_raw", "build_zstd", "open_layer", "row_latency:acs", "row_latency:acs_zstd",
                         "dl:tensor:*:w0", "dl:acs:*:w0", "dl:acs_zstd:sequential:w0",
                         "dl:tensor:sequential:w2", "dl:acs:sequential:w2"],
        },
    },
}
SLOW_MODES = {"zarr_append", "torchlens", "nnsight"}  # few timed repeats: one is enough to compare


def store_available() -> tuple[bool, str]:
    try:
        from activationscope.store import StoreWriter  # noqa: F401
    except Exception as e:
        return False, f"activationscope.store is not importable yet ({type(e).__name__}: {e})"
    return True, ""


def detect_durability(requested: str) -> tuple[str, str]:
    """Which raw-write floor matches the store: ``fsync`` or ``buffered`` (and why)."""
    if requested != "auto":
        return requested, "--durability given"
    try:
        from activationscope.store import StoreWriter
    except Exception:
        return "buffered", "store not importable; buffered writes assumed"
    params = inspect.signature(StoreWriter).parameters
    for key in ("fsync", "durable", "sync", "durability"):
        if key in params:
            default = params[key].default
            if default in (True, "fsync", "full", "always"):
                return "fsync", f"StoreWriter({key}={default!r}) by default"
            return "buffered", f"StoreWriter({key}={default!r}) by default"
    return "buffered", "StoreWriter has no fsync / durability option: buffered writes assumed"


def _torchvision_imports() -> bool:
    from . import workloads

    return workloads._torchvision_resnet18() is not None


def workload_available(name: str) -> tuple[bool, str]:
    if name == "minilm":
        from . import workloads
        from ._util import Skip

        try:
            workloads.minilm_paths()
        except Skip as e:
            return False, str(e)
    return True, ""


def _in_profile(prof: dict[str, Any], workload: str, mode: str) -> bool:
    pats = prof.get("modes", {}).get(workload)
    return pats is None or any(fnmatch.fnmatchcase(mode, p) for p in pats)


def _repeats(prof: dict[str, Any], workload: str) -> int:
    if prof.get("repeats_override") is not None:
        return prof["repeats_override"]
    return prof.get("repeats_by_workload", {}).get(workload, prof["repeats"])


def plan(args: argparse.Namespace, prof: dict[str, Any]) -> list[dict[str, Any]]:
    specs = []
    for wl in args.workloads:
        if wl == "readback":
            params = dict(prof["readback"])
            for mode in readback.modes(tuple(prof["readback_workers"])):
                if not _in_profile(prof, wl, mode):
                    continue
                reps = 0 if mode.startswith("build") else (prof["open_repeats"] if mode == "open_layer" else _repeats(prof, wl))
                specs.append({"workload": wl, "mode": mode, "params": params, "repeats": reps,
                              "budget_s": prof["budget_s"]})
            continue
        params = dict(prof[wl])
        if wl == "toy" and args.forwards:
            params["n_forwards"] = args.forwards
        modes = TOY_MODES if wl == "toy" else MODEL_MODES
        for mode in modes:
            if not _in_profile(prof, wl, mode):
                continue
            slow = mode in SLOW_MODES
            specs.append({"workload": wl, "mode": mode, "params": params,
                          "repeats": 1 if slow else _repeats(prof, wl),
                          "budget_s": prof["slow_budget_s"] if slow else prof["budget_s"]})
    if args.only:
        specs = [s for s in specs if any(fnmatch.fnmatchcase(f"{s['workload']}/{s['mode']}", p) for p in args.only)]
    return specs


def readback_prerequisite(done: dict[str, Any], mode: str) -> str | None:
    """Why a read-back mode cannot run (its store's build failed), or None."""
    if mode.startswith("build"):
        return None
    needs = ["build_raw"] + (["build_zstd"] if "zstd" in mode else [])
    for b in needs:
        rec = done.get(b)
        if rec is not None and rec.get("status") != "ok":
            return f"needs the {b} store, whose build was {rec.get('status')}: {rec.get('note', '')[:200]}"
    return None


def run_child(spec: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="acs-bench-spec-") as tmp:
        spec_path, out_path = os.path.join(tmp, "spec.json"), os.path.join(tmp, "out.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        env = dict(os.environ)
        n = str(spec["threads"])
        env.update(OMP_NUM_THREADS=n, MKL_NUM_THREADS=n, PYTHONPATH=REPO + os.pathsep + env.get("PYTHONPATH", ""),
                   TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                   PYTHONWARNINGS="ignore")
        t0 = time.perf_counter()
        try:
            proc = subprocess.run([sys.executable, "-m", "benchmark.child", spec_path, out_path], cwd=REPO, env=env,
                                  capture_output=True, text=True, timeout=timeout_s)
            tail = (proc.stderr or "")[-2000:]
            rc = proc.returncode
        except subprocess.TimeoutExpired as e:
            tail, rc = f"timed out after {timeout_s:.0f} s; {(e.stderr or b'')[-500:]!r}", None
        if os.path.exists(out_path):
            with open(out_path) as f:
                return json.load(f)
        return {"workload": spec["workload"], "mode": spec["mode"], "status": "error",
                "note": f"child exited with {rc} without a record: {tail.strip()[-600:]}",
                "child_wall_s": time.perf_counter() - t0}


def derive(results: dict[str, dict[str, Any]]) -> None:
    """Per-forward times, ratios against plain / naive, bandwidths and read-back rows/s (in place)."""
    for wl, recs in results.items():
        if wl == "readback":
            ram = {}
            for mode, r in recs.items():
                if r.get("status") != "ok":
                    continue
                if mode.startswith("dl:") or mode == "hf_datasets":
                    rows = (r.get("extra") or {}).get("rows_per_epoch")
                    if rows:
                        r["rows_per_s"] = rows / r["median_s"]
                        r["cold_rows_per_s"] = rows / r["cold_s"]
                if mode.startswith("dl:tensor:"):
                    ram[mode.split(":", 2)[2]] = r.get("rows_per_s")
                if mode.startswith("build"):
                    r["write_bytes_per_s"] = r["captured_bytes"] / r["median_s"]
            for mode, r in recs.items():
                if mode.startswith("dl:") and r.get("rows_per_s") and ram.get(mode.split(":", 2)[2]):
                    r["ratio_vs_tensor"] = r["rows_per_s"] / ram[mode.split(":", 2)[2]]
            continue
        plain = recs.get("plain", {})
        naive = recs.get("naive_clone", {})
        for mode, r in recs.items():
            if r.get("status") != "ok":
                continue
            n = r.get("n_forwards") or 1
            r["ms_per_forward"] = r["median_s"] / n * 1e3
            r["cold_ms_per_forward"] = r["cold_s"] / n * 1e3
            if plain.get("status") == "ok":
                r["ratio_vs_plain"] = r["median_s"] / plain["median_s"]
                r["cold_ratio_vs_plain"] = r["cold_s"] / plain["cold_s"]
            if naive.get("status") == "ok":
                r["ratio_vs_naive"] = r["median_s"] / naive["median_s"]
            if r.get("captured_bytes"):
                r["captured_bytes_per_s"] = r["captured_bytes"] / r["median_s"]


def limits(results: dict[str, dict[str, Any]], durability: str) -> dict[str, Any]:
    toy = results.get("toy", {})
    ok = lambda k: toy.get(k, {}).get("status") == "ok"  # noqa: E731
    out: dict[str, Any] = {"durability": durability}
    if ok("memcpy"):
        out["memcpy_s"] = toy["memcpy"]["median_s"]
        out["memcpy_bytes_per_s"] = toy["memcpy"]["captured_bytes"] / toy["memcpy"]["median_s"]
        if ok("plain"):
            out["copy_floor_s"] = toy["plain"]["median_s"] + toy["memcpy"]["median_s"]
            out["copy_floor_ratio_vs_plain"] = out["copy_floor_s"] / toy["plain"]["median_s"]
    for key in ("raw_write", "raw_write_fsync"):
        if ok(key):
            out[f"{key}_s"] = toy[key]["median_s"]
            out[f"{key}_bytes_per_s"] = toy[key]["captured_bytes"] / toy[key]["median_s"]
    raw = out.get("raw_write_fsync_s" if durability == "fsync" else "raw_write_s")
    if raw is not None and ok("plain"):
        out["disk_floor_s"] = max(toy["plain"]["median_s"], raw)
        out["disk_floor_ratio_vs_plain"] = out["disk_floor_s"] / toy["plain"]["median_s"]
    if ok("plain") and ok("plain_end"):
        out["plain_drift"] = toy["plain_end"]["median_s"] / toy["plain"]["median_s"]
    return out


def seed_comparison(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    toy = results.get("toy", {})
    naive, snap = toy.get("naive_clone", {}), toy.get("scope_snapshot", {})
    ours: dict[str, Any] = {}
    if naive.get("status") == "ok":
        ours["naive_ms_per_forward"] = naive["ms_per_forward"]
    if snap.get("status") == "ok":
        ours["scope_ms_per_forward"] = snap["ms_per_forward"]
    if len(ours) == 2:
        ours["speedup_vs_naive"] = ours["naive_ms_per_forward"] / ours["scope_ms_per_forward"]
    return {"seed": dict(goals_mod.SEED), "ours": ours}


# ---------------------------------------------------------------------------- printing
def _f(x: Any, fmt: str = "{:.3f}") -> str:
    return "-" if x is None else fmt.format(x)


def print_summary(doc: dict[str, Any], out: Any = None) -> None:
    out = sys.stdout if out is None else out
    p = lambda *a: print(*a, file=out)  # noqa: E731
    mch = doc["machine"]
    p(f"machine: {mch['cpu_model']}, {mch['n_cpus']} CPUs ({mch['n_cpus_usable']} usable), "
      f"{fmt_bytes(mch['memory_bytes'])} RAM, load {_f((mch['loadavg'] or [None])[0], '{:.2f}')}")
    p(f"torch {mch['torch']} (CPU), torch.set_num_threads({doc['settings']['threads']}) and 1 interop thread in "
      f"every mode; python {mch['python']}; profile {doc['settings']['profile']}; torch.no_grad(); "
      f"durability of disk modes: {doc['limits']['durability']} ({doc['settings']['durability_reason']})")
    for wl, recs in doc["results"].items():
        if wl == "readback":
            continue
        p("")
        p(f"== {wl}: {doc['workloads'].get(wl, {}).get('description', '')}")
        wd = doc["workloads"].get(wl, {})
        if not wd.get("captured_bytes_consistent", True):
            p("   WARNING: modes captured different bytes: "
              + ", ".join(f"{m} {fmt_bytes(b)}" for m, b in wd["captured_bytes_by_mode"].items()))
        p(f"{'mode':<18}{'ms/fwd':>9}{'cold':>9}{'x plain':>9}{'cold x':>8}{'x naive':>9}"
          f"{'RSS grow':>11}{'captured':>11}{'on disk':>11}  note")
        for mode, r in recs.items():
            if r.get("status") != "ok":
                p(f"{mode:<18}{r.get('status', '?').upper():>9}  {r.get('note', '')}")
                continue
            p(f"{mode:<18}{_f(r.get('ms_per_forward'), '{:.2f}'):>9}{_f(r.get('cold_ms_per_forward'), '{:.2f}'):>9}"
              f"{_f(r.get('ratio_vs_plain'), '{:.2f}x'):>9}{_f(r.get('cold_ratio_vs_plain'), '{:.2f}x'):>8}"
              f"{_f(r.get('ratio_vs_naive'), '{:.2f}x'):>9}{fmt_bytes(r.get('peak_rss_growth_bytes')):>11}"
              f"{fmt_bytes(r.get('captured_bytes')):>11}{fmt_bytes(r.get('stored_bytes')):>11}"
              f"  n={r.get('n_repeats')} {r.get('note', '')}")
    lim = doc["limits"]
    if len(lim) > 1:
        p("")
        p("limits (toy, same run): "
          + f"memcpy {_f(lim.get('memcpy_bytes_per_s'), '{:.2e}')} B/s -> copy floor {_f(lim.get('copy_floor_ratio_vs_plain'), '{:.2f}x')} plain; "
          + f"raw write {_f(lim.get('raw_write_bytes_per_s'), '{:.2e}')} B/s, with fsync {_f(lim.get('raw_write_fsync_bytes_per_s'), '{:.2e}')} B/s "
          + f"-> disk floor {_f(lim.get('disk_floor_ratio_vs_plain'), '{:.2f}x')} plain; plain drift over the run {_f(lim.get('plain_drift'), '{:.2f}x')}")
    rb = doc["results"].get("readback")
    if rb:
        p("")
        p(f"== readback: {doc['workloads'].get('readback', {}).get('description', '')}")
        for mode, r in rb.items():
            if r.get("status") != "ok":
                p(f"{mode:<28}{r.get('status', '?').upper():>9}  {r.get('note', '')}")
                continue
            ex = r.get("extra") or {}
            if mode.startswith("dl:") or mode == "hf_datasets":
                p(f"{mode:<28}{_f(r.get('rows_per_s'), '{:,.0f}'):>12} rows/s  cold {_f(r.get('cold_rows_per_s'), '{:,.0f}'):>10}"
                  f"  x tensor {_f(r.get('ratio_vs_tensor'), '{:.2f}'):>5}  RSS grow {fmt_bytes(r.get('peak_rss_growth_bytes'))}")
            elif mode.startswith("row_latency"):
                p(f"{mode:<28} median {_f(ex.get('median_us'), '{:.1f}')} us  p99 {_f(ex.get('p99_us'), '{:.1f}')} us"
                  f"  cold median {_f(ex.get('cold_median_us'), '{:.1f}')} us  first {_f(ex.get('first_read_us'), '{:.1f}')} us")
            elif mode == "open_layer":
                p(f"{mode:<28} {r['median_s'] * 1e3:.3f} ms (cold {r['cold_s'] * 1e3:.3f} ms), RSS growth "
                  f"{fmt_bytes(ex.get('rss_growth_bytes'))} of {fmt_bytes(ex.get('layer_bytes'))}")
            else:
                p(f"{mode:<28} {r['median_s']:.2f} s, {fmt_bytes(r.get('captured_bytes'))} -> {fmt_bytes(r.get('stored_bytes'))}"
                  f" on disk, {_f(r.get('write_bytes_per_s'), '{:.2e}')} B/s")
    sc = doc["seed_comparison"]
    p("")
    p(f"seed (its machine): naive {sc['seed']['naive_ms_per_forward']} ms/fwd -> scope {sc['seed']['scope_ms_per_forward']} "
      f"ms/fwd, {sc['seed']['speedup_vs_naive']}x faster than naive")
    o = sc["ours"]
    p(f"ours (this run):    naive {_f(o.get('naive_ms_per_forward'), '{:.2f}')} ms/fwd -> scope SNAPSHOT "
      f"{_f(o.get('scope_ms_per_forward'), '{:.2f}')} ms/fwd, {_f(o.get('speedup_vs_naive'), '{:.2f}')}x faster than naive")
    p("")
    p("goals:")
    for g in doc["goals"]:
        fig = _f(g["measured"], "{:.3f}") + (g["unit"] if g["measured"] is not None else "")
        p(f"  [{g['status']}] {g['goal']}: measured {fig} (goal {g['op']} {g['threshold']}{g['unit']}) {g['note']}")
    c = {s: sum(1 for g in doc["goals"] if g["status"] == s) for s in ("PASS", "FAIL", "SKIP")}
    p(f"  {c['PASS']} pass, {c['FAIL']} fail, {c['SKIP']} not measured; total wall {doc['wall_s']:.0f} s")


# ---------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmark.runner", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small workloads and 2 repeats (under 2 minutes)")
    ap.add_argument("--json", metavar="PATH", help="write every figure to PATH (see benchmark/README.md)")
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads in every mode (default 1)")
    ap.add_argument("--workloads", default="toy,resnet18,minilm,readback",
                    help="comma-separated subset of toy,resnet18,minilm,readback")
    ap.add_argument("--only", action="append", metavar="GLOB",
                    help="run only workload/mode matching GLOB (repeatable), e.g. 'toy/scope_*'")
    ap.add_argument("--forwards", type=int, help="forwards per repeat of the toy workload (default 200; quick 20)")
    ap.add_argument("--layer-mib", type=int, help="size of the read-back layer in MiB (default 1024; quick 64)")
    ap.add_argument("--repeats", type=int, help="timed repeats per mode after the cold one (default 5; quick 2)")
    ap.add_argument("--durability", choices=("auto", "buffered", "fsync"), default="auto",
                    help="durability of the raw-write floor and the hand-written disk modes (auto: the store's)")
    ap.add_argument("--workdir", help="parent folder of the scratch stores (default: the system temp folder)")
    ap.add_argument("--keep", action="store_true", help="keep the scratch folder")
    args = ap.parse_args(argv)
    args.workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    for w in args.workloads:
        if w not in ("toy", "resnet18", "minilm", "readback"):
            ap.error(f"--workloads must name toy, resnet18, minilm or readback, got {w!r}")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    t_run = time.perf_counter()
    import torch  # noqa: F401  (machine description)

    from . import machine

    profile = "quick" if args.quick else "full"
    prof = json.loads(json.dumps(PROFILES[profile]))
    if args.repeats is not None:
        prof["repeats"] = prof["repeats_override"] = args.repeats
    if args.layer_mib is not None:
        prof["readback"]["layer_bytes"] = args.layer_mib << 20
        prof["readback"]["dl_rows"] = min(prof["readback"]["dl_rows"], (args.layer_mib << 20) // 1024)
    durability, why = detect_durability(args.durability)
    has_store, store_note = store_available()
    work = tempfile.mkdtemp(prefix="acs-bench-", dir=args.workdir)
    ctx = {"workdir": work, "readback_dir": os.path.join(work, "readback"), "durability": durability}
    os.makedirs(ctx["readback_dir"])
    doc: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "machine": machine.describe(args.threads),
        "settings": {"profile": profile, "threads": args.threads, "durability": durability, "durability_reason": why,
                     "repeats": prof["repeats"], "workdir": work, "argv": list(argv if argv is not None else sys.argv[1:])},
        "workloads": {},
        "results": {},
    }
    print(f"ActivationScope benchmark ({profile}); scratch {work}; torch threads {args.threads}", flush=True)
    specs = plan(args, prof)
    available = {w: workload_available(w) for w in args.workloads}
    try:
        for spec in specs:
            wl, mode = spec["workload"], spec["mode"]
            spec.update(threads=args.threads, ctx=ctx)
            ok, why_not = available.get(wl, (True, ""))
            needs_store = mode in STORE_MODES or wl == "readback"
            built = readback_prerequisite(doc["results"].get("readback", {}), mode) if wl == "readback" else None
            if not ok:
                rec = {"workload": wl, "mode": mode, "status": "skipped", "note": why_not}
            elif needs_store and not has_store:
                rec = {"workload": wl, "mode": mode, "status": "skipped", "note": store_note}
            elif built:
                rec = {"workload": wl, "mode": mode, "status": "skipped", "note": built}
            else:
                print(f"  {wl}/{mode} ...", end="", flush=True)
                rec = run_child(spec, prof["build_timeout_s"] if mode.startswith("build") else prof["child_timeout_s"])
                print(f" {rec['status']} ({rec.get('child_wall_s', 0):.1f} s) {rec.get('note', '')[:160]}", flush=True)
            doc["results"].setdefault(wl, {})[mode] = rec
            doc["workloads"].setdefault(wl, {"params": spec["params"]})
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    describe_workloads(doc, prof)
    derive(doc["results"])
    check_bytes(doc)
    doc["limits"] = limits(doc["results"], durability)
    doc["seed_comparison"] = seed_comparison(doc["results"])
    doc["goals"] = goals_mod.evaluate(doc["results"], durability)
    doc["wall_s"] = time.perf_counter() - t_run
    print("")
    print_summary(doc)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1, default=str)
        print(f"\nwrote {args.json}")
    return doc


def check_bytes(doc: dict[str, Any]) -> None:
    """Flag workloads whose modes did not capture the same number of bytes."""
    for wl, recs in doc["results"].items():
        if wl == "readback":
            continue
        seen = {m: r["captured_bytes"] for m, r in recs.items()
                if r.get("status") == "ok" and r.get("captured_bytes") and m != "scope_reductions"}
        d = doc["workloads"].setdefault(wl, {})
        d["captured_bytes_consistent"] = len(set(seen.values())) <= 1
        d["captured_bytes_by_mode"] = seen


def describe_workloads(doc: dict[str, Any], prof: dict[str, Any]) -> None:
    for wl, d in doc["workloads"].items():
        p = d["params"]
        if wl == "toy":
            d["description"] = (f"nn.Sequential of 48 x Linear(256,256), batch {p['batch']}, {p['n_forwards']} forwards, "
                                "capture='both' (every input and output)")
        elif wl == "resnet18":
            src = "torchvision" if _torchvision_imports() else "plain-PyTorch definition (torchvision not importable)"
            d["description"] = (f"ResNet-18 ({src}), random init, batch {p['batch']}, {p['n_forwards']} forwards, "
                                "every module's output")
        elif wl == "minilm":
            d["description"] = (f"all-MiniLM-L6-v2, Pang & Lee sentences, batch {p['batch']}, {p['n_passes']} pass(es), "
                                "token rows of every encoder layer's output")
        elif wl == "readback":
            d["description"] = (f"one layer of {fmt_bytes(p['layer_bytes'])} (rows of 256 float32), epochs of "
                                 f"{p['dl_rows']} rows, batch {p['batch_size']}")
        for r in doc["results"].get(wl, {}).values():
            if r.get("rows_per_repeat") and "rows_per_repeat" not in d:
                d["rows_per_repeat"] = r["rows_per_repeat"]


if __name__ == "__main__":
    main()
