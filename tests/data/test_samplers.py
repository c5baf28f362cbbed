"""Batch samplers: coverage, determinism, rank partitions, chunk locality."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from activationscope.data import (
    ChunkShuffleBatchSampler,
    SequentialBatchSampler,
    ShuffledBatchSampler,
    partition_bounds,
)

from activationscope.errors import ArgumentTypeError, ArgumentValueError

SAMPLERS = [SequentialBatchSampler, ShuffledBatchSampler, ChunkShuffleBatchSampler]


def _flat(sampler):
    return [i for batch in sampler for i in batch]


def test_sequential_yields_ranges_in_order():
    s = SequentialBatchSampler(10, 4)
    batches = list(s)
    assert batches == [range(0, 4), range(4, 8), range(8, 10)] and len(s) == 3
    assert list(SequentialBatchSampler(10, 4, drop_last=True)) == [range(0, 4), range(4, 8)]


@pytest.mark.parametrize("cls", SAMPLERS)
def test_every_row_once_and_deterministic(cls):
    s = cls(103, 10, seed=7)
    first = _flat(s)
    assert sorted(first) == list(range(103))
    assert _flat(cls(103, 10, seed=7)) == first
    assert len(list(s)) == len(s) == 11


@pytest.mark.parametrize("cls", [ShuffledBatchSampler, ChunkShuffleBatchSampler])
def test_epochs_and_seeds_change_the_order(cls):
    s = cls(500, 50, seed=1, **({"block_rows": 10, "buffer_rows": 100} if cls is ChunkShuffleBatchSampler else {}))
    e0 = _flat(s)
    s.set_epoch(1)
    e1 = _flat(s)
    assert e0 != e1 and sorted(e1) == list(range(500))
    s.set_epoch(0)
    assert _flat(s) == e0
    assert _flat(cls(500, 50, seed=2)) != _flat(cls(500, 50, seed=1))


@pytest.mark.filterwarnings("ignore:.*do not read the same number of batches per epoch")
@settings(max_examples=40, deadline=None)
@given(n=st.integers(0, 300), world=st.integers(1, 7), bs=st.integers(1, 40), epoch=st.integers(0, 3),
       which=st.sampled_from(SAMPLERS))
def test_ranks_partition_without_overlap_or_loss(n, world, bs, epoch, which):
    seen = []
    for rank in range(world):
        s = which(n, bs, seed=3, rank=rank, world_size=world)
        s.set_epoch(epoch)
        part = _flat(s)
        assert len(part) == s.n_rows()
        seen += part
    assert sorted(seen) == list(range(n))


@pytest.mark.parametrize("which", SAMPLERS)
@pytest.mark.parametrize("n, world, bs, drop_last", [
    (10, 3, 3, False), (11, 3, 3, True), (96, 3, 32, True), (97, 3, 32, False), (99, 4, 8, False), (12, 3, 3, False),
    (100, 4, 32, False), (0, 2, 4, False), (1, 2, 4, False),
])
def test_ranks_reading_unequal_numbers_of_batches_are_warned_of(which, n, world, bs, drop_last):
    # (parts of n // world and one more row straddling a multiple of batch_size gave one rank a
    # batch more than another, without a word: a DDP step on that batch waits forever)
    import warnings

    counts, warned = [], []
    for rank in range(world):
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            sampler = which(n, bs, rank=rank, world_size=world, drop_last=drop_last)
        warned.append([str(x.message) for x in w])
        counts.append(sum(1 for _ in sampler))
        assert counts[-1] == len(sampler)
    uneven = len(set(counts)) > 1
    for messages in warned:
        assert len(messages) == int(uneven), (counts, messages)
        if uneven:
            assert f"rank 0 reads {counts[0]}, rank {world - 1} reads {counts[-1]}" in messages[0]
            assert "Pass even=True for equal parts" in messages[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len({len(which(n, bs, rank=r, world_size=world, drop_last=drop_last, even=True)) for r in range(world)}) == 1


def test_even_parts_drop_only_the_remainder():
    sizes = []
    seen = []
    for rank in range(4):
        s = ShuffledBatchSampler(103, 5, rank=rank, world_size=4, even=True)
        part = _flat(s)
        sizes.append(len(part))
        seen += part
    assert sizes == [25] * 4 and len(set(seen)) == 100
    assert partition_bounds(103, 3, 4) == (77, 103)


def test_rank_defaults_and_validation():
    s = ShuffledBatchSampler(10, 2)
    assert (s.rank, s.world_size) == (0, 1)
    with pytest.raises(ValueError, match="rank must be an int in \\[0, 2\\), got 2"):
        ShuffledBatchSampler(10, 2, rank=2, world_size=2)
    with pytest.raises(ValueError, match="batch_size must be a positive int, got 0"):
        SequentialBatchSampler(10, 0)


def test_rank_defaults_follow_torch_distributed(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        s = ShuffledBatchSampler(10, 2)
        assert (s.rank, s.world_size) == (0, 1) and dist.is_initialized()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("which", [SequentialBatchSampler, ShuffledBatchSampler, ChunkShuffleBatchSampler])
def test_world_size_without_rank_is_refused_outside_a_process_group(which):
    # (rank defaulted to 0 with no process group: two processes given world_size=2 both read
    # part 0, the same rows, and no process read part 1)
    with pytest.raises(ArgumentValueError, match=r"world_size=2 was given without rank= and no torch.distributed "
                       r"process group is initialised.*pass rank= .*\[0, 2\)"):
        which(10, 2, world_size=2)
    assert (which(10, 2, world_size=1).rank, which(10, 2, world_size=torch.tensor(1)).world_size) == (0, 1)
    parts = [list(which(10, 2, rank=r, world_size=2)) for r in (0, 1)]
    assert sorted(i for p in parts for b in p for i in b) == list(range(10))


def test_world_size_without_rank_must_match_the_process_group(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        with pytest.raises(ArgumentValueError, match="world_size=2 was given without rank= and the torch.distributed "
                           "process group has 1 ranks"):
            ShuffledBatchSampler(10, 2, world_size=2)
        s = ShuffledBatchSampler(10, 2, world_size=1)
        assert (s.rank, s.world_size) == (0, 1)
    finally:
        dist.destroy_process_group()


def test_chunk_shuffle_is_local_and_mixes():
    n, block, buffer, bs = 1000, 50, 200, 20
    s = ChunkShuffleBatchSampler(n, bs, block_rows=block, buffer_rows=buffer, seed=0)
    order = _flat(s)
    assert sorted(order) == list(range(n))
    # every window of buffer_rows rows holds exactly buffer/block whole blocks
    for w in range(0, n, buffer):
        blocks = {i // block for i in order[w : w + buffer]}
        assert len(blocks) == buffer // block
    # each batch touches few blocks, but rows inside a window are mixed (not block-sorted)
    for batch in s:
        assert len({i // block for i in batch}) <= buffer // block
    assert order[:block] != sorted(order[:block])
    # the first window's blocks are not simply the first blocks
    assert {i // block for i in order[:buffer]} != set(range(buffer // block))


def test_chunk_shuffle_with_a_buffer_over_everything_is_a_full_permutation():
    s = ChunkShuffleBatchSampler(100, 100, block_rows=10, buffer_rows=1000, seed=5)
    (batch,) = list(s)
    # rows of one block spread over the whole epoch
    positions = [batch.index(i) for i in range(10)]
    assert max(positions) - min(positions) > 20


def test_chunk_shuffle_uses_dataset_block_boundaries():
    class Source:
        def __len__(self):
            return 30

        def block_boundaries(self):
            return torch.tensor([0, 5, 17, 30])

    s = ChunkShuffleBatchSampler(Source(), 30, buffer_rows=1, seed=0)
    assert s.block_starts.tolist() == [0, 5, 17] and s.block_sizes.tolist() == [5, 12, 13]
    (batch,) = list(s)
    # buffer_rows=1: each block is its own window, so every block is one contiguous run
    block_of = torch.bucketize(torch.tensor(batch), torch.tensor([5, 17]), right=True).tolist()
    runs = [b for k, b in enumerate(block_of) if k == 0 or block_of[k - 1] != b]
    assert sorted(runs) == [0, 1, 2]
    assert sorted(batch) == list(range(30))


def test_integer_arguments_take_numpy_and_torch_integers_and_refuse_the_rest():
    """numpy / 0-d torch integers (a batch size or rank computed with numpy) were refused as
    "must be a positive int, got np.int64(4)"; set_epoch(1.5) silently took epoch 1's order
    (and set_epoch("a") raised Python's bare ValueError)."""
    import numpy as np

    from activationscope.errors import ArgumentTypeError

    for S in (ShuffledBatchSampler, SequentialBatchSampler, ChunkShuffleBatchSampler):
        plain = S(10, 4, seed=3, rank=1, world_size=2)
        other = S(10, np.int64(4), seed=np.int64(3), rank=torch.tensor(1), world_size=np.int32(2))
        plain.set_epoch(2)
        other.set_epoch(np.int64(2))
        assert [list(b) for b in other] == [list(b) for b in plain] and other.epoch == 2
        for kw in ({"batch_size": 4.0}, {"seed": 1.5}, {"rank": True, "world_size": 2}, {"world_size": "2"},
                   {"batch_size": torch.tensor(True)}):
            with pytest.raises(ArgumentTypeError, match=next(iter(kw))):
                S(10, **{"batch_size": 4, **kw})
        for bad in (1.5, "a", True, torch.tensor(True)):  # (a bool tensor was taken as epoch 1)
            with pytest.raises(ArgumentTypeError, match="epoch must be an int"):
                plain.set_epoch(bad)
    with pytest.raises(ArgumentTypeError, match="buffer_rows"):
        ChunkShuffleBatchSampler(10, 4, buffer_rows=8.0)
    assert [list(b) for b in ChunkShuffleBatchSampler(10, 4, buffer_rows=np.int64(8), block_rows=np.int64(2))] == \
        [list(b) for b in ChunkShuffleBatchSampler(10, 4, buffer_rows=8, block_rows=2)]


@pytest.mark.parametrize("cls", [ShuffledBatchSampler, ChunkShuffleBatchSampler])
@pytest.mark.parametrize("seed", [2**64, 2**70 + 5, -(2**63) - 1])
def test_a_seed_beyond_64_bits_is_refused(cls, seed):
    # (it was taken modulo 2**64: seed 2**64 gave seed 0's permutation without a word)
    with pytest.raises(ArgumentValueError, match=r"seed must be an int in \[-2\*\*63, 2\*\*64\)"):
        cls(100, batch_size=10, seed=seed)


@pytest.mark.parametrize("cls", [ShuffledBatchSampler, ChunkShuffleBatchSampler])
def test_seeds_at_the_ends_of_the_range_give_other_orders(cls):
    orders = {s: [i for b in cls(100, batch_size=10, seed=s) for i in b] for s in (0, 1, 2**64 - 1, -(2**63))}
    assert all(sorted(o) == list(range(100)) for o in orders.values())
    assert len({tuple(o) for o in orders.values()}) == 4


@pytest.mark.parametrize("which", [SequentialBatchSampler, ShuffledBatchSampler, ChunkShuffleBatchSampler])
def test_a_row_count_takes_numpy_and_torch_integers_and_refuses_the_rest(which):
    # (a numpy or 0-d torch count raised Python's bare "has no len()", True was taken as one
    # row, and a negative count failed in len() or torch.arange with no word of the argument)
    import numpy as np

    from activationscope.errors import ArgumentTypeError

    plain = [list(b) for b in which(5, 2, seed=1)]
    assert plain and sorted(i for b in plain for i in b) == [0, 1, 2, 3, 4]
    for count in (np.int64(5), torch.tensor(5), np.array(5)):
        assert [list(b) for b in which(count, 2, seed=1)] == plain
    for bad in (True, 5.0, torch.tensor(True), None):
        with pytest.raises(ArgumentTypeError, match=r"data_source \(a dataset, or a number of rows\) must be"):
            which(bad, 2)
    with pytest.raises(ArgumentValueError, match=r"data_source \(a dataset, or a number of rows\) must be an int >= 0, got -5"):
        which(-5, 2)


@pytest.mark.parametrize("args, error, match", [
    ((10, 3, 2), ValueError, r"rank must be an int in \[0, 2\), got 3"),
    ((10, -1, 2), ValueError, r"rank must be an int in \[0, 2\), got -1"),
    ((10, 0, 0), ValueError, "world_size must be a positive int, got 0"),
    ((-5, 0, 2), ValueError, "n must be an int >= 0, got -5"),
    ((10, True, 2), TypeError, "rank must be an int, got True"),
    ((10.0, 0, 2), TypeError, "n must be an int"),
])
def test_partition_bounds_refuses_arguments_that_give_no_part_of_the_positions(args, error, match):
    with pytest.raises(error, match=match):
        partition_bounds(*args)  # (rank 3 of 2 gave (15, 20), outside [0, 10), without an error)


def test_partition_bounds_cover_the_positions():
    assert [partition_bounds(10, r, 3) for r in range(3)] == [(0, 3), (3, 6), (6, 10)]
    assert [partition_bounds(10, r, 3, even=True) for r in range(3)] == [(0, 3), (3, 6), (6, 9)]
    assert partition_bounds(np.int64(10), torch.tensor(1), 2) == (5, 10)


@pytest.mark.parametrize("which", [SequentialBatchSampler, ShuffledBatchSampler, ChunkShuffleBatchSampler])
@pytest.mark.parametrize("flag", ["drop_last", "even"])
def test_flags_take_a_bool_only(which, flag):
    # drop_last="no" (a true string) dropped the short last batch without a word
    with pytest.raises(ArgumentTypeError, match=f"{flag} must be True or False, got 'no'"):
        which(10, 3, **{flag: "no"})
    assert getattr(which(10, 3, **{flag: np.bool_(True)}), flag) is True
    with pytest.raises(ArgumentTypeError, match="even must be True or False, got 'no'"):
        partition_bounds(10, 0, 3, even="no")


def _chunk_shuffle_batches_from_whole_order(s):
    """The batches of a ChunkShuffleBatchSampler computed from the whole epoch's order at once
    (the order of every row, then this rank's part of it, then batches)."""
    g = torch.Generator().manual_seed(__import__("activationscope.data.samplers", fromlist=["_mix_seed"])
                                      ._mix_seed(s.seed, s.epoch, salt=1))
    if s.n == 0:
        return []
    perm = torch.randperm(s.block_starts.numel(), generator=g)
    starts, sizes = s.block_starts[perm], s.block_sizes[perm]
    rows = torch.repeat_interleave(starts - torch.cumsum(sizes, 0) + sizes, sizes) + torch.arange(s.n)
    order, pos, acc, win = torch.empty_like(rows), 0, 0, 0
    for size in sizes.tolist():
        acc, pos = acc + size, pos + size
        if acc >= s.buffer_rows or pos == s.n:
            order[win:pos] = rows[win:pos][torch.randperm(pos - win, generator=g)]
            win, acc = pos, 0
    a, b = partition_bounds(s.n, s.rank, s.world_size, s.even)
    part, stop = order[a:b], len(s) * s.batch_size
    return [part[i:i + s.batch_size].tolist() for i in range(0, min(stop, b - a), s.batch_size)]


@pytest.mark.filterwarnings("ignore:ChunkShuffleBatchSampler. the . ranks do not read")
@settings(max_examples=150, deadline=None)
@given(n=st.integers(0, 300), bs=st.integers(1, 40), block=st.integers(1, 60), buffer=st.integers(1, 120),
       world=st.integers(1, 4), rank=st.integers(0, 3), drop_last=st.booleans(), even=st.booleans(),
       epoch=st.integers(0, 3))
def test_chunk_shuffle_batches_built_per_window_are_those_of_the_whole_order(n, bs, block, buffer, world, rank,
                                                                           drop_last, even, epoch):
    # (the batches are now cut from one window at a time: the same batches, every part of every rank)
    s = ChunkShuffleBatchSampler(n, bs, block_rows=block, buffer_rows=buffer, seed=3, rank=rank % world,
                                 world_size=world, drop_last=drop_last, even=even)
    s.set_epoch(epoch)
    assert list(s) == _chunk_shuffle_batches_from_whole_order(s)


class _Shards:
    """A source of ``n`` rows whose shards hold ``sizes`` rows (0 for an empty shard), as
    :meth:`ActivationDataset.block_boundaries` gives them."""

    def __init__(self, sizes):
        self.bounds = torch.tensor([0, *np.cumsum(sizes).tolist()], dtype=torch.int64)

    def __len__(self):
        return int(self.bounds[-1])

    def block_boundaries(self):
        return self.bounds


@pytest.mark.filterwarnings("ignore:ChunkShuffleBatchSampler. the . ranks do not read")
@settings(max_examples=150, deadline=None)
@given(sizes=st.lists(st.integers(0, 40), min_size=2, max_size=12), bs=st.integers(1, 30), buffer=st.integers(1, 90),
       world=st.integers(1, 4), rank=st.integers(0, 3), drop_last=st.booleans(), even=st.booleans(),
       seed=st.integers(0, 2**64 - 1), epoch=st.integers(0, 3))
def test_chunk_shuffle_batches_of_shards_of_unequal_sizes_are_those_of_the_whole_order(sizes, bs, buffer, world, rank,
                                                                                   drop_last, even, seed, epoch):
    # (shards of a store differ in size, and a shard may be empty: a window then closes
    # between blocks of any size, and an empty block adds none)
    s = ChunkShuffleBatchSampler(_Shards(sizes), bs, buffer_rows=buffer, seed=seed, rank=rank % world,
                                 world_size=world, drop_last=drop_last, even=even)
    s.set_epoch(epoch)
    assert list(s) == _chunk_shuffle_batches_from_whole_order(s)


def test_chunk_shuffle_first_batch_needs_one_window_not_the_whole_epoch():
    # The whole order of an epoch was built before the first batch: 8 bytes a row (400 MB
    # and 18 s for 50 million token rows, 8 GB for a billion). Of 2**40 rows that cannot be
    # allocated; one window of 2**16 rows can.
    s = ChunkShuffleBatchSampler(2**40, 1000, block_rows=2**20, buffer_rows=2**16, seed=0)
    it = iter(s)
    first, second = next(it), next(it)
    assert len(first) == len(second) == 1000 and len(set(first + second)) == 2000
    # both from the first window, which is one block of 2**20 rows
    assert len({i >> 20 for i in first + second}) == 1
    r = ChunkShuffleBatchSampler(2**40, 1000, block_rows=2**20, buffer_rows=2**16, seed=0, rank=1, world_size=2**20)
    assert len(next(iter(r))) == 1000


@pytest.fixture(scope="module")
def pinned_sources(tmp_path_factory):
    """The sources of the pinned orders: a row count, shards of unequal sizes (empty ones
    included), a store of 48-row shards, and a selection of its rows (blocks of 23 / 24)."""
    from activationscope.data import ActivationDataset
    from activationscope.store import StoreWriter

    path = tmp_path_factory.mktemp("pinned") / "s.zarr"
    w = StoreWriter(path, chunk_rows=8, shard_rows=48)
    w.open_array("x", (2,), torch.float32, "sample").append(torch.zeros(1000, 2))
    w.add_batch(1000)
    w.close()
    return {"int": 10007, "shards": _Shards([300, 0, 17, 1200, 5, 900, 0, 64, 2000, 1]),
            "store": ActivationDataset(path), "store_rows": ActivationDataset(path, rows=list(range(3, 990, 2)))}


_LAST_SEED = 2**64 - 1
PINNED_ORDERS = [
    # (source, sampler, arguments, epoch, sha256 of the batches' reprs in turn, its first 16 hex digits)
    ("int", ChunkShuffleBatchSampler, dict(batch_size=37, buffer_rows=500, seed=5), 0, "46e4a4981bdb80a3"),
    ("int", ChunkShuffleBatchSampler, dict(batch_size=37, block_rows=40, buffer_rows=130, rank=1, world_size=3, seed=11),
     0, "dd300db94a223161"),
    ("int", ChunkShuffleBatchSampler, dict(batch_size=64, buffer_rows=500, drop_last=True, seed=_LAST_SEED), 1,
     "369976618323433b"),
    ("shards", ChunkShuffleBatchSampler, dict(batch_size=37, buffer_rows=500, seed=5), 1, "f9c7862a0493ef53"),
    ("shards", ChunkShuffleBatchSampler, dict(batch_size=37, buffer_rows=1, seed=5), 1, "9133adf9557ea826"),
    ("shards", ChunkShuffleBatchSampler, dict(batch_size=50, buffer_rows=500, even=True, rank=2, world_size=3, seed=11),
     1, "afb2a4134e7dd2ca"),
    ("shards", ChunkShuffleBatchSampler, dict(batch_size=64, block_rows=40, buffer_rows=130, drop_last=True,
                                             seed=_LAST_SEED), 0, "532d09aece6f39ae"),
    ("store", ChunkShuffleBatchSampler, dict(batch_size=37, seed=5), 0, "8b1f8395fe86fe73"),
    ("store", ChunkShuffleBatchSampler, dict(batch_size=37, block_rows=40, buffer_rows=130, seed=5), 0, "8560827cb0d27094"),
    ("store", ChunkShuffleBatchSampler, dict(batch_size=37, buffer_rows=500, rank=1, world_size=3, seed=11), 1,
     "8a428e0568e1dd93"),
    ("store_rows", ChunkShuffleBatchSampler, dict(batch_size=37, buffer_rows=500, seed=5), 0, "6b53076526130ecc"),
    ("store_rows", ChunkShuffleBatchSampler, dict(batch_size=50, block_rows=40, buffer_rows=130, even=True, rank=2,
                                                 world_size=3, seed=11), 1, "dd85a887c9e8dc70"),
    ("store", ShuffledBatchSampler, dict(batch_size=37, seed=5), 0, "4ebf0c7f5f397401"),
    ("int", ShuffledBatchSampler, dict(batch_size=37, rank=1, world_size=3, seed=11), 1, "71796f856d6afa58"),
]


@pytest.mark.filterwarnings("ignore:.*do not read the same number of batches per epoch")
@pytest.mark.parametrize("source, cls, kwargs, epoch, digest", PINNED_ORDERS)
def test_orders_are_those_pinned(pinned_sources, source, cls, kwargs, epoch, digest):
    # The batches of a seed and epoch, as computed before the window building was rewritten
    # (numpy passes, one list per window): a faster sampler must yield the same lists.
    s = cls(pinned_sources[source], **kwargs)
    s.set_epoch(epoch)
    h = hashlib.sha256()
    for batch in s:
        assert type(batch) is list
        h.update(repr(batch).encode())
    assert h.hexdigest()[:16] == digest
