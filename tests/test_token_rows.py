"""``rows="token"``: one row per token without an attention mask, taken from the (batch, pos)
of the model's first input; a mask, when given, still leaves padding out."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import activationscope as acs


class TinyLM(torch.nn.Module):
    """Token ids (batch, pos) -> embeddings -> two blocks -> a pooled (batch, d) head."""

    def __init__(self, vocab: int = 50, d: int = 8) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(vocab, d)
        self.block0 = torch.nn.Linear(d, d)
        self.block1 = torch.nn.Linear(d, d)
        self.head = torch.nn.Linear(d, 3)

    def forward(self, ids):
        x = self.block1(torch.relu(self.block0(self.embed(ids))))
        return self.head(x.mean(1))


def _batches():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 50, (3, 5), generator=g), torch.randint(0, 50, (2, 7), generator=g)]


def test_store_has_one_row_per_token_in_sample_position_order(tmp_path):
    model = TinyLM().eval()
    scope = acs.ActivationScope(store=tmp_path / "s.zarr", rows="token", reductions=["mean"])
    with torch.no_grad(), scope.track(model, include=["block0", "block1", "head"]):
        for ids in _batches():
            model(ids)
    store = acs.open_store(tmp_path / "s.zarr")
    with torch.no_grad():  # plain PyTorch reference
        ref0 = torch.cat([model.block0(model.embed(ids)).reshape(-1, 8) for ids in _batches()])
        heads = torch.cat([model(ids) for ids in _batches()])
    assert store.row_kind("block0.output") == "token" and store.row_kind("head.output") == "sample"
    assert torch.equal(store["block0.output"], ref0)
    assert store.n_rows("block1.output") == 3 * 5 + 2 * 7
    assert torch.equal(store["head.output"], heads)  # (batch, 3): not (batch, pos), one row per sample
    table = store.row_table("token")
    assert table["sample_id"].to_pylist() == [s for s in range(3) for _ in range(5)] + [s for s in (3, 4) for _ in range(7)]
    assert table["pos"].to_pylist() == list(range(5)) * 3 + list(range(7)) * 2
    assert torch.allclose(store.reductions["block0.output"]["mean"], ref0.double().mean(0))
    assert store.attrs["capture_config"]["rows"] == "token"


def test_without_rows_token_a_sequence_output_is_one_row_per_sample(tmp_path):
    model = TinyLM().eval()
    ids = _batches()[0]
    with torch.no_grad(), acs.ActivationScope(store=tmp_path / "s.zarr").track(model, include=["block0"]):
        model(ids)
    store = acs.open_store(tmp_path / "s.zarr")
    assert store.row_kind("block0.output") == "sample" and store["block0.output"].shape == (3, 5, 8)


def test_a_mask_still_leaves_padding_out(tmp_path):
    model = TinyLM().eval()
    ids = _batches()[0]
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0]])
    scope = acs.ActivationScope(store=tmp_path / "s.zarr", rows="token")
    with torch.no_grad(), scope.track(model, include=["block0"]) as tracker:
        tracker.set_batch(attention_mask=mask)
        model(ids)
    store = acs.open_store(tmp_path / "s.zarr")
    with torch.no_grad():
        ref = model.block0(model.embed(ids))[mask.bool()]
    assert torch.equal(store["block0.output"], ref)
    assert store.row_table("token")["pos"].to_pylist() == [0, 1, 2, 3, 4, 0, 1, 0, 1, 2]


def test_set_batch_without_a_mask_keeps_every_token(tmp_path):
    # sample ids and columns without attention_mask: every position is a token, as with no
    # set_batch at all (this raised "needs an attention mask ... got mask (0,)")
    model = TinyLM().eval()
    batches = _batches()
    scope = acs.ActivationScope(store=tmp_path / "s.zarr", rows="token", reductions=["mean"])
    with torch.no_grad(), scope.track(model, include=["block0", "head"]) as tracker:
        first = 10
        for ids in batches:
            n = ids.shape[0]
            tracker.set_batch(sample_ids=range(first, first + n), label=[7] * n, token_ids=ids)
            model(ids)
            first += n
    store = acs.open_store(tmp_path / "s.zarr")
    with torch.no_grad():  # plain PyTorch reference
        ref = torch.cat([model.block0(model.embed(ids)).reshape(-1, 8) for ids in batches])
        heads = torch.cat([model(ids) for ids in batches])
    assert store.row_kind("block0.output") == "token" and torch.equal(store["block0.output"], ref)
    assert torch.equal(store["head.output"], heads)
    assert torch.allclose(store.reductions["block0.output"]["mean"], ref.double().mean(0))
    table = store.row_table("token")
    assert table["sample_id"].to_pylist() == [s for s in (10, 11, 12) for _ in range(5)] + [s for s in (13, 14) for _ in range(7)]
    assert table["pos"].to_pylist() == list(range(5)) * 3 + list(range(7)) * 2
    assert table["token_ids"].to_pylist() == torch.cat([ids.reshape(-1) for ids in batches]).tolist()
    assert store.row_table("sample")["label"].to_pylist() == [7] * 5


def test_a_mask_then_a_batch_without_one_keeps_every_token_of_the_later_batch(tmp_path):
    model = TinyLM().eval()
    ids0, ids1 = _batches()
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0]])
    scope = acs.ActivationScope(store=tmp_path / "s.zarr", rows="token")
    with torch.no_grad(), scope.track(model, include=["block0"]) as tracker:
        tracker.set_batch(attention_mask=mask)
        model(ids0)
        tracker.set_batch(sample_ids=[3, 4])
        model(ids1)
    store = acs.open_store(tmp_path / "s.zarr")
    with torch.no_grad():
        ref = torch.cat([model.block0(model.embed(ids0))[mask.bool()], model.block0(model.embed(ids1)).reshape(-1, 8)])
    assert torch.equal(store["block0.output"], ref)
    assert store.row_table("token")["pos"].to_pylist() == [0, 1, 2, 3, 4, 0, 1, 0, 1, 2] + list(range(7)) * 2


def test_in_memory_reductions_and_embedding_inputs(transformer):
    # an encoder fed embeddings (batch, pos, d): (batch, pos) are the input's first two dims
    x = torch.randn(4, 6, 16)
    scope = acs.ActivationScope(rows="token", reductions=["mean", "max"])
    with torch.no_grad(), scope.track(transformer, include=["layers.0"]) as tracker:
        transformer(x)
    with torch.no_grad():
        ref = transformer.layers[0](x).reshape(-1, 16).double()
    assert torch.allclose(tracker.reductions["layers.0.output"]["mean"], ref.mean(0), atol=1e-6)
    assert torch.allclose(tracker.reductions["layers.0.output"]["max"], ref.max(0).values, atol=1e-6, rtol=0)
    assert tracker.activations["layers.0.output"][0].shape == (4, 6, 16)  # records keep their shape


def test_rows_token_of_an_mlps_features_is_warned_about_once(tmp_path):
    # an MLP fed (batch, features) floats stored each feature as a token row of one value, without a word
    mlp = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(0))
    with pytest.warns(acs.CaptureWarning) as caught:
        with torch.no_grad(), acs.ActivationScope(store=tmp_path / "s.zarr", rows="token").track(mlp):
            mlp(x)
            mlp(x)
    texts = [str(w.message) for w in caught if "floating-point (batch, features)" in str(w.message)]
    assert texts == [
        "rows='token' took (batch, pos) = (5, 4) from the model's first tensor input in forward 0, input of shape "
        "(5, 4): floating-point (batch, features), not token ids (batch, pos) or embeddings (batch, pos, d), so "
        "'0.output', '1.output' stored 4 token rows per sample, one value each, one per feature given as its pos. For "
        "one row per sample (an MLP's features), leave rows='token' out (rows='auto') or pass token_rows=False; for "
        "token rows of a sequence model, give tracker.set_batch(attention_mask=...) a mask of its (batch, pos) before "
        "each forward (warned once per capture)"]
    store = acs.open_store(tmp_path / "s.zarr")  # stored as the warning says
    assert store.row_kind("0.output") == "token" and store["0.output"].shape == (40,)
    assert store.row_kind("2.output") == "sample"


@pytest.mark.parametrize("model, x", [
    (TinyLM(), _batches()[0]),                                                  # token ids
    (torch.nn.Sequential(torch.nn.Unflatten(1, (6, 1)), torch.nn.Linear(1, 8)),  # a sequence of values, embedded
     torch.randn(3, 6)),
])
def test_rows_token_of_ids_or_a_sequence_of_values_is_not_warned_about_as_features(tmp_path, model, x):
    with warnings.catch_warnings():
        warnings.simplefilter("error", acs.CaptureWarning)
        with torch.no_grad(), acs.ActivationScope(store=tmp_path / "s.zarr", rows="token").track(model):
            model(x)
    store = acs.open_store(tmp_path / "s.zarr")
    assert any(store.row_kind(hp) == "token" for hp in store.hook_points)


def test_rows_is_validated():
    with pytest.raises(ValueError, match=r"rows must be one of \['auto', 'token'\], got 'tokens'"):
        acs.ActivationScope(rows="tokens")


def test_token_rows_with_hf_keyword_inputs(tmp_path):
    class KwModel(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.embed = torch.nn.Embedding(20, 4)

        def forward(self, input_ids=None):
            return self.embed(input_ids)

    model = KwModel()
    ids = torch.randint(0, 20, (2, 3))
    with torch.no_grad(), acs.ActivationScope(store=tmp_path / "s.zarr", rows="token").track(model, include=["embed"]):
        model(input_ids=ids)
    store = acs.open_store(tmp_path / "s.zarr")
    assert torch.equal(store["embed.output"], model.embed.weight[ids.reshape(-1)].detach())
    assert np.array_equal(store.row_table("token")["pos"].to_numpy(), [0, 1, 2, 0, 1, 2])


def test_a_2d_activation_taken_as_token_rows_with_padding_is_warned_about(tmp_path):
    import warnings as _w

    from activationscope import ActivationScope, CaptureWarning, open_store

    class Pooled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(20, 8)
            self.head = torch.nn.Linear(8, 6)

        def forward(self, ids):
            return self.head(self.emb(ids).mean(1))  # (batch, 6) logits

    torch.manual_seed(0)
    m = Pooled()
    ids = torch.randint(0, 20, (4, 6))
    mask = torch.ones(4, 6, dtype=torch.long)
    mask[:, 4:] = 0
    with _w.catch_warnings(record=True) as rec:
        _w.simplefilter("always")
        with torch.no_grad(), ActivationScope(store=str(tmp_path / "p.zarr")).track(m, include=["head"]) as tr:
            tr.set_batch(attention_mask=mask)
            m(ids)
    msgs = [str(r.message) for r in rec if issubclass(r.category, CaptureWarning)]
    assert any("'head.output' has shape (4, 6)" in t and "padded columns are dropped" in t for t in msgs), msgs
    assert open_store(str(tmp_path / "p.zarr")).row_kind("head.output") == "token"


def test_a_2d_token_hook_point_is_warned_about_at_the_first_padded_mask_after_unpadded_ones(tmp_path):
    """The first batch's mask had no padding, so a pooled (batch, 6) output with pos 6 was
    taken as token rows without a word, and a later padded batch dropped its columns silently:
    the warning now comes with the first mask that has padding (once), before that forward."""
    import warnings as _w

    from activationscope import ActivationScope, CaptureWarning, open_store

    class Pooled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(20, 6)
            self.head = torch.nn.Linear(6, 6)

        def forward(self, ids):
            return self.head(self.emb(ids).mean(1))  # (batch, 6)

    torch.manual_seed(0)
    m = Pooled()
    ids = [torch.randint(0, 20, (2, 6)) for _ in range(3)]
    masks = [torch.ones(2, 6, dtype=torch.long), torch.tensor([[1, 1, 1, 0, 0, 0], [1] * 6]),
             torch.tensor([[1, 0, 0, 0, 0, 0], [1] * 6])]
    seen = []
    with _w.catch_warnings(record=True) as rec:
        _w.simplefilter("always")
        with torch.no_grad(), ActivationScope(store=str(tmp_path / "p.zarr")).track(m, include=["head"]) as tr:
            for i, (x, mk) in enumerate(zip(ids, masks)):
                tr.set_batch(attention_mask=mk)
                seen.append(sum("'head.output'" in str(r.message) and "padded columns are dropped" in str(r.message)
                                for r in rec if issubclass(r.category, CaptureWarning)))
                m(x)
    assert seen == [0, 1, 1]  # at the first padded mask, once
    store = open_store(str(tmp_path / "p.zarr"))
    assert store.row_kind("head.output") == "token" and store.n_rows("head.output") == 12 + 9 + 7
    with torch.no_grad():
        want = torch.cat([m(x)[mk.bool()] for x, mk in zip(ids, masks)])
    assert torch.equal(store["head.output"], want)


def test_a_2d_token_hook_point_confirmed_by_token_rows_gets_no_later_warning(tmp_path):
    import warnings as _w

    from activationscope import ActivationScope, CaptureWarning

    m = torch.nn.Sequential(torch.nn.Embedding(20, 6), torch.nn.Flatten(1), torch.nn.Linear(36, 6))
    with _w.catch_warnings(record=True) as rec:
        _w.simplefilter("always")
        scope = ActivationScope(store=str(tmp_path / "p.zarr"), token_rows={"2.output": True})
        with torch.no_grad(), scope.track(m, include=["2"]) as tr:
            for mk in (torch.ones(2, 6, dtype=torch.long), torch.tensor([[1, 1, 1, 0, 0, 0], [1] * 6])):
                tr.set_batch(attention_mask=mk)
                m(torch.randint(0, 20, (2, 6)))
    assert not [r for r in rec if issubclass(r.category, CaptureWarning) and "padded columns" in str(r.message)]


class _HeadFirst(torch.nn.Module):
    """An attention map (batch, heads, pos, pos) as a module output (its dropout), beside the
    (batch, pos, d) values it weights."""

    def __init__(self, heads: int, d: int = 8) -> None:
        super().__init__()
        self.heads = heads
        self.values = torch.nn.Linear(d, d)
        self.drop = torch.nn.Dropout(0.0)

    def forward(self, x):
        batch, pos, _ = x.shape
        scores = torch.arange(batch * self.heads * pos * pos, dtype=torch.float32).reshape(batch, self.heads, pos, pos)
        return self.drop(torch.softmax(scores / 100, -1)) @ self.values(x).unsqueeze(1)


@pytest.mark.parametrize("heads, token_rows, warned, kind", [
    (4, None, True, "token"),     # heads == pos: (batch, pos, pos, pos) could be either
    (4, False, False, "sample"),  # the user says head-first: one row per sample, no warning
    (4, True, False, "token"),    # the user confirms token rows: no warning
    (3, None, False, "sample"),   # heads != pos: the shape tells
])
def test_a_head_first_map_whose_heads_equal_pos_is_warned_about(tmp_path, heads, token_rows, warned, kind):
    """An attention map (batch, heads, pos, pos) of 4 heads over batches padded to 4 tokens
    starts with the mask's (batch, pos): it was stored as token rows of (sample, head) pairs
    picked by the mask without a word. The capture now says so, naming token_rows=."""
    import warnings as _w

    from activationscope import ActivationScope, CaptureWarning, open_store

    torch.manual_seed(0)
    m = _HeadFirst(heads).eval()
    x = torch.randn(2, 4, 8)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    opts = {} if token_rows is None else {"token_rows": {"drop.output": token_rows}}
    with _w.catch_warnings(record=True) as rec:
        _w.simplefilter("always")
        with torch.no_grad(), ActivationScope(store=str(tmp_path / "s.zarr"), **opts).track(m) as tr:
            for _ in range(2):
                tr.set_batch(attention_mask=mask)
                m(x)
    msgs = [str(r.message) for r in rec if issubclass(r.category, CaptureWarning) and "head-first" in str(r.message)]
    assert len(msgs) == warned  # once per capture, not per forward
    if warned:
        assert "'drop.output'" in msgs[0] and "(2, 4, 4, 4)" in msgs[0] and "token_rows={'drop.output': False}" in msgs[0]
    store = open_store(str(tmp_path / "s.zarr"))
    assert store.row_kind("drop.output") == kind and store.row_kind("values.output") == "token"
    with torch.no_grad():
        attn = m.drop(torch.softmax(torch.arange(2 * heads * 16, dtype=torch.float32).reshape(2, heads, 4, 4) / 100, -1))
    want = attn[mask.bool()] if kind == "token" else attn
    assert torch.equal(store["drop.output"], torch.cat([want, want]))


def test_a_head_first_map_under_rows_token_without_a_mask_is_warned_about_by_its_input_pos(tmp_path):
    """rows="token" takes (batch, pos) from the model's first input: the warning says so, not
    that a mask (there is none) fixed pos, and token_rows=False keeps the map whole."""
    import warnings as _w

    from activationscope import ActivationScope, CaptureWarning, open_store

    torch.manual_seed(0)
    m = _HeadFirst(4).eval()
    x = torch.randn(2, 4, 8)
    for token_rows, kind in ((None, "token"), ({"drop.output": False}, "sample")):
        opts = {} if token_rows is None else {"token_rows": token_rows}
        with _w.catch_warnings(record=True) as rec:
            _w.simplefilter("always")
            with torch.no_grad(), ActivationScope(store=str(tmp_path / "s.zarr"), rows="token",
                                                  store_options={"overwrite": True}, **opts).track(m):
                m(x)
        msgs = [str(r.message) for r in rec if issubclass(r.category, CaptureWarning) and "head-first" in str(r.message)]
        assert len(msgs) == (token_rows is None)
        if msgs:
            assert "of the model's first input" in msgs[0] and "(2, 4, 4, 4)" in msgs[0]
        store = open_store(str(tmp_path / "s.zarr"))
        with torch.no_grad():
            attn = m.drop(torch.softmax(torch.arange(2 * 4 * 16, dtype=torch.float32).reshape(2, 4, 4, 4) / 100, -1))
        assert store.row_kind("drop.output") == kind
        assert torch.equal(store["drop.output"], attn.reshape(8, 4, 4) if kind == "token" else attn)


def test_head_first_maps_of_several_layers_are_warned_about_in_one_warning(tmp_path):
    """A model returning the attention map of every layer (output_attentions=True) has several
    such hook points: one warning names them all, with the token_rows= that keeps each whole,
    and that token_rows= stores every map as one row per sample, no warning left."""
    import warnings as _w

    from activationscope import ActivationScope, CaptureWarning, open_store

    class TwoLayers(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = _HeadFirst(4), _HeadFirst(4)

        def forward(self, x):
            return self.b(self.a(x).mean(1))

    torch.manual_seed(0)
    m = TwoLayers().eval()
    x = torch.randn(2, 4, 8)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    for token_rows in (None, {"a.drop.output": False, "b.drop.output": False}):
        opts = {} if token_rows is None else {"token_rows": token_rows}
        with _w.catch_warnings(record=True) as rec:
            _w.simplefilter("always")
            with torch.no_grad(), ActivationScope(store=str(tmp_path / "s.zarr"), store_options={"overwrite": True},
                                                  **opts).track(m, include=["a.drop", "b.drop"]) as tr:
                for _ in range(2):
                    tr.set_batch(attention_mask=mask)
                    m(x)
        msgs = [str(r.message) for r in rec if issubclass(r.category, CaptureWarning) and "head-first" in str(r.message)]
        store = open_store(str(tmp_path / "s.zarr"))
        if token_rows is None:
            assert len(msgs) == 1
            assert "'a.drop.output' (2, 4, 4, 4)" in msgs[0] and "'b.drop.output' (2, 4, 4, 4)" in msgs[0]
            assert "token_rows={'a.drop.output': False, 'b.drop.output': False}" in msgs[0]
            assert store.row_kind("a.drop.output") == store.row_kind("b.drop.output") == "token"
        else:
            assert msgs == []
            assert store.row_kind("a.drop.output") == store.row_kind("b.drop.output") == "sample"
            assert store["a.drop.output"].shape == (4, 4, 4, 4)


@pytest.mark.parametrize("reductions, warned", [(None, False), (["mean"], True)])
def test_ambiguous_token_rows_are_warned_about_only_where_rows_are_taken(reductions, warned):
    """In memory, records are whole tensors whatever the row rule says: a head-first map or a
    (batch, pos) output is warned about only when reductions take its rows (or a store does)."""
    import warnings as _w

    from activationscope import ActivationScope, CaptureWarning

    class Both(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = _HeadFirst(4)
            self.score = torch.nn.Sequential(torch.nn.Linear(8, 1), torch.nn.Flatten(1))  # (batch, pos)

        def forward(self, x):
            return self.score(self.attn(x).mean(1))

    torch.manual_seed(0)
    m = Both().eval()
    x = torch.randn(2, 4, 8)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    opts = {} if reductions is None else {"reductions": reductions}
    with _w.catch_warnings(record=True) as rec:
        _w.simplefilter("always")
        with torch.no_grad(), ActivationScope(**opts).track(m, include=["attn.drop", "score.1"]) as tr:
            tr.set_batch(attention_mask=mask)
            out = m(x)
    msgs = [str(r.message) for r in rec if issubclass(r.category, CaptureWarning)]
    assert sum("head-first" in msg for msg in msgs) == warned
    assert sum("'score.1.output'" in msg for msg in msgs) == warned  # (batch, pos): a per-token scalar?
    with torch.no_grad():
        attn = m.attn.drop(torch.softmax(torch.arange(2 * 4 * 16, dtype=torch.float32).reshape(2, 4, 4, 4) / 100, -1))
    assert torch.equal(tr.activations["attn.drop.output"][0], attn)  # whole, either way
    if reductions:
        torch.testing.assert_close(tr.reductions["attn.drop.output"]["mean"].double(),
                                   attn[mask.bool()].double().mean(0), rtol=1e-6, atol=1e-6)


def _store_files(path):
    """Every file of the store (the writer lock aside) with its bytes."""
    return {str(f.relative_to(path)): f.read_bytes() for f in sorted(path.rglob("*"))
            if f.is_file() and f.name != ".activationscope-writer.lock"}


@pytest.mark.parametrize("first, resumed", [("auto", "token"), ("token", "auto")])
@pytest.mark.parametrize("more", [True, False], ids=["more-rows", "nothing-left"])
@pytest.mark.parametrize("reductions", [None, ["mean"]], ids=["no-reductions", "reductions"])
def test_a_resume_with_the_other_rows_setting_is_refused_naming_both_whether_or_not_rows_are_left(
        tmp_path, first, resumed, more, reductions):
    """A resume whose rows= differs from the store's was refused, naming both, only once a
    forward gave a hook point the other row kind; with nothing left to capture it went through
    (a resume adding a reduction rewrote the store's recorded rows= too). Both are refused
    when the tracker attaches, naming both settings and the fix, every file of the store as found."""
    model = TinyLM().eval()
    path = tmp_path / "s.zarr"
    xs = _batches()
    with torch.no_grad(), acs.ActivationScope(store=path, rows=first).track(model, include=["block0"]):
        model(xs[0])
    before = _store_files(path)
    scope = acs.ActivationScope(store=path, rows=resumed, reductions=reductions, store_options={"resume": True})
    with pytest.raises(acs.CaptureError, match=rf"cannot resume .*: it was captured with rows={first!r} \(.*\), this "
                                               rf"capture has rows={resumed!r} \(.*\);.*resume with rows={first!r} \(CLI: --rows "
                                               rf"{first}\).*left as it was"):
        with torch.no_grad(), scope.track(model, include=["block0"]):
            if more:
                model(xs[1])
    assert _store_files(path) == before
    store = acs.open_store(path)
    assert store.status == "complete" and store.n_samples == 3
    assert store.row_kind("block0.output") == ("token" if first == "token" else "sample")
    assert store.attrs["capture_config"]["rows"] == first


def test_a_resume_with_the_same_rows_setting_and_nothing_left_goes_through(tmp_path):
    model = TinyLM().eval()
    path = tmp_path / "s.zarr"
    with torch.no_grad(), acs.ActivationScope(store=path, rows="token").track(model, include=["block0"]):
        model(_batches()[0])
    scope = acs.ActivationScope(store=path, rows="token", reductions=["mean"], store_options={"resume": True})
    with torch.no_grad(), scope.track(model, include=["block0"]):
        pass
    store = acs.open_store(path)
    assert store.status == "complete" and store.n_rows("block0.output") == 15
    assert torch.allclose(store.reductions["block0.output"]["mean"], store["block0.output"].double().mean(0))


class _PositionsModel(torch.nn.Module):
    """forward(input_ids, position_ids): position ids (1, pos) broadcast over the batch, as
    Hugging Face models take them."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.tok = torch.nn.Embedding(20, 4)
        self.pos = torch.nn.Embedding(8, 4)
        self.out = torch.nn.Linear(4, 4)

    def forward(self, input_ids, position_ids=None, **extra):
        return self.out(self.tok(input_ids) + self.pos(position_ids))


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("rows", ["auto", "token"])
def test_keyword_inputs_passed_in_another_order_take_the_batch_from_the_first_parameter(tmp_path, rows, compiled):
    """model(position_ids=p, input_ids=i) is model(i, p): the batch (and with rows="token" the
    (batch, pos) of the token rows) comes from input_ids, the forward's first parameter, not
    from the (1, pos) position ids passed first. A keyword the forward does not name (taken
    by **extra) comes after its parameters."""
    import warnings as _w

    model = _PositionsModel().eval()
    ids = torch.randint(0, 20, (3, 5), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(5)[None]
    ref = model(ids, pos).detach()
    stores = {}
    for order in ("as_signature", "reversed"):
        path = tmp_path / f"{order}.zarr"
        with _w.catch_warnings():
            _w.simplefilter("error", acs.CaptureWarning)
            with torch.no_grad(), acs.ActivationScope(store=path, rows=rows).track(model, include=["tok", "out"]):
                # (compiled: a function calling the tracked model, so its root wrapper is traced in the graph)
                run = torch.compile(lambda **kw: model(**kw), backend="eager") if compiled else model
                if order == "as_signature":
                    run(input_ids=ids, position_ids=pos)
                else:
                    run(unused=torch.zeros(1, 1), position_ids=pos, input_ids=ids)
        stores[order] = acs.open_store(path)
    for order, store in stores.items():
        assert store.n_samples == 3, order
        if rows == "token":
            assert torch.equal(store["out.output"], ref.reshape(15, 4)), order
            assert store.row_table("token")["pos"].to_pylist() == [0, 1, 2, 3, 4] * 3
        else:
            assert torch.equal(store["out.output"], ref), order
        assert store.follows_row_table("out.output") and store.follows_row_table("tok.output")


class _LearnedPositions(torch.nn.Module):
    """Token ids (batch, pos) plus a position embedding called on arange(pos)[None], whose
    (1, pos, d) output is one tensor broadcast over the batch (GPT-2's wpe, CLIP's)."""

    def __init__(self, vocab: int = 50, d: int = 8) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(vocab, d)
        self.positions = torch.nn.Embedding(16, d)
        self.block = torch.nn.Linear(d, d)

    def forward(self, ids):
        return self.block(self.embed(ids) + self.positions(torch.arange(ids.shape[1])[None]))


def test_a_broadcast_tensor_taken_as_token_rows_at_a_first_batch_of_one_names_the_cause(tmp_path):
    """At a first forward of one sample, a (1, pos, d) tensor shared by the batch starts with
    the (1, pos) mask and is taken as token rows; the next batch of 2 samples was refused with
    advice about masks for each forward and generation steps, none of which fixes it. The error
    now says it is a tensor shared by the batch and names exclude_hook_points=, which works."""
    model = _LearnedPositions().eval()
    ids = torch.randint(0, 50, (3, 5), generator=torch.Generator().manual_seed(0))
    scope = acs.ActivationScope(store=str(tmp_path / "a.zarr"), rows="token")
    with pytest.raises(acs.CaptureError) as info:
        with torch.no_grad(), scope.track(model):
            model(ids[:1])
            model(ids[1:])
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "'positions.output' is one tensor shared by the batch's samples" in notes
    assert "stays 1 in a batch of 2 samples" in notes and "its first activation, (1, 5, 8)" in notes
    assert "exclude_hook_points=['positions.output']" in notes
    store = acs.open_store(tmp_path / "a.zarr")
    assert store.n_rows("block.output") == 5  # the first forward is kept whole

    scope = acs.ActivationScope(store=str(tmp_path / "b.zarr"), rows="token",
                                exclude_hook_points=["positions.output"])
    with torch.no_grad(), scope.track(model):
        model(ids[:1])
        model(ids[1:])
    store = acs.open_store(tmp_path / "b.zarr")
    assert store.hook_points == ["embed.output", "block.output"]
    with torch.no_grad():
        assert torch.equal(store["block.output"], model(ids).reshape(15, 8))


@pytest.mark.parametrize("first", [1, 3])
def test_a_broadcast_tensor_leaving_the_row_table_is_named_so_whatever_its_first_batch(first, tmp_path):
    """A (1, pos, d) tensor shared by the batch, stored one row per sample (rows="auto"), records
    one row for a forward of more samples and leaves the row table. Where its first forward had
    more samples the warning said it is one tensor shared by the batch and named
    exclude_hook_points=; where its first forward had one sample it gave the generic advice
    (its module returned no tensor, or another number of rows). Now both say the first; and a
    later change of its shape (another pos) adds the same note to the error."""
    model = _LearnedPositions().eval()
    ids = torch.randint(0, 50, (4, 5), generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(acs.CaptureError) as info, torch.no_grad(), \
                acs.ActivationScope(store=str(tmp_path / "a.zarr")).track(model, include=["positions", "block"]):
            model(ids[:first])
            model(ids)
            model(ids[:, :4])  # (another pos: refused at positions.output, called before block)
    lost = [str(w.message) for w in caught
            if issubclass(w.category, acs.CaptureWarning) and "row(s) in forward" in str(w.message)]
    assert len(lost) == 1, lost
    forward = 0 if first > 1 else 1
    assert (f"hook point 'positions.output' recorded 1 row(s) in forward {forward} of the tracked model, where the "
            f"row table got {first if first > 1 else 4}") in lost[0]
    assert "Its activation (1, 5, 8) is one tensor shared by the batch's samples" in lost[0], lost[0]
    assert "exclude_hook_points=['positions.output']" in lost[0]
    assert "Track only hook points whose module returns a tensor in every forward" not in lost[0]
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "'positions.output' is one tensor shared by the batch's samples" in notes, (str(info.value), notes)
    assert "its activation was (1, 5, 8) for a batch of more samples" in notes
