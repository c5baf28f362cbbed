"""Small valid stores to damage (hostile-store and fuzz tests), and helpers to edit them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import torch

import activationscope as acs
from activationscope.store import StoreWriter

HERE = Path(__file__).parent
ROOT = HERE.parents[1]

HP = "0.output"
N_ROWS = 320
FEATURE = 8  # float32: 32-byte rows
CHUNK_ROWS = 16
SHARD_ROWS = 64  # 4 chunks per shard: 5 shards


class _Mean:
    kind = "mean"

    def __init__(self, value: torch.Tensor) -> None:
        self.value = value

    def result(self) -> dict:
        return {"mean": self.value}


def make_store(path: Path, *, compression=None, n_rows: int = N_ROWS) -> torch.Tensor:
    """A ``0.output`` store of ``n_rows`` float32 rows (8 features), 64-row shards of 16-row chunks,
    batches of 32 samples with a ``label`` column, and a ``mean`` reduction. Returns the rows."""
    g = torch.Generator().manual_seed(0)
    data = torch.randn(n_rows, FEATURE, generator=g)
    w = StoreWriter(path, compression=compression, chunk_rows=CHUNK_ROWS, shard_bytes=SHARD_ROWS * FEATURE * 4)
    a = w.open_array(HP, (FEATURE,), torch.float32, "sample")
    for s in range(0, n_rows, 32):
        e = min(n_rows, s + 32)
        a.append(data[s:e])
        w.add_batch(e - s, list(range(s, e)), None, {"label": torch.arange(s, e) % 3})
        w.commit()
    w.add_reductions(HP, "mean", _Mean(data.double().mean(0)))
    w.close()
    return data


def shard(path: Path, k: int) -> Path:
    return path / "acts" / HP / "c" / str(k) / "0"


def root(path: Path) -> dict:
    return json.loads((path / "zarr.json").read_text())


def edit_root(path: Path, fn) -> None:
    """Apply ``fn`` to the root document's ``activationscope`` attributes and write it back."""
    doc = json.loads((path / "zarr.json").read_text())
    fn(doc["attributes"]["activationscope"])
    (path / "zarr.json").write_text(json.dumps(doc))


def set_index(path: Path, k: int, slot: int, offset: int, nbytes: int, n_chunks: int = SHARD_ROWS // CHUNK_ROWS) -> None:
    """Rewrite one entry of shard ``k``'s index, with a valid index crc32c."""
    import google_crc32c

    p = shard(path, k)
    data = bytearray(p.read_bytes())
    ib = 16 * n_chunks + 4
    index = np.frombuffer(bytes(data[-ib:-4]), dtype="<u8").copy().reshape(-1, 2)
    index[slot] = (offset, nbytes)
    raw = index.astype("<u8").tobytes()
    data[-ib:] = raw + int(google_crc32c.value(raw)).to_bytes(4, "little")
    p.write_bytes(bytes(data))


_HIDE_NATIVE = "import sys\nsys.modules['activationscope._C'] = None  # the extension is absent: its import fails\n"


def run_python(code: str, *args: str, native: bool = True, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run ``code`` (dedented) in a fresh interpreter with the repository and this folder on
    its path; ``native=False`` hides the compiled extension first (a machine without our
    build, or one built for another torch). Returns the finished process (text output)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(HERE), os.environ.get("PYTHONPATH", "")]))
    code = textwrap.dedent(code)
    if not native:
        code = _HIDE_NATIVE + code
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env,
                          timeout=timeout)


class FailsAt(torch.nn.Module):
    """A linear layer whose forward ``fail_at`` (0-based) raises."""

    def __init__(self, fail_at: int) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(FEATURE, 4)
        self.fail_at, self.calls = fail_at, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls - 1 == self.fail_at:
            raise RuntimeError(f"forward {self.fail_at} fails")
        return self.lin(x)


def overwrite_capture(path: Path, model: torch.nn.Module, n_batches: int) -> None:
    """``n_batches`` forwards of ``model`` (8 rows of FEATURE) into ``path`` with overwrite=True."""
    scope = acs.ActivationScope(store=str(path), store_options={"overwrite": True})
    with scope.track(model, include=["lin"]) as tracker, torch.no_grad():
        for _ in range(n_batches):
            tracker.set_batch()
            model(torch.randn(8, FEATURE))
