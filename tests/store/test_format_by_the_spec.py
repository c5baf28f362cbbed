"""Stores read by the rules of store/FORMAT.md alone, as a reader without activationscope reads
them (json, numpy, zarr, pyarrow, numcodecs, crc32c), equal what the library reads.

The functions named ``spec_*`` import nothing of activationscope: each follows the section of
FORMAT.md it names, so a rule the writer breaks, or one the document leaves out, fails here."""

from __future__ import annotations

import hashlib
import json
import shutil
import unicodedata
from pathlib import Path
from typing import Optional

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import zarr
from acs_testing import small_transformer, toy_mlp
from hostile import _Mean

import activationscope as acs
from activationscope.reductions import script_reduction
from activationscope.store import StoreWriter, copy_store, open_store
from activationscope.store.ranks import commit_ranks

google_crc32c = pytest.importorskip("google_crc32c")

# ---------------------------------------------------------------- the reader of FORMAT.md
_NUMPY = {"float32": "<f4", "float16": "<f2", "float64": "<f8", "int8": "i1", "int16": "<i2", "int32": "<i4",
          "int64": "<i8", "uint8": "u1", "uint16": "<u2", "uint32": "<u4", "uint64": "<u8", "bool": "?",
          "complex64": "<c8", "complex128": "<c16", "bfloat16": "<u2"}  # §2, §3: bfloat16 as uint16 bits


def _crc(data: bytes) -> int:
    return int(google_crc32c.value(bytes(data)))


def spec_node_name(hook_point: str) -> str:
    """§1."""
    out = hook_point.replace("%", "%25").replace("/", "%2F").replace("\\", "%5C").replace("\x00", "%00")
    if out.startswith("__"):
        out = "%5F_" + out[2:]
    if out in (".", "..") or unicodedata.normalize("NFC", unicodedata.normalize("NFD", out).casefold()) == "zarr.json":
        out = out.replace(".", "%2E")
    out = "".join(f"%{ord(c):02X}" if c in '<>:"|?*' or 0 < ord(c) < 32 else c for c in out)
    if out.endswith((".", " ")):
        out = out[:-1] + {".": "%2E", " ": "%20"}[out[-1]]
    devices = {"CON", "PRN", "AUX", "NUL"} | {f"{d}{i}" for d in ("COM", "LPT") for i in "0123456789¹²³"}
    if out.split(".", 1)[0].rstrip(" ").upper() in devices:
        out = f"%{ord(out[0]):02X}" + out[1:]
    raw = out.encode("utf-8")
    if len(raw) > 128:
        out = raw[:100].decode("utf-8", "ignore") + "~" + hashlib.sha256(hook_point.encode("utf-8")).hexdigest()[:16]
    return out


def spec_root(path: Path) -> dict:
    """§2, §8: the root document's attributes, of a version this reader knows (§11: version 3
    keeps reductions only, `rows_stored` false, `reduced` in place of `arrays`)."""
    meta = json.loads((path / "zarr.json").read_text())["attributes"]["activationscope"]
    assert meta["format"]["name"] == "activationscope" and meta["format"]["version"] in (1, 2, 3, 4)
    assert (meta["format"]["version"] == 3) == (meta.get("rows_stored") is False)
    if meta["format"]["version"] == 3:
        assert "arrays" not in meta and "aliases" not in meta and set(meta["row_tables"]) <= {"sample"}
    return meta


def spec_rows(path: Path, entry: dict) -> np.ndarray:
    """§3, §5: the committed rows of one array, from its shard files and manifest by hand."""
    n_rows, chunk_rows, shard_rows = entry["n_rows"], entry["chunk_rows"], entry["shard_rows"]
    feature_shape = entry["feature_shape"]
    dtype = np.dtype(_NUMPY[entry["dtype"]])
    row_bytes = int(np.prod(feature_shape, dtype=np.int64)) * dtype.itemsize
    n_chunks = shard_rows // chunk_rows
    out = bytearray()
    if n_rows and row_bytes:  # (§3: rows of no byte read no chunk)
        manifest = json.loads((path / entry["manifest"]).read_text())
        assert (manifest["chunk_rows"], manifest["shard_rows"]) == (chunk_rows, shard_rows)
        shards = {s["shard"]: s for s in manifest["shards"]}
        end = 0
        for e in manifest.get("segments", []):  # §5: the records of shards first..end-1, in order
            assert e["first"] == end
            raw = (path / entry["manifest"]).with_name(f"manifest.{e['first']}.json").read_bytes()
            assert len(raw) == e["file_bytes"] and _crc(raw) == e["crc32c"]
            segment = json.loads(raw)
            assert (segment["hook_point"], segment["first"], segment["end"]) == (manifest["hook_point"], e["first"],
                                                                                 e["end"])
            assert [r["shard"] for r in segment["shards"]] == list(range(e["first"], e["end"]))
            shards.update({r["shard"]: r for r in segment["shards"]})
            end = e["end"]
        assert all(k >= end for k in (r["shard"] for r in manifest["shards"]))
        for k in range((n_rows - 1) // shard_rows + 1):
            key = f"{entry['path']}/c/{k}" + "/0" * len(feature_shape)  # §1: the Zarr default chunk key
            record = shards[k]
            assert record["key"] == key
            data = (path / key).read_bytes()
            assert len(data) == record["file_bytes"]
            index = data[-(16 * n_chunks + 4):]  # §3: (offset, nbytes) uint64 pairs, then their crc32c
            assert _crc(index[:-4]) == int.from_bytes(index[-4:], "little")
            slots = np.frombuffer(index[:-4], "<u8").reshape(n_chunks, 2)
            chunks = {c[0]: c for c in record["chunks"]}
            rows_here = min(shard_rows, n_rows - k * shard_rows)
            for j in range((rows_here - 1) // chunk_rows + 1):
                offset, nbytes = int(slots[j, 0]), int(slots[j, 1])
                assert offset + nbytes <= len(data) - len(index)
                raw = data[offset:offset + nbytes]
                assert chunks[j][1:] == [offset, nbytes, _crc(raw)]  # §5: crc32c of the encoded chunk
                decoded = spec_decode(raw, entry["compression"])
                assert len(decoded) == chunk_rows * row_bytes  # the last chunk too: written whole
                out += decoded[:min(chunk_rows, rows_here - j * chunk_rows) * row_bytes]
    return np.frombuffer(bytes(out), dtype).reshape(n_rows, *feature_shape)


def spec_decode(raw: bytes, compression: Optional[dict]) -> bytes:
    import numcodecs

    if compression is None or not raw:
        return bytes(raw)
    if compression["name"] == "zstd":
        return bytes(numcodecs.Zstd().decode(raw))
    assert compression["name"] == "blosc"
    return bytes(numcodecs.Blosc().decode(raw))


def spec_table(path: Path, table: dict) -> Optional[pa.Table]:
    """§4, §5: the listed parts in order, each with its crc32c."""
    parts = []
    for key in table["parts"]:
        data = (path / key).read_bytes()
        if "crc32c" in table:
            assert _crc(data) == table["crc32c"][key]
        parts.append(pq.read_table(path / key))
    if not parts:
        return None
    out = pa.concat_tables(parts)
    assert out.num_rows == table["n_rows"] and out.column_names == table["columns"]
    return out


def spec_reduction(path: Path, hook_point: str, name: str, entry: dict) -> np.ndarray:
    """§5, §6: one chunk, bytes codec, crc32c per file, attributes."""
    for key, crc in (entry.get("crc32c") or {}).items():
        assert _crc((path / key).read_bytes()) == crc, key
    doc = json.loads((path / entry["path"] / "zarr.json").read_text())
    assert doc["attributes"]["activationscope"] == {"hook_point": hook_point, "reduction": entry["reduction"],
                                                    "dtype": entry["dtype"]}
    value = zarr.open_array(str(path / entry["path"]), mode="r")[...]
    assert list(value.shape) == entry["shape"] and value.dtype == np.dtype(_NUMPY[entry["dtype"]])
    return value


def spec_dimension_names(meta: dict) -> dict:
    """§3: the dimension names of every array and reduction result, by path."""
    arrays, aliases, out = meta.get("arrays") or {}, meta.get("aliases") or {}, {}
    for hp, e in arrays.items():
        rows = e["row_kind"] if e["follows_row_table"] else f"{hp}.rows"
        out[e["path"]] = [rows] + [f"{hp}.dim{i}" for i in range(len(e["feature_shape"]))]
    reduced = meta.get("reduced") or {}  # (§11: the feature shape of the rows reduced)
    for hp, entries in (meta.get("reductions") or {}).items():
        target = aliases.get(hp, hp)
        features = arrays[target]["feature_shape"] if target in arrays else (
            reduced[hp]["feature_shape"] if hp in reduced else None)
        options = {e["reduction"]: e["options"] for e in entries.values() if "options" in e}
        for name, e in entries.items():
            per_feature = options.get(e["reduction"], {}).get("per_feature", 1)
            edges = e["kind"] == "hist" and name == f"{e['reduction']}.edges"
            if features is not None and e["shape"] == features and per_feature != 0 and not edges:
                out[e["path"]] = [f"{target}.dim{i}" for i in range(len(features))]
            else:
                out[e["path"]] = [f"{hp}.{name}.dim{i}" for i in range(len(e["shape"]))]
    return out


def spec_read(path: Path) -> dict:
    """Every hook point's rows (aliases resolved, §2), the row tables and the reductions."""
    meta = spec_root(path)
    arrays = meta.get("arrays") or {}
    rows = {hp: spec_rows(path, e) for hp, e in arrays.items()}
    rows.update({a: rows[t] for a, t in (meta.get("aliases") or {}).items() if t in rows})
    for hp, e in arrays.items():
        assert e["path"] == f"acts/{spec_node_name(hp)}"
        if e["n_rows"]:  # the plain Zarr read of the document, first n_rows rows only (§2)
            assert np.array_equal(zarr.open_array(str(path / e["path"]), mode="r")[:e["n_rows"]], rows[hp])
    for p, names in spec_dimension_names(meta).items():  # (informational: older stores lack them)
        assert json.loads((path / p / "zarr.json").read_text()).get("dimension_names", names) == names, p
    tables = {kind: spec_table(path, t) for kind, t in (meta.get("row_tables") or {}).items()}
    reductions = {hp: {name: spec_reduction(path, hp, name, e) for name, e in entries.items()}
                  for hp, entries in (meta.get("reductions") or {}).items()}
    return {"meta": meta, "rows": rows, "tables": tables, "reductions": reductions}


def spec_rank_view(path: Path) -> dict:
    """§10, before the commit: the rank stores of the root's run, rank by rank, with a `rank` column."""
    meta = spec_root(path)
    assert meta["distributed"]["committed"] is False and not meta.get("arrays")
    rows, tables = {}, {}
    for r in range(meta["distributed"]["world_size"]):
        rank = spec_read(path / "ranks" / f"{r:05d}")
        assert rank["meta"]["rank_store"]["run_id"] == meta["distributed"]["run_id"]
        for hp, x in rank["rows"].items():
            rows.setdefault(hp, []).append(x)
        for kind, t in rank["tables"].items():
            if t is not None:
                tables.setdefault(kind, []).append(t.append_column("rank", pa.array([r] * t.num_rows, pa.int64())))
    return {"rows": {hp: np.concatenate(x) for hp, x in rows.items()},
            "tables": {kind: pa.concat_tables(t) for kind, t in tables.items()}}


# ---------------------------------------------------------------- comparing with the library
def _torch(x: np.ndarray, dtype: str) -> torch.Tensor:
    x = np.array(x, order="C", copy=True)
    return torch.from_numpy(x.view(np.int16)).view(torch.bfloat16) if dtype == "bfloat16" else torch.from_numpy(x)


def _same(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Same dtype, shape and bits (NaN included)."""
    bits = lambda t: t.reshape(-1).contiguous().view(torch.uint8)  # noqa: E731
    return got.dtype == want.dtype and got.shape == want.shape and torch.equal(bits(got), bits(want))


def _same_as_the_library(path: Path, spec: dict) -> None:
    store = open_store(path)
    meta = spec["meta"]
    assert store.status == meta["status"] and store.n_samples == meta["n_samples"]
    assert sorted(store.hook_points) == sorted(spec["rows"] or meta.get("reduced") or {})
    for hp, x in spec["rows"].items():
        target = (meta.get("aliases") or {}).get(hp, hp)
        got, want = store[hp], _torch(x, meta["arrays"][target]["dtype"])
        assert _same(got, want), hp
    for kind, table in spec["tables"].items():
        if table is not None:
            assert store.row_table(kind).equals(table), kind
    for hp, values in spec["reductions"].items():
        assert sorted(store.reductions[hp]) == sorted(values)
        for name, x in values.items():
            want = _torch(x, meta["reductions"][hp][name]["dtype"])
            got = store.reductions[hp][name]
            assert _same(got, want), (hp, name)
    assert store.verify() == []


def _sum_of_squares(acc: Optional[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    s = x.double().pow(2).sum(0)
    return s if acc is None else acc + s


REDUCTIONS = ["mean", "var", ("hist", "hist", {"lo": -2.0, "hi": 2.0, "bins": 8}), ("topk", "topk", {"k": 3}),
              ("whole", "mean", {"per_feature": 0}), "cov"]


def _tokens(path, *, compression, storage_dtype, batches, reductions, opts=None):
    model = small_transformer().eval()
    g = torch.Generator().manual_seed(1)
    scope = acs.ActivationScope(store=str(path), capture="both", storage_dtype=storage_dtype, reductions=reductions,
                                store_options={"compression": compression, **(opts or {})})
    with scope.track(model, include=["layers.0", "layers.1.linear1"]) as tracker, torch.no_grad():
        for b in range(batches):
            mask = torch.arange(6)[None] < torch.randint(2, 7, (3,), generator=g)[:, None]
            tracker.set_batch(attention_mask=mask, label=torch.arange(3) + 10 * b,
                              token_ids=torch.arange(18).view(3, 6) + 100 * b)
            model(torch.randn(3, 6, 16, generator=g), src_key_padding_mask=~mask)


def _samples(path, *, compression, batches, opts=None, reductions=REDUCTIONS):
    model = toy_mlp(8, 2)
    g = torch.Generator().manual_seed(2 + batches)
    scope = acs.ActivationScope(store=str(path), capture="both", reductions=reductions,
                                store_options={"compression": compression, **(opts or {})})
    with scope.track(model) as tracker, torch.no_grad():
        for b in range(batches):
            tracker.set_batch(label=torch.arange(7) + b)
            model(torch.randn(7, 8, generator=g))


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    import warnings

    base = tmp_path_factory.mktemp("spec")
    pt = str(script_reduction(_sum_of_squares, base / "sumsq.pt"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the padding mask is stored as a token row of its own: said, and meant)
        _tokens(base / "tokens_bf16_zstd.zarr", compression="zstd", storage_dtype=torch.bfloat16, batches=3,
                reductions=REDUCTIONS + [pt])
        _tokens(base / "tokens_blosc.zarr", compression="blosc-lz4", storage_dtype=None, batches=3,
                reductions=["mean"], opts={"chunk_rows": 2, "shard_rows": 6})
        small = {"chunk_rows": 4, "shard_rows": 8}
        _samples(base / "resumed.zarr", compression=None, batches=2, opts=small)
        _samples(base / "resumed.zarr", compression=None, batches=2, opts={**small, "resume": True})
        _samples("memory://spec/copied.zarr", compression="zstd", batches=2)
        from activationscope.store import _format as F

        sealed, F.MANIFEST_SEGMENT_SHARDS = F.MANIFEST_SEGMENT_SHARDS, 2  # §5: segments of 2 shards
        try:
            _samples(base / "segmented.zarr", compression="zstd", batches=3, opts={"chunk_rows": 1, "shard_rows": 2})
            _samples(base / "segmented.zarr", compression="zstd", batches=2,
                     opts={"chunk_rows": 1, "shard_rows": 2, "resume": True})
        finally:
            F.MANIFEST_SEGMENT_SHARDS = sealed
        copy_store("memory://spec/copied.zarr", base / "copied.zarr")
    w = StoreWriter(base / "names.zarr", capture_config={}, model=None, storage_dtype=None, chunk_rows=2, shard_rows=4)
    names = [".", "..", "a/b%c.output", "__init__.output", "x" * 140 + ".output", "é.output", "zarr.json",
             "Zarr.JSON",  # (a TransformerLens HookPoint 'json' under a module 'zarr': named as its group's document)
             "a:b", "x?", "con", "nul.txt", "a.", "a "]  # (no Windows file name: escaped)
    with pytest.warns(RuntimeWarning, match="'zarr.json' and 'Zarr.JSON' differ only in case"):
        for i, hp in enumerate(names):
            w.open_array(hp, (2, 3), torch.float32, "sample").append(torch.arange(30.0).view(5, 2, 3) + i)
    w.open_array("empty.output", (3, 0), torch.float32, "sample").append(torch.zeros(5, 3, 0))
    w.add_batch(5, list(range(5)), None, {})
    w.commit()
    w.add_reductions("zarr.json", "mean", _Mean((torch.arange(30.0).view(5, 2, 3) + 6).double().mean(0)))
    w.close()
    w = StoreWriter(base / "empty_zstd.zarr", capture_config={}, model=None, storage_dtype=None, chunk_rows=2,
                    shard_rows=4, compression="zstd")
    w.open_array("empty.output", (0,), torch.float32, "sample").append(torch.zeros(5, 0))
    w.open_array("h.output", (2,), torch.bfloat16, "sample").append(torch.arange(10.0).view(5, 2).to(torch.bfloat16))
    w.add_batch(5, list(range(5)), None, {})
    w.close()
    return base


@pytest.mark.parametrize("name", ["tokens_bf16_zstd.zarr", "tokens_blosc.zarr", "resumed.zarr", "copied.zarr",
                                  "names.zarr", "empty_zstd.zarr", "segmented.zarr"])
def test_a_store_read_by_the_format_document_alone_is_what_the_library_reads(stores, name):
    spec = spec_read(stores / name)
    assert spec["rows"]
    _same_as_the_library(stores / name, spec)


GOLDEN = Path(__file__).resolve().parents[2] / "store" / "golden"


@pytest.mark.parametrize("name", ["v1/mlp_f32.zarr", "v1/tokens_bf16_zstd.zarr", "v2/ranks.zarr", "v4/segments.zarr",
                                  "v4/segments_zstd.zarr"])
def test_golden_stores_read_by_the_format_document_alone(name):
    spec = spec_read(GOLDEN / name)
    assert spec["rows"]
    _same_as_the_library(GOLDEN / name, spec)


def test_a_store_of_reductions_only_read_by_the_format_document_alone(tmp_path):
    # §11: reductions (a custom TorchScript one among them), the sample table and the rows reduced;
    # no activation array, no token table
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU()).eval()
    path = tmp_path / "r.zarr"
    scope = acs.ActivationScope(store=str(path), reduction_policy=acs.ReductionPolicy.STREAMING,
                                reductions=["mean", "var", ("ss", _sum_of_squares)])
    xs = [torch.randn(4, 3) for _ in range(3)]
    with scope.track(model) as tracker, torch.no_grad():
        for i, x in enumerate(xs):
            tracker.set_batch(label=torch.arange(4) + i)
            model(x)
    for p in (path, GOLDEN / "v3" / "reductions.zarr"):
        spec = spec_read(p)
        assert spec["rows"] == {} and spec["reductions"] and not (p / "acts").exists()
        _same_as_the_library(p, spec)
    meta = spec_root(path)
    assert {hp: (e["n_rows"], e["feature_shape"]) for hp, e in meta["reduced"].items()} == {
        "0.output": (12, [4]), "1.output": (12, [4])}
    with torch.no_grad():
        h = torch.cat([model[0](x) for x in xs]).double()
    assert np.allclose(spec_read(path)["reductions"]["0.output"]["ss"], h.pow(2).sum(0).numpy())


def test_the_reduction_group_says_its_hook_point(stores):
    meta = spec_root(stores / "tokens_bf16_zstd.zarr")
    for hp, entries in meta["reductions"].items():
        folder = next(iter(entries.values()))["path"].rsplit("/", 1)[0]
        doc = json.loads((stores / "tokens_bf16_zstd.zarr" / folder / "zarr.json").read_text())
        assert doc["node_type"] == "group" and doc["attributes"] == {"activationscope": {"hook_point": hp}}


def test_an_interrupted_capture_reads_its_committed_rows_by_the_document(tmp_path):
    # §2, §7: a capture stopped by an error leaves the root `incomplete`, listing the rows of its
    # recorded forwards only; its shards hold more (the forward it was in)
    path = tmp_path / "stopped.zarr"
    w = StoreWriter(path, capture_config={}, model=None, storage_dtype=None, chunk_rows=2, shard_rows=4)
    a = w.open_array("h.output", (3,), torch.float32, "sample")
    for b in range(3):
        a.append(torch.arange(15.0).view(5, 3) + 100 * b)
        w.add_batch(5, list(range(5 * b, 5 * b + 5)), None, {})
    a.append(torch.full((3, 3), -1.0))  # the forward the error stopped: never recorded
    w.abort(RuntimeError("stopped"))
    spec = spec_read(path)
    assert spec["meta"]["status"] == "incomplete" and spec["meta"]["arrays"]["h.output"]["n_rows"] == 15
    assert np.array_equal(spec["rows"]["h.output"], (torch.arange(15.0).view(5, 3)[None] + 100 * torch.arange(3.0)[:, None, None]).reshape(15, 3).numpy())
    _same_as_the_library(path, spec)


def test_rank_stores_read_by_the_document_before_and_after_their_commit(tmp_path):
    path = tmp_path / "tasks.zarr"
    for task in range(2):
        _samples(path, compression="zstd", batches=2 + task, reductions=["mean"],
                 opts={"chunk_rows": 4, "shard_rows": 8, "process_group": acs.RankStore(task, 2)})
    view = spec_rank_view(path)
    store = open_store(path)
    assert store.status == "incomplete" and sorted(store.hook_points) == sorted(view["rows"])
    for hp, x in view["rows"].items():
        assert _same(store[hp], torch.from_numpy(x.copy())), hp
    sample = store.row_table("sample")
    assert sample.equals(view["tables"]["sample"]) and sample.column_names[-1] == "rank"
    assert sample.schema.field("rank").type == pa.int64()
    ranks = {r: spec_read(path / "ranks" / f"{r:05d}") for r in range(2)}
    commit_ranks(path)
    committed = spec_read(path)
    meta = committed["meta"]
    assert meta["format"]["version"] == 2 and meta["distributed"]["committed"] is True
    assert meta["row_tables"]["sample"]["columns"][-1] == "rank"
    # §10 row order: every rank's full shards, then every rank's tail
    S = meta["distributed"]["shard_rows"]["sample"]
    for hp, x in committed["rows"].items():
        full = [ranks[r]["rows"][hp][:len(ranks[r]["rows"][hp]) // S * S] for r in range(2)]
        tails = [ranks[r]["rows"][hp][len(ranks[r]["rows"][hp]) // S * S:] for r in range(2)]
        assert np.array_equal(x, np.concatenate(full + tails)), hp
    _same_as_the_library(path, committed)
    shutil.rmtree(path)


def test_user_columns_hold_the_arrow_types_section_4_names(tmp_path):
    model = toy_mlp(8, 1)
    bf = torch.tensor([0.1, -2.5, 3e38]).to(torch.bfloat16)
    cols = {"bf": bf, "h": torch.tensor([0.5, 1.5, -2.0]).half(), "flag": torch.tensor([True, False, True]),
            "text": ["a", "b", "c"], "raw": [b"x", b"y", b"z"], "vec": torch.arange(6.0).view(3, 2)}
    with acs.ActivationScope(store=str(tmp_path / "s.zarr")).track(model) as tracker, torch.no_grad():
        tracker.set_batch(**cols)
        model(torch.randn(3, 8))
    meta = spec_root(tmp_path / "s.zarr")
    table = spec_table(tmp_path / "s.zarr", meta["row_tables"]["sample"])
    types = {f.name: f.type for f in table.schema}
    assert types["bf"] == pa.float32() and table.column("bf").to_pylist() == bf.float().tolist()
    assert types["h"] == pa.float16() and types["flag"] == pa.bool_()
    assert types["text"] == pa.string() and types["raw"] == pa.binary()
    assert pa.types.is_list(types["vec"]) and table.column("vec").to_pylist() == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]


def test_topk_row_ids_index_the_stored_rows(tmp_path, stores):
    # §6: values[i, f] == rows[row_ids[i, f], f]; in a store committed from rank stores, rows in
    # the committed order (each rank's ids were its own row indices before the commit)
    checked = 0
    path = tmp_path / "tasks.zarr"
    topk = [("topk", "topk", {"k": 3}), ("flat", "topk", {"k": 4, "per_feature": 0})]
    for task in range(2):
        _samples(path, compression=None, batches=2 + task, reductions=topk,
                 opts={"chunk_rows": 4, "shard_rows": 8, "process_group": acs.RankStore(task, 2)})
    commit_ranks(path)
    for store in (stores / "tokens_bf16_zstd.zarr", stores / "resumed.zarr", path):
        spec = spec_read(store)
        for hp, values in spec["reductions"].items():
            if "topk.values" not in values:
                continue
            rows = spec["rows"][hp]
            target = (spec["meta"].get("aliases") or {}).get(hp, hp)
            rows = bf16_rows(rows) if spec["meta"]["arrays"][target]["dtype"] == "bfloat16" else rows
            assert np.array_equal(np.take_along_axis(rows, values["topk.row_ids"], 0), values["topk.values"]), hp
            if "flat.values" in values:
                flat = rows.reshape(len(rows), -1)
                assert np.array_equal(flat[values["flat.row_ids"], values["flat.feature_ids"]], values["flat.values"])
            checked += 1
    assert checked >= 5


def bf16_rows(bits: np.ndarray) -> np.ndarray:
    """§3: bfloat16 bit patterns to the float32 values they are."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


@pytest.mark.filterwarnings("ignore:hook point '1.output' recorded 0 row")
def test_a_reduction_that_saw_no_row_has_its_count_alone(tmp_path):
    class Skip(torch.nn.Module):
        def forward(self, x):
            return x[:0] + 1  # no row in any forward

    model = torch.nn.Sequential(torch.nn.Linear(3, 3), Skip())
    with acs.ActivationScope(store=str(tmp_path / "s.zarr"), reductions=["mean", "var"]).track(model), torch.no_grad():
        model(torch.randn(2, 3))
    spec = spec_read(tmp_path / "s.zarr")
    assert sorted(spec["meta"]["reductions"]["1.output"]) == ["mean.count", "var.count"]
    assert spec["reductions"]["1.output"]["mean.count"] == 0
    assert sorted(spec["meta"]["reductions"]["0.output"]) == ["mean", "mean.count", "var", "var.count", "var.mean"]
