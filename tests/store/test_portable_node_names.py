"""Hook points whose names a Windows file name cannot hold (``a:b``, ``x?``, ``con``,
``nul.txt``, ``a.``, ``a `` -- a ``ModuleDict`` key, a TransformerLens hook point): their folders
escape what Windows refuses (FORMAT.md section 1), so that a store can be copied to a Windows
file system or a share macOS mounts from one. Before, the folders were named as the hook
points, and such a copy failed or lost them. Stores written before keep their folders:
they are read, and resumed, there.
"""

from __future__ import annotations

import os
import re

import pyarrow.parquet as pq
import pytest
import torch
import zarr

import activationscope as acs
from activationscope.data import export_parquet
from activationscope.store import StoreWriter, copy_store, open_store
from activationscope.store import _format as F

from hostile import _Mean

NAMES = ["a:b", "x?", "con", "nul.txt", "a.", "a ", 'q"<>|*', "tab\there", "AUX.output", "m.COM1.output"]

_DEVICE = re.compile(r"(con|prn|aux|nul|com[0-9¹²³]|lpt[0-9¹²³])", re.IGNORECASE)


def _windows_refuses(name: str) -> bool:
    """Whether Windows cannot make a file or folder of this name."""
    return (any(c in '<>:"|?*\\' or ord(c) < 32 for c in name) or name[-1] in ". "
            or _DEVICE.fullmatch(name.split(".", 1)[0].rstrip(" ")) is not None)


def _refused_entries(root) -> list[str]:
    out = []
    for dirpath, dirnames, files in os.walk(root):
        out += [os.path.relpath(os.path.join(dirpath, n), root) for n in dirnames + files if _windows_refuses(n)]
    return out


@pytest.mark.parametrize("hp, node", [
    ("a:b", "a%3Ab"), ("x?", "x%3F"), ("con", "%63on"), ("NUL.txt", "%4EUL.txt"), ("a.", "a%2E"), ("a ", "a%20"),
    ('q"<>|*', "q%22%3C%3E%7C%2A"), ("tab\there", "tab%09here"), ("Com7.output", "%43om7.output"),
    ("lpt¹", "%6Cpt¹"), ("m.con.output", "m.con.output"), ("console", "console"), ("a%3Ab", "a%253Ab"),
    ("..", "%2E%2E"), ("zarr.json", "zarr%2Ejson"),
])
def test_node_names_are_names_windows_can_hold(hp, node):
    assert F.node_name(hp) == node
    assert not _windows_refuses(node)


def _write(path, names, n=6):
    data = {hp: torch.arange(n * 3, dtype=torch.float32).view(n, 3) + 100 * i for i, hp in enumerate(names)}
    w = StoreWriter(path, chunk_rows=2, shard_rows=4)
    for hp in names:
        w.open_array(hp, (3,), torch.float32, "sample").append(data[hp])
    w.add_batch(n, list(range(n)), None, {})
    w.commit()
    for hp in names:
        w.add_reductions(hp, "mean", _Mean(data[hp].double().mean(0)))
    w.close()
    return data


def _same(path, data):
    st = open_store(path)
    assert sorted(st.hook_points) == sorted(data)
    group = zarr.open_group(str(path), mode="r")
    for hp, want in data.items():
        assert torch.equal(st[hp], want), hp
        assert torch.equal(st.reductions[hp]["mean"], want.double().mean(0)), hp
        # a plain Zarr reader, by the path the metadata gives
        assert torch.equal(torch.from_numpy(group[st.attrs["arrays"][hp]["path"]][:]), want), hp
    assert st.verify() == []
    st.close()


def test_a_store_of_such_hook_points_holds_only_names_windows_can_hold_and_reads_back(tmp_path):
    data = _write(tmp_path / "s.zarr", NAMES)
    assert _refused_entries(tmp_path / "s.zarr") == []
    _same(tmp_path / "s.zarr", data)
    copy_store(tmp_path / "s.zarr", tmp_path / "copy.zarr")
    assert _refused_entries(tmp_path / "copy.zarr") == []
    _same(tmp_path / "copy.zarr", data)
    out = export_parquet(str(tmp_path / "s.zarr"), tmp_path / "s.parquet")
    table = pq.read_table(out)
    for hp, want in data.items():
        assert torch.equal(torch.tensor(table.column(hp).to_pylist()), want), hp


def test_a_capture_of_module_dict_keys_windows_cannot_hold_reads_back(tmp_path):
    torch.manual_seed(0)
    keys = ["a:b", "x?", "con", "a "]
    model = torch.nn.ModuleDict({k: torch.nn.Linear(3, 2) for k in keys})
    x = torch.randn(5, 3)
    path = tmp_path / "s.zarr"

    class Sum(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.m = model

        def forward(self, x):
            return sum(layer(x) for layer in self.m.values())

    top = Sum()
    with torch.no_grad(), acs.ActivationScope(store=str(path)).track(top, include=["m.*"]):
        top(x)
    assert _refused_entries(path) == []
    st = open_store(path)
    with torch.no_grad():
        for k in keys:
            assert torch.equal(st[f"m.{k}.output"], model[k](x)), k
    assert st.verify() == []


def _before_the_escapes(hook_point: str) -> str:
    return F._shortened(F._whole_node_name(hook_point, portable=False), hook_point)


def test_a_store_written_before_the_escapes_reads_and_resumes_in_its_folders(tmp_path, monkeypatch):
    path = tmp_path / "s.zarr"
    with monkeypatch.context() as m:
        m.setattr(F, "node_name", _before_the_escapes)
        _write(path, NAMES[:6])
    assert sorted(os.listdir(path / "acts")) == sorted(["zarr.json", *NAMES[:6]])
    data = {hp: torch.arange(18, dtype=torch.float32).view(6, 3) + 100 * i for i, hp in enumerate(NAMES[:6])}
    _same(path, data)
    more = {hp: torch.full((4, 3), -1.0 - i) for i, hp in enumerate(NAMES[:6])}
    w = StoreWriter(path, resume=True)
    for hp in NAMES[:6]:
        w.open_array(hp, (3,), torch.float32, "sample").append(more[hp])
    w.add_batch(4, list(range(6, 10)), None, {})
    w.close()
    # the resumed rows went to each array's stored folder, not to a new one missing the rows before
    assert sorted(os.listdir(path / "acts")) == sorted(["zarr.json", *NAMES[:6]])
    st = open_store(path)
    for hp in NAMES[:6]:
        assert torch.equal(st[hp], torch.cat([data[hp], more[hp]])), hp
        assert torch.equal(st.reductions[hp]["mean"], data[hp].double().mean(0)), hp
    assert st.verify() == []


def test_a_resume_of_a_store_written_before_the_escapes_keeps_its_reductions_folders(tmp_path, monkeypatch):
    """A resume of a store written before the escapes wrote the hook points' reductions again
    into new folders (``reductions/a%3Ab``), leaving the stored ones (``reductions/a:b``)
    behind as empty groups naming the same hook point, which a copy to Windows still refused;
    FORMAT.md says reductions are resumed where they are. They now are."""
    path = tmp_path / "s.zarr"
    names = NAMES[:3]
    with monkeypatch.context() as m:
        m.setattr(F, "node_name", _before_the_escapes)
        data = _write(path, names)
    assert sorted(os.listdir(path / "reductions")) == sorted(["zarr.json", *names])
    more = {hp: torch.full((4, 3), -1.0 - i) for i, hp in enumerate(names)}
    w = StoreWriter(path, resume=True)
    for hp in names:
        w.open_array(hp, (3,), torch.float32, "sample").append(more[hp])
    w.add_batch(4, list(range(6, 10)), None, {})
    w.commit()
    for hp in names:
        w.add_reductions(hp, "mean", _Mean(torch.cat([data[hp], more[hp]]).double().mean(0)))
    w.close()
    assert sorted(os.listdir(path / "reductions")) == sorted(["zarr.json", *names])
    st = open_store(path)
    for hp in names:
        assert st.attrs["reductions"][hp]["mean"]["path"] == f"reductions/{hp}/mean", hp
        assert torch.equal(st.reductions[hp]["mean"], torch.cat([data[hp], more[hp]]).double().mean(0)), hp
    assert st.verify() == []
    # a store of the current rule writes its reductions in the escaped folders, as before
    data = _write(tmp_path / "new.zarr", names)
    assert sorted(os.listdir(tmp_path / "new.zarr" / "reductions")) == sorted(
        ["zarr.json", *(F.node_name(hp) for hp in names)])
