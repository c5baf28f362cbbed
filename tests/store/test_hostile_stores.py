"""Stores from someone else: damaged or hostile inputs are refused with StoreCorruptError
naming the file, never crash, hang, read or delete outside the store, or read as zeros
(issue 12; the rules are FORMAT.md §9)."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import threading
from pathlib import Path
from typing import Optional

import pytest
import torch

import activationscope as acs
from activationscope.errors import StoreCorruptError, StoreError
from activationscope.store import StoreWriter, open_store

from hostile import CHUNK_ROWS, FEATURE, HP, N_ROWS, SHARD_ROWS, edit_root, make_store, root, set_index, shard


@pytest.fixture
def plain(tmp_path):
    path = tmp_path / "s.zarr"
    return path, make_store(path)


@pytest.fixture
def zstd(tmp_path):
    path = tmp_path / "z.zarr"
    return path, make_store(path, compression="zstd")


def _victim(tmp_path: Path) -> Path:
    """A folder outside the store, shaped like what a hostile path would delete or read."""
    v = tmp_path / "victim"
    for sub in ("c/9/0", "rows/sample/part-000009.parquet", "x"):
        (v / sub).parent.mkdir(parents=True, exist_ok=True)
        (v / sub).write_bytes(b"keep me")
    return v


def _files(p: Path) -> dict[str, bytes]:
    return {str(q.relative_to(p)): q.read_bytes() for q in sorted(p.rglob("*")) if q.is_file()}


def _within(seconds: float, fn):
    """Run fn in a thread; fail (instead of hanging the suite) when it does not return in time."""
    out: dict = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"hung for more than {seconds} s"
    if "error" in out:
        raise out["error"]
    return out.get("value")


def test_valid_store_reads_back(plain, zstd):
    for path, data in (plain, zstd):
        s = open_store(path)
        assert torch.equal(s[HP], data) and s.verify() == []
        assert torch.equal(s.reductions[HP]["mean"], data.double().mean(0))
        assert s.row_table().column("label").to_pylist() == [i % 3 for i in range(N_ROWS)]


# ---------------------------------------------------------------- 2. paths reaching outside
@pytest.mark.parametrize("edit, field", [
    (lambda a: a["row_tables"].update({"../../victim": {"parts": [], "n_rows": 0}}), "row_tables key"),
    (lambda a: a["row_tables"]["sample"]["parts"].append("../victim/rows/sample/part-000009.parquet"), "parts"),
    (lambda a: a["row_tables"]["sample"]["parts"].append("rows/sample/../../../victim/x"), "parts"),
    (lambda a: a["arrays"][HP].update(path="../victim"), "path"),
    (lambda a: a["arrays"][HP].update(path="acts/../../victim"), "path"),
    (lambda a: a["arrays"][HP].update(path="/tmp/victim"), "path"),
    (lambda a: a["arrays"][HP].update(manifest="acts/../../victim/x"), "manifest"),
    (lambda a: a["reductions"][HP]["mean"].update(script="reductions/../../../../../../etc/passwd.pt"), "script"),
    (lambda a: a["reductions"][HP]["mean"].update(path="reductions/../../victim"), "path"),
    (lambda a: a["reductions"][HP]["mean"]["crc32c"].update({"/etc/passwd": 1}), "crc32c"),
])
def test_metadata_paths_outside_the_store_are_refused(tmp_path, plain, edit, field):
    path, _ = plain
    victim = _victim(tmp_path)
    before = _files(victim)
    edit_root(path, edit)
    with pytest.raises(StoreCorruptError, match=f"zarr.json field .*{field}.*inside the store|zarr.json field .*{field}"):
        open_store(path)
    with pytest.raises(StoreCorruptError):
        StoreWriter(path, resume=True).close()
    assert _files(victim) == before


def test_symlinked_folder_leaving_the_store(tmp_path, plain):
    """acts/0.output replaced by a link to a folder outside: resume deletes nothing there,
    reads read nothing from there."""
    path, _ = plain
    victim = tmp_path / "victim"
    shutil.copytree(path / "acts" / HP, victim)
    for extra in ("c/9/0", "c/7/0"):
        (victim / extra).parent.mkdir(parents=True, exist_ok=True)
        (victim / extra).write_bytes(b"keep me")
    before = _files(victim)
    shutil.rmtree(path / "acts" / HP)
    (path / "acts" / HP).symlink_to(victim)
    with pytest.raises(StoreCorruptError, match="outside the store"):
        StoreWriter(path, resume=True)
    with pytest.raises(StoreCorruptError, match="outside the store"):
        open_store(path)[HP]
    assert _files(victim) == before


def test_file_symlink_leaving_the_store(tmp_path, plain):
    path, _ = plain
    secret = tmp_path / "secret"
    secret.write_bytes(b"secret bytes")
    part = path / "rows" / "sample" / "part-000000.parquet"
    part.unlink()
    part.symlink_to(secret)
    with pytest.raises(StoreCorruptError, match="part-000000.parquet.*outside the store"):
        open_store(path).row_table()
    # 7. save() refuses the link: no byte of the target is copied
    with pytest.raises(StoreCorruptError, match="outside the store"):
        open_store(path).save(tmp_path / "copy.zarr")
    copied = tmp_path / "copy.zarr"
    assert not any(b"secret bytes" in q.read_bytes() for q in copied.rglob("*") if q.is_file())


# ---------------------------------------------------------------- 3. hangs and unbounded reads
@pytest.mark.parametrize("where", ["shard", "root", "manifest", "part"])
def test_fifo_instead_of_a_file(plain, where):
    path, _ = plain
    target = {"shard": shard(path, 1), "root": path / "zarr.json", "manifest": path / "acts" / HP / "manifest.json",
              "part": path / "rows" / "sample" / "part-000000.parquet"}[where]
    target.unlink()
    os.mkfifo(target)

    def read():
        s = open_store(path)
        problems = s.verify()  # a FIFO manifest is only read by verify: reported there
        assert any("must be a regular file, got a FIFO" in p for p in problems), problems
        s[HP].sum()
        s.row_table()

    with pytest.raises(StoreCorruptError, match="must be a regular file, got a FIFO"):
        _within(20, read) if where != "manifest" else (_within(20, read), open_store(path).info())



def _every_read(path: Path) -> None:
    """Every read path of a store (views, rows, row tables, reductions, dataset, save);
    raises at the first refusal."""
    s = open_store(path)
    s.info()
    for hp in s.hook_points:
        s[hp].sum()
        s.rows(hp, 0, s.n_rows(hp)).sum()
    for kind in ("sample", "token"):
        s.row_table(kind)
    for hp in s.reductions:
        for v in s.reductions[hp].values():
            v.sum()
    ds = acs.ActivationDataset(path)
    ds[0:len(ds)]
    s.save(path.parent / (path.name + f".copy{len(list(path.parent.iterdir()))}"))


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_fifo_in_place_of_any_file(tmp_path, compression):
    """Each file of a store in turn (documents, manifest, shards, row-table part, reduction
    data) replaced by a FIFO: every read path and verify return within seconds, verify names
    the file, and a read that needs it raises StoreCorruptError (never blocks)."""
    src = tmp_path / "src.zarr"
    make_store(src, compression=compression, n_rows=96)
    keys = sorted(str(q.relative_to(src)) for q in src.rglob("*") if q.is_file() and not q.name.startswith("."))
    assert {"zarr.json", f"acts/{HP}/zarr.json", f"acts/{HP}/manifest.json", f"acts/{HP}/c/0/0",
            "rows/sample/part-000000.parquet"} <= set(keys), keys
    for i, key in enumerate(keys):
        path = tmp_path / f"case{i}" / "s.zarr"
        shutil.copytree(src, path)
        (path / key).unlink()
        os.mkfifo(path / key)
        if key == "zarr.json":
            with pytest.raises(StoreCorruptError, match="must be a regular file, got a FIFO"):
                _within(20, lambda: open_store(path))
            continue
        problems = _within(20, lambda: open_store(path).verify())
        assert any(key in p and "FIFO" in p for p in problems), (key, problems)
        try:
            _within(20, lambda: _every_read(path))
        except StoreCorruptError as e:
            assert "must be a regular file, got a FIFO" in str(e) and key in str(e), (key, e)
        else:
            raise AssertionError(f"every read of a store with a FIFO in place of {key!r} succeeded")
        import zarr  # a plain zarr-python read of the same arrays goes through the same checks

        z = open_store(path)._backend.zarr_store(read_only=True)
        if key == f"acts/{HP}/zarr.json" or key.startswith(f"acts/{HP}/c/"):
            with pytest.raises(StoreCorruptError, match="got a FIFO"):
                _within(20, lambda: zarr.open_array(z, path=f"acts/{HP}", mode="r")[:])



@pytest.mark.parametrize("kind", ["fifo", "dir", "link"])
def test_writer_lock_that_is_not_a_regular_file(tmp_path, kind):
    """The writer lock is opened the same way: a FIFO, folder or link in its place is refused
    (never blocks, never follows the link) and the store is left as it was."""
    path = tmp_path / "s.zarr"
    make_store(path, n_rows=64)
    lock = path / ".activationscope-writer.lock"
    lock.unlink(missing_ok=True)
    target = tmp_path / "elsewhere"
    target.write_bytes(b"keep")
    {"fifo": lambda: os.mkfifo(lock), "dir": lock.mkdir, "link": lambda: lock.symlink_to(target)}[kind]()
    before = root(path)
    with pytest.raises(StoreCorruptError, match="writer lock .* must be a regular file"):
        _within(20, lambda: StoreWriter(path, resume=True))
    assert target.read_bytes() == b"keep" and root(path) == before
    assert open_store(path).n_rows(HP) == 64

def test_root_linked_to_dev_zero_and_oversized(plain):
    path, _ = plain
    (path / "zarr.json").unlink()
    (path / "zarr.json").symlink_to("/dev/zero")
    with pytest.raises(StoreCorruptError, match="outside the store"):
        _within(20, lambda: open_store(path))
    (path / "zarr.json").unlink()
    with open(path / "zarr.json", "wb") as f:  # sparse: 1 GiB that takes no disk
        f.truncate(1 << 30)
    with pytest.raises(StoreCorruptError, match="zarr.json.*1073741824 bytes, more than"):
        _within(20, lambda: open_store(path))


def test_directory_instead_of_a_shard(plain):
    path, _ = plain
    shard(path, 2).unlink()
    shard(path, 2).mkdir()
    with pytest.raises(StoreCorruptError, match="must be a regular file, got a directory"):
        open_store(path)[HP]


# ---------------------------------------------------------------- 4. memory from metadata
def test_huge_n_rows(plain):
    path, _ = plain
    edit_root(path, lambda a: a["arrays"][HP].update(n_rows=1 << 40))
    s = open_store(path)
    problems = _within(30, s.verify)
    assert 1 <= len(problems) <= 21 and any("have no manifest entry" in p for p in problems), problems
    # the root's count is checked against the array's own document before a row is read
    with pytest.raises(StoreCorruptError, match=r"acts/0.output/zarr.json holds 320 rows .*1099511627776 rows"):
        s[HP]
    with pytest.raises(StoreCorruptError, match=r"acts/0.output/zarr.json holds 320 rows .*1099511627776 rows"):
        s[HP, (1 << 40) - 3:]


@pytest.mark.parametrize("shape", [[6 << 27], [1 << 20, 1 << 20], [3]])
def test_reduction_shape_checked_against_its_file(plain, shape):
    path, _ = plain
    edit_root(path, lambda a: a["reductions"][HP]["mean"].update(shape=shape))
    with pytest.raises(StoreCorruptError, match=r"mean.*(holds 64 bytes, but its shape|shape must be|says data_type "
                                                r"'float64', shape \[8\].*the two disagree)"):
        open_store(path).reductions[HP]["mean"]


@pytest.mark.parametrize("dtype", ["int64", "complex64", "uint64"])
def test_reduction_dtype_checked_against_its_document(plain, dtype):
    """A root that says another dtype of the same itemsize for a reduction is refused, naming
    its array document and both values; before, the float64 bytes were returned reinterpreted
    as that dtype and verify returned []."""
    path, _ = plain
    # (a built-in kind of a dtype none stores is refused by its readers: test_a_built_in_reduction_of_a_dtype_it_never_stores)
    kind = "mean" if dtype == "int64" else "eager"
    edit_root(path, lambda a: a["reductions"][HP]["mean"].update(dtype=dtype, kind=kind))
    s = open_store(path)
    message = (rf"reduction 'mean': its array document reductions/{HP}/mean/zarr.json says data_type 'float64', "
               rf"shape \[8\] \(dtype 'float64'\), but the root document zarr.json says dtype '{dtype}'")
    with pytest.raises(StoreCorruptError, match=message):
        s.reductions[HP]["mean"]
    assert any("the two disagree" in p for p in s.verify())
    (path / "reductions" / HP / "mean" / "zarr.json").unlink()
    with pytest.raises(StoreCorruptError, match=rf"its array document reductions/{HP}/mean/zarr.json is missing"):
        open_store(path).reductions[HP]["mean"]


REDUCTION_DOCUMENT_LIES = {
    "big-endian": (lambda d: d["codecs"][0]["configuration"].update(endian="big"), "codecs"),
    "chunk key separator '.'": (lambda d: d["chunk_key_encoding"].update(configuration={"separator": "."}),
                                "chunk_key_encoding"),
    "v2 chunk keys": (lambda d: d.update(chunk_key_encoding={"name": "v2", "configuration": {"separator": "/"}}),
                      "chunk_key_encoding"),
    "another chunk grid": (lambda d: d["chunk_grid"]["configuration"].update(chunk_shape=[2]), "chunk_grid"),
    "a codec added": (lambda d: d["codecs"].append({"name": "crc32c"}), "codecs"),
    "a storage transformer": (lambda d: d.update(storage_transformers=[{"name": "x"}]), "storage_transformers"),
}


@pytest.mark.parametrize("array", ["mean", "mean.state.mean"])
@pytest.mark.parametrize("lie", list(REDUCTION_DOCUMENT_LIES))
def test_reduction_document_that_plain_zarr_would_misread(tmp_path, lie, array):
    """A reduction's array document edited to say big-endian bytes, another chunk key or grid
    made zarr-python and xarray read other values (byte-swapped numbers, fill values) from the
    intact chunk, while activationscope read it right and verify returned []. The document is
    now checked against the format's one-chunk layout: reads of the reduction and verify name it."""
    import zarr

    path = tmp_path / "s.zarr"
    model = torch.nn.Sequential(torch.nn.Linear(4, 3))
    with acs.ActivationScope(store=str(path), reductions=["mean"]).track(model), torch.no_grad():
        model(torch.randn(6, 4))
    s = open_store(path)
    assert s.verify() == []
    mean = s.reductions["0.output"]["mean"].numpy()
    assert (zarr.open_group(str(path), mode="r")["reductions/0.output/mean"][...] == mean).all()
    edit, field = REDUCTION_DOCUMENT_LIES[lie]
    doc_path = path / "reductions" / "0.output" / array / "zarr.json"
    doc = json.loads(doc_path.read_text())
    edit(doc)
    doc_path.write_text(json.dumps(doc))
    s = open_store(path)
    problems = s.verify()
    assert len(problems) == 1 and f"reductions/0.output/{array}/zarr.json field {field} must be" in problems[0], problems
    if array == "mean":
        with pytest.raises(StoreCorruptError, match=rf"its array document reductions/0.output/mean/zarr.json field "
                                                    rf"{field} must be"):
            s.reductions["0.output"]["mean"]
    else:
        torch.testing.assert_close(s.reductions["0.output"]["mean"].numpy(), mean)

@pytest.mark.parametrize("field, value", [
    ("feature_shape", [1 << 40]), ("feature_shape", [-1]), ("feature_shape", [2.5]), ("n_rows", -1),
    ("n_rows", 1 << 60), ("chunk_rows", 0), ("shard_rows", 63), ("dtype", "float128"), ("row_kind", "pixel"),
    ("compression", {"name": "lzma"}), ("n_rows", "320"), ("n_rows", True), ("follows_row_table", "yes"),
])
def test_array_fields_out_of_range(plain, field, value):
    path, _ = plain
    edit_root(path, lambda a: a["arrays"][HP].update({field: value}))
    with pytest.raises(StoreCorruptError, match=rf"zarr.json field arrays\['0.output'\]\.{field} must be"):
        open_store(path)



@pytest.mark.parametrize("field", ["arrays", "row_tables", "reductions"])
def test_root_tables_that_are_null(plain, field):
    """A root whose arrays, row tables or reductions are JSON null (not an object) is refused
    at open, naming the field, on every path that reads it (never a TypeError)."""
    from activationscope import cli

    path, _ = plain
    edit_root(path, lambda a: a.update({field: None}))
    message = rf"zarr.json field {field} must be a JSON object, got None"
    with pytest.raises(StoreCorruptError, match=message):
        open_store(path)
    with pytest.raises(StoreCorruptError, match=message):
        acs.ActivationDataset(path)
    for command in (["info"], ["verify"], ["export", "--format", "parquet", "--out", str(path.parent / "e.parquet")]):
        assert cli.main([command[0], str(path), *command[1:]]) == 1


@pytest.mark.parametrize("kind", ["sample", "token"])
def test_verify_names_a_row_table_the_root_does_not_list(tmp_path, kind):
    """A root without the row table its arrays follow reads that table as 0 rows (datasets and
    exports of the arrays then fail): verify reports it instead of returning []. Without the
    sample table, the root's n_samples no longer matches it: refused at open."""
    path = tmp_path / "t.zarr"
    w = StoreWriter(path)
    a = w.open_array(HP, (FEATURE,), torch.float32, "token")
    a.append(torch.randn(5, FEATURE))
    w.add_batch(2, [0, 1], torch.tensor([[True, True, True], [True, True, False]]))
    w.close()
    assert open_store(path).verify() == []
    edit_root(path, lambda a: a["row_tables"].pop(kind))
    if kind == "sample":  # the root's n_samples (2) is checked against the table's rows at open
        with pytest.raises(StoreCorruptError, match=r"t\.zarr'.*field n_samples must be the sample row table's n_rows "
                           r"\(0: zarr.json lists no row_tables\['sample'\]\), got 2"):
            open_store(path)
        return
    problems = open_store(path).verify()
    if kind == "token":
        assert problems == [f"hook point {HP!r}: n_rows 5 exceeds the 0 rows of the token row table it follows "
                            "(zarr.json lists no row_tables['token'])"], problems
        with pytest.raises(StoreCorruptError, match=r"token row table .* has 0 rows, but hook point '0.output', "
                           r"which follows it, has 5: .* store.verify\(\)"):
            acs.ActivationDataset(path, columns=["sample_id"])[0:1]


def test_verify_names_row_table_parts_that_do_not_fit_together(plain):
    """A row-table part that is intact (its crc32c recorded) and readable Parquet, but whose
    columns do not make one table (a column repeated): row_table() refuses the table, and
    verify reports it; before, verify returned [] while every read of the table failed."""
    import io

    import google_crc32c
    import pyarrow.parquet as pq

    path, _ = plain
    key = root(path)["attributes"]["activationscope"]["row_tables"]["sample"]["parts"][0]
    t = pq.read_table(path / key)
    t = t.append_column("label", t.column("label"))
    sink = io.BytesIO()
    pq.write_table(t, sink)
    (path / key).write_bytes(sink.getvalue())
    edit_root(path, lambda a: a["row_tables"]["sample"]["crc32c"].update({key: int(google_crc32c.value(sink.getvalue()))}))
    s = open_store(path)
    with pytest.raises(StoreCorruptError, match="the parts of row table 'sample' do not fit together"):
        s.row_table("sample")
    problems = s.verify()
    assert len(problems) == 1 and "row table 'sample'" in problems[0] and "do not fit together" in problems[0], problems


@pytest.mark.parametrize("options, field", [({"ddof": "x"}, "options['ddof']"), ({"ddof": None}, "options['ddof']"),
                                            ({"ddof": True}, "options['ddof']"), ("ddof=1", "options"),
                                            ({"bins": [4]}, "options['bins']")])
def test_reduction_options_that_are_not_numbers(tmp_path, options, field):
    """A reduction entry's options (a resume, a commit of rank stores and report rebuild or
    rescale the reduction from them) are numbers: anything else is refused at open naming
    the field; before, report (and a resume) failed on it with a raw ValueError."""
    from activationscope import cli
    from activationscope.reductions import make_reduction

    path = tmp_path / "r.zarr"
    data = make_store(path)
    w = StoreWriter(path, resume=True)
    w.open_array(HP, (FEATURE,), torch.float32, "sample")
    r = make_reduction("var")
    r.update(data)
    w.add_reductions(HP, "var", r)
    w.close()
    edit_root(path, lambda a: a["reductions"][HP]["var"].update(options=options))
    with pytest.raises(StoreCorruptError, match=re.escape(f"field reductions['{HP}']['var'].{field} must be")):
        open_store(path)
    assert cli.main(["report", str(path), "--out", str(tmp_path / "report")]) == 1


@pytest.mark.parametrize("configuration", ["/etc/passwd", ["little"], 7])
def test_array_document_whose_bytes_codec_configuration_is_not_an_object(plain, configuration):
    """The inner bytes codec's configuration of an array document that is not a JSON object
    is named as a disagreement with the root (reads, info and verify); before, every one of
    them failed with AttributeError: 'str' object has no attribute 'get'."""
    path, _ = plain
    doc_path = path / "acts" / HP / "zarr.json"
    doc = json.loads(doc_path.read_text())
    doc["codecs"][0]["configuration"]["codecs"][0]["configuration"] = configuration
    doc_path.write_text(json.dumps(doc))
    s = open_store(path)
    message = "field codecs\\[0\\].configuration.codecs must start with the bytes codec"
    with pytest.raises(StoreCorruptError, match=message):
        s[HP]
    with pytest.raises(StoreCorruptError, match=message):
        s.info()
    assert any("must start with the bytes codec" in p for p in s.verify())


@pytest.mark.parametrize("value", [1 << 40, "float128", [], True])
def test_root_storage_dtype_that_is_not_a_dtype_name(plain, value):
    """The root's storage_dtype (what a resume compares its own with, and names in its error)
    is null or a dtype name: anything else is refused at open and on resume, naming the
    field; before, a resume failed with TypeError building its message."""
    path, _ = plain
    edit_root(path, lambda a: a.update(storage_dtype=value))
    with pytest.raises(StoreCorruptError, match=r"zarr.json field storage_dtype must be null or one of"):
        open_store(path)
    with pytest.raises(StoreCorruptError, match=r"zarr.json field storage_dtype must be null or one of"):
        StoreWriter(path, resume=True)


def test_root_that_lost_its_arrays_field(plain):
    """A root that records samples but has no ``arrays`` field (a truncated or edited
    document) is refused at open; before, it opened as a store with no hook points."""
    path, _ = plain
    assert open_store(path).n_samples > 0
    edit_root(path, lambda a: a.pop("arrays"))
    with pytest.raises(StoreCorruptError, match=r"zarr.json field arrays must be present in a root that records \d+ "
                       r"samples, got 'no such field'"):
        open_store(path)
    with pytest.raises(StoreCorruptError, match="field arrays must be present"):
        acs.ActivationDataset(path)


@pytest.mark.parametrize("codec, field", [
    ({"name": "zstd", "configuration": {"level": ""}}, "configuration.level"),
    ({"name": "zstd", "configuration": {"level": [[[[[]]]]]}}, "configuration.level"),
    ({"name": "zstd", "configuration": {"level": 1.5}}, "configuration.level"),
    ({"name": "zstd", "configuration": {"level": True}}, "configuration.level"),
    ({"name": "zstd", "configuration": {"level": 2**40}}, "configuration.level"),
    ({"name": "zstd", "configuration": {"level": 3, "checksum": "yes"}}, "configuration.checksum"),
    ({"name": "zstd", "configuration": {"level": 3, "dictionary": "x"}}, "configuration"),
    ({"name": "zstd", "configuration": []}, "configuration"),
    ({"name": "blosc", "configuration": {"cname": "lz5"}}, "configuration.cname"),
    ({"name": "blosc", "configuration": {"cname": "lz4", "clevel": 10}}, "configuration.clevel"),
    ({"name": "blosc", "configuration": {"shuffle": 1}}, "configuration.shuffle"),
    ({"name": "blosc", "configuration": {"blocksize": -1}}, "configuration.blocksize"),
    ({"name": "blosc", "configuration": {"typesize": "4"}}, "configuration.typesize"),
    ({"name": [], "configuration": {}}, ""),
    ({"name": "zstd", "configuration": {}, "id": "zstd"}, ""),
    ("zstd", ""),
])
def test_ill_typed_codec_configuration(zstd, codec, field):
    """Every field of the compression codec (it configures the decoder, and a resumed
    writer's encoder) is checked for type and range: StoreCorruptError naming the file and
    the field, at open (before any decode), never a raw error."""
    path, _ = zstd
    edit_root(path, lambda a: a["arrays"][HP].update({"compression": codec}))
    dotted = rf"\.{re.escape(field)}" if field else ""
    with pytest.raises(StoreCorruptError, match=rf"zarr.json field arrays\['0.output'\]\.compression{dotted} must be"):
        open_store(path)
    with pytest.raises(StoreCorruptError, match="compression"):
        StoreWriter(path, resume=True)


# ---------------------------------------------------------------- 5. silent zeros, wrong bytes
@pytest.mark.parametrize("fixture", ["plain", "zstd"])
def test_missing_shard_is_an_error_not_zeros(request, fixture):
    path, data = request.getfixturevalue(fixture)
    shard(path, 2).unlink()
    s = open_store(path)
    assert torch.equal(s[HP, :128], data[:128])  # rows of other shards still read
    with pytest.raises(StoreCorruptError, match=r"c/2/0.*missing"):
        s[HP, 130:140]
    with pytest.raises(StoreCorruptError, match=r"c/2/0.*missing"):
        s[HP]
    assert any("c/2/0" in p for p in s.verify())


@pytest.mark.parametrize("fixture", ["plain", "zstd"])
@pytest.mark.parametrize("entry", ["past the end", "absent"])
def test_index_entry_past_the_end_or_absent(request, fixture, entry):
    path, data = request.getfixturevalue(fixture)
    off, nb = (10 << 20, 512) if entry == "past the end" else (2**64 - 1, 2**64 - 1)
    set_index(path, 1, 2, off, nb)
    s = open_store(path)
    match = "past the end" if entry == "past the end" else "missing from the shard index"
    with pytest.raises(StoreCorruptError, match=match):
        s[HP, 64 + 2 * 16:64 + 3 * 16]
    assert torch.equal(s[HP, :64], data[:64])
    assert any(match in p for p in s.verify())


def test_chunks_out_of_order_read_right(plain):
    """A valid shard whose chunks are not back to back (another Zarr writer) reads right."""
    path, data = plain
    p = shard(path, 0)
    raw = bytearray(p.read_bytes())
    c = 16 * 8 * 4
    raw[0:c], raw[c:2 * c] = raw[c:2 * c], raw[0:c]
    p.write_bytes(bytes(raw))
    set_index(path, 0, 0, c, c)
    set_index(path, 0, 1, 0, c)
    s = open_store(path)
    assert torch.equal(s[HP, :64], data[:64]) and torch.equal(s[HP], data)


def test_uncompressed_chunk_of_another_size(plain):
    path, _ = plain
    set_index(path, 0, 1, 512, 500)
    with pytest.raises(StoreCorruptError, match="500 bytes, expected chunk_bytes 512"):
        open_store(path)[HP, :64]


@pytest.mark.parametrize("fixture", ["plain", "zstd"])
def test_shard_shorter_than_its_index(request, fixture):
    path, data = request.getfixturevalue(fixture)
    shard(path, 4).write_bytes(b"\0" * 40)  # a 68-byte index cannot fit
    s = open_store(path)
    with pytest.raises(StoreCorruptError, match=r"c/4/0.*truncated: 40 bytes, fewer than its 68-byte index"):
        s[HP, 256:]
    assert torch.equal(s[HP, :256], data[:256])


def test_row_table_part_listed_twice_or_missing(plain):
    path, _ = plain
    parts = root(path)["attributes"]["activationscope"]["row_tables"]["sample"]["parts"]
    edit_root(path, lambda a: a["row_tables"]["sample"]["parts"].insert(1, parts[0]))
    with pytest.raises(StoreCorruptError, match="listed more than once"):
        open_store(path)
    import pyarrow.parquet as pq

    left = N_ROWS - pq.read_metadata(path / parts[0]).num_rows
    edit_root(path, lambda a: a["row_tables"]["sample"].update(parts=parts[1:]))
    s = open_store(path)
    assert any(f"parts hold {left} rows" in p and "n_rows 320" in p for p in s.verify())
    with pytest.raises(StoreCorruptError, match=f"{left} rows in its parts|lists no parts.*n_rows 320"):
        s.row_table()


# ---------------------------------------------------------------- 6. errors that name the file
@pytest.mark.parametrize("fixture", ["plain", "zstd"])
def test_corrupt_shard_index(request, fixture):
    path, _ = request.getfixturevalue(fixture)
    p = shard(path, 3)
    raw = bytearray(p.read_bytes())
    raw[-10] ^= 0xFF
    p.write_bytes(bytes(raw))
    with pytest.raises(StoreCorruptError, match=r"c/3/0.*shard index crc32c mismatch.*activationscope verify"):
        open_store(path)[HP]


def test_truncated_root(plain):
    path, _ = plain
    raw = (path / "zarr.json").read_bytes()
    (path / "zarr.json").write_bytes(raw[: len(raw) // 2])
    with pytest.raises(StoreCorruptError, match="zarr.json is not valid JSON.*activationscope verify"):
        open_store(path)
    with pytest.raises(StoreCorruptError, match="zarr.json is not valid JSON"):
        StoreWriter(path, resume=True)


@pytest.mark.parametrize("version", ["two", None, 1.9, True, 0, [1]])
def test_bad_format_versions(plain, version):
    path, _ = plain
    edit_root(path, lambda a: a["format"].update(version=version))
    with pytest.raises(StoreCorruptError, match="format.version must be a positive int"):
        open_store(path)


def test_newer_format_version(plain):
    path, _ = plain
    # (2: stores committed from rank stores, 3: stores that keep reductions only, 4: segmented manifests)
    edit_root(path, lambda a: a["format"].update(version=5))
    with pytest.raises(StoreError, match="format version 5.*upgrade activationscope") as e:
        open_store(path)
    assert not isinstance(e.value, StoreCorruptError)


def test_corrupt_compressed_chunk_names_the_shard(zstd):
    path, _ = zstd
    p = shard(path, 0)
    raw = bytearray(p.read_bytes())
    raw[0:4] = b"\0\0\0\0"  # the zstd magic number
    p.write_bytes(bytes(raw))
    with pytest.raises(StoreCorruptError, match=r"c/0/0.*crc32c mismatch"):  # caught by the chunk's checksum
        open_store(path)[HP, :16]


def test_corrupt_parquet_part(plain):
    path, _ = plain
    edit_root(path, lambda a: a["row_tables"]["sample"].pop("crc32c"))  # no checksum to catch it first
    key = root(path)["attributes"]["activationscope"]["row_tables"]["sample"]["parts"][-1]
    (path / key).write_bytes(b"PAR1 garbage")
    with pytest.raises(StoreCorruptError, match=f"{key}' is not a readable Parquet file"):
        open_store(path).row_table()


# ---------------------------------------------------------------- 8. verify = every read succeeds
def test_store_killed_before_its_first_commit_verifies(tmp_path):
    path = tmp_path / "early.zarr"
    w = StoreWriter(path, chunk_rows=16, shard_bytes=1 << 20)
    a = w.open_array(HP, (8,), torch.float32, "sample")
    w.add_batch(0)  # a forward that gave it no row
    w.commit()  # publishes the array with n_rows 0 (no document yet)
    a.append(torch.randn(5, 8))  # rows written, never committed
    w._core.drain()
    killed = tmp_path / "killed.zarr"
    shutil.copytree(path, killed, ignore=shutil.ignore_patterns(".activationscope-writer.lock"))
    w.close()
    assert not (killed / "acts" / HP / "zarr.json").exists()
    s = open_store(killed)
    assert s.n_rows(HP) == 0 and s.verify() == [] and s[HP].shape == (0, 8)


def _shrink_doc(path):
    p = path / "acts" / HP / "zarr.json"
    doc = json.loads(p.read_text())
    doc["shape"][0] = 100
    p.write_text(json.dumps(doc))


def _drop_manifest_chunk(path):
    p = path / "acts" / HP / "manifest.json"
    doc = json.loads(p.read_text())
    doc["shards"][1]["chunks"].pop(2)
    p.write_text(json.dumps(doc))


EDITS = {
    "array document shape": _shrink_doc,
    "manifest chunk dropped": _drop_manifest_chunk,
    "chunk_rows": lambda p: edit_root(p, lambda a: a["arrays"][HP].update(chunk_rows=32)),
    "dtype": lambda p: edit_root(p, lambda a: a["arrays"][HP].update(dtype="float16", storage_dtype="float16")),
    "feature_shape": lambda p: edit_root(p, lambda a: a["arrays"][HP].update(feature_shape=[4])),
    "compression": lambda p: edit_root(p, lambda a: a["arrays"][HP].update(compression={"name": "zstd", "configuration": {"level": 3}})),
    "n_rows + 1": lambda p: edit_root(p, lambda a: a["arrays"][HP].update(n_rows=N_ROWS + 1)),
    "row table n_rows": lambda p: edit_root(p, lambda a: a["row_tables"]["sample"].update(n_rows=300)),
    "n_samples": lambda p: edit_root(p, lambda a: a.update(n_samples=300)),
    "shard_rows": lambda p: edit_root(p, lambda a: a["arrays"][HP].update(shard_rows=128)),
    "reduction dtype": lambda p: edit_root(p, lambda a: a["reductions"][HP]["mean"].update(dtype="float32")),
}


@pytest.mark.parametrize("name", list(EDITS))
def test_verify_finds_every_metadata_edit_that_breaks_a_read(plain, name):
    """Either open_store refuses the store, or verify() reports it, or every read succeeds and
    returns the rows that were written."""
    path, data = plain
    EDITS[name](path)
    try:
        s = open_store(path)
    except StoreCorruptError:
        return
    problems = s.verify()
    if problems:
        return
    pytest.fail(f"verify() passed a store edited at {name!r}")


# ---------------------------------------------------------------- 9. scripts are never loaded
def test_reduction_scripts_never_loaded(plain, monkeypatch):
    path, data = plain

    def refuse(*a, **k):
        raise AssertionError("torch.jit.load called")

    monkeypatch.setattr(torch.jit, "load", refuse)
    script = path / "reductions" / HP / "mean.pt"
    script.write_bytes(b"not a script")
    import google_crc32c

    key = f"reductions/{HP}/mean.pt"
    edit_root(path, lambda a: (a["reductions"][HP]["mean"].update(script=key),
                               a["reductions"][HP]["mean"]["crc32c"].update({key: int(google_crc32c.value(b"not a script"))})))
    s = open_store(path)
    assert torch.equal(s.reductions[HP]["mean"], data.double().mean(0))
    s.verify()
    s.info()
    assert s.reduction_script(HP, "mean") == b"not a script"


@pytest.mark.parametrize("field, value", [("path", f"reductions/{HP}/var"), ("script", f"reductions/{HP}/absmax.pt")])
def test_reduction_entry_pointed_at_another_file(tmp_path, field, value):
    """A reduction entry whose path (or script) was edited to name another reduction's file,
    intact and of the same size, is refused: its crc32c map lists the files it was written
    with, not that one. Before, the other file's values were returned as this reduction's and
    verify returned []."""
    path = tmp_path / "r.zarr"
    data = make_store(path)
    script = tmp_path / "absmax.pt"
    script.write_bytes(b"scripted module bytes")

    class Var:
        kind = "var"

        def result(self):
            return {"var": data.double().var(0, unbiased=False)}

    class Absmax:
        kind = "script"

        def result(self):
            return {"value": data.abs().amax(0)}

    w = StoreWriter(path, resume=True)
    w.open_array(HP, (FEATURE,), torch.float32, "sample")
    w.add_reductions(HP, "var", Var())
    w.add_reductions(HP, "absmax", Absmax(), script_path=script)
    w.close()
    s = open_store(path)
    assert s.verify() == [] and s.reduction_script(HP, "absmax") == b"scripted module bytes"
    edit_root(path, lambda a: a["reductions"][HP]["mean"].update({field: value}))
    # (a file of another entry: refused when the store opens, as two arrays of one path are)
    with pytest.raises(StoreCorruptError, match=rf"reductions\['{HP}'\]\['\w+'\]\.{field} must be unique, got "
                                                rf"\"{value} \(also the file of reductions\['{HP}'\]\['(mean|var|absmax)'\]"):
        open_store(path)


def _row_sum(acc: Optional[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    s = x.double().sum(0)
    return s if acc is None else acc + s


def _row_max(acc: Optional[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    m = x.double().amax(0)
    return m if acc is None else torch.maximum(acc, m)


@pytest.mark.parametrize("edit", ["another hook point's entry", "another entry of its hook point"])
def test_a_reduction_entry_replaced_by_another_entry_whole_is_refused(tmp_path, edit):
    """A root edited so that reduction 'mean' of one hook point is the entry of another (its
    path, state and crc32c map together: every checksum matches) read the other's values as
    this one's, and verify returned []; refused when the store opens, naming the entry."""
    path = tmp_path / "r.zarr"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()).eval()
    with acs.ActivationScope(store=str(path), reductions=["mean", _row_sum, _row_max]).track(model) as tr, \
            torch.no_grad():
        model(torch.randn(6, 4))
    assert open_store(path).verify() == []
    if edit == "another hook point's entry":
        change, match = (lambda a: a["reductions"]["0.output"].update(mean=a["reductions"]["1.output"]["mean"])), \
            r"reductions\['0.output'\]\['mean'\].path must be a key in the hook point's folder 'reductions/0.output/', " \
            r"got 'reductions/1.output/mean'"
    else:
        change, match = (lambda a: a["reductions"]["0.output"].update(_row_max=a["reductions"]["0.output"]["_row_sum"])), \
            r"reductions\['0.output'\]\['_row_(max|sum)'\].(path|script) must be unique, got \"reductions/0.output/_row_sum"
    edit_root(path, change)
    with pytest.raises(StoreCorruptError, match=match):
        open_store(path)


def test_one_shard_folder_linked_outside_among_real_ones(tmp_path, plain):
    """Folders already read are remembered as inside the store; a shard folder that is a link
    leaving it is still refused when its shard is first read, and links that stay inside the
    store are followed."""
    path, _ = plain
    store = open_store(path)
    want = store[HP].clone()
    moved = tmp_path / "elsewhere"
    shutil.move(path / "acts" / HP / "c" / "3", moved)
    (path / "acts" / HP / "c" / "3").symlink_to(moved)
    with pytest.raises(StoreCorruptError, match=r"c/3/0.*outside the store"):
        open_store(path)[HP]
    # the same folder moved inside the store (a link to it stays inside): read as before
    os.unlink(path / "acts" / HP / "c" / "3")
    shutil.move(moved, path / "kept-3")
    (path / "acts" / HP / "c" / "3").symlink_to(path / "kept-3")
    torch.testing.assert_close(open_store(path)[HP], want)


@pytest.mark.parametrize("bad", [["x", 0, 8, 1], [0, -1, 8, 1], [9, 0, 8, 1], [0, 0, 8, 1 << 32], [True, 0, 8, 1], [0, 0]])
def test_malformed_manifest_chunk_entry_is_caught_before_its_use(zstd, bad):
    """A manifest chunk entry is checked when its shard's entries are first used (a decoded
    read, verify), not for every chunk at each open: the read of that shard and verify name
    the manifest and the field; shards before it still read."""
    path, data = zstd
    man = path / "acts" / HP / "manifest.json"
    doc = json.loads(man.read_text())
    doc["shards"][2]["chunks"][1] = bad
    man.write_text(json.dumps(doc))
    store = open_store(path)
    torch.testing.assert_close(store.rows(HP, 0, 2 * SHARD_ROWS), data[: 2 * SHARD_ROWS])
    with pytest.raises(StoreCorruptError, match=r"manifest\.json field shards\[2\]\.chunks\[\] must be \[slot 0\.\.3"):
        store.rows(HP, 2 * SHARD_ROWS, 3 * SHARD_ROWS)
    assert any("shards[2].chunks[]" in p for p in open_store(path).verify())


# ---------------------------------------------------------------- 10. the root against the array document
#: Lies of the root's entry of an array that its own document (acts/0.output/zarr.json) contradicts:
#: (edit of the entry, what the error says). Each would read rows of another type or shape, or
#: lay the rows out by another chunk grid (rule 17).
ROOT_LIES = {
    "int32 (same itemsize)": ({"dtype": "int32", "storage_dtype": "int32"},
                              r"says data_type 'float32', but the root document zarr.json says arrays\['0.output'\] "
                              r"dtype 'int32'"),
    "uint16 as bfloat16": ({"dtype": "bfloat16", "storage_dtype": "uint16", "feature_shape": [16]},
                           r"says data_type 'float32'.*dtype 'bfloat16'"),
    "feature_shape [0]": ({"feature_shape": [0]},
                          r"says shape \[320, 8\], but the root document zarr.json says arrays\['0.output'\] "
                          r"feature_shape \[0\]"),
    "feature_shape [4, 2]": ({"feature_shape": [4, 2]}, r"says shape \[320, 8\].*feature_shape \[4, 2\]"),
    "feature_shape [8, 1]": ({"feature_shape": [8, 1]}, r"says shape \[320, 8\].*feature_shape \[8, 1\]"),
    "chunk_rows": ({"chunk_rows": 32}, r"says codecs\[0\]\.configuration\.chunk_shape \[16, 8\].*chunk_rows 32"),
    "shard_rows": ({"shard_rows": 128}, r"says chunk_grid .*\[64, 8\].*shard_rows 128"),
    "compression": ({"compression": {"name": "zstd", "configuration": {"level": 3, "checksum": False}}},
                    r"says codecs\[0\]\.configuration\.codecs .*compression \{'name': 'zstd'"),
    "row_kind": ({"row_kind": "token"}, r"says attributes\.activationscope\.row_kind 'sample'.*row_kind 'token'"),
}


def _reads(path: Path) -> dict:
    """Every way to get rows (or their type and shape) of HP."""
    from activationscope.data import ActivationDataset

    return {
        "store[hp]": lambda: open_store(path)[HP],
        "store[hp, rows]": lambda: open_store(path)[HP, 3:5],
        "rows": lambda: open_store(path).rows(HP, 0, 10),
        "verified open": lambda: open_store(path, verify=True)[HP],
        "dtype": lambda: open_store(path).dtype(HP),
        "feature_shape": lambda: open_store(path).feature_shape(HP),
        "row_blocks": lambda: open_store(path).row_blocks(HP),
        "info": lambda: open_store(path).info(),  # shows the entry's dtype and shape: checked first
        "dataset": lambda: ActivationDataset(path, hook_points=HP)[0:4],
        "dataset, verified": lambda: ActivationDataset(path, hook_points=HP, open_options={"verify": True})[0:4],
        "to_dask": lambda: _to_dask(path),
    }


def _to_dask(path: Path):
    pytest.importorskip("dask")
    from activationscope.analysis.dask import to_dask

    return to_dask(str(path), HP).compute()


@pytest.mark.parametrize("fixture", ["plain", "zstd"])
@pytest.mark.parametrize("lie", list(ROOT_LIES))
def test_root_entry_checked_against_the_array_document(request, fixture, lie):
    """A root document whose entry of an array disagrees with the array's own document (data
    type, feature shape, chunk grid, codecs, attributes) is StoreCorruptError naming the
    array, both files and both values, on every read path, before anything is read or sized;
    verify() reports it."""
    path, _ = request.getfixturevalue(fixture)
    edit, message = ROOT_LIES[lie]
    if fixture == "zstd" and lie == "compression":
        edit = {"compression": None}
        message = r"says codecs\[0\]\.configuration\.codecs .*'zstd'.*compression None"
    edit_root(path, lambda a: a["arrays"][HP].update(edit))
    for name, read in _reads(path).items():
        with pytest.raises(StoreCorruptError, match=rf"hook point '0.output': its array document "
                                                     rf"acts/0.output/zarr.json {message}.*the two disagree"):
            read()
    assert any(re.search(message, p) for p in open_store(path).verify()), open_store(path).verify()


def test_hook_point_of_another_array_document(plain):
    """The root listing an array under another hook point's name (paths swapped, renamed) is
    caught by the document's attributes."""
    path, _ = plain
    edit_root(path, lambda a: a.update(arrays={"1.output": a["arrays"][HP]}))
    with pytest.raises(StoreCorruptError, match=r"hook point '1.output': its array document acts/0.output/zarr.json "
                                                r"says attributes.activationscope.hook_point '0.output'"):
        open_store(path)["1.output"]


@pytest.mark.parametrize("field, value", [("data_type", "int32"), ("shape", [320, 0]), ("shape", [320, -8]),
                                          ("shape", [320, 8.0]), ("chunk_key_encoding", {"name": "v2"})])
def test_array_document_edited_alone(plain, field, value):
    """The same check catches the array document edited instead of the root (a negative or
    non-int dimension included)."""
    path, _ = plain
    doc_path = path / "acts" / HP / "zarr.json"
    doc = json.loads(doc_path.read_text())
    doc[field] = value
    doc_path.write_text(json.dumps(doc))
    with pytest.raises(StoreCorruptError, match=rf"its array document acts/0.output/zarr.json (says {field}|field {field})"):
        open_store(path)[HP]
    assert open_store(path).verify()


@pytest.mark.parametrize("field, value", [("fill_value", None), ("dimension_names", ["rows"]), ("zzz", 1),
                                          ("storage_transformers", [{"name": "x"}])])
def test_verify_names_an_array_document_zarr_cannot_open(zstd, field, value):
    """An array document that agrees with the root on every field the reader sizes rows from,
    but that zarr-python refuses (compressed_array, exports of a compressed array and to_dask
    open it through zarr), is reported by verify; before, verify returned [] while every read failed.
    (row_blocks, what ActivationDataset reads by, no longer opens it through zarr: on object
    storage that cost 6 requests per array; the rows, read by the store's own checked decode,
    are read as stored.)"""
    path, data = zstd
    doc_path = path / "acts" / HP / "zarr.json"
    doc = json.loads(doc_path.read_text())
    doc[field] = value
    doc_path.write_text(json.dumps(doc))
    s = open_store(path)
    with pytest.raises(StoreCorruptError, match=rf"array document acts/{HP}/zarr.json does not open with zarr"):
        s.compressed_array(HP)
    bounds, views = s.row_blocks(HP)
    assert bounds[-1] == s.n_rows(HP) and not views
    assert torch.equal(s.rows(HP, 0, s.n_rows(HP)), data)
    problems = s.verify()
    assert len(problems) == 1 and "does not open with zarr" in problems[0], problems


@pytest.mark.parametrize("fixture", ["plain", "zstd"])
@pytest.mark.parametrize("field", ["chunk_rows", "shard_rows"])
def test_manifest_layout_checked_against_the_root(request, fixture, field):
    path, _ = request.getfixturevalue(fixture)
    man = path / "acts" / HP / "manifest.json"
    doc = json.loads(man.read_text())
    doc[field] *= 2
    man.write_text(json.dumps(doc))
    with pytest.raises(StoreCorruptError, match=rf"manifest acts/0.output/manifest.json says {field} .*the root "
                                                r"document zarr.json says"):
        open_store(path)[HP]


def test_array_without_rows_checked_against_its_document(tmp_path):
    """An array closed with no rows has a document (shape [0, 8]); a root that gives it another
    feature shape or type is refused too (an empty read of the wrong shape)."""
    path = tmp_path / "empty.zarr"
    w = StoreWriter(path, chunk_rows=16, shard_bytes=1 << 20)
    w.open_array(HP, (8,), torch.float32, "sample")
    w.add_batch(0)  # a forward that gave it no row
    w.close()
    assert (path / "acts" / HP / "zarr.json").exists() and open_store(path)[HP].shape == (0, 8)
    edit_root(path, lambda a: a["arrays"][HP].update(feature_shape=[0], dtype="int32", storage_dtype="int32"))
    for read in (lambda: open_store(path)[HP], lambda: open_store(path).feature_shape(HP),
                 lambda: open_store(path).n_rows(HP)):
        with pytest.raises(StoreCorruptError, match=r"says shape \[0, 8\].*feature_shape \[0\]"):
            read()
    assert any("data_type 'float32'" in p for p in open_store(path).verify())


def test_resume_refuses_a_root_that_lies_about_the_layout(plain):
    """A resume deletes the shards past the committed rows by the root's shard_rows: a root
    that lies about it is refused before a file is deleted or written."""
    path, data = plain
    edit_root(path, lambda a: a["arrays"][HP].update(shard_rows=128))
    _assert_resume_refused_as_found(path, r"chunk_grid .*shard_rows 128.*nothing was deleted or written")


def _assert_resume_refused_as_found(path: Path, match: str) -> None:
    """A resume of ``path`` raises StoreCorruptError matching ``match``, every file as found."""
    before = _files(path)
    with pytest.raises(StoreCorruptError, match=match):
        StoreWriter(path, resume=True)
    after = _files(path)
    after.pop(".activationscope-writer.lock", None)
    before.pop(".activationscope-writer.lock", None)
    assert after == before


@pytest.mark.parametrize("edit, match", [
    pytest.param(lambda a: a.update(n_samples=64), r"field n_samples must be the sample row table's n_rows \(320\), "
                 r"got 64", id="n_samples below the sample table"),
    pytest.param(lambda a: a.update(n_samples=400), r"field n_samples must be the sample row table's n_rows \(320\), "
                 r"got 400", id="n_samples above the sample table"),
    pytest.param(lambda a: (a.update(n_samples=64), a["row_tables"]["sample"].update(n_rows=64)),
                 r"hook point '0.output' has n_rows 320, more than the 64 rows of the sample row table it follows; "
                 r"nothing was deleted or written", id="sample table n_rows below its array"),
])
def test_resume_refuses_a_root_whose_counts_disagree(plain, edit, match):
    """A resume continues from the root's n_samples (the samples a caller skips) and appends
    after each array's n_rows: a root whose n_samples is not its sample table's rows, or whose
    table has fewer rows than an array that follows it, would make the resumed rows land next
    to the wrong samples. It is refused before a file is deleted or written, naming both counts."""
    path, data = plain
    edit_root(path, edit)
    _assert_resume_refused_as_found(path, match)


# ---------------------------------------------------------------- 11. manifest fields the reader does not use
def _edit_manifest(path: Path, fn) -> None:
    man = path / "acts" / HP / "manifest.json"
    doc = json.loads(man.read_text())
    fn(doc)
    man.write_text(json.dumps(doc))


MANIFEST_LIES = {
    "key absolute": (lambda d: d["shards"][0].update(key="/etc/passwd"),
                     r"shard 0: key '/etc/passwd' is not the shard's key 'acts/0.output/c/0/0'"),
    "key ..": (lambda d: d["shards"][1].update(key="../other.zarr/acts/0.output/c/1/0"),
               r"shard 1: key '\.\./other\.zarr/acts/0\.output/c/1/0' is not the shard's key 'acts/0.output/c/1/0'"),
    "key of another shard": (lambda d: d["shards"][2].update(key="acts/0.output/c/3/0"),
                             r"shard 2: key 'acts/0.output/c/3/0' is not the shard's key 'acts/0.output/c/2/0'"),
    "rows_end of a non-last shard": (lambda d: d["shards"][0].update(rows_end=32), r"shard 0: rows_end 32 must be 64"),
    "rows_end past its shard": (lambda d: d["shards"][1].update(rows_end=200), r"shard 1: rows_end 200 must be 128"),
    "rows_end past the last shard": (lambda d: d["shards"][4].update(rows_end=400),
                                     r"shard 4: rows_end 400 must be in 257\.\.320"),
    "file_bytes": (lambda d: d["shards"][0].update(file_bytes=99999),
                   r"shard 0: file_bytes 99999 differs from the size of the shard file 'acts/0.output/c/0/0', \d+ bytes"),
    "file_bytes of the last shard": (lambda d: d["shards"][4].update(file_bytes=d["shards"][4]["file_bytes"] - 1),
                                     r"shard 4: file_bytes \d+ differs from the size of the shard file"),
    "hook_point": (lambda d: d.update(hook_point="1.output"),
                   r"manifest acts/0.output/manifest.json says hook_point '1.output', but it is the manifest of hook "
                   r"point '0.output'"),
}


@pytest.mark.parametrize("fixture", ["plain", "zstd"])
@pytest.mark.parametrize("lie", list(MANIFEST_LIES))
def test_verify_reports_every_lying_manifest_field(request, fixture, lie, capsys):
    """Reads ignore a manifest's key, rows_end and file_bytes (the reader derives shard keys
    itself) and stay right, reading nothing outside the store; verify() and `activationscope
    verify` report each lie, naming the manifest, the shard and both values."""
    from activationscope import cli

    path, data = request.getfixturevalue(fixture)
    edit, message = MANIFEST_LIES[lie]
    _edit_manifest(path, edit)
    assert torch.equal(open_store(path)[HP], data)
    problems = open_store(path).verify()
    assert len(problems) == 1 and re.search(rf"hook point '0.output': .*{message}", problems[0]), problems
    assert cli.main(["verify", str(path)]) == 1
    assert re.search(message, capsys.readouterr().err)


def test_verify_accepts_a_manifest_written_by_a_resumed_capture(tmp_path):
    """rows_end / file_bytes of a last shard that a resume rewrote (and of one that was closed
    partial, then filled) are what the writer records: no false report."""
    path = tmp_path / "r.zarr"
    make_store(path, n_rows=100)
    w = StoreWriter(path, resume=True)
    a = w.open_array(HP, (8,), torch.float32, "sample")
    a.append(torch.randn(90, 8))
    w.add_batch(90, list(range(100, 190)), None, {"label": torch.arange(90) % 3})
    w.close()
    s = open_store(path)
    assert s.n_rows(HP) == 190 and s.verify() == []


# ---------------------------------------------------------------- 12. temporary files of a killed writer
#: Temporary files of the backend's atomic set / reserve (".<name>.<8 hex>.tmp"), as a writer
#: killed between creating and renaming them leaves them.
LEFTOVERS = [".zarr.json.0123abcd.tmp", "acts/.zarr.json.89abcdef.tmp",
             f"acts/{HP}/.zarr.json.00ff00ff.tmp", f"acts/{HP}/.manifest.json.deadbeef.tmp",
             "rows/sample/.part-000003.parquet.a1b2c3d4.tmp", f"reductions/{HP}/.mean.0f0f0f0f.tmp"]
#: Files that merely look alike (another name, or outside the store's own folders): kept.
LOOKALIKES = [".zarr.json.DEADBEEF.tmp", ".zarr.json.0123abc.tmp", ".zarr.json.0123abcde.tmp", "zarr.json.0123abcd.tmp",
              ".zarr.json.0123abcd.tmp.bak", ".zarr.json.0123abcd.TMP", "acts/.zarr.json.0123abcd.tmp~",
              "notes/.draft.0123abcd.tmp", "ranks/00001/.zarr.json.0123abcd.tmp"]


def _plant(path: Path, keys: list[str]) -> None:
    for key in keys:
        (path / key).parent.mkdir(parents=True, exist_ok=True)
        (path / key).write_bytes(b"partial")


@pytest.mark.parametrize("how", ["resume", "abort", "close"])
def test_leftover_temporary_files_are_removed(tmp_path, plain, how):
    """A resumed writer removes, when it opens, the temporary files of the store's own naming
    that a killed writer left, and a close after a failure (an abort) removes any left then;
    files that only look alike, and what a link among them points to, are kept; the rows are
    intact. A clean close leaves none of its own (it walks no folder for others')."""
    path, data = plain
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"keep me")
    _plant(path, LOOKALIKES)
    leftovers = [*LEFTOVERS, ".zarr.json.fedcba98.tmp"]
    if how == "resume":
        _plant(path, LEFTOVERS)
        assert open_store(path).verify() == []  # unfinished writes are ignored (FORMAT.md section 1)
        (path / ".zarr.json.fedcba98.tmp").symlink_to(victim)
        w = StoreWriter(path, resume=True)
        assert not [k for k in leftovers if os.path.lexists(path / k)]
        w.close()
    elif how == "abort":
        w = StoreWriter(path, resume=True)
        w.add_batch(0)  # a batch recorded (a resume stopped before its first is put back as found)
        _plant(path, LEFTOVERS)  # left while this writer was open (as by one of its own writes that failed)
        (path / ".zarr.json.fedcba98.tmp").symlink_to(victim)
        w.abort(RuntimeError("the capture failed"))
    else:
        before = {p for p in path.rglob("*")}
        w = StoreWriter(path, resume=True)
        w.close()
        assert {p for p in path.rglob("*")} == before  # no temporary file of its own left, nothing removed
        leftovers = []
    assert not [k for k in leftovers if os.path.lexists(path / k)]
    assert all((path / k).read_bytes() == b"partial" for k in LOOKALIKES)
    assert victim.read_bytes() == b"keep me"
    s = open_store(path)
    assert torch.equal(s[HP], data) and s.verify() == []
    assert s.status == ("incomplete" if how == "abort" else "complete")


def _begun_shard(tmp_path: Path) -> tuple[str, bytes]:
    """The name and bytes of a shard temporary as the native writer leaves it when killed
    mid-shard (one chunk of four written, before its array's first commit)."""
    path = tmp_path / "begun.zarr"
    w = StoreWriter(path, chunk_rows=CHUNK_ROWS, shard_bytes=SHARD_ROWS * FEATURE * 4)
    try:
        a = w.open_array("9.output", (FEATURE,), torch.float32, "sample")
        a.append(torch.randn(CHUNK_ROWS, FEATURE))
        w._core.drain()  # the chunk is in the shard's temporary file
        (tmp,) = [p for p in (path / "acts" / "9.output").iterdir() if p.name.startswith("shard-")]
        return tmp.name, tmp.read_bytes()
    finally:
        w.discard()


@pytest.mark.parametrize("how", ["resume", "abort"])
def test_leftover_shard_temporaries_are_removed_in_every_array_folder(tmp_path, plain, how):
    """The native writer's shard temporaries (shard-<writer id>-<shard>-<pid>.tmp) that a
    killed writer left are removed by a resume and by a close after a failure in every array folder of
    acts/, also one the root does not list (killed before that array's first commit); files
    that only look alike, the same name elsewhere, what a link points to and what lies behind
    a linked array folder are kept; the rows are intact."""
    from activationscope.store._backend import SHARD_TEMP_NAME

    path, data = plain
    name, begun = _begun_shard(tmp_path)
    assert SHARD_TEMP_NAME.fullmatch(name), name  # the naming the cleanup knows is the writer's
    assert HP in root(path)["attributes"]["activationscope"]["arrays"]
    assert "9.output" not in root(path)["attributes"]["activationscope"]["arrays"]
    leftovers = [f"acts/{HP}/{name}", f"acts/9.output/{name}", "acts/9.output/shard-1-0-2.tmp",
                 "acts/7.output/shard-140012345678-3-99999.tmp"]
    lookalikes = ["acts/9.output/shard-1-0.tmp", "acts/9.output/shard-1-0-2.tmp.bak", "acts/9.output/shard-x-0-2.tmp",
                  "acts/9.output/Shard-1-0-2.tmp", "acts/9.output/shard-1-0-2.TMP", "acts/9.output/c/shard-1-0-2.tmp",
                  "acts/9.output/c/0/shard-1-0-2.tmp", "acts/shard-1-0-2.tmp", "shard-1-0-2.tmp",
                  f"rows/{name}", f"reductions/{HP}/{name}", f"notes/9.output/{name}",
                  f"ranks/00001/acts/9.output/{name}"]
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"keep me")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / name).write_bytes(b"keep me")

    def plant() -> None:
        _plant(path, lookalikes)
        for key in leftovers:
            (path / key).parent.mkdir(parents=True, exist_ok=True)
            (path / key).write_bytes(begun)
        (path / "acts" / "9.output" / "shard-7-0-7.tmp").symlink_to(victim)  # the link goes, never its target
        (path / "acts" / "8.output").symlink_to(outside, target_is_directory=True)  # never entered

    gone = [*leftovers, "acts/9.output/shard-7-0-7.tmp"]
    if how == "resume":
        plant()
        w = StoreWriter(path, resume=True)
        assert not [k for k in gone if os.path.lexists(path / k)]
        w.close()
    else:
        w = StoreWriter(path, resume=True)
        w.add_batch(0)  # a batch recorded (a resume stopped before its first is put back as found)
        plant()  # left while this writer was open (as by its own shard writes, then a failure)
        w.abort(RuntimeError("the capture failed"))
    assert not [k for k in gone if os.path.lexists(path / k)]
    assert all((path / k).read_bytes() == b"partial" for k in lookalikes)
    assert victim.read_bytes() == b"keep me" and (outside / name).read_bytes() == b"keep me"
    (path / "acts" / "8.output").unlink()
    s = open_store(path)
    assert torch.equal(s[HP], data) and s.verify() == []
    assert s.status == ("complete" if how == "resume" else "incomplete")


@pytest.mark.parametrize("kind", ["sample", "token"])
def test_row_table_parts_listed_out_of_order(tmp_path, kind):
    """Row-table parts listed in another order than written (the root edited, every checksum
    intact) would pair each row with another sample's id and columns: refused on reading the
    table, by the dataset and by verify."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 2))
    path = tmp_path / "s.zarr"
    for b in range(3):  # one run, then two resumes: a part each
        scope = acs.ActivationScope(store=str(path), rows="token" if kind == "token" else "auto",
                                    store_options={"resume": b > 0})
        with scope.track(model) as tr, torch.no_grad():
            mask = {"attention_mask": torch.ones(2, 4, dtype=torch.bool)} if kind == "token" else {}
            tr.set_batch(sample_ids=[10 * b, 10 * b + 1], label=[b, b], **mask)
            model(torch.randn(2, 4, 3) if kind == "token" else torch.randn(2, 3))
    st = open_store(path)
    table = st.row_table(kind)
    assert table.column("batch").to_pylist() == sorted(table.column("batch").to_pylist())
    parts = root(path)["attributes"]["activationscope"]["row_tables"][kind]["parts"]
    assert len(parts) == 3
    edit_root(path, lambda a: a["row_tables"][kind].update({"parts": [parts[1], parts[0], parts[2]]}))
    message = rf"row table {kind!r}: its batch column goes back from 1 to 0 .*not in the order they were written"
    with pytest.raises(StoreCorruptError, match=message):
        open_store(path).row_table(kind)
    with pytest.raises(StoreCorruptError, match=message):  # (also when the batch column is not asked for)
        open_store(path).row_table(kind, columns=["sample_id", "label"])
    with pytest.raises(StoreCorruptError, match=message):
        acs.ActivationDataset(path, columns=["label"])[0]
    assert any("goes back from 1 to 0" in p for p in open_store(path).verify())



@pytest.mark.parametrize("back_at", [None, 500_000, 123_457])
def test_batch_order_of_a_long_row_table_reads_one_part_at_a_time(back_at):
    """The batch-order check of every row-table read took the whole ``batch`` column as one
    array and its ``np.diff`` (two copies of it: 800 MB and 3.5 s per read of a token table of
    50 million rows). It finds the same row, at a part's first row or inside one, with
    allocations of one part at most."""
    import tracemalloc

    import numpy as np
    import pyarrow as pa

    from activationscope._safeio import batch_order

    batch = np.repeat(np.arange(2000, dtype=np.int64), 500)  # 1,000,000 rows, 8 MB
    if back_at is not None:
        batch[back_at:] -= 3
    column = pa.chunked_array([batch[i:i + 10_000] for i in range(0, len(batch), 10_000)])  # 100 parts
    tracemalloc.start()
    try:
        found = batch_order(pa.table({"batch": column}), False)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    want = None if back_at is None else ("back", (back_at, int(batch[back_at - 1]), int(batch[back_at])))
    assert found == want
    assert peak < batch.nbytes // 4

def _three_part_store(path: Path, rank_of_batch) -> torch.nn.Module:
    """A one-process store of three forwards of 2 samples (a run, then two resumes: a
    row-table part each) with a user column ``rank`` of ``rank_of_batch(b)`` per sample."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 2))
    for b in range(3):
        with acs.ActivationScope(store=str(path), store_options={"resume": b > 0}).track(model) as tr, \
                torch.no_grad():
            tr.set_batch(sample_ids=[10 * b, 10 * b + 1], rank=rank_of_batch(b))
            model(torch.randn(2, 3))
    return model


@pytest.mark.parametrize("values", [lambda b: ["a", "b"], lambda b: [0.5 + b, 1.5], lambda b: [3 - b, 3 - b],
                                    lambda b: [b, -b]], ids=["str", "float", "int", "int-back"])
def test_a_user_column_named_rank_in_a_one_process_store(tmp_path, values):
    """``rank`` is the rank column only in a store committed from rank stores (FORMAT.md §10):
    in a one-process store, a user's ``rank`` column (set_batch) is a column like any other.
    Before, the batch-order check read it as ranks: a store with a str or float ``rank``
    column did not open ("must hold integers"), and one with int values hid parts listed out
    of order (each "rank" its own forward)."""
    path = tmp_path / "s.zarr"
    _three_part_store(path, values)
    want = [v for b in range(3) for v in values(b)]
    st = open_store(path)
    assert st.row_table("sample").column("rank").to_pylist() == want
    assert st.row_table("sample").column("batch").to_pylist() == [0, 0, 1, 1, 2, 2]
    assert st.verify() == []
    ds = acs.ActivationDataset(path, columns=["rank"])
    assert [ds[i]["rank"] if not isinstance(ds[i]["rank"], torch.Tensor) else ds[i]["rank"].item()
            for i in range(6)] == want
    parts = root(path)["attributes"]["activationscope"]["row_tables"]["sample"]["parts"]
    edit_root(path, lambda a: a["row_tables"]["sample"].update({"parts": [parts[1], parts[0], parts[2]]}))
    with pytest.raises(StoreCorruptError, match=r"row table 'sample': its batch column goes back from 1 to 0 \(row 2\)"):
        open_store(path).row_table("sample")


def test_the_rank_column_of_a_store_committed_from_rank_stores_orders_its_batches(tmp_path):
    """In a committed multi-rank store each rank's forwards count from 0, in rank order: the
    batch column goes back where the ranks change, and the rank column says so; a rank
    column that is not ints is refused there."""
    import google_crc32c
    import pyarrow as pa
    import pyarrow.parquet as pq

    from activationscope.store.ranks import commit_ranks

    model = torch.nn.Sequential(torch.nn.Linear(3, 2))
    path = tmp_path / "m.zarr"
    for task in range(2):
        opts = {"process_group": acs.RankStore(task, 2)}
        with acs.ActivationScope(store=str(path), store_options=opts).track(model), torch.no_grad():
            for _ in range(2):
                model(torch.randn(2, 3))
    commit_ranks(path)
    st = open_store(path)
    table = st.row_table("sample")
    assert table.column("rank").to_pylist() == [0, 0, 0, 0, 1, 1, 1, 1]
    assert table.column("batch").to_pylist() == [0, 0, 1, 1, 0, 0, 1, 1]
    assert st.verify() == []
    (key,) = root(path)["attributes"]["activationscope"]["row_tables"]["sample"]["parts"]
    t = pq.read_table(path / key)
    t = t.set_column(t.column_names.index("rank"), "rank", pa.array([str(r) for r in t.column("rank").to_pylist()]))
    pq.write_table(t, path / key)
    crc = int(google_crc32c.value((path / key).read_bytes()))
    edit_root(path, lambda a: a["row_tables"]["sample"]["crc32c"].update({key: crc}))
    with pytest.raises(StoreCorruptError, match=rf"row table 'sample': part '{key}' has a 'rank' column of string, "
                                                r"where the format says integers"):
        open_store(path).row_table("sample")


def test_a_user_column_named_rank_in_a_multi_rank_capture(tmp_path, monkeypatch):
    """A multi-rank store adds a ``rank`` column to its row tables: a user column of that name
    is refused at capture (nothing of that forward recorded); rank stores written with one
    before (forged here) give our error naming the rank store when read or committed, never
    pyarrow's "duplicate field names"."""
    from activationscope.errors import ArgumentValueError, StoreError
    from activationscope.store import writer as writer_mod
    from activationscope.store.ranks import commit_ranks

    model = torch.nn.Sequential(torch.nn.Linear(3, 2))
    path = tmp_path / "m.zarr"
    opts = {"process_group": acs.RankStore(0, 2)}
    with pytest.raises(ArgumentValueError, match=r"column 'rank' clashes with the rank column a multi-rank store "
                                                 r"adds to its row tables \(this is rank 0 of 2\); rename it"):
        with acs.ActivationScope(store=str(path), store_options=opts).track(model) as tr, torch.no_grad():
            tr.set_batch(rank=[7, 8])
            model(torch.randn(2, 3))

    original = writer_mod.StoreWriter._user_columns

    def unchecked(self, *args, **kwargs):  # as a writer before the check
        kept, self.rank_store = self.rank_store, None
        try:
            return original(self, *args, **kwargs)
        finally:
            self.rank_store = kept

    monkeypatch.setattr(writer_mod.StoreWriter, "_user_columns", unchecked)
    path = tmp_path / "old.zarr"
    for task in range(2):
        opts = {"process_group": acs.RankStore(task, 2)}
        with acs.ActivationScope(store=str(path), store_options=opts).track(model) as tr, torch.no_grad():
            tr.set_batch(rank=[7, 8])
            model(torch.randn(2, 3))
    monkeypatch.undo()
    with pytest.raises(StoreError, match=r"rank store 0 \(.*\) has a user row-table column named 'rank'"):
        open_store(path).row_table("sample")
    with pytest.raises(StoreError, match=r"rank store 0 \(.*\) has a user row-table column named 'rank'"):
        commit_ranks(path)
    assert open_store(path).status == "incomplete"  # nothing committed


def test_resume_of_a_root_whose_row_table_lists_no_parts_field(plain):
    """A root whose row table entry has no ``parts`` field (it may: a table of no rows) is
    resumed and closed without a KeyError, and reads back as before."""
    path, data = plain
    edit_root(path, lambda a: a["row_tables"].setdefault("token", {"n_rows": 0, "columns": []}).pop("parts", None))
    w = StoreWriter(path, resume=True, compression=None, chunk_rows=16, shard_bytes=64 * 8 * 4)
    w.close()
    st = open_store(path)
    assert st.row_table("token").num_rows == 0 and torch.equal(st["0.output"], data)


def _builtin_store(path: Path, feature_shape=(2, 3), n_modules: int = 1) -> None:
    """A store of one hook point ``0.output`` (rows of ``feature_shape``; ``1.output``, ... with
    ``n_modules``) with every built-in reduction, per feature and over every value (``<name>0``)."""
    from activationscope.reductions import BUILTIN_REDUCTIONS

    class M(torch.nn.Module):
        def forward(self, x):
            return x * 2

    model = torch.nn.Sequential(*(M() for _ in range(n_modules)))
    reds = []
    for kind in BUILTIN_REDUCTIONS:
        opts = {"hist": {"lo": -1.0, "hi": 1.0, "bins": 4}, "topk": {"k": 3}, "var": {"ddof": 1}}.get(kind, {})
        reds += [(kind, kind, opts), (kind + "0", kind, {**opts, "per_feature": 0})]
    with acs.ActivationScope(store=str(path), reductions=reds).track(model), torch.no_grad():
        for _ in range(2):
            model(torch.randn(5, *feature_shape))


def _refused_by_its_readers(path: Path, entry: str, message: str, hp: str = "0.output") -> None:
    """The store at ``path`` opens, and reduction ``entry`` of ``hp`` is refused by every reader
    of it, the message (a regex) naming the field and the value with the fix: listed in
    ``refused_reductions``; ``store.reductions[hp]`` returns the others with a warning naming
    it, and indexing it there raises; ``reduction_specs`` leaves it out; ``verify`` and the
    ``verify`` command name it, a resume refuses before it writes anything."""
    from activationscope import cli

    before = _files(path)
    s = open_store(path)
    assert re.search(message, s.refused_reductions[hp][entry])
    raised = rf"hook point {re.escape(repr(hp))}: reduction '[^']+' is refused: .*{message}.*capture that reduction again"
    refused = set(s.refused_reductions[hp])
    with pytest.warns(UserWarning, match=raised + r".*the hook point's other reductions are returned without"):
        got = s.reductions[hp]
    entries = root(path)["attributes"]["activationscope"]["reductions"][hp]
    assert set(got) == set(entries) - refused and got  # every other entry, read
    for name in refused:
        with pytest.raises(StoreCorruptError, match=raised.replace("'[^']+'", re.escape(repr(name)))):
            got[name]
    specs = s.reduction_specs(hp)  # a reduction with a refused entry left out, the others there
    assert specs and not {entries[n]["reduction"] for n in refused} & set(specs)
    assert set(specs) == {e["reduction"] for e in entries.values()} - {entries[n]["reduction"] for n in refused}
    assert any(p.startswith(f"hook point {hp!r}: reduction {entry!r} is refused: ") and re.search(message, p)
               and "capture that reduction again" in p for p in s.verify())
    assert cli.main(["verify", str(path)]) == 1
    with pytest.raises(StoreCorruptError, match=raised.replace("capture that reduction again", "cannot be resumed")):
        StoreWriter(path, resume=True)
    assert _files(path) == before


@pytest.mark.parametrize("feature_shape", [(3,), (2, 3), (1, 2, 2)])
def test_every_built_in_reduction_a_capture_stores_passes_the_open_checks(tmp_path, feature_shape):
    """The open-time rules for built-in reductions (kinds, options, output shapes) hold for
    what the native reductions store, for every kind, per feature or not."""
    from activationscope.reductions import BUILTIN_REDUCTIONS
    from activationscope.store._validate import BUILTIN_OPTIONS

    assert set(BUILTIN_OPTIONS) == set(BUILTIN_REDUCTIONS)
    path = tmp_path / "b.zarr"
    _builtin_store(path, feature_shape)
    s = open_store(path)
    assert s.verify() == []
    red = s.reductions["0.output"]
    assert red["cov"].shape == (math.prod(feature_shape),) * 2 and red["hist.counts"].shape == (*feature_shape, 4)
    assert red["topk.values"].shape == (3, *feature_shape) and red["topk0.feature_ids"].shape == (3,)


@pytest.mark.parametrize("entry, edit, field, constraint", [
    ("hist.counts", {"options": {"bins": 0.0}}, "options['bins']", "an integer in 1..16777216"),
    ("hist.counts", {"options": {"bins": -4.0}}, "options['bins']", "an integer in 1..16777216"),
    ("hist.counts", {"options": {"bins": 2.5}}, "options['bins']", "an integer in 1..16777216"),
    ("hist.counts", {"options": {"lo": 1.0}}, "options['lo']", "below hi (1.0)"),
    ("hist.counts", {"options": {"lo": 3.0}}, "options['lo']", "below hi (1.0)"),
    ("hist.counts", {"options": {"lo": -1e308, "hi": 1e308}}, "options['hi']", "such that hi - lo"),
    ("hist.counts", {"options": {"lo": None}}, "options['lo']", "present (the histogram range)"),
    ("topk.values", {"options": {"k": 0.0}}, "options['k']", "an integer in 1..16777216"),
    ("topk.values", {"options": {"k": -2.0}}, "options['k']", "an integer in 1..16777216"),
    ("topk.values", {"options": {"k": 2.5}}, "options['k']", "an integer in 1..16777216"),
    ("mean", {"options": {"per_feature": 2.0}}, "options['per_feature']", "0 or 1"),
    ("mean", {"options": {"bins": 4.0}}, "options['bins']", "absent (reduction 'mean' has the options ['per_feature'])"),
    ("cov", {"options": {"ddof": -1.0}}, "options['ddof']", "a non-negative integer"),
    ("var", {"options": {"ddof": 0.5}}, "options['ddof']", "a non-negative integer"),
    ("mean", {"shape": [3, 2]}, "shape", "[2, 3] (output 'mean' of the built-in reduction 'mean', by the feature shape "
                                         "[2, 3] of '0.output'"),
    ("mean", {"shape": [6]}, "shape", "[2, 3]"),
    ("mean0", {"shape": [1]}, "shape", "[] (output 'mean' of the built-in reduction 'mean', by per_feature=0"),
    ("cov", {"shape": [3, 3]}, "shape", "[6, 6]"),
    ("hist.counts", {"shape": [2, 3, 5]}, "shape", "[2, 3, 4]"),
    ("hist.edges", {"shape": [4]}, "shape", "[5]"),
    ("topk.values", {"shape": [4, 2, 3]}, "shape", "[n, *[2, 3]] with n in 1..3 (k)"),
    ("topk.row_ids", {"shape": [0, 2, 3]}, "shape", "[n, *[2, 3]] with n in 1..3 (k)"),
    ("topk.values", {"shape": [3, 6]}, "shape", "[n, *[2, 3]]"),
])
def test_built_in_reduction_metadata_that_no_reduction_has_is_refused(tmp_path, entry, edit, field, constraint):
    """A root whose built-in reduction entries name options that reduction cannot have (hist
    bins <= 0 or lo >= hi, topk k <= 0 or not an integer, an unknown option) or an output
    shape its hook point's feature shape cannot give: the store opens, and every reader of
    that entry refuses it with StoreCorruptError naming the field (an output of a reduction
    whose options are refused with them), as verify and a resume do; before, it opened and
    verified clean, and a resume, a commit or the report failed on it later (or binned with a
    range that is none)."""
    path = tmp_path / "b.zarr"
    _builtin_store(path)

    def forge(a):
        e = a["reductions"]["0.output"][entry]
        if "options" in edit:
            e["options"].update(edit["options"])
            e["options"] = {k: v for k, v in e["options"].items() if v is not None}
        if "shape" in edit:
            e["shape"] = edit["shape"]

    edit_root(path, forge)
    message = re.escape(f"zarr.json field reductions['0.output'][{entry!r}].{field} must be {constraint}")
    _refused_by_its_readers(path, entry, message)
    entries = root(path)["attributes"]["activationscope"]["reductions"]["0.output"]
    outputs = {n for n, e in entries.items() if e["reduction"] == entries[entry]["reduction"]}
    refused = open_store(path).refused_reductions["0.output"]
    # an output of a reduction whose options are refused: refused with them, naming them; a shape only its entry
    assert set(refused) == (outputs if "options" in edit else {entry})
    assert all(re.search(message, refused[n]) for n in refused)


def test_built_in_reduction_entries_that_are_not_its_outputs_are_refused(tmp_path):
    path = tmp_path / "b.zarr"
    _builtin_store(path)
    # (the count's entry under another name: a copy of it would name a file of another entry,
    # refused at open for the whole store, as two arrays of one path are)
    edit_root(path, lambda a: a["reductions"]["0.output"].update(
        {"mean.extra": a["reductions"]["0.output"].pop("mean.count")}))
    _refused_by_its_readers(path, "mean.extra", re.escape(
        "field reductions['0.output']['mean.extra'] must be an output of the built-in reduction 'mean'"))
    assert set(open_store(path).refused_reductions["0.output"]) == {"mean.extra"}
    _builtin_store(path := tmp_path / "c.zarr")
    edit_root(path, lambda a: a["reductions"]["0.output"]["mean.count"].update(reduction="var"))
    _refused_by_its_readers(path, "mean.count", re.escape(
        "field reductions['0.output']['mean.count'].reduction must be the entry's name, or the part of it before"))


def _retype_reduction(path: Path, name: str, dtype: str, state: str | None = None, hp: str = "0.output") -> str:
    """Rewrite one array of a built-in reduction (its output ``name``, or that entry's state
    array ``state``) as ``dtype`` everywhere at once: its values cast, its document's data type,
    the root's dtype and crc32c (a consistent store, as someone else might write it). Returns
    the root field that names its dtype."""
    import google_crc32c
    import numpy as np

    def entry(a):
        e = a["reductions"][hp][name]
        return e["state"][state] if state else e

    e = entry(root(path)["attributes"]["activationscope"])
    (chunk,) = [k for k in e["crc32c"] if not k.endswith(".pt")]
    doc_path = path / e["path"] / "zarr.json"
    doc = json.loads(doc_path.read_text())
    values = np.frombuffer((path / chunk).read_bytes(), dtype=np.dtype(doc["data_type"]).newbyteorder("<"))
    (path / chunk).write_bytes(values.astype(np.dtype(dtype).newbyteorder("<")).tobytes())
    doc["data_type"], doc["fill_value"] = dtype, (False if dtype == "bool" else 0)
    if "dtype" in doc.get("attributes", {}).get("activationscope", {}):
        doc["attributes"]["activationscope"]["dtype"] = dtype
    doc_path.write_text(json.dumps(doc))
    crc = int(google_crc32c.value((path / chunk).read_bytes()))
    edit_root(path, lambda a: entry(a).update(dtype=dtype, crc32c={chunk: crc}))
    return f"reductions[{hp!r}][{name!r}]" + (f".state[{state!r}]" if state else "") + ".dtype"


@pytest.mark.parametrize("name, dtype, state", [
    ("mean", "bool", None), ("var", "float32", None), ("hist.counts", "int8", None), ("topk.row_ids", "float16", None),
    ("cov", "complex128", None), ("var", "float32", "m2"), ("min", "uint8", "value"),
])
def test_a_built_in_reduction_of_a_dtype_it_never_stores_is_refused(tmp_path, name, dtype, state):
    """A built-in reduction output (or state array) stored as a dtype the native reductions
    never write, consistently (document, root, crc32c): refused by its readers, by verify and
    by a resume, naming the field and the dtype; before, a bool "mean" read back as
    True/False, verify returned [] and the report plotted it as a mean of 1.0."""
    path = tmp_path / "b.zarr"
    _builtin_store(path)
    field = _retype_reduction(path, name, dtype, state)
    message = re.escape(f"zarr.json field {field} must be one of ['float64', 'int64'] (what the built-in reduction")
    _refused_by_its_readers(path, name, message + rf".*got {re.escape(repr(dtype))}")
    assert set(open_store(path).refused_reductions["0.output"]) == {name}


def test_a_store_with_a_refused_reduction_entry_reads_everything_else(tmp_path):
    """A store an earlier version wrote with a float32 "mean" of a built-in kind (its
    StoreWriter.add_reductions took one) opens: its arrays, row table, datasets and the
    reductions of its other hook points read as before; the reductions of the entry's hook
    point leave it out (indexing it raises), the report and a resume refuse it naming the entry, the field, the value and the
    fix; info lists it as refused. Before, open_store refused the whole store."""
    from activationscope import cli
    from activationscope.analysis.report import write_report

    path = tmp_path / "b.zarr"
    _builtin_store(path, n_modules=2)
    s = open_store(path)
    acts = {hp: s[hp].clone() for hp in s.hook_points}
    samples = s.row_table("sample")
    others = dict(s.reductions["1.output"])
    specs = s.reduction_specs("1.output")
    same_hp = dict(s.reductions["0.output"])
    _retype_reduction(path, "mean", "float32", hp="0.output")

    s = open_store(path)
    assert sorted(s.hook_points) == ["0.output", "1.output"]
    assert all(torch.equal(s[hp], acts[hp]) for hp in acts)
    assert s.row_table("sample").equals(samples)
    ds = acs.ActivationDataset(path, hook_points=["0.output"])
    assert torch.equal(ds[0:len(ds)]["0.output"], acts["0.output"])
    got = s.reductions["1.output"]
    assert sorted(got) == sorted(others) and all(torch.equal(got[k], others[k]) for k in others)
    assert s.reduction_specs("1.output") == specs
    assert list(s.refused_reductions) == ["0.output"] and list(s.refused_reductions["0.output"]) == ["mean"]
    message = (r"hook point '0\.output': reduction 'mean' is refused: zarr\.json field reductions\['0\.output'\]"
               r"\['mean'\]\.dtype must be one of \['float64', 'int64'\].*got 'float32'; .*capture that reduction again")
    with pytest.warns(UserWarning, match=message):
        got = s.reductions["0.output"]
    assert sorted(got) == sorted(set(same_hp) - {"mean"})  # the others read, as they were
    assert all(torch.equal(got[k], same_hp[k]) for k in got)
    with pytest.raises(StoreCorruptError, match=message) as first:
        got["mean"]
    with pytest.raises(StoreCorruptError, match=message) as again:
        got["mean"]
    assert again.value is not first.value  # (a new error each time: no traceback kept growing)
    with pytest.warns(UserWarning, match=message):
        assert "mean" not in s.reductions.get("0.output")
    with pytest.warns(UserWarning, match=r"hook point '0\.output': reductions: the store's reduction 'mean' of this "
                      r"hook point is refused \(zarr\.json field .*got 'float32'.*computed from the sampled rows"):
        report = write_report(path, tmp_path / "report")  # the report goes on from the rows, saying so
    assert "reduction &#x27;mean&#x27; of this hook point is refused" in Path(report).read_text()
    assert s.info()["refused_reductions"] == s.refused_reductions
    problems = s.verify()
    assert len(problems) == 1 and re.match(message, problems[0])
    assert cli.main(["info", str(path)]) == 0
    with pytest.raises(StoreCorruptError, match=message.replace("capture that reduction again", "cannot be resumed")):
        StoreWriter(path, resume=True)
    # the same store with the entry's values as the reduction writes them: nothing refused
    _retype_reduction(path, "mean", "float64", hp="0.output")
    s = open_store(path)
    assert s.refused_reductions == {} and s.verify() == [] and "mean" in s.reductions["0.output"]


def test_a_refused_reduction_entry_that_covers_part_of_the_rows_leaves_the_others_readable(tmp_path):
    """A refused entry that a resume did not continue (it covers fewer rows than its hook point:
    left out of store.reductions as partial) does not break reading the hook point's complete
    reductions (it raised IndexError)."""
    import warnings

    path = tmp_path / "b.zarr"
    _builtin_store(path)
    before = dict(open_store(path).reductions["0.output"])
    _retype_reduction(path, "mean", "float32")
    edit_root(path, lambda a: a["reductions"]["0.output"]["mean"].update(n_rows=5))
    s = open_store(path)
    assert list(s.refused_reductions["0.output"]) == ["mean"] and "mean" in s.partial_reductions["0.output"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (no complete entry is refused: nothing left out to warn about)
        got = s.reductions["0.output"]
    assert sorted(got) == sorted(set(before) - {"mean"})
    assert all(torch.equal(got[k], before[k]) for k in got)
    assert s.reduction_specs("0.output")["var"] == ("var", {"ddof": 1.0, "per_feature": 1.0})


def test_info_names_a_refused_reduction_entry(tmp_path, capsys):
    from activationscope import cli

    path = tmp_path / "b.zarr"
    _builtin_store(path)
    _retype_reduction(path, "var", "float32")
    assert cli.main(["info", str(path)]) == 0
    out = capsys.readouterr().out
    assert "var (refused)" in out and "var0 (refused)" not in out
    assert "refused reductions" in out and "  0.output: var" in out
    # what reading them does now: the hook point's other reductions read, the entry raises
    assert "reading the reductions of their hook point raises" not in out
    assert "store.reductions[hook point] returns the others with a warning" in out
    assert cli.main(["info", "--json", str(path)]) == 0
    assert list(json.loads(capsys.readouterr().out)["refused_reductions"]["0.output"]) == ["var"]


def test_a_writer_refuses_a_built_in_kind_of_another_dtype_before_it_writes(tmp_path):
    """StoreWriter.add_reductions of a reduction whose kind is a built-in's but whose output is
    float32 is refused before anything of it is written (readers would refuse the store); a
    state of such a dtype is not kept (a resume rebuilds it), the result is."""
    path = tmp_path / "s.zarr"
    data = make_store(path)

    class Mean:
        kind = "mean"

        def __init__(self, value, state=None):
            self.value, self._state = value, state

        def result(self):
            return {"mean": self.value}

        def state(self):
            return self._state

    w = StoreWriter(path, resume=True)
    w.open_array(HP, (FEATURE,), torch.float32, "sample")
    with pytest.raises(StoreError, match=r"reduction 'm32' of hook point '0\.output': result 'mean' is float32, but a "
                                         r"reduction of the built-in kind 'mean' stores float64 or int64 outputs only"):
        w.add_reductions(HP, "m32", Mean(data.mean(0)))
    w.add_reductions(HP, "m64", Mean(data.double().mean(0), {"mean": data.mean(0), "count": torch.tensor(N_ROWS)}))
    w.close()
    s = open_store(path)
    assert s.verify() == [] and not (path / "reductions" / HP / "m32").exists()
    assert torch.equal(s.reductions[HP]["m64"], data.double().mean(0))
    assert "state" not in root(path)["attributes"]["activationscope"]["reductions"][HP]["m64"]


@pytest.mark.parametrize("per_feature,shape,refused", [(1, [3], False), (1, [2, 2], False), (0, [], False),
                                                       (0, [3], True)])
def test_a_built_in_reduction_of_a_hook_point_without_an_array(tmp_path, per_feature, shape, refused):
    """StoreWriter.add_reductions of a hook point that has no array (nothing tells its feature
    shape): an output per feature reads whatever its shape (it was refused, compared with the
    shape over rows of no feature), and an output whose shape the feature shape does not decide
    (per_feature=0) is still checked (FORMAT.md section 9 rule 10)."""
    path = tmp_path / "r.zarr"
    value = torch.arange(float(math.prod(shape)), dtype=torch.float64).reshape(shape)

    class Mean:
        kind = "mean"
        options = {"per_feature": per_feature}

        def result(self):
            return {"mean": value, "count": torch.tensor(5)}

        def state(self):
            return {"mean": value, "count": torch.tensor(5)}

    w = StoreWriter(path)
    w.add_reductions("x.output", "mean", Mean())
    w.close()
    s = open_store(path)
    if refused:
        assert list(s.refused_reductions["x.output"]) == ["mean"]
        assert "reductions['x.output']['mean'].shape must be [] " in s.refused_reductions["x.output"]["mean"]
        assert len(s.verify()) == 1
        return
    assert s.refused_reductions == {} and s.verify() == []
    assert torch.equal(s.reductions["x.output"]["mean"], value)
    assert s.reductions["x.output"]["mean.count"].item() == 5


def test_a_built_in_reduction_count_stored_as_float64_still_reads(tmp_path):
    """int64 outputs stored as float64 (exact below 2**53; the extrema of some integer rows are
    float64 in stores written before they were int64) are values the reduction wrote."""
    path = tmp_path / "b.zarr"
    _builtin_store(path)
    count = open_store(path).reductions["0.output"]["mean.count"]
    _retype_reduction(path, "mean.count", "float64")
    s = open_store(path)
    assert s.verify() == [] and s.reductions["0.output"]["mean.count"].dtype == torch.float64
    assert s.reductions["0.output"]["mean.count"].item() == count.item() == 10


@pytest.mark.parametrize("field,value", [("node_type", "array"), ("zarr_format", 2), ("node_type", None)])
def test_root_document_that_is_not_a_zarr_v3_group(tmp_path, plain, field, value):
    # open_store and verify() took it; zarr-python and xarray then fail to open the group
    src, _data = plain
    path = tmp_path / "copy.zarr"
    shutil.copytree(src, path)
    doc = root(path)
    doc[field] = value
    (path / "zarr.json").write_text(json.dumps(doc))
    with pytest.raises(StoreCorruptError, match=rf"zarr\.json.*Zarr v3 group.*{field}"):
        open_store(path)


# ---------------------------------------------------------------- 12. a committed shard file missing at a resume
def _memory_files(url: str) -> dict[str, bytes]:
    import fsspec

    fs = fsspec.filesystem("memory")
    base = url[len("memory://"):]
    return {k: fs.cat_file(k) for k in sorted(fs.find(base)) if not k.endswith(".activationscope-writer.lock")}


@pytest.mark.parametrize("where", ["local", "memory"])
@pytest.mark.parametrize("n_rows, gone", [(N_ROWS, 2), (300, 1), (300, 4)], ids=["full-shards", "a-full-shard-before-a-partial-one", "the-partial-last-shard"])
def test_resume_refuses_a_missing_committed_shard_before_it_writes(tmp_path, where, n_rows, gone):
    """A committed shard file that is gone (here shard ``gone`` of 64-row shards): the resume
    continued appending after a full one (only the partial last shard was re-read), leaving a
    hole that readers and verify then reported. It is refused at the resume's start, naming the
    array, the shard key and the fix, every file as found; the store still reads its other shards."""
    import uuid

    import fsspec

    if where == "local":
        path = tmp_path / "s.zarr"
        data = make_store(path, n_rows=n_rows)
        shard(path, gone).unlink()
        files = lambda: {k: v for k, v in _files(path).items() if k != ".activationscope-writer.lock"}  # noqa: E731
    else:
        path = f"memory://acs-missing-shard/{uuid.uuid4().hex}.zarr"
        data = make_store(path, n_rows=n_rows)
        fsspec.filesystem("memory").rm(f"{path[len('memory://'):]}/acts/{HP}/c/{gone}/0")
        files = lambda: _memory_files(path)  # noqa: E731
    before = files()
    key = f"acts/{HP}/c/{gone}/0"
    with pytest.raises(StoreCorruptError, match=rf"cannot resume: hook point '0\.output' \(array 'acts/0\.output'\): "
                                                rf"its shard {re.escape(repr(key))} is missing, but its rows "
                                                rf"{gone * SHARD_ROWS}\.\. are committed .*nothing was deleted or "
                                                r"written; restore the store from an intact copy or capture it again"):
        StoreWriter(path, resume=True)
    assert files() == before
    s = open_store(path)
    assert s.status == "complete" and any(key in p for p in s.verify())
    if gone < (n_rows - 1) // SHARD_ROWS:  # (the shard of the last committed row: the array is refused whole)
        assert s.n_rows(HP) == n_rows and torch.equal(s[HP, :gone * SHARD_ROWS], data[:gone * SHARD_ROWS])
    with pytest.raises(StoreCorruptError, match=rf"shard {re.escape(repr(key))}.* missing"):
        s[HP]


def test_n_samples_other_than_the_sample_row_table_is_refused_at_open(tmp_path):
    """A root whose n_samples was raised over its 2-row sample table (info() and len() reported
    samples that are not there): refused at open, naming the field and both counts."""
    path = tmp_path / "t.zarr"
    w = StoreWriter(path)
    a = w.open_array(HP, (FEATURE,), torch.float32, "sample")
    a.append(torch.randn(2, FEATURE))
    w.add_batch(2, [0, 1], None)
    w.close()
    assert open_store(path).n_samples == 2
    edit_root(path, lambda a: a.update(n_samples=1000))
    with pytest.raises(StoreCorruptError, match=r"t\.zarr'.*field n_samples must be the sample row table's n_rows "
                                                r"\(2\), got 1000"):
        open_store(path)


def test_a_commit_of_rank_stores_refuses_a_refused_reduction_entry(tmp_path):
    """A rank store whose built-in "mean" is float32 (as an earlier version's writer could store
    it): the commit of the rank stores refuses it naming the rank store, the entry, the field
    and the value, and writes nothing; never merged as values the reduction wrote."""
    from activationscope.store.ranks import commit_ranks

    model = torch.nn.Sequential(torch.nn.Linear(3, 2))
    path = tmp_path / "m.zarr"
    for task in range(2):
        opts = {"process_group": acs.RankStore(task, 2)}
        with acs.ActivationScope(store=str(path), store_options=opts, reductions=["mean"]).track(model), \
                torch.no_grad():
            for _ in range(2):
                model(torch.randn(2, 3))
    rank0 = path / "ranks" / "00000"
    _retype_reduction(rank0, "mean", "float32")
    before = _files(path)
    with pytest.raises(StoreCorruptError, match=re.escape(f"store {str(rank0)!r}: hook point '0.output': reduction "
                                                          "'mean' is refused: zarr.json field reductions['0.output']"
                                                          "['mean'].dtype must be one of ['float64', 'int64']")
                       + r".*got 'float32'; .*capture that reduction again"):
        commit_ranks(path)
    assert _files(path) == before and open_store(path).status == "incomplete"


def test_a_projected_row_table_checks_the_types_of_the_columns_not_read(plain):
    """Two intact row-table parts holding ``label`` as int64 and as float32: the whole table
    was refused while ``row_table(columns=["sample_id"])`` decoded only sample_id and returned
    the rows. Both now raise the same error (each part's types read from its Parquet footer)."""
    import io

    import google_crc32c
    import pyarrow as pa
    import pyarrow.parquet as pq

    path, _ = plain
    key = root(path)["attributes"]["activationscope"]["row_tables"]["sample"]["parts"][0]
    t = pq.read_table(path / key)
    assert t.num_rows >= 2 and t.schema.field("label").type == pa.int64()
    half = t.num_rows // 2
    second = t.slice(half)
    second = second.set_column(second.column_names.index("label"), "label", second.column("label").cast(pa.float32()))
    key2 = key.replace("part-000000", "part-000001")
    assert key2 != key
    crcs = {}
    for k, part in ((key, t.slice(0, half)), (key2, second)):
        sink = io.BytesIO()
        pq.write_table(part, sink)
        (path / k).write_bytes(sink.getvalue())
        crcs[k] = int(google_crc32c.value(sink.getvalue()))

    def edit(a):
        a["row_tables"]["sample"]["parts"] = [key, key2]
        a["row_tables"]["sample"]["crc32c"] = crcs
    edit_root(path, edit)
    s = open_store(path)
    with pytest.raises(StoreCorruptError, match="the parts of row table 'sample' do not fit together") as whole:
        s.row_table("sample")
    with pytest.raises(StoreCorruptError) as projected:
        s.row_table("sample", columns=["sample_id"])
    assert str(projected.value) == str(whole.value)
    assert "label" in str(projected.value)
