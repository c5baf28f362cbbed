"""``capture_dataset``: ``activationscope capture`` as a library function (checks, specs,
resume offset, batches, store options). Reference values: the model run in plain PyTorch."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import activationscope as acs
from activationscope.analysis import capture_run
from activationscope.errors import ArgumentValueError, CaptureError
from acs_testing import PrependCLS as _PrependCLS


@pytest.fixture
def nets(user_package):
    """``runnets.nets:mlp`` (Linear 6->5, ReLU, Linear 5->3, seeded) and ``runnets.nets:fails3``
    (the same model, raising in its fourth forward); the data: 50 samples of 6 features."""
    return user_package("runnets", """
        import torch

        def mlp():
            torch.manual_seed(0)
            return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))

        class Fails(torch.nn.Sequential):
            ok = 3
            def forward(self, x):
                if self.ok == 0:
                    raise RuntimeError("bad batch")
                self.ok -= 1
                return super().forward(x)

        def fails3():
            torch.manual_seed(0)
            return Fails(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    """, data=(50, 6, 1))


def _reference(x_path) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3)).eval()
    x = torch.from_numpy(np.load(x_path))
    with torch.no_grad():
        h0 = model[0](x)
        h1 = torch.relu(h0)
        return {"0.output": h0, "1.output": h1, "2.output": model[2](h1)}


def test_capture_then_resume_continues_at_the_committed_samples(nets, tmp_path):
    out = str(tmp_path / "r.zarr")
    ref = _reference(nets)
    first = capture_run.capture_dataset("runnets.nets:mlp", str(nets), out, max_samples=20, batch_size=8,
                                        reductions=["mean"], progress=False)
    assert (first.first_sample, first.n_target, first.n_samples, first.n_forwards) == (0, 20, 20, 3)
    assert not first.nothing_to_capture
    assert capture_run.resume_offset(out) == 20

    second = capture_run.capture_dataset("runnets.nets:mlp", str(nets), out, batch_size=8, resume=True,
                                         reductions=["mean"], progress=False)
    # samples 20..49 in batches of 8: 8, 8, 8, 6
    assert (second.first_sample, second.n_target, second.n_samples, second.n_forwards) == (20, 50, 30, 4)
    store = acs.open_store(out)
    assert store.status == "complete" and store.n_samples == 50
    for hp, want in ref.items():
        torch.testing.assert_close(store[hp], want)
    assert store.row_table("sample").column("sample_id").to_pylist() == list(range(50))
    torch.testing.assert_close(store.reductions["2.output"]["mean"], ref["2.output"].double().mean(0))

    third = capture_run.capture_dataset("runnets.nets:mlp", str(nets), out, resume=True, progress=False)
    assert third.nothing_to_capture and (third.first_sample, third.n_target, third.n_forwards) == (50, 50, 0)
    assert acs.open_store(out).n_samples == 50


def test_resume_after_a_failed_capture_starts_at_its_last_commit(nets, tmp_path):
    out = str(tmp_path / "f.zarr")
    ref = _reference(nets)
    # batches of 4 samples, one shard holds 2 rows of 5 float32 (40 bytes) at most: each
    # forward commits; the fourth forward raises, so 12 samples stay committed
    with pytest.raises(CaptureError, match="bad batch"):
        capture_run.capture_dataset("runnets.nets:fails3", str(nets), out, batch_size=4, shard_bytes=40,
                                    chunk_rows=2, progress=False)
    committed = acs.open_store(out)
    assert committed.status == "incomplete"
    assert capture_run.resume_offset(out) == committed.n_samples == 12
    done = capture_run.capture_dataset("runnets.nets:mlp", str(nets), out, batch_size=16, resume=True,
                                       progress=False)
    assert (done.first_sample, done.n_samples) == (12, 38)
    store = acs.open_store(out)
    for hp, want in ref.items():
        torch.testing.assert_close(store[hp], want)
    assert store.row_table("sample").column("sample_id").to_pylist() == list(range(50))


def test_resume_offset_takes_a_path_or_the_store_opened(nets, tmp_path, monkeypatch):
    # (a resume opens its store once and passes it on: the offset is read from it, not opened again)
    from acs_testing import count_store_reads

    out = str(tmp_path / "r.zarr")
    capture_run.capture_dataset("runnets.nets:mlp", str(nets), out, max_samples=12, batch_size=8, progress=False)
    store = acs.open_store(out)
    counts = count_store_reads(monkeypatch)
    assert capture_run.resume_offset(store) == 12 and counts["opens"] == 0
    assert capture_run.resume_offset(out) == 12 and counts["opens"] == 1
    with pytest.raises(ArgumentValueError, match=r"--resume: store '.*none.zarr' does not exist; drop --resume"):
        capture_run.resume_offset(str(tmp_path / "none.zarr"))


def test_store_options_hold_only_what_was_given():
    assert capture_run.capture_store_options(model="m", data="d") == {
        "provenance": {"model": "m", "data": "d", "command": ""}}
    got = capture_run.capture_store_options(model="m", data="d", command="activationscope capture", resume=True,
                                            compression="zstd", shard_bytes=4096, chunk_rows=16)
    assert got == {"provenance": {"model": "m", "data": "d", "command": "activationscope capture"},
                   "resume": True, "compression": "zstd", "shard_bytes": 4096, "chunk_rows": 16}
    assert "compression" not in capture_run.capture_store_options(model="m", data="d", compression="none")
    assert capture_run.capture_store_options(model="m", data="d", overwrite=True)["overwrite"] is True


def test_options_and_dtype_reach_the_store(nets, tmp_path):
    out = str(tmp_path / "o.zarr")
    capture_run.capture_dataset("runnets.nets:mlp", str(nets), out, include=["0", "2"], dtype="bfloat16",
                                compression="zstd", max_samples=10, progress=False, command="acs capture x")
    store = acs.open_store(out)
    assert store.hook_points == ["0.output", "2.output"]
    assert store["2.output"].dtype == torch.bfloat16
    torch.testing.assert_close(store["2.output"], _reference(nets)["2.output"][:10].bfloat16())
    info = store.info()
    assert info["provenance"]["model"] == "runnets.nets:mlp" and info["provenance"]["command"] == "acs capture x"


@pytest.mark.parametrize(
    "kwargs, needles",
    [
        ({"batch_size": 0}, ["--batch-size must be a positive int, got 0"]),
        ({"max_samples": 0}, ["--max-samples must be a positive int, got 0"]),
        ({"max_length": 0}, ["--max-length must be a positive int, got 0"]),
        ({"max_length": -3}, ["--max-length must be a positive int, got -3"]),
        ({"reductions": ["mean", "median"]}, ["unknown reduction 'median'"]),
        ({"dtype": "int8"}, ["--dtype must be one of", "'int8'"]),
        ({"padding": "max"}, ["--padding must be one of ['longest', 'max_length'], got 'max'"]),
        ({"resume": True}, ["--resume", "does not exist"]),
        ({"resume": True, "overwrite": True}, ["exclude each other"]),
    ],
)
def test_bad_options_fail_before_anything_is_loaded(tmp_path, kwargs, needles):
    # the model spec cannot be imported: these errors come first
    with pytest.raises(ArgumentValueError) as info:
        capture_run.capture_dataset("no_such_pkg_xyz.nets:mlp", str(tmp_path / "x.npy"), str(tmp_path / "o.zarr"),
                                    progress=False, **kwargs)
    for needle in needles:
        assert needle in str(info.value)
    assert not (tmp_path / "o.zarr").exists()


def test_an_existing_store_needs_resume_or_overwrite(nets, tmp_path):
    out = str(tmp_path / "e.zarr")
    capture_run.capture_dataset("runnets.nets:mlp", str(nets), out, max_samples=5, progress=False)
    with pytest.raises(ArgumentValueError, match="pass --overwrite to replace it or --resume to continue it"):
        capture_run.capture_dataset("runnets.nets:mlp", str(nets), out, progress=False)
    capture_run.capture_dataset("runnets.nets:mlp", str(nets), out, max_samples=7, overwrite=True, progress=False)
    assert acs.open_store(out).n_samples == 7



def test_a_store_inside_another_store_is_refused(nets, tmp_path):
    import os

    outer = tmp_path / "outer.zarr"
    capture_run.capture_dataset("runnets.nets:mlp", str(nets), str(outer), max_samples=5, progress=False)
    before = sorted(p.relative_to(outer) for p in outer.rglob("*"))
    os.symlink(outer / "acts", tmp_path / "link")
    for out in (outer / "new.zarr", outer / "acts" / "new.zarr", outer / "acts" / "0.output" / "x" / "y.zarr",
                tmp_path / "link" / "new.zarr"):
        with pytest.raises(ArgumentValueError, match=f"is inside the store '{outer}'.*choose a path outside it"):
            capture_run.capture_dataset("runnets.nets:mlp", str(nets), str(out), max_samples=5, progress=False)
    assert sorted(p.relative_to(outer) for p in outer.rglob("*")) == before  # nothing written among its files
    capture_run.capture_dataset("runnets.nets:mlp", str(nets), str(tmp_path / "next.zarr"), max_samples=5,
                                progress=False)  # next to it is fine

def test_a_reduction_added_on_a_resume_of_a_full_store_is_computed_over_its_rows(nets, tmp_path):
    out = str(tmp_path / "full.zarr")
    ref = _reference(nets)
    capture_run.capture_dataset("runnets.nets:mlp", str(nets), out, batch_size=16, progress=False)
    assert acs.open_store(out).reductions == {}
    again = capture_run.capture_dataset("runnets.nets:mlp", str(nets), out, resume=True,
                                        reductions=["mean", "max"], progress=False)
    assert again.nothing_to_capture and again.n_forwards == 0
    assert sorted(again.reduced_hook_points) == sorted(ref)
    store = acs.open_store(out)
    assert store.status == "complete" and store.n_samples == 50 and store.partial_reductions == {}
    for hp, want in ref.items():
        torch.testing.assert_close(store.reductions[hp]["mean"], want.double().mean(0))
        torch.testing.assert_close(store.reductions[hp]["max"].double(), want.double().max(0).values)


def test_a_resume_with_a_narrower_include_is_refused_and_the_store_kept(nets, tmp_path):
    out = str(tmp_path / "n.zarr")
    capture_run.capture_dataset("runnets.nets:mlp", str(nets), out, max_samples=20, batch_size=8, progress=False)
    with pytest.raises(CaptureError, match=r"it holds \['1.output', '2.output'\].*n.zarr is left as it was"):
        capture_run.capture_dataset("runnets.nets:mlp", str(nets), out, include=["0"], resume=True, progress=False)
    store = acs.open_store(out)
    assert store.status == "complete" and store.n_samples == 20
    assert {hp: store.n_rows(hp) for hp in store.hook_points} == {"0.output": 20, "1.output": 20, "2.output": 20}


@pytest.mark.parametrize("first, again", [("hist[lo=-4,hi=4,bins=64]", "hist[lo=-1,hi=1,bins=4]"),
                                          ("hist[lo=-1,hi=1,bins=4]", "hist[lo=-2,hi=2,bins=4]"),
                                          ("topk[k=5]", "topk[k=3]")])
def test_a_reduction_with_other_options_on_a_resume_of_a_full_store_is_recomputed(nets, tmp_path, first, again):
    out = str(tmp_path / "full.zarr")
    ref = _reference(nets)["0.output"].double()
    capture_run.capture_dataset("runnets.nets:mlp", str(nets), out, include=["0"], reductions=[first],
                                progress=False)
    done = capture_run.capture_dataset("runnets.nets:mlp", str(nets), out, include=["0"], resume=True,
                                       reductions=[again], progress=False)
    assert done.nothing_to_capture and done.reduced_hook_points == ["0.output"]
    store = acs.open_store(out)
    assert store.status == "complete" and store.n_samples == 50 and store.partial_reductions == {}
    r = store.reductions["0.output"]
    if again.startswith("topk"):
        assert store.attrs["reductions"]["0.output"]["topk.values"]["options"]["k"] == 3
        want = ref.topk(3, dim=0)
        torch.testing.assert_close(r["topk.values"].double(), want.values)
        torch.testing.assert_close(r["topk.row_ids"].long(), want.indices)
    else:
        lo, hi = (-1, 1) if "lo=-1" in again else (-2, 2)
        torch.testing.assert_close(r["hist.edges"].double(), torch.linspace(lo, hi, 5, dtype=torch.float64))
        want = torch.stack([torch.histc(c[(c >= lo) & (c <= hi)], 4, lo, hi) for c in ref.T]).long()
        torch.testing.assert_close(r["hist.counts"].long(), want)


def _files(path):
    from pathlib import Path

    return {p.relative_to(path): p.read_bytes() for p in sorted(Path(path).rglob("*")) if p.is_file()}


@pytest.mark.parametrize("reductions", [None, ["mean"]])
@pytest.mark.parametrize("options, error, match", [
    ({"dtype": "bfloat16"}, CaptureError, r"stored with storage_dtype=None.*this capture has storage_dtype=torch.bfloat16"),
    ({"include": ["0"]}, CaptureError, r"it holds \['1.output', '2.output'\] which this capture does not give"),
    ({"capture": "input"}, CaptureError, r"captured with --capture output, this run asks for --capture input"),
    ({"capture": "both"}, CaptureError, r"captured with --capture output, this run asks for --capture both"),
])
def test_a_resume_of_a_full_store_is_checked_as_an_incomplete_one(nets, tmp_path, reductions, options, error, match):
    """Nothing left to capture is no reason to accept another dtype or other hook points:
    refused, and the store left byte for byte as it was."""
    out = str(tmp_path / "full.zarr")
    capture_run.capture_dataset("runnets.nets:mlp", str(nets), out, batch_size=16, progress=False)
    before = _files(out)
    with pytest.raises(error, match=match):
        capture_run.capture_dataset("runnets.nets:mlp", str(nets), out, resume=True, reductions=reductions,
                                    progress=False, **options)
    assert _files(out) == before


@pytest.mark.parametrize("reductions", [None, ["mean"]])
@pytest.mark.parametrize("first, again", [
    ({"include": ["0"]}, {}),                                   # a wider include: every module
    ({"include": ["0"]}, {"include": ["0", "2"]}),
    ({"exclude": ["1", "2"]}, {"exclude": ["2"]}),              # a narrower exclude
])
def test_a_resume_of_a_full_store_with_other_patterns_is_refused(nets, tmp_path, reductions, first, again):
    """No forward runs to show the other hook points a wider selection gives: the recorded
    patterns are compared, and the store left byte for byte as it was."""
    out = str(tmp_path / "full.zarr")
    ref = _reference(nets)
    capture_run.capture_dataset("runnets.nets:mlp", str(nets), out, batch_size=16, progress=False, **first)
    before = _files(out)
    with pytest.raises(CaptureError) as err:
        capture_run.capture_dataset("runnets.nets:mlp", str(nets), out, resume=True, reductions=reductions,
                                    progress=False, **again)
    assert (f"it was captured with include={first.get('include')!r}, exclude={first.get('exclude')!r}, this "
            f"capture has include={again.get('include')!r}, exclude={again.get('exclude')!r}") in str(err.value)
    assert _files(out) == before
    store = acs.open_store(out)
    assert store.hook_points == ["0.output"] and store.n_samples == 50
    torch.testing.assert_close(store["0.output"], ref["0.output"])


def test_a_resume_of_a_full_store_with_the_same_options_leaves_it_as_it_was(nets, tmp_path):
    out = str(tmp_path / "full.zarr")
    capture_run.capture_dataset("runnets.nets:mlp", str(nets), out, batch_size=16, progress=False)
    before = _files(out)
    again = capture_run.capture_dataset("runnets.nets:mlp", str(nets), out, resume=True, progress=False)
    assert again.nothing_to_capture and again.first_sample == 50 and again.n_target == 50
    assert _files(out) == before


def test_a_resume_with_data_of_fewer_samples_than_the_store_is_refused(nets, tmp_path):
    out = str(tmp_path / "full.zarr")
    capture_run.capture_dataset("runnets.nets:mlp", str(nets), out, batch_size=16, progress=False)
    short = tmp_path / "short.npy"
    np.save(short, np.load(nets)[:30])
    before = _files(out)
    for reductions in (None, ["mean"]):
        with pytest.raises(ArgumentValueError, match=r"holds 50 samples, but --data .*short.npy' has only 30"):
            capture_run.capture_dataset("runnets.nets:mlp", str(short), out, resume=True, reductions=reductions,
                                        progress=False)
    assert _files(out) == before
    # fewer samples asked for (--max-samples) of the same data: nothing to capture, no error
    assert capture_run.capture_dataset("runnets.nets:mlp", str(nets), out, resume=True, max_samples=20,
                                       progress=False).nothing_to_capture


def _mask_unused_run(tmp_path, model=None):
    """run_capture of a model that prepends a token, with the tokenizer's (batch, pos) mask:
    no hook point starts with the mask's shape (4, 6), so the tracker warns about it."""
    torch.manual_seed(0)
    model = model or torch.nn.Sequential(torch.nn.Embedding(50, 8), _PrependCLS(), torch.nn.Linear(8, 8))
    ids = torch.randint(1, 50, (4, 6), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(4, 6, dtype=torch.bool)
    mask[2:, 3:] = False
    batches = [(0, ids, {"attention_mask": mask, "sample_ids": list(range(4)), "label": [0, 1, 0, 1]})]
    return capture_run.run_capture(model, batches, out=str(tmp_path / "m.zarr"), n_total=4, include=["1", "2"],
                                   exclude=None, reductions=None, progress=False)


def test_a_library_warning_turned_into_an_error_is_raised_as_itself(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # what python -W error does
        with pytest.raises(acs.CaptureWarning) as raised:
            _mask_unused_run(tmp_path)
    e = raised.value
    assert not isinstance(e, CaptureError) and "the model raised" not in str(e)
    assert str(e).startswith("the attention mask of the tokenized text, of shape (4, 6) (batch, pos), fits no tracked")
    assert "'1.output': (4, 7, 8)" in str(e) and "--sample-rows" in str(e)
    assert any("m.zarr" in note for note in e.__notes__)  # what the store keeps, as for any failure


def test_a_model_error_under_the_error_filter_is_still_the_models(tmp_path):
    class Raises(torch.nn.Sequential):
        def forward(self, x):
            raise ValueError("no such token")

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(CaptureError, match=r"the model raised ValueError: no such token on samples 0\.\.3"):
            _mask_unused_run(tmp_path, Raises(torch.nn.Embedding(50, 8), _PrependCLS(), torch.nn.Linear(8, 8)))


def test_the_reworded_mask_warning_carries_the_trackers_fields(tmp_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        summary = _mask_unused_run(tmp_path)
    mask = [w.message for w in caught if getattr(w.message, "reason", None) == "mask_unused"]
    assert len(mask) == 1 and isinstance(mask[0], acs.CaptureWarning)
    assert str(mask[0]).startswith("the attention mask of the tokenized text, of shape (4, 6)")
    assert mask[0].mask_shape == (4, 6)
    assert mask[0].first_shapes == "{'1.output': (4, 7, 8), '2.output': (4, 7, 8)}"
    assert f"({mask[0].first_shapes})" in str(mask[0])
    assert summary.n_samples == 4 and acs.open_store(tmp_path / "m.zarr").row_kind("1.output") == "sample"


class _StopsEarlyAfterFirst(torch.nn.Module):
    """Runs a second layer in its first forward only: later forwards never reach the stop point
    that stop_after_last learnt, and the tracker warns (a RuntimeWarning, as CaptureWarning)."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.k = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), 0

    def forward(self, x):
        self.k += 1
        y = self.a(x)
        return (self.b(y) if self.k == 1 else y) + 1


def test_the_trackers_own_runtime_warning_turned_into_an_error_is_raised_as_itself(tmp_path):
    torch.manual_seed(0)
    batches = [(2 * i, torch.randn(2, 4), {}) for i in range(3)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(acs.CaptureWarning, match=r"^forward 1 of the tracked model ran to its end without reaching "
                                                     r"the stop point of stop_after_last=True") as raised:
            capture_run.run_capture(_StopsEarlyAfterFirst(), batches, out=str(tmp_path / "s.zarr"), n_total=6,
                                    include=None, exclude=None, reductions=None, progress=False,
                                    stop_after_last=True)
    assert isinstance(raised.value, RuntimeWarning) and not isinstance(raised.value, CaptureError)


@pytest.mark.parametrize("flag", ["resume", "overwrite"])
@pytest.mark.parametrize("value", ["False", "no", 1, None])
def test_resume_and_overwrite_must_be_bools(nets, tmp_path, flag, value):
    # resume="False" (from a config file) is a true string: it resumed the store there (an
    # incomplete one holding every sample was closed complete); refused before anything is loaded
    from activationscope.errors import ArgumentTypeError

    out = str(tmp_path / "b.zarr")
    capture_run.capture_dataset("runnets.nets:mlp", str(nets), out, max_samples=20, progress=False)
    before = acs.open_store(out).attrs
    with pytest.raises(ArgumentTypeError, match=rf"{flag} must be True or False, got {value!r}"):
        capture_run.capture_dataset("runnets.nets:mlp", str(nets), out, max_samples=20, progress=False,
                                    **{flag: value})
    assert acs.open_store(out).attrs == before


class _Tokenizer:
    pad_token_id = 0


def _pad_warnings(tmp_path, ids):
    """The pad-id CaptureWarnings of a token-row capture of tensor data ``ids`` (6, 5)."""
    from activationscope.errors import CaptureWarning

    torch.save(ids, tmp_path / "ids.pt")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        capture_run.capture_dataset("tok:model", str(tmp_path / "ids.pt"), str(tmp_path / "r.zarr"), rows="token",
                                    batch_size=3, progress=False)
    return [str(w.message) for w in caught if issubclass(w.category, CaptureWarning) and "pad token id" in str(w.message)]


@pytest.mark.parametrize("side", ["right", "left", "none"])
def test_token_ids_padded_with_the_pad_id_are_warned_about(tmp_path, monkeypatch, side):
    """Tensor data gives the model no attention mask: ids padded with the tokenizer's pad id
    are attended to and stored as tokens, which a text file would have masked."""
    from activationscope.analysis import specs

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(20, 4))
    monkeypatch.setattr(specs, "load_model_spec", lambda spec: specs.LoadedModel(model=model, tokenizer=_Tokenizer(),
                                                                              name=spec))
    ids = torch.randint(1, 20, (6, 5))
    if side == "right":
        ids[1, 3:] = 0
        ids[4, 4:] = 0
    elif side == "left":
        ids[2, :2] = 0
    padded = _pad_warnings(tmp_path, ids)
    n = {"right": 2, "left": 1, "none": 0}[side]
    if n:
        assert padded == [
            f"--data {str(tmp_path / 'ids.pt')!r} holds token ids padded with the tokenizer's pad token id 0 ({n} of 6 "
            "samples start or end with it), but a tensor file gives the model no attention mask: padded positions are "
            "attended to and stored as rows like real tokens. Give the text instead (a text file, one sample per "
            "line: each batch is tokenized with its attention mask, and padding never enters the store), or ids of "
            "one length without padding"]
    else:
        assert padded == []
    # what the warning says: the padded positions are stored, one row per token
    store = acs.open_store(str(tmp_path / "r.zarr"))
    assert torch.equal(store["0.output"], model[0](ids).detach().reshape(30, 4))


class _GPT2LikeTokenizer:
    pad_token_id = bos_token_id = eos_token_id = 0


@pytest.mark.parametrize("ends, n", [("bos_eos", 0), ("padded", 2)])
def test_a_pad_id_that_is_also_bos_or_eos_warns_only_for_runs_of_it(tmp_path, monkeypatch, ends, n):
    """A tokenizer whose pad id is its BOS / EOS id (GPT-2's): token data that begins or
    ends each context with that token (SAE caching) is not padded; two of them at an end are."""
    from activationscope.analysis import specs

    model = torch.nn.Sequential(torch.nn.Embedding(20, 4))
    monkeypatch.setattr(specs, "load_model_spec", lambda spec: specs.LoadedModel(
        model=model, tokenizer=_GPT2LikeTokenizer(), name=spec))
    ids = torch.randint(1, 20, (6, 5))
    ids[:, 0] = 0  # every context starts with BOS
    ids[3, -1] = 0  # one ends with EOS
    if ends == "padded":
        ids[1, 3:] = 0
        ids[4, 4:] = 0
        ids[4, 3] = 0
    padded = _pad_warnings(tmp_path, ids)
    assert len(padded) == (1 if n else 0) and all(f"({n} of 6 samples start or end with it)" in p for p in padded)


def test_a_failed_capture_joins_the_error_and_what_the_store_keeps_in_one_sentence(tmp_path, monkeypatch):
    """A sample-row hook point that changes shape with pos under a mask: the native error ends
    with a full stop, and what the store keeps follows after "; " (it read "module).; r.zarr")."""
    from activationscope.analysis import specs

    class Tok:
        pad_token_id = 0

        def __call__(self, texts, **kwargs):
            n = max(len(t.split()) for t in texts)
            ids = torch.tensor([[1] * len(t.split()) + [0] * (n - len(t.split())) for t in texts])
            return {"input_ids": ids, "attention_mask": (ids != 0).long()}

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(3, 2)
            self.pos = torch.nn.Embedding(16, 2)

        def forward(self, input_ids, attention_mask=None):
            return self.emb(input_ids) + self.pos(torch.arange(input_ids.shape[1])[None])  # pos: (1, pos, d)

    monkeypatch.setattr(specs, "load_model_spec", lambda spec: specs.LoadedModel(model=Model(), tokenizer=Tok(), name=spec))
    (tmp_path / "t.txt").write_text("a b\nc d\ne f g h\ni j k\n")
    with pytest.raises(CaptureError) as e:
        capture_run.capture_dataset("m:f", str(tmp_path / "t.txt"), str(tmp_path / "r.zarr"), batch_size=2,
                                    progress=False)
    message = str(e.value)
    assert "hook point 'pos.output' changed its feature shape from (2, 2) to (4, 2)" in message
    assert message.endswith(f"or with its module (exclude= its module); {tmp_path / 'r.zarr'} keeps the rows "
                            "committed before (2 samples, status incomplete; --resume continues it)")


def test_on_start_names_the_tracked_modules_before_the_first_forward(tmp_path, monkeypatch):
    # a long capture says what it tracks from its start, also when it stops early (the command
    # line prints "tracked modules: ..." then, not after the capture)
    from activationscope.analysis import specs

    calls = []

    class Failing(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(4, 4)) for _ in range(2))

        def forward(self, x):
            calls.append("forward")
            if len(calls) > 2:
                raise RuntimeError("stopped in forward 2")
            for layer in self.layers:
                x = layer(x)
            return x

    model = Failing()
    monkeypatch.setattr(specs, "load_model_spec", lambda spec: specs.LoadedModel(
        model=model, name=spec, default_include=["layers.0", "layers.1"], default_note="layers.0..1 (the blocks)"))
    torch.save(torch.randn(12, 4), tmp_path / "x.pt")
    with pytest.raises(Exception, match="stopped in forward 2"):
        capture_run.capture_dataset("m:model", str(tmp_path / "x.pt"), str(tmp_path / "r.zarr"), batch_size=4,
                                    progress=False, on_start=lambda note: calls.append(f"start: {note}"))
    assert calls[:2] == ["start: layers.0..1 (the blocks)", "forward"]


def test_token_id_data_captured_one_row_per_token_stores_the_id_of_every_token_row(tmp_path, monkeypatch):
    # --rows token over token ids (the SAE-caching layout) stored sample_id and pos only: a row's
    # token was found by indexing the data file again; now the token table holds token_ids,
    # also across a resume
    from activationscope.analysis import specs

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(20, 4), torch.nn.Linear(4, 4))
    mlp = torch.nn.Sequential(torch.nn.Linear(4, 4))
    monkeypatch.setattr(specs, "load_model_spec", lambda spec: specs.LoadedModel(
        model=model if spec == "m:model" else mlp, name=spec))
    ids = torch.randint(1, 20, (7, 5), dtype=torch.int32)
    torch.save(ids, tmp_path / "ids.pt")
    out = str(tmp_path / "r.zarr")
    capture_run.capture_dataset("m:model", str(tmp_path / "ids.pt"), out, rows="token", batch_size=3, max_samples=4,
                                progress=False)
    capture_run.capture_dataset("m:model", str(tmp_path / "ids.pt"), out, rows="token", batch_size=2, resume=True,
                                progress=False)
    store = acs.open_store(out)
    table = store.row_table("token")
    assert store.n_samples == 7 and store.n_rows("1.output") == table.num_rows == 35
    assert table.column("token_ids").to_pylist() == ids.reshape(-1).tolist()
    assert table.column("token_ids").type == "int32"  # the data's own dtype
    assert table.column("pos").to_pylist() == list(range(5)) * 7
    with torch.no_grad():
        assert torch.equal(store["0.output"], model[0](ids).reshape(35, 4))

    # embeddings (batch, pos, d) are no token ids: no column
    torch.save(torch.randn(3, 5, 4), tmp_path / "emb.pt")
    capture_run.capture_dataset("m:mlp", str(tmp_path / "emb.pt"), str(tmp_path / "e.zarr"), rows="token",
                                progress=False)
    assert acs.open_store(str(tmp_path / "e.zarr")).row_table("token").column_names == ["sample_id", "pos", "batch"]


class _Attrs:
    """A store as the resume checks read it: its root attributes only."""

    def __init__(self, attrs):
        self.attrs = attrs


def test_a_committed_store_checks_each_ranks_part_by_the_fingerprint_that_rank_recorded():
    x = torch.arange(40, dtype=torch.float32).reshape(10, 4)
    part = {"n_samples": 10, "world_size": 2}
    rank0 = {"data": "x.npy", "data_fingerprint": capture_run.tensor_fingerprint(x[:5], 5),
             "rank_part": {"start": 0, "stop": 5, **part}}
    rank1 = {"data": "x.npy", "data_fingerprint": capture_run.tensor_fingerprint(x[5:], 5),
             "rank_part": {"start": 5, "stop": 10, **part}}
    store = _Attrs({"provenance": {**rank0, "resumes": [rank1]}})
    capture_run._check_committed_tensor("s.zarr", x, "x.npy", 10, store)  # the data captured: no error
    for sample, said in [(2, "its samples 0..4 "), (7, "its samples 5..9 ")]:
        other = x.clone()
        other[sample, 1] += 1
        with pytest.raises(ArgumentValueError, match=f"is not the data they were captured from: {said}"):
            capture_run._check_committed_tensor("s.zarr", other, "x.npy", 10, store)
    with pytest.raises(ArgumentValueError, match="it has 4 samples from sample 5 on"):
        capture_run._check_committed_tensor("s.zarr", x[:9], "x.npy", 10, store)
    # a store committed by an earlier version records no rank's part: its data is not checked
    older = _Attrs({"provenance": {**{k: v for k, v in rank0.items() if k != "rank_part"},
                                   "resumes": [{k: v for k, v in rank1.items() if k != "rank_part"}]}})
    capture_run._check_committed_tensor("s.zarr", x + 1, "x.npy", 10, older)


def test_a_rank_without_a_rank_store_takes_the_settings_the_others_record():
    agreed = capture_run._agreed_settings
    assert agreed("s.zarr", None, [{"max_length": 6, "include": None}, None]) == {"max_length": 6, "include": None}
    assert agreed("s.zarr", None, [{}, None, {"max_length": 6}]) == {"max_length": 6}
    assert agreed("s.zarr", {"include": ["a"]}, [{"include": ["a"]}, {"max_length": 6, "include": ["a"]}]) == \
        {"include": ["a"]}  # (a rank with a store keeps its own)
    assert agreed("s.zarr", None, [None, None]) is None  # (no store at all: every rank starts anew)
    with pytest.raises(ArgumentValueError, match=r"record other --max-length: rank 0 6, rank 2 8; .*--overwrite"):
        agreed("s.zarr", None, [{"max_length": 6}, None, {"max_length": 8}])
    with pytest.raises(ArgumentValueError, match=r"record other --include patterns: rank 0 None, rank 1 \['a'\]"):
        agreed("s.zarr", {"include": None}, [{"include": None}, {"include": ["a"]}])
    assert agreed("s.zarr", None, [None, {"padding": "max_length"}]) == {"padding": "max_length"}
    with pytest.raises(ArgumentValueError, match=r"record other --padding: rank 0 'longest', rank 1 'max_length'"):
        agreed("s.zarr", None, [{"padding": "longest"}, {"padding": "max_length"}, None])
