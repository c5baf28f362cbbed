"""Ctrl-C (``KeyboardInterrupt``) arriving at any line of the library, as in a notebook whose
cell is interrupted: the model is left without a wrapper of the capture, and the cell run again
captures as usual. The interruption is raised by a trace function at the k-th line run in the
library's own code, for every k (``acs_testing.InterruptAt``)."""

from __future__ import annotations

import gc
import linecache
import sys
import warnings
import weakref
from pathlib import Path

import pytest
import torch

import activationscope as acs

from acs_testing import InterruptAt, toy_mlp


def _wrapped(model: torch.nn.Module) -> list[str]:
    """Modules whose forward is still an instance attribute (a capture's wrapper)."""
    return [name for name, m in model.named_modules() if "forward" in m.__dict__]


def test_ctrl_c_at_any_line_of_a_with_block_leaves_no_wrapper():
    # the cell `with scope.track(model): model(x)` interrupted anywhere in the library (the block
    # entered, the forward captured, the block left), then run again
    model = toy_mlp()
    x = torch.randn(2, 16)
    with torch.no_grad():
        want = model(x)

    def cell():
        with torch.no_grad(), acs.ActivationScope().track(model) as tracker:
            model(x)
        return tracker

    cell()  # (first use: lazy imports)
    with InterruptAt(None) as count:
        cell()
    assert count.n > 100 and not _wrapped(model)
    for k in range(1, count.n + 1):
        with pytest.raises(KeyboardInterrupt), InterruptAt(k) as where:
            cell()
            raise KeyboardInterrupt("after the cell")
        assert not _wrapped(model), f"Ctrl-C at line {k} of the cell ({where.where}) left wrappers on {_wrapped(model)}"
    # the model runs as before, and a new capture records each call once
    with torch.no_grad():
        assert torch.equal(model(x), want)
    tracker = cell()
    assert tracker.activations and all(len(v) == 1 for v in tracker.activations.values())


def test_ctrl_c_in_a_store_capture_then_the_cell_again(tmp_path):
    # the cell of a store capture interrupted at one line in 20 of the library's (its store
    # opened, forwards captured and committed, the store closed), then run again: as it is where
    # no row was committed (the new store is removed), with resume=True where rows were (the
    # committed rows intact), never refused as locked; the store then holds every forward once
    model = toy_mlp(depth=1)
    xs = torch.randn(3, 2, 16)
    with torch.no_grad():
        want = {"0.output": torch.cat([model[0](x) for x in xs]), "1.output": torch.cat([model(x) for x in xs])}

    def cell(path, **options):
        scope = acs.ActivationScope(store=path, store_options=dict(options, commit_interval=0))
        with torch.no_grad(), scope.track(model) as tracker:
            for x in xs[tracker.resume_from // 2:]:
                model(x)

    cell(tmp_path / "first.zarr")  # (first use: lazy imports)
    with InterruptAt(None) as count:
        cell(tmp_path / "counted.zarr")
    assert count.n > 1000
    for k in range(1, count.n + 1, 20):
        path = tmp_path / f"{k}.zarr"
        with pytest.raises(KeyboardInterrupt), InterruptAt(k) as where:
            cell(path)
        assert not _wrapped(model), where.where
        n = acs.open_store(path).n_samples if (path / "zarr.json").exists() else 0
        if n:
            store = acs.open_store(path)
            assert store.status == "incomplete" or n == 6, where.where
            for hook_point in store.hook_points:
                assert torch.equal(store[hook_point], want[hook_point][:n]), where.where
            cell(path, resume=True)
        else:
            cell(path)  # (no row committed: no store left there, nor a lock)
        store = acs.open_store(path)
        assert store.status == "complete" and sorted(store.hook_points) == sorted(want), where.where
        for hook_point, rows in want.items():
            assert torch.equal(store[hook_point], rows), where.where
        assert store.row_table("sample")["sample_id"].to_pylist() == list(range(6)), where.where



def _store_cell(model, xs, path, stop=None, trackers=None, **options):
    """A notebook cell capturing ``xs`` (from where a resumed store stopped) into ``path``;
    ``stop``: a Ctrl-C after the first forward (so that the writer aborts); ``trackers``: a
    list the tracker is appended to."""
    scope = acs.ActivationScope(store=path, store_options=dict(options, commit_interval=0))
    with torch.no_grad(), scope.track(model) as tracker:
        if trackers is not None:
            trackers.append(tracker)
        for x in xs[tracker.resume_from // 2:]:
            model(x)
            if stop is not None:
                raise KeyboardInterrupt("in the loop")


def test_two_ctrl_cs_as_the_store_of_no_row_is_removed_then_the_cell_again(tmp_path):
    # a Ctrl-C in a store capture before its first commit, then a second one as the tracker removed
    # the store of no row, its root document gone and its folders not: the folder left (a store's
    # entries, no root document) was refused by the cell run again, with overwrite=True too, as
    # "not empty but holds no Zarr store ... overwrite=True only replaces stores". Now the cell
    # with neither flag is refused naming what the folder holds and the fix, changing nothing,
    # and the cell with overwrite=True replaces it
    from activationscope.store import _backend as B

    model = toy_mlp(depth=1)
    xs = torch.randn(3, 2, 16)
    path = tmp_path / "s.zarr"

    def stop(module, args):  # (the first Ctrl-C: in the first forward, before any row was recorded)
        raise KeyboardInterrupt("in the forward")

    hook = model[1].register_forward_pre_hook(stop)
    at = _InterruptAtLine(B.__file__, "clear", "shutil.rmtree(p)", 1)  # (the root document is removed first)
    with pytest.raises(KeyboardInterrupt), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with at:
            _store_cell(model, xs, path)
    hook.remove()
    assert at.raised and not (path / "zarr.json").exists() and (path / "acts").is_dir()
    found = {str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")}
    with pytest.raises(acs.StoreExistsError, match=r"holds entries of a store \('acts'.*\) but no root document "
                                                   r"\(zarr\.json\).*nothing was changed\. Pass overwrite=True .* "
                                                   r"or remove the folder"):
        _store_cell(model, xs, path)
    assert {str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")} == found
    _store_cell(model, xs, path, overwrite=True)
    store = acs.open_store(path)
    assert store.status == "complete" and store.n_samples == 6 and store.verify() == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.zarr"]  # (nothing left aside)


@pytest.mark.parametrize("name", ["draft.tmp", ".DS_Store"])
def test_a_folder_of_no_store_folder_is_not_taken_for_what_a_cut_short_removal_leaves(tmp_path, name):
    # a folder holding a temporary file or file-manager clutter only (none of a store's folders:
    # acts/, rows/, ...) was taken for what a store's removal cut short leaves: refused as
    # "entries of a store ('draft.tmp') ... Pass overwrite=True", and overwrite=True then deleted
    # the file. It holds no store: refused as such a folder, with overwrite=True too, the file kept
    path = tmp_path / "out.zarr"
    path.mkdir()
    (path / name).write_text("mine")
    for options in ({}, {"overwrite": True}):
        with pytest.raises(acs.StoreExistsError, match=r"exists and is not empty but holds no Zarr store"):
            _store_cell(toy_mlp(depth=1), torch.randn(1, 2, 16), path, **options)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["out.zarr"]
        assert (path / name).read_text() == "mine"


def test_the_root_temp_file_of_a_new_store_killed_in_its_first_write_is_a_store_entry(tmp_path):
    # a new store writes its root document first (a temporary file, renamed): a process killed in
    # that write leaves the folder holding that file alone (.zarr.json.<8 hex>.tmp, the store's
    # own name for it). It was refused as a folder holding no store, overwrite=True too, so that
    # the user had to delete it by hand; it is what is left of a store: refused as such, and
    # overwrite=True replaces it
    path = tmp_path / "out.zarr"
    path.mkdir()
    (path / ".zarr.json.1a2b3c4d.tmp").write_text("{")
    with pytest.raises(acs.StoreExistsError, match=r"holds entries of a store \('.zarr.json.1a2b3c4d.tmp'\)"):
        _store_cell(toy_mlp(depth=1), torch.randn(1, 2, 16), path)
    assert sorted(p.name for p in path.iterdir()) == [".zarr.json.1a2b3c4d.tmp"]
    _store_cell(toy_mlp(depth=1), torch.randn(1, 2, 16), path, overwrite=True)
    assert acs.open_store(path).n_samples == 2
    assert not (path / ".zarr.json.1a2b3c4d.tmp").exists()


def _interrupt_once(monkeypatch, owner, name, when):
    """Make ``owner.name`` raise KeyboardInterrupt the first time ``when(*args)`` holds."""
    real = getattr(owner, name)
    fired = []

    def patched(*args, **kwargs):
        if not fired and when(*args):
            fired.append(True)
            raise KeyboardInterrupt(name)
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, patched)
    return fired


def test_ctrl_c_as_the_spare_file_thread_starts_leaves_no_store(tmp_path, monkeypatch):
    # a Ctrl-C after the store's background thread (spare temporary files) was made and before it
    # started: the close joined a thread never started (RuntimeError), so the commit failed and the
    # new store, holding no row, stayed behind with its lock, and the cell run again was refused
    import threading

    model = toy_mlp(depth=1)
    xs = torch.randn(3, 2, 16)
    path = tmp_path / "s.zarr"
    fired = _interrupt_once(monkeypatch, threading.Thread, "start", lambda t: t.name == "activationscope-reserve")
    with pytest.raises(KeyboardInterrupt), warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # (no "could not be fully committed")
        _store_cell(model, xs, path)
    monkeypatch.undo()
    assert fired and not (path / "zarr.json").exists()
    _store_cell(model, xs, path)
    assert acs.open_store(path).status == "complete" and acs.open_store(path).n_samples == 6


class _Tracing:
    """Trace the lines of the functions of ``self.file`` named in ``self.names`` (their own
    lines, not those of what they call) with ``self._line`` while entered."""

    file: str
    names: tuple

    def __enter__(self):
        sys.settrace(self._call)
        return self

    def __exit__(self, *exc):
        sys.settrace(None)

    def _call(self, frame, event, arg):
        code = frame.f_code
        return self._line if code.co_name in self.names and code.co_filename == self.file else None

    def _line(self, frame, event, arg):
        raise NotImplementedError


class _InterruptInFunction(_Tracing):
    """Raise KeyboardInterrupt at the ``at``-th line run in the functions named ``names`` of
    ``module_file`` (their own lines, not those of what they call); ``n``: lines counted."""

    def __init__(self, module_file: str, names: tuple, at: int | None) -> None:
        self.file, self.names, self.at, self.n = module_file, names, at, 0

    def _line(self, frame, event, arg):
        line = linecache.getline(frame.f_code.co_filename, frame.f_lineno).lstrip()
        if event == "line" and not line.startswith(("with ", "try:")):
            self.n += 1
            if self.n == self.at:
                raise KeyboardInterrupt(f"{frame.f_code.co_name}:{frame.f_lineno}")
        return self._line


class _InterruptAtLine(_Tracing):
    """Raise KeyboardInterrupt the ``nth`` time a line holding ``text`` of the function ``name``
    of ``module_file`` is run; ``raised``: whether it was."""

    def __init__(self, module_file: str, name: str, text: str, nth: int) -> None:
        self.file, self.names, self.text, self.nth, self.seen, self.raised = module_file, (name,), text, nth, 0, False

    def _line(self, frame, event, arg):
        if event == "line" and self.text in linecache.getline(frame.f_code.co_filename, frame.f_lineno):
            self.seen += 1
            if self.seen == self.nth:
                self.raised = True
                raise KeyboardInterrupt(f"{frame.f_code.co_name}:{frame.f_lineno}")
        return self._line


@pytest.mark.parametrize("stop", [False, True], ids=["ended", "raised"])
def test_ctrl_c_at_each_line_of_the_writer_close_then_the_cell_again(tmp_path, stop):
    # a Ctrl-C at each line of StoreWriter.close (the cell's loop ended, or raised), the cell then run again as after any
    # Ctrl-C: with resume=True where rows were committed, as it is where none were. A Ctrl-C
    # between marking the writer closed and its try left the new store (no row, status
    # incomplete, the abort that followed doing nothing as the writer was closed) and the
    # cell run again was refused as an existing store
    from activationscope.store import writer as W

    model = toy_mlp(depth=1)
    xs = torch.randn(3, 2, 16)
    with torch.no_grad():
        want = torch.cat([model(x) for x in xs])

    def cell(path, stop=None, **options):
        _store_cell(model, xs, path, stop, **options)

    counted = _InterruptInFunction(W.__file__, ("close",), None)
    with warnings.catch_warnings(), counted, pytest.raises(KeyboardInterrupt):
        warnings.simplefilter("ignore")
        cell(tmp_path / "counted.zarr", stop=stop or None)
        raise KeyboardInterrupt("(close ran)")
    assert counted.n > 5
    for k in range(1, counted.n + 1):
        path = tmp_path / f"{k}.zarr"
        with warnings.catch_warnings(), pytest.raises(KeyboardInterrupt):
            warnings.simplefilter("ignore")
            with _InterruptInFunction(W.__file__, ("close",), k):
                cell(path, stop=stop or None)
            raise KeyboardInterrupt("(not interrupted)")
        n = acs.open_store(path).n_samples if (path / "zarr.json").exists() else 0
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cell(path, resume=True) if n else cell(path)
        store = acs.open_store(path)
        assert store.status == "complete", k
        assert torch.equal(store["1.output"], want), k



@pytest.mark.parametrize("stop", [False, True], ids=["ended", "raised"])
def test_ctrl_c_in_the_writer_close_before_its_thread_stopped_then_the_cell_again(tmp_path, monkeypatch, stop):
    # a Ctrl-C in StoreWriter.close after the first array's partial shard was handed to the writer
    # thread (its encoding held until the threads are stopped, or until the store that holds no row
    # is being removed): the thread went on writing after the close had released the lock, its
    # shard landed in the folder being removed, the removal failed and left a folder without
    # zarr.json that the cell run again refused
    import os
    import threading

    from activationscope.store import writer as W

    model = toy_mlp(depth=1)
    xs = torch.randn(3, 2, 16)
    with torch.no_grad():
        want = torch.cat([model(x) for x in xs])
    gate, trackers = threading.Event(), []
    make_encoder, stop_threads, rmdir = W.F.numcodecs_encoder, W.StoreWriter._stop_threads, os.rmdir

    def stopping(self):
        gate.set()
        stop_threads(self)

    def removing(name, *args, **kwargs):
        if str(name).endswith("0.output"):  # (the array whose shard the close handed over)
            gate.set()
            trackers[-1].writer._core.drain()  # the shard is written now, as the folder is removed
        return rmdir(name, *args, **kwargs)

    monkeypatch.setattr(W.F, "numcodecs_encoder", lambda codec: _HeldEncoder(make_encoder(codec), gate))
    monkeypatch.setattr(W.StoreWriter, "_stop_threads", stopping)
    monkeypatch.setattr(os, "rmdir", removing)

    def cell(path, stop=None):
        _store_cell(model, xs, path, stop, trackers, compression="zstd")

    close, closes = W.StoreWriter.close, []

    def closing(self, *args, **kwargs):
        closes.append(self)
        if len(closes) == 2:  # the tracker's second try at the close cut short at once: the close is given up
            raise KeyboardInterrupt("close again")
        return close(self, *args, **kwargs)

    monkeypatch.setattr(W.StoreWriter, "close", closing)
    path = tmp_path / "s.zarr"
    at = _cell_interrupted_in_close(W, cell, path, stop)
    assert at.raised
    assert not path.exists() or not any(path.iterdir())
    cell(path)
    store = acs.open_store(path)
    assert store.status == "complete"
    assert torch.equal(store["1.output"], want)


class _HeldEncoder:
    """A codec whose encoding waits for ``gate`` (30 s at most: a test that hangs fails)."""

    def __init__(self, encoder, gate):
        self.encoder, self.gate = encoder, gate

    def encode(self, data):
        self.gate.wait(30)
        return self.encoder.encode(data)

    def __getattr__(self, name):  # (decode, as the codec's)
        return getattr(self.encoder, name)


def _cell_interrupted_in_close(W, cell, path, stop):
    """Run ``cell(path)`` (``stop``: with a Ctrl-C in its loop first) with a Ctrl-C in
    StoreWriter.close once its first array is flushed; returns the interrupter."""
    at = _InterruptAtLine(W.__file__, "close", "for a in self._arrays.values()", 2)  # (the first array flushed)
    with warnings.catch_warnings(), pytest.raises(KeyboardInterrupt):
        warnings.simplefilter("ignore")
        with at:
            cell(path, stop=stop or None)
    return at


def _held_writer_thread(monkeypatch, W, n_interrupted: int | None):
    """Hold the encoding of every chunk on an event until a stop of the writer's threads gets
    through; the first ``n_interrupted`` stops (None: every one until ``interrupted[0]`` is set
    to a number) are interrupted (a Ctrl-C while the stop waits for the held thread). Returns
    the stops tried, the writer threads' state at each lock release (whether they were
    stopped) and ``interrupted``."""
    import threading

    from activationscope.store import _lock

    gate, stops, released, interrupted = threading.Event(), [], [], [n_interrupted]
    make_encoder, stop_threads, release = W.F.numcodecs_encoder, W.StoreWriter._stop_threads, _lock.WriterLock.release

    def stopping(self):
        stops.append(self)
        if interrupted[0] is None or len(stops) <= interrupted[0]:
            raise KeyboardInterrupt(f"stop {len(stops)}")
        gate.set()
        stop_threads(self)

    def releasing(self):
        if self._held and stops and self is stops[-1]._writer_lock:
            released.append(stops[-1]._threads_stopped and gate.is_set())
        release(self)

    close = W.StoreWriter.close

    def closing(self, *args, **kwargs):
        # the tracker's second try at a close cut short (Tracker._close_writer) is cut short too, at once:
        # these Ctrl-Cs keep coming as the store closes (it would wait for the held thread otherwise)
        frame = sys._getframe(1)
        for _ in range(3):
            if frame is None:
                break
            if frame.f_code.co_name == "_close_writer" and self.close_pending:
                raise KeyboardInterrupt("close tried again")
            frame = frame.f_back
        return close(self, *args, **kwargs)

    monkeypatch.setattr(W.F, "numcodecs_encoder", lambda codec: _HeldEncoder(make_encoder(codec), gate))
    monkeypatch.setattr(W.StoreWriter, "_stop_threads", stopping)
    monkeypatch.setattr(W.StoreWriter, "close", closing)
    monkeypatch.setattr(_lock.WriterLock, "release", releasing)
    return stops, released, interrupted


@pytest.mark.parametrize("again", ["writer.close", "tracker.remove"])
@pytest.mark.parametrize("n_interrupted", [1, None], ids=["once", "every_time"])
@pytest.mark.parametrize("stop", [False, True], ids=["ended", "raised"])
def test_ctrl_c_again_in_the_writer_close_then_close_again_and_the_cell_again(tmp_path, monkeypatch, stop,
                                                                              n_interrupted, again):
    # a Ctrl-C in StoreWriter.close while a shard was held in the writer thread, then more in the
    # stop of that thread (a notebook user pressing Ctrl-C again while the close waits): the
    # clean-up and the lock release after the stop were skipped, and the writer, marked closed,
    # did nothing when closed (or aborted) again: the lock stayed held and the cell run again was
    # refused as locked. The capture's own abort finishes the close; where each of its tries is
    # interrupted too, closing the writer (or the tracker) again does
    from activationscope.store import writer as W

    model = toy_mlp(depth=1)
    xs = torch.randn(3, 2, 16)
    with torch.no_grad():
        want = torch.cat([model(x) for x in xs])
    stops, released, interrupted = _held_writer_thread(monkeypatch, W, n_interrupted)
    trackers = []

    def cell(path, stop=None, **options):
        _store_cell(model, xs, path, stop, trackers, compression="zstd", **options)

    path = tmp_path / "s.zarr"
    at = _cell_interrupted_in_close(W, cell, path, stop)
    assert at.raised and (released == [True]) == (n_interrupted is not None)
    n_stops = interrupted[0] = len(stops) - (n_interrupted is not None)  # (from here on, none is)
    assert n_stops >= 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        close = trackers[-1].writer.close if again == "writer.close" else trackers[-1].remove
        close()  # (again: what the interrupted close left undone is done, once)
        close()
    assert len(stops) == n_stops + 1 and released == [True]  # the thread stopped, then the lock released
    # (a store left, with or without rows, is resumed; none where the capture removed it, holding no row)
    cell(path, resume=True) if (path / "zarr.json").exists() else cell(path)
    store = acs.open_store(path)
    assert store.status == "complete"
    assert torch.equal(store["1.output"], want)
    assert store.row_table("sample")["sample_id"].to_pylist() == list(range(6))


@pytest.mark.parametrize("again", ["abort", "close"])
def test_ctrl_c_twice_in_the_writer_abort_then_again_and_the_cell_again(tmp_path, monkeypatch, again):
    # a Ctrl-C in StoreWriter.abort while it stopped the writer thread, then another in the
    # retried stop: abort never raises, and left the lock held, doing nothing
    # when called again; now an abort or close called again stops the thread, cleans up and
    # releases the lock, and the cell run again completes the store
    from activationscope.store import writer as W

    model = toy_mlp(depth=1)
    xs = torch.randn(3, 2, 16)
    with torch.no_grad():
        want = torch.cat([model(x) for x in xs])
    stops, released, _ = _held_writer_thread(monkeypatch, W, 2)

    def cell(path, abort=False, **options):
        scope = acs.ActivationScope(store=path, store_options=dict(options, commit_interval=0, compression="zstd"))
        with torch.no_grad(), scope.track(model) as tracker:
            for x in xs[tracker.resume_from // 2:]:
                model(x)
            if abort:
                tracker.writer.abort()
                assert len(stops) == 2 and not released
                getattr(tracker.writer, again)()
                assert len(stops) == 3 and released == [True]

    path = tmp_path / "s.zarr"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cell(path, abort=True)
    cell(path, resume=True)  # (the store the abort left: incomplete)
    store = acs.open_store(path)
    assert store.status == "complete"
    assert torch.equal(store["1.output"], want)



@pytest.mark.parametrize("again", ["writer.close", "writer.abort", "tracker.remove"])
def test_ctrl_c_again_in_a_rank_store_close_then_close_again_and_the_cell_again(tmp_path, monkeypatch, again):
    # the same Ctrl-Cs in the close of a rank store (process_group=RankStore(r, n): a
    # RankWriter over the rank store's StoreWriter): the RankWriter, marked done, did nothing
    # when closed, aborted or removed again, so the rank store's lock stayed held and the cell
    # run again was refused as locked; now its rank store's writer finishes that close
    from activationscope.store import _backend as B
    from activationscope.store import writer as W
    from activationscope.store._lock import writer_holding

    model = toy_mlp(depth=1)
    xs = torch.randn(3, 2, 16)
    with torch.no_grad():
        want = torch.cat([model(x) for x in xs])
    stops, released, interrupted = _held_writer_thread(monkeypatch, W, None)
    trackers = []

    def cell(path, **options):
        options.update(process_group=acs.RankStore(0, 2), commit_interval=0, compression="zstd")
        scope = acs.ActivationScope(store=path, store_options=options)
        with torch.no_grad(), scope.track(model) as tracker:
            trackers.append(tracker)
            for x in xs[tracker.resume_from // 2:]:
                model(x)

    path = tmp_path / "r.zarr"
    at = _InterruptAtLine(W.__file__, "close", "for a in self._arrays.values()", 2)  # (the first array flushed)
    with warnings.catch_warnings(), pytest.raises(KeyboardInterrupt):
        warnings.simplefilter("ignore")
        with at:
            cell(path)
    rank_store = trackers[-1].writer.path
    assert at.raised and not released and writer_holding(B.resolve(rank_store)) is not None
    n_stops = interrupted[0] = len(stops)  # (from here on, none is)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        writer = trackers[-1].writer
        close = {"writer.close": writer.close, "writer.abort": writer.abort, "tracker.remove": trackers[-1].remove}[again]
        close()  # (again: what the interrupted close left undone is done, once)
        close()
    assert len(stops) == n_stops + 1 and released == [True]  # the thread stopped, then the lock released
    assert writer_holding(B.resolve(rank_store)) is None
    cell(path, resume=True)
    assert torch.equal(acs.open_store(rank_store)["1.output"], want)

def test_interrupt_at_leaves_out_callbacks_run_by_weakref_finalize():
    # (the garbage collector runs them when it runs: a Ctrl-C delivered there is printed and
    # ignored, and the line count would vary from run to run)
    from acs_testing import _run_by_finalize

    seen = []

    class Owner:
        pass

    owner = Owner()
    weakref.finalize(owner, lambda: seen.append(_run_by_finalize(sys._getframe())))
    del owner
    gc.collect()
    assert seen == [True] and not _run_by_finalize(sys._getframe())


def test_ctrl_c_at_each_line_of_a_new_hook_point_leaves_the_ctrl_c_itself():
    # a Ctrl-C at each line of the tracker's set-up of a new hook point with reductions (an
    # in-memory capture): one between noting the hook point's reduction names and their objects
    # was replaced, at the close, by a KeyError naming the hook point
    from activationscope.capture import scope as S

    model = toy_mlp(depth=1)
    x = torch.randn(3, 16)

    def cell():
        with torch.no_grad(), acs.ActivationScope(reductions={"*": ["mean", "var"]}).track(model) as tracker:
            model(x)
        return tracker

    cell()  # (first use: lazy imports)
    counted = _InterruptInFunction(S.__file__, ("_new_sink",), None)
    with counted:
        cell()
    assert counted.n > 20
    for k in range(1, counted.n + 1):
        with pytest.raises(KeyboardInterrupt), _InterruptInFunction(S.__file__, ("_new_sink",), k):
            cell()
    tracker = cell()
    torch.testing.assert_close(tracker.reductions["0.output"]["mean"], model[0](x).double().mean(0))


@pytest.mark.parametrize("text", ["self._backend.make_root = False", "self._lost: str | None = None",
                                  "self._replacing = False"])
def test_ctrl_c_in_the_writer_setup_right_after_its_lock_then_the_cell_again(tmp_path, text):
    # a Ctrl-C in StoreWriter.__init__ between taking the writer lock and the try that gives it back
    # on a failure: the half-made writer, kept alive by the traceback a notebook keeps, held the
    # lock, and the cell run again was refused as a writer of this process still open
    from activationscope.store import StoreWriter
    from activationscope.store import writer as W

    path = tmp_path / "s.zarr"
    at = _InterruptAtLine(W.__file__, "__init__", text, 1)
    with pytest.raises(KeyboardInterrupt) as kept:  # (its traceback kept, as a notebook keeps it)
        with at:
            StoreWriter(str(path))
    assert at.raised and kept.value.__traceback__ is not None
    assert not path.exists()  # (the folder it made: removed)
    w = StoreWriter(str(path))  # (not refused: the lock was given back)
    w.abort(RuntimeError("stop"))
    assert w.remove_if_unused() and not path.exists()


@pytest.mark.parametrize("again", ["close", "abort"])
@pytest.mark.parametrize("where", [("close", "self._finish_delete()"), ("finish", "self._thread.join()")],
                         ids=["before", "waiting"])
def test_ctrl_c_in_the_writer_close_while_the_replaced_store_is_deleted_then_close_again(tmp_path, monkeypatch,
                                                                                         where, again):
    # a Ctrl-C in StoreWriter.close of an overwrite=True while it waited for the background delete
    # of the old store: the close released the lock and left that delete running, and the close
    # called again did nothing, so the folder aside (.<name>.replaced-<hex>) was still there after
    # it. Now the close called again waits for that delete, as an uninterrupted close does; also
    # where the Ctrl-C came as the close waited (the writer had let go of that delete as the
    # wait began), and an abort called instead waits for it too
    import threading

    from acs_testing import hold_aside_delete

    from activationscope.store import StoreWriter
    from activationscope.store import writer as W

    path = tmp_path / "s.zarr"
    data = torch.randn(8, 4)
    for overwrite in (False, True):
        if overwrite:
            go, started = hold_aside_delete(monkeypatch)
        w = StoreWriter(str(path), overwrite=overwrite)
        w.open_array("x", (4,), torch.float32, "sample").append(data)
        w.add_batch(8)
        if overwrite:
            at = _InterruptAtLine(W.__file__, *where, 1)
            with pytest.raises(KeyboardInterrupt), at:
                w.close()
            assert at.raised and started.wait(30)
            threading.Timer(0.5, go.set).start()  # (the delete ends after this: the close waits for it)
        (getattr(w, again) if overwrite else w.close)()
    assert not list(tmp_path.glob(".s.zarr.replaced-*"))
    assert torch.equal(acs.open_store(path)["x"], data)


class _Mean:
    """A reduction as add_reductions stores it: its result only."""

    kind = "mean"

    def __init__(self, value: torch.Tensor) -> None:
        self.value = value

    def result(self) -> dict:
        return {"mean": self.value}


def _writer_left_open(path, make=None, **options):
    """A StoreWriter (or the writer ``make`` opens: a RankWriter) of two sample arrays ``a`` and
    ``b`` of 8 float32 features, left open: three batches of 12 rows (with a ``label`` column)
    in 16-row shards, the first 24 rows committed, then a mean reduction of ``a`` stored: the
    close flushes the last rows (a partial shard of each array) and commits them with the
    reduction."""
    from activationscope.store import StoreWriter

    data = torch.randn(36, 8, generator=torch.Generator().manual_seed(0))
    w = (make or StoreWriter)(str(path), chunk_rows=4, shard_rows=16, commit_interval=0, **options)
    arrays = [w.open_array(hp, (8,), torch.float32, "sample") for hp in ("a", "b")]
    for s in range(0, 36, 12):
        for i, arr in enumerate(arrays):
            arr.append(data[s:s + 12] + i)
        w.add_batch(12, list(range(s, s + 12)), None, {"label": torch.arange(s, s + 12) % 3})
        if s == 12:
            w._core.drain()
            assert w.commit()
    w.add_reductions("a", "mean", _Mean(data.double().mean(0)))
    return w


def _same_store(path, want) -> None:
    """The store at ``path`` reads as the one at ``want``: status, arrays, row table, reductions."""
    got, want = acs.open_store(path), acs.open_store(want)
    assert (got.status, got.n_samples, sorted(got.hook_points)) == (want.status, want.n_samples,
                                                                    sorted(want.hook_points))
    for hook_point in want.hook_points:
        assert torch.equal(got[hook_point], want[hook_point]), hook_point
    assert got.row_table("sample").to_pylist() == want.row_table("sample").to_pylist()
    assert got.reductions.keys() == want.reductions.keys()
    for hook_point, results in want.reductions.items():
        assert results.keys() == got.reductions[hook_point].keys(), hook_point
        for name, value in results.items():
            assert torch.equal(got.reductions[hook_point][name], value), (hook_point, name)


@pytest.mark.parametrize("names", [("close",), ("_commit_now",)], ids=["close", "commit"])
@pytest.mark.parametrize("overwrite", [False, True], ids=["new", "overwrite"])
def test_ctrl_c_at_each_line_of_the_writer_close_then_close_again_commits_every_row(tmp_path, names, overwrite):
    # a Ctrl-C at each line of StoreWriter.close (and of the commit it makes: one after the commit
    # took the records of the shards the writer thread finished, before it listed them, lost them,
    # and a later commit listed no row of theirs, a close "complete" included), then close() called
    # again: the close had flushed the last rows (a partial shard of each array) and released
    # the lock in its clean-up, so the second close did nothing and the store stayed at its
    # last commit, without those rows nor the reduction (resume=True captured them again), and,
    # overwriting a store, the old one was put back in place of the new. Now the second close
    # finishes the first: the store is as an uninterrupted close leaves it
    from activationscope.store import _backend as B
    from activationscope.store import writer as W
    from activationscope.store._lock import writer_holding

    def old_store(path):
        if overwrite:
            w = _writer_left_open(path)
            w.close("incomplete")

    want = tmp_path / "want.zarr"
    old_store(want)
    _writer_left_open(want, overwrite=overwrite).close()
    old_store(tmp_path / "counted.zarr")
    w = _writer_left_open(tmp_path / "counted.zarr", overwrite=overwrite)
    with _InterruptInFunction(W.__file__, names, None) as counted:
        w.close()
    assert counted.n > 5
    for k in range(1, counted.n + 1):
        path = tmp_path / f"{k}.zarr"
        old_store(path)
        w = _writer_left_open(path, overwrite=overwrite)
        with warnings.catch_warnings(), pytest.raises(KeyboardInterrupt):
            warnings.simplefilter("ignore")
            with _InterruptInFunction(W.__file__, names, k):
                w.close()
        w.close()  # (again: the interrupted close is finished)
        _same_store(path, want)
        assert writer_holding(B.resolve(str(path))) is None, k
        assert not list(tmp_path.glob(f".{k}.zarr.replaced-*")), k  # (overwrite: the old store went)


@pytest.mark.parametrize("again", ["close", "abort", "discard"])
@pytest.mark.parametrize("overwrite", [False, True], ids=["new", "overwrite"])
def test_a_close_that_failed_then_a_ctrl_c_in_its_clean_up_then_again_commits_nothing_more(tmp_path, monkeypatch,
                                                                                         overwrite, again):
    # StoreWriter.close whose commit raised (a manifest on a full disk), then a Ctrl-C in its
    # clean-up (the lock still held): the writer still recorded the close's status as that of a
    # close cut short before its commit, so close() called again committed it: overwriting a
    # store, this run's root over the old store the failed close had put back (a store of this
    # run's row count over the old one's files: a shard missing, a row table part of another
    # crc32c), else a complete store where the close had said it failed. Now the one called
    # again finishes the clean-up only: the store as the failed close leaves it uninterrupted
    import errno
    import os

    from activationscope.store import StoreWriter
    from activationscope.store import _backend as B
    from activationscope.store import writer as W
    from activationscope.store._lock import writer_holding

    def failed_close(path, interrupted):
        if overwrite:
            _writer_left_open(path).close()
            w = StoreWriter(str(path), overwrite=True, commit_interval=0)
            w.open_array("x", (8,), torch.float32, "sample").append(torch.randn(4, 8))
            w.add_batch(4)
        else:
            w = _writer_left_open(path)
        real = os.replace

        def full(src, dst, *args, **kwargs):  # (the disk is full from here on)
            if str(dst).endswith("manifest.json"):
                raise OSError(errno.ENOSPC, "No space left on device", str(dst))
            return real(src, dst, *args, **kwargs)

        monkeypatch.setattr(os, "replace", full)
        if interrupted:
            _interrupt_once(monkeypatch, W.StoreWriter, "_cleanup", lambda *args: True)
        with pytest.raises(KeyboardInterrupt if interrupted else acs.StoreError), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            w.close()
        monkeypatch.undo()
        return w

    want, path = tmp_path / "want.zarr", tmp_path / "s.zarr"
    failed_close(want, False)
    w = failed_close(path, True)
    assert writer_holding(B.resolve(str(path))) is not None  # (the Ctrl-C came before the lock went)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        getattr(w, again)()
    _same_store(path, want)
    assert acs.open_store(path).verify() == []
    assert writer_holding(B.resolve(str(path))) is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.zarr", "want.zarr"]  # (nothing left aside)


@pytest.mark.parametrize("again", ["discard", "close"])
@pytest.mark.parametrize("where", [("_backend", "clear_for_restore", "self.clear()", 1),
                                   ("writer", "_settle_aside", "self._aside_cleared = True", 1),
                                   ("_backend", "restore_aside", "os.rename(p, self.root / p.name)", 2),
                                   ("_backend", "restore_aside", "Path(aside).rmdir()", 1)],
                         ids=["clearing", "cleared", "moving-back", "moved-back"])
def test_ctrl_c_as_the_writer_discard_puts_the_replaced_store_back_then_again(tmp_path, where, again):
    # a Ctrl-C in StoreWriter.discard of an overwrite=True that committed no forward, while it put the
    # old store back from the folder aside (the new store's files being removed, the old ones
    # moved back): the writer had forgotten that folder as the put-back began, so the discard
    # called again left it there, the old store (its root document included) in it and the
    # path without a store. Now the discard called again finishes the put-back: the old store
    # is back at the path as it was, nothing left aside, the lock released
    from activationscope.store import StoreWriter
    from activationscope.store import _backend as B
    from activationscope.store import writer as W
    from activationscope.store._lock import writer_holding

    want, path = tmp_path / "want.zarr", tmp_path / "s.zarr"
    _writer_left_open(want).close()
    _writer_left_open(path).close()
    w = StoreWriter(str(path), overwrite=True, commit_interval=0)
    w.open_array("x", (8,), torch.float32, "sample").append(torch.randn(4, 8))
    w.add_batch(4)
    module, *line = where
    at = _InterruptAtLine({"_backend": B, "writer": W}[module].__file__, *line)
    _discard_interrupted_then(w, at, again)
    _same_store(path, want)
    assert not list(tmp_path.glob(".s.zarr.replaced-*"))
    assert writer_holding(B.resolve(str(path))) is None


def _resumed_writer(path, rows, status):
    """A StoreWriter resuming the store of :func:`_writer_left_open` at ``path`` (closed with
    ``status``), given ``rows`` more sample rows of arrays ``a`` and ``b`` and a mean reduction
    of ``a``, none committed; and the store's files as found (:func:`_files`): ``(writer, found)``."""
    from activationscope.store import StoreWriter

    _writer_left_open(path).close(status)
    found = _files(path)
    w = StoreWriter(str(path), chunk_rows=4, shard_rows=16, commit_interval=0, resume=True)
    for i, hp in enumerate(("a", "b")):
        w.open_array(hp, (8,), torch.float32, "sample").append(torch.randn(rows, 8) + i)
    w.add_batch(rows, list(range(36, 36 + rows)))
    w.add_reductions("a", "mean", _Mean(torch.zeros(8, dtype=torch.float64)))
    return w, found


def _discard_interrupted_then(w, at, again):
    """``w.discard()`` under the Ctrl-C ``at`` (which must fire; discard never raises: the
    Ctrl-C is taken in its clean-up), then ``w.<again>()``, warnings ignored."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with at:
            w.discard()
        assert at.raised
        getattr(w, again)()


def _overwrite_close_interrupted_at(tmp_path, function, text):
    """A StoreWriter of ``overwrite=True`` over a store at ``tmp_path / "s.zarr"`` that
    committed nothing before, given 8 sample rows of one array ``x``, whose close() a Ctrl-C cut
    short at the first run of the line of writer.py holding ``text`` in ``function``; and
    ``tmp_path / "want.zarr"``, the same capture closed without one: ``(writer, path, want)``."""
    from activationscope.store import StoreWriter
    from activationscope.store import writer as W

    data = torch.randn(8, 4)

    def replaced(path):
        _writer_left_open(path).close()
        w = StoreWriter(str(path), overwrite=True, commit_interval=0)
        w.open_array("x", (4,), torch.float32, "sample").append(data)
        w.add_batch(8)
        return w

    want, path = tmp_path / "want.zarr", tmp_path / "s.zarr"
    replaced(want).close()
    w = replaced(path)
    at = _InterruptAtLine(W.__file__, function, text, 1)
    with warnings.catch_warnings(), pytest.raises(KeyboardInterrupt):
        warnings.simplefilter("ignore")
        with at:
            w.close()
    assert at.raised
    return w, path, want


@pytest.mark.parametrize("again", ["close", "abort"])
@pytest.mark.parametrize("where", [("_settle_aside", "(aside / \"zarr.json\").unlink()"),
                                   ("__init__", "self._thread = threading.Thread("),
                                   ("__init__", "self._thread.start()"), ("_settle_aside", "self._aside = None")],
                         ids=["unlinking", "thread", "starting", "listed"])
def test_ctrl_c_as_the_writer_close_starts_deleting_the_replaced_store_then_again(tmp_path, where, again):
    # a Ctrl-C in the commit of StoreWriter.close of an overwrite=True that committed nothing before,
    # as it began the background delete of the old store (its root committed): the writer had
    # forgotten the folder aside before that delete was listed, so the close (or abort) called
    # again neither deleted nor waited for it, and the .<name>.replaced-<hex> folder stayed. Now
    # the one called again deletes it: the new store as an uninterrupted close leaves it
    from activationscope.store import _backend as B
    from activationscope.store._lock import writer_holding

    w, path, want = _overwrite_close_interrupted_at(tmp_path, *where)
    getattr(w, again)()
    _same_store(path, want)
    assert not list(tmp_path.glob(".s.zarr.replaced-*"))
    assert writer_holding(B.resolve(str(path))) is None


@pytest.mark.parametrize("again", ["abort", "discard"])
@pytest.mark.parametrize("text", ["self._document_bytes += len(root)", "self._settle_aside(keep_new=True)"],
                         ids=["root-written", "settling"])
def test_ctrl_c_after_the_root_of_an_overwrite_close_then_abort_keeps_the_new_store(tmp_path, text, again):
    # a Ctrl-C in the commit of StoreWriter.close of an overwrite=True that committed nothing before,
    # after it wrote the new store's root (every row listed, status complete) and before it began
    # deleting the old store, then an abort (a tracker's after a Ctrl-C in its close, or one
    # called): the old store was put back in place of the new one, which had committed, and the
    # new rows were lost. Now the old store goes, as after an uninterrupted close
    from activationscope.store import _backend as B
    from activationscope.store._lock import writer_holding

    w, path, want = _overwrite_close_interrupted_at(tmp_path, "_commit_now", text)
    getattr(w, again)()
    _same_store(path, want)
    assert not list(tmp_path.glob(".s.zarr.replaced-*"))
    assert writer_holding(B.resolve(str(path))) is None


@pytest.mark.parametrize("again", ["discard", "close"])
@pytest.mark.parametrize("where", [("_drop_kept_shards", "if restore and path not in listed"),
                                   ("_drop_kept_shards", "keep.unlink(missing_ok=True)"),
                                   ("_drop_kept_reductions", "if restore:")],
                         ids=["shard-restoring", "shard-removing", "reduction-restoring"])
def test_ctrl_c_as_the_writer_discard_puts_kept_files_back_then_again(tmp_path, where, again):
    # a Ctrl-C in StoreWriter.discard of a resume, as it put back the committed files it had kept
    # (the last shard of each array, rewritten with the new rows; a reduction written again): the
    # writer forgot each kept file as it began putting it back, so the discard (or close) called
    # again left that file in the store (.committed.tmp) and, for a reduction, the rewrite at its
    # key, which the root, put back as found, does not list. Now each is kept until it is back:
    # the store's files are the found ones
    from activationscope.store import _backend as B
    from activationscope.store import writer as W
    from activationscope.store._lock import writer_holding

    path = tmp_path / "s.zarr"
    w, found = _resumed_writer(path, 12, "incomplete")
    at = _InterruptAtLine(W.__file__, *where, 1)
    _discard_interrupted_then(w, at, again)
    assert _files(path) == found
    assert writer_holding(B.resolve(str(path))) is None


@pytest.mark.parametrize("again", ["discard", "abort"])
def test_ctrl_c_at_each_line_of_the_writer_discard_of_a_resume_then_again(tmp_path, again):
    # a Ctrl-C at each line of StoreWriter.discard of a resume (rows and a reduction given, none
    # committed): one in its try body was turned into a warning with an empty text, the lock
    # released, and the discard called again did nothing: the store kept this run's root document
    # (its time, its status), not the one found. Now the discard cut short keeps the lock and what
    # it needs, warns to call it again, and discard() (or abort(), once it was cut short) called
    # again puts the store back as found (every file's bytes)
    from activationscope.store import _backend as B
    from activationscope.store import writer as W
    from activationscope.store._lock import writer_holding

    def resumed(path):  # (complete: the root this run writes is not the one found)
        return _resumed_writer(path, 20, "complete")

    w, _ = resumed(tmp_path / "counted.zarr")
    with _InterruptInFunction(W.__file__, ("discard",), None) as counted:
        w.discard()
    assert counted.n > 5
    for k in range(1, counted.n + 1):
        path = tmp_path / f"{k}.zarr"
        w, found = resumed(path)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                with _InterruptInFunction(W.__file__, ("discard",), k):
                    w.discard()
            except KeyboardInterrupt:
                pass
        assert not [c for c in caught if "putting it back as found failed" in str(c.message)], k
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            getattr(w, again)()
        cut_short = any("call discard() again" in str(c.message) for c in caught)
        if again == "discard" or cut_short:  # (an abort before the discard began commits this run's rows)
            assert _files(path) == found, k
        assert acs.open_store(path).verify() == [], k
        assert writer_holding(B.resolve(str(path))) is None, k


def _resumed_rank_writer(path, rows):
    """A RankWriter of a rank store of its own (``RankStore(0, 2)``, no process group) resuming
    the rank store :func:`_writer_left_open` closed at ``path``, given ``rows`` more sample rows of
    arrays ``a`` and ``b`` and a mean reduction of ``a``, none committed; and the rank store's
    files as found (:func:`_files`): ``(writer, found)``."""
    from activationscope.store.ranks import open_capture_writer

    group = acs.RankStore(0, 2)
    _writer_left_open(path, make=open_capture_writer, process_group=group).close()
    found = _files(path / "ranks" / "00000")
    w = open_capture_writer(str(path), process_group=group, chunk_rows=4, shard_rows=16, commit_interval=0,
                            resume=True)
    assert w.path == str(path / "ranks" / "00000")
    for i, hp in enumerate(("a", "b")):
        w.open_array(hp, (8,), torch.float32, "sample").append(torch.randn(rows, 8) + i)
    w.add_batch(rows, list(range(36, 36 + rows)))
    w.add_reductions("a", "mean", _Mean(torch.zeros(8, dtype=torch.float64)))
    return w, found


@pytest.mark.parametrize("again", ["discard", "close", "abort"])
@pytest.mark.parametrize("module", ["ranks", "writer"])
def test_ctrl_c_at_each_line_of_a_rank_store_discard_then_again(tmp_path, module, again):
    # a Ctrl-C at each line of RankWriter.discard (module "ranks") and of the rank store's
    # StoreWriter.discard it calls ("writer"), for a resumed rank store of its own (RankStore,
    # no process group): one before the rank store's discard began (or before its try) left
    # that writer open, and the RankWriter's discard (or close, abort) called again aborted it,
    # committing this run's rows into the rank store, or, close, committed it complete. Now
    # the one called again finishes the discard: the rank store's files are the found ones
    from activationscope.store import _backend as B
    from activationscope.store import ranks as R
    from activationscope.store import writer as W
    from activationscope.store._lock import writer_holding

    file = (R if module == "ranks" else W).__file__
    w, found = _resumed_rank_writer(tmp_path / "counted.zarr", 20)
    with _InterruptInFunction(file, ("discard",), None) as counted:
        w.discard()
    assert counted.n > (3 if module == "ranks" else 5) and _files(Path(w.path)) == found
    for k in range(1, counted.n + 1):
        w, found = _resumed_rank_writer(tmp_path / f"{k}.zarr", 20)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                with _InterruptInFunction(file, ("discard",), k):
                    w.discard()
            except KeyboardInterrupt:
                pass
            begun = bool(w._done)  # (a close or abort before the discard began commits this run's rows)
            getattr(w, again)()
        if again == "discard" or begun:
            assert _files(Path(w.path)) == found, k
        assert acs.open_store(w.path).verify() == [], k
        assert writer_holding(B.resolve(w.path)) is None, k


def _files(path) -> dict[str, bytes]:
    """Every file of the store at ``path`` (but its writer lock) and its bytes."""
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*"))
            if p.is_file() and p.name != ".activationscope-writer.lock"}


@pytest.mark.parametrize("again", ["writer.close", "tracker.remove"])
def test_a_store_whose_close_ctrl_c_cut_short_refuses_the_cell_again_naming_the_close_to_call_again(tmp_path,
                                                                                                  monkeypatch, again):
    # the cell run again while the store's close, cut short by Ctrl-Cs, still holds its lock is
    # refused; the refusal said the writer was still open and to close it, not that the close
    # (or tracker.remove()) cut short is to be called again, which finishes it
    from activationscope.store import writer as W

    model = toy_mlp(depth=1)
    xs = torch.randn(3, 2, 16)
    stops, _, interrupted = _held_writer_thread(monkeypatch, W, None)  # (every stop of the thread interrupted)
    trackers = []

    def cell(path, stop=None, **options):
        _store_cell(model, xs, path, stop, trackers, compression="zstd", **options)

    path = tmp_path / "s.zarr"
    _cell_interrupted_in_close(W, cell, path, False)
    with pytest.raises(acs.StoreLockedError, match=r"one whose close a Ctrl-C cut short holds the store until that "
                                                    r"close\(\) or tracker\.remove\(\) is called again"):
        cell(path, resume=True)
    interrupted[0] = len(stops)  # (from here on, none is)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        (trackers[0].writer.close if again == "writer.close" else trackers[0].remove)()
    cell(path, resume=True) if (path / "zarr.json").exists() else cell(path)
    assert acs.open_store(path).status == "complete"


def test_ctrl_c_at_each_line_of_a_rank_store_close_then_close_again_commits_every_row(tmp_path):
    # the same Ctrl-Cs in the close of a rank store of its own (process_group=RankStore(r, n): a
    # RankWriter over the rank store's StoreWriter, no other rank to tell): the RankWriter aborted
    # the rank store's close cut short, so that its close called again only let go of the lock,
    # the rank store lacking the rows that close had flushed. Now it commits them, as the
    # rank store's own close called again does
    from activationscope.store import writer as W
    from activationscope.store.ranks import open_capture_writer

    def rank_writer(path):
        return _writer_left_open(path, make=open_capture_writer, process_group=acs.RankStore(0, 2))

    want = rank_writer(tmp_path / "want.zarr")
    want.close()
    with _InterruptInFunction(W.__file__, ("close",), None) as counted:
        rank_writer(tmp_path / "counted.zarr").close()
    assert counted.n > 5
    for k in range(1, counted.n + 1):
        w = rank_writer(tmp_path / f"{k}.zarr")
        with warnings.catch_warnings(), pytest.raises(KeyboardInterrupt):
            warnings.simplefilter("ignore")
            with _InterruptInFunction(W.__file__, ("close",), k):
                w.close()
        w.close()  # (again: the interrupted close is finished)
        _same_store(w.path, want.path)


@pytest.mark.parametrize("where", [("close", "self._stop_threads()"), ("_commit_now", "self._drop_unlisted_parts()")],
                         ids=["before-commit", "after-root"])
def test_consolidate_of_a_rank_store_whose_close_ctrl_c_cut_short_waits_for_that_close(tmp_path, capsys, where):
    # a rank store of its own (RankStore, no process group) whose close a Ctrl-C cut short is held
    # by its writer until that close is called again: `activationscope consolidate` said only to
    # wait for it to finish, which it never would, or, the Ctrl-C coming after the rank store's
    # root was written, committed the rank stores and removed that one from under its writer.
    # Now it is refused, naming the close to call again; once it is, the consolidate commits
    # every row
    from activationscope import cli
    from activationscope.store import writer as W
    from activationscope.store.ranks import open_capture_writer

    data = torch.randn(24, 8, generator=torch.Generator().manual_seed(0))

    def task(path, t):
        w = open_capture_writer(str(path), process_group=acs.RankStore(t, 2), chunk_rows=4, shard_rows=8,
                                commit_interval=0)
        arr = w.open_array("x", (8,), torch.float32, "sample")
        for s in range(12 * t, 12 * t + 12, 6):
            arr.append(data[s:s + 6])
            w.add_batch(6, list(range(s, s + 6)))
        return w

    want, path = tmp_path / "want.zarr", tmp_path / "s.zarr"
    for t in (0, 1):
        task(want, t).close()
    assert cli.main(["consolidate", str(want)]) == 0
    task(path, 0).close()
    w, at = task(path, 1), _InterruptAtLine(W.__file__, *where, 1)
    with warnings.catch_warnings(), pytest.raises(KeyboardInterrupt):
        warnings.simplefilter("ignore")
        with at:
            w.close()
    assert at.raised
    capsys.readouterr()
    assert cli.main(["consolidate", str(path)]) == 1
    err = capsys.readouterr().err
    assert f"rank 1 store {str(path / 'ranks' / '00001')!r} is still being written" in err, err
    assert "close() or tracker.remove() is called again in that process" in err and "nothing was written" in err, err
    assert (path / "ranks" / "00001" / "zarr.json").exists() and not (path / "acts").exists()
    w.close()  # (again)
    assert cli.main(["consolidate", str(path)]) == 0
    _same_store(path, want)


@pytest.mark.parametrize("stop", [False, True], ids=["ended", "raised"])
def test_ctrl_c_in_the_commit_of_a_with_blocks_close_keeps_every_row(tmp_path, monkeypatch, stop):
    # a Ctrl-C in the commit of the store's close as the `with` block ends (its loop done, or
    # stopped by a first Ctrl-C): the writer kept the rows it had flushed, for close() called
    # again to commit them, but the tracker gave that close up at once, so a new store with no
    # earlier commit was removed, every forward lost (resume=True captured them all again), and
    # neither tracker.remove() nor tracker.writer.close() could commit them any more. Now the
    # tracker finishes the close as close() called again does; the Ctrl-C still goes on
    from activationscope.store import _backend as B
    from activationscope.store import writer as W
    from activationscope.store._lock import writer_holding

    model = toy_mlp(depth=1)
    xs = torch.randn(3, 2, 16)
    with torch.no_grad():
        want = torch.cat([model(x) for x in xs])
    fired = _interrupt_once(monkeypatch, W.StoreWriter, "_commit_now", lambda self, *_: self._closed)
    path = tmp_path / "s.zarr"
    with warnings.catch_warnings(record=True) as caught, pytest.raises(KeyboardInterrupt):
        warnings.simplefilter("always")
        _store_cell(model, xs, path, stop or None)
    assert fired and not _wrapped(model)
    assert not [str(w.message) for w in caught if "could not be fully committed" in str(w.message)]
    assert writer_holding(B.resolve(str(path))) is None
    store = acs.open_store(path)
    # (raised: the Ctrl-C in the loop came after the first forward)
    assert store.status == ("incomplete" if stop else "complete")
    assert torch.equal(store["1.output"], want[:2] if stop else want)
    _store_cell(model, xs, path, resume=True)
    store = acs.open_store(path)
    assert store.status == "complete" and torch.equal(store["1.output"], want)
    assert store.row_table("sample")["sample_id"].to_pylist() == list(range(6))


@pytest.mark.parametrize("stop", [False, True], ids=["ended", "raised"])
def test_a_with_blocks_close_failing_as_the_tracker_finishes_it_after_a_ctrl_c_says_why(tmp_path, monkeypatch,
                                                                                         stop):
    # a Ctrl-C cut short the commit of the store's close as the `with` block ended, and the
    # tracker's second try at that close failed (a full disk): the KeyboardInterrupt went on
    # alone, the failure said nowhere, as if the close had been finished with every forward. Now
    # that failure is raised, as a close that fails raises it (the body raised: named in the
    # warning that the store could not be fully committed)
    from activationscope.errors import StoreError
    from activationscope.store import writer as W

    model = toy_mlp(depth=1)
    xs = torch.randn(3, 2, 16)
    real, n = W.StoreWriter._commit_now, []

    def failing(self, *args, **kwargs):
        if self._closed and len(n) < 2:
            n.append(True)
            if len(n) == 1:
                raise KeyboardInterrupt("commit")
            raise StoreError("writing 'zarr.json' failed: No space left on device (ENOSPC)")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(W.StoreWriter, "_commit_now", failing)
    path = tmp_path / "s.zarr"
    with warnings.catch_warnings(record=True) as caught, pytest.raises(BaseException) as err:
        warnings.simplefilter("always")
        _store_cell(model, xs, path, stop or None)
    assert isinstance(err.value, KeyboardInterrupt if stop else StoreError), repr(err.value)
    assert len(n) == 2 and not _wrapped(model)
    said = str(err.value) + " ".join(str(w.message) for w in caught if "fully committed" in str(w.message))
    assert "No space left on device" in said, said
    _store_cell(model, xs, path, **({"resume": True} if path.exists() else {}))
    assert acs.open_store(path).status == "complete" and acs.open_store(path).n_samples == 6


def test_ctrl_c_again_as_a_with_blocks_close_is_finished_leaves_the_last_commit(tmp_path, monkeypatch):
    # the tracker's second try at the close cut short too: the close is given up as before, the
    # store at its last commit (a new store with none removed), and the cell runs again as it is
    from activationscope.store import writer as W

    model = toy_mlp(depth=1)
    xs = torch.randn(3, 2, 16)
    real, n = W.StoreWriter._commit_now, []

    def interrupted(self, *args, **kwargs):
        if self._closed and len(n) < 2:
            n.append(True)
            raise KeyboardInterrupt("commit")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(W.StoreWriter, "_commit_now", interrupted)
    path = tmp_path / "s.zarr"
    with warnings.catch_warnings(), pytest.raises(KeyboardInterrupt):
        warnings.simplefilter("ignore")
        _store_cell(model, xs, path)
    assert len(n) == 2 and not _wrapped(model) and not path.exists()
    _store_cell(model, xs, path)
    assert acs.open_store(path).status == "complete" and acs.open_store(path).n_samples == 6
