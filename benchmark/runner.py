"""``python -m benchmark.runner``: ActivationScope side by side with naive hooks, hand-written
alternatives, peers and the hardware limits, on the same machine in the same run.

Each (workload, mode) runs in its own process (``benchmark.child``) with the same torch
thread count, forked from a server that imported torch once (``multiprocessing``'s
``forkserver``: about 2 s of import per child saved; ``--no-forkserver`` starts each child
from scratch): setup, one cold repeat (also the warm-up), then timed repeats; the figures are
medians of the timed repeats, ratios against the plain forward of the same workload. See
``benchmark/README.md`` for the modes, every JSON key and how to read the goals.
"""

from __future__ import annotations

import argparse
import fnmatch
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
from . import registry
from .interleaved import side_by_side_text

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCHEMA_VERSION = 2

#: How each profile runs (workload parameters live with each workload's registration).
PROFILES: dict[str, dict[str, Any]] = {
    "full": {"repeats": 5, "budget_s": 25.0, "slow_budget_s": 5.0, "child_timeout_s": 300, "build_timeout_s": 240},
    "quick": {"repeats": 2, "budget_s": 3.0, "slow_budget_s": 1.0, "child_timeout_s": 60, "build_timeout_s": 45},
}
#: --quick must finish within this many seconds (a goal of the quick run).
QUICK_WALL_S = 120.0


def detect_durability(requested: str) -> tuple[str, str]:
    """Which raw-write floor matches the store: ``fsync`` or ``buffered`` (and why)."""
    if requested != "auto":
        return requested, "--durability given"
    from activationscope.store import StoreWriter

    params = inspect.signature(StoreWriter).parameters
    for key in ("fsync", "durable", "sync", "durability"):
        if key in params:
            default = params[key].default
            if default in (True, "fsync", "full", "always"):
                return "fsync", f"StoreWriter({key}={default!r}) by default"
            return "buffered", f"StoreWriter({key}={default!r}) by default"
    return "buffered", "StoreWriter has no fsync / durability option: buffered writes assumed"


def plan(args: argparse.Namespace, profile: str) -> list[dict[str, Any]]:
    """One spec per (workload, mode) to run, in run order."""
    prof = PROFILES[profile]
    specs = []
    for wl in args.workloads:
        wspec = registry.WORKLOADS[wl]
        if profile == "quick" and not wspec.quick and not args.only:
            continue
        params = dict(wspec.params[profile])
        if wl == "toy" and args.forwards:
            params["n_forwards"] = args.forwards
        if wl == "readback" and args.layer_mib is not None:
            params["layer_bytes"] = args.layer_mib << 20
            params["dl_rows"] = min(params["dl_rows"], (args.layer_mib << 20) // 1024)
        for m in registry.modes_for(wl):
            if profile == "quick" and not m.in_quick(wl) and not args.only:
                continue
            if m.repeats is not None:
                reps = m.repeats if profile == "full" or m.repeats == 0 else min(m.repeats, 3)
            elif m.slow:
                reps = 1
            else:
                reps = wspec.repeats.get(profile, prof["repeats"])
            if args.repeats is not None and m.repeats is None:
                reps = args.repeats
            scale = 1.0  # the time limits grow with the rounds asked for
            if getattr(args, "rounds", None) is not None and m.repeats is not None and m.repeats > 1:
                scale = max(1.0, args.rounds / reps)
                reps = args.rounds  # the interleaved modes' rounds
            specs.append({"workload": wl, "mode": m.name, "params": params, "repeats": reps,
                          "budget_s": scale * (m.budget_s or (prof["slow_budget_s"] if m.slow else prof["budget_s"])),
                          "timeout_s": scale * prof[m.timeout], "optional": m.optional, "needs": list(m.needs),
                          "own_interpreter": m.own_interpreter})
    if getattr(args, "skip", None):
        specs = [s for s in specs if not any(fnmatch.fnmatchcase(f"{s['workload']}/{s['mode']}", p) for p in args.skip)]
    if args.only:
        keep = {(s["workload"], s["mode"]) for s in specs
                if any(fnmatch.fnmatchcase(f"{s['workload']}/{s['mode']}", p) for p in args.only)}
        for s in specs:  # what a kept mode needs (its store's build) runs too
            if (s["workload"], s["mode"]) in keep:
                keep.update((s["workload"], n) for n in s["needs"])
        specs = [s for s in specs if (s["workload"], s["mode"]) in keep]
    return specs


def prerequisite(done: dict[str, Any], spec: dict[str, Any]) -> str | None:
    """Why a mode cannot run (a build it needs did not succeed), or None."""
    for b in spec["needs"]:
        rec = done.get(b)
        if rec is not None and rec.get("status") != "ok":
            return f"needs {b}, which was {rec.get('status')}: {rec.get('note', '')[:200]}"
    return None


def child_env(threads: int) -> dict[str, str]:
    """The environment of every child: thread counts, offline hubs, no warnings, no bars."""
    n = str(threads)
    return dict(OMP_NUM_THREADS=n, MKL_NUM_THREADS=n, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
                TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1", PYTHONWARNINGS="ignore", TQDM_DISABLE="1")


_FORKSERVER: Any = None


def use_forkserver(threads: int) -> None:
    """Start children by forking a server that has imported torch (set once, before any child).

    The server is started with :func:`child_env` in its environment, so a forked child has the
    thread counts a fresh one would; each child is still its own process (own memory, own
    peak RSS counted from its fork, killed on time-out)."""
    global _FORKSERVER
    import multiprocessing

    os.environ.update(child_env(threads))
    os.environ["PYTHONPATH"] = REPO + os.pathsep + os.environ.get("PYTHONPATH", "")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "numpy", "benchmark.child"])
    _FORKSERVER = ctx


def _forked_child(spec_path: str, out_path: str, log_path: str) -> None:
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.chdir(REPO)
    import multiprocessing

    # a forkserver child inherits the forkserver start method; a fresh interpreter has the
    # platform's default (DataLoader workers started through the server re-import torch)
    multiprocessing.set_start_method(None, force=True)
    from . import child

    child.main([spec_path, out_path])  # ends the process (os._exit)


def run_child(spec: dict[str, Any]) -> dict[str, Any]:
    timeout_s = spec["timeout_s"]
    with tempfile.TemporaryDirectory(prefix="acs-bench-spec-") as tmp:
        spec_path, out_path = os.path.join(tmp, "spec.json"), os.path.join(tmp, "out.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        t0 = time.perf_counter()
        if _FORKSERVER is not None and not spec.get("own_interpreter"):
            log_path = os.path.join(tmp, "child.log")
            proc = _FORKSERVER.Process(target=_forked_child, args=(spec_path, out_path, log_path))
            proc.start()
            proc.join(timeout_s)
            if proc.is_alive():
                proc.kill()
                proc.join()
                rc = None
            else:
                rc = proc.exitcode
            tail = ""
            if os.path.exists(log_path):
                with open(log_path, errors="replace") as f:
                    tail = f.read()[-2000:]
            if rc is None:
                tail = f"timed out after {timeout_s:.0f} s; {tail[-500:]!r}"
        else:
            env = dict(os.environ)
            env.update(child_env(spec["threads"]), PYTHONPATH=REPO + os.pathsep + env.get("PYTHONPATH", ""))
            try:
                proc = subprocess.run([sys.executable, "-m", "benchmark.child", spec_path, out_path], cwd=REPO,
                                      env=env, capture_output=True, text=True, timeout=timeout_s)
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
    """Per-forward times, ratios against plain / naive, bandwidths, tokens/s and read-back
    rows/s (in place). Read-back epochs of one order must have read the same values (their
    checksums agree); a dataset that read other values is turned into an error."""
    for wl, recs in results.items():
        if wl == "readback":
            base: dict[str, dict[str, float]] = {"tensor": {}, "tensor_batched": {}, "hf": {}}
            sums: dict[str, dict[str, float]] = {}
            for mode, r in recs.items():
                if r.get("status") != "ok":
                    continue
                ex = r.get("extra") or {}
                if mode.startswith("dl:"):
                    _, ds, order, _w = mode.split(":")
                    rows = ex.get("rows_per_epoch")
                    r["rows_per_s"] = rows / r["median_s"]
                    r["cold_rows_per_s"] = rows / r["cold_s"]
                    r["bytes_per_s"] = r["rows_per_s"] * 1024
                    if ds in base:
                        base[ds][mode.split(":", 2)[2]] = r["rows_per_s"]
                    if not ex.get("epoch_shortened"):
                        sums.setdefault(order, {})[mode] = ex.get("checksum")
                if mode.startswith("build"):
                    r["write_bytes_per_s"] = r["captured_bytes"] / r["median_s"]
            for order, by_mode in sums.items():
                ref = next(iter(by_mode.values()))
                for mode, cs in by_mode.items():
                    if cs != ref:
                        rec = recs[mode]
                        rec.update(status="error", note=f"read other values than the other datasets of the {order} "
                                   f"order (checksum {cs!r}, others {ref!r})")
            for mode, r in recs.items():
                if mode.startswith("dl:") and r.get("status") == "ok":
                    key = mode.split(":", 2)[2]
                    for ds, rates in base.items():
                        if rates.get(key):
                            r[f"ratio_vs_{ds}"] = r["rows_per_s"] / rates[key]
            continue
        plain = recs.get("plain", {})
        naive = recs.get("naive_clone", {})
        for mode, r in recs.items():
            if r.get("status") != "ok":
                continue
            n = r.get("n_forwards") or 1
            r["ms_per_forward"] = r["median_s"] / n * 1e3
            r["cold_ms_per_forward"] = r["cold_s"] / n * 1e3
            if r.get("rows_per_repeat"):
                r["rows_per_s"] = r["rows_per_repeat"] / r["median_s"]
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
        p(f"{'mode':<24}{'ms/fwd':>9}{'cold':>9}{'x plain':>9}{'cold x':>8}{'x naive':>9}{'rows/s':>10}"
          f"{'RSS grow':>11}{'captured':>11}{'on disk':>11}  note")
        for mode, r in recs.items():
            if r.get("status") != "ok":
                p(f"{mode:<24}{r.get('status', '?').upper():>9}  {r.get('note', '')}")
                continue
            p(f"{mode:<24}{_f(r.get('ms_per_forward'), '{:.2f}'):>9}{_f(r.get('cold_ms_per_forward'), '{:.2f}'):>9}"
              f"{_f(r.get('ratio_vs_plain'), '{:.2f}x'):>9}{_f(r.get('cold_ratio_vs_plain'), '{:.2f}x'):>8}"
              f"{_f(r.get('ratio_vs_naive'), '{:.2f}x'):>9}{_f(r.get('rows_per_s'), '{:,.0f}'):>10}"
              f"{fmt_bytes(r.get('peak_rss_growth_bytes')):>11}"
              f"{fmt_bytes(r.get('captured_bytes')):>11}{fmt_bytes(r.get('stored_bytes')):>11}"
              f"  n={r.get('n_repeats')} {r.get('note', '')}")
        sbs = side_by_side_text(recs.get("side_by_side"))
        if sbs:
            p(f"   {sbs}")
        inter = recs.get("store_floor_interleaved", {})
        if inter.get("status") == "ok":
            ex = inter["extra"]
            pm = ex["part_median_s"]
            p(f"   interleaved ({ex['rounds']} rounds): plain {pm['plain'] * 1e3 / inter['n_forwards']:.2f}, raw write "
              f"{pm['raw_write'] * 1e3 / inter['n_forwards']:.2f}, store {pm['scope_store'] * 1e3 / inter['n_forwards']:.2f} "
              f"ms/fwd; store / max(plain, raw write) per round: "
              + ", ".join(f"{x:.2f}" for x in ex["store_vs_floor_per_round"]) + f" (median {ex['store_vs_floor_median']:.2f})")
            if "write_beside" in pm:
                p(f"   the plain forward with its bytes written beside it by a second thread (write_beside) "
                  f"{pm['write_beside'] * 1e3 / inter['n_forwards']:.2f} ms/fwd, {ex['write_beside_vs_plain_median']:.2f}x "
                  f"plain; store / write_beside {ex['store_vs_write_beside_median']:.2f}")
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
                p(f"{mode:<32}{r.get('status', '?').upper():>9}  {r.get('note', '')}")
                continue
            ex = r.get("extra") or {}
            if mode.startswith("dl:"):
                p(f"{mode:<32}{_f(r.get('rows_per_s'), '{:,.0f}'):>12} rows/s  cold {_f(r.get('cold_rows_per_s'), '{:,.0f}'):>10}"
                  f"  x RAM batched {_f(r.get('ratio_vs_tensor_batched'), '{:.2f}'):>5}"
                  f"  x RAM per-row {_f(r.get('ratio_vs_tensor'), '{:.2f}'):>5}  x HF {_f(r.get('ratio_vs_hf'), '{:.2f}'):>5}"
                  f"  RSS grow {fmt_bytes(r.get('peak_rss_growth_bytes'))}")
            elif mode.startswith("dl_side_by_side:"):
                pm = ex.get("part_median_s") or {}
                p(f"{mode:<32} ours {_f(pm.get('acs', 0) * 1e3, '{:.1f}')} ms, RAM batched "
                  f"{_f(pm.get('tensor_batched', 0) * 1e3, '{:.1f}')} ms per epoch side by side: "
                  f"x RAM batched {_f(ex.get('acs_vs_tensor_batched_median'), '{:.3f}')} (median of {ex.get('rounds')} rounds)")
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
        iv = g.get("interval")
        spread = ""
        if iv:
            spread = (f" [interval of the median {iv[0]:.3f}-{iv[1]:.3f}"
                      + ("" if g.get("settled") else ", spans the bound: within noise") + "]")
        p(f"  [{g['status']}] {g['goal']}: measured {fig}{spread} (goal {g['op']} {g['threshold']}{g['unit']}) "
          f"{g['note']}")
    for e in doc.get("peer_errors", []):
        p(f"  peer error (reported, not a failure of ActivationScope): {e}")
    c = {s: sum(1 for g in doc["goals"] if g["status"] == s) for s in ("PASS", "FAIL", "SKIP")}
    p(f"  {c['PASS']} pass, {c['FAIL']} fail, {c['SKIP']} not measured; total wall {doc['wall_s']:.0f} s")


# ---------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    registry.load_all()
    names = list(registry.WORKLOADS)
    ap = argparse.ArgumentParser(prog="python -m benchmark.runner", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small workloads, 2 repeats, fewer modes (under 2 minutes)")
    ap.add_argument("--json", metavar="PATH", help="write every figure to PATH (see benchmark/README.md)")
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads in every mode (default 1)")
    ap.add_argument("--no-forkserver", action="store_true",
                    help="start every child as a fresh interpreter (default: forked from a server that imported torch)")
    ap.add_argument("--workloads", default=",".join(names), help=f"comma-separated subset of {','.join(names)}")
    ap.add_argument("--skip", action="append", metavar="GLOB",
                    help="leave out workload/mode matching GLOB (repeatable), e.g. 'toy/torchlens'")
    ap.add_argument("--only", action="append", metavar="GLOB",
                    help="run only workload/mode matching GLOB (repeatable), e.g. 'toy/scope_*'; with --quick, "
                    "modes the quick profile leaves out run too when they match")
    ap.add_argument("--forwards", type=int, help="forwards per repeat of the toy workload (default 200; quick 20)")
    ap.add_argument("--layer-mib", type=int, help="size of the read-back layer in MiB (default 512; quick 64)")
    ap.add_argument("--repeats", type=int, help="timed repeats per mode after the cold one (default 5; quick 2)")
    ap.add_argument("--rounds", type=int,
                    help="rounds of the interleaved modes (side_by_side, store_floor_interleaved) after the warm one "
                    "(default 9; quick 3): more rounds narrow the interval of a ratio's median (e.g. --only "
                    "'transformer/side_by_side' --rounds 45)")
    ap.add_argument("--durability", choices=("auto", "buffered", "fsync"), default="auto",
                    help="durability of the raw-write floor and the hand-written disk modes (auto: the store's)")
    ap.add_argument("--workdir", help="parent folder of the scratch stores (default: the system temp folder)")
    ap.add_argument("--keep", action="store_true", help="keep the scratch folder")
    ap.add_argument("--merge", nargs="+", metavar="RUN_JSON",
                    help="merge the workloads of several runs (e.g. run side by side, one per group of "
                    "workloads; a .partial file of a run stopped early counts) into --json, then derive as --rederive")
    ap.add_argument("--rederive", metavar="RUN_JSON", help="recompute the derived keys (ratios, limits, goals, "
                    "failures) of a stored run from its measurements with the current code, rewrite it, print it")
    args = ap.parse_args(argv)
    args.workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    for w in args.workloads:
        if w not in names:
            ap.error(f"--workloads must name some of {', '.join(names)}, got {w!r}")
    return args


def failures(doc: dict[str, Any]) -> list[str]:
    """``workload/mode: note`` of every mode of ours (not a peer) that ended in an error; a
    skip of a mode that is not optional was already turned into an error."""
    registry.load_all()
    out = []
    for wl, recs in doc["results"].items():
        for mode, r in recs.items():
            spec = registry.MODES.get(mode)
            if r.get("status") == "error" and not (spec and spec.peer):
                out.append(f"{wl}/{mode}: {r.get('note', '')[:200]}")
    return out


def peer_errors(doc: dict[str, Any]) -> list[str]:
    """``workload/mode: note`` of every peer mode that ended in an error (reported, not a failure)."""
    registry.load_all()
    return [f"{wl}/{mode}: {r.get('note', '')[:200]}" for wl, recs in doc["results"].items()
            for mode, r in recs.items()
            if r.get("status") == "error" and registry.MODES.get(mode) and registry.MODES[mode].peer]


def merge(paths: list[str]) -> dict[str, Any]:
    """One document from several runs of distinct workloads: the first run's machine and
    settings (a package version it lacks taken from a run that had it), every run's workloads and records (a workload found in several runs: the run
    that holds more of its modes; a mode missing or not ok there: from a run where it is ok
    with the same workload parameters, listed in that run's ``modes_filled``),
    ``settings.merged_from`` naming the runs; derived anew."""
    docs = []
    for p in paths:
        with open(p) as f:
            docs.append((p, json.load(f)))
    out = json.loads(json.dumps(docs[0][1]))
    out["results"], out["workloads"] = {}, {}
    out["settings"]["merged_from"] = [{"file": os.path.basename(p), "argv": d["settings"]["argv"],
                                       "started_at": d["settings"].get("started_at"),
                                       "loadavg": d["machine"].get("loadavg"),
                                       "stopped_early": d.get("wall_s") is None} for p, d in docs]
    # a peer missing from the first run's machine but installed for another run: its version
    packages = out["machine"].setdefault("packages", {})
    for _p, d in docs[1:]:
        for name, version in (d["machine"].get("packages") or {}).items():
            if packages.get(name) is None and version is not None:
                packages[name] = version
    taken: dict[str, int] = {}  # workload -> the run (its index) whose records it holds
    for i, (_p, d) in enumerate(docs):
        for wl, recs in d["results"].items():
            if len(recs) > len(out["results"].get(wl, {})):
                out["results"][wl] = dict(recs)
                out["workloads"][wl] = d["workloads"].get(wl, {"params": {}})
                taken[wl] = i
    for i, entry in enumerate(out["settings"]["merged_from"]):
        entry["workloads"] = [wl for wl in out["results"] if taken.get(wl) == i]
    # a mode missing or not ok in its workload's run is taken from a run where it is ok, with
    # the same workload parameters (e.g. rerun alone after a fix); each run lists what it gave
    for (p, d), entry in zip(docs, out["settings"]["merged_from"]):
        entry["modes_filled"] = []
        for wl, recs in d["results"].items():
            if d["workloads"].get(wl, {}).get("params") != out["workloads"].get(wl, {}).get("params"):
                continue
            for mode, r in recs.items():
                have = out["results"][wl].get(mode)
                if r.get("status") == "ok" and (have is None or have.get("status") != "ok"):
                    out["results"][wl][mode] = r
                    entry["modes_filled"].append(f"{wl}/{mode}")
                    entry.setdefault("replaced_status", []).append("missing" if have is None else have.get("status"))
    walls = [d.get("wall_s") for _p, d in docs]
    out["wall_s"] = None if any(w is None for w in walls) else max(walls)
    # (the goals too are derived again; the first run's --quick verdict, measured by a run of its
    # own, is kept as it was: rederive takes it from there)
    for key in ("limits", "seed_comparison", "failures", "peer_errors"):
        out.pop(key, None)
    return rederive(out)


def rederive(doc: dict[str, Any]) -> dict[str, Any]:
    """Recompute every derived key of a run (ratios, limits, goals, failures) from its
    measured records with the current code; the measurements are not touched."""
    registry.load_all()
    for recs in doc["results"].values():
        for r in recs.values():
            for k in [k for k in r if k.startswith("ratio_vs_") or k in ("rows_per_s", "cold_rows_per_s", "bytes_per_s",
                      "ms_per_forward", "cold_ms_per_forward", "cold_ratio_vs_plain", "captured_bytes_per_s",
                      "write_bytes_per_s")]:
                del r[k]
    describe_workloads(doc)
    if doc.get("wall_s") is None:  # a run stopped early (its .partial file): the children's time
        doc["wall_s"] = sum(r.get("child_wall_s") or 0 for recs in doc["results"].values() for r in recs.values())
        doc["settings"]["stopped_early"] = True
    derive(doc["results"])
    check_bytes(doc)
    doc["limits"] = limits(doc["results"], doc["settings"]["durability"])
    doc["seed_comparison"] = seed_comparison(doc["results"])
    quick = next((g for g in doc.get("goals", []) if g["id"] == "quick_wall"), None)
    doc["goals"] = goals_mod.evaluate(doc["results"]) + ([quick] if quick else [])
    doc["failures"] = failures(doc)
    doc["peer_errors"] = peer_errors(doc)
    return doc


def run_spec(spec: dict[str, Any], done: dict[str, Any], unavailable: str | None) -> dict[str, Any]:
    wl, mode = spec["workload"], spec["mode"]
    if unavailable:
        return {"workload": wl, "mode": mode, "status": "skipped", "note": unavailable}
    why = prerequisite(done, spec)
    if why:
        # an optional build that was skipped skips its readers; a failed build fails them
        failed = any(done.get(b, {}).get("status") == "error" for b in spec["needs"])
        return {"workload": wl, "mode": mode, "status": "error" if failed else "skipped", "note": why}
    print(f"  {wl}/{mode} ...", end="", flush=True)
    rec = run_child(spec)
    if rec["status"] == "skipped" and not spec["optional"]:
        rec.update(status="error", note=f"a mode of ActivationScope itself must not be skipped: {rec.get('note')}")
    print(f" {rec['status']} ({rec.get('child_wall_s', 0):.1f} s) {rec.get('note', '')[:160]}", flush=True)
    return rec


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.merge:
        doc = merge(args.merge)
        print_summary(doc)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(doc, f, indent=1, default=str)
            print(f"\nwrote {args.json}")
        return doc
    if args.rederive:
        with open(args.rederive) as f:
            doc = rederive(json.load(f))
        print_summary(doc)
        with open(args.rederive, "w") as f:
            json.dump(doc, f, indent=1, default=str)
        print(f"\nrewrote {args.rederive}")
        return doc
    t_run = time.perf_counter()
    import torch  # noqa: F401  (machine description)

    from . import machine

    profile = "quick" if args.quick else "full"
    prof = PROFILES[profile]
    durability, why = detect_durability(args.durability)
    work = tempfile.mkdtemp(prefix="acs-bench-", dir=args.workdir)
    ctx = {"workdir": work, "readback_dir": os.path.join(work, "readback"), "durability": durability}
    os.makedirs(ctx["readback_dir"])
    doc: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "machine": machine.describe(args.threads),
        "settings": {"started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "profile": profile, "threads": args.threads, "durability": durability, "durability_reason": why,
                     "repeats": prof["repeats"] if args.repeats is None else args.repeats, "workdir": work,
                     "argv": list(argv if argv is not None else sys.argv[1:])},
        "workloads": {},
        "results": {},
    }
    print(f"ActivationScope benchmark ({profile}); scratch {work}; torch threads {args.threads}", flush=True)
    specs = plan(args, profile)
    if not args.no_forkserver:
        use_forkserver(args.threads)
    unavailable = {}
    for w in args.workloads:
        avail = registry.WORKLOADS[w].available
        unavailable[w] = avail() if avail else None
    try:
        for spec in specs:
            wl = spec["workload"]
            spec.update(threads=args.threads, ctx=ctx)
            rec = run_spec(spec, doc["results"].get(wl, {}), unavailable.get(wl))
            doc["results"].setdefault(wl, {})[spec["mode"]] = rec
            doc["workloads"].setdefault(wl, {"params": spec["params"]})
            if args.json:  # every record so far, raw (no derived keys): a run stopped early keeps them
                with open(args.json + ".partial", "w") as f:
                    json.dump(doc, f, default=str)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    describe_workloads(doc)
    derive(doc["results"])
    check_bytes(doc)
    doc["limits"] = limits(doc["results"], durability)
    doc["seed_comparison"] = seed_comparison(doc["results"])
    doc["wall_s"] = time.perf_counter() - t_run
    doc["goals"] = goals_mod.evaluate(doc["results"])
    doc["goals"].append(registry.goal(
        "quick_wall", f"--quick finishes in under {QUICK_WALL_S:.0f} s", doc["wall_s"] if profile == "quick" and
        not args.only and set(args.workloads) == set(registry.WORKLOADS) else None, "<", QUICK_WALL_S, unit="s",
        note="measured by a --quick run of every workload without --only"))
    doc["failures"] = failures(doc)
    doc["peer_errors"] = peer_errors(doc)
    print("")
    print_summary(doc)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1, default=str)
        print(f"\nwrote {args.json}")
    return doc


def cli(argv: list[str] | None = None) -> int:
    """``python -m benchmark.runner``: exit status 1 when a mode of ours failed."""
    doc = main(argv)
    if doc["failures"]:
        print(f"\nFAILED: {len(doc['failures'])} mode(s) of ActivationScope failed:", file=sys.stderr)
        for f in doc["failures"]:
            print(f"  {f}", file=sys.stderr)
        return 1
    return 0


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


def describe_workloads(doc: dict[str, Any]) -> None:
    for wl, d in doc["workloads"].items():
        spec = registry.WORKLOADS[wl]
        d["description"] = spec.describe(d["params"]) if spec.describe else spec.doc
        for r in doc["results"].get(wl, {}).values():
            if r.get("rows_per_repeat") and "rows_per_repeat" not in d:
                d["rows_per_repeat"] = r["rows_per_repeat"]


if __name__ == "__main__":
    sys.exit(cli())
