"""Reads that check what they read: metadata counts against the array's own files before
anything is allocated, and every decoded chunk against its manifest crc32c, on every path
that decodes (Store, ActivationDataset, export, to_dask). FORMAT.md section 9 rules 12, 16."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numcodecs
import numpy as np
import pyarrow as pa
import pytest

from activationscope.data import ActivationDataset
from activationscope.data.export import export_arrow
from activationscope.errors import StoreCorruptError, StoreError
from activationscope.store import open_store

from hostile import FEATURE, HP, edit_root, make_store, shard

HERE = Path(__file__).parent
ROOT = HERE.parents[1]


def _raise_counts(path: Path, n: int, *, doc: bool = False, manifest: bool = False, last_shard: bool = False) -> None:
    """Edit the root's n_rows to ``n``; optionally make the array document, the manifest and
    the last shard file agree with it (a hostile store consistent layer after layer)."""
    edit_root(path, lambda a: a["arrays"][HP].update(n_rows=n))
    arr = path / "acts" / HP
    if doc:
        d = json.loads((arr / "zarr.json").read_text())
        d["shape"][0] = n
        (arr / "zarr.json").write_text(json.dumps(d))
    shard_rows = json.loads((arr / "manifest.json").read_text())["shard_rows"]
    last = (n - 1) // shard_rows
    if manifest:
        m = json.loads((arr / "manifest.json").read_text())
        m["shards"].append({**m["shards"][0], "shard": last, "key": f"acts/{HP}/c/{last}/0", "rows_end": n})
        (arr / "manifest.json").write_text(json.dumps(m))
    if last_shard:
        dst = shard(path, last)
        dst.parent.mkdir(parents=True)
        dst.write_bytes(shard(path, 0).read_bytes())


def _run_capped(code: str, cap_gib: int = 2) -> subprocess.CompletedProcess:
    """Run ``code`` in a child whose address space is capped ``cap_gib`` GiB above its imports
    (an allocation sized from metadata fails there instead of succeeding lazily)."""
    prelude = textwrap.dedent(f"""
        import resource, sys
        import torch
        from activationscope.store import open_store
        from activationscope.data import ActivationDataset
        from activationscope.errors import ActivationScopeError
        with open("/proc/self/statm") as f:
            vm = int(f.read().split()[0]) * resource.getpagesize()
        resource.setrlimit(resource.RLIMIT_AS, (vm + ({cap_gib} << 30), vm + ({cap_gib} << 30)))
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(HERE), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)], capture_output=True, text=True,
                          env=env, timeout=300)


# ------------------------------------------------------------------ counts before allocation
@pytest.mark.parametrize("compression", [None, "zstd"])
@pytest.mark.parametrize("layers, message", [
    ({}, r"acts/0.output/zarr.json holds 96 rows \(shape\[0\]\), but the root document zarr.json says 2147483648"),
    ({"doc": True}, r"manifest acts/0.output/manifest.json lists no shard 33554431, but the root .* 2147483648"),
    ({"doc": True, "manifest": True}, r"manifest acts/0.output/manifest.json lists 3 of the 33554432 shards .* "
                                      r"2147483648 .*first missing: shard 2"),
    ({"doc": True, "manifest": True, "last_shard": True}, r"manifest .* lists 3 of the 33554432 shards"),
], ids=["root", "root+doc", "root+doc+manifest", "root+doc+manifest+last-shard"])
def test_raised_n_rows_is_refused_before_any_allocation(tmp_path, compression, layers, message):
    """n_rows 2**31 (64 GiB of rows) in a 96-row store: every read path refuses it, naming
    the file that disagrees, inside a 2 GiB address-space cap (nothing sized from the count
    is allocated first: torch would fail with its own RuntimeError)."""
    path = tmp_path / "s.zarr"
    make_store(path, compression=compression, n_rows=96)
    _raise_counts(path, 1 << 31, **layers)
    r = _run_capped(f"""
        path = {str(path)!r}
        for read in (lambda: open_store(path)["{HP}"], lambda: open_store(path)["{HP}", ::-1],
                     lambda: open_store(path).rows("{HP}", 0, 1 << 31),
                     lambda: ActivationDataset(path)[0:1 << 31], lambda: ActivationDataset(path)[1 << 30:(1 << 30) + 5]):
            try:
                read()
            except ActivationScopeError as e:
                print(type(e).__name__, e)
            else:
                print("READ")
    """)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.splitlines()
    assert len(lines) == 5, r.stdout + r.stderr[-2000:]
    import re

    for line in lines:
        assert line.startswith("StoreCorruptError"), line
        assert re.search(message, line), line


def test_n_rows_raised_within_the_last_chunk_is_refused(tmp_path):
    """90 committed rows, the last chunk written whole (96 rows, zero-padded): n_rows raised
    to 96 in the root read six rows of zeros before; now the count is checked against the
    array document (shape[0] 90, read from the bytes written) and the manifest."""
    for compression in (None, "zstd"):
        path = tmp_path / f"{compression}.zarr"
        make_store(path, compression=compression, n_rows=90)
        doc = json.loads((path / "acts" / HP / "zarr.json").read_text())
        assert doc["shape"][0] == 90
        _raise_counts(path, 96)
        s = open_store(path)
        for read in (lambda: s[HP], lambda: s.rows(HP, 88, 96), lambda: s.n_rows(HP),
                     lambda: ActivationDataset(path)[80:96]):
            with pytest.raises(StoreCorruptError, match=r"array document acts/0.output/zarr.json holds 90 rows "
                                                        r"\(shape\[0\]\), but the root document zarr.json says 96 "
                                                        r"rows .*activationscope verify"):
                read()
        assert any("zarr.json" in p and "96" in p for p in s.verify())
        # the array document raised too: the manifest's rows_end (90) disagrees
        d = json.loads((path / "acts" / HP / "zarr.json").read_text())
        d["shape"][0] = 96
        (path / "acts" / HP / "zarr.json").write_text(json.dumps(d))
        with pytest.raises(StoreCorruptError, match=r"manifest acts/0.output/manifest.json says shard 1 ends at row "
                                                    r"90, but the root document zarr.json says 96 rows"):
            open_store(path)[HP]


def test_n_rows_behind_the_array_document_reads(tmp_path):
    """A root behind its arrays (a commit in progress) is valid: only the root's rows read."""
    path = tmp_path / "s.zarr"
    data = make_store(path, n_rows=96)
    _raise_counts(path, 40)
    s = open_store(path)
    assert s.n_rows(HP) == 40
    assert np.array_equal(s[HP].numpy(), data[:40].numpy())


# ------------------------------------------------------------------ chunk checksums
def _damage_a_chunk_so_it_still_decodes(path: Path) -> tuple[int, bytes]:
    """Flip one byte of chunk 1 of shard 0 of a zstd store, at a place where the frame still
    decodes (to the right size, with other bytes). Returns (offset in the file, the chunk's
    undamaged encoded bytes). Reference: numcodecs on the bytes written."""
    f = shard(path, 0)
    data = bytearray(f.read_bytes())
    man = json.loads((path / "acts" / HP / "manifest.json").read_text())
    _slot, off, nb, _crc = next(c for c in man["shards"][0]["chunks"] if c[0] == 1)
    good = bytes(data[off:off + nb])
    ref = numcodecs.Zstd().decode(good)
    for pos in range(nb - 1, nb // 2, -1):  # random rows compress to raw blocks: bytes near the end are literals
        bad = bytearray(good)
        bad[pos] ^= 0x55
        try:
            out = numcodecs.Zstd().decode(bytes(bad))
        except Exception:  # noqa: BLE001 - this byte breaks the frame: try another
            continue
        if len(out) == len(ref) and bytes(out) != bytes(ref):
            data[off + pos] ^= 0x55
            f.write_bytes(bytes(data))
            return off + pos, good
    raise AssertionError("no byte of the chunk decodes to other bytes when flipped")


def test_damaged_zstd_chunk_is_an_error_on_every_read_path(tmp_path):
    path = tmp_path / "z.zarr"
    data = make_store(path, compression="zstd", n_rows=96)
    _damage_a_chunk_so_it_still_decodes(path)
    match = r"chunk 1 \(rows 16-31, shard acts/0.output/c/0/0\).*'acts/0.output/c/0/0'.*crc32c mismatch"
    s = open_store(path)
    assert np.array_equal(s.rows(HP, 0, 16).numpy(), data[:16].numpy())  # the other chunks read
    assert np.array_equal(s.rows(HP, 32, 96).numpy(), data[32:].numpy())
    with pytest.raises(StoreCorruptError, match=match):
        s.rows(HP, 20, 21)
    with pytest.raises(StoreCorruptError, match=match):
        open_store(path)[HP]
    with pytest.raises(StoreCorruptError, match=match):
        ActivationDataset(path)[16:32]
    with pytest.raises(StoreCorruptError, match=match):
        ActivationDataset(path, hook_points=HP, columns="label")[0:96]
    with pytest.raises(StoreCorruptError, match=match):
        export_arrow(path, tmp_path / "out.arrow")
    assert not (tmp_path / "out.arrow").exists() or pa.ipc.open_file(tmp_path / "out.arrow").num_record_batches == 0
    assert any("crc32c mismatch" in p for p in open_store(path).verify())


# ------------------------------------------------------------------ Dask workers
def _to_dask(path):
    pytest.importorskip("dask")
    from activationscope.analysis.dask import to_dask

    return to_dask(str(path), HP)


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_to_dask_workers_check_what_they_read(tmp_path, compression):
    """The graph is made first, the store damaged after: each worker task opens and checks its
    shard as the reader does (our errors naming the file, never other bytes)."""
    path = tmp_path / "s.zarr"
    data = make_store(path, compression=compression)
    x = _to_dask(path)
    assert np.array_equal(x.compute(scheduler="sync"), data.numpy())
    # a damaged chunk (a flipped byte that still decodes, for zstd)
    f = shard(path, 1)
    good = f.read_bytes()
    if compression:
        _damage_a_chunk_so_it_still_decodes_in(path, 1)
    else:
        bad = bytearray(good)
        bad[100] ^= 0x10  # row 3 of shard 1, a float's bits
        f.write_bytes(bytes(bad))
    with pytest.raises(StoreCorruptError, match=r"shard 'acts/0.output/c/1/0'.*crc32c mismatch"):
        x.compute(scheduler="sync")
    assert np.array_equal(x[:64].compute(scheduler="sync"), data[:64].numpy())  # other shards read
    # a FIFO in the shard's place: refused at once, never blocks the worker
    f.unlink()
    os.mkfifo(f)
    with pytest.raises(StoreCorruptError, match=r"'acts/0.output/c/1/0' must be a regular file, got a FIFO"):
        x[64:128].compute(scheduler="sync")
    # a link leaving the store
    f.unlink()
    (tmp_path / "elsewhere").write_bytes(good)
    f.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(StoreCorruptError, match=r"outside the store"):
        x[64:128].compute(scheduler="sync")
    # missing: an error, not fill values
    f.unlink()
    with pytest.raises(StoreCorruptError, match=r"shard 'acts/0.output/c/1/0' is missing"):
        x[64:128].compute(scheduler="sync")


@pytest.mark.parametrize("where", ["local", "memory"])
def test_to_dask_names_a_shard_cut_short_as_the_reader_does(tmp_path, where):
    """A shard file cut short after its commit: the Dask task's message gives both sizes and
    "cut short after its commit", as Store reads do (not a bare index crc32c mismatch)."""
    import uuid

    import fsspec

    pytest.importorskip("dask")
    from activationscope.analysis.dask import to_dask

    if where == "local":
        path = str(tmp_path / "s.zarr")
        make_store(Path(path))
        key = str(shard(Path(path), 1))
        good = Path(key).read_bytes()
        Path(key).write_bytes(good[:len(good) // 2])
    else:
        path = f"memory://acs-dask/{uuid.uuid4().hex}.zarr"
        make_store(path)
        fs = fsspec.filesystem("memory")
        key = f"{path[len('memory://'):]}/acts/{HP}/c/1/0"
        good = fs.cat_file(key)
        fs.pipe_file(key, good[:len(good) // 2])
    said = (rf"shard 'acts/0.output/c/1/0': shard index crc32c mismatch \(stored \w+, computed \w+\): it holds "
            rf"{len(good) // 2} bytes, its manifest acts/0.output/manifest.json records {len(good)} \(file_bytes\), "
            r"so it was cut short after its commit")
    with pytest.raises(StoreCorruptError, match=said):
        open_store(path)[HP][64:128]
    with pytest.raises(StoreCorruptError, match=said):
        to_dask(path, HP)[64:128].compute(scheduler="sync")


def _damage_a_chunk_so_it_still_decodes_in(path: Path, k: int) -> None:
    f = shard(path, k)
    data = bytearray(f.read_bytes())
    man = json.loads((path / "acts" / HP / "manifest.json").read_text())
    _slot, off, nb, _crc = next(c for c in next(s for s in man["shards"] if s["shard"] == k)["chunks"] if c[0] == 0)
    good = bytes(data[off:off + nb])
    ref = numcodecs.Zstd().decode(good)
    for pos in range(nb - 1, nb // 2, -1):
        bad = bytearray(good)
        bad[pos] ^= 0x55
        try:
            out = numcodecs.Zstd().decode(bytes(bad))
        except Exception:  # noqa: BLE001
            continue
        if len(out) == len(ref) and bytes(out) != bytes(ref):
            data[off + pos] ^= 0x55
            f.write_bytes(bytes(data))
            return
    raise AssertionError("no byte of the chunk decodes to other bytes when flipped")


def test_to_dask_store_replaced_after_the_graph_is_named(tmp_path):
    path = tmp_path / "s.zarr"
    make_store(path, compression="zstd")
    x = _to_dask(path)
    import shutil

    other = tmp_path / "other.zarr"
    # same layout, other chunk bytes: a new run (run_id) in the old one's place
    from activationscope.store import StoreWriter
    import torch

    w = StoreWriter(other / "x", compression="zstd", chunk_rows=16, shard_bytes=64 * FEATURE * 4)
    a = w.open_array(HP, (FEATURE,), torch.float32, "sample")
    a.append(torch.randn(320, FEATURE, generator=torch.Generator().manual_seed(9)))
    w.add_batch(320)
    w.close()
    shutil.rmtree(path)
    shutil.copytree(other / "x", path)
    with pytest.raises(StoreError, match=r"was replaced since the Dask graph was made.*to_dask") as e:
        x.compute(scheduler="sync")
    assert not isinstance(e.value, StoreCorruptError)


def test_to_dask_store_removed_after_the_graph_is_named_as_removed(tmp_path):
    """A graph computed after its store was removed (a rank store its multi-rank store's
    commit removed) said the store "was replaced (another run is there now)"."""
    import shutil

    path = tmp_path / "s.zarr"
    make_store(path, compression="zstd")
    x = _to_dask(path)
    shutil.rmtree(path)
    with pytest.raises(StoreError, match=r"was removed or moved since the Dask graph was made \(no readable store is "
                       r"there now.*make the graph again \(to_dask\)") as e:
        x.compute(scheduler="sync")
    assert not isinstance(e.value, StoreCorruptError)


def test_to_dask_workers_never_import_torch(tmp_path):
    """The graph, pickled, computes in a process where importing torch fails."""
    import pickle

    path = tmp_path / "s.zarr"
    data = make_store(path, compression="zstd")
    x = _to_dask(path)
    (tmp_path / "graph.pkl").write_bytes(pickle.dumps(x))
    np.save(tmp_path / "ref.npy", data.numpy())
    code = textwrap.dedent(f"""
        import pickle, sys
        sys.modules["torch"] = None  # any import of torch fails
        import numpy as np
        x = pickle.loads(open({str(tmp_path / "graph.pkl")!r}, "rb").read())
        got = x.compute(scheduler="sync")
        assert np.array_equal(got, np.load({str(tmp_path / "ref.npy")!r}))
        assert "activationscope.store" not in sys.modules
        print("ok")
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_resume_after_a_killed_resume_rereads_its_rewritten_chunk(tmp_path, compression):
    """A resume killed before its next commit leaves the shard of the last committed row
    rewritten (with rows past n_rows) under the old manifest: the chunk straddling n_rows
    then differs from its recorded crc32c (FORMAT.md section 5). Its committed rows, followed
    by zeros and encoded again, match the record: they read as committed (a committed row
    changed there is an error); a new resume re-reads it unchecked and finishes the store,
    which then verifies clean."""
    import torch

    from activationscope.store import StoreWriter

    data = torch.randn(96, FEATURE, generator=torch.Generator().manual_seed(5))

    def write(path, rows):
        w = StoreWriter(path, compression=compression, chunk_rows=16, shard_bytes=64 * FEATURE * 4)
        a = w.open_array(HP, (FEATURE,), torch.float32, "sample")
        a.append(rows)
        w.add_batch(len(rows))
        w.close(status="incomplete")

    a_path, b_path = tmp_path / "a.zarr", tmp_path / "b.zarr"
    write(a_path, data[:90])
    write(b_path, data)  # what the killed resume had written into shard 1: rows 64..95
    shard(a_path, 1).write_bytes(shard(b_path, 1).read_bytes())
    if compression:
        assert torch.equal(open_store(a_path).rows(HP, 80, 90), data[80:90])
        damaged = tmp_path / "d.zarr"
        write(damaged, data[:90])
        changed = data.clone()
        changed[85] += 1  # (a committed row the rewrite does not keep)
        write(tmp_path / "c.zarr", changed)
        shard(damaged, 1).write_bytes(shard(tmp_path / "c.zarr", 1).read_bytes())
        with pytest.raises(StoreCorruptError, match=r"chunk 5 .*(crc32c mismatch|gives the chunk \d+ bytes)"):
            open_store(damaged).rows(HP, 80, 90)
    w = StoreWriter(a_path, resume=True, compression=compression, chunk_rows=16, shard_bytes=64 * FEATURE * 4)
    a = w.open_array(HP, (FEATURE,), torch.float32, "sample")
    a.append(data[90:])
    w.add_batch(6)
    w.close()
    s = open_store(a_path)
    assert torch.equal(s[HP], data) and s.verify() == []


def test_flipped_bytes_in_a_mapped_shard_and_the_opt_in_check(tmp_path):
    """Zero-copy reads of an uncompressed shard do not checksum its bytes (the documented
    limit: a flipped byte reads as it is); verify() finds it, and open_store(verify=True)
    checks each mapped shard's chunks once, when the shard is first read."""
    import torch

    path = tmp_path / "s.zarr"
    data = make_store(path)  # 320 rows, 64-row shards, 16-row chunks, 32-byte rows
    f = shard(path, 1)
    raw = bytearray(f.read_bytes())
    raw[20 * 32 + 5] ^= 0x40  # row 84 (chunk 5), a byte of its first float
    f.write_bytes(bytes(raw))
    expected = data.clone().numpy()
    expected.view(np.uint8).reshape(320, 32)[84, 5] ^= 0x40  # the flip, applied with numpy to the written rows
    s = open_store(path)
    assert np.array_equal(s[HP].numpy(), expected)  # read as it is: the limit
    assert any("chunk 5 " in p and "crc32c mismatch" in p for p in s.verify())
    v = open_store(path, verify=True)
    assert torch.equal(v.rows(HP, 0, 64), data[:64]) and torch.equal(v.rows(HP, 64, 80), data[64:80])
    assert torch.equal(v.rows(HP, 96, 320), data[96:])  # the other chunks of the shard stay readable
    with pytest.raises(StoreCorruptError, match=r"chunk 5 \(rows 80-95\).*'acts/0.output/c/1/0'.*crc32c mismatch"):
        v.rows(HP, 84, 85)
    with pytest.raises(StoreCorruptError, match=r"chunk 5 .*crc32c mismatch"):
        v[HP]
    with pytest.raises(StoreCorruptError, match=r"chunk 5 .*crc32c mismatch"):
        ActivationDataset(path, open_options={"verify": True})[80:96]
    with pytest.raises(TypeError, match="verify must be True or False"):
        open_store(path, verify="yes")


@pytest.mark.parametrize("compression", [None, "zstd", "blosc-lz4"])
def test_to_dask_of_a_remote_store_checks_what_it_reads(compression):
    """A store on object storage (here fsspec ``memory://``) is read by the same checked
    worker tasks, by byte ranges: each chunk against its manifest crc32c and, for blosc,
    its header's compressed size against the chunk's bytes, before it is decoded (plain
    zarr-python would hand the bytes to the codec unchecked)."""
    import uuid

    import fsspec

    pytest.importorskip("dask")
    from activationscope.analysis.dask import to_dask

    url = f"memory://acs-dask/{uuid.uuid4().hex}.zarr"
    data = make_store(url, compression=compression)
    x = to_dask(url, HP)
    assert x.chunks[0] == (64, 64, 64, 64, 64)
    assert np.array_equal(x.compute(scheduler="sync"), data.numpy())
    fs = fsspec.filesystem("memory")
    key = f"{url[len('memory://'):]}/acts/{HP}/c/1/0"
    good = fs.cat_file(key)
    man = json.loads(fs.cat_file(f"{url[len('memory://'):]}/acts/{HP}/manifest.json"))
    _slot, off, nb, _crc = next(c for c in next(s for s in man["shards"] if s["shard"] == 1)["chunks"] if c[0] == 0)
    bad = bytearray(good)
    bad[off + nb - 1] ^= 0x10
    fs.pipe_file(key, bytes(bad))
    with pytest.raises(StoreCorruptError, match=r"chunk 0 of shard 'acts/0.output/c/1/0'.*crc32c mismatch"):
        x.compute(scheduler="sync")
    if compression == "blosc-lz4":  # a forged header, its crc32c made to match: cbytes past the chunk's end
        import google_crc32c

        bad = bytearray(good)
        bad[off + 12:off + 16] = (nb + 4096).to_bytes(4, "little")
        fs.pipe_file(key, bytes(bad))
        forged = google_crc32c.value(bytes(bad[off:off + nb]))
        man_key = f"{url[len('memory://'):]}/acts/{HP}/manifest.json"
        for s in man["shards"]:
            if s["shard"] == 1:
                s["chunks"] = [[c[0], c[1], c[2], forged if c[0] == 0 else c[3]] for c in s["chunks"]]
        fs.pipe_file(man_key, json.dumps(man).encode())
        x = to_dask(url, HP)
        with pytest.raises(StoreCorruptError, match=rf"does not decode: blosc header says {nb + 4096} compressed "
                           rf"bytes, the chunk holds {nb}"):
            x[64:128].compute(scheduler="sync")
    assert np.array_equal(x[:64].compute(scheduler="sync"), data[:64].numpy())  # other shards read
    fs.rm_file(key)
    with pytest.raises(StoreCorruptError, match=r"shard 'acts/0.output/c/1/0' is missing"):
        x[64:128].compute(scheduler="sync")
    fs.rm(url[len("memory://"):], recursive=True)


# ------------------------------------------------------------------ row tables as Dask data frames
def _rewrite_part(path: Path, edit, *, record_crc: bool = True) -> Path:
    """Rewrite the sample row table's one part with ``edit(table)``; its crc32c in the root is
    updated (a store consistent but for the edit) unless ``record_crc`` is False."""
    import google_crc32c
    import pyarrow.parquet as pq

    key = json.loads((path / "zarr.json").read_text())["attributes"]["activationscope"]["row_tables"]["sample"]["parts"]
    assert len(key) == 1
    part = path / key[0]
    pq.write_table(edit(pq.read_table(part)), part)
    if record_crc:
        crc = int(google_crc32c.value(part.read_bytes()))
        edit_root(path, lambda a: a["row_tables"]["sample"]["crc32c"].update({key[0]: crc}))
    return part


def _one_part_store(path: Path) -> None:
    """96 float32 rows of ``HP`` and a sample row table of one part (sample_id, batch, label)."""
    import torch

    from activationscope.store import StoreWriter

    w = StoreWriter(path, chunk_rows=16, shard_bytes=64 * FEATURE * 4)
    a = w.open_array(HP, (FEATURE,), torch.float32, "sample")
    a.append(torch.arange(96 * FEATURE, dtype=torch.float32).reshape(96, FEATURE))
    w.add_batch(96, list(range(96)), None, {"label": torch.arange(96) % 3})
    w.close()


def test_row_table_dask_counts_the_rows_of_its_parts_against_the_metadata(tmp_path):
    """A part of fewer rows than the root's n_rows (its crc32c recorded): refused when the
    graph is made, as Store.row_table refuses it, never a frame whose rows are not the arrays'."""
    dd = pytest.importorskip("dask.dataframe")  # noqa: F841
    from activationscope.analysis.dask import row_table_dask

    path = tmp_path / "s.zarr"
    _one_part_store(path)
    assert row_table_dask(str(path)).compute()["label"].tolist() == [i % 3 for i in range(96)]
    _rewrite_part(path, lambda t: t.slice(0, 50))
    with pytest.raises(StoreCorruptError, match=r"s\.zarr'.*row table 'sample' has 50 rows in its parts, but the "
                                                r"metadata says n_rows 96"):
        row_table_dask(str(path))


def test_row_table_dask_workers_check_the_crc32c_of_what_they_read(tmp_path):
    """The graph is made first, the part replaced after by one of other labels (same rows,
    same schema): the worker checks the part's crc32c and names it, never other labels."""
    pytest.importorskip("dask.dataframe")
    import pyarrow.compute as pc

    from activationscope.analysis.dask import row_table_dask

    path = tmp_path / "s.zarr"
    _one_part_store(path)
    ddf = row_table_dask(str(path))
    _rewrite_part(path, lambda t: t.set_column(2, "label", pc.add(t.column("label"), 1)), record_crc=False)
    with pytest.raises(StoreCorruptError, match=r"row table 'sample': part 'rows/sample/part-000000.parquet': "
                                                r"crc32c mismatch"):
        ddf.compute(scheduler="sync")


def _two_part_store(path: Path) -> list[str]:
    """96 float32 rows of ``HP`` and a sample row table of two parts of 48 rows, each written
    again in row groups of 16 rows, its crc32c recorded. The parts' keys."""
    import google_crc32c
    import pyarrow.parquet as pq
    import torch

    from activationscope.store import StoreWriter

    w = StoreWriter(path, chunk_rows=16, shard_bytes=16 * FEATURE * 4)  # (48 rows: whole shards, committed)
    a = w.open_array(HP, (FEATURE,), torch.float32, "sample")
    for first in (0, 48):
        a.append(torch.arange(first * FEATURE, (first + 48) * FEATURE, dtype=torch.float32).reshape(48, FEATURE))
        w.add_batch(48, list(range(first, first + 48)), None, {"label": torch.arange(48) % 3})
        w._core.drain()  # (the shards written: a commit takes the forwards whose rows are durable)
        w.commit()
    w.close()
    keys = json.loads((path / "zarr.json").read_text())["attributes"]["activationscope"]["row_tables"]["sample"]["parts"]
    assert len(keys) == 2
    for key in keys:
        pq.write_table(pq.read_table(path / key), path / key, row_group_size=16)
        crc = int(google_crc32c.value((path / key).read_bytes()))
        edit_root(path, lambda a, key=key, crc=crc: a["row_tables"]["sample"]["crc32c"].update({key: crc}))
    return keys


def _lie_about_rows(path: Path, key: str, first_group: int, *, record_crc: bool = True) -> None:
    """Part ``key``'s footer saying its first row group holds ``first_group`` rows (its columns
    as many values, the file as many rows as its groups together): a footer that agrees with
    itself. Its crc32c recorded again, or (``record_crc`` False) none recorded."""
    import google_crc32c

    from parquet_footer import lying_row_counts

    raw = (path / key).read_bytes()
    (path / key).write_bytes(lying_row_counts(raw, {0: first_group}, file_rows=first_group + 32, values=True))
    crc = int(google_crc32c.value((path / key).read_bytes()))
    edit_root(path, lambda a: a["row_tables"]["sample"]["crc32c"].update({key: crc}) if record_crc
              else a["row_tables"]["sample"]["crc32c"].pop(key, None))


def test_row_table_dask_refuses_a_footer_of_more_rows_than_the_table_leaves_before_decoding(tmp_path, monkeypatch):
    """Two parts whose footers each agree with themselves and sum to the table's n_rows, the
    first saying 2**24 + 48 rows, the second 48 - 2**24: the graph was made (only the sum was
    checked) and the worker had Parquet decode the first by its footer's count. Store.row_table
    refuses it before a value is decoded; now the graph's footers are checked as it checks them."""
    pytest.importorskip("dask.dataframe")
    from activationscope.analysis.dask import row_table_dask

    path = tmp_path / "s.zarr"
    keys = _two_part_store(path)
    assert row_table_dask(str(path)).compute(scheduler="sync")["label"].tolist() == [i % 3 for i in range(48)] * 2
    big = 2**24
    _lie_about_rows(path, keys[0], big + 16)
    _lie_about_rows(path, keys[1], 16 - big)
    from parquet_footer import spy_decodes

    decoded = spy_decodes(monkeypatch)
    said = (rf"row table 'sample': part '{keys[0]}' says in its footer that it holds {big + 48} rows, more than the "
            r"96 rows the table's metadata \(n_rows\) leaves for it")
    with pytest.raises(StoreCorruptError, match=said):
        row_table_dask(str(path)).compute(scheduler="sync")
    with pytest.raises(StoreCorruptError, match=f"row-table part '{keys[0]}' says in its footer that it holds"):
        open_store(path).row_table("sample")
    assert decoded == [], "a part whose footer lies was decoded"


def test_row_table_dask_workers_refuse_a_part_of_more_rows_than_its_footer_said_before_decoding(tmp_path, monkeypatch):
    """The graph made first; a part without a recorded crc32c then replaced by one whose footer
    (agreeing with itself) says 2**24 + 32 rows: the worker read it with no bound but the
    footer's own, Parquet allocating by that count. Now it is refused naming the part, before
    a value is decoded, by the rows its footer said when the graph was made."""
    pytest.importorskip("dask.dataframe")
    from activationscope.analysis.dask import row_table_dask

    path = tmp_path / "s.zarr"
    keys = _two_part_store(path)
    edit_root(path, lambda a: a["row_tables"]["sample"]["crc32c"].pop(keys[1]))
    ddf = row_table_dask(str(path))
    _lie_about_rows(path, keys[1], 2**24, record_crc=False)
    from parquet_footer import spy_decodes

    decoded = spy_decodes(monkeypatch)
    with pytest.raises(StoreCorruptError, match=rf"row-table part '{keys[1]}' says in its footer that it holds "
                                                rf"{2**24 + 32} rows, more than the 48 rows"):
        ddf.partitions[1].compute(scheduler="sync")
    assert decoded == [], "a part whose footer lies was decoded"


@pytest.mark.parametrize("damage", ["truncated", "footer"])
def test_row_table_dask_names_a_part_without_a_readable_footer(tmp_path, damage):
    """A part cut short or with its footer overwritten: StoreCorruptError naming the part
    (pyarrow's ArrowInvalid never escapes)."""
    pytest.importorskip("dask.dataframe")
    from activationscope.analysis.dask import row_table_dask

    path = tmp_path / "s.zarr"
    _one_part_store(path)
    part = next((path / "rows" / "sample").iterdir())
    raw = bytearray(part.read_bytes())
    part.write_bytes(bytes(raw[:len(raw) // 2]) if damage == "truncated" else bytes(raw[:-12]) + b"\xff" * 8 + b"PAR1")
    with pytest.raises(StoreCorruptError, match=r"row-table part 'rows/sample/part-000000.parquet' is not a readable "
                                                r"Parquet file"):
        row_table_dask(str(path))


def test_row_table_dask_of_parts_with_a_column_named_twice(tmp_path):
    """A part whose schema names a column twice (dask cannot read it as a frame): the row
    table is read as Store.row_table reads it, our error naming the row table."""
    pytest.importorskip("dask.dataframe")
    from activationscope.analysis.dask import row_table_dask

    path = tmp_path / "s.zarr"
    _one_part_store(path)
    _rewrite_part(path, lambda t: t.append_column("label", t.column("label")))
    with pytest.raises(StoreCorruptError, match=r"row table 'sample' do not fit together .*duplicate field names"):
        row_table_dask(str(path))


def _part_of_long_strings(path: Path, value_bytes: int) -> None:
    """Rewrite the one sample row-table part with a ``text`` column whose 96 rows all take one
    dictionary-encoded value of ``value_bytes`` bytes (a small file: the value is written once,
    zstd-compressed), its crc32c recorded."""
    import pyarrow.parquet as pq

    def edit(t):
        text = pa.DictionaryArray.from_arrays(pa.array(np.zeros(t.num_rows, np.int32)), pa.array(["x" * value_bytes]))
        return t.append_column("text", text)

    _rewrite_part(path, edit)
    part = next((path / "rows" / "sample").iterdir())
    table = pq.read_table(part)  # (rewritten as plain strings: their decoded size is the bomb's)
    pq.write_table(table.combine_chunks(), part, compression="zstd", store_schema=False)
    import google_crc32c

    key = "rows/sample/" + part.name
    edit_root(path, lambda a: a["row_tables"]["sample"]["crc32c"].update({key: int(google_crc32c.value(part.read_bytes()))}))


def test_a_row_table_part_decoding_beyond_its_bound_is_refused_before_it_is_decoded(tmp_path):
    """96 rows taking one 48 MiB string (a few hundred KB on disk, 4.5 GiB decoded, above the
    4 GiB a part may hold): refused from the dictionary sizes, in a child whose address space
    could not hold the decoded column, by Store.row_table and by row_table_dask."""
    import pyarrow.parquet as pq

    path = tmp_path / "s.zarr"
    _one_part_store(path)
    part = next((path / "rows" / "sample").iterdir())
    # the part as written by the store reads its strings back as they were (small ones first)
    _part_of_long_strings(path, 8)
    small = open_store(path).row_table("sample")
    assert small.column("text").to_pylist() == ["x" * 8] * 96 and small.schema.field("text").type == pa.string()
    assert pq.read_schema(part).field("text").type == pa.string()
    _one_part_store(tmp_path / "big.zarr")
    _part_of_long_strings(tmp_path / "big.zarr", 48 << 20)
    assert (tmp_path / "big.zarr" / "rows" / "sample" / part.name).stat().st_size < 4 << 20
    out = _run_capped(f"""
        try:
            open_store({str(tmp_path / 'big.zarr')!r}).row_table("sample")
        except ActivationScopeError as e:
            print(type(e).__name__, e)
    """, cap_gib=2)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("StoreCorruptError") and "big.zarr" in out.stdout, out.stdout
    decoded = re.search(rf"row-table part 'rows/sample/{part.name}' decodes to (\d+) bytes", out.stdout)
    assert decoded and int(decoded.group(1)) > 96 * (48 << 20), out.stdout
    assert f"more than the {4 << 30} a part may hold" in out.stdout and "big.zarr" in out.stdout
    problems = open_store(tmp_path / "big.zarr").verify()  # (reads the footers, then the bounded part)
    assert len(problems) == 1 and problems[0].startswith(f"row table 'sample': row-table part "
                                                         f"'rows/sample/{part.name}' decodes to"), problems
    pytest.importorskip("dask.dataframe")
    from activationscope.analysis.dask import row_table_dask

    with pytest.raises(StoreCorruptError, match=rf"part 'rows/sample/{part.name}' decodes to \d+ bytes"):
        row_table_dask(str(tmp_path / "big.zarr")).compute(scheduler="sync")


def test_a_shard_that_cannot_be_mapped_for_want_of_mappings_is_not_called_damaged(tmp_path, monkeypatch):
    """Each shard file read zero-copy is one memory mapping, and a process holds at most
    vm.max_map_count of them (65530 by default): a store of 1500 hook points of 50 shards each,
    every hook point read by an ActivationDataset, runs out. The mapping then fails with ENOMEM,
    and before, that was a StoreCorruptError telling the user to restore the store from an
    intact copy or capture it again, for a store that is whole. Now it is a StoreError that says
    the store is not damaged, and why, and how to read it; the store reads as before once
    mappings are free."""
    from activationscope.store import reader as R

    path = tmp_path / "s.zarr"
    data = make_store(path)
    real = R._native.optional()

    class OutOfMappings:
        def __getattr__(self, name):
            return getattr(real, name)

        @staticmethod
        def map_files_contiguous(paths, stride, total):
            # (the native error, as mmap's ENOMEM gives it)
            raise RuntimeError(f"mapping shard '{paths[0]}' failed: {os.strerror(12)}")

    monkeypatch.setattr(R._native, "optional", lambda: OutOfMappings())
    st = open_store(path)
    for read in (lambda: st[HP], lambda: st.rows(HP, 70, 71)):
        with pytest.raises(StoreError) as e:
            read()
        assert not isinstance(e.value, StoreCorruptError), e.value
        msg = str(e.value)
        assert "not damaged" in msg and "memory mappings" in msg and "vm.max_map_count" in msg, msg
        assert "restore the store" not in msg, msg
    monkeypatch.undo()
    st = open_store(path, verify=True)
    assert np.array_equal(st[HP].numpy(), data.numpy())
    assert np.array_equal(st.rows(HP, 70, 71).numpy(), data[70:71].numpy())


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="counts the process's mappings (Linux)")
def test_verify_unmaps_the_shards_it_checked(tmp_path):
    """verify() mapped every shard of every array to check it, and kept every mapping: each is one of
    the process's vm.max_map_count (65530) mappings, so a store of 1500 hook points of 50 shards
    each ran out before its last arrays, which were then reported damaged (or the verify failed).
    Now the shards of each array are unmapped once it is checked; the mappings a reader made
    before stay theirs."""
    import torch

    import activationscope as acs

    def n_maps() -> int:
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(12)])
    xs = [torch.randn(2, 4) for _ in range(40)]  # 80 rows: 10 shards of 8 rows per hook point
    path = tmp_path / "s.zarr"
    with torch.no_grad(), acs.ActivationScope(store=str(path), store_options={"chunk_rows": 8, "shard_rows": 8}).track(
            model):
        for x in xs:
            model(x)
    st = open_store(path)
    held = st.rows("0.output", 0, 80)  # (a read before: its mappings stay)
    before = n_maps()
    assert st.verify() == []
    assert n_maps() - before < 10 + 5, n_maps() - before  # (before: 110, the 11 other arrays' shards)
    with torch.no_grad():
        h = torch.cat(xs)
        for i, layer in enumerate(model):
            h = layer(h)
            assert torch.equal(st.rows(f"{i}.output", 0, 80), h)
    assert torch.equal(held, model[0](torch.cat(xs)).detach())


@pytest.mark.parametrize("damage", ["cut", "flipped"])
def test_a_row_table_part_cut_short_is_named_so(tmp_path, damage):
    """A row-table part cut short after its commit: the crc32c mismatch says the file does not
    end as Parquet files do (cut short or written over), in reads and in verify(); a byte
    flipped inside an intact-length file gets the plain mismatch."""
    path = tmp_path / "s.zarr"
    make_store(path)
    part = sorted((path / "rows" / "sample").glob("part-*.parquet"))[0]
    raw = part.read_bytes()
    if damage == "cut":
        part.write_bytes(raw[:len(raw) // 2])
    else:
        bad = bytearray(raw)
        bad[len(raw) // 2] ^= 0x01
        part.write_bytes(bytes(bad))
    key = f"rows/sample/{part.name}"
    cut = rf"its {len(raw) // 2} bytes do not end with Parquet's magic 'PAR1', so it was cut short"
    with pytest.raises(StoreCorruptError, match=rf"part '{key}': crc32c mismatch \(metadata \w+, data \w+\)") as e:
        open_store(path).row_table()
    assert bool(re.search(cut, str(e.value))) == (damage == "cut"), str(e.value)
    problems = [p for p in open_store(path).verify() if key in p]
    assert len(problems) == 1 and bool(re.search(cut, problems[0])) == (damage == "cut"), problems
