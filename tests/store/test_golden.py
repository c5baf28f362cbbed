"""Golden stores of every released format version still read with the right values."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr

import activationscope as acs
from activationscope.store import open_store
from activationscope.store.ranks import commit_ranks

GOLDEN = Path(__file__).resolve().parents[2] / "store" / "golden"
SCHEMA = Path(__file__).resolve().parents[2] / "store" / "schema" / "metadata.v1.json"


def _expected(version: str) -> dict:
    return torch.load(GOLDEN / version / "expected.pt")


def test_v1_uncompressed_float32():
    store = open_store(GOLDEN / "v1" / "mlp_f32.zarr")
    exp = _expected("v1")["mlp_f32"]
    assert store.status == "complete"
    assert torch.equal(store["fc.output"], exp["fc.output"])
    assert store.row_table().column("label").to_pylist() == [i % 2 for i in range(10)]
    assert store.attrs["provenance"] == {"golden": "v1"}
    assert store.verify() == []


def test_v1_bfloat16_tokens_zstd():
    store = open_store(GOLDEN / "v1" / "tokens_bf16_zstd.zarr")
    exp = _expected("v1")["tokens_bf16_zstd"]["enc.output"]
    got = store["enc.output"]
    assert got.dtype == torch.bfloat16
    assert torch.equal(got.view(torch.int16), exp.view(torch.int16))  # bit-exact, NaN included
    tokens = store.row_table("token")
    assert tokens.column("sample_id").to_pylist() == ["a"] * 3 + ["b"] * 4
    assert tokens.column("token_ids").to_pylist() == [0, 1, 2, 4, 5, 6, 7]
    raw = zarr.open_group(str(GOLDEN / "v1" / "tokens_bf16_zstd.zarr"), mode="r")["acts/enc.output"][:]
    assert np.array_equal(raw, exp.view(torch.uint16).numpy())
    assert store.verify() == []


@pytest.mark.parametrize("name", ["mlp_f32.zarr", "tokens_bf16_zstd.zarr"])
def test_v1_metadata_matches_the_schema(name):
    jsonschema = pytest.importorskip("jsonschema")
    attrs = json.loads((GOLDEN / "v1" / name / "zarr.json").read_text())["attributes"]["activationscope"]
    jsonschema.validate(attrs, json.loads(SCHEMA.read_text()))


def test_new_stores_match_the_schema(tmp_path):
    jsonschema = pytest.importorskip("jsonschema")
    from store_models import MLP, batches_mlp, capture_store

    torch.manual_seed(0)
    capture_store(MLP().eval(), batches_mlp(2), tmp_path / "s.zarr", reductions=["mean"])
    attrs = open_store(tmp_path / "s.zarr").attrs
    jsonschema.validate(attrs, json.loads(SCHEMA.read_text()))


class _Complex(torch.nn.Module):
    def forward(self, x):
        return torch.complex(x, -x)


def test_stores_of_complex_rows_match_the_schema(tmp_path):
    # FORMAT.md section 2 lists complex64 and complex128 among the dtypes a store holds: a consumer
    # validating the metadata with the published schema refused every store that recorded one
    jsonschema = pytest.importorskip("jsonschema")
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), _Complex())
    with acs.ActivationScope(store=str(tmp_path / "c.zarr")).track(model), torch.no_grad():
        for _ in range(2):
            model(torch.randn(4, 3))
    attrs = open_store(tmp_path / "c.zarr").attrs
    assert attrs["arrays"]["1.output"]["dtype"] == "complex64"
    jsonschema.validate(attrs, json.loads(SCHEMA.read_text()))
    with pytest.raises(jsonschema.ValidationError):  # the schema still checks the dtype
        attrs["arrays"]["1.output"]["dtype"] = "complex32"
        jsonschema.validate(attrs, json.loads(SCHEMA.read_text()))


def test_version_2_stores_match_the_version_2_schema(tmp_path):
    # stores captured by several ranks are format version 2 (FORMAT.md section 10): the only published
    # schema said version 1, so their metadata (the root before the commit and after) had none to match
    jsonschema = pytest.importorskip("jsonschema")
    v1, v2 = (json.loads((SCHEMA.parent / f"metadata.v{v}.json").read_text()) for v in (1, 2))
    assert {k: v for k, v in v2["$defs"].items() if k != "distributed"} == v1["$defs"]  # one format, kept in step
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4)).eval()
    path = tmp_path / "tasks.zarr"
    for task in range(2):
        scope = acs.ActivationScope(store=str(path), reductions=["mean"],
                                    store_options={"shard_rows": 8, "process_group": acs.RankStore(task, 2)})
        with scope.track(model), torch.no_grad():
            for _ in range(2):
                model(torch.randn(3, 4))
    pending = json.loads((path / "zarr.json").read_text())["attributes"]["activationscope"]
    rank = json.loads((path / "ranks" / "00001" / "zarr.json").read_text())["attributes"]["activationscope"]
    commit_ranks(path)
    committed = json.loads((path / "zarr.json").read_text())["attributes"]["activationscope"]
    assert [pending["format"]["version"], rank["format"]["version"], committed["format"]["version"]] == [2, 1, 2]
    assert pending["distributed"]["committed"] is False and committed["distributed"]["committed"] is True
    jsonschema.validate(pending, v2)
    jsonschema.validate(committed, v2)
    jsonschema.validate(rank, v1)  # a rank store is a version 1 store
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(committed, v1)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**committed, "distributed": {"world_size": 0, "committed": True}}, v2)


def test_v2_committed_from_rank_stores():
    # FORMAT.md section 8: a golden store of every version the library writes; version 2 had none
    store = open_store(GOLDEN / "v2" / "ranks.zarr")
    exp = torch.load(GOLDEN / "v2" / "expected.pt")
    assert store.status == "complete" and store.attrs["format"]["version"] == 2
    assert store.attrs["provenance"] == {"golden": "v2"}
    # section 10's row order: the full shards (4 rows) of rank 0, then of rank 1, then the tails
    r0, r1 = exp["0.output"]
    rows = torch.cat([r0[:4], r1[:8], r0[4:], r1[8:]])
    got = store["0.output"]
    assert got.dtype == torch.bfloat16 and torch.equal(got.view(torch.int16), rows.view(torch.int16))
    table = store.row_table("sample")
    ids, labels = exp["sample_id"], exp["label"]
    assert table.column("sample_id").to_pylist() == ids[0][:4] + ids[1][:8] + ids[0][4:] + ids[1][8:]
    assert table.column("label").to_pylist() == labels[0][:4] + labels[1][:8] + labels[0][4:] + labels[1][8:]
    assert table.column("rank").to_pylist() == [0] * 4 + [1] * 8 + [0] * 2 + [1]
    assert torch.allclose(store.reductions["0.output"]["mean"], rows.double().mean(0))
    assert store.verify() == []
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(store.attrs, json.loads((SCHEMA.parent / "metadata.v2.json").read_text()))


def test_v3_keeps_reductions_only():
    # FORMAT.md section 11: reductions, the sample row table and the rows reduced; no activation row
    from activationscope.errors import StoreError

    path = GOLDEN / "v3" / "reductions.zarr"
    store = open_store(path)
    exp = torch.load(GOLDEN / "v3" / "expected.pt")
    assert store.status == "complete" and store.attrs["format"]["version"] == 3 and not store.rows_stored
    assert store.attrs["provenance"] == {"golden": "v3"}
    assert store.hook_points == ["pool.output", "tok.output"]
    assert {hp: (e["row_kind"], e["n_rows"]) for hp, e in store.reduced.items()} == {
        "pool.output": ("sample", 6), "tok.output": ("token", 21)}
    for hp in store.hook_points:
        red = store.reductions[hp]
        for name in ("mean", "var", "min", "max"):
            assert torch.allclose(red[name], exp[hp][name]), (hp, name)
        assert int(red["mean.count"]) == exp[hp]["n_rows"]
        with pytest.raises(StoreError, match="keeps reductions only"):
            store[hp]
    assert store.row_table("sample").column("sample_id").to_pylist() == exp["sample_id"]
    assert store.partial_reductions == {} and store.verify() == []
    # a plain Zarr reader reads them, at the paths the root gives (each commit's folder: FORMAT.md section 11)
    key = store.attrs["reductions"]["tok.output"]["mean"]["path"]
    assert key.startswith("reductions/tok.output/__c")
    raw = zarr.open_group(str(path), mode="r")[key][:]
    assert np.allclose(raw, exp["tok.output"]["mean"].numpy())
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads((SCHEMA.parent / "metadata.v3.json").read_text())
    jsonschema.validate(store.attrs, schema)
    v1 = json.loads(SCHEMA.read_text())
    assert {k: v for k, v in schema["$defs"].items() if k != "reduced"} == v1["$defs"]  # one format, kept in step
    with pytest.raises(jsonschema.ValidationError):  # a version 1 reader's schema refuses it
        jsonschema.validate(store.attrs, v1)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**store.attrs, "arrays": {}}, schema)


@pytest.mark.parametrize("name,hp,n_segments", [("segments.zarr", "fc.output", 5), ("segments_zstd.zarr", "enc.output", 1)])
def test_v4_segmented_manifests(name, hp, n_segments):
    # FORMAT.md section 5: the records of full committed shards sealed into segments (of 2 shards here)
    path = GOLDEN / "v4" / name
    store = open_store(path)
    exp = torch.load(GOLDEN / "v4" / "expected.pt")[hp]
    assert store.status == "complete" and store.attrs["format"]["version"] == 4
    manifest = json.loads((path / "acts" / hp / "manifest.json").read_text())
    assert len(manifest["segments"]) == n_segments and len(manifest["shards"]) == 1
    assert torch.equal(store[hp], exp)
    assert torch.equal(store[hp, 5:6], exp[5:6])
    raw = zarr.open_group(str(path), mode="r")[f"acts/{hp}"][:len(exp)]  # plain Zarr readers read it as ever
    assert np.array_equal(raw, exp.numpy())
    assert store.verify() == []
    jsonschema = pytest.importorskip("jsonschema")
    v4 = json.loads((SCHEMA.parent / "metadata.v4.json").read_text())
    v2 = json.loads((SCHEMA.parent / "metadata.v2.json").read_text())
    assert v4["$defs"] == v2["$defs"]  # one format, kept in step
    jsonschema.validate(store.attrs, v4)
    with pytest.raises(jsonschema.ValidationError):  # a version 1 reader's schema refuses it
        jsonschema.validate(store.attrs, json.loads(SCHEMA.read_text()))
