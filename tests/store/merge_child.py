"""Child process of the row-table merge tests: a capture that commits after every forward and
merges its row-table parts at every commit that can (FORMAT.md section 4), killed by SIGKILL
at a chosen write.

python merge_child.py TARGET N_FORWARDS KILL_AT RESUME [STORAGE_OPTIONS_JSON]
Captures N_FORWARDS forwards (RESUME 1: resumes the store at TARGET, from its committed
forwards on), committing after each. KILL_AT > 0: SIGKILL instead of the KILL_AT-th write or
delete of a row-table part or of the root document (counted from the writer's open); 0: never.
"""

from __future__ import annotations

import json
import os
import signal
import sys

import numpy as np
import torch

from activationscope.store import StoreWriter
from activationscope.store import writer as W
from activationscope.store._backend import LocalBackend, ZarrBackend

SAMPLES = 2  # per forward; each forward's mask keeps 3 tokens
MASK = torch.tensor([[True, True], [True, False]])


def merge_often() -> None:
    """Merge every run of 2 parts of a table of more than 2 (the writer's defaults: 4 and 16)."""
    W.ROW_PARTS_BEFORE_MERGE = 2
    W.ROW_PART_MERGE_FACTOR = 2


def counting(kill_at: int, log: list | None = None) -> None:
    """Count the writes and deletes of row-table parts and of the root document; SIGKILL
    instead of the ``kill_at``-th (0: never). ``log`` gets ``(op, key)`` of each."""
    for cls in (LocalBackend, ZarrBackend):
        for op in ("set", "delete"):
            original = cls.__dict__[op]

            def wrapped(self, key, *args, _original=original, _op=op, **kwargs):
                if key.startswith("rows/") or key == "zarr.json":
                    counting.n += 1
                    if log is not None:
                        log.append((_op, key))
                    if counting.n == kill_at:
                        os.kill(os.getpid(), signal.SIGKILL)
                return _original(self, key, *args, **kwargs)

            setattr(cls, op, wrapped)


counting.n = 0


class Capture:
    """A writer of one sample array ``x`` and one token array ``t`` (one row a shard), whose
    forwards are each committed at once."""

    def __init__(self, target: str, resume: bool = False, storage_options: dict | None = None) -> None:
        self.w = StoreWriter(target, chunk_rows=1, shard_bytes=8, commit_interval=0, resume=resume,
                             storage_options=storage_options)
        self.x = self.w.open_array("x", (2,), torch.float32, "sample")
        self.t = self.w.open_array("t", (2,), torch.float32, "token")

    def forward(self, i: int, late_from: int) -> None:
        """Forward ``i`` (2 samples, 3 tokens) recorded and committed: columns of strings,
        floats (NaN in every fifth forward), token ids, and ``late`` from forward ``late_from`` on."""
        self.x.append(torch.full((SAMPLES, 2), float(i)))
        self.t.append(torch.full((3, 2), float(i)))
        columns = {"name": [f"s{SAMPLES * i + j}" for j in range(SAMPLES)],
                   "score": np.array([i / 3, np.nan if i % 5 == 0 else -i], np.float64),
                   "tok": torch.tensor([[i, i + 1], [i + 2, i + 3]])}
        if i >= late_from:  # a column first given in a later forward: null in the rows before
            columns["late"] = [i, i]
        self.w.add_batch(SAMPLES, list(range(SAMPLES * i, SAMPLES * (i + 1))), MASK, columns)
        self.w._core.drain()
        self.w.commit()


def capture(target: str, n_forwards: int, resume: bool = False, storage_options: dict | None = None) -> None:
    """The forwards past the committed ones, each committed at once, then the close."""
    c = Capture(target, resume, storage_options)
    for i in range(c.w.n_samples_committed // SAMPLES, n_forwards):
        c.forward(i, n_forwards // 2)
    c.w.close()


if __name__ == "__main__":
    target, n, kill_at, resume = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
    options = json.loads(sys.argv[5]) if len(sys.argv) > 5 else None
    merge_often()
    counting(kill_at)
    capture(target, n, resume, options)
