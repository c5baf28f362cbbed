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


def test_a_store_being_overwritten_before_its_first_commit_names_the_old_store_aside(tmp_path):
    """A local overwrite=True before its first commit (still running, or killed there) leaves
    a new store with no rows at the path and the old store whole in a folder next to it: a
    reader saw an empty incomplete store and nothing else, as if the old rows were lost; now
    opening it warns, naming that folder and the ways out. Once the new store commits, or
    for a store with rows, nothing is said."""
    import warnings

    path = tmp_path / "s.zarr"
    w = StoreWriter(path, capture_config={}, model=None, storage_dtype=None)
    w.open_array("a", (3,), torch.float32, "sample").append(torch.ones(2, 3))
    w.add_batch(2, [0, 1], None, {})
    w.close()
    w = StoreWriter(path, capture_config={}, model=None, storage_dtype=None, overwrite=True)
    try:
        aside = [p for p in tmp_path.iterdir() if p.name.startswith(".s.zarr.replaced-")]
        assert len(aside) == 1 and (aside[0] / "zarr.json").exists()
        with pytest.warns(UserWarning, match=rf"holds no rows yet: an overwrite=True .* the store it replaces is in "
                                             rf"'{aside[0]}' until then"):
            store = open_store(path)
        assert store.status == "incomplete" and store.hook_points == []
        assert torch.equal(open_store(aside[0])["a"], torch.ones(2, 3))  # whole, there
        w.open_array("a", (3,), torch.float32, "sample").append(torch.zeros(1, 3))
        w.add_batch(1, [0], None, {})
    finally:
        w.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(open_store(path)["a"], torch.zeros(1, 3))
