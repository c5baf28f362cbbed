"""Resume with the tracker's default sample ids continues the numbering."""

from __future__ import annotations

import pytest
import torch

import activationscope as acs


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())


def test_resume_with_default_sample_ids_equals_uninterrupted(tmp_path):
    model = _model()
    xs = [torch.randn(4, 8) for _ in range(6)]
    with acs.ActivationScope(store=str(tmp_path / "ref.zarr")).track(model), torch.no_grad():
        for x in xs:
            model(x)

    path = str(tmp_path / "run.zarr")
    with pytest.raises(KeyboardInterrupt):
        with acs.ActivationScope(store=path).track(model), torch.no_grad():
            for x in xs[:3]:
                model(x)
            raise KeyboardInterrupt
    assert acs.open_store(path).status == "incomplete"

    tracker = acs.ActivationScope(store=path, store_options={"resume": True}).track(model)
    with tracker, torch.no_grad():
        start = tracker.resume_from
        assert start % 4 == 0 and 0 < start <= 12
        for x in xs[start // 4:]:
            model(x)

    got, ref = acs.open_store(path), acs.open_store(tmp_path / "ref.zarr")
    assert got.status == "complete"
    for hp in ref.hook_points:
        assert torch.equal(got[hp], ref[hp])
    assert got.row_table("sample").column("sample_id").to_pylist() == list(range(24))
    assert ref.row_table("sample").column("sample_id").to_pylist() == list(range(24))


def test_custom_script_reduction_is_kept_with_the_store(tmp_path):
    from typing import Optional

    def total(acc: Optional[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        s = x.double().sum(0)
        return s if acc is None else acc + s

    model = _model()
    xs = [torch.randn(4, 8) for _ in range(3)]
    with acs.ActivationScope(store=str(tmp_path / "s.zarr"), reductions=[total]).track(model), torch.no_grad():
        for x in xs:
            model(x)
    store = acs.open_store(tmp_path / "s.zarr")
    with torch.no_grad():
        want = torch.cat([model[0](x) for x in xs]).double().sum(0)
    torch.testing.assert_close(store.reductions["0.output"]["total"], want)
    script = store.reduction_script("0.output", "total")
    assert script is not None and len(script) > 0
    # a colleague can recompute it from the kept TorchScript
    import io

    fn = torch.jit.load(io.BytesIO(script))
    torch.testing.assert_close(fn(None, store["0.output"]), want)


def test_exception_inside_a_forward_commits_only_whole_forwards(tmp_path):
    class Flaky(torch.nn.Module):
        calls = 0
        fail_at = 3

        def forward(self, x):
            Flaky.calls += 1
            if Flaky.calls == Flaky.fail_at:
                raise RuntimeError("boom")
            return x * 2

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), Flaky(), torch.nn.Linear(8, 8))
    xs = [torch.randn(4, 8) for _ in range(5)]
    path = str(tmp_path / "run.zarr")
    with pytest.raises(RuntimeError, match="boom"):
        with acs.ActivationScope(store=path).track(model), torch.no_grad():
            for x in xs:
                model(x)
    store = acs.open_store(path)
    assert store.status == "incomplete"
    assert store.n_samples == 8  # two whole forwards; the third raised after layer 0 was captured
    assert all(store.n_rows(hp) == 8 for hp in store.hook_points)
    Flaky.fail_at = -1
    tracker = acs.ActivationScope(store=path, store_options={"resume": True}).track(model)
    with tracker, torch.no_grad():
        for x in xs[tracker.resume_from // 4:]:
            model(x)
    store = acs.open_store(path)
    with torch.no_grad():
        want = torch.cat([model[0](x) for x in xs])
    assert store.status == "complete" and torch.equal(store["0.output"], want)
    assert store.row_table("sample").column("sample_id").to_pylist() == list(range(20))


# ---------------------------------------------------------------------- generation captures

def _generation_run(model, path, prompts, store_options, stop_after=None, ids=None):
    """A generation-like capture: each prompt batch of 2 samples is one forward, then 3 steps
    described with ``same_samples=True``. ``ids``: the prompt batches' sample ids (default:
    counted). ``stop_after``: raise KeyboardInterrupt after that many prompt batches (a kill
    between two generations). Returns the tracker's ``resume_from``."""
    tracker = acs.ActivationScope(store=path, store_options=store_options).track(model)
    with tracker, torch.no_grad():
        start = tracker.resume_from // 2
        for i in range(start, len(prompts)):
            if stop_after is not None and i == stop_after:
                raise KeyboardInterrupt
            tracker.set_batch(**({"sample_ids": ids[i]} if ids else {}))
            model(prompts[i][0])
            for step in prompts[i][1:]:
                tracker.set_batch(same_samples=True)
                model(step)
    return tracker.resume_from


def _prompts(n=4):
    torch.manual_seed(1)
    return [[torch.randn(2, 8) for _ in range(4)] for _ in range(n)]


@pytest.mark.parametrize("given", [False, True], ids=["counted", "given"])
def test_resumed_generation_capture_continues_the_sample_ids_of_an_uninterrupted_run(tmp_path, given):
    # each prompt's steps store its samples' rows again: the store holds 8 sample rows per
    # prompt batch of 2 samples, and a resume continues the ids (and skips the data) by samples
    model, prompts = _model(), _prompts()
    ids = [[10 * i + 1, 10 * i + 2] for i in range(4)] if given else None
    ref = str(tmp_path / "ref.zarr")
    _generation_run(model, ref, prompts, {}, ids=ids)
    path = str(tmp_path / "run.zarr")
    with pytest.raises(KeyboardInterrupt):
        _generation_run(model, path, prompts, {}, stop_after=2, ids=ids)
    killed = acs.open_store(path)
    assert killed.status == "incomplete" and killed.n_samples == 16
    assert killed.attrs["next_sample_id"] == 4
    assert _generation_run(model, path, prompts, {"resume": True}, ids=ids) == 4
    got, want = acs.open_store(path), acs.open_store(ref)
    expected = [i for b in (ids or [[0, 1], [2, 3], [4, 5], [6, 7]]) for i in b * 4]
    assert want.row_table("sample").column("sample_id").to_pylist() == expected
    assert got.row_table("sample").column("sample_id").to_pylist() == expected
    assert got.status == "complete" and got.attrs["next_sample_id"] == 8
    for hp in want.hook_points:
        assert torch.equal(got[hp], want[hp])


def test_resumed_generation_store_written_before_the_recorded_counter_continues_from_its_distinct_ids(tmp_path):
    # a store whose root has no next_sample_id (written before it was recorded): the counter
    # continues from the samples it holds, each counted once, not from its sample rows
    import json

    model, prompts = _model(), _prompts()
    path = tmp_path / "run.zarr"
    with pytest.raises(KeyboardInterrupt):
        _generation_run(model, str(path), prompts, {}, stop_after=3)
    root = json.loads((path / "zarr.json").read_text())
    assert root["attributes"]["activationscope"].pop("next_sample_id") == 6
    (path / "zarr.json").write_text(json.dumps(root))
    assert acs.open_store(path).verify() == []
    assert _generation_run(model, str(path), prompts, {"resume": True}) == 6
    got = acs.open_store(path)
    assert got.row_table("sample").column("sample_id").to_pylist() == [i for b in range(4) for i in [2 * b, 2 * b + 1] * 4]
    assert got.attrs["next_sample_id"] == 8


def test_resume_continues_the_counter_after_given_ids_and_generation_steps(tmp_path):
    # given ids advance the counter once per sample, steps do not: a resumed run of counted
    # ids gets what the uninterrupted run's counter gives (2, 3 here), never the rows count
    model, prompts = _model(), _prompts(2)
    path = str(tmp_path / "run.zarr")
    with pytest.raises(KeyboardInterrupt):
        _generation_run(model, path, prompts, {}, stop_after=1, ids=[[100, 200]])
    tracker = acs.ActivationScope(store=path, store_options={"resume": True}).track(model)
    with tracker, torch.no_grad():
        assert tracker.resume_from == 2 and tracker.writer.n_samples_committed == 8
        model(prompts[1][0])
        tracker.set_batch(same_samples=True)
        model(prompts[1][1])
    assert acs.open_store(path).row_table("sample").column("sample_id").to_pylist() == [100, 200] * 4 + [2, 3] * 2


@pytest.mark.parametrize("bad", [-1, 1.5, True, "3", 1 << 49])
def test_add_batch_refuses_a_next_id_that_is_not_a_row_count(tmp_path, bad):
    writer = acs.store.StoreWriter(tmp_path / "w.zarr")
    try:
        with pytest.raises(acs.errors.ArgumentValueError, match=r"next_id must be an int in 0\.\.\d+, got "):
            writer.add_batch(2, next_id=bad)
        assert writer.next_sample_id == 0
        writer.add_batch(2, sample_ids=[5, 6], next_id=0)  # a batch of samples counted before
        writer.add_batch(2)
        assert writer.next_sample_id == 2
    finally:
        writer.close()
    assert acs.open_store(tmp_path / "w.zarr").row_table("sample").column("sample_id").to_pylist() == [5, 6, 0, 1]


def test_add_batch_refuses_a_next_id_that_takes_the_counter_back(tmp_path):
    """A counter set back would give later samples default ids already stored (repeated ids,
    silently): refused, naming the counter, the batch not recorded."""
    from activationscope.store import StoreWriter

    writer = StoreWriter(tmp_path / "w.zarr")
    try:
        writer.add_batch(3)
        with pytest.raises(acs.errors.ArgumentValueError, match=r"next_id must be at least next_sample_id 3 .*got 1"):
            writer.add_batch(2, sample_ids=[7, 8], next_id=1)
        assert writer.next_sample_id == 3
        writer.add_batch(2, sample_ids=[0, 1], described_again=True, next_id=3)  # (a step: the counter stays)
        writer.add_batch(1)
    finally:
        writer.close()
    assert acs.open_store(tmp_path / "w.zarr").row_table("sample").column("sample_id").to_pylist() == [0, 1, 2, 0, 1, 3]


@pytest.mark.parametrize("bad", [-1, 1.5, "3", True, None, 1 << 49])
def test_a_stored_next_sample_id_that_is_not_a_count_is_refused_and_the_store_left_as_it_was(tmp_path, bad):
    from hostile import edit_root, make_store

    from activationscope.errors import StoreCorruptError

    path = tmp_path / "s.zarr"
    make_store(path, n_rows=32)
    edit_root(path, lambda a: a.update(next_sample_id=bad))
    before = (path / "zarr.json").read_bytes()
    with pytest.raises(StoreCorruptError, match=r"next_sample_id must be an int in 0\.\.\d+"):
        acs.open_store(path)
    with pytest.raises(StoreCorruptError, match=r"next_sample_id must be an int in 0\.\.\d+"):
        acs.store.StoreWriter(path, resume=True)
    assert (path / "zarr.json").read_bytes() == before


def test_resume_from_is_the_count_at_attach_while_the_run_commits(tmp_path):
    # a loop that skips `resume_from` samples of its data reads it at every batch: the run's
    # own commits do not move it
    model, path = _model(), str(tmp_path / "run.zarr")
    small = {"chunk_rows": 4, "shard_bytes": 4 * 8 * 4}
    tracker = acs.ActivationScope(store=path, store_options=small).track(model)
    with tracker, torch.no_grad():
        for _ in range(4):
            model(torch.randn(4, 8))
            assert tracker.resume_from == 0
    assert acs.open_store(path).n_samples == 16 and tracker.resume_from == 0
