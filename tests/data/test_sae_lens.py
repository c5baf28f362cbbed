"""An HF export in SAELens's cached-activations layout, read by SAELens itself."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

import activationscope as acs
from activationscope.data import export_hf

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
pytest.importorskip("datasets", reason="needs `pip install datasets`")
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    sae_lens = pytest.importorskip("sae_lens", reason="SAELens is optional: pip install -e '.[interop]'")


def test_padded_token_rows_packed_for_sae_lens(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(40, 8), torch.nn.Linear(8, 8))
    tokens = torch.randint(1, 40, (10, 7))
    lengths = torch.tensor([7, 3, 5, 7, 2, 6, 4, 7, 1, 5])
    mask = torch.arange(7)[None, :] < lengths[:, None]                      # 47 real tokens
    with acs.ActivationScope(store=str(tmp_path / "s.zarr"), storage_dtype=torch.bfloat16).track(model, include=["1"]) as tr:
        tr.set_batch(attention_mask=mask, token_ids=tokens)
        model(tokens)
    store = acs.open_store(str(tmp_path / "s.zarr"))
    assert store.n_rows("1.output") == 47
    export_hf(store, tmp_path / "cache", hook_points="1.output", columns=["token_ids"], context_size=4, drop_last=True)
    acts_store = sae_lens.ActivationsStore(
        model=model, dataset=None, cached_activations_path=str(tmp_path / "cache"), hook_name="1.output",
        context_size=4, d_in=8, streaming=False, hook_head_index=None, n_batches_in_buffer=2,
        total_training_tokens=100, store_batch_size_prompts=3, train_batch_size_tokens=4, prepend_bos=False,
        normalize_activations="none", device=torch.device("cpu"), dtype="float32")
    got, ids = [], []
    while True:
        try:
            a, t = acts_store.get_raw_llm_batch(raise_on_epoch_end=True)
        except StopIteration:
            break
        got.append(a)
        ids.append(t)
    # 11 windows of 4 tokens; SAELens reads whole batches of 3 windows: 9 windows, 36 rows
    assert torch.equal(torch.cat(got), store["1.output"][:36].float())       # bf16 exported as exact float32
    assert torch.equal(torch.cat(ids), tokens[mask][:36])


def test_head_split_rows_are_exported_flat_as_sae_lens_caches_them(tmp_path):
    # hook_z rows are (n_heads, d_head); SAELens caches (and reads back) such a hook as
    # (context_size, n_heads * d_head), the heads side by side (hook_head_index=None)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(40, 8), torch.nn.Unflatten(-1, (2, 4)))
    tokens = torch.randint(1, 40, (6, 4))
    with acs.ActivationScope(store=str(tmp_path / "s.zarr"), rows="token").track(model, include=["1"]) as tr:
        tr.set_batch(token_ids=tokens)
        model(tokens)
    store = acs.open_store(str(tmp_path / "s.zarr"))
    assert store.feature_shape("1.output") == (2, 4)
    export_hf(store, tmp_path / "cache", hook_points="1.output", columns=["token_ids"], context_size=4)
    acts_store = sae_lens.ActivationsStore(
        model=model, dataset=None, cached_activations_path=str(tmp_path / "cache"), hook_name="1.output",
        context_size=4, d_in=8, streaming=False, hook_head_index=None, n_batches_in_buffer=2,
        total_training_tokens=24, store_batch_size_prompts=3, train_batch_size_tokens=4, prepend_bos=False,
        normalize_activations="none", device=torch.device("cpu"), dtype="float32")
    a, t = acts_store.get_raw_llm_batch()
    assert torch.equal(a, store["1.output"][:12].reshape(12, 8))
    assert torch.equal(t, tokens.reshape(-1)[:12])
