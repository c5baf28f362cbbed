"""Golden stores of every released format version still read with the right values."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr

from activationscope.store import open_store

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
