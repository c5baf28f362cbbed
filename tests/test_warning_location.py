"""The library's warnings name the user's line (the ``model(x)`` whose hooks warned, the end
of the ``with`` block, the ``open_store(...)``), not a line of torch's or of this package: the
file and line shown, and the module that ``warnings.filterwarnings(module=...)`` matches."""

from __future__ import annotations

import sys
import warnings

import pytest
import torch

import activationscope as acs
from activationscope.errors import CaptureWarning, warn_at_caller
from activationscope.store import StoreWriter


def _here() -> int:
    """The line of the caller."""
    return sys._getframe(1).f_lineno


def _only(caught, text: str) -> warnings.WarningMessage:
    found = [w for w in caught if text in str(w.message)]
    assert len(found) == 1, [(w.filename, w.lineno, str(w.message)[:80]) for w in caught]
    return found[0]


def _place(w: warnings.WarningMessage) -> tuple[str, int]:
    return w.filename, w.lineno


class _SometimesNone(torch.nn.Module):
    def __init__(self, off: set[int]) -> None:
        super().__init__()
        self.off, self.k = off, 0

    def forward(self, x):
        self.k += 1
        return None if self.k - 1 in self.off else x * 2


class _TwoBranches(torch.nn.Module):
    def __init__(self, off: set[int]) -> None:
        super().__init__()
        self.a = torch.nn.Identity()
        self.b = _SometimesNone(off)

    def forward(self, x):
        self.b(x)
        return self.a(x)


def test_a_warning_at_the_end_of_a_forward_names_the_line_that_called_the_model(tmp_path):
    model = _TwoBranches(off={1})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with acs.ActivationScope(store=str(tmp_path / "s.zarr")).track(model, include=["a", "b"]):
            for i in range(3):
                line = _here() + 1
                model(torch.full((2, 3), float(i)))
    w = _only(caught, "recorded 0 row(s) in forward 1")
    assert issubclass(w.category, CaptureWarning)
    assert _place(w) == (__file__, line)


class _LateBranch(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Identity()
        self.b = torch.nn.Identity()
        self.k, self.line = 0, None

    def forward(self, x):
        self.k += 1
        if self.k > 1:
            self.line = _here() + 1
            x = self.b(x)
        return self.a(x)


def test_a_warning_from_a_hook_of_a_submodule_names_the_model_s_line_that_called_it(tmp_path):
    model = _LateBranch()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with acs.ActivationScope(store=str(tmp_path / "s.zarr")).track(model, include=["a", "b"]):
            model(torch.ones(2, 3))
            model(torch.ones(2, 3))
    w = _only(caught, "'b.output' was first captured in forward 1")
    assert _place(w) == (__file__, model.line)


_INSTALLED_MODEL = """
import torch


class LateBranch(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Identity()
        self.b = torch.nn.Identity()
        self.k = 0

    def forward(self, x):
        self.k += 1
        if self.k > 1:
            x = self.b(x)
        return self.a(x)
"""


def test_a_warning_from_a_hook_inside_an_installed_package_s_model_names_the_line_that_called_the_model(
        tmp_path, monkeypatch):
    """A model of an installed package (a Hugging Face model's forward calling its blocks):
    its lines are not the user's, who called the model."""
    pkg = tmp_path / "site-packages" / "installed_model_pkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(_INSTALLED_MODEL)
    monkeypatch.syspath_prepend(str(tmp_path / "site-packages"))
    monkeypatch.delitem(sys.modules, "installed_model_pkg", raising=False)
    from installed_model_pkg import LateBranch

    model = LateBranch()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with acs.ActivationScope(store=str(tmp_path / "s.zarr")).track(model, include=["a", "b"]):
            model(torch.ones(2, 3))
            line = _here() + 1
            model(torch.ones(2, 3))
    w = _only(caught, "'b.output' was first captured in forward 1")
    assert _place(w) == (__file__, line)
    assert w.filename != str(pkg / "__init__.py")


def test_a_warning_from_a_hook_inside_torch_modules_names_the_line_that_called_the_model(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(4, 3)).eval()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with acs.ActivationScope(store=str(tmp_path / "s.zarr")).track(model) as tracker, torch.no_grad():
            for _ in range(2):
                tracker.set_batch(sample_ids=range(4))
                line = _here() + 1
                model(torch.randn(4, 4))
    w = _only(caught, "sample id 0 was recorded more than once")
    assert _place(w) == (__file__, line)


def test_a_warning_at_the_end_of_the_with_block_names_the_with_statement():
    class WithIdle(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.used, self.idle = torch.nn.Linear(3, 3), torch.nn.Linear(3, 3)

        def forward(self, x):
            return self.used(x)

    model = WithIdle()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = _here() + 1
        with acs.ActivationScope().track(model):
            model(torch.ones(2, 3))
    w = _only(caught, "'idle'")
    assert _place(w) == (__file__, line)

    tracker = acs.ActivationScope().track(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tracker.attach()
        model(torch.ones(2, 3))
        line = _here() + 1
        tracker.remove()
    w = _only(caught, "'idle'")
    assert _place(w) == (__file__, line)


def test_a_store_writer_s_warning_at_the_start_of_the_with_block_names_the_with_statement(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(4, 3)).eval()
    path = str(tmp_path / "s.zarr")
    with acs.ActivationScope(store=path, store_options={"compression": None}).track(model), torch.no_grad():
        model(torch.randn(2, 4))
    scope = acs.ActivationScope(store=path, store_options={"compression": "zstd", "resume": True})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = _here() + 1
        with scope.track(model), torch.no_grad():
            model(torch.randn(2, 4))
    w = _only(caught, "the resumed capture asks for compression 'zstd'")
    assert w.category is RuntimeWarning and _place(w) == (__file__, line)


def _store_being_overwritten(path):
    w = StoreWriter(path, capture_config={}, model=None, storage_dtype=None)
    w.open_array("a", (3,), torch.float32, "sample").append(torch.ones(2, 3))
    w.add_batch(2, [0, 1], None, {})
    w.close()
    return StoreWriter(path, capture_config={}, model=None, storage_dtype=None, overwrite=True)


def test_a_store_reader_s_warning_names_the_line_that_opened_it(tmp_path):
    path = tmp_path / "s.zarr"
    writer = _store_being_overwritten(path)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            line = _here() + 1
            acs.open_store(path)
        assert _place(_only(caught, "holds no rows yet")) == (__file__, line)

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with pytest.raises(acs.HookPointNotFoundError):
                line = _here() + 1
                acs.ActivationDataset(str(path), "a")
        assert _place(_only(caught, "holds no rows yet")) == (__file__, line)
    finally:
        writer.close()


def test_an_analysis_warning_names_the_line_that_called_it(tmp_path):
    from activationscope.analysis.specs import load_data_spec

    (tmp_path / "t.txt").write_text("one\n\ntwo\n")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = _here() + 1
        load_data_spec(str(tmp_path / "t.txt"))
    assert _place(_only(caught, "blank line")) == (__file__, line)


def test_filters_match_the_user_s_module_and_still_silence_by_category(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(4, 3)).eval()

    def capture(path):
        with acs.ActivationScope(store=str(path)).track(model) as tracker, torch.no_grad():
            for _ in range(2):
                tracker.set_batch(sample_ids=range(4))
                model(torch.randn(4, 4))

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.filterwarnings("error", category=CaptureWarning, module=__name__)
        with pytest.raises(CaptureWarning, match="sample id 0 was recorded more than once"):
            capture(tmp_path / "a.zarr")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", category=CaptureWarning)
        capture(tmp_path / "b.zarr")
    assert [w for w in caught if issubclass(w.category, CaptureWarning)] == []


def test_a_warning_with_no_user_frame_names_the_library_s_line():
    import threading

    # a function of this package run on a thread of its own: no frame of the stack is the user's
    code = compile("def issue():\n    warn_at_caller('from a thread', RuntimeWarning)\n",
                   acs.errors.__file__, "exec")
    scope = {"warn_at_caller": warn_at_caller, "__name__": "activationscope.errors"}
    exec(code, scope)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t = threading.Thread(target=scope["issue"])
        t.start()
        t.join(timeout=60)
    assert [(w.filename, w.lineno, str(w.message)) for w in caught] == [(acs.errors.__file__, 2, "from a thread")]


# a row reader of this package (its frames are the library's), for a DataLoader's workers
_LIBRARY = {"__name__": "activationscope._rows", "warn_at_caller": warn_at_caller, "warnings": warnings}
exec(compile("def get_row(self, i):\n"
             "    with warnings.catch_warnings(record=True) as caught:\n"
             "        warnings.simplefilter('always')\n"
             "        warn_at_caller('a row', RuntimeWarning)\n"
             "    return (caught[0].filename, caught[0].lineno)\n", acs.errors.__file__, "exec"), _LIBRARY)


class _LibraryRows(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 2

    __getitem__ = _LIBRARY["get_row"]


def _as_list(batch):
    return batch


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_a_warning_in_a_dataloader_worker_names_the_loop_or_the_library_s_line(context):
    # fork: the worker's stack goes on from the loop that started it; spawn: it starts from
    # the `python -c` code of multiprocessing, which is nobody's line
    loader = torch.utils.data.DataLoader(_LibraryRows(), batch_size=2, num_workers=1, collate_fn=_as_list,
                                         multiprocessing_context=context)
    got = []
    line = _here() + 1
    for batch in loader:
        got.extend(batch)
    assert got == ([(__file__, line)] * 2 if context == "fork" else [(acs.errors.__file__, 4)] * 2)


def test_warn_at_caller_keeps_category_and_the_once_filter():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("once")
        for _ in range(3):
            line = _here() + 1
            warn_at_caller(CaptureWarning("the same"))
        warn_at_caller("text", RuntimeWarning)
    assert [(w.category, str(w.message)) for w in caught] == [(CaptureWarning, "the same"), (RuntimeWarning, "text")]
    assert _place(caught[0]) == (__file__, line)


def test_the_command_line_names_no_category_for_the_library_s_warnings_shown_at_the_user_s_line():
    from activationscope import cli

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warn_at_caller("store 's.zarr': removing leftover temporary files: denied", RuntimeWarning)
        warnings.warn("another package's", RuntimeWarning)
    assert [w.filename for w in caught] == [__file__, __file__]
    fmt = cli._warning_formatter("capture")
    assert [fmt(w.message, w.category, w.filename, w.lineno) for w in caught] == [
        "activationscope capture: warning: store 's.zarr': removing leftover temporary files: denied\n",
        "activationscope capture: warning: RuntimeWarning: another package's\n"]
