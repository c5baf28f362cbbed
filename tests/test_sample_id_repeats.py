"""A sample id recorded twice in one capture (or in the store it resumes) is warned about
once: a per-batch counter (``sample_ids=range(len(batch))``) is the usual cause, and a
``sample_ids=`` selection of the store then picks the rows of every sample with that id."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import activationscope as acs
from activationscope.store.writer import _SampleIds


def _capture(path, ids_of, n_batches=3, **options):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3)).eval()
    scope = acs.ActivationScope(store=str(path), store_options=options)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with scope.track(model) as tr, torch.no_grad():
            for i in range(n_batches):
                ids = ids_of(i)
                tr.set_batch(**({} if ids is None else {"sample_ids": ids}))  # (None: default ids)
                model(torch.randn(4, 4))
    return [str(w.message) for w in caught if issubclass(w.category, acs.CaptureWarning)]


def test_a_per_batch_counter_is_warned_about_once_and_every_row_is_stored(tmp_path):
    got = _capture(tmp_path / "s.zarr", lambda i: range(4), n_batches=4)
    assert len(got) == 1
    assert "sample id 0 was recorded more than once (batch 1" in got[0] and "range(len(batch))" in got[0]
    store = acs.open_store(tmp_path / "s.zarr")
    assert store.n_samples == 16 and store.row_table().column("sample_id").to_pylist() == [0, 1, 2, 3] * 4


@pytest.mark.parametrize("ids_of", [
    lambda i: range(4 * i, 4 * i + 4),                       # a running position
    lambda i: torch.tensor([7, 3, 5, 1]) + 8 * i,            # shuffled
    lambda i: [f"doc-{i}-{j}" for j in range(4)],             # str ids
    lambda i: [10**15 + 4 * i + j for j in range(4)],         # ids past the table: kept in the set
    lambda i: None if i == 0 else range(4 * i, 4 * i + 4),    # default ids first, then on from them
])
def test_distinct_ids_are_not_warned_about(tmp_path, ids_of):
    assert _capture(tmp_path / "s.zarr", ids_of) == []


@pytest.mark.parametrize("ids_of, repeated, batch", [
    (lambda i: [1, 2, 3, 1], "1", 0),                                   # twice in one batch
    (lambda i: None if i < 2 else [0, 1, 2, 3], "0", 2),                 # given ids over the default counter's
    (lambda i: [4, 5, 6, 7] if i == 0 else None, "4", 1),               # the counter runs into given ids
    (lambda i: ["a", "b", "c", "a"] if i == 2 else [f"x{i}{j}" for j in range(4)], "'a'", 2),
    (lambda i: [-5 - i, 10**15, 2 + 4 * i, 3 + 4 * i], "1000000000000000", 1),  # ids outside the table
    (lambda i: [float("nan"), 0.5 + 4 * i, 1.5 + 4 * i, 2.5 + 4 * i], "nan", 1),   # NaN ids are one id
    # a list of numpy ints (the int64 type an array of ids has) is checked as the ints it holds
    (lambda i: None if i < 2 else [np.int64(v) for v in range(4)], "0", 2),
    (lambda i: np.arange(4) if i == 0 else [np.int64(v) for v in (9, 8, 0, 7)], "0", 1),
    (lambda i: np.array([2**64 - 1, 4 * i + 1, 4 * i + 2, 4 * i + 3], dtype=np.uint64),
     "18446744073709551615", 1),                                        # uint64 ids named as given
    (lambda i: np.array([2**64 - 1 - i, 1, 2, 3], dtype=np.uint64) if i == 0 else
     [np.uint64(2**64 - 1), np.uint64(4 * i), np.uint64(4 * i + 1), np.uint64(4 * i + 2)], "18446744073709551615", 1),
])
def test_repeated_ids_are_named_with_their_batch(tmp_path, ids_of, repeated, batch):
    got = _capture(tmp_path / "s.zarr", ids_of)
    assert len(got) == 1 and f"sample id {repeated} was recorded more than once (batch {batch}," in got[0], got


def test_a_resume_checks_its_ids_against_the_stored_ones(tmp_path):
    path = tmp_path / "s.zarr"
    assert _capture(path, lambda i: range(4 * i, 4 * i + 4), n_batches=2) == []
    # a resume that feeds the store's first batches again (the loop did not skip the committed samples)
    got = _capture(path, lambda i: range(4 * i, 4 * i + 4), n_batches=1, resume=True)
    assert len(got) == 1 and "sample id 0 was recorded more than once (batch 2," in got[0]
    # one that goes on from them: nothing to say
    assert _capture(path, lambda i: range(100 + 4 * i, 104 + 4 * i), n_batches=2, resume=True) == []


def test_the_id_table_matches_a_set_on_random_batches():
    rng = np.random.default_rng(0)
    for trial in range(30):
        seen, ref = _SampleIds(), set()
        first = None
        for b in range(12):
            kind = rng.integers(4)
            if kind == 0:
                ids = rng.integers(0, 400, size=int(rng.integers(1, 9)))
            elif kind == 1:
                lo = int(rng.integers(0, 400))
                ids = np.arange(lo, lo + int(rng.integers(1, 9)))
            elif kind == 2:
                ids = rng.integers(-50, 50, size=3) * (1 << 40)
            else:
                lo = int(rng.integers(0, 400))
                seen.add_range(lo, lo + 5)
                ref.update(range(lo, lo + 5))
                continue
            vals = ids.tolist()
            expect = len(set(vals)) != len(vals) or bool(set(vals) & ref)
            got = seen.add(ids)
            assert (got is not None) == expect, (trial, b, vals)
            if got is not None:
                assert got in vals and (vals.count(got) > 1 or got in ref)
                first = first if first is not None else got
            ref.update(vals)


def test_forwards_under_one_sticky_description_are_the_same_samples_again(tmp_path):
    """set_batch is sticky: several forwards after one call (a generation loop) are those
    samples again, never warned about; a new call that gives the same ids is."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3)).eval()
    path = tmp_path / "s.zarr"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with acs.ActivationScope(store=str(path)).track(model) as tr, torch.no_grad():
            tr.set_batch(sample_ids=[5, 6])
            for _ in range(3):  # three forwards of samples 5 and 6
                model(torch.randn(2, 4))
            tr.set_batch(sample_ids=[7, 8])
            model(torch.randn(2, 4))
    assert [w for w in caught if issubclass(w.category, acs.CaptureWarning)] == []
    assert acs.open_store(path).row_table().column("sample_id").to_pylist() == [5, 6] * 3 + [7, 8]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with acs.ActivationScope(store=str(tmp_path / "t.zarr")).track(model) as tr, torch.no_grad():
            tr.set_batch(sample_ids=[5, 6])
            model(torch.randn(2, 4))
            tr.set_batch(sample_ids=[5, 6])  # a new description with the same ids: a repeat
            model(torch.randn(2, 4))
    got = [str(w.message) for w in caught if issubclass(w.category, acs.CaptureWarning)]
    assert len(got) == 1 and "sample id 5 was recorded more than once (batch 1," in got[0]
