"""Mixture-of-experts models: each expert module is called with the tokens routed to it, a
number of rows that changes from forward to forward and is no sample's."""

from __future__ import annotations

import warnings

import torch

import activationscope as acs


class _FixedRouteMoE(torch.nn.Module):
    """Tokens flattened to (batch * pos, d); the first two go to expert 0, the others to
    expert 1 (a fixed routing: expert 0 gets 2 rows in every forward, as many as a batch of 2)."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(50, d)
        self.experts = torch.nn.ModuleList([torch.nn.Linear(d, d), torch.nn.Linear(d, d)])

    def forward(self, ids):
        h = self.embed(ids)
        flat = h.reshape(-1, h.shape[-1])
        out = torch.cat([self.experts[0](flat[:2]), self.experts[1](flat[2:])])
        return out.reshape(h.shape)


def test_expert_rows_as_many_as_the_samples_are_not_labelled_with_them(tmp_path):
    """Expert 0 got 2 rows in every forward of batches of 2 samples: the store took them for
    the samples' rows and gave them sample ids 0, 1 (2, 3 in the next forward) and the samples'
    labels, while they are tokens 0 and 1 of sample 0. They are now stored off the row table
    from the first forward, with a warning; the values are the expert's rows."""
    model = _FixedRouteMoE().eval()
    batches = [torch.randint(0, 50, (2, 3), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    scope = acs.ActivationScope(store=str(tmp_path / "moe.zarr"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad(), scope.track(model, include=["embed", "experts.*"]) as tracker:
            for i, ids in enumerate(batches):
                tracker.set_batch(label=[i, i])
                model(ids)
    messages = [str(w.message) for w in caught if "mixture-of-experts experts" in str(w.message)]
    assert len(messages) == 1
    assert "'experts.0.output'" in messages[0] and "in forward 0" in messages[0]
    store = acs.open_store(tmp_path / "moe.zarr")
    assert not store.follows_row_table("experts.0.output")
    assert not store.follows_row_table("experts.1.output")  # (4 rows: off the table by its count)
    assert store.follows_row_table("embed.output") and store.row_kind("embed.output") == "sample"
    with torch.no_grad():
        expected = torch.cat([model.experts[0](model.embed(ids).reshape(-1, 8)[:2]) for ids in batches])
    assert torch.equal(store["experts.0.output"], expected)
    assert store.row_table("sample").column("label").to_pylist() == [0, 0, 1, 1]


class _MultiGateMoE(torch.nn.Module):
    """A dense multi-gate mixture of experts (MMoE, as in recommendation models): every expert
    is given every sample's features (batch, d), and gates weigh their outputs."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.experts = torch.nn.ModuleList([torch.nn.Linear(d, 4) for _ in range(3)])
        self.gate = torch.nn.Linear(d, 3)

    def forward(self, x):
        out = torch.stack([e(x) for e in self.experts], 1)
        return (torch.softmax(self.gate(x), -1).unsqueeze(-1) * out).sum(1)


def test_experts_given_every_sample_keep_their_sample_rows(tmp_path):
    """Each expert of a dense mixture is called with the batch's features (batch, d): its rows
    are the samples'. They were stored off the row table all the same, without the samples'
    ids and columns, with a warning saying they are routed tokens. No hook point of the capture
    has positions, so they now stay sample rows, without a warning."""
    model = _MultiGateMoE().eval()
    xs = [torch.randn(5, 8, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    scope = acs.ActivationScope(store=str(tmp_path / "mmoe.zarr"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad(), scope.track(model) as tracker:
            for i, x in enumerate(xs):
                tracker.set_batch(sample_ids=torch.arange(10 * i, 10 * i + 5), label=[i] * 5)
                model(x)
    assert [str(w.message) for w in caught if "mixture-of-experts" in str(w.message)] == []
    store = acs.open_store(tmp_path / "mmoe.zarr")
    for k in range(3):
        hp = f"experts.{k}.output"
        assert store.follows_row_table(hp) and store.row_kind(hp) == "sample", hp
        with torch.no_grad():
            assert torch.equal(store[hp], torch.cat([model.experts[k](x) for x in xs])), hp
    table = store.row_table("sample")
    assert table.column("sample_id").to_pylist() == [10 * i + j for i in range(3) for j in range(5)]
    assert table.column("label").to_pylist() == [i for i in range(3) for _ in range(5)]
