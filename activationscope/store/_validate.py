"""Validation of everything read from a store, before it is used (FORMAT.md §9).

A store may come from someone else: every key, size, shape and count taken from its
metadata is checked here, with plain Python ints (no overflow), before a file is opened,
a byte is allocated or anything is deleted. A violation raises :class:`StoreCorruptError`
naming the file, the field, what is wrong and the fix. Pure: no I/O, except the manifest
segments a :class:`Manifest` reads, when asked for their records, through the backend (or the
function) it was given.
"""

from __future__ import annotations

import bisect
import json
import math
import re
from collections.abc import Mapping
from typing import Any, Callable, Iterable, Iterator

from .._safeio import (FIX, MAX_FILE_BYTES, MAX_JSON_BYTES, corrupt, required_columns,  # noqa: F401 - re-exported
                       row_part_problem)
from ..errors import StoreCorruptError, StoreError
from . import _format as F

#: Bounds of the numbers of the metadata (each far above any real capture).
MAX_ROWS = 1 << 48
MAX_FEATURE_DIMS = 32
MAX_ROW_BYTES = 1 << 34
MAX_CHUNK_BYTES = 1 << 34
MAX_SHARD_CHUNKS = 1 << 20
MAX_REDUCTION_BYTES = 1 << 34
MAX_NAME_CHARS = 4096


_PART = re.compile(r"rows/(sample|token)/[^/]+")


def check_key(key: Any, *, store: Any, what: str, under: str | None = None) -> str:
    """A relative key of the store: ``/``-separated names, none empty, ``.`` or ``..``.

    Raises
    ------
    StoreCorruptError
        Not a str, absolute, a backslash, a NUL, an empty / ``.`` / ``..`` component, or not
        under ``under/``.
    """
    ok = (isinstance(key, str) and 0 < len(key) <= MAX_NAME_CHARS and "\\" not in key and "\x00" not in key
          and not key.startswith("/") and all(p not in ("", ".", "..") for p in key.split("/")))
    if ok and under is not None:
        ok = key.startswith(under.rstrip("/") + "/")
    if not ok:
        where = f" under {under!r}" if under else ""
        raise corrupt(store, f"{what} must be a relative path inside the store{where} (no '..', no absolute path), "
                             f"got {key!r}")
    return key


def loads_json(raw: bytes, *, store: Any, key: str) -> Any:
    """Parse a JSON document of the store; a damaged one raises :class:`StoreCorruptError` naming it."""
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise corrupt(store, f"{key} is not valid JSON ({type(e).__name__}: {e})") from None


def _int(v: Any, lo: int, hi: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def field_message(key: str, field: str, constraint: str, got: Any) -> str:
    """``"<key> field <field> must be <constraint>, got <got!r>"`` (a long value cut at 200 characters)."""
    r = repr(got)
    if len(r) > 200:
        r = r[:200] + "..."
    return f"{key} field {field} must be {constraint}, got {r}"


class _Checker:
    def __init__(self, store: Any, key: str) -> None:
        self.store, self.key = store, key

    def fail(self, field: str, constraint: str, got: Any) -> StoreCorruptError:
        return corrupt(self.store, field_message(self.key, field, constraint, got))

    def int(self, d: dict, name: str, field: str, lo: int = 0, hi: int = MAX_ROWS, default: Any = ...) -> int:
        v = d.get(name, default)
        if v is ... or not _int(v, lo, hi):
            raise self.fail(field, f"an int in {lo}..{hi}", d.get(name))
        return v

    def dict(self, v: Any, field: str, optional: bool = False) -> dict:
        if v is None and optional:
            return {}
        if not isinstance(v, dict):
            raise self.fail(field, "a JSON object", v)
        return v

    def keyed(self, v: Any, field: str, under: str | None = None) -> str:
        return check_key(v, store=self.store, what=f"{self.key} field {field}", under=under)

    def crcs(self, v: Any, field: str, under: str) -> dict:
        d = self.dict(v, field, optional=True)
        for k, c in d.items():
            self.keyed(k, f"{field} key", under)
            if not _int(c, 0, (1 << 32) - 1):
                raise self.fail(f"{field}[{k!r}]", "a crc32c (an int in 0..2**32-1)", c)
        return d


def check_format(attrs: dict, *, store: Any, key: str = "zarr.json") -> None:
    """Check ``format``: name ``activationscope``, an int version 1..FORMAT_VERSION.

    Raises
    ------
    StoreError
        A newer version (upgrade activationscope).
    StoreCorruptError
        Another name, or a version that is not a positive int.
    """
    c = _Checker(store, key)
    fmt = attrs.get("format")
    if not isinstance(fmt, dict) or fmt.get("name") != F.FORMAT_NAME:
        raise c.fail("format", f"{{'name': {F.FORMAT_NAME!r}, 'version': <int>}}", fmt)
    v = fmt.get("version")
    if not _int(v, 1, 1 << 31):
        raise c.fail("format.version", "a positive int", v)
    if v > F.MAX_READ_VERSION:
        raise StoreError(
            f"store {str(store)!r} has format version {v}; this activationscope reads versions up to "
            f"{F.MAX_READ_VERSION}: upgrade activationscope"
        )


def row_bytes(meta: dict) -> int:
    return math.prod(meta["feature_shape"]) * F.itemsize(meta["dtype"])


def _check_rows_meta(meta: dict, f: str, c: _Checker) -> int:
    """``row_kind``, ``dtype``, ``feature_shape`` and ``n_rows`` of the entry ``f`` (an array's,
    or a hook point's of ``reduced``), checked; returns the bytes of one row."""
    if meta.get("row_kind") not in ("sample", "token"):
        raise c.fail(f"{f}.row_kind", "one of ['sample', 'token']", meta.get("row_kind"))
    if meta.get("dtype") not in F.SUPPORTED_DTYPES:
        raise c.fail(f"{f}.dtype", f"one of {list(F.SUPPORTED_DTYPES)}", meta.get("dtype"))
    feat = meta.get("feature_shape")
    if (not isinstance(feat, list) or len(feat) > MAX_FEATURE_DIMS
            or not all(_int(d, 0, MAX_ROW_BYTES) for d in feat)):
        raise c.fail(f"{f}.feature_shape", f"a list of at most {MAX_FEATURE_DIMS} non-negative ints", feat)
    rb = row_bytes(meta)
    if rb > MAX_ROW_BYTES:
        raise c.fail(f"{f}.feature_shape", f"rows of at most {MAX_ROW_BYTES} bytes", feat)
    c.int(meta, "n_rows", f"{f}.n_rows")
    return rb


def check_array_entry(hp: str, meta: Any, c: _Checker) -> None:
    f = f"arrays[{hp!r}]"
    c.dict(meta, f)
    c.keyed(meta.get("path"), f"{f}.path", "acts")
    c.keyed(meta.get("manifest"), f"{f}.manifest", "acts")
    rb = _check_rows_meta(meta, f, c)
    chunk_rows = c.int(meta, "chunk_rows", f"{f}.chunk_rows", 1, MAX_ROWS)
    shard_rows = c.int(meta, "shard_rows", f"{f}.shard_rows", 1, MAX_ROWS)
    if shard_rows % chunk_rows or shard_rows // chunk_rows > MAX_SHARD_CHUNKS:
        raise c.fail(f"{f}.shard_rows", f"a multiple (at most {MAX_SHARD_CHUNKS}x) of chunk_rows={chunk_rows}", shard_rows)
    if max(1, rb) * chunk_rows > MAX_CHUNK_BYTES:
        raise c.fail(f"{f}.chunk_rows", f"chunks of at most {MAX_CHUNK_BYTES} bytes", chunk_rows)
    check_codec(meta.get("compression"), f"{f}.compression", c)
    if "follows_row_table" in meta and not isinstance(meta["follows_row_table"], bool):
        raise c.fail(f"{f}.follows_row_table", "a bool", meta["follows_row_table"])
    if "storage_dtype" in meta and meta["storage_dtype"] != F.zarr_dtype(meta["dtype"]):
        raise c.fail(f"{f}.storage_dtype", repr(F.zarr_dtype(meta["dtype"])), meta["storage_dtype"])


#: Fields of a codec's ``configuration``: {name: (constraint, check)} per codec (FORMAT.md §9).
#: zstd levels as numcodecs takes them (negative: the fast levels); blosc as c-blosc takes them.
_CODEC_FIELDS: dict[str, dict[str, tuple[str, Any]]] = {
    "zstd": {
        "level": (f"an int in {-(1 << 17)}..{F.ZSTD_LEVELS[1]}", lambda v: _int(v, -(1 << 17), F.ZSTD_LEVELS[1])),
        "checksum": ("a bool", lambda v: isinstance(v, bool)),
    },
    "blosc": {
        "cname": ("one of ['blosclz', 'lz4', 'lz4hc', 'zlib', 'zstd']",
                  lambda v: v in ("blosclz", "lz4", "lz4hc", "zlib", "zstd")),
        "clevel": (f"an int in {F.BLOSC_CLEVELS[0]}..{F.BLOSC_CLEVELS[1]}", lambda v: _int(v, *F.BLOSC_CLEVELS)),
        "shuffle": ("one of ['noshuffle', 'shuffle', 'bitshuffle']",
                    lambda v: v in ("noshuffle", "shuffle", "bitshuffle")),
        "blocksize": (f"an int in 0..{(1 << 31) - 1}", lambda v: _int(v, 0, (1 << 31) - 1)),
        "typesize": ("an int in 1..255", lambda v: _int(v, 1, 255)),
    },
}


def check_codec(comp: Any, field: str, c: _Checker) -> None:
    """A compression codec document: null, or ``{"name": "zstd" | "blosc", "configuration":
    {...}}`` whose every field is known and of the right type and range (it configures the
    decoder, and a resumed writer's encoder)."""
    if comp is None:
        return
    if not isinstance(comp, dict) or not isinstance(comp.get("name"), str) or comp["name"] not in _CODEC_FIELDS:
        raise c.fail(field, "null or a zstd / blosc codec document", comp)
    extra = sorted(set(comp) - {"name", "configuration"}, key=str)
    if extra:
        raise c.fail(field, "a codec document with the keys name and configuration only", f"also {extra}")
    conf = comp.get("configuration", {})
    if not isinstance(conf, dict):
        raise c.fail(f"{field}.configuration", "a JSON object", conf)
    known = _CODEC_FIELDS[comp["name"]]
    for key, value in conf.items():
        if key not in known:
            raise c.fail(f"{field}.configuration", f"a {comp['name']} configuration with fields among {sorted(known)}",
                         f"the unknown field {key!r}")
        constraint, ok = known[key]
        if not ok(value):
            raise c.fail(f"{field}.configuration.{key}", constraint, value)


def check_reduction_entry(hp: str, name: str, e: Any, c: _Checker) -> None:
    f = f"reductions[{hp!r}][{name!r}]"
    c.dict(e, f)
    c.keyed(e.get("path"), f"{f}.path", "reductions")
    if e.get("dtype") not in F.SUPPORTED_DTYPES:
        raise c.fail(f"{f}.dtype", f"one of {list(F.SUPPORTED_DTYPES)}", e.get("dtype"))
    shape = e.get("shape")
    if not isinstance(shape, list) or len(shape) > MAX_FEATURE_DIMS or not all(_int(d, 0, MAX_REDUCTION_BYTES) for d in shape):
        raise c.fail(f"{f}.shape", f"a list of at most {MAX_FEATURE_DIMS} non-negative ints", shape)
    if math.prod(shape) * F.itemsize(e["dtype"]) > MAX_REDUCTION_BYTES:
        raise c.fail(f"{f}.shape", f"a result of at most {MAX_REDUCTION_BYTES} bytes", shape)
    if e.get("script") is not None:
        s = c.keyed(e["script"], f"{f}.script", "reductions")
        if not s.endswith(".pt"):
            raise c.fail(f"{f}.script", "a key ending in '.pt'", s)
    c.crcs(e.get("crc32c"), f"{f}.crc32c", "reductions")
    if "n_rows" in e:
        c.int(e, "n_rows", f"{f}.n_rows")
    if "options" in e:  # a built-in reduction's options (numbers): a resume, a commit and a report use them
        options = c.dict(e["options"], f"{f}.options")
        for key, value in options.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise c.fail(f"{f}.options[{key!r}]", "a finite number", value)
    for key, part in c.dict(e.get("state"), f"{f}.state", optional=True).items():
        g = f"{f}.state[{key!r}]"
        c.dict(part, g)
        c.keyed(part.get("path"), f"{g}.path", "reductions")
        if part.get("dtype") not in F.SUPPORTED_DTYPES:
            raise c.fail(f"{g}.dtype", f"one of {list(F.SUPPORTED_DTYPES)}", part.get("dtype"))
        pshape = part.get("shape")
        if not isinstance(pshape, list) or len(pshape) > MAX_FEATURE_DIMS or not all(
                _int(d, 0, MAX_REDUCTION_BYTES) for d in pshape):
            raise c.fail(f"{g}.shape", f"a list of at most {MAX_FEATURE_DIMS} non-negative ints", pshape)
        if math.prod(pshape) * F.itemsize(part["dtype"]) > MAX_REDUCTION_BYTES:
            raise c.fail(f"{g}.shape", f"a state of at most {MAX_REDUCTION_BYTES} bytes", pshape)
        c.crcs(part.get("crc32c"), f"{g}.crc32c", "reductions")


def _check_reduction_places(hp: str, name: str, e: dict, owners: dict[str, str], c: _Checker) -> None:
    """Each file of a reduction entry (its result, its state, its script) lies in its hook
    point's folder, ``reductions/<node>/`` (FORMAT.md section 1), and belongs to that entry
    alone: an entry naming another hook point's files (or another entry's) would be read as
    its own, the other's values under its name, with every crc32c matching."""
    f = f"reductions[{hp!r}][{name!r}]"
    folders = [f"reductions/{node}/" for node in F.node_names(hp)]  # (a long name's whole: an older store's)
    places = [(f"{f}.path", e["path"])]
    places += [(f"{f}.state[{key!r}].path", part["path"]) for key, part in (e.get("state") or {}).items()]
    if e.get("script") is not None:
        places.append((f"{f}.script", e["script"]))
    for field, path in places:
        if not path.startswith(tuple(folders)):
            raise c.fail(field, f"a key in the hook point's folder {folders[0]!r}"
                         + (f" (or {' or '.join(repr(x) for x in folders[1:])}, as stores written before its "
                            f"name was shortened or escaped)" if len(folders) > 1 else ""), path)
        if path in owners:
            raise c.fail(field, "unique", f"{path} (also the file of {owners[path]})")
        owners[path] = field


#: The built-in reductions (``capture.reductions.BUILTIN_REDUCTIONS``, made in
#: ``csrc/reductions_builtin.cpp``) and the options each takes besides ``per_feature``.
BUILTIN_OPTIONS: dict[str, tuple[str, ...]] = {
    "mean": (), "var": ("ddof",), "std": ("ddof",), "min": (), "max": (), "absmax": (), "l2": (), "nonzero": (),
    "hist": ("bins", "lo", "hi"), "cov": ("ddof",), "topk": ("k",),
}
#: The largest ``bins`` of ``hist`` and ``k`` of ``topk``.
MAX_BINS = MAX_TOPK = 1 << 24


def _whole(v: Any, lo: int, hi: int) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v == math.floor(v) \
        and lo <= v <= hi


def _builtin_option_problem(kind: str, options: dict) -> tuple[str, str, Any] | None:
    """``(option, constraint, value)`` of the first option of built-in ``kind`` that a
    reduction of that kind cannot be made with (``make_reduction`` refuses it), else None."""
    allowed = (*BUILTIN_OPTIONS[kind], "per_feature")
    for name, value in options.items():
        if name not in allowed:
            return name, f"absent (reduction {kind!r} has the options {list(allowed)})", value
    if options.get("per_feature", 1) not in (0, 1):
        return "per_feature", "0 or 1", options["per_feature"]
    if "ddof" in allowed and not _whole(options.get("ddof", 0), 0, MAX_ROWS):
        return "ddof", "a non-negative integer", options["ddof"]
    if kind == "topk" and not _whole(options.get("k", 10), 1, MAX_TOPK):
        return "k", f"an integer in 1..{MAX_TOPK}", options["k"]
    if kind == "hist":
        if not _whole(options.get("bins", 64), 1, MAX_BINS):
            return "bins", f"an integer in 1..{MAX_BINS}", options["bins"]
        if "lo" not in options or "hi" not in options:
            return "lo" if "lo" not in options else "hi", "present (the histogram range)", "no such option"
        lo, hi, bins = options["lo"], options["hi"], options.get("bins", 64)
        if not lo < hi:
            return "lo", f"below hi ({hi!r})", lo
        if not (math.isfinite(hi - lo) and math.isfinite(bins / (hi - lo))
                and (hi - lo) / bins >= 16 * math.ulp(max(abs(lo), abs(hi)))):
            return "hi", (f"such that hi - lo and bins / (hi - lo) are finite and each of the {int(bins)} bins is at "
                          f"least 16 float64 steps wide (lo={lo!r})"), hi
    return None


def _builtin_output_shape(kind: str, key: str, options: dict, feature_shape: list[int]) -> Any:
    """The shape of output ``key`` of built-in ``kind`` over rows of ``feature_shape``: a
    list, ``("topk", rest)`` for a ``topk`` output (``[n, *rest]``, ``1 <= n <= k``), or None
    when the reduction has no such output."""
    per = list(feature_shape) if options.get("per_feature", 1) else []
    n_features = math.prod(feature_shape) if options.get("per_feature", 1) else 1
    if key == "count":
        return []
    if kind in ("mean", "var", "std", "min", "max", "absmax", "l2", "nonzero"):
        own = {kind} | ({"mean"} if kind in ("var", "std") else set())
        return per if key in own else None
    if kind == "hist":
        bins = int(options.get("bins", 64))
        return {"counts": [*per, bins], "edges": [bins + 1], "underflow": per, "overflow": per, "nan": per}.get(key)
    if kind == "cov":
        return {"mean": per, "cov": [n_features, n_features]}.get(key)
    if kind == "topk":
        keys = ("values", "row_ids") + (() if options.get("per_feature", 1) else ("feature_ids",))
        return ("topk", per) if key in keys else None
    return None


#: The fix given with a reduction entry that breaks a rule of built-in reductions (FORMAT.md §9 rule 10).
REFUSED_REDUCTION_FIX = (
    "no built-in reduction writes such an entry (earlier versions' StoreWriter.add_reductions stored values of the "
    "writer's own under a built-in kind, or the store was edited): capture that reduction again into a new store "
    "(or capture the store again with overwrite=True); the store's arrays, row tables and other reductions "
    "read as usual (`activationscope verify STORE` lists every refused entry)"
)
#: The dtypes of every output and state array of a built-in reduction (FORMAT.md section 6).
BUILTIN_DTYPES = ("float64", "int64")


class _EntryProblem(Exception):
    """A per-entry rule of a built-in reduction broken (its message: :func:`field_message`)."""


class _EntryChecker(_Checker):
    def fail(self, field: str, constraint: str, got: Any) -> _EntryProblem:  # type: ignore[override]
        return _EntryProblem(field_message(self.key, field, constraint, got))


def _check_builtin_entry(hp: str, name: str, e: dict, kind: str, features: Any, options_of: dict[str, dict],
                         c: _EntryChecker) -> None:
    """The rules of FORMAT.md §9 rule 10 for one entry of built-in ``kind``; raises
    :class:`_EntryProblem` naming the first it breaks."""
    f = f"reductions[{hp!r}][{name!r}]"
    # the native reductions keep float64 values and int64 counts, ids and extrema of integer
    # rows: an output of another dtype (a bool "mean") is no value the reduction wrote
    arrays_of = [(f"{f}.dtype", e.get("dtype"))] + [
        (f"{f}.state[{k!r}].dtype", part.get("dtype")) for k, part in (e.get("state") or {}).items()
        if isinstance(part, dict)]
    for field, dtype in arrays_of:
        if dtype not in BUILTIN_DTYPES:
            raise c.fail(field, f"one of {list(BUILTIN_DTYPES)} (what the built-in reduction {kind!r} stores: "
                         "float64 values, int64 counts, ids and extrema of integer rows)", dtype)
    if "options" in e:
        bad = _builtin_option_problem(kind, e["options"])
        if bad is not None:
            option, constraint, value = bad
            raise c.fail(f"{f}.options[{option!r}]", f"{constraint} for the built-in reduction {kind!r}", value)
    red = e.get("reduction")
    if red is None:
        return  # which reduction (and output) it is is not recorded: nothing to compare
    if not isinstance(red, str) or not (name == red or name.startswith(red + ".")):
        raise c.fail(f"{f}.reduction", "the entry's name, or the part of it before '.<output>'", red)
    key = kind if name == red else name[len(red) + 1:]
    options = options_of.get(red)
    if options is None:  # options not recorded: its outputs are known, their shapes are not
        if all(_builtin_output_shape(kind, key, {"per_feature": pf, "lo": 0, "hi": 1}, []) is None
               for pf in (0, 1)):
            raise c.fail(f, f"an output of the built-in reduction {kind!r}", name)
        return
    if kind == "hist" and ("lo" not in options or "hi" not in options):
        options = {**options, "lo": 0.0, "hi": 1.0}  # (refused with the entry that records them)
    want = _builtin_output_shape(kind, key, options, features if isinstance(features, list) else [])
    if want is None:
        raise c.fail(f, f"an output of the built-in reduction {kind!r} (the entry {red!r} or {red!r}.<output>)", name)
    per_feature = bool(options.get("per_feature", 1))
    if not isinstance(features, list) and want != _builtin_output_shape(kind, key, options, [2, 3]):
        return  # no array of this hook point: the shape of an output per feature is not known
    shape = e["shape"]
    if isinstance(want, tuple):
        k = int(options.get("k", 10))
        ok = len(shape) == 1 + len(want[1]) and 1 <= shape[0] <= k and shape[1:] == want[1]
        want = f"[n, *{want[1]}] with n in 1..{k} (k)"
    else:
        ok = shape == want
    if not ok:
        where = f"the feature shape {features} of {hp!r}" if per_feature else "per_feature=0"
        raise c.fail(f"{f}.shape", f"{want} (output {key!r} of the built-in reduction {kind!r}, by {where} "
                     f"and its options {options})", shape)


def builtin_reduction_problems(attrs: dict, *, key: str = "zarr.json") -> dict[str, dict[str, str]]:
    """``{hook_point: {name: problem}}`` of the reduction entries of a built-in ``kind`` that
    break a rule of FORMAT.md §9 rule 10 (attributes that passed :func:`check_root_attrs`).

    The rules: its dtype, and its state's, float64 or int64 (what the native reductions
    store), the options of its main entry ones that reduction can be made with, and each entry
    one of its outputs with the shape it has over rows of its hook point's feature shape (when
    the hook point, or the target of its alias, has an array). An output of a reduction whose
    options are refused is refused with it (its shape was checked against options no
    reduction has). Each problem is ``"<key> field <field> must be <constraint>, got <value>"``.

    Each rule concerns one entry: a store holding such an entry (an earlier version's
    ``StoreWriter.add_reductions`` took a built-in ``kind`` of any dtype) opens, and the
    readers of that entry refuse it (FORMAT.md §9 rule 10). Pure: no I/O.
    """
    c = _EntryChecker(None, key)
    out: dict[str, dict[str, str]] = {}
    arrays, aliases = attrs.get("arrays", {}), attrs.get("aliases") or {}
    reduced = attrs.get("reduced") or {}  # (a store that keeps reductions only: the reduced rows' shape)
    for hp, entries in attrs.get("reductions", {}).items():
        meta = arrays.get(aliases.get(hp, hp)) or arrays.get(hp) or reduced.get(hp)
        features = meta.get("feature_shape") if isinstance(meta, dict) else None
        kinds = {name: e.get("kind") for name, e in entries.items()
                 if isinstance(e.get("kind"), str) and e["kind"] in BUILTIN_OPTIONS}
        options_of: dict[str, dict] = {}
        given_by: dict[str, str] = {}  # reduction -> the entry whose options are its own
        for name, kind in kinds.items():
            e = entries[name]
            if isinstance(e.get("options"), dict):
                red = str(e.get("reduction", name))
                if red not in options_of:
                    options_of[red], given_by[red] = e["options"], name
        problems: dict[str, str] = {}
        for name, kind in kinds.items():
            red = entries[name].get("reduction")
            owner = given_by.get(red) if isinstance(red, str) else None
            bad = None if owner in (None, name) else _builtin_option_problem(kinds[owner], options_of[red])
            if bad is not None:  # (its shape, compared with options no reduction has, would say nothing)
                option, constraint, value = bad
                problems[name] = field_message(
                    key, f"reductions[{hp!r}][{owner!r}].options[{option!r}]",
                    f"{constraint} for the built-in reduction {kinds[owner]!r} (the options of the reduction {red!r} "
                    f"that {name!r} is an output of)", value)
                continue
            try:
                _check_builtin_entry(hp, name, entries[name], kind, features, options_of, c)
            except _EntryProblem as p:
                problems[name] = str(p)
        if problems:
            out[hp] = problems
    return out


def check_reduced_entry(hp: str, meta: Any, c: _Checker) -> None:
    """One entry of ``reduced`` (FORMAT.md §11): ``row_kind``, ``feature_shape``, ``dtype`` and
    ``n_rows`` of a hook point whose rows were reduced and not stored."""
    f = f"reduced[{hp!r}]"
    c.dict(meta, f)
    _check_rows_meta(meta, f, c)


def check_reductions_only(attrs: dict, c: _Checker) -> dict | None:
    """The fields of a store that keeps reductions only (FORMAT.md §11), checked: its
    ``reduced`` entries (returned), or None for a store of rows. A root of another version
    that says it keeps none (``rows_stored`` false, or ``reduced``) is refused: a reader of
    that version would open it as a store of no rows."""
    version = attrs["format"]["version"]
    if version != F.REDUCTIONS_ONLY_VERSION:
        if "rows_stored" in attrs and attrs["rows_stored"] is not True:
            raise c.fail("format.version", f"{F.REDUCTIONS_ONLY_VERSION} in a root whose rows_stored is "
                         f"{attrs['rows_stored']!r} (a store that keeps reductions only, FORMAT.md §11)", version)
        if "reduced" in attrs:
            raise c.fail("format.version", f"{F.REDUCTIONS_ONLY_VERSION} in a root with 'reduced' (a store that keeps "
                         "reductions only, FORMAT.md §11)", version)
        return None
    if attrs.get("rows_stored", ...) is not False:
        raise c.fail("rows_stored", f"false in a root of format version {version} (a store that keeps reductions "
                     "only)", attrs.get("rows_stored", "no such field"))
    for name, what in (("arrays", "activation arrays"), ("aliases", "aliases of arrays"),
                       ("distributed", "a multi-rank record"), ("rank_store", "a rank store record")):
        if name in attrs:
            raise c.fail(name, f"absent in a store that keeps reductions only (it has no {what})", attrs[name])
    tables = attrs.get("row_tables", {})
    if isinstance(tables, dict) and set(tables) - {"sample"}:
        raise c.fail("row_tables key", "'sample' only in a store that keeps reductions only (no token table)",
                     sorted(set(tables) - {"sample"})[0])
    reduced = c.dict(attrs.get("reduced", ...), "reduced")
    for hp, meta in reduced.items():
        check_reduced_entry(hp, meta, c)
    return reduced


def check_root_attrs(attrs: Any, *, store: Any, key: str = "zarr.json") -> dict:
    """Validate the root metadata (FORMAT.md §2, §9) and return it.

    Raises
    ------
    StoreCorruptError
        The first field that breaks a rule, named with its path (``arrays['x'].n_rows``).
    StoreError
        A newer format version.
    """
    c = _Checker(store, key)
    c.dict(attrs, f"attributes[{F.ATTRS_KEY!r}]")
    check_format(attrs, store=store, key=key)
    if attrs.get("status") not in ("complete", "incomplete"):
        raise c.fail("status", "one of ['complete', 'incomplete']", attrs.get("status"))
    if "run_id" in attrs and not (isinstance(attrs["run_id"], str) and 0 < len(attrs["run_id"]) <= 128):
        raise c.fail("run_id", "a str of 1..128 characters", attrs["run_id"])
    if attrs.get("storage_dtype") is not None and attrs["storage_dtype"] not in F.SUPPORTED_DTYPES:
        raise c.fail("storage_dtype", f"null or one of {list(F.SUPPORTED_DTYPES)}", attrs["storage_dtype"])
    c.int(attrs, "n_samples", "n_samples", default=0)
    c.int(attrs, "n_batches", "n_batches", default=0)
    c.int(attrs, "next_sample_id", "next_sample_id", default=0)  # (absent in stores written before it)
    reduced = check_reductions_only(attrs, c)
    # absent in a store of nothing yet; present, each is an object (null is not one)
    if "arrays" not in attrs and attrs.get("n_samples", 0) and reduced is None:
        # a root that records samples but no hook point entries lost them (an edited or
        # truncated document): it would open as a store with no rows at all
        raise c.fail("arrays", f"present in a root that records {attrs['n_samples']} samples", "no such field")
    arrays = c.dict(attrs.get("arrays", {}), "arrays")
    paths: dict[str, str] = {}
    for hp, meta in arrays.items():
        check_array_entry(hp, meta, c)
        if meta["path"] in paths:
            raise c.fail(f"arrays[{hp!r}].path", "unique", f"{meta['path']} (also the path of {paths[meta['path']]!r})")
        paths[meta["path"]] = hp
    tables = c.dict(attrs.get("row_tables", {}), "row_tables")
    for kind, info in tables.items():
        f = f"row_tables[{kind!r}]"
        if kind not in ("sample", "token"):
            raise c.fail("row_tables key", "one of ['sample', 'token']", kind)
        c.dict(info, f)
        parts = info.get("parts", [])
        if not isinstance(parts, list):
            raise c.fail(f"{f}.parts", "a list of keys", parts)
        for p in parts:
            c.keyed(p, f"{f}.parts[]", f"rows/{kind}")
        if len(set(parts)) != len(parts):
            dup = sorted({p for p in parts if parts.count(p) > 1})
            raise c.fail(f"{f}.parts", "a list without repeats", f"{dup} listed more than once")
        c.int(info, "n_rows", f"{f}.n_rows", default=0)
        cols = info.get("columns", [])
        if not isinstance(cols, list) or not all(isinstance(x, str) for x in cols):
            raise c.fail(f"{f}.columns", "a list of str", cols)
        c.crcs(info.get("crc32c"), f"{f}.crc32c", f"rows/{kind}")
    sample_rows = (tables.get("sample") or {}).get("n_rows", 0)
    if attrs.get("n_samples", 0) != sample_rows:  # (info() and len() would report samples that are not there)
        listed = "" if "sample" in tables else ": zarr.json lists no row_tables['sample']"
        raise c.fail("n_samples", f"the sample row table's n_rows ({sample_rows}{listed})", attrs.get("n_samples", 0))
    reductions = c.dict(attrs.get("reductions", {}), "reductions")
    for hp, entries in reductions.items():
        if reduced is not None and hp not in reduced:  # (its rows, feature shape and dtype are reduced's)
            raise c.fail(f"reductions[{hp!r}]", "the reductions of a hook point of 'reduced' (a store that keeps "
                         "reductions only lists each reduced hook point there)", "a hook point 'reduced' lacks")
        for name, e in c.dict(entries, f"reductions[{hp!r}]").items():
            check_reduction_entry(hp, name, e, c)
    for alias, target in c.dict(attrs.get("aliases"), "aliases", optional=True).items():
        if not isinstance(target, str) or target not in arrays:
            raise c.fail(f"aliases[{alias!r}]", "a hook point of 'arrays'", target)
        if alias in arrays:
            raise c.fail(f"aliases[{alias!r}]", "a hook point without an array of its own", alias)
    # (the rules of built-in reduction entries concern one entry each: builtin_reduction_problems,
    # refused by the readers of that entry, never for the whole store)
    owners: dict[str, str] = {}
    for hp, entries in reductions.items():
        for name, e in entries.items():
            _check_reduction_places(hp, name, e, owners, c)
    return attrs


def parse_root(raw: bytes, *, store: Any, key: str = "zarr.json") -> dict | None:
    """The root document's ``activationscope`` attributes, validated; None for another Zarr group."""
    doc = loads_json(raw, store=store, key=key)
    if not isinstance(doc, dict):
        raise corrupt(store, f"{key} must hold a JSON object, got {type(doc).__name__}")
    attributes = doc.get("attributes", {})
    if not isinstance(attributes, dict):
        raise corrupt(store, f"{key} field attributes must be a JSON object, got {type(attributes).__name__}")
    attrs = attributes.get(F.ATTRS_KEY)
    if attrs is None:
        return None
    if doc.get("zarr_format") != 3 or doc.get("node_type") != "group":  # plain Zarr readers open it as one
        raise corrupt(store, f"{key} must be a Zarr v3 group document (zarr_format 3, node_type 'group'), got "
                             f"zarr_format {doc.get('zarr_format')!r}, node_type {doc.get('node_type')!r}")
    return check_root_attrs(attrs, store=store, key=key)


_INDEX_CODECS = [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}]


def array_document_problems(doc: Any, meta: dict, *, hook_point: str, doc_key: str,
                            root_key: str = "zarr.json") -> list[str]:
    """What the array document ``doc`` (``acts/<node>/zarr.json``) says against the root's
    entry ``meta`` of the same array (FORMAT.md §9 rule 17); empty when they agree.

    The reader sizes and interprets every row from the root's entry (``dtype``,
    ``feature_shape``, ``chunk_rows``, ``shard_rows``, ``compression``): each is compared with
    what the array's own document says (``data_type``, ``shape[1:]``, the chunk grid, the
    sharding codec's chunk shape and inner codecs, the chunk key encoding, the index codecs
    and location, and the ``activationscope`` attributes ``hook_point``, ``dtype`` and
    ``row_kind`` when present), so a root edited to say int32 where float32 was written, or
    another feature shape, is an error instead of rows of the wrong type or shape. ``shape[0]``
    is compared with ``n_rows`` by the caller (rule 16). Pure: no I/O.

    Returns
    -------
    list of str
        One line per disagreement, naming the array, both files and both values.
    """
    where = f"hook point {hook_point!r}: its array document {doc_key}"
    root = f"the root document {root_key}"
    if not isinstance(doc, dict):
        return [f"{where} must hold a JSON object, got {type(doc).__name__}"]
    out: list[str] = []

    def differ(field: str, got: Any, root_fields: dict, expected: Any = ...) -> None:
        shown = "" if expected is ... else f" (so {field} {expected!r})"
        r = repr(got)
        if len(r) > 200:
            r = r[:200] + "..."
        said = ", ".join(f"{name} {value!r}" for name, value in root_fields.items())
        out.append(f"{where} says {field} {r}, but {root} says arrays[{hook_point!r}] {said}{shown}: the two disagree")

    if doc.get("zarr_format") != 3 or doc.get("node_type") != "array":
        out.append(f"{where} must be a Zarr v3 array document (zarr_format 3, node_type 'array'), got zarr_format "
                   f"{doc.get('zarr_format')!r}, node_type {doc.get('node_type')!r}")
    dtype, feat = meta["dtype"], list(meta["feature_shape"])
    chunk_rows, shard_rows = int(meta["chunk_rows"]), int(meta["shard_rows"])
    feat_chunk = [max(1, d) for d in feat]
    shape = doc.get("shape")
    if not isinstance(shape, list) or not shape or not all(_int(d, 0, 1 << 62) for d in shape):
        out.append(f"{where} field shape must be a list of non-negative ints, got {shape!r}")
    elif shape[1:] != feat:
        differ("shape", shape, {"feature_shape": feat}, [shape[0], *feat])
    zdtype = F.zarr_dtype(dtype)
    if doc.get("data_type") != zdtype:
        differ("data_type", doc.get("data_type"), {"dtype": dtype}, zdtype)
    attrs = doc.get("attributes")
    ours = attrs.get(F.ATTRS_KEY) if isinstance(attrs, dict) else None
    if isinstance(ours, dict):  # written by every activationscope version; checked when present
        for name, want in (("hook_point", hook_point), ("dtype", dtype), ("row_kind", meta["row_kind"])):
            if name in ours and ours[name] != want:
                if name == "hook_point":
                    out.append(f"{where} says attributes.{F.ATTRS_KEY}.hook_point {ours[name]!r}, but {root} lists "
                               f"it (arrays[...].path {meta['path']!r}) as hook point {hook_point!r}: the two disagree")
                else:
                    differ(f"attributes.{F.ATTRS_KEY}.{name}", ours[name], {name: want})
    grid = doc.get("chunk_grid")
    grid_shape = grid.get("configuration", {}).get("chunk_shape") if isinstance(grid, dict) and isinstance(
        grid.get("configuration"), dict) else None
    if not isinstance(grid, dict) or grid.get("name") != "regular" or grid_shape != [shard_rows, *feat_chunk]:
        differ("chunk_grid", grid, {"shard_rows": shard_rows, "feature_shape": feat},
               {"name": "regular", "configuration": {"chunk_shape": [shard_rows, *feat_chunk]}})
    cke = doc.get("chunk_key_encoding")
    cke_conf = cke.get("configuration", {}) if isinstance(cke, dict) else None
    if not (isinstance(cke, dict) and cke.get("name") == "default" and isinstance(cke_conf, dict)
            and cke_conf.get("separator", "/") == "/"):
        out.append(f"{where} field chunk_key_encoding must be the default encoding with separator '/' (the shard "
                   f"keys {meta['path']}/c/<shard>/0... of FORMAT.md §1), got {cke!r}")
    codecs = doc.get("codecs")
    shard_codec = codecs[0] if isinstance(codecs, list) and len(codecs) == 1 else None
    conf = shard_codec.get("configuration") if isinstance(shard_codec, dict) else None
    if not (isinstance(conf, dict) and shard_codec.get("name") == "sharding_indexed"):
        out.append(f"{where} field codecs must be one sharding_indexed codec (FORMAT.md §3), got {codecs!r}"[:400])
        return out
    if conf.get("chunk_shape") != [chunk_rows, *feat_chunk]:
        differ("codecs[0].configuration.chunk_shape", conf.get("chunk_shape"),
               {"chunk_rows": chunk_rows, "feature_shape": feat}, [chunk_rows, *feat_chunk])
    inner = conf.get("codecs")
    comp = meta.get("compression")
    bytes_conf = (inner[0].get("configuration") or {}) if isinstance(inner, list) and inner and isinstance(
        inner[0], dict) else None
    endian_ok = (isinstance(bytes_conf, dict) and inner[0].get("name") == "bytes"
                 and bytes_conf.get("endian", "little" if F.itemsize(dtype) == 1 else None) == "little")
    if not endian_ok:
        out.append(f"{where} field codecs[0].configuration.codecs must start with the bytes codec, endian 'little' "
                   f"(FORMAT.md §3), got {inner!r}"[:400])
    elif inner[1:] != ([comp] if comp is not None else []):
        differ("codecs[0].configuration.codecs", inner, {"compression": comp}, [inner[0], *([comp] if comp else [])])
    if conf.get("index_codecs") != _INDEX_CODECS or conf.get("index_location", "end") != "end":
        out.append(f"{where} field codecs[0].configuration must have index_codecs {_INDEX_CODECS!r} and "
                   f"index_location 'end' (FORMAT.md §3), got {conf.get('index_codecs')!r}, "
                   f"{conf.get('index_location')!r}"[:400])
    return out


def row_table_type_clashes(sample: Any, token: Any, keys: Iterable[str]) -> list[str]:
    """The columns of ``keys`` (token rows are paired with their sample by them) that the
    sample and token row tables' Arrow schemas hold with two types (a null column, a table
    of no rows, matches any): one writer writes both from the same values. One line each."""
    out = []
    for key in keys:
        if key in sample.names and key in token.names:
            s_type, t_type = sample.field(key).type, token.field(key).type
            if s_type != t_type and "null" not in (str(s_type), str(t_type)):
                out.append(f"column {key!r} is {t_type} in the token row table and {s_type} in the sample row table")
    return out


def small_array_document_problems(doc: dict, dtype: str, shape: list[int], *, doc_key: str) -> list[str]:
    """What a reduction's array document ``doc`` (``reductions/<node>/<name>/zarr.json``) says
    of how its one chunk is found and decoded, against the format's layout (FORMAT.md §6, §9
    rule 14): a Zarr v3 array, a regular chunk grid of one chunk (``chunk_shape`` the shape,
    0 written as 1), the default chunk key encoding with separator ``/``, the ``bytes`` codec
    little-endian alone, no storage transformer. activationscope reads the chunk by its key and
    the root's dtype and shape; a plain Zarr reader (zarr-python, xarray) follows this document,
    so one edited to say big-endian, another chunk key or another grid would make it read other
    values (fill values, swapped bytes) from the same intact file. ``data_type`` and ``shape``
    are compared by the caller. Pure: no I/O.

    Returns
    -------
    list of str
        One line per field that differs, naming the document, the field and both values.
    """
    where = f"its array document {doc_key}"
    out: list[str] = []
    if doc.get("zarr_format") != 3 or doc.get("node_type") != "array":
        out.append(f"{where} must be a Zarr v3 array document (zarr_format 3, node_type 'array'), got zarr_format "
                   f"{doc.get('zarr_format')!r}, node_type {doc.get('node_type')!r}")
    want_grid = {"name": "regular", "configuration": {"chunk_shape": [max(1, int(d)) for d in shape]}}
    if doc.get("chunk_grid") != want_grid:
        out.append(f"{where} field chunk_grid must be {want_grid!r} (one chunk), got {doc.get('chunk_grid')!r}"[:400])
    cke = doc.get("chunk_key_encoding")
    cke_conf = cke.get("configuration", {}) if isinstance(cke, dict) else None
    if not (isinstance(cke, dict) and cke.get("name") == "default" and isinstance(cke_conf, dict)
            and cke_conf.get("separator", "/") == "/"):
        out.append(f"{where} field chunk_key_encoding must be the default encoding with separator '/', got "
                   f"{cke!r}"[:400])
    codecs = doc.get("codecs")
    codec = codecs[0] if isinstance(codecs, list) and len(codecs) == 1 and isinstance(codecs[0], dict) else None
    conf = (codec.get("configuration") or {}) if codec is not None else None
    if not (codec is not None and codec.get("name") == "bytes" and isinstance(conf, dict)
            and conf.get("endian", "little" if F.itemsize(dtype) == 1 else None) == "little"):
        out.append(f"{where} field codecs must be [{F.bytes_codec(dtype)!r}] (the bytes codec, little-endian, "
                   f"alone), got {codecs!r}"[:400])
    if doc.get("storage_transformers", []) != []:
        out.append(f"{where} field storage_transformers must be [], got {doc.get('storage_transformers')!r}"[:400])
    return out


def manifest_problems(doc: Any, shards: dict[int, dict], meta: dict, *, hook_point: str, key: str,
                      sizes: dict[int, int | None] | None = None, restorable: set[int] | None = None) -> list[str]:
    """The fields of a parsed manifest (FORMAT.md §5) that the reader does not use but that a
    reader of the format could trust, checked against what the format prescribes (rule 18):
    ``hook_point`` the array's, each shard's ``key`` the shard key of its number, ``rows_end``
    the end of its shard (``(shard + 1) * shard_rows``) for every shard but the last listed,
    within its shard for the last one (and at least ``n_rows`` when it holds the last committed
    row), and ``file_bytes`` the size of the shard file (``sizes``: ``{shard: size or None}``,
    for the shards whose files were looked at). ``restorable``: the shards a resume can put
    back (None: all), which the advice on a partial last shard of another size depends on.
    Pure: no I/O.

    Returns
    -------
    list of str
        One line per lie, naming the manifest (the segment, for a record of one), the shard, the
        field, what it says and what it must be.
    """
    out: list[str] = []
    if isinstance(doc, dict) and "hook_point" in doc and doc["hook_point"] != hook_point:
        out.append(f"manifest {key} says hook_point {doc['hook_point']!r}, but it is the manifest of hook point "
                   f"{hook_point!r} (the root document zarr.json, arrays[{hook_point!r}].manifest)")
    shard_rows, n = int(meta["shard_rows"]), int(meta["n_rows"])
    last_listed = max(shards, default=-1)
    last_committed = (n - 1) // shard_rows if n else -1
    for k in sorted(shards):
        rec = shards[k]
        # (a record of a segment: named by the segment's key, the file that holds it)
        where = f"manifest {shards.key_of(k) if isinstance(shards, Manifest) else key} shard {k}"
        want_key = F.shard_key(meta["path"], k, len(meta["feature_shape"]))
        if rec.get("key", want_key) != want_key:
            r = repr(rec.get("key"))
            out.append(f"{where}: key {r[:200]} is not the shard's key {want_key!r} (FORMAT.md §1: shard {k} of "
                       f"{meta['path']!r} is {want_key!r})")
        rows_end = rec.get("rows_end")
        lo, full = k * shard_rows, (k + 1) * shard_rows
        if not _int(rows_end, 0, MAX_ROWS + shard_rows):
            out.append(f"{where}: rows_end must be a non-negative int, got {rows_end!r}")
        elif k != last_listed and rows_end != full:
            out.append(f"{where}: rows_end {rows_end} must be {full} (shard {k} is not the last one listed, so it "
                       f"holds rows {lo}..{full - 1}: (shard + 1) * shard_rows with shard_rows {shard_rows})")
        elif not lo < rows_end <= full:
            out.append(f"{where}: rows_end {rows_end} must be in {lo + 1}..{full} (the rows of shard {k}, shard_rows "
                       f"{shard_rows})")
        elif k == last_committed and rows_end < n:
            out.append(f"{where}: rows_end {rows_end} is below the {n} committed rows (n_rows of the root document "
                       "zarr.json) that end in this shard")
        if sizes is not None and k in sizes and sizes[k] is not None and rec.get("file_bytes") != sizes[k]:
            cause = ""
            if k == last_committed and (restorable is None or k in restorable):
                cause = (": the shard holds the last committed rows, and a capture appending to it (a resume, or a "  # FORMAT.md §5, §7
                         "running capture rewriting the partial shard of an array that held its commits back) was "
                         "killed while it committed, or an older version's resume is still running (resume the "
                         "capture: it puts the committed shard back, or check again once that capture has ended), or "
                         "it is damaged")
            elif k == last_committed and n % int(meta["chunk_rows"]):
                cause = (": the shard holds the last committed rows, which end inside a chunk that a resumed capture "
                         "appends to, and no committed copy of it is kept: it is damaged, or an older version's resume "
                         "is still running (check again once that capture has ended); restore the store from an intact "
                         "copy, or capture it again")
            out.append(f"{where}: file_bytes {rec.get('file_bytes')!r} differs from the size of the shard file "
                       f"{want_key!r}, {sizes[k]} bytes{cause}")
    return out


def _check_record(rec: Any, f: str, c: "_Checker", n_chunks: int, check_chunks: bool) -> int:
    """One manifest record (a shard's), checked; its shard number."""
    c.dict(rec, f)
    k = c.int(rec, "shard", f"{f}.shard", 0, MAX_ROWS)
    c.int(rec, "file_bytes", f"{f}.file_bytes", 0, 1 << 62)
    if check_chunks:
        check_chunk_entries(rec, n_chunks, store=c.store, key=c.key, field=f)
    elif not isinstance(rec.get("chunks", []), list):
        raise c.fail(f"{f}.chunks", "a list", rec.get("chunks"))
    return k


class Manifest(Mapping):
    """``{shard: record}`` of an array's manifest (FORMAT.md section 5): the records its index
    ``manifest.json`` lists, and those of its segments ``manifest.<first>.json``, each segment
    read and checked the first time one of its shards is looked up (a random row read parses
    one segment, not all; iterating the keys or ``in`` reads none; ``items()``, ``values()``
    read every one). Shards are ints; a segment that is missing, of another size or crc32c
    than the index records, over 64 MiB, or whose fields disagree with the index raises
    :class:`StoreCorruptError` naming the segment's key and the field.

    Attributes
    ----------
    segments : list of dict
        The index's segments, ``{"first", "end", "file_bytes", "crc32c"}`` each, contiguous from
        shard 0 (shards ``first .. end - 1``; ``file_bytes`` in bytes).
    key : str
        The index's key.
    """

    def __init__(self, tail: dict[int, dict], segments: list[dict], *, hook_point: Any, n_chunks: int, store: Any,
                 key: str, check_chunks: bool, fetch: Callable[[str], Any] | None,
                 root_hook_point: bool = False) -> None:
        self._tail, self.segments, self.key = tail, segments, key
        self._firsts = [e["first"] for e in segments]
        self._hook_point, self._n_chunks, self._store = hook_point, n_chunks, store
        self._root_hook_point = root_hook_point  # (hook_point: the root's name of the array, not the index's)
        self._check_chunks, self._fetch = check_chunks, fetch
        self._loaded: dict[int, dict[int, dict]] = {}

    def _segment_of(self, shard: Any) -> int | None:
        if not isinstance(shard, int) or isinstance(shard, bool):
            return None
        i = bisect.bisect_right(self._firsts, shard) - 1
        return i if i >= 0 and shard < self.segments[i]["end"] else None

    def key_of(self, shard: int) -> str:
        """The key of the document that lists ``shard``: its segment's, or the index's."""
        i = self._segment_of(shard)
        return self.key if i is None else F.segment_key(self.key, self.segments[i]["first"])

    def __getitem__(self, shard: Any) -> dict:
        rec = self._tail.get(shard)
        if rec is not None:
            return rec
        i = self._segment_of(shard)
        if i is None:
            raise KeyError(shard)
        got = self._loaded.get(i)
        if got is None:
            got = self._loaded[i] = self._load(i)
        return got[shard]

    def __contains__(self, shard: Any) -> bool:
        return shard in self._tail or self._segment_of(shard) is not None

    def __iter__(self) -> Iterator[int]:
        for e in self.segments:
            yield from range(e["first"], e["end"])
        yield from self._tail

    def __len__(self) -> int:
        return sum(e["end"] - e["first"] for e in self.segments) + len(self._tail)

    @property
    def tail(self) -> dict[int, dict]:
        """``{shard: record}`` of the records the index itself lists (the shards after its
        segments, in its order): none of a segment, none read."""
        return self._tail

    def n_listed(self, last: int) -> int:
        """How many of shards ``0 .. last`` are listed, without reading a segment (a segment's
        range counts whole: its records are checked when it is read)."""
        n = sum(max(0, min(e["end"], last + 1) - e["first"]) for e in self.segments)
        return n + sum(1 for k in self._tail if k <= last)

    def load_all(self) -> None:
        """Read and check every segment (``verify``): the first bad one raises."""
        for i in range(len(self.segments)):
            if i not in self._loaded:
                self._loaded[i] = self._load(i)

    def _load(self, i: int) -> dict[int, dict]:
        e = self.segments[i]
        first, end = e["first"], e["end"]
        skey = F.segment_key(self.key, first)
        listed = f"the manifest {self.key} lists it (segments[{i}], shards {first}..{end - 1})"
        fetch = self._fetch or (lambda k: self._store.get(k, max_bytes=MAX_JSON_BYTES))
        raw = fetch(skey)
        if raw is None:
            raise corrupt(self._store, f"manifest segment {skey} is missing, but {listed}")
        raw = bytes(raw)
        if len(raw) != e["file_bytes"]:
            raise corrupt(self._store, f"manifest segment {skey} holds {len(raw)} bytes, but {listed} with file_bytes "
                                       f"{e['file_bytes']}: it is damaged or not this manifest's")
        got = F.crc32c(raw)
        if got != e["crc32c"]:
            raise corrupt(self._store, f"manifest segment {skey} has crc32c {got}, but {listed} with crc32c "
                                       f"{e['crc32c']}: it is damaged or not this manifest's")
        doc = loads_json(raw, store=self._store, key=skey)
        c = _Checker(self._store, skey)
        c.dict(doc, "(document)")
        for name, want in (("hook_point", self._hook_point), ("first", first), ("end", end)):
            if doc.get(name, ...) != want or type(doc.get(name)) is not type(want):  # (4.0 == 4, True == 1)
                said = ("the array's hook point (the root document zarr.json)" if name == "hook_point"
                        and self._root_hook_point else f"what {listed} says")
                raise c.fail(name, f"{want!r} ({said})", doc.get(name, "no such field"))
        shards = doc.get("shards")
        if not isinstance(shards, list) or len(shards) != end - first:
            raise c.fail("shards", f"a list of {end - first} records (shards {first}..{end - 1})",
                         f"{len(shards)} records" if isinstance(shards, list) else shards)
        out: dict[int, dict] = {}
        for j, rec in enumerate(shards):
            k = _check_record(rec, f"shards[{j}]", c, self._n_chunks, self._check_chunks)
            if not first <= k < end:
                raise c.fail(f"shards[{j}].shard", f"in {first}..{end - 1} (the shards of this segment)", k)
            if k in out:
                raise c.fail(f"shards[{j}].shard", "unique", k)
            out[k] = rec
        return out


def parse_manifest(doc: Any, meta: dict, *, store: Any, key: str, check_chunks: bool = True,
                   fetch: Callable[[str], Any] | None = None, hook_point: str | None = None) -> Manifest:
    """``{shard: record}`` of a manifest (FORMAT.md §5), each record checked against the array.

    The index is checked now (its records, and its segments: contiguous from shard 0, each of
    at least one shard, the records after the last one's ``end``); each segment when one of its
    shards is first looked up (:class:`Manifest`), read with ``fetch(key) -> bytes or None``
    (default: ``store.get`` up to 64 MiB).

    ``hook_point``: the array's hook point (the root document's name for it), which each
    segment's ``hook_point`` must be; None: the index's ``hook_point`` (a lie there is then
    blamed on the segments; :func:`manifest_problems` names the index's own).

    ``check_chunks=False`` leaves each record's ``chunks`` list to :func:`check_chunk_entries`,
    called before that shard's entries are used (a large layer lists thousands of chunks, which
    a memory-mapped read never looks at).

    Raises
    ------
    StoreCorruptError
        A field of the index (or, when read, of a segment) breaks a rule: named with its key."""
    c = _Checker(store, key)
    c.dict(doc, "(document)")
    shards = doc.get("shards", [])
    if not isinstance(shards, list):
        raise c.fail("shards", "a list", shards)
    for name in ("chunk_rows", "shard_rows"):  # the reader takes both from the root (rule 17)
        if name in doc and doc[name] != meta[name]:
            raise corrupt(store, f"manifest {key} says {name} {doc[name]!r}, but the root document zarr.json says "
                                 f"{meta[name]!r} for its array {meta['path']!r}: the two disagree")
    segments = doc.get("segments", [])
    if not isinstance(segments, list):
        raise c.fail("segments", "a list", segments)
    end = 0
    for i, e in enumerate(segments):
        f = f"segments[{i}]"
        c.dict(e, f)
        first = c.int(e, "first", f"{f}.first", 0, MAX_ROWS)
        if first != end:
            what = "a gap" if first > end else "an overlap"
            raise c.fail(f"{f}.first", f"{end} (segments follow each other from shard 0; {what} otherwise)", first)
        end = c.int(e, "end", f"{f}.end", first + 1, MAX_ROWS)
        c.int(e, "file_bytes", f"{f}.file_bytes", 1, MAX_JSON_BYTES)
        c.int(e, "crc32c", f"{f}.crc32c", 0, (1 << 32) - 1)
    n_chunks = meta["shard_rows"] // meta["chunk_rows"]
    out: dict[int, dict] = {}
    for i, rec in enumerate(shards):
        f = f"shards[{i}]"
        k = _check_record(rec, f, c, n_chunks, check_chunks)
        if k < end:
            raise c.fail(f"{f}.shard", f"at least {end} (shards 0..{end - 1} are in the segments)", k)
        if k in out:
            raise c.fail(f"{f}.shard", "unique", k)
        out[k] = rec
    return Manifest(out, [dict(e) for e in segments], n_chunks=n_chunks, store=store, key=key,
                    hook_point=doc.get("hook_point") if hook_point is None else hook_point,
                    root_hook_point=hook_point is not None, check_chunks=check_chunks, fetch=fetch)


def check_chunk_entries(rec: dict, n_chunks: int, *, store: Any, key: str, field: str = "shards[]") -> list:
    """The ``chunks`` list of one manifest record, each entry ``[slot, offset, nbytes, crc32c]``
    of ints in range (slot below ``n_chunks``); :class:`StoreCorruptError` naming the manifest
    and the field otherwise."""
    c = _Checker(store, key)
    chunks = rec.get("chunks", [])
    if not isinstance(chunks, list):
        raise c.fail(f"{field}.chunks", "a list", chunks)
    for ch in chunks:  # type(x) is int: ints, not bools (hundreds of thousands in a large layer)
        if (type(ch) is not list or len(ch) != 4 or type(ch[0]) is not int or type(ch[1]) is not int
                or type(ch[2]) is not int or type(ch[3]) is not int or not 0 <= ch[0] < n_chunks
                or not 0 <= ch[1] <= 1 << 62 or not 0 <= ch[2] <= 1 << 62 or not 0 <= ch[3] < 1 << 32):
            raise c.fail(f"{field}.chunks[]", f"[slot 0..{n_chunks - 1}, offset, nbytes, crc32c] of ints", ch)
    return chunks


def pairing_keys(samples: Any, tokens: Any, keys: Iterable[str]) -> list[str]:
    """Of ``keys``, those that pair a token row with its sample, ``sample_id`` last: the ones
    both tables hold, ``rank`` only without nulls in either (a store's ``rank`` column, one
    value per row; a user column of that name given per sample in some forwards and per token
    in others is null in the rows of the other kind, FORMAT.md section 9 rule 15)."""
    out = [k for k in keys if k != "sample_id" and k in samples.column_names and k in tokens.column_names]
    out = [k for k in out if k != "rank" or not (samples.column(k).null_count or tokens.column(k).null_count)]
    return out + ["sample_id"]


#: Token rows paired with their samples at a time (:func:`token_rows_without_sample`).
PAIRING_ROWS = 1 << 20


def token_rows_without_sample(samples: Any, tokens: Any, keys: Iterable[str]) -> tuple[int, list, int, list]:
    """Token rows that no sample row describes (FORMAT.md §4, §9 rule 15): a writer records
    each forward's samples and their token rows together, with the same ``sample_id``,
    ``batch`` (and, in a store committed from rank stores, ``rank``), so each token row's
    ``keys`` values are those of a row of the sample table. A generation step
    (``same_samples=True``) records its samples again under its own ``batch``; resumed and
    multi-rank stores keep the pairing. Vectorised (hash lookups, no loop per row), in slices
    of ``PAIRING_ROWS`` token rows: a store of millions of token rows is checked in one pass
    over each column, with the memory of one slice (and the sample table's keys).

    Parameters
    ----------
    samples, tokens : pyarrow.Table
        The sample and token row tables; both hold ``sample_id`` and every key of ``keys``.
    keys : iterable of str
        The columns that pair a token row with its sample (``sample_id`` among them).

    Returns
    -------
    (n_unknown, unknown_ids, n_unpaired, unpaired)
        ``n_unknown`` token rows whose ``sample_id`` is in no sample row, the first (at most 5)
        distinct such ids in row order; ``n_unpaired`` further token rows whose ``sample_id`` is known but
        whose ``keys`` values together are in no sample row, and the first (at most 5) distinct
        such values of the keys, as dicts, in row order.
    """
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    keys = pairing_keys(samples, tokens, keys)
    known_ids = pc.unique(samples.column("sample_id").combine_chunks())
    pairs = None
    if len(keys) > 1:
        pairs = samples.select(keys).group_by(keys).aggregate([])
        pairs = pairs.append_column("_pair", pa.array(np.ones(pairs.num_rows, dtype=bool)))
    n_unknown, unknown_ids, n_unpaired, unpaired = 0, [], 0, []
    # PAIRING_ROWS token rows at a time: the lookups and the join hold one slice, not every row
    for start in range(0, tokens.num_rows, PAIRING_ROWS):
        part = tokens.slice(start, PAIRING_ROWS)
        ids = part.column("sample_id")
        known = pc.fill_null(pc.is_in(ids, value_set=known_ids), False)
        unknown = pc.invert(known)
        n = int(pc.sum(unknown).as_py() or 0)
        if n:
            n_unknown += n
            if len(unknown_ids) < 5:  # the first distinct ids in row order
                new = pc.unique(ids.filter(unknown).combine_chunks()).to_pylist()
                unknown_ids += [i for i in new if i not in unknown_ids][:5 - len(unknown_ids)]
        if pairs is None:
            continue
        # among the rows of known ids (a null id pairs by is_in above, never by a join): each row's
        # keys looked up among the sample rows' distinct keys
        rows = part.select(keys).append_column("_row", pa.array(np.arange(start, start + part.num_rows,
                                                                          dtype=np.int64)))
        rows = rows.filter(pc.and_(known, pc.is_valid(ids)))
        joined = rows.join(pairs, keys, join_type="left outer")
        lost = joined.filter(pc.is_null(joined.column("_pair")))
        if not lost.num_rows:
            continue
        n_unpaired += lost.num_rows
        if len(unpaired) < 5:
            first = lost.group_by(keys).aggregate([("_row", "min")]).sort_by("_row_min").slice(0, 5).select(keys)
            unpaired += [v for v in first.to_pylist() if v not in unpaired][:5 - len(unpaired)]
    return n_unknown, unknown_ids, n_unpaired, unpaired


def token_rows_without_sample_lines(samples: Any, tokens: Any, keys: Iterable[str], fix: str) -> list[str]:
    """:func:`token_rows_without_sample` said in words, one line per finding, each ending with
    ``fix``: what verify reports and the dataset's join raises."""
    n_unknown, unknown_ids, n_unpaired, unpaired = token_rows_without_sample(samples, tokens, keys)
    out = []
    if n_unknown:
        out.append(f"row table 'token': {n_unknown} of its {tokens.num_rows} rows have a sample_id that is in no row "
                   f"of the sample row table ({samples.num_rows} rows), first {unknown_ids!r}: those token rows have "
                   f"no sample (the row tables were edited, or their parts come from different stores); {fix}")
    if n_unpaired:
        keys = pairing_keys(samples, tokens, keys)
        out.append(f"row table 'token': {n_unpaired} of its {tokens.num_rows} rows have a sample_id of the sample row "
                   f"table but no sample row with their {', '.join(keys)} together, first {unpaired!r}: those token "
                   f"rows are paired with no sample (the row tables were edited, or their parts come from different "
                   f"stores); {fix}")
    return out


def short_of_row_table_line(hook_point: str, n_rows: int, kind: str, table_rows: int, table: Any,
                            from_ranks: bool, fix: str) -> str | None:
    """Whether an array that follows its row table with fewer rows (``n_rows``) than the
    table (``table_rows``) is damage, said in words ending with ``fix``; None where a writer
    leaves it (its first ``n_rows`` rows pair with the table's first rows; readers read the
    table that far).

    Legitimate only at the end of a forward, in a store not committed from rank stores
    (``from_ranks``): a writer commits whole forwards in every array, and a resume through
    ``StoreWriter`` that never opens a stored array again leaves it at the end of the last
    forward committed before (the capture API refuses such a resume; an array missing from a
    forward of the same run no longer follows the table). ``commit_ranks`` refuses a rank
    store whose array that follows its table holds fewer rows than it, so a committed
    multi-rank store has none. ``table``: the row table (``pyarrow.Table``, at least
    ``n_rows + 1`` rows to tell; None: not read, nothing said)."""
    where = (f"hook point {hook_point!r}: n_rows {n_rows} is fewer than the {table_rows} rows of the {kind} row "
             "table it follows")
    if from_ranks:
        return (f"{where}: in a store committed from rank stores every array that follows its row table holds all of "
                f"the table's rows (the commit refuses a rank store where it does not); {fix}")
    if table is None or "batch" not in table.column_names or n_rows == 0 or table.num_rows <= n_rows:
        return None
    batch = table.column("batch")
    last, after = batch[n_rows - 1].as_py(), batch[n_rows].as_py()
    if last != after:
        return None  # the end of a forward: a resume that never opened this array again
    return (f"{where}, and ends inside forward (batch) {last!r}, whose rows continue at table row {n_rows}: a writer "
            f"commits whole forwards in every array (a resume that never opens a stored array again leaves it short "
            f"at the end of a forward), so its rows and the table's no longer pair; {fix}")
