"""Child process of the crash-safety tests: captures a toy MLP into a store.

python store_child.py PATH MODE N_BATCHES [LIMIT_AFTER]
MODE "run": capture (resume=True when a store exists at PATH), printing "batch <i>" after each forward.
MODE "runz": the same into a zstd-compressed store.
MODE "killinstall" / "killinstallrunz": "run" / "runz" killed by SIGKILL right after a resume's commit
renames its rewrite of the partial last shard over the key.
MODE "diskfull": after LIMIT_AFTER batches, cap file sizes (RLIMIT_FSIZE) and go on; prints
"ERR <class>: <message>" for the error that stops the capture.
MODE "seg<mode>": <mode> with manifest segments of 2 shards (FORMAT.md section 5).
MODE "killseal": "run" killed by SIGKILL right after a commit wrote manifest segments, before the
manifests that list them.
"""

from __future__ import annotations

import os
import resource
import signal
import sys
import time

import torch

import activationscope as acs
from store_models import MLP, batches_mlp

# fc1 rows: 64 B -> 8-row shards; a commit after every forward that completes one (kills land
# between, inside and after commits, not only before the first)
OPTIONS = {"chunk_rows": 4, "shard_bytes": 4 * 16 * 4 * 2, "commit_interval": 0}
BATCH = 5


def capture(path: str, n_batches: int, *, limit_after: int | None = None, sleep_s: float = 0.0,
            compression: str | None = None) -> None:
    torch.manual_seed(0)
    model = MLP().eval()
    xs = batches_mlp(n_batches=n_batches, batch=BATCH)
    resume = os.path.exists(os.path.join(path, "zarr.json"))  # resume=True needs a store to continue
    scope = acs.ActivationScope(store=path, store_options={**OPTIONS, "resume": resume, "compression": compression})
    tracker = scope.track(model)
    tracker.attach()
    start = tracker.writer.n_samples_committed
    print(f"start {start}", flush=True)
    try:
        with tracker, torch.no_grad():
            for i in range(start // BATCH, n_batches):
                if limit_after is not None and i == limit_after:
                    tracker.writer._core.drain()  # let the shards written so far commit first
                    tracker.writer.commit()
                    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
                    resource.setrlimit(resource.RLIMIT_FSIZE, (100, 100))
                tracker.set_batch(sample_ids=list(range(i * BATCH, (i + 1) * BATCH)))
                model(xs[i])
                print(f"batch {i}", flush=True)
                if sleep_s:
                    time.sleep(sleep_s)
    except acs.ActivationScopeError as e:
        print(f"ERR {type(e).__name__}: {e}", flush=True)
        return
    print("done", flush=True)


if __name__ == "__main__":
    path, mode, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    if mode.startswith("seg"):
        from activationscope.store import _format

        _format.MANIFEST_SEGMENT_SHARDS = 2
        mode = mode[len("seg"):]
    if mode == "killseal":
        import re

        from activationscope.store.writer import StoreWriter

        set_many = StoreWriter._set_many

        def _set_then_die(self, writes):
            set_many(self, writes)
            if any(re.search(r"/manifest\.\d+\.json$", key) for key, _data in writes):
                os.kill(os.getpid(), signal.SIGKILL)

        StoreWriter._set_many = _set_then_die
        mode = "run"
    if mode.startswith("killinstall"):
        # killed right after a resume's commit renamed its rewrite of the partial last shard over
        # the key, before the manifest that lists it (FORMAT.md section 7)
        from activationscope.store.writer import StoreWriter

        install = StoreWriter._install_held_shard

        def _install_then_die(self, arr, shards):
            install(self, arr, shards)
            os.kill(os.getpid(), signal.SIGKILL)

        StoreWriter._install_held_shard = _install_then_die
        mode = mode[len("killinstall"):] or "run"
    if mode == "diskfull":
        capture(path, n, limit_after=int(sys.argv[4]))
    else:
        capture(path, n, sleep_s=float(sys.argv[4]) if len(sys.argv) > 4 else 0.0,
                compression="zstd" if mode == "runz" else None)
