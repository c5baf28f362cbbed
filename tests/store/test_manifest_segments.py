"""Manifest segments (store/FORMAT.md section 5): each block of ``MANIFEST_SEGMENT_SHARDS`` full
committed shards of an array is sealed once into ``acts/<node>/manifest.<first>.json``, and
``manifest.json`` lists the segments and the shards after them, so that a commit writes what grows
with its new shards, not with all of them. The tests seal every 2 shards."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import activationscope as acs
from activationscope.errors import StoreCorruptError, StoreError
from activationscope.store import StoreWriter, copy_store, open_store
from activationscope.store import _format as F
from activationscope.store import _validate as V

from hostile import CHUNK_ROWS, FEATURE, HP, SHARD_ROWS, make_store

HERE = Path(__file__).parent
SEGMENT = 2


@pytest.fixture
def small_segments(monkeypatch):
    monkeypatch.setattr(F, "MANIFEST_SEGMENT_SHARDS", SEGMENT)


def _index(path: Path, hp: str = HP) -> dict:
    return json.loads((path / "acts" / hp / "manifest.json").read_text())


def _write_index(path: Path, doc: dict) -> None:
    (path / "acts" / HP / "manifest.json").write_text(json.dumps(doc))


@pytest.fixture
def segmented(tmp_path, small_segments):
    """The hostile-test store (5 shards of 64 rows) with segments [0, 2), [2, 4) and shard 4 in
    the index."""
    path = tmp_path / "s.zarr"
    data = make_store(path)
    return path, data


def test_a_long_array_is_sealed_into_segments_and_reads_back(segmented):
    path, data = segmented
    doc = _index(path)
    assert [(e["first"], e["end"]) for e in doc["segments"]] == [(0, 2), (2, 4)]
    assert [r["shard"] for r in doc["shards"]] == [4]
    for e in doc["segments"]:
        raw = (path / "acts" / HP / f"manifest.{e['first']}.json").read_bytes()
        assert e["file_bytes"] == len(raw) and e["crc32c"] == F.crc32c(raw)
        seg = json.loads(raw)
        assert (seg["hook_point"], seg["first"], seg["end"]) == (HP, e["first"], e["end"])
        assert [r["shard"] for r in seg["shards"]] == list(range(e["first"], e["end"]))
    assert json.loads((path / "zarr.json").read_text())["attributes"]["activationscope"]["format"]["version"] == 4
    st = open_store(path)
    assert torch.equal(st[HP], data)
    assert st.verify() == []
    # every record as one manifest of format version 1 lists it
    ref = {k: st._array_crcs(st._meta(HP)).shards[k] for k in range(5)}
    assert [ref[k]["rows_end"] for k in range(5)] == [64, 128, 192, 256, 320]


def test_random_row_reads_equal_plain_zarr_and_parse_one_segment(segmented, monkeypatch):
    zarr = pytest.importorskip("zarr")
    path, data = segmented
    z = zarr.open_array(str(path / "acts" / HP), mode="r")  # plain zarr-python: the segments are no concern of it
    np.testing.assert_array_equal(z[:320], data.numpy())
    loads = []
    real = V.Manifest._load
    monkeypatch.setattr(V.Manifest, "_load", lambda self, i: loads.append(i) or real(self, i))
    st = open_store(path)
    rng = random.Random(0)
    for row in rng.sample(range(320), 12):
        np.testing.assert_array_equal(st[HP, row:row + 1].numpy(), z[row:row + 1])
    assert loads == []  # memory-mapped reads and the open's checks look at the last shard only (in the index)
    st = open_store(path, verify=True)  # checks each mapped shard's chunks against its record
    assert torch.equal(st[HP, 70:71], data[70:71])
    assert loads == [0]  # shard 1 is in the segment [0, 2); the segment [2, 4) is never parsed


def test_compressed_reads_check_chunks_against_segment_records(tmp_path, small_segments):
    path = tmp_path / "z.zarr"
    data = make_store(path, compression="zstd")
    assert len(_index(path)["segments"]) == 2
    st = open_store(path)
    assert torch.equal(st[HP], data)
    assert st.verify() == []
    seg = path / "acts" / HP / "manifest.0.json"
    doc = json.loads(seg.read_bytes())
    doc["shards"][1]["chunks"][0][3] ^= 1  # shard 1's first chunk: another crc32c
    raw = json.dumps(doc).encode()
    seg.write_bytes(raw)
    index = _index(path)
    index["segments"][0].update(file_bytes=len(raw), crc32c=F.crc32c(raw))
    _write_index(path, index)
    st = open_store(path)
    assert torch.equal(st[HP, 200:210], data[200:210])
    with pytest.raises(StoreCorruptError, match=r"crc32c mismatch"):
        st[HP, 64:65]


def test_stores_of_fewer_shards_are_written_as_before(tmp_path):
    path = tmp_path / "s.zarr"
    make_store(path)  # 5 shards, segments of 1024
    doc = _index(path)
    assert list(doc) == ["hook_point", "chunk_rows", "shard_rows", "shards"]
    assert len(doc["shards"]) == 5 and not list((path / "acts" / HP).glob("manifest.*.json"))
    assert json.loads((path / "zarr.json").read_text())["attributes"]["activationscope"]["format"]["version"] == 1


def test_a_reader_of_version_3_refuses_a_segmented_store(segmented, monkeypatch):
    path, _ = segmented
    monkeypatch.setattr(F, "MAX_READ_VERSION", 3)
    with pytest.raises(StoreError, match=r"format version 4; this activationscope reads versions up to 3: upgrade "
                                         r"activationscope") as e:
        open_store(path)
    assert not isinstance(e.value, StoreCorruptError)


def test_the_writer_keeps_and_rewrites_only_the_shards_after_its_segments(tmp_path, small_segments):
    path = tmp_path / "s.zarr"
    w = StoreWriter(path, chunk_rows=2, shard_rows=4)
    a = w.open_array("x", (4,), torch.float32, "sample")
    sizes, kept = [], []
    for i in range(40):
        a.append(torch.arange(16 * i, 16 * (i + 1), dtype=torch.float32).reshape(4, 4))
        w.add_batch(4, list(range(4 * i, 4 * i + 4)), None, {})
        w.commit()
        man = path / "acts" / "x" / "manifest.json"  # (none until a shard is durable)
        sizes.append(man.stat().st_size if man.exists() else 0)
        kept.append(len(w._arrays["x"].manifest))
    w.close()
    assert max(kept) <= SEGMENT + 1  # the records of sealed shards are dropped
    # the manifest lists up to 2 shards and a segment entry per 2 sealed: far below 40 records
    one = len(json.dumps(open_store(path)._array_crcs(open_store(path)._meta("x")).shards[0]))
    assert max(sizes) < 3 * one + 20 * 80 < 40 * one  # (a manifest of every record: 40 * one bytes)
    assert len(_index(path, "x")["segments"]) == 20 and _index(path, "x")["shards"] == []
    st = open_store(path)
    assert torch.equal(st["x"], torch.arange(640, dtype=torch.float32).reshape(160, 4))
    assert st.verify() == []


# ---------------------------------------------------------------- damaged segments
def _edit_segment(path: Path, first: int, fn, *, fix_index: bool = True) -> None:
    seg = path / "acts" / HP / f"manifest.{first}.json"
    doc = json.loads(seg.read_bytes())
    fn(doc)
    raw = json.dumps(doc).encode()
    seg.write_bytes(raw)
    if fix_index:
        index = _index(path)
        e = next(e for e in index["segments"] if e["first"] == first)
        e.update(file_bytes=len(raw), crc32c=F.crc32c(raw))
        _write_index(path, index)


def _bad_crc(path):
    index = _index(path)
    index["segments"][0]["crc32c"] ^= 1
    _write_index(path, index)


def _wrong_size(path):
    index = _index(path)
    index["segments"][0]["file_bytes"] += 1
    _write_index(path, index)


def _gap(path):
    index = _index(path)
    index["segments"][1]["first"] = 3
    _write_index(path, index)


def _overlap(path):
    index = _index(path)
    index["segments"][1]["first"] = 1
    _write_index(path, index)


def _record_outside(path):
    _edit_segment(path, 0, lambda d: d["shards"][1].update(shard=2))


def _tail_inside(path):
    index = _index(path)
    index["shards"][0]["shard"] = 3
    _write_index(path, index)


def _other_first(path):
    _edit_segment(path, 0, lambda d: d.update(first=1))


def _float_end(path):
    _edit_segment(path, 2, lambda d: d.update(end=4.0))


def _other_hook_point(path):
    _edit_segment(path, 2, lambda d: d.update(hook_point="1.output"))


def _short(path):
    _edit_segment(path, 0, lambda d: d["shards"].pop())


def _missing(path):
    (path / "acts" / HP / "manifest.0.json").unlink()


def _linked(path):
    seg = path / "acts" / HP / "manifest.0.json"
    outside = path.parent / "elsewhere.json"
    shutil.copyfile(seg, outside)  # the same bytes, outside the store
    seg.unlink()
    seg.symlink_to(outside)


DAMAGE = {
    "bad crc32c": (_bad_crc, r"manifest segment acts/0\.output/manifest\.0\.json has crc32c \d+, but the manifest"),
    "wrong size": (_wrong_size, r"manifest segment acts/0\.output/manifest\.0\.json holds \d+ bytes, but the manifest"),
    "gap": (_gap, r"manifest\.json field segments\[1\]\.first must be 2 \(segments follow each other from shard 0; "
                  r"a gap otherwise\), got 3"),
    "overlap": (_overlap, r"manifest\.json field segments\[1\]\.first must be 2 .*an overlap otherwise\), got 1"),
    "record outside its segment": (_record_outside, r"manifest\.0\.json field shards\[1\]\.shard must be in 0\.\.1"),
    "index record inside a segment": (_tail_inside, r"manifest\.json field shards\[0\]\.shard must be at least 4"),
    "another first": (_other_first, r"manifest\.0\.json field first must be 0"),
    "end a float": (_float_end, r"manifest\.2\.json field end must be 4 .*got 4\.0"),
    "another hook point": (_other_hook_point, r"manifest\.2\.json field hook_point must be '0\.output'"),
    "a record short": (_short, r"manifest\.0\.json field shards must be a list of 2 records"),
    "missing": (_missing, r"manifest segment acts/0\.output/manifest\.0\.json is missing, but the manifest"),
    "linked outside the store": (_linked, r"manifest\.0\.json' resolves to .*outside the store"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_segment_is_named_by_reads_and_verify(segmented, damage):
    path, data = segmented
    edit, message = DAMAGE[damage]
    edit(path)
    st = open_store(path, verify=True)  # the open reads the index only
    with pytest.raises(StoreCorruptError, match=message):
        for row in range(0, 320, 64):
            st[HP, row:row + 1]
    problems = open_store(path).verify()
    assert any(re.search(message, p) for p in problems), problems


SEGMENT_LIES = {
    "key": (lambda d: d["shards"][1].update(key="../other.zarr/acts/0.output/c/1/0"),
            r"shard 1: key '\.\./other\.zarr/acts/0\.output/c/1/0' is not the shard's key"),
    "rows_end": (lambda d: d["shards"][0].update(rows_end=32), r"shard 0: rows_end 32 must be 64"),
    "file_bytes": (lambda d: d["shards"][1].update(file_bytes=99999),
                   r"shard 1: file_bytes 99999 differs from the size of the shard file"),
}


@pytest.mark.parametrize("lie", list(SEGMENT_LIES))
def test_verify_names_the_segment_that_holds_a_lying_record(segmented, lie, capsys):
    """A record of a segment whose key, rows_end or file_bytes lies (the segment's size and crc32c
    in the index made to match): reads stay right, and verify named the index manifest.json,
    which does not hold that record; it names the segment now."""
    from activationscope import cli

    path, data = segmented
    edit, message = SEGMENT_LIES[lie]
    _edit_segment(path, 0, edit)
    assert torch.equal(open_store(path)[HP], data)
    problems = open_store(path).verify()
    assert len(problems) == 1, problems
    assert re.search(rf"manifest acts/0\.output/manifest\.0\.json {message}", problems[0]), problems
    assert cli.main(["verify", str(path)]) == 1
    assert re.search(rf"manifest\.0\.json {message}", capsys.readouterr().err)


def test_a_wrong_hook_point_in_the_index_is_named_in_the_index(segmented, capsys):
    """manifest.json saying another hook point: verify blamed its segments (each checked against
    the index's hook_point) and reads refused them; verify names manifest.json now, each segment
    being checked against the array's hook point, and reads (which use no hook_point of a
    manifest, as in a store without segments) read the rows."""
    from activationscope import cli

    path, data = segmented
    index = _index(path)
    index["hook_point"] = "9.output"
    _write_index(path, index)
    problems = open_store(path).verify()
    assert len(problems) == 1, problems
    assert re.search(r"manifest acts/0\.output/manifest\.json says hook_point '9\.output', but it is the manifest of "
                     r"hook point '0\.output'", problems[0]), problems
    assert "manifest.0.json" not in problems[0] and "manifest.2.json" not in problems[0]
    assert torch.equal(open_store(path, verify=True)[HP], data)
    assert cli.main(["verify", str(path)]) == 1
    err = capsys.readouterr().err
    assert "manifest.json says hook_point" in err and "manifest.0.json" not in err


def test_a_segment_over_64_mib_is_refused_before_it_is_read(segmented, monkeypatch):
    path, _ = segmented
    meta, index = open_store(path)._meta(HP), _index(path)
    monkeypatch.setattr(V, "MAX_JSON_BYTES", 100)  # (the segments hold about 450 bytes)
    with pytest.raises(StoreCorruptError, match=r"segments\[0\]\.file_bytes must be an int in 1\.\.100"):
        V.parse_manifest(index, meta, store=None, key=f"acts/{HP}/manifest.json")


# ---------------------------------------------------------------- copies, readers that are not ours
def test_copy_store_to_memory_keeps_the_segments(segmented):
    path, data = segmented
    url = f"memory://acs-segments/{os.getpid()}-{random.getrandbits(32):08x}.zarr"
    copy_store(str(path), url)
    st = open_store(url)
    assert torch.equal(st[HP], data)
    assert st.verify() == []
    assert st._backend.get(f"acts/{HP}/manifest.0.json") == (path / "acts" / HP / "manifest.0.json").read_bytes()


def test_dask_and_xarray_read_a_segmented_store(segmented):
    pytest.importorskip("dask")
    path, data = segmented
    x = acs.to_dask(str(path), HP)
    np.testing.assert_array_equal(x.compute(), data.numpy())
    xr = pytest.importorskip("xarray")
    ds = xr.open_zarr(str(path), group="acts", consolidated=False)
    np.testing.assert_array_equal(ds[HP].values[:320], data.numpy())


# ---------------------------------------------------------------- resume, kills
def test_a_resume_continues_after_the_segments(segmented):
    path, data = segmented
    w = StoreWriter(path, resume=True, chunk_rows=CHUNK_ROWS, shard_bytes=SHARD_ROWS * FEATURE * 4)
    a = w.open_array(HP, (FEATURE,), torch.float32, "sample")
    assert w._arrays[HP].manifest.keys() == {4} and len(w._arrays[HP].segments) == 2
    more = torch.randn(200, FEATURE, generator=torch.Generator().manual_seed(1))
    for s in range(0, 200, 40):
        a.append(more[s:s + 40])
        w.add_batch(40, list(range(320 + s, 360 + s)), None, {"label": torch.arange(40) % 3})
        w.commit()
    w.close()
    st = open_store(path)
    assert torch.equal(st[HP], torch.cat([data, more]))
    assert [(e["first"], e["end"]) for e in _index(path)["segments"]] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert st.verify() == []


def _child(*args: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), str(HERE.parent.parent), os.environ.get("PYTHONPATH", "")]))
    return subprocess.Popen([sys.executable, str(HERE / "store_child.py"), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def _capture_segmented(path: Path) -> None:
    """store_child's capture of 12 batches into ``path`` (resumed where it holds rows), its
    manifests sealed every SEGMENT shards."""
    import store_child

    old = F.MANIFEST_SEGMENT_SHARDS
    F.MANIFEST_SEGMENT_SHARDS = SEGMENT
    try:
        store_child.capture(str(path), 12)
    finally:
        F.MANIFEST_SEGMENT_SHARDS = old


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    path = tmp_path_factory.mktemp("ref") / "ref.zarr"
    _capture_segmented(path)
    return path


def _files(path: Path) -> dict[str, bytes]:
    """The files of the arrays (row-table parts are one a commit: another run commits other parts)."""
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted((path / "acts").rglob("*")) if p.is_file()}


@pytest.mark.parametrize("mode,at", [("segrun", "batch 6"), ("segkillseal", None)])
def test_a_capture_killed_then_resumed_ends_as_an_uninterrupted_one(tmp_path, reference, mode, at):
    """Killed anywhere (``segrun``), or right after writing segments, before the manifest that
    lists them (``segkillseal``): the store reads its committed rows, and a resume ends with the
    files of an uninterrupted run (every shard, manifest and segment byte for byte)."""
    path = tmp_path / "s.zarr"
    proc = _child(str(path), mode, "12", "0.02")
    try:
        for line in proc.stdout:
            if at is not None and line.startswith(at):
                os.kill(proc.pid, signal.SIGKILL)
                break
    finally:
        proc.wait(timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read()
    st = open_store(path)
    assert st.status == "incomplete" and st.verify() == []
    if mode == "segkillseal":  # a segment written, listed by no manifest yet
        listed = {f"manifest.{e['first']}.json" for e in _index(path, "fc1.output").get("segments", [])}
        assert {p.name for p in (path / "acts" / "fc1.output").glob("manifest.*.json")} - listed
    _capture_segmented(path)
    st, ref = open_store(path), open_store(reference)
    assert st.status == "complete" and st.verify() == []
    for hp in ref.hook_points:
        assert torch.equal(st[hp], ref[hp]), hp
    assert _files(path) == _files(reference)
    assert len(_index(path, "fc1.output")["segments"]) == 3



def test_a_segment_no_manifest_lists_is_a_leftover_that_the_resume_writes_again(tmp_path, reference, capsys):
    """A capture killed after writing a segment, before the manifest that lists it: verify said
    nothing of that file; it is named now as a harmless leftover (a note, not damage), and the
    resume's sealing writes it again (whatever it holds) and lists it."""
    from activationscope import cli

    path = tmp_path / "s.zarr"
    proc = _child(str(path), "segkillseal", "12", "0.02")
    proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGKILL
    folder = path / "acts" / "fc1.output"
    listed = {f"manifest.{e['first']}.json" for e in _index(path, "fc1.output").get("segments", [])}
    left = sorted({p.name for p in folder.glob("manifest.*.json")} - listed - {"manifest.json"})
    assert left
    st = open_store(path)
    assert st.verify() == []
    lines = st.leftovers()
    assert sorted(re.search(r"manifest segment acts/fc1\.output/(manifest\.\d+\.json) is listed by no manifest", l)[1]
                  for l in lines if "'fc1.output'" in l) == left
    assert all("harmless" in l for l in lines)
    assert cli.main(["verify", str(path)]) == 0
    err = capsys.readouterr().err
    assert re.search(rf"verify: note: .*manifest segment acts/fc1\.output/{re.escape(left[0])} is listed by no "
                     r"manifest .*harmless", err), err
    for name in left:  # whatever the leftover holds, the resume's sealing replaces it
        (folder / name).write_bytes(b"{}")
    _capture_segmented(path)
    st = open_store(path)
    assert st.status == "complete" and st.verify() == [] and st.leftovers() == []
    assert _files(path) == _files(reference)


# ---------------------------------------------------------------- rank stores
def test_a_commit_of_rank_stores_seals_the_merged_manifests(tmp_path, monkeypatch):
    """Rank stores seal their own manifests, the commit reads them and seals the merged ones;
    the committed store reads as the commit of the same rank stores without segments."""
    sys.path.insert(0, str(HERE.parent / "distributed"))
    import torchrun_capture as job
    from activationscope.store.ranks import commit_ranks

    plain, seg = tmp_path / "plain.zarr", tmp_path / "seg.zarr"
    job.capture_rank_stores(str(plain), ["mean"])
    commit_ranks(str(plain))
    monkeypatch.setattr(F, "MANIFEST_SEGMENT_SHARDS", SEGMENT)
    job.capture_rank_stores(str(seg), ["mean"])
    rank0 = seg / "ranks" / "00000"
    assert json.loads((rank0 / "zarr.json").read_text())["attributes"]["activationscope"]["format"]["version"] == 4
    assert (rank0 / "acts" / "0.output" / "manifest.2.json").is_file()  # 77 rows: shards 0..3 sealed
    commit_ranks(str(seg))
    a, b = open_store(plain), open_store(seg)
    assert a.attrs["format"]["version"] == 2 and b.attrs["format"]["version"] == 4
    assert b.attrs["distributed"]["committed"] is True
    for hp in a.hook_points:
        assert torch.equal(a[hp], b[hp]), hp
        ma, mb = a._array_crcs(a._meta(hp)).shards, b._array_crcs(b._meta(hp)).shards
        assert [(e["first"], e["end"]) for e in mb.segments] == [(0, 2), (2, 4), (4, 6), (6, 8)]  # 147 rows: 9 full
        assert dict(ma.items()) == dict(mb.items())
    torch.testing.assert_close(a.reductions["0.output"]["mean"], b.reductions["0.output"]["mean"], rtol=0, atol=0)
    assert b.verify() == []


@pytest.mark.parametrize("damage", ["bad crc32c", "missing", "truncated shard"])
def test_a_resume_refuses_a_damaged_segment_or_sealed_shard_before_it_changes_anything(segmented, damage):
    path, _ = segmented
    if damage == "truncated shard":  # shard 1 is listed in the segment [0, 2) only
        p = path / "acts" / HP / "c" / "1" / "0"
        p.write_bytes(p.read_bytes()[:-8])
        message = r"c/1/0.*bytes where its manifest records"
    else:
        DAMAGE[damage][0](path)
        message = DAMAGE[damage][1]
    before = {p: p.read_bytes() for p in path.rglob("*") if p.is_file() and p.name != ".activationscope-writer.lock"}
    with pytest.raises(StoreCorruptError, match=message):
        StoreWriter(path, resume=True)
    after = {p: p.read_bytes() for p in path.rglob("*") if p.is_file() and p.name != ".activationscope-writer.lock"}
    assert after == before


def test_a_remote_resume_refuses_a_damaged_segment_when_it_opens_the_array(segmented):
    path, _ = segmented
    url = f"memory://acs-segments/{os.getpid()}-{random.getrandbits(32):08x}.zarr"
    copy_store(str(path), url)
    from activationscope.store._backend import resolve

    b = resolve(url)
    raw = b.get(f"acts/{HP}/manifest.2.json")
    b.set(f"acts/{HP}/manifest.2.json", raw.replace(b'"rows_end": 192', b'"rows_end": 191'))  # (same size)
    w = StoreWriter(url, resume=True)
    with pytest.raises(StoreCorruptError, match=r"manifest segment acts/0\.output/manifest\.2\.json has crc32c"):
        w.open_array(HP, (FEATURE,), torch.float32, "sample")
    w.abort(RuntimeError("refused"))
    assert open_store(url).n_rows(HP) == 320


def test_a_segment_claiming_trillions_of_shards_is_counted_without_a_step_per_shard(segmented):
    # the open counts the shards the manifest lists up to the last committed one: a segment's range
    # counts at once (one step per shard number of a range of 2**40 would never end), and the
    # missing shard file is named
    from hostile import edit_root

    path, _ = segmented
    last = (1 << 40) - 1
    n = (last + 1) * SHARD_ROWS
    edit_root(path, lambda a: a["arrays"][HP].update(n_rows=n))
    doc = json.loads((path / "acts" / HP / "zarr.json").read_text())
    doc["shape"][0] = n
    (path / "acts" / HP / "zarr.json").write_text(json.dumps(doc))
    index = _index(path)
    tail = {**index["shards"][0], "shard": last, "key": f"acts/{HP}/c/{last}/0", "rows_end": n}
    index["segments"] = [{**index["segments"][0], "end": last}]
    index["shards"] = [tail]
    _write_index(path, index)
    with pytest.raises(StoreCorruptError, match=rf"shard 'acts/0\.output/c/{last}/0' is missing"):
        open_store(path)[HP, 0:1]


def test_info_sizes_a_local_store_without_reading_its_segments(segmented, monkeypatch):
    """info() read every segment of every array to size the shards, whose local sizes are the
    files' own: it reads none now, and gives the same bytes on disk; a store in memory, whose
    sizes are its records', reads them."""
    path, _ = segmented
    loads = []
    real = V.Manifest._load
    monkeypatch.setattr(V.Manifest, "_load", lambda self, i: loads.append(i) or real(self, i))
    files = sum(p.stat().st_size for p in (path / "acts" / HP / "c").rglob("*") if p.is_file())
    info = open_store(path).info()
    assert info["arrays"][HP]["bytes_on_disk"] == info["bytes_on_disk"] == files
    # counted from the manifest's index, as the format version's reason says
    assert info["arrays"][HP]["n_manifest_segments"] == 2
    assert info["format_reason"] == "manifest segments: a long array's full shard records sealed in blocks"
    assert loads == []
    url = f"memory://acs-segments/{os.getpid()}-{random.getrandbits(32):08x}.zarr"
    copy_store(str(path), url)
    assert open_store(url).info()["arrays"][HP]["bytes_on_disk"] == files
    assert sorted(loads) == [0, 1]
