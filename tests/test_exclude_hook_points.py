"""exclude_hook_points= leaves out single hook points (a leaf of a structured output) while the
other hook points of their module are captured: a BLOOM block returns its attention weights
(batch, heads, pos, pos) next to its hidden state, and the weights, one row per sample, change
shape with pos, so a capture of the blocks over text of varying length failed, advising to
exclude the block itself. Reference: the modules called in plain PyTorch."""

from __future__ import annotations

import warnings

import pytest
import torch

import activationscope as acs


class _Block(torch.nn.Module):
    """Returns (hidden (batch, pos, d), attention weights (batch, heads, pos, pos)), as BLOOM's."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, h, mask):
        scores = h @ h.transpose(1, 2) / 2 + (1.0 - mask[:, None, :].float()) * -1e4
        weights = scores.softmax(-1)[:, None].expand(-1, 2, -1, -1)        # 2 heads
        return h + self.proj(weights[:, 0] @ h), weights


class _Decoder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(20, 4)
        self.h = torch.nn.ModuleList([_Block(), _Block()])

    def forward(self, ids, mask):
        x = self.emb(ids)
        for block in self.h:
            x, _ = block(x, mask)
        return x


def _batches():
    g = torch.Generator().manual_seed(0)
    return [(torch.randint(0, 20, (2, 5), generator=g), torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])),
            (torch.randint(0, 20, (2, 3), generator=g), torch.tensor([[1, 1, 1], [1, 0, 0]]))]


def _reference(model, batches):
    rows = {"h.0.output.0": [], "h.1.output.0": []}
    with torch.no_grad():
        for ids, mask in batches:
            x = model.emb(ids)
            for i, block in enumerate(model.h):
                x, _ = block(x, mask)
                rows[f"h.{i}.output.0"].append(x[mask.bool()])
    return {k: torch.cat(v) for k, v in rows.items()}


def _capture(path, batches, model, **kwargs):
    with torch.no_grad(), acs.ActivationScope(store=str(path), reductions=["mean"], **kwargs).track(
            model, include=["h.?"]) as tracker:
        for ids, mask in batches:
            tracker.set_batch(attention_mask=mask)
            model(ids, mask)
    return tracker


def test_without_it_the_weights_fail_the_second_length_naming_exclude_hook_points(tmp_path):
    torch.manual_seed(0)
    model = _Decoder().eval()
    with pytest.raises(acs.CaptureError) as e:
        _capture(tmp_path / "s.zarr", _batches(), model)
    msg = str(e.value)
    assert "hook point 'h.0.output.1' changed its feature shape from (2, 5, 5) to (2, 3, 3)" in msg
    assert "alone with exclude_hook_points=['h.0.output.1'] (the other hook points of its module still captured)" in msg
    # (the fix that keeps the weights: it said only to leave them out)
    assert ("and those rows change shape with pos: pad every batch to one length (a tokenizer's "
            "padding=\"max_length\", max_length=N; the token rows of the other hook points still leave the padding "
            "out), so that its rows keep one shape, or leave it out of the capture") in msg


def test_batches_padded_to_one_length_keep_the_weights_and_the_token_rows_of_the_rest(tmp_path):
    """The fix the error gives first: every batch padded to one length (what a tokenizer's
    padding="max_length" does), so the weights keep one shape, one row per sample, and the
    hidden states are still stored one row per real token."""
    torch.manual_seed(0)
    model = _Decoder().eval()
    batches = []
    for ids, mask in _batches():
        pad = 5 - ids.shape[1]
        batches.append((torch.nn.functional.pad(ids, (0, pad)), torch.nn.functional.pad(mask, (0, pad))))
    _capture(tmp_path / "s.zarr", batches, model)
    store = acs.open_store(tmp_path / "s.zarr")
    want = _reference(model, batches)
    with torch.no_grad():
        weights = torch.cat([model.h[0](model.emb(ids), mask)[1] for ids, mask in batches])
    assert store.row_kind("h.0.output.1") == "sample" and torch.equal(store["h.0.output.1"], weights)
    assert store.row_kind("h.0.output.0") == "token" and torch.equal(store["h.0.output.0"], want["h.0.output.0"])


@pytest.mark.parametrize("where", ["scope", "track"])
def test_excluded_leaves_are_never_captured_and_the_rest_of_the_module_is(tmp_path, where):
    torch.manual_seed(0)
    model = _Decoder().eval()
    batches = _batches()
    path = tmp_path / "s.zarr"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if where == "scope":
            tracker = _capture(path, batches, model, exclude_hook_points=["h.*.output.1"])
        else:
            with torch.no_grad(), acs.ActivationScope(store=str(path), reductions=["mean"]).track(
                    model, include=["h.?"], exclude_hook_points="h.*.output.1") as tracker:
                for ids, mask in batches:
                    tracker.set_batch(attention_mask=mask)
                    model(ids, mask)
    assert [str(w.message) for w in caught if issubclass(w.category, acs.CaptureWarning)] == []
    store = acs.open_store(path)
    assert store.hook_points == ["h.0.output.0", "h.1.output.0"] and tracker.hook_points == store.hook_points
    want = _reference(model, batches)
    for hp, rows in want.items():
        assert store.row_kind(hp) == "token" and torch.equal(store[hp], rows)
        assert torch.allclose(store.reductions[hp]["mean"], rows.double().mean(0))
    assert sorted(store.reductions) == ["h.0.output.0", "h.1.output.0"]


def test_in_memory_records_and_reductions_leave_them_out_too():
    torch.manual_seed(0)
    model = _Decoder().eval()
    ids, mask = _batches()[0]
    with torch.no_grad(), acs.ActivationScope(reductions=["max"], exclude_hook_points=["h.1.output.1"]).track(
            model, include=["h.?"]) as tracker:
        tracker.set_batch(attention_mask=mask)
        model(ids, mask)
    assert sorted(tracker.activations) == ["h.0.output.0", "h.0.output.1", "h.1.output.0"]
    assert "h.1.output.1" not in tracker.reductions
    with torch.no_grad():
        x, w0 = model.h[0](model.emb(ids), mask)
        x1, _ = model.h[1](x, mask)
    assert torch.equal(tracker.activations["h.0.output.1"][0], w0)
    assert torch.equal(tracker.activations["h.1.output.0"][0], x1)


def test_a_module_whose_every_hook_point_is_excluded_is_not_called_silent_and_an_unused_pattern_warns(tmp_path):
    torch.manual_seed(0)
    model = _Decoder().eval()
    with pytest.warns(acs.CaptureWarning) as caught:
        tracker = _capture(tmp_path / "s.zarr", _batches(), model, exclude_hook_points=["h.0.output.1", "h.1.output.*", "h.9.*"])
    said = [str(w.message) for w in caught]
    assert len(said) == 1 and said[0].startswith(
        "exclude_hook_points pattern(s) ['h.9.*'] left out no hook point of the 2 captured forward(s), so they "
        "excluded nothing") and "recorded nothing" not in said[0]
    assert tracker.hook_points == ["h.0.output.0"]  # h.1 gave none, on purpose: not warned about as silent


def test_the_store_records_the_patterns(tmp_path):
    torch.manual_seed(0)
    _capture(tmp_path / "s.zarr", _batches(), _Decoder().eval(), exclude_hook_points=["h.*.output.1"])
    assert acs.open_store(tmp_path / "s.zarr").attrs["capture_config"]["exclude_hook_points"] == ["h.*.output.1"]


def test_patterns_must_be_strings():
    from activationscope.errors import ArgumentTypeError

    with pytest.raises(ArgumentTypeError, match="exclude_hook_points must be a list of fnmatch patterns"):
        acs.ActivationScope(exclude_hook_points=[1])
