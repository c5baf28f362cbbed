"""A torchrun capture that ends with a plain interpreter exit (run by tests/distributed/test_torchrun_exit.py).

    torchrun --standalone --nproc_per_node=2 torchrun_exit.py STORE [--init torch|acs] [--no-capture]

Each rank captures a small MLP into STORE (gloo; ``--no-capture``: only imports
activationscope.store and writes no report, the shape in which a rank aborted most often,
1 run in 3 to 5 without the exit hook), then destroys the process group and
returns, as a user's script does. With ``--init torch`` the group comes from
``torch.distributed.init_process_group``, with ``--init acs`` from ``acs.init_process_group``;
then ``torch.distributed.nn`` is imported (as ``transformers`` 5 ``from_pretrained`` does):
imported for the first time after the group exists, its functions' default arguments hold
the group past ``destroy_process_group``.

After the capture the ranks gather one value (a last collective, as a user's script gathers
its results). Each rank writes ``STORE.rank<r>.exit.json``: the gloo threads alive at the very end of
interpreter exit (after every other atexit hook, activationscope's included) and, with
``--init acs``, right after ``destroy_process_group``.
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import sys

REPORT: dict = {}


def _gloo_threads() -> list[str]:
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:
            pass  # the thread ended meanwhile
    return sorted(n for n in names if "gloo" in n)


def _report_at_exit() -> None:
    if "path" not in REPORT:
        return  # failed before the process group existed: the error says why
    REPORT["gloo_threads_at_exit"] = _gloo_threads()
    with open(REPORT["path"], "w") as f:
        json.dump(REPORT, f)


if "--no-capture" not in sys.argv:  # (it delays the exit: the abort needs the exit to follow the last collective at once)
    atexit.register(_report_at_exit)  # first registered, so it runs after every later atexit hook

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import activationscope as acs  # noqa: E402


def main() -> None:
    store, init = sys.argv[1], sys.argv[sys.argv.index("--init") + 1] if "--init" in sys.argv else "torch"
    torch.set_num_threads(1)
    if init == "acs":
        acs.init_process_group("gloo")
    else:
        dist.init_process_group("gloo")
    importlib.import_module("torch.distributed.nn")  # first import: binds the group as its functions' defaults
    rank, world = dist.get_rank(), dist.get_world_size()
    REPORT.update(path=f"{store}.rank{rank}.exit.json", rank=rank)
    if "--no-capture" in sys.argv:
        importlib.import_module("activationscope.store")  # only the library's import
        dist.barrier()
    else:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32)).eval()
        scope = acs.ActivationScope(store=store, store_options={"shard_rows": 64})
        with scope.track(model) as tracker, torch.no_grad():
            for b in range(rank, 8, world):
                tracker.set_batch(sample_ids=torch.arange(b * 16, (b + 1) * 16))
                model(torch.randn(16, 32, generator=torch.Generator().manual_seed(b)))
    rows: list = [None] * world  # a last collective right before the end, as a user's script gathers its results
    dist.all_gather_object(rows, {"rank": rank, "n_batches": len(range(rank, 8, world))})
    REPORT["gathered"] = rows
    dist.destroy_process_group()
    if init == "acs":  # (with "torch", nothing may run here: the abort needs the exit to follow at once)
        REPORT["gloo_threads_after_destroy"] = _gloo_threads()


if __name__ == "__main__":
    main()
