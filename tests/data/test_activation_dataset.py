"""ActivationDataset against the store read contract (a fake on-disk store with shards)."""

from __future__ import annotations

import pickle
import re
import warnings

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
import torch
from fake_store import FakeStore, open_fake, write_fake_store

from activationscope.data import ActivationDataset, Batch, SequentialBatchSampler, collate
from activationscope.errors import ArgumentTypeError, ArgumentValueError, HookPointNotFoundError

N = 40
D = 6


def _rows_table(n, kind):
    sample = np.arange(n) // (4 if kind == "token" else 1)
    cols = {"sample_id": pa.array(sample, pa.int64()), "batch": pa.array(sample // 8, pa.int64())}
    if kind == "token":
        cols["pos"] = pa.array(np.arange(n) % 4, pa.int64())
    cols["label"] = pa.array((sample % 2).astype(np.int64))
    cols["text"] = pa.array([f"s{i}" for i in sample])
    return pa.table(cols)


@pytest.fixture
def arrays():
    g = torch.Generator().manual_seed(0)
    return {
        "a.output": torch.randn(N, D, generator=g),
        "b.output": torch.randn(N, 2, 3, generator=g).to(torch.bfloat16),
    }


@pytest.fixture
def store(tmp_path, arrays):
    path = write_fake_store(tmp_path / "s", arrays, kinds={k: "token" for k in arrays},
                            tables={"token": _rows_table(N, "token")}, shard_rows=16)
    return FakeStore(path)


def test_item_values_dtypes_and_columns(store, arrays):
    ds = ActivationDataset(store, columns=["label", "pos", "sample_id", "text"])
    assert len(ds) == N and ds.row_kind == "token"
    assert ds.hook_points == ["a.output", "b.output"]
    item = ds[17]
    assert torch.equal(item["a.output"], arrays["a.output"][17])
    assert item["b.output"].dtype == torch.bfloat16
    assert torch.equal(item["b.output"], arrays["b.output"][17])
    assert int(item["label"]) == (17 // 4) % 2 and int(item["pos"]) == 1 and item["text"] == "s4"
    assert torch.equal(ds[-1]["a.output"], arrays["a.output"][-1])
    with pytest.raises(IndexError):
        ds[N]


def test_contiguous_batch_within_shard_is_a_view(store, arrays):
    ds = ActivationDataset(store, hook_points=["a.output"], columns=["label"])
    shard = store.rows("a.output", 16, 32)
    batch = ds.get_batch(range(18, 26))
    assert batch["a.output"].data_ptr() == shard[2:].data_ptr()
    assert torch.equal(batch["a.output"], arrays["a.output"][18:26])
    assert torch.equal(batch["label"], torch.tensor([(i // 4) % 2 for i in range(18, 26)]))
    # positions given as a list are the caller's own copy, also when they are consecutive
    listed = ds.get_batch(list(range(18, 26)))["a.output"]
    assert listed.data_ptr() != shard[2:].data_ptr() and torch.equal(listed, arrays["a.output"][18:26])


def test_batch_across_shards_and_random_batch_are_copies_with_right_values(store, arrays):
    ds = ActivationDataset(store)
    across = ds.get_batch(range(10, 30))
    assert torch.equal(across["a.output"], arrays["a.output"][10:30])
    assert torch.equal(across["b.output"], arrays["b.output"][10:30])
    idx = [39, 0, 17, 16, 15, 3, 3]
    rand = ds.get_batch(idx)
    assert torch.equal(rand["a.output"], arrays["a.output"][idx])
    assert torch.equal(rand["b.output"], arrays["b.output"][idx])
    assert rand["b.output"].dtype == torch.bfloat16


def test_getitems_and_default_collate_do_not_stack(store, arrays):
    ds = ActivationDataset(store, hook_points="a.*", columns=["label"])
    b = ds.__getitems__(range(0, 8))
    assert isinstance(b, Batch) and len(b) == 8
    out = torch.utils.data.default_collate(b)
    assert out["a.output"].data_ptr() == store.rows("a.output", 0, 16).data_ptr()
    assert collate(b)["a.output"].data_ptr() == out["a.output"].data_ptr()
    # rows of a batch taken apart still collate by stacking, as default_collate would
    rows = [b[3], b[1]]
    stacked = torch.utils.data.default_collate(rows)
    assert torch.equal(stacked["a.output"], arrays["a.output"][[3, 1]])


def test_writing_into_a_view_does_not_change_the_store(store, arrays, tmp_path):
    ds = ActivationDataset(store, hook_points=["a.output"])
    loader = torch.utils.data.DataLoader(ds, batch_size=8)
    first = next(iter(loader))["a.output"]
    first.add_(100.0)  # no crash
    reopened = FakeStore(store.path)
    assert torch.equal(reopened["a.output"], arrays["a.output"])


def test_filter_on_an_unknown_field_names_it_and_the_columns(store):
    with pytest.raises(ArgumentValueError) as err:
        ActivationDataset(store, hook_points=["a.output"], filter=pc.field("zzz") > 0)
    msg = str(err.value)
    assert "names field 'zzz', which is not a column of the token row table" in msg
    for col in ("sample_id: int64", "pos: int64", "label: int64"):
        assert col in msg
    assert "__activationscope" not in msg
    with pytest.raises(ArgumentValueError, match=r"names field 'label.q'"):
        ActivationDataset(store, hook_points=["a.output"], filter=pc.field("label", "q") > 0)
    # an expression Arrow cannot evaluate: its reason, and the columns
    with pytest.raises(ArgumentValueError,
                       match=r"cannot be evaluated on the token row table.*no kernel.*label: int64") as err:
        ActivationDataset(store, hook_points=["a.output"], filter=pc.field("label") > "x")
    assert "__activationscope" not in str(err.value)


def test_rows_selection_and_filters(store, arrays):
    ds = ActivationDataset(store, hook_points=["a.output"], rows=slice(8, 24), columns=["pos"])
    assert len(ds) == 16 and torch.equal(ds[0]["a.output"], arrays["a.output"][8])
    # drop BOS tokens with a pyarrow expression
    ds = ActivationDataset(store, hook_points=["a.output"], columns=["pos"], filter=pc.field("pos") > 0)
    kept = [i for i in range(N) if i % 4 != 0]
    assert len(ds) == len(kept)
    assert torch.equal(ds[:]["a.output"], arrays["a.output"][kept])
    assert bool((ds[:]["pos"] > 0).all())
    # a callable over the row table, combined with sample ids and a rows selection
    ds = ActivationDataset(
        store, hook_points=["a.output"], rows=range(0, 32), columns=["label", "sample_id"],
        filter=lambda t: pc.equal(t["label"], 1), sample_ids=[1, 3, 5, 9],
    )
    expect = [i for i in range(32) if (i // 4) in (1, 3, 5)]
    assert torch.equal(ds[:]["a.output"], arrays["a.output"][expect])
    assert ds[:]["sample_id"].tolist() == [i // 4 for i in expect]
    # a filtered dataset still reads contiguous runs as views
    run = ds.get_batch(range(0, 4))
    assert run["a.output"].data_ptr() == store.rows("a.output", 4, 8).data_ptr()
    # sample ids of which none is there: an error, not an empty dataset
    with pytest.raises(ValueError, match=r"none of the sample_ids= \(e.g. \[1000000, 9\]\) is in this dataset's (sample|token) row table"):
        ActivationDataset(store, hook_points=["a.output"], rows=range(0, 32), sample_ids=[10**6, 9])
    # ids some of which no sample of the store has: an error naming them, not a smaller dataset
    with pytest.raises(ArgumentValueError, match=r"sample_ids= holds 2 id\(s\) that no sample of .* has \(e.g. "
                                                  r"\[500, 10000\]\): the dataset would leave them out"):
        ActivationDataset(store, hook_points=["a.output"], sample_ids=[1, 500, 3, 10000])
    # ids that rows= (or filter=) leave out are no error: the selections intersect
    ds = ActivationDataset(store, hook_points=["a.output"], rows=range(0, 8), sample_ids=[1, 9])
    assert torch.equal(ds[:]["a.output"], arrays["a.output"][4:8])


def test_index_tensor_rows_keep_their_order(store, arrays):
    rows = torch.tensor([30, 2, 7])
    ds = ActivationDataset(store, hook_points=["a.output"], rows=rows)
    assert torch.equal(ds[:]["a.output"], arrays["a.output"][rows])
    assert torch.equal(ds[1]["a.output"], arrays["a.output"][2])


def test_errors_name_the_problem(tmp_path, arrays):
    path = write_fake_store(
        tmp_path / "mixed",
        {"tok": torch.zeros(8, 2), "sam": torch.zeros(2, 2), "sam2": torch.zeros(3, 2)},
        kinds={"tok": "token"},
        tables={"token": _rows_table(8, "token"), "sample": _rows_table(2, "sample")},
    )
    store = FakeStore(path)
    with pytest.raises(ValueError, match="same row kind.*'tok': token.*'sam': sample"):
        ActivationDataset(store, hook_points=["tok", "sam"])
    with pytest.raises(ValueError, match="same number of rows.*'sam': 2.*'sam2': 3"):
        ActivationDataset(store, hook_points=["sam", "sam2"])
    with pytest.raises(HookPointNotFoundError, match="'nope'"):
        ActivationDataset(store, hook_points=["nope"])
    with pytest.raises(KeyError):
        ActivationDataset(store, hook_points=["nope*"])
    for pattern in ("nope*", "t?x", "[xy]ok"):  # a pattern is named as one (it was "hook point 'nope*' is not in")
        with pytest.raises(HookPointNotFoundError, match=rf"pattern {re.escape(repr(pattern))} matches no hook point"):
            ActivationDataset(store, hook_points=[pattern])
    with pytest.raises(ValueError, match="columns \\['lbl'\\]"):
        ActivationDataset(store, hook_points=["tok"], columns=["lbl"])
    with pytest.raises(ValueError, match="bool mask of shape \\(8,\\)"):
        ActivationDataset(store, hook_points=["tok"], filter=lambda t: np.ones(3, bool))


def test_a_dataset_without_hook_points_of_a_store_of_both_row_kinds_says_hook_points_was_not_given(tmp_path):
    # ActivationDataset(path) of a store holding token and pooled sample rows: the refusal listed
    # every hook point with its kind and did not say that hook_points= had been left out
    path = write_fake_store(
        tmp_path / "mixed",
        {"tok": torch.zeros(8, 2), "tok2": torch.zeros(8, 2), "sam": torch.zeros(2, 2)},
        kinds={"tok": "token", "tok2": "token"},
        tables={"token": _rows_table(8, "token"), "sample": _rows_table(2, "sample")},
    )
    store = FakeStore(path)
    with pytest.raises(ArgumentValueError) as err:
        ActivationDataset(store)
    msg = str(err.value)
    assert re.search("same row kind.*'tok': token.*'sam': sample", msg), msg
    assert "hook_points= was not given, so every hook point of the store was taken" in msg
    assert "hook_points=['tok', 'tok2'] (token rows) or hook_points=['sam'] (sample rows)" in msg
    # given explicitly: the choice was the caller's, nothing said about a default
    with pytest.raises(ArgumentValueError) as err:
        ActivationDataset(store, hook_points=["tok", "sam"])
    assert "was not given" not in str(err.value) and "hook_points=['tok'] (token rows)" in str(err.value)


def test_a_bracket_pattern_of_hook_points_that_selects_other_hook_points_says_so(tmp_path):
    """hook_points=['d.a[1].*'] meant the hook points below the key 'a[1]', but fnmatch read
    '[1]' as one of '1': the dataset read d.a1's rows without a word, or the no-match error
    listed the store. Now a warning (the hint in the error) names the hook points holding the
    brackets and the pattern 'd.a[[]1].*' that selects them; that one selects them."""
    arrays = {"d.a[1].0.output": torch.arange(8.0).reshape(4, 2), "d.a1.0.output": -torch.arange(8.0).reshape(4, 2)}
    store = FakeStore(write_fake_store(tmp_path / "s", arrays, tables={"sample": _rows_table(4, "sample")}))
    hint = ("; fnmatch reads '[...]' in it as a character class (one of its characters): the hook points whose names "
            "hold those brackets are ['d.a[1].0.output'], which hook_points=['d.a[[]1].*'] selects")
    with pytest.warns(UserWarning, match=re.escape("hook_points pattern 'd.a[1].*' selects ['d.a1.0.output']" + hint)):
        ds = ActivationDataset(store, hook_points=["d.a[1].*"])
    assert ds.hook_points == ["d.a1.0.output"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ds = ActivationDataset(store, hook_points=["d.a[[]1].*"])
    assert ds.hook_points == ["d.a[1].0.output"]
    assert torch.equal(ds[:]["d.a[1].0.output"], arrays["d.a[1].0.output"])
    store = FakeStore(write_fake_store(tmp_path / "t", {"d.a[1].0.output": arrays["d.a[1].0.output"]},
                                       tables={"sample": _rows_table(4, "sample")}))
    with pytest.raises(HookPointNotFoundError, match=re.escape("matches no hook point of the store") + ".*"
                       + re.escape(hint)):
        ActivationDataset(store, hook_points=["d.a[1].*"])


def test_hook_points_that_print_alike_are_told_apart_in_the_no_match_error(tmp_path):
    """Two hook points differing only in Unicode normalization ('\u00e9' and 'e' plus a
    combining accent) printed alike in the error's list of the store's hook points; now the
    one not in NFC form is shown with its escapes."""
    nfc, nfd = "d.\u00e9.output", "d.e\u0301.output"
    store = FakeStore(write_fake_store(tmp_path / "s", {nfc: torch.zeros(2, 1), nfd: torch.ones(2, 1)},
                                       tables={"sample": _rows_table(2, "sample")}))
    with pytest.raises(HookPointNotFoundError) as e:
        ActivationDataset(store, hook_points=["d.x.output"])
    assert "['d.\u00e9.output', 'd.e\\u0301.output']" in str(e.value)


def test_pickles_as_path_and_reopens(store, arrays):
    ds = ActivationDataset(store.path, hook_points=["a.output"], columns=["label"], filter=pc.field("pos") > 0,
                           open_options={"opener": open_fake})
    ds[:]  # open and map in this process
    blob = pickle.dumps(ds)
    assert len(blob) < 10_000  # path, options and the row selection; no activations
    clone = pickle.loads(blob)
    assert clone.source._store is None
    assert torch.equal(clone[:]["a.output"], ds[:]["a.output"])
    assert torch.equal(clone[:]["label"], ds[:]["label"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.uint8])
def test_dtypes_come_back_exactly(tmp_path, dtype):
    t = (torch.arange(30).reshape(10, 3) * 3 - 7).to(dtype) if dtype != torch.uint8 else torch.arange(30, dtype=dtype).reshape(10, 3)
    path = write_fake_store(tmp_path / "d", {"x": t}, tables={"sample": _rows_table(10, "sample")}, shard_rows=4)
    ds = ActivationDataset(FakeStore(path))
    out = ds[:]["x"]
    assert out.dtype == dtype and torch.equal(out, t)
    assert ds[[9, 0]]["x"].dtype == dtype



@pytest.mark.parametrize("ids", [
    [5, 1, 3], (3, 1, 5), {1, 3, 5}, frozenset({5, 3, 1}), range(1, 6, 2), torch.tensor([5, 3, 1]),
    torch.tensor([1, 3, 5], dtype=torch.int32), np.array([3, 5, 1]), np.array([1, 3, 5], dtype=np.uint16),
])
def test_sample_ids_take_any_collection_of_ints_and_keep_store_order(store, arrays, ids):
    ds = ActivationDataset(store, hook_points=["a.output"], columns=["sample_id"], sample_ids=ids)
    expect = [i for i in range(N) if (i // 4) in (1, 3, 5)]
    assert torch.equal(ds[:]["a.output"], arrays["a.output"][expect])
    assert ds[:]["sample_id"].tolist() == [i // 4 for i in expect]
    one = ActivationDataset(store, hook_points=["a.output"], sample_ids=np.int64(3))
    assert torch.equal(one[:]["a.output"], arrays["a.output"][12:16])


@pytest.mark.parametrize("ids, match", [
    ([1, None], r"sample_ids= must be ints \(sample ids\), got None"),
    ([1.5, 2], r"sample_ids= must be ints \(sample ids\), got 1\.5"),
    ([True, 2], r"got True"),
    ("abc", r"sample_ids= must be a collection of ints .*got 'abc'"),
    (torch.tensor([1.0, 2.0]), r"sample_ids= must be ints \(a 1-D integer Tensor\), got a torch.float32 Tensor"),
    (np.array([[1, 2]]), r"sample_ids= must be ints \(a 1-D integer numpy array\)"),
])
def test_sample_ids_that_are_not_ints_get_our_error(store, ids, match):
    with pytest.raises(ArgumentTypeError, match=match):
        ActivationDataset(store, hook_points=["a.output"], sample_ids=ids)


def test_sample_ids_beyond_int64_and_meta_tensors_are_refused(store):
    with pytest.raises(ArgumentValueError, match=r"sample_ids= holds 18446744073709551616, beyond int64"):
        ActivationDataset(store, hook_points=["a.output"], sample_ids=[1, 2**64])
    with pytest.raises(ArgumentValueError, match=r"sample_ids= is a meta tensor"):
        ActivationDataset(store, hook_points=["a.output"], sample_ids=torch.tensor([1], device="meta"))


def test_sample_ids_of_a_store_with_str_sample_ids_are_str(tmp_path):
    # the writer takes str sample ids (document names): sample_ids= selects them by those
    from activationscope.store import StoreWriter

    data = torch.arange(12.0).reshape(6, 2)
    w = StoreWriter(tmp_path / "s.zarr")
    w.open_array("x", (2,), torch.float32, "sample").append(data)
    w.add_batch(6, sample_ids=[f"doc-{i}" for i in range(6)])
    w.close()
    path = str(tmp_path / "s.zarr")
    for ids in (["doc-4", "doc-1"], {"doc-1", "doc-4"}, ("doc-1", "doc-4", "doc-1")):
        ds = ActivationDataset(path, columns=["sample_id"], sample_ids=ids)
        assert torch.equal(ds[:]["x"], data[[1, 4]]) and ds[:]["sample_id"] == ["doc-1", "doc-4"]
    with pytest.raises(ArgumentValueError, match=r"sample_ids= holds 1 id\(s\) that no sample of .* has \(e.g. "
                                                  r"\['doc-9'\]\)"):
        ActivationDataset(path, sample_ids=("doc-1", "doc-4", "doc-9"))
    assert torch.equal(ActivationDataset(path, sample_ids="doc-5")[:]["x"], data[[5]])
    with pytest.raises(ArgumentTypeError, match=r"sample_ids= must be str \(this store's sample ids are strings\), got 3"):
        ActivationDataset(path, sample_ids=["doc-1", 3])
    with pytest.raises(ArgumentValueError, match=r"none of the sample_ids= \(e.g. \['doc-9'\]\)"):
        ActivationDataset(path, sample_ids=["doc-9"])


@pytest.mark.parametrize("values", [[1, None, 0, None, 7], [True, None, False, None, True], [0.5, None, 1.5, None, 2.5]])
def test_a_numeric_column_with_nulls_reads_where_the_dataset_leaves_them_out(tmp_path, values):
    from activationscope.store import StoreWriter

    data = torch.arange(10.0).reshape(5, 2)
    w = StoreWriter(tmp_path / "s.zarr")
    w.open_array("x", (2,), torch.float32, "sample").append(data)
    w.add_batch(5, columns={"label": values})
    w.close()
    path = str(tmp_path / "s.zarr")
    set_rows = [0, 2, 4]
    want = torch.tensor([values[i] for i in set_rows])
    for ds in (ActivationDataset(path, columns=["label"], filter=pc.field("label").is_valid()),
               ActivationDataset(path, columns=["label"], rows=set_rows),
               ActivationDataset(path, columns=["label"], rows=slice(0, 1))):
        got = ds[:]
        assert torch.equal(got["label"], want[: len(ds)]) and torch.equal(got["x"], data[set_rows][: len(ds)])
        assert [ds[i]["label"].item() for i in range(len(ds))] == want[: len(ds)].tolist()
    # refused when the dataset is made, not at its first read (in a DataLoader worker, mid-epoch)
    for kwargs in ({"rows": [0, 3, 4, 1]}, {"filter": pc.field("sample_id") != 0}):
        with pytest.raises(ArgumentValueError, match=r"column 'label' of .* is null in 2 of this dataset's rows \(first: "
                                                     r"dataset row [01], store row [13]\).*filter=pc.field\('label'\).is_valid\(\)"):
            ActivationDataset(path, columns=["label"], **kwargs)
    assert len(ActivationDataset(path, rows=[0, 3, 4, 1])) == 4  # a null column not asked for is no error


def test_a_filter_callable_returning_an_empty_list_on_a_store_without_rows(tmp_path):
    # a list comprehension over the row table of a store killed before its first commit: []
    from activationscope.store import StoreWriter

    w = StoreWriter(tmp_path / "s.zarr")
    w.open_array("x", (2,), torch.float32, "sample")
    w.add_batch(0)  # a forward that gave it no row: listed with 0 rows
    w.commit()
    ds = ActivationDataset(str(tmp_path / "s.zarr"), filter=lambda t: [v > 0 for v in t["sample_id"].to_pylist()])
    assert len(ds) == 0 and ds[:]["x"].shape == (0, 2)
    w.close()


def test_batch_is_indexed_by_row_not_by_name(store):
    ds = ActivationDataset(store, hook_points=["a.output"])
    b = ds.__getitems__([0, 1])
    assert torch.equal(b[1]["a.output"], ds[1]["a.output"])
    with pytest.raises(ArgumentTypeError, match=r"read batch.data\['a.output'\] \(keys: a.output\)"):
        b["a.output"]
    with pytest.raises(ArgumentTypeError, match=r"indexed by row \(an int\), got float"):
        b[0.5]


def test_sample_ids_of_a_sample_without_token_rows_are_known(tmp_path):
    """A sample whose mask keeps no token has no token row but is a sample of the store: asking
    for it with others is no error (it adds no row); an id of no sample is one."""
    import activationscope as acs

    model = torch.nn.Linear(3, 2)
    x = torch.randn(3, 4, 3)
    mask = torch.tensor([[1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    path = tmp_path / "t.zarr"
    with torch.no_grad(), acs.ActivationScope(store=path).track(model) as tr:
        tr.set_batch(attention_mask=mask, sample_ids=[10, 11, 12])
        model(x)
    ds = ActivationDataset(path, sample_ids=[10, 11])
    with torch.no_grad():
        assert torch.equal(ds[:]["output"], model(x)[0, :2])
    with pytest.raises(ArgumentValueError, match=r"holds 1 id\(s\) that no sample of .* has \(e.g. \[13\]\)"):
        ActivationDataset(path, sample_ids=[10, 13])


def test_changing_a_batch_column_in_place_does_not_change_later_reads(store):
    # (contiguous batches and items handed out views of the dataset's cached column values:
    # ``batch["label"] -= 1`` in a training loop shifted the labels of every later epoch)
    ds = ActivationDataset(store, hook_points=["a.output"], columns=["label", "pos"])
    want = {c: torch.tensor([(i // 4) % 2 if c == "label" else i % 4 for i in range(N)]) for c in ("label", "pos")}
    sampler = SequentialBatchSampler(ds, 8)
    for _epoch in range(2):
        for batch in torch.utils.data.DataLoader(ds, batch_sampler=sampler):
            batch["label"] -= 1
            batch["pos"].zero_()
    item = ds[5]
    item["label"] += 7
    ds.get_batch(slice(0, 20))["pos"].fill_(9)
    for c in ("label", "pos"):
        assert torch.equal(ds[:][c], want[c]) and torch.equal(ds.get_batch(range(0, N))[c], want[c])
    assert int(ds[5]["label"]) == int(want["label"][5])


def test_changing_a_list_or_dict_column_value_in_place_does_not_change_later_reads(tmp_path):
    # (list and struct columns were cached as Python lists of lists / dicts: every batch and
    # item handed out the same inner objects, so batch["tags"][0].append(x) changed later reads)
    import activationscope as acs

    path = tmp_path / "lists.zarr"
    model = torch.nn.Linear(2, 2)
    tags, meta = [[1, 2], [3], [], [4, 5, 6]], [{"a": 1}, {"a": 2}, {"a": 3}, {"a": 4}]
    with acs.ActivationScope(store=str(path)).track(model) as tracker, torch.no_grad():
        tracker.set_batch(tags=tags, meta=meta, text=["w", "x", "y", "z"])
        model(torch.randn(4, 2))
    ds = ActivationDataset(str(path), columns=["tags", "meta", "text"])
    batch = ds[0:2]
    batch["tags"][0].append(99)
    batch["meta"][1]["a"] = -1
    ds[1]["tags"].append(7)
    ds[[3, 0]]["tags"][1].append(42)
    for b in torch.utils.data.DataLoader(ds, batch_size=3, shuffle=True, generator=torch.Generator().manual_seed(0)):
        for t in b["tags"]:
            t.append(0)
    assert ds[0:4]["tags"] == tags and ds[0:4]["meta"] == meta and ds[0:4]["text"] == ["w", "x", "y", "z"]
    assert ds[[3, 1]]["tags"] == [[4, 5, 6], [3]] and ds[1]["tags"] == [3] and ds.get_batch(range(4))["meta"] == meta


def test_sample_ids_of_samples_without_token_rows_say_so(tmp_path):
    """A sample whose every position the mask left out has no token row: sample_ids= of it
    alone says that (it named rows= and filter=, which were not given); ids left out by rows=
    name rows= alone."""
    from activationscope.store import StoreWriter

    path = tmp_path / "t.zarr"
    w = StoreWriter(path)
    a = w.open_array("h", (2,), torch.float32, "token")
    mask = torch.tensor([[True, True], [True, False], [False, False]])  # sample 12: no token row
    a.append(torch.arange(6, dtype=torch.float32).reshape(3, 2))
    w.add_batch(3, [10, 11, 12], mask)
    w.close()
    with pytest.raises(ArgumentValueError, match=r"none of the sample_ids= \(e.g. \[12\]\) is in this dataset's token "
                                                  r"row table: those samples have no token rows in this store") as e:
        ActivationDataset(path, sample_ids=[12])
    assert "rows=" not in str(e.value) and "filter=" not in str(e.value)
    with pytest.raises(ArgumentValueError, match=r"none of the sample_ids= \(e.g. \[11\]\) is in this dataset's token "
                                                  r"row table \(within rows=\); read the ids there are with "
                                                  r"store.row_table\('token'\)\['sample_id'\]"):
        ActivationDataset(path, sample_ids=[11], rows=range(0, 2))
    assert ActivationDataset(path, sample_ids=[11, 12])[:]["h"].tolist() == [[4.0, 5.0]]


def test_items_read_one_by_one_collate_as_a_batch_of_the_dataset(tmp_path):
    # a ConcatDataset has no __getitems__: the DataLoader collates items ds[i]. default_collate
    # transposed a list column ([[0, 1], [1, 2]] -> [tensor([0, 1]), tensor([1, 2])]) and
    # refused a null string; the rows now collate as the dataset's own batches do
    from torch.utils.data import ConcatDataset, DataLoader

    from activationscope.store import StoreWriter

    data = torch.arange(12.0).reshape(6, 2)
    w = StoreWriter(tmp_path / "s.zarr")
    w.open_array("x", (2,), torch.float32, "sample").append(data)
    w.add_batch(6, columns={"label": [0, 1, 2, 3, 4, 5], "tags": [[i, i + 1] for i in range(6)],
                            "name": [None, "b", "c", None, "e", "f"], "meta": [{"k": i} for i in range(6)]})
    w.close()
    ds = ActivationDataset(str(tmp_path / "s.zarr"), columns=["label", "tags", "name", "meta"])
    whole = ds[:]
    cat = ConcatDataset([ds, ds])
    for loader in (DataLoader(cat, batch_size=4), DataLoader(cat, batch_size=4, collate_fn=collate),
                   DataLoader(cat, batch_size=4, num_workers=2)):
        batches = list(loader)
        assert torch.equal(torch.cat([b["x"] for b in batches]), torch.cat([data, data]))
        assert torch.equal(torch.cat([b["label"] for b in batches]), torch.cat([whole["label"]] * 2))
        for key in ("tags", "name", "meta"):
            assert [v for b in batches for v in b[key]] == whole[key] * 2, key
    assert collate([ds[4], ds[1]])["tags"] == [[4, 5], [1, 2]]
    b = ds.__getitems__([0, 1, 2, 3])
    assert collate([b[3], b[1]])["tags"] == [[3, 4], [1, 2]]  # rows of a batch taken apart
    # datasets reading other columns: named, not a bare KeyError from inside the DataLoader
    other = ActivationDataset(str(tmp_path / "s.zarr"), columns=["label"])
    with pytest.raises(ArgumentValueError, match=r"rows collated into one batch must have the same keys, got "
                                                 r"\['x', 'label', 'tags', 'name', 'meta'\] and \['x', 'label'\]"):
        next(iter(DataLoader(ConcatDataset([ds, other]), batch_size=12)))


def test_sample_ids_are_checked_against_a_set_of_the_wanted_ids_not_of_every_row(tmp_path, monkeypatch):
    # (whether each wanted id is a sample of the store was asked of a hash set of the token
    # table's every row: 7 s and 3 GB more for 50 million rows, to check 100 ids)
    import activationscope as acs

    model = torch.nn.Linear(3, 2)
    path = tmp_path / "t.zarr"
    with torch.no_grad(), acs.ActivationScope(store=path, rows="token").track(model) as tr:
        for k in range(3):
            tr.set_batch(sample_ids=[10 * k + i for i in range(4)])
            model(torch.randn(4, 16, 3))
    sizes = []
    is_in = pc.is_in

    def recording(values, value_set=None, **kw):
        sizes.append(len(value_set))
        return is_in(values, value_set=value_set, **kw)

    monkeypatch.setattr(pc, "is_in", recording)
    ds = ActivationDataset(path, sample_ids=[1, 22])
    assert len(ds) == 32 and ds.store_rows().tolist() == list(range(16, 32)) + list(range(160, 176))
    with pytest.raises(ArgumentValueError, match=r"holds 1 id\(s\) that no sample of .* has \(e.g. \[5\]\)"):
        ActivationDataset(path, sample_ids=[1, 5])
    assert sizes and max(sizes) <= 2
