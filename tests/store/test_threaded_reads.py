"""One opened store read from several threads while another thread refreshes it (a live
capture or a resume growing the store meanwhile). Each interleaving that went wrong is
forced here deterministically: a slow point of one reader (monkeypatched) runs the other
thread's ``refresh()`` (or read) right there; one test also races real threads (readers
while another thread overwrites the store and refreshes it)."""

from __future__ import annotations

import re
import threading

import pytest
import torch

from activationscope.errors import RowIndexError, StoreError
from activationscope.store import StoreWriter, open_store
from activationscope.store import reader as R
from acs_testing import write_rows

HP = "x"



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
    write_rows(path, data[:37], compression=compression)
    st = open_store(path)
    write_rows(path, data[37:], resume=True, compression=compression)  # a live capture grows it
    # the reader has taken the array's entry of the commit it opened; another thread's
    # refresh() lands before it checks that entry against the array's files
    fired = _once(monkeypatch, R.Store, "_array_crcs", lambda self: self.refresh())
    assert torch.equal(st.rows(HP, 0, 10), data[:10])
    assert fired
    assert st.n_rows(HP) == 100 and torch.equal(st.rows(HP, 0, 32), data[:32])


def _refresh_after(monkeypatch, st, method, key):
    """Make ``st._backend.<method>(key, ...)`` run ``st.refresh()`` once, right after it read
    ``key`` (another thread's refresh landing while this reader builds a cache entry from
    the commit it opened)."""
    real = getattr(st._backend, method)
    fired = []

    def patched(k, *args, **kwargs):
        got = real(k, *args, **kwargs)
        if k == key and not fired:
            fired.append(True)
            st.refresh()
        return got

    monkeypatch.setattr(st._backend, method, patched)
    return fired


@pytest.mark.parametrize("compression", [None, "zstd"])
@pytest.mark.parametrize("cache", ["array check", "shard index"])
def test_what_a_reader_built_from_the_commit_before_a_refresh_is_not_kept_for_the_new_one(
        tmp_path, data, monkeypatch, compression, cache):
    path = str(tmp_path / "s.zarr")
    write_rows(path, data[:37], compression=compression)  # shard 1 holds rows 32-36
    st = open_store(path, cache_bytes=0)  # (decoded chunks not cached: see the test of that cache below)
    write_rows(path, data[37:], resume=True, compression=compression)  # rewrites shard 1, adds shards 2-3
    if cache == "array check":  # the manifest's chunks of shards 0-1 (the last one of 37 rows)
        fired = _refresh_after(monkeypatch, st, "size", "acts/x/c/1/0")
        assert torch.equal(st.rows(HP, 0, 10), data[:10])
    else:  # the index of shard 1 as its 37-row file had it
        st.rows(HP, 0, 10)
        fired = _refresh_after(monkeypatch, st, "tail", "acts/x/c/1/0")
        assert torch.equal(st.rows(HP, 32, 37), data[32:37])
    assert fired and st.n_rows(HP) == 100
    for a, b in [(64, 72), (32, 40), (30, 100), (0, 100)]:
        assert torch.equal(st.rows(HP, a, b), data[a:b]), (a, b)
    assert torch.equal(st[HP, ::3], data[::3])
    assert st.verify() == []


def test_a_chunk_decoding_for_the_commit_before_a_refresh_is_not_used_for_the_new_one(tmp_path, data, monkeypatch):
    path = str(tmp_path / "s.zarr")
    write_rows(path, data[:37], compression="zstd")  # chunk 4: rows 32-36 of 37
    st = open_store(path)
    entered, gate = threading.Event(), threading.Event()
    real = R.Store._decode_chunk

    def slow(self, hook_point, meta, c, out=None, run=None):  # the old commit's chunk 4 decodes slowly
        if self is st and c == 4 and int(meta["n_rows"]) == 37:
            entered.set()
            gate.wait(2)
        return real(self, hook_point, meta, c, out, run)

    monkeypatch.setattr(R.Store, "_decode_chunk", slow)
    got = {}
    old_reader = threading.Thread(target=lambda: got.setdefault("old", st.rows(HP, 32, 37)))
    old_reader.start()
    assert entered.wait(5)
    write_rows(path, data[37:], resume=True, compression="zstd")  # chunk 4 now holds rows 32-39
    st.refresh()
    try:  # while the old commit's chunk 4 (5 rows) still decodes
        assert torch.equal(st.rows(HP, 32, 40), data[32:40])
    finally:
        gate.set()
        old_reader.join()
    assert torch.equal(got["old"], data[32:37])
    for a, b in [(32, 40), (24, 48), (0, 100)]:  # once it has finished: not cached for the new commit
        assert torch.equal(st.rows(HP, a, b), data[a:b]), (a, b)



@pytest.mark.parametrize("compression", [None, "zstd"])
@pytest.mark.parametrize("verify", [False, True])
def test_a_reader_that_read_the_kept_shard_of_a_resume_reads_on_once_the_resume_removed_it(
        tmp_path, monkeypatch, compression, verify):
    data = torch.randn(100, 128, generator=torch.Generator().manual_seed(1))
    path = tmp_path / "s.zarr"
    write_rows(path, data[:45], compression=compression)  # shard 1: chunk 4 full, chunk 5 rows 40-44
    shard = path / "acts" / "x" / "c" / "1" / "0"
    kept = shard.with_name("0.committed.tmp")
    committed = shard.read_bytes()
    st = open_store(path, cache_bytes=0, verify=verify)
    assert torch.equal(st.rows(HP, 0, 8), data[:8])
    write_rows(path, data[45:], resume=True, compression=compression)
    # as a reader sees it in a resume's commit: its rewrite at the key, the committed file kept
    kept.write_bytes(committed)
    assert torch.equal(st.rows(HP, 40, 45), data[40:45])  # (of the kept file: the key's does not match)
    kept.unlink()  # the resume's commit ends: it removes the kept file
    for a, b in [(32, 40), (40, 45), (30, 45), (0, 45)]:
        assert torch.equal(st.rows(HP, a, b), data[a:b]), (a, b)
    assert torch.equal(st[HP, ::2], data[:45:2])
    st.refresh()
    assert torch.equal(st.rows(HP, 0, 100), data)


def test_two_threads_refreshing_at_once_never_take_the_store_back_to_an_older_commit(tmp_path, data, monkeypatch):
    path = str(tmp_path / "s.zarr")
    write_rows(path, data[:37])
    st = open_store(path)
    real, fired = R.V.parse_root, []

    def parse_root(raw, **kwargs):  # one refresh() has read the root of 37 rows; meanwhile the
        if not fired:  # store grows and another thread's refresh() reads and shows 100 rows
            fired.append(True)
            write_rows(path, data[37:], resume=True)
            st.refresh()
            assert st.n_rows(HP) == 100
        return real(raw, **kwargs)

    monkeypatch.setattr(R.V, "parse_root", parse_root)
    st.refresh()
    assert fired
    assert st.n_rows(HP) == 100 and torch.equal(st.rows(HP, 90, 100), data[90:])


def _write_run(path, data, compression) -> None:
    """A new run of the store at ``path`` (``overwrite=True``): ``data`` as array ``x``."""
    w = StoreWriter(path, overwrite=True, compression=compression, chunk_rows=8, shard_rows=32)
    w.open_array(HP, tuple(data.shape[1:]), data.dtype, "sample").append(data)
    w.add_batch(len(data))
    w.close()


@pytest.mark.parametrize("compression", [None, "zstd"])
@pytest.mark.parametrize("start,stop", [(1, 30), (50, 90), (1, 70)])
def test_a_refresh_to_another_run_while_rows_are_read(tmp_path, monkeypatch, compression, start, stop):
    """Another thread overwrites the store with a run of fewer rows and refreshes it while
    ``rows()`` reads (after it took the array's entry of the old run): the rows are read again,
    of the new run, or are said to be past its rows (before: a missing shard, or an array
    document at odds with the root, blamed on damage of an intact store)."""
    old = torch.randn(100, 3, generator=torch.Generator().manual_seed(1))
    new = torch.randn(40, 3, generator=torch.Generator().manual_seed(2))
    path = str(tmp_path / "s.zarr")
    _write_run(path, old, compression)
    st = open_store(path)
    assert torch.equal(st.rows(HP, start, stop), old[start:stop])

    def replaced(self):
        _write_run(path, new, compression)
        self.refresh()  # (in another thread)

    fired = _once(monkeypatch, R.Store, "_mappable", replaced)
    if stop <= 40:
        assert torch.equal(st.rows(HP, start, stop), new[start:stop])
    else:
        with pytest.raises(RowIndexError, match=rf"rows \[{start}, {stop}\) out of range for hook point 'x' with 40 "
                                                 r"rows: start and stop must satisfy 0 <= start <= stop <= 40"):
            st.rows(HP, start, stop)
    assert fired


# (each way of reading rows [23, 38) of a store of 32-row shards: rows(), slices of any step)
SPANS = {
    "rows": (lambda st: st.rows(HP, 23, 38), lambda t: t[23:38]),
    "slice": (lambda st: st[HP, 23:38], lambda t: t[23:38]),
    "slice-step": (lambda st: st[HP, 23:38:2], lambda t: t[23:38:2]),
    "slice-reversed": (lambda st: st[HP, 37:22:-1], lambda t: t[23:38].flip(0)),
}


@pytest.mark.parametrize("how", list(SPANS))
def test_rows_spanning_shards_are_never_of_two_runs(tmp_path, monkeypatch, how):
    """A refresh() of another thread shows a replacing run after ``rows()`` (or
    ``store[hp, a:b]``) mapped the first shard of its rows, of the old run: the rows are read
    again, all of the new run (before: the first shard's rows of the old run, the next shard's
    of the new, with no error)."""
    read, want = SPANS[how]
    small = torch.randn(40, 3, generator=torch.Generator().manual_seed(2))
    big = torch.randn(100, 3, generator=torch.Generator().manual_seed(1))
    path = str(tmp_path / "s.zarr")
    _write_run(path, small, None)
    st = open_store(path)
    assert torch.equal(read(st), want(small))
    real, calls = R.Store._mapped_rows, []

    def then_replaced(self, *args):
        out = real(self, *args)
        calls.append(1)
        if len(calls) == 1:
            _write_run(path, big, None)
            self.refresh()  # (in another thread)
        return out

    monkeypatch.setattr(R.Store, "_mapped_rows", then_replaced)
    assert torch.equal(read(st), want(big))
    assert calls


@pytest.mark.parametrize("read,what", [(lambda st: st.rows(HP, 1, 30), r"rows \[1, 30\) of hook point 'x'"),
                                       (lambda st: st[HP, 1:30], r"store\['x', 1:30\]")], ids=["rows", "slice"])
def test_rows_read_while_each_read_is_replaced_are_refused_after_three_reads(tmp_path, monkeypatch, read, what):
    """Another run shown by a refresh() during each read: three reads, then the error saying
    the store was replaced while they were read, naming the read (not rows of another run, not
    a loop)."""
    runs = [torch.randn(100, 3, generator=torch.Generator().manual_seed(1)),
            torch.randn(40, 3, generator=torch.Generator().manual_seed(2))]
    path = str(tmp_path / "s.zarr")
    _write_run(path, runs[0], None)
    st = open_store(path)
    assert torch.equal(read(st), runs[0][1:30])
    real, calls = R.Store._mapped_rows, []

    def then_replaced(self, *args):
        out = real(self, *args)
        calls.append(1)
        _write_run(path, runs[len(calls) % 2], None)
        self.refresh()  # (in another thread)
        return out

    monkeypatch.setattr(R.Store, "_mapped_rows", then_replaced)
    with pytest.raises(StoreError, match=what + r": store at .* was replaced while they were "
                                         r"read, 3 times .*read them again once no capture overwrites the store"):
        read(st)
    assert len(calls) == 3


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_rows_read_while_another_thread_overwrites_and_refreshes(tmp_path, compression):
    """Reader threads read ``rows()`` while another thread writes new runs in the store's place
    (``overwrite=True``) and refreshes it: each read is the rows of one of the two runs, or a
    RowIndexError (rows past the run shown), or the error saying the store was replaced (read
    between the overwrite and the refresh); never damage of an intact store."""
    runs = [torch.randn(100, 3, generator=torch.Generator().manual_seed(1)),
            torch.randn(40, 3, generator=torch.Generator().manual_seed(2))]
    path = str(tmp_path / "s.zarr")
    _write_run(path, runs[0], compression)
    st = open_store(path)
    done, wrong, failed = threading.Event(), [], []

    def read(seed):
        g = torch.Generator().manual_seed(seed)
        while not done.is_set():
            start = int(torch.randint(0, 100, (1,), generator=g))
            stop = int(torch.randint(start, 101, (1,), generator=g))
            try:
                got = st.rows(HP, start, stop)
            except RowIndexError:
                continue
            except StoreError as e:
                if type(e) is not StoreError or not re.search(r"was (replaced|removed or moved)", str(e)):
                    failed.append(e)
                continue
            if not any(stop <= len(t) and torch.equal(got, t[start:stop]) for t in runs):
                wrong.append((start, stop))

    threads = [threading.Thread(target=read, args=(s,)) for s in range(3)]
    for th in threads:
        th.start()
    try:
        for i in range(1, 13):
            _write_run(path, runs[i % 2], compression)
            st.refresh()
    finally:
        done.set()
        for th in threads:
            th.join()
    assert not failed, failed[:3]
    assert not wrong, wrong[:3]

