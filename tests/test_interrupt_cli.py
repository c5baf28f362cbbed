"""Ctrl-C and SIGTERM in the command line: the command exits 130 (143 for SIGTERM) with one
line on stderr, no traceback, and leaves the stores as the library does (tests/test_interrupt_tools.py);
running it again completes it. Ctrl-C is raised at lines of the library's code, ``InterruptAt``."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys

import pytest
import torch

import activationscope as acs
from activationscope import cli

from acs_testing import InterruptAt
from test_interrupt_tools import _Lines, _rank_stores, _tree, _without_times

NETS = """
import os
import signal

import torch


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))


class Terminated(torch.nn.Module):
    # mlp(), sent SIGTERM (what a batch scheduler, Slurm or timeout, sends) by its forward
    # number $TERMINATE_AT (1: the first; unset: never)

    def __init__(self):
        super().__init__()
        self.inner, self.n = mlp(), 0

    def forward(self, x):
        self.n += 1
        if self.n == int(os.environ.get("TERMINATE_AT", 0)):
            os.kill(os.getpid(), signal.SIGTERM)
        return self.inner(x)


def terminated():
    return Terminated()
"""


def _run(capsys, *argv) -> tuple[int, str]:
    code = cli.main([str(a) for a in argv])
    return code, capsys.readouterr().err


def _sweep(capsys, argv, before, after, most=60):
    """Run the command ``argv`` interrupted at ``most`` lines spread over those it runs (each
    after ``before()``), check its exit and message, then ``after(where)``."""
    before()
    assert _run(capsys, *argv)[0] == 0  # (first use: lazy imports)
    before()
    with _Lines() as lines:
        assert _run(capsys, *argv)[0] == 0
    step = -(-len(lines.first) // most)
    for k in lines.first[::step]:
        before()
        with InterruptAt(k) as where:
            code, err = _run(capsys, *argv)
        if where.where is None:  # (finished before line k: the lines a run takes vary a little)
            continue
        assert code == 130 and err.count("\n") == 1 and "Traceback" not in err, (where.where, err)
        assert err.startswith(f"activationscope {argv[0]}: interrupted"), (where.where, err)
        after(where.where)


@pytest.fixture
def toy(tmp_path, user_package):
    x = user_package("clinets", NETS, data=(12, 6, 0))
    ref = tmp_path / "ref.zarr"
    assert cli.main(["capture", "--model", "clinets.nets:mlp", "--data", str(x), "--out", str(ref),
                     "--batch-size", "4", "--no-progress"]) == 0
    return x, ref


def _same_rows(path, ref) -> bool:
    a, b = acs.open_store(path), acs.open_store(ref)
    return a.status == "complete" and a.hook_points == b.hook_points and all(
        torch.equal(a[hp], b[hp]) for hp in b.hook_points) and a.row_table("sample") == b.row_table("sample")


def test_ctrl_c_in_cli_capture(tmp_path, toy, capsys):
    x, ref = toy
    out = tmp_path / "out.zarr"
    argv = ["capture", "--model", "clinets.nets:mlp", "--data", x, "--out", out, "--batch-size", "4", "--no-progress"]

    def before():
        shutil.rmtree(out, ignore_errors=True)

    def after(where):
        if (out / "zarr.json").exists():  # the rows committed: an incomplete store, resumed
            assert acs.open_store(out).status in ("incomplete", "complete"), where
            code, err = _run(capsys, *argv, "--resume")
        else:  # none: no store left there, nor a lock
            code, err = _run(capsys, *argv)
        assert code == 0, (where, err)
        assert _same_rows(out, ref), where

    _sweep(capsys, argv, before, after, most=30)


@pytest.mark.parametrize("command", ["info", "verify"])
def test_ctrl_c_in_cli_info_and_verify(toy, capsys, command):
    _, ref = toy
    want = _tree(ref)

    def after(where):
        assert _tree(ref) == want, where

    _sweep(capsys, [command, ref], lambda: None, after)


def test_ctrl_c_in_cli_consolidate(tmp_path, capsys):
    template, path, reference = (tmp_path / f"{name}.zarr" for name in ("template", "run", "reference"))
    _rank_stores(template)
    shutil.copytree(template, reference)
    assert _run(capsys, "consolidate", reference)[0] == 0
    want = _without_times(_tree(reference))

    def before():
        shutil.rmtree(path, ignore_errors=True)
        shutil.copytree(template, path)

    def after(where):
        assert _run(capsys, "consolidate", path)[0] == 0, where
        assert _without_times(_tree(path)) == want, where

    _sweep(capsys, ["consolidate", path], before, after, most=20)


@pytest.mark.parametrize("overwrite", [False, True])
def test_ctrl_c_in_cli_copy(tmp_path, toy, capsys, overwrite):
    # the source as it was; the target absent, the store it held (with --overwrite), or an incomplete
    # store listing no row, which the command again with --overwrite completes
    from activationscope.store._backend import LOCK_KEY, resolve
    from activationscope.store._lock import writer_holding

    def _unlocked(tree):
        return {k: v for k, v in tree.items() if k != LOCK_KEY}

    _, ref = toy
    want = _tree(ref)
    out = tmp_path / "copy.zarr"
    old = tmp_path / "old.zarr"
    argv = ["copy", ref, out] + (["--overwrite"] if overwrite else [])
    if overwrite:  # a store of other rows there, replaced
        assert _run(capsys, "copy", ref, old)[0] == 0
        with open(old / "zarr.json", "r+b") as f:
            doc = f.read().replace(b'"status": "complete"', b'"status": "incomplete"', 1)
            f.seek(0), f.truncate(), f.write(doc)
        assert acs.open_store(old).status == "incomplete"
    kept = _tree(old) if overwrite else None

    def before():
        shutil.rmtree(out, ignore_errors=True)
        if overwrite:
            shutil.copytree(old, out)

    def after(where):
        assert _tree(ref) == want, where
        if out.exists():  # (an empty lock file left by the interrupted release is no lock: nothing holds it)
            assert writer_holding(resolve(str(out))) is None, where
            got = _unlocked(_tree(out))
            assert got in (_unlocked(want), _unlocked(kept or {}), {}) or acs.open_store(out).n_samples == 0, where
        code, err = _run(capsys, "copy", ref, out, *(["--overwrite"] if out.exists() else []))
        assert code == 0, (where, err)
        assert _unlocked(_tree(out)) == _unlocked(want), where

    _sweep(capsys, argv, before, after, most=30)


def test_ctrl_c_in_cli_export(tmp_path, toy, capsys):
    _, ref = toy
    out = tmp_path / "rows.parquet"
    argv = ["export", ref, "--format", "parquet", "--out", out]
    assert _run(capsys, *argv)[0] == 0
    want = out.read_bytes()

    def after(where):
        assert not out.exists() or out.read_bytes() == want, where
        assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("rows")) in ([], ["rows.parquet"]), where
        assert _run(capsys, *argv)[0] == 0 and out.read_bytes() == want, where

    _sweep(capsys, argv, lambda: out.unlink(missing_ok=True), after)


def test_sigterm_stops_a_cli_capture_as_ctrl_c_does(tmp_path, user_package, capsys, monkeypatch):
    # killed by SIGTERM (Python's default), a capture lost every row it had not committed, left its
    # temporary files in the store and ended without a word; now SIGTERM stops it as Ctrl-C does:
    # the forwards before are committed, the store is left incomplete for --resume, status 143
    x = user_package("clinets", NETS, data=(20, 6, 0))
    argv = ["capture", "--model", "clinets.nets:terminated", "--data", str(x), "--batch-size", "4", "--no-progress",
            "--shard-bytes", "128"]
    monkeypatch.delenv("TERMINATE_AT", raising=False)
    assert cli.main([*argv, "--out", str(tmp_path / "ref.zarr")]) == 0
    out = tmp_path / "out.zarr"
    env = dict(os.environ, TERMINATE_AT="3",
               PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(acs.__file__)), str(tmp_path)]))
    done = subprocess.run([sys.executable, "-m", "activationscope", *argv, "--out", str(out)], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 143 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.startswith("activationscope capture: terminated (SIGTERM)") and done.stderr.count("\n") == 1
    st = acs.open_store(out)
    assert st.status == "incomplete" and st.n_samples == 8  # the two forwards before the third
    assert [p.name for p in out.rglob("*.tmp")] == []
    assert cli.main([*argv, "--out", str(out), "--resume"]) == 0, capsys.readouterr().err
    assert _same_rows(out, tmp_path / "ref.zarr")


def test_the_sigterm_handler_before_a_command_is_put_back(capsys):
    before = signal.getsignal(signal.SIGTERM)
    assert cli.main(["info", "no-such.zarr"]) == 1
    assert signal.getsignal(signal.SIGTERM) is before


INTERRUPT_IMPORT = """
import importlib.abc
import os
import signal
import sys
import time


class InterruptImport(importlib.abc.MetaPathFinder):
    # Ctrl-C (SIGINT sent to this process) while the module $SIGINT_IN_IMPORT is being imported

    def find_spec(self, fullname, path, target=None):
        if fullname == os.environ.get("SIGINT_IN_IMPORT"):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(30)  # (ended at once by the KeyboardInterrupt of the signal)
        return None


sys.meta_path.insert(0, InterruptImport())
"""


@pytest.mark.parametrize("entry", ["console_script", "python_m"])
@pytest.mark.parametrize("module", ["activationscope.cli", "activationscope.analysis.capture_run", "argparse"])
def test_ctrl_c_while_the_command_line_is_imported_prints_one_line(tmp_path, entry, module):
    # a Ctrl-C while the console script imported activationscope.cli (before the command's own
    # Ctrl-C handling) printed Python's traceback; now the one line and status 130 of any Ctrl-C
    import tomllib

    (tmp_path / "sitecustomize.py").write_text(INTERRUPT_IMPORT)
    root = os.path.dirname(os.path.dirname(acs.__file__))
    with open(os.path.join(root, "pyproject.toml"), "rb") as f:
        target = tomllib.load(f)["project"]["scripts"]["activationscope"]
    name, func = target.split(":")
    script = tmp_path / "activationscope-script.py"  # as pip writes the console script
    script.write_text(f"import sys\nfrom {name} import {func}\nif __name__ == '__main__':\n    sys.exit({func}())\n")
    cmd = [sys.executable, str(script)] if entry == "console_script" else [sys.executable, "-m", "activationscope"]
    env = dict(os.environ, SIGINT_IN_IMPORT=module, PYTHONPATH=os.pathsep.join([str(tmp_path), root]))
    done = subprocess.run([*cmd, "info", str(tmp_path / "no-such.zarr")], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert (done.returncode, done.stderr) == (130, "activationscope info: interrupted\n")
    env.pop("SIGINT_IN_IMPORT")  # (not interrupted: the command runs)
    done = subprocess.run([*cmd, "info", str(tmp_path / "no-such.zarr")], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and done.stderr.startswith("activationscope info: error: "), done.stderr


def test_the_commands_named_for_a_ctrl_c_while_importing_are_the_command_lines():
    from activationscope import __main__

    assert __main__.COMMANDS == tuple(cli._COMMANDS)
