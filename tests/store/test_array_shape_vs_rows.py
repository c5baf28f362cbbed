"""An array document's shape[0] against the rows its shards hold and the rows committed
(FORMAT.md section 9): a plain Zarr reader reads the document's shape, so a shape ahead of
the rows written reads fill values (zeros) as if they were data. ``verify`` names it; the
library's readers read the root's ``n_rows`` only; a resume writes the document down to its
committed rows before it deletes the shards past them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
import zarr

from activationscope import cli
from activationscope.data import ActivationDataset
from activationscope.store import StoreWriter, open_store

from hostile import CHUNK_ROWS, FEATURE, HP, N_ROWS, SHARD_ROWS, edit_root, make_store, root, set_index, shard

DOC = f"acts/{HP}/zarr.json"


def _shard_commits(path: Path) -> torch.Tensor:
    """``make_store``'s layout, committed once per shard (64 rows, one row-table part each, the
    shard durable before its commit). Returns the rows."""
    data = torch.randn(N_ROWS, FEATURE, generator=torch.Generator().manual_seed(0))
    w = StoreWriter(path, chunk_rows=CHUNK_ROWS, shard_bytes=SHARD_ROWS * FEATURE * 4)
    a = w.open_array(HP, (FEATURE,), torch.float32, "sample")
    for s in range(0, N_ROWS, SHARD_ROWS):
        a.append(data[s:s + SHARD_ROWS])
        w.add_batch(SHARD_ROWS, list(range(s, s + SHARD_ROWS)), None, {"label": torch.arange(s, s + SHARD_ROWS) % 3})
        w._core.drain()
        assert w.commit()
    w.close()
    return data


@pytest.fixture
def plain(tmp_path):
    path = tmp_path / "s.zarr"
    return path, make_store(path)


@pytest.fixture
def per_shard(tmp_path):
    path = tmp_path / "p.zarr"
    return path, _shard_commits(path)


def _set_doc_rows(path: Path, rows: int) -> None:
    p = path / DOC
    doc = json.loads(p.read_text())
    doc["shape"][0] = rows
    p.write_text(json.dumps(doc))


def _doc_rows(path: Path) -> int:
    return json.loads((path / DOC).read_text())["shape"][0]


def _killed_commit(path: Path, committed: int = 256, status: str = "incomplete") -> None:
    """The store as a commit killed after its array documents and before its root leaves it:
    the root lists ``committed`` rows (the first row-table parts, which must hold that many),
    the array document, manifest and shards hold all ``N_ROWS``."""
    parts = root(path)["attributes"]["activationscope"]["row_tables"]["sample"]["parts"]
    assert [pq.read_metadata(path / key).num_rows for key in parts] == [SHARD_ROWS] * (N_ROWS // SHARD_ROWS)
    kept = committed // SHARD_ROWS

    def edit(a):
        a["status"] = status
        a["n_samples"] = committed
        a["n_batches"] = kept
        a["arrays"][HP]["n_rows"] = committed
        t = a["row_tables"]["sample"]
        dropped = t["parts"][kept:]
        t["parts"] = t["parts"][:kept]
        for key in dropped:
            t["crc32c"].pop(key)
        t["n_rows"] = committed
    edit_root(path, edit)


def test_verify_names_a_shape_ahead_of_the_rows_held(plain, capsys):
    path, data = plain
    _set_doc_rows(path, N_ROWS + 80)
    s = open_store(path)
    problems = s.verify()
    assert len(problems) == 1
    assert f"array document {DOC} has shape[0] {N_ROWS + 80}" in problems[0]
    assert f"hold rows 0..{N_ROWS - 1} only (shard 5's file acts/{HP}/c/5/0 is missing" in problems[0]
    assert f"rows {N_ROWS}..{N_ROWS + 79}, never written, as fill values" in problems[0]
    assert f"set shape[0] in {DOC} to {N_ROWS}" in problems[0]
    code = cli.main(["verify", str(path)])
    err = capsys.readouterr().err
    assert code == 1 and f"shape[0] {N_ROWS + 80}" in err and "Traceback" not in err
    # what a plain Zarr reader reads: zeros past the rows written
    plain_rows = zarr.open_array(str(path / "acts" / HP), mode="r")[:]
    assert plain_rows.shape == (N_ROWS + 80, 8) and not plain_rows[N_ROWS:].any()
    # the library's readers read the committed rows only (the root's n_rows)
    assert torch.equal(s[HP], data)
    ds = ActivationDataset(path, HP)
    assert len(ds) == N_ROWS and torch.equal(ds[0:N_ROWS][HP], data)
    from activationscope.analysis.dask import to_dask

    assert np.array_equal(to_dask(path, HP).compute(), data.numpy())


def test_verify_accepts_a_killed_commit_whose_rows_are_held(per_shard):
    path, data = per_shard
    _killed_commit(path)
    s = open_store(path)
    assert s.verify() == [] and torch.equal(s[HP], data[:256])
    # a plain Zarr reader reads the 64 uncommitted rows as written
    assert np.array_equal(zarr.open_array(str(path / "acts" / HP), mode="r")[:], data.numpy())


def test_verify_names_a_killed_commit_missing_the_shard_past_the_committed_rows(per_shard):
    path, _ = per_shard
    _killed_commit(path)
    shard(path, 4).unlink()
    problems = open_store(path).verify()
    assert len(problems) == 1
    assert f"hold rows 0..255 only (shard 4's file acts/{HP}/c/4/0 is missing" in problems[0]
    assert f"rows 256..{N_ROWS - 1}, never written" in problems[0]


def test_verify_names_an_array_without_committed_rows_whose_document_holds_none(per_shard):
    path, _ = per_shard
    _killed_commit(path, committed=0)
    assert open_store(path).verify() == []  # its document and every shard are there
    shard(path, 0).unlink()
    problems = open_store(path).verify()
    assert len(problems) == 1 and f"has shape[0] {N_ROWS}, but its shards hold no rows" in problems[0]
    assert f"set shape[0] in {DOC} to 0" in problems[0]


def test_verify_names_a_complete_store_whose_shape_is_past_its_rows(per_shard):
    path, _ = per_shard
    _killed_commit(path, status="complete")
    problems = open_store(path).verify()
    assert len(problems) == 1
    assert f"has shape[0] {N_ROWS}, more than the 256 committed rows" in problems[0]
    assert "64 rows that were never committed and that no row table lists" in problems[0]


@pytest.mark.parametrize("resume_closes", [False, True])
def test_resume_writes_a_shape_ahead_down_before_it_deletes_shards(tmp_path, per_shard, resume_closes):
    path, data = per_shard
    _killed_commit(path)
    w = StoreWriter(path, resume=True)
    assert _doc_rows(path) == 256 and not shard(path, 4).exists()
    killed = tmp_path / "killed.zarr"  # the resume killed before its first commit
    shutil.copytree(path, killed, ignore=shutil.ignore_patterns(".activationscope-writer.lock"))
    if resume_closes:
        a = w.open_array(HP, (8,), torch.float32, "sample")
        a.append(data[256:288])
        w.add_batch(32, list(range(256, 288)), None, {"label": torch.arange(256, 288) % 3})
        w.close()
        s = open_store(path)
        assert s.verify() == [] and torch.equal(s[HP], data[:288]) and _doc_rows(path) == 288
    else:
        w.discard()
    for p in [killed] + ([] if resume_closes else [path]):
        s = open_store(p)
        assert s.verify() == [] and torch.equal(s[HP], data[:256])
        z = zarr.open_array(str(p / "acts" / HP), mode="r")
        assert z.shape == (256, 8) and np.array_equal(z[:], data[:256].numpy())


def test_a_shape_ahead_of_the_manifest_s_rows_end_is_held_when_the_shard_s_index_lists_the_chunks(per_shard):
    """The manifest's last shard ends (rows_end) before the document's shape[0], but the shard
    file's own index lists the chunks up to it: a plain Zarr reader reads those rows as written
    (a commit that failed between its shards and its manifests leaves the manifest of the
    earlier, shorter version of a rewritten last shard): not reported. Chunks the index lacks are."""
    path, _ = per_shard
    _killed_commit(path)
    p = path / "acts" / HP / "manifest.json"
    man = json.loads(p.read_text())
    man["shards"][4]["rows_end"] = 300
    p.write_text(json.dumps(man))
    assert open_store(path).verify() == []
    missing = 2**64 - 1
    set_index(path, 4, 3, missing, missing)
    problems = open_store(path).verify()
    assert len(problems) == 1
    assert f"hold rows 0..303 only (shard 4's file acts/{HP}/c/4/0 holds chunks up to row 304)" in problems[0]
    assert f"rows 304..{N_ROWS - 1}, never written" in problems[0]


def test_a_shard_the_manifest_does_not_list_yet_holds_the_chunks_its_index_lists(per_shard):
    """A commit writes its manifests and array documents together: killed between them, the
    document's shape may count the rows of a shard its manifest does not list yet. Those rows
    are written (the shard and its index are there): not reported; chunks the index lacks are."""
    path, data = per_shard
    _killed_commit(path)
    p = path / "acts" / HP / "manifest.json"
    man = json.loads(p.read_text())
    man["shards"] = man["shards"][:4]
    p.write_text(json.dumps(man))
    s = open_store(path)
    assert s.verify() == [] and torch.equal(s[HP], data[:256])
    missing = 2**64 - 1
    set_index(path, 4, 2, missing, missing)
    problems = open_store(path).verify()
    assert len(problems) == 1
    assert f"hold rows 0..287 only (shard 4's file acts/{HP}/c/4/0 holds chunks up to row 288)" in problems[0]
