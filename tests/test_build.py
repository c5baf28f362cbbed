"""The build installs numpy before compiling (torch warns "Failed to initialize NumPy" otherwise)."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

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
