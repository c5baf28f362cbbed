"""Chunk buffers written by the store's writer thread are reused for later chunks (of any
array whose chunks have the same byte size, whatever its dtype): every stored row must still
be exactly the row the model produced, the last chunk's padding included."""

from __future__ import annotations

import torch

import activationscope as acs
from activationscope.cli import main as cli_main


class Mixed(torch.nn.Module):
    """Hook points whose chunks have the same bytes with different dtypes and shapes:
    float32 (4,), float64 (2,), int16 (8,), bool (16,) rows are all 16 bytes."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Identity()
        self.b = torch.nn.Identity()
        self.c = torch.nn.Identity()
        self.d = torch.nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.a(x)
        self.b(x[:, :2].double() * 3)
        self.c((x.repeat(1, 2) * 100).to(torch.int16))
        self.d(x.repeat(1, 4) > 0)
        return x


def test_reused_chunk_buffers_keep_every_row_exact(tmp_path):
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(int(n), 4, generator=g) for n in torch.randint(1, 9, (60,), generator=g)]
    path = tmp_path / "s.zarr"
    model = Mixed()
    # 4-row chunks, 2 chunks per shard: hundreds of chunks, far more than ever in flight
    scope = acs.ActivationScope(store=str(path), store_options={"chunk_rows": 4, "shard_bytes": 4 * 16 * 2})
    with torch.no_grad(), scope.track(model, include=["a", "b", "c", "d"]):
        for x in xs:
            model(x)
    x = torch.cat(xs)
    store = acs.open_store(path)
    assert torch.equal(store["a.output"], x)
    assert torch.equal(store["b.output"], x[:, :2].double() * 3)
    assert torch.equal(store["c.output"], (x.repeat(1, 2) * 100).to(torch.int16))
    assert torch.equal(store["d.output"], x.repeat(1, 4) > 0)
    assert cli_main(["verify", str(path)]) == 0  # the last chunk's padding is zeros, CRCs match


def test_reused_chunk_buffers_across_two_stores(tmp_path):
    # two stores written one after the other from one model: each gets its own rows
    lin = torch.nn.Linear(8, 8)
    g = torch.Generator().manual_seed(1)
    for k in range(2):
        xs = [torch.randn(5, 8, generator=g) for _ in range(30)]
        path = tmp_path / f"s{k}.zarr"
        with torch.no_grad(), acs.ActivationScope(store=str(path), store_options={"chunk_rows": 3}).track(lin):
            for x in xs:
                lin(x)
        with torch.no_grad():
            ref = torch.cat([lin(x) for x in xs])  # per batch, as captured (a matmul of other batch sizes may round differently)
        assert torch.equal(acs.open_store(path)["output"], ref)
