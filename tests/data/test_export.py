"""Arrow IPC / Parquet export and zero-copy read-back."""

from __future__ import annotations

import importlib.util
import os
import re

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import torch
from fake_store import FakeStore, write_fake_store

from activationscope.errors import ArgumentTypeError, ArgumentValueError
from activationscope.data import ActivationDataset, arrow_to_torch, export_arrow, export_parquet, read_arrow

#: export_hf needs the Hugging Face datasets library (the [dev] extra); its parts of a test run where it is installed
_HAS_DATASETS = importlib.util.find_spec("datasets") is not None

N = 30


@pytest.fixture
def arrays():
    g = torch.Generator().manual_seed(1)
    return {
        "f32": torch.randn(N, 5, generator=g),
        "bf16": torch.randn(N, 2, 3, generator=g).to(torch.bfloat16),
        "f16": torch.randn(N, 4, generator=g).to(torch.float16),
        "i32": torch.arange(N * 2, dtype=torch.int32).reshape(N, 2),
        "scalar": torch.randn(N, generator=g),
    }


@pytest.fixture
def store(tmp_path, arrays):
    table = pa.table({
        "sample_id": pa.array(np.arange(N), pa.int64()),
        "label": pa.array(np.arange(N) % 2, pa.int64()),
        "text": pa.array([f"t{i}" for i in range(N)]),
    })
    return FakeStore(write_fake_store(tmp_path / "s", arrays, tables={"sample": table}, shard_rows=8))


@pytest.mark.parametrize("tensor_type", ["fixed_shape_tensor", "fixed_size_list"])
def test_arrow_round_trip_small_batches(store, arrays, tmp_path, tensor_type):
    path = export_arrow(store, tmp_path / "x.arrow", batch_rows=7, tensor_type=tensor_type)
    # plain pyarrow reads it: several record batches, large string offsets, bf16 as uint16 bits
    with pa.ipc.open_file(pa.memory_map(str(path))) as f:
        assert f.num_record_batches == 5
        table = f.read_all()
    schema = table.schema
    assert schema.field("text").type == pa.large_string()
    assert schema.field("bf16").metadata[b"activationscope.dtype"] == b"bfloat16"
    bits = table.column("bf16").combine_chunks()
    storage = bits.storage if tensor_type == "fixed_shape_tensor" else bits
    assert storage.type.value_type == pa.uint16() and storage.type.list_size == 6
    expect_bits = arrays["bf16"].view(torch.int16).numpy().view(np.uint16).reshape(-1)
    assert np.array_equal(storage.flatten().to_numpy(), expect_bits)
    if tensor_type == "fixed_shape_tensor":
        assert isinstance(schema.field("f32").type, pa.FixedShapeTensorType)
        assert np.array_equal(table.column("f32").combine_chunks().to_numpy_ndarray(), arrays["f32"].numpy())
    # read back as tensors with exact dtypes
    back = read_arrow(path)
    for name, t in arrays.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t), name
    assert back["label"].tolist() == [i % 2 for i in range(N)] and back["text"][3] == "t3"


def test_read_arrow_is_zero_copy_and_writes_do_not_reach_the_file(store, arrays, tmp_path):
    path = export_arrow(store, tmp_path / "x.arrow", hook_points=["f32", "bf16"], batch_rows=1000)
    before = path.read_bytes()
    back = read_arrow(path)
    # the views lie inside one private map of the whole file
    t = back["f32"]
    base = t.untyped_storage().data_ptr()
    size = path.stat().st_size
    assert t.untyped_storage().nbytes() == size
    assert base <= t.data_ptr() and t.data_ptr() + t.numel() * 4 <= base + size
    t.add_(1.0)
    back["bf16"].zero_()
    assert path.read_bytes() == before
    assert torch.equal(read_arrow(path)["f32"], arrays["f32"])
    parts = read_arrow(export_arrow(store, tmp_path / "y.arrow", hook_points=["f32"], batch_rows=7), batches=True)
    assert len(parts) == 5 and torch.equal(torch.cat([p["f32"] for p in parts]), arrays["f32"])
    assert all(p["f32"].untyped_storage().nbytes() == (tmp_path / "y.arrow").stat().st_size for p in parts)


def test_sliced_arrow_tensor_arrays_honour_their_offset(arrays):
    t = arrays["f32"]
    storage = pa.FixedSizeListArray.from_arrays(pa.array(t.reshape(-1).numpy()), 5)
    ext = pa.ExtensionArray.from_storage(pa.fixed_shape_tensor(pa.float32(), [5]), storage)
    for arr in (storage, ext):
        for a, b in [(3, 11), (0, 1), (29, 30), (7, 7)]:
            assert torch.equal(arrow_to_torch(arr.slice(a, b - a)), t[a:b])
    # slices of slices, and chunked arrays of slices
    assert torch.equal(arrow_to_torch(ext.slice(4, 20).slice(3, 5)), t[7:12])
    chunked = pa.chunked_array([ext.slice(2, 3), ext.slice(20, 4)])
    assert torch.equal(arrow_to_torch(chunked), torch.cat([t[2:5], t[20:24]]))
    # values whose own child array is offset
    child = pa.array(t.reshape(-1).numpy()).slice(5)
    assert torch.equal(arrow_to_torch(pa.FixedSizeListArray.from_arrays(child, 5)), t[1:])


def test_offsets_never_32_bit():
    from activationscope.data.export import _hook_point_field, _large

    f = _hook_point_field("hp", torch.float32, (4096,), "fixed_size_list", "arrow")
    # no offsets buffer at all: a fixed-size list column cannot overflow at any size
    assert pa.types.is_fixed_size_list(f.type)
    arr = pa.FixedSizeListArray.from_arrays(pa.array(np.zeros(8, np.float32)), 4)
    assert arr.buffers()[0] is None and len(arr.buffers()) == 3  # validity, child validity, child values
    assert _large(pa.list_(pa.string())) == pa.large_list(pa.large_string())
    assert _large(pa.struct([("t", pa.binary())])) == pa.struct([("t", pa.large_binary())])


def test_parquet_round_trip_and_filters(store, arrays, tmp_path):
    path = export_parquet(store, tmp_path / "x.parquet", batch_rows=8, filter=pc.field("label") == 1)
    pf = pq.ParquetFile(path)
    assert pf.metadata.num_row_groups == 2
    table = pf.read()
    rows = [i for i in range(N) if i % 2 == 1]
    assert table.column("sample_id").to_pylist() == rows
    assert isinstance(table.schema.field("f32").type, pa.FixedShapeTensorType)
    for name, t in arrays.items():
        col = table.column(name)
        assert torch.equal(arrow_to_torch(col, table.schema.field(name)), t[rows]), name


@pytest.mark.parametrize("fn", [export_arrow, export_parquet, "hf"])
def test_exports_select_rows_by_sample_ids(store, arrays, tmp_path, fn):
    """sample_ids= selects the rows of those samples, in store order, as ActivationDataset's
    does (the exports took rows= and filter= only: sample_ids= was Python's bare TypeError)."""
    out = tmp_path / "ids"
    if fn == "hf":
        from activationscope.data import export_hf

        pytest.importorskip("datasets")
        import datasets

        export_hf(store, out, hook_points="f32", sample_ids=[21, 4, 17])
        got = datasets.load_from_disk(str(out)).with_format("torch")[:]
        ids, f32 = got["sample_id"].tolist(), got["f32"]
    else:
        fn(store, out, hook_points="f32", sample_ids=np.array([21, 4, 17]))
        table = pq.read_table(out) if fn is export_parquet else pa.ipc.open_file(out).read_all()
        ids, f32 = table.column("sample_id").to_pylist(), arrow_to_torch(table.column("f32"), table.schema.field("f32"))
    assert ids == [4, 17, 21] and torch.equal(f32, arrays["f32"][[4, 17, 21]])
    with pytest.raises(ArgumentValueError, match=r"sample_ids= holds 1 id\(s\) that no sample"):
        export_parquet(store, tmp_path / "none.parquet", sample_ids=[4, 99])
    assert not (tmp_path / "none.parquet").exists()


def test_export_a_dataset_selection(store, arrays, tmp_path):
    ds = ActivationDataset(store, hook_points=["f32"], rows=[5, 1, 9], columns=["label"])
    path = export_arrow(ds, tmp_path / "sel.arrow")
    back = read_arrow(path)
    assert set(back) == {"f32", "sample_id", "label", "text"}
    assert torch.equal(back["f32"], arrays["f32"][[5, 1, 9]])
    assert back["sample_id"].tolist() == [5, 1, 9]


@pytest.mark.parametrize("fn", [export_arrow, export_parquet])
def test_a_dataset_keeps_its_selection_when_hook_points_are_chosen(store, arrays, tmp_path, fn):
    ds = ActivationDataset(store, hook_points=["f32", "f16"], filter=pc.field("label") == 1, columns=["label"])
    path = fn(ds, tmp_path / "sel", hook_points=["f16", "bf16"])          # not all 24 rows of the store
    table = pq.read_table(path) if fn is export_parquet else pa.ipc.open_file(path).read_all()
    odd = list(range(1, N, 2))
    assert table.column("sample_id").to_pylist() == odd and set(table.column("label").to_pylist()) == {1}
    assert torch.equal(arrow_to_torch(table.column("bf16"), table.schema.field("bf16")), arrays["bf16"][odd])
    # rows= / filter= select store rows: next to a dataset's own selection they are refused
    for kw in ({"rows": [0, 1]}, {"filter": pc.field("label") == 0}, {"sample_ids": [1]}):
        with pytest.raises(ArgumentValueError, match=rf"a dataset was given, which exports its own {len(odd)} rows"):
            fn(ds, tmp_path / "again", **kw)
    assert not (tmp_path / "again").exists()


def test_export_validates_before_writing(store, tmp_path):
    with pytest.raises(ValueError, match="batch_rows must be a positive int"):
        export_arrow(store, tmp_path / "a.arrow", batch_rows=0)
    for fn in (export_arrow, export_parquet):  # (True was taken as 1: a file of 1-row batches)
        for bad in (True, 2.0, "8"):
            with pytest.raises(ArgumentTypeError, match=rf"batch_rows must be an int, got {re.escape(repr(bad))}"):
                fn(store, tmp_path / "a.arrow", batch_rows=bad)
    assert list(tmp_path.glob("a.arrow*")) == []
    export_arrow(store, tmp_path / "np.arrow", batch_rows=np.int64(8))  # (numpy integers were refused)
    assert pa.ipc.open_file(tmp_path / "np.arrow").num_record_batches == -(-store.n_rows(store.hook_points[0]) // 8)
    with pytest.raises(ValueError, match="tensor_type must be one of"):
        export_arrow(store, tmp_path / "a.arrow", tensor_type="list")
    with pytest.raises(ValueError, match="columns \\['nope'\\]"):
        export_arrow(store, tmp_path / "a.arrow", columns=["nope"])
    assert list(tmp_path.glob("a.arrow*")) == []


def test_empty_export(store, tmp_path):
    path = export_arrow(store, tmp_path / "e.arrow", hook_points=["f32"], filter=pc.field("label") == 5)
    back = read_arrow(path)
    assert back["f32"].shape == (0, 5) and back["f32"].dtype == torch.float32


def test_an_empty_arrow_export_read_with_plain_pyarrow_is_an_empty_tensor(store, tmp_path):
    path = export_arrow(store, tmp_path / "e.arrow", hook_points=["bf16", "f32"], filter=pc.field("label") == 5)
    table = pa.ipc.open_file(path).read_all()                   # no record batch: chunked arrays of 0 chunks
    assert table.column("bf16").num_chunks == 0
    got = arrow_to_torch(table.column("bf16"), table.schema.field("bf16"))
    assert got.shape == (0, 2, 3) and got.dtype == torch.bfloat16
    assert arrow_to_torch(table.column("f32"), table.schema.field("f32")).shape == (0, 5)


def test_other_readers(store, arrays, tmp_path):
    pl = pytest.importorskip("polars")
    duckdb = pytest.importorskip("duckdb")
    path = export_parquet(store, tmp_path / "x.parquet", hook_points=["f32"], columns=["sample_id", "label"],
                          tensor_type="fixed_size_list")
    df = pl.read_parquet(path)
    assert df["sample_id"].to_list() == list(range(N))
    got = np.array(df["f32"].to_list(), dtype=np.float32)
    assert np.array_equal(got, arrays["f32"].numpy())
    con = duckdb.connect()
    row = con.execute(f"select f32, label from read_parquet('{path}') where sample_id = 7").fetchone()
    assert np.array_equal(np.array(row[0], np.float32), arrays["f32"][7].numpy()) and row[1] == 1
    arrow_path = export_arrow(store, tmp_path / "x.arrow", hook_points=["f32"], columns=["label"])
    df2 = pl.read_ipc(arrow_path)
    assert np.array_equal(np.array(df2["f32"].to_list(), dtype=np.float32), arrays["f32"].numpy())


def test_pandas_reads_every_export(store, arrays, tmp_path):
    from activationscope.data import to_pandas

    pytest.importorskip("pandas")
    tensor = pq.read_table(export_parquet(store, tmp_path / "t.parquet", hook_points=["f32", "bf16"]))
    flat = pq.read_table(export_parquet(store, tmp_path / "l.parquet", hook_points=["f32", "bf16"],
                                        tensor_type="fixed_size_list"))
    frames = [to_pandas(tensor, split_blocks=True), to_pandas(tensor), flat.to_pandas(split_blocks=True),
              to_pandas(flat, split_blocks=True)]
    for frame in frames:
        assert np.array_equal(np.stack(frame["f32"].to_numpy()), arrays["f32"].numpy())
        bits = arrays["bf16"].view(torch.int16).numpy().view(np.uint16).reshape(N, -1)
        assert np.array_equal(np.stack(frame["bf16"].to_numpy()), bits)
        assert frame["label"].tolist() == [i % 2 for i in range(N)] and frame["text"][3] == "t3"
    # the field metadata survives the workaround
    assert to_pandas.__doc__ and tensor.schema.field("bf16").metadata[b"activationscope.dtype"] == b"bfloat16"


@pytest.mark.parametrize("fn, kind", [(export_arrow, "arrow"), (export_parquet, "parquet")])
def test_an_existing_file_that_is_not_an_export_is_kept(store, arrays, tmp_path, fn, kind):
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes")
    with pytest.raises(ArgumentValueError, match=rf"notes.txt' exists and is not an earlier {kind} export; it is left"):
        fn(store, notes)
    assert notes.read_text() == "my notes"
    with pytest.raises(ArgumentValueError, match=r"is a folder"):
        fn(store, tmp_path)
    # an earlier export is replaced; anything with overwrite=True
    out = tmp_path / f"x.{kind}"
    fn(store, out, hook_points=["f32"])
    fn(store, out, hook_points=["f32"])
    fn(store, notes, hook_points=["f32"], overwrite=True)
    got = read_arrow(notes) if kind == "arrow" else pq.read_table(notes)
    assert (got["f32"].shape[0] if kind == "arrow" else got.num_rows) == N


def test_a_hook_point_of_rows_without_values_is_named(tmp_path):
    from activationscope.data import export_hf
    from activationscope.errors import ActivationScopeError

    arrays = {"empty": torch.zeros(6, 2, 0), "f32": torch.randn(6, 3)}
    store = FakeStore(write_fake_store(tmp_path / "s", arrays, tables={"sample": pa.table({"sample_id": list(range(6))})},
                                       shard_rows=8))
    back = read_arrow(export_arrow(store, tmp_path / "f.arrow", hook_points=["f32"]))
    assert torch.equal(back["f32"], arrays["f32"])
    for fn in (export_arrow, export_parquet, "hf"):
        if fn == "hf":
            pytest.importorskip("datasets")
            fn = export_hf
        with pytest.raises(ActivationScopeError, match=r"hook point 'empty' has feature shape \(2, 0\): its rows hold no"):
            fn(store, tmp_path / "x")
        assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128])
def test_a_hook_point_of_a_dtype_export_cannot_write_is_named_with_the_fix(tmp_path, dtype):
    # a store holds complex hook points exactly; an export has no column type for them: the
    # refusal names the export format, the dtypes it writes and what to do
    from activationscope.data import export_hf
    from activationscope.errors import ActivationScopeError

    odd = (torch.randn(6, 2) * 9).abs().to(dtype)
    arrays = {"odd": odd, "f32": torch.randn(6, 3)}
    store = FakeStore(write_fake_store(tmp_path / "s", arrays, tables={"sample": pa.table({"sample_id": list(range(6))})},
                                       shard_rows=8))
    for fn, format in ((export_arrow, "arrow"), (export_parquet, "parquet"), ("hf", "hf")):
        if fn == "hf":
            pytest.importorskip("datasets")
            fn = export_hf
        with pytest.raises(ActivationScopeError, match=rf"hook point 'odd' has dtype {dtype}, which the export format "
                                                       rf"'{format}' does not support \(it writes float32, .*bfloat16.*"
                                                       r"uint32.*bool; nothing was written\); leave it out "
                                                       r"of hook_points .*open_store or ActivationDataset"):
            fn(store, tmp_path / "x")
        assert not (tmp_path / "x").exists()
    # the fix it names: the other hook points export, and the dataset gives the odd one exactly
    back = read_arrow(export_arrow(store, tmp_path / "f.arrow", hook_points=["f32"]))
    assert torch.equal(back["f32"], arrays["f32"])
    got = ActivationDataset(store, hook_points=["odd"])[0:6]["odd"]
    assert got.dtype == dtype and torch.equal(got, odd)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    signed = {torch.uint16: torch.int16, torch.uint32: torch.int32, torch.uint64: torch.int64}
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(signed[a.dtype]), b.view(signed[b.dtype]))


def test_unsigned_hook_points_export_exactly(tmp_path):
    # uint16 / uint32 / uint64 hook points were refused by every export; Arrow and Parquet
    # carry them exactly (their top values and 2**63 included), datasets uint16 and uint32
    # (read as int64 by with_format("torch")), and uint64 is refused there naming the formats that keep it
    from activationscope.data import export_hf
    from activationscope.errors import ActivationScopeError

    arrays = {
        "u16": torch.tensor([[0, 1, 2**16 - 1], [7, 2**15, 9]] * 3, dtype=torch.uint16),
        "u32": torch.tensor([[0, 2**32 - 1], [2**31, 5]] * 3, dtype=torch.uint32),
        "u64": torch.tensor([0, 2**64 - 1, 2**63, 2**63 - 1, 3, 2**40], dtype=torch.uint64),
    }
    store = FakeStore(write_fake_store(tmp_path / "s", arrays, tables={"sample": pa.table({"sample_id": list(range(6))})},
                                       shard_rows=4))
    back = read_arrow(export_arrow(store, tmp_path / "f.arrow", batch_rows=4))
    table = pq.read_table(export_parquet(store, tmp_path / "f.parquet", tensor_type="fixed_size_list"))
    for hp, want in arrays.items():
        assert _same_bits(back[hp], want), hp
        assert _same_bits(arrow_to_torch(table[hp], table.schema.field(hp)), want), hp
        col = table[hp].combine_chunks()  # as plain pyarrow reads it
        values = col.flatten() if want.dim() > 1 else col
        assert values.type == pa.from_numpy_dtype(want.numpy().dtype), hp
        assert values.to_pylist() == [int(v) for v in want.numpy().reshape(-1)], hp
    datasets = pytest.importorskip("datasets")
    with pytest.raises(ActivationScopeError, match=r"hook point 'u64' has dtype torch.uint64, which the export format "
                                                   r"'hf' does not keep exactly: .*values of 2\*\*63 or more turned "
                                                   r"negative \(nothing was written\); export it with export_parquet or "
                                                   r"export_arrow"):
        export_hf(store, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()
    hf = datasets.load_from_disk(str(export_hf(store, tmp_path / "hf", hook_points=["u16", "u32"])))
    assert hf.features["u16"] == datasets.List(datasets.Value("uint16"), length=3)
    got = hf.with_format("torch")[:]
    for hp in ("u16", "u32"):
        assert torch.equal(got[hp], arrays[hp].to(torch.int64)), hp


@pytest.mark.parametrize("overwrite", ["False", 0, None])
@pytest.mark.parametrize("fn", [export_parquet, export_arrow])
def test_overwrite_must_be_a_bool_and_nothing_is_replaced(store, tmp_path, fn, overwrite):
    # overwrite="False" from a config file is a true string: it replaced a file that is not an export
    mine = tmp_path / "notes.parquet"
    mine.write_bytes(b"mine")
    with pytest.raises(ArgumentTypeError, match=rf"overwrite must be True or False, got {re.escape(repr(overwrite))}"):
        fn(store, mine, hook_points=["f32"], overwrite=overwrite)
    assert mine.read_bytes() == b"mine"


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_pipe_or_a_link_to_one_is_never_read_nor_replaced(store, tmp_path, overwrite):
    import os
    import stat

    from activationscope.data import export_hf

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)                  # reading it to tell whether it is an export would wait for ever
    link = tmp_path / "link"
    link.symlink_to(fifo)
    import threading

    done = threading.Event()

    def release_readers():  # an export that opens the pipe to read gets end-of-file, not a hang
        while not done.wait(0.2):
            try:
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:  # no reader yet
                pass

    helper = threading.Thread(target=release_readers, daemon=True)
    helper.start()
    try:
        for path in (fifo, link):
            for fn in (export_arrow, export_parquet):
                with pytest.raises(ArgumentValueError, match=r"is not a regular file \(a device, a pipe or a socket\)"):
                    fn(store, path, hook_points=["f32"], overwrite=overwrite)
            for file_format in ("arrow", "parquet") if _HAS_DATASETS else ():
                with pytest.raises(ArgumentValueError, match=r"is not a regular file"):
                    export_hf(store, path, hook_points=["f32"], file_format=file_format)
    finally:
        done.set()
        helper.join()
    assert stat.S_ISFIFO(os.stat(fifo).st_mode) and link.is_symlink()
    if not _HAS_DATASETS:
        pytest.skip("export_hf's part needs `pip install datasets`")


@pytest.mark.parametrize("fn", [export_arrow, export_parquet])
def test_a_file_name_of_the_longest_length_is_written(store, arrays, tmp_path, fn):
    out = tmp_path / ("x" * 250 + ".out")                    # 254 bytes: the temporary name must fit too
    fn(store, out, hook_points=["f32"])
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("x")] == [out.name]


@pytest.mark.parametrize("fn", [export_arrow, export_parquet])
def test_a_path_whose_folder_is_missing_or_a_file_is_named(store, tmp_path, fn):
    (tmp_path / "afile").write_text("keep")
    with pytest.raises(ArgumentValueError, match=r"its folder '.*afile' is not a folder"):
        fn(store, tmp_path / "afile" / "x.out")
    with pytest.raises(ArgumentValueError, match=r"its folder '.*nope' does not exist"):
        fn(store, tmp_path / "nope" / "x.out")
    assert (tmp_path / "afile").read_text() == "keep" and not (tmp_path / "nope").exists()


@pytest.mark.parametrize("fn, kind", [(export_arrow, "arrow"), (export_parquet, "parquet")])
def test_a_file_named_like_the_temporary_one_is_kept(store, tmp_path, fn, kind):
    out = tmp_path / f"x.{kind}"
    mine = tmp_path / f"x.{kind}.tmp"           # the user's, not ours
    mine.write_text("my notes")
    fn(store, out, hook_points=["f32"])
    assert mine.read_text() == "my notes"
    with pytest.raises(ArgumentValueError):
        fn(store, out, hook_points=["f32"], tensor_type="nope")   # a failed export cleans up only its own file
    assert mine.read_text() == "my notes"
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("x.")) == [out.name, mine.name]


@pytest.mark.parametrize("fn, kind", [(export_arrow, "arrow"), (export_parquet, "parquet")])
def test_an_export_removes_what_a_killed_export_to_its_path_left(store, tmp_path, fn, kind):
    # SIGKILL leaves the temporary file of an export behind (as large as what it had written)
    import subprocess
    import sys

    from activationscope.data import export as export_module

    out = tmp_path / f"x.{kind}"
    child = ("import os, sys; from pathlib import Path; from activationscope.data.export import _temp_sibling; "
             "t = _temp_sibling(Path(sys.argv[1])); t.write_bytes(b'half an export'); print(t.name); os._exit(9)")
    done = subprocess.run([sys.executable, "-c", child, str(out)], capture_output=True, text=True, timeout=120)
    killed = tmp_path / done.stdout.strip()
    assert done.returncode == 9 and killed.is_file(), done.stderr
    host = export_module._host_tag()
    running = tmp_path / f"x.{kind}.{host}-{os.getpid()}-0123abcd.tmp"   # a process still at work: kept
    other_host = tmp_path / f"x.{kind}.elsewhere-1-0123abcd.tmp"         # another host's: kept
    for f in (running, other_host):
        f.write_text("in use")
    fn(store, out, hook_points=["f32"])
    assert not killed.exists()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("x.")) == sorted(
        [out.name, running.name, other_host.name])


# ----------------------------------------------------------- hook points off the row table
@pytest.fixture
def late_store(tmp_path):
    from acs_testing import late_branch_store

    path = tmp_path / "late.zarr"
    model, xs = late_branch_store(path)
    with torch.no_grad():
        # forward by forward, as captured (a matmul's last bits depend on the batch)
        want_b = torch.cat([model.b(model.a(x)) for x in xs[2:]])
        want_a = torch.cat([model.a(x) for x in xs])
    return path, want_a, want_b


@pytest.mark.parametrize("columns", [None, []])
@pytest.mark.parametrize("fn", [export_parquet, export_arrow])
def test_a_hook_point_off_the_row_table_exports_alone_without_columns(late_store, tmp_path, columns, fn):
    import activationscope as acs

    path, _, want_b = late_store
    assert not acs.open_store(path).follows_row_table("b.output")
    out = fn(path, tmp_path / "b.out", hook_points="b.output", columns=columns)
    table = pq.read_table(out) if fn is export_parquet else read_arrow(out)
    if fn is export_parquet:
        assert table.column_names == ["b.output"]
        got = arrow_to_torch(table.column("b.output"))
    else:
        assert list(table) == ["b.output"]
        got = table["b.output"]
    assert torch.equal(got, want_b)
    # a dataset over it exports the same
    ds = ActivationDataset(path, hook_points="b.output", rows=slice(2, 5))
    export_parquet(ds, tmp_path / "ds.parquet")
    assert torch.equal(arrow_to_torch(pq.read_table(tmp_path / "ds.parquet").column("b.output")), want_b[2:5])


def test_a_dataset_of_a_hook_point_off_the_row_table_refuses_columns_as_export_does(late_store):
    """columns=, filter= and sample_ids= for a hook point whose rows do not follow the row
    table are refused as an argument (ArgumentValueError, a ValueError), as export_parquet
    refuses them and as the dataset refuses it next to other hook points; they raised the
    bare ActivationScopeError, which ``except ValueError`` did not catch."""
    path, _, want_b = late_store
    for kwargs in ({"columns": ["label"]}, {"filter": pc.field("label") == 1}, {"sample_ids": [1]}):
        with pytest.raises(ArgumentValueError, match=r"\['b.output'\] do not follow the sample row table"):
            ActivationDataset(path, hook_points="b.output", **kwargs)
    with pytest.raises(ValueError):
        ActivationDataset(path, hook_points="b.output", columns=["label"])
    assert torch.equal(ActivationDataset(path, hook_points="b.output")[:]["b.output"], want_b)  # alone, it reads


def test_a_hook_point_off_the_row_table_refuses_columns_filters_and_company(late_store, tmp_path):
    path, want_a, _ = late_store
    with pytest.raises(ArgumentValueError, match=r"'b.output'.*columns=\['sample_id'\].*export it without columns"):
        export_parquet(path, tmp_path / "x.parquet", hook_points="b.output", columns=["sample_id"])
    with pytest.raises(ArgumentValueError, match=r"'b.output'.*a filter"):
        export_parquet(path, tmp_path / "x.parquet", hook_points="b.output", filter=pc.field("label") == 1)
    with pytest.raises(ArgumentValueError, match=r"'b.output'.*sample_ids= cannot be exported with them"):
        export_parquet(path, tmp_path / "x.parquet", hook_points="b.output", sample_ids=[1])
    for hps in (None, ["a.output", "b.output"]):
        with pytest.raises(ArgumentValueError, match=r"\['b.output'\].*do not follow the row table.*"
                                                     r"with \['a.output'\]; export them separately"):
            export_parquet(path, tmp_path / "x.parquet", hook_points=hps)
    assert not (tmp_path / "x.parquet").exists()
    # the hook points that follow the table export with their columns as before
    export_parquet(path, tmp_path / "a.parquet", hook_points="a.output", columns=["sample_id", "label"])
    table = pq.read_table(tmp_path / "a.parquet")
    assert table.column("label").to_pylist() == [i % 2 for i in range(24)]
    assert torch.equal(arrow_to_torch(table.column("a.output")), want_a)


def _files(root):
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_an_export_into_the_store_it_reads_is_refused_and_the_store_is_unchanged(tmp_path):
    """Paths inside the store (its root document, a shard, a new file or folder there), the
    store itself and a folder holding it are refused for every export, also with overwrite."""
    import activationscope as acs
    from activationscope.data import export_hf

    m = torch.nn.Sequential(torch.nn.Linear(4, 3))
    root = tmp_path / "ex.zarr"
    with torch.no_grad(), acs.ActivationScope(store=str(root)).track(m) as tr:
        tr.set_batch(sample_ids=range(6))
        m(torch.randn(6, 4))
    before = _files(root)
    shard = next(p for p in root.rglob("*") if p.is_file() and "/c/" in str(p))
    inside = [root / "zarr.json", shard, root / "x.parquet", root / "hf", root / "acts", root, tmp_path]
    try:
        import datasets  # noqa: F401
        has_hf = True
    except ImportError:
        has_hf = False
    for path in inside:
        for overwrite in (False, True):
            for fn in (export_parquet, export_arrow):
                why = r"is a folder" if path == tmp_path else r"is inside the store .*give a path outside the store"
                with pytest.raises(ArgumentValueError, match=why):
                    fn(str(root), path, overwrite=overwrite)
        if has_hf:
            for fmt in ("arrow", "parquet"):
                with pytest.raises(ArgumentValueError, match=r"(is inside|holds) the store .*give a path outside the store"):
                    export_hf(str(root), path, file_format=fmt)
    assert _files(root) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ex.zarr"]
    torch.testing.assert_close(read_arrow(export_arrow(str(root), tmp_path / "ok.arrow"))["0.output"],
                               acs.open_store(str(root))["0.output"])


def test_an_export_into_another_store_is_refused_and_that_store_is_unchanged(tmp_path):
    """An export written among the files of another store than the one it reads was lost
    without a word when that store was captured again with overwrite=True (which removes its
    folder): refused as a path inside the store it reads is."""
    import activationscope as acs
    from activationscope.data import export_hf

    m = torch.nn.Sequential(torch.nn.Linear(4, 3))
    src, other = tmp_path / "src.zarr", tmp_path / "other.zarr"
    for root in (src, other):
        with torch.no_grad(), acs.ActivationScope(store=str(root)).track(m) as tr:
            tr.set_batch(sample_ids=range(6))
            m(torch.randn(6, 4))
    before = _files(other)
    for path in (other / "x.parquet", other / "acts" / "x.arrow", other / "hf"):
        for fn in (export_parquet, export_arrow):
            with pytest.raises(ArgumentValueError, match=r"is inside the store .*other\.zarr.*give a path outside"):
                fn(str(src), path, overwrite=True)
        try:
            import datasets  # noqa: F401
        except ImportError:
            continue
        with pytest.raises(ArgumentValueError, match=r"is inside the store .*other\.zarr.*give a path outside"):
            export_hf(str(src), path)
    assert _files(other) == before
    back = read_arrow(export_arrow(str(src), tmp_path / "ok.arrow"))
    torch.testing.assert_close(back["0.output"], acs.open_store(str(src))["0.output"])


@pytest.mark.parametrize("equal_counts", [False, True])
def test_a_dataset_refuses_a_hook_point_off_the_row_table_next_to_others(late_store, monkeypatch, equal_counts):
    from activationscope.data import _source

    path, _, want_b = late_store
    if equal_counts:  # row i of each would be paired though row i is not the same sample's
        monkeypatch.setattr(_source.StoreSource, "n_rows", lambda self, hp: 8)
    with pytest.raises(ArgumentValueError, match=r"hook points \['b.output'\] of .* do not follow the row table .*"
                                                 r"not row i of the other hook points \['a.output'\]; make a dataset "
                                                 r"of each of them alone"):
        ActivationDataset(path, hook_points=["a.output", "b.output"])
    monkeypatch.undo()
    assert torch.equal(ActivationDataset(path, hook_points="b.output")[:]["b.output"], want_b)


def _with_shape_metadata(path, out, column: str, raw: bytes):
    table = pa.ipc.open_file(pa.memory_map(str(path))).read_all()
    i = table.schema.get_field_index(column)
    field = table.schema.field(i)
    table = table.cast(table.schema.set(i, field.with_metadata({**field.metadata, b"activationscope.shape": raw})))
    with pa.OSFile(str(out), "wb") as sink, pa.ipc.new_file(sink, table.schema) as w:
        w.write_table(table)
    return out


@pytest.mark.parametrize("tensor_type", ["fixed_shape_tensor", "fixed_size_list"])
@pytest.mark.parametrize("raw, constraint", [
    (b"[-1, 3]", "a JSON list of at most 32 ints >= 0"),  # reshape(-1) would have inferred a wrong shape
    (b"[-2, -3]", "a JSON list of at most 32 ints >= 0"),
    (b"[2.5, 2]", "a JSON list of at most 32 ints >= 0"),
    (b"[true, 6]", "a JSON list of at most 32 ints >= 0"),  # read as (rows, 1, 6) before
    (b'["2", 3]', "a JSON list of at most 32 ints >= 0"),
    (b"[1e400]", "a JSON list of at most 32 ints >= 0"),
    (b"[" + b"1, " * 32 + b"6]", "a JSON list of at most 32 ints >= 0"),
    (b"{}", "a JSON list of at most 32 ints >= 0"),
    (b"nope", "a JSON list of ints"),
    (b"[4]", None),
    (b"[2, 2]", None),
    (b"[]", None),
])
def test_read_arrow_refuses_shape_metadata_that_does_not_describe_the_column(store, arrays, tmp_path, tensor_type,
                                                                            raw, constraint):
    """A hook point column's ``activationscope.shape`` that is not a list of ints >= 0, or
    whose shape (or number of values) disagrees with the column, is our error naming the
    column, never a numpy / torch / json exception or a tensor of another shape."""
    from activationscope.errors import ActivationScopeError

    path = export_arrow(store, tmp_path / "x.arrow", hook_points=["bf16"], tensor_type=tensor_type)
    bad = _with_shape_metadata(path, tmp_path / "bad.arrow", "bf16", raw)
    if constraint is None:
        constraint = ("the column's fixed_shape_tensor shape [2, 3]" if tensor_type == "fixed_shape_tensor"
                      else "a shape of 6 values (the column's fixed_size_list size)")
    with pytest.raises(ActivationScopeError, match=re.escape(
            f"column 'bf16': field metadata activationscope.shape must be {constraint}, got {raw.decode()!r}")):
        read_arrow(bad)
    with pa.ipc.open_file(pa.memory_map(str(bad))) as f:
        table = f.read_all()
    with pytest.raises(ActivationScopeError, match="field metadata activationscope.shape must be"):
        arrow_to_torch(table.column("bf16"), table.schema.field("bf16"))
    assert torch.equal(read_arrow(path)["bf16"], arrays["bf16"])  # the file as exported reads back


def test_read_arrow_shape_metadata_of_a_fixed_size_list_and_a_scalar_column(store, arrays, tmp_path):
    """A fixed-size list column takes any shape of its number of values from the metadata (the
    layout has none of its own); a scalar column's shape is []."""
    path = export_arrow(store, tmp_path / "x.arrow", hook_points=["bf16", "scalar"], tensor_type="fixed_size_list")
    other = read_arrow(_with_shape_metadata(path, tmp_path / "y.arrow", "bf16", b"[3, 1, 2]"))["bf16"]
    assert other.shape == (N, 3, 1, 2) and torch.equal(other.reshape(N, 2, 3), arrays["bf16"])
    from activationscope.errors import ActivationScopeError

    with pytest.raises(ActivationScopeError, match=re.escape(
            "column 'scalar': field metadata activationscope.shape must be [] (the column is float, one value per "
            "row), got '[1]'")):
        read_arrow(_with_shape_metadata(path, tmp_path / "z.arrow", "scalar", b"[1]"))
    assert torch.equal(read_arrow(path)["scalar"], arrays["scalar"])


@pytest.mark.parametrize("fn, kind", [(export_parquet, "parquet"), (export_arrow, "arrow")])
def test_an_unknown_compression_is_refused_before_anything_is_read_or_written(store, arrays, tmp_path, fn, kind):
    from activationscope.data import EXPORT_COMPRESSIONS

    out = tmp_path / f"t.{kind}"
    fn(store, out, hook_points=["f32"])
    earlier, listing = out.read_bytes(), sorted(p.name for p in tmp_path.iterdir())
    accepted = list(EXPORT_COMPRESSIONS[kind])
    for bad in ("lz99", "snappy" if kind == "arrow" else "lzo"):
        with pytest.raises(ArgumentValueError, match=rf"export compression must be one of {re.escape(str(accepted))} "
                                                     rf"for the export format '{kind}', got '{bad}'"):
            fn(store, out, hook_points=["f32"], compression=bad)
        # up front: before the store is even opened
        with pytest.raises(ArgumentValueError, match="export compression must be one of"):
            fn(tmp_path / "no-such-store.zarr", tmp_path / f"u.{kind}", compression=bad)
    assert out.read_bytes() == earlier and sorted(p.name for p in tmp_path.iterdir()) == listing


@pytest.mark.parametrize("fn, kind", [(export_parquet, "parquet"), (export_arrow, "arrow")])
def test_every_accepted_compression_writes_the_values(store, arrays, tmp_path, fn, kind):
    from activationscope.data import EXPORT_COMPRESSIONS

    for name in (*EXPORT_COMPRESSIONS[kind], None, "ZSTD"):
        out = tmp_path / f"t-{name}.{kind}"
        fn(store, out, hook_points=["f32"], compression=name)
        table = pq.read_table(out) if kind == "parquet" else pa.ipc.open_file(pa.memory_map(str(out))).read_all()
        assert torch.equal(arrow_to_torch(table.column("f32"), table.schema.field("f32")), arrays["f32"]), name


@pytest.mark.parametrize("fmt", ["parquet", "arrow", "hf"])
def test_an_export_of_a_store_path_refuses_a_damaged_chunk_and_writes_nothing(tmp_path, fmt):
    """An export reads every byte it writes: a store given by path is read with every chunk
    checked against its crc32c, so flipped bytes are an error naming the chunk, never values in
    the export (an earlier export at the path is left as it was)."""
    import activationscope as acs
    from activationscope.cli import main
    from activationscope.data import export_arrow, export_hf, export_parquet
    from activationscope.errors import StoreCorruptError

    if fmt == "hf":
        pytest.importorskip("datasets")
    model = torch.nn.Linear(4, 4)
    path = tmp_path / "s.zarr"
    with torch.no_grad(), acs.ActivationScope(store=path, store_options={"chunk_rows": 8}).track(model):
        model(torch.randn(16, 4))
    fn = {"parquet": export_parquet, "arrow": export_arrow, "hf": export_hf}[fmt]
    out = tmp_path / f"out.{fmt}"
    fn(str(path), out)  # intact: exported
    before = sorted((p.relative_to(out), p.read_bytes()) for p in out.rglob("*") if p.is_file()) if fmt == "hf" \
        else out.read_bytes()
    with open(path / "acts" / "output" / "c" / "0" / "0", "r+b") as f:
        f.seek(4)
        f.write(b"\1" * 4)
    kwargs = {} if fmt == "hf" else {"overwrite": True}
    with pytest.raises(StoreCorruptError, match=r"chunk 0 \(rows 0-7\) of array 'acts/output'.*crc32c mismatch"):
        fn(str(path), out, **kwargs)
    with pytest.raises(StoreCorruptError, match=r"crc32c mismatch"):
        fn(path, tmp_path / f"other.{fmt}")  # a PathLike too
    assert not (tmp_path / f"other.{fmt}").exists()
    after = sorted((p.relative_to(out), p.read_bytes()) for p in out.rglob("*") if p.is_file()) if fmt == "hf" \
        else out.read_bytes()
    assert after == before
    # the command line: exit 1 naming the chunk, nothing written
    assert main(["export", str(path), "--format", fmt, "--out", str(tmp_path / f"cli.{fmt}")]) == 1
    assert not (tmp_path / f"cli.{fmt}").exists()
    # a store object opened without verify= is read as it was opened (zero-copy reads do not checksum)
    fn(acs.open_store(path), tmp_path / f"unchecked.{fmt}")


@pytest.mark.parametrize("fn", [export_parquet, export_arrow])
def test_a_column_named_twice_is_exported_once_as_the_dataset_reads_it(store, arrays, tmp_path, fn):
    # (it raised pyarrow's KeyError "Column sample_id does not exist in schema")
    path = fn(store, tmp_path / "x.out", hook_points=["f32"], columns=["label", "sample_id", "label"])
    table = pq.read_table(path) if fn is export_parquet else pa.ipc.open_file(pa.memory_map(str(path))).read_all()
    assert table.column_names == ["f32", "label", "sample_id"]
    assert table.column("label").to_pylist() == [i % 2 for i in range(N)]
    assert np.array_equal(np.stack(table.column("f32").to_pylist()), arrays["f32"].reshape(N, -1).numpy())
    ds = ActivationDataset(store, hook_points=["f32"], columns=["label", "sample_id", "label"])
    assert list(ds[0]) == ["f32", "label", "sample_id"]


def test_read_arrow_of_what_is_not_an_arrow_file_says_what_it_is_and_how_to_read_it(store, arrays, tmp_path):
    parquet = export_parquet(store, tmp_path / "x.parquet", hook_points=["bf16"])
    with pytest.raises(ArgumentValueError, match=r"read_arrow: '.*x\.parquet' is a Parquet file .*"
                                                 r"pyarrow\.parquet\.read_table\(path\).*arrow_to_torch"):
        read_arrow(parquet)
    # what it says works: the Parquet file's column read that way is the stored bf16 rows
    table = pq.read_table(parquet)
    assert torch.equal(arrow_to_torch(table["bf16"], table.schema.field("bf16")), arrays["bf16"])
    stream = tmp_path / "x.arrows"
    with pa.ipc.new_stream(str(stream), table.schema) as w:
        w.write_table(table)
    with pytest.raises(ArgumentValueError, match=r"'.*x\.arrows' is an Arrow IPC stream, not a file: read it with "
                                                 r"pyarrow\.ipc\.open_stream\(path\)\.read_all\(\)"):
        read_arrow(stream)
    back = pa.ipc.open_stream(str(stream)).read_all()
    assert torch.equal(arrow_to_torch(back["bf16"], back.schema.field("bf16")), arrays["bf16"])
    with pytest.raises(ArgumentValueError, match=r"'.*' is a folder, not an Arrow IPC file: read a store with "
                                                 r"open_store\(path\)"):
        read_arrow(tmp_path)
    (tmp_path / "empty.arrow").write_bytes(b"")
    with pytest.raises(ArgumentValueError, match=r"'.*empty\.arrow' is empty; give a file written by export_arrow"):
        read_arrow(tmp_path / "empty.arrow")
    (tmp_path / "t.arrow").write_text("hello world")
    with pytest.raises(ArgumentValueError, match=r"does not start with the Arrow file magic b'ARROW1' \(got b'hello '\)"):
        read_arrow(tmp_path / "t.arrow")
    with pytest.raises(FileNotFoundError, match=r"no\.arrow"):
        read_arrow(tmp_path / "no.arrow")
    # an Arrow file still reads as before
    assert torch.equal(read_arrow(export_arrow(store, tmp_path / "x.arrow", hook_points=["bf16"]))["bf16"],
                       arrays["bf16"])


@pytest.mark.parametrize("fn", ["parquet", "arrow", "hf"])
def test_an_export_of_token_and_sample_rows_names_each_kind_and_writes_nothing(tmp_path, fn):
    from activationscope.data import export_hf

    if fn == "hf":
        pytest.importorskip("datasets")

    tables = {
        "token": pa.table({"sample_id": pa.array(np.arange(8) // 4, pa.int64()), "pos": pa.array(np.arange(8) % 4, pa.int64())}),
        "sample": pa.table({"sample_id": pa.array(np.arange(2), pa.int64())}),
    }
    tok, sam = torch.arange(16.0).reshape(8, 2), torch.ones(2, 3)
    store = FakeStore(write_fake_store(tmp_path / "mixed", {"tok": tok, "sam": sam}, kinds={"tok": "token"}, tables=tables))
    export = {"parquet": export_parquet, "arrow": export_arrow, "hf": export_hf}[fn]
    out = tmp_path / f"x.{fn}"
    # the export's own words (it said "hook points of one ActivationDataset ...; make one dataset per row kind")
    with pytest.raises(ArgumentValueError, match=re.escape(
            "exported hook points must have one row kind (token or sample rows), got token rows: ['tok']; "
            "sample rows: ['sam']; pass hook_points= of one kind and export the others to another file")):
        export(store, out)
    assert not out.exists()
    # each kind to its own file, as the message says
    export(store, tmp_path / f"tok.{fn}", hook_points="tok")
    if fn == "arrow":
        assert torch.equal(read_arrow(tmp_path / "tok.arrow")["tok"], tok)


@pytest.mark.parametrize("fn, kind", [(export_arrow, "arrow"), (export_parquet, "parquet")])
def test_an_export_keeps_the_temporary_file_of_another_host_of_a_similar_name(store, tmp_path, monkeypatch, fn, kind):
    # cluster nodes on one shared file system: names alike in their first letters, or alike
    # once their dashes and dots are left out
    import socket
    import subprocess
    import sys

    from activationscope.data import export as export_module

    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          timeout=60)
    gone = int(done.stdout)  # a process id that runs on neither host now
    out = tmp_path / f"x.{kind}"
    others = []
    for name in ("gpu-node-cluster-a-0017", "gpunode-cluster-a-0018.local", "gpu.node-cluster-a-0019"):
        monkeypatch.setattr(socket, "gethostname", lambda name=name: name)
        f = tmp_path / f"x.{kind}.{export_module._host_tag()}-{gone}-0123abcd.tmp"
        f.write_text("another host's export, at work")
        others.append(f)
    monkeypatch.setattr(socket, "gethostname", lambda: "gpu-node-cluster-a-0016")
    fn(store, out, hook_points=["f32"])
    assert all(f.read_text() == "another host's export, at work" for f in others)


def test_check_compression_names_the_formats_that_take_one():
    from activationscope.data import check_compression

    assert check_compression("parquet", "ZSTD") == "zstd" and check_compression("arrow", "none") is None
    with pytest.raises(ArgumentValueError, match=r"compression applies to the export formats \['parquet', 'arrow'\], "
                                                 r"got 'hf'"):
        check_compression("hf", "zstd")  # (a bare KeyError 'hf' before)
    with pytest.raises(ArgumentValueError, match=r"format must be one of \['parquet', 'arrow', 'hf'\], got 'csv'"):
        check_compression("csv", None)


def test_read_arrow_batches_takes_a_bool_only(tmp_path):
    # batches="no" (a true string) returned a list of dicts where one dict was asked for
    store = FakeStore(write_fake_store(tmp_path / "s", {"a": torch.arange(12.0).reshape(6, 2)},
                                       tables={"sample": pa.table({"sample_id": list(range(6))})}, shard_rows=4))
    export_arrow(store, tmp_path / "a.arrow", hook_points="a", columns=[], batch_rows=4)
    with pytest.raises(ArgumentTypeError, match="batches must be True or False, got 'no'"):
        read_arrow(tmp_path / "a.arrow", batches="no")
    assert torch.equal(read_arrow(tmp_path / "a.arrow", batches=np.bool_(False))["a"], torch.arange(12.0).reshape(6, 2))
    assert len(read_arrow(tmp_path / "a.arrow", batches=True)) == 2
