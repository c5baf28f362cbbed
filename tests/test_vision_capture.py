"""Convolutional networks: what a capture of conv feature maps (batch, C, H, W) tells the user."""

from __future__ import annotations

import warnings

import pytest
import torch

import activationscope as acs
from activationscope.errors import CaptureError

from acs_testing import plain_hooks


class _Stem(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(4)
        self.pool = torch.nn.AdaptiveAvgPool2d(1)

    def forward(self, x):
        return self.pool(torch.relu(self.bn(self.conv(x))))


def test_images_of_another_size_name_the_fixes_for_images(tmp_path):
    """Conv maps follow the input's size: a second batch of 10x10 images after 8x8 ones is
    refused, and the message only said to pass an attention mask (a fix for token sequences
    that does not apply to images). It now names the fixes for images too, and the pooled
    output of the same forwards is stored."""
    torch.manual_seed(0)
    model = _Stem().eval()
    scope = acs.ActivationScope(store=str(tmp_path / "s.zarr"))
    with pytest.raises(CaptureError) as info:
        with torch.no_grad(), scope.track(model, include=["conv", "pool"]):
            model(torch.randn(2, 3, 8, 8))
            model(torch.randn(2, 3, 10, 10))
    message = str(info.value)
    assert "hook point 'conv.output' changed its feature shape from (4, 8, 8) to (4, 10, 10)" in message
    assert "for images of varying size" in message and "resize or crop" in message
    assert "nn.AdaptiveAvgPool2d" in message
    store = acs.open_store(tmp_path / "s.zarr")
    assert store.n_rows("pool.output") == 2  # the first forward is kept whole


class _Block(torch.nn.Module):
    """A residual block as in ResNet (in-place ReLU called twice per forward)."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(c)
        self.relu = torch.nn.ReLU(inplace=True)
        self.conv2 = torch.nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = torch.nn.BatchNorm2d(c)

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(out)) + x)


class _Views(torch.nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

    def forward(self, x):
        if self.kind == "transpose":
            return x.transpose(1, 3)
        if self.kind == "slice":
            return x[:, ::2, 1:, :]
        return x[:, :1].expand(-1, 3, -1, -1)  # stride 0 along channels


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.BatchNorm2d(4))
        self.block = _Block(4)
        self.t, self.s, self.e = _Views("transpose"), _Views("slice"), _Views("expand")
        self.drop = torch.nn.Dropout(0.5)
        self.fc = torch.nn.Linear(4, 3)

    def forward(self, x):
        y = self.block(self.stem(x))
        side = self.t(y).mean() + self.s(y).mean() + self.e(y).mean()
        return self.fc(self.drop(y.mean((2, 3)))) + side


_HOOKED = ["stem", "block.bn1", "block.relu", "block", "t", "s", "e", "drop"]


def _reference(model, batches):
    """Plain forward hooks, cloned at the call (a module called twice gives two lists)."""
    seen, outs = plain_hooks(model, lambda: [model(b) for b in batches], _HOOKED, grad=True)
    per_call = {}
    for key, calls in seen.items():
        name = key.removesuffix(".output")
        k = len(calls) // len(batches)
        for j in range(k):
            hp = f"{name}.output" if j == 0 else f"{name}#{j}.output"
            per_call[hp] = torch.cat(calls[j::k])
    return per_call, outs


@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last])
@pytest.mark.parametrize("mode", ["eval", "train"])
def test_conv_maps_in_a_store_equal_forward_hooks_and_leave_the_model_as_untracked(tmp_path, memory_format, mode):
    """Rows of conv maps (channels_last inputs, transposed, sliced and expanded outputs, an
    in-place ReLU called twice, BatchNorm in train mode, dropout) equal plain forward hooks;
    float64 reductions equal torch over the stored rows; a tracked training step gives the
    same outputs, gradients and BatchNorm running statistics as an untracked one."""
    import copy

    torch.manual_seed(0)
    base = _Net().to(memory_format=memory_format)
    base.train(mode == "train")
    images = torch.randn(11, 3, 6, 6).contiguous(memory_format=memory_format)
    batches = list(images.split(4))  # 4, 4, 3: the last batch smaller
    plain, tracked = copy.deepcopy(base), copy.deepcopy(base)
    torch.manual_seed(1)
    ref, ref_out = _reference(plain, batches)
    sum(o.square().sum() for o in ref_out).backward()
    scope = acs.ActivationScope(store=str(tmp_path / "s.zarr"), reductions=["mean", "var", "min", ("top", "topk", {"k": 2})])
    torch.manual_seed(1)
    with scope.track(tracked, include=_HOOKED):
        outs = [tracked(b) for b in batches]
    sum(o.square().sum() for o in outs).backward()
    for a, b in zip(ref_out, outs):
        assert torch.equal(a, b)
    for (name, p), q in zip(plain.named_parameters(), tracked.parameters()):
        assert torch.equal(p.grad, q.grad), name
    for (name, a), b in zip(plain.state_dict().items(), tracked.state_dict().values()):
        assert torch.equal(a, b), name
    store = acs.open_store(tmp_path / "s.zarr")
    assert sorted(store.hook_points) == sorted(ref)
    for hp, rows in ref.items():
        assert torch.equal(store[hp], rows), hp
        x = rows.double()
        red = store.reductions[hp]
        torch.testing.assert_close(red["mean"], x.mean(0), rtol=1e-12, atol=1e-300)
        torch.testing.assert_close(red["var"], x.var(0, correction=0), rtol=1e-12, atol=1e-300)
        assert torch.equal(red["min"], x.amin(0)), hp
        values, row_ids = torch.sort(x, dim=0, descending=True, stable=True)  # ties: the lower row first
        assert torch.equal(red["top.values"], values[:2]) and torch.equal(red["top.row_ids"], row_ids[:2]), hp


# (REFERENCE records of bn1 warn: the in-place ReLU after it changes them, as it should be said)
@pytest.mark.filterwarnings("ignore:hook point .block.bn1.output...a tensor kept by CaptureMode.REFERENCE")
@pytest.mark.parametrize("mode", [acs.CaptureMode.SNAPSHOT, acs.CaptureMode.REFERENCE])
def test_records_under_grad_hold_no_graph(mode):
    """Records of a forward with grad enabled are detached: they do not require grad and do
    not keep the autograd graph (and the tensors it saved) alive once the output is dropped."""
    import gc
    import weakref

    torch.manual_seed(0)
    model = _Net().train()

    class Marker:
        pass

    with acs.ActivationScope(capture_mode=mode).track(model, include=_HOOKED) as tracker:
        out = model(torch.randn(4, 3, 6, 6))
        marker = Marker()
        out.grad_fn.register_hook(lambda *args, m=marker: None)  # lives as long as the graph
        alive = weakref.ref(marker)
        del marker
        assert alive() is not None
        del out
    gc.collect()
    assert alive() is None
    records = tracker.activations
    assert records and all(not r.requires_grad and r.grad_fn is None for rs in records.values() for r in rs)


def test_stop_after_last_in_training_mode_says_what_it_changes():
    """stop_after_last=True skips the modules after the stop point: in training mode their
    dropout draws no random numbers, so the next forwards' dropout masks (before the stop
    point too) and their records differed from a full run's, while the docs said records are
    exactly a full run's. The capture now says so when such modules are in training mode;
    in eval mode the records are a full run's, without a warning, and so are they when
    every such module comes before the stop point."""
    import warnings

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Dropout(0.5), torch.nn.Conv2d(4, 4, 3),
                                torch.nn.Dropout(0.5))
    images = torch.randn(12, 3, 8, 8)
    records = {}
    for train in (True, False):
        model.train(train)
        for stop in (False, True):
            torch.manual_seed(7)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                with torch.no_grad(), acs.ActivationScope().track(model, include=["1"], stop_after_last=stop) as tr:
                    for b in images.split(4):
                        model(b)
            said = [str(w.message) for w in caught if issubclass(w.category, acs.CaptureWarning)]
            records[train, stop] = torch.cat(tr.activations["1.output"])
            if train and stop:
                assert len(said) == 1 and "stop_after_last=True with the model in training mode skips '3'" in said[0]
                assert "'1'" not in said[0] and "model.eval()" in said[0]  # (the dropout before the stop point runs)
            else:
                assert not said, said
    assert not torch.equal(records[True, True], records[True, False])  # what the warning is about
    assert torch.equal(records[False, True], records[False, False])
    model.train()
    with warnings.catch_warnings():
        warnings.simplefilter("error", acs.CaptureWarning)
        with torch.no_grad(), acs.ActivationScope().track(model, include=["3"], stop_after_last=True):
            for b in images.split(4):
                model(b)  # nothing after the stop point: no warning


def test_stop_after_last_in_training_mode_before_a_batchnorm_names_its_statistics():
    import warnings

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4)).train()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad(), acs.ActivationScope().track(model, include=["0"], stop_after_last=True):
            for _ in range(3):
                model(torch.randn(4, 3, 6, 6))
    said = [str(w.message) for w in caught if issubclass(w.category, acs.CaptureWarning)]
    assert len(said) == 1 and "skips '1' after the stop point: its BatchNorm running statistics are not updated" in said[0]
    assert "dropout" not in said[0]
    assert int(model[1].num_batches_tracked) == 1  # only the first, full forward ran it


class _TinyViT(torch.nn.Module):
    """Patches of 8x8 pixels, a class token, one layer: (batch, 3, 16, 16) -> (batch, 5, 8)."""

    def __init__(self) -> None:
        super().__init__()
        self.patch = torch.nn.Conv2d(3, 8, 8, stride=8)
        self.cls = torch.nn.Parameter(torch.randn(1, 1, 8))
        self.layer = torch.nn.Linear(8, 8)

    def forward(self, pixel_values):
        x = self.patch(pixel_values).flatten(2).transpose(1, 2)
        return self.layer(torch.cat([self.cls.expand(len(x), -1, -1), x], dim=1))


def test_token_rows_taken_from_an_image_input_warn_and_a_patch_mask_stores_patches(tmp_path):
    """rows="token" takes (batch, pos) from the model's first input; for pixel values
    (batch, channels, height, width) that is (batch, channels): under capture="both" the image
    itself was stored as one token row per channel, labelled with the channel as pos, and the
    (batch, patches, d) hidden states one row per sample, without a word. A warning now names
    the hook points taken so and the mask that gives one row per patch, which works."""
    torch.manual_seed(0)
    model = _TinyViT().eval()
    pixels = torch.randn(2, 3, 16, 16)
    scope = acs.ActivationScope(store=str(tmp_path / "a.zarr"), rows="token", capture="both")
    with pytest.warns(acs.CaptureWarning, match=r"rows='token' took \(batch, pos\) = \(2, 3\)") as caught:
        with torch.no_grad(), scope.track(model, include=["patch", "layer"]):
            model(pixels)
            model(pixels)
    messages = [str(w.message) for w in caught if "rows='token' took" in str(w.message)]
    assert len(messages) == 1  # once per capture
    assert "'patch.input.0' stored 3 token rows per sample" in messages[0]
    assert "(2, 3, 16, 16)" in messages[0] and "set_batch(attention_mask=" in messages[0]
    store = acs.open_store(tmp_path / "a.zarr")
    assert store.row_kind("patch.input.0") == "token" and store.row_kind("layer.output") == "sample"

    # the fix the warning names: a mask of the hidden states' (batch, pos)
    scope = acs.ActivationScope(store=str(tmp_path / "b.zarr"), rows="token", capture="both")
    with torch.no_grad(), scope.track(model, include=["patch", "layer"]) as tracker:
        tracker.set_batch(attention_mask=torch.ones(2, 5, dtype=torch.bool))
        model(pixels)
    store = acs.open_store(tmp_path / "b.zarr")
    assert store.row_kind("patch.input.0") == "sample" and store.row_kind("layer.output") == "token"
    with torch.no_grad():
        reference = model(pixels)
    assert torch.equal(store["layer.output"], reference.reshape(10, 8))
    assert torch.equal(store["patch.input.0"], pixels)
    assert store.row_table("token").column("pos").to_pylist() == [0, 1, 2, 3, 4] * 2


class _TinyAudioEncoder(torch.nn.Module):
    """Log-mel features (batch, 8 mel bins, 20 frames) -> a strided conv -> (batch, 10, 8)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv1d(8, 6, 3, stride=2, padding=1)
        self.layer = torch.nn.Linear(6, 8)

    def forward(self, input_features):
        return self.layer(self.conv(input_features).transpose(1, 2))


def test_token_rows_taken_from_audio_features_by_keyword_are_warned_about(tmp_path):
    """Whisper's input_features (batch, mel bins, frames) are 3-D like embeddings: rows="token"
    took (batch, mel bins) as (batch, pos) and stored the conv's input one row per mel bin as
    tokens, silently. The Hugging Face name of the input now tells them apart."""
    torch.manual_seed(0)
    model = _TinyAudioEncoder().eval()
    features = torch.randn(2, 8, 20)
    scope = acs.ActivationScope(store=str(tmp_path / "a.zarr"), rows="token", capture="both")
    with pytest.warns(acs.CaptureWarning, match=r"input_features of shape \(2, 8, 20\)") as caught:
        with torch.no_grad(), scope.track(model, include=["conv", "layer"]):
            model(input_features=features)
    message = next(str(w.message) for w in caught if "rows='token' took" in str(w.message))
    assert "'conv.input.0' stored 8 token rows per sample" in message and "'conv.output'" not in message
    store = acs.open_store(tmp_path / "a.zarr")
    assert store.row_kind("conv.input.0") == "token" and store.row_kind("layer.output") == "sample"


class _TinyCLIP(torch.nn.Module):
    """A text tower over token ids (batch, 5) and a vision tower over (batch, 3, 16, 16)
    images, whose 4 patches and class token make (batch, 5, 8) as well."""

    def __init__(self) -> None:
        super().__init__()
        self.text_model = torch.nn.Sequential(torch.nn.Embedding(50, 8), torch.nn.Linear(8, 8))
        self.vision_model = _TinyViT()

    def forward(self, input_ids, pixel_values, attention_mask=None):
        return self.text_model(input_ids)[:, 0] @ self.vision_model(pixel_values)[:, 0].T


@pytest.mark.parametrize("token_rows", [None, {"vision_model.*": False}, {"vision_model.*": True}])
def test_vision_tower_rows_taken_with_the_text_mask_are_warned_about(tmp_path, token_rows):
    """A text-and-image model whose vision tower has as many positions as the text: its hidden
    states (batch, 5, d) start with the text's (batch, 5) mask, so they were stored as token
    rows, patches dropped by the text's padding and labelled with text positions, silently.
    A warning now names them and token_rows={'vision_model.*': False}, which stores one row per
    image; token_rows={'vision_model.*': True} confirms token rows without it."""
    torch.manual_seed(0)
    model = _TinyCLIP().eval()
    ids = torch.randint(0, 50, (2, 5))
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    pixels = torch.randn(2, 3, 16, 16)
    scope = acs.ActivationScope(store=str(tmp_path / "a.zarr"), token_rows=token_rows)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad(), scope.track(model, include=["text_model.1", "vision_model.layer"]) as tracker:
            tracker.set_batch(attention_mask=mask)
            model(ids, pixels, attention_mask=mask)
    messages = [str(w.message) for w in caught if "vision or audio tower" in str(w.message)]
    store = acs.open_store(tmp_path / "a.zarr")
    assert store.row_kind("text_model.1.output") == "token" and store.n_rows("text_model.1.output") == 8
    if token_rows is None:
        assert len(messages) == 1
        assert "'vision_model.layer.output'" in messages[0] and "(batch, pos) = (2, 5)" in messages[0]
        assert "token_rows={'vision_model.*': False}" in messages[0] and "'text_model.1.output'" not in messages[0]
        assert store.row_kind("vision_model.layer.output") == "token"
    elif token_rows["vision_model.*"]:  # confirmed: no warning
        assert messages == []
        assert store.row_kind("vision_model.layer.output") == "token"
    else:
        assert messages == []
        with torch.no_grad():
            reference = model.vision_model(pixels)
        assert store.row_kind("vision_model.layer.output") == "sample"
        assert torch.equal(store["vision_model.layer.output"], reference)
