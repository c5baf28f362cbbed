"""Child process of the store fuzz test: mutates copies of small valid stores and reads them.

python fuzz_child.py SANDBOX SECONDS SEED

SANDBOX holds ``plain.zarr`` and ``zstd.zarr`` (valid stores) and ``outside/`` (files no
store may touch). For SECONDS, each case copies a store to ``SANDBOX/cases/<i>.zarr``, applies
one random mutation (bytes, JSON fields, file kinds, paths) and runs every read path plus a
resumed writer on it. Prints ``case <i> <mutation>`` before and ``ok <i> <outcome>`` after
each case; a failure that is not one of our errors prints ``FAIL <i> <traceback>`` and exits 1.
The address space is capped (RLIMIT_AS) after the imports: an allocation that metadata
inflates fails instead of filling the machine.
"""

from __future__ import annotations

import json
import os
import random
import resource
import shutil
import sys
import time
import traceback
from pathlib import Path

import torch

from activationscope.data import ActivationDataset
from activationscope.errors import ActivationScopeError
from activationscope.store import StoreWriter, open_store

from hostile import FEATURE, HP

VALUES = [None, True, False, 0, -1, 1, 3, 2**31, 2**40, 2**63, 2**64 + 5, -(2**63), 1.5, float(1e308), "", "x",
          "../x", "../../outside/victim", "/etc/passwd", "acts/../../outside", "rows/sample/../../../outside/victim",
          "reductions/../../outside/victim.pt", [], [1], [2**40], [-1], [0, 0], {}, {"name": "zstd"},
          {"name": "lzma", "configuration": {}}, "float128", "token", "sample", [[[[[]]]]]]


def _json_paths(node, prefix=()):
    yield prefix
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _json_paths(v, prefix + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _json_paths(v, prefix + (i,))


def _set(doc, path, value, delete=False):
    node = doc
    for k in path[:-1]:
        node = node[k]
    if delete and isinstance(node, dict):
        node.pop(path[-1], None)
    else:
        node[path[-1]] = value


def mutate(store: Path, outside: Path, rng: random.Random) -> str:
    files = sorted(p for p in store.rglob("*") if p.is_file() and not p.name.startswith("."))
    kind = rng.choice(["bytes", "bytes", "json", "json", "json", "kind", "path"])
    f = rng.choice(files)
    rel = f.relative_to(store)
    if kind == "bytes":
        data = bytearray(f.read_bytes())
        how = rng.choice(["flip", "truncate", "append", "zero"])
        if how == "flip" and data:
            for _ in range(rng.randint(1, 8)):
                data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        elif how == "truncate":
            data = data[: rng.randrange(len(data) + 1)]
        elif how == "append":
            data += bytes(rng.randrange(256) for _ in range(rng.randint(1, 64)))
        elif data:
            a = rng.randrange(len(data))
            data[a:a + rng.randint(1, 64)] = b"\0" * len(data[a:a + 64])
        f.write_bytes(bytes(data))
        return f"bytes {how} {rel}"
    if kind in ("json", "path"):
        jsons = [p for p in files if p.name.endswith(".json")]
        f = rng.choice(jsons) if kind == "json" else store / "zarr.json"
        rel = f.relative_to(store)
        doc = json.loads(f.read_text())
        paths = [p for p in _json_paths(doc) if p]
        if kind == "path":
            paths = [p for p in paths if p[-1] in ("path", "manifest", "script", "parts") or
                     (len(p) > 1 and p[-2] in ("parts", "crc32c"))] or paths
        p = rng.choice(paths)
        if rng.random() < 0.15:
            _set(doc, p, None, delete=True)
            what = f"delete {p}"
        else:
            v = rng.choice(VALUES)
            if kind == "path" and isinstance(v, (int, float)) and rng.random() < 0.7:
                v = rng.choice([x for x in VALUES if isinstance(x, str)])
            _set(doc, p, v)
            what = f"set {p} = {v!r}"
        f.write_text(json.dumps(doc))
        return f"json {rel} {what}"
    # file kinds
    how = rng.choice(["fifo", "dir", "link-outside", "link-dev-zero", "link-loop", "delete"])
    f.unlink()
    if how == "fifo":
        os.mkfifo(f)
    elif how == "dir":
        f.mkdir()
        (f / "inner").write_bytes(b"x")
    elif how == "link-outside":
        f.symlink_to(outside / "victim")
    elif how == "link-dev-zero":
        f.symlink_to("/dev/zero")
    elif how == "link-loop":
        f.symlink_to(f.name)
    return f"kind {how} {rel}"


def exercise(path: Path) -> str:
    """Every read path, then a resumed writer; returns how far it got."""
    s = open_store(path)
    s.info()
    s.verify()
    for hp in s.hook_points:
        n = s.n_rows(hp)
        s[hp].sum()
        s[hp, ::-3].sum()
        if n:
            s.rows(hp, n // 2, n).sum()
    for kind in ("sample", "token"):
        s.row_table(kind)
    for hp in s.reductions:
        for v in s.reductions[hp].values():
            v.sum()
    ds = ActivationDataset(path)
    if len(ds):
        ds[0:len(ds)]
    s.save(path.parent / (path.name + ".copy"))
    w = StoreWriter(path, resume=True)
    try:
        w.open_array(HP, (FEATURE,), torch.float32, "sample")
    finally:
        w.close()
    open_store(path)[HP].sum()
    return "read"


def main() -> None:
    sandbox, seconds, seed = Path(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
    rng = random.Random(seed)
    with open("/proc/self/statm") as f:
        vm_bytes = int(f.read().split()[0]) * resource.getpagesize()
    cap = vm_bytes + (3 << 30)
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    cases = sandbox / "cases"
    cases.mkdir()
    end = time.monotonic() + seconds
    i = 0
    while time.monotonic() < end:
        src = sandbox / rng.choice(["plain.zarr", "zstd.zarr"])
        dst = cases / f"{i}.zarr"
        shutil.copytree(src, dst, symlinks=True)
        what = mutate(dst, sandbox / "outside", rng)
        print(f"case {i} {what}", flush=True)
        try:
            outcome = exercise(dst)
        except ActivationScopeError as e:
            outcome = type(e).__name__
        except BaseException:  # noqa: BLE001 - anything else is a finding
            print(f"FAIL {i} {what}\n{traceback.format_exc()}", flush=True)
            sys.exit(1)
        print(f"ok {i} {outcome}", flush=True)
        i += 1
    print(f"done {i}", flush=True)


if __name__ == "__main__":
    main()
