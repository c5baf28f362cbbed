"""Several trackers open at once in one process: on two models, on a submodule two models
share, and in threads of their own. Each capture holds its own model's forwards, equal to a
plain-PyTorch reference (forward hooks recording clones), or the combination is refused with
CaptureError before anything is written."""

from __future__ import annotations

import copy
import threading

import pytest
import torch

from activationscope import ActivationScope, CaptureError, open_store

from acs_testing import plain_hooks


def _mlp(seed=0, width=8):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(width, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _reference(model, xs):
    """{'<module>.output': rows of every call in order} of the submodules of `model`, by
    plain forward hooks."""
    out, _ = plain_hooks(model, lambda: [model(x) for x in xs])
    return {k: torch.cat(v) for k, v in out.items()}


def _in_thread(fn):
    errors: list[BaseException] = []

    def body():
        try:
            fn()
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    th = threading.Thread(target=body, name="other")
    th.start()
    th.join(60)
    return errors


def _assert_store_equals(path, ref):
    s = open_store(path)
    assert s.status == "complete"
    assert sorted(s.hook_points) == sorted(ref)
    for k, v in ref.items():
        torch.testing.assert_close(s[k], v, rtol=0, atol=0)


def test_a_thread_tracking_a_model_another_thread_tracks_is_refused_and_writes_nothing(tmp_path):
    # each thread with its own tracker of one model: every forward, from either thread, was
    # captured by both trackers, so one thread's rows went into the other's store under that
    # thread's sample ids, without an error
    m = _mlp()
    xs, ys = [torch.randn(5, 8) for _ in range(2)], [torch.randn(5, 8) + 10 for _ in range(2)]

    def other():
        with torch.no_grad(), ActivationScope(store=tmp_path / "b.zarr").track(m) as t:
            for y in ys:
                t.set_batch(label=[1] * 5)
                m(y)

    with torch.no_grad(), ActivationScope(store=tmp_path / "a.zarr").track(m) as t:
        t.set_batch(label=[0] * 5)
        m(xs[0])
        errors = _in_thread(other)
        t.set_batch(label=[0] * 5)
        m(xs[1])
    assert len(errors) == 1 and isinstance(errors[0], CaptureError)
    msg = str(errors[0])
    assert "thread 'other'" in msg and "same model" in msg and "MainThread" in msg and "copy.deepcopy" in msg
    assert not (tmp_path / "b.zarr").exists()  # refused before the store was made
    assert "forward" not in m.__dict__ and not any("forward" in c.__dict__ for c in m)
    _assert_store_equals(tmp_path / "a.zarr", _reference(m, xs))
    # once the first tracker is gone, the other thread tracks the model (or its own copy at any time)
    assert _in_thread(other) == []
    _assert_store_equals(tmp_path / "b.zarr", _reference(m, ys))
    assert open_store(tmp_path / "b.zarr").row_table("sample").column("label").to_pylist() == [1] * 10


def test_a_submodule_shared_with_a_model_another_thread_tracks_is_refused():
    shared = torch.nn.Linear(8, 8)
    a = torch.nn.Sequential(shared, torch.nn.ReLU())
    b = torch.nn.Sequential(torch.nn.Tanh(), shared)

    def other():
        with ActivationScope().track(b):
            pass

    with ActivationScope().track(a):
        errors = _in_thread(other)
    assert len(errors) == 1 and isinstance(errors[0], CaptureError)
    assert "module '1' of Sequential is also tracked by a tracker of Sequential" in str(errors[0])
    assert "forward" not in shared.__dict__ and "forward" not in b.__dict__
    assert _in_thread(other) == []  # not shared with a tracker any more


@pytest.mark.parametrize("first", ["submodule", "model"])
def test_a_model_and_its_submodule_tracked_in_two_threads_is_refused(tmp_path, first):
    # one thread tracked m.0 alone while another tracked m (only m.2 selected: m.0 not wrapped
    # by its tracker): every forward of m, from the other thread, called m.0 and was recorded
    # by the first thread's tracker as a forward of its own, the other thread's rows in its
    # store, without an error
    m = _mlp()
    sub = m[0]
    trackers = {"submodule": lambda: ActivationScope(store=tmp_path / "sub.zarr").track(sub),
                "model": lambda: ActivationScope(store=tmp_path / "m.zarr").track(m, include=["2"])}
    second = "model" if first == "submodule" else "submodule"

    def other():
        with torch.no_grad(), trackers[second]():
            m(torch.randn(3, 8))

    xs = [torch.randn(5, 8)]
    with torch.no_grad(), trackers[first]() as t:
        errors = _in_thread(other)
        (sub if first == "submodule" else m)(xs[0])
    assert len(errors) == 1 and isinstance(errors[0], CaptureError)
    msg = str(errors[0])
    assert "thread 'other'" in msg and "MainThread" in msg and "copy.deepcopy" in msg
    if second == "model":
        assert "module '0' of Sequential is also tracked by a tracker of Linear" in msg
    else:
        assert "Linear itself is also a module of the model of a tracker of Sequential" in msg
    assert not (tmp_path / f"{'m' if second == 'model' else 'sub'}.zarr").exists()  # nothing written
    assert "forward" not in m.__dict__ and not any("forward" in c.__dict__ for c in m)
    if first == "submodule":  # the first thread's store holds its own forward only
        s = open_store(tmp_path / "sub.zarr")
        assert s.n_samples == 5
        torch.testing.assert_close(s["output"], sub(xs[0]).detach(), rtol=0, atol=0)
    else:
        _assert_store_equals(tmp_path / "m.zarr", {"2.output": _reference(m, xs)["2.output"]})
    del t


@pytest.mark.parametrize("store", [False, True])
def test_a_submodule_shared_by_two_models_records_each_models_own_calls(tmp_path, store):
    # in memory, the tracker of b also recorded the shared module's calls in a's forwards (as
    # calls on their own): b's records of it were twice as many as b's forwards, interleaved
    shared = torch.nn.Linear(8, 8)
    a = torch.nn.Sequential(shared, torch.nn.ReLU())
    b = torch.nn.Sequential(torch.nn.Tanh(), shared)
    xs = [torch.randn(5, 8) for _ in range(3)]
    ref_a, ref_b = _reference(a, xs), _reference(b, [x * 3 for x in xs])
    scope_a = ActivationScope(store=tmp_path / "a.zarr" if store else None)
    scope_b = ActivationScope(store=tmp_path / "b.zarr" if store else None)
    with torch.no_grad(), scope_a.track(a) as ta, scope_b.track(b) as tb:
        for x in xs:
            a(x)
            b(x * 3)
    if store:
        _assert_store_equals(tmp_path / "a.zarr", ref_a)
        _assert_store_equals(tmp_path / "b.zarr", ref_b)
        return
    for t, ref in ((ta, ref_a), (tb, ref_b)):
        acts = t.activations
        assert sorted(acts) == sorted(ref)
        for k, v in ref.items():
            assert len(acts[k]) == 3, k
            torch.testing.assert_close(torch.cat(acts[k]), v, rtol=0, atol=0)


def test_threads_each_tracking_a_model_of_their_own_equal_plain_pytorch(tmp_path):
    models = [_mlp(0, 32), _mlp(1, 32)]
    models.append(copy.deepcopy(models[0]))  # a copy per thread: its own modules
    xss = [[torch.randn(16, 32) + i for _ in range(40)] for i in range(3)]
    refs = [_reference(m, xs) for m, xs in zip(models, xss)]
    barrier = threading.Barrier(3, timeout=30)
    errors: list[BaseException] = []

    def work(i):
        try:
            scope = ActivationScope(store=tmp_path / f"{i}.zarr", reductions=["mean"],
                                    store_options={"chunk_rows": 8, "shard_bytes": 1 << 12})
            with torch.no_grad(), scope.track(models[i]) as t:
                barrier.wait()
                for k, x in enumerate(xss[i]):
                    t.set_batch(sample_ids=list(range(1000 * i + 16 * k, 1000 * i + 16 * k + 16)))
                    models[i](x)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(3)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(120)
    assert errors == []
    for i, ref in enumerate(refs):
        _assert_store_equals(tmp_path / f"{i}.zarr", ref)
        s = open_store(tmp_path / f"{i}.zarr")
        assert s.row_table("sample").column("sample_id").to_pylist() == list(range(1000 * i, 1000 * i + 640))
        for k, v in ref.items():
            torch.testing.assert_close(s.reductions[k]["mean"], v.double().mean(0))


@pytest.mark.parametrize("how", ["remove", "exit"])
@pytest.mark.parametrize("store", [False, True])
def test_closing_a_tracker_inside_a_forward_of_its_model_is_refused_and_the_capture_goes_on(tmp_path, how, store):
    # a forward hook closed the tracker of the model it runs in: the forward then failed with
    # "closed ... while this call ran in another thread" (it was this thread), and the close
    # called the forward one that raised (a store: removed as holding no whole forward)
    m = _mlp()
    xs = [torch.randn(5, 8) for _ in range(2)]
    ref = _reference(m, xs)
    t = ActivationScope(store=tmp_path / "s.zarr" if store else None).track(m)
    refused = []

    def close_it(_module, _args, _out):
        if not refused:
            try:
                t.remove() if how == "remove" else t.__exit__(None, None, None)
            except CaptureError as e:
                refused.append(e)

    handle = m[1].register_forward_hook(close_it)
    try:
        with torch.no_grad(), t:
            for x in xs:
                m(x)
    finally:
        handle.remove()
    assert len(refused) == 1
    assert "inside a forward of its own model" in str(refused[0]) and "forward 0" in str(refused[0])
    assert "forward" not in m.__dict__ and not any("forward" in c.__dict__ for c in m)
    if store:
        _assert_store_equals(tmp_path / "s.zarr", ref)
    else:
        for k, v in ref.items():
            torch.testing.assert_close(torch.cat(t.activations[k]), v, rtol=0, atol=0)


def test_two_models_sharing_a_submodule_run_at_once_in_two_threads_each_record_their_own_calls(tmp_path):
    # trackers attached in one thread, the models run in two: b's forward called the shared
    # module while a's forward, open in the other thread, waited after its own call of it; the
    # call was refused ("called from one thread while the tracked model runs a forward in
    # another", naming the module by a's path), failing b's forward
    a_waits, b_called = threading.Event(), threading.Event()

    class WaitForB(torch.nn.Module):
        def forward(self, x):
            a_waits.set()
            b_called.wait(10)  # (b's forward failing never sets it)
            return x + 1

    class TellA(torch.nn.Module):
        def forward(self, x):
            b_called.set()
            return x * 2

    torch.manual_seed(0)
    shared = torch.nn.Linear(8, 8)
    a = torch.nn.Sequential(shared, WaitForB())
    b = torch.nn.Sequential(torch.nn.Tanh(), shared, TellA())
    x, y = torch.randn(3, 8), torch.randn(4, 8)
    a_waits.set(), b_called.set()
    ref_a, ref_b = _reference(a, [x]), _reference(b, [y])
    a_waits.clear(), b_called.clear()
    errors: list[BaseException] = []

    def run_b():
        try:
            assert a_waits.wait(10)  # a's forward is open in the main thread, past its shared call
            with torch.no_grad():
                b(y)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    with torch.no_grad(), ActivationScope(store=tmp_path / "a.zarr").track(a), \
            ActivationScope(store=tmp_path / "b.zarr").track(b):
        th = threading.Thread(target=run_b)
        th.start()
        a(x)
        th.join(30)
    assert errors == []
    _assert_store_equals(tmp_path / "a.zarr", ref_a)
    _assert_store_equals(tmp_path / "b.zarr", ref_b)


def test_a_tracker_left_attached_by_a_thread_that_ended_still_refuses_another_threads_tracker():
    # a new thread may get the ended thread's identifier: it is still another thread, whose
    # forwards the tracker left attached would capture too
    m = _mlp()
    left = []

    def attach():
        left.append(ActivationScope().track(m).attach())

    assert _in_thread(attach) == []
    try:
        errors = _in_thread(lambda: ActivationScope().track(m).attach())
        assert len(errors) == 1 and isinstance(errors[0], CaptureError), errors
        assert "same model attached in thread 'other'" in str(errors[0])
    finally:
        left[0].remove()
    assert "forward" not in m.__dict__


def test_in_graph_calls_of_a_shared_submodule_open_in_two_threads_at_once_stay_each_threads_own():
    # the in-graph path (torch.compile: call_begin / call_end ops around each tracked call)
    # kept one stack of open calls per module: two compiled models sharing a submodule, each
    # run in its own thread, both inside the shared call at once, had each call's end take the
    # other thread's frame, recording a's rows in b's capture and b's in a's. The ops are
    # driven here in the order a compiled graph in each thread would run them, interleaved
    from activationscope.capture.compiled import _TOKEN

    ops = torch.ops.activationscope
    shared = torch.nn.Linear(8, 8)
    a = torch.nn.Sequential(shared, torch.nn.ReLU())
    b = torch.nn.Sequential(torch.nn.Tanh(), shared)
    x, y = torch.randn(3, 8), torch.randn(5, 8)
    out_a, out_b = torch.randn(3, 8), torch.randn(5, 8)
    steps = [threading.Event() for _ in range(3)]
    with torch.no_grad(), ActivationScope().track(a, include=["0"]) as ta, \
            ActivationScope().track(b, include=["1"]) as tb:
        root_a, root_b, key = a.forward._acs_key, b.forward._acs_key, shared.forward._acs_key

        def run_b():
            assert steps[0].wait(10)  # a is inside its shared call
            ops.call_begin(_TOKEN, root_b, [], [], y)
            ops.call_begin(_TOKEN, key, [], [], None)
            steps[1].set()
            assert steps[2].wait(10)  # a closed its calls
            ops.call_end(_TOKEN, key, [out_b], ["output"])
            ops.call_end(_TOKEN, root_b, [], [])

        errors: list[BaseException] = []

        def body():
            try:
                run_b()
            except BaseException as e:  # noqa: BLE001
                errors.append(e)

        th = threading.Thread(target=body)
        ops.call_begin(_TOKEN, root_a, [], [], x)
        ops.call_begin(_TOKEN, key, [], [], None)
        th.start()
        steps[0].set()
        assert steps[1].wait(10)
        ops.call_end(_TOKEN, key, [out_a], ["output"])
        ops.call_end(_TOKEN, root_a, [], [])
        steps[2].set()
        th.join(30)
    assert errors == []
    assert list(ta.activations) == ["0.output"] and list(tb.activations) == ["1.output"]
    assert len(ta.activations["0.output"]) == 1 and len(tb.activations["1.output"]) == 1
    torch.testing.assert_close(ta.activations["0.output"][0], out_a, rtol=0, atol=0)
    torch.testing.assert_close(tb.activations["1.output"][0], out_b, rtol=0, atol=0)
