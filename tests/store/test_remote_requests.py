"""Requests of a sequential read of a store on object storage (moto S3): each one costs a
round trip there, so a shard's index is read once however many chunks of it decode side by
side, and a ranged read asks for no size first. Rows read equal the captured ones."""

from __future__ import annotations

import collections
import uuid

import pytest
import torch

import activationscope as acs


def test_a_sequential_read_of_an_s3_store_makes_few_requests_per_shard(s3, monkeypatch):
    endpoint = pytest.importorskip("aiobotocore.endpoint")
    url = f"s3://acs-bucket/requests-{uuid.uuid4().hex}.zarr"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16))
    batches = [torch.randn(8, 16) for _ in range(6)]
    options = {"storage_options": s3, "chunk_rows": 4, "shard_rows": 8}
    with acs.ActivationScope(store=url, store_options=options).track(model, include=["0"]), torch.no_grad():
        for x in batches:
            model(x)
    with torch.no_grad():
        want = torch.cat([model(x) for x in batches])

    requests: collections.Counter = collections.Counter()
    send = endpoint.AioEndpoint._send

    async def counted(self, request):
        key = request.url.split("?")[0].split(".zarr/")[-1]
        requests[(request.method, key)] += 1
        return await send(self, request)

    monkeypatch.setattr(endpoint.AioEndpoint, "_send", counted)
    ds = acs.ActivationDataset(url, open_options={"storage_options": s3})
    requests.clear()
    got = torch.cat([ds[i:i + 8]["0.output"] for i in range(0, len(ds), 8)])
    assert torch.equal(got, want)
    shards = {key for _, key in requests if key.startswith("acts/0.output/c/")}
    assert len(shards) == 6
    for key in shards:
        # the shard's size (one HEAD), its index and its 2 chunks (3 ranged GETs); before: 16
        # HEADs (two per size, a size before every ranged read, the index read by each chunk)
        # and 5 GETs
        assert requests[("HEAD", key)] <= 1, (key, requests)
        assert requests[("GET", key)] <= 3, (key, requests)
