"""Every backend passes the storage contract's test suite (``backend_suite.BackendTests``)."""

from __future__ import annotations

import uuid

import pytest
import zarr

from activationscope.store._backend import FsspecBackend, LocalBackend, MemoryBackend, resolve

from backend_suite import BackendTests


class TestLocalBackend(BackendTests):
    @pytest.fixture
    def backend(self, tmp_path):
        b = resolve(tmp_path / "s.zarr")
        assert isinstance(b, LocalBackend) and b.capabilities.mmap and b.capabilities.atomic_rename
        return b


class TestMemoryBackend(BackendTests):
    @pytest.fixture
    def backend(self):
        b = resolve(zarr.storage.MemoryStore())
        assert isinstance(b, MemoryBackend) and b.capabilities.conditional_write
        return b


class TestFsspecMemoryBackend(BackendTests):
    @pytest.fixture
    def backend(self):
        b = resolve(f"memory://acs-contract-{uuid.uuid4().hex}/s.zarr")
        assert isinstance(b, FsspecBackend) and b.capabilities.conditional_write
        return b


class TestS3Backend(BackendTests):
    @pytest.fixture
    def backend(self, s3):
        b = resolve(f"s3://acs-bucket/contract-{uuid.uuid4().hex}.zarr", storage_options=s3)
        assert isinstance(b, FsspecBackend) and b.capabilities.conditional_write
        return b


def test_a_negative_start_of_a_ranged_read_is_refused():
    from activationscope.errors import ArgumentValueError

    backend = MemoryBackend(zarr.storage.MemoryStore())
    backend.set("r", bytes(range(10)))
    with pytest.raises(ArgumentValueError, match=r"get_range of 'r': start must be 0 or more, got -1"):
        backend.get_range("r", -1, 4)
