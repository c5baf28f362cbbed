"""Hook points whose first two sizes only look like the ``(batch, pos)`` of token rows: T5's
relative position bias ``(query, key, heads)`` has no batch dimension, and where the batch has
as many samples as positions it would be stored as the samples' tokens."""

from __future__ import annotations

import contextlib
import json
import warnings

import pytest
import torch

import activationscope as acs
from activationscope.errors import CaptureWarning

transformers = pytest.importorskip("transformers")

BIAS = "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.output"


def _t5_encoder():
    torch.manual_seed(0)
    config = transformers.T5Config(vocab_size=50, d_model=8, d_kv=2, d_ff=16, num_layers=1, num_heads=4,
                                   relative_attention_num_buckets=8, dropout_rate=0.0)
    return transformers.T5EncoderModel(config).eval()


@pytest.mark.parametrize("masked", [False, True])
def test_t5_position_bias_is_not_token_rows_when_batch_equals_pos(tmp_path, masked):
    model = _t5_encoder()
    ids = torch.randint(1, 50, (4, 4))                      # as many samples as positions
    mask = torch.ones(4, 4, dtype=torch.bool)
    scope = acs.ActivationScope(store=tmp_path / "s.zarr", rows="token")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad(), scope.track(model, include=["*relative_attention_bias", "encoder.final_layer_norm"]) as tracker:
            for _ in range(2):
                if masked:
                    tracker.set_batch(attention_mask=mask)
                model(ids)
    messages = [str(w.message) for w in caught if issubclass(w.category, CaptureWarning)]
    named = [m for m in messages if BIAS in m and "no batch dimension" in m]
    assert len(named) == 1 and "exclude_hook_points=" in named[0]
    store = acs.open_store(tmp_path / "s.zarr")
    with torch.no_grad():
        bias = model.encoder.block[0].layer[0].SelfAttention.relative_attention_bias.weight
    assert store.row_kind(BIAS) == "sample"
    assert not store.follows_row_table(BIAS)
    assert tuple(store[BIAS].shape) == (8, 4, 4)            # 4 queries per forward, (key, heads) each
    assert store[BIAS][0, 0].tolist() == bias[0].tolist()    # query 0, key 0: bucket 0
    # the hidden states keep their token rows, labelled (sample, position)
    assert store.row_kind("encoder.final_layer_norm.output") == "token"
    assert store.follows_row_table("encoder.final_layer_norm.output")
    assert tuple(store["encoder.final_layer_norm.output"].shape) == (32, 8)


def test_t5_position_bias_in_memory_is_not_warned_about():
    model = _t5_encoder()
    with warnings.catch_warnings():
        warnings.simplefilter("error", CaptureWarning)
        with torch.no_grad(), acs.ActivationScope(rows="token").track(
                model, include=["*relative_attention_bias", "encoder.final_layer_norm"]) as tr:
            model(torch.randint(1, 50, (4, 4)))
    assert tuple(tr.activations[BIAS][0].shape) == (4, 4, 4)


@pytest.mark.parametrize("arch", ["bert", "gpt2"])
def test_hidden_states_with_batch_equal_to_pos_give_no_position_bias_warning(tmp_path, arch):
    torch.manual_seed(0)
    if arch == "bert":
        include = ["encoder.layer.0.output*"]
        config = transformers.BertConfig(vocab_size=50, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                                         intermediate_size=16, max_position_embeddings=16)
        model = transformers.BertModel(config).eval()
    else:
        config = transformers.GPT2Config(vocab_size=50, n_embd=8, n_layer=1, n_head=2, n_positions=16)
        model = transformers.GPT2Model(config).eval()
        include = ["h.0.mlp*"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad(), acs.ActivationScope(store=tmp_path / "s.zarr", rows="token").track(
                model, include=include):
            model(torch.randint(1, 50, (4, 4)))
    assert not [w for w in caught if "relative position bias" in str(w.message)]
    store = acs.open_store(tmp_path / "s.zarr")
    assert store.hook_points and all(store.row_kind(hp) == "token" for hp in store.hook_points)


class EncDec(torch.nn.Module):
    """A home-made encoder-decoder: forward(src, tgt), its decoder states (batch, S, d)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(50, 8)
        self.enc = torch.nn.Linear(8, 8)
        self.dec = torch.nn.Linear(8, 8)

    def forward(self, src, tgt, tgt_mask=None):
        memory = self.enc(self.emb(src)).mean(1, keepdim=True)
        return self.dec(self.emb(tgt) + memory)


def _second_sequence_warnings(tmp_path, tgt_len, token_rows=None, mask_padding=True, by_keyword=False):
    model = EncDec().eval()
    src, tgt = torch.randint(1, 50, (4, 4)), torch.randint(1, 50, (4, tgt_len))
    mask = torch.ones(4, 4, dtype=torch.bool)
    if mask_padding:
        mask[2:, 3:] = False                                 # the source's padding, not the target's
    scope = acs.ActivationScope(store=tmp_path / "s.zarr", rows="token", token_rows=token_rows)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad(), scope.track(model, include=["enc", "dec"]) as tracker:
            for _ in range(2):
                tracker.set_batch(attention_mask=mask)
                model(src, tgt=tgt) if by_keyword else model(src, tgt)
    return [str(w.message) for w in caught if "second sequence" in str(w.message)]


@pytest.mark.parametrize("by_keyword", [False, True])
def test_home_made_encoder_decoder_with_equal_lengths_warns_about_the_target_rows(tmp_path, by_keyword):
    found = _second_sequence_warnings(tmp_path, 4, by_keyword=by_keyword)
    assert len(found) == 1                                   # once per capture
    assert "'tgt' (batch, pos) = (4, 4)" in found[0] and "'dec.output'" in found[0]
    assert "token_rows={pattern: False}" in found[0]
    store = acs.open_store(tmp_path / "s.zarr")
    assert tuple(store["dec.output"].shape) == (28, 8)      # stored as before: the warning tells


@pytest.mark.parametrize("case", ["other_length", "no_padding", "token_rows_given"])
def test_home_made_encoder_decoder_without_ambiguity_is_not_warned_about(tmp_path, case):
    found = _second_sequence_warnings(
        tmp_path, 5 if case == "other_length" else 4, mask_padding=case != "no_padding",
        token_rows={"dec.*": False} if case == "token_rows_given" else None)
    assert found == []


@pytest.mark.parametrize("arch", ["bert", "gpt2"])
def test_single_sequence_models_with_a_padded_mask_give_no_second_sequence_warning(tmp_path, arch):
    torch.manual_seed(0)
    if arch == "bert":
        model = transformers.BertModel(transformers.BertConfig(
            vocab_size=50, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16,
            max_position_embeddings=16)).eval()
    else:
        model = transformers.GPT2Model(transformers.GPT2Config(vocab_size=50, n_embd=8, n_layer=1, n_head=2,
                                                               n_positions=16)).eval()
    ids = torch.randint(1, 50, (4, 4))
    mask = torch.ones(4, 4, dtype=torch.long)
    mask[2:, 3:] = 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad(), acs.ActivationScope(store=tmp_path / "s.zarr").track(model) as tracker:
            tracker.set_batch(attention_mask=mask, token_ids=ids)
            model(ids, attention_mask=mask)
    assert not [w for w in caught if "second sequence" in str(w.message) or "relative position" in str(w.message)]


def test_home_made_encoder_decoder_one_tracker_per_side_is_not_warned_about(tmp_path):
    model = EncDec().eval()
    src, tgt = torch.randint(1, 50, (4, 4)), torch.randint(1, 50, (4, 4))
    src_mask = torch.ones(4, 4, dtype=torch.bool)
    src_mask[2:, 3:] = False
    tgt_mask = torch.ones(4, 4, dtype=torch.bool)
    tgt_mask[1:, 2:] = False
    enc = acs.ActivationScope(store=tmp_path / "enc.zarr")
    dec = acs.ActivationScope(store=tmp_path / "dec.zarr")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad(), enc.track(model, include=["enc"]) as src_tracker, \
                dec.track(model, include=["dec"]) as tgt_tracker:
            src_tracker.set_batch(attention_mask=src_mask)
            tgt_tracker.set_batch(attention_mask=tgt_mask)
            model(src, tgt)
    assert not [w for w in caught if "second sequence" in str(w.message)]
    assert tuple(acs.open_store(tmp_path / "dec.zarr")["dec.output"].shape) == (int(tgt_mask.sum()), 8)


def test_t5_position_bias_buckets_input_is_not_token_rows(tmp_path):
    model = _t5_encoder()
    buckets = BIAS.replace(".output", ".input.0")
    scope = acs.ActivationScope(store=tmp_path / "s.zarr", rows="token", capture="both")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad(), scope.track(model, include=["*relative_attention_bias", "encoder.final_layer_norm"]):
            model(torch.randint(1, 50, (4, 4)))
    assert any(buckets in str(w.message) and "no batch dimension" in str(w.message) for w in caught)
    store = acs.open_store(tmp_path / "s.zarr")
    assert store.row_kind(buckets) == "sample" and not store.follows_row_table(buckets)
    assert tuple(store[buckets].shape) == (4, 4)            # (query, key) buckets, one row per query
    assert store[buckets][0, 0].item() == 0                  # query 0, key 0: bucket 0


def _old_layout_store(path, model, ids, mask):
    """A store as the version before position biases were stored off the row table wrote it:
    the bias as the samples' token rows (forced with token_rows=), its capture_config without
    that token_rows record (the old version decided by the shape alone)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CaptureWarning)
        with torch.no_grad(), acs.ActivationScope(store=path, rows="token").track(
                model, include=["*relative_attention_bias", "encoder.final_layer_norm"],
                token_rows={BIAS: True}) as tracker:
            tracker.set_batch(attention_mask=mask)
            model(ids)
    doc = json.loads((path / "zarr.json").read_text())
    doc["attributes"]["activationscope"]["capture_config"]["token_rows"] = None
    (path / "zarr.json").write_text(json.dumps(doc))
    store = acs.open_store(path)
    assert store.row_kind(BIAS) == "token" and store.follows_row_table(BIAS)
    assert tuple(store[BIAS].shape) == (16, 4)


@pytest.mark.parametrize("how", ["plain", "token_rows", "overwrite"])
def test_resume_of_a_store_with_the_position_bias_as_token_rows_names_how_to_go_on(tmp_path, how):
    """A store captured when T5's position bias was stored as token rows was refused on resume
    with "resume with the same model and options, or overwrite=True" only, though the model and
    options were the same. The error now says why and names the ways on that work: token_rows=
    to continue as before, or a new store; each of them does."""
    model = _t5_encoder()
    ids, mask = torch.randint(1, 50, (4, 4)), torch.ones(4, 4, dtype=torch.bool)
    path = tmp_path / "old.zarr"
    _old_layout_store(path, model, ids, mask)
    before = acs.open_store(path)[BIAS].clone()
    kwargs = {"token_rows": {BIAS: True}} if how == "token_rows" else {}
    options = {"overwrite": True} if how == "overwrite" else {"resume": True}
    scope = acs.ActivationScope(store=path, rows="token", store_options=options)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CaptureWarning)
        with contextlib.ExitStack() as stack:
            if how == "plain":
                refused = stack.enter_context(pytest.raises(acs.StoreError))
            with torch.no_grad(), scope.track(model, include=["*relative_attention_bias", "encoder.final_layer_norm"],
                                              **kwargs) as tracker:
                tracker.set_batch(attention_mask=mask)
                model(ids)
    store = acs.open_store(path)
    if how == "plain":
        msg = str(refused.value)
        assert BIAS in msg and f"token_rows={{{BIAS!r}: True}}" in msg and "new store" in msg, msg
        assert "exclude_hook_points" not in msg, msg          # (a resume must give every stored hook point)
        assert store.status == "complete" and torch.equal(store[BIAS], before)
    elif how == "token_rows":                               # continued as before: token rows
        assert store.status == "complete" and store.row_kind(BIAS) == "token" and store.follows_row_table(BIAS)
        assert torch.equal(store[BIAS], torch.cat([before, before]))
    else:                                                   # captured again: one row per query
        assert store.row_kind(BIAS) == "sample" and not store.follows_row_table(BIAS)
        assert tuple(store[BIAS].shape) == (4, 4, 4)
