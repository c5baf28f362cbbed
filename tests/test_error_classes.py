"""Every error the library raises is a subclass of ActivationScopeError that also inherits the
natural builtin (STYLE.md, Errors): ``except ValueError`` / ``except TypeError`` /
``except RuntimeError`` catch them as users expect, and so does ``except ActivationScopeError``."""

from __future__ import annotations

import ast
from pathlib import Path

import pyarrow as pa
import pytest
import torch

import activationscope as acs
from activationscope.data import arrow_to_torch
from activationscope.data._source import as_source
from activationscope.errors import ActivationScopeError, RowIndexError

PACKAGE = Path(acs.__file__).parent


def test_no_error_is_raised_as_the_bare_root_class():
    """A `raise ActivationScopeError(...)` (or a function building one to raise) is caught only
    by `except ActivationScopeError`: each one names a subclass with its builtin instead."""
    bare = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            call = node.exc if isinstance(node, ast.Raise) else node.value if isinstance(node, ast.Return) else None
            if isinstance(call, ast.Call) and isinstance(call.func, ast.Name):
                if call.func.id == "ActivationScopeError":
                    bare.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    assert bare == []


@pytest.mark.parametrize("call, builtin", [
    (lambda: as_source(None), TypeError),
    (lambda: arrow_to_torch(pa.array([1.0, None])), ValueError),
    (lambda: arrow_to_torch(pa.array(["a"])), TypeError),
])
def test_data_errors_inherit_their_builtin(call, builtin):
    with pytest.raises(builtin) as e:
        call()
    assert isinstance(e.value, ActivationScopeError)


def test_a_closed_store_tracker_entered_again_is_a_capture_error(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    scope = acs.ActivationScope(store=str(tmp_path / "s.zarr"))
    tracker = scope.track(model)
    with tracker, torch.no_grad():
        model(torch.ones(1, 2))
    with pytest.raises(RuntimeError, match="this tracker's store is closed") as e:
        with tracker:
            pass
    assert isinstance(e.value, acs.CaptureError)


def test_rows_out_of_range_of_a_source_are_a_row_index_error(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    with acs.ActivationScope(store=str(tmp_path / "s.zarr")).track(model), torch.no_grad():
        model(torch.ones(3, 2))
    source = as_source(str(tmp_path / "s.zarr"))
    assert source.read("0.output", 1, 3).shape == (2, 2)
    with pytest.raises(IndexError, match=r"rows \[2, 4\) out of range for hook point '0.output' with 3 rows") as e:
        source.read("0.output", 2, 4)
    assert isinstance(e.value, RowIndexError)
