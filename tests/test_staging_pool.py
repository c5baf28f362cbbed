"""The process-wide staging pool of in-memory captures: its cap (``set_staging_pool_bytes``,
``$ACS_STAGING_POOL_BYTES``) bounds the bytes it keeps for reuse."""

from __future__ import annotations

import gc
import os
import subprocess
import sys

import pytest
import torch

import activationscope as acs
from activationscope.errors import ArgumentValueError

SLAB = 64 << 20


def _C():
    from activationscope.capture import _native

    return _native.load()


def test_lowering_the_cap_frees_the_slabs_pooled_past_it():
    C = _C()
    cap = C.staging_pool_bytes()
    model = torch.nn.Linear(256, 4096)
    x = torch.randn(1024, 256)  # 16 MiB per record: 14 records fill 4 slabs
    try:
        C.set_staging_pool_bytes(1 << 30)
        with torch.no_grad(), acs.ActivationScope().track(model) as tr:
            for _ in range(14):
                model(x)
        assert [len(v) for v in tr.activations.values()] == [14]
        del tr
        gc.collect()
        assert C.pooled_staging_bytes() >= 3 * SLAB  # the records' slabs came back to the pool
        C.set_staging_pool_bytes(SLAB)
        assert C.staging_pool_bytes() == SLAB
        assert C.pooled_staging_bytes() <= SLAB  # what the new cap allows, not what was kept before
        C.set_staging_pool_bytes(0)
        assert C.pooled_staging_bytes() == 0
    finally:
        C.set_staging_pool_bytes(cap)


def _run(code: str, value: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, ACS_STAGING_POOL_BYTES=value)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("value", ["512MiB", "1e9", "-1", " 5"])
def test_a_pool_cap_in_the_environment_that_is_not_bytes_is_refused(value):
    code = ("import activationscope as acs\n"
            "from activationscope.errors import ArgumentValueError\n"
            "try:\n    acs.ActivationScope()\nexcept ArgumentValueError as e:\n    print('REFUSED', e)\n"
            "else:\n    print('ACCEPTED')\n")
    out = _run(code, value)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("REFUSED"), out.stdout
    assert "ACS_STAGING_POOL_BYTES" in out.stdout and repr(value) in out.stdout


def test_a_pool_cap_in_the_environment_in_bytes_is_the_cap():
    code = ("import activationscope as acs\nfrom activationscope.capture import _native\n"
            "acs.ActivationScope()\nprint(_native.load().staging_pool_bytes())\n")
    out = _run(code, str(3 * SLAB))
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) == 3 * SLAB


def test_the_native_pool_does_not_read_a_size_with_a_unit_as_a_few_bytes():
    # the extension read "64MiB" as 64 bytes (no slab kept for reuse at all); it keeps its
    # default instead, and the Python side refuses the value (above)
    code = "from activationscope.capture import _native\nprint(_native.load().staging_pool_bytes())\n"
    out = _run(code, "64MiB")
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) == 1 << 30


def test_check_pool_env_is_quiet_when_unset(monkeypatch):
    from activationscope.capture import _native

    monkeypatch.delenv("ACS_STAGING_POOL_BYTES", raising=False)
    _native.check_pool_env()
    monkeypatch.setenv("ACS_STAGING_POOL_BYTES", "12x")
    with pytest.raises(ArgumentValueError, match="ACS_STAGING_POOL_BYTES"):
        _native.check_pool_env()


def _anon_rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) << 10
    raise AssertionError("no RssAnon in /proc/self/status")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc_trim, /proc")
def test_clear_gives_back_the_memory_of_its_records_descriptors():
    import ctypes

    trim = ctypes.CDLL("libc.so.6").malloc_trim
    C = _C()
    model = torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in range(200)])
    x = torch.randn(1, 2)
    C.set_staging_prefault(False)  # no slab prepared in the background while measuring
    try:
        with torch.no_grad(), acs.ActivationScope().track(model) as tr:
            for _ in range(2000):  # 400,000 records of 8 bytes each
                model(x)
        tr.clear()
        gc.collect()
        trim(0)
        cleared = _anon_rss()
        assert [len(v) for v in tr.activations.values()] == [0] * 200
        del tr
        gc.collect()
        trim(0)
        dropped = _anon_rss()
    finally:
        C.set_staging_prefault(True)
    # clear() kept each record list's capacity: about 160 bytes a record, 64 MB here, that only
    # dropping the tracker gave back
    assert cleared - dropped < 24 << 20, (cleared, dropped)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork")
def test_a_forked_child_keeps_the_cap_set_in_its_parent():
    C = _C()
    cap = C.staging_pool_bytes()
    try:
        C.set_staging_pool_bytes(2 * SLAB)
        C.pooled_staging_bytes()  # (the pool is in use in the parent)
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: report its cap, then leave without running any cleanup
            try:
                os.write(w, str(C.staging_pool_bytes()).encode())
            finally:
                os._exit(0)
        os.close(w)
        got = os.read(r, 64).decode()
        os.close(r)
        os.waitpid(pid, 0)
    finally:
        C.set_staging_pool_bytes(cap)
    # the child took the environment's cap (1 GiB by default) instead, as if never set
    assert int(got) == 2 * SLAB
