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
