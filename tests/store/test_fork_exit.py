"""A process forked during a store capture that exits normally (``sys.exit``: the exit hooks run)
leaves its parent's capture alone."""

from __future__ import annotations

import os

import pytest
import torch

import activationscope as acs
from activationscope.store import writer as W

from acs_testing import toy_mlp


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_s_exit_does_not_close_the_parent_s_writers(tmp_path):
    # the child's atexit hook closed the parent's writers it had copies of, writing their
    # queued chunks into the parent's store (the parent's next rename of a shard then failed,
    # ENOENT, in some runs); now the child holds none of them at exit
    model = toy_mlp(depth=1)
    xs = torch.randn(8, 4, 16)
    path = tmp_path / "s.zarr"
    with torch.no_grad(), acs.ActivationScope(store=path, store_options={"compression": "zstd"}).track(model):
        for i, x in enumerate(xs):
            model(x)
            if i == 3:
                assert W._ENCODING  # (the parent's encoder thread runs: compressed chunks)
                r, w = os.pipe()
                pid = os.fork()
                if pid == 0:  # the child: report what its exit would close, and run that exit hook
                    os.close(r)
                    os.write(w, str(len(W._ENCODING)).encode())
                    os.close(w)
                    W._stop_encoders_at_exit()
                    os._exit(0)
                os.close(w)
                seen = os.read(r, 16).decode()
                os.close(r)
                _, status = os.waitpid(pid, 0)
                assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
                assert seen == "0"
    store = acs.open_store(path)
    assert store.status == "complete" and store.verify() == []
    with torch.no_grad():
        assert torch.equal(store["1.output"], torch.cat([model(x) for x in xs]))


_CHILD_EXITS = """
import os, sys
import torch
from activationscope.store import StoreWriter, open_store
target = sys.argv[1]
w = StoreWriter(target, chunk_rows=4, capture_config={}, model=None, storage_dtype=None)
a = w.open_array("x", (16,), torch.float32, "sample")
rows = torch.randn(10, 16)
a.append(rows)  # (a shard open: its temporary file being written, in the store's or staging folder)
w.add_batch(10, list(range(10)), None, {})
w._core.drain()
pid = os.fork()
if pid == 0:
    sys.exit(0)  # the interpreter's exit: the child's copies of the writer's objects are dropped
_, status = os.waitpid(pid, 0)
assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
a.append(rows)
w.add_batch(10, list(range(10, 20)), None, {})
w.close()
assert torch.equal(open_store(target)["x"], torch.cat([rows, rows]))
print("ok")
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.parametrize("where", ["local", "memory"])
def test_a_forked_child_s_exit_leaves_the_parent_s_open_shard(tmp_path, where):
    # the child's copy of each array writer, dropped at its exit, removed the temporary file of
    # the shard its parent was writing (the parent's rename of it then failed, ENOENT, and the
    # capture with it); now a forked child's copy removes nothing
    import subprocess
    import sys
    from pathlib import Path

    target = str(tmp_path / "s.zarr") if where == "local" else f"memory://fork-exit/{tmp_path.name}.zarr"
    env = {**os.environ, "TMPDIR": str(tmp_path), "PYTHONPATH": os.pathsep.join(
        [str(Path(acs.__file__).parents[1]), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", _CHILD_EXITS, target], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]
