"""Shuffled batches of a compressed store (a shuffled or chunk-shuffled batch sampler, or
``get_batch`` of positions): each row is copied once out of the store's cached decoded chunks
(``Store.take``), no chunk copied whole per batch; every batch equals plain PyTorch indexing
of the written rows."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch
from torch.utils.data import DataLoader

from activationscope.data import ActivationDataset, ChunkShuffleBatchSampler, ShuffledBatchSampler
from activationscope.data.dataset import collate
from activationscope.store import StoreWriter
from activationscope.store import reader as R

N = 200


@pytest.fixture
def store(tmp_path):
    g = torch.Generator().manual_seed(0)
    ref = {"a": torch.randn(N, 8, generator=g), "b": torch.randn(N, 3, 2, generator=g).to(torch.bfloat16),
           "label": torch.arange(N) % 3}
    path = tmp_path / "s.zarr"
    w = StoreWriter(path, compression="zstd", chunk_rows=8, shard_rows=32)
    arrays = {hp: w.open_array(hp, tuple(ref[hp].shape[1:]), ref[hp].dtype, "sample") for hp in ("a", "b")}
    for s in range(0, N, 40):
        for hp, arr in arrays.items():
            arr.append(ref[hp][s:s + 40])
        w.add_batch(40, list(range(s, s + 40)), None, {"label": ref["label"][s:s + 40]})
        w.commit()
    w.close()
    return str(path), ref


def _check(got: dict, ref: dict, batch: list[int]) -> None:
    assert torch.equal(got["a"], ref["a"][batch])
    assert got["b"].dtype == torch.bfloat16 and torch.equal(got["b"].view(torch.int16), ref["b"][batch].view(torch.int16))
    assert torch.equal(got["label"], ref["label"][batch])


def test_shuffled_batches_copy_their_rows_only(store, monkeypatch):
    """Before, a batch of positions read each chunk it touched whole (``rows`` of the chunk,
    one copy of it) and picked its rows from that copy: a chunk-shuffled batch of 1 KiB rows
    copied about 64 MiB (64 chunks of 1 MiB) for its 256 KiB of rows."""
    path, ref = store
    ds = ActivationDataset(path, hook_points=["a", "b"], columns=["label"])
    whole = []
    real = R.Store._read_decoded
    monkeypatch.setattr(R.Store, "_read_decoded",
                        lambda self, hp, meta, a, b: whole.append((hp, a, b)) or real(self, hp, meta, a, b))
    for sampler in (ChunkShuffleBatchSampler(ds, 16, buffer_rows=64, seed=1), ShuffledBatchSampler(ds, 16, seed=2)):
        for batch in sampler:
            _check(collate(ds.__getitems__(batch)), ref, batch)
            _check(ds.get_batch(torch.tensor(batch)), ref, batch)
    assert whole == []  # (no chunk read whole for a batch)
    assert torch.equal(ds[5:20]["a"], ref["a"][5:20])  # a contiguous batch is still a read of its span
    assert whole


def test_a_dataloader_of_forked_workers_reads_shuffled_batches(store):
    path, ref = store
    ds = ActivationDataset(path, hook_points=["a", "b"], columns=["label"])
    _check(ds.get_batch([3, 100, 7]), ref, [3, 100, 7])  # the parent decodes before the workers fork
    sampler = ChunkShuffleBatchSampler(ds, 24, buffer_rows=64, seed=0)
    loader = DataLoader(ds, batch_sampler=sampler, num_workers=2, multiprocessing_context=mp.get_context("fork"))
    seen = []
    for batch, rows in zip(loader, list(sampler)):
        _check(batch, ref, rows)
        seen += rows
    assert sorted(seen) == list(range(N))
