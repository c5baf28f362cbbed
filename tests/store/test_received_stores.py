"""Stores received from someone else: what copying, reading and resuming one does."""

from __future__ import annotations

import shutil

import pytest
import torch
from hostile import HP, edit_root, make_store, root

from activationscope.errors import StoreCorruptError, StoreError
from activationscope.store import copy_store, open_store


@pytest.mark.parametrize("overwrite", [False, True])
def test_copy_store_refuses_a_store_of_a_newer_format_version(tmp_path, overwrite):
    # copy_store knows which files make up a store of the versions it reads (temporary files are
    # left out, kept files taken instead of damaged ones): a newer version's copy could miss files
    src = tmp_path / "newer.zarr"
    make_store(src)
    edit_root(src, lambda a: a["format"].update(version=3))
    (src / "acts" / HP / "c" / "0" / "0.x.tmp").write_bytes(b"a newer writer's file")
    dst = tmp_path / "copy.zarr"
    old = None
    if overwrite:
        old = make_store(dst)
    before = sorted(p.relative_to(dst) for p in dst.rglob("*")) if overwrite else None
    with pytest.raises(StoreError, match=r"format version 3; this activationscope reads versions up to 2: upgrade "
                                         r"activationscope.*cp -a.*nothing was copied") as e:
        copy_store(src, dst, overwrite=overwrite)
    assert not isinstance(e.value, StoreCorruptError)
    if overwrite:  # the store there is left as it was
        assert sorted(p.relative_to(dst) for p in dst.rglob("*")) == before
        assert torch.equal(open_store(dst)[HP], old) and open_store(dst).verify() == []
    else:
        assert not dst.exists()


def test_copy_store_still_copies_the_versions_it_reads(tmp_path):
    src = tmp_path / "two.zarr"
    rows = make_store(src)
    edit_root(src, lambda a: a["format"].update(version=2))  # (version 1 is version 2 without its fields)
    copy_store(src, tmp_path / "copy.zarr")
    assert root(tmp_path / "copy.zarr")["attributes"]["activationscope"]["format"]["version"] == 2
    assert torch.equal(open_store(tmp_path / "copy.zarr")[HP], rows)
    shutil.rmtree(src)



def test_a_store_moved_under_an_open_reader_says_to_open_it_at_its_new_path(tmp_path):
    path = tmp_path / "s.zarr"
    rows = make_store(path)
    s = open_store(path)
    assert torch.equal(s.rows(HP, 0, 10), rows[:10])
    path.rename(tmp_path / "renamed.zarr")  # handed over: the folder renamed while it was open
    with pytest.raises(StoreError, match=r"s\.zarr' was removed or moved since it was opened .*if it was moved or "
                                         r"renamed, open it at its new path \(open_store\(new path\)") as e:
        s.rows(HP, 200, 210)
    assert not isinstance(e.value, StoreCorruptError)
    assert torch.equal(open_store(tmp_path / "renamed.zarr").rows(HP, 200, 210), rows[200:210])
