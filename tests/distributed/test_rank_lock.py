"""A multi-rank capture of a local store holds the store's writer lock from rank 0's preparation
to its commit (store/FORMAT.md sections 7 and 10): an overwrite, a resume, another multi-rank
capture or ``consolidate`` of the same path started meanwhile is refused, changing nothing, and
the running capture then commits as an undisturbed one does. Before, nothing held the store in
that window: a one-process ``overwrite=True`` took over the capture's uncommitted root, its rank
stores and the old store it had moved aside (the capture failed and the old store was lost), or,
during rank 0's commit, put the old store back, which rank 0 then took for its own commit;
``consolidate`` committed the rank stores itself."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import activationscope as acs
from activationscope import cli
from activationscope.store import StoreWriter
from activationscope.store import _backend as B
from activationscope.store._lock import writer_holding
from activationscope.store.ranks import _prepare, commit_ranks, prepare_root

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from test_torchrun import SCRIPT, TORCHRUN, WORLD, _same_files, _torchrun  # noqa: E402


def _files(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` (relative path: bytes), but writer locks."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != B.LOCK_KEY}


@pytest.fixture(scope="module")
def old(tmp_path_factory):
    """A committed multi-rank store (also what an undisturbed capture of the same data makes)."""
    store = tmp_path_factory.mktemp("ranklock") / "old.zarr"
    out = _torchrun(store)
    assert out.returncode == 0, out.stderr[-3000:]
    return store


class _Held:
    """``torchrun_capture.py STORE --overwrite --hold ...`` running, rank 0 held at ``at``
    (``batch``: before its last batch; ``commit``: every rank's store closed, before its commit)
    until :meth:`go`."""

    def __init__(self, store: Path, at: str, tmp: Path) -> None:
        self.hold = str(tmp / "hold")
        self.tmp = tmp / "tmp"
        self.tmp.mkdir()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parents[1]), os.environ.get("PYTHONPATH", "")]),
               "OMP_NUM_THREADS": "1", "TMPDIR": str(self.tmp)}
        launcher = [str(TORCHRUN)] if TORCHRUN.exists() else [sys.executable, "-m", "torch.distributed.run"]
        self.proc = subprocess.Popen([*launcher, "--standalone", f"--nproc_per_node={WORLD}", "--max-restarts=0",
                                      str(SCRIPT), str(store), "--overwrite", "--hold", self.hold, "--hold-at", at],
                                     env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)  # (its own process group: stop() ends it whole)
        deadline = time.monotonic() + 300  # (bounded: the file says when rank 0 is held, no timing decides)
        while not os.path.exists(self.hold + ".held"):
            assert self.proc.poll() is None, self.proc.communicate()[0][-3000:]
            assert time.monotonic() < deadline, "rank 0 did not reach its hold"
            time.sleep(0.05)
        self.rank0 = int(Path(self.hold + ".held").read_text())

    def go(self) -> tuple[int, str]:
        Path(self.hold + ".go").write_text("")
        out = self.proc.communicate(timeout=300)[0]
        return self.proc.returncode, out

    def stop(self) -> None:
        """After a failed assertion: rank 0 let go, and the launcher and its ranks killed."""
        Path(self.hold + ".go").write_text("")
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.communicate(timeout=60)


def _aside(store: Path) -> Path:
    (folder,) = [p for p in store.parent.iterdir() if p.name.startswith(f".{store.name}.replaced-")]
    return folder


def _races(store: Path) -> dict[str, str]:
    """Each writer of ``store`` that could take over a running capture, tried: what it raised."""
    said = {}

    def attempt(name, fn):
        with pytest.raises(acs.StoreLockedError) as e:
            fn()
        said[name] = str(e.value)

    attempt("overwrite", lambda: StoreWriter(str(store), overwrite=True).abort(RuntimeError("took it")))
    attempt("resume", lambda: StoreWriter(str(store), resume=True).abort(RuntimeError("took it")))
    aside: list = []
    held: list = []
    # (rank 0's step of another multi-rank capture with overwrite=True, and a multi-rank resume)
    attempt("ranks overwrite", lambda: _prepare(str(store), WORLD, True, False, None, aside, held))
    assert aside == [] and held == []
    attempt("ranks resume", lambda: prepare_root(str(store), world_size=WORLD, resume=True))
    attempt("consolidate", lambda: commit_ranks(str(store)))
    return said


@pytest.mark.parametrize("at", ["batch", "commit"])
def test_writers_started_while_a_multi_rank_overwrite_runs_are_refused_and_it_commits(old, tmp_path, at, capsys):
    store = tmp_path / "s.zarr"
    shutil.copytree(old, store, ignore=shutil.ignore_patterns(B.LOCK_KEY))
    before = _files(store)
    run = _Held(store, at, tmp_path)
    try:
        aside = _aside(store)
        assert _files(aside) == before  # (the old store, moved aside by rank 0)
        root = (store / "zarr.json").read_bytes()
        ranks = _files(store / "ranks") if at == "commit" else None  # (every rank store closed: fixed)
        said = _races(store)
        for name, text in said.items():
            assert repr(str(store)) in text and f"pid {run.rank0} on host" in text, (name, text)
            assert "rank 0 of a multi-rank capture of 2 ranks" in text and "stop it" in text, (name, text)
        assert cli.main(["consolidate", str(store)]) == 1
        assert f"pid {run.rank0} on host" in capsys.readouterr().err
        # nothing changed: the old store aside, the capture's root and (closed) rank stores
        assert _aside(store) == aside and _files(aside) == before
        assert (store / "zarr.json").read_bytes() == root
        if ranks is not None:
            assert _files(store / "ranks") == ranks
        rc, out = run.go()
    finally:
        run.stop()
    assert rc == 0, out[-3000:]
    st, ref = acs.open_store(store), acs.open_store(old)
    assert st.status == "complete" and st.verify() == [] and st.attrs["run_id"] != ref.attrs["run_id"]
    _same_files(store, old)  # (byte-identical to an undisturbed capture)
    assert st.row_table("sample").equals(ref.row_table("sample"))
    assert [p.name for p in tmp_path.iterdir() if ".replaced-" in p.name] == []
    assert writer_holding(B.resolve(str(store))) is None


def test_a_multi_rank_capture_killed_leaves_the_store_unlocked(old, tmp_path):
    """Rank 0 SIGKILLed while it holds the store: the lock goes with its process; an
    overwrite then settles the old store it had moved aside (put back whole here)."""
    store = tmp_path / "s.zarr"
    shutil.copytree(old, store, ignore=shutil.ignore_patterns(B.LOCK_KEY))
    before = _files(store)
    run = _Held(store, "batch", tmp_path)
    try:
        assert writer_holding(B.resolve(str(store))) is not None
        os.kill(run.rank0, signal.SIGKILL)
        out = run.proc.communicate(timeout=300)[0]
        assert run.proc.returncode != 0, out[-3000:]
    finally:
        run.stop()
    assert writer_holding(B.resolve(str(store))) is None
    StoreWriter(str(store), overwrite=True).abort(RuntimeError("stop"))  # (not refused: nothing holds it)
    assert _files(store) == before and [p.name for p in tmp_path.iterdir() if ".replaced-" in p.name] == []


def test_writers_of_a_store_whose_rank_tasks_are_writing_are_refused(tmp_path):
    """Rank tasks without a process group (``RankStore``) hold no lock on the store, only on
    their rank stores: an ``overwrite=True`` or ``resume=True`` of the store (one process, or a
    multi-rank capture's rank 0) started while a task writes is refused, naming that rank store
    and its writer, instead of moving the task's rank store away or removing it."""
    import torch

    import torchrun_capture as job

    url = tmp_path / "s.zarr"
    model = job.toy_mlp(job.WIDTH, 3).eval()
    scope = acs.ActivationScope(store=str(url), reductions=["mean"],
                                store_options={**job.STORE_OPTIONS, "process_group": acs.RankStore(1, WORLD)})
    with scope.track(model) as tracker, torch.no_grad():
        tracker.set_batch(sample_ids=torch.arange(job.BATCH))
        model(job.batch(1))
        root = (url / "zarr.json").read_bytes()
        for name, fn in {
            "overwrite": lambda: StoreWriter(str(url), overwrite=True).abort(RuntimeError("took it")),
            "resume": lambda: StoreWriter(str(url), resume=True).abort(RuntimeError("took it")),
            "ranks overwrite": lambda: _prepare(str(url), WORLD, True, False, None, [], []),
            "ranks resume": lambda: prepare_root(str(url), world_size=WORLD, resume=True),
        }.items():
            with pytest.raises(acs.StoreLockedError) as e:
                fn()
            text = str(e.value)
            assert repr(str(url)) in text and f"ranks/00001 (pid {os.getpid()} on host" in text, (name, text)
            assert (url / "zarr.json").read_bytes() == root and (url / "ranks" / "00001" / "zarr.json").exists()
            assert [p.name for p in tmp_path.iterdir() if ".replaced-" in p.name] == []
        model(job.batch(3))
    st = acs.open_store(url / "ranks" / "00001")
    assert st.status == "complete" and st.n_samples == 2 * job.BATCH and st.verify() == []


_CTRL_C_AFTER_PREPARATION = r"""
import linecache, os, sys
import torch.distributed as dist
from activationscope.store import ranks
from activationscope.store import _backend as B
from activationscope.store._lock import writer_holding

store, pg, text = sys.argv[1:4]
dist.init_process_group("gloo", init_method="file://" + pg, rank=0, world_size=1)

def line(frame, event, arg):
    if event == "line" and text in linecache.getline(frame.f_code.co_filename, frame.f_lineno):
        raise KeyboardInterrupt(text)
    return line

def call(frame, event, arg):
    return line if frame.f_code.co_name == "writer_options" and frame.f_code.co_filename == ranks.__file__ else None

session = ranks.RankSession(None, 0, 1, store)
sys.settrace(call)
try:
    session.writer_options({})
except KeyboardInterrupt as e:
    kept = e  # (its traceback kept, as a notebook keeps it)
    sys.settrace(None)
else:
    sys.settrace(None)
    raise SystemExit("not interrupted")
print("HELD" if writer_holding(B.resolve(store)) is not None else "FREE", flush=True)
os._exit(0)
"""


@pytest.mark.parametrize("text", ["self.storage_options = opts.get", "self._arrival = _arrival_keys"])
def test_a_ctrl_c_once_rank_0_prepared_the_store_leaves_no_lock(tmp_path, text):
    """A Ctrl-C in rank 0's RankSession.writer_options after its preparation (the store's writer
    lock held from there to the commit) and before the try that tells the other ranks: the lock
    was kept by the session, which a notebook's traceback keeps alive, so every later writer of
    the store was refused; now the lock goes with the interruption."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parents[1]), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", _CTRL_C_AFTER_PREPARATION, str(tmp_path / "s.zarr"),
                          str(tmp_path / "pg"), text], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "FREE", out.stdout + out.stderr[-3000:]


def test_a_rank_store_writer_started_once_consolidate_found_it_free_is_refused(tmp_path, monkeypatch):
    """``consolidate`` (commit_ranks) asked whether a writer held each rank store's lock, then
    read the rank stores, committed them and removed them, holding no lock of theirs: a writer
    of a rank store (a ``RankStore`` task resumed) starting once the question was answered was
    let in, and wrote into a rank store the commit read and then removed. Now the commit takes
    each rank store's lock: such a writer is refused, and the commit goes on undisturbed."""
    import torch

    import torchrun_capture as job
    from activationscope.store import ranks

    url = tmp_path / "s.zarr"
    model = job.toy_mlp(job.WIDTH, 3).eval()
    for r in range(WORLD):
        scope = acs.ActivationScope(store=str(url), reductions=["mean"],
                                    store_options={**job.STORE_OPTIONS, "process_group": acs.RankStore(r, WORLD)})
        with scope.track(model) as tracker, torch.no_grad():
            tracker.set_batch(sample_ids=torch.arange(job.BATCH) + r * job.BATCH)
            model(job.batch(r))
    started = []

    def refuse_then_a_writer_starts(*args, _refuse=ranks._refuse_held_ranks):
        _refuse(*args)
        try:  # (a rank task resumed right after the rank stores were found free)
            StoreWriter(str(url / "ranks" / "00001"), resume=True).abort(RuntimeError("let in"))
            started.append("let in")
        except acs.StoreLockedError as e:
            started.append(str(e))

    monkeypatch.setattr(ranks, "_refuse_held_ranks", refuse_then_a_writer_starts)
    out = commit_ranks(str(url))
    assert out["n_ranks"] == WORLD and out["n_samples"] == WORLD * job.BATCH
    assert len(started) == 1 and started[0] != "let in", started
    assert "ranks/00001" in started[0] and f"pid {os.getpid()} on host" in started[0], started[0]
    st = acs.open_store(url)
    assert st.status == "complete" and st.n_samples == WORLD * job.BATCH and st.verify() == []
    assert not (url / "ranks").exists()
