"""Default chunk / shard layout: every array completes shards within MAX_SHARD_ROWS rows, so
commits come at a steady pace whatever the row size; chunks stay whole pages."""

from __future__ import annotations

import math
import queue
import time

import pytest
import torch

import activationscope as acs
from activationscope.store import _format as F


@pytest.mark.parametrize("feature_shape", [(), (1,), (3,), (4,), (7,), (384,), (768,), (4096,), (2, 5)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8", "float64"])
def test_default_shards_hold_at_most_max_shard_rows(feature_shape, dtype):
    chunk_rows, shard_chunks = F.chunk_layout(feature_shape, dtype, None, None)
    shard_rows = chunk_rows * shard_chunks
    row_bytes = math.prod(feature_shape) * F.itemsize(dtype)
    assert 1 <= shard_rows <= F.MAX_SHARD_ROWS
    assert shard_chunks <= F.MAX_SHARD_CHUNKS
    assert shard_rows * row_bytes <= F.DEFAULT_SHARD_BYTES
    # whole 4 KiB pages per chunk where the row size allows (shards then map back to back)
    page_rows = F.PAGE_BYTES // math.gcd(row_bytes, F.PAGE_BYTES)
    if page_rows <= F.MAX_SHARD_ROWS and row_bytes <= F.DEFAULT_CHUNK_BYTES:
        assert (chunk_rows * row_bytes) % F.PAGE_BYTES == 0, (chunk_rows, row_bytes)
    # narrow rows: a shard is a good fraction of the cap, not a handful of rows
    if row_bytes <= 64:
        assert shard_rows >= F.MAX_SHARD_ROWS // 2


def test_explicit_sizes_are_taken_as_given():
    # an explicit shard_bytes has no row cap; an explicit chunk_rows stays as asked
    assert F.chunk_layout((1,), "float32", None, 1 << 20) == (65536, 4)
    assert F.chunk_layout((1,), "float32", 100, 4000) == (100, 10)
    chunk_rows, shard_chunks = F.chunk_layout((1,), "float32", 1000, None)
    assert chunk_rows == 1000 and chunk_rows * shard_chunks <= F.MAX_SHARD_ROWS


def test_narrow_array_no_longer_holds_back_commits(tmp_path):
    """One array of 1-float rows next to a wider one: samples are committed during the
    capture (before the fix, the narrow array's first 64 MiB shard needed 16M rows)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(2, 64), torch.nn.Linear(64, 1)).eval()
    path = tmp_path / "s.zarr"
    n_rows, batch = 3 * F.MAX_SHARD_ROWS, 4096
    xs = torch.randn(n_rows, 2)
    with torch.no_grad():
        ref = model(xs)
    with acs.ActivationScope(store=str(path)).track(model) as tr:
        with torch.no_grad():
            for i in range(0, n_rows, batch):
                model(xs[i:i + batch])
        deadline = time.monotonic() + 10
        # the writer thread commits shards as it completes them: wait for the first two
        while tr.writer.n_samples_committed < 2 * F.MAX_SHARD_ROWS and time.monotonic() < deadline:
            tr.writer.commit()
            time.sleep(0.01)
        mid = acs.open_store(path)  # what a capture killed now would keep
        assert mid.status == "incomplete"
        assert mid.n_samples >= 2 * F.MAX_SHARD_ROWS, mid.n_samples
        assert mid.attrs["arrays"]["1.output"]["shard_rows"] <= F.MAX_SHARD_ROWS
        torch.testing.assert_close(mid["1.output"], ref[:mid.n_samples])
    assert acs.open_store(path).n_samples == n_rows


def test_arrays_are_listed_before_the_first_commit(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(3, 4)).eval()
    with acs.ActivationScope(store=str(tmp_path / "s.zarr")).track(model):
        with torch.no_grad():
            model(torch.randn(2, 3))
        store = acs.open_store(tmp_path / "s.zarr")
        assert store.n_samples == 0 and store.status == "incomplete"
        assert store.hook_points == ["0.output"]
        assert store.n_rows("0.output") == 0 and store["0.output"].shape == (0, 4)
        assert store.verify() == []


def test_commit_with_many_arrays_writes_every_document(tmp_path):
    """A commit writes its manifests and array documents concurrently (12 arrays here, over
    the pool's threshold); every one is there, then the root."""
    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(12)]).eval()
    xs = torch.randn(10, 4)
    path = tmp_path / "s.zarr"
    with acs.ActivationScope(store=str(path)).track(model):
        with torch.no_grad():
            model(xs)
    store = acs.open_store(path)
    assert len(store.hook_points) == 12 and store.status == "complete"
    for hp in store.hook_points:
        assert (path / store.attrs["arrays"][hp]["manifest"]).exists()
        assert store[hp].shape == (10, 4)
    assert store.verify() == []


def test_failed_commit_write_raises_and_keeps_the_last_commit(tmp_path, monkeypatch):
    """One manifest write of the final commit fails: close raises StoreError naming the file.
    That commit was the first: no root lists a row, so the new store is removed (it was left
    as an incomplete store of 0 rows, which resume=True had nothing to continue), the error's
    note saying so; a store that committed rows before keeps them (test_disk_full)."""
    from activationscope.errors import StoreError
    from activationscope.store import _backend

    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(12)]).eval()
    path = tmp_path / "s.zarr"
    real_set = _backend.LocalBackend.set

    def failing_set(self, key, data):
        if key.endswith("acts/5.output/manifest.json"):
            raise StoreError(f"writing {key!r} failed: No space left on device")
        real_set(self, key, data)

    scope = acs.ActivationScope(store=str(path))
    with pytest.raises(StoreError, match="5.output/manifest.json") as raised:
        with scope.track(model):
            with torch.no_grad():
                model(torch.randn(3, 4))
            monkeypatch.setattr(_backend.LocalBackend, "set", failing_set)
    monkeypatch.setattr(_backend.LocalBackend, "set", real_set)
    assert any("no row was committed, so the new store" in note for note in raised.value.__notes__)
    assert not path.exists()


def test_reserved_temporary_files_are_used_then_released(tmp_path):
    """LocalBackend.reserve makes empty temporary files ahead of time, in folders it makes below
    the store's folder (never the store's folder itself: a store moved or removed meanwhile is
    not made again); set() fills and renames one; release() removes the unused; nothing else is
    left in the directory."""
    from activationscope.store._backend import LocalBackend

    gone = LocalBackend(tmp_path / "gone")  # (its folder was never made, as one removed)
    gone._spare_queue = queue.SimpleQueue()  # the reserving thread's loop, run here to its end
    gone._spare_queue.put("a/zarr.json")
    gone._spare_queue.put(None)
    gone._reserve_loop()
    assert not (tmp_path / "gone").exists() and gone._spare == {}
    (tmp_path / "s").mkdir()
    b = LocalBackend(tmp_path / "s")
    b.reserve(["a/zarr.json", "b/zarr.json"])
    deadline = time.monotonic() + 10
    while len(b._spare) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sorted(b._spare) == ["a/zarr.json", "b/zarr.json"]
    spare = b._spare["a/zarr.json"]
    assert spare.exists() and spare.stat().st_size == 0
    b.set("a/zarr.json", b'{"x": 1}')
    assert not spare.exists() and b.get("a/zarr.json") == b'{"x": 1}'
    b.release()
    b.reserve(["c/zarr.json"])  # after release: ignored
    files = sorted(str(p.relative_to(tmp_path / "s")) for p in (tmp_path / "s").rglob("*") if p.is_file())
    assert files == ["a/zarr.json"]


def test_reserve_never_makes_a_removed_folder_again(tmp_path):
    """A folder LocalBackend.reserve made (or found) once and that is gone since was removed (a
    store being deleted under its capture): later reservations make neither it nor anything in
    it, so a removal of the store is never undone; a folder it never had is made as before."""
    import shutil

    from activationscope.store._backend import LocalBackend

    def reserve_now(b, keys):  # the reserving thread's loop, run here to its end
        b._spare_queue = queue.SimpleQueue()
        for key in [*keys, None]:
            b._spare_queue.put(key)
        b._reserve_loop()

    (tmp_path / "s").mkdir()
    b = LocalBackend(tmp_path / "s")
    reserve_now(b, ["acts/a/zarr.json", "acts/b/zarr.json"])
    assert sorted(b._spare) == ["acts/a/zarr.json", "acts/b/zarr.json"]
    shutil.rmtree(tmp_path / "s" / "acts" / "a")
    b._spare.clear()
    reserve_now(b, ["acts/a/zarr.json", "acts/a/manifest.json", "acts/b/manifest.json", "acts/c/zarr.json"])
    assert not (tmp_path / "s" / "acts" / "a").exists()
    assert sorted(b._spare) == ["acts/b/manifest.json", "acts/c/zarr.json"]
    shutil.rmtree(tmp_path / "s" / "acts")
    b._spare.clear()
    reserve_now(b, ["acts/d/zarr.json", "zarr.json"])
    assert [p.name for p in (tmp_path / "s").iterdir()] == [b._spare["zarr.json"].name]


def test_capture_leaves_no_temporary_files(tmp_path):
    """Commits during the capture (small shards) and at the close use reserved files; the
    closed store holds no temporary file."""
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(10)]).eval()
    path = tmp_path / "s.zarr"
    xs = torch.randn(64, 8)
    with acs.ActivationScope(store=str(path), store_options={"chunk_rows": 16, "shard_bytes": 16 * 8 * 4}).track(model) as tr:
        with torch.no_grad():
            for i in range(0, 64, 8):
                model(xs[i:i + 8])
                time.sleep(0.02)
                tr.writer.commit()
    assert not [p for p in path.rglob("*.tmp")]
    store = acs.open_store(path)
    assert store.n_samples == 64 and store.verify() == []
    with torch.no_grad():
        torch.testing.assert_close(store["9.output"], model(xs))


@pytest.mark.parametrize("kwargs, match", [
    ({"shard_rows": {"a": 8}}, r"shard_rows as a dict must have the keys \['sample', 'token'\], got \['a'\]"),
    ({"shard_rows": 0}, r"shard_rows\['sample'\] must be a positive int, got 0"),
    ({"shard_rows": 6, "chunk_rows": 4}, r"shard_rows\['sample'\] must be a multiple of chunk_rows=4, got 6"),
    ({"shard_rows": 8, "shard_bytes": 4096}, r"shard_rows and shard_bytes exclude each other"),
])
def test_bad_shard_rows_are_our_argument_error_and_nothing_is_made(tmp_path, kwargs, match):
    from activationscope.errors import ArgumentValueError
    from activationscope.store import StoreWriter

    with pytest.raises(ArgumentValueError, match=match):
        StoreWriter(tmp_path / "s.zarr", **kwargs)
    assert not (tmp_path / "s.zarr").exists()


@pytest.mark.parametrize("feature_shape", [(4,), (256,), (3, 5)])
@pytest.mark.parametrize("compressed", [False, True])
def test_an_explicit_shard_bytes_below_a_default_chunk_is_honoured_for_narrow_rows(feature_shape, compressed):
    """A shard of shard_bytes holds at most that many bytes of rows (at least one row), also
    for rows so narrow that a default chunk alone is larger: a small shard_bytes is how a
    capture commits more often (docs/usage/store.md, "Commit granularity")."""
    import math

    from activationscope.store._format import chunk_layout

    row_bytes = math.prod(feature_shape) * 4
    for shard_bytes in (64 << 10, 4096, 1000, 1):
        chunk_rows, chunks = chunk_layout(feature_shape, "float32", None, shard_bytes, compressed)
        assert chunk_rows * chunks * row_bytes <= max(shard_bytes, row_bytes)
        assert chunk_rows * chunks * row_bytes > shard_bytes // 2 or chunk_rows * chunks == 1


def test_a_capture_with_a_small_shard_bytes_commits_narrow_rows_a_shard_at_a_time(tmp_path):
    import torch

    import activationscope as acs

    model = torch.nn.Sequential(torch.nn.Linear(8, 4))  # 16-byte rows
    path = tmp_path / "s.zarr"
    scope = acs.ActivationScope(store=str(path), store_options={"shard_bytes": 64 << 10, "commit_interval": 0})
    xs = [torch.randn(1024, 8) for _ in range(5)]
    with torch.no_grad(), scope.track(model):
        for x in xs:
            model(x)
    store = acs.open_store(path)
    meta = store.attrs["arrays"]["0.output"]
    assert meta["shard_rows"] * 16 == 64 << 10  # 4096 rows of 16 bytes a shard (16384 before)
    with torch.no_grad():
        assert torch.equal(store["0.output"], torch.cat([model(x) for x in xs]))


@pytest.mark.parametrize("shard_rows, feature_shape, want", [(24, (16,), 24), (100000, (16,), 4000), (6, (100000,), 1),
                                                            (4099, (16,), 1)])
def test_an_explicit_shard_rows_takes_the_largest_divisor_of_it_not_above_the_default_chunk(
        tmp_path, shard_rows, feature_shape, want):
    # FORMAT.md section 3, as a store records it
    default, _ = F.chunk_layout(feature_shape, "float32", None, None)
    assert want == max(d for d in range(1, min(default, shard_rows) + 1) if shard_rows % d == 0)
    model = torch.nn.Sequential(torch.nn.Tanh())
    with acs.ActivationScope(store=str(tmp_path / "s.zarr"), store_options={"shard_rows": shard_rows}).track(model), \
            torch.no_grad():
        model(torch.randn(2, feature_shape[0]))
    entry = acs.open_store(tmp_path / "s.zarr").attrs["arrays"]["0.output"]
    assert (entry["shard_rows"], entry["chunk_rows"]) == (shard_rows, want)
