"""A layer split over many shards reads as ONE zero-copy view (shards mapped back to back)."""

from __future__ import annotations

import torch

import activationscope as acs
from activationscope.capture import _native

_C = _native.load()


def _capture(path, n_batches=12, rows=512, d=384, **opts):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, d))
    xs = [torch.randn(rows, 32) for _ in range(n_batches)]
    with acs.ActivationScope(store=str(path), store_options={"shard_bytes": 256 << 10, **opts}).track(model):
        with torch.no_grad():
            for x in xs:
                model(x)
    with torch.no_grad():
        return torch.cat([model(x) for x in xs])


def _mapped_files(ptr: int) -> str:
    with open("/proc/self/maps") as f:
        for line in f:
            span, *rest = line.split()
            lo, hi = (int(v, 16) for v in span.split("-"))
            if lo <= ptr < hi:
                return rest[-1] if len(rest) >= 5 else ""
    return ""


def test_whole_layer_over_many_shards_is_one_view(tmp_path):
    ref = _capture(tmp_path / "s.zarr")
    store = acs.open_store(tmp_path / "s.zarr")
    shard_rows = store.attrs["arrays"]["0.output"]["shard_rows"]
    n_shards = -(-store.n_rows("0.output") // shard_rows)
    assert n_shards >= 8
    # the whole layer is one unit of zero-copy memory (one segment), not one per shard
    assert store.segments("0.output") == [0, store.n_rows("0.output")]
    whole = store["0.output"]
    assert torch.equal(whole, ref)
    # every shard's first row lies in the mapping of its own shard file, inside one tensor
    seg = list(range(0, store.n_rows("0.output"), shard_rows))
    for k in range(n_shards):
        row = whole[seg[k]]
        assert f"0.output/c/{k}/0" in _mapped_files(row.data_ptr())
    again = store["0.output", seg[1] - 3: seg[3] + 3]  # spans three shards: still a view
    assert again.data_ptr() == whole[seg[1] - 3].data_ptr()


def test_writing_into_the_whole_view_never_changes_the_files(tmp_path):
    ref = _capture(tmp_path / "s.zarr", n_batches=4)
    view = acs.open_store(tmp_path / "s.zarr")["0.output"]
    view.add_(1.0)
    assert torch.equal(acs.open_store(tmp_path / "s.zarr")["0.output"], ref)


def test_unaligned_rows_fall_back_to_one_copy(tmp_path):
    # 3 float32 per row and 7 rows per chunk: shards are not whole pages
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3))
    xs = [torch.randn(50, 4) for _ in range(6)]
    with acs.ActivationScope(store=str(tmp_path / "u.zarr"), store_options={"chunk_rows": 7, "shard_bytes": 7 * 12 * 2}).track(model):
        with torch.no_grad():
            for x in xs:
                model(x)
    with torch.no_grad():
        ref = torch.cat([model(x) for x in xs])
    store = acs.open_store(tmp_path / "u.zarr")
    assert torch.equal(store["0.output"], ref)
    # not one mapping: a segment per shard (views within a shard, a copy across)
    assert store.segments("0.output") == list(range(0, 300, 14)) + [300]


def test_map_files_contiguous_checks_its_input(tmp_path):
    import pytest

    a = tmp_path / "a"
    a.write_bytes(b"\x01" * 4096)
    b = tmp_path / "b"
    b.write_bytes(b"\x02" * 100)
    t = _C.map_files_contiguous([str(a), str(b)], 4096, 4096 + 100)
    assert t.shape == (4196,) and int(t[:4096].sum()) == 4096 and int(t[4096:].sum()) == 200
    with pytest.raises(acs.CaptureError, match="'.*b' holds 100 bytes"):
        _C.map_files_contiguous([str(a), str(b)], 4096, 4096 + 200)
    with pytest.raises(acs.CaptureError, match="multiple of"):
        _C.map_files_contiguous([str(a)], 1000, 100)
