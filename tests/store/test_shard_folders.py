"""The writer thread makes a shard's folder (``c/<shard>``) when it opens the shard, while
the model runs, not when it finishes it (at the close every array's last shard finishes at
once: making a folder is a new inode, the slow part of a close on some file systems). The
stored rows, the verification and a discard must not see the difference."""

from __future__ import annotations

import os
import shutil

import torch

import activationscope as acs
from activationscope.cli import main as cli_main
from activationscope.store.writer import StoreWriter


def _options():
    return {"chunk_rows": 4, "shard_bytes": 16 * 8 * 4}  # rows of 8 float32: 16-row shards of 4-row chunks


def test_the_folder_of_an_open_shard_exists_before_the_shard_is_finished(tmp_path):
    path = tmp_path / "deep" / "er" / "s.zarr"  # parents made too
    w = StoreWriter(path, **_options())
    a = w.open_array("0.output", (8,), torch.float32, "sample")
    rows = torch.randn(20, 8)
    a.append(rows)  # shard 0 finished (16 rows), shard 1 open with one 4-row chunk
    w.add_batch(20)
    w._core.drain()
    assert (path / "acts/0.output/c/0/0").is_file()
    assert (path / "acts/0.output/c/1").is_dir() and not (path / "acts/0.output/c/1/0").exists()
    w.close()
    assert (path / "acts/0.output/c/1/0").is_file()
    assert torch.equal(acs.open_store(path)["0.output"], rows)
    assert cli_main(["verify", str(path)]) == 0


def test_a_shard_whose_folder_went_while_it_was_open_is_still_stored(tmp_path):
    path = tmp_path / "s.zarr"
    w = StoreWriter(path, **_options())
    a = w.open_array("0.output", (8,), torch.float32, "sample")
    rows = torch.randn(20, 8)
    a.append(rows)
    w.add_batch(20)
    w._core.drain()
    shutil.rmtree(path / "acts/0.output/c/1")  # the open shard's folder (its temporary file lives elsewhere)
    w.close()
    assert torch.equal(acs.open_store(path)["0.output"], rows)
    assert cli_main(["verify", str(path)]) == 0


def test_a_capture_into_a_store_is_unchanged_by_early_folders(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8))
    path = tmp_path / "s.zarr"
    xs = [torch.randn(7, 8) for _ in range(9)]  # 63 rows: 3 full shards and a partial one
    with torch.no_grad(), acs.ActivationScope(store=str(path), store_options=_options()).track(model):
        for x in xs:
            model(x)
    store = acs.open_store(path)
    x = torch.cat(xs)
    with torch.no_grad():
        assert torch.equal(store["0.output"], model[0](x))
        assert torch.equal(store["2.output"], model(x))
    shard_dirs = sorted(os.listdir(path / "acts/0.output/c"))
    assert shard_dirs == ["0", "1", "2", "3"]  # no folder of a shard that holds no row
    assert cli_main(["verify", str(path)]) == 0


def test_an_empty_shard_folder_left_by_a_killed_writer_is_ignored_by_readers_and_verify(tmp_path):
    path = tmp_path / "s.zarr"
    w = StoreWriter(path, **_options())
    rows = torch.randn(20, 8)
    w.open_array("0.output", (8,), torch.float32, "sample").append(rows)
    w.add_batch(20)
    w.close()
    (path / "acts/0.output/c/7").mkdir()  # as a writer killed right after opening shard 7 leaves it
    (path / "acts/0.output/c/8/0").mkdir(parents=True)  # (a shard key's folders of a 3-d array)
    store = acs.open_store(path)
    assert store.status == "complete" and torch.equal(store["0.output"], rows)
    assert cli_main(["verify", str(path)]) == 0
