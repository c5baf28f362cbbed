"""Shared fixtures: devices (cuda marked gpu and skipped without CUDA), dtypes, small models."""

from __future__ import annotations

import socket

import pytest
import torch
from acs_testing import SmallCNN, small_transformer, toy_mlp  # noqa: F401

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]),
]
FLOAT_DTYPES = [torch.float32, torch.float16, torch.bfloat16]


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
