"""Native threads at the end of a process: no std::terminate, whatever the caller left open.

A process that exits (normally, or by an uncaught exception) with a store writer still open
used to die in ``std::terminate`` ("terminate called without an active exception"): the
encoder, a Python daemon thread, was inside a native call with the GIL released when the
interpreter finalized, and CPython ended it with ``pthread_exit`` through a noexcept
destructor. Two layers: an exit hook stops the encoders of writers left open while the
interpreter is whole, and the bindings let that ``pthread_exit`` through (alone, that second
layer still aborted in about 1 of 40 runs on a loaded machine, through a path not found yet).
(A user's daemon thread that runs any model at exit aborts the same way in plain
PyTorch, inside torch's own operators: not a case this library can make safe, so not tested
here.) Reference: the model run in plain PyTorch (the rows committed before the exit), and
the bytes of the rows appended to a native writer that nobody closed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import activationscope as acs

ROOT = Path(__file__).resolve().parents[2]
N_BATCHES, BATCH, WIDTH = 40, 16, 64

CHILD = textwrap.dedent("""
    import sys
    import torch
    import activationscope as acs

    path, how = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear({W}, {W}), torch.nn.ReLU(), torch.nn.Linear({W}, {W})).eval()
    xs = torch.randn({N}, {B}, {W}, generator=torch.Generator().manual_seed(1))
    opts = {{"compression": "zstd", "chunk_rows": 8, "shard_rows": 64}}
    tracker = acs.ActivationScope(store=path, store_options=opts).track(model).__enter__()  # never closed
    with torch.no_grad():
        for i in range({N}):
            tracker.set_batch(sample_ids=torch.arange(i * {B}, (i + 1) * {B}))
            model(xs[i])
    import time
    deadline = time.monotonic() + 120  # commit() takes the shards made durable so far: on a
    tracker.writer.commit()            # loaded machine the encoder may not have finished one yet
    while not tracker.writer.n_samples_committed and time.monotonic() < deadline:
        time.sleep(0.02)
        tracker.writer.commit()
    if how.startswith("raise"):
        raise RuntimeError("the capture loop failed")
    sys.exit(0)
""").format(N=N_BATCHES, B=BATCH, W=WIDTH)


def _run_child(tmp_path: Path, how: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "s.zarr"), how], env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("how", ["exit", "raise"])
def test_a_process_ending_with_a_writer_open_exits_without_terminate(tmp_path, how):
    out = _run_child(tmp_path, how)
    assert "terminate called" not in out.stderr, out.stderr[-2000:]
    assert out.returncode == (1 if how.startswith("raise") else 0), out.stderr[-2000:]
    assert ("the capture loop failed" in out.stderr) == how.startswith("raise")
    store = acs.open_store(tmp_path / "s.zarr")  # what was committed before the exit, exactly
    assert store.status == "incomplete"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU(), torch.nn.Linear(WIDTH, WIDTH)).eval()
    xs = torch.randn(N_BATCHES, BATCH, WIDTH, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = torch.cat([model(x) for x in xs])  # batch by batch, as captured
    n = store.n_rows("2.output")
    assert 0 < n <= N_BATCHES * BATCH and n == store.n_samples
    assert torch.equal(store["2.output"], ref[:n])


def test_a_native_writer_dropped_without_close_writes_its_queue_and_ends(tmp_path):
    """The Python side drops the store core and the array writer with chunks still queued:
    the writer thread holds the last reference, writes every queued shard, and ends (it used
    to touch the freed core after its destructor ran on that same thread)."""
    from activationscope.capture import _native

    _C = _native.load()
    rows = torch.arange(64 * 24, dtype=torch.float32).reshape(64, 24)
    for _ in range(3):
        core = _C.StoreCore(1 << 20, False)
        d = tmp_path / f"a{_}"
        w = _C.ArrayWriter(core, "x", str(d), str(d), torch.float32, [24], 4, 2, 0, False)
        w.append(rows)  # 16 chunks of 4 rows: 8 shards, queued for the writer thread
        del w, core  # no flush, no close
    import gc
    import time

    gc.collect()
    for k in range(3):
        d = tmp_path / f"a{k}"
        deadline = time.monotonic() + 30
        while len(list((d / "c").glob("*/0"))) < 8 and time.monotonic() < deadline:
            time.sleep(0.05)
        shards = sorted((d / "c").glob("*/0"), key=lambda p: int(p.parent.name))
        assert [int(p.parent.name) for p in shards] == list(range(8))
        for s, p in enumerate(shards):  # the shard's chunks: raw rows, then the index
            data = p.read_bytes()
            assert data[: 8 * 24 * 4] == rows[8 * s: 8 * s + 8].numpy().tobytes()


def _capture(target, n_batches: int = 3, **options) -> torch.Tensor:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(5)]).eval()
    xs = torch.randn(n_batches, 4, 8)
    store_options = {"overwrite": True, "commit_interval": 0.0, **options}
    with acs.ActivationScope(store=target, store_options=store_options).track(model), torch.no_grad():
        for x in xs:
            model(x)
    with torch.no_grad():
        return model[0](xs.reshape(-1, 8))


def test_a_thread_reading_after_the_main_thread_returned_opens_compressed_arrays(tmp_path, monkeypatch):
    """Once the main thread returns, concurrent.futures refuses new work (its exit hook runs
    before the threads still running are joined). zarr reads local files through that machinery
    (asyncio.to_thread): a thread that went on reading opened its first compressed array with
    StoreCorruptError ("does not open with zarr (RuntimeError: cannot schedule new futures after
    interpreter shutdown)"), calling an intact store damaged. The flag concurrent.futures sets at
    exit, set here: the rows are read."""
    import concurrent.futures.thread as cf_thread

    want = _capture(str(tmp_path / "s.zarr"), compression="zstd")
    monkeypatch.setattr(cf_thread, "_shutdown", True)
    store = acs.open_store(str(tmp_path / "s.zarr"))
    assert torch.equal(store.rows("0.output", 0, len(want)), want)


def test_a_thread_capturing_into_an_object_store_after_the_main_thread_returned_commits(monkeypatch):
    """The same for a capture into an object store (memory://): zarr puts each object through
    asyncio.to_thread, and the open failed taking the writer lock ("writing
    '.activationscope-writer.lock' to memory://... failed: cannot schedule new futures after
    interpreter shutdown"). The capture now commits every row."""
    import concurrent.futures.thread as cf_thread
    import uuid

    url = f"memory://exit-{uuid.uuid4().hex[:8]}"
    monkeypatch.setattr(cf_thread, "_shutdown", True)
    want = _capture(url)
    store = acs.open_store(url)
    assert store.attrs["status"] == "complete"
    assert torch.equal(store.rows("0.output", 0, len(want)), want)
