"""Shared fixtures: devices (cuda marked gpu and skipped without CUDA), dtypes, small models,
a user package of models (what the CLI and ``capture_dataset`` import), an S3 server."""

from __future__ import annotations

import faulthandler
import socket
import sys
import textwrap

import numpy as np
import pytest
import torch
from acs_testing import SmallCNN, remove_killed_folders, small_transformer, toy_mlp  # noqa: F401

try:  # property tests draw the same examples in every run (a CI run fails only where the code does);
    # HYPOTHESIS_PROFILE=explore draws new ones, to look for more
    from hypothesis import settings as _hyp_settings

    _hyp_settings.register_profile("ci", derandomize=True)
    _hyp_settings.register_profile("explore", derandomize=False)
    import os as _os

    _hyp_settings.load_profile(_os.environ.get("HYPOTHESIS_PROFILE", "ci"))
except ImportError:
    pass

# pytest-timeout (``timeout`` in pyproject.toml) fails a test stuck in Python after 600 s. A
# test stuck inside a native call never returns to Python to be interrupted: past this limit
# every thread's stack is printed and the run ends, instead of stalling until its time is up.
HARD_LIMIT_S = 900


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    faulthandler.dump_traceback_later(HARD_LIMIT_S, exit=True)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


DEVICES = [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]),
]
FLOAT_DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture(autouse=True)
def _killed_folders_removed():
    """The temporary folders of writers a test "killed" (acs_testing.die_at) go when it ends."""
    yield
    remove_killed_folders()


@pytest.fixture(params=DEVICES)
def device(request):
    return torch.device(request.param)


@pytest.fixture(params=FLOAT_DTYPES, ids=lambda d: str(d).replace("torch.", ""))
def float_dtype(request):
    return request.param


@pytest.fixture
def mlp():
    return toy_mlp()


@pytest.fixture
def cnn():
    return SmallCNN().eval()


@pytest.fixture
def transformer():
    return small_transformer().eval()


@pytest.fixture
def user_package(tmp_path, monkeypatch):
    """Make a package of models importable as ``<name>.nets:<factory>`` from the working directory.

    ``user_package(name, nets, data=(rows, features, seed), **modules)`` writes
    ``tmp_path/<name>/nets.py`` (``nets``, dedented) and one ``<module>.py`` per keyword, makes
    ``tmp_path`` the working directory and the front of ``sys.path``, and returns the path of
    an ``.npy`` of float32 standard normal data of shape (rows, features) drawn with ``seed``
    (None without ``data``). The package's modules are unloaded after the test.
    """
    made: list[str] = []

    def make(name: str, nets: str, data: tuple[int, int, int] | None = None, **modules: str):
        pkg = tmp_path / name
        pkg.mkdir()
        (pkg / "__init__.py").write_text("")
        (pkg / "nets.py").write_text(textwrap.dedent(nets))
        for module, source in modules.items():
            (pkg / f"{module}.py").write_text(source)
        monkeypatch.chdir(tmp_path)
        monkeypatch.syspath_prepend(str(tmp_path))
        made.append(name)
        if data is None:
            return None
        rows, features, seed = data
        x = tmp_path / "x.npy"
        np.save(x, np.random.default_rng(seed).standard_normal((rows, features)).astype(np.float32))
        return x

    yield make
    for name in [m for m in sys.modules if m.split(".")[0] in made]:
        del sys.modules[name]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def s3():
    """fsspec ``storage_options`` of a moto S3 server on 127.0.0.1 (one per test session),
    with the buckets ``acs-bucket`` (store tests) and ``acs-ranks`` (rank stores). Skipped
    without moto[server] and s3fs."""
    moto_server = pytest.importorskip("moto.server", reason="S3 tests need moto[server] (pip install 'moto[server]')")
    s3fs = pytest.importorskip("s3fs", reason="S3 tests need s3fs")
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=_free_port(), verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    options = {"key": "test", "secret": "test", "client_kwargs": {"endpoint_url": f"http://{host}:{port}"}}
    fs = s3fs.S3FileSystem(**options)
    for bucket in ("acs-bucket", "acs-ranks"):
        if not fs.exists(bucket):
            fs.mkdir(bucket)
    yield options
    server.stop()
