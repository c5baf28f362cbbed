"""Every public callable has a docstring that documents each of its parameters.

Public: the ``__all__`` of ``activationscope``, ``activationscope.store``, ``activationscope.data``
and of the modules of ``activationscope.capture`` and ``activationscope.analysis`` that users
import (those two packages export nothing themselves), with the public methods of the classes
they export. A parameter is documented when a numpy-style ``Parameters`` (or ``Other
Parameters``) section has an entry for it (``name : type``, or ``a, b : type`` for several); a
class's constructor parameters may be documented in the class docstring, and a dataclass's
fields in an ``Attributes`` section. Parameters whose name starts with ``_`` are private. An
entry for a parameter the callable does not take (renamed or removed) is an error too.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import inspect
import re

import pytest

MODULES = [
    "activationscope",
    "activationscope.store",
    "activationscope.data",
    "activationscope.capture.scope",
    "activationscope.capture.reductions",
    "activationscope.analysis.dask",
    "activationscope.analysis.pca",
    "activationscope.analysis.pooling",
    "activationscope.analysis.probes",
    "activationscope.analysis.report",
]

# Methods whose parameters are documented elsewhere, each with the reason.
EXCEPTIONS = {
    # made by ActivationScope.track() (documented there), never by users: its arguments are internal
    "Tracker": ("scope", "model", "modules", "side", "stop_after_last", "patterns"),
    # "arguments as StoreWriter": its keyword arguments are the constructor's, documented there
    "StoreWriter.check_options": ("overwrite", "resume", "compression", "chunk_rows", "shard_bytes", "shard_rows",
                                  "fsync", "commit_interval", "max_pending_bytes", "provenance", "storage_options"),
    # "others: as export_arrow", which takes the same parameters and documents each of them
    "activationscope.data.export_parquet": ("store", "path", "hook_points", "columns", "batch_rows", "rows", "filter",
                                            "sample_ids", "tensor_type", "overwrite"),
}

ENTRY = re.compile(r"\*{0,2}\w+(\s*,\s*\*{0,2}\w+)*(\s*:.*)?")


def documented(doc: str, sections: tuple[str, ...]) -> set[str]:
    """Names with an entry in the numpy-style ``sections`` of ``doc``."""
    names: set[str] = set()
    lines = inspect.cleandoc(doc).splitlines()
    inside = False
    for i, line in enumerate(lines):
        if i + 1 < len(lines) and re.fullmatch(r"-{3,}", lines[i + 1].strip()) and line.strip():
            inside = line.strip() in sections
            continue
        if inside and line and not line[0].isspace() and ENTRY.fullmatch(line.rstrip()):
            head = line.split(":", 1)[0]
            names.update(n.strip().lstrip("*") for n in head.split(","))
    return names


def public_callables():
    seen: set[int] = set()
    for module_name in MODULES:
        module = importlib.import_module(module_name)
        for name in module.__all__:
            value = getattr(module, name)
            if id(value) in seen or not callable(value) or not getattr(value, "__module__", "").startswith("activationscope"):
                continue
            seen.add(id(value))
            if inspect.isclass(value):
                if issubclass(value, (BaseException, enum.Enum)):
                    continue  # an error or an enum takes no documented arguments
                yield value.__qualname__, value
                for attr, member in vars(value).items():
                    if attr.startswith("_") and attr not in ("__call__", "__getitem__", "__getitems__", "__len__"):
                        continue
                    if isinstance(member, (staticmethod, classmethod)):
                        member = member.__func__
                    if inspect.isfunction(member):
                        yield f"{value.__qualname__}.{attr}", member
            else:
                yield f"{module_name}.{name}", value


def test_the_walk_finds_the_public_api():
    names = {name for name, _ in public_callables()}
    for name in ("ActivationScope", "ActivationScope.track", "Store.rows", "ActivationDataset.get_batch",
                 "activationscope.open_store", "activationscope.data.export_parquet", "Store.__getitem__"):
        assert name in names, name


def test_documented_reads_numpy_parameter_sections():
    doc = """Summary.

    Parameters
    ----------
    a : int
        Text that names b : not an entry.
    b, c
    **kw : dict

    Returns
    -------
    d : int
    """
    assert documented(doc, ("Parameters",)) == {"a", "b", "c", "kw"}


@pytest.mark.parametrize("name, obj", list(public_callables()), ids=lambda v: v if isinstance(v, str) else "")
def test_public_callable_documents_each_parameter(name, obj):
    doc = inspect.getdoc(obj) or ""
    assert doc.strip(), f"{name} has no docstring"
    sections = ("Parameters", "Other Parameters")
    if inspect.isclass(obj):
        init = vars(obj).get("__init__")
        if init is not None and init.__doc__:
            doc += "\n\n" + inspect.getdoc(init)
        if dataclasses.is_dataclass(obj):
            sections += ("Attributes",)
    parameters = [p for p in inspect.signature(obj).parameters if p not in ("self", "cls") and not p.startswith("_")]
    entries = documented(doc, sections)
    missing = [p for p in parameters if p not in entries and p not in EXCEPTIONS.get(name, ())]
    assert missing == [], f"{name}: parameters without an entry in its docstring's Parameters section: {missing}"
    if not dataclasses.is_dataclass(obj):  # (a dataclass's Attributes may hold more than its fields)
        stale = entries - set(inspect.signature(obj).parameters) - {"others"}  # ("others : as f", f's parameters)
        assert stale == set(), f"{name}: its Parameters section names what it does not take: {sorted(stale)}"


def test_the_exceptions_name_parameters_there_are():
    """An entry of EXCEPTIONS left behind by a renamed parameter would excuse nothing."""
    found = dict(public_callables())
    for name, parameters in EXCEPTIONS.items():
        assert name in found, name
        assert set(parameters) <= set(inspect.signature(found[name]).parameters), name
