"""set_batch describes the next forward's batch: a description of another number of samples,
or a mask that is not 0/1, is refused naming the argument, expected and actual (issue 12)."""

from __future__ import annotations

import re
import warnings

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

import activationscope as acs
from activationscope.data import export_parquet
from activationscope.errors import ActivationScopeError, ArgumentTypeError, ArgumentValueError


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU()).eval()


@pytest.mark.parametrize("kwargs, what", [
    ({"sample_ids": [10, 11, 12]}, "sample_ids"),
    ({"label": [1, 0, 1, 0, 1]}, "column 'label'"),
    ({"attention_mask": torch.ones(3, 7, dtype=torch.bool)}, "attention_mask"),
])
@pytest.mark.parametrize("to_store", [False, True])
def test_batch_described_with_another_size_is_refused(tmp_path, kwargs, what, to_store):
    model = _model()
    x = torch.randn(4, 7, 6) if "attention_mask" in kwargs else torch.randn(4, 6)
    scope = acs.ActivationScope(store=str(tmp_path / "s.zarr")) if to_store else acs.ActivationScope()
    with pytest.raises(ValueError, match=rf"set_batch\({what}=\.\.\.\) describes \d samples, but the forward's batch has 4") as e:
        with scope.track(model) as tr, torch.no_grad():
            tr.set_batch(**kwargs)
            model(x)
    assert isinstance(e.value, ActivationScopeError)
    if to_store:  # nothing committed for that forward: the new store is removed
        assert not (tmp_path / "s.zarr").exists()


@pytest.mark.parametrize("kwargs, what", [
    ({"sample_ids": [10]}, "sample_ids"),
    ({"label": [7]}, "column 'label'"),
    ({"attention_mask": torch.ones(2, 7, dtype=torch.bool)}, "attention_mask"),
])
def test_empty_batch_described_with_samples_is_refused(tmp_path, kwargs, what):
    # a forward whose batch is empty (first input of 0 rows) described as holding samples:
    # before, the row table got those samples while the hook points got no rows
    model = _model()
    x = torch.randn(0, 7, 6) if "attention_mask" in kwargs else torch.randn(0, 6)
    path = tmp_path / "s.zarr"
    with pytest.raises(ArgumentValueError, match=rf"set_batch\({what}=\.\.\.\) describes [12] samples, but the "
                       r"forward's batch has 0"):
        with acs.ActivationScope(store=str(path)).track(model) as tr, torch.no_grad():
            tr.set_batch(label=[1, 0], sample_ids=[1, 2])
            model(torch.randn(2, 6))
            tr.set_batch(**kwargs)
            model(x)
    s = acs.open_store(path)
    assert s.n_samples == 2 and all(s.follows_row_table(hp) for hp in s.hook_points)


def test_empty_batch_described_as_empty_is_accepted(tmp_path):
    model = _model()
    path = tmp_path / "s.zarr"
    with acs.ActivationScope(store=str(path)).track(model) as tr, torch.no_grad():
        tr.set_batch(label=[1, 0])
        model(torch.randn(2, 6))
        tr.set_batch(label=[])
        model(torch.randn(0, 6))
        tr.set_batch(label=[3])
        model(torch.randn(1, 6))
    s = acs.open_store(path)
    assert s.n_samples == 3 and s.row_table().column("label").to_pylist() == [1, 0, 3]
    assert all(s.follows_row_table(hp) and s.n_rows(hp) == 3 for hp in s.hook_points)


@pytest.mark.parametrize("to_store", [False, True])
def test_a_refused_batch_caught_inside_the_block_records_nothing_of_its_forward(tmp_path, to_store):
    # the refusal comes before any module of the forward runs: a caller that catches it and
    # goes on keeps every hook point aligned with the row table
    model = _model()
    xs = [torch.randn(4, 6) for _ in range(3)]
    scope = acs.ActivationScope(store=str(tmp_path / "s.zarr"), reductions=["mean"]) if to_store else \
        acs.ActivationScope(reductions=["mean"])
    with scope.track(model) as tr, torch.no_grad():
        for i, x in enumerate(xs):
            tr.set_batch(label=[i] * (3 if i == 1 else 4))
            try:
                model(x)
            except ArgumentValueError:
                assert i == 1
    with torch.no_grad():
        want = torch.cat([model(xs[0]), model(xs[2])])
    if to_store:
        s = acs.open_store(tmp_path / "s.zarr")
        assert s.row_table().column("label").to_pylist() == [0] * 4 + [2] * 4
        assert s.follows_row_table("1.output")
        torch.testing.assert_close(s["1.output"][:], want, rtol=0, atol=0)
        torch.testing.assert_close(s.reductions["1.output"]["mean"], want.double().mean(0))
    else:
        torch.testing.assert_close(torch.cat(tr.activations["1.output"]), want, rtol=0, atol=0)
        torch.testing.assert_close(tr.reductions["1.output"]["mean"], want.double().mean(0))


def test_matching_description_is_accepted(tmp_path):
    model = _model()
    scope = acs.ActivationScope(store=str(tmp_path / "s.zarr"))
    with scope.track(model) as tr, torch.no_grad():
        tr.set_batch(sample_ids=[10, 11, 12, 13], label=[1, 0, 1, 0])
        model(torch.randn(4, 6))
    s = acs.open_store(tmp_path / "s.zarr")
    assert s.row_table().column("sample_id").to_pylist() == [10, 11, 12, 13]
    assert s.n_rows("0") == 4 if "0" in s else s.n_rows(s.hook_points[0]) == 4


@pytest.mark.parametrize("mask, error, match", [
    (torch.ones(2, 3), TypeError, r"attention_mask must be bool or 0/1 integers, got dtype torch.float32"),
    (torch.tensor([[0, 2, 1], [1, 1, 0]]), ValueError, r"attention_mask must hold only 0 and 1, got values in \[0, 2\]"),
    (torch.tensor([[0, -1, 1], [1, 1, 0]]), ValueError, r"attention_mask must hold only 0 and 1"),
    (torch.ones(2, 3, 4, dtype=torch.bool), ValueError, r"attention_mask must be 2-D \(batch, pos\), got shape \(2, 3, 4\)"),
])
def test_bad_masks_are_refused(mask, error, match):
    tr = acs.ActivationScope().track(_model())
    with pytest.raises(error, match=match) as e:
        tr.set_batch(attention_mask=mask)
    assert isinstance(e.value, ActivationScopeError)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_float_mask_is_refused_with_the_conversion_that_keeps_its_tokens(tmp_path, dtype):
    # an additive mask (0 at tokens, -inf or a large negative value at padding) was told
    # "pass mask.bool()", which keeps the padding and leaves out every token
    keep = torch.tensor([[True, True, False], [True, False, False]])
    x = torch.randn(2, 3, 6)
    model = _model()
    for mask, advice in [(keep.to(dtype), "; pass mask.bool()"),
                         (torch.zeros(2, 3, dtype=dtype).masked_fill(~keep, float("-inf")), "pass (mask == 0)"),
                         (torch.zeros(2, 3, dtype=dtype).masked_fill(~keep, torch.finfo(dtype).min), "pass (mask == 0)")]:
        with acs.ActivationScope().track(model) as tr:
            with pytest.raises(ArgumentTypeError, match=re.escape(advice)):
                tr.set_batch(attention_mask=mask)
        # the conversion the message names stores the real tokens' rows
        fixed = mask.bool() if advice.endswith("mask.bool()") else (mask == 0)
        path = tmp_path / f"{len(list(tmp_path.iterdir()))}.zarr"
        with acs.ActivationScope(store=str(path)).track(model) as tr, torch.no_grad():
            tr.set_batch(attention_mask=fixed)
            model(x)
        with torch.no_grad():
            assert torch.equal(acs.open_store(path)["1.output"], model(x)[keep])


@pytest.mark.parametrize("mask, error, match", [
    ([[1, 1, 0]], TypeError, r"attention_mask must be a torch\.Tensor or numpy array \(batch, pos\), got list"),
    (torch.ones(3, dtype=torch.bool), ValueError, r"attention_mask must be 2-D \(batch, pos\), got shape \(3,\)"),
])
def test_a_mask_of_another_kind_or_shape_names_what_it_got(mask, error, match):
    # (the message said "must be a (batch, pos) tensor, got (3, 5)" for a (3, 5) numpy mask)
    tr = acs.ActivationScope().track(_model())
    with pytest.raises(error, match=match) as e:
        tr.set_batch(attention_mask=mask)
    assert isinstance(e.value, ActivationScopeError)


@pytest.mark.parametrize("dtype", ["bool", "int64", "int32"])
def test_a_numpy_mask_is_taken_as_the_tensor(tmp_path, dtype):
    # tokenizers give numpy masks with return_tensors="np"
    import numpy as np

    torch.manual_seed(0)
    enc = torch.nn.Sequential(torch.nn.Embedding(20, 4), torch.nn.Linear(4, 4))
    tokens = torch.randint(1, 20, (3, 5))
    mask = np.array([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]).astype(dtype)
    with torch.no_grad(), acs.ActivationScope(store=str(tmp_path / "s.zarr")).track(enc, include=["1"]) as tr:
        tr.set_batch(attention_mask=mask)
        enc(tokens)
    with torch.no_grad():
        expected = enc(tokens)[torch.from_numpy(mask.astype(bool))]
    store = acs.open_store(tmp_path / "s.zarr")
    assert store.row_kind("1.output") == "token"
    assert torch.equal(store["1.output"], expected)
    assert store.row_table("token")["pos"].to_pylist() == [2, 3, 4, 0, 1, 2, 3, 4, 0]


def test_integer_01_mask_is_accepted():
    tr = acs.ActivationScope().track(_model())
    tr.set_batch(attention_mask=torch.tensor([[1, 1, 0], [1, 0, 0]]))


@pytest.mark.parametrize("first, then, types", [
    (lambda n: torch.randint(0, 2, (n,)), lambda n: torch.rand(n), ("float", "int64")),
    (lambda n: torch.zeros(n, dtype=torch.int32), lambda n: torch.zeros(n, dtype=torch.int64), ("int64", "int32")),
    (lambda n: [True] * n, lambda n: [1] * n, ("int64", "bool")),
    (lambda n: ["a"] * n, lambda n: [1.5] * n, ("double", "string")),
])
def test_a_column_changing_type_is_refused_at_set_batch_and_earlier_batches_stay(tmp_path, first, then, types):
    """A row-table column has one type: the batch that changes it is refused when described,
    before its forward, naming the column and both types; the batches before it are kept."""
    model, path = _model(), tmp_path / "s.zarr"
    xs = [torch.randn(4, 6) for _ in range(3)]
    with pytest.raises(ArgumentTypeError, match=rf"column 'label' holds {types[0]} values in this batch, "
                                                    rf"but {types[1]} in the earlier batches"):
        with acs.ActivationScope(store=str(path)).track(model) as tr, torch.no_grad():
            for x in xs:
                tr.set_batch(label=first(4))
                model(x)
            tr.set_batch(label=then(4))
    st = acs.open_store(path)
    assert st.status == "incomplete" and st.n_samples == 12
    with torch.no_grad():
        assert torch.equal(st["0.output"], torch.cat([model[0](x) for x in xs]))
    assert len(st.row_table("sample").column("label")) == 12


def test_the_same_type_from_other_containers_is_accepted(tmp_path):
    model, path = _model(), tmp_path / "s.zarr"
    with acs.ActivationScope(store=str(path)).track(model) as tr, torch.no_grad():
        for label in (torch.tensor([0, 1]), [1, 0], torch.tensor([1, 1]).numpy()):
            tr.set_batch(label=label)
            model(torch.randn(2, 6))
    assert acs.open_store(path).row_table("sample").column("label").to_pylist() == [0, 1, 1, 0, 1, 1]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2])
def test_columns_of_floats_numpy_lacks_hold_their_values_exactly(tmp_path, dtype):
    # a float8 column raised numpy's "Got unsupported ScalarType Float8_e4m3fn" from set_batch
    model, path = _model(), tmp_path / "s.zarr"
    score = torch.tensor([1.5, -0.375, 3.0, 0.0]).to(dtype)
    with acs.ActivationScope(store=str(path)).track(model) as tr, torch.no_grad():
        tr.set_batch(score=score)
        model(torch.randn(4, 6))
    col = acs.open_store(path).row_table("sample").column("score")
    assert str(col.type) == "float" and col.to_pylist() == score.float().tolist()
    got = acs.ActivationDataset(path, columns=["score"])[0:4]["score"]
    assert got.dtype == torch.float32 and torch.equal(got, score.float())


_COLUMN_VALUES = {torch.uint8: [0, 255, 7, 1], torch.uint16: [0, 65535, 7, 1], torch.uint32: [0, 2**32 - 1, 7, 1],
                  torch.uint64: [0, 2**64 - 1, 7, 1], torch.int8: [-128, 127, 7, 1], torch.int16: [-32768, 32767, 7, 1],
                  torch.float16: [-0.5, 65504.0, 7.0, 1.0], torch.bool: [True, False, True, True]}


@pytest.mark.parametrize("dtype", list(_COLUMN_VALUES), ids=str)
def test_columns_keep_their_dtype_from_set_batch_to_the_dataset_and_export(tmp_path, dtype):
    # uint16 and uint32 columns came back from ActivationDataset as int64 tensors (values right)
    model, path = _model(), tmp_path / "s.zarr"
    values = _COLUMN_VALUES[dtype]
    score = torch.tensor(values, dtype=dtype) if dtype != torch.uint64 else torch.tensor(
        np.array(values, dtype=np.uint64).view(np.int64)).view(torch.uint64)
    mask = torch.tensor([[1, 1], [1, 0], [1, 1], [0, 0]], dtype=torch.bool)
    tok = torch.stack([score, score], 1)  # (batch, pos): a token column
    with acs.ActivationScope(store=str(path)).track(model) as tr, torch.no_grad():
        tr.set_batch(score=score)
        model(torch.randn(4, 6))
    with acs.ActivationScope(store=str(tmp_path / "t.zarr")).track(model) as tr, torch.no_grad():
        tr.set_batch(attention_mask=mask, score=score, tok=tok)
        model(torch.randn(4, 2, 6))
    arrow = str(score.numpy().dtype) if dtype not in (torch.float16, torch.uint64) else \
        {torch.float16: "halffloat", torch.uint64: "uint64"}[dtype]
    assert str(acs.open_store(path).row_table("sample").schema.field("score").type) == arrow
    ds = acs.ActivationDataset(path, columns=["score"])
    for got in (ds[0:4]["score"], ds[[0, 1, 2, 3]]["score"], torch.stack([ds[i]["score"] for i in range(4)])):
        assert got.dtype == dtype and got.tolist() == values
    loader = torch.utils.data.DataLoader(ds, batch_size=4)
    assert next(iter(loader))["score"].dtype == dtype
    toks = acs.ActivationDataset(tmp_path / "t.zarr", hook_points="0.output", columns=["score", "tok"])
    got = toks[[0, 1, 2, 3, 4]]  # real tokens (0,0) (0,1) (1,0) (2,0) (2,1)
    assert got["score"].dtype == dtype and got["score"].tolist() == [values[i] for i in (0, 0, 1, 2, 2)]
    assert got["tok"].dtype == dtype and got["tok"].tolist() == [values[i] for i in (0, 0, 1, 2, 2)]
    export_parquet(path, tmp_path / "e.parquet", hook_points=["1.output"], columns=["score"])
    assert str(pq.read_schema(tmp_path / "e.parquet").field("score").type) == arrow


def test_a_resumed_capture_keeps_the_stored_column_types(tmp_path):
    model, path = _model(), tmp_path / "s.zarr"
    with acs.ActivationScope(store=str(path)).track(model) as tr, torch.no_grad():
        tr.set_batch(label=[0, 1])
        model(torch.randn(2, 6))
    scope = acs.ActivationScope(store=str(path), store_options={"resume": True})
    with pytest.raises(ArgumentTypeError, match=r"column 'label' holds double values .* but int64"):
        with scope.track(model) as tr, torch.no_grad():
            tr.set_batch(label=[0.5, 1.5])
    st = acs.open_store(path)
    assert st.n_samples == 2 and st.row_table("sample").column("label").to_pylist() == [0, 1]


@pytest.mark.parametrize("value", [None, 3, "abc"])
def test_a_column_that_is_not_a_sequence_is_refused_naming_it(value):
    with acs.ActivationScope().track(_model()) as tr:
        with pytest.raises(ArgumentTypeError, match=r"column 'label' must be a sequence or tensor"):
            tr.set_batch(label=value)


@pytest.mark.parametrize("name", ["sample_id", "batch", "pos"])
def test_reserved_column_names_are_refused_at_set_batch(tmp_path, name):
    """``pos`` too for a per-sample column: token datasets join the sample columns, where it
    would hide the token position."""
    with pytest.raises(ArgumentValueError, match=rf"column '{name}' clashes with a reserved row-table column"):
        with acs.ActivationScope(store=str(tmp_path / "s.zarr")).track(_model()) as tr:
            tr.set_batch(**{name: [0, 1]})


def test_columns_of_a_store_whose_batches_all_had_no_samples_are_kept(tmp_path):
    """Every forward so far had an empty batch: the columns it described are in the row table
    (0 rows, their types), a dataset asking for them is empty instead of an error, and rows a
    resume adds later come with their values."""
    model = _model()
    path = tmp_path / "s.zarr"
    with acs.ActivationScope(store=str(path)).track(model) as tr, torch.no_grad():
        for _ in range(2):
            tr.set_batch(label=torch.zeros(0, dtype=torch.long), text=[])
            model(torch.randn(0, 6))
    s = acs.open_store(path)
    table = s.row_table()
    assert s.n_samples == 0 and table.num_rows == 0
    assert table.column_names == ["sample_id", "batch", "label", "text"]
    assert str(table.schema.field("label").type) == "int64"
    assert len(acs.ActivationDataset(path, columns=["label", "text"])) == 0
    with acs.ActivationScope(store=str(path), store_options={"resume": True}).track(model) as tr, torch.no_grad():
        tr.set_batch(label=torch.tensor([4, 5]), text=["a", "b"])
        model(torch.randn(2, 6))
    s = acs.open_store(path)
    assert s.row_table().column("label").to_pylist() == [4, 5]
    assert s.row_table().column("text").to_pylist() == ["a", "b"]
    ds = acs.ActivationDataset(path, columns=["label"])
    assert len(ds) == 2 and ds.get_batch([0, 1])["label"].tolist() == [4, 5] and s.verify() == []


class _SeqFirst(torch.nn.Module):
    """An LSTM over (pos, batch, 4) inputs (nn.LSTM's default layout) and a head on its last step."""

    def __init__(self):
        super().__init__()
        self.lstm = torch.nn.LSTM(4, 8)
        self.head = torch.nn.Linear(8, 2)

    def forward(self, x):
        h, _ = self.lstm(x)
        return self.head(h[-1])


def test_a_sequence_first_model_takes_one_entry_per_sample(tmp_path):
    torch.manual_seed(0)
    model = _SeqFirst().eval()
    xs = [torch.randn(10, 3, 4), torch.randn(7, 3, 4)]
    with acs.ActivationScope(store=str(tmp_path / "s.zarr")).track(model, include=["head"]) as tracker, \
            torch.no_grad():
        for i, x in enumerate(xs):
            tracker.set_batch(label=[i, 1, 0])
            model(x)
    store = acs.open_store(str(tmp_path / "s.zarr"))
    with torch.no_grad():
        want = torch.cat([model(x) for x in xs])
    torch.testing.assert_close(store["head.output"], want, rtol=0, atol=0)
    assert store.n_samples == 6 and store.verify() == []
    assert store.row_table()["label"].to_pylist() == [0, 1, 0, 1, 1, 0]
    # neither dimension: still refused, naming both
    with acs.ActivationScope().track(model, include=["head"]) as tracker:
        tracker.set_batch(label=[0, 1])
        with pytest.raises(ArgumentValueError, match=r"describes 2 samples.* has 10 .*sequence-first input, is 3"):
            model(xs[0])


class _MaskedBlock(torch.nn.Module):
    """A block called with hidden states (batch, pos, d) and an additive attention bias
    (batch, 1, pos, pos), as Hugging Face encoder layers are."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, h, bias):
        return self.proj(h) + bias.mean((1, 3)).unsqueeze(-1)


class _MaskedEncoder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.block = _MaskedBlock()

    def forward(self, h, mask):
        bias = (1.0 - mask[:, None, None, :].float()) * -1e4
        return self.block(h, bias.expand(-1, 1, h.shape[1], -1))


def test_a_hook_point_that_does_not_start_with_the_mask_names_the_mask_and_the_fix(tmp_path):
    """With an attention mask set, a hook point whose activation does not start with the mask's
    (batch, pos) (an attention bias (batch, 1, pos, pos)) is stored one row per sample; when
    pos changes, the error says so and names the fixes that apply, not a mask already given."""
    torch.manual_seed(0)
    model = _MaskedEncoder().eval()
    batches = [(torch.randn(2, 5, 4), torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])),
               (torch.randn(2, 3, 4), torch.tensor([[1, 1, 1], [1, 0, 0]]))]
    scope = acs.ActivationScope(store=str(tmp_path / "s.zarr"), capture="both")
    with pytest.raises(acs.CaptureError) as e:
        with scope.track(model, include=["block"]) as tracker, torch.no_grad():
            for h, mask in batches:
                tracker.set_batch(attention_mask=mask)
                model(h, mask)
    msg = str(e.value)
    assert "hook point 'block.input.1' changed its feature shape from (1, 5, 5) to (1, 3, 3)" in msg
    assert "(batch, pos) = (2, 3)" in msg and "of shape (2, 1, 3, 3), does not start with it" in msg
    assert "exclude= its module" in msg and 'capture="output"' in msg
    assert "pass attention_mask=" not in msg  # the mask was given
    store = acs.open_store(str(tmp_path / "s.zarr"))  # the first forward is kept, whole
    assert store.status == "incomplete" and store.n_samples == 2
    with torch.no_grad():
        want = model.block(batches[0][0], (1.0 - batches[0][1][:, None, None, :].float()).expand(-1, 1, 5, -1) * -1e4)
    assert torch.equal(store["block.output"], want[batches[0][1].bool()])


@pytest.mark.parametrize("rows", ["mask", "token"])
def test_a_generation_steps_bias_that_starts_with_the_steps_mask_names_the_mask_and_the_fix(tmp_path, rows):
    """A step after the prompt (a (batch, 1) forward, the key-value cache holding the rest)
    gives the attention bias (batch, 1, 1, pos + 1), which starts with the step's (batch, 1)
    mask: the error told to pass attention_mask= (given, or taken by rows="token") rather than
    that the hook point is stored one row per sample and is to be left out."""
    torch.manual_seed(0)
    model = _MaskedEncoder().eval()
    prompt, prompt_mask = torch.randn(2, 5, 4), torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    step, step_mask = torch.randn(2, 1, 4), torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    scope = acs.ActivationScope(store=str(tmp_path / "s.zarr"), capture="both",
                                **({"rows": "token"} if rows == "token" else {}))
    with pytest.raises(acs.CaptureError) as e:
        with scope.track(model, include=["block"]) as tracker, torch.no_grad():
            if rows == "mask":
                tracker.set_batch(attention_mask=prompt_mask)
            model(prompt, prompt_mask)
            if rows == "mask":
                tracker.set_batch(attention_mask=step_mask[:, -1:], same_samples=True)
            model(step, step_mask)
    msg = str(e.value)
    assert "hook point 'block.input.1' changed its feature shape from (1, 5, 5) to (1, 1, 6)" in msg
    assert "(batch, pos) = (2, 1)" in msg and "of shape (2, 1, 1, 6), is stored one row per sample" in msg
    assert "exclude= its module" in msg and 'capture="output"' in msg
    assert "pass attention_mask=" not in msg
    store = acs.open_store(str(tmp_path / "s.zarr"))  # the prompt's forward is kept, whole
    assert store.status == "incomplete" and store.n_samples == 2
    with torch.no_grad():
        want = model.block(prompt, (1.0 - prompt_mask[:, None, None, :].float()).expand(-1, 1, 5, -1) * -1e4)
    assert torch.equal(store["block.output"], want[prompt_mask.bool()] if rows == "mask" else want.reshape(10, 4))


@pytest.mark.parametrize("to_store", [lambda t: t, lambda t: t.numpy()], ids=["tensor", "numpy"])
def test_a_numpy_per_token_column_is_a_token_column_as_a_tensor_is(tmp_path, to_store):
    # a (batch, pos) numpy column was stored as one list per sample in the sample table,
    # while the same tensor gives one value per real token in the token table
    torch.manual_seed(0)
    enc = torch.nn.Sequential(torch.nn.Embedding(20, 4), torch.nn.Linear(4, 4))
    tokens = torch.randint(1, 20, (3, 5))
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    path = tmp_path / "s.zarr"
    with torch.no_grad(), acs.ActivationScope(store=str(path)).track(enc, include=["1"]) as tr:
        tr.set_batch(attention_mask=mask, token_ids=to_store(tokens), emb=to_store(torch.arange(6).reshape(3, 2)))
        enc(tokens)
    store = acs.open_store(path)
    assert "token_ids" not in store.row_table("sample").column_names
    assert store.row_table("token")["token_ids"].to_pylist() == tokens[mask.bool()].tolist()
    assert store.row_table("sample")["emb"].to_pylist() == [[0, 1], [2, 3], [4, 5]]  # (batch, 2): per sample


@pytest.mark.parametrize("ids, position", [(["x", None], 1), ([None, 1], 0), ([None, None], 0),
                                            (np.array(["a", None], dtype=object), 1)])
def test_a_sample_id_of_none_is_refused_at_set_batch(tmp_path, ids, position):
    """None ids were stored as nulls, and two of one forward were pooled as one sample by
    sentence_rows / the probes, without the warning a repeated id gets."""
    path = tmp_path / "s.zarr"
    m = torch.nn.Sequential(torch.nn.Linear(2, 2))
    with acs.ActivationScope(store=str(path)).track(m) as tr, torch.no_grad():
        tr.set_batch(sample_ids=["p", "q"])
        m(torch.randn(2, 2))
        with pytest.raises(ArgumentTypeError, match=rf"sample_ids must not hold None, got None at position {position}"):
            tr.set_batch(sample_ids=ids)
        tr.set_batch(sample_ids=["r", "s"])
        m(torch.randn(2, 2))
    assert acs.open_store(path).row_table("sample")["sample_id"].to_pylist() == ["p", "q", "r", "s"]


@pytest.mark.parametrize("ids", [[5, 6], np.array([5, 6], dtype=np.uint32), torch.tensor([5, 6], dtype=torch.int32),
                                 ["a", "b"], np.array(["a", "b"])])
def test_int_and_str_sample_ids_are_taken_and_selected(tmp_path, ids):
    from activationscope.data import ActivationDataset

    path = tmp_path / "s.zarr"
    m = torch.nn.Sequential(torch.nn.Linear(2, 2))
    with acs.ActivationScope(store=str(path)).track(m) as tr, torch.no_grad():
        tr.set_batch(sample_ids=ids)
        m(torch.randn(2, 2))
    first = list(ids)[0]
    first = first.item() if hasattr(first, "item") else first
    assert len(ActivationDataset(str(path), sample_ids=[first])) == 1


def test_a_tracked_sequence_first_module_is_named_in_a_store_capture(tmp_path):
    """A store capture of an nn.LSTM built sequence-first stored one row per position (its
    first dimension) with the batch among the features, and the row table listed those rows as
    samples, without a word; a warning now names the module, its hook points and the fix."""
    torch.manual_seed(0)
    model = _SeqFirst().eval()
    x = torch.randn(5, 3, 4)  # (pos, batch, features)
    with pytest.warns(acs.CaptureWarning, match=r"sequence-first \(batch_first=False\).*'lstm' \(LSTM\): "
                      r"lstm\.output\.0, lstm\.output\.1\.0, lstm\.output\.1\.1\. Rows are the first "
                      r"dimension.*batch_first=True"):
        with acs.ActivationScope(store=str(tmp_path / "s.zarr")).track(model) as tracker, torch.no_grad():
            tracker.set_batch(label=[0, 1, 0])
            model(x)
    store = acs.open_store(str(tmp_path / "s.zarr"))
    assert store["lstm.output.0"].shape == (5, 3, 8)  # (what the warning says: positions as rows)
    # built batch-first, or only its batch-first head tracked, or in memory: nothing to say
    first = torch.nn.TransformerEncoderLayer(4, 2, 8, dropout=0.0, batch_first=True).eval()
    for m, kw, store_opts in ((first, {}, {"store": str(tmp_path / "b.zarr")}),
                              (model, {"include": ["head"]}, {"store": str(tmp_path / "h.zarr")}),
                              (model, {}, {})):
        with warnings.catch_warnings():
            warnings.simplefilter("error", acs.CaptureWarning)
            with acs.ActivationScope(**store_opts).track(m, **kw) as tracker, torch.no_grad():
                tracker.set_batch(label=[0, 1, 0])
                m(x.transpose(0, 1).contiguous() if m is first else x)
    # in memory with reductions: reduced over positions, named the same way (only the reduced ones)
    with pytest.warns(acs.CaptureWarning, match=r"'lstm' \(LSTM\): lstm\.output\.0\. Rows are the first dimension"):
        with acs.ActivationScope(reductions={"lstm.output.0": ["mean"]}).track(model) as tracker, torch.no_grad():
            model(x)
    assert tracker.reductions["lstm.output.0"]["mean"].shape == (3, 8)  # (per batch member: positions reduced)


# ------------------------------------------------------------ a description kept for new data
def _stale_capture(tmp_path, where, describe, n_forwards=2):
    """Forwards of an embedding model (batch 2, pos 3) into a store or memory; ``describe(tr, k)``
    runs before forward k. Returns (the CaptureWarnings about a kept description, the store path)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(50, 4)).eval()
    path = tmp_path / "s.zarr"
    scope = {"store": acs.ActivationScope(store=str(path)),
             "reductions": acs.ActivationScope(reductions=["mean"]),
             "memory": acs.ActivationScope()}[where]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with scope.track(model) as tr, torch.no_grad():
            for k in range(n_forwards):
                describe(tr, k)
                model(torch.randint(1, 50, (2, 3)))
    return [str(w.message) for w in seen if "kept the set_batch description" in str(w.message)], path


PADDED = torch.tensor([[1, 1, 0], [1, 1, 1]])


@pytest.mark.parametrize("where", ["store", "reductions"])
def test_a_padding_mask_kept_for_a_new_batch_of_counted_samples_warns_once(tmp_path, where):
    # set_batch before the first batch only: the later batches are new samples (counted ids 2, 3,
    # 4, 5) that got the first batch's padding, with no word before
    msgs, path = _stale_capture(tmp_path, where, lambda tr, k: k == 0 and tr.set_batch(attention_mask=PADDED), 3)
    assert len(msgs) == 1
    assert "forward 1 of the tracked model" in msgs[0] and "attention_mask (with padding)" in msgs[0]
    assert "call set_batch(...) before each batch" in msgs[0] and "same_samples=True" in msgs[0]
    if where == "store":  # every row is still stored as described (a warning, not a refusal)
        table = acs.open_store(path).row_table("token")
        assert table.column("sample_id").to_pylist() == [0, 0, 1, 1, 1, 2, 2, 3, 3, 3, 4, 4, 5, 5, 5]


def test_sticky_columns_kept_for_a_new_batch_of_counted_samples_warn_naming_them(tmp_path):
    msgs, _ = _stale_capture(tmp_path, "store", lambda tr, k: k == 0 and tr.set_batch(label=[1, 0]))
    assert len(msgs) == 1 and "columns 'label'" in msgs[0] and "attention_mask" not in msgs[0]


@pytest.mark.parametrize("describe", [
    pytest.param(lambda tr, k: tr.set_batch(attention_mask=PADDED), id="set_batch-before-each-batch"),
    pytest.param(lambda tr, k: tr.set_batch(attention_mask=PADDED, same_samples=k > 0), id="same_samples-steps"),
    pytest.param(lambda tr, k: k == 0 and tr.set_batch(attention_mask=PADDED, sample_ids=[7, 8]),
                 id="given-sample-ids-kept"),
    pytest.param(lambda tr, k: k == 0 and tr.set_batch(attention_mask=torch.ones(2, 3, dtype=torch.bool)),
                 id="mask-without-padding"),
    pytest.param(lambda tr, k: None, id="no-description"),
])
def test_a_description_that_still_describes_the_forward_does_not_warn(tmp_path, describe):
    msgs, _ = _stale_capture(tmp_path, "store", describe, 3)
    assert msgs == []


def test_a_kept_mask_of_an_in_memory_capture_without_reductions_does_not_warn(tmp_path):
    # records are kept whole there: the mask describes no row
    msgs, _ = _stale_capture(tmp_path, "memory", lambda tr, k: k == 0 and tr.set_batch(attention_mask=PADDED))
    assert msgs == []


@pytest.mark.filterwarnings("ignore:.*was recorded more than once")  # (that writer is not told of steps)
def test_a_registered_writer_without_the_optional_add_batch_keywords_takes_generation_steps(tmp_path, monkeypatch):
    # a writer of the interface before described_again= / next_id=: a same_samples=True step is
    # given neither keyword (it was a TypeError at the step), and every row is stored
    from activationscope.capture import writer as capture_writer
    from activationscope.store import open_capture_writer

    class OlderWriter:
        def __init__(self, inner):
            self._inner = inner

        def __getattr__(self, name):
            return getattr(self._inner, name)

        def add_batch(self, n_samples, sample_ids=None, token_mask=None, columns=None):
            return self._inner.add_batch(n_samples=n_samples, sample_ids=sample_ids, token_mask=token_mask,
                                         columns=columns)

    monkeypatch.setattr(capture_writer, "_factory", lambda target, **kw: OlderWriter(open_capture_writer(target, **kw)))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(50, 4)).eval()
    with acs.ActivationScope(store=str(tmp_path / "s.zarr")).track(model) as tr, torch.no_grad():
        tr.set_batch(attention_mask=torch.ones(2, 3, dtype=torch.bool))
        model(torch.randint(1, 50, (2, 3)))
        tr.set_batch(attention_mask=torch.ones(2, 1, dtype=torch.bool), same_samples=True)
        model(torch.randint(1, 50, (2, 1)))
    table = acs.open_store(tmp_path / "s.zarr").row_table("token")
    assert table.column("sample_id").to_pylist() == [0, 0, 0, 1, 1, 1, 0, 1]


@pytest.mark.parametrize("token", [False, True])
def test_a_complex_column_is_refused_as_our_error_and_earlier_batches_stay(tmp_path, token):
    """Parquet has no complex type: pyarrow's own NotImplementedError ("Unsupported numpy type 14")
    left set_batch; it is our ArgumentTypeError naming the column and the fix."""
    model, path = _model(), tmp_path / "s.zarr"
    x = torch.randn(2, 3, 6) if token else torch.randn(2, 6)
    mask = torch.ones(2, 3, dtype=torch.bool) if token else None
    bad = torch.complex(torch.randn(*x.shape[:-1]), torch.randn(*x.shape[:-1]))
    with pytest.raises(ArgumentTypeError, match=r"column 'phase' cannot be stored in the row table \(complex values: "
                                                r"Parquet has no complex type\); store col\.real and col\.imag as two"):
        with acs.ActivationScope(store=str(path)).track(model) as tr, torch.no_grad():
            tr.set_batch(attention_mask=mask, phase=bad.real)
            model(x)
            tr.set_batch(attention_mask=mask, phase=bad)
    st = acs.open_store(path)
    assert st.status == "incomplete" and st.n_samples == 2
    table = st.row_table("token" if token else "sample")
    assert table.column("phase").to_pylist() == bad.real.reshape(-1).tolist()


@pytest.mark.parametrize("ids", [torch.arange(4).view(2, 2), [[0, 1], [2, 3]]])
def test_sample_ids_of_a_sequence_per_sample_are_refused_at_set_batch(tmp_path, ids):
    """A 2-D tensor of ids got past set_batch and the forward, then left the capture as a bare
    TypeError ("unhashable type: 'list'") when the forward was recorded."""
    model, path = _model(), tmp_path / "s.zarr"
    ran = []
    model[0].register_forward_hook(lambda *a: ran.append(1))
    with pytest.raises(ArgumentTypeError, match=r"sample_ids must hold one id per sample \(ints or strings\), got "
                                                r"list<item: int64> values"):
        with acs.ActivationScope(store=str(path)).track(model) as tr, torch.no_grad():
            tr.set_batch(sample_ids=[7, 8])
            model(torch.randn(2, 6))
            tr.set_batch(sample_ids=ids)
            model(torch.randn(2, 6))
    assert len(ran) == 1  # refused before the forward
    st = acs.open_store(path)
    assert st.row_table("sample").column("sample_id").to_pylist() == [7, 8]


def _decoder():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(20, 4), torch.nn.Linear(4, 4)).eval()


def test_a_sticky_per_token_column_at_a_one_token_step_is_refused_and_the_prompt_stays(tmp_path):
    # a generate() loop: the prompt's (batch, pos) token_ids stay described (set_batch is
    # sticky) at the (batch, 1) steps, where they were stored as one list per sample and the
    # steps' token rows got null token_ids, without a word
    dec, path = _decoder(), tmp_path / "s.zarr"
    prompt = torch.randint(1, 20, (3, 5))
    with pytest.raises(ArgumentValueError, match=r"column 'token_ids' is a per-token column .* shape \(3, 5\) while "
                                                  r"the forward has \(batch, pos\) = \(3, 1\).*same_samples=True"):
        with torch.no_grad(), acs.ActivationScope(store=str(path), rows="token").track(dec, include=["1"]) as tr:
            tr.set_batch(sample_ids=[7, 8, 9], token_ids=prompt)
            dec(prompt)
            dec(prompt[:, -1:])                                       # a step: the sticky description
    store = acs.open_store(path)
    assert store.status == "incomplete" and store.n_rows("1.output") == 15   # the prompt's rows, whole
    with torch.no_grad():
        assert torch.equal(store["1.output"], dec(prompt).reshape(15, 4))
    assert store.row_table("token")["token_ids"].to_pylist() == prompt.reshape(-1).tolist()
    assert "token_ids" not in store.row_table("sample").column_names


def test_the_steps_described_with_their_own_token_column_are_stored_per_token(tmp_path):
    dec, path = _decoder(), tmp_path / "s.zarr"
    prompt, step = torch.randint(1, 20, (3, 5)), torch.randint(1, 20, (3, 1))
    with torch.no_grad(), acs.ActivationScope(store=str(path), rows="token").track(dec, include=["1"]) as tr:
        tr.set_batch(sample_ids=[7, 8, 9], token_ids=prompt)
        dec(prompt)
        tr.set_batch(same_samples=True, token_ids=step)
        dec(step)
    table = acs.open_store(path).row_table("token")
    assert table["token_ids"].to_pylist() == prompt.reshape(-1).tolist() + step.reshape(-1).tolist()
    assert table["sample_id"].to_pylist()[15:] == [7, 8, 9]


def test_a_per_sample_tensor_column_as_wide_as_a_later_mask_is_refused_at_set_batch(tmp_path):
    # a (batch, k) per-sample column whose k equals the pos of a later batch was stored per
    # token in that batch (its sample rows left null, its values picked by the mask)
    dec, path = _decoder(), tmp_path / "s.zarr"
    with torch.no_grad(), acs.ActivationScope(store=str(path)).track(dec, include=["1"]) as tr:
        tr.set_batch(attention_mask=torch.ones(2, 5, dtype=torch.bool), emb=torch.zeros(2, 3))
        dec(torch.randint(1, 20, (2, 5)))
        with pytest.raises(ArgumentValueError, match=r"column 'emb' is a per-sample column .* shape \(2, 3\), the "
                                                      r"token mask's \(batch, pos\) = \(2, 3\).*emb=list\(values.cpu\(\).numpy\(\)\)"):
            tr.set_batch(attention_mask=torch.ones(2, 3, dtype=torch.bool), emb=torch.ones(2, 3))
        tr.set_batch(attention_mask=torch.ones(2, 3, dtype=torch.bool), emb=list(torch.ones(2, 3).numpy()))   # the fix: per sample
        dec(torch.randint(1, 20, (2, 3)))
    store = acs.open_store(path)
    assert store.row_table("sample")["emb"].to_pylist() == [[0.0] * 3] * 2 + [[1.0] * 3] * 2
    assert "emb" not in store.row_table("token").column_names


@pytest.mark.parametrize("describe", ["nothing", "sticky_ids", "same_samples"])
def test_a_one_token_step_after_a_prompt_numbered_as_new_samples_warns_once(tmp_path, describe):
    # generate() with a key-value cache under rows="token" and no set_batch: the (batch, 1)
    # steps' rows got new sample ids (3, 4, 5, then 6, 7, 8) from the running counter, without
    # a word, so a join on sample_id attributed them to samples that do not exist
    dec, path = _decoder(), tmp_path / "s.zarr"
    prompt, steps = torch.randint(1, 20, (3, 5)), [torch.randint(1, 20, (3, 1)) for _ in range(2)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad(), acs.ActivationScope(store=str(path), rows="token").track(dec, include=["1"]) as tr:
            if describe == "sticky_ids":
                tr.set_batch(sample_ids=[0, 1, 2])
            dec(prompt)
            for step in steps:
                if describe == "same_samples":
                    tr.set_batch(same_samples=True)
                dec(step)
    said = [str(w.message) for w in caught if issubclass(w.category, acs.CaptureWarning)]
    ids = acs.open_store(path).row_table("token")["sample_id"].to_pylist()
    assert ids[:15] == [i for i in range(3) for _ in range(5)]
    if describe == "nothing":
        assert ids[15:] == [3, 4, 5, 6, 7, 8]  # as documented: new samples, now with the warning
        assert len(said) == 1 and said[0].startswith(
            "forward 1 of the tracked model fed one token per sample, (batch, pos) = (3, 1), right after a forward of "
            "(3, 5), and no set_batch described its samples") and "set_batch(sample_ids=...)" in said[0]
    else:
        assert ids[15:] == [0, 1, 2, 0, 1, 2] and said == []


def test_sequences_of_one_token_fed_from_the_start_do_not_warn(tmp_path):
    dec, path = _decoder(), tmp_path / "s.zarr"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad(), acs.ActivationScope(store=str(path), rows="token").track(dec, include=["1"]):
            for _ in range(2):
                dec(torch.randint(1, 20, (3, 1)))
            dec(torch.randint(1, 20, (4, 5)))
            dec(torch.randint(1, 20, (2, 1)))                  # another batch size: new data
    assert [w for w in caught if issubclass(w.category, acs.CaptureWarning)] == []


def test_a_column_named_like_a_hook_point_is_refused_before_anything_is_stored(tmp_path):
    """A row-table column and a hook point of one name were both stored, then every dataset
    or export selecting both refused the store ('column names clash'); now the capture
    refuses it, in the forward that brings the second name, keeping the forwards before."""
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    path = tmp_path / "s.zarr"
    with pytest.raises(ArgumentValueError, match=r"column '0\.output' has the name of a hook point.*rename the column"):
        with torch.no_grad(), acs.ActivationScope(store=path).track(model) as tr:
            tr.set_batch(**{"0.output": [1, 2]})
            model(torch.randn(2, 2))
    assert not path.exists()  # (nothing committed: the folder the capture made is removed)

    class Late(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)

        def forward(self, x, late=False):
            return self.b(x) if late else self.a(x)

    torch.manual_seed(0)
    late, x = Late(), torch.randn(2, 2)
    path = tmp_path / "t.zarr"
    with pytest.raises(ArgumentValueError, match=r"hook point 'b\.output' has the name of a row-table column.*"
                                                    r"exclude_hook_points=\['b\.output'\]"):
        with torch.no_grad(), acs.ActivationScope(store=path).track(late) as tr:
            tr.set_batch(**{"b.output": [1, 2]})
            late(x)
            tr.set_batch(**{"b.output": [3, 4]})
            late(x, late=True)
    st = acs.open_store(path)  # the first forward stays, whole
    assert st.n_samples == 2 and st.hook_points == ["a.output"]
    with torch.no_grad():
        assert torch.equal(st.rows("a.output", 0, 2), late.a(x))
    assert st.row_table("sample").column("b.output").to_pylist() == [1, 2]


def test_set_batch_on_a_closed_store_tracker_is_refused_and_the_store_kept(tmp_path):
    # a loop left outside the with block ran its forwards unhooked, described and stored nowhere, without a word
    model = torch.nn.Sequential(torch.nn.Linear(2, 3))
    path = tmp_path / "s.zarr"
    with acs.ActivationScope(store=str(path)).track(model) as tracker, torch.no_grad():
        tracker.set_batch(label=[0, 1])
        model(torch.ones(2, 2))
    for kwargs in ({"label": [2, 3]}, {"sample_ids": [5, 6]}, {}):
        with pytest.raises(acs.CaptureError, match=re.escape(
                f"set_batch on a closed tracker: its store {str(path)!r} is closed (its `with` block ended, or "
                "remove() was called), so the forwards it would describe are not captured; call set_batch and the "
                "model inside the `with scope.track(model)` block, or make a new tracker with "
                "store_options={'resume': True} to add rows")):
            tracker.set_batch(**kwargs)
    store = acs.open_store(path)
    assert store.status == "complete" and store.n_rows("0.output") == 2
    assert store.row_table("sample")["label"].to_pylist() == [0, 1]


def test_set_batch_before_a_store_tracker_is_entered_describes_its_first_forward(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(2, 3))
    tracker = acs.ActivationScope(store=str(tmp_path / "s.zarr")).track(model)
    tracker.set_batch(label=[4, 5])
    with tracker, torch.no_grad():
        model(torch.ones(2, 2))
    assert acs.open_store(tmp_path / "s.zarr").row_table("sample")["label"].to_pylist() == [4, 5]


def test_set_batch_after_remove_names_the_method_that_closed_the_tracker(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(2, 3))
    tracker = acs.ActivationScope(store=str(tmp_path / "s.zarr")).track(model).attach()
    with torch.no_grad():
        model(torch.ones(2, 2))
    tracker.remove()
    with pytest.raises(acs.CaptureError) as info:
        tracker.set_batch(label=[2, 3])
    named = re.findall(r"(\w+)\(\) was called", str(info.value))
    assert named == ["remove"] and all(callable(getattr(tracker, n, None)) for n in named)
    assert acs.open_store(tmp_path / "s.zarr").n_rows("0.output") == 2


@pytest.mark.parametrize("order", ["after_the_forward", "from_the_second_batch"])
def test_a_mask_first_given_after_a_forward_without_one_names_that_forward(tmp_path, order):
    """set_batch describes the forwards after it: a mask given after the forward it belongs to
    (or only from the second batch) left the first forward without one, so its (batch, pos, d)
    hook point was made one row per sample. The error at the next length says so and how to
    call set_batch, not only to leave the hook point out, which is no fix."""
    model = _HFLikeEncoder()
    batches = [(torch.randint(1, 20, (2, 5)), torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])),
               (torch.randint(1, 20, (2, 3)), torch.tensor([[1, 1, 1], [1, 0, 0]])),
               (torch.randint(1, 20, (2, 4)), torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]]))]
    scope = acs.ActivationScope(store=str(tmp_path / "s.zarr"))
    with pytest.raises(acs.CaptureError) as e, warnings.catch_warnings():
        warnings.simplefilter("ignore", acs.CaptureWarning)
        with scope.track(model, include=["proj"]) as tracker, torch.no_grad():
            for i, (ids, mask) in enumerate(batches):
                if order == "from_the_second_batch" and i > 0:
                    tracker.set_batch(attention_mask=mask)
                model(ids, attention_mask=mask)
                if order == "after_the_forward":
                    tracker.set_batch(attention_mask=mask)
    assert "hook point 'proj.output' changed its feature shape from (5, 8)" in str(e.value)
    notes = " ".join(getattr(e.value, "__notes__", []))
    assert "'proj.output' was first captured in forward 0 of the tracked model, when tracker.set_batch had given " \
           "no attention_mask" in notes
    assert "call tracker.set_batch(attention_mask=mask) before each forward, the first included" in notes


def test_a_hook_point_first_captured_with_its_mask_gets_no_note_about_set_batch(tmp_path):
    """The note is for a hook point made sample rows by a forward without a mask only: the
    bias of test_a_hook_point_that_does_not_start_with_the_mask... gets none."""
    torch.manual_seed(0)
    model = _MaskedEncoder().eval()
    batches = [(torch.randn(2, 5, 4), torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])),
               (torch.randn(2, 3, 4), torch.tensor([[1, 1, 1], [1, 0, 0]]))]
    with pytest.raises(acs.CaptureError) as e:
        with acs.ActivationScope(store=str(tmp_path / "s.zarr"), capture="both").track(
                model, include=["block"]) as tracker, torch.no_grad():
            for h, mask in batches:
                tracker.set_batch(attention_mask=mask)
                model(h, mask)
    assert "set_batch had given no attention_mask" not in " ".join(getattr(e.value, "__notes__", []))


class _HFLikeEncoder(torch.nn.Module):
    """Token ids and an attention_mask in, (batch, pos, 8) out, as a Hugging Face encoder."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(20, 8)
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, input_ids, attention_mask=None):
        return self.proj(self.embed(input_ids))
