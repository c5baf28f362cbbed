"""Fixtures of the store tests."""

from __future__ import annotations

import socket

import pytest
import torch

from store_models import MLP


@pytest.fixture
def mlp():
    torch.manual_seed(0)
    return MLP().eval()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def s3():
    moto_server = pytest.importorskip("moto.server", reason="remote store test needs moto[server] (pip install 'moto[server]')")
    s3fs = pytest.importorskip("s3fs", reason="remote store test needs s3fs")
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=_free_port(), verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    options = {"key": "test", "secret": "test", "client_kwargs": {"endpoint_url": f"http://{host}:{port}"}}
    fs = s3fs.S3FileSystem(**options)
    if not fs.exists("acs-bucket"):
        fs.mkdir("acs-bucket")
    yield options
    server.stop()
