"""Hugging Face datasets export: load_from_disk / from_parquet give ActivationDataset's tensors."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet  # noqa: F401 - pa.parquet
import pytest
import torch
from fake_store import FakeStore, write_fake_store

import activationscope as acs
from activationscope.data import ActivationDataset, export_hf
from activationscope.errors import ArgumentValueError

datasets = pytest.importorskip("datasets", reason="the HF export needs `pip install datasets`")

N = 24


@pytest.fixture
def arrays():
    g = torch.Generator().manual_seed(3)
    return {
        "f32": torch.randn(N, 5, generator=g),
        "bf16": torch.randn(N, 2, 3, generator=g).to(torch.bfloat16),
        "f16": torch.randn(N, 4, generator=g).to(torch.float16),
        "f64": torch.randn(N, 3, generator=g, dtype=torch.float64),
        "i32": torch.arange(N * 2, dtype=torch.int32).reshape(N, 2),
        "conv": torch.randn(N, 2, 3, 4, generator=g),
        "scalar": torch.randn(N, generator=g),
    }


@pytest.fixture
def store(tmp_path, arrays):
    table = pa.table({
        "sample_id": pa.array(np.arange(N), pa.int64()),
        "label": pa.array(np.arange(N) % 3, pa.int64()),
        "text": pa.array([f"t{i}" for i in range(N)]),
    })
    return FakeStore(write_fake_store(tmp_path / "s", arrays, tables={"sample": table}, shard_rows=7))


def _load(path, file_format, tmp_path):
    if file_format == "arrow":
        return datasets.load_from_disk(str(path))
    return datasets.Dataset.from_parquet(str(path), cache_dir=str(tmp_path / "hf-cache"))


@pytest.mark.parametrize("file_format", ["arrow", "parquet"])
def test_hf_export_gives_the_dataset_tensors(store, arrays, tmp_path, file_format):
    out = tmp_path / ("hf" if file_format == "arrow" else "hf.parquet")
    export_hf(store, out, file_format=file_format, batch_rows=10)   # three record batches
    hf = _load(out, file_format, tmp_path)
    assert len(hf) == N
    feats = hf.features
    assert feats["f32"] == datasets.List(datasets.Value("float32"), length=5)
    assert feats["bf16"] == datasets.Array2D((2, 3), "float32")         # bf16 upcast, exactly
    assert feats["f16"] == datasets.List(datasets.Value("float16"), length=4)
    assert feats["conv"] == datasets.Array3D((2, 3, 4), "float32")
    assert feats["scalar"] == datasets.Value("float32") and feats["i32"].feature == datasets.Value("int32")
    assert feats["text"] == datasets.Value("string")

    ours = ActivationDataset(store, columns=["sample_id", "label"])[:]
    theirs = hf.with_format("torch")[:]
    for name in ("f32", "conv", "scalar"):
        assert theirs[name].dtype == torch.float32 and torch.equal(theirs[name], ours[name]), name
    # with_format("torch") turns floats into float32 and ints into int64 (datasets' defaults);
    # float16 and bfloat16 values are exact in float32
    assert torch.equal(theirs["bf16"], ours["bf16"].float()) and theirs["bf16"].shape == (N, 2, 3)
    assert torch.equal(theirs["f16"], ours["f16"].float())
    assert torch.equal(theirs["i32"], ours["i32"].long())
    exact = hf.with_format("torch", columns=["f64"], dtype=torch.float64)[:]["f64"]
    assert exact.dtype == torch.float64 and torch.equal(exact, arrays["f64"])
    assert torch.equal(theirs["label"], ours["label"]) and torch.equal(theirs["sample_id"], ours["sample_id"])
    assert hf["text"][:3] == ["t0", "t1", "t2"]
    # one example at a time, as a DataLoader over the HF dataset reads it
    assert torch.equal(hf.with_format("torch")[5]["conv"], arrays["conv"][5])


def test_hf_export_bf16_bits_and_a_selection(store, arrays, tmp_path):
    ds = ActivationDataset(store, hook_points=["bf16", "f32"], rows=slice(3, 20), columns=["label"])
    export_hf(ds, tmp_path / "bits", columns=["label"], bfloat16="bits")
    hf = datasets.load_from_disk(str(tmp_path / "bits"))
    assert hf.features["bf16"] == datasets.Array2D((2, 3), "uint16") and hf.column_names == ["bf16", "f32", "label"]
    bits = hf.with_format("torch")[:]["bf16"]                 # int64 holding the uint16 patterns
    assert bits.dtype == torch.int64 and int(bits.min()) >= 0 and int(bits.max()) < 1 << 16
    back = torch.from_numpy(bits.numpy().astype(np.uint16).view(np.int16)).view(torch.bfloat16)
    assert torch.equal(back, arrays["bf16"][3:20])
    assert torch.equal(hf.with_format("torch")[:]["f32"], arrays["f32"][3:20])


def test_hf_export_groups_rows_into_examples(store, arrays, tmp_path):
    with pytest.raises(ValueError, match=r"multiple of context_size=5 \(remainder 4\); pass drop_last=True"):
        export_hf(store, tmp_path / "g", hook_points=["f32"], context_size=5)
    assert not (tmp_path / "g").exists()
    with pytest.raises(ValueError, match=r"context_size=1000 is more than the \d+ rows of \['f32'\]: not one example can be "
                       r"filled, and with drop_last=True nothing would be exported"):
        export_hf(store, tmp_path / "g", hook_points=["f32"], context_size=1000, drop_last=True)
    # without drop_last too: the advice to pass drop_last=True would lead to the error above
    with pytest.raises(ValueError, match=r"context_size=1000 is more than the \d+ rows of \['f32'\]") as e:
        export_hf(store, tmp_path / "g", hook_points=["f32"], context_size=1000)
    assert "pass drop_last=True" not in str(e.value) and "at most" in str(e.value)
    assert not (tmp_path / "g").exists()
    export_hf(store, tmp_path / "g", hook_points=["f32", "conv"], columns=["sample_id"], context_size=5,
              drop_last=True, batch_rows=7)
    hf = datasets.load_from_disk(str(tmp_path / "g"))
    assert hf.features["f32"] == datasets.Array2D((5, 5), "float32")
    assert hf.features["conv"] == datasets.Array2D((5, 24), "float32")   # (context_size, d_in), as SAELens
    assert hf.features["sample_id"] == datasets.List(datasets.Value("int64"), length=5)
    got = hf.with_format("torch")[:]
    assert torch.equal(got["f32"], arrays["f32"][:20].reshape(4, 5, 5))
    assert torch.equal(got["conv"], arrays["conv"][:20].reshape(4, 5, 24))
    assert got["sample_id"].tolist() == np.arange(20).reshape(4, 5).tolist()
    for bad in (True, 7.0):  # (True was taken as 1 row per record batch)
        with pytest.raises(TypeError, match=rf"batch_rows must be an int, got {bad!r}"):
            export_hf(store, tmp_path / "h", hook_points=["f32"], batch_rows=bad)
    assert not (tmp_path / "h").exists()


def test_hf_export_never_replaces_what_it_did_not_write(store, tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="not an earlier export_hf export"):
        export_hf(store, mine)
    assert (mine / "notes.txt").read_text() == "keep me"
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(FileExistsError, match="got an existing file"):
        export_hf(store, a_file)
    export_hf(store, tmp_path / "hf", hook_points=["f32"])
    export_hf(store, tmp_path / "hf", hook_points=["f16"])     # a previous export is replaced
    assert datasets.load_from_disk(str(tmp_path / "hf")).column_names[0] == "f16"
    assert not list(tmp_path.glob("*.tmp"))


def test_hf_export_refusals_are_the_library_s_own_error(store, tmp_path):
    """Every path export_hf leaves alone is refused with ExportExistsError: an
    ActivationScopeError (so `except ActivationScopeError` catches it) and a FileExistsError."""
    from activationscope.errors import ActivationScopeError, ExportExistsError

    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "notes.txt").write_text("keep me")
    a_file = tmp_path / "file"
    a_file.write_text("x")
    earlier = tmp_path / "hf"
    export_hf(store, earlier, hook_points=["f32"])
    (earlier / "README.md").write_text("mine")
    cases = [(folder, "arrow"), (a_file, "arrow"), (earlier, "arrow"), (a_file, "parquet"), (folder, "parquet")]
    for path, file_format in cases:
        with pytest.raises(ExportExistsError) as info:
            export_hf(store, path, hook_points=["f32"], file_format=file_format)
        assert isinstance(info.value, ActivationScopeError) and isinstance(info.value, FileExistsError)
        assert str(path) in str(info.value)
    assert (folder / "notes.txt").read_text() == "keep me" and a_file.read_text() == "x"


def test_hf_parquet_export_never_replaces_a_file_it_did_not_write(store, tmp_path):
    for name, content in (("notes.parquet", b"keep me"), ("notes.txt", b"keep me")):
        mine = tmp_path / name
        mine.write_bytes(content)
        with pytest.raises(FileExistsError, match="not an earlier export_hf Parquet file"):
            export_hf(store, mine, hook_points=["f32"], file_format="parquet")
        assert mine.read_bytes() == content
    plain = tmp_path / "plain.parquet"                       # a Parquet file, but not a datasets one
    pa.parquet.write_table(pa.table({"x": [1, 2]}), plain)
    with pytest.raises(FileExistsError, match="not an earlier export_hf Parquet file"):
        export_hf(store, plain, hook_points=["f32"], file_format="parquet")
    assert pa.parquet.read_table(plain).column_names == ["x"]
    out = tmp_path / "hf.parquet"
    export_hf(store, out, hook_points=["f32"], file_format="parquet")
    export_hf(store, out, hook_points=["f16"], file_format="parquet")     # a previous export is replaced
    assert pa.parquet.read_table(out).column_names[0] == "f16"


@pytest.mark.parametrize("file_format", ["arrow", "parquet"])
def test_hf_export_path_whose_folder_is_a_file_is_named(store, tmp_path, file_format):
    (tmp_path / "afile").write_text("keep")
    with pytest.raises(acs.errors.ArgumentValueError, match=r"its folder '.*afile' is not a folder"):
        export_hf(store, tmp_path / "afile" / "hf", hook_points=["f32"], file_format=file_format)
    assert (tmp_path / "afile").read_text() == "keep"


def test_hf_export_keeps_an_earlier_export_that_holds_files_of_the_user(store, tmp_path):
    out = tmp_path / "hf"
    export_hf(store, out, hook_points=["f32"])
    (out / "README.md").write_text("my notes on this export")
    with pytest.raises(FileExistsError, match=r"also holds \['README.md'\], which the export did not write"):
        export_hf(store, out, hook_points=["f16"])
    assert (out / "README.md").read_text() == "my notes on this export"
    assert datasets.load_from_disk(str(out)).column_names[0] == "f32"


def test_hf_export_in_groups_of_a_column_that_is_none_in_every_row(tmp_path):
    model = torch.nn.Linear(3, 2)
    path = tmp_path / "s.zarr"
    with torch.no_grad(), acs.ActivationScope(store=str(path)).track(model) as tracker:
        tracker.set_batch(note=[None, None, None], label=[0, 1, 2])   # note: an Arrow null column
        model(torch.randn(3, 3))
        model(torch.randn(3, 3))
    export_hf(str(path), tmp_path / "hf", columns=["note", "label"], context_size=2)
    hf = datasets.load_from_disk(str(tmp_path / "hf"))
    assert hf["note"] == [[None, None]] * 3 and hf["label"] == [[0, 1], [2, 0], [1, 2]]
    assert torch.equal(hf.with_format("torch")[:]["output"], acs.open_store(str(path))["output"].reshape(3, 2, 2))


def test_hf_export_never_replaces_a_datasets_dataset_of_the_user(store, tmp_path):
    corpus = datasets.Dataset.from_dict({"tokens": [[1, 2], [3, 4]]})
    folder = tmp_path / "corpus"
    corpus.save_to_disk(str(folder))                           # the user's own datasets folder
    with pytest.raises(FileExistsError, match="not an earlier export_hf export"):
        export_hf(store, folder, hook_points=["f32"])
    assert datasets.load_from_disk(str(folder))["tokens"] == [[1, 2], [3, 4]]
    one_file = tmp_path / "corpus.parquet"
    corpus.to_parquet(str(one_file))                           # and its own datasets Parquet file
    with pytest.raises(FileExistsError, match="not an earlier export_hf Parquet file"):
        export_hf(store, one_file, hook_points=["f32"], file_format="parquet")
    assert pa.parquet.read_table(one_file).column("tokens").to_pylist() == [[1, 2], [3, 4]]


@pytest.mark.parametrize("file_format", ["arrow", "parquet"])
def test_hf_export_keeps_files_named_like_its_temporary_ones(store, tmp_path, file_format):
    out = tmp_path / "hf"
    folder = tmp_path / "hf.tmp"                 # the user's folder, not ours
    folder.mkdir()
    (folder / "notes.txt").write_text("keep me")
    stream = tmp_path / "hf.stream.tmp"
    stream.write_text("keep me too")
    export_hf(store, out, hook_points=["f32"], file_format=file_format)
    assert (folder / "notes.txt").read_text() == "keep me" and stream.read_text() == "keep me too"
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("hf")) == ["hf", "hf.stream.tmp", "hf.tmp"]


@pytest.mark.parametrize("file_format", ["arrow", "parquet"])
def test_hf_export_of_no_rows_is_refused_and_writes_nothing(store, tmp_path, file_format):
    import pyarrow.compute as pc

    out = tmp_path / "hf"
    with pytest.raises(acs.errors.ArgumentValueError, match=r"no rows to export .* datasets cannot load a dataset of 0"):
        export_hf(store, out, hook_points=["f32"], filter=pc.field("label") == 5, file_format=file_format)
    with pytest.raises(acs.errors.ArgumentValueError, match=r"no rows to export"):
        export_hf(store, out, hook_points=["f32"], rows=[], context_size=2, drop_last=True, file_format=file_format)
    # the message names the argument that selected no row (it named rows= / filter= only)
    with pytest.raises(acs.errors.ArgumentValueError, match=r"no rows to export .* none selected by rows= / filter= / "
                                                            r"sample_ids="):
        export_hf(store, out, hook_points=["f32"], sample_ids=[], file_format=file_format)
    assert list(tmp_path.iterdir()) == [tmp_path / "s"]


def test_hf_export_of_token_rows_from_a_real_capture(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(30, 8), torch.nn.Linear(8, 8))
    tokens = torch.randint(1, 30, (4, 6))
    mask = torch.ones(4, 6, dtype=torch.bool)
    mask[2:, 4:] = False
    with acs.ActivationScope(store=str(tmp_path / "t.zarr"), storage_dtype=torch.bfloat16).track(model) as tracker:
        tracker.set_batch(attention_mask=mask, token_ids=tokens, label=[0, 1, 0, 1])
        model(tokens)
    export_hf(str(tmp_path / "t.zarr"), tmp_path / "t-hf")
    hf = datasets.load_from_disk(str(tmp_path / "t-hf")).with_format("torch")
    ds = ActivationDataset(str(tmp_path / "t.zarr"), columns=["token_ids", "pos", "label"])
    assert len(hf) == len(ds) == 20                       # padding never entered
    got, ours = hf[:], ds[:]
    assert torch.equal(got["1.output"], ours["1.output"].float())
    assert torch.equal(got["token_ids"], tokens[mask]) and torch.equal(got["label"], ours["label"])


def test_check_format_options_names_the_option_and_the_format():
    from activationscope.data import EXPORT_FORMAT_OPTIONS, check_format_options

    check_format_options("hf", context_size=4, drop_last=True, tensor_type=None, overwrite=False)
    check_format_options("parquet", tensor_type="fixed_size_list", overwrite=True, context_size=None)
    with pytest.raises(ArgumentValueError, match=r"option tensor_type= has no effect for the export format 'hf': it "
                                                 r"applies to the export format 'parquet' and the export format "
                                                 r"'arrow' only"):
        check_format_options("hf", tensor_type="fixed_shape_tensor")
    with pytest.raises(ArgumentValueError, match=r"option overwrite= has no effect for the export format 'hf'"):
        check_format_options("hf", overwrite=True)
    with pytest.raises(ArgumentValueError, match=r"option context_size= has no effect for the export format 'arrow'"):
        check_format_options("arrow", context_size=3)
    with pytest.raises(ArgumentValueError, match=r"option drop_last= applies only with option context_size="):
        check_format_options("hf", drop_last=True)
    with pytest.raises(ArgumentValueError, match=r"format must be one of \['parquet', 'arrow', 'hf'\], got 'csv'"):
        check_format_options("csv")
    with pytest.raises(ArgumentValueError, match=r"must be one of \['tensor_type'"):
        check_format_options("hf", batch=3)
    assert set(EXPORT_FORMAT_OPTIONS) == {"tensor_type", "compression", "overwrite", "context_size", "drop_last"}
    from activationscope import cli, data

    assert cli.EXPORT_FORMATS == data.EXPORT_FORMATS == ("parquet", "arrow", "hf")


def test_export_hf_refuses_drop_last_without_context_size(store, tmp_path):
    with pytest.raises(ArgumentValueError, match="option drop_last= applies only with option context_size="):
        export_hf(store, tmp_path / "hf", drop_last=True)
    assert not (tmp_path / "hf").exists()


def _transform_caches(path) -> list[str]:
    """Load the export and transform it as a user would: datasets writes cache-*.arrow files
    next to it."""
    hf = datasets.load_from_disk(str(path))
    hf.map(lambda row: {"twice": row["label"] * 2})
    hf.filter(lambda row: row["label"] == 1)
    return sorted(p.name for p in path.glob("cache-*.arrow"))


def test_hf_export_replaces_an_earlier_export_with_the_caches_datasets_wrote(store, arrays, tmp_path):
    out = tmp_path / "hf"
    export_hf(store, out, hook_points=["f32"], columns=["label"])
    caches = _transform_caches(out)
    assert len(caches) == 2
    export_hf(store, out, hook_points=["f16"], columns=["label"])   # replaced, caches of the old rows with it
    hf = datasets.load_from_disk(str(out))
    assert hf.column_names == ["f16", "label"] and len(hf) == N
    assert torch.equal(hf.with_format("torch", dtype=torch.float16)[:]["f16"], arrays["f16"])
    assert not list(out.glob("cache-*.arrow")) and not list(tmp_path.glob("*.tmp"))


@pytest.mark.parametrize("foreign", ["notes.txt", "cache-notes.arrow", "cache-dir.arrow", "cache-link.arrow",
                                     "tmpab12cd34"])
def test_hf_export_never_deletes_anything_else_next_to_the_caches(store, tmp_path, foreign):
    """Only datasets' cache-*.arrow Arrow streams go with an earlier export: a file of
    another kind (even named cache-*.arrow), a folder or a link is the user's."""
    out = tmp_path / "hf"
    export_hf(store, out, hook_points=["f32"], columns=["label"])
    caches = _transform_caches(out)
    target = tmp_path / "elsewhere.txt"
    target.write_text("keep me too")
    if foreign == "cache-dir.arrow":
        (out / foreign).mkdir()
        (out / foreign / "x").write_text("keep me")
    elif foreign == "cache-link.arrow":
        (out / foreign).symlink_to(target)
    else:
        (out / foreign).write_text("keep me")
    before = sorted((str(p.relative_to(out)), p.is_dir() or p.read_bytes()) for p in out.rglob("*"))
    with pytest.raises(FileExistsError, match=rf"now also holds \['{foreign}'\], which the export did not write"):
        export_hf(store, out, hook_points=["f16"])
    assert sorted((str(p.relative_to(out)), p.is_dir() or p.read_bytes()) for p in out.rglob("*")) == before
    assert all((out / c).is_file() for c in caches) and target.read_text() == "keep me too"


def test_hf_export_drop_last_takes_a_bool_only(store, tmp_path):
    # drop_last="no" (a true string) left out the rows of the last example without a word
    from activationscope.errors import ArgumentTypeError

    with pytest.raises(ArgumentTypeError, match="drop_last must be True or False, got 'no'"):
        export_hf(store, tmp_path / "hf", hook_points=["f32"], context_size=5, drop_last="no")
    assert not (tmp_path / "hf").exists()
    export_hf(store, tmp_path / "hf", hook_points=["f32"], context_size=5, drop_last=np.bool_(True))
    assert len(datasets.load_from_disk(str(tmp_path / "hf"))) == N // 5
