"""Child process of the crash-safety tests of stores that keep reductions only (FORMAT.md section 11).

python reduced_child.py PATH MODE N_BATCHES [SLEEP_S]
MODE "run": capture (resume=True when a store exists at PATH), printing "batch <i>" after each forward.
MODE "killfiles<k>" / "killroot<k>": "run", killed by SIGKILL at its k-th commit of reductions, right after it
wrote the commit's reduction files (before the root lists them) / right after the root (before the folders
of the commit before are removed).
"""

from __future__ import annotations

import os
import signal
import sys
import time

import torch

import activationscope as acs
from store_models import MLP, batches_mlp


def _sum_of_squares(acc: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    s = x.double().pow(2).sum(0)
    return s if acc is None else acc + s


REDUCTIONS = ["mean", "var", "min", "max", ("top", "topk", {"k": 3}), ("ss", _sum_of_squares)]
BATCH = 5


def capture(path: str, n_batches: int, *, sleep_s: float = 0.0) -> None:
    import activationscope.store.writer as writer

    # a commit after every forward (none waits for the time the states took): kills land between
    # and inside commits
    share, writer.STATE_WRITE_SHARE = writer.STATE_WRITE_SHARE, 0.0
    try:
        _capture(path, n_batches, sleep_s)
    finally:
        writer.STATE_WRITE_SHARE = share


def _capture(path: str, n_batches: int, sleep_s: float) -> None:
    torch.manual_seed(0)
    model = MLP().eval()
    xs = batches_mlp(n_batches=n_batches, batch=BATCH)
    resume = os.path.exists(os.path.join(path, "zarr.json"))
    scope = acs.ActivationScope(store=path, reduction_policy=acs.ReductionPolicy.STREAMING, reductions=REDUCTIONS,
                                store_options={"commit_interval": 0, "resume": resume})
    tracker = scope.track(model)
    tracker.attach()
    start = tracker.resume_from
    print(f"start {start}", flush=True)
    with tracker, torch.no_grad():
        for i in range(start // BATCH, n_batches):
            tracker.set_batch(sample_ids=list(range(i * BATCH, (i + 1) * BATCH)))
            model(xs[i])
            print(f"batch {i}", flush=True)
            if sleep_s:
                time.sleep(sleep_s)
    print("done", flush=True)


def _die_at(k: int, method: str, before: bool = False) -> None:
    """SIGKILL at the k-th call of StoreWriter.<method>: after it, or (before) instead of it."""
    from activationscope.store.writer import StoreWriter

    original = getattr(StoreWriter, method)
    seen = [0]

    def then_die(self, *args):
        seen[0] += 1
        if seen[0] == k and before:
            os.kill(os.getpid(), signal.SIGKILL)
        out = original(self, *args)
        if seen[0] == k:
            os.kill(os.getpid(), signal.SIGKILL)
        return out

    setattr(StoreWriter, method, then_die)


if __name__ == "__main__":
    path, mode, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    if mode.startswith("killfiles"):
        _die_at(int(mode[len("killfiles"):]), "_write_commit_reductions")
    elif mode.startswith("killroot"):
        # (called right after the root is written: killed before it removes anything)
        _die_at(int(mode[len("killroot"):]), "_drop_unlisted_commit_folders", before=True)
    capture(path, n, sleep_s=float(sys.argv[4]) if len(sys.argv) > 4 else 0.0)
