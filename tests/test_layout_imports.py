"""The package layout follows the data path: capture -> store -> data -> analysis -> cli.

A module imports only from its own layer or the layers before it (docs/development.md,
"Import rule"); the shared base modules (errors.py, sizes.py, _version.py, _safeio.py, _args.py) import no layer; and the
import graph between modules has no cycle. Imports inside functions count too.
The package's ``__init__.py`` (the public facade) and ``__main__.py`` sit above every layer.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "activationscope"
LAYERS = ["capture", "store", "data", "analysis", "cli"]
BASE = {"activationscope.errors", "activationscope.sizes", "activationscope._version", "activationscope._C",
        "activationscope._safeio", "activationscope._args"}
TOP = {"activationscope", "activationscope.__main__"}


def _module_name(path: Path) -> str:
    parts = ["activationscope", *path.relative_to(PKG).with_suffix("").parts]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The package modules ``name`` imports (module level and inside functions)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    is_pkg = path.name == "__init__.py"
    here = name.split(".") if is_pkg else name.split(".")[:-1]
    out: set[str] = set()

    def add(target: str) -> None:
        # the longest known module prefix of target (a name imported from a module is not a module)
        parts = target.split(".")
        while parts and ".".join(parts) not in known:
            parts.pop()
        if parts:
            out.add(".".join(parts))

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("activationscope"):
                    add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if not mod.startswith("activationscope"):
                continue
            for alias in node.names:
                # ``from pkg import sub``: the submodule (pkg itself is only its parent package);
                # ``from mod import name``: mod
                sub = f"{mod}.{alias.name}"
                add(sub if sub in known else mod)
    out.discard(name)
    return out


def _layer(module: str) -> int | None:
    """Index in LAYERS; -1 for the base modules (errors, sizes, _version, the extension);
    None for the facade."""
    if module in BASE:
        return -1
    if module in TOP:
        return None
    parts = module.split(".")
    if len(parts) >= 2 and parts[1] in LAYERS:
        return LAYERS.index(parts[1])
    raise AssertionError(f"{module} is in no layer: put it in one of {LAYERS} or make it a base module")


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    known = set(mods) | {"activationscope._C"}
    return {name: _imports(name, path, known) for name, path in mods.items()}


def test_every_module_has_a_layer():
    for name in _modules():
        _layer(name)


def test_no_upward_import():
    bad = []
    for name, deps in _graph().items():
        mine = _layer(name)
        if mine is None:
            continue
        for dep in sorted(deps):
            theirs = _layer(dep)
            if theirs is None or theirs > mine:
                where = "the package facade" if theirs is None else LAYERS[theirs]
                layer = "base" if mine < 0 else LAYERS[mine]
                bad.append(f"{name} ({layer}) imports {dep} ({where})")
    assert not bad, "imports against the layer order capture -> store -> data -> analysis -> cli:\n" + "\n".join(bad)


def test_no_import_cycle():
    graph = {n: {d for d in deps if d not in TOP} for n, deps in _graph().items() if n not in TOP}
    # a package's __init__ importing its own submodules is how packages work, not a cycle
    for n in graph:
        graph[n] = {d for d in graph[n] if not d.startswith(n + ".")}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for d in sorted(graph.get(n, ())):
            if state.get(d) == 1:
                return stack[stack.index(d):] + [d]
            if d not in state:
                found = visit(d)
                if found:
                    return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state:
            cycle = visit(n)
            assert cycle is None, "import cycle: " + " -> ".join(cycle)


@pytest.mark.parametrize(
    "source, upward",
    [
        ("from ..store import StoreWriter", True),
        ("from activationscope.cli import main", True),
        ("def f():\n    from ..analysis import report", True),
        ("from ..errors import CaptureError", False),
        ("from . import hooks", False),
    ],
)
def test_the_checker_sees_upward_imports(tmp_path, source, upward):
    """The check itself: a capture module with each import, upward or not."""
    mods = _modules()
    fake = tmp_path / "fake.py"
    fake.write_text(source + "\n")
    deps = _imports("activationscope.capture.fake", fake, set(mods))
    assert any(_layer(d) is not None and _layer(d) > 0 for d in deps) is upward, deps


def _doc_imports() -> list[tuple[str, str]]:
    """(file, import statement) for every activationscope import in README.md and docs/."""
    root = PKG.parent
    out = []
    for path in [root / "README.md", *sorted((root / "docs").rglob("*.md"))]:
        for line in path.read_text(encoding="utf-8").splitlines():
            text = line.strip()
            if text.startswith(("import activationscope", "from activationscope")) and " import " in text or text.startswith("import activationscope"):
                out.append((path.relative_to(root).as_posix(), text.split("#")[0].strip()))
    return out


def test_every_import_the_docs_show_works():
    found = _doc_imports()
    assert len(found) >= 10, found  # the docs do show imports; the scan must see them
    for where, statement in found:
        try:
            exec(statement, {})
        except ImportError as e:
            raise AssertionError(f"{where}: {statement!r} fails: {e}") from e
