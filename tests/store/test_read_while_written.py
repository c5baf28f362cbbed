"""Reading a store while its capture writes it, from another process or thread."""

from __future__ import annotations

import pytest
import torch

from activationscope.errors import HookPointNotFoundError
from activationscope.store import StoreWriter, open_store


def test_a_hook_point_of_a_store_before_its_first_commit_says_why_it_is_missing(tmp_path):
    """A store opened while its capture has committed nothing yet lists no hook points:
    ``store[hp]`` said only "it has []", as for a mistyped name; now it says the store is
    incomplete, that hook points appear with the first commit, and to refresh."""
    path = tmp_path / "s.zarr"
    w = StoreWriter(path, capture_config={}, model=None, storage_dtype=None)
    try:
        store = open_store(path)
        assert store.status == "incomplete" and store.hook_points == []
        with pytest.raises(HookPointNotFoundError, match=r"it has \[\]: the store is incomplete .*"
                           r"hook points appear with its first commit; call store.refresh\(\)"):
            store["a"]
        arr = w.open_array("a", (3,), torch.float32, "sample")
        arr.append(torch.arange(6.0).reshape(2, 3))
        w.add_batch(2, [0, 1], None, {})
    finally:
        w.close()
    store.refresh()
    assert torch.equal(store["a"], torch.arange(6.0).reshape(2, 3))
    with pytest.raises(HookPointNotFoundError) as e:  # a store with hook points: a name it lacks
        store["b"]
    assert str(e.value).endswith("it has ['a']")
