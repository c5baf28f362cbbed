"""Compression, in-memory and remote (S3 via moto) stores, copies, and write-read properties."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import re
import subprocess
import sys
import tempfile
import textwrap
import uuid
from pathlib import Path

import fsspec
import numpy as np
import pytest
import torch
from acs_testing import store_three_batches
import zarr
from hypothesis import given, settings, strategies as st

import activationscope as acs
from activationscope.store import StoreWriter, copy_store, open_store

from store_models import batches_mlp, capture_memory, capture_store

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32, torch.uint8, torch.bool]


def _write(target, data: dict, *, batch: int = 7, **options):
    w = StoreWriter(target, capture_config={}, model=None, storage_dtype=None, **options)
    writers = {hp: w.open_array(hp, tuple(t.shape[1:]), t.dtype, "sample") for hp, t in data.items()}
    n = next(iter(data.values())).shape[0]
    for s in range(0, max(n, 1), batch):  # (no rows: one batch of none, which lists the arrays)
        e = min(n, s + batch)
        for hp, t in data.items():
            writers[hp].append(t[s:e])
        w.add_batch(e - s, list(range(s, e)), None, {})
        w.commit()
    w.close()


def _random(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if not dtype.is_floating_point:
        return torch.randint(0, 100, shape, generator=g).to(dtype)
    t = torch.randn(shape, generator=g).to(dtype)
    if t.numel() > 3:
        t.view(-1)[:3] = torch.tensor([float("nan"), float("inf"), -0.0]).to(dtype)
    return t


def _same(a, b):
    """Bit-exact equality (NaN == NaN)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype.is_floating_point:
        bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        return torch.equal(a.view(bits), b.view(bits))
    return torch.equal(a, b)


@pytest.mark.parametrize("compression", ["zstd", "blosc-lz4", zarr.codecs.ZstdCodec(level=1)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_compressed_roundtrip_and_plain_zarr(tmp_path, compression, dtype):
    data = {"x": _random((90, 16), dtype)}
    data["x"][:40] = 0  # compressible
    _write(tmp_path / "s.zarr", data, compression=compression, chunk_rows=8, shard_bytes=4096)
    store = open_store(tmp_path / "s.zarr")
    assert _same(store["x"], data["x"])
    assert _same(store["x", 3:77], data["x"][3:77])
    assert store.verify() == []
    info = store.info()
    assert info["arrays"]["x"]["compression"] in ("zstd", "blosc")
    assert info["data_to_disk_ratio"] > 1.0
    g = zarr.open_group(str(tmp_path / "s.zarr"), mode="r")
    raw = data["x"].view(torch.uint16) if dtype == torch.bfloat16 else data["x"]
    assert np.array_equal(g["acts/x"][:], raw.numpy(), equal_nan=True)


def test_compressed_capture_equals_memory(tmp_path, mlp):
    xs = batches_mlp()
    ref = capture_memory(mlp, xs)
    capture_store(mlp, xs, tmp_path / "s.zarr", store_options={"compression": "zstd", "chunk_rows": 4})
    store = open_store(tmp_path / "s.zarr")
    for hp, r in ref.items():
        assert torch.equal(store[hp], r), hp


def test_compressed_verify_finds_a_flipped_byte(tmp_path):
    _write(tmp_path / "s.zarr", {"x": _random((64, 8), torch.float32)}, compression="zstd", chunk_rows=8, shard_bytes=1 << 20)
    shard = tmp_path / "s.zarr" / "acts" / "x" / "c" / "0" / "0"
    data = bytearray(shard.read_bytes())
    data[20] ^= 0xFF
    shard.write_bytes(bytes(data))
    problems = open_store(tmp_path / "s.zarr").verify()
    assert len(problems) == 1 and "'x'" in problems[0] and "chunk 0" in problems[0]


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(0, 40),
    feature=st.lists(st.integers(1, 4), min_size=0, max_size=2),
    chunk_rows=st.integers(1, 9),
    shard_chunks=st.integers(1, 4),
    dtype=st.sampled_from(DTYPES),
    batch=st.integers(1, 11),
)
def test_write_then_read_is_identity(tmp_path_factory, n, feature, chunk_rows, shard_chunks, dtype, batch):
    path = tmp_path_factory.mktemp("h") / "s.zarr"
    t = _random((n, *feature), dtype, seed=n)
    item = t.element_size() * int(np.prod(feature) if feature else 1)
    _write(path, {"x": t}, batch=batch, chunk_rows=chunk_rows, shard_bytes=chunk_rows * shard_chunks * item)
    store = open_store(path)
    assert store.n_rows("x") == n
    assert _same(store["x"], t)
    if n > 2:
        assert _same(store["x", 1:n - 1], t[1:n - 1])
    assert store.verify() == []


def test_memory_url_store_and_save(tmp_path, mlp):
    xs = batches_mlp()
    ref = capture_memory(mlp, xs)
    capture_store(mlp, xs, "memory://acs-test/run.zarr", store_options={"chunk_rows": 4, "overwrite": True})
    store = open_store("memory://acs-test/run.zarr")
    for hp, r in ref.items():
        assert torch.equal(store[hp], r), hp
    saved = store.save(tmp_path / "saved.zarr")
    assert saved.status == "complete" and saved.verify() == []
    for hp, r in ref.items():
        assert torch.equal(saved[hp], r), hp
    with pytest.raises(acs.StoreExistsError):
        copy_store(store, tmp_path / "saved.zarr")


def test_zarr_memory_store_object():
    ms = zarr.storage.MemoryStore()
    data = {"x": _random((30, 5), torch.float16)}
    _write(ms, data, compression="blosc-lz4", chunk_rows=4)
    store = open_store(ms)
    assert _same(store["x"], data["x"])
    assert store.verify() == []


def test_remote_s3_store_resume_and_read(s3, mlp):
    xs = batches_mlp(n_batches=8)
    ref = capture_memory(mlp, xs)
    url = "s3://acs-bucket/run.zarr"
    opts = {"chunk_rows": 4, "shard_bytes": 4 * 16 * 4 * 2, "storage_options": s3}
    # first half, then abandon the run (incomplete), then resume the rest
    scope = acs.ActivationScope(store=url, store_options=opts)
    with pytest.raises(RuntimeError, match="stop"):
        with scope.track(mlp) as tr, torch.no_grad():
            for i, x in enumerate(xs):
                if i == 5:
                    raise RuntimeError("stop")
                tr.set_batch(sample_ids=list(range(5 * i, 5 * i + 5)))
                mlp(x)
    first = open_store(url, storage_options=s3)
    assert first.status == "incomplete"
    done = first.n_samples
    for hp in first.hook_points:
        assert torch.equal(first[hp], ref[hp][:done]), hp
    scope = acs.ActivationScope(store=url, store_options={**opts, "resume": True})
    tr = scope.track(mlp)
    tr.attach()
    assert tr.writer.n_samples_committed == done
    with tr, torch.no_grad():
        for i in range(done // 5, len(xs)):
            tr.set_batch(sample_ids=list(range(5 * i, 5 * i + 5)))
            mlp(xs[i])
    store = open_store(url, storage_options=s3)
    assert store.status == "complete"
    for hp, r in ref.items():
        assert torch.equal(store[hp], r), hp
    assert store.row_table().column("sample_id").to_pylist() == list(range(40))
    assert store.verify() == []


def test_copy_store_and_save_take_the_storage_options_of_an_s3_url(s3, mlp, tmp_path):
    """A local store copied to S3 (and back) with the credentials given as storage_options, as
    open_store and a capture take them; before, copy_store and save had no such argument, and
    a URL target needed the credentials in the environment."""
    local = tmp_path / "a.zarr"
    xs = batches_mlp(n_batches=3)
    ref = capture_memory(mlp, xs)
    capture_store(mlp, xs, str(local), reductions=["mean"])
    url = f"s3://acs-bucket/copied-{uuid.uuid4().hex}.zarr"
    copy_store(str(local), url, storage_options=s3)
    remote = open_store(url, storage_options=s3)
    assert remote.verify() == [] and remote.status == "complete"
    for hp, rows in ref.items():
        assert torch.equal(remote[hp], rows), hp
        assert torch.equal(remote.reductions[hp]["mean"], open_store(local).reductions[hp]["mean"])
    back = tmp_path / "back.zarr"
    copy_store(url, str(back), storage_options=s3)
    assert all(torch.equal(open_store(back)[hp], rows) for hp, rows in ref.items())
    again = open_store(local).save(url, overwrite=True, storage_options=s3)
    assert again.verify() == [] and all(torch.equal(again[hp], rows) for hp, rows in ref.items())


@pytest.fixture
def no_aws_environment(monkeypatch, tmp_path):
    """No credentials anywhere botocore looks for them (variables, files, instance metadata)."""
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
                 "AWS_DEFAULT_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    # (nor a file system an earlier test made with the variables it set: s3fs keeps instances)
    s3fs = pytest.importorskip("s3fs")
    s3fs.S3FileSystem.clear_instance_cache()


def _closed_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_remote_store_without_credentials_or_endpoint_names_the_fix(s3, mlp, no_aws_environment, capsys, monkeypatch):
    """Reading or writing an S3 store without credentials, or at an endpoint that does not
    answer, said only botocore's words ("Unable to locate credentials"), with no way to give
    them named (the command line takes no option for them): the error now names
    storage_options= and the environment variables, for open_store, a capture and the CLI."""
    import s3fs

    from activationscope import cli

    url = "s3://acs-bucket/creds.zarr"
    with acs.ActivationScope(store=url, store_options={"storage_options": s3, "overwrite": True}).track(mlp), \
            torch.no_grad():
        mlp(torch.randn(3, 8))
    endpoint = s3["client_kwargs"]
    no_key = {"client_kwargs": endpoint}
    creds = r"no credentials were found: pass storage_options=\{'key': \.\.\., 'secret': \.\.\.\}.*AWS_ACCESS_KEY_ID"
    with pytest.raises(acs.StoreError, match=rf"'zarr.json' in {url}.*Unable to locate credentials; {creds}"):
        open_store(url, storage_options=no_key)
    with pytest.raises(acs.StoreError, match=rf"to s3://acs-bucket/new.zarr failed: .*; {creds}"):
        with acs.ActivationScope(store="s3://acs-bucket/new.zarr", store_options={"storage_options": no_key}).track(mlp):
            mlp(torch.randn(3, 8))
    elsewhere = {**s3, "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{_closed_port()}"}}
    port = elsewhere["client_kwargs"]["endpoint_url"].rsplit(":", 1)[1]
    with pytest.raises(acs.StoreError, match=rf"the endpoint http://127\.0\.0\.1:{port} did not answer \(the connection "
                       r"was refused, or the host is unknown; each request was tried 4 times .*\): check storage_options="
                       r"\{'client_kwargs': \{'endpoint_url': \.\.\.\}\} or AWS_ENDPOINT_URL.*"
                       r"storage_options=\{'config_kwargs': \{'connect_timeout': 30\}\}"):
        open_store(url, storage_options=elsewhere)
    anonymous = {"anon": True, "client_kwargs": endpoint}
    with pytest.raises(acs.StoreError, match=r"the object store refused the credentials or this bucket"):
        open_store(url, storage_options=anonymous)
    assert cli.main(["info", url]) == 1
    assert "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY" in capsys.readouterr().err
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3["key"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3["secret"])
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint["endpoint_url"])
    s3fs.S3FileSystem.clear_instance_cache()   # (a new process of the command line starts without it)
    assert cli.main(["verify", url]) == 0, capsys.readouterr().err


def test_a_missing_bucket_or_an_object_at_the_store_s_path_is_named_with_the_fix(s3, mlp):
    """Opening or capturing into an S3 URL whose bucket does not exist said only "no store
    (no zarr.json)" or botocore's "The specified bucket does not exist": both now name the
    bucket's absence and the fix. A URL naming an object (a file), not a prefix, says so."""
    url = f"s3://acs-missing-{uuid.uuid4().hex[:12]}/run.zarr"
    bucket = url.split("/")[2]
    with pytest.raises(acs.StoreError, match=rf"no store at '{url}' \(no zarr.json\): the bucket '{bucket}' does "
                       rf"not exist at this endpoint: create it \(e.g. `aws s3 mb s3://{bucket}`\) or correct"):
        open_store(url, storage_options=s3)
    with pytest.raises(acs.StoreError, match=rf"to {url} failed: .*; the bucket does not exist at this endpoint: "
                       r"create it .* or correct the bucket's name in the URL"):
        with acs.ActivationScope(store=url, store_options={"storage_options": s3}).track(mlp), torch.no_grad():
            mlp(torch.randn(3, 8))
    import s3fs

    fs = s3fs.S3FileSystem(**s3)
    assert not fs.exists(bucket)  # (nothing was made)
    file_url = f"s3://acs-bucket/object-{uuid.uuid4().hex}.zarr"
    fs.pipe(file_url[len("s3://"):], b"not a store")
    with pytest.raises(acs.StoreError, match=r"\(no zarr.json\): an object \(a file\) is at that path, and a store "
                       r"is a prefix \(folder\) of objects: give the store's own URL"):
        open_store(file_url, storage_options=s3)
    with pytest.raises(acs.StoreError, match=r"no store at 's3://acs-bucket/absent-[0-9a-f]+.zarr' \(no zarr.json\)$"):
        open_store(f"s3://acs-bucket/absent-{uuid.uuid4().hex}.zarr", storage_options=s3)


@pytest.mark.parametrize("how", ["capture", "copy_store"])
def test_a_store_is_not_written_beside_an_object_at_its_own_s3_path(s3, mlp, tmp_path, how):
    """An object (a file) at ``s3://bucket/run.zarr``: a capture or a copy into that URL wrote
    the store's objects under the prefix of the same name, beside the file (a local path that
    is a file is refused). Now refused with StoreError naming the path and the fix; the object
    is left as it was and no object is written under the prefix."""
    import s3fs

    fs = s3fs.S3FileSystem(**s3)
    url = f"s3://acs-bucket/file-{uuid.uuid4().hex}.zarr"
    fs.pipe(url[len("s3://"):], b"my notes")
    fix = (rf"store path '{url}' must be a prefix \(folder\) of objects or a path where nothing is yet, got an "
           r"existing object \(a file\) of 8 bytes; choose another path, or delete that object")
    with pytest.raises(acs.StoreError, match=fix):
        if how == "capture":
            for options in ({}, {"overwrite": True}):
                try:
                    with acs.ActivationScope(store=url, store_options={"storage_options": s3, **options}).track(mlp), \
                            torch.no_grad():
                        mlp(torch.randn(3, 8))
                except acs.StoreError as e:
                    if options:
                        raise
                    assert re.search(fix, str(e)), e
        else:
            local = str(tmp_path / "src.zarr")
            capture_store(mlp, batches_mlp(n_batches=1), local)
            copy_store(local, url, storage_options=s3)
    fs.invalidate_cache()
    assert fs.cat(url[len("s3://"):]) == b"my notes"
    key = url[len("s3://"):]
    assert [k for k in fs.find("acs-bucket") if k.startswith(key + "/")] == []


@contextlib.contextmanager
def _silent_endpoint():
    """``(endpoint URL, list of the request heads it got, request line first)`` of a local server that takes every
    connection and reads each request, but never answers (a port of another service, a
    stalled proxy)."""
    import socket
    import threading

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    heads: list[bytes] = []
    held: list = []

    def read(conn) -> None:
        data = b""
        while True:
            try:
                got = conn.recv(65536)
            except OSError:
                return
            if not got:
                return
            data += got
            while b"\r\n\r\n" in data:  # (a request's head; its body, if any, is not counted)
                head, data = data.split(b"\r\n\r\n", 1)
                heads.append(head)

    def take() -> None:
        while True:
            try:
                conn = server.accept()[0]
            except OSError:
                return
            held.append(conn)
            threading.Thread(target=read, args=(conn,), daemon=True).start()

    threading.Thread(target=take, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.getsockname()[1]}", heads
    finally:
        server.close()
        for c in held:
            c.close()


def test_an_endpoint_that_never_answers_fails_after_a_bounded_number_of_tries(s3):
    """An endpoint that takes the connection and never answers: each request was tried 25
    times (s3fs's 5 tries, each botocore's 5), waiting read_timeout each time (about 25 minutes
    with a 60 s wait, 7 minutes with s3fs's 15 s), before botocore's bare "Read timeout". Now
    the store's client tries each request 4 times (2 by s3fs, each 2 by botocore: about a minute
    with the default 15 s wait) and the error names the URL, the endpoint, the wait and the
    storage_options key that raises it. A short read_timeout of the test's own keeps it fast."""
    with _silent_endpoint() as (endpoint, heads):
        options = {"key": "k", "secret": "s", "client_kwargs": {"endpoint_url": endpoint},
                   "config_kwargs": {"read_timeout": 0.2}}
        with pytest.raises(acs.StoreError) as got:
            open_store("s3://acs-bucket/silent.zarr", storage_options=options)
        message = str(got.value)
        assert re.search(rf"in s3://acs-bucket/silent\.zarr failed: .*; the endpoint {re.escape(endpoint)} took the "
                         r"connection but did not answer within read_timeout 0\.2 s; each request was tried 4 times "
                         r"\(2 by s3fs, each 2 by botocore\): check that the endpoint .*; on a slow link give it "
                         r"longer: storage_options=\{'config_kwargs': \{'read_timeout': 60\}\}$", message), message
        assert len(heads) == 4, heads
        assert all(h.startswith(b"HEAD /acs-bucket/silent.zarr/zarr.json ") for h in heads), heads
        assert options["config_kwargs"] == {"read_timeout": 0.2}  # (the caller's dict left as it was)
    with _silent_endpoint() as (endpoint, heads):  # the caller's own tries win over the defaults
        options = {"key": "k", "secret": "s", "client_kwargs": {"endpoint_url": endpoint},
                   "config_kwargs": {"read_timeout": 0.2, "retries": {"total_max_attempts": 1}}}
        with pytest.raises(acs.StoreError, match=r"within read_timeout 0\.2 s; each request was tried 2 times "
                           r"\(2 by s3fs, each 1 by botocore\)"):
            open_store("s3://acs-bucket/silent.zarr", storage_options=options)
        assert len(heads) == 2, heads


def _in_a_thread(fn, timeout_s: float = 60):
    """What ``fn()`` raised (None when it returned), run in a daemon thread given ``timeout_s``
    seconds: a call that never returns fails the test instead of hanging it."""
    import threading

    raised: list = []

    def run() -> None:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - returned to the test
            raised.append(e)
        else:
            raised.append(None)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout_s)
    assert not t.is_alive(), f"still waiting after {timeout_s} s"
    return raised[0]


def test_a_capture_and_an_upload_to_an_endpoint_that_never_answers_fail_after_bounded_tries(mlp):
    """A capture into an endpoint that takes the connection and never answers: three checks of
    the path made their requests (each waited for, then taken as "nothing there"), then the
    writer lock's upload waited forever: botocore sends an upload with "Expect: 100-continue"
    and aiohttp waits for the "100 Continue" with no timeout. Now the first request that the
    endpoint does not answer ends the capture (StoreError naming the URL and the endpoint), and
    uploads go without that header, so read_timeout bounds them too (4 tries each)."""
    from activationscope.store import _backend

    with _silent_endpoint() as (endpoint, heads):
        options = {"key": "k", "secret": "s", "client_kwargs": {"endpoint_url": endpoint},
                   "config_kwargs": {"read_timeout": 0.2}}

        def capture() -> None:
            scope = acs.ActivationScope(store="s3://acs-bucket/silent.zarr", store_options={"storage_options": options})
            with scope.track(mlp), torch.no_grad():
                mlp(torch.randn(3, 8))

        e = _in_a_thread(capture)
        assert isinstance(e, acs.StoreError) and re.search(
            rf"s3://acs-bucket/silent\.zarr failed: .*the endpoint {re.escape(endpoint)} took the connection but did "
            r"not answer within read_timeout 0\.2 s; each request was tried 4 times", str(e)), e
        assert len(heads) == 4, [h.split(b"\r\n", 1)[0] for h in heads]
        heads.clear()
        backend = _backend.resolve("s3://acs-bucket/silent.zarr", storage_options=options)
        e = _in_a_thread(lambda: backend.set("notes.txt", b"x" * 1000))
        assert isinstance(e, acs.StoreError) and re.search(
            rf"writing 'notes\.txt' to s3://acs-bucket/silent\.zarr failed: .*the endpoint {re.escape(endpoint)} took "
            r"the connection but did not answer within read_timeout 0\.2 s", str(e)), e
        assert [h.split(b"\r\n", 1)[0] for h in heads] == [b"PUT /acs-bucket/silent.zarr/notes.txt HTTP/1.1"] * 4
        assert not any(b"\r\nexpect:" in h.lower() for h in heads), heads
        for what, fn in (("listing 'acts/'", lambda: list(backend.list("acts/"))),
                         ("deleting 'notes.txt'", lambda: backend.delete("notes.txt"))):
            e = _in_a_thread(fn)  # (botocore's own ReadTimeoutError before, with no fix named)
            assert isinstance(e, acs.StoreError) and re.search(
                rf"{what} of|{what} from", str(e)) and f"the endpoint {endpoint} took the connection" in str(e), e


def test_an_s3_store_s_client_gets_timeouts_and_tries_the_caller_s_options_override(s3):
    """The limits an s3:// store's client gets (S3_CONFIG_DEFAULTS, S3FS_TRIES): each key of
    the caller's config_kwargs wins; other URLs' options are left as given."""
    from activationscope.store import _backend

    defaults = _backend.S3_CONFIG_DEFAULTS
    assert defaults == {"connect_timeout": 5, "read_timeout": 15,
                        "retries": {"mode": "standard", "total_max_attempts": 2}}
    b = _backend.resolve("s3://acs-bucket/limits.zarr", storage_options=s3)
    assert b.store.fs.config_kwargs == defaults and b.store.fs.retries == _backend.S3FS_TRIES == 2
    mine = {**s3, "config_kwargs": {"read_timeout": 120, "retries": {"max_attempts": 9}}}
    b = _backend.resolve("s3a://acs-bucket/limits.zarr", storage_options=mine)
    got = b.store.fs.config_kwargs
    assert (got["connect_timeout"], got["read_timeout"]) == (5, 120)
    assert got["retries"] in ({"max_attempts": 9}, {"total_max_attempts": 10, "mode": "legacy"})  # (as botocore reads it)
    assert mine["config_kwargs"] == {"read_timeout": 120, "retries": {"max_attempts": 9}}  # (the caller's, unchanged)
    assert defaults["retries"] == {"mode": "standard", "total_max_attempts": 2}
    assert _backend.with_remote_defaults("memory://x.zarr", {"a": 1}) == {"a": 1}
    assert _backend.with_remote_defaults("gs://b/x.zarr", None) is None


@pytest.fixture
def staging_dir(tmp_path, monkeypatch):
    """The folder where writers of remote stores make their staging folders in this test
    (``tempfile``'s folder, as TMPDIR sets it)."""
    d = tmp_path / "tmp"
    d.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(d))
    return d


def _staged(url: str, compression=None) -> StoreWriter:
    """A writer of ``url`` holding durable, never uploaded shards of array ``x`` in its staging folder."""
    w = StoreWriter(url, chunk_rows=4, shard_bytes=4 * 16 * 4, compression=compression)
    w.open_array("x", (16,), torch.float32, "sample").append(torch.randn(40, 16))
    w._core.drain()
    return w


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_a_remote_writer_dropped_without_close_removes_its_staging_folder(staging_dir, compression):
    """Also a compressing writer: its encoder thread holds no reference to the writer, so the
    writer is collected, and its finalizer stops that thread and removes the folder."""
    w = _staged(f"memory://acs-staging/{uuid.uuid4().hex}.zarr", compression)
    thread = w._encoder_thread
    assert (thread is not None) == (compression is not None)
    (folder,) = staging_dir.iterdir()
    assert folder.name.startswith("acs-staging-")
    assert sorted(p.name for p in (folder / "acts" / "x" / "c").iterdir()) == [str(k) for k in range(10)]
    del w
    gc.collect()
    assert list(staging_dir.iterdir()) == []
    if thread is not None:
        thread.join(timeout=60)
        assert not thread.is_alive()


def test_a_remote_writer_that_fails_to_open_removes_its_staging_folder(staging_dir):
    url = f"memory://acs-staging/{uuid.uuid4().hex}.zarr"
    _write(url, {"x": torch.randn(12, 16)}, chunk_rows=4)
    fsspec.filesystem("memory").pipe(url[len("memory:/"):] + "/acts/x/zarr.json", b'{"zarr_format": 2}')
    with pytest.raises(acs.StoreCorruptError, match="zarr_format 3"):
        StoreWriter(url, resume=True)  # refused after its staging folder was made
    gc.collect()
    assert list(staging_dir.iterdir()) == []


def test_a_remote_writer_left_open_at_exit_removes_its_staging_folder(tmp_path):
    """A script that ends without closing its writer (compressed: the encoder thread runs):
    its staging folder goes at interpreter exit, the store keeps its last commit."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    child = textwrap.dedent(f"""
        import torch
        from activationscope.store import StoreWriter
        w = StoreWriter("memory://acs-staging/exit.zarr", chunk_rows=4, shard_bytes=4 * 16 * 4, compression="zstd")
        w.open_array("x", (16,), torch.float32, "sample").append(torch.randn(40, 16))
        w._core.drain()
        import json, os
        print(json.dumps(sorted(os.listdir({str(tmp)!r}))))
    """)
    env = {**os.environ, "TMPDIR": str(tmp),
           "PYTHONPATH": os.pathsep.join([str(Path(acs.__file__).parents[1]), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", child], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    (name,) = json.loads(out.stdout)  # the child's staging folder, while it ran
    assert name.startswith("acs-staging-")
    assert list(tmp.iterdir()) == []


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_a_forked_child_dropping_its_parents_writer_exits_and_leaves_it_to_the_parent(tmp_path, compression):
    """A process forked while a writer is open holds a copy of the writer but not its writer
    thread: dropping the copy does not wait for that thread (it waited forever), waiting on it
    is refused with an error naming the owning process, and the parent then closes its writer
    and commits every row."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    child = textwrap.dedent(f"""
        import gc, os, sys, torch
        import activationscope as acs
        from activationscope.store import StoreWriter
        w = StoreWriter("memory://acs-fork/s.zarr", chunk_rows=4, shard_bytes=4 * 16 * 4,
                        compression={compression!r})
        a = w.open_array("x", (16,), torch.float32, "sample")
        a.append(torch.ones(20, 16))
        w.add_batch(20)
        w._core.drain()
        pid = os.fork()
        if pid == 0:
            code = 3
            try:
                w._core.drain()
            except Exception as e:
                code = 0 if "belongs to process" in str(e) else 4
            del w, a
            gc.collect()
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, status
        w.close()
        st = acs.open_store("memory://acs-fork/s.zarr")
        assert st.status == "complete" and torch.equal(st["x"], torch.ones(20, 16)), st.status
        print("ok")
    """)
    env = {**os.environ, "TMPDIR": str(tmp),
           "PYTHONPATH": os.pathsep.join([str(Path(acs.__file__).parents[1]), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", child], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]
    assert list(tmp.iterdir()) == []  # the parent's staging folder went with its close


@pytest.mark.parametrize("where", ["local", "memory"])
def test_a_forked_child_cannot_write_commit_or_close_its_parents_store(tmp_path, where):
    """A process forked during a capture holds a copy of the tracker and its writer: a forward
    there (whose rows would go to the parent's store), a commit (it would put back the parent's
    committed rows and root) and a close (it would give up the parent's lock) are refused with
    an error naming the owning process; the parent then closes a complete store of every row
    it captured, and its lock held throughout."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    target = str(tmp_path / "s.zarr") if where == "local" else "memory://acs-fork2/s.zarr"
    child = textwrap.dedent(f"""
        import os, torch
        import activationscope as acs
        from activationscope.errors import StoreLockedError
        target = {target!r}
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 16)).eval()
        xs = [torch.randn(5, 16) for _ in range(6)]
        scope = acs.ActivationScope(store=target, store_options={{"chunk_rows": 4, "shard_bytes": 256}})
        with scope.track(model) as tr, torch.no_grad():
            for x in xs[:4]:
                model(x)
            tr.writer._core.drain()
            tr.writer.commit()
            pid = os.fork()
            if pid == 0:
                refused = []
                for step in ("forward", "commit", "close"):
                    try:
                        if step == "forward":
                            model(xs[5])
                        elif step == "commit":
                            tr.writer.commit()
                        else:
                            tr.writer.close()
                    except Exception as e:
                        refused.append(step if "belongs to process" in str(e) else f"{{step}}: {{e}}")
                os._exit(0 if refused == ["forward", "commit", "close"] else print(refused, flush=True) or 3)
            _, status = os.waitpid(pid, 0)
            assert os.waitstatus_to_exitcode(status) == 0, status
            if target.startswith("/"):
                try:  # the parent still holds its lock
                    acs.StoreWriter(target, overwrite=True)
                    raise AssertionError("another writer took the store")
                except StoreLockedError:
                    pass
            model(xs[4])
        st = acs.open_store(target)
        want = torch.cat([model[0](x) for x in xs[:5]]).detach()
        assert st.status == "complete" and st.n_samples == 25, (st.status, st.n_samples)
        assert torch.allclose(st["0.output"], want) and st.verify() == []
        print("ok")
    """)
    env = {**os.environ, "TMPDIR": str(tmp),
           "PYTHONPATH": os.pathsep.join([str(Path(acs.__file__).parents[1]), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", child], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), (out.stdout[-2000:], out.stderr[-3000:])


def _memory_store_found():
    """An in-memory store of three batches in 16-row shards (shards 0, 1 and a partial shard 2
    of 4 rows): (url, store options, its rows, the memory filesystem, its root, {path: bytes}
    of every file as found)."""
    url = f"memory://acs-test/{uuid.uuid4().hex}.zarr"
    options = {"chunk_rows": 4, "shard_bytes": 16 * 8 * 4}  # 16-row shards
    data = store_three_batches(url, **options)
    fs = fsspec.filesystem("memory")
    root = url[len("memory:/"):]
    return url, options, data, fs, root, {p: fs.cat_file(p) for p in fs.find(root)}


def test_an_aborted_remote_resume_that_committed_no_batch_puts_back_its_partial_last_shard():
    """A resume of an in-memory store rewrites the found partial last shard with more rows and
    uploads it at a commit that records no batch; an abort then puts back the found bytes of
    every file (the shard too, not only its manifest): the store verifies and holds its rows."""
    url, options, data, fs, root, found = _memory_store_found()
    w = StoreWriter(url, resume=True, **options)
    w.open_array("0.output", (8,), torch.float32, "sample").append(torch.randn(40, 8))  # shards 2, 3 and part of 4
    w.open_array("1.output", (8,), torch.float32, "sample").append(torch.randn(40, 8))  # a new array
    w._core.drain()
    w.commit()  # uploads shard 2 (20 rows now) and shard 3, records no batch
    assert fs.cat_file(f"{root}/acts/0.output/c/2/0") != found[f"{root}/acts/0.output/c/2/0"]
    w.abort(RuntimeError("stopped before the first forward was recorded"))
    after = {p: fs.cat_file(p) for p in fs.find(root)}
    assert sorted(after) == sorted(found)
    assert [k for k in found if after[k] != found[k]] == []
    store = open_store(url)
    assert store.status == "complete" and store.n_samples == 36 and store.hook_points == ["0.output"]
    assert torch.equal(store["0.output"], data) and store.verify() == []


def test_an_aborted_remote_resume_whose_commit_failed_uploading_removes_the_shards_it_uploaded():
    """A commit of a resume (no batch recorded) uploads shards past the found ones, then an
    upload fails; the abort that follows removes the shards uploaded before the failure: the
    store's files are those found."""
    url, options, data, fs, root, found = _memory_store_found()
    w = StoreWriter(url, resume=True, **options)
    w.open_array("0.output", (8,), torch.float32, "sample").append(torch.randn(60, 8))  # shards 2 to 4 and part of 5
    w._core.drain()
    put_file, uploads = w._backend.put_file, []

    def failing_third(key, local):
        uploads.append(key)
        if len(uploads) == 3:
            raise OSError("upload failed")
        return put_file(key, local)

    w._backend.put_file = failing_third
    with pytest.raises(OSError, match="upload failed"):
        w.commit()
    assert fs.exists(f"{root}/acts/0.output/c/3/0")  # uploaded before the failure
    w.abort(RuntimeError("stopped before the first forward was recorded"))
    after = {p: fs.cat_file(p) for p in fs.find(root)}
    assert sorted(after) == sorted(found)
    assert [k for k in found if after[k] != found[k]] == []
    store = open_store(url)
    assert store.status == "complete" and store.n_samples == 36
    assert torch.equal(store["0.output"], data) and store.verify() == []


@pytest.mark.parametrize("fsync", [False, True])
def test_ctrl_c_while_a_key_is_written_leaves_no_temporary_file(tmp_path, fsync):
    # Ctrl-C at any line of a local write: the key holds the old bytes or the new ones, and no
    # temporary file is left beside it (in a new store's folder one would make it "not empty but
    # holds no Zarr store" to the rerun)
    from acs_testing import InterruptAt

    from activationscope.store._backend import LocalBackend

    backend = LocalBackend(tmp_path / "s", fsync=fsync)
    backend.set("a/zarr.json", b"old")
    with InterruptAt(None) as count:
        backend.set("a/zarr.json", b"old")
    assert count.n > 5
    for k in range(1, count.n + 1):
        with pytest.raises(KeyboardInterrupt), InterruptAt(k) as where:
            backend.set("a/zarr.json", b"new")
        assert sorted(p.name for p in (tmp_path / "s" / "a").iterdir()) == ["zarr.json"], where.where
        assert backend.get("a/zarr.json") in (b"old", b"new"), where.where
        backend.set("a/zarr.json", b"old")
