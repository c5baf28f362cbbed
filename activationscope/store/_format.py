"""The on-disk format, version 1: names, dtypes, codecs and metadata documents.

The spec is ``store/FORMAT.md``; this module is its executable half. Everything here is
pure (no I/O).
"""

from __future__ import annotations

import datetime as _dt
import functools
import hashlib
import json
import math
import unicodedata
from typing import Any

import torch

from .._args import parse_flag  # noqa: F401  (the store's flags: F.parse_flag)
from ..errors import ArgumentTypeError, ArgumentValueError

FORMAT_NAME = "activationscope"
FORMAT_VERSION = 1
#: Highest version readers accept: 2 = stores committed from rank stores (FORMAT.md section 10),
#: 3 = stores that keep reductions only (FORMAT.md section 11), 4 = stores with a segmented
#: manifest (FORMAT.md section 5).
MAX_READ_VERSION = 4
#: The version of a store (a store of one process, a rank store, or a root committed from rank
#: stores) any of whose array manifests has segments (FORMAT.md section 5).
SEGMENTS_VERSION = 4
#: Full committed shards of one array sealed into each manifest segment (FORMAT.md section 5): a
#: manifest lists at most about this many shards itself, whatever the array's length.
MANIFEST_SEGMENT_SHARDS = 1024
#: The version of a store that keeps reductions only, no activation rows (FORMAT.md section 11).
REDUCTIONS_ONLY_VERSION = 3
ATTRS_KEY = "activationscope"

#: Default sizes: a chunk is about 256 KiB of rows, a shard about 64 MiB but at most
#: MAX_SHARD_ROWS rows (see chunk_layout).
DEFAULT_CHUNK_BYTES = 256 << 10
#: Default chunk size of compressed arrays (decoded whole on read, never memory-mapped).
COMPRESSED_CHUNK_BYTES = 1 << 20
#: Chunk sizes are rounded to whole pages of this size when the row size allows.
PAGE_BYTES = 4096
DEFAULT_SHARD_BYTES = 64 << 20
MAX_CHUNK_ROWS = 1 << 16
#: Cap of chunks per shard: the shard index (16 bytes per chunk) stays <= 16 KiB.
MAX_SHARD_CHUNKS = 1024
#: Cap of rows per shard in the default layout. Rows become durable a whole shard at a time
#: and a commit needs every array's rows durable, so without it an array of narrow rows (which
#: fills 64 MiB only after millions of rows) would hold back every commit of the capture.
MAX_SHARD_ROWS = 16384
#: Valid compression levels: zstd (the "zstd:<level>" form) and blosc clevel.
ZSTD_LEVELS = (1, 22)
BLOSC_CLEVELS = (0, 9)

# torch dtype name -> Zarr v3 data type of the stored elements
_ZARR_DTYPE = {
    "float32": "float32",
    "float16": "float16",
    "float64": "float64",
    "bfloat16": "uint16",  # bit patterns; zarr-python 3.1 has no bfloat16
    "int8": "int8",
    "int16": "int16",
    "int32": "int32",
    "int64": "int64",
    "uint8": "uint8",
    "uint16": "uint16",
    "uint32": "uint32",
    "uint64": "uint64",
    "bool": "bool",
    "complex64": "complex64",    # interleaved (real, imaginary) float32 pairs
    "complex128": "complex128",  # interleaved (real, imaginary) float64 pairs
}

SUPPORTED_DTYPES = tuple(_ZARR_DTYPE)
COMPRESSION_NAMES = (None, "zstd", "blosc-lz4")


def is_rank_name(name: str) -> bool:
    """Whether ``name`` names a rank store in a multi-rank store's ``ranks/`` folder: the
    rank in 5 digits (FORMAT.md section 10)."""
    return len(name) == 5 and name.isdigit()


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).replace("torch.", "")


def torch_dtype(name: str) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16`` (a supported dtype name)."""
    if name not in _ZARR_DTYPE:
        raise ArgumentValueError(f"dtype must be one of {list(SUPPORTED_DTYPES)}, got {name!r}")
    return getattr(torch, name)


def parse_dtype(dtype: Any, what: str) -> str:
    """Validate a dtype for a store array; returns its name."""
    if not isinstance(dtype, torch.dtype):
        raise ArgumentTypeError(f"{what} must be a torch.dtype, got {dtype!r}")
    name = dtype_name(dtype)
    if name not in _ZARR_DTYPE:
        raise ArgumentValueError(f"{what} must be one of {list(SUPPORTED_DTYPES)}, got {name!r}")
    return name


def zarr_dtype(name: str) -> str:
    return _ZARR_DTYPE[name]


@functools.cache
def itemsize(name: str) -> int:
    """Bytes per element of a supported dtype name (ArgumentValueError for another name)."""
    return torch_dtype(name).itemsize


#: Longest node name in UTF-8 bytes: file systems allow 255 bytes a name, and a reduction's
#: files add ``.<reduction>.state.<key>`` below it
MAX_NODE_BYTES = 128


#: Characters no Windows file name holds (nor a macOS SMB share's), written ``%XX`` in a node
#: name (FORMAT.md section 1), with the control characters U+0001 .. U+001F.
_NOT_PORTABLE = '<>:"|?*' + "".join(chr(c) for c in range(1, 32))
#: Windows device names: a file named so, with any extension (``nul.txt``), cannot be made.
_DEVICE_NAMES = frozenset(["CON", "PRN", "AUX", "NUL", *(f"{d}{i}" for d in ("COM", "LPT") for i in "0123456789¹²³")])


def _whole_node_name(hook_point: str, *, escape_document: bool = True, portable: bool = True) -> str:
    """:func:`node_name` before a long one is shortened: the hook point, escaped (with
    ``escape_document=False``, a name that folds to ``zarr.json`` as stores written before
    it was escaped kept it; with ``portable=False``, without the escapes of names Windows
    cannot hold, as stores written before them kept them)."""
    if not isinstance(hook_point, str) or not hook_point:
        raise ArgumentValueError(f"hook point must be a non-empty str, got {hook_point!r}")
    # (a backslash or NUL is no character of a store key: a module named "a\\b" is a folder "a%5Cb")
    out = hook_point.replace("%", "%25").replace("/", "%2F").replace("\\", "%5C").replace("\x00", "%00")
    if portable:  # (a folder that can be copied to Windows, or to a share macOS mounts from it)
        out = "".join(f"%{ord(c):02X}" if c in _NOT_PORTABLE else c for c in out)
    if out.startswith("__"):
        out = "%5F" + out[1:]
    if out in (".", "..") or (escape_document and folded(out) == "zarr.json"):  # (named as its group's document)
        out = out.replace(".", "%2E")
    if portable:
        if out[-1] in ". ":  # (Windows drops a trailing dot or space: "a." would be "a")
            out = out[:-1] + f"%{ord(out[-1]):02X}"
        base = out.split(".", 1)[0].rstrip(" ")
        if base.upper() in _DEVICE_NAMES and all(c.isascii() or c in "¹²³" for c in base):  # ("con", "nul.txt")
            out = f"%{ord(out[0]):02X}" + out[1:]
    return out


def spelled_alike(a: str, b: str) -> str:
    """`` (written ...)`` with both names in ASCII escapes when they print alike (``é`` as one
    character and as ``e`` plus a combining accent), else nothing: for a message naming both."""
    if unicodedata.normalize("NFC", a) != unicodedata.normalize("NFC", b):
        return ""
    return f" (written {ascii(a)} and {ascii(b)})"


def folded(name: str) -> str:
    """``name`` as a file system that folds case and Unicode normalization (macOS, Windows)
    compares it: ``"Zarr.JSON"`` and ``"zarr.json"`` are one file there."""
    return unicodedata.normalize("NFC", unicodedata.normalize("NFD", name).casefold())


def node_names(hook_point: str) -> tuple[str, ...]:
    """The node names a store may keep ``hook_point``'s folders under: :func:`node_name`, and
    for a name it shortens also the whole escaped name, which stores written before names
    were shortened use (on object storage, or on a file system within its name limit); for a
    name folding to ``zarr.json`` in another case (``Zarr.JSON``) also the name with its
    ``.``, which stores written before it was escaped use (on a case-sensitive file system);
    for a name holding a character or spelling Windows cannot hold (``a:b``, ``con``,
    ``a.``) also the name without those escapes, which stores written before them use."""
    names = [node_name(hook_point)]
    for other in (_whole_node_name(hook_point), _shortened(_whole_node_name(hook_point, portable=False), hook_point),
                  _whole_node_name(hook_point, portable=False),
                  _whole_node_name(hook_point, escape_document=False, portable=False)):
        if other not in names:
            names.append(other)
    return tuple(names)


def node_name(hook_point: str) -> str:
    """The Zarr node name of a hook point (``/``, ``\\``, NUL and a leading ``__`` escaped with
    ``%``; the ``.`` of a hook point ``.``, ``..`` or ``zarr.json``, any case, as ``%2E``; and
    what a Windows file name cannot hold: ``<>:"|?*`` and U+0001 .. U+001F as ``%XX``, a
    trailing ``.`` or space as ``%2E`` / ``%20``, the first character of a device name such as
    ``con`` or ``nul.txt`` as ``%XX``).

    A name longer than :data:`MAX_NODE_BYTES` UTF-8 bytes is cut to its first 100 bytes (at a
    character boundary) plus ``~`` and the first 16 hex digits of the sha256 of the hook point
    (FORMAT.md section 1): a folder a file system can make, one per hook point."""
    return _shortened(_whole_node_name(hook_point), hook_point)


def _shortened(out: str, hook_point: str) -> str:
    """The escaped name ``out`` of ``hook_point``, shortened when it is too long (:func:`node_name`)."""
    raw = out.encode("utf-8", "surrogatepass")
    if len(raw) > MAX_NODE_BYTES:
        head = raw[:100].decode("utf-8", "ignore")  # (a character cut in two is left out)
        out = f"{head}~{hashlib.sha256(hook_point.encode('utf-8', 'surrogatepass')).hexdigest()[:16]}"
    return out


#: The row kinds of a store's row tables (FORMAT.md section 3), in the order they are written.
ROW_KINDS = ("sample", "token")


def first_root_attrs(run_id: str | None, created: str, *, version: int = FORMAT_VERSION) -> dict:
    """The ``activationscope`` attributes of the first root of a run (FORMAT.md section 2):
    status ``incomplete``, no model, rows, arrays, row-table parts or reductions. ``run_id``
    None records none (a resumed multi-rank root written before run ids)."""
    return {
        "format": {"name": FORMAT_NAME, "version": version}, "status": "incomplete",
        **({} if run_id is None else {"run_id": run_id}), "created": created, "updated": utc_now(),
        "library": library_versions(), "model": None, "capture_config": {}, "storage_dtype": None, "provenance": {},
        "n_samples": 0, "n_batches": 0, "arrays": {},
        "row_tables": {k: {"parts": [], "n_rows": 0, "columns": []} for k in ROW_KINDS}, "reductions": {},
    }


def library_versions() -> dict:
    """The ``library`` record of a root document: the activationscope, torch and zarr
    versions of the writer (FORMAT.md section 2)."""
    import zarr

    from .._version import __version__

    return {"activationscope": __version__, "torch": torch.__version__, "zarr": zarr.__version__}


# ------------------------------------------------------------------------ codecs
def parse_compression(compression: Any) -> dict | None:
    """Normalise ``compression=`` to the Zarr v3 codec document (or None).

    Accepts None, ``"zstd"``, ``"zstd:<level>"`` (level 1..22, default 3), ``"blosc-lz4"``,
    ``"blosc-lz4:<clevel>"`` (clevel 0..9, default 5), a zarr ``ZstdCodec`` / ``BloscCodec``
    or a numcodecs ``Zstd`` / ``Blosc`` (zstd level at most 22, blosc clevel 0..9).

    Raises
    ------
    ValueError
        An unknown form or a level out of range.
    """
    if compression is None or compression is False:
        return None
    if isinstance(compression, str):
        name, sep, level = compression.partition(":")
        if name == "zstd":
            lvl = _parse_level(level, 3, "zstd", compression, ZSTD_LEVELS) if sep else 3
            return {"name": "zstd", "configuration": {"level": lvl, "checksum": False}}
        if name == "blosc-lz4":
            lvl = _parse_level(level, 5, "blosc-lz4", compression, BLOSC_CLEVELS) if sep else 5
            return {"name": "blosc", "configuration": {"cname": "lz4", "clevel": lvl, "shuffle": "shuffle", "blocksize": 0}}
    doc = _codec_document(compression)
    if doc is not None:
        conf = doc["configuration"]
        if doc["name"] == "zstd" and not (-(1 << 17) <= int(conf.get("level", 0)) <= ZSTD_LEVELS[1]):
            raise ArgumentValueError(f"zstd level must be at most {ZSTD_LEVELS[1]}, got {conf.get('level')!r} in compression={compression!r}")
        if doc["name"] == "blosc" and not (BLOSC_CLEVELS[0] <= int(conf.get("clevel", 5)) <= BLOSC_CLEVELS[1]):
            raise ArgumentValueError(
                f"blosc clevel must be in {BLOSC_CLEVELS[0]}..{BLOSC_CLEVELS[1]}, got {conf.get('clevel')!r} in "
                f"compression={compression!r}"
            )
        return doc
    raise ArgumentValueError(
        "compression must be one of [None, 'zstd', 'zstd:<level>', 'blosc-lz4', 'blosc-lz4:<clevel>'], a zarr ZstdCodec / "
        f"BloscCodec or a numcodecs Zstd / Blosc, got {compression!r}"
    )


def _parse_level(level: str, default: int, name: str, compression: str, bounds: tuple[int, int]) -> int:
    lo, hi = bounds
    try:
        lvl = int(level)
    except ValueError:
        lvl = None
    if lvl is None or not lo <= lvl <= hi:
        raise ArgumentValueError(
            f"{name} level must be an int in {lo}..{hi}, got {level!r} in compression={compression!r}; "
            f"e.g. '{name}:{default}'"
        )
    return lvl


def _codec_document(compression: Any) -> dict | None:
    """The codec document of a zarr ZstdCodec / BloscCodec or numcodecs Zstd / Blosc (else None)."""
    mod = type(compression).__module__
    cls = type(compression).__name__
    if mod.startswith("zarr") and cls in ("ZstdCodec", "BloscCodec"):
        doc = compression.to_dict()
        conf = dict(doc.get("configuration") or {})
        if doc["name"] == "blosc":
            conf.pop("typesize", None)
            conf["shuffle"] = str(getattr(conf.get("shuffle"), "value", conf.get("shuffle") or "shuffle"))
            conf["cname"] = str(getattr(conf.get("cname"), "value", conf.get("cname")))
            conf.setdefault("blocksize", 0)
        return {"name": doc["name"], "configuration": conf}
    if mod.startswith("numcodecs") and cls == "Zstd":
        return {"name": "zstd", "configuration": {"level": int(compression.level), "checksum": bool(getattr(compression, "checksum", False))}}
    if mod.startswith("numcodecs") and cls == "Blosc":
        shuffle = {0: "noshuffle", 1: "shuffle", 2: "bitshuffle"}.get(int(compression.shuffle), "shuffle")
        return {
            "name": "blosc",
            "configuration": {"cname": str(compression.cname), "clevel": int(compression.clevel),
                              "shuffle": shuffle, "blocksize": int(compression.blocksize)},
        }
    return None


def codec_for_array(compression: dict | None, dtype: str) -> dict | None:
    """The array's compression codec document (blosc gets the element size as typesize)."""
    if compression is None:
        return None
    doc = json.loads(json.dumps(compression))
    if doc["name"] == "blosc":
        doc["configuration"]["typesize"] = itemsize(dtype)
    return doc


def numcodecs_encoder(codec: dict):
    """A numcodecs object that encodes exactly like the Zarr codec document ``codec``."""
    import numcodecs

    conf = codec.get("configuration") or {}
    if codec["name"] == "zstd":
        return numcodecs.Zstd(level=int(conf.get("level", 0)), checksum=bool(conf.get("checksum", False)))
    if codec["name"] == "blosc":
        shuffle = {"noshuffle": 0, "shuffle": 1, "bitshuffle": 2}[conf.get("shuffle", "shuffle")]
        return numcodecs.Blosc(cname=conf.get("cname", "lz4"), clevel=int(conf.get("clevel", 5)),
                               shuffle=shuffle, blocksize=int(conf.get("blocksize", 0)))
    raise ArgumentValueError(f"unknown codec {codec['name']!r}")


# ------------------------------------------------------------------------ layout
def chunk_layout(feature_shape: tuple[int, ...], dtype: str, chunk_rows: int | None,
                 shard_bytes: int | None, compressed: bool = False) -> tuple[int, int]:
    """(chunk_rows, chunks per shard) for an array.

    Default (``shard_bytes`` None): a shard is about 64 MiB but at most ``MAX_SHARD_ROWS``
    rows (rounded down to whole chunks, at least one chunk), so the arrays of one capture
    complete shards -- and so let commits through -- at similar row counts whatever their
    row size. Default chunks are about 256 KiB of rows in whole 4 KiB pages where the row
    size allows (shards then map back to back, ``reader._whole_rows``). An explicit
    ``shard_bytes`` is taken as given (no row cap; default chunks no larger than it, so a
    small ``shard_bytes`` commits as often as it says for narrow rows too). Compressed arrays (never mapped) get
    chunks of about ``COMPRESSED_CHUNK_BYTES``: fewer, larger encoder calls.
    """
    row_bytes = max(1, math.prod(feature_shape) * itemsize(dtype))
    if chunk_rows is None:
        target_chunk = COMPRESSED_CHUNK_BYTES if compressed else DEFAULT_CHUNK_BYTES
        if shard_bytes is not None:  # a shard smaller than a default chunk: chunks as small as it
            target_chunk = min(target_chunk, max(1, int(shard_bytes)))
        chunk_rows = max(1, min(MAX_CHUNK_ROWS, target_chunk // row_bytes))
        if shard_bytes is None:
            chunk_rows = min(chunk_rows, MAX_SHARD_ROWS)
        # Whole pages per chunk (so per shard) where possible: shards then map back to back
        # into one contiguous zero-copy view of the whole array (reader._whole_rows).
        page_rows = PAGE_BYTES // math.gcd(row_bytes, PAGE_BYTES)
        if chunk_rows >= page_rows:
            chunk_rows -= chunk_rows % page_rows
    chunk_bytes = chunk_rows * row_bytes
    target = DEFAULT_SHARD_BYTES if shard_bytes is None else shard_bytes
    shard_chunks = max(1, min(MAX_SHARD_CHUNKS, target // chunk_bytes))
    if shard_bytes is None:
        shard_chunks = max(1, min(shard_chunks, MAX_SHARD_ROWS // chunk_rows))
    return int(chunk_rows), int(shard_chunks)


def parse_shard_rows(shard_rows: Any, chunk_rows: int | None) -> dict[str, int] | None:
    """Normalise ``shard_rows=`` (int, or ``{"sample": int, "token": int}``) to a dict per row kind.

    Raises
    ------
    ValueError, TypeError
        Not a positive int (or a dict of them for both kinds), or ``chunk_rows`` does not divide it.
    """
    if shard_rows is None:
        return None
    if isinstance(shard_rows, dict):
        if set(shard_rows) != {"sample", "token"}:
            raise ArgumentValueError(f"shard_rows as a dict must have the keys ['sample', 'token'], got {sorted(shard_rows)!r}")
        out = dict(shard_rows)
    else:
        out = {"sample": shard_rows, "token": shard_rows}
    for kind, n in out.items():
        if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
            raise ArgumentValueError(f"shard_rows[{kind!r}] must be a positive int, got {n!r}")
        if chunk_rows is not None and n % chunk_rows:
            raise ArgumentValueError(f"shard_rows[{kind!r}] must be a multiple of chunk_rows={chunk_rows}, got {n}")
    return out


def chunk_layout_for_shard_rows(feature_shape: tuple[int, ...], dtype: str, shard_rows: int,
                                chunk_rows: int | None, compressed: bool = False) -> tuple[int, int]:
    """(chunk_rows, chunks per shard) for an exact ``shard_rows``: chunks are ``chunk_rows``
    when given (a divisor of ``shard_rows``), else the largest divisor of ``shard_rows`` not
    above the default chunk rows of :func:`chunk_layout`."""
    if chunk_rows is None:
        target, _ = chunk_layout(feature_shape, dtype, None, None, compressed)
        target = max(1, min(target, shard_rows))
        chunk_rows = max(d for d in range(1, target + 1) if shard_rows % d == 0)
    if shard_rows % chunk_rows:
        raise ArgumentValueError(f"shard_rows={shard_rows} must be a multiple of chunk_rows={chunk_rows}")
    return int(chunk_rows), int(shard_rows // chunk_rows)


def shard_key(array_path: str, shard: int, ndim_feature: int) -> str:
    return f"{array_path}/c/{shard}" + "/0" * ndim_feature


def bytes_codec(dtype: str) -> dict:
    if itemsize(dtype) == 1:
        return {"name": "bytes"}
    return {"name": "bytes", "configuration": {"endian": "little"}}


def feature_dimension_names(hook_point: str, ndim: int) -> list[str]:
    """Names of the feature dimensions of a hook point's rows: ``<hook point>.dim<i>``.

    Unique per hook point, so arrays of different widths never share a dimension name (xarray
    merges the arrays of a group into one Dataset and rejects one name with two sizes); a
    reduction with the shape of a row (mean, var, ...) uses the same names, so it lines up
    with its activation array.
    """
    return [f"{hook_point}.dim{i}" for i in range(ndim)]


#: Outputs of built-in reductions that are never per feature, whatever their shape.
NOT_PER_FEATURE_OUTPUTS = {"hist": {"edges"}}


def reduction_dimension_names(hook_point: str, full: str, key: str, kind: str, options: Any,
                              shape: tuple[int, ...], feature_shape: tuple[int, ...] | None,
                              features_of: str | None = None) -> list[str]:
    """Dimension names of the reduction array ``reductions/<node>/<full>`` (output ``key`` of
    a reduction of ``kind`` with ``options``, shape ``shape``).

    The feature names (:func:`feature_dimension_names`) of the array the hook point's rows are
    read from (``features_of``: the target of an alias, which has no array of its own; default
    the hook point) when the output is per feature: its shape is ``feature_shape``, the
    reduction reduces per feature (``per_feature`` not 0) and the output is not one that never
    is (``hist`` ``edges``, ``bins + 1`` values, which may have as many values as there are
    features); otherwise ``<hook point>.<full>.dim<i>``.
    """
    per_feature = bool((options or {}).get("per_feature", 1)) if isinstance(options, dict) else True
    if (feature_shape is not None and tuple(shape) == tuple(feature_shape) and per_feature
            and key not in NOT_PER_FEATURE_OUTPUTS.get(kind, ())):
        return feature_dimension_names(features_of or hook_point, len(shape))
    return [f"{hook_point}.{full}.dim{i}" for i in range(len(shape))]


def dimension_names(hook_point: str, row_kind: str, follows_row_table: bool, ndim_feature: int) -> list[str]:
    """The Zarr ``dimension_names`` of an ``acts/<hook point>`` array.

    The row dimension is the row kind (``"sample"`` or ``"token"``) when row *i* of the array
    is row *i* of that row table, so every such array shares it (and its length); otherwise
    ``<hook point>.rows``. Feature dimensions: :func:`feature_dimension_names`.
    """
    rows = row_kind if follows_row_table else f"{hook_point}.rows"
    return [rows, *feature_dimension_names(hook_point, ndim_feature)]


def array_document(*, n_rows: int, feature_shape: tuple[int, ...], dtype: str, chunk_rows: int,
                   shard_chunks: int, compression: dict | None, attributes: dict,
                   dimension_names: list[str] | None = None) -> dict:
    """The ``zarr.json`` of an ``acts/<hook point>`` array."""
    feat = [int(d) for d in feature_shape]
    feat_chunk = [max(1, d) for d in feat]
    inner = [bytes_codec(dtype)]
    if compression is not None:
        inner.append(compression)
    return {
        "zarr_format": 3,
        "node_type": "array",
        "shape": [int(n_rows), *feat],
        "data_type": zarr_dtype(dtype),
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [chunk_rows * shard_chunks, *feat_chunk]}},
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
        "fill_value": False if dtype == "bool" else ([0.0, 0.0] if dtype.startswith("complex") else 0),
        "codecs": [
            {
                "name": "sharding_indexed",
                "configuration": {
                    "chunk_shape": [chunk_rows, *feat_chunk],
                    "codecs": inner,
                    "index_codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}],
                    "index_location": "end",
                },
            }
        ],
        "attributes": attributes,
        "storage_transformers": [],
        **({"dimension_names": list(dimension_names)} if dimension_names is not None else {}),
    }


def group_document(attributes: dict | None = None) -> dict:
    return {"zarr_format": 3, "node_type": "group", "attributes": attributes or {}}


def dumps(doc: Any) -> bytes:
    """A metadata document as compact JSON (one line: Python's C encoder, about 5x faster than
    its indenting one, which cost 4 ms of the close of a capture of 49 arrays)."""
    return json.dumps(doc, sort_keys=False, allow_nan=False).encode()


def run_of(attrs: Any) -> tuple | None:
    """``(run_id, created)`` of a store's metadata (``created`` tells runs apart in stores
    written before run ids), or None when ``attrs`` is not a metadata dict. A resume keeps
    both; another run written in the store's place changes them."""
    return (attrs.get("run_id"), attrs.get("created")) if isinstance(attrs, dict) else None


def committed_a_forward(attrs: Any) -> bool:
    """Whether a store's metadata (parsed root attributes) list a commit of at least one
    forward (``n_batches``, or samples), in a store of rows and in one that keeps reductions
    only alike."""
    if not isinstance(attrs, dict):
        return False
    return int(attrs.get("n_batches") or 0) > 0 or int(attrs.get("n_samples") or 0) > 0


def settled_replaced(attrs: Any) -> bool:
    """Whether an ``overwrite=True`` that wrote the store of these metadata settled the store it
    replaced as deleted (FORMAT.md section 7): its root lists a committed forward, or it closed
    ``complete``. The delete removes the old store's root document first, at that commit."""
    return committed_a_forward(attrs) or (isinstance(attrs, dict) and attrs.get("status") == "complete")


def listed_keys(attrs: Any) -> list[str]:
    """The manifest keys (FORMAT.md section 5) of the arrays with committed rows and the row
    table parts that a store's metadata (parsed root attributes) list."""
    if not isinstance(attrs, dict):
        return []
    arrays, tables = attrs.get("arrays"), attrs.get("row_tables")
    keys = [str(meta["manifest"]) for meta in (arrays.values() if isinstance(arrays, dict) else ())
            if isinstance(meta, dict) and meta.get("manifest") and int(meta.get("n_rows") or 0) > 0]
    for info in tables.values() if isinstance(tables, dict) else ():
        keys += [str(k) for k in (info.get("parts") or () if isinstance(info, dict) else ())]
    return keys


def utc_now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z")


def check_jsonable(value: Any, what: str) -> Any:
    """Round-trip ``value`` through JSON; a clear error names ``what`` when it cannot."""
    try:
        return json.loads(json.dumps(value, allow_nan=False))
    except (TypeError, ValueError) as e:
        raise ArgumentTypeError(f"{what} must be JSON-serialisable (str, int, float, bool, None, list, dict), got an error: {e}") from None


def crc32c(data: Any, crc: int = 0) -> int:
    """CRC-32C (Castagnoli) of a bytes-like object, continuing ``crc`` (the crc32c of the bytes
    before ``data``: a file's crc32c from its pieces): the native one, else google_crc32c (a
    zarr dependency)."""
    from ..capture import _native

    mod = _native.optional()
    if mod is not None:
        return int(mod.crc32c(data, crc))
    import google_crc32c

    return int(google_crc32c.extend(crc, bytes(data) if not isinstance(data, bytes) else data))


#: Suffix of a committed file a resume keeps while it rewrites the file in place (a partial
#: last shard, a reduction's files), until a root lists the rewrite (FORMAT.md sections 6, 7).
KEPT_SUFFIX = ".committed.tmp"


def _reduction_key(key: Any) -> str | None:
    """``key`` when it is a file key under ``reductions/`` without ``..``; else None (a key
    from a store's metadata is never followed elsewhere)."""
    if isinstance(key, str) and key.startswith("reductions/") and ".." not in key.split("/") and "\\" not in key:
        return key
    return None


def kept_reduction_key(key: str) -> str:
    """Where a resume keeps the committed reduction file ``key`` (``reductions/<node>/...``)
    while it rewrites it: in the hook point's folder, its path below that folder flattened
    (``%`` as ``%25``, ``/`` as ``%2F``) plus :data:`KEPT_SUFFIX`, e.g.
    ``reductions/<node>/mean%2Fc%2F0.committed.tmp``. Outside every array's folder, so an
    array written again with another chunk layout (``c/0`` then ``c``) never finds a kept file
    where it makes a file or a folder."""
    parts = key.split("/", 2)
    if len(parts) < 3:
        return key + KEPT_SUFFIX
    return f"{parts[0]}/{parts[1]}/{parts[2].replace('%', '%25').replace('/', '%2F')}{KEPT_SUFFIX}"


def committed_reduction_groups(reductions: Any, name: str | None = None) -> list[tuple[str | None, dict[str, int]]]:
    """The files the ``reductions`` metadata of a root lists (``{hook point: {key: entry}}``;
    with ``name``, a hook point's ``{key: entry}`` and only reduction ``name``'s), one group
    per result or state array: (its document ``<path>/zarr.json``, ``{file key: crc32c}`` of
    its chunk and, for a result, its script). Keys under ``reductions/`` only; malformed
    parts are left out (the reader refuses them when they are read)."""
    if name is not None:
        reductions = {"": {k: e for k, e in (reductions.items() if isinstance(reductions, dict) else ())
                           if isinstance(e, dict) and e.get("reduction") == name}}
    out = []
    for entries in (reductions.values() if isinstance(reductions, dict) else ()):
        for entry in (entries.values() if isinstance(entries, dict) else ()):
            if not isinstance(entry, dict):
                continue
            states = entry.get("state")
            for arr in [entry] + [st for st in (states.values() if isinstance(states, dict) else ())
                                  if isinstance(st, dict)]:
                path = _reduction_key(arr.get("path"))
                crcs = arr.get("crc32c")
                files = {k: c for k, c in (crcs.items() if isinstance(crcs, dict) else ())
                         if _reduction_key(k) and isinstance(c, int) and not isinstance(c, bool)}
                out.append((None if path is None else path + "/zarr.json", files))
    return out


def kept_reduction_places(reductions: Any) -> set[str]:
    """The keys where a resume of a store whose root lists ``reductions`` (``{hook point:
    {key: entry}}``) may keep a committed reduction file (:func:`kept_reduction_key` of each
    file it lists): the only names a folder or a link in the store's place is refused or
    removed for (a reduction may itself be named ``m.committed.tmp``)."""
    places = set()
    for doc, files in committed_reduction_groups(reductions):
        places.update(kept_reduction_key(k) for k in files)
        if doc is not None:
            places.add(kept_reduction_key(doc))
    return places


def committed_reduction_files(entries: Any, name: str) -> list[str]:
    """Every file of reduction ``name`` that a hook point's ``entries`` (its part of a root's
    ``reductions`` metadata) list: each result's and state's document and chunk, the script."""
    keys: set[str] = set()
    for doc, files in committed_reduction_groups(entries, name):
        keys.update(files)
        if doc is not None:
            keys.add(doc)
    return sorted(keys)


def segment_key(manifest_key: str, first: int) -> str:
    """Key of the manifest segment whose first shard is ``first`` (FORMAT.md section 5): the
    file ``manifest.<first>.json`` next to the manifest ``manifest_key``. Derived, never read
    from a document."""
    return f"{manifest_key.rpartition('/')[0]}/manifest.{int(first)}.json"


def manifest_documents(hook_point: str, chunk_rows: int, shard_rows: int, manifest_key: str,
                       segments: list[dict], records: dict[int, dict], sealable: int,
                       encode: Any = None) -> tuple[bytes, dict[str, bytes], list[dict], list[int]]:
    """The manifest of an array (FORMAT.md section 5) and the segments to write before it.

    Each block of :data:`MANIFEST_SEGMENT_SHARDS` shards of ``records`` that follows the last
    segment (shard 0 on without one) and lies below ``sealable`` is sealed into a new segment,
    in order; the manifest lists ``segments`` (plus the new ones, appended to it) and the
    records left. Without any segment the manifest is the document of format version 1, byte
    for byte.

    Parameters
    ----------
    hook_point, chunk_rows, shard_rows : the array's (``chunk_rows``, ``shard_rows`` in rows).
    manifest_key : str
        The manifest's key (``acts/<node>/manifest.json``); segment keys are derived from it.
    segments : list of dict
        The segments listed so far, ``{"first", "end", "file_bytes", "crc32c"}`` each (not
        changed).
    records : dict
        ``{shard: record}`` of the shards not in a segment, each at or past the last segment's
        ``end``; not changed (the caller drops the sealed ones).
    sealable : int
        Shards ``0 .. sealable - 1`` are full and committed: their records never change again
        (a root already lists their rows), so they may be sealed.
    encode : callable, optional
        ``encode(shard, record) -> str``, the JSON of one record (a cache); default
        ``json.dumps``.

    Returns
    -------
    (manifest bytes, {segment key: bytes} of the new segments, the segments it lists, shards sealed)
    """
    enc = encode or (lambda _s, rec: json.dumps(rec))
    segments = list(segments)
    n = max(1, int(MANIFEST_SEGMENT_SHARDS))
    new: dict[str, bytes] = {}
    sealed: list[int] = []
    end = int(segments[-1]["end"]) if segments else 0
    while end + n <= sealable and all(s in records for s in range(end, end + n)):
        head = json.dumps({"hook_point": hook_point, "first": end, "end": end + n, "shards": []})
        data = (head[:-3] + "[" + ", ".join(enc(s, records[s]) for s in range(end, end + n)) + "]}").encode()
        new[segment_key(manifest_key, end)] = data
        segments.append({"first": end, "end": end + n, "file_bytes": len(data), "crc32c": crc32c(data)})
        sealed += range(end, end + n)
        end += n
    done = set(sealed)
    parts = [enc(s, records[s]) for s in sorted(records) if s not in done]
    head: dict[str, Any] = {"hook_point": hook_point, "chunk_rows": chunk_rows, "shard_rows": shard_rows}
    if segments:
        head["segments"] = segments
    head["shards"] = []
    text = json.dumps(head)
    return (text[:-3] + "[" + ", ".join(parts) + "]}").encode(), new, segments, sealed
