"""One opened store read from several threads while another thread refreshes it (a live
capture or a resume growing the store meanwhile). Each interleaving that went wrong is
forced here deterministically: a slow point of one reader (monkeypatched) runs the other
thread's ``refresh()`` (or read) right there."""

from __future__ import annotations

import threading

import pytest
import torch

from activationscope.store import StoreWriter, open_store
from activationscope.store import reader as R

HP = "x"


def _write(path, data, *, resume=False, compression=None):
    """Rows of ``HP``: chunks of 8 rows, shards of 32 (37 rows end inside a chunk)."""
    w = StoreWriter(path, resume=resume, compression=compression, chunk_rows=8, shard_rows=32)
    a = w.open_array(HP, (3,), torch.float32, "sample")
    a.append(data)
    w.add_batch(len(data))
    w.close()


@pytest.fixture
def data():
    return torch.randn(100, 3, generator=torch.Generator().manual_seed(0))


def _once(monkeypatch, cls, name, before):
    """Patch ``cls.name`` so that its first call runs ``before(self)`` first."""
    real = getattr(cls, name)
    fired = []

    def patched(self, *args, **kwargs):
        if not fired:
            fired.append(True)
            before(self)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(cls, name, patched)
    return fired


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_a_refresh_while_a_reader_checks_the_array_is_not_reported_as_damage(tmp_path, data, monkeypatch,
                                                                          compression):
    path = str(tmp_path / "s.zarr")
    _write(path, data[:37], compression=compression)
    st = open_store(path)
    _write(path, data[37:], resume=True, compression=compression)  # a live capture grows it
    # the reader has taken the array's entry of the commit it opened; another thread's
    # refresh() lands before it checks that entry against the array's files
    fired = _once(monkeypatch, R.Store, "_array_crcs", lambda self: self.refresh())
    assert torch.equal(st.rows(HP, 0, 10), data[:10])
    assert fired
    assert st.n_rows(HP) == 100 and torch.equal(st.rows(HP, 0, 32), data[:32])
