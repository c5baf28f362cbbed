"""A capture script run by the tests under torchrun (or as one process with WORLD_SIZE unset).

    torchrun --standalone --nproc_per_node=2 torchrun_capture.py STORE [--resume] [--overwrite] [--die-at-batch K --die-rank R
                                                                         [--die-once] [--die-how exit|sigkill]] [--plain-init]
                                                                         [--storage-options JSON] [--stall-before-rank-root]

Rank r captures batches r, r + world, r + 2 world, ... of a fixed synthetic data set (batch b
is seeded by b). The dying rank dies inside the forward of batch K (``os._exit(3)``, or
SIGKILL of its own pid, or ``--die-how raise``: a RuntimeError leaving the capture's block), once something is committed. ``--die-once``: die only in torchrun's first attempt
(``TORCHELASTIC_RESTART_COUNT`` 0), so ``--max-restarts=1`` reruns the ranks. The process group
comes from ``acs.init_process_group`` (``--plain-init``: ``torch.distributed``'s own). The summary of rank 0's commit goes to STORE + ".summary.json"
(a local STORE only). ``--storage-options``: fsspec options of a URL STORE (``s3://...``), as JSON.
``--timeout-s T``: the process group's timeout (seconds); ``--slow-rank0-s S``: rank 0 sleeps S
seconds before its last batch (its share takes longer than the other ranks'); ``--slow-prepare-s S``:
rank 0's preparation of the store (``prepare_root``) takes S seconds more. ``--fail-open-rank R``: rank
R's store fails to open (a StoreError) before its capture starts; the script catches it, prints
it, and its process stays alive ``--alive-s`` seconds more before it exits. ``--fail-attach-rank R``: rank
R's store opens, then wrapping its modules fails (a RuntimeError), caught and printed the same way.
``--stall-before-rank-root``: rank 0 stops once its rank store's folder and lock are made, before
its root document (``zarr.json``) is written, and waits there (at most 300 s, then ``os._exit(4)``)
for torchrun to stop it once another rank dies: a rank stopped while it was still creating its rank store.
With ``ACS_TEST_NO_GLOO_GROUP=1`` in the environment, ``torch.distributed.new_group(backend="gloo")``
raises, as where gloo finds no network interface (the default group is made without it).
``--hold FILE --hold-at batch|commit``: rank 0 stops before its last batch (``batch``: every rank's
store open) or before its commit of the rank stores (``commit``: every rank's store closed), writes
FILE + ".held" and waits (at most 300 s, then ``os._exit(5)``) for FILE + ".go" to exist.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import activationscope as acs  # noqa: E402
from acs_testing import toy_mlp  # noqa: E402

N_BATCHES, BATCH, WIDTH = 21, 7, 16
STORE_OPTIONS = {"shard_rows": 16, "chunk_rows": 8, "commit_interval": 0}  # kills land between commits


def batch(b: int) -> torch.Tensor:
    return torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(1000 + b)) + 3.0


def batches_of(rank: int, world: int) -> list[int]:
    return list(range(rank, N_BATCHES, world))


def capture_rank_stores(store: str, reductions: list[str], world: int = 2, storage_options: dict | None = None,
                        model: torch.nn.Module | None = None) -> None:
    """Slurm / Ray style, in this process: task r of ``world`` writes its rank store
    (``acs.RankStore``) from the batches rank r captures under torchrun; nothing is committed."""
    model = toy_mlp(WIDTH, 3).eval() if model is None else model
    extra = {"storage_options": storage_options} if storage_options else {}
    for r in range(world):
        scope = acs.ActivationScope(store=str(store), reductions=reductions,
                                    store_options={**STORE_OPTIONS, **extra, "process_group": acs.RankStore(r, world)})
        with scope.track(model) as tracker, torch.no_grad():
            for b in batches_of(r, world):
                tracker.set_batch(sample_ids=torch.arange(b * BATCH, (b + 1) * BATCH))
                model(batch(b))


def wait_for_rank_roots(args, rank: int, world: int, deadline: float) -> None:
    """Wait until the rank store of every other rank has its root document (zarr.json), or
    ``deadline`` (time.monotonic()) passes."""
    import fsspec

    options = json.loads(args.storage_options) if isinstance(args.storage_options, str) else (
        args.storage_options or {})
    fs, root = fsspec.core.url_to_fs(args.store, **options)
    others = [f"{root.rstrip('/')}/ranks/{r:05d}/zarr.json" for r in range(world) if r != rank]
    while time.monotonic() < deadline:
        fs.invalidate_cache()
        if all(fs.exists(p) for p in others):
            return
        time.sleep(0.05)
    print(f"rank {rank}: the other ranks' rank stores have no root document after waiting", flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("store")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--die-at-batch", type=int, default=-1)
    p.add_argument("--die-rank", type=int, default=1)
    p.add_argument("--die-once", action="store_true")
    p.add_argument("--die-how", choices=["exit", "sigkill", "raise"], default="exit")
    p.add_argument("--plain-init", action="store_true")
    p.add_argument("--storage-options", type=json.loads, default=None)
    p.add_argument("--device", default="cpu", help="the model's device (cuda: every rank on the current one, gloo)")
    p.add_argument("--timeout-s", type=float, default=None)
    p.add_argument("--slow-rank0-s", type=float, default=0.0)
    p.add_argument("--slow-prepare-s", type=float, default=0.0)
    p.add_argument("--rank-wait-s", type=float, default=None)
    p.add_argument("--sample-every", type=int, default=0, help="CapturePolicy.SAMPLE_N with this period")
    p.add_argument("--fail-open-rank", type=int, default=-1)
    p.add_argument("--alive-s", type=float, default=0.0)
    p.add_argument("--fail-attach-rank", type=int, default=-1)
    p.add_argument("--stall-before-rank-root", action="store_true")
    p.add_argument("--hold", default=None)
    p.add_argument("--hold-at", choices=["batch", "commit"], default="batch")
    p.add_argument("--segment-shards", type=int, default=0, help="manifest segments of this many shards")
    args = p.parse_args()
    if args.segment_shards:  # (store/FORMAT.md section 5: every rank store and the commit seal them so)
        from activationscope.store import _format

        _format.MANIFEST_SEGMENT_SHARDS = args.segment_shards
    torch.set_num_threads(1)
    distributed = "WORLD_SIZE" in os.environ
    if distributed:
        import datetime

        timeout = {} if args.timeout_s is None else {"timeout": datetime.timedelta(seconds=args.timeout_s)}
        if args.plain_init:
            dist.init_process_group("gloo", **timeout)
        else:
            acs.init_process_group("gloo", **timeout)
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    if os.environ.get("ACS_TEST_NO_GLOO_GROUP") == "1":
        new_group = dist.new_group

        def no_gloo_group(*a, **kw):
            if kw.get("backend") == "gloo":
                raise RuntimeError("[enforce fail at gloo/transport/tcp/device.cc] no network interface found")
            return new_group(*a, **kw)

        dist.new_group = no_gloo_group
    if rank == 0 and args.slow_prepare_s:
        from activationscope.store import ranks

        prepare = ranks._prepare  # (what the capture's rank 0 calls; prepare_root calls it too)

        def slow_prepare(*a, **kw):  # (an overwrite of a large old store on object storage)
            time.sleep(args.slow_prepare_s)
            return prepare(*a, **kw)

        ranks._prepare = slow_prepare
    if rank == 0 and args.stall_before_rank_root:
        from activationscope.store import writer

        def stalled_root(backend, *a, **kw):  # (the folder and the writer lock exist; zarr.json not yet)
            print("rank 0 stalls before the root document of its rank store", flush=True)
            time.sleep(300)  # (bounded: torchrun stops it long before)
            os._exit(4)

        writer.write_root_first = stalled_root
    def hold() -> None:  # (a file the test writes lets it go on: no timing decides anything)
        with open(args.hold + ".held", "w") as f:
            f.write(str(os.getpid()))
        deadline = time.monotonic() + 300
        while not os.path.exists(args.hold + ".go"):
            if time.monotonic() > deadline:
                os._exit(5)
            time.sleep(0.02)

    if rank == 0 and args.hold and args.hold_at == "commit":
        from activationscope.store import ranks as ranks_module

        def held(commit):
            def held_commit(*a, **kw):
                hold()
                return commit(*a, **kw)
            return held_commit

        for name in ("commit_ranks", "_commit_held"):  # (rank 0 commits with the second, under the store's lock)
            if hasattr(ranks_module, name):
                setattr(ranks_module, name, held(getattr(ranks_module, name)))
    if rank == args.fail_open_rank:
        from activationscope.store import writer

        class FailingWriter(writer.StoreWriter):
            def __init__(self, *a, **kw):
                raise acs.StoreError(f"injected failure to open the store of rank {rank}")

        writer.StoreWriter = FailingWriter
    if rank == args.fail_attach_rank:
        from activationscope.capture import scope as scope_module

        def failing_install(self, module, site):
            assert self.writer is not None  # (after the store opened)
            raise RuntimeError(f"injected failure to wrap a module on rank {rank}")

        scope_module.Tracker._install = failing_install
    model = toy_mlp(WIDTH, 3).eval().to(args.device)
    policy = ({"capture_policy": acs.CapturePolicy.SAMPLE_N, "sample_every": args.sample_every}
              if args.sample_every else {})
    scope = acs.ActivationScope(store=args.store, reductions=["mean", "var", "cov"], **policy,
                                store_options={**STORE_OPTIONS, "resume": args.resume, "overwrite": args.overwrite,
                                               **({"rank_wait_s": args.rank_wait_s} if args.rank_wait_s else {}),
                                               **({"storage_options": args.storage_options} if args.storage_options else {})})
    if rank in (args.fail_open_rank, args.fail_attach_rank):
        try:
            with scope.track(model):
                raise AssertionError("the capture of this rank started")
        except (acs.StoreError, RuntimeError) as e:
            print(f"rank {rank} caught: {e}", flush=True)
        time.sleep(args.alive_s)  # (the process goes on with other work)
        if distributed:
            dist.destroy_process_group()
        return
    with scope.track(model) as tracker, torch.no_grad():
        skip = tracker.resume_from // BATCH
        for i, b in enumerate(batches_of(rank, world)):
            if i < skip:
                continue
            first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
            if b == args.die_at_batch and rank == args.die_rank and (first_attempt or not args.die_once):
                # die once something is committed (the writer thread makes shards durable in the
                # background; on a loaded machine it may lag the forwards), then with no exit path
                deadline = time.monotonic() + 30
                while tracker.writer.n_samples_committed == 0 and time.monotonic() < deadline:
                    tracker.writer.commit()
                    time.sleep(0.01)
                if not args.stall_before_rank_root:  # (and once the other ranks' rank stores are made:
                    # on a loaded machine another rank may still be starting; --stall-before-rank-root
                    # is the test of that case)
                    wait_for_rank_roots(args, rank, world, deadline=time.monotonic() + 60)

                def die(*_):  # mid-forward: the first layers of this batch were captured already
                    if args.die_how == "raise":  # (leaves the capture's block: the process exits with it)
                        raise RuntimeError(f"injected failure in the forward of batch {b} on rank {rank}")
                    if args.die_how == "sigkill":
                        os.kill(os.getpid(), signal.SIGKILL)
                    os._exit(3)

                model[2].register_forward_hook(die)
            if rank == 0 and args.hold and args.hold_at == "batch" and i == len(batches_of(rank, world)) - 1:
                hold()
            if rank == 0 and args.slow_rank0_s and i == len(batches_of(rank, world)) - 1:
                time.sleep(args.slow_rank0_s)
            tracker.set_batch(sample_ids=torch.arange(b * BATCH, (b + 1) * BATCH))
            model(batch(b).to(args.device))
    summary = getattr(tracker.writer, "summary", None)
    if rank == 0 and summary is not None and "://" not in args.store:
        with open(args.store + ".summary.json", "w") as f:
            json.dump(summary, f)
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
