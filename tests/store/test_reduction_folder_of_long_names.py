"""A store written before long hook point names were shortened (FORMAT.md section 1: a node
name over 128 UTF-8 bytes is cut and given a hash) keeps its arrays and reductions in the
folders of the whole name; it still opens and reads its reductions."""
from __future__ import annotations

import torch

from activationscope.store import StoreWriter, open_store
from activationscope.store import _format as F

from hostile import _Mean

LONG = "encoder." + "very_long_module_name_" * 7  # 162 bytes: shortened by node_name today


def _node_name_before_shortening(hook_point: str) -> str:
    out = hook_point.replace("%", "%25").replace("/", "%2F").replace("\\", "%5C").replace("\x00", "%00")
    if out.startswith("__"):
        out = "%5F" + out[1:]
    return out.replace(".", "%2E") if out in (".", "..") else out


def test_a_store_whose_long_hook_point_has_the_folders_of_its_whole_name_opens(tmp_path, monkeypatch):
    assert F.node_name(LONG) != _node_name_before_shortening(LONG)
    data = torch.randn(8, 4)
    with monkeypatch.context() as m:
        m.setattr(F, "node_name", _node_name_before_shortening)
        w = StoreWriter(tmp_path / "s.zarr")
        a = w.open_array(LONG, (4,), torch.float32, "sample")
        a.append(data)
        w.add_batch(8, list(range(8)), None, {})
        w.commit()
        w.add_reductions(LONG, "mean", _Mean(data.double().mean(0)))
        w.close()
    assert (tmp_path / "s.zarr" / "reductions" / LONG).is_dir()
    st = open_store(tmp_path / "s.zarr")
    assert torch.equal(st[LONG], data)
    assert torch.equal(st.reductions[LONG]["mean"], data.double().mean(0))
    assert st.verify() == []
