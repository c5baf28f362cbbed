"""A hook point called in a few forwards only fills its shard slowly, perhaps never; a commit
covers only the forwards whose rows are durable in every array. The writer makes such an
array's rows durable as a partial shard (rewritten under the same key as rows come), so the
commits follow the other arrays and a killed capture keeps its forwards."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import activationscope as acs
from acs_testing import store_target

# 'lin' gets 2 rows a forward and fills an 8-row shard every 4 forwards; 'rare' runs once
# every 20 forwards (2 rows): its 8-row shard fills after 80 forwards
OPTIONS = {"chunk_rows": 4, "shard_rows": 8, "commit_interval": 0}
EVERY = 20


class RareBranch(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 4)
        self.rare = torch.nn.Linear(4, 3)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        h = self.lin(x)
        if (self.calls - 1) % EVERY == 0:
            h = h + self.rare(x).sum(-1, keepdim=True)
        return h


def inputs(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(2, 4, generator=g) for _ in range(n)]


def expected(xs: list[torch.Tensor], n_forwards: int) -> dict[str, torch.Tensor]:
    model = RareBranch()  # (the same weights, untracked)
    with torch.no_grad():
        return {"lin.output": torch.cat([model.lin(x) for x in xs[:n_forwards]]),
                "rare.output": torch.cat([model.rare(x) for i, x in enumerate(xs[:n_forwards]) if i % EVERY == 0])}


def check_prefix(st, xs, n_forwards_min: int) -> int:
    """The store's committed forwards (at least ``n_forwards_min``), each row as PyTorch gives it."""
    n = st.n_samples
    assert n % 2 == 0 and n >= 2 * n_forwards_min, (n, n_forwards_min)
    want = expected(xs, n // 2)
    for hp, rows in want.items():
        assert st.n_rows(hp) == len(rows), (hp, st.n_rows(hp), len(rows))
        assert torch.equal(st.rows(hp, 0, len(rows)), rows), hp
    return n // 2


@pytest.mark.parametrize("compression", [None, "zstd"])
@pytest.mark.parametrize("where", ["local", "memory", "s3"])
def test_a_rare_hook_point_does_not_hold_back_the_commits(request, where, compression):
    """Before, no forward was committed until 'rare' filled its shard (80 forwards): a reader
    of the running capture saw none, and a crash lost them all."""
    target, so = store_target(request, where, prefix="partial")
    model, xs = RareBranch(), inputs(70)
    scope = acs.ActivationScope(store=target, store_options={**OPTIONS, "compression": compression,
                                                           "storage_options": so})
    tracker = scope.track(model, include=["lin", "rare"]).attach()
    early = None
    with tracker, torch.no_grad():
        for i, x in enumerate(xs):
            model(x)
            tracker.writer._core.drain()  # (the writer thread keeps up: the commits below are exact)
            if i == 25:
                live = acs.open_store(target, storage_options=so)
                check_prefix(live, xs, 20)
                early = acs.open_store(target, storage_options=so)  # read again later, never refreshed
            elif i > 25 and i % 7 == 0:
                live.refresh()  # the partial shard of 'rare' rewritten since: its rows read right
                check_prefix(live, xs, i + 1 - 6)
        live.refresh()
        got = check_prefix(live, xs, len(xs) - 6)
        assert got < len(xs)  # (some forwards wait for 'lin''s shard: the commits follow it)
        check_prefix(early, xs, 20)
    st = acs.open_store(target, storage_options=so)
    assert check_prefix(st, xs, len(xs)) == len(xs) and st.status == "complete"
    check_prefix(early, xs, 20)  # (its commit's rows, the shard rewritten since)


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted((root / "acts").rglob("*")) if p.is_file()}


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_a_capture_that_is_not_killed_writes_the_same_arrays(tmp_path, monkeypatch, compression):
    """The partial shards written meanwhile are replaced by the shards a capture writes
    without them: the same files, byte for byte (shards, manifests, array documents)."""
    from activationscope.store.writer import StoreWriter

    def capture(path):
        model, xs = RareBranch(), inputs(70)
        with torch.no_grad(), acs.ActivationScope(store=path, store_options={
                **OPTIONS, "compression": compression}).track(model, include=["lin", "rare"]) as tracker:
            for x in xs:
                model(x)
                tracker.writer._core.drain()
        return model, xs

    capture(tmp_path / "a.zarr")
    with monkeypatch.context() as m:
        m.setattr(StoreWriter, "_request_partial_shards", lambda self, durable: None, raising=False)
        capture(tmp_path / "b.zarr")
    a, b = _files(tmp_path / "a.zarr"), _files(tmp_path / "b.zarr")
    assert sorted(a) == sorted(b) and any("rare" in k and "/c/" in k for k in a)
    assert all(a[k] == b[k] for k in a), [k for k in a if a[k] != b[k]]


_KILLED = textwrap.dedent("""\
    import os, signal, sys
    import torch
    import activationscope as acs
    from test_partial_shards import OPTIONS, RareBranch, inputs

    path, n = sys.argv[1], int(sys.argv[2])
    model, xs = RareBranch(), inputs(n)
    with torch.no_grad(), acs.ActivationScope(store=path, store_options=OPTIONS).track(
            model, include=["lin", "rare"]) as tracker:
        for x in xs:
            model(x)
            tracker.writer._core.drain()
        os.kill(os.getpid(), signal.SIGKILL)
""")


@pytest.mark.parametrize("n_forwards", [41, 58])
def test_a_killed_capture_keeps_the_forwards_a_rare_hook_point_held_back(tmp_path, n_forwards):
    """Killed (SIGKILL) after ``n_forwards``: the store opens with every forward up to the last
    shard of 'lin' (or after), 'rare''s rows among them, each as PyTorch gives it; before, none."""
    here = Path(__file__).resolve().parent
    path = tmp_path / "killed.zarr"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(here.parent.parent), str(here.parent), str(here)])}
    done = subprocess.run([sys.executable, "-c", _KILLED, str(path), str(n_forwards)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == -signal.SIGKILL, done.stderr
    st = acs.open_store(path)
    assert st.status == "incomplete"
    check_prefix(st, inputs(n_forwards), n_forwards - 6)
    st = acs.open_store(path, verify=True)  # (every chunk against its crc32c)
    check_prefix(st, inputs(n_forwards), n_forwards - 6)
    # resumed (its partial shard of 'rare' re-fed and rewritten) and killed again, then finished
    total = n_forwards + 30
    for kill in (True, False):
        code = _KILLED.replace("RareBranch(), inputs(n)", "RareBranch(), inputs(n)\nopts = {**OPTIONS, 'resume': True}")
        code = code.replace("store_options=OPTIONS", "store_options=opts").replace(
            "    for x in xs:", "    start = tracker.writer.n_samples_committed // 2\n"
                               "    model.calls = start\n    for x in xs[start:]:")
        assert "xs[start:]" in code
        if not kill:
            code = code.replace("    os.kill(os.getpid(), signal.SIGKILL)\n", "")
            assert "kill" not in code
        done = subprocess.run([sys.executable, "-c", code, str(path), str(total - (15 if kill else 0))], env=env,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == (-signal.SIGKILL if kill else 0), done.stderr
        st = acs.open_store(path, verify=True)
        got = check_prefix(st, inputs(total), total - (15 + 6 if kill else 0))
        assert st.status == ("incomplete" if kill else "complete") and (kill or got == total)


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_a_reader_reading_while_partial_shards_are_rewritten_reads_the_committed_rows(tmp_path, compression):
    """A reader in another thread refreshes and reads every committed row while the capture
    rewrites 'rare''s partial shard under the same key (a commit renaming each rewrite over it):
    each read gives the rows of its commit, none damaged or missing."""
    import threading

    path = tmp_path / "live.zarr"
    model, xs = RareBranch(), inputs(400)
    want = expected(xs, len(xs))
    scope = acs.ActivationScope(store=path, store_options={**OPTIONS, "compression": compression})
    tracker = scope.track(model, include=["lin", "rare"]).attach()
    stop, seen, errors = threading.Event(), [], []

    def read():
        try:
            st = None
            while not stop.is_set():
                if st is None:
                    if not (path / "zarr.json").exists():
                        continue
                    st = acs.open_store(path)
                st.refresh()
                n = st.n_samples
                for hp in want:
                    if hp not in st.hook_points:  # (listed from the commit of its first forward)
                        continue
                    k = st.n_rows(hp)
                    assert torch.equal(st.rows(hp, 0, k), want[hp][:k]), (hp, k)
                seen.append(n)
        except BaseException as e:  # (reported by the test's thread)
            errors.append(e)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        with tracker, torch.no_grad():
            for i, x in enumerate(xs):
                model(x)
                if i % 20 == 19:  # (the reader reads along: at times wait for two more of its reads)
                    for _ in range(2):  # (the writer thread caught up, and committed: what it reads is known)
                        tracker.writer._core.drain()
                        tracker.writer.commit()
                    target = len(seen) + 2
                    while len(seen) < target and not errors and reader.is_alive():
                        stop.wait(0.001)
    finally:
        stop.set()
        reader.join()
    assert not errors, errors[0]
    assert len(set(seen)) > 3 and max(seen) > 0  # (it read several commits)
    # commits follow 'lin' (8-row shards: 4 forwards), and the reader read at least every 20 forwards:
    # it saw each 24 forwards (48 samples) or so committed. Before, 'rare', whose 8-row shards fill
    # every 80 forwards, held the commits back for up to 60 forwards at a time
    points = sorted(set(seen))
    assert max(b - a for a, b in zip(points, points[1:])) <= 2 * 28, points
    st = acs.open_store(path, verify=True)
    assert check_prefix(st, xs, len(xs)) == len(xs)


def test_only_the_array_that_holds_the_commits_back_is_written_as_a_partial_shard(tmp_path, monkeypatch):
    """'lin' completes a shard every 4 forwards and holds no commit back but when 'rare' completes
    one: only then is it written partial (before, a partial shard of 'rare', durable and not yet
    committed, put it behind 'rare' after each of 'rare''s rows: up to a shard's bytes for nothing)."""
    from activationscope.capture import _native

    C = _native.load()
    asked: list[str] = []
    snapshot = C.ArrayWriter.snapshot
    monkeypatch.setattr(C.ArrayWriter, "snapshot", lambda self: (asked.append((self.hook_point, model.calls)), snapshot(self))[1])
    model, xs = RareBranch(), inputs(70)
    path = tmp_path / "s.zarr"
    with torch.no_grad(), acs.ActivationScope(store=path, store_options=OPTIONS).track(
            model, include=["lin", "rare"]) as tracker:
        for x in xs:
            model(x)
            tracker.writer._core.drain()
            assert tracker.writer.n_samples_committed >= 2 * (model.calls - 6)
    # 'rare' is written partial after each of its rows (forwards 0, 20, 40), until its shard fills
    # (forward 60); 'lin' only when 'rare', its shard complete, is ahead of it (forwards 61-64)
    rare = [c for hp, c in asked if hp == "rare.output"]
    assert len(rare) == 3 and all(0 < c - 20 * i <= 6 for i, c in enumerate(rare)), asked
    assert all(60 < c <= 66 for hp, c in asked if hp == "lin.output"), asked
    assert check_prefix(acs.open_store(path), xs, len(xs)) == len(xs)


class TokensAndPool(torch.nn.Module):
    """Token rows (2 samples x 8 tokens x 32 features a forward) and a pooled sample array (2 x
    64): the sample array completes its 64-row shard every 32 forwards, the token array every 4."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tok = torch.nn.Linear(4, 32)
        self.pool = torch.nn.Linear(32, 64)

    def forward(self, x):
        return self.pool(self.tok(x).mean(1))


def test_partial_shards_written_stay_within_a_quarter_of_the_bytes_captured(tmp_path, monkeypatch):
    """A sample array behind token arrays holds every commit back: before, its open shard was
    written again at every commit (each interval), up to a shard's bytes each time, several
    times the bytes the capture wrote on a slow model. Now the partial shards written stay
    within PARTIAL_REWRITE_SHARE (25%) of the bytes appended, and the commits still follow
    the token array."""
    from activationscope.capture import _native
    from activationscope.store.writer import PARTIAL_REWRITE_SHARE

    C = _native.load()
    asked: list[tuple[str, int]] = []
    snapshot = C.ArrayWriter.snapshot
    monkeypatch.setattr(C.ArrayWriter, "snapshot",
                        lambda self: (asked.append((self.hook_point, int(self.n_rows))), snapshot(self))[1])
    model = TokensAndPool()
    g = torch.Generator().manual_seed(2)
    xs = [torch.randn(2, 8, 4, generator=g) for _ in range(60)]
    mask = torch.ones(2, 8, dtype=torch.long)
    path = tmp_path / "s.zarr"
    committed_early = 0
    with torch.no_grad(), acs.ActivationScope(store=path, store_options={
            "chunk_rows": 4, "shard_rows": 64, "commit_interval": 0}).track(model, include=["tok", "pool"]) as tracker:
        for i, x in enumerate(xs):
            tracker.set_batch(attention_mask=mask)
            model(x)
            tracker.writer._core.drain()
            if i == 28:  # (the pooled array's first shard fills at forward 31)
                committed_early = tracker.writer.n_samples_committed
    row_bytes = {"tok.output": 32 * 4, "pool.output": 64 * 4}
    # (a snapshot writes the rows past the complete shards: none when a shard just filled, as
    # at 64 rows when the commits' timing asks then, its shard written complete anyway)
    written = sum(n % 64 * row_bytes[hp] for hp, n in asked)
    appended = len(xs) * (16 * row_bytes["tok.output"] + 2 * row_bytes["pool.output"])
    assert any(hp == "pool.output" for hp, _ in asked), asked
    assert PARTIAL_REWRITE_SHARE == 0.25 and written <= 0.25 * appended, (written, appended, asked)
    assert committed_early >= 2 * 16, committed_early  # (none without partial shards: 0)
    st = acs.open_store(path, verify=True)
    with torch.no_grad():
        h = torch.cat([model.tok(x) for x in xs])
        assert torch.equal(st.rows("tok.output", 0, st.n_rows("tok.output")), h.reshape(-1, 32))
        pooled = torch.cat([model.pool(model.tok(x).mean(1)) for x in xs])
        assert torch.equal(st.rows("pool.output", 0, st.n_rows("pool.output")), pooled)


class WideRareBranch(RareBranch):
    """'rare' (every 20 forwards) gives 2 rows of 4096 features (32 KiB), 'lin' 32 bytes a
    forward: a partial shard of 'rare' would be most of the bytes captured."""

    def __init__(self) -> None:
        super().__init__()
        self.rare = torch.nn.Linear(4, 4096)


def test_a_partial_shard_over_the_byte_budget_warns_that_commits_are_held_back(tmp_path):
    """Partial shards stay within a quarter of the bytes captured, so a wide hook point called
    rarely can still hold the commits back: the capture says so once, naming it (before, with
    no budget, it was written as a partial shard whatever its size)."""
    model, xs = WideRareBranch(), inputs(30)
    path = tmp_path / "s.zarr"
    with pytest.warns(acs.CaptureWarning, match=r"the last \d+ forwards are not committed: hook point 'rare\.output' "
                      r"holds them back .* past 25% of the bytes captured.*Warned once per capture") as caught:
        with torch.no_grad(), acs.ActivationScope(store=path, store_options=OPTIONS).track(
                model, include=["lin", "rare"]) as tracker:
            for x in xs:
                model(x)
                tracker.writer._core.drain()
            assert tracker.writer.n_samples_committed == 0
    assert sum("are not committed" in str(w.message) for w in caught) == 1
    st = acs.open_store(path, verify=True)
    with torch.no_grad():
        assert torch.equal(st.rows("rare.output", 0, 4), torch.cat([model.rare(xs[0]), model.rare(xs[20])]))
        assert torch.equal(st.rows("lin.output", 0, 60), torch.cat([model.lin(x) for x in xs]))


_KILLED_AT_INSTALL = textwrap.dedent("""\
    import json, os, signal, sys
    import torch
    import activationscope as acs
    from activationscope.store.writer import StoreWriter
    from test_partial_shards import OPTIONS, RareBranch, inputs

    url, n, kill_at, so = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4])
    install, seen = StoreWriter._install_held_shard, [0]

    def install_then_die(self, arr, shards):  # (killed once the rewrite is uploaded, before its manifest)
        install(self, arr, shards)
        seen[0] += 1
        if seen[0] == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    StoreWriter._install_held_shard = install_then_die
    opts = {**OPTIONS, "compression": "zstd", "storage_options": so, "resume": kill_at == 0}
    model, xs = RareBranch(), inputs(n)
    with torch.no_grad(), acs.ActivationScope(store=url, store_options=opts).track(
            model, include=["lin", "rare"]) as tracker:
        start = tracker.writer.n_samples_committed // 2
        model.calls = start
        for x in xs[start:]:
            model(x)
            tracker.writer._core.drain()
""")


@pytest.mark.parametrize("kill_at", [2, 3])
def test_an_s3_capture_killed_after_uploading_a_partial_shard_s_rewrite_resumes(request, kill_at):
    """Killed after a commit uploaded the rewrite of 'rare''s partial shard over its key, before
    the manifest that lists it: the object is larger than the manifest's file_bytes. Before, the
    resume read that shard as found with the manifest's size as its limit and failed ("holds 133
    bytes, more than the 93 such a file may hold") at its first commit, every time: the capture
    could not go on. Now it resumes and ends with every row, as a capture not killed writes them."""
    import json

    here = Path(__file__).resolve().parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(here.parent.parent), str(here.parent), str(here)])}
    url, so = store_target(request, "s3", prefix="partial-killed")
    done = subprocess.run([sys.executable, "-c", _KILLED_AT_INSTALL, url, "70", str(kill_at), json.dumps(so)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == -signal.SIGKILL, done.stderr
    st = acs.open_store(url, storage_options=so)
    assert st.status == "incomplete" and st.n_samples >= 2 * 20, st.n_samples
    done = subprocess.run([sys.executable, "-c", _KILLED_AT_INSTALL, url, "70", "0", json.dumps(so)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    st = acs.open_store(url, storage_options=so, verify=True)
    assert st.status == "complete" and check_prefix(st, inputs(70), 70) == 70 and st.verify() == []


@pytest.mark.parametrize("compression", [None, "zstd", "blosc-lz4"])
@pytest.mark.parametrize("kill_at", [1, 3])
def test_an_s3_capture_killed_after_uploading_a_partial_shard_s_rewrite_reads_its_committed_rows(
        request, kill_at, compression):
    """Killed after a commit uploaded the rewrite of a partial shard over its key, before the
    manifest that lists it (object storage keeps no committed copy): the chunk holding the last
    committed rows holds more rows now. Before, every read of those rows (and open_store with
    verify=True) raised StoreCorruptError ("crc32c mismatch ... rewritten by a resumed capture")
    until a resume; now the committed rows, checked against the manifest (themselves, then zeros,
    encoded again), read as committed, each as PyTorch gives it."""
    import json

    here = Path(__file__).resolve().parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(here.parent.parent), str(here.parent), str(here)])}
    url, so = store_target(request, "s3", prefix="partial-read")
    code = _KILLED_AT_INSTALL.replace('"compression": "zstd"', f'"compression": {compression!r}')
    done = subprocess.run([sys.executable, "-c", code, url, "70", str(kill_at), json.dumps(so)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == -signal.SIGKILL, done.stderr
    for verify in (False, True):
        st = acs.open_store(url, storage_options=so, verify=verify)
        assert st.status == "incomplete" and check_prefix(st, inputs(70), 20) >= 20
    # verify() lists the rewritten shard (it differs from its manifest until a resume) and says why
    # and what puts it back (before: "rewritten by a resumed capture", or no cause at all)
    lines = st.verify()
    assert lines and all("rare.output" in line and "the partial shard of an array that held its commits back" in line
                         and "resume the capture" in line for line in lines), lines


def test_an_array_whose_complete_shard_is_still_queued_is_not_written_as_a_partial_shard(tmp_path, monkeypatch):
    """Every array gets every forward's rows, but the writer thread, one thread for all of them,
    makes some durable later than others (hundreds of hook points, a shard each few forwards).
    Before, such an array counted as holding the commit back, and its open shard was written as
    a partial shard at nearly every commit (on a 300-layer MLP, about half the shards written
    twice, and a warning naming a hook point whose shard "is not full"); a partial shard, queued
    after the complete one, cannot make it durable sooner. Now it is not asked for; the commits
    follow as the queued shard is listed. The writer thread's lag is made here: the shards of
    '1.output' are listed one commit late."""
    from activationscope.capture import _native

    C = _native.load()
    asked: list[tuple[str, int]] = []
    snapshot, take = C.ArrayWriter.snapshot, C.ArrayWriter.take_durable
    monkeypatch.setattr(C.ArrayWriter, "snapshot",
                        lambda self: (asked.append((self.hook_point, int(self.n_rows))), snapshot(self))[1])
    late: list = []
    closing: list = []

    def take_late(self):
        got = list(take(self))
        if self.hook_point != "1.output":
            return got
        if closing:  # (the close takes every durable shard: how many times it asks is not fixed)
            out, late[:] = late + got, []
            return out
        out = late[:]
        late[:] = got
        return out

    monkeypatch.setattr(C.ArrayWriter, "take_durable", take_late)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    xs = [torch.randn(3, 4) for _ in range(40)]
    path = tmp_path / "s.zarr"
    committed = []
    with torch.no_grad(), acs.ActivationScope(store=path, store_options=OPTIONS).track(model) as tracker:
        for x in xs:
            model(x)
            tracker.writer._core.drain()
            committed.append(tracker.writer.n_samples_committed)
        closing.append(True)
    assert asked == [], asked
    # the commits follow '1.output' one shard (8 rows: 2 or 3 forwards) behind the others
    assert committed[-1] >= 3 * 40 - 3 * 8, committed
    assert committed == sorted(committed) and len(set(committed)) >= 10, committed
    st = acs.open_store(path, verify=True)
    assert st.n_samples == 3 * 40
    with torch.no_grad():
        h = torch.cat(xs)
        for i, layer in enumerate(model):
            h = layer(h)
            assert torch.equal(st.rows(f"{i}.output", 0, 3 * 40), h)
