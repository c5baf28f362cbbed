"""Small models shared by the tests (import as `from acs_testing import ...`)."""

from __future__ import annotations

import inspect
import linecache
import shutil
import sys
import threading
import weakref
from typing import Optional

import torch


def toy_mlp(width: int = 16, depth: int = 3) -> torch.nn.Module:
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers)


class MLP(torch.nn.Module):
    """``fc1`` (8 -> 16), ``act`` (ReLU), ``fc2`` (16 -> 4): modules named as wrapped models name theirs."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16)
        self.act = torch.nn.ReLU()
        self.fc2 = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


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


class SumRows(torch.nn.Module):
    """A mergeable custom reduction (script it): the float64 sum of the rows."""

    def forward(self, acc: Optional[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        s = x.double().sum(0)
        return s if acc is None else acc + s

    @torch.jit.export
    def merge(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a + b


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


def write_batches(target, t, *, batch: int = 7, **options) -> None:
    """A store of one sample-row array ``x`` holding ``t`` (rows, features), written
    ``batch`` rows per commit (sample ids 0, 1, ...); ``options`` go to the StoreWriter
    (compression, chunk_rows, shard_rows, ...)."""
    from activationscope.store import StoreWriter

    w = StoreWriter(target, capture_config={}, model=None, storage_dtype=None, **options)
    arr = w.open_array("x", tuple(t.shape[1:]), t.dtype, "sample")
    for s in range(0, t.shape[0], batch):
        e = min(t.shape[0], s + batch)
        arr.append(t[s:e])
        w.add_batch(e - s, list(range(s, e)), None, {})
        w.commit()
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


def store_target(request, where: str, prefix: str = "race", bucket: str = "acs-bucket") -> tuple[str, dict | None]:
    """(path or URL of a new store, its storage_options): on S3 (``where="s3"``: the moto
    server of the ``s3`` fixture, in ``bucket``), in a local folder (``"local"``, under
    ``tmp_path``) or in fsspec memory (``"memory"``); named ``<prefix>-<hex>.zarr``."""
    import uuid

    name = f"{prefix}-{uuid.uuid4().hex}.zarr"
    if where == "s3":
        return f"s3://{bucket}/{name}", request.getfixturevalue("s3")
    if where == "local":
        return str(request.getfixturevalue("tmp_path") / name), None
    return f"memory://acs/{name}", None


_KILLED_FOLDERS: list[str] = []  # made by die_at, removed by remove_killed_folders
_RMTREE = shutil.rmtree  # (die_at replaces shutil.rmtree while it is in force)


def remove_killed_folders() -> None:
    """Remove the temporary folders :func:`die_at` made (conftest: after each test)."""
    while _KILLED_FOLDERS:
        _RMTREE(_KILLED_FOLDERS.pop(), ignore_errors=True)


class Killed(BaseException):
    """Stands for a process dying (nothing of it runs after it): raised by :func:`die_at`."""


def die_at(monkeypatch, step: int) -> list:
    """Make the ``step``-th write or delete of a store object (the writer lock excluded) raise
    :class:`Killed` before it happens: on object storage and in fsspec memory ``set`` and
    ``delete``; in a local folder ``set``, the removal of a file and of a folder (one killed
    partway through a folder first removes every other file of it, as a death mid-way would).
    Returns the operations made before it, ``("set" | "delete", key or path)``, in order;
    ``monkeypatch.undo()`` ends it."""
    import shutil
    import tempfile
    from pathlib import Path

    from activationscope.store import _backend as B

    # (the temporary folders of a writer that "dies" here, such as a remote store's staging
    # folder, go in one removed when the test ends: conftest's remove_killed_folders)
    tmp = tempfile.mkdtemp(prefix="acs-killed-")
    _KILLED_FOLDERS.append(tmp)
    monkeypatch.setattr(tempfile, "tempdir", tmp)
    done: list = []

    def wrap(fn, what):
        def run(*args, **kwargs):
            key = str(args[-1]) if what != "set" else args[1]
            if not key.endswith(B.LOCK_KEY):
                if len(done) == step:
                    if what == "rmtree":
                        for p in sorted(p for p in Path(key).rglob("*") if p.is_file())[::2]:
                            p.unlink()
                    raise Killed
                done.append(("delete" if what == "rmtree" else what, key))
            return fn(*args, **kwargs)
        return run

    monkeypatch.setattr(B.ZarrBackend, "set", wrap(B.ZarrBackend.set, "set"))
    monkeypatch.setattr(B.ZarrBackend, "delete", wrap(B.ZarrBackend.delete, "delete"))
    monkeypatch.setattr(B.LocalBackend, "set", wrap(B.LocalBackend.set, "set"))
    monkeypatch.setattr(B.shutil, "rmtree", wrap(shutil.rmtree, "rmtree"))
    monkeypatch.setattr(B.Path, "unlink", wrap(Path.unlink, "delete"))
    return done


_DIE_AT_DELETE = """\
import os as _os, shutil as _shutil
from activationscope.store import _backend as _B

_n_deletes = [0]

def _dying(fn):
    def run(*args, **kwargs):
        if not str(args[-1]).endswith(_B.LOCK_KEY):
            _n_deletes[0] += 1
            if _n_deletes[0] == {at}:
                _os._exit(9)  # killed before this delete, as the kernel would kill it
        return fn(*args, **kwargs)
    return run

_B.ZarrBackend.delete = _dying(_B.ZarrBackend.delete)
_B.shutil.rmtree = _dying(_shutil.rmtree)
"""


def run_killed_at_delete(code: str, at: int, *args: str, path=(), timeout: float = 300):
    """Run the script ``code`` (``sys.argv[1:]`` is ``args``) in a fresh interpreter that dies
    (``os._exit(9)``: no ``finally``, no lock released, as a kill) right before its ``at``-th
    delete of a store object (1: the first; the writer lock excluded): on object storage and in
    fsspec memory ``ZarrBackend.delete``, in a local folder the removal of a top-level folder
    (``shutil.rmtree``). The repository, this folder (``tests``) and the folders in ``path`` are
    on its import path.

    Fails the test, with the script's output, when the script does not die there."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    here = Path(__file__).resolve().parent  # (this module's folder: a script may import it)
    import shutil
    import tempfile

    # (its temporary folders, which its death leaves behind, go in one removed after it)
    tmp = tempfile.mkdtemp(prefix="acs-killed-")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(here.parent), str(here), *map(str, path)]),
           "TMPDIR": tmp}
    try:
        done = subprocess.run([sys.executable, "-c", _DIE_AT_DELETE.format(at=int(at)) + code, *args], env=env,
                              capture_output=True, text=True, timeout=timeout)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    assert done.returncode == 9, f"the script was to die at its delete {at}, it ended with {done.returncode}:\n" \
                                 f"{done.stdout}\n{done.stderr}"


def hold_aside_delete(monkeypatch) -> tuple[threading.Event, threading.Event]:
    """Hold every background delete of a replaced store's folder (``writer._delete_aside``)
    until the first event is set (30 s at most); the second is set when one starts."""
    from activationscope.store import writer as W

    go, started = threading.Event(), threading.Event()
    delete = W._delete_aside

    def held(p):
        started.set()
        go.wait(30)  # (bounded: the test sets it)
        return delete(p)

    monkeypatch.setattr(W, "_delete_aside", held)
    return go, started


def count_store_reads(monkeypatch) -> dict:
    """Count, from now on, ``"opens"``: the stores made (``Store(...)``, through ``open_store``
    or a writer's own reader), and ``"row_tables"``: ``(kind, columns)`` of each
    ``Store.row_table`` call (``columns`` None: every column)."""
    from activationscope.store import reader

    counts: dict = {"opens": 0, "row_tables": []}
    init, row_table = reader.Store.__init__, reader.Store.row_table

    def counted_init(self, *args, **kwargs):
        counts["opens"] += 1
        return init(self, *args, **kwargs)

    def counted_row_table(self, kind="sample", columns=None, **kwargs):
        counts["row_tables"].append((kind, None if columns is None else list(columns)))
        return row_table(self, kind, columns, **kwargs) if columns is not None else row_table(self, kind, **kwargs)

    monkeypatch.setattr(reader.Store, "__init__", counted_init)
    monkeypatch.setattr(reader.Store, "row_table", counted_row_table)
    return counts


def wait_for_child(pid: int, timeout: float, what: str) -> int:
    """The exit code of the forked child ``pid``, waited for at most ``timeout`` seconds; past
    that it is killed and the test fails with ``what`` (a child that hangs fails, never hangs)."""
    import os
    import signal
    import time

    import pytest

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    pytest.fail(what)



def run_as_other_user(fn) -> tuple[str, str]:
    """Run ``fn()`` in a forked child (user nobody, 65534, when this process is root); returns
    (error type name, message) of what it raised, ("", "") when it returned. Everything ``fn``
    imports must be imported already (the interpreter's own files may be unreadable to nobody)."""
    import os

    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        os.close(r)
        torch.set_num_threads(1)  # (torch's OpenMP pool does not survive a fork: a parallel op would hang)
        out = b""
        try:
            if hasattr(os, "geteuid") and os.geteuid() == 0:
                os.setgid(65534)
                os.setuid(65534)
                # (multiprocessing's temporary folder, made by this process as root once an earlier
                # test shared a tensor through torch.multiprocessing, is closed to nobody: the
                # DataLoader workers' sockets go into one of its own)
                import multiprocessing.process

                multiprocessing.process.current_process()._config.pop("tempdir", None)
            fn()
        except BaseException as e:  # noqa: BLE001 (reported to the parent)
            out = f"{type(e).__name__}\n{e}".encode()
        os.write(w, out)
        os._exit(0)
    os.close(w)
    # (waited for first, bounded: a child that hangs fails the test; its message fits in the pipe)
    wait_for_child(pid, 120, "the child acting as another user did not end")
    with os.fdopen(r, "rb") as f:
        got = f.read().decode()
    name, _, msg = got.partition("\n")
    return name, msg

def _before_try(fn) -> tuple:
    """The code of ``fn`` and the numbers of its lines up to its first ``try:``."""
    lines, first = inspect.getsourcelines(fn)
    n = next(i for i, line in enumerate(lines) if line.strip() == "try:")
    return fn.__code__, frozenset(range(first, first + n + 1))


def _unguarded() -> dict:
    if not _UNGUARDED:
        import activationscope as acs

        _UNGUARDED.update(_before_try(f) for f in (acs.Tracker.__enter__, acs.Tracker.__exit__))
    return _UNGUARDED


_UNGUARDED: dict = {}  # {code: line numbers} where InterruptAt raises nothing


def _run_by_finalize(frame) -> bool:
    caller = frame.f_back
    return caller is not None and caller.f_code is weakref.finalize.__call__.__code__


class InterruptAt:
    """Raise KeyboardInterrupt at the ``at``-th line run in activationscope's code (1: the first),
    as a signal delivered there would (Ctrl-C in a notebook), in this thread; ``at=None`` counts
    the lines only (``n``). ``where``: the function and line it was raised at."""

    def __init__(self, at: int | None) -> None:
        self.at, self.n, self.where = at, 0, None

    def __enter__(self) -> "InterruptAt":
        sys.settrace(self._call)
        return self

    def __exit__(self, *exc) -> None:
        sys.settrace(None)

    def _call(self, frame, event, arg):
        # (not in a __del__ nor a weakref.finalize callback: one raised there is printed and
        # ignored, as a signal delivered there is, and when the garbage collector runs them
        # varies from run to run)
        return self._line if f"activationscope{'/'}" in frame.f_code.co_filename.replace("\\", "/") \
            and frame.f_code.co_name != "__del__" and not _run_by_finalize(frame) else None

    def _line(self, frame, event, arg):
        # Not at the line of a `with` statement (the event there also comes before its __exit__
        # call) or of a `try:` (one raised there skips the handlers around it): no signal is
        # delivered at either. Nor at the lines of the tracker's __enter__ / __exit__ before their
        # `try:`: a signal delivered there, as the `with` statement calls them, is out of any
        # code's reach (Python's own limit)
        if event == "line" and frame.f_lineno not in _unguarded().get(frame.f_code, ()) and not linecache.getline(
                frame.f_code.co_filename, frame.f_lineno).lstrip().startswith(("with ", "async with ", "try:")):
            self.n += 1
            if self.n == self.at:
                self.where = f"{frame.f_code.co_name}:{frame.f_lineno}"
                raise KeyboardInterrupt(self.where)
        return self._line


def log_sum(acc: Optional[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """A custom reduction (TorchScript-able): the sum of log(x) per feature, float64; makes
    -inf of a 0 among finite rows."""
    s = x.double().log().sum(0)
    return s if acc is None else acc + s


def log_sum_in_place(acc: Optional[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """:func:`log_sum` updating its accumulator in place."""
    s = x.double().log().sum(0)
    if acc is None:
        return s
    acc += s
    return acc


_LOG_SUM_SCALE = 1.0  # a global Python float: TorchScript refuses it, so log_sum_eager runs eagerly


def log_sum_eager(acc, x):
    """:func:`log_sum` that TorchScript cannot compile (runs as eager Python)."""
    s = x.double().log().sum(0) * _LOG_SUM_SCALE
    return s if acc is None else acc + s


def plain_hooks(model, run, names=None, *, side: str = "output", structured: str = "skip", clone: bool = True,
                to=None, grad: bool = False) -> tuple[dict[str, list[torch.Tensor]], object]:
    """What plain PyTorch forward hooks (no activationscope) see while ``run()`` runs: the
    reference a capture is compared with. Returns ``({hook point: [Tensor per call]}, run())``.

    ``names``: the module paths hooked (default: every submodule, the root left out; ``""`` is
    the root, whose hook points are ``output`` and ``input.<i>``). ``side``: ``"output"``,
    ``"input"`` (the positional arguments, ``<name>.input.<i>``, taken before the forward) or
    ``"both"``. ``structured``, what a value that is no tensor gives: ``"skip"`` nothing (an
    input that is no tensor neither); ``"first"`` an output that is no tensor (a tuple, a
    ``ModelOutput``) its first element ``out[0]``, as ``<name>.output``; ``"leaves"`` each
    tensor of nested tuples and lists, ``<name>.output.<i>`` (``.<j>`` deeper), inputs alike.
    Each tensor is detached and cloned at the call (``clone`` False: kept as it is), then given
    to ``.to(to)`` when ``to`` is a dtype or device.
    ``run()`` runs under ``torch.no_grad()`` unless ``grad``; the hooks are removed after it.
    """
    records: dict[str, list[torch.Tensor]] = {}

    def keep(key, value):
        if isinstance(value, torch.Tensor):
            value = value.detach().clone() if clone else value
            records.setdefault(key, []).append(value if to is None else value.to(to))
        elif structured == "leaves" and isinstance(value, (tuple, list)):
            for i, item in enumerate(value):
                keep(f"{key}.{i}", item)

    def hooks(name):
        prefix = f"{name}." if name else ""

        def pre(module, args):
            for i, a in enumerate(args):
                keep(f"{prefix}input.{i}", a)

        def post(module, args, out):
            if structured == "first" and not isinstance(out, torch.Tensor):
                out = out[0]
            keep(f"{prefix}output", out)

        return pre, post

    handles = []
    try:
        for name in names if names is not None else [n for n, _ in model.named_modules() if n]:
            module = model.get_submodule(name)
            pre, post = hooks(name)
            if side in ("input", "both"):
                handles.append(module.register_forward_pre_hook(pre))
            if side in ("output", "both"):
                handles.append(module.register_forward_hook(post))
        if grad:
            result = run()
        else:
            with torch.no_grad():
                result = run()
    finally:
        for h in handles:
            h.remove()
    return records, result
