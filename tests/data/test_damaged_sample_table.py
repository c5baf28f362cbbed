"""A damaged sample row table is raised as damage, never read as a store without one.

The per-sample columns of token rows (``label``, ``text``) come from the store's sample row
table. Its read was wrapped in ``except Exception``, taken as "the store has no sample table":
a part with another crc32c, or a part missing, then read as a dataset whose ``columns=
["label"]`` "are not in the token row table", a filter on ``label`` that named no column, an
export that left the column out without a word, and a report whose ``label_column`` was "not a
column of the store's row tables". Each now raises the StoreCorruptError naming the part. A
store with no sample rows reads an empty sample table, as before."""

from __future__ import annotations

import json
import shutil

import pyarrow.compute as pc
import pytest
import torch

import activationscope as acs
from activationscope.data import ActivationDataset, export_parquet
from activationscope.errors import StoreCorruptError

BATCH, POS = 4, 3


@pytest.fixture(scope="module")
def intact(tmp_path_factory):
    """A token store of 2 forwards with a per-sample ``label`` (a sample row-table part each)."""
    path = tmp_path_factory.mktemp("samples") / "t.zarr"
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 4)).eval()
    gen = torch.Generator().manual_seed(0)
    with acs.ActivationScope(store=str(path)).track(model, include=["1"]) as tracker, torch.no_grad():
        for f in range(2):
            tracker.set_batch(attention_mask=torch.ones(BATCH, POS, dtype=torch.bool),
                              sample_ids=list(range(f * BATCH, (f + 1) * BATCH)), label=[i % 2 for i in range(BATCH)])
            model(torch.randint(0, 10, (BATCH, POS), generator=gen))
    return path


def _sample_part(path):
    attrs = json.loads((path / "zarr.json").read_text())["attributes"]["activationscope"]
    return attrs["row_tables"]["sample"]["parts"][-1]


@pytest.fixture(params=["flipped", "missing"])
def damaged(intact, tmp_path, request):
    """A copy of the store whose last sample row-table part has a flipped byte, or is gone."""
    path = tmp_path / "damaged.zarr"
    shutil.copytree(intact, path)
    key = _sample_part(path)
    part = path / key
    if request.param == "flipped":
        raw = bytearray(part.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        part.write_bytes(bytes(raw))
    else:
        part.unlink()
    return str(path), key


def test_the_intact_store_reads_its_sample_columns(intact):
    ds = ActivationDataset(str(intact), columns=["label"])
    assert ds[:]["label"].tolist() == [i % 2 for i in range(BATCH) for _ in range(POS)] * 2
    assert len(ActivationDataset(str(intact), filter=pc.field("label") == 1)) == BATCH * POS


def test_columns_of_a_damaged_sample_table_raise_its_damage(damaged):
    path, key = damaged
    with pytest.raises(StoreCorruptError, match=key):
        ActivationDataset(path, columns=["label"])


def test_a_filter_on_a_damaged_sample_table_raises_its_damage(damaged):
    path, key = damaged
    with pytest.raises(StoreCorruptError, match=key):
        ActivationDataset(path, filter=pc.field("label") == 1)


def test_sample_ids_of_a_damaged_sample_table_raise_its_damage(damaged):
    # (the ids are checked against the store's samples: a sample with no token row is one)
    path, key = damaged
    with pytest.raises(StoreCorruptError, match=key):
        ActivationDataset(path, sample_ids=[0, 1])


@pytest.mark.parametrize("columns", [["label"], None])
def test_an_export_of_a_damaged_sample_table_raises_its_damage(damaged, tmp_path, columns):
    # (columns=None: every column, the per-sample ones too, which were left out without a word)
    path, key = damaged
    with pytest.raises(StoreCorruptError, match=key):
        export_parquet(path, tmp_path / "out.parquet", columns=columns)
    assert not (tmp_path / "out.parquet").exists()


def test_a_report_label_column_of_a_damaged_sample_table_raises_its_damage(damaged, tmp_path):
    pytest.importorskip("matplotlib")
    from activationscope.analysis.report import write_report

    path, key = damaged
    with pytest.raises(StoreCorruptError, match=key):
        write_report(path, tmp_path / "report", label_column="label")


def test_a_store_without_a_sample_table_reads_its_token_columns_as_before(intact, tmp_path):
    # (a root listing no sample table: the store reads an empty one, no per-sample column)
    path = tmp_path / "no-samples.zarr"
    shutil.copytree(intact, path)
    doc = json.loads((path / "zarr.json").read_text())
    attrs = doc["attributes"]["activationscope"]
    del attrs["row_tables"]["sample"]
    attrs["n_samples"] = 0
    (path / "zarr.json").write_text(json.dumps(doc))
    shutil.rmtree(path / "rows" / "sample")
    ds = ActivationDataset(str(path), columns=["sample_id"], filter=pc.field("sample_id") < 2, sample_ids=[0, 1, 5])
    assert ds[:]["sample_id"].tolist() == [0] * POS + [1] * POS
    with pytest.raises(ValueError, match=r"columns \['label'\] are not in the token row table"):
        ActivationDataset(str(path), columns=["label"])
