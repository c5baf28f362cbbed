"""Fuzzing: random mutations of small valid stores (bytes, JSON fields, file kinds, paths)
for a bounded time. Asserts no signal, no hang, bounded memory (RLIMIT_AS in the child), no
file touched outside the store, and that every failure is one of our errors.

``ACS_FUZZ_SECONDS`` (default 4) sets the time budget, ``ACS_FUZZ_SEED`` the seed (default:
a fixed one, so that CI replays the same cases; the seed is printed on failure).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from hostile import make_store

HERE = Path(__file__).parent
ROOT = HERE.parents[1]


def _snapshot(p: Path) -> dict:
    return {str(q.relative_to(p)): (q.read_bytes(), q.stat().st_mtime_ns) for q in p.rglob("*") if q.is_file()}


def test_fuzz_mutated_stores(tmp_path):
    seconds = float(os.environ.get("ACS_FUZZ_SECONDS", "4"))
    seed = int(os.environ.get("ACS_FUZZ_SEED", "20261130"))
    make_store(tmp_path / "plain.zarr", n_rows=96)
    make_store(tmp_path / "zstd.zarr", compression="zstd", n_rows=96)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "victim").write_bytes(b"victim bytes")
    (outside / "victim.pt").write_bytes(b"not a script")
    before = _snapshot(outside)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(HERE), os.environ.get("PYTHONPATH", "")]))
    try:
        r = subprocess.run([sys.executable, str(HERE / "fuzz_child.py"), str(tmp_path), str(seconds), str(seed)],
                           capture_output=True, text=True, env=env, timeout=seconds + 120)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        last = [line for line in out.splitlines() if line.startswith("case ")][-1:]
        raise AssertionError(f"fuzz seed {seed}: hung in {last}") from None
    lines = r.stdout.splitlines()
    last = [line for line in lines if line.startswith("case ")][-1:]
    assert r.returncode == 0, (f"fuzz seed {seed}: exit {r.returncode} (negative: killed by that signal) in {last}\n"
                               + "\n".join(lines[-30:]) + r.stderr[-3000:])
    assert lines and lines[-1].startswith("done "), r.stdout[-2000:] + r.stderr[-2000:]
    n_cases = int(lines[-1].split()[1])
    assert n_cases >= 3, f"only {n_cases} cases ran"
    assert _snapshot(outside) == before, f"fuzz seed {seed}: a file outside the stores was changed"
    allowed = {"plain.zarr", "zstd.zarr", "outside", "cases"}
    assert {p.name for p in tmp_path.iterdir()} <= allowed, sorted(p.name for p in tmp_path.iterdir())
