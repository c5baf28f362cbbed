"""verify() checks the crc32c of row-table parts and reduction files (not only activation
chunks), naming the damaged file; reading a damaged one raises StoreCorruptError."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Optional

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


def test_a_read_of_a_damaged_last_chunk_gives_the_advice_once(tmp_path):
    """A checked read (open_store(verify=True), every export) of a damaged chunk holding the
    last committed rows of a store with no kept committed copy advised to restore the store or
    capture it again twice: once from the chunk's cause, once more as the error's ending."""
    from activationscope.data import export_parquet

    model = torch.nn.Linear(4, 4)
    path = tmp_path / "s.zarr"
    with torch.no_grad(), acs.ActivationScope(store=path, store_options={"chunk_rows": 8}).track(model):
        model(torch.randn(13, 4))  # rows 8-12 end inside chunk 1
    with open(path / "acts" / "output" / "c" / "0" / "0", "r+b") as f:
        f.seek(130)
        f.write(b"\1" * 8)
    for read in (lambda: acs.open_store(path, verify=True)["output"],
                 lambda: export_parquet(path, tmp_path / "e.parquet")):
        with pytest.raises(StoreCorruptError) as info:
            read()
        message = str(info.value)
        assert "chunk 1 (rows 8-12)" in message and "crc32c mismatch" in message
        assert message.count("restore the store from an intact copy") == 1, message
        assert message.endswith("capture it again; `activationscope verify STORE` lists every damaged file"), message
    assert not (tmp_path / "e.parquet").exists()


def test_the_advice_on_a_damaged_partial_last_shard_depends_on_a_kept_committed_copy(tmp_path):
    """The chunk holding the last committed rows may have been rewritten by a resume; a local
    store can only be put back by one from the committed copy a resume kept: without it the
    advice is to restore or capture again, never to resume (a resume refuses the damaged shard)."""
    import os

    model = torch.nn.Linear(4, 4)
    path = tmp_path / "s.zarr"
    with torch.no_grad(), acs.ActivationScope(store=path, store_options={"chunk_rows": 8}).track(model):
        model(torch.randn(13, 4))  # rows 8-12 end inside chunk 1
    shard = path / "acts" / "output" / "c" / "0" / "0"
    with open(shard, "r+b") as f:
        f.seek(130)
        f.write(b"\1" * 8)
    lines = acs.open_store(path).verify()
    assert len(lines) == 1 and "chunk 1 (rows 8-12" in lines[0] and "crc32c mismatch" in lines[0]
    assert "no committed copy of its shard is kept" in lines[0]
    assert "restore the store from an intact copy, or capture it again" in lines[0]
    assert "resume the capture" not in lines[0]
    os.truncate(shard, 4000)
    lines = acs.open_store(path).verify()
    size = next(line for line in lines if "file_bytes" in line)
    assert "no committed copy of it is kept" in size and "resume the capture" not in size
    # a kept committed copy as the manifest records it: the reader reads it, nothing to advise
    original = tmp_path / "o.zarr"
    with torch.no_grad(), acs.ActivationScope(store=original, store_options={"chunk_rows": 8}).track(model):
        model(torch.randn(13, 4))
    committed = (original / "acts" / "output" / "c" / "0" / "0").read_bytes()
    with open(original / "acts" / "output" / "c" / "0" / "0.committed.tmp", "wb") as f:
        f.write(committed)
    with open(original / "acts" / "output" / "c" / "0" / "0", "r+b") as f:
        f.seek(130)
        f.write(b"\1" * 8)
    assert acs.open_store(original).verify() == []


def test_the_advice_on_a_damaged_partial_last_shard_of_an_object_store_is_to_resume():
    import uuid

    model = torch.nn.Linear(4, 4)
    url = f"memory://acs-advice-{uuid.uuid4().hex}/s.zarr"
    with torch.no_grad(), acs.ActivationScope(store=url, store_options={"chunk_rows": 8}).track(model):
        model(torch.randn(13, 4))
    import fsspec

    fs = fsspec.filesystem("memory")
    key = url[len("memory://"):] + "/acts/output/c/0/0"
    data = bytearray(fs.cat_file(key))
    data[130:138] = b"\1" * 8
    fs.pipe_file(key, bytes(data))
    lines = acs.open_store(url).verify()
    assert len(lines) == 1 and "resume the capture: it puts the committed shard back" in lines[0]


def test_info_gives_the_shard_files_as_they_are_on_disk(tmp_path):
    """bytes_on_disk of a local store is the size of its shard files as they are (a truncated
    one shows smaller than its manifest records; verify names it), not what the manifest says."""
    import os

    model = torch.nn.Linear(4, 4)
    path = tmp_path / "s.zarr"
    with torch.no_grad(), acs.ActivationScope(store=path, store_options={"chunk_rows": 8}).track(model):
        model(torch.randn(16, 4))
    shard = path / "acts" / "output" / "c" / "0" / "0"
    manifest = json.loads((path / "acts" / "output" / "manifest.json").read_text())
    assert acs.open_store(path).info()["arrays"]["output"]["bytes_on_disk"] == shard.stat().st_size == \
        manifest["shards"][0]["file_bytes"]
    os.truncate(shard, 1000)
    assert acs.open_store(path).info()["arrays"]["output"]["bytes_on_disk"] == 1000
    assert any("file_bytes" in line and "1000 bytes" in line for line in acs.open_store(path).verify())


def test_info_parses_each_manifest_once(tmp_path, monkeypatch):
    """info() reads and parses each array's manifest once: its check of the array against the
    root and its shard sizes use the same parse (they parsed it twice), and a second info()
    uses it again; the sizes are those of the shard files."""
    from activationscope.store import _validate

    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(5)], torch.nn.Linear(4, 2))
    path = tmp_path / "s.zarr"
    with torch.no_grad(), acs.ActivationScope(store=path, store_options={"chunk_rows": 4, "shard_rows": 8}).track(model):
        for _ in range(3):
            model(torch.randn(4, 4))  # 12 rows: 2 shards an array
    parsed, decoded = [], []
    parse_manifest, loads_json = _validate.parse_manifest, _validate.loads_json

    def counted_parse(doc, meta, **kw):
        parsed.append(kw["key"])
        return parse_manifest(doc, meta, **kw)

    def counted_loads(raw, **kw):
        decoded.append(kw["key"])
        return loads_json(raw, **kw)

    monkeypatch.setattr(_validate, "parse_manifest", counted_parse)
    monkeypatch.setattr(_validate, "loads_json", counted_loads)
    s = acs.open_store(path)
    info = s.info()
    manifests = sorted(s.attrs["arrays"][hp]["manifest"] for hp in info["arrays"])
    assert len(manifests) == 6 and sorted(parsed) == manifests
    assert sorted(k for k in decoded if k in manifests) == manifests
    for hp, entry in info["arrays"].items():
        shards = [f for f in (path / s.attrs["arrays"][hp]["path"] / "c").rglob("*") if f.is_file()]
        assert entry["n_rows"] == 12 and len(shards) == 2
        assert entry["bytes_on_disk"] == sum(f.stat().st_size for f in shards) > 0
    parsed.clear()
    decoded.clear()
    assert s.info()["arrays"] == info["arrays"]
    assert parsed == [] and not any(k in manifests for k in decoded)


class _CountedEntries(dict):
    """The root's ``arrays``, counting the entries looked at through ``items()``."""

    looked = 0

    def items(self):
        for entry in super().items():
            type(self).looked += 1
            yield entry


def test_info_names_each_array_without_a_scan_of_the_root(tmp_path, monkeypatch):
    """Checking an array's document names its hook point, found from its root entry: a scan of
    the root's arrays for it looked at n^2/2 entries in an info() of n arrays."""
    n = 40
    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(n - 1)], torch.nn.Linear(4, 2))
    path = tmp_path / "s.zarr"
    with torch.no_grad(), acs.ActivationScope(store=path).track(model):
        model(torch.randn(3, 4))
    s = acs.open_store(path)
    monkeypatch.setitem(s._attrs, "arrays", _CountedEntries(s._attrs["arrays"]))
    monkeypatch.setattr(_CountedEntries, "looked", 0)
    info = s.info()
    assert len(info["arrays"]) == n and all(a["n_rows"] == 3 for a in info["arrays"].values())
    assert _CountedEntries.looked <= 2 * n, _CountedEntries.looked


def _sum_rows(acc: Optional[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    s = x.sum(0)
    if acc is None:
        return s
    return acc + s


def _script_store(tmp_path, target):
    from activationscope.capture.reductions import script_reduction

    pt = script_reduction(_sum_rows, tmp_path / "sum_rows.pt")
    model = torch.nn.Sequential(torch.nn.Linear(3, 2)).eval()
    with acs.ActivationScope(store=target, reductions=[str(pt)]).track(model), torch.no_grad():
        model(torch.randn(4, 3))
    store = acs.open_store(target)
    (hp, entries), = store.attrs["reductions"].items()
    name, entry = next((n, e) for n, e in entries.items() if "script" in e)
    return hp, name, entry["script"]


def _plant_script(backend, hp, name, key, data: bytes | None, crc: str) -> None:
    """Put ``data`` (None: the big file is already there) at the script's key; the root's
    crc32c of it says ``crc``: "recorded" (the planted file's), "mismatch" (the old one), or
    "unrecorded" (none, as stores written before crc32c were recorded)."""
    from activationscope.store import _format as F

    if data is not None:
        backend.set(key, data)
    root = json.loads(backend.get("zarr.json"))
    entry = root["attributes"]["activationscope"]["reductions"][hp][name]
    if crc == "recorded":
        got = 0
        for at in range(0, backend.size(key), 16 << 20):
            got = F.crc32c(backend.get_range(key, at, 16 << 20), got)
        entry["crc32c"][key] = got
    elif crc == "unrecorded":
        del entry["crc32c"]
    backend.set("zarr.json", json.dumps(root).encode())


@pytest.mark.parametrize("crc", ["recorded", "mismatch", "unrecorded"])
def test_verify_reads_a_huge_reduction_script_in_bounded_pieces(tmp_path, monkeypatch, crc):
    """A planted script of 64 MiB is checked by a crc32c computed piece by piece: no read
    asks for more than 16 MiB (verify read it whole, and a hostile file of up to 4 GiB with it)."""

    from activationscope.store._backend import resolve

    path = tmp_path / "s.zarr"
    hp, name, key = _script_store(tmp_path, str(path))
    with open(path / key, "r+b") as f:
        f.truncate(64 << 20 | 1)  # (sparse: no disk used)
    _plant_script(resolve(str(path)), hp, name, key, None, crc)
    from acs_testing import record_biggest_pread

    biggest = record_biggest_pread(monkeypatch)
    problems = acs.open_store(path).verify()
    monkeypatch.undo()
    assert 0 < biggest[0] <= 16 << 20
    if crc == "mismatch":
        assert len(problems) == 1 and key in problems[0] and "crc32c mismatch" in problems[0], problems
    else:
        assert problems == []


@pytest.mark.parametrize("crc", ["recorded", "mismatch", "unrecorded"])
def test_verify_reads_a_huge_reduction_script_of_an_object_store_in_ranges(tmp_path, monkeypatch, crc):
    import zarr

    from activationscope.store._backend import ZarrBackend, resolve

    zs = zarr.storage.MemoryStore()
    hp, name, key = _script_store(tmp_path, zs)
    _plant_script(resolve(zs), hp, name, key, bytes(40 << 20), crc)
    asked = []
    get, get_range = ZarrBackend.get, ZarrBackend.get_range

    def whole(self, k, *args, **kw):
        asked.append((k, "whole"))
        return get(self, k, *args, **kw)

    def ranged(self, k, start, length):
        asked.append((k, length))
        return get_range(self, k, start, length)

    monkeypatch.setattr(ZarrBackend, "get", whole)
    monkeypatch.setattr(ZarrBackend, "get_range", ranged)
    problems = acs.open_store(zs).verify()
    monkeypatch.undo()
    script_reads = [n for k, n in asked if k == key]
    assert script_reads and all(n != "whole" and n <= 16 << 20 for n in script_reads), script_reads
    assert (len(problems) == 1 and key in problems[0]) if crc == "mismatch" else problems == [], problems
