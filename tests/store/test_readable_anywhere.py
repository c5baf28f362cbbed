"""Reading never needs the native extension and takes any slice; bad indices are our errors
(issue 12)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from activationscope.errors import ActivationScopeError
from activationscope.store import open_store

from hostile import HP, N_ROWS, make_store, run_python

# ---------------------------------------------------------------- readable without the extension
_NO_NATIVE = """
    import sys
    import numpy as np, torch
    from pathlib import Path
    import activationscope as acs
    from activationscope.errors import NativeExtensionError
    from activationscope.store import open_store
    from activationscope.data import ActivationDataset
    from hostile import HP, N_ROWS
    path, out = Path(sys.argv[1]), Path(sys.argv[2])
    data = torch.load(path.parent / "data.pt")
    s = open_store(path)
    assert torch.equal(s[HP], data) and s.verify() == [], s.verify()
    v = s[HP, 64:128]
    assert torch.equal(v, data[64:128])
    assert v.data_ptr() == s[HP, 64:128].data_ptr()  # zero-copy: the same mapped bytes twice
    assert torch.equal(s.reductions[HP]["mean"], data.double().mean(0))
    ds = ActivationDataset(path)
    assert torch.equal(ds[10:20][HP], data[10:20])
    z = open_store(path.parent / "z.zarr")
    assert torch.equal(z[HP], torch.load(path.parent / "zdata.pt")) and z.verify() == []
    from activationscope.data import export_parquet
    export_parquet(ds, out / "rows.parquet")
    try:
        acs.ActivationScope(store=str(out / "new.zarr")).track(torch.nn.Linear(2, 2)).attach()
    except NativeExtensionError as e:
        print("capture refused:", type(e).__name__)
    print("read ok")
"""


def test_reads_without_the_native_extension(tmp_path):
    torch.save(make_store(tmp_path / "s.zarr"), tmp_path / "data.pt")
    torch.save(make_store(tmp_path / "z.zarr", compression="zstd"), tmp_path / "zdata.pt")
    out = tmp_path / "out"
    out.mkdir()
    r = run_python(_NO_NATIVE, str(tmp_path / "s.zarr"), str(out), native=False)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "read ok" in r.stdout and "capture refused: NativeExtensionError" in r.stdout
    import pyarrow.parquet as pq

    assert pq.read_table(out / "rows.parquet").num_rows == N_ROWS


def test_cli_reads_without_the_native_extension(tmp_path):
    """info, verify, export (Parquet and Arrow) and report on a machine without our build:
    reading a store needs no compiled code, so each command runs and gives the stored rows."""
    data = make_store(tmp_path / "s.zarr")
    torch.save(data, tmp_path / "data.pt")
    code = """
        import sys
        from activationscope.cli import main
        store, out = sys.argv[1], sys.argv[2]
        for cmd in (["info", store], ["verify", store],
                    ["export", store, "--format", "parquet", "--out", out + "/rows.parquet"],
                    ["export", store, "--format", "arrow", "--out", out + "/rows.arrow"],
                    ["report", store, "--out", out + "/report"]):
            rc = main(cmd)
            print("rc", cmd[0], cmd[3] if cmd[0] == "export" else "", rc, flush=True)
        assert "activationscope._C" not in sys.modules or sys.modules["activationscope._C"] is None
    """
    r = run_python(code, str(tmp_path / "s.zarr"), str(tmp_path), native=False)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    for line in ("rc info  0", "rc verify  0", "rc export parquet 0", "rc export arrow 0", "rc report  0"):
        assert line in r.stdout, (line, r.stdout, r.stderr[-3000:])
    import pyarrow.parquet as pq

    from activationscope.data import read_arrow

    table = pq.read_table(tmp_path / "rows.parquet")
    assert table.num_rows == N_ROWS
    rows = torch.tensor(np.stack(table.column(HP).to_numpy(zero_copy_only=False)), dtype=torch.float32)
    assert torch.equal(rows.view(N_ROWS, -1), data)
    assert table.column("label").to_pylist() == [i % 3 for i in range(N_ROWS)]
    assert torch.equal(read_arrow(tmp_path / "rows.arrow")[HP], data)
    page = (tmp_path / "report" / "index.html").read_text()
    assert HP in page and (tmp_path / "report" / f"hp_{HP.replace('.', '_')}.png").stat().st_size > 5000


# ---------------------------------------------------------------- slices and indices
@pytest.fixture(scope="module")
def store(tmp_path_factory):
    path = tmp_path_factory.mktemp("s") / "s.zarr"
    data = make_store(path)
    return open_store(path), data


@pytest.mark.parametrize("sl", [slice(None, None, -1), slice(None, None, 3), slice(300, 10, -7), slice(5, 5),
                                slice(-10, None), slice(None, -300, -1), slice(10, 300, 64), slice(400, 500),
                                slice(319, None, -64)])
def test_any_slice_gives_the_rows_torch_gives(store, sl):
    s, data = store
    idx = list(range(N_ROWS))[sl]  # plain Python semantics, as a reference
    want = data[idx] if idx else data[:0]
    got = s[HP, sl]
    assert got.shape == want.shape and torch.equal(got, want)


@pytest.mark.parametrize("call, error", [
    (lambda s: s.rows(HP, 0.5, 3), TypeError),
    (lambda s: s.rows(HP, 0, "3"), TypeError),
    (lambda s: s.rows(HP, 5, 400), IndexError),
    (lambda s: s.rows(HP, -1, 3), IndexError),
    (lambda s: s[HP, 0.5:3], TypeError),
    (lambda s: s[HP, 3], TypeError),
    (lambda s: s[3], KeyError),
])
def test_bad_row_indices_are_our_errors(store, call, error):
    s, _ = store
    with pytest.raises(error) as e:
        call(s)
    assert isinstance(e.value, ActivationScopeError)


def test_dataset_empty_and_bad_indices(store, tmp_path):
    from activationscope.data import ActivationDataset

    s, data = store
    ds = ActivationDataset(s)
    assert ds[[]][HP].shape == (0, 8) and ds.get_batch(())[HP].shape == (0, 8)
    assert len(ActivationDataset(s, rows=[])) == 0
    assert torch.equal(ds[[5, 2]][HP], data[[5, 2]])
    for bad, error in (([0.5], TypeError), (0.5, TypeError), (N_ROWS, IndexError), ([N_ROWS + 3], IndexError)):
        with pytest.raises(error) as e:
            ds[bad]
        assert isinstance(e.value, ActivationScopeError)
