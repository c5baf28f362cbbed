"""Captures inside training loops: eval forwards (validation) mixed with training forwards,
dropout, optimizer steps. Reference: forward hooks of plain PyTorch that clone each output."""

from __future__ import annotations

import importlib.util
import warnings

import pytest
import torch

from activationscope import ActivationScope, CaptureError, CaptureWarning, open_store

from acs_testing import plain_hooks

HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None


class _Mlp(torch.nn.Module):
    """A GPT-2 style MLP: its last step is a dropout, so in eval mode its output is its
    projection's output, the same tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(6, 12)
        self.proj = torch.nn.Linear(12, 6)
        self.drop = torch.nn.Dropout(0.5)

    def forward(self, x):
        return self.drop(self.proj(torch.relu(self.fc(x))))


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(_Mlp(), torch.nn.Dropout(0.3), torch.nn.Linear(6, 2))


@pytest.mark.parametrize("first", ["eval", "train"])
def test_validation_forward_then_training_stores_every_rows_own_values(tmp_path, first):
    # In eval mode a dropout returns its input: '0.output' is the very tensor of '0.proj.output'
    # (and '1.output' of '0.output'). Stored as aliases at a first forward in eval mode, the
    # training forwards after it (new tensors) raised CaptureError; each is now its own array,
    # and every row is the value the model passed on at that step.
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    names = ["0.proj", "0", "1", "2"]
    torch.manual_seed(1)
    xs = [torch.randn(4, 6) for _ in range(4)]
    modes = ["eval", "train", "train", "eval"] if first == "eval" else ["train", "eval", "train", "eval"]

    def capture():
        with ActivationScope(store=tmp_path / "s.zarr").track(model, include=["0", "0.proj", "1", "2"]):
            for x, mode in zip(xs, modes):
                if mode == "eval":
                    model.eval()
                    with torch.no_grad():
                        model(x)
                else:
                    model.train()
                    model(x).sum().backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)

    refs, _ = plain_hooks(model, capture, names, grad=True)
    store = open_store(tmp_path / "s.zarr")
    assert store.status == "complete"
    assert store.aliases == {}
    for n in names:
        torch.testing.assert_close(store[f"{n}.output"][:], torch.cat(refs[f"{n}.output"]), rtol=0, atol=0)
    # the training forwards' dropout rows are not their inputs' rows
    step = modes.index("train")
    train_rows = slice(4 * step, 4 * step + 4)
    assert not torch.equal(store["0.output"][train_rows], store["0.proj.output"][train_rows])


def test_a_dropout_of_probability_zero_or_in_training_mode_keeps_the_alias(tmp_path):
    # Dropout(p=0) returns its input in both modes, and a capture in training mode never
    # sees a dropout return its input: these stay aliases (stored once)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.0)),
                                torch.nn.Linear(4, 2)).eval()
    with torch.no_grad(), ActivationScope(store=tmp_path / "a.zarr").track(model, include=["0", "0.0"]):
        model(torch.randn(3, 4))
    assert open_store(tmp_path / "a.zarr").aliases == {"0.output": "0.0.output"}
    model = torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5)),
                                torch.nn.Linear(4, 2)).train()
    x = torch.randn(3, 4)
    torch.manual_seed(2)
    out = model[0](x)
    with ActivationScope(store=tmp_path / "b.zarr").track(model, include=["0", "0.1"]):
        torch.manual_seed(2)
        model(x)
    store = open_store(tmp_path / "b.zarr")
    assert store.aliases == {"0.output": "0.1.output"}
    torch.testing.assert_close(store["0.output"][:], out.detach(), rtol=0, atol=0)


@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="needs transformers")
def test_gpt2_validation_then_training_steps_are_stored(tmp_path):
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=50, n_positions=16, n_embd=16, n_layer=1, n_head=2)
    model = transformers.GPT2LMHeadModel(config)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    names = ["transformer.h.0.mlp", "transformer.h.0.mlp.c_proj"]
    ids = torch.randint(1, 50, (3, 5))

    def capture():
        with ActivationScope(store=tmp_path / "g.zarr", rows="token").track(model, include=names):
            model.eval()
            with torch.no_grad():
                model(input_ids=ids)
            model.train()
            for _ in range(2):
                model(input_ids=ids, labels=ids).loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)

    refs, _ = plain_hooks(model, capture, names, grad=True)
    store = open_store(tmp_path / "g.zarr")
    for n in names:
        torch.testing.assert_close(store[f"{n}.output"][:], torch.cat(refs[f"{n}.output"]).reshape(-1, 16),
                                   rtol=0, atol=0)


class _NormWithItsOwnDrop(torch.nn.Module):
    """Calls its dropout itself, as Hugging Face BART and Whisper do: no dropout module."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(6)
        self.dropout = 0.4

    def forward(self, x):
        return torch.nn.functional.dropout(self.norm(x), p=self.dropout, training=self.training)


def test_functional_dropout_validation_then_training_is_stored(tmp_path):
    # in eval mode '1.input.0' is the very tensor of '0.norm.output'; in training mode the
    # functional dropout between them gives a new one (it raised CaptureError at that forward)
    torch.manual_seed(0)
    model = torch.nn.Sequential(_NormWithItsOwnDrop(), torch.nn.Linear(6, 2))
    torch.manual_seed(1)
    xs = [torch.randn(3, 6) for _ in range(3)]

    def capture():
        with ActivationScope(store=tmp_path / "f.zarr", capture="both").track(model, include=["0.norm", "1"]):
            for i, x in enumerate(xs):
                model.train(i > 0)
                model(x).sum().backward()

    refs, _ = plain_hooks(model, capture, ["0.norm", "0"], grad=True)
    store = open_store(tmp_path / "f.zarr")
    assert store.aliases == {}
    torch.testing.assert_close(store["0.norm.output"][:], torch.cat(refs["0.norm.output"]), rtol=0, atol=0)
    torch.testing.assert_close(store["1.input.0"][:], torch.cat(refs["0.output"]), rtol=0, atol=0)


def test_a_second_epoch_is_warned_about_as_such(tmp_path):
    # a training loop's second epoch gives the samples' ids again: the warning said only to
    # "pass the sample's position in the dataset", which such a loop already does
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    x = torch.randn(4, 4)
    with pytest.warns(CaptureWarning, match=r"sample id 0 was recorded more than once.*once per epoch.*epoch=\[e\]"):
        with ActivationScope(store=tmp_path / "e.zarr").track(model, include=["1"]) as tracker:
            for epoch in range(2):
                tracker.set_batch(sample_ids=range(4), epoch=[epoch] * 4)
                model(x).sum().backward()
    store = open_store(tmp_path / "e.zarr")
    assert store.row_table("sample").column("epoch").to_pylist() == [0] * 4 + [1] * 4
    assert store.row_table("sample").column("sample_id").to_pylist() == [0, 1, 2, 3] * 2


class _Noise(torch.nn.Module):
    """Adds noise in training mode only, and returns its input as it is in eval mode: not
    named like a dropout and holding no dropout probability."""

    def forward(self, x):
        return x + 0.1 * torch.randn_like(x) if self.training else x


def test_a_noise_layer_that_breaks_an_eval_mode_alias_is_refused_naming_the_mode_switch(tmp_path):
    # the error spoke only of "a branch, or a loop": it now names the eval / train switch
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), _Noise(), torch.nn.Linear(4, 2))
    x = torch.randn(3, 4)
    with pytest.raises(CaptureError, match=r"'1.output' is stored once, as an alias of '0.output'.*"
                                           r"model.eval\(\) and model.train\(\).*exclude="):
        with ActivationScope(store=tmp_path / "n.zarr").track(model, include=["0", "1"]):
            model.eval()
            with torch.no_grad():
                model(x)
            model.train()
            model(x)
    store = open_store(tmp_path / "n.zarr")
    assert store.status == "incomplete" and store.n_rows("0.output") == 3
    with torch.no_grad():
        torch.testing.assert_close(store["1.output"][:], model[0](x), rtol=0, atol=0)


class _DropPath(torch.nn.Module):
    """Stochastic depth as timm writes it: drops whole samples in training mode."""

    def __init__(self, drop_prob: float) -> None:
        super().__init__()
        self.drop_prob = drop_prob

    def forward(self, x):
        if not self.training or self.drop_prob == 0:
            return x
        keep = (torch.rand(x.shape[0], 1) >= self.drop_prob).to(x.dtype)
        return x * keep / (1 - self.drop_prob)


@pytest.mark.parametrize("late", ["drop_path", "functional"])
def test_stop_after_last_in_training_mode_names_a_skipped_drop_path_or_functional_dropout(late):
    # a drop path, or a module calling F.dropout itself, after the stop point takes no random
    # numbers when skipped, so later forwards' records differ from a full run's: only
    # torch.nn dropouts were named (nothing was said of these)
    torch.manual_seed(0)
    tail = _DropPath(0.5) if late == "drop_path" else _NormWithItsOwnDrop()
    model = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Dropout(0.5), torch.nn.Linear(6, 6), tail).train()
    xs = torch.randn(12, 6).split(4)
    records = {}
    for stop in (False, True):
        torch.manual_seed(7)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with torch.no_grad(), ActivationScope().track(model, include=["1"], stop_after_last=stop) as tracker:
                for x in xs:
                    model(x)
        said = [str(w.message) for w in caught if issubclass(w.category, CaptureWarning)]
        records[stop] = torch.cat(tracker.activations["1.output"])
        if stop:
            assert len(said) == 1 and "in training mode skips '3'" in said[0] and "dropout takes no random" in said[0]
        else:
            assert not said, said
    assert not torch.equal(records[True], records[False])  # what the warning is about


def test_an_eval_mode_capture_keeps_the_aliases_that_no_dropout_makes(tmp_path):
    # Only an identity that goes through a dropout (its own output, or a module ending in one)
    # may not last into training; a module returning its child's output (no dropout between)
    # stays an alias in an eval-mode capture of a model that has dropouts elsewhere
    torch.manual_seed(0)
    inner = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))   # returns its LayerNorm's output
    model = torch.nn.Sequential(inner, torch.nn.Dropout(0.2), torch.nn.Linear(4, 2)).eval()
    x = torch.randn(5, 4)
    with torch.no_grad(), ActivationScope(store=tmp_path / "e.zarr").track(model):
        model(x)
        model(x + 1)
    store = open_store(tmp_path / "e.zarr")
    assert store.aliases == {"0.output": "0.1.output"}   # not '1.output' (the dropout's)
    with torch.no_grad():
        expected = torch.cat([inner(x), inner(x + 1)])
    torch.testing.assert_close(store["0.output"][:], expected, rtol=0, atol=0)
    torch.testing.assert_close(store["1.output"][:], expected, rtol=0, atol=0)


def test_a_forward_outside_autocast_after_one_under_it_is_refused_naming_autocast(tmp_path):
    # the dtype change (bf16 under autocast, float32 outside it) was refused naming only
    # storage_dtype=; the cause is the autocast, which the message now names
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    with ActivationScope(store=tmp_path / "a.zarr").track(model, include=["0"]):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(torch.randn(2, 4))
        with pytest.raises(CaptureError, match=r"changed its dtype from torch.bfloat16 to torch.float32 .*"
                           r"A forward under torch.autocast and one outside it .* run every forward under the "
                           r"same autocast, or pass storage_dtype="):
            model(torch.randn(2, 4))
    assert open_store(tmp_path / "a.zarr").n_rows("0.output") == 2
