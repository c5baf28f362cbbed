"""The reusable test suite of the storage contract (``StoreBackend``), as zarr-python's
``zarr.testing.store.StoreTests``: every backend subclasses :class:`BackendTests` and gives
a ``backend`` fixture of an empty store; ``tests/store/test_backend_contract.py`` runs it for
local, memory, fsspec ``memory://`` and S3 (moto) backends."""

from __future__ import annotations

import threading

import pytest

from activationscope.errors import StoreCorruptError
from activationscope.store._backend import LOCK_KEY, Capabilities, StoreBackend

BAD_KEYS = ["../x", "a/../../x", "/etc/passwd", "a//b", "a/./b", "", "a\\..\\b", "a/\x00b", ".."]


class BackendTests:
    """Subclass and define a ``backend`` fixture returning an empty backend."""

    def test_is_a_store_backend(self, backend):
        assert isinstance(backend, StoreBackend)
        assert isinstance(backend.capabilities, Capabilities)
        assert backend.capabilities.atomic_write

    def test_set_get_size_roundtrip(self, backend):
        assert backend.is_empty()
        backend.set("a/b/c.bin", b"\x00\x01hello")
        assert backend.get("a/b/c.bin") == b"\x00\x01hello"
        assert backend.size("a/b/c.bin") == 7
        backend.set("a/b/c.bin", b"new")  # replaced whole
        assert backend.get("a/b/c.bin") == b"new" and backend.size("a/b/c.bin") == 3
        assert not backend.is_empty()

    def test_missing_keys(self, backend):
        assert backend.get("nope") is None
        assert backend.size("nope") is None
        assert backend.get_range("nope", 0, 4) is None
        backend.delete("nope")  # nothing happens

    def test_get_range(self, backend):
        backend.set("r", bytes(range(100)))
        assert backend.get_range("r", 10, 5) == bytes(range(10, 15))
        assert backend.get_range("r", 95, 10) == bytes(range(95, 100))  # fewer at the end
        assert backend.get_range("r", 100, 10) == b""
        assert backend.get_range("r", 250, 10) == b""  # (past the end: an object store refuses the range)
        assert backend.get_range("r", 10, 0) == b"" and backend.get_range("nope", 10, 0) is None

    def test_tail(self, backend):
        backend.set("r", bytes(range(100)))
        assert backend.tail("r", 5) == (100, bytes(range(95, 100)))
        assert backend.tail("r", 200) == (100, bytes(range(100)))  # the whole object when shorter
        assert backend.tail("r", 0) == (100, b"")
        assert backend.tail("nope", 5) is None

    @pytest.mark.parametrize("hint", [100, 99, 101, 4, 0, None, True])
    def test_tail_with_a_size_hint_gives_the_real_size_and_end(self, backend, hint):
        """A size hint (a manifest's record) right, too small, too large or unusable: the
        object's real size and last bytes, never the bytes before a wrong end."""
        backend.set("r", bytes(range(100)))
        assert backend.tail("r", 5, size_hint=hint) == (100, bytes(range(95, 100)))
        assert backend.tail("nope", 5, size_hint=hint) is None

    def test_list_and_delete(self, backend):
        for key in ("x/1", "x/2/3", "y/1", "zarr.json"):
            backend.set(key, key.encode())
        assert sorted(backend.list("")) == ["x/1", "x/2/3", "y/1", "zarr.json"]
        assert sorted(backend.list("x/")) == ["x/1", "x/2/3"]
        backend.delete("x/1")
        assert sorted(backend.list("x/")) == ["x/2/3"]
        assert backend.exists()

    def test_size_cap(self, backend):
        backend.set("big", b"x" * 1000)
        assert backend.get("big", max_bytes=1000) == b"x" * 1000
        with pytest.raises(StoreCorruptError, match="'big' holds 1000 bytes, more than the 999"):
            backend.get("big", max_bytes=999)

    @pytest.mark.parametrize("key", BAD_KEYS)
    def test_keys_outside_the_store_are_refused(self, backend, key):
        for op in (lambda: backend.get(key), lambda: backend.set(key, b"x"), lambda: backend.delete(key),
                   lambda: backend.size(key), lambda: backend.set_if_absent(key, b"x")):
            with pytest.raises(StoreCorruptError, match="must be a relative path inside the store"):
                op()
        assert backend.is_empty()

    def test_set_if_absent(self, backend):
        assert backend.set_if_absent("m", b"first") is True
        assert backend.set_if_absent("m", b"second") is False
        assert backend.get("m") == b"first"

    def test_conditional_write_has_one_winner(self, backend):
        if not backend.capabilities.conditional_write:
            pytest.skip("this backend states no conditional write")
        wins = []

        def race(i):
            if backend.set_if_absent("lock", str(i).encode()):
                wins.append(i)

        threads = [threading.Thread(target=race, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(wins) == 1 and backend.get("lock") == str(wins[0]).encode()

    def test_lock_key_is_not_data(self, backend):
        backend.set("d", b"1")
        assert backend.set_if_absent(LOCK_KEY, b"holder")
        assert LOCK_KEY not in list(backend.list(""))
        backend.clear()
        assert backend.is_empty() and backend.get("d") is None
        assert backend.get(LOCK_KEY) == b"holder"  # clear() keeps the writer lock
        backend.delete(LOCK_KEY)

    def test_zarr_store_sees_the_same_objects(self, backend):
        from zarr.core.buffer import default_buffer_prototype
        from zarr.core.sync import sync

        backend.set("k/v", b"abc")
        buf = sync(backend.zarr_store(read_only=True).get("k/v", prototype=default_buffer_prototype()))
        assert buf.to_bytes() == b"abc"
