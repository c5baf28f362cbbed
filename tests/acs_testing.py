"""Small models shared by the tests (import as `from acs_testing import ...`)."""

from __future__ import annotations

import torch


def toy_mlp(width: int = 16, depth: int = 3) -> torch.nn.Module:
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers)


class SmallCNN(torch.nn.Module):
    """Conv / BatchNorm / in-place ReLU / pooling / linear head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv1 = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = torch.nn.BatchNorm2d(8)
        self.relu1 = torch.nn.ReLU(inplace=True)
        self.conv2 = torch.nn.Conv2d(8, 8, 3, padding=1)
        self.relu2 = torch.nn.ReLU(inplace=True)
        self.pool = torch.nn.AdaptiveAvgPool2d(1)
        self.head = torch.nn.Linear(8, 4)

    def forward(self, x):
        x = self.relu1(self.bn1(self.conv1(x)))
        x = self.relu2(self.conv2(x))
        return self.head(self.pool(x).flatten(1))


def small_transformer(d_model: int = 16) -> torch.nn.Module:
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(d_model, nhead=2, dim_feedforward=32, dropout=0.0, batch_first=True)
    return torch.nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)


def python_blocks(path) -> list[str]:
    """The ```python blocks of a Markdown file, in order."""
    import re
    from pathlib import Path

    return re.findall(r"```python\n(.*?)```", Path(path).read_text(), flags=re.S)


def run_doc_blocks(path, workdir, *, min_blocks: int = 1) -> None:
    """Run a Markdown page's python blocks in order as one script inside ``workdir``
    (a file, so TorchScript can read the source of functions defined there)."""
    import os
    import runpy
    from pathlib import Path

    blocks = python_blocks(path)
    assert len(blocks) >= min_blocks, f"{path}: {len(blocks)} python blocks, expected at least {min_blocks}"
    script = Path(workdir) / f"{Path(path).stem}_doc.py"
    script.write_text("\n".join(f"# --- block {i}\n{b}" for i, b in enumerate(blocks)))
    cwd = os.getcwd()
    os.chdir(workdir)
    try:
        runpy.run_path(str(script), run_name="__docs__")
    finally:
        os.chdir(cwd)


class PrependCLS(torch.nn.Module):
    """Prepends a learnt token to ``(batch, pos, 8)`` activations: its output no longer starts
    with the tokenizer's ``(batch, pos)`` mask."""

    def __init__(self) -> None:
        super().__init__()
        self.cls = torch.nn.Parameter(torch.randn(1, 1, 8))

    def forward(self, h):
        return torch.cat([self.cls.expand(len(h), -1, -1), h], 1)


class BracketNames(torch.nn.Module):
    """Module names that are also fnmatch patterns: ``d.a[1]`` matches ``d.a1`` as a pattern."""

    def __init__(self):
        super().__init__()
        self.d = torch.nn.ModuleDict({"a[1]": torch.nn.Linear(2, 2), "a1": torch.nn.Linear(2, 3)})

    def forward(self, x):
        return self.d["a[1]"](x), self.d["a1"](x)


class LateBranch(torch.nn.Module):
    """``a`` runs in every forward, ``b`` only when ``extra``: a store where ``b.output`` is
    first captured after some forwards, so its rows do not follow the row table."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(4, 4)
        self.b = torch.nn.Linear(4, 2)

    def forward(self, x, extra=True):
        y = self.a(x)
        return (y, self.b(y)) if extra else (y,)


def late_branch_store(path, n_forwards: int = 4, rows: int = 6, first_b: int = 2):
    """Capture :class:`LateBranch` into ``path``: ``n_forwards`` forwards of ``rows`` samples
    (labels 0/1 alternating), ``b`` called from forward ``first_b`` on.

    Returns (model, inputs): ``a.output`` rows are ``model.a(x)`` of each input ``x`` in turn,
    ``b.output`` rows ``model.b(model.a(x))`` of each of ``inputs[first_b:]`` (forward by forward:
    a matmul's last bits depend on the batch).
    """
    import warnings

    import activationscope as acs

    model = LateBranch()
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(rows, 4, generator=g) for _ in range(n_forwards)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", acs.CaptureWarning)
        with torch.no_grad(), acs.ActivationScope(store=path).track(model) as tracker:
            for i, x in enumerate(xs):
                ids = list(range(i * rows, (i + 1) * rows))
                tracker.set_batch(sample_ids=ids, label=[s % 2 for s in ids])
                model(x, extra=i >= first_b)
    return model, xs


def store_three_batches(target, **options) -> torch.Tensor:
    """A complete store at ``target`` (a path or URL) of one array "0.output" of (8,) float32
    rows: 36 rows in three batches of 12, written with the StoreWriter ``options`` (e.g.
    16-row shards: shards 0, 1 and a partial shard 2 of 4 rows). Returns the rows."""
    from activationscope.store import StoreWriter

    data = torch.randn(36, 8, generator=torch.Generator().manual_seed(0))
    w = StoreWriter(target, **options)
    a = w.open_array("0.output", (8,), torch.float32, "sample")
    for s in range(0, 36, 12):
        a.append(data[s:s + 12])
        w.add_batch(12)
    w.close()
    return data


def set_reduction_state(path, name, key, value, hook_point: str = "0.output") -> None:
    """Replace one state array of reduction ``name`` of ``hook_point`` in the store (or rank
    store) at ``path``, checksums and all: a store damaged or made by someone else that
    verify() finds nothing wrong with."""
    import json

    from activationscope.store import _format as F

    root_file = path / "zarr.json"
    root = json.loads(root_file.read_text())
    entries = root["attributes"]["activationscope"]["reductions"][hook_point]
    entry = next(e for e in entries.values() if e.get("reduction") == name and "state" in e)["state"][key]
    doc = json.loads((path / entry["path"] / "zarr.json").read_text())
    assert doc["shape"] == list(value.shape)
    (chunk,) = entry["crc32c"]
    data = value.contiguous().numpy().tobytes()
    (path / chunk).write_bytes(data)
    entry["crc32c"] = {chunk: F.crc32c(data)}
    root_file.write_text(json.dumps(root))


def write_rows(path, data, hook_point="x", *, resume=False, compression=None):
    """A store of one sample-row array ``hook_point`` holding ``data`` (rows, features):
    chunks of 8 rows, shards of 32, one batch (so 37 or 40 rows end inside a shard)."""
    from activationscope.store import StoreWriter

    w = StoreWriter(path, resume=resume, compression=compression, chunk_rows=8, shard_rows=32)
    a = w.open_array(hook_point, tuple(data.shape[1:]), data.dtype, "sample")
    a.append(data)
    w.add_batch(len(data))
    w.close()


def record_biggest_pread(monkeypatch) -> list:
    """Patch ``os.pread`` (undone with ``monkeypatch.undo()``) to note the largest read asked
    for: returns ``[n]``, updated as reads happen."""
    import os

    biggest = [0]
    pread = os.pread

    def recording(fd, n, offset):
        biggest[0] = max(biggest[0], n)
        return pread(fd, n, offset)

    monkeypatch.setattr(os, "pread", recording)
    return biggest
