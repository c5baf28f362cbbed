"""Encoder-decoder models: two sequences, the encoder's (batch, S) and the decoder's (batch, T).
Token rows are taken with one mask; a decoder activation starts with the encoder mask's
(batch, S) whenever T == S, and its rows must not be taken at the encoder's tokens."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

import activationscope as acs
from activationscope.data import ActivationDataset

from acs_testing import plain_hooks

transformers = pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

B, S = 3, 6


def _t5():
    torch.manual_seed(0)
    config = transformers.T5Config(d_model=32, d_ff=64, num_layers=2, num_heads=2, vocab_size=200, d_kv=16,
                                   decoder_start_token_id=0, pad_token_id=0)
    return transformers.T5ForConditionalGeneration(config).eval()


def _batch(t: int, pad: bool = True):
    g = torch.Generator().manual_seed(t)
    src, tgt = torch.randint(2, 200, (B, S), generator=g), torch.randint(2, 200, (B, t), generator=g)
    src_mask, tgt_mask = torch.ones(B, S, dtype=torch.long), torch.ones(B, t, dtype=torch.long)
    if pad:
        src_mask[1, 4:] = 0
        src_mask[2, 3:] = 0
        tgt_mask[0, t - 1:] = 0
        tgt_mask[2, 2:] = 0
    return src, src_mask, tgt, tgt_mask


def _reference(model, names, src, src_mask, tgt, tgt_mask):
    """The outputs of the modules ``names`` in one forward, by plain forward hooks."""
    got, _ = plain_hooks(model, lambda: model(input_ids=src, attention_mask=src_mask, decoder_input_ids=tgt,
                                              decoder_attention_mask=tgt_mask), names, structured="first")
    return {k.removesuffix(".output"): v[-1] for k, v in got.items()}


def test_decoder_token_rows_taken_with_the_encoders_mask_are_refused(tmp_path):
    # T == S: the decoder's (batch, T, d) starts with the encoder mask's (batch, S); its rows
    # would be the decoder positions where the encoder has tokens (13 of them, where the
    # decoder has 12), listed with the encoder's positions and token ids
    model = _t5()
    src, src_mask, tgt, tgt_mask = _batch(S)
    scope = acs.ActivationScope(store=tmp_path / "s.zarr")
    with pytest.raises(acs.CaptureError, match=r"hook point 'decoder\.block\.0\.output\.0' is on the decoder "
                       r"side of the encoder-decoder model T5ForConditionalGeneration.*is the encoder's "
                       r"\(attention_mask, .*one tracker per side"):
        with torch.no_grad(), scope.track(model, include=["encoder.block.0", "decoder.block.0"]) as tracker:
            tracker.set_batch(attention_mask=src_mask, token_ids=src)
            model(input_ids=src, attention_mask=src_mask, decoder_input_ids=tgt, decoder_attention_mask=tgt_mask)
    assert not (tmp_path / "s.zarr").exists()  # nothing committed: the new store is removed


def test_reductions_of_decoder_token_rows_with_the_encoders_mask_are_refused():
    model = _t5()
    src, src_mask, tgt, tgt_mask = _batch(S)
    scope = acs.ActivationScope(reductions={"decoder.*": ["mean"]})
    with pytest.raises(acs.CaptureError, match=r"'decoder\.final_layer_norm\.output' is on the decoder side"):
        with torch.no_grad(), scope.track(model, include=["decoder.final_layer_norm"]) as tracker:
            tracker.set_batch(attention_mask=src_mask)
            model(input_ids=src, attention_mask=src_mask, decoder_input_ids=tgt, decoder_attention_mask=tgt_mask)


def test_rows_token_with_a_padded_decoder_is_refused(tmp_path):
    # rows="token" takes every position of the model's first input, the encoder's: right for a
    # decoder without padding, not for one whose decoder_attention_mask has some
    model = _t5()
    src, _, tgt, tgt_mask = _batch(S)
    scope = acs.ActivationScope(store=tmp_path / "s.zarr", rows="token")
    with pytest.raises(acs.CaptureError, match=r"'lm_head\.output' is on the decoder side.*rows='token'.*is the "
                       r"encoder's"):
        with torch.no_grad(), scope.track(model, include=["lm_head"]):
            model(input_ids=src, decoder_input_ids=tgt, decoder_attention_mask=tgt_mask)


def test_a_later_forward_whose_decoder_mask_differs_is_refused_and_the_earlier_kept(tmp_path):
    # the first batch has no padding on either side (the masks agree); the second has: its
    # decoder rows would be taken at the encoder's tokens. Refused before any row of it.
    model = _t5()
    first, second = _batch(S, pad=False), _batch(S)
    ref = _reference(model, ["decoder.block.1"], *first)
    scope = acs.ActivationScope(store=tmp_path / "s.zarr", reductions=["mean"])
    with pytest.raises(acs.CaptureError, match=r"'decoder\.block\.1\.output\.0' is on the decoder side.*forward 1"):
        with torch.no_grad(), scope.track(model, include=["decoder.block.1"]) as tracker:
            for src, src_mask, tgt, tgt_mask in (first, second):
                tracker.set_batch(attention_mask=src_mask)
                model(input_ids=src, attention_mask=src_mask, decoder_input_ids=tgt, decoder_attention_mask=tgt_mask)
    store = acs.open_store(tmp_path / "s.zarr")
    assert store.n_samples == B
    assert torch.equal(store["decoder.block.1.output.0"], ref["decoder.block.1"].reshape(B * S, -1))


@pytest.mark.parametrize("t", [S, 4])
def test_each_side_in_a_tracker_of_its_own_stores_its_own_tokens(tmp_path, t):
    model = _t5()
    src, src_mask, tgt, tgt_mask = _batch(t)
    ref = _reference(model, ["encoder.block.1", "decoder.block.1", "lm_head"], src, src_mask, tgt, tgt_mask)
    enc = acs.ActivationScope(store=tmp_path / "enc.zarr", reductions=["mean"])
    dec = acs.ActivationScope(store=tmp_path / "dec.zarr", reductions=["mean"])
    with torch.no_grad(), enc.track(model, include=["encoder.block.1"]) as te, \
            dec.track(model, include=["decoder.block.1", "lm_head"]) as td:
        te.set_batch(attention_mask=src_mask, sample_ids=[10, 11, 12], token_ids=src)
        td.set_batch(attention_mask=tgt_mask, sample_ids=[10, 11, 12], token_ids=tgt)
        model(input_ids=src, attention_mask=src_mask, decoder_input_ids=tgt, decoder_attention_mask=tgt_mask)
    e, d = acs.open_store(tmp_path / "enc.zarr"), acs.open_store(tmp_path / "dec.zarr")
    src_rows, tgt_rows = src_mask.bool(), tgt_mask.bool()
    assert torch.equal(e["encoder.block.1.output.0"], ref["encoder.block.1"][src_rows])
    assert torch.equal(d["decoder.block.1.output.0"], ref["decoder.block.1"][tgt_rows])
    assert torch.equal(d["lm_head.output"], ref["lm_head"][tgt_rows])
    torch.testing.assert_close(d.reductions["lm_head.output"]["mean"], ref["lm_head"][tgt_rows].double().mean(0))
    ds = ActivationDataset(tmp_path / "dec.zarr", hook_points=["decoder.block.1.output.0"],
                           columns=["sample_id", "pos", "token_ids"])
    rows = ds[:]
    assert torch.equal(rows["token_ids"], tgt[tgt_rows])
    assert torch.equal(rows["pos"], tgt_rows.nonzero()[:, 1])
    assert torch.equal(rows["sample_id"], torch.tensor([10, 11, 12])[tgt_rows.nonzero()[:, 0]])


def test_decoder_hook_points_as_sample_rows_when_asked(tmp_path):
    model = _t5()
    src, src_mask, tgt, tgt_mask = _batch(S)
    ref = _reference(model, ["encoder.block.1", "decoder.block.1"], src, src_mask, tgt, tgt_mask)
    scope = acs.ActivationScope(store=tmp_path / "s.zarr", token_rows={"decoder.*": False})
    with torch.no_grad(), scope.track(model, include=["encoder.block.1", "decoder.block.1"]) as tracker:
        tracker.set_batch(attention_mask=src_mask)
        model(input_ids=src, attention_mask=src_mask, decoder_input_ids=tgt, decoder_attention_mask=tgt_mask)
    store = acs.open_store(tmp_path / "s.zarr")
    assert store.row_kind("decoder.block.1.output.0") == "sample"
    assert torch.equal(store["decoder.block.1.output.0"], ref["decoder.block.1"])
    assert torch.equal(store["encoder.block.1.output.0"], ref["encoder.block.1"][src_mask.bool()])


# ---------------------------------------------------------------------------- recurrent modules


class _Packed(torch.nn.Module):
    """Token ids and lengths -> a PackedSequence through an LSTM and a GRU -> padded logits."""

    def __init__(self, num_layers: int = 1) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(50, 8)
        self.lstm = torch.nn.LSTM(8, 6, num_layers=num_layers, batch_first=True)
        self.head = torch.nn.Linear(6, 2)

    def forward(self, ids, lengths):
        packed = torch.nn.utils.rnn.pack_padded_sequence(self.emb(ids), lengths, batch_first=True,
                                                         enforce_sorted=False)
        out, _ = self.lstm(packed)
        padded, _ = torch.nn.utils.rnn.pad_packed_sequence(out, batch_first=True, total_length=ids.shape[1])
        return self.head(padded)


def test_a_batch_first_lstm_hidden_state_is_warned_about_as_rows_of_layers(tmp_path):
    # h_n and c_n are (num_layers, batch, hidden) with batch_first=True too: with 2 layers and
    # 2 samples the store lists layer i as sample i; the warning names them
    model = _Packed(num_layers=2).eval()
    ids, lengths = torch.randint(1, 50, (2, 5)), torch.tensor([5, 3])
    with pytest.warns(acs.CaptureWarning, match=r"'lstm' \(LSTM\): lstm\.output\.0\.batch_sizes, "
                      r"lstm\.output\.0\.data, lstm\.output\.0\.sorted_indices, lstm\.output\.0\.unsorted_indices, "
                      r"lstm\.output\.1\.0, lstm\.output\.1\.1\. A hidden state"):
        with torch.no_grad(), acs.ActivationScope(store=tmp_path / "s.zarr").track(model) as tracker:
            tracker.set_batch(attention_mask=torch.arange(5)[None] < lengths[:, None], label=[0, 1])
            model(ids, lengths)
    store = acs.open_store(tmp_path / "s.zarr")
    with torch.no_grad():
        _, (h, _) = model.lstm(torch.nn.utils.rnn.pack_padded_sequence(model.emb(ids), lengths, batch_first=True,
                                                                       enforce_sorted=False))
    assert torch.equal(store["lstm.output.1.0"], h)  # stored as it is: rows are layers
    assert store.row_kind("head.output") == "token" and store.n_rows("head.output") == 8



# ---------------------------------------------------------------------------- generate()


def test_generate_into_a_store_says_why_the_encoder_recorded_nothing(tmp_path):
    # generate() calls the encoder on its own, before the decoder's forwards: a store records
    # forwards of the tracked model only, so the encoder's modules record nothing there, and
    # the warning naming them says they were called (not "never called" alone)
    model = _t5()
    src, src_mask, _, _ = _batch(S)
    scope = acs.ActivationScope(store=tmp_path / "s.zarr")
    with pytest.warns(acs.CaptureWarning, match=r"recorded nothing in 3 captured forward\(s\): "
                      r"'encoder\.block\.1\.layer\.1'.*called on their own, outside a forward of the tracked model "
                      r"\(1 call\(s\)\).*scope\.track\(model\.get_encoder\(\)\)"):
        with torch.no_grad(), scope.track(model, include=["encoder.block.1.layer.1", "decoder.block.1.layer.2"]):
            model.generate(input_ids=src, attention_mask=src_mask, max_new_tokens=3, min_new_tokens=3,
                           do_sample=False)


def test_generate_with_the_encoder_in_a_tracker_of_its_own_stores_both_sides(tmp_path):
    model = _t5()
    src, src_mask, _, _ = _batch(S)
    got, (hidden, expected) = plain_hooks(model, lambda: (
        model.encoder(input_ids=src, attention_mask=src_mask).last_hidden_state,
        model.generate(input_ids=src, attention_mask=src_mask, max_new_tokens=3, min_new_tokens=3, do_sample=False)),
        ["decoder.block.1.layer.2"])
    steps = got["decoder.block.1.layer.2.output"]
    enc = acs.ActivationScope(store=tmp_path / "enc.zarr")
    dec = acs.ActivationScope(store=tmp_path / "dec.zarr")
    with torch.no_grad(), enc.track(model.get_encoder(), include=["final_layer_norm"]) as te, \
            dec.track(model, include=["decoder.block.1.layer.2"]) as td:
        te.set_batch(attention_mask=src_mask, sample_ids=[7, 8, 9])
        td.set_batch(sample_ids=[7, 8, 9])
        out = model.generate(input_ids=src, attention_mask=src_mask, max_new_tokens=3, min_new_tokens=3,
                             do_sample=False)
    assert torch.equal(out, expected)
    e, d = acs.open_store(tmp_path / "enc.zarr"), acs.open_store(tmp_path / "dec.zarr")
    assert torch.equal(e["final_layer_norm.output"], hidden[src_mask.bool()])
    assert len(steps) == 3 and torch.equal(d["decoder.block.1.layer.2.output"], torch.cat(steps))
    assert d.row_table("sample").column("sample_id").to_pylist() == [7, 8, 9] * 3


# ---------------------------------------------------------------------------- cross-attention


def test_cross_attention_keys_are_the_encoders_positions(tmp_path):
    # T == S: a cross-attention's key projection is (batch, S, inner) inside the decoder. The
    # decoder's tracker (decoder mask) refuses it; the encoder's (encoder mask) stores its rows
    # at the encoder's tokens, as the encoder states a decoder block takes (input.3, encoder_hidden_states)
    model = _t5()
    src, src_mask, tgt, tgt_mask = _batch(S)
    key = "decoder.block.0.layer.1.EncDecAttention.k"
    ref = _reference(model, [key, "encoder"], src, src_mask, tgt, tgt_mask)
    dec = acs.ActivationScope(store=tmp_path / "dec.zarr")
    with pytest.raises(acs.CaptureError, match=rf"'{key}\.output' is on the encoder side.*is the decoder's"):
        with torch.no_grad(), dec.track(model, include=[key]) as tracker:
            tracker.set_batch(attention_mask=tgt_mask)
            model(input_ids=src, attention_mask=src_mask, decoder_input_ids=tgt, decoder_attention_mask=tgt_mask)
    decoder_positions = {"decoder.block.0.input.0": False, "decoder.block.0.output*": False}
    enc = acs.ActivationScope(store=tmp_path / "enc.zarr", capture="both", token_rows=decoder_positions)
    with torch.no_grad(), enc.track(model, include=[key, "decoder.block.0"]) as tracker:
        tracker.set_batch(attention_mask=src_mask)
        model(input_ids=src, attention_mask=src_mask, decoder_input_ids=tgt, decoder_attention_mask=tgt_mask)
    store = acs.open_store(tmp_path / "enc.zarr")
    rows = src_mask.bool()
    assert torch.equal(store[f"{key}.output"], ref[key][rows])
    assert torch.equal(store["decoder.block.0.input.3"], ref["encoder"][rows])


def test_decoder_hook_points_stored_as_sample_rows_under_the_encoders_mask_are_named(tmp_path):
    # T != S: the decoder's (batch, T, d) does not start with the encoder mask's (batch, S): one
    # row per sample, the decoder's padding inside. Stored as the documented rule says, and named
    model = _t5()
    src, src_mask, tgt, tgt_mask = _batch(4)
    ref = _reference(model, ["decoder.block.1", "lm_head"], src, src_mask, tgt, tgt_mask)
    scope = acs.ActivationScope(store=tmp_path / "s.zarr", reductions=["mean"])
    with pytest.warns(acs.CaptureWarning, match=r"decoder hook points of the encoder-decoder model "
                      r"T5ForConditionalGeneration start with the decoder's \(batch, T\), not with the \(batch, pos\) "
                      r"\(3, 6\) of the encoder's mask.*'decoder\.block\.1\.output\.0' \(3, 4, 32\), 'lm_head\.output' "
                      r"\(3, 4, 200\)\. They are stored one row per sample"):
        with torch.no_grad(), scope.track(model, include=["encoder.block.1", "decoder.block.1", "lm_head"]) as tracker:
            tracker.set_batch(attention_mask=src_mask)
            model(input_ids=src, attention_mask=src_mask, decoder_input_ids=tgt, decoder_attention_mask=tgt_mask)
    store = acs.open_store(tmp_path / "s.zarr")
    assert store.row_kind("lm_head.output") == "sample"
    assert torch.equal(store["lm_head.output"], ref["lm_head"])
    assert torch.equal(store["decoder.block.1.output.0"], ref["decoder.block.1"])


def test_decoder_sample_rows_asked_for_are_not_warned_about(tmp_path):
    model = _t5()
    src, src_mask, tgt, tgt_mask = _batch(4)
    scope = acs.ActivationScope(store=tmp_path / "s.zarr", token_rows={"lm_head*": False})
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        with scope.track(model, include=["lm_head"]) as tracker:
            tracker.set_batch(attention_mask=src_mask)
            model(input_ids=src, attention_mask=src_mask, decoder_input_ids=tgt, decoder_attention_mask=tgt_mask)
    assert not [w for w in caught if "decoder hook points" in str(w.message)]
    assert acs.open_store(tmp_path / "s.zarr").n_rows("lm_head.output") == B


class _PackedInput(torch.nn.Module):
    """Takes a PackedSequence: a GRU over it, a head on the last layer's hidden state."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.gru = torch.nn.GRU(4, 3, batch_first=True)
        self.head = torch.nn.Linear(3, 2)

    def forward(self, packed):
        _, h = self.gru(packed)
        return self.head(h[-1])


@pytest.mark.parametrize("by_keyword", [False, True])
def test_a_packed_sequence_input_counts_its_samples_not_its_tokens(tmp_path, by_keyword):
    # the PackedSequence's first tensor, data, is (5 + 2 + 3 tokens, 4): the batch is 3 samples,
    # not 10 (the row table had 10 samples, the head's 3 rows left it, and a column of 3 was refused)
    model = _PackedInput().eval()
    x, lengths = torch.randn(3, 5, 4), torch.tensor([5, 2, 3])
    packed = torch.nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
    with torch.no_grad():
        expected = model(packed)
    with torch.no_grad(), acs.ActivationScope(store=tmp_path / "s.zarr").track(model, include=["head"]) as tracker:
        tracker.set_batch(label=[0, 1, 2], sample_ids=[4, 5, 6])
        model(packed=packed) if by_keyword else model(packed)
    store = acs.open_store(tmp_path / "s.zarr")
    assert store.n_samples == 3 and store.follows_row_table("head.output")
    assert torch.equal(store["head.output"], expected)
    table = store.row_table("sample")
    assert table.column("sample_id").to_pylist() == [4, 5, 6]
    assert table.column("label").to_pylist() == [0, 1, 2]
    with torch.no_grad(), acs.ActivationScope(store=tmp_path / "t.zarr").track(model, include=["head"]):
        model(packed)  # no description: the counter numbers 3 samples
    assert acs.open_store(tmp_path / "t.zarr").row_table("sample").column("sample_id").to_pylist() == [0, 1, 2]


def test_the_compiled_path_reads_a_packed_sequence_batch_as_the_native_one():
    from activationscope.capture.compiled import first_input

    packed = torch.nn.utils.rnn.pack_padded_sequence(torch.randn(3, 5, 4), torch.tensor([5, 2, 3]), batch_first=True,
                                                     enforce_sorted=False)
    assert first_input((packed,), {}).shape == (3,)
    assert first_input((), {"packed": packed}, ("packed",)).shape == (3,)


def test_a_decoder_mask_of_ones_own_is_refused_until_confirmed(tmp_path):
    # a training forward given labels (the decoder's input made from them, no decoder mask):
    # the decoder tracker's mask leaves out the -100 positions. It is neither mask the model
    # has, so it is refused, naming token_rows=; confirmed, the rows are those of the mask
    model = _t5()
    src, src_mask, tgt, tgt_mask = _batch(S)
    labels = tgt.masked_fill(tgt_mask == 0, -100)
    out, _ = plain_hooks(model, lambda: model(input_ids=src, attention_mask=src_mask, labels=labels), ["lm_head"])
    mask = labels != -100
    with pytest.raises(acs.CaptureError, match=r"'lm_head\.output' is on the decoder side.*labels != -100.*"
                       r"token_rows=\{'lm_head\.output': True\}"):
        with torch.no_grad(), acs.ActivationScope(store=tmp_path / "a.zarr").track(model, include=["lm_head"]) as t:
            t.set_batch(attention_mask=mask)
            model(input_ids=src, attention_mask=src_mask, labels=labels)
    scope = acs.ActivationScope(store=tmp_path / "b.zarr", token_rows={"lm_head*": True})
    with torch.no_grad(), scope.track(model, include=["lm_head"]) as tracker:
        tracker.set_batch(attention_mask=mask)
        model(input_ids=src, attention_mask=src_mask, labels=labels)
    assert torch.equal(acs.open_store(tmp_path / "b.zarr")["lm_head.output"], out["lm_head.output"][0][mask])


def test_generate_names_the_position_bias_whose_shape_grows_and_its_exclusion_captures_the_rest(tmp_path):
    # a T5 decoder block returns its position bias (1, heads, query, key) next to its hidden
    # state: one tensor shared by the batch, which each generate() step grows by one key. The
    # error at the second step named attention masks and image sizes; it now names the bias
    model = _t5()
    src, src_mask, _, _ = _batch(S)
    block = "decoder.block.0"
    with pytest.raises(acs.CaptureError, match=rf"'{block}\.output\.1' changed its feature shape") as raised, \
            warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad(), acs.ActivationScope(store=tmp_path / "a.zarr").track(model, include=[block]) as t:
            t.set_batch(sample_ids=[0, 1, 2])
            model.generate(input_ids=src, attention_mask=src_mask, max_new_tokens=3, min_new_tokens=3,
                           do_sample=False)
    # (at the first step's end: its one row for 3 samples leaves the row table)
    lost = [str(w.message) for w in caught if "row table got 3" in str(w.message)]
    assert len(lost) == 2 and all("one tensor shared by the batch's samples" in w for w in lost), lost
    assert f"exclude_hook_points=['{block}.output.1']" in lost[0]
    notes = " ".join(getattr(raised.value, "__notes__", []))
    assert f"'{block}.output.1' is one tensor shared by the batch's samples" in notes
    assert "(1, 2, 1, 1)" in notes and f"exclude_hook_points=['{block}.output.1']" in notes
    got, expected = plain_hooks(model, lambda: model.generate(
        input_ids=src, attention_mask=src_mask, max_new_tokens=3, min_new_tokens=3, do_sample=False),
        [block], structured="first")
    steps = got[f"{block}.output"]
    scope = acs.ActivationScope(store=tmp_path / "b.zarr", exclude_hook_points=["decoder.block.*.output.[12]"])
    with torch.no_grad(), scope.track(model, include=[block]) as t:
        t.set_batch(sample_ids=[0, 1, 2])
        out = model.generate(input_ids=src, attention_mask=src_mask, max_new_tokens=3, min_new_tokens=3,
                             do_sample=False)
    assert torch.equal(out, expected)
    store = acs.open_store(tmp_path / "b.zarr")
    assert store.hook_points == [f"{block}.output.0"]
    assert len(steps) == 3 and torch.equal(store[f"{block}.output.0"], torch.cat(steps))
