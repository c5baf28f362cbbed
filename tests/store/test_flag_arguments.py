"""True / False arguments of the store layer take a bool only: ``"False"`` from a config file
or an environment variable is a true string."""

from __future__ import annotations

import numpy as np
import pytest

import activationscope as acs
from activationscope.errors import ArgumentTypeError
from activationscope.store import commit_ranks, remove_if_empty


def test_remove_if_empty_remove_folder_takes_a_bool_only(tmp_path):
    # remove_folder="False" removed the folder the caller said existed before the capture
    folder = tmp_path / "run.zarr"
    acs.StoreWriter(folder).close()  # a store with no committed row
    with pytest.raises(ArgumentTypeError, match="remove_folder must be True or False, got 'False'"):
        remove_if_empty(str(folder), remove_folder="False")
    assert folder.is_dir()
    assert remove_if_empty(str(folder), remove_folder=np.bool_(False)) is True
    assert folder.is_dir() and list(folder.iterdir()) == []


def test_commit_ranks_verify_takes_a_bool_only(tmp_path):
    # checked before the target is looked at (verify="no" verified every shard, verify=0 none)
    with pytest.raises(ArgumentTypeError, match="verify must be True or False, got 'no'"):
        commit_ranks(str(tmp_path / "s.zarr"), verify="no")
