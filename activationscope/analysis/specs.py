"""Model and data specifications of the command line, loaded: ``--model`` is ``demo``, a
Hugging Face model folder or ``package.module:factory``; ``--data`` is ``demo``, a text file
(one sample per line, optionally ``__label__<tag> text``) or a tensor file (``.npy`` /
``.pt``, samples along dim 0)."""

from __future__ import annotations

import importlib
import os
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import SpecError, one_line


@dataclass
class LoadedModel:
    model: Any
    tokenizer: Any = None
    name: str = ""
    default_include: list[str] | None = None


def load_model_spec(spec: str) -> LoadedModel:
    """``demo``, a Hugging Face model folder, or ``package.module:factory``.

    Raises
    ------
    SpecError
        The spec is none of these, the import fails, or the factory does not give an nn.Module.
    """
    import torch

    from . import demo_assets as demo

    if spec == "demo":
        tokenizer, model = demo.load_model()
        return LoadedModel(model, tokenizer, "all-MiniLM-L6-v2 (demo)", demo.layer_include(model))
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
        return LoadedModel(model, tokenizer, str(path))
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
    obj.eval()
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


def load_data_spec(spec: str) -> LoadedData:
    """``demo``, a text file (one sample per line) or a tensor file (.npy / .pt).

    A text file's samples are its non-blank lines, stripped; each one's sample id
    (``LoadedData.sample_ids``) is its 0-based line index, so blank and whitespace-only lines
    are skipped without renumbering the lines after them (one ``UserWarning`` says how many
    were skipped).

    Raises
    ------
    SpecError
        Missing or unreadable file, an empty data set, or a tensor file without a tensor.
    """
    import torch

    from . import demo_assets as demo

    if spec == "demo":
        texts, labels = demo.load_polarity()
        return LoadedData(texts=texts, labels=labels, name="pang_lee_polarity")
    path = Path(spec)
    if not path.exists():
        raise SpecError(f"--data {spec!r} does not exist")
    if not path.is_file():
        raise SpecError(f"--data {spec!r} must be a file (text, .npy or .pt), got a folder")
    suffix = path.suffix.lower()
    if suffix == ".npy":
        import numpy as np

        with open(path, "rb") as f:
            magic = f.read(6)
        if magic != b"\x93NUMPY":
            kind = "a text file" if _looks_like_text(path) else "not a .npy file"
            raise SpecError(
                f"--data {spec!r} is {kind}: a .npy file starts with b'\\x93NUMPY', this one with {magic!r}; "
                "save arrays with numpy.save, or give text (one sample per line) a .txt name"
            )
        try:
            array = np.load(path, allow_pickle=False)
        except Exception as e:  # noqa: BLE001
            raise SpecError(f"--data {spec!r} is not a readable .npy file: {e}") from e
        tensor = torch.from_numpy(np.ascontiguousarray(array))
    elif suffix in (".pt", ".pth"):
        with open(path, "rb") as f:
            head = f.read(4)
        if head != b"PK\x03\x04" and head[:1] != b"\x80":  # torch.save: a zip archive (or legacy pickle)
            kind = "a text file" if _looks_like_text(path) else "not a torch file"
            raise SpecError(
                f"--data {spec!r} is {kind}: a file of torch.save starts with b'PK\\x03\\x04' (a zip archive), "
                f"this one with {head!r}; save the tensor with torch.save(tensor, path), or give text (one sample "
                "per line) a .txt name"
            )
        try:
            tensor = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001
            what = one_line(e) if not isinstance(e, KeyError) else f"{type(e).__name__} {e}"
            raise SpecError(f"--data {spec!r} is not a readable torch file ({what}); save one tensor with "
                            "torch.save(tensor, path)") from e
        if not isinstance(tensor, torch.Tensor):
            raise SpecError(f"--data {spec!r} must hold one tensor (samples along dim 0), got {type(tensor).__name__}")
    else:
        try:
            raw = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raw = path.read_text(encoding="latin-1")
        lines = [line.strip() for line in raw.splitlines() if line.strip()]
        if not lines:
            raise SpecError(f"--data {spec!r} has no non-empty lines")
        return _parse_text_lines(spec, raw, path.name)
    if tensor.dim() == 0 or tensor.shape[0] == 0:
        raise SpecError(f"--data {spec!r} must have samples along dim 0, got shape {tuple(tensor.shape)}")
    return LoadedData(tensor=tensor, name=path.name)


#: Prefix of a fastText-style label tag: ``__label__<tag> text``.
LABEL_PREFIX = "__label__"


def _parse_text_lines(spec: str, raw: str, name: str) -> LoadedData:
    """Samples of a text file, one per non-blank line. When any line starts with a
    ``__label__<tag>`` tag, every non-blank line must: the tags become ``labels`` (the tag
    without its prefix) and never part of a text. ``sample_ids`` are the 0-based line
    indices of the samples; one ``UserWarning`` names how many blank lines were skipped.

    Raises
    ------
    SpecError
        Some lines carry a ``__label__`` tag and others do not (the message names the first
        line without one, 1-based).
    """
    all_lines = raw.splitlines()
    numbered = [(i, line.strip()) for i, line in enumerate(all_lines) if line.strip()]
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
        warnings.warn(
            f"--data {spec!r}: skipped {n_blank} blank line{'s' if n_blank != 1 else ''}; sample ids are line "
            "numbers counted from 0 (blank lines included), so they have gaps", UserWarning, stacklevel=3)
    if not any(tagged):
        return LoadedData(texts=[line for _, line in numbered], name=name, sample_ids=ids)
    labels, texts = [], []
    for _, line in numbered:
        tag, *text = line.split(maxsplit=1)
        labels.append(tag[len(LABEL_PREFIX):])
        texts.append(text[0] if text else "")
    return LoadedData(texts=texts, labels=labels, name=name, sample_ids=ids)
