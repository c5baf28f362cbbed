"""A tiny on-disk store implementing the read contract of ``activationscope.store``.

Used to test the data module against the contract independently of the real store: each
hook point is a list of raw shard files (rows, *feature_shape) mapped copy-on-write, row
tables are Parquet files. It implements the ``RowSource`` protocol of
``activationscope.data._source``; ``row_blocks`` / ``rows`` expose the shard boundaries.
"""

from __future__ import annotations

import json
import mmap
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch


def write_fake_store(path, arrays, kinds=None, tables=None, shard_rows=None):
    """arrays: {hp: Tensor (rows, *shape)}; tables: {kind: pa.Table}; shard_rows: rows per shard file."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    meta = {}
    for i, (hp, t) in enumerate(arrays.items()):
        t = t.contiguous()
        n = t.shape[0]
        step = shard_rows or max(n, 1)
        bounds = list(range(0, n, step)) + [n]
        files = []
        for k, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
            name = f"a{i}_s{k}.bin"
            (path / name).write_bytes(t[a:b].view(torch.uint8).numpy().tobytes() if t.dtype != torch.bool else t[a:b].numpy().tobytes())
            files.append(name)
        meta[hp] = {
            "files": files,
            "bounds": bounds,
            "dtype": str(t.dtype).removeprefix("torch."),
            "shape": list(t.shape[1:]),
            "kind": (kinds or {}).get(hp, "sample"),
        }
    for kind, table in (tables or {}).items():
        pq.write_table(table, path / f"rows_{kind}.parquet")
    (path / "fake_store.json").write_text(json.dumps(meta))
    return path


class FakeStore:
    def __init__(self, path):
        self.path = os.fspath(path)
        self._meta = json.loads((Path(path) / "fake_store.json").read_text())
        self._maps = {}
        self.attrs = {}
        self.reductions = {}

    @property
    def hook_points(self):
        return list(self._meta)

    def n_rows(self, hp):
        return self._meta[hp]["bounds"][-1]

    def row_kind(self, hp):
        return self._meta[hp]["kind"]

    def row_table(self, kind):
        path = Path(self.path) / f"rows_{kind}.parquet"
        if not path.exists():  # no rows of that kind: an empty table, as the store's
            cols = {"sample_id": pa.array([], pa.int64()), "batch": pa.array([], pa.int64())}
            return pa.table({**cols, "pos": pa.array([], pa.int64())} if kind == "token" else cols)
        return pq.read_table(path)

    def dtype(self, hp):
        return getattr(torch, self._meta[hp]["dtype"])

    def feature_shape(self, hp):
        return tuple(self._meta[hp]["shape"])

    def follows_row_table(self, hp):
        return True

    def row_blocks(self, hp):
        return list(self._meta[hp]["bounds"]), True

    def will_read(self, hp, start, stop):
        pass

    def _shard(self, hp, k):
        key = (hp, k)
        if key not in self._maps:
            m = self._meta[hp]
            dtype = getattr(torch, m["dtype"])
            fname = Path(self.path) / m["files"][k]
            rows = m["bounds"][k + 1] - m["bounds"][k]
            if os.path.getsize(fname) == 0:
                t = torch.empty((0, *m["shape"]), dtype=dtype)
            else:
                with open(fname, "rb") as f:
                    mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
                t = torch.frombuffer(mm, dtype=dtype).reshape(rows, *m["shape"])
            self._maps[key] = t
        return self._maps[key]

    def rows(self, hp, start, stop):
        bounds = self._meta[hp]["bounds"]
        for k in range(len(bounds) - 1):
            if bounds[k] <= start and stop <= bounds[k + 1]:
                return self._shard(hp, k)[start - bounds[k] : stop - bounds[k]]
        return torch.cat([self._shard(hp, k) for k in range(len(bounds) - 1)])[start:stop]

    def __getitem__(self, hp):
        if hp not in self._meta:
            raise KeyError(hp)
        return self.rows(hp, 0, self.n_rows(hp))


def open_fake(spec, **options):
    return FakeStore(spec)

