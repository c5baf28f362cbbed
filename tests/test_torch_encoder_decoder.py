"""Encoder-decoders of torch.nn's stacks: nn.Transformer, and a model of one's own around
nn.TransformerEncoder / nn.TransformerDecoder. The source (batch, S) and target (batch, T)
are told by their key padding masks (True at padding); token rows taken with the other
side's mask, or with a key padding mask as given, are refused. References: forward hooks."""

from __future__ import annotations

import warnings

import pytest
import torch

import activationscope as acs

from acs_testing import plain_hooks

B, S, D = 3, 5, 8


def _transformer() -> torch.nn.Transformer:
    torch.manual_seed(0)
    return torch.nn.Transformer(d_model=D, nhead=2, num_encoder_layers=2, num_decoder_layers=2, dim_feedforward=16,
                                dropout=0.0, batch_first=True).eval()


def _batch(t: int, pad: bool = True, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    src, tgt = torch.randn(B, S, D, generator=g), torch.randn(B, t, D, generator=g)
    src_pad, tgt_pad = torch.zeros(B, S, dtype=torch.bool), torch.zeros(B, t, dtype=torch.bool)
    if pad:
        src_pad[1, 3:] = True
        src_pad[2, 4:] = True
        tgt_pad[0, t - 1:] = True
        tgt_pad[2, 2:] = True
    return src, src_pad, tgt, tgt_pad


def _call(model, src, src_pad, tgt, tgt_pad):
    return model(src, tgt, src_key_padding_mask=src_pad, tgt_key_padding_mask=tgt_pad,
                 memory_key_padding_mask=src_pad)


def _reference(model, names, *batch, inputs=()):
    """The outputs (and the inputs ``(name, i)`` of ``inputs``) of the modules ``names`` in one
    forward, by plain forward hooks, PyTorch's fast path off as while a capture runs."""
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        got, _ = plain_hooks(model, lambda: _call(model, *batch), names, side="both" if inputs else "output",
                             structured="first")
    finally:
        torch.backends.mha.set_fastpath_enabled(True)
    out = {k.removesuffix(".output"): v[-1] for k, v in got.items() if k.endswith(".output")}
    out.update({(n, i): got[f"{n}.input.{i}"][-1] for n, i in inputs})
    return out


def _close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def _both_sides_under(tmp_path, model, batch, mask, warning):
    """A store of ``encoder.layers.1`` and ``decoder.layers.1`` captured under one side's
    ``mask``, the other side's hook points warned about (``warning``, a regex)."""
    with pytest.warns(acs.CaptureWarning, match=warning):
        with torch.no_grad(), acs.ActivationScope(store=tmp_path / "s.zarr").track(
                model, include=["encoder.layers.1", "decoder.layers.1"]) as tracker:
            tracker.set_batch(attention_mask=mask)
            _call(model, *batch)
    return acs.open_store(tmp_path / "s.zarr")


def test_decoder_rows_taken_with_the_source_mask_are_refused(tmp_path):
    # T == S: the decoder's (batch, T, d) starts with the source mask's (batch, S); its rows
    # were the target positions where the source has tokens (13 of them, the target has 11)
    model = _transformer()
    batch = _batch(S)
    scope = acs.ActivationScope(store=tmp_path / "s.zarr")
    with pytest.raises(acs.CaptureError, match=r"hook point 'decoder\.layers\.0\.output' is on the decoder side of "
                       r"the encoder-decoder model Transformer.*is the encoder's \(the inverse of "
                       r"src_key_padding_mask.*one tracker per side"):
        with torch.no_grad(), scope.track(model, include=["encoder.layers.0", "decoder.layers.0"]) as tracker:
            tracker.set_batch(attention_mask=~batch[1])
            _call(model, *batch)
    assert not (tmp_path / "s.zarr").exists()  # nothing committed: the new store is removed


def test_encoder_rows_taken_with_the_target_mask_are_refused():
    model = _transformer()
    batch = _batch(S)
    scope = acs.ActivationScope(reductions=["mean"])
    with pytest.raises(acs.CaptureError, match=r"'encoder\.layers\.1\.output' is on the encoder side.*is the "
                       r"decoder's \(the inverse of tgt_key_padding_mask"):
        with torch.no_grad(), scope.track(model, include=["encoder.layers.1"]) as tracker:
            tracker.set_batch(attention_mask=~batch[3])
            _call(model, *batch)


def test_a_key_padding_mask_as_given_is_refused(tmp_path):
    # src_key_padding_mask is True at padding: as set_batch's attention_mask its rows would be
    # the padding positions (and with no padding, no row at all)
    model = _transformer()
    for pad in (True, False):
        batch = _batch(4, pad=pad)
        with pytest.raises(acs.CaptureError, match=r"'encoder\.layers\.0\.output' is on the encoder side.*the "
                           r"encoder's key padding mask as given \(True at padding.*attention_mask=~key_padding_mask"):
            with torch.no_grad(), acs.ActivationScope(store=tmp_path / f"{pad}.zarr").track(
                    model, include=["encoder.layers.0"]) as tracker:
                tracker.set_batch(attention_mask=batch[1])
                _call(model, *batch)


@pytest.mark.parametrize("t", [S, 4])
def test_each_side_in_a_tracker_of_its_own_stores_its_own_tokens(tmp_path, t):
    model = _transformer()
    batch = src, src_pad, tgt, tgt_pad = _batch(t)
    cross = "decoder.layers.1.multihead_attn"
    names = ["encoder.layers.1", "decoder.layers.1", cross]
    ref = _reference(model, names, *batch, inputs=[(cross, 0), (cross, 1)])
    # (the encoder's tracker takes the cross-attention's inputs; its query and output, over the
    # target's positions, and the key padding masks as one row per sample)
    enc = acs.ActivationScope(store=tmp_path / "enc.zarr", reductions=["mean"], capture="both",
                              token_rows={f"{cross}.input.0": False, f"{cross}.output*": False,
                                          "*key_padding_mask": False})
    dec = acs.ActivationScope(store=tmp_path / "dec.zarr", reductions=["mean"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad(), enc.track(model, include=["encoder.layers.1", cross]) as te, \
                dec.track(model, include=["decoder.layers.1", cross]) as td:
            te.set_batch(attention_mask=~src_pad, sample_ids=[10, 11, 12])
            td.set_batch(attention_mask=~tgt_pad, sample_ids=[10, 11, 12])
            _call(model, *batch)
    assert not [w for w in caught if issubclass(w.category, acs.CaptureWarning)], [str(w.message) for w in caught]
    e, d = acs.open_store(tmp_path / "enc.zarr"), acs.open_store(tmp_path / "dec.zarr")
    src_rows, tgt_rows = ~src_pad, ~tgt_pad
    _close(e["encoder.layers.1.output"], ref["encoder.layers.1"][src_rows])
    # the cross-attention's key (the memory) is over the source's positions, its query and
    # output over the target's
    _close(e[f"{cross}.input.1"], ref[(cross, 1)][src_rows])
    _close(d[f"{cross}.output.0"], ref[cross][tgt_rows])
    _close(d["decoder.layers.1.output"], ref["decoder.layers.1"][tgt_rows])
    _close(d.reductions["decoder.layers.1.output"]["mean"].float(), ref["decoder.layers.1"][tgt_rows].mean(0))
    assert d.row_table("token").column("pos").to_pylist() == tgt_rows.nonzero()[:, 1].tolist()


def test_decoder_hook_points_stored_as_sample_rows_under_the_source_mask_are_named(tmp_path):
    model = _transformer()
    batch = _batch(4)
    ref = _reference(model, ["decoder.layers.1"], *batch)
    store = _both_sides_under(tmp_path, model, batch, ~batch[1], r"decoder hook points of the encoder-decoder model "
                              r"Transformer start with the decoder's \(batch, T\), not with the \(batch, pos\) "
                              r"\(3, 5\).*'decoder\.layers\.1\.output' \(3, 4, 8\)\. They are stored one row per sample")
    assert store.row_kind("decoder.layers.1.output") == "sample"
    _close(store["decoder.layers.1.output"], ref["decoder.layers.1"])


def test_a_later_forward_whose_padding_differs_is_refused_and_the_earlier_kept(tmp_path):
    # no padding on either side in the first batch (the masks agree); the second has some
    model = _transformer()
    first, second = _batch(S, pad=False), _batch(S, seed=1)
    ref = _reference(model, ["decoder.layers.0"], *first)
    with pytest.raises(acs.CaptureError, match=r"'decoder\.layers\.0\.output' is on the decoder side.*forward 1"):
        with torch.no_grad(), acs.ActivationScope(store=tmp_path / "s.zarr").track(
                model, include=["decoder.layers.0"]) as tracker:
            for batch in (first, second):
                tracker.set_batch(attention_mask=~batch[1])
                _call(model, *batch)
    store = acs.open_store(tmp_path / "s.zarr")
    assert store.n_samples == B
    _close(store["decoder.layers.0.output"], ref["decoder.layers.0"].reshape(B * S, D))


class _Seq2Seq(torch.nn.Module):
    """A model of one's own: embeddings, nn.TransformerEncoder, nn.TransformerDecoder, a head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.src_embed = torch.nn.Embedding(20, D)
        self.tgt_embed = torch.nn.Embedding(20, D)
        self.encoder = torch.nn.TransformerEncoder(
            torch.nn.TransformerEncoderLayer(D, 2, 16, dropout=0.0, batch_first=True), 1, enable_nested_tensor=False)
        self.decoder = torch.nn.TransformerDecoder(
            torch.nn.TransformerDecoderLayer(D, 2, 16, dropout=0.0, batch_first=True), 1)
        self.head = torch.nn.Linear(D, 20)

    def forward(self, src_ids, tgt_ids, src_pad, tgt_pad):
        memory = self.encoder(self.src_embed(src_ids), src_key_padding_mask=src_pad)
        out = self.decoder(self.tgt_embed(tgt_ids), memory, tgt_key_padding_mask=tgt_pad,
                           memory_key_padding_mask=src_pad)
        return self.head(out)


def test_a_model_of_ones_own_around_torch_stacks(tmp_path):
    model = _Seq2Seq().eval()
    _, src_pad, _, tgt_pad = _batch(S)
    g = torch.Generator().manual_seed(3)
    src, tgt = torch.randint(0, 20, (B, S), generator=g), torch.randint(0, 20, (B, S), generator=g)
    out, _ = plain_hooks(model, lambda: model(src, tgt, src_pad, tgt_pad), ["decoder.layers.0", "head"])
    # a hook point inside the decoder stack, with the source's mask: refused
    with pytest.raises(acs.CaptureError, match=r"'decoder\.layers\.0\.output' is on the decoder side of the "
                       r"encoder-decoder model _Seq2Seq.*is the encoder's"):
        with torch.no_grad(), acs.ActivationScope(store=tmp_path / "a.zarr").track(
                model, include=["decoder.layers.0"]) as tracker:
            tracker.set_batch(attention_mask=~src_pad)
            model(src, tgt, src_pad, tgt_pad)
    # the head is outside both stacks: with S == T and other padding its side cannot be told
    with pytest.raises(acs.CaptureError, match=r"'head\.output' is outside the encoder and decoder stacks of the "
                       r"encoder-decoder model _Seq2Seq.*cannot be told.*token_rows=\{'head\.output': True\}"):
        with torch.no_grad(), acs.ActivationScope(store=tmp_path / "b.zarr").track(
                model, include=["head"]) as tracker:
            tracker.set_batch(attention_mask=~tgt_pad)
            model(src, tgt, src_pad, tgt_pad)
    # the target's mask for the decoder's tracker, confirmed for the head
    scope = acs.ActivationScope(store=tmp_path / "c.zarr", token_rows={"head*": True})
    with torch.no_grad(), scope.track(model, include=["decoder.layers.0", "head"]) as tracker:
        tracker.set_batch(attention_mask=~tgt_pad)
        model(src, tgt, src_pad, tgt_pad)
    store = acs.open_store(tmp_path / "c.zarr")
    _close(store["decoder.layers.0.output"], out["decoder.layers.0.output"][0][~tgt_pad])
    _close(store["head.output"], out["head.output"][0][~tgt_pad])


class _DecoderOnly(torch.nn.Module):
    """nn.TransformerDecoder as a decoder-only model: its memory is its own input, unpadded."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(20, D)
        self.decoder = torch.nn.TransformerDecoder(
            torch.nn.TransformerDecoderLayer(D, 2, 16, dropout=0.0, batch_first=True), 1)

    def forward(self, ids, pad):
        x = self.embed(ids)
        return self.decoder(x, x, tgt_key_padding_mask=pad)


def test_a_decoder_only_model_of_torch_stacks_takes_its_own_mask(tmp_path):
    # one sequence: a memory without its own key padding mask tells no second one, so the
    # embedding (outside the stack) is not refused as of an unknown side
    model = _DecoderOnly().eval()
    _, _, _, pad = _batch(S)
    ids = torch.randint(0, 20, (B, S), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = model.embed(ids)
    with torch.no_grad(), acs.ActivationScope(store=tmp_path / "s.zarr").track(
            model, include=["embed", "decoder.layers.0"]) as tracker:
        tracker.set_batch(attention_mask=~pad)
        out = model(ids, pad)
    store = acs.open_store(tmp_path / "s.zarr")
    assert torch.equal(store["embed.output"], expected[~pad])
    _close(store["decoder.layers.0.output"], out[~pad])


def test_encoder_hook_points_stored_as_sample_rows_under_the_target_mask_are_named(tmp_path):
    # T != S: the encoder's (batch, S, d) does not start with the target mask's (batch, T): one
    # row per sample, the source's padding inside; stored so, and named as the decoder's are
    model = _transformer()
    batch = _batch(4)
    ref = _reference(model, ["encoder.layers.1", "decoder.layers.1"], *batch)
    store = _both_sides_under(tmp_path, model, batch, ~batch[3], r"encoder hook points of the encoder-decoder model "
                              r"Transformer start with the encoder's \(batch, S\), not with the \(batch, pos\) "
                              r"\(3, 4\) of the decoder's mask.*'encoder\.layers\.1\.output' \(3, 5, 8\)\. They are "
                              r"stored one row per sample, each a whole source")
    assert store.row_kind("encoder.layers.1.output") == "sample"
    _close(store["encoder.layers.1.output"], ref["encoder.layers.1"])
    _close(store["decoder.layers.1.output"], ref["decoder.layers.1"][~batch[3]])


def test_rows_token_with_a_padded_target_is_refused(tmp_path):
    # rows="token" takes every position of the model's first input, src: not the target's
    # tokens where tgt_key_padding_mask has padding
    model = _transformer()
    batch = _batch(S)
    with pytest.raises(acs.CaptureError, match=r"'decoder\.layers\.0\.output' is on the decoder side.*rows='token'.*"
                       r"is not the decoder's \(the inverse of tgt_key_padding_mask, else every position of tgt\): "):
        with torch.no_grad(), acs.ActivationScope(store=tmp_path / "s.zarr", rows="token").track(
                model, include=["decoder.layers.0"]):
            _call(model, *batch)


class _SequenceFirstEncoder(torch.nn.Module):
    """A model of one sequence around nn.TransformerEncoder, built sequence-first (the default)."""

    def __init__(self):
        super().__init__()
        self.enc = torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(D, 2, 16, 0.0), 1,
                                               enable_nested_tensor=False)

    def forward(self, x, pad):
        return self.enc(x, src_key_padding_mask=pad)


@pytest.mark.parametrize("where", ["store", "reductions"])
def test_token_rows_of_a_sequence_first_encoder_of_one_sequence_are_refused(tmp_path, where):
    # a model of its own around a sequence-first nn.TransformerEncoder, with as many samples as
    # positions: the (pos, batch, d) output was stored as 23 token rows taken with the mask
    # transposed (rows of the wrong samples and positions), with a warning saying the rows were
    # one per position with the batch among the features
    torch.manual_seed(0)
    model = _SequenceFirstEncoder().eval()
    x = torch.randn(S, S, D)
    pad = torch.zeros(S, S, dtype=torch.bool)
    pad[1, 3:] = True
    scope = (acs.ActivationScope(store=tmp_path / "s.zarr") if where == "store"
             else acs.ActivationScope(reductions=["mean"]))
    with pytest.raises(acs.CaptureError, match=r"'enc\.layers\.0\.output' is inside 'enc' \(TransformerEncoder\) "
                       r"of the model _SequenceFirstEncoder, built sequence-first \(batch_first=False\): its "
                       rf"activation \({S}, {S}, {D}\) is \(pos, batch, \.\.\.\).*batch_first=True"):
        with torch.no_grad(), scope.track(model, include=["enc.layers.0"]) as tracker:
            tracker.set_batch(attention_mask=~pad)
            model(x, pad)
    assert not (tmp_path / "s.zarr").exists()


def test_a_sequence_first_encoder_of_one_sequence_keeps_token_rows_asked_for(tmp_path):
    # token_rows=True: the mask is the user's to give (here transposed to fit the layout)
    torch.manual_seed(0)
    model = _SequenceFirstEncoder().eval()
    x = torch.randn(S, S, D)
    pad = torch.zeros(S, S, dtype=torch.bool)
    pad[1, 3:] = True
    seen = []
    model.enc.layers[0].register_forward_hook(lambda m, a, o: seen.append(o.detach().clone()))
    with torch.no_grad(), acs.ActivationScope(store=tmp_path / "s.zarr", token_rows={"enc.layers.0.output": True}
                                              ).track(model, include=["enc.layers.0"]) as tracker:
        tracker.set_batch(attention_mask=~pad.T)
        model(x, pad)
    assert torch.equal(acs.open_store(tmp_path / "s.zarr")["enc.layers.0.output"], seen[0][~pad.T])


def test_token_rows_of_a_sequence_first_stack_are_refused(tmp_path):
    # batch_first=False (nn.Transformer's default): (pos, batch, d) starts with the (batch, pos)
    # mask where batch == pos, and its rows were taken with the mask transposed
    torch.manual_seed(0)
    model = torch.nn.Transformer(d_model=D, nhead=2, num_encoder_layers=1, num_decoder_layers=1,
                                 dim_feedforward=16, dropout=0.0).eval()
    src, tgt = torch.randn(S, S, D), torch.randn(S, S, D)
    src_pad, tgt_pad = torch.zeros(S, S, dtype=torch.bool), torch.zeros(S, S, dtype=torch.bool)
    src_pad[1, 3:] = True
    with pytest.raises(acs.CaptureError, match=r"'encoder\.layers\.0\.output' is inside 'encoder' "
                       r"\(TransformerEncoder\) of the encoder-decoder model Transformer, built sequence-first.*"
                       r"batch_first=True"):
        with torch.no_grad(), acs.ActivationScope(store=tmp_path / "s.zarr").track(
                model, include=["encoder.layers.0"]) as tracker:
            tracker.set_batch(attention_mask=~src_pad)
            _call(model, src, src_pad, tgt, tgt_pad)
    assert not (tmp_path / "s.zarr").exists()


def test_the_stacks_signatures_are_read_once_not_at_every_forward(tmp_path, monkeypatch):
    # each call of an encoder or decoder stack read its forward's signature again
    # (inspect.signature: tens of microseconds per stack call, at every forward)
    import inspect

    from activationscope.capture import scope as scope_module

    model = _transformer()
    batch = src, src_pad, tgt, tgt_pad = _batch(4)
    read = []
    signature = inspect.signature

    def counted(fn, *a, **k):
        if fn in (torch.nn.TransformerEncoder.forward, torch.nn.TransformerDecoder.forward):
            read.append(fn)
        return signature(fn, *a, **k)

    scope_module._positional_names.cache_clear()
    monkeypatch.setattr(scope_module.inspect, "signature", counted)
    dec = acs.ActivationScope(store=tmp_path / "dec.zarr")
    with torch.no_grad(), dec.track(model, include=["decoder.layers.1"]) as td:
        for _ in range(4):
            td.set_batch(attention_mask=~tgt_pad, sample_ids=[10, 11, 12])
            _call(model, *batch)
    assert read.count(torch.nn.TransformerDecoder.forward) == 1
    assert read.count(torch.nn.TransformerEncoder.forward) <= 1
    assert acs.open_store(tmp_path / "dec.zarr").n_samples == 4 * B


def test_token_rows_of_a_sequence_first_module_outside_an_encoder_decoder_are_refused(tmp_path):
    # an encoder alone (no decoder stack), an LSTM or an attention built sequence-first: with
    # as many samples as positions their (pos, batch, d) passed for token rows, taken with the
    # mask transposed (a CaptureWarning said one row per position), refused only for nn.Transformer
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(d_model=D, nhead=2, dim_feedforward=16, dropout=0.0)
    encoder = torch.nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False).eval()
    lstm = torch.nn.LSTM(D, D).eval()
    x = torch.randn(S, S, D)  # (pos, batch, d), batch == pos
    pad = torch.zeros(S, S, dtype=torch.bool)
    pad[1, 2:] = True
    for i, (model, call, include, where) in enumerate((
            (encoder, lambda m: m(x, src_key_padding_mask=pad), ["layers.1"], r"'layers\.1' \(TransformerEncoderLayer\)"),
            (lstm, lambda m: m(x), ["*"], r"'the model' \(LSTM\)"))):
        with pytest.raises(acs.CaptureError, match=rf"is inside {where} of the model \w+, built sequence-first.*"
                           r"mask transposed.*batch_first=True"):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", acs.CaptureWarning)
                with torch.no_grad(), acs.ActivationScope(store=tmp_path / f"{i}.zarr").track(
                        model, include=include) as tracker:
                    tracker.set_batch(attention_mask=~pad)
                    call(model)
        assert not (tmp_path / f"{i}.zarr").exists()
    # an attention's weights (batch, query, key) and the key padding masks are batch-first in
    # a sequence-first module: still token rows
    mha = torch.nn.MultiheadAttention(D, 2).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", acs.CaptureWarning)
        with torch.no_grad(), acs.ActivationScope(store=tmp_path / "m.zarr", capture="both",
                                                  token_rows={"output.0": False, "input.*": False}).track(mha) as t:
            t.set_batch(attention_mask=~pad)
            _, weights = mha(x, x, x, key_padding_mask=pad)
    store = acs.open_store(tmp_path / "m.zarr")
    _close(store["output.1"], weights[~pad])


def test_token_rows_of_a_sequence_first_encoder_are_said_to_be_swapped(tmp_path):
    # rows="token" on a sequence-first nn.TransformerEncoder: its (pos, batch, d) output was stored
    # as 15 token rows of (position, sample) pairs listed with sample_id = position, under a
    # warning that said one row per position with the batch among the features
    torch.manual_seed(0)
    enc = torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(D, 2, 16, 0.0), 1,
                                      enable_nested_tensor=False).eval()
    x = torch.randn(5, 3, D)  # (pos, batch, d)
    with warnings.catch_warnings(record=True) as seen, torch.no_grad(), acs.ActivationScope(
            store=tmp_path / "s.zarr", rows="token").track(enc, include=["layers.0"]):
        warnings.simplefilter("always")
        out = enc(x)
    said = [str(w.message) for w in seen if issubclass(w.category, acs.CaptureWarning) and "sequence-first" in str(w.message)]
    assert len(said) == 1, said
    assert "'layers.0' (TransformerEncoderLayer): layers.0.output. Their rows are (position, sample) pairs" in said[0]
    assert "its sample_id is the position, its pos the sample" in said[0] and "among the features" not in said[0]
    store = acs.open_store(tmp_path / "s.zarr")
    assert torch.equal(store["layers.0.output"], out.reshape(15, D))  # what the warning says: (pos, batch) pairs
    assert store.row_table("token").column("sample_id").to_pylist() == [p for p in range(5) for _ in range(3)]
