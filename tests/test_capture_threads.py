"""Threads and exceptions in the capture's bookkeeping: records are exact per call or the
call fails with CaptureError, never shared or miscounted; a start callback that raises
leaves names and counts intact. Reference: the modules called in plain PyTorch."""

from __future__ import annotations

import threading
import time
import warnings

import pytest
import torch

from activationscope import ActivationScope, CaptureError


def _mlp(width=64):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, width))


def _run_threads(fn, n_threads):
    errors: list[BaseException] = []

    def body(i):
        try:
            fn(i)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=body, args=(i,)) for i in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


def _assert_same_multiset(records, refs):
    assert len(records) == len(refs)
    left = list(refs)
    for r in records:
        hit = next((i for i, ref in enumerate(left) if torch.equal(r, ref)), None)
        assert hit is not None, "a record matches no plain-PyTorch output"
        left.pop(hit)


@pytest.mark.parametrize("n_threads", [2, 4])
def test_concurrent_root_forwards_are_exact_or_capture_errors(n_threads):
    m = _mlp()
    inputs = {i: [torch.randn(8, 64) for _ in range(25)] for i in range(n_threads)}
    done: dict[int, list[torch.Tensor]] = {i: [] for i in range(n_threads)}
    refused = []

    def work(i):
        for x in inputs[i]:
            try:
                m(x)
                done[i].append(x)
            except CaptureError as e:
                assert "called from one thread while the tracked model runs a forward in another" in str(e)
                refused.append(e)

    with torch.no_grad(), ActivationScope().track(m) as t:
        errors = _run_threads(work, n_threads)
    assert errors == []
    ok = [x for xs in done.values() for x in xs]
    assert len(ok) + len(refused) == 25 * n_threads
    assert t.n_forwards == len(ok)
    acts = t.activations
    assert sorted(acts) == ["0.output", "1.output", "2.output"]  # no '#1' names from interleaving
    with torch.no_grad():
        _assert_same_multiset(acts["0.output"], [m[0](x) for x in ok])
        _assert_same_multiset(acts["2.output"], [m(x) for x in ok])
    ptrs = [r.data_ptr() for rs in acts.values() for r in rs]
    assert len(set(ptrs)) == len(ptrs)


@pytest.mark.parametrize("n_threads", [2, 4])
def test_threads_calling_tracked_submodules_outside_a_forward_are_exact(n_threads):
    # no root forward runs: every call is its own capture, from several threads at once,
    # through one staging arena
    m = _mlp(256)
    inputs = {i: [torch.randn(16, 256) for _ in range(40)] for i in range(n_threads)}

    def work(i):
        for x in inputs[i]:
            m[0](x)

    with torch.no_grad(), ActivationScope().track(m, include=["0"]) as t:
        assert _run_threads(work, n_threads) == []
    recs = t.activations["0.output"]
    with torch.no_grad():
        _assert_same_multiset(recs, [m[0](x) for xs in inputs.values() for x in xs])
    ptrs = [r.data_ptr() for r in recs]
    assert len(set(ptrs)) == len(ptrs)
    assert all(r.untyped_storage().nbytes() == r.nbytes for r in recs)


@pytest.mark.parametrize("n_threads", [2, 4])
def test_threads_meeting_a_new_hook_point_at_once_share_one_sink(n_threads):
    # every thread calls the tracked submodule for the first time at once: each finds no sink
    # for its hook point and asks the tracker for one; the tracker's callback runs Python, so
    # the threads interleave inside it. The records of all of them must land in the sink the
    # tracker lists (here the callback is slowed down so that they always interleave).
    m = _mlp(32)
    inputs = {i: [torch.randn(4, 32) for _ in range(3)] for i in range(n_threads)}
    barrier = threading.Barrier(n_threads)

    def work(i):
        barrier.wait()
        for x in inputs[i]:
            m[0](x)

    with torch.no_grad(), ActivationScope().track(m, include=["0"]) as t:
        made = t._core.on_new_hook_point

        def slow(name, tensor):
            time.sleep(0.05)  # releases the GIL: another thread enters meanwhile
            return made(name, tensor)

        t._core.on_new_hook_point = slow
        assert _run_threads(work, n_threads) == []
    recs = t.activations["0.output"]
    with torch.no_grad():
        _assert_same_multiset(recs, [m[0](x) for xs in inputs.values() for x in xs])


def test_concurrent_forwards_into_a_store_keep_it_consistent(tmp_path):
    from activationscope import open_store

    m = _mlp()
    inputs = {i: [torch.randn(4, 64) for _ in range(15)] for i in range(3)}
    done = []
    lock = threading.Lock()

    def work(i):
        for x in inputs[i]:
            try:
                m(x)
                with lock:
                    done.append(x)
            except CaptureError:
                pass

    with torch.no_grad(), ActivationScope(store=tmp_path / "s.zarr").track(m):
        assert _run_threads(work, 3) == []
    s = open_store(tmp_path / "s.zarr")
    assert s.status == "complete" and s.n_samples == 4 * len(done)
    rows = s["2.output"][:]
    with torch.no_grad():
        _assert_same_multiset(list(rows.split(4)), [m(x) for x in done])


# ---------------------------------------------------------------- exception-safe bookkeeping


def test_issue_input_start_callback_raises():
    m = _mlp(8)
    x = torch.randn(3, 8)
    with torch.no_grad():
        t = ActivationScope().track(m).attach()
        good = t._core.on_forward_start

        def boom():
            raise RuntimeError("boom")

        t._core.on_forward_start = boom
        for _ in range(2):
            with pytest.raises(RuntimeError, match="boom"):
                m(x)
        t._core.on_forward_start = good
        m(x)
        m(x + 1)
        t.remove()
        assert t.n_forwards == 2
        acts = t.activations
        assert sorted(acts) == ["0.output", "1.output", "2.output"]  # no '#1', '#2'
        torch.testing.assert_close(acts["2.output"][1], m(x + 1), rtol=0, atol=0)
        assert len(acts["0.output"]) == 2


def test_warning_turned_error_in_the_start_callback():
    # a forward raises and is caught inside the capture; with warnings as errors the next
    # forward's start raises that warning: later forwards are still named and counted right
    class Fails(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)
            self.fail = True

        def forward(self, x):
            y = self.lin(x)
            if self.fail:
                raise ValueError("bad batch")
            return y

    m = Fails()
    x = torch.randn(2, 4)
    with torch.no_grad(), ActivationScope().track(m) as t:
        with pytest.raises(ValueError):
            m(x)
        m.fail = False
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            with pytest.raises(RuntimeWarning, match="raised and the exception was caught"):
                m(x)
        m(x)
        m(x)
    assert sorted(t.activations) == ["lin.output"]
    assert t.n_forwards == 3  # the failed one and the two whole ones; not the refused one
    assert len(t.activations["lin.output"]) == 3
    torch.testing.assert_close(t.activations["lin.output"][-1], m.lin(x), rtol=0, atol=0)


# ---------------------------------------------------------------- reads and closes under threads


@pytest.mark.parametrize("op", ["activations", "reductions", "clear"])
def test_reading_or_clearing_while_a_thread_meets_a_new_hook_point(op):
    # tracker.activations / .reductions / .clear() go over the tracker's hook points while
    # another thread's call adds one: they must not fail ("dictionary changed size during
    # iteration"); they see the hook points before or after the new one, each whole.
    m = _mlp(8)
    x, y = torch.randn(2, 8), torch.randn(3, 8)
    entered, inserted = threading.Event(), threading.Event()

    class PausingDict(dict):  # the reader pauses inside its iteration until the writer went on
        def _pause(self, it):
            yield next(it)
            if not entered.is_set():
                entered.set()
                inserted.wait(0.3)
            yield from it

        def items(self):
            return self._pause(iter(dict.items(self)))

        def values(self):
            return self._pause(iter(dict.values(self)))

    with torch.no_grad(), ActivationScope(reductions=["mean"]).track(m, include=["0", "1", "2"]) as t:
        m[0](x)
        m[2](x)
        made = t._core.on_new_hook_point

        def slow(name, tensor):  # '1.output', new in the forward of the writer thread
            entered.wait(2)
            try:
                return made(name, tensor)
            finally:
                inserted.set()

        t._core.on_new_hook_point = slow
        for attr in ("_sinks", "_reduction_names"):
            setattr(t, attr, PausingDict(getattr(t, attr)))
        reads = []

        def read(i):
            reads.append(getattr(t, op)() if op == "clear" else getattr(t, op))

        writer = threading.Thread(target=lambda: m(y))
        writer.start()
        errors = _run_threads(read, 1)
        writer.join()
    assert errors == []
    acts = t.activations
    with torch.no_grad():
        # (the writer's forward captured module 0 before it met '1.output')
        # (records are read as they are when each hook point is read: the writer may have gone
        # on to module 2 meanwhile)
        both = [m[0](x), m[0](y)]
        if op == "activations":
            assert sorted(reads[0]) == ["0.output", "2.output"]
            _assert_same_multiset(reads[0]["0.output"], both)
            torch.testing.assert_close(reads[0]["2.output"][0], m[2](x), rtol=0, atol=0)
            assert len(reads[0]["2.output"]) in (1, 2)
        if op == "reductions":
            torch.testing.assert_close(reads[0]["0.output"]["mean"], torch.cat(both).double().mean(0))
        if op == "clear":  # cleared while the writer was at module 1: its later records may be kept
            assert acts["0.output"] == []
            assert len(acts["2.output"]) <= 1
            if acts["2.output"]:
                torch.testing.assert_close(acts["2.output"][0], m(y), rtol=0, atol=0)
        else:
            _assert_same_multiset(acts["0.output"], both)
            assert len(acts["2.output"]) == 2
        torch.testing.assert_close(acts["1.output"][0], m[1](m[0](y)), rtol=0, atol=0)
        torch.testing.assert_close(t.reductions["1.output"]["mean"], m[1](m[0](y)).double().mean(0))


def _gate_model():
    # 0: a Linear whose forward, called from the thread named "outside", waits for `ev["go"]`;
    # 1: a module that, in a root forward, says the forward is open and waits for `ev["hold"]`
    ev = {"open": threading.Event(), "go": threading.Event(), "hold": threading.Event(), "entered": threading.Event()}

    class Gate(torch.nn.Linear):
        def forward(self, x):
            if threading.current_thread().name == "outside":
                ev["entered"].set()
                ev["go"].wait(2)
            return super().forward(x)

    class Hold(torch.nn.Module):
        def forward(self, x):
            ev["open"].set()
            ev["hold"].wait(2)
            return x

    torch.manual_seed(0)
    return torch.nn.Sequential(Gate(4, 4), Hold(), torch.nn.Linear(4, 4)), ev


@pytest.mark.parametrize("stop_after_last", [False, True])
def test_outside_call_that_ends_inside_another_threads_forward_is_its_own_capture(stop_after_last):
    # a tracked submodule called on its own in one thread returns while another thread runs a
    # root forward that already captured that submodule: the outside call is its own capture
    # (it was not in the forward), and the forward's capture is whole
    m, ev = _gate_model()
    x, y = torch.randn(2, 4), torch.randn(3, 4)
    got = {}

    def outside():
        got["y"] = m[0](y)
        ev["hold"].set()

    def release():
        ev["open"].wait(2)  # the root forward captured 0 and waits in Hold
        ev["go"].set()  # the outside call returns now, inside the forward's span

    with torch.no_grad(), ActivationScope().track(m, include=["0", "2"], stop_after_last=stop_after_last) as t:
        th = threading.Thread(target=outside, name="outside")
        th.start()
        ev["entered"].wait(2)  # the outside call runs (before the forward starts)
        helper = threading.Thread(target=release)
        helper.start()
        out = m(x)
        helper.join()
        th.join()
        ev["open"].clear(), ev["go"].clear(), ev["hold"].set()
        out2 = m(x + 1)  # (stop_after_last: learnt from the first forward)
    with torch.no_grad():
        ref0, ref2 = m[0](x), m(x)
        torch.testing.assert_close(got["y"], m[0](y), rtol=0, atol=0)
    assert (out is None) == stop_after_last and (out2 is None) == stop_after_last
    acts = t.activations
    assert sorted(acts) == ["0.output", "2.output"]
    assert len(acts["0.output"]) == 3 and len(acts["2.output"]) == 2
    _assert_same_multiset(acts["0.output"][:2], [ref0, m[0](y).detach()])
    torch.testing.assert_close(acts["2.output"][0], ref2, rtol=0, atol=0)
    assert t.n_forwards == 2


def test_outside_call_that_starts_before_another_threads_forward_reaches_it():
    # the outside call returns while the forward is open but before the forward called that
    # submodule: the forward's own call of it is captured too (no 'two tensors' refusal)
    m, ev = _gate_model()
    x, y = torch.randn(2, 4), torch.randn(3, 4)

    class First(torch.nn.Module):  # the root forward is open here, before module 0
        def forward(self, x):
            ev["go"].set()
            ev["back"].wait(2)
            return x

    ev["back"] = threading.Event()
    m = torch.nn.Sequential(First(), *m)
    got = {}

    def outside():
        got["y"] = m[1](y)
        ev["back"].set()

    ev["hold"].set()
    with torch.no_grad(), ActivationScope().track(m, include=["1", "3"]) as t:
        th = threading.Thread(target=outside, name="outside")
        th.start()
        ev["entered"].wait(2)  # the outside call runs (before the forward starts)
        out = m(x)
        th.join()
    with torch.no_grad():
        torch.testing.assert_close(out, m(x), rtol=0, atol=0)
        _assert_same_multiset(t.activations["1.output"], [m[1](x), m[1](y)])
        torch.testing.assert_close(t.activations["3.output"][0], m(x), rtol=0, atol=0)


def test_close_waits_for_a_forward_running_in_another_thread():
    # the `with` block ends while another thread is inside a forward: the close waits for it,
    # and its capture is whole (before: the wrappers went away under it, and the forward
    # failed with "'NoneType' object is not callable" at its next new hook point)
    m, ev = _gate_model()
    x = torch.randn(2, 4)
    outs, errors = [], []

    def run():
        try:
            outs.append(m(x))
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    with torch.no_grad():
        with ActivationScope().track(m) as t:
            th = threading.Thread(target=run)
            th.start()
            ev["open"].wait(2)
            threading.Timer(0.1, ev["hold"].set).start()
        th.join()
        assert errors == []
        acts = t.activations
        assert sorted(acts) == ["0.output", "1.output", "2.output"]
        torch.testing.assert_close(acts["2.output"][0], m(x), rtol=0, atol=0)
        torch.testing.assert_close(outs[0], m(x), rtol=0, atol=0)
        assert t.n_forwards == 1


def test_close_that_gives_up_waiting_fails_the_forward_it_left(monkeypatch):
    from activationscope.capture import scope as scope_module

    monkeypatch.setattr(scope_module, "_CLOSE_WAIT_S", 0.1)
    m, ev = _gate_model()
    x = torch.randn(2, 4)
    errors = []

    def run():
        try:
            m(x)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    with torch.no_grad():
        t = ActivationScope().track(m)
        th = threading.Thread(target=run)
        with pytest.raises(CaptureError, match="still ran in other threads"), warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            with t:
                th.start()
                ev["open"].wait(2)
        ev["hold"].set()
        th.join()
    # the forward left running did not raise: no warning says it did (the error covers it)
    assert not [x for x in w if "raised" in str(x.message)], [str(x.message) for x in w]
    assert len(errors) == 1 and isinstance(errors[0], CaptureError)
    assert "was closed" in str(errors[0]) and "another thread" in str(errors[0])
    assert "forward" not in m.__dict__ and "forward" not in m[2].__dict__  # wrappers removed
    torch.testing.assert_close(m(x), m[2](m[0](x)))


def test_root_forward_of_a_second_thread_while_the_first_reads_its_input():
    # the first thread's root forward reads its input (Python code: the thread can switch
    # there): a second thread's root forward started then is refused, never nested into it
    m = _mlp(8)
    x, y = torch.randn(2, 8), torch.randn(3, 8)
    reading, second_done, first_done = threading.Event(), threading.Event(), threading.Event()

    class Batch(list):  # a list whose attribute lookups run Python (as a user's batch type can)
        def __getattr__(self, name):
            if threading.current_thread() is threading.main_thread():
                reading.set()
                second_done.wait(2)
            raise AttributeError(name)

    errors = []

    def second():
        root(Batch([y]))  # this thread runs the last forward before the main thread's
        first_done.set()
        reading.wait(2)
        try:
            root(Batch([y]))
        except CaptureError as e:
            errors.append(e)
        finally:
            second_done.set()

    class Takes(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body = m

        def forward(self, batch):
            return self.body(batch[0])

    root = Takes()
    with torch.no_grad(), ActivationScope().track(root) as t:
        th = threading.Thread(target=second)
        th.start()
        first_done.wait(2)
        out = root(Batch([x]))
        th.join()
    assert len(errors) == 1 and "called from one thread while the tracked model runs a forward" in str(errors[0])
    acts = t.activations
    assert sorted(acts) == ["body.0.output", "body.1.output", "body.2.output", "body.output"]
    with torch.no_grad():
        torch.testing.assert_close(acts["body.output"][0], m(y), rtol=0, atol=0)
        torch.testing.assert_close(acts["body.output"][1], m(x), rtol=0, atol=0)
        torch.testing.assert_close(out, m(x), rtol=0, atol=0)
    assert t.n_forwards == 2 and all(len(v) == 2 for v in acts.values())


_DEADLOCK_SCRIPT = r"""
import threading, time, warnings
import torch
from activationscope import ActivationScope
warnings.simplefilter("ignore")
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4))
entered = threading.Event()
def slow_sum(acc, x):  # not TorchScript (threading): an eager Python reduction
    if threading.current_thread().name == "outside":
        entered.set()
        time.sleep(0.2)  # the GIL goes to the main thread, the sink's lock stays held
    s = x.sum(0)
    return s if acc is None else acc + s
x, y = torch.randn(2, 4), torch.randn(3, 4)
with torch.no_grad(), ActivationScope(reductions={"0.output": [slow_sum]}).track(m, include=["0"]) as t:
    th = threading.Thread(target=lambda: m[0](y), name="outside")
    th.start()
    entered.wait(5)
    m(x)  # its start stops watching '0.output' (first seen since the last forward): the sink's lock
    th.join()
with torch.no_grad():
    ref = m[0](y).sum(0) + m[0](x).sum(0)
torch.testing.assert_close(t.reductions["0.output"]["slow_sum"], ref)
print("OK")
"""


def test_python_reduction_in_an_outside_call_does_not_deadlock_a_root_forward():
    # a thread's outside call runs an eager (Python) reduction: it holds its hook point's sink
    # lock and takes the GIL in turn; a root forward started meanwhile by another thread took
    # that lock with the GIL held, and both waited for ever
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _DEADLOCK_SCRIPT], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and out.stdout.strip().endswith("OK"), out.stderr[-2000:]


def test_alias_target_module_called_on_its_own_is_not_shown_in_the_alias():
    # '0.output' is kept as an alias of '0.0.output' (the container returns its child's
    # tensor): in memory it shares the child's records for the calls where it got that
    # tensor. The child called on its own adds records the container never had: they stay
    # out of the container's records, and the next forward is recorded as usual.
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(4, 4)), torch.nn.ReLU())
    x, y = torch.randn(2, 4), torch.randn(3, 4)
    with torch.no_grad():
        refs = [m[0](x), m[0](y), m[0][0](x + 1), m[0](x + 2), m[0][0](x + 3)]
    with torch.no_grad(), ActivationScope().track(m, include=["0", "0.0"]) as t:
        m(x)
        m[0](y)  # the container on its own: its child too, so the pair stays whole
        assert t._aliases == {"0.output": "0.0.output"}
        m[0][0](x + 1)  # the child alone: not a call of the container
        m(x + 2)
        m[0][0](x + 3)
    assert t.n_forwards == 2
    acts = t.activations
    assert len(acts["0.output"]) == 3 and len(acts["0.0.output"]) == 5
    for got, ref in zip(acts["0.output"], [refs[0], refs[1], refs[3]]):
        torch.testing.assert_close(got, ref, rtol=0, atol=0)
    for got, ref in zip(acts["0.0.output"], refs):
        torch.testing.assert_close(got, ref, rtol=0, atol=0)
    assert acts["0.output"][2].data_ptr() == acts["0.0.output"][3].data_ptr()  # kept once


def test_reductions_read_while_another_thread_updates_them_are_whole_batches():
    # a reduction's update in one thread and a read of `tracker.reductions` in another: the
    # read sees the state before or after the batch, never half of it (here an eager
    # reduction updates its accumulator in two steps, sleeping between them)
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 4))
    xs = [torch.randn(2, 4), torch.randn(3, 4)]
    entered = threading.Event()

    def two_step_sum(acc, x):  # not TorchScript (threading): an eager Python reduction
        s = x.sum(0)
        if acc is None:
            return s
        acc[:2].add_(s[:2])
        if threading.current_thread().name == "capture":
            entered.set()
            time.sleep(0.2)  # the GIL goes to the reading thread meanwhile
        acc[2:].add_(s[2:])
        return acc

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        scope = ActivationScope(reductions={"0.output": [two_step_sum]})
    with torch.no_grad(), scope.track(m) as t:
        th = threading.Thread(target=lambda: [m(x) for x in xs], name="capture")
        th.start()
        assert entered.wait(5)
        read = t.reductions["0.output"]["two_step_sum"].clone()  # (as it is now)
        th.join(10)
    with torch.no_grad():
        ref = m(xs[0]).sum(0) + m(xs[1]).sum(0)
    torch.testing.assert_close(read, ref)
    torch.testing.assert_close(t.reductions["0.output"]["two_step_sum"], ref)


def test_close_reads_made_nonfinite_of_a_reduction_a_left_forward_still_updates(monkeypatch):
    # The close gives up waiting for a forward of another thread that is inside a custom
    # reduction's update (an eager one, sleeping before it returns -inf made of finite rows):
    # its NaN-or-inf check reads the reduction's flags under the hook point's lock
    # (Sink.reduction_made_nonfinite), so that update ends first, and the close warns as after
    # a forward that ended.
    from activationscope.capture import scope as scope_module

    monkeypatch.setattr(scope_module, "_CLOSE_WAIT_S", 0.1)
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(3, 3))
    x = torch.randn(2, 3)
    entered = threading.Event()
    errors = []

    def log_of_zeros(acc, x):  # not TorchScript (threading): an eager Python reduction
        if threading.current_thread().name == "capture":
            entered.set()
            time.sleep(1.0)  # the close runs meanwhile
        s = (x * 0.0).abs().log().sum(0)  # -inf of finite rows
        return s if acc is None else acc + s

    def run():
        try:
            m(x)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        scope = ActivationScope(reductions={"0.output": [log_of_zeros]})
    th = threading.Thread(target=run, name="capture")
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(CaptureError, match="still ran in other threads"):
            with scope.track(m):
                th.start()
                assert entered.wait(5)
        th.join(10)
    assert len(errors) == 1 and isinstance(errors[0], CaptureError) and "was closed" in str(errors[0])
    messages = [str(w.message) for w in caught if "whose result holds NaN or inf" in str(w.message)]
    assert len(messages) == 1, [str(w.message) for w in caught]
    assert messages[0].startswith("custom reduction(s) whose result holds NaN or inf made of finite rows: "
                                  "'log_of_zeros' of hook point '0.output' (3 of 3 values NaN or inf). ")
