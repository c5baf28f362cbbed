"""A torchrun rank exits cleanly after its capture when ``torch.distributed.nn`` was imported
after the process group was created (``transformers`` 5 ``from_pretrained`` imports it): the
group it keeps past ``destroy_process_group`` is destroyed at exit, its gloo threads joined
before the interpreter finalizes (else a rank could abort with "terminate called without an
active exception", SIGABRT)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import types
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from activationscope.store.ranks import release_destroyed_groups

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "torchrun_exit.py"
TORCHRUN = Path(sys.executable).with_name("torchrun")


def _torchrun(store: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parents[1]), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    cmd = [str(TORCHRUN), "--standalone", "--nproc_per_node=2", "--monitor-interval=1", str(SCRIPT), str(store), *extra]
    env["TMPDIR"] = tempfile.mkdtemp(prefix="acs-torchrun-")  # torchrun's agent leaves torchelastic_* folders there
    try:
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    finally:
        shutil.rmtree(env["TMPDIR"], ignore_errors=True)


def _reports(store: Path) -> list[dict]:
    return [json.loads(Path(f"{store}.rank{r}.exit.json").read_text()) for r in range(2)]


@pytest.mark.slow
def test_a_group_kept_by_torch_distributed_nn_is_destroyed_at_exit(tmp_path):
    """The capture, then a gather, destroy_process_group and a plain exit: no gloo thread is
    left when the interpreter finalizes (before the fix every rank still had all three)."""
    store = tmp_path / "torch.zarr"
    out = _torchrun(store, "--init", "torch")
    assert out.returncode == 0, out.stderr[-3000:]
    for r, rep in enumerate(_reports(store)):
        assert rep["rank"] == r and rep["gathered"] == [{"rank": 0, "n_batches": 4}, {"rank": 1, "n_batches": 4}]
        assert rep["gloo_threads_at_exit"] == [], rep


@pytest.mark.slow
def test_acs_init_process_group_is_destroyed_by_destroy_process_group(tmp_path):
    """``acs.init_process_group`` imports ``torch.distributed.nn`` before the group exists:
    ``destroy_process_group`` ends the group's gloo threads at once."""
    store = tmp_path / "acs.zarr"
    out = _torchrun(store, "--init", "acs")
    assert out.returncode == 0, out.stderr[-3000:]
    for rep in _reports(store):
        assert rep["gloo_threads_after_destroy"] == [] and rep["gloo_threads_at_exit"] == [], rep


@pytest.mark.slow
def test_ranks_exit_cleanly_every_time(tmp_path):
    """The shape that aborted a rank in 1 run of 3 to 5 (gather, destroy, exit at once):
    every one of 4 runs ends with exit code 0 on both ranks."""
    for i in range(4):
        out = _torchrun(tmp_path / f"run{i}.zarr", "--init", "torch", "--no-capture")
        assert out.returncode == 0, f"run {i}: {out.stderr[-3000:]}"
        assert "terminate called" not in out.stderr


def test_release_destroyed_groups_replaces_only_destroyed_groups():
    """Defaults (positional and keyword-only) holding a destroyed group become None; the live
    default group and other defaults stay."""
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        old = dist.group.WORLD
        mod = types.ModuleType("fake_functional")
        exec("def f(x, op=1, group=G):\n    return group\n"
             "def g(x, *, group=G):\n    return group\n"
             "def h(x, op=1, t=T):\n    return op\n", {"G": old, "T": torch.zeros(2)}, vars(mod))
        assert release_destroyed_groups(mod) == []  # the group is live: kept
        assert mod.f.__defaults__ == (1, old)
    finally:
        dist.destroy_process_group()
    assert release_destroyed_groups(mod) == ["f", "g"]
    assert mod.f.__defaults__ == (1, None) and mod.g.__kwdefaults__ == {"group": None}
    assert mod.h.__defaults__[0] == 1 and torch.equal(mod.h.__defaults__[1], torch.zeros(2)) and mod.f(0) is None
    assert release_destroyed_groups(mod) == []
    # a destroyed group is replaced even while another group is the default
    mod.f.__defaults__ = (1, old)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert release_destroyed_groups(mod) == ["f"] and mod.f.__defaults__ == (1, None)
    finally:
        dist.destroy_process_group()
    assert release_destroyed_groups(types.ModuleType("empty")) == []
    assert torch.distributed.is_initialized() is False
