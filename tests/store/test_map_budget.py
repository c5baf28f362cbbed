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
    for hp in ref:
        assert torch.equal(st.rows(hp, 0, ROWS), ref[hp])
        for s in range(0, ROWS, SHARD_ROWS):
            assert torch.equal(st.rows(hp, s, s + 1), ref[hp][s:s + 1])
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
