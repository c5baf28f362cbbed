"""A store keeps a bounded number of memory mappings cached (``reader._MAP_BUDGET``).

Each shard file read zero-copy is one of the process's ``vm.max_map_count`` mappings (65530
by default). A store of 1500 hook points of 50 shards each, every hook point read in turn,
used to keep every mapping it ever made (per shard, and per array mapped back to back), ran
out, and its reads failed with ENOMEM although the store was whole. Here the limit is
simulated (the native map refuses past a few live mappings of the store's files, as mmap
does past the limit) and the budget made small: every hook point reads with the right
values, through ``Store.rows`` and through ``ActivationDataset``, and the mappings held stay
within the budget.
"""

from __future__ import annotations

import errno
import gc
import os

import pytest
import torch

import activationscope as acs
from activationscope.capture import _native
from activationscope.store import reader as R

pytestmark = [
    pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="counts the process's mappings (Linux)"),
    pytest.mark.skipif(_native.optional() is None, reason="needs the native extension (shards mapped back to back)"),
]

N_LAYERS = 6
ROWS = 80  # 5 shards of 16 rows (one 4 KiB chunk of 16 rows of 64 float32) per hook point
SHARD_ROWS = 16


def _capture(path):
    """A store of N_LAYERS hook points of 5 shards each; the rows fed in, per hook point."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(N_LAYERS)])
    xs = [torch.randn(8, 64) for _ in range(ROWS // 8)]
    opts = {"chunk_rows": SHARD_ROWS, "shard_rows": SHARD_ROWS}
    with torch.no_grad(), acs.ActivationScope(store=str(path), store_options=opts).track(model):
        for x in xs:
            model(x)
    ref = {}
    with torch.no_grad():
        h = torch.cat(xs)
        for i, layer in enumerate(model):
            h = layer(h)
            ref[f"{i}.output"] = h.clone()
    return ref


def _store_maps(path) -> int:
    """How many of the process's mappings are of files of the store at ``path``."""
    root = str(path)
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if root in line)


@pytest.fixture
def limited(tmp_path, monkeypatch):
    """make(budget, limit) -> (path, reference rows): a store, the budget patched small, and
    the native map refusing (ENOMEM, as mmap past vm.max_map_count) a mapping that would make
    more than ``limit`` live mappings of the store's files (the store's cache, and what a
    caller holds: a batch of views of a shard of each hook point)."""

    def make(budget: int, limit: int):
        path = tmp_path / "s.zarr"
        ref = _capture(path)
        real = _native.optional()

        class Limited:
            def __getattr__(self, name):
                return getattr(real, name)

            @staticmethod
            def map_files_contiguous(paths, stride, total):
                n = -(-total // stride)  # (the files it maps)
                if _store_maps(path) + n > limit:
                    raise RuntimeError(f"mapping shard '{paths[0]}' failed: {os.strerror(errno.ENOMEM)}")
                return real.map_files_contiguous(paths, stride, total)

        monkeypatch.setattr(R._native, "optional", lambda: Limited())
        monkeypatch.setattr(R, "_MAP_BUDGET", budget, raising=False)
        return path, ref

    gc.collect()  # (mappings of stores of earlier tests, freed)
    return make


@pytest.mark.parametrize("budget", [40, 8, 3], ids=["whole-arrays", "per-shard", "fewer-than-an-array"])
def test_every_hook_point_reads_through_rows_within_the_budget(limited, budget):
    """40: every array's 5 shards map back to back (one view each; the store's 30 shards fit),
    and the least recently used mappings are dropped for the shards read one by one; 8 and
    3: the store's shards do not fit, so every array is read per shard (a read across shards
    is one copy). Before, the mappings were never dropped, and a read needed more live
    mappings than the limit: 'cannot be mapped ... out of memory mappings'."""
    path, ref = limited(budget, limit=budget + 5)
    st = acs.open_store(path)
    for _ in range(2):  # (a second pass: mappings dropped before are made again)
        for hp, want in ref.items():
            assert torch.equal(st.rows(hp, 0, ROWS), want)
            for s in range(0, ROWS, 8):  # within one shard: views of one shard's mapping
                assert torch.equal(st.rows(hp, s, s + 8), want[s:s + 8])
            assert torch.equal(st[hp, 5:70:3], want[5:70:3])
            assert _store_maps(path) <= budget
            assert st._n_mapped <= budget
    if budget < N_LAYERS * ROWS // SHARD_ROWS:
        assert st.segments("0.output") == list(range(0, ROWS + 1, SHARD_ROWS))
    else:
        assert st.segments("0.output") == [0, ROWS]


def test_a_view_kept_past_its_mapping_being_dropped_still_reads_the_stored_rows(limited):
    """The store drops its cached mapping of an array for another's; a tensor returned before
    holds its own reference to the mapping, which stays until that tensor is gone."""
    budget = N_LAYERS * ROWS // SHARD_ROWS  # (every array mapped back to back fits)
    path, ref = limited(budget, limit=budget + 5 + 1 + 5)
    st = acs.open_store(path)
    kept = st.rows("0.output", 0, ROWS)  # a view of the five shards mapped back to back
    part = st.rows("1.output", 16, 24)  # a view of one shard of another array
    for hp in ref:  # (each shard on its own, then all of them back to back in their place)
        for s in range(0, ROWS, SHARD_ROWS):
            assert torch.equal(st.rows(hp, s, s + 1), ref[hp][s:s + 1])
        assert torch.equal(st.rows(hp, 0, ROWS), ref[hp])
    assert st._n_mapped <= budget
    assert ("whole", st.attrs["arrays"]["0.output"]["path"]) not in st._mapped  # dropped from the cache
    assert not any(k == "shard" and "1.output/c/1/" in key for k, key in st._mapped)
    assert torch.equal(kept, ref["0.output"])
    assert torch.equal(part, ref["1.output"][16:24])
    assert _store_maps(path) <= budget + 5 + 1  # the cache's, and the two views' own
    del kept, part
    assert _store_maps(path) <= budget


@pytest.mark.parametrize("shuffle", [False, True], ids=["sequential", "shuffled"])
@pytest.mark.parametrize("budget", [32, 8, 3], ids=["whole-arrays", "per-shard", "fewer-than-an-array"])
def test_a_dataset_of_every_hook_point_reads_within_the_budget(limited, budget, shuffle):
    """One dataset of all the hook points, and one dataset of each in turn over the same
    opened store: a DataLoader epoch gives every row of every hook point, and the store's
    mappings (its own and the dataset's memo of them) stay within the budget."""
    whole = budget >= N_LAYERS * ROWS // SHARD_ROWS
    # (a batch of views holds a mapping of each hook point: of its 5 shards when mapped back to back)
    path, ref = limited(budget, limit=budget + N_LAYERS * (ROWS // SHARD_ROWS if whole else 1))
    st = acs.open_store(path)
    hps = list(ref)
    ds = acs.ActivationDataset(st, hook_points=hps)
    g = torch.Generator().manual_seed(1)
    for _epoch in range(2):
        seen = torch.zeros(ROWS, dtype=torch.bool)
        order = torch.randperm(ROWS, generator=g).tolist() if shuffle else list(range(ROWS))
        # (a sequential batch as a range: the dataset's read path of views; positions: its gather)
        batches = [order[s:s + 8] if shuffle else range(s, s + 8) for s in range(0, ROWS, 8)]
        loader = iter(torch.utils.data.DataLoader(ds, batch_sampler=batches))
        for i in batches:
            batch = next(loader)  # (not zip: its result tuple would keep the last batch)
            idx = torch.as_tensor(list(i))
            for hp in hps:
                assert torch.equal(batch[hp], ref[hp][idx]), hp
            seen[idx] = True
            del batch
            assert _store_maps(path) <= budget
            assert st._n_mapped <= budget
        assert bool(seen.all())
    for hp in hps:  # a dataset of each hook point in turn
        one = acs.ActivationDataset(st, hook_points=[hp])
        got = torch.cat([b[hp] for b in torch.utils.data.DataLoader(one, batch_size=8, shuffle=False)])
        assert torch.equal(got, ref[hp])
        idx = torch.randperm(ROWS, generator=g)[:24]
        assert torch.equal(one.get_batch(idx.tolist())[hp], ref[hp][idx])
        del got, one
        assert st._n_mapped <= budget
        assert _store_maps(path) <= budget


def test_the_default_budget_is_half_the_limit_less_what_is_held(monkeypatch, tmp_path):
    """Without a patched budget: half of vm.max_map_count less the mappings the process
    holds when the store first maps, never below _MIN_MAP_BUDGET."""
    monkeypatch.setattr(R, "_MAP_BUDGET", None)
    with open("/proc/sys/vm/max_map_count") as f:
        limit = int(f.read())
    with open("/proc/self/maps") as f:
        held = sum(1 for _ in f)
    got = R._default_map_budget()
    assert got >= R._MIN_MAP_BUDGET
    assert abs(got - max(R._MIN_MAP_BUDGET, limit // 2 - held)) <= 64  # (the process maps a few more meanwhile)


@pytest.mark.parametrize("shuffle", [False, True], ids=["sequential", "shuffled"])
def test_dataloader_workers_read_every_hook_point_within_the_budget(limited, shuffle):
    """Two forked DataLoader workers, each with the store reopened and its own budget (and the
    simulated limit: a worker's map past it raises, and the epoch with it)."""
    budget = 3
    path, ref = limited(budget, limit=budget + N_LAYERS)
    hps = list(ref)
    ds = acs.ActivationDataset(str(path), hook_points=hps)
    order = torch.randperm(ROWS, generator=torch.Generator().manual_seed(2)).tolist() if shuffle else list(range(ROWS))
    batches = [order[s:s + 8] for s in range(0, ROWS, 8)]
    loader = torch.utils.data.DataLoader(ds, batch_sampler=batches, num_workers=2, multiprocessing_context="fork")
    got = list(loader)
    assert len(got) == len(batches)
    for i, batch in zip(batches, got):
        for hp in hps:
            assert torch.equal(batch[hp], ref[hp][torch.as_tensor(i)]), hp


def test_the_rank_stores_of_an_uncommitted_multi_rank_store_share_its_budget(tmp_path, monkeypatch):
    """A store of rank stores not committed yet reads each rank's shards through a store of
    its own: together they keep the budget of one store (each keeping a whole budget, two
    ranks held twice the mappings, past vm.max_map_count when the budget is half of it)."""
    budget = 6
    monkeypatch.setattr(R, "_MAP_BUDGET", budget, raising=False)
    path = tmp_path / "tasks.zarr"
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(2)])
    refs = []
    for task in range(2):
        xs = [torch.randn(8, 64) for _ in range(ROWS // 8)]
        opts = {"chunk_rows": SHARD_ROWS, "shard_rows": SHARD_ROWS, "process_group": acs.RankStore(task, 2)}
        with torch.no_grad(), acs.ActivationScope(store=str(path), store_options=opts).track(model):
            for x in xs:
                model(x)
        with torch.no_grad():
            refs.append(model[0](torch.cat(xs)))
    st = acs.open_store(path)
    assert st.status == "incomplete" and st._ranks
    got = torch.cat([st.rows("0.output", s, s + 8) for s in range(0, 2 * ROWS, 8)])
    assert sorted(map(tuple, got.tolist())) == sorted(map(tuple, torch.cat(refs).tolist()))
    for hp in ("0.output", "1.output"):
        for s in range(0, 2 * ROWS, 8):
            st.rows(hp, s, s + 8)
            assert sum(rank._n_mapped for _, rank in st._ranks) <= budget


def test_the_unmap_callbacks_of_a_refresh_of_an_uncommitted_multi_rank_store_run_without_its_lock(tmp_path):
    """Store.on_unmap callbacks are called without the store's lock held, also when a refresh()
    closes the rank stores it read before (their mappings dropped)."""
    path = tmp_path / "tasks.zarr"
    model = torch.nn.Sequential(torch.nn.Linear(64, 64))
    for task in range(2):
        opts = {"chunk_rows": SHARD_ROWS, "shard_rows": SHARD_ROWS, "process_group": acs.RankStore(task, 2)}
        with torch.no_grad(), acs.ActivationScope(store=str(path), store_options=opts).track(model):
            model(torch.randn(ROWS, 64))
    st = acs.open_store(path)
    held = []
    st.on_unmap(lambda: held.append(st._lock._is_owned()))
    st.rows("0.output", 0, 8)  # (a shard of rank 0 mapped)
    st.refresh()
    assert held == [False]


@pytest.mark.parametrize("budget", [40, 8], ids=["whole-arrays", "per-shard"])
def test_stores_open_at_once_keep_one_budget_for_the_process(tmp_path, monkeypatch, budget):
    """vm.max_map_count is a limit of the process: four stores open at once (one per layer, a
    sweep over many) keep the budget together, the least recently used mapping dropped
    whichever store it is of. Before, each store kept a budget of its own (half of the limit
    each: two stores could use it all up, and the next map failed with ENOMEM)."""
    monkeypatch.setattr(R, "_MAP_BUDGET", budget)
    refs = [_capture(tmp_path / f"s{i}.zarr") for i in range(4)]
    gc.collect()
    stores = [acs.open_store(tmp_path / f"s{i}.zarr") for i in range(4)]
    kept = stores[0].rows("0.output", 16, 24)  # a view of one shard, held across all the reads
    for _ in range(2):
        for st, ref in zip(stores, refs):
            for hp, want in ref.items():
                assert torch.equal(st.rows(hp, 0, ROWS), want)
                for s in range(0, ROWS, 8):
                    assert torch.equal(st.rows(hp, s, s + 8), want[s:s + 8])
                assert sum(x._n_mapped for x in stores) <= budget
                assert _store_maps(tmp_path) <= budget + 1  # (and the kept view's own)
    assert torch.equal(kept, refs[0]["0.output"][16:24])
    del kept
    assert _store_maps(tmp_path) <= budget
    for st in stores:
        st.close()
    assert _store_maps(tmp_path) == 0


def test_a_store_let_go_of_without_close_leaves_the_budget_to_the_others(tmp_path, monkeypatch):
    """A store collected without close() takes its cached mappings with it: the budget they
    held is the other stores' again (not counted as held forever)."""
    monkeypatch.setattr(R, "_MAP_BUDGET", 8)
    ref = _capture(tmp_path / "a.zarr")
    _capture(tmp_path / "b.zarr")
    a = acs.open_store(tmp_path / "a.zarr")
    b = acs.open_store(tmp_path / "b.zarr")
    calls = []
    a.on_unmap(lambda: calls.append(1))
    for s in range(0, 3 * SHARD_ROWS, SHARD_ROWS):
        assert torch.equal(a.rows("0.output", s, s + 8), ref["0.output"][s:s + 8])
    for s in range(0, ROWS, SHARD_ROWS):  # (used after a's: a's would be dropped first)
        b.rows("0.output", s, s + 1)
    assert b._n_mapped == ROWS // SHARD_ROWS and a._n_mapped == 3 and calls == []
    del b
    gc.collect()
    for s in range(ROWS - SHARD_ROWS, -1, -SHARD_ROWS):  # (the shards a has not mapped yet first)
        assert torch.equal(a.rows("0.output", s, s + 8), ref["0.output"][s:s + 8])
    assert a._n_mapped == ROWS // SHARD_ROWS and calls == []  # (nothing of a's dropped for b's)


def test_stores_opened_and_let_go_of_without_mapping_leave_no_entry_behind(tmp_path):
    """The process-wide cache keeps an entry per open store, forgotten once the store is
    collected. It was forgotten only when some store next mapped a file: a process that opens
    stores it never maps (object storage, compressed arrays, a loop polling a running
    capture's progress) kept an entry for every store it ever opened. Now opening a store
    forgets those of the stores collected since."""
    _capture(tmp_path / "s.zarr")
    gc.collect()
    live = acs.open_store(tmp_path / "s.zarr")
    with R._MAPPINGS.lock:
        before = set(R._MAPPINGS.stores)
    for _ in range(50):
        st = acs.open_store(tmp_path / "s.zarr")
        assert st.n_samples == ROWS
        st.close()
        del st
    gc.collect()
    last = acs.open_store(tmp_path / "s.zarr")
    with R._MAPPINGS.lock:
        new = set(R._MAPPINGS.stores) - before
    assert new == {last._map_token}
    assert torch.equal(live.rows("0.output", 0, 2), last.rows("0.output", 0, 2))


def test_a_forked_child_counts_the_mappings_it_inherited(tmp_path, monkeypatch):
    """A forked child (a DataLoader worker) holds its parent's mappings too (fork copies them,
    and the parent's stores live on in the child): it counts them against its budget and drops
    them, least recently used first, for its own; its mappings of the stores' files stay
    within the budget."""
    import multiprocessing

    budget = 8
    monkeypatch.setattr(R, "_MAP_BUDGET", budget)
    ref = _capture(tmp_path / "s.zarr")
    gc.collect()
    parent = acs.open_store(tmp_path / "s.zarr")
    for s in range(0, ROWS, SHARD_ROWS):  # the parent's cache full
        for hp in list(ref)[:2]:
            parent.rows(hp, s, s + 1)
    assert parent._n_mapped == budget

    def child(queue):
        try:
            st = acs.open_store(tmp_path / "s.zarr")  # (as a worker reopens a dataset's store)
            most, right = 0, True
            for hp, want in ref.items():
                for s in range(0, ROWS, 8):
                    right = right and torch.equal(st.rows(hp, s, s + 8), want[s:s + 8])
                    most = max(most, _store_maps(tmp_path))
            queue.put((most, right, parent._n_mapped + st._n_mapped))
        except BaseException as e:  # (said to the test, not lost in the child)
            queue.put(repr(e))

    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    proc = ctx.Process(target=child, args=(queue,))
    proc.start()
    got = queue.get(timeout=120)
    proc.join(timeout=60)
    most, right, n_cached = got
    assert right
    assert n_cached <= budget
    assert most <= budget


def _rewrite(path, seed: int) -> dict:
    """Another run written in the place of the store at ``path`` (overwrite=True); its rows."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64))
    x = torch.randn(ROWS, 64)
    opts = {"chunk_rows": SHARD_ROWS, "shard_rows": SHARD_ROWS, "overwrite": True}
    with torch.no_grad(), acs.ActivationScope(store=str(path), store_options=opts).track(model):
        model(x)
    with torch.no_grad():
        return {"0.output": model(x)}


def test_a_refresh_that_finds_another_run_tells_the_unmap_callbacks(tmp_path):
    """refresh() of a store another run was written in place of drops every cached mapping (its
    files are not the new run's): a dataset holding views of them is told, as for any other
    drop. Before, they were dropped without a word, and the views kept held the mappings."""
    path = tmp_path / "s.zarr"
    _capture(path)
    st = acs.open_store(path)
    calls = []
    st.on_unmap(lambda: calls.append(st._n_mapped))
    st.rows("0.output", 0, 8)
    assert st._n_mapped == 1 and calls == []
    st.refresh()  # the same run: nothing dropped
    assert calls == []
    ref = _rewrite(path, seed=1)
    st.refresh()
    assert calls == [0]
    assert torch.equal(st.rows("0.output", 0, 8), ref["0.output"][:8])


def test_verify_tells_the_unmap_callbacks_of_the_mappings_it_drops(tmp_path, monkeypatch):
    """verify() maps shards to check them and drops them again: said to the on_unmap callbacks
    (a reader in another thread may have taken views of them meanwhile)."""
    monkeypatch.setattr(R, "_MAP_BUDGET", 8)  # (read per shard: the store's 30 shards do not fit)
    path = tmp_path / "s.zarr"
    _capture(path)
    st = acs.open_store(path)
    calls = []
    st.on_unmap(lambda: calls.append(1))
    before = dict(st._mapped)
    assert st.verify() == []
    assert calls and st._mapped == before


def test_a_commit_since_that_maps_an_array_again_tells_the_unmap_callbacks(tmp_path):
    """An array's shards mapped back to back are mapped again once a commit adds rows (a longer
    view): the mapping it replaces in the cache is said dropped, so that a dataset's views of it
    go too (held, they kept a mapping the budget no longer counts)."""
    from activationscope.store import StoreWriter

    data = torch.randn(4 * SHARD_ROWS, 64, generator=torch.Generator().manual_seed(0))
    w = StoreWriter(tmp_path / "s.zarr", chunk_rows=SHARD_ROWS, shard_bytes=SHARD_ROWS * 64 * 4)
    a = w.open_array("0.output", (64,), torch.float32, "sample")

    def commit_shard(s):
        a.append(data[s:s + SHARD_ROWS])
        w.add_batch(SHARD_ROWS, list(range(s, s + SHARD_ROWS)), None, None)
        w._core.drain()
        assert w.commit()

    try:
        commit_shard(0)
        commit_shard(SHARD_ROWS)
        st = acs.open_store(tmp_path / "s.zarr")
        calls = []
        st.on_unmap(lambda: calls.append(1))
        assert torch.equal(st.rows("0.output", 0, 2 * SHARD_ROWS), data[:2 * SHARD_ROWS])
        assert st._n_mapped == 2 and calls == []
        commit_shard(2 * SHARD_ROWS)
        st.refresh()
        assert torch.equal(st.rows("0.output", 0, 3 * SHARD_ROWS), data[:3 * SHARD_ROWS])
        assert st._n_mapped == 3 and calls == [1]
    finally:
        w.close()


def _file_maps(file: str) -> int:
    """How many of the process's mappings are of ``file``."""
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if line.rstrip("\n").endswith(" " + file))


def _shard_file(st, hp: str, k: int) -> str:
    meta = st.attrs["arrays"][hp]
    return str(st._backend.path(st._shard_index(meta, k).key))


@pytest.mark.parametrize("order", ["shard-then-read-ahead", "whole-then-read-back"])
def test_a_shard_file_is_mapped_once(tmp_path, monkeypatch, order):
    """A shard's own mapping and the array's shards mapped back to back (a read across shards,
    or the read-ahead of will_read) both held the file: two mappings of it at once, two of the
    budget. Now the array's mapping takes the shard's place in the cache, and a read of rows
    of one shard takes them from the array's mapping while the cache holds it."""
    monkeypatch.setattr(R, "_MAP_BUDGET", 1000)
    path = tmp_path / "s.zarr"
    ref = _capture(path)["0.output"]
    gc.collect()
    st = acs.open_store(path)
    first = _shard_file(st, "0.output", 0)
    if order == "shard-then-read-ahead":
        assert torch.equal(st.rows("0.output", 0, 8), ref[:8])  # shard 0 mapped on its own
        assert _file_maps(first) == 1
        st.will_read("0.output", 0, 8)  # the read-ahead past shard 0: the array's shards back to back
    else:
        assert torch.equal(st.rows("0.output", 0, ROWS), ref)  # the array's shards back to back
        st.will_read("0.output", 64, 72)
        st.will_read("0.output", 8, 16)  # (backwards: rows of shard 0 only)
        assert torch.equal(st.rows("0.output", 8, 16), ref[8:16])
    assert _file_maps(first) == 1
    assert st._n_mapped == ROWS // SHARD_ROWS
    assert torch.equal(st.rows("0.output", 40, 48), ref[40:48])
    assert _file_maps(first) == 1 and _file_maps(_shard_file(st, "0.output", 2)) == 1


_ARMED: list = []  # (test_a_fork_while_another_thread_holds_the_cache_lock: events set just before a fork)
if hasattr(os, "register_at_fork"):  # (registered after the reader's own: runs before it)
    os.register_at_fork(before=lambda: [e.set() for e in _ARMED])


def test_a_fork_while_another_thread_holds_the_cache_lock_leaves_it_free_in_the_child():
    """The lock of the process's mapping caches is held across fork: a fork while another
    thread holds it (a read in a prefetch thread as a DataLoader starts its workers) waits for
    it, and the child starts with it free and the caches whole. Before, the child could start
    with it held by a thread it does not have, and its first read hung."""
    import multiprocessing
    import threading

    held, go = threading.Event(), threading.Event()

    def hold():
        with R._MAPPINGS.lock:
            held.set()
            go.wait(timeout=60)  # (set just before the fork)

    t = threading.Thread(target=hold)
    t.start()
    assert held.wait(timeout=60)

    def child(queue):
        got = R._MAPPINGS.lock.acquire(timeout=10)
        queue.put(got)

    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    _ARMED.append(go)
    try:
        proc = ctx.Process(target=child, args=(queue,))
        proc.start()
    finally:
        _ARMED.remove(go)
        go.set()
        t.join(timeout=60)
    assert queue.get(timeout=60) is True
    proc.join(timeout=60)


def test_threads_reading_several_stores_keep_the_count_and_the_budget(tmp_path, monkeypatch):
    """Four threads, each reading its own store and a store they all share, per shard and
    whole arrays (each drops the others' mappings for its own): every read has the right
    rows, and once they are done the count of the process's cached mappings is what the
    stores hold, within the budget."""
    import threading

    budget = 40
    monkeypatch.setattr(R, "_MAP_BUDGET", budget)
    refs = [_capture(tmp_path / f"s{i}.zarr") for i in range(5)]
    gc.collect()
    stores = [acs.open_store(tmp_path / f"s{i}.zarr") for i in range(5)]
    wrong: list = []

    def read(i):
        try:
            for _ in range(3):
                for st, ref in ((stores[i], refs[i]), (stores[4], refs[4])):
                    for hp, want in ref.items():
                        for s in range(0, ROWS, 8):
                            if not torch.equal(st.rows(hp, s, s + 8), want[s:s + 8]):
                                wrong.append((i, hp, s))
                        if not torch.equal(st.rows(hp, 0, ROWS), want):
                            wrong.append((i, hp))
        except BaseException as e:  # (said to the test)
            wrong.append(repr(e))

    threads = [threading.Thread(target=read, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads)
    assert wrong == []
    with R._MAPPINGS.lock:
        mine = {slot: n for slot, n in R._MAPPINGS.lru.items() if slot[0] in {st._map_token for st in stores}}
        assert sum(mine.values()) == sum(st._n_mapped for st in stores) <= budget
        for st in stores:
            assert {(k, key): n for (token, k, key), n in mine.items() if token == st._map_token} == st._mapped
    assert _store_maps(tmp_path) <= budget


def test_two_readers_that_both_find_a_shard_unmapped_keep_one_mapping_of_it(tmp_path, monkeypatch):
    """Two threads that both find a shard not mapped yet both map it; the one that caches its
    mapping second takes the first one's instead of replacing it (its own is let go of): the
    file is mapped once, and nothing the first one returned is dropped from the cache."""
    monkeypatch.setattr(R, "_MAP_BUDGET", 1000)
    path = tmp_path / "s.zarr"
    ref = _capture(path)["0.output"]
    gc.collect()
    st = acs.open_store(path)
    calls = []
    st.on_unmap(lambda: calls.append(1))
    first = st.rows("0.output", 0, 8)
    real = R.Store._cached_mapping
    # (the second reader looked into the cache before the first one kept its mapping)
    monkeypatch.setattr(R.Store, "_cached_mapping", lambda self, kind, key: None)
    second = st.rows("0.output", 8, 16)
    monkeypatch.setattr(R.Store, "_cached_mapping", real)
    assert torch.equal(first, ref[:8]) and torch.equal(second, ref[8:16])
    assert _file_maps(_shard_file(st, "0.output", 0)) == 1
    assert first.untyped_storage().data_ptr() == second.untyped_storage().data_ptr()
    assert calls == [] and st._n_mapped == 1


def test_a_mapping_kept_in_place_of_a_second_one_is_marked_as_used(tmp_path, monkeypatch):
    """A reader that mapped a shard another thread had cached meanwhile uses the cached
    mapping: it is marked as the most recently used, and the next mapping past the budget
    drops the least recently used other one. Before, it kept its old place and was the next
    dropped, while in use."""
    monkeypatch.setattr(R, "_MAP_BUDGET", 3)
    path = tmp_path / "s.zarr"
    ref = _capture(path)["0.output"]
    gc.collect()
    st = acs.open_store(path)
    key = [st._shard_index(st.attrs["arrays"]["0.output"], k).key for k in range(4)]
    assert torch.equal(st.rows("0.output", 0, 8), ref[:8])  # shard 0, then 1, mapped
    assert torch.equal(st.rows("0.output", 16, 24), ref[16:24])
    real = R.Store._cached_mapping
    # (a reader that looked into the cache before another thread kept shard 0's mapping)
    monkeypatch.setattr(R.Store, "_cached_mapping", lambda self, kind, k: None)
    assert torch.equal(st.rows("0.output", 8, 16), ref[8:16])
    monkeypatch.setattr(R.Store, "_cached_mapping", real)
    assert set(st._mapped) == {("shard", key[0]), ("shard", key[1])}
    assert torch.equal(st.rows("0.output", 32, 40), ref[32:40])  # shard 2: within the budget
    assert torch.equal(st.rows("0.output", 48, 56), ref[48:56])  # shard 3: one dropped
    assert set(st._mapped) == {("shard", key[0]), ("shard", key[2]), ("shard", key[3])}
    st.close()


class _CountingLock:
    """A lock that counts how often it is taken (``with`` and ``acquire``)."""

    def __init__(self, lock):
        self.lock, self.n = lock, 0

    def acquire(self, *a, **kw):
        self.n += 1
        return self.lock.acquire(*a, **kw)

    def release(self):
        self.lock.release()

    def __enter__(self):
        self.acquire()
        return self

    def __exit__(self, *exc):
        self.release()


@pytest.mark.parametrize("order", ["sequential", "chunk_shuffled", "shuffled"])
def test_warm_dataset_batches_take_no_cache_lock_and_map_nothing(tmp_path, monkeypatch, order):
    """Once a dataset has read its rows, further batches of every order are served from the
    views it holds: they neither take the process's mapping-cache lock (one lock for every
    store of the process, which the DataLoader's batches would otherwise queue on) nor map
    a file, and read the stored rows."""
    from activationscope.data import ChunkShuffleBatchSampler, SequentialBatchSampler, ShuffledBatchSampler

    path = tmp_path / "s.zarr"
    ref = _capture(path)["0.output"]
    gc.collect()
    ds = acs.ActivationDataset(str(path), hook_points=["0.output"])
    sampler = {"sequential": lambda: SequentialBatchSampler(ds, batch_size=8),
               "chunk_shuffled": lambda: ChunkShuffleBatchSampler(ds, batch_size=8, seed=0),
               "shuffled": lambda: ShuffledBatchSampler(ds, batch_size=8, seed=0)}[order]
    for b in sampler():  # (the first epoch maps the layer)
        ds.__getitems__(b)
    counting = _CountingLock(R._MAPPINGS.lock)
    monkeypatch.setattr(R._MAPPINGS, "lock", counting)
    maps: list = []
    real_map = R.Store._map
    monkeypatch.setattr(R.Store, "_map", lambda self, *a, **kw: maps.append(a) or real_map(self, *a, **kw))
    n = 0
    for b in sampler():
        got = ds.__getitems__(b).data["0.output"]
        assert torch.equal(got, ref[torch.as_tensor(list(b))])
        n += 1
    assert n == ROWS // 8
    assert counting.n == 0 and maps == []


def test_a_collected_store_is_forgotten_without_python_code_run_by_the_collector(tmp_path):
    """The weak reference that forgets a collected store calls back into no Python code: a
    Ctrl-C delivered in a callback run by the garbage collector is printed and ignored (the
    capture it interrupted went on), and when the collector runs varies from run to run."""
    _capture(tmp_path / "s.zarr")
    st = acs.open_store(tmp_path / "s.zarr")
    with R._MAPPINGS.lock:
        ref = R._MAPPINGS.stores[st._map_token]
    assert ref.__callback__ is not None and not hasattr(ref.__callback__, "__code__")
    token = st._map_token
    del st
    gc.collect()
    acs.open_store(tmp_path / "s.zarr")
    with R._MAPPINGS.lock:
        assert token not in R._MAPPINGS.stores
