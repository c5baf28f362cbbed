"""An attention mask that fits no tracked hook point is not ignored silently."""

from __future__ import annotations

import warnings

import pytest
import torch

import activationscope as acs
from acs_testing import PrependCLS


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(50, 8), PrependCLS(), torch.nn.Linear(8, 8))


def _mask(pos: int) -> torch.Tensor:
    mask = torch.ones(4, pos, dtype=torch.bool)
    mask[2:, 3:] = False
    return mask


def _scope(where, tmp_path, **kw):
    return acs.ActivationScope(store=tmp_path / "run.zarr", **kw) if where == "store" else acs.ActivationScope(**kw)


@pytest.mark.parametrize("where", ["memory", "store"])
def test_mask_matching_no_hook_point_warns_once(where, tmp_path):
    model = _model()
    ids = torch.randint(1, 50, (4, 6))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad(), _scope(where, tmp_path).track(model, include=["1", "2"]) as tracker:
            for _ in range(2):
                tracker.set_batch(attention_mask=_mask(6))
                model(ids)
    mine = [w for w in caught if issubclass(w.category, acs.CaptureWarning) and "attention_mask" in str(w.message)]
    assert len(mine) == 1
    assert (mine[0].message.reason, mine[0].message.mask_shape) == ("mask_unused", (4, 6))
    assert mine[0].message.first_shapes in str(mine[0].message) and "'1.output': (4, 7, 8)" in mine[0].message.first_shapes
    with pytest.warns(acs.CaptureWarning, match=r"attention_mask.* shape \(4, 6\).*matches no tracked hook point.*"
                                                r"'1\.output': \(4, 7, 8\).*token_rows"):
        with torch.no_grad(), acs.ActivationScope().track(model, include=["1", "2"]) as tracker:
            tracker.set_batch(attention_mask=_mask(6))
            model(ids)


class _Pool(torch.nn.Module):
    def forward(self, h, m):
        m = m.unsqueeze(-1).float()
        return (h * m).sum(1) / m.sum(1)


class _Pooled(torch.nn.Module):
    """Embeddings mean-pooled over the mask's positions: (batch, d) rows, no pos dimension."""

    def __init__(self):
        super().__init__()
        self.emb, self.pool = torch.nn.Embedding(50, 8), _Pool()

    def forward(self, ids, mask):
        return self.pool(self.emb(ids), mask)


@pytest.mark.parametrize("where", ["memory", "store"])
def test_mask_given_with_pooled_hook_points_only_does_not_speak_of_padding_inside_them(where, tmp_path):
    """A (batch, d) pooled hook point holds no position, so no padding: the warning says the
    mask is not needed, not that the rows keep their padding inside; the rows are the pooled ones."""
    model, ids, mask = _Pooled(), torch.randint(1, 50, (4, 6)), _mask(6)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad(), _scope(where, tmp_path).track(model, include=["pool"]) as tracker:
            tracker.set_batch(attention_mask=mask)
            expected = model(ids, mask)
    mine = [w for w in caught if issubclass(w.category, acs.CaptureWarning) and "attention_mask" in str(w.message)]
    assert len(mine) == 1 and mine[0].message.reason == "mask_unused"
    text = str(mine[0].message)
    assert "padding inside" not in text and "no pos dimension" in text and "token_rows=False" in text, text
    if where == "memory":
        rows = tracker.activations["pool.output"][0]
    else:
        rows = torch.as_tensor(acs.open_store(tmp_path / "run.zarr")["pool.output"][:])
    torch.testing.assert_close(rows, expected)


@pytest.mark.parametrize("where", ["memory", "store"])
@pytest.mark.parametrize("include, pos, kw", [
    (["1", "2"], 7, {}),                               # the activations' (batch, pos): token rows
    (["0", "1", "2"], 6, {}),                          # fits the embedding only: it applies there
    (["1", "2"], 6, {"token_rows": False}),            # sample rows asked for
])
def test_mask_that_applies_or_sample_rows_asked_for_do_not_warn(where, include, pos, kw, tmp_path):
    model = _model()
    ids = torch.randint(1, 50, (4, 6))
    with warnings.catch_warnings():
        warnings.simplefilter("error", acs.CaptureWarning)
        with torch.no_grad(), _scope(where, tmp_path, **kw).track(model, include=include) as tracker:
            tracker.set_batch(attention_mask=_mask(pos))
            model(ids)


@pytest.mark.parametrize("where", ["memory", "store"])
def test_rows_token_that_fits_no_hook_point_warns_once(where, tmp_path):
    # rows="token" without a mask: the model prepends a token, so no activation starts with the
    # (batch, pos) of its input and every hook point is stored one row per sample
    model = _model()
    ids = torch.randint(1, 50, (4, 6))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad(), _scope(where, tmp_path, rows="token").track(model, include=["1", "2"]) as tracker:
            for _ in range(2):
                model(ids)
    mine = [w for w in caught if issubclass(w.category, acs.CaptureWarning) and "rows='token'" in str(w.message)]
    assert len(mine) == 1
    assert mine[0].message.reason == "token_rows_unused"
    assert "(batch, pos) = (4, 6)" in str(mine[0].message) and "'1.output': (4, 7, 8)" in mine[0].message.first_shapes
    if where == "store":
        store = acs.open_store(tmp_path / "run.zarr")
        with torch.no_grad():
            ref = model[:2](ids)
        assert store.row_kind("1.output") == "sample" and torch.equal(store["1.output"], torch.cat([ref, ref]))
    else:
        assert len(tracker.activations["2.output"]) == 2


@pytest.mark.parametrize("include, kw", [
    (["0", "1", "2"], {}),                             # the embedding takes token rows: no warning
    (["1", "2"], {"token_rows": False}),               # sample rows asked for
])
def test_rows_token_that_applies_or_sample_rows_asked_for_do_not_warn(include, kw, tmp_path):
    model = _model()
    ids = torch.randint(1, 50, (4, 6))
    with warnings.catch_warnings():
        warnings.simplefilter("error", acs.CaptureWarning)
        with torch.no_grad(), acs.ActivationScope(store=tmp_path / "run.zarr", rows="token", **kw).track(
                model, include=include):
            model(ids)
    store = acs.open_store(tmp_path / "run.zarr")
    assert store.row_kind("1.output") == "sample"
    if "0" in include:
        with torch.no_grad():
            assert torch.equal(store["0.output"], model[0](ids).reshape(24, 8))


class _EmbedProj(torch.nn.Module):
    """An embedding of ``vocab`` ids and a linear layer, seeded."""

    def __init__(self, vocab: int):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(vocab, 8)
        self.proj = torch.nn.Linear(8, 8)


class _TextModel(_EmbedProj):
    """Tokenizes its str input inside its forward, as TransformerLens's model("text") does."""

    def __init__(self):
        super().__init__(128)

    def forward(self, texts):
        texts = [texts] if isinstance(texts, str) else texts
        width = max(len(t) for t in texts)
        ids = torch.tensor([[ord(c) % 128 for c in t] + [0] * (width - len(t)) for t in texts])
        return self.proj(self.embed(ids))


def test_rows_token_of_a_model_called_with_text_says_so(tmp_path):
    # no tensor input: the warning says that the model got text (not "fewer than 2 dims") and
    # how to give it token ids
    model = _TextModel()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad(), acs.ActivationScope(store=tmp_path / "run.zarr", rows="token").track(model,
                                                                                                   include=["proj"]):
            model(["hello world", "hi"])
    (mine,) = [w for w in caught if issubclass(w.category, acs.CaptureWarning) and "rows='token'" in str(w.message)]
    assert mine.message.reason == "token_rows_unused"
    message = str(mine.message)
    assert "the model was called with no tensor input (its first argument is a list, text the model" in message
    assert "fewer than 2 dims" not in message and "model.to_tokens" in message
    assert acs.open_store(tmp_path / "run.zarr").row_kind("proj.output") == "sample"


class _MaskedEncoder(_EmbedProj):
    """Takes (input_ids, attention_mask) as a Hugging Face encoder does."""

    def __init__(self):
        super().__init__(50)

    def forward(self, input_ids, attention_mask=None):
        h = self.embed(input_ids)
        return self.proj(h if attention_mask is None else h * attention_mask[..., None])


@pytest.mark.parametrize("how", ["keyword", "positional"])
def test_rows_token_warns_about_padding_given_to_the_model_only(how, tmp_path):
    model = _MaskedEncoder()
    ids = torch.randint(1, 50, (4, 6))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad(), acs.ActivationScope(store=tmp_path / "run.zarr", rows="token").track(model,
                                                                                                   include=["proj"]):
            for _ in range(2):
                model(ids, attention_mask=_mask(6)) if how == "keyword" else model(ids, _mask(6))
    mine = [str(w.message) for w in caught if issubclass(w.category, acs.CaptureWarning)]
    assert len(mine) == 1 and "given attention_mask= with padding (6 of 24 positions are 0)" in mine[0], mine
    assert acs.open_store(tmp_path / "run.zarr").n_rows("proj.output") == 48


@pytest.mark.parametrize("where", ["store", "reductions"])
@pytest.mark.parametrize("how", ["keyword", "positional"])
def test_default_rows_warn_about_padding_given_to_the_model_only(how, where, tmp_path):
    """rows="auto" (the default) with no set_batch mask: a model given a padded mask keeps its
    padding inside the one row per sample of each (batch, pos, d) hook point, and in its
    reductions; batches of one length (padding="max_length") never fail on the shape, so it warns."""
    model = _MaskedEncoder()
    ids = torch.randint(1, 50, (4, 6))
    scope = (acs.ActivationScope(store=tmp_path / "run.zarr") if where == "store"
             else acs.ActivationScope(reductions=["mean"]))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad(), scope.track(model, include=["proj"]):
            for _ in range(2):
                model(ids, attention_mask=_mask(6)) if how == "keyword" else model(ids, _mask(6))
    mine = [str(w.message) for w in caught if issubclass(w.category, acs.CaptureWarning)]
    assert len(mine) == 1, mine
    assert "forward 0 of the tracked model was given attention_mask= with padding (6 of 24 positions are 0)" in mine[0]
    assert "'proj.output'" in mine[0] and "one row per sample with the padded positions inside" in mine[0]
    assert "tracker.set_batch(attention_mask=mask)" in mine[0] and "token_rows=False" in mine[0]
    if where == "store":
        assert acs.open_store(tmp_path / "run.zarr")["proj.output"].shape == (8, 6, 8)


@pytest.mark.parametrize("case", ["set_batch", "no_padding", "token_rows_false", "in_memory"])
def test_default_rows_say_nothing_of_a_mask_described_unpadded_or_chosen(case, tmp_path):
    """No warning where the padding is left out (set_batch has the mask), there is none, sample
    rows were asked for (token_rows=False), or no row is taken (in memory, no reductions)."""
    model = _MaskedEncoder()
    ids = torch.randint(1, 50, (4, 6))
    mask = torch.ones(4, 6, dtype=torch.long) if case == "no_padding" else _mask(6)
    kw = {"token_rows": False} if case == "token_rows_false" else {}
    scope = acs.ActivationScope(**kw) if case == "in_memory" else acs.ActivationScope(store=tmp_path / "r.zarr", **kw)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad(), scope.track(model, include=["proj"]) as tracker:
            for _ in range(2):
                if case == "set_batch":
                    tracker.set_batch(attention_mask=mask)
                model(ids, attention_mask=mask)
    assert [str(w.message) for w in caught if issubclass(w.category, acs.CaptureWarning)] == []



_FLOAT_MASKS = {
    # (the mask given to the model, what its padding holds in the warning; None: no padding)
    "0/1 float": (lambda: _mask(6).float(), "0"),  # (a Hugging Face mask cast to float)
    "additive": (lambda: (~_mask(6)).float() * torch.finfo(torch.float32).min, "negative"),
    "additive -inf": (lambda: torch.where(_mask(6), 0.0, float("-inf")), "negative"),
    "additive unpadded": (lambda: torch.zeros(4, 6), None),
    "0/1 float unpadded": (lambda: torch.ones(4, 6), None),
}


@pytest.mark.parametrize("rows", ["auto", "token"])
@pytest.mark.parametrize("case", list(_FLOAT_MASKS))
def test_a_float_mask_given_to_the_model_warns_of_its_padding_only(case, rows, tmp_path):
    """A float attention_mask of 0s and 1s (a Hugging Face mask cast to float) has its 0s as
    padding, an additive one (0 at the tokens, -inf or the lowest float at the padding) its
    negative values: rows="auto" said nothing of either (float masks were passed over), and
    rows="token" counted the 0s of an additive mask, its real tokens, as padding (an unpadded
    one: "24 of 24 positions are 0")."""
    make, value = _FLOAT_MASKS[case]
    model = _MaskedEncoder()
    ids = torch.randint(1, 50, (4, 6))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad(), acs.ActivationScope(store=tmp_path / "run.zarr", rows=rows).track(model,
                                                                                                include=["proj"]):
            for _ in range(2):
                model(ids, attention_mask=make())
    mine = [str(w.message) for w in caught if issubclass(w.category, acs.CaptureWarning)]
    if value is None:
        assert mine == []
    else:
        assert len(mine) == 1, mine
        assert f"forward 0 of the tracked model was given attention_mask= with padding (6 of 24 positions are {value})" \
            in mine[0]


@pytest.mark.parametrize("batches", [(2, 4), (4, 2), (1, 4)])
def test_default_rows_warn_of_padding_in_a_forward_of_another_batch_size_than_the_first(batches, tmp_path):
    """The padded hook points were those whose first forward started with this forward's
    (batch, pos): padding only in a forward of another batch size (the last, smaller batch; a
    first forward of one sample) was stored without a word."""
    first, later = batches
    model = _MaskedEncoder()
    padded = torch.ones(later, 6, dtype=torch.bool)
    padded[later // 2:, 3:] = False
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad(), acs.ActivationScope(store=tmp_path / "run.zarr").track(model, include=["proj"]):
            model(torch.randint(1, 50, (first, 6)), attention_mask=torch.ones(first, 6, dtype=torch.long))
            model(torch.randint(1, 50, (later, 6)), attention_mask=padded)
    mine = [str(w.message) for w in caught if issubclass(w.category, acs.CaptureWarning)]
    n_pad = int((~padded).sum())
    assert len(mine) == 1, mine
    assert (f"forward 1 of the tracked model was given attention_mask= with padding ({n_pad} of {later * 6} positions "
            "are 0)") in mine[0]
    assert "'proj.output'" in mine[0] and f"(batch, pos) = ({later}, 6)" in mine[0]
    assert acs.open_store(tmp_path / "run.zarr")["proj.output"].shape == (first + later, 6, 8)


class _SharedPositions(torch.nn.Module):
    """Position embeddings (1, pos, d), one tensor broadcast over the batch's samples."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(16, 8)

    def forward(self, input_ids):
        return self.emb(torch.arange(input_ids.shape[1])[None])


class _PositionsEncoder(_MaskedEncoder):
    def __init__(self):
        super().__init__()
        self.pos = _SharedPositions()

    def forward(self, input_ids, attention_mask=None):
        h = self.embed(input_ids) + self.pos(input_ids)
        return self.proj(h * attention_mask[..., None])


@pytest.mark.parametrize("where", ["store", "reductions"])
def test_padding_warning_leaves_out_a_hook_point_shared_by_the_batch_first_seen_in_a_forward_of_one_sample(where,
                                                                                                         tmp_path):
    """A (1, pos, d) hook point shared by the batch (position embeddings) whose first forward
    had one sample looks like (batch, pos, d) there: the padding of a later forward of four
    samples was said to be inside its rows, one per sample, which it is not (one row for the
    four). It is left out of the warning, as where its first forward had more samples; the
    per-sample hook point is still named."""
    torch.manual_seed(0)
    model = _PositionsEncoder().eval()
    padded = torch.ones(4, 6, dtype=torch.bool)
    padded[2:, 3:] = False
    scope = (acs.ActivationScope(store=tmp_path / "run.zarr") if where == "store"
             else acs.ActivationScope(reductions=["mean"]))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad(), scope.track(model, include=["pos", "proj"]):
            model(torch.randint(1, 50, (1, 6)), attention_mask=torch.ones(1, 6, dtype=torch.long))
            model(torch.randint(1, 50, (4, 6)), attention_mask=padded)
    mine = [str(w.message) for w in caught if issubclass(w.category, acs.CaptureWarning) and "padding" in str(w.message)]
    assert len(mine) == 1, mine
    assert "forward 1 of the tracked model was given attention_mask= with padding (6 of 24 positions are 0)" in mine[0]
    assert "'proj.output', starting with" in mine[0] and "'pos.output'" not in mine[0], mine[0]


class _Device:
    """Stands for a CUDA device and its torch.cuda.Events: ``done`` forwards are finished, as
    the test sets it; an event of a later forward is not, until synchronize() waits for it."""

    def __init__(self):
        self.done, self.log, self.n = 0, [], 0

    def count_later(self, mask):
        device, k = self, self.n
        self.n += 1

        class Event:
            def query(self):
                device.log.append(f"query {k}")
                return k < device.done

            def synchronize(self):
                device.log.append(f"synchronize {k}")
                device.done = max(device.done, k + 1)

        return (mask == 0).sum(), Event()


@pytest.mark.parametrize("rows", ["auto", "token"])
@pytest.mark.parametrize("ready", ["next_forward", "at_close"])
def test_a_device_mask_is_counted_without_waiting_for_the_device(rows, ready, tmp_path, monkeypatch):
    """A CUDA mask's padding is counted on the device and copied to the host without a wait
    (no synchronization per forward): the warning comes at a later forward's end once the device
    is done, or at the close, which waits for it, and names the forward whose mask had padding."""
    from activationscope.capture import scope as scope_mod

    device = _Device()
    monkeypatch.setattr(scope_mod, "_counts_padding_later", lambda mask: True)
    monkeypatch.setattr(scope_mod, "_count_zeros_later", device.count_later)
    model = _MaskedEncoder()
    ids = torch.randint(1, 50, (4, 6))
    warned_after: list[int] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad(), acs.ActivationScope(store=tmp_path / "run.zarr", rows=rows).track(
                model, include=["proj"]):
            for i in range(3):
                if ready == "next_forward" and i == 2:
                    device.done = 2  # (the device got through forwards 0 and 1 while forward 2 ran)
                model(ids, attention_mask=_mask(6))
                warned_after.append(sum(issubclass(w.category, acs.CaptureWarning) for w in caught))
    mine = [str(w.message) for w in caught if issubclass(w.category, acs.CaptureWarning)]
    assert len(mine) == 1, mine
    assert "forward 0 of the tracked model was given attention_mask= with padding (6 of 24 positions are 0)" in mine[0]
    if ready == "next_forward":
        assert warned_after == [0, 0, 1] and not any(e.startswith("synchronize") for e in device.log), device.log
    else:  # (no forward's end waited: the close did, for forward 0's count)
        assert warned_after == [0, 0, 0] and device.log[-1] == "synchronize 0", device.log
        assert not any(e.startswith("synchronize") for e in device.log[:-1]), device.log


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_cuda_mask_with_padding_warns_by_the_close(tmp_path):
    """On a CUDA model the padding count goes through pinned memory and an event: the warning
    still comes (at the latest when the capture closes) with the right count."""
    model = _MaskedEncoder().cuda()
    ids = torch.randint(1, 50, (4, 6), device="cuda")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad(), acs.ActivationScope(store=tmp_path / "run.zarr").track(model, include=["proj"]):
            for _ in range(2):
                model(ids, attention_mask=_mask(6).cuda())
    mine = [str(w.message) for w in caught if issubclass(w.category, acs.CaptureWarning)]
    assert len(mine) == 1 and "given attention_mask= with padding (6 of 24 positions are 0)" in mine[0], mine


_PLAIN_PADDING = {
    # (the mask given to the model, its padded positions counted in plain PyTorch)
    "bool": (lambda m: m, lambda m: int((~m).sum())),
    "long": (lambda m: m.long(), lambda m: int((m == 0).sum())),
    "0/1 float": (lambda m: m.float(), lambda m: int((m == 0).sum())),
    "additive": (lambda m: torch.where(m, 0.0, float("-inf")), lambda m: int((m < 0).sum())),
}


@pytest.mark.parametrize("rows", ["auto", "token"])
@pytest.mark.parametrize("kind", list(_PLAIN_PADDING))
def test_a_cpu_mask_is_counted_once_per_forward_and_its_count_is_plain_pytorchs(kind, rows, tmp_path, monkeypatch):
    """A CPU mask's padding was counted twice in a forward of rows="auto" until the warning came
    (once to see whether it had any, once more for the warning); now once per forward, none
    after the warning, and the warning's count is the plain PyTorch count of padded positions."""
    from activationscope.capture import scope as scope_mod

    counted: list[int] = []
    count = scope_mod._padding_count

    def spy(mask):
        counted[-1] += 1
        return count(mask)

    monkeypatch.setattr(scope_mod, "_padding_count", spy)
    make, plain = _PLAIN_PADDING[kind]
    g = torch.Generator().manual_seed(3)
    padded = torch.rand(4, 6, generator=g) > 0.4
    padded[:, 0] = True  # (one real token per sample)
    masks = [make(torch.ones(4, 6, dtype=torch.bool)), make(padded), make(padded)]
    ids = torch.randint(1, 50, (4, 6), generator=g)
    model = _MaskedEncoder()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad(), acs.ActivationScope(store=tmp_path / "run.zarr", rows=rows).track(model,
                                                                                                include=["proj"]):
            for mask in masks:
                counted.append(0)
                model(ids, attention_mask=mask)
    assert counted == [1, 1, 0], counted
    mine = [str(w.message) for w in caught if issubclass(w.category, acs.CaptureWarning)]
    n_pad = plain(masks[1])
    assert n_pad > 0 and len(mine) == 1, mine
    assert f"forward 1 of the tracked model was given attention_mask= with padding ({n_pad} of 24 positions" in mine[0]
