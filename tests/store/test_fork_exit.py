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
