"""Rank stores whose row-table parts their commits merged (store/FORMAT.md sections 4 and 10):
each rank task's writer merges its parts as any writer does; the store read before
``consolidate`` (every rank's rows) and the committed store (one part of every rank's rows)
hold the tables of rank stores never merged."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import activationscope as acs
from activationscope.store import writer as W
from activationscope.store.ranks import commit_ranks, rank_target
from acs_testing import store_target

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from test_capture_again import WORLD, _model, _task  # noqa: E402


@pytest.mark.parametrize("where", ["local", "memory"])
def test_rank_stores_whose_parts_were_merged_commit_the_tables_of_unmerged_ones(request, where, monkeypatch):
    monkeypatch.setattr(W, "ROW_PART_MERGE_FACTOR", 2)
    maybe_commit = W.StoreWriter.maybe_commit

    def drained(self):  # every forward's shards durable before it asks: a commit after each forward
        self._core.drain()
        return maybe_commit(self)

    monkeypatch.setattr(W.StoreWriter, "maybe_commit", drained)
    found = {}
    for merge in (False, True):
        url, so = store_target(request, where, "rank-merges", bucket="acs-ranks")
        monkeypatch.setattr(W, "ROW_PARTS_BEFORE_MERGE", 2 if merge else 1 << 40)
        for task in range(WORLD):
            _task(url, so, task, WORLD, _model(0))
        parts = [acs.open_store(rank_target(url, r), storage_options=so).attrs["row_tables"]["sample"]["parts"]
                 for r in range(WORLD)]
        assert any(key.count("-") == 2 for p in parts for key in p) == merge, parts  # (merged: part-<a>-<b>.parquet)
        pending = acs.open_store(url, storage_options=so)
        before = pending.row_table("sample")
        assert pending.verify() == []
        commit_ranks(url, storage_options=so)
        st = acs.open_store(url, storage_options=so)
        assert st.verify() == [] and len(st.attrs["row_tables"]["sample"]["parts"]) == 1
        found[merge] = (before, st.row_table("sample"))
    assert found[True][0].equals(found[False][0]) and found[True][1].equals(found[False][1])
    assert sorted(found[True][1].column("sample_id").to_pylist()) == list(range(21 * 7))
