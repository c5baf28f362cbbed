"""Model and data specifications of the command line, loaded: ``--model`` is ``demo``, a
Hugging Face model folder or ``package.module:factory``; ``--data`` is ``demo``, a text file
(one sample per line, optionally ``__label__<tag> text``) or a tensor file (``.npy`` /
``.pt`` / ``.npz`` / ``.safetensors`` of one tensor, samples along dim 0)."""

from __future__ import annotations

import importlib
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import SpecError, one_line, warn_at_caller
from ._text import decode_windows_1252


@dataclass
class LoadedModel:
    """A loaded ``--model``: the module, its tokenizer (None for an import path) and what a
    capture without ``--include`` tracks."""

    model: Any
    tokenizer: Any = None
    name: str = ""
    #: Module names a capture without ``--include`` tracks; None: every module.
    default_include: list[str] | None = None
    #: ``default_include`` in a few words for the user, e.g. ``"encoder.layer.0..5 (the
    #: model's blocks; --include to choose others)"``; "" without a default.
    default_note: str = ""
    #: Why a capture of this model needs ``--include`` (a Hugging Face model folder without a
    #: stack of repeated blocks), said as the error of such a capture; "" when none is needed.
    needs_include: str = ""


def describe_modules(names: list[str]) -> str:
    """Module names in short: runs of numbered siblings as a range, ``encoder.layer.0..5``;
    others as they are, comma separated (``"h.0..1, ln_f"``)."""
    parts: list[str] = []
    run: list[Any] = []  # [prefix, first, last] of the current run of numbered siblings

    def close() -> None:
        if run:
            prefix, first, last = run
            parts.append(f"{prefix}{first}" if first == last else f"{prefix}{first}..{last}")
            run.clear()

    for name in names:
        prefix, _, last = name.rpartition(".")
        prefix = f"{prefix}." if prefix else ""
        if last.isdigit() and str(int(last)) == last:
            if run and run[0] == prefix and run[2] + 1 == int(last):
                run[2] = int(last)
                continue
            close()
            run.extend([prefix, int(last), int(last)])
            continue
        close()
        parts.append(name)
    close()
    return ", ".join(parts)


def hf_default_include(model: Any, spec: str) -> tuple[list[str] | None, str, str]:
    """What a capture of a Hugging Face model without ``--include`` tracks: the blocks of its
    stacks of repeated layers (:func:`~activationscope.capture.hooks.block_modules`), whose
    ``output`` hook points are the residual stream after each block.

    Returns
    -------
    (default_include, default_note, needs_include)
        The block module names and their description; or ``(None, "", message)`` when the
        model has no stack, the message naming ``--include`` and a few module names.
    """
    from ..capture.hooks import block_modules

    blocks = block_modules(model)
    if blocks:
        return blocks, f"{describe_modules(blocks)} (the model's blocks; --include to choose others)", ""
    names = [n for n, _ in model.named_modules() if n]
    shown = ", ".join(repr(n) for n in names[:8]) + (", ..." if len(names) > 8 else "")
    return None, "", (
        f"--model {spec!r} has no stack of repeated blocks (an nn.ModuleList of layers of one class) to track by "
        f"default; pass --include PATTERN with the modules to track (its modules are [{shown}]), or --include '*' "
        "for every module")


def load_model_spec(spec: str) -> LoadedModel:
    """``demo``, a Hugging Face model folder, or ``package.module:factory``.

    Without ``--include`` a capture tracks ``default_include``: for ``demo`` the encoder
    layers and pools, for a Hugging Face model folder the blocks of its stacks of repeated
    layers (:func:`hf_default_include`; a folder whose model has none sets ``needs_include``
    instead), for an import path every module (None). A Hugging Face model is loaded with
    ``config.use_cache = False``: a capture generates nothing, so no key/value cache.

    Raises
    ------
    SpecError
        The spec is none of these, the import fails, or the factory does not give an nn.Module.
    """
    import torch

    from . import demo_assets as demo

    if spec == "demo":
        tokenizer, model = demo.load_model()
        layers = demo.layer_include(model)
        return LoadedModel(model, tokenizer, "all-MiniLM-L6-v2 (demo)", layers,
                           f"{describe_modules(layers)} (the demo's layers and pools; --include to choose others)")
    path = Path(spec)
    looks_like_path = spec.startswith((".", "/", "~")) or os.sep in spec or (os.altsep or os.sep) in spec
    if looks_like_path and ":" not in spec and not path.exists():
        raise SpecError(
            f"--model {spec!r} does not exist: no such folder (expected a Hugging Face model folder with config.json, "
            "'demo', or an import path package.module:factory)"
        )
    if path.exists() and not path.is_dir():
        raise SpecError(f"--model {spec!r} is a file; pass its folder (a Hugging Face model folder with config.json)")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise SpecError(f"--model {spec!r} is a folder without config.json (not a Hugging Face model folder)")
        tokenizer, model = demo.load_model(path, pooled=False)
        config = getattr(model, "config", None)
        if getattr(config, "use_cache", False):
            # a capture generates nothing: without a key/value cache the blocks return their
            # hidden states alone (older transformers return (hidden, cache) tuples otherwise)
            config.use_cache = False
        include, note, needs = hf_default_include(model, spec)
        return LoadedModel(model, tokenizer, str(path), include, note, needs)
    if ":" not in spec:
        raise SpecError(
            f"--model must be 'demo', a Hugging Face model folder or an import path package.module:factory, got {spec!r}"
        )
    module_name, _, attr = spec.partition(":")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001 - any failure of user code at import
        raise SpecError(f"--model {spec!r}: cannot import {module_name!r}: {type(e).__name__}: {e}") from e
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise SpecError(f"--model {spec!r}: module {module_name!r} has no attribute {attr!r}") from None
    if not isinstance(obj, torch.nn.Module):
        if not callable(obj):
            raise SpecError(f"--model {spec!r} must name an nn.Module or a factory returning one, got {type(obj).__name__}")
        try:
            obj = obj()
        except Exception as e:  # noqa: BLE001
            raise SpecError(f"--model {spec!r}: the factory raised {type(e).__name__}: {e}") from e
    if not isinstance(obj, torch.nn.Module):
        raise SpecError(f"--model {spec!r}: the factory must return a torch.nn.Module, got {type(obj).__name__}")
    try:
        obj.eval()
    except Exception as e:  # noqa: BLE001 - a module that refuses eval mode (torch.export's) is no model to run here
        fix = ("a torch.export.export(...).module() refuses train() / eval() (its mode is the one it was exported in), "
               "and calls none of its modules, so only its output could be captured: return the eager model, or "
               "torch.export.unflatten(exported_program) of a model exported in eval mode"
               if isinstance(obj, torch.fx.GraphModule) else "return a model whose eval() works")
        raise SpecError(f"--model {spec!r}: the {type(obj).__name__} the factory returned cannot be put in eval mode "
                        f"({type(e).__name__}: {e}); {fix}") from e
    return LoadedModel(obj, None, spec)


@dataclass
class LoadedData:
    texts: list[str] | None = None
    tensor: Any = None
    labels: list[Any] | None = None
    name: str = ""
    #: Sample id of each text: its 0-based line index in the file (blank lines are skipped
    #: but keep their numbers); None: the samples' positions 0, 1, ...
    sample_ids: list[int] | None = None

    def __len__(self) -> int:
        return len(self.texts) if self.texts is not None else int(self.tensor.shape[0])


def _looks_like_text(path: Path) -> bool:
    """Whether the first 4 KiB of a file decode as UTF-8 without NUL bytes."""
    with open(path, "rb") as f:
        head = f.read(4096)
    if b"\x00" in head:
        return False
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as e:  # a cut multi-byte character at the end is still text
        return e.start >= len(head) - 3
    return True


#: Tensor files (``.npy``, ``.pt``) of at least this many bytes are memory-mapped rather than
#: read whole: a file larger than memory is read as its batches are. A smaller one is read
#: whole, so that a file rewritten while a capture reads it (a truncated mapping would
#: end the process with SIGBUS) cannot touch the capture.
MMAP_MIN_BYTES = 256 << 20


def _mapped(path: Path) -> bool:
    """Whether the tensor file ``path`` is memory-mapped (:data:`MMAP_MIN_BYTES`)."""
    return path.stat().st_size >= MMAP_MIN_BYTES


#: File name suffixes of tables: ``--data`` reads their text column (and label column), never their lines.
TABLE_SUFFIXES = (".csv", ".tsv", ".json", ".jsonl", ".ndjson", ".parquet", ".arrow", ".feather")


def load_data_spec(spec: str, text_column: str | None = None, label_column: str | None = None) -> LoadedData:
    """``demo``, a text file (one sample per line) or a tensor file (.npy / .pt / .npz /
    .safetensors; a ``.pt`` may hold a dict of tensors): a container of one tensor is that
    tensor, one of several is refused naming them (which one is the input cannot be told).

    A text file's samples are its non-blank lines, spaces and tabs at their ends removed
    (other whitespace, such as NEL, U+2028 or a form feed, is kept); each one's sample id
    (``LoadedData.sample_ids``) is its 0-based line index, so blank and whitespace-only lines
    are skipped without renumbering the lines after them (one ``UserWarning`` says how many
    were skipped). Lines end at ``\\n`` (or ``\\r\\n``) only. A text file is read as UTF-8;
    one starting with a byte order mark by that mark (UTF-8, UTF-16 or UTF-32, the mark
    removed); one that is not UTF-8 as Windows-1252 (latin-1 with its punctuation in 0x80-0x9F), when it holds no multi-byte UTF-8 character.

    A ``.npy`` file of :data:`MMAP_MIN_BYTES` or more is memory-mapped (copy-on-write: the
    file is never written), so a file larger than memory is read batch by batch; one stored
    big-endian or in Fortran order is read whole, as the same values in native byte order
    and C order. A large ``.pt`` file of ``torch.save`` (a zip archive) is memory-mapped too.

    Raises
    ------
    SpecError
        Missing or unreadable file, a table (:data:`TABLE_SUFFIXES`: ``.csv``, ``.jsonl``, ...,
        whose lines are not samples), an empty data set, a ``.npy`` file of values that are not
        numbers (strings, dates), or a tensor file without a tensor; a
        text file mixing UTF-8 with other bytes (naming the line and byte offset), one holding
        NUL characters (UTF-16 / UTF-32 without a byte order mark) or a byte order mark
        after its start (naming the line), or badly labelled lines (see ``_parse_text_lines``).
    """
    import torch

    from . import demo_assets as demo

    if spec == "demo" and (text_column is not None or label_column is not None):
        flag = "--text-column" if text_column is not None else "--label-column"
        raise SpecError(f"{flag} names a column of a table --data; --data 'demo' is the demo's labelled sentences: "
                        f"leave {flag} out")
    if spec == "demo":
        texts, labels = demo.load_polarity()
        return LoadedData(texts=texts, labels=labels, name="pang_lee_polarity")
    path = Path(spec)
    if not path.exists():
        raise SpecError(f"--data {spec!r} does not exist")
    suffix = path.suffix.lower()
    if suffix in TABLE_SUFFIXES or (path.is_dir() and (path / "dataset_info.json").is_file()) \
            or (path.is_dir() and (path / "dataset_dict.json").is_file()):
        return _load_table(spec, path, text_column, label_column)
    if text_column is not None or label_column is not None:
        flag = "--text-column" if text_column is not None else "--label-column"
        raise SpecError(f"{flag} names a column of a table (.csv, .tsv, .jsonl, .json, .parquet, .arrow, .feather, "
                        f"or a datasets.save_to_disk folder); --data {spec!r} is none: leave {flag} out")
    if not path.is_file():
        what = ("a folder that is not a datasets.save_to_disk folder (no dataset_info.json)" if path.is_dir()
                else "something that is not a regular file (a device, FIFO or socket)")
        raise SpecError(f"--data {spec!r} must be a file (text, a table, .npy, .pt, .npz or .safetensors) or a "
                        f"datasets.save_to_disk folder, got {what}")
    if suffix == ".npy":
        import numpy as np

        with open(path, "rb") as f:
            magic = f.read(6)
        if not magic:
            raise SpecError(f"--data {spec!r} is empty (0 bytes): save the array with numpy.save")
        if magic != b"\x93NUMPY":
            kind = "a text file" if _looks_like_text(path) else "not a .npy file"
            raise SpecError(
                f"--data {spec!r} is {kind}: a .npy file starts with b'\\x93NUMPY', this one with {magic!r}; "
                "save arrays with numpy.save, or give text (one sample per line) a .txt name"
            )
        try:
            # a large file memory-mapped copy-on-write: a file larger than memory is read as its
            # batches are, and a model writing into its input changes pages in memory, never the file
            array = np.load(path, allow_pickle=False, mmap_mode="c" if _mapped(path) else None)
        except Exception as e:  # noqa: BLE001
            raise SpecError(f"--data {spec!r} is not a readable .npy file: {e}") from e
        if not array.dtype.isnative:  # big-endian data (saved on another machine): the same values, native
            array = array.astype(array.dtype.newbyteorder("="))
        try:
            tensor = torch.from_numpy(np.ascontiguousarray(array))
        except TypeError as e:  # strings, objects, datetimes: no torch dtype
            raise SpecError(f"--data {spec!r} holds {array.dtype} values, which are not numbers torch can take "
                            f"({e}); save a numeric array (e.g. float32) with numpy.save") from None
    elif suffix in (".pt", ".pth"):
        with open(path, "rb") as f:
            head = f.read(4)
        if not head:
            raise SpecError(f"--data {spec!r} is empty (0 bytes): save the tensor with torch.save(tensor, path)")
        if head != b"PK\x03\x04" and head[:1] != b"\x80":  # torch.save: a zip archive (or legacy pickle)
            kind = "a text file" if _looks_like_text(path) else "not a torch file"
            raise SpecError(
                f"--data {spec!r} is {kind}: a file of torch.save starts with b'PK\\x03\\x04' (a zip archive), "
                f"this one with {head!r}; save the tensor with torch.save(tensor, path), or give text (one sample "
                "per line) a .txt name"
            )
        try:
            # a large zip archive is memory-mapped (private pages: the file is never written), as a .npy is
            tensor = torch.load(path, map_location="cpu", weights_only=True,
                                mmap=head == b"PK\x03\x04" and _mapped(path))
        except Exception as e:  # noqa: BLE001
            found = re.search(r"GLOBAL ([\w.]+)", str(e))
            if found:  # a pickled object (a TensorDataset, a custom class): never unpickled, it could run code
                raise SpecError(
                    f"--data {spec!r} holds a pickled {found.group(1)}, which is not loaded (unpickling an object "
                    "can run any code): save its input tensor alone, torch.save(dataset.tensors[0], 'x.pt') for a "
                    "TensorDataset, and give its labels with --labels (torch.save(dataset.tensors[1], "
                    "'y.pt'))") from None
            what = one_line(e) if not isinstance(e, KeyError) else f"{type(e).__name__} {e}"
            raise SpecError(f"--data {spec!r} is not a readable torch file ({what}); save one tensor with "
                            "torch.save(tensor, path)") from e
        if isinstance(tensor, dict) and tensor and all(isinstance(v, torch.Tensor) for v in tensor.values()):
            tensor = _only_tensor(spec, {str(k): v for k, v in tensor.items()}, "torch.save(d['{0}'], 'x.pt')")
        if not isinstance(tensor, torch.Tensor):
            raise SpecError(f"--data {spec!r} must hold one tensor (samples along dim 0), got {type(tensor).__name__}")
    elif suffix == ".npz":
        import numpy as np

        try:
            with np.load(path, allow_pickle=False) as archive:
                arrays = {name: archive[name] for name in archive.files}
        except Exception as e:  # noqa: BLE001
            raise SpecError(f"--data {spec!r} is not a readable .npz file ({one_line(e)}); save arrays with "
                            "numpy.savez") from e
        array = _only_tensor(spec, arrays, "numpy.save('x.npy', np.load(path)['{0}'])")
        if not array.dtype.isnative:
            array = array.astype(array.dtype.newbyteorder("="))
        try:
            tensor = torch.from_numpy(np.ascontiguousarray(array))
        except TypeError as e:
            raise SpecError(f"--data {spec!r} holds {array.dtype} values, which are not numbers torch can take "
                            f"({e}); save a numeric array (e.g. float32)") from None
    elif suffix == ".safetensors":
        try:
            from safetensors.torch import load_file
        except ImportError:
            raise SpecError(f"--data {spec!r} is a safetensors file, which needs the safetensors package: pip "
                            "install safetensors") from None
        try:
            tensors = load_file(str(path), device="cpu")
        except Exception as e:  # noqa: BLE001
            raise SpecError(f"--data {spec!r} is not a readable safetensors file ({one_line(e)})") from e
        tensor = _only_tensor(spec, tensors, "safetensors.torch.save_file({{'x': d['{0}']}}, 'x.safetensors')")
    else:
        raw = _decode_text(spec, path.read_bytes())
        if not any(line.strip() for line in _split_lines(raw)):
            raise SpecError(f"--data {spec!r} has no non-empty lines")
        return _parse_text_lines(spec, raw, path.name)
    if tensor.dim() == 0 or tensor.shape[0] == 0:
        raise SpecError(f"--data {spec!r} must have samples along dim 0, got shape {tuple(tensor.shape)}")
    return LoadedData(tensor=tensor, name=path.name)


def _read_table(spec: str, path: Path, text_name: str = "text") -> Any:
    """The pyarrow table of a table file or a ``datasets.save_to_disk`` folder. Text formats
    (CSV, TSV, JSON lines, JSON) are decoded as ``--data`` text is (:func:`_decode_text`:
    UTF-8, a byte order mark, Windows-1252 without UTF-8 characters); a CSV's ``text_name``
    column is read as strings, also where every value looks like a number."""
    import json

    import pyarrow as pa

    if path.is_dir():
        try:
            import datasets
        except ImportError:
            raise SpecError(f"--data {spec!r} is a datasets.save_to_disk folder, which needs the datasets package: "
                            "pip install datasets") from None
        if (path / "dataset_dict.json").is_file():
            splits = sorted(p.name for p in path.iterdir() if (p / "dataset_info.json").is_file())
            raise SpecError(f"--data {spec!r} is a DatasetDict of splits {splits}: pass one split's folder, e.g. "
                            f"--data {str(path / (splits[0] if splits else 'train'))!r}")
        try:
            return datasets.load_from_disk(str(path)).with_format("arrow")[:]  # (its indices mapping applied)
        except Exception as e:  # noqa: BLE001
            raise SpecError(f"--data {spec!r} is not a readable datasets folder ({one_line(e)})") from e
    suffix = path.suffix.lower()
    try:
        if suffix == ".parquet":
            import pyarrow.parquet as pq
            return pq.read_table(path)
        if suffix in (".arrow", ".feather"):
            import pyarrow.ipc as ipc
            try:
                return ipc.open_file(str(path)).read_all()
            except pa.ArrowInvalid:  # an Arrow IPC stream (as the cache files of datasets)
                with open(path, "rb") as f:
                    return ipc.open_stream(f).read_all()
        text = _decode_text(spec, path.read_bytes())
        if suffix in (".csv", ".tsv"):
            import pyarrow.csv as pcsv
            return pcsv.read_csv(pa.BufferReader(text.encode("utf-8")),
                                 parse_options=pcsv.ParseOptions(delimiter="\t" if suffix == ".tsv" else ",",
                                                                 newlines_in_values=True),
                                 convert_options=pcsv.ConvertOptions(strings_can_be_null=False,
                                                                     column_types={text_name: pa.string()}))
        if suffix == ".json" and text.lstrip().startswith("["):
            rows = json.loads(text)
            if not all(isinstance(r, dict) for r in rows):
                raise SpecError(f"--data {spec!r} is a JSON list, but not of objects (one per sample)")
            return pa.Table.from_pylist(rows)
        import pyarrow.json as pjson
        return pjson.read_json(pa.BufferReader(text.encode("utf-8")))
    except SpecError:
        raise
    except Exception as e:  # noqa: BLE001
        raise SpecError(f"--data {spec!r} is not a readable {suffix} table ({one_line(e)})") from e


def _load_table(spec: str, path: Path, text_column: str | None, label_column: str | None) -> LoadedData:
    """The samples of a table: one per row, its text from ``text_column`` (default ``text``)
    and, when given or present, its label from ``label_column`` (default ``label``); sample
    ids are the row indices. A text that is null, not a string, or blank is refused naming
    its row (a row left out would move the labels of the rows after it), and so is a null
    label."""
    import pyarrow as pa

    table = _read_table(spec, path, "text" if text_column is None else text_column)
    columns = table.column_names
    shown = ", ".join(repr(c) for c in columns[:12]) + (", ..." if len(columns) > 12 else "")
    text_name = "text" if text_column is None else text_column
    if text_name not in columns:
        flag = "--text-column" if text_column is not None else "a text column: --text-column NAME names it"
        raise SpecError(f"--data {spec!r} has no column {text_name!r} ({flag}); its columns are [{shown}]")
    label_name = label_column if label_column is not None else ("label" if "label" in columns else None)
    if label_name is not None and label_name not in columns:
        raise SpecError(f"--label-column {label_name!r} is not a column of --data {spec!r}; its columns are [{shown}]")
    if label_name == text_name:
        raise SpecError(f"--label-column and --text-column both name {text_name!r}: give the label its own column")
    column = table.column(text_name)
    if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
        raise SpecError(f"--data {spec!r}: column {text_name!r} holds {column.type} values, not text; name the text "
                        f"column with --text-column (its columns are [{shown}])")
    texts = column.to_pylist()
    if not texts:
        raise SpecError(f"--data {spec!r} has no rows")
    bad = next((i for i, t in enumerate(texts) if t is None or not t.strip()), None)
    if bad is not None:
        raise SpecError(f"--data {spec!r}: row {bad} (0-based) of column {text_name!r} has "
                        f"{'no text (null)' if texts[bad] is None else 'a blank text'}; remove the row or give it "
                        "a text")
    labels = None
    if label_name is not None:
        labels = table.column(label_name).to_pylist()
        bad = next((i for i, v in enumerate(labels) if v is None), None)
        if bad is not None:
            raise SpecError(f"--data {spec!r}: row {bad} (0-based) of column {label_name!r} has no label (null); "
                            "give it one (-1 is left out of the probes as unlabelled)")
        if any(isinstance(v, (list, dict)) for v in labels):
            raise SpecError(f"--data {spec!r}: column {label_name!r} holds lists or records, not one label per "
                            "sample")
    return LoadedData(texts=texts, labels=labels, name=path.name, sample_ids=list(range(len(texts))))


def _only_tensor(spec: str, tensors: dict[str, Any], save: str) -> Any:
    """The one array / tensor of a ``.npz``, ``.safetensors`` or ``.pt`` dict; several (or
    none) are refused, naming them: which is the input cannot be told, and a label array
    taken for it would be captured without a word. ``save`` shows how to save one alone
    (``{0}``: its name)."""
    if len(tensors) == 1:
        return next(iter(tensors.values()))
    if not tensors:
        raise SpecError(f"--data {spec!r} holds no array")
    names = ", ".join(f"{k!r} {tuple(v.shape)}" for k, v in list(tensors.items())[:8])
    names += ", ..." if len(tensors) > 8 else ""
    first = next(iter(tensors))
    raise SpecError(
        f"--data {spec!r} holds {len(tensors)} arrays ({names}), and --data takes one, samples along dim 0: save "
        f"the model's input alone, e.g. {save.format(first)}, and give labels with --labels")


#: Prefix of a fastText-style label tag: ``__label__<tag> text``.
LABEL_PREFIX = "__label__"

#: What is removed from both ends of a text line (the tag ends at the first of them too):
#: spaces and tabs only; other whitespace (NEL, U+2028, U+2029, form feed, vertical tab) is
#: part of the text.
_SPACES = " \t"

#: Byte order marks of text files and the codec that decodes a file starting with one
#: (UTF-32 before UTF-16: the UTF-32-LE mark starts with the UTF-16-LE one).
_BOMS = ((b"\xef\xbb\xbf", "utf-8-sig"), (b"\xff\xfe\x00\x00", "utf-32"), (b"\x00\x00\xfe\xff", "utf-32"),
         (b"\xff\xfe", "utf-16"), (b"\xfe\xff", "utf-16"))

#: One well-formed multi-byte UTF-8 character (RFC 3629): a file holding one is meant as UTF-8.
_UTF8_MULTIBYTE = re.compile(
    rb"[\xc2-\xdf][\x80-\xbf]|\xe0[\xa0-\xbf][\x80-\xbf]|[\xe1-\xec\xee\xef][\x80-\xbf]{2}"
    rb"|\xed[\x80-\x9f][\x80-\xbf]|\xf0[\x90-\xbf][\x80-\xbf]{2}|[\xf1-\xf3][\x80-\xbf]{3}"
    rb"|\xf4[\x80-\x8f][\x80-\xbf]{2}"
)


def _decode_text(spec: str, data: bytes, flag: str = "--data") -> str:
    """The text of a data file: a file starting with a byte order mark is decoded by it
    (UTF-8, UTF-16 or UTF-32, the mark removed); otherwise as UTF-8, and a file that is not
    UTF-8 as Windows-1252 (:func:`decode_windows_1252`: latin-1, with the punctuation of
    bytes 0x80-0x9F) when it holds no multi-byte UTF-8 character at all (a latin-1 or cp1252
    file, such as gensim's ``pang_lee_polarity.cor``).

    Raises
    ------
    SpecError
        The bytes do not decode by the file's byte order mark; a file not UTF-8 that holds
        UTF-8 characters too (mixed encodings: the message names the line and byte offset
        of the first byte that is not UTF-8); a text holding NUL characters (UTF-16 / UTF-32
        without a byte order mark, or a binary file); a byte order mark after the file's
        start (naming its line).
    """
    fix = "save the file as UTF-8 (e.g. iconv -f <its encoding> -t utf-8)"
    codec = next((c for bom, c in _BOMS if data.startswith(bom)), None)
    if codec is not None:
        try:
            return _no_nul(spec, data.decode(codec), fix, flag)
        except UnicodeDecodeError as e:
            name = codec.replace("-sig", "")
            at = e.start + (3 if codec == "utf-8-sig" else 0)  # utf-8-sig counts after its mark
            raise SpecError(f"{flag} {spec!r} starts with the {name} byte order mark but is not {name} "
                            f"(byte offset {at}: {e.reason}); {fix}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        if b"\x00" not in data and _UTF8_MULTIBYTE.search(data):
            line = data.count(b"\n", 0, e.start) + 1
            raise SpecError(
                f"{flag} {spec!r} mixes encodings: it holds UTF-8 characters, but line {line} (byte offset "
                f"{e.start}) has the byte {data[e.start:e.start + 1]!r}, which is not UTF-8 (Windows-1252 / latin-1 is read only "
                "from a file without UTF-8 characters); write that line's characters in UTF-8"
            ) from None
        text = decode_windows_1252(data)  # NUL bytes: refused just below
    return _no_nul(spec, text, fix, flag)


def _no_nul(spec: str, text: str, fix: str, flag: str = "--data") -> str:
    """``text``, refused when it holds a NUL character or a byte order mark (U+FEFF) after
    its start (the one at byte 0 is removed by the decoding)."""
    at = text.find("\x00")
    if at >= 0:
        line = text.count("\n", 0, at) + 1
        raise SpecError(
            f"{flag} {spec!r} is not a text file of one sample per line: line {line} holds a NUL character "
            f"(UTF-16 or UTF-32 without a byte order mark, or a binary file); {fix}"
        )
    at = text.find("\ufeff")
    if at >= 0:
        line = text.count("\n", 0, at) + 1
        raise SpecError(
            f"{flag} {spec!r}: line {line} holds a byte order mark (U+FEFF) that is not at the start of the file "
            "(files joined with cat keep the marks of the later ones), so it would be part of a text; remove it "
            "(e.g. sed -i 's/\\xef\\xbb\\xbf//g' on a UTF-8 file)"
        )
    return text


def _split_lines(raw: str) -> list[str]:
    """The lines of a text: split at ``\\n`` only (a trailing ``\\r`` is dropped, so CRLF files
    read the same); other line-break characters (U+2028, NEL, form feed, vertical tab) stay
    inside their line, so line numbers are those of ``wc -l`` and editors."""
    lines = raw.split("\n")
    if lines[-1] == "":
        lines.pop()
    return [line[:-1] if line.endswith("\r") else line for line in lines]


def _parse_text_lines(spec: str, raw: str, name: str) -> LoadedData:
    """Samples of a text file, one per non-blank line. When any line starts with a
    ``__label__<tag>`` tag, every non-blank line must: the tags become ``labels`` (the tag
    without its prefix) and never part of a text. ``sample_ids`` are the 0-based line
    indices of the samples; one ``UserWarning`` names how many blank lines were skipped.

    Lines are split at ``\\n`` only (a trailing ``\\r`` dropped), and only spaces and tabs
    are removed from a line's ends (and separate the tag from the text): U+2028, U+2029, NEL,
    form feed or vertical tab, inside a line or at its ends, stay part of its text. A line
    of whitespace only is blank.

    Raises
    ------
    SpecError
        Some lines carry a ``__label__`` tag and others do not (the message names the first
        line without one, 1-based); a line with an empty tag (``__label__ text``); a line
        with a tag and no text (``__label__pos``); a line starting with more than one tag
        (``__label__a __label__b text``: one label per sample).
    """
    all_lines = _split_lines(raw)
    numbered = [(i, line.strip(_SPACES)) for i, line in enumerate(all_lines) if line.strip()]
    ids = [i for i, _ in numbered]
    tagged = [line.startswith(LABEL_PREFIX) for _, line in numbered]
    if any(tagged) and not all(tagged):
        first_tagged = numbered[tagged.index(True)][0] + 1
        first_untagged = numbered[tagged.index(False)][0] + 1
        raise SpecError(
            f"--data {spec!r}: line {first_untagged} has no {LABEL_PREFIX} tag, but line {first_tagged} has one; "
            f"{sum(tagged)} of {len(tagged)} non-blank lines are labelled: give every line a "
            f"'{LABEL_PREFIX}<tag> text' prefix, or remove all tags"
        )
    n_blank = len(all_lines) - len(numbered)
    if n_blank:
        warn_at_caller(
            f"--data {spec!r}: skipped {n_blank} blank line{'s' if n_blank != 1 else ''}; sample ids are line "
            "numbers counted from 0 (blank lines included), so they have gaps", UserWarning)
    if not any(tagged):
        return LoadedData(texts=[line for _, line in numbered], name=name, sample_ids=ids)
    labels, texts = [], []
    for i, line in numbered:
        tag = re.match(r"[^ \t]*", line).group(0)
        rest = line[len(tag):].lstrip(_SPACES)
        text = [rest] if rest.strip() else []  # whitespace only: no text
        if tag == LABEL_PREFIX:
            raise SpecError(f"--data {spec!r}: line {i + 1} has an empty tag {LABEL_PREFIX!r}; write "
                            f"'{LABEL_PREFIX}<tag> text' with a tag, e.g. {LABEL_PREFIX}pos")
        if text and text[0].startswith(LABEL_PREFIX):
            tags = [tag, *(w for w in text[0].split() if w.startswith(LABEL_PREFIX))][:3]
            raise SpecError(
                f"--data {spec!r}: line {i + 1} has more than one label tag ({' '.join(tags)} ...); one label "
                f"per sample is supported: keep one {LABEL_PREFIX} tag per line"
            )
        if not text:
            raise SpecError(f"--data {spec!r}: line {i + 1} has the tag {tag!r} but no text; write "
                            f"'{tag} text' with the sample's text, or remove the line")
        labels.append(tag[len(LABEL_PREFIX):])
        texts.append(text[0])
    return LoadedData(texts=texts, labels=labels, name=name, sample_ids=ids)


_INT_LABEL = re.compile(r"[+-]?[0-9]+")


def load_labels_spec(spec: str, data: str, n_samples: int) -> list[Any]:
    """``--labels FILE``: one label per sample of tensor data, the i-th for the data's i-th
    sample. ``FILE`` is a ``.npy`` or ``.pt`` file of one 1-D array / tensor (integers,
    floats, bools or, for ``.npy``, strings), or a text file of one label per line (read as
    ``--data`` text is: UTF-8, a byte order mark honoured, spaces and tabs at the ends
    removed). A text file whose every line is an integer gives integer labels (``-1`` and
    ``-100`` then mark unlabelled samples); any other, string labels.

    Raises
    ------
    SpecError
        A missing or unreadable file, one that is not 1-D, a text file with a blank line
        (which sample it labels would be unclear), or a label count other than
        ``n_samples``, the samples of ``data`` (the labels would not line up with the rows).
    """
    import numpy as np
    import torch

    path = Path(spec)
    if not path.is_file():
        raise SpecError(f"--labels {spec!r} does not exist" if not path.exists()
                        else f"--labels {spec!r} must be a file (.npy, .pt, or text with one label per line)")
    suffix = path.suffix.lower()
    if suffix == ".npy":
        try:
            values = np.load(path, allow_pickle=False)
        except Exception as e:  # noqa: BLE001
            raise SpecError(f"--labels {spec!r} is not a readable .npy file ({one_line(e)}); save the labels "
                            "with numpy.save") from e
        shape, kind = tuple(values.shape), values.dtype.kind
        if kind not in "biufU":
            raise SpecError(f"--labels {spec!r} holds {values.dtype} values; save integers, floats, bools or "
                            "strings")
    elif suffix in (".pt", ".pth"):
        try:
            values = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001
            raise SpecError(f"--labels {spec!r} is not a readable torch file ({one_line(e)}); save one tensor "
                            "with torch.save(labels, path)") from e
        if not isinstance(values, torch.Tensor) or values.dtype.is_complex:
            raise SpecError(f"--labels {spec!r} must hold one tensor of labels, got "
                            f"{type(values).__name__ if not isinstance(values, torch.Tensor) else values.dtype}")
        shape = tuple(values.shape)
        values = values.detach().float().numpy() if values.dtype in (torch.float16, torch.bfloat16) \
            else values.detach().numpy()
    else:
        lines = _split_lines(_decode_text(spec, path.read_bytes(), "--labels"))
        blank = next((i for i, line in enumerate(lines) if not line.strip(_SPACES)), None)
        if blank is not None:
            raise SpecError(f"--labels {spec!r}: line {blank + 1} is blank; write one label per line, line i "
                            f"for sample i of --data {data!r} (an empty string labels nothing)")
        stripped = [line.strip(_SPACES) for line in lines]
        if stripped and all(_INT_LABEL.fullmatch(v) for v in stripped):
            # a file of integers is integer labels (so -1 and -100 mark unlabelled samples, as
            # the docs say, and classes compare as the numbers they are), not strings
            big = next((i for i, v in enumerate(stripped) if not -2**63 <= int(v) < 2**63), None)
            if big is not None:
                raise SpecError(f"--labels {spec!r}: line {big + 1} holds the integer {stripped[big]}, which does "
                                "not fit a 64-bit integer label; write smaller class numbers (or give every label a "
                                "name that is not a number, for string labels)")
            values = np.array([int(v) for v in stripped], dtype=np.int64)
        else:
            values = np.array(stripped, dtype=str)
        shape = (len(lines),)
    if len(shape) != 1:
        raise SpecError(f"--labels {spec!r} must be 1-D, one label per sample, got shape {shape}")
    if shape[0] != n_samples:
        raise SpecError(
            f"--labels {spec!r} has {shape[0]} labels, but --data {data!r} has {n_samples} samples: label i is "
            "sample i's, so the counts must be equal (nothing was written)")
    return values.tolist()
