"""The native core's Python boundary: codes of Python-side enums are range-checked, and
exceptions raised inside the forward wrapper's call slot reach the caller with their class."""

from __future__ import annotations

from typing import Optional

import pytest
import torch

import activationscope as acs
from activationscope.capture import _native

_C = _native.load()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"keep": 3}, r"Sink keep must be 0 \(ALL\), 1 \(LAST\) or 2 \(NONE\), got 3"),
        ({"keep": -1}, r"Sink keep must be .*, got -1"),
        ({"placement": 4}, r"Sink placement must be 0 \(AUTO\), 1 \(CPU\), 2 \(GPU\) or 3 \(DISK\), got 4"),
        ({"row_kind": 2}, r"Sink row_kind must be -1 .*, got 2"),
        ({"row_kind": -2}, r"Sink row_kind must be -1 .*, got -2"),
    ],
)
def test_sink_enum_codes_out_of_range_are_rejected(kwargs, match):
    with pytest.raises(RuntimeError, match=match):
        _C.Sink("h", **kwargs)


def test_sink_enum_codes_in_range_are_accepted():
    for keep in range(3):
        for placement in range(4):
            for row_kind in (-1, 0, 1):
                assert _C.Sink("h", keep=keep, placement=placement, row_kind=row_kind).row_kind == row_kind


def test_tracker_policy_code_out_of_range_is_rejected():
    core = _C.TrackerCore(lambda name, t: None)
    for code in range(3):
        core.policy = code
        assert core.policy == code
    for bad in (3, -1):
        with pytest.raises(RuntimeError, match=rf"capture policy code must be 0 \(EVERY\), 1 \(SAMPLE_N\) or 2 \(MAX_K\), got {bad}"):
            core.policy = bad
    assert core.policy == 2  # unchanged by the rejected codes


def _wrapped(on_new):
    core = _C.TrackerCore(on_new)
    wrapper = _C.ForwardWrapper(lambda x: x * 2)
    wrapper.add_site(_C.Site(core, "m", False, True, True))
    return wrapper


def test_wrapper_slot_passes_python_errors_through():
    def on_new(name, t):
        raise KeyError("from the callback")

    with pytest.raises(KeyError, match="from the callback"):
        _wrapped(on_new)(torch.ones(2, 3))


def test_wrapper_slot_translates_native_user_errors_to_capture_error():
    # A token-row sink without an attention mask: the sink's check (acs::UserError).
    sink = _C.Sink("m.output", row_kind=1)
    sink.add_reduction(_C.make_builtin_reduction("mean"))
    with pytest.raises(acs.CaptureError, match=r"hook point 'm.output' stores token rows and needs an attention mask"):
        _wrapped(lambda name, t: sink)(torch.ones(2, 3, 4))


def test_wrapper_slot_translates_pybind_cast_errors():
    # The callback returns something that is not a Sink: pybind11's cast error, as a RuntimeError.
    with pytest.raises(RuntimeError):
        _wrapped(lambda name, t: "not a sink")(torch.ones(2, 3))


def test_wrapper_slot_returns_the_forward_result_and_records_it():
    sinks = {}

    def on_new(name, t):
        sinks[name] = _C.Sink(name)
        return sinks[name]

    x = torch.arange(6.0).reshape(2, 3)
    out = _wrapped(on_new)(x)
    torch.testing.assert_close(out, x * 2)
    assert list(sinks) == ["m.output"]
    torch.testing.assert_close(sinks["m.output"].records()[0], x * 2)


@pytest.mark.parametrize(
    "shape, mask_shape, expected",
    [((2, 3, 4), (2, 3), True), ((2, 3), (2, 3), True), ((2, 4, 4), (2, 3), False), ((2,), (2, 3), False),
     ((3, 3, 4), (2, 3), False), ((2, 3, 4), None, False)],
)
def test_token_row_rule(shape, mask_shape, expected):
    mask = None if mask_shape is None else torch.ones(mask_shape, dtype=torch.bool)
    assert _C.is_token_rows(torch.zeros(shape), mask) is expected


def _log_of_zeros(acc: Optional[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    s = (x * 0.0).abs().log().sum(0)  # -inf of finite rows
    return s if acc is None else acc + s


def _plain_sum(acc: Optional[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    return x.sum(0) if acc is None else acc + x.sum(0)


def test_sink_reads_made_nonfinite_under_its_lock_once_the_update_is_done():
    """``Sink.reduction_made_nonfinite`` (what the close reads) takes the hook point's lock, so a
    forward still updating the reduction in another thread is waited for: read on the reduction
    itself meanwhile, the flags are those from before the update, which is still to set them."""
    import threading
    import time

    from activationscope.capture.reductions import EagerReduction

    entered = threading.Event()

    def slow_log_of_zeros(acc, x):
        entered.set()
        time.sleep(0.3)
        return _log_of_zeros(acc, x)

    red = EagerReduction(slow_log_of_zeros)
    sink = _C.Sink("h", keep=2)
    sink.add_reduction(red)
    th = threading.Thread(target=sink.consume, args=(torch.ones(2, 3), torch.Tensor()))
    th.start()
    assert entered.wait(5)
    assert red.made_nonfinite is False  # (unlocked: the update has not set it yet)
    assert sink.reduction_made_nonfinite(0) is True
    th.join(5)


def test_sink_made_nonfinite_of_each_reduction_kind():
    """The eager reduction's own ``made_nonfinite`` is asked through the native interface (it
    answered the built-ins' False there), a TorchScript one's is its native flags, a built-in's
    False; an index past the reductions is an error naming the hook point."""
    from activationscope.capture.reductions import EagerReduction, make_reduction

    sink = _C.Sink("h", keep=2)
    # (held here, as a capture holds its reductions: an eager one's Python side must outlive its use)
    reds = [EagerReduction(_log_of_zeros), make_reduction(_log_of_zeros), make_reduction(_plain_sum),
            make_reduction("mean")]
    for red in reds:
        sink.add_reduction(red)
    sink.consume(torch.ones(2, 3), torch.Tensor())
    assert [sink.reduction_made_nonfinite(i) for i in range(4)] == [True, True, False, False]
    with pytest.raises(acs.CaptureError, match="hook point 'h' has 4 reduction"):
        sink.reduction_made_nonfinite(4)
