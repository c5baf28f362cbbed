"""Hook points whose first two sizes only look like the ``(batch, pos)`` of token rows: T5's
relative position bias ``(query, key, heads)`` has no batch dimension, and where the batch has
as many samples as positions it would be stored as the samples' tokens."""

from __future__ import annotations

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
