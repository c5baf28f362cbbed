"""A store on object storage or in fsspec memory replaced under an open reader (another
writer's ``overwrite=True``) is reported as replaced when the reader next opens one of its
files, never read as the other run's rows (FORMAT.md §2 ``run_id``)."""

from __future__ import annotations

import uuid

import pytest
import torch

import activationscope as acs
from activationscope.errors import StoreError

from store_models import MLP, batches_mlp, capture_store

def _target(where: str, s3) -> tuple[str, dict | None]:
    name = f"replaced-{uuid.uuid4().hex}.zarr"
    if where == "s3":
        return f"s3://acs-bucket/{name}", s3
    return f"memory://acs/{name}", None


@pytest.fixture(params=["s3", "memory"])
def where(request):
    return request.param


def test_remote_store_replaced_under_reader_is_refused(where, request):
    s3 = request.getfixturevalue("s3") if where == "s3" else None
    url, so = _target(where, s3)
    torch.manual_seed(0)
    mlp = MLP()
    opts = {"chunk_rows": 4, "shard_bytes": 4 * 16 * 4 * 2, "storage_options": so, "overwrite": True}
    capture_store(mlp, batches_mlp(n_batches=4, seed=0), url, store_options=opts, reductions=["mean"])
    st = acs.open_store(url, storage_options=so)
    first = st["fc1.output"].clone()
    # another writer captures another run in its place, same layout (its files sit where the old ones were)
    capture_store(mlp, batches_mlp(n_batches=4, seed=1), url, store_options=opts, reductions=["mean"])
    other = acs.open_store(url, storage_options=so)
    assert not torch.equal(other["fc1.output"], first)  # (the two runs differ)
    for read in (lambda: st["act.output"], lambda: st.rows("fc2.output", 0, 20),
                 lambda: st.reductions["act.output"]["mean"], lambda: st.row_table(), lambda: st.verify()):
        with pytest.raises(StoreError, match="was replaced since it was opened"):
            read()
    try:  # rows already read: the opened run's (from the reader's cache), or refused; never the other run's
        again = st["fc1.output"]
    except StoreError as e:
        assert "was replaced since it was opened" in str(e)
    else:
        assert torch.equal(again, first)
    st.refresh()
    assert torch.equal(st["act.output"], other["act.output"])
