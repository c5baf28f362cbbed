"""A store written before long hook point names were shortened (FORMAT.md section 1: a node
name over 128 UTF-8 bytes is cut and given a hash) keeps its arrays and reductions in the
folders of the whole name; it still opens, reads its reductions and resumes there; as does one holding a hook point folding to
zarr.json (`Zarr.JSON`) written before such names were escaped."""
from __future__ import annotations

import pytest
import torch

from activationscope.errors import StoreError
from activationscope.store import StoreWriter, open_store
from activationscope.store import _format as F

from hostile import _Mean

LONG = "encoder." + "very_long_module_name_" * 7  # 162 bytes: shortened by node_name today


def _node_name_before_shortening(hook_point: str) -> str:
    out = hook_point.replace("%", "%25").replace("/", "%2F").replace("\\", "%5C").replace("\x00", "%00")
    if out.startswith("__"):
        out = "%5F" + out[1:]
    return out.replace(".", "%2E") if out in (".", "..") else out


@pytest.mark.parametrize("hp", [LONG, "Zarr.JSON"])
def test_a_store_written_before_the_name_was_shortened_or_escaped_opens_with_its_reductions(tmp_path, monkeypatch, hp):
    # a long name's folders were its whole name; 'Zarr.JSON' was a folder of its own on a
    # case-sensitive file system before such names became 'Zarr%2EJSON': its reductions there
    # are still its own
    assert F.node_name(hp) != _node_name_before_shortening(hp)
    data = torch.randn(8, 4)
    with monkeypatch.context() as m:
        m.setattr(F, "node_name", _node_name_before_shortening)
        w = StoreWriter(tmp_path / "s.zarr")
        w.open_array(hp, (4,), torch.float32, "sample").append(data)
        w.add_batch(8, list(range(8)), None, {})
        w.commit()
        w.add_reductions(hp, "mean", _Mean(data.double().mean(0)))
        w.close()
    assert (tmp_path / "s.zarr" / "reductions" / hp).is_dir()
    st = open_store(tmp_path / "s.zarr")
    assert torch.equal(st[hp], data)
    assert torch.equal(st.reductions[hp]["mean"], data.double().mean(0))
    assert st.verify() == []


@pytest.mark.parametrize("hp", ["Zarr.JSON", LONG])
def test_a_resume_of_a_store_written_before_the_name_was_escaped_or_shortened_appends_to_its_folder(
        tmp_path, monkeypatch, hp):
    # the resumed rows go to the array's stored folder ('acts/Zarr.JSON', the long name whole), not a
    # new one ('acts/Zarr%2EJSON', the shortened name) missing the rows committed before
    data = torch.randn(12, 4)
    with monkeypatch.context() as m:
        m.setattr(F, "node_name", _node_name_before_shortening)
        w = StoreWriter(tmp_path / "s.zarr", chunk_rows=2, shard_rows=4)
        w.open_array(hp, (4,), torch.float32, "sample").append(data[:6])
        w.add_batch(6, list(range(6)), None, {})
        w.close()
    w = StoreWriter(tmp_path / "s.zarr", resume=True)
    w.open_array(hp, (4,), torch.float32, "sample").append(data[6:])
    w.add_batch(6, list(range(6, 12)), None, {})
    w.close()
    st = open_store(tmp_path / "s.zarr")
    assert (tmp_path / "s.zarr" / "acts" / hp).is_dir() and not (tmp_path / "s.zarr" / "acts" / F.node_name(hp)).exists()
    assert torch.equal(st[hp], data)
    assert st.verify() == []


def test_a_hook_point_spelled_as_another_s_shortened_folder_name_is_refused(tmp_path):
    """A long hook point's folder is its first 100 bytes, '~' and a hash; a second hook point
    spelled exactly so had the same folder, its shards over the first's, without a word."""
    long_name = "m" * 300 + ".output"
    node = F.node_name(long_name)
    assert node != long_name and len(node.encode()) <= F.MAX_NODE_BYTES
    w = StoreWriter(tmp_path / "s.zarr")
    w.open_array(long_name, (3,), torch.float32, "sample")
    with pytest.raises(StoreError, match=r"would share one folder 'acts/m+~[0-9a-f]{16}'.*exclude_hook_points"):
        w.open_array(node, (3,), torch.float32, "sample")
    w.open_array("other.output", (3,), torch.float32, "sample")  # (the writer goes on)
    w.close()
