"""The build installs numpy before compiling (torch warns "Failed to initialize NumPy" otherwise);
the sdist holds what builds the extension and nothing a checkout gathers besides."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import shutil
import subprocess
import sys
import tarfile
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_numpy_is_a_build_requirement():
    build = tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]["requires"]
    assert any(re.match(r"numpy\b", r) for r in build), build


def test_make_install_installs_numpy_before_the_build():
    lines = (ROOT / "Makefile").read_text().splitlines()
    build = next(i for i, line in enumerate(lines) if "--no-build-isolation" in line)
    assert any("install" in line and re.search(r'\bnumpy\b', line) for line in lines[:build]), lines[:build]


def test_setup_refuses_to_build_without_numpy(tmp_path):
    # a numpy that cannot be found: setup.py stops with the fix instead of a torch warning
    blocker = tmp_path / "sitecustomize.py"
    blocker.write_text(
        "import importlib.util, sys\n"
        "_find = importlib.util.find_spec\n"
        "importlib.util.find_spec = lambda name, *a, **k: None if name == 'numpy' else _find(name, *a, **k)\n"
    )
    out = subprocess.run([sys.executable, str(ROOT / "setup.py"), "--name"], cwd=ROOT, capture_output=True, text=True,
                         env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert out.returncode != 0
    assert "numpy must be installed before building" in out.stderr


# ----------------------------------------------------------------------------- the sdist
def _copy_of_checkout(tmp_path_factory) -> Path:
    """A new folder holding the checkout's files (tracked, and untracked ones not ignored)."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True)
    if listed.returncode != 0:
        pytest.skip("needs a git checkout")
    src = tmp_path_factory.mktemp("checkout")
    for name in filter(None, listed.stdout.decode().split("\0")):
        if (ROOT / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, src / name)
    return src


@pytest.fixture(scope="module")
def sdist(tmp_path_factory):
    """``(members, PKG-INFO text, version written)`` of an sdist built (PEP 517, as pip builds
    one) from a copy of the checkout's files, with what an in-place build and a test run leave
    in a checkout added, and another version in ``_version.py``."""
    src = _copy_of_checkout(tmp_path_factory)
    (src / "activationscope" / "_C.cpython-311-x86_64-linux-gnu.so").write_bytes(b"\x7fELF")
    (src / "build" / "temp").mkdir(parents=True)
    (src / "build" / "temp" / "sink.o").write_bytes(b"\x7fELF")
    (src / "tests" / "scratch.zarr").mkdir()
    (src / "tests" / "scratch.zarr" / "zarr.json").write_text("{}")
    version = "0.1.0.dev7"
    (src / "activationscope" / "_version.py").write_text(f'__version__ = "{version}"\n')
    dist = tmp_path_factory.mktemp("dist")
    out = subprocess.run([sys.executable, "-c", "import sys; from setuptools import build_meta; "
                          "print(build_meta.build_sdist(sys.argv[1]))", str(dist)],
                         cwd=src, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    with tarfile.open(dist / out.stdout.split()[-1]) as tar:
        top = tar.getmembers()[0].name.split("/")[0]
        members = {m.name.split("/", 1)[1] for m in tar.getmembers() if "/" in m.name and m.isfile()}
        pkg_info = tar.extractfile(f"{top}/PKG-INFO").read().decode()
    return members, pkg_info, version


def test_sdist_holds_every_native_source_and_header(sdist):
    members, _, _ = sdist
    native = {f"csrc/{p.name}" for p in (ROOT / "csrc").iterdir() if p.suffix in (".cpp", ".h")}
    assert native - members == set()
    # every header a source includes is there (the extension builds from the sdist alone)
    included = {f"csrc/{name}" for m in members if m.startswith("csrc/")
                for name in re.findall(r'#include "([^"]+)"', (ROOT / m).read_text())}
    assert included and included - members == set()


def test_sdist_holds_the_license_readme_and_format(sdist):
    members, pkg_info, _ = sdist
    assert {"LICENSE", "README.md", "pyproject.toml", "setup.py", "store/FORMAT.md"} <= members
    assert "License-File: LICENSE" in pkg_info.splitlines()
    assert "Description-Content-Type: text/markdown" in pkg_info.splitlines()
    assert "Apache License" in (ROOT / "LICENSE").read_text()


def test_sdist_leaves_out_build_outputs_and_tests(sdist):
    members, _, _ = sdist
    # the tests need the whole checkout (docs, benchmark, golden stores): none, rather than some
    assert [m for m in members if m.startswith(("tests/", "build/", "benchmark/results/"))] == []
    assert [m for m in members if m.endswith((".so", ".o", ".pyc"))] == []


def _torch_requirements(metadata: str) -> list[str]:
    return [line.split(":", 1)[1].strip() for line in metadata.splitlines()
            if line.startswith("Requires-Dist:") and re.match(r"Requires-Dist: torch\b", line)]


@pytest.mark.parametrize("kind", ["wheel", "editable"])
def test_a_wheel_requires_the_torch_its_extension_was_built_against(tmp_path_factory, kind):
    # the extension loads only under the torch it was built against (_native.load compares
    # torch.__version__), but the wheel and `pip install --no-build-isolation -e .` declared torch>=2.4
    import torch

    src = _copy_of_checkout(tmp_path_factory)
    out_dir = tmp_path_factory.mktemp("metadata")
    out = subprocess.run([sys.executable, "-c", "import sys; from setuptools import build_meta; "
                          f"print(build_meta.prepare_metadata_for_build_{kind}(sys.argv[1]))", str(out_dir)],
                         cwd=src, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    metadata = (out_dir / out.stdout.split()[-1] / "METADATA").read_text()
    assert _torch_requirements(metadata) == [f"torch=={torch.__version__}"]
    assert "Requires-Dist: zarr<3.2,>=3.1" in metadata.splitlines()


def test_the_sdist_requires_any_torch_it_builds_against(sdist):
    # an sdist builds the extension against the torch installed: its metadata keeps torch>=2.4,
    # marked dynamic (the wheel built from it pins that torch)
    _, pkg_info, _ = sdist
    assert _torch_requirements(pkg_info) == ["torch>=2.4"]
    assert "dynamic: requires-dist" in pkg_info.lower().splitlines()


def test_the_ops_take_their_str_arguments_as_the_string_view_of_every_torch_the_sdist_builds_against():
    # the sdist builds against torch>=2.4, whose op registration (m.impl of TORCH_LIBRARY_IMPL)
    # takes a `str` argument only as c10::string_view, a class of its own there: a kernel that
    # took std::string_view built against torch 2.11 and 2.13 (where the two are one type) and
    # failed to compile against 2.4's headers
    src = (ROOT / "csrc" / "compiled_ops.cpp").read_text()
    kernels = sorted(set(re.findall(r'm\.impl\("\w+", &(\w+)\)', src)))
    assert kernels == ["call_begin", "call_begin_meta", "call_end", "call_end_meta"]
    for name in kernels:
        params = re.search(rf"\bvoid {name}\(([^)]*)\)", src).group(1)
        assert "c10::string_view" in params and "std::string_view" not in params, (name, params)


def _sections(page: Path) -> set[str]:
    """The headings of a Markdown page and the leads of its bold paragraphs (``**Lead.**``)."""
    text = page.read_text()
    return ({line.lstrip("#").strip() for line in text.splitlines() if re.match(r"#+ ", line)}
            | set(re.findall(r"\*\*([^*]+?)\.\*\*", text)))


def test_every_page_the_sources_name_is_in_the_sdist_with_its_section(sdist):
    # an installed package has no docs/ folder: messages name a page through errors.docs_page,
    # which says it is in the source distribution; docstrings and comments name pages that are
    # there too, and every section named is a heading (or bold lead) of its page
    members, _, _ = sdist
    named: dict[tuple[str, str | None], str] = {}
    stray = []
    for path in sorted((ROOT / "activationscope").rglob("*.py")):
        text = path.read_text()
        tree = ast.parse(text)
        docstrings, args = set(), set()
        for node in ast.walk(tree):
            where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body \
                    and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant):
                docstrings.add(id(node.body[0].value))
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "docs_page":
                assert node.args and all(isinstance(a, ast.Constant) for a in node.args), where
                args.update(id(a) for a in node.args)
                named[(node.args[0].value, node.args[1].value if len(node.args) > 1 else None)] = where
        for node in ast.walk(tree):
            if (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
                    and id(node) not in args and re.search(r"docs/\S*\.md", node.value)):
                stray.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value!r}")
        for m in re.finditer(r"(?:section ([\"'])([^\"']+)\1 of\s+)?\b(docs/[\w/.-]+?\.md|store/FORMAT\.md)\b", text):
            where = f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}"
            named.setdefault((m.group(3), m.group(2)), where)
    assert stray == [], "name these pages with errors.docs_page(path, section)"
    assert len({p for p, _ in named}) >= 4  # (the scan finds them)
    for (page, section), where in sorted(named.items(), key=str):
        assert (ROOT / page).is_file() and page in members, f"{where} names {page}"
        if section is not None:
            assert section in _sections(ROOT / page), f"{where} names section {section!r} of {page}"


def test_sdist_takes_its_version_from_version_py(sdist):
    _, pkg_info, version = sdist
    assert f"Version: {version}" in pkg_info.splitlines()


def test_installed_version_is_the_package_version():
    import activationscope

    assert importlib.metadata.version("activationscope") == activationscope.__version__


# ----------------------------------------------------------------------------- the extension
def _elf_section_names(path: str) -> list[str]:
    """Names of the sections of the 64-bit little-endian ELF file at ``path``."""
    import struct

    with open(path, "rb") as f:
        head = f.read(64)
        assert head[:4] == b"\x7fELF" and head[4] == 2 and head[5] == 1, f"{path} is not a 64-bit little-endian ELF"
        shoff, = struct.unpack_from("<Q", head, 0x28)
        shentsize, shnum, shstrndx = struct.unpack_from("<HHH", head, 0x3A)
        f.seek(shoff)
        table = f.read(shentsize * shnum)
        headers = [struct.unpack_from("<IIQQQQ", table, i * shentsize) for i in range(shnum)]
        _, _, _, _, str_offset, str_size = headers[shstrndx]
        f.seek(str_offset)
        strings = f.read(str_size)
    return [strings[h[0]:strings.index(b"\0", h[0])].decode() for h in headers]


@pytest.mark.skipif(sys.platform != "linux", reason="reads the extension as an ELF file")
def test_the_extension_carries_no_debug_information():
    # Python's CFLAGS usually hold -g: the extension then weighs 51 MB, in every wheel
    from activationscope.capture import _native

    names = _elf_section_names(_native.load().__file__)
    assert ".text" in names
    assert [n for n in names if n.startswith(".debug_")] == []
