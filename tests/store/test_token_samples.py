"""Every token row has its sample: verify() names token rows whose sample_id (or whose
sample_id, batch and rank together) no sample row has, and a read of the sample columns on
token rows says the store is damaged instead of asking to filter nulls out. Stores of the
library's own writer (generation steps, string ids, resumes, ranks) verify clean."""

from __future__ import annotations

import io
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import activationscope as acs
from activationscope.cli import main
from activationscope.errors import StoreCorruptError
from activationscope.store import StoreWriter, open_store
from activationscope.store import _format as F

HP = "t"


def _token_store(path, ids=((0, 1), (10, 11))):
    """Two forwards of 2 samples (ids ``ids``), 2 and 3 tokens, a per-sample ``label``."""
    w = StoreWriter(path, chunk_rows=4, shard_bytes=16 * 8 * 4)
    a = w.open_array(HP, (8,), torch.float32, "token")
    for b, pair in enumerate(ids):
        a.append(torch.randn(5, 8))
        w.add_batch(2, list(pair), torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool),
                    {"label": torch.tensor([b, b + 1])})
        w.commit()
    w.close()


def _edit_tokens(path, column, values):
    """Rewrite the token table's one part with ``column`` set to ``values``, its crc32c
    recomputed in the root (so only a check of the pairing can tell). ``values``: a list, or a
    function of the part's table that returns one."""
    doc = json.loads((path / "zarr.json").read_text())
    info = doc["attributes"]["activationscope"]["row_tables"]["token"]
    (key,) = info["parts"]
    t = pq.read_table(path / key)
    values = values(t) if callable(values) else values
    t = t.set_column(t.schema.get_field_index(column), column, pa.array(values, t.schema.field(column).type))
    sink = io.BytesIO()
    pq.write_table(t, sink)
    (path / key).write_bytes(sink.getvalue())
    info["crc32c"][key] = F.crc32c(sink.getvalue())
    (path / "zarr.json").write_text(json.dumps(doc))


def test_token_rows_of_an_unknown_sample_id_are_named_by_verify_and_refused_by_reads(tmp_path, capsys):
    path = tmp_path / "s.zarr"
    _token_store(path)
    assert open_store(path).verify() == []
    assert acs.ActivationDataset(path, columns=["label"])[:]["label"].tolist() == [0, 0, 1, 1, 1, 1, 1, 2, 2, 2]
    _edit_tokens(path, "sample_id", [99, 99, 1, 1, 1, 10, 10, 98, 98, 98])
    problems = open_store(path).verify()
    assert len(problems) == 1, problems
    assert problems[0].startswith("row table 'token': 5 of its 10 rows have a sample_id that is in no row of the "
                                  "sample row table (4 rows), first [99, 98]: those token rows have no sample"), problems
    assert "restore it from its source" in problems[0]
    with pytest.raises(StoreCorruptError, match=r"damaged: 5 token rows have no sample row to take the sample columns "
                                                r"\['label'\] from .*first \[99, 98\].*activationscope verify") as e:
        acs.ActivationDataset(path, columns=["label"])[:]
    assert "filter them out" not in str(e.value) and "is null" not in str(e.value)
    with pytest.raises(StoreCorruptError, match="activationscope verify"):  # a filter sees every column
        acs.ActivationDataset(path, filter=lambda t: [True] * t.num_rows)
    # the token rows' own columns never needed a sample: read as before
    assert acs.ActivationDataset(path, columns=["pos"])[:]["pos"].tolist() == [0, 1, 0, 1, 2, 0, 1, 0, 1, 2]
    code = main(["verify", str(path)])
    out = capsys.readouterr()
    assert code != 0 and "first [99, 98]" in out.out + out.err


def test_token_rows_whose_sample_id_is_of_another_forward_are_named_by_verify(tmp_path):
    # sample ids 0, 1 are in the sample table, but in forward 0 only: the rows of forward 1
    # that claim them pair with no sample (the join is on batch and sample_id)
    path = tmp_path / "s.zarr"
    _token_store(path)
    _edit_tokens(path, "sample_id", [0, 0, 1, 1, 1, 0, 0, 11, 11, 11])
    problems = open_store(path).verify()
    assert len(problems) == 1, problems
    assert problems[0].startswith("row table 'token': 2 of its 10 rows have a sample_id of the sample row table but "
                                  "no sample row with their batch, sample_id together, first [{'batch': 1, "
                                  "'sample_id': 0}]"), problems
    with pytest.raises(StoreCorruptError, match=r"damaged: 2 token rows .*activationscope verify"):
        acs.ActivationDataset(path, columns=["label"])[:]


def test_string_sample_ids_of_a_token_store_verify_clean_and_their_damage_is_named(tmp_path):
    path = tmp_path / "s.zarr"
    _token_store(path, ids=(("a", "b"), ("c", "d")))
    assert open_store(path).verify() == []
    _edit_tokens(path, "sample_id", ["a", "a", "b", "b", "b", "c", "c", "zz", "zz", "zz"])
    (line,) = open_store(path).verify()
    assert "3 of its 10 rows have a sample_id that is in no row" in line and "first ['zz']" in line


def _generate(path, resume=False, steps=3, store_options=None):
    """A prompt of 2 samples (string ids) and ``steps`` generation steps of 1 token each, each
    step described with same_samples=True: its rows keep the prompt's sample ids."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(20, 4), torch.nn.Linear(4, 4))
    options = {"resume": True} if resume else {"overwrite": True}
    with acs.ActivationScope(store=path, store_options={**options, **(store_options or {})}).track(
            model, include=["1"]) as tracker, torch.no_grad():
        tracker.set_batch(attention_mask=torch.tensor([[0, 1, 1], [1, 1, 1]], dtype=torch.bool),
                          sample_ids=["p", "q"], label=[3, 4])
        model(torch.randint(1, 20, (2, 3)))
        for _ in range(steps):
            tracker.set_batch(attention_mask=torch.ones(2, 1, dtype=torch.bool), same_samples=True, label=[3, 4])
            model(torch.randint(1, 20, (2, 1)))


def test_generation_steps_of_the_same_samples_verify_clean(tmp_path):
    path = tmp_path / "g.zarr"
    _generate(path)
    store = open_store(path)
    assert store.verify() == []
    assert store.row_table("sample").column("sample_id").to_pylist() == ["p", "q"] * 4
    got = acs.ActivationDataset(path, columns=["sample_id", "label"])[:]
    assert got["sample_id"] == ["p", "p", "q", "q", "q"] + ["p", "q"] * 3
    assert got["label"].tolist() == [3, 3, 4, 4, 4] + [3, 4] * 3


def test_a_resumed_token_store_verifies_clean(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(20, 4), torch.nn.Linear(4, 4))
    path = tmp_path / "r.zarr"
    masks = [torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)] * 4
    options = {"chunk_rows": 2, "shard_rows": 4, "commit_interval": 0}
    with pytest.raises(KeyboardInterrupt):
        with acs.ActivationScope(store=path, store_options=options).track(model, include=["1"]) as tracker, \
                torch.no_grad():
            for b in range(2):
                tracker.set_batch(attention_mask=masks[b], label=[b, b + 1])
                model(torch.randint(1, 20, (2, 3)))
            raise KeyboardInterrupt
    tracker = acs.ActivationScope(store=path, store_options={**options, "resume": True}).track(model, include=["1"])
    with tracker, torch.no_grad():
        for b in range(tracker.resume_from // 2, 4):
            tracker.set_batch(attention_mask=masks[b], label=[b, b + 1])
            model(torch.randint(1, 20, (2, 3)))
    store = open_store(path)
    assert store.status == "complete" and store.verify() == []
    assert store.row_table("sample").column("sample_id").to_pylist() == list(range(8))
    got = acs.ActivationDataset(path, columns=["sample_id", "label"])[:]
    assert got["label"].tolist() == [(s // 2) + (s % 2) for s in got["sample_id"].tolist()]


def _two_rank_token_stores(path, batch_of_rank) -> None:
    """Two RankStore tasks, each one forward of 2 samples x 3 tokens into ``path`` (token rows
    of ``1.output``); ``batch_of_rank(r)``: the set_batch keywords of rank ``r`` besides the mask."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(50, 4), torch.nn.Linear(4, 4))
    for r in range(2):
        options = {"process_group": acs.RankStore(r, 2), "chunk_rows": 2, "shard_rows": 4}
        with acs.ActivationScope(store=path, store_options=options).track(model, include=["1"]) as tracker, \
                torch.no_grad():
            tracker.set_batch(attention_mask=torch.ones(2, 3, dtype=torch.bool), **batch_of_rank(r))
            model(torch.randint(1, 50, (2, 3)))


@pytest.mark.parametrize("committed", [False, True])
def test_rank_stores_with_the_same_default_ids_verify_clean(tmp_path, committed):
    # default ids count per rank: ids 0, 1 on both ranks, paired with their sample by rank
    from activationscope.store.ranks import commit_ranks

    path = tmp_path / "r.zarr"
    _two_rank_token_stores(path, lambda r: {"label": [10 * r, 10 * r + 1]})
    if committed:
        commit_ranks(path)
    store = open_store(path)
    assert store.verify() == []
    got = acs.ActivationDataset(path, columns=["rank", "sample_id", "label"])[:]
    assert got["label"].tolist() == [10 * r + s for r, s in zip(got["rank"].tolist(), got["sample_id"].tolist())]


def test_rows_of_a_committed_rank_store_paired_with_another_rank_are_named_by_verify(tmp_path):
    from activationscope.store.ranks import commit_ranks

    path = tmp_path / "r.zarr"
    _two_rank_token_stores(path, lambda r: {"sample_ids": [2 * r, 2 * r + 1]})
    commit_ranks(path)
    assert open_store(path).verify() == []
    # the rows of sample 2 (rank 1) said of rank 0, which has no sample 2
    _edit_tokens(path, "rank", lambda t: [0 if s == 2 else r for s, r in zip(t.column("sample_id").to_pylist(),
                                                                              t.column("rank").to_pylist())])
    (line,) = open_store(path).verify()
    assert "3 of its 12 rows have a sample_id of the sample row table but no sample row with their rank, batch, " \
           "sample_id together, first [{'rank': 0, 'batch': 0, 'sample_id': 2}]" in line, line


@pytest.mark.parametrize("edit", ["unknown", "unpaired"])
def test_verify_reads_each_row_table_once_and_pairs_token_rows_a_slice_at_a_time(tmp_path, monkeypatch, edit):
    """verify read each row table twice and paired every token row with its sample in one
    join (4 GB of memory for a store of 50 million token rows): now each part is read once
    and the token rows are paired PAIRING_ROWS at a time, with the same findings."""
    import pyarrow.acero

    from activationscope.store import _validate as V
    from activationscope.store import reader

    path = tmp_path / "s.zarr"
    _token_store(path)
    if edit == "unknown":
        _edit_tokens(path, "sample_id", [99, 99, 1, 1, 1, 10, 10, 98, 98, 97])
        want = ("row table 'token': 5 of its 10 rows have a sample_id that is in no row of the sample row table "
                "(4 rows), first [99, 98, 97]: ")
    else:
        _edit_tokens(path, "sample_id", [0, 0, 1, 10, 1, 0, 0, 11, 1, 11])
        want = ("row table 'token': 4 of its 10 rows have a sample_id of the sample row table but no sample row with "
                "their batch, sample_id together, first [{'batch': 0, 'sample_id': 10}, {'batch': 1, 'sample_id': 0}, "
                "{'batch': 1, 'sample_id': 1}]")
    (whole,) = open_store(path).verify()
    assert whole.startswith(want), whole
    joined, parts = [], []
    join, read_part = pyarrow.acero._perform_join, reader.read_parquet_part

    def recording_join(join_type, left, left_keys, right, *args, **kw):
        joined.append(left.num_rows)
        return join(join_type, left, left_keys, right, *args, **kw)

    def recording_read(raw, backend, key, *args, **kw):
        parts.append(key)
        return read_part(raw, backend, key, *args, **kw)

    monkeypatch.setattr(V, "PAIRING_ROWS", 3)
    monkeypatch.setattr(pyarrow.acero, "_perform_join", recording_join)
    monkeypatch.setattr(reader, "read_parquet_part", recording_read)
    assert open_store(path).verify() == [whole]
    assert joined and max(joined) <= 3
    assert parts and len(parts) == len(set(parts))
