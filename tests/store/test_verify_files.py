"""verify() checks the crc32c of row-table parts and reduction files (not only activation
chunks), naming the damaged file; reading a damaged one raises StoreCorruptError."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import activationscope as acs
from activationscope.errors import StoreCorruptError

GOLDEN = Path(__file__).resolve().parents[2] / "store" / "golden" / "v1"


@pytest.fixture
def store_path(tmp_path):
    path = tmp_path / "s.zarr"
    enc = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU()).eval()  # token rows with a mask
    scope = acs.ActivationScope(store=str(path), reductions=["mean"])
    with scope.track(enc) as tr:
        with torch.no_grad():
            for i in range(2):
                x = torch.randn(3, 5, 8)
                mask = torch.ones(3, 5, dtype=torch.bool)
                mask[0, 3:] = False
                tr.set_batch(attention_mask=mask, sample_ids=[3 * i, 3 * i + 1, 3 * i + 2])
                enc(x)
    return path


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset % len(data)] ^= 0x01
    path.write_bytes(bytes(data))


def test_clean_store_verifies_and_records_crcs(store_path):
    store = acs.open_store(store_path)
    assert store.verify() == []
    attrs = store.attrs
    for kind in ("sample", "token"):
        info = attrs["row_tables"][kind]
        assert set(info["crc32c"]) == set(info["parts"]) and info["parts"]
    entry = next(iter(attrs["reductions"].values()))["mean"]
    assert list(entry["crc32c"]) == [entry["path"] + "/c/0"]


@pytest.mark.parametrize("kind", ["token", "sample"])
def test_flipped_byte_in_a_row_table_part(store_path, kind):
    part = f"rows/{kind}/part-000000.parquet"
    _flip(store_path / part, 40)
    problems = acs.open_store(store_path).verify()
    assert len(problems) == 1 and part in problems[0] and "crc32c" in problems[0], problems
    with pytest.raises(StoreCorruptError, match=part):
        acs.open_store(store_path).row_table(kind)


def test_flipped_byte_in_a_reduction_chunk(store_path):
    store = acs.open_store(store_path)
    hp = next(iter(store.reductions))
    key = store.attrs["reductions"][hp]["mean"]["path"] + "/c/0"
    _flip(store_path / key, 5)
    problems = acs.open_store(store_path).verify()
    assert len(problems) == 1 and key in problems[0] and "crc32c" in problems[0] and hp in problems[0], problems
    with pytest.raises(StoreCorruptError, match="mean"):
        acs.open_store(store_path).reductions[hp]


def test_missing_reduction_chunk(store_path):
    store = acs.open_store(store_path)
    hp = next(iter(store.reductions))
    key = store.attrs["reductions"][hp]["mean"]["path"] + "/c/0"
    (store_path / key).unlink()
    problems = acs.open_store(store_path).verify()
    assert any(key in p and "missing" in p for p in problems), problems


def test_cli_verify_names_the_damaged_part(store_path, capsys):
    from activationscope import cli

    _flip(store_path / "rows/token/part-000000.parquet", 40)
    assert cli.main(["verify", str(store_path)]) == 1
    err = capsys.readouterr().err
    assert "rows/token/part-000000.parquet" in err and "Traceback" not in err


def test_v1_golden_without_crcs_still_verifies(tmp_path):
    # stores written before the crcs were recorded: verify checks the parts' presence only
    path = tmp_path / "g.zarr"
    shutil.copytree(GOLDEN / "mlp_f32.zarr", path)
    attrs = json.loads((path / "zarr.json").read_text())["attributes"]["activationscope"]
    assert "crc32c" not in attrs["row_tables"]["sample"]
    assert acs.open_store(path).verify() == []
