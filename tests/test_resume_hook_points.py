"""A resumed capture gives exactly the hook points its store holds, or is refused before any
row of it is committed, the store left as it was (issue 11: a narrower ``include=`` on resume
gave a "complete" store whose arrays had fewer rows than its sample table). A reduction added
on a resume with nothing left to capture is computed over the stored rows. Reference: plain
PyTorch over every sample, and the store's files byte for byte."""

from __future__ import annotations

import hashlib
import warnings
import pathlib

import pytest
import torch

from acs_testing import LateBranch  # a is called in every forward, b only when extra

from activationscope import ActivationScope, CaptureError, CaptureWarning, open_store


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


def _batches(n, rows=5):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(rows, 4, generator=g) for _ in range(n)]


def _files(path):
    """Every file of the store (the writer lock aside) -> sha256 of its bytes."""
    root = pathlib.Path(path)
    return {str(f.relative_to(root)): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(root.rglob("*")) if f.is_file() and f.name != ".lock"}


def _capture(model, path, xs, *, resume=False, reductions=("mean",), **track):
    scope = ActivationScope(store=path, reductions=list(reductions) if reductions else None,
                            store_options={"resume": True} if resume else {})
    with torch.no_grad(), scope.track(model, **track):
        for x in xs:
            model(x)


def _ref(model, xs, upto):
    with torch.no_grad():
        return torch.cat([model[:upto](x) for x in xs]).double()


@pytest.mark.parametrize("track", [
    {"include": ["0"]},                      # the input: a narrower include
    {"exclude": ["2"]},                      # the same through exclude
    {"capture": "input"},                    # the other side of the same modules
])
def test_a_resume_missing_stored_hook_points_is_refused_and_the_store_is_untouched(tmp_path, track):
    model, xs = _model(), _batches(4)
    path = tmp_path / "s.zarr"
    _capture(model, path, xs[:2])
    before = _files(path)
    with pytest.raises(CaptureError) as err:
        _capture(model, path, xs[2:], resume=True, **track)
    msg = str(err.value)
    assert "cannot resume" in msg and "same include=/exclude=/capture=" in msg and "left as it was" in msg
    assert "'2.output'" in msg  # a missing hook point is named
    assert _files(path) == before
    s = open_store(path)
    assert s.status == "complete" and s.n_samples == 10
    for hp, upto in (("0.output", 1), ("1.output", 2), ("2.output", 3)):
        torch.testing.assert_close(torch.as_tensor(s[hp][:]).double(), _ref(model, xs[:2], upto))


def _drop_patterns(path):
    """The root document as a store written before include=/exclude= were recorded."""
    import json

    root = pathlib.Path(path) / "zarr.json"
    doc = json.loads(root.read_text())
    del doc["attributes"]["activationscope"]["capture_config"]["patterns"]
    root.write_text(json.dumps(doc))


def test_a_resume_giving_extra_hook_points_is_refused_before_its_first_row(tmp_path):
    # a store without recorded patterns: the hook points of the first resumed forward are checked
    model, xs = _model(), _batches(4)
    path = tmp_path / "s.zarr"
    _capture(model, path, xs[:2], include=["0", "2"])
    _drop_patterns(path)
    before = _files(path)
    with pytest.raises(CaptureError, match=r"this capture gives \['1.output'\] which it does not hold"):
        _capture(model, path, xs[2:], resume=True)  # every module: 1.output is new
    assert _files(path) == before
    assert open_store(path).status == "complete"


@pytest.mark.parametrize("status", ["complete", "incomplete"])
def test_a_hook_point_missing_from_the_first_resumed_forward_is_refused_before_commit(tmp_path, status):
    model = LateBranch()
    xs = _batches(6, rows=700)  # a first resumed forward that fills chunks of both arrays
    path = tmp_path / "s.zarr"
    try:
        with torch.no_grad(), ActivationScope(store=path, store_options={"chunk_rows": 64}).track(model):
            for x in xs[:2]:
                model(x)
            if status == "incomplete":
                raise KeyboardInterrupt
    except KeyboardInterrupt:
        pass
    before = _files(path)
    with pytest.raises(CaptureError, match=r"it holds \['b.output'\] which this capture does not give"):
        with torch.no_grad(), ActivationScope(store=path, store_options={"resume": True}).track(model):
            model(xs[2], extra=False)
    s = open_store(path)
    assert s.status == status and s.n_samples == 1400
    assert {hp: s.n_rows(hp) for hp in s.hook_points} == {"a.output": 1400, "b.output": 1400}
    if status == "complete":
        assert _files(path) == before
    # the same resume with every hook point continues exactly
    with torch.no_grad(), ActivationScope(store=path, store_options={"resume": True}).track(model):
        for x in xs[2:]:
            model(x)
    s = open_store(path)
    with torch.no_grad():
        ref_a = torch.cat([model.a(x) for x in xs])
        ref_b = torch.cat([model.b(model.a(x)) for x in xs])
    assert s.status == "complete" and s.n_samples == 4200
    torch.testing.assert_close(torch.as_tensor(s["a.output"][:]), ref_a)
    torch.testing.assert_close(torch.as_tensor(s["b.output"][:]), ref_b)


def test_a_refusal_caught_inside_the_block_is_raised_again_at_its_end(tmp_path):
    model = LateBranch()
    xs = _batches(3)
    path = tmp_path / "s.zarr"
    with torch.no_grad(), ActivationScope(store=path).track(model):
        model(xs[0])
    before = _files(path)
    with pytest.raises(CaptureError, match="cannot resume"):
        with torch.no_grad(), ActivationScope(store=path, store_options={"resume": True}).track(model):
            with pytest.raises(CaptureError, match="cannot resume"):
                model(xs[1], extra=False)
            model(xs[2])  # a whole forward after the refusal is not committed either
    assert _files(path) == before


def test_several_resumes_in_a_row_stay_exact(tmp_path):
    model, xs = _model(), _batches(6)
    path = tmp_path / "s.zarr"
    _capture(model, path, xs[:1], reductions=("mean", "max"))
    for i in range(1, 6):
        _capture(model, path, xs[i:i + 1], resume=True, reductions=("mean", "max"))
    s = open_store(path)
    assert s.status == "complete" and s.n_samples == 30
    for hp, upto in (("0.output", 1), ("1.output", 2), ("2.output", 3)):
        ref = _ref(model, xs, upto)
        assert s.n_rows(hp) == 30
        torch.testing.assert_close(torch.as_tensor(s[hp][:]).double(), ref)
        torch.testing.assert_close(s.reductions[hp]["mean"], ref.mean(0))
        torch.testing.assert_close(s.reductions[hp]["max"].double(), ref.max(0).values)


def test_a_reduction_added_on_a_resume_with_nothing_left_to_capture_covers_the_stored_rows(tmp_path):
    model, xs = _model(), _batches(3)
    path = tmp_path / "s.zarr"
    _capture(model, path, xs, reductions=None)
    scope = ActivationScope(store=path, reductions=["mean", "var"], store_options={"resume": True})
    with torch.no_grad(), scope.track(model) as tracker:
        pass  # every sample is stored already: no forward
    s = open_store(path)
    assert s.status == "complete" and s.n_samples == 15
    for hp, upto in (("0.output", 1), ("1.output", 2), ("2.output", 3)):
        ref = _ref(model, xs, upto)
        torch.testing.assert_close(s.reductions[hp]["mean"], ref.mean(0))
        torch.testing.assert_close(s.reductions[hp]["var"], ref.var(0, correction=0))
        assert int(s.reductions[hp]["mean.count"]) == 15
        torch.testing.assert_close(tracker.reductions[hp]["mean"], ref.mean(0))
    assert s.partial_reductions == {}


def test_a_hook_point_first_seen_in_a_later_forward_is_not_said_to_follow_the_row_table(tmp_path):
    model = LateBranch()
    xs = _batches(2, rows=3)
    path = tmp_path / "s.zarr"
    with pytest.warns(CaptureWarning, match=r"hook point 'b.output' was first captured in forward 1.*follows_row_table"):
        with torch.no_grad(), ActivationScope(store=path).track(model):
            model(xs[0], extra=False)
            model(xs[1], extra=True)
    s = open_store(path)
    assert s.n_samples == 6 and s.n_rows("b.output") == 3
    assert s.follows_row_table("a.output") and not s.follows_row_table("b.output")
    with torch.no_grad():
        torch.testing.assert_close(torch.as_tensor(s["b.output"][:]), model.b(model.a(xs[1])))


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_a_refused_resume_that_rewrote_the_committed_last_shard_puts_it_back(tmp_path, compression):
    # 40 committed rows of 64-row shards: the refused forward's 40 rows complete shard 0,
    # which the writer renames over the committed file before the forward ends
    model = LateBranch()
    xs = _batches(3, rows=40)
    path = tmp_path / "s.zarr"
    opts = {"shard_rows": 64, "compression": compression}
    with torch.no_grad(), ActivationScope(store=path, store_options=opts).track(model):
        model(xs[0])
    before = _files(path)
    with pytest.raises(CaptureError, match="cannot resume"):
        with torch.no_grad(), ActivationScope(store=path, store_options={"resume": True}).track(model):
            model(xs[1], extra=False)
    assert _files(path) == before
    s = open_store(path)
    assert s.verify() == []
    with torch.no_grad():
        torch.testing.assert_close(torch.as_tensor(s["a.output"][:]), model.a(xs[0]))
    # and a resume with every hook point continues exactly from there
    with torch.no_grad(), ActivationScope(store=path, store_options={"resume": True}).track(model):
        model(xs[1])
        model(xs[2])
    s = open_store(path)
    assert s.verify() == [] and s.n_samples == 120
    with torch.no_grad():
        torch.testing.assert_close(torch.as_tensor(s["b.output"][:]), torch.cat([model.b(model.a(x)) for x in xs]))


@pytest.mark.parametrize("record", ["../../outside/victim", ["a"], 3])
def test_a_resume_refuses_a_root_whose_model_record_is_not_an_object(tmp_path, record):
    import json

    from activationscope import StoreCorruptError

    model, xs = LateBranch(), _batches(2)
    path = tmp_path / "s.zarr"
    _capture(model, path, xs[:1])
    root = path / "zarr.json"
    doc = json.loads(root.read_text())
    doc["attributes"]["activationscope"]["model"] = record
    root.write_text(json.dumps(doc))
    before = _files(path)
    with pytest.raises(StoreCorruptError, match=r"records the model as .* not an object; nothing was changed"):
        _capture(model, path, xs[1:], resume=True)
    assert _files(path) == before


def test_the_capture_config_records_the_include_and_exclude_patterns(tmp_path):
    model, xs = _model(), _batches(1)
    _capture(model, tmp_path / "a.zarr", xs, include=["0", "2"])
    _capture(model, tmp_path / "b.zarr", xs, exclude=["1"])
    scope = ActivationScope(store=tmp_path / "c.zarr", include=["*"])
    with torch.no_grad(), scope.track(model):
        model(xs[0])
    assert open_store(tmp_path / "a.zarr").attrs["capture_config"]["patterns"] == {"include": ["0", "2"],
                                                                                  "exclude": None}
    assert open_store(tmp_path / "b.zarr").attrs["capture_config"]["patterns"] == {"include": None,
                                                                                  "exclude": ["1"]}
    assert open_store(tmp_path / "c.zarr").attrs["capture_config"]["patterns"] == {"include": ["*"], "exclude": None}


@pytest.mark.parametrize("first, resumed", [
    ({"include": ["0"]}, {"include": ["0", "1"]}),  # a wider include
    ({"include": ["0"]}, {}),                        # every module
    ({"exclude": ["1", "2"]}, {"exclude": ["2"]}),   # a narrower exclude
])
@pytest.mark.parametrize("more", [True, False], ids=["more-rows", "nothing-left"])
def test_a_resume_with_other_patterns_is_refused_and_the_store_is_untouched(tmp_path, first, resumed, more):
    model, xs = _model(), _batches(3)
    path = tmp_path / "s.zarr"
    _capture(model, path, xs[:2], **first)
    before = _files(path)
    with pytest.raises(CaptureError) as err:
        _capture(model, path, xs[2:] if more else [], resume=True, **resumed)
    msg = str(err.value)
    stored = f"include={first.get('include')!r}, exclude={first.get('exclude')!r}"
    asked = f"include={resumed.get('include')!r}, exclude={resumed.get('exclude')!r}"
    assert f"it was captured with {stored}, this capture has {asked}" in msg
    assert "resume with the same include=/exclude= as the first run" in msg and "left as it was" in msg
    assert _files(path) == before
    s = open_store(path)
    assert s.status == "complete" and s.n_samples == 10 and s.hook_points == ["0.output"]
    torch.testing.assert_close(torch.as_tensor(s["0.output"][:]).double(), _ref(model, xs[:2], 1))


def test_a_resume_with_the_same_patterns_in_another_order_continues(tmp_path):
    model, xs = _model(), _batches(3)
    path = tmp_path / "s.zarr"
    _capture(model, path, xs[:2], include=["0", "2"])
    _capture(model, path, xs[2:], resume=True, include=["2", "0"])
    s = open_store(path)
    assert s.status == "complete" and s.n_samples == 15 and s.hook_points == ["0.output", "2.output"]
    torch.testing.assert_close(torch.as_tensor(s["2.output"][:]).double(), _ref(model, xs, 3))


def test_a_store_without_recorded_patterns_resumes_unchecked(tmp_path):
    model, xs = _model(), _batches(3)
    path = tmp_path / "s.zarr"
    _capture(model, path, xs[:2], include=["0"])
    _drop_patterns(path)
    # another but equivalent selection: the hook points of the forward match, so it continues
    _capture(model, path, xs[2:], resume=True, include=["0", "1"], exclude=["1"])
    s = open_store(path)
    assert s.status == "complete" and s.n_samples == 15 and s.hook_points == ["0.output"]
    torch.testing.assert_close(torch.as_tensor(s["0.output"][:]).double(), _ref(model, xs, 1))
    # the resume recorded its own patterns
    assert s.attrs["capture_config"]["patterns"] == {"include": ["0", "1"], "exclude": ["1"]}


def test_a_resume_continues_a_store_whose_hook_point_a_forward_may_not_call(tmp_path):
    """b.output is called only in some forwards (its rows already do not follow the row
    table): a resume whose first forward does not call it was refused ("it holds ['b.output']
    which this capture does not give"), so a model with a data-dependent branch could not be
    resumed unless its first resumed forward took the branch. It now continues, exactly."""
    import warnings

    model = LateBranch()
    xs = _batches(5, rows=3)
    extra = [False, True, False, False, True]
    path = tmp_path / "s.zarr"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CaptureWarning)
        with torch.no_grad(), ActivationScope(store=path).track(model):
            for x, e in zip(xs[:3], extra[:3]):
                model(x, extra=e)
    assert not open_store(path).follows_row_table("b.output")
    with warnings.catch_warnings():
        warnings.simplefilter("error", CaptureWarning)  # b.output is no news to this store
        with torch.no_grad(), ActivationScope(store=path, store_options={"resume": True}).track(model):
            for x, e in zip(xs[3:], extra[3:]):
                model(x, extra=e)
    s = open_store(path)
    with torch.no_grad():
        ref_a = torch.cat([model.a(x) for x in xs])
        ref_b = torch.cat([model.b(model.a(x)) for x, e in zip(xs, extra) if e])
    assert s.status == "complete" and s.n_samples == 15 and s.verify() == []
    torch.testing.assert_close(torch.as_tensor(s["a.output"][:]), ref_a, rtol=0, atol=0)
    torch.testing.assert_close(torch.as_tensor(s["b.output"][:]), ref_b, rtol=0, atol=0)
    assert s.follows_row_table("a.output") and not s.follows_row_table("b.output")


class _Output(torch.nn.Module):
    """Hugging Face BERT's ``BertOutput``: a module called ``output`` with a ``dense`` child."""

    def __init__(self):
        super().__init__()
        self.dense = torch.nn.Linear(8, 8)

    def forward(self, x):
        return torch.tanh(self.dense(x))


class _Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.intermediate = torch.nn.Linear(4, 8)
        self.output = _Output()

    def forward(self, x):
        return self.output(self.intermediate(x))


def test_modules_called_output_resume_and_are_not_called_silent(tmp_path):
    # hook points 'layer.output.output' and 'layer.output.dense.output' belong to the modules
    # 'layer.output' and 'layer.output.dense', not to 'layer'
    torch.manual_seed(0)
    model = torch.nn.Sequential()
    model.add_module("layer", _Layer())
    xs = _batches(4)
    path = tmp_path / "s.zarr"
    include = ["layer.output", "layer.output.dense"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", CaptureWarning)  # no module named as recording nothing
        _capture(model, path, xs[:2], include=include)
        _capture(model, path, xs[2:], resume=True, include=include)
    s = open_store(path)
    assert sorted(s.hook_points) == ["layer.output.dense.output", "layer.output.output"]
    with torch.no_grad():
        dense = torch.cat([model.layer.output.dense(model.layer.intermediate(x)) for x in xs])
    torch.testing.assert_close(s["layer.output.dense.output"][:], dense, rtol=0, atol=0)
    torch.testing.assert_close(s["layer.output.output"][:], torch.tanh(dense), rtol=0, atol=0)
    torch.testing.assert_close(s.reductions["layer.output.output"]["mean"], torch.tanh(dense).double().mean(0))
