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
