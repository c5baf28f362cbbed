"""Indexes ``ActivationDataset`` does not take get our errors (the message names the index and
the fix), on the native gather path, without it, and on a dataset with a row selection; the
0-d indexes it does take read the same row as an int; a range is its positions (never clipped
as a slice is), in ``ds[...]`` and in ``rows=``."""

from __future__ import annotations

import array
import collections

import numpy as np
import pyarrow as pa
import pytest
import torch

from activationscope import ActivationDataset
from activationscope.capture import _native
from activationscope.data import _source
from activationscope.errors import ArgumentTypeError, ArgumentValueError, RowIndexError

from fake_store import open_fake, write_fake_store

N = 299
OPEN = {"opener": open_fake}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("index")
    a = torch.arange(N * 2, dtype=torch.float32).reshape(N, 2)
    b = torch.arange(N, dtype=torch.int32) * 3
    table = pa.table({"label": pa.array(np.arange(N) % 3)})
    path = write_fake_store(tmp_path / "s", {"a": a, "b": b}, tables={"sample": table}, shard_rows=50)
    return path, a


@pytest.fixture(params=["native", "python", "selected"])
def ds(request, data, monkeypatch):
    """The same 299 rows three ways: the native gather, the Python path (no extension), and a
    dataset with a row selection (``rows=`` a list: positions go through the general path)."""
    path, _ = data
    if request.param == "python":
        monkeypatch.setattr(_source, "_GATHER", [None])
    rows = list(range(N)) if request.param == "selected" else None
    return ActivationDataset(path, hook_points=["a", "b"], columns=["label"], rows=rows, open_options=OPEN)


def _sparse():
    return torch.tensor([1, 2]).to_sparse()


WRONG_KIND = [
    ("name", r"ds\[index\]: index must be an int .* got the name 'name'; items and batches are dicts keyed by "
             r"the hook points and columns \['a', 'b', 'label'\]"),
    ("a", r"got the name 'a'; 'a' is a key of each item and batch, so read ds\[i\]\['a'\] for one row or ds\[:\]\['a'\]"),
    ([None, 2], r"ds\[index\]: index must be a sequence of ints \(positions\), got None \(NoneType\) at element 0 "
                r"of \[None, 2\]; use ds\[:\] for every row"),
    ((3, None), r"got None \(NoneType\) at element 1 of \(3, None\)"),
    ({1, 2}, r"ds\[index\]: index must be an int .* got \{1, 2\} \(set\); a set has no order.*pass sorted\(\.\.\.\)"),
    (frozenset({1, 2}), r"\(frozenset\); a set has no order"),
    (None, r"got None \(NoneType\); use a slice \(ds\[:\]\) for every row"),
    ({1: 2}, r"got \{1: 2\} \(dict\); pass list\(\.\.\.\) of it"),
    ((i for i in (1, 2)), r"\(generator\); pass list\(\.\.\.\) of it"),
    (pa.array([1.5]), r"positions must be ints, got dtype torch\.float64"),
    (3.0, r"got 3\.0 \(float\); positions are ints"),
    (True, r"got True \(bool\); a bool is not a position"),
    ([1, [2]], r"got \[2\] \(list\) at element 1"),
    (["x", "y"], r"got 'x' \(str\) at element 0"),
    ([1.5, 2.0], r"a batch index must be a 1-D sequence of ints, got \[1\.5, 2\.0\]; positions must be ints"),
    (torch.tensor([[1, 2]]), r"a batch index must be a 1-D sequence of ints, got a torch\.int64 Tensor of shape "
                             r"\(1, 2\) on cpu; the index must be 1-D, got shape \(1, 2\): flatten it with \.reshape\(-1\)"),
    (torch.ones(2, 3, dtype=torch.bool), r"a bool mask must be 1-D with one entry per dataset row, got shape \(2, 3\)"),
    (torch.tensor([1.0]), r"positions must be ints, got dtype torch\.float32: convert whole numbers with \.long\(\)"),
    (np.array([1.5]), r"positions must be ints, got dtype torch\.float64"),
    (np.array(["x"]), r"ds\[index\]: index must be an int .* got array\(\['x'\]"),
    (torch.tensor(3.5), r"ds\[index\]: index as a 0-d tensor must have an integer dtype .* got torch\.float32; "
                        r"convert it with int\(\.\.\.\)"),
    (torch.tensor(True), r"as a 0-d tensor must have an integer dtype .* got torch\.bool; a bool is not a position"),
    (np.array(3.0), r"as a 0-d numpy array must have an integer dtype .* got float64"),
    (np.bool_(True), r"a bool is not a position"),
    (slice("a", 3), r"ds\[index\]: index slice must have int or None start, stop and step, got slice\('a', 3, None\)"),
    ("sparse", r"ds\[index\]: index must be a dense tensor, got layout torch\.sparse_coo; pass index\.to_dense\(\)"),
]


@pytest.mark.parametrize("index, message", WRONG_KIND, ids=[repr(i)[:30] for i, _ in WRONG_KIND])
def test_an_index_of_a_kind_not_taken_is_an_argument_type_error(ds, index, message):
    index = _sparse() if isinstance(index, str) and index == "sparse" else index
    with pytest.raises(ArgumentTypeError, match=message) as info:
        ds[index]
    assert isinstance(info.value, TypeError)


OUT_OF_RANGE = [
    ([2**64], r"ds\[index\]: index must be positions in \[-299, 299\) \(299 dataset rows; negative positions count "
              r"from the end\), got 18446744073709551616 at element 0$"),
    ([-2**70], r"got -1180591620717411303424 at element 0$"),
    ([2**63], r"got 9223372036854775808 at element 0$"),
    ([0, 5, 2**64], r"got 18446744073709551616 at element 2$"),
    ([0, N], r"must be positions in \[-299, 299\) .* got 299 at element 1$"),
    ([3, -N - 1], r"got -300 at element 1$"),
    (torch.tensor([4, 2**40]), r"got 1099511627776 at element 1$"),
    (np.array([2**64 - 1], dtype=np.uint64), r"got 18446744073709551615 at element 0$"),  # not row -1
    (np.array([4, 2**64 - 2], dtype=">u8"), r"got 18446744073709551614 at element 1$"),
    (torch.from_numpy(np.array([1, 2**63], dtype=np.uint64)), r"got 9223372036854775808 at element 1$"),
    (range(290, 310), r"ds\[index\]: index range\(290, 310\) must be positions in \[-299, 299\) .* got 309; a range "
                      r"is taken position by position, like a list, and is not clipped as a slice is: keep it within "
                      r"\[-299, 299\), or use slice\(290, 310\) to read only the rows there are"),
    (range(290, 310, 2), r"got 308; .*use slice\(290, 310, 2\)"),
    (range(-400, 3), r"got -400; "),
    (range(0, 2**70), r"got 1180591620717411303423; "),
    (N, r"ds\[index\]: index must be in \[-299, 299\) for a dataset of 299 rows .* got 299$"),
    (-N - 1, r"got -300$"),
    (2**64, r"got 18446744073709551616$"),
    (np.array(N), r"got 299$"),
    (torch.tensor(-N - 1), r"got -300$"),
    (np.array(2**64 - 1, dtype=np.uint64), r"got 18446744073709551615$"),
]


@pytest.mark.parametrize("index, message", OUT_OF_RANGE, ids=[repr(i)[:30] for i, _ in OUT_OF_RANGE])
def test_positions_out_of_range_are_a_row_index_error_naming_the_position(ds, index, message):
    with pytest.raises(RowIndexError, match=message) as info:
        ds[index]
    assert isinstance(info.value, IndexError)


@pytest.mark.parametrize("selection", [{"rows": []}, {"filter": lambda t: [False] * t.num_rows}, {"rows": slice(5, 5)}])
def test_a_row_of_an_empty_dataset_says_it_has_no_rows(data, selection):
    # it said "index must be in [-0, 0)", which reads as an off-by-one, not as an empty selection
    path, _ = data
    empty = ActivationDataset(path, hook_points=["a"], open_options=OPEN, **selection)
    for index in (0, -1, np.int64(0), torch.tensor(0)):
        with pytest.raises(RowIndexError, match=r"ds\[-?[01]\]: the dataset has no rows \(rows=, sample_ids= or filter= "
                                                r"selected none.*check len\(ds\)"):
            empty[index]
    assert empty[:]["a"].shape == (0, 2)


@pytest.mark.parametrize("index", [torch.tensor([0, 1], device="meta"), torch.tensor(1, device="meta")])
def test_an_index_on_the_meta_device_is_refused_with_the_fix(ds, index):
    with pytest.raises(ArgumentValueError, match=r"ds\[index\]: index must be a tensor with values, got a (0-d )?tensor "
                                                 r"on the meta device \(it holds none\)"):
        ds[index]


SAME_AS_3 = [np.array(3), torch.tensor(3), np.int64(3), np.array(3, dtype=np.uint64), np.array(3, dtype=np.int8),
             torch.tensor(3, dtype=torch.uint8), torch.tensor(3, dtype=torch.int32), torch.tensor(3, dtype=torch.uint64),
             np.array(3 - N), torch.tensor(3 - N)]


@pytest.mark.parametrize("index", SAME_AS_3, ids=repr)
def test_a_0d_integer_index_reads_the_row_an_int_reads(ds, data, index):
    _, a = data
    got, want = ds[index], ds[3]
    assert torch.equal(got["a"], a[3]) and torch.equal(got["a"], want["a"])
    assert int(got["b"]) == 9 and int(got["label"]) == 0


@pytest.mark.parametrize(
    "index, rows",
    [
        (range(-5, 3), [294, 295, 296, 297, 298, 0, 1, 2]),  # a range is its positions, as a list
        (range(5, -1, -1), [5, 4, 3, 2, 1, 0]),
        (range(-3, 0), [296, 297, 298]),
        (range(7, 7), []),
        (range(7, 8, 5), [7]),
        (slice(290, 310), list(range(290, N))),  # a slice clips, as in Python
        (slice(-5, None, 2), [294, 296, 298]),
        (np.array([5, 3, 1])[::-1], [1, 3, 5]),  # negative strides
        (np.array([3, 1], dtype=">i8"), [3, 1]),  # not native byte order
        (np.array([3, 1], dtype=np.uint64), [3, 1]),
        (np.array([3, 1], dtype=">u8"), [3, 1]),
        (torch.tensor([3, 1], dtype=torch.uint64), [3, 1]),
        (np.array([np.int64(3), 1], dtype=object), [3, 1]),
        ([np.uint64(3), 1], [3, 1]),  # numpy makes float64 of these; they are ints
        ([3, np.uint64(2**63 - 1) - np.uint64(2**63 - 2)], [3, 1]),
        ((4, -1), [4, 298]),
        (pa.array([3, 1]), [3, 1]),  # array-likes go through numpy
        (collections.deque([3, -1]), [3, 298]),  # other sequences through a list
        (array.array("q", [3, 1]), [3, 1]),
    ],
    ids=repr,
)
def test_taken_batch_indexes_read_the_rows_of_their_positions(ds, data, index, rows):
    _, a = data
    got = ds[index]
    assert torch.equal(got["a"], a[rows]) and got["a"].shape == (len(rows), 2)
    assert got["label"].tolist() == [r % 3 for r in rows]
    if isinstance(index, range):
        assert torch.equal(ds[list(index)]["a"], got["a"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_cuda_index_tensor_reads_the_same_rows(ds, data):
    _, a = data
    assert torch.equal(ds[torch.tensor([7, 2, 290], device="cuda")]["a"], a[[7, 2, 290]])
    assert torch.equal(ds[torch.tensor(7, device="cuda")]["a"], a[7])
    path, _ = data
    assert torch.equal(_make(path, torch.tensor([9, 4], device="cuda"))[:]["a"], a[[9, 4]])


def test_the_native_gather_still_takes_lists_of_ints_and_int64_tensors(data, monkeypatch):
    path, a = data
    native = _native.load().gather_rows
    calls = []
    monkeypatch.setattr(_source, "_GATHER", [lambda *args: calls.append(native(*args)) or calls[-1]])
    ds = ActivationDataset(path, hook_points=["a"], open_options=OPEN)
    assert torch.equal(ds[[5, 60, 2]]["a"], a[[5, 60, 2]])
    assert torch.equal(ds[torch.tensor([298, 0])]["a"], a[[298, 0]])
    assert calls and None not in calls  # (an int return: a segment to map first)
    calls.clear()
    with pytest.raises(RowIndexError, match="got 18446744073709551616 at element 1"):
        ds[[5, 2**64]]
    with pytest.raises(ArgumentTypeError, match="got None"):
        ds[[None, 2]]
    assert calls == [None, None]  # refused natively, then explained by the general path


# ---------------------------------------------------------------------------- rows=
def _make(path, rows):
    return ActivationDataset(path, hook_points=["a"], rows=rows, open_options=OPEN)


def test_rows_range_past_the_end_is_an_error_like_a_list_while_a_slice_clips(data):
    path, a = data
    fix = r"a range is taken position by position, like a list, and is not clipped as a slice is: .*slice\(290, 310\)"
    with pytest.raises(RowIndexError, match=r"rows range\(290, 310\) must be positions in \[-299, 299\) \(299 store rows; "
                                            r"negative positions count from the end\), got 309; " + fix):
        _make(path, range(290, 310))
    with pytest.raises(RowIndexError, match=r"rows must be positions in \[-299, 299\) .* got 299 at element 9$"):
        _make(path, list(range(290, 310)))
    with pytest.raises(RowIndexError, match=r"got 308; .*slice\(290, 310, 2\)"):
        _make(path, range(290, 310, 2))
    clipped = _make(path, slice(290, 310))
    assert len(clipped) == 9 and torch.equal(clipped[:]["a"], a[290:])


@pytest.mark.parametrize(
    "rows, want",
    [
        (range(-5, 3), [294, 295, 296, 297, 298, 0, 1, 2]),
        (range(-3, 0), [296, 297, 298]),
        (range(298, 290, -3), [298, 295, 292]),
        (range(10, 20), list(range(10, 20))),
        (range(400, 300), []),
        (np.array([5, 3, 1])[::-1], [1, 3, 5]),
        (np.array([3, 1], dtype=np.uint64), [3, 1]),
    ],
    ids=repr,
)
def test_rows_range_is_its_positions_as_a_list(data, rows, want):
    path, a = data
    ds = _make(path, rows)
    assert len(ds) == len(want) and torch.equal(ds[:]["a"], a[want])
    if isinstance(rows, range):
        assert torch.equal(_make(path, list(rows))[:]["a"], a[want])


ROWS_WRONG = [
    ({1, 2}, ArgumentTypeError, r"rows must be a slice, a range, .* or a bool mask, got \{1, 2\} \(set\); a set has no order"),
    ([None, 2], ArgumentTypeError, r"rows must be a sequence of ints \(positions\), got None .* rows=None selects every row"),
    ("a", ArgumentTypeError, r"rows must be .* got 'a' \(str\); rows are selected by position, not by name"),
    (3, ArgumentTypeError, r"rows must be .* got 3 \(int\)"),
    ([1.5], ArgumentTypeError, r"positions must be ints, got dtype torch\.float64"),
    (torch.ones(2, 2, dtype=torch.int64), ArgumentTypeError, r"the index must be 1-D, got shape \(2, 2\)"),
    (slice(0, 10, 0), ArgumentValueError, r"rows slice step must not be zero, got slice\(0, 10, 0\)"),
    ([2**64], RowIndexError, r"rows must be positions in \[-299, 299\) .* got 18446744073709551616 at element 0"),
    (np.array([2**64 - 1], dtype=np.uint64), RowIndexError, r"got 18446744073709551615 at element 0"),
    (range(0, 2**70), RowIndexError, r"got 1180591620717411303423"),
    (torch.tensor([0, 1], device="meta"), ArgumentValueError, r"rows must be a tensor with values, got a tensor on the meta device"),
]


@pytest.mark.parametrize("rows, error, message", ROWS_WRONG, ids=[repr(r)[:30] for r, _, _ in ROWS_WRONG])
def test_rows_not_taken_are_our_errors_naming_rows(data, rows, error, message):
    path, _ = data
    with pytest.raises(error, match=message):
        _make(path, rows)


@pytest.mark.parametrize("kind", ["torch", "numpy", "list"])
def test_a_bool_mask_over_the_dataset_reads_the_rows_where_it_is_true(ds, data, kind):
    _, a = data
    mask = torch.zeros(N, dtype=torch.bool)
    mask[[3, 7, 8, 250]] = True
    index = {"torch": mask, "numpy": mask.numpy(), "list": mask.tolist()}[kind]
    got = ds[index]
    assert torch.equal(got["a"], a[mask]) and got["a"].shape == (4, 2)
    assert got["label"].tolist() == [3 % 3, 7 % 3, 8 % 3, 250 % 3]
    assert torch.equal(ds.get_batch(index)["a"], a[[3, 7, 8, 250]])
    assert ds[torch.zeros(N, dtype=torch.bool)]["a"].shape == (0, 2)


@pytest.mark.parametrize("length", [0, 2, N - 1, N + 1])
def test_a_bool_mask_of_another_length_than_the_dataset_is_refused(ds, length):
    with pytest.raises(ArgumentValueError, match=rf"ds\[index\]: a bool mask must have one entry per dataset "
                                                 rf"row, shape \({N},\), got shape \({length},\)"):
        ds[torch.ones(length, dtype=torch.bool)]


@pytest.mark.parametrize("index, at", [([True, 1], 0), ([1, True], 1), ((0, False), 1), ([2, np.bool_(True)], 1)])
def test_a_bool_among_ints_is_refused_not_read_as_position_one(ds, index, at):
    with pytest.raises(ArgumentTypeError, match=rf"got (np\.)?(True|False)_? \(bool\) at element {at}"):
        ds[index]



@pytest.mark.parametrize("index, at, kind", [
    ([torch.tensor(True), torch.tensor(5)], 0, r"a torch\.bool Tensor of shape \(\)"),
    ([4, torch.tensor(False)], 1, r"a torch\.bool Tensor of shape \(\)"),
    ([torch.tensor([3]), 1], 0, r"a torch\.int64 Tensor of shape \(1,\)"),
])
def test_a_bool_or_1d_tensor_among_positions_is_refused(ds, index, at, kind):
    # (a 0-d bool tensor in a list of positions was read as position 0 / 1, and a 1-element
    # tensor as its value, where a Python bool and np.array([3]) are refused)
    for read in (lambda: ds[index], lambda: ds.__getitems__(index)):
        with pytest.raises(ArgumentTypeError, match=rf"got {kind} on cpu \(Tensor\) at element {at}"):
            read()


def test_0d_integer_tensors_in_a_list_are_positions(ds, data):
    _, a = data
    index = list(torch.tensor([7, 250, 7, 0]))  # a list of 0-d tensors
    assert torch.equal(ds[index]["a"], a[[7, 250, 7, 0]])

def test_a_bool_mask_batch_has_the_length_of_its_rows(ds, data):
    _, a = data
    mask = torch.zeros(N, dtype=torch.bool)
    mask[[5, 9]] = True
    batch = ds.__getitems__(mask)
    assert len(batch) == 2 and torch.equal(batch.data["a"], a[[5, 9]])


def test_a_uint8_tensor_index_is_refused_as_ambiguous_and_a_uint8_array_is_positions(ds, data):
    """torch indexing reads a uint8 tensor as a mask (deprecated), numpy a uint8 array as positions:
    a uint8 tensor is refused with both fixes, in ds[...] and in rows=, and never read as either."""
    path, a = data
    index = torch.tensor([1, 0, 1], dtype=torch.uint8)
    with pytest.raises(ArgumentTypeError, match=r"ds\[index\]: index must not be a uint8 Tensor, got a torch\.uint8 Tensor "
                                                r"of shape \(3,\) .* pass index\.bool\(\) for a mask or index\.long\(\)"):
        ds[index]
    with pytest.raises(ArgumentTypeError, match=r"must not be a uint8 Tensor"):
        ds.get_batch(torch.ones(N, dtype=torch.uint8))
    with pytest.raises(ArgumentTypeError, match=r"rows must not be a uint8 Tensor"):
        _make(path, torch.tensor([3, 1], dtype=torch.uint8))
    assert torch.equal(ds[index.long()]["a"], a[[1, 0, 1]])
    assert torch.equal(ds[np.array([1, 0, 1], dtype=np.uint8)]["a"], a[[1, 0, 1]])  # numpy: positions
    assert torch.equal(ds[torch.tensor(2, dtype=torch.uint8)]["a"], a[2])  # 0-d: one row, as an int
